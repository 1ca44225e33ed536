"""A committed TeraIO run re-planned with the current planner, beside its committed plan, on
the CPU: what each plan moves, the slots and room it needs, and its simulated iteration.

:func:`replan` reads a job folder (``teraio.perf.jobdir``: its trace and plan), plans the
trace again as the run did (``teraio.perf.replay.plan_as_committed``), optionally at another
host cap, host packing or drive room, and summarizes both plans (:func:`plan_summary`);
:func:`beyond_host` is the floor no plan at a capacity and host cap can keep off the drive.
Bytes throughout; seconds simulated (``teraio.perf.simulator.simulate``, FIFO, the SSD's
reads and writes in separate queues).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from teraio.core.bandwidth import TierBandwidth
from teraio.core.plan import MigrationPlan
from teraio.core.slots import HOST_ALIGN, align_up, ssd_file_bytes
from teraio.core.trace import Trace
from teraio.perf import jobdir
from teraio.perf.replay import plan_as_committed, plan_tiers
from teraio.perf.simulator import simulate


def owner_slots(plan: MigrationPlan, tier: str) -> dict[str, int]:
    """``tier``'s slots, owner name -> bytes: one per owner, or one per tensor name in a plan
    without shared slots (made before ``teraio.core.slots``)."""
    return {m.name: m.nbytes for m in plan.migrations if m.tier == tier and m.slot in ("", m.name)}


def slot_bytes(plan: MigrationPlan) -> dict[str, int]:
    """Bytes of each tier's slots (:func:`owner_slots`; host slots rounded up as the host
    tier allocates them); for a host tier as one region (``host_arena``), the region's
    bytes in use."""
    out = {}
    for tier, align in (("ssd", 1), ("host", HOST_ALIGN)):
        out[tier] = sum(align_up(b, align) for b in owner_slots(plan, tier).values())
    if plan.meta.get("host_arena"):  # one region: its highest end
        out["host"] = plan.meta["slot_bytes"]["host"]
    return out


def ssd_files(plan: MigrationPlan) -> int:
    """Bytes the SSD tier's files take for the plan's SSD slots (:func:`owner_slots`, each in
    whole stripes, ``teraio.core.slots.ssd_file_bytes``)."""
    return int(ssd_file_bytes(np.array(list(owner_slots(plan, "ssd").values()), np.int64)).sum())


def beyond_host(trace: Trace, capacity_bytes: int, host_cap_bytes: int) -> dict[str, int]:
    """What no plan at this capacity and host cap can keep off the drive:
    ``{"bytes": b, "ops": n}``, where b is the most bytes that must be off the GPU beyond the
    host cap at any op (the trace's ``required_bytes`` less the capacity and the cap; 0
    where the two suffice) and n the number of ops where that is positive. The drive holds
    at least b at once, so each iteration writes and reads at least b there."""
    beyond = trace.required_bytes() - capacity_bytes - host_cap_bytes
    return {"bytes": int(max(beyond.max(), 0)), "ops": int((beyond > 0).sum())}


def plan_summary(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth) -> dict:
    """``plan`` on ``trace`` in numbers: migrations and exposed ones, bytes moved per tier and
    iteration, :func:`slot_bytes`, the most bytes each tier holds at once
    (``MigrationPlan.tier_bytes_held``), predicted peak and shortfall, :func:`ssd_files`,
    the host packing (and ``host_arena_auto`` where ``"auto"`` chose it), and the simulated
    iteration and stall seconds at ``tiers`` (with the plan's ``meta["stream_frees"]``, as its
    choices were simulated)."""
    sim = simulate(trace, plan, tiers, stream_frees=plan.meta.get("stream_frees", False))
    return {"migrations": len(plan.migrations), "exposed": plan.meta.get("n_exposed", 0),
            "bytes_per_tier": plan.bytes_per_tier(), "slot_bytes": slot_bytes(plan),
            "most_bytes_held": {t: int(plan.tier_bytes_held(t).max(initial=0)) for t in ("ssd", "host")},
            "predicted_peak_bytes": plan.predicted_peak_bytes, "shortfall_bytes": plan.shortfall_bytes,
            "ssd_file_bytes": ssd_files(plan),
            "host_arena": plan.meta.get("host_arena", False),
            **{k: plan.meta[k] for k in ("host_arena_auto",) if k in plan.meta},
            "simulated_iteration_s": sim.iteration_seconds, "simulated_stall_s": sim.stall_seconds}


def replan(job: str | Path, host_cap_bytes: int | None = None, host_arena: bool | str | None = None,
           released_grads: bool = False, ssd_cap_bytes: int | None = None) -> dict:
    """The committed plan of ``job`` and the current planner's, side by side
    (:func:`plan_summary` each, at the committed plan's rates); the new plan at
    ``host_cap_bytes`` if given, else at the committed plan's host cap, with ``host_arena``
    if given, else the committed plan's, and its SSD files within ``ssd_cap_bytes`` if given;
    with ``released_grads`` both plans are simulated on the trace as a run with
    ``release_grads`` plans it.

    Raises:
        ValueError: ``job`` lacks its trace or plan, ``host_cap_bytes`` < 0, or a bad
            ``host_arena`` (``plan_fastest``).
    """
    if host_cap_bytes is not None and host_cap_bytes < 0:
        raise ValueError(f"host_cap_bytes={host_cap_bytes}; must be >= 0 (0: TeraIO-SSD)")
    trace = jobdir.trace(job, released_grads=released_grads)
    old = jobdir.plan(job)
    meta = old.meta
    tiers = plan_tiers(old)
    host_cap = meta["host_cap_bytes"] if host_cap_bytes is None else host_cap_bytes
    new = plan_as_committed(trace, old, host_cap, host_arena, ssd_cap_bytes)
    return {"job": str(job), "capacity_bytes": old.capacity_bytes, "host_cap_bytes": meta["host_cap_bytes"],
            "replanned_host_cap_bytes": host_cap, "released_grads": released_grads,
            "replanned_ssd_cap_bytes": new.meta["ssd_cap_bytes"],
            "tiers_gbps": meta["tiers_gbps"], "ideal_s": float(trace.op_seconds.sum()),
            "beyond_host": beyond_host(trace, old.capacity_bytes, host_cap),
            "committed": plan_summary(trace, old, tiers), "replanned": plan_summary(trace, new, tiers)}
