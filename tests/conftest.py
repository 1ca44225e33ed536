"""Shared pytest set-up.

GPU tests get a time limit (pytest-timeout, ``method="thread"``): a test that hangs on the
lent GPU then fails with every thread's stack printed, instead of using up the device call
with nothing to show (a TeraIO GPU test once ran until the GPU call's deadline)."""
from __future__ import annotations

import pytest

GPU_TEST_TIMEOUT_S = 300


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT_S, method="thread"))
