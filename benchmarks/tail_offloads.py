"""Committed TeraIO runs' plans with their tail offloads where the planner put them and
launched as the next step starts (``teraio.perf.retime.defer_tail_offloads``), simulated
with each step ending with the device synchronised as the measurement loop ends it
(``teraio.perf.simulator.simulate``'s ``step_sync``), beside what the run measured.

    python -m benchmarks.tail_offloads JOB_DIR [JOB_DIR ...] --out FILE.json

Per job: the row's ``status``, ``gpu_name`` and measured mean iteration seconds (the
iterations it measured, ``measured_steps``); its plan simulated FIFO at the rates it was
planned at (``teraio.perf.replay.plan_tiers``, the drive shared as the plan says) without
a sync at the step's end (``run_on_s``, the planner's model), with it (``in_step_s``, and
``in_step_over_measured``), and with the offloads that would still be copying at the sync
launched after it (``next_step_s``; ``deferred`` and ``deferred_bytes`` count them) and
``next_step_over_in_step``; the trace's op sum ``ideal_s`` and the plan's ``capacity_bytes``
(what names the trace and plan it was made from). A plan that updates parameters in host
memory is simulated on the trace it was made for, at the host's AdamW rate it recorded
(``teraio.perf.replay.saved_run``), its tail offloads too (``defer_tail_offloads``).
``--out`` is replaced atomically.
"""
from __future__ import annotations

import sys
from pathlib import Path

from benchmarks import job_tool
from teraio.perf.replay import plan_tiers, replay_run, saved_run
from teraio.perf.retime import defer_tail_offloads
from teraio.perf.simulator import simulate


def compare(job: Path) -> dict:
    """One run's plan simulated in step and with its tail offloads in the next step.

    Raises:
        ValueError: ``job`` lacks its row, trace or plan, or its row measured no iteration.
    """
    row, trace, plan, gbps = saved_run(job)
    tiers, shared = plan_tiers(plan), plan.meta["shared_ssd"]
    in_step = replay_run(trace, plan, tiers, row.get("iterations") or [], shared_ssd=shared, step_sync=True,
                         host_update_gbps=gbps)
    deferred = defer_tail_offloads(trace, plan, tiers, shared_ssd=shared, host_update_gbps=gbps)
    next_step = simulate(trace, deferred, tiers, shared_ssd=shared, step_sync=True,
                         host_update_gbps=gbps).iteration_seconds
    return {"job": str(job), "status": row["status"], "gpu_name": row.get("gpu_name"),
            "measured_steps": len(in_step.iterations),
            "measured_iteration_seconds": in_step.measured_iteration_seconds,
            "run_on_s": simulate(trace, plan, tiers, shared_ssd=shared, host_update_gbps=gbps).iteration_seconds,
            "in_step_s": in_step.simulated.iteration_seconds,
            "in_step_over_measured": in_step.predicted_over_measured,
            "deferred": deferred.meta["tail_offloads"]["deferred"],
            "deferred_bytes": deferred.meta["tail_offloads"]["bytes"],
            "next_step_s": next_step, "next_step_over_in_step": next_step / in_step.simulated.iteration_seconds,
            "ideal_s": float(trace.op_seconds.sum()), "capacity_bytes": plan.capacity_bytes}


def main(argv: list[str] | None = None) -> None:
    job_tool("benchmarks.tail_offloads", __doc__.split("\n\n")[0], sys.argv[1:] if argv is None else argv, compare,
             lambda j: (f"measured {j['measured_iteration_seconds']:.2f} s, in step {j['in_step_s']:.2f} s "
                        f"({j['in_step_over_measured']:.3f}), {j['deferred']} offloads to the next step: "
                        f"{j['next_step_s']:.2f} s ({j['next_step_over_in_step']:.3f})"))


if __name__ == "__main__":
    main()
