"""``python -m analysis.claims SWEEP_DIR... [--out DIR] [--characterize CSV] [--roofline CSV]
[--plan-compile JSON] [--insert FILE...]``: the paper's claims C1–C22, each computed from rows.

For every claim: the paper's figure, ours, the rows (``result.json`` files) or generated files
it used, and a verdict by the rule written beside the claim in :data:`CLAIMS`:

- ``supported``: our figure meets the rule's bar;
- ``partly``: part of the claim holds, or it holds only against a modeled Ideal or untuned
  baselines (a comparison is only as strong as its baseline: ZeRO rows without a ``tuning``
  cap a speedup claim at ``partly``);
- ``not supported``: measured, and it does not hold;
- ``not measured``: no row (or input) the claim needs, with why.

Fig. 7 claims read the sweeps whose name begins ``fig7``, Fig. 9 claims those beginning
``fig9``; the sweeps are pooled (a point and trial in two sweeps, or trials of a point made
with different configs, ``analysis.trials``, would be pooled as one, so that is refused). A
claim reads only rows that ran on a GPU held to its capacity and measured the steps their point
asks (:func:`set_aside` says why another is not read; with no row left a claim is
``not measured``), and a share of Ideal above 100 % is flagged, never ``supported``. An Ideal that is
``modeled`` (trace sums, ``baselines.ideal``) is never averaged with measured ones: claims
on % of Ideal use measured Ideal points, and say what a modeled one would add. ``ideal_bias``
tables modeled ÷ measured Ideal wherever a point has a measured Ideal and a TeraIO trace to
model it from (the modeled Ideal's method: the trace's summed op times).

Writes ``claims.md``/``.tex`` (the claims table), ``claims_detail.md``/``.tex`` (each
claim's rule, its figure point by point, the rows used), ``ideal_bias.md``/``.tex`` and
``fairness.md``/``.tex`` (what each system ran with) and ``runtime.md``/``.tex`` (how long the
runs took, :mod:`analysis.runtime`) into ``--out`` (default ``runs/claims``). ``--insert FILE``
replaces each generated block of FILE (between ``<!-- analysis.claims:NAME begin -->`` and
``<!-- analysis.claims:NAME end -->``, NAME one of :data:`BLOCKS`: ``claims``, ``ideal_bias``,
``fairness``, ``runtime``) by the file just written.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from . import aggregate as agg
from . import cost
from .fairness import fairness_frame, fairness_table
from .load import Sweep, describe, load_sweep, run_trace
from .render import fmt, to_latex, to_markdown
from .runtime import HOUR, runtime_frame, runtime_table
from .trials import check_one_config

SUPPORTED, PARTLY, NOT_SUPPORTED, NOT_MEASURED = "supported", "partly", "not supported", "not measured"
NEAR_IDEAL = 90.0  # % of Ideal the rules take as "near Ideal" (the paper gives no bar)
DEFAULT_OUT = Path("runs/claims")
BLOCKS = ("claims", "ideal_bias", "fairness", "runtime")  # the files --insert puts into a document
WRITTEN = BLOCKS + ("claims_detail",)  # every file written (each .md and .tex)
MEASURED_IDEAL = ("measured", "composed")  # Ideal timed on the device: whole, or in phases


@dataclasses.dataclass(frozen=True)
class Finding:
    """What a rule found: ``ours``, our figure in one or two sentences (the claims table's
    cell); the verdict; the rows or files it used; ``detail``, the figure point by point
    (``claims_detail``; empty where ``ours`` says it all)."""

    ours: str
    verdict: str
    used: tuple[str, ...] = ()
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Claim:
    """One claim of the paper: ``text`` and ``paper`` (its figure) as the paper states them
    (NeurIPS 2025 camera-ready, where shown), ``rule`` how the verdict is reached; ``reads``:
    the sweeps whose rows it reads, those named ``<reads>*`` (None: it reads no row)."""

    id: str
    text: str
    where: str
    paper: str
    rule: str
    compute: Callable[["Evidence"], Finding]
    reads: str | None = "fig7"


def set_aside(sweep: Sweep) -> pd.Series:
    """Per row of ``sweep.runs``, why no claim reads it: ``"no GPU"`` (its config's
    ``hardware.device`` is not CUDA: a machinery check), ``"capacity not enforced"`` (its
    ``capacity_enforced`` is false: nothing held it to its GPU capacity), ``"fewer measured
    steps than asked"`` (``aggregate.cut_short``: its time limit cut it short), else ``""``."""
    device = [str(((sweep.configs.get((s, j)) or {}).get("hardware") or {}).get("device"))
              for s, j in zip(sweep.runs["sweep"], sweep.runs["job_dir"])]
    why = ["no GPU" if not d.startswith("cuda") else "capacity not enforced" if loose
           else "fewer measured steps than asked" if short else ""
           for d, loose, short in zip(device, sweep.runs["cap_not_enforced"], agg.cut_short(sweep.runs))]
    return pd.Series(why, index=sweep.runs.index, dtype=object)


def read_by_claims(sweep: Sweep) -> Sweep:
    """``sweep`` with only the rows no claim sets aside (:func:`set_aside`)."""
    keep = sweep.runs[set_aside(sweep) == ""]
    jobs = set(keep["job_dir"])
    its = sweep.iterations[sweep.iterations["job_dir"].isin(jobs)]
    return dataclasses.replace(sweep, runs=keep.reset_index(drop=True), iterations=its.reset_index(drop=True))


class Evidence:
    """The pooled rows of the sweeps given, summarised once (``aggregate``), and the
    generated files of the CPU analyses (``None`` where not given).

    ``given``: the sweeps as given (captions, names); ``sweeps`` and ``runs``: their rows that
    ran on a GPU held to its capacity and measured the steps asked (:func:`read_by_claims`),
    the only ones a claim reads; ``aside``: the sweep, job dir and why of every other row."""

    def __init__(self, sweeps: list[Sweep], characterize: Path | None = None,
                 roofline: Path | None = None, plan_compile: Path | None = None):
        self.given = sweeps
        runs = pd.concat([s.runs for s in sweeps], ignore_index=True) if sweeps else pd.DataFrame()
        if len(runs):
            dup = runs[runs.duplicated(agg.GROUP_KEYS + ["trial"], keep=False)]
            if len(dup):
                raise ValueError(f"the same point and trial is in two sweeps ({', '.join(sorted(set(dup['sweep'])))}): "
                                 f"{dup['job_dir'].iloc[0]}; give each point's rows once")
            check_one_config(runs, {k: c for s in sweeps for k, c in s.configs.items()})
        self.aside = pd.DataFrame(
            [(s.name, j, why) for s in sweeps for j, why in zip(s.runs["job_dir"], set_aside(s)) if why],
            columns=["sweep", "job_dir", "why"])
        self.sweeps = [read_by_claims(s) for s in sweeps]
        self.runs = pd.concat([s.runs for s in self.sweeps], ignore_index=True) if sweeps else pd.DataFrame()
        self.characterize, self.roofline, self.plan_compile = characterize, roofline, plan_compile
        self._figures: dict[str, pd.DataFrame] = {}

    def unmeasured(self, prefix: str | None) -> Finding | None:
        """Why a claim that reads the sweeps named ``<prefix>*`` has no row to read (no such
        sweep, or every row of them set aside: :func:`set_aside`), as its finding; None where
        it has rows, or reads none (``prefix`` None)."""
        if prefix is None or (len(self.runs) and self.runs["sweep"].str.startswith(prefix).any()):
            return None
        aside = self.aside[self.aside["sweep"].str.startswith(prefix)]
        if not len(aside):
            return Finding(f"no {prefix}* sweep given", NOT_MEASURED)
        return Finding(f"no row of the {prefix}* sweeps to read: {_why_aside(aside)}", NOT_MEASURED)

    def figure(self, prefix: str) -> pd.DataFrame:
        """The best-micro-batch groups (``aggregate.select_best``) with % of Ideal, of the
        sweeps named ``<prefix>*`` (computed once per prefix; callers must not modify it)."""
        if prefix not in self._figures:
            self._figures[prefix] = self._figure(prefix)
        return self._figures[prefix]

    def _figure(self, prefix: str) -> pd.DataFrame:
        runs = self.runs[self.runs["sweep"].str.startswith(prefix)] if len(self.runs) else self.runs
        if not len(runs):
            return pd.DataFrame(columns=agg.GROUP_KEYS + ["n", "tokens_per_s_mean", "pct_of_ideal",
                                                          "ideal_measure", "config"])
        summary = agg.add_pct_of_ideal(agg.summarize_runs(runs))
        return agg.select_best(summary)

    def rows(self, groups: pd.DataFrame) -> tuple[str, ...]:
        """The ``result.json`` files of ``groups`` (any frame with ``GROUP_KEYS``-less-measure
        columns), trials folded: ``sweep/<job dir less -t<n>>-t{0,1,2}``."""
        if not len(groups) or not len(self.runs):
            return ()
        keys = agg.COMPARE_KEYS + ["system"]
        hit = self.runs.merge(groups[keys].drop_duplicates(), on=keys, how="inner")
        folded: dict[str, list[str]] = {}
        for sweep, job in zip(hit["sweep"], hit["job_dir"]):
            m = re.fullmatch(r"(.*)-t(\d+)", job)
            stem, trial = (m.group(1), m.group(2)) if m else (job, "")
            folded.setdefault(f"{sweep}/{stem}", []).append(trial)
        return tuple(f"{k}-t{{{','.join(sorted(v, key=lambda t: int(t) if t else -1))}}}/result.json"
                     if v != [""] else f"{k}/result.json" for k, v in sorted(folded.items()))


def _ok(best: pd.DataFrame, system: str) -> pd.DataFrame:
    return best[(best["system"] == system) & (best["n"] > 0)]


def _tuned(ev: Evidence, groups: pd.DataFrame) -> bool:
    """Every row of ``groups`` carries a tuning."""
    keys = agg.COMPARE_KEYS + ["system"]
    hit = ev.runs.merge(groups[keys].drop_duplicates(), on=keys, how="inner")
    return bool(len(hit)) and bool(hit["tuning_json"].notna().all())


def _pct(v: float) -> str:
    return f"{fmt(v, 1)} %"


def _x(v: float) -> str:
    return f"{fmt(v, 2)}×"


def _span(values, unit: str = "", digits: int | None = None) -> str:
    """``a–b<unit>`` over ``values`` (formatted as :func:`fmt`), one value where they print
    the same; ``n/a`` when there is none."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if not v:
        return "n/a"
    lo, hi = fmt(min(v), digits), fmt(max(v), digits)
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def _n(k: int, what: str) -> str:
    return f"{k} {what}" + ("" if k == 1 else "s")


def _points(df: pd.DataFrame) -> str:
    return ", ".join(f"{m} {c}" for m, c in zip(df["model"], df["config"]))


def _modeled_short(df: pd.DataFrame) -> str:
    """The figures against a modeled Ideal in a few words, named as such."""
    mod = df[df["ideal_measure"] == "modeled"]
    if not len(mod):
        return ""
    return f"; {_span(mod['pct_of_ideal'], ' %', 1)} of a modeled Ideal at {_n(len(mod), 'point')} (ideal_bias)"


def _modeled_note(df: pd.DataFrame, system: str) -> str:
    """Figures against a modeled Ideal, named as such (never averaged with measured ones)."""
    mod = df[df["ideal_measure"] == "modeled"]
    if not len(mod):
        return ""
    return ("; against a modeled Ideal (trace sums, see ideal_bias): "
            + ", ".join(f"{m} {c} {_pct(p)}" for m, c, p in zip(mod["model"], mod["config"], mod["pct_of_ideal"])))


def _best_zero_ratio(best: pd.DataFrame) -> pd.DataFrame:
    """Per point where TeraIO-Mixed and at least one ZeRO baseline ran ok: TeraIO-Mixed ÷ the
    faster ZeRO. Columns: keys, ``config``, ``zero``, ``ratio``; plus the points where
    TeraIO-Mixed ran ok and every ZeRO row failed (``ratio`` NaN, ``zero`` the failures)."""
    rows = []
    for keys, g in best.groupby(agg.COMPARE_KEYS, dropna=False, sort=False):
        mixed = g[(g["system"] == "teraio_mixed") & (g["n"] > 0)]
        if not len(mixed):
            continue
        zeros = g[g["system"].isin(("zero_offload", "zero_infinity"))]
        ok = zeros[zeros["n"] > 0]
        base = {**dict(zip(agg.COMPARE_KEYS, keys)), "config": g["config"].iloc[0]}
        if len(ok):
            z = ok.sort_values("tokens_per_s_mean", ascending=False).iloc[0]
            rows.append({**base, "zero": z["system"], "system": z["system"],
                         "ratio": mixed["tokens_per_s_mean"].iloc[0] / z["tokens_per_s_mean"]})
        elif len(zeros):
            rows.append({**base, "zero": "; ".join(f"{agg.system_label(s)} {f}" for s, f in
                                                   zip(zeros["system"], zeros["failures"])),
                         "system": None, "ratio": math.nan})
    return pd.DataFrame(rows, columns=agg.COMPARE_KEYS + ["config", "zero", "system", "ratio"])


def _speedup_rows(ev: Evidence, best: pd.DataFrame, r: pd.DataFrame) -> tuple[str, ...]:
    both = r[np.isfinite(r["ratio"].astype(float))]
    groups = pd.concat([best[best["system"] == "teraio_mixed"].merge(both[agg.COMPARE_KEYS], on=agg.COMPARE_KEYS),
                        both.assign(system=both["system"])], ignore_index=True)
    return ev.rows(groups)


def _speedup(ev: Evidence, paper: float, use_max: bool) -> Finding:
    best = ev.figure("fig7")
    r = _best_zero_ratio(best)
    both = r[np.isfinite(r["ratio"].astype(float))]
    failed = r[~np.isfinite(r["ratio"].astype(float))]
    if not len(both):
        return Finding("no point where TeraIO-Mixed and a ZeRO baseline both ran ok"
                       + "".join(f"; {m} {c}: {z}" for m, c, z in zip(failed["model"], failed["config"], failed["zero"])),
                       NOT_MEASURED)
    value = both["ratio"].max() if use_max else both["ratio"].mean()
    per = ", ".join(f"{m} {c} {_x(v)} ({agg.system_label(z)})"
                    for m, c, v, z in zip(both["model"], both["config"], both["ratio"], both["zero"]))
    zero_groups = best[best["system"].isin(("zero_offload", "zero_infinity"))].merge(
        both[agg.COMPARE_KEYS], on=agg.COMPARE_KEYS)
    tuned = _tuned(ev, zero_groups)
    failed_text = f"ZeRO failed where TeraIO-Mixed ran: {_points(failed)}" if len(failed) else ""
    ours = (f"{'max' if use_max else 'mean'} {_x(value)} over {_n(len(both), 'point')}"
            + (f"; ZeRO failed at {_n(len(failed), 'more point')}" if len(failed) else "")
            + ("" if tuned else "; ZeRO not tuned"))
    detail = f"per point: {per}" + (f"; {failed_text}" if failed_text else "") + (
        "" if tuned else "; ZeRO's rows carry no tuning")
    verdict = SUPPORTED if value >= 0.9 * paper else PARTLY if value > 1.0 else NOT_SUPPORTED
    if verdict == SUPPORTED and not tuned:
        verdict = PARTLY
    return Finding(ours, verdict, _speedup_rows(ev, best, r), detail)


def c1(ev: Evidence) -> Finding:
    return _speedup(ev, 1.47, use_max=False)


def c3(ev: Evidence) -> Finding:
    return _speedup(ev, 1.59, use_max=True)


def _pct_of_ideal(ev: Evidence, best: pd.DataFrame, system: str, models: tuple[str, ...] | None = None):
    v = _ok(best, system)
    if models is not None:
        v = v[v["model"].str.startswith(models)]
    v = v[np.isfinite(v["pct_of_ideal"].astype(float))]
    return v[v["ideal_measure"].isin(MEASURED_IDEAL)], v


def _above_ideal(found: Finding, pct_of_ideal) -> Finding:
    """``found``, flagged where a share of Ideal it rests on (``pct_of_ideal``, percent) is
    above 100 %: a run faster than the un-offloaded step says that the Ideal or the run is
    not what it should be, so such a finding is never ``supported`` (``partly`` at most)."""
    over = [float(p) for p in pct_of_ideal if math.isfinite(float(p)) and float(p) > 100.0]
    if not over:
        return found
    flag = f"; flagged: {_span(over, ' %', 1)} of Ideal at {_n(len(over), 'point')}, above Ideal: suspect"
    return dataclasses.replace(found, ours=found.ours + flag, detail=found.detail + flag if found.detail else "",
                               verdict=PARTLY if found.verdict == SUPPORTED else found.verdict)


def _with_ideal_rows(ev: Evidence, best: pd.DataFrame, groups: pd.DataFrame) -> tuple[str, ...]:
    ideal = best[best["system"] == "ideal"].merge(groups[agg.WORKLOAD_KEYS].drop_duplicates(), on=agg.WORKLOAD_KEYS)
    return ev.rows(pd.concat([groups, ideal], ignore_index=True))


def c2(ev: Evidence) -> Finding:
    best = ev.figure("fig7")
    measured, allv = _pct_of_ideal(ev, best, "teraio_mixed")
    if not len(allv):
        return Finding("no TeraIO-Mixed row with an Ideal at its point", NOT_MEASURED)
    if not len(measured):
        return Finding("only against a modeled Ideal" + _modeled_short(allv), NOT_MEASURED,
                       _with_ideal_rows(ev, best, allv), "only against a modeled Ideal" + _modeled_note(allv, "teraio_mixed"))
    m = measured["pct_of_ideal"].mean()
    ours = f"TeraIO-Mixed mean {_pct(m)} over {_n(len(measured), 'point')} with a measured Ideal" + _modeled_short(allv)
    detail = ("per point: " + ", ".join(f"{mo} {c} {_pct(p)}" + (" (composed Ideal)" if im == "composed" else "")
                                        for mo, c, p, im in zip(measured["model"], measured["config"],
                                                                measured["pct_of_ideal"], measured["ideal_measure"]))
              + _modeled_note(allv, "teraio_mixed"))
    verdict = SUPPORTED if m >= 0.9 * 80.7 else PARTLY if m >= 0.5 * 80.7 else NOT_SUPPORTED
    return _above_ideal(Finding(ours, verdict, _with_ideal_rows(ev, best, allv), detail), allv["pct_of_ideal"])


def c4(ev: Evidence) -> Finding:
    best = ev.figure("fig7")
    parts, short, used, holds = [], [], [], []
    for prefix, paper in (("llama3_8b", 65.9), ("granite_8b", 65.5)):
        measured, allv = _pct_of_ideal(ev, best, "zero_offload", (prefix,))
        if len(measured):
            m = measured["pct_of_ideal"].mean()
            holds.append(abs(m - paper) <= 10.0)
            parts.append(f"ZeRO-Offload at {prefix}*: mean {_pct(m)} over {len(measured)} point(s)")
            short.append(f"{_pct(m)} at {prefix}* ({_n(len(measured), 'point')})")
            used.append(measured)
    inf = _ok(best, "zero_infinity")
    off = _ok(best, "zero_offload")
    pair = inf.merge(off, on=agg.COMPARE_KEYS, suffixes=("_inf", "_off"))
    if len(pair):
        ratios = pair["tokens_per_s_mean_inf"] / pair["tokens_per_s_mean_off"]
        holds.append(bool(((ratios >= 0.8) & (ratios <= 1.0)).all()))
        parts.append("ZeRO-Infinity ÷ ZeRO-Offload " + ", ".join(
            f"{m} {c} {fmt(v, 3)}" for m, c, v in zip(pair["model"], pair["config_inf"], ratios)))
        used += [inf.merge(pair[agg.COMPARE_KEYS], on=agg.COMPARE_KEYS)]
        inf_short = f"ZeRO-Infinity ÷ ZeRO-Offload {_span(ratios, digits=3)} at {_n(len(pair), 'point')}"
    if not holds:
        return Finding("no ZeRO-Offload row of Llama3-8B or Granite-8B with a measured Ideal", NOT_MEASURED)
    failed = best[best["system"].isin(("zero_offload", "zero_infinity")) & (best["n"] == 0)]
    tuned = _tuned(ev, pd.concat(used))
    detail = "; ".join(parts) + (
        "; failed: " + ", ".join(f"{agg.system_label(s)} {m} {c} ({f})" for s, m, c, f in
                                 zip(failed["system"], failed["model"], failed["config"], failed["failures"]))
        if len(failed) else "") + ("" if tuned else "; not tuned")
    ours = "; ".join(([f"ZeRO-Offload {', '.join(short)} of Ideal"] if short else [])
                     + ([inf_short] if len(pair) else [])
                     + ([f"ZeRO failed at {_n(len(failed), 'point')}"] if len(failed) else [])
                     + ([] if tuned else ["not tuned"]))
    verdict = SUPPORTED if all(holds) else PARTLY if any(holds) else NOT_SUPPORTED
    rows = _with_ideal_rows(ev, best, pd.concat(used + [failed], ignore_index=True))
    return _above_ideal(Finding(ours, verdict, rows, detail), pd.concat(used)["pct_of_ideal"])


def _not_measured_model(ev: Evidence, prefix: str, what: str) -> Finding | None:
    best = ev.figure("fig7")
    if not len(best) or not best["model"].str.startswith(prefix).any():
        return Finding(f"no {prefix} row in the sweeps given ({what})", NOT_MEASURED)
    return None


def _failed_text(g: pd.DataFrame, system: str) -> str:
    """``"failed at every point (oom×2)"``, ``"ran"`` or ``"not run"``: ``system``'s groups of ``g``."""
    s = g[g["system"] == system]
    if not len(s):
        return "not run"
    if (s["n"] == 0).all():
        return f"failed at every point ({'; '.join(sorted(set(s['failures'])))})"
    return f"ran ok at {_n(int((s['n'] > 0).sum()), 'point')}"


def c5(ev: Evidence) -> Finding:
    miss = _not_measured_model(ev, "llama3_70b", "the claim is about Llama3-70B")
    if miss:
        return miss
    best = ev.figure("fig7")
    g = best[best["model"].str.startswith("llama3_70b")]
    off = g[g["system"] == "zero_offload"]
    off_failed = bool(len(off)) and bool((off["n"] == 0).all())
    inf, _ = _pct_of_ideal(ev, best, "zero_infinity", ("llama3_70b",))
    mix, _ = _pct_of_ideal(ev, best, "teraio_mixed", ("llama3_70b",))
    if not len(mix):
        return Finding("no Llama3-70B TeraIO-Mixed row ran ok beside a measured Ideal; ZeRO-Offload "
                       + _failed_text(g, "zero_offload"), NOT_MEASURED, ev.rows(g))
    pair = mix.merge(inf, on=agg.COMPARE_KEYS, suffixes=("", "_inf"))
    ratios = pair["tokens_per_s_mean"] / pair["tokens_per_s_mean_inf"]
    holds = [off_failed] + ([bool(ratios.mean() >= 0.9 * 1.33)] if len(pair) else [])
    ours = (f"ZeRO-Offload {_failed_text(g, 'zero_offload')}; ZeRO-Infinity "
            + (f"{_pct(inf['pct_of_ideal'].mean())} of Ideal at {_n(len(inf), 'point')}" if len(inf)
               else _failed_text(g, "zero_infinity"))
            + f", TeraIO-Mixed {_pct(mix['pct_of_ideal'].mean())} at {_n(len(mix), 'point')}; "
            + (f"TeraIO-Mixed ÷ ZeRO-Infinity {_x(ratios.mean())} over {_n(len(pair), 'point')} where both ran"
               if len(pair) else "no point where both ran"))
    detail = ours + ("; per point: " + ", ".join(f"{c} {_x(v)}" for c, v in zip(pair["config"], ratios))
                     if len(pair) else "")
    verdict = SUPPORTED if all(holds) and len(holds) == 2 else PARTLY if any(holds) else NOT_SUPPORTED
    return _above_ideal(Finding(ours, verdict, _with_ideal_rows(ev, best, g), detail),
                        pd.concat([inf, mix])["pct_of_ideal"])


def c6(ev: Evidence) -> Finding:
    best = ev.figure("fig7")
    parts, short, used, near_measured, near_modeled = [], [], [], [], []
    for system in ("teraio_mixed", "teraio_ssd"):
        measured, allv = _pct_of_ideal(ev, best, system, ("llama3_8b",))
        if not len(allv):
            parts.append(f"{agg.system_label(system)}: no row with an Ideal")
            short.append(parts[-1])
            near_measured.append(False)
            continue
        used.append(allv)
        mod = allv[allv["ideal_measure"] == "modeled"]
        short.append(agg.system_label(system) + " " + ", ".join(
            ([f"{_span(measured['pct_of_ideal'], ' %', 1)} of a measured Ideal at {_n(len(measured), 'point')}"]
             if len(measured) else [])
            + ([f"{_span(mod['pct_of_ideal'], ' %', 1)} of a modeled one"] if len(mod) else [])))
        if len(measured):
            parts.append(f"{agg.system_label(system)} "
                         + ", ".join(f"{c} {_pct(p)}" for c, p in zip(measured["config"], measured["pct_of_ideal"]))
                         + " of a measured Ideal"
                         + _modeled_note(allv, system))
        else:
            parts.append(f"{agg.system_label(system)}" + _modeled_note(allv, system))
        near_measured.append(bool(len(measured)) and bool((measured["pct_of_ideal"] >= NEAR_IDEAL).all()))
        mod = allv[allv["ideal_measure"] == "modeled"]
        near_modeled.append(bool(len(mod)) and bool((mod["pct_of_ideal"] >= NEAR_IDEAL).any()))
    if not used:
        return Finding("no Llama3-8B row with an Ideal", NOT_MEASURED)
    detail = "; ".join(parts) + f"; near Ideal: ≥ {fmt(NEAR_IDEAL, 0)} %; the +9 % of a bigger micro-batch: not measured"
    ours = "; ".join(short) + ". The +9 % of a bigger micro-batch: not measured."
    verdict = (SUPPORTED if all(near_measured) else
               PARTLY if any(near_measured) or any(near_modeled) else NOT_SUPPORTED)
    groups = pd.concat(used, ignore_index=True)
    return _above_ideal(Finding(ours, verdict, _with_ideal_rows(ev, best, groups), detail), groups["pct_of_ideal"])


def c7(ev: Evidence) -> Finding:
    best = ev.figure("fig7")
    g = best[best["model"].str.startswith("granite_8b")]
    if not len(g):
        return Finding("no granite_8b row in the sweeps given", NOT_MEASURED)
    parts, short, holds = [], [], []
    measured, allv = _pct_of_ideal(ev, best, "teraio_mixed", ("granite_8b",))
    if len(measured):
        parts.append("TeraIO-Mixed " + ", ".join(f"{c} {_pct(p)}" for c, p in zip(measured["config"],
                                                                                measured["pct_of_ideal"]))
                     + " of a measured Ideal")
        short.append(f"TeraIO-Mixed {_span(measured['pct_of_ideal'], ' %', 1)} of a measured Ideal "
                     f"at {_n(len(measured), 'point')}")
        holds.append(bool((measured["pct_of_ideal"] >= NEAR_IDEAL).all()))
    ssd, zero = _ok(g, "teraio_ssd"), g[g["system"].isin(("zero_offload", "zero_infinity")) & (g["n"] > 0)]
    pair = ssd.merge(zero, on=agg.COMPARE_KEYS, suffixes=("", "_z"))
    if len(pair):
        ratios = pair["tokens_per_s_mean"] / pair["tokens_per_s_mean_z"]
        parts.append("TeraIO-SSD ÷ ZeRO " + ", ".join(f"{c} {fmt(v, 2)} ({agg.system_label(z)})" for c, v, z in
                                                     zip(pair["config"], ratios, pair["system_z"])))
        short.append(f"TeraIO-SSD ÷ ZeRO {_span(ratios, digits=2)} at {_n(len(pair), 'point')}")
        holds.append(bool(((ratios >= 0.9) & (ratios <= 1.1)).all()))
    else:
        parts.append("TeraIO-SSD ≈ ZeRO: no point where both ran ok")
        short.append(parts[-1])
    n_ssd = int(ev.runs.loc[ev.runs["model"].str.startswith("granite_8b"), "n_ssd"].max())
    parts.append(f"4 SSDs per GPU: not measured (at most {n_ssd} drive here)")
    short.append(parts[-1])
    ours, detail = "; ".join(short), "; ".join(parts)
    if not holds:
        return Finding(ours, NOT_MEASURED, _with_ideal_rows(ev, best, g), detail)
    verdict = SUPPORTED if all(holds) else PARTLY if any(holds) else NOT_SUPPORTED
    return _above_ideal(Finding(ours, verdict, _with_ideal_rows(ev, best, g), detail), measured["pct_of_ideal"])


def c8(ev: Evidence) -> Finding:
    best = ev.figure("fig7")
    mixed_closest, ssd_ge_zero, failing = [], [], []
    for keys, g in best.groupby(agg.COMPARE_KEYS, dropna=False, sort=False):
        ok = g[(g["n"] > 0) & (g["system"] != "ideal")]
        if "teraio_mixed" in set(ok["system"]) and len(ok) > 1:
            top = ok.sort_values("tokens_per_s_mean", ascending=False)["system"].iloc[0]
            mixed_closest.append(top == "teraio_mixed")
            if top != "teraio_mixed":
                failing.append(f"{g['model'].iloc[0]} {g['config'].iloc[0]}: {agg.system_label(top)} above TeraIO-Mixed")
        ssd = ok[ok["system"] == "teraio_ssd"]
        zero = ok[ok["system"].isin(("zero_offload", "zero_infinity"))]
        if len(ssd) and len(zero):
            ge = bool((ssd["tokens_per_s_mean"].iloc[0] >= zero["tokens_per_s_mean"]).all())
            ssd_ge_zero.append(ge)
            if not ge:
                failing.append(f"{g['model'].iloc[0]} {g['config'].iloc[0]}: TeraIO-SSD below a ZeRO")
    if not mixed_closest and not ssd_ge_zero:
        return Finding("no point with TeraIO-Mixed beside another system that ran ok", NOT_MEASURED)
    ours = (f"TeraIO-Mixed closest to Ideal at {sum(mixed_closest)} of {len(mixed_closest)} points; "
            f"TeraIO-SSD ≥ every ZeRO that ran at {sum(ssd_ge_zero)} of {len(ssd_ge_zero)}")
    checks = mixed_closest + ssd_ge_zero
    verdict = SUPPORTED if all(checks) else PARTLY if sum(checks) >= len(checks) / 2 else NOT_SUPPORTED
    return Finding(ours, verdict, ev.rows(best[best["system"] != "ideal"]),
                   ours + (f" ({'; '.join(failing)})" if failing else ""))


def c9(ev: Evidence) -> Finding:
    miss = _not_measured_model(ev, "llama3_70b", "the claim is about Llama3-70B's seq4096")
    if miss:
        return miss
    best = ev.figure("fig7")
    g = best[best["model"].str.startswith("llama3_70b")]
    teraio = g[g["system"].isin(("teraio_ssd", "teraio_mixed"))]
    inf = g[g["system"] == "zero_infinity"]
    if not len(teraio) or not len(inf):
        return Finding("Llama3-70B rows lack TeraIO or ZeRO-Infinity", NOT_MEASURED, ev.rows(g))
    all_ok = bool((teraio["n_failed"] == 0).all())
    inf_oom = inf[inf["failures"].str.contains("oom")]
    ours = (f"TeraIO {'ok at every point' if all_ok else 'failed at ' + _points(teraio[teraio['n_failed'] > 0])}; "
            f"ZeRO-Infinity oom at {_points(inf_oom) or 'no point'}")
    return Finding(ours, SUPPORTED if all_ok and len(inf_oom) else PARTLY if all_ok else NOT_SUPPORTED, ev.rows(g))


def c10(ev: Evidence) -> Finding:
    best = ev.figure("fig7")
    inf = _ok(best, "zero_infinity")
    mix = _ok(best, "teraio_mixed").merge(inf[agg.COMPARE_KEYS], on=agg.COMPARE_KEYS)
    if not len(mix):
        return Finding("no point where TeraIO-Mixed and ZeRO-Infinity both ran ok", NOT_MEASURED)
    its = agg.summarize_iterations(_iterations(ev, "fig7"))
    sel = its.merge(mix[agg.COMPARE_KEYS + ["system"]], on=agg.COMPARE_KEYS + ["system"])
    zi = its.merge(inf[agg.COMPARE_KEYS + ["system"]], on=agg.COMPARE_KEYS + ["system"])
    detail = ("TeraIO-Mixed stall / overlapped / iteration s: " + ", ".join(
        f"{m} {c} {fmt(s)} / {fmt(o)} / {fmt(t)}" for m, c, s, o, t in
        zip(sel["model"], sel["config"], sel["stall_seconds_mean"], sel["overlapped_seconds_mean"], sel["seconds_mean"]))
        + "; ZeRO-Infinity iteration s: " + ", ".join(f"{m} {c} {fmt(t)}" for m, c, t in
                                                      zip(zi["model"], zi["config"], zi["seconds_mean"]))
        + "; DeepSpeed reports no stall or migration time, so the stall comparison is not measured")
    ours = (f"DeepSpeed reports no stall or migration time, so the comparison is not measured. TeraIO-Mixed "
            f"stalled {_span(sel['stall_seconds_mean'], ' s')} per iteration at {_n(len(sel), 'point')}.")
    return Finding(ours, NOT_MEASURED, ev.rows(pd.concat([mix, inf], ignore_index=True)), detail)


def _iterations(ev: Evidence, prefix: str) -> pd.DataFrame:
    return pd.concat([s.iterations for s in ev.sweeps if s.name.startswith(prefix)], ignore_index=True)


def c11(ev: Evidence) -> Finding:
    from .figures import NoData, fig10_bandwidth
    import matplotlib.pyplot as plt
    shares = []
    for s in ev.sweeps:
        if not s.name.startswith("fig7"):
            continue
        try:
            fig, sh = fig10_bandwidth(s)
        except NoData:
            continue
        plt.close(fig)
        shares.append(sh.assign(sweep=s.name))
    if not shares:
        return Finding("no TeraIO run with a transfer and op log", NOT_MEASURED)
    sh = pd.concat(shares, ignore_index=True)
    sh = sh[sh["system"] == "teraio_mixed"]
    parts, short, holds = [], [], []
    for prefix, paper in (("granite_8b", 64.0), ("llama3_70b", 82.3)):
        g = sh[sh["model"].str.startswith(prefix)]
        if len(g):
            parts.append(f"{prefix}*: " + ", ".join(f"{c} {_pct(100 * v)}" for c, v in zip(g["config"], g["share_above_16gbps"])))
            short.append(f"{prefix}* {_span(100 * g['share_above_16gbps'], ' %', 1)} at {_n(len(g), 'point')}")
            holds.append(bool((100 * g["share_above_16gbps"] > paper).all()))
        else:
            parts.append(f"{prefix}*: not measured")
            short.append(parts[-1])
    other = sh[~sh["model"].str.startswith(("granite_8b", "llama3_70b"))]
    if len(other):
        parts.append("other models: " + ", ".join(f"{m} {c} {_pct(100 * v)}" for m, c, v in
                                                  zip(other["model"], other["config"], other["share_above_16gbps"])))
    used = tuple(f"{s}/{j}/result.json" for s, j in zip(sh["sweep"], sh["job_dir"]))
    ours = "; ".join(short)
    if not holds:
        return Finding(ours, NOT_MEASURED, used, "; ".join(parts))
    return Finding("TeraIO-Mixed, each point's best trial: " + ours,
                   SUPPORTED if all(holds) and len(holds) == 2 else PARTLY if any(holds) else NOT_SUPPORTED, used,
                   "; ".join(parts) + " (each point's best trial by tokens/s, one iteration)")


def c12(ev: Evidence) -> Finding:
    sweep = next((s for s in ev.given if s.name.startswith("fig7")), None)
    if sweep is None:
        return Finding("no fig7 sweep given", NOT_MEASURED)
    sav = cost.cost_saving(sweep)
    table3 = sav.drop_duplicates("teraio")
    same = [round(float(r), 2) == round(float(p), 2) for r, p in zip(table3["paper_table3"], table3["paper_stated"])]
    ours = "; ".join(f"{agg.system_label(t)} {_x(r)} (paper states {_x(p)})"
                     for t, r, p in zip(table3["teraio"], table3["paper_table3"], table3["paper_stated"]))
    return Finding(ours + ", from Table 3's prices",
                   SUPPORTED if all(same) else PARTLY if any(same) else NOT_SUPPORTED,
                   ("the paper's Table 3 prices in analysis/cost.py",), ours + " (arithmetic, analysis.cost)")


def _cost_efficiency(ev: Evidence, prefix: str) -> pd.DataFrame:
    """:func:`analysis.cost.cost_efficiency` over the sweeps named ``<prefix>*`` (each at its own
    prices), one frame."""
    frames = [cost.cost_efficiency(cost.cost_frame(s)) for s in ev.sweeps if s.name.startswith(prefix) and len(s.runs)]
    return (pd.concat(frames, ignore_index=True) if frames
            else pd.DataFrame(columns=agg.COMPARE_KEYS + ["config", "teraio", "zero", "ratio"]))


def c13(ev: Evidence) -> Finding:
    miss = _not_measured_model(ev, "llama3_70b", "the paper's cost efficiency is Llama3-70B's, Table 3")
    eff = _cost_efficiency(ev, "fig7")
    is70 = eff["model"].str.startswith("llama3_70b")
    seventy = eff[is70 & (eff["teraio"] == "teraio_mixed")]
    summ = cost.cost_efficiency_summary(eff[~is70])
    other = "; other models at Table 3's prices: " + ", ".join(
        f"{agg.system_label(t)} ÷ {agg.system_label(z)} at {m} mean {_x(v)} ({n} point(s))"
        for m, t, z, v, n in zip(summ["model"], summ["teraio"], summ["zero"], summ["mean"], summ["n_points"]))
    if miss:
        return Finding(miss.ours, NOT_MEASURED, detail=miss.ours + other)
    g = ev.figure("fig7")
    g = g[g["model"].str.startswith("llama3_70b")]
    parts, holds = [], []
    for zero, paper in (("zero_offload", 1.45), ("zero_infinity", 1.47)):
        r = seventy[seventy["zero"] == zero]["ratio"]
        if len(r):
            holds.append(bool(r.mean() >= 0.9 * paper))
            parts.append(f"over {agg.system_label(zero)} {_x(r.mean())} at {_n(len(r), 'point')}")
        else:
            holds.append(None)
            parts.append(f"over {agg.system_label(zero)}: no point where both ran ({_failed_text(g, zero)})")
    ours = "TeraIO-Mixed's tokens/s per $ at Llama3-70B " + "; ".join(parts)
    used = ev.rows(g[g["system"].isin(("teraio_mixed", "zero_offload", "zero_infinity"))])
    measured = [h for h in holds if h is not None]
    if not measured:
        return Finding(ours, NOT_MEASURED, used, ours + other)
    ratios = seventy["ratio"]
    verdict = (SUPPORTED if len(measured) == 2 and all(measured)
               else PARTLY if any(measured) or bool((ratios > 1).any()) else NOT_SUPPORTED)
    return Finding(ours, verdict, used, ours + other)


def c14(ev: Evidence) -> Finding:
    best = ev.figure("fig9")
    if not len(best):
        return Finding("no fig9 sweep given", NOT_MEASURED)
    v = _ok(best, "teraio_mixed").sort_values(["n_ssd", "host_mem_cap_bytes"], kind="stable")
    # the fig9 points' hardware names carry their drives and host cap: Ideal is the fig7
    # sweeps' measured one of the same model, batch and sequence on the same GPU
    ideal = _ok(ev.figure("fig7"), "ideal")
    ideal = ideal[ideal["measure"].isin(MEASURED_IDEAL)]
    gpus = ev.runs.groupby(["model", "hardware"], dropna=False)["gpu_name"].first()
    parts, pct, used = [], [], [v]
    for _, r in v.iterrows():
        gpu = gpus.get((r["model"], r["hardware"]))
        same = ideal[(ideal["model"] == r["model"]) & (ideal["batch_size"] == r["batch_size"])
                     & (ideal["seq_len"] == r["seq_len"])
                     & np.array([gpus.get((m, h)) == gpu for m, h in zip(ideal["model"], ideal["hardware"])],
                                dtype=bool)]
        p = 100 * r["tokens_per_s_mean"] / same["tokens_per_s_mean"].iloc[0] if len(same) else math.nan
        used.append(same)
        pct.append(p)
        parts.append(f"{int(r['n_ssd'])} SSD, {fmt(r['host_mem_cap_bytes'] / 1e9, 1)} GB host: "
                     + (_pct(p) if math.isfinite(p) else "no measured Ideal"))
    detail = (f"TeraIO-Mixed at {v['model'].iloc[0]} {v['config'].iloc[0]}, % of the fig7 sweeps' measured Ideal "
              f"(same GPU): " + ", ".join(parts)) if len(v) else "no TeraIO-Mixed row"
    ours = (f"TeraIO-Mixed at {v['model'].iloc[0]} {v['config'].iloc[0]} with "
            f"{_span(v['n_ssd'], ' SSD', 0)} and {_span(v['host_mem_cap_bytes'] / 1e9, ' GB', 0)} of host memory: "
            f"{_span(pct, ' %', 1)} of the measured Ideal") if len(v) else "no TeraIO-Mixed row"
    groups = pd.concat(used, ignore_index=True)
    two = [p for p, n in zip(pct, v["n_ssd"]) if n >= 2 and math.isfinite(p)]
    if not two:
        missing = "; the claim's 2 SSDs: not measured (every row has fewer drives)"
        return Finding(ours + missing, NOT_MEASURED, ev.rows(groups), detail + missing)
    verdict = SUPPORTED if max(two) >= NEAR_IDEAL else NOT_SUPPORTED
    return _above_ideal(Finding(ours, verdict, ev.rows(groups), detail), pct)


def c15(ev: Evidence) -> Finding:
    miss = _not_measured_model(ev, "llama3_70b", "the claim is Llama3-70B's with 2 and 4 SSDs")
    if miss:
        return miss
    runs = ev.runs[ev.runs["model"].str.startswith("llama3_70b") & (ev.runs["system"] == "teraio_mixed")]
    ok = runs[~runs["failed"]]
    if not len(ok):
        return Finding("no Llama3-70B TeraIO-Mixed row ran ok" + (f" ({_n(len(runs), 'row')} failed)" if len(runs) else ""),
                       NOT_MEASURED, ev.rows(ev.figure("fig7").merge(runs[["model", "system"]].drop_duplicates())))
    drives = _span(ok["n_ssd"], digits=0)
    hosts = _span(ok["host_mem_cap_bytes"] / 1e9, " GB", 0)
    ours = (f"Llama3-70B TeraIO-Mixed ran ok with {drives} drive(s) and {hosts} of host memory; the claim's 2 "
            "SSDs + 512 GB and 4 SSDs + 1 TB: not measured (as many separate drives needed)")
    best = ev.figure("fig7")
    return Finding(ours, NOT_MEASURED, ev.rows(best[best["model"].str.startswith("llama3_70b")
                                                    & (best["system"] == "teraio_mixed")]))


def c16(ev: Evidence) -> Finding:
    best = ev.figure("fig7")
    inf = _ok(best, "zero_infinity")
    full = inf[inf["model"].isin(("llama3_8b", "llama3_70b"))]
    cut = inf[~inf["model"].isin(("llama3_8b", "llama3_70b"))]
    txt = ", ".join(f"{m} {c} {fmt(b / 1e9, 1)} GB" for m, c, b in zip(cut["model"], cut["config"], cut["peak_host_rss_bytes"]))
    if not len(full):
        none = "no ZeRO-Infinity row of the full Llama3-8B or Llama3-70B"
        return Finding(none + (f"; at the cuts its worker peaks at {_span(cut['peak_host_rss_bytes'] / 1e9, ' GB', 1)} "
                               "of host memory" if txt else ""),
                       NOT_MEASURED, ev.rows(cut),
                       none + (f"; ZeRO-Infinity's worker peak host memory at the cuts: {txt}" if txt else ""))
    ours = ", ".join(f"{m} {fmt(b / 1e9, 1)} GB" for m, b in zip(full["model"], full["peak_host_rss_bytes"]))
    return Finding(ours, PARTLY, ev.rows(full))


def c18(ev: Evidence) -> Finding:
    if ev.plan_compile is None:
        return Finding("no plan compile timings given (--plan-compile)", NOT_MEASURED)
    data = json.loads(Path(ev.plan_compile).read_text())
    paper = {"llama3_8b": 31.2, "granite_8b": 37.9, "llama3_70b": 396.6}
    # TeraIO's default plans with recompute="auto": the schedule search's time where measured
    got = {k: (e.get("schedule") or e).get("median_seconds") for k, e in data.get("entries", {}).items() if k in paper}
    if not got:
        return Finding(f"{ev.plan_compile}: no entry of {', '.join(paper)}", NOT_MEASURED, (str(ev.plan_compile),))
    searched = all("schedule" in data["entries"][k] for k in got)
    ours = ", ".join(f"{k} {fmt(v)} s" for k, v in got.items()) + (
        " (median, CPU, recompute=auto)" if searched else " (median, CPU)")
    holds = [v <= paper[k] for k, v in got.items()]
    return Finding(ours, SUPPORTED if all(holds) and len(got) == 3
                   else PARTLY if any(holds) else NOT_SUPPORTED, (str(ev.plan_compile),))


def _characterize(ev: Evidence) -> pd.DataFrame | None:
    return pd.read_csv(ev.characterize) if ev.characterize is not None else None


def c19(ev: Evidence) -> Finding:
    ch = _characterize(ev)
    if ch is None:
        return Finding("no characterization given (--characterize)", NOT_MEASURED)
    detail = ", ".join(f"{t}: max {fmt(a, 2)} %, mean {fmt(b, 2)} %" for t, a, b in
                       zip(ch["trace"], ch["active max %"], ch["active mean %"]))
    ours = (f"active max {_span(ch['active max %'], ' %', 2)}, mean {_span(ch['active mean %'], ' %', 2)} "
            f"over {_n(len(ch), 'trace')}")
    below = bool((ch["active max %"] < 14.0).all())
    return Finding(ours + "; GPT2-40B and T5-11B not built",
                   PARTLY if below else NOT_SUPPORTED, (str(ev.characterize),), detail + "; GPT2-40B and T5-11B not built")


def c20(ev: Evidence) -> Finding:
    ch = _characterize(ev)
    if ch is None:
        return Finding("no characterization given (--characterize)", NOT_MEASURED)
    a, b = "of them inactive > 10^4 µs %", "of them inactive > migration at 6.5 GB/s %"
    detail = ", ".join(f"{t}: {fmt(x, 1)} % / {fmt(y, 1)} %" for t, x, y in zip(ch["trace"], ch[a], ch[b]))
    ours = (f"{_span(ch[a], ' %', 1)} inactive > 10^4 µs, {_span(ch[b], ' %', 1)} longer than their migration, "
            f"over {_n(len(ch), 'trace')}")
    holds = bool((ch[a] > 40.0).all())
    return Finding(ours, SUPPORTED if holds else NOT_SUPPORTED,
                   (str(ev.characterize),), detail + " (> 10^4 µs / > migration at 6.5 GB/s)")


def c21(ev: Evidence) -> Finding:
    if ev.roofline is None:
        return Finding("no roofline given (--roofline)", NOT_MEASURED)
    rf = pd.read_csv(ev.roofline)
    rf = rf[(rf["policy"] == "fifo") & rf["bandwidth_gbps"].isin((32.0, 48.0))]
    detail = ", ".join(f"{m} at {int(b)} GB/s {fmt(v, 2)}" for m, b, v in
                       zip(rf["model"], rf["bandwidth_gbps"], rf["normalized_throughput"]))
    at = {b: rf.loc[rf["bandwidth_gbps"] == b, "normalized_throughput"] for b in (32.0, 48.0)}
    ours = (f"{_span(at[32.0], digits=2)} at 32 GB/s, {_span(at[48.0], digits=2)} at 48 GB/s over "
            f"{_n(rf['model'].nunique(), 'trace')} (modeled normalized throughput, FIFO)")
    near = at[48.0] >= NEAR_IDEAL / 100
    return Finding(ours, SUPPORTED if near.all() else PARTLY if near.any() else NOT_SUPPORTED, (str(ev.roofline),),
                   detail + " (modeled normalized throughput, FIFO)")


def _never(why: str) -> Callable[[Evidence], Finding]:
    return lambda ev: Finding(why, NOT_MEASURED)


CLAIMS: tuple[Claim, ...] = (
    Claim("C1", "TeraIO is faster than ZeRO-Offload and ZeRO-Infinity on average", "Fig. 7", "1.47×",
          "TeraIO-Mixed ÷ the faster ZeRO baseline per point, mean over the points where both ran ok; "
          "supported ≥ 0.9 × 1.47, partly > 1, else not supported; untuned ZeRO caps it at partly", c1),
    Claim("C2", "TeraIO reaches this share of Ideal on average", "Fig. 7", "80.7 %",
          "TeraIO-Mixed % of Ideal, mean over points with a measured Ideal (modeled ones shown apart); "
          "supported ≥ 0.9 × 80.7, partly ≥ 0.5 ×, else not supported", c2),
    Claim("C3", "Speedup over the ZeRO series, at most", "Fig. 7", "1.59×",
          "as C1, the maximum over points", c3),
    Claim("C4", "ZeRO-Offload's share of Ideal (Llama3-8B / Granite-8B); ZeRO-Infinity slightly below it",
          "Fig. 7", "65.9 % / 65.5 %",
          "each model's mean within 10 points of the paper's, and ZeRO-Infinity ÷ ZeRO-Offload in 0.8–1.0 "
          "where both ran; supported if all hold, partly if some", c4),
    Claim("C5", "Llama3-70B: ZeRO-Offload fails; ZeRO-Infinity and TeraIO-Mixed share of Ideal; their ratio",
          "Fig. 7", "fails; 43.0 %, 59.7 %; 1.33×",
          "ZeRO-Offload failed at every Llama3-70B point, and TeraIO-Mixed ÷ ZeRO-Infinity ≥ 0.9 × 1.33 (mean "
          "over the points where both ran ok); supported if both hold, partly if one", c5),
    Claim("C6", "Llama3-8B: TeraIO-SSD and TeraIO-Mixed near Ideal; a bigger micro-batch adds throughput",
          "Fig. 7", "near Ideal; +9 %",
          f"near = ≥ {NEAR_IDEAL:.0f} % of a measured Ideal at every point; partly where only one variant, or "
          "only a modeled Ideal, gets there; the +9 % needs rows at two micro-batches", c6),
    Claim("C7", "Granite-8B: TeraIO-SSD ≈ ZeRO; TeraIO-Mixed near Ideal; 4 SSDs per GPU too few for SSD-only",
          "Fig. 7", "≈; near Ideal",
          f"TeraIO-SSD ÷ ZeRO in 0.9–1.1, TeraIO-Mixed ≥ {NEAR_IDEAL:.0f} % of a measured Ideal; supported if "
          "all measured parts hold, partly if some", c7),
    Claim("C8", "Over all sweeps, TeraIO-Mixed closest to Ideal and TeraIO-SSD ≥ ZeRO", "Fig. 7", "always",
          "per point, among systems that ran ok; supported if every check holds, partly if at least half", c8),
    Claim("C9", "ZeRO-Infinity OOM above seq 3,072 (Llama3-70B); TeraIO trains every configuration",
          "Fig. 7(2)", "OOM; all ok", "TeraIO ok at every Llama3-70B point and ZeRO-Infinity oom at one", c9),
    Claim("C10", "TeraIO-Mixed stalls less than ZeRO-Infinity and overlaps more", "Fig. 8", "qualitative",
          "needs both systems' stall time; DeepSpeed reports none", c10),
    Claim("C11", "Migration above 16 GB/s for this share of iteration time (Granite-8B / Llama3-70B)",
          "Fig. 10(2)", "> 64 % / 82.3 %", "TeraIO-Mixed's share above the paper's at every point of that model",
          c11),
    Claim("C12", "Hardware cost vs all-GPU: TeraIO-SSD / TeraIO-Mixed cheaper", "Table 3", "5.88× / 5.41×",
          "recomputed from Table 3's prices, equal to the 2 digits printed", c12, reads=None),
    Claim("C13", "Cost efficiency vs ZeRO-Offload / ZeRO-Infinity (Llama3-70B)", "Table 3 + Fig. 7",
          "1.45× / 1.47×", "TeraIO-Mixed's tokens/s per $ ÷ each ZeRO's (analysis.cost, the rows' prices) at "
          "the Llama3-70B points where both ran ok, mean ≥ 0.9 × the paper's for both; partly if one holds or "
          "TeraIO-Mixed is cheaper per token anywhere", c13),
    Claim("C14", "Llama3-8B near Ideal with 2 SSDs + 64 GB of CPU memory", "Fig. 9a", "near Ideal",
          f"a TeraIO-Mixed row with ≥ 2 SSDs at ≥ {NEAR_IDEAL:.0f} % of Ideal", c14, reads="fig9"),
    Claim("C15", "Llama3-70B: 2 SSDs + 512 GB give this share of 4 SSDs + 1 TB", "Fig. 9b", "73.1 %",
          "needs Llama3-70B TeraIO-Mixed rows at 2 and 4 SSDs; says how many drives the rows had", c15),
    Claim("C16", "ZeRO-Infinity needs this much CPU memory (Llama3-8B / Llama3-70B)", "Fig. 9, §4.4",
          "170 GB / 770 GB", "ZeRO-Infinity's peak host memory at the full models", c16),
    Claim("C17", "GDS cuts host CPU use and host memory bandwidth", "Fig. 11", "12.3 % / 97.4 %",
          "needs nvidia-fs, host CPU and memory-bandwidth counters, 2 GPUs × 4 SSDs",
          _never("no row records host CPU or memory bandwidth, and no GDS (nvidia-fs) run exists"), reads=None),
    Claim("C18", "One-time plan compilation (Llama3-8B / Granite-8B / Llama3-70B)", "Table 1",
          "31.2 / 37.9 / 396.6 s", "median compile time no longer than the paper's, for all three", c18, reads=None),
    Claim("C19", "Active tensors < 14 % (1.7 % on average) of GPU capacity per kernel", "Fig. 1",
          "< 14 % (1.7 %)", "every trace's active max below 14 %; partly as GPT2-40B and T5-11B are not built", c19,
          reads=None),
    Claim("C20", "> 40 % of 10 MB–1 GB tensors inactive > 10^4 µs, longer than their migration at 6.5 GB/s",
          "Fig. 2", "> 40 %", "every trace's share above 40 %", c20, reads=None),
    Claim("C21", "32–48 GB/s per GPU is enough for near-Ideal throughput", "Fig. 3", "near Ideal",
          f"modeled normalized throughput at 48 GB/s ≥ {NEAR_IDEAL / 100:.2f} for every trace", c21, reads=None),
    Claim("C22", "BERT-Large: 48 % of tensors > 100 MB; their inactive periods ~100× shorter", "§2.1", "48 %; 100×",
          "needs a BERT-Large trace", _never("BERT-Large is not built"), reads=None),
)


def findings(ev: Evidence) -> list[tuple[Claim, Finding]]:
    """Every claim's finding, in order: ``not measured`` for a claim whose sweeps have no row
    to read (:meth:`Evidence.unmeasured`)."""
    return [(c, ev.unmeasured(c.reads) or c.compute(ev)) for c in CLAIMS]


def _trials(used: str) -> int:
    """How many ``result.json`` files one entry of :attr:`Finding.used` stands for
    (``…-t{0,1,2}/result.json``: 3)."""
    m = re.search(r"-t\{([\d,]+)\}/", used)
    return len(m.group(1).split(",")) if m else 1


def sources(used: tuple[str, ...], sweeps: list[str]) -> str:
    """Where a finding's figure comes from, in a few words: per sweep the number of rows
    (``result.json`` files) it used, then each other file; ``none``."""
    rows: dict[str, int] = {}
    files = []
    for u in used:
        head = u.split("/", 1)[0]
        if head in sweeps and u.endswith("result.json"):
            rows[head] = rows.get(head, 0) + _trials(u)
        else:
            files.append(u)
    parts = [f"{name}: {_n(n, 'row')}" for name, n in rows.items()] + files
    return ", ".join(parts) if parts else "none"


def claims_table(found: list[tuple[Claim, Finding]], sweeps: list[str]) -> pd.DataFrame:
    """One row per claim: the claim, the paper's figure, ours in one or two sentences, the
    verdict, and where ours comes from (:func:`sources`)."""
    return pd.DataFrame({
        "#": [c.id for c, _ in found], "claim (paper)": [f"{c.text} ({c.where})" for c, _ in found],
        "paper": [c.paper for c, _ in found], "ours": [f.ours for _, f in found],
        "verdict": [f.verdict for _, f in found],
        "from": [sources(f.used, sweeps) for _, f in found]}).astype(object)


def claims_detail_table(found: list[tuple[Claim, Finding]]) -> pd.DataFrame:
    """One row per claim: the rule its verdict follows, our figure point by point, and every
    row or file it used (trials folded)."""
    return pd.DataFrame({
        "#": [c.id for c, _ in found], "rule": [c.rule for c, _ in found],
        "ours, point by point": [f.detail or f.ours for _, f in found],
        "rows used": [", ".join(f.used) if f.used else "none" for _, f in found]}).astype(object)


def ideal_bias_frame(ev: Evidence) -> pd.DataFrame:
    """Modeled ÷ measured Ideal iteration time at every point with a measured Ideal (ok) and a
    TeraIO row's trace of the whole step (the modeled Ideal's method, ``baselines.ideal``:
    the trace's summed op times). Columns: ``model``, ``config``, ``trace`` (sweep/path),
    ``modeled_s``, ``measured_s`` (Ideal's mean iteration), ``ratio`` (> 1: the model runs slow,
    so a % of a modeled Ideal reads high). A damaged trace is left out, with a warning naming
    it (``load.run_trace``)."""
    rows = []
    for s in ev.sweeps:
        r = s.runs
        ideal = r[(r["system"] == "ideal") & (r["measure"] == "measured") & ~r["failed"]]
        if not len(ideal):
            continue
        measured = ideal.groupby(agg.WORKLOAD_KEYS, dropna=False)["iteration_seconds"].mean()
        tr = r[r["trace_path"].notna() & r["system"].isin(("teraio_ssd", "teraio_mixed"))]
        for _, row in tr.sort_values("job_dir").iterrows():
            key = tuple(row[k] for k in agg.WORKLOAD_KEYS)
            if key not in measured.index:
                continue
            trace = run_trace(s.root, row["trace_path"])
            if trace is None or trace.meta.get("batch_size") != row["batch_size"]:
                continue
            modeled = float(trace.op_seconds.sum())
            rows.append({"model": row["model"], "config": row["config"], "trace": f"{s.name}/{row['trace_path']}",
                         "modeled_s": modeled, "measured_s": float(measured[key]), "ratio": modeled / float(measured[key])})
    return pd.DataFrame(rows, columns=["model", "config", "trace", "modeled_s", "measured_s", "ratio"])


def ideal_bias_table(bias: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"Model": bias["model"], "Config": bias["config"], "trace": bias["trace"],
                         "modeled s/iter": bias["modeled_s"].map(fmt),
                         "measured Ideal s/iter": bias["measured_s"].map(fmt),
                         "modeled ÷ measured": bias["ratio"].map(lambda v: fmt(v, 3))}).astype(object)


def _write(df: pd.DataFrame, stem: Path, caption: str, notes: list[str]) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    md, tex = stem.with_suffix(".md"), stem.with_suffix(".tex")
    md.write_text(to_markdown(df, caption, notes))
    tex.write_text(to_latex(df, caption, stem.name, notes))
    return [md, tex]


def _why_aside(aside: pd.DataFrame) -> str:
    """``"14 rows with no GPU, 2 rows with capacity not enforced"``: the rows set aside, by why."""
    return ", ".join(f"{_n(n, 'row')} with {why}" for why, n in aside["why"].value_counts().items())


def _aside_note(aside: pd.DataFrame) -> list[str]:
    """The claims table's note on the rows no claim read (:attr:`Evidence.aside`); none where
    there are none."""
    if not len(aside):
        return []
    return [f"Read by no claim: {_why_aside(aside)} (a claim is about complete runs on a GPU held to its "
            "capacity): "
            + ", ".join(f"{s}/{j}" for s, j in zip(aside["sweep"], aside["job_dir"])) + "."]


def write_claims(ev: Evidence, out: Path) -> dict[str, Path]:
    """Write ``claims``, ``claims_detail``, ``ideal_bias``, ``fairness`` and ``runtime``
    (``.md`` and ``.tex``) under ``out``; return ``{name: markdown path}`` of the :data:`BLOCKS`."""
    who = "; ".join(describe(s) for s in ev.given)
    rows_of = "the rows of " + (", ".join(s.name for s in ev.given) or "no sweep")  # the other captions
    found = findings(ev)
    counts = pd.Series([f.verdict for _, f in found]).value_counts()
    tally = ", ".join(f"{counts.get(v, 0)} {v}" for v in (SUPPORTED, PARTLY, NOT_SUPPORTED, NOT_MEASURED))
    _write(claims_table(found, [s.name for s in ev.given]), out / "claims",
           f"The paper's claims, computed from rows — {who}",
           [f"Verdicts: {tally}. Each verdict follows the rule beside its claim in analysis.claims.CLAIMS; "
            "claims_detail.md beside this file gives the rule, the figure point by point and every row used.",
            f"Near Ideal is ≥ {NEAR_IDEAL:.0f} % (the paper gives no bar). % of Ideal averages measured "
            "(or composed: timed in phases) Ideals only; a modeled Ideal is named where used (its bias: "
            "ideal_bias). Fig. 7 claims read the sweeps named fig7*, Fig. 9 claims those named fig9*.",
            *_aside_note(ev.aside)])
    _write(claims_detail_table(found), out / "claims_detail",
           f"The paper's claims: rules, figures point by point, rows used — {rows_of}",
           ["Rows used: result.json files, trials folded (-t{0,1,2}), paths relative to the sweeps' parent."])
    bias = ideal_bias_frame(ev)
    _write(ideal_bias_table(bias), out / "ideal_bias",
           f"The modeled Ideal against the measured one — {rows_of}",
           ["Modeled: the TeraIO row's trace of the whole step, its op times summed (how a modeled "
            "Ideal row is made, baselines.ideal); measured: Ideal's mean iteration at the same "
            "point. Above 1 the model is slow, so a % of a modeled Ideal reads high by that factor."
            + (f" Over {len(bias)} traces: {fmt(bias['ratio'].min(), 3)}–{fmt(bias['ratio'].max(), 3)}."
               if len(bias) else " No point has both.")])
    fair = fairness_frame(ev.runs) if len(ev.runs) else pd.DataFrame()
    n_tuned = int(fair["tuned"].sum()) if len(fair) else 0
    _write(fairness_table(fair) if len(fair) else pd.DataFrame({"none": []}), out / "fairness",
           f"What each system ran with, and how it was chosen — {rows_of}",
           [f"{n_tuned} of {len(fair)} (point, system) groups tuned by measurement (the rows' tuning); "
            "the paper tunes each baseline per configuration (§4.1)."])
    times = runtime_frame(ev.runs) if len(ev.runs) else pd.DataFrame()
    _write(runtime_table(times) if len(times) else pd.DataFrame({"none": []}), out / "runtime",
           f"How long the runs took — {rows_of}",
           ["Worker time: each row's wall_seconds, the worker process from start to end (set-up, "
            "profiling and planning included); failed runs count. A sweep's time is the sum over its "
            f"points; in all {fmt(times['total_s'].sum() / HOUR, 2) if len(times) else '0'} worker hours, "
            "one run after another. Each run is capped at its experiment's timeout_s."])
    return {name: out / f"{name}.md" for name in BLOCKS}


def insert(target: Path, blocks: dict[str, Path]) -> list[str]:
    """Replace each ``<!-- analysis.claims:NAME begin -->…<!-- analysis.claims:NAME end -->``
    block of ``target`` with the file ``blocks[NAME]``; return the names replaced.

    Raises:
        ValueError: ``target`` has no such block, or one without its end marker.
    """
    text = target.read_text()
    done = []
    for name, path in blocks.items():
        begin, end = f"<!-- analysis.claims:{name} begin -->", f"<!-- analysis.claims:{name} end -->"
        if begin not in text:
            continue
        if end not in text.split(begin, 1)[1]:
            raise ValueError(f"{target}: {begin} has no {end}")
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = f"{head}{begin}\n{path.read_text().strip()}\n{end}{tail}"
        done.append(name)
    if not done:
        raise ValueError(f"{target}: no generated block (<!-- analysis.claims:NAME begin --> with NAME in "
                         f"{', '.join(blocks)})")
    target.write_text(text)
    return done


def block(target_text: str, name: str) -> str | None:
    """The text of block ``name`` in a document (see :func:`insert`), ``None`` if absent."""
    begin, end = f"<!-- analysis.claims:{name} begin -->", f"<!-- analysis.claims:{name} end -->"
    if begin not in target_text:
        return None
    return target_text.split(begin, 1)[1].split(end, 1)[0].strip()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m analysis.claims", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dirs", nargs="+", help="sweep directories (their result.json files)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--characterize", type=Path, help="characterize.csv of python -m analysis.characterize (C19, C20)")
    ap.add_argument("--roofline", type=Path, help="roofline.csv of the fig3 experiment (C21)")
    ap.add_argument("--plan-compile", type=Path, help="plan_compile JSON of benchmarks/plan_compile.py (C18)")
    ap.add_argument("--insert", type=Path, nargs="*", default=[],
                    help="documents whose generated blocks to replace with what was written")
    args = ap.parse_args(argv)
    for p in (args.characterize, args.roofline, args.plan_compile):
        if p is not None and not p.is_file():
            raise SystemExit(f"python -m analysis.claims: no such file {p}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sweeps = [load_sweep(d, exclude=Path(d) / "analysis") for d in args.sweep_dirs]
        ev = Evidence(sweeps, args.characterize, args.roofline, args.plan_compile)
        written = write_claims(ev, args.out)
        for target in args.insert:
            print(f"{target}: replaced {', '.join(insert(target, written))}")
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"python -m analysis.claims: {e}") from e
    for path in written.values():
        print(path)


if __name__ == "__main__":
    main()
