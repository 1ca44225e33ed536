"""Lifetime-aware slot sharing in the offload tiers (paper §3.2: the planner tracks the
host memory its migrations use over the iteration, up to the user's cap).

A tier *slot* holds a tensor's bytes while it is off the GPU. A migration of inactive
period ``[a, b)`` (op indices, cyclic: last use ``a``, next use ``b``) writes the slot after
op ``a`` and the engine waits for the read back before op ``b``. Two tensors whose periods
never overlap (as half-open intervals) can therefore use the same slot: the later write is
queued after op ``a2 >= b1``, which runs after the earlier read completed. Within one
micro-batch's forward and backward an activation is offloaded and read back; the next
micro-batch's copy of it, a distinct tensor, can reuse the slot.

A *bin* is one slot: its *owner* is the first tensor placed in it and sets its size; a
later tensor joins a bin at least its size (the smallest such, best fit) when none of
its periods meets a period already held there, else opens a new bin if the cap allows.
A placed tensor reserves *all* its candidate periods in its bin at once, so its later
periods always find its slot free (a tensor has one slot per tier, as the tiers address
slots by tensor name). The bytes a tier needs are the sum of its bin sizes
(:attr:`SlotBins.held_bytes`): at most the plan's old sum of one slot per tensor, at least
the most bytes ever off the GPU at once on that tier.
"""
from __future__ import annotations

import numpy as np

HOST_ALIGN = 64  # bytes: the host tier rounds each slot up to a cache line (the CPU allocator's alignment)


def align_up(n, a: int):
    """``n`` (an int or an int array) rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


class SlotBins:
    """The bins of one tier while a plan is built.

    Args:
        n_ops: ops per iteration.
        tid, a, b: the candidate periods as arrays ``[n_periods]``: tensor id, last use
            ``a`` in ``[0, n_ops)``, next use ``b`` unrolled (``a < b <= a + n_ops``), as
            ``teraio.core.planner.Periods`` holds them.
        cap_bytes: most bytes the bins may hold in all (None: no cap).
        align: each bin's bytes are rounded up to this (the host tier's 64 B).
    """

    def __init__(self, n_ops: int, tid: np.ndarray, a: np.ndarray, b: np.ndarray,
                 cap_bytes: int | None = None, align: int = 1):
        if cap_bytes is not None and cap_bytes < 0:
            raise ValueError(f"cap_bytes={cap_bytes!r}; must be >= 0 or None")
        self.n = n_ops
        self.cap = cap_bytes
        self.align = align
        self._a, self._b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        # Tensor ids compacted to 0..T-1, so that per-tensor sums are one bincount.
        self._tids, self._tix = np.unique(np.asarray(tid, np.int64), return_inverse=True)
        self._tix = self._tix.reshape(-1)
        self.held_bytes = 0
        self.size: list[int] = []             # per bin, aligned bytes
        self.owner: list[int] = []            # per bin, the owner's tensor id
        self._occ: list[np.ndarray] = []      # per bin, bool [n]: ops of periods held there
        self._busy = np.zeros((0, len(self._tids)), dtype=bool)  # [bins, tensors]: a period meets the bin's
        self.bin_of: dict[int, int] = {}      # tensor id -> bin

    def _mask(self, periods: np.ndarray) -> np.ndarray:
        occ = np.zeros(self.n, dtype=bool)
        for lo, hi in zip(self._a[periods], self._b[periods]):
            occ[lo:min(hi, self.n)] = True
            if hi > self.n:
                occ[:hi - self.n] = True
        return occ

    def _busy_row(self, occ: np.ndarray) -> np.ndarray:
        """bool per tensor: one of its periods meets an op of ``occ``."""
        prefix = np.concatenate([[0], np.cumsum(np.concatenate([occ, occ]), dtype=np.int64)])
        hits = prefix[self._b] - prefix[self._a]
        return np.bincount(self._tix, weights=hits, minlength=len(self._tids)) > 0

    def room(self, tid: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """bool per candidate (tensor ids ``tid``, sizes ``nbytes``): its tensor has a bin
        here already, fits a free bin, or a new bin of its size fits under the cap."""
        tid, nbytes = np.asarray(tid, np.int64), np.asarray(nbytes, np.int64)
        if self.cap is None:
            return np.ones(len(tid), dtype=bool)
        placed = np.fromiter(self.bin_of, dtype=np.int64, count=len(self.bin_of))
        ok = np.isin(tid, placed) | (self.held_bytes + align_up(nbytes, self.align) <= self.cap)
        if self.size:
            col = np.searchsorted(self._tids, tid)
            fits = (np.asarray(self.size)[:, None] >= nbytes[None, :]) & ~self._busy[:, col]
            ok |= fits.any(axis=0)
        return ok

    def place(self, tid: int, nbytes: int) -> int:
        """Put tensor ``tid`` (``nbytes``) in a bin, reserving all its periods there, and
        return the bin's owner's tensor id (``tid`` itself for a new bin).

        Raises:
            ValueError: no bin fits and a new one would exceed the cap (``room`` said no).
        """
        tid = int(tid)
        if tid in self.bin_of:
            return self.owner[self.bin_of[tid]]
        col = int(np.searchsorted(self._tids, tid))
        if col >= len(self._tids) or self._tids[col] != tid:
            raise ValueError(f"tensor {tid} has no candidate period")
        free = [j for j, s in enumerate(self.size) if s >= nbytes and not self._busy[j, col]]
        occ = self._mask(np.flatnonzero(self._tix == col))
        if free:
            j = min(free, key=lambda j: (self.size[j], j))
            self._occ[j] |= occ
            self._busy[j] = self._busy_row(self._occ[j])
        else:
            size = align_up(int(nbytes), self.align)
            if self.cap is not None and self.held_bytes + size > self.cap:
                raise ValueError(f"no bin of >= {nbytes} B is free over tensor {tid}'s periods and a new "
                                 f"one would hold {self.held_bytes + size} B, above the cap of {self.cap} B")
            j = len(self.size)
            self.size.append(size)
            self.owner.append(tid)
            self._occ.append(occ)
            self._busy = np.vstack([self._busy, self._busy_row(occ)[None, :]])
            self.held_bytes += size
        self.bin_of[tid] = j
        return self.owner[j]
