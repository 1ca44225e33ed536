"""TeraIO runs against the performance model: each job's own plan replayed through the
simulator (``teraio.perf.replay.replay_run``, FIFO, the drive shared as the plan says) at the
rates it was planned at, beside the iterations the run measured.

    python -m benchmarks.replay_runs JOB_DIR [JOB_DIR ...] --out FILE.json

Per job: the row's ``status`` (an ``interrupted`` or time-limited row keeps the iterations it
measured, which are used), ``gpu_name``, the plan's ``recompute`` setting, its recomputes
and recomputed bytes per iteration, ``tiers_gbps`` (the planned rates), the measured mean
iteration seconds over ``measured_steps`` iterations, the simulated ones, their ratio
``simulated_over_measured``, the profiled op sum ``ideal_s`` (of the trace the plan was made
for: without the device updates of parameters it updates in host memory) and the plan's
``capacity_bytes``; and the same plan simulated with each channel serving the transfer whose
op waits first, preempting (``simulated_edf_iteration_seconds``: what an engine that ordered
its copies so would reach, where the engine's copies run in issue order on one stream per
direction, as FIFO; null for a plan that updates parameters in host memory, which the
simulator replays FIFO only, at the host's AdamW rate the plan recorded,
``host_update_gbps``); and FIFO with each iteration ending with the device synchronised, as
the measurement loop ends each step (``simulated_step_sync_iteration_seconds`` and
``step_sync_over_measured``: the copies still running at a step's end are waited for
there, ``teraio.perf.simulator.simulate``'s ``step_sync``); and as the run ran: FIFO, the step
synchronised, and a host-tier offload's storage freed without a wait where the run's engine
freed it so (``stream_frees``: ``device_waits`` on CUDA; ``simulated_as_run_iteration_seconds``
and ``as_run_over_measured``). ``--out`` is replaced atomically.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

from benchmarks import job_tool
import torch

from teraio.config import dataclass_from_dict
from teraio.perf.replay import plan_tiers, replay_run, saved_run
from teraio.trainer.options import TeraIOOptions


def run_stream_frees(row: dict) -> bool:
    """Whether the run of ``row`` freed host-tier offloads without a wait
    (``TeraIOOptions.stream_frees`` of its config's options and device)."""
    config = row["config"]
    opts = dataclass_from_dict(TeraIOOptions, config["system"]["options"], "system.options (TeraIO)")
    return opts.stream_frees(torch.device(config["hardware"]["device"]))


def replay(job: Path) -> dict:
    """One TeraIO run's plan simulated beside its measured iterations.

    Raises:
        ValueError: ``job`` lacks its row, trace or plan, or its row measured no iteration.
    """
    row, trace, plan, gbps = saved_run(job)
    run = functools.partial(replay_run, trace, plan, plan_tiers(plan), row.get("iterations") or [],
                            shared_ssd=plan.meta["shared_ssd"], host_update_gbps=gbps)
    frees = run_stream_frees(row)
    r, synced, as_run = run(), run(step_sync=True), run(step_sync=True, stream_frees=frees)
    edf = run(policy="edf") if gbps is None else None  # the simulator replays host updates FIFO only
    return {"job": str(job), "system": row["point"]["system"], "status": row["status"],
            "gpu_name": row.get("gpu_name"), "recompute": plan.meta.get("recompute"),
            "recomputes": len(plan.recomputes), "recomputed_bytes": plan.recomputed_bytes(),
            "tiers_gbps": plan.meta["tiers_gbps"], "measured_steps": len(r.iterations),
            "measured_iteration_seconds": r.measured_iteration_seconds,
            "simulated_iteration_seconds": r.simulated.iteration_seconds,
            "simulated_over_measured": r.predicted_over_measured,
            "simulated_edf_iteration_seconds": edf.simulated.iteration_seconds if edf else None,
            "host_update_gbps": gbps,
            "simulated_step_sync_iteration_seconds": synced.simulated.iteration_seconds,
            "step_sync_over_measured": synced.predicted_over_measured,
            "stream_frees": frees, "simulated_as_run_iteration_seconds": as_run.simulated.iteration_seconds,
            "as_run_over_measured": as_run.predicted_over_measured,
            "ideal_s": float(trace.op_seconds.sum()), "capacity_bytes": plan.capacity_bytes}


def main(argv: list[str] | None = None) -> None:
    job_tool("benchmarks.replay_runs", __doc__.split("\n\n")[0], sys.argv[1:] if argv is None else argv, replay,
             lambda j: (f"{j['status']}, recompute {j['recompute']} ({j['recomputes']} chains), measured "
                        f"{j['measured_iteration_seconds']:.2f} s over {j['measured_steps']} steps, simulated "
                        f"{j['simulated_iteration_seconds']:.2f} s ({j['simulated_over_measured']:.3f})"))


if __name__ == "__main__":
    main()
