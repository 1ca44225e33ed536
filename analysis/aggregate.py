"""The numbers behind the tables and figures: per-group statistics over trials, the best
micro-batch per system, % of Ideal, and speedups of TeraIO over ZeRO.

A *group* is one point of the sweep less its trial: ``GROUP_KEYS``. Groups are formed with
``groupby(..., dropna=False)`` so a row missing a key is kept as its own group. Failed
trials (status ≠ ok) never enter a mean or CI; they are counted in ``n_failed``.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from teraio import systems
from teraio.core.engine import RECOVERY_KEYS

from .stats import mean_ci


WORKLOAD_KEYS = ["model", "hardware", "batch_size", "seq_len"]
VARIANT_KEYS = ["host_mem_cap_bytes", "n_ssd", "pipeline_stages"]
COMPARE_KEYS = WORKLOAD_KEYS + VARIANT_KEYS
GROUP_KEYS = COMPARE_KEYS + ["micro_batch_size", "system", "measure"]


def system_label(system) -> str:
    """The registry's display name (``teraio.systems``); the name itself for a system it
    does not know, ``?`` for none."""
    if system is None or (not isinstance(system, str) and pd.isna(system)):
        return "?"
    return systems.get(system).display if system in systems.names() else str(system)


def system_rank(system) -> int:
    """Position in the registry (the paper's Fig. 7 order); unknown systems last."""
    order = systems.legend_order()
    return order.index(system) if system in order else len(order)


def _failures(status: pd.Series) -> str:
    """``"oom"`` or ``"oom×2, timeout"``: the failed statuses of a group."""
    counts = status[status != "ok"].fillna("?").value_counts(sort=False)
    return ", ".join(s if c == 1 else f"{s}×{c}" for s, c in counts.sort_index().items())


def _first(series: pd.Series):
    s = series.dropna()
    return s.iloc[0] if len(s) else None


def _ci_columns(out: dict, name: str, values) -> None:
    mean, half, n = mean_ci(values)
    out[f"{name}_mean"], out[f"{name}_ci95"] = mean, half


def ran_micro_batch(g: pd.DataFrame) -> str:
    """The micro-batches a group's rows trained with (``ran_micro_batch_size``, failed rows
    too: they ran with their setting), distinct values joined by "/"; the point's
    ``micro_batch_size`` for rows that predate the column; empty if neither is known."""
    col = g["ran_micro_batch_size"] if "ran_micro_batch_size" in g.columns else g["micro_batch_size"]
    vals = col.fillna(g["micro_batch_size"]).dropna().unique()
    return "/".join(str(int(v)) for v in sorted(vals))


def sort_groups(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in the paper's order: model, hardware, batch, sequence, variant, system."""
    keys = [k for k in COMPARE_KEYS + ["micro_batch_size"] if k in df.columns]
    return (df.assign(_rank=df["system"].map(system_rank))
            .sort_values(keys + ["_rank"], na_position="last", kind="stable")
            .drop(columns="_rank").reset_index(drop=True))


def cut_short(runs: pd.DataFrame) -> pd.Series:
    """Per row of the per-run frame: an ok row that ran its steps (``measure`` measured) and
    measured fewer of them (``n_iterations``) than its point asks (``asked_steps``): its time
    limit stopped it (the row's ``time_limited``, ``teraio.systems.loop.measure_steps``)."""
    short = (~runs["failed"] & (runs["measure"] == "measured")
             & (runs["n_iterations"] < runs["asked_steps"]).fillna(False))
    return short.astype(bool)


def summarize_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per group (``GROUP_KEYS``) of the per-run frame.

    Columns: the keys, ``config``, ``n_runs``, ``n`` (ok trials), ``n_failed``, ``failures``
    (e.g. ``"oom"``), ``error`` (first error text), ``tokens_per_s_mean``/``_ci95``
    (tokens/s; 95 % t half-width, NaN for n < 2), ``stall_count_per_iter_mean``/``_ci95``,
    ``stall_seconds_per_iter_mean``/``_ci95`` (s), ``peak_allocated_bytes``,
    ``peak_reserved_bytes``, ``peak_host_rss_bytes`` (means over ok trials, bytes), ``capacity_bytes``,
    ``unoffloaded_peak_bytes``, ``memory_pressure`` (M as a fraction, from any trial
    that has it: M is a property of the model and workload, known even for an OOM),
    ``peak_fraction`` (peak allocated ÷ capacity), ``measured_steps`` (the measured
    iterations of each ok trial, distinct counts joined by "/", e.g. ``"4"`` or ``"2/4"``;
    empty with no ok trial), ``warmup_steps`` (the same for the unmeasured steps before them;
    both empty for a ``modeled`` group, where no step ran), ``cut_short`` (its ok trials that
    measured fewer steps than asked, :func:`cut_short`), ``ran_micro_batch`` (the
    micro-batches the group's rows trained with, :func:`ran_micro_batch`),
    ``transfers_path``/``oplog_path``/``job_dir`` of the first ok trial.
    """
    rows = []
    short = cut_short(runs)
    for _, g in runs.groupby(GROUP_KEYS, dropna=False, sort=False):
        ok = g[~g["failed"]]
        first = g.iloc[0]
        out = {k: first[k] for k in GROUP_KEYS}
        out.update(config=first["config"], n_runs=len(g), n=len(ok), n_failed=int(g["failed"].sum()),
                   failures=_failures(g["status"]), error=_first(g["error"]))
        for name in ("tokens_per_s", "stall_count_per_iter", "stall_seconds_per_iter"):
            _ci_columns(out, name, ok[name])
        for name in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_host_rss_bytes", "peak_fraction"):
            out[name] = ok[name].mean() if len(ok) else math.nan
        for name in ("capacity_bytes", "unoffloaded_peak_bytes", "memory_pressure"):
            out[name] = g[name].median()
        for name, col in (("measured_steps", "n_iterations"), ("warmup_steps", "warmup_steps")):
            ran = ok[ok["measure"] != "modeled"]
            out[name] = "/".join(str(int(n)) for n in sorted(ran[col].dropna().unique()))
        out["cut_short"] = int(short[g.index].sum())
        out["ran_micro_batch"] = ran_micro_batch(g)
        ok_sorted = ok.sort_values("trial", na_position="last")
        for name in ("job_dir", "transfers_path", "oplog_path"):
            out[name] = _first(ok_sorted[name])
        rows.append(out)
    return sort_groups(pd.DataFrame(rows))


def with_not_run(summary: pd.DataFrame, not_run) -> pd.DataFrame:
    """``summary`` (:func:`summarize_runs`) with a group for each system of ``not_run`` (system
    names) that has none at a point (``COMPARE_KEYS`` and ``config``) where other systems
    have: ``n_runs`` 0, ``not_run`` True (False on every other row), other values NA; in the
    paper's order (:func:`sort_groups`)."""
    shown = summary.assign(not_run=False)
    rows = []
    for keys, g in summary.groupby(COMPARE_KEYS + ["config"], dropna=False, sort=False):
        here = set(g["system"].dropna())
        rows += [{**dict(zip(COMPARE_KEYS + ["config"], keys)), "system": s, "n_runs": 0, "n": 0,
                  "n_failed": 0, "failures": "", "measured_steps": "", "warmup_steps": "", "not_run": True}
                 for s in not_run if s not in here]
    if not rows:
        return shown
    return sort_groups(pd.concat([shown, pd.DataFrame(rows)], ignore_index=True))


MEASURE_RANK = {"measured": 2, "composed": 1, "modeled": 0}
"""How a row's number was made, most trusted highest (``teraio.result``'s ``measure``)."""


def select_best(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (``COMPARE_KEYS``, system): the micro-batch group with the highest mean tokens/s,
    as the paper picks "the best hyperparameter" per baseline (§4.1). Measured beats
    composed, composed beats modeled (:data:`MEASURE_RANK`); a group with no ok trial is
    kept only if the system has nothing better, so that an all-OOM point still shows as
    failed."""
    ranked = summary.assign(
        _has_ok=summary["n"] > 0, _measured=summary["measure"].map(MEASURE_RANK).fillna(0),
        _mean=summary["tokens_per_s_mean"].fillna(-np.inf))
    ranked = ranked.sort_values(["_has_ok", "_measured", "_mean"], ascending=False, kind="stable")
    best = ranked.groupby(COMPARE_KEYS + ["system"], dropna=False, sort=False).head(1)
    return sort_groups(best.drop(columns=["_has_ok", "_measured", "_mean"]))


def add_pct_of_ideal(summary: pd.DataFrame, modeled: pd.DataFrame | None = None) -> pd.DataFrame:
    """Add ``ideal_tokens_per_s``, ``ideal_measure`` and ``pct_of_ideal`` (percent) to each
    group: Ideal of the same model, workload (batch, sequence) and hardware, its best
    micro-batch (measured preferred over composed, composed over modeled); where Ideal has
    no ok trial, the Ideal of ``modeled`` at the point (``analysis.ideal_bias.modeled_ideals``:
    from TeraIO's traces, its ``ideal_measure`` saying so), if given. NaN where neither."""
    ideal = select_best(summary[summary["system"] == "ideal"])
    ideal = ideal[ideal["n"] > 0].assign(_m=lambda d: d["measure"].map(MEASURE_RANK).fillna(0))
    ideal = (ideal.sort_values(["_m", "tokens_per_s_mean"], ascending=False, kind="stable")
             .groupby(WORKLOAD_KEYS, dropna=False, sort=False).head(1))
    ideal = ideal[WORKLOAD_KEYS + ["tokens_per_s_mean", "measure"]].rename(
        columns={"tokens_per_s_mean": "ideal_tokens_per_s", "measure": "ideal_measure"})
    if modeled is not None and not modeled.empty:
        ideal = pd.concat([ideal, modeled[WORKLOAD_KEYS + ["ideal_tokens_per_s", "ideal_measure"]]],
                          ignore_index=True).drop_duplicates(WORKLOAD_KEYS, keep="first")
    out = summary.drop(columns=[c for c in ("ideal_tokens_per_s", "ideal_measure", "pct_of_ideal")
                                if c in summary.columns])
    out = out.merge(ideal, on=WORKLOAD_KEYS, how="left")
    out["pct_of_ideal"] = 100.0 * out["tokens_per_s_mean"] / out["ideal_tokens_per_s"]
    return out


def pct_of_ideal_summary(best: pd.DataFrame) -> pd.DataFrame:
    """Mean, min and max % of Ideal per (model, hardware, system) over the best-micro-batch
    groups that ran ok (claims C2, C4, C5). ``best``: :func:`add_pct_of_ideal` of
    :func:`select_best`. Columns: ``model``, ``hardware``, ``system``, ``n_points``,
    ``mean``, ``min``, ``max`` (percent), ``ideal_measures`` (e.g. ``"measured"``)."""
    v = best[(best["system"] != "ideal") & np.isfinite(best["pct_of_ideal"].astype(float))]
    rows = []
    for (model, hw, system), g in v.groupby(["model", "hardware", "system"], dropna=False, sort=False):
        rows.append({"model": model, "hardware": hw, "system": system, "n_points": len(g),
                     "mean": g["pct_of_ideal"].mean(), "min": g["pct_of_ideal"].min(),
                     "max": g["pct_of_ideal"].max(),
                     "ideal_measures": "+".join(sorted(g["ideal_measure"].dropna().unique()))})
    cols = ["model", "hardware", "system", "n_points", "mean", "min", "max", "ideal_measures"]
    return sort_groups(pd.DataFrame(rows, columns=cols)) if rows else pd.DataFrame(columns=cols)


def speedups(best: pd.DataFrame) -> pd.DataFrame:
    """Speedup of each TeraIO variant over each ZeRO baseline, per (``COMPARE_KEYS``), from
    the best-micro-batch groups of :func:`select_best`.

    Columns: ``COMPARE_KEYS``, ``config``, ``teraio``, ``zero``, ``teraio_tokens_per_s``,
    ``zero_tokens_per_s``, ``speedup`` (ratio of means; NaN unless both have ok trials),
    ``note`` (``""``, ``"<system> failed (<statuses>)"`` or ``"<system> not run"``).
    A baseline beyond the paper's (``SystemSpec.paper`` false) is paired only in a sweep that
    ran it somewhere.
    """
    ran = set(best["system"].dropna())
    baselines = [z for z in systems.with_role("baseline") if systems.get(z).paper or z in ran]
    rows = []
    for keys, g in best.groupby(COMPARE_KEYS, dropna=False, sort=False):
        by_sys = {s: r for s, r in zip(g["system"], g.to_dict("records"))}
        for t in systems.with_role("teraio"):
            for z in baselines:
                if t not in by_sys and z not in by_sys:
                    continue
                notes = []
                for s in (t, z):
                    r = by_sys.get(s)
                    if r is None:
                        notes.append(f"{system_label(s)} not run")
                    elif r["n"] == 0:
                        notes.append(f"{system_label(s)} failed ({r['failures']})")
                tr, zr = by_sys.get(t), by_sys.get(z)
                t_mean = tr["tokens_per_s_mean"] if tr else math.nan
                z_mean = zr["tokens_per_s_mean"] if zr else math.nan
                rows.append({**dict(zip(COMPARE_KEYS, keys)), "config": g["config"].iloc[0],
                             "teraio": t, "zero": z, "teraio_tokens_per_s": t_mean,
                             "zero_tokens_per_s": z_mean, "speedup": t_mean / z_mean,
                             "note": "; ".join(notes)})
    cols = COMPARE_KEYS + ["config", "teraio", "zero", "teraio_tokens_per_s", "zero_tokens_per_s",
                           "speedup", "note"]
    return pd.DataFrame(rows, columns=cols)


def speedup_summary(sp: pd.DataFrame) -> pd.DataFrame:
    """Arithmetic mean, geometric mean and max of the speedups per (teraio, zero) pair and
    per TeraIO variant over both ZeRO baselines (the paper's "ZeRO series", claims C1/C3: the
    registry's baselines of the paper, ``SystemSpec.paper``), over the points where both ran
    ok. Columns: ``teraio``, ``zero`` (``"both"`` for the
    series), ``n_points``, ``mean``, ``geomean``, ``max``."""
    valid = sp[np.isfinite(sp["speedup"].astype(float))]  # an empty frame's column is object
    series = [z for z in systems.with_role("baseline") if systems.get(z).paper]
    rows = []
    for t in systems.with_role("teraio"):
        for z in (*systems.with_role("baseline"), "both"):
            pair = (sp["teraio"] == t) & ((sp["zero"] == z) if z != "both" else sp["zero"].isin(series))
            if not pair.any():
                continue
            s = valid.loc[pair[pair].index.intersection(valid.index), "speedup"].to_numpy(float)
            rows.append({"teraio": t, "zero": z, "n_points": len(s),
                         "mean": s.mean() if len(s) else math.nan,
                         "geomean": float(np.exp(np.log(s).mean())) if len(s) else math.nan,
                         "max": s.max() if len(s) else math.nan})
    return pd.DataFrame(rows, columns=["teraio", "zero", "n_points", "mean", "geomean", "max"])


def summarize_iterations(iterations: pd.DataFrame) -> pd.DataFrame:
    """Per group (``GROUP_KEYS``), from ok runs' measured iterations: per-run means first,
    then mean ± 95 % t half-width over trials of ``seconds``, ``stall_count``,
    ``stall_seconds``, ``migration_seconds``, ``overlapped_seconds``, ``compute_seconds``
    (s per iteration), the four byte counts (bytes per iteration) and the engine's unplanned
    work (``teraio.core.engine.RECOVERY_KEYS``, per iteration; NaN for rows without it); ``n`` trials,
    ``n_iterations`` in all, ``instrumented`` (stall and migration times known for every
    iteration), ``stall_share`` (Σ stall ÷ Σ seconds) and ``migration_gbps`` (all bytes
    moved ÷ all seconds, GB/s with GB = 1e9 bytes)."""
    ok = iterations[~iterations["failed"]]
    value_cols = ["seconds", "stall_count", "stall_seconds", "migration_seconds",
                  "overlapped_seconds", "compute_seconds", "bytes_offloaded_ssd",
                  "bytes_offloaded_host", "bytes_prefetched_ssd", "bytes_prefetched_host"]
    byte_cols = value_cols[-4:]
    value_cols += list(RECOVERY_KEYS)
    rows = []
    for _, g in ok.groupby(GROUP_KEYS, dropna=False, sort=False):
        first = g.iloc[0]
        per_run = g.groupby("job_dir", dropna=False)[value_cols].mean()
        out = {k: first[k] for k in GROUP_KEYS}
        out.update(config=first["config"], n=len(per_run), n_iterations=len(g), ran_micro_batch=ran_micro_batch(g),
                   instrumented=bool(g[["stall_seconds", "migration_seconds"]].notna().all().all()))
        for c in value_cols:
            _ci_columns(out, c, per_run[c])
        total_s = g["seconds"].sum()
        out["stall_share"] = (g["stall_seconds"].sum(min_count=len(g)) / total_s
                              if total_s else math.nan)
        moved = g[byte_cols].sum(axis=1, min_count=len(byte_cols)).sum(min_count=len(g))
        out["migration_gbps"] = moved / total_s / 1e9 if total_s else math.nan
        rows.append(out)
    return sort_groups(pd.DataFrame(rows)) if rows else pd.DataFrame(columns=GROUP_KEYS)
