"""The shared measurement loop (teraio.systems.loop): what it times, records and prints, and that a
loss that is not finite stops every system's run, TeraIO's included."""
from __future__ import annotations

import time

import pytest
import torch

import teraio.systems.teraio
import teraio.workload.pipeline
from teraio.config import WorkloadConfig, run_config_from_dict
from teraio.systems.loop import Step, Steps, StepStats, measure_steps
from teraio.result import measured_before
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


def test_a_loss_that_is_not_finite_stops_the_loop_naming_the_step(capsys):
    out = Steps()
    with pytest.raises(FloatingPointError, match=r"^step 3: loss nan is not finite$"):
        measure_steps(lambda step: Step(lambda: float("nan") if step == 3 else 1.0), WORK, CPU, out=out)
    assert [i["step"] for i in out.iterations] == [2]  # kept: measured before the failure
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["0", "1", "2"]


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
    make_batch, train_step = teraio.systems.teraio.make_batch, teraio.workload.pipeline.train_step
    monkeypatch.setattr(teraio.systems.teraio, "make_batch", lambda step, *a: current.append(step) or make_batch(step, *a))
    monkeypatch.setattr(teraio.workload.pipeline, "train_step",
                        lambda *a: train_step(*a) * (float("nan") if current[-1] == 3 else 1.0))
    cfg = teraio_cfg(tmp_path)
    (tmp_path / "job").mkdir()
    with pytest.raises(FloatingPointError, match=r"^step 3: loss nan is not finite$") as err:
        teraio.systems.teraio.run(cfg, tmp_path / "job", CPU)
    measured = measured_before(err.value)
    assert [i["step"] for i in measured.iterations] == [2] and measured.extras["plan"]["shortfall_bytes"] == 0

    row = run_point(cfg, tmp_path / "job")
    assert row["status"] == "error" and "step 3: loss nan is not finite" in row["error"]
    assert [i["step"] for i in row["iterations"]] == [2] and row["tokens_per_s"] is None
