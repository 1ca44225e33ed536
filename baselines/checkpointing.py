"""What the systems users switch on today share: torchtitan's activation checkpointing of the
blocks, their ``ac``/``micro_batch_size`` options, and the measured peak of saved activations.

Activation checkpointing is torchtitan 0.2.2's own (``torchtitan.distributed.activation_checkpoint
.apply_ac``, as ``torchtitan.models.llama3.infra.parallelize`` applies it, with that module's
per-op save list): each transformer block is wrapped in PyTorch's non-reentrant
``checkpoint_wrapper``; ``full`` recomputes the whole block in backward; ``selective`` is
torchtitan's selective checkpointing, per op (``selective_ac_option: op``: the block's matmul
and attention outputs are saved, every second matmul and the rest recomputed) or every n-th
block (``selective_ac_option: "<n>"``). Recomputation runs the same ops on the same inputs, so a
checkpointed step's losses and parameters equal the unchecked step's bit for bit where the
kernels are deterministic (the CPU; ``tests/test_users_baselines.py``).

The saved-activation peak (:func:`saved_activation_peak_bytes`) is measured by TeraIO's own
tensor-lifetime profiler (``teraio.core.profiler``) on one whole step: the largest sum, over the
step's ops, of the tensors made outside backward and read by it (kind ``activation``). It is
device-independent (CPU rows have it where they have no allocator peak).

Tuning hook: the knobs a per-point tuner of the baselines sets are plain ``system.options``,
the same key in all three systems: ``micro_batch_size`` (a divisor of the workload's; the
experiments set ZeRO's rule, ``teraio.harness.compose.zero_micro_batch``, through
``sweep.system_options``) and the checkpointing mode (``mode`` in ``ideal_ac``, ``ac`` in
``fsdp_offload`` and ``torchao_offload``); each row records what ran
(``micro_batch_size_trained``, ``ac_mode``).
"""
from __future__ import annotations

import torch
from torch import nn

from teraio.config import RunConfig, WorkloadConfig
from teraio.core.profiler import profile_step
from teraio.result import Measurements
from teraio.systems.loop import Steps, measure_steps
from teraio.systems.measure import peak_memory

AC_MODES = ("none", "full", "selective")


def micro_batch_divisors(cfg: RunConfig, keep_activations: bool) -> list[int]:
    """The micro-batches a user's baseline is tuned over at ``cfg``'s point, largest first: the
    divisors of the workload's micro-batch (so the step's tokens stay the point's); where
    ``keep_activations`` (nothing checkpointed: a micro-batch's activations, attention
    probabilities and logits stay on the device, ``teraio.workload.models.micro_batch_bytes``)
    only those whose estimate fits ``hardware.gpu_capacity_bytes`` (all without a cap), 1 where
    none does (its failure is then measured and recorded)."""
    from teraio.workload.models import build_meta_model, ffn_hidden, micro_batch_bytes

    w, cap = cfg.workload, cfg.hardware.gpu_capacity_bytes
    divisors = [d for d in range(w.micro_batch_size, 0, -1) if w.micro_batch_size % d == 0]
    if not keep_activations or cap is None:
        return divisors
    ffn = ffn_hidden(build_meta_model(cfg.model, w.seq_len))
    return [d for d in divisors if micro_batch_bytes(cfg.model, ffn, d, w.seq_len, cfg.model.n_layers) <= cap] or [1]


def check_ac(system: str, key: str, mode, selective_ac_option, modes: tuple[str, ...] = AC_MODES) -> None:
    """Refuse an ``ac`` mode outside ``modes`` or a ``selective_ac_option`` other than ``"op"`` or
    a positive int (torchtitan's two selective kinds). Raises ValueError naming the value."""
    if mode not in modes:
        raise ValueError(f"system.options.{key}={mode!r}; {system} takes one of {list(modes)}")
    option = str(selective_ac_option)
    if option != "op" and not (option.isdigit() and int(option) > 0):
        raise ValueError(f"system.options.selective_ac_option={selective_ac_option!r}; valid: 'op' (per-op "
                         "selective checkpointing) or a positive int n (checkpoint every n-th block)")


def check_micro_batch(system: str, mb) -> None:
    """``micro_batch_size``: a positive int or null. Raises ValueError naming the value."""
    if mb is not None and not (isinstance(mb, int) and not isinstance(mb, bool) and mb > 0):
        raise ValueError(f"system.options.micro_batch_size={mb!r}; {system} takes a positive int or null "
                         "(the workload's)")


def check_bools(opts: dict, keys) -> None:
    """Each of ``keys`` of ``opts`` is a bool. Raises ValueError naming the first that is not."""
    for key in keys:
        if not isinstance(opts[key], bool):
            raise ValueError(f"system.options.{key}={opts[key]!r}; must be true or false")


def check_keys(system: str, options: dict, defaults: dict) -> dict:
    """``options`` over ``defaults``; raises ValueError naming an unknown key and the valid ones."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"system.options: unknown key(s) {unknown} for {system}; valid: {sorted(defaults)}")
    return {**defaults, **dict(options)}


def micro_batch(system: str, option: int | None, workload_micro_batch: int) -> int:
    """The micro-batch a system trains with: ``option`` (a divisor of the workload's micro-batch,
    so the global batch and its tokens stay the point's) or the workload's.

    Raises:
        ValueError: ``option`` does not divide the workload's micro-batch.
    """
    mb = option or workload_micro_batch
    if workload_micro_batch % mb:
        raise ValueError(f"system.options.micro_batch_size={mb} does not divide workload.micro_batch_size="
                         f"{workload_micro_batch} ({system})")
    return mb


def apply_checkpointing(model: nn.Module, mode: str, selective_ac_option: str | int = "op") -> nn.Module:
    """Wrap ``model``'s blocks (``model.layers``) in place with torchtitan's activation
    checkpointing (``mode`` ``full`` or ``selective``; ``none`` leaves it as is) and return it.

    torchtitan counts blocks for every-n-th-block selective checkpointing in a module global
    (``_layer_sac_count``) that grows over calls; it is reset here so that the same blocks are
    checkpointed in every model built in one process.
    """
    if mode == "none":
        return model
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed import activation_checkpoint
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    activation_checkpoint._layer_sac_count = 0
    activation_checkpoint.apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=str(selective_ac_option)),
                                   op_sac_save_list=_op_sac_save_list)
    return model


def saved_activation_peak_bytes(step_fn, model: nn.Module, optimizer: torch.optim.Optimizer,
                                device: torch.device) -> tuple[float, int]:
    """Run ``step_fn`` (one whole training step, after at least one step so that the optimizer
    state exists) under TeraIO's lifetime profiler and return (its loss, the peak bytes of
    the activations it saved for backward: :meth:`teraio.core.trace.Trace.live_bytes_by_kind`'s
    ``activation``). The profiler runs each op as is: the step's numbers are unchanged. On
    CUDA it resets the allocator's peak statistics per op."""
    loss, trace = profile_step(step_fn, model, optimizer, device)
    saved = trace.live_bytes_by_kind()["activation"]
    return loss, int(saved.max()) if len(saved) else 0


CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def final_params_digest(model: nn.Module) -> str:
    """``teraio.systems.measure.param_digest`` of ``model`` as the unwrapped model would give
    it: parameter names without ``checkpoint_wrapper``'s ``_checkpoint_wrapped_module.`` and
    FSDP2's sharded parameters (DTensors) gathered whole. Equal digests: bit-identical weights."""
    import hashlib

    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        h.update(name.replace(CHECKPOINT_PREFIX, "").encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def measure_and_digest(step_fn, workload: WorkloadConfig, device: torch.device, measured: Measurements,
                       model: nn.Module, progress: bool = True) -> None:
    """The users' baselines' measured steps: ``step_fn``'s steps run by the shared loop
    (``teraio.systems.loop.measure_steps``, progress lines where ``progress``), then their
    losses, the device's peaks (bytes) and :func:`final_params_digest` of ``model`` into
    ``measured``."""
    steps = measure_steps(step_fn, workload, device, progress=progress, out=Steps(iterations=measured.iterations))
    measured.losses = list(steps.losses.values())
    measured.peak_allocated_bytes, measured.peak_reserved_bytes = peak_memory(device)
    measured.extras["final_params_sha256"] = final_params_digest(model)
