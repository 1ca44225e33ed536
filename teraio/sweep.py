"""The sweep: Hydra 1.3 multirun as a thin orchestrator over worker processes.

    python -m teraio.sweep +experiment=smoke            # all points of conf/experiment/smoke.yaml
    python -m teraio.sweep +experiment=fig7 system=ideal trial=0   # a slice of a sweep

Before the first run, every point of the sweep is composed and checked
(:class:`SweepCallback`); bad input stops the sweep naming the key and what is valid.
Then, per point (:func:`run_point_job`), in ``<runs_dir>/<name>/<point>/`` — a directory
named after the point keys, so a rerun finds it:

* ``result.json`` already ``ok``: skipped (resume), never overwritten;
* an earlier failed ``result.json`` (oom, error, timeout) is kept as ``result.<n>.json``
  and the point runs again;
* ``resolved.yaml`` is written and ``python -m teraio.run resolved.yaml`` runs as a
  subprocess (``torchrun`` for ``hardware.n_gpus`` > 1), its output streamed to the
  terminal and appended to ``worker.log``; past ``timeout_s`` its process group is killed
  and a ``timeout`` row written; a worker that dies without a row gets an ``error`` row;
* a worker of a system that moves data through a drive (``SystemSpec.uses_drives``) starts only when
  no other run on this host uses that drive (``sweep.exclusive_drives``,
  :mod:`teraio.drive_lock`); its ``timeout_s`` counts from its start.

A failed point is a row, and the sweep goes on. After the last point,
``python -m analysis <sweep dir>`` makes the tables and figures.

Test hook: the environment variable ``TERAIO_WORKER_CMD`` (a shell-quoted command)
replaces ``python -m teraio.run``; the tests use it to run small scripted workers. It is
not meant for real runs.
"""
from __future__ import annotations

import collections
import importlib.util
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import hydra
import torch
import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from teraio import systems
from teraio.config import ModelConfig, RunConfig, WorkloadConfig, run_config_from_dict
from teraio.drive_lock import hold_drives, hold_point
from teraio.result import empty_result, read_status, write_result
from teraio.run import iso_time

RUN_KEYS = ("model", "workload", "system", "hardware", "trial", "seed", "timeout_s")
KILL_GRACE_S = 10.0
LOG_TAIL_LINES = 40

console = Console(highlight=False, emoji=False, soft_wrap=True)


# ---------------------------------------------------------------- config → RunConfig

def estimate_unoffloaded_peak_bytes(model: ModelConfig, workload: WorkloadConfig) -> int:
    """Estimated peak device memory (bytes) of one training step with nothing offloaded:
    FP32 weights, gradients and AdamW's two states (16 bytes per parameter, counted on
    the meta-device model) plus one micro-batch's saved activations, about
    (12·dim + 4·ffn_hidden) floats per token per layer, and three logits-sized buffers
    (logits, log-softmax, their gradient). Attention is taken to save no seq² matrix
    (SDPA's flash/efficient kernels on CUDA). An estimate: the measured peak of a run is
    in its row (Ideal's ``peak_allocated_bytes``, TeraIO's ``unoffloaded_peak_bytes``).
    """
    from teraio.models import (STATE_BYTES_PER_PARAMETER, activation_bytes, build_meta_model,
                               count_parameters, ffn_hidden, logits_bytes)

    net = build_meta_model(model, workload.seq_len)
    tokens = workload.micro_batch_size * workload.seq_len
    return (STATE_BYTES_PER_PARAMETER * count_parameters(net)
            + activation_bytes(model, ffn_hidden(net), tokens, model.n_layers) + logits_bytes(model, tokens))


def capacity_for_pressure(model: DictConfig, workload: DictConfig, m_percent: float) -> int:
    """The GPU capacity (bytes) under which ``model`` at ``workload`` has memory pressure
    M = ``m_percent`` % (paper Fig. 7: M = peak memory / capacity), from
    :func:`estimate_unoffloaded_peak_bytes`."""
    run = run_config_from_dict({"model": OmegaConf.to_container(model, resolve=True),
                                "workload": OmegaConf.to_container(workload, resolve=True),
                                "system": {"name": "ideal"}})
    return int(estimate_unoffloaded_peak_bytes(run.model, run.workload) / (float(m_percent) / 100))


def register_resolvers() -> None:
    """OmegaConf resolvers the experiment configs use:

    ``${gb:X}``        X GB (1e9 bytes) as an int of bytes
    ``${take:L,N}``    the first N items of list L (e.g. N of the SSD directories)
    ``${capacity_for_pressure:MODEL,WORKLOAD,M}``  see :func:`capacity_for_pressure`
    """
    def take(items, n: int):
        items = list(items)
        if not 0 < n <= len(items):
            raise ValueError(f"${{take:...,{n}}}: only {len(items)} item(s): {items}")
        return items[:n]

    OmegaConf.register_new_resolver("gb", lambda x: int(round(float(x) * 1e9)), replace=True)
    OmegaConf.register_new_resolver("take", take, replace=True)
    OmegaConf.register_new_resolver("capacity_for_pressure", capacity_for_pressure, replace=True)


def run_config(cfg: DictConfig) -> RunConfig:
    """The worker's :class:`RunConfig` from a composed point config.

    ``sweep.system_options[<system name>]`` is merged over ``system.options`` (an
    experiment that sweeps several systems sets per-system options there), and
    ``hardware.ssd_dirs`` are made absolute against the directory the sweep was launched
    from (:func:`launch_dir`), whether or not Hydra changes into the job dir.

    Raises:
        ValueError: an unknown key or a bad value, naming it (``teraio.config``).
    """
    d = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
         for k in RUN_KEYS if k in cfg}
    extra = OmegaConf.select(cfg, f"sweep.system_options.{d['system']['name']}", default=None)
    if extra is not None:
        d["system"]["options"] = {**(d["system"].get("options") or {}),
                                  **OmegaConf.to_container(extra, resolve=True)}
    hw = d.get("hardware") or {}
    if "ssd_dirs" in hw:
        hw["ssd_dirs"] = [str(launch_dir() / Path(p).expanduser()) for p in hw["ssd_dirs"]]
    return run_config_from_dict(d)


def launch_dir() -> Path:
    """The directory ``python -m teraio.sweep`` was started in (Hydra's original working
    directory; ``hydra.job.chdir=true`` moves each job into its job dir)."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.cwd)
    return Path.cwd()


def validate(run: RunConfig, *, check_device: bool = True, make_ssd_dirs: bool = False,
             runs_dir: str | Path | None = None) -> None:
    """Check what the workers would only find out mid-run, on this machine.

    * ``hardware.gpu_capacity_bytes``: positive; on a CUDA device, at most the GPU's
      memory (checked only when ``check_device`` and a GPU is visible; a ``cuda`` device
      with no GPU here is itself an error unless ``check_device`` is false);
    * ``hardware.ssd_dirs`` of systems that offload to SSDs: each exists (created first
      when it lies under ``runs_dir``, the sweep's own scratch, or with ``make_ssd_dirs``;
      elsewhere a missing one is a mistyped path or an unmounted drive), is a directory,
      and takes a new file — checked only with
      ``check_device``, since otherwise the workers run elsewhere; the list must not be empty;
    * ``system.options``: every key and value, by the system's own check (``teraio.systems``);
    * a system with a host tier (TeraIO-Mixed) needs ``hardware.host_mem_cap_bytes`` > 0;
    * ``timeout_s`` > 0, ``workload.measure_steps`` >= 1, ``hardware.n_gpus`` >= 1.

    Raises:
        ValueError: naming the bad key, its value and what would be valid.
    """
    hw, w = run.hardware, run.workload
    if not run.timeout_s > 0:
        raise ValueError(f"timeout_s={run.timeout_s} must be > 0 (seconds)")
    if w.measure_steps < 1 or w.warmup_steps < 0:
        raise ValueError(f"workload.measure_steps={w.measure_steps} must be >= 1 and "
                         f"workload.warmup_steps={w.warmup_steps} >= 0")
    if hw.n_gpus < 1:
        raise ValueError(f"hardware.n_gpus={hw.n_gpus} must be >= 1")
    try:
        device = torch.device(hw.device)
    except RuntimeError as e:
        raise ValueError(f"hardware.device={hw.device!r} is not a device: {e}; valid: cpu, cuda, cuda:N") from e
    cap = hw.gpu_capacity_bytes
    if cap is not None and not cap > 0:
        raise ValueError(f"hardware.gpu_capacity_bytes={cap} must be > 0 (bytes), or null for no cap")
    if device.type != "cuda" and hw.n_gpus > 1:
        raise ValueError(f"hardware.n_gpus={hw.n_gpus} needs hardware.device=cuda, not {hw.device!r}")
    if check_device and device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"hardware.device={hw.device!r} but this machine has no CUDA GPU; "
                             "use hardware=cpu_ci here, or sweep.check_device=false when the "
                             "workers run on other machines")
        if hw.n_gpus > torch.cuda.device_count():
            raise ValueError(f"hardware.n_gpus={hw.n_gpus} but {torch.cuda.device_count()} GPU(s) here")
        total = torch.cuda.get_device_properties(device.index or 0).total_memory
        if cap is not None and cap > total:
            raise ValueError(f"hardware.gpu_capacity_bytes={cap} is larger than the GPU "
                             f"({torch.cuda.get_device_name(device.index or 0)}: {total} bytes); "
                             f"valid: 1..{total}")
    spec = systems.get(run.system.name)
    systems.check_options(spec.name, run.system.options)
    if spec.uses_drives:
        if check_device:
            check_ssd_dirs(hw.ssd_dirs, run.system.name, make=make_ssd_dirs, scratch=runs_dir)
        elif not hw.ssd_dirs:  # the drives are the worker's machine's (e.g. Slurm nodes)
            raise ValueError(f"hardware.ssd_dirs is empty; {run.system.name} offloads to SSDs: "
                             "give one directory per drive")
    if spec.host_tier and not hw.host_mem_cap_bytes > 0:
        raise ValueError(f"hardware.host_mem_cap_bytes={hw.host_mem_cap_bytes}: {spec.name} "
                         "offloads to host memory too and needs a cap > 0 (bytes)")


def check_ssd_dirs(dirs: list[str], system: str, make: bool = False, scratch: str | Path | None = None) -> None:
    """Each SSD directory exists (made first when ``make``, or when it lies under
    ``scratch``), is a directory, and takes a new file. Raises ValueError naming
    ``hardware.ssd_dirs[i]``."""
    if not dirs:
        raise ValueError(f"hardware.ssd_dirs is empty; {system} offloads to SSDs: "
                         "give one directory per drive")
    for i, d in enumerate(dirs):
        key, p = f"hardware.ssd_dirs[{i}]={d}", Path(d)
        if make or (scratch is not None and Path(os.path.abspath(p)).is_relative_to(os.path.abspath(scratch))):
            try:
                p.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"{key} cannot be created: {e}") from e
        if not p.exists():
            raise ValueError(f"{key} does not exist ({system} writes tensors there); create it "
                             "or mount the drive, set hardware.ssd_dirs=[dir,...], or let the sweep "
                             "create it (sweep.make_ssd_dirs=true; directories under sweep.runs_dir "
                             "are created anyway)")
        if not p.is_dir():
            raise ValueError(f"{key} is not a directory")
        try:
            with tempfile.TemporaryFile(dir=p):
                pass
        except OSError as e:
            raise ValueError(f"{key} is not writable: {e}") from e


def job_overrides(config: DictConfig) -> list[list[str]]:
    """The override list of every job of this multirun, in launch order: the sweeper's
    ``hydra.sweeper.params`` then the command line, expanded as Hydra's BasicSweeper
    expands them (a later value for a key replaces an earlier one; discrete sweeps form
    a cartesian product)."""
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    args = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(args)
    axes: dict[str, list[str]] = {}
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override():
            if not o.is_discrete_sweep():
                raise ValueError(f"{key}: only discrete sweeps (a,b,c) are supported")
            axes[key] = [f"{key}={v}" for v in o.sweep_string_iterator()]
        else:
            axes[key] = [f"{key}={o.get_value_element_as_str()}"]
    return [list(job) for job in itertools.product(*axes.values())]


# ---------------------------------------------------------------- one point

def history_path(result_path: Path) -> Path:
    """The first free ``result.<n>.json`` (n = 1, 2, ...) beside ``result_path``."""
    n = 1
    while (p := result_path.with_name(f"{result_path.stem}.{n}{result_path.suffix}")).exists():
        n += 1
    return p


def config_diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in sorted(set(a) | set(b), key=str)
                for k in config_diff(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]


def worker_command(run: RunConfig, resolved: Path) -> list[str]:
    """``python -m teraio.run <resolved>``; under ``torchrun`` (one process per GPU,
    which also serves DeepSpeed: it reads the same environment) for ``hardware.n_gpus``
    > 1; or the test hook ``$TERAIO_WORKER_CMD``."""
    if os.environ.get("TERAIO_WORKER_CMD"):
        return shlex.split(os.environ["TERAIO_WORKER_CMD"]) + [str(resolved)]
    if run.hardware.n_gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={run.hardware.n_gpus}", "-m", "teraio.run", str(resolved)]
    return [sys.executable, "-m", "teraio.run", str(resolved)]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the sweep dies, so that no orphan worker
    writes into a rerun's job dir (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# Library chatter a worker prints (DeepSpeed's and torch's log lines, Python warnings and the
# source line under each): worker.log keeps it, the terminal shows the worker's own lines.
_LIBRARY_NOISE = re.compile(r"^\[\d{4}-\d\d-\d\d [^]]*\] \[(INFO|WARNING|DEBUG)\]|Warning: |^\s+warnings\.warn\(|"
                            r"^\s*$|^Using .* as PyTorch extensions root|^(Emitting|Building|Loading|Time to load) ")


def launch_worker(run: RunConfig, job_dir: Path, resolved: Path) -> tuple[int | None, list[str]]:
    """Run the worker, streaming its lines to ``worker.log`` and, but for library chatter
    (:data:`_LIBRARY_NOISE`), to the terminal.

    Returns:
        (exit code, or None when killed after ``timeout_s``; its last output lines).
    """
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = worker_command(run, resolved)
    with open(job_dir / "worker.log", "a") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
        log.flush()
        # Its own session: the whole process group (torchrun's ranks too) is killed on timeout.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                env=env, start_new_session=True, preexec_fn=_die_with_parent)

        def pump() -> None:
            hidden = 0
            for line in proc.stdout:
                log.write(line)
                log.flush()
                tail.append(line.rstrip("\n"))
                if _LIBRARY_NOISE.search(line):
                    hidden += 1
                    if hidden == 1:
                        console.print(f"  │ (library messages go to {job_dir / 'worker.log'})", markup=False)
                    continue
                console.print(f"  │ {line.rstrip()}", markup=False)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=run.timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            # A timeout, the sweep interrupted, or children left behind by a finished
            # worker (they would hold its output pipe open).
            _kill_group(proc)
        reader.join()
    return rc, list(tail)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group, SIGKILL after ``KILL_GRACE_S`` if the
    worker is still there."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def failure_row(run: RunConfig, status: str, error: str, started: float) -> dict:
    """A row for a point whose worker wrote none (killed, crashed, or never started)."""
    row = empty_result(run.point(), run.to_dict())
    row.update(status=status, error=error, wall_seconds=time.time() - started,
               started_at=iso_time(started), finished_at=iso_time())
    return row


def drive_dirs(run: RunConfig) -> list[str]:
    """The directories whose drives a run of ``run.system`` moves data through: none for a
    system that uses no drive (``SystemSpec.uses_drives``); else ``hardware.ssd_dirs`` and
    ZeRO-Infinity's ``system.options.nvme_path`` where set."""
    if not systems.get(run.system.name).uses_drives:
        return []
    extra = run.system.options.get("nvme_path")
    return [*run.hardware.ssd_dirs, *([extra] if extra else [])]


def run_point_job(cfg: DictConfig, job_dir: Path, label: str = "") -> str:
    """Validate, resume-check and run one point in ``job_dir``; returns its final status,
    ``"skip"`` for a point already ok, or ``"busy"`` when another sweep is running it now
    (``teraio.drive_lock.hold_point``, held for the point's whole run). Never raises for a
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
    if read_status(result_path) == "ok":
        old = json.loads(result_path.read_text()).get("config")
        changed = config_diff(old, run.to_dict())
        console.print("  skip (ok)" + (f" — made with a different {', '.join(changed)}; "
                                       "move its job dir away to run it again" if changed else ""))
        return "skip"
    if result_path.exists():
        result_path.rename(history_path(result_path))
    try:
        validate(run, check_device=cfg.sweep.check_device, make_ssd_dirs=cfg.sweep.make_ssd_dirs,
                 runs_dir=cfg.sweep.runs_dir)
        resolved = job_dir / "resolved.yaml"
        resolved.write_text(yaml.safe_dump(run.to_dict(), sort_keys=False))
        drives = drive_dirs(run) if cfg.sweep.exclusive_drives else []
        with hold_drives(drives, on_wait=lambda lock: console.print(
                f"  waiting for the drive of {', '.join(drives)}: another run holds {lock}")):
            started = time.time()  # a timeout row's time starts with its worker
            rc, tail = launch_worker(run, job_dir, resolved)
    except ValueError as e:  # a check that only the machine running the job can make
        write_result(result_path, failure_row(run, "error", f"invalid config: {e}", started))
        rc, tail = 0, []
    status = read_status(result_path)
    log_tail = "\n".join(tail)
    if rc is None and status != "ok":
        write_result(result_path, failure_row(
            run, "timeout", f"killed after timeout_s={run.timeout_s} s; last output:\n{log_tail}", started))
    elif status is None:
        why = f"exit code {rc}" + (" (killed by a signal: the host OOM killer?)" if rc and rc < 0 else "")
        write_result(result_path, failure_row(
            run, "error", f"worker ended ({why}) without writing result.json; last output:\n{log_tail}",
            started))
    row = json.loads(result_path.read_text())
    if row["status"] == "ok":
        console.print(f"[green]✓ ok[/green] {row['tokens_per_s']:.1f} tokens/s "
                      f"({time.time() - started:.1f} s)")
    else:
        last = [ln for ln in (row["error"] or "").strip().splitlines() if ln.strip()][-1:]
        console.print(f"[red]✗ {row['status']}[/red] {escape(last[0]) if last else ''}")
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
        and refuse two points that share a job dir.

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
            counts[read_status(job_dir / "result.json") or "new"] += 1
        self.job_dirs = list(seen)
        console.print(f"[bold]{len(seen)} points[/bold] in {config.hydra.sweep.dir}: "
                      + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                      + (" (ok ones are skipped)" if counts["ok"] else ""))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        ok = job_return.status == JobStatus.COMPLETED and isinstance(job_return.return_value, str)
        self.outcomes[job_return.return_value if ok else "error"] += 1

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # What this sweep's own jobs ended with; a launcher that runs jobs elsewhere
        # (Slurm) reports none here, and then the rows on disk stand in.
        statuses = self.outcomes or collections.Counter(read_status(d / "result.json") or "missing"
                                                        for d in self.job_dirs)
        console.print("[bold]sweep done:[/bold] " + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())))
        if config.sweep.analyze:
            analyze(Path(config.hydra.sweep.dir))


def analyze(sweep_dir: Path) -> None:
    """``python -m analysis <sweep_dir>`` (tables and figures, in ``<sweep_dir>/analysis``),
    then the throughput table on the terminal.

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
    rc = subprocess.call([sys.executable, "-m", "analysis", str(sweep_dir)])
    if rc:
        raise SystemExit(f"teraio.sweep: `python -m analysis {sweep_dir}` failed (exit {rc}); "
                         "the result rows are intact")
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
        from teraio.fig3 import run

        run(cfg, Path(hc.runtime.output_dir))
        return "ok"
    label = f"#{hc.job.num} " if hc.mode.name == "MULTIRUN" else ""
    return run_point_job(cfg, Path(hc.runtime.output_dir), label)


def main() -> None:
    register_resolvers()
    _hydra_main()


if __name__ == "__main__":
    # Run the task function from the importable module, not from __main__: launchers that
    # pickle it (hydra/launcher=submitit_slurm) then send a reference to teraio.sweep
    # instead of copying this module by value, rich console and locks included.
    from teraio.sweep import main as importable_main

    importable_main()
