"""Roofline of normalized throughput vs migration bandwidth (paper §2.2, Fig. 3), modeled.

For each saved trace and each migration bandwidth, plan with Algorithm 1
(:func:`teraio.planner.plan_migrations`, SSD only, every direction at that bandwidth) and
replay the plan with the performance model (:func:`teraio.simulator.simulate`).
Normalized throughput = Ideal / predicted iteration time. When no hidden plan fits, the
planner adds exposed migrations (``allow_stalls``), whose waits the model charges: that
is how the paper's runtime behaves when memory cannot otherwise fit, and what makes
throughput fall at low bandwidth. A configuration whose tensors cannot fit at all
(the ops' own operands exceed the capacity) gets ``normalized_throughput = NaN``.
Every row is labelled ``modeled``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from teraio.planner import TierBandwidth, plan_migrations
from teraio.simulator import simulate
from teraio.trace import Trace

BANDWIDTHS_GBPS: tuple[float, ...] = (4, 8, 12, 16, 24, 32, 48, 64)  # paper Fig. 3's x ticks


def roofline(traces: dict[str, Trace], capacities: dict[str, int],
             bandwidths_gbps: tuple[float, ...] = BANDWIDTHS_GBPS, policy: str = "fifo",
             progress: bool = True) -> pd.DataFrame:
    """One row per (model, bandwidth).

    Args:
        traces: model name -> its trace.
        capacities: model name -> GPU capacity to plan for, bytes (the paper's
            ``peak / M``).
        bandwidths_gbps: migration bandwidths per GPU, GB/s.
        policy: the simulator's channel order, ``"fifo"`` or ``"edf"``.
        progress: show a tqdm bar.

    Returns:
        a tidy DataFrame with columns ``model, bandwidth_gbps, normalized_throughput,
        iteration_seconds, ideal_seconds, stall_seconds, stall_count, capacity_bytes,
        memory_pressure, feasible, shortfall_bytes, n_migrations, n_exposed,
        plan_compile_seconds, policy, measure ("modeled"), modeled (True)``.

    Raises:
        ValueError: a model without a capacity.
    """
    missing = sorted(set(traces) - set(capacities))
    if missing:
        raise ValueError(f"no capacity given for {missing}; capacities has {sorted(capacities)}")
    rows = []
    points = [(m, bw) for m in traces for bw in bandwidths_gbps]
    for model, bw in tqdm(points, desc="roofline", disable=not progress):
        trace, cap = traces[model], int(capacities[model])
        tiers = TierBandwidth.uniform(float(bw))
        plan = plan_migrations(trace, cap, tiers, host_cap_bytes=0, allow_stalls=True)
        sim = simulate(trace, plan, tiers, policy=policy)
        rows.append({
            "model": model, "bandwidth_gbps": float(bw),
            "normalized_throughput": sim.normalized_throughput if plan.feasible else np.nan,
            "iteration_seconds": sim.iteration_seconds, "ideal_seconds": sim.ideal_seconds,
            "stall_seconds": sim.stall_seconds, "stall_count": sim.stall_count,
            "capacity_bytes": cap, "memory_pressure": plan.baseline_peak_bytes / cap,
            "feasible": plan.feasible, "shortfall_bytes": plan.shortfall_bytes,
            "n_migrations": len(plan.migrations), "n_exposed": plan.meta["n_exposed"],
            "plan_compile_seconds": plan.meta["compile_seconds"], "policy": policy,
            "measure": "modeled", "modeled": True,
        })
    return pd.DataFrame(rows)


def plot_roofline(df: pd.DataFrame, ax=None):
    """Paper Fig. 3: one line per model, normalized throughput vs bandwidth (GB/s).

    Returns:
        the matplotlib Axes (a new Figure's if ``ax`` is None; no pyplot state is used).
    """
    import seaborn as sns
    from matplotlib.figure import Figure

    if ax is None:
        ax = Figure(figsize=(5.0, 3.5), layout="constrained").subplots()
    sns.lineplot(data=df, x="bandwidth_gbps", y="normalized_throughput", hue="model", style="model",
                 markers=True, dashes=False, ax=ax)
    ax.set_xlabel("Available Migration Bandwidth (GB/s)")
    ax.set_ylabel("Normalized Throughput (modeled)")
    ax.set_xticks([0, *BANDWIDTHS_GBPS])
    ax.set_xlim(0, max(64.0, float(df["bandwidth_gbps"].max())))
    ax.set_ylim(0.0, 1.05)
    ax.grid(alpha=0.3)
    return ax


def main(trace_paths: list[str | Path], capacities: list[int], out_dir: str | Path,
         bandwidths_gbps: tuple[float, ...] = BANDWIDTHS_GBPS, policy: str = "fifo") -> pd.DataFrame:
    """Roofline from saved traces: writes ``roofline.csv``, ``roofline.parquet``,
    ``fig3_roofline.png`` and ``fig3_roofline.pdf`` to ``out_dir`` and returns the table.

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
        trace = Trace.load(path)
        name = str(trace.meta.get("model") or Path(path).stem)
        if name in traces:
            raise ValueError(f"two traces are named {name!r} ({path}); model names must differ")
        traces[name], caps[name] = trace, int(cap)
    df = roofline(traces, caps, bandwidths_gbps, policy=policy)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "roofline.csv", index=False)
    df.to_parquet(out / "roofline.parquet", index=False)
    fig = plot_roofline(df).figure
    for suffix in ("png", "pdf"):
        fig.savefig(out / f"fig3_roofline.{suffix}", dpi=200)
    return df
