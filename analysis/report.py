"""``analyze``: everything the analysis writes for one sweep, in one call (the sweep calls it
at its end; ``python -m analysis`` calls it from the shell).

Layout under ``out_dir`` (default ``<sweep dir>/analysis``):
``runs.parquet``/``runs.csv`` (per-run frame), ``iterations.parquet``/``iterations.csv``
(per-iteration frame; columns in :mod:`analysis.load`), ``tables/*.md|tex``,
``figures/*.png|pdf``, and ``index.md`` listing what was written, which figures were
skipped and why, and any ``result.json`` that could not be read.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from . import figures as figs
from .cost import write_cost_tables
from .load import describe, load_sweep
from .render import write_table
from .tables import write_tables

FIGURES = {"fig7_throughput": figs.fig7_throughput, "fig8_breakdown": figs.fig8_breakdown,
           "fig9_host_memory": figs.fig9_host_memory, "fig10_memory_breakdown": figs.fig10_memory_breakdown}


def analyze(sweep_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Load ``sweep_dir`` and write frames, tables and figures under ``out_dir``.

    Returns:
        ``{path relative to out_dir: absolute path}`` of every file written.

    Raises:
        FileNotFoundError, ValueError: from :func:`load.load_sweep` (no sweep, no results),
            :mod:`analysis.cost` (bad prices).
    """
    sweep_dir = Path(sweep_dir).resolve()
    out = Path(out_dir).resolve() if out_dir else sweep_dir / "analysis"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sweep = load_sweep(sweep_dir, exclude=out)
        out.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        for name, frame in (("runs", sweep.runs), ("iterations", sweep.iterations)):
            frame.to_parquet(out / f"{name}.parquet", index=False)
            frame.to_csv(out / f"{name}.csv", index=False)
            written += [out / f"{name}.parquet", out / f"{name}.csv"]
        written += write_tables(sweep, out / "tables")
        written += write_cost_tables(sweep, out / "tables")
        from .ideal_bias import write_bias  # here: python -m analysis.ideal_bias runs it as __main__

        written += write_bias([sweep], out / "tables")
        skipped: dict[str, str] = {}
        for name, draw in FIGURES.items():
            try:
                fig = draw(sweep)
            except figs.NoData as e:
                skipped[name] = str(e)
                continue
            written += figs.save_figure(fig, out / "figures" / name)
        try:
            fig, shares = figs.fig10_bandwidth(sweep)
        except figs.NoData as e:
            skipped["fig10_bandwidth"] = str(e)
        else:
            written += figs.save_figure(fig, out / "figures" / "fig10_bandwidth")
            written += write_table(figs.share_table_rows(shares), out / "tables" / "migration_bandwidth",
                                   f"Share of an iteration with migration above 16 GB/s (paper §6 "
                                   f"C11) — {describe(sweep)}",
                                   ["Paper: > 16 GB/s for > 64% (Granite-8B) and 82.3% "
                                    "(Llama3-70B) of training time, TeraIO-Mixed."])
    index = out / "index.md"
    lines = [f"# Analysis of {describe(sweep)}", ""]
    makeup = out / "tables" / "memory_makeup_per_point.md"
    if makeup.exists():  # per point: the measured M and memory make-up beside the paper's
        lines += ["## Memory pressure and make-up per point, beside the paper's", "",
                  makeup.read_text().strip(), ""]
    lines += ["## Written", ""]
    lines += [f"- `{p.relative_to(out)}`" for p in written]
    lines += ["", "## Figures skipped", ""] + ([f"- {k}: {v}" for k, v in skipped.items()] or ["- none"])
    lines += ["", "## result.json not loaded", ""] + (
        [f"- `{p}`: {why}" for p, why in sweep.skipped] or ["- none"])
    once = list({str(w.message): w for w in caught}.values())  # a file read by several tables: one line
    lines += ["", "## Warnings", ""] + (
        [f"- {w.message}" for w in once] or ["- none"])
    index.write_text("\n".join(lines) + "\n")
    written.append(index)
    for w in once:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return {str(p.relative_to(out)): p for p in written}
