"""Plans chosen by the performance model: ``host_arena="auto"``, ``recompute="auto"`` and the
parameters updated in host memory (:func:`plan_host_update`).

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
                 shared_ssd: bool = True, min_tensor_bytes: int = 1 << 20, host_update_gbps: float | None = None,
                 stream_frees: bool = False, **options) -> MigrationPlan:
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

    In either case ``meta["compile_seconds"]`` covers every plan made and its simulation;
    ``host_update_gbps`` is the host's AdamW rate where ``trace`` updates parameters in host
    memory (``Trace.with_host_update``), for the simulator. ``stream_frees``: the plans are
    simulated as the engine that frees a host-tier offload at once runs them
    (``simulate``'s ``stream_frees``; ``TeraIOOptions.stream_frees``): without it a choice
    counts as a wait what that engine never waits for. The plan returned records it
    (``meta["stream_frees"]``).

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
    sim = {"host_update_gbps": host_update_gbps, "stream_frees": stream_frees}
    if recompute == "auto":
        plan = _fastest_schedule(*args, host_arena=host_arena, sim=sim, **options)
    elif host_arena == "auto":
        plan = _fastest_packing(*args, recompute=recompute, sim=sim, **options)
    else:
        plan = plan_migrations(*args, host_arena=host_arena, recompute=recompute, **options)
    plan.meta["stream_frees"] = stream_frees  # how it is simulated (teraio.perf.replay.plan_as_committed)
    return plan


def _fastest_schedule(trace: Trace, capacity_bytes: int, tiers: TierBandwidth, host_cap_bytes: int,
                      host_arena: bool | str, sim: dict, **options) -> MigrationPlan:
    """``recompute="auto"`` (:func:`plan_fastest`): the plan without and with the recompute
    option, the latter kept where it simulates more than :data:`REGION_MARGIN` faster
    (``sim``: ``simulate``'s ``host_update_gbps`` and ``stream_frees``)."""
    t0 = time.perf_counter()
    options["candidates"] = Candidates(trace, int(options["min_tensor_bytes"]))

    def one(recompute: bool) -> MigrationPlan:
        if host_arena == "auto":
            return _fastest_packing(trace, capacity_bytes, tiers, host_cap_bytes, recompute=recompute, sim=sim,
                                    **options)
        return plan_packings(trace, capacity_bytes, tiers, host_cap_bytes, ("arena" if host_arena else "slots",),
                             recompute=recompute, **options)["arena" if host_arena else "slots"]

    plans = {"on": one(True)}
    if plans["on"].recomputes:  # else it is the plan without the option
        plans["off"] = one(False)
    seconds = {k: _simulated(plan) or simulate(trace, plan, tiers, shared_ssd=options["shared_ssd"], **sim).iteration_seconds
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
                     recompute: bool, sim: dict, **options) -> MigrationPlan:
    """``host_arena="auto"`` (:func:`plan_fastest`): the host tier in slots and as one
    region (twins, ``plan_packings``), the region's plan kept where it simulates more than
    :data:`REGION_MARGIN` faster (``sim`` as for :func:`_fastest_schedule`)."""
    t0 = time.perf_counter()
    plans = plan_packings(trace, capacity_bytes, tiers, host_cap_bytes,
                          ("slots", "arena") if host_cap_bytes > 0 else ("slots",), recompute=recompute, **options)
    seconds = {packing: simulate(trace, plan, tiers, shared_ssd=options["shared_ssd"], **sim).iteration_seconds
               for packing, plan in plans.items()}
    region = "arena" in seconds and seconds["arena"] < seconds["slots"] * (1 - REGION_MARGIN)
    kept = plans["arena" if region else "slots"]
    kept.meta.update(host_arena_auto=seconds, compile_seconds=time.perf_counter() - t0)
    return kept


HOST_UPDATE_SHARES = (1.0, 0.75, 0.5, 0.25)
"""The shares of the candidate parameter groups :func:`plan_host_update` tries, the groups
whose gradients arrive longest before their next use first."""

HOST_UPDATE_BYTES = 4
"""Host bytes a hosted parameter takes per byte of it: the parameter, its gradient and its
two AdamW moments (``teraio.core.host_update``)."""


def hosted_candidates(trace: Trace) -> list[str]:
    """The parameters (``"param:<fqn>"``) a host update can take: every one that ``trace``'s
    ``optimizer.step`` updates with a gradient (``Trace.update_blocks``). Their two AdamW
    moments then live in host memory only, whether or not the plan without the update kept
    them there: hosting a parameter whose moments the plan kept on the device frees their
    device bytes for the plan's other tensors, as torchao's ``CPUOffloadOptimizer`` does for
    every parameter.

    Raises:
        ValueError: as ``Trace.update_blocks`` (an optimizer that does not update each
            tensor in one run of ops).
    """
    return sorted(p for p, block in trace.update_blocks().items() if block[2] is not None)


def _group(name: str) -> str:
    """A parameter's group: its block (``layers.<i>``) or its top-level module."""
    parts = name[len("param:"):].split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def plan_host_update(trace: Trace, plan: MigrationPlan, capacity_bytes: int, tiers: TierBandwidth,
                     host_cap_bytes: int, host_update_gbps: float, mode: str, release_grads: bool,
                     stream_frees: bool = False, groups: int | None = None,
                     **options) -> tuple[Trace, MigrationPlan, list[str]]:
    """The optimizer update where its state lives (``teraio.core.host_update``), chosen by
    simulation per parameter group. ``plan`` is ``trace``'s plan without it (made as
    :func:`plan_fastest` makes it from ``trace``, gradients released where
    ``release_grads``); its candidates are the parameters the step updates with a gradient
    (:func:`hosted_candidates`), in groups (a block, or a top-level module), ranked by
    the least time in the group from a gradient's last write to its parameter's first use in
    the next iteration (the time a host update has). For each of :data:`HOST_UPDATE_SHARES`
    of the ranked groups the trace is planned with those parameters updated in host memory
    (``Trace.with_host_update``; :func:`plan_fastest` with ``options``, the host cap less
    :data:`HOST_UPDATE_BYTES` per hosted byte) and simulated at ``host_update_gbps``; the
    fastest that fits as well as ``plan`` is kept, with ``mode="on"``, or with ``"auto"`` where
    it simulates more than :data:`REGION_MARGIN` faster than ``plan``. With ``groups`` (mode
    ``"on"``) only the first ``groups`` ranked groups are tried (all, where there are fewer):
    a choice made before, taken again. Every simulation, and :func:`plan_fastest`'s, takes
    ``stream_frees``.

    Returns:
        (the trace planned, its plan, the hosted parameters): ``trace`` (released) and
        ``plan`` with none. The plan's ``meta["host_update_auto"]`` holds ``"off"`` (``plan``'s
        simulated seconds), every variant tried (``{"groups", "params", "bytes", "seconds"}``;
        seconds null where it did not fit as well) and ``"kept"`` (the variant's index, or null);
        where one is kept, also ``"hosted"`` (its parameters) and ``"gbps"``
        (``host_update_gbps``), which a replay of the plan needs (``teraio.perf.replay``).

    Raises:
        ValueError: a ``mode`` other than ``"on"`` or ``"auto"``, ``groups`` with ``"auto"`` or
            below 1, or as ``Trace.with_host_update``.
    """
    if mode not in ("on", "auto"):
        raise ValueError(f"host_update={mode!r}; valid: off, on or auto")
    if groups is not None and (mode != "on" or groups < 1):
        raise ValueError(f"host_update_groups={groups!r} with host_update={mode!r}; valid: null, or >= 1 with on")
    released = (lambda t: t.with_released_grads()) if release_grads else (lambda t: t)
    base = released(trace)
    shared = options.get("shared_ssd", True)
    off = simulate(base, plan, tiers, shared_ssd=shared, stream_frees=stream_frees).iteration_seconds
    blocks = trace.update_blocks()
    candidates = hosted_candidates(trace)
    start = trace.op_start_seconds()
    info = {t.name: t for t in trace.tensors}

    def slack(p: str) -> float:  # from its gradient's last write to its first use, next iteration
        grad = info[blocks[p][2]]
        return float(start[-1] - start[grad.uses[-1] + 1] + start[info[p].uses[0]])

    by_group: dict[str, list[str]] = {}
    for p in candidates:
        by_group.setdefault(_group(p), []).append(p)
    ranked = sorted(by_group, key=lambda g: -min(slack(p) for p in by_group[g]))
    tried, best = [], None
    shares = [max(1, round(share * len(ranked))) for share in HOST_UPDATE_SHARES] if groups is None \
        else [min(groups, len(ranked))]
    for n in dict.fromkeys(shares if ranked else []):
        hosted = [p for g in ranked[:n] for p in by_group[g]]
        nbytes = sum(info[p].nbytes for p in hosted)
        entry = {"groups": n, "params": len(hosted), "bytes": nbytes, "seconds": None}
        tried.append(entry)
        room = host_cap_bytes - HOST_UPDATE_BYTES * nbytes
        if room <= 0:
            continue
        t = released(trace.with_host_update(hosted))
        p = plan_fastest(t, capacity_bytes, tiers, room, host_update_gbps=host_update_gbps, stream_frees=stream_frees,
                         **options)
        if p.shortfall_bytes > plan.shortfall_bytes:
            continue
        entry["seconds"] = simulate(t, p, tiers, shared_ssd=shared, host_update_gbps=host_update_gbps,
                                    stream_frees=stream_frees).iteration_seconds
        if best is None or entry["seconds"] < best[0]["seconds"]:
            best = (entry, t, p, hosted)
    keep = best is not None and (mode == "on" or best[0]["seconds"] < off * (1 - REGION_MARGIN))
    record = {"off": off, "variants": tried, "kept": tried.index(best[0]) if keep else None}
    if not keep:
        plan.meta["host_update_auto"] = record
        return base, plan, []
    _, t, p, hosted = best
    p.meta["host_update_auto"] = {**record, "hosted": hosted, "gbps": host_update_gbps}
    return t, p, hosted
