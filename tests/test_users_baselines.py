"""What users switch on today: Ideal with torchtitan's activation checkpointing (``ideal_ac``)
and torchao's CPU-offloaded optimizer (``torchao_offload``); FSDP2's CPU offload has its own
file (``tests/test_fsdp_offload.py``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from teraio import systems
from teraio.config import run_config_from_dict
from teraio.harness.checks import validate
from teraio.result import result_row
from baselines import fsdp_offload, ideal, ideal_ac, torchao_offload
from baselines.checkpointing import final_params_digest, saved_activation_peak_bytes
from teraio.workload.models import build_model
from teraio.workload.step import make_batch, make_optimizer, train_step

CONF = Path(__file__).resolve().parents[1] / "conf"
TINY = {"name": "llama3_tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "vocab_size": 256, "multiple_of": 32}
# 10 steps: 2 warm-up (the second profiled for the saved activations), 8 measured.
WORKLOAD = {"batch_size": 4, "micro_batch_size": 2, "seq_len": 32, "warmup_steps": 2, "measure_steps": 8}
SEED = 3


def cfg(system: str, device: str = "cpu", **options):
    return run_config_from_dict({"model": TINY, "system": {"name": system, "options": options}, "seed": SEED,
                                 "workload": WORKLOAD, "hardware": {"device": device}})


def shared_step(device: str = "cpu") -> tuple[list[float], str, int]:
    """The shared step unwrapped, 10 steps: (losses, final parameter digest, peak bytes saved for
    backward at step 1, profiled as ideal_ac profiles it)."""
    c = cfg("ideal")
    model, w = build_model(c.model, WORKLOAD["seq_len"], device, SEED), c.workload
    opt = make_optimizer(model, w.lr)
    losses, peak = [], None
    for s in range(10):
        x, y = make_batch(s, w, TINY["vocab_size"], SEED, device)
        if s == 1:
            loss, peak = saved_activation_peak_bytes(lambda: train_step(model, opt, x, y, 2), model, opt,
                                                     torch.device(device))
        else:
            loss = train_step(model, opt, x, y, 2)
        losses.append(loss)
    return losses, final_params_digest(model), peak


@pytest.fixture(scope="module")
def unchecked():
    return shared_step()


@pytest.mark.parametrize("options", [{"mode": "full"}, {"mode": "selective", "selective_ac_option": "op"},
                                     {"mode": "selective", "selective_ac_option": "2"}])
def test_ideal_ac_is_bit_identical_to_ideal_and_saves_less(tmp_path, unchecked, options):
    losses, digest, peak = unchecked
    c = cfg("ideal_ac", **options)
    row = result_row(c.point(), c.to_dict(), ideal_ac.run(c, tmp_path, torch.device("cpu")))
    assert row["losses"] == losses  # bit for bit, all 10 steps
    assert row["final_params_sha256"] == digest
    assert [i["loss"] for i in row["iterations"]] == losses[2:]
    assert row["ac_mode"] == options["mode"] and row["micro_batch_size_trained"] == 2
    saved = row["saved_activation_peak_bytes"]
    assert 0 < saved < peak, (saved, peak)
    # Ideal's own row: the same losses (the reference is the shared step Ideal runs).
    if options["mode"] == "full":
        assert ideal.run(cfg("ideal"), tmp_path, torch.device("cpu")).losses == losses


def test_ideal_ac_without_a_second_warmup_step_records_no_saved_peak(tmp_path):
    c = run_config_from_dict({"model": TINY, "system": {"name": "ideal_ac"}, "seed": SEED,
                              "workload": {**WORKLOAD, "warmup_steps": 1, "measure_steps": 1}})
    assert ideal_ac.run(c, tmp_path, torch.device("cpu")).extras["saved_activation_peak_bytes"] is None


@pytest.mark.parametrize("system", ["ideal_ac", "fsdp_offload"])
def test_a_capped_point_on_a_cpu_says_nothing_held_it_to_the_cap(tmp_path, system):
    from teraio.harness.run import run_point
    capped = run_config_from_dict({"model": TINY, "system": {"name": system}, "seed": SEED,
                                   "workload": {**WORKLOAD, "warmup_steps": 1, "measure_steps": 1},
                                   "hardware": {"device": "cpu", "gpu_capacity_bytes": 10**9}})
    row = run_point(capped, tmp_path / "capped")
    assert row["status"] == "ok" and row["capacity_enforced"] is False, row  # the throughput table's note reads it
    uncapped = dataclasses.replace(capped, hardware=dataclasses.replace(capped.hardware, gpu_capacity_bytes=None))
    free = run_point(uncapped, tmp_path / "free")
    assert free["status"] == "ok" and "capacity_enforced" not in free


@pytest.mark.parametrize("system, options, match", [
    ("ideal_ac", {"mode": "none"}, r"mode='none'; ideal_ac takes one of \['full', 'selective'\]"),
    ("ideal_ac", {"selective_ac_option": "x"}, r"selective_ac_option='x'; valid: 'op'"),
    ("ideal_ac", {"micro_batch_size": 0}, r"micro_batch_size=0; ideal_ac takes a positive int or null"),
    ("ideal_ac", {"bogus": 1}, r"unknown key\(s\) \['bogus'\] for ideal_ac"),
    ("torchao_offload", {"ac": "some"}, r"ac='some'; torchao_offload takes one of"),
    ("torchao_offload", {"minimal_size": -1}, r"minimal_size=-1; must be an int >= 0"),
    ("torchao_offload", {"fused": "yes"}, r"fused='yes'; must be true or false"),
])
def test_options_are_checked(system, options, match):
    with pytest.raises(ValueError, match=match):
        systems.check_options(system, options)


def test_micro_batch_option_must_divide_the_workloads(tmp_path):
    with pytest.raises(ValueError, match=r"micro_batch_size=3 does not divide workload.micro_batch_size=2"):
        ideal_ac.run(cfg("ideal_ac", micro_batch_size=3), tmp_path, torch.device("cpu"))


def test_ideal_ac_trains_the_chosen_micro_batch_with_the_same_tokens(tmp_path, unchecked):
    c = run_config_from_dict({"model": TINY, "system": {"name": "ideal_ac", "options": {"micro_batch_size": 1}},
                              "seed": SEED, "workload": {**WORKLOAD, "warmup_steps": 1, "measure_steps": 2}})
    m = ideal_ac.run(c, tmp_path, torch.device("cpu"))
    assert m.extras["micro_batch_size_trained"] == 1
    # Same tokens and loss definition; the sums run over other micro-batches: FP32 rounding only.
    assert m.losses == pytest.approx(unchecked[0][:3], rel=1e-5)


@pytest.mark.parametrize("name, runner", [("ideal_ac", ideal_ac), ("fsdp_offload", fsdp_offload),
                                          ("torchao_offload", torchao_offload)])
def test_system_configs_equal_their_runners_defaults(name, runner):
    conf = yaml.safe_load((CONF / "system" / f"{name}.yaml").read_text())
    assert conf["name"] == name and conf["options"] == runner.DEFAULTS
    runner.check_options(name, conf["options"])


def test_the_sweep_refuses_torchao_offload_on_a_cpu_point():
    with pytest.raises(ValueError, match=r"hardware.device='cpu': torchao_offload runs on CUDA only"):
        validate(cfg("torchao_offload"), check_device=False)


def test_torchao_offload_runner_refuses_a_cpu_device(tmp_path):
    with pytest.raises(ValueError, match=r"hardware.device='cpu': torchao_offload .*runs on cuda"):
        torchao_offload.run(cfg("torchao_offload"), tmp_path, torch.device("cpu"))


def test_torchao_offload_refuses_offloaded_gradients_with_accumulation(tmp_path):
    c = cfg("torchao_offload", "cuda", offload_gradients=True)
    with pytest.raises(ValueError, match=r"offload_gradients=true with 2 micro-batches per step"):
        torchao_offload.run(c, tmp_path, torch.device("cuda"))


# Equal losses within this relative tolerance: torchao steps AdamW with the fused CPU kernel, Ideal
# with per-parameter GPU kernels (FP32 rounding differs per step and compounds over 10 steps).
TORCHAO_RTOL = 1e-4


@pytest.mark.gpu
def test_torchao_offload_losses_equal_ideal_on_a_gpu(tmp_path):
    ref = ideal.run(cfg("ideal", "cuda"), tmp_path, torch.device("cuda"))
    for options in ({}, {"ac": "full"}):
        m = torchao_offload.run(cfg("torchao_offload", "cuda", **options), tmp_path, torch.device("cuda"))
        assert m.losses == pytest.approx(ref.losses, rel=TORCHAO_RTOL)
        assert m.peak_allocated_bytes > 0 and m.extras["host_state_bytes"] > 0


@pytest.mark.gpu
def test_ideal_ac_on_a_gpu_lowers_the_peak_and_keeps_the_losses(tmp_path):
    ref = ideal.run(cfg("ideal", "cuda"), tmp_path, torch.device("cuda"))
    m = ideal_ac.run(cfg("ideal_ac", "cuda"), tmp_path, torch.device("cuda"))
    # Recomputation reruns the same kernels on the same inputs: equal up to nondeterministic
    # GPU reductions (atomics in attention's backward), compounded over 10 steps.
    assert m.losses == pytest.approx(ref.losses, rel=TORCHAO_RTOL)
    assert m.extras["saved_activation_peak_bytes"] > 0
