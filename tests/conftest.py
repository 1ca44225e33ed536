"""Shared pytest set-up.

GPU tests get a time limit (pytest-timeout, ``method="thread"``): a test that hangs on the
lent GPU then fails with every thread's stack printed, instead of using up the device call
with nothing to show (a TeraIO GPU test once ran until the GPU call's deadline).

Tests run under the CUDA allocator configuration of every run (``teraio.harness.run`` sets
``PYTORCH_CUDA_ALLOC_CONF`` to expandable segments when imported, before CUDA starts). In a
process without it, capped GPU tests ran out of memory with about 271 MiB of the 851 MiB allowed
reserved but unallocated (``benchmarks/results/gpu_tests_h200/``)."""
from __future__ import annotations

import pytest
import torch

import teraio.harness.run  # noqa: F401  (the allocator configuration above)

GPU_TEST_TIMEOUT_S = 300


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT_S, method="thread"))


class ModelBuilt(Exception):
    """Raised by :func:`cap_then_build`'s stand-in for ``build_model``: the run stops there."""


def open_tiers(plan, tmp_path, host_tier=None) -> dict:
    """The CPU tiers ``plan`` needs, under ``tmp_path`` (which must exist): an SSD tier over
    two directories and a host tier (``host_tier``: its class, default ``HostTier``), each
    with the slots the plan gives the tensors it places there."""
    from teraio.core.tiers.host import HostTier
    from teraio.core.tiers.ssd import SSDTier
    slots = {"ssd": {}, "host": {}}
    for m in plan.migrations:
        slots[m.tier][m.name] = m.nbytes
    tiers = {}
    if slots["ssd"]:
        dirs = [tmp_path / "ssd0", tmp_path / "ssd1"]
        for d in dirs:
            d.mkdir()
        tiers["ssd"] = SSDTier([str(d) for d in dirs], slots["ssd"], shares=plan.shared_slots("ssd"))
    if slots["host"]:
        tiers["host"] = (host_tier or HostTier)(sum(slots["host"].values()) + 4096 * len(slots["host"]),
                                                slots["host"], torch.device("cpu"),
                                                shares=plan.shared_slots("host"))
    return tiers


def cap_then_build(monkeypatch, runner_module, build_module=None) -> list:
    """Replace ``apply_memory_cap`` in ``runner_module`` and ``build_model`` in
    ``build_module`` (default: the runner's own) with recorders: the returned list gets
    ``("cap", capacity)`` and ``"build"`` in call order, and building raises
    :class:`ModelBuilt`, so a test sees what a runner does before its first device
    allocation."""
    calls: list = []

    def build(*args, **kwargs):
        calls.append("build")
        raise ModelBuilt

    monkeypatch.setattr(runner_module, "apply_memory_cap", lambda capacity, device: calls.append(("cap", capacity)))
    monkeypatch.setattr(build_module or runner_module, "build_model", build)
    return calls
