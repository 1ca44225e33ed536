"""Tuning by measurement (teraio.harness.tune): a sweep measures a baseline's candidate
settings before its trials, keeps the fastest that ran, records them all, and every trial
and a resumed sweep reuse the record.

The worker is a script (the sweep's ``TERAIO_WORKER_CMD`` test hook) whose tokens/s per
micro-batch is known, so that no candidate trains.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.load import load_sweep
from teraio import systems
from teraio.config import run_config_from_dict
from teraio.harness import tune
from baselines import zero

REPO = Path(__file__).resolve().parents[1]

# Candidates (their job dirs are under <sweep dir>/tuning/) answer with $FAKE_SPEEDS[micro-batch]
# tokens/s, or "oom"; a trial answers with the tokens/s of the micro-batch it was given,
# unless $FAKE_TRIALS says "oom" for its trial.
WORKER = '''
import json, os, sys
from pathlib import Path
from teraio.config import load_run_config
from teraio.result import Measurements, result_row, write_result
resolved = Path(sys.argv[1])
cfg = load_run_config(resolved)
with open(resolved.parent / "calls", "a") as f:
    f.write("call\\n")
mb = cfg.system.options.get("micro_batch_size")
speed = json.loads(os.environ["FAKE_SPEEDS"])[str(mb)]
if "tuning" not in resolved.parts:
    speed = json.loads(os.environ["FAKE_TRIALS"]).get(str(cfg.trial), speed)
if speed == "oom":
    row = result_row(cfg.point(), cfg.to_dict(), status="oom", error="torch.OutOfMemoryError: scripted")
else:
    steps = cfg.workload.measure_steps
    row = result_row(cfg.point(), cfg.to_dict(), Measurements(extras={"zero_micro_batch_size": mb}, iterations=[
        {"step": s, "seconds": 256 / speed, "tokens": 256, "tokens_per_s": float(speed), "loss": 1.0}
        for s in range(steps)]), status="ok")
from teraio.harness.tune import row_tuning
result = {**row, **row_tuning(resolved.parent)}
write_result(resolved.parent / "result.json", result)
'''
SPEEDS = {"4": "oom", "2": 300.0, "1": 100.0}


def sweep(runs: Path, worker: Path, trial: str, trials_plan: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "FAKE_SPEEDS": json.dumps(SPEEDS), "FAKE_TRIALS": json.dumps(trials_plan),
           "TERAIO_WORKER_CMD": f"{sys.executable} {worker}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "teraio.sweep", "+experiment=smoke", "system=zero_offload", f"trial={trial}",
           f"sweep.runs_dir={runs}", "sweep.analyze=false", "sweep.tune.max_candidates=null",
           "hardware.gpu_capacity_bytes=null"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def candidate_calls(runs: Path) -> dict[str, int]:
    return {p.parent.name: len(p.read_text().splitlines())
            for p in sorted((runs / "smoke" / "tuning").glob("*/c*/calls"))}


def row(runs: Path, trial: int) -> dict:
    return json.loads((runs / "smoke" / f"llama3_tiny-zero_offload-cpu_ci-bs4-mb2-seq64-t{trial}"
                       / "result.json").read_text())


def test_the_fastest_candidate_that_ran_is_chosen_recorded_and_reused(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    runs = tmp_path / "runs"

    p = sweep(runs, worker, "0", {})
    assert p.returncode == 0, p.stdout + p.stderr
    (record_file,) = (runs / "smoke" / "tuning").glob("*.json")
    record = json.loads(record_file.read_text())
    # Largest micro-batch first: 4 (oom), 2 (300 tokens/s), 1 (100 tokens/s).
    assert [(c["setting"], c["status"], c["tokens_per_s"]) for c in record["candidates"]] == [
        ({"micro_batch_size": 4}, "oom", None), ({"micro_batch_size": 2}, "ok", 300.0),
        ({"micro_batch_size": 1}, "ok", 100.0)]
    assert "scripted" in record["candidates"][0]["message"]
    assert record["chosen"] == {"micro_batch_size": 2}
    assert record["key"]["tune"] == {"warmup_steps": 1, "measure_steps": 1, "max_candidates": None}
    assert candidate_calls(runs) == {"c0": 1, "c1": 1, "c2": 1}

    r0 = row(runs, 0)
    assert r0["status"] == "ok"
    assert r0["tuning"] == {"file": f"tuning/{record_file.name}", "chosen": {"micro_batch_size": 2},
                            "candidates": record["candidates"]}
    assert r0["zero_micro_batch_size"] == 2 and r0["config"]["system"]["options"]["micro_batch_size"] == 2
    assert r0["config"]["workload"]["measure_steps"] == 3  # the trial's own steps, not the candidates'

    # A second trial, which fails, reuses the record without tuning again.
    p = sweep(runs, worker, "1", {"1": "oom"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert candidate_calls(runs) == {"c0": 1, "c1": 1, "c2": 1}
    r1 = row(runs, 1)
    assert r1["status"] == "oom" and r1["tuning"]["chosen"] == {"micro_batch_size": 2}

    # The resumed sweep reruns the failed trial only, with the recorded setting.
    p = sweep(runs, worker, "0,1", {})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "skip (ok)\n" in p.stdout and "made with a different" not in p.stdout
    assert candidate_calls(runs) == {"c0": 1, "c1": 1, "c2": 1}
    r1 = row(runs, 1)
    assert r1["status"] == "ok" and r1["tuning"]["chosen"] == {"micro_batch_size": 2}
    assert r1["tuning"]["file"] == f"tuning/{record_file.name}"
    assert r1["tokens_per_s"] == 300.0
    # The candidates' rows (under tuning/) are in the record, not runs of the sweep.
    assert len(list((runs / "smoke" / "tuning").rglob("result.json"))) == 3
    assert sorted(load_sweep(runs / "smoke").runs["trial"]) == [0, 1]


def test_a_record_made_for_another_config_is_kept_and_the_point_tuned_again(tmp_path):
    run = run_config_from_dict({"model": {"name": "m"}, "system": {"name": "zero_offload"},
                                "workload": {"batch_size": 2, "micro_batch_size": 1}})
    settings = tune.TuneSettings(enabled=True)
    launched = []

    def launch(crun, cdir, resolved):
        launched.append(crun.system.options["micro_batch_size"])
        mb = crun.system.options["micro_batch_size"]
        (cdir / "result.json").write_text(json.dumps({"status": "ok", "tokens_per_s": 10.0 * mb}))
        return 0, []

    tuned, tuning = tune.tuned_run(run, tmp_path, settings, launch, say=lambda s: None)
    assert launched == [2, 1] and tuning["chosen"] == {"micro_batch_size": 2}
    assert tuned.system.options["micro_batch_size"] == 2 and tuned.workload.measure_steps == 3
    tune.tuned_run(run, tmp_path, settings, launch, say=lambda s: None)
    assert launched == [2, 1]  # read, not tuned again
    tune.tuned_run(run, tmp_path, tune.TuneSettings(enabled=True, measure_steps=3), launch, say=lambda s: None)
    assert launched == [2, 1, 2, 1]
    assert sorted(p.name for p in (tmp_path / "tuning").glob("*.json")) == [
        "m-zero_offload-cpu-bs2-mb1-seq64.1.json", "m-zero_offload-cpu-bs2-mb1-seq64.json"]
    # A system that does not opt in, or tuning off: untouched.
    ideal = run_config_from_dict({"model": {"name": "m"}, "system": {"name": "ideal"}})
    assert tune.tuned_run(ideal, tmp_path, settings, launch) == (ideal, None)
    assert tune.tuned_run(run, tmp_path, tune.TuneSettings(), launch) == (run, None)


def test_a_candidate_the_options_check_refuses_is_a_recorded_failure(tmp_path):
    run = run_config_from_dict({"model": {"name": "m"}, "system": {"name": "zero_offload"},
                                "workload": {"batch_size": 2, "micro_batch_size": 1}})
    entry = tune._measure(run, {"micro_batch_size": 0}, tmp_path / "c0", tune.TuneSettings(enabled=True),
                          launch=lambda *a: pytest.fail("launched a refused candidate"))
    assert entry["status"] == "error" and "refused: system.options.micro_batch_size=0" in entry["message"]


def test_tune_settings_name_a_bad_key_or_value():
    for d, match in (({"enabled": True, "steps": 2}, r"sweep.tune: unknown key\(s\) \['steps'\]"),
                     ({"measure_steps": 0}, r"sweep.tune.measure_steps=0; must be an int >= 1"),
                     ({"max_candidates": 0}, r"sweep.tune.max_candidates=0"),
                     ({"timeout_s": -1}, r"sweep.tune.timeout_s=-1")):
        with pytest.raises(ValueError, match=match):
            tune.tune_settings(d)


def test_zero_candidates_are_the_divisors_of_the_batch_the_capacity_admits():
    def cfg(system, cap):
        return run_config_from_dict({"model": {"name": "m", "dim": 64, "n_layers": 2, "n_heads": 4,
                                               "vocab_size": 512, "multiple_of": 32},
                                     "system": {"name": system}, "hardware": {"gpu_capacity_bytes": cap},
                                     "workload": {"batch_size": 8, "micro_batch_size": 2, "seq_len": 64}})
    assert zero.micro_batch_candidates(cfg("zero_offload", None)) == [8, 4, 2, 1]
    from teraio.workload.models import build_meta_model, ffn_hidden, micro_batch_bytes
    c = cfg("zero_offload", None)
    two = micro_batch_bytes(c.model, ffn_hidden(build_meta_model(c.model, 64)), 2, 64, 2)
    assert zero.micro_batch_candidates(cfg("zero_offload", two)) == [2, 1]
    assert zero.micro_batch_candidates(cfg("zero_offload", 1)) == [1]  # none fits: its failure is measured
    inf = zero.tuning_candidates(cfg("zero_infinity", two))
    assert {c["micro_batch_size"] for c in inf} == {2, 1}
    assert {c["prefetch_bucket_size"] for c in inf} == {None, 0}  # prefetch on (DeepSpeed's default) and off
    for c in inf:
        zero.resolve_options("zero_infinity", c)
    assert systems.get("zero_offload").tuner == systems.get("zero_infinity").tuner == \
        "baselines.zero:tuning_candidates"


def test_the_users_baselines_are_tuned_over_the_divisors_of_the_points_micro_batch():
    from baselines import ideal_ac, torchao_offload
    from teraio.workload.models import build_meta_model, ffn_hidden, micro_batch_bytes

    def cfg(system, cap):
        return run_config_from_dict({"model": {"name": "m", "dim": 64, "n_layers": 2, "n_heads": 4,
                                               "vocab_size": 512, "multiple_of": 32},
                                     "system": {"name": system}, "hardware": {"gpu_capacity_bytes": cap},
                                     "workload": {"batch_size": 16, "micro_batch_size": 4, "seq_len": 64}})
    c = cfg("torchao_offload", None)
    two = micro_batch_bytes(c.model, ffn_hidden(build_meta_model(c.model, 64)), 2, 64, 2)
    # torchao keeps activations on the device: only the micro-batches whose estimate fits
    assert torchao_offload.tuning_candidates(c) == [{"micro_batch_size": m} for m in (4, 2, 1)]
    assert torchao_offload.tuning_candidates(cfg("torchao_offload", two)) == [{"micro_batch_size": m} for m in (2, 1)]
    assert torchao_offload.tuning_candidates(cfg("torchao_offload", 1)) == [{"micro_batch_size": 1}]
    # checkpointed blocks: the two largest micro-batches whatever the cap, selective before full
    assert ideal_ac.tuning_candidates(cfg("ideal_ac", 1)) == [
        {"mode": "selective", "micro_batch_size": 4}, {"mode": "full", "micro_batch_size": 4},
        {"mode": "selective", "micro_batch_size": 2}, {"mode": "full", "micro_batch_size": 2}]
    for system, module in (("torchao_offload", torchao_offload), ("ideal_ac", ideal_ac)):
        assert systems.get(system).tuner == f"baselines.{system}:tuning_candidates"
        for setting in module.tuning_candidates(cfg(system, two)):
            module.resolve_options(system, setting)  # every candidate is a valid setting


# A TeraIO worker whose plan is scripted: with recompute "auto", trial 0 keeps the plan that
# recomputes and any other trial the one that does not (the flip a noisy profile can make);
# with "on" or "off" the plan follows the option.
TERAIO_WORKER = '''
import json, sys
from pathlib import Path
from teraio.config import load_run_config
from teraio.result import Measurements, result_row, write_result
from teraio.harness.tune import row_tuning
resolved = Path(sys.argv[1])
cfg = load_run_config(resolved)
with open(resolved.parent / "calls", "a") as f:
    f.write(json.dumps(cfg.system.options) + "\\n")
mode = cfg.system.options["recompute"]
on = mode == "on" or (mode == "auto" and cfg.trial == 0)
plan = {"recomputes": 3 if on else 0, "host_arena": cfg.trial == 0 if cfg.system.options["host_arena"] == "auto"
        else cfg.system.options["host_arena"]}
row = result_row(cfg.point(), cfg.to_dict(), Measurements(extras={"plan": plan}, iterations=[
    {"step": 3, "seconds": 1.0, "tokens": 256, "tokens_per_s": 256.0, "loss": 1.0}]), status="ok")
write_result(resolved.parent / "result.json", {**row, **row_tuning(resolved.parent)})
'''


def test_a_teraio_point_is_decided_by_its_first_trial_and_every_other_trial_runs_that_choice(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(TERAIO_WORKER)
    runs = tmp_path / "runs"

    def sweep_teraio(trials: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "TERAIO_WORKER_CMD": f"{sys.executable} {worker}",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "teraio.sweep", "+experiment=smoke", "system=teraio_mixed", f"trial={trials}",
               f"sweep.runs_dir={runs}", "sweep.analyze=false"]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)

    def job(trial: int) -> Path:
        return runs / "smoke" / f"llama3_tiny-teraio_mixed-cpu_ci-bs4-mb2-seq64-t{trial}"

    p = sweep_teraio("0")
    assert p.returncode == 0, p.stdout + p.stderr
    (record_file,) = (runs / "smoke" / "tuning").glob("*.json")
    record = json.loads(record_file.read_text())
    assert (record["chosen"], record["workload"], record["decided_by"]) == (
        {"recompute": "on", "host_arena": True}, {}, job(0).name)
    r0 = json.loads((job(0) / "result.json").read_text())
    assert r0["tuning"] == {"file": f"tuning/{record_file.name}", "decides": ["recompute", "host_arena"]}

    p = sweep_teraio("1,2")
    assert p.returncode == 0, p.stdout + p.stderr
    for t in (1, 2):
        r = json.loads((job(t) / "result.json").read_text())
        assert r["plan"] == {"recomputes": 3, "host_arena": True}  # the first trial's choice, not its own
        assert r["config"]["system"]["options"]["recompute"] == "on"
        assert r["tuning"] == {"file": f"tuning/{record_file.name}", "chosen": record["chosen"], "workload": {},
                               "decided_by": job(0).name}
    # A resumed sweep reads every row as made with the point's config and runs nothing again.
    p = sweep_teraio("0,1,2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("skip (ok)") == 3 and "made with a different" not in p.stdout
    assert [len((job(t) / "calls").read_text().splitlines()) for t in (0, 1, 2)] == [1, 1, 1]


def test_a_decision_comes_from_an_ok_row_only_and_is_made_again_for_another_config(tmp_path):
    def run(trial=0, **options):
        return run_config_from_dict({"model": {"name": "m"}, "system": {"name": "teraio_ssd", "options": options},
                                     "workload": {"batch_size": 4, "micro_batch_size": "auto", "warmup_steps": 4},
                                     "trial": trial})
    said = []
    # nothing to decide: every choice given
    given = run(recompute="off", host_arena=False)
    given = dataclasses.replace(given, workload=dataclasses.replace(given.workload, micro_batch_size=2))
    with tune.decided(given, tmp_path, tmp_path / "j", say=said.append) as (r, tuning):
        assert r is given and tuning is None
    # a deciding trial that fails leaves no record: the next trial decides
    for trial, status in ((0, "error"), (1, "ok")):
        job = tmp_path / f"t{trial}"
        job.mkdir()
        with tune.decided(run(trial), tmp_path, job, say=said.append) as (r, tuning):
            assert tuning["decides"] == ["recompute", "host_arena", "workload.micro_batch_size"]
            (job / "result.json").write_text(json.dumps({"status": status, "plan": {"recomputes": 0, "host_arena": False},
                                                         "micro_batch": {"chosen": 2}}))
        assert (tmp_path / "tuning").exists() and len(list((tmp_path / "tuning").glob("*.json"))) == (status == "ok")
    with tune.decided(run(2), tmp_path, tmp_path / "t2", say=said.append) as (r, tuning):
        assert (r.system.options["recompute"], r.system.options["host_arena"], r.workload.micro_batch_size) == \
            ("off", False, 2)
        assert tuning["decided_by"] == "t1"
    # another config (the seed): the record is kept aside and the point decided again
    other = dataclasses.replace(run(2), seed=7)
    with tune.decided(other, tmp_path, tmp_path / "t2", say=said.append) as (r, tuning):
        assert "decides" in tuning
    assert any("kept as" in s for s in said)
