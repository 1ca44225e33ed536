"""Profile a reduced-depth model, synthesize the full-depth trace, time the planner on it
(Llama3-70B cannot run on one GPU, its 2-layer cut can; camera-ready Table 1).

On a GPU machine (Llama3-70B widths, 2 of its 80 layers, bs1 seq2048: ~61 GB of weights,
gradients and AdamW state in FP32, fits one H200):

    python -m benchmarks.profile_reduced --model llama3_70b --layers 2 --target-layers 80 \
        --seq-len 2048 --device cuda --paper-m 940.85 --host-cap-gb 770 \
        --out-dir benchmarks/results/h200_llama3_70b_2l

Checking the identical-layers assumption against a real full-depth trace (Llama3-8B,
2 -> 32 layers, against the trace measured on an H200 at the same workload):

    python -m benchmarks.profile_reduced --model llama3_8b --layers 2 --target-layers 32 \
        --seq-len 2048 --device cuda \
        --compare-trace benchmarks/results/h200x2_llama3_8b_70gib/teraio_mixed_trace.json.gz \
        --out-dir benchmarks/results/h200_llama3_8b_2l

``--compare-real`` profiles the full-depth model too (small models, or any that fit), and
``--set KEY=VALUE`` overrides model fields (tests run a tiny model on the CPU this way).

Writes to ``--out-dir``: ``trace_<L>l.json.gz`` (the profile), ``trace_synth<L2>l.json.gz``
(synthesized), ``summary.json`` (command, device, traces, the comparison), and with
``--paper-m`` the plan compile time as an entry of ``plan_compile.json``
(``benchmarks.plan_compile``'s format). The training step is the one every system
shares (``teraio.workload.step``), profiled after one ordinary step as ``teraio.trainer.runner`` does.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import yaml

from benchmarks.plan_compile import machine, time_plan, write_entry
from benchmarks import command
from teraio.config import ModelConfig, WorkloadConfig, dataclass_from_dict
from teraio.core.profiler import profile_step
from teraio.core.trace import Trace
from teraio.perf.synth import synthesize_layers
from teraio.workload.models import build_model
from teraio.workload.step import make_batch, make_optimizer, train_step

REPO = Path(__file__).resolve().parents[1]


def model_config(name: str, n_layers: int, overrides: list[str]) -> ModelConfig:
    """``conf/model/<name>.yaml`` with ``n_layers`` layers and ``KEY=VALUE`` overrides
    (values parsed as YAML).

    Raises:
        ValueError: no such model file, one that inherits (``defaults``: use its base), a
            malformed override or an unknown key.
    """
    path = REPO / "conf" / "model" / f"{name}.yaml"
    if not path.is_file():
        valid = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"--model {name}: no {path}; valid: {valid}")
    d = yaml.safe_load(path.read_text())
    if "defaults" in d:
        raise ValueError(f"--model {name} inherits from another model file; give its base model "
                         "and --layers instead")
    for kv in overrides:
        key, sep, value = kv.partition("=")
        if not sep:
            raise ValueError(f"--set {kv!r}: expected KEY=VALUE, e.g. dim=64")
        d[key] = yaml.safe_load(value)
    d["n_layers"] = n_layers
    return dataclass_from_dict(ModelConfig, d, f"model {name}")


def profile(cfg: ModelConfig, workload: WorkloadConfig, device: torch.device, seed: int = 0) -> tuple[Trace, float]:
    """One ordinary step, then the profiled step. Returns (trace, profiling wall seconds)."""
    model = build_model(cfg, workload.seq_len, device, seed)
    optimizer = make_optimizer(model, workload.lr)

    def step(i: int):
        inputs, labels = make_batch(i, workload, cfg.vocab_size, seed, device)
        return lambda: train_step(model, optimizer, inputs, labels, workload.micro_batch_size)  # noqa: F821

    step(0)()
    t0 = time.perf_counter()
    _, trace = profile_step(step(1), model, optimizer, device, meta={
        "model": cfg.name, "n_layers": cfg.n_layers, "batch_size": workload.batch_size,
        "micro_batch_size": workload.micro_batch_size, "seq_len": workload.seq_len})
    seconds = time.perf_counter() - t0
    del model, optimizer  # the closure's too: free the GPU before the caller profiles again
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return trace, seconds


def compare(syn: Trace, real: Trace) -> dict:
    """The synthesized trace against a real one of the same depth: op count and names
    (should be exact), peak bytes and total kernel time (target: within 5 %).
    A synthesized trace has no allocator peaks (``op_allocated_bytes``), so its peak is
    the tensor-lifetime one; ``live_peak_*`` compares like with like."""
    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return {
        "n_ops": {"synthesized": syn.n_ops, "real": real.n_ops},
        "op_names_equal": syn.op_names == real.op_names,
        "n_tensors": {"synthesized": len(syn.tensors), "real": len(real.tensors)},
        "peak_bytes": {"synthesized": syn.peak_bytes(), "real": real.peak_bytes()},
        "peak_ratio": ratio(syn.peak_bytes(), real.peak_bytes()),
        "live_peak_bytes": {"synthesized": int(syn.live_bytes().max()), "real": int(real.live_bytes().max())},
        "live_peak_ratio": ratio(int(syn.live_bytes().max()), int(real.live_bytes().max())),
        "kernel_seconds": {"synthesized": float(syn.op_seconds.sum()), "real": float(real.op_seconds.sum())},
        "kernel_seconds_ratio": ratio(float(syn.op_seconds.sum()), float(real.op_seconds.sum())),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="conf/model/<name>.yaml, e.g. llama3_70b")
    p.add_argument("--layers", type=int, default=2, help="layers to profile")
    p.add_argument("--target-layers", type=int, required=True, help="layers to synthesize")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model field override")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-real", action="store_true", help="also profile the full-depth model and compare")
    p.add_argument("--compare-trace", type=Path, help="a saved full-depth trace (same workload) to compare with")
    p.add_argument("--paper-m", type=float, help="memory pressure M, percent: time the planner at peak / M")
    p.add_argument("--host-cap-gb", type=float, default=770.0, help="host tier cap for the planner, GB")
    p.add_argument("--ssd-gbps", type=float, default=16.0)
    p.add_argument("--host-gbps", type=float, default=50.0)
    p.add_argument("--min-tensor-bytes", type=int, default=1 << 20)
    p.add_argument("--repeats", type=int, default=1, help="planner runs to time")
    p.add_argument("--out-dir", type=Path, required=True)
    a = p.parse_args(argv)
    if not 2 <= a.layers <= a.target_layers:
        p.error(f"--layers {a.layers} --target-layers {a.target_layers}: need 2 <= layers <= target-layers")
    try:
        cfg = model_config(a.model, a.layers, a.set)
        workload = WorkloadConfig(batch_size=a.batch_size, micro_batch_size=a.micro_batch_size, seq_len=a.seq_len)
    except ValueError as e:
        p.error(str(e))
    device = torch.device(a.device)
    out = a.out_dir
    out.mkdir(parents=True, exist_ok=True)
    summary = {"command": command("benchmarks.profile_reduced", argv or sys.argv[1:]),
               "machine": {**machine(), "torch": torch.__version__,
                           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
               "model": {**cfg.__dict__, "n_layers_full": a.target_layers}}

    trace, secs = profile(cfg, workload, device, a.seed)
    trace.save(out / f"trace_{a.layers}l.json.gz")
    summary["profile"] = {"file": f"trace_{a.layers}l.json.gz", "seconds": secs, "n_ops": trace.n_ops,
                          "peak_bytes": trace.peak_bytes(), "kernel_seconds": float(trace.op_seconds.sum())}
    t0 = time.perf_counter()
    syn = synthesize_layers(trace, a.layers, a.target_layers)
    summary["synthesized"] = {"file": f"trace_synth{a.target_layers}l.json.gz",
                              "seconds": time.perf_counter() - t0, "n_ops": syn.n_ops,
                              "n_tensors": len(syn.tensors), "peak_bytes": syn.peak_bytes(),
                              "kernel_seconds": float(syn.op_seconds.sum())}
    syn.save(out / summary["synthesized"]["file"])
    del trace

    if a.compare_real:
        real, secs = profile(model_config(a.model, a.target_layers, a.set), workload, device, a.seed)
        summary["compare_real"] = {"profile_seconds": secs, **compare(syn, real)}
        del real
    if a.compare_trace:
        summary["compare_trace"] = {"file": str(a.compare_trace), **compare(syn, Trace.load(a.compare_trace))}
    if a.paper_m is not None:
        entry = {"command": summary["command"], "trace_file": str(out / summary["synthesized"]["file"]),
                 "note": f"{a.model} synthesized to {a.target_layers} layers from a {a.layers}-layer profile",
                 "machine": summary["machine"],
                 **time_plan(syn, a.paper_m, a.ssd_gbps, a.host_gbps, int(a.host_cap_gb * 1e9), a.repeats,
                             a.min_tensor_bytes)}
        write_entry(out / "plan_compile.json", f"{a.model}_synth{a.target_layers}", entry)
        summary["plan_compile"] = {k: entry[k] for k in ("median_seconds", "seconds", "plan")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("machine", "model")}, indent=1))
    return summary


if __name__ == "__main__":
    main()
