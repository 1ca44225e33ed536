"""Model construction from a :class:`~teraio.config.ModelConfig` (torchtitan 0.2.2 models).

All systems (Ideal, TeraIO, ZeRO) build their model here, so they train the same
network from the same initial weights for a given seed.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchtitan.models.llama3 import Transformer, TransformerModelArgs

from teraio.config import ModelConfig


def llama3_args(cfg: ModelConfig, max_seq_len: int) -> TransformerModelArgs:
    """torchtitan args for ``cfg``; ``max_seq_len`` sizes the RoPE table (tokens)."""
    return TransformerModelArgs(
        dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        vocab_size=cfg.vocab_size, multiple_of=cfg.multiple_of,
        ffn_dim_multiplier=cfg.ffn_dim_multiplier, norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, max_seq_len=max_seq_len, attn_type="sdpa",
        attn_mask_type="causal")


def build_model(cfg: ModelConfig, max_seq_len: int, device: torch.device | str = "cpu",
                seed: int = 0) -> nn.Module:
    """Build and initialise the model on ``device`` (fp32), deterministically from ``seed``.

    The model is built on the meta device and materialised once on ``device``, so an 8B
    model never exists twice in host memory.
    """
    if cfg.family != "llama3":
        raise ValueError(f"model.family={cfg.family!r} is not supported by build_model")
    args = llama3_args(cfg, max_seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
