"""Does TeraIO's plan fit the GPU test's cap when the trace comes from the CPU?

The GPU bit-identity test (``tests/test_teraio_train.py``, ``GPU_MODEL``, then 50 % of
the un-offloaded peak, ``GPU_OPTIONS`` headroom; both in ``tests/conftest.py``) got a plan
that did not fit on the H200 (``benchmarks/results/raw_gpu_calls/h200_b/COMMANDS.md``,
call 4). This probe profiles the same
model on the CPU. It sets every op to ``--op-us`` microseconds, as short as a GPU's ops,
so that bandwidth hides almost nothing. Then it plans both test systems at ``--fraction``
of the un-offloaded peak, as the test does (``allow_stalls``, the test's headroom and
minimum tensor size).

    python -m benchmarks.gpu_test_plan_fit [--fraction 0.5] [--op-us 5] [--out FILE.json]

Prints, and writes to ``--out``, per system: un-offloaded peak, plan capacity, predicted
peak and shortfall, in bytes.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from teraio.core.planner import plan_migrations
from teraio.core.profiler import profile_step
from teraio.trainer.machine import tier_bandwidth
from teraio.workload.models import build_model
from teraio.workload.step import make_batch, make_optimizer, train_step
from tests.conftest import GPU_MODEL, GPU_OPTIONS, config

SYSTEMS = {"teraio_ssd": {}, "teraio_mixed": {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fraction", type=float, default=0.5, help="capacity, of the un-offloaded peak")
    ap.add_argument("--op-us", type=float, default=5.0, help="every op's time, microseconds")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ssd = Path(tempfile.mkdtemp())
    cfg = config("teraio_ssd", ssd, None, model=GPU_MODEL, options=GPU_OPTIONS)
    w, cpu = cfg.workload, torch.device("cpu")
    model = build_model(cfg.model, w.seq_len, cpu, cfg.seed)
    optimizer = make_optimizer(model, w.lr)

    def step_fn(step):  # as teraio.trainer.runner.run: step 0 creates the optimizer state, step 1 is profiled
        inputs, labels = make_batch(step, w, cfg.model.vocab_size, cfg.seed, cpu)
        return lambda: train_step(model, optimizer, inputs, labels, w.micro_batch_size)

    step_fn(0)()
    _, trace = profile_step(step_fn(1), model, optimizer, cpu)
    trace.op_seconds = np.full(trace.n_ops, args.op_us * 1e-6)
    capacity = int(trace.peak_bytes() * args.fraction)
    plan_capacity = int(capacity * (1 - GPU_OPTIONS["headroom_fraction"]))
    rows = {}
    for system, hw in SYSTEMS.items():
        cfg = config(system, ssd, capacity, model=GPU_MODEL, options=GPU_OPTIONS, **hw)
        host_cap = cfg.hardware.host_mem_cap_bytes if system == "teraio_mixed" else 0
        plan = plan_migrations(trace, plan_capacity, tier_bandwidth(cfg), host_cap_bytes=host_cap,
                               min_tensor_bytes=cfg.system.options["min_tensor_bytes"], allow_stalls=True)
        rows[system] = {"unoffloaded_peak_bytes": trace.peak_bytes(), "plan_capacity_bytes": plan_capacity,
                        "predicted_peak_bytes": plan.predicted_peak_bytes,
                        "shortfall_bytes": plan.meta["shortfall_bytes"], "n_exposed": plan.meta["n_exposed"]}
    out = {"model": GPU_MODEL, "options": GPU_OPTIONS, "fraction": args.fraction, "op_us": args.op_us,
           "systems": rows}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
