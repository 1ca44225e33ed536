"""Lifetime-aware tensor migration planning (paper §3.2, Algorithm 1).

Given a profiled :class:`~teraio.core.trace.Trace` and a GPU capacity, choose which inactive
periods of which tensors to offload (to SSD, or to host memory under a cap) and when, so
that the predicted peak of live bytes fits the capacity while transfers hide behind
compute. The result is a :class:`~teraio.core.plan.MigrationPlan`.

Model
-----
* **Inactive periods.** For every tensor of at least ``min_tensor_bytes`` bytes (except
  ``kind="input"`` storages, which are made outside the step and cannot be matched in a
  later iteration), each gap between consecutive uses ``a = u_i`` and ``b = u_{i+1}`` with
  ``b - a >= 2``; for a persistent tensor also the wrap-around gap from its last use to its
  first use of the next iteration (paper §3.1: global tensors' periods may span two
  iterations), except for a parameter updated in host memory (``meta["host_update"]``,
  ``Trace.with_host_update``), whose copy comes back refreshed across that gap.
* **Time.** Op k occupies ``[T[k], T[k+1])`` with ``T = trace.op_start_seconds()``; call
  that interval *slot* k.
* **Bandwidth timeline** (paper Fig. 6a), one per (tier, direction): a fluid model in
  which slot k can carry ``BW * op_seconds[k]`` bytes, less what earlier chosen
  migrations reserved there. An offload launched after op ``a`` fills the free capacity
  slot by slot from slot ``a+1`` on (never reaching the needed op ``b``); op
  ``free_before`` is the first op after the slot where it completes. A prefetch needed by
  op ``b`` fills backward from slot ``b-1``; ``prefetch_before`` is the slot where it
  starts. A candidate is *viable* if the freed window ``[free_before, prefetch_before)``
  is non-empty. Choosing it reserves exactly the bytes it moves in each slot, so no slot
  is ever reserved beyond its capacity.
* **Memory.** ``M'`` starts as ``trace.required_bytes()``; a chosen migration subtracts its
  bytes over its freed window. The greedy loop stops when ``max(M') <= capacity`` or when
  no viable candidate with a positive benefit is left.

Benefit (``benefit=``)
----------------------
The paper's prose (§3.2) and its Algorithm 1 disagree:

``"pressure"`` (default)
    The prose: the time integral of the *reduction* of critical memory pressure (the
    shaded area of Fig. 6b), ``sum_k min(s, max(0, M'[k] - C)) * tau_k`` over the freed
    window, ranked by benefit / cost with cost = offload time + prefetch time
    (``s / BW_write + s / BW_read`` of the tier) in seconds. It is the default because it
    is what the text defines and motivates, and because it stops crediting bytes that
    no longer reduce the excess: once ``M'`` is close to ``C`` in a region, a huge
    tensor earns no more than the excess it actually removes, so the planner does not
    spend bandwidth on offloads that buy nothing.
``"formula"``
    Algorithm 1 lines 8 and 11 as printed: ``B = s * sum(tau_k for critical k in the
    window)``, ranked by ``B / s``, i.e. by the critical time the window covers.

Tiers
-----
One drive is one channel for reads and writes (``shared_ssd``, default): the SSD tier's
offloads and prefetches draw on one timeline of drive time, an offload of ``s`` bytes
taking ``s / BW_write`` of it and a prefetch ``s / BW_read`` (the lent H200's drive served
both directions from one budget, 1.2-1.8 GB/s in all; planning them as two independent
channels sent it twice what it could move). ``shared_ssd=False`` plans the two directions
as independent channels (full-duplex links; the Fig. 3 roofline's model).

SSD first (paper §3.2). For each candidate both options are evaluated on their own
timelines: SSD (``ssd_write`` / ``ssd_read``) and, when ``host_cap_bytes > 0``, host
memory (``host_d2h`` / ``host_h2d``). Host memory is used only when its window gives a
strictly larger benefit than the SSD window, which happens when the SSD timeline is
saturated around the period (its offload completes later / its prefetch must start
earlier), and only if the host copy fits: each tier's slots are shared by tensors whose
periods never overlap (``teraio.core.slots``; each migration names its slot's owner in
``Migration.slot``), and the host slots, pinned buffers allocated once
(``teraio.core.storage.HostTier``), never hold more than ``host_cap_bytes`` in all.
The SSD tier's files, its slots in whole stripes, stay under ``ssd_cap_bytes`` when given
(the drives' free room): a candidate whose new SSD slot would pass it may still go to host
memory. TeraIO-SSD is ``host_cap_bytes=0``; TeraIO-Mixed a positive cap. ``use_ssd=False`` plans
for host memory only. With ``host_arena=True`` the host tier is one region of the cap
instead, a byte offset per tensor (``teraio.core.slots.HostArena``): it holds more at once
where slots sized by their first tensor leave gaps, and less where a tensor's later period
finds its offset taken. Choosing between the two by their simulated iterations
(``host_arena="auto"``) is the performance model's job, above this module:
``teraio.perf.choose.plan_fastest``.

Recompute (``recompute=``)
--------------------------
A third option beside the tiers, in the spirit of systems that decide swap and recompute
together (Capuchin, ASPLOS 2020; Checkmate, MLSys 2020): drop an intermediate tensor after
its last use before the period and make it again before its next use by re-running
the ops that produced it (``teraio.core.recompute.Chains``: the producer, and recursively
the producers of its inputs that are dead by then, from inputs that are resident). Its
window is ``[a + 1, r)``, where r is the latest op up to b at which the memory with the
chain's intermediates (``extra_bytes``) stays within the capacity (b itself where it
does) or, in a first plan, is still over it (the greedy must free that op anyway, the
chain's bytes with it; early in the greedy nearly every op is, so the first rule alone
leaves the largest tensors to the tiers); where that first plan does not fit, a second
takes the first rule alone, and the plan with the smaller shortfall is kept
(``meta["recompute_room"]``: ``"critical"`` or ``"fits"``). It uses no bandwidth and costs the chain's profiled op seconds on the compute stream
before op r. Ranked as the tiers are: benefit per
second of cost (the pressure benefit over the window, divided by the chain's seconds where
a tier divides by its transfer seconds), and chosen for a candidate where that beats the
tier the rule above picks. Recomputing a tensor keeps its chain's resident inputs on the
GPU through op b: their periods that hold op b leave the candidates (a candidate whose chain
would so pin a tensor larger than itself has no recompute option), and a candidate whose
input is moved or recomputed there loses the option. Such an update can raise a score
(op b's memory rises), so the lazy greedy's bounds are then only close to exact.

When memory cannot fit
----------------------
By default the plan holds only migrations Algorithm 1 deems viable and reports any
shortfall. With ``allow_stalls=True`` a second phase adds *exposed* migrations, whose
windows cover the remaining critical ops even though their transfers cannot hide, so
the run stalls instead of running out of memory (paper §3.2, "Stalls"); the simulator
charges those waits, which is what bends the roofline (Fig. 3) down at low bandwidth.

Speed
-----
Lazy greedy: every candidate's score (benefit / cost) can only fall as the plan grows
(``M'`` only falls, windows only shrink as bandwidth fills, host room only shrinks: a slot's
busy ops only grow, and a new slot a candidate could share opens only while one of the
candidate's own size would still fit the cap), so a score computed earlier is an upper
bound. Accepting a migration changes state only inside
its own inactive period, so only candidates whose periods overlap it go stale. Each round
re-scores stale candidates in vectorized batches, highest bound first, until none can
beat the best fresh score; ties go to the lowest candidate index, so the result is the
same as re-scoring everything every round (a round evaluates in one call as many
candidates as the last round's batches took). Window ends come from ``searchsorted`` on
prefix sums of free bandwidth over a doubled (cyclic) timeline, summed only as far as a
batch's windows reach, benefits from prefix sums of the benefit density, one row per
candidate size. A change sums a row again only from its first op whose value changed, in
the same order as summing it whole (``torch.cumsum`` on the same memory: it adds in order,
as numpy's cumsum does, and faster), so every score is the same to the last bit as summing
afresh. The exposed phase is lazy the same way
(``_Exposed``). The recompute chains are found once per ``plan_migrations`` call.

:func:`plan_packings` plans the two packings (for ``host_arena="auto"``) as twins: one run places each host migration
in the slots and in the region alike and asks both for room; while they answer alike it is
both plans, and at the first room test they answer differently it splits into two that carry
on alone (``_run_twins``), so the shared part is planned once. :class:`Candidates` keeps
what every plan of one trace shares (its periods, recompute chains and slot rows). Planning time on the
committed traces, today's planner and ``recompute="auto"`` side by side:
``benchmarks/results/plan_compile_cpu.json``.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import time

import numpy as np
import torch

from teraio.core.bandwidth import CHANNELS, TIER_CHANNELS, TierBandwidth
from teraio.core.plan import Migration, MigrationPlan, Recompute
from teraio.core.recompute import Chains
from teraio.core.slots import HOST_ALIGN, HostArena, SlotBins, periods_meet, ssd_file_bytes
from teraio.core.trace import Trace

BENEFITS: tuple[str, ...] = ("pressure", "formula")


@dataclasses.dataclass
class Periods:
    """Inactive periods as arrays ``[n_periods]``: tensor id, bytes, last use ``a`` and
    next use ``b`` unrolled so that ``a < b <= a + n_ops`` (a wrapping period has
    ``b >= n_ops``)."""

    tid: np.ndarray
    nbytes: np.ndarray
    a: np.ndarray
    b: np.ndarray


def inactive_periods(trace: Trace, min_tensor_bytes: int = 1 << 20) -> Periods:
    """The candidate inactive periods of ``trace`` (see the module docstring), in tensor
    order and, per tensor, in the order of their last uses.

    A gap needs at least one op strictly between the two uses (``b - a >= 2``).
    """
    n = trace.n_ops
    tensors = [t for t in trace.tensors if t.nbytes >= max(1, min_tensor_bytes) and t.kind != "input"]
    count = np.fromiter((len(t.uses) for t in tensors), np.int64, len(tensors))
    uses = np.fromiter(itertools.chain.from_iterable(t.uses for t in tensors), np.int64, int(count.sum()))
    end = np.cumsum(count)  # per tensor, one past its last use in ``uses``
    of = np.repeat(np.arange(len(tensors)), count)  # per use, its tensor
    # a period starts at each use: up to the next use of its tensor, or from the last use
    # of a persistent one to its first use of the next iteration
    last = np.zeros(len(uses), dtype=bool)
    last[end - 1] = True
    b = np.empty_like(uses)
    b[:-1] = uses[1:]
    b[end - 1] = uses[end - count] + n
    # a parameter updated in host memory (Trace.with_host_update) comes back refreshed every
    # iteration: its wrap-around gap is the host update's, never a candidate
    refreshed = trace.meta.get("host_update", {})
    wraps = np.fromiter((t.persistent and t.name not in refreshed for t in tensors), bool, len(tensors))
    keep = (~last | wraps[of]) & (b - uses >= 2)
    tid = np.fromiter((t.tid for t in tensors), np.int64, len(tensors))
    nbytes = np.fromiter((t.nbytes for t in tensors), np.int64, len(tensors))
    return Periods(tid[of][keep], nbytes[of][keep], uses[keep], b[keep])


def _cumsum(x: np.ndarray, out: np.ndarray) -> None:
    """``np.cumsum(x, out=out)`` of a float64 1-D array into another: the same sums in the
    same order, summed by ``torch.cumsum`` on the same memory, a few times faster on the CPU
    (ATen's CPU cumsum adds the elements one after another, from the first, in float64, as
    numpy's does; ``tests/test_planner.py`` checks that they agree to the last bit)."""
    torch.cumsum(torch.from_numpy(x), 0, out=torch.from_numpy(out))


class _Channel:
    """Free capacity (bytes) per op slot of one (tier, direction), with a prefix sum over
    the doubled (cyclic) timeline: ``prefix[i] = free[0 mod n] + ... + free[(i-1) mod n]``,
    summed in that order. A reservation changes a few slots; the prefix is summed again
    from the first of them on (the same sums, in the same order), when next asked for and
    only as far as asked (:meth:`prefix_to`)."""

    def __init__(self, bytes_per_s: float, op_seconds: np.ndarray):
        self.n = len(op_seconds)
        self.capacity = bytes_per_s * op_seconds
        self._free2 = np.concatenate([self.capacity, self.capacity])
        self.free = self._free2[:self.n]
        self._prefix = np.zeros(2 * self.n + 1)
        self._valid = 0  # prefix[:_valid + 1] is up to date

    def prefix_to(self, m: int) -> np.ndarray:
        """The prefix up to column ``m`` (``prefix[:m + 1]``, a view), summed on from its last
        valid column as far as ``m`` only: the same sums, in the same order, as summing it
        whole."""
        v = self._valid
        if v < m:
            first = self._free2[v]
            self._free2[v] = self._prefix[v] + first  # summed on from prefix[v], in order
            _cumsum(self._free2[v:m], self._prefix[v + 1:m + 1])
            self._free2[v] = first
            self._valid = m
        return self._prefix[:m + 1]

    def offload_end(self, start: int, nbytes: float, within: int | None = None) -> int:
        """Unrolled index of the slot after the one where ``nbytes`` launched at slot
        ``start`` completes (``free_before``); may exceed ``2n`` if it never completes.
        With ``within``, one that would end after slot ``within`` gives ``within + 1``
        (only the prefix up to ``within`` is summed)."""
        p = self.prefix_to(2 * self.n if within is None else within)
        return int(p.searchsorted(p[start] + nbytes, side="left"))

    def prefetch_start(self, end: int, nbytes: float) -> int:
        """Unrolled slot where a transfer of ``nbytes`` that must finish by the start of
        slot ``end`` starts (``prefetch_before``); negative if it cannot fit."""
        p = self.prefix_to(end)
        return int(p.searchsorted(p[end] - nbytes, side="right")) - 1

    def _take(self, lo: int, hi: int, last: int, rest: float) -> None:
        """All of slots ``[lo, hi)`` (unrolled, cyclic) and ``rest`` bytes of slot ``last``;
        the prefix is out of date from the first changed slot on."""
        n = self.n
        for s, e in _cyclic_slices(lo, hi, n):
            self._free2[s:e] = 0.0
            self._free2[s + n:e + n] = 0.0
            self._valid = min(self._valid, s)
        k = last % n
        self._free2[k] = self._free2[k + n] = max(0.0, self._free2[k] - rest)
        self._valid = min(self._valid, k)

    def reserve_offload(self, start: int, nbytes: float, within: int | None = None) -> int:
        """Reserve an offload of ``nbytes`` from slot ``start`` on; its ``free_before``.
        ``within``: as :meth:`offload_end`'s, for a caller that knows it ends by then."""
        end = self.offload_end(start, nbytes, within)
        last = end - 1
        p = self.prefix_to(last)
        self._take(start, last, last, nbytes - (p[last] - p[start]))
        return end

    def reserve_prefetch(self, end: int, nbytes: float) -> int:
        """Reserve a prefetch of ``nbytes`` that must end by slot ``end``; its
        ``prefetch_before``."""
        start = self.prefetch_start(end, nbytes)
        p = self.prefix_to(end)
        self._take(start + 1, end, start, nbytes - (p[end] - p[start + 1]))
        return start

    @property
    def reserved(self) -> np.ndarray:
        return self.capacity - self.free


def _snap(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to 36 significant bits: scores that are equal but for the rounding of
    the prefix sums they came from (which shifts as other slots' free bandwidth changes)
    compare equal, so ties go to the lowest candidate index whenever a score was computed.
    Monotone, so an upper bound stays one."""
    m, e = np.frexp(x)
    return np.ldexp(np.rint(m * 2.0**36), e - 36)


def _channels(tiers: TierBandwidth, op_seconds: np.ndarray, shared_ssd: bool):
    """The bandwidth timelines by channel name, and per channel the factor that turns a
    transfer's bytes into the timeline's units. With ``shared_ssd`` ``ssd_read`` is the
    ``ssd_write`` timeline itself (bytes at the write rate), a read of ``s`` bytes taking
    ``s * BW_write / BW_read`` of it: the drive time it takes."""
    chans = {c: _Channel(tiers.bytes_per_second(c), op_seconds) for c in CHANNELS}
    scale = dict.fromkeys(CHANNELS, 1.0)
    if shared_ssd:
        chans["ssd_read"] = chans["ssd_write"]
        scale["ssd_read"] = tiers.bytes_per_second("ssd_write") / tiers.bytes_per_second("ssd_read")
    return chans, scale


def _cyclic_slices(lo: int, hi: int, n: int) -> list[tuple[int, int]]:
    """Unrolled ``[lo, hi)`` (``0 <= lo <= hi``, ``hi - lo <= n``) as slices of ``[0, n)``."""
    if hi <= lo:
        return []
    s, e = lo % n, (hi - 1) % n + 1
    return [(s, e)] if s < e else [(s, n), (0, e)]


@dataclasses.dataclass
class RecomputeTable:
    """The recompute option of each candidate period (``teraio.core.recompute``), the same for
    every plan of one trace and candidate set, so made once for all of them.

    Attributes:
        ok: bool ``[n_periods]``: a chain exists and pins no larger tensor than it frees.
        cost: its chain's seconds (at least 1 ns), 1.0 where none.
        extra: its chain's bytes beyond the tensor, int64.
        chain: its :class:`~teraio.core.recompute.Chain`, None where none.
        dependents: candidate -> the recompute candidates whose chain keeps it on the GPU
            (periods of a chain's resident input that hold op b, ``a' < b <= b'``); only
            candidates that have some.
        by_tid: tensor id -> its candidates.
    """

    ok: np.ndarray
    cost: np.ndarray
    extra: np.ndarray
    chain: list
    dependents: dict[int, list[int]]
    by_tid: dict[int, list[int]]

    @classmethod
    def empty(cls, n_periods: int) -> "RecomputeTable":
        """No candidate recomputable."""
        return cls(np.zeros(n_periods, dtype=bool), np.ones(n_periods), np.zeros(n_periods, dtype=np.int64),
                   [None] * n_periods, {}, {})

    @classmethod
    def of(cls, trace: Trace, periods: Periods) -> "RecomputeTable":
        """The chains of ``periods``' activations and temporaries before their next use."""
        n, N = trace.n_ops, len(periods.tid)
        out = cls.empty(N)
        chains = Chains(trace)
        a, b_, s = periods.a.tolist(), periods.b.tolist(), periods.nbytes.tolist()
        for c, t in enumerate(periods.tid.tolist()):
            out.by_tid.setdefault(t, []).append(c)
        for c, t in enumerate(periods.tid.tolist()):
            rec = trace.tensors[t]
            if rec.persistent or rec.kind not in ("activation", "temp"):
                continue
            b = b_[c]
            ch = chains.chain(rec.tid, b)
            if ch is None:
                continue
            anchors = [c2 for i in ch.inputs for c2 in out.by_tid.get(i, ())
                       if a[c2] < b <= b_[c2] or a[c2] < b + n <= b_[c2]]
            if any(s[c2] > s[c] for c2 in anchors):
                continue  # it would pin a larger tensor than it frees
            out.ok[c] = True
            out.cost[c] = max(ch.seconds, 1e-9)
            out.extra[c] = ch.extra_bytes
            out.chain[c] = ch
            for c2 in anchors:
                out.dependents.setdefault(c2, []).append(c)
        return out


_AHEAD = 64 + 128 + 256  # candidates a round of the lazy greedy evaluates in one call


class _Ahead:
    """Scores of candidates evaluated ahead of the batches of the lazy greedy that will ask
    for them (:meth:`_Planner.evaluate` of each, in one call). Within a round nothing that
    ``evaluate`` reads changes, and each candidate's result depends on nothing else in its
    call, so a batch gets what evaluating it alone would give."""

    def __init__(self, planner: "_Planner", n_candidates: int):
        self.planner = planner
        self.pos = np.full(n_candidates, -1, dtype=np.int64)
        self.out: list[np.ndarray] | None = None

    def add(self, ids: np.ndarray) -> None:
        got = self.planner.evaluate(ids)
        n = 0 if self.out is None else len(self.out[0])
        self.pos[ids] = np.arange(n, n + len(ids))
        self.out = list(got) if self.out is None else [np.concatenate([a, b]) for a, b in zip(self.out, got)]

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """``planner.evaluate(ids)``'s answer."""
        pos = self.pos[ids]
        missing = pos < 0
        if missing.any():
            self.add(ids[missing])
            pos = self.pos[ids]
        bound, choice, f, p, score = self.out
        return bound[pos], choice[pos], f[pos], p[pos], score[pos]


class _Diverged(Exception):
    """A twinned planner's two host packings answered a room test differently: from here on
    their plans differ (:meth:`_Planner.split`)."""


@dataclasses.dataclass
class _Round:
    """A round of the lazy greedy: the best fresh score so far and the next batch size."""

    best: float
    batch: int = 64
    ahead: _Ahead | None = None
    stale: np.ndarray | None = None  # the candidates alive and stale that may reach the best, ascending
    taken: int = 0  # candidates its batches evaluated


class _Greedy:
    """Phase 1's state (:meth:`_Planner.run`): per candidate the last evaluation (bound,
    choice, windows, score), whether it is still a candidate and whether that evaluation is
    current; the migrations chosen, the round in progress, the statistics once done."""

    def __init__(self, bound, choice, fwin, pwin, score):
        self.bound, self.choice, self.fwin, self.pwin, self.score = bound, choice, fwin, pwin, score
        self.evaluations = len(bound)
        self.alive = bound > 0
        self.fresh = np.ones(len(bound), dtype=bool)
        self.migrations: list[Migration] = []
        self.round: _Round | None = None
        self.ahead = _AHEAD  # candidates the next round evaluates in its first call
        self.stats: dict | None = None


class _Planner:
    """The greedy loop's state: bandwidth timelines, ``M'`` (and its excess over the
    capacity on a doubled timeline, so a window never needs splitting), host occupancy, and
    per-candidate cached scores.
    ``required``: ``trace.required_bytes()`` where the caller has it (:class:`Candidates`)."""

    def __init__(self, trace: Trace, capacity: int, tiers: TierBandwidth, host_cap: int,
                 benefit: str, use_ssd: bool, periods: Periods, shared_ssd: bool, host_arena: bool = False,
                 ssd_cap: int | None = None, recompute: str | None = None,
                 recompute_table: "RecomputeTable | None" = None, meets: dict | None = None,
                 host_placement=None, required: np.ndarray | None = None):
        self.n = trace.n_ops
        self.capacity = capacity
        self.benefit = benefit
        self.tiers = [t for t, on in (("ssd", use_ssd), ("host", host_cap > 0)) if on]
        self.channels, self.scale = _channels(tiers, trace.op_seconds, shared_ssd)
        self.cost_per_byte = {t: sum(1.0 / tiers.bytes_per_second(c) for c in TIER_CHANNELS[t])
                              for t in TIER_CHANNELS}
        live = (trace.required_bytes() if required is None else required).astype(np.int64)
        self.baseline_peak = int(live.max()) if self.n else 0  # trace.peak_bytes()
        # M' - C over the doubled timeline, in float64 (bytes: whole numbers, exact)
        self.excess2 = np.concatenate([live, live]).astype(np.float64) - capacity
        self.tau2 = np.concatenate([trace.op_seconds, trace.op_seconds])
        self.s, self.a, self.b, self.p_tid = periods.nbytes, periods.a, periods.b, periods.tid
        self._st = self.a + 1  # each period's first op off the GPU at the earliest
        # Slots shared by tensors whose periods never overlap (teraio.core.slots): the host
        # tier's bins stay under the cap, the SSD tier's files under the drives' room.
        # With host_arena the host tier is one region, a byte offset per tensor instead.
        # With host_placement (plan_migrations) the host tier is that placement, by period.
        self.host_arena = host_arena
        self.host_by_period = host_arena or host_placement is not None
        host = HostArena if host_arena else SlotBins
        self._tensor_meets: dict = {} if meets is None else meets
        slots = {} if host_arena else {"meets": self._tensor_meets}
        self.bins = {"host": host(self.n, self.p_tid, self.a, self.b, host_cap, align=HOST_ALIGN, **slots)
                     if host_placement is None else host_placement(self.n, self.a, self.b, host_cap),
                     "ssd": SlotBins(self.n, self.p_tid, self.a, self.b, ssd_cap, footprint=ssd_file_bytes,
                                     meets=self._tensor_meets)}
        # Until the SSD files come within one largest slot of the cap, every candidate has room there.
        self._ssd_largest = int(ssd_file_bytes(int(self.s.max()))) if len(self.s) else 0
        # per candidate: its bytes in each channel's units, and per tier what a score divides by
        self._moved = {c: self.s * self.scale[c] for c in CHANNELS}
        self._per = {t: self.s * self.cost_per_byte[t] if benefit == "pressure" else self.s.astype(np.float64)
                     for t in TIER_CHANNELS}
        # Benefit density prefix sums over the doubled timeline, one row per key (a candidate
        # size for "pressure", one row for "formula"): row r is valid up to column _valid[r]
        # (its densities changed at that op, or it was summed that far), summed on from there
        # as far as a query needs.
        if benefit == "pressure":
            self._keys, self._code = np.unique(self.s, return_inverse=True)
        else:
            self._keys, self._code = np.array([-1], np.int64), np.zeros(len(self.s), np.int64)
        self._code = self._code.reshape(-1)
        self._q = np.zeros((len(self._keys), 2 * self.n + 1))
        self._valid = np.zeros(len(self._keys), dtype=np.int64)
        self._one = np.array([1])  # the formula's key: its density changes where the excess falls to 0
        self._touched = np.zeros(len(self._keys), dtype=np.int64)  # first op changed since the exposed phase asked
        self._recompute_setup(trace, periods, recompute, recompute_table)
        self.recomputes: list[Recompute] = []
        self.pinned: dict[int, list[int]] = {}  # candidate -> ops where a recompute reads it
        self._greedy: _Greedy | None = None
        self._exposed: _Exposed | None = None
        # With a twin (host_arena="auto"), the host region planned alongside the slots: both
        # are placed in and asked for room until they answer differently (_Diverged).
        self.twin: HostArena | None = None

    def _recompute_setup(self, trace: Trace, periods: Periods, on: str | None,
                         table: "RecomputeTable | None") -> None:
        """The recompute option's per-candidate state (:class:`RecomputeTable`; ``table`` if
        given, else made here), ``rc_ok`` a copy, as the greedy clears it."""
        self.rc_on = on is not None
        self.rc_room = on
        if not self.rc_on:
            table = RecomputeTable.empty(len(self.s))
        elif table is None:
            table = RecomputeTable.of(trace, periods)
        self.rc_ok = table.ok.copy()
        self.rc_cost, self.rc_extra, self.rc_chain = table.cost, table.extra, table.chain
        self.rc_dependents, self.by_tid = table.dependents, table.by_tid
        self.n_recomputable = int(self.rc_ok.sum())

    @property
    def live(self) -> np.ndarray:
        """int64 ``[n_ops]``: ``M'``, the live bytes of each op with the plan so far."""
        return (self.excess2[:self.n] + self.capacity).astype(np.int64)

    def over(self) -> bool:
        """Whether ``M'`` is over the capacity at some op."""
        return bool(self.excess2[:self.n].max(initial=0.0) > 0)

    # ---- scoring (vectorized over candidates) -------------------------------------------
    def _window_benefit(self, rows: np.ndarray, ok: np.ndarray, f: np.ndarray, p: np.ndarray) -> np.ndarray:
        """The benefit density summed over the windows ``[f, p)`` (unrolled) of candidates of
        prefix-sum rows ``rows`` (their size's, ``self._code``) where ``ok`` (bytes*s for
        "pressure", s for "formula"; 0 elsewhere): a difference of the prefix sums of their
        row."""
        ben = np.zeros(len(rows))
        i = ok.nonzero()[0]
        if i.size:
            rows, pi, fi = rows[i], p[i], f[i]
            need = np.zeros(len(self._keys), dtype=np.int64)
            np.maximum.at(need, rows, pi)
            self._extend(need)
            q, at = self._q.ravel(), rows * self._q.shape[1]
            ben[i] = q.take(at + pi) - q.take(at + fi)
        return ben

    def _extend(self, need: np.ndarray) -> None:
        """Make prefix-sum row r valid up to column ``need[r]``, summing on from its last valid
        column: the same sums, in the same order, as summing the row whole."""
        for r in (need > self._valid).nonzero()[0].tolist():
            d, m = int(self._valid[r]), int(need[r])
            excess = self.excess2[d:m]
            key = int(self._keys[r])
            dens = (excess.clip(0.0, key) if key >= 0 else excess > 0) * self.tau2[d:m]
            dens[0] += self._q[r, d]
            _cumsum(dens, self._q[r, d + 1:m + 1])
            self._valid[r] = m

    def _lower(self, lo: int, hi: int, nbytes: int) -> None:
        """Take ``nbytes`` off ``M'`` over the unrolled ops ``[lo, hi)`` (cyclic) and mark the
        prefix-sum rows whose densities this changes, from the first op where one does: a
        size ``key``'s density ``min(max(0, excess), key)`` changes where the excess was
        positive and falls below ``key``; the formula's where it falls to 0 or below."""
        pieces = sorted(_cyclic_slices(lo, hi, self.n))
        if not pieces:
            return
        keys = self._keys if self.benefit == "pressure" else self._one
        excess = np.concatenate([self.excess2[s:e] for s, e in pieces]) if len(pieces) > 1 else \
            self.excess2[pieces[0][0]:pieces[0][1]]  # read before it is lowered below
        # ops where the excess was positive and falls below the largest key
        at = ((excess > 0) & (excess < int(keys[-1]) + nbytes)).nonzero()[0]
        if at.size:
            low = np.minimum.accumulate(excess[at] - nbytes)  # non-increasing
            k = (-low).searchsorted(-keys, side="right")  # the first that falls below each key
            hit = k < len(low)
            first = len(range(*pieces[0]))
            op = at[np.minimum(k, len(at) - 1)]
            op = np.where(op < first, pieces[0][0] + op, pieces[-1][0] + op - first)
            self._valid[hit] = np.minimum(self._valid[hit], op[hit])
            self._touched[hit] = np.minimum(self._touched[hit], op[hit])
        for s, e in pieces:
            self.excess2[s:e] -= nbytes
            self.excess2[s + self.n:e + self.n] -= nbytes

    def _recompute_at(self, c: int) -> int:
        """The op before which candidate c is made again: the latest op r in ``(a + 1, b]``
        where the memory with its chain's intermediates stays within the capacity (at op
        b where it does), or, with ``rc_room="critical"``, where it does or the op is still
        over the capacity (the greedy frees it, the chain's bytes with it, later); -1 where
        there is none."""
        if not self.rc_ok[c]:
            return -1
        lo, b = int(self.a[c]) + 2, int(self.b[c])
        seg = self.excess2[lo:b + 1]
        room = seg + self.rc_extra[c] <= 0
        if self.rc_room == "critical":
            room |= seg > 0
        if room[-1]:
            return b
        r = room.nonzero()[0]
        return lo + int(r[-1]) if r.size else -1

    def _recompute_ats(self, idx: np.ndarray) -> np.ndarray:
        """:meth:`_recompute_at` of recomputable candidates ``idx``: op b where there is
        room there, else searched back from b."""
        b = self.b[idx]
        excess = self.excess2[b]
        room = excess + self.rc_extra[idx] <= 0
        if self.rc_room == "critical":
            room |= excess > 0
        r = b.copy()
        for j in (~room).nonzero()[0].tolist():
            r[j] = self._recompute_at(int(idx[j]))
        return r

    def _recompute_option(self, idx: np.ndarray, st: np.ndarray, f: np.ndarray, p: np.ndarray, ok: np.ndarray,
                          per: np.ndarray) -> None:
        """The recompute option of candidates ``idx`` (:meth:`evaluate`), written into its
        rows: window ``[st, p)`` (p -1 where there is no option), viable where non-empty, and
        what its score divides by (the chain's seconds; bytes for "formula")."""
        rc = self.rc_ok[idx]
        f[:] = st
        p[:] = -1
        p[rc] = self._recompute_ats(idx[rc])
        np.greater(p, st, out=ok)
        ok &= rc
        per[:] = self.rc_cost[idx] if self.benefit == "pressure" else self.s[idx]

    @property
    def rc_index(self) -> int:
        """The choice index (:meth:`evaluate`) of the recompute option."""
        return len(self.tiers)

    def evaluate(self, idx: np.ndarray):
        """For candidates ``idx``: (upper bound on every future score, chosen option: a tier
        index into ``self.tiers``, :attr:`rc_index` for recompute, or -1, free_before,
        prefetch_before (unrolled), chosen score).

        Each option's window: a tier's offload fills the free bandwidth from slot a + 1 on
        and its prefetch backward from slot b - 1; recompute drops the tensor from op a + 1
        to its remake (:meth:`_recompute_at`). Each is viable where its window is non-empty,
        the tier has room and the benefit is positive; its score is the benefit per second
        of cost (transfer seconds of the tier, the chain's seconds of recompute; per byte
        for "formula"), snapped.

        Tier rule: SSD unless the host window's benefit is strictly larger; then recompute
        where its score (benefit per second of recompute) beats the tier's (benefit per
        second of transfer)."""
        st, b = self._st[idx], self.b[idx]
        top = int(b.max(initial=0))  # no window reaches past it: the prefixes are summed that far
        nt, k = len(self.tiers), len(idx)
        m = nt + self.rc_on
        F, P = np.empty((m, k), np.int64), np.empty((m, k), np.int64)
        OK, per = np.empty((m, k), bool), np.empty((m, k))
        for j, tier in enumerate(self.tiers):
            cw, cr = TIER_CHANNELS[tier]
            pw, pr = self.channels[cw].prefix_to(top), self.channels[cr].prefix_to(top)
            F[j] = pw.searchsorted(pw[st] + self._moved[cw][idx], side="left")
            P[j] = pr.searchsorted(pr[b] - self._moved[cr][idx], side="right")
            P[j] -= 1
            np.less(F[j], b, out=OK[j])
            OK[j] &= P[j] > F[j]
            if tier == "host":
                OK[j] &= self.host_room(idx)
            elif self.bins["ssd"].cap is not None:
                OK[j] &= self.ssd_room(idx)
            per[j] = self._per[tier][idx]
        if self.rc_on:
            self._recompute_option(idx, st, F[nt], P[nt], OK[nt], per[nt])
        ben = self._window_benefit(np.concatenate([self._code[idx]] * m), OK.ravel(), F.ravel(), P.ravel()).reshape(m, k)
        if self.benefit == "formula":
            ben *= self.s[idx]
        OK &= ben > 0
        SC = _snap(np.where(OK, ben / per, 0.0))
        bound = SC.max(axis=0)
        choice = np.where(OK[0], 0, -1)
        f, p, score = F[0], P[0], SC[0]  # SC is 0 where an option is not viable
        if nt == 2:
            host = OK[1] & (~OK[0] | (ben[1] > ben[0]))
            choice[host] = 1
            f, p, score = np.where(host, F[1], f), np.where(host, P[1], p), np.where(host, SC[1], score)
        if self.rc_on:
            rc = OK[nt] & (SC[nt] > score)
            choice = np.where(rc, self.rc_index, choice)
            f, p, score = np.where(rc, F[nt], f), np.where(rc, P[nt], p), np.where(rc, SC[nt], score)
        return bound, choice, f, p, score

    def _pins(self, c: int, r: int) -> list[int] | None:
        """The candidates that keep candidate c's chain inputs on the GPU at op r (periods
        ``a' < r <= b'``), or None if one of them is already moved or recomputed."""
        pins = []
        for i in self.rc_chain[c].inputs:
            for c2 in self.by_tid.get(i, ()):
                a2, b2 = int(self.a[c2]), int(self.b[c2])
                if a2 < r <= b2 or a2 < r + self.n <= b2:
                    if self.taken[c2] and c2 not in self.pinned:
                        return None
                    pins.append(c2)
        return pins

    def accept_recompute(self, c: int) -> tuple[int, int]:
        """Drop candidate c from op a + 1 until it is made again before op b'
        (:meth:`_recompute_at`); its chain's intermediates add to op b'."""
        s, a, b = int(self.s[c]), int(self.a[c]), self._recompute_at(c)
        self._lower(a + 1, b, s)
        extra = int(self.rc_extra[c])
        if extra:
            k = b % self.n
            before = self.excess2[k]
            self.excess2[k] += extra
            self.excess2[k + self.n] += extra
            # rows whose density at op k rises: the excess was below the key and ends above 0
            keys = self._keys if self.benefit == "pressure" else self._one
            if before + extra > 0:
                hit = keys > before
                self._valid[hit] = np.minimum(self._valid[hit], k)
        return a + 1, b

    # ---- choosing -----------------------------------------------------------------------
    def accept(self, c: int, tier: str) -> tuple[int, int]:
        s, a, b = int(self.s[c]), int(self.a[c]), int(self.b[c])
        cw, cr = TIER_CHANNELS[tier]
        f = self.channels[cw].reserve_offload(a + 1, s * self.scale[cw], within=b)
        p = self.channels[cr].reserve_prefetch(b, s * self.scale[cr])
        self._lower(f, p, s)
        self._place(c, tier)
        return f, p

    def _by_period(self, tier: str) -> bool:
        return tier == "host" and self.host_by_period  # HostArena places periods, SlotBins tensors

    def _place(self, c: int, tier: str) -> None:
        """Give candidate c's tensor its slot in ``tier`` (``teraio.core.slots``), or its
        period a range of the host region."""
        self.bins[tier].place(c if self._by_period(tier) else int(self.p_tid[c]), int(self.s[c]))
        if tier == "host" and self.twin is not None:
            self.twin.place(c, int(self.s[c]))

    def split(self) -> "_Planner":
        """A twinned planner's region half: a copy whose host tier is the twin (the region)
        and whose host migrations so far name their tensor's offset in it; this planner
        keeps the slots and drops the twin. Both then carry on alone."""
        twin, self.twin = self.twin, None
        shared = (self.tau2, self.s, self.a, self.b, self._st, self.p_tid, self._keys, self._code, self.rc_cost,
                  self.rc_extra, self.rc_chain, self.rc_dependents, self.by_tid, self._tensor_meets)
        memo = {id(x): x for x in shared}
        memo[id(self.bins["host"])] = None
        for ms in ([self._greedy.migrations] if self._greedy else []) + \
                  ([self._exposed.migrations] if self._exposed else []) + [self.recomputes]:
            memo.update((id(m), m) for m in ms)  # never changed in place: replaced
        other = copy.deepcopy(self, memo)
        other.bins["host"], other.host_arena, other.host_by_period = twin, True, True
        lists = [other._greedy.migrations] if other._greedy else []
        lists += [other._exposed.migrations] if other._exposed else []
        for ms in lists:
            ms[:] = [dataclasses.replace(m, slot=m.name, offset=twin.at[m.tid]) if m.tier == "host" else m
                     for m in ms]
        return other

    def host_room(self, idx: np.ndarray) -> np.ndarray:
        """bool per candidate: its tensor has a host slot already, shares a free one, or a
        new one still fits the cap (with ``host_arena``: its period finds a free range)."""
        if self.host_by_period:
            return self.bins["host"].room(idx, self.s[idx])
        room = self.bins["host"].room_of_periods(idx, self.s[idx])
        if self.twin is not None and (self.twin.room(idx, self.s[idx]) != room).any():
            raise _Diverged
        return room

    def ssd_room(self, idx: np.ndarray) -> np.ndarray:
        """bool per candidate: its tensor has an SSD slot already, shares a free one, or a
        new one's stripes still fit the SSD cap (always, without a cap)."""
        return self.bins["ssd"].room_of_periods(idx, self.s[idx])

    def ssd_room_may_shrink(self) -> bool:
        """Whether the SSD cap can refuse some candidate now: the files are within one
        largest slot of it."""
        ssd = self.bins["ssd"]
        return ssd.cap is not None and ssd.tier_bytes + self._ssd_largest > ssd.cap

    def slot_of(self, c: int, tier: str, trace: Trace) -> str:
        """The name of the owner of the ``tier`` slot that candidate c's tensor was placed in
        (in the host region: the tensor's own)."""
        bins = self.bins[tier]
        if self._by_period(tier):
            return trace.tensors[int(self.p_tid[c])].name
        return trace.tensors[bins.owner[bins.bin_of[int(self.p_tid[c])]]].name

    def offset_of(self, c: int, tier: str) -> int:
        """Candidate c's tensor's byte offset in the host region; -1 outside it."""
        return self.bins["host"].at[int(self.p_tid[c])] if tier == "host" and self.host_arena else -1

    def _overlapping(self, c: int, through_b: bool = False) -> np.ndarray:
        """Candidates whose inactive period shares an op with candidate c's: the only ones
        whose scores accepting c can change (all its effects lie inside its period, or up to
        and including op b with ``through_b``: a recompute's intermediates)."""
        return self._meets(int(self.a[c]) + 1, int(self.b[c]) + int(through_b))

    def _meets(self, lo: int, hi: int) -> np.ndarray:
        """bool per candidate: its period's ops ``[a + 1, b)`` meet the unrolled ops
        ``[lo, hi)`` (cyclic; ``1 <= lo <= n``, ``lo < hi``; :func:`~teraio.core.slots.periods_meet`)."""
        return periods_meet(self._st, self.b, lo, hi, self.n)

    def run(self, trace: Trace) -> tuple[list[Migration], dict]:
        """Phase 1: the lazy greedy (module docstring, "Speed"). Its state lives in
        ``self._greedy``, so that a call after :class:`_Diverged` carries on from the
        batch it stopped at."""
        N = len(self.s)
        if self._greedy is None:
            self._greedy = _Greedy(*self.evaluate(np.arange(N)))
            self.taken = np.zeros(N, dtype=bool)
            self.hidden: dict[int, tuple[int, int, int]] = {}  # candidate -> (index, free, prefetch), unrolled
        g = self._greedy
        if g.stats is not None:
            return g.migrations, g.stats
        bound, choice, fwin, pwin, score = g.bound, g.choice, g.fwin, g.pwin, g.score
        alive, fresh, migrations = g.alive, g.fresh, g.migrations
        while self.over():
            if g.round is None:
                g.round = _Round(float(np.where(alive & fresh & (choice >= 0), score, 0.0).max(initial=0.0)))
            rnd = g.round
            if rnd.stale is None:
                rnd.stale = (alive & ~fresh).nonzero()[0]
            while True:
                # within a round only the batches' candidates change (they turn fresh) and the
                # best only rises: those left stale that can reach it are among the last ones
                rnd.stale = ids = rnd.stale[~fresh[rnd.stale] & (bound[rnd.stale] >= rnd.best)]
                if not ids.size:
                    break
                if rnd.ahead is None:  # the batches of this round (64, 128, 256) in one call
                    rnd.ahead = _Ahead(self, N)
                    k = g.ahead  # as many as the last round took
                    rnd.ahead.add(ids if ids.size <= k else ids[(-bound[ids]).argpartition(k)[:k]])
                if ids.size > rnd.batch:
                    ids = ids[(-bound[ids]).argpartition(rnd.batch)[:rnd.batch]]
                got = rnd.ahead.take(ids)
                bound[ids], choice[ids], fwin[ids], pwin[ids], score[ids] = got
                g.evaluations += ids.size
                rnd.taken += ids.size
                fresh[ids] = True
                alive[ids] = got[0] > 0
                if (got[1] >= 0).any():
                    rnd.best = max(rnd.best, float(got[4].max()))
                rnd.batch *= 2
            g.ahead = max(_AHEAD, rnd.taken) if rnd.batch > 128 else 64
            g.round = None
            usable = alive & fresh & (choice >= 0)
            if not usable.any():
                break
            c = int(np.where(usable, score, -np.inf).argmax())
            recompute = choice[c] == self.rc_index
            if recompute and self._recompute_at(c) != pwin[c]:
                fresh[c] = False  # memory near op b changed since c was scored: score it again
                continue
            pins = self._pins(c, int(pwin[c])) if recompute else []
            if pins is None:  # an input of its chain is off the GPU at op r
                self.rc_ok[c] = fresh[c] = False
                continue
            for r in self.rc_dependents.get(c, ()):  # c no longer stays resident through their op b
                self.rc_ok[r] = False
                fresh[r] = False
            if recompute:
                f, p = self.accept_recompute(c)
                assert (f, p) == (fwin[c], pwin[c]), "accepted a stale window"
                t = trace.tensors[int(self.p_tid[c])]
                ch = self.rc_chain[c]
                self.recomputes.append(Recompute(
                    tid=t.tid, name=t.name, nbytes=t.nbytes, drop_after=int(self.a[c]),
                    recompute_before=p, needed_by=int(self.b[c]), ops=ch.ops, inputs=ch.inputs, seconds=ch.seconds,
                    extra_bytes=ch.extra_bytes))
                alive[c] = False
                self.taken[c] = True
                for c2 in pins:  # its chain's inputs stay on the GPU at op r
                    alive[c2] = False
                    self.taken[c2] = True
                    self.pinned.setdefault(c2, []).append(p)
                fresh &= ~self._overlapping(c, through_b=True)
                continue
            tier = self.tiers[int(choice[c])]
            f, p = self.accept(c, tier)
            assert (f, p) == (fwin[c], pwin[c]), "accepted a stale window"
            if tier == "host":  # host room shrank for every candidate, not only overlapping ones
                fresh &= choice != self.tiers.index("host")
            elif self.ssd_room_may_shrink():  # so may SSD room, near its cap
                fresh &= choice != self.tiers.index("ssd")
            t = trace.tensors[int(self.p_tid[c])]
            self.hidden[c] = (len(migrations), f, p)
            migrations.append(Migration(
                tid=t.tid, name=t.name, nbytes=t.nbytes, tier=tier,
                offload_after=int(self.a[c]), free_before=f % self.n, prefetch_before=p % self.n,
                needed_by=int(self.b[c]) % self.n, slot=self.slot_of(c, tier, trace),
                offset=self.offset_of(c, tier)))
            alive[c] = False
            self.taken[c] = True
            fresh &= ~self._overlapping(c)
        stop = "no_viable_candidate" if self.over() else "fits"
        g.stats = {"n_candidates": N, "evaluations": int(g.evaluations), "stop_reason": stop,
                   "n_recomputable": self.n_recomputable}
        return migrations, g.stats

    def run_exposed(self, trace: Trace, hidden: list[Migration]) -> tuple[list[Migration], int]:
        """Phase 2 (``allow_stalls``): with no hidden migration left and memory still over
        capacity, free each remaining critical op anyway, as the paper's runtime does by
        stalling. A migration's window spans the critical ops of its period (from the first
        to the last), so its transfers run into waits the simulator charges. Host memory
        is used when it fits (faster, so shorter stalls), else SSD. Ranked as in phase 1.
        A tensor kept on the GPU for a recompute's chain may go where its window misses
        every op at which a chain reads it.

        A period that already has a hidden migration (``hidden``, phase 1's list) can be
        *widened* instead: its window grows to cover the critical ops of the period outside
        it (in place, same tier). Without this, a hidden prefetch that bandwidth made start
        early would pin the tensor on the GPU through a later peak nothing else can free.

        Lazy, as phase 1: a score only falls as memory falls (windows shrink to the
        critical ops left, densities fall, room only shrinks), so a score computed earlier
        bounds it; each round scores again only the candidates that the last choice may
        have changed (:meth:`_Exposed.stale`) and whose bound can still win, and picks what
        scoring every candidate would pick.

        Returns:
            (the new exposed migrations, how many hidden ones were widened).
        """
        n = self.n
        if self._exposed is None:
            self._exposed = _Exposed(self, hidden)
        state = self._exposed
        migrations = state.migrations
        while not state.done and self.over():
            c = state.best()
            if c < 0:
                break
            fc, pc = int(state.f[c]), int(state.p[c])
            widen = bool(state.widenable[c])
            new_ops = [(fc, int(state.hf[c])), (int(state.hp[c]), pc)] if widen else [(fc, pc)]
            self._touched[:] = 2 * n
            for lo_u, hi_u in new_ops:
                self._lower(lo_u, hi_u, int(self.s[c]))
            if widen:
                i = self.hidden[c][0]
                hidden[i] = dataclasses.replace(hidden[i], free_before=fc % n, prefetch_before=pc % n)
                state.chosen(c, new_ops, None)
                state.n_widened += 1
                continue
            name = "host" if state.tier[c] == 1 else "ssd"
            self._place(c, name)
            state.chosen(c, new_ops, name)
            t = trace.tensors[int(self.p_tid[c])]
            migrations.append(Migration(tid=t.tid, name=t.name, nbytes=t.nbytes, tier=name,
                                        offload_after=int(self.a[c]), free_before=fc % n,
                                        prefetch_before=pc % n, needed_by=int(self.b[c]) % n,
                                        slot=self.slot_of(c, name, trace), offset=self.offset_of(c, name)))
        state.done = True
        return migrations, state.n_widened


_SLACK = 1e-6  # relative: a bound this close to the best is scored again (rounding of the prefix sums)


class _Exposed:
    """Per-candidate state of the exposed phase (:meth:`_Planner.run_exposed`): the window,
    tier and score each candidate had when last scored, and which may have changed since.

    A candidate's exposed window is its period's critical ops, first to last (for a hidden
    migration, widened: the hull of those and its hidden window), so it changes only where
    memory fell inside its period; its benefit sums prefix rows that change only from the
    first op whose density changed (``_Planner._touched``); host room shrinks with each
    host placement, SSD room near its cap with each SSD one. A tensor pinned for a
    recompute's chain is scored again whenever its window may have changed, whatever its
    bound: its option opens as its window shrinks."""

    def __init__(self, planner: _Planner, hidden: list[Migration]):
        self.pl = pl = planner
        N, n = len(pl.s), pl.n
        self.alive = ~pl.taken
        self.pinned = np.zeros(N, dtype=bool)
        self.pinned[list(pl.pinned)] = True
        self.hf, self.hp = np.full(N, -1), np.full(N, -1)  # hidden windows (unrolled), -1 where none
        self.widenable = np.zeros(N, dtype=bool)
        self.hidden_tier = np.full(N, -1)
        for c, (i, f_h, p_h) in pl.hidden.items():
            self.hf[c], self.hp[c], self.widenable[c] = f_h, p_h, True
            self.hidden_tier[c] = pl.tiers.index(hidden[i].tier)
        self.f, self.p = np.zeros(N, np.int64), np.zeros(N, np.int64)
        self.tier = np.full(N, -1)
        self.score, self.bound = np.zeros(N), np.full(N, np.inf)  # nothing scored yet
        self.stale = np.ones(N, dtype=bool)
        self.migrations: list[Migration] = []
        self.n_widened, self.done = 0, False
        self.crit: np.ndarray | None = None  # the critical ops of the doubled timeline

    def _evaluate(self, idx: np.ndarray, crit: np.ndarray) -> None:
        """Score candidates ``idx`` now (the full-rescoring rule of phase 2); ``crit``: the
        critical ops of the doubled timeline, ascending, with -1 before them and ``2n`` after."""
        pl, n = self.pl, self.pl.n
        st, b, s = pl._st[idx], pl.b[idx], pl.s[idx]
        hf, hp, widenable = self.hf[idx], self.hp[idx], self.widenable[idx]
        # the first critical op from st on (2n if none) and one past the last before b (0 if none)
        f = crit[crit.searchsorted(st)]
        p = crit[crit.searchsorted(b) - 1] + 1
        has_crit = f < b
        f = np.where(widenable & has_crit, np.minimum(f, hf), np.where(widenable, hf, f))
        p = np.where(widenable & has_crit, np.maximum(p, hp), np.where(widenable, hp, p))
        ok = (self.alive[idx] | widenable) & has_crit
        for j in (self.pinned[idx] & has_crit & ~ok).nonzero()[0].tolist():
            # an input of a recompute may go where its window misses op r
            ops = pl.pinned[int(idx[j])]
            ok[j] = not any(f[j] <= r < p[j] or f[j] <= r + n < p[j] for r in ops)
        tier = np.where(widenable, self.hidden_tier[idx], -1)
        fresh = ok & ~widenable
        cost = {"host": np.inf, "ssd": np.inf}
        if "host" in pl.tiers and fresh.any():
            i = fresh.nonzero()[0]
            tier[i[pl.host_room(idx[i])]] = 1
        if "ssd" in pl.tiers:
            i = (fresh & (tier < 0)).nonzero()[0]
            tier[i[pl.ssd_room(idx[i])] if pl.bins["ssd"].cap is not None else i] = 0  # no cap: room for all
            cost["ssd"] = pl.cost_per_byte["ssd"]
        ok &= tier >= 0
        rows = pl._code[idx]
        ben = pl._window_benefit(rows, ok, f, p)
        w = ok & widenable  # only the ops the widening adds
        if w.any():
            ben[w] -= pl._window_benefit(rows, w, hf, hp)[w]
        per = np.where(tier == 1, pl.cost_per_byte["host"], pl.cost_per_byte["ssd"]) * s
        pressure = pl.benefit == "pressure"
        score = np.where(ok & (ben > 0), ben / (per if pressure else s), 0.0)
        bound = score
        if pressure and cost["ssd"] < pl.cost_per_byte["host"]:
            # a host candidate that loses its room may go to a cheaper SSD
            cheaper = (tier == 1) & ~widenable
            bound = np.where(cheaper, score * pl.cost_per_byte["host"] / cost["ssd"], score)
        self.f[idx], self.p[idx], self.tier[idx], self.score[idx], self.bound[idx] = f, p, tier, score, bound
        self.stale[idx] = False

    def best(self) -> int:
        """The candidate scoring every candidate now would pick (highest score, lowest index
        among equals), or -1 where none has a positive score."""
        if self.crit is None:
            self.crit = (self.pl.excess2 > 0).nonzero()[0]
        crit = np.concatenate([[-1], self.crit, [2 * self.pl.n]])
        stale = self.stale.copy()
        # a stale bound of 0 stays 0: scores only fall; but not a pinned tensor's, stale
        # until scored (also when a _Diverged cut the last call short)
        self.stale &= (self.bound > 0) | self.pinned
        self.score[stale & ~self.stale] = 0.0
        again = self.stale & self.pinned
        if again.any():
            self._evaluate(again.nonzero()[0], crit)
        best, batch = float(self.score[~self.stale].max(initial=0.0)), 64
        while True:  # highest bounds first, until none left can reach the best
            ids = (self.stale & (self.bound * (1 + _SLACK) >= best)).nonzero()[0]
            if not ids.size:
                break
            if ids.size > batch:
                ids = ids[(-self.bound[ids]).argpartition(batch)[:batch]]
            self._evaluate(ids, crit)
            best = max(best, float(self.score[ids].max()))
            batch *= 2
        c = int(self.score.argmax())
        return c if self.score[c] > 0 else -1

    def chosen(self, c: int, lowered: list[tuple[int, int]], tier: str | None) -> None:
        """Candidate c was widened (``tier`` None) or placed in ``tier`` after memory fell over
        the unrolled ranges ``lowered``: mark what that may have changed."""
        pl = self.pl
        self.alive[c] = self.widenable[c] = self.pinned[c] = False
        self.score[c] = self.bound[c] = 0.0
        # windows change only where an op of the period stopped being critical
        still = pl.excess2[self.crit] > 0
        ended, self.crit = self.crit[~still], self.crit[still]
        if ended.size:
            count = np.zeros(2 * pl.n + 1, dtype=np.int64)
            count[ended + 1] = 1
            count.cumsum(out=count)
            self.stale |= count[pl.b] > count[pl._st]
        # prefix rows summed again from their first changed op: the windows reaching past it
        self.stale |= np.maximum(self.p, self.hp) > pl._touched[pl._code]
        if tier == "host":
            self.stale |= (self.tier == 1) & ~self.widenable
        elif tier == "ssd" and pl.ssd_room_may_shrink():
            self.stale |= (self.tier == 0) & ~self.widenable
        self.stale[c] = False


def plan_migrations(trace: Trace, capacity_bytes: int, tiers: TierBandwidth, host_cap_bytes: int,
                    benefit: str = "pressure", min_tensor_bytes: int = 1 << 20,
                    use_ssd: bool = True, allow_stalls: bool = False, shared_ssd: bool = True,
                    host_arena: bool = False, ssd_cap_bytes: int | None = None,
                    recompute: bool = False, host_placement=None) -> MigrationPlan:
    """Algorithm 1 (paper §3.2): a migration plan that brings ``trace``'s peak live bytes
    under ``capacity_bytes`` while hiding transfers behind compute.

    Args:
        trace: the profiled iteration.
        capacity_bytes: GPU memory available to the tensors of the trace, bytes.
        tiers: migration bandwidths, GB/s.
        host_cap_bytes: most host memory the plan may use, bytes: the sum of its host
            slots, each shared by tensors whose periods never overlap (0: SSD only,
            TeraIO-SSD; > 0: TeraIO-Mixed).
        benefit: ``"pressure"`` (default, the paper's prose) or ``"formula"`` (Algorithm 1
            as printed); see the module docstring.
        min_tensor_bytes: smaller tensors are never migrated, bytes.
        use_ssd: False plans for host memory only.
        allow_stalls: if no hidden migration is left and the peak is still over capacity,
            add *exposed* migrations (windows that transfers cannot hide behind, so the
            run stalls) until it fits (see ``_Planner.run_exposed``). They come last in
            ``plan.migrations``; ``plan.meta["n_exposed"]`` counts them. Off by default:
            the plan then only holds migrations Algorithm 1 deems viable.
        shared_ssd: the SSD tier's reads and writes share one drive-time timeline
            (default; see the module docstring); False: two independent channels.
        host_arena: place host migrations in one region of ``host_cap_bytes``, a byte
            offset per tensor (``Migration.offset``; ``teraio.core.slots.HostArena``),
            instead of in slots (``"auto"``: ``teraio.perf.choose.plan_fastest``).
        ssd_cap_bytes: most bytes the SSD tier's files may take (its slots in whole
            stripes, ``teraio.core.slots.ssd_file_bytes``): the room on its drives. A
            candidate whose SSD slot would pass it goes to host memory or stays; None: no
            cap. ``meta["ssd_file_bytes"]`` is what the plan's SSD slots take.
        recompute: also consider, per candidate, dropping the tensor and recomputing it
            before its next use (``teraio.core.recompute``; ``plan.recomputes``), ranked
            against the tiers (module docstring, "Recompute"; ``"auto"``:
            ``teraio.perf.choose.plan_fastest``).
        host_placement: the host tier placed by another rule than slots or the region, for
            estimates of other packings (``benchmarks/host_packing.py``): a callable
            ``host_placement(n_ops, a, b, host_cap_bytes)`` of the inactive periods' first
            and last ops (:class:`Periods`' ``a``, ``b``), returning an object with
            ``room(periods, nbytes)`` (bool per period: it fits), ``place(period, nbytes)``
            and ``held_bytes`` (the ``meta["slot_bytes"]["host"]`` of the plan), which
            places each period on its own: each host migration names its own tensor as its
            slot and has no offset. None (default): slots, or the region with ``host_arena``.

    Returns:
        the plan, migrations in the order chosen. If the peak cannot be brought under
        capacity, ``plan.predicted_peak_bytes > capacity_bytes`` and
        ``plan.shortfall_bytes`` says by how much (also in ``plan.meta``).

    Raises:
        ValueError: non-positive capacity, negative host or SSD cap, unknown benefit, a
            ``host_arena`` or ``recompute`` other than true or false (``"auto"`` is
            ``teraio.perf.choose.plan_fastest``'s), or no tier to migrate to
            (``use_ssd=False`` with ``host_cap_bytes=0``), or a ``host_placement`` that is
            not callable or comes with ``host_arena``.
    """
    for name, value in (("host_arena", host_arena), ("recompute", recompute)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}; valid: true or false ('auto' is chosen by simulation: "
                             "teraio.perf.choose.plan_fastest)")
    if host_placement is not None and (host_arena or not callable(host_placement)):
        raise ValueError(f"host_placement={host_placement!r} with host_arena={host_arena}; valid: a callable, "
                         "with host_arena=False")
    packing = "arena" if host_arena else "slots"
    return plan_packings(trace, capacity_bytes, tiers, host_cap_bytes, (packing,), benefit=benefit,
                         min_tensor_bytes=min_tensor_bytes, use_ssd=use_ssd, allow_stalls=allow_stalls,
                         shared_ssd=shared_ssd, ssd_cap_bytes=ssd_cap_bytes, recompute=recompute,
                         host_placement=host_placement)[packing]


def plan_packings(trace: Trace, capacity_bytes: int, tiers: TierBandwidth, host_cap_bytes: int,
                  packings: tuple[str, ...] = ("slots", "arena"), benefit: str = "pressure",
                  min_tensor_bytes: int = 1 << 20, use_ssd: bool = True, allow_stalls: bool = False,
                  shared_ssd: bool = True, ssd_cap_bytes: int | None = None, recompute: bool = False,
                  host_placement=None, candidates: "Candidates | None" = None) -> dict[str, MigrationPlan]:
    """:func:`plan_migrations` for each host packing of ``packings`` (``"slots"``,
    ``"arena"``: ``host_arena`` false, true), two planned as twins (module docstring): the
    plans ``host_arena="auto"`` chooses from (``teraio.perf.choose``). ``candidates``: what
    an earlier call on the same trace and ``min_tensor_bytes`` found (:class:`Candidates`),
    reused. Arguments and errors as :func:`plan_migrations`; ``packings`` must be one or
    both of ``"slots"``, ``"arena"``."""
    if not packings or not set(packings) <= {"slots", "arena"} or len(set(packings)) != len(packings):
        raise ValueError(f"packings={packings!r}; valid: one or both of 'slots', 'arena'")
    if not isinstance(capacity_bytes, (int, np.integer)) or capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes={capacity_bytes!r}; must be a positive int (bytes)")
    if host_cap_bytes < 0:
        raise ValueError(f"host_cap_bytes={host_cap_bytes!r}; must be >= 0 bytes")
    if ssd_cap_bytes is not None and ssd_cap_bytes < 0:
        raise ValueError(f"ssd_cap_bytes={ssd_cap_bytes!r}; must be >= 0 bytes or None")
    if benefit not in BENEFITS:
        raise ValueError(f"benefit={benefit!r}; valid: {BENEFITS}")
    if not use_ssd and host_cap_bytes == 0:
        raise ValueError("use_ssd=False with host_cap_bytes=0 leaves no tier to migrate to")
    if min_tensor_bytes < 0:
        raise ValueError(f"min_tensor_bytes={min_tensor_bytes!r}; must be >= 0")
    if candidates is None or candidates.trace is not trace or candidates.min_tensor_bytes != int(min_tensor_bytes):
        candidates = Candidates(trace, int(min_tensor_bytes))
    return _plan_packings(candidates, trace, int(capacity_bytes), tiers, int(host_cap_bytes), time.perf_counter(),
                          tuple(packings), recompute, benefit=benefit, use_ssd=use_ssd, allow_stalls=allow_stalls,
                          shared_ssd=shared_ssd, ssd_cap_bytes=None if ssd_cap_bytes is None else int(ssd_cap_bytes),
                          host_placement=host_placement)


class Candidates:
    """The candidate periods of a trace (:func:`inactive_periods`) and, once asked for, their
    :class:`RecomputeTable`: made once for all the plans of one trace (:func:`plan_packings`'
    ``candidates``)."""

    def __init__(self, trace: Trace, min_tensor_bytes: int):
        self.trace, self.min_tensor_bytes = trace, min_tensor_bytes
        self.periods = inactive_periods(trace, min_tensor_bytes)
        self._table: RecomputeTable | None = None
        self.meets: dict = {}  # the slots' rows of what each tensor's periods meet (SlotBins)
        self.required = trace.required_bytes()  # each op's bytes before any plan (M)

    @property
    def recompute_table(self) -> RecomputeTable:
        if self._table is None:
            self._table = RecomputeTable.of(self.trace, self.periods)
        return self._table


def _plan_packings(cands: Candidates, trace: Trace, capacity_bytes: int, tiers: TierBandwidth,
                   host_cap_bytes: int, t0: float, packings: tuple[str, ...], recompute: bool,
                   **options) -> dict[str, MigrationPlan]:
    """One plan per host packing of ``packings`` (``"slots"``, ``"arena"``: ``host_arena``
    false, true). With recompute, a plan whose memory does not fit is planned again with the
    other room rule and the smaller shortfall kept. Two packings are planned as twins
    (:func:`_run_twins`): their greedy runs are one until a room test tells them apart."""
    plans: dict[str, MigrationPlan] = {}
    for room in (("critical", "fits") if recompute else (None,)):
        todo = tuple(k for k in packings if k not in plans or not plans[k].feasible)
        if not todo:
            break
        planner = _Planner(trace, capacity_bytes, tiers, host_cap_bytes, options["benefit"], options["use_ssd"],
                           cands.periods, options["shared_ssd"], todo == ("arena",), options["ssd_cap_bytes"],
                           room, recompute_table=cands.recompute_table if recompute else None,
                           meets=cands.meets, host_placement=options["host_placement"], required=cands.required)
        meta = {"planner": "teraio.planner/1", "benefit": options["benefit"],
                "tiers_gbps": dataclasses.asdict(tiers), "host_cap_bytes": host_cap_bytes,
                "use_ssd": options["use_ssd"], "allow_stalls": options["allow_stalls"],
                "min_tensor_bytes": cands.min_tensor_bytes, "shared_ssd": options["shared_ssd"],
                "ssd_cap_bytes": options["ssd_cap_bytes"], "recompute": bool(recompute), "recompute_room": room}
        for k, (pl, migrations, stats) in _run_twins(planner, todo, trace, options["allow_stalls"]).items():
            other = _make_plan(pl, trace, capacity_bytes, migrations, stats, t0,
                               meta={**meta, "host_arena": k == "arena"})
            if k not in plans or other.shortfall_bytes < plans[k].shortfall_bytes:
                plans[k] = other
    return plans


def _run_twins(planner: _Planner, packings: tuple[str, ...], trace: Trace,
               allow_stalls: bool) -> dict[str, tuple[_Planner, list[Migration], dict]]:
    """Run ``planner`` (made for ``packings[0]``) and, with two packings, its region twin:
    one greedy run places in the slots and in the region alike while each answers every
    room test as the other, which makes it both packings' run so far; at the first test
    they answer differently it splits in two that carry on alone.

    Returns:
        packing -> (its planner, migrations, statistics).
    """
    if len(packings) == 2:
        planner.twin = HostArena(planner.n, planner.p_tid, planner.a, planner.b, planner.bins["host"].cap,
                                 align=HOST_ALIGN)
    try:
        ran = {packings[0]: (planner, *_phases(planner, trace, allow_stalls))}
    except _Diverged:
        arena = planner.split()
        return {"slots": (planner, *_phases(planner, trace, allow_stalls)),
                "arena": (arena, *_phases(arena, trace, allow_stalls))}
    if len(packings) == 2:  # never told apart: the region's plan is the slots' with its own places
        arena = planner.split()
        ran["arena"] = (arena, *_phases(arena, trace, allow_stalls))
    return ran


def _phases(planner: _Planner, trace: Trace, allow_stalls: bool) -> tuple[list[Migration], dict]:
    """Run ``planner``'s phases (the second with ``allow_stalls``), or carry them on after a
    :class:`_Diverged`: the migrations and the run's statistics."""
    if planner.baseline_peak <= planner.capacity:
        return [], {"n_candidates": len(planner.s), "evaluations": 0, "stop_reason": "fits"}
    migrations, stats = planner.run(trace)
    stats = dict(stats)
    if allow_stalls and stats["stop_reason"] != "fits":
        exposed, widened = planner.run_exposed(trace, migrations)
        migrations = migrations + exposed
        stats["n_exposed"], stats["n_widened"] = len(exposed), widened
        stats["stop_reason"] = "fits_with_stalls" if not planner.over() else \
            "no_candidate_left"
    return migrations, stats


def _make_plan(planner: _Planner, trace: Trace, capacity_bytes: int, migrations: list[Migration], stats: dict,
               t0: float, meta: dict) -> MigrationPlan:
    """The plan of a planner that ran (:func:`_phases`); ``meta`` holds the settings, to which
    the run's statistics are added."""
    predicted = int(planner.live.max()) if trace.n_ops else 0
    meta = {
        **meta, "n_exposed": 0, "n_widened": 0,
        "recomputed_bytes": sum(r.nbytes for r in planner.recomputes),
        "shortfall_bytes": max(0, predicted - capacity_bytes), **stats,
        "slot_bytes": {t: planner.bins[t].held_bytes for t in ("ssd", "host")},
        "ssd_file_bytes": planner.bins["ssd"].tier_bytes,
        "compile_seconds": time.perf_counter() - t0,
    }
    return MigrationPlan(n_ops=trace.n_ops, capacity_bytes=capacity_bytes, baseline_peak_bytes=planner.baseline_peak,
                         predicted_peak_bytes=predicted, migrations=migrations, meta=meta,
                         recomputes=list(planner.recomputes))


def predicted_live_bytes(trace: Trace, plan: MigrationPlan) -> np.ndarray:
    """int64 ``[n_ops]``: live bytes during each op with ``plan`` applied (``M'``): each
    migration's bytes are off the GPU over its cyclic window ``[free_before,
    prefetch_before)``; each recompute's over ``[drop_after + 1, recompute_before)``, its
    chain's ``extra_bytes`` added at op ``recompute_before``.

    Raises:
        ValueError: the plan was made for a trace with another op count.
    """
    n = trace.n_ops
    if plan.n_ops != n:
        raise ValueError(f"plan is for {plan.n_ops} ops but the trace has {n}")
    delta = np.zeros(n + 1, dtype=np.int64)
    for m in plan.migrations:
        lo, hi = m.free_before, m.prefetch_before
        for s, e in _cyclic_slices(lo, hi if hi > lo else hi + n, n):
            delta[s] -= m.nbytes
            delta[e] += m.nbytes
    for r in plan.recomputes:
        delta[r.drop_after + 1] -= r.nbytes
        delta[r.recompute_before] += r.nbytes + r.extra_bytes
        delta[r.recompute_before + 1] -= r.extra_bytes
    return trace.required_bytes() + np.cumsum(delta[:-1])


def reserved_bandwidth(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Replay ``plan``'s migrations, in plan order, on fresh bandwidth timelines.

    Exposed migrations (``allow_stalls``) reserve nothing: they are not planned to hide.
    Hidden migrations the exposed phase widened keep their original reservations.

    Returns:
        channel name (``CHANNELS``) -> (reserved bytes per op slot, capacity bytes per op
        slot), float64 ``[n_ops]`` each: the planned bandwidth use (paper Fig. 8 / 10(2)
        as planned rather than measured). For a plan made with ``shared_ssd`` the SSD
        tier is one channel, ``"ssd"``, in bytes at the write rate (reads counted by the
        drive time they take), in place of ``ssd_write`` and ``ssd_read``.

    Raises:
        ValueError: a migration's op indices are not what the fluid model gives for it
            (the plan was made with other bandwidths or for another trace).
    """
    n = trace.n_ops
    shared = plan.meta.get("shared_ssd", False)
    chans, scale = _channels(tiers, trace.op_seconds, shared)
    hidden = plan.migrations[:len(plan.migrations) - plan.meta.get("n_exposed", 0)]
    for m in hidden:
        a = m.offload_after
        b = m.needed_by if m.needed_by > a else m.needed_by + n
        cw, cr = TIER_CHANNELS[m.tier]
        f = chans[cw].reserve_offload(a + 1, m.nbytes * scale[cw])
        p = chans[cr].reserve_prefetch(b, m.nbytes * scale[cr])
        # A migration widened by the exposed phase keeps its reservation; its window only
        # grew around the replayed one (it frees earlier and/or comes back later).
        widened_ok = ((m.free_before - a) % n <= (f - a) % n
                      and (p - a) % n <= ((m.prefetch_before - a - 1) % n) + 1)
        if (f % n, p % n) != (m.free_before, m.prefetch_before) and not widened_ok:
            raise ValueError(f"migration of {m.name!r} after op {a}: replay gives free_before {f % n}, "
                             f"prefetch_before {p % n}; the plan says {m.free_before}, {m.prefetch_before}")
    if shared:
        chans = {"ssd": chans["ssd_write"], "host_d2h": chans["host_d2h"], "host_h2d": chans["host_h2d"]}
    return {c: (ch.reserved, ch.capacity) for c, ch in chans.items()}
