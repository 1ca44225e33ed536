"""The paper's evaluation figures (seaborn 0.13 + matplotlib), one function per figure.

Each function takes a loaded :class:`load.Sweep` and returns a matplotlib ``Figure`` (not
attached to pyplot, so nothing global is touched), or raises :class:`NoData` saying why
the sweep cannot draw it. Every title carries :func:`load.describe` (sweep, trials,
hardware). Artists carry a ``gid`` so tests and readers can find them: ``"bar"`` (Fig. 7
bars), ``"failed"`` (× marks), ``"stall"``/``"overlapped"``/``"compute"``/``"total"``
(Fig. 8 segments), ``"series"``/``"ideal"`` (Fig. 9 lines), ``"offload"``/``"prefetch"``
(Fig. 10 lines). Fig. 10(1)'s areas, one point per op, are rasterized in the PDF (axes and
text stay vector), so its size does not grow with a run's op count.

- Fig. 7: tokens/s per config (x) and system (hue), bars = mean of ok trials at the
  system's best micro-batch, error bars = 95 % t interval, × = every trial failed, M under
  each config; one panel per model × hardware (× host-memory cap × SSD count when the
  sweep varies them).
- Fig. 8: mean iteration time split into stall / migration overlapped with compute /
  compute, from the per-iteration frame; systems that report no stall or migration time
  are drawn as the total only, labelled "not instrumented".
- Fig. 9: tokens/s vs host-memory cap (``hardware.host_mem_cap_bytes``, GiB), one line per
  system and SSD count (``len(hardware.ssd_dirs)``); Ideal as a dashed line.
- Fig. 10: migration GB/s over op index, offload and prefetch, from ``transfers.csv`` and
  ``oplog.csv`` of the first ok trial (see :mod:`analysis.bandwidth`).
- Fig. 10(1): live bytes by kind over one iteration, from the profiled trace
  (:mod:`analysis.breakdown`).
"""
from __future__ import annotations

import math
import re
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from teraio import systems as registry

from . import aggregate as agg
from .bandwidth import run_bandwidth
from .load import Sweep, config_label, describe, run_trace
from .stats import t_interval

BAR_WIDTH = 0.8  # seaborn's default; bars of n hue levels sit at i + (j - (n-1)/2) * 0.8/n
GIB = 2**30
SEGMENTS = (("stall", "migration stall"), ("overlapped", "migration overlapped with compute"),
            ("compute", "compute"))
SEGMENT_COLORS = {"stall": "#d62728", "overlapped": "#ff7f0e", "compute": "#1f77b4"}


class NoData(Exception):
    """The sweep holds no data for this figure; the message says what is missing."""


def system_palette(systems) -> dict[str, tuple]:
    """A fixed colour per system (by the paper's series order), so figures agree."""
    order = registry.legend_order()
    base = sns.color_palette("colorblind", len(order) + len(systems))
    extra = iter(base[len(order):])
    return {s: base[order.index(s)] if s in order else next(extra)
            for s in systems}


def slot(i: int, j: int, n: int) -> float:
    """x centre of hue level ``j`` of ``n`` at category ``i`` (seaborn's dodge geometry)."""
    return i + (j - (n - 1) / 2) * BAR_WIDTH / n


def _systems(df: pd.DataFrame) -> list[str]:
    return sorted(df["system"].dropna().unique(), key=lambda s: (agg.system_rank(s), s))


def _facets(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Panels per model × hardware, split further by (host cap, SSDs, pipeline stages) only
    where a model × hardware has more than one."""
    out = []
    for (model, hw), g in df.groupby(["model", "hardware"], dropna=False, sort=True):
        variants = list(g.groupby(agg.VARIANT_KEYS, dropna=False, sort=True))
        for (cap, n_ssd, stages), v in variants:
            title = f"{model} · {hw}"
            if len(variants) > 1:
                cap_text = "n/a" if pd.isna(cap) else f"{cap / GIB:g} GiB"
                ssd_text = "n/a" if pd.isna(n_ssd) else str(int(n_ssd))
                title += f" · host cap {cap_text}, {ssd_text} SSD(s)" + (f", {stages} stages" if stages > 1 else "")
            out.append((title, v))
    return out


def _configs(g: pd.DataFrame) -> list[str]:
    order = g.sort_values(["batch_size", "seq_len"], na_position="last")["config"]
    return list(dict.fromkeys(order))


def _failed_mark(ax, x: float, color) -> None:
    ax.plot([x], [0], marker="x", markersize=9, markeredgewidth=2, color=color, ls="none",
            gid="failed", clip_on=False, zorder=5)


def suptitle(fig: Figure, text: str, fontsize: float = 9) -> None:
    """The figure's title, each line wrapped to the figure's width (a narrow figure, e.g.
    one configuration, would otherwise cut a long title off at both edges)."""
    chars = max(20, int(fig.get_figwidth() * 72 / (0.6 * fontsize)))  # ~0.6 em per character
    lines = [_wrap_phrases(line, chars) for line in text.split("\n")]
    fig.suptitle("\n".join(lines), fontsize=fontsize)


def _wrap_phrases(line: str, chars: int) -> str:
    """``line`` broken into lines of at most ``chars`` where possible, between phrases (after
    ``;`` or before ``(``) rather than inside one; a phrase longer than a line is wrapped
    by words."""
    import re

    phrases = [p for p in re.split(r"(?<=;)\s+|\s+(?=\()", line) if p]
    out, cur = [], ""
    for p in phrases:
        if cur and len(cur) + 1 + len(p) > chars:
            out.append(cur)
            cur = ""
        cur = f"{cur} {p}" if cur else p
    out.append(cur)
    return "\n".join(textwrap.fill(x, chars) for x in out)


def new_figure(n_panels: int, width: float, height: float = 3.4) -> tuple[Figure, list]:
    fig = Figure(figsize=(width, height * n_panels + 0.8), layout="constrained")
    return fig, list(fig.subplots(n_panels, 1, squeeze=False)[:, 0])


def fig7_throughput(sweep: Sweep) -> Figure:
    """Fig. 7: grouped bars of tokens/s per config and system (see module doc).

    Raises:
        NoData: no run has a system.
    """
    best = agg.select_best(agg.summarize_runs(sweep.runs))
    best = best[best["system"].notna()]
    if best.empty:
        raise NoData("no run names a system")
    systems = _systems(best)
    palette = system_palette(systems)
    ok = sweep.runs[~sweep.runs["failed"]].merge(best[agg.GROUP_KEYS], on=agg.GROUP_KEYS)
    facets = _facets(best)
    n_cfg = max(len(_configs(g)) for _, g in facets)
    fig, axes = new_figure(len(facets), max(6.0, 0.45 * n_cfg * len(systems) + 2))
    n_sys = len(systems)
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"):
        for k, (ax, (title, g)) in enumerate(zip(axes, facets)):
            configs = _configs(g)
            data = ok.merge(g[agg.GROUP_KEYS], on=agg.GROUP_KEYS)
            if len(data):
                sns.barplot(data=data, x="config", y="tokens_per_s", hue="system", order=configs,
                            hue_order=systems, palette=palette, errorbar=t_interval, capsize=0.15,
                            dodge=True,  # else seaborn widens bars where a config has one system
                            err_kws={"linewidth": 1}, legend=False, ax=ax)
            by_slot = {(configs.index(r["config"]), systems.index(r["system"])): r
                       for _, r in g.iterrows()}
            for p in ax.patches:
                centre = p.get_x() + p.get_width() / 2
                for (i, j), r in by_slot.items():
                    if abs(centre - slot(i, j, n_sys)) < 1e-6 and r["n"] > 0:
                        p.set_gid("bar")
                        if r["measure"] == "modeled":
                            p.set_hatch("//")
            for (i, j), r in by_slot.items():
                if r["n"] == 0:
                    _failed_mark(ax, slot(i, j, n_sys), palette[systems[j]])
            m = g.groupby("config")["memory_pressure"].median()
            ax.set_xticks(range(len(configs)))
            ax.set_xticklabels([f"{c}\nM={100 * m.get(c):.0f}%" if pd.notna(m.get(c)) else
                                f"{c}\nM=n/a" for c in configs])
            ax.set_xlim(-0.5, len(configs) - 0.5)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("")
            ax.set_ylabel("tokens/s")
            ax.set_title(title)
        handles = [Patch(facecolor=palette[s], label=agg.system_label(s)) for s in systems]
        if (best["n"] == 0).any():
            handles.append(Line2D([], [], marker="x", color="k", ls="none", label="failed (OOM/error/timeout)"))
        if (best["measure"] == "modeled").any():
            handles.append(Patch(facecolor="white", edgecolor="k", hatch="//", label="modeled"))
        fig.legend(handles=handles, fontsize=7, ncols=min(len(handles), 4), loc="outside lower center")
    cut = (best["tokens_per_s_mean"] - best["tokens_per_s_ci95"] < 0).any()
    suptitle(fig, "Fig. 7 — average training throughput (bars: mean of ok trials; error bars: "
              f"95% t-CI{', cut at 0' if cut else ''}; M: memory pressure)\n{describe(sweep)}")
    return fig


def fig8_breakdown(sweep: Sweep) -> Figure:
    """Fig. 8: per-iteration time split into stall / overlapped migration / compute.

    Raises:
        NoData: no ok run recorded a measured iteration.
    """
    its = agg.summarize_iterations(sweep.iterations)
    if its.empty or "n" not in its.columns:
        raise NoData("no ok run recorded a measured iteration")
    best = agg.select_best(agg.summarize_runs(sweep.runs))
    best = best[best["system"].notna()]
    its = its.merge(best[agg.GROUP_KEYS], on=agg.GROUP_KEYS)
    if its.empty:
        raise NoData("no measured iteration at a system's best micro-batch")
    failed = best[best["n"] == 0]
    systems = _systems(best)
    palette = system_palette(systems)
    facets = _facets(pd.concat([its, failed], ignore_index=True))
    n_cfg = max(len(_configs(g)) for _, g in facets)
    n_sys = len(systems)
    fig, axes = new_figure(len(facets), max(6.0, 0.5 * n_cfg * n_sys + 2), 3.8)
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"):
        for ax, (title, g) in zip(axes, facets):
            configs = _configs(g)
            ticks, labels = [], []
            for _, r in g.iterrows():
                i, j = configs.index(r["config"]), systems.index(r["system"])
                x, w = slot(i, j, n_sys), BAR_WIDTH / n_sys
                ticks.append(x)
                labels.append(f"{r['config']}\n{agg.system_label(r['system'])}")
                if pd.isna(r.get("n")) or r.get("n", 0) == 0 or pd.isna(r.get("seconds_mean")):
                    _failed_mark(ax, x, palette[r["system"]])
                elif r["instrumented"]:
                    bottom = 0.0
                    for seg, _ in SEGMENTS:
                        h = max(0.0, float(r[f"{seg}_seconds_mean"]))
                        ax.bar(x, h, w, bottom=bottom, color=SEGMENT_COLORS[seg],
                               edgecolor=palette[r["system"]], linewidth=1.5, gid=seg)
                        bottom += h
                else:
                    ax.bar(x, r["seconds_mean"], w, color="0.88", edgecolor=palette[r["system"]],
                           linewidth=1.5, gid="total")
                    ax.text(x, r["seconds_mean"] / 2, "total only:\nnot instrumented", rotation=90,
                            ha="center", va="center", fontsize=7,
                            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.5})
            order = np.argsort(ticks)
            ax.set_xticks(np.asarray(ticks)[order])
            ax.set_xticklabels(np.asarray(labels, dtype=object)[order], rotation=90, fontsize=6)
            ax.set_xlim(-0.5, len(configs) - 0.5)
            ax.set_ylim(bottom=0)
            ax.set_ylabel("seconds per iteration")
            ax.set_title(title)
        handles = [Patch(facecolor=SEGMENT_COLORS[s], label=lab) for s, lab in SEGMENTS]
        handles.append(Patch(facecolor="0.88", label="total only (not instrumented)"))
        if len(failed):
            handles.append(Line2D([], [], marker="x", color="k", ls="none", label="failed"))
        fig.legend(handles=handles, fontsize=7, ncols=3, loc="outside lower center")
    suptitle(fig, "Fig. 8 — latency breakdown of a training iteration (mean over ok trials)\n"
              f"{describe(sweep)}")
    return fig


def machine_of(hardware: str) -> str:
    """The machine a hardware name stands for: without the ``-<n>ssd-<cap>gb`` the Fig. 9
    experiments add (``paper_h100nvl-2ssd-16gb`` → ``paper_h100nvl``; ``h200-1ssd-4gb on NVIDIA
    H200`` → ``h200 on NVIDIA H200``, the card kept: ``load.hardware_label``)."""
    return re.sub(r"-\d+ssd-\d+gb(?= on |$)", "", str(hardware))


def fig9_host_memory(sweep: Sweep) -> Figure:
    """Fig. 9: tokens/s vs host-memory cap, one line per system and SSD count, a panel per
    model, workload and machine (:func:`machine_of`: the experiments name each point's hardware
    after its knobs, ``<machine>-<n>ssd-<cap>gb``, so that its job dir is its own). Ideal, and
    a system the cap does not bind (no host tier, ``SystemSpec.host_tier``) run at one cap of
    the panel, are horizontal reference lines (gid ``ideal`` and ``reference``).

    Raises:
        NoData: no system was run at two or more host-memory caps of one workload.
    """
    best = agg.select_best(agg.summarize_runs(sweep.runs))
    best = best[best["system"].notna() & best["host_mem_cap_bytes"].notna()]
    best = best.assign(machine=best["hardware"].map(machine_of))
    series_keys = ["model", "machine", "batch_size", "seq_len", "system", "n_ssd"]
    others = best[best["system"] != "ideal"]
    caps = others.groupby(series_keys, dropna=False)["host_mem_cap_bytes"].nunique()
    panels = caps[caps >= 2].reset_index()[["model", "machine", "batch_size", "seq_len"]]
    panels = panels.drop_duplicates()
    if panels.empty:
        raise NoData("no system was run at two or more host-memory caps (hardware."
                     "host_mem_cap_bytes) of one model and workload")
    ideal = agg.select_best(agg.summarize_runs(sweep.runs))
    ideal = ideal[(ideal["system"] == "ideal") & (ideal["n"] > 0)]
    ideal = ideal.assign(machine=ideal["hardware"].map(machine_of))
    palette = system_palette(_systems(best))
    styles = {"teraio_mixed": "-", "teraio_ssd": "--"}
    fig, axes = new_figure(len(panels), 6.5)
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"):
        for ax, (_, p) in zip(axes, panels.iterrows()):
            keys = p.to_dict()
            sel = others.merge(panels.loc[[p.name]], on=list(keys))
            n_ssds = sorted(sel["n_ssd"].dropna().unique())
            shades = sns.color_palette("crest", max(len(n_ssds), 1))
            for (system, n_ssd), s in sel.groupby(["system", "n_ssd"], dropna=False, sort=False):
                s = s.sort_values("host_mem_cap_bytes")
                if len(s) == 1 and system in registry.names() and not registry.get(system).host_tier:
                    _reference_line(ax, s.iloc[0], palette[system])
                    continue
                x = (s["host_mem_cap_bytes"] / GIB).to_numpy(float)
                good = (s["n"] > 0).to_numpy()
                color = (shades[n_ssds.index(n_ssd)] if system in styles and pd.notna(n_ssd)
                         else palette[system])
                ssd_text = "n/a" if pd.isna(n_ssd) else str(int(n_ssd))
                if good.any():
                    bars = ax.errorbar(
                        x[good], s["tokens_per_s_mean"].to_numpy(float)[good],
                        yerr=np.nan_to_num(s["tokens_per_s_ci95"].to_numpy(float)[good]),
                        marker="o", capsize=3, ls=styles.get(system, ":"), color=color,
                        label=f"{agg.system_label(system)}, {ssd_text} SSD(s)")
                    bars.lines[0].set_gid("series")
                for xf in x[~good]:
                    _failed_mark(ax, xf, color)
            row = ideal.merge(panels.loc[[p.name]], on=list(keys))
            if len(row):
                ax.axhline(float(row["tokens_per_s_mean"].max()), ls="--", color="0.4",
                           label="Ideal", gid="ideal")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("available host memory (GiB)")
            ax.set_ylabel("tokens/s")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{keys['model']} · {keys['machine']} · "
                         f"{config_label(keys['batch_size'], keys['seq_len'])}")
            ax.legend(fontsize=7)
    any_failed = (others["n"] == 0).any()
    suptitle(fig, "Fig. 9 — throughput vs host-memory capacity and SSDs (error bars: 95% t-CI"
              + ("; × failed" if any_failed else "") + f")\n{describe(sweep)}")
    return fig


def _reference_line(ax, row, color) -> None:
    """A system run at one host-memory cap of a Fig. 9 panel that the cap does not bind: its
    mean tokens/s across the panel (dotted), or, where it failed, a legend entry saying so."""
    label = agg.system_label(row["system"])
    if row["n"] > 0:
        ax.axhline(float(row["tokens_per_s_mean"]), ls=":", color=color, label=label, gid="reference")
    else:
        ax.plot([], [], ls="none", marker="x", color=color, label=f"{label}: {row['failures']}",
                gid="reference_failed")


def fig10_bandwidth(sweep: Sweep) -> tuple[Figure, pd.DataFrame]:
    """Fig. 10: migration bandwidth over op index per run with an engine log, and a frame of
    (model, hardware, config, system, job_dir, step, share_above_16gbps).

    Raises:
        NoData: no ok run lists both ``transfers`` and ``oplog`` artifacts.
    """
    best = agg.select_best(agg.summarize_runs(sweep.runs))
    cand = best[(best["n"] > 0) & best["transfers_path"].notna() & best["oplog_path"].notna()]
    if cand.empty:
        raise NoData("no ok run lists both a 'transfers' and an 'oplog' artifact "
                     "(the TeraIO engine's transfer and op logs)")
    panels, rows = [], []
    for _, r in cand.iterrows():
        try:
            bins, step, share = run_bandwidth(sweep.root, r["transfers_path"], r["oplog_path"])
        except (OSError, ValueError) as e:
            warnings.warn(f"Fig. 10: skipping {r['job_dir']}: {e}", stacklevel=2)
            continue
        panels.append((r, bins, step, share))
        rows.append({"model": r["model"], "hardware": r["hardware"], "config": r["config"],
                     "host_mem_cap_bytes": r["host_mem_cap_bytes"], "n_ssd": r["n_ssd"],
                     "system": r["system"], "job_dir": r["job_dir"], "step": step,
                     "share_above_16gbps": share})
    if not panels:
        raise NoData("every run's transfer/op log was unreadable (see warnings)")
    fig, axes = new_figure(len(panels), 7.0, 3.0)
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"):
        for ax, (r, bins, step, share) in zip(axes, panels):
            ax.plot(bins["op"], bins["offload_gbps"], lw=0.8, label="offload (eviction from GPU)",
                    gid="offload")
            ax.plot(bins["op"], bins["prefetch_gbps"], lw=0.8, label="prefetch (fetching to GPU)",
                    gid="prefetch")
            ax.set_xlabel("op index in one training iteration")
            ax.set_ylabel("migration GB/s")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{r['model']} · {r['hardware']} · {r['config']} · "
                         f"{agg.system_label(r['system'])}\n{r['job_dir']}, step {step}: "
                         f"> 16 GB/s for {100 * share:.1f}% of the step", fontsize=8)
            ax.legend(fontsize=7, loc="upper right")
    suptitle(fig, f"Fig. 10 — migration bandwidth, op by op, over one iteration\n{describe(sweep)}")
    return fig, pd.DataFrame(rows)


def fig10_memory_breakdown(sweep: Sweep) -> Figure:
    """Fig. 10(1) (camera-ready): the un-offloaded step's live bytes by kind over one
    iteration (stacked, GiB against seconds of profiled kernel time), one panel per
    (model, hardware, config, system) from its first ok trial with a trace
    (:mod:`analysis.breakdown`). Areas carry ``gid`` = the group's name.

    Raises:
        NoData: no ok run lists a ``trace`` artifact, or none of theirs can be read (a damaged
            one is left out with a warning naming it, ``load.run_trace``).
    """
    from . import breakdown as bd

    ok = sweep.runs[(~sweep.runs["failed"]) & sweep.runs["trace_path"].notna()]
    if ok.empty:
        raise NoData("no ok run lists a 'trace' artifact (TeraIO's profiled step)")
    firsts = ok.sort_values("trial").groupby(["model", "hardware", "config", "system"], sort=True).head(1)
    traced = [(r, t) for _, r in firsts.iterrows() if (t := run_trace(sweep.root, r["trace_path"])) is not None]
    if not traced:
        raise NoData("no ok run's trace could be read (each damaged one is named in a warning)")
    fig, axes = new_figure(len(traced), 7.0, 3.0)
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"):
        for ax, (r, trace) in zip(axes, traced):
            kinds = trace.live_bytes_by_kind()
            series = {g: sum(kinds[k] for k in ks) for g, ks in bd.GROUPS.items()}
            series[bd.ALLOCATOR] = trace.required_bytes() - trace.live_bytes()
            t = trace.op_start_seconds()[:-1]
            polys = ax.stackplot(t, *[v / GIB for v in series.values()], labels=list(series), lw=0,
                                 rasterized=True)
            for poly, name in zip(polys, series):
                poly.set_gid(name)
            ax.set_xlabel("seconds of profiled kernel time into the iteration")
            ax.set_ylabel("GiB live, nothing offloaded")
            ax.set_title(f"{r['model']} · {r['hardware']} · {r['config']} · "
                         f"{agg.system_label(r['system'])}\n{r['job_dir']}", fontsize=8)
            ax.legend(fontsize=6, loc="upper left", ncol=3)
    suptitle(fig, f"Fig. 10(1) — memory by kind over one iteration\n{describe(sweep)}")
    return fig


def save_figure(fig: Figure, stem: Path) -> list[Path]:
    """Write ``<stem>.png`` (200 dpi) and ``<stem>.pdf``; return both paths. The PDF carries
    no creation date, so the same figure gives the same bytes on every run."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    png, pdf = stem.with_suffix(".png"), stem.with_suffix(".pdf")
    fig.savefig(png, dpi=200)
    fig.savefig(pdf, dpi=200, metadata={"CreationDate": None})
    return [png, pdf]


def share_table_rows(shares: pd.DataFrame) -> pd.DataFrame:
    """Display rows for the C11 table: share of a step above 16 GB/s per Fig. 10 run."""
    return pd.DataFrame({
        "Model": shares["model"], "Hardware": shares["hardware"], "Config": shares["config"],
        "System": shares["system"].map(agg.system_label), "run": shares["job_dir"],
        "step": shares["step"].astype(str),
        "time > 16 GB/s %": shares["share_above_16gbps"].map(
            lambda v: "n/a" if math.isnan(v) else f"{100 * v:.1f}")}).astype(object)
