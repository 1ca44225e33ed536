"""Measurement tools outside the sweep, each a command line run from the repository root as
``python -m benchmarks.<name>`` (``benchmarks/README.md`` lists them). Their logic is the
package's (``teraio.perf.replay``, ``teraio.perf.replan``, ``teraio.perf.jobdir``, ...);
each tool parses its arguments, calls it and writes its file."""
from __future__ import annotations

import shlex


def command(module: str, argv: list[str]) -> str:
    """The command line that runs ``module`` (``benchmarks.<name>``) with ``argv``, as the
    tools record it beside their numbers."""
    return shlex.join(["python", "-m", module, *argv])
