"""What each system ran with at each point, and how that setting was chosen: tuned by
measurement (the row's ``tuning``: every candidate tried, with its tokens/s or its failure,
and the one kept) or set by the experiment and not tuned (paper §4.1 tunes each baseline per
configuration).

One row per (point, system) group of the per-run frame (:mod:`analysis.load`), from the
columns ``ran_micro_batch_size``, ``system_options_json`` and ``tuning_json``; for TeraIO's
systems also the engine settings the rows ran with (``system_options_json``, ``host_packing``,
``ssd_io_mode``), so that rows made by engines with other defaults are told apart.
"""
from __future__ import annotations

import json

import pandas as pd

from . import aggregate as agg
from .render import fmt

SETTING_KEYS = {
    # what, beside the micro-batch, a system's rows are set by (the options a tuning may choose)
    "zero_offload": ("stage",),
    "zero_infinity": ("stage", "prefetch_bucket_size", "param_buffer_count", "param_buffer_size",
                      "optimizer_buffer_count"),
}


ENGINE_KEYS = {
    # the migration engine's options whose defaults changed over the committed rows; a key
    # missing from a row's options predates the option (the engine then behaved as noted)
    "device_waits": "false", "release_grads": "false", "host_arena": "slots",
}
ENGINE_SYSTEMS = ("teraio_ssd", "teraio_mixed")


def _option_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _engine_text(g: pd.DataFrame, options: dict) -> str:
    """The engine settings of a TeraIO group: each of :data:`ENGINE_KEYS` (``absent``, with
    what the engine did then, where the rows predate it), the host packing the plans kept and
    the SSD tier's I/O path; ``n/a`` for other systems."""
    if g["system"].iloc[0] not in ENGINE_SYSTEMS:
        return "n/a"
    parts = [f"{key} {_option_text(options[key])}" if key in options and options[key] is not None
             else f"{key} absent (before the option: {then})" for key, then in ENGINE_KEYS.items()]
    packing = sorted(set(g["host_packing"].dropna()))
    if packing:
        parts.append(f"host tier kept as {' / '.join(packing)}")
    modes = sorted(set(g["ssd_io_mode"].dropna()))
    if modes:
        parts.append(f"SSD I/O {' / '.join(modes)}")
    return ", ".join(parts)


def _micro_batch_source(options: dict) -> str:
    if options.get("micro_batch_size") is not None:
        return "micro-batch set in the run config (system.options.micro_batch_size)"
    return "the point's micro-batch"


def _setting_text(system: str, mb: str, options: dict) -> str:
    parts = [f"micro-batch {mb}"]
    for key in SETTING_KEYS.get(system, ()):
        if key in options:
            value = options[key]
            parts.append(f"{key} {value}" + (" (prefetch off)" if key == "prefetch_bucket_size" and value == 0
                                             else ""))
    return ", ".join(parts)


def _candidate_text(c: dict) -> str:
    setting = ", ".join(f"{k} {v}" for k, v in sorted((c.get("setting") or {}).items()))
    status = c.get("status") or "?"
    if status == "ok":
        return f"{setting}: {fmt(c.get('tokens_per_s'))} tokens/s"
    why = c.get("message")
    return f"{setting}: {status}" + (f" ({why})" if why else "")


def fairness_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (``aggregate.COMPARE_KEYS``, system) group, in the paper's order: ``model``,
    ``config``, ``system``, ``ran_with`` (the micro-batch and the system's other set options),
    ``engine`` (TeraIO's engine settings, :func:`_engine_text`; ``n/a`` for other systems),
    ``tuned`` (bool: every row of the group carries a ``tuning``), ``how`` (how the setting
    was chosen), ``candidates`` (each tuning candidate with its tokens/s or failure, "; "
    joined; empty when not tuned), ``tuning_file`` (empty when not tuned)."""
    rows = []
    for keys, g in runs.groupby(agg.COMPARE_KEYS + ["system"], dropna=False, sort=False):
        system = g["system"].iloc[0]
        options = json.loads(g["system_options_json"].dropna().iloc[0]) if g["system_options_json"].notna().any() else {}
        mb = agg.ran_micro_batch(g)
        tunings = [json.loads(t) for t in g["tuning_json"].dropna()]
        tuned = len(tunings) == len(g) and len(g) > 0
        if tuned:
            t = tunings[0]
            chosen = ", ".join(f"{k} {v}" for k, v in sorted((t.get("chosen") or {}).items()))
            how = f"tuned by measurement: kept {chosen}" + (
                "" if all(x == t for x in tunings) else " (the rows name different tunings)")
            candidates = "; ".join(_candidate_text(c) for c in t.get("candidates") or [])
            tuning_file = str(t.get("file") or "")
        else:
            how = (f"not tuned: {_micro_batch_source(options)}"
                   + ("" if not tunings else f" ({len(tunings)} of {len(g)} rows tuned)"))
            candidates, tuning_file = "", ""
        rows.append({**dict(zip(agg.COMPARE_KEYS + ["system"], keys)), "config": g["config"].iloc[0],
                     "ran_with": _setting_text(system, mb, options), "engine": _engine_text(g, options),
                     "tuned": tuned, "how": how,
                     "candidates": candidates, "tuning_file": tuning_file})
    cols = agg.COMPARE_KEYS + ["system", "config", "ran_with", "engine", "tuned", "how", "candidates", "tuning_file"]
    return agg.sort_groups(pd.DataFrame(rows, columns=cols)) if rows else pd.DataFrame(columns=cols)


def fairness_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The display form of :func:`fairness_frame`."""
    return pd.DataFrame({
        "Model": frame["model"], "Hardware": frame["hardware"], "Config": frame["config"],
        "System": frame["system"].map(agg.system_label),
        "ran with": frame["ran_with"], "engine (TeraIO)": frame["engine"], "how it was chosen": frame["how"],
        "candidates tried (tokens/s or failure)": frame["candidates"].replace("", "none"),
        "tuning file": frame["tuning_file"].replace("", "none")}).astype(object)
