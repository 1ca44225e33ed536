"""The paper's performance model (§2.2, Fig. 3): replay an iteration of a
:class:`~teraio.core.trace.Trace` under a :class:`~teraio.core.plan.MigrationPlan` at given
bandwidths and predict its time and stalls.

Model
-----
* Op k runs for its profiled ``op_seconds[k]``; ops run one after another.
* Each (tier, direction) is a channel (``ssd_write``, ``ssd_read``, ``host_d2h``,
  ``host_h2d``) that moves one transfer at a time at the channel's full bandwidth. With
  ``shared_ssd`` the SSD tier's two channels share one queue: a drive serving one request
  at a time, reads at the read bandwidth and writes at the write bandwidth (the lent
  H200's single drive behaves so: its TeraIO-SSD iterations took the sum of the read and
  write times, not the larger, ``benchmarks/results/teraio_core_h200.json``).
  ``policy="fifo"`` (default) serves transfers whole in the order they are issued.
  ``policy="edf"`` serves the transfer with the earliest deadline (the op that waits for
  it) first, preempting a later-deadline one when an earlier-deadline one is issued: the
  order the planner's bandwidth model assumes. A plan whose windows fit the planner's
  model then never stalls (EDF is optimal on one channel with release times and
  deadlines), while FIFO can stall, because the planner reserves bandwidth in the order
  it chooses migrations, not in the order they are issued.
* For each migration: the offload is issued when op ``offload_after`` ends; before op
  ``free_before`` the run waits for it (a stall if not done) and frees the memory; before
  op ``prefetch_before`` the prefetch is issued; before op ``needed_by`` the run waits
  for it (a stall). Before an op the waits for frees come first, then prefetches are
  issued, then the waits for needed tensors, as the engine (``teraio.core.engine``) does.
* Migrations of persistent tensors may wrap across the iteration boundary; the model
  runs two iterations and reports the second, whose channels carry the transfers the
  first left in flight (steady state). In the first iteration, a transfer that belongs
  to the iteration before is taken as already done (the engine primes them before step
  one).
* A recompute (``plan.recomputes``) re-runs its chain's ops before op ``recompute_before``,
  after that op's waits, on the compute stream: its ``seconds`` add to that op's run.
* Ideal (paper §4, a GPU with unlimited memory) is the sum of op times. Memory is not
  modelled: the plan is trusted to fit.
"""
from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from teraio.core.bandwidth import CHANNELS, TIER_CHANNELS, TierBandwidth
from teraio.core.plan import MigrationPlan
from teraio.core.trace import Trace


@dataclasses.dataclass
class SimResult:
    """Predicted steady-state iteration.

    Attributes:
        iteration_seconds: predicted iteration time, s (= ideal + recompute + stall).
        ideal_seconds: sum of op times, s.
        recompute_seconds: time spent re-running ops of the plan's recomputes, s.
        stall_seconds: time spent waiting for transfers, s.
        stall_count: waits that lasted longer than zero.
        op_start_seconds: float64 ``[n_ops]``, when op k starts (after its waits; a
            recompute before op k runs from then on, as part of op k's run), seconds from
            the iteration's start.
        op_stall_seconds: float64 ``[n_ops]``, wait before op k, s.
        slot_bytes: channel -> float64 ``[n_ops]``, bytes the channel moved during op k's
            slot (its waits plus its run).
    """

    iteration_seconds: float
    ideal_seconds: float
    stall_seconds: float
    stall_count: int
    op_start_seconds: np.ndarray
    op_stall_seconds: np.ndarray
    slot_bytes: dict[str, np.ndarray]
    recompute_seconds: float = 0.0

    @property
    def normalized_throughput(self) -> float:
        """Ideal / predicted iteration time (paper Fig. 3's y axis), in (0, 1]."""
        return self.ideal_seconds / self.iteration_seconds if self.iteration_seconds > 0 else 1.0

    @property
    def slot_seconds(self) -> np.ndarray:
        """float64 ``[n_ops]``: length of op k's slot (wait + run), s."""
        return np.diff(np.append(self.op_start_seconds - self.op_stall_seconds, self.iteration_seconds))

    def bandwidth_gbps(self) -> dict[str, np.ndarray]:
        """channel -> float64 ``[n_ops]``: mean bandwidth used during op k's slot, GB/s
        (the paper's Fig. 8 / Fig. 10(2), modeled)."""
        secs = self.slot_seconds
        with np.errstate(divide="ignore", invalid="ignore"):
            return {c: np.where(secs > 0, b / secs / 1e9, 0.0) for c, b in self.slot_bytes.items()}


POLICIES: tuple[str, ...] = ("fifo", "edf")


def simulate(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth, policy: str = "fifo",
             shared_ssd: bool = False) -> SimResult:
    """Predict the steady-state iteration of ``trace`` under ``plan`` (module docstring).

    Args:
        trace: the profiled iteration (op times in seconds).
        plan: migrations with op indices into ``trace``.
        tiers: bandwidths in GB/s per tier and direction.
        policy: ``"fifo"`` or ``"edf"``, the order in which a channel serves transfers.
        shared_ssd: the SSD tier's reads and writes share one queue (module docstring).

    Raises:
        ValueError: unknown policy, a plan for another op count, or a migration whose ops
            are not in cyclic order offload_after < free_before <= prefetch_before <= needed_by.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}; valid: {POLICIES}")
    n = trace.n_ops
    if plan.n_ops != n:
        raise ValueError(f"plan is for {plan.n_ops} ops but the trace has {n}")
    iterations = 2
    total = iterations * n
    tau = trace.op_seconds
    run = tau.copy()  # each op's run, with the recomputes before it
    for r in plan.recomputes:
        run[r.recompute_before] += r.seconds

    # Each migration recurs every iteration: instance (migration, anchor), where the anchor
    # is the global op index (iteration * n + k) after which its offload is issued.
    off_after: dict[int, list[int]] = {}
    free_at: dict[int, list[int]] = {}
    pf_at: dict[int, list[int]] = {}
    need_at: dict[int, list[int]] = {}
    inst: list[tuple[int, int]] = []
    steps: list[tuple[int, int, int]] = []  # per migration: ops from offload_after to free, prefetch, need
    for mi, m in enumerate(plan.migrations):
        a = m.offload_after
        df, dp, db = (m.free_before - a) % n, (m.prefetch_before - a) % n, (m.needed_by - a) % n or n
        if not 0 < df <= dp <= db:
            raise ValueError(f"migration {mi} of {m.name!r}: ops offload_after={a}, free_before="
                             f"{m.free_before}, prefetch_before={m.prefetch_before}, needed_by="
                             f"{m.needed_by} are not in cyclic order")
        steps.append((df, dp, db))
        for it in range(-1, iterations):
            anchor = a + it * n
            if anchor + db < 0:
                continue
            i = len(inst)
            inst.append((mi, anchor))
            for g, events in ((anchor, off_after), (anchor + df, free_at), (anchor + dp, pf_at),
                              (anchor + db, need_at)):
                if 0 <= g < total:
                    events.setdefault(g, []).append(i)

    rates = {c: tiers.bytes_per_second(c) for c in CHANNELS}
    chans = {c: _Channel(policy, rates) for c in CHANNELS}
    if shared_ssd:
        chans["ssd_read"] = chans["ssd_write"]

    def transfer(i: int, direction: int) -> tuple[_Channel, tuple, int, int, str]:
        """(channel, key, bytes, deadline op, channel name) of instance i's offload (0) or
        prefetch (1)."""
        mi, anchor = inst[i]
        m = plan.migrations[mi]
        df, _, db = steps[mi]
        name = TIER_CHANNELS[m.tier][direction]
        return chans[name], (i, direction), m.nbytes, anchor + (df if direction == 0 else db), name

    boundary = np.zeros(total + 1)
    op_start = np.zeros(total)
    op_stall = np.zeros(total)
    stalls = np.zeros(total, dtype=np.int64)

    def wait(g: int, i: int, direction: int, t: float) -> float:
        """Time once instance i's transfer is done (a stall at op g if later than t)."""
        ch, key, _, _, _ = transfer(i, direction)
        if key not in ch.issued:  # it moved before step one
            return t
        done = ch.done_time(key, t)
        if done > t:
            stalls[g] += 1
            return done
        return t

    t = 0.0
    for g in range(total):
        boundary[g] = t
        t0 = t
        for i in free_at.get(g, ()):
            t = wait(g, i, 0, t)
        for i in pf_at.get(g, ()):
            ch, key, nbytes, dl, name = transfer(i, 1)
            ch.issue(t, key, nbytes, dl, name)
        for i in need_at.get(g, ()):
            t = wait(g, i, 1, t)
        op_stall[g] = t - t0
        op_start[g] = t
        t += run[g % n]
        for i in off_after.get(g, ()):
            ch, key, nbytes, dl, name = transfer(i, 0)
            ch.issue(t, key, nbytes, dl, name)
    boundary[total] = t

    first = (iterations - 1) * n
    last = slice(first, total)
    ideal = float(tau.sum())
    stall = float(op_stall[last].sum())
    recompute = float(run.sum() - ideal)
    slot_bytes = {c: np.diff(_bytes_done_by([p for p in ch.pieces if p[3] == c], boundary[first:]))
                  for c, ch in chans.items()}
    return SimResult(iteration_seconds=ideal + recompute + stall, ideal_seconds=ideal, stall_seconds=stall,
                     recompute_seconds=recompute,
                     stall_count=int(stalls[last].sum()), op_start_seconds=op_start[last] - boundary[first],
                     op_stall_seconds=op_stall[last].copy(), slot_bytes=slot_bytes)


class _Channel:
    """A queue that serves issued transfers one at a time, each at its own rate (bytes/s),
    lazily, up to the time the replay asks about. FIFO: whole, in issue order. EDF:
    earliest deadline first, preempted when an earlier deadline is issued. One per
    (tier, direction), or one for both SSD directions (``shared_ssd``)."""

    def __init__(self, policy: str, rates: dict[str, float]):
        self.fifo = policy == "fifo"
        self.rates = rates  # bytes/s per channel name
        self.time = 0.0  # everything before this is served
        self.queue: list[tuple[int, int, tuple]] = []  # heap of (priority, issue order, key)
        self.left: dict[tuple, float] = {}  # seconds of service left
        self.channel: dict[tuple, str] = {}
        self.done: dict[tuple, float] = {}
        self.issued: set[tuple] = set()
        self.pieces: list[tuple[float, float, float, str]] = []  # (start, end, bytes, channel) served
        self._seq = 0

    def issue(self, t: float, key: tuple, nbytes: int, deadline: int, channel: str) -> None:
        self._serve(until=t)
        heapq.heappush(self.queue, (self._seq if self.fifo else deadline, self._seq, key))
        self._seq += 1
        self.left[key] = nbytes / self.rates[channel]
        self.channel[key] = channel
        self.issued.add(key)

    def done_time(self, key: tuple, t: float) -> float:
        """When ``key`` completes; nothing is issued meanwhile, as the replay waits for it."""
        self._serve(until=t)
        while key not in self.done:
            self._serve(until=np.inf, one=True)
        return self.done[key]

    def _serve(self, until: float, one: bool = False) -> None:
        while self.queue and self.time < until:
            key = self.queue[0][2]
            need, channel = self.left[key], self.channel[key]
            if self.time + need <= until:
                self.pieces.append((self.time, self.time + need, need * self.rates[channel], channel))
                self.time += need
                self.done[key] = self.time
                heapq.heappop(self.queue)
                del self.left[key]
                if one:
                    return
            else:
                served = until - self.time
                self.pieces.append((self.time, until, served * self.rates[channel], channel))
                self.left[key] -= served
                self.time = until
        if not self.queue and until < np.inf:
            self.time = max(self.time, until)


def _bytes_done_by(pieces: list[tuple[float, float, float]], times: np.ndarray) -> np.ndarray:
    """Bytes a channel has moved by each of ``times`` (its pieces are in time order and
    never overlap)."""
    if not pieces:
        return np.zeros(len(times))
    start, end, nbytes = (np.asarray(x, dtype=np.float64) for x in list(zip(*pieces))[:3])
    before = np.concatenate([[0.0], np.cumsum(nbytes)])
    i = np.searchsorted(start, times, side="right") - 1
    j = np.maximum(i, 0)
    part = nbytes[j] * np.clip((times - start[j]) / (end[j] - start[j]), 0.0, 1.0)
    return np.where(i >= 0, before[j] + part, 0.0)
