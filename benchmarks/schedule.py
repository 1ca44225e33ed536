"""TeraIO's schedule against today's plan, on CPU, over committed runs: for each job
directory (its ``trace.json[.gz]`` and ``plan.json[.gz]``), plan the trace at the committed
plan's capacity, host cap, drive and host rates and options, the host packing chosen as the
systems choose it today (``host_arena="auto"``), twice: as today (tiers only) and with
``recompute="auto"`` (``teraio.perf.choose.plan_fastest``: each candidate
moved to SSD, to host memory, or dropped and recomputed), and replay both through the
simulator (``teraio.perf.simulator.simulate``, FIFO, one drive for both directions).

    python -m benchmarks.schedule JOB_DIR [JOB_DIR ...] --out FILE.json

Per job: ``ideal_s`` (the sum of op times), ``today_simulated_s``, ``schedule_simulated_s``,
and the schedule's bytes per iteration, each direction: ``recomputed_bytes``, ``ssd_bytes``,
``host_bytes``; with ``host_cap_bytes``, ``capacity_bytes``, the plan kept by ``"auto"``
(``recompute``), both plans' planning seconds and shortfalls. ``--out`` is replaced atomically.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import command, refusing
from teraio.core.plan import MigrationPlan
from teraio.core.recompute import is_inplace
from teraio.core.trace import Trace
from teraio.files import write_atomic
from teraio.perf import jobdir
from teraio.perf.replay import plan_as_committed, plan_tiers
from teraio.perf.simulator import simulate


def ssd_bytes_by_kind(trace: Trace, plan: MigrationPlan) -> dict[str, int]:
    """Bytes per iteration ``plan`` moves to the drive, by kind of tensor (module docstring)."""
    out: dict[str, int] = {}
    for m in plan.migrations:
        if m.tier != "ssd":
            continue
        t = trace.tensors[m.tid]
        if t.persistent:
            kind = t.name.split(":", 1)[0]
        else:
            kind = "accumulated" if any(is_inplace(trace.op_names[u]) for u in t.uses[1:]) else "activation"
        out[kind] = out.get(kind, 0) + m.nbytes
    return dict(sorted(out.items()))


def schedule(job: Path) -> dict:
    """Today's plan and the schedule with recompute of ``job``, simulated side by side.

    Raises:
        ValueError: ``job`` lacks its trace or plan.
    """
    trace, committed = jobdir.trace(job), jobdir.plan(job)
    tiers = plan_tiers(committed)
    shared = committed.meta["shared_ssd"]
    out = {"job": str(job), "host_cap_bytes": committed.meta["host_cap_bytes"],
           "capacity_bytes": committed.capacity_bytes, "tiers_gbps": committed.meta["tiers_gbps"],
           "ideal_s": float(trace.op_seconds.sum())}
    for key, recompute in (("today", False), ("schedule", "auto")):
        t0 = time.perf_counter()
        plan = plan_as_committed(trace, committed, host_arena="auto", recompute=recompute)
        seconds = time.perf_counter() - t0
        out[f"{key}_simulated_s"] = simulate(trace, plan, tiers, shared_ssd=shared,
                                             stream_frees=plan.meta["stream_frees"]).iteration_seconds
        out[f"{key}_plan_seconds"] = seconds
        out[f"{key}_shortfall_bytes"] = plan.shortfall_bytes
    tiers_bytes = plan.bytes_per_tier()
    out.update(recomputed_bytes=plan.recomputed_bytes(), ssd_bytes=tiers_bytes["ssd"],
               host_bytes=tiers_bytes["host"], recompute=plan.meta["recompute"],
               recompute_auto=plan.meta.get("recompute_auto"), ssd_bytes_by_kind=ssd_bytes_by_kind(trace, plan))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jobs", nargs="+", type=Path, help="job directories with trace and plan")
    ap.add_argument("--out", type=Path, required=True)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    rows = []
    for job in args.jobs:
        with refusing("benchmarks.schedule"):
            r = schedule(job)
        rows.append(r)
        print(f"{job.name}: ideal {r['ideal_s']:.1f} s, today {r['today_simulated_s']:.1f} s, schedule "
              f"{r['schedule_simulated_s']:.1f} s (recomputed {r['recomputed_bytes'] / 1e9:.1f} GB, "
              f"SSD {r['ssd_bytes'] / 1e9:.1f} GB, host {r['host_bytes'] / 1e9:.1f} GB)", flush=True)
    write_atomic(args.out, json.dumps({"command": command("benchmarks.schedule", argv),
                                       "jobs": rows}, indent=1).encode())


if __name__ == "__main__":
    main()
