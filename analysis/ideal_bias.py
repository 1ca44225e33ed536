"""How far a modeled or composed Ideal is from a measured one, at every point where both exist.

    python -m analysis.ideal_bias <sweep dir> [<sweep dir> ...] [--out DIR]

A *modeled* Ideal iteration is the sum of the kernel times a TeraIO run profiled at the point
(its ``trace.json``; ``baselines.ideal.trace_step_seconds``, what a ``measure:
"modeled"`` row is made of); a *composed* one is the step composed from its phases timed on
the device (``baselines.ideal.run_composed``). Where the same point (model, batch,
micro-batch, sequence, on the same GPU) also has measured Ideal rows, their ratio to the
measured iteration is the bias a modeled or composed Ideal carries where it stands in for one
(> 1: it is slower than Ideal measured, which flatters the systems compared with it).

Writes ``ideal_bias.md``/``.tex`` (default into the first sweep dir's ``analysis/tables``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from teraio import systems
from baselines.ideal import trace_step_seconds

from .load import Sweep, load_sweep, run_trace
from .render import fmt, write_table

POINT = ["model", "batch_size", "micro_batch_size", "seq_len", "gpu_name"]


def estimates(sweep: Sweep) -> pd.DataFrame:
    """One row per modeled or composed Ideal iteration of ``sweep``: every ok TeraIO run's
    trace (``how`` "modeled from <system>"), every ok composed Ideal row (``how``
    "composed"); columns :data:`POINT`, ``hardware``, ``how``, ``seconds``, ``job_dir``. A
    trace that cannot be read is left out, with a warning naming it (``load.run_trace``)."""
    runs = sweep.runs[(sweep.runs["status"] == "ok") & (sweep.runs["pipeline_stages"].fillna(1) == 1)]
    teraio = set(systems.with_role("teraio"))
    out = []
    for r in runs.itertuples(index=False):
        if r.system in teraio and isinstance(r.trace_path, str):
            trace = run_trace(sweep.root, r.trace_path)
            if trace is None:  # damaged: named in a warning
                continue
            seconds = trace_step_seconds(trace, int(r.batch_size), int(r.micro_batch_size))
            out.append({**{k: getattr(r, k) for k in POINT}, "hardware": r.hardware,
                        "how": f"modeled from {r.system}", "seconds": seconds, "job_dir": r.job_dir})
        elif r.system == "ideal" and r.measure == "composed":
            out.append({**{k: getattr(r, k) for k in POINT}, "hardware": r.hardware, "how": "composed",
                        "seconds": float(r.iteration_seconds), "job_dir": r.job_dir})
    return pd.DataFrame(out, columns=[*POINT, "hardware", "how", "seconds", "job_dir"])


def modeled_ideals(sweep: Sweep) -> pd.DataFrame:
    """An Ideal modeled from TeraIO's traces (:func:`estimates`) at each point where Ideal ran
    and no trial of it ended ok (``oom`` where not even one micro-batch fits) and a TeraIO
    run profiled the step: ``tokens_per_step`` over the mean of those traces' modeled
    iterations. Columns ``aggregate.WORKLOAD_KEYS``, ``ideal_tokens_per_s`` and
    ``ideal_measure`` ("modeled from <systems>' trace"), for ``aggregate.add_pct_of_ideal``."""
    keys = ["model", "hardware", "batch_size", "seq_len"]
    cols = [*keys, "ideal_tokens_per_s", "ideal_measure"]
    runs = sweep.runs
    ideal = runs[runs["system"] == "ideal"]
    failed = ideal.groupby(keys, dropna=False)["status"].agg(lambda st: not (st == "ok").any())
    est = estimates(sweep)
    est = est[est["how"].str.startswith("modeled from ")]
    if est.empty or not failed.any():
        return pd.DataFrame(columns=cols)
    est = est.merge(failed[failed].reset_index()[keys], on=keys, how="inner")
    rows = []
    for point, g in est.groupby(keys, dropna=False, sort=False):
        names = ", ".join(systems.get(h.removeprefix("modeled from ")).display for h in sorted(set(g["how"])))
        rows.append({**dict(zip(keys, point)), "ideal_measure": f"modeled from {names}'s trace",
                     "ideal_tokens_per_s": point[2] * point[3] / g["seconds"].mean()})
    return pd.DataFrame(rows, columns=cols)


def bias_frame(sweeps: list[Sweep]) -> pd.DataFrame:
    """Per point and kind of estimate (:func:`estimates`), where measured Ideal rows of the
    point exist in any of ``sweeps``: the measured iteration (mean over its ok rows, seconds),
    the estimate's (mean, min, max over its runs) and estimate ÷ measured (mean, min, max)."""
    measured = pd.concat([s.runs[(s.runs["system"] == "ideal") & (s.runs["status"] == "ok")
                                 & (s.runs["measure"] == "measured")
                                 & (s.runs["pipeline_stages"].fillna(1) == 1)] for s in sweeps])
    est = pd.concat([estimates(s) for s in sweeps])
    cols = [*POINT, "how", "measured_s", "measured_n", "estimate_s", "estimate_min_s", "estimate_max_s",
            "estimate_n", "ratio", "ratio_min", "ratio_max"]
    if measured.empty or est.empty:
        return pd.DataFrame(columns=cols)
    m = (measured.groupby(POINT, dropna=False)["iteration_seconds"].agg(["mean", "count"])
         .rename(columns={"mean": "measured_s", "count": "measured_n"}).reset_index())
    # gpu_name is all missing (float64) in a CPU sweep's frame and text in another's
    joined = est.astype({"gpu_name": object}).merge(m.astype({"gpu_name": object}), on=POINT, how="inner")
    joined["r"] = joined["seconds"] / joined["measured_s"]
    g = joined.groupby([*POINT, "how", "measured_s", "measured_n"], dropna=False)
    out = g.agg(estimate_s=("seconds", "mean"), estimate_min_s=("seconds", "min"),
                estimate_max_s=("seconds", "max"), estimate_n=("seconds", "count"),
                ratio=("r", "mean"), ratio_min=("r", "min"), ratio_max=("r", "max")).reset_index()
    return out[cols].sort_values([*POINT, "how"]).reset_index(drop=True)


def bias_table(frame: pd.DataFrame) -> pd.DataFrame:
    """:func:`bias_frame` for display."""
    return pd.DataFrame({
        "Model": frame["model"], "Batch": frame["batch_size"], "µbatch": frame["micro_batch_size"],
        "Seq": frame["seq_len"], "GPU": frame["gpu_name"], "Estimate": frame["how"],
        "Measured Ideal s (rows)": [f"{fmt(s, 3)} ({n})" for s, n in zip(frame["measured_s"], frame["measured_n"])],
        "Estimate s (runs)": [f"{fmt(s, 3)} ({n})" for s, n in zip(frame["estimate_s"], frame["estimate_n"])],
        "Estimate ÷ measured": [f"{fmt(r, 3)} ({fmt(lo, 3)}–{fmt(hi, 3)})"
                                for r, lo, hi in zip(frame["ratio"], frame["ratio_min"], frame["ratio_max"])],
    })


CAPTION = "Ideal estimates against Ideal measured at the same point"
NOTES = ["Modeled: the sum of a TeraIO run's profiled kernel times at the point (what a modeled "
         "Ideal row is made of); composed: the step composed from its phases timed on the GPU. "
         "Ratio: mean over the estimate's runs (min–max) of estimate ÷ the measured Ideal iteration "
         "(mean over its rows); > 1 flatters the systems compared with the estimate."]


def write_bias(sweeps: list[Sweep], out_dir: Path) -> list[Path]:
    """Write ``ideal_bias.md``/``.tex`` into ``out_dir``; none where no point has both."""
    frame = bias_frame(sweeps)
    if frame.empty:
        return []
    return write_table(bias_table(frame), out_dir / "ideal_bias", CAPTION, NOTES)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m analysis.ideal_bias", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dirs", nargs="+", help="directories holding the sweeps' result.json files")
    ap.add_argument("--out", default=None, help="output directory (default: <first sweep dir>/analysis/tables)")
    args = ap.parse_args(argv)
    try:
        sweeps = [load_sweep(d, exclude=Path(d) / "analysis") for d in args.sweep_dirs]
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"python -m analysis.ideal_bias: {e}") from e
    out = Path(args.out) if args.out else Path(args.sweep_dirs[0]) / "analysis" / "tables"
    written = write_bias(sweeps, out)
    if not written:
        raise SystemExit("python -m analysis.ideal_bias: no point has both a measured Ideal and an estimate")
    for p in written:
        print(p)
    print(written[0].read_text())


if __name__ == "__main__":
    main()
