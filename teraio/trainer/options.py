"""``system.options`` of the TeraIO systems (``teraio_ssd``, ``teraio_mixed``): one dataclass,
a docstring under each field (``conf/system/teraio_ssd.yaml`` sets every one at its default).

All are optional. A bad key or value is a ValueError naming it and what is valid, raised
before anything runs (the sweep's checks call :func:`check_options` through the registry,
``teraio.systems``; the runner reads them again from the resolved config).
"""
from __future__ import annotations

import dataclasses

import torch

from teraio import systems
from teraio.config import dataclass_from_dict
from teraio.core.planner import BENEFITS
from teraio.perf.choose import is_host_arena
from teraio.perf.retime import COPY_ORDERS, TAIL_OFFLOADS

PENDING_LIMITS: tuple[str, ...] = ("off", "capacity", "plan")
"""The valid ``pending_limit`` values."""

CUDA_HEADROOM_FRACTION = 0.08
"""Default ``headroom_fraction`` on CUDA: the share of the capacity kept out of the plan and
the pager (on CPU: none)."""


@dataclasses.dataclass
class TeraIOOptions:
    """What a TeraIO run may be told besides the workload and the machine."""

    benefit: str = "pressure"
    """Algorithm 1's ranking of offload candidates (``teraio.core.planner``): ``"pressure"``,
    the area of memory pressure above capacity that offloading removes (the paper's prose,
    Fig. 6b), or ``"formula"``, the benefit as printed in Algorithm 1."""

    min_tensor_bytes: int = 1 << 20
    """Smallest tensor considered for offloading by the plan, and for eviction by the pager
    of the steps before the plan (``teraio.core.pager``), bytes (default 1 MiB)."""

    headroom_fraction: float | None = None
    """Fraction of the capacity kept out of the plan and the pager for allocator rounding,
    fragmentation and workspaces, in [0, 1); None: :data:`CUDA_HEADROOM_FRACTION` on CUDA,
    0.0 on CPU (:meth:`headroom`)."""

    io_threads: int = 4
    """I/O threads of the SSD tier (``teraio.core.tiers.ssd.SSDTier``), >= 1; they also measure
    the null bandwidths (``teraio.core.probe``)."""

    allow_stalls: bool = True
    """When bandwidth cannot hide enough migrations, still bring the peak under capacity with
    migrations the engine stalls for (paper §3.2: the runtime stalls kernels until memory is
    freed); false: such a plan falls short and the run stops before its first planned step."""

    device_waits: bool = True
    """Host-tier transfers on a CUDA device ordered on the compute stream (CUDA events)
    instead of blocking the training thread (``teraio.core.engine``)."""

    pending_limit: str = "off"
    """With ``device_waits``, whether the host waits for offload copies to keep the memory
    they still hold under the device's capacity (``teraio.core.pending``): an offloaded
    storage is freed as its op is issued, but the caching allocator can reuse its bytes only
    once the copy ran on the GPU, which runs behind the host; where a request finds no room the
    allocator syncs the device and releases its whole cache. ``"off"``: no wait (the allocator
    syncs where it must); ``"capacity"``: before each op, the plan's live bytes there plus the
    bytes of freed storages whose copies may still run are held under the device's capacity
    (the rows' ``pending_waits``); ``"plan"``: under the capacity less headroom, what the plan
    was made for. It acts only where host-tier copies are stream-ordered (``device_waits`` on a
    CUDA device; TeraIO-Mixed). Default ``"off"``, by measurement: on an H100 ``"plan"`` waited
    6-10 times a step, the allocator retried as often, and tokens/s did not change
    (``runs/reference/h100/allocator_settings/pending_limit/``)."""

    release_grads: bool = True
    """Free each gradient right after its last use in the optimizer step and plan for it
    (``Trace.with_released_grads``, ``teraio.core.engine``); false: ``param.grad`` holds every
    gradient through the step."""

    replan_on_drift: bool = True
    """When a step's shape differs from the profiled one's (``workload.seq_len_schedule``),
    hand the engine's tensors back to a pager, profile that step and plan again (counted in
    the row's ``replans``); false: the step fails with ``PlanDriftError``."""

    host_arena: bool | str = "auto"
    """How the host tier holds its tensors (only TeraIO-Mixed has one): true, one region with
    a byte offset per tensor (``teraio.core.slots.HostArena``); false, slots shared by tensors
    whose periods never overlap; ``"auto"``, both planned and the region kept where it
    simulates more than 2 % faster (``teraio.perf.choose.REGION_MARGIN``)."""

    recompute: str | bool = "auto"
    """Whether the plan may drop a tensor and make it again from resident inputs instead of
    moving it (the planner's third option beside the tiers, ``teraio.core.recompute``; run by
    the engine, ``teraio.core.rerun``): ``"off"`` (YAML's bare ``off``, false, too), ``"on"``
    (YAML's bare ``on``, true), or ``"auto"``: planned without and with the option and the
    plan with it kept where it simulates more than 2 % faster (``teraio.perf.choose``). In a
    sweep, ``"auto"`` (and ``host_arena``'s, and ``workload.micro_batch_size=auto``) is decided
    once per point, by its first trial, and its other trials run with that choice
    (:func:`decision`, ``teraio.harness.tune.decided``). The default is ``"auto"``, chosen
    by simulation of the committed H200 traces: it shortens the Granite-8B cut's iterations
    and keeps the plan without recompute at the Llama3-8B cut's points
    (``benchmarks/results/schedule_h200_traces.json``); and by measurement beside ``"off"``
    on an H100 at the Granite-8B cut (``benchmarks/results/recompute_h100.json``)."""

    host_update: str | bool = "off"
    """Whether the plan may run the AdamW update of parameters in host memory, their optimizer
    state kept there, instead of carrying that state to the GPU and back every step or keeping
    it on the GPU (beyond the paper, as ZeRO-Offload and torchao's CPU offload do for every
    parameter; any parameter updated with a gradient is a candidate;
    ``teraio.core.host_update``): ``"off"`` (YAML's bare ``off``, false, too), ``"on"`` (the
    parameter groups that simulate fastest, ``teraio.perf.choose.plan_host_update``) or
    ``"auto"`` (those, kept where they simulate more than 2 % faster than the plan without).
    TeraIO-Mixed only (it needs the host tier); the host's AdamW rate is measured at the run's
    start (the row's ``host_update_gbps``). Default ``"off"``: the paper's TeraIO moves the
    state; the default changes only by measurement on a GPU."""

    host_update_groups: int | None = None
    """With ``host_update`` on: how many parameter groups (a block, or a top-level module) the
    plan updates in host memory, the first of ``teraio.perf.choose.plan_host_update``'s
    ranking; None (YAML's ``null``): the number that simulates fastest. In a sweep the
    point's first trial decides it and its other trials take it (``decision``), so that
    every trial runs the same plan."""

    copy_order: str = "fifo"
    """In what order the host tier's copies are launched (TeraIO-Mixed; beyond the paper):
    ``"fifo"``, where the planner put them; ``"deadline"``, each moved to the op where an
    earliest-deadline-first link would start it and those of one op in the order their waits
    come (``teraio.perf.retime``), kept where it simulates no slower (the row's
    ``plan.copy_order`` says which was kept and both simulated iterations). Default
    ``"fifo"``; it changes only by measurement on a GPU."""

    tail_offloads: str = "next_step"
    """Where the offloads still copying at a step's end are launched (beyond the paper):
    ``"in_step"``, where the planner put them, so that the sync that ends a measured step
    waits for them; ``"next_step"``, those whose window crosses the step boundary launched
    after the step's last op, which the engine does as the next step starts
    (``teraio.perf.retime``'s ``defer_tail_offloads``; the row's ``plan.tail_offloads``
    counts them). Default ``"next_step"``, chosen by simulation of the committed TeraIO-Mixed
    runs with each step ending in a device sync (``simulate``'s ``step_sync``, within 5 % of
    what the H100 Llama3-8B cut runs measured): up to 7 % faster, none more than 0.002 %
    slower (``benchmarks/results/tail_offloads/``)."""

    def __post_init__(self) -> None:
        bad = []
        if self.copy_order not in COPY_ORDERS:
            bad.append(f"copy_order={self.copy_order!r}; valid: {', '.join(COPY_ORDERS)}")
        if self.pending_limit not in PENDING_LIMITS:
            bad.append(f"pending_limit={self.pending_limit!r}; valid: {', '.join(PENDING_LIMITS)}")
        if self.tail_offloads not in TAIL_OFFLOADS:
            bad.append(f"tail_offloads={self.tail_offloads!r}; valid: {', '.join(TAIL_OFFLOADS)}")
        if isinstance(self.host_update, bool):
            self.host_update = "on" if self.host_update else "off"
        if self.host_update not in ("off", "on", "auto"):
            bad.append(f"host_update={self.host_update!r}; valid: off, on or auto")
        if self.host_update_groups is not None and (isinstance(self.host_update_groups, bool)
                                                    or not isinstance(self.host_update_groups, int)
                                                    or self.host_update_groups < 1):
            bad.append(f"host_update_groups={self.host_update_groups!r}; valid: null or an integer >= 1")
        elif self.host_update_groups is not None and self.host_update != "on":
            bad.append(f"host_update_groups={self.host_update_groups!r} with host_update={self.host_update!r}; "
                       "valid: null, or a number with host_update=on")
        if isinstance(self.recompute, bool):
            self.recompute = "on" if self.recompute else "off"
        if self.recompute not in ("off", "on", "auto"):
            bad.append(f"recompute={self.recompute!r}; valid: off, on or auto")
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

    def headroom(self, device: torch.device) -> float:
        """``headroom_fraction``, or its default on ``device`` where null."""
        if self.headroom_fraction is not None:
            return self.headroom_fraction
        return CUDA_HEADROOM_FRACTION if device.type == "cuda" else 0.0

    def stream_frees(self, device: torch.device) -> bool:
        """Whether the engine frees a host-tier offload's storage as soon as its op is issued,
        the caching allocator holding the memory until the copy ran (``device_waits`` on a
        CUDA device; ``teraio.perf.simulator.simulate``'s ``stream_frees``)."""
        return self.device_waits and device.type == "cuda"

    def planner_options(self) -> dict:
        """The options passed through to ``teraio.perf.choose.plan_fastest`` as keyword
        arguments (the run adds what the machine sets: capacity, bandwidths, tier room)."""
        return {"benefit": self.benefit, "min_tensor_bytes": self.min_tensor_bytes,
                "allow_stalls": self.allow_stalls, "host_arena": self.host_arena,
                "recompute": "auto" if self.recompute == "auto" else self.recompute == "on"}


def check_options(system: str, options: dict) -> None:
    """``system.options`` of a TeraIO system (``teraio.systems``). Raises ValueError naming
    an unknown key or a bad value, or a host update asked of a system without a host tier."""
    opts = dataclass_from_dict(TeraIOOptions, options, f"system.options ({system})")
    if opts.host_update != "off" and not systems.get(system).host_tier:
        raise ValueError(f"system.options.host_update={opts.host_update!r}: {system} has no host tier to keep the "
                         "optimizer state in; valid: off (or run teraio_mixed)")


def undecided(run) -> list[str]:
    """The choices a TeraIO run of ``run``'s point makes from its own profile: ``recompute`` and
    ``host_arena`` where ``"auto"``, ``host_update`` and ``host_update_groups`` where
    ``host_update`` is ``"auto"``, or ``"on"`` without ``host_update_groups``,
    ``workload.micro_batch_size`` where ``"auto"`` (the registry's ``decider``,
    ``teraio.systems``)."""
    opts = dataclass_from_dict(TeraIOOptions, run.system.options, f"system.options ({run.system.name})")
    hosting = opts.host_update == "auto" or (opts.host_update == "on" and opts.host_update_groups is None)
    return ([k for k in ("recompute", "host_arena") if getattr(opts, k) == "auto"]
            + (["host_update", "host_update_groups"] if hosting else [])
            + (["workload.micro_batch_size"] if run.workload.micro_batch_size == "auto" else []))


def decision(row: dict) -> tuple[dict, dict]:
    """The settings that make an ok TeraIO row's choices again, as ``(system.options,
    workload)`` keys: ``recompute`` ``"on"`` where its plan recomputes, else ``"off"`` (a plan
    made with the option that recomputes nothing is the plan without it); ``host_arena``, the
    packing its plan kept; ``host_update`` ``"on"`` with ``host_update_groups`` (the groups
    its plan hosted) where its plan updates parameters in host memory, else ``"off"``; the
    micro-batch it chose where it searched
    (``teraio.trainer.microbatch``; its row's ``micro_batch``).

    Raises:
        ValueError: the row is not ok or has no plan.
    """
    plan = row.get("plan")
    if row.get("status") != "ok" or not plan:
        raise ValueError(f"a decision needs an ok row with its plan; this one is {row.get('status')!r}")
    workload = {"micro_batch_size": row["micro_batch"]["chosen"]} if row.get("micro_batch") else {}
    # rows made before the recompute option or the region have neither: their plans had neither
    hosted = plan.get("host_update") or {}
    update = ({"host_update": "on", "host_update_groups": hosted["variants"][hosted["kept"]]["groups"]}
              if hosted.get("params") else {"host_update": "off"})
    return ({"recompute": "on" if plan.get("recomputes") else "off", "host_arena": bool(plan.get("host_arena")),
             **update}, workload)
