"""A job folder, read: the files one run leaves in ``<sweep dir>/<job>/`` (``teraio.sweep``,
``teraio.harness.run``, ``teraio.trainer.runner``), which the performance model replays and
the analysis reads.

=================  ===========================================  ===================
file               holds                                        read by
=================  ===========================================  ===================
``resolved.yaml``  the run's config (``teraio.config``)         :func:`run_config`
``result.json``    its row (``teraio.result``)                  :func:`result`
``trace.json``     its profiled step (``teraio.core.trace``)    :func:`trace`
``plan.json``      its migration plan (``teraio.core.plan``)    :func:`plan`
=================  ===========================================  ===================

Any of them may be kept gzip-compressed instead (``<file>.gz``, as committed reference rows
keep large side files); where both exist the plain file is read. ``prefix`` names the files
of one stage of a pipelined run (``"stage0/"``) or of one run in a folder of several
(``"call1_teraio_mixed_"``: ``call1_teraio_mixed_trace.json.gz``).
"""
from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

from teraio.config import RunConfig, load_run_config
from teraio.core.plan import MigrationPlan
from teraio.core.trace import Trace

RESOLVED, RESULT, TRACE, PLAN = "resolved.yaml", "result.json", "trace.json", "plan.json"


def side_file(job: str | Path, name: str) -> Path | None:
    """``job/name``, else its gzip-compressed copy ``job/name.gz``, whichever exists first;
    None where neither does."""
    path = Path(job) / name
    return next((p for p in (path, path.with_name(path.name + ".gz")) if p.is_file()), None)


def read_json(path: str | Path) -> dict:
    """The JSON document in ``path``, gunzipped first where the name ends in ``.gz``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is damaged (truncated, not gzip where named ``.gz``, not JSON), naming
            the file and what is wrong.
    """
    raw = Path(path).read_bytes()
    try:
        return json.loads(gzip.decompress(raw) if Path(path).suffix == ".gz" else raw)
    except (EOFError, OSError, ValueError, zlib.error) as e:  # gzip's: EOFError, BadGzipFile, zlib.error
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e})") from e


def read_trace(path: str | Path) -> Trace:
    """The profiled step saved in ``path`` (``Trace.save``'s ``.json`` or ``.json.gz``).

    Raises:
        OSError: the file cannot be read.
        ValueError: as :func:`read_json`.
    """
    return Trace.from_dict(read_json(path))


def _required(job: str | Path, name: str) -> Path:
    found = side_file(job, name)
    if found is None:
        raise ValueError(f"{job}: no {name} or {name}.gz")
    return found


def result(job: str | Path, prefix: str = "") -> dict:
    """The run's row (``<prefix>result.json``).

    Raises:
        ValueError: the folder holds no such file, or a damaged one (:func:`read_json`).
    """
    return read_json(_required(job, prefix + RESULT))


def run_config(job: str | Path) -> RunConfig:
    """The run's config (``resolved.yaml``, as its worker read it).

    Raises:
        ValueError: no such file, or a key or value ``teraio.config`` refuses.
    """
    return load_run_config(_required(job, RESOLVED))


def trace(job: str | Path, prefix: str = "", released_grads: bool = False) -> Trace:
    """The run's profiled step (``<prefix>trace.json``), as saved or, with
    ``released_grads``, as a run with ``release_grads`` plans it
    (``Trace.with_released_grads``).

    Raises:
        ValueError: the folder holds no such file, or a damaged one (:func:`read_json`).
    """
    t = read_trace(_required(job, prefix + TRACE))
    return t.with_released_grads() if released_grads else t


def plan(job: str | Path, prefix: str = "") -> MigrationPlan:
    """The run's migration plan (``<prefix>plan.json``).

    Raises:
        ValueError: the folder holds no such file, or a damaged one (:func:`read_json`).
    """
    return MigrationPlan.from_dict(read_json(_required(job, prefix + PLAN)))


def job_dirs(folder: str | Path, pattern: str = "*") -> list[Path]:
    """The job folders in ``folder`` whose names match ``pattern`` (``Path.glob``) and that
    hold a row (``result.json``, or its ``.gz``), sorted by name."""
    return sorted(p for p in Path(folder).glob(pattern) if p.is_dir() and side_file(p, RESULT) is not None)
