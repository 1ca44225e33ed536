"""The offload tiers restore storages bit-exactly, clean up after themselves, and fail
loudly."""
import errno
import gc
import os
import re
import shutil
import time
import weakref

import pytest
import torch

from teraio.core.slots import ssd_file_bytes
from teraio.core.tiers.base import Tier, TierIOError
from teraio.core.tiers.host import HostTier
from teraio.core.tiers.ssd import SSDTier, drive_room_bytes

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _direct_io_in(path) -> bool:
    from teraio.core.tiers.ssd import _direct_io_works
    probe = os.path.join(path, "probe")
    open(probe, "w").close()
    try:
        return _direct_io_works(probe)
    finally:
        os.unlink(probe)


@pytest.fixture(params=["ssd", "ssd-buffered", "ssd-striped", "host"])
def make_tier(request, tmp_path):
    """Factory: slots -> a tier of the parametrised kind, closed after the test. "ssd" is
    the default backend (O_DIRECT where the filesystem allows it), "ssd-striped" the same
    with 4 KiB stripes, so every tensor over 4 KiB spans several stripes and files."""
    made = []

    def make(slots, n_dirs=1, shares=None):
        if request.param == "host":
            tier = HostTier(sum(slots.values()) + 64 * len(slots), slots, DEVICE, shares=shares)
        else:
            dirs = [tmp_path / f"drive{i}" for i in range(n_dirs)]
            for d in dirs:
                d.mkdir()
            backend = "buffered" if request.param == "ssd-buffered" else "auto"
            stripe = 4096 if request.param == "ssd-striped" else 8 << 20
            tier = SSDTier([str(d) for d in dirs], slots, backend=backend, threads=4, stripe_bytes=stripe,
                           shares=shares)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of the raw bytes of t's whole storage (integer copy: keeps NaN payloads)."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).clone()


def offload_and_restore(tier, name: str, t: torch.Tensor) -> None:
    """What the engine does: write, free the storage, re-allocate it, poison it, read."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    original = _bytes(t)
    assert tier.write(name, storage).wait() == nbytes
    storage.resize_(0)
    storage.resize_(nbytes)
    # The allocator may hand back the same memory with the old bytes still in it:
    # overwrite every byte with a different value, so a read that did nothing fails.
    torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(~original)
    assert tier.read(name, storage).wait() == nbytes


def _float_bits(n: int, seed: int = 0) -> torch.Tensor:
    """float32 values from random bit patterns (NaNs with payloads, infs, denormals),
    plus -0.0 and a signalling NaN."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    bits[0] = -2**31  # -0.0
    bits[1] = 0x7F800001  # signalling NaN
    bits[2] = -0x7FFFFF  # negative quiet NaN with payload
    return bits.view(torch.float32).to(DEVICE)


@pytest.mark.parametrize("nbytes", [1, 511, 4097])
def test_restore_is_bit_exact_for_odd_sizes(make_tier, nbytes):
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEVICE)
    expected = t.clone()
    tier = make_tier({"t": nbytes})
    offload_and_restore(tier, "t", t)
    assert torch.equal(t, expected)


def test_restore_noncontiguous_view_keeps_nan_payloads_and_negative_zero(make_tier):
    base = _float_bits(64 * 33).view(64, 33)
    view = base.t()[3:30:2, ::3]  # transposed, sliced, strided
    assert not view.is_contiguous()
    expected = view.view(torch.int32).clone()
    tier = make_tier({"view": view.untyped_storage().nbytes()})
    offload_and_restore(tier, "view", view)
    assert torch.equal(view.view(torch.int32), expected)
    assert torch.equal(base.t()[3:30:2, ::3].view(torch.int32), expected)


def test_restore_several_tensors_sharing_one_storage(make_tier):
    base = _float_bits(1000, seed=1)
    shared = {"head": base[:100], "square": base[100:200].view(10, 10).t(),
              "as_int16": base.view(torch.int16)[500:900:3], "whole": base}
    def bits(v):  # integers compare exactly; floats compare NaN != NaN
        return v.view(torch.int32) if v.dtype == torch.float32 else v

    expected = {k: bits(v).clone() for k, v in shared.items()}
    assert len({v.untyped_storage().data_ptr() for v in shared.values()}) == 1
    tier = make_tier({"base": base.untyped_storage().nbytes()})
    offload_and_restore(tier, "base", base)
    for k, v in shared.items():
        assert torch.equal(bits(v), expected[k]), k


def test_restore_does_not_bump_autograd_version_so_backward_runs(make_tier):
    def step(offload_tier=None):
        w = torch.linspace(-1, 1, 256, device=DEVICE).requires_grad_()
        h = torch.tanh(w * 3)  # saved by the next op for backward
        loss = (h * h).sum()
        if offload_tier is not None:
            version = h._version
            offload_and_restore(offload_tier, "h", h)
            assert h._version == version
        loss.backward()  # raises "modified by an inplace operation" if the version moved
        return loss.detach(), w.grad

    tier = make_tier({"h": 256 * 4})
    ref_loss, ref_grad = step()
    loss, grad = step(tier)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


def test_many_transfers_in_flight_land_in_their_own_slots(make_tier):
    sizes = [1, 4095, 4096, 4097, 10_000, 3, 70_000, 511] * 3
    tensors = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEVICE)
               for i, n in enumerate(sizes)}
    expected = {k: v.clone() for k, v in tensors.items()}
    tier = make_tier({k: v.numel() for k, v in tensors.items()}, n_dirs=3)
    writes = [tier.write(k, v.untyped_storage()) for k, v in tensors.items()]
    assert [w.wait() for w in writes] == sizes
    for v in tensors.values():
        v.untyped_storage().resize_(0)
    for k, v in tensors.items():
        v.untyped_storage().resize_(expected[k].numel())
        v.copy_(~expected[k])
    reads = [tier.read(k, tensors[k].untyped_storage()) for k in tensors]
    assert all(r.wait() for r in reads)
    for k in tensors:
        assert torch.equal(tensors[k], expected[k]), k


def test_transfers_of_one_name_run_in_issue_order(make_tier, monkeypatch):
    def slowed(io):  # so a transfer that does not wait for the one before overtakes it
        def slow(*args):
            time.sleep(0.05)
            return io(*args)
        return slow

    monkeypatch.setattr(os, "pwrite", slowed(os.pwrite))
    monkeypatch.setattr(os, "preadv", slowed(os.preadv))
    n = 1 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEVICE)
    dst = torch.zeros(n, dtype=torch.uint8, device=DEVICE)
    tier = make_tier({"x": n})
    for _ in range(2):
        old = src.clone()
        w = tier.write("x", src.untyped_storage())
        r = tier.read("x", dst.untyped_storage())  # read after write: sees the write
        r.wait()
        assert w.done() and torch.equal(dst, old)
        dst.zero_()
        r = tier.read("x", dst.untyped_storage())
        new = old + 1
        w = tier.write("x", new.untyped_storage())  # write after read: does not clobber it
        r.wait()
        w.wait()
        assert torch.equal(dst, old)
        src.copy_(new)


def test_bad_names_and_sizes_are_rejected(make_tier):
    tier = make_tier({"a": 16})
    s = torch.zeros(16, dtype=torch.uint8, device=DEVICE).untyped_storage()
    with pytest.raises(ValueError, match="'b'"):
        tier.write("b", s)
    with pytest.raises(ValueError, match="never written"):
        tier.read("a", s)
    with pytest.raises(ValueError, match="8 bytes.*16"):
        tier.write("a", torch.zeros(8, dtype=torch.uint8, device=DEVICE).untyped_storage())
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        tier.write("a", s)


def test_both_tiers_open_every_transfer_with_the_base_checks(make_tier):
    # teraio.core.tiers.base.Tier makes the checks; each message opens with the tier's label
    tier = make_tier({"a": 16})
    assert isinstance(tier, Tier) and tier.label in ("SSD tier", "host tier")
    s = torch.zeros(16, dtype=torch.uint8, device=DEVICE).untyped_storage()
    with pytest.raises(ValueError, match=rf"^{tier.label}: tensor 'b' has no slot"):
        tier.read("b", s)
    with pytest.raises(ValueError, match=rf"^{tier.label}: tensor 'a' was never written"):
        tier.read("a", s)
    tier.write("a", s).wait()
    tier.close()
    with pytest.raises(RuntimeError, match=rf"^{tier.label} is closed; cannot read 'a'"):
        tier.read("a", s)


def test_a_shared_slot_holds_the_tensor_written_last(make_tier):
    # y uses x's slot (their periods never overlap, teraio.core.slots); z has its own.
    slots = {"x": 12_000, "y": 9_000, "z": 100}
    tier = make_tier(slots, n_dirs=2, shares={"y": "x"})
    data = {n: torch.randint(0, 256, (b,), dtype=torch.uint8, device=DEVICE) for n, b in slots.items()}

    def read(name):
        out = torch.empty(slots[name], dtype=torch.uint8, device=DEVICE)
        tier.read(name, out.untyped_storage()).wait()
        return out

    for name in ("x", "z", "y"):
        tier.write(name, data[name].untyped_storage()).wait()
    assert torch.equal(read("y"), data["y"]) and torch.equal(read("z"), data["z"])
    with pytest.raises(ValueError, match="slot 'x' now holds 'y', written after 'x'"):
        read("x")
    tier.write("x", data["x"].untyped_storage()).wait()
    assert torch.equal(read("x"), data["x"])
    if isinstance(tier, HostTier):  # only the owners' slots take memory
        assert tier.nbytes == 12_032 + 128 and tier.can_take_over("x") is False
    else:
        x = {(st.path, st.offset) for st in tier.placement["x"]}
        assert {(st.path, st.offset) for st in tier.placement["y"]} <= x
        assert sum(st.nbytes for st in tier.placement["y"]) == 9_000
        assert not x & {(st.path, st.offset) for st in tier.placement["z"]}


def test_a_host_region_holds_each_range_until_another_is_written_over_it():
    # One region, a byte offset per name (a plan made with host_arena): z's range covers
    # x's and part of y's, and y's range spans two chunks. Each reads back what was written
    # until another name is written over any of its bytes.
    slots = {"x": 100, "y": 200, "z": 150}
    offsets = {"x": 0, "y": 128, "z": 64}
    tier = HostTier(1 << 20, slots, DEVICE, offsets=offsets, chunk_bytes=192)
    data = {n: torch.randint(0, 256, (b,), dtype=torch.uint8, device=DEVICE) for n, b in slots.items()}

    def read(name):
        out = torch.empty(slots[name], dtype=torch.uint8, device=DEVICE)
        tier.read(name, out.untyped_storage()).wait()
        return out

    for name in ("x", "y"):
        tier.write(name, data[name].untyped_storage()).wait()
    assert torch.equal(read("x"), data["x"]) and torch.equal(read("y"), data["y"])
    tier.write("z", data["z"].untyped_storage()).wait()
    assert torch.equal(read("z"), data["z"])
    for name in ("x", "y"):
        with pytest.raises(ValueError, match=f"slot '{name}' now holds 'z', written after '{name}'"):
            read(name)
    tier.write("y", data["y"].untyped_storage()).wait()
    assert torch.equal(read("y"), data["y"])
    with pytest.raises(ValueError, match="slot 'z' now holds 'y'"):
        read("z")
    # the region is its ranges' highest end (y: 128 + 200 rounded up to 64), in 2 chunks
    assert tier.nbytes == 384 and tier.allocated_bytes == 384
    assert tier.can_take_over("x") is False
    tier.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"offsets": {"x": 0, "y": 128}}, r"offset None of 'z'"),
    ({"offsets": {"x": 0, "y": 100, "z": 0}}, r"offset 100 of 'y'.*multiple of 64"),
    ({"offsets": {"x": 0, "y": 0, "z": -64}}, r"offset -64 of 'z'"),
    ({"offsets": {"x": 0, "y": 0, "z": 0}, "shares": {"y": "x"}}, "exclude each other"),
    ({"offsets": {"x": 0, "y": 0, "z": 0}, "chunk_bytes": 100}, "chunk_bytes=100"),
    ({"offsets": {"x": 0, "y": 0, "z": 1 << 20}}, r"region of 3 ranges needs 1048704 bytes, above host_mem_cap_bytes=1048576"),
])
def test_bad_host_regions_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HostTier(1 << 20, {"x": 12_000, "y": 9_000, "z": 100}, DEVICE, **kwargs)


@pytest.mark.parametrize("shares, message", [
    ({"w": "x"}, "'w' is not a slot name"),
    ({"y": "v"}, "'y' -> 'v', which is no slot of its own"),
    ({"y": "x", "z": "y"}, "'z' -> 'y', which is no slot of its own"),
    ({"x": "y"}, r"'x' \(12000 B\) does not fit in 'y'\'s slot \(9000 B\)"),
])
def test_bad_shares_are_refused_before_anything_is_allocated(tmp_path, shares, message):
    slots = {"x": 12_000, "y": 9_000, "z": 100}
    with pytest.raises(ValueError, match=message):
        HostTier(1 << 20, slots, DEVICE, shares=shares)
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=message):
        SSDTier([str(tmp_path / "d")], slots, shares=shares)
    assert os.listdir(tmp_path / "d") == []


def test_host_take_over_only_where_the_slot_is_the_tensors_own_size():
    tier = HostTier(1 << 20, {"x": 1000, "y": 600}, "cpu", shares={"y": "x"})
    assert tier.can_take_over("x") and not tier.can_take_over("y") and not tier.can_take_over("q")
    buf = torch.arange(1024, dtype=torch.int64).to(torch.uint8)
    tier.take_over("x", buf)
    assert not tier.can_take_over("x")
    out = torch.empty(1000, dtype=torch.uint8)
    tier.read("x", out.untyped_storage())
    assert torch.equal(out, buf[:1000])
    tier.close()


# --- SSD tier: files, placement, validation, failures -------------------------------------

def _ssd(tmp_path, slots, n_dirs=1, **kw):
    dirs = []
    for i in range(n_dirs):
        (tmp_path / f"d{i}").mkdir()
        dirs.append(str(tmp_path / f"d{i}"))
    return SSDTier(dirs, slots, **kw), dirs


@pytest.mark.parametrize("stripe", [4096, 8 << 20])
def test_ssd_slots_are_4k_aligned_disjoint_striped_and_spread_over_dirs(tmp_path, stripe):
    slots = {f"t{i}": n for i, n in enumerate([5000, 1, 4096, 9000, 300, 70000, 4097, 0])}
    tier, dirs = _ssd(tmp_path, slots, n_dirs=3, stripe_bytes=stripe)
    with tier:
        stripes = [st for sts in tier.placement.values() for st in sts]
        assert {os.path.dirname(st.path) for st in stripes} == set(dirs)
        by_file: dict[str, list[tuple[int, int]]] = {}
        for name, sts in tier.placement.items():
            # The stripes cover the storage's bytes once, in order, each at most a stripe.
            assert [st.start for st in sts] == [j * stripe for j in range(len(sts))]
            assert sum(st.nbytes for st in sts) == slots[name] and all(st.nbytes <= stripe for st in sts)
            # Consecutive stripes go to consecutive files (RAID-0).
            files = [tier._file_index[st.path] for st in sts]
            assert all((b - a) % 3 == 1 for a, b in zip(files, files[1:]))
            for st in sts:
                assert st.offset % 4096 == 0
                by_file.setdefault(st.path, []).append((st.offset, st.nbytes))
        for path, spans in by_file.items():
            spans.sort()
            for (o1, n1), (o2, _) in zip(spans, spans[1:]):
                assert o1 + n1 <= o2
            assert os.path.getsize(path) >= spans[-1][0] + spans[-1][1]
        if stripe == 4096:  # the 70,000-byte slot is spread over all three files
            assert len({st.path for st in tier.placement["t5"]}) == 3
        assert all(len(os.listdir(d)) == 1 for d in dirs)
    assert all(os.listdir(d) == [] for d in dirs)


def test_ssd_io_bypasses_the_page_cache_where_the_filesystem_allows(tmp_path):
    (tmp_path / "d").mkdir()
    direct = _direct_io_in(tmp_path / "d")
    with SSDTier([str(tmp_path / "d")], {"a": 10}) as tier:
        assert tier.mode == ("direct" if direct else "buffered")
        flags = __import__("fcntl").fcntl(tier._handles[0], __import__("fcntl").F_GETFL)
        assert bool(flags & os.O_DIRECT) == direct
    with SSDTier([str(tmp_path / "d")], {"a": 10}, backend="buffered") as tier:
        assert tier.mode == "buffered"
    if not direct:
        with pytest.raises(ValueError, match=r"refuse O_DIRECT; use backend='buffered'"):
            SSDTier([str(tmp_path / "d")], {"a": 10}, backend="direct")
    with pytest.raises(ValueError, match=r"stripe_bytes=1000; must be a positive multiple of 4096"):
        SSDTier([str(tmp_path / "d")], {"a": 10}, stripe_bytes=1000)


def test_ssd_files_stay_flat_over_50_cycles_and_vanish_on_close(tmp_path):
    t = torch.randint(0, 256, (12_345,), dtype=torch.uint8, device=DEVICE)
    u = torch.randn(100, device=DEVICE)
    tier, dirs = _ssd(tmp_path, {"t": t.numel(), "u": 400}, n_dirs=2)
    before = {d: [(f, os.path.getsize(os.path.join(d, f))) for f in os.listdir(d)] for d in dirs}
    for _ in range(50):
        expected = (t.clone(), u.clone())
        offload_and_restore(tier, "t", t)
        offload_and_restore(tier, "u", u)
        assert torch.equal(t, expected[0]) and torch.equal(u, expected[1])
        t.add_(7)
        u.mul_(1.5)
    after = {d: [(f, os.path.getsize(os.path.join(d, f))) for f in os.listdir(d)] for d in dirs}
    assert after == before
    tier.close()
    assert all(os.listdir(d) == [] for d in dirs)


def test_ssd_files_are_deleted_when_the_tier_is_dropped_unclosed(tmp_path):
    tier, dirs = _ssd(tmp_path, {"a": 10})
    assert len(os.listdir(dirs[0])) == 1
    del tier
    gc.collect()
    assert os.listdir(dirs[0]) == []


def test_ssd_missing_dir_is_rejected_naming_path_and_bytes(tmp_path):
    (tmp_path / "ok").mkdir()
    missing = tmp_path / "no_such_drive"
    with pytest.raises(ValueError, match=rf"{re.escape(str(missing))}.*does not exist.*8192 bytes"):
        SSDTier([str(tmp_path / "ok"), str(missing)], {"a": 5000, "b": 4097})
    assert os.listdir(tmp_path / "ok") == []


def test_ssd_path_under_a_regular_file_is_rejected(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"file.*not a directory.*4096 bytes"):
        SSDTier([str(tmp_path / "file")], {"a": 1})
    with pytest.raises(ValueError, match=r"file/sub.*does not exist.*4096 bytes"):
        SSDTier([str(tmp_path / "file" / "sub")], {"a": 1})


def test_ssd_unwritable_dir_is_rejected_and_nothing_is_left_behind(tmp_path):
    # procfs refuses new files to everyone, root included (chmod would not stop root).
    (tmp_path / "ok").mkdir()
    with pytest.raises(ValueError, match=r"'/proc'.*not writable.*4096 bytes"):
        SSDTier([str(tmp_path / "ok"), "/proc"], {"a": 10, "b": 20})
    assert os.listdir(tmp_path / "ok") == []


def test_ssd_too_little_free_space_is_rejected_naming_path_and_bytes(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / 'd'))}.*10000 bytes free.*12288 bytes"):
        SSDTier([str(tmp_path / "d")], {"a": 4096, "b": 4097})
    assert os.listdir(tmp_path / "d") == []


@pytest.mark.parametrize("n_dirs", [1, 2, 3, 5])
def test_the_planners_ssd_file_bytes_are_what_the_tier_allocates(tmp_path, n_dirs):
    # teraio.core.slots.ssd_file_bytes, which the planner's SSD cap counts, against the
    # files the tier makes for the same slots (sizes around 4 KiB and stripe boundaries).
    stripe = 64 << 10
    sizes = [1, 4095, 4096, 4097, stripe - 1, stripe, stripe + 1, 3 * stripe + 5, 7 * stripe]
    slots = {f"t{i}": n for i, n in enumerate(sizes)}
    dirs = [str(tmp_path / f"d{i}") for i in range(n_dirs)]
    for d in dirs:
        os.mkdir(d)
    with SSDTier(dirs, slots, backend="buffered", stripe_bytes=stripe):
        made = sum(os.path.getsize(os.path.join(d, f)) for d in dirs for f in os.listdir(d))
    assert made == sum(ssd_file_bytes(n, stripe) for n in sizes)


def test_drive_room_is_the_free_bytes_less_the_reserve_shared_by_dirs_of_one_filesystem(tmp_path, monkeypatch):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    for d in dirs:
        os.mkdir(d)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_001))
    assert drive_room_bytes(dirs[:1], reserve=1) == 10_000
    assert drive_room_bytes(dirs, reserve=1) == 10_000  # one filesystem: 5,000 per directory
    assert drive_room_bytes(dirs, reserve=20_000) == 0
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "gone"))):
        drive_room_bytes([str(tmp_path / "gone")])
    with pytest.raises(ValueError, match="at least one"):
        drive_room_bytes([])


def test_ssd_failed_write_raises_naming_tensor_and_path_and_poisons_the_slot(tmp_path, monkeypatch):
    tier, dirs = _ssd(tmp_path, {"layers.3.w": 100}, backend="buffered")
    with tier:
        s = torch.arange(25, dtype=torch.float32, device=DEVICE).untyped_storage()

        def full_disk(fd, data, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwrite", full_disk)
        transfer = tier.write("layers.3.w", s)
        with pytest.raises(TierIOError, match=rf"'layers.3.w'.*{re.escape(dirs[0])}.*No space left") as info:
            transfer.wait()
        assert info.value.name == "layers.3.w" and info.value.path.startswith(dirs[0])
        assert transfer.done()
        monkeypatch.undo()
        # The slot holds no valid data now: a read must fail, not return stale bytes.
        with pytest.raises(TierIOError, match="last write failed"):
            tier.read("layers.3.w", s).wait()
        tier.write("layers.3.w", s).wait()  # a new write makes it valid again
        tier.read("layers.3.w", s).wait()


def test_ssd_failed_read_raises_naming_tensor_and_path(tmp_path):
    tier, dirs = _ssd(tmp_path, {"opt.exp_avg": 5000})
    with tier:
        s = torch.ones(1250, device=DEVICE).untyped_storage()
        tier.write("opt.exp_avg", s).wait()
        (stripe,) = tier.placement["opt.exp_avg"]
        path = stripe.path
        os.truncate(path, 100)  # the drive lost the data behind the tier's back
        with pytest.raises(TierIOError, match=rf"'opt.exp_avg'.*{re.escape(path)}.*end of file"):
            tier.read("opt.exp_avg", s).wait()


def test_ssd_rejects_bad_backend(tmp_path):
    with pytest.raises(ValueError, match="'nvme'.*valid"):
        SSDTier([str(tmp_path)], {"a": 1}, backend="nvme")
    if not CUDA:
        with pytest.raises(ValueError, match="CUDA driver"):
            SSDTier([str(tmp_path)], {"a": 1}, backend="kvikio")
        with SSDTier([str(tmp_path)], {}) as tier:
            assert tier.mode in ("direct", "buffered")


# --- host tier ------------------------------------------------------------------------

def test_host_slots_are_capped_aligned_allocated_on_first_write_and_freed_on_close():
    slots = {"a": 1, "b": 100, "c": 64}
    with pytest.raises(ValueError, match=r"256 bytes.*host_mem_cap_bytes=255"):
        HostTier(255, slots, DEVICE)
    tier = HostTier(256, slots, DEVICE)
    assert tier.nbytes == 256 and tier.pinned == CUDA
    assert tier.allocated_bytes == 0
    tier.write("b", torch.zeros(100, dtype=torch.uint8, device=DEVICE).untyped_storage()).wait()
    assert tier.allocated_bytes == 128
    buffer = weakref.ref(tier._slot_buffers["b"])
    tier.close()
    gc.collect()
    assert buffer() is None


# --- GPU only ---------------------------------------------------------------------------

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["ssd", "host"])
def test_restore_over_2_gib_is_bit_exact(kind, tmp_path):
    nbytes = 2**31 + 4097
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    expected = t.clone()
    tier = (SSDTier([str(tmp_path)], {"big": nbytes}) if kind == "ssd"
            else HostTier(nbytes + 64, {"big": nbytes}, "cuda"))
    with tier:
        if kind == "ssd":
            assert tier.mode in ("gds", "direct", "buffered")
        offload_and_restore(tier, "big", t)
        if kind == "host":
            assert tier._slot_buffers["big"].is_pinned()
        assert torch.equal(t, expected)
    assert os.listdir(tmp_path) == []


@pytest.mark.gpu
@gpu
def test_host_tier_copies_hold_no_device_storage():
    """A device storage whose owner lets it go while its host-tier copy is not yet waited on
    is freed at once (the transfer does not keep it alive), and both copies still move the
    right bytes: the caching allocator reuses the memory only after the copy ran."""
    from torch.multiprocessing.reductions import StorageWeakRef

    nbytes = 1 << 28
    with HostTier(nbytes + 64, {"x": nbytes}, "cuda") as tier:
        t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        expected = t.cpu()
        ref = StorageWeakRef(t.untyped_storage())
        write = tier.write("x", t.untyped_storage())
        del t
        assert ref.expired()
        overwrite = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
        write.wait()
        back = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        tier.read("x", back.untyped_storage()).wait()
        assert torch.equal(back.cpu(), expected)

        dropped = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        ref = StorageWeakRef(dropped.untyped_storage())
        read = tier.read("x", dropped.untyped_storage())
        del dropped
        assert ref.expired()
        read.wait()
        assert int(overwrite[0]) == 7


@pytest.mark.gpu
@gpu
def test_host_tier_times_each_copy_on_its_stream_not_its_wait_for_the_compute_stream():
    """A copy queued behind a long kernel is timed from where it starts on its stream: its
    ``copy_seconds`` is a small share of the wait for it, and 1 GiB moves at PCIe's order of
    speed (above 5 GB/s)."""
    nbytes = 1 << 30
    with HostTier(nbytes + 64, {"x": nbytes}, "cuda") as tier:
        t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        a = torch.randn(8192, 8192, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):  # keeps the compute stream busy: the copy waits for these
            a = a @ a / 8192
        write = tier.write("x", t.untyped_storage())
        write.wait()
        waited = time.perf_counter() - t0
        copy = write.copy_seconds()
        assert copy is not None and 0 < copy < 0.5 * waited and nbytes / copy > 5e9
    from teraio.core.tiers.base import Transfer
    ssd = Transfer("y", "p", "what", 1)
    assert ssd.copy_seconds() is None  # nothing timed: an SSD transfer, a CPU copy


def test_slot_files_of_killed_runs_are_removed_by_the_next_run(tmp_path, capsys):
    import socket
    import subprocess
    import sys

    host = socket.gethostname().replace("-", "_")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"teraio-{host}-{dead.pid}-abc123.slots"
    live = tmp_path / f"teraio-{host}-{os.getpid()}-def456.slots"
    elsewhere = tmp_path / f"teraio-otherhost-{dead.pid}-ghi789.slots"
    for f in (orphan, live, elsewhere):
        f.write_bytes(b"x" * 100)
    with SSDTier([str(tmp_path)], {"a": 10}) as tier:
        (own,) = {st.path for sts in tier.placement.values() for st in sts}
        assert os.path.basename(own).startswith(f"teraio-{host}-{os.getpid()}-")
        assert not orphan.exists() and live.exists() and elsewhere.exists()
    assert f"removed {orphan} (100 B), left by process {dead.pid}, which is gone" in capsys.readouterr().out


def test_the_room_for_a_plan_is_measured_after_a_dead_runs_slot_files_are_removed(tmp_path):
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"teraio-{socket.gethostname().replace('-', '_')}-{dead.pid}-abc123.slots"
    orphan.write_bytes(b"x" * 100)
    drive_room_bytes([str(tmp_path)])
    assert not orphan.exists()
