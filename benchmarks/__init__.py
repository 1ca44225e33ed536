"""Measurement tools outside the sweep, each a command line run from the repository root as
``python -m benchmarks.<name>`` (``benchmarks/README.md`` lists them). Their logic is the
package's (``teraio.perf.replay``, ``teraio.perf.replan``, ``teraio.perf.jobdir``, ...);
each tool parses its arguments, calls it and writes its file."""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
from pathlib import Path
from typing import Callable, Iterator

from teraio.files import write_atomic


def command(module: str, argv: list[str]) -> str:
    """The command line that runs ``module`` (``benchmarks.<name>``) with ``argv``, as the
    tools record it beside their numbers."""
    return shlex.join(["python", "-m", module, *argv])


@contextlib.contextmanager
def refusing(module: str) -> Iterator[None]:
    """Turn the ``ValueError`` a tool's input raises (a job dir without its files, a damaged
    one: ``teraio.perf.jobdir``, each naming the file) into one line and exit status 1,
    instead of a traceback; nothing is written."""
    try:
        yield
    except ValueError as e:
        raise SystemExit(f"python -m {module}: {e}") from e


def job_tool(module: str, description: str, argv: list[str], per_job: Callable[[Path], dict],
             line: Callable[[dict], str]) -> None:
    """The command line of a tool that reads TeraIO job directories (``JOB_DIR ... --out
    FILE.json``): ``per_job`` of each (its ``ValueError`` refused as :func:`refusing` does,
    before anything is written), ``line`` of each printed, and ``{"command", "jobs"}``
    written to ``--out`` atomically."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    ap.add_argument("jobs", nargs="+", type=Path, help="TeraIO job directories (row, trace and plan)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    jobs = []
    for job in args.jobs:
        with refusing(module):
            j = per_job(job)
        print(f"{job}: {line(j)}")
        jobs.append(j)
    write_atomic(args.out, (json.dumps({"command": command(module, argv), "jobs": jobs}, indent=1) + "\n").encode())
