"""Pipeline parallelism as the paper trains (§4.1: each GPU is one stage of a 2-stage 1F1B
pipeline, PipeDream style): a model's blocks split over stages, and one training step of
one stage through ``torch.distributed.pipelining``'s ``Schedule1F1B``, as torchtitan runs it.

A stage's step equals :func:`teraio.workload.step.train_step` on the whole model bit for bit, for the
same initial weights and tokens:

- each micro-batch's loss is its cross-entropy ÷ the number of micro-batches, as in
  ``train_step`` (the schedule's own gradient scaling, which divides after summing, is off);
- 1F1B runs each stage's backward passes in forward order, so every gradient accumulates
  over micro-batches in the order ``train_step`` accumulates it;
- the step's loss is the sum of the micro-batch losses in micro-batch order, computed on the
  last stage and broadcast to every stage.

Every rank builds the whole model from the seed on the host (the same initial weights as an
un-pipelined run on the host) and keeps its stage's blocks (:func:`split_model`), moved to its
device. :func:`build_training` gives a system what it trains, pipelined or not.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from teraio.config import ModelConfig, WorkloadConfig
from teraio.workload.models import build_model
from teraio.workload.step import make_optimizer, train_step


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    """The block indices of ``stage``: contiguous, the earlier stages taking one more block
    each while ``n_layers`` does not divide evenly.

    Raises:
        ValueError: fewer blocks than stages, or ``stage`` not in ``[0, n_stages)``.
    """
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"pipeline_stages={n_stages}: needs 1 <= stages <= the model's {n_layers} layers")
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage}: valid stages are 0..{n_stages - 1}")
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def split_model(model: nn.Module, n_stages: int, stage: int) -> nn.Module:
    """Keep ``stage``'s share of a torchtitan ``Transformer`` in place and return it: its
    blocks (:func:`stage_layers`), the token embedding on the first stage only, the final
    norm and output projection on the last stage only (torchtitan's forward passes through
    the missing ones).

    Raises:
        ValueError: a model with tied input/output embeddings (one matrix cannot sit on two
            stages), or a bad stage split (:func:`stage_layers`).
    """
    if n_stages > 1 and getattr(model, "tie_embeddings", False):
        raise ValueError("a model with tied input/output embeddings (e.g. granite) cannot be split "
                         "over pipeline stages")
    keep = stage_layers(len(model.layers), n_stages, stage)
    for key in list(model.layers.keys()):
        if int(key) not in keep:
            del model.layers[key]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm = None
        model.output = None
    return model


class StageStep:
    """One training step of one pipeline stage (module docstring).

    Args:
        module: the stage's share of the model (:func:`split_model`), on ``device``.
        optimizer: over ``module``'s parameters.
        stage, n_stages: this rank's stage and the pipeline's depth; stage ``s`` is the
            ``s``-th rank of ``group``.
        n_micro: micro-batches per step.
        device: the stage's device.
        group: the process group of the pipeline (default: the world).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, stage: int, n_stages: int,
                 n_micro: int, device: torch.device, group: dist.ProcessGroup | None = None):
        self.optimizer = optimizer
        self.stage, self.n_stages, self.n_micro = stage, n_stages, n_micro
        self.device = device
        self.group = group
        self.last_rank = dist.get_global_rank(group, n_stages - 1) if group is not None else n_stages - 1
        self.pipe = PipelineStage(module, stage, n_stages, device, group=group)
        self.schedule = Schedule1F1B(self.pipe, n_micro, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / self.n_micro

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """Run the step on the global batch ``inputs``/``labels`` (int64 ``[batch, seq]``;
        read on the first and the last stage respectively) and return its loss (float,
        every stage)."""
        losses: list[torch.Tensor] = []
        if self.stage == 0:
            self.schedule.step(inputs, target=labels if self.n_stages == 1 else None,
                               losses=losses if self.n_stages == 1 else None)
        elif self.stage == self.n_stages - 1:
            self.schedule.step(target=labels, losses=losses)
        else:
            self.schedule.step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss.detach()
        dist.broadcast(total, src=self.last_rank, group=self.group)
        return float(total)


@dataclass
class Training:
    """What a system trains in this process.

    Attributes:
        model: the whole model, or this process's stage of it (:func:`split_model`).
        optimizer: AdamW over ``model``'s parameters (``teraio.workload.step.make_optimizer``).
        step: ``step(inputs, labels) -> loss`` for one global batch (int64 ``[batch, seq]``):
            ``teraio.workload.step.train_step``, or this stage's :class:`StageStep`.
        stage, n_stages: this process's stage and the pipeline's depth (0 and 1 unpipelined).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[torch.Tensor, torch.Tensor], float]
    stage: int = 0
    n_stages: int = 1


def build_training(model_cfg: ModelConfig, workload: WorkloadConfig, device: torch.device, seed: int) -> Training:
    """The model, optimizer and step of ``workload``: built on ``device`` for
    ``pipeline_stages`` = 1; for S > 1, this process's stage (its rank in a process group of
    S, initialised here from torchrun's environment when no group exists: nccl on CUDA,
    gloo on the CPU), built on the host and moved to ``device``.

    Raises:
        ValueError: S > 1 without S processes (``WORLD_SIZE``), or a model that cannot be
            split so (:func:`split_model`).
    """
    n_stages = workload.pipeline_stages
    if n_stages == 1:
        model = build_model(model_cfg, workload.seq_len, device, seed)
        optimizer = make_optimizer(model, workload.lr)
        return Training(model, optimizer,
                        lambda x, y: train_step(model, optimizer, x, y, workload.micro_batch_size))
    stage = _pipeline_rank(n_stages, device)
    module = split_model(build_model(model_cfg, workload.seq_len, "cpu", seed), n_stages, stage).to(device)
    optimizer = make_optimizer(module, workload.lr)
    step = StageStep(module, optimizer, stage, n_stages, workload.grad_accum_steps, device)
    return Training(module, optimizer, step, stage, n_stages)


def _pipeline_rank(n_stages: int, device: torch.device) -> int:
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world != n_stages:
            raise ValueError(f"workload.pipeline_stages={n_stages} needs {n_stages} processes (torchrun "
                             f"--nproc-per-node={n_stages}); this one runs in a world of {world}")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != n_stages:
        raise ValueError(f"workload.pipeline_stages={n_stages} but the process group has "
                         f"{dist.get_world_size()} ranks")
    return dist.get_rank()


def gather_stages(training: Training, facts: dict) -> list[dict] | None:
    """Every stage's ``facts`` (JSON-able), in stage order, with its ``stage`` and ``rank``:
    the ``stages`` extra of a pipelined row; None unpipelined. A collective: every stage
    calls it."""
    if training.n_stages == 1:
        return None
    mine = {"stage": training.stage, "rank": dist.get_rank(), **facts}
    out: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return sorted(out, key=lambda f: f["stage"])
