"""A 2-stage 1F1B pipeline (``teraio.workload.pipeline``) on the CPU over gloo: the same losses and
final parameters, bit for bit, as the un-pipelined step on the same model and tokens; and
so under TeraIO too, each stage profiled, planned at half its own un-offloaded peak and
migrated by its own engine (paper §4.1: one plan per GPU)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import open_tiers

from teraio.config import ModelConfig, WorkloadConfig
from teraio.core.engine import MigrationEngine
from teraio.workload.models import build_model
from teraio.workload.pipeline import StageStep, split_model, stage_layers
from teraio.core.bandwidth import TierBandwidth
from teraio.core.planner import plan_migrations
from teraio.core.profiler import persistent_tensors, profile_step
from teraio.workload.step import make_batch, make_optimizer, train_step

MODEL = dict(name="tiny4", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256)
WORK = dict(batch_size=8, micro_batch_size=2, seq_len=32, warmup_steps=2, measure_steps=2)
SEED = 3


def _digests(named: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's bytes as hex (bit-exact comparison across processes)."""
    return {k: v.detach().contiguous().view(torch.uint8).numpy().tobytes().hex() for k, v in named.items()}


def _unpipelined(model_cfg: ModelConfig, w: WorkloadConfig) -> tuple[list[float], dict[str, str]]:
    torch.set_num_threads(1)
    model = build_model(model_cfg, w.seq_len, "cpu", SEED)
    opt = make_optimizer(model, w.lr)
    losses = [train_step(model, opt, *make_batch(s, w, model_cfg.vocab_size, SEED, "cpu"), w.micro_batch_size)
              for s in range(w.warmup_steps + w.measure_steps)]
    return losses, _digests(dict(model.named_parameters()))


# TeraIO per stage: "mixed" makes the SSD slow so that host memory wins windows.
TIERS = {"ssd": (TierBandwidth.uniform(50.0), 0),
         "mixed": (TierBandwidth(0.5, 0.5, 50.0, 50.0), 1 << 28)}


def _stage_main(rank: int, port: int, out: str, n_stages: int, teraio: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n_stages)
    cpu = torch.device("cpu")
    try:
        model_cfg, w = ModelConfig(**MODEL), WorkloadConfig(**WORK)
        module = split_model(build_model(model_cfg, w.seq_len, "cpu", SEED), n_stages, rank)
        opt = make_optimizer(module, w.lr)
        step = StageStep(module, opt, rank, n_stages, w.batch_size // w.micro_batch_size, cpu)

        def step_fn(s: int):
            return lambda: step(*make_batch(s, w, model_cfg.vocab_size, SEED, "cpu"))

        report = {}
        if teraio is None:
            losses = [step_fn(s)() for s in range(w.warmup_steps + w.measure_steps)]
        else:  # step 0 makes AdamW's state, step 1 is profiled, then the stage's own plan runs
            losses = [step_fn(0)()]
            loss, trace = profile_step(step_fn(1), module, opt, cpu)
            losses.append(loss)
            bandwidths, host_cap = TIERS[teraio]
            capacity = trace.peak_bytes() // 2
            plan = plan_migrations(trace, capacity, bandwidths, host_cap_bytes=host_cap, min_tensor_bytes=1024)
            tier_root = Path(out, f"tiers{rank}")
            tier_root.mkdir()
            engine = MigrationEngine(trace, plan, persistent_tensors(module, opt), open_tiers(plan, tier_root), cpu)
            engine.prime()
            losses += [engine.run_step(step_fn(s), s) for s in range(2, w.warmup_steps + w.measure_steps)]
            engine.close()
            report = {"capacity": capacity, "predicted_peak": plan.predicted_peak_bytes,
                      "bytes_per_tier": plan.bytes_per_tier(),
                      "transfers": sum(1 for t in engine.transfers if t["step"] >= 2)}
        Path(out, f"stage{rank}.json").write_text(json.dumps(
            {"losses": losses, "params": _digests(dict(module.named_parameters())), **report}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def unpipelined():
    model_cfg, w = ModelConfig(**MODEL), WorkloadConfig(**WORK)
    assert w.batch_size // w.micro_batch_size == 4
    return _unpipelined(model_cfg, w)


def _run_stages(tmp_path, teraio: str | None) -> list[dict]:
    torch.multiprocessing.spawn(_stage_main, args=(_free_port(), str(tmp_path), 2, teraio), nprocs=2)
    return [json.loads((tmp_path / f"stage{r}.json").read_text()) for r in (0, 1)]


def test_two_stage_1f1b_equals_the_unpipelined_step_bit_for_bit(tmp_path, unpipelined):
    losses, params = unpipelined
    stages = _run_stages(tmp_path, None)
    for s in stages:
        assert s["losses"] == losses  # exact floats, every stage
    # Stage 0: the embedding and blocks 0-1; stage 1: blocks 2-3, the norm and the output.
    assert set(stages[0]["params"]) == {k for k in params if k.startswith(("tok_embeddings.", "layers.0.",
                                                                            "layers.1."))}
    assert set(stages[0]["params"]) | set(stages[1]["params"]) == set(params)
    for s in stages:
        for k, v in s["params"].items():
            assert v == params[k], k
    assert losses[0] != losses[-1]  # it trained


@pytest.mark.parametrize("teraio", ["ssd", "mixed"])
def test_each_stage_under_teraio_at_half_its_peak_stays_bit_identical(tmp_path, unpipelined, teraio):
    losses, params = unpipelined
    for s in _run_stages(tmp_path, teraio):
        assert s["losses"] == losses
        assert all(v == params[k] for k, v in s["params"].items())
        assert s["predicted_peak"] <= s["capacity"]
        assert s["transfers"] > 0
        assert (s["bytes_per_tier"]["host"] > 0) == (teraio == "mixed")


@pytest.mark.parametrize("n_layers,n_stages,expected", [
    (4, 2, [range(0, 2), range(2, 4)]), (5, 2, [range(0, 3), range(3, 5)]), (3, 3, [range(0, 1), range(1, 2), range(2, 3)]),
])
def test_stage_layers_cover_the_blocks_once_in_order(n_layers, n_stages, expected):
    assert [stage_layers(n_layers, n_stages, s) for s in range(n_stages)] == expected


@pytest.mark.parametrize("n_layers,n_stages,stage,match", [
    (1, 2, 0, "pipeline_stages=2: needs 1 <= stages <= the model's 1 layers"),
    (4, 2, 2, "stage 2: valid stages are 0..1"),
])
def test_bad_splits_are_refused_by_value(n_layers, n_stages, stage, match):
    with pytest.raises(ValueError, match=match):
        stage_layers(n_layers, n_stages, stage)


def test_tied_embeddings_cannot_be_split():
    cfg = ModelConfig(**{**MODEL, "tie_embeddings": True})
    with pytest.raises(ValueError, match="tied input/output embeddings"):
        split_model(build_model(cfg, 32, "cpu", SEED), 2, 0)


# --- pipelined points through the sweep --------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def _sweep(runs: Path, *overrides: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",  # as torchrun's ranks: the same CPU kernels
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-m", "teraio.sweep", "+experiment=smoke", "trial=0",
                        "workload.measure_steps=2", f"sweep.runs_dir={runs}", "sweep.analyze=false",
                        "sweep.make_ssd_dirs=true", *overrides],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr


def test_pipelined_points_of_ideal_and_teraio_train_as_the_unpipelined_step(tmp_path):
    runs, capacity = tmp_path / "runs", 3_600_000  # about half of each stage's un-offloaded peak
    _sweep(runs, "system=ideal")
    _sweep(runs, "system=ideal,teraio_ssd,teraio_mixed", "workload.pipeline_stages=2",
           f"hardware.gpu_capacity_bytes={capacity}")
    point = runs / "smoke" / "llama3_tiny-{}-cpu_ci-bs4-mb2-seq64{}-t0"
    plain = json.loads((Path(str(point).format("ideal", "")) / "result.json").read_text())
    digests = set()
    for system in ("ideal", "teraio_ssd", "teraio_mixed"):
        job = Path(str(point).format(system, "-pp2"))
        row = json.loads((job / "result.json").read_text())
        assert row["status"] == "ok", row["error"]
        assert row["losses"] == plain["losses"]  # bit for bit: one model, two stages
        assert [s["stage"] for s in row["stages"]] == [0, 1]
        if system == "ideal":
            continue
        for s in row["stages"]:
            assert s["plan"]["capacity_bytes"] == capacity and s["plan"]["shortfall_bytes"] == 0
            assert s["memory_pressure"] > 1.5 and s["plan"]["migrations"] > 0
            assert all((job / path).is_file() for path in s["artifacts"].values())
            assert s["artifacts"]["trace"] == f"stage{s['stage']}/trace.json"
        digests.add(row["final_params_sha256"])
    assert len(digests) == 1  # TeraIO-SSD and TeraIO-Mixed end with the same parameters


@pytest.mark.parametrize("system,workload,match", [
    ("zero_offload", {}, r"zero_offload does not train in pipeline stages; systems that do: "
                         r"\['teraio_ssd', 'teraio_mixed', 'ideal'\]"),
    ("ideal", {"pipeline_stages": 3}, "needs at least 3 micro-batches per step; batch_size=4 / micro_batch_size=2 gives 2"),
    ("ideal", {"pipeline_stages": 0}, r"workload.pipeline_stages=0; valid: an integer >= 1"),
])
def test_a_point_that_cannot_be_pipelined_is_refused_before_it_runs(system, workload, match):
    from teraio.config import run_config_from_dict
    from teraio.harness.checks import validate
    with pytest.raises(ValueError, match=match):
        run = run_config_from_dict({"model": MODEL, "system": {"name": system},
                                    "workload": {"batch_size": 4, "micro_batch_size": 2, "seq_len": 32,
                                                 "pipeline_stages": 2, **workload}})
        validate(run, check_device=False)
