"""Trials pooled as one point must be runs of one config: a mean over trials made with a
different learning rate or GPU capacity would show as one point what are two.

The trials of a group (``aggregate.GROUP_KEYS``) may differ only in what makes them trials
(:data:`TRIAL_KEYS`: the trial, its seed, how many steps it ran and measured, which the tables
show per group) and in what does not change what a run measures
(``teraio.harness.rows.NOT_IDENTITY``: where the drives are, the time limit). A setting left to
``auto`` compares as the choice its row records (:func:`ran_with`).
"""
from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping

import pandas as pd

from teraio import systems
from teraio.harness.rows import changed_keys

from .aggregate import GROUP_KEYS

TRIAL_KEYS = ("trial", "seed", "workload.warmup_steps", "workload.measure_steps")


def ran_with(result: dict) -> dict:
    """The config a row's run ran with: its ``config``, where a setting is ``auto`` the choice
    its run made, as the system's decider reads it from an ok row (the registry's
    ``SystemSpec.decider``; TeraIO: ``recompute`` ``on`` or ``off`` by its plan's recomputes,
    ``host_arena`` the packing its plan kept, ``workload.micro_batch_size`` the micro-batch it
    chose; where a setting is null, as ``host_update_groups`` with ``host_update=on``, the
    choice too), so that a point's trial that made its choices pools with the trials that ran them
    (``teraio.harness.tune.decided``)."""
    cfg = copy.deepcopy(result.get("config") or {})
    name = (cfg.get("system") or {}).get("name") or (result.get("point") or {}).get("system")
    ref = systems.get(name).decider if name in systems.names() else None
    if ref is None or result.get("status") != "ok" or not result.get("plan"):
        return cfg
    options, workload = importlib.import_module(ref).decision(result)
    options_now = cfg.setdefault("system", {}).setdefault("options", {})
    for section, chosen in ((options_now, options), (cfg.setdefault("workload", {}), workload)):
        for key, value in chosen.items():
            # null where given: left to the run too (host_update_groups); a key the config
            # lacks (a row made before it existed) is not added
            if section.get(key) == "auto" or (key in section and section[key] is None):
                section[key] = value
    return cfg


def _value(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


def check_one_config(runs: pd.DataFrame, configs: Mapping[tuple[str, str], dict]) -> None:
    """Refuse a group of ``runs`` (the per-run frame, ``analysis.load``) whose rows ran with
    different configs. A failed row whose setting is ``auto`` made no choice there, so it
    differs from no trial's choice (a deciding trial that failed, the next deciding).

    Args:
        configs: ``(sweep, job_dir)`` of every row of ``runs`` -> :func:`ran_with` of its row.

    Raises:
        ValueError: for the first such group: its point, each key that differs with the value
            of each trial, and what to do.
    """
    for _, g in runs.groupby(GROUP_KEYS, dropna=False, sort=False):
        if len(g) < 2:
            continue
        cfgs = [configs[(s, j)] for s, j in zip(g["sweep"], g["job_dir"])]
        keys = sorted({k for c in cfgs[1:] for k in changed_keys(cfgs[0], c) if k not in TRIAL_KEYS})
        # a failed trial that was to make a choice made none: its "auto" matches any choice
        made = [[c for c, st in zip(cfgs, g["status"]) if not (st != "ok" and _value(c, k) == "auto")] for k in keys]
        keys = [k for k, cs in zip(keys, made) if len({repr(_value(c, k)) for c in cs}) > 1]
        if not keys:
            continue
        r = g.iloc[0]
        trials = [f"{s}/{j}" for s, j in zip(g["sweep"], g["job_dir"])]
        per_key = "; ".join(f"{k}: " + ", ".join(f"{_value(c, k)!r} in {t}" for c, t in zip(cfgs, trials))
                            for k in keys)
        raise ValueError(
            f"the trials of {r['model']} {r['system']} {r['config']} (micro-batch {r['micro_batch_size']}) were made "
            f"with different configs, so their mean would pool different runs as one point: {per_key}; analyse "
            "each config apart (move the job dirs of one into a sweep dir of their own) or run the point's trials "
            "again with one config (sweep.rerun_changed=true)")
