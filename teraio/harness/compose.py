"""A composed Hydra point → the worker's :class:`~teraio.config.RunConfig`: the resolvers
the experiment configs use, the memory estimate behind ``${capacity_for_pressure:...}``,
and the expansion of a multirun into its points' overrides."""
from __future__ import annotations

import itertools
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from teraio.config import ModelConfig, RunConfig, WorkloadConfig, run_config_from_dict

RUN_KEYS = ("model", "workload", "system", "hardware", "trial", "seed", "timeout_s")
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the repository's conf/


def estimate_unoffloaded_peak_bytes(model: ModelConfig, workload: WorkloadConfig) -> int:
    """Estimated peak device memory (bytes) of one training step with nothing offloaded, on
    CUDA, on one GPU: :func:`teraio.workload.models.pipeline_estimate` with one stage and one
    micro-batch in flight (FP32 weights, gradients and AdamW's two states, 16 bytes per
    distinct parameter, plus the micro-batch's activations, attention probabilities and
    logits, and one attention softmax's transient bytes where they exceed the logits). An
    estimate: the measured peak of a run is in its row (Ideal's
    ``peak_allocated_bytes``, TeraIO's ``unoffloaded_peak_bytes``).
    """
    from teraio.workload.models import pipeline_estimate

    (one,) = pipeline_estimate(model, workload.micro_batch_size, workload.seq_len, n_micro=1, stages=1)
    return one["peak_bytes"]


def capacity_for_pressure(model: DictConfig, workload: DictConfig, m_percent: float | None,
                          micro_batch_size: int | None = None) -> int | None:
    """The GPU capacity (bytes) under which ``model`` at ``workload`` has memory pressure
    M = ``m_percent`` % (paper Fig. 7: M = peak memory / capacity), from
    :func:`estimate_unoffloaded_peak_bytes`; None (no cap: the GPU's own capacity) for a
    null ``m_percent``. ``micro_batch_size``: the micro-batch the point's M is given at, in
    place of the workload's (which a run may override, e.g. ``workload.micro_batch_size=auto``:
    every system of a point then keeps the point's capacity).

    Raises:
        ValueError: ``m_percent`` not above 0.
    """
    if m_percent is None:
        return None
    if not float(m_percent) > 0:
        raise ValueError(f"capacity_for_pressure: M = {m_percent} %; it must be above 0 (or null for no cap)")
    work = OmegaConf.to_container(workload, resolve=True)
    if micro_batch_size is not None:
        work["micro_batch_size"] = int(micro_batch_size)
    run = run_config_from_dict({"model": OmegaConf.to_container(model, resolve=True),
                                "workload": work, "system": {"name": "ideal"}})
    return int(estimate_unoffloaded_peak_bytes(run.model, run.workload) / (float(m_percent) / 100))


ZERO_ACTIVATION_SHARE = 0.5
"""The share of the capacity :func:`zero_micro_batch` lets what one micro-batch holds for
backward take; the rest is for what ZeRO stage 3 keeps beside them (gathered parameters, gradient
buckets, prefetch)."""


def zero_micro_batch(model: DictConfig, workload: DictConfig, capacity_bytes: int | None) -> int | None:
    """The micro-batch a ZeRO baseline trains with under ``capacity_bytes``: the largest divisor
    of the workload's micro-batch whose estimated activations, attention probabilities and
    logits (:func:`teraio.workload.models.micro_batch_bytes`) take at most
    :data:`ZERO_ACTIVATION_SHARE` of it, else 1; None (the workload's) with no capacity. ZeRO
    keeps activations on the device, where TeraIO offloads them; the paper tunes each
    baseline per configuration (§4.1), a choice this stands in for."""
    if capacity_bytes is None:
        return None
    from teraio.workload.models import build_meta_model, ffn_hidden, micro_batch_bytes

    run = run_config_from_dict({"model": OmegaConf.to_container(model, resolve=True),
                                "workload": OmegaConf.to_container(workload, resolve=True),
                                "system": {"name": "ideal"}})
    m, w = run.model, run.workload
    ffn = ffn_hidden(build_meta_model(m, w.seq_len))
    fits = [d for d in range(1, w.micro_batch_size + 1) if w.micro_batch_size % d == 0
            and micro_batch_bytes(m, ffn, d, w.seq_len, m.n_layers) <= ZERO_ACTIVATION_SHARE * int(capacity_bytes)]
    return max(fits, default=1)


def register_resolvers() -> None:
    """OmegaConf resolvers the experiment configs use:

    ``${gb:X}``        X GB (1e9 bytes) as an int of bytes
    ``${take:L,N}``    the first N items of list L (e.g. N of the SSD directories)
    ``${capacity_for_pressure:MODEL,WORKLOAD,M[,MICRO_BATCH]}``  see :func:`capacity_for_pressure`
    ``${zero_micro_batch:MODEL,WORKLOAD,CAPACITY}``  see :func:`zero_micro_batch`
    ``${pipeline_suffix:S}``  ``-ppS`` for S > 1 pipeline stages, else empty (job dir names)
    """
    def take(items, n: int):
        items = list(items)
        if not 0 < n <= len(items):
            raise ValueError(f"${{take:...,{n}}}: only {len(items)} item(s): {items}")
        return items[:n]

    OmegaConf.register_new_resolver("gb", lambda x: int(round(float(x) * 1e9)), replace=True)
    OmegaConf.register_new_resolver("take", take, replace=True)
    OmegaConf.register_new_resolver("capacity_for_pressure", capacity_for_pressure, replace=True)
    OmegaConf.register_new_resolver("zero_micro_batch", zero_micro_batch, replace=True)
    OmegaConf.register_new_resolver("pipeline_suffix", lambda s: f"-pp{int(s)}" if int(s) > 1 else "",
                                    replace=True)


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


def compose_run_config(overrides: list[str], conf_dir: Path = CONF_DIR) -> RunConfig:
    """One run's config composed from ``conf_dir``'s ``config.yaml`` with ``overrides``, as
    one point of ``python -m teraio.sweep OVERRIDES`` would be (``+experiment=fig7_h200
    model=llama3_8b``, ``system=teraio_mixed hardware=h200 workload.batch_size=1``), the
    resolvers registered (:func:`register_resolvers`); :func:`run_config` of it. For tools
    outside the sweep that run or size a point: their configs come from ``conf/`` too.

    Raises:
        hydra.errors.ConfigCompositionException: an override Hydra refuses (an unknown key
            or group option); ValueError: what :func:`run_config` refuses. Either names it.
    """
    register_resolvers()
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return run_config(compose("config", overrides=list(overrides)))


def launch_dir() -> Path:
    """The directory ``python -m teraio.sweep`` was started in (Hydra's original working
    directory; ``hydra.job.chdir=true`` moves each job into its job dir)."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.cwd)
    return Path.cwd()


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
