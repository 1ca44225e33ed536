"""The pager (teraio/core/pager.py): on-demand LRU paging within a capacity, for the steps
before a migration plan exists."""
from __future__ import annotations

import gc

import pytest
import torch

from teraio.config import run_config_from_dict
from teraio.core.pager import CapacityError, Pager, PagedStep, fresh_output_bytes
from teraio.result import measured_before, result_row
from teraio.trainer.runner import run

CPU = torch.device("cpu")
KB = 1024


def test_fresh_output_bytes_from_the_schema_and_the_meta_device():
    a, b = torch.ones(8, 16), torch.ones(16, 4)
    aten = torch.ops.aten
    assert fresh_output_bytes(aten.mm.default, (a, b), {}) == 8 * 4 * 4
    assert fresh_output_bytes(aten.add_.Tensor, (a, a), {}) == 0  # in place
    assert fresh_output_bytes(aten.view.default, (a, [16, 8]), {}) == 0  # a view
    assert fresh_output_bytes(aten._local_scalar_dense.default, (a[0, 0],), {}) == 0  # no tensor
    # A factory op is sized on the meta device, whatever device it names.
    assert fresh_output_bytes(aten.empty.memory_format, ([3, 5],), {"dtype": torch.float64,
                                                                    "device": CPU}) == 3 * 5 * 8
    assert fresh_output_bytes(aten.split.Tensor, (a, 4), {}) == 0  # views of a
    assert fresh_output_bytes(aten.nonzero.default, (a,), {}) is None  # data-dependent shape


def chain(xs: list[torch.Tensor]) -> torch.Tensor:
    """Uses every input twice, far apart, so that an LRU pager under a small limit must
    evict and restore them."""
    acc = torch.zeros_like(xs[0])
    for x in xs + xs[::-1]:
        acc = acc + x * 2
    return acc


def test_paged_ops_are_bit_exact_and_stay_within_the_limit():
    torch.manual_seed(0)
    xs = [torch.randn(1024) for _ in range(12)]  # 4 KiB each, 48 KiB in all
    expected = chain(xs)
    pager = Pager(24 * KB, CPU, xs)
    with PagedStep(pager):
        got = chain(xs)
    assert torch.equal(got, expected)
    assert pager.stats.evictions > 0 and pager.stats.restores > 0
    assert pager.stats.max_accounted_bytes <= 24 * KB
    # Every evicted storage is 4 KiB and every buffer is kept for reuse (none released under
    # the default host limit), so the host memory held only grew: its peak is what is held now.
    assert pager.stats.max_host_bytes == pager.buffers.held_bytes
    assert pager.stats.max_host_bytes >= pager.evicted_bytes > 0 and pager.stats.max_host_bytes % (4 * KB) == 0
    held = [x for x in xs if pager.holds(x.untyped_storage())]
    assert held and all(x.untyped_storage().nbytes() == 0 for x in held)
    assert all(pager.nbytes(x.untyped_storage()) == 4 * KB for x in xs)
    pager.close()
    assert all(x.untyped_storage().nbytes() == 4 * KB for x in xs)
    assert torch.equal(torch.stack(xs).sum(0), torch.stack([x.clone() for x in xs]).sum(0))


def test_dead_storages_stop_counting():
    pager = Pager(1 << 20, CPU)
    with PagedStep(pager):
        t = torch.ones(1024) * 3  # 4 KiB, made inside the paged region (and the ones, dead now)
    pager.make_room(0)  # any call drains what died
    assert pager.resident_bytes == 4 * KB
    del t
    gc.collect()
    pager.make_room(0)
    assert pager.resident_bytes == 0


def test_an_op_larger_than_the_capacity_is_refused_naming_the_bytes():
    x = torch.ones(4096)  # 16 KiB
    pager = Pager(8 * KB, CPU, [])
    with pytest.raises(CapacityError, match=r"needs 3\d{4} B resident .* allows 8192 B"), PagedStep(pager):
        x * 2  # input 16 KiB, output 16 KiB


def test_small_storages_count_but_are_never_evicted():
    small = [torch.ones(16) for _ in range(4)]  # 64 B each, older than the rest
    old, new = torch.ones(1024), torch.ones(1024)  # 4 KiB each
    pager = Pager(8 * KB + 256, CPU, small + [old, new], min_evict_bytes=1 * KB)
    with PagedStep(pager):
        y = new + 1  # 4 KiB more: the small ones are least recently used, yet `old` goes
    assert pager.holds(old.untyped_storage())
    assert not any(pager.holds(s.untyped_storage()) for s in small)
    assert pager.stats.max_accounted_bytes == 8 * KB + 256
    del y


TINY = {"name": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256}


def test_a_model_whose_parameters_exceed_the_capacity_is_refused_before_it_is_built(tmp_path):
    cfg = run_config_from_dict({
        "model": TINY, "workload": {"batch_size": 2, "micro_batch_size": 1, "seq_len": 32},
        "hardware": {"device": "cpu", "ssd_dirs": [str(tmp_path)], "gpu_capacity_bytes": 10_000},
        "system": {"name": "teraio_ssd"}})
    with pytest.raises(ValueError, match=r"model tiny: its parameters and buffers take \d+ B, above the "
                                         r"10000 B TeraIO may use") as err:
        run(cfg, tmp_path, CPU)
    result = result_row(cfg.point(), cfg.to_dict(), measured_before(err.value))
    assert result["iterations"] == [] and not list(tmp_path.iterdir())


def test_host_buffers_are_reused_by_size_and_adopted_by_the_host_tier():
    from teraio.core.pager import HostBuffers
    from teraio.core.tiers.host import HostTier

    pool = HostBuffers(pinned=False, limit_bytes=10 * KB)
    a = pool.take(4 * KB)
    pool.give(a)
    assert pool.take(4 * KB) is a  # the same buffer, not a new one
    with pytest.raises(MemoryError, match=r"4096 B of evicted tensors .* 8192 B more would pass the 10240 B"):
        pool.take(8 * KB)
    pool.give(a)
    b = pool.take(8 * KB)  # the free 4 KiB buffer is released to make room
    assert pool.free_bytes == 0 and pool.in_use_bytes == 8 * KB
    pool.give(b)
    tier = HostTier(16 * KB, {"x": 8 * KB, "y": 2 * KB}, CPU)
    assert tier.adopt(pool) == 8 * KB and tier.allocated_bytes == 8 * KB
    assert tier._slot_buffers["x"] is b and pool.free_bytes == 0
    tier.close()


def test_a_pagers_copy_is_handed_to_the_host_tier_without_a_second_buffer():
    from teraio.core.tiers.host import HostTier

    xs = [torch.arange(1024, dtype=torch.float32) + i for i in range(4)]  # 4 KiB each
    expected = [x.clone() for x in xs]
    pager = Pager(16 * KB, CPU, xs)
    pager.make_room(8 * KB)  # evicts the two least recently used: xs[0], xs[1]
    assert pager.holds(xs[0].untyped_storage()) and pager.buffers.in_use_bytes == 8 * KB
    host = pager.hand_over(xs[0].untyped_storage())
    assert not pager.holds(xs[0].untyped_storage()) and pager.buffers.in_use_bytes == 4 * KB
    assert pager.evicted_bytes == 4 * KB and pager.buffers.free_bytes == 0

    tier = HostTier(16 * KB, {"x0": 4 * KB, "x1": 4 * KB}, CPU)
    tier.take_over("x0", host)
    assert tier._slot_buffers["x0"] is host and tier.allocated_bytes == 4 * KB
    xs[0].untyped_storage().resize_(4 * KB)
    tier.read("x0", xs[0].untyped_storage()).wait()
    assert torch.equal(xs[0], expected[0])
    with pytest.raises(ValueError, match=r"slot 'x0' is already allocated"):
        tier.take_over("x0", host)
    with pytest.raises(ValueError, match=r"slot 'x1' needs a uint8 buffer of at least 4096 B, got "
                                         r"torch.uint8 of 100 elements"):
        tier.take_over("x1", torch.empty(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"'zz' has no slot"):
        tier.take_over("zz", host)

    # Once the pager stops keeping buffers, a restored tensor's buffer is released, not kept.
    pager.buffers.stop_keeping()
    pager.restore(xs[1].untyped_storage())
    assert torch.equal(xs[1], expected[1])
    assert pager.buffers.free_bytes == 0 and pager.buffers.in_use_bytes == 0
    pager.close()
    tier.close()


def test_an_op_out_of_memory_beyond_its_outputs_is_retried_after_evicting_and_fails_only_with_nothing_left():
    """An op may allocate inside more than its outputs (torch's _safe_softmax holds its scores,
    the softmax and a mask beside its result): the pager evicts and retries until the op runs,
    never evicting the op's inputs, and gives up only when nothing else is left to evict."""
    old = [torch.full((1024,), float(i)) for i in range(3)]  # 4 KiB each, evictable
    x = torch.ones(1024)
    pager = Pager(64 * KB, CPU, old + [x])
    fails = {"n": 0}

    def op():  # out of memory until the other storages are gone
        if pager.evicted_bytes < 12 * KB:
            fails["n"] += 1
            raise torch.OutOfMemoryError("out of memory (scripted)")
        return x * 2
    keys = pager.admit(torch.ops.aten.mul.Tensor, (x, 2), {})
    assert torch.equal(pager.run(op, keys), torch.full((1024,), 2.0))
    assert fails["n"] == pager.stats.oom_retries == 1 and pager.evicted_bytes == 12 * KB
    assert x.untyped_storage().nbytes() == 4 * KB  # the input stayed
    pager.restore_all()
    assert all(torch.equal(t, torch.full((1024,), float(i))) for i, t in enumerate(old))

    def never():
        raise torch.OutOfMemoryError("out of memory (scripted)")
    with pytest.raises(torch.OutOfMemoryError, match="scripted"):
        pager.run(never, keys)
    assert pager.evicted_bytes == 12 * KB and x.untyped_storage().nbytes() == 4 * KB
