"""TeraIO as a training system (``teraio_ssd`` and ``teraio_mixed``, paper §3, Fig. 4): the
runner the registry names (``teraio.systems``). The run itself is
``teraio.trainer.trainer.TeraIOTrainer``; its options
``teraio.trainer.options.TeraIOOptions``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from teraio.config import RunConfig
from teraio.result import Measurements, kept_on_failure
from teraio.trainer.trainer import TeraIOTrainer


def run(cfg: RunConfig, job_dir: Path, device: torch.device) -> Measurements:
    """Train ``cfg`` under TeraIO and return the measurements (``teraio.result``; on failure,
    those made so far travel with the exception, ``teraio.result.kept_on_failure``: the
    plan that fell short, the capacity, the paged and measured steps).

    Steps 2 .. (after the candidates' steps with ``workload.micro_batch_size=auto``) are run by
    the shared loop (``teraio.systems.loop.measure_steps``); each one's timed region covers
    making its batch and the engine's step. Extras of the row: ``plan`` (the first plan's
    summary, its recomputes included), ``micro_batch`` (with ``auto``: every candidate's
    simulated iteration and the choice, ``teraio.trainer.microbatch``),
    ``final_params_sha256`` and, on CUDA, ``audits`` (each engine's first step's
    ``teraio.core.engine.StepStats.audit`` with its ``step``: that step is usually a warm-up
    one, which has no iteration row); each iteration adds ``urgent_count``,
    ``max_accounted_bytes``, ``recomputed_bytes``, ``recompute_seconds``, ``oom_retries``,
    ``dropped_bytes``, ``deferred_prefetches`` and ``spilled_bytes``.

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
        TeraIOTrainer(cfg, Path(job_dir), device, measured).train()
    return measured
