"""How long the committed runs took: per sweep, model and system, the worker time of each run
(the row's ``wall_seconds``: the worker process from start to end, set-up, profiling and
planning included), so a reviewer can budget a rerun. Failed rows count: they took the time.

One row per (sweep, model, system) of the per-run frame (:mod:`analysis.load`), in the
paper's order.
"""
from __future__ import annotations

import pandas as pd

from . import aggregate as agg
from .render import fmt

HOUR = 3600.0


def runtime_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """Columns ``sweep``, ``model``, ``system``, ``runs``, ``ok``, ``min_s``, ``max_s`` (one
    run's ``wall_seconds``, s) and ``total_s`` (their sum); rows without ``wall_seconds`` are
    counted in ``runs`` only."""
    rows = []
    for (sweep, model, system), g in runs.groupby(["sweep", "model", "system"], dropna=False, sort=False):
        wall = g["wall_seconds"].dropna()
        rows.append({"sweep": sweep, "model": model, "system": system, "runs": len(g),
                     "ok": int((~g["failed"]).sum()), "min_s": wall.min() if len(wall) else float("nan"),
                     "max_s": wall.max() if len(wall) else float("nan"), "total_s": float(wall.sum())})
    cols = ["sweep", "model", "system", "runs", "ok", "min_s", "max_s", "total_s"]
    if not rows:
        return pd.DataFrame(columns=cols)
    out = pd.DataFrame(rows, columns=cols)
    out["_rank"] = out["system"].map(agg.system_rank)
    return out.sort_values(["sweep", "model", "_rank"], kind="stable").drop(columns="_rank").reset_index(drop=True)


def runtime_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The display form of :func:`runtime_frame`."""
    return pd.DataFrame({
        "Sweep": frame["sweep"], "Model": frame["model"], "System": frame["system"].map(agg.system_label),
        "runs (ok)": [f"{r} ({o})" for r, o in zip(frame["runs"], frame["ok"])],
        "worker s per run": [fmt(a, 1) if fmt(a, 1) == fmt(b, 1) else f"{fmt(a, 1)}–{fmt(b, 1)}"
                             for a, b in zip(frame["min_s"], frame["max_s"])],
        "worker h in all": (frame["total_s"] / HOUR).map(lambda v: fmt(v, 2))}).astype(object)
