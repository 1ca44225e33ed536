"""The host tier (paper §3.2-3.3): page-locked host memory under a cap, in slots shared by
tensors whose periods never overlap or as one region of byte offsets, copied on side
streams. The contract it keeps is ``teraio.core.tiers.base.Tier``'s.
"""
from __future__ import annotations

import weakref

import torch

from teraio.core.slots import HOST_ALIGN, align_up
from teraio.core.tiers.base import Tier, Transfer, byte_view
from teraio.core.tiers.pinned import page_unlock, pinned_empty


class HostTier(Tier):
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
    overlap on the PCIe link), completion tracked by CUDA events, each copy timed on its
    stream (``Transfer.copy_seconds``). On a CPU device copies
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

    label = "host tier"

    def __init__(self, cap_bytes: int, slots: dict[str, int], device, shares: dict[str, str] | None = None,
                 offsets: dict[str, int] | None = None, chunk_bytes: int = 1 << 30):
        super().__init__(slots, shares if offsets is None else None)  # region: every name its own key
        self._device = torch.device(device)
        self._range: dict[str, tuple[int, int]] | None = None  # per name, in region mode
        if offsets is None:
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
        self._closed = weakref.finalize(self, _release, self._buffers, self._slot_buffers)
        if self._device.type == "cuda":
            self._d2h = torch.cuda.Stream(self._device)
            self._h2d = torch.cuda.Stream(self._device)
        self._last: dict[str, torch.cuda.Event] = {}  # last transfer per slot (CUDA)

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

    def _written(self, name: str):
        """The slots that hold ``name`` once it is written: its own, or in the region every
        name whose range meets its own."""
        return self._meets[name] if self._range is not None else (self._key[name],)

    def _start(self, kind: str, name: str, storage: torch.UntypedStorage, nbytes: int) -> Transfer:
        """Copy on a side stream (one per direction) after the current stream's queued ops
        and the slot's previous copy; synchronously on a CPU device."""
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
        started, event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            started.record(stream)  # after the waits above: where the copy itself begins
            for host, lo, hi in pieces:
                (host.copy_(view[lo:hi], non_blocking=True) if kind == "write"
                 else view[lo:hi].copy_(host, non_blocking=True))
            event.record(stream)
        # The caching allocator keeps the memory until the copy ran, so the transfer need not
        # hold the storage: a tensor past its last use is freed when its owner lets it go,
        # not when a thread gets round to waiting on the copy.
        view.record_stream(stream)
        self._last[key] = event
        return Transfer(name, "host pool", what, nbytes, event=event, started=started)

    def _drain(self) -> None:
        """Finish the copies in flight (the buffers are then unpinned and freed)."""
        if self._device.type == "cuda":
            self._d2h.synchronize()
            self._h2d.synchronize()
        self._last.clear()


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


def _release(registered: dict, buffers: dict) -> None:
    """Unlock the page-locked buffers, then let go of all of them."""
    for buf in registered.values():
        page_unlock(buf)
    registered.clear()
    buffers.clear()
