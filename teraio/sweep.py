"""The sweep: Hydra 1.3 multirun as a thin orchestrator over worker processes.

    python -m teraio.sweep +experiment=smoke            # all points of conf/experiment/smoke.yaml
    python -m teraio.sweep +experiment=fig7 system=ideal trial=0   # a slice of a sweep

Before the first run, every point of the sweep is composed and checked
(:class:`SweepCallback`); bad input stops the sweep naming the key and what is valid.
Then, per point (:func:`run_point_job`), in ``<runs_dir>/<name>/<point>/`` (``sweep.runs_dir``,
``runs`` by default, relative to the directory the sweep starts in; its first line names the
folder) — a directory named after the point keys, so a rerun finds it:

* ``result.json`` already ``ok``: skipped (resume), never overwritten — if it was made
  with the same config (``teraio.harness.rows.changed_keys``: every key but where the
  drives are and ``timeout_s``); one made with another config stops the sweep before
  anything runs (a result is never shown under a config it was not made with), unless
  ``sweep.rerun_changed=true``: then it is kept as ``result.<n>.json`` and the point runs again;
* an earlier failed ``result.json`` (oom, error, timeout), or one the analysis would skip
  (``teraio.harness.rows.row_status``: not JSON, another format, a key missing; never
  counted ``ok``), is kept as ``result.<n>.json``, the side files of that attempt (trace,
  plan, logs of the run, ``resolved.yaml``) move to ``attempt.<n>/`` (:func:`keep_attempt`),
  and the point runs again;
* ``resolved.yaml`` is written and ``python -m teraio.harness.run resolved.yaml`` runs as a
  subprocess (``torchrun`` for ``hardware.n_gpus`` > 1), its output streamed to the
  terminal and appended to ``worker.log``; past ``timeout_s`` its process group is killed
  and a ``timeout`` row written; a worker that dies without a row gets an ``error`` row
  (``drive full: <dir>`` first where one of its drives is, :func:`full_drive`);
  SIGTERM or SIGINT to the sweep ends its worker, which writes an ``interrupted`` row (not
  counted; the next sweep runs the point again), and stops the sweep (:func:`main`); before
  and after every worker, what dead runs left on its drives is removed (:func:`remove_leftovers`);
* with ``sweep.tune.enabled``, a system that opts in (``SystemSpec.tuner``) runs with the
  fastest of its candidate settings, measured before its first trial and recorded in
  ``<runs_dir>/<name>/tuning/`` for every trial and later sweep (:mod:`teraio.harness.tune`);
  the row's ``tuning`` names it;
* a worker of a system that moves data through a drive (``SystemSpec.uses_drives``) starts only when
  no other run on this host uses that drive (``sweep.exclusive_drives``,
  :mod:`teraio.harness.drive_lock`); its ``timeout_s`` counts from its start.
* with ``sweep.deadline`` (a Unix time, s) a point is *deferred*, left as it is for a later
  sweep, when the ok rows of its other trials (same point and workload) say that it would
  not end before the deadline (:func:`expected_seconds`), or when the deadline has passed:
  a sweep cut short by a time limit (a batch job's, a lent machine's) then stops starting
  runs that the limit would kill before they write a row.

A failed point is a row, and the sweep goes on. After the last point,
``python -m analysis <sweep dir>`` makes the tables and figures.

Its parts: :mod:`teraio.harness.compose` (point config → ``RunConfig``, resolvers, the multirun's
points), :mod:`teraio.harness.checks` (what is checked before any run), :mod:`teraio.harness.launch` (one
worker process) and :mod:`teraio.harness.drive_lock`.

Test hook: the environment variable ``TERAIO_WORKER_CMD`` (a shell-quoted command)
replaces ``python -m teraio.harness.run``; the tests use it to run small scripted workers. It is
not meant for real runs.
"""
from __future__ import annotations

import collections
import fcntl
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich.markup import escape

from teraio import systems
from teraio.harness.checks import validate
from teraio.harness.compose import job_overrides, register_resolvers, run_config
from teraio.config import RunConfig
from teraio.harness.drive_lock import OWNER_LOCK, hold_drives, hold_point
from teraio.interrupt import Interrupted, raise_on_signals
from teraio.files import SCRATCH, remove_orphans
from teraio.harness.launch import console, launch_worker
from teraio.harness.tune import decided, tune_settings, tuned_run, write_job_tuning
from teraio.result import lock_path, read_status, result_row, write_result
from teraio.harness.rows import UNREADABLE, changed_keys, row_status
from teraio.harness.run import iso_time



# ---------------------------------------------------------------- one point

# A worker's own start and end, beyond the ``wall_seconds`` its row counts (interpreter and
# imports; the sweep counted about 15 s more than the rows' 170 s on the lent H200).
WORKER_START_S = 30.0


def deadline_of(cfg: DictConfig) -> float | None:
    """``sweep.deadline`` as a Unix time in seconds, or None where unset.

    Raises:
        ValueError: a value that is not a number (naming it and what is valid).
    """
    value = cfg.sweep.get("deadline")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sweep.deadline={value!r}; must be a Unix time in seconds "
                         "(e.g. sweep.deadline=$(date -d +9min +%s)) or null")
    return float(value)


def expected_seconds(job_dir: Path, run: RunConfig) -> float | None:
    """Seconds a run of ``run`` is expected to take: the longest ``wall_seconds`` of the ok
    rows beside ``job_dir`` (``<sweep dir>/*/result.json``) of the same point but the trial
    and the same workload, plus :data:`WORKER_START_S`; None where there is no such row."""
    point = {k: v for k, v in run.point().items() if k != "trial"}
    workload = run.to_dict()["workload"]
    walls = []
    for path in job_dir.parent.glob("*/result.json"):
        if path.parent == job_dir:
            continue
        try:
            row = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if row.get("status") != "ok" or row.get("wall_seconds") is None:
            continue
        if ({k: v for k, v in (row.get("point") or {}).items() if k != "trial"} == point
                and (row.get("config") or {}).get("workload") == workload):
            walls.append(float(row["wall_seconds"]))
    return max(walls) + WORKER_START_S if walls else None


def history_path(result_path: Path) -> Path:
    """The first free ``result.<n>.json`` (n = 1, 2, ...) beside ``result_path``."""
    n = 1
    while (p := result_path.with_name(f"{result_path.stem}.{n}{result_path.suffix}")).exists():
        n += 1
    return p


KEPT_IN_PLACE = ("result.json", lock_path(Path("result.json")).name, "worker.log", OWNER_LOCK)


def keep_attempt(job_dir: Path, kept_result: Path) -> None:
    """Move the side files of the attempt whose row was kept as ``kept_result``
    (``result.<n>.json``) into ``job_dir/attempt.<n>/`` (made only when there is one), so
    that a rerun writes its own beside an empty slate and never overwrites them. Stays in
    place: the rows (``result.json``, ``result.<m>.json``), ``worker.log`` (appended to by
    every attempt), the point's lock and the row's, and earlier ``attempt.<m>/`` directories."""
    dest = job_dir / f"attempt.{kept_result.name.split('.')[1]}"
    for entry in sorted(job_dir.iterdir()):
        name = entry.name
        if name in KEPT_IN_PLACE or (name.startswith("result.") and name.endswith(".json")) \
                or (name.startswith("attempt.") and entry.is_dir()):
            continue
        dest.mkdir(exist_ok=True)
        entry.rename(dest / name)


def changed_ok_row(job_dir: Path, run: RunConfig) -> list[str]:
    """The keys that :func:`changed_keys` finds between the ok row in ``job_dir`` and
    ``run``; empty where there is no ok row or it was made with the same config."""
    path = job_dir / "result.json"
    if row_status(path)[0] != "ok":
        return []
    done, now = json.loads(path.read_text()), run.to_dict()
    tuning = done.get("tuning") or {}
    if tuning.get("chosen"):  # the row ran with its tuned or decided setting (teraio.harness.tune)
        now["system"]["options"] = {**now["system"]["options"], **tuning["chosen"]}
        now["workload"].update(tuning.get("workload") or {})
    return changed_keys(done.get("config") or {}, now)


def changed_message(job_dir: Path, changed: list[str]) -> str:
    return (f"{job_dir}/result.json is an ok row made with a different {', '.join(changed)}; "
            "run with sweep.rerun_changed=true to run it again with this config (the old row is "
            "kept as result.<n>.json), or move its job dir away")


def failure_row(run: RunConfig, status: str, error: str, started: float, tuning: dict | None = None) -> dict:
    """A row for a point whose worker wrote none (killed, crashed, or never started): it
    measured nothing (``teraio.result.result_row``); ``tuning``: the setting it ran with
    (``teraio.harness.tune``)."""
    row = result_row(run.point(), run.to_dict(), status=status, error=error, wall_seconds=time.time() - started,
                     started_at=iso_time(started), finished_at=iso_time())
    return {**row, "tuning": tuning} if tuning is not None else row


def drive_dirs(run: RunConfig) -> list[str]:
    """The directories whose drives a run of ``run.system`` moves data through: none for a
    system that uses no drive (``SystemSpec.uses_drives``); else ``hardware.ssd_dirs`` and
    ZeRO-Infinity's ``system.options.nvme_path`` where set."""
    if not systems.get(run.system.name).uses_drives:
        return []
    extra = run.system.options.get("nvme_path")
    return [*run.hardware.ssd_dirs, *([extra] if extra else [])]


FULL_DRIVE_BYTES = 64 << 20
"""A drive with less free room than this is *full*: a write that found no room stopped
there (DeepSpeed's aio writes go in blocks of 1 MiB by default)."""


def full_drive(run: RunConfig) -> str | None:
    """The first of ``run``'s drive directories (:func:`drive_dirs`) whose drive has less than
    :data:`FULL_DRIVE_BYTES` free, or None. Asked where a worker died without a row, before
    its leftovers are removed: DeepSpeed's aio op aborts the process (SIGABRT) on a write
    that finds no room, leaving no row to say so."""
    for d in drive_dirs(run):
        try:
            if shutil.disk_usage(d).free < FULL_DRIVE_BYTES:
                return d
        except OSError:
            continue
    return None


def remove_leftovers(run: RunConfig) -> None:
    """Remove what dead runs left on the drives of ``run`` (:func:`drive_dirs`): TeraIO's
    slot files and ZeRO-Infinity's swap directories whose process is gone
    (``teraio.files.remove_orphans``), before a worker starts (so that its plan sees their
    room free) and after it ended, however it ended (a worker killed past its grace
    leaves them)."""
    for d in drive_dirs(run):
        for prefix, suffix in SCRATCH:
            remove_orphans(d, prefix, suffix)


def say(line: str) -> None:
    """Print one line of the harness's own (markup in it shown as text)."""
    console.print(escape(line))


def run_point_job(cfg: DictConfig, job_dir: Path, label: str = "") -> str:
    """Validate, resume-check and run one point in ``job_dir``; returns its final status,
    ``"skip"`` for a point already ok, ``"changed"`` for one whose ok row was made with
    another config (not run; ``sweep.rerun_changed``), ``"deferred"`` for one left for later
    (``sweep.deadline``), or ``"busy"`` when another sweep is running it now
    (``teraio.harness.drive_lock.hold_point``, held for the point's whole run). Never raises for a
    failed point: the failure is written as its row, so that the sweep goes on."""
    job_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]▶ {label}{job_dir.name}[/bold]")
    with hold_point(job_dir) as owner:
        if not owner:
            console.print("  skip: another sweep is running this point now")
            return "busy"
        return _run_owned_point(cfg, job_dir)


def _run_owned_point(cfg: DictConfig, job_dir: Path) -> str:
    result_path = job_dir / "result.json"
    started = time.time()
    try:
        run = run_config(cfg)
    except ValueError as e:  # the pre-pass catches this in a multirun
        console.print(f"[red]✗ invalid config:[/red] {escape(str(e))}")
        return "invalid"
    changed = changed_ok_row(job_dir, run)
    if changed and not cfg.sweep.rerun_changed:
        console.print(f"[red]✗ changed:[/red] {escape(changed_message(job_dir, changed))}")
        return "changed"
    status, unreadable = row_status(result_path)
    if status == "ok" and not changed:
        console.print("  skip (ok)")
        return "skip"
    try:
        deadline = deadline_of(cfg)
    except ValueError as e:  # the pre-pass catches this in a multirun
        console.print(f"[red]✗ invalid config:[/red] {escape(str(e))}")
        return "invalid"
    if deadline is not None:
        left, need = deadline - time.time(), expected_seconds(job_dir, run)
        if left <= 0 or (need is not None and need > left):
            console.print(f"  deferred: {max(left, 0):.0f} s left before sweep.deadline"
                          + (f"; its other trials' rows say it needs {need:.0f} s" if need is not None else ""))
            return "deferred"
    if result_path.exists():
        kept = history_path(result_path)
        result_path.rename(kept)
        keep_attempt(job_dir, kept)
        if status == UNREADABLE:
            console.print(f"  result.json is no row the analysis reads ({escape(unreadable)}): kept as "
                          f"{kept.name}, running the point again")
    try:
        validate(run, check_device=cfg.sweep.check_device, make_ssd_dirs=cfg.sweep.make_ssd_dirs,
                 runs_dir=cfg.sweep.runs_dir)
        settings = tune_settings(OmegaConf.to_container(cfg.sweep.get("tune") or {}, resolve=True))
        resolved = job_dir / "resolved.yaml"
        drives = drive_dirs(run) if cfg.sweep.exclusive_drives else []
        with hold_drives(drives, on_wait=lambda lock: console.print(
                f"  waiting for the drive of {', '.join(drives)}: another run holds {lock}")):
            # The point's choices made once, by its first trial; its candidates run before the
            # trial, on the drives the trial uses (teraio.harness.tune).
            with decided(run, job_dir.parent, job_dir, say=say) as (run, decision):
                run, tuning = tuned_run(run, job_dir.parent, settings, say=say)
                tuning = tuning or decision
                write_job_tuning(job_dir, tuning)
                resolved.write_text(yaml.safe_dump(run.to_dict(), sort_keys=False))
                started = time.time()  # a timeout row's time starts with its worker
                remove_leftovers(run)
                try:
                    rc, tail = launch_worker(run, job_dir, resolved)
                    full = full_drive(run)  # before the leftovers free its room
                finally:
                    remove_leftovers(run)
    except ValueError as e:  # a check that only the machine running the job can make
        write_result(result_path, failure_row(run, "error", f"invalid config: {e}", started))
        rc, tail, full = 0, [], None
        tuning = None
    except Interrupted as e:  # the worker, ended, wrote its interrupted row; else the sweep does
        if read_status(result_path) is None:
            write_result(result_path, failure_row(run, "interrupted", f"{e} (the sweep)", started))
        # a worker that wrote its row before the signal keeps it (ok, oom, ...): main() says which
        e.job_dir, e.job_status = job_dir, read_status(result_path)
        raise
    status = read_status(result_path)
    log_tail = "\n".join(tail)
    cause = None  # why the worker wrote no row, where the sweep writes it
    if rc is None and status != "ok":
        cause = f"killed after timeout_s={run.timeout_s} s"
        write_result(result_path, failure_row(
            run, "timeout", f"{cause}; last output:\n{log_tail}", started, tuning))
    elif status is None:
        why = f"killed by signal {-rc}, {signal.Signals(-rc).name}" if rc and rc < 0 else f"exit code {rc}"
        cause = (f"drive full: {full}; " if full else "") + f"worker ended ({why}) without writing result.json"
        write_result(result_path, failure_row(run, "error", f"{cause}; last output:\n{log_tail}", started, tuning))
    row = json.loads(result_path.read_text())
    if row["status"] == "ok":
        console.print(f"[green]✓ ok[/green] {row['tokens_per_s']:.1f} tokens/s "
                      f"({time.time() - started:.1f} s)")
    else:  # the cause, else the last line of the worker's error (its exception)
        last = [ln for ln in (row["error"] or "").strip().splitlines() if ln.strip()][-1:]
        console.print(f"[red]✗ {row['status']}[/red] {escape(cause or (last[0] if last else ''))}")
    return row["status"]


# ---------------------------------------------------------------- the multirun

class SweepCallback(Callback):
    """Hydra callback (``hydra.callbacks.teraio`` in ``conf/config.yaml``): checks every
    point before the first runs, and runs the analysis after the last.

    Hydra 1.3 turns an ``Exception`` raised by a callback into a warning and goes on, so
    a refusal here is a ``SystemExit`` (message on stderr, exit status 1).
    """

    def __init__(self) -> None:
        self.job_dirs: list[Path] = []
        self.outcomes: collections.Counter[str] = collections.Counter()  # of this sweep's own jobs

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Compose every point as the launcher will, build and validate its RunConfig,
        and refuse two points that share a job dir, and a point whose job dir holds an ok
        row made with another config (``teraio.harness.rows.changed_keys``) unless ``sweep.rerun_changed``.

        Raises:
            SystemExit: for the first bad point, with its overrides and the reason.
        """
        loader = GlobalHydra.instance().config_loader()
        seen: dict[Path, str] = {}
        counts: collections.Counter[str] = collections.Counter()
        for overrides in job_overrides(config):
            where = " ".join(overrides)
            try:
                point = loader.load_sweep_config(config, list(overrides))
                deadline_of(point)
                tune_settings(OmegaConf.to_container(point.sweep.get("tune") or {}, resolve=True))
                validate(run_config(point), check_device=point.sweep.check_device,
                         make_ssd_dirs=point.sweep.make_ssd_dirs, runs_dir=point.sweep.runs_dir)
            except Exception as e:
                raise SystemExit(f"teraio.sweep: invalid point [{where}]: {e}\nNothing was run.") from e
            job_dir = Path(point.hydra.sweep.dir) / str(point.hydra.sweep.subdir)
            if job_dir in seen:
                raise SystemExit(f"points [{seen[job_dir]}] and [{where}] share the job dir {job_dir}: "
                                 "the dir name is built from the point keys; make the "
                                 "swept keys change one of them (e.g. hardware.name). "
                                 "Nothing was run.")
            seen[job_dir] = where
            changed = changed_ok_row(job_dir, run_config(point))
            if changed and not point.sweep.rerun_changed:
                raise SystemExit(f"teraio.sweep: point [{where}]: {changed_message(job_dir, changed)}. "
                                 "Nothing was run.")
            counts["changed" if changed else row_status(job_dir / "result.json")[0] or "new"] += 1
        self.job_dirs = list(seen)
        console.print(f"[bold]{len(seen)} points[/bold] in {Path(config.hydra.sweep.dir).resolve()}: "
                      + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                      + (" (ok ones are skipped)" if counts["ok"] else ""))

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A single run (``+experiment=fig3``, the roofline): check that its traces exist
        before Hydra makes its run dir (``teraio.harness.fig3.check_models``).

        Raises:
            SystemExit: a missing trace or a bad value, named.
        """
        if "roofline" in config:
            from teraio.harness.fig3 import check_models

            try:
                check_models(config.roofline.models)
            except ValueError as e:
                raise SystemExit(f"teraio.sweep: {e}\nNothing was run.") from e

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        ok = job_return.status == JobStatus.COMPLETED and isinstance(job_return.return_value, str)
        self.outcomes[job_return.return_value if ok else "error"] += 1

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # What this sweep's own jobs ended with; a launcher that runs jobs elsewhere
        # (Slurm) reports none here, and then the rows on disk stand in.
        statuses = self.outcomes or collections.Counter(row_status(d / "result.json")[0] or "missing"
                                                        for d in self.job_dirs)
        console.print("[bold]sweep done:[/bold] " + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())))
        if statuses["changed"]:
            raise SystemExit(f"teraio.sweep: {statuses['changed']} point(s) not run: their ok rows were made "
                             "with another config (sweep.rerun_changed=true runs them again)")
        if config.sweep.analyze:
            analyze(Path(config.hydra.sweep.dir))


ANALYSIS_LOCK = ".analysis.lock"


def analyze(sweep_dir: Path) -> None:
    """``python -m analysis <sweep_dir>`` (tables and figures, in ``<sweep_dir>/analysis``;
    one at a time per sweep dir, under :data:`ANALYSIS_LOCK`), then its index and the
    throughput table on the terminal.

    Raises:
        SystemExit: the analysis failed (the rows stay as they are).
    """
    try:
        found = importlib.util.find_spec("analysis.__main__") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        console.print("[yellow]analysis package not available in this checkout: no tables "
                      f"or figures; run `python -m analysis {sweep_dir}` once it is[/yellow]")
        return
    # One analysis at a time in a sweep dir: sweeps into one runs dir end at their own times.
    with open(sweep_dir / ANALYSIS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        p = subprocess.run([sys.executable, "-m", "analysis", str(sweep_dir)], stdout=subprocess.PIPE, text=True)
    if p.returncode:
        sys.stdout.write(p.stdout)
        raise SystemExit(f"teraio.sweep: `python -m analysis {sweep_dir}` failed (exit {p.returncode}); "
                         "the result rows are intact")
    written = [ln for ln in p.stdout.splitlines() if ln.strip() and not ln.startswith("see ")]
    console.print(f"analysis: {len(written)} files in {sweep_dir / 'analysis'}"
                  + "".join(f"; {ln}" for ln in p.stdout.splitlines() if ln.startswith("see ")), markup=False)
    table = sweep_dir / "analysis" / "tables" / "throughput.md"
    if table.exists():
        console.print(f"\n{table.read_text()}", markup=False)


# An absolute path: Hydra resolves a relative one against the module's package when the
# task function is imported by name (below), and "pkg://teraio/../conf" does not exist.
@hydra.main(version_base="1.3", config_path=str(Path(__file__).resolve().parents[1] / "conf"),
            config_name="config")
def _hydra_main(cfg: DictConfig) -> str:
    hc = HydraConfig.get()
    if "roofline" in cfg:  # +experiment=fig3: modeled from saved traces, no worker, no GPU
        from teraio.harness.fig3 import run

        try:
            run(cfg, Path(hc.runtime.output_dir))
        except ValueError as e:
            raise SystemExit(f"teraio.sweep: {e}") from e
        return "ok"
    label = f"#{hc.job.num} " if hc.mode.name == "MULTIRUN" else ""
    status = run_point_job(cfg, Path(hc.runtime.output_dir), label)
    if status == "changed" and hc.mode.name != "MULTIRUN":
        raise SystemExit(1)
    return status


def main() -> None:
    """Run the sweep; SIGTERM or SIGINT (Ctrl-C) end the running worker (it closes its
    tiers and writes an ``interrupted`` row, which the next sweep runs again) and stop the
    sweep with one line and exit status 128 + the signal's number."""
    register_resolvers()
    raise_on_signals()
    try:
        _hydra_main()
    except Interrupted as e:
        where, status = getattr(e, "job_dir", None), getattr(e, "job_status", None)
        if where is None:
            said = ""
        elif status == "interrupted":
            said = f"; {escape(str(where))} has an interrupted row, run again by the next sweep"
        else:  # its worker wrote its row before the signal arrived
            said = f"; {escape(str(where))} kept its row ({status}), written before the signal"
        console.print(f"[red]✗ sweep {e}[/red]{said}")
        sys.exit(128 + e.signum)


if __name__ == "__main__":
    # Run the task function from the importable module, not from __main__: launchers that
    # pickle it (hydra/launcher=submitit_slurm) then send a reference to teraio.sweep
    # instead of copying this module by value, rich console and locks included.
    from teraio.sweep import main as importable_main

    importable_main()
