"""What TeraIO costs where it moves nothing, on a GPU: Ideal's step beside the same step under
the migration engine with a plan that moves nothing, and the profiled op times beside both.

At one point of a sweep (composed from ``conf/`` as the sweep composes it, default
``fig7_h200``'s Llama3-8B cut at ``seq_short``, whose whole step fits an 80 GB card), in one
process, the modes interleaved round by round so that a drift of the GPU's clocks reaches
every mode alike:

* ``ideal``: the shared step (``teraio.workload.step.train_step``) on the default stream, as
  Ideal runs it;
* ``ideal_stream``: the same on a side stream, as TeraIO runs its steps
  (``teraio.trainer.machine.compute_stream``);
* ``engine``: the same step under a ``MigrationEngine`` whose plan has no migration, with
  TeraIO's default options (device waits, gradients released after their last use), on
  the side stream: the engine's tax per op, which acceptance asks to be at most 3 %.

Then the step is profiled (``teraio.core.profiler.profile_step``) twice without a pager and
once under the pager at ``--capacity-gib`` (the way TeraIO profiles a step that does not
fit); each profile's op seconds are summed and set beside Ideal's step (what the planner
takes the step's compute to cost), and the paged profile's ops are set beside the unpaged
one's op by op, by op name (where paging makes an op look slower).

    python -m benchmarks.engine_tax --out tax.json [--rounds 3] [--capacity-gib GIB] [--point "..."]
        [--device cuda] [OVERRIDE ...]

``--point`` (Hydra overrides; default ``+experiment=fig7_h200 model=llama3_8b_4l
fig7.point=seq_short``) and ``OVERRIDE`` after it pick another point. ``--capacity-gib`` defaults to the point's own
capped capacity (what the experiment gives TeraIO there). With ``--clocks`` the GPU's SM clock,
power and temperature are sampled every 100 ms through the whole run (``nvidia-smi``), and
each step and profile gets their means over its span: an FP32 matmul at the power limit slows
with the clock.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks import command

GiB = 1 << 30
POINT = "+experiment=fig7_h200 model=llama3_8b_4l fig7.point=seq_short"
MODES = ("ideal", "ideal_stream", "engine")


CLOCK_QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu"
"""What :func:`start_clock_log` samples (``nvidia-smi --query-gpu``), in this order."""


def start_clock_log(path: Path, every_ms: int = 100) -> subprocess.Popen | None:
    """Sample the GPU's SM clock (MHz), power (W) and temperature (C) every ``every_ms`` into
    ``path`` (CSV, no header: :data:`CLOCK_QUERY`) until the returned process is ended; None
    where ``nvidia-smi`` cannot be started."""
    try:
        return subprocess.Popen(["nvidia-smi", f"--query-gpu={CLOCK_QUERY}", "--format=csv,noheader,nounits",
                                 f"-lms={every_ms}"], stdout=open(path, "w"), stderr=subprocess.DEVNULL)
    except OSError:
        return None


def clocks_during(path: Path, t0: float, t1: float) -> dict | None:
    """Mean SM clock, power and temperature of the samples in ``path`` (:func:`start_clock_log`)
    taken between epoch seconds ``t0`` and ``t1``; None without such samples."""
    import datetime

    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, *(float(x) for x in parts[1:4])))
        except (ValueError, IndexError):
            continue
    inside = [r for r in rows if t0 <= r[0] <= t1]
    if not inside:
        return None
    n = len(inside)
    return {"samples": n, "sm_mhz": sum(r[1] for r in inside) / n, "power_w": sum(r[2] for r in inside) / n,
            "temp_c": sum(r[3] for r in inside) / n}


def op_seconds_by_name(trace) -> dict[str, float]:
    """Seconds of ``trace``'s ops summed per op name."""
    out: dict[str, float] = defaultdict(float)
    for name, s in zip(trace.op_names, trace.op_seconds):
        out[name] += float(s)
    return dict(out)


def compare_profiles(plain, paged) -> dict:
    """Where ``paged`` (profiled under the pager) has ops slower than ``plain`` (the same step
    profiled without): the op-name totals, largest excess first, and the op-by-op excess
    where both traces ran the same op sequence."""
    a, b = op_seconds_by_name(plain), op_seconds_by_name(paged)
    by_name = sorted(((n, a.get(n, 0.0), b.get(n, 0.0)) for n in set(a) | set(b)), key=lambda x: x[1] - x[2])
    out = {"by_name": [{"op": n, "unpaged_s": x, "paged_s": y, "excess_s": y - x} for n, x, y in by_name[:15]]}
    if plain.op_names == paged.op_names:
        d = paged.op_seconds - plain.op_seconds
        out["same_ops"] = True
        out["excess_s"] = float(d.sum())
        out["ops_over_10pct"] = int(((d > 0.1 * plain.op_seconds) & (d > 1e-4)).sum())
        out["excess_in_those_s"] = float(d[(d > 0.1 * plain.op_seconds) & (d > 1e-4)].sum())
    else:
        out["same_ops"] = False
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the JSON file written")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three modes, one step each")
    ap.add_argument("--capacity-gib", type=float, help="the paged profile's capacity (default: the point's)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a quick check of the tool itself")
    ap.add_argument("--clocks", type=Path, help="sample the GPU's clock and power into this CSV (nvidia-smi) and "
                    "give each step and profile their means")
    ap.add_argument("--point", default=POINT, help="the point's Hydra overrides, space-separated (default: %(default)s)")
    ap.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides after the point's")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give at least 1")
    import torch

    from teraio.core.engine import MigrationEngine
    from teraio.core.pager import Pager
    from teraio.core.plan import MigrationPlan
    from teraio.core.profiler import persistent_tensors, profile_step
    from teraio.harness.compose import compose_run_config
    from teraio.systems.measure import timed
    from teraio.systems.memory_cap import apply_memory_cap
    from teraio.trainer.machine import compute_stream
    from teraio.trainer.options import TeraIOOptions
    from teraio.workload.models import build_model
    from teraio.workload.step import make_batch, make_optimizer, train_step

    dev = torch.device(args.device)
    point = args.point.split()
    capped = compose_run_config(point + ["system=teraio_mixed"] + list(args.overrides))
    cfg = compose_run_config(point + ["system=ideal"] + list(args.overrides))
    m, w = cfg.model, cfg.workload
    opts = TeraIOOptions()
    capacity = int(args.capacity_gib * GiB) if args.capacity_gib else capped.hardware.gpu_capacity_bytes
    model = build_model(m, w.seq_len, dev)
    opt = make_optimizer(model, w.lr)

    def work(step):
        x, y = make_batch(step, w, m.vocab_size, cfg.seed, dev)
        return lambda: train_step(model, opt, x, y, w.micro_batch_size)

    clock_log = start_clock_log(args.clocks) if args.clocks else None
    out = {"command": command("benchmarks.engine_tax", sys.argv[1:]), "point": cfg.point(),
           "gpu_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "steps": {k: [] for k in MODES}}
    work(0)()  # the optimizer state
    _, trace = profile_step(work(1), model, opt, dev, meta=dict(cfg.point()))
    planned = trace.with_released_grads() if opts.release_grads else trace
    empty = MigrationPlan(planned.n_ops, planned.peak_bytes(), planned.peak_bytes(), planned.peak_bytes(), [])
    engine = MigrationEngine(planned, empty, persistent_tensors(model, opt), {}, dev, log_ops=False,
                             device_waits=opts.device_waits, release_grads=opts.release_grads)
    step = 2
    for _ in range(args.rounds):
        for mode in MODES:
            fn = work(step)
            with compute_stream(dev) if mode != "ideal" else contextlib.nullcontext():
                with timed(dev) as t:
                    t0 = time.time()
                    loss = engine.run_step(fn, step) if mode == "engine" else fn()
            out["steps"][mode].append({"step": step, "seconds": t["seconds"], "loss": loss,
                                       "epoch_s": [t0, time.time()]})
            if dev.type == "cuda":  # the caching allocator keeps a pool per stream: Ideal's peak fits one
                torch.cuda.empty_cache()
            print(mode, step, round(t["seconds"], 4), flush=True)
            step += 1
    engine.close()
    del engine
    profiles, spans = {}, {}
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    for name in ("unpaged", "unpaged_again"):
        t0 = time.time()
        _, profiles[name] = profile_step(work(step), model, opt, dev, meta=dict(cfg.point()))
        spans[name] = [t0, time.time()]
        step += 1
    torch.cuda.empty_cache()
    limit = int(capacity * (1 - opts.headroom(dev)))
    held = apply_memory_cap(capacity, dev, capped.hardware.capacity_mode)
    pager = None
    try:
        pager = Pager(limit, dev, list(persistent_tensors(model, opt).values()), min_evict_bytes=opts.min_tensor_bytes)
        with timed(dev) as t:
            t0 = time.time()
            _, profiles["paged"] = profile_step(work(step), model, opt, dev, meta=dict(cfg.point()), pager=pager)
        spans["paged"] = [t0, time.time()]
        out["paged_profile"] = {"seconds": t["seconds"], "capacity_bytes": capacity, "limit_bytes": limit,
                                "pager": vars(pager.stats)}
    finally:
        if pager is not None:
            pager.close()
        held.lift()
    ideal = min(s["seconds"] for s in out["steps"]["ideal"])
    out["min_seconds"] = {k: min(s["seconds"] for s in v) for k, v in out["steps"].items()}
    out["engine_over_ideal"] = out["min_seconds"]["engine"] / ideal
    out["stream_over_ideal"] = out["min_seconds"]["ideal_stream"] / ideal
    out["profiles"] = {k: {"n_ops": p.n_ops, "op_seconds_sum": float(p.op_seconds.sum()),
                           "over_ideal_step": float(p.op_seconds.sum()) / ideal, "epoch_s": spans[k]}
                       for k, p in profiles.items()}
    if clock_log is not None:
        clock_log.terminate()
        clock_log.wait()
        for steps in out["steps"].values():
            for s in steps:
                s["gpu"] = clocks_during(args.clocks, *s["epoch_s"])
        for k, p in out["profiles"].items():
            p["gpu"] = clocks_during(args.clocks, *p["epoch_s"])
    out["paged_vs_unpaged"] = compare_profiles(profiles["unpaged"], profiles["paged"])
    out["unpaged_vs_unpaged"] = compare_profiles(profiles["unpaged"], profiles["unpaged_again"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    for k, p in profiles.items():
        p.save(args.out.with_name(f"{args.out.stem}.trace_{k}.json"))
    print(json.dumps({k: out[k] for k in ("min_seconds", "engine_over_ideal", "stream_over_ideal", "profiles")},
                     indent=1))


if __name__ == "__main__":
    main()
