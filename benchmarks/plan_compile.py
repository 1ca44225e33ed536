"""Plan compile time (paper camera-ready Table 1:
31.2 s for Llama3-8B, 396.6 s for Llama3-70B): wall time of
:func:`teraio.perf.choose.plan_fastest` (the planner, ``"auto"`` settings chosen by simulating) on a saved trace, on
this machine's CPU, and the CPU time of the process over the same call (on a machine other
work shares, the wall time includes waiting for a core).

    python -m benchmarks.plan_compile TRACE --label NAME --paper-m M_PERCENT \
        [--host-cap-gb 170] [--ssd-gbps 16] [--host-gbps 50] [--host-arena {false,true,auto}] \
        [--repeats 3] [--schedule] [--synthesize L:L2] [--note TEXT] [--out benchmarks/results/plan_compile_cpu.json]

Setting (the paper's TeraIO-Mixed on its server, §4.1): capacity = the trace's
un-offloaded peak / M; SSD tier ``--ssd-gbps`` GB/s each way (4 x 990 PRO per GPU,
~16 GB/s); host tier ``--host-gbps`` GB/s each way (the paper states none:
``conf/hardware/paper_h100nvl.yaml``'s assumption) capped at ``--host-cap-gb`` GB (170 GB
for Llama3-8B, 770 GB for Llama3-70B: what ZeRO-Infinity uses), packed as ``--host-arena``
says (default ``auto``, TeraIO's: the planner plans the host tier in slots and as one region,
as twins that share their run until a room test tells them apart, and keeps the faster);
``allow_stalls`` and the other options as
``conf/system/teraio_ssd.yaml``. ``--synthesize L:L2`` first turns an
L-layer trace into an L2-layer one (:func:`teraio.perf.synth.synthesize_layers`).
``--schedule`` also times the schedule search, ``recompute="auto"`` (each candidate moved
to SSD, to host memory or dropped and recomputed; the plans with and without recompute
simulated and the faster kept), right after today's planner in each repeat, and gives
the ratios of their medians.

The result is one entry, keyed by ``--label``, of the JSON file ``--out`` (other entries
are kept; the file is replaced atomically).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import command
from benchmarks.replan import HOST_ARENA
from teraio.core.bandwidth import TierBandwidth
from teraio.core.trace import Trace
from teraio.files import write_atomic
from teraio.perf.choose import plan_fastest
from teraio.perf.synth import synthesize_layers

WHAT = ("teraio.perf.choose.plan_fastest on a saved trace, on the CPU: wall and CPU seconds of today's "
        "planner (recompute off) and, with --schedule, of the schedule search (recompute=auto) right after it")
# Camera-ready Table 1, for comparison only; the paper's machine and what its
# time includes are not stated.
PAPER_SECONDS = {"llama3_8b": 31.2, "granite_8b": 37.9, "llama3_70b": 396.6}


def time_plan(trace: Trace, paper_m: float, ssd_gbps: float = 16.0, host_gbps: float = 50.0,
              host_cap_bytes: int = 170 * 10**9, repeats: int = 3, min_tensor_bytes: int = 1 << 20,
              host_arena: bool | str = "auto", schedule: bool = False) -> dict:
    """Plan ``trace`` ``repeats`` times at capacity = peak / (``paper_m`` / 100) and report
    wall times and the process's CPU times (s) and the plan's size; with ``schedule``, each
    time also with ``recompute="auto"`` (TeraIO's schedule search: tiers or recompute per
    tensor), right after today's plan, its times, their medians' ratios to today's and its
    plan under ``"schedule"``.

    Raises:
        ValueError: ``paper_m`` <= 100 (nothing to plan) or ``repeats`` < 1.
    """
    if not paper_m > 100:
        raise ValueError(f"paper_m={paper_m}: must be > 100 (percent of the GPU capacity)")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    peak = trace.peak_bytes()
    capacity = int(peak / (paper_m / 100))
    tiers = TierBandwidth(ssd_gbps, ssd_gbps, host_gbps, host_gbps)
    seconds, cpu, plan, sched_seconds, sched_cpu, sched = [], [], None, [], [], None
    for _ in range(repeats):
        for recompute, times, cpus in ((False, seconds, cpu),
                                       ("auto", sched_seconds, sched_cpu) if schedule else (None, None, None)):
            if times is None:
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            out = plan_fastest(trace, capacity, tiers, host_cap_bytes=host_cap_bytes, allow_stalls=True,
                               min_tensor_bytes=min_tensor_bytes, host_arena=host_arena, recompute=recompute)
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            plan, sched = (out, sched) if recompute is False else (plan, out)
    extra = {}
    if schedule:
        extra["schedule"] = {
            "seconds": sched_seconds, "median_seconds": statistics.median(sched_seconds),
            "cpu_seconds": sched_cpu, "median_cpu_seconds": statistics.median(sched_cpu),
            "ratio_to_today": statistics.median(sched_seconds) / statistics.median(seconds),
            "cpu_ratio_to_today": statistics.median(sched_cpu) / statistics.median(cpu),
            "recompute_auto": sched.meta.get("recompute_auto"), "recomputed_bytes": sched.recomputed_bytes(),
            "bytes_per_tier": sched.bytes_per_tier(), "shortfall_bytes": sched.shortfall_bytes}
    return {
        "seconds": seconds, "median_seconds": statistics.median(seconds),
        "cpu_seconds": cpu, "median_cpu_seconds": statistics.median(cpu),
        "trace": {"n_ops": trace.n_ops, "n_tensors": len(trace.tensors), "peak_bytes": peak,
                  "ideal_seconds": float(trace.op_seconds.sum()),
                  **{k: trace.meta.get(k) for k in ("model", "batch_size", "micro_batch_size", "seq_len",
                                                    "n_layers", "device")},
                  "synthesized": trace.meta.get("synthesized")},
        "setting": {"paper_m_percent": paper_m, "capacity_bytes": capacity, "tiers_gbps": tiers.__dict__,
                    "host_cap_bytes": host_cap_bytes, "min_tensor_bytes": min_tensor_bytes, "allow_stalls": True,
                    "host_arena": host_arena},
        "plan": {"n_migrations": len(plan.migrations), "predicted_peak_bytes": plan.predicted_peak_bytes,
                 "bytes_per_tier": plan.bytes_per_tier(),
                 **{k: plan.meta[k] for k in ("n_exposed", "stop_reason", "n_candidates", "evaluations",
                                              "shortfall_bytes", "host_arena")},
                 "host_arena_auto": plan.meta.get("host_arena_auto")},
        **extra,
    }


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "numpy": np.__version__, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def write_entry(out: Path, label: str, entry: dict) -> None:
    """Put ``entry`` under ``label`` in the JSON file ``out``, keeping the others."""
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc["what"] = WHAT
    doc.setdefault("entries", {})[label] = entry
    write_atomic(out, (json.dumps(doc, indent=1) + "\n").encode())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="saved trace, .json or .json.gz")
    p.add_argument("--label", required=True, help="entry name in --out, e.g. llama3_8b")
    p.add_argument("--paper-m", type=float, required=True, help="memory pressure M, percent (188.81)")
    p.add_argument("--host-cap-gb", type=float, default=170.0, help="host tier cap, GB (0: TeraIO-SSD)")
    p.add_argument("--ssd-gbps", type=float, default=16.0, help="SSD tier, GB/s each way")
    p.add_argument("--host-gbps", type=float, default=50.0, help="host tier, GB/s each way")
    p.add_argument("--host-arena", choices=tuple(HOST_ARENA), default="auto",
                   help="host tier packing: false (slots), true (one region) or auto (both, the faster kept)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--schedule", action="store_true",
                   help="also time the schedule search (recompute=auto) beside today's planner, each repeat")
    p.add_argument("--synthesize", metavar="L:L2", help="synthesize L2 layers from this L-layer trace first")
    p.add_argument("--paper-key", help="key of PAPER_SECONDS to compare with (default: the trace's "
                                       "model, none with --synthesize)")
    p.add_argument("--note", help="free text stored with the entry (what it stands for)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/plan_compile_cpu.json"))
    a = p.parse_args(argv)
    trace = Trace.load(a.trace)
    if a.synthesize:
        try:
            L, L2 = (int(x) for x in a.synthesize.split(":"))
        except ValueError:
            p.error(f"--synthesize {a.synthesize!r}: expected L:L2, e.g. 32:80")
        trace = synthesize_layers(trace, L, L2)
    entry = {"command": command("benchmarks.plan_compile", argv or sys.argv[1:]),
             "trace_file": str(a.trace), "note": a.note, "machine": machine(),
             **time_plan(trace, a.paper_m, a.ssd_gbps, a.host_gbps, int(a.host_cap_gb * 1e9), a.repeats,
                          host_arena=HOST_ARENA[a.host_arena], schedule=a.schedule)}
    # A synthesized stand-in (e.g. 8B widths at 80 layers) is no paper model.
    key = a.paper_key or (None if a.synthesize else trace.meta.get("model"))
    entry["paper_seconds"] = PAPER_SECONDS.get(key)
    write_entry(a.out, a.label, entry)
    print(json.dumps({a.label: {k: entry[k] for k in ("median_seconds", "seconds", "median_cpu_seconds",
                                                      "paper_seconds")},
                      "plan": entry["plan"], **{k: entry[k] for k in ("schedule",) if k in entry}}, indent=1))
    return entry


if __name__ == "__main__":
    main()
