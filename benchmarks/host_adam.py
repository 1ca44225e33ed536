"""How fast AdamW updates FP32 parameters in host memory: the rate a host-side optimizer
update would run at (parameters per second), for torch's CPU AdamW in its three
implementations (``fused``, ``foreach``, the per-tensor loop) and DeepSpeed's
``DeepSpeedCPUAdam`` (AdamW mode; its JIT op built first, ``scripts/build_ds_ops.py``).

The tensors have the shapes of a model's parameters, composed from ``conf/`` (default
``model=llama3_8b_4l``, about 1.9 billion parameters: 30 GB of host memory for parameters,
gradients and the two states), with random gradients; each implementation runs
``--warmup`` untimed steps then ``--steps`` timed ones on all of them, with the threads torch
has (``torch.get_num_threads()``, recorded).

    python -m benchmarks.host_adam --out host_adam.json [--impls fused,foreach,loop,deepspeed]
        [--steps 3] [--warmup 1] [--scale 1.0] [OVERRIDE ...]

``--scale`` keeps that share of the parameters (first tensors first) for a quick look on a
small machine. An implementation that cannot run is recorded with its error.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import command

IMPLS = ("fused", "foreach", "loop", "deepspeed")


def make_optimizer(impl: str, params: list, lr: float):
    """The AdamW of ``impl`` over ``params`` (weight decay 0.01, torch's default betas)."""
    import torch

    if impl == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, weight_decay=0.01, adamw_mode=True)
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **flags)


def rate(impl: str, shapes: list[tuple[int, ...]], steps: int, warmup: int) -> dict:
    """Seconds per step and parameters per second of ``impl`` over fresh tensors of ``shapes``."""
    import torch

    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params)
    opt = make_optimizer(impl, params, 1e-4)
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"step_seconds": times, "params": n, "params_per_s": n / best,
            "gb_per_s_of_state": 16 * n / best / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("overrides", nargs="*", metavar="OVERRIDE")
    args = ap.parse_args()
    impls = args.impls.split(",")
    bad = [i for i in impls if i not in IMPLS]
    if bad or not 0 < args.scale <= 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--impls {bad} (valid: {','.join(IMPLS)}), --scale {args.scale} (0 < x <= 1), "
                         f"--steps {args.steps} (>= 1), --warmup {args.warmup} (>= 0)")
    import torch

    from teraio.harness.compose import compose_run_config
    from teraio.workload.models import build_meta_model

    cfg = compose_run_config(["model=llama3_8b_4l", "system=ideal", *args.overrides])
    shapes = [tuple(p.shape) for p in build_meta_model(cfg.model, cfg.workload.seq_len).parameters()]
    total = sum(torch.Size(s).numel() for s in shapes)
    kept, n = [], 0
    for s in shapes:
        if n >= args.scale * total:
            break
        kept.append(s)
        n += torch.Size(s).numel()
    out = {"command": command("benchmarks.host_adam", sys.argv[1:]), "model": cfg.model.name,
           "threads": torch.get_num_threads(), "params": n, "impls": {}}
    for impl in impls:
        try:
            out["impls"][impl] = rate(impl, kept, args.steps, args.warmup)
        except Exception as e:  # recorded: one that cannot run does not stop the others
            out["impls"][impl] = {"error": f"{type(e).__name__}: {e}"}
        print(impl, out["impls"][impl].get("params_per_s") or out["impls"][impl].get("error"), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
