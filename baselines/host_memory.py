"""The host memory a CPU-offloading baseline needs, checked before anything is allocated.

FSDP2's CPU offload and torchao's ``CPUOffloadOptimizer`` keep, per parameter, its FP32
weight, its FP32 gradient and AdamW's two FP32 moments in host memory
(:data:`HOST_BYTES_PER_PARAMETER`, page-locked where pinned). Where that exceeds what the
machine has available the process would be killed by the kernel's OOM killer mid-run (no
row, a lost machine); :func:`check_host_room` refuses the point in one line naming the
bytes instead, before the model is built (the row is an ``error``).
"""
from __future__ import annotations

from teraio.config import RunConfig
from teraio.workload.models import STATE_BYTES_PER_PARAMETER, build_meta_model

HOST_BYTES_PER_PARAMETER = STATE_BYTES_PER_PARAMETER
"""Host bytes per offloaded parameter: FP32 weight, gradient and AdamW's exp_avg, exp_avg_sq."""

PROCESS_HEADROOM_BYTES = 8 * 10**9
"""Host bytes the worker needs beside the offloaded state (Python, torch and CUDA libraries,
the CUDA context, the batch, one parameter in flight while it is sharded or pinned): the
check refuses a point whose state leaves less than this of the available memory."""


def offloaded_parameters(cfg: RunConfig, minimal_numel: int = 0) -> int:
    """Distinct parameters (tied ones once) of ``cfg``'s model with at least ``minimal_numel``
    elements each, counted on the meta device."""
    model = build_meta_model(cfg.model, cfg.workload.seq_len)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.numel() >= minimal_numel)


def host_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (bytes): what the kernel can give without
    swapping; None where there is no such file (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_room(system: str, need_bytes: int, ranks_on_host: int = 1,
                    available_bytes: int | None = None) -> None:
    """Refuse a run whose host state (``need_bytes`` over all ranks on this host) plus
    :data:`PROCESS_HEADROOM_BYTES` per rank exceeds the host memory available now
    (``available_bytes``, default :func:`host_available_bytes`; no check where it is unknown).

    Raises:
        MemoryError: naming the bytes needed and available (the row is an ``error``).
    """
    available = host_available_bytes() if available_bytes is None else available_bytes
    if available is not None and need_bytes + ranks_on_host * PROCESS_HEADROOM_BYTES > available:
        raise MemoryError(
            f"{system} needs {need_bytes / 1e9:.1f} GB of host memory for its offloaded state "
            f"({HOST_BYTES_PER_PARAMETER} B per parameter: FP32 weight, gradient and two AdamW moments"
            + (f", {ranks_on_host} ranks" if ranks_on_host > 1 else "")
            + f", plus {ranks_on_host * PROCESS_HEADROOM_BYTES / 1e9:.0f} GB for the process), more than the "
            f"{available / 1e9:.1f} GB this host has available: refused before anything was allocated")
