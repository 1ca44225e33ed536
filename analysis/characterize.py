"""The paper's characterization of LLM training (§2.1, Fig. 1 and Fig. 2; claims C19, C20)
from saved traces, on the CPU:

    python -m analysis.characterize TRACE [TRACE ...] --out DIR [--capacity-gb 94]

* Fig. 1: memory of all live tensors and of the *active* tensors (those the running op
  itself uses, :meth:`teraio.core.trace.Trace.active_bytes`) per op, as % of a GPU capacity
  (default the paper's 94 GB H100 NVL), log scale.
* Fig. 2: CDF of the tensors' inactive periods in µs, one line per size bucket (the
  paper's legend buckets). An inactive period runs from the end of a use to the start of
  the next (wrapping across the iteration for parameters and optimizer state,
  :func:`teraio.core.planner.inactive_periods`), timed with the trace's kernel times.
* A table per trace: peak and active memory (% of capacity: max and mean over ops), the
  share of tensors per size bucket, and for the 10 MB–1 GB tensors the share whose
  longest inactive period exceeds 10^4 µs and the share longer than their own migration
  at 6.5 GB/s (the paper's C20 comparison).

Writes ``DIR/characterize.{md,tex,csv}`` and ``DIR/fig1_active.{png,pdf}``,
``DIR/fig2_inactive_cdf.{png,pdf}``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from teraio.core.planner import inactive_periods
from teraio.core.trace import Trace
from teraio.perf.jobdir import read_trace

from .figures import new_figure, save_figure, suptitle
from .render import write_table

MB = 1e6
# The paper's Fig. 2 legend buckets (bytes, upper bounds exclusive).
BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("<1 MB", 0, 1 * MB), ("1–10 MB", 1 * MB, 10 * MB), ("10–100 MB", 10 * MB, 100 * MB),
    ("100 MB–1 GB", 100 * MB, 1000 * MB), (">1 GB", 1000 * MB, np.inf))
LONG_US = 1e4            # C20: "inactive for more than 10^4 µs"
MIGRATION_GBPS = 6.5     # C20: "longer than their SSD migration time at 6.5 GB/s"


def trace_label(trace: Trace, path: Path) -> str:
    meta = trace.meta
    name = meta.get("model", path.stem)
    synth = meta.get("synthesized")
    return f"{name} (synthesized from {synth['n_layers_profiled']} layers)" if synth else name


def period_seconds(trace: Trace) -> pd.DataFrame:
    """One row per inactive period of every tensor (inputs excluded): ``tid``, ``nbytes``,
    ``seconds`` (end of the use before to start of the use after; a wrapping period adds
    the iteration's length)."""
    p = inactive_periods(trace, min_tensor_bytes=1)
    start = trace.op_start_seconds()
    n, total = trace.n_ops, start[-1]
    end_of_a = start[p.a + 1]
    b = p.b % n
    start_of_b = start[b] + np.where(p.b >= n, total, 0.0)
    return pd.DataFrame({"tid": p.tid, "nbytes": p.nbytes, "seconds": start_of_b - end_of_a})


def bucket_of(nbytes: np.ndarray) -> np.ndarray:
    out = np.empty(len(nbytes), dtype=object)
    for name, lo, hi in BUCKETS:
        out[(nbytes >= lo) & (nbytes < hi)] = name
    return out


def summary_row(trace: Trace, label: str, capacity_bytes: float) -> dict:
    """The characterization numbers of one trace (module docstring). Percentages are 0–100."""
    live, active = trace.required_bytes(), trace.active_bytes()
    sizes = np.array([t.nbytes for t in trace.tensors if t.kind != "input"])
    row = {"trace": label, "ops": trace.n_ops, "tensors": len(sizes),
           "peak % of capacity": 100 * live.max() / capacity_bytes,
           "active max %": 100 * active.max() / capacity_bytes,
           "active mean %": 100 * active.mean() / capacity_bytes}
    buckets = bucket_of(sizes)
    for name, _, _ in BUCKETS:
        row[f"{name} %"] = 100 * float(np.mean(buckets == name)) if len(sizes) else float("nan")
    per = period_seconds(trace)
    longest = per.groupby("tid").agg(nbytes=("nbytes", "first"), seconds=("seconds", "max"))
    mid = longest[(longest.nbytes >= 10 * MB) & (longest.nbytes < 1000 * MB)]
    row["10 MB–1 GB tensors with a period"] = len(mid)
    row["of them inactive > 10^4 µs %"] = (100 * float(np.mean(mid.seconds * 1e6 > LONG_US))
                                           if len(mid) else float("nan"))
    row["of them inactive > migration at 6.5 GB/s %"] = (
        100 * float(np.mean(mid.seconds > mid.nbytes / (MIGRATION_GBPS * 1e9))) if len(mid) else float("nan"))
    return row


def fig1_active(traces: list[tuple[str, Trace]], capacity_bytes: float) -> Figure:
    """Fig. 1: all vs active tensor memory per op, % of capacity, log y; one panel per trace."""
    fig, axes = new_figure(len(traces), 7.0, 3.0)
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"):
        for ax, (label, trace) in zip(axes, traces):
            x = np.arange(trace.n_ops)
            ax.plot(x, 100 * trace.required_bytes() / capacity_bytes, lw=0.8, label="all")
            ax.plot(x, np.maximum(100 * trace.active_bytes() / capacity_bytes, 1e-3), lw=0.5, label="active")
            ax.set_yscale("log")
            ax.set_xlabel("op index")
            ax.set_ylabel("% of GPU capacity")
            ax.set_title(label, fontsize=8)
            ax.legend(fontsize=7)
    suptitle(fig, f"Fig. 1 — memory of all vs active tensors per op, % of a {capacity_bytes / 1e9:.0f} GB GPU")
    return fig


def fig2_inactive_cdf(traces: list[tuple[str, Trace]]) -> Figure:
    """Fig. 2: CDF of inactive periods (µs, log x), one line per size bucket present."""
    fig, axes = new_figure(len(traces), 7.0, 3.0)
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"):
        for ax, (label, trace) in zip(axes, traces):
            per = period_seconds(trace)
            per["bucket"] = bucket_of(per.nbytes.to_numpy())
            for name, _, _ in BUCKETS:
                us = np.sort(per.loc[per.bucket == name, "seconds"].to_numpy() * 1e6)
                if len(us):
                    ax.step(np.maximum(us, 1e-1), 100 * np.arange(1, len(us) + 1) / len(us), where="post",
                            label=f"{name} ({len(us)})")
            ax.axvline(LONG_US, color="k", lw=0.6, ls=":")
            ax.set_xscale("log")
            ax.set_xlabel("inactive time (µs)")
            ax.set_ylabel("CDF (%)")
            ax.set_title(label, fontsize=8)
            ax.legend(fontsize=6, title="tensor size (periods)", title_fontsize=6)
    suptitle(fig, "Fig. 2 — CDF of inactive periods by tensor size (dotted: 10^4 µs)")
    return fig


def characterize(paths: list[Path], out: Path, capacity_bytes: float = 94e9) -> list[Path]:
    """Write the table and both figures for ``paths`` into ``out``; return the files.

    Raises:
        ValueError: no trace given, or a file that is not a trace or is damaged (named,
            ``teraio.perf.jobdir.read_trace``).
        FileNotFoundError: a missing trace file.
    """
    if not paths:
        raise ValueError("no trace given")
    traces = []
    for p in paths:
        trace = read_trace(p)
        traces.append((trace_label(trace, p), trace))
    table = pd.DataFrame([summary_row(t, label, capacity_bytes) for label, t in traces])
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "characterize.csv", index=False)
    shown = table.map(lambda v: f"{v:.2f}" if isinstance(v, float) else v).astype(object)
    files = write_table(shown, out / "characterize",
                        f"Characterization (paper §2.1, Fig. 1–2): {len(traces)} trace(s), "
                        f"capacity {capacity_bytes / 1e9:.0f} GB",
                        ["Traces: " + ", ".join(str(p) for p in paths),
                         "active = tensors the op itself uses; max and mean over the iteration's ops.",
                         "size shares over all tensors but the token inputs; the last two columns take "
                         "each 10 MB–1 GB tensor's longest inactive period.",
                         "Paper (C19): active < 14 %, 1.7 % on average; (C20): > 40 % of the 10 MB–1 GB "
                         "tensors inactive > 10^4 µs, longer than their migration at 6.5 GB/s."])
    files += save_figure(fig1_active(traces, capacity_bytes), out / "fig1_active")
    files += save_figure(fig2_inactive_cdf(traces), out / "fig2_inactive_cdf")
    return [out / "characterize.csv", *files]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m analysis.characterize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path, help="saved traces (.json or .json.gz)")
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--capacity-gb", type=float, default=94.0,
                    help="GPU capacity for the percentages, GB (default: the paper's 94 GB H100 NVL)")
    args = ap.parse_args(argv)
    if args.capacity_gb <= 0:
        ap.error(f"--capacity-gb {args.capacity_gb}: must be > 0")
    try:
        files = characterize(args.traces, args.out, args.capacity_gb * 1e9)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"python -m analysis.characterize: {e}") from e
    for f in files:
        print(f)


if __name__ == "__main__":
    main()
