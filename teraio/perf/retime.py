"""The host link's copies in deadline order (beyond the paper): a plan's copies launched
where an earliest-deadline-first channel would start them.

The planner (Algorithm 1, paper §3.2) reserves each channel's bandwidth migration by
migration in the order it chooses them, which assumes a channel that serves the copy whose
wait comes first (earliest deadline first, EDF: ``teraio.perf.simulator``'s
``policy="edf"``). A CUDA stream serves its copies in the order they are launched (FIFO):
a prefetch launched early for a use far ahead holds the link while one launched later for a
use just ahead waits, and the op that needs the latter stalls. At fig7_h200's Llama3-8B cut on
an H100 that is worth 0.18-0.38 s of a 4.6 s step, all of it on the host tier's two links
(``benchmarks/results/microbatch_plans/``).

:func:`retime_copies` moves each host-tier copy's launch to the op where the EDF replay of
the plan started it (``teraio.perf.simulator.served_launches``) and launches the copies of
one op in the order of their waits (``meta["copy_order"] = "deadline"``, which the engine
and the simulator both follow), so that launch order is EDF's order and a FIFO stream serves
them as EDF would, but for EDF's preemptions. Nothing is held longer on the device: an
offload's bytes are freed at ``free_before`` whenever its copy was launched, and a prefetch
launched later allocates its storage later. The SSD tier keeps its launches: its I/O threads
serve several copies at once, and EDF gains nothing there at that point.
"""
from __future__ import annotations

import dataclasses

from teraio.core.bandwidth import TierBandwidth
from teraio.core.plan import MigrationPlan
from teraio.core.trace import Trace
from teraio.perf.simulator import late_offloads, served_launches, simulate

COPY_ORDERS: tuple[str, ...] = ("fifo", "deadline")
"""``system.options.copy_order``: the planner's launches (``fifo``) or :func:`retime_copies`'."""

TAIL_OFFLOADS: tuple[str, ...] = ("in_step", "next_step")
"""``system.options.tail_offloads``: the planner's launches (``in_step``) or
:func:`defer_tail_offloads`'."""


def retime_copies(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth, shared_ssd: bool = True,
                  stream_frees: bool = False) -> MigrationPlan:
    """``plan`` with its host-tier copies launched in deadline order (module docstring), if
    that simulates no slower than ``plan`` (FIFO, as the engine serves it); else ``plan``.

    Both plans are simulated at ``tiers`` (``shared_ssd`` as for ``simulate``); the plan
    returned records ``meta["copy_order"]`` (``"deadline"`` or ``"fifo"``) and
    ``meta["copy_order_sim"]``, the simulated iteration seconds of each. A plan without host
    migrations, or for a trace whose parameters are updated in host memory (the simulator
    replays those FIFO only), is returned as it is, with ``copy_order`` ``"fifo"``.

    Raises:
        ValueError: as ``teraio.perf.simulator.simulate``.
    """
    if trace.meta.get("host_update") or not any(m.tier == "host" for m in plan.migrations):
        return dataclasses.replace(plan, meta={**plan.meta, "copy_order": "fifo"})
    after, before = served_launches(trace, plan, tiers, policy="edf", shared_ssd=shared_ssd,
                                    stream_frees=stream_frees)
    migrations = [dataclasses.replace(m, launch_after=int(a) if a != m.offload_after else -1,
                                      launch_before=int(b) if b != m.prefetch_before else -1)
                  if m.tier == "host" else m
                  for m, a, b in zip(plan.migrations, after, before)]
    retimed = dataclasses.replace(plan, migrations=migrations, meta={**plan.meta, "copy_order": "deadline"})
    seconds = {order: simulate(trace, p, tiers, shared_ssd=shared_ssd, stream_frees=stream_frees).iteration_seconds
               for order, p in (("fifo", plan), ("deadline", retimed))}
    kept = retimed if seconds["deadline"] <= seconds["fifo"] else dataclasses.replace(
        plan, meta={**plan.meta, "copy_order": "fifo"})
    kept.meta["copy_order_sim"] = seconds
    return kept


def defer_tail_offloads(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth, shared_ssd: bool = True,
                        stream_frees: bool = False, host_update_gbps: float | None = None) -> MigrationPlan:
    """``plan`` with each offload that would still be copying when its step's last op ends
    launched after that op instead (``launch_after = n_ops - 1``), where its window crosses
    the step boundary (freed in the next step, so the step never waits for it).

    Why: the simulator's steady state lets such a copy run on into the next step, but a
    step ends with a host sync (the loss read) and the training loop synchronises the device
    after each step, so a copy launched in the step's last ops (the optimizer state written
    by the update) is waited for at the step's end with nothing left to hide it: at
    fig7_h200's Llama3-8B cut on an H100, 4.2 GB of AdamW moments, 0.11 s of a 4.9 s step
    (``runs/reference/h100/microbatch_auto``). The engine launches the offloads after a
    step's last op as the next step starts (``teraio.core.engine``), so those copies run
    beside the next step's first ops, as the simulator has them. The tensor's bytes stay
    where the plan accounts them (on the device until ``free_before``); the data is final
    (nothing writes it before its next use in the next step).

    Which copies: ``teraio.perf.simulator.late_offloads`` of ``plan`` at ``tiers``
    (``shared_ssd``, ``stream_frees``, ``host_update_gbps`` as for ``simulate``). The plan
    returned records ``meta["tail_offloads"]``: ``{"deferred": count, "bytes": total}``. A
    trace whose parameters are updated in host memory is simulated at ``host_update_gbps``
    (with the host update on an H100, the device AdamW's last moments, 4.2 GB, were waited
    for at each step's end: ``runs/reference/h100/host_update/beside_torchao``); without
    that rate it is returned as it is, with ``{"deferred": 0, "bytes": 0}``.

    Raises:
        ValueError: as ``teraio.perf.simulator.simulate``.
    """
    n = trace.n_ops
    late = (late_offloads(trace, plan, tiers, shared_ssd=shared_ssd, stream_frees=stream_frees,
                          host_update_gbps=host_update_gbps)
            if not trace.meta.get("host_update") or host_update_gbps else [False] * len(plan.migrations))
    deferred = [i for i, m in enumerate(plan.migrations) if late[i] and m.offload_launch != n - 1]
    migrations = list(plan.migrations)
    for i in deferred:
        migrations[i] = dataclasses.replace(migrations[i], launch_after=n - 1)
    return dataclasses.replace(plan, migrations=migrations, meta={
        **plan.meta, "tail_offloads": {"deferred": len(deferred),
                                       "bytes": sum(plan.migrations[i].nbytes for i in deferred)}})
