"""Ideal: the shared training step with no memory cap and no offload (paper §4, "a GPU
with infinite on-board memory"), measured on hardware wherever any of it fits, modeled from
profiled kernel times only where not even one micro-batch does.

The paper does not say how its Ideal was obtained; for models that cannot fit it must have
been modeled. Here a point's Ideal row is, by ``system.options.measure`` (default ``auto``:
the first of these that fits the device, ``hardware.gpu_capacity_bytes`` ignored):

* ``measured`` — the whole step trained and timed (:func:`run_measured`);
* ``composed`` — the whole step does not fit (the AdamW states beside one micro-batch's
  activations) but one micro-batch does: its phases are timed apart on the device, the
  forward+backward of one micro-batch and the optimizer step, each over several repeats,
  and the step composed from them (:func:`run_composed`);
* ``modeled`` — not even one micro-batch fits: the sum of a trace's kernel times
  (``system.options.modeled_traces``, :func:`run_modeled`); no model is built.

``system.options.capacity_bytes`` emulates a smaller device for Ideal alone
(``teraio.systems.capacity``), on a GPU and on the CPU alike. The row says which it is
(``measure``) and what did not fit on the way (``fell_back_from``).
"""
from __future__ import annotations

import gc
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from teraio.config import RunConfig
from teraio.systems.capacity import EmulatedCapacity
from teraio.systems.loop import Step, StepStats, Steps, measure_steps
from teraio.systems.measure import peak_memory, reset_peak_memory, timed
from teraio.result import Measurements, iteration_row, kept_on_failure
from teraio.workload.models import build_model
from teraio.workload.pipeline import build_training, gather_stages
from teraio.workload.step import make_batch, make_optimizer
from teraio.core.trace import Trace
from teraio.perf.jobdir import read_trace

NO_BYTES = {"ssd": 0, "host": 0}
# Nothing moves, nothing stalls.
NO_MIGRATION = StepStats(stall_count=0, stall_seconds=0.0, migration_seconds=0.0, bytes_offloaded=NO_BYTES,
                         bytes_prefetched=NO_BYTES)
MEASURES = ("auto", "measured", "composed", "modeled")
OPTIONS = ("modeled_traces", "measure", "capacity_bytes", "phase_repeats")
PHASE_REPEATS = 5
"""Default timed repeats of each phase of a composed Ideal (``system.options.phase_repeats``)."""


def check_options(system: str, options: dict) -> None:
    """``system.options`` of Ideal (``teraio.systems``; ``conf/system/ideal.yaml``):
    ``modeled_traces`` ({model name: trace file}), ``measure`` (one of :data:`MEASURES`),
    ``capacity_bytes`` (positive int or null), ``phase_repeats`` (int >= 1). Raises
    ValueError naming the bad key or value."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"system.options {unknown}: {system} takes only {', '.join(OPTIONS)}")
    traces = options.get("modeled_traces") or {}
    if not isinstance(traces, dict):
        raise ValueError(f"system.options.modeled_traces={traces!r}; must map model names to trace files")
    if options.get("measure", "auto") not in MEASURES:
        raise ValueError(f"system.options.measure={options['measure']!r}; valid: {MEASURES}")
    cap = options.get("capacity_bytes")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
        raise ValueError(f"system.options.capacity_bytes={cap!r}; must be a positive int (bytes) or null")
    reps = options.get("phase_repeats", PHASE_REPEATS)
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"system.options.phase_repeats={reps!r}; must be an int >= 1")


def is_oom(e: BaseException) -> bool:
    """True for torch's OOM error and the 'out of memory' RuntimeErrors CUDA and cuBLAS raise."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower())


def run(cfg: RunConfig, job_dir: Path, device: torch.device) -> Measurements:
    """Ideal's row of the point (module docstring): with ``measure: auto``, measured; where
    the device (or ``capacity_bytes``) runs out of memory, composed; where that runs out too
    and ``modeled_traces`` names the point's model, modeled. Each fallback is listed in the
    row's ``fell_back_from`` (``[{measure, status: "oom", message}]``). With
    ``workload.pipeline_stages`` > 1, ``auto`` is ``measured`` (the stages' processes cannot
    retry apart).

    ``measure: measured|composed|modeled`` runs that one only.

    Raises:
        ValueError: an unknown option, ``measure: modeled`` without a trace for the model,
            or a modeled trace that does not match the point.
        FloatingPointError: a non-finite loss.
        torch.OutOfMemoryError: nothing that was allowed fits (the last one's error).
    """
    check_options(cfg.system.name, cfg.system.options)
    opts = cfg.system.options
    how = opts.get("measure", "auto")
    trace = (opts.get("modeled_traces") or {}).get(cfg.model.name)
    if how == "modeled":
        if trace is None:
            raise ValueError(f"system.options.measure=modeled needs modeled_traces.{cfg.model.name}")
        return run_modeled(cfg, Path(trace))
    ladder = {"measured": ["measured"], "composed": ["composed"],
              "auto": (["measured"] if cfg.workload.pipeline_stages > 1
                       else ["measured", "composed"] + (["modeled"] if trace is not None else []))}[how]
    fell: list[dict] = []
    for i, kind in enumerate(ladder):
        last = i == len(ladder) - 1
        try:
            if kind == "modeled":
                measured = run_modeled(cfg, Path(trace))
            elif kind == "composed":
                measured = run_composed(cfg, device)
            else:
                measured = run_measured(cfg, device)
        except Exception as e:
            if last or not is_oom(e):
                raise
            message = str(e).strip().splitlines()[0][:500] if str(e).strip() else type(e).__name__
            fell.append({"measure": kind, "status": "oom", "message": message})
            print(f"Ideal {kind}: out of memory ({message}); trying {ladder[i + 1]}", flush=True)
        else:
            if fell:
                measured.extras["fell_back_from"] = fell
            return measured
        _release(device)  # the exception and its frames are gone: free what they held
    raise AssertionError("unreachable")


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        print(f"released: {torch.cuda.memory_allocated(device)} bytes still allocated", flush=True)


def run_measured(cfg: RunConfig, device: torch.device) -> Measurements:
    """Train ``workload.warmup_steps`` untimed then ``workload.measure_steps`` timed
    iterations of the shared step, uncapped but for ``system.options.capacity_bytes``
    (``teraio.systems.loop.measure_steps``), and return the measurements (``teraio.result``;
    on failure, the iterations measured so far travel with the exception,
    ``teraio.result.kept_on_failure``).

    Each iteration is timed with the device synchronised at both ends
    (``teraio.systems.measure.timed``); the synthetic batch is made before the timer starts.
    ``peak_allocated_bytes``/``peak_reserved_bytes`` cover the whole run (bytes; null on
    CPU). With nothing offloaded, the peak allocated is also the unoffloaded peak, and
    ``memory_pressure`` is that peak over ``hardware.gpu_capacity_bytes`` when the
    hardware names a capacity — the M the capped systems run under; ``capacity_bytes``
    stays null because Ideal itself runs uncapped.

    With ``workload.pipeline_stages`` > 1 this process trains its stage
    (``teraio.workload.pipeline.build_training``); the row is stage 0's, its timing the
    pipeline's step, and the extra ``stages`` lists each stage's peak memory.

    Raises:
        FloatingPointError: a non-finite loss.
        torch.OutOfMemoryError: the step does not fit the device (or ``capacity_bytes``).
    """
    w = cfg.workload
    with EmulatedCapacity(cfg.system.options.get("capacity_bytes"), device, cfg.hardware.capacity_mode), \
            kept_on_failure(Measurements()) as measured:
        training = build_training(cfg.model, w, device, cfg.seed)
        reset_peak_memory(device)

        def step_fn(step: int) -> Step:
            inputs, labels = make_batch(step, w, cfg.model.vocab_size, cfg.seed, device)
            return Step(lambda: training.step(inputs, labels), lambda: NO_MIGRATION)

        steps = measure_steps(step_fn, w, device, progress=training.stage == 0,
                              out=Steps(iterations=measured.iterations))
    peak, reserved = peak_memory(device)
    capacity = cfg.hardware.gpu_capacity_bytes
    measured.losses = list(steps.losses.values())
    measured.peak_allocated_bytes, measured.peak_reserved_bytes = peak, reserved
    measured.unoffloaded_peak_bytes = peak
    measured.memory_pressure = peak / capacity if peak is not None and capacity else None
    stages = gather_stages(training, {"peak_allocated_bytes": peak, "peak_reserved_bytes": reserved})
    if stages is not None:
        measured.extras["stages"] = stages
    return measured


def run_composed(cfg: RunConfig, device: torch.device) -> Measurements:
    """Ideal's step composed from its phases, each timed on the device (``measure:
    "composed"``): for a point whose whole step does not fit but one micro-batch does.

    One model and AdamW (``teraio.workload.step``) on ``device``, under
    ``system.options.capacity_bytes`` when given. Phase 1, before any optimizer state
    exists: the forward+backward of one micro-batch of step 0's batch (gradients
    accumulating, as the step's later micro-batches run; the previous micro-batch's logits
    held until the next ones are made, as ``teraio.workload.step.train_step`` holds them),
    ``max(1, workload.warmup_steps)`` times untimed, then ``phase_repeats`` times timed.
    Phase 2, the activations gone: ``optimizer.step()`` over those gradients, its first call
    (which makes AdamW's states) and ``max(1, warmup_steps) - 1`` more untimed, then
    ``phase_repeats`` timed. Each timing has the device synchronised at both ends.

    The step, one iteration of ``workload.tokens_per_step`` tokens: ``micro-batches x``
    the mean forward+backward ``+`` the mean optimizer step (seconds), as the step runs
    them (``zero_grad``, dropping the gradients, is not timed). The row's extra
    ``composed``: ``{micro_batches, warmup_repeats, micro_batch_seconds: [...],
    optimizer_seconds: [...]}``. No loss: no step trained; ``unoffloaded_peak_bytes`` and
    ``memory_pressure`` stay null (the step never held all of it at once); the peaks are
    the run's (CUDA).

    Raises:
        ValueError: ``workload.pipeline_stages`` > 1, or a sequence-length schedule.
        torch.OutOfMemoryError: one micro-batch, or the optimizer step, does not fit.
    """
    w = cfg.workload
    if w.pipeline_stages > 1 or w.seq_len_schedule:
        raise ValueError("a composed Ideal times one device's step of one shape: workload.pipeline_stages=1 "
                         "and no workload.seq_len_schedule")
    repeats = cfg.system.options.get("phase_repeats", PHASE_REPEATS)
    warm = max(1, w.warmup_steps)
    n_micro, mb = w.grad_accum_steps, w.micro_batch_size
    fwd_bwd: list[float] = []
    opt_step: list[float] = []
    with EmulatedCapacity(cfg.system.options.get("capacity_bytes"), device, cfg.hardware.capacity_mode):
        model = build_model(cfg.model, w.seq_len, device, cfg.seed)
        optimizer = make_optimizer(model, w.lr)
        inputs, labels = make_batch(0, w, cfg.model.vocab_size, cfg.seed, device)
        reset_peak_memory(device)
        logits = None
        for r in range(warm + repeats):
            sl = slice((r % n_micro) * mb, (r % n_micro + 1) * mb)
            with timed(device) as t:  # as train_step's loop body
                logits = model(inputs[sl])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[sl].flatten()) / n_micro
                loss.backward()
                loss = loss.detach()
            if r >= warm:
                fwd_bwd.append(t["seconds"])
            print(f"composed: forward+backward {r} {t['seconds']:.3f}s"
                  + (" (warm-up)" if r < warm else ""), flush=True)
        del logits, loss
        for r in range(warm + repeats):
            with timed(device) as t:
                optimizer.step()
            if r >= warm:
                opt_step.append(t["seconds"])
            print(f"composed: optimizer step {r} {t['seconds']:.3f}s"
                  + (" (warm-up)" if r < warm else ""), flush=True)
        optimizer.zero_grad(set_to_none=True)
    peak, reserved = peak_memory(device)
    seconds = n_micro * statistics.fmean(fwd_bwd) + statistics.fmean(opt_step)
    print(f"composed: {n_micro} x {statistics.fmean(fwd_bwd):.3f} s + {statistics.fmean(opt_step):.3f} s = "
          f"{seconds:.3f} s per iteration, {w.tokens_per_step / seconds:.1f} tokens/s", flush=True)
    return Measurements(
        measure="composed", peak_allocated_bytes=peak, peak_reserved_bytes=reserved,
        extras={"composed": {"micro_batches": n_micro, "warmup_repeats": warm, "micro_batch_seconds": fwd_bwd,
                             "optimizer_seconds": opt_step}},
        iterations=[iteration_row(w.warmup_steps, seconds, w.tokens_per_step, None, stall_count=0,
                                  stall_seconds=0.0, migration_seconds=0.0, bytes_offloaded=NO_BYTES,
                                  bytes_prefetched=NO_BYTES)])


def optimizer_phase_start(trace: Trace) -> int:
    """Index of the first op that touches optimizer state (AdamW's per-parameter updates,
    ``foreach=False``): where the step's optimizer phase begins.

    Raises:
        ValueError: the trace has no optimizer state.
    """
    uses = [min(t.uses) for t in trace.tensors if t.kind == "optim" and t.uses]
    if not uses:
        raise ValueError("trace has no optimizer-state tensor: cannot find the optimizer phase")
    return min(uses)


def modeled_iteration_seconds(trace: Trace, micro_batches: int) -> float:
    """Ideal iteration time (seconds) from profiled kernel times (paper §2.2: kernels run
    for their profiled time, nothing waits): the forward/backward ops of the trace's one
    micro-batch ``micro_batches`` times, then its optimizer phase once.

    Raises:
        ValueError: ``micro_batches`` < 1, or no optimizer phase in the trace.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches}; must be >= 1")
    k = optimizer_phase_start(trace)
    return micro_batches * float(trace.op_seconds[:k].sum()) + float(trace.op_seconds[k:].sum())


def trace_step_seconds(trace: Trace, batch_size: int, micro_batch_size: int) -> float:
    """Modeled Ideal iteration (seconds) of a step of ``batch_size`` in micro-batches of
    ``micro_batch_size`` from ``trace``: the sum of its kernel times where it is a whole step
    of that batch (``meta["batch_size"]``), else :func:`modeled_iteration_seconds` of its one
    micro-batch."""
    if trace.meta.get("batch_size") == batch_size:
        return float(trace.op_seconds.sum())
    return modeled_iteration_seconds(trace, batch_size // micro_batch_size)


def run_modeled(cfg: RunConfig, trace_file: Path) -> Measurements:
    """The measurements of a modeled Ideal row, ``measure: "modeled"``, no loss, no
    memory: one iteration of the summed kernel times of ``trace_file`` when it is a whole
    step of the point (``meta["batch_size"]`` is the point's, e.g. a TeraIO run's
    ``trace.json``), else of :func:`modeled_iteration_seconds` from a one-micro-batch step
    (e.g. synthesized to full depth by ``benchmarks/profile_reduced.py``).

    Raises:
        ValueError: the file is missing, or its ``meta`` (model, n_layers, micro_batch_size,
            seq_len, and a batch of one micro-batch or of the point's batch) does not match.
    """
    if not trace_file.is_file():
        raise ValueError(f"system.options.modeled_traces.{cfg.model.name}: no such file {trace_file}")
    trace = read_trace(trace_file)  # a damaged file: a ValueError naming it
    w, meta = cfg.workload, trace.meta
    whole_step = meta.get("batch_size") == w.batch_size
    want = {"model": cfg.model.name, "n_layers": cfg.model.n_layers, "micro_batch_size": w.micro_batch_size,
            "batch_size": w.batch_size if whole_step else w.micro_batch_size, "seq_len": w.seq_len}
    wrong = {k: (meta[k], v) for k, v in want.items() if k in meta and meta[k] != v}
    if wrong or "model" not in meta:
        raise ValueError(f"{trace_file} does not model this point: (trace, point) differ in "
                         f"{wrong or {'model': (None, cfg.model.name)}}; it must be a step of the same "
                         f"model, micro-batch size and sequence length, of one micro-batch or of the "
                         f"point's batch")
    seconds = trace_step_seconds(trace, w.batch_size, w.micro_batch_size)
    print(f"modeled from {trace_file}: {seconds:.3f} s per iteration, "
          f"{w.tokens_per_step / seconds:.1f} tokens/s", flush=True)
    return Measurements(measure="modeled", extras={"modeled_from": str(trace_file)}, iterations=[iteration_row(
        w.warmup_steps, seconds, w.tokens_per_step, None, stall_count=0, stall_seconds=0.0,
        migration_seconds=0.0, bytes_offloaded=NO_BYTES, bytes_prefetched=NO_BYTES)])
