"""What the sweep and the analysis both take from a ``result.json``: whether it is a row the
analysis reads (:func:`check_row`, :func:`row_status`), and which keys of the run config tell
two rows' runs apart (:func:`changed_keys`).

The sweep counts a point as done only where its row is one the analysis reads, so a row the
analysis would skip is run again (the sweep keeps it as ``result.<n>.json``), never counted.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from teraio.result import FORMAT, POINT_KEYS, STATUSES

# Keys every row of FORMAT has (teraio.result.result_row) and the analysis reads: a row
# lacking one is skipped, never counted.
REQUIRED_KEYS = ("status", "point", "config", "iterations", "tokens_per_s")
UNREADABLE = "unreadable"
""":func:`row_status` of a file that is not a row the analysis reads."""


def check_row(result) -> None:
    """Refuse a row the analysis cannot read faithfully.

    Raises:
        ValueError: not a JSON object; ``format`` other than ``teraio.result/1``; a key of
            :data:`REQUIRED_KEYS` missing; ``status`` not one of ``teraio.result.STATUSES``;
            ``point`` lacking a key of ``teraio.result.POINT_KEYS``; ``iterations`` not a
            list, or empty in an ``ok`` row (each message names the key).
    """
    if not isinstance(result, dict):
        raise ValueError(f"not a result row (a JSON {type(result).__name__}, not an object)")
    if result.get("format") != FORMAT:
        raise ValueError(f"format {result.get('format')!r} is not {FORMAT!r}, the one this analysis reads")
    missing = [k for k in REQUIRED_KEYS if k not in result]
    if missing:
        raise ValueError(f"required key {', '.join(map(repr, missing))} missing")
    if result["status"] not in STATUSES:
        raise ValueError(f"status {result['status']!r} not in {STATUSES}")
    point = result["point"]
    lacking = [k for k in POINT_KEYS if not isinstance(point, dict) or k not in point]
    if lacking:
        raise ValueError(f"required key point.{lacking[0]} missing (a point has {', '.join(POINT_KEYS)})")
    if not isinstance(result["iterations"], list) or (result["status"] == "ok" and not result["iterations"]):
        raise ValueError("required key 'iterations' empty in an ok row" if isinstance(result["iterations"], list)
                         else f"iterations is a {type(result['iterations']).__name__}, not a list")


def read_row(path: str | Path) -> dict:
    """The row in ``path``, checked (:func:`check_row`).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not UTF-8 JSON, or as :func:`check_row`.
    """
    result = json.loads(Path(path).read_text())
    check_row(result)
    return result


def row_status(path: str | Path) -> tuple[str | None, str]:
    """``(status, why)`` of the row in ``path`` as the analysis counts it: ``(None, "")``
    where there is no file, ``(UNREADABLE, why)`` where it is not a row the analysis reads
    (:func:`read_row`), else the row's ``status`` and ``""``."""
    path = Path(path)
    if not path.exists():
        return None, ""
    try:
        return read_row(path)["status"], ""
    except (OSError, ValueError) as e:
        return UNREADABLE, str(e)


# Keys of the run config that do not change what a run measures: where its drives are
# (so a runs dir copied elsewhere keeps its rows) and how long it may take.
NOT_IDENTITY = ("hardware.ssd_dirs", "system.options.nvme_path", "timeout_s")


# The config's sections (RunConfig's dataclasses): a field only one side has is a field
# added or dropped since the row was made, not compared; below them a value (a map such as
# hardware.prices) is compared whole.
SECTIONS = ("", "model.", "workload.", "system.", "hardware.", "system.options.")

# Fields added to the run config whose absence from a row means a value: the way every run
# went before the field existed. A row without one is compared as having that value.
ADDED_AS = {("hardware", "capacity_mode"): "fraction"}


def _as_added(config: Any) -> Any:
    """``config`` with each :data:`ADDED_AS` field it lacks set to that field's value."""
    if not isinstance(config, dict):
        return config
    out = dict(config)
    for (section, key), value in ADDED_AS.items():
        if isinstance(out.get(section), dict) and key not in out[section]:
            out[section] = {**out[section], key: value}
    return out


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the run config whose values differ between ``old`` (the config a row
    was made with) and ``new``, but for :data:`NOT_IDENTITY`; a field of a section
    (:data:`SECTIONS`) that only one side has (a row made before the field existed) is
    not compared, unless :data:`ADDED_AS` says what its absence meant."""
    if not prefix:
        old, new = _as_added(old), _as_added(new)
    if prefix in SECTIONS and isinstance(old, dict) and isinstance(new, dict):
        return [k for key in sorted(set(old) & set(new), key=str)
                for k in changed_keys(old[key], new[key], f"{prefix}{key}.")]
    key = prefix.rstrip(".")
    return [] if old == new or key in NOT_IDENTITY else [key]
