"""The training step every system shares: synthetic tokens, micro-batched forward/backward,
AdamW step, zero_grad (paper §4.1: FP32, AdamW, no activation checkpointing).

Data are random token ids from a seeded generator, the same for every system: the
paper's C4 cannot be downloaded on the evaluation machines, and throughput does not
depend on token values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teraio.config import WorkloadConfig


def make_batch(step: int, workload: WorkloadConfig, vocab_size: int, seed: int,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels, int64 ``[batch_size, workload.seq_len_at(step)]``, deterministic in
    (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab_size, (workload.batch_size, workload.seq_len_at(step) + 1), generator=g)
    tokens = tokens.to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with per-parameter kernels (``foreach=False``): each parameter's update is its
    own op, so the profiler sees each optimizer state's use separately."""
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=False, fused=False)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               labels: torch.Tensor, micro_batch_size: int) -> float:
    """One optimizer step over the global batch, accumulating gradients over micro-batches.

    Returns:
        the mean loss over micro-batches (float; a host sync).
    """
    n_micro = inputs.shape[0] // micro_batch_size
    total = torch.zeros((), device=inputs.device)
    for i in range(n_micro):
        sl = slice(i * micro_batch_size, (i + 1) * micro_batch_size)
        logits = model(inputs[sl])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[sl].flatten()) / n_micro
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)
