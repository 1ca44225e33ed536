"""The worker: one run of one system on one point, in its own process.

    python -m teraio.harness.run <job dir>/resolved.yaml

Reads the resolved run config (never Hydra), trains with the system's runner, and writes
``<job dir>/result.json`` (``teraio.result``) whatever happens: ``ok``, ``oom`` (the GPU,
or the emulated capacity, ran out of memory), or ``error`` with the traceback (a loss or
a throughput that is not finite is an error too, naming the step). Exits 0
once the row is written; a non-zero exit means no row (the sweep then writes one).

Runners (``run(cfg, job_dir, device) -> teraio.result.Measurements``, raising on failure)
come from the registry (``teraio.systems``) and are imported only when needed, so a broken
or missing one fails its own points and nothing else. The row is made here, by
``teraio.result.result_row``, from what the runner returned (or, when it raised, from what it
had measured by then: ``teraio.result.kept_on_failure``).

SIGTERM or SIGINT ends the run through the runner's ``finally`` blocks (its tiers closed,
their files deleted; ``teraio.interrupt``) and the row is ``interrupted``.

Under torchrun (``hardware.n_gpus`` > 1, or ``workload.pipeline_stages`` > 1: one rank per
stage) every rank trains on ``cuda:<LOCAL_RANK>`` (or the CPU) and rank 0 alone writes the
row and prints its status.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

# Before torch is imported: the caching allocator maps memory in growable segments, so the
# blocks freed and re-allocated by offloading do not strand GiBs between fixed-size segments
# (PyTorch "CUDA semantics", expandable_segments). A value set by the user wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from teraio import systems
from teraio.config import RunConfig, load_run_config
from teraio.systems.measure import environment_facts, peak_host_rss_bytes
from teraio.interrupt import Interrupted, raise_on_signals
from teraio.result import Measurements, check_finite, measured_before, result_row, write_result
from teraio.harness.launch import LOG_ONLY
from teraio.harness.tune import row_tuning

Runner = Callable[[RunConfig, Path, torch.device], Measurements]


def load_runner(system: str) -> Runner:
    """The ``run`` function of ``system``'s runner (``teraio.systems``)."""
    return systems.load_runner(system)


def run_device(cfg: RunConfig) -> torch.device:
    """``hardware.device``, with the rank's GPU under torchrun (``LOCAL_RANK``)."""
    device = torch.device(cfg.hardware.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def is_oom(e: BaseException) -> bool:
    """True for torch's OOM error and for the 'out of memory' RuntimeErrors that CUDA,
    cuBLAS and DeepSpeed raise without using it."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower())


def iso_time(t: float | None = None) -> str:
    """``t`` (seconds since the epoch; default now) as an ISO 8601 UTC timestamp."""
    t = time.time() if t is None else t
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def note_time_limit(cfg: RunConfig, measured: Measurements) -> None:
    """Where the measurement loop stopped before the time limit (an iteration's
    ``time_limit``, ``teraio.systems.loop.measure_steps``), the row's ``time_limited``:
    ``{reason: "cold" (its one step, the run's first, measured with no warm-up) | "cut"
    (fewer measured steps, after a shortened warm-up or none cut), measured_steps,
    asked_steps, timeout_s}``."""
    reasons = [i["time_limit"] for i in measured.iterations if i.get("time_limit")]
    if reasons:
        measured.extras["time_limited"] = {"reason": reasons[0], "measured_steps": len(measured.iterations),
                                           "asked_steps": cfg.workload.measure_steps, "timeout_s": cfg.timeout_s}


def run_point(cfg: RunConfig, job_dir: Path, runner: Runner | None = None) -> dict:
    """Train ``cfg`` and return its result row (never raises for a failed run: the failure
    is the row's status and message; :class:`~teraio.interrupt.Interrupted` makes an
    ``interrupted`` row)."""
    device = run_device(cfg)
    started_at = iso_time()
    t0 = time.perf_counter()
    facts: dict = {}
    measured = None
    try:
        facts = environment_facts(device)
        measured = (runner or load_runner(cfg.system.name))(cfg, job_dir, device)
        if not isinstance(measured, Measurements):
            raise TypeError(f"the runner of {cfg.system.name} returned {type(measured).__name__}; a runner "
                            "returns teraio.result.Measurements (teraio.systems)")
        if not measured.iterations:
            raise RuntimeError(f"{cfg.system.name} measured no iteration "
                               f"(workload.measure_steps={cfg.workload.measure_steps})")
        check_finite(measured)
        note_time_limit(cfg, measured)
        status, error = "ok", None
    except Interrupted as e:  # the runner's finally blocks have closed its tiers
        if not isinstance(measured, Measurements):
            measured = measured_before(e)
        status, error = "interrupted", f"{e} at {iso_time()}"
    except Exception as e:  # every failure becomes the row's status and message
        if not isinstance(measured, Measurements):
            measured = measured_before(e)
        status, error = "oom" if is_oom(e) else "error", traceback.format_exc()
    # A modeled row ran nothing worth counting.
    host_rss = peak_host_rss_bytes() if measured.measure == "measured" else None
    return result_row(cfg.point(), cfg.to_dict(), measured, status=status, error=error, **facts,
                      peak_host_rss_bytes=host_rss, started_at=started_at, finished_at=iso_time(),
                      wall_seconds=time.perf_counter() - t0)


class _LogOnlyLines(logging.Formatter):
    """Each line of a record marked for ``worker.log`` alone (``LOG_ONLY``)."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(LOG_ONLY + line for line in super().format(record).splitlines())


def log_only_output() -> None:
    """Send what libraries say through Python's warnings and logging (records of loggers
    with no handler of their own) to ``worker.log`` alone: every line marked ``LOG_ONLY``,
    so that a warning's source line or a multi-line message (a docstring) never reaches
    the sweep's terminal as a bare fragment (``teraio.harness.launch``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogOnlyLines("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.captureWarnings(True)


def end_lines(result: dict, log: Path) -> tuple[str, str | None]:
    """What the worker prints of its row at its end: the status line (rank 0's) and its
    failure, if any. An ``oom`` is an outcome, not a crash: its status line names ``log``,
    where its traceback goes alone (marked ``LOG_ONLY``); any other failure's traceback is
    printed whole."""
    tps, error = result["tokens_per_s"], result["error"]
    if result["status"] == "oom":
        return f"oom (its traceback is in {log})", "\n".join(LOG_ONLY + line for line in (error or "").splitlines())
    return f"{result['status']}" + (f": {tps:.1f} tokens/s" if tps else ""), error


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m teraio.harness.run <job dir>/resolved.yaml", file=sys.stderr)
        return 2
    resolved = Path(argv[0])
    log_only_output()
    raise_on_signals()
    cfg = load_run_config(resolved)
    result = {**run_point(cfg, resolved.parent), **row_tuning(resolved.parent)}
    status, failure = end_lines(result, resolved.parent / "worker.log")
    if int(os.environ.get("RANK", 0)) == 0:
        write_result(resolved.parent / "result.json", result)
        print(status, flush=True)
    if failure:  # every rank's own failure
        print(failure, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
