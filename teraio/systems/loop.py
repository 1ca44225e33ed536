"""The one measurement loop every system runs: warm-up steps, then measured ones, each timed
the same way, printed the same way and refused the same way when its loss is not finite.

A system hands the loop a step function ``step_fn(step) -> Step | None``: called untimed,
it prepares step ``step`` (its batch, a re-plan) and returns the work to time; None means
the step ran outside the loop (TeraIO's re-profiled steps, which time and print
themselves) and is neither timed here nor measured.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from teraio.config import WorkloadConfig
from teraio.interrupt import raise_if_interrupted
from teraio.systems.measure import allocator_events, timed
from teraio.result import check_loss, iteration_row, progress_line


@dataclass(frozen=True)
class StepStats:
    """What a system observes of one step besides its time and loss (``teraio.result``'s
    iteration schema; None: the system cannot tell).

    Attributes:
        stall_count, stall_seconds: the step's stalls (count, seconds).
        migration_seconds: time at least one transfer was in flight (seconds).
        bytes_offloaded, bytes_prefetched: ``{ssd, host}`` bytes moved in the step.
        extra: system-specific keys of the iteration row (TeraIO: ``urgent_count``,
            ``max_accounted_bytes``, ``oom_retries``, ``dropped_bytes``, ``deferred_prefetches``,
            ``spilled_bytes``).
        note: appended to the step's progress line (TeraIO: `` stalls <n>``).
    """

    stall_count: int | None = None
    stall_seconds: float | None = None
    migration_seconds: float | None = None
    bytes_offloaded: dict[str, int] | None = None
    bytes_prefetched: dict[str, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class Step:
    """One step as the loop runs it.

    Attributes:
        run: the timed work; returns the step's loss (float, a host sync).
        stats: called once the timer has stopped (the device synchronised): the step's
            :class:`StepStats`.
    """

    run: Callable[[], float]
    stats: Callable[[], StepStats] = StepStats


StepFn = Callable[[int], Step | None]  # step index -> the step to time, or None (run outside the loop)

DEADLINE_ENV = "TERAIO_DEADLINE"
"""Environment variable holding the Unix time (s) at which the sweep kills this worker
(``teraio.harness.launch`` sets it: launch + ``timeout_s``); unset: no time limit."""
END_MARGIN_S = 15.0
"""Seconds a worker keeps, after its last step, to end (close the system, write its row)."""


def deadline_from_env() -> float | None:
    """:data:`DEADLINE_ENV` as a Unix time in seconds; None where unset or empty."""
    value = os.environ.get(DEADLINE_ENV)
    return float(value) if value else None


@dataclass
class Steps:
    """What the loop measured.

    Attributes:
        iterations: one ``teraio.result.iteration_row`` per measured step (steps
            ``>= workload.warmup_steps``), in step order.
        losses: the loss of every step the loop timed, warm-up ones included, by step.
    """

    iterations: list[dict] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)


def measure_steps(step_fn: StepFn, workload: WorkloadConfig, device: torch.device, *, first_step: int = 0,
                  progress: bool = True, out: Steps | None = None, deadline: float | None = None) -> Steps:
    """Run steps ``first_step .. warmup_steps + measure_steps - 1``. Per step: ``step_fn(step)``
    and a settled garbage collector (:func:`_settle_collector`; the loop unfreezes what it
    froze when it ends, by an error too) untimed; its ``run`` timed with the device
    synchronised at both ends (``teraio.systems.measure.timed``); the loss checked; ``stats``; the progress line
    (``teraio.result.progress_line``, printed when ``progress``); and, from
    ``workload.warmup_steps`` on, the iteration row, of ``workload.tokens_at(step)`` tokens;
    on CUDA the row's ``allocator`` holds what the caching allocator did in the timed region
    (``teraio.systems.measure.ALLOCATOR_EVENTS``: its retries, each a wait for every stream,
    tell a step that ran at the memory cap).

    The time limit (``deadline``, a Unix time in seconds; default :func:`deadline_from_env`,
    the sweep's kill time): where another step as long as the one just run would not end
    :data:`END_MARGIN_S` before it, the loop stops there rather than be killed with
    nothing measured, and that step is measured (a warm-up one too): the run's first step
    (step 0) with ``time_limit: "cold"`` in its iteration (a step that alone outlasts the
    limit gets no warm-up, and the row says so), a later one with ``time_limit: "cut"``
    (fewer iterations than ``measure_steps``, the warm-up perhaps shortened). Under several
    ranks they stop together, where any rank's step says so.

    Each step is recorded in ``out`` (default: a new :class:`Steps`) as it completes, so a
    runner that passes its own keeps the steps measured before a failure; ``out`` is
    returned.

    Raises:
        FloatingPointError: a step's loss is not finite (naming the step; before its line).
        teraio.interrupt.Interrupted: at a step's start, where a SIGTERM or SIGINT arrived
            whose exception Python dropped (``teraio.interrupt``).
    """
    out = Steps() if out is None else out
    deadline = deadline_from_env() if deadline is None else deadline
    try:
        return _run_steps(step_fn, workload, device, first_step, progress, out, deadline)
    finally:
        gc.unfreeze()  # what the steps froze is the collector's again


def _settle_collector() -> None:
    """Before a step, untimed: collect every generation (what earlier steps froze included),
    then freeze what survives (the model, its optimizer, a plan and its trace, the libraries:
    objects that live through training), so that the collections Python starts during the
    timed step scan only the objects made since. A full collection walks every tracked object,
    the libraries' included: a host-side pause of that kind, at the same op of every
    micro-batch, shows in the op logs (``oplog.csv``'s ``seconds``) of TeraIO-Mixed's rows in
    ``runs/reference/h100/host_update/`` (whether it is the collector is not yet measured on a
    GPU). Every system runs this loop, so all get it; torchtitan's trainer manages its
    collector between steps too (``torchtitan.tools.utils.GarbageCollection``)."""
    gc.unfreeze()  # what earlier steps froze is scanned again: no cycle it left behind is kept
    gc.collect()
    gc.freeze()


def _run_steps(step_fn: StepFn, workload: WorkloadConfig, device: torch.device, first_step: int, progress: bool,
               out: Steps, deadline: float | None) -> Steps:
    """:func:`measure_steps`' loop."""
    last = workload.warmup_steps + workload.measure_steps - 1
    for step in range(first_step, last + 1):
        raise_if_interrupted()  # a SIGTERM or SIGINT whose exception Python dropped (teraio.interrupt)
        this = step_fn(step)
        if this is None:
            continue
        _settle_collector()
        events = allocator_events(device)
        with timed(device) as t:
            loss = this.run()
        after = allocator_events(device)
        check_loss(step, loss)
        s = this.stats()
        if events is not None:
            s = replace(s, extra={**s.extra, "allocator": {k: after[k] - v for k, v in events.items()}})
        seconds, tokens, warmup = t["seconds"], workload.tokens_at(step), step < workload.warmup_steps
        limit = None
        if deadline is not None and step < last and _any_rank(time.time() + seconds + END_MARGIN_S > deadline,
                                                              device):
            limit = "cold" if step == 0 else "cut"  # steps before first_step ran outside the loop
            warmup = False
        note = s.note + {None: "", "cold": " (measured cold: another step would outlast the time limit)",
                         "cut": " (last: another step would outlast the time limit)"}[limit]
        if progress:
            print(progress_line(step, seconds, tokens, loss, warmup, note), flush=True)
        out.losses[step] = loss
        if not warmup:
            extra = {**s.extra, **({"time_limit": limit} if limit else {})}
            out.iterations.append(iteration_row(
                step, seconds, tokens, loss, stall_count=s.stall_count, stall_seconds=s.stall_seconds,
                migration_seconds=s.migration_seconds, bytes_offloaded=s.bytes_offloaded,
                bytes_prefetched=s.bytes_prefetched, **extra))
        if limit:
            break
    return out


def _any_rank(flag: bool, device: torch.device) -> bool:
    """``flag`` of any rank of the default process group (one all-reduce; the flag itself
    without one): the ranks of a run stop at the same step."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([float(flag)], device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
