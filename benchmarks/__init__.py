"""Measurement tools outside the sweep, each a command line run from the repository root as
``python -m benchmarks.<name>`` (``benchmarks/README.md`` lists them). Their logic is the
package's (``teraio.perf.replay``, ``teraio.perf.replan``, ``teraio.perf.jobdir``, ...);
each tool parses its arguments, calls it and writes its file."""
from __future__ import annotations

import contextlib
import shlex
from typing import Iterator


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
