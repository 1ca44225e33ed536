"""Where a TeraIO run's steps went on the GPU, from its logs' own GPU timeline: each op's start
on the compute stream and each host-tier copy's start and seconds on its stream
(``oplog.csv``'s and ``transfers.csv``'s ``gpu_start_s``, ``copy_s``; ``teraio.core.engine``).

Per logged step: the step's span on the compute stream (first op's start to the last op's),
the stalls the engine measured (the compute stream's waits, and the training thread's), the
rest of the span (the ops' own time and the gaps where the GPU waited for the host to issue
work: an op's span from its start to the next op's start is its kernels plus any gap), and
per direction of the host link the bytes its copies moved, the seconds they ran and the
rate while running, and the share of the span its stream was busy; where the logs have each
op's end too (``gpu_end_s``), the seconds the compute stream ran none of the ops between the
first op and the last (``gpu_idle_s``), and the ops in which the host most likely waited for
the device (``host_syncs``: those whose host time, ``oplog.csv``'s ``seconds``, is at least
``--host-sync-s`` and in which the engine measured no stall, whose waits for a drive or a
host update are host time too; the host issues an op in well under a millisecond, so these
held a device sync: the caching allocator releasing its cached memory to fit an allocation
under the capacity, which waits for the stream, or a read of a device value) with the seconds
the compute stream waited for the host around them (the gaps before and after each, and its
span past its profiled seconds), and at each of those ops (``at``) the bytes the plan had
live there (``planned_live_gb``, ``teraio.core.planner.predicted_live_bytes``, beside the
plan's ``capacity_gb``) and the bytes of host-tier offloads launched before it whose copy
ended on the GPU after the host issued it (``offloads_copying_gb``: with ``device_waits``,
memory freed to the caching allocator but not reusable until the copy ran; the host's clock,
``oplog.csv``'s ``t_start_s``, and the GPU's both count from the step's start, which finds the
device idle); per step, how far the GPU ran behind the host (``gpu_lag_s``: the median over
the ops of ``gpu_start_s - t_start_s``). The profiled seconds are the trace's the run planned
(``teraio.perf.replay.replayed_trace``: without the device updates of parameters updated in
host memory); a step whose ops are not that trace's (a step after a re-plan) has
``host_syncs`` ``{"skipped": why}``. Beside them, the trace's profiled op seconds (what the
plan and the simulator take the ops to cost).

    python -m benchmarks.gpu_timeline JOB_DIR [JOB_DIR ...] --out timeline.json [--host-sync-s 0.1]

A job dir whose logs have no GPU timeline (CPU runs, logs made before it) is reported so.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks import command
from teraio.core.planner import predicted_live_bytes
from teraio.perf import jobdir
from teraio.perf.replay import replayed_trace


HOST_SYNC_S = 0.1
"""Default ``--host-sync-s``: host seconds in one op that mark a device sync inside it."""


def step_timeline(ops: pd.DataFrame, transfers: pd.DataFrame, profiled: tuple[list[str], np.ndarray] | None = None,
                  host_sync_s: float = HOST_SYNC_S, live: np.ndarray | None = None) -> dict:
    """One step's figures (module docstring) from its op rows (``op``, ``gpu_start_s``,
    ``stall_s``; ``t_start_s``, ``gpu_end_s``, ``seconds`` and ``op_name`` where logged) and its transfer rows
    (``tier``, ``direction``, ``nbytes``, ``copy_s``, ``gpu_start_s``; ``op_issued`` for
    ``host_syncs``' ``at``); ``host_syncs`` where the ops have their ends and ``profiled`` (the
    planned trace's op names and seconds, indexed by op) is given, with the plan's live bytes
    per op (``live``, bytes) where given. Seconds; GB = 1e9 bytes."""
    start = ops.sort_values("op")["gpu_start_s"].to_numpy(dtype=float)
    span = float(start[-1] - start[0])
    out = {"span_s": span, "stall_s": float(ops["stall_s"].sum()),
           "ops_and_gaps_s": span - float(ops["stall_s"].sum())}
    if "t_start_s" in ops:
        out["gpu_lag_s"] = float(np.median(ops["gpu_start_s"] - ops["t_start_s"]))
    host = transfers[(transfers["tier"] == "host") & transfers["copy_s"].notna()]
    if "gpu_end_s" in ops and ops["gpu_end_s"].notna().all():  # where the GPU ran none of the ops
        o = ops.sort_values("op")
        gaps = np.clip(o["gpu_start_s"].to_numpy(dtype=float)[1:] - o["gpu_end_s"].to_numpy(dtype=float)[:-1],
                       0, None)
        out["gpu_idle_s"] = float(gaps.sum())
        if profiled is not None and "seconds" in o:
            out["host_syncs"] = _host_syncs(o, gaps, *profiled, host_sync_s, host[host["direction"] == "offload"], live)
    for direction, g in host.groupby("direction"):
        seconds = float(g["copy_s"].sum())
        out[direction] = {"gb": float(g["nbytes"].sum()) / 1e9, "copy_s": seconds,
                          "gbps_while_copying": float(g["nbytes"].sum()) / seconds / 1e9 if seconds > 0 else None,
                          "busy_share_of_span": seconds / span if span > 0 else None}
    return out


def _host_syncs(o: pd.DataFrame, gaps: np.ndarray, names: list[str], seconds: np.ndarray,
                host_sync_s: float, offloads: pd.DataFrame, live: np.ndarray | None) -> dict:
    """``host_syncs`` (module docstring) of one step's op rows ``o`` (in op order) with the
    compute stream's idle ``gaps`` between them, against the planned trace's op ``names`` and
    profiled ``seconds``; ``offloads``: the step's host-tier offloads with their copies'
    ``gpu_start_s`` and ``copy_s``; ``live``: the plan's live bytes per op, or None."""
    idx = o["op"].to_numpy()
    if len(o) != len(names) or "op_name" not in o or list(o["op_name"]) != [names[k] for k in idx]:
        return {"skipped": "the step's ops are not the planned trace's (a step after a re-plan?)"}
    host = o["seconds"].to_numpy(dtype=float)  # NaN (the step's last op): not counted
    synced = np.flatnonzero((host >= host_sync_s) & (o["stall_s"].to_numpy(dtype=float) <= 0))
    around = sorted({g for k in synced for g in (k - 1, k) if 0 <= g < len(gaps)})  # before and after each
    spans = o["gpu_end_s"].to_numpy(dtype=float) - o["gpu_start_s"].to_numpy(dtype=float)
    past = np.clip(spans - seconds[idx], 0, None)
    host_start = o["t_start_s"].to_numpy(dtype=float)
    issued = offloads["op_issued"].to_numpy()
    copy_end = (offloads["gpu_start_s"] + offloads["copy_s"]).to_numpy(dtype=float)
    nbytes = offloads["nbytes"].to_numpy(dtype=float)
    at = []
    for k in synced:
        entry = {"op": int(idx[k]), "offloads_copying_gb":
                 float(nbytes[(issued < idx[k]) & (copy_end > host_start[k])].sum()) / 1e9}
        if live is not None:
            entry["planned_live_gb"] = float(live[idx[k]]) / 1e9
        at.append(entry)
    return {"count": len(synced), "ops": [int(idx[k]) for k in synced],
            "gpu_wait_s": float(gaps[around].sum() + past[synced].sum()), "at": at}


def job_timeline(job: Path, host_sync_s: float = HOST_SYNC_S) -> dict:
    """:func:`step_timeline` of every logged step of the TeraIO run in ``job``, with the
    trace's profiled op seconds; ``{"no_gpu_timeline": reason}`` where the logs have none.
    ``host_syncs_skipped`` says why no step has ``host_syncs`` where the planned trace cannot
    be rebuilt (``teraio.perf.replay.replayed_trace``).

    Raises:
        ValueError: the job dir has no op or transfer log (``teraio.perf.jobdir``).
    """
    found = {name: jobdir.side_file(job, name) for name in ("oplog.csv", "transfers.csv")}
    missing = [n for n, p in found.items() if p is None]
    if missing:
        raise ValueError(f"{job}: no {', '.join(missing)} (or .gz)")
    ops, transfers = pd.read_csv(found["oplog.csv"]), pd.read_csv(found["transfers.csv"])
    if "gpu_start_s" not in ops or ops["gpu_start_s"].isna().all():
        return {"no_gpu_timeline": "its logs hold no gpu_start_s (a CPU run, or logs made before the GPU timeline)"}
    trace = jobdir.read_trace(jobdir.side_file(job, "trace.json"))
    out: dict = {}
    live = None
    try:  # the trace the run planned, whose ops its logs number
        plan = jobdir.plan(job) if jobdir.side_file(job, "plan.json") else None
        planned = replayed_trace(trace, plan)[0] if plan is not None else trace
        profiled = (list(planned.op_names), np.asarray(planned.op_seconds, dtype=float))
        if plan is not None:
            live = predicted_live_bytes(planned, plan)
            out["capacity_gb"] = plan.capacity_bytes / 1e9
    except ValueError as e:  # a plan that updates parameters on the host without naming them
        profiled, out["host_syncs_skipped"] = None, str(e)
    steps = {int(s): step_timeline(g, transfers[transfers["step"] == s], profiled, host_sync_s, live)
             for s, g in ops.groupby("step")}
    spans = [v["span_s"] for v in steps.values()]
    return {"steps": steps, "median_span_s": float(np.median(spans)),
            "profiled_op_seconds_sum": float(trace.op_seconds.sum()), **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jobs", nargs="+", type=Path, metavar="JOB_DIR")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--host-sync-s", type=float, default=HOST_SYNC_S,
                    help=f"host seconds in one op that mark a device sync (default {HOST_SYNC_S})")
    args = ap.parse_args()
    if not args.host_sync_s > 0:
        ap.error(f"--host-sync-s={args.host_sync_s}: must be > 0")
    out = {"command": command("benchmarks.gpu_timeline", sys.argv[1:]), "jobs": {}}
    for job in args.jobs:
        try:
            out["jobs"][str(job)] = job_timeline(job, args.host_sync_s)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    args.out.write_text(json.dumps(out, indent=1))
    for job, t in out["jobs"].items():
        print(job, t.get("median_span_s", t.get("no_gpu_timeline")))


if __name__ == "__main__":
    main()
