"""An emulated device capacity that also binds on the CPU: a smaller GPU for the question
"does this still fit?", asked the same way on a GPU and in CPU tests.

On CUDA it is the device held to the capacity (``teraio.systems.memory_cap``, the way
``hardware.capacity_mode`` says: past it ``torch.OutOfMemoryError`` as on a smaller GPU). On
the CPU, where no allocator can be capped, a ``TorchDispatchMode`` counts the bytes of the live storages on the device that the ops
under it allocate (each counted from the op that made it until it is freed, a weak reference
telling when), plus those of the tensors handed to :meth:`EmulatedCapacity.track`, and raises
``torch.OutOfMemoryError`` from the op that takes the count past the capacity.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from teraio.core.profiler import fresh_outputs, iter_tensors, storage_key
from teraio.systems.memory_cap import MemoryCap, apply_memory_cap


class _LiveBytes(TorchDispatchMode):
    """Counts live storages on ``device`` allocated under it; raises past ``limit_bytes``."""

    def __init__(self, limit_bytes: int, device: torch.device):
        super().__init__()
        self.limit_bytes, self.device = int(limit_bytes), device
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.live_bytes = self.peak_bytes = 0

    def track(self, tensors) -> None:
        for t in tensors:
            self._count(t.untyped_storage())

    def _count(self, s: torch.UntypedStorage) -> None:
        if s.device.type != self.device.type:
            return
        key = s._cdata
        old = self.live.get(key)
        if old is not None and old[0]() is s:
            return
        n = s.nbytes()

        def dead(_, key=key, n=n):
            # only the entry this reference made: the key may be reused by a later storage
            if self.live.get(key, (None,))[0] is ref:
                del self.live[key]
                self.live_bytes -= n

        ref = weakref.ref(s, dead)
        self.live[key] = (ref, n)
        self.live_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        in_keys = {storage_key(t) for t in iter_tensors(args, kwargs)}
        for t in fresh_outputs(out, in_keys):
            self._count(t.untyped_storage())
        if self.live_bytes > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"out of memory (emulated capacity of {self.limit_bytes} bytes on {self.device}): "
                f"{func} took the live storages to {self.live_bytes} bytes")
        return out


class EmulatedCapacity:
    """``with EmulatedCapacity(capacity_bytes, device, mode) as cap:`` — the device holds at
    most ``capacity_bytes`` bytes inside the block (module docstring), on CUDA held the
    ``mode`` way (``hardware.capacity_mode``); None: no cap, nothing done. On the CPU,
    tensors made before the block count once passed to :meth:`track`; :attr:`peak_bytes` is then the largest count seen (bytes; None on CUDA or uncapped).

    Raises:
        ValueError: a capacity that is not positive, or above a GPU's total memory.
    """

    def __init__(self, capacity_bytes: int | None, device: torch.device, mode: str):
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}; must be > 0 (bytes) or null")
        self.capacity_bytes, self.device, self.cap_mode = capacity_bytes, torch.device(device), mode
        self._mode: _LiveBytes | None = None
        self._cap: MemoryCap | None = None

    def __enter__(self) -> "EmulatedCapacity":
        if self.capacity_bytes is None:
            return self
        if self.device.type == "cuda":
            self._cap = apply_memory_cap(self.capacity_bytes, self.device, self.cap_mode)
        else:
            self._mode = _LiveBytes(self.capacity_bytes, self.device)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.capacity_bytes is None:
            return
        if self._mode is not None:
            self._mode.__exit__(*exc)
        elif self._cap is not None:
            self._cap.lift()

    def track(self, tensors) -> None:
        """Count ``tensors`` (made before the block) against the capacity (CPU)."""
        if self._mode is not None:
            self._mode.track(tensors)

    @property
    def peak_bytes(self) -> int | None:
        return self._mode.peak_bytes if self._mode is not None else None
