"""One run's result row: the ``result.json`` every worker writes (format ``teraio.result/1``).

Schema (keys always present; unknown values are ``null``):

``status``            ``"ok" | "oom" | "error" | "timeout"``
``error``             error text, or null when ok
``measure``           ``"measured"`` (timed on hardware) or ``"modeled"`` (performance model)
``point``             ``{model, system, hardware, batch_size, micro_batch_size, seq_len, trial}``
``config``            the whole resolved run config (dict)
``iterations``        list, one per *measured* iteration:
                      ``{step, seconds, tokens, tokens_per_s, loss, stall_count, stall_seconds,
                      migration_seconds, bytes_offloaded: {ssd, host}, bytes_prefetched: {ssd, host}}``
                      (seconds: wall time of the iteration; migration_seconds: time at least one
                      transfer was in flight; byte counts in bytes; null where a system cannot tell)
``tokens_per_s``      mean over measured iterations (tokens/s)
``stall_count``, ``stall_seconds``   totals over measured iterations
``bytes_per_tier``    ``{ssd, host}``: bytes offloaded + prefetched over measured iterations
``peak_allocated_bytes``, ``peak_reserved_bytes``   device memory peaks over the whole run (bytes)
``peak_host_rss_bytes``  peak resident host memory of the worker process (bytes; rank 0's
                      under torchrun; ``teraio.measure.peak_host_rss_bytes``), null for a
                      modeled row or where unknown
``capacity_bytes``    the GPU capacity the run was held to (bytes): the emulated one, or for
                      TeraIO without one on a GPU the device's free memory at start; null
                      when uncapped
``capacity_emulated`` true when ``capacity_bytes`` is an emulated cap, false when it is the
                      real device's, null when uncapped
``paged_steps``       TeraIO: the steps before its plan (0: creates the optimizer state,
                      1: profiled), each ``{step, seconds, loss, peak_allocated_bytes,
                      max_accounted_bytes, evictions, restores, bytes_evicted, bytes_restored,
                      oom_retries}`` (``teraio.pager``); empty for other systems
``tier_gbps``         TeraIO: the planner's bandwidths (GB/s, ``ssd_write_gbps`` ...) and
                      ``source`` of each (the hardware config, or measured on this machine,
                      ``teraio.probe``); null otherwise
``replans``           TeraIO: one entry per step where the workload shape changed and the
                      run profiled and planned again (``{step, shape, profile_seconds,
                      plan_compile_seconds, plan, artifacts}``; that step is not measured);
                      empty otherwise
``step_peak_allocated_bytes``  TeraIO on CUDA: the allocator's peak of every step, the
                      paged ones included (bytes, step order); empty otherwise
``unoffloaded_peak_bytes``  peak live bytes with no offloading (from the trace), null if unknown
``memory_pressure``   M = unoffloaded peak ÷ capacity (paper Fig. 7), null if unknown
``plan_compile_seconds``, ``profile_seconds``   TeraIO one-time costs, null otherwise
``ssd_io_mode``       ``"gds" | "compat" | "direct" | "buffered" | null`` (SSD tier I/O path, ``teraio.storage.SSDTier.mode``)
``gpu_name``, ``versions``, ``host``, ``started_at``, ``finished_at``, ``wall_seconds``
``artifacts``         relative paths of side files in the job dir (trace, plan, oplog, transfers,
                      deepspeed config), by name
"""
from __future__ import annotations

import fcntl
import json
import math
import os
from pathlib import Path
from typing import Any

from teraio.files import write_atomic

FORMAT = "teraio.result/1"
STATUSES: tuple[str, ...] = ("ok", "oom", "error", "timeout")
POINT_KEYS: tuple[str, ...] = ("model", "system", "hardware", "batch_size", "micro_batch_size",
                               "seq_len", "trial")


def empty_result(point: dict, config: dict) -> dict[str, Any]:
    """A result with every schema key present and unknown values null."""
    missing = [k for k in POINT_KEYS if k not in point]
    if missing:
        raise ValueError(f"point lacks {missing}; a point needs {POINT_KEYS}")
    return {
        "format": FORMAT, "status": "error", "error": None, "measure": "measured",
        "point": dict(point), "config": config, "iterations": [],
        "tokens_per_s": None, "stall_count": None, "stall_seconds": None,
        "bytes_per_tier": {"ssd": None, "host": None},
        "peak_allocated_bytes": None, "peak_reserved_bytes": None, "peak_host_rss_bytes": None,
        "capacity_bytes": None, "capacity_emulated": None, "paged_steps": [], "replans": [], "tier_gbps": None,
        "step_peak_allocated_bytes": [], "unoffloaded_peak_bytes": None, "memory_pressure": None,
        "plan_compile_seconds": None, "profile_seconds": None, "ssd_io_mode": None,
        "gpu_name": None, "versions": {}, "host": None, "started_at": None,
        "finished_at": None, "wall_seconds": None, "artifacts": {},
    }


def iteration_row(step: int, seconds: float, tokens: int, loss: float, *, stall_count: int | None = None,
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


def summarize_iterations(result: dict) -> None:
    """Fill the totals (tokens/s, stalls, bytes per tier) from ``result["iterations"]``."""
    its = result["iterations"]
    if not its:
        return
    result["tokens_per_s"] = sum(i["tokens"] for i in its) / sum(i["seconds"] for i in its)

    def total(key: str):
        vals = [i.get(key) for i in its]
        return None if any(v is None for v in vals) else sum(vals)

    result["stall_count"] = total("stall_count")
    result["stall_seconds"] = total("stall_seconds")
    for tier in ("ssd", "host"):
        vals = [(i.get("bytes_offloaded") or {}).get(tier) for i in its] + \
               [(i.get("bytes_prefetched") or {}).get(tier) for i in its]
        result["bytes_per_tier"][tier] = None if any(v is None for v in vals) else sum(vals)


def check_finite(result: dict) -> None:
    """Refuse a row whose training diverged or whose timing is broken: every loss (the
    warm-up steps' in ``losses`` too) and every iteration's tokens/s must be finite; a
    modeled row has no loss.

    Raises:
        FloatingPointError: naming the first step and value that is not finite.
    """
    for i in result["iterations"]:
        for key in ("loss", "tokens_per_s"):
            v = i.get(key)
            if (v is not None or key == "tokens_per_s") and not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise FloatingPointError(f"step {i.get('step')}: {key} {v} is not finite")
    for step, loss in enumerate(result.get("losses") or ()):
        if loss is not None and not math.isfinite(loss):
            raise FloatingPointError(f"step {step}: loss {loss} is not finite")


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_result(path: str | Path, result: dict) -> None:
    """Write ``result`` to ``path`` atomically (temp file + rename) and exclusively (the
    check for an ok row and the rename hold a lock file beside ``path``).

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
        with open(path.parent / f".{path.name}.lock", "a") as lock:
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
