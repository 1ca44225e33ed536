"""One run's result row: the ``result.json`` every worker writes (format ``teraio.result/1``).

Schema (keys always present; unknown values are ``null``):

``status``            ``"ok" | "oom" | "error" | "timeout" | "interrupted"`` (``interrupted``: the
                      run was stopped by SIGTERM/SIGINT before it ended; like every status but
                      ``ok`` it is not counted, and the next sweep runs the point again)
``error``             error text, or null when ok
``measure``           ``"measured"`` (timed on hardware), ``"composed"`` (Ideal: the step
                      composed from its phases, each timed on hardware, where the whole step
                      does not fit: ``baselines.ideal.run_composed``) or ``"modeled"``
                      (performance model)
``point``             ``{model, system, hardware, batch_size, micro_batch_size, seq_len, trial}``
``config``            the whole resolved run config (dict)
``iterations``        list, one per *measured* iteration:
                      ``{step, seconds, tokens, tokens_per_s, loss, stall_count, stall_seconds,
                      migration_seconds, bytes_offloaded: {ssd, host}, bytes_prefetched: {ssd, host}}``
                      (seconds: wall time of the iteration; migration_seconds: time at least one
                      transfer was in flight; byte counts in bytes; null where a system cannot tell);
                      TeraIO's add what its engine counted, among them ``gpu_idle_seconds`` on CUDA:
                      the seconds the compute stream ran none of the step's ops (its stalls as the
                      GPU saw them; ``stall_seconds`` also counts the training thread's waits for
                      SSD transfers, while the GPU may run work queued before them;
                      ``MigrationEngine.gpu_idle_seconds``); every system's on CUDA add
                      ``allocator``, the caching allocator's retries, stream syncs and device
                      allocations in the step (``teraio.systems.measure.ALLOCATOR_EVENTS``)
``tokens_per_s``      mean over measured iterations (tokens/s)
``stall_count``, ``stall_seconds``   totals over measured iterations
``bytes_per_tier``    ``{ssd, host}``: bytes offloaded + prefetched over measured iterations
                      (these totals: of an ok row; a failed row's stay null, its iterations
                      may be partial)
``peak_allocated_bytes``, ``peak_reserved_bytes``   device memory peaks over the whole run (bytes)
``peak_host_rss_bytes``  peak resident host memory of the worker process (bytes; rank 0's
                      under torchrun; ``teraio.systems.measure.peak_host_rss_bytes``), null for a
                      modeled row or where unknown
``capacity_bytes``    the GPU capacity the run was held to (bytes): the emulated one, or for
                      TeraIO without one on a GPU the device's free memory at start; null
                      when uncapped
``capacity_emulated`` true when ``capacity_bytes`` is an emulated cap, false when it is the
                      real device's, null when uncapped
``paged_steps``       TeraIO: the steps before its plan (0: creates the optimizer state,
                      1: profiled), each ``{step, seconds, loss, peak_allocated_bytes,
                      max_accounted_bytes, evictions, restores, bytes_evicted, bytes_restored,
                      oom_retries}`` (``teraio.core.pager``); empty for other systems
``tier_gbps``         TeraIO: the planner's bandwidths (GB/s, ``ssd_write_gbps`` ...) and
                      ``source`` of each (the hardware config, or measured on this machine,
                      ``teraio.core.probe``); null otherwise
``replans``           TeraIO: one entry per step where the workload shape changed and the
                      run profiled and planned again (``{step, shape, profile_seconds,
                      plan_compile_seconds, plan, artifacts}``; that step is not measured),
                      or, for a shape seen before, reused its trace and plan (``reused:
                      true``, ``profile_seconds`` null, ``plan_compile_seconds`` null unless
                      the SSD room had shrunk and the trace was planned again; that step is
                      measured); empty otherwise
``step_peak_allocated_bytes``  TeraIO on CUDA: the allocator's peak of every step, the
                      paged ones included (bytes, step order); empty otherwise
``unoffloaded_peak_bytes``  peak live bytes with no offloading (from the trace), null if unknown
``memory_pressure``   M = unoffloaded peak ÷ capacity (paper Fig. 7), null if unknown
``plan_compile_seconds``, ``profile_seconds``   TeraIO one-time costs, null otherwise
``ssd_io_mode``       ``"gds" | "compat" | "direct" | "buffered" | null`` (SSD tier I/O path, ``teraio.core.tiers.ssd.SSDTier.mode``)
``gpu_name``, ``versions``, ``host``, ``started_at``, ``finished_at``, ``wall_seconds``
``allocator_conf``    the CUDA caching allocator's settings the worker ran with
                      (``teraio.systems.measure.allocator_conf``; ``teraio.harness.run`` sets
                      expandable segments unless the user set them), null on a CPU device or
                      where none is set
``artifacts``         relative paths of side files in the job dir (trace, plan, oplog, transfers,
                      deepspeed config), by name

Written after those, where the runner gave them:

``losses``            every step's loss in step order, the warm-up and paged steps included
                      (:attr:`Measurements.losses`; absent from a modeled row and from a row
                      whose runner raised)

and the runner-specific keys (:attr:`Measurements.extras`):

``plan``              TeraIO: the first plan's ``{capacity_bytes, predicted_peak_bytes,
                      shortfall_bytes, migrations, bytes_per_tier}`` (also on a failed row
                      once the plan was made)
``final_params_sha256``  TeraIO: digest of the trained parameters (``teraio.systems.measure.param_digest``)
``audits``            TeraIO on CUDA: per engine (one, and one more per re-plan), its first step's
                      ``{step, first, largest, lingering}``: the first and largest overrun of the
                      plan's account ``[op, bytes]`` and what lingered at the largest
                      (``teraio.core.engine.StepStats.audit``); absent where no step ended well
``modeled_from``      Ideal, modeled row: the trace file its iteration time comes from
``composed``          Ideal, composed row: ``{micro_batches, warmup_repeats, micro_batch_seconds,
                      optimizer_seconds}``, every timed repeat of each phase (seconds)
``time_limited``      where the measurement loop stopped before the worker's time limit
                      (``teraio.systems.loop.measure_steps``): ``{reason: "cold" (its one
                      measured step, the run's first, had no warm-up: a second would have
                      outlasted the limit) | "cut" (fewer measured steps than asked, the
                      warm-up perhaps shortened), measured_steps, asked_steps, timeout_s}``;
                      that iteration has ``time_limit`` (``teraio.harness.run``)
``fell_back_from``    Ideal: what did not fit before the row's ``measure``,
                      ``[{measure, status: "oom", message}]`` (absent where the first fit)
``tuning``            a run whose system was tuned before its trials (``teraio.harness.tune``;
                      absent otherwise): ``{file, chosen, candidates}``: the tuning record
                      (path relative to the sweep dir), the setting it ran with (its
                      ``system.options`` keys; null where no candidate ran) and every
                      candidate tried, ``{setting, status, tokens_per_s, message}``; a TeraIO
                      run whose point decides ``"auto"`` choices once (``teraio.harness.tune.decided``):
                      ``{file, decides: [choices]}`` for the trial that made them, else
                      ``{file, chosen, workload, decided_by}``: the options and workload keys it
                      ran with and the job dir of the trial that made them
``zero_micro_batch_size``  ZeRO: the micro-batch it trained with (``system.options.micro_batch_size``,
                      else the point's)
``capacity_enforced``  ZeRO on a CPU device: false, nothing held the run to ``capacity_bytes``
                      (the emulated cap binds CUDA's allocator only); absent where it was enforced

Every row, failed or ok, is made by :func:`result_row`: a runner returns
:class:`Measurements` and the worker (``teraio.harness.run``) merges them with the run's facts.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from teraio.files import write_atomic

FORMAT = "teraio.result/1"
STATUSES: tuple[str, ...] = ("ok", "oom", "error", "timeout", "interrupted")
POINT_KEYS: tuple[str, ...] = ("model", "system", "hardware", "batch_size", "micro_batch_size",
                               "seq_len", "trial")
# Facts of the run itself, set by the worker or the sweep (not by a runner).
RUN_KEYS: tuple[str, ...] = ("gpu_name", "versions", "host", "started_at", "finished_at", "wall_seconds",
                             "peak_host_rss_bytes", "allocator_conf")


@dataclass
class Measurements:
    """What a runner measured (``teraio.systems``: a runner returns one). Each field is the
    row key of the same name (schema above); :func:`result_row` derives the totals
    (``tokens_per_s``, ``stall_count``, ``stall_seconds``, ``bytes_per_tier``) from
    ``iterations``.

    Attributes:
        losses: every step's loss in step order (the row's ``losses``); None: no such key
            (a modeled row).
        extras: runner-specific row keys beyond the schema (the documented ones above);
            a key of the schema here is refused by :func:`result_row`.
    """

    measure: str = "measured"
    iterations: list[dict] = field(default_factory=list)
    losses: list[float] | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    capacity_bytes: int | None = None
    capacity_emulated: bool | None = None
    paged_steps: list[dict] = field(default_factory=list)
    replans: list[dict] = field(default_factory=list)
    tier_gbps: dict | None = None
    step_peak_allocated_bytes: list[int] = field(default_factory=list)
    unoffloaded_peak_bytes: int | None = None
    memory_pressure: float | None = None
    plan_compile_seconds: float | None = None
    profile_seconds: float | None = None
    ssd_io_mode: str | None = None
    artifacts: dict[str, str] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def kept_on_failure(measured: Measurements) -> Iterator[Measurements]:
    """Attach ``measured`` to an exception leaving the block (its ``measurements``
    attribute, read by :func:`measured_before`), so that a failure row keeps what the runner
    measured before it failed (the plan that fell short, the capacity, the bandwidths)."""
    try:
        yield measured
    except BaseException as e:
        e.measurements = measured
        raise


def measured_before(e: BaseException) -> Measurements:
    """The measurements a runner had made when it raised ``e`` (:func:`kept_on_failure`);
    empty ones if it attached none."""
    return getattr(e, "measurements", None) or Measurements()


def result_row(point: dict, config: dict, measured: Measurements | None = None, *, status: str = "error",
               error: str | None = None, **run_facts: Any) -> dict[str, Any]:
    """The one builder of a result row: every schema key present, unknown values null; then
    ``measured`` (none: a row that measured nothing, e.g. a failed worker's), the status,
    the totals over the iterations of an ``ok`` row (a failed row's iterations may be
    partial: its totals stay null) and the run's facts (``run_facts``, keys of :data:`RUN_KEYS`); then
    ``losses`` (when given) and the runner's ``extras``.

    Raises:
        ValueError: ``point`` lacks a key of :data:`POINT_KEYS`, a ``run_facts`` key is not
            in :data:`RUN_KEYS`, or an ``extras`` key is a schema key.
    """
    missing = [k for k in POINT_KEYS if k not in point]
    if missing:
        raise ValueError(f"point lacks {missing}; a point needs {POINT_KEYS}")
    unknown = sorted(set(run_facts) - set(RUN_KEYS))
    if unknown:
        raise ValueError(f"run facts {unknown}; valid: {RUN_KEYS}")
    m = measured or Measurements()
    row = {
        "format": FORMAT, "status": status, "error": error, "measure": m.measure,
        "point": dict(point), "config": config, "iterations": list(m.iterations),
        "tokens_per_s": None, "stall_count": None, "stall_seconds": None,
        "bytes_per_tier": {"ssd": None, "host": None},
        "peak_allocated_bytes": m.peak_allocated_bytes, "peak_reserved_bytes": m.peak_reserved_bytes,
        "peak_host_rss_bytes": None, "capacity_bytes": m.capacity_bytes,
        "capacity_emulated": m.capacity_emulated, "paged_steps": list(m.paged_steps),
        "replans": list(m.replans), "tier_gbps": m.tier_gbps,
        "step_peak_allocated_bytes": list(m.step_peak_allocated_bytes),
        "unoffloaded_peak_bytes": m.unoffloaded_peak_bytes, "memory_pressure": m.memory_pressure,
        "plan_compile_seconds": m.plan_compile_seconds, "profile_seconds": m.profile_seconds,
        "ssd_io_mode": m.ssd_io_mode, "gpu_name": None, "allocator_conf": None, "versions": {}, "host": None,
        "started_at": None,
        "finished_at": None, "wall_seconds": None, "artifacts": dict(m.artifacts),
    }
    if status == "ok":
        row.update(iteration_totals(row["iterations"]))
    row.update(run_facts)
    clash = sorted(set(m.extras) & (set(row) | {"losses"}))
    if clash:
        raise ValueError(f"extras {clash} are schema keys; set them as Measurements fields")
    if m.losses is not None:
        row["losses"] = list(m.losses)
    row.update(m.extras)
    return row


def iteration_row(step: int, seconds: float, tokens: int, loss: float | None, *, stall_count: int | None = None,
                  stall_seconds: float | None = None, migration_seconds: float | None = None,
                  bytes_offloaded: dict | None = None, bytes_prefetched: dict | None = None,
                  **extra) -> dict:
    """One entry of ``result["iterations"]`` (schema above). Migration fields a system
    cannot observe stay null; ``extra`` keys are system-specific additions."""
    none = {"ssd": None, "host": None}
    return {"step": step, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "loss": loss, "stall_count": stall_count, "stall_seconds": stall_seconds,
            "migration_seconds": migration_seconds,
            "bytes_offloaded": dict(bytes_offloaded or none), "bytes_prefetched": dict(bytes_prefetched or none),
            **extra}


def progress_line(step: int, seconds: float, tokens: int, loss: float, warmup: bool, extra: str = "") -> str:
    """The per-iteration line every worker prints (the sweep streams it to the terminal)."""
    return (f"step {step} {seconds:.3f}s {tokens / seconds:.1f} tokens/s loss {loss:.6f}{extra}"
            + (" (warm-up)" if warmup else ""))


def human_bytes(n: int | float) -> str:
    """``n`` bytes for a reader, in decimal units with one decimal: ``0 B``, ``950 B``,
    ``1.5 kB``, ``64.0 GB``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def iteration_totals(its: list[dict]) -> dict[str, Any]:
    """The totals over measured ``its`` (a row's, or a pipeline stage's): mean tokens/s,
    summed stalls and bytes per tier (null where an iteration has null; empty when there is
    no iteration)."""
    if not its:
        return {}

    def total(vals):
        return None if any(v is None for v in vals) else sum(vals)

    return {
        "tokens_per_s": sum(i["tokens"] for i in its) / sum(i["seconds"] for i in its),
        "stall_count": total([i.get("stall_count") for i in its]),
        "stall_seconds": total([i.get("stall_seconds") for i in its]),
        "bytes_per_tier": {tier: total([(i.get("bytes_offloaded") or {}).get(tier) for i in its]
                                       + [(i.get("bytes_prefetched") or {}).get(tier) for i in its])
                           for tier in ("ssd", "host")},
    }


def check_loss(step: int, loss: float | None) -> None:
    """Raise FloatingPointError (naming ``step`` and the value) for a loss that is not finite;
    None (no loss: a modeled step) passes."""
    if loss is not None and not (isinstance(loss, (int, float)) and math.isfinite(loss)):
        raise FloatingPointError(f"step {step}: loss {loss} is not finite")


def check_finite(measured: Measurements) -> None:
    """Refuse measurements whose training diverged or whose timing is broken: every loss (the
    warm-up steps' in ``losses`` too) and every iteration's tokens/s must be finite; a
    modeled row has no loss.

    Raises:
        FloatingPointError: naming the first step and value that is not finite.
    """
    for i in measured.iterations:
        check_loss(i.get("step"), i.get("loss"))
        v = i.get("tokens_per_s")
        if not (isinstance(v, (int, float)) and math.isfinite(v)):
            raise FloatingPointError(f"step {i.get('step')}: tokens_per_s {v} is not finite")
    for step, loss in enumerate(measured.losses or ()):
        check_loss(step, loss)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def lock_path(path: Path) -> Path:
    """The lock file beside ``path`` that :func:`write_result` holds while it writes it."""
    return path.parent / f".{path.name}.lock"


def write_result(path: str | Path, result: dict) -> None:
    """Write ``result`` to ``path`` atomically (temp file + rename) and exclusively (the
    check for an ok row and the rename hold :func:`lock_path`).

    Raises:
        ValueError: status not in ``STATUSES``.
        FileExistsError: ``path`` already holds an ``ok`` result (results are never
            overwritten; a failed one may be replaced by a rerun).
    """
    if result.get("status") not in STATUSES:
        raise ValueError(f"result status {result.get('status')!r} not in {STATUSES}")
    def commit(tmp: str, path: Path) -> None:
        # The check and the rename under one lock: of two writers at the same instant,
        # the second sees the first's ok row.
        with open(lock_path(path), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if read_status(path) == "ok":
                raise FileExistsError(f"{path} already holds an ok result; refusing to overwrite it")
            os.replace(tmp, path)

    write_atomic(path, json.dumps(_json_safe(result), indent=1).encode(), commit)


def read_status(path: str | Path) -> str | None:
    """The status stored in a result file, or None if absent or unreadable."""
    try:
        return json.loads(Path(path).read_text()).get("status")
    except (OSError, ValueError):
        return None
