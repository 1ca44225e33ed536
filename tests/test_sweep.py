"""The sweep orchestrator (teraio.sweep): failed points become rows, reruns resume,
nothing is overwritten, and a real Ideal point runs end to end.

Most tests replace the worker by a small script (the ``TERAIO_WORKER_CMD`` test hook) whose
behaviour per trial is scripted, so that a crash, a hang and an OOM cost no training; the
last test runs the real worker.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from teraio.config import load_run_config
from teraio.harness.rows import changed_keys
from teraio.result import read_status

REPO = Path(__file__).resolve().parents[1]

# A worker that writes rows with the real teraio.result code, acting per trial as
# $FAKE_PLAN says: ok | oom | crash (exit 3, no row) | sleep (hang until killed) | slow (ok after 8 s)
# | scratch (leave a slot file and a ZeRO swap dir on the drives, then sleep) | linger (write an ok
# row, then hang until killed).
FAKE_WORKER = '''
import json, os, sys, time
from pathlib import Path
from teraio.config import load_run_config
from teraio.result import Measurements, result_row, write_result
resolved = Path(sys.argv[1])
cfg = load_run_config(resolved)
(resolved.parent / "pid").write_text(str(os.getpid()))
with open(resolved.parent / "calls", "a") as f:
    f.write("call\\n")
(resolved.parent / "trace.json").write_text(json.dumps({"attempt_of": os.environ.get("FAKE_PLAN")}))
action = json.loads(os.environ["FAKE_PLAN"]).get(str(cfg.trial), "ok")
print(f"fake worker trial {cfg.trial}: {action}", flush=True)
print("[2026-12-01 00:00:00,000] [WARNING] [lib.py:1:f] noise from a library", flush=True)
if action == "crash":
    sys.exit(3)
if action == "scratch":  # a killed run's scratch on the drives: slot files, a ZeRO swap dir
    import socket
    a, b = cfg.hardware.ssd_dirs
    owner = f"{socket.gethostname().replace('-', '_')}-{os.getpid()}"  # teraio.files.owner_tag
    Path(a, f"teraio-{owner}-x.slots").write_bytes(b"s" * 4096)
    Path(b, f"zero-{owner}-point-1").mkdir()
    Path(b, f"zero-{owner}-point-1", "swap.bin").write_bytes(b"z" * 4096)
    action = "sleep"
if action == "sleep":
    time.sleep(120)
if action == "slow":
    time.sleep(8)
if action == "oom":
    row = result_row(cfg.point(), cfg.to_dict(), status="oom",
                     error="torch.OutOfMemoryError: CUDA out of memory (scripted)")
else:
    row = result_row(cfg.point(), cfg.to_dict(), Measurements(iterations=[
        {"step": 0, "seconds": 0.5, "tokens": 100, "tokens_per_s": 200.0, "loss": 1.0, "stall_count": 0,
         "stall_seconds": 0.0}]), status="ok")
write_result(resolved.parent / "result.json", row)
if action == "linger":
    time.sleep(120)
'''


@pytest.fixture
def fake_worker(tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    return f"{sys.executable} {script}"


def sweep_cmd(runs: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "teraio.sweep", "+experiment=smoke", "system=ideal",
            f"sweep.runs_dir={runs}", "sweep.analyze=false", *overrides]


def sweep_env(plan: dict, worker: str | None) -> dict:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "FAKE_PLAN": json.dumps(plan), "PYTHONPATH": path}
    if worker:
        env["TERAIO_WORKER_CMD"] = worker
    return env


def run_sweep(runs: Path, plan: dict, worker: str | None, *overrides: str,
              timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(sweep_cmd(runs, *overrides), cwd=REPO, env=sweep_env(plan, worker),
                          capture_output=True, text=True, timeout=timeout)


def job_dir(runs: Path, trial: int) -> Path:
    return runs / "smoke" / f"llama3_tiny-ideal-cpu_ci-bs4-mb2-seq64-t{trial}"


def calls(runs: Path, trial: int) -> int:
    """Worker calls of a point, over its attempts (a rerun moves the last one's files to
    ``attempt.<n>/``)."""
    d = job_dir(runs, trial)
    return sum(len(p.read_text().splitlines()) for p in [d / "calls", *d.glob("attempt.*/calls")] if p.exists())


def row(runs: Path, trial: int) -> dict:
    return json.loads((job_dir(runs, trial) / "result.json").read_text())


def pid_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (Linux /proc)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_failed_points_become_rows_and_rerun_resumes_without_overwriting(tmp_path, fake_worker):
    runs = tmp_path / "runs"
    plan = {"0": "ok", "1": "crash", "2": "sleep", "3": "oom"}
    p = run_sweep(runs, plan, fake_worker, "trial=0,1,2,3", "timeout_s=2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [row(runs, t)["status"] for t in range(4)] == ["ok", "error", "timeout", "oom"]
    assert "exit code 3" in row(runs, 1)["error"] and "fake worker trial 1: crash" in row(runs, 1)["error"]
    assert "timeout_s=2" in row(runs, 2)["error"]
    assert "out of memory" in row(runs, 3)["error"]
    out = " ".join(p.stdout.split())  # the console wraps long lines
    assert "✗ error worker ended (exit code 3) without writing result.json" in out  # the cause, not the log's last line
    assert "✗ timeout killed after timeout_s=2 s" in out
    for t in range(4):  # every row carries its point and the config it ran
        r = row(runs, t)
        assert r["point"]["trial"] == t and r["config"]["trial"] == t
        assert load_run_config(job_dir(runs, t) / "resolved.yaml").trial == t
    assert "fake worker trial 0: ok" in (job_dir(runs, 0) / "worker.log").read_text()
    ok_bytes = (job_dir(runs, 0) / "result.json").read_bytes()
    failed = {t: (job_dir(runs, t) / "result.json").read_bytes() for t in (1, 2, 3)}

    p = run_sweep(runs, {}, fake_worker, "trial=0,1,2,3", "timeout_s=2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "skip (ok)" in p.stdout
    assert [calls(runs, t) for t in range(4)] == [1, 2, 2, 2]  # only the failed ones ran again
    assert (job_dir(runs, 0) / "result.json").read_bytes() == ok_bytes
    assert not (job_dir(runs, 0) / "result.1.json").exists()
    for t in (1, 2, 3):  # the earlier failure is kept as history, the new row is ok
        assert row(runs, t)["status"] == "ok"
        assert (job_dir(runs, t) / "result.1.json").read_bytes() == failed[t]
    for t in (1, 3):  # and its side files, beside which the rerun wrote its own
        d = job_dir(runs, t)
        assert json.loads((d / "attempt.1" / "trace.json").read_text()) == {"attempt_of": json.dumps(plan)}
        assert json.loads((d / "trace.json").read_text()) == {"attempt_of": json.dumps({})}
        assert load_run_config(d / "attempt.1" / "resolved.yaml").trial == t
        # the row's lock stays with the row: it serialises every attempt's write of it
        assert (d / ".result.json.lock").exists() and not (d / "attempt.1" / ".result.json.lock").exists()
        assert "fake worker trial %d: ok" % t in (d / "worker.log").read_text()  # one log, appended
    assert not (job_dir(runs, 0) / "attempt.1").exists()

    p = run_sweep(runs, {}, fake_worker, "trial=0,1,2,3")
    assert p.stdout.count("skip (ok)") == 4 and [calls(runs, t) for t in range(4)] == [1, 2, 2, 2]


def test_a_deadline_defers_the_points_that_would_not_end_before_it(tmp_path, fake_worker):
    runs = tmp_path / "runs"
    assert run_sweep(runs, {"2": "oom"}, fake_worker, "trial=0,2").returncode == 0
    first = job_dir(runs, 0) / "result.json"  # an earlier trial of the point that took 500 s
    first.write_text(json.dumps({**json.loads(first.read_text()), "wall_seconds": 500.0}))
    oom_bytes = (job_dir(runs, 2) / "result.json").read_bytes()

    # 120 s left: trials 1 and 2 of that point are deferred (500 s + the worker's start);
    # trial 4 runs another workload, of which no row says anything, so it runs.
    p = run_sweep(runs, {}, fake_worker, "trial=1,2", f"sweep.deadline={time.time() + 120:.0f}")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("deferred: ") == 2 and "it needs 530 s" in p.stdout, p.stdout
    assert calls(runs, 1) == 0 and not (job_dir(runs, 1) / "result.json").exists()
    assert (job_dir(runs, 2) / "result.json").read_bytes() == oom_bytes  # its row left as it was
    assert not (job_dir(runs, 2) / "result.1.json").exists() and calls(runs, 2) == 1
    p = run_sweep(runs, {}, fake_worker, "trial=4", "workload.measure_steps=2",
                  f"sweep.deadline={time.time() + 120:.0f}")
    assert "deferred" not in p.stdout and row(runs, 4)["status"] == "ok", p.stdout

    # Enough time: they run. A deadline already past defers even a point no row speaks of.
    p = run_sweep(runs, {}, fake_worker, "trial=1,2", f"sweep.deadline={time.time() + 1000:.0f}")
    assert [row(runs, t)["status"] for t in (1, 2)] == ["ok", "ok"], p.stdout
    p = run_sweep(runs, {}, fake_worker, "trial=5", "workload.measure_steps=2",
                  f"sweep.deadline={time.time() - 1:.0f}")
    assert "deferred: 0 s left" in p.stdout and not job_dir(runs, 5).joinpath("result.json").exists()

    p = run_sweep(runs, {}, fake_worker, "trial=6", "sweep.deadline=soon")
    assert p.returncode != 0 and "sweep.deadline='soon'" in p.stderr and "Nothing was run" in p.stderr
    assert not job_dir(runs, 6).exists()


def test_killed_sweep_runs_only_missing_points_on_restart(tmp_path, fake_worker):
    runs = tmp_path / "runs"
    proc = subprocess.Popen(sweep_cmd(runs, "trial=0,1,2"), cwd=REPO,
                            env=sweep_env({"1": "sleep"}, fake_worker),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 60
        while calls(runs, 1) == 0:  # trial 0 done, trial 1's worker hanging
            assert time.time() < deadline and proc.poll() is None, "sweep never reached trial 1"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    worker_pid = int((job_dir(runs, 1) / "pid").read_text())
    deadline = time.time() + 10
    while pid_alive(worker_pid):  # the worker, in its own session, dies with the sweep
        assert time.time() < deadline, "orphan worker outlived the killed sweep"
        time.sleep(0.1)
    assert row(runs, 0)["status"] == "ok"
    assert not (job_dir(runs, 1) / "result.json").exists()  # its worker died with the sweep
    assert not job_dir(runs, 2).exists()
    ok_bytes = (job_dir(runs, 0) / "result.json").read_bytes()

    p = run_sweep(runs, {}, fake_worker, "trial=0,1,2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [calls(runs, t) for t in range(3)] == [1, 2, 1]
    assert (job_dir(runs, 0) / "result.json").read_bytes() == ok_bytes
    assert [row(runs, t)["status"] for t in range(3)] == ["ok"] * 3
    rows = sorted(str(p.relative_to(runs)) for p in runs.rglob("result*.json"))
    assert rows == [f"smoke/{job_dir(runs, t).name}/result.json" for t in range(3)]


def test_library_chatter_goes_to_the_worker_log_not_the_terminal(tmp_path, fake_worker):
    runs = tmp_path / "runs"
    p = run_sweep(runs, {}, fake_worker, "trial=0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "fake worker trial 0: ok" in p.stdout and "noise from a library" not in p.stdout
    assert "library messages go to" in p.stdout
    assert "noise from a library" in (job_dir(runs, 0) / "worker.log").read_text()


def test_a_worker_that_dies_on_a_full_drive_gets_a_row_that_says_so(tmp_path, monkeypatch):
    # DeepSpeed's aio op aborts the process (SIGABRT) on a write that finds no room: no row of
    # its own. The drive looks full to the sweep (disk_usage patched) while the worker aborts.
    from hydra import compose, initialize_config_dir

    from teraio import sweep

    runs = tmp_path / "runs"
    sweep.register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        master = compose("config", overrides=["+experiment=smoke", "system=teraio_ssd", "trial=0",
                                              f"sweep.runs_dir={runs}"], return_hydra_config=True)
        (point,) = [compose("config", overrides=list(job), return_hydra_config=True)
                    for job in sweep.job_overrides(master)]
    drive = sweep.run_config(point).hardware.ssd_dirs[0]
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=4096) if str(p) == drive else real(p))
    abort = "import os, resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); os.abort()"  # no core file
    monkeypatch.setenv("TERAIO_WORKER_CMD", f"{sys.executable} -c '{abort}'")
    job = Path(point.hydra.sweep.dir) / str(point.hydra.sweep.subdir)
    assert sweep.run_point_job(point, job) == "error"
    r = json.loads((job / "result.json").read_text())
    assert r["error"].startswith(f"drive full: {drive}; worker ended (killed by signal 6, SIGABRT)"), r["error"]
    monkeypatch.setattr(shutil, "disk_usage", real)  # room again: the cause is the signal alone
    assert sweep.run_point_job(point, job) == "error"
    assert json.loads((job / "result.json").read_text())["error"].startswith("worker ended (killed by signal 6")


def test_worker_that_writes_nothing_and_exits_zero_is_an_error_row(tmp_path):
    runs = tmp_path / "runs"
    p = run_sweep(runs, {}, f"{sys.executable} -c pass", "trial=0")
    assert p.returncode == 0, p.stdout + p.stderr
    r = row(runs, 0)
    assert r["status"] == "error" and "without writing result.json" in r["error"]


def test_ideal_point_end_to_end_with_the_real_worker(tmp_path):
    runs = tmp_path / "runs"
    p = run_sweep(runs, {}, None, "trial=0", "workload.warmup_steps=1", "workload.measure_steps=2")
    assert p.returncode == 0, p.stdout + p.stderr
    r = row(runs, 0)
    assert r["status"] == "ok", r["error"]
    assert [i["step"] for i in r["iterations"]] == [1, 2]
    assert all(i["tokens_per_s"] > 0 for i in r["iterations"])
    assert r["versions"]["torch"] and r["finished_at"]
    assert "loss" in p.stdout and "tokens/s" in p.stdout  # per-iteration lines streamed
    resolved = yaml.safe_load((job_dir(runs, 0) / "resolved.yaml").read_text())
    assert resolved == r["config"]


def test_fig7_teraio_points_run_below_their_unoffloaded_peak(tmp_path):
    # The paper's Fig. 7 path, with a small point added for the CPU and a capacity below the
    # point's un-offloaded peak (about 12 MB): TeraIO runs every step within it.
    runs, capacity = tmp_path / "runs", 8_000_000
    cmd = [sys.executable, "-m", "teraio.sweep", "+experiment=fig7", "hardware=cpu_ci", "model=llama3_tiny",
           "+fig7.points.llama3_tiny.bs_mid={batch_size:4,micro_batch_size:2,seq_len:64,paper_m:150}",
           "+fig7.host_mem_gb.llama3_tiny=0.004", "fig7.point=bs_mid", "system=teraio_ssd,teraio_mixed",
           "trial=0", f"hardware.gpu_capacity_bytes={capacity}", "sweep.make_ssd_dirs=true",
           "+sweep.system_options={teraio_ssd:{min_tensor_bytes:4096},teraio_mixed:{min_tensor_bytes:4096}}",
           "workload.measure_steps=2", "timeout_s=300", f"sweep.runs_dir={runs}", "sweep.analyze=false"]
    p = subprocess.run(cmd, cwd=REPO, env=sweep_env({}, None), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    for system in ("teraio_ssd", "teraio_mixed"):
        r = json.loads((runs / "fig7" / f"llama3_tiny-{system}-cpu_ci-bs4-mb2-seq64-t0" / "result.json").read_text())
        assert r["status"] == "ok", r["error"]
        assert r["memory_pressure"] > 1 and r["capacity_bytes"] == capacity and r["capacity_emulated"]
        assert [s["step"] for s in r["paged_steps"]] == [0, 1]
        assert all(s["max_accounted_bytes"] <= capacity for s in r["paged_steps"])
        assert all(i["max_accounted_bytes"] <= capacity for i in r["iterations"])


@pytest.mark.parametrize("chdir", ["true", "false"])
def test_a_relative_ssd_dir_is_resolved_against_the_launch_dir(tmp_path, fake_worker, chdir):
    runs = tmp_path / "runs"
    cmd = sweep_cmd(runs, "system=teraio_ssd", "trial=0", "hardware.ssd_dirs=[rel/ssd]", "sweep.make_ssd_dirs=true",
                    f"hydra.job.chdir={chdir}")
    p = subprocess.run(cmd, cwd=tmp_path, env=sweep_env({}, fake_worker), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    job = runs / "smoke" / "llama3_tiny-teraio_ssd-cpu_ci-bs4-mb2-seq64-t0"
    resolved = yaml.safe_load((job / "resolved.yaml").read_text())
    assert resolved["hardware"]["ssd_dirs"] == [str(tmp_path / "rel" / "ssd")]
    assert (tmp_path / "rel" / "ssd").is_dir() and not (job / "rel").exists()


def test_two_sweeps_into_one_runs_dir_run_each_point_once(tmp_path, fake_worker):
    runs = tmp_path / "runs"
    env = sweep_env({"0": "slow"}, fake_worker)
    procs = [subprocess.Popen(sweep_cmd(runs, "trial=0"), cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert calls(runs, 0) == 1 and row(runs, 0)["status"] == "ok"
    ran = [o for o in outs if "✓ ok" in o]
    other = [o for o in outs if "✓ ok" not in o]
    assert len(ran) == 1 and "sweep done: 1 ok" in ran[0]
    # The other one skipped it (busy while the first ran, or already ok) and says so.
    assert "another sweep is running this point now" in other[0] or "skip (ok)" in other[0]
    assert "sweep done: 1 busy" in other[0] or "sweep done: 1 skip" in other[0]
    assert "worker.log" not in os.listdir(job_dir(runs, 0)) or \
        (job_dir(runs, 0) / "worker.log").read_text().count("fake worker trial 0") == 1


PLUGIN = '''
from teraio import systems
from teraio.systems import SystemSpec

systems.register(SystemSpec("fake_offload", "Fake-Offload", "fake_plugin", "fake_plugin:check_options"))


def check_options(system, options):
    if set(options) - {"speed"}:
        raise ValueError(f"system.options {sorted(set(options) - {'speed'})}: {system} takes only speed")


def run(cfg, job_dir, device):  # trains as Ideal does, returning its teraio.result.Measurements
    import dataclasses
    from baselines import ideal
    return ideal.run(dataclasses.replace(cfg, system=dataclasses.replace(cfg.system, name="ideal", options={})),
                     job_dir, device)
'''


def plugin_sweep(tmp_path, module: str, source: str, system: str, options: str, *overrides: str):
    """The command and environment of a sweep of smoke's trial 0 with ``system``, registered by
    the module ``module`` (its text ``source``) with the options ``options`` (YAML); its rows
    go to ``tmp_path/runs``."""
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / f"{module}.py").write_text(source)
    (tmp_path / "conf" / "system").mkdir(parents=True)
    (tmp_path / "conf" / "system" / f"{system}.yaml").write_text(f"name: {system}\noptions: {options}\n")
    env = {**sweep_env({}, None), "TERAIO_SYSTEM_MODULES": module}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "plugin"), env["PYTHONPATH"]])
    cmd = [sys.executable, "-m", "teraio.sweep", "+experiment=smoke", f"system={system}", "trial=0",
           f"sweep.runs_dir={tmp_path / 'runs'}", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", *overrides]
    return cmd, env


def test_a_system_added_through_the_registry_alone_runs_end_to_end(tmp_path):
    cmd, env = plugin_sweep(tmp_path, "fake_plugin", PLUGIN, "fake_offload", "{speed: 1}",
                            "workload.warmup_steps=1", "workload.measure_steps=2")
    runs = tmp_path / "runs"
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (job,) = (runs / "smoke").glob("llama3_tiny-fake_offload-*")
    r = json.loads((job / "result.json").read_text())
    assert r["status"] == "ok" and r["point"]["system"] == "fake_offload" and r["tokens_per_s"] > 0
    # The analysis labels it by the registry's display name.
    assert "Fake-Offload" in (runs / "smoke" / "analysis" / "tables" / "throughput.md").read_text()
    # Its own options check guards the sweep like any other system's.
    bad = subprocess.run(cmd + ["+system.options.turbo=1"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "fake_offload takes only speed" in bad.stderr


NOISY_PLUGIN = '''
import logging, warnings
import torch
from teraio import systems
from teraio.systems import SystemSpec

systems.register(SystemSpec("noisy", "Noisy", "noisy_plugin", "noisy_plugin:check_options"))


def check_options(system, options):
    pass


def deprecated(*args, **kwargs):
    warnings.warn("old API.\\n\\n    Second line of a docstring.", FutureWarning, stacklevel=2)


def wrapper(func, *args, **kwargs):
    return func(*args, **kwargs)


def run(cfg, job_dir, device):  # a library's warnings, then an expected out-of-memory
    wrapper(deprecated)
    logging.getLogger("somelib").warning("a record\\nits second line")
    print("the runner's own line", flush=True)
    wrapper(fail)


def fail():
    raise torch.OutOfMemoryError("CUDA out of memory (scripted)")
'''


def test_library_warnings_and_an_ooms_traceback_go_to_the_log_not_the_terminal(tmp_path):
    cmd, env = plugin_sweep(tmp_path, "noisy_plugin", NOISY_PLUGIN, "noisy", "{}", "sweep.analyze=false")
    runs = tmp_path / "runs"
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (job,) = (runs / "smoke").glob("llama3_tiny-noisy-*")
    assert json.loads((job / "result.json").read_text())["status"] == "oom"
    out = " ".join(p.stdout.split())  # the console wraps long lines
    assert "the runner's own line" in out
    assert f"oom (its traceback is in {job / 'worker.log'})" in out
    assert "✗ oom torch.OutOfMemoryError: CUDA out of memory (scripted)" in out
    for fragment in ("Second line of a docstring", "return func(*args, **kwargs)", "its second line",
                     "Traceback", "raise torch.OutOfMemoryError"):
        assert fragment not in p.stdout, fragment
        assert fragment in (job / "worker.log").read_text(), fragment


@pytest.mark.parametrize("change", ["workload.lr=0.001", "seed=1", "hardware.host_mem_cap_bytes=1048576",
                                    "+sweep.system_options.ideal.modeled_traces.llama3_70b=/x.json"])
def test_a_changed_config_never_reuses_an_old_ok_row(tmp_path, fake_worker, change):
    runs = tmp_path / "runs"
    assert run_sweep(runs, {}, fake_worker, "trial=0").returncode == 0
    ok = (job_dir(runs, 0) / "result.json").read_bytes()
    p = run_sweep(runs, {}, fake_worker, "trial=0", change)
    assert p.returncode != 0 and "Nothing was run" in p.stderr, p.stdout + p.stderr
    key = {"+": "system.options.modeled_traces"}.get(change[0], change.split("=")[0])
    assert key in " ".join(p.stderr.split()) and "sweep.rerun_changed=true" in p.stderr
    assert calls(runs, 0) == 1 and (job_dir(runs, 0) / "result.json").read_bytes() == ok

    p = run_sweep(runs, {}, fake_worker, "trial=0", change, "sweep.rerun_changed=true")
    assert p.returncode == 0, p.stdout + p.stderr
    assert calls(runs, 0) == 2 and (job_dir(runs, 0) / "result.1.json").read_bytes() == ok
    assert row(runs, 0)["status"] == "ok" and row(runs, 0)["config"] != json.loads(ok)["config"]


def test_a_row_made_before_the_capacity_mode_existed_was_held_by_the_fraction():
    old = {"hardware": {"name": "h200", "gpu_capacity_bytes": 1}}
    assert changed_keys(old, {"hardware": {**old["hardware"], "capacity_mode": "fraction"}}) == []
    assert changed_keys(old, {"hardware": {**old["hardware"], "capacity_mode": "reserve"}}) == [
        "hardware.capacity_mode"]
    assert changed_keys(old, {"hardware": {**old["hardware"], "a_later_field": 1}}) == []  # not compared


def test_a_copied_runs_dir_keeps_its_rows(tmp_path, fake_worker):
    runs = tmp_path / "runs"
    assert run_sweep(runs, {}, fake_worker, "trial=0", "timeout_s=30").returncode == 0
    copy = tmp_path / "elsewhere" / "runs"
    shutil.copytree(runs, copy)
    p = run_sweep(copy, {}, fake_worker, "trial=0")  # another ssd_dirs (under it) and timeout_s
    assert p.returncode == 0 and "skip (ok)" in p.stdout and "different" not in p.stdout, p.stdout + p.stderr
    assert calls(copy, 0) == 1


def scratch(runs: Path) -> list[str]:
    """The entries on the smoke sweep's drives (hardware cpu_ci's ssd_dirs under runs_dir)."""
    return sorted(str(p.relative_to(runs)) for p in (runs / "_ssd").glob("*/*/*"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_sweep_closes_the_tiers_and_writes_an_interrupted_row(tmp_path, sig):
    runs = tmp_path / "runs"
    proc = subprocess.Popen(sweep_cmd(runs, "system=teraio_mixed", "trial=0", "workload.measure_steps=100000"),
                            cwd=REPO, env=sweep_env({}, None), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = runs / "smoke" / "llama3_tiny-teraio_mixed-cpu_ci-bs4-mb2-seq64-t0" / "worker.log"
        deadline = time.time() + 120
        while not (log.exists() and "step 4 " in log.read_text()):  # planned, its tiers open
            assert time.time() < deadline and proc.poll() is None, "the run never reached step 4"
            time.sleep(0.2)
        assert any(name.endswith(".slots") for name in scratch(runs))
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, out
    r = json.loads((log.parent / "result.json").read_text())
    assert r["status"] == "interrupted" and "interrupted by SIGTERM" in r["error"], r["error"]  # the sweep ends its worker so
    assert r["plan"]["migrations"] > 0 and r["iterations"]  # what it measured before, kept
    assert scratch(runs) == []  # the worker closed its tiers (nothing was left to remove)
    assert "left by process" not in out and "Traceback" not in out
    after = out.split("step 4 ", 1)[1].splitlines()[1:]
    ours = [ln for ln in after if not ln.startswith("  │ step ")]
    assert len(ours) == 1 and ours[0].startswith(f"✗ sweep interrupted by {sig.name}"), out


def test_a_signal_after_the_worker_wrote_its_row_keeps_the_row_and_says_so(tmp_path, fake_worker):
    runs = tmp_path / "runs"
    proc = subprocess.Popen(sweep_cmd(runs, "trial=0"), cwd=REPO, env=sweep_env({"0": "linger"}, fake_worker),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        result = job_dir(runs, 0) / "result.json"
        deadline = time.time() + 60
        while read_status(result) != "ok":  # the worker wrote its row and lingers
            assert time.time() < deadline and proc.poll() is None, "the worker never wrote its row"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert row(runs, 0)["status"] == "ok"
    last = out.strip().splitlines()[-1]
    assert last.startswith("✗ sweep interrupted by SIGTERM") and "kept its row (ok)" in last, out
    assert "has an interrupted row" not in out, out


def test_a_timeout_or_a_rerun_removes_what_a_killed_worker_left_on_the_drives(tmp_path, fake_worker):
    runs = tmp_path / "runs"
    ssd = ("system=teraio_ssd", "trial=0")  # a system that uses the drives; the fake worker runs it
    job = runs / "smoke" / "llama3_tiny-teraio_ssd-cpu_ci-bs4-mb2-seq64-t0"
    p = run_sweep(runs, {"0": "scratch"}, fake_worker, *ssd, "timeout_s=3")
    assert p.returncode == 0 and read_status(job / "result.json") == "timeout", p.stdout + p.stderr
    assert scratch(runs) == [] and p.stdout.count("left by process") == 2
    # a worker killed past the sweep's reach (its sweep SIGKILLed): the next sweep removes it
    proc = subprocess.Popen(sweep_cmd(runs, *ssd), cwd=REPO, env=sweep_env({"0": "scratch"}, fake_worker),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 60
        while len(scratch(runs)) < 2:
            assert time.time() < deadline and proc.poll() is None, "the worker never wrote its scratch"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    worker_pid = int((job / "pid").read_text())
    deadline = time.time() + 10
    while pid_alive(worker_pid):
        assert time.time() < deadline, "orphan worker outlived the killed sweep"
        time.sleep(0.1)
    assert len(scratch(runs)) == 2
    p = run_sweep(runs, {}, fake_worker, *ssd)
    assert p.returncode == 0 and read_status(job / "result.json") == "ok", p.stdout + p.stderr
    assert scratch(runs) == [] and p.stdout.count("left by process") == 2


def test_the_sweep_ends_with_the_analysis_index_and_the_table_not_every_path(tmp_path, fake_worker):
    runs = tmp_path / "runs"
    p = run_sweep(runs, {}, fake_worker, "trial=0,1", "sweep.analyze=true")
    assert p.returncode == 0, p.stdout + p.stderr
    out = " ".join(p.stdout.split())
    assert f"files in {runs / 'smoke' / 'analysis'}; see " in out and "index.md" in out
    assert "tables/throughput.tex" not in out and "| System" in p.stdout  # the table, not the list
    assert (runs / "smoke" / ".analysis.lock").exists()  # concurrent sweeps' analyses take turns


@pytest.mark.parametrize("broken", [
    lambda r: r.pop("tokens_per_s"),         # a key the analysis needs
    lambda r: r.update(iterations=[]),      # an ok row that measured nothing
    lambda r: r.update(format="teraio.result/0"),
])
def test_an_ok_row_the_analysis_would_skip_is_run_again_and_kept(tmp_path, fake_worker, broken):
    runs = tmp_path / "runs"
    assert run_sweep(runs, {}, fake_worker, "trial=0").returncode == 0
    r = row(runs, 0)
    broken(r)
    (job_dir(runs, 0) / "result.json").write_text(json.dumps(r))
    skipped = (job_dir(runs, 0) / "result.json").read_bytes()
    p = run_sweep(runs, {}, fake_worker, "trial=0")
    assert p.returncode == 0, p.stdout + p.stderr
    out = " ".join(p.stdout.split())
    assert "1 unreadable" in out and "skip (ok)" not in out
    assert "kept as result.1.json, running the point again" in out
    assert calls(runs, 0) == 2 and row(runs, 0)["status"] == "ok" and "tokens_per_s" in row(runs, 0)
    assert (job_dir(runs, 0) / "result.1.json").read_bytes() == skipped


def test_a_sweep_started_elsewhere_writes_under_that_dirs_runs_and_says_where(tmp_path, fake_worker):
    p = subprocess.run([sys.executable, "-m", "teraio.sweep", "+experiment=smoke", "system=ideal", "trial=0",
                        "sweep.analyze=false"], cwd=tmp_path, env=sweep_env({}, fake_worker),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "runs" / "smoke" / "llama3_tiny-ideal-cpu_ci-bs4-mb2-seq64-t0" / "result.json").exists()
    assert f"1 points in {tmp_path / 'runs' / 'smoke'}:" in " ".join(p.stdout.split())


def test_the_roofline_from_another_dir_names_the_missing_trace_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "teraio.sweep", "+experiment=fig3"], cwd=tmp_path,
                       env=sweep_env({}, None), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert p.stderr.startswith("teraio.sweep: roofline.models.llama3_8b.trace=benchmarks/results/"), p.stderr
    assert f"taken from the directory the command runs in, {tmp_path}" in p.stderr
    assert not (tmp_path / "runs").exists()  # refused before Hydra made its run dir
