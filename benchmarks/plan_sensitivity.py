"""How a TeraIO plan depends on the op times it was profiled with, on CPU: for job
directories of one point (runs of the same configuration, whose traces have the same ops and
tensors and differ only in the measured op times), plan each run's trace as
``benchmarks.replan`` does (``teraio.perf.replay.plan_as_committed``: the committed plan's capacity, bandwidths, host cap and
options, or ``--host-arena``; ``--released-grads`` as a run with ``release_grads`` plans it),
then replay every plan through the simulator under every run's op times.

    python -m benchmarks.plan_sensitivity JOB_DIR JOB_DIR [JOB_DIR ...]
        [--host-arena {false,true,auto}] [--released-grads] [--jitter FRACTION SEEDS] --out FILE.json

The file ``--out`` (replaced atomically) holds, per run (``jobs``, in the order given): its
committed plan's capacity, the sum of its op times (``ideal_s``), the median and 90th
percentile of each op's relative difference from the first run's, its new plan's bytes per
tier, and ``simulated_s``: that plan's iteration under each run's op times (FIFO,
``teraio.perf.simulator.simulate``). Run i's ``simulated_s[i]`` is its own plan on its own
trace; how far the runs' plans differ under one run's op times is what the planner makes of
op-time noise. With ``--jitter``, ``jitter`` holds :func:`jitter` of the first run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks import command
from benchmarks.replan import parse_plan_options
from teraio.core.trace import Trace
from teraio.files import write_atomic
from teraio.perf import jobdir
from teraio.perf.replay import plan_as_committed, plan_tiers
from teraio.perf.simulator import simulate


def _tensors(trace: Trace) -> list[tuple]:
    return [(r.name, r.nbytes, r.kind, tuple(r.uses)) for r in trace.tensors]


def _same_step(traces: list[Trace], jobs: list[Path]) -> None:
    first = traces[0]
    for t, job in zip(traces[1:], jobs[1:]):
        if t.op_names != first.op_names or _tensors(t) != _tensors(first):
            raise ValueError(f"{job}: its trace has other ops or tensors than {jobs[0]}'s; "
                             "give runs of one configuration")


def jitter(job: Path, fraction: float, seeds: int, host_arena: bool | str | None = None,
           released_grads: bool = False) -> dict:
    """``job``'s trace planned ``seeds`` times, each with every op time multiplied by
    ``1 + fraction * z`` (z standard normal, numpy seed 0, 1, ...; at least 0.01 of the
    time), and each plan simulated under the trace's own op times: how far noise of that
    size alone moves the planner's result. ``own_s``: the unjittered plan there.

    Raises:
        ValueError: ``fraction`` not in (0, 1), ``seeds`` < 1, or ``job`` lacks its trace or plan.
    """
    if not 0 < fraction < 1 or seeds < 1:
        raise ValueError(f"fraction={fraction}, seeds={seeds}: need 0 < fraction < 1 and seeds >= 1")
    trace = jobdir.trace(job, released_grads=released_grads)
    committed = jobdir.plan(job)
    tiers = plan_tiers(committed)
    simulated, ssd = [], []
    for seed in range(seeds):
        z = np.random.default_rng(seed).standard_normal(len(trace.op_seconds))
        noisy = dataclasses.replace(trace, op_seconds=trace.op_seconds * np.maximum(1 + fraction * z, 0.01))
        plan = plan_as_committed(noisy, committed, host_arena=host_arena)
        simulated.append(simulate(trace, plan, tiers).iteration_seconds)
        ssd.append(plan.bytes_per_tier().get("ssd", 0))
    own = plan_as_committed(trace, committed, host_arena=host_arena)
    return {"job": str(job), "fraction": fraction, "own_s": simulate(trace, own, tiers).iteration_seconds,
            "simulated_s": simulated, "ssd_bytes": ssd}


def sensitivity(jobs: list[Path], host_arena: bool | str | None = None, released_grads: bool = False) -> dict:
    """Each run's plan simulated under each run's op times (module docstring).

    Raises:
        ValueError: fewer than 2 jobs, a job without its trace or plan, or traces whose ops
            or tensors differ.
    """
    if len(jobs) < 2:
        raise ValueError(f"{len(jobs)} job(s) given; need 2 or more runs of one configuration")
    traces = [jobdir.trace(j, released_grads=released_grads) for j in jobs]
    _same_step(traces, jobs)
    committed = [jobdir.plan(j) for j in jobs]
    tiers = plan_tiers(committed[0])
    base = traces[0].op_seconds
    rows = []
    for j, trace, old in zip(jobs, traces, committed):
        plan = plan_as_committed(trace, old, host_arena=host_arena)
        rel = np.abs(trace.op_seconds - base) / np.maximum(base, 1e-9)
        rows.append({"job": str(j), "capacity_bytes": old.capacity_bytes, "ideal_s": float(trace.op_seconds.sum()),
                     "op_rel_diff_median": float(np.median(rel)), "op_rel_diff_p90": float(np.percentile(rel, 90)),
                     "replanned": {"bytes_per_tier": plan.bytes_per_tier(),
                                   "host_arena": bool(plan.meta.get("host_arena", False))},
                     "simulated_s": [simulate(t, plan, tiers).iteration_seconds for t in traces]})
    return {"released_grads": released_grads, "jobs": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jobs", nargs="+", type=Path, help="job directories of one configuration, with trace and plan")
    ap.add_argument("--jitter", type=float, nargs=2, metavar=("FRACTION", "SEEDS"),
                    help="also plan the first run's trace SEEDS times with its op times jittered "
                         "by FRACTION (a standard deviation, e.g. 0.03), simulated on its own times")
    argv = sys.argv[1:] if argv is None else argv
    args, arena = parse_plan_options(ap, argv)
    if args.jitter and not (0 < args.jitter[0] < 1 and args.jitter[1] >= 1 and args.jitter[1] == int(args.jitter[1])):
        ap.error(f"--jitter {args.jitter[0]:g} {args.jitter[1]:g}: FRACTION must be in (0, 1) and SEEDS a whole number >= 1")
    doc = sensitivity(args.jobs, arena, args.released_grads)
    if args.jitter:
        doc["jitter"] = jitter(args.jobs[0], args.jitter[0], int(args.jitter[1]), arena, args.released_grads)
        print(f"{args.jobs[0]}, op times jittered by {args.jitter[0]}: simulated "
              + ", ".join(f"{x:.2f}" for x in doc["jitter"]["simulated_s"]) + f" s (own plan {doc['jitter']['own_s']:.2f} s)")
    write_atomic(args.out, json.dumps({"command": command("benchmarks.plan_sensitivity", argv),
                                       **doc}, indent=1).encode())
    for row in doc["jobs"]:
        cells = ", ".join(f"{x:.2f}" for x in row["simulated_s"])
        print(f"{row['job']}: compute {row['ideal_s']:.2f} s, plan moves {row['replanned']['bytes_per_tier']} B; "
              f"simulated under each run's op times: {cells} s")


if __name__ == "__main__":
    main()
