"""FSDP2's CPU offload (``fsdp_offload``): on a CPU with gloo it trains the shared step bit for
bit (losses and final parameters); its options and conf file; the host-memory refusal (a row
naming the bytes, nothing trained); on a GPU, equal losses within FP32 tolerance."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from teraio.config import run_config_from_dict
from teraio.harness.run import run_point
from baselines import fsdp_offload, host_memory
from baselines.checkpointing import final_params_digest
from teraio.workload.models import build_model
from teraio.workload.step import make_batch, make_optimizer, train_step

CONF = Path(__file__).resolve().parents[1] / "conf"
TINY = {"name": "llama3_tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "vocab_size": 256, "multiple_of": 32}
# 10 steps of 2 micro-batches each (gradient accumulation through FSDP2's offloaded gradients).
WORKLOAD = {"batch_size": 4, "micro_batch_size": 2, "seq_len": 32, "warmup_steps": 2, "measure_steps": 8}
SEED = 5
STEPS = WORKLOAD["warmup_steps"] + WORKLOAD["measure_steps"]


def cfg(device: str = "cpu", model: dict = TINY, **options):
    return run_config_from_dict({"model": model, "system": {"name": "fsdp_offload", "options": options},
                                 "seed": SEED, "workload": WORKLOAD, "hardware": {"device": device}})


def shared_step(device: str, build_on: str = "cpu") -> tuple[list[float], str]:
    """Ideal's step, unsharded, 10 steps from the weights built on ``build_on`` (fsdp_offload
    builds on the host): (losses, final parameter digest)."""
    c = cfg(device)
    model = build_model(c.model, c.workload.seq_len, build_on, SEED).to(device)
    opt = make_optimizer(model, c.workload.lr)
    losses = []
    for s in range(STEPS):
        x, y = make_batch(s, c.workload, TINY["vocab_size"], SEED, device)
        losses.append(train_step(model, opt, x, y, WORKLOAD["micro_batch_size"]))
    return losses, final_params_digest(model)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_fsdp_offload_on_cpu_is_bit_identical_to_the_shared_step(tmp_path, ac):
    """One rank with gloo: FSDP2's sharding of one is the whole tensor, its reduce-scatter a
    copy, and AdamW steps the same FP32 values on the host: nothing changes a bit (FP32
    tolerance stated for the GPU test below)."""
    losses, digest = shared_step("cpu")
    row = run_point(cfg(ac=ac), tmp_path)
    assert row["status"] == "ok", row["error"]
    assert row["losses"] == losses  # float equality: bit for bit
    assert row["final_params_sha256"] == digest
    assert row["ac_mode"] == ac and row["micro_batch_size_trained"] == 2
    assert len(row["iterations"]) == WORKLOAD["measure_steps"]
    n_params = sum(p.numel() for p in build_model(cfg().model, 32, "meta", SEED).parameters())
    assert row["host_state_bytes"] == 16 * n_params
    assert row["peak_host_rss_bytes"] > row["host_state_bytes"]


def test_fsdp_offload_refuses_a_host_too_small_in_one_line_naming_the_bytes(tmp_path, monkeypatch):
    need = 16 * sum(p.numel() for p in build_model(cfg().model, 32, "meta", SEED).parameters())
    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: need + host_memory.PROCESS_HEADROOM_BYTES - 1)
    row = run_point(cfg(), tmp_path)
    assert row["status"] == "error" and row["iterations"] == []
    last = row["error"].strip().splitlines()[-1]
    assert last.startswith("MemoryError: fsdp_offload needs ") and "GB of host memory" in last
    assert f"needs {need / 1e9:.1f} GB" in last and "plus 8 GB for the process" in last
    assert f"{(need + host_memory.PROCESS_HEADROOM_BYTES - 1) / 1e9:.1f} GB this host has available" in last
    # exactly enough: no refusal
    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: need + host_memory.PROCESS_HEADROOM_BYTES)
    host_memory.check_host_room("fsdp_offload", need)


def test_the_full_llama3_8b_needs_about_128_gb_of_host_state():
    """The issue's number from the shapes: 16 B per parameter of the whole Llama3-8B
    (8.03 B parameters); refused where less is available, run where as much is."""
    d = yaml.safe_load((CONF / "model" / "llama3_8b.yaml").read_text())
    c = run_config_from_dict({"model": d, "system": {"name": "fsdp_offload"},
                              "workload": {"batch_size": 4, "micro_batch_size": 1, "seq_len": 2048}})
    need = host_memory.HOST_BYTES_PER_PARAMETER * host_memory.offloaded_parameters(c)
    assert 128.0e9 < need < 128.9e9
    with pytest.raises(MemoryError, match=r"needs 128\.\d GB of host memory .* more than the 120\.0 GB"):
        host_memory.check_host_room("fsdp_offload", need, available_bytes=120 * 10**9)
    host_memory.check_host_room("fsdp_offload", need, available_bytes=need + host_memory.PROCESS_HEADROOM_BYTES)


def test_fsdp_offload_options_are_checked_and_documented():
    opts = yaml.safe_load((CONF / "system" / "fsdp_offload.yaml").read_text())["options"]
    assert opts == fsdp_offload.DEFAULTS
    fsdp_offload.check_options("fsdp_offload", opts)
    for bad, match in [({"offload": True}, r"unknown key\(s\) \['offload'\] for fsdp_offload; valid: "),
                       ({"ac": "some"}, r"system.options.ac='some'; fsdp_offload takes one of \['none', "),
                       ({"ac": "selective", "selective_ac_option": "x"}, r"selective_ac_option='x'; valid: 'op'"),
                       ({"micro_batch_size": 0}, r"micro_batch_size=0; fsdp_offload takes a positive int"),
                       ({"pin_memory": "yes"}, r"pin_memory='yes'; must be true or false")]:
        with pytest.raises(ValueError, match=match):
            fsdp_offload.check_options("fsdp_offload", bad)


def test_fsdp_offload_refuses_a_micro_batch_that_does_not_divide(tmp_path):
    row = run_point(cfg(micro_batch_size=3), tmp_path)
    assert row["status"] == "error" and "micro_batch_size=3 does not divide" in row["error"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp_offload_on_a_gpu_trains_the_shared_step_within_fp32_tolerance(tmp_path):
    """On CUDA, against the shared step from the same host-built weights moved to the GPU: the
    forward and backward kernels are the GPU's in both, but FSDP2's AdamW steps on the host
    (another summation order than the GPU's), so losses agree within FP32 rounding carried
    over 10 steps: relative 1e-4."""
    losses, _ = shared_step("cuda")
    row = run_point(cfg("cuda"), tmp_path)
    assert row["status"] == "ok", row["error"]
    assert row["losses"] == pytest.approx(losses, rel=1e-4)
    assert row["peak_allocated_bytes"] > 0
