"""What a step's memory is made of (paper Fig. 10(1), camera-ready): bytes of parameters,
gradients, optimizer state, activations and temporaries, measured from a run's profiled
trace and estimated for the paper's own configurations.

Measured (:func:`trace_breakdown`): at the op where the un-offloaded step peaks
(``Trace.required_bytes``) and as a time-weighted mean over the iteration, from the
tensors' kinds and lifetimes (``Trace.live_bytes_by_kind``). Bytes the allocator holds
beyond the tensors (``op_allocated_bytes`` of a CUDA profile above the lifetime count:
gradients ``param.grad`` keeps past their last use, workspaces, rounding) are their own
group, ``allocator``.

Estimated (:func:`teraio.workload.models.pipeline_estimate`): one GPU of a pipeline of
``stages`` stages run 1F1B, as the paper trains every model (§4.1: two GPUs, one stage each).
The paper gives no micro-batch size: the estimate takes the one the configuration names
(``conf/experiment/fig7.yaml`` states its assumption).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from teraio.config import ModelConfig
from teraio.workload.models import build_meta_model, pipeline_estimate, softmax_working_bytes
from teraio.core.trace import Trace

from .load import run_trace

GROUPS: dict[str, tuple[str, ...]] = {
    "parameters": ("param",), "gradients": ("grad",), "optimizer state": ("optim",),
    "activations": ("activation",), "temporaries": ("temp", "input")}
PERSISTENT = ("parameters", "gradients", "optimizer state")
ALLOCATOR = "allocator"


def trace_breakdown(trace: Trace) -> dict:
    """``{"peak_op", "peak_bytes", "at_peak": {group: bytes}, "mean": {group: bytes}}`` of
    ``trace``; groups are :data:`GROUPS` plus :data:`ALLOCATOR`, and ``at_peak`` adds up to
    ``peak_bytes``. ``mean`` weighs each op by its seconds (by op count if none are
    timed)."""
    kinds = trace.live_bytes_by_kind()
    series = {g: sum(kinds[k] for k in ks) for g, ks in GROUPS.items()}
    required = trace.required_bytes()
    series[ALLOCATOR] = required - trace.live_bytes()
    peak = int(np.argmax(required))
    w = trace.op_seconds if trace.op_seconds.sum() > 0 else np.ones(trace.n_ops)
    return {"peak_op": peak, "peak_bytes": int(required[peak]),
            "at_peak": {g: int(s[peak]) for g, s in series.items()},
            "mean": {g: float(np.average(s, weights=w)) for g, s in series.items()}}


def persistent_share(groups: dict) -> float:
    """Parameters, gradients and optimizer state as a fraction of all ``groups``' bytes."""
    total = sum(groups.values())
    return sum(groups.get(g, 0) for g in PERSISTENT) / total if total else float("nan")


def estimated_share(stage: dict) -> float:
    """The persistent share of an estimate (a stage of :func:`pipeline_estimate`) with its
    temporaries left out: what persists against what is saved for backward, the split the
    scaled points are matched on; the temporaries (one attention softmax's transient bytes
    where they exceed the logits) set the peak, not the split."""
    return persistent_share({g: stage[g] for g in GROUPS if g != "temporaries"})


def paper_micro_batch(model: ModelConfig, batch_size: int, seq_len: int, paper_m: float,
                      capacity_bytes: int, stages: int = 2) -> int:
    """The micro-batch a paper configuration is taken to have run (the paper gives none): the
    divisor of ``batch_size`` whose estimated first-stage peak (:func:`pipeline_estimate`),
    as a share of ``capacity_bytes``, is nearest the paper's M (``paper_m``, %); the smaller
    one on a tie."""
    def gap(mb: int) -> float:
        first = pipeline_estimate(model, mb, seq_len, batch_size // mb, stages)[0]
        return abs(100 * first["peak_bytes"] / capacity_bytes - paper_m)
    return min((d for d in range(1, batch_size + 1) if batch_size % d == 0), key=lambda d: (gap(d), d))


def measured_frame(runs: pd.DataFrame, root: Path) -> pd.DataFrame:
    """One row per run with a trace: its point and status, the un-offloaded peak, each group's
    bytes at that peak and the persistent share there and over the iteration. A TeraIO run
    saves the trace of its profiled, un-offloaded step before it plans, so a run that failed
    later (its status says how) still measured its make-up. A damaged trace is left out,
    with a warning naming it (``load.run_trace``)."""
    rows = []
    for _, r in runs[runs["trace_path"].notna()].iterrows():
        trace = run_trace(root, r["trace_path"])
        if trace is None:  # damaged: named in a warning
            continue
        b = trace_breakdown(trace)
        rows.append({**{k: r[k] for k in ("model", "system", "config", "micro_batch_size", "trial", "status")},
                     "peak_bytes": b["peak_bytes"], **b["at_peak"],
                     "persistent_at_peak": persistent_share(b["at_peak"]),
                     "persistent_mean": persistent_share(b["mean"])})
    return pd.DataFrame(rows)


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
SCALED = ("fig7_h200", "fig7_h200_m_only", "fig7_70b_cut")
"""Experiments whose points stand for the paper's Fig. 7 points on a smaller machine: a model
``<paper model>_<cut>`` (``llama3_8b_4l`` for ``llama3_8b``) and the paper's M per point, each
point capped at M (``fig7_h200``) or all at one capacity (``fig7_70b_cut``:
:func:`fixed_capacity`)."""


def adamw_update_bytes(model: ModelConfig) -> int:
    """Bytes the largest op of AdamW's update holds at once on the GPU (``foreach=False``,
    ``teraio.workload.step``: one parameter at a time): ``param.addcdiv_(exp_avg, denom)`` of the
    largest parameter, its weight, first moment and denominator, 3 x 4 B per element. No
    schedule can run that op with less resident (Llama3-70B's output weight: 12.6 GB)."""
    net = build_meta_model(model, 1)
    return 3 * 4 * max(p.numel() for p in net.parameters())


def fixed_capacity(experiment: str, conf_dir: Path = CONF_DIR) -> int | None:
    """The one GPU capacity (bytes) every point of ``experiment`` is capped at, where its file
    gives ``hardware.gpu_capacity_bytes`` as a number; None where the capacity is per point
    (an interpolation such as ``fig7_h200``'s ``${capacity_for_pressure:...}``) or absent."""
    import yaml

    d = yaml.safe_load((conf_dir / "experiment" / f"{experiment}.yaml").read_text())
    cap = (d.get("hardware") or {}).get("gpu_capacity_bytes")
    return cap if isinstance(cap, int) and not isinstance(cap, bool) else None


def load_model(name: str, conf_dir: Path = CONF_DIR) -> ModelConfig:
    """``model/<name>.yaml`` as the sweep composes it: its ``defaults`` (a base model, as
    ``llama3_8b_4l`` has ``llama3_8b``) first, then its own keys."""
    import yaml

    d = yaml.safe_load((conf_dir / "model" / f"{name}.yaml").read_text())
    merged: dict = {}
    for base in d.pop("defaults", []):
        if base != "_self_":
            merged.update(dataclasses.asdict(load_model(base, conf_dir)))
    return ModelConfig(**{**merged, **d})


def paper_frame(conf_dir: Path = CONF_DIR, stages: int = 2) -> pd.DataFrame:
    """The :func:`pipeline_estimate` of every configuration of the paper's Fig. 7
    (``experiment/fig7.yaml``: model, batch, micro-batch, sequence), one row per stage: the
    estimated M (% of the paper's GPU, ``hardware/paper_h100nvl.yaml``) beside the paper's."""
    import yaml

    points = _points(conf_dir, "fig7")
    capacity = yaml.safe_load((conf_dir / "hardware" / "paper_h100nvl.yaml").read_text())["gpu_capacity_bytes"]
    rows = []
    for name, by_point in points.items():
        model = load_model(name, conf_dir)
        for point, p in by_point.items():
            n_micro = p["batch_size"] // p["micro_batch_size"]
            for st in pipeline_estimate(model, p["micro_batch_size"], p["seq_len"], n_micro, stages):
                rows.append({"model": name, "point": point, "batch_size": p["batch_size"],
                             "micro_batch_size": p["micro_batch_size"], "seq_len": p["seq_len"],
                             "paper_m": p["paper_m"], **st, "estimated_m": 100 * st["peak_bytes"] / capacity,
                             "persistent_share": estimated_share(st)})
    return pd.DataFrame(rows)


def _points(conf_dir: Path, experiment: str) -> dict:
    import yaml

    return yaml.safe_load((conf_dir / "experiment" / f"{experiment}.yaml").read_text())["fig7"]["points"]


def paper_point_of(model: str, batch_size: int, micro_batch_size: int, seq_len: int,
                   conf_dir: Path = CONF_DIR) -> tuple[str, str] | None:
    """The paper configuration ``(model, point)`` a run stands for: a point of
    ``experiment/fig7.yaml`` itself, or one of a :data:`SCALED` experiment with a
    ``paper_m`` (whose model is a cut of the paper's: ``llama3_8b_4l`` for ``llama3_8b``);
    None for any other run."""
    shape = (batch_size, micro_batch_size, seq_len)
    for experiment, paper_model in (("fig7", model), *((e, model.rsplit("_", 1)[0]) for e in SCALED)):
        for point, p in _points(conf_dir, experiment).get(model, {}).items():
            if p.get("paper_m") is not None and (p["batch_size"], p["micro_batch_size"], p["seq_len"]) == shape:
                return paper_model, point
    return None


def one_gpu_estimate(model: ModelConfig, micro_batch_size: int, seq_len: int) -> tuple[dict, float]:
    """A step of ``model`` on one GPU, nothing offloaded, as :func:`pipeline_estimate` sees it
    with one stage (the whole model, one micro-batch in flight, the logits), and its
    persistent share."""
    (one,) = pipeline_estimate(model, micro_batch_size, seq_len, 1, stages=1)
    return one, estimated_share(one)


SEQUENCE_FACTORS = (1.0, 1.25, 1.5, 1.75, 2.0)
"""The factors :func:`sequence_factor` chooses from."""


def sequence_factor(paper_model: str, cut: str, factors: tuple[float, ...] = SEQUENCE_FACTORS,
                    conf_dir: Path = CONF_DIR) -> float:
    """The factor by which a scaled experiment lengthens the sequences of ``paper_model``'s
    Fig. 7 points on its cut ``cut`` (model ``<paper_model>_<cut>``), micro-batches kept: of
    ``factors``, the one whose largest distance (as :func:`scaled_frame` measures it: points of
    percentage between the cut's persistent share on one GPU and either pipeline stage's
    estimated for the paper configuration) over the model's points is least."""
    paper = paper_frame(conf_dir)
    paper = paper[paper["model"] == paper_model]
    model = load_model(f"{paper_model}_{cut}", conf_dir)

    def worst(factor: float) -> float:
        gaps = []
        for point, est in paper.groupby("point"):
            _, share = one_gpu_estimate(model, int(est["micro_batch_size"].iloc[0]),
                                        int(est["seq_len"].iloc[0] * factor))
            gaps.append(max(abs(share - v) for v in est["persistent_share"]))
        return max(gaps)
    return min(factors, key=worst)


def scaled_frame(experiment: str = "fig7_h200", conf_dir: Path = CONF_DIR) -> pd.DataFrame:
    """Per point of a :data:`SCALED` experiment that stands for a paper point: the point on one
    GPU as :func:`pipeline_estimate` sees it with one stage (the whole cut, one micro-batch in
    flight, the logits) — its peak and persistent share — beside the paper configuration's M and
    the persistent share estimated for each stage of its 2-stage pipeline (:func:`paper_frame`),
    and ``distance``: the larger of the two gaps, in points of percentage. The capacity the point
    is capped at: the experiment's :func:`fixed_capacity`, else peak / the paper's M;
    ``m_here``: the M that gives (%, peak / capacity). ``largest_op_share``:
    what one attention softmax holds at once
    (:func:`teraio.workload.models.softmax_working_bytes`) over that capacity: above the capacity
    TeraIO keeps usable no schedule can run that op;
    ``paper_largest_op_share``: the same at the paper configuration on its GPU.
    ``update_op_share``: :func:`adamw_update_bytes` over the capacity, bound the same way.
    ``zero_sequence_share``: what one sequence holds for backward (activations, attention
    probabilities, logits) over that capacity: the ZeRO baselines keep it on the GPU (no
    activation checkpointing, paper §4.1), so above 1 their rows end ``oom``.
    ``ssd_floor_bytes``: what TeraIO-SSD (no host tier) must hold on its drives at once, the
    peak less the capacity its plan keeps usable on a GPU (``headroom_fraction``'s CUDA
    default); a drive with less free room cannot hold its plan
    (``teraio.perf.replan.beyond_host`` measures it from a trace)."""
    import yaml

    from teraio.trainer.options import CUDA_HEADROOM_FRACTION  # the TeraIO system's imports: only here

    paper = paper_frame(conf_dir)
    paper_capacity = yaml.safe_load((conf_dir / "hardware" / "paper_h100nvl.yaml").read_text())["gpu_capacity_bytes"]
    fixed = fixed_capacity(experiment, conf_dir)
    rows = []
    for name, by_point in _points(conf_dir, experiment).items():
        model = load_model(name, conf_dir)
        for point, p in by_point.items():
            if p.get("paper_m") is None:
                continue
            one, share = one_gpu_estimate(model, p["micro_batch_size"], p["seq_len"])
            capacity = fixed if fixed is not None else one["peak_bytes"] / (p["paper_m"] / 100)
            sequence, _ = one_gpu_estimate(model, 1, p["seq_len"])
            est = paper[(paper["model"] == name.rsplit("_", 1)[0]) & (paper["point"] == point)]
            stage = {int(e["stage"]): float(e["persistent_share"]) for _, e in est.iterrows()}
            rows.append({"model": name, "point": point, "batch_size": p["batch_size"],
                         "micro_batch_size": p["micro_batch_size"], "seq_len": p["seq_len"],
                         "peak_bytes": one["peak_bytes"], "paper_m": p["paper_m"],
                         "m_here": 100 * one["peak_bytes"] / capacity, "persistent_share": share,
                         "paper_persistent_stage0": stage[0], "paper_persistent_stage1": stage[1],
                         "distance": 100 * max(abs(share - v) for v in stage.values()),
                         "largest_op_share": softmax_working_bytes(model, p["micro_batch_size"], p["seq_len"])
                         / capacity,
                         "paper_largest_op_share": softmax_working_bytes(
                             model, int(est["micro_batch_size"].iloc[0]), int(est["seq_len"].iloc[0]))
                         / paper_capacity,
                         "update_op_share": adamw_update_bytes(model) / capacity,
                         "zero_sequence_share": sequence["activations"] / capacity,
                         "ssd_floor_bytes": one["peak_bytes"] - (1 - CUDA_HEADROOM_FRACTION) * capacity})
    return pd.DataFrame(rows)


def point_comparison(runs: pd.DataFrame, measured: pd.DataFrame, paper: pd.DataFrame,
                     conf_dir: Path = CONF_DIR) -> pd.DataFrame:
    """Per measured point (model, batch, micro-batch, sequence): M (median over the ok runs)
    and the persistent share at the un-offloaded peak (median over the runs with a trace,
    :func:`measured_frame`) as measured, beside the
    paper's M and the persistent share estimated for the paper configuration the point
    stands for (:func:`paper_point_of`; both stages of :func:`paper_frame`). No row for a
    point where no run is ok (every TeraIO run failed, some after tracing their step)."""
    keys = ["model", "batch_size", "micro_batch_size", "seq_len"]
    columns = [*keys, "measured_m", "measured_persistent", "paper_model", "paper_point", "paper_m",
               "paper_persistent_stage0", "paper_persistent_stage1"]
    ok = runs[~runs["failed"] & runs["memory_pressure"].notna()]
    rows = []
    for key, g in ok.groupby(keys, sort=True):
        point = dict(zip(keys, key))
        m = measured[(measured["model"] == point["model"]) & (measured["config"].isin(g["config"]))
                     & (measured["micro_batch_size"] == point["micro_batch_size"])]
        row = {**point, "measured_m": 100 * float(g["memory_pressure"].median()),
               "measured_persistent": float(m["persistent_at_peak"].median()) if len(m) else float("nan"),
               "paper_model": None, "paper_point": None, "paper_m": float("nan"),
               "paper_persistent_stage0": float("nan"), "paper_persistent_stage1": float("nan")}
        match = paper_point_of(*key, conf_dir=conf_dir)
        if match is not None:
            est = paper[(paper["model"] == match[0]) & (paper["point"] == match[1])]
            row.update(paper_model=match[0], paper_point=match[1])
            if len(est):
                row["paper_m"] = float(est["paper_m"].iloc[0])
                for _, e in est.iterrows():
                    row[f"paper_persistent_stage{int(e['stage'])}"] = float(e["persistent_share"])
        rows.append(row)
    return pd.DataFrame(rows, columns=columns)
