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

_BLOCK = 1 << 21  # HostArena.offsets: candidate × placed-range pairs per block
HOST_ALIGN = 64  # bytes: the host tier rounds each slot up to a cache line (the CPU allocator's alignment)
FILE_ALIGN = 4096  # bytes: GDS needs 4 KiB-aligned file offsets (kvikio CuFile.pwrite notes)
SSD_STRIPE = 8 << 20  # bytes: the SSD tier's stripe (teraio.core.tiers.ssd.SSDTier's default)


def align_up(n, a: int):
    """``n`` (an int or an int array) rounded up to a multiple of ``a`` (> 0); for a power
    of two, by clearing the low bits (the same numbers, fewer and cheaper array operations)."""
    if a & (a - 1) == 0:
        return (n + (a - 1)) & -a
    return (n + a - 1) // a * a


def periods_meet(a, b, lo, hi, n: int):
    """Whether unrolled periods ``[a, b)`` and ``[lo, hi)`` of an ``n``-op cycle share an op
    (either side scalars or arrays that broadcast), for starts ``0 <= a <= n`` and ends
    ``a < b <= a + n`` (likewise ``lo``, ``hi``): the periods :class:`SlotBins` takes, and
    the planner's ops ``[a + 1, b)`` of a period. Of the three shifts of one period against
    the other, the one by ``-n`` needs only ``a < hi - n`` and the one by ``+n`` only
    ``lo + n < b``: their other halves always hold there."""
    return ((a < hi) & (lo < b)) | (a < hi - n) | (lo + n < b)


def ssd_file_bytes(nbytes, stripe: int = SSD_STRIPE):
    """Bytes the SSD tier's files take for a slot of ``nbytes`` (an int or an int array):
    one 4 KiB-aligned stripe when it fits one, else whole stripes
    (``teraio.core.tiers.ssd.SSDTier``'s layout, over any number of drives)."""
    if isinstance(nbytes, int):  # the same rule in Python's ints, without arrays
        return align_up(nbytes, stripe if nbytes > stripe else FILE_ALIGN)
    n = np.asarray(nbytes, np.int64)
    out = np.where(n > stripe, align_up(n, stripe), align_up(n, FILE_ALIGN))
    return int(out) if out.ndim == 0 else out


class SlotBins:
    """The bins of one tier while a plan is built.

    Args:
        n_ops: ops per iteration.
        tid, a, b: the candidate periods as arrays ``[n_periods]``: tensor id, last use
            ``a`` in ``[0, n_ops)``, next use ``b`` unrolled (``a < b <= a + n_ops``), as
            ``teraio.core.planner.Periods`` holds them.
        cap_bytes: most bytes the bins may take in the tier in all (None: no cap).
        align: each bin's bytes are rounded up to this (the host tier's 64 B).
        footprint: bytes a bin of ``nbytes`` takes in the tier, for the cap (vectorized over
            an int array; default: its aligned size). The SSD tier's is
            :func:`ssd_file_bytes`: its files hold whole stripes.
        meets: per tensor id, the tensors one of whose periods meets one of its own, bool
            ``[tensors]`` (in the order of ``np.unique(tid)``); a dict that bins over the same
            periods may share, filled as tensors are placed.

    Attributes:
        held_bytes: the sum of the bins' (aligned) sizes.
        tier_bytes: the sum of their footprints, what the cap bounds.
    """

    def __init__(self, n_ops: int, tid: np.ndarray, a: np.ndarray, b: np.ndarray,
                 cap_bytes: int | None = None, align: int = 1, footprint=None, meets: dict | None = None):
        if cap_bytes is not None and cap_bytes < 0:
            raise ValueError(f"cap_bytes={cap_bytes!r}; must be >= 0 or None")
        self.n = n_ops
        self.cap = cap_bytes
        self.align = align
        self.footprint = footprint or (lambda nbytes: align_up(nbytes, align))
        self.tier_bytes = 0
        self._a, self._b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        # Tensor ids compacted to 0..T-1, so that per-tensor sums are one bincount.
        self._tids, self._tix = np.unique(np.asarray(tid, np.int64), return_inverse=True)
        self._tix = self._tix.reshape(-1)
        T = len(self._tids)
        self.held_bytes = 0
        self.size: list[int] = []             # per bin, aligned bytes
        self.owner: list[int] = []            # per bin, the owner's tensor id
        # [bins, tensors]: a period of the tensor meets the bin's; rows beyond len(size) are
        # spare (the array grows by doubling)
        self._busy = np.zeros((8, T), dtype=bool)
        self._sizes = np.zeros(8, dtype=np.int64)  # self.size as an array, same spare rows
        self._placed = np.zeros(T, dtype=bool)     # per tensor: it has a bin
        # per tensor: the largest bin none of whose periods meets the tensor's, -1 if none
        # (bins only get busier, so it only falls), from per tensor and bin size the number
        # of such bins (kept with a cap only: room asks for it)
        self._free_max = np.full(T, -1, dtype=np.int64)
        self._free_count = np.zeros((T, 0), dtype=np.int64)
        self._size_col: dict[int, int] = {}   # bin size -> its column of _free_count
        self.bin_of: dict[int, int] = {}      # tensor id -> bin
        self._meets = {} if meets is None else meets

    def _busy_row(self, periods: np.ndarray) -> np.ndarray:
        """bool per tensor: one of its periods shares an op with one of ``periods``
        (cyclic)."""
        lo, hi = self._a[periods, None], self._b[periods, None]
        a, b, n = self._a, self._b, self.n
        meet = periods_meet(a, b, lo, hi, n).any(axis=0)
        row = np.zeros(len(self._tids), dtype=bool)
        row[self._tix[meet]] = True
        return row

    def room(self, tid: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """bool per candidate (tensor ids ``tid``, sizes ``nbytes``): its tensor has a bin
        here already, fits a free bin, or a new bin of its size fits under the cap."""
        tid, nbytes = np.asarray(tid, np.int64), np.asarray(nbytes, np.int64)
        if self.cap is None:
            return np.ones(len(tid), dtype=bool)
        ok = self.tier_bytes + self.footprint(nbytes) <= self.cap
        if not len(self._tids):
            return ok
        col = np.minimum(np.searchsorted(self._tids, tid), len(self._tids) - 1)
        known = self._tids[col] == tid
        return ok | (known & (self._placed[col] | (self._free_max[col] >= nbytes)))

    def room_of_periods(self, periods: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """:meth:`room` for the tensors of candidate periods ``periods`` (indices into the
        periods this was made with)."""
        if self.cap is None:
            return np.ones(len(periods), dtype=bool)
        col = self._tix[periods]
        ok = self.tier_bytes + self.footprint(nbytes) <= self.cap
        return ok | self._placed[col] | (self._free_max[col] >= nbytes)

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
        k = len(self.size)
        free = ((self._sizes[:k] >= nbytes) & ~self._busy[:k, col]).nonzero()[0]
        mine = self._meets.get(tid)  # what its periods meet
        if mine is None:
            mine = self._meets[tid] = self._busy_row((self._tix == col).nonzero()[0])
        if free.size:
            j = int(free[np.argmin(self._sizes[free])])  # best fit, the lowest index among equals
            newly = mine & ~self._busy[j]
            self._busy[j] |= mine
            if self.cap is not None:  # tensors that lost bin j as a free one
                u = self._size_col[int(self._sizes[j])]
                self._free_count[newly, u] -= 1
                lost = (newly & (self._free_count[:, u] == 0) & (self._free_max == self._sizes[j])).nonzero()[0]
                if lost.size:
                    sizes = np.array(list(self._size_col), dtype=np.int64)
                    self._free_max[lost] = np.where(self._free_count[lost] > 0, sizes, -1).max(axis=1)
        else:
            size = align_up(int(nbytes), self.align)
            taken = int(self.footprint(int(nbytes)))
            if self.cap is not None and self.tier_bytes + taken > self.cap:
                raise ValueError(f"no bin of >= {nbytes} B is free over tensor {tid}'s periods and a new "
                                 f"one would take {self.tier_bytes + taken} B, above the cap of {self.cap} B")
            j = k
            if j == len(self._sizes):
                self._busy = np.concatenate([self._busy, np.zeros_like(self._busy)])
                self._sizes = np.concatenate([self._sizes, np.zeros_like(self._sizes)])
            self.size.append(size)
            self.owner.append(tid)
            self._busy[j], self._sizes[j] = mine, size
            if self.cap is not None:
                if size not in self._size_col:
                    self._size_col[size] = self._free_count.shape[1]
                    self._free_count = np.concatenate([self._free_count, np.zeros((len(mine), 1), np.int64)], axis=1)
                self._free_count[~mine, self._size_col[size]] += 1
                self._free_max = np.where(mine, self._free_max, np.maximum(self._free_max, size))
            self.held_bytes += size
            self.tier_bytes += taken
        self.bin_of[tid] = j
        self._placed[col] = True
        return self.owner[j]


class HostArena:
    """The host tier as one region of ``cap_bytes`` with one byte offset per tensor: the
    alternative to :class:`SlotBins` for the host (``plan_migrations(host_arena=True)``).

    A tensor's first host period is placed at the lowest offset (first fit) where its bytes,
    rounded up to ``align``, meet no range placed before over an op of the period (cyclic);
    its later periods must find the same offset free, or go elsewhere. Unlike a bin, a range
    reserves only the periods placed in it, and a free gap takes a tensor of any size that
    fits it: where the cap binds this holds more at once (what fixed-size bins lose to their
    first tensor's size). The tier addresses the region by tensor name
    (``teraio.core.tiers.host.HostTier``'s ``offsets``).

    Args:
        n_ops: ops per iteration.
        tid, a, b: the candidate periods, as for :class:`SlotBins`.
        cap_bytes: the region's bytes.
        align: each range's bytes and offset are multiples of this.

    Attributes:
        at: tensor id -> its offset.
    """

    def __init__(self, n_ops: int, tid: np.ndarray, a: np.ndarray, b: np.ndarray, cap_bytes: int,
                 align: int = 1):
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes={cap_bytes!r}; must be >= 0")
        self.n, self.cap, self.align = n_ops, int(cap_bytes), align
        self.tid = np.asarray(tid, np.int64)
        self.a, self.b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        # per placed period, by offset (in placing order among equal offsets): its ops [lo, hi)
        # (unrolled) and its byte range [off, end)
        self._ranges = np.zeros((4, 0), np.int64)  # rows lo, hi, off, end
        self.at: dict[int, int] = {}
        # per period: its last answer and the (aligned) size asked, -1 where none is kept.
        # Ranges are only ever added, so an answer stays right until a new range meets the
        # period and overlaps the answer's bytes (or its tensor gets its offset): ``place``
        # forgets exactly those.
        self._memo = np.full(len(self.tid), -1, np.int64)
        self._memo_size = np.full(len(self.tid), -1, np.int64)
        # per period: the highest end of the ranges placed over it (the region above is free
        # there), and whether its tensor has its offset
        self._top = np.zeros(len(self.tid), np.int64)
        self._fixed = np.zeros(len(self.tid), bool)

    def offsets(self, periods: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Where each period's bytes would go, int64 ``[len(periods)]``: its tensor's offset
        where that is free over the period, else (a tensor not placed yet) the lowest offset
        free over it (first fit); -1 where none is. One pass over the placed ranges for all
        candidates (the planner asks for hundreds at each of its steps), in blocks of at most
        ``_BLOCK`` candidate × range pairs, for the periods not answered since the last
        range that could change their answer."""
        periods = np.asarray(periods, np.int64)
        size = align_up(np.asarray(nbytes, np.int64), self.align)
        out, new = self._memo[periods], self._memo_size[periods] != size
        if new.any():  # a period asked twice with two sizes keeps the last in the memo
            out[new] = self._search(periods[new], size[new])
            self._memo[periods[new]], self._memo_size[periods[new]] = out[new], size[new]
        return out

    def _search(self, periods: np.ndarray, size: np.ndarray) -> np.ndarray:
        """:meth:`offsets` over the placed ranges (``size`` aligned)."""
        fixed = np.array([self.at.get(int(t), -1) for t in self.tid[periods]], dtype=np.int64)
        lo, hi, off, end = self._ranges
        out = np.empty(len(periods), dtype=np.int64)
        rows = max(1, _BLOCK // max(1, len(off)))
        for s in range(0, len(periods), rows):
            p, sz, fx = periods[s:s + rows], size[s:s + rows, None], fixed[s:s + rows, None]
            a, b = self.a[p, None], self.b[p, None]
            meet = periods_meet(lo, hi, a, b, self.n)  # the period meets a range's ops
            clash = (meet & (off < fx + sz) & (fx < end)).any(axis=1)
            # the region's end as one more range that every period meets: the gap below it
            # is the free space above the highest meeting range
            meet = np.concatenate([meet, np.ones((len(p), 1), bool)], axis=1)
            reach = np.maximum.accumulate(np.where(meet, np.append(end, self.cap), 0), axis=1)
            before = np.concatenate([np.zeros((len(p), 1), np.int64), reach[:, :-1]], axis=1)
            gap = meet & (np.append(off, self.cap) - before >= sz)  # a free gap below a meeting range
            first = np.where(gap.any(axis=1), before[np.arange(len(p)), gap.argmax(axis=1)], -1)
            out[s:s + rows] = np.where(fx[:, 0] >= 0, np.where(clash, -1, fx[:, 0]), first)
        return out

    def offset(self, period: int, nbytes: int) -> int:
        """:meth:`offsets` of one period."""
        size = int(align_up(int(nbytes), self.align))
        if self._memo_size[period] != size:
            self._memo[period], self._memo_size[period] = self._search_one(period, size), size
        return int(self._memo[period])

    def _search_one(self, period: int, size: int) -> int:
        """:meth:`_search` of one period (``size`` aligned), over the placed ranges that meet
        it only: the free space below each of them, in offset order, is what the highest end
        below it leaves."""
        fixed = self.at.get(int(self.tid[period]), -1)
        lo, hi, off, end = self._ranges
        a, b, n = self.a[period], self.b[period], self.n
        meet = periods_meet(lo, hi, a, b, n)
        if fixed >= 0:
            return -1 if (meet & (off < fixed + size) & (fixed < end)).any() else fixed
        j = meet.nonzero()[0]
        before = np.zeros(len(j) + 1, np.int64)  # per meeting range and the region's end: the highest end below
        np.maximum.accumulate(end[j], out=before[1:])
        gap = (np.append(off[j], self.cap) - before >= size).nonzero()[0]
        return int(before[gap[0]]) if gap.size else -1

    def room(self, periods: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """bool per candidate period: :meth:`offsets` finds a place for it. A period of a
        tensor without an offset whose bytes fit above every range placed over it has one
        without a search."""
        periods, nbytes = np.asarray(periods, np.int64), np.asarray(nbytes, np.int64)
        ok = ~self._fixed[periods] & (self._top[periods] + align_up(nbytes, self.align) <= self.cap)
        rest = (~ok).nonzero()[0]
        if rest.size:
            ok[rest] = self.offsets(periods[rest], nbytes[rest]) >= 0
        return ok

    def place(self, period: int, nbytes: int) -> int:
        """Reserve ``period``'s range and return its offset.

        Raises:
            ValueError: no offset is free for it (``room`` said no).
        """
        off = self.offset(period, nbytes)
        if off < 0:
            raise ValueError(f"period {period} ({nbytes} B) of tensor {int(self.tid[period])} has no free "
                             f"offset in the {self.cap} B region")
        t = int(self.tid[period])
        if t not in self.at:
            self.at[t] = off
            mine = self.tid == t
            self._memo_size[mine] = -1
            self._fixed[mine] = True
        end = off + int(align_up(int(nbytes), self.align))
        lo, hi, n = int(self.a[period]), int(self.b[period]), self.n
        meet = periods_meet(self.a, self.b, lo, hi, n).nonzero()[0]
        memo, size = self._memo[meet], self._memo_size[meet]
        # no range frees space: a -1 stays -1
        self._memo_size[meet[(memo >= 0) & (memo < end) & (off < memo + size)]] = -1
        self._top[meet] = np.maximum(self._top[meet], end)
        at = int(self._ranges[2].searchsorted(off, side="right"))  # after those placed before it
        self._ranges = np.concatenate([self._ranges[:, :at], [[lo], [hi], [off], [end]], self._ranges[:, at:]], axis=1)
        return off

    @property
    def held_bytes(self) -> int:
        """The region's bytes in use: the highest range end placed."""
        return int(self._ranges[3].max(initial=0))
