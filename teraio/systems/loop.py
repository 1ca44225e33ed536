"""The one measurement loop every system runs: warm-up steps, then measured ones, each timed
the same way, printed the same way and refused the same way when its loss is not finite.

A system hands the loop a step function ``step_fn(step) -> Step | None``: called untimed,
it prepares step ``step`` (its batch, a re-plan) and returns the work to time; None means
the step ran outside the loop (TeraIO's re-profiled steps, which time and print
themselves) and is neither timed here nor measured.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from teraio.config import WorkloadConfig
from teraio.systems.measure import timed
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
                  progress: bool = True, out: Steps | None = None) -> Steps:
    """Run steps ``first_step .. warmup_steps + measure_steps - 1``. Per step: ``step_fn(step)``
    untimed; its ``run`` timed with the device synchronised at both ends
    (``teraio.systems.measure.timed``); the loss checked; ``stats``; the progress line
    (``teraio.result.progress_line``, printed when ``progress``); and, from
    ``workload.warmup_steps`` on, the iteration row, of ``workload.tokens_at(step)`` tokens.

    Each step is recorded in ``out`` (default: a new :class:`Steps`) as it completes, so a
    runner that passes its own keeps the steps measured before a failure; ``out`` is
    returned.

    Raises:
        FloatingPointError: a step's loss is not finite (naming the step; before its line).
    """
    out = Steps() if out is None else out
    for step in range(first_step, workload.warmup_steps + workload.measure_steps):
        this = step_fn(step)
        if this is None:
            continue
        with timed(device) as t:
            loss = this.run()
        check_loss(step, loss)
        s = this.stats()
        seconds, tokens, warmup = t["seconds"], workload.tokens_at(step), step < workload.warmup_steps
        if progress:
            print(progress_line(step, seconds, tokens, loss, warmup, s.note), flush=True)
        out.losses[step] = loss
        if not warmup:
            out.iterations.append(iteration_row(
                step, seconds, tokens, loss, stall_count=s.stall_count, stall_seconds=s.stall_seconds,
                migration_seconds=s.migration_seconds, bytes_offloaded=s.bytes_offloaded,
                bytes_prefetched=s.bytes_prefetched, **s.extra))
    return out
