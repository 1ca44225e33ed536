"""Locks that let the sweeps of one host share a runs dir and drives: one run at a time per
point (:func:`hold_point`) and one drive-bound run at a time per drive (:func:`hold_drives`).

A point's job dir holds ``.owner.lock``; the sweep that runs the point holds an exclusive
``flock`` on it from the resume check to the row, so a second sweep of the same point
skips it instead of running it again beside the first.

Two runs that move data through the same drive slow each other down: on the lent
nvidia-h200-x2 machine two ZeRO-Infinity runs, one per GPU, on its one drive each took
about twice as long per step as alone, and both ended as ``timeout`` rows
(``benchmarks/results/raw_gpu_calls/h200x2_b/COMMANDS.md``, call 3). So the sweep holds an
exclusive advisory lock (``fcntl.flock``, Linux ``flock(2)``) per drive while a worker of
such a system runs (``teraio.sweep.run_point_job``); a second sweep on the same host waits
for it before starting its own drive-bound worker, and its ``timeout_s`` starts only then.

The lock is per device, not per directory: its file is named after the ``st_dev`` of the
directory and lives in the host's temporary directory (``tempfile.gettempdir()``), so two
directories on one drive share one lock. Sweeps on different hosts share no lock (their
local drives differ); directories on a network filesystem shared by several hosts are not
covered.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


OWNER_LOCK = ".owner.lock"  # in a point's job dir (:func:`hold_point`)


@contextlib.contextmanager
def hold_point(job_dir: str | os.PathLike) -> Iterator[bool]:
    """Hold the job dir's owner lock for the ``with`` block; yields True, or False at once
    (holding nothing) when another process holds it."""
    with open(Path(job_dir) / OWNER_LOCK, "a") as f:  # closing it releases the lock
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def lock_path(directory: str | os.PathLike) -> Path:
    """The lock file of the drive (device) holding ``directory``.

    Raises:
        ValueError: ``directory`` does not exist.
    """
    try:
        dev = os.stat(directory).st_dev
    except FileNotFoundError:
        raise ValueError(f"offload directory {directory} does not exist, so its drive cannot be "
                         "locked (hardware.ssd_dirs, or zero_infinity's system.options.nvme_path)") from None
    return Path(tempfile.gettempdir()) / f"teraio-drive-{os.major(dev)}-{os.minor(dev)}.lock"


@contextlib.contextmanager
def hold_drives(dirs: Iterable[str | os.PathLike],
                on_wait: Callable[[Path], None] | None = None) -> Iterator[list[Path]]:
    """Hold the drive locks of ``dirs`` (each drive once) for the ``with`` block; yields the
    lock files held. Blocks while another process, or another ``hold_drives`` of this one,
    holds one of them, after calling ``on_wait(lock file)`` once for it.

    Raises:
        ValueError: a directory of ``dirs`` does not exist.
    """
    # One fixed order for every caller, so that two holders of several drives cannot
    # each wait for the other.
    paths = sorted({lock_path(d) for d in dirs})
    with contextlib.ExitStack() as held:
        for path in paths:
            f = held.enter_context(open(path, "a"))  # closing it releases the lock
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait(path)
                fcntl.flock(f, fcntl.LOCK_EX)
        yield paths
