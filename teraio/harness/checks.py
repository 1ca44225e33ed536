"""What the workers would only find out mid-run, checked on the sweep's machine before any
point runs: capacities, devices, SSD directories, system options, host tier."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from teraio import systems
from teraio.config import RunConfig
from teraio.trainer.microbatch import warmup_refusal
from teraio.workload.models import ties_embeddings


def validate(run: RunConfig, *, check_device: bool = True, make_ssd_dirs: bool = False,
             runs_dir: str | Path | None = None) -> None:
    """Check what the workers would only find out mid-run, on this machine.

    * ``hardware.gpu_capacity_bytes``: positive; on a CUDA device, at most the GPU's
      memory (checked only when ``check_device`` and a GPU is visible; a ``cuda`` device
      with no GPU here is itself an error unless ``check_device`` is false);
    * ``hardware.ssd_dirs`` of systems that offload to SSDs: each exists (created first
      when it lies under ``runs_dir``, the sweep's own scratch, or with ``make_ssd_dirs``;
      elsewhere a missing one is a mistyped path or an unmounted drive), is a directory,
      and takes a new file, and the system's own check of its drives passes
      (``SystemSpec.check_drives``: ZeRO-Infinity's swap files fit) — checked only with
      ``check_device``, since otherwise the workers run elsewhere; the list must not be empty;
    * ``system.options``: every key and value, by the system's own check (``teraio.systems``);
    * a system that runs on CUDA only (``SystemSpec.cuda_only``) needs a CUDA device;
    * ``workload.micro_batch_size: auto`` only for TeraIO's systems (they choose it);
    * TeraIO's systems warm up for as many steps as they profile
      (``teraio.trainer.microbatch.warmup_steps_needed``: 2, or 4 with a micro-batch ``auto``);
    * a system with a host tier (TeraIO-Mixed) needs ``hardware.host_mem_cap_bytes`` > 0;
    * ``timeout_s`` > 0, ``workload.measure_steps`` >= 1, ``workload.warmup_steps`` >= 1,
      ``hardware.n_gpus`` >= 1;
    * ``workload.pipeline_stages`` > 1 (:func:`check_pipeline`): a system that pipelines, as
      many micro-batches and layers as stages at least, no tied embeddings, one GPU per stage.

    Raises:
        ValueError: naming the bad key, its value and what would be valid.
    """
    hw, w = run.hardware, run.workload
    if not run.timeout_s > 0:
        raise ValueError(f"timeout_s={run.timeout_s} must be > 0 (seconds)")
    if w.measure_steps < 1 or w.warmup_steps < 1:
        raise ValueError(f"workload.measure_steps={w.measure_steps} must be >= 1 and "
                         f"workload.warmup_steps={w.warmup_steps} >= 1 (every system warms up before "
                         "it is measured; a step that alone outlasts timeout_s is measured cold, "
                         "teraio.systems.loop)")
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
    if spec.cuda_only and device.type != "cuda":
        raise ValueError(f"hardware.device={hw.device!r}: {spec.name} runs on CUDA only; "
                         f"run it with a CUDA device (e.g. hardware=h200) or leave it out of this sweep")
    if w.micro_batch_size == "auto" and spec.role != "teraio":
        raise ValueError(f"workload.micro_batch_size=auto: {spec.name} trains the micro-batch it is given "
                         f"(a divisor of batch_size={w.batch_size}); only "
                         f"{[n for n in systems.names() if systems.get(n).role == 'teraio']} choose their own")
    if spec.role == "teraio" and (refusal := warmup_refusal(w.warmup_steps, w.micro_batch_size)):
        raise ValueError(f"{refusal} for {spec.name}")
    if w.pipeline_stages > 1:
        check_pipeline(run, spec, device)
    if spec.uses_drives:
        if check_device:
            check_ssd_dirs(hw.ssd_dirs, run.system.name, make=make_ssd_dirs, scratch=runs_dir)
            systems.check_drives(run)
        elif not hw.ssd_dirs:  # the drives are the worker's machine's (e.g. Slurm nodes)
            raise ValueError(f"hardware.ssd_dirs is empty; {run.system.name} offloads to SSDs: "
                             "give one directory per drive")
    if spec.host_tier and not hw.host_mem_cap_bytes > 0:
        raise ValueError(f"hardware.host_mem_cap_bytes={hw.host_mem_cap_bytes}: {spec.name} "
                         "offloads to host memory too and needs a cap > 0 (bytes)")


def check_pipeline(run: RunConfig, spec: systems.SystemSpec, device: torch.device) -> None:
    """A pipelined point (``workload.pipeline_stages`` = S > 1) can run: its system builds
    stages, the step has at least S micro-batches (1F1B keeps every stage busy only then)
    and the model at least S blocks and no tied embeddings, and on CUDA each stage has its
    own GPU (``hardware.n_gpus`` = S). Raises ValueError naming the bad value."""
    w, s = run.workload, run.workload.pipeline_stages
    if not spec.pipeline:
        valid = [n for n in systems.names() if systems.get(n).pipeline]
        raise ValueError(f"workload.pipeline_stages={s}: {spec.name} does not train in pipeline stages; "
                         f"systems that do: {valid}")
    if w.grad_accum_steps < s:
        raise ValueError(f"workload.pipeline_stages={s} needs at least {s} micro-batches per step; "
                         f"batch_size={w.batch_size} / micro_batch_size={w.micro_batch_size} gives "
                         f"{w.grad_accum_steps}")
    if run.model.n_layers < s:
        raise ValueError(f"workload.pipeline_stages={s}: model {run.model.name} has {run.model.n_layers} layers")
    if ties_embeddings(run.model):
        raise ValueError(f"workload.pipeline_stages={s}: model {run.model.name} ties its input and output "
                         "embeddings, which cannot sit on two stages")
    if device.type == "cuda" and run.hardware.n_gpus != s:
        raise ValueError(f"workload.pipeline_stages={s} runs one stage per GPU: set hardware.n_gpus={s} "
                         f"(it is {run.hardware.n_gpus})")


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
