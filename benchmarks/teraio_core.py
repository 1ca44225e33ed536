"""Llama3-8B on one GPU, Ideal (uncapped) vs TeraIO-Mixed and
TeraIO-SSD under an emulated capacity, plus the engine's per-op dispatch overhead.

Each system runs as its own worker process (``python -m teraio.harness.run``), as in the sweep, so
one run's GPU memory never affects the next; all run in the same call on the same machine,
so they can be compared as ratios.

    python benchmarks/teraio_core.py --out DIR [--systems ideal,teraio_mixed,teraio_ssd]
        [--capacity-gib 70] [--host-cap-gib 96] [--batch 4] [--ssd-dir /tmp/teraio_ssd]

Writes ``DIR/teraio_core.json`` (summary) and one job dir per system with its result.json,
trace, plan and logs.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from the repo root

GiB = 1 << 30
LLAMA3_8B = {"name": "llama3_8b", "family": "llama3", "dim": 4096, "n_layers": 32, "n_heads": 32,
             "n_kv_heads": 8, "vocab_size": 128256, "multiple_of": 1024, "ffn_dim_multiplier": 1.3,
             "rope_theta": 500000.0}


def run_config(system: str, args) -> dict:
    capped = system != "ideal"
    return {
        "model": dict(LLAMA3_8B, n_layers=args.layers, name="llama3_8b" if args.layers == 32 else f"llama3_8b_{args.layers}l"),
        "workload": {"batch_size": args.batch, "micro_batch_size": 1, "seq_len": args.seq,
                     "warmup_steps": args.warmup, "measure_steps": args.measure, "lr": 1e-4},
        "system": {"name": system, "options": {}},
        "hardware": {"name": "h200", "device": "cuda", "n_gpus": 1,
                     "gpu_capacity_bytes": int(args.capacity_gib * GiB) if capped else None,
                     "ssd_dirs": [args.ssd_dir], "ssd_write_gbps": args.ssd_write_gbps,
                     "ssd_read_gbps": args.ssd_read_gbps,
                     "host_mem_cap_bytes": int(args.host_cap_gib * GiB), "host_d2h_gbps": 37.0,
                     "host_h2d_gbps": 55.0, "prices": {}},
        "trial": 0, "seed": 0, "timeout_s": args.timeout,
    }


def run_worker(job_dir: Path, cfg: dict, timeout: float) -> dict:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "resolved.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "teraio.harness.run", str(job_dir / "resolved.yaml")]
    t0 = time.perf_counter()
    with open(job_dir / "worker.log", "w") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "wall_seconds": time.perf_counter() - t0}
    try:
        return json.loads((job_dir / "result.json").read_text())
    except OSError:
        return {"status": "error", "error": (job_dir / "worker.log").read_text()[-4000:]}


def overhead(args) -> dict:
    """Per-op dispatch overhead: plain steps vs the same steps under a MigrationEngine with an
    empty plan (every op still goes through the engine's dispatch path)."""
    import torch

    from teraio.config import ModelConfig, WorkloadConfig
    from teraio.core.engine import MigrationEngine
    from teraio.systems.measure import timed
    from teraio.workload.models import build_model
    from teraio.core.plan import MigrationPlan
    from teraio.core.profiler import persistent_tensors, profile_step
    from teraio.workload.step import make_batch, make_optimizer, train_step

    dev = torch.device("cuda")
    mc = ModelConfig(**LLAMA3_8B) if args.layers == 32 else ModelConfig(**dict(LLAMA3_8B, n_layers=args.layers))
    w = WorkloadConfig(batch_size=1, micro_batch_size=1, seq_len=args.seq)
    model = build_model(mc, w.seq_len, dev)
    opt = make_optimizer(model, 1e-4)

    def fn(s):
        x, y = make_batch(s, w, mc.vocab_size, 0, dev)
        return lambda: train_step(model, opt, x, y, 1)

    fn(0)()
    _, trace = profile_step(fn(1), model, opt, dev)
    empty = MigrationPlan(trace.n_ops, trace.peak_bytes(), trace.peak_bytes(), trace.peak_bytes(), [])
    eng = MigrationEngine(trace, empty, persistent_tensors(model, opt), {}, dev)
    plain, engine = [], []
    for s in range(2, 2 + 2 * args.overhead_steps, 2):
        with timed(dev) as t:
            fn(s)()
        plain.append(t["seconds"])
        with timed(dev) as t:
            eng.run_step(fn(s + 1), s + 1)
        engine.append(t["seconds"])
    eng.close()
    p, e = min(plain), min(engine)
    return {"n_ops": trace.n_ops, "plain_step_seconds": plain, "engine_step_seconds": engine,
            "overhead_fraction": (e - p) / p}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--systems", default="ideal,teraio_mixed,teraio_ssd")
    ap.add_argument("--capacity-gib", type=float, default=70.0)
    ap.add_argument("--host-cap-gib", type=float, default=96.0)
    ap.add_argument("--ssd-dir", default="/tmp/teraio_ssd")
    ap.add_argument("--ssd-write-gbps", type=float, default=2.0)
    ap.add_argument("--ssd-read-gbps", type=float, default=1.6)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--measure", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--overhead-steps", type=int, default=0, help="0: skip the overhead measurement")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    Path(args.ssd_dir).mkdir(parents=True, exist_ok=True)
    summary = {"command": " ".join(shlex.quote(a) for a in sys.argv), "systems": {}}
    for system in args.systems.split(","):
        r = run_worker(args.out / system, run_config(system, args), args.timeout)
        keep = ("status", "error", "tokens_per_s", "stall_count", "stall_seconds", "bytes_per_tier",
                "peak_allocated_bytes", "peak_reserved_bytes", "capacity_bytes", "unoffloaded_peak_bytes",
                "memory_pressure", "plan_compile_seconds", "profile_seconds", "ssd_io_mode", "gpu_name",
                "losses", "plan", "wall_seconds")
        summary["systems"][system] = {k: r.get(k) for k in keep}
        summary["systems"][system]["iterations"] = r.get("iterations")
        print(system, r.get("status"), r.get("tokens_per_s"), flush=True)
        (args.out / "teraio_core.json").write_text(json.dumps(summary, indent=1))
    if args.overhead_steps:  # last, in this process: the workers have released the GPU
        summary["dispatch_overhead"] = overhead(args)
        (args.out / "teraio_core.json").write_text(json.dumps(summary, indent=1))
    ideal = summary["systems"].get("ideal", {})

    def step_losses(r):
        return {i["step"]: i["loss"] for i in r.get("iterations") or []}

    for s in summary["systems"].values():
        s["ratio_to_ideal"] = (s["tokens_per_s"] / ideal["tokens_per_s"]
                               if ideal.get("tokens_per_s") and s.get("tokens_per_s") else None)
        mine, ref = step_losses(s), step_losses(ideal)
        s["same_losses_as_ideal"] = (mine == ref) if mine and ref else None
    (args.out / "teraio_core.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: {kk: v.get(kk) for kk in ("status", "tokens_per_s", "ratio_to_ideal", "stall_count",
                                                   "stall_seconds", "same_losses_as_ideal")}
                      for k, v in summary["systems"].items()}, indent=1))


if __name__ == "__main__":
    main()
