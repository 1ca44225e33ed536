"""Ideal: the shared training step with no memory cap and no offload (paper §4, "a GPU
with infinite on-board memory"), measured on hardware wherever the model fits, modeled
from profiled kernel times where it cannot.

The paper does not say how its Ideal was obtained; for models that cannot fit it must have
been modeled. Here Ideal is measured on the real device, ignoring
``hardware.gpu_capacity_bytes``, unless ``system.options.modeled_traces`` names a trace
for the point's model: then the row is ``modeled`` (``measure: "modeled"``) from that
trace's kernel times, and no model is built. The trace is either a whole step of the point
(the ``trace.json`` a TeraIO run of it profiled within the capacity; the kernels' own times
add up to the iteration) or one micro-batch of it (:func:`modeled_iteration_seconds`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from teraio.config import RunConfig
from teraio.systems.loop import Step, StepStats, Steps, measure_steps
from teraio.systems.measure import peak_memory, reset_peak_memory
from teraio.result import Measurements, iteration_row, kept_on_failure
from teraio.workload.pipeline import build_training, gather_stages
from teraio.workload.step import make_batch
from teraio.core.trace import Trace

NO_BYTES = {"ssd": 0, "host": 0}
# Nothing moves, nothing stalls.
NO_MIGRATION = StepStats(stall_count=0, stall_seconds=0.0, migration_seconds=0.0, bytes_offloaded=NO_BYTES,
                         bytes_prefetched=NO_BYTES)


def check_options(system: str, options: dict) -> None:
    """``system.options`` of Ideal (``teraio.systems``): only ``modeled_traces``, a map of
    model names to trace files. Raises ValueError naming the bad key or value."""
    unknown = sorted(set(options) - {"modeled_traces"})
    if unknown:
        raise ValueError(f"system.options {unknown}: {system} takes only modeled_traces "
                         "({model name: trace file})")
    traces = options.get("modeled_traces") or {}
    if not isinstance(traces, dict):
        raise ValueError(f"system.options.modeled_traces={traces!r}; must map model names to trace files")


def run(cfg: RunConfig, job_dir: Path, device: torch.device) -> Measurements:
    """Train ``workload.warmup_steps`` untimed then ``workload.measure_steps`` timed
    iterations of the shared step, uncapped (``teraio.systems.loop.measure_steps``), and return
    the measurements (``teraio.result``; on failure, the iterations measured so far travel
    with the exception, ``teraio.result.kept_on_failure``).

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

    ``system.options.modeled_traces`` (optional): ``{model name: trace file}``; a point
    whose model is named there gets a modeled row instead (:func:`run_modeled`).

    Raises:
        ValueError: an unknown option, or a modeled trace that does not match the point.
        FloatingPointError: a non-finite loss.
        torch.OutOfMemoryError: the model does not fit the real device.
    """
    check_options(cfg.system.name, cfg.system.options)
    traces = cfg.system.options.get("modeled_traces") or {}
    if cfg.model.name in traces:
        return run_modeled(cfg, Path(traces[cfg.model.name]))
    w = cfg.workload
    training = build_training(cfg.model, w, device, cfg.seed)
    reset_peak_memory(device)

    def step_fn(step: int) -> Step:
        inputs, labels = make_batch(step, w, cfg.model.vocab_size, cfg.seed, device)
        return Step(lambda: training.step(inputs, labels), lambda: NO_MIGRATION)

    with kept_on_failure(Measurements()) as measured:
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
    trace = Trace.load(trace_file)
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
    seconds = (float(trace.op_seconds.sum()) if whole_step
               else modeled_iteration_seconds(trace, w.batch_size // w.micro_batch_size))
    print(f"modeled from {trace_file}: {seconds:.3f} s per iteration, "
          f"{w.tokens_per_step / seconds:.1f} tokens/s", flush=True)
    return Measurements(measure="modeled", extras={"modeled_from": str(trace_file)}, iterations=[iteration_row(
        w.warmup_steps, seconds, w.tokens_per_step, None, stall_count=0, stall_seconds=0.0,
        migration_seconds=0.0, bytes_offloaded=NO_BYTES, bytes_prefetched=NO_BYTES)])
