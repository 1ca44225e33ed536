"""teraio.core.pending: offloaded storages freed while their copies may still run, held under a
limit by waiting for the oldest copies first."""
from __future__ import annotations

import pytest

from teraio.core.pending import PendingFrees
from teraio.trainer.options import TeraIOOptions

GB = 10**9


class Copy:
    """A copy that is done once waited for, or from the start."""

    def __init__(self, name: str, log: list, done: bool = False):
        self.name, self.log, self.finished = name, log, done

    def done(self) -> bool:
        return self.finished

    def wait(self) -> int:
        self.log.append(self.name)
        self.finished = True
        return 0


def test_the_oldest_copies_are_waited_for_until_the_live_bytes_and_the_pending_fit():
    log: list[str] = []
    pending = PendingFrees(10 * GB)
    for name in "abc":
        pending.add(Copy(name, log), 2 * GB)
    assert pending.bytes == 6 * GB
    assert pending.settle(4 * GB) == (0, 0.0) and not log  # 4 + 6 fits in 10
    waits, seconds = pending.settle(7 * GB)  # 7 + 6 > 10: a and b go, 7 + 2 fits
    assert (waits, log, pending.bytes) == (2, ["a", "b"], 2 * GB) and seconds >= 0
    assert pending.settle(20 * GB)[0] == 1  # past the limit even alone: every copy waited for
    assert log == ["a", "b", "c"] and pending.bytes == 0
    assert pending.settle(20 * GB) == (0, 0.0)


def test_copies_seen_done_are_dropped_without_a_wait():
    log: list[str] = []
    pending = PendingFrees(GB)
    pending.add(Copy("a", log, done=True), 2 * GB)
    pending.add(Copy("b", log), GB)
    assert pending.settle(0) == (0, 0.0) and pending.bytes == GB and not log
    pending.add(Copy("c", log, done=True), GB)  # done, but behind b: dropped once b is
    assert pending.settle(GB // 2)[0] == 1 and log == ["b"] and pending.bytes == 0


def test_a_copy_done_behind_one_still_running_is_dropped():
    # freed in the order b, a; a (issued first) is done, b is not: only b's bytes are pending
    log: list[str] = []
    pending = PendingFrees(3 * GB)
    pending.add(Copy("b", log), 2 * GB)
    pending.add(Copy("a", log, done=True), 2 * GB)
    assert pending.settle(GB) == (0, 0.0) and pending.bytes == 2 * GB and not log


def test_without_a_limit_nothing_is_waited_for():
    log: list[str] = []
    pending = PendingFrees(None)
    pending.add(Copy("a", log), 50 * GB)
    assert pending.settle(100 * GB) == (0, 0.0) and not log and pending.bytes == 50 * GB


def test_a_negative_limit_and_an_unknown_option_value_are_refused():
    with pytest.raises(ValueError, match="limit_bytes=-1"):
        PendingFrees(-1)
    with pytest.raises(ValueError, match="pending_limit='always'; valid: off, capacity, plan"):
        TeraIOOptions(pending_limit="always")
