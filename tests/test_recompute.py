"""Recompute as the planner's third option: chains from a trace, the planner's choice,
the simulator's charge, and the plan's round trip."""
import numpy as np
import pytest
import torch

from teraio.core.bandwidth import TierBandwidth
from teraio.core.plan import MigrationPlan
from teraio.core.planner import predicted_live_bytes
from teraio.core.recompute import Chains, is_inplace, is_pure
from teraio.core.trace import TensorRecord, Trace
from teraio.perf.choose import REGION_MARGIN, plan_fastest
from teraio.perf.replay import plan_as_committed
from teraio.perf.simulator import simulate

GB = 10**9


def attention_trace(middle_op: str = "aten.mm.default", busy_at_use: int = 0, n_ops: int = 12,
                    softmax_op: str = "aten._safe_softmax.default") -> Trace:
    """q made at op 0 and read again at op 10; op 1 makes scores S from q (a temp), op 2
    (``softmax_op``) softmax P from S, read by op 3 and again by op 9 (its backward use); op 5
    (``middle_op``) touches q; ops 4..7 hold a 3 GB temp each, so memory peaks between P's
    uses, and op 9 one of ``busy_at_use`` bytes."""
    names = ["aten.mm.default", "aten.bmm.default", softmax_op, "aten.bmm.default",
             "aten.mm.default", middle_op] + ["aten.mm.default"] * (n_ops - 6)
    recs = [TensorRecord(0, "param:w", GB, "param", True, list(range(n_ops))),
            TensorRecord(1, "op0:out0", GB // 10, "activation", False, [0, 1, 5, 10]),
            TensorRecord(2, "op1:out0", 2 * GB, "temp", False, [1, 2]),
            TensorRecord(3, "op2:out0", 2 * GB, "activation", False, [2, 3, 9])]
    for k in range(4, 8):
        recs.append(TensorRecord(len(recs), f"op{k}:out0", 3 * GB, "temp", False, [k]))
    if busy_at_use:
        recs.append(TensorRecord(len(recs), "op9:out0", busy_at_use, "temp", False, [9]))
    secs = np.full(n_ops, 1.0)
    secs[[1, 2]] = 0.01  # the chain is cheap
    return Trace(names, secs, recs)


def test_chain_reruns_the_producers_of_dead_inputs_from_resident_ones():
    tr = attention_trace()
    ch = Chains(tr).chain(3, 9)
    assert ch.ops == [1, 2]  # bmm then softmax; q (tid 1) is resident at op 9
    assert ch.inputs == [0, 1]
    assert ch.seconds == pytest.approx(0.02)
    assert ch.extra_bytes == 2 * GB  # S and P coexist at the softmax


@pytest.mark.parametrize("op", ["aten.add_.Tensor", "aten.mm.out"])
def test_no_chain_through_an_input_written_in_place(op):
    assert Chains(attention_trace(middle_op=op)).chain(3, 9) is None


def test_op_classes():
    assert is_inplace("aten.add_.Tensor") and is_inplace("aten.mm.out")
    assert not is_inplace("aten._safe_softmax.default") and not is_inplace("aten.__and__.Tensor")
    assert not is_pure("aten.native_dropout.default") and not is_pure("aten.empty.memory_format")
    assert is_pure("aten._safe_softmax.default")
    assert not is_pure("mylib.unknown.default") and not is_pure("not an op")  # nothing to vouch for it


def random_aten_ops() -> list[str]:
    """Every aten overload this PyTorch has that draws random numbers by its own metadata:
    tagged ``nondeterministic_seeded`` or taking a ``Generator``."""
    found = []
    for schema in torch._C._jit_get_all_schemas():
        ns, base = schema.name.split("::")
        if ns != "aten":
            continue
        name = f"aten.{base}.{schema.overload_name or 'default'}"
        op = getattr(getattr(torch.ops.aten, base), schema.overload_name or "default")
        if (torch.Tag.nondeterministic_seeded in op.tags
                or any("Generator" in str(a.type) for a in schema.arguments)):
            found.append(name)
    return found


def test_every_random_aten_op_is_refused():
    ops = random_aten_ops()
    assert len(ops) > 100 and "aten.rrelu_with_noise.default" in ops  # the enumeration sees them
    assert [o for o in ops if is_pure(o)] == []


@pytest.mark.parametrize("op", ["aten.rrelu_with_noise.default", "aten.rrelu_with_noise_functional.default",
                                "aten.rrelu.default", "aten.poisson.default", "aten.binomial.default",
                                "aten._standard_gamma.default", "aten._sample_dirichlet.default",
                                "aten.cauchy.default", "aten.geometric.default"])
def test_random_ops_whose_names_say_nothing_are_refused(op):
    assert not is_pure(op)
    assert Chains(attention_trace(softmax_op=op)).chain(3, 9) is None  # P made by it: not recomputable


@pytest.mark.parametrize("op", ["aten.mm.default", "aten.bmm.default", "aten.add.Tensor", "aten.mul.Tensor",
                                "aten.silu.default", "aten._unsafe_view.default", "aten.transpose.int",
                                "aten.native_dropout_backward.default", "aten.embedding.default",
                                "aten._safe_softmax.default", "aten.rsqrt.default"])
def test_the_deterministic_ops_of_a_step_stay_pure(op):
    # the ops the planner recomputes on the committed CUDA traces: their plans are unchanged
    assert is_pure(op)


def plan(tr, recompute, capacity=int(5.2 * GB)):
    # a drive far too slow to hide a 2 GB move behind a few seconds of compute
    return plan_fastest(tr, capacity, TierBandwidth.uniform(0.01), host_cap_bytes=0, allow_stalls=True,
                        recompute=recompute)


def test_planner_recomputes_where_moving_cannot_hide():
    tr = attention_trace()
    off, on = plan(tr, False), plan(tr, True)
    assert not off.recomputes and on.recomputes
    r = next(r for r in on.recomputes if r.name == "op2:out0")
    assert (r.name, r.drop_after, r.needed_by, r.ops) == ("op2:out0", 3, 9, [1, 2])
    assert r.recompute_before == 9
    assert on.feasible and predicted_live_bytes(tr, on).max() <= on.capacity_bytes
    assert on.meta["recomputed_bytes"] == on.recomputed_bytes() == sum(r.nbytes for r in on.recomputes)
    tiers = TierBandwidth.uniform(0.01)
    s_on, s_off = simulate(tr, on, tiers, shared_ssd=True), simulate(tr, off, tiers, shared_ssd=True)
    assert s_on.recompute_seconds == pytest.approx(sum(r.seconds for r in on.recomputes))
    assert s_on.iteration_seconds == pytest.approx(s_on.ideal_seconds + s_on.recompute_seconds + s_on.stall_seconds)
    assert s_on.iteration_seconds < s_off.iteration_seconds
    auto = plan(tr, "auto")
    assert auto.recomputes and auto.meta["recompute_auto"]["on"] < auto.meta["recompute_auto"]["off"]


def test_recompute_made_again_early_where_its_intermediates_do_not_fit_at_the_use():
    tr = attention_trace(busy_at_use=GB)  # op 9: 4.1 GB, + P's chain's 2 GB > 5.2 GB
    on = plan(tr, True)
    r = next(r for r in on.recomputes if r.name == "op2:out0")
    assert (r.drop_after, r.recompute_before, r.needed_by) == (3, 8, 9)  # op 8 has room
    assert on.feasible and predicted_live_bytes(tr, on).max() <= on.capacity_bytes


def test_plan_with_recomputes_round_trips(tmp_path):
    p = plan(attention_trace(), True)
    p.save(tmp_path / "plan.json")
    q = MigrationPlan.load(tmp_path / "plan.json")
    assert q.recomputes == p.recomputes and q.migrations == p.migrations


@pytest.mark.parametrize("gbps", [2.0, 4.0])
def test_recompute_auto_simulates_the_alternatives_as_the_engine_frees_host_offloads(gbps):
    # P (2 GB) offloaded to the host after op 3 must be gone before op 4: counted as a wait
    # for the copy (1 s at 2 GB/s), moving it looks 0.5-1 s slower than recomputing it
    # (0.02 s); the engine with device_waits frees it at once (``stream_frees``), and moving
    # is then within the margin of recomputing: "auto" keeps the plan that moves.
    tr, tiers = attention_trace(), TierBandwidth(0.01, 0.01, gbps, gbps)
    kept = {sf: plan_fastest(tr, int(5.2 * GB), tiers, host_cap_bytes=8 * GB, allow_stalls=True, recompute="auto",
                             stream_frees=sf) for sf in (False, True)}
    assert kept[False].recomputes and not kept[True].recomputes
    assert any(m.tier == "host" and m.name == "op2:out0" for m in kept[True].migrations)
    for sf, plan in kept.items():
        seconds = plan.meta["recompute_auto"]
        assert seconds["on"] == pytest.approx(10.04)
        assert seconds["off"] > 10.5 if not sf else seconds["off"] < 10.04 / (1 - REGION_MARGIN)
        assert simulate(tr, plan, tiers, shared_ssd=True, stream_frees=sf).iteration_seconds == \
            pytest.approx(seconds["on" if plan.recomputes else "off"])
    # a replan as committed (teraio.perf.replay) simulates as the plan's run did, where it says
    for sf, plan in kept.items():
        plan.meta["stream_frees"] = sf
        assert bool(plan_as_committed(tr, plan, recompute="auto").recomputes) is not sf
    del kept[True].meta["stream_frees"]  # made before plans recorded it: simulated without
    assert plan_as_committed(tr, kept[True], recompute="auto").recomputes


@pytest.mark.parametrize("bad", [1, "on", None])
def test_recompute_other_than_true_false_or_auto_is_refused(bad):
    with pytest.raises(ValueError, match="recompute="):
        plan(attention_trace(), bad)


FIG9_16GB = "runs/reference/h200/fig9_h200/llama3_8b_4l-teraio_mixed-h200-1ssd-16gb-bs8-mb2-seq3072-t0"


def test_schedule_of_a_committed_h200_trace_fits_keeps_chain_inputs_and_beats_today(tmp_path):
    """The Llama3-8B cut at 16 GB of host memory (fig9_h200): the drive is the bottleneck and
    the attention probabilities are cheap to make again."""
    import json
    from pathlib import Path

    from benchmarks.schedule import main
    from teraio.perf import jobdir
    from teraio.perf.replay import plan_as_committed

    job = Path(FIG9_16GB)
    trace, committed = jobdir.trace(job), jobdir.plan(job)
    sched = plan_as_committed(trace, committed, recompute=True)
    assert sched.feasible and sched.recomputes
    assert predicted_live_bytes(trace, sched).max() <= sched.capacity_bytes
    n = trace.n_ops
    for r in sched.recomputes:  # every input of a chain is on the GPU when the chain runs
        assert r.drop_after < r.recompute_before <= r.needed_by
        inputs = set(r.inputs)
        assert not any(m.tid in inputs and m.saves_at(r.recompute_before, n) for m in sched.migrations)
        assert not any(o.tid in inputs and o.saves_at(r.recompute_before, n) for o in sched.recomputes)
    out = tmp_path / "schedule.json"
    main([str(job), "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["command"].startswith("python -m benchmarks.schedule")
    row, = got["jobs"]
    assert {"job", "ideal_s", "today_simulated_s", "schedule_simulated_s", "recomputed_bytes", "ssd_bytes",
            "host_bytes", "host_cap_bytes"} <= set(row)
    assert row["host_cap_bytes"] == 16 * 10**9
    assert row["recomputed_bytes"] > 0
    assert row["ideal_s"] < row["schedule_simulated_s"] < row["today_simulated_s"]
    # what stays on the drive, by kind: it adds up, and gradient accumulators (written in place
    # by add_, which no recompute can make again) are among it
    kinds = row["ssd_bytes_by_kind"]
    assert sum(kinds.values()) == row["ssd_bytes"] and kinds["accumulated"] > 0 and kinds["param"] > 0


def test_the_engine_refuses_a_recompute_the_trace_does_not_describe():
    import dataclasses

    import torch

    from teraio.core.engine import MigrationEngine

    tr = attention_trace()
    p = plan(tr, True)
    p.recomputes[0] = dataclasses.replace(p.recomputes[0], name="op7:out0")
    with pytest.raises(ValueError, match=r"plan recomputes tensor \d+ 'op7:out0' but the trace has"):
        MigrationEngine(tr, p, {}, {}, torch.device("cpu"))
