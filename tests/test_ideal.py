"""The Ideal baseline: the shared step, unmodified, with a valid row."""
from __future__ import annotations

import math

import torch

from baselines import ideal
from teraio.config import run_config_from_dict
from teraio.models import build_model
from teraio.result import empty_result
from teraio.step import make_batch, make_optimizer, train_step

TINY = {"name": "llama3_tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "vocab_size": 256, "multiple_of": 32}


def test_ideal_row_and_losses_equal_the_shared_step(tmp_path):
    cfg = run_config_from_dict({
        "model": TINY, "system": {"name": "ideal"}, "seed": 3,
        "workload": {"batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "warmup_steps": 2,
                     "measure_steps": 3},
        "hardware": {"gpu_capacity_bytes": 1 << 20}})
    result = empty_result(cfg.point(), cfg.to_dict())
    ideal.run(cfg, tmp_path, result, torch.device("cpu"))

    its = result["iterations"]
    assert [i["step"] for i in its] == [2, 3, 4]
    for i in its:
        assert math.isfinite(i["loss"]) and i["seconds"] > 0 and i["tokens"] == 4 * 16
        assert i["tokens_per_s"] == i["tokens"] / i["seconds"]
        assert (i["stall_count"], i["stall_seconds"], i["migration_seconds"]) == (0, 0.0, 0.0)
        assert i["bytes_offloaded"] == {"ssd": 0, "host": 0} == i["bytes_prefetched"]
    assert result["capacity_bytes"] is None  # Ideal runs uncapped
    assert result["peak_allocated_bytes"] is None  # no device peak on a CPU

    torch.manual_seed(123)  # the runner must not depend on global RNG state
    model = build_model(cfg.model, 16, "cpu", seed=3)
    opt = make_optimizer(model, cfg.workload.lr)
    expected = [train_step(model, opt, *make_batch(s, cfg.workload, 256, 3, "cpu"), 2) for s in range(5)]
    assert result["losses"] == expected
    assert [i["loss"] for i in its] == expected[2:]


def test_ideal_refuses_options(tmp_path):
    cfg = run_config_from_dict({"model": TINY, "system": {"name": "ideal", "options": {"x": 1}}})
    result = empty_result(cfg.point(), cfg.to_dict())
    try:
        ideal.run(cfg, tmp_path, result, torch.device("cpu"))
    except ValueError as e:
        assert "ideal takes no options" in str(e)
    else:
        raise AssertionError("ideal accepted options")
