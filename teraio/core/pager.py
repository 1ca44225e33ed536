"""On-demand paging under the GPU capacity, for the steps that run before a migration plan
exists: the first step (which creates the optimizer state) and the profiled one (paper §3.1).

The paper profiles a model that does not fit by offloading, during the profiled iteration,
every tensor the running kernel does not need. The :class:`Pager` does the same lazily:
before each op it brings back (from host memory) whatever the op touches that is off the
device, and makes room for the op's inputs and its freshly allocated outputs by evicting
the least recently used storages to host memory. Nothing the op touches is evicted, so the
op runs on resident tensors; its kernel time can then be timed on its own.

Units: bytes. A storage is evicted whole, as the engine does (``resize_(0)``, bytes kept in
a host copy; restored with ``resize_(nbytes)`` and a copy back), so tensor objects, views
and the autograd graph are untouched. On CUDA the host copies live in page-locked buffers
reused by size (:class:`HostBuffers`) and move asynchronously on the compute stream, ahead
of the op that needs them, at the link's speed; freshly touched pageable memory moved only
about 2 GB/s on an H200 host.

Resident bytes are counted two ways: the *accounted* bytes, the sum of the resident
storages the pager tracks (every storage an op touched or allocated, and every storage it
was given up front), which is all there is on a CPU device; and on CUDA the caching
allocator's ``memory_allocated``, which also sees workspaces and rounding. The pager keeps
both, plus the op's estimated fresh outputs, at or below ``limit_bytes``; an op that still
runs out of memory is retried after evicting more (:meth:`Pager.run`).

A storage's death is seen through a weak reference to its ``UntypedStorage`` object (PyTorch
keeps that object alive exactly as long as the storage), so a dead storage's host copy and
bytes are dropped at once.
"""
from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map_only

from teraio.core.profiler import fresh_outputs, iter_tensors, storage_id
from teraio.core.tiers.base import byte_view
from teraio.core.tiers.pinned import page_unlock, pinned_empty


class CapacityError(RuntimeError):
    """An op needs more resident bytes than the capacity allows even with every other
    storage evicted."""


@dataclass
class PagerStats:
    """What paging did over the pager's life. Bytes are bytes; seconds wall time."""

    evictions: int = 0
    restores: int = 0
    bytes_evicted: int = 0
    bytes_restored: int = 0
    oom_retries: int = 0
    max_accounted_bytes: int = 0  # peak of the accounted bytes at any op, outputs included
    max_host_bytes: int = 0  # peak of the host memory its buffers held (HostBuffers.held_bytes)


class _Page:
    __slots__ = ("key", "ref", "nbytes", "host")

    def __init__(self, key: int, ref: weakref.ref, nbytes: int):
        self.key, self.ref, self.nbytes = key, ref, nbytes
        self.host: torch.Tensor | None = None  # the bytes while evicted


def _signature(x):
    """A hashable stand-in for an op argument that fixes its outputs' sizes: a tensor's
    shape, strides and dtype, containers element-wise, other values as they are."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x


def fresh_output_bytes(func, args: tuple, kwargs: dict | None) -> int | None:
    """Bytes of the storages ``func`` will newly allocate for its outputs, from its schema
    (outputs without alias annotation) and a run on the meta device; 0 for ops that only
    return views, in-place results or no tensor; None where the meta run fails (ops with
    data-dependent shapes, ops without a meta kernel)."""
    returns = func._schema.returns
    if all(r.alias_info is not None or "Tensor" not in str(r.type) for r in returns):
        return 0

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")

    meta_kwargs = tree_map_only(torch.Tensor, to_meta, kwargs or {})
    if "device" in meta_kwargs:  # a factory op: size it without allocating on the device
        meta_kwargs["device"] = torch.device("meta")
    try:
        with _disable_current_modes():
            out = func(*tree_map_only(torch.Tensor, to_meta, args), **meta_kwargs)
    except Exception:
        return None
    outs = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
    total = 0
    for r, o in zip(returns, outs):
        if r.alias_info is None:
            total += sum(t.untyped_storage().nbytes() for t in iter_tensors((o,), None))
    return total


def physical_memory_bytes() -> int:
    """This machine's RAM, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class HostBuffers:
    """Host buffers for evicted bytes, reused by exact size: making fresh memory
    page-locked is what costs (:func:`teraio.core.tiers.pinned.pinned_empty`, about 4.6 GB/s on an
    H200 host against 55 GB/s for the copy), so a buffer, once made, is kept for the next
    eviction of its size. On CUDA each is page-locked on exactly its bytes; a buffer a copy
    still reads from is reused only once the CUDA event recorded after that copy has fired.
    Free buffers are released, oldest first, only when a new one would take the total past
    ``limit_bytes``, or all at once by :meth:`stop_keeping`.

    Raises:
        MemoryError (from :meth:`take`): the buffers in use and the new one exceed
            ``limit_bytes``.
    """

    def __init__(self, pinned: bool, limit_bytes: int):
        self.pinned = pinned
        self.limit_bytes = limit_bytes
        self._free: OrderedDict[int, torch.Tensor] = OrderedDict()  # id -> buffer, oldest first
        self._pending: list[tuple[torch.cuda.Event | None, torch.Tensor]] = []
        self.in_use_bytes = 0  # buffers holding evicted bytes, and pending ones
        self.free_bytes = 0
        self.keep_free = True  # keep returned buffers for reuse (see stop_keeping)

    @property
    def held_bytes(self) -> int:
        """Host memory these buffers hold now: in use, pending and kept free, bytes."""
        return self.in_use_bytes + self.free_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` CPU tensor of ``nbytes`` (contents undefined)."""
        self._reap()
        buf = self.take_free(nbytes)
        if buf is not None:
            self.in_use_bytes += nbytes
            return buf
        while self._free and self.in_use_bytes + self.free_bytes + nbytes > self.limit_bytes:
            self._release(self._free.popitem(last=False)[1])
        if self.in_use_bytes + nbytes > self.limit_bytes:
            raise MemoryError(f"pager: {self.in_use_bytes} B of evicted tensors are in host memory; "
                              f"{nbytes} B more would pass the {self.limit_bytes} B it may use")
        buf = pinned_empty(nbytes, "pager") if self.pinned else torch.empty(nbytes, dtype=torch.uint8)
        self.in_use_bytes += nbytes
        return buf

    def take_free(self, nbytes: int) -> torch.Tensor | None:
        """A free buffer of exactly ``nbytes``, no longer counted here (the caller owns it,
        and on CUDA its registration), or None."""
        for key, buf in self._free.items():
            if buf.numel() == nbytes:
                del self._free[key]
                self.free_bytes -= nbytes
                return buf
        return None

    def give(self, buf: torch.Tensor) -> None:
        """Return ``buf``; with pinned buffers, reusable once the copies queued so far on
        the current stream (the one reading from it) have run."""
        event = None
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
        self._pending.append((event, buf))
        self._reap()

    def disown(self, buf: torch.Tensor) -> None:
        """``buf``, taken from here, now belongs to someone else (and on CUDA so does its
        registration): it no longer counts here."""
        self.in_use_bytes -= buf.numel()

    def stop_keeping(self) -> None:
        """Release every free buffer, and from now on each returned one once its copies
        have run: when the buffers' next owner allocates its own, host memory must not
        hold both."""
        self.keep_free = False
        self.close()

    def _reap(self) -> None:
        still = []
        for event, buf in self._pending:
            if event is None or event.query():
                self.in_use_bytes -= buf.numel()
                if self.keep_free:
                    self._free[id(buf)] = buf
                    self.free_bytes += buf.numel()
                elif self.pinned:
                    page_unlock(buf)
            else:
                still.append((event, buf))
        self._pending = still

    def _release(self, buf: torch.Tensor) -> None:
        self.free_bytes -= buf.numel()
        if self.pinned:
            page_unlock(buf)

    def settle(self) -> None:
        """Wait for the copies still reading from returned buffers."""
        for event, _ in self._pending:
            if event is not None:
                event.synchronize()
        self._reap()

    def close(self) -> None:
        """Wait for pending copies and release every free buffer."""
        self.settle()
        while self._free:
            self._release(self._free.popitem(last=False)[1])


class Pager:
    """Keeps the storages of one device within ``limit_bytes`` by evicting the least
    recently used ones to host memory and restoring them when an op touches them.

    Args:
        limit_bytes: resident bytes allowed, accounted and (CUDA) allocated.
        device: the training device; storages elsewhere (CPU scalars of a CUDA run) are
            not paged.
        persistent: storages alive before the first paged op (parameters, buffers,
            optimizer state), tracked from the start so that they count.
        min_evict_bytes: storages below this size are counted but never evicted (their
            copies cost more than they free).
        unknown_output_bytes: bytes assumed for an op whose outputs cannot be sized on
            the meta device (:func:`fresh_output_bytes`).
        host_limit_bytes: host memory the evicted bytes may take (:class:`HostBuffers`);
            default 80 % of this machine's RAM (TeraIO's runs keep the default: the host
            cap binds the plan's host tier, not the steps before it).

    Raises:
        CapacityError: the persistent storages alone are above ``limit_bytes`` and
            cannot be evicted enough (raised by the first op that needs room).
    """

    def __init__(self, limit_bytes: int, device: torch.device, persistent: list[torch.Tensor] = (),
                 min_evict_bytes: int = 0, unknown_output_bytes: int = 0, host_limit_bytes: int | None = None):
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes={limit_bytes}; must be positive")
        self.limit_bytes = int(limit_bytes)
        self.device = torch.device(device)
        self.min_evict_bytes = min_evict_bytes
        self.unknown_output_bytes = unknown_output_bytes
        self.stats = PagerStats()
        self.buffers = HostBuffers(pinned=self.device.type == "cuda",
                                   limit_bytes=host_limit_bytes or int(0.8 * physical_memory_bytes()))
        self._output_bytes: dict = {}  # (op, argument signature) -> fresh_output_bytes
        self._lru: OrderedDict[int, _Page] = OrderedDict()  # resident, evictable, oldest first
        self._pinned: dict[int, _Page] = {}  # resident, below min_evict_bytes
        self._away: dict[int, _Page] = {}  # evicted
        self._dead: list[_Page] = []  # filled by weak-reference callbacks, drained on the next op
        self.resident_bytes = 0
        self.evicted_bytes = 0
        self.track(persistent)

    def track(self, tensors) -> None:
        """Count the storages of ``tensors`` from now on (resident, unless already held)."""
        for t in tensors:
            self._track(t.untyped_storage())

    def adopt_evicted(self, storage: torch.UntypedStorage, host: torch.Tensor) -> None:
        """Track ``storage``, freed (0 bytes) by another owner, as evicted, its bytes in
        ``host`` (a CPU ``uint8`` tensor of the storage's size from :attr:`buffers`
        ``.take``): the migration engine hands its off-device tensors back this way
        (``MigrationEngine.hand_back``).

        Raises:
            ValueError: ``storage`` still holds bytes, or the pager already tracks it.
        """
        if storage.nbytes() != 0:
            raise ValueError(f"adopt_evicted: the storage still holds {storage.nbytes()} B; free it first")
        self._drain_dead()
        if self._page(storage) is not None:
            raise ValueError("adopt_evicted: the pager already tracks this storage")
        key = storage_id(storage)
        dead = self._dead
        page = _Page(key, weakref.ref(storage, lambda _, dead=dead: dead.append(page)), host.numel())
        page.host = host
        self._away[key] = page
        self.evicted_bytes += page.nbytes
        self._note_host()

    def _note_host(self) -> None:
        self.stats.max_host_bytes = max(self.stats.max_host_bytes, self.buffers.held_bytes)

    # ---- bookkeeping --------------------------------------------------------------
    def _on_device(self, storage: torch.UntypedStorage) -> bool:
        d = storage.device
        return d.type == self.device.type and (d.index is None or self.device.index is None
                                               or d.index == self.device.index)

    def _drain_dead(self) -> None:
        while self._dead:
            self._untrack(self._dead.pop())

    def _untrack(self, page: _Page) -> None:
        for where in (self._lru, self._pinned, self._away):
            if where.get(page.key) is page:
                del where[page.key]
                if where is self._away:
                    self.evicted_bytes -= page.nbytes
                else:
                    self.resident_bytes -= page.nbytes
        self._drop_host(page)

    def _drop_host(self, page: _Page) -> None:
        if page.host is not None:
            self.buffers.give(page.host)
            page.host = None

    def _page(self, storage: torch.UntypedStorage) -> _Page | None:
        key = storage_id(storage)
        for where in (self._lru, self._away, self._pinned):
            page = where.get(key)
            if page is not None and page.ref() is storage:
                return page
        return None

    def _track(self, storage: torch.UntypedStorage) -> _Page | None:
        """The page of ``storage``, tracked from now on as resident if new."""
        if not self._on_device(storage):
            return None
        self._drain_dead()
        page = self._page(storage)
        if page is not None:
            return page
        key = storage_id(storage)
        stale = self._lru.get(key) or self._pinned.get(key) or self._away.get(key)
        if stale is not None:  # its storage died and the address was reused before the callback ran
            self._untrack(stale)
        dead = self._dead
        page = _Page(key, weakref.ref(storage, lambda _, dead=dead: dead.append(page)), storage.nbytes())
        (self._pinned if page.nbytes < self.min_evict_bytes else self._lru)[key] = page
        self.resident_bytes += page.nbytes
        return page

    def _note_accounted(self) -> None:
        if self.resident_bytes > self.stats.max_accounted_bytes:
            self.stats.max_accounted_bytes = self.resident_bytes

    def nbytes(self, storage: torch.UntypedStorage) -> int:
        """``storage``'s size, also while it is evicted (its ``nbytes()`` is 0 then)."""
        page = self._page(storage)
        return page.nbytes if page is not None else storage.nbytes()

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """True if ``storage`` is evicted and its bytes are in the pager's host copy."""
        page = self._page(storage)
        return page is not None and page.host is not None

    def host_copy(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """The host copy (CPU ``uint8`` ``[nbytes]``) of an evicted ``storage``, complete
        (the device is synchronised first). Valid until :meth:`forget` or :meth:`close`."""
        page = self._page(storage)
        if page is None or page.host is None:
            raise ValueError("the pager holds no copy of this storage")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return page.host

    def hand_over(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """The host copy of an evicted ``storage``, complete, now owned by the caller (on
        CUDA with its page lock): the pager stops tracking ``storage`` and keeps no buffer
        for it, so the bytes are not held twice."""
        host = self.host_copy(storage)
        page = self._page(storage)
        page.host = None
        self.buffers.disown(host)
        self._untrack(page)
        return host

    def forget(self, storage: torch.UntypedStorage) -> None:
        """Stop tracking ``storage`` (and drop its host copy, if evicted): another owner,
        the migration engine, takes it over as it is."""
        page = self._page(storage)
        if page is not None:
            self._untrack(page)

    # ---- moving bytes -------------------------------------------------------------
    def _used(self) -> int:
        if self.device.type == "cuda":
            return max(self.resident_bytes, torch.cuda.memory_allocated(self.device))
        return self.resident_bytes

    def _evict(self, page: _Page) -> bool:
        storage = page.ref()
        if storage is None:
            return False
        with _disable_current_modes():
            host = self.buffers.take(page.nbytes)
            # Stream-ordered: the block freed next is reused only by work queued after the copy.
            host.copy_(byte_view(storage), non_blocking=self.buffers.pinned)
            storage.resize_(0)
        page.host = host
        del self._lru[page.key]
        self._away[page.key] = page
        self.resident_bytes -= page.nbytes
        self.evicted_bytes += page.nbytes
        self.stats.evictions += 1
        self.stats.bytes_evicted += page.nbytes
        self._note_host()
        return True

    def _restore(self, page: _Page, storage: torch.UntypedStorage) -> None:
        with _disable_current_modes():
            storage.resize_(page.nbytes)
            byte_view(storage).copy_(page.host, non_blocking=self.buffers.pinned)
        self._drop_host(page)
        del self._away[page.key]
        (self._pinned if page.nbytes < self.min_evict_bytes else self._lru)[page.key] = page
        self.resident_bytes += page.nbytes
        self.evicted_bytes -= page.nbytes
        self.stats.restores += 1
        self.stats.bytes_restored += page.nbytes

    def make_room(self, extra_bytes: int, protect: set[int] = frozenset(), strict: bool = True) -> None:
        """Evict least recently used storages (never one in ``protect``, by storage id)
        until the bytes in use plus ``extra_bytes`` are within the limit.

        Raises:
            CapacityError: with ``strict``, nothing evictable is left and the accounted
                bytes plus ``extra_bytes`` are still above the limit.
        """
        self._drain_dead()
        if self._used() + extra_bytes <= self.limit_bytes:
            return
        skipped = []
        while self._used() + extra_bytes > self.limit_bytes and self._lru:
            key, page = next(iter(self._lru.items()))
            if key in protect:
                skipped.append(self._lru.pop(key))
            elif not self._evict(page):  # died since the last op: its callback has queued it
                self._drain_dead()
                self._lru.pop(key, None)
        for page in reversed(skipped):  # back to the front, in their old order
            self._lru[page.key] = page
            self._lru.move_to_end(page.key, last=False)
        if strict and self.resident_bytes + extra_bytes > self.limit_bytes:
            raise CapacityError(
                f"an op needs {self.resident_bytes + extra_bytes} B resident (its inputs, its new outputs "
                f"and what cannot be evicted) but the capacity allows {self.limit_bytes} B")

    def restore(self, storage: torch.UntypedStorage) -> None:
        """Bring ``storage`` back if the pager holds it (no capacity check)."""
        page = self._page(storage)
        if page is not None and page.host is not None:
            self._restore(page, storage)

    def restore_all(self) -> None:
        """Bring every evicted storage back (no capacity check: the caller knows they fit)."""
        self._drain_dead()
        for page in list(self._away.values()):
            storage = page.ref()
            if storage is not None:
                self._restore(page, storage)
        self._drain_dead()

    def close(self) -> None:
        """Restore what is still evicted, stop tracking and release the host buffers.
        Idempotent."""
        self.restore_all()
        self._lru.clear()
        self._pinned.clear()
        self.resident_bytes = self.evicted_bytes = 0
        self.buffers.close()

    # ---- per op ---------------------------------------------------------------------
    def admit(self, func, args: tuple, kwargs: dict | None) -> set[int]:
        """Before ``func`` runs: track and restore what it touches, and make room for its
        inputs and fresh outputs. Returns the storage ids of its inputs (all devices)."""
        self._drain_dead()
        in_keys: set[int] = set()
        back: list[tuple[_Page, torch.UntypedStorage]] = []
        for t in iter_tensors(args, kwargs):
            storage = t.untyped_storage()
            key = storage_id(storage)
            if key in in_keys:
                continue
            in_keys.add(key)
            page = self._track(storage)
            if page is None:
                continue
            if page.host is not None:
                back.append((page, storage))
            elif page.key in self._lru:
                self._lru.move_to_end(page.key)
        extra = sum(p.nbytes for p, _ in back)
        key = (func, _signature(args), _signature(kwargs or {}))
        out_bytes = self._output_bytes.get(key, -1)
        if out_bytes == -1:
            out_bytes = self._output_bytes[key] = fresh_output_bytes(func, args, kwargs)
        extra += self.unknown_output_bytes if out_bytes is None else out_bytes
        self.make_room(extra, protect=in_keys)
        for page, storage in back:
            self._restore(page, storage)
        return in_keys

    def settle(self, out, in_keys: set[int]) -> None:
        """After the op: track its fresh outputs as resident, most recently used."""
        for t in fresh_outputs(out, in_keys):
            self._track(t.untyped_storage())
        self._note_accounted()

    def run(self, op: Callable[[], object], in_keys: set[int]):
        """``op()``, the admitted op. An out-of-memory error (workspaces, fragmentation, or
        what an op allocates inside beyond its outputs, as ``aten._safe_softmax`` holds its
        scores, the softmax and a mask beside its result) evicts more and retries, asking for
        twice the free bytes each time (from ``max(limit / 16, 1 GiB)``), until nothing but the
        op's inputs is left to evict; an op fails at allocation, before it writes anything.

        Raises:
            torch.OutOfMemoryError: the op does not fit with every other storage evicted.
        """
        want = max(self.limit_bytes // 16, 1 << 30)
        while True:
            try:
                return op()
            except torch.OutOfMemoryError:
                if not any(k not in in_keys for k in self._lru):
                    raise
                self.stats.oom_retries += 1
                self.make_room(want, protect=in_keys, strict=False)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                want *= 2

    def call(self, func, args: tuple, kwargs: dict | None):
        """One op under the pager: :meth:`admit`, :meth:`run`, :meth:`settle`."""
        in_keys = self.admit(func, args, kwargs)
        out = self.run(lambda: func(*args, **(kwargs or {})), in_keys)
        self.settle(out, in_keys)
        return out


class PagedStep(TorchDispatchMode):
    """Runs ops under a :class:`Pager` without recording anything (the step before the
    profiled one)."""

    def __init__(self, pager: Pager):
        super().__init__()
        self.pager = pager

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.pager.call(func, args, kwargs)
