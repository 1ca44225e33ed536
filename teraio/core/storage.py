"""The offload tiers the migration engine moves tensor storages to (paper §3.3, Fig. 4):
an SSD tier over one or more directories and a host tier of pinned memory.

Both tiers work on whole ``torch.UntypedStorage`` objects, byte for byte: the engine
offloads a storage, frees it with ``storage.resize_(0)``, later re-allocates it with
``storage.resize_(nbytes)`` and reads the bytes back (as FSDP does), so every tensor
viewing that storage (non-contiguous views, several tensors sharing one storage) is
restored bit-exactly. Every tensor name gets a fixed slot of known size up front (from
the migration plan), its own or shared with tensors whose periods never overlap its
(``shares``, ``teraio.core.slots``), so no tier allocates after construction.

Bytes are moved through a fresh ``uint8`` tensor ``set_`` on the storage: writing
through it bumps only that tensor's autograd version counter, never the counter of a
tensor saved for backward (``h.detach().copy_()`` would, and backward then fails with
"modified by an inplace operation").

Transfers are futures in the kvikio style (:class:`Transfer`: ``done()``, ``wait()``).
Transfers of the same slot run in the order they were issued (a read issued after a
write returns the written bytes; a write to a shared slot waits for the read of the
tensor before it); transfers of different slots may overlap.
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

from teraio.files import SLOT_FILES, owner_tag, remove_orphans as remove_owned
from teraio.core.slots import FILE_ALIGN, HOST_ALIGN, SSD_STRIPE, align_up

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


class TierIOError(RuntimeError):
    """A transfer to or from a tier failed. ``name``: the tensor; ``path``: the file (or
    ``"host pool"``). The underlying error is the ``__cause__``."""

    def __init__(self, message: str, name: str, path: str):
        super().__init__(message)
        self.name = name
        self.path = path


class Transfer:
    """Future of one tier transfer, in the style of kvikio's ``IOFuture``.

    Backed by a ``concurrent.futures.Future`` (SSD tier), a CUDA event (host tier on
    CUDA), or nothing (already complete). It holds no reference to the device storage: the
    SSD tier's I/O thread holds its view until the copy ran, and the host tier's copies are
    guarded by the caching allocator (``record_stream``), so a storage whose last reference
    its owner drops is freed at once, its memory reused only after the copy ran.
    """

    def __init__(self, name: str, path: str, what: str, nbytes: int, *,
                 future: concurrent.futures.Future | None = None,
                 event: torch.cuda.Event | None = None):
        self.name, self.path, self.nbytes = name, path, nbytes
        self._what = what
        self._future, self._event = future, event

    def done(self) -> bool:
        """True once the transfer finished (successfully or not); never blocks."""
        if self._future is not None:
            return self._future.done()
        if self._event is not None:
            return self._event.query()
        return True

    @property
    def stream_ordered(self) -> bool:
        """True when a CUDA stream can be ordered after this transfer without blocking the
        host (:meth:`wait_on_stream`): the host tier's copies on a CUDA device."""
        return self._event is not None

    def wait_on_stream(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream``'s later work wait for this transfer on the device
        (``cudaStreamWaitEvent``, PyTorch ``Stream.wait_event``); returns at once. Errors of
        an asynchronous CUDA copy surface at a later synchronization, as any kernel's.

        Raises:
            ValueError: the transfer is not :attr:`stream_ordered` (use :meth:`wait`).
        """
        if self._event is None:
            raise ValueError(f"{self._what}: no CUDA event to order a stream after; use wait()")
        stream.wait_event(self._event)

    def wait(self) -> int:
        """Block until the transfer finished; return the bytes moved.

        Raises:
            TierIOError: the transfer failed; the message names the tensor and the path.
        """
        try:
            if self._future is not None:
                self._future.result()
            elif self._event is not None:
                self._event.synchronize()
        except Exception as e:
            raise TierIOError(f"{self._what} failed: {e}", self.name, self.path) from e
        return self.nbytes


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A fresh 1-D uint8 tensor over all of ``storage`` (own autograd version counter)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def page_lock(buf: torch.Tensor, what: str) -> None:
    """Page-lock the host tensor ``buf`` on exactly its bytes (``cudaHostRegister``, portable);
    no-op for an empty one. Undo with :func:`page_unlock` before ``buf`` is freed.

    Raises:
        RuntimeError: the driver refused, naming ``what`` and the CUDA error.
    """
    if buf.numel():
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 1)  # 1: Portable
        if int(err) != 0:
            raise RuntimeError(f"{what}: cudaHostRegister of {buf.numel()} bytes failed (cudaError {int(err)})")


def pinned_empty(nbytes: int, what: str) -> torch.Tensor:
    """A page-locked CPU ``uint8`` tensor of ``nbytes`` (contents zero), owned by the caller
    (:func:`page_unlock` it before it is freed). Its pages are touched first by a
    multi-threaded fill, then locked: on an H200 host that made fresh memory usable at
    about 4.6 GB/s, against 1.6-2.0 GB/s for ``pin_memory=True`` or locking untouched pages,
    whose faults the driver takes one thread at a time
    (``benchmarks/results/host_pinning_h200.json``).

    Raises:
        RuntimeError: the driver refused, naming ``what``.
    """
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(0)
    page_lock(buf, what)
    return buf


def page_unlock(buf: torch.Tensor) -> None:
    """Undo :func:`page_lock`."""
    if buf.numel():
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


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


def _check_slots(slots: dict[str, int]) -> None:
    for name, nbytes in slots.items():
        if not isinstance(name, str) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"slot {name!r}: {nbytes!r} — slots must map str names to int byte counts >= 0")


def _slot_keys(slots: dict[str, int], shares: dict[str, str] | None) -> dict[str, str]:
    """Tensor name -> the name of the slot it uses (its own, or its owner's in
    ``shares``), after checking that every owner is a slot of its own at least as large."""
    shares = dict(shares or {})
    for name, owner in shares.items():
        if name not in slots:
            raise ValueError(f"shares: {name!r} is not a slot name (known: {len(slots)} names from the plan)")
        if owner not in slots or owner in shares:
            raise ValueError(f"shares: {name!r} -> {owner!r}, which is no slot of its own; "
                             "an owner must be a slot name that shares nothing")
        if slots[name] > slots[owner]:
            raise ValueError(f"shares: {name!r} ({slots[name]} B) does not fit in {owner!r}'s slot "
                             f"({slots[owner]} B)")
    return {n: shares.get(n, n) for n in slots}


def _meeting_ranges(ranges: dict[str, tuple[int, int]]) -> dict[str, list[str]]:
    """Name -> the names whose byte ranges ``[start, end)`` meet its own, itself included."""
    order = sorted(ranges, key=lambda n: ranges[n])
    meets: dict[str, list[str]] = {n: [n] for n in ranges}
    for i, n in enumerate(order):
        end = ranges[n][1]
        for m in order[i + 1:]:
            if ranges[m][0] >= end:
                break
            if ranges[m][0] < ranges[m][1] and ranges[n][0] < end:
                meets[n].append(m)
                meets[m].append(n)
    return meets


def _check_holder(tier: str, holders: dict[str, str], key: str, name: str) -> None:
    """Refuse to read ``name`` from slot ``key`` unless it was the last tensor written there."""
    holder = holders.get(key)
    if holder is None:
        raise ValueError(f"{tier}: tensor {name!r} was never written, nothing to read")
    if holder != name:
        raise ValueError(f"{tier}: slot {key!r} now holds {holder!r}, written after {name!r}: "
                         "the plan shares it between overlapping periods")


def _check_storage(tier: str, slots: dict[str, int], name: str, storage: torch.UntypedStorage) -> int:
    if name not in slots:
        raise ValueError(f"{tier}: tensor {name!r} has no slot (known: {len(slots)} names from the plan)")
    if storage.nbytes() != slots[name]:
        raise ValueError(f"{tier}: storage of {name!r} has {storage.nbytes()} bytes, its slot "
                         f"{slots[name]}; restore with storage.resize_({slots[name]}) before reading")
    return slots[name]


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


class SSDTier:
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
        _check_slots(slots)
        if backend == "kvikio" and not torch.cuda.is_available():
            raise ValueError("backend='kvikio' needs a CUDA driver (kvikio does no I/O without "
                             "libcuda.so.1); use backend='direct' or 'buffered' on this machine")
        if backend == "auto" and torch.cuda.is_available() and _gds_available():
            backend = "kvikio"
        self._slots = dict(slots)
        self._key = _slot_keys(slots, shares)
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
        self._holder: dict[str, str] = {}  # slot -> the name last written there

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

    def write(self, name: str, storage: torch.UntypedStorage) -> Transfer:
        """Launch the copy of all bytes of ``storage`` into ``name``'s slot.

        Waits (off the calling thread) for the ops queued on the current CUDA stream, so
        the bytes are those after the producing op. ``storage`` must not be freed or
        changed until the transfer is done.
        """
        return self._submit("write", name, storage)

    def read(self, name: str, storage: torch.UntypedStorage) -> Transfer:
        """Launch the copy of ``name``'s slot into ``storage`` (already ``resize_``-d to
        its slot size). Waits first for the ops queued on the current CUDA stream (the
        memory may have just been reused by the caching allocator).

        Raises:
            ValueError: ``name`` was never written to this tier, or another tensor was
                written to its slot since.
        """
        if name in self._slots:
            _check_holder("SSD tier", self._holder, self._key[name], name)
        return self._submit("read", name, storage)

    def _submit(self, kind: str, name: str, storage: torch.UntypedStorage) -> Transfer:
        if not self._closed.alive:
            raise RuntimeError(f"SSD tier is closed; cannot {kind} {name!r}")
        nbytes = _check_storage("SSD tier", self._slots, name, storage)
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
            self._holder[key] = name
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

    def close(self) -> None:
        """Wait for in-flight transfers, then close and delete the offload files.
        Idempotent."""
        if self._closed.alive:
            self._pool.shutdown(wait=True)
            self._workers.shutdown(wait=True)
            self._closed()

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def _unregister(buffers: dict) -> None:
    for buf in buffers.values():
        page_unlock(buf)
    buffers.clear()


class HostTier:
    """The host-memory tier: one buffer per slot, of its owner's size, never more than
    ``cap_bytes`` in all (paper §3.2: host memory is used under a capacity limit once the
    SSD bandwidth is exhausted). A slot is a tensor name's own, or shared by several
    tensors whose periods never overlap (``shares``).

    A slot's buffer is allocated at its first write, so that host memory fills only as
    tensors arrive (the steps before the plan may still hold other copies in host memory,
    ``teraio.core.pager``). With a CUDA device each buffer is page-locked with
    ``cudaHostRegister`` on exactly its own bytes (the caching pinned allocator would round
    up to a power of two and keep the block cached after close) and copies run
    ``non_blocking`` on two side streams (one per direction, so offloads and prefetches
    overlap on the PCIe link), completion tracked by CUDA events. On a CPU device copies
    are synchronous and the buffers pageable.

    With ``offsets`` (a plan made with ``host_arena``) the tier is one region instead: each
    name has the byte range ``[offset, offset + size)``, and ranges of tensors whose periods
    never overlap may overlap. The region is allocated in chunks of ``chunk_bytes`` as
    copies first touch them (a range may span chunks: one copy per piece), so host memory
    fills as tensors arrive, as with slots. A copy waits for the previous copy of every
    range that meets its own, and a read is refused once another tensor was written over
    any byte of its range. The region takes no buffer from the pager (``adopt``,
    ``take_over``): the engine copies those tensors in instead.

    Args:
        cap_bytes: host-memory cap for offloaded tensors, bytes.
        slots: tensor name -> storage size in bytes, from the migration plan.
        device: the training device (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
        shares: tensor name -> the name whose slot it uses instead of its own (from
            ``MigrationPlan.shared_slots``); a copy into a shared slot waits for the slot's
            previous copy.
        offsets: tensor name -> its byte offset in the region (``MigrationPlan.host_offsets``),
            a multiple of 64, for every name of ``slots``; None: slots.
        chunk_bytes: the region's allocation unit, bytes (a multiple of 64).

    Attributes:
        nbytes: bytes the slots take once all are written (each rounded up to 64 B).
        pinned: whether the buffers are page-locked.

    Raises:
        ValueError: the slots (or the region) need more than ``cap_bytes`` (message names
            both), a bad ``shares`` entry, both ``shares`` and ``offsets``, or a missing or
            misaligned offset.
    """

    def __init__(self, cap_bytes: int, slots: dict[str, int], device, shares: dict[str, str] | None = None,
                 offsets: dict[str, int] | None = None, chunk_bytes: int = 1 << 30):
        _check_slots(slots)
        self._slots = dict(slots)
        self._device = torch.device(device)
        self._range: dict[str, tuple[int, int]] | None = None  # per name, in region mode
        if offsets is None:
            self._key = _slot_keys(slots, shares)
            owners = [n for n in slots if self._key[n] == n]
            total = sum(align_up(slots[n], HOST_ALIGN) for n in owners)
            what = f"the plan's {len(owners)} host slots need"
        else:
            if shares:
                raise ValueError("host tier: shares (slots) and offsets (one region) exclude each other")
            bad = [n for n in slots if not isinstance(offsets.get(n), int) or offsets[n] < 0 or offsets[n] % HOST_ALIGN]
            if bad:
                raise ValueError(f"host tier: offset {offsets.get(bad[0])!r} of {bad[0]!r} (and {len(bad) - 1} more); "
                                 f"each slot name needs an int offset >= 0, a multiple of {HOST_ALIGN}")
            if chunk_bytes <= 0 or chunk_bytes % HOST_ALIGN:
                raise ValueError(f"host tier: chunk_bytes={chunk_bytes!r}; must be a positive multiple of {HOST_ALIGN}")
            self._key = {n: n for n in slots}
            self._range = {n: (offsets[n], offsets[n] + align_up(slots[n], HOST_ALIGN)) for n in slots}
            self._meets = _meeting_ranges(self._range)
            self._chunk = chunk_bytes
            total = max((end for _, end in self._range.values()), default=0)
            what = f"the plan's host region of {len(slots)} ranges needs"
        if total > cap_bytes:
            raise ValueError(f"host tier: {what} {total} bytes, above host_mem_cap_bytes={cap_bytes}")
        self.nbytes = total
        self.pinned = self._device.type == "cuda"
        self._buffers: dict = {}  # per slot (or chunk index), the registered ones, on CUDA
        self._slot_buffers: dict = {}  # per slot, or per chunk index of the region
        self._closed = weakref.finalize(self, _unregister, self._buffers)
        if self._device.type == "cuda":
            self._d2h = torch.cuda.Stream(self._device)
            self._h2d = torch.cuda.Stream(self._device)
        self._last: dict[str, torch.cuda.Event] = {}  # last transfer per slot (CUDA)
        self._holder: dict[str, str] = {}  # slot -> the name last written there

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the slot buffers allocated so far."""
        return sum(b.numel() for b in self._slot_buffers.values())

    def adopt(self, pool) -> int:
        """Give each slot not yet allocated a free buffer of its size from ``pool`` (a
        ``teraio.core.pager.HostBuffers`` pinned as this tier is) instead of a fresh one:
        page-locking fresh memory is what costs. The tier owns the buffers from then on.
        Returns the bytes adopted."""
        if self._range is not None:
            return 0
        if pool.pinned != self.pinned:
            raise ValueError(f"host tier: a pool of {'pinned' if pool.pinned else 'pageable'} buffers "
                             f"cannot serve a {'pinned' if self.pinned else 'pageable'} tier")
        pool.settle()
        adopted = 0
        for name, nbytes in self._slots.items():
            if self._key[name] != name or name in self._slot_buffers:
                continue
            buf = pool.take_free(align_up(nbytes, HOST_ALIGN))
            if buf is None and nbytes % HOST_ALIGN:
                buf = pool.take_free(nbytes)
            if buf is None:
                continue
            self._slot_buffers[name] = buf
            if self.pinned:
                self._buffers[name] = buf  # unlocked at close
            adopted += buf.numel()
        return adopted

    def take_over(self, name: str, buf: torch.Tensor) -> Transfer:
        """Make ``buf`` (a CPU ``uint8`` tensor holding ``name``'s bytes at its start, at
        least its slot's size, page-locked as this tier is) the slot of ``name``, written,
        without a copy; the tier owns it from then on. For bytes that are already in host
        memory (``teraio.core.pager``), so that they are not held twice.

        Raises:
            ValueError: ``name`` is no slot, its slot is already allocated, or ``buf`` is
                smaller than the slot.
        """
        if name not in self._slots:
            raise ValueError(f"host tier: {name!r} has no slot in the plan")
        key = self._key[name]
        nbytes = self._slots[key]
        if key in self._slot_buffers:
            raise ValueError(f"host tier: slot {key!r} is already allocated; write() to it instead")
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < nbytes:
            raise ValueError(f"host tier: slot {key!r} needs a uint8 buffer of at least {nbytes} B, "
                             f"got {buf.dtype} of {buf.numel()} elements")
        self._slot_buffers[key] = buf
        if self.pinned:
            self._buffers[key] = buf  # unlocked at close
        self._holder[key] = name
        return Transfer(name, "host pool", f"host take-over of {name!r} ({self._slots[name]} B)",
                        self._slots[name])

    def can_take_over(self, name: str) -> bool:
        """True while ``name``'s slot has no buffer yet and is ``name``'s own size, so that
        a buffer holding ``name``'s bytes can become it (:meth:`take_over`)."""
        key = self._key.get(name)
        return (self._range is None and key is not None and key not in self._slot_buffers
                and self._slots[key] == self._slots[name])

    def _buffer(self, key, size: int) -> torch.Tensor:
        """Slot ``key``'s buffer (or the region's chunk ``key``), allocated at first use."""
        buf = self._slot_buffers.get(key)
        if buf is None:
            if self.pinned:
                buf = pinned_empty(size, f"host tier slot {key!r}")
                self._buffers[key] = buf
            else:
                buf = torch.empty(size, dtype=torch.uint8)
            self._slot_buffers[key] = buf
        return buf

    def _pieces(self, name: str, nbytes: int) -> list[tuple[torch.Tensor, int, int]]:
        """``name``'s host bytes as ``(host view, start, end)``: the view holds bytes
        ``[start, end)`` of the tensor; one piece per slot, or per chunk its range meets."""
        if self._range is None:
            key = self._key[name]
            return [(self._buffer(key, align_up(self._slots[key], HOST_ALIGN))[:nbytes], 0, nbytes)]
        lo = self._range[name][0]
        pieces, pos = [], lo
        while pos < lo + nbytes:
            i, at = divmod(pos, self._chunk)
            end = min(lo + nbytes, (i + 1) * self._chunk)
            size = min(self._chunk, align_up(self.nbytes - i * self._chunk, HOST_ALIGN))
            pieces.append((self._buffer(i, size)[at:at + end - pos], pos - lo, end - lo))
            pos = end
        return pieces

    def write(self, name: str, storage: torch.UntypedStorage) -> Transfer:
        """Copy all bytes of ``storage`` into ``name``'s slot (after the ops queued so far
        on the current stream). ``storage`` must not be freed until the transfer is done."""
        transfer = self._copy("write", name, storage)
        for key in (self._meets[name] if self._range is not None else (self._key[name],)):
            self._holder[key] = name
        return transfer

    def read(self, name: str, storage: torch.UntypedStorage) -> Transfer:
        """Copy ``name``'s slot into ``storage`` (already ``resize_``-d to its slot size).

        Raises:
            ValueError: ``name`` was never written to this tier, or another tensor was
                written to its slot since.
        """
        if name in self._slots:
            _check_holder("host tier", self._holder, self._key[name], name)
        return self._copy("read", name, storage)

    def _copy(self, kind: str, name: str, storage: torch.UntypedStorage) -> Transfer:
        if not self._closed.alive:
            raise RuntimeError(f"host tier is closed; cannot {kind} {name!r}")
        nbytes = _check_storage("host tier", self._slots, name, storage)
        pieces = self._pieces(name, nbytes)
        view = byte_view(storage)
        what = f"host {kind} of {name!r} ({nbytes} B)"
        if not view.is_cuda:
            for host, lo, hi in pieces:
                (host.copy_(view[lo:hi]) if kind == "write" else view[lo:hi].copy_(host))
            return Transfer(name, "host pool", what, nbytes)
        stream = self._d2h if kind == "write" else self._h2d
        stream.wait_stream(torch.cuda.current_stream(storage.device))
        key = self._key[name]
        for other in (self._meets[name] if self._range is not None else (key,)):
            if other in self._last:
                stream.wait_event(self._last[other])
        with torch.cuda.stream(stream):
            for host, lo, hi in pieces:
                (host.copy_(view[lo:hi], non_blocking=True) if kind == "write"
                 else view[lo:hi].copy_(host, non_blocking=True))
            event = torch.cuda.Event()
            event.record(stream)
        # The caching allocator keeps the memory until the copy ran, so the transfer need not
        # hold the storage: a tensor past its last use is freed when its owner lets it go,
        # not when a thread gets round to waiting on the copy.
        view.record_stream(stream)
        self._last[key] = event
        return Transfer(name, "host pool", what, nbytes, event=event)

    def close(self) -> None:
        """Wait for in-flight copies, then unpin and free the buffers. Idempotent."""
        if self._closed.alive:
            if self._device.type == "cuda":
                self._d2h.synchronize()
                self._h2d.synchronize()
            self._last.clear()
            self._closed()
            self._slot_buffers.clear()

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
