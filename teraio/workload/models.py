"""Model construction from a :class:`~teraio.config.ModelConfig` (torchtitan 0.2.2 models).

All systems (Ideal, TeraIO, ZeRO) build their model here, so they train the same
network from the same initial weights for a given seed.

Families:

- ``llama3``: torchtitan's Llama3 ``Transformer`` as is (Llama 3.1 RoPE scaling).
- ``granite``: Granite-code-base-8B (IBM, 2024; HF ``ibm-granite/granite-8b-code-base``,
  a ``LlamaForCausalLM``): the same blocks with attention and MLP biases, tied
  input/output embeddings and plain RoPE (``rope_scaling: null`` in its HF config).

``ffn_hidden_dim``, ``attn_bias``, ``mlp_bias`` and ``tie_embeddings`` may also be set
on a ``llama3`` model; ``granite`` implies the last three.
"""
from __future__ import annotations

import torch
from torch import nn
from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.models.llama3.model.args import RoPEScalingArgs

from teraio.config import ModelConfig

# scaling_factor 1 makes torchtitan's Llama 3.1 RoPE scaling the identity (plain RoPE).
NO_ROPE_SCALING = RoPEScalingArgs(scaling_factor=1.0)


def llama3_args(cfg: ModelConfig, max_seq_len: int) -> TransformerModelArgs:
    """torchtitan args for ``cfg``; ``max_seq_len`` sizes the RoPE table (tokens)."""
    return TransformerModelArgs(
        dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        vocab_size=cfg.vocab_size, multiple_of=cfg.multiple_of,
        ffn_dim_multiplier=cfg.ffn_dim_multiplier, norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, max_seq_len=max_seq_len, attn_type="sdpa",
        attn_mask_type="causal",
        **({"rope_scaling_args": NO_ROPE_SCALING} if cfg.family == "granite" else {}))


def _linear_like(old: nn.Linear, in_features: int, out_features: int, bias: bool) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias, device=old.weight.device)


class VariantTransformer(Transformer):
    """torchtitan's Llama3 ``Transformer`` with an explicit FFN width, optional biases on
    every attention (wq, wk, wv, wo) and MLP (w1, w2, w3) projection, and optional tied
    embeddings (``output.weight is tok_embeddings.weight``).

    Biases are initialised to zero (as in HF Llama). With tied embeddings the shared
    matrix gets torchtitan's output init (truncated normal, std ``dim**-0.5``), which
    runs after the embedding init and keeps the initial logits O(1).
    """

    def __init__(self, args: TransformerModelArgs, ffn_hidden_dim: int | None,
                 attn_bias: bool, mlp_bias: bool, tie_embeddings: bool):
        super().__init__(args)
        self.tie_embeddings = tie_embeddings
        for block in self.layers.values():
            attn, ffn = block.attention, block.feed_forward
            if attn_bias:
                for name in ("wq", "wk", "wv", "wo"):
                    old = getattr(attn, name)
                    setattr(attn, name, _linear_like(old, old.in_features, old.out_features, True))
            hidden = ffn_hidden_dim or ffn.w1.out_features
            ffn.w1 = _linear_like(ffn.w1, args.dim, hidden, mlp_bias)
            ffn.w3 = _linear_like(ffn.w3, args.dim, hidden, mlp_bias)
            ffn.w2 = _linear_like(ffn.w2, hidden, args.dim, mlp_bias)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection (no-op when untied).
        Call again after ``to_empty``, which gives each module its own new tensor."""
        if self.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        super().init_weights(buffer_device=buffer_device)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)


def _needs_variant(cfg: ModelConfig) -> bool:
    return (cfg.family == "granite" or cfg.ffn_hidden_dim is not None or cfg.attn_bias
            or cfg.mlp_bias or cfg.tie_embeddings)


def ties_embeddings(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s output projection is its token embedding (``granite`` implies it)."""
    return cfg.tie_embeddings or cfg.family == "granite"


def build_meta_model(cfg: ModelConfig, max_seq_len: int) -> nn.Module:
    """The model for ``cfg`` on the meta device (no memory), for shapes and counts."""
    if cfg.ffn_hidden_dim is not None and cfg.ffn_hidden_dim <= 0:
        raise ValueError(f"model.ffn_hidden_dim={cfg.ffn_hidden_dim}; must be a positive int or null")
    args = llama3_args(cfg, max_seq_len)
    granite = cfg.family == "granite"
    with torch.device("meta"):
        if not _needs_variant(cfg):
            return Transformer(args)
        return VariantTransformer(args, ffn_hidden_dim=cfg.ffn_hidden_dim,
                                  attn_bias=cfg.attn_bias or granite,
                                  mlp_bias=cfg.mlp_bias or granite,
                                  tie_embeddings=ties_embeddings(cfg))


def build_model(cfg: ModelConfig, max_seq_len: int, device: torch.device | str = "cpu",
                seed: int = 0) -> nn.Module:
    """Build and initialise the model on ``device`` (fp32), deterministically from ``seed``.

    The model is built on the meta device and materialised once on ``device``, so an 8B
    model never exists twice in host memory.
    """
    model = build_meta_model(cfg, max_seq_len)
    model.to_empty(device=device)
    if isinstance(model, VariantTransformer):
        model.tie_weights()
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model


def model_state_bytes(cfg: ModelConfig, max_seq_len: int) -> int:
    """Bytes of the model's parameters (tied ones once) and buffers as built by
    :func:`build_model` (fp32; the RoPE table complex64), computed on the meta device."""
    model = build_meta_model(cfg, max_seq_len)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


# Bytes per parameter of FP32 training with AdamW: the weight, its gradient and two states.
STATE_BYTES_PER_PARAMETER = 16


def ffn_hidden(net: nn.Module) -> int:
    """The FFN width of a built (meta) model, from its first block's ``w1``."""
    return max(m.out_features for name, m in net.named_modules() if name.endswith("feed_forward.w1"))


def activation_bytes(cfg: ModelConfig, ffn: int, tokens: int, n_layers: int) -> int:
    """Estimated bytes of the activations ``n_layers`` blocks save for backward over ``tokens``
    tokens in FP32, beside the attention probabilities (:func:`attention_bytes`): about
    (12·dim + 4·ffn) floats per token per layer."""
    return tokens * n_layers * (12 * cfg.dim + 4 * ffn) * 4


def attention_bytes(cfg: ModelConfig, micro_batch_size: int, seq_len: int, n_layers: int) -> int:
    """Bytes of the attention probabilities ``n_layers`` blocks save for backward over one
    micro-batch in FP32 on CUDA: torchtitan's SDPA wrapper allows the cuDNN, flash and math
    kernels only, and in FP32 only the math kernel runs, which saves its softmax output, one
    FP32 seq × seq matrix per sequence and head (a trace of the H200 shows 2,416 MB per layer
    at 2 sequences of 3,072 tokens and 32 heads: ``tests/test_breakdown.py``)."""
    return micro_batch_size * cfg.n_heads * seq_len * seq_len * 4 * n_layers


def softmax_working_bytes(cfg: ModelConfig, micro_batch_size: int, seq_len: int) -> int:
    """Bytes one layer's attention softmax holds at once while it runs, over one micro-batch
    on CUDA in FP32: torch's ``aten._safe_softmax`` keeps its input scores, the softmax before
    masking, a bool mask of the same shape and its result (the probabilities
    :func:`attention_bytes` counts) alive together, 13/4 of one layer's probabilities. No
    schedule can run that op with less resident."""
    return attention_bytes(cfg, micro_batch_size, seq_len, 1) * 13 // 4


def micro_batch_bytes(cfg: ModelConfig, ffn: int, micro_batch_size: int, seq_len: int, n_layers: int,
                      logits: bool = True) -> int:
    """What one micro-batch in flight holds for backward: :func:`activation_bytes` and
    :func:`attention_bytes` of ``n_layers`` blocks, and with ``logits`` the
    :func:`logits_bytes`."""
    tokens = micro_batch_size * seq_len
    return (activation_bytes(cfg, ffn, tokens, n_layers) + attention_bytes(cfg, micro_batch_size, seq_len, n_layers)
            + (logits_bytes(cfg, tokens) if logits else 0))


def logits_bytes(cfg: ModelConfig, tokens: int) -> int:
    """Three logits-sized FP32 buffers over ``tokens`` tokens: the logits, their log-softmax
    and its gradient."""
    return 3 * tokens * cfg.vocab_size * 4


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def stage_of(name: str, n_layers: int, stages: int) -> int:
    """The pipeline stage holding parameter ``name`` (``layers.<i>.…``, ``tok_embeddings.…``,
    ``norm.…``, ``output.…``); blocks split evenly, earlier stages taking the remainder."""
    if name.startswith("layers."):
        i, end = int(name.split(".")[1]), 0
        for s in range(stages):
            end += n_layers // stages + (s < n_layers % stages)
            if i < end:
                return s
        raise ValueError(f"stage_of: {name} is past the model's {n_layers} blocks")
    return 0 if name.startswith("tok_embeddings.") else stages - 1


def pipeline_estimate(cfg: ModelConfig, micro_batch_size: int, seq_len: int, n_micro: int,
                      stages: int = 2) -> list[dict]:
    """The estimated peak device memory of each GPU of a pipeline of ``stages`` stages run
    1F1B (paper §4.1: two GPUs, one stage each), nothing offloaded.

    A stage holds its share of the blocks (the first also the embedding, the last also the
    final norm and the output layer), at :data:`STATE_BYTES_PER_PARAMETER` per distinct
    parameter (a weight tied across stages, Granite's embedding and output, is held by both;
    within one stage once), and at its peak what ``min(stages - stage, n_micro)`` micro-batches
    in flight hold for backward (:func:`micro_batch_bytes`, the logits on the last stage only).
    The step peaks either at the logits or inside an attention softmax, whichever holds more:
    temporaries are what :func:`softmax_working_bytes` holds beyond the probabilities it saves
    and the stage's logits.

    Returns:
        Per stage ``{"stage", "layers", "parameters_count", "parameters", "gradients",
        "optimizer state", "activations", "temporaries", "peak_bytes"}``, in bytes.

    Raises:
        ValueError: fewer blocks than stages, or no micro-batch.
    """
    if not 1 <= stages <= cfg.n_layers or n_micro < 1:
        raise ValueError(f"stages={stages} must be in 1..n_layers={cfg.n_layers} and n_micro={n_micro} >= 1")
    net = build_meta_model(cfg, seq_len)
    held: list[dict[int, int]] = [{} for _ in range(stages)]
    for name, p in net.named_parameters(remove_duplicate=False):
        held[stage_of(name, cfg.n_layers, stages)][id(p)] = p.numel()
    ffn = ffn_hidden(net)
    out = []
    for s in range(stages):
        count = sum(held[s].values())
        layers = cfg.n_layers // stages + (s < cfg.n_layers % stages)
        in_flight = min(stages - s, n_micro)
        last = s == stages - 1
        logits = logits_bytes(cfg, micro_batch_size * seq_len) if last else 0
        groups = {"parameters": 4 * count, "gradients": 4 * count,
                  "optimizer state": 8 * count,  # AdamW's two FP32 states
                  "activations": in_flight * micro_batch_bytes(cfg, ffn, micro_batch_size, seq_len, layers,
                                                               logits=last),
                  "temporaries": max(0, softmax_working_bytes(cfg, micro_batch_size, seq_len)
                                     - attention_bytes(cfg, micro_batch_size, seq_len, 1) - logits)}
        out.append({"stage": s, "layers": layers, "parameters_count": count, **groups,
                    "peak_bytes": sum(groups.values())})
    return out
