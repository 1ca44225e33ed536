"""Run configuration as dataclasses: what a worker reads from ``<job dir>/resolved.yaml``.

The sweep (``teraio.sweep``) composes these from Hydra YAML under ``conf/``; workers never
import Hydra, they call :func:`load_run_config` on the resolved file. Units: bytes for
memory, GB/s (1e9 bytes per second) for bandwidth, seconds for time.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from teraio import systems

MODEL_FAMILIES: tuple[str, ...] = ("llama3", "granite")


@dataclasses.dataclass
class ModelConfig:
    """Transformer shape. ``family="llama3"`` is torchtitan's Llama3; ``"granite"`` adds
    attention/MLP biases and tied embeddings (Granite-code-base-8B).

    ``ffn_hidden_dim``: explicit FFN width; null derives it the torchtitan way from
    ``dim``, ``multiple_of`` and ``ffn_dim_multiplier``.
    """

    name: str
    family: str = "llama3"
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int | None = None
    vocab_size: int = 2048
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    ffn_hidden_dim: int | None = None
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    attn_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.family not in MODEL_FAMILIES:
            raise ValueError(f"model.family={self.family!r}; valid: {MODEL_FAMILIES}")


@dataclasses.dataclass
class WorkloadConfig:
    """Global batch (sequences), micro-batch, sequence length (tokens), steps.

    ``pipeline_stages``: 1 trains the whole model in one process; S > 1 splits its blocks
    over S processes, one stage each, run as a 1F1B pipeline (``teraio.workload.pipeline``;
    paper §4.1: 2 stages, one per GPU), each stage profiled, planned and migrated on its own
    by TeraIO.

    ``seq_len_schedule``: the sequence length of steps 0, 1, 2, ... (the last value holds
    for every later step); empty: ``seq_len`` throughout. Each value is at most ``seq_len``,
    which sizes the model (its RoPE table). A TeraIO run profiles and plans again where
    the length changes (``system.options.replan_on_drift``).
    """

    batch_size: int = 2
    micro_batch_size: int | str = 1
    """Sequences per micro-batch, a divisor of ``batch_size``; or ``"auto"``: TeraIO picks the
    divisor whose planned iteration simulates shortest (``teraio.trainer.microbatch``; one
    stage only; other systems refuse it)."""
    seq_len: int = 64
    warmup_steps: int = 2
    measure_steps: int = 3
    lr: float = 1e-4
    seq_len_schedule: list[int] = dataclasses.field(default_factory=list)
    pipeline_stages: int = 1

    def __post_init__(self) -> None:
        for key, least in (("batch_size", 1), ("seq_len", 1), ("warmup_steps", 0), ("measure_steps", 1),
                           ("pipeline_stages", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"workload.{key}={value!r}; valid: an integer >= {least}")
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not self.lr >= 0:
            raise ValueError(f"workload.lr={self.lr!r}; valid: a number >= 0")
        if self.micro_batch_size == "auto":
            if self.pipeline_stages != 1:
                raise ValueError(f"workload.micro_batch_size=auto with workload.pipeline_stages="
                                 f"{self.pipeline_stages}: the choice is for one stage; name a divisor of "
                                 f"batch_size={self.batch_size}")
        elif (not isinstance(self.micro_batch_size, int) or isinstance(self.micro_batch_size, bool)
              or self.micro_batch_size <= 0):
            raise ValueError(f"workload.micro_batch_size={self.micro_batch_size!r}; valid: a divisor of "
                             f"batch_size={self.batch_size}, or auto")
        elif self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"workload.batch_size={self.batch_size} is not divisible by "
                f"workload.micro_batch_size={self.micro_batch_size}; pick a divisor")
        bad = [v for v in self.seq_len_schedule if not 0 < v <= self.seq_len]
        if bad:
            raise ValueError(f"workload.seq_len_schedule={list(self.seq_len_schedule)}: {bad[0]} is not in "
                             f"1..workload.seq_len={self.seq_len}")

    def seq_len_at(self, step: int) -> int:
        """The sequence length of ``step`` (tokens)."""
        if not self.seq_len_schedule:
            return self.seq_len
        return self.seq_len_schedule[min(step, len(self.seq_len_schedule) - 1)]

    def tokens_at(self, step: int) -> int:
        """Tokens trained in ``step``."""
        return self.batch_size * self.seq_len_at(step)

    def shape_at(self, step: int) -> dict:
        """``step``'s workload shape, the keys a migration plan depends on."""
        return {"batch_size": self.batch_size, "micro_batch_size": self.micro_batch_size,
                "seq_len": self.seq_len_at(step)}

    @property
    def grad_accum_steps(self) -> int:
        if self.micro_batch_size == "auto":
            raise ValueError("workload.micro_batch_size=auto: the micro-batches per step are known once "
                             "TeraIO has chosen (teraio.trainer.microbatch)")
        return self.batch_size // self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclasses.dataclass
class SystemConfig:
    """Which system trains, and its options (free-form per system, documented in
    ``conf/system/<name>.yaml``)."""

    name: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        systems.get(self.name)  # ValueError naming the valid names


CAPACITY_MODES = ("fraction", "reserve")
"""The valid ``hardware.capacity_mode`` values (``teraio.systems.memory_cap``)."""


def check_capacity_mode(mode: str) -> None:
    """Raises ValueError naming ``mode`` and the valid ones unless it is one of
    :data:`CAPACITY_MODES`."""
    if mode not in CAPACITY_MODES:
        raise ValueError(f"hardware.capacity_mode={mode!r}; valid: {', '.join(CAPACITY_MODES)}")


@dataclasses.dataclass
class HardwareConfig:
    """The machine to emulate.

    ``gpu_capacity_bytes``: cap on device memory (null: uncapped). ``capacity_mode``: how
    the cap is held, ``fraction`` (the caching allocator's own limit) or ``reserve`` (the
    memory past it taken up front; ``teraio.systems.memory_cap`` says how they differ). The
    default is ``fraction``: on an H100 the two ran TeraIO-Mixed at the same speed with the
    same allocator retries (``runs/reference/h100/allocator_settings/COMMAND.md``).
    ``ssd_dirs``: one directory per drive. Bandwidths are GB/s per direction, the SSD ones per drive; null:
    measured on the machine that runs (``teraio.core.probe``; the SSD ones then over all the
    drives together). ``prices``: USD, for the cost table.
    """

    name: str = "cpu"
    device: str = "cpu"
    n_gpus: int = 1
    gpu_capacity_bytes: int | None = None
    capacity_mode: str = "fraction"
    ssd_dirs: list[str] = dataclasses.field(default_factory=lambda: ["/tmp/teraio_ssd"])
    ssd_write_gbps: float | None = 2.0
    ssd_read_gbps: float | None = 1.6
    host_mem_cap_bytes: int = 0
    host_d2h_gbps: float | None = 37.0
    host_h2d_gbps: float | None = 55.0
    prices: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_capacity_mode(self.capacity_mode)  # ValueError naming the valid modes


@dataclasses.dataclass
class RunConfig:
    model: ModelConfig
    workload: WorkloadConfig
    system: SystemConfig
    hardware: HardwareConfig
    trial: int = 0
    seed: int = 0
    timeout_s: float = 3600.0

    def point(self) -> dict:
        """The keys that identify this run in result rows (see ``teraio.result``)."""
        return {"model": self.model.name, "system": self.system.name, "hardware": self.hardware.name,
                "batch_size": self.workload.batch_size,
                "micro_batch_size": self.workload.micro_batch_size,
                "seq_len": self.workload.seq_len, "trial": self.trial}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def dataclass_from_dict(cls, d: dict | None, where: str):
    """``cls(**d)``, but an unknown key is a ValueError naming ``where``, the key and the
    valid keys."""
    d = dict(d or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {sorted(names)}")
    return cls(**d)


def run_config_from_dict(d: dict) -> RunConfig:
    """Build a :class:`RunConfig`, naming any unknown key and the valid ones."""
    top = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(d) - top)
    if unknown:
        raise ValueError(f"run config: unknown key(s) {unknown}; valid: {sorted(top)}")
    return RunConfig(
        model=dataclass_from_dict(ModelConfig, d.get("model"), "model"),
        workload=dataclass_from_dict(WorkloadConfig, d.get("workload"), "workload"),
        system=dataclass_from_dict(SystemConfig, d.get("system"), "system"),
        hardware=dataclass_from_dict(HardwareConfig, d.get("hardware"), "hardware"),
        **{k: d[k] for k in ("trial", "seed", "timeout_s") if k in d},
    )


def load_run_config(path: str | Path) -> RunConfig:
    return run_config_from_dict(yaml.safe_load(Path(path).read_text()))
