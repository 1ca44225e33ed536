"""The shared measurement loop (teraio.systems.loop): what it times, records and prints, and that a
loss that is not finite stops every system's run, TeraIO's included."""
from __future__ import annotations

import contextlib
import gc
import time
import weakref

import pytest
import torch

import teraio.systems.loop
import teraio.trainer.runner
import teraio.trainer.trainer
import teraio.workload.pipeline
from teraio.config import WorkloadConfig, run_config_from_dict
from teraio.systems.loop import Step, Steps, StepStats, measure_steps
from teraio.result import Measurements, measured_before
from teraio.harness.checks import validate
from teraio.harness.run import run_point

CPU = torch.device("cpu")
WORK = WorkloadConfig(batch_size=2, micro_batch_size=1, seq_len=8, warmup_steps=2, measure_steps=3)


def test_steps_are_timed_recorded_and_printed(capsys):
    prepared = []

    def step_fn(step):
        prepared.append(step)
        if step == 3:
            return None  # run outside the loop: neither timed nor measured
        time.sleep(0.2)  # set-up before the timer starts
        return Step(lambda: float(step), lambda: StepStats(stall_count=step, note=f" stalls {step}",
                                                         extra={"urgent_count": 1}))

    out = Steps()
    steps = measure_steps(step_fn, WORK, CPU, first_step=1, out=out)
    assert steps is out and prepared == [1, 2, 3, 4]
    assert steps.losses == {1: 1.0, 2: 2.0, 4: 4.0}
    assert [i["step"] for i in steps.iterations] == [2, 4]
    for i in steps.iterations:
        assert i["seconds"] < 0.1  # the set-up is not timed
        assert i["tokens"] == 16 and i["stall_count"] == i["step"] and i["urgent_count"] == 1
        assert i["migration_seconds"] is None and i["bytes_offloaded"] == {"ssd": None, "host": None}
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["1", "2", "4"]
    assert lines[0].endswith("loss 1.000000 stalls 1 (warm-up)") and lines[2].endswith("loss 4.000000 stalls 4")
    measure_steps(step_fn, WORK, CPU, progress=False)
    assert capsys.readouterr().out == ""


def test_each_step_records_what_the_allocator_did_in_its_timed_region_only(monkeypatch):
    counts = {"alloc_retries": 0, "sync_all_streams": 0, "device_allocs": 0, "device_frees": 0}

    def events(device):  # the allocator's counters since the start, as on CUDA
        return None if device.type == "cpu" else dict(counts)

    def work(step):
        counts["device_allocs"] += 100  # before the timer: not the step's
        return Step(lambda: counts.update(alloc_retries=counts["alloc_retries"] + step,
                                          device_allocs=counts["device_allocs"] + 1) or 1.0,
                    lambda: counts.update(device_frees=counts["device_frees"] + 7) or StepStats())  # after it

    monkeypatch.setattr(teraio.systems.loop, "allocator_events", events)
    monkeypatch.setattr(teraio.systems.loop, "timed", lambda device: contextlib.nullcontext({"seconds": 1.0}))
    its = measure_steps(work, WORK, torch.device("meta"), progress=False).iterations
    assert [i["allocator"] for i in its] == [
        {"alloc_retries": s, "sync_all_streams": 0, "device_allocs": 1, "device_frees": 0} for s in (2, 3, 4)]
    assert "allocator" not in measure_steps(lambda step: Step(lambda: 1.0), WORK, CPU).iterations[0]


def test_a_row_names_the_allocator_settings_pytorch_reads_first(monkeypatch):
    from teraio.systems.measure import allocator_conf

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert allocator_conf() == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    assert allocator_conf() == "max_split_size_mb:512"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    assert allocator_conf() is None


def test_a_loss_that_is_not_finite_stops_the_loop_naming_the_step(capsys):
    out = Steps()
    with pytest.raises(FloatingPointError, match=r"^step 3: loss nan is not finite$"):
        measure_steps(lambda step: Step(lambda: float("nan") if step == 3 else 1.0), WORK, CPU, out=out)
    assert [i["step"] for i in out.iterations] == [2]  # kept: measured before the failure
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["0", "1", "2"]


class _Cycle:
    """An object in a reference cycle with itself: only the collector frees it."""

    def __init__(self):
        self.me = self


def test_each_timed_step_runs_with_what_lived_before_it_frozen_and_the_loop_leaves_nothing_frozen():
    held = {"cycle": _Cycle()}  # lives before the loop, then dropped by step 1's work
    gone = weakref.ref(held["cycle"])
    seen = {}

    def step_fn(step):
        def run():
            seen[step] = (gc.get_freeze_count(), gone() is None)
            held.pop("cycle", None)  # garbage now, in a cycle the step before froze
            return 1.0
        return Step(run)

    gc.unfreeze()
    measure_steps(step_fn, WORK, CPU, progress=False)
    assert all(frozen > 0 for frozen, _ in seen.values())  # the collections in a step skip them
    # frozen at step 0 and dropped in it, the cycle is collected before step 1: nothing frozen leaks
    assert seen[0] == (seen[0][0], False) and all(dead for _, dead in list(seen.values())[1:]), seen
    assert gc.get_freeze_count() == 0
    with pytest.raises(FloatingPointError):
        measure_steps(lambda step: Step(lambda: float("nan")), WORK, CPU, progress=False)
    assert gc.get_freeze_count() == 0  # also after a failure


def teraio_cfg(ssd_dir):
    return run_config_from_dict({
        "model": {"name": "tiny", "dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 128},
        "workload": {"batch_size": 2, "micro_batch_size": 1, "seq_len": 16, "warmup_steps": 2,
                     "measure_steps": 3},
        "hardware": {"device": "cpu", "ssd_dirs": [str(ssd_dir)], "ssd_write_gbps": 50.0, "ssd_read_gbps": 50.0,
                     "host_d2h_gbps": 50.0, "host_h2d_gbps": 50.0},
        "system": {"name": "teraio_ssd"}})


def test_teraio_stops_at_a_loss_that_is_not_finite(tmp_path, monkeypatch):
    # Step 3 (an engine step of the loop) trains as planned, and its loss comes back nan.
    current = []
    make_batch, train_step = teraio.trainer.trainer.make_batch, teraio.workload.pipeline.train_step
    monkeypatch.setattr(teraio.trainer.trainer, "make_batch", lambda step, *a: current.append(step) or make_batch(step, *a))
    monkeypatch.setattr(teraio.workload.pipeline, "train_step",
                        lambda *a: train_step(*a) * (float("nan") if current[-1] == 3 else 1.0))
    cfg = teraio_cfg(tmp_path)
    (tmp_path / "job").mkdir()
    with pytest.raises(FloatingPointError, match=r"^step 3: loss nan is not finite$") as err:
        teraio.trainer.runner.run(cfg, tmp_path / "job", CPU)
    measured = measured_before(err.value)
    assert [i["step"] for i in measured.iterations] == [2] and measured.extras["plan"]["shortfall_bytes"] == 0

    row = run_point(cfg, tmp_path / "job")
    assert row["status"] == "error" and "step 3: loss nan is not finite" in row["error"]
    assert [i["step"] for i in row["iterations"]] == [2] and row["tokens_per_s"] is None


class FakeClock:
    """Steps of ``seconds`` each on a clock of its own: the loop's ``timed`` and ``time.time``."""

    def __init__(self, seconds: float):
        self.now, self.seconds = 1000.0, seconds

    def time(self) -> float:
        return self.now

    @contextlib.contextmanager
    def timed(self, device):
        out = {}
        yield out
        self.now += self.seconds
        out["seconds"] = self.seconds


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock(10.0)
    monkeypatch.setattr(teraio.systems.loop, "timed", c.timed)
    monkeypatch.setattr(teraio.systems.loop.time, "time", c.time)
    monkeypatch.setattr(teraio.systems.loop, "END_MARGIN_S", 5.0)
    return c


def test_a_step_that_alone_outlasts_the_time_limit_is_measured_cold(clock, monkeypatch, capsys):
    # warm-up step 0 ends at 1010; another would end at 1020 + 5 s to spare > 1024: measure step 0.
    monkeypatch.setenv(teraio.systems.loop.DEADLINE_ENV, "1024")
    work = WorkloadConfig(batch_size=2, micro_batch_size=1, seq_len=8, warmup_steps=2, measure_steps=3)
    steps = measure_steps(lambda step: Step(lambda: 1.0), work, CPU)
    (it,) = steps.iterations
    assert it["step"] == 0 and it["time_limit"] == "cold" and it["seconds"] == 10.0
    assert steps.losses == {0: 1.0}
    assert capsys.readouterr().out.splitlines() == [
        "step 0 10.000s 1.6 tokens/s loss 1.000000 (measured cold: another step would outlast the time limit)"]


def test_the_loop_stops_before_the_time_limit_with_the_steps_measured_so_far(clock):
    work = WorkloadConfig(batch_size=2, micro_batch_size=1, seq_len=8, warmup_steps=1, measure_steps=4)
    # Steps end at 1010, 1020, 1030: after step 2 another would end at 1040 + 5 > 1044.
    steps = measure_steps(lambda step: Step(lambda: 1.0), work, CPU, deadline=1044.0)
    assert [(i["step"], i.get("time_limit")) for i in steps.iterations] == [(1, None), (2, "cut")]
    # Room for every step: none is marked, and the last is never cut.
    steps = measure_steps(lambda step: Step(lambda: 1.0), work, CPU, deadline=clock.now + 55.0)
    assert [(i["step"], i.get("time_limit")) for i in steps.iterations] == [(1, None), (2, None), (3, None),
                                                                           (4, None)]
    assert "time_limit" not in measure_steps(lambda step: Step(lambda: 1.0), work, CPU).iterations[0]
    # A warm-up step after the first: measured (it had a warm-up), the steps cut short.
    work = WorkloadConfig(batch_size=2, micro_batch_size=1, seq_len=8, warmup_steps=3, measure_steps=2)
    steps = measure_steps(lambda step: Step(lambda: 1.0), work, CPU, deadline=clock.now + 34.0)
    assert [(i["step"], i.get("time_limit")) for i in steps.iterations] == [(1, "cut")]
    assert list(steps.losses) == [0, 1]


def test_the_row_says_its_step_was_measured_cold(clock, tmp_path, monkeypatch):
    monkeypatch.setenv(teraio.systems.loop.DEADLINE_ENV, str(clock.now + 12.0))
    cfg = run_config_from_dict({"model": {"name": "tiny", "dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 128},
                                "system": {"name": "ideal"}, "timeout_s": 600,
                                "workload": {"batch_size": 2, "micro_batch_size": 1, "seq_len": 8,
                                             "warmup_steps": 1, "measure_steps": 3}})
    row = run_point(cfg, tmp_path, runner=lambda cfg, job_dir, device: Measurements(
        iterations=measure_steps(lambda step: Step(lambda: 1.0), cfg.workload, device).iterations))
    assert row["status"] == "ok", row["error"]
    assert row["time_limited"] == {"reason": "cold", "measured_steps": 1, "asked_steps": 3, "timeout_s": 600}


def test_every_system_warms_up_before_it_is_measured():
    cfg = run_config_from_dict({"model": {"name": "tiny", "dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 128},
                                "system": {"name": "ideal"}, "workload": {"warmup_steps": 0}})
    with pytest.raises(ValueError, match=r"workload.warmup_steps=0 >= 1 \(every system warms up"):
        validate(cfg, check_device=False, make_ssd_dirs=False, runs_dir="runs")
