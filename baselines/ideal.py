"""Ideal: the shared training step with no memory cap and no offload (PAPER.md §3–§4,
"a GPU with infinite on-board memory"), measured on hardware wherever the model fits.

The paper does not say how its Ideal was obtained; for models that cannot fit it was
presumably modeled (PAPER.md §3). Here Ideal is always measured, on the real device,
ignoring ``hardware.gpu_capacity_bytes``.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from teraio.config import RunConfig
from teraio.measure import peak_memory, reset_peak_memory, timed
from teraio.models import build_model
from teraio.result import iteration_row, progress_line
from teraio.step import make_batch, make_optimizer, train_step

NO_BYTES = {"ssd": 0, "host": 0}


def run(cfg: RunConfig, job_dir: Path, result: dict, device: torch.device) -> None:
    """Train ``workload.warmup_steps`` untimed then ``workload.measure_steps`` timed
    iterations of the shared step, uncapped, and fill ``result`` (``teraio.result``).

    Each measured iteration is timed with the device synchronised at both ends
    (``teraio.measure.timed``); the synthetic batch is made before the timer starts.
    ``peak_allocated_bytes``/``peak_reserved_bytes`` cover the whole run (bytes; null on
    CPU). With nothing offloaded, the peak allocated is also the unoffloaded peak, and
    ``memory_pressure`` is that peak over ``hardware.gpu_capacity_bytes`` when the
    hardware names a capacity — the M the capped systems run under; ``capacity_bytes``
    stays null because Ideal itself runs uncapped.

    Raises:
        ValueError: ``system.options`` is not empty (Ideal has none).
        FloatingPointError: a non-finite loss.
        torch.OutOfMemoryError: the model does not fit the real device.
    """
    if cfg.system.options:
        raise ValueError(f"system.options={cfg.system.options!r}: ideal takes no options")
    w = cfg.workload
    model = build_model(cfg.model, w.seq_len, device, cfg.seed)
    optimizer = make_optimizer(model, w.lr)
    reset_peak_memory(device)
    losses = []
    for step in range(w.warmup_steps + w.measure_steps):
        inputs, labels = make_batch(step, w, cfg.model.vocab_size, cfg.seed, device)
        with timed(device) as t:
            loss = train_step(model, optimizer, inputs, labels, w.micro_batch_size)
        if not math.isfinite(loss):
            raise FloatingPointError(f"step {step}: loss {loss}")
        losses.append(loss)
        print(progress_line(step, t["seconds"], w.tokens_per_step, loss, step < w.warmup_steps), flush=True)
        if step >= w.warmup_steps:
            result["iterations"].append(iteration_row(
                step, t["seconds"], w.tokens_per_step, loss, stall_count=0, stall_seconds=0.0,
                migration_seconds=0.0, bytes_offloaded=NO_BYTES, bytes_prefetched=NO_BYTES))
    peak, reserved = peak_memory(device)
    capacity = cfg.hardware.gpu_capacity_bytes
    result.update(peak_allocated_bytes=peak, peak_reserved_bytes=reserved, capacity_bytes=None,
                  unoffloaded_peak_bytes=peak,
                  memory_pressure=peak / capacity if peak is not None and capacity else None,
                  losses=losses)
