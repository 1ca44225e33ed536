"""Condense the raw output of ``benchmarks.teraio_core`` calls into
``benchmarks/results/teraio_core_h200.json``, and replay every measured
TeraIO run through the performance model (``teraio.perf.replay.replay_run``) for
``benchmarks/results/simulator_validation_h200.json``.

    python -m benchmarks.core_summary benchmarks/results/raw_gpu_calls/h200x2_a \\
        --overhead benchmarks/results/h200x2_llama3_8b_70gib/call6_teraio_core.json \\
        --sweep runs/reference/h200/fig7_h200_slice

Inputs, as the GPU machine returned them (``RAW/COMMANDS.md`` says which call made what):
``RAW/call<N>_teraio_core.json`` (one per call; each holds an Ideal row of the same call,
so every ratio to Ideal is taken within one call), ``RAW/call<N>_<system>_{trace,plan,
result}.json.gz`` of the TeraIO runs, the dispatch-overhead measurement (``--overhead``)
and the TeraIO rows of a sweep (``--sweep``: job dirs holding trace.json, plan.json and
result.json), which add configurations to the simulator's validation.
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
from pathlib import Path

from benchmarks import command
from teraio.core.engine import union_seconds
from teraio.core.plan import MigrationPlan
from teraio.core.trace import Trace
from teraio.perf import jobdir
from teraio.perf.replay import replay_run, run_tiers

GiB = 1 << 30
TERAIO = ("teraio_mixed", "teraio_ssd")


def as_command(recorded: str) -> str:
    """The command line a ``teraio_core.json`` records: the whole command
    (``python -m benchmarks.teraio_core ...``), or, in files of earlier calls, the script and
    its arguments (``benchmarks/teraio_core.py ...``), which ran under ``python``."""
    return recorded if recorded.startswith("python") else "python " + recorded


def system_row(name: str, result: dict, ideal: dict, call: str) -> dict:
    """One system's measured iterations, against the Ideal row of the same call."""
    its = result.get("iterations") or []
    tps = [i["tokens_per_s"] for i in its]
    ideal_loss = {i["step"]: i["loss"] for i in ideal.get("iterations") or []}
    peak = result.get("peak_allocated_bytes")
    return {
        "call": call,
        "status": result["status"],
        "tokens_per_s": statistics.fmean(tps) if tps else None,
        "tokens_per_s_per_iteration": tps,
        "ratio_to_ideal": statistics.fmean(tps) / ideal["tokens_per_s"] if tps else None,
        "ideal_tokens_per_s_same_call": ideal["tokens_per_s"],
        "iteration_seconds": [i["seconds"] for i in its],
        "stall_count_per_iteration": [i.get("stall_count") for i in its],
        "stall_seconds_per_iteration": [i.get("stall_seconds") for i in its],
        "bytes_per_iteration": [{"offloaded": i.get("bytes_offloaded"), "prefetched": i.get("bytes_prefetched")}
                                for i in its],
        "same_losses_as_ideal": ({i["step"]: i["loss"] for i in its} == ideal_loss) if its else None,
        "peak_allocated_gib": peak / GiB if peak else None,
        "capacity_gib": result["capacity_bytes"] / GiB if result.get("capacity_bytes") else None,
        "unoffloaded_peak_gib": (result["unoffloaded_peak_bytes"] / GiB if result.get("unoffloaded_peak_bytes")
                                 else None),
        "plan": result.get("plan"),
        "plan_compile_seconds": result.get("plan_compile_seconds"),
        "ssd_io_mode": result.get("ssd_io_mode", result.get("kvikio_mode")),
    }


def transfer_busy(transfers_csv: Path) -> dict:
    """Per measured step and tier: how long each direction had a transfer in flight (the
    union of its transfers' issue-to-done intervals, seconds), the bytes moved and the
    resulting GB/s, and how long either direction was busy. A link busy for a small part
    of the iteration means the schedule, not the link, set the iteration time."""
    import pandas as pd

    df = pd.read_csv(transfers_csv)
    out: dict = {}
    for (step, tier), g in df.groupby(["step", "tier"]):
        row = {}
        for direction, d in g.groupby("direction"):
            busy = union_seconds(list(zip(d.t_issued_s, d.t_done_s)))
            row[direction] = {"bytes": int(d.nbytes.sum()), "busy_seconds": busy,
                              "gbps_while_busy": d.nbytes.sum() / busy / 1e9}
        row["either_busy_seconds"] = union_seconds(list(zip(g.t_issued_s, g.t_done_s)))
        out.setdefault(f"step{step}", {})[tier] = row
    return out


def validate(label: str, trace: Trace, plan: MigrationPlan, result: dict) -> list[dict]:
    """Predicted vs measured iteration seconds of one run: FIFO and EDF transfer order,
    each with the SSD's reads and writes in separate queues (the paper's model) and in one
    (``shared_ssd``: the lent machine has one drive), at the rates of the run's config."""
    tiers = run_tiers(result["config"])
    rows = []
    for policy, shared in itertools.product(("fifo", "edf"), (False, True)):
        r = replay_run(trace, plan, tiers, result["iterations"], policy=policy, shared_ssd=shared)
        rows.append({"config": label, "policy": policy, "shared_ssd": shared,
                     "predicted_iteration_seconds": r.simulated.iteration_seconds,
                     "measured_iteration_seconds": r.measured_iteration_seconds,
                     "predicted_over_measured": r.predicted_over_measured,
                     "predicted_stall_seconds": r.simulated.stall_seconds,
                     "predicted_stall_count": r.simulated.stall_count,
                     "measured_stall_seconds": r.measured_stall_seconds,
                     "measured_stall_count": r.measured_stall_count,
                     "ideal_seconds_model": r.simulated.ideal_seconds})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", type=Path)
    ap.add_argument("--overhead", type=Path, required=True)
    ap.add_argument("--sweep", type=Path)
    args = ap.parse_args()
    cmd = command("benchmarks.core_summary", sys.argv[1:])

    out = {"what": "Llama3-8B (torchtitan 0.2.2, sdpa), fp32, AdamW(foreach=False), batch 1 x seq 2048, "
                   "capacity emulated at 70 GiB on one H200 of an nvidia-h200-x2 machine; each system's "
                   "ratio to Ideal is taken against the Ideal run of the same call",
           "commands": {"summary": cmd,
                        "calls": str(args.raw / "COMMANDS.md")},
           "systems": {}}
    validation = {"command": cmd, "configs": []}
    for call_file in sorted(args.raw.glob("call*_teraio_core.json")):
        call = call_file.name.split("_")[0]
        summary = json.loads(call_file.read_text())
        ideal = summary["systems"]["ideal"]
        out["commands"][call] = as_command(summary["command"])
        for name, s in summary["systems"].items():
            prefix = f"{call}_{name}_"
            has_result = jobdir.side_file(args.raw, prefix + jobdir.RESULT) is not None
            if name in TERAIO and not has_result:
                continue  # a run that wrote no result (COMMANDS.md says why)
            result = jobdir.result(args.raw, prefix) if has_result else s
            if name == "ideal":
                out["systems"].setdefault("ideal", {})[call] = system_row(name, result, ideal, call)
                continue
            out["systems"][name] = system_row(name, result, ideal, call)
            out["systems"][name]["transfers_in_flight"] = transfer_busy(args.raw / f"{call}_{name}_transfers.csv.gz")
            trace, plan = jobdir.trace(args.raw, prefix), jobdir.plan(args.raw, prefix)
            validation["configs"] += validate(f"llama3_8b bs1 seq2048, {name}, 70 GiB ({call})", trace, plan,
                                              result)
    overhead = json.loads(args.overhead.read_text())
    ov = overhead["dispatch_overhead"]
    out["commands"]["dispatch_overhead"] = as_command(overhead["command"])
    out["dispatch_overhead"] = {**ov, "percent_of_step": 100 * ov["overhead_fraction"], "source": str(args.overhead)}

    if args.sweep:
        for job in jobdir.job_dirs(args.sweep):
            result = jobdir.result(job)
            if not re.search(r"-teraio_(mixed|ssd)-", job.name) or result["status"] != "ok":
                continue
            validation["configs"] += validate(job.name, jobdir.trace(job), jobdir.plan(job), result)
    validation["summary"] = {}
    for policy, shared in itertools.product(("fifo", "edf"), (False, True)):
        for tier in ("mixed", "ssd"):
            r = [c["predicted_over_measured"] for c in validation["configs"]
                 if c["policy"] == policy and c["shared_ssd"] == shared and f"teraio_{tier}" in c["config"]]
            validation["summary"][f"{policy}{'_shared_ssd' if shared else ''}_teraio_{tier}"] = {
                "n": len(r), "min": min(r), "max": max(r), "median": statistics.median(r),
                "within_10_percent": sum(abs(x - 1) <= 0.10 for x in r)}

    (args.raw.parent / "teraio_core_h200.json").write_text(json.dumps(out, indent=1))
    (args.raw.parent / "simulator_validation_h200.json").write_text(json.dumps(validation, indent=1))
    print(json.dumps({k: ({kk: v[kk] for kk in ("status", "tokens_per_s", "ratio_to_ideal", "same_losses_as_ideal")}
                          if k != "ideal" else {c: r["tokens_per_s"] for c, r in v.items()})
                      for k, v in out["systems"].items()}, indent=1))
    print(json.dumps(validation["summary"], indent=1))


if __name__ == "__main__":
    main()
