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
from teraio.config import run_config_from_dict
from teraio.systems.memory_cap import MemoryCap

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
    ``("cap", capacity, mode)`` and ``"build"`` in call order, and building raises
    :class:`ModelBuilt`, so a test sees what a runner does before its first device
    allocation."""
    calls: list = []

    def build(*args, **kwargs):
        calls.append("build")
        raise ModelBuilt

    def cap(capacity, device, mode):
        calls.append(("cap", capacity, mode))
        return MemoryCap(device, None)

    monkeypatch.setattr(runner_module, "apply_memory_cap", cap)
    monkeypatch.setattr(build_module or runner_module, "build_model", build)
    return calls


# The TeraIO runs of tests/test_teraio_train.py: a tiny Llama3 on the CPU, and the GPU test's
# model, capacity and headroom (benchmarks/gpu_test_plan_fit.py plans the GPU test's model
# from a CPU trace with them).
MODEL = {"name": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256}
WORK = {"batch_size": 2, "micro_batch_size": 1, "seq_len": 32, "warmup_steps": 2, "measure_steps": 18}


def config(system, ssd_dir, capacity, model=None, device="cpu", options=None, workload=None, **hw):
    hardware = {"device": device, "ssd_dirs": [str(ssd_dir)], "gpu_capacity_bytes": capacity,
                "host_mem_cap_bytes": 1 << 28,
                "ssd_write_gbps": 50.0, "ssd_read_gbps": 50.0, "host_d2h_gbps": 50.0, "host_h2d_gbps": 50.0,
                **hw}
    return run_config_from_dict({"model": {**MODEL, **(model or {})}, "workload": {**WORK, **(workload or {})},
                                 "hardware": hardware,
                                 "system": {"name": system,
                                            "options": {"min_tensor_bytes": 1024, **(options or {})}}})


# Many allocator blocks, none large: a 4-layer dim-1024 model with an 8192-token vocabulary
# (largest tensor, the embedding, 32 MiB).
GPU_MODEL = {"dim": 1024, "n_layers": 4, "vocab_size": 8192}
# 50 % of the peak cannot be planned on the H200 for this model, nor for a dim-1024
# 32768-token one: the CUDA trace's plan came out 43 MB over its capacity, where a CPU trace
# fits (benchmarks/results/raw_gpu_calls/h200_b/COMMANDS.md, call 4). Likely the CUDA trace's
# allocator-measured floor (``Trace.op_allocated_bytes``: bytes that are no tensor of the
# trace), which migrations cannot lower; through AdamW's step it is mostly gradients that
# param.grad holds past their last use (``Trace.held_grad_bytes``; the release_grads case).
# 70 % leaves the plan capacity about 116 MB above that planned peak (0.7 x 0.65 x the
# run's 1,226 MB peak, less 441 MB); its H200 runs: benchmarks/results/gpu_tests_h200/.
GPU_FRACTION = 0.7
# Outside the plan at this small capacity (under a GiB): cuBLAS workspaces (64 MiB or more
# on Hopper), 64 MiB the allocator held beyond the plan and 111-129 MiB of fragmentation in
# the H200 run above, 242-248 MiB in later runs, where every case ran out of memory in
# AdamW's update (benchmarks/results/gpu_tests_h200/COMMAND.md); the engine then drops
# and spills tensors (teraio.core.engine). Real runs have GiBs of headroom at the default 8 %.
GPU_OPTIONS = {"headroom_fraction": 0.35}
