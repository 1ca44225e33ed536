"""DeepSpeed ZeRO baselines (baselines.zero) on CPU: generated config, option errors,
training that follows plain torch's loss trajectory, and real NVMe swapping.

The DeepSpeed runs need the JIT ops built (``python scripts/build_ds_ops.py``: minutes
the first time, then cached); each run itself takes seconds.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from baselines import zero
from baselines.process_group import free_port
from conftest import ModelBuilt, cap_then_build
from teraio.config import HardwareConfig, ModelConfig, RunConfig, SystemConfig, WorkloadConfig
from teraio.workload.models import build_meta_model, build_model
from teraio.result import write_result
from teraio.harness.run import run_point
from teraio.workload.step import make_batch, make_optimizer, train_step

REPO = Path(__file__).resolve().parents[1]

# dim 512: the attention and embedding matrices reach 1 MiB, the smallest size
# DeepSpeed swaps to NVMe (aio block_size), so zero_infinity really swaps.
MODEL = ModelConfig(name="tiny512", dim=512, n_layers=1, n_heads=4, vocab_size=2048, multiple_of=32)
WORKLOAD = WorkloadConfig(batch_size=4, micro_batch_size=2, seq_len=32, warmup_steps=1,
                          measure_steps=3, lr=1e-3)
# DeepSpeedCPUAdam is a different (vectorised) AdamW kernel from torch's: its updates
# differ from torch's in the last bits, so after a few steps the losses differ by ~1e-6.
# The effect of training itself on these losses is ~1e-2 (checked below), so a 1e-4
# tolerance tells "same training" from "different training" by two orders of magnitude.
LOSS_ATOL = 1e-4


def make_cfg(system: str, options: dict | None = None, ssd_dir: Path | str = "/nonexistent",
             model: ModelConfig = MODEL) -> RunConfig:
    return RunConfig(model=model, workload=WORKLOAD,
                     system=SystemConfig(name=system, options=options or {}),
                     hardware=HardwareConfig(ssd_dirs=[str(ssd_dir)]))


def torch_losses(lr: float) -> list[float]:
    """The shared step (teraio.workload.step.train_step), as Ideal runs it, on CPU."""
    w = WORKLOAD
    model = build_model(MODEL, w.seq_len, "cpu", seed=0)
    optimizer = make_optimizer(model, lr)
    return [train_step(model, optimizer, *make_batch(s, w, MODEL.vocab_size, 0, "cpu"),
                       w.micro_batch_size) for s in range(w.warmup_steps + w.measure_steps)]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    trained, frozen = torch_losses(WORKLOAD.lr), torch_losses(0.0)
    # Guard that the tolerance can fail: training moves these losses far more than it.
    assert max(abs(a - b) for a, b in zip(trained, frozen)) > 50 * LOSS_ATOL
    return trained


# --- the generated DeepSpeed config ------------------------------------------------------

def largest_param() -> int:
    return max(p.numel() for p in build_meta_model(MODEL, WORKLOAD.seq_len).parameters())


def test_offload_config_has_table4_keys_and_shared_hyperparameters():
    opts = zero.resolve_options("zero_offload", {})
    ds = zero.deepspeed_config(make_cfg("zero_offload"), opts, largest_param())
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"],
            ds["gradient_accumulation_steps"]) == (4, 2, 2)
    z = ds["zero_optimization"]
    assert z["stage"] == 3  # Table 4
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    torch_defaults = torch.optim.AdamW([torch.zeros(1)], lr=1e-3).defaults
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 1e-3, "betas": list(torch_defaults["betas"]), "eps": torch_defaults["eps"],
        "weight_decay": torch_defaults["weight_decay"]}}
    assert ds["optimizer"]["params"]["weight_decay"] == 0.01
    # FP32, no activation checkpointing, no clipping (as teraio.workload.step.train_step)
    assert not {"fp16", "bf16", "amp", "activation_checkpointing"} & set(ds)
    assert ds["gradient_clipping"] == 0.0
    json.dumps(ds)  # serialisable as is

    assert z["stage3_param_persistence_threshold"] == 100_000
    assert z["stage3_model_persistence_threshold"] == sys.maxsize
    # Stage 2 keeps the parameters on the device: no offload_param unless asked (an error).
    stage2 = zero.deepspeed_config(make_cfg("zero_offload"), zero.resolve_options(
        "zero_offload", {"stage": 2}), largest_param())["zero_optimization"]
    assert stage2["stage"] == 2 and "offload_param" not in stage2
    assert "stage3_param_persistence_threshold" not in stage2


def test_infinity_config_has_table4_keys(tmp_path):
    opts = zero.resolve_options("zero_infinity", {})
    ds = zero.deepspeed_config(make_cfg("zero_infinity"), opts, largest_param(), nvme_path=str(tmp_path))
    z = ds["zero_optimization"]
    assert z["stage"] == 3
    # buffer_count: Table 4's 4 is too few for DeepSpeed 0.19.8's pipelined swapper (3 x 4).
    assert z["offload_optimizer"] == {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
                                      "buffer_count": 12, "pipeline_read": True, "pipeline_write": True}
    assert z["offload_param"] == {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
                                  "buffer_count": 18, "buffer_size": largest_param()}
    assert z["stage3_param_persistence_threshold"] == 100_000
    assert z["stage3_model_persistence_threshold"] == sys.maxsize
    assert ds["aio"]["intra_op_parallelism"] == 1 and "thread_count" not in ds["aio"]
    assert ds["aio"]["block_size"] == 1 << 20


def test_options_override_and_ds_config_merges():
    opts = zero.resolve_options("zero_infinity", {
        "param_buffer_size": 10**9, "aio": {"intra_op_parallelism": 4},
        "ds_config": {"zero_optimization": {"sub_group_size": 12345}, "wall_clock_breakdown": True}})
    ds = zero.deepspeed_config(make_cfg("zero_infinity"), opts, largest_param(), nvme_path="/x")
    assert ds["zero_optimization"]["offload_param"]["buffer_size"] == 10**9
    assert ds["aio"]["intra_op_parallelism"] == 4 and ds["aio"]["queue_depth"] == 8
    assert ds["zero_optimization"]["sub_group_size"] == 12345
    assert ds["zero_optimization"]["stage"] == 3 and ds["wall_clock_breakdown"] is True
    zero_threshold = zero.resolve_options("zero_infinity", {"model_persistence_threshold": 0})
    assert zero.deepspeed_config(make_cfg("zero_infinity"), zero_threshold, largest_param(), nvme_path="/x")[
        "zero_optimization"]["stage3_model_persistence_threshold"] == 0


@pytest.mark.parametrize("system", zero.ZERO_SYSTEMS)
def test_conf_yaml_mirrors_defaults(system):
    conf = yaml.safe_load((REPO / "conf" / "system" / f"{system}.yaml").read_text())
    assert conf["name"] == system
    assert conf["options"] == zero.DEFAULTS[system]


@pytest.mark.parametrize("system,options,match", [
    ("zero_offload", {"stag": 2}, r"unknown key\(s\) \['stag'\].*valid: .*'stage'"),
    ("zero_offload", {"stage": 1}, r"stage=1.*stage 2 or 3"),
    ("zero_infinity", {"stage": 2}, r"stage=2.*zero_infinity runs ZeRO stage 3"),
    ("zero_offload", {"stage": 2, "offload_param": True}, r"offload_param=true needs stage 3"),
    ("zero_infinity", {"aio": {"thread_count": 4}}, r"thread_count is ignored.*intra_op_parallelism"),
    ("zero_infinity", {"param_buffer_count": 0}, r"param_buffer_count=0; must be a positive int"),
    ("zero_infinity", {"optimizer_buffer_count": 4}, r"optimizer_buffer_count=4; .* needs at least 12"),
    ("zero_infinity", {"optimizer_buffer_count": 7, "pipeline_write": False}, r"needs at least 8"),
    ("zero_infinity", {"ds_config": [1]}, r"ds_config=\[1\]; must be a mapping"),
    ("zero_infinity", {"aio": None}, r"aio=None; must be a mapping"),
    ("zero_offload", {"micro_batch_size": 0}, r"micro_batch_size=0; must be a positive int or null"),
    ("zero_infinity", {"micro_batch_size": True}, r"micro_batch_size=True; must be a positive int"),
    ("zero_offload", {"micro_batch_size": "1"}, r"micro_batch_size='1'; must be a positive int"),
    ("ideal", {}, r"'ideal' is not a ZeRO system"),
])
def test_bad_options_are_named(system, options, match):
    with pytest.raises(ValueError, match=match):
        zero.resolve_options(system, options)


def test_too_small_param_buffer_is_named():
    opts = zero.resolve_options("zero_infinity", {"param_buffer_size": 1000})
    with pytest.raises(ValueError, match=rf"param_buffer_size=1000 .* >= {largest_param()}"):
        zero.deepspeed_config(make_cfg("zero_infinity"), opts, largest_param(), nvme_path="/x")


def test_a_smaller_zero_micro_batch_accumulates_more_of_them():
    # the workload: batch 4 in micro-batches of 2
    ds = zero.deepspeed_config(make_cfg("zero_offload"), zero.resolve_options("zero_offload", {"micro_batch_size": 1}),
                               largest_param())
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 1, 4)
    with pytest.raises(ValueError, match=r"micro_batch_size=3 does not divide workload.batch_size=4"):
        zero.deepspeed_config(make_cfg("zero_offload"), zero.resolve_options("zero_offload", {"micro_batch_size": 3}),
                              largest_param())


def test_batch_not_split_over_ranks_is_named():
    with pytest.raises(ValueError, match=r"batch_size=4 is not a multiple of .* 2 x 3"):
        zero.deepspeed_config(make_cfg("zero_offload"), zero.resolve_options("zero_offload", {}),
                              largest_param(), world_size=3)


def test_missing_swap_dir_fails_before_training(tmp_path):
    cfg = make_cfg("zero_infinity", ssd_dir=tmp_path / "missing")
    result = run_point(cfg, tmp_path / "job", runner=zero.run)
    assert result["status"] == "error"
    assert "swap directory" in result["error"] and "does not exist" in result["error"]
    assert not (tmp_path / "job" / zero.CONFIG_FILE).exists()


def test_a_swap_dir_with_too_little_room_fails_before_training(tmp_path, monkeypatch):
    import shutil

    cfg = make_cfg("zero_infinity", ssd_dir=tmp_path)
    need = zero.swap_bytes_of(cfg)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    result = run_point(cfg, tmp_path / "job", runner=zero.run)
    assert result["status"] == "error"
    assert f"{tmp_path} has {need - 1} B" in result["error"] and f"swap files take {need} B" in result["error"]
    assert not (tmp_path / "job" / zero.CONFIG_FILE).exists()


TINY = ModelConfig(name="llama3_tiny", dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64)


def test_a_two_mib_drive_is_refused_for_a_model_with_no_parameter_large_enough_to_swap(tmp_path, monkeypatch):
    # No parameter of the tiny model reaches 1 MiB, so none is swapped; its one optimizer
    # sub-group (FP32 partition and two AdamW moments, about 2.1 MB each) is: 6.3 MB, more
    # than a 2 MiB drive holds. A bound of swapped parameters alone said 0 B and let it start.
    import shutil

    cfg = make_cfg("zero_infinity", ssd_dir=tmp_path, model=TINY)
    numels = zero.param_numels(cfg)
    assert max(numels) * 4 < 1 << 20
    aligned = -(-sum(numels) // 256) * 256  # 1 KiB of FP32 elements
    assert zero.swap_bytes_of(cfg) == 3 * 4 * aligned
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=2 << 20))
    with pytest.raises(ValueError, match=rf"{tmp_path} has 2097152 B \(2.1 MB\) free; DeepSpeed's swap files "
                                         rf"take {3 * 4 * aligned} B \(6.3 MB\)"):
        zero.check_swap_room(cfg)
    # The sweep asks the same before any point runs.
    from teraio.harness.checks import validate
    with pytest.raises(ValueError, match="swap files take"):
        validate(cfg)
    monkeypatch.setattr(shutil, "disk_usage", real)
    validate(cfg)


def test_swap_sizing_follows_deepspeeds_partitions_sub_groups_and_alignment():
    ds = {"aio": {"block_size": 1 << 20, "intra_op_parallelism": 2}, "zero_optimization": {"sub_group_size": 600_000}}
    big, small = 300_001, 1000  # 1.2 MB and 4 kB of FP32
    a = 512  # alignment: 1024 B x 2 threads, in FP32 elements
    up = lambda n: -(-n // a) * a  # noqa: E731
    # one rank: the big parameter is swapped (rounded up to the alignment), the small one not;
    # sub-groups [big, big] (600,002 >= 600,000) and [small, big]: each swapped 3 times over,
    # and each big gradient's aligned part once
    one = 4 * (3 * up(big) + 3 * up(2 * big) + 3 * up(small + big) + 3 * (big // a * a))
    assert zero.swap_bytes_needed([big, big, small, big], ds) == one
    # two ranks: each holds half a parameter (300,001 -> 150,001: under 1 MiB, not swapped)
    # in one sub-group of 301,002 elements; both on this host write their own files
    half = 150_001
    assert zero.swap_bytes_needed([big, big], ds, world=2, local_world=2) == 2 * 4 * 3 * up(2 * half)


# --- training with DeepSpeed on CPU (gloo) ----------------------------------------------

def check_row(result: dict, job_dir: Path, reference: list[float]) -> None:
    assert result["status"] == "ok", result["error"]
    its = result["iterations"]
    assert [i["step"] for i in its] == [1, 2, 3]
    for i in its:
        assert i["tokens"] == WORKLOAD.tokens_per_step and i["seconds"] > 0
        assert math.isclose(i["tokens_per_s"], i["tokens"] / i["seconds"])
        assert math.isfinite(i["loss"])
        assert i["stall_count"] is None and i["migration_seconds"] is None
    assert result["tokens_per_s"] > 0 and result["stall_count"] is None
    assert result["ssd_io_mode"] is None
    assert result["artifacts"]["deepspeed_config"] == zero.CONFIG_FILE
    written = json.loads((job_dir / zero.CONFIG_FILE).read_text())
    assert written["zero_optimization"]["stage"] == result["config"]["system"]["options"].get(
        "stage", zero.DEFAULTS[result["point"]["system"]]["stage"])
    assert result["losses"] == pytest.approx(reference, abs=LOSS_ATOL)
    write_result(job_dir / "result.json", result)  # the row serialises


@pytest.mark.parametrize("options", [{"stage": 2}, {"stage": 3}, {"stage": 3, "micro_batch_size": 1}])
def test_zero_offload_follows_plain_torch(tmp_path, reference, options):
    cfg = make_cfg("zero_offload", options)
    result = run_point(cfg, tmp_path, runner=zero.run)
    check_row(result, tmp_path, reference)  # the losses: the mean over micro-batches of either size
    mb = options.get("micro_batch_size", WORKLOAD.micro_batch_size)
    assert result["zero_micro_batch_size"] == mb
    assert json.loads((tmp_path / zero.CONFIG_FILE).read_text())["gradient_accumulation_steps"] == \
        WORKLOAD.batch_size // mb


def test_a_cap_on_a_cpu_is_marked_not_enforced_in_the_row(tmp_path):
    # Nothing holds a CPU run to the CUDA allocator's cap: a 4 KB "GPU" trains as well as any.
    cfg = make_cfg("zero_offload", {"stage": 2})
    cfg.hardware = dataclasses.replace(cfg.hardware, gpu_capacity_bytes=4096)
    result = run_point(cfg, tmp_path, runner=zero.run)
    assert result["status"] == "ok", result["error"]
    assert result["capacity_bytes"] == 4096 and result["capacity_enforced"] is False


def test_zero_infinity_swaps_to_nvme_and_follows_plain_torch(tmp_path, reference, monkeypatch):
    import deepspeed
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    seen: list[set[str]] = []
    swapped: list[int] = []
    step = deepspeed.DeepSpeedEngine.step

    def step_and_look(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        seen.append({str(p.relative_to(ssd)) for p in ssd.rglob("*.swp")})
        swapped.append(sum(p.stat().st_size for p in ssd.rglob("*.swp")))
        return out

    monkeypatch.setattr(deepspeed.DeepSpeedEngine, "step", step_and_look)
    job = tmp_path / "job"
    # Several optimizer sub-groups, so that the pipelined swapper reads ahead and writes
    # behind (with Table 4's 4 buffers it ran out here and on the H200).
    options = {"ds_config": {"zero_optimization": {"sub_group_size": 500_000}}}
    cfg = make_cfg("zero_infinity", options, ssd_dir=ssd)
    result = run_point(cfg, job, runner=zero.run)
    check_row(result, job, reference)
    assert len(seen) == 8  # 4 iterations x 2 micro-batches
    files = seen[-1]
    params = {f for f in files if "/zero_stage_3/float32params/rank0/" in f}
    optimizer = {f for f in files if "/zero_stage_3/optimizer/rank0/" in f}
    # every parameter of >= 1 MiB: tok_embeddings, output, wq, wk, wv, wo, w1, w2, w3
    assert len(params) == 9, sorted(files)
    assert optimizer, sorted(files)
    swap_dirs = {f.split("/")[0] for f in files}  # one, named after the process and the job
    assert len(swap_dirs) == 1 and re.fullmatch(r"zero-.+-job-\d+", next(iter(swap_dirs))), swap_dirs
    assert not any(ssd.iterdir())  # the run's swap directory is removed afterwards
    swap = json.loads((job / zero.CONFIG_FILE).read_text())["zero_optimization"]
    assert Path(swap["offload_param"]["nvme_path"]) == ssd / next(iter(swap_dirs))
    # what the check before DeepSpeed starts asks of the drive is what DeepSpeed swapped
    assert max(swapped) == zero.swap_bytes_of(cfg)


def test_a_param_buffer_count_deepspeed_would_assert_on_is_refused_before_it_starts(tmp_path):
    # tiny512 swaps 9 parameters and has far fewer elements than stage3_max_reuse_distance
    # (1e9): DeepSpeed keeps all 9 live through the step, one buffer each.
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg = make_cfg("zero_infinity", {"param_buffer_count": 8}, ssd_dir=ssd)
    result = run_point(cfg, tmp_path / "job", runner=zero.run)
    assert result["status"] == "error"
    assert "system.options.param_buffer_count=8; DeepSpeed's parameter swapper needs at least 9" in result["error"]
    assert not (tmp_path / "job" / zero.CONFIG_FILE).exists() and not any(ssd.iterdir())
    zero.check_param_buffers(cfg, zero.resolve_options("zero_infinity", {"param_buffer_count": 9}))
    # Released after each use (reuse distance 0): a module's own swapped parameters, one here.
    zero.check_param_buffers(cfg, zero.resolve_options("zero_infinity", {
        "param_buffer_count": 1, "ds_config": {"zero_optimization": {"stage3_max_reuse_distance": 0}}}))
    with pytest.raises(ValueError, match=r"param_buffer_count=8; .* at least 9"):
        zero.check_param_buffers(cfg, zero.resolve_options("zero_infinity", {"param_buffer_count": 8}))


def test_zero_infinity_with_parameter_prefetch_trains_as_without_it(tmp_path, reference):
    losses = {}
    for prefetch in (0, None):  # off; on (DeepSpeed's 5e7 elements, the default)
        ssd = tmp_path / f"ssd{prefetch}"
        ssd.mkdir()
        job = tmp_path / f"job{prefetch}"
        result = run_point(make_cfg("zero_infinity", {"prefetch_bucket_size": prefetch}, ssd_dir=ssd), job,
                           runner=zero.run)
        check_row(result, job, reference)
        zero_cfg = json.loads((job / zero.CONFIG_FILE).read_text())["zero_optimization"]
        assert zero_cfg.get("stage3_prefetch_bucket_size") == prefetch
        losses[prefetch] = result["losses"]
    assert losses[None] == pytest.approx(losses[0], abs=1e-6)


# --- on a CUDA GPU (nccl) ----------------------------------------------------------------

def gpu_cfg(system: str, options: dict, ssd: Path, capacity: int | None = None) -> RunConfig:
    cfg = make_cfg(system, options, ssd)
    cfg.hardware = HardwareConfig(device="cuda", ssd_dirs=[str(ssd)], gpu_capacity_bytes=capacity)
    return cfg


@pytest.mark.gpu
def test_zero_infinity_on_gpu_under_capacity(tmp_path, reference):
    # Stage 3 builds on the host (as the CPU reference does) and computes on the GPU.
    # DeepSpeed's default reduce bucket (5e8 elements: 2 GB in FP32) alone would exceed
    # this capacity: the run shrinks it through ds_config.
    capacity = 1 << 30
    job = tmp_path / "job"
    options = {"ds_config": {"zero_optimization": {"reduce_bucket_size": 10**7}}}
    result = run_point(gpu_cfg("zero_infinity", options, tmp_path, capacity), job, runner=zero.run)
    check_row(result, job, reference)
    assert result["capacity_bytes"] == capacity
    assert 0 < result["peak_allocated_bytes"] <= capacity


@pytest.mark.gpu
def test_zero_offload_on_gpu_follows_plain_torch(tmp_path):
    # Stage 2 builds the model on the GPU as Ideal does: same initial weights as torch there.
    w = WORKLOAD
    model = build_model(MODEL, w.seq_len, "cuda", seed=0)
    optimizer = make_optimizer(model, w.lr)
    expected = [train_step(model, optimizer, *make_batch(s, w, MODEL.vocab_size, 0, "cuda"),
                           w.micro_batch_size) for s in range(w.warmup_steps + w.measure_steps)]
    del model, optimizer
    torch.cuda.empty_cache()
    result = run_point(gpu_cfg("zero_offload", {"stage": 2}, tmp_path), tmp_path, runner=zero.run)
    check_row(result, tmp_path, expected)
    assert result["peak_allocated_bytes"] > 0 and result["gpu_name"]


def _rank_main(rank: int, port: int, out: str) -> None:
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = run_point(make_cfg("zero_offload", {"stage": 2}), Path(out) / f"rank{rank}",
                       runner=zero.run)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_zero_offload_two_ranks_follow_plain_torch(tmp_path, reference):
    # Data parallel over 2 gloo ranks, 1 micro-batch each per step: DeepSpeed averages the
    # gradients over ranks, which is the shared step's mean over micro-batches.
    torch.multiprocessing.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["status"] == "ok", result["error"]
        assert result["losses"] == pytest.approx(reference, abs=LOSS_ATOL)
    ds = json.loads((tmp_path / "rank0" / zero.CONFIG_FILE).read_text())
    assert ds["gradient_accumulation_steps"] == 1 and ds["train_batch_size"] == 4


@pytest.mark.parametrize("stage", [2, 3])
def test_the_emulated_capacity_binds_before_the_model_is_built(tmp_path, monkeypatch, stage):
    calls = cap_then_build(monkeypatch, zero)
    cfg = make_cfg("zero_offload", {"stage": stage})
    cfg.hardware.gpu_capacity_bytes, cfg.hardware.capacity_mode = 1 << 30, "reserve"
    with pytest.raises(ModelBuilt):
        zero.run(cfg, tmp_path / "job", torch.device("cpu"))
    assert calls == [("cap", 1 << 30, "reserve"), "build"]  # the config's mode
