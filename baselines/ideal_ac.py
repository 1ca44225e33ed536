"""Ideal with activation checkpointing (``ideal_ac``): the shared training step
(``teraio.workload.step``: model, tokens, FP32, AdamW, batch and micro-batches) with
torchtitan's activation checkpointing applied to the blocks (``baselines.checkpointing``),
nothing offloaded, under the point's capacity where the point has one. What a user whose
model does not fit switches on first: recompute in backward instead of keeping activations.

``system.options`` (defaults :data:`DEFAULTS`, documented in ``conf/system/ideal_ac.yaml``):
  ``mode``                 ``full`` (every block recomputed) or ``selective`` (torchtitan's)
  ``selective_ac_option``  ``op`` (per-op policy) or ``"<n>"`` (every n-th block)
  ``micro_batch_size``     sequences per micro-batch, a divisor of the workload's; null is
                           the workload's (the row's ``micro_batch_size_trained``)
  ``profile_saved_activations``  profile the last warm-up step (needs ``workload.warmup_steps``
                           >= 2) for the row's ``saved_activation_peak_bytes``; the
                           allocator's peaks then cover the steps after it

Row extras: ``ac_mode``, ``selective_ac_option``, ``micro_batch_size_trained``,
``saved_activation_peak_bytes`` (null when not profiled), ``final_params_sha256``;
``capacity_enforced: false`` where a cap was asked for on a device that is not CUDA
(``teraio.systems.memory_cap.capacity_unenforced``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from baselines.checkpointing import (apply_checkpointing, check_ac, check_bools, check_keys, check_micro_batch,
                                     measure_and_digest, micro_batch, micro_batch_divisors,
                                     saved_activation_peak_bytes)
from baselines.ideal import NO_MIGRATION
from teraio.config import RunConfig
from teraio.result import Measurements, kept_on_failure
from teraio.systems.loop import Step
from teraio.systems.measure import reset_peak_memory
from teraio.systems.memory_cap import apply_memory_cap, capacity_unenforced
from teraio.workload.models import build_model
from teraio.workload.step import make_batch, make_optimizer, train_step

DEFAULTS = {"mode": "full", "selective_ac_option": "op", "micro_batch_size": None,
            "profile_saved_activations": True}


def resolve_options(system: str, options: dict) -> dict:
    """``options`` over :data:`DEFAULTS`, checked. Raises ValueError naming a bad key or value."""
    opts = check_keys(system, options, DEFAULTS)
    check_ac(system, "mode", opts["mode"], opts["selective_ac_option"], modes=("full", "selective"))
    check_micro_batch(system, opts["micro_batch_size"])
    check_bools(opts, ("profile_saved_activations",))
    return opts


def check_options(system: str, options: dict) -> None:
    """``system.options`` of ideal_ac (``teraio.systems``): :func:`resolve_options`."""
    resolve_options(system, options)


TUNED_MICRO_BATCHES = 2
"""How many of the largest micro-batches :func:`tuning_candidates` tries, in each mode."""


def tuning_candidates(cfg: RunConfig) -> list[dict]:
    """The settings the sweep measures before an ideal_ac point's trials (``teraio.harness.tune``;
    the registry's ``SystemSpec.tuner``): the :data:`TUNED_MICRO_BATCHES` largest divisors of the
    workload's micro-batch (checkpointed blocks keep little for backward, so no estimate rules
    one out), largest first, each with torchtitan's selective (per-op) checkpointing, which
    recomputes less, then full."""
    return [{"mode": mode, "micro_batch_size": mb}
            for mb in micro_batch_divisors(cfg, keep_activations=False)[:TUNED_MICRO_BATCHES]
            for mode in ("selective", "full")]


def profiled_step(workload) -> int | None:
    """The warm-up step profiled for the saved-activation peak: the last one, if it is not the
    first (the optimizer state must exist); None with fewer than 2 warm-up steps."""
    return workload.warmup_steps - 1 if workload.warmup_steps >= 2 else None


def run(cfg: RunConfig, job_dir: Path, device: torch.device) -> Measurements:
    """Train ``workload.warmup_steps`` untimed then ``workload.measure_steps`` timed iterations
    of the shared step with the blocks checkpointed, through the shared loop
    (``teraio.systems.loop.measure_steps``), and return the measurements (on failure, those
    made so far travel with the exception).

    The model is built as Ideal builds it (same initial weights), then wrapped; the emulated
    capacity (``hardware.gpu_capacity_bytes``) is applied before it is placed on the device.

    Raises:
        ValueError: a bad option or micro-batch.
        FloatingPointError: a non-finite loss.
        torch.OutOfMemoryError: the (emulated) device ran out of memory.
    """
    opts = resolve_options(cfg.system.name, cfg.system.options)
    w = cfg.workload
    mb = micro_batch(cfg.system.name, opts["micro_batch_size"], w.micro_batch_size)
    cap = cfg.hardware.gpu_capacity_bytes
    measured = Measurements(capacity_bytes=cap, capacity_emulated=True if cap is not None else None, extras={
        "ac_mode": opts["mode"], "selective_ac_option": str(opts["selective_ac_option"]),
        "micro_batch_size_trained": mb, "saved_activation_peak_bytes": None})
    if capacity_unenforced(cap, device):
        measured.extras["capacity_enforced"] = False
    profiled = profiled_step(w) if opts["profile_saved_activations"] else None
    with kept_on_failure(measured):
        held = apply_memory_cap(cap, device, cfg.hardware.capacity_mode)
        try:
            model = apply_checkpointing(build_model(cfg.model, w.seq_len, device, cfg.seed), opts["mode"],
                                        opts["selective_ac_option"])
            optimizer = make_optimizer(model, w.lr)
            reset_peak_memory(device)

            def step_fn(step: int) -> Step:
                inputs, labels = make_batch(step, w, cfg.model.vocab_size, cfg.seed, device)

                def one() -> float:
                    return train_step(model, optimizer, inputs, labels, mb)

                if step != profiled:
                    if profiled is not None and step == profiled + 1:
                        reset_peak_memory(device)  # the profiler reset the peaks per op
                    return Step(one, lambda: NO_MIGRATION)

                def profile() -> float:
                    loss, measured.extras["saved_activation_peak_bytes"] = saved_activation_peak_bytes(
                        one, model, optimizer, device)
                    return loss
                return Step(profile, lambda: NO_MIGRATION)

            measure_and_digest(step_fn, w, device, measured, model)
        finally:
            held.lift()
    return measured
