"""The reference grown call by call: its list (benchmarks/reference.yaml) and its rows' logic
(teraio.harness.reference), the packing of a call's folders (teraio.harness.rowpack) and the
device script's control of its budget (benchmarks/reference.sh), on the CPU."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from teraio.harness import reference as ref
from teraio.harness import rowpack
from teraio.result import result_row, write_result

REPO = Path(__file__).resolve().parents[1]
POINT = {"model": "m", "hardware": "h200", "batch_size": 4, "micro_batch_size": 1, "seq_len": 64}


def test_the_list_names_its_points_in_the_issues_order():
    """a: the baselines at fig7_h200's seq_short cuts and `full`; b: the Llama3-70B cut at the
    paper's 70B sequences; c: fig9_h200's host caps and Ideal at their point; d (held): TeraIO
    at a's points. Each chunk composes to one point of its experiment."""
    listed = ref.load_list()
    assert [c.part for c in listed.chunks] == sorted(c.part for c in listed.chunks) and listed.held == ("d",)
    shapes = {}
    for c in listed.chunks:
        p = ref.composed_point(c)
        shapes.setdefault(c.part, set()).add((p["model"], p["batch_size"], p["micro_batch_size"], p["seq_len"],
                                              p["hardware"]))
    assert shapes["a"] == shapes["d"] == {("llama3_8b_4l", 16, 8, 1536, "h200"), ("granite_8b_8l", 16, 4, 2560, "h200"),
                                          ("llama3_8b", 4, 1, 2048, "h200")}
    assert {s[3] for s in shapes["b"]} == {2048, 3072, 4096} and {s[0] for s in shapes["b"]} == {"llama3_70b_2l"}
    assert shapes["c"] == {("llama3_8b_4l", 8, 2, 3072, h) for h in
                           ("h200", "h200-1ssd-4gb", "h200-1ssd-8gb", "h200-1ssd-16gb", "h200-1ssd-32gb")}
    systems = lambda part: {s for c in listed.chunks if c.part == part for s in c.systems}  # noqa: E731
    assert systems("a") == {"ideal", "zero_offload", "zero_infinity", "torchao_offload", "ideal_ac", "fsdp_offload"}
    assert systems("b") == {"ideal", "zero_offload", "zero_infinity", "teraio_ssd", "teraio_mixed"}
    assert systems("d") == {"teraio_ssd", "teraio_mixed"}
    assert {c.trials for c in listed.chunks} == {(0, 1, 2)}
    # every b point has the paper's five systems
    for point in ("bs_mid", "seq_short", "seq_long"):
        assert {s for c in listed.chunks if c.point == (f"fig7.point={point}",) for s in c.systems} == systems("b")


def write_list(tmp_path: Path, **changes) -> Path:
    d = {"held": [], "trials": [0, 1], "full_run_s": 400,
         "chunks": [{"part": "a", "experiment": "fig7_h200", "sweep": "s", "point": ["model=llama3_8b_4l"],
                     "systems": ["ideal", "zero_offload"]},
                    {"part": "b", "experiment": "fig7_h200", "sweep": "s", "point": ["model=granite_8b_8l"],
                     "systems": ["teraio_mixed"], "overrides": ["workload.measure_steps=2"]}]}
    for key, value in changes.items():
        if key.startswith("chunk_"):
            d["chunks"][0][key[len("chunk_"):]] = value
        else:
            d[key] = value
    path = tmp_path / "list.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.mark.parametrize("change, message", [
    ({"chunk_experiment": "fig8"}, r"chunks\[0\].experiment='fig8': no such experiment; valid: \[.*'fig7_h200'"),
    ({"chunk_systems": ["ideal", "zero"]}, r"chunks\[0\].systems=.*unknown \['zero'\]; valid:"),
    ({"chunk_point": ["model llama3_8b_4l"]}, r"chunks\[0\].point=.*KEY=VALUE"),
    ({"chunk_trials": [-1]}, r"chunks\[0\].trials=\[-1\]"),
    ({"chunk_sweep": "a/b"}, r"chunks\[0\].sweep='a/b': must be a folder name"),
    ({"chunk_cost": 1}, r"chunks\[0\]=.*valid keys"),
    ({"held": ["z"]}, r"held=\['z'\]: must be a list of the chunks' parts \['a', 'b'\]"),
    ({"full_run_s": 0}, r"full_run_s=0"),
    ({"trials": []}, r"trials=\[\]"),
])
def test_a_bad_list_is_refused_naming_the_value_and_what_is_valid(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        ref.load_list(write_list(tmp_path, **change))


def test_a_system_listed_twice_at_one_point_is_refused(tmp_path):
    path = write_list(tmp_path)
    d = yaml.safe_load(path.read_text())
    d["chunks"].append({**d["chunks"][0], "systems": ["zero_offload"], "overrides": ["workload.measure_steps=1"]})
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(ValueError, match=r"chunks\[2\] and chunks\[0\] both run zero_offload"):
        ref.load_list(path)


def row(sweep_dir: Path, system: str, trial: int, status: str, *, model: str = "m", timeout_s: float = 100.0,
        gpu: str | None = "NVIDIA H100 80GB HBM3") -> None:
    point = {**POINT, "model": model, "system": system, "trial": trial}
    r = result_row(point, {"hardware": {"name": "h200"}, "timeout_s": timeout_s}, status=status, gpu_name=gpu)
    if status == "ok":
        r["iterations"] = [{"step": 3, "seconds": 1.0, "tokens": 256, "tokens_per_s": 256.0, "loss": 1.0}]
        r["tokens_per_s"] = 256.0
    job = sweep_dir / f"{model}-{system}-t{trial}"
    job.mkdir(parents=True)
    write_result(job / "result.json", r)


def fake_point(chunk: ref.Chunk) -> dict:
    return {**POINT, "model": chunk.point[0].split("=")[1]}


def test_a_row_is_done_when_ok_or_failed_with_its_reason_and_held_parts_wait(tmp_path):
    listed = ref.load_list(write_list(tmp_path, full_run_s=400))
    s = tmp_path / "h100" / "s"
    row(s, "ideal", 0, "ok", model="llama3_8b_4l")
    row(s, "ideal", 1, "oom", model="llama3_8b_4l")
    row(s, "zero_offload", 0, "error", model="llama3_8b_4l")
    row(s, "zero_offload", 1, "interrupted", model="llama3_8b_4l")       # the budget ended it: again
    row(s, "teraio_mixed", 0, "timeout", model="granite_8b_8l", timeout_s=400)   # a whole run's time: done
    row(s, "teraio_mixed", 1, "timeout", model="granite_8b_8l", timeout_s=300)   # less: again
    todo = ref.missing(listed, tmp_path / "h100", "h100", point_of=fake_point)
    assert [(m.chunk.part, m.system, m.trial) for m in todo] == [("a", "zero_offload", 1), ("b", "teraio_mixed", 1)]
    (s / "llama3_8b_4l-ideal-t0" / "result.json").write_text("{not json")  # unreadable: not done
    held = ref.load_list(write_list(tmp_path, held=["b"]))
    todo = ref.missing(held, tmp_path / "h100", "h100", point_of=fake_point)
    assert [(m.system, m.trial) for m in todo] == [("ideal", 0), ("zero_offload", 1)]
    lines = ref.status_lines(held, todo)
    assert lines[0].endswith("-> s: 2/4 done") and lines[1].endswith("-> s: held")


def test_a_row_of_another_card_is_refused_naming_it(tmp_path):
    listed = ref.load_list(write_list(tmp_path))
    row(tmp_path / "h100" / "s", "ideal", 0, "ok", model="llama3_8b_4l", gpu="NVIDIA H200")
    with pytest.raises(ValueError, match=r"llama3_8b_4l-ideal-t0/result.json: made on 'NVIDIA H200', not on the card 'h100'"):
        ref.missing(listed, tmp_path / "h100", "h100", point_of=fake_point)


def test_the_card_comes_from_the_gpus_name():
    assert (ref.card_of("NVIDIA H100 80GB HBM3"), ref.card_of("NVIDIA H200")) == ("h100", "h200")
    with pytest.raises(ValueError, match=r"GPU 'NVIDIA A100-SXM4-80GB': the reference is made on \['NVIDIA H100"):
        ref.card_of("NVIDIA A100-SXM4-80GB")


def test_sweeps_group_the_systems_missing_the_same_trials_and_share_the_time_among_candidates(tmp_path):
    listed = ref.load_list(write_list(tmp_path, trials=[0, 1, 2]))
    a, b = listed.chunks
    todo = [ref.Missing(a, "ideal", 1), ref.Missing(a, "ideal", 2), ref.Missing(a, "zero_offload", 0),
            ref.Missing(a, "zero_offload", 1), ref.Missing(a, "zero_offload", 2), ref.Missing(b, "teraio_mixed", 2)]
    lines = [i.line() for i in ref.invocations(listed, todo, candidates=lambda c, s: 4 if s == "zero_offload" else 0)]
    assert lines == ["fig7_h200 s 400 model=llama3_8b_4l system=ideal trial=1,2",
                     "fig7_h200 s 100 model=llama3_8b_4l system=zero_offload trial=0,1,2",
                     "fig7_h200 s 400 model=granite_8b_8l system=teraio_mixed trial=2 workload.measure_steps=2"]


def test_a_chunk_that_picks_several_points_is_refused(tmp_path):
    chunk = ref.Chunk("a", "fig9_h200", "s", (), ("teraio_mixed",), (0,))
    with pytest.raises(ValueError, match=r"its overrides pick 4 points of fig9_h200"):
        ref.composed_point(chunk)


def write_file(path: Path, text: str, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (mtime, mtime))


def test_a_calls_folders_travel_whole_and_replace_theirs(tmp_path):
    device, home = tmp_path / "device" / "h100", tmp_path / "home" / "h100"
    old, since = 1_000_000.0, 2_000_000.0
    for root in (device, home):
        write_file(root / "s" / "done-t0" / "result.json", "old row", old)       # untouched
        write_file(root / "s" / "again-t0" / "result.json", "interrupted", old)
        write_file(root / "s" / "again-t0" / "trace.json.gz", "old trace", old)
    # the call: a rerun moves the interrupted attempt aside and writes a new row and trace
    (device / "s" / "again-t0" / "result.json").rename(device / "s" / "again-t0" / "result.1.json")
    write_file(device / "s" / "again-t0" / "result.json", "new row", since + 1)
    write_file(device / "s" / "again-t0" / "trace.json", "new trace", since + 1)
    write_file(device / "s" / "again-t0" / ".result.json.lock", "", since + 1)
    write_file(device / "s" / "new-t0" / "result.json", "a row", since + 1)
    write_file(device / "s" / "tuning" / "p.json", "record", since + 1)
    write_file(device / "s" / "done-t0" / ".lock", "", since + 1)              # a visit leaves a lock only
    entries = rowpack.touched_entries(device, ["s", "absent"], since)
    assert entries == ["s/again-t0", "s/new-t0", "s/tuning"]
    log = tmp_path / "call.log"
    log.write_text("the log")
    archive = tmp_path / "call.tar.gz"
    rowpack.pack(device, entries, archive, {"tag": "t1", "card": "h100"}, {"logs/t1/call.log": log})
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
    assert "s/again-t0/trace.json.gz" in names and "s/again-t0/trace.json" not in names
    assert not [n for n in names if Path(n).name.startswith(".")]
    record = rowpack.unpack(archive, home)
    assert record["entries"] == entries + ["logs/t1/call.log"] and record["tag"] == "t1"
    assert (home / "s" / "again-t0" / "result.json").read_text() == "new row"
    assert (home / "s" / "again-t0" / "result.1.json").read_text() == "interrupted"
    import gzip
    assert gzip.decompress((home / "s" / "again-t0" / "trace.json.gz").read_bytes()) == b"new trace"
    assert (home / "s" / "done-t0" / "result.json").read_text() == "old row"
    assert (home / "logs" / "t1" / "call.log").read_text() == "the log"
    assert (home / "s" / "tuning" / "p.json").read_text() == "record"


def test_an_archive_with_a_file_outside_its_entries_is_refused(tmp_path):
    archive = tmp_path / "bad.tar.gz"
    evil = tmp_path / "evil"
    evil.write_text("x")
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo(rowpack.RECORD)
        data = json.dumps({"entries": ["s/a"]}).encode()
        info.size = len(data)
        import io
        tar.addfile(info, io.BytesIO(data))
        tar.add(evil, arcname="s/b/result.json")
    with pytest.raises(ValueError, match=r"member 's/b/result.json' is not a file of its entries \['s/a'\]"):
        rowpack.unpack(archive, tmp_path / "home")
    assert not (tmp_path / "home" / "s").exists()


def test_each_call_adds_its_row_to_the_cards_command_md(tmp_path):
    md = tmp_path / "h100" / "COMMAND.md"
    first = {"tag": "c1", "gpu_name": "NVIDIA H100 80GB HBM3", "budget_s": 560,
             "sweeps": ["fig7_h200 fig7_ref model=m system=ideal trial=0,1,2"],
             "rows": {"fig7_ref/a/result.json": "ok", "fig7_ref/b/result.json": "oom", "fig7_ref/c/result.json": "ok"}}
    ref.append_call(md, "h100", first, "abc1234")
    ref.append_call(md, "h100", {**first, "tag": "c2", "sweeps": [], "rows": {}}, "def5678")
    text = md.read_text()
    assert text.startswith("# runs/reference/h100: the reference, grown call by call on the h100 card")
    assert "`NVIDIA H100 80GB HBM3`" in text and text.count("| tag | commit |") == 1
    assert text.splitlines()[-2:] == [
        "| c1 | abc1234 | NVIDIA H100 80GB HBM3 | 560 | `fig7_h200 fig7_ref model=m system=ideal trial=0,1,2` | "
        "2 ok, 1 oom |",
        "| c2 | def5678 | NVIDIA H100 80GB HBM3 | 560 | none | none |"]


STUB = r"""#!/bin/bash
# a stand-in for python on the GPU machine: the card, a plan of two sweeps, each sweep logged
echo "$*" >> "$CALLS"
case "$*" in
  "-m benchmarks.reference card") echo h100 NVIDIA H100 80GB HBM3;;
  "-m benchmarks.reference plan --card h100") printf '%s\n' "fig7_h200 fig7_ref 140 model=a system=zero_offload trial=0,1" "fig9_h200 fig9_ref 420 fig9.host=x1 system=teraio_mixed trial=2";;
  "-m benchmarks.reference pack"*) exec "$REAL" "$@";;
  "-m teraio.sweep"*) for a in "$@"; do case $a in sweep.name=*) name=${a#sweep.name=};; esac; done
    mkdir -p "runs/reference/h100/$name/job-t0" && echo '{"status": "oom"}' > "runs/reference/h100/$name/job-t0/result.json";;
esac
exit 0
"""


def run_script(tmp_path: Path, budget: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    for d in ("benchmarks", "scripts"):
        (tmp_path / d).mkdir(exist_ok=True)
    for f in ("benchmarks/reference.sh", "benchmarks/reference.py", "benchmarks/__init__.py",
              "scripts/device_call.sh"):
        shutil.copy(REPO / f, tmp_path / f)
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(STUB)
    stub.chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    env = {**os.environ, "PATH": f"{stub.parent}:/usr/bin:/bin", "CALLS": str(calls), "REAL": sys.executable,
           "PYTHONPATH": str(REPO),  # the package; benchmarks/ is the copy's
           "BUDGET_S": str(budget), "OUT": str(tmp_path / "out"), "TAG": "t"}
    done = subprocess.run(["bash", "benchmarks/reference.sh"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    return done, calls.read_text().splitlines()


def test_the_script_runs_each_planned_sweep_with_the_time_left_and_packs(tmp_path):
    done, calls = run_script(tmp_path, budget=10_000)
    sweeps = [c for c in calls if c.startswith("-m teraio.sweep")]
    assert len(sweeps) == 2, done.stdout + done.stderr
    first = sweeps[0].split()
    # the sweep's name before the chunk's overrides, so that a sweep.name among them would win
    assert first[:7] == ["-m", "teraio.sweep", "-m", "+experiment=fig7_h200", "sweep.name=fig7_ref", "model=a",
                         "system=zero_offload"]
    assert "sweep.tune.timeout_s=140" in first
    assert "sweep.runs_dir=runs/reference/h100" in first
    timeouts = [int(next(a for a in c.split() if a.startswith("timeout_s=")).split("=")[1]) for c in sweeps]
    assert 0 < timeouts[1] <= timeouts[0] <= 10_000 - 40   # the budget left less a sweep's start
    assert "scripts/build_ds_ops.py cpu_adam" in calls   # ZeRO-Offload's op, not ZeRO-Infinity's too
    record = rowpack.read_record(tmp_path / "out" / "t.tar.gz")
    assert record["sweeps"] == ["fig7_h200 fig7_ref model=a system=zero_offload trial=0,1",
                                "fig9_h200 fig9_ref fig9.host=x1 system=teraio_mixed trial=2"]
    assert (record["card"], record["gpu_name"], record["budget_s"]) == ("h100", "NVIDIA H100 80GB HBM3", 10_000)
    assert record["entries"] == ["fig7_ref/job-t0", "fig9_ref/job-t0", "logs/t/t.log", "logs/t/fig7_ref.log",
                                 "logs/t/fig9_ref.log"]
    assert record["rows"] == {"fig7_ref/job-t0/result.json": "oom", "fig9_ref/job-t0/result.json": "oom"}


def test_the_script_starts_no_sweep_without_the_budget_for_one(tmp_path):
    done, calls = run_script(tmp_path, budget=60)
    assert not [c for c in calls if c.startswith("-m teraio.sweep")]
    assert done.stdout.count("left for the next call") == 2
    assert rowpack.read_record(tmp_path / "out" / "t.tar.gz")["sweeps"] == []
