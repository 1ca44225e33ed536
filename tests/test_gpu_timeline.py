"""benchmarks.gpu_timeline: a TeraIO run's steps on the GPU, from its logs' GPU timeline."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from benchmarks.gpu_timeline import job_timeline
from teraio.core.plan import MigrationPlan
from teraio.core.trace import TensorRecord, Trace


def write_job(job, gpu=True):
    job.mkdir()
    Trace(["aten.mm.default"] * 3, np.array([1.0, 2.0, 0.5]),
          [TensorRecord(0, "param:w", 8, "param", True, [0, 2])]).save(job / "trace.json")
    ops = pd.DataFrame({"step": [3, 3, 3], "op": [0, 1, 2], "op_name": ["aten.mm.default"] * 3,
                        "t_start_s": [0.0, 0.1, 0.2], "seconds": [0.4, 0.3, np.nan], "stall_s": [0.2, 0.0, 0.3],
                        "gpu_start_s": [0.25, 1.25, 3.75] if gpu else [np.nan] * 3,
                        "gpu_end_s": [1.0, 3.5, 4.0] if gpu else [np.nan] * 3})
    ops.to_csv(job / "oplog.csv", index=False)
    pd.DataFrame({"step": [3, 3, 3], "tensor": ["a", "b", "c"], "tier": ["host", "host", "ssd"],
                  "direction": ["offload", "prefetch", "offload"], "nbytes": [2e9, 1e9, 1e9],
                  "op_issued": [0, 1, 0], "op_done": [1, 2, 1], "t_issued_s": [0.0, 0.1, 0.0],
                  "t_done_s": [0.3, 0.4, 0.5], "copy_s": [0.05, 0.1, np.nan],
                  "gpu_start_s": [0.3, 1.3, np.nan]}).to_csv(job / "transfers.csv", index=False)


def test_a_steps_span_stalls_and_copies_come_from_its_gpu_timeline(tmp_path):
    write_job(tmp_path / "job")
    t = job_timeline(tmp_path / "job")
    (step,) = t["steps"].values()
    assert step["span_s"] == pytest.approx(3.5) and step["stall_s"] == pytest.approx(0.5)
    assert step["ops_and_gaps_s"] == pytest.approx(3.0)
    assert step["gpu_idle_s"] == pytest.approx(0.25 + 0.25)  # op 0 ends at 1.0, op 1 starts 1.25; 3.5 to 3.75
    assert step["offload"]["gbps_while_copying"] == pytest.approx(40.0)  # 2 GB in 0.05 s
    assert step["prefetch"]["busy_share_of_span"] == pytest.approx(0.1 / 3.5)
    assert "ssd" not in step and t["profiled_op_seconds_sum"] == pytest.approx(3.5)
    # op 1's host held 0.3 s without a stall: a sync; the GPU waited 0.25 s before it, 0.25 s
    # after it, and ran it 0.25 s past its profiled 2 s. Op 0's 0.4 s held a stall (host time
    # too, a drive's read): not a sync.
    # Offload a (2 GB, launched at op 0) copied on the GPU from 0.3 to 0.35 s, after the host
    # issued op 1 (0.1 s): still to copy at the sync. No plan here: no live bytes. The GPU ran
    # 0.25, 1.15 and 3.55 s behind the host.
    assert step["host_syncs"] == {"count": 1, "ops": [1], "gpu_wait_s": pytest.approx(0.75),
                                  "at": [{"op": 1, "offloads_copying_gb": pytest.approx(2.0)}]}
    assert step["gpu_lag_s"] == pytest.approx(1.15)
    assert job_timeline(tmp_path / "job", host_sync_s=0.35)["steps"][3]["host_syncs"]["count"] == 0


def test_a_syncs_planned_live_bytes_come_from_the_runs_plan(tmp_path):
    write_job(tmp_path / "job")
    trace = Trace.load(tmp_path / "job" / "trace.json")
    MigrationPlan(trace.n_ops, 3 * 10**9, 8, 8, []).save(tmp_path / "job" / "plan.json")
    transfers = pd.read_csv(tmp_path / "job" / "transfers.csv")
    transfers.loc[0, "gpu_start_s"] = 0.0  # offload a copied by 0.05 s, before op 1 was issued
    transfers.to_csv(tmp_path / "job" / "transfers.csv", index=False)
    t = job_timeline(tmp_path / "job")
    assert t["capacity_gb"] == 3.0
    assert t["steps"][3]["host_syncs"]["at"] == [{"op": 1, "offloads_copying_gb": 0.0, "planned_live_gb": 8e-9}]


def test_host_syncs_are_skipped_for_a_step_whose_ops_are_not_the_planned_traces(tmp_path):
    write_job(tmp_path / "job")
    log = pd.read_csv(tmp_path / "job" / "oplog.csv")
    log.loc[2, "op_name"] = "aten.add.Tensor"  # a step after a re-plan ran other ops
    log.to_csv(tmp_path / "job" / "oplog.csv", index=False)
    assert "skipped" in job_timeline(tmp_path / "job")["steps"][3]["host_syncs"]


def test_logs_without_a_gpu_timeline_say_so(tmp_path):
    write_job(tmp_path / "job", gpu=False)
    assert "no_gpu_timeline" in job_timeline(tmp_path / "job")
    with pytest.raises(ValueError, match="no oplog.csv"):
        job_timeline(tmp_path)
