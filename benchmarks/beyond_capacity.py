"""Summarise a point whose un-offloaded step does not fit the GPU: Ideal's row, TeraIO-Mixed's
rows (the real capacity and, optionally, an emulated one), and Ideal modeled from the
trace TeraIO-Mixed profiled within the real capacity (``baselines.ideal.run_modeled``).

    python -m benchmarks.beyond_capacity --sweep DIR [--emulated DIR] --out FILE.json

``--sweep``: the sweep dir of ``system=ideal,teraio_mixed`` at the point with no emulated
capacity; ``--emulated``: a sweep dir of ``teraio_mixed`` at the same point with
``hardware.gpu_capacity_bytes`` set. ZeRO-Offload is not run at such a point when the host
cannot hold it: the file says why, from the host memory per parameter that committed
ZeRO-Offload rows measured (``--zero-rows``) and the host's RAM.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from teraio.core.pager import physical_memory_bytes
from teraio.perf import jobdir
from teraio.result import result_row
from baselines.ideal import run_modeled
from teraio.workload.models import build_meta_model, count_parameters


def rows(sweep: Path) -> dict[str, tuple[Path, dict]]:
    """system name -> (job dir, result row) for every row in ``sweep``."""
    out = {}
    for job in jobdir.job_dirs(sweep):
        r = jobdir.result(job)
        out[r["point"]["system"]] = (job, r)
    return out


def last_line(error: str | None) -> str | None:
    lines = [ln for ln in (error or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


def teraio_summary(row: dict, modeled_tps: float | None) -> dict:
    its = row["iterations"]
    return {
        "status": row["status"], "error": last_line(row["error"]),
        "tokens_per_s": row["tokens_per_s"],
        "of_modeled_ideal": row["tokens_per_s"] / modeled_tps if row["tokens_per_s"] and modeled_tps else None,
        "iteration_seconds": [i["seconds"] for i in its],
        "stall_seconds_per_iter": row["stall_seconds"] / len(its) if its else None,
        "stall_count_per_iter": row["stall_count"] / len(its) if its else None,
        "capacity_bytes": row["capacity_bytes"], "capacity_emulated": row["capacity_emulated"],
        "plan_capacity_bytes": (row.get("plan") or {}).get("capacity_bytes"),
        "unoffloaded_peak_bytes": row["unoffloaded_peak_bytes"], "memory_pressure": row["memory_pressure"],
        "peak_allocated_bytes": row["peak_allocated_bytes"],
        "step_peak_allocated_bytes": row["step_peak_allocated_bytes"],
        "profile_seconds": row["profile_seconds"], "plan_compile_seconds": row["plan_compile_seconds"],
        "paged_steps": row["paged_steps"], "plan": row.get("plan"),
        "bytes_per_tier": row["bytes_per_tier"], "peak_host_rss_bytes": row["peak_host_rss_bytes"],
        "wall_seconds": row["wall_seconds"],
    }


def modeled_ideal(job_dir: Path) -> dict:
    """A modeled Ideal row of ``job_dir``'s point from its ``trace.json``."""
    cfg = jobdir.run_config(job_dir)
    cfg = dataclasses.replace(cfg, system=dataclasses.replace(cfg.system, name="ideal", options={}))
    return result_row(cfg.point(), cfg.to_dict(), run_modeled(cfg, job_dir / "trace.json"), status="ok")


def zero_offload_host_bytes(zero_rows: Path, n_params: int) -> dict:
    """Host memory ZeRO-Offload would need for ``n_params`` parameters, scaled from the peak
    resident host memory per parameter of the ok rows under ``zero_rows``."""
    per_param = []
    for job in jobdir.job_dirs(zero_rows, "*zero_offload*"):
        r = jobdir.result(job)
        if r["status"] == "ok" and r["peak_host_rss_bytes"]:
            cfg = jobdir.run_config(job)
            per_param.append(r["peak_host_rss_bytes"] / count_parameters(build_meta_model(cfg.model, 16)))
    if not per_param:
        return {}
    b = min(per_param)
    return {"rows": str(zero_rows), "host_bytes_per_parameter_measured": b,
            "host_bytes_needed": int(b * n_params),
            "host_ram_bytes": physical_memory_bytes()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=Path, required=True)
    ap.add_argument("--emulated", type=Path)
    ap.add_argument("--zero-rows", type=Path, default=Path("runs/reference/h200/fig7_h200_slice"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    found = rows(args.sweep)
    out: dict = {}
    mixed_dir, mixed = found["teraio_mixed"]
    out["point"] = mixed["point"]
    out["capacity_emulated"] = mixed["capacity_emulated"]
    if "ideal" in found:
        ideal = found["ideal"][1]
        out["ideal"] = {"status": ideal["status"], "error": last_line(ideal["error"]),
                        "tokens_per_s": ideal["tokens_per_s"], "peak_allocated_bytes": ideal["peak_allocated_bytes"]}
    modeled_tps = None
    if (mixed_dir / "trace.json").is_file():
        modeled = modeled_ideal(mixed_dir)
        modeled_tps = modeled["tokens_per_s"]
        out["ideal_modeled_iteration_seconds"] = modeled["iterations"][0]["seconds"]
        out["ideal_modeled_from"] = "the trace.json of the teraio_mixed row (kernel times, summed)"
    out["ideal_modeled_tokens_per_s"] = modeled_tps
    out["teraio_mixed"] = teraio_summary(mixed, modeled_tps)
    if modeled_tps and mixed["profile_seconds"]:
        out["teraio_mixed"]["profile_over_modeled_ideal_iteration"] = (
            mixed["profile_seconds"] / out["ideal_modeled_iteration_seconds"])
    if args.emulated is not None:
        out["teraio_mixed_emulated"] = teraio_summary(rows(args.emulated)["teraio_mixed"][1], modeled_tps)
    cfg = jobdir.run_config(mixed_dir)
    n_params = count_parameters(build_meta_model(cfg.model, cfg.workload.seq_len))
    need = zero_offload_host_bytes(args.zero_rows, n_params)
    out["zero_offload"] = {"status": "not run", "parameters": n_params, **need,
                           "why": "the host cannot hold it" if need and need["host_bytes_needed"] > need["host_ram_bytes"]
                           else "not run here"}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("capacity_emulated", "ideal_modeled_tokens_per_s")}),
          json.dumps({k: out["teraio_mixed"][k] for k in ("status", "tokens_per_s", "of_modeled_ideal",
                                                          "stall_seconds_per_iter", "peak_allocated_bytes",
                                                          "profile_seconds")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
