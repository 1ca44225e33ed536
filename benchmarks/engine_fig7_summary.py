"""Condense the rows of ``benchmarks/engine_fig7_h200.sh`` into the ``fig7_h200`` section of
``benchmarks/results/engine_h200.json`` and replay each TeraIO-Mixed run through the
performance model (``teraio.perf.replay.replay_run``) at the tier rates measured by
``benchmarks.engine_bandwidth`` (the same JSON's ``host_*_gbps`` and ``ssd_*_gbps``).

    python -m benchmarks.engine_fig7_summary benchmarks/results/engine_h200/fig7_trials \\
        --json benchmarks/results/engine_h200.json

Per point (``fig7.point``, read off each row's configuration): every trial's tokens/s per
system, their means, ``mixed_of_ideal`` = mean TeraIO-Mixed ÷ mean Ideal and
``mixed_over_zero_offload`` = mean TeraIO-Mixed ÷ mean ZeRO-Offload; TeraIO-Mixed's stall
seconds as a share of its iteration; whether its losses equal Ideal's step for step; and
the simulator's predicted iteration seconds against the measured ones (FIFO order, the
drive as one shared channel: the engine's order and the planner's default), per run and
as means per point.

Inputs: job folders ``<model>-<system>-...-t<trial>/`` holding ``result.json``, and for
TeraIO-Mixed ``trace.json.gz`` and ``plan.json.gz``. Rewrites only the ``fig7_h200`` key of
``--json`` (written atomically); prints that section.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from benchmarks import command
from teraio.core.bandwidth import TierBandwidth
from teraio.files import write_atomic
from teraio.perf import jobdir
from teraio.perf.replay import replay_run

SYSTEMS = ("ideal", "teraio_mixed", "zero_offload")


def point_names(experiment: Path) -> dict[tuple, str]:
    """``(model, batch_size, micro_batch_size, seq_len)`` → the experiment's point name."""
    from omegaconf import OmegaConf
    points = OmegaConf.to_container(OmegaConf.load(experiment).fig7.points)
    return {(model, w["batch_size"], w["micro_batch_size"], w["seq_len"]): name
            for model, named in points.items() for name, w in named.items()}


def replay(job: Path, row: dict, tiers: TierBandwidth) -> dict:
    """Predicted against measured iteration seconds of one TeraIO-Mixed run."""
    r = replay_run(jobdir.trace(job), jobdir.plan(job), tiers, row["iterations"], policy="fifo", shared_ssd=True)
    return {"job": job.name, "measured_iteration_seconds": r.measured_iteration_seconds,
            "predicted_iteration_seconds": r.simulated.iteration_seconds,
            "predicted_over_measured": r.predicted_over_measured,
            "measured_stall_seconds": r.measured_stall_seconds,
            "predicted_stall_seconds": r.simulated.stall_seconds,
            "profiled_kernel_seconds": r.simulated.ideal_seconds}


def summarize(rows_dir: Path, tiers: TierBandwidth, names: dict[tuple, str]) -> dict:
    """The ``fig7_h200`` section (module docstring).

    Raises:
        ValueError: a row that is not ``ok``, or a point missing one of :data:`SYSTEMS`.
    """
    points: dict[str, dict] = {}
    for job in jobdir.job_dirs(rows_dir):
        row = jobdir.result(job)
        if row["status"] != "ok":
            raise ValueError(f"{job}: status {row['status']!r}; this summary compares ok rows only")
        pt = row["point"]
        point = names[(pt["model"], pt["batch_size"], pt["micro_batch_size"], pt["seq_len"])]
        system = pt["system"]
        p = points.setdefault(point, {"workload": {k: row["config"]["workload"][k] for k in
                                                   ("batch_size", "micro_batch_size", "seq_len")},
                                      "rows": {s: [] for s in SYSTEMS}, "replays": []})
        p["rows"][system].append((pt["trial"], row, job))
    out = {}
    for point, p in points.items():
        missing = [s for s in SYSTEMS if not p["rows"][s]]
        if missing:
            raise ValueError(f"point {point}: no rows of {missing}")
        tps = {s: [r["tokens_per_s"] for _, r, _ in sorted(p["rows"][s], key=lambda x: x[0])] for s in SYSTEMS}
        mean = {s: statistics.fmean(v) for s, v in tps.items()}
        mixed = sorted(p["rows"]["teraio_mixed"], key=lambda x: x[0])
        ideal_losses = p["rows"]["ideal"][0][1]["losses"]
        replays = [replay(job, row, tiers) for _, row, job in mixed]
        its = [i for _, row, _ in mixed for i in row["iterations"]]
        out[point] = {
            **p["workload"],
            "trials": len(mixed),
            "tokens_per_s": tps,
            "mean_tokens_per_s": mean,
            "mixed_of_ideal": mean["teraio_mixed"] / mean["ideal"],
            "mixed_over_zero_offload": mean["teraio_mixed"] / mean["zero_offload"],
            "mixed_stall_share_of_iteration": (sum(i["stall_seconds"] for i in its)
                                               / sum(i["seconds"] for i in its)),
            "mixed_losses_equal_ideal": all(row["losses"] == ideal_losses for _, row, _ in mixed),
            "mixed_final_params_sha256": sorted({row.get("final_params_sha256") for _, row, _ in mixed}),
            "simulator": {
                "runs": replays,
                "mean_predicted_over_measured": (statistics.fmean(r["predicted_iteration_seconds"] for r in replays)
                                                 / statistics.fmean(r["measured_iteration_seconds"] for r in replays)),
                "runs_within_10_percent": sum(abs(r["predicted_over_measured"] - 1) <= 0.10 for r in replays),
            },
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", type=Path, help="folder of job folders")
    ap.add_argument("--json", type=Path, required=True, help="benchmarks.engine_bandwidth's JSON; gets the fig7_h200 key")
    ap.add_argument("--experiment", type=Path, default=Path("conf/experiment/fig7_h200_m_only.yaml"),
                    help="the experiment file naming the points")
    args = ap.parse_args()
    bench = json.loads(args.json.read_text())
    tiers = TierBandwidth(bench["ssd_write_gbps"], bench["ssd_read_gbps"], bench["host_d2h_gbps"],
                          bench["host_h2d_gbps"])
    section = summarize(args.rows, tiers, point_names(args.experiment))
    bench["fig7_h200"] = {"command": command("benchmarks.engine_fig7_summary", sys.argv[1:]),
                          "simulator_tiers_gbps": dataclasses.asdict(tiers),
                          "points": section}
    write_atomic(args.json, (json.dumps(bench, indent=1) + "\n").encode())
    print(json.dumps({k: {kk: v[kk] for kk in ("mean_tokens_per_s", "mixed_of_ideal", "mixed_over_zero_offload",
                                               "mixed_stall_share_of_iteration", "mixed_losses_equal_ideal")}
                      | {"simulator": {kk: v["simulator"][kk] for kk in ("mean_predicted_over_measured",
                                                                          "runs_within_10_percent")}}
                      for k, v in section.items()}, indent=1))


if __name__ == "__main__":
    main()
