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
first op and the last (``gpu_idle_s``), and the ops in which the host waited for the device
(``host_syncs``: those whose host time, ``oplog.csv``'s ``seconds``, is at least
``--host-sync-s``; the host issues an op in well under a millisecond, so these held a
device sync: the caching allocator releasing its cached memory to fit an allocation under
the capacity, which waits for every stream, or a read of a device value such as the loss)
with the seconds the compute stream waited for the host around them (the gap before each
and its span past its profiled seconds). Beside them, the trace's profiled op seconds (what
the plan and the simulator take the ops to cost).

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
from teraio.perf import jobdir


HOST_SYNC_S = 0.1
"""Default ``--host-sync-s``: host seconds in one op that mark a device sync inside it."""


def step_timeline(ops: pd.DataFrame, transfers: pd.DataFrame, profiled: np.ndarray | None = None,
                  host_sync_s: float = HOST_SYNC_S) -> dict:
    """One step's figures (module docstring) from its op rows (``op``, ``gpu_start_s``,
    ``stall_s``; ``gpu_end_s`` and ``seconds`` where logged) and its transfer rows (``tier``,
    ``direction``, ``nbytes``, ``copy_s``, ``gpu_start_s``); ``host_syncs`` where the ops have
    their ends and ``profiled`` (the trace's op seconds, indexed by op) is given. Seconds;
    GB = 1e9 bytes."""
    start = ops.sort_values("op")["gpu_start_s"].to_numpy(dtype=float)
    span = float(start[-1] - start[0])
    out = {"span_s": span, "stall_s": float(ops["stall_s"].sum()),
           "ops_and_gaps_s": span - float(ops["stall_s"].sum())}
    if "gpu_end_s" in ops and ops["gpu_end_s"].notna().all():  # where the GPU ran none of the ops
        o = ops.sort_values("op")
        gaps = o["gpu_start_s"].to_numpy(dtype=float)[1:] - o["gpu_end_s"].to_numpy(dtype=float)[:-1]
        out["gpu_idle_s"] = float(np.clip(gaps, 0, None).sum())
        if profiled is not None and "seconds" in o:
            synced = np.flatnonzero(o["seconds"].to_numpy(dtype=float) >= host_sync_s)  # NaN: not synced
            op_spans = o["gpu_end_s"].to_numpy(dtype=float) - o["gpu_start_s"].to_numpy(dtype=float)
            before = np.concatenate([[0.0], np.clip(gaps, 0, None)])
            past = np.clip(op_spans - profiled[o["op"].to_numpy()], 0, None)
            out["host_syncs"] = {"count": len(synced), "ops": [int(o["op"].iloc[i]) for i in synced],
                                 "gpu_wait_s": float((before[synced] + past[synced]).sum())}
    host = transfers[(transfers["tier"] == "host") & transfers["copy_s"].notna()]
    for direction, g in host.groupby("direction"):
        seconds = float(g["copy_s"].sum())
        out[direction] = {"gb": float(g["nbytes"].sum()) / 1e9, "copy_s": seconds,
                          "gbps_while_copying": float(g["nbytes"].sum()) / seconds / 1e9 if seconds > 0 else None,
                          "busy_share_of_span": seconds / span if span > 0 else None}
    return out


def job_timeline(job: Path, host_sync_s: float = HOST_SYNC_S) -> dict:
    """:func:`step_timeline` of every logged step of the TeraIO run in ``job``, with the
    trace's profiled op seconds; ``{"no_gpu_timeline": reason}`` where the logs have none.

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
    profiled = np.asarray(trace.op_seconds, dtype=float)
    steps = {int(s): step_timeline(g, transfers[transfers["step"] == s], profiled, host_sync_s)
             for s, g in ops.groupby("step")}
    spans = [v["span_s"] for v in steps.values()]
    return {"steps": steps, "median_span_s": float(np.median(spans)),
            "profiled_op_seconds_sum": float(trace.op_seconds.sum())}


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
