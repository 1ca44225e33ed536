"""The SSD tier (paper §3.3): tensor storages striped over one preallocated file per drive,
moved with ``O_DIRECT`` (or kvikio/GPUDirect Storage where present) by a pool of workers;
the room the tier may take on the drives (:func:`drive_room_bytes`) and the slot files a
killed run left behind (:func:`remove_orphans`). The contract it keeps is
``teraio.core.tiers.base.Tier``'s.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass

import torch

from teraio.core.slots import FILE_ALIGN, SSD_STRIPE, align_up
from teraio.core.tiers.base import Tier, Transfer, byte_view
from teraio.core.tiers.pinned import page_unlock, pinned_empty
from teraio.files import SLOT_FILES, owner_tag, remove_orphans as remove_owned

BACKENDS: tuple[str, ...] = ("auto", "direct", "buffered", "kvikio")
SSD_FREE_RESERVE = 1 << 30  # bytes a plan leaves free on each drive's filesystem (side files, logs)


def drive_room_bytes(dirs: list[str], reserve: int = SSD_FREE_RESERVE) -> int:
    """Most bytes the SSD tier's files may take over ``dirs`` (one per drive), for the
    planner's ``ssd_cap_bytes``: the tier spreads its slots evenly over the directories, so
    each may take its filesystem's free bytes less ``reserve``, shared among that
    filesystem's directories. The slot files a dead run left there (:func:`remove_orphans`)
    are removed first, so that their bytes count as free. :class:`SSDTier` still checks each
    file's share when it opens.

    Raises:
        ValueError: no directory, or one that does not exist.
    """
    if not dirs:
        raise ValueError("the SSD tier needs at least one offload directory, got none")
    try:
        groups = _by_filesystem(dirs)
    except OSError as e:
        raise ValueError(f"offload dir {e.filename!r} cannot be read ({e}); hardware.ssd_dirs must exist") from e
    for d in dirs:
        remove_orphans(d)
    each = min(max(0, shutil.disk_usage(dirs[ix[0]]).free - reserve) // len(ix) for ix in groups.values())
    return each * len(dirs)


def _by_filesystem(dirs: list[str]) -> dict[int, list[int]]:
    """Indices into ``dirs`` grouped by the filesystem each lies on (``st_dev``), groups and
    indices in the order of ``dirs``. Raises OSError for a directory it cannot stat."""
    groups: dict[int, list[int]] = {}
    for i, d in enumerate(dirs):
        groups.setdefault(os.stat(d).st_dev, []).append(i)
    return groups


def _ready_event(storage: torch.UntypedStorage) -> torch.cuda.Event | None:
    """An event on the device's current stream: the ops queued so far that produce (for a
    write) or last used the memory of (for a read) ``storage`` are done once it fires."""
    if storage.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(storage.device))
    return event


def _host_buffer(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU uint8 tensor, without copying.
    (``t.numpy()`` would do, but marks the storage non-resizable for good, and the engine
    must ``resize_`` it.) The caller keeps ``t`` alive while the view is used."""
    return memoryview((ctypes.c_uint8 * t.numel()).from_address(t.data_ptr())).cast("B")


def _delete_files(paths: list[str], handles: list) -> None:
    for h in handles:  # kvikio.CuFile or a POSIX fd
        if isinstance(h, int):
            os.close(h)
        else:
            h.close()
    handles.clear()
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    paths.clear()


_SLOT_PREFIX = SLOT_FILES[0]


def remove_orphans(directory: str) -> list[str]:
    """Delete the slot files in ``directory`` that a TeraIO process of this host left behind
    when it was killed (its process is gone; ``teraio.files.remove_orphans``), printing a line
    for each; files of live processes and of other hosts stay. Returns the deleted paths."""
    return remove_owned(directory, *SLOT_FILES)


@dataclass(frozen=True)
class Stripe:
    """One piece of a tensor's slot: bytes ``[start, start + nbytes)`` of the storage live
    in ``path`` at byte ``offset`` (4 KiB-aligned)."""

    path: str
    offset: int
    start: int
    nbytes: int


class SSDTier(Tier):
    """The SSD tier: one preallocated file per directory (one directory per drive), each
    slot (a tensor name's, or shared: ``shares``) striped over all of them (RAID-0 style):
    its bytes are cut into ``stripe_bytes`` pieces dealt round-robin over the files, so one large tensor
    moves at the drives' summed bandwidth. The paper (§3.3) moves tensors between HBM and
    SSDs with GPUDirect Storage through cuFile and leaves the file layout unstated; kvikio
    is the cuFile binding used where GDS is present, and the fixed slots mean no
    allocation, fragmentation or file growth while training.

    Each stripe is one request on a pool of ``threads`` workers per directory, so every
    drive has several requests in flight. Without GDS a stripe goes through a 4 KiB-aligned
    bounce buffer of the worker (page-locked on a CUDA device, copied on the worker's own
    CUDA stream) and the file is opened with ``O_DIRECT``: the page cache is out of both
    the data path and the measurement, as with ZeRO-Infinity's libaio.

    Args:
        dirs: directories, one per drive.
        slots: tensor name -> storage size in bytes, from the migration plan.
        shares: tensor name -> the name whose slot it uses instead of its own (from
            ``MigrationPlan.shared_slots``: tensors whose periods never overlap); a write
            to a shared slot waits for the slot's previous transfer.
        backend: ``"direct"`` (``O_DIRECT`` through bounce buffers; a directory whose
            filesystem refuses ``O_DIRECT`` is an error), ``"buffered"`` (the same path
            through the page cache), ``"kvikio"`` (``kvikio.CuFile`` on device memory: GDS,
            or kvikio's compat mode without nvidia-fs; needs a CUDA driver), or ``"auto"``
            (kvikio where GDS is available, else direct where every directory allows it,
            else buffered).
        threads: workers per directory.
        stripe_bytes: stripe size, a positive multiple of 4 KiB.

    Attributes:
        mode: ``"gds"``, ``"compat"`` (kvikio without GDS), ``"direct"`` or ``"buffered"``;
            goes into the result row (``ssd_io_mode``).
        placement: tensor name -> its :class:`Stripe` list, in storage order.

    Raises:
        ValueError: before any transfer, if a directory is missing, not a directory, not
            writable, has too little free space for its share (the message names the path
            and the bytes needed) or refuses ``O_DIRECT`` with ``backend="direct"``; or on a
            bad backend, thread count, stripe size or slot.
    """

    label = "SSD tier"

    def __init__(self, dirs: list[str], slots: dict[str, int], backend: str = "auto", threads: int = 4,
                 stripe_bytes: int = SSD_STRIPE, shares: dict[str, str] | None = None):
        if not dirs:
            raise ValueError("SSDTier needs at least one offload directory, got none")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; valid: {BACKENDS}")
        if threads < 1:
            raise ValueError(f"threads={threads}; need >= 1")
        if stripe_bytes <= 0 or stripe_bytes % FILE_ALIGN:
            raise ValueError(f"stripe_bytes={stripe_bytes}; must be a positive multiple of {FILE_ALIGN}")
        super().__init__(slots, shares)
        if backend == "kvikio" and not torch.cuda.is_available():
            raise ValueError("backend='kvikio' needs a CUDA driver (kvikio does no I/O without "
                             "libcuda.so.1); use backend='direct' or 'buffered' on this machine")
        if backend == "auto" and torch.cuda.is_available() and _gds_available():
            backend = "kvikio"
        dirs = [os.path.abspath(d) for d in dirs]
        layout, share = _stripe_layout({n: b for n, b in slots.items() if self._key[n] == n},
                                       len(dirs), stripe_bytes)
        for d, need in zip(dirs, share):
            if not os.path.exists(d):
                raise ValueError(f"offload dir {d!r} does not exist (the plan needs {need} bytes there)")
            if not os.path.isdir(d):
                raise ValueError(f"offload dir {d!r} is not a directory (the plan needs {need} bytes there)")

        # Owned by the finalizer, so the files go even if close() is never called.
        self._paths: list[str] = []
        self._handles: list = []
        self._bounce: list[torch.Tensor] = []  # every worker's bounce buffer, unlocked at close
        self._closed = weakref.finalize(self, _close_tier, self._paths, self._handles, self._bounce)
        try:
            for d, need in zip(dirs, share):
                remove_orphans(d)
                try:
                    fd, path = tempfile.mkstemp(prefix=f"{_SLOT_PREFIX}{owner_tag()}-", suffix=".slots", dir=d)
                except OSError as e:
                    raise ValueError(f"offload dir {d!r} is not writable ({e}); "
                                     f"the plan needs {need} bytes there") from e
                os.close(fd)
                self._paths.append(path)
            self._check_free_space(dirs, share)
            for path, need in zip(self._paths, share):
                self._allocate(path, need)
            self.placement: dict[str, list[Stripe]] = {
                name: [Stripe(self._paths[f], off, start, max(0, min(n, slots[name] - start)))
                       for f, off, start, n in layout[self._key[name]] if start < slots[name] or start == 0]
                for name in slots}
            if backend == "kvikio":
                import kvikio
                import kvikio.defaults
                self.mode = "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"
                self._handles.extend(kvikio.CuFile(p, "r+") for p in self._paths)
            else:
                direct = backend != "buffered" and all(_direct_io_works(p) for p in self._paths)
                if backend == "direct" and not direct:
                    bad = [d for d, p in zip(dirs, self._paths) if not _direct_io_works(p)]
                    raise ValueError(f"offload dir(s) {bad} refuse O_DIRECT; use backend='buffered' "
                                     "or 'auto' there (reads then come from the page cache)")
                self.mode = "direct" if direct else "buffered"
                flags = os.O_RDWR | (os.O_DIRECT if direct else 0)
                self._handles.extend(os.open(p, flags) for p in self._paths)
        except BaseException:
            self._closed()
            raise
        self.backend = backend
        self._stripe_bytes = stripe_bytes
        self._file_index = {p: i for i, p in enumerate(self._paths)}
        self._pool = concurrent.futures.ThreadPoolExecutor(threads * len(dirs), thread_name_prefix="teraio-ssd")
        self._workers = concurrent.futures.ThreadPoolExecutor(threads * len(dirs), thread_name_prefix="teraio-ssd-io")
        self._local = threading.local()  # per worker: bounce buffer, CUDA stream
        self._last: dict[str, concurrent.futures.Future] = {}  # last transfer per slot
        self._last_write: dict[str, concurrent.futures.Future] = {}  # per name

    @staticmethod
    def _check_free_space(dirs: list[str], share: list[int]) -> None:
        for ix in _by_filesystem(dirs).values():
            d, need = dirs[ix[0]], sum(share[i] for i in ix)
            free = shutil.disk_usage(d).free
            if free < need:
                raise ValueError(f"offload dir {d!r} has {free} bytes free; the plan needs "
                                 f"{need} bytes on its filesystem")

    @staticmethod
    def _allocate(path: str, nbytes: int) -> None:
        if nbytes == 0:
            return
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystem without fallocate
                os.ftruncate(fd, nbytes)
            else:
                raise ValueError(f"cannot allocate {nbytes} bytes for offload file {path!r}: {e}") from e
        finally:
            os.close(fd)

    def _start(self, kind: str, name: str, storage: torch.UntypedStorage, nbytes: int) -> Transfer:
        """Submit the transfer; a worker waits (off the calling thread) for the ops queued on
        the current CUDA stream, then for the slot's previous transfer."""
        stripes = self.placement[name]
        where = "to" if kind == "write" else "from"
        files = sorted({st.path for st in stripes})
        path = files[0] if len(files) == 1 else os.path.commonpath(files)
        what = (f"SSD {kind} of {name!r} ({nbytes} B) {where} {path}"
                + (f" at offset {stripes[0].offset}" if len(stripes) == 1 else f" in {len(stripes)} stripes"))
        view = byte_view(storage)
        key = self._key[name]
        future = self._pool.submit(self._run, kind, view, stripes, _ready_event(storage),
                                   self._last.get(key), self._last_write.get(name))
        self._last[key] = future
        if kind == "write":
            self._last_write[name] = future
        return Transfer(name, path, what, nbytes, future=future)

    def _run(self, kind: str, view: torch.Tensor, stripes: list[Stripe], ready, previous, last_write) -> int:
        if previous is not None:
            concurrent.futures.wait([previous])
        if kind == "read" and last_write.exception() is not None:
            raise OSError(errno.EIO, f"the slot holds no valid data: its last write failed "
                                     f"({last_write.exception()})")
        if ready is not None:
            ready.synchronize()
        if view.numel() == 0:
            return 0
        pieces = [self._workers.submit(self._move, kind, view, st) for st in stripes]
        concurrent.futures.wait(pieces)
        for p in pieces:
            if p.exception() is not None:
                raise p.exception()
        return view.numel()

    def _move(self, kind: str, view: torch.Tensor, st: Stripe) -> None:
        """One stripe, on a worker thread."""
        fd = self._handles[self._file_index[st.path]]
        part = view[st.start:st.start + st.nbytes]
        if self.backend == "kvikio":
            buf = part if part.is_cuda else _host_buffer(part)
            io = fd.pwrite if kind == "write" else fd.pread
            moved = io(buf, st.nbytes, st.offset).get()
            if moved != st.nbytes:
                raise OSError(errno.EIO, f"kvikio moved {moved} of {st.nbytes} bytes at file offset {st.offset}")
            return
        bounce, stream = self._worker_state(part.device)
        span = align_up(st.nbytes, FILE_ALIGN)
        if kind == "write":
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                bounce[:st.nbytes].copy_(part, non_blocking=stream is not None)
            if stream is not None:
                stream.synchronize()
            n = os.pwrite(fd, _host_buffer(bounce[:span]), st.offset)
            if n != span:
                raise OSError(errno.EIO, f"pwrite moved {n} of {span} bytes at file offset {st.offset}")
            return
        n = os.preadv(fd, [_host_buffer(bounce[:span])], st.offset)
        if n < st.nbytes:
            raise OSError(errno.EIO, f"unexpected end of file at offset {st.offset + max(n, 0)}")
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            part.copy_(bounce[:st.nbytes], non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()

    def _worker_state(self, device: torch.device):
        """This worker's 4 KiB-aligned bounce buffer of one stripe (page-locked for a CUDA
        device) and its CUDA stream (None on a CPU device)."""
        local = self._local
        if getattr(local, "bounce", None) is None:
            cuda = device.type == "cuda"
            raw = pinned_empty(self._stripe_bytes + FILE_ALIGN, "SSD tier bounce buffer") if cuda \
                else torch.empty(self._stripe_bytes + FILE_ALIGN, dtype=torch.uint8)
            if cuda:
                self._bounce.append(raw)
            skip = -raw.data_ptr() % FILE_ALIGN
            local.bounce = raw[skip:skip + self._stripe_bytes]
            local.stream = torch.cuda.Stream(device) if cuda else None
        return local.bounce, local.stream

    def _drain(self) -> None:
        """Finish the transfers in flight (the files are then closed and deleted)."""
        self._pool.shutdown(wait=True)
        self._workers.shutdown(wait=True)


def _stripe_layout(slots: dict[str, int], n_files: int, stripe: int):
    """Where each slot's stripes go: name -> [(file index, file offset, start, nbytes)],
    and the bytes each file needs. A slot's stripe j goes to file ``(first + j) % n_files``,
    ``first`` being the least-filled file when the slot is placed (largest slots first);
    a slot's stripes in one file are contiguous, each stripe 4 KiB-aligned."""
    fill = [0] * n_files
    layout: dict[str, list[tuple[int, int, int, int]]] = {}
    for name in sorted(slots, key=lambda n: (-slots[n], n)):
        nbytes = slots[name]
        n_stripes = max(1, -(-nbytes // stripe))
        first = min(range(n_files), key=lambda f: fill[f])
        base = {}
        for j in range(min(n_stripes, n_files)):
            f = (first + j) % n_files
            count = len(range(j, n_stripes, n_files))
            base[f] = fill[f]
            fill[f] += count * stripe if count > 1 else align_up(min(stripe, nbytes), FILE_ALIGN)
        pieces = []
        for j in range(n_stripes):
            f = (first + j) % n_files
            start = j * stripe
            pieces.append((f, base[f] + (j // n_files) * stripe, start, max(0, min(stripe, nbytes - start))))
        layout[name] = pieces
    return {n: layout[n] for n in slots}, fill


def _direct_io_works(path: str) -> bool:
    """Whether ``path``'s filesystem takes ``O_DIRECT`` (tmpfs before Linux 6.6 does not)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def _gds_available() -> bool:
    """True where kvikio would use GPUDirect Storage (nvidia-fs present), not its compat mode."""
    try:
        import kvikio.defaults
    except ImportError:
        return False
    return not kvikio.defaults.is_compat_mode_preferred()


def _close_tier(paths: list[str], handles: list, bounce: list[torch.Tensor]) -> None:
    _delete_files(paths, handles)
    for buf in bounce:
        page_unlock(buf)
    bounce.clear()
