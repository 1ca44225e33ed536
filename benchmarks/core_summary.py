"""Condense the raw output of ``benchmarks/teraio_core.py`` calls into
``benchmarks/results/teraio_core_h200.json`` (issue 2, item 7), and replay the measured
TeraIO plan through the performance model (``teraio.simulator``) for
``benchmarks/results/simulator_validation_h200.json`` (issue 5, item 2).

    python benchmarks/core_summary.py benchmarks/results/h200x2_llama3_8b_70gib

Inputs (committed, as the GPU machine returned them): ``call9_teraio_core.json`` (the
systems, one call), ``call6_teraio_core.json`` (the dispatch-overhead measurement, an
earlier call on the same kind of machine whose TeraIO runs failed), and the TeraIO-Mixed
trace, plan and result of call 9 (``teraio_mixed_*.json.gz``).
"""
from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from teraio.plan import MigrationPlan  # noqa: E402
from teraio.planner import TierBandwidth  # noqa: E402
from teraio.simulator import simulate  # noqa: E402
from teraio.trace import Trace  # noqa: E402

GiB = 1 << 30


def main(raw: Path) -> None:
    systems_call = json.loads((raw / "call9_teraio_core.json").read_text())
    overhead_call = json.loads((raw / "call6_teraio_core.json").read_text())
    mixed_result = json.loads(gzip.decompress((raw / "teraio_mixed_result.json.gz").read_bytes()))
    ideal = systems_call["systems"]["ideal"]
    ideal_tps = ideal["tokens_per_s"]
    ideal_loss = {i["step"]: i["loss"] for i in ideal["iterations"]}
    out = {
        "what": "Llama3-8B (torchtitan 0.2.2, sdpa), fp32, AdamW(foreach=False), batch 1 x seq 2048, "
                "capacity emulated at 70 GiB on one H200 of an nvidia-h200-x2 machine",
        "commands": {"systems": "python " + systems_call["command"],
                     "dispatch_overhead": "python " + overhead_call["command"],
                     "summary": "python benchmarks/core_summary.py " + str(raw)},
        "systems": {},
    }
    for name, s in systems_call["systems"].items():
        its = s.get("iterations") or []
        if name == "teraio_mixed":
            its = mixed_result["iterations"]  # measured steps; the row's status covers the cleanup too
        tps = [i["tokens_per_s"] for i in its]
        out["systems"][name] = {
            "status": s["status"],
            "tokens_per_s": statistics.fmean(tps) if tps else None,
            "tokens_per_s_per_iteration": tps,
            "ratio_to_ideal": statistics.fmean(tps) / ideal_tps if tps else None,
            "stall_count_per_iteration": [i.get("stall_count") for i in its],
            "stall_seconds_per_iteration": [i.get("stall_seconds") for i in its],
            "bytes_per_iteration": [{"offloaded": i.get("bytes_offloaded"), "prefetched": i.get("bytes_prefetched")}
                                    for i in its],
            "same_losses_as_ideal": ({i["step"]: i["loss"] for i in its} == ideal_loss) if its else None,
            "peak_allocated_gib": (mixed_result if name == "teraio_mixed" else s).get("peak_allocated_bytes") and
                                  (mixed_result if name == "teraio_mixed" else s)["peak_allocated_bytes"] / GiB,
            "unoffloaded_peak_gib": s.get("unoffloaded_peak_bytes") and s["unoffloaded_peak_bytes"] / GiB,
            "plan": s.get("plan"),
            "plan_compile_seconds": s.get("plan_compile_seconds"),
            "kvikio_mode": (mixed_result if name == "teraio_mixed" else s).get("kvikio_mode"),
        }
    ov = overhead_call["dispatch_overhead"]
    out["dispatch_overhead"] = {**ov, "percent_of_step": 100 * ov["overhead_fraction"]}
    (raw.parent / "teraio_core_h200.json").write_text(json.dumps(out, indent=1))

    trace = Trace.from_dict(json.loads(gzip.decompress((raw / "teraio_mixed_trace.json.gz").read_bytes())))
    plan = MigrationPlan.from_dict(json.loads(gzip.decompress((raw / "teraio_mixed_plan.json.gz").read_bytes())))
    hw = mixed_result["config"]["hardware"]
    n = len(hw["ssd_dirs"])
    tiers = TierBandwidth(hw["ssd_write_gbps"] * n, hw["ssd_read_gbps"] * n, hw["host_d2h_gbps"], hw["host_h2d_gbps"])
    measured = statistics.fmean(i["seconds"] for i in mixed_result["iterations"])
    validation = {"command": "python benchmarks/core_summary.py " + str(raw), "configs": []}
    for policy in ("fifo", "edf"):
        sim = simulate(trace, plan, tiers, policy=policy)
        validation["configs"].append({
            "config": "llama3_8b bs1 seq2048, teraio_mixed, 70 GiB", "policy": policy,
            "predicted_iteration_seconds": sim.iteration_seconds, "measured_iteration_seconds": measured,
            "predicted_over_measured": sim.iteration_seconds / measured,
            "predicted_stall_seconds": sim.stall_seconds, "predicted_stall_count": sim.stall_count,
            "ideal_seconds_model": sim.ideal_seconds,
            "ideal_seconds_measured": statistics.fmean(i["seconds"] for i in ideal["iterations"])})
    (raw.parent / "simulator_validation_h200.json").write_text(json.dumps(validation, indent=1))
    print(json.dumps({k: {kk: v[kk] for kk in ("status", "tokens_per_s", "ratio_to_ideal", "same_losses_as_ideal")}
                      for k, v in out["systems"].items()}, indent=1))
    print(json.dumps(validation["configs"], indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
