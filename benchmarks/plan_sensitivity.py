"""How a TeraIO plan depends on the op times it was profiled with, on CPU: for job
directories of one point (runs of the same configuration, whose traces have the same ops and
tensors and differ only in the measured op times), plan each run's trace as
``benchmarks/replan.py`` does (the committed plan's capacity, bandwidths, host cap and
options, or ``--host-arena``; ``--released-grads`` as a run with ``release_grads`` plans it),
then replay every plan through the simulator under every run's op times.

    python benchmarks/plan_sensitivity.py JOB_DIR JOB_DIR [JOB_DIR ...]
        [--host-arena {false,true,auto}] [--released-grads] --out FILE.json

The file ``--out`` (replaced atomically) holds, per run (``jobs``, in the order given): its
committed plan's capacity, the sum of its op times (``ideal_s``), the median and 90th
percentile of each op's relative difference from the first run's, its new plan's bytes per
tier, and ``simulated_s``: that plan's iteration under each run's op times (FIFO,
``teraio.core.simulator.simulate``). Run i's ``simulated_s[i]`` is its own plan on its own
trace; how far the runs' plans differ under one run's op times is what the planner makes of
op-time noise.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replan import _load, parse_plan_options  # noqa: E402

from teraio.core.plan import MigrationPlan  # noqa: E402
from teraio.core.planner import TierBandwidth, plan_migrations  # noqa: E402
from teraio.core.simulator import simulate  # noqa: E402
from teraio.core.trace import Trace  # noqa: E402
from teraio.files import write_atomic  # noqa: E402


def _same_step(traces: list[Trace], jobs: list[Path]) -> None:
    first = traces[0]
    key = [(r.name, r.nbytes, r.kind, tuple(r.uses)) for r in first.tensors]
    for t, job in zip(traces[1:], jobs[1:]):
        if t.op_names != first.op_names or [(r.name, r.nbytes, r.kind, tuple(r.uses)) for r in t.tensors] != key:
            raise ValueError(f"{job}: its trace has other ops or tensors than {jobs[0]}'s; "
                             "give runs of one configuration")


def sensitivity(jobs: list[Path], host_arena: bool | str | None = None, released_grads: bool = False) -> dict:
    """Each run's plan simulated under each run's op times (module docstring).

    Raises:
        ValueError: fewer than 2 jobs, a job without its trace or plan, or traces whose ops
            or tensors differ.
    """
    if len(jobs) < 2:
        raise ValueError(f"{len(jobs)} job(s) given; need 2 or more runs of one configuration")
    traces = [Trace.from_dict(_load(j, "trace")) for j in jobs]
    if released_grads:
        traces = [t.with_released_grads() for t in traces]
    _same_step(traces, jobs)
    plans, capacities = [], []
    for j, trace in zip(jobs, traces):
        old = MigrationPlan.from_dict(_load(j, "plan"))
        meta = old.meta
        capacities.append(old.capacity_bytes)
        plans.append(plan_migrations(
            trace, old.capacity_bytes, TierBandwidth(**meta["tiers_gbps"]), host_cap_bytes=meta["host_cap_bytes"],
            benefit=meta["benefit"], min_tensor_bytes=meta["min_tensor_bytes"], use_ssd=meta["use_ssd"],
            allow_stalls=meta["allow_stalls"], shared_ssd=meta["shared_ssd"],
            host_arena=meta.get("host_arena", False) if host_arena is None else host_arena))
    tiers = TierBandwidth(**MigrationPlan.from_dict(_load(jobs[0], "plan")).meta["tiers_gbps"])
    base = traces[0].op_seconds
    rows = []
    for j, trace, plan, capacity in zip(jobs, traces, plans, capacities):
        rel = np.abs(trace.op_seconds - base) / np.maximum(base, 1e-9)
        rows.append({"job": str(j), "capacity_bytes": capacity, "ideal_s": float(trace.op_seconds.sum()),
                     "op_rel_diff_median": float(np.median(rel)), "op_rel_diff_p90": float(np.percentile(rel, 90)),
                     "replanned": {"bytes_per_tier": plan.bytes_per_tier(),
                                   "host_arena": bool(plan.meta.get("host_arena", False))},
                     "simulated_s": [simulate(t, plan, tiers).iteration_seconds for t in traces]})
    return {"released_grads": released_grads, "jobs": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jobs", nargs="+", type=Path, help="job directories of one configuration, with trace and plan")
    argv = sys.argv[1:] if argv is None else argv
    args, arena = parse_plan_options(ap, argv)
    doc = sensitivity(args.jobs, arena, args.released_grads)
    write_atomic(args.out, json.dumps({"command": shlex.join(["python", "benchmarks/plan_sensitivity.py", *argv]),
                                       **doc}, indent=1).encode())
    for row in doc["jobs"]:
        cells = ", ".join(f"{x:.2f}" for x in row["simulated_s"])
        print(f"{row['job']}: compute {row['ideal_s']:.2f} s, plan moves {row['replanned']['bytes_per_tier']} B; "
              f"simulated under each run's op times: {cells} s")

if __name__ == "__main__":
    main()
