"""Load a sweep's ``result.json`` rows (format ``teraio.result/1``, see ``teraio.result``)
into two tidy pandas frames.

``runs``: one row per run (one ``result.json``). Columns:

- identity: ``sweep``, ``job_dir`` (relative to the sweep dir), ``model``, ``system``,
  ``hardware`` (:func:`hardware_label`: the config's name and the card the row ran on), ``batch_size``, ``micro_batch_size`` (where the point says ``auto``, TeraIO's
  choice, the row's ``micro_batch.chosen``), ``seq_len``, ``trial``, ``config``
  (the paper's label, ``bs{batch_size}_seq{seq_len}``, ``_pp<S>`` added for a pipeline),
  ``host_mem_cap_bytes`` and ``n_ssd`` (``len(hardware.ssd_dirs)``), both from the run
  config (the Fig. 9 axes), and ``pipeline_stages`` (``workload.pipeline_stages``, 1 for
  rows that predate it);
- outcome: ``status`` (ok | oom | error | timeout | interrupted, or ``non-finite`` for an ``ok`` row whose
  tokens/s or a loss is not finite), ``error``, ``failed`` (status ≠ ok),
  ``measure`` (measured | modeled);
- throughput: ``tokens_per_s`` (tokens/s), ``n_iterations``, ``iteration_seconds`` (mean, s),
  ``warmup_steps`` (the run config's ``workload.warmup_steps``: steps run before the measured
  ones, not measured; null where the config has none), ``asked_steps`` (its
  ``workload.measure_steps``: the measured steps the point asks; an ok ``measured`` row with
  fewer, ``n_iterations``, was cut short by its time limit, ``teraio.systems.loop.measure_steps``);
- stalls: ``stall_count``, ``stall_seconds`` (totals over measured iterations, s),
  ``stall_count_per_iter``, ``stall_seconds_per_iter``;
- bytes: ``bytes_ssd``, ``bytes_host`` (offloaded + prefetched over measured iterations);
- memory: ``peak_allocated_bytes``, ``peak_reserved_bytes``, ``peak_host_rss_bytes``, ``capacity_bytes``,
  ``cap_not_enforced`` (the row's ``capacity_enforced`` is false: nothing held the run to that capacity),
  ``unoffloaded_peak_bytes``, ``memory_pressure`` (M, a fraction: unoffloaded peak ÷
  capacity, computed from those two when the row leaves it null), ``peak_fraction``
  (peak allocated ÷ capacity);
- the tier rates the run planned with (GB/s, the row's ``tier_gbps``; NaN for systems
  without a plan): ``ssd_write_gbps``, ``ssd_read_gbps``, ``host_d2h_gbps``, ``host_h2d_gbps``;
- one-time costs and facts: ``plan_compile_seconds``, ``profile_seconds``, ``ssd_io_mode``,
  ``gpu_name``, ``n_gpus``, ``wall_seconds``, ``started_at``, ``finished_at``;
- side files: ``prices_json`` (the run config's ``hardware.prices`` as JSON, "{}" if none),
  ``transfers_path``, ``oplog_path``, ``trace_path`` (relative to the sweep dir, null if absent);
- what the run ran with: ``ran_micro_batch_size`` (the micro-batch it trained with: a ZeRO row's
  ``zero_micro_batch_size``, else its tuning's chosen ``micro_batch_size``, else the run
  config's ``system.options.micro_batch_size``, else the point's), ``system_options_json``
  (the run config's ``system.options`` as JSON, "{}" if none) and ``tuning_json`` (the row's
  ``tuning``: the tuning file, the chosen setting and every candidate tried, as JSON; null
  for a row run with an untuned setting), ``host_packing`` (how the plan laid out the host
  tier: ``region``, one region of the cap, or ``slots``, from the row's ``plan.host_arena``;
  null where the row has no plan or predates that key).

``not_run``: from ``not_run.yaml`` beside the rows, if there is one: system name -> why
it has no row at some points of the sweep (a fact of the machine the rows were made on, such
as its one drive; the throughput table lists those points as not run and says why).

``iterations``: one row per measured iteration of every run, with the identity and outcome
columns above plus ``step``, ``seconds``, ``tokens``, ``tokens_per_s``, ``loss``,
``stall_count``, ``stall_seconds``, ``migration_seconds``, ``overlapped_seconds``
(migration overlapped with compute: ``max(0, migration - stall)``), ``compute_seconds``
(``seconds - stall - overlapped``), ``bytes_offloaded_ssd``, ``bytes_offloaded_host``,
``bytes_prefetched_ssd``, ``bytes_prefetched_host``, and the migration engine's unplanned
work (TeraIO's rows; NaN for other systems and for rows made before a count existed):
``urgent_count``, ``oom_retries``, ``dropped_bytes``, ``deferred_prefetches``,
``spilled_bytes`` (``teraio.core.engine.RECOVERY_KEYS``). Null in the row is NaN/NA here.

Integer keys are nullable ``Int64`` and text is pandas' ``str`` dtype, so a key missing
from a row is NA and survives ``groupby(..., dropna=False)``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from teraio import systems
from teraio.core.engine import RECOVERY_KEYS
from teraio.harness.rows import read_row
from teraio.harness.tune import TUNING_DIR
from teraio.core.trace import Trace
from teraio.perf.jobdir import read_trace, side_file

from .trials import check_one_config, ran_with

RESULT_NAME = "result.json"
NOT_RUN_NAME = "not_run.yaml"
POINT_KEYS = ("model", "system", "hardware", "batch_size", "micro_batch_size", "seq_len", "trial")
INT_KEYS = ("batch_size", "micro_batch_size", "seq_len", "trial", "host_mem_cap_bytes", "n_ssd",
            "pipeline_stages", "n_gpus", "ran_micro_batch_size")
TEXT_KEYS = ("sweep", "job_dir", "model", "system", "hardware", "config", "status", "error",
             "measure", "ssd_io_mode", "gpu_name", "started_at", "finished_at", "prices_json",
             "transfers_path", "oplog_path", "trace_path", "system_options_json", "tuning_json",
             "host_packing")
TIER_RATE_KEYS = ("ssd_write_gbps", "ssd_read_gbps", "host_d2h_gbps", "host_h2d_gbps")
ID_COLUMNS = ("sweep", "job_dir", *POINT_KEYS, "config", "host_mem_cap_bytes", "n_ssd", "pipeline_stages",
              "status", "error", "failed", "measure", "ran_micro_batch_size")


@dataclasses.dataclass
class Sweep:
    """A loaded sweep. ``skipped``: (path, reason) for each ``result.json`` not loaded;
    ``not_run``: :func:`load_not_run`; ``configs``: ``(sweep, job_dir)`` of each loaded row ->
    the config its run ran with (``analysis.trials.ran_with``)."""

    name: str
    root: Path
    runs: pd.DataFrame
    iterations: pd.DataFrame
    skipped: list[tuple[str, str]]
    not_run: dict[str, str] = dataclasses.field(default_factory=dict)
    configs: dict[tuple[str, str], dict] = dataclasses.field(default_factory=dict)


def load_not_run(root: Path) -> dict[str, str]:
    """``<root>/not_run.yaml``: a mapping of system names (``teraio.systems``) to why the
    system has no row at some points of the sweep; ``{}`` where the file is absent.

    Raises:
        ValueError: the file is not such a mapping (names the bad entry and what is valid).
    """
    path = root / NOT_RUN_NAME
    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must map system names to text, got {type(data).__name__}")
    for name, why in data.items():
        if name not in systems.names():
            raise ValueError(f"{path}: system {name!r} unknown; valid: {', '.join(systems.names())}")
        if not isinstance(why, str) or not why.strip():
            raise ValueError(f"{path}: {name}: {why!r}; must be a non-empty text saying why")
    return {name: " ".join(why.split()) for name, why in data.items()}


def _num(x) -> float:
    if isinstance(x, bool) or x is None:
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _div(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def config_label(batch_size, seq_len, pipeline_stages: int = 1) -> str:
    """The paper's Fig. 7 label, e.g. ``bs32_seq2048``, with ``_pp<S>`` for S > 1 pipeline
    stages; ``?`` for a missing value."""
    def part(v):
        return "?" if v is None or pd.isna(v) else str(int(v))
    return f"bs{part(batch_size)}_seq{part(seq_len)}" + (f"_pp{pipeline_stages}" if pipeline_stages > 1 else "")


def _artifact(root: Path, job_rel: Path, artifacts: dict, name: str) -> str | None:
    """The side file ``name`` of a row, relative to the sweep dir ``root``: as the row names
    it, or its gzip-compressed copy (``<file>.gz``, as committed reference rows keep large
    side files) where only that exists (``teraio.perf.jobdir.side_file``); None where the
    row names none or neither exists (a side file lost with its attempt: the row stays,
    without it)."""
    rel = (artifacts or {}).get(name)
    found = side_file(root / job_rel, rel) if rel else None
    return None if found is None else str(found.relative_to(root))


def run_trace(root: Path, trace_path: str) -> Trace | None:
    """The trace a row names (``trace_path``, relative to the sweep dir ``root``); None, with
    one warning naming the file and what is wrong, where it is damaged (truncated, not gzip,
    not JSON: ``teraio.perf.jobdir.read_trace``): the row is analysed without it."""
    try:
        return read_trace(root / trace_path)
    except (OSError, ValueError) as e:
        warnings.warn(f"{e}; its run is analysed without its trace", stacklevel=2)
        return None


NON_FINITE = "non-finite"


def hardware_label(hardware: str | None, gpu_name: str | None) -> str | None:
    """The hardware every table names a row by: its hardware config's name and, where it ran on
    a GPU, the card (``h200 on NVIDIA H100 80GB HBM3``: the h200 config's points on an H100), so
    that rows of two cards are never one group; the name alone for a row with no GPU."""
    return f"{hardware} on {gpu_name}" if hardware is not None and gpu_name else hardware


def _name_cards(runs: list[dict], iters: list[dict], configs: dict) -> None:
    """Set each row's ``hardware`` to its :func:`hardware_label` (its iterations' too). A row
    that names no GPU but ran with a CUDA device (a failure written before its worker asked
    the GPU, or by the sweep) takes the card of its sweep's rows where all that name one name
    the same; its ``gpu_name`` stays as the row has it."""
    named = {r["gpu_name"] for r in runs if r["gpu_name"]}
    only = next(iter(named)) if len(named) == 1 else None
    label = {}
    for r in runs:
        device = str((configs[(r["sweep"], r["job_dir"])].get("hardware") or {}).get("device") or "")
        label[r["job_dir"]] = hardware_label(r["hardware"], r["gpu_name"] or (only if device.startswith("cuda") else None))
        r["hardware"] = label[r["job_dir"]]
    for it in iters:
        it["hardware"] = label[it["job_dir"]]


def _finite_row(result: dict) -> bool:
    """True when the row's tokens/s, every iteration's tokens/s and loss (where it has one)
    and every step's loss in ``losses`` (the warm-up and paged steps' too; a null there is a
    loss that was not finite, JSON having no NaN) are finite numbers."""
    values = [result.get("tokens_per_s"), *(result.get("losses") or [])]
    for it in result.get("iterations") or []:
        values.append(it.get("tokens_per_s"))
        if it.get("loss") is not None:
            values.append(it.get("loss"))
    return all(math.isfinite(_num(v)) for v in values)


def _rows(result: dict, root: Path, job_rel: Path) -> tuple[dict, list[dict]]:
    point = result.get("point") or {}
    hw = ((result.get("config") or {}).get("hardware")) or {}
    workload = ((result.get("config") or {}).get("workload")) or {}
    stages = workload.get("pipeline_stages") or 1
    ssd_dirs = hw.get("ssd_dirs")
    ident = {k: point.get(k) for k in POINT_KEYS}
    if ident["micro_batch_size"] == "auto":  # TeraIO chose it: the row is the choice's point
        ident["micro_batch_size"] = (result.get("micro_batch") or {}).get("chosen")
    status, error = result.get("status"), result.get("error")
    if status == "ok" and not _finite_row(result):
        status, error = NON_FINITE, "an ok row with a loss or tokens/s that is not finite"
    ident.update(
        sweep=root.name, job_dir=str(job_rel),
        config=config_label(point.get("batch_size"), point.get("seq_len"), stages),
        host_mem_cap_bytes=hw.get("host_mem_cap_bytes"),
        n_ssd=len(ssd_dirs) if isinstance(ssd_dirs, list) else None, pipeline_stages=stages,
        status=status, error=error, failed=status != "ok", measure=result.get("measure"),
        ran_micro_batch_size=_ran_micro_batch(result))

    its = result.get("iterations") or []
    iter_rows = []
    for it in its:
        off, pre = it.get("bytes_offloaded") or {}, it.get("bytes_prefetched") or {}
        seconds, stall = _num(it.get("seconds")), _num(it.get("stall_seconds"))
        migration = _num(it.get("migration_seconds"))
        overlapped = max(0.0, migration - stall) if math.isfinite(migration + stall) else math.nan
        iter_rows.append({
            **ident, "step": it.get("step"), "seconds": seconds, "tokens": _num(it.get("tokens")),
            "tokens_per_s": _num(it.get("tokens_per_s")), "loss": _num(it.get("loss")),
            "stall_count": _num(it.get("stall_count")), "stall_seconds": stall,
            "migration_seconds": migration, "overlapped_seconds": overlapped,
            "compute_seconds": seconds - stall - overlapped,
            "bytes_offloaded_ssd": _num(off.get("ssd")), "bytes_offloaded_host": _num(off.get("host")),
            "bytes_prefetched_ssd": _num(pre.get("ssd")),
            "bytes_prefetched_host": _num(pre.get("host")),
            **{k: _num(it.get(k)) for k in RECOVERY_KEYS},
        })

    n_it = len(its)
    tiers = result.get("bytes_per_tier") or {}
    peak, cap = _num(result.get("peak_allocated_bytes")), _num(result.get("capacity_bytes"))
    unoff = _num(result.get("unoffloaded_peak_bytes"))
    m = _num(result.get("memory_pressure"))
    artifacts = result.get("artifacts") or {}
    run = {
        **ident,
        "tokens_per_s": _num(result.get("tokens_per_s")), "n_iterations": n_it,
        "warmup_steps": workload.get("warmup_steps"), "asked_steps": workload.get("measure_steps"),
        "iteration_seconds": (float(np.mean([_num(i.get("seconds")) for i in its]))
                              if its else math.nan),
        "stall_count": _num(result.get("stall_count")),
        "stall_seconds": _num(result.get("stall_seconds")),
        "stall_count_per_iter": _div(_num(result.get("stall_count")), n_it),
        "stall_seconds_per_iter": _div(_num(result.get("stall_seconds")), n_it),
        "bytes_ssd": _num(tiers.get("ssd")), "bytes_host": _num(tiers.get("host")),
        "peak_allocated_bytes": peak, "peak_reserved_bytes": _num(result.get("peak_reserved_bytes")),
        "peak_host_rss_bytes": _num(result.get("peak_host_rss_bytes")),  # absent in older rows
        "capacity_bytes": cap, "cap_not_enforced": result.get("capacity_enforced") is False,
        "unoffloaded_peak_bytes": unoff,
        "memory_pressure": m if math.isfinite(m) else _div(unoff, cap),
        "peak_fraction": _div(peak, cap),
        **{k: _num((result.get("tier_gbps") or {}).get(k)) for k in TIER_RATE_KEYS},
        "plan_compile_seconds": _num(result.get("plan_compile_seconds")),
        "profile_seconds": _num(result.get("profile_seconds")),
        # rows before the striped SSD tier name the same fact kvikio_mode
        "ssd_io_mode": result.get("ssd_io_mode", result.get("kvikio_mode")), "gpu_name": result.get("gpu_name"),
        "n_gpus": hw.get("n_gpus"), "wall_seconds": _num(result.get("wall_seconds")),
        "started_at": result.get("started_at"), "finished_at": result.get("finished_at"),
        "prices_json": json.dumps(hw.get("prices") or {}, sort_keys=True),
        "transfers_path": _artifact(root, job_rel, artifacts, "transfers"),
        "oplog_path": _artifact(root, job_rel, artifacts, "oplog"),
        "trace_path": _artifact(root, job_rel, artifacts, "trace"),
        "system_options_json": json.dumps(_system_options(result), sort_keys=True),
        "tuning_json": json.dumps(result["tuning"], sort_keys=True) if result.get("tuning") else None,
        "host_packing": _host_packing(result),
    }
    return run, iter_rows


def _host_packing(result: dict) -> str | None:
    """``region`` or ``slots`` from the row's ``plan.host_arena``; None without one."""
    arena = (result.get("plan") or {}).get("host_arena")
    return None if arena is None else ("region" if arena else "slots")


def _system_options(result: dict) -> dict:
    return (((result.get("config") or {}).get("system")) or {}).get("options") or {}


def _ran_micro_batch(result: dict):
    """The micro-batch a row trained with (see the module docstring's ``ran_micro_batch_size``)."""
    chosen = (result.get("tuning") or {}).get("chosen") or {}
    for v in (result.get("zero_micro_batch_size"), chosen.get("micro_batch_size"),
              (result.get("micro_batch") or {}).get("chosen"),
              _system_options(result).get("micro_batch_size"), (result.get("point") or {}).get("micro_batch_size")):
        if v is not None:
            return v
    return None


def _typed(rows: list[dict], columns: list[str]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=columns)
    for c in columns:
        if c in INT_KEYS:
            df[c] = pd.array([None if v is None or (isinstance(v, float) and math.isnan(v))
                              else int(v) for v in df[c]], dtype="Int64")
        elif c in TEXT_KEYS:
            df[c] = df[c].astype("str").where(df[c].notna())
        elif c in ("failed", "cap_not_enforced"):
            df[c] = df[c].astype(bool)
        elif c in ("step", "n_iterations", "warmup_steps", "asked_steps"):
            df[c] = pd.to_numeric(df[c]).astype("Int64")
        else:
            df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    return df


RUN_COLUMNS = list(ID_COLUMNS) + [
    "tokens_per_s", "n_iterations", "warmup_steps", "asked_steps", "iteration_seconds", "stall_count",
    "stall_seconds", "stall_count_per_iter", "stall_seconds_per_iter", "bytes_ssd", "bytes_host",
    "peak_allocated_bytes", "peak_reserved_bytes", "peak_host_rss_bytes", "capacity_bytes",
    "cap_not_enforced", "unoffloaded_peak_bytes", "memory_pressure", "peak_fraction", *TIER_RATE_KEYS, "plan_compile_seconds",
    "profile_seconds", "ssd_io_mode", "gpu_name", "n_gpus", "wall_seconds", "started_at",
    "finished_at", "prices_json", "transfers_path", "oplog_path", "trace_path", "system_options_json",
    "tuning_json", "host_packing"]
ITERATION_COLUMNS = list(ID_COLUMNS) + [
    "step", "seconds", "tokens", "tokens_per_s", "loss", "stall_count", "stall_seconds",
    "migration_seconds", "overlapped_seconds", "compute_seconds", "bytes_offloaded_ssd",
    "bytes_offloaded_host", "bytes_prefetched_ssd", "bytes_prefetched_host", *RECOVERY_KEYS]


def load_sweep(sweep_dir: str | Path, exclude: str | Path | None = None) -> Sweep:
    """Read every ``result.json`` under ``sweep_dir`` (recursively) into a :class:`Sweep`.

    Files that are unreadable, of another format than ``teraio.result/1`` (an unknown
    version, newer or older) or missing a required key (``teraio.harness.rows.read_row``) are
    skipped with one warning each, naming the file and the format or key, and listed in
    ``Sweep.skipped``: such a row is never counted. Files under ``exclude`` are ignored.

    Raises:
        FileNotFoundError: ``sweep_dir`` is not a directory.
        ValueError: no loadable ``result.json`` under it, a bad ``not_run.yaml``, or trials of
            one point made with different configs (``analysis.trials.check_one_config``).
    """
    root = Path(sweep_dir).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"sweep dir {root} is not a directory")
    excl = Path(exclude).resolve() if exclude else None
    runs, iters, skipped, configs = [], [], [], {}
    tuning = root / TUNING_DIR  # the tuning candidates' rows: in the tuning files, not runs
    for path in sorted(root.rglob(RESULT_NAME)):
        if (excl is not None and excl in path.parents) or tuning in path.parents:
            continue
        try:
            result = read_row(path)
            run, its = _rows(result, root, path.parent.relative_to(root))
        except (OSError, ValueError, AttributeError, TypeError) as e:
            skipped.append((str(path), str(e)))
            warnings.warn(f"skipping {path}: {e}", stacklevel=2)
            continue
        runs.append(run)
        iters.extend(its)
        configs[(run["sweep"], run["job_dir"])] = ran_with(result)
    if not runs:
        raise ValueError(f"no loadable {RESULT_NAME} under {root} "
                         f"({len(skipped)} skipped); is this a sweep dir?")
    _name_cards(runs, iters, configs)
    frame = _typed(runs, RUN_COLUMNS)
    check_one_config(frame, configs)
    return Sweep(name=root.name, root=root, runs=frame, iterations=_typed(iters, ITERATION_COLUMNS),
                 skipped=skipped, not_run=load_not_run(root), configs=configs)


def describe(sweep: Sweep) -> str:
    """One line naming the sweep, its runs and trials, and the hardware: every table
    caption and figure title carries it."""
    r = sweep.runs
    n_ok = int((~r["failed"]).sum())
    point = [k for k in POINT_KEYS if k != "trial"] + ["host_mem_cap_bytes", "n_ssd", "pipeline_stages"]
    trials = r.groupby(point, dropna=False)["trial"].size()
    tmin, tmax = int(trials.min()), int(trials.max())
    trial_text = f"{tmax}" if tmin == tmax else f"{tmin}–{tmax}"
    hw = ", ".join(sorted(r["hardware"].dropna().unique()))  # each with its card (hardware_label)
    if r["gpu_name"].notna().any():
        where = ""
    elif (r["measure"] == "modeled").all():
        where = " (modeled rows only: estimates, no run)"
    else:
        where = " (no GPU: a machinery check, not comparable with the paper)"
    return (f"sweep {sweep.name}: {len(r)} runs ({n_ok} ok, {len(r) - n_ok} failed), "
            f"{trial_text} trial(s) per point; hardware {hw or '?'}{where}")
