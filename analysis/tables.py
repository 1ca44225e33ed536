"""The paper's numbers as tables (Markdown + LaTeX): throughput with % of Ideal, speedup over
ZeRO, stalls, bytes moved per tier, peak memory and M.

Which frame each table uses:

- ``throughput``, ``speedup``, ``memory``: the per-run frame (one value per trial:
  ``result["tokens_per_s"]``, peaks, M), aggregated by :func:`aggregate.summarize_runs`.
- ``stalls``, ``bytes``, ``recovery``: the per-iteration frame, averaged per run first and
  then over trials by :func:`aggregate.summarize_iterations`.
- ``tier_rates``: each ok run's transfer log (``transfers.csv``), per tier
  (:func:`bandwidth.tier_rates_frame`).

Every caption carries :func:`load.describe` (sweep, runs, trials, hardware). Units: tokens/s;
seconds; memory in GiB (2^30 bytes); bytes moved in GB (1e9 bytes).
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from . import aggregate as agg
from . import bandwidth as bw
from . import breakdown as bd
from .fairness import fairness_frame, fairness_table
from .load import Sweep, describe
from .render import FAILED, NA, NOT_RUN, fmt, fmt_ci, write_table

GIB = 2**30
GB = 1e9


def _host_cap(caps: pd.Series) -> tuple[str, pd.Series]:
    """The host-cap column's header and cells: in GiB, or in MiB for every row where one cap is
    below 0.1 GiB (a 4 MiB CI cap is not "0.00391"); the unit in the header, never in a cell."""
    unit, scale = ("MiB", 2**20) if (caps.dropna() < 0.1 * GIB).any() else ("GiB", GIB)
    return f"Host cap ({unit})", caps.map(lambda v: NA if v is None or pd.isna(v) else fmt(v / scale))


def _key_columns(df: pd.DataFrame, micro_batch: bool = True, system: bool = True) -> dict:
    cols = {"Model": df["model"], "Hardware": df["hardware"], "Config": df["config"],
            **dict([_host_cap(df["host_mem_cap_bytes"])]),
            "SSDs": df["n_ssd"].map(lambda v: NA if pd.isna(v) else str(int(v)))}
    if micro_batch:  # what the rows trained with; the point's micro-batch where that is unknown
        point_mb = df["micro_batch_size"].map(lambda v: NA if pd.isna(v) else str(int(v)))
        cols["µbatch"] = (df["ran_micro_batch"].replace("", pd.NA).fillna(point_mb)
                          if "ran_micro_batch" in df.columns else point_mb)
    if system:
        cols["System"] = df["system"].map(agg.system_label)
        cols["Measure"] = df["measure"].fillna(NA)
    return {k: v.fillna(NA).astype(object) for k, v in cols.items()}


def _value_or_failed(row: pd.Series, text: str) -> str:
    return FAILED if row["n"] == 0 else text


def throughput_table(summary: pd.DataFrame) -> pd.DataFrame:
    """``summary``: :func:`aggregate.add_pct_of_ideal` of :func:`aggregate.summarize_runs`,
    optionally through :func:`aggregate.with_not_run` (its ``not_run`` groups read "not run")."""
    not_run = summary["not_run"].fillna(False) if "not_run" in summary.columns else \
        pd.Series(False, index=summary.index)
    d = pd.DataFrame(_key_columns(summary))
    d["n"] = summary["n"].astype(int).astype(str)
    d["warm-up"] = summary["warmup_steps"].replace("", NA)
    d["steps"] = [NA if steps == "" else steps + (f" ({int(k)} cut short)" if k and pd.notna(k) else "")
                  for steps, k in zip(summary["measured_steps"], summary["cut_short"])]
    d["n failed"] = [str(int(n)) + (f" ({f})" if f else "")
                     for n, f in zip(summary["n_failed"], summary["failures"])]
    d["tokens/s (mean ± 95% CI)"] = [
        NOT_RUN if skip else _value_or_failed(r, fmt_ci(r["tokens_per_s_mean"], r["tokens_per_s_ci95"]))
        for skip, (_, r) in zip(not_run, summary.iterrows())]
    d["% of Ideal"] = [NA if skip else _value_or_failed(r, fmt(r["pct_of_ideal"], 1))
                       for skip, (_, r) in zip(not_run, summary.iterrows())]
    d["Ideal is"] = summary["ideal_measure"].fillna(NA).astype(object)
    return d


def speedup_table(sp: pd.DataFrame) -> pd.DataFrame:
    d = pd.DataFrame(_key_columns(sp, micro_batch=False, system=False))
    d["TeraIO"] = sp["teraio"].map(agg.system_label)
    d["ZeRO"] = sp["zero"].map(agg.system_label)
    d["TeraIO tokens/s"] = sp["teraio_tokens_per_s"].map(fmt)
    d["ZeRO tokens/s"] = sp["zero_tokens_per_s"].map(fmt)
    d["speedup"] = [f"{fmt(s, 2)}×" if math.isfinite(s) else FAILED for s in sp["speedup"]]
    d["note"] = sp["note"]
    return d


def speedup_summary_table(summary: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "TeraIO": summary["teraio"].map(agg.system_label),
        "over": summary["zero"].map(lambda z: "ZeRO series (both)" if z == "both"
                                    else agg.system_label(z)),
        "points": summary["n_points"].astype(str),
        "mean": summary["mean"].map(lambda v: f"{fmt(v, 2)}×"),
        "geomean": summary["geomean"].map(lambda v: f"{fmt(v, 2)}×"),
        "max": summary["max"].map(lambda v: f"{fmt(v, 2)}×")})


def pct_of_ideal_summary_table(summary: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "Model": summary["model"], "Hardware": summary["hardware"],
        "System": summary["system"].map(agg.system_label), "points": summary["n_points"].astype(str),
        "mean % of Ideal": summary["mean"].map(lambda v: fmt(v, 1)),
        "min": summary["min"].map(lambda v: fmt(v, 1)), "max": summary["max"].map(lambda v: fmt(v, 1)),
        "Ideal is": summary["ideal_measures"]}).astype(object)


def stall_table(it_summary: pd.DataFrame) -> pd.DataFrame:
    d = pd.DataFrame(_key_columns(it_summary))
    d["n"] = it_summary["n"].astype(str)
    d["iterations"] = it_summary["n_iterations"].astype(str)
    d["iteration s"] = [fmt_ci(m, h) for m, h in zip(it_summary["seconds_mean"],
                                                    it_summary["seconds_ci95"])]
    d["stalls/iter"] = [fmt_ci(m, h) for m, h in zip(it_summary["stall_count_mean"],
                                                    it_summary["stall_count_ci95"])]
    d["stall s/iter"] = [fmt_ci(m, h) for m, h in zip(it_summary["stall_seconds_mean"],
                                                     it_summary["stall_seconds_ci95"])]
    d["stall % of time"] = (100 * it_summary["stall_share"]).map(lambda v: fmt(v, 1))
    d["migration s/iter"] = it_summary["migration_seconds_mean"].map(fmt)
    d["overlapped s/iter"] = it_summary["overlapped_seconds_mean"].map(fmt)
    return d


def recovery_table(it_summary: pd.DataFrame) -> pd.DataFrame:
    """The migration engine's unplanned work per iteration, for the groups whose rows count it
    (TeraIO's): urgent fetches, op retries, dropped GB, deferred prefetches, spilled GB (means
    over ok trials; ``n/a`` where the rows predate a count)."""
    s = it_summary[it_summary["urgent_count_mean"].notna()]
    d = pd.DataFrame(_key_columns(s))
    d["n"] = s["n"].astype(str)
    d["urgent fetches/iter"] = s["urgent_count_mean"].map(fmt)
    d["op retries/iter"] = s["oom_retries_mean"].map(fmt)
    d["dropped GB/iter"] = (s["dropped_bytes_mean"] / GB).map(fmt)
    d["deferred prefetches/iter"] = s["deferred_prefetches_mean"].map(fmt)
    d["spilled GB/iter"] = (s["spilled_bytes_mean"] / GB).map(fmt)
    return d


def bytes_table(it_summary: pd.DataFrame) -> pd.DataFrame:
    d = pd.DataFrame(_key_columns(it_summary))
    d["n"] = it_summary["n"].astype(str)
    for tier in ("ssd", "host"):
        for direction in ("offloaded", "prefetched"):
            col = f"bytes_{direction}_{tier}_mean"
            d[f"{tier} {direction} GB/iter"] = (it_summary[col] / GB).map(fmt)
    d["migration GB/s"] = it_summary["migration_gbps"].map(fmt)
    return d


def memory_table(summary: pd.DataFrame) -> pd.DataFrame:
    d = pd.DataFrame(_key_columns(summary))
    d["n"] = summary["n"].astype(int).astype(str)
    d["peak allocated GiB"] = [_value_or_failed(r, fmt(r["peak_allocated_bytes"] / GIB))
                               for _, r in summary.iterrows()]
    d["peak reserved GiB"] = [_value_or_failed(r, fmt(r["peak_reserved_bytes"] / GIB))
                              for _, r in summary.iterrows()]
    d["capacity GiB"] = (summary["capacity_bytes"] / GIB).map(fmt)
    d["peak ÷ capacity %"] = [_value_or_failed(r, fmt(100 * r["peak_fraction"], 1))
                              for _, r in summary.iterrows()]
    d["unoffloaded peak GiB"] = (summary["unoffloaded_peak_bytes"] / GIB).map(fmt)
    d["M %"] = (100 * summary["memory_pressure"]).map(lambda v: fmt(v, 2))
    d["peak host RSS GiB"] = [_value_or_failed(r, fmt(r["peak_host_rss_bytes"] / GIB))
                              for _, r in summary.iterrows()]
    return d


def memory_breakdown_table(measured: pd.DataFrame) -> pd.DataFrame:
    d = measured[["model", "system", "config", "micro_batch_size", "trial", "status"]].rename(
        columns={"micro_batch_size": "µbatch", "status": "run status"}).astype(str)
    d["peak GiB"] = (measured["peak_bytes"] / GIB).map(fmt)
    for g in (*bd.GROUPS, bd.ALLOCATOR):
        d[f"{g} GiB"] = (measured[g] / GIB).map(fmt)
    d["persistent % at peak"] = (100 * measured["persistent_at_peak"]).map(lambda v: fmt(v, 1))
    d["persistent % mean"] = (100 * measured["persistent_mean"]).map(lambda v: fmt(v, 1))
    return d


def paper_breakdown_table(paper: pd.DataFrame) -> pd.DataFrame:
    d = paper[["model", "point", "batch_size", "micro_batch_size", "seq_len", "stage"]].astype(str)
    d["paper M %"] = paper["paper_m"].map(lambda v: fmt(v, 2))
    d["estimated M %"] = paper["estimated_m"].map(lambda v: fmt(v, 2))
    d["peak GiB"] = (paper["peak_bytes"] / GIB).map(fmt)
    for g in bd.GROUPS:
        d[f"{g} GiB"] = (paper[g] / GIB).map(fmt)
    d["persistent %"] = (100 * paper["persistent_share"]).map(lambda v: fmt(v, 1))
    return d


def point_comparison_table(comp: pd.DataFrame) -> pd.DataFrame:
    d = comp[["model", "batch_size", "micro_batch_size", "seq_len"]].rename(
        columns={"batch_size": "batch", "micro_batch_size": "µbatch", "seq_len": "seq"}).astype(str)
    d["M %"] = comp["measured_m"].map(lambda v: fmt(v, 1))
    d["persistent % at peak"] = (100 * comp["measured_persistent"]).map(lambda v: fmt(v, 1))
    known = [isinstance(m, str) for m in comp["paper_model"]]  # None, or NaN beside other rows' names
    d["paper configuration"] = [f"{m} {p}" if k else "none" for k, m, p in zip(known, comp["paper_model"], comp["paper_point"])]
    d["paper M %"] = comp["paper_m"].map(lambda v: fmt(v, 1))
    d["paper persistent % (stage 0 / 1, estimated)"] = [
        f"{fmt(100 * a, 1)} / {fmt(100 * b, 1)}" if k else NA
        for k, a, b in zip(known, comp["paper_persistent_stage0"], comp["paper_persistent_stage1"])]
    return d


def tier_rate_table(rates: pd.DataFrame) -> pd.DataFrame:
    """``rates``: :func:`analysis.bandwidth.tier_rates_frame`."""
    return pd.DataFrame({
        "Model": rates["model"], "Config": rates["config"], "System": rates["system"].map(agg.system_label),
        "run": rates["job_dir"], "tier": rates["tier"], "steps": rates["steps"].astype(str),
        "offload GB/step": rates["offload_gb"].map(fmt), "prefetch GB/step": rates["prefetch_gb"].map(fmt),
        "busy s/step": rates["busy_s"].map(fmt),
        "offload GB/s": rates["offload_gbps"].map(fmt), "prefetch GB/s": rates["prefetch_gbps"].map(fmt),
        "both GB/s": rates["gbps"].map(fmt),
        "copy-stream offload / prefetch GB/s": [f"{fmt(a)} / {fmt(b)}" for a, b in
                                                zip(rates["offload_copy_gbps"], rates["prefetch_copy_gbps"])],
        "planned offload / prefetch GB/s": [f"{fmt(a)} / {fmt(b)}" for a, b in
                                            zip(rates["planned_offload_gbps"], rates["planned_prefetch_gbps"])]})


def write_tables(sweep: Sweep, out_dir: Path) -> list[Path]:
    """Write every table under ``out_dir`` (``<name>.md`` and ``<name>.tex``); return the
    paths written."""
    from .ideal_bias import modeled_ideals  # here: python -m analysis.ideal_bias runs it as __main__

    who = describe(sweep)
    modeled = modeled_ideals(sweep)
    summary = agg.add_pct_of_ideal(agg.summarize_runs(sweep.runs), modeled)
    from_traces = [] if modeled.empty else [
        "Ideal ran out of memory at " + ", ".join(f"{m} bs{b} seq{q}" for m, b, q in
                                               zip(modeled["model"], modeled["batch_size"], modeled["seq_len"]))
        + ": its % there is of an Ideal modeled from a TeraIO run's trace at the point (the sum of its "
        "profiled kernel times, as a modeled Ideal row is; `python -m analysis.ideal_bias` gives the "
        "method's bias where Ideal was also measured)"]
    sp = agg.speedups(agg.select_best(summary))
    its = agg.summarize_iterations(sweep.iterations)
    ci_note = ("mean ± 95% confidence interval over ok trials (Student t, n-1 degrees of "
               "freedom; no interval for n = 1); failed trials are excluded and counted in "
               f"'n failed'; {FAILED} = every trial failed (oom, error or timeout); warm-up: steps "
               "run and not measured before the measured ones, per ok trial (0: the measured step "
               "is the first, with its one-time setup); steps: measured iterations per ok trial; both n/a "
               "for a modeled row, where no step ran. µbatch: the micro-batch the rows trained "
               "with (a ZeRO baseline's may be smaller than the point's, with more accumulation; "
               "tables/fairness says how it was chosen).")
    why_not_run = [f"{NOT_RUN}: no row of this system at this point; why, from not_run.yaml beside "
                   "the rows: " + "; ".join(f"{agg.system_label(s)}: {why}" for s, why in sweep.not_run.items())
                   ] if sweep.not_run else []
    loose = sorted({agg.system_label(s) for s in sweep.runs.loc[sweep.runs["cap_not_enforced"], "system"]})
    cut_note = ["cut short: ok trials that measured fewer steps than their point asks "
                "(workload.measure_steps): the time limit stopped them (their rows' time_limited); "
                "no claim reads their rows"] if summary["cut_short"].any() else []
    pronoun, possessive = ("it", "its") if len(loose) == 1 else ("them", "their")
    cap_note = [f"cap not enforced: {', '.join(loose)} ran where nothing held {pronoun} to "
                "hardware.gpu_capacity_bytes (a CPU: the cap binds CUDA's allocator only; the rows' "
                f"capacity_enforced is false), so {possessive} tokens/s are not those of the capped GPU"] if loose else []
    paths = write_table(throughput_table(agg.with_not_run(summary, sweep.not_run)),
                        out_dir / "throughput", f"Training throughput (tokens/s) and % of Ideal — {who}",
                        [ci_note, "% of Ideal: ratio of means against Ideal of the same model, "
                         "batch, sequence length and hardware at its best micro-batch; 'Ideal "
                         "is' says whether that Ideal was measured or modeled.", *why_not_run, *cut_note, *cap_note,
                         *from_traces])
    fair = fairness_frame(sweep.runs)
    paths += write_table(fairness_table(fair), out_dir / "fairness",
                         f"What each system ran with, and how it was chosen — {who}",
                         [f"{int(fair['tuned'].sum())} of {len(fair)} (point, system) groups tuned by "
                          "measurement (their rows' tuning: every candidate tried and the one kept); "
                          "the paper tunes each baseline per configuration (§4.1)."])
    paths += write_table(
        pct_of_ideal_summary_table(agg.pct_of_ideal_summary(agg.add_pct_of_ideal(agg.select_best(summary)))),
        out_dir / "pct_of_ideal_summary", f"% of Ideal, summarised over configurations — {who}",
        ["Arithmetic mean over the configurations where the system and Ideal ran ok, each at "
         "its best micro-batch. Paper (§6): TeraIO 80.7% on average (C2); ZeRO-Offload 65.9% "
         "(Llama3-8B) and 65.5% (Granite-8B) (C4); on Llama3-70B ZeRO-Infinity 43.0% and "
         "TeraIO-Mixed 59.7% (C5)."])
    paths += write_table(speedup_table(sp), out_dir / "speedup",
                         f"Speedup of TeraIO over ZeRO (ratio of mean tokens/s) — {who}",
                         ["Each system at its best micro-batch (paper §4.1: best hyperparameter "
                          "per baseline). " + f"{FAILED}: one side failed or was not run."])
    paths += write_table(speedup_summary_table(agg.speedup_summary(sp)), out_dir / "speedup_summary",
                         f"Speedup of TeraIO over ZeRO, summarised over configurations — {who}",
                         ["Over the points where both systems ran ok. Paper (§6 C1, C3): 1.47× "
                          "on average over ZeRO-Offload and ZeRO-Infinity, up to 1.59×; the "
                          "paper does not say which TeraIO variant or which mean."])
    if len(its) and "n" in its.columns:
        paths += write_table(stall_table(its), out_dir / "stalls",
                             f"Stalls per iteration — {who}",
                             ["Per-iteration frame: per-run means, then mean ± 95% CI over ok "
                              "trials. n/a: the system does not report it."])
        recovery = recovery_table(its)
        if len(recovery):
            paths += write_table(recovery, out_dir / "recovery",
                                 f"The migration engine's unplanned work per iteration — {who}",
                                 ["TeraIO's rows; per-iteration frame, means over ok trials. Urgent: "
                                  "a tensor an op touched while off the device, not planned (paper "
                                  "§3.2). Op retries: allocations tried again after an out-of-memory "
                                  "error; dropped: tensors prefetched ahead freed again for them; "
                                  "spilled: resident tensors copied to host memory for them; "
                                  "deferred: planned prefetches that did not fit, read at their use. "
                                  "n/a: rows made before the count."])
        paths += write_table(bytes_table(its), out_dir / "bytes",
                             f"Bytes moved per tier per iteration (GB = 1e9 bytes) — {who}",
                             ["Per-iteration frame, means over ok trials. migration GB/s: all "
                              "bytes moved ÷ all iteration time."])
    rates = bw.tier_rates_frame(sweep.runs, sweep.root)
    if len(rates):
        paths += write_table(tier_rate_table(rates), out_dir / "tier_rates",
                             f"What each tier achieved, beside the rates its plan assumed — {who}",
                             ["Per ok run with a transfer log (its measured steps; GB = 1e9 bytes). "
                              "A transfer is in flight from its issue to its completion, time in "
                              "the tier's queue included, so the rates are lower bounds on what "
                              "the device can do. "
                              "busy: time at least one of the tier's transfers is in flight; a "
                              "direction's GB/s: its bytes ÷ the time at least one of its "
                              "transfers is in flight; both: all bytes ÷ busy. Copy-stream: a "
                              "direction's bytes ÷ the seconds its copies ran, timed with CUDA "
                              "events on the copy stream (host tier on CUDA; n/a in logs made "
                              "before they were timed): the link's own rate. Planned: the "
                              "row's tier_gbps (SSD write / read, host D2H / H2D), which the "
                              "planner and the simulator use."])
    paths += write_table(memory_table(summary), out_dir / "memory",
                         f"Peak GPU memory, memory pressure M and peak host memory — {who}",
                         ["M = peak live bytes without offloading ÷ emulated GPU capacity "
                          "(paper Fig. 7), median over trials; peak ÷ capacity is the peak "
                          "allocated with offloading; peak host RSS is the worker process's "
                          "peak resident host memory (pinned buffers, host-side state and the "
                          "Python runtime; n/a in rows made before it was recorded)."])
    measured = bd.measured_frame(sweep.runs, sweep.root)
    if len(measured):
        paths += write_table(memory_breakdown_table(measured), out_dir / "memory_breakdown",
                             f"What the un-offloaded step's memory is made of (paper Fig. 10(1)) — {who}",
                             ["From each run's profiled trace: bytes live at the op where the "
                              "un-offloaded step peaks, by tensor kind (a TeraIO run traces that "
                              "step before it plans, so a run that failed later has one too: "
                              "'run status' says how it ended); allocator: what a CUDA "
                              "profile's allocator held beyond the tensors. Persistent = "
                              "parameters, gradients and optimizer state; 'mean' weighs each op "
                              "by its time. The paper's configurations, estimated: "
                              "memory_breakdown_paper_configs."])
    paper = bd.paper_frame()
    if len(measured):
        paths += write_table(point_comparison_table(bd.point_comparison(sweep.runs, measured, paper)),
                             out_dir / "memory_makeup_per_point",
                             f"Memory pressure M and the persistent share, measured per point beside the "
                             f"paper's — {who}",
                             ["M: un-offloaded peak ÷ capacity (median over ok runs); persistent: "
                              "parameters, gradients and optimizer state at the un-offloaded peak "
                              "(median over the runs' traces, memory_breakdown; n/a where no run at the point has a "
                              "trace: only TeraIO's runs profile one). Paper: M from its Fig. 7 tables; "
                              "persistent share estimated for the configuration the point stands "
                              "for, per stage of its 2-stage pipeline (memory_breakdown_paper_configs)."])
    paths += write_table(paper_breakdown_table(paper), out_dir / "memory_breakdown_paper_configs",
                         "The paper's Fig. 7 configurations, estimated per GPU of its 2-stage 1F1B "
                         "pipeline (teraio.workload.models.pipeline_estimate)",
                         ["16 B per parameter of the stage (FP32 weight, gradient, two AdamW "
                          "states); activations of the micro-batches in flight at the stage's "
                          "peak (2 on stage 0, 1 on stage 1), about (12·dim + 4·ffn) floats per "
                          "token per layer, and the logits on the last stage; temporaries: what "
                          "one attention softmax holds beyond its saved output and the stage's "
                          "logits, left out of the persistent %. Micro-batch sizes are not in the "
                          "paper: those of conf/experiment/fig7.yaml."])
    return paths
