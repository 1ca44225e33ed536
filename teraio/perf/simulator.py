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
* With ``step_sync`` each iteration ends as a measured step does, with the device
  synchronised: op 0 of the next iteration waits until every channel is empty, and the
  offloads launched after the last op are issued after that wait (``simulate``).
* A recompute (``plan.recomputes``) re-runs its chain's ops before op ``recompute_before``,
  after that op's waits, on the compute stream: its ``seconds`` add to that op's run.
* A parameter updated in host memory (``trace.meta["host_update"]``,
  ``Trace.with_host_update``; ``teraio.core.host_update``): its gradient goes to host memory
  on the ``host_d2h`` channel when op ``grad_write`` ends; the host's AdamW, one parameter at
  a time in the order their gradients arrive, takes ``nbytes / host_update_gbps`` once it
  is there; the updated parameter comes back on the ``host_h2d`` channel once that is done
  and the next iteration has started (after its step sync, with ``step_sync``), and op
  ``first_use`` of the next iteration waits for it.
  FIFO channels only (an update's times are read as it is issued).
* Ideal (paper §4, a GPU with unlimited memory) is the sum of op times. Memory is not
  modelled: the plan is trusted to fit.
"""
from __future__ import annotations

import collections
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
_ITERATIONS = 2  # replayed; the last is reported (module docstring)


def simulate(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth, policy: str = "fifo",
             shared_ssd: bool = False, host_update_gbps: float | None = None,
             stream_frees: bool = False, step_sync: bool = False) -> SimResult:
    """Predict the steady-state iteration of ``trace`` under ``plan`` (module docstring).

    Args:
        trace: the profiled iteration (op times in seconds).
        plan: migrations with op indices into ``trace``.
        tiers: bandwidths in GB/s per tier and direction.
        policy: ``"fifo"`` or ``"edf"``, the order in which a channel serves transfers.
        shared_ssd: the SSD tier's reads and writes share one queue (module docstring).
        host_update_gbps: GB of parameters the host's AdamW updates per second; needed
            where the trace has parameters updated in host memory.
        stream_frees: a host-tier offload's ``free_before`` is no wait: the engine with
            ``device_waits`` frees the storage at once and the caching allocator holds its
            memory until the copy ran (``teraio.core.engine``); the memory is then reused
            later than planned, which the model does not see.
        step_sync: each iteration ends with the device synchronised, as the measurement
            loop ends each step (``teraio.systems.loop``): before op 0 of the next iteration
            the run waits until every channel has served what it was given (a stall of op
            0), and the offloads launched after the last op are issued after that wait, as
            the engine launches them as the next step starts. Without it, copies run on
            across the boundary (the steady state of a loop that never synchronises).

    Raises:
        ValueError: unknown policy, a plan for another op count, a migration whose ops
            are not in cyclic order offload_after < free_before <= prefetch_before <= needed_by,
            or host updates without a positive ``host_update_gbps`` or with EDF.
    """
    return _simulate(trace, plan, tiers, policy, shared_ssd, host_update_gbps, stream_frees, step_sync)[0]


def _simulate(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth, policy: str, shared_ssd: bool,
              host_update_gbps: float | None, stream_frees: bool = False,
              step_sync: bool = False) -> tuple[SimResult, "_Transfers", dict, np.ndarray]:
    """:func:`simulate`, and the replay's transfers, channels and op slot boundaries."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}; valid: {POLICIES}")
    n = trace.n_ops
    if plan.n_ops != n:
        raise ValueError(f"plan is for {plan.n_ops} ops but the trace has {n}")
    total = _ITERATIONS * n
    transfers = _Transfers(plan, n, total)
    if stream_frees:
        transfers.stream_frees()
    updates = trace.meta.get("host_update") or {}
    if updates:
        if not (host_update_gbps and host_update_gbps > 0) or policy != "fifo":
            raise ValueError(f"the trace updates {len(updates)} parameters in host memory: simulate them with "
                             f"policy='fifo' and a positive host_update_gbps (got {policy!r}, {host_update_gbps!r})")
        transfers.add_host_updates(updates, n, total, host_update_gbps * 1e9)
    tau = trace.op_seconds
    run = tau.copy()  # each op's run, with the recomputes before it
    for r in plan.recomputes:
        run[r.recompute_before] += r.seconds
    rates = {c: tiers.bytes_per_second(c) for c in CHANNELS}
    chans = {c: _Channel(policy, rates) for c in CHANNELS}
    if shared_ssd:
        chans["ssd_read"] = chans["ssd_write"]
    boundary, op_start, op_stall, stalls = _replay(run.tolist(), transfers, chans, step_sync)

    first = (_ITERATIONS - 1) * n
    last = slice(first, total)
    ideal = float(tau.sum())
    stall = float(op_stall[last].sum())
    recompute = float(run.sum() - ideal)
    slot_bytes = {c: np.diff(ch.bytes_done_by(c, boundary[first:])) for c, ch in chans.items()}
    return (SimResult(iteration_seconds=ideal + recompute + stall, ideal_seconds=ideal, stall_seconds=stall,
                     recompute_seconds=recompute,
                     stall_count=int(stalls[last].sum()), op_start_seconds=op_start[last] - boundary[first],
                     op_stall_seconds=op_stall[last].copy(), slot_bytes=slot_bytes),
            transfers, chans, boundary)


def served_launches(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth, policy: str = "edf",
                    shared_ssd: bool = False, stream_frees: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Where each migration's copies would be launched so that channels serving them in
    launch order (FIFO, as CUDA streams do) start them when ``policy`` started them: per
    migration, the last op after which its offload can be launched (int64 ``[n_migrations]``)
    and the last op before which its prefetch can be, each no earlier than ``plan``'s own
    launch (``Migration.offload_launch``, ``prefetch_launch``) and still in its window
    (the offload before ``free_before``, the prefetch before ``needed_by`` where it was), in
    the iteration it was launched in, in the steady-state iteration :func:`simulate`
    reports. A copy the policy never served there keeps its launch.

    Raises:
        ValueError: as :func:`simulate`, or a trace with host updates (FIFO only).
    """
    _, transfers, chans, boundary = _simulate(trace, plan, tiers, policy, shared_ssd, None, stream_frees)
    n = trace.n_ops
    started: dict[int, float] = {}
    for ch in {id(c): c for c in chans.values()}.values():
        started.update(ch.started)
    ms = plan.migrations
    out = (np.array([m.offload_launch for m in ms], np.int64), np.array([m.prefetch_launch for m in ms], np.int64))
    ops = transfers.ops
    for j, mi in enumerate(transfers.migration):
        for kind, key, due, shift in (("offload", 2 * j, "free", 2), ("prefetch", 2 * j + 1, "need", 1)):
            g = int(ops[kind][j])
            if not n <= g < 2 * n or key not in started:
                continue
            # the last op whose launch (after op g - 1 ends, or before op g starts) is at or
            # before the start served: boundary[i] is where op i's slot starts
            served = int(np.searchsorted(boundary, started[key], side="right")) - shift
            last = int(ops[due][j]) - 1 if kind == "offload" else max(g, int(ops[due][j]) - 1)
            last = min(last, (g // n) * n + n - 1)  # in the iteration it was launched in
            out[kind == "prefetch"][mi] = min(max(served, g), last) % n
    return out


def late_offloads(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth, shared_ssd: bool = False,
                  stream_frees: bool = False, host_update_gbps: float | None = None) -> np.ndarray:
    """Per migration of ``plan`` (bool ``[n_migrations]``): whether its offload, launched in
    the steady-state iteration :func:`simulate` reports and freed in the next one (its window
    crosses the iteration boundary), is still copying when that iteration's last op ends, in
    a FIFO replay at ``tiers`` (``shared_ssd``, ``stream_frees``, ``host_update_gbps`` as for
    :func:`simulate`): the copies a step that ends with a device sync waits for
    (``teraio.perf.retime``).

    Raises:
        ValueError: as :func:`simulate` (a trace with host updates needs ``host_update_gbps``).
    """
    _, transfers, chans, boundary = _simulate(trace, plan, tiers, "fifo", shared_ssd, host_update_gbps, stream_frees)
    first, total = (_ITERATIONS - 1) * trace.n_ops, _ITERATIONS * trace.n_ops
    end = boundary[total]
    late = np.zeros(len(plan.migrations), dtype=bool)
    for j, mi in enumerate(transfers.migration):
        launched, freed = int(transfers.ops["offload"][j]), int(transfers.ops["free"][j])
        if first <= launched < total <= freed:
            key = 2 * j
            late[mi] |= chans[transfers.channel[key]].done_time(key, end) > end
    return late


class _Transfers:
    """The transfers of a plan's migrations over the replayed iterations, and when the
    replay meets them.

    Each migration recurs every iteration: an instance per anchor, the global op index
    (iteration * n + k) after which its offload is issued, from the iteration before the
    first on (its transfers that the first iteration waits for moved before step one).
    Instance j's offload is transfer ``2j``, its prefetch ``2j + 1``: per transfer its
    channel name, bytes and deadline (the op that waits for it). Per event kind, the ops
    and transfers in the order the replay meets them (by op, then by instance), with the
    op ``-1`` after the last: ``offload`` (issued after the op), ``free`` (waited for before
    it), ``prefetch`` (issued before it), ``need`` (waited for before it).

    Raises:
        ValueError: a migration whose ops are not in cyclic order.
    """

    KINDS = ("offload", "free", "prefetch", "need")

    def __init__(self, plan: MigrationPlan, n: int, total: int):
        ms = plan.migrations
        a, f, p, b, nbytes, la, lb = (np.fromiter((getattr(m, x) for m in ms), np.int64, len(ms))
                                      for x in ("offload_after", "free_before", "prefetch_before", "needed_by",
                                                "nbytes", "offload_launch", "prefetch_launch"))
        df, dp, db, dla, dlb = (f - a) % n, (p - a) % n, (b - a) % n, (la - a) % n, (lb - a) % n
        db[db == 0] = n
        dlb[(dlb == 0) & (dp > 0)] = n  # launched before its use, which is op a of the next iteration
        bad = (~((0 < df) & (df <= dp) & (dp <= db) & (dla < df) & (dp <= dlb) & (dlb <= db))).nonzero()[0]
        if bad.size:
            mi = int(bad[0])
            m = ms[mi]
            raise ValueError(f"migration {mi} of {m.name!r}: ops offload_after={m.offload_after}, free_before="
                             f"{m.free_before}, prefetch_before={m.prefetch_before}, needed_by="
                             f"{m.needed_by} (launches after {m.offload_launch}, before {m.prefetch_launch}) "
                             "are not in cyclic order")
        anchor = a[:, None] + np.arange(-1, _ITERATIONS) * n  # [migration, iteration]
        keep = anchor + db[:, None] >= 0
        mi = np.broadcast_to(np.arange(len(ms))[:, None], anchor.shape)[keep]  # per instance, in order
        anchor = anchor[keep]
        self.migration = mi  # per instance
        # per instance: the global ops of its offload's launch and deadline, and its prefetch's
        self.ops = {"offload": anchor + dla[mi], "free": anchor + df[mi],
                    "prefetch": anchor + dlb[mi], "need": anchor + db[mi]}
        names = np.array([TIER_CHANNELS[m.tier] for m in ms], dtype=object).reshape(-1, 2)
        self.channel: list[str] = names[mi].ravel().tolist()
        self.nbytes: list[int] = np.repeat(nbytes[mi], 2).tolist()
        self.deadline: list[int] = np.stack([self.ops["free"], self.ops["need"]], axis=1).ravel().tolist()
        key = 2 * np.arange(len(anchor))
        deadline_order = plan.meta.get("copy_order") == "deadline"  # as the engine launches them
        self.events: dict[str, tuple[list[int], list[int]]] = {}
        for kind, k, due in (("offload", key, "free"), ("free", key, None),
                             ("prefetch", key + 1, "need"), ("need", key + 1, None)):
            g = self.ops[kind]
            inside = (0 <= g) & (g < total)
            g, k = g[inside], k[inside]
            if deadline_order and due is not None:
                order = np.lexsort((self.ops[due][inside], g))
            else:
                order = np.argsort(g, kind="stable")
            self.events[kind] = (g[order].tolist() + [-1], k[order].tolist())
        # host updates (add_host_updates): per op, the gradients sent after it, the updates
        # started after it (their gradient's last write), the refreshed parameters waited
        # for before it; per refresh key, its parameter's first use (the engine's copy order)
        self.grads: dict[int, list[int]] = {}
        self.updated: dict[int, list[int]] = {}
        self.refreshed: dict[int, list[int]] = {}
        self.first_use: dict[int, int] = {}
        self.update_seconds: dict[int, float] = {}  # per gradient key: the host AdamW's seconds

    def stream_frees(self) -> None:
        """Drop the waits for host-tier offloads (``simulate``'s ``stream_frees``)."""
        g, k = self.events["free"]
        kept = [i for i, key in enumerate(k) if not self.channel[key].startswith("host")]
        self.events["free"] = ([g[i] for i in kept] + [-1], [k[i] for i in kept])

    def add_host_updates(self, updates: dict, n: int, total: int, bytes_per_s: float) -> None:
        """Each iteration's host update of each parameter of ``updates``
        (``Trace.with_host_update``'s ``meta["host_update"]``): its gradient's transfer
        (``host_d2h``) and its refreshed parameter's (``host_h2d``, key + 1), when the replay
        meets them (module docstring)."""
        for u in updates.values():
            for it in range(_ITERATIONS):
                key = len(self.channel)
                self.channel += ["host_d2h", "host_h2d"]
                self.nbytes += [u["nbytes"], u["nbytes"]]
                need = (it + 1) * n + u["first_use"]
                self.deadline += [it * n + u["last_use"], need]
                self.update_seconds[key] = u["nbytes"] / bytes_per_s
                self.grads.setdefault(it * n + u["grad_write"], []).append(key)
                self.updated.setdefault(it * n + u["grad_write"], []).append(key)
                self.first_use[key + 1] = u["first_use"]
                if need < total:
                    self.refreshed.setdefault(need, []).append(key + 1)


def _replay(run: list[float], transfers: _Transfers, chans: dict[str, "_Channel"], step_sync: bool = False):
    """Replay the iterations (module docstring): before each op the waits for frees, then
    the prefetches issued, then the waits for needed tensors; after it the offloads issued.
    A transfer never issued moved before step one (no wait). With ``step_sync``
    (:func:`simulate`), before op 0 of each iteration after the first, the wait for every
    channel to drain, then the offloads launched after the iteration before's last op.

    Returns:
        (boundary: float64 ``[total + 1]``, when each op's slot starts, and the end;
        op_start, op_stall: float64 ``[total]``; stalls: int64 ``[total]``, waits that
        lasted longer than zero).
    """
    n = len(run)
    total = _ITERATIONS * n
    chan = [chans[c] for c in transfers.channel]
    nbytes, deadline, name = transfers.nbytes, transfers.deadline, transfers.channel
    issued = bytearray(len(chan))
    (off_g, off_k), (free_g, free_k), (pf_g, pf_k), (need_g, need_k) = (transfers.events[k]
                                                                        for k in _Transfers.KINDS)
    jo = jf = jp = jn = 0
    boundary, op_start, op_stall = [0.0] * (total + 1), [0.0] * total, [0.0] * total
    stalls = [0] * total
    run = run * _ITERATIONS  # op g runs run[g]
    t = 0.0
    cpu = 0.0  # the host's AdamW is busy until then
    ready: list[tuple[float, int, int]] = []  # (when, first use, key): refreshed parameters, their update done by then
    later: list[tuple[float, int, int]] = []  # this iteration's: ready once the next one starts
    queues = list({id(c): c for c in chans.values()}.values())
    held: list[int] = []  # step_sync: offloads launched after the last op, issued after the sync
    for g in range(total):
        boundary[g] = t
        t0 = t
        if step_sync and g and g % n == 0:
            for q in queues:
                t = max(t, q.drained())
            stalls[g] += t > t0
            for key in held:
                chan[key].issue(t, key, nbytes[key], deadline[key], name[key])
                issued[key] = 1
            held.clear()
        if g % n == 0 and later:  # the last iteration's updates: copied back from now on
            for when, first, key in later:
                heapq.heappush(ready, (max(when, t), first, key))
            later.clear()
        while ready and ready[0][0] <= t:  # refreshes whose update is done, by then and first use
            when, _, key = heapq.heappop(ready)
            chan[key].issue(when, key, nbytes[key], deadline[key], name[key])
            issued[key] = 1
        while free_g[jf] == g:
            key = free_k[jf]
            jf += 1
            if issued[key]:
                done = chan[key].done_time(key, t)
                if done > t:
                    stalls[g] += 1
                    t = done
        while pf_g[jp] == g:
            key = pf_k[jp]
            jp += 1
            chan[key].issue(t, key, nbytes[key], deadline[key], name[key])
            issued[key] = 1
        while need_g[jn] == g:
            key = need_k[jn]
            jn += 1
            if issued[key]:
                done = chan[key].done_time(key, t)
                if done > t:
                    stalls[g] += 1
                    t = done
        for key in transfers.refreshed.get(g, ()):
            if not issued[key]:  # its update ends later: issued then, and waited for
                entry = next(e for e in ready if e[2] == key)
                when = entry[0]
                ready.remove(entry)
                heapq.heapify(ready)
                chan[key].issue(when, key, nbytes[key], deadline[key], name[key])
                issued[key] = 1
            done = chan[key].done_time(key, t)
            if done > t:
                stalls[g] += 1
                t = done
        op_stall[g] = t - t0
        op_start[g] = t
        t += run[g]
        while off_g[jo] == g:
            key = off_k[jo]
            jo += 1
            if step_sync and g % n == n - 1:
                held.append(key)
                continue
            chan[key].issue(t, key, nbytes[key], deadline[key], name[key])
            issued[key] = 1
        for key in transfers.grads.get(g, ()):
            chan[key].issue(t, key, nbytes[key], deadline[key], name[key])
            issued[key] = 1
        for key in transfers.updated.get(g, ()):  # FIFO: its gradient's arrival is known now
            cpu = max(cpu, chan[key].done_time(key, t)) + transfers.update_seconds[key]
            later.append((max(cpu, t), transfers.first_use[key + 1], key + 1))
    boundary[total] = t
    return np.array(boundary), np.array(op_start), np.array(op_stall), np.array(stalls, dtype=np.int64)


class _Channel:
    """A queue that serves issued transfers one at a time, each at its own rate (bytes/s),
    lazily, up to the time the replay asks about. FIFO: whole, in issue order. EDF:
    earliest deadline first, preempted when an earlier deadline is issued. One per
    (tier, direction), or one for both SSD directions (``shared_ssd``). Transfers are
    named by int keys (:class:`_Transfers`); what it served is kept as pieces
    (start, end, bytes, channel name), in time order, in four lists."""

    def __init__(self, policy: str, rates: dict[str, float]):
        self.fifo = policy == "fifo"
        self.rates = rates  # bytes/s per channel name
        self.time = 0.0  # everything before this is served
        self.queue: list = collections.deque() if self.fifo else []  # keys; EDF: heap of (deadline, seq, key)
        self.left: dict[int, float] = {}  # seconds of service left
        self.channel: dict[int, str] = {}
        self.done: dict[int, float] = {}
        self.started: dict[int, float] = {}  # when each transfer was first served
        self.pieces: tuple[list[float], list[float], list[float], list[str]] = ([], [], [], [])
        self._seq = 0

    def issue(self, t: float, key: int, nbytes: int, deadline: int, channel: str) -> None:
        self._serve_to(t)
        if self.fifo:
            self.queue.append(key)
        else:
            heapq.heappush(self.queue, (deadline, self._seq, key))
        self._seq += 1
        self.left[key] = nbytes / self.rates[channel]
        self.channel[key] = channel

    def done_time(self, key: int, t: float) -> float:
        """When ``key`` completes; nothing is issued meanwhile, as the replay waits for it."""
        self._serve_to(t)
        while key not in self.done:
            self._serve(until=_INF, one=True)
        return self.done[key]

    def drained(self) -> float:
        """When the queue is empty: everything issued so far served (nothing is issued
        meanwhile, as the replay waits for it)."""
        if self.queue:
            self._serve(until=_INF)
        return self.time

    def _serve_to(self, t: float) -> None:
        """:meth:`_serve` up to ``t``; an empty queue only moves its clock on."""
        if self.queue:
            self._serve(until=t)
        elif t > self.time:
            self.time = t

    def _serve(self, until: float, one: bool = False) -> None:
        queue, start, end, served_bytes, names = self.queue, *self.pieces
        while queue and self.time < until:
            key = queue[0] if self.fifo else queue[0][2]
            need, channel = self.left[key], self.channel[key]
            if key not in self.started:
                self.started[key] = self.time
            start.append(self.time)
            names.append(channel)
            if self.time + need <= until:
                end.append(self.time + need)
                served_bytes.append(need * self.rates[channel])
                self.time += need
                self.done[key] = self.time
                queue.popleft() if self.fifo else heapq.heappop(queue)
                del self.left[key]
                if one:
                    return
            else:
                served = until - self.time
                end.append(until)
                served_bytes.append(served * self.rates[channel])
                self.left[key] -= served
                self.time = until
        if not queue and until < _INF:
            self.time = max(self.time, until)

    def bytes_done_by(self, channel: str, times: np.ndarray) -> np.ndarray:
        """Bytes this queue moved for ``channel`` by each of ``times`` (its pieces are in
        time order and never overlap)."""
        mine = np.asarray(self.pieces[3]) == channel
        if not mine.any():
            return np.zeros(len(times))
        start, end, nbytes = (np.asarray(x, dtype=np.float64)[mine] for x in self.pieces[:3])
        before = np.concatenate([[0.0], np.cumsum(nbytes)])
        i = np.searchsorted(start, times, side="right") - 1
        j = np.maximum(i, 0)
        part = nbytes[j] * np.clip((times - start[j]) / (end[j] - start[j]), 0.0, 1.0)
        return np.where(i >= 0, before[j] + part, 0.0)


_INF = float("inf")
