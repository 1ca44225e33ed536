"""Measurement helpers every system shares: device sync, peak memory, the caching
allocator's counters, and the facts (versions, GPU name) that go into a result row."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
import socket
import sys
import time
from contextlib import contextmanager

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(peak allocated, peak reserved) in bytes since the last reset; (None, None) on CPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


ALLOCATOR_EVENTS = {"alloc_retries": "num_alloc_retries", "sync_all_streams": "num_sync_all_streams",
                    "device_allocs": "num_device_alloc", "device_frees": "num_device_free"}
"""The caching allocator's counters (``torch.cuda.memory_stats`` keys) an iteration row reports
as ``allocator``, by the row's name for each: ``alloc_retries`` (allocations that failed, made
the allocator release its unused memory, which waits for the device, and tried again),
``sync_all_streams`` (those waits, and those of every ``torch.cuda.empty_cache``, which
TeraIO's engine and pager call after an out-of-memory error), ``device_allocs`` and
``device_frees`` (cudaMalloc/cudaFree calls, or with expandable segments the maps and unmaps
of their pages)."""


def allocator_events(device: torch.device) -> dict[str, int] | None:
    """The counters of :data:`ALLOCATOR_EVENTS` since the process started, by row name; None
    on a CPU device."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats[key]) for name, key in ALLOCATOR_EVENTS.items()}


def peak_host_rss_bytes() -> int | None:
    """Peak resident set size of this process since it started, in bytes (Linux
    ``getrusage(RUSAGE_SELF).ru_maxrss``, which the kernel gives in KiB); None on another OS.
    It counts every page the process has touched: page-locked (pinned) buffers, host-side
    model and optimizer state, and the Python runtime with its libraries."""
    if not sys.platform.startswith("linux"):
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextmanager
def timed(device: torch.device):
    """Wall-clock seconds of the block, with the device synchronised at both ends.
    Yields a dict whose ``"seconds"`` is set on exit."""
    out: dict = {}
    synchronize(device)
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        synchronize(device)
        out["seconds"] = time.perf_counter() - t0


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def allocator_conf() -> str | None:
    """The caching allocator's settings this process runs with: ``PYTORCH_ALLOC_CONF`` where
    set (PyTorch reads it first), else ``PYTORCH_CUDA_ALLOC_CONF``; None where neither is set
    (PyTorch's defaults)."""
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


def environment_facts(device: torch.device) -> dict:
    """Versions, host, GPU name and the caching allocator's settings (:func:`allocator_conf`)
    for a result row. No GPU name and no allocator settings where this process sees no GPU (a
    modeled row, made on any machine, for a CUDA point)."""
    on_gpu = device.type == "cuda" and torch.cuda.is_available()
    return {
        "gpu_name": torch.cuda.get_device_name(device) if on_gpu else None,
        "allocator_conf": allocator_conf() if on_gpu else None,
        "host": socket.gethostname(),
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            **{d: _version(d) for d in ("torchtitan", "deepspeed", "kvikio-cu13", "kvikio-cu12",
                                        "hydra-core", "pandas", "seaborn")},
        },
    }


def param_digest(model: torch.nn.Module) -> str:
    """SHA-256 over the bytes of every parameter, in ``named_parameters`` order: equal digests
    mean bit-identical weights (used to check that offloading changed no bit of training)."""
    import hashlib

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
