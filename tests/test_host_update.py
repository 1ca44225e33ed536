"""The optimizer update where its state lives (teraio.core.host_update): the trace of a step
whose device optimizer no longer holds some parameters, the planner and simulator on it."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from teraio.core.bandwidth import TierBandwidth
from teraio.core.plan import MigrationPlan
from teraio.core.planner import inactive_periods
from teraio.core.profiler import profile_step
from teraio.core.trace import TensorRecord, Trace
from teraio.harness.compose import compose_run_config
from teraio.perf.simulator import simulate
from teraio.workload.models import build_model
from teraio.workload.step import make_batch, make_optimizer, train_step

CPU = torch.device("cpu")
HOSTED = ["param:layers.0.attention.wq.weight", "param:output.weight", "param:tok_embeddings.weight"]


def tiny():
    cfg = compose_run_config(["model=llama3_tiny", "system=ideal", "workload.batch_size=4",
                              "workload.micro_batch_size=2", "workload.seq_len=64"])
    model = build_model(cfg.model, 64, CPU, 0)
    opt = make_optimizer(model, 1e-3)

    def step(s):
        x, y = make_batch(s, cfg.workload, cfg.model.vocab_size, 0, CPU)
        return lambda: train_step(model, opt, x, y, 2)
    step(0)()
    return model, opt, step


def drop_from_optimizer(model, opt, names):
    params = dict(model.named_parameters())
    gone = {id(params[n[len("param:"):]]) for n in names}
    for g in opt.param_groups:
        g["params"] = [p for p in g["params"] if id(p) not in gone]
    for n in names:
        opt.state.pop(params[n[len("param:"):]])


def shape(trace, hosted=()):
    """What a step's trace is, but the names of its inputs (numbered by the profiler's
    records) and the kind of a hosted gradient (a plain temporary to a profiler that no
    longer sees its optimizer read it)."""
    grads = {trace.meta["host_update"][p]["grad"] for p in hosted} if hosted else set()
    return sorted((t.name if t.kind != "input" else "input", t.nbytes,
                   "temp" if t.name in grads else t.kind, t.persistent, tuple(t.uses)) for t in trace.tensors)


def test_a_trace_with_host_updates_is_the_step_whose_optimizer_no_longer_holds_those_parameters():
    model, opt, step = tiny()
    _, full = profile_step(step(1), model, opt, CPU)
    hosted = full.with_host_update(HOSTED)
    drop_from_optimizer(model, opt, HOSTED)
    _, real = profile_step(step(2), model, opt, CPU)
    assert hosted.op_names == real.op_names and hosted.meta["optimizer_ops"] == real.meta["optimizer_ops"]
    assert shape(hosted, HOSTED) == shape(real)
    assert hosted.n_ops == full.n_ops - 10 * len(HOSTED)  # a per-tensor AdamW: 10 ops per parameter
    for p in HOSTED:
        u = hosted.meta["host_update"][p]
        grad = next(t for t in hosted.tensors if t.name == u["grad"])
        param = next(t for t in hosted.tensors if t.name == p)
        assert grad.kind == "grad" and u["grad_write"] == grad.uses[-1] < hosted.meta["optimizer_ops"][0]
        assert (u["first_use"], u["last_use"], u["nbytes"]) == (param.uses[0], param.uses[-1], param.nbytes)
        assert not any(t.name.startswith("optim:" + p[len("param:"):] + ":") for t in hosted.tensors)
    # the planner offers no wrap-around period of a hosted parameter: its copy comes back refreshed
    wrapping = {hosted.tensors[int(t)].name for t, b in zip(*(lambda P: (P.tid, P.b))(inactive_periods(hosted, 0)))
                if b >= hosted.n_ops}
    assert wrapping and not wrapping & set(HOSTED)
    assert {p for p in HOSTED} <= {full.tensors[int(t)].name for t, b in
                                   zip(inactive_periods(full, 0).tid, inactive_periods(full, 0).b) if b >= full.n_ops}


def test_a_parameter_the_optimizer_does_not_update_is_refused_by_name():
    model, opt, step = tiny()
    _, full = profile_step(step(1), model, opt, CPU)
    with pytest.raises(ValueError, match=r"not updated with a gradient in optimizer.step: \['param:nope'\]"):
        full.with_host_update(["param:nope"])
    with pytest.raises(ValueError, match="optimizer_ops"):
        Trace(full.op_names, full.op_seconds, full.tensors, meta={}).with_host_update(HOSTED)


def one_update_trace(first_use=0, grad_write=1, last_use=2, nbytes=int(1e9)):
    """Four ops of 1 s; one parameter P updated in host memory."""
    tensors = [TensorRecord(0, "param:P", nbytes, "param", True, sorted({first_use, last_use}))]
    meta = {"host_update": {"param:P": {"grad": "op1:out0", "grad_write": grad_write, "last_use": last_use,
                                        "first_use": first_use, "nbytes": nbytes}}}
    return Trace(["aten.mm.default"] * 4, np.ones(4), tensors, meta=meta)


@pytest.mark.parametrize("gbps,stall", [(0.5, 2.0), (10.0, 1.0)])
def test_the_simulator_waits_for_a_refreshed_parameter_as_its_gradient_update_and_copy_allow(gbps, stall):
    # 1 GB at 1 GB/s each way: the gradient leaves after op 1 (t = 2) and arrives at 3; the
    # update takes 1/gbps s from then; its copy back (1 s) starts once the update is done and
    # the next iteration has started (t = 4), as the engine issues it, and op 0 of the next
    # iteration waits for it: at 10 GB/s the update is done at 3.1 and the copy runs 4-5
    trace = one_update_trace()
    plan = MigrationPlan(4, 10**12, 10**12, 10**12, [])
    sim = simulate(trace, plan, TierBandwidth(1.0, 1.0, 1.0, 1.0), host_update_gbps=gbps)
    assert sim.stall_seconds == pytest.approx(stall) and sim.op_stall_seconds[0] == pytest.approx(stall)
    assert sim.iteration_seconds == pytest.approx(4 + stall)


def test_host_updates_need_a_rate_and_fifo_channels():
    plan = MigrationPlan(4, 10**12, 10**12, 10**12, [])
    with pytest.raises(ValueError, match="positive host_update_gbps"):
        simulate(one_update_trace(), plan, TierBandwidth(1.0, 1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="policy='fifo'"):
        simulate(one_update_trace(), plan, TierBandwidth(1.0, 1.0, 1.0, 1.0), policy="edf", host_update_gbps=1.0)


def reference_losses(steps):
    model, opt, step = tiny()
    return [step(s)() for s in range(1, steps)], dict(model.named_parameters())


@pytest.mark.parametrize("planned,slow", [(False, False), (True, False), (False, True)],
                         ids=["no-migrations", "planned", "slow-host"])
def test_training_with_host_updates_follows_plain_training(tmp_path, planned, slow):
    # slow-host: the host's AdamW takes longer than the rest of the step, so the training
    # thread waits at the norm weight's first use (op 9, before the output weight's), after
    # autograd saved that op's inputs: a norm weight is the one kind its first-use op saves,
    # and a copy back that bumped its version there failed backward (on an H100)
    from teraio.core.engine import MigrationEngine
    from teraio.core.host_update import HostUpdate, give_back, take_from_optimizer
    from teraio.core.planner import plan_migrations
    from teraio.core.profiler import persistent_tensors
    from teraio.core.tiers.host import HostTier

    steps = 8
    ref_losses, ref_params = reference_losses(steps)
    model, opt, step = tiny()
    _, full = profile_step(step(1), model, opt, CPU)
    names = ["param:output.weight", "param:layers.0.attention_norm.weight"] if slow else HOSTED
    hosted = full.with_host_update(names).with_released_grads()
    params = {"param:" + n: p for n, p in model.named_parameters() if "param:" + n in names}
    taken = take_from_optimizer(opt, params)
    assert all(not any(p is q for g in opt.param_groups for q in g["params"]) for p in params.values())
    hu = HostUpdate(params, taken, hosted.meta["host_update"], CPU)
    if planned:
        plan = plan_migrations(hosted, int(hosted.peak_bytes() * 0.6), TierBandwidth(1.0, 1.0, 1.0, 1.0),
                               host_cap_bytes=1 << 30, use_ssd=False, min_tensor_bytes=4096, allow_stalls=True)
        assert plan.migrations and not any(m.name in names and m.wraps for m in plan.migrations)
        tiers = {"host": HostTier(1 << 30, {m.name: m.nbytes for m in plan.migrations}, CPU,
                                  shares=plan.shared_slots("host"))}
    else:
        plan, tiers = MigrationPlan(hosted.n_ops, 10**12, 10**12, 10**12, []), {}
    if slow:
        for h in hu.hosted.values():
            h.optimizer.step = (lambda run: lambda: (time.sleep(0.5), run())[1])(h.optimizer.step)
    eng = MigrationEngine(hosted, plan, persistent_tensors(model, opt), tiers, CPU, release_grads=True, host_update=hu)
    eng.prime()
    got = []

    def train():
        for s in range(2, steps):
            got.append(eng.run_step(step(s), s))
        eng.close()

    runner = threading.Thread(target=train, daemon=True)
    runner.start()
    runner.join(timeout=120)
    assert not runner.is_alive(), "the training thread and the host update wait for each other"
    # steps 2.. ran with the host's fused AdamW: the same updates to rounding
    np.testing.assert_allclose(got, ref_losses[1:], rtol=1e-4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-6)
    give_back(opt, params, taken)  # and the device optimizer can take them back, in their places
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())


def test_a_replay_takes_the_hosted_parameters_from_the_plan_and_refuses_a_plan_that_does_not_name_them():
    from teraio.perf.replay import replayed_trace

    model, opt, step = tiny()
    _, full = profile_step(step(1), model, opt, CPU)
    plan = lambda auto: MigrationPlan(full.n_ops, 1, 1, 1, [], meta={"host_update_auto": auto})  # noqa: E731
    assert replayed_trace(full, plan({"off": 1.0, "variants": [], "kept": None})) == (full, None)
    trace, gbps = replayed_trace(full, plan({"kept": 0, "hosted": HOSTED, "gbps": 3.5}))
    assert gbps == 3.5 and shape(trace, HOSTED) == shape(full.with_host_update(HOSTED).with_released_grads(), HOSTED)
    with pytest.raises(ValueError, match="kept=0.* does not name them"):
        replayed_trace(full, plan({"kept": 0}))


def test_every_parameter_with_a_gradient_is_a_candidate_even_where_the_plan_keeps_its_moments_on_the_device():
    from teraio.perf.choose import hosted_candidates, plan_host_update

    model, opt, step = tiny()
    _, full = profile_step(step(1), model, opt, CPU)
    trained = sorted(f"param:{n}" for n, p in model.named_parameters() if p.requires_grad)
    assert hosted_candidates(full) == trained
    tiers = TierBandwidth(ssd_write_gbps=1.0, ssd_read_gbps=1.0, host_d2h_gbps=10.0, host_h2d_gbps=10.0)
    roomy = int(full.peak_bytes() * 2)
    plain = MigrationPlan(full.n_ops, roomy, full.peak_bytes(), full.peak_bytes(), [])
    assert not plain.migrations  # the plan without the update keeps every moment on the device
    _, plan, hosted = plan_host_update(full, plain, roomy, tiers, host_cap_bytes=1 << 40, host_update_gbps=50.0,
                                       mode="on", release_grads=False)
    record = plan.meta["host_update_auto"]
    assert hosted and set(hosted) <= set(trained) and record["kept"] is not None
    assert record["variants"][0]["params"] == len(trained)  # the first share tries every group


def test_a_point_hosts_the_groups_its_first_trial_chose_and_bad_group_counts_are_refused():
    from teraio.harness.compose import compose_run_config as compose
    from teraio.perf.choose import plan_host_update
    from teraio.trainer.options import TeraIOOptions, decision, undecided

    model, opt, step = tiny()
    _, full = profile_step(step(1), model, opt, CPU)
    tiers = TierBandwidth(ssd_write_gbps=1.0, ssd_read_gbps=1.0, host_d2h_gbps=10.0, host_h2d_gbps=10.0)
    roomy = int(full.peak_bytes() * 2)
    plain = MigrationPlan(full.n_ops, roomy, full.peak_bytes(), full.peak_bytes(), [])
    _, plan, hosted = plan_host_update(full, plain, roomy, tiers, 1 << 40, 50.0, "on", False, groups=1)
    record = plan.meta["host_update_auto"]
    assert [v["groups"] for v in record["variants"]] == [1] and record["kept"] == 0
    assert hosted and len({h.split(".")[0] for h in hosted}) == 1  # one top-level module or block
    # the row's record gives the groups back, and a point whose groups are given decides nothing more
    row = {"status": "ok", "plan": {"recomputes": 0, "host_update": {"params": len(hosted), **record}}}
    assert decision(row)[0] == {"recompute": "off", "host_arena": False, "host_update": "on", "host_update_groups": 1}
    on = ["model=llama3_tiny", "system=teraio_mixed", "system.options.host_update=on"]
    assert "host_update" in undecided(compose(on))
    assert "host_update" not in undecided(compose(on + ["system.options.host_update_groups=2"]))
    with pytest.raises(ValueError, match="host_update_groups=0.*valid: null or an integer >= 1"):
        TeraIOOptions(host_update="on", host_update_groups=0)
    with pytest.raises(ValueError, match="host_update_groups=1 with host_update='auto'"):
        plan_host_update(full, plain, roomy, tiers, 1 << 40, 50.0, "auto", False, groups=1)


def test_the_trial_that_chose_its_host_update_groups_reads_as_run_with_them():
    # the deciding trial's config says null; the trials after it were given its number
    from analysis.trials import ran_with

    plan = {"recomputes": 0, "host_arena": False,
            "host_update": {"params": 20, "kept": 1, "variants": [{"groups": 7}, {"groups": 4}]}}
    options = {"recompute": "auto", "host_arena": "auto", "host_update": "on", "host_update_groups": None}
    row = {"status": "ok", "plan": plan, "config": {"system": {"name": "teraio_mixed", "options": options}}}
    assert ran_with(row)["system"]["options"] == {"recompute": "off", "host_arena": False, "host_update": "on",
                                                  "host_update_groups": 4}
