"""The Ideal baseline: the shared step, unmodified, with a valid row."""
from __future__ import annotations

import math

import torch

from teraio.systems import ideal
import numpy as np
import pytest

from teraio.config import run_config_from_dict
from teraio.harness.run import run_point
from teraio.core.trace import TensorRecord, Trace
from teraio.workload.models import build_model
from teraio.result import result_row
from teraio.workload.step import make_batch, make_optimizer, train_step

TINY = {"name": "llama3_tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "vocab_size": 256, "multiple_of": 32}


def test_ideal_row_and_losses_equal_the_shared_step(tmp_path):
    cfg = run_config_from_dict({
        "model": TINY, "system": {"name": "ideal"}, "seed": 3,
        "workload": {"batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "warmup_steps": 2,
                     "measure_steps": 3},
        "hardware": {"gpu_capacity_bytes": 1 << 20}})
    result = result_row(cfg.point(), cfg.to_dict(), ideal.run(cfg, tmp_path, torch.device("cpu")))

    its = result["iterations"]
    assert [i["step"] for i in its] == [2, 3, 4]
    for i in its:
        assert math.isfinite(i["loss"]) and i["seconds"] > 0 and i["tokens"] == 4 * 16
        assert i["tokens_per_s"] == i["tokens"] / i["seconds"]
        assert (i["stall_count"], i["stall_seconds"], i["migration_seconds"]) == (0, 0.0, 0.0)
        assert i["bytes_offloaded"] == {"ssd": 0, "host": 0} == i["bytes_prefetched"]
    assert result["capacity_bytes"] is None  # Ideal runs uncapped
    assert result["peak_allocated_bytes"] is None  # no device peak on a CPU

    torch.manual_seed(123)  # the runner must not depend on global RNG state
    model = build_model(cfg.model, 16, "cpu", seed=3)
    opt = make_optimizer(model, cfg.workload.lr)
    expected = [train_step(model, opt, *make_batch(s, cfg.workload, 256, 3, "cpu"), 2) for s in range(5)]
    assert result["losses"] == expected
    assert [i["loss"] for i in its] == expected[2:]


def test_ideal_refuses_options(tmp_path):
    cfg = run_config_from_dict({"model": TINY, "system": {"name": "ideal", "options": {"x": 1}}})
    try:
        ideal.run(cfg, tmp_path, torch.device("cpu"))
    except ValueError as e:
        assert "ideal takes only modeled_traces" in str(e)
    else:
        raise AssertionError("ideal accepted options")


def hand_trace(meta: dict) -> Trace:
    # ops 0-2: forward/backward of one micro-batch; op 3 first touches optimizer state.
    tensors = [TensorRecord(0, "param:w", 64, "param", True, [0, 2, 3]),
               TensorRecord(1, "optim:w:exp_avg", 64, "optim", True, [3, 4])]
    return Trace(op_names=["mm", "mm", "mm", "lerp_", "addcdiv_"],
                 op_seconds=np.array([1.0, 2.0, 3.0, 4.0, 5.0]), tensors=tensors, meta=meta)


def test_modeled_iteration_repeats_the_micro_batch_then_the_optimizer_once():
    tr = hand_trace({})
    assert ideal.optimizer_phase_start(tr) == 3
    assert ideal.modeled_iteration_seconds(tr, 1) == 15.0
    assert ideal.modeled_iteration_seconds(tr, 4) == 4 * 6.0 + 9.0
    with pytest.raises(ValueError, match="micro_batches=0"):
        ideal.modeled_iteration_seconds(tr, 0)


def modeled_cfg(trace_file, **workload):
    w = {"batch_size": 8, "micro_batch_size": 2, "seq_len": 16, "warmup_steps": 2, "measure_steps": 3, **workload}
    return run_config_from_dict({"model": TINY, "workload": w, "system": {
        "name": "ideal", "options": {"modeled_traces": {TINY["name"]: str(trace_file)}}}})


def test_modeled_ideal_row_is_labelled_and_timed_from_the_trace(tmp_path):
    meta = {"model": TINY["name"], "n_layers": 2, "batch_size": 2, "micro_batch_size": 2, "seq_len": 16}
    hand_trace(meta).save(tmp_path / "t.json.gz")
    row = run_point(modeled_cfg(tmp_path / "t.json.gz"), tmp_path / "job", runner=ideal.run)
    assert row["status"] == "ok", row["error"]
    assert row["measure"] == "modeled" and row["modeled_from"] == str(tmp_path / "t.json.gz")
    (it,) = row["iterations"]
    assert it["seconds"] == 4 * 6.0 + 9.0  # 8 / 2 micro-batches
    assert row["tokens_per_s"] == pytest.approx(8 * 16 / 33.0)


def test_modeled_ideal_refuses_a_trace_of_another_point(tmp_path):
    meta = {"model": TINY["name"], "n_layers": 2, "batch_size": 2, "micro_batch_size": 2, "seq_len": 32}
    hand_trace(meta).save(tmp_path / "t.json.gz")
    row = run_point(modeled_cfg(tmp_path / "t.json.gz"), tmp_path / "job", runner=ideal.run)
    assert row["status"] == "error" and "'seq_len': (32, 16)" in row["error"]
    row = run_point(modeled_cfg(tmp_path / "missing.json"), tmp_path / "job2", runner=ideal.run)
    assert row["status"] == "error" and "no such file" in row["error"]


def test_modeled_ideal_from_a_whole_step_trace_sums_its_kernel_times(tmp_path):
    # A TeraIO run's trace.json: the point's whole step (4 micro-batches of 2), profiled
    # within the capacity; its op times are the kernels' own, so they add up to Ideal's step.
    meta = {"model": TINY["name"], "batch_size": 8, "micro_batch_size": 2, "seq_len": 16}
    hand_trace(meta).save(tmp_path / "trace.json")
    row = run_point(modeled_cfg(tmp_path / "trace.json"), tmp_path / "job", runner=ideal.run)
    assert row["status"] == "ok", row["error"]
    (it,) = row["iterations"]
    assert it["seconds"] == 15.0 and row["measure"] == "modeled"
    row = run_point(modeled_cfg(tmp_path / "trace.json", micro_batch_size=4), tmp_path / "job2",
                    runner=ideal.run)
    assert row["status"] == "error" and "'micro_batch_size': (2, 4)" in row["error"]
