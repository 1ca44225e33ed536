"""Model shapes and parameter counts (meta device: nothing is materialised) and the
Granite variant's behaviour on a tiny CPU model."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from torchtitan.models.llama3 import Transformer, llama3_args as titan_args

from teraio.config import ModelConfig
from teraio.workload.models import build_meta_model, build_model, count_parameters

REPO = Path(__file__).resolve().parents[1]

LLAMA3_8B = ModelConfig(name="llama3_8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        vocab_size=128256, multiple_of=1024, ffn_dim_multiplier=1.3,
                        rope_theta=500000.0)
LLAMA3_70B = ModelConfig(name="llama3_70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                         vocab_size=128256, multiple_of=4096, ffn_dim_multiplier=1.3,
                         rope_theta=500000.0)
GRANITE_8B = ModelConfig(name="granite_8b", family="granite", dim=4096, n_layers=36, n_heads=32,
                         n_kv_heads=8, vocab_size=49152, ffn_hidden_dim=14336, rope_theta=1e4,
                         attn_bias=True, mlp_bias=True, tie_embeddings=True)

# ibm-granite/granite-8b-code-base's HF config.json (LlamaForCausalLM). Read from the
# configs of its public fine-tunes, which name it as `_name_or_path`; its GGUF export
# lists the same shapes and the q/k/v/o biases. The model card says "8B".
GRANITE_8B_HF = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 49152,
                 "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}


def hf_llama_parameters(c: dict) -> int:
    """Parameter count of HF transformers' LlamaForCausalLM for config ``c`` (q/k/v/o
    projections biased iff attention_bias, gate/up/down iff mlp_bias, two RMSNorms per
    layer plus a final one, lm_head shared with embed_tokens iff tie_word_embeddings)."""
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    attn = 2 * h * h + 2 * h * kv + (2 * h + 2 * kv) * c["attention_bias"]
    mlp = 3 * h * f + (2 * f + h) * c["mlp_bias"]
    layer = attn + mlp + 2 * h
    return c["num_hidden_layers"] * layer + h + v * h * (1 if c["tie_word_embeddings"] else 2)


@pytest.mark.parametrize("cfg,size", [(LLAMA3_8B, "8B"), (LLAMA3_70B, "70B")])
def test_llama3_shapes_match_torchtitan(cfg, size):
    with torch.device("meta"):
        reference = Transformer(titan_args[size])
    ours = build_meta_model(cfg, max_seq_len=2048)
    assert count_parameters(ours) == count_parameters(reference)
    assert {n: p.shape for n, p in ours.named_parameters()} == \
        {n: p.shape for n, p in reference.named_parameters()}


def test_llama3_explicit_ffn_hidden_dim_equals_derived_width():
    derived = build_meta_model(LLAMA3_8B, 2048)
    explicit = build_meta_model(
        ModelConfig(**{**LLAMA3_8B.__dict__, "ffn_hidden_dim": 14336}), 2048)
    assert derived.layers["0"].feed_forward.w1.out_features == 14336
    assert count_parameters(explicit) == count_parameters(derived)
    narrow = build_meta_model(ModelConfig(**{**LLAMA3_8B.__dict__, "ffn_hidden_dim": 1000}), 2048)
    assert narrow.layers["3"].feed_forward.w2.in_features == 1000


def test_granite_8b_matches_published_parameter_count():
    published = hf_llama_parameters(GRANITE_8B_HF)
    assert round(published / 1e9) == 8  # the model card's "8B"
    model = build_meta_model(GRANITE_8B, max_seq_len=4096)
    assert abs(count_parameters(model) - published) <= 0.01 * published
    assert model.output.weight is model.tok_embeddings.weight
    attn, ffn = model.layers["35"].attention, model.layers["35"].feed_forward
    assert all(getattr(attn, n).bias is not None for n in ("wq", "wk", "wv", "wo"))
    assert all(getattr(ffn, n).bias is not None for n in ("w1", "w2", "w3"))
    assert attn.wk.out_features == 1024 and ffn.w1.out_features == 14336


def test_granite_conf_file_matches_published_count():
    path = REPO / "conf" / "model" / "granite_8b.yaml"
    if not path.exists():
        pytest.skip(f"{path} not written yet")
    d = {k: v for k, v in yaml.safe_load(path.read_text()).items() if not k.startswith("_")}
    published = hf_llama_parameters(GRANITE_8B_HF)
    assert abs(count_parameters(build_meta_model(ModelConfig(**d), 4096)) - published) \
        <= 0.01 * published


TINY_GRANITE = ModelConfig(name="tiny_granite", family="granite", dim=64, n_layers=2, n_heads=4,
                           n_kv_heads=2, vocab_size=128, ffn_hidden_dim=96, rope_theta=1e4)


def test_granite_materialised_keeps_tie_and_trains():
    model = build_model(TINY_GRANITE, max_seq_len=32, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert all(torch.count_nonzero(m.bias) == 0 for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m.bias is not None)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert math.isfinite(loss.item())
    loss.backward()
    assert model.layers["0"].attention.wq.bias.grad.abs().sum() > 0
    assert model.layers["1"].feed_forward.w2.bias.grad.abs().sum() > 0
    # the shared matrix gets the gradient of both uses: not that of the embedding alone
    assert model.tok_embeddings.weight.grad.count_nonzero() > tokens[:, :-1].unique().numel() * 64


def test_granite_uses_plain_rope():
    model = build_model(TINY_GRANITE, max_seq_len=32)
    head_dim = 64 // 4
    freqs = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(32).float(), freqs)
    torch.testing.assert_close(model.freqs_cis, torch.polar(torch.ones_like(angles), angles))


def test_build_model_is_deterministic_in_seed():
    a, b, c = (build_model(TINY_GRANITE, 32, seed=s) for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def test_bad_ffn_hidden_dim_is_named():
    with pytest.raises(ValueError, match="ffn_hidden_dim=-4"):
        build_meta_model(ModelConfig(name="bad", ffn_hidden_dim=-4), 32)
