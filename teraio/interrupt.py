"""SIGTERM and SIGINT (Ctrl-C) as an exception, so that a process stopped by either ends
through its ``finally`` blocks: a worker closes its tiers (offload files deleted, pinned
memory unregistered) and writes an ``interrupted`` row; the sweep ends its worker, keeps
that row and stops with one line on the terminal.

A handler's exception is raised wherever the main thread happens to be, and Python drops
one raised inside a weakref callback or a ``__del__`` (it prints "Exception ignored in" and
goes on): the pager's and the capacity tracker's weakref callbacks run many times a step.
So the first signal also leaves its mark in the signal table, and
:func:`raise_if_interrupted`, called at each step of every runner's loop
(``teraio.systems.loop.measure_steps``), raises the exception that was dropped."""
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


class _Arrived:
    """The handler of :data:`SIGNALS` once the first has arrived: later ones are ignored, so
    that the cleanup the first started runs to its end; it remembers the first's number."""

    def __init__(self, signum: int):
        self.signum = signum

    def __call__(self, signum, frame) -> None:
        pass


def raise_on_signals() -> None:
    """From now on the first SIGTERM or SIGINT raises :class:`Interrupted`; later ones are
    ignored, so that the cleanup the first one started runs to its end (the sweep SIGKILLs
    a worker that takes longer, ``teraio.harness.launch.KILL_GRACE_S``)."""
    def handler(signum, frame):
        arrived = _Arrived(signum)
        for sig in SIGNALS:
            signal.signal(sig, arrived)
        raise Interrupted(signum)

    for sig in SIGNALS:
        signal.signal(sig, handler)


def raise_if_interrupted() -> None:
    """Raise :class:`Interrupted` where one of :data:`SIGNALS` has arrived since
    :func:`raise_on_signals` (its exception may have been dropped, the module's docstring
    says where). Call it only where no interruption is being handled: at the start of a
    training step. A no-op in a process that never called :func:`raise_on_signals`."""
    handler = signal.getsignal(signal.SIGTERM)
    if isinstance(handler, _Arrived):
        raise Interrupted(handler.signum)
