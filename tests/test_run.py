"""The worker (teraio.harness.run): every outcome of a runner becomes a row with the right status."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from teraio import systems
from teraio.harness import run as worker
from teraio.config import run_config_from_dict
from teraio.result import Measurements

REPO = Path(__file__).resolve().parents[1]
TINY = {"name": "llama3_tiny", "dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2,
        "vocab_size": 128, "multiple_of": 32}


def cfg(system: str = "ideal"):
    return run_config_from_dict({"model": TINY, "system": {"name": system},
                                 "workload": {"batch_size": 2, "micro_batch_size": 1, "seq_len": 16,
                                              "warmup_steps": 1, "measure_steps": 2}})


def raising(exc: BaseException):
    def runner(cfg, job_dir, device):
        raise exc
    return runner


@pytest.mark.parametrize("exc,status", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
    (RuntimeError("CUDA error: out of memory"), "oom"),
    (RuntimeError("shape mismatch"), "error"),
    (ValueError("bad option"), "error"),
])
def test_runner_failure_is_a_row_with_status_and_traceback(tmp_path, exc, status):
    r = worker.run_point(cfg(), tmp_path, raising(exc))
    assert r["status"] == status
    assert str(exc) in r["error"] and "Traceback" in r["error"]
    assert r["point"]["system"] == "ideal" and r["finished_at"] and r["wall_seconds"] >= 0


def test_runner_that_measures_nothing_is_an_error(tmp_path):
    r = worker.run_point(cfg(), tmp_path, lambda *a: Measurements())
    assert r["status"] == "error" and "measured no iteration" in r["error"]


def test_totals_are_summarised_from_iterations(tmp_path):
    def runner(cfg, job_dir, device):
        return Measurements(iterations=[{"step": s, "seconds": 2.0, "tokens": 100, "tokens_per_s": 50.0,
                                         "loss": 1.0, "stall_count": s, "stall_seconds": 0.5}
                                        for s in (1, 2)])
    r = worker.run_point(cfg(), tmp_path, runner)
    assert r["status"] == "ok" and r["error"] is None
    assert r["tokens_per_s"] == 50.0 and r["stall_count"] == 3 and r["stall_seconds"] == 1.0


def test_unknown_runner_module_names_what_is_missing(monkeypatch):
    import dataclasses

    from teraio import systems
    spec = dataclasses.replace(systems.get("teraio_ssd"), runner="teraio.no_such_engine")
    monkeypatch.setitem(systems.REGISTRY._specs, "teraio_ssd", spec)
    with pytest.raises(RuntimeError, match="runner teraio.no_such_engine not available"):
        worker.load_runner("teraio_ssd")
    with pytest.raises(ValueError, match="valid"):
        worker.load_runner("nope")


def test_every_system_has_a_runner_and_an_options_check():
    import importlib

    from teraio import systems
    for name in systems.names():
        spec = systems.get(name)
        assert callable(worker.load_runner(name))
        module, _, fn = spec.check_options.partition(":")
        assert callable(getattr(importlib.import_module(module), fn))


def test_worker_cli_writes_result_json(tmp_path):
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(yaml.safe_dump(cfg().to_dict()))
    p = subprocess.run([sys.executable, "-m", "teraio.harness.run", str(resolved)], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["status"] == "ok", r["error"]
    assert len(r["iterations"]) == 2 and "tokens/s" in p.stdout and "loss" in p.stdout


# A fresh process whose runner writes a 1 GiB tensor: the row's host peak must be taken after
# the runner, and in bytes (not KiB). The runner starts from the process's current resident
# size, which may lie well below its peak so far (imports peak and release).
HOST_PEAK = """
import json, os, resource, sys, torch
from pathlib import Path
from teraio.config import run_config_from_dict
from teraio.result import Measurements
from teraio.result import Measurements, iteration_row
from teraio.harness.run import run_point
cfg = run_config_from_dict(json.loads(sys.argv[1]))
resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
peak_so_far = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def runner(cfg, job_dir, device):
    x = torch.ones((1 << 30) // 4)  # written, so resident
    return Measurements(iterations=[iteration_row(0, 1.0, 1, float(x[-1]))])
row = run_point(cfg, Path(sys.argv[2]), runner=runner)
print(json.dumps({"resident": resident, "peak_so_far": peak_so_far, "peak": row["peak_host_rss_bytes"]}))
"""


def test_row_records_the_workers_peak_host_memory(tmp_path):
    p = subprocess.run([sys.executable, "-c", HOST_PEAK, json.dumps(cfg().to_dict()), str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["resident"] + (960 << 20) <= out["peak"]
    assert out["peak"] <= max(out["peak_so_far"], out["resident"] + (1 << 30)) + (256 << 20)


@pytest.mark.parametrize("loss,tps,warmup_loss,named", [
    (float("nan"), 50.0, 1.0, "step 2: loss nan is not finite"),
    (1.0, float("inf"), 1.0, "step 1: tokens_per_s inf is not finite"),
    (1.0, 50.0, float("nan"), "step 0: loss nan is not finite"),
])
def test_a_loss_or_throughput_that_is_not_finite_is_an_error_row(tmp_path, loss, tps, warmup_loss, named):
    def runner(cfg, job_dir, device):
        return Measurements(iterations=[
            {"step": 1, "seconds": 2.0, "tokens": 100, "tokens_per_s": tps, "loss": 1.0},
            {"step": 2, "seconds": 2.0, "tokens": 100, "tokens_per_s": 50.0, "loss": loss}],
            losses=[warmup_loss, 1.0, loss])
    r = worker.run_point(cfg(), tmp_path, runner)
    assert r["status"] == "error" and named in r["error"]


def _write_ok_at_once(path, barrier, out):
    from teraio.result import result_row, write_result
    row = result_row(cfg().point(), {})
    row["status"] = "ok"
    barrier.wait()
    try:
        write_result(path, row)
        out.put("written")
    except FileExistsError:
        out.put("refused")


def test_two_writers_of_one_row_at_the_same_instant_cannot_both_succeed(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for i in range(20):
        path = tmp_path / f"p{i}" / "result.json"
        path.parent.mkdir()
        barrier, out = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_write_ok_at_once, args=(path, barrier, out)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        assert sorted([out.get(), out.get()]) == ["refused", "written"]
        assert sorted(f.name for f in path.parent.iterdir()) == [".result.json.lock", "result.json"]


# Beyond the paper's comparison, what users switch on today: each is run here end to end, by
# name through the worker's command line, wherever this machine can run it.
USERS_BASELINES = [n for n in systems.names() if not systems.get(n).paper]


@pytest.mark.parametrize("system", USERS_BASELINES)
def test_each_users_baseline_runs_end_to_end_through_the_worker(tmp_path, system):
    if systems.get(system).cuda_only and not torch.cuda.is_available():
        pytest.skip(f"{system} runs on CUDA only (the sweep refuses it on a CPU point: tests/test_users_baselines.py)")
    run = cfg(system)
    if torch.cuda.is_available():
        run = run_config_from_dict({**run.to_dict(), "hardware": {"device": "cuda"}})
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(yaml.safe_dump(run.to_dict()))
    p = subprocess.run([sys.executable, "-m", "teraio.harness.run", str(resolved)], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["status"] == "ok", r["error"]
    assert r["point"]["system"] == system and len(r["iterations"]) == 2 and len(r["losses"]) == 3
    assert r["micro_batch_size_trained"] == 1 and r["final_params_sha256"]
