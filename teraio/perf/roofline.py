"""Roofline of normalized throughput vs migration bandwidth (paper §2.2, Fig. 3), modeled.

For each saved trace and each migration bandwidth, plan with Algorithm 1
(:func:`teraio.core.planner.plan_migrations`, SSD only, every direction at that bandwidth) and
replay the plan with the performance model (:func:`teraio.perf.simulator.simulate`), under
each requested channel policy. Normalized throughput = Ideal / predicted iteration time.
When no hidden plan fits, the planner adds exposed migrations (``allow_stalls``), whose
waits the model charges: that is how the paper's runtime behaves when memory cannot
otherwise fit, and what makes throughput fall at low bandwidth.

Edge cases, explicitly:

* **0 GB/s** (the figure's left end): nothing can move. A trace whose un-offloaded peak
  exceeds the capacity cannot run at all, so it trains 0 tokens/s: normalized throughput
  0, infinite iteration and stall time, ``stop_reason="no_bandwidth"``. One that fits
  runs at Ideal (1).
* **Capacity below what single ops need** (the ops' own operands exceed it): no
  bandwidth makes it run and the model says nothing; ``normalized_throughput = NaN``.

Every row is labelled ``modeled``.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from teraio.core.bandwidth import TierBandwidth
from teraio.core.planner import plan_migrations
from teraio.core.trace import Trace
from teraio.perf.jobdir import read_trace
from teraio.perf.simulator import POLICIES, simulate

BANDWIDTHS_GBPS: tuple[float, ...] = (0, 4, 8, 12, 16, 24, 32, 48, 64)  # paper Fig. 3's x ticks
OUTPUT_FILES: tuple[str, ...] = ("roofline.csv", "roofline.parquet", "fig3_roofline.png", "fig3_roofline.pdf")


def roofline(traces: dict[str, Trace], capacities: dict[str, int],
             bandwidths_gbps: tuple[float, ...] = BANDWIDTHS_GBPS, policies: tuple[str, ...] = ("fifo",),
             progress: bool = True) -> pd.DataFrame:
    """One row per (model, bandwidth, policy); the plan at a bandwidth is shared by the
    policies, which only change how the simulator orders transfers on a channel.

    Args:
        traces: model name -> its trace.
        capacities: model name -> GPU capacity to plan for, bytes (the paper's
            ``peak / M``).
        bandwidths_gbps: migration bandwidths per GPU, GB/s, each >= 0.
        policies: the simulator's channel orders (``teraio.perf.simulator.POLICIES``).
        progress: show a tqdm bar.

    Returns:
        a tidy DataFrame with columns ``model, bandwidth_gbps, policy,
        normalized_throughput, iteration_seconds, ideal_seconds, stall_seconds,
        stall_count, capacity_bytes, peak_bytes, memory_pressure, feasible,
        shortfall_bytes, n_migrations, n_exposed, stop_reason, plan_compile_seconds,
        n_ops, synthesized, measure ("modeled"), modeled (True)``.

    Raises:
        ValueError: a model without a capacity, a negative or non-finite bandwidth, an
            unknown policy.
    """
    missing = sorted(set(traces) - set(capacities))
    if missing:
        raise ValueError(f"no capacity given for {missing}; capacities has {sorted(capacities)}")
    bad = [bw for bw in bandwidths_gbps if not (math.isfinite(bw) and bw >= 0)]
    if bad:
        raise ValueError(f"bandwidths_gbps {bad}: each must be a finite number of GB/s >= 0")
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        raise ValueError(f"policies={list(policies)}; give one or more of {POLICIES}")
    rows = []
    points = [(m, bw) for m in traces for bw in bandwidths_gbps]
    for model, bw in tqdm(points, desc="roofline", disable=not progress):
        trace, cap = traces[model], int(capacities[model])
        peak, ideal = trace.peak_bytes(), float(trace.op_seconds.sum())
        common = {"model": model, "bandwidth_gbps": float(bw), "ideal_seconds": ideal,
                  "capacity_bytes": cap, "peak_bytes": peak, "memory_pressure": peak / cap,
                  "n_ops": trace.n_ops, "synthesized": "synthesized" in trace.meta,
                  "measure": "modeled", "modeled": True}
        if bw == 0:
            fits = peak <= cap
            for policy in policies:
                rows.append({**common, "policy": policy, "normalized_throughput": float(fits),
                             "iteration_seconds": ideal if fits else math.inf,
                             "stall_seconds": 0.0 if fits else math.inf, "stall_count": 0,
                             "feasible": fits, "shortfall_bytes": max(0, peak - cap), "n_migrations": 0,
                             "n_exposed": 0, "stop_reason": "fits" if fits else "no_bandwidth",
                             "plan_compile_seconds": 0.0})
            continue
        tiers = TierBandwidth.uniform(float(bw))
        plan = plan_migrations(trace, cap, tiers, host_cap_bytes=0, allow_stalls=True, shared_ssd=False)
        for policy in policies:
            sim = simulate(trace, plan, tiers, policy=policy)
            rows.append({
                **common, "policy": policy,
                "normalized_throughput": sim.normalized_throughput if plan.feasible else np.nan,
                "iteration_seconds": sim.iteration_seconds, "stall_seconds": sim.stall_seconds,
                "stall_count": sim.stall_count, "feasible": plan.feasible,
                "shortfall_bytes": plan.shortfall_bytes, "n_migrations": len(plan.migrations),
                "n_exposed": plan.meta["n_exposed"], "stop_reason": plan.meta["stop_reason"],
                "plan_compile_seconds": plan.meta["compile_seconds"],
            })
    return pd.DataFrame(rows)


def plot_roofline(df: pd.DataFrame, policy: str = "fifo", ax=None):
    """Paper Fig. 3: one line per model, normalized throughput vs bandwidth (GB/s), from
    the rows of ``policy``.

    Returns:
        the matplotlib Axes (a new Figure's if ``ax`` is None; no pyplot state is used).

    Raises:
        ValueError: ``df`` has no row of ``policy``.
    """
    import seaborn as sns
    from matplotlib.figure import Figure

    rows = df[df["policy"] == policy]
    if rows.empty:
        raise ValueError(f"no roofline rows with policy={policy!r}; the table has {sorted(set(df['policy']))}")
    if ax is None:
        ax = Figure(figsize=(5.0, 3.5), layout="constrained").subplots()
    sns.lineplot(data=rows, x="bandwidth_gbps", y="normalized_throughput", hue="model", style="model",
                 markers=True, dashes=False, ax=ax)
    ax.set_xlabel("Available Migration Bandwidth (GB/s)")
    ax.set_ylabel("Normalized Throughput (modeled)")
    ax.set_title(f"Roofline, modeled ({policy.upper()} channels)", fontsize="medium")
    ax.set_xticks(list(BANDWIDTHS_GBPS))
    right = max(64.0, float(rows["bandwidth_gbps"].max()))
    ax.set_xlim(-0.03 * right, 1.04 * right)  # markers at 0 and at the last bandwidth whole
    ax.set_ylim(0.0, 1.05)
    ax.grid(alpha=0.3)
    return ax


def save_roofline(df: pd.DataFrame, out_dir: str | Path, policy: str = "fifo") -> list[Path]:
    """Write ``OUTPUT_FILES`` to ``out_dir`` (made if missing): the table as CSV and
    Parquet, the figure (``policy``'s rows) as PNG and PDF. Returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / OUTPUT_FILES[0], index=False)
    df.to_parquet(out / OUTPUT_FILES[1], index=False)
    fig = plot_roofline(df, policy).figure
    for name in OUTPUT_FILES[2:]:
        fig.savefig(out / name, dpi=200)
    return [out / name for name in OUTPUT_FILES]


def main(trace_paths: list[str | Path], capacities: list[int], out_dir: str | Path,
         bandwidths_gbps: tuple[float, ...] = BANDWIDTHS_GBPS, policies: tuple[str, ...] = ("fifo",)
         ) -> pd.DataFrame:
    """Roofline from saved traces (``.json`` or ``.json.gz``): writes ``OUTPUT_FILES`` to
    ``out_dir`` (the figure from ``policies[0]``) and returns the table.

    A trace's model name is ``trace.meta["model"]``, else its file name without suffix.

    Raises:
        ValueError: as many capacities (bytes) as traces are needed; duplicate model names.
    """
    if len(trace_paths) != len(capacities):
        raise ValueError(f"{len(trace_paths)} trace(s) but {len(capacities)} capacity value(s); "
                         "give one capacity in bytes per trace")
    traces: dict[str, Trace] = {}
    caps: dict[str, int] = {}
    for path, cap in zip(trace_paths, capacities):
        trace = read_trace(path)  # a damaged file: a ValueError naming it
        name = str(trace.meta.get("model") or Path(path).name.split(".")[0])
        if name in traces:
            raise ValueError(f"two traces are named {name!r} ({path}); model names must differ")
        traces[name], caps[name] = trace, int(cap)
    df = roofline(traces, caps, bandwidths_gbps, policies=policies)
    save_roofline(df, out_dir, policies[0])
    return df
