"""Result rows come from one builder (teraio.result.result_row): a failed and an ok row have
the schema's keys, in its order, plus each runner's declared extras, and a failure row keeps
what the runner measured before it failed."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from baselines import ideal
from teraio import sweep
from teraio.config import run_config_from_dict
from teraio.result import Measurements, kept_on_failure, measured_before, result_row
from teraio.harness.run import run_point

# The keys of every row, in order (format teraio.result/1).
SCHEMA_KEYS = [
    "format", "status", "error", "measure", "point", "config", "iterations", "tokens_per_s", "stall_count",
    "stall_seconds", "bytes_per_tier", "peak_allocated_bytes", "peak_reserved_bytes", "peak_host_rss_bytes",
    "capacity_bytes", "capacity_emulated", "paged_steps", "replans", "tier_gbps", "step_peak_allocated_bytes",
    "unoffloaded_peak_bytes", "memory_pressure", "plan_compile_seconds", "profile_seconds", "ssd_io_mode",
    "gpu_name", "allocator_conf", "versions", "host", "started_at", "finished_at", "wall_seconds", "artifacts",
]
TINY = {"name": "llama3_tiny", "dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128,
        "multiple_of": 32}


def cfg(system="ideal", **hardware):
    return run_config_from_dict({"model": TINY, "system": {"name": system}, "hardware": hardware,
                                 "workload": {"batch_size": 2, "micro_batch_size": 1, "seq_len": 16,
                                              "warmup_steps": 2, "measure_steps": 2}})


def test_a_failure_row_has_the_schema_keys_only():
    c = cfg()
    for row in (result_row(c.point(), c.to_dict()), sweep.failure_row(c, "timeout", "killed", time.time())):
        assert list(row) == SCHEMA_KEYS
        assert row["format"] == "teraio.result/1" and row["iterations"] == [] and row["tokens_per_s"] is None
    assert sweep.failure_row(c, "timeout", "killed", time.time())["status"] == "timeout"


def test_ok_rows_have_the_schema_keys_then_the_runners_extras(tmp_path):
    row = run_point(cfg(), tmp_path / "ideal")
    assert row["status"] == "ok", row["error"]
    assert list(row) == SCHEMA_KEYS + ["losses"] and len(row["losses"]) == 4
    assert row["tokens_per_s"] > 0 and row["stall_count"] == 0 and row["bytes_per_tier"] == {"ssd": 0, "host": 0}

    ssd, job = tmp_path / "ssd", tmp_path / "teraio"
    ssd.mkdir()
    job.mkdir()  # the sweep makes a point's job dir before its worker starts
    row = run_point(cfg("teraio_ssd", device="cpu", ssd_dirs=[str(ssd)], ssd_write_gbps=50.0, ssd_read_gbps=50.0,
                        host_d2h_gbps=50.0, host_h2d_gbps=50.0), job)
    assert row["status"] == "ok", row["error"]
    assert list(row) == SCHEMA_KEYS + ["losses", "plan", "final_params_sha256"]
    assert [i["step"] for i in row["iterations"]] == [2, 3] and len(row["losses"]) == 4
    assert {"urgent_count", "max_accounted_bytes", "oom_retries", "dropped_bytes",
            "deferred_prefetches", "spilled_bytes"} <= set(row["iterations"][0])
    assert all((i["oom_retries"], i["dropped_bytes"], i["deferred_prefetches"], i["spilled_bytes"]) == (0, 0, 0, 0)
               for i in row["iterations"])


def test_a_modeled_row_names_its_trace(tmp_path, monkeypatch):
    c = cfg()
    c = dataclasses.replace(c, system=dataclasses.replace(c.system, options={"measure": "modeled", "modeled_traces": {
        TINY["name"]: str(tmp_path / "trace.json")}}))
    monkeypatch.setattr(ideal, "run_modeled", lambda cfg, trace_file: Measurements(
        measure="modeled", extras={"modeled_from": str(trace_file)},
        iterations=[{"step": 2, "seconds": 1.0, "tokens": 32, "tokens_per_s": 32.0, "loss": None}]))
    row = run_point(c, tmp_path / "job", runner=ideal.run)
    assert row["status"] == "ok" and list(row) == SCHEMA_KEYS + ["modeled_from"]
    assert row["peak_host_rss_bytes"] is None and row["tokens_per_s"] == 32.0


def test_a_failure_row_keeps_what_was_measured_before_the_failure(tmp_path):
    def runner(cfg, job_dir, device):
        with kept_on_failure(Measurements(capacity_bytes=1 << 20)) as measured:
            measured.iterations.append({"step": 2, "seconds": 1.0, "tokens": 32, "tokens_per_s": 32.0, "loss": 1.0})
            measured.extras["plan"] = {"shortfall_bytes": 7}
            raise torch.OutOfMemoryError("CUDA out of memory (scripted)")

    row = run_point(cfg(), tmp_path, runner)
    assert row["status"] == "oom" and "scripted" in row["error"]
    assert row["capacity_bytes"] == 1 << 20 and row["plan"] == {"shortfall_bytes": 7}
    assert len(row["iterations"]) == 1 and row["tokens_per_s"] is None  # partial: no totals
    assert measured_before(ValueError()) == Measurements()


def test_a_runner_that_returns_no_measurements_is_an_error_row(tmp_path):
    row = run_point(cfg(), tmp_path, lambda cfg, job_dir, device: None)
    assert row["status"] == "error" and "returns teraio.result.Measurements" in row["error"]
    assert list(row) == SCHEMA_KEYS


def test_extras_cannot_replace_a_schema_key_and_facts_must_be_known():
    c = cfg()
    with pytest.raises(ValueError, match=r"extras \['tokens_per_s'\] are schema keys"):
        result_row(c.point(), c.to_dict(), Measurements(extras={"tokens_per_s": 1.0}))
    with pytest.raises(ValueError, match=r"extras \['losses'\] are schema keys"):
        result_row(c.point(), c.to_dict(), Measurements(extras={"losses": []}))
    with pytest.raises(ValueError, match=r"run facts \['status_code'\]"):
        result_row(c.point(), c.to_dict(), status_code=1)
    with pytest.raises(ValueError, match="point lacks"):
        result_row({"model": "x"}, {})


def test_human_bytes_reads_as_a_person_writes_it():
    from teraio.result import human_bytes

    assert [human_bytes(n) for n in (0, 950, 1500, 2 << 20, 63992496128, 4.2e13)] == [
        "0 B", "950 B", "1.5 kB", "2.1 MB", "64.0 GB", "42.0 TB"]
