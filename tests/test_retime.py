"""The host link's copies in deadline order and a step's tail offloads launched as the next
step starts (``teraio.perf.retime``): launches the simulator and the engine follow, moved
only within their windows, never slower in simulation, and training under a plan with moved
launches bit-identical to plain PyTorch's."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from teraio.core.bandwidth import TierBandwidth
from teraio.core.engine import MigrationEngine
from teraio.core.plan import MigrationPlan
from teraio.core.planner import plan_migrations
from teraio.core.profiler import persistent_tensors
from teraio.perf.retime import defer_tail_offloads, retime_copies
from teraio.perf.simulator import late_offloads, served_launches, simulate
from teraio.perf.synth import layered_trace
from teraio.trainer.options import TeraIOOptions
from conftest import open_tiers
from test_engine import CPU, every_gap_plan, profiled, share_slots, train_bit_exact
from test_simulator import GB, plan_of, trace_of


def test_copies_launched_at_one_op_go_in_the_order_of_their_waits():
    # X (2 GB, needed by op 7) and Y (0.5 GB, needed by op 2) are both prefetched before op 1,
    # X first in the plan. In plan order the link serves X first and op 2 waits 1.5 s for Y;
    # in deadline order Y goes first and nothing waits. (Their offloads' frees wait on the
    # device: ``stream_frees``.)
    tr = trace_of([1.0] * 8)
    plan = plan_of(8, (2 * GB, 0, 1, 1, 7, "host"), (GB // 2, 0, 1, 1, 2, "host"))
    tiers = TierBandwidth(1.0, 1.0, 1.0, 1.0)
    assert simulate(tr, plan, tiers).op_stall_seconds[1] > 0  # the engine without device_waits
    assert simulate(tr, plan, tiers, stream_frees=True).op_stall_seconds.tolist() == [0, 0, 1.5, 0, 0, 0, 0, 0]
    ordered = dataclasses.replace(plan, meta={**plan.meta, "copy_order": "deadline"})
    assert simulate(tr, ordered, tiers, stream_frees=True).stall_seconds == 0.0
    kept = retime_copies(tr, plan, tiers, stream_frees=True)
    assert kept.meta["copy_order"] == "deadline" and kept.meta["copy_order_sim"] == {"fifo": 9.5, "deadline": 8.0}


def test_a_later_launch_is_where_the_simulator_issues_the_copy():
    # A 2 s read launched before op 1 is done at 3 s, before its use (op 4, at 4 s); launched
    # before op 3 it is done at 5 s, and op 4 waits 1 s. An offload launched after op 2
    # instead of op 0 likewise starts at 3 s and its free (before op 4) waits 1 s.
    plan = plan_of(8, (GB, 0, 4, 4, 7, "host"))
    tiers = TierBandwidth(1.0, 1.0, 0.5, 1.0)
    assert simulate(trace_of([1.0] * 8), plan, tiers).stall_seconds == 0.0
    late = dataclasses.replace(plan, migrations=[dataclasses.replace(plan.migrations[0], launch_after=2)])
    assert late.migrations[0].offload_launch == 2
    assert simulate(trace_of([1.0] * 8), late, tiers).op_stall_seconds.tolist() == [0, 0, 0, 0, 1.0, 0, 0, 0]
    tr, tiers = trace_of([1.0] * 6), TierBandwidth(1.0, 1.0, 0.5, 0.5)
    plan = plan_of(6, (GB, 0, 1, 1, 4, "host"))
    assert simulate(tr, plan, tiers, stream_frees=True).stall_seconds == 0.0
    late = dataclasses.replace(plan, migrations=[dataclasses.replace(plan.migrations[0], launch_before=3)])
    assert late.migrations[0].prefetch_launch == 3
    assert simulate(tr, late, tiers, stream_frees=True).op_stall_seconds.tolist() == [0, 0, 0, 0, 1.0, 0]
    for bad in ({"launch_before": 5}, {"launch_before": 0}, {"launch_after": 1}):
        outside = dataclasses.replace(plan, migrations=[dataclasses.replace(plan.migrations[0], **bad)])
        with pytest.raises(ValueError, match="are not in cyclic order"):
            simulate(tr, outside, tiers)
    # a plan's JSON holds the launches only where they are set
    assert "launch_before" not in plan.to_dict()["migrations"][0]
    assert MigrationPlan.from_dict(late.to_dict()) == late


@pytest.mark.parametrize("seed", range(3))
def test_retimed_launches_stay_in_their_windows_and_never_simulate_slower(seed):
    tr = layered_trace(6 + 2 * seed, mm_seconds=4e-3)
    tiers = TierBandwidth(2.0, 3.0, 6.0 + seed, 5.0)
    plan = plan_migrations(tr, int(tr.peak_bytes() * 0.45), tiers, host_cap_bytes=8 << 30, shared_ssd=True)
    assert sum(m.tier == "host" for m in plan.migrations) > 10
    n = tr.n_ops
    after, before = served_launches(tr, plan, tiers, shared_ssd=True)
    retimed = retime_copies(tr, plan, tiers, shared_ssd=True)
    sim = retimed.meta["copy_order_sim"]
    assert sim["fifo"] == simulate(tr, plan, tiers, shared_ssd=True).iteration_seconds
    assert (retimed.meta["copy_order"] == "deadline") == (sim["deadline"] <= sim["fifo"])
    moved = 0
    for m, r, a, b in zip(plan.migrations, retimed.migrations, after, before):
        assert (r.offload_after, r.free_before, r.prefetch_before, r.needed_by) == \
               (m.offload_after, m.free_before, m.prefetch_before, m.needed_by)
        # later or the same, before the free (offload) or before the use (prefetch), never
        # across the iteration's end
        assert m.offload_after <= a and (a - m.offload_after) % n < (m.free_before - m.offload_after) % n
        assert m.prefetch_before <= b <= max(m.prefetch_before, (m.needed_by - 1) % n)
        if retimed.meta["copy_order"] == "deadline":
            assert (r.offload_launch, r.prefetch_launch) == ((a, b) if m.tier == "host" else
                                                             (m.offload_after, m.prefetch_before))
            moved += (r.offload_launch, r.prefetch_launch) != (m.offload_after, m.prefetch_before)
    assert retimed.meta["copy_order"] == "fifo" or moved > 0


def test_a_trace_with_host_updates_keeps_its_launches():
    tr = trace_of([1.0] * 4)
    tr.meta["host_update"] = {"param:w": {}}
    plan = plan_of(4, (GB, 0, 1, 2, 3, "host"))
    kept = retime_copies(tr, plan, TierBandwidth.uniform(1.0))
    assert kept.meta["copy_order"] == "fifo" and kept.migrations == plan.migrations


def test_training_under_moved_launches_is_bit_exact_and_launches_there(tmp_path):
    # Every gap of every tensor offloaded to the host tier, slots shared where periods allow,
    # the free two ops after the offload and the prefetch as early as the free: each offload
    # launched just before its free, each prefetch just before its use.
    model, opt, losses, trace = profiled()
    base = share_slots(every_gap_plan(trace, lambda i: "host", free_delay=2))
    n = trace.n_ops
    migs = [dataclasses.replace(m, prefetch_before=m.free_before,
                                launch_after=(m.free_before - 1) % n, launch_before=(m.needed_by - 1) % n)
            for m in base.migrations]
    migs = [dataclasses.replace(m, launch_after=-1 if m.launch_after < m.offload_after else m.launch_after,
                                launch_before=-1 if m.launch_before < m.prefetch_before else m.launch_before)
            for m in migs]
    plan = dataclasses.replace(base, migrations=migs, meta={"copy_order": "deadline"})
    assert sum(m.launch_after >= 0 for m in migs) > 5 and sum(m.launch_before >= 0 for m in migs) > 5
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    train_bit_exact(eng, model, opt, losses, n_steps=6)
    launched = {(r["tensor"], r["direction"], r["op_issued"]) for r in eng.transfers if r["step"] == 5}
    for m in migs:
        if not m.wraps:
            assert (m.name, "offload", m.offload_launch) in launched
            assert (m.name, "prefetch", m.prefetch_launch) in launched


def test_a_bad_copy_order_is_named():
    with pytest.raises(ValueError, match="copy_order='lifo'; valid: fifo, deadline"):
        TeraIOOptions(copy_order="lifo")


def test_only_copies_still_running_at_the_step_end_and_freed_in_the_next_are_deferred():
    # 8 ops of 1 s, links of 1 GB/s, nothing stalls. A (1.5 GB, offloaded after op 6, freed
    # before op 3 of the next step) is still copying when op 7 ends (done at 8.5 s): deferred.
    # B (0.25 GB, after op 6, freed before op 2 of the next step) is queued behind A: late
    # too. C (1 GB, after op 2, freed before op 1 of the next step) is done at 4 s: kept.
    # D (1 GB to the SSD, after op 5, freed before op 7 of its own step) is waited for
    # inside the step: kept.
    tr = trace_of([1.0] * 8)
    plan = plan_of(8, (3 * GB // 2, 6, 3, 4, 6, "host"), (GB // 4, 6, 2, 4, 6, "host"),
                   (GB, 2, 1, 1, 2, "host"), (GB, 5, 7, 0, 3, "ssd"))
    tiers = TierBandwidth.uniform(1.0)
    assert simulate(tr, plan, tiers).stall_seconds == 0.0
    assert late_offloads(tr, plan, tiers).tolist() == [True, True, False, False]
    out = defer_tail_offloads(tr, plan, tiers)
    assert [m.offload_launch for m in out.migrations] == [7, 7, 2, 5]
    assert out.meta["tail_offloads"] == {"deferred": 2, "bytes": 3 * GB // 2 + GB // 4}
    # the launches move within their windows, and by no more than the step's last ops
    assert simulate(tr, out, tiers).iteration_seconds == pytest.approx(simulate(tr, plan, tiers).iteration_seconds)
    again = defer_tail_offloads(tr, out, tiers)  # already after the last op: nothing more to move
    assert again.meta["tail_offloads"] == {"deferred": 0, "bytes": 0} and again.migrations == out.migrations
    # a trace that updates a parameter in host memory cannot be simulated without the host's
    # AdamW rate: without it the plan is kept as it is
    held = host_updated(8, GB, grad_write=1, first_use=5)
    kept = defer_tail_offloads(held, plan, tiers)
    assert kept.migrations == plan.migrations and kept.meta["tail_offloads"]["deferred"] == 0
    with pytest.raises(ValueError, match="host_update_gbps"):
        late_offloads(held, plan, tiers)


def host_updated(n_ops: int, nbytes: int, grad_write: int, first_use: int):
    """``n_ops`` ops of 1 s whose step updates one parameter of ``nbytes`` in host memory: its
    gradient goes down after op ``grad_write``, the parameter comes back before op
    ``first_use`` of the next step (``Trace.with_host_update``'s ``meta["host_update"]``)."""
    tr = trace_of([1.0] * n_ops)
    tr.meta["host_update"] = {"param:w": {"grad": "grad:w", "grad_write": grad_write, "last_use": grad_write,
                                          "first_use": first_use, "nbytes": nbytes}}
    return tr


def test_a_step_with_host_updates_defers_the_offloads_its_gradients_copies_make_late():
    # 8 ops of 1 s, links of 1 GB/s; X (1.5 GB) offloaded after op 5, freed before op 1 of the
    # next step: alone it copies from 6 s to 7.5 s, inside the step. Behind a 2 GB gradient
    # that goes down after op 4 (5 s to 7 s) it copies until 8.5 s, past the step's end
    # (8 s): deferred; behind a 0.5 GB one it ends at 7.5 s: kept. The host's AdamW
    # (100 GB/s) brings each parameter back long before op 7 of the next step: nothing stalls.
    tiers = TierBandwidth.uniform(1.0)
    plan = plan_of(8, (3 * GB // 2, 5, 1, 2, 5, "host"))
    assert defer_tail_offloads(trace_of([1.0] * 8), plan, tiers).migrations == plan.migrations
    big, small = host_updated(8, 2 * GB, grad_write=4, first_use=7), host_updated(8, GB // 2, grad_write=4, first_use=7)
    assert simulate(big, plan, tiers, host_update_gbps=100.0).stall_seconds == 0.0
    assert late_offloads(big, plan, tiers, host_update_gbps=100.0).tolist() == [True]
    deferred = defer_tail_offloads(big, plan, tiers, host_update_gbps=100.0)
    assert [m.offload_launch for m in deferred.migrations] == [7]
    assert deferred.meta["tail_offloads"] == {"deferred": 1, "bytes": 3 * GB // 2}
    assert defer_tail_offloads(small, plan, tiers, host_update_gbps=100.0).migrations == plan.migrations


def test_a_synchronised_step_waits_for_its_tail_copies_but_not_for_those_launched_after_its_last_op():
    # 8 ops of 1 s, a 1 GB/s link; A (1.5 GB) offloaded after op 6, freed before op 3 of the
    # next step. Run on, the copy ends 0.5 s into the next step and nothing waits; with the
    # device synchronised at each step's end, op 0 waits 0.5 s for it; launched after op 7
    # (defer_tail_offloads) it is issued after that sync and ends before op 3 needs it.
    tr, tiers = trace_of([1.0] * 8), TierBandwidth.uniform(1.0)
    plan = plan_of(8, (3 * GB // 2, 6, 3, 4, 6, "host"))
    assert simulate(tr, plan, tiers).iteration_seconds == 8.0
    synced = simulate(tr, plan, tiers, step_sync=True)
    assert synced.iteration_seconds == 8.5 and synced.op_stall_seconds.tolist() == [0.5] + [0.0] * 7
    deferred = defer_tail_offloads(tr, plan, tiers)
    assert deferred.migrations[0].offload_launch == 7
    assert simulate(tr, deferred, tiers, step_sync=True).iteration_seconds == 8.0
    # copies that end inside the step add nothing
    two = plan_of(8, (3 * GB // 2, 6, 3, 4, 6, "host"), (GB, 0, 2, 2, 3, "host"))
    assert simulate(tr, two, tiers, step_sync=True).iteration_seconds == 8.5


def test_offloads_after_the_last_op_launch_as_the_next_step_starts_bit_exact(tmp_path):
    # Every gap of every tensor offloaded to the host tier; each offload whose window crosses
    # the step boundary freed before op 0 of the next step and launched after the step's
    # last op: the engine launches those before op 0 of the next step (then waits for them
    # there), never after op n-1, and training stays bit-identical.
    model, opt, losses, trace = profiled()
    base = share_slots(every_gap_plan(trace, lambda i: "host"))
    n = trace.n_ops
    migs = [dataclasses.replace(m, free_before=0, launch_after=n - 1)
            if m.wraps and m.prefetch_before < m.offload_after < n - 1 else m for m in base.migrations]
    deferred = {m.name for m in migs if m.launch_after == n - 1}
    assert len(deferred) > 3
    plan = dataclasses.replace(base, migrations=migs)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    train_bit_exact(eng, model, opt, losses, n_steps=6)
    rows = [r for r in eng.transfers if r["direction"] == "offload" and r["tensor"] in deferred]
    assert not any(r["op_issued"] == n - 1 for r in rows)
    for step in (3, 4, 5):  # launched by the step before; the first engine step's were primed
        assert {r["tensor"] for r in rows if r["step"] == step and r["op_issued"] == 0} == deferred
    assert not any(r["step"] == 2 and r["op_issued"] == 0 for r in rows)


def test_a_bad_tail_offloads_is_named():
    with pytest.raises(ValueError, match="tail_offloads='later'; valid: in_step, next_step"):
        TeraIOOptions(tail_offloads="later")
