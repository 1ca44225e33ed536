"""The contract of the offload tiers the migration engine moves tensor storages to (paper
§3.3, Fig. 4): :class:`Tier`, the base of the SSD tier (``teraio.core.tiers.ssd.SSDTier``) and
the host tier of page-locked memory (``teraio.core.tiers.host.HostTier``), in the style of
DeepSpeed's swapper base and its subclasses, and the :class:`Transfer` futures they return.

Both tiers work on whole ``torch.UntypedStorage`` objects, byte for byte: the engine
offloads a storage, frees it with ``storage.resize_(0)``, later re-allocates it with
``storage.resize_(nbytes)`` and reads the bytes back (as FSDP does), so every tensor
viewing that storage (non-contiguous views, several tensors sharing one storage) is
restored bit-exactly. Every tensor name gets a fixed slot of known size up front (from
the migration plan), its own or shared with tensors whose periods never overlap its
(``shares``, ``teraio.core.slots``), so no tier allocates after construction.

Bytes are moved through a fresh ``uint8`` tensor ``set_`` on the storage (:func:`byte_view`):
writing through it bumps only that tensor's autograd version counter, never the counter of
a tensor saved for backward (``h.detach().copy_()`` would, and backward then fails with
"modified by an inplace operation").

Transfers are futures in the kvikio style (:class:`Transfer`: ``done()``, ``wait()``).
Transfers of the same slot run in the order they were issued (a read issued after a
write returns the written bytes; a write to a shared slot waits for the read of the
tensor before it); transfers of different slots may overlap.
"""
from __future__ import annotations

import abc
import concurrent.futures
import weakref

import torch


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
                 event: torch.cuda.Event | None = None, started: torch.cuda.Event | None = None):
        self.name, self.path, self.nbytes = name, path, nbytes
        self._what = what
        self._future, self._event, self._started = future, event, started

    def copy_seconds(self) -> float | None:
        """Seconds the copy ran on its stream, from a timing event recorded on that stream
        where the copy begins (``started``) to ``event``, where it ends: the link's own time,
        without the wait for the work queued before it. None without both events (an SSD
        transfer, a CPU copy). Call it after :meth:`wait`."""
        if self._started is None or self._event is None:
            return None
        return self._started.elapsed_time(self._event) / 1e3

    def copy_start_after(self, origin: torch.cuda.Event | None) -> float | None:
        """Seconds from ``origin`` (a timing event recorded earlier on the same device, e.g.
        at the start of a step) to where the copy began on its stream; None without
        ``origin`` or a timed copy. Call it after :meth:`wait`."""
        if self._started is None or origin is None:
            return None
        return origin.elapsed_time(self._started) / 1e3

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


class Tier(abc.ABC):
    """A tier of fixed slots that tensor storages are copied to and back, whole (module
    docstring). The base holds the slots and which tensor each slot holds, and makes the
    checks every transfer opens with; a subclass moves the bytes.

    A subclass sets :attr:`label` (it opens every message), sets ``_closed`` in its
    constructor (a ``weakref.finalize`` that releases what the tier holds, so its files and
    page-locked memory go even if :meth:`close` is never called), and implements
    :meth:`_start` and :meth:`_drain`.

    Args:
        slots: tensor name -> storage size in bytes, from the migration plan.
        shares: tensor name -> the name whose slot it uses instead of its own (from
            ``MigrationPlan.shared_slots``: tensors whose periods never overlap); a write
            to a shared slot waits for the slot's previous transfer.

    Raises:
        ValueError: a slot that is not a str name with an int byte count >= 0; a ``shares``
            entry whose name or owner is no slot, whose owner shares another's, or whose
            tensor is larger than its owner's slot.
    """

    label = "tier"
    _closed: weakref.finalize

    def __init__(self, slots: dict[str, int], shares: dict[str, str] | None = None):
        _check_slots(slots)
        self._slots = dict(slots)
        self._key = _slot_keys(slots, shares)  # name -> the slot it uses
        self._holder: dict[str, str] = {}  # slot -> the name last written there

    def write(self, name: str, storage: torch.UntypedStorage) -> Transfer:
        """Launch the copy of all bytes of ``storage`` into ``name``'s slot, after the ops
        queued so far on the current CUDA stream (the bytes are those after the producing
        op). ``storage`` must not be freed or changed until the transfer is done. The slot
        holds ``name`` from then on.

        Raises:
            RuntimeError: the tier is closed.
            ValueError: ``name`` has no slot, or ``storage`` is not its slot's size.
        """
        nbytes = self._opening("write", name, storage)
        transfer = self._start("write", name, storage, nbytes)
        for key in self._written(name):
            self._holder[key] = name
        return transfer

    def read(self, name: str, storage: torch.UntypedStorage) -> Transfer:
        """Launch the copy of ``name``'s slot into ``storage`` (already ``resize_``-d to its
        slot size), after the ops queued so far on the current CUDA stream (the memory may
        have just been reused by the caching allocator).

        Raises:
            ValueError: ``name`` was never written to this tier, or another tensor was
                written to its slot since; ``name`` has no slot, or ``storage`` is not its
                slot's size.
            RuntimeError: the tier is closed.
        """
        if name in self._slots:
            holder = self._holder.get(self._key[name])
            if holder is None:
                raise ValueError(f"{self.label}: tensor {name!r} was never written, nothing to read")
            if holder != name:
                raise ValueError(f"{self.label}: slot {self._key[name]!r} now holds {holder!r}, written after "
                                 f"{name!r}: the plan shares it between overlapping periods")
        nbytes = self._opening("read", name, storage)
        return self._start("read", name, storage, nbytes)

    def _opening(self, kind: str, name: str, storage: torch.UntypedStorage) -> int:
        """The checks every transfer opens with; returns ``name``'s slot size in bytes."""
        if not self._closed.alive:
            raise RuntimeError(f"{self.label} is closed; cannot {kind} {name!r}")
        if name not in self._slots:
            raise ValueError(f"{self.label}: tensor {name!r} has no slot (known: {len(self._slots)} names "
                             "from the plan)")
        nbytes = self._slots[name]
        if storage.nbytes() != nbytes:
            raise ValueError(f"{self.label}: storage of {name!r} has {storage.nbytes()} bytes, its slot "
                             f"{nbytes}; restore with storage.resize_({nbytes}) before reading")
        return nbytes

    def _written(self, name: str):
        """The slots that hold ``name`` once it is written: its own."""
        return (self._key[name],)

    @abc.abstractmethod
    def _start(self, kind: str, name: str, storage: torch.UntypedStorage, nbytes: int) -> Transfer:
        """Launch the ``kind`` (``"write"`` or ``"read"``) of ``name``'s ``nbytes`` bytes, its
        checks passed."""

    @abc.abstractmethod
    def _drain(self) -> None:
        """Wait for the transfers in flight."""

    def close(self) -> None:
        """Wait for in-flight transfers, then release what the tier holds (files, buffers).
        Idempotent."""
        if self._closed.alive:
            self._drain()
            self._closed()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
