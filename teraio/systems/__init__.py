"""The registry of training systems: the one place that lists them (paper §4.1: Ideal,
TeraIO-SSD, TeraIO-Mixed, ZeRO-Offload, ZeRO-Infinity; beyond the paper, what users switch
on today: Ideal with activation checkpointing, FSDP2's CPU offload, torchao's CPU optimizer). Everything else — config
validation, the worker, the sweep's checks, the analysis' labels, order and cost model —
asks it.

A system is a :class:`SystemSpec`: its runner (a module with ``run(cfg, job_dir, device)``,
the contract below), its options check (``"module:function"`` taking the
``system.options`` dict, raising ``ValueError`` on a bad key or value; it gets the name
too), and what it needs from the machine.
Runner and check are named, not imported, so that a system whose module is broken fails
its own points only.

More systems come from the modules named in the environment variable
``TERAIO_SYSTEM_MODULES`` (comma-separated), imported on the first lookup; each calls
:func:`register`. Workers inherit the variable, so a system registered that way runs
end to end (its Hydra group file, ``conf/system/<name>.yaml``, can live in a directory
added with ``hydra.searchpath``).

The runner contract, ``run(cfg, job_dir, device) -> teraio.result.Measurements``:

* ``cfg`` is the point's ``teraio.config.RunConfig``, ``job_dir`` its directory (side files
  go there, named in ``Measurements.artifacts``), ``device`` the ``torch.device`` to train on;
* it trains the point, its steps run by the shared loop (``teraio.systems.loop.measure_steps``:
  timing, progress lines, the non-finite loss check), and returns what it measured; it
  never writes the row, which the worker makes from that (``teraio.result.result_row``);
* it raises on failure (``torch.OutOfMemoryError`` makes an ``oom`` row, anything else an
  ``error`` row); what it had measured by then is kept in the row when it raised inside
  ``teraio.result.kept_on_failure``;
* a return with no iteration, or a loss or tokens/s that is not finite, is an ``error`` row.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class SystemSpec:
    """One training system.

    Attributes:
        name: ``system.name``.
        display: its label in tables and figures.
        runner: module defining ``run(cfg, job_dir, device) -> teraio.result.Measurements``
            (the contract above).
        check_options: ``"module:function"``; the function takes the system's name and
            its ``system.options`` dict and raises ``ValueError`` naming a bad key or value.
        uses_drives: it moves data through ``hardware.ssd_dirs`` (directories checked
            before the sweep; one such run per drive at a time).
        host_tier: it offloads to host memory under ``hardware.host_mem_cap_bytes`` (which
            must then be > 0).
        cost_server: the server of the cost model it is priced on
            (``analysis.cost``; None: not priced).
        role: ``"teraio"`` (the paper's system), ``"baseline"`` (an offloading system
            TeraIO is compared with: the speedup tables) or ``"ideal"`` (the reference
            without offloading).
        legend_rank: place in tables and figures (the paper's Fig. 7 legend order);
            registration order breaks ties.
        pipeline: it trains ``workload.pipeline_stages`` > 1 (its runner builds its stage
            with ``teraio.workload.pipeline.build_training``).
        tuner: ``"module:function"`` taking the point's ``teraio.config.RunConfig`` and
            returning its candidate settings (a non-empty list of dicts of ``system.options``
            keys), which the sweep measures before the point's trials, keeping the fastest
            (``teraio.harness.tune``); None: the system is not tuned.
        decider: module (dotted path) of a system that makes choices from its own profile
            (``"auto"`` options): it defines ``undecided(run) -> list[str]``, the choices a
            run of the point would make, and ``decision(row) -> (options, workload)``, the
            settings that make a finished row's choices again. The point's first trial makes
            them, the rest of its trials and later sweeps run with them
            (``teraio.harness.tune.decided``); None: nothing to decide.
        check_drives: ``"module:function"`` taking the point's ``teraio.config.RunConfig``
            and raising ``ValueError`` where its drives lack what it needs (room), run by the
            sweep before any point runs (``teraio.harness.checks.validate``); None: nothing
            beyond the directories' own checks.
        cuda_only: it runs on a CUDA device only (the sweep refuses a point on another
            device before anything runs: ``teraio.harness.checks.validate``).
        paper: one of the paper's systems (§4.1); False for those beyond its comparison.
            The speedup summary's series (``analysis.aggregate.speedup_summary``: the
            paper's "ZeRO series") takes the paper's baselines only.
    """

    name: str
    display: str
    runner: str
    check_options: str
    uses_drives: bool = False
    host_tier: bool = False
    cost_server: str | None = None
    role: str = "baseline"
    legend_rank: int = 100
    pipeline: bool = False
    tuner: str | None = None
    decider: str | None = None
    check_drives: str | None = None
    cuda_only: bool = False
    paper: bool = True


# In the paper's order of comparison (§4.1); legend_rank gives its Fig. 7 legend order.
_BUILT_IN = (
    SystemSpec("zero_offload", "ZeRO-Offload", "baselines.zero", "baselines.zero:check_options",
               cost_server="server_1tb", legend_rank=1, tuner="baselines.zero:tuning_candidates"),
    SystemSpec("zero_infinity", "ZeRO-Infinity", "baselines.zero", "baselines.zero:check_options",
               uses_drives=True, cost_server="server_1tb", legend_rank=0,
               tuner="baselines.zero:tuning_candidates", check_drives="baselines.zero:check_swap_room"),
    SystemSpec("teraio_ssd", "TeraIO-SSD", "teraio.trainer.runner", "teraio.trainer.options:check_options",
               uses_drives=True, cost_server="server_base", role="teraio", legend_rank=2, pipeline=True,
               decider="teraio.trainer.options"),
    SystemSpec("teraio_mixed", "TeraIO-Mixed", "teraio.trainer.runner", "teraio.trainer.options:check_options",
               uses_drives=True, host_tier=True, cost_server="server_1tb", role="teraio", legend_rank=3,
               pipeline=True, decider="teraio.trainer.options"),
    SystemSpec("ideal", "Ideal", "baselines.ideal", "baselines.ideal:check_options", role="ideal",
               legend_rank=4, pipeline=True),
    # What users switch on today instead (beyond the paper's comparison): torchtitan's
    # activation checkpointing, FSDP2's CPU offload, torchao's CPU-offloaded optimizer.
    SystemSpec("ideal_ac", "Ideal+AC", "baselines.ideal_ac", "baselines.ideal_ac:check_options",
               cost_server="server_base", legend_rank=5, paper=False,
               tuner="baselines.ideal_ac:tuning_candidates"),
    SystemSpec("fsdp_offload", "FSDP2-Offload", "baselines.fsdp_offload",
               "baselines.fsdp_offload:check_options", cost_server="server_1tb", legend_rank=6,
               paper=False),
    SystemSpec("torchao_offload", "torchao-Offload", "baselines.torchao_offload",
               "baselines.torchao_offload:check_options", cost_server="server_1tb", legend_rank=7,
               cuda_only=True, paper=False, tuner="baselines.torchao_offload:tuning_candidates"),
)


class Registry:
    """Systems by name, in registration order; plugins loaded on first use."""

    def __init__(self, specs=_BUILT_IN, env: str = "TERAIO_SYSTEM_MODULES"):
        self._specs: dict[str, SystemSpec] = {s.name: s for s in specs}
        self._env = env
        self._plugins_loaded = False

    def register(self, spec: SystemSpec) -> SystemSpec:
        """Add ``spec``. Raises ValueError if its name is taken."""
        if spec.name in self._specs:
            raise ValueError(f"system {spec.name!r} is already registered")
        self._specs[spec.name] = spec
        return spec

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for module in filter(None, (m.strip() for m in os.environ.get(self._env, "").split(","))):
            importlib.import_module(module)

    def names(self) -> tuple[str, ...]:
        self._load_plugins()
        return tuple(self._specs)

    def legend_order(self) -> tuple[str, ...]:
        """Names in the order tables and figures show them (``legend_rank``)."""
        names = self.names()
        return tuple(sorted(names, key=lambda n: (self._specs[n].legend_rank, names.index(n))))

    def with_role(self, role: str) -> tuple[str, ...]:
        """Names of the systems of ``role``, in registration order."""
        return tuple(n for n in self.names() if self._specs[n].role == role)

    def get(self, name: str) -> SystemSpec:
        """The spec of ``name``. Raises ValueError naming the valid names."""
        self._load_plugins()
        if name not in self._specs:
            raise ValueError(f"system.name={name!r}; valid: {self.names()}")
        return self._specs[name]


REGISTRY = Registry()
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names
with_role = REGISTRY.with_role
legend_order = REGISTRY.legend_order


def _named(ref: str) -> Callable:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def check_options(name: str, options: dict) -> None:
    """Check ``system.options`` of system ``name`` (before anything runs).

    Raises:
        ValueError: unknown system, or the system's check refuses a key or value.
    """
    _named(get(name).check_options)(name, options or {})


def check_drives(run) -> None:
    """The check of ``run.system``'s drives (``SystemSpec.check_drives``), where it has one.

    Raises:
        ValueError: unknown system, or the check refuses the drives.
    """
    ref = get(run.system.name).check_drives
    if ref is not None:
        _named(ref)(run)


def load_runner(name: str) -> Callable:
    """The ``run`` function of ``name``'s runner.

    Raises:
        ValueError: unknown system.
        RuntimeError: the runner module (or its ``run``) does not exist in this checkout.
    """
    module_name = get(name).runner
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:  # the runner exists but one of its imports is missing
            raise
        raise RuntimeError(f"runner {module_name} not available: {e} (system {name!r} cannot run "
                           "in this checkout)") from e
    run = getattr(module, "run", None)
    if not callable(run):
        raise RuntimeError(f"runner {module_name} not available: it defines no run() function")
    return run
