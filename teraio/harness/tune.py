"""Tuning by measurement: before a point's trials, each baseline's candidate settings run a
few measured steps and the fastest is kept (paper §4.1: every baseline is given its best
setting per configuration).

A system opts in through the registry (``teraio.systems.SystemSpec.tuner``: a
``"module:function"`` that takes the point's ``RunConfig`` and returns its candidates, each
a dict of ``system.options`` keys, e.g. ``{"micro_batch_size": 2}``). With ``sweep.tune.enabled``
(:class:`TuneSettings`), :func:`tuned_run` runs every candidate in a worker process as the
sweep runs a point (``teraio.harness.launch``), with ``sweep.tune.warmup_steps`` untimed and
``sweep.tune.measure_steps`` timed steps, in ``<sweep dir>/tuning/<key>/c<i>/``; a candidate
that fails (oom, error, timeout, or refused by the system's options check) is a recorded
failure. The fastest candidate that ran (tokens/s) is chosen.

A system that makes choices from its own profile instead (TeraIO's ``"auto"`` options) is
decided once per point by its first trial (:func:`decided`), its record beside the tuning
records.

The record is ``<sweep dir>/tuning/<key>.json`` (:func:`tuning_file`), one per model x
workload x hardware x system (the point less its trial), made once and read by every
trial and every later sweep of the point::

    {"key": {model, workload, hardware, system, seed, tune},   # what it was tuned for
     "chosen": {<option>: value, ...} | null,                  # null: no candidate ran
     "candidates": [{"setting", "status", "tokens_per_s", "message"}, ...]}

A record made for another ``key`` (a changed config) is kept as ``<key>.<n>.json`` and the
point is tuned again. The trial then runs with ``system.options`` updated by ``chosen``, and
its row carries ``tuning`` (:func:`row_tuning`): ``{file, chosen, candidates}``, ``file``
relative to the sweep dir. The worker reads it from ``<job dir>/tuning.json``
(:data:`JOB_FILE`), written by the sweep beside ``resolved.yaml``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import yaml

from teraio import systems
from teraio.config import RunConfig, dataclass_from_dict, run_config_from_dict

TUNING_DIR = "tuning"
JOB_FILE = "tuning.json"
STATUSES = ("ok", "oom", "error", "timeout")


@dataclasses.dataclass(frozen=True)
class TuneSettings:
    """``sweep.tune`` (``conf/config.yaml``).

    Attributes:
        enabled: tune the systems that opt in (``SystemSpec.tuner``) before their trials.
        warmup_steps: untimed steps of each candidate (at least 1).
        measure_steps: timed steps of each candidate; its tokens/s is their mean.
        max_candidates: try only the first this many of a system's candidates (null: all).
        timeout_s: a candidate's time limit (s); null: the point's ``timeout_s``.
    """

    enabled: bool = False
    warmup_steps: int = 1
    measure_steps: int = 2
    max_candidates: int | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name, low in (("warmup_steps", 1), ("measure_steps", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"sweep.tune.{name}={v!r}; must be an int >= {low}")
        m = self.max_candidates
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"sweep.tune.max_candidates={m!r}; must be an int >= 1 or null (all)")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ValueError(f"sweep.tune.timeout_s={t!r}; must be a positive number of seconds or null")


def tune_settings(tune: dict | None) -> TuneSettings:
    """:class:`TuneSettings` from the ``sweep.tune`` mapping. Raises ValueError naming an
    unknown key or a bad value."""
    return dataclass_from_dict(TuneSettings, tune, "sweep.tune")


def tuning_key(run: RunConfig, settings: TuneSettings) -> dict:
    """What a tuning record is made for: the point's config but its trial and time limit,
    and how it was tuned."""
    d = run.to_dict()
    return {"model": d["model"], "workload": d["workload"], "hardware": d["hardware"], "system": d["system"],
            "seed": d["seed"], "tune": {"warmup_steps": settings.warmup_steps,
                                        "measure_steps": settings.measure_steps,
                                        "max_candidates": settings.max_candidates}}


def tuning_file(sweep_dir: Path, run: RunConfig) -> Path:
    """``<sweep dir>/tuning/<model>-<system>-<hardware>-bs<B>-mb<b>-seq<S>[-ppN].json``: the
    point's job-dir name less its trial."""
    w = run.workload
    name = (f"{run.model.name}-{run.system.name}-{run.hardware.name}-bs{w.batch_size}-mb{w.micro_batch_size}"
            f"-seq{w.seq_len}" + (f"-pp{w.pipeline_stages}" if w.pipeline_stages > 1 else ""))
    return Path(sweep_dir) / TUNING_DIR / f"{name}.json"


def candidates_of(run: RunConfig) -> list[dict] | None:
    """The system's candidate settings for ``run`` (``SystemSpec.tuner``), or None where the
    system does not opt in.

    Raises:
        ValueError: the generator failed or returned something that is not a list of dicts.
    """
    ref = systems.get(run.system.name).tuner
    if ref is None:
        return None
    module, _, attr = ref.partition(":")
    try:
        import importlib
        found = getattr(importlib.import_module(module), attr)(run)
    except Exception as e:
        raise ValueError(f"tuning candidates of {run.system.name} ({ref}): {type(e).__name__}: {e}") from e
    if not isinstance(found, list) or not found or not all(isinstance(c, dict) for c in found):
        raise ValueError(f"tuning candidates of {run.system.name} ({ref}): {found!r}; must be a non-empty list "
                         "of dicts of system.options keys")
    return found


def with_setting(run: RunConfig, setting: dict, **workload) -> RunConfig:
    """``run`` with ``system.options`` updated by ``setting`` (and ``workload`` keys replaced)."""
    d = run.to_dict()
    d["system"]["options"] = {**d["system"]["options"], **setting}
    d["workload"].update(workload)
    return run_config_from_dict(d)


Launch = Callable[[RunConfig, Path, Path], tuple]  # teraio.harness.launch.launch_worker


def _measure(run: RunConfig, setting: dict, cdir: Path, settings: TuneSettings, launch: Launch) -> dict:
    """Run one candidate in a worker in ``cdir`` (made afresh); its record."""
    entry = {"setting": setting, "status": "error", "tokens_per_s": None, "message": None}
    try:
        crun = with_setting(run, setting, warmup_steps=settings.warmup_steps, measure_steps=settings.measure_steps)
        crun = dataclasses.replace(crun, timeout_s=settings.timeout_s or run.timeout_s)
        systems.check_options(crun.system.name, crun.system.options)
    except ValueError as e:
        entry["message"] = f"refused: {e}"
        return entry
    if cdir.exists():  # an earlier, interrupted tuning's
        shutil.rmtree(cdir)
    cdir.mkdir(parents=True)
    resolved = cdir / "resolved.yaml"
    resolved.write_text(yaml.safe_dump(crun.to_dict(), sort_keys=False))
    rc, tail = launch(crun, cdir, resolved)
    try:
        row = json.loads((cdir / "result.json").read_text())
    except (OSError, ValueError):
        row = None
    if rc is None and (row is None or row.get("status") != "ok"):
        entry.update(status="timeout", message=f"killed after timeout_s={crun.timeout_s} s")
    elif row is None:
        entry["message"] = f"worker ended (exit code {rc}) without a row; last output: " + " | ".join(tail[-3:])
    else:
        entry["status"] = row["status"]
        if row["status"] == "ok":
            entry["tokens_per_s"] = row["tokens_per_s"]
        else:
            lines = [ln for ln in (row.get("error") or "").strip().splitlines() if ln.strip()]
            entry["message"] = lines[-1][:500] if lines else None
    return entry


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside ``path`` (two sweeps of one point tune it once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def tuned_run(run: RunConfig, sweep_dir: Path, settings: TuneSettings, launch: Launch | None = None,
              say: Callable[[str], None] = print) -> tuple[RunConfig, dict | None]:
    """``run`` with its tuned setting, and the row's ``tuning`` (:func:`row_tuning`); ``run``
    and None where tuning is off or the system does not opt in. Tunes the point where no
    record for its key exists (module docstring); else reads the record. Where no candidate
    ran, ``chosen`` is null and ``run`` is returned unchanged.

    Raises:
        ValueError: the system's candidate generator failed (:func:`candidates_of`).
    """
    if not settings.enabled:
        return run, None
    found = candidates_of(run)
    if found is None:
        return run, None
    path = tuning_file(sweep_dir, run)
    key = tuning_key(run, settings)
    with _locked(path):
        record = _kept_record(path, key, say)
        if record is None:
            if launch is None:
                from teraio.harness.launch import launch_worker as launch
            tried = found[:settings.max_candidates]
            say(f"  tuning {run.system.name}: {len(tried)} candidate(s), {settings.warmup_steps} warm-up + "
                f"{settings.measure_steps} measured step(s) each")
            entries = []
            for i, setting in enumerate(tried):
                entry = _measure(run, setting, path.with_suffix("") / f"c{i}", settings, launch)
                entries.append(entry)
                say(f"  tuning {setting}: {entry['status']}"
                    + (f" {entry['tokens_per_s']:.1f} tokens/s" if entry["tokens_per_s"] is not None
                       else f" ({entry['message']})"))
            ok = [e for e in entries if e["status"] == "ok" and e["tokens_per_s"] is not None]
            chosen = max(ok, key=lambda e: e["tokens_per_s"])["setting"] if ok else None
            record = {"key": key, "chosen": chosen, "candidates": entries}
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, path)
            say(f"  tuned {run.system.name}: {chosen if chosen is not None else 'no candidate ran'} "
                f"({path})")
        else:
            say(f"  tuned {run.system.name}: {record['chosen']} (from {path})")
    tuning = {"file": str(path.relative_to(sweep_dir)), "chosen": record["chosen"],
              "candidates": record["candidates"]}
    return (with_setting(run, record["chosen"]) if record["chosen"] else run), tuning


def decision_key(run: RunConfig) -> dict:
    """What a decision record is made for: the point's config but its trial and time limit."""
    d = run.to_dict()
    return {k: d[k] for k in ("model", "workload", "hardware", "system", "seed")}


def _kept_record(path: Path, key: dict, say: Callable[[str], None]) -> dict | None:
    """The record in ``path`` where it was made for ``key``; one made for another key (or
    unreadable) is kept as ``<name>.<n>.json`` and None returned, as is None where there is none."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        record = {}
    if record.get("key") == key:
        return record
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}.json")).exists():
        n += 1
    path.rename(kept)
    say(f"  record {path.name} was made for another config: kept as {kept.name}")
    return None


@contextlib.contextmanager
def decided(run: RunConfig, sweep_dir: Path, job_dir: Path,
            say: Callable[[str], None] = print) -> Iterator[tuple[RunConfig, dict | None]]:
    """One choice per point for a system that makes choices from its own profile (the
    registry's ``SystemSpec.decider``; TeraIO's ``recompute``, ``host_arena``, ``host_update``
    and ``workload.micro_batch_size`` when ``"auto"``, and ``host_update_groups`` with
    ``host_update=on``): the choices a trial makes from its noisy
    profile may differ from its neighbour's, so the point's first trial makes them and every
    other trial of the point, and every later sweep of it, runs with that trial's choices.

    Yields ``(run, tuning)`` for the trial in ``job_dir``, run within the block:

    * where the point's record (``<sweep dir>/tuning/<point>.json``, :func:`tuning_file`,
      ``{"key", "chosen", "workload", "decided_by"}``) exists, ``run`` with its settings and the
      row's ``tuning``, ``{file, chosen, workload, decided_by}`` (the deciding trial's job dir);
    * else ``run`` unchanged (its choices made by itself) and ``{file, decides: [choices]}``;
      the point's lock is held through the block, so that a trial of another sweep waits for
      the record, and where the block ends with an ok row in ``job_dir`` the record is written
      from it (the decider's ``decision(row)``). A failed trial, or an ok row its decider
      cannot read a choice from (``decision`` raises ValueError), leaves none: the next decides.

    ``(run, None)`` for a system with nothing to decide. A record made for another config is
    kept as ``<point>.<n>.json`` and the point decided again.
    """
    ref = systems.get(run.system.name).decider
    if ref is None:
        yield run, None
        return
    import importlib
    decider = importlib.import_module(ref)
    choices = decider.undecided(run)
    if not choices:
        yield run, None
        return
    path, key = tuning_file(sweep_dir, run), decision_key(run)
    name = str(path.relative_to(sweep_dir))
    with _locked(path):
        record = _kept_record(path, key, say)
        if record is None:
            say(f"  {run.system.name}: this trial decides the point's {', '.join(choices)} ({name})")
            yield run, {"file": name, "decides": choices}
            row_path = Path(job_dir) / "result.json"
            row = json.loads(row_path.read_text()) if row_path.exists() else {}
            if row.get("status") == "ok":
                try:
                    options, workload = decider.decision(row)
                except ValueError as e:  # an ok row that records no choice (no plan): the next decides
                    say(f"  {run.system.name}: left undecided ({e})")
                    return
                options = {k: v for k, v in options.items() if k in choices}  # what was left to it
                workload = {k: v for k, v in workload.items() if f"workload.{k}" in choices}
                record = {"key": key, "chosen": options, "workload": workload, "decided_by": Path(job_dir).name}
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(json.dumps(record, indent=1))
                os.replace(tmp, path)
                say(f"  decided {run.system.name}: {options} {workload or ''} ({name})")
            return
    say(f"  decided {run.system.name}: {record['chosen']} {record['workload'] or ''} "
        f"(from {name}, by {record['decided_by']})")
    yield (with_setting(run, record["chosen"], **record["workload"]),
           {"file": name, **{k: record[k] for k in ("chosen", "workload", "decided_by")}})


def write_job_tuning(job_dir: Path, tuning: dict | None) -> None:
    """Write the row's ``tuning`` beside ``resolved.yaml`` (removing a stale one where None)."""
    path = Path(job_dir) / JOB_FILE
    if tuning is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(json.dumps(tuning, indent=1))


def row_tuning(job_dir: Path) -> dict:
    """``{"tuning": ...}`` for the row of the run in ``job_dir``, from :data:`JOB_FILE`;
    empty where the run was not tuned."""
    path = Path(job_dir) / JOB_FILE
    return {"tuning": json.loads(path.read_text())} if path.exists() else {}
