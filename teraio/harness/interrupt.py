"""SIGTERM and SIGINT (Ctrl-C) as an exception, so that a process stopped by either ends
through its ``finally`` blocks: a worker closes its tiers (offload files deleted, pinned
memory unregistered) and writes an ``interrupted`` row; the sweep ends its worker, keeps
that row and stops with one line on the terminal."""
from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """Raised in the main thread by :func:`raise_on_signals`' handler. A ``BaseException``
    like ``KeyboardInterrupt``, so that no ``except Exception`` of a runner swallows it.

    Attributes:
        signum: the signal that arrived.
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


def raise_on_signals() -> None:
    """From now on the first SIGTERM or SIGINT raises :class:`Interrupted`; later ones are
    ignored, so that the cleanup the first one started runs to its end (the sweep SIGKILLs
    a worker that takes longer, ``teraio.harness.launch.KILL_GRACE_S``)."""
    def handler(signum, frame):
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    for sig in SIGNALS:
        signal.signal(sig, handler)
