"""One TeraIO training run (``teraio_ssd`` and ``teraio_mixed``): profile → plan → migrate
around the shared training step (paper §3, Fig. 4), as a class in the shape of torchtitan's
``Trainer``: the run's state as attributes, a method per phase of the cycle.

The GPU capacity binds from the run's first allocation: the emulated one
(``hardware.gpu_capacity_bytes``, held the way ``hardware.capacity_mode`` says,
``teraio.systems.memory_cap``) or, with none given on a CUDA device, the device's own free
memory at start. No step runs un-offloaded.

Iteration schedule (the step index selects the data, so every system sees the same
tokens at the same step):

* step 0 (:meth:`TeraIOTrainer.paged_step` of :meth:`~TeraIOTrainer.first_step`): a step
  under the pager (``teraio.core.pager``), which creates the optimizer state and keeps
  everything within the capacity by evicting least recently used tensors to host memory on
  demand;
* step 1 (:meth:`~TeraIOTrainer.profile`): the profiled step (``teraio.core.profiler``),
  under the same pager (paper §3.1: a model that does not fit is profiled by offloading what
  the running kernel does not need);
* then the plan is compiled (:meth:`~TeraIOTrainer.plan`), the engine takes over the pager's
  tensors (:meth:`~TeraIOTrainer.start_engine`), and steps ``2 .. warmup_steps-1`` warm the
  engine up; steps ``warmup_steps ..`` are measured (:meth:`~TeraIOTrainer.measured_step`);
  a step whose workload shape differs from the one before it is profiled and planned
  again, or, where the run has planned that shape before, runs on its plan
  (:meth:`~TeraIOTrainer.replan`).

On a CPU device with no capacity given nothing is capped (no pager, nothing to plan for).
The options are ``teraio.trainer.options.TeraIOOptions``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import time
from pathlib import Path
from typing import Callable

import torch

from teraio import systems
from teraio.config import RunConfig, dataclass_from_dict
from teraio.core.engine import RECOVERY_KEYS, SHAPE_KEYS, MigrationEngine
from teraio.core.pager import CapacityError, Pager, PagedStep, PagerStats
from teraio.core.plan import MigrationPlan
from teraio.core.host_update import HostUpdate, give_back, measure_rate, take_from_optimizer
from teraio.perf.choose import plan_fastest, plan_host_update
from teraio.perf.retime import defer_tail_offloads, retime_copies
from teraio.perf.simulator import simulate
from teraio.core.profiler import persistent_tensors, profile_step
from teraio.core.tiers.ssd import SSD_FREE_RESERVE, drive_room_bytes
from teraio.core.trace import Trace
from teraio.result import Measurements, human_bytes, iteration_totals, progress_line
from teraio.systems.loop import Step, Steps, StepStats, measure_steps
from teraio.systems.measure import param_digest, peak_memory, reset_peak_memory, synchronize, timed
from teraio.systems.memory_cap import apply_memory_cap
from teraio.trainer.logs import EngineLogs
from teraio.trainer.machine import (check_model_fits, compute_stream, device_capacity, open_tiers,
                                    tier_bandwidth)
from teraio.trainer.microbatch import Candidate, MicroBatchSearch, warmup_refusal
from teraio.trainer.options import TeraIOOptions
from teraio.workload.pipeline import build_training, gather_stages
from teraio.workload.step import make_batch, train_step


def shape_key(shape: dict) -> tuple:
    """The workload shape a plan holds for (``SHAPE_KEYS`` of a step's shape or a trace's
    meta), as a dict key."""
    return tuple(shape.get(k) for k in SHAPE_KEYS)


@dataclasses.dataclass(frozen=True)
class Planned:
    """A profiled step's plan, before any engine runs it (:meth:`TeraIOTrainer.plan`).

    Attributes:
        trace: the trace as planned (its gradients released after their last use where
            ``release_grads``).
        plan: the migration plan.
        capacity_bytes: the capacity planned for: the run's limit (capacity less headroom),
            or uncapped the un-offloaded peak less headroom.
        unoffloaded_peak_bytes: the profiled step's peak without offloading (memory
            pressure's numerator, for every option).
        ssd_cap_bytes: the room the SSD tier's files were planned in (the drives' free
            bytes shared by the pipeline's stages).
        compile_seconds: wall time of planning, the SSD room's look-up included.
        hosted: the parameters whose AdamW update runs in host memory
            (``teraio.core.host_update``; the trace is then ``Trace.with_host_update``'s).
    """

    trace: Trace
    plan: MigrationPlan
    capacity_bytes: int
    unoffloaded_peak_bytes: int
    ssd_cap_bytes: int
    compile_seconds: float
    hosted: tuple[str, ...] = ()

    def summary(self) -> dict:
        """The row's ``plan`` extra (and each re-plan's)."""
        plan = self.plan
        return {"capacity_bytes": self.capacity_bytes, "predicted_peak_bytes": plan.predicted_peak_bytes,
                "shortfall_bytes": plan.shortfall_bytes, "migrations": len(plan.migrations),
                "bytes_per_tier": plan.bytes_per_tier(), "host_arena": plan.meta["host_arena"],
                "ssd_cap_bytes": self.ssd_cap_bytes, "ssd_file_bytes": plan.meta["ssd_file_bytes"],
                **({"host_arena_auto": plan.meta["host_arena_auto"]} if "host_arena_auto" in plan.meta else {}),
                "recomputes": len(plan.recomputes), "recomputed_bytes": plan.recomputed_bytes(),
                **({"recompute_auto": plan.meta["recompute_auto"]} if "recompute_auto" in plan.meta else {}),
                **({"copy_order": plan.meta["copy_order"], "copy_order_sim": plan.meta.get("copy_order_sim")}
                   if "copy_order" in plan.meta else {}),
                **({"tail_offloads": plan.meta["tail_offloads"]} if "tail_offloads" in plan.meta else {}),
                **({"host_update": {"params": len(self.hosted), "bytes": sum(
                    self.trace.meta["host_update"][p]["nbytes"] for p in self.hosted),
                    **plan.meta["host_update_auto"]}} if "host_update_auto" in plan.meta else {})}


class TeraIOTrainer:
    """Train ``cfg`` under TeraIO, recording into ``measured`` (``teraio.trainer.runner.run``
    says what the row holds and what a failure raises).

    Constructing it checks the options and the model against the capacity, measures null
    bandwidths and binds the capacity, all before anything is allocated on the device;
    :meth:`train` builds the model and runs the cycle, then :meth:`close` hands everything
    back.

    Attributes:
        opts: the options (``TeraIOOptions``).
        headroom: the fraction of the capacity kept out of the plan and the pager.
        capacity: the device capacity in bytes (None: uncapped, a CPU given none).
        cap: the emulated capacity as applied (``teraio.systems.memory_cap.MemoryCap``), lifted
            by :meth:`close`.
        limit: the capacity less headroom, bytes: what the pager and the plan may use.
        bandwidths: the planner's tier bandwidths (GB/s).
        training: the model, optimizer and step (``teraio.workload.pipeline.Training``).
        side: directory of the side files (the job dir, or its ``stage<s>/``).
        pager: the pager of the steps before a plan (None: uncapped, or an engine runs).
        engine: the migration engine of the current plan (None before the first).
        runs: the current engine with its planned trace, for the logs (a re-plan writes the
            replaced engine's last records and drops it, :meth:`end_engine`).
        plans: per workload shape planned so far (``SHAPE_KEYS`` values), the profiled trace,
            its :class:`Planned` and the suffix of its files, for :meth:`replan` to reuse.
        losses: every step's loss, by step: the paged ones and the loop's.
        peaks: (allocated, reserved) peak bytes of the build, then of each step.
    """

    def __init__(self, cfg: RunConfig, job_dir: Path, device: torch.device, measured: Measurements):
        self.cfg, self.job_dir, self.device, self.measured = cfg, job_dir, device, measured
        self.opts = dataclass_from_dict(TeraIOOptions, cfg.system.options, "system.options (TeraIO)")
        self.spec = systems.get(cfg.system.name)
        self.workload = w = cfg.workload
        # workload.micro_batch_size=auto: candidates profiled from step 1 on (choose_micro_batch)
        self.search = MicroBatchSearch(w.batch_size) if w.micro_batch_size == "auto" else None
        refusal = warmup_refusal(w.warmup_steps, w.micro_batch_size)
        if refusal:
            raise ValueError(refusal)
        if self.search:  # step 0 trains the smallest candidate: it fits under the pager if any does
            self.workload = w = dataclasses.replace(w, micro_batch_size=self.search.order[-1])
        self.headroom = self.opts.headroom(device)
        self.capacity, emulated = device_capacity(cfg, device)
        self.limit = int(self.capacity * (1 - self.headroom)) if self.capacity is not None else None
        if w.pipeline_stages == 1:  # a stage holds a share of the model: its own step tells
            check_model_fits(cfg, self.limit)
        self.bandwidths = tier_bandwidth(cfg, device, self.opts.io_threads, measured)  # a probe, before the cap
        # the host's AdamW rate, where the plan may update parameters in host memory
        self.host_update_gbps = measure_rate() if self.opts.host_update != "off" and self.spec.host_tier else None
        if self.host_update_gbps is not None:
            measured.extras["host_update_gbps"] = self.host_update_gbps
        self.hosted: tuple[dict, dict, HostUpdate] | None = None  # the current engine's: params, taken, update
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # from the first allocation on
        self.cap = apply_memory_cap(cfg.hardware.gpu_capacity_bytes, device, cfg.hardware.capacity_mode)
        measured.capacity_bytes = self.capacity
        measured.capacity_emulated = emulated if self.capacity is not None else None
        self.training = self.logs = self.pager = self.engine = None
        self.runs: list[tuple[MigrationEngine, Trace]] = []
        self.plans: dict[tuple, tuple[Trace, Planned, str]] = {}
        self.losses: dict[int, float] = {}
        self.peaks: list[tuple[int | None, int | None]] = []
        self.prefix, self.side, self.loud = "", job_dir, True

    # ------------------------------------------------------------------ the run

    def train(self) -> None:
        """Build the model and run the cycle: the paged step, the profiled one, the plan,
        the loop's steps (re-planned where the shape changes). A failed run leaves no
        partial logs; either way :meth:`close` runs before anything is read back.

        Raises: as ``teraio.trainer.runner.run``.
        """
        try:
            self.build()
            self.paged_step(0, self.first_step)
            if self.search is None:
                trace, self.measured.profile_seconds = self.profile(1)
                planned, first = None, 2
            else:
                trace, planned, first = self.choose_micro_batch()
            self.plan_and_start(trace, "", planned)
            with compute_stream(self.device):
                measure_steps(self.measured_step, self.workload, self.device, first_step=first, progress=self.loud,
                              out=Steps(iterations=self.measured.iterations, losses=self.losses))
            synchronize(self.device)
            if self.device.type == "cuda":
                self.measured.step_peak_allocated_bytes = [a for a, _ in self.peaks[1:]]
                self.measured.peak_allocated_bytes = max(a for a, _ in self.peaks)
                self.measured.peak_reserved_bytes = max(r for _, r in self.peaks)
        except BaseException:
            if self.logs is not None:  # a failed run leaves no partial logs
                self.logs.discard()
            raise
        finally:
            self.close()
        self.finish()

    def build(self) -> None:
        """The model and optimizer on the device (within the capacity already bound), the
        side files' directory and logs, and the pager of the steps before the plan."""
        reset_peak_memory(self.device)
        self.training = training = build_training(self.cfg.model, self.workload, self.device, self.cfg.seed)
        self.peaks.append(peak_memory(self.device))
        # A pipeline stage's side files go to stage<s>/ of the job dir; stage 0 prints.
        self.prefix = "" if training.n_stages == 1 else f"stage{training.stage}/"
        self.side = self.job_dir / self.prefix
        self.side.mkdir(parents=True, exist_ok=True)
        self.logs = EngineLogs(self.side, first_step=self.workload.warmup_steps)
        self.loud = training.stage == 0
        self.pager = self.new_pager()

    def close(self) -> None:
        """Lift the capacity and close the engine, restoring the parameters only (their
        digest is all that is read after training; reading back the optimizer state too
        would add minutes from an SSD tier)."""
        self.cap.lift()
        if self.engine is not None:
            self.engine.close(restore=lambda name: name.startswith("param:"))

    def finish(self) -> None:
        """After :meth:`close`: the losses, the logs' last records, the parameters' digest
        and, pipelined, every stage's facts (a collective)."""
        measured = self.measured
        measured.losses = [self.losses[step] for step in sorted(self.losses)]
        digest = param_digest(self.training.model)
        self.logs.write(self.runs)
        self.logs.close()
        measured.artifacts.update(oplog=f"{self.prefix}oplog.csv", transfers=f"{self.prefix}transfers.csv")
        totals = iteration_totals(measured.iterations)
        stages = gather_stages(self.training, {
            "stall_count": totals.get("stall_count"), "stall_seconds": totals.get("stall_seconds"),
            "unoffloaded_peak_bytes": measured.unoffloaded_peak_bytes, "memory_pressure": measured.memory_pressure,
            "peak_allocated_bytes": measured.peak_allocated_bytes, "plan": measured.extras.get("plan"),
            "final_params_sha256": digest, "artifacts": dict(measured.artifacts)})
        if stages is not None:
            measured.extras["stages"] = stages
            digest = hashlib.sha256("".join(s["final_params_sha256"] for s in stages).encode()).hexdigest()
        measured.extras["final_params_sha256"] = digest

    # ------------------------------------------------------------------ steps before a plan

    def step_work(self, step: int) -> Callable[[], float]:
        """Make ``step``'s batch; the returned call trains it (the shared step) and returns its
        loss."""
        inputs, labels = make_batch(step, self.workload, self.cfg.model.vocab_size, self.cfg.seed, self.device)
        return lambda: self.training.step(inputs, labels)

    def new_pager(self, track: bool = True) -> Pager | None:
        """A pager within the limit, tracking the model's and optimizer's tensors where
        ``track``; None uncapped."""
        if self.limit is None:
            return None
        tracked = list(persistent_tensors(self.training.model, self.training.optimizer).values()) if track else []
        return Pager(self.limit, self.device, tracked, min_evict_bytes=self.opts.min_tensor_bytes)

    def paged_step(self, step: int, body: Callable[[], tuple[float, Trace | None]],
                   note: str = "") -> tuple[float, Trace | None]:
        """Run ``body`` (step ``step`` under the pager, returning its loss and, profiled, its
        trace) outside the measurement loop: timed, its peak and pager statistics kept in the
        row's ``paged_steps``, its line printed. Returns its seconds and the trace."""
        pager = self.pager
        if pager is not None:
            pager.stats = PagerStats(max_accounted_bytes=pager.resident_bytes, max_host_bytes=pager.buffers.held_bytes)
        reset_peak_memory(self.device)
        with timed(self.device) as t:
            loss, trace = body()
        self.losses[step] = loss
        allocated, reserved = peak_memory(self.device)
        if trace is not None and allocated is not None:  # the profiler resets the peak per op
            allocated = max(allocated, trace.meta["peak_allocated_bytes"] or 0)
        self.peaks.append((allocated, reserved))
        self.measured.paged_steps.append({"step": step, "seconds": t["seconds"], "loss": loss,
                                          "peak_allocated_bytes": allocated,
                                          **(dataclasses.asdict(pager.stats) if pager is not None else {})})
        if self.loud:
            print(progress_line(step, t["seconds"], self.workload.tokens_at(step), loss, not note,
                                (" (paged)" if pager is not None else "") + note), flush=True)
        return t["seconds"], trace

    def first_step(self) -> tuple[float, None]:
        """Step 0 under the pager: it creates the optimizer state. Its loss (no trace)."""
        with PagedStep(self.pager) if self.pager is not None else contextlib.nullcontext():
            return self.step_work(0)(), None

    def profile(self, step: int, note: str = "") -> tuple[Trace, float]:
        """Profile step ``step`` under the pager (:meth:`paged_step`); its trace, whose meta
        holds the run's point and the step's shape, and its seconds."""
        meta = {**self.cfg.point(), **self.workload.shape_at(step)}
        seconds, trace = self.paged_step(step, lambda: profile_step(
            self.step_work(step), self.training.model, self.training.optimizer, self.device, meta=meta,
            pager=self.pager), note)
        return trace, seconds

    def set_micro_batch(self, m: int) -> None:
        """Train micro-batches of ``m`` sequences from the next step on (one stage)."""
        self.workload = dataclasses.replace(self.cfg.workload, micro_batch_size=m)
        model, optimizer = self.training.model, self.training.optimizer
        self.training = dataclasses.replace(self.training,
                                            step=lambda x, y: train_step(model, optimizer, x, y, m))

    def choose_micro_batch(self) -> tuple[Trace, Planned, int]:
        """``workload.micro_batch_size=auto`` (``teraio.trainer.microbatch``): profile the
        candidates the search names, one step each from step 1 on, plan each at the run's
        capacity and tiers and simulate it at the tiers' rates as the engine runs it
        (``TeraIOOptions.stream_frees``); train the winner from then on. A candidate whose step
        does not fit under the pager is recorded ``oom`` (its step's gradients dropped). The
        row's ``micro_batch`` holds every candidate and the choice. Returns the winner's trace
        and plan and the first step after the profiled ones.

        Raises:
            RuntimeError: no candidate fit.
        """
        kept: dict[int, tuple[Trace, Planned, float]] = {}
        step = 1
        while (m := self.search.next()) is not None:
            self.set_micro_batch(m)
            try:
                trace, seconds = self.profile(step, f" (micro-batch {m}: a candidate)")
            except (torch.OutOfMemoryError, CapacityError):
                self.training.optimizer.zero_grad(set_to_none=True)
                self.search.add(Candidate(m, "oom", profile_step=step))
            else:
                planned = self.plan(trace)
                sim = simulate(planned.trace, planned.plan, self.bandwidths, shared_ssd=True,
                               host_update_gbps=self.host_update_gbps,
                               stream_frees=planned.plan.meta["stream_frees"])
                self.search.add(Candidate(m, "simulated", sim.ideal_seconds, sim.iteration_seconds, step))
                kept[m] = (trace, planned, seconds)
            step += 1
        best = self.search.best().micro_batch_size
        self.set_micro_batch(best)
        self.measured.extras["micro_batch"] = self.search.record()
        trace, planned, self.measured.profile_seconds = kept[best]
        return trace, planned, step

    # ------------------------------------------------------------------ the plan

    def plan(self, trace: Trace) -> Planned:
        """Plan ``trace`` (Algorithm 1, paper §3.2; ``teraio.perf.choose.plan_fastest``),
        touching nothing of the run: every planner option is given here, the user's
        (``TeraIOOptions.planner_options``) and the machine's (the capacity less headroom,
        the tier bandwidths, the host tier's cap where the system has one, the SSD tier's
        room on its drives shared by the pipeline's stages). With ``host_update`` the plan may
        update parameters in host memory (``teraio.perf.choose.plan_host_update``). Every
        choice is simulated as this run's engine frees host-tier offloads
        (``TeraIOOptions.stream_frees``; ``plan_fastest`` records it as the plan's
        ``meta["stream_frees"]``, which the retimings keep)."""
        unoffloaded_peak = trace.peak_bytes()  # M's numerator: the plain step's, for every option
        raw = trace
        if self.opts.release_grads:
            trace = trace.with_released_grads()
        capacity = self.limit if self.limit is not None else int(unoffloaded_peak * (1 - self.headroom))
        host_cap = self.cfg.hardware.host_mem_cap_bytes if self.spec.host_tier else 0
        t0 = time.perf_counter()
        ssd_cap = self.ssd_room()
        stream_frees = self.opts.stream_frees(self.device)
        options = {"ssd_cap_bytes": ssd_cap, "stream_frees": stream_frees, **self.opts.planner_options()}
        plan = plan_fastest(trace, capacity, self.bandwidths, host_cap_bytes=host_cap, **options)
        hosted = []
        if self.host_update_gbps is not None:  # the optimizer update where its state lives
            trace, plan, hosted = plan_host_update(raw, plan, capacity, self.bandwidths, host_cap, self.host_update_gbps,
                                                   self.opts.host_update, self.opts.release_grads,
                                                   groups=self.opts.host_update_groups, **options)
        if self.opts.copy_order == "deadline":
            plan = retime_copies(trace, plan, self.bandwidths, shared_ssd=True, stream_frees=stream_frees)
        if self.opts.tail_offloads == "next_step":
            plan = defer_tail_offloads(trace, plan, self.bandwidths, shared_ssd=True, stream_frees=stream_frees,
                                       host_update_gbps=self.host_update_gbps)
        return Planned(trace, plan, capacity, unoffloaded_peak, ssd_cap, time.perf_counter() - t0, tuple(hosted))

    def ssd_room(self) -> int:
        """The room the SSD tier's files may take now: the drives' free bytes
        (``drive_room_bytes``) shared by the pipeline's stages."""
        return drive_room_bytes(list(self.cfg.hardware.ssd_dirs)) // self.workload.pipeline_stages

    def plan_and_start(self, trace: Trace, suffix: str, planned: Planned | None = None) -> Planned:
        """Plan ``trace`` (unless ``planned``, its plan already made) and start an engine on
        the plan (:meth:`start_engine`). The trace and the plan are saved as
        ``trace<suffix>.json`` and ``plan<suffix>.json``; the first plan (``suffix`` empty) is
        recorded in the row.

        Raises:
            ValueError: the plan cannot bring the peak under the capacity (after the files
                and the row's record, before any engine).
        """
        trace.save(self.side / f"trace{suffix}.json")
        planned = planned or self.plan(trace)
        planned.plan.save(self.side / f"plan{suffix}.json")
        self.plans[shape_key(trace.meta)] = (trace, planned, suffix)
        if not suffix:
            m = self.measured
            m.unoffloaded_peak_bytes = planned.unoffloaded_peak_bytes
            m.plan_compile_seconds = planned.compile_seconds
            m.memory_pressure = planned.unoffloaded_peak_bytes / self.capacity if self.capacity else None
            m.extras["plan"] = planned.summary()
            m.artifacts.update(trace=f"{self.prefix}trace.json", plan=f"{self.prefix}plan.json")
        self.refuse_shortfall(planned)
        self.start_engine(planned)
        return planned

    def refuse_shortfall(self, planned: Planned) -> None:
        """Raise ValueError where ``planned`` peaks above its capacity, naming the smallest
        capacity it reaches and the SSD room it planned in."""
        plan, headroom = planned.plan, self.headroom
        if plan.shortfall_bytes <= 0:
            return
        raise ValueError(
            f"the capacity cannot be met: the plan for {planned.capacity_bytes} B (capacity {self.capacity} B less "
            f"headroom {headroom}) peaks at {plan.predicted_peak_bytes} B, {plan.shortfall_bytes} B over; "
            f"the smallest capacity it reaches is hardware.gpu_capacity_bytes="
            f"{math.ceil(plan.predicted_peak_bytes / (1 - headroom))}"
            + ("" if self.opts.allow_stalls else " (or allow stalls: system.options.allow_stalls=true)")
            + f"; its SSD files take {plan.meta['ssd_file_bytes']} B of the {planned.ssd_cap_bytes} B free on "
            f"hardware.ssd_dirs={list(self.cfg.hardware.ssd_dirs)} (less {SSD_FREE_RESERVE} B kept free)")

    def host_update(self, planned: Planned) -> HostUpdate:
        """Take ``planned.hosted`` out of the device optimizer and start their update in host
        memory (``teraio.core.host_update``), their states and parameters copied to host
        memory from the device or, where the pager holds them, from its copies (those of the
        states are dropped from the pager)."""
        named = dict(self.training.model.named_parameters())
        params = {p: named[p[len("param:"):]] for p in planned.hosted}
        taken = take_from_optimizer(self.training.optimizer, params)
        pager, given = self.pager, {}
        if pager is not None:
            def host(x: torch.Tensor) -> torch.Tensor:  # a copy of x's bytes where the pager holds them
                return pager.host_copy(x.untyped_storage()).view(x.dtype).view(x.shape).clone()

            for name, p in params.items():
                state = taken[name].state
                tensors = [p, state["exp_avg"], state["exp_avg_sq"]]
                if any(pager.holds(x.untyped_storage()) for x in tensors):
                    given[name] = tuple(host(x) if pager.holds(x.untyped_storage()) else x.detach().to("cpu", copy=True)
                                        for x in tensors)
                for x in tensors[1:]:
                    pager.forget(x.untyped_storage())
        update = HostUpdate(params, taken, {p: planned.trace.meta["host_update"][p] for p in planned.hosted},
                            self.device, given)
        self.hosted = (params, taken, update)
        return update

    def start_engine(self, planned: Planned) -> None:
        """Open the plan's tiers and start an engine on it, taking over what the pager holds
        (its free page-locked buffers become host-tier slots); the pager is closed."""
        tiers = open_tiers(planned.plan, self.cfg, self.device, self.opts.io_threads)
        self.measured.ssd_io_mode = tiers["ssd"].mode if "ssd" in tiers else None
        pager = self.pager
        update = self.host_update(planned) if planned.hosted else None
        engine = MigrationEngine(planned.trace, planned.plan,
                                 persistent_tensors(self.training.model, self.training.optimizer), tiers,
                                 self.device, device_waits=self.opts.device_waits,
                                 release_grads=self.opts.release_grads, host_update=update,
                                 pending_limit_bytes=self.pending_limit_bytes())
        if pager is not None:
            # The pager's free page-locked buffers become host-tier slots; the rest of its
            # buffers are released as they empty, so host memory never holds both.
            adopted = tiers["host"].adopt(pager.buffers) if "host" in tiers else 0
            pager.buffers.stop_keeping()
        engine.prime(pager)
        if pager is not None:
            if "host" in tiers and self.loud:
                print(f"host tier: {human_bytes(adopted)} of {human_bytes(tiers['host'].nbytes)} adopted from "
                      f"the pager's free buffers, {human_bytes(tiers['host'].allocated_bytes - adopted)} more "
                      "taken over or allocated", flush=True)
            pager.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.engine = engine
        self.runs.append((engine, planned.trace))

    # ------------------------------------------------------------------ steps under a plan

    def measured_step(self, step: int) -> Step | None:
        """The loop's step ``step`` (``teraio.systems.loop.StepFn``): the engine's step,
        timed from its batch on; where ``replan_on_drift`` and the shape differs from the
        step before, :meth:`replan` first (None: the step ran there, profiled, and is not
        measured)."""
        w = self.workload
        shape = w.shape_at(step)
        if self.opts.replan_on_drift and shape != w.shape_at(step - 1) and self.replan(step):
            return None
        reset_peak_memory(self.device)
        return Step(lambda: self.engine.run_step(self.step_work(step), step, shape=shape), self.engine_stats)

    def replan(self, step: int) -> bool:
        """Plan drift (the shape the plan was made for changed): end the engine
        (:meth:`end_engine`) and start one on the plan of step ``step``'s shape; the row's
        ``replans`` gets an entry. Returns whether the step ran here.

        A new shape: step ``step`` is profiled under a pager and planned
        (``trace.step<step>.json``, ``plan.step<step>.json``); returns True.

        A shape seen before (:attr:`plans`): its trace and plan are reused, nothing is
        profiled, and the step is left to the new engine (returns False; the entry names the
        files reused). That plan holds again because all it was made from is unchanged: the
        trace of a shape is the same ops on tensors of the same sizes (the model, the
        optimizer and the shape fix them; the engine refuses a step that runs other ops,
        ``ExecutionDivergedError``), and the capacity, the host tier's cap and the tier rates
        are the run's. Only the SSD room may have shrunk (another process writing to the
        drives): where it no longer holds the plan's files, the stored trace is planned
        again in the room there is (``plan.step<step>.json``), still without a profile.
        """
        shape = self.workload.shape_at(step)
        self.end_engine()
        known = self.plans.get(shape_key(shape))
        if known is None:
            trace, seconds = self.profile(step, f" (profiled again: seq_len {shape['seq_len']}, not measured)")
            planned = self.plan_and_start(trace, f".step{step}")
            self.measured.replans.append({
                "step": step, "shape": shape, "profile_seconds": seconds,
                "plan_compile_seconds": planned.compile_seconds, "plan": planned.summary(),
                "artifacts": {"trace": f"{self.prefix}trace.step{step}.json",
                              "plan": f"{self.prefix}plan.step{step}.json"}})
            return True
        trace, planned, suffix = known
        compile_seconds = None  # the plan reused as it is
        if planned.plan.meta["ssd_file_bytes"] > self.ssd_room():
            planned, suffix = self.plan(trace), f".step{step}"
            compile_seconds = planned.compile_seconds
            planned.plan.save(self.side / f"plan{suffix}.json")
            self.plans[shape_key(shape)] = (trace, planned, suffix)
            self.refuse_shortfall(planned)
        self.start_engine(planned)
        self.measured.replans.append({
            "step": step, "shape": shape, "reused": True, "profile_seconds": None,
            "plan_compile_seconds": compile_seconds, "plan": planned.summary(),
            "artifacts": {"trace": f"{self.prefix}trace{known[2]}.json", "plan": f"{self.prefix}plan{suffix}.json"}})
        if self.loud:
            print(f"step {step}: seq_len {shape['seq_len']} seen before: its plan "
                  f"({self.prefix}plan{suffix}.json) reused, nothing profiled", flush=True)
        return False

    def end_engine(self) -> None:
        """End the current engine between steps and keep nothing of it: its tensors go back
        to a new pager (uncapped, where there is none, it restores them and closes), and
        its last log records are written."""
        self.pager = self.new_pager(track=False)
        if self.pager is None:  # uncapped: the plan moves nothing
            self.engine.close()
        else:
            self.engine.hand_back(self.pager)
        if self.hosted is not None:  # back to the device optimizer, their states on the device
            params, taken, update = self.hosted
            for name, state in update.states().items():
                taken[name].state = {k: v.to(self.device) if k != "step" else v for k, v in state.items()}
            give_back(self.training.optimizer, params, taken)
            self.hosted = None
        if self.pager is not None:
            self.pager.track(persistent_tensors(self.training.model, self.training.optimizer).values())
        self.logs.write(self.runs)
        self.runs, self.engine = [], None

    def pending_limit_bytes(self) -> int | None:
        """The engine's ``pending_limit_bytes`` (``TeraIOOptions.pending_limit``): the device
        capacity under ``"capacity"``, the capacity less headroom under ``"plan"``; None under
        ``"off"`` or on a device without a capacity."""
        if self.capacity is None:
            return None
        return {"off": None, "capacity": self.capacity, "plan": self.limit}[self.opts.pending_limit]

    def engine_stats(self) -> StepStats:
        """The engine's step just run, for the loop (its peak kept, its logs written, its
        audit recorded where it is an engine's first step)."""
        self.peaks.append(peak_memory(self.device))
        self.logs.write(self.runs)
        s = self.engine.stats
        if s.audit is not None:  # an engine's first step, measured or warm-up
            self.measured.extras.setdefault("audits", []).append({"step": s.step, **s.audit})
        return StepStats(stall_count=s.stall_count, stall_seconds=s.stall_seconds,
                         migration_seconds=s.migration_seconds, bytes_offloaded=s.bytes_offloaded,
                         bytes_prefetched=s.bytes_prefetched, note=f" stalls {s.stall_count}",
                         extra={"max_accounted_bytes": s.max_accounted_bytes,
                                "gpu_idle_seconds": self.engine.gpu_idle_seconds(s.step),
                                "recomputed_bytes": s.recomputed_bytes, "recompute_seconds": s.recompute_seconds,
                                "pending_waits": s.pending_waits, **{k: getattr(s, k) for k in RECOVERY_KEYS}})
