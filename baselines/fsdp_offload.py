"""FSDP2 with CPU offload (``fsdp_offload``): PyTorch's ``fully_shard`` with
``CPUOffloadPolicy(pin_memory=True)`` (what torchtitan's ``training.enable_cpu_offload``
switches on), on one GPU or data-parallel over ``hardware.n_gpus`` ranks (``torchrun``).

Each transformer block is its own FSDP unit, then the token embedding and the final norm with
the output layer (apart unless the model ties them), then the root: torchtitan 0.2.2's
``apply_fsdp`` order. The sharded parameters, their gradients and AdamW's state live in
page-locked host memory; FSDP2 copies a unit's parameters to the GPU for its forward and
backward and its reduced gradients back, and the optimizer (the shared
``teraio.workload.step.make_optimizer``: AdamW, FP32) steps on the CPU, as FSDP2 does it.
Optional activation checkpointing of the blocks: torchtitan's (``baselines.checkpointing``),
applied before sharding as torchtitan does.

Same model, tokens, FP32, batch and loss as every system: the model is built on the host
from the point's seed (the weights Ideal draws on a CPU; on a GPU Ideal draws them there, a
different draw of the same distribution, as ZeRO stage 3's), each rank trains its contiguous
share of the global batch in micro-batches, and the loss is the mean over micro-batches and
ranks. FSDP2 averages gradients over ranks.

``system.options`` (defaults :data:`DEFAULTS`, documented in ``conf/system/fsdp_offload.yaml``):
  ``ac``                   ``none``, ``full`` or ``selective`` activation checkpointing
  ``selective_ac_option``  ``op`` or ``"<n>"`` (``baselines.checkpointing``)
  ``micro_batch_size``     sequences per micro-batch, a divisor of the workload's; null is
                           the workload's
  ``pin_memory``           page-locked host state (``CPUOffloadPolicy(pin_memory=...)``)
  ``reshard_after_forward``  free a unit's gathered parameters after its forward (FSDP2's
                           default true; false keeps them until backward)
  ``check_host_memory``    refuse the point before anything is allocated when the host state
                           (``baselines.host_memory``) exceeds the host's available memory

Row extras: ``ac_mode``, ``selective_ac_option``, ``micro_batch_size_trained``,
``host_state_bytes`` (the offloaded state: 16 B per parameter), ``final_params_sha256``;
``capacity_enforced: false`` where a cap was asked for on a device that is not CUDA
(``teraio.systems.memory_cap.capacity_unenforced``).
Not measured: FSDP2 exposes no stalls or bytes moved per step (null in every iteration).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from baselines.checkpointing import (AC_MODES, apply_checkpointing, check_ac, check_bools, check_keys,
                                     check_micro_batch, measure_and_digest, micro_batch)
from baselines.host_memory import HOST_BYTES_PER_PARAMETER, check_host_room, offloaded_parameters
from baselines.process_group import init_process_group, mean_over_ranks, rank_rows
from teraio.config import RunConfig
from teraio.result import Measurements, kept_on_failure
from teraio.systems.loop import Step
from teraio.systems.measure import reset_peak_memory
from teraio.systems.memory_cap import apply_memory_cap, capacity_unenforced
from teraio.workload.models import build_model
from teraio.workload.step import make_batch, make_optimizer, train_step

DEFAULTS = {"ac": "none", "selective_ac_option": "op", "micro_batch_size": None, "pin_memory": True,
            "reshard_after_forward": True, "check_host_memory": True}


def resolve_options(system: str, options: dict) -> dict:
    """``options`` over :data:`DEFAULTS`, checked. Raises ValueError naming a bad key or value."""
    opts = check_keys(system, options, DEFAULTS)
    check_ac(system, "ac", opts["ac"], opts["selective_ac_option"], AC_MODES)
    check_micro_batch(system, opts["micro_batch_size"])
    check_bools(opts, ("pin_memory", "reshard_after_forward", "check_host_memory"))
    return opts


def check_options(system: str, options: dict) -> None:
    """``system.options`` of fsdp_offload (``teraio.systems``): :func:`resolve_options`."""
    resolve_options(system, options)


def shard(model: torch.nn.Module, mesh, pin_memory: bool, reshard_after_forward: bool) -> torch.nn.Module:
    """``fully_shard`` ``model`` in torchtitan 0.2.2's ``apply_fsdp`` units (each block; the
    token embedding; the final norm with the output layer; the root), every unit with
    ``CPUOffloadPolicy(pin_memory=pin_memory)``, FP32 parameters and reductions. A model
    whose output layer is its token embedding (tied) keeps both in the root unit."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory),
          "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)}
    tied = model.output.weight is model.tok_embeddings.weight
    if not tied:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **kw)
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    if not tied:  # torchtitan: the last units are not resharded (backward needs them at once)
        fully_shard([model.norm, model.output], reshard_after_forward=False, **kw)
    return fully_shard(model, **kw)


def run(cfg: RunConfig, job_dir: Path, device: torch.device) -> Measurements:
    """Train the point with FSDP2's CPU offload (module doc) through the shared loop
    (``teraio.systems.loop.measure_steps``) and return the measurements (on failure, those
    made so far travel with the exception). The emulated capacity
    (``hardware.gpu_capacity_bytes``) is applied before anything is placed on the device.

    Raises:
        ValueError: a bad option, or a batch that does not split over micro-batches and ranks.
        MemoryError: the host state exceeds the host's available memory (``check_host_memory``).
        FloatingPointError: a non-finite loss.
        torch.OutOfMemoryError: the (emulated) device ran out of memory.
    """
    opts = resolve_options(cfg.system.name, cfg.system.options)
    w = cfg.workload
    world = int(os.environ.get("WORLD_SIZE", 1))
    mb = micro_batch(cfg.system.name, opts["micro_batch_size"], w.micro_batch_size)
    if w.batch_size % (mb * world):
        raise ValueError(f"workload.batch_size={w.batch_size} is not a multiple of micro_batch_size x ranks = "
                         f"{mb} x {world} ({cfg.system.name})")
    cap = cfg.hardware.gpu_capacity_bytes
    host_bytes = HOST_BYTES_PER_PARAMETER * offloaded_parameters(cfg)
    measured = Measurements(capacity_bytes=cap, capacity_emulated=True if cap is not None else None, extras={
        "ac_mode": opts["ac"], "selective_ac_option": str(opts["selective_ac_option"]),
        "micro_batch_size_trained": mb, "host_state_bytes": host_bytes})
    if capacity_unenforced(cap, device):
        measured.extras["capacity_enforced"] = False
    with kept_on_failure(measured):
        if opts["check_host_memory"]:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            check_host_room(cfg.system.name, host_bytes * local // world, local)
        # On CUDA both backends: the offloaded shards live on the host, and gathering them whole
        # (the row's parameter digest) is a CPU collective.
        own_group = init_process_group(device, "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                                       set_device=True)
        held = apply_memory_cap(cap, device, cfg.hardware.capacity_mode)
        try:
            _train(cfg, opts, device, world, mb, measured)
        finally:
            held.lift()
            if own_group:
                dist.destroy_process_group()
    return measured


def _train(cfg: RunConfig, opts: dict, device: torch.device, world: int, mb: int, measured: Measurements) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    w = cfg.workload
    mesh = init_device_mesh(device.type, (world,))
    model = build_model(cfg.model, w.seq_len, "cpu", cfg.seed)
    for module in model.modules():  # the buffers (RoPE table) live on the device
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, buf.to(device))
    apply_checkpointing(model, opts["ac"], opts["selective_ac_option"])
    shard(model, mesh, opts["pin_memory"] and device.type == "cuda", opts["reshard_after_forward"])
    optimizer = make_optimizer(model, w.lr)
    rows = rank_rows(w.batch_size, world)
    reset_peak_memory(device)

    def step_fn(step: int) -> Step:
        inputs, labels = make_batch(step, w, cfg.model.vocab_size, cfg.seed, device)
        inputs, labels = inputs[rows], labels[rows]

        def one() -> float:
            loss = train_step(model, optimizer, inputs, labels, mb)
            return loss if world == 1 else mean_over_ranks(torch.tensor(loss, device=device), world)

        return Step(one)

    measure_and_digest(step_fn, w, device, measured, model, progress=dist.get_rank() == 0)
