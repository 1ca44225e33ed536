"""Plans chosen by the performance model: ``host_arena="auto"`` and ``recompute="auto"``.

The planner (``teraio.core.planner.plan_migrations``, Algorithm 1) makes one plan for one
setting. Where two settings each win on some traces (the host tier in slots or as one
region; the recompute option off or on), :func:`plan_fastest` plans both, replays each with
the simulator (``teraio.perf.simulator.simulate``, FIFO, the SSD's reads and writes on the
plan's drive model) and keeps the faster, with a margin (:data:`REGION_MARGIN`) against
noise in the profiled op times.
"""
from __future__ import annotations

import time

from teraio.core.bandwidth import TierBandwidth
from teraio.core.plan import MigrationPlan
from teraio.core.planner import Candidates, plan_migrations, plan_packings
from teraio.core.trace import Trace
from teraio.perf.simulator import simulate

# "auto" keeps the region (or the recompute option) only where it simulates more than this
# fraction faster: at fig9_h200's 4-16 GB points the region's simulated gain moved between
# 0.06 and 1.17 % from one trial's profile to the next (benchmarks/results/shared_slots/
# host_arena_auto.md), so a smaller margin would let a point's trials run different packings.
REGION_MARGIN = 0.02


def is_host_arena(value) -> bool:
    """Whether ``value`` is one that :func:`plan_fastest`'s ``host_arena`` (or ``recompute``)
    takes: true, false or ``"auto"`` (1 and 0 are not)."""
    return isinstance(value, bool) or value == "auto"


def plan_fastest(trace: Trace, capacity_bytes: int, tiers: TierBandwidth, host_cap_bytes: int,
                 host_arena: bool | str = False, recompute: bool | str = False,
                 shared_ssd: bool = True, min_tensor_bytes: int = 1 << 20, **options) -> MigrationPlan:
    """``plan_migrations`` with ``host_arena`` and ``recompute`` each true, false or
    ``"auto"``; the other arguments (``options`` included) are ``plan_migrations``'.
    Without an ``"auto"`` it is ``plan_migrations`` itself.

    ``host_arena="auto"``: plan the host tier in slots and as one region (slots only at
    ``host_cap_bytes=0``; the two as twins, ``teraio.core.planner.plan_packings``) and return
    the region's plan if its simulated iteration is more than :data:`REGION_MARGIN` shorter
    than the slots', else the slots'. Its ``meta["host_arena"]`` is the packing kept,
    ``meta["host_arena_auto"]`` the simulated iteration seconds of each (``{"slots": s,
    "arena": s}``).

    ``recompute="auto"``: plan with and without the recompute option and keep the plan
    with it where it simulates more than :data:`REGION_MARGIN` shorter;
    ``meta["recompute_auto"]`` holds both simulated iterations (``{"off": s, "on": s}``).
    A plan with the option that recomputes nothing is the plan without it (the option
    only adds choices), so it is kept without planning again; ``meta["recompute_auto"]``
    then has ``"on"`` only. The plans share the trace's candidates (``Candidates``), and a
    plan ``host_arena="auto"`` simulated is not simulated again.

    In either case ``meta["compile_seconds"]`` covers every plan made and its simulation.

    Raises:
        ValueError: a ``host_arena`` or ``recompute`` other than true, false or ``"auto"``;
            whatever ``plan_migrations`` raises.
    """
    if not is_host_arena(host_arena):
        raise ValueError(f"host_arena={host_arena!r}; valid: true, false or 'auto'")
    if not is_host_arena(recompute):
        raise ValueError(f"recompute={recompute!r}; valid: true, false or 'auto'")
    args = (trace, capacity_bytes, tiers, host_cap_bytes)
    options.update(shared_ssd=shared_ssd, min_tensor_bytes=min_tensor_bytes)
    if recompute == "auto":
        return _fastest_schedule(*args, host_arena=host_arena, **options)
    if host_arena == "auto":
        return _fastest_packing(*args, recompute=recompute, **options)
    return plan_migrations(*args, host_arena=host_arena, recompute=recompute, **options)


def _fastest_schedule(trace: Trace, capacity_bytes: int, tiers: TierBandwidth, host_cap_bytes: int,
                      host_arena: bool | str, **options) -> MigrationPlan:
    """``recompute="auto"`` (:func:`plan_fastest`): the plan without and with the recompute
    option, the latter kept where it simulates more than :data:`REGION_MARGIN` faster."""
    t0 = time.perf_counter()
    options["candidates"] = Candidates(trace, int(options["min_tensor_bytes"]))

    def one(recompute: bool) -> MigrationPlan:
        if host_arena == "auto":
            return _fastest_packing(trace, capacity_bytes, tiers, host_cap_bytes, recompute=recompute, **options)
        return plan_packings(trace, capacity_bytes, tiers, host_cap_bytes, ("arena" if host_arena else "slots",),
                             recompute=recompute, **options)["arena" if host_arena else "slots"]

    plans = {"on": one(True)}
    if plans["on"].recomputes:  # else it is the plan without the option
        plans["off"] = one(False)
    seconds = {k: _simulated(plan) or simulate(trace, plan, tiers, shared_ssd=options["shared_ssd"]).iteration_seconds
               for k, plan in plans.items()}
    on = "off" not in plans or seconds["on"] < seconds["off"] * (1 - REGION_MARGIN)
    kept = plans["on" if on else "off"]
    kept.meta.update(recompute_auto=seconds, compile_seconds=time.perf_counter() - t0)
    return kept


def _simulated(plan: MigrationPlan) -> float | None:
    """The simulated iteration seconds of a plan that ``host_arena="auto"`` kept (it
    simulated it to choose), else None."""
    auto = plan.meta.get("host_arena_auto")
    return auto["arena" if plan.meta["host_arena"] else "slots"] if auto else None


def _fastest_packing(trace: Trace, capacity_bytes: int, tiers: TierBandwidth, host_cap_bytes: int,
                     recompute: bool, **options) -> MigrationPlan:
    """``host_arena="auto"`` (:func:`plan_fastest`): the host tier in slots and as one
    region (twins, ``plan_packings``), the region's plan kept where it simulates more than
    :data:`REGION_MARGIN` faster."""
    t0 = time.perf_counter()
    plans = plan_packings(trace, capacity_bytes, tiers, host_cap_bytes,
                          ("slots", "arena") if host_cap_bytes > 0 else ("slots",), recompute=recompute, **options)
    seconds = {packing: simulate(trace, plan, tiers, shared_ssd=options["shared_ssd"]).iteration_seconds
               for packing, plan in plans.items()}
    region = "arena" in seconds and seconds["arena"] < seconds["slots"] * (1 - REGION_MARGIN)
    kept = plans["arena" if region else "slots"]
    kept.meta.update(host_arena_auto=seconds, compile_seconds=time.perf_counter() - t0)
    return kept
