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
from teraio.core.planner import plan_migrations
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
                 shared_ssd: bool = True, **options) -> MigrationPlan:
    """``plan_migrations`` with ``host_arena`` and ``recompute`` each true, false or
    ``"auto"``; the other arguments (``options`` included) are ``plan_migrations``'.
    Without an ``"auto"`` it is ``plan_migrations`` itself.

    ``host_arena="auto"``: plan the host tier in slots and as one region (slots only at
    ``host_cap_bytes=0``) and return the region's plan if its simulated iteration is more
    than :data:`REGION_MARGIN` shorter than the slots', else the slots'. Its
    ``meta["host_arena"]`` is the packing kept, ``meta["host_arena_auto"]`` the simulated
    iteration seconds of each (``{"slots": s, "arena": s}``).

    ``recompute="auto"``: plan with and without the recompute option and keep the plan
    with it where it simulates more than :data:`REGION_MARGIN` shorter;
    ``meta["recompute_auto"]`` holds both simulated iterations (``{"off": s, "on": s}``).
    A plan with the option that recomputes nothing is the plan without it (the option
    only adds choices), so it is kept without planning again; ``meta["recompute_auto"]``
    then has ``"on"`` only.

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
    if recompute == "auto":
        return _fastest_schedule(*args, host_arena=host_arena, shared_ssd=shared_ssd, **options)
    if host_arena == "auto":
        return _fastest_packing(*args, recompute=recompute, shared_ssd=shared_ssd, **options)
    return plan_migrations(*args, host_arena=host_arena, recompute=recompute, shared_ssd=shared_ssd, **options)


def _fastest_schedule(trace: Trace, capacity_bytes: int, tiers: TierBandwidth, host_cap_bytes: int,
                      **options) -> MigrationPlan:
    """``recompute="auto"`` (:func:`plan_fastest`): the plan without and with the recompute
    option, the latter kept where it simulates more than :data:`REGION_MARGIN` faster."""
    t0 = time.perf_counter()
    plans = {"on": plan_fastest(trace, capacity_bytes, tiers, host_cap_bytes, **options, recompute=True)}
    if plans["on"].recomputes:  # else it is the plan without the option
        plans["off"] = plan_fastest(trace, capacity_bytes, tiers, host_cap_bytes, **options, recompute=False)
    seconds = {k: simulate(trace, plan, tiers, shared_ssd=options["shared_ssd"]).iteration_seconds
               for k, plan in plans.items()}
    on = "off" not in plans or seconds["on"] < seconds["off"] * (1 - REGION_MARGIN)
    kept = plans["on" if on else "off"]
    kept.meta.update(recompute_auto=seconds, compile_seconds=time.perf_counter() - t0)
    return kept


def _fastest_packing(trace: Trace, capacity_bytes: int, tiers: TierBandwidth, host_cap_bytes: int,
                     **options) -> MigrationPlan:
    """``host_arena="auto"`` (:func:`plan_fastest`): the host tier in slots and as one
    region, the region's plan kept where it simulates more than :data:`REGION_MARGIN` faster."""
    t0 = time.perf_counter()
    plans = {packing: plan_migrations(trace, capacity_bytes, tiers, host_cap_bytes, **options,
                                      host_arena=packing == "arena")
             for packing in (("slots", "arena") if host_cap_bytes > 0 else ("slots",))}
    seconds = {packing: simulate(trace, plan, tiers, shared_ssd=options["shared_ssd"]).iteration_seconds
               for packing, plan in plans.items()}
    region = "arena" in seconds and seconds["arena"] < seconds["slots"] * (1 - REGION_MARGIN)
    kept = plans["arena" if region else "slots"]
    kept.meta.update(host_arena_auto=seconds, compile_seconds=time.perf_counter() - t0)
    return kept
