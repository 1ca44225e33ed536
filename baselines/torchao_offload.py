"""torchao's CPU-offloaded optimizer (``torchao_offload``): the shared step with the optimizer
replaced by ``torchao.optim.CPUOffloadOptimizer`` (torchao 0.18.0) wrapping AdamW: parameters
and activations on the GPU, the optimizer state and the AdamW step on the CPU. Each
parameter's gradient is copied to a page-locked host copy as soon as backward has
accumulated it (a post-accumulate-grad hook, on a side stream), the host AdamW (torchao's
default: fused CPU AdamW) steps it, and the updated weight is copied back. Parameters under
``minimal_size`` elements stay with an AdamW on the GPU. CUDA (or XPU) only: torchao refuses
any other device, and so does the sweep's up-front check (``cuda_only`` in
``teraio.systems``).

Same model (built on the device from the point's seed, as Ideal's), tokens, FP32, batch,
micro-batches and loss as every system (``teraio.workload.step.train_step``), AdamW with
the shared hyperparameters (``baselines.zero.adamw_hyperparameters``).

``system.options`` (defaults :data:`DEFAULTS`, documented in ``conf/system/torchao_offload.yaml``):
  ``ac``                   ``none``, ``full`` or ``selective`` activation checkpointing
  ``selective_ac_option``  ``op`` or ``"<n>"`` (``baselines.checkpointing``)
  ``micro_batch_size``     sequences per micro-batch, a divisor of the workload's; null is
                           the workload's
  ``offload_gradients``    free each GPU gradient once copied to the host; torchao: "not
                           compatible with gradient accumulation", so refused when the step
                           has more than one micro-batch
  ``minimal_size``         parameters of fewer elements stay on the GPU (torchao's 4096)
  ``fused``                the host AdamW's fused CPU kernel (torchao's default true)
  ``check_host_memory``    refuse the point before anything is allocated when the host state
                           (``baselines.host_memory``) exceeds the host's available memory

Row extras: ``ac_mode``, ``selective_ac_option``, ``micro_batch_size_trained``,
``host_state_bytes``, ``final_params_sha256``. Not measured: no stalls or bytes moved per step.
"""
from __future__ import annotations

from pathlib import Path

import torch

from baselines.checkpointing import (AC_MODES, apply_checkpointing, check_ac, check_bools, check_keys,
                                     check_micro_batch, measure_and_digest, micro_batch, micro_batch_divisors)
from baselines.host_memory import HOST_BYTES_PER_PARAMETER, check_host_room, offloaded_parameters
from baselines.zero import adamw_hyperparameters
from teraio.config import RunConfig
from teraio.result import Measurements, kept_on_failure
from teraio.systems.loop import Step
from teraio.systems.measure import reset_peak_memory
from teraio.systems.memory_cap import apply_memory_cap
from teraio.workload.models import build_model
from teraio.workload.step import make_batch, train_step

DEFAULTS = {"ac": "none", "selective_ac_option": "op", "micro_batch_size": None, "offload_gradients": False,
            "minimal_size": 4096, "fused": True, "check_host_memory": True}
DEVICES = ("cuda", "xpu")  # what torchao's CPUOffloadOptimizer runs on


def resolve_options(system: str, options: dict) -> dict:
    """``options`` over :data:`DEFAULTS`, checked. Raises ValueError naming a bad key or value."""
    opts = check_keys(system, options, DEFAULTS)
    check_ac(system, "ac", opts["ac"], opts["selective_ac_option"], AC_MODES)
    check_micro_batch(system, opts["micro_batch_size"])
    check_bools(opts, ("offload_gradients", "fused", "check_host_memory"))
    if not (isinstance(opts["minimal_size"], int) and not isinstance(opts["minimal_size"], bool)
            and opts["minimal_size"] >= 0):
        raise ValueError(f"system.options.minimal_size={opts['minimal_size']!r}; must be an int >= 0 (elements)")
    return opts


def check_options(system: str, options: dict) -> None:
    """``system.options`` of torchao_offload (``teraio.systems``): :func:`resolve_options`."""
    resolve_options(system, options)


def tuning_candidates(cfg: RunConfig) -> list[dict]:
    """The settings the sweep measures before a torchao_offload point's trials
    (``teraio.harness.tune``; the registry's ``SystemSpec.tuner``), as ZeRO's are: each
    micro-batch of :func:`baselines.checkpointing.micro_batch_divisors` whose activations
    are estimated to fit (they stay on the device), largest first."""
    return [{"micro_batch_size": mb} for mb in micro_batch_divisors(cfg, keep_activations=True)]


def make_offload_optimizer(model: torch.nn.Module, lr: float, opts: dict) -> torch.optim.Optimizer:
    """torchao's ``CPUOffloadOptimizer`` over ``model``'s parameters: AdamW with the shared
    hyperparameters, ``offload_gradients``, ``minimal_size`` and ``fused`` from ``opts``."""
    from torchao.optim import CPUOffloadOptimizer

    hp = adamw_hyperparameters(lr)
    return CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=opts["offload_gradients"],
                               minimal_size=opts["minimal_size"], lr=hp["lr"], betas=tuple(hp["betas"]),
                               eps=hp["eps"], weight_decay=hp["weight_decay"], fused=opts["fused"])


def run(cfg: RunConfig, job_dir: Path, device: torch.device) -> Measurements:
    """Train the point with torchao's CPU-offloaded AdamW (module doc) through the shared loop
    (``teraio.systems.loop.measure_steps``) and return the measurements (on failure, those
    made so far travel with the exception). The emulated capacity is applied before anything
    is placed on the device.

    Raises:
        ValueError: a bad option; ``offload_gradients`` with more than one micro-batch; a
            device torchao does not run on (:data:`DEVICES`).
        MemoryError: the host state exceeds the host's available memory (``check_host_memory``).
        FloatingPointError: a non-finite loss.
        torch.OutOfMemoryError: the (emulated) device ran out of memory.
    """
    opts = resolve_options(cfg.system.name, cfg.system.options)
    if device.type not in DEVICES:
        raise ValueError(f"hardware.device={device.type!r}: {cfg.system.name} (torchao's CPUOffloadOptimizer) "
                         f"runs on {' or '.join(DEVICES)} only")
    w = cfg.workload
    mb = micro_batch(cfg.system.name, opts["micro_batch_size"], w.micro_batch_size)
    if opts["offload_gradients"] and w.batch_size // mb > 1:
        raise ValueError(f"system.options.offload_gradients=true with {w.batch_size // mb} micro-batches per step: "
                         "torchao's CPUOffloadOptimizer frees each gradient after copying it, which breaks "
                         "gradient accumulation; set micro_batch_size to the batch size or offload_gradients=false")
    cap = cfg.hardware.gpu_capacity_bytes
    host_bytes = HOST_BYTES_PER_PARAMETER * offloaded_parameters(cfg, opts["minimal_size"])
    measured = Measurements(capacity_bytes=cap, capacity_emulated=True if cap is not None else None, extras={
        "ac_mode": opts["ac"], "selective_ac_option": str(opts["selective_ac_option"]),
        "micro_batch_size_trained": mb, "host_state_bytes": host_bytes})
    with kept_on_failure(measured):
        if opts["check_host_memory"]:
            check_host_room(cfg.system.name, host_bytes)
        held = apply_memory_cap(cap, device, cfg.hardware.capacity_mode)
        try:
            model = apply_checkpointing(build_model(cfg.model, w.seq_len, device, cfg.seed), opts["ac"],
                                        opts["selective_ac_option"])
            optimizer = make_offload_optimizer(model, w.lr, opts)
            reset_peak_memory(device)

            def step_fn(step: int) -> Step:
                inputs, labels = make_batch(step, w, cfg.model.vocab_size, cfg.seed, device)
                return Step(lambda: train_step(model, optimizer, inputs, labels, mb))

            measure_and_digest(step_fn, w, device, measured, model)
        finally:
            held.lift()
    return measured
