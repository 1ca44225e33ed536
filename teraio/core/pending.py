"""Device memory freed while an offload's copy still reads it (``device_waits``).

With ``device_waits`` the engine frees a host-tier offload's storage as soon as the op after
which it leaves is issued (``teraio.core.engine``): the caching allocator keeps those bytes
until the copy has run on the GPU (``record_stream``), and the host issues ops well ahead of the
GPU, so the allocator holds gigabytes the plan counts as gone (on an H100 at ``fig7_h200``'s
Llama3-8B cut: the GPU 0.32-0.35 s behind the host, and at two thirds of the allocator's cache
releases up to 8.8-9.5 GB of offloads still to copy, ``runs/reference/h100/allocator_settings/``). A
request that finds no room then makes the allocator wait for every stream and release all its
unused memory: a device sync and the remapping of its cache.

:class:`PendingFrees` keeps those storages' copies in the order they were freed and, given a
limit, holds the plan's live bytes plus the bytes still to copy under it: before an op that
would pass it, the host waits for the copies freed first until it does not. That wait is for
one copy on the host link, while the GPU goes on with the work queued before it. Gradients
sent to the host for a host update (``teraio.core.host_update``) are freed the same way and
not counted here.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Protocol


class _Copy(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> int: ...


class PendingFrees:
    """The freed storages whose offload copies may still be running, oldest first.

    Args:
        limit_bytes: the bytes the plan's live bytes and the pending ones may take together
            (the device capacity the allocator is held to); None: never wait, only count.

    Raises:
        ValueError: a negative ``limit_bytes``.
    """

    def __init__(self, limit_bytes: int | None):
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"limit_bytes={limit_bytes}: give bytes >= 0, or None for no limit")
        self.limit_bytes = limit_bytes
        self._queue: deque[tuple[_Copy, int]] = deque()
        self.bytes = 0
        """Bytes freed whose copies were not seen done (as of the last :meth:`add` or
        :meth:`settle`)."""

    def add(self, copy: _Copy, nbytes: int) -> None:
        """A storage of ``nbytes`` freed while ``copy`` (its offload: ``done()``, ``wait()``,
        as ``teraio.core.tiers.base.Transfer``) may still read it."""
        self._queue.append((copy, nbytes))
        self.bytes += nbytes

    def settle(self, live_bytes: int) -> tuple[int, float]:
        """Before an op the plan has ``live_bytes`` live in: drop the copies that are done
        and, where a limit is set and ``live_bytes`` plus the pending bytes pass it, wait for
        the one freed first, drop those done by then, and so on until they fit (or none is
        left). Returns (copies waited for, seconds waited)."""
        self._drop_done()
        waited, t0 = 0, time.perf_counter()
        while self._queue and self.limit_bytes is not None and live_bytes + self.bytes > self.limit_bytes:
            copy, nbytes = self._queue.popleft()
            copy.wait()
            self.bytes -= nbytes
            waited += 1
            self._drop_done()
        return waited, (time.perf_counter() - t0) if waited else 0.0

    def _drop_done(self) -> None:
        """Drop every copy seen done, wherever it is in the queue: copies finish in the
        order they were issued, which need not be the order their storages were freed."""
        if any(copy.done() for copy, _ in self._queue):
            kept = [(copy, n) for copy, n in self._queue if not copy.done()]
            self.bytes = sum(n for _, n in kept)
            self._queue = deque(kept)
