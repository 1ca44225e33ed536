"""The Ideal baseline: the shared step, unmodified, with a valid row."""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from baselines import ideal
from teraio.systems.capacity import EmulatedCapacity
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
        "name": "ideal", "options": {"measure": "modeled", "modeled_traces": {TINY["name"]: str(trace_file)}}}})


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


# A small Llama3 whose whole step fits: 4 micro-batches of 2 x 128 tokens.
SMALL = {"name": "llama3_small", "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
         "vocab_size": 2048, "multiple_of": 64}


def small_cfg(**options):
    return run_config_from_dict({
        "model": SMALL, "system": {"name": "ideal", "options": options}, "seed": 1,
        "workload": {"batch_size": 8, "micro_batch_size": 2, "seq_len": 128, "warmup_steps": 2,
                     "measure_steps": 5}})


class OpClock(TorchDispatchMode):
    """A clock that advances 1 ms per aten op run under it (``now``, seconds): a step's time
    is the work it runs, whatever else the machine runs beside it."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.now += 1e-3
        return func(*args, **(kwargs or {}))


def test_composed_ideal_times_the_step_as_the_measured_one_does(tmp_path, monkeypatch):
    # Timed by the work it runs (OpClock as time.perf_counter), not by the wall clock, which
    # on the shared 2-core CI machine other processes stretch by up to 2x from one second to
    # the next: the composed step (4 forward+backward micro-batches and one optimizer step,
    # each phase repeated) runs the measured step's ops but its few bookkeeping ones (the
    # loss sum and read, zero_grad), so the two times agree within 3 %; a phase left out or
    # counted twice moves them apart by a third or more.
    clock = OpClock()
    monkeypatch.setattr(time, "perf_counter", lambda: clock.now)
    with clock:
        measured = run_point(small_cfg(measure="measured"), tmp_path / "m", runner=ideal.run)
        composed = run_point(small_cfg(measure="composed", phase_repeats=5), tmp_path / "c", runner=ideal.run)
    assert measured["status"] == composed["status"] == "ok", (measured["error"], composed["error"])
    assert measured["measure"] == "measured" and composed["measure"] == "composed"
    c = composed["composed"]
    assert c["micro_batches"] == 4 and len(c["micro_batch_seconds"]) == len(c["optimizer_seconds"]) == 5
    (it,) = composed["iterations"]
    assert it["seconds"] == pytest.approx(4 * np.mean(c["micro_batch_seconds"]) + np.mean(c["optimizer_seconds"]))
    assert it["loss"] is None and "losses" not in composed and composed["unoffloaded_peak_bytes"] is None
    steps = [i["seconds"] for i in measured["iterations"]]
    assert len(steps) == 5 and max(steps) == pytest.approx(min(steps))  # the same work every step
    ratio = it["seconds"] / steps[0]
    assert 0.97 <= ratio <= 1.0, (f"composed {it['seconds']:.3f} s vs measured {steps[0]:.3f} s of op time "
                                  f"(ratio {ratio:.3f}); phases {c}")


def peak_of(fn) -> int:
    """Peak live CPU bytes of ``fn()`` (teraio.systems.capacity's count, no cap binding)."""
    with EmulatedCapacity(1 << 50, torch.device("cpu"), "fraction") as cap:
        fn()
    return cap.peak_bytes


def tiny_cfg(**options):
    return run_config_from_dict({
        "model": TINY, "system": {"name": "ideal", "options": options}, "seed": 1,
        "workload": {"batch_size": 4, "micro_batch_size": 2, "seq_len": 32, "warmup_steps": 1,
                     "measure_steps": 1}})


def test_ideal_composes_where_the_step_does_not_fit_and_models_only_where_a_micro_batch_does_not(tmp_path):
    cpu = torch.device("cpu")
    step_peak = peak_of(lambda: ideal.run_measured(tiny_cfg(), cpu))
    phase_peak = peak_of(lambda: ideal.run_composed(tiny_cfg(phase_repeats=1), cpu))
    assert phase_peak < step_peak  # AdamW's states are not beside the activations

    # Between the two: the whole step runs out, one micro-batch and the optimizer step fit.
    row = run_point(tiny_cfg(capacity_bytes=(phase_peak + step_peak) // 2, phase_repeats=1), tmp_path / "a",
                    runner=ideal.run)
    assert row["status"] == "ok", row["error"]
    assert row["measure"] == "composed"
    (fell,) = row["fell_back_from"]
    assert fell["measure"] == "measured" and fell["status"] == "oom" and "emulated capacity" in fell["message"]

    # Below the phases' peak: modeled from the trace where one is named, else the row is oom.
    meta = {"model": TINY["name"], "n_layers": 2, "batch_size": 2, "micro_batch_size": 2, "seq_len": 32}
    hand_trace(meta).save(tmp_path / "t.json.gz")
    low = tiny_cfg(capacity_bytes=phase_peak * 9 // 10, phase_repeats=1,
                    modeled_traces={TINY["name"]: str(tmp_path / "t.json.gz")})
    row = run_point(low, tmp_path / "b", runner=ideal.run)
    assert row["status"] == "ok", row["error"]
    assert row["measure"] == "modeled"
    assert [f["measure"] for f in row["fell_back_from"]] == ["measured", "composed"]
    assert row["iterations"][0]["seconds"] == 2 * 6.0 + 9.0
    row = run_point(tiny_cfg(capacity_bytes=phase_peak * 9 // 10, phase_repeats=1), tmp_path / "c",
                    runner=ideal.run)
    assert row["status"] == "oom" and "emulated capacity" in row["error"]

    # Forced: composed alone reports its own oom, never a measured row.
    row = run_point(tiny_cfg(measure="composed", capacity_bytes=phase_peak * 9 // 10), tmp_path / "d",
                    runner=ideal.run)
    assert row["status"] == "oom"


def test_ideal_checks_its_options():
    for options, match in (({"measure": "guessed"}, r"measure='guessed'; valid"),
                           ({"capacity_bytes": 0}, r"capacity_bytes=0; must be a positive int"),
                           ({"phase_repeats": 0}, r"phase_repeats=0; must be an int >= 1"),
                           ({"modeled_traces": "t.json"}, r"modeled_traces='t.json'")):
        with pytest.raises(ValueError, match=match):
            ideal.check_options("ideal", options)
    with pytest.raises(ValueError, match=r"measure=modeled needs modeled_traces.llama3_small"):
        ideal.run(small_cfg(measure="modeled"), Path("."), torch.device("cpu"))


def test_a_modeled_ideal_from_a_damaged_trace_names_the_file(tmp_path):
    damaged = tmp_path / "trace.json.gz"
    damaged.write_bytes(b"\x1f\x8b\x08\x00truncated")
    cfg = run_config_from_dict({"model": {"name": "m"}, "system": {"name": "ideal"},
                                "workload": {"batch_size": 2, "micro_batch_size": 1}})
    with pytest.raises(ValueError, match=rf"{damaged} is damaged"):
        ideal.run_modeled(cfg, damaged)
