"""Full-depth trace synthesis from a reduced-depth profile."""
from collections import Counter

import numpy as np
import pytest
import torch

from teraio.config import ModelConfig, WorkloadConfig
from teraio.workload.models import build_model
from teraio.core.profiler import profile_step
from teraio.workload.step import make_batch, make_optimizer, train_step
from teraio.perf.synth import Sweep, find_sweeps, layered_trace, synthesize_layers
from teraio.core.trace import Trace


def canonical(trace: Trace) -> Counter:
    """Every tensor as (name, bytes, kind, persistent, uses), ignoring tid order. Inputs
    are named by the profiler's record count, which depends on depth: drop their names."""
    return Counter((t.name if t.kind != "input" else "input", t.nbytes, t.kind, t.persistent,
                    tuple(t.uses)) for t in trace.tensors)


@pytest.mark.parametrize("n_layers", [2, 3, 7, 32])
def test_toy_trace_synthesized_equals_real(n_layers):
    src = layered_trace(2)
    assert find_sweeps(src, 2) == [Sweep(1, 12, 1, 2), Sweep(30, 16, -1, 2), Sweep(68, 20, 1, 2)]
    real, syn = layered_trace(n_layers), synthesize_layers(src, 2, n_layers)
    assert syn.op_names == real.op_names
    assert np.allclose(syn.op_seconds, real.op_seconds, rtol=1e-12)
    assert canonical(syn) == canonical(real)
    assert syn.meta["synthesized"]["n_layers"] == syn.meta["n_layers"] == n_layers


def test_inserted_layers_take_mean_op_times():
    src = layered_trace(2)
    first = src.op_seconds.copy()
    src.op_seconds[1:13] *= 1.5  # forward block of layer 0 (ops 1..12) runs slower
    syn = synthesize_layers(src, 2, 4)
    block = syn.op_seconds[1:1 + 4 * 12].reshape(4, 12)
    assert np.allclose(block[0], 1.5 * first[1:13])          # layer 0 kept
    assert np.allclose(block[1], block[2]) and np.allclose(block[1], 1.25 * first[13:25])  # mean
    assert np.allclose(block[3], first[13:25])               # last layer kept


def profile_tiny(n_layers: int, family: str = "llama3", n_kv_heads=None, micro_batches: int = 1) -> Trace:
    cfg = ModelConfig(name="tiny", family=family, dim=64, n_layers=n_layers, n_heads=4,
                      n_kv_heads=n_kv_heads, vocab_size=256, multiple_of=32)
    wl = WorkloadConfig(batch_size=micro_batches, micro_batch_size=1, seq_len=32)
    model = build_model(cfg, wl.seq_len)
    opt = make_optimizer(model, 1e-3)
    x, y = make_batch(0, wl, cfg.vocab_size, 0, "cpu")
    train_step(model, opt, x, y, 1)  # optimizer state exists before profiling
    return profile_step(lambda: train_step(model, opt, x, y, 1), model, opt, torch.device("cpu"))[1]


@pytest.mark.parametrize("family, n_kv_heads, micro_batches", [
    ("llama3", None, 1), ("llama3", 2, 2), ("granite", None, 1)])
def test_profiled_2_layer_trace_synthesizes_the_real_5_layer_trace(family, n_kv_heads, micro_batches):
    """synthesized N-layer trace from a 2-layer profile vs a real N-layer profile.
    Ops and tensors match exactly (so do live bytes and peak). Kernel times are CPU
    wall times here, too noisy to compare in a test; see the GPU benchmark."""
    src = profile_tiny(2, family, n_kv_heads, micro_batches)
    real = profile_tiny(5, family, n_kv_heads, micro_batches)
    syn = synthesize_layers(src, 2, 5)
    assert syn.n_ops == real.n_ops and syn.op_names == real.op_names
    assert canonical(syn) == canonical(real)
    assert (syn.live_bytes() == real.live_bytes()).all()
    assert len(find_sweeps(src, 2)) == 2 * micro_batches + 1  # forward, backward per micro-batch; optimizer


def test_synthesized_trace_round_trips(tmp_path):
    syn = synthesize_layers(layered_trace(2), 2, 9)
    syn.save(tmp_path / "t.json")
    again = Trace.load(tmp_path / "t.json")
    assert canonical(again) == canonical(syn) and again.op_names == syn.op_names


def test_bad_layer_counts_are_named():
    src = layered_trace(2)
    with pytest.raises(ValueError, match="can only add layers"):
        synthesize_layers(src, 2, 1)
    with pytest.raises(ValueError, match=r"layers \[0, 1\], expected 0..2"):
        synthesize_layers(src, 3, 6)
    with pytest.raises(ValueError, match="at least 2 layers"):
        synthesize_layers(layered_trace(1), 1, 4)


def test_non_periodic_trace_is_refused():
    src = layered_trace(2)
    # Layer 1's forward runs a different op where layer 0 ran an mm: no repeat.
    k = next(k for k in range(13, 25) if src.op_names[k] == "aten.mm.default")
    src.op_names[k] = "aten.bmm.default"
    with pytest.raises(ValueError, match="layer-periodic"):
        synthesize_layers(src, 2, 4)
