"""TeraIO as a training system (``teraio_ssd`` and ``teraio_mixed``): profile → plan →
migrate around the shared training step (paper §3, Fig. 4).

The GPU capacity binds from the run's first allocation: the emulated one
(``hardware.gpu_capacity_bytes``, a cap on the process's allocator) or, with none given on
a CUDA device, the device's own free memory at start. No step runs un-offloaded.

Iteration schedule (the step index selects the data, so every system sees the same
tokens at the same step):

* step 0: a step under the pager (``teraio.core.pager``), which creates the optimizer state and
  keeps everything within the capacity by evicting least recently used tensors to host
  memory on demand;
* step 1: the profiled step (``teraio.core.profiler``), under the same pager (paper §3.1: a model
  that does not fit is profiled by offloading what the running kernel does not need);
* then the plan is compiled, the engine takes over the pager's tensors (``prime``), and
  steps ``2 .. warmup_steps-1`` warm the engine up; steps ``warmup_steps ..`` are measured.

On a CPU device with no capacity given nothing is capped (no pager, nothing to plan for).

``system.options`` (all optional):
  ``benefit``            ``"pressure"`` (default) or ``"formula"`` (``teraio.core.planner``)
  ``min_tensor_bytes``   smallest tensor considered for offloading (plan) or eviction
                         (pager), bytes (default 1 MiB)
  ``headroom_fraction``  fraction of the capacity kept out of the plan and the pager for
                         allocator rounding, fragmentation and workspaces (default 0.0 on
                         CPU, 0.08 on CUDA)
  ``io_threads``         SSD tier I/O threads (default 4)
  ``allow_stalls``       when bandwidth cannot hide enough migrations, still bring the peak
                         under capacity with migrations the engine stalls for (paper §3.2:
                         the runtime stalls kernels until memory is freed); default true
  ``device_waits``       host-tier transfers on a CUDA device ordered on the compute stream
                         (CUDA events) instead of blocking the training thread
                         (``teraio.core.engine``); default true
  ``release_grads``      free each gradient right after its last use in the optimizer step
                         and plan for it (``Trace.with_released_grads``, ``teraio.core.engine``);
                         default true
  ``host_arena``         true: the host tier as one region, a byte offset per tensor
                         (``teraio.core.slots.HostArena``); false: slots shared by tensors
                         whose periods never overlap; ``"auto"`` (default): both planned,
                         the region kept where it simulates more than 2 % faster
                         (``teraio.perf.choose.REGION_MARGIN``)
  ``replan_on_drift``    when a step's shape differs from the profiled one's
                         (``workload.seq_len_schedule``), hand the engine's tensors back to a
                         pager, profile that step and plan again (counted in the row's
                         ``replans``); false: the step fails with ``PlanDriftError``;
                         default true
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import math
import time
from pathlib import Path

import torch

from teraio import systems
from teraio.core import probe
from teraio.config import RunConfig, dataclass_from_dict
from teraio.core.engine import RECOVERY_KEYS, MigrationEngine
from teraio.systems.loop import Step, Steps, StepStats, measure_steps
from teraio.systems.measure import (apply_memory_cap, lift_memory_cap, param_digest, peak_memory, reset_peak_memory,
                            synchronize, timed)
from teraio.workload.models import model_state_bytes
from teraio.core.bandwidth import TierBandwidth
from teraio.core.planner import BENEFITS
from teraio.perf.choose import is_host_arena, plan_fastest
from teraio.core.pager import Pager, PagedStep, PagerStats
from teraio.core.profiler import persistent_tensors, profile_step
from teraio.result import Measurements, iteration_totals, kept_on_failure, progress_line
from teraio.workload.pipeline import build_training, gather_stages
from teraio.workload.step import make_batch
from teraio.core.tiers.host import HostTier
from teraio.core.tiers.ssd import SSD_FREE_RESERVE, SSDTier, drive_room_bytes


CUDA_HEADROOM_FRACTION = 0.08
"""Default ``headroom_fraction`` on CUDA: the share of the capacity kept out of the plan and
the pager (on CPU: none)."""


@dataclasses.dataclass
class TeraIOOptions:
    benefit: str = "pressure"
    min_tensor_bytes: int = 1 << 20
    headroom_fraction: float | None = None
    io_threads: int = 4
    allow_stalls: bool = True
    device_waits: bool = True
    release_grads: bool = True
    replan_on_drift: bool = True
    host_arena: bool | str = "auto"

    def __post_init__(self) -> None:
        bad = []
        if self.benefit not in BENEFITS:
            bad.append(f"benefit={self.benefit!r}; valid: {BENEFITS}")
        if not (isinstance(self.min_tensor_bytes, int) and self.min_tensor_bytes >= 0):
            bad.append(f"min_tensor_bytes={self.min_tensor_bytes!r}; valid: an int >= 0 (bytes)")
        if self.headroom_fraction is not None and not 0 <= self.headroom_fraction < 1:
            bad.append(f"headroom_fraction={self.headroom_fraction!r}; valid: null or 0 <= x < 1")
        if not (isinstance(self.io_threads, int) and self.io_threads >= 1):
            bad.append(f"io_threads={self.io_threads!r}; valid: an int >= 1")
        for flag in ("allow_stalls", "device_waits", "release_grads", "replan_on_drift"):
            if not isinstance(getattr(self, flag), bool):
                bad.append(f"{flag}={getattr(self, flag)!r}; valid: true or false")
        if not is_host_arena(self.host_arena):
            bad.append(f"host_arena={self.host_arena!r}; valid: true, false or auto")
        if bad:
            raise ValueError("system.options." + "; system.options.".join(bad))


def check_options(system: str, options: dict) -> None:
    """``system.options`` of a TeraIO system (``teraio.systems``). Raises ValueError naming
    an unknown key or a bad value."""
    dataclass_from_dict(TeraIOOptions, options, f"system.options ({system})")


def tier_bandwidth(cfg: RunConfig, device: torch.device | None = None, io_threads: int = 4,
                   measured: Measurements | None = None) -> TierBandwidth:
    """Planner bandwidths (GB/s). Given ones from ``cfg.hardware`` (the SSD tier aggregates
    its drives, one directory per drive); null ones measured on ``device`` over the tiers
    (``teraio.core.probe``, cached per machine). ``measured`` gets ``tier_gbps``: the values and
    where each came from.

    Raises:
        ValueError: a bandwidth is null and no device is given to measure it on.
    """
    hw = cfg.hardware
    n = len(hw.ssd_dirs)
    given = {"ssd_write_gbps": None if hw.ssd_write_gbps is None else hw.ssd_write_gbps * n,
             "ssd_read_gbps": None if hw.ssd_read_gbps is None else hw.ssd_read_gbps * n,
             "host_d2h_gbps": hw.host_d2h_gbps, "host_h2d_gbps": hw.host_h2d_gbps}
    missing = [k for k, v in given.items() if v is None]
    gbps, source = dict(given), dict.fromkeys(given, "hardware config")
    if missing:
        if device is None:
            raise ValueError(f"hardware.{missing[0]} is null (measure it) but no device was given to measure on")
        m = probe.measured_bandwidths(device, list(hw.ssd_dirs), io_threads)
        for k in missing:
            gbps[k] = m["gbps"][k]
            source[k] = f"measured {m['measured_at']}" + (" (cached)" if m["cached"] else "")
    if measured is not None:
        measured.tier_gbps = {**gbps, "source": source}
    return TierBandwidth(**gbps)


def open_tiers(plan, cfg: RunConfig, device: torch.device, io_threads: int = 4) -> dict:
    """The tiers the plan uses, with a slot per migrated tensor or shared as the plan says
    (``MigrationPlan.shared_slots``), the host tier one region where the plan places it so
    (``MigrationPlan.host_offsets``). The SSD tier puts one uniquely named file in each
    drive's directory, so concurrent runs never collide, and refuses a missing, unwritable
    or too small directory, naming it and the bytes needed.
    """
    slots: dict[str, dict[str, int]] = {"ssd": {}, "host": {}}
    for m in plan.migrations:
        slots[m.tier][m.name] = m.nbytes
    tiers = {}
    if slots["ssd"]:
        tiers["ssd"] = SSDTier(list(cfg.hardware.ssd_dirs), slots["ssd"], threads=io_threads,
                               shares=plan.shared_slots("ssd"))
    if slots["host"]:
        offsets = plan.host_offsets()
        tiers["host"] = HostTier(cfg.hardware.host_mem_cap_bytes, slots["host"], device,
                                 shares=None if offsets else plan.shared_slots("host"), offsets=offsets)
    return tiers


@contextlib.contextmanager
def compute_stream(device: torch.device):
    """Run the step on a non-blocking CUDA stream: kvikio's compat-mode copies run on its
    own streams, and on the legacy default stream every one of them would serialize with
    the training kernels."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.stream(torch.cuda.Stream(device)):
        yield


def device_capacity(cfg: RunConfig, device: torch.device) -> tuple[int | None, bool]:
    """(capacity in bytes, emulated?): ``hardware.gpu_capacity_bytes`` when given (emulated);
    else on CUDA the device's free memory now, before the run allocates anything (the real
    GPU); else (CPU) None, uncapped."""
    if cfg.hardware.gpu_capacity_bytes is not None:
        return int(cfg.hardware.gpu_capacity_bytes), True
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), False
    return None, False


def check_model_fits(cfg: RunConfig, limit: int | None) -> None:
    """TeraIO builds the model on the device; refuse, before allocating anything, a model
    whose parameters and buffers alone exceed the bytes it may use there.

    Raises:
        ValueError: naming the model, its bytes and the limit.
    """
    if limit is None:
        return
    need = model_state_bytes(cfg.model, cfg.workload.seq_len)
    if need > limit:
        raise ValueError(
            f"model {cfg.model.name}: its parameters and buffers take {need} B, above the {limit} B "
            f"TeraIO may use on the device (capacity less headroom); the model is built on the device, "
            f"so its parameters alone must fit there")


def run(cfg: RunConfig, job_dir: Path, device: torch.device) -> Measurements:
    """Train ``cfg`` under TeraIO and return the measurements (``teraio.result``; on failure,
    those made so far travel with the exception, ``teraio.result.kept_on_failure``: the
    plan that fell short, the capacity, the paged and measured steps).

    Steps 2 .. are run by the shared loop (``teraio.systems.loop.measure_steps``); each one's timed
    region covers making its batch and the engine's step. Extras of the row: ``plan`` (the
    first plan's summary), ``final_params_sha256`` and, on CUDA, ``audits`` (each engine's first
    step's ``teraio.core.engine.StepStats.audit`` with its ``step``: that step is usually a
    warm-up one, which has no iteration row); each iteration adds ``urgent_count``,
    ``max_accounted_bytes``, ``oom_retries``, ``dropped_bytes``, ``deferred_prefetches`` and
    ``spilled_bytes``.

    With ``workload.pipeline_stages`` > 1 each process profiles, plans and migrates its own
    stage (``teraio.workload.pipeline``; paper §4.1: one plan per GPU) and writes its side
    files to ``stage<s>/`` of the job dir; the row is stage 0's (the pipeline's step time),
    with the extra ``stages`` (per stage: stalls, peaks, plan, parameter digest, side files)
    and ``final_params_sha256`` the SHA-256 of the stages' digests in stage order.

    Side files in ``job_dir``: ``trace.json``, ``plan.json``, ``oplog.csv`` (per op of each
    measured step: start time and stall, seconds), ``transfers.csv`` (one row per transfer).

    Raises:
        ValueError: bad options, a model whose parameters do not fit the capacity, a plan
            that cannot bring the peak under the capacity (before any planned step runs;
            the message names the smallest capacity the plan reaches and the SSD room it
            planned in: the SSD tier's files are planned within the free bytes of
            ``hardware.ssd_dirs``, shared by the stages, ``teraio.core.tiers.ssd.drive_room_bytes``), or an SSD
            directory that is missing/unwritable/too small.
        teraio.core.pager.CapacityError: an op's own inputs and outputs exceed the capacity.
        torch.OutOfMemoryError: the capacity was exceeded.
        FloatingPointError: a loss that is not finite.
    """
    with kept_on_failure(Measurements()) as measured:
        _train(cfg, Path(job_dir), device, measured)
    return measured


def _train(cfg: RunConfig, job_dir: Path, device: torch.device, measured: Measurements) -> None:
    opts = dataclass_from_dict(TeraIOOptions, cfg.system.options, "system.options (TeraIO)")
    spec = systems.get(cfg.system.name)
    w = cfg.workload
    if w.warmup_steps < 2:
        raise ValueError(f"workload.warmup_steps={w.warmup_steps}: TeraIO needs >= 2 "
                         "(one step to create the optimizer state, one profiled step)")
    headroom = opts.headroom_fraction if opts.headroom_fraction is not None else (
        CUDA_HEADROOM_FRACTION if device.type == "cuda" else 0.0)
    capacity, emulated = device_capacity(cfg, device)
    limit = int(capacity * (1 - headroom)) if capacity is not None else None
    if w.pipeline_stages == 1:  # a stage holds a share of the model: its own step tells
        check_model_fits(cfg, limit)
    bandwidths = tier_bandwidth(cfg, device, opts.io_threads, measured)  # a probe, if any, before the cap
    if device.type == "cuda":
        torch.cuda.empty_cache()
    apply_memory_cap(cfg.hardware.gpu_capacity_bytes, device)  # from the first allocation on
    measured.capacity_bytes = capacity
    measured.capacity_emulated = emulated if capacity is not None else None
    engine = logs = None
    try:
        reset_peak_memory(device)
        training = build_training(cfg.model, w, device, cfg.seed)
        model, optimizer = training.model, training.optimizer
        peaks = [peak_memory(device)]  # (allocated, reserved): the build, then each step
        # A pipeline stage's side files go to stage<s>/ of the job dir; stage 0 prints.
        prefix = "" if training.n_stages == 1 else f"stage{training.stage}/"
        side = job_dir / prefix
        side.mkdir(parents=True, exist_ok=True)
        logs = EngineLogs(side, first_step=w.warmup_steps)
        loud = training.stage == 0

        def step_fn(step: int):
            inputs, labels = make_batch(step, w, cfg.model.vocab_size, cfg.seed, device)
            return lambda: training.step(inputs, labels)

        def new_pager(track: bool = True):
            return None if limit is None else Pager(
                limit, device, list(persistent_tensors(model, optimizer).values()) if track else [],
                min_evict_bytes=opts.min_tensor_bytes)

        pager = new_pager()
        losses: dict[int, float] = {}  # every step's, by step: the paged ones and the loop's
        paged = measured.paged_steps

        def paged_step(step: int, body, note: str = ""):
            if pager is not None:
                pager.stats = PagerStats(max_accounted_bytes=pager.resident_bytes,
                                         max_host_bytes=pager.buffers.held_bytes)
            reset_peak_memory(device)
            with timed(device) as t:
                loss = body()
            losses[step] = loss
            allocated, reserved = peak_memory(device)
            if step in traced and allocated is not None:  # the profiler resets the peak per op
                allocated = max(allocated, traced[step].meta["peak_allocated_bytes"] or 0)
            peaks.append((allocated, reserved))
            paged.append({"step": step, "seconds": t["seconds"], "loss": loss,
                          "peak_allocated_bytes": peaks[-1][0],
                          **(dataclasses.asdict(pager.stats) if pager is not None else {})})
            if loud:
                print(progress_line(step, t["seconds"], w.tokens_at(step), loss, not note,
                                    (" (paged)" if pager is not None else "") + note), flush=True)
            return t["seconds"]

        def first_step():
            with PagedStep(pager) if pager is not None else contextlib.nullcontext():
                return step_fn(0)()

        traced = {}

        def profiled(step: int):
            def body():
                loss, traced[step] = profile_step(step_fn(step), model, optimizer, device,
                                                  meta={**cfg.point(), **w.shape_at(step)}, pager=pager)
                return loss
            return body

        def plan_for(trace, suffix: str):
            """Plan ``trace`` (saved with it in the job dir) and start an engine on it, taking
            over what the pager holds."""
            unoffloaded_peak = trace.peak_bytes()  # M's numerator: the plain step's, for every option
            trace.save(side / f"trace{suffix}.json")
            if opts.release_grads:
                trace = trace.with_released_grads()
            plan_capacity = limit if limit is not None else int(unoffloaded_peak * (1 - headroom))
            host_cap = cfg.hardware.host_mem_cap_bytes if spec.host_tier else 0
            t0 = time.perf_counter()
            # The SSD tier's files within the drives' free room, shared by the pipeline's stages.
            ssd_cap = drive_room_bytes(list(cfg.hardware.ssd_dirs)) // w.pipeline_stages
            plan = plan_fastest(trace, plan_capacity, bandwidths, host_cap_bytes=host_cap,
                                benefit=opts.benefit, min_tensor_bytes=opts.min_tensor_bytes,
                                allow_stalls=opts.allow_stalls, host_arena=opts.host_arena,
                                ssd_cap_bytes=ssd_cap)
            compile_seconds = time.perf_counter() - t0
            plan.save(side / f"plan{suffix}.json")
            summary = {"capacity_bytes": plan_capacity, "predicted_peak_bytes": plan.predicted_peak_bytes,
                       "shortfall_bytes": plan.shortfall_bytes, "migrations": len(plan.migrations),
                       "bytes_per_tier": plan.bytes_per_tier(), "host_arena": plan.meta["host_arena"],
                       "ssd_cap_bytes": ssd_cap, "ssd_file_bytes": plan.meta["ssd_file_bytes"],
                       **({"host_arena_auto": plan.meta["host_arena_auto"]} if "host_arena_auto" in plan.meta else {})}
            if not suffix:
                measured.unoffloaded_peak_bytes = unoffloaded_peak
                measured.plan_compile_seconds = compile_seconds
                measured.memory_pressure = unoffloaded_peak / capacity if capacity else None
                measured.extras["plan"] = summary
                measured.artifacts.update(trace=f"{prefix}trace.json", plan=f"{prefix}plan.json")
            if plan.shortfall_bytes > 0:
                raise ValueError(
                    f"the capacity cannot be met: the plan for {plan_capacity} B (capacity {capacity} B less "
                    f"headroom {headroom}) peaks at {plan.predicted_peak_bytes} B, {plan.shortfall_bytes} B over; "
                    f"the smallest capacity it reaches is hardware.gpu_capacity_bytes="
                    f"{math.ceil(plan.predicted_peak_bytes / (1 - headroom))}"
                    + ("" if opts.allow_stalls else " (or allow stalls: system.options.allow_stalls=true)")
                    + f"; its SSD files take {plan.meta['ssd_file_bytes']} B of the {ssd_cap} B free on "
                    f"hardware.ssd_dirs={list(cfg.hardware.ssd_dirs)} (less {SSD_FREE_RESERVE} B kept free)")
            tiers = open_tiers(plan, cfg, device, opts.io_threads)
            measured.ssd_io_mode = tiers["ssd"].mode if "ssd" in tiers else None
            eng = MigrationEngine(trace, plan, persistent_tensors(model, optimizer), tiers, device,
                                  device_waits=opts.device_waits, release_grads=opts.release_grads)
            if pager is not None:
                # The pager's free page-locked buffers become host-tier slots; the rest of its
                # buffers are released as they empty, so host memory never holds both.
                adopted = tiers["host"].adopt(pager.buffers) if "host" in tiers else 0
                pager.buffers.stop_keeping()
            eng.prime(pager)
            if pager is not None:
                if "host" in tiers and loud:
                    print(f"host tier: {adopted} B of {tiers['host'].nbytes} B adopted from the pager's "
                          f"free buffers, {tiers['host'].allocated_bytes - adopted} B more taken over or "
                          "allocated", flush=True)
                pager.close()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return eng, trace, compile_seconds, summary

        paged_step(0, first_step)
        measured.profile_seconds = paged_step(1, profiled(1))
        engine, trace, _, _ = plan_for(traced[1], "")
        runs = [(engine, trace)]  # every engine of the run with its trace, for the logs

        def loop_step(step: int) -> Step | None:
            nonlocal engine, pager
            shape = w.shape_at(step)
            if opts.replan_on_drift and shape != w.shape_at(step - 1):
                # Plan drift (the shape the plan was made for changed): page, profile, plan anew.
                pager = new_pager(track=False)
                if pager is None:  # uncapped: the plan moves nothing
                    engine.close()
                else:
                    engine.hand_back(pager)
                    pager.track(persistent_tensors(model, optimizer).values())
                seconds = paged_step(step, profiled(step), f" (profiled again: seq_len {shape['seq_len']},"
                                                           " not measured)")
                engine, new_trace, compile_seconds, summary = plan_for(traced[step], f".step{step}")
                runs.append((engine, new_trace))
                measured.replans.append({"step": step, "shape": shape, "profile_seconds": seconds,
                                         "plan_compile_seconds": compile_seconds, "plan": summary,
                                         "artifacts": {"trace": f"{prefix}trace.step{step}.json",
                                                       "plan": f"{prefix}plan.step{step}.json"}})
                return None
            reset_peak_memory(device)
            return Step(lambda: engine.run_step(step_fn(step), step, shape=shape), engine_stats)

        def engine_stats() -> StepStats:
            peaks.append(peak_memory(device))
            logs.write(runs)
            s = engine.stats
            if s.audit is not None:  # an engine's first step, measured or warm-up
                measured.extras.setdefault("audits", []).append({"step": s.step, **s.audit})
            return StepStats(stall_count=s.stall_count, stall_seconds=s.stall_seconds,
                             migration_seconds=s.migration_seconds, bytes_offloaded=s.bytes_offloaded,
                             bytes_prefetched=s.bytes_prefetched, note=f" stalls {s.stall_count}",
                             extra={"max_accounted_bytes": s.max_accounted_bytes,
                                    **{k: getattr(s, k) for k in RECOVERY_KEYS}})

        with compute_stream(device):
            measure_steps(loop_step, w, device, first_step=2, progress=loud,
                          out=Steps(iterations=measured.iterations, losses=losses))
        synchronize(device)
        if device.type == "cuda":
            measured.step_peak_allocated_bytes = [a for a, _ in peaks[1:]]
            measured.peak_allocated_bytes = max(a for a, _ in peaks)
            measured.peak_reserved_bytes = max(r for _, r in peaks)
    except BaseException:
        if logs is not None:  # a failed run leaves no partial logs
            logs.discard()
        raise
    finally:
        lift_memory_cap(device)
        if engine is not None:
            # Only the parameters are read after training (their digest); reading back the
            # optimizer state too would add minutes from an SSD tier.
            engine.close(restore=lambda name: name.startswith("param:"))
    measured.losses = [losses[step] for step in sorted(losses)]
    digest = param_digest(model)
    logs.write(runs)
    logs.close()
    measured.artifacts.update(oplog=f"{prefix}oplog.csv", transfers=f"{prefix}transfers.csv")
    totals = iteration_totals(measured.iterations)
    stages = gather_stages(training, {
        "stall_count": totals.get("stall_count"), "stall_seconds": totals.get("stall_seconds"),
        "unoffloaded_peak_bytes": measured.unoffloaded_peak_bytes, "memory_pressure": measured.memory_pressure,
        "peak_allocated_bytes": measured.peak_allocated_bytes, "plan": measured.extras.get("plan"),
        "final_params_sha256": digest, "artifacts": dict(measured.artifacts)})
    if stages is not None:
        measured.extras["stages"] = stages
        digest = hashlib.sha256("".join(s["final_params_sha256"] for s in stages).encode()).hexdigest()
    measured.extras["final_params_sha256"] = digest


class EngineLogs:
    """``oplog.csv`` and ``transfers.csv`` of the steps from ``first_step`` on, over every
    engine of the run (several where it planned again), written as the steps go: each
    :meth:`write` takes the engines' records (``MigrationEngine.take_logs``), so that a long
    run's memory stays flat."""

    TRANSFER_COLUMNS = ["step", "tensor", "tier", "direction", "nbytes", "op_issued", "op_done",
                        "t_issued_s", "t_done_s"]

    def __init__(self, job_dir: Path, first_step: int):
        self.paths = [job_dir / "oplog.csv", job_dir / "transfers.csv"]
        self.first_step = first_step
        self._files = [open(p, "w", newline="") for p in self.paths]
        self._ops = csv.writer(self._files[0])
        self._ops.writerow(["step", "op", "op_name", "t_start_s", "seconds", "stall_s"])
        self._transfers = csv.DictWriter(self._files[1], fieldnames=self.TRANSFER_COLUMNS)
        self._transfers.writeheader()

    def write(self, runs: list) -> None:
        """Write and forget the records of each ``(engine, trace)`` of ``runs``."""
        for engine, trace in runs:
            oplog, transfers = engine.take_logs()
            for row in oplog:
                if row["step"] < self.first_step:
                    continue
                t = row["t_start_s"]
                dur = list(t[1:] - t[:-1]) + [float("nan")]
                for k in range(trace.n_ops):
                    self._ops.writerow([row["step"], k, trace.op_names[k], f"{t[k]:.9f}", f"{dur[k]:.9f}",
                                        f"{row['stall_s'][k]:.9f}"])
            self._transfers.writerows(r for r in transfers if r["step"] >= self.first_step)

    def close(self) -> None:
        for f in self._files:
            f.close()

    def discard(self) -> None:
        """Close and delete the files (a failed run)."""
        self.close()
        for p in self.paths:
            p.unlink(missing_ok=True)
