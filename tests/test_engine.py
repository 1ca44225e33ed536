"""Migration engine on a real (tiny) torchtitan Llama3 training step, CPU standing in for the
GPU: bit-exact training under aggressive hand-made plans, prime/wrap-around, urgent fetches,
divergence, I/O failures, and cleanup. The planner's own plans are tested end to end in
test_teraio_train.py."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from teraio.config import ModelConfig, WorkloadConfig
from teraio.core.engine import ExecutionDivergedError, MigrationEngine, PlanDriftError, free_blocks_note
from teraio.workload.models import build_model
from teraio.core.plan import Migration, MigrationPlan, cyclic_between
from teraio.core.profiler import persistent_tensors, profile_step
from teraio.core.slots import SlotBins
from teraio.workload.step import make_batch, make_optimizer, train_step
from teraio.core.tiers.base import TierIOError, Transfer
from teraio.core.tiers.host import HostTier
from conftest import open_tiers

CPU = torch.device("cpu")
MODEL = ModelConfig(name="tiny", dim=64, n_layers=2, n_heads=4, vocab_size=256)
WORK = WorkloadConfig(batch_size=2, micro_batch_size=1, seq_len=32)


def step_fn(model, opt, step):
    x, y = make_batch(step, WORK, MODEL.vocab_size, 0, CPU)
    return lambda: train_step(model, opt, x, y, WORK.micro_batch_size)


def reference(n_steps):
    model = build_model(MODEL, WORK.seq_len)
    opt = make_optimizer(model, 1e-3)
    losses = [step_fn(model, opt, s)() for s in range(n_steps)]
    return losses, [p.detach().clone() for p in model.parameters()]


def profiled():
    """A model after step 0 and the profiled step 1: (model, opt, losses, trace)."""
    model = build_model(MODEL, WORK.seq_len)
    opt = make_optimizer(model, 1e-3)
    losses = [step_fn(model, opt, 0)()]
    loss, trace = profile_step(step_fn(model, opt, 1), model, opt, CPU)
    return model, opt, losses + [loss], trace


def every_gap_plan(trace, tier_of=lambda i: "ssd", min_gap=4, min_bytes=256, free_delay=0):
    """Offload every tensor over every inactive gap as long as possible: the freed window is
    (a, b) exclusive, persistent tensors wrap. The harshest plan for the engine.
    ``free_delay`` ops more pass between the offload's start and the free where the gap
    has room for them, as when the planner lets the write run under later ops."""
    n = trace.n_ops
    migs = []
    for t in trace.tensors:
        if t.kind == "input" or t.nbytes < min_bytes:
            continue
        uses = t.uses + ([t.uses[0] + n] if t.persistent else [])
        for a, b in zip(uses, uses[1:]):
            if b - a >= min_gap:
                free = a + 1 + (free_delay if b - a - 2 > free_delay else 0)
                migs.append(Migration(t.tid, t.name, t.nbytes, tier_of(len(migs)), a, free % n,
                                      (b - 1) % n, b % n))
    return MigrationPlan(n, 0, trace.peak_bytes(), 0, migs)


def alternate_tiers(i):
    """Every other migration to the host tier, the rest to the SSD tier (TeraIO-Mixed)."""
    return "host" if i % 2 else "ssd"


def train_bit_exact(eng, model, opt, losses, n_steps):
    """Prime ``eng``, run steps 2 .. n_steps-1 under it and close it; the losses (``losses``
    holds steps 0 and 1) and the parameters equal plain PyTorch's, bit for bit."""
    ref_losses, ref_params = reference(n_steps)
    eng.prime()
    for s in range(2, n_steps):
        losses.append(eng.run_step(step_fn(model, opt, s), s))
    eng.close()
    assert losses == ref_losses
    for p, q in zip(model.parameters(), ref_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("mixed", [False, True], ids=["ssd", "mixed"])
def test_every_gap_offloaded_is_bit_exact(tmp_path, mixed):
    model, opt, losses, trace = profiled()
    plan = every_gap_plan(trace, alternate_tiers if mixed else (lambda i: "ssd"))
    assert any(m.wraps for m in plan.migrations) and any(not m.wraps for m in plan.migrations)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    train_bit_exact(eng, model, opt, losses, n_steps=8)
    # The hand plan frees almost everything between uses: accounted residency drops far
    # below the un-offloaded peak, and every planned byte really moved.
    assert max(h.max_accounted_bytes for h in eng.history) < trace.peak_bytes() / 4
    moved = sum(m.nbytes for m in plan.migrations)
    for h in eng.history:
        assert sum(h.bytes_offloaded.values()) == moved
        assert h.urgent_count == 0
    # Wrapping prefetches bring back what the previous step offloaded (the first step's,
    # what prime() offloaded), so in steady state each step moves the same both ways.
    for h in eng.history[1:]:
        assert h.bytes_prefetched == h.bytes_offloaded


def share_slots(plan):
    """``plan`` with each tier's slots shared wherever periods allow (teraio.core.slots),
    placed in plan order as the planner places them."""
    n, out = plan.n_ops, list(plan.migrations)
    for tier in ("ssd", "host"):
        idx = [i for i, m in enumerate(out) if m.tier == tier]
        ms = [out[i] for i in idx]
        b = [m.needed_by + n * (m.needed_by <= m.offload_after) for m in ms]
        bins = SlotBins(n, np.array([m.tid for m in ms]), np.array([m.offload_after for m in ms]), np.array(b))
        names = {m.tid: m.name for m in ms}
        for i, m in zip(idx, ms):
            out[i] = dataclasses.replace(m, slot=names[bins.place(m.tid, m.nbytes)])
    return dataclasses.replace(plan, migrations=out)


@pytest.mark.parametrize("mixed", [False, True], ids=["ssd", "mixed"])
def test_shared_slots_are_bit_exact(tmp_path, mixed):
    # Every gap offloaded, and tensors whose periods never overlap write into one slot: each
    # read gets the bytes of its own tensor (a tier refuses a read of a slot overwritten since).
    model, opt, losses, trace = profiled()
    plan = share_slots(every_gap_plan(trace, alternate_tiers if mixed else (lambda i: "ssd")))
    for tier in {m.tier for m in plan.migrations}:
        assert len(plan.shared_slots(tier)) > len({m.name for m in plan.migrations if m.tier == tier}) / 4
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    train_bit_exact(eng, model, opt, losses, n_steps=6)


def test_unplanned_use_is_fetched_urgently(tmp_path):
    n_steps = 4
    ref_losses, _ = reference(n_steps)
    model, opt, losses, trace = profiled()
    # A plan that wrongly claims a weight is unused until long after its real next use.
    w = next(t for t in trace.tensors if t.name.endswith("attention.wq.weight"))
    a, b = w.uses[0], w.uses[1]
    late = trace.n_ops - 1
    plan = MigrationPlan(trace.n_ops, 0, 0, 0, [Migration(w.tid, w.name, w.nbytes, "ssd", a, a + 1, late, late)])
    assert b < late
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    for s in range(2, n_steps):
        losses.append(eng.run_step(step_fn(model, opt, s), s))
    eng.close()
    assert losses == ref_losses
    assert all(h.urgent_count >= 1 and h.stall_count >= 1 for h in eng.history)


def test_diverging_step_is_an_error(tmp_path):
    model, opt, _, trace = profiled()
    eng = MigrationEngine(trace, every_gap_plan(trace), persistent_tensors(model, opt),
                          open_tiers(every_gap_plan(trace), tmp_path), CPU)
    eng.prime()
    x, y = make_batch(2, WORK, MODEL.vocab_size, 0, CPU)
    with pytest.raises(ExecutionDivergedError, match="op 0 is"):
        eng.run_step(lambda: model(x).sum(), 2)
    eng.close()


@pytest.mark.parametrize("shape,named", [
    ({"batch_size": 2, "micro_batch_size": 1, "seq_len": 16}, "seq_len 32 -> 16"),
    ({"batch_size": 4, "micro_batch_size": 2, "seq_len": 32}, "batch_size 2 -> 4, micro_batch_size 1 -> 2"),
])
def test_a_step_of_another_shape_is_refused_before_anything_moves(tmp_path, shape, named):
    model, opt, _, trace = profiled()
    trace.meta.update(batch_size=WORK.batch_size, micro_batch_size=WORK.micro_batch_size, seq_len=WORK.seq_len)
    plan = every_gap_plan(trace)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    eng.prime()
    moved = len(eng.transfers)
    work = WorkloadConfig(**shape)
    x, y = make_batch(2, work, MODEL.vocab_size, 0, CPU)
    with pytest.raises(PlanDriftError, match=f"step 2 drifted from the profiled step: {named}"):
        eng.run_step(lambda: train_step(model, opt, x, y, work.micro_batch_size), 2, shape=shape)
    assert len(eng.transfers) == moved and eng.history == []
    eng.run_step(step_fn(model, opt, 2), 2, shape=dataclasses.asdict(WORK))  # the profiled shape runs
    eng.close()


def test_failed_write_names_tensor_and_path(tmp_path, monkeypatch):
    model, opt, _, trace = profiled()
    plan = every_gap_plan(trace)
    tiers = open_tiers(plan, tmp_path)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), tiers, CPU)
    eng.prime()

    def full_disk(fd, buf, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(TierIOError) as err:
        eng.run_step(step_fn(model, opt, 2), 2)
    assert err.value.name in {m.name for m in plan.migrations}
    assert str(tmp_path) in err.value.path
    assert err.value.name in str(err.value) and err.value.path in str(err.value)
    monkeypatch.undo()
    eng.close()


def test_fifty_steps_stay_flat_and_cleanup_is_complete(tmp_path):
    model, opt, _, trace = profiled()
    plan = every_gap_plan(trace, lambda i: "host" if i % 3 == 0 else "ssd")
    tiers = open_tiers(plan, tmp_path)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    sizes = [p.stat().st_size for p in files]
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), tiers, CPU)
    eng.prime()
    for s in range(2, 52):
        eng.run_step(step_fn(model, opt, s), s)
        assert [p.stat().st_size for p in files] == sizes
        assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == files
    accounted = {h.max_accounted_bytes for h in eng.history}
    assert len(accounted) == 1
    assert len({len([r for r in eng.transfers if r["step"] == s]) for s in range(2, 52)}) == 1
    eng.close()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    # Everything is back on the "device" and whole: one more ordinary step runs.
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    step_fn(model, opt, 52)()


def test_close_restores_only_what_is_asked_and_cleans_up(tmp_path):
    # After steps under the harshest plan, close(restore=params): the parameters come back
    # bit-exact, optimizer state offloaded at that moment stays freed, files are gone.
    n_steps = 4
    _, ref_params = reference(n_steps)
    model, opt, _, trace = profiled()
    plan = every_gap_plan(trace)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    eng.prime()
    for s in range(2, n_steps):
        eng.run_step(step_fn(model, opt, s), s)
    eng.close(restore=lambda name: name.startswith("param:"))
    for p, q in zip(model.parameters(), ref_params):
        assert torch.equal(p, q)
    states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.nbytes >= 256]
    assert any(v.untyped_storage().nbytes() == 0 for v in states)
    assert not [f for d in tmp_path.iterdir() for f in d.iterdir()]


class InjectedOOM(torch.OutOfMemoryError):
    pass


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("mixed", [False, True], ids=["ssd", "mixed"])
def test_error_mid_step_propagates_and_close_cleans_up(tmp_path, mixed):
    # An out-of-memory error halfway through a step, with migrations in flight under the
    # harshest plan: the step raises it (no hang), close() then brings the parameters back
    # whole and deletes the offload files.
    model, opt, _, trace = profiled()
    plan = every_gap_plan(trace, alternate_tiers if mixed else (lambda i: "ssd"))
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    eng.prime()
    eng.run_step(step_fn(model, opt, 2), 2)

    def out_of_memory(*args):
        raise InjectedOOM("injected: CUDA out of memory")

    model.layers["1"].register_forward_hook(out_of_memory)
    with pytest.raises(InjectedOOM):
        eng.run_step(step_fn(model, opt, 3), 3)
    eng.close(restore=lambda name: name.startswith("param:"))
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    assert not [f for d in tmp_path.iterdir() for f in d.iterdir()]


def test_out_of_memory_in_an_op_names_the_op_and_the_planned_bytes(tmp_path):
    model, opt, _, trace = profiled()
    plan = every_gap_plan(trace)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    eng.prime()
    k_fail = next(m.prefetch_before for m in plan.migrations if not m.wraps)
    launch = eng._launch_prefetch

    def launch_or_fail(t, k, **kw):
        if k == k_fail:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        launch(t, k, **kw)

    eng._launch_prefetch = launch_or_fail
    with pytest.raises(torch.OutOfMemoryError) as info:
        eng.run_step(step_fn(model, opt, 2), 2)
    accounted = int(eng.required_bytes[k_fail]) - eng._away_bytes  # nothing moved since
    eng.close()
    (note,) = info.value.__notes__
    assert note.startswith(
        f"TeraIO: out of memory at op {k_fail} ({trace.op_names[k_fail]}) of step 2; the plan "
        f"accounts {accounted} B resident there (planned peak {plan.predicted_peak_bytes} B for a "
        f"capacity of {plan.capacity_bytes} B); ")
    assert " intermediates alive past their profiled last use hold " in note


def fail_op(eng, k_fail: int, before=lambda k: None) -> None:
    """Make op ``k_fail`` of ``eng``'s steps raise an out-of-memory error before it runs,
    after calling ``before(k_fail)``."""
    check = eng._check_op

    def check_or_fail(k, func):
        if k == k_fail:
            before(k)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        check(k, func)

    eng._check_op = check_or_fail


def lingering_at_failure(tmp_path, stash: bool) -> tuple[dict, str, list]:
    """Run the engine's first step to an out-of-memory error injected before the optimizer's
    first op: (what ``lingering`` named there, name -> (bytes, last use); the error's note;
    layer 0's outputs a forward hook kept, where ``stash``)."""
    tmp_path.mkdir()
    model, opt, _, trace = profiled()
    plan = every_gap_plan(trace)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    eng.prime()
    kept = []
    if stash:
        model.layers["0"].register_forward_hook(lambda mod, inp, out: kept.append(out))
    k_fail, seen = trace.meta["optimizer_ops"][0], {}
    fail_op(eng, k_fail, lambda k: seen.update({name: (nbytes, last) for name, nbytes, last in eng.lingering(k)}))
    with pytest.raises(torch.OutOfMemoryError) as info:
        eng.run_step(step_fn(model, opt, 2), 2)
    assert eng.lingering(k_fail) == []  # outside the audited step
    eng.close()
    (note,) = info.value.__notes__
    return seen, note, kept


def test_the_first_step_names_intermediates_alive_past_their_last_use(tmp_path):
    # A reference the profiled step did not have (a forward hook keeping layer 0's output,
    # one per micro-batch) holds those outputs past their last use: an out-of-memory error
    # in the engine's first step names them with their bytes, beside what autograd holds
    # anyway (the same run without the hook).
    base, base_note, _ = lingering_at_failure(tmp_path / "a", stash=False)
    held, note, kept = lingering_at_failure(tmp_path / "b", stash=True)
    extra = {name: v for name, v in held.items() if name not in base}
    out_bytes = kept[0].untyped_storage().nbytes()
    assert len(kept) == 2 and sorted(b for b, _ in extra.values()) == [out_bytes, out_bytes]
    assert set(base) <= set(held)
    for seen, text in ((base, base_note), (held, note)):
        assert (f"; {len(seen)} intermediates alive past their profiled last use hold "
                f"{sum(b for b, _ in seen.values())} B") in text
    largest = max(held.items(), key=lambda kv: (kv[1][0], kv[0]))
    assert f"{largest[0]} ({largest[1][0]} B, last use op {largest[1][1]})" in note


class _FinishedEvent:
    """A CUDA event's interface for a copy that already ran (CPU copies are synchronous)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _StreamOrderedHostTier(HostTier):
    """The host tier as on a CUDA device, where its transfers carry a CUDA event and can be
    stream-ordered; on the CPU each copy has run by the time it returns."""

    def _start(self, kind, name, storage, nbytes):
        done = super()._start(kind, name, storage, nbytes)
        return Transfer(done.name, done.path, f"host {kind} of {name!r}", done.nbytes, event=_FinishedEvent())


@pytest.mark.parametrize("device_waits", [False, True])
def test_device_waits_skip_host_waits_and_stay_bit_exact(tmp_path, device_waits):
    model, opt, losses, trace = profiled()
    # free_delay: some host-tier writes that prime() starts are still pending at op 0 and
    # freed inside the first step (a path that once crashed on the GPU).
    plan = every_gap_plan(trace, alternate_tiers, free_delay=5)
    n = plan.n_ops
    assert any(m.tier == "host" and m.wraps and cyclic_between(0, (m.offload_after + 1) % n, m.prefetch_before, n)
               and not m.offloaded_at_iteration_start(n) for m in plan.migrations)
    tiers = open_tiers(plan, tmp_path, host_tier=_StreamOrderedHostTier)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), tiers, CPU, device_waits=device_waits)
    waited = []
    wait = eng._wait

    def recording_wait(t, k):
        waited.append((eng._in_step, t.tier))
        wait(t, k)

    eng._wait = recording_wait
    n_steps = 6
    train_bit_exact(eng, model, opt, losses, n_steps)
    in_step = {tier for in_step, tier in waited if in_step}
    # Without device_waits the thread waits on both tiers; with it, on the SSD tier only.
    assert in_step == ({"ssd"} if device_waits else {"ssd", "host"})
    # Every transfer is waited on at an op, except the last step's offloads that span the
    # iteration boundary: close() ends those.
    unwaited = {(r["step"], r["direction"]) for r in eng.transfers if r["step"] >= 2 and r["op_done"] is None}
    assert unwaited <= {(n_steps - 1, "offload")}


def grad_bytes_at_step_end(model, opt) -> list[int]:
    """A list that gets, each time ``opt.step`` returns, the bytes ``param.grad`` still holds."""
    held = []
    opt.register_step_post_hook(lambda o, a, kw: held.append(
        sum(p.grad.untyped_storage().nbytes() for p in model.parameters())))
    return held


@pytest.mark.parametrize("migrate", [False, True], ids=["no-migrations", "every-gap"])
def test_release_grads_frees_each_gradient_within_the_step_and_stays_bit_exact(tmp_path, migrate):
    model, opt, losses, trace = profiled()
    start, end = trace.meta["optimizer_ops"]
    grads = [t for t in trace.tensors if t.kind == "grad"]
    assert len(grads) == len(list(model.parameters()))
    assert all(start <= t.uses[-1] < end for t in grads)
    plan = every_gap_plan(trace) if migrate else MigrationPlan(trace.n_ops, 0, trace.peak_bytes(), 0, [])
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU,
                          release_grads=True)
    held = grad_bytes_at_step_end(model, opt)
    train_bit_exact(eng, model, opt, losses, n_steps=5)
    assert held == [0, 0, 0]


def test_without_release_grads_the_step_holds_every_gradient(tmp_path):
    model, opt, losses, trace = profiled()
    plan = MigrationPlan(trace.n_ops, 0, trace.peak_bytes(), 0, [])
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), {}, CPU)
    held = grad_bytes_at_step_end(model, opt)
    train_bit_exact(eng, model, opt, losses, n_steps=3)
    assert held == [sum(t.nbytes for t in trace.tensors if t.kind == "grad")]


def test_the_first_step_names_the_first_op_after_which_the_allocator_overran_the_plan(tmp_path):
    # The allocator's bytes after each op against what the plan accounts there (CUDA only;
    # here a stand-in allocator count): 1 % of the capacity below the account is not an
    # overrun; the first op past it, and the op furthest past it, are named.
    model, opt, _, trace = profiled()
    plan = dataclasses.replace(every_gap_plan(trace), capacity_bytes=trace.peak_bytes())
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    eng.prime()
    k_over, k_most, k_fail = 10, 20, 30
    slack = plan.capacity_bytes // 100
    extra = {k_over: slack + 1, k_most: 5 * slack}
    ops = []

    def stand_in():  # called once per op, after it, with the engine's account of that op
        k = len(ops)
        ops.append(k)
        return int(eng.required_bytes[k]) - eng._away_bytes + extra.get(k, slack)

    eng._allocator_bytes = stand_in
    fail_op(eng, k_fail)
    with pytest.raises(torch.OutOfMemoryError) as info:
        eng.run_step(step_fn(model, opt, 2), 2)
    eng.close()
    (note,) = info.value.__notes__
    assert note.endswith(f"; the allocator held more than the plan accounts first after op {k_over} "
                         f"({slack + 1} B over), most after op {k_most} ({5 * slack} B over)")
    assert ops == list(range(k_fail))


class FailingOp(TorchDispatchMode):
    """Below the engine's mode: the ``nth`` call (from 0) of aten op ``name`` raises an
    out-of-memory error its first ``times`` attempts, as an op that does not fit would."""

    def __init__(self, name: str, nth: int, times: int):
        super().__init__()
        self.name, self.nth, self.times = name, nth, times
        self.calls = self.failed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) == self.name:
            if self.calls == self.nth and self.failed < self.times:
                self.failed += 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            self.calls += 1
        return func(*args, **(kwargs or {}))


COMPUTE_OPS = ("aten.mul.Tensor", "aten.mul_.Tensor", "aten.add_.Tensor")  # none of them a tier's


def prefetched_ahead_at(trace, plan, k):
    """Migrations whose read runs over op ``k`` for a later use, on a tensor op ``k`` does not touch."""
    return [m for m in plan.migrations if cyclic_between(k, m.prefetch_before, m.needed_by, trace.n_ops)
            and k not in trace.tensors[m.tid].uses]


@pytest.mark.parametrize("mixed,shared", [(False, False), (True, False), (True, True)],
                         ids=["ssd", "mixed", "mixed-shared-slots"])
def test_an_op_out_of_memory_drops_tensors_prefetched_ahead_and_runs_again(tmp_path, mixed, shared):
    # An op that does not fit (memory the plan never saw) frees the tensors read ahead for
    # later ops, one per attempt, and runs again: training stays bit-exact, each dropped
    # tensor is read again at its use (from a slot no other tensor has written since, where
    # slots are shared), and the step counts the retries and bytes.
    model, opt, losses, trace = profiled()
    plan = every_gap_plan(trace, alternate_tiers if mixed else (lambda i: "ssd"))
    plan = share_slots(plan) if shared else plan
    k_fail = next(k for k, name in enumerate(trace.op_names)
                  if name in COMPUTE_OPS and len(prefetched_ahead_at(trace, plan, k)) >= 2)
    ahead, name = prefetched_ahead_at(trace, plan, k_fail), trace.op_names[k_fail]
    nth = trace.op_names[:k_fail].count(name)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    ref_losses, ref_params = reference(5)
    eng.prime()
    for s in range(2, 5):
        with FailingOp(name, nth, len(ahead) if s == 3 else 0):
            losses.append(eng.run_step(step_fn(model, opt, s), s))
    eng.close()
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_params))
    quiet, failed = eng.history[0], eng.history[1]
    assert (quiet.oom_retries, quiet.dropped_bytes) == (0, 0)
    assert (failed.oom_retries, failed.dropped_bytes) == (len(ahead), sum(m.nbytes for m in ahead))
    assert sum(failed.bytes_prefetched.values()) == sum(quiet.bytes_prefetched.values()) + failed.dropped_bytes


# Gaps of 200 ops or more offloaded only: tensors stay resident beside each op to spill.
SPARSE_GAP = 200


def spill_order_ok(eng, spilled):
    """Each ``(k, tid, resident)`` of ``spilled`` (what :meth:`MigrationEngine._spill` freed, and
    the resident tensors it chose among) took the tensor whose next use is furthest after
    op ``k``."""
    def gap(tid, k):
        return min(((u - k) % eng.n_ops for u in eng.trace.tensors[tid].uses if u != k), default=eng.n_ops)
    return all(gap(tid, k) == max(gap(r, k) for r in resident) for k, tid, resident in spilled)


def record_spills(eng) -> list:
    """Wrap ``eng._spill``: each spill appends ``(op, the tensor spilled, the resident tensors
    there that op ``k`` does not read)``."""
    spill, spilled = eng._spill, []

    def recording(k, keep):
        resident = [tid for tid, t in eng.tensors.items() if t.status == "resident" and t.job is None
                    and t.storage is not None and t.storage.nbytes() and t.storage._cdata not in keep]
        before = {tid for tid, t in eng.tensors.items() if t.spill is not None}
        done = spill(k, keep)
        if done:
            (tid,) = {tid for tid, t in eng.tensors.items() if t.spill is not None} - before
            spilled.append((k, tid, resident))
        return done

    eng._spill = recording
    return spilled


@pytest.mark.parametrize("mixed", [False, True], ids=["ssd", "mixed"])
def test_an_op_out_of_memory_with_nothing_prefetched_ahead_spills_the_tensor_used_furthest_ahead(tmp_path, mixed):
    # An op that still does not fit once every tensor prefetched ahead is freed again copies
    # resident tensors to host memory, the one used furthest ahead first, one per attempt,
    # and runs again; each comes back at its planned prefetch or its use. Training stays
    # bit-exact and the step counts the retries and the spilled bytes.
    model, opt, losses, trace = profiled()
    plan = every_gap_plan(trace, alternate_tiers if mixed else (lambda i: "ssd"), min_gap=SPARSE_GAP)
    k_fail = next(k for k, name in enumerate(trace.op_names)
                  if name in COMPUTE_OPS and prefetched_ahead_at(trace, plan, k))
    ahead, name = prefetched_ahead_at(trace, plan, k_fail), trace.op_names[k_fail]
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    spilled = record_spills(eng)
    ref_losses, ref_params = reference(5)
    eng.prime()
    for s in range(2, 5):
        with FailingOp(name, trace.op_names[:k_fail].count(name), len(ahead) + 2 if s == 3 else 0):
            losses.append(eng.run_step(step_fn(model, opt, s), s))
    eng.close()
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_params))
    quiet, failed = eng.history[0], eng.history[1]
    assert [(k, len(r) > 1) for k, _, r in spilled] == [(k_fail, True)] * 2 and spill_order_ok(eng, spilled)
    assert (failed.oom_retries, failed.dropped_bytes) == (len(ahead) + 2, sum(m.nbytes for m in ahead))
    assert failed.spilled_bytes == sum(trace.tensors[tid].nbytes for _, tid, _ in spilled) > 0
    assert quiet.spilled_bytes == eng.history[2].spilled_bytes == 0
    assert all(t.spill is None for t in eng.tensors.values())


def test_a_tensor_still_spilled_after_a_step_goes_to_the_pager_on_hand_back(tmp_path):
    # An op in the optimizer's update spills a persistent tensor whose next use is in the next
    # step; handing the engine back between steps gives the pager its bytes from the spill,
    # and the pager restores the state of plain PyTorch's step, bit for bit: the next step,
    # plain PyTorch's, gives its loss and parameters.
    from teraio.core.pager import Pager

    model, opt, losses, trace = profiled()
    plan = every_gap_plan(trace, alternate_tiers, min_gap=SPARSE_GAP)
    first, end = trace.meta["optimizer_ops"]
    k_fail = max(k for k in range(first, end) if trace.op_names[k] in COMPUTE_OPS)
    ahead, name = prefetched_ahead_at(trace, plan, k_fail), trace.op_names[k_fail]
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    spilled = record_spills(eng)
    eng.prime()
    with FailingOp(name, trace.op_names[:k_fail].count(name), len(ahead) + 1):
        losses.append(eng.run_step(step_fn(model, opt, 2), 2))
    ((_, tid, _),) = spilled
    assert eng.tensors[tid].spill is not None and trace.tensors[tid].persistent
    pager = Pager(trace.peak_bytes(), CPU)
    eng.hand_back(pager)
    assert eng.tensors[tid].spill is None and pager.evicted_bytes >= trace.tensors[tid].nbytes
    pager.restore_all()
    losses.append(step_fn(model, opt, 3)())  # plain PyTorch from the restored state
    ref_losses, ref_params = reference(4)
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_params))


def test_an_op_out_of_memory_with_nothing_left_to_free_fails_with_its_note(tmp_path):
    # Once nothing prefetched ahead is left to drop and nothing resident is left to spill,
    # the op's error is the step's; close() brings every spilled tensor back, bit for bit.
    model, opt, _, trace = profiled()
    plan = every_gap_plan(trace, min_gap=SPARSE_GAP)
    k_fail = next(k for k, name in enumerate(trace.op_names)
                  if name in COMPUTE_OPS and prefetched_ahead_at(trace, plan, k))
    assert k_fail < trace.meta["optimizer_ops"][0]  # the failed step changes no parameter
    ahead, name = prefetched_ahead_at(trace, plan, k_fail), trace.op_names[k_fail]
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    spilled = record_spills(eng)
    eng.prime()
    with pytest.raises(torch.OutOfMemoryError) as info:
        with FailingOp(name, trace.op_names[:k_fail].count(name), 10 ** 6):
            eng.run_step(step_fn(model, opt, 2), 2)
    assert eng.stats.oom_retries == len(ahead) + len(spilled) and len(spilled) > 1
    left = [tid for tid, t in eng.tensors.items() if t.status == "resident" and t.storage is not None
            and t.storage.nbytes()]
    assert all(k_fail in trace.tensors[tid].uses for tid in left)  # op k_fail's own inputs
    eng.close()
    _, ref_params = reference(2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_params))
    (note,) = info.value.__notes__
    assert note.startswith(f"TeraIO: out of memory at op {k_fail} ({name}) of step 2;")


class FailingResize:
    """Stand-in for the engine's re-allocation of an offloaded storage: its ``nth`` call (from
    0) raises an out-of-memory error its first ``times`` attempts, as on a GPU whose free
    memory is fragmented; ``armed`` turns it on."""

    def __init__(self, nth: int, times: int):
        self.nth, self.times = nth, times
        self.armed, self.calls, self.failed = False, 0, 0

    def __call__(self, storage, nbytes):
        if self.armed:
            if self.calls == self.nth and self.failed < self.times:
                self.failed += 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            self.calls += 1
        storage.resize_(nbytes)


class FailingResizeAt(FailingResize):
    """:class:`FailingResize` by op: the ``n``-th re-allocation (from 0) the engine makes
    before op ``k`` raises its first ``failures[k, n]`` attempts (``engine``: set by
    :func:`run_with_failing_allocations`)."""

    def __init__(self, failures: dict[tuple[int, int], int]):
        super().__init__(-1, 0)
        self.failures, self.engine, self.made = dict(failures), None, Counter()

    def __call__(self, storage, nbytes):
        if self.armed:
            at = (self.engine._k, self.made[self.engine._k])
            if self.failures.get(at, 0) > 0:
                self.failures[at] -= 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            self.made[self.engine._k] += 1
        storage.resize_(nbytes)


def run_with_failing_allocations(tmp_path, resize, fail_op=None, min_gap=4, plan=None, watch=None):
    """Steps 2-4 of ``plan`` (default: an every-gap mixed plan, gaps of ``min_gap`` ops or
    more), step 3 with ``resize`` armed (and ``fail_op``, a :class:`FailingOp`, around it),
    under a stand-in for the allocator's cache release; ``watch(engine)`` before the first
    step: (losses, parameters, step 2's stats, step 3's stats, release calls)."""
    model, opt, losses, trace = profiled()
    plan = plan or every_gap_plan(trace, alternate_tiers, min_gap=min_gap)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    if watch is not None:
        watch(eng)
    released = []
    eng._empty_cache, eng._resize = (lambda: released.append(eng._k)), resize
    resize.engine = eng
    eng.prime()
    for s in range(2, 5):
        resize.armed = s == 3
        with fail_op if s == 3 and fail_op is not None else contextlib.nullcontext():
            losses.append(eng.run_step(step_fn(model, opt, s), s))
    resize.armed = False
    eng.close()
    return losses, list(model.parameters()), eng.history[0], eng.history[1], released


@pytest.mark.parametrize("times", [1, 2], ids=["fits-after-release", "deferred"])
def test_a_prefetch_that_does_not_fit_releases_the_cache_then_waits_for_its_use(tmp_path, times):
    # A planned prefetch whose allocation runs out of memory (fragmentation the plan never
    # saw) releases the allocator's unused memory and tries once more; where that fails too,
    # the tensor stays off the device and is read at its use. Training stays bit-exact and
    # the step moves the same bytes.
    ref_losses, ref_params = reference(5)
    losses, params, quiet, failed, released = run_with_failing_allocations(tmp_path, FailingResize(0, times))
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    assert len(released) == 1
    assert (quiet.oom_retries, quiet.deferred_prefetches) == (0, 0)
    assert (failed.oom_retries, failed.deferred_prefetches, failed.dropped_bytes) == (1, times - 1, 0)
    assert failed.bytes_prefetched == quiet.bytes_prefetched


def test_an_allocation_at_its_use_that_does_not_fit_frees_tensors_prefetched_ahead(tmp_path):
    # A planned prefetch is deferred (its allocation fails before and after the release);
    # at the tensor's use its allocation fails again after a second release: a tensor
    # prefetched ahead is freed again, as for an op, and the allocation fits. Training stays
    # bit-exact.
    _, _, _, trace = profiled()
    plan = every_gap_plan(trace, alternate_tiers)
    starts = Counter(m.prefetch_before for m in plan.migrations)
    m = next(m for m in plan.migrations if starts[m.prefetch_before] == 1
             and [a for a in prefetched_ahead_at(trace, plan, m.needed_by) if a is not m])
    ref_losses, ref_params = reference(5)
    losses, params, quiet, failed, released = run_with_failing_allocations(
        tmp_path, FailingResizeAt({(m.prefetch_before, 0): 2, (m.needed_by, starts[m.needed_by]): 2}))
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    assert released == [m.prefetch_before, m.needed_by, m.needed_by]  # released again after the drop
    assert failed.deferred_prefetches == 1
    assert failed.dropped_bytes > 0 and quiet.dropped_bytes == 0
    assert failed.oom_retries == 3  # after the two releases and the drop


def test_an_allocation_at_its_use_with_nothing_prefetched_ahead_spills(tmp_path):
    # As above, where no tensor is prefetched ahead at the use: a resident tensor is spilled
    # to host memory instead, and the allocation fits. Training stays bit-exact.
    _, _, _, trace = profiled()
    plan = every_gap_plan(trace, alternate_tiers, min_gap=SPARSE_GAP)
    starts = Counter(m.prefetch_before for m in plan.migrations)
    m = next(m for m in plan.migrations if starts[m.prefetch_before] == 1
             and not [a for a in prefetched_ahead_at(trace, plan, m.needed_by) if a is not m])
    ref_losses, ref_params = reference(5)
    losses, params, quiet, failed, released = run_with_failing_allocations(
        tmp_path, FailingResizeAt({(m.prefetch_before, 0): 2, (m.needed_by, starts[m.needed_by]): 2}),
        min_gap=SPARSE_GAP)
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    assert released == [m.prefetch_before, m.needed_by, m.needed_by]  # released again after the spill
    assert (failed.deferred_prefetches, failed.dropped_bytes) == (1, 0)
    assert failed.spilled_bytes > 0 and quiet.spilled_bytes == 0
    assert failed.oom_retries == 3  # after the two releases and the spill


def test_a_spill_takes_a_tensor_the_plan_leaves_on_the_device(tmp_path):
    # A plan that moves one tensor only: where its allocation at its use does not fit, no
    # other tensor of the plan is resident, and the spill takes a parameter or optimizer
    # state the plan never moves; it comes back at its use. Training stays bit-exact.
    _, _, _, trace = profiled()
    m = next(m for m in every_gap_plan(trace, min_gap=SPARSE_GAP).migrations if not m.wraps)
    ref_losses, ref_params = reference(5)
    watched = []
    losses, params, _, failed, _ = run_with_failing_allocations(
        tmp_path, FailingResizeAt({(m.prefetch_before, 0): 2, (m.needed_by, 0): 2}),
        plan=MigrationPlan(trace.n_ops, 0, trace.peak_bytes(), 0, [m]),
        watch=lambda eng: watched.append((eng, record_spills(eng))))
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    ((eng, ((k, tid, _),)),) = watched
    assert k == m.needed_by and tid != m.tid and trace.tensors[tid].persistent
    assert failed.spilled_bytes == trace.tensors[tid].nbytes
    assert all(t.spill is None for t in eng.tensors.values())


def test_an_allocation_at_its_use_that_does_not_fit_fails_with_its_note(tmp_path):
    # Only a planned prefetch can wait for its use: the same tensor's allocation at its use
    # that does not fit once nothing is left to drop or spill is the step's error.
    with pytest.raises(torch.OutOfMemoryError) as info:
        run_with_failing_allocations(tmp_path, FailingResize(0, 10 ** 6))
    (note,) = info.value.__notes__
    assert note.startswith("TeraIO: out of memory at op ")


def test_an_op_out_of_memory_first_releases_the_cache(tmp_path):
    # With a cache to release (CUDA), an op that runs out of memory runs again after the
    # release before any prefetched tensor is dropped.
    model, opt, _, trace = profiled()
    plan = every_gap_plan(trace, alternate_tiers)
    k_fail = next(k for k, name in enumerate(trace.op_names)
                  if name in COMPUTE_OPS and prefetched_ahead_at(trace, plan, k))
    name = trace.op_names[k_fail]
    fail_op = FailingOp(name, trace.op_names[:k_fail].count(name), 1)
    ref_losses, ref_params = reference(5)
    losses, params, _, failed, released = run_with_failing_allocations(tmp_path, FailingResize(0, 0), fail_op)
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    assert released == [k_fail]
    assert (failed.oom_retries, failed.dropped_bytes, failed.deferred_prefetches) == (1, 0, 0)


def test_a_first_step_that_ends_well_keeps_its_audit(tmp_path):
    # The overruns of the audited step and what lingered at the largest travel with its
    # statistics (the row's ``audits``); later steps are not audited.
    model, opt, losses, trace = profiled()
    plan = dataclasses.replace(every_gap_plan(trace), capacity_bytes=trace.peak_bytes())
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    eng.prime()
    slack = plan.capacity_bytes // 100
    k_over, k_most = 10, trace.n_ops // 2
    extra, ops, at_most = {k_over: slack + 1, k_most: 5 * slack}, [], {}

    def stand_in():
        k = len(ops) % trace.n_ops
        ops.append(k)
        if k == k_most:
            at_most["lingering"] = [list(x) for x in eng.lingering(k + 1)[:5]]
        return int(eng.required_bytes[k]) - eng._away_bytes + extra.get(k, 0)

    eng._allocator_bytes = stand_in
    for s in (2, 3):
        losses.append(eng.run_step(step_fn(model, opt, s), s))
    eng.close()
    assert len(ops) == trace.n_ops  # the second step asks the allocator nothing
    first, second = eng.history
    assert at_most["lingering"]  # autograd holds some outputs past their last use
    assert first.audit == {"first": [k_over, slack + 1], "largest": [k_most, 5 * slack], **at_most}
    assert second.audit is None


def test_free_blocks_note_sums_the_free_blocks_of_a_snapshot():
    # torch.cuda.memory_snapshot()'s layout: one dict per segment, its blocks with a state
    mib = 1 << 20
    snapshot = [
        {"segment_type": "large", "blocks": [{"size": 20 * mib, "state": "active_allocated"},
                                             {"size": 6 * mib, "state": "inactive"},
                                             {"size": 14 * mib, "state": "active_allocated"}]},
        {"segment_type": "large", "blocks": [{"size": 18 * mib, "state": "inactive"},
                                             {"size": 2 * mib, "state": "active_pending_free"}]},
        {"segment_type": "small", "blocks": [{"size": 512, "state": "inactive"},
                                             {"size": 2 * mib - 512, "state": "active_allocated"}]},
    ]
    assert free_blocks_note(snapshot) == (f"free blocks: {24 * mib + 512} B in 3, the largest {18 * mib} B, "
                                          "over 2 large-pool segments, 1 small-pool segments")
    assert free_blocks_note([]) == "free blocks: none (no segment)"


def test_a_long_run_under_the_engine_stays_flat(tmp_path):
    """1,000 steps of a one-block tiny Llama3 (this file's model, cut to one block so that the
    steps take seconds) under a plan that moves tensors through both tiers every step, the
    records taken after each as the TeraIO runner does (``EngineLogs``): the resident set
    (``/proc``) grows by less than 1 MB from step 200 to step 1,000."""
    import gc

    from teraio.trainer.logs import EngineLogs

    def rss() -> int:
        gc.collect()
        status = open("/proc/self/status").read()
        return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) * 1024

    torch.manual_seed(0)
    one_block, work = dataclasses.replace(MODEL, n_layers=1), dataclasses.replace(WORK, micro_batch_size=2)
    model = build_model(one_block, work.seq_len)
    opt = make_optimizer(model, 1e-3)
    x, y = make_batch(0, work, one_block.vocab_size, 0, CPU)

    def tiny_step():  # one micro-batch a step: half the ops of the file's two
        return train_step(model, opt, x, y, work.micro_batch_size)

    tiny_step()
    _, trace = profile_step(tiny_step, model, opt, CPU)
    plan = every_gap_plan(trace, alternate_tiers, min_gap=2)
    assert {m.tier for m in plan.migrations} == {"ssd", "host"}
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    logs = EngineLogs(tmp_path, first_step=2)
    eng.prime()
    sampled = {}
    for step in range(2, 1002):
        eng.run_step(tiny_step, step)
        logs.write([(eng, trace)])
        if step in (202, 1001):
            sampled[step] = rss()
    eng.close()
    logs.write([(eng, trace)])
    logs.close()
    assert len(eng.history) <= 64 and eng.history[0].step == 2 and eng.history[-1].step == 1001
    assert sampled[1001] - sampled[202] < 1 << 20, f"grew {sampled[1001] - sampled[202]} B over 800 steps"
    ops = pd.read_csv(tmp_path / "oplog.csv")  # every step's records, written as it went
    assert len(ops) == 1000 * trace.n_ops and ops["step"].nunique() == 1000
    moved = pd.read_csv(tmp_path / "transfers.csv")
    assert moved["t_done_s"].notna().all() and set(moved["step"]) == set(range(2, 1002))
    assert "copy_s" in moved and moved["copy_s"].isna().all()  # CPU copies: no stream to time them on
    assert moved["gpu_start_s"].isna().all() and ops["gpu_start_s"].isna().all()  # nor a GPU timeline
    assert ops["gpu_end_s"].isna().all() and eng.gpu_idle_seconds(1001) is None


def every_recompute_plan(trace, min_gap=3):
    """Drop and re-run every intermediate over every inactive gap of at least ``min_gap`` ops
    that a chain can make again (``teraio.core.recompute.Chains``): the engine's harshest
    test of re-runs, chains whose inputs are themselves dropped included."""
    from teraio.core.plan import Recompute
    from teraio.core.recompute import Chains

    chains, recs = Chains(trace), []
    for t in trace.tensors:
        if t.persistent or t.kind == "input":
            continue
        for a, b in zip(t.uses, t.uses[1:]):
            ch = chains.chain(t.tid, b) if b - a >= min_gap else None
            if ch is not None:
                recs.append(Recompute(t.tid, t.name, t.nbytes, a, b, b, ch.ops, ch.inputs, ch.seconds,
                                      ch.extra_bytes))
    return MigrationPlan(trace.n_ops, 0, trace.peak_bytes(), 0, [], recomputes=recs)


def test_every_recompute_is_bit_exact(tmp_path):
    model, opt, losses, trace = profiled()
    plan = every_recompute_plan(trace)
    assert len(plan.recomputes) > 10 and any(len(r.ops) > 1 for r in plan.recomputes)
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), {}, CPU)
    train_bit_exact(eng, model, opt, losses, n_steps=4)
    # each dropped tensor was made again once per step (a chain input that another recompute
    # dropped is made again first, ahead of its own plan, and counted as urgent)
    for h in eng.history:
        assert h.recomputed_bytes == plan.recomputed_bytes()
    assert max(h.max_accounted_bytes for h in eng.history) < trace.peak_bytes()
    # both ways of putting the bytes back ran: an out= overload into the tensor, and a copy
    assert any(eng.reruns.in_place) and False in eng.reruns.in_place


def test_recomputes_beside_migrations_of_a_planned_schedule_are_bit_exact(tmp_path):
    from teraio.core.planner import TierBandwidth, plan_migrations

    model, opt, losses, trace = profiled()
    # a drive far too slow to hide moves: the planner recomputes what a chain makes cheaply
    cap = int(trace.peak_bytes() * 0.6)
    plan = plan_migrations(trace, cap, TierBandwidth.uniform(1e-4), host_cap_bytes=1 << 26,
                           min_tensor_bytes=256, allow_stalls=True, recompute=True)
    assert plan.recomputes and plan.migrations
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), open_tiers(plan, tmp_path), CPU)
    train_bit_exact(eng, model, opt, losses, n_steps=4)
    for h in eng.history:
        assert h.recomputed_bytes == plan.recomputed_bytes()
        assert h.max_accounted_bytes <= cap


def test_a_dropped_tensor_used_before_its_planned_remake_is_made_again_at_once(tmp_path):
    model, opt, losses, trace = profiled()
    plan = every_recompute_plan(trace)
    r = max(plan.recomputes, key=lambda r: r.recompute_before - r.drop_after)
    late = dataclasses.replace(r, recompute_before=r.needed_by)  # remake at the use itself
    plan.recomputes = [late]
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), {}, CPU)
    eng.remake_before[late.recompute_before].clear()  # as if the planned remake were lost
    train_bit_exact(eng, model, opt, losses, n_steps=4)
    assert all(h.urgent_count == 1 and h.recomputed_bytes == late.nbytes for h in eng.history)


class LateRead:
    """A read that starts 0.2 s late (a slow drive): a transfer handle for the engine."""

    stream_ordered = False

    def __init__(self, start):
        import concurrent.futures
        import time

        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._job = self._pool.submit(lambda: (time.sleep(0.2), start())[1])

    def wait(self):
        self._job.result().wait()

    def done(self):
        return self._job.done() and self._job.result().done()

    def copy_seconds(self):
        return self._job.result().copy_seconds()

    def copy_start_after(self, origin):
        return self._job.result().copy_start_after(origin)


def test_a_chain_input_still_being_read_back_is_waited_for_before_the_re_run(tmp_path):
    model, opt, losses, trace = profiled()
    # A recompute whose chain reads an intermediate I that is inactive around the remake; I
    # is offloaded over that gap and its read launched at the remake's op: still in flight
    # when the chain runs again, which must wait for it.
    for r in every_recompute_plan(trace).recomputes:
        found = None
        for i in r.inputs:
            rec = trace.tensors[i]
            before = [u for u in rec.uses if u < r.recompute_before]
            after = [u for u in rec.uses if u > r.recompute_before]
            if (not rec.persistent and rec.kind != "input" and before and after
                    and before[-1] + 1 < r.recompute_before):
                found = Migration(i, rec.name, rec.nbytes, "ssd", before[-1], before[-1] + 1,
                                  r.recompute_before, after[0])
                break
        if found:
            break
    plan = MigrationPlan(trace.n_ops, 0, trace.peak_bytes(), 0, [found], recomputes=[r])
    tiers = open_tiers(plan, tmp_path)
    read = tiers["ssd"].read
    tiers["ssd"].read = lambda name, storage: LateRead(lambda: read(name, storage))
    eng = MigrationEngine(trace, plan, persistent_tensors(model, opt), tiers, CPU)
    train_bit_exact(eng, model, opt, losses, n_steps=4)
    assert all(h.recomputed_bytes == r.nbytes and h.stall_count >= 1 for h in eng.history)
