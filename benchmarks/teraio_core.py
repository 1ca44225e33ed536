"""Llama3-8B on one GPU, Ideal (uncapped) vs TeraIO-Mixed and
TeraIO-SSD under an emulated capacity, plus the engine's per-op dispatch overhead.

Each system runs as its own worker process, launched as the sweep launches it
(``teraio.harness.launch.launch_worker``), so one run's GPU memory never affects the next;
all run in the same call on the same machine, so they can be compared as ratios. Each run's
config is composed from ``conf/`` as a sweep point's is
(``teraio.harness.compose.compose_run_config``, :func:`overrides`): ``model=llama3_8b``,
``hardware=h200``, the system's own file, the workload and capacities of the options below,
then any Hydra ``OVERRIDE`` given after them (``hardware.ssd_write_gbps=2.0``, ...).

    python -m benchmarks.teraio_core --out DIR [--systems ideal,teraio_mixed,teraio_ssd]
        [--capacity-gib 70] [--host-cap-gib GIB] [--batch 4] [--ssd-dir DIR] [OVERRIDE ...]

Writes ``DIR/teraio_core.json`` (summary) and one job dir per system with its
``resolved.yaml``, result.json, trace, plan and logs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import yaml

from benchmarks import command
from teraio.harness.compose import compose_run_config
from teraio.harness.launch import launch_worker
from teraio.perf import jobdir

GiB = 1 << 30


def overrides(system: str, args: argparse.Namespace) -> list[str]:
    """The Hydra overrides of ``system``'s run: the model, machine and workload of the
    arguments, ``--capacity-gib`` on every system but Ideal (uncapped), then ``args.overrides``."""
    out = ["model=llama3_8b", f"system={system}", "hardware=h200", f"workload.batch_size={args.batch}",
           "workload.micro_batch_size=1", f"workload.seq_len={args.seq}", f"workload.warmup_steps={args.warmup}",
           f"workload.measure_steps={args.measure}", f"timeout_s={args.timeout}"]
    if args.layers is not None:
        out += [f"model.n_layers={args.layers}", f"model.name=llama3_8b_{args.layers}l"]
    if system != "ideal":
        out.append(f"hardware.gpu_capacity_bytes={int(args.capacity_gib * GiB)}")
    if args.host_cap_gib is not None:
        out.append(f"hardware.host_mem_cap_bytes={int(args.host_cap_gib * GiB)}")
    if args.ssd_dir is not None:
        out.append(f"hardware.ssd_dirs=[{args.ssd_dir}]")
    return out + list(args.overrides)


def run_worker(job_dir: Path, overrides: list[str]) -> dict:
    """Compose the run, write its ``resolved.yaml`` into ``job_dir``, run its worker and
    return its row; a row ``timeout`` or ``error`` (the worker's last lines) where it wrote
    none."""
    run = compose_run_config(overrides)
    job_dir.mkdir(parents=True, exist_ok=True)
    for d in run.hardware.ssd_dirs:
        Path(d).mkdir(parents=True, exist_ok=True)
    resolved = job_dir / jobdir.RESOLVED
    resolved.write_text(yaml.safe_dump(run.to_dict(), sort_keys=False))
    rc, tail = launch_worker(run, job_dir, resolved)
    if jobdir.side_file(job_dir, jobdir.RESULT) is not None:
        return jobdir.result(job_dir)
    return {"status": "timeout"} if rc is None else {"status": "error", "error": "\n".join(tail)}


def overhead(args) -> dict:
    """Per-op dispatch overhead: plain steps vs the same steps under a MigrationEngine with an
    empty plan (every op still goes through the engine's dispatch path), on Ideal's model
    (:func:`overrides`) at one sequence per step."""
    import torch

    from teraio.core.engine import MigrationEngine
    from teraio.systems.measure import timed
    from teraio.workload.models import build_model
    from teraio.core.plan import MigrationPlan
    from teraio.core.profiler import persistent_tensors, profile_step
    from teraio.workload.step import make_batch, make_optimizer, train_step

    dev = torch.device("cuda")
    cfg = compose_run_config(overrides("ideal", args))
    mc, w = cfg.model, dataclasses.replace(cfg.workload, batch_size=1, micro_batch_size=1)
    model = build_model(mc, w.seq_len, dev)
    opt = make_optimizer(model, w.lr)

    def fn(s):
        x, y = make_batch(s, w, mc.vocab_size, cfg.seed, dev)
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


def parser() -> argparse.ArgumentParser:
    """The command line (module docstring); its arguments are :func:`overrides`' ``args``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--systems", default="ideal,teraio_mixed,teraio_ssd")
    ap.add_argument("--capacity-gib", type=float, default=70.0, help="the capped systems' capacity, GiB")
    ap.add_argument("--host-cap-gib", type=float, help="TeraIO-Mixed's host tier cap, GiB (default: conf's)")
    ap.add_argument("--ssd-dir", help="the SSD tier's directory (default: conf's)")
    ap.add_argument("--layers", type=int, help="the model's layers (default: Llama3-8B's)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--measure", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--overhead-steps", type=int, default=0, help="0: skip the overhead measurement")
    ap.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides of every run, last")
    return ap


def main() -> None:
    args = parser().parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"command": command("benchmarks.teraio_core", sys.argv[1:]), "systems": {}}
    for system in args.systems.split(","):
        r = run_worker(args.out / system, overrides(system, args))
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
