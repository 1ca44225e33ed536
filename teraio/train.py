"""TeraIO as a training system (``teraio_ssd`` and ``teraio_mixed``): profile → plan →
migrate around the shared training step (paper §3, Fig. 4).

Iteration schedule (the step index selects the data, so every system sees the same
tokens at the same step):

* step 0: an ordinary step, so the optimizer state exists before profiling;
* step 1: the profiled step (``teraio.profiler``), un-offloaded and uncapped — the
  emulated-capacity setup lets the profile run on the real, larger GPU (PAPER.md §2.1
  profiles models that do not fit by offloading everything inactive; we do not need to);
* then the plan is compiled, the engine primed, the capacity cap applied, and steps
  ``2 .. warmup_steps-1`` warm the engine up; steps ``warmup_steps ..`` are measured.

``system.options`` (all optional):
  ``benefit``            ``"pressure"`` (default) or ``"formula"`` (``teraio.planner``)
  ``min_tensor_bytes``   smallest tensor considered for offloading, bytes (default 1 MiB)
  ``headroom_fraction``  fraction of the capacity kept out of the plan for allocator
                         rounding, fragmentation and workspaces (default 0.0 on CPU, 0.08 on CUDA)
  ``io_threads``         SSD tier I/O threads (default 4)
  ``allow_stalls``       when bandwidth cannot hide enough migrations, still bring the peak
                         under capacity with migrations the engine stalls for (paper §3.2:
                         the runtime stalls kernels until memory is freed); default true
  ``device_waits``       host-tier transfers on a CUDA device ordered on the compute stream
                         (CUDA events) instead of blocking the training thread
                         (``teraio.engine``); default false, as every committed GPU row ran
  ``release_grads``      free each gradient right after its last use in the optimizer step
                         and plan for it (``Trace.with_released_grads``, ``teraio.engine``);
                         default false, as every committed GPU row ran
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import time
from pathlib import Path

import torch

from teraio.config import RunConfig, dataclass_from_dict
from teraio.engine import MigrationEngine
from teraio.measure import (apply_memory_cap, lift_memory_cap, param_digest, peak_memory, reset_peak_memory,
                            synchronize, timed)
from teraio.models import build_model
from teraio.planner import TierBandwidth, plan_migrations
from teraio.profiler import persistent_tensors, profile_step
from teraio.result import iteration_row, progress_line
from teraio.step import make_batch, make_optimizer, train_step
from teraio.storage import HostTier, SSDTier

TERAIO_SYSTEMS = ("teraio_ssd", "teraio_mixed")


@dataclasses.dataclass
class TeraIOOptions:
    benefit: str = "pressure"
    min_tensor_bytes: int = 1 << 20
    headroom_fraction: float | None = None
    io_threads: int = 4
    allow_stalls: bool = True
    device_waits: bool = False
    release_grads: bool = False


def tier_bandwidth(cfg: RunConfig) -> TierBandwidth:
    """Planner bandwidths (GB/s): the SSD tier aggregates its drives (one dir per drive)."""
    hw = cfg.hardware
    n = len(hw.ssd_dirs)
    return TierBandwidth(ssd_write_gbps=hw.ssd_write_gbps * n, ssd_read_gbps=hw.ssd_read_gbps * n,
                         host_d2h_gbps=hw.host_d2h_gbps, host_h2d_gbps=hw.host_h2d_gbps)


def open_tiers(plan, cfg: RunConfig, device: torch.device, io_threads: int = 4) -> dict:
    """The tiers the plan uses, with one slot per migrated tensor. The SSD tier puts one
    uniquely named file in each drive's directory, so concurrent runs never collide, and
    refuses a missing, unwritable or too small directory, naming it and the bytes needed.
    """
    slots: dict[str, dict[str, int]] = {"ssd": {}, "host": {}}
    for m in plan.migrations:
        slots[m.tier][m.name] = m.nbytes
    tiers = {}
    if slots["ssd"]:
        tiers["ssd"] = SSDTier(list(cfg.hardware.ssd_dirs), slots["ssd"], threads=io_threads)
    if slots["host"]:
        tiers["host"] = HostTier(cfg.hardware.host_mem_cap_bytes, slots["host"], device)
    return tiers


@contextlib.contextmanager
def compute_stream(device: torch.device):
    """Run the step on a non-blocking CUDA stream: kvikio's compat-mode copies run on its
    own streams, and on the legacy default stream every one of them would serialize with
    the training kernels."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.stream(torch.cuda.Stream(device)):
        yield


def run(cfg: RunConfig, job_dir: Path, result: dict, device: torch.device) -> None:
    """Train ``cfg`` under TeraIO and fill ``result`` (schema: ``teraio.result``).

    Side files in ``job_dir``: ``trace.json``, ``plan.json``, ``oplog.csv`` (per op of each
    measured step: start time and stall, seconds), ``transfers.csv`` (one row per transfer).

    Raises:
        ValueError: bad options, or an SSD directory that is missing/unwritable/too small.
        torch.OutOfMemoryError: the emulated capacity was exceeded.
    """
    if cfg.system.name not in TERAIO_SYSTEMS:
        raise ValueError(f"system.name={cfg.system.name!r} is not a TeraIO system {TERAIO_SYSTEMS}")
    opts = dataclass_from_dict(TeraIOOptions, cfg.system.options, "system.options (TeraIO)")
    w = cfg.workload
    if w.warmup_steps < 2:
        raise ValueError(f"workload.warmup_steps={w.warmup_steps}: TeraIO needs >= 2 "
                         "(one ordinary step to create the optimizer state, one profiled step)")
    job_dir = Path(job_dir)
    model = build_model(cfg.model, w.seq_len, device, cfg.seed)
    optimizer = make_optimizer(model, w.lr)

    def step_fn(step: int):
        inputs, labels = make_batch(step, w, cfg.model.vocab_size, cfg.seed, device)
        return lambda: train_step(model, optimizer, inputs, labels, w.micro_batch_size)

    losses = [step_fn(0)()]
    t0 = time.perf_counter()
    loss, trace = profile_step(step_fn(1), model, optimizer, device,
                               meta=cfg.point())
    losses.append(loss)
    result["profile_seconds"] = time.perf_counter() - t0
    trace.save(job_dir / "trace.json")

    unoffloaded_peak = trace.peak_bytes()  # M's numerator: the plain step's, for every option
    if opts.release_grads:
        trace = trace.with_released_grads()
    capacity = cfg.hardware.gpu_capacity_bytes
    headroom = opts.headroom_fraction if opts.headroom_fraction is not None else (
        0.08 if device.type == "cuda" else 0.0)
    plan_capacity = int((capacity if capacity is not None else unoffloaded_peak) * (1 - headroom))
    host_cap = cfg.hardware.host_mem_cap_bytes if cfg.system.name == "teraio_mixed" else 0
    t0 = time.perf_counter()
    plan = plan_migrations(trace, plan_capacity, tier_bandwidth(cfg), host_cap_bytes=host_cap,
                           benefit=opts.benefit, min_tensor_bytes=opts.min_tensor_bytes,
                           allow_stalls=opts.allow_stalls)
    result["plan_compile_seconds"] = time.perf_counter() - t0
    plan.save(job_dir / "plan.json")
    result.update(unoffloaded_peak_bytes=unoffloaded_peak, capacity_bytes=capacity,
                  memory_pressure=unoffloaded_peak / capacity if capacity else None)
    result["plan"] = {"capacity_bytes": plan_capacity, "predicted_peak_bytes": plan.predicted_peak_bytes,
                      "shortfall_bytes": plan.shortfall_bytes, "migrations": len(plan.migrations),
                      "bytes_per_tier": plan.bytes_per_tier()}
    result["artifacts"].update(trace="trace.json", plan="plan.json")

    tiers = open_tiers(plan, cfg, device, opts.io_threads)
    result["kvikio_mode"] = tiers["ssd"].mode if "ssd" in tiers else None
    engine = MigrationEngine(trace, plan, persistent_tensors(model, optimizer), tiers, device,
                             device_waits=opts.device_waits, release_grads=opts.release_grads)
    try:
        engine.prime()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        apply_memory_cap(capacity, device)
        reset_peak_memory(device)
        with compute_stream(device):
            for step in range(2, w.warmup_steps + w.measure_steps):
                with timed(device) as t:
                    loss = engine.run_step(step_fn(step), step)
                losses.append(loss)
                s = engine.stats
                print(progress_line(step, t["seconds"], w.tokens_per_step, loss, step < w.warmup_steps,
                                    f" stalls {s.stall_count}"), flush=True)
                if step >= w.warmup_steps:
                    result["iterations"].append(iteration_row(
                        step, t["seconds"], w.tokens_per_step, loss, stall_count=s.stall_count,
                        stall_seconds=s.stall_seconds, migration_seconds=s.migration_seconds,
                        bytes_offloaded=s.bytes_offloaded, bytes_prefetched=s.bytes_prefetched,
                        urgent_count=s.urgent_count, max_accounted_bytes=s.max_accounted_bytes))
        synchronize(device)
        result["peak_allocated_bytes"], result["peak_reserved_bytes"] = peak_memory(device)
    finally:
        lift_memory_cap(device)
        # Only the parameters are read after training (their digest); reading back the
        # optimizer state too would add minutes from an SSD tier.
        engine.close(restore=lambda name: name.startswith("param:"))
    result["losses"] = losses
    result["final_params_sha256"] = param_digest(model)
    _write_logs(engine, trace, job_dir, first_step=w.warmup_steps)
    result["artifacts"].update(oplog="oplog.csv", transfers="transfers.csv")


def _write_logs(engine: MigrationEngine, trace, job_dir: Path, first_step: int) -> None:
    with open(job_dir / "oplog.csv", "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["step", "op", "op_name", "t_start_s", "seconds", "stall_s"])
        for row in engine.oplog:
            if row["step"] < first_step:
                continue
            t = row["t_start_s"]
            dur = list(t[1:] - t[:-1]) + [float("nan")]
            for k in range(trace.n_ops):
                wr.writerow([row["step"], k, trace.op_names[k], f"{t[k]:.9f}", f"{dur[k]:.9f}",
                             f"{row['stall_s'][k]:.9f}"])
    cols = ["step", "tensor", "tier", "direction", "nbytes", "op_issued", "op_done", "t_issued_s", "t_done_s"]
    with open(job_dir / "transfers.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=cols)
        wr.writeheader()
        for r in engine.transfers:
            if r["step"] >= first_step:
                wr.writerow(r)
