"""Replaying runs through the performance model (``teraio.perf.simulator``): a run's trace
planned again at the settings its committed plan was made with (:func:`plan_as_committed`),
and a run's plan simulated beside the iterations it measured (:func:`replay_run`).

A committed plan records its settings in ``plan.meta`` (``teraio.core.planner``): its rates
(``tiers_gbps``, GB/s), host cap, drive model and options; :func:`plan_tiers` and
:func:`plan_as_committed` read them from there, so a trace is replanned at its run's
capacity, host cap and rates without its config. A run's own rates are its config's
(:func:`run_tiers`).
"""
from __future__ import annotations

import dataclasses
import statistics

from teraio.core.bandwidth import TierBandwidth
from teraio.core.plan import MigrationPlan
from teraio.core.trace import Trace
from teraio.perf import jobdir
from teraio.perf.choose import plan_fastest
from teraio.perf.simulator import SimResult, simulate


def plan_tiers(plan: MigrationPlan) -> TierBandwidth:
    """The rates ``plan`` was made at (``meta["tiers_gbps"]``, GB/s)."""
    return TierBandwidth(**plan.meta["tiers_gbps"])


def run_tiers(config: dict) -> TierBandwidth:
    """The rates a run was configured with: a result row's ``config`` (``teraio.result``),
    its SSD tier's rates per drive times its drives (``hardware.ssd_dirs``), as
    ``teraio.trainer.machine.tier_bandwidth`` gives them to the planner."""
    hw = config["hardware"]
    n = len(hw["ssd_dirs"])
    return TierBandwidth(hw["ssd_write_gbps"] * n, hw["ssd_read_gbps"] * n, hw["host_d2h_gbps"], hw["host_h2d_gbps"])


def plan_as_committed(trace: Trace, committed: MigrationPlan, host_cap_bytes: int | None = None,
                      host_arena: bool | str | None = None, ssd_cap_bytes: int | None = None,
                      recompute: bool | str = False, host_placement=None) -> MigrationPlan:
    """``trace`` planned by the current planner (``teraio.perf.choose.plan_fastest``) as
    ``committed`` was: at its capacity, rates, benefit, smallest tensor, drive model and
    stall setting; at its host cap unless ``host_cap_bytes`` is given (bytes; 0 plans
    TeraIO-SSD); its host packing unless ``host_arena`` is given (true, false or
    ``"auto"``); its SSD files within its room unless ``ssd_cap_bytes`` is given (bytes);
    with ``recompute`` as ``plan_fastest`` takes it; and with ``host_placement``
    (``plan_migrations``'; only with ``host_arena`` false) where given. Its choices are
    simulated with ``committed``'s ``meta["stream_frees"]`` (false in a plan made before plans
    recorded it), without a host AdamW rate.

    Raises:
        ValueError: a bad ``host_arena``, ``recompute`` or ``host_placement``, or what
            ``plan_migrations`` refuses (a negative host cap, ...).
    """
    meta = committed.meta
    options = {} if host_placement is None else {"host_placement": host_placement}
    return plan_fastest(trace, committed.capacity_bytes, plan_tiers(committed),
                        host_cap_bytes=meta["host_cap_bytes"] if host_cap_bytes is None else host_cap_bytes,
                        benefit=meta["benefit"], min_tensor_bytes=meta["min_tensor_bytes"],
                        use_ssd=meta["use_ssd"], allow_stalls=meta["allow_stalls"],
                        shared_ssd=meta["shared_ssd"],
                        host_arena=meta.get("host_arena", False) if host_arena is None else host_arena,
                        ssd_cap_bytes=meta.get("ssd_cap_bytes") if ssd_cap_bytes is None else ssd_cap_bytes,
                        recompute=recompute, stream_frees=meta.get("stream_frees", False), **options)


def replayed_trace(trace: Trace, plan: MigrationPlan) -> tuple[Trace, float | None]:
    """``trace`` (a run's profiled step, as saved) as ``plan`` was made for it, and the host's
    AdamW rate to simulate it at (GB/s): where the plan updates parameters in host memory
    (``meta["host_update_auto"]["hosted"]``, ``teraio.perf.choose.plan_host_update``), the
    trace without their device updates (``Trace.with_host_update``), its gradients released
    after their last use as a run with host updates always has them
    (``Trace.with_released_grads``), and the rate the plan recorded; else ``trace`` and None.

    Raises:
        ValueError: a plan that updates parameters in host memory without naming them
            (made before plans recorded them), or as ``Trace.with_host_update``.
    """
    auto = plan.meta.get("host_update_auto") or {}
    if auto.get("kept") is None:
        return trace, None
    if "hosted" not in auto:
        raise ValueError("the plan updates parameters in host memory (host_update_auto.kept="
                         f"{auto['kept']}) but does not name them: made before plans recorded "
                         "host_update_auto.hosted, it cannot be replayed")
    return trace.with_host_update(auto["hosted"]).with_released_grads(), auto["gbps"]  # a host update releases them


def saved_run(job) -> tuple[dict, Trace, MigrationPlan, float | None]:
    """A TeraIO run's job directory (``teraio.perf.jobdir``) as a replay takes it: its row, the
    trace its plan was made for (:func:`replayed_trace` of the saved trace), its plan, and the
    host's AdamW rate for the parameters it updates in host memory (None: none).

    Raises:
        ValueError: the directory lacks its row, trace or plan, or as :func:`replayed_trace`.
    """
    plan = jobdir.plan(job)
    trace, gbps = replayed_trace(jobdir.trace(job), plan)
    return jobdir.result(job), trace, plan, gbps


@dataclasses.dataclass(frozen=True)
class Replay:
    """A run's plan simulated (``simulated``) beside the iterations it measured
    (``iterations``: the row's, each with ``seconds``, ``stall_seconds`` and
    ``stall_count``). Means are over the measured iterations; seconds throughout."""

    simulated: SimResult
    iterations: list[dict]

    @property
    def measured_iteration_seconds(self) -> float:
        return statistics.fmean(i["seconds"] for i in self.iterations)

    @property
    def measured_stall_seconds(self) -> float:
        return statistics.fmean(i["stall_seconds"] for i in self.iterations)

    @property
    def measured_stall_count(self) -> float:
        return statistics.fmean(i["stall_count"] for i in self.iterations)

    @property
    def predicted_over_measured(self) -> float:
        """Simulated over measured iteration seconds (1: the model is exact)."""
        return self.simulated.iteration_seconds / self.measured_iteration_seconds


def replay_run(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth, iterations: list[dict],
               policy: str = "fifo", shared_ssd: bool = False, step_sync: bool = False,
               host_update_gbps: float | None = None, stream_frees: bool = False) -> Replay:
    """``plan`` on ``trace`` simulated at ``tiers`` (``simulate``'s ``policy``,
    ``shared_ssd``, ``step_sync``, ``host_update_gbps`` and ``stream_frees``), beside the run's measured
    ``iterations`` (its row's). A run's saved trace and plan: :func:`replayed_trace` first.

    Raises:
        ValueError: no measured iteration, or what ``simulate`` refuses.
    """
    if not iterations:
        raise ValueError("iterations=[]: a replay needs the run's measured iterations")
    return Replay(simulate(trace, plan, tiers, policy=policy, shared_ssd=shared_ssd, step_sync=step_sync,
                           host_update_gbps=host_update_gbps, stream_frees=stream_frees), list(iterations))
