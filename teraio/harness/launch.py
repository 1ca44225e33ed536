"""Running one worker process: its command (``python -m teraio.harness.run``, ``torchrun`` for
several GPUs, or the test hook ``$TERAIO_WORKER_CMD``), its output streamed to the terminal
and to ``worker.log`` (library chatter to the log only), and its process group ended past
``timeout_s`` or when the sweep is interrupted (SIGTERM, then SIGKILL after
:data:`KILL_GRACE_S`)."""
from __future__ import annotations

import collections
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console

from teraio.config import RunConfig
from teraio.systems.loop import DEADLINE_ENV

KILL_GRACE_S = 10.0
LOG_TAIL_LINES = 40

console = Console(highlight=False, emoji=False, soft_wrap=True)


def worker_command(run: RunConfig, resolved: Path) -> list[str]:
    """``python -m teraio.harness.run <resolved>``; under ``torchrun`` (one process per GPU,
    which also serves DeepSpeed: it reads the same environment) for ``hardware.n_gpus``
    > 1, or one per stage for ``workload.pipeline_stages`` > 1; or the test hook
    ``$TERAIO_WORKER_CMD``."""
    if os.environ.get("TERAIO_WORKER_CMD"):
        return shlex.split(os.environ["TERAIO_WORKER_CMD"]) + [str(resolved)]
    procs = max(run.hardware.n_gpus, run.workload.pipeline_stages)
    if procs > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={procs}", "-m", "teraio.harness.run", str(resolved)]
    return [sys.executable, "-m", "teraio.harness.run", str(resolved)]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the sweep dies, so that no orphan worker
    writes into a rerun's job dir (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


LOG_ONLY = "[log] "
"""The start of a worker's line meant for ``worker.log`` alone: each line of a Python warning
or of a library's log record (``teraio.harness.run.log_only_output``), and an expected
failure's traceback."""

# Library chatter a worker prints (DeepSpeed's and torch's log lines, the lines it marks
# LOG_ONLY): worker.log keeps it, the terminal shows the worker's own lines.
_LIBRARY_NOISE = re.compile(r"^\[\d{4}-\d\d-\d\d [^]]*\] \[(INFO|WARNING|DEBUG)\]|Warning: |^\s+warnings\.warn\(|"
                            r"^\s*$|^Using .* as PyTorch extensions root|^(Emitting|Building|Loading|Time to load) |"
                            + "^" + re.escape(LOG_ONLY))


def launch_worker(run: RunConfig, job_dir: Path, resolved: Path) -> tuple[int | None, list[str]]:
    """Run the worker, streaming its lines to ``worker.log`` and, but for library chatter
    (:data:`_LIBRARY_NOISE`), to the terminal. Its environment's
    ``teraio.systems.loop.DEADLINE_ENV`` is the Unix time at which it is killed.

    Returns:
        (exit code, or None when killed after ``timeout_s``; its last output lines).
    """
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    # The kill time, for the measurement loop to stop before it (teraio.systems.loop).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", DEADLINE_ENV: repr(time.time() + run.timeout_s)}
    cmd = worker_command(run, resolved)
    with open(job_dir / "worker.log", "a") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
        log.flush()
        # Its own session: the whole process group (torchrun's ranks too) is killed on timeout.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                env=env, start_new_session=True, preexec_fn=_die_with_parent)

        ending = threading.Event()  # set when the sweep ends the worker: its last words go to the log only

        def pump() -> None:
            hidden = 0
            for line in proc.stdout:
                log.write(line)
                log.flush()
                tail.append(line.rstrip("\n"))
                if ending.is_set():
                    continue
                if _LIBRARY_NOISE.search(line):
                    hidden += 1
                    if hidden == 1:
                        console.print(f"  │ (library messages go to {job_dir / 'worker.log'})", markup=False)
                    continue
                console.print(f"  │ {line.rstrip()}", markup=False)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=run.timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            # A timeout, the sweep interrupted (the worker then writes its interrupted row,
            # teraio.interrupt), or children left behind by a finished worker (they
            # would hold its output pipe open).
            if proc.poll() is None:
                ending.set()
            _kill_group(proc)
        reader.join()
    return rc, list(tail)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group, SIGKILL after ``KILL_GRACE_S`` if the
    worker is still there."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
