"""Migration engine: runs a :class:`~teraio.core.plan.MigrationPlan` during training (paper §3.3).

The paper inserts offload/prefetch instructions into the compiled execution graph; we run
in the same ``TorchDispatchMode`` position as the profiler, so op k of every iteration is
op k of the profiled trace. Around each op k:

* before k: for migrations whose ``free_before`` is k, wait for the offload write (a stall
  if not done) and free the HBM with ``untyped_storage().resize_(0)``; for those whose
  prefetch is launched before k (``Migration.prefetch_launch``: ``prefetch_before``, or
  later where the plan put its copies in deadline order), re-allocate with
  ``resize_(nbytes)`` and launch the read; for ``needed_by`` k, wait for
  the read (a stall if not done). Anything op k touches that is still off the device and was
  not planned is fetched at once ("urgent", paper §3.2) and counted.
* after k: register the storages of planned intermediates that op k allocated, and launch
  the offloads launched after k (``Migration.offload_launch``: ``offload_after``, or later).
  Those launched after the step's last op are launched as the next step starts, before its
  op 0: after the host has read the step's result, so that the loss read and the training
  loop's sync at the step's end do not wait for them (``teraio.perf.retime``'s
  ``defer_tail_offloads``); their tensors stay resident until then, and an engine that
  ends there (``close``, ``hand_back``) leaves them so.
* an out-of-memory error in op k (memory the plan does not see: workspaces, fragmentation,
  tensors held past their profiled last use) frees again the tensor prefetched ahead whose
  use is furthest from k (its read finished first; its tier slot still holds its bytes until
  its use, ``teraio.core.slots``) and runs op k again, until the op fits or no such tensor is
  left; each dropped tensor comes back at its use, as an urgent fetch. An op fails at
  allocation, before it writes anything. On CUDA the first retry only releases the caching
  allocator's unused memory (``torch.cuda.empty_cache``: with expandable segments, the free
  pages between live blocks that fragmentation holds, which the process's cap still counts).
  A planned prefetch whose allocation does not fit even then is left undone: its tensor is
  read at its use instead (a stall there); an allocation at a tensor's use that does not fit
  frees tensors prefetched ahead as an op does. Once none is left, an op or an allocation at
  a use *spills*: it copies the resident tensor whose next use is furthest after op k (a
  tensor of the plan, or a parameter, buffer or optimizer state on the device that the plan
  leaves there; none of op k's own inputs, none with a transfer in flight) to host memory,
  frees its device bytes and tries again, one tensor per attempt, releasing the allocator's
  unused memory again before each try; a spilled tensor comes back from that copy at its
  planned prefetch or its use, whichever comes first, and a planned offload of it meanwhile
  is skipped (its bytes are already off the device). The error propagates when nothing is
  left to spill. Counted per step (``oom_retries``, ``dropped_bytes``,
  ``deferred_prefetches``, ``spilled_bytes``); the error's note names the allocator's free
  blocks (:func:`free_blocks_note`), which tell fragmentation from a plan that did not fit.

A plan's recomputes (``plan.recomputes``, the planner's third option) run here too: after
op ``drop_after`` the tensor's storage is freed as an offload's is (without a write), the
calls of its chain's ops are recorded as they run, and before op ``recompute_before`` the
chain runs again and its result's bytes go into the tensor's own storage
(``teraio.core.rerun`` says how and why this stays bit-exact). A use of a dropped tensor
before then makes it again at once (urgent). Counted per step (``recomputed_bytes``,
``recompute_seconds``).

Tensor objects and the autograd graph stay intact (the FSDP technique): only the storage's
bytes come and go. Reads write through a fresh tensor set on the storage (inside the tier),
so no tensor's autograd version counter moves. Ordering with CUDA events (recorded by the
tier on the compute stream when the engine calls it, right after op k): an offload's I/O
waits for the ops queued before it (no write-out before the producer finished); a
prefetch's I/O waits for the ops queued before the re-allocation (the reused memory's
earlier readers are done); the storage is freed only once the write completed.

With ``device_waits`` (host-tier copies on a CUDA device only) the training thread does not
block on those: a prefetch's ``needed_by`` wait becomes a wait of the compute stream on the
copy's CUDA event, and an offloaded storage is freed as soon as op k is issued, the caching
allocator holding its memory until the copy ran (``record_stream`` in the host tier; PyTorch
"CUDA semantics"). The paper's runtime stalls kernels, not the host (§3.2); this keeps the
host issuing kernels ahead of the GPU. A stall is then the compute stream's measured wait.
Those freed bytes stay the allocator's until the copies ran on the GPU, behind the host; with
``pending_limit_bytes`` the host waits for the copies freed first where the plan's live bytes and
those would pass it (``teraio.core.pending``).

With ``release_grads`` the engine also frees each gradient's storage right after its last
use (its parameter's update inside ``optimizer.step``) instead of leaving it to
``zero_grad`` after the whole step: ``param.grad`` otherwise holds every gradient through
the step, bytes the plan can neither move nor free (``Trace.held_grad_bytes``). Plan with
``Trace.with_released_grads`` then.

The first step an engine runs is audited: it keeps a weak reference to every storage an op
allocates, and on CUDA the allocator's bytes after each op, so that an out-of-memory error in
that step names the intermediates still alive past their profiled last use
(:meth:`MigrationEngine.lingering`) and the first op after which the allocator held more
than the plan accounts there (:meth:`MigrationEngine.overrun`); a step that ends well keeps
the overruns and what lingered at the largest (``StepStats.audit``). Later steps skip the
bookkeeping.

Everything is per engine instance (per process, per GPU): no module-level state.
"""
from __future__ import annotations

import concurrent.futures
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from teraio.core.host_update import HostUpdate
from teraio.core.pending import PendingFrees
from teraio.core.plan import Migration, MigrationPlan, cyclic_between
from teraio.core.planner import predicted_live_bytes
from teraio.core.profiler import fresh_outputs, iter_tensors, storage_id, storage_key
from teraio.core.rerun import Reruns
from teraio.core.tiers.base import Transfer, byte_view
from teraio.core.trace import Trace, parse_intermediate

RESIDENT, OFFLOADING, OFFLOADED, PREFETCHING = "resident", "offloading", "offloaded", "prefetching"
# The :class:`StepStats` fields that count the engine's unplanned work in a step: fetches the
# plan did not make, and what out-of-memory retries freed or put off.
RECOVERY_KEYS = ("urgent_count", "oom_retries", "dropped_bytes", "deferred_prefetches", "spilled_bytes")


class ExecutionDivergedError(RuntimeError):
    """The training step ran a different op sequence than the profiled trace."""


class PlanDriftError(ValueError):
    """A step's workload shape differs from the profiled one's, so the plan's tensors and op
    indices do not describe it; raised before the step touches anything."""


SHAPE_KEYS: tuple[str, ...] = ("batch_size", "micro_batch_size", "seq_len")


# the CUDA caching allocator's largest small-pool block (kSmallSize, c10/cuda/CUDACachingAllocator.cpp)
SMALL_POOL_BYTES = 1 << 20
_DEFERRED = object()  # what MigrationEngine._until_fits returns for a deferrable attempt it gave up


@dataclass
class _Tensor:
    name: str
    nbytes: int
    persistent: bool
    storage: torch.UntypedStorage | None = None
    status: str = RESIDENT
    job: Future | None = None
    tier: str | None = None
    transfer: dict | None = None  # the in-flight transfer's log row
    handle: Transfer | None = None  # the in-flight transfer
    spill: torch.Tensor | None = None  # its bytes in host memory while spilled (module docstring)
    rerun: int | None = None  # while dropped by recompute i of the plan: i (``teraio.core.rerun``)


# Steps whose StepStats MigrationEngine.history keeps: the first and the latest, so that a
# long run's memory stays flat.
HISTORY_STEPS = 64


@dataclass
class StepStats:
    """What one iteration under the engine did. Seconds are wall time; bytes are bytes."""

    step: int
    stall_count: int = 0
    stall_seconds: float = 0.0
    urgent_count: int = 0
    bytes_offloaded: dict = field(default_factory=lambda: {"ssd": 0, "host": 0})
    bytes_prefetched: dict = field(default_factory=lambda: {"ssd": 0, "host": 0})
    migration_seconds: float = 0.0
    max_accounted_bytes: int = 0
    oom_retries: int = 0  # allocations tried again after an out-of-memory error (``MigrationEngine``)
    dropped_bytes: int = 0  # bytes of prefetched tensors freed again for those retries
    deferred_prefetches: int = 0  # planned prefetches that did not fit, read at their use instead
    spilled_bytes: int = 0  # bytes of resident tensors copied to host memory and freed for retries
    pending_waits: int = 0  # offload copies waited for to keep freed-but-copying bytes under the limit
    recomputed_bytes: int = 0  # bytes of dropped tensors made again by re-running their chains
    recompute_seconds: float = 0.0  # host seconds spent issuing those re-runs (on CUDA, kernel launches)
    # the audited (first) step on CUDA: ``MigrationEngine.overrun`` as ``{"first": [op, bytes],
    # "largest": [op, bytes]}`` (empty: none) and ``lingering`` at the largest overrun's op (at
    # most 5, ``[name, bytes, last use]``); None in other steps and off CUDA
    audit: dict | None = None


class MigrationEngine(TorchDispatchMode):
    """Executes ``plan`` on the live tensors of one training process.

    Args:
        trace: the profiled trace the plan was made for.
        plan: the migration plan (op indices into ``trace``).
        persistent: name -> tensor for parameters, buffers and optimizer state
            (``teraio.core.profiler.persistent_tensors``), matched to the trace by name.
        tiers: ``{"ssd": SSDTier, "host": HostTier}`` (``teraio.core.tiers``); only the tiers the
            plan uses are needed.
        device: the training device.
        io_threads: threads that wait on in-flight transfers to timestamp them (the tiers
            have their own I/O threads); at least the transfers expected in flight at once.
        log_ops: keep a per-op log (op start time and stall seconds) for the analysis; on
            CUDA also each op's start on the compute stream (a timing event recorded after
            its waits, read once the step is over) and end (one recorded after its kernels
            are queued), and each host-tier copy's start on its stream, in seconds from an
            event recorded as the step starts: the GPU's own timeline beside the host's, and
            the GPU's idle seconds (:meth:`gpu_idle_seconds`).
        device_waits: order host-tier transfers on the CUDA compute stream instead of
            blocking the training thread (module docstring). Op start times in the log are
            then the host's issue times, and stall seconds the compute stream's waits.
        release_grads: free each gradient's storage after its last use in the step
            (module docstring). The step must not read a gradient after the optimizer
            has used it; ``teraio.workload.step.train_step`` does not (``zero_grad(set_to_none=True)``).
        host_update: the parameters updated in host memory (``teraio.core.host_update``; the
            trace is then ``Trace.with_host_update``'s): the engine sends each one's gradient
            after its last write, before freeing it, has its refreshed copy issued from the
            next step's ops and waits for it before its first use, and never spills a hosted
            parameter (a refresh may be writing it). Needs ``release_grads``.
        pending_limit_bytes: with ``device_waits``, the bytes the plan's live bytes at an op
            and the offloaded storages freed while their copies may still run may take
            together: before an op that would pass it the host waits for the copies freed first
            (``teraio.core.pending``; counted per step as ``pending_waits``, their seconds as
            stalls). None: never wait.

    Use :meth:`prime` once before the first step, run each step with :meth:`run_step`, and
    :meth:`close` at the end (restores every offloaded tensor and frees the tiers).

    ``history`` holds the :class:`StepStats` of the first step and of the latest ones
    (:data:`HISTORY_STEPS` in all); ``oplog`` and ``transfers`` every record since the last
    :meth:`take_logs`.
    """

    def __init__(self, trace: Trace, plan: MigrationPlan, persistent: dict[str, torch.Tensor],
                 tiers: dict, device: torch.device, io_threads: int = 64, log_ops: bool = True,
                 device_waits: bool = False, release_grads: bool = False, host_update: HostUpdate | None = None,
                 pending_limit_bytes: int | None = None):
        super().__init__()
        if plan.n_ops != trace.n_ops:
            raise ValueError(f"plan is for {plan.n_ops} ops but the trace has {trace.n_ops}")
        missing = {m.tier for m in plan.migrations} - set(tiers)
        if missing:
            raise ValueError(f"plan uses tier(s) {sorted(missing)} but only {sorted(tiers)} were given")
        if host_update is not None and not release_grads:
            raise ValueError("a host update needs release_grads: the engine frees each gradient it sends")
        self.trace, self.plan, self.tiers, self.device = trace, plan, tiers, device
        self.host_update = host_update
        hosted = host_update.names if host_update is not None else set()
        self._unspillable = {rec.tid for rec in trace.tensors if rec.name in hosted}
        self.n_ops = trace.n_ops
        self.op_names = trace.op_names
        self.required_bytes = trace.required_bytes()
        self.log_ops = log_ops
        self._gpu_log = log_ops and device.type == "cuda"
        self._origin: torch.cuda.Event | None = None  # this step's start on the compute stream (CUDA log)
        self._op_events: list | None = None  # each op's start on the compute stream (CUDA log)
        self._op_end_events: list | None = None  # ... and where its kernels were queued up to
        # per logged step (CUDA log): seconds the compute stream ran no op of the step, from the
        # step's start to its last op (waits for transfers and gaps the host left); read by
        # take_logs, handed over by gpu_idle_seconds
        self._gpu_idle: dict[int, float] = {}
        self.device_waits = device_waits
        self._in_step = False
        # (op, start, end) CUDA timing events around each compute-stream wait of this step
        self._device_stalls: list[tuple[int | None, torch.cuda.Event, torch.cuda.Event]] = []
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="teraio-io")
        self._func_names: dict = {}

        self.tensors: dict[int, _Tensor] = {}
        for m in plan.migrations:
            rec = trace.tensors[m.tid]
            if rec.name != m.name:
                raise ValueError(f"plan names tensor {m.tid} {m.name!r} but the trace has {rec.name!r}")
            if m.tid not in self.tensors:
                self.tensors[m.tid] = _Tensor(rec.name, rec.nbytes, rec.persistent)
        for r in plan.recomputes:
            rec = trace.tensors[r.tid]
            if rec.name != r.name or rec.persistent:
                raise ValueError(f"plan recomputes tensor {r.tid} {r.name!r} but the trace has "
                                 f"{'persistent ' if rec.persistent else ''}{rec.name!r}")
            self.tensors.setdefault(r.tid, _Tensor(rec.name, rec.nbytes, False))
        for t in self.tensors.values():
            if t.persistent:
                if t.name not in persistent:
                    raise ValueError(f"plan migrates {t.name!r}, which the model/optimizer does not have")
                t.storage = persistent[t.name].untyped_storage()
        # The persistent tensors on the device that the plan leaves resident: only a spill
        # moves them (module docstring). On CUDA not those of at most 1 MiB: the caching
        # allocator serves them from segments of their own (its small pool), so freeing them
        # never makes room for a larger allocation.
        smallest = SMALL_POOL_BYTES + 1 if device.type == "cuda" else 0
        for rec in trace.tensors:
            x = persistent.get(rec.name) if rec.persistent else None
            if (rec.tid not in self.tensors and x is not None and x.device.type == device.type
                    and rec.nbytes >= smallest and rec.name not in hosted):  # a refresh writes a hosted one
                self.tensors[rec.tid] = _Tensor(rec.name, rec.nbytes, True, x.untyped_storage())

        self._index_launches(plan)
        # Recomputes (``teraio.core.rerun``): their chains' calls, recorded as they run; which
        # recomputes drop their tensor after op k, and which make it again before op k.
        self.reruns = Reruns(plan.recomputes)
        self.drop_after: list[list[int]] = [[] for _ in range(self.n_ops)]
        self.remake_before: list[list[int]] = [[] for _ in range(self.n_ops)]
        for i, r in enumerate(plan.recomputes):
            self.drop_after[r.drop_after].append(i)
            self.remake_before[r.recompute_before].append(i)
        # Intermediates: which op allocates them (slot j of op k) and after which op the
        # engine drops its reference, so autograd can free them as usual.
        self.produced_at: dict[int, list[tuple[int, int]]] = {}
        self.release_after: dict[int, list[int]] = {}
        for tid, t in self.tensors.items():
            if t.persistent:
                continue
            k, j = parse_intermediate(t.name)
            self.produced_at.setdefault(k, []).append((j, tid))
            last = max([m.needed_by for m in plan.migrations if m.tid == tid]
                       + [r.needed_by for r in plan.recomputes if r.tid == tid])
            self.release_after.setdefault(last, []).append(tid)

        self._index_grads(release_grads)

        # The audited first step: every intermediate's profiled last use, and (name, bytes,
        # weak reference) of each storage an op allocated in that step.
        self._last_use = {rec.name: rec.uses[-1] for rec in trace.tensors if not rec.persistent}
        self._allocated: list[tuple[str, int, StorageWeakRef]] | None = None
        # ... and (op, bytes) of the first and of the largest overrun of the accounted bytes
        self._allocator_bytes = (lambda: torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
        # what an out-of-memory retry calls first (None: nothing to release off CUDA), and the
        # re-allocation of an offloaded storage (``storage.resize_``)
        self._empty_cache = torch.cuda.empty_cache if device.type == "cuda" else None
        self._resize = lambda storage, nbytes: storage.resize_(nbytes)
        self._overrun: dict[str, tuple[int, int]] = {}
        self._overrun_lingering: list[tuple[str, int, int]] = []  # at the largest overrun
        self._away: dict[int, int] = {}  # storage key -> tid, for storages freed right now
        self._away_bytes = 0
        # offloaded storages freed while their copies may still run (device_waits), and the
        # plan's live bytes per op they are held under with the limit
        self._pending = PendingFrees(pending_limit_bytes)
        self._planned_live = predicted_live_bytes(trace, plan) if pending_limit_bytes is not None else None
        self._k = 0
        self._failed = False
        self._step_t0 = 0.0
        self.step_index = -1
        self.stats: StepStats | None = None
        self.history: list[StepStats] = []
        self.oplog: list[dict] = []
        self.transfers: list[dict] = []
        self._op_t = np.zeros(self.n_ops)
        self._op_stall = np.zeros(self.n_ops)
        # Offloads launched after a step's last op: launched as the next step starts (before
        # its op 0), after the host has read the step's result (teraio.perf.retime's
        # defer_tail_offloads); until then their tensors stay resident.
        self._next_step: list[Migration] = []

    def _index_launches(self, plan: MigrationPlan) -> None:
        """Per op, the migrations whose offload is launched after it and whose prefetch before
        it (``Migration.offload_launch``, ``prefetch_launch``), and those whose free and use
        come before it. In a plan whose copies are put in deadline order
        (``meta["copy_order"]``, ``teraio.perf.retime``) the copies launched at one op go in
        the order their waits come (a stream serves its copies in launch order); else in
        the plan's."""
        deadline_order = plan.meta.get("copy_order") == "deadline"

        def by_op(attr: str, deadline: str | None = None) -> list[list[Migration]]:
            out: list[list[Migration]] = [[] for _ in range(self.n_ops)]
            for m in plan.migrations:
                out[getattr(m, attr)].append(m)
            if deadline_order and deadline is not None:
                for k, ms in enumerate(out):
                    ms.sort(key=lambda m: (getattr(m, deadline) - k) % self.n_ops)
            return out

        self.offload_after, self.free_before = by_op("offload_launch", "free_before"), by_op("free_before")
        self.prefetch_before, self.needed_by = by_op("prefetch_launch", "needed_by"), by_op("needed_by")

    def _index_grads(self, release_grads: bool) -> None:
        """Gradients (``release_grads``): the op and slot that allocate each, the op after
        which its storage is freed, and by name its tid; their storages while alive."""
        self.grad_produced_at: dict[int, list[tuple[int, int]]] = {}
        self.grad_free_after: dict[int, list[int]] = {}
        self._grads: dict[int, torch.UntypedStorage] = {}
        self._grad_tid = {rec.name: rec.tid for rec in self.trace.tensors if rec.kind == "grad"}
        if release_grads:
            for rec in self.trace.tensors:
                if rec.kind == "grad":
                    k, j = parse_intermediate(rec.name)
                    self.grad_produced_at.setdefault(k, []).append((j, rec.tid))
                    self.grad_free_after.setdefault(rec.uses[-1], []).append(rec.tid)

    # ---- public -----------------------------------------------------------------
    def prime(self, pager=None) -> None:
        """Bring the persistent tensors into the state the plan assumes at op 0 of an
        iteration: offloads whose write spans the iteration boundary are done now
        (synchronously), and those planned to be off the device at op 0 are freed.

        Args:
            pager: the ``teraio.core.pager.Pager`` the steps before the plan ran under, holding
                some storages off the device. Its host copies go straight to their tier
                where the plan keeps them off the device at op 0 (a host-tier slot takes
                the pager's buffer itself where it has none yet); the rest come back.
                Order: the pager's copies that stay off the device first (host memory
                shrinks, the device is untouched), then resident tensors (their frees make
                room on the device), then the pager's copies that come back; so the device
                never holds more than the plan's op 0 plus one tensor, and host memory
                never holds a tensor twice. On return the pager holds nothing.
        """
        spanning = [m for m in self.plan.migrations
                    if m.wraps and cyclic_between(0, (m.offload_after + 1) % self.n_ops,
                                                  m.prefetch_before, self.n_ops)]
        held = (lambda m: False) if pager is None else (lambda m: pager.holds(self.tensors[m.tid].storage))
        away = {m.tid: m.offloaded_at_iteration_start(self.n_ops) for m in spanning}
        for m in sorted(spanning, key=lambda m: 1 if not held(m) else (0 if away[m.tid] else 2)):
            tier, t = self.tiers[m.tier], self.tensors[m.tid]
            t.tier = m.tier
            if held(m) and away[m.tid]:
                take_over = getattr(tier, "take_over", None)
                if take_over is not None and tier.can_take_over(t.name):
                    transfer = take_over(t.name, pager.hand_over(t.storage))
                else:
                    transfer = tier.write(t.name, pager.host_copy(t.storage).untyped_storage())
                    transfer.wait()
                    pager.forget(t.storage)
            else:
                if held(m):
                    pager.restore(t.storage)
                transfer = tier.write(t.name, t.storage)
                transfer.wait()
            t.status, t.job, t.handle = OFFLOADING, _done_future(), transfer
            if away[m.tid]:
                self._free(m.tid, t)
        if pager is not None:
            pager.restore_all()

    def run_step(self, step_fn, step: int, shape: dict | None = None):
        """Run one training step under the engine; returns ``step_fn()``'s value.

        Args:
            shape: the step's workload (``batch_size``, ``micro_batch_size``, ``seq_len``),
                checked against the trace's ``meta`` before anything runs.

        Raises:
            PlanDriftError: ``shape`` differs from the profiled step's; it names each key
                that changed (profile it again and plan anew for the new shape).
            ExecutionDivergedError: the step ran other ops than the profiled trace.
        """
        if shape is not None:
            changed = {k: (self.trace.meta[k], shape[k]) for k in SHAPE_KEYS
                       if k in shape and k in self.trace.meta and shape[k] != self.trace.meta[k]}
            if changed:
                raise PlanDriftError(
                    f"step {step} drifted from the profiled step: "
                    + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
                    + "; the plan holds only for the profiled shape: profile and plan again")
        self.step_index = step
        self.stats = StepStats(step=step)
        self._k = 0
        self._failed = False
        self._op_stall[:] = 0.0
        if self._gpu_log:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
            self._op_events = [None] * self.n_ops
            self._op_end_events = [None] * self.n_ops
        self._step_t0 = time.perf_counter()
        first_transfer = len(self.transfers)
        self._allocated = [] if not self.history else None
        self._overrun, self._overrun_lingering = {}, []
        self.reruns.start_step()
        self._in_step = True
        try:
            with self:
                out = step_fn()
        finally:
            self._in_step = False
            if self._allocated is not None and self._allocator_bytes is not None:
                self.stats.audit = {**{key: list(v) for key, v in self._overrun.items()},
                                    "lingering": [list(x) for x in self._overrun_lingering]}
            self._allocated = None
        self._settle_device_stalls()
        if self.host_update is not None:
            self.host_update.end_step()
        if self._k != self.n_ops:
            raise ExecutionDivergedError(
                f"step {step} ran {self._k} ops; the profiled trace has {self.n_ops}")
        leaked = [t.name for t in self.tensors.values() if not t.persistent and t.storage is not None]
        leaked += [self.trace.tensors[tid].name for tid in self._grads]
        if leaked:
            raise RuntimeError(f"engine still holds intermediates after the step: {leaked[:5]}")
        self.stats.migration_seconds = union_seconds(
            [(r["t_issued_s"], r["t_done_s"]) for r in self.transfers[first_transfer:] if r["step"] == step])
        if self.log_ops:
            self.oplog.append({"step": step, "t_start_s": self._op_t.copy(), "stall_s": self._op_stall.copy(),
                               "gpu": (self._origin, self._op_events, self._op_end_events) if self._gpu_log else None})
        self.history.append(self.stats)
        if len(self.history) > HISTORY_STEPS:
            del self.history[1]  # the first (audited) step stays, then the latest ones
        return out

    def gpu_idle_seconds(self, step: int) -> float | None:
        """Seconds the compute stream ran none of step ``step``'s ops, from the step's start
        to its last op: its waits for transfers and the gaps the training thread left it
        (the GPU's stalls; with ``device_waits`` the training thread's own waits for SSD
        transfers, counted in ``StepStats.stall_seconds``, stall it only where the GPU runs
        out of queued work). Known once :meth:`take_logs` read the step (CUDA with
        ``log_ops``), and handed over once; None otherwise."""
        return self._gpu_idle.pop(step, None)

    def take_logs(self) -> tuple[list[dict], list[dict]]:
        """Hand over the per-op records of the steps run so far (``oplog``, with ``log_ops``)
        and the records of the transfers issued so far, in issue order, up to the first
        still in flight (``transfers``), and forget them: a runner that writes them out as
        it goes (``teraio.trainer.runner``) keeps a long run's memory flat. Between steps."""
        oplog, self.oplog = self.oplog, []
        for row in oplog:  # the GPU's op starts and ends, read now that the step is over
            gpu = row.pop("gpu", None)
            if gpu is not None:
                origin, starts, ends = gpu
                ends[-1].synchronize()  # events of one stream complete in order
                row["gpu_start_s"] = start = np.array([origin.elapsed_time(e) / 1e3 for e in starts])
                row["gpu_end_s"] = end = np.array([origin.elapsed_time(e) / 1e3 for e in ends])
                self._gpu_idle[row["step"]] = float(start[0] + np.clip(start[1:] - end[:-1], 0, None).sum())
        n = next((i for i, r in enumerate(self.transfers) if r["t_done_s"] is None), len(self.transfers))
        done, self.transfers = self.transfers[:n], self.transfers[n:]
        return oplog, done

    def hand_back(self, pager) -> None:
        """Between steps, end the engine's life without bringing anything back to the
        device: each tensor it holds off the device goes to ``pager``
        (``teraio.core.pager.Pager``) as an evicted storage, its bytes read from the tier into
        one of the pager's host buffers; transfers in flight finish first (an offload
        leaves its tensor resident, a prefetch makes it resident). Then the I/O threads
        stop and the tiers close. The reverse of :meth:`prime`, for planning anew
        (``teraio.trainer.runner``, on a change of workload shape)."""
        if self._pool is None:
            raise RuntimeError("hand_back: the engine is closed")
        if self.host_update is not None:  # the hosted parameters at their updated values
            self.host_update.close()
        self.step_index, self.stats = -1, StepStats(step=-1)
        self._next_step.clear()  # their tensors are resident
        for tid, t in self.tensors.items():
            if t.storage is None or t.status == RESIDENT:
                continue
            if t.status == OFFLOADING:
                concurrent.futures.wait([t.job])
                t.handle.wait()
                t.status, t.job = RESIDENT, None
            elif t.status == PREFETCHING:
                self._make_resident(tid, t, urgent=False)
            else:  # OFFLOADED
                host = pager.buffers.take(t.nbytes)
                if t.spill is not None:
                    host.copy_(t.spill)
                    t.spill = None
                else:
                    self.tiers[t.tier].read(t.name, host.untyped_storage()).wait()
                pager.adopt_evicted(t.storage, host)
                t.status = RESIDENT  # the engine no longer holds it
        self._stop_io()

    def _stop_io(self) -> None:
        """Stop the I/O threads and close the tiers (offload files deleted, buffers freed)."""
        self._pool.shutdown(wait=True)
        self._pool = None
        for tier in self.tiers.values():
            tier.close()
        self._pending = PendingFrees(self._pending.limit_bytes)  # the tiers drained their copies

    def close(self, restore: Callable[[str], bool] | None = None) -> None:
        """Restore offloaded tensors to the device, stop the I/O threads and close the tiers
        (offload files deleted, pinned pool freed). Idempotent.

        Args:
            restore: which tensors to restore, by stable name (e.g. ``"param:"`` names);
                None restores every one. A tensor not restored keeps its storage freed
                (0 bytes): the caller must not use it again. A runner that only reads the
                parameters after training saves reading the rest back (from an SSD tier,
                tens of GB at a few GB/s).
        """
        if self._pool is None:
            return
        if self.host_update is not None:  # the hosted parameters at their updated values
            self.host_update.close()
        # Restores after the last step are not part of any step's statistics.
        self.step_index, self.stats = -1, StepStats(step=-1)
        self._next_step.clear()  # their tensors are resident
        errors = []
        for tid, t in self.tensors.items():
            if t.rerun is not None:  # an intermediate dropped by a step that failed: nothing reads it again
                t.rerun, t.storage = None, None
            if t.storage is None or t.status == RESIDENT:
                continue
            if t.status == OFFLOADING:  # the bytes never left the device: a failed write loses nothing
                concurrent.futures.wait([t.job])
                t.status, t.job = RESIDENT, None
                continue
            if t.status == OFFLOADED and restore is not None and not restore(t.name):
                t.spill = None
                continue
            try:
                self._make_resident(tid, t, urgent=False)
            except Exception as e:  # keep restoring the others, then report
                errors.append(e)
        self._stop_io()
        if errors:
            raise errors[0]

    # ---- dispatch ---------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._failed:  # unwinding an error: let the remaining ops run untouched
            return func(*args, **(kwargs or {}))
        k = self._k
        try:
            self._check_op(k, func)
            self._op_t[k] = time.perf_counter() - self._step_t0
            self._before(k, args, kwargs)
            if self._op_events is not None:
                e = self._op_events[k] = torch.cuda.Event(enable_timing=True)
                e.record()
            out = self._run_op(k, func, args, kwargs)
            if self._op_end_events is not None:
                e = self._op_end_events[k] = torch.cuda.Event(enable_timing=True)
                e.record()
            self._after(k, func, args, kwargs, out)
        except torch.OutOfMemoryError as e:
            self._failed = True
            e.add_note(self._memory_note(k))  # shown by traceback, so in the result row's error
            raise
        except BaseException:
            self._failed = True
            raise
        self._k = k + 1
        return out

    def _run_op(self, k: int, func, args, kwargs):
        """Op ``k``, run again after each out-of-memory error until it fits
        (:meth:`_until_fits`; none of its own inputs freed); the error propagates when nothing
        is left to free."""
        return self._until_fits(lambda: func(*args, **(kwargs or {})), k,
                                lambda: frozenset(storage_key(x) for x in iter_tensors(args, kwargs)))

    def _until_fits(self, attempt: Callable, k: int, keep: Callable[[], frozenset], deferrable: bool = False):
        """``attempt()``'s value, tried again after each out-of-memory error: first once the
        allocator's unused memory is released (CUDA), then once more after each tensor
        :meth:`_make_room` frees (none whose storage key is in ``keep()``, op ``k``'s inputs),
        the release repeated so that the freed pages count. A ``deferrable`` attempt gives up
        after the release instead (:data:`_DEFERRED`; counted). Raises the last error when
        nothing is left to free (or outside a step, ``k`` < 0)."""
        emptied = self._empty_cache is None
        while True:
            try:
                return attempt()
            except torch.OutOfMemoryError:
                if emptied:
                    if deferrable:
                        if self.stats is not None:
                            self.stats.deferred_prefetches += 1
                        return _DEFERRED
                    if k < 0 or not self._make_room(k, keep()):
                        raise
                emptied = True
                if self.stats is not None:
                    self.stats.oom_retries += 1
                if self._empty_cache is not None:
                    self._empty_cache()

    def _make_room(self, k: int, keep: frozenset) -> bool:
        """Free one tensor's device bytes for a retry at op ``k``: one prefetched ahead if any
        (:meth:`_drop_prefetched`), else spill one (:meth:`_spill`); none whose storage key is
        in ``keep`` (op ``k``'s inputs). False when neither is left."""
        return self._drop_prefetched(k, keep) or self._spill(k, keep)

    def _spill(self, k: int, keep: frozenset) -> bool:
        """Copy the resident tensor whose next use is furthest after op ``k`` (of the plan's and
        the persistent tensors the plan leaves on the device; none in ``keep``, none with a
        transfer in flight, no parameter updated in host memory) to host memory,
        synchronously, and free its device bytes; it comes back from that copy
        (:meth:`_launch_prefetch`). False when none is left."""
        best, best_gap = None, -1
        for tid, t in self.tensors.items():
            if (t.status != RESIDENT or t.job is not None or t.storage is None or t.storage.nbytes() == 0
                    or storage_id(t.storage) in keep or tid in self._unspillable):
                continue
            gap = min(((u - k) % self.n_ops for u in self.trace.tensors[tid].uses if u != k), default=self.n_ops)
            if gap > best_gap:
                best, best_gap = tid, gap
        if best is None:
            return False
        t = self.tensors[best]
        t.spill = byte_view(t.storage).to("cpu", copy=True)
        self._free(best, t)
        self.stats.spilled_bytes += t.nbytes
        return True

    def _drop_prefetched(self, k: int, in_keys: set[int]) -> bool:
        """Free the device copy of the tensor prefetched for the use furthest after op ``k``
        (none of op ``k``'s inputs), once its read has finished; False when there is none."""
        best, best_gap = None, -1
        for m in self.plan.migrations:
            t = self.tensors[m.tid]
            if (t.status != PREFETCHING or t.storage is None or storage_id(t.storage) in in_keys
                    or not cyclic_between(k, m.prefetch_before, m.needed_by, self.n_ops)):
                continue
            gap = (m.needed_by - k) % self.n_ops
            if gap > best_gap:
                best, best_gap = m, gap
        if best is None:
            return False
        t = self.tensors[best.tid]
        if self._stream_ordered(t):
            t.handle.wait()  # the host waits: the memory is reused at once
            self._mark_done(t, k)
        else:
            self._wait(t, k)
        self._free(best.tid, t)
        self.stats.dropped_bytes += t.nbytes
        return True

    def lingering(self, k: int) -> list[tuple[str, int, int]]:
        """Intermediates of the audited (first) step still alive at op ``k`` past their
        profiled last use: ``(name, bytes when allocated, last use)``, largest first. The
        lifetime count frees their bytes after the last use; a reference that outlives it
        (autograd, the step's own code) holds them on the device all the same, and only
        where the profiled step held them as long did its allocator peak
        (``Trace.op_allocated_bytes``) count them. Empty outside the audited step."""
        if self._allocated is None:
            return []
        alive = [(name, nbytes, self._last_use[name]) for name, nbytes, ref in self._allocated
                 if self._last_use[name] < k and not ref.expired()]
        return sorted(alive, key=lambda x: (-x[1], x[0]))

    def overrun(self) -> dict[str, tuple[int, int]]:
        """Of the audited step's ops so far, on CUDA: ``{"first": (op, bytes), "largest": (op,
        bytes)}``, where bytes is how far the allocator's bytes after the op exceeded what the
        plan accounts during it (``required_bytes`` less what is off the device, a peak that
        bounds the bytes after the op), counted above 1 % of the planned capacity (allocator
        rounding stays below it). Empty where no op overran so, and off CUDA."""
        return dict(self._overrun)

    def _accounted(self, k: int) -> int:
        """Bytes the plan accounts on the device during op ``k`` as things stand: the op's
        un-offloaded need less what is off the device now."""
        return int(self.required_bytes[k]) - self._away_bytes

    def _memory_note(self, k: int) -> str:
        """What the plan and the allocator hold at op ``k``: the numbers that tell a plan
        that did not fit from memory the plan never saw (fragmentation, workspaces, tensors
        alive past their profiled last use)."""
        accounted = self._accounted(k)
        note = (f"TeraIO: out of memory at op {k} ({self.op_names[k]}) of step {self.step_index}; "
                f"the plan accounts {accounted} B resident there (planned peak "
                f"{self.plan.predicted_peak_bytes} B for a capacity of {self.plan.capacity_bytes} B)")
        if self.device.type == "cuda":
            backend = torch.cuda.get_allocator_backend()  # cudaMallocAsync keeps no blocks to list
            note += (f"; the caching allocator holds {torch.cuda.memory_allocated(self.device)} B "
                     f"allocated, {torch.cuda.memory_reserved(self.device)} B reserved; "
                     + (free_blocks_note(torch.cuda.memory_snapshot()) if backend == "native"
                        else f"free blocks: not tracked by the {backend} backend"))
        if self._allocated is not None:
            alive = self.lingering(k)
            largest = ", ".join(f"{name} ({nbytes} B, last use op {last})" for name, nbytes, last in alive[:5])
            note += (f"; {len(alive)} intermediates alive past their profiled last use hold "
                     f"{sum(a[1] for a in alive)} B" + (f", the largest: {largest}" if alive else ""))
            if self._allocator_bytes is not None:
                over = self.overrun()
                note += ("; the allocator held more than the plan accounts first after op {} ({} B "
                         "over), most after op {} ({} B over)".format(*over["first"], *over["largest"])
                         if over else "; no earlier op of the step overran the plan's account")
        return note

    def _check_op(self, k: int, func) -> None:
        if k >= self.n_ops:
            raise ExecutionDivergedError(f"step ran more ops than the {self.n_ops} profiled")
        name = self._func_names.get(func)
        if name is None:
            name = self._func_names[func] = str(func)
        if name != self.op_names[k]:
            raise ExecutionDivergedError(
                f"op {k} is {name}, but the profiled trace has {self.op_names[k]} there")

    def _before(self, k: int, args, kwargs) -> None:
        if k == 0 and self._next_step:
            self._launch_offloads(self._next_step, k)
            self._next_step.clear()
        if self.host_update is not None:
            waited = self.host_update.before(k)
            if waited > 0:
                self.stats.stall_count += 1
                self.stats.stall_seconds += waited
                self._op_stall[k] += waited
        for m in self.free_before[k]:
            t = self.tensors[m.tid]
            if t.status == OFFLOADING:
                if self._stream_ordered(t):  # the allocator holds the memory until the copy ran
                    if self._planned_live is not None:
                        self._pending.add(t.handle, t.nbytes)
                    self._mark_done(t, k)
                else:
                    self._wait(t, k)
                self._free(m.tid, t)
        if self._planned_live is not None:
            waits, waited = self._pending.settle(int(self._planned_live[k]))
            if waits:
                self.stats.pending_waits += waits
                self.stats.stall_count += 1
                self.stats.stall_seconds += waited
                self._op_stall[k] += waited
        for m in self.prefetch_before[k]:
            t = self.tensors[m.tid]
            if t.status == OFFLOADED:
                self._launch_prefetch(t, k, deferrable=True)
        waits = [m for m in self.needed_by[k] if self.tensors[m.tid].status != RESIDENT]
        remakes = [i for i in self.remake_before[k] if self.tensors[self.plan.recomputes[i].tid].rerun == i]
        if waits or remakes or self._away:
            inputs = [storage_key(x) for x in iter_tensors(args, kwargs)]
            keep = frozenset(inputs)  # an allocation here may not free op k's own inputs
            for i in remakes:
                tid = self.plan.recomputes[i].tid
                self._remake(tid, self.tensors[tid], k, keep)
            for m in waits:
                self._make_resident(m.tid, self.tensors[m.tid], urgent=False, k=k, keep=keep)
            for key in inputs:
                tid = self._away.get(key)
                if tid is not None:
                    self._make_resident(tid, self.tensors[tid], urgent=True, k=k, keep=keep)
        accounted = self._accounted(k)
        if accounted > self.stats.max_accounted_bytes:
            self.stats.max_accounted_bytes = accounted

    def _after(self, k: int, func, args, kwargs, out) -> None:
        produced, grads = self.produced_at.get(k), self.grad_produced_at.get(k)
        if produced or grads or self._allocated is not None:
            fresh = fresh_outputs(out, {storage_key(x) for x in iter_tensors(args, kwargs)})
            if self._allocated is not None:
                for j, x in enumerate(fresh):
                    name = f"op{k}:out{j}"
                    if name in self._last_use:
                        s = x.untyped_storage()
                        self._allocated.append((name, s.nbytes(), StorageWeakRef(s)))
            for j, tid in produced or ():
                self.tensors[tid].storage = fresh[j].untyped_storage()
            for j, tid in grads or ():
                self._grads[tid] = fresh[j].untyped_storage()
        if k in self.reruns.ops:
            self.reruns.record(k, func, args, kwargs, out)
        for i in self.drop_after[k]:
            tid = self.plan.recomputes[i].tid
            t = self.tensors[tid]
            if t.status == RESIDENT and t.storage is not None:
                self._free(tid, t)
                t.rerun = i
        if self.host_update is not None:  # a hosted gradient leaves before it is freed below
            self.host_update.after(k, lambda name: self._grads[self._grad_tid[name]])
        for tid in self.grad_free_after.get(k, ()):
            self._grads.pop(tid).resize_(0)  # param.grad keeps the tensor; zero_grad drops it
        if k == self.n_ops - 1:  # after the step's last op: as the next step starts
            self._next_step.extend(self.offload_after[k])
        else:
            self._launch_offloads(self.offload_after[k], k)
        for tid in self.release_after.get(k, ()):
            t = self.tensors[tid]
            if t.status != RESIDENT:
                self._make_resident(tid, t, urgent=True, k=k)
            t.storage = None
        if self._allocated is not None and self._allocator_bytes is not None:
            over = self._allocator_bytes() - self._accounted(k)
            if over > self.plan.capacity_bytes // 100:  # allocator rounding stays below
                self._overrun.setdefault("first", (k, over))
                if over > self._overrun.get("largest", (k, 0))[1]:
                    self._overrun["largest"] = (k, over)
                    self._overrun_lingering = self.lingering(k + 1)[:5]

    # ---- transfers --------------------------------------------------------------
    def _submit(self, t: _Tensor, tier: str, direction: str, k: int) -> None:
        # The tier call happens here, on the training thread, so the tier's ready event is
        # recorded on the compute stream right after op k; a waiter thread only timestamps
        # completion for the transfer log.
        io = self.tiers[tier]
        transfer = (io.write if direction == "offload" else io.read)(t.name, t.storage)
        row = {"step": self.step_index, "tensor": t.name, "tier": tier, "direction": direction,
               "nbytes": t.nbytes, "op_issued": k, "op_done": None,
               "t_issued_s": time.perf_counter() - self._step_t0, "t_done_s": None, "copy_s": None,
               "gpu_start_s": None}
        t0, origin = self._step_t0, self._origin if self._in_step else None

        def waiter():
            try:
                transfer.wait()
                row["copy_s"], row["gpu_start_s"] = transfer.copy_seconds(), transfer.copy_start_after(origin)
            finally:
                row["t_done_s"] = time.perf_counter() - t0

        t.job, t.tier, t.transfer, t.handle = self._pool.submit(waiter), tier, row, transfer
        self.transfers.append(row)
        (self.stats.bytes_offloaded if direction == "offload" else self.stats.bytes_prefetched)[tier] += t.nbytes

    def _launch_offloads(self, ms: list[Migration], k: int) -> None:
        """Launch the offloads of ``ms`` whose tensors are on the device (at op ``k``)."""
        for m in ms:
            t = self.tensors[m.tid]
            if t.status == RESIDENT and t.storage is not None:
                self._launch_offload(m, t, k)

    def _launch_offload(self, m: Migration, t: _Tensor, k: int) -> None:
        self._submit(t, m.tier, "offload", k)
        t.status = OFFLOADING

    def _launch_prefetch(self, t: _Tensor, k: int, deferrable: bool = False, keep: frozenset = frozenset()) -> None:
        """Re-allocate ``t`` (:meth:`_allocate`) and read it back: from its tier (PREFETCHING),
        or where it was spilled, from host memory at once (RESIDENT)."""
        if not self._allocate(t, k, deferrable, keep):
            return
        self._away.pop(storage_id(t.storage), None)
        self._away_bytes -= t.nbytes
        if t.spill is not None:
            byte_view(t.storage).copy_(t.spill)
            t.spill, t.status = None, RESIDENT
            return
        self._submit(t, t.tier, "prefetch", k)
        t.status = PREFETCHING

    def _allocate(self, t: _Tensor, k: int, deferrable: bool, keep: frozenset) -> bool:
        """Re-allocate ``t``'s device bytes before op ``k``; on an out-of-memory error release
        the allocator's unused memory (CUDA) and try once more. Where that fails too, a
        ``deferrable`` (planned) prefetch is left undone, ``t`` staying offloaded until its use
        (False); an allocation at ``t``'s use instead makes room one tensor per attempt, as an
        op does (:meth:`_until_fits`; none whose storage key is in ``keep``, op ``k``'s inputs),
        and the error propagates when nothing is left to free (or outside a step, ``k`` < 0)."""
        return self._until_fits(lambda: self._resize(t.storage, t.nbytes), k, lambda: keep,
                                deferrable) is not _DEFERRED

    def _wait(self, t: _Tensor, k: int | None) -> None:
        """Block until ``t``'s transfer completes; a wait on an unfinished one is a stall."""
        job = t.job
        if not job.done():
            t0 = time.perf_counter()
            job.result()
            dt = time.perf_counter() - t0
            if self.stats is not None:
                self.stats.stall_count += 1
                self.stats.stall_seconds += dt
                if k is not None:
                    self._op_stall[k] += dt
        else:
            job.result()  # re-raises an I/O error naming the tensor and path
        self._mark_done(t, k)

    def _free(self, tid: int, t: _Tensor) -> None:
        t.storage.resize_(0)
        t.status = OFFLOADED
        self._away[storage_id(t.storage)] = tid
        self._away_bytes += t.nbytes

    def _make_resident(self, tid: int, t: _Tensor, urgent: bool, k: int | None = None,
                       keep: frozenset = frozenset()) -> None:
        if t.rerun is not None:  # dropped by a recompute: made again, whatever the op
            if urgent and self.stats is not None:
                self.stats.urgent_count += 1
            self._remake(tid, t, -1 if k is None else k, keep)
            return
        if t.status == OFFLOADED:
            self._launch_prefetch(t, k if k is not None else -1, keep=keep)
        if urgent and self.stats is not None:
            self.stats.urgent_count += 1
        if t.status == RESIDENT:  # it came back from where it was spilled
            return
        if self._stream_ordered(t):
            self._wait_on_stream(t, k)
        else:
            self._wait(t, k)
        t.status = RESIDENT

    def _remake(self, tid: int, t: _Tensor, k: int, keep: frozenset) -> None:
        """Make tensor ``tid``, dropped by recompute ``t.rerun``, again before op ``k``: its
        chain's resident inputs first (fetched if something moved them; a planned read still
        in flight waited for, a stall), then the re-run, its last op writing into the
        tensor's own storage, re-allocated, or its result copied there (``teraio.core.rerun``). Each
        allocation retries after an out-of-memory error as an op does (:meth:`_until_fits`)."""
        i, t0 = t.rerun, time.perf_counter()
        inputs = {storage_key(x) for x in self.reruns.inputs(i)}
        for key in inputs:  # freed, or being read back: the re-run needs their bytes now
            away = self._away.get(key)
            if away is not None:
                self._make_resident(away, self.tensors[away], urgent=True, k=k, keep=keep)
        for tid_in, x in self.tensors.items():
            if x.status == PREFETCHING and storage_id(x.storage) in inputs:
                self._make_resident(tid_in, x, urgent=False, k=k, keep=keep)
        keep = keep | inputs
        def into() -> torch.UntypedStorage:
            self._until_fits(lambda: self._resize(t.storage, t.nbytes), k, lambda: keep)
            return t.storage

        fresh = self.reruns.replay(i, lambda call: self._until_fits(call, k, lambda: keep), into)
        if fresh is not None:  # made in fresh memory: its bytes go into the tensor's storage
            if fresh.untyped_storage().nbytes() != t.nbytes:
                raise RuntimeError(f"re-run of {t.name!r} made {fresh.untyped_storage().nbytes()} B; "
                                   f"the profiled tensor has {t.nbytes} B")
            into()
            byte_view(t.storage).copy_(byte_view(fresh.untyped_storage()))
            del fresh
        self._away.pop(storage_id(t.storage), None)
        self._away_bytes -= t.nbytes
        t.status, t.rerun = RESIDENT, None
        if self.stats is not None:
            self.stats.recomputed_bytes += t.nbytes
            self.stats.recompute_seconds += time.perf_counter() - t0

    # ---- device-side waits (device_waits) ----------------------------------------
    def _stream_ordered(self, t: _Tensor) -> bool:
        # job and handle are set together when a transfer starts; job is cleared once it is waited on
        return self.device_waits and self._in_step and t.job is not None and t.handle.stream_ordered

    def _mark_done(self, t: _Tensor, k: int | None) -> None:
        """Log op ``k`` as where the transfer was needed and drop the job; the waiter thread
        still timestamps the transfer's completion for the log."""
        if t.transfer is not None:
            t.transfer["op_done"] = k
        t.job = None

    def _wait_on_stream(self, t: _Tensor, k: int | None) -> None:
        """Order the compute stream after ``t``'s copy; time the wait if it is unfinished."""
        if not t.handle.done():  # a finished copy needs no ordering
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            t.handle.wait_on_stream(stream)
            end.record(stream)
            self._device_stalls.append((k, start, end))
        self._mark_done(t, k)

    def _settle_device_stalls(self) -> None:
        """After a step: add each compute-stream wait's measured seconds to the stalls."""
        if not self._device_stalls:
            return
        self._device_stalls[-1][2].synchronize()  # events of one stream complete in order
        for k, start, end in self._device_stalls:
            dt = start.elapsed_time(end) / 1e3
            self.stats.stall_count += 1
            self.stats.stall_seconds += dt
            if k is not None:
                self._op_stall[k] += dt
        self._device_stalls.clear()


def free_blocks_note(snapshot: list[dict]) -> str:
    """What the reserved but unallocated memory of ``snapshot`` (``torch.cuda.memory_snapshot()``:
    one dict per mapped segment, its ``blocks`` each with ``size`` in bytes and ``state``) is
    made of: the bytes and count of its free (``inactive``) blocks, the largest of them, and
    over how many segments, large and small pool, they spread. An allocation that does not fit
    with many small free blocks is fragmentation, not the plan."""
    if not snapshot:
        return "free blocks: none (no segment)"
    free = [b["size"] for seg in snapshot for b in seg["blocks"] if b["state"] == "inactive"]
    pools = Counter(seg.get("segment_type", "unknown") for seg in snapshot)
    return (f"free blocks: {sum(free)} B in {len(free)}, the largest {max(free, default=0)} B, over "
            + ", ".join(f"{n} {pool}-pool segments" for pool, n in sorted(pools.items())))


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


def union_seconds(intervals: list[tuple[float, float | None]]) -> float:
    """Total length of the union of [start, end] intervals (seconds)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((s, e) for s, e in intervals if e is not None):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
