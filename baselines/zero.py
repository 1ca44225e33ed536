"""DeepSpeed ZeRO baselines (paper §4.1, Table 4): ``zero_offload`` and ``zero_infinity``.

- ``zero_offload``: ZeRO stage 3 (Table 4: stage=3; or stage 2) with the optimizer state
  and step on the host (``offload_optimizer.device: cpu``, DeepSpeedCPUAdam in AdamW mode)
  and, at stage 3, the parameters in host memory too (``offload_param.device: cpu``): the
  paper's "GPU → CPU memory only" (paper §4.1).
- ``zero_infinity``: ZeRO stage 3 with parameters and optimizer state on NVMe
  (``offload_param``/``offload_optimizer.device: nvme``) through DeepSpeed's ``async_io``
  op, under ``hardware.ssd_dirs[0]``.

Both train the model of :func:`teraio.workload.models.build_model` on the tokens of
:func:`teraio.workload.step.make_batch`, in FP32, with the workload's batch and micro-batch
(gradient accumulation = batch / micro-batch / ranks; ``micro_batch_size`` below may set
a smaller one, as the paper tunes each baseline per configuration, §4.1), no activation
checkpointing, and
AdamW with the hyperparameters of :func:`teraio.workload.step.make_optimizer`. The DeepSpeed
config is generated from ``system.options`` (defaults: :data:`DEFAULTS`, mirrored in
``conf/system/zero_*.yaml``; paper Table 4 plus what DeepSpeed 0.19.8 needs) and saved
as ``<job dir>/deepspeed_config.json``.

``system.options``:
  ``micro_batch_size``       sequences per micro-batch, a divisor of the workload's; null is
                             the workload's. ZeRO keeps a micro-batch's activations on the
                             device, where TeraIO offloads them: under an emulated capacity
                             the point's micro-batch may not fit (the row's
                             ``zero_micro_batch_size`` says which one ran)
  ``stage``                  ZeRO stage (Table 4: 3): 3 or 2 for zero_offload, 3 for
                             zero_infinity
  ``offload_param``          zero_offload: parameters in host memory too; stage 3 only;
                             null is true at stage 3 and false at stage 2
  ``pin_memory``             page-locked host buffers (Table 4: true)
  ``param_persistence_threshold``   stage 3: parameters with fewer elements stay on the
                             device (Table 4: 100K, DeepSpeed's default)
  ``model_persistence_threshold``   stage 3: cap on the elements kept so; null is
                             DeepSpeed's default sys.maxsize (Table 4)
  ``prefetch_bucket_size``   stage 3 ``stage3_prefetch_bucket_size`` (elements); null is
                             DeepSpeed's 5e7: parameter prefetch on (for zero_infinity it
                             overlaps the NVMe reads with compute); 0 turns it off. The
                             swap-buffer assertions once seen with prefetch on come from too
                             few parameter buffers: :func:`check_param_buffers` states the
                             rule and refuses such a setting before DeepSpeed starts
  ``nvme_path``              zero_infinity: swap directory; null is ``hardware.ssd_dirs[0]``
                             (a per-run subdirectory is made there and removed afterwards)
  ``param_buffer_count``     zero_infinity: parameter swap buffers (Table 4: 18); at least
                             what :func:`check_param_buffers` derives from DeepSpeed's swapper
  ``param_buffer_size``      zero_infinity: elements per parameter buffer; null is the
                             largest parameter's element count (Table 4: 300M/540M; it
                             must hold the largest parameter)
  ``optimizer_buffer_count`` zero_infinity: optimizer-state swap buffers (Table 4: 4; default
                             12). DeepSpeed 0.19.8's pipelined swapper takes 4 buffers (FP32
                             partition, exp_avg, exp_avg_sq, gradient) per swap in flight: the
                             current sub-group, plus one read ahead (``pipeline_read``), plus
                             one write behind (``pipeline_write``); with fewer, a model of more
                             than one sub-group fails its first optimizer step ("ran out of
                             swap buffers"). Seen on the H200 with Table 4's 4, reproduced on
                             CPU (``tests/test_zero.py``). Each buffer holds one sub-group
                             (``sub_group_size``, DeepSpeed's default 1e9 elements).
  ``pipeline_read``, ``pipeline_write``  zero_infinity: overlap optimizer-state swapping
                             with the optimizer step (Table 4: true)
  ``aio``                    zero_infinity: DeepSpeed's ``aio`` section (``block_size``
                             bytes, ``queue_depth``, ``intra_op_parallelism`` threads —
                             ``thread_count`` is ignored since DeepSpeed 0.16.4 —,
                             ``single_submit``, ``overlap_events``). Parameters smaller than
                             ``block_size`` bytes (and 1 MiB) stay in host memory.
  ``ds_config``              dict deep-merged last into the generated config (any other
                             DeepSpeed key; the JSON records the result)

Not measured: DeepSpeed exposes neither stalls nor migration time nor bytes moved per
iteration, so ``stall_count``, ``stall_seconds``, ``migration_seconds`` and the byte
counts are null in every iteration.
"""
from __future__ import annotations

import copy
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from baselines.process_group import init_process_group, mean_over_ranks, rank_rows
from teraio.files import SWAP_DIRS, owner_tag, remove_orphans
from teraio.config import RunConfig
from teraio.systems.loop import Step, Steps, measure_steps
from teraio.systems.measure import peak_memory, reset_peak_memory
from teraio.systems.memory_cap import MemoryCap, apply_memory_cap, capacity_unenforced
from teraio.workload.models import build_meta_model, build_model
from teraio.result import Measurements, human_bytes, kept_on_failure
from teraio.workload.step import make_batch, make_optimizer

REPO = Path(__file__).resolve().parents[1]
CONFIG_FILE = "deepspeed_config.json"

_COMMON = {"micro_batch_size": None, "stage": 3, "pin_memory": True, "param_persistence_threshold": 100_000,
           "model_persistence_threshold": None, "prefetch_bucket_size": None, "ds_config": {}}
# AdamW under ZeRO-3 NVMe: FP32 partition, exp_avg, exp_avg_sq and the gradient per swap.
OPTIMIZER_BUFFERS_PER_SWAP = 4

DEFAULTS: dict[str, dict] = {
    "zero_offload": {**_COMMON, "offload_param": None},
    "zero_infinity": {
        **_COMMON, "nvme_path": None,
        "param_buffer_count": 18, "param_buffer_size": None, "optimizer_buffer_count": 12,
        "pipeline_read": True, "pipeline_write": True,
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True}},
}
VALID_STAGES = {"zero_offload": (2, 3), "zero_infinity": (3,)}
ZERO_SYSTEMS = tuple(DEFAULTS)  # the systems this runner serves (teraio.systems)


def use_extensions_dir() -> Path:
    """Point ``TORCH_EXTENSIONS_DIR`` (where DeepSpeed JIT-builds its ops) at the project's
    ``<repo>/.torch_extensions/<pyXY>_<cpu|cuXYZ>`` when unset, and return it. The torch
    build tag keeps a CPU and a CUDA build of the same op apart (torch's own default
    layout). ``scripts/build_ds_ops.py`` builds into the same place."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        cuda = torch.version.cuda
        tag = f"py{sys.version_info.major}{sys.version_info.minor}_" + \
              (f"cu{cuda.replace('.', '')}" if cuda else "cpu")
        os.environ["TORCH_EXTENSIONS_DIR"] = str(REPO / ".torch_extensions" / tag)
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def check_options(system: str, options: dict) -> None:
    """``system.options`` of a ZeRO system (``teraio.systems``): :func:`resolve_options`."""
    resolve_options(system, options)


def resolve_options(system: str, options: dict) -> dict:
    """``options`` over :data:`DEFAULTS` (``aio`` merged key by key), validated.

    Raises:
        ValueError: unknown system or key, a stage the system does not run, a non-positive
            buffer count or micro-batch, ``offload_param`` without stage 3.
    """
    if system not in DEFAULTS:
        raise ValueError(f"system.name={system!r} is not a ZeRO system; valid: {ZERO_SYSTEMS}")
    defaults = DEFAULTS[system]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"system.options: unknown key(s) {unknown} for {system}; "
                         f"valid: {sorted(defaults)}")
    opts = {**copy.deepcopy(defaults), **copy.deepcopy(dict(options))}
    if "aio" in defaults:
        if not isinstance(opts["aio"], dict):
            raise ValueError(f"system.options.aio={opts['aio']!r}; must be a mapping")
        bad = sorted(set(opts["aio"]) - set(defaults["aio"]))
        if bad:
            raise ValueError(f"system.options.aio: unknown key(s) {bad}; valid: {sorted(defaults['aio'])}"
                             + (" (thread_count is ignored since DeepSpeed 0.16.4: use "
                                "intra_op_parallelism)" if "thread_count" in bad else ""))
        opts["aio"] = {**defaults["aio"], **opts["aio"]}
    if opts["stage"] not in VALID_STAGES[system]:
        raise ValueError(f"system.options.stage={opts['stage']!r}; {system} runs ZeRO stage "
                         f"{' or '.join(map(str, VALID_STAGES[system]))}")
    if "offload_param" in opts and opts["offload_param"] is None:
        opts["offload_param"] = opts["stage"] == 3
    if opts.get("offload_param") and opts["stage"] != 3:
        raise ValueError("system.options.offload_param=true needs stage 3 "
                         f"(got stage={opts['stage']}): ZeRO-2 keeps parameters on the device")
    for key in ("param_buffer_count", "optimizer_buffer_count"):
        if key in opts and not (isinstance(opts[key], int) and opts[key] > 0):
            raise ValueError(f"system.options.{key}={opts[key]!r}; must be a positive int")
    if "optimizer_buffer_count" in opts:
        need = OPTIMIZER_BUFFERS_PER_SWAP * (1 + bool(opts["pipeline_read"]) + bool(opts["pipeline_write"]))
        if opts["optimizer_buffer_count"] < need:
            raise ValueError(f"system.options.optimizer_buffer_count={opts['optimizer_buffer_count']}; with "
                             f"pipeline_read={opts['pipeline_read']} and pipeline_write={opts['pipeline_write']} "
                             f"DeepSpeed's optimizer swapper needs at least {need} (4 per swap in flight)")
    mb = opts["micro_batch_size"]
    if mb is not None and not (isinstance(mb, int) and not isinstance(mb, bool) and mb > 0):
        raise ValueError(f"system.options.micro_batch_size={mb!r}; must be a positive int or null "
                         "(the workload's)")
    if not isinstance(opts["ds_config"], dict):
        raise ValueError(f"system.options.ds_config={opts['ds_config']!r}; must be a mapping")
    return opts


def adamw_hyperparameters(lr: float) -> dict:
    """lr, betas, eps, weight_decay of :func:`teraio.workload.step.make_optimizer`, read from the
    torch optimizer itself so the two cannot drift apart."""
    d = make_optimizer(nn.Linear(1, 1), lr).defaults
    return {"lr": d["lr"], "betas": list(d["betas"]), "eps": d["eps"],
            "weight_decay": d["weight_decay"]}


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def micro_batch_size(cfg: RunConfig, opts: dict) -> int:
    """The micro-batch ZeRO trains with: ``opts["micro_batch_size"]`` (resolved options), or the
    workload's. Any divisor of the batch: ZeRO trains the same batch (same tokens per step)
    in ``batch / micro-batch`` accumulation steps (the tuning candidates,
    :func:`tuning_candidates`, may be larger than the point's micro-batch).

    Raises:
        ValueError: it does not divide the workload's batch.
    """
    mb = opts["micro_batch_size"] or cfg.workload.micro_batch_size
    if cfg.workload.batch_size % mb:
        raise ValueError(f"system.options.micro_batch_size={mb} does not divide "
                         f"workload.batch_size={cfg.workload.batch_size}")
    return mb


def deepspeed_config(cfg: RunConfig, opts: dict, largest_param_numel: int, world_size: int = 1,
                     nvme_path: str | None = None) -> dict:
    """The DeepSpeed JSON config for ``cfg`` with resolved ``opts`` (see the module doc).

    Args:
        largest_param_numel: element count of the largest parameter (sizes the NVMe
            parameter buffers).
        world_size: data-parallel ranks; the global batch is split evenly among them.
        nvme_path: zero_infinity's swap directory.

    Raises:
        ValueError: the batch does not split into micro-batches over the ranks, or
            ``param_buffer_size`` is below ``largest_param_numel``.
    """
    w = cfg.workload
    mb = micro_batch_size(cfg, opts)
    if w.batch_size % (mb * world_size):
        raise ValueError(f"workload.batch_size={w.batch_size} is not a multiple of "
                         f"micro_batch_size x ranks = {mb} x {world_size}")
    stage = opts["stage"]
    zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": opts["pin_memory"]}}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=opts["param_persistence_threshold"],
                    stage3_model_persistence_threshold=sys.maxsize if opts["model_persistence_threshold"]
                    is None else opts["model_persistence_threshold"])
        if opts["prefetch_bucket_size"] is not None:
            zero["stage3_prefetch_bucket_size"] = opts["prefetch_bucket_size"]
        if opts.get("offload_param"):
            zero["offload_param"] = {"device": "cpu", "pin_memory": opts["pin_memory"]}
    ds: dict = {
        "train_batch_size": w.batch_size,
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": w.batch_size // (mb * world_size),
        # FP32 throughout (paper §4.1): no fp16/bf16 section.
        "optimizer": {"type": "AdamW", "params": adamw_hyperparameters(w.lr)},
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if cfg.system.name == "zero_infinity":
        buffer_size = opts["param_buffer_size"]
        buffer_size = largest_param_numel if buffer_size is None else buffer_size
        if buffer_size < largest_param_numel:
            raise ValueError(f"system.options.param_buffer_size={buffer_size} is smaller than the "
                             f"largest parameter ({largest_param_numel} elements); use >= "
                             f"{largest_param_numel} or null")
        zero["offload_optimizer"] = {
            "device": "nvme", "nvme_path": nvme_path, "pin_memory": opts["pin_memory"],
            "buffer_count": opts["optimizer_buffer_count"],
            "pipeline_read": opts["pipeline_read"], "pipeline_write": opts["pipeline_write"]}
        zero["offload_param"] = {
            "device": "nvme", "nvme_path": nvme_path, "pin_memory": opts["pin_memory"],
            "buffer_count": opts["param_buffer_count"], "buffer_size": buffer_size}
        ds["aio"] = dict(opts["aio"])
    return _deep_merge(ds, opts["ds_config"])


def param_numels(cfg: RunConfig) -> list[int]:
    """Elements of each parameter of ``cfg``'s model, in ``parameters()`` order (built on the
    meta device: nothing is allocated)."""
    return [p.numel() for p in build_meta_model(cfg.model, cfg.workload.seq_len).parameters()]


DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed's default ``zero_optimization.sub_group_size`` (elements)."""
SWAPPED_PER_SUB_GROUP = 3
"""Files of one size per swapped optimizer sub-group: the FP32 partition and AdamW's two moments."""


def swap_bytes_needed(numels: list[int], ds_config: dict, world: int = 1, local_world: int = 1) -> int:
    """The bytes zero_infinity's swap files take on this host's drive, sized as DeepSpeed
    0.19.8 sizes them (``deepspeed/runtime/swap_tensor/``, ``zero/stage3.py``) for a model
    whose parameters have ``numels`` elements (:func:`param_numels`), trained with
    ``ds_config`` (:func:`deepspeed_config`) on ``world`` ranks, ``local_world`` of them on
    this host, each writing its own files. FP32 throughout (4 B per element); a tensor is
    swapped where it has at least ``max(aio.block_size, 1 MiB)`` bytes, to a file of its
    elements rounded up to the I/O alignment (``1024 x aio.intra_op_parallelism`` bytes):

    * each parameter's partition (``ceil(n / world)`` elements), a file each;
    * the partitions, in order, make optimizer sub-groups of ``sub_group_size`` elements or
      more (the last takes the rest); a swapped sub-group has its FP32 partition and AdamW's
      two moments in a file each, and of each parameter's gradient the part that is a
      multiple of the alignment, where that part is swapped itself (the rest stays in
      memory).
    """
    aio = ds_config["aio"]
    smallest = max(aio["block_size"], 1 << 20) // 4  # elements
    align = 1024 * aio["intra_op_parallelism"] // 4

    def file(n: int) -> int:  # elements on the drive of a tensor of n elements
        return -(-n // align) * align if n >= smallest else 0

    parts = [-(-n // world) for n in numels]
    total = sum(file(n) for n in parts)
    group_size = ds_config["zero_optimization"].get("sub_group_size", DEEPSPEED_SUB_GROUP_SIZE)
    groups: list[list[int]] = [[]]
    for n in parts:
        if sum(groups[-1]) >= group_size:
            groups.append([])
        groups[-1].append(n)
    for group in groups:
        if sum(group) >= smallest:
            total += SWAPPED_PER_SUB_GROUP * file(sum(group))
            total += sum(file(n // align * align) for n in group if n >= smallest)
    return 4 * total * local_world


DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000
"""DeepSpeed's default ``stage3_max_reuse_distance`` (elements)."""


def check_param_buffers(cfg: RunConfig, opts: dict) -> None:
    """Refuse, before DeepSpeed starts, a zero_infinity parameter-buffer setting that its
    swapper (``deepspeed/runtime/swap_tensor/partitioned_param_swapper.py``, 0.19.8) would
    fail an assertion on. Each swapped parameter (:func:`swapped_param_count`) holds one
    buffer of ``param_buffer_size`` elements from its swap-in until DeepSpeed releases it:

    * a buffer holds one parameter: ``param_buffer_size`` >= the largest parameter's
      elements (``get_buffer``: "More elements ... than buffer size"; checked in
      :func:`deepspeed_config`);
    * a module's parameters are swapped in together (``swap_in``: "Not enough buffers"):
      ``param_buffer_count`` >= the most swapped parameters one module owns;
    * once the first step has recorded the module order, a fetched parameter is released
      only if it is not used again within ``stage3_max_reuse_distance`` elements
      (``partitioned_param_coordinator``; DeepSpeed's default 1e9): where the whole model
      has no more elements than that, every swapped parameter stays live from its fetch in
      the forward pass to its use in the backward pass, so ``param_buffer_count`` >= the
      number of swapped parameters. Prefetch (``prefetch_bucket_size`` > 0 or null) swaps
      in ahead only into free buffers, so it asks no more than that.

    Raises:
        ValueError: naming ``param_buffer_count`` and the least it must be.
    """
    if cfg.system.name != "zero_infinity":
        return
    net = build_meta_model(cfg.model, cfg.workload.seq_len)
    smallest = max(opts["aio"]["block_size"], 1 << 20)

    def swapped(p) -> bool:
        return p.numel() >= opts["param_persistence_threshold"] and p.numel() * 4 >= smallest

    per_module = max((sum(swapped(p) for p in m.parameters(recurse=False)) for m in net.modules()), default=0)
    total = sum(p.numel() for p in net.parameters())
    reuse = ((opts["ds_config"].get("zero_optimization") or {}).get("stage3_max_reuse_distance",
                                                                     DEEPSPEED_MAX_REUSE_DISTANCE))
    every = sum(swapped(p) for p in net.parameters())
    need, why = ((every, f"the model's {total} elements are within stage3_max_reuse_distance={reuse}, so "
                  f"DeepSpeed keeps all {every} swapped parameters live through the step")
                 if total <= reuse else (per_module, "a module's swapped parameters are swapped in together"))
    if opts["param_buffer_count"] < need:
        raise ValueError(f"system.options.param_buffer_count={opts['param_buffer_count']}; DeepSpeed's parameter "
                         f"swapper needs at least {need}: {why} (each holds one buffer)")


def micro_batch_candidates(cfg: RunConfig) -> list[int]:
    """The micro-batches a ZeRO baseline is tuned over at ``cfg``'s point, largest first: the
    divisors of the batch per rank (``workload.batch_size / hardware.n_gpus``) whose estimated
    activations, attention probabilities and logits
    (:func:`teraio.workload.models.micro_batch_bytes`; ZeRO keeps them on the device) fit
    ``hardware.gpu_capacity_bytes`` (all of them without a cap); 1 where none does (its
    failure is then measured and recorded)."""
    from teraio.workload.models import ffn_hidden, micro_batch_bytes

    w, cap = cfg.workload, cfg.hardware.gpu_capacity_bytes
    per_rank = w.batch_size // max(cfg.hardware.n_gpus, 1)
    ffn = ffn_hidden(build_meta_model(cfg.model, w.seq_len))
    fits = [d for d in range(per_rank, 0, -1) if per_rank % d == 0 and
            (cap is None or micro_batch_bytes(cfg.model, ffn, d, w.seq_len, cfg.model.n_layers) <= cap)]
    return fits or [1]


def tuning_candidates(cfg: RunConfig) -> list[dict]:
    """The settings the sweep measures before a ZeRO point's trials (``teraio.harness.tune``;
    the registry's ``SystemSpec.tuner``): every micro-batch of :func:`micro_batch_candidates`,
    largest first; for zero_infinity each with parameter prefetch on
    (``prefetch_bucket_size``: DeepSpeed's default, 5e7 elements) at two parameter-buffer
    counts -- Table 4's 18 and one buffer per swapped parameter, :func:`swapped_param_count`
    (never short, whatever prefetch and reuse keep live) -- then with it off (0), Table 4's 18
    buffers. Buffer sizes stay at the largest parameter (the least DeepSpeed accepts)."""
    mbs = micro_batch_candidates(cfg)
    if cfg.system.name != "zero_infinity":
        return [{"micro_batch_size": mb} for mb in mbs]
    opts = resolve_options(cfg.system.name, cfg.system.options)
    every = max(swapped_param_count(param_numels(cfg), opts), 1)
    buffers = [(None, n) for n in dict.fromkeys((18, every))] + [(0, 18)]
    return [{"micro_batch_size": mb, "prefetch_bucket_size": p, "param_buffer_count": n}
            for mb in mbs for p, n in buffers]


def swapped_param_count(numels: list[int], opts: dict) -> int:
    """How many of the parameters (element counts ``numels``) zero_infinity swaps to its
    directory: those of at least ``param_persistence_threshold`` elements and at least
    ``aio.block_size`` bytes and 1 MiB (DeepSpeed keeps the rest in memory)."""
    smallest = max(opts["aio"]["block_size"], 1 << 20)
    return sum(1 for n in numels if n >= opts["param_persistence_threshold"] and n * 4 >= smallest)


def swap_bytes_of(cfg: RunConfig, world: int = 1, local_world: int = 1) -> int:
    """:func:`swap_bytes_needed` of zero_infinity at ``cfg``'s point: its model, and the
    DeepSpeed config its options make (:func:`deepspeed_config`)."""
    opts = resolve_options("zero_infinity", cfg.system.options)
    numels = param_numels(cfg)
    return swap_bytes_needed(numels, deepspeed_config(cfg, opts, max(numels), world, "/swap"), world, local_world)


def check_swap_room(cfg: RunConfig, world: int | None = None, local_world: int | None = None) -> Path | None:
    """Refuse, before DeepSpeed starts, a zero_infinity swap directory
    (``system.options.nvme_path``, else ``hardware.ssd_dirs[0]``) that is missing, not
    writable, or whose drive has less room than the swap files take
    (:func:`swap_bytes_needed` of the point's DeepSpeed config, for ``world`` ranks,
    ``local_world`` of them on this host; default ``hardware.n_gpus`` each). What dead runs
    left there is removed first (``teraio.files.remove_orphans``), so that its room counts.
    The sweep checks every point so before the first runs (``SystemSpec.check_drives``), the
    worker again before DeepSpeed starts. Returns the directory; other systems pass.

    Raises:
        ValueError: naming the directory, its free bytes and the bytes the files take.
    """
    if cfg.system.name != "zero_infinity":
        return None
    opts = resolve_options(cfg.system.name, cfg.system.options)
    root = Path(opts["nvme_path"] or cfg.hardware.ssd_dirs[0])
    if not root.is_dir():
        raise ValueError(f"zero_infinity swap directory {root} does not exist "
                         "(hardware.ssd_dirs[0] or system.options.nvme_path)")
    if not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"zero_infinity swap directory {root} is not writable")
    remove_orphans(root, *SWAP_DIRS)
    world = world or cfg.hardware.n_gpus
    need = swap_bytes_of(cfg, world, local_world or world)
    free = shutil.disk_usage(root).free
    if free < need:
        raise ValueError(f"zero_infinity swap directory {root} has {free} B ({human_bytes(free)}) free; "
                         f"DeepSpeed's swap files take {need} B ({human_bytes(need)}) there (each swapped "
                         "parameter, and the FP32 partition, AdamW's two moments and the gradients of each "
                         "optimizer sub-group, as DeepSpeed sizes them); free room on that drive, or point "
                         "hardware.ssd_dirs[0] or system.options.nvme_path at a larger one")
    return root


def swap_dir_of(root: Path, job_dir: Path) -> Path:
    """zero_infinity's swap directory under ``root`` for a run in ``job_dir``: named after
    this process (``teraio.files.owner_tag``), so that a later run removes it where this one
    died before its ``finally`` did (``teraio.files.remove_orphans`` with ``teraio.files.SWAP_DIRS``)."""
    return root / f"{SWAP_DIRS[0]}{owner_tag()}-{job_dir.name}-{time.time_ns()}"


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, buf.to(device))


def _release_device(device: torch.device, held: MemoryCap | None) -> None:
    """Leave the process's device as found: a later run in the same process (tests) gets
    neither this run's cap (``held``, None where none was applied yet) nor its cached blocks
    (DeepSpeed's engine and buffers are freed by the collector: they sit in reference
    cycles)."""
    if device.type != "cuda":
        return
    gc.collect()
    torch.cuda.empty_cache()
    if held is not None:
        held.lift()


def run(cfg: RunConfig, job_dir: Path, device: torch.device) -> Measurements:
    """Train ``cfg`` with DeepSpeed ZeRO and return the measurements (``teraio.result``;
    on failure, those made so far travel with the exception, ``teraio.result.kept_on_failure``).

    ``workload.warmup_steps`` untimed then ``workload.measure_steps`` timed iterations
    (``teraio.systems.loop.measure_steps``; the batch is made and sliced before the timer starts);
    iteration ``s`` trains on ``make_batch(s, ...)``, each rank on its contiguous share of
    the global batch. The loss is the mean over micro-batches (and ranks) of the
    cross-entropy, as in :func:`teraio.workload.step.train_step`. Peaks (bytes) cover all
    iterations, after DeepSpeed's set-up; the emulated capacity
    (``hardware.gpu_capacity_bytes``) is applied before anything is placed on the device;
    on a CPU nothing enforces it, and the row says so (``capacity_enforced: false``).

    Stage 2 builds the model on ``device`` (as Ideal does: same initial weights). Stage 3
    builds it on the host and hands it to ``deepspeed.zero.Init``, which partitions and
    offloads one parameter at a time, so the whole model never sits on the device (on a
    GPU its initial weights are then a different draw from Ideal's, same distribution).

    Side files: ``deepspeed_config.json`` (``artifacts["deepspeed_config"]``).

    Raises:
        ValueError: bad ``system.options`` or swap directory.
        FloatingPointError: a non-finite loss.
        torch.OutOfMemoryError: the (emulated) device ran out of memory.
    """
    with kept_on_failure(Measurements()) as measured:
        _run(cfg, Path(job_dir), device, measured)
    return measured


def _run(cfg: RunConfig, job_dir: Path, device: torch.device, measured: Measurements) -> None:
    opts = resolve_options(cfg.system.name, cfg.system.options)
    w = cfg.workload
    numels = param_numels(cfg)
    world = int(os.environ.get("WORLD_SIZE", 1))
    root = check_swap_room(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    swap_dir = swap_dir_of(root, job_dir) if root is not None else None
    ds_config = deepspeed_config(cfg, opts, max(numels), world, str(swap_dir) if swap_dir else None)
    check_param_buffers(cfg, opts)
    measured.extras["zero_micro_batch_size"] = ds_config["train_micro_batch_size_per_gpu"]
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / CONFIG_FILE).write_text(json.dumps(ds_config, indent=1))
    measured.artifacts["deepspeed_config"] = CONFIG_FILE

    use_extensions_dir()
    import deepspeed  # after TORCH_EXTENSIONS_DIR is set: its ops JIT-load from there

    own_group = init_process_group(device, "nccl" if device.type == "cuda" else "gloo")
    engine = held = None
    try:
        if swap_dir is not None:
            swap_dir.mkdir()
        # before the first device allocation
        held = apply_memory_cap(cfg.hardware.gpu_capacity_bytes, device, cfg.hardware.capacity_mode)
        if opts["stage"] == 3:
            model = build_model(cfg.model, w.seq_len, "cpu", cfg.seed)
            deepspeed.zero.Init(module=model, config_dict_or_path=ds_config)
            _buffers_to(model, device)  # zero.Init places parameters only (RoPE table)
        else:
            model = build_model(cfg.model, w.seq_len, device, cfg.seed)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config)
        _train(engine, cfg, measured, device, world, ds_config["train_micro_batch_size_per_gpu"])
    finally:
        if engine is not None:
            engine.destroy()
        if own_group:  # through deepspeed.comm, which also drops its cached groups
            (deepspeed.comm if deepspeed.comm.is_initialized() else dist).destroy_process_group()
        if swap_dir is not None:
            shutil.rmtree(swap_dir, ignore_errors=True)
        _release_device(device, held)
    measured.capacity_bytes = cfg.hardware.gpu_capacity_bytes
    measured.capacity_emulated = True if cfg.hardware.gpu_capacity_bytes is not None else None
    if capacity_unenforced(cfg.hardware.gpu_capacity_bytes, device):
        measured.extras["capacity_enforced"] = False


def _train(engine, cfg: RunConfig, measured: Measurements, device: torch.device, world: int, mb: int) -> None:
    """The training loop over micro-batches of ``mb`` sequences: iterations, losses and peaks
    (bytes) into ``measured``. DeepSpeed
    exposes no stall, migration time or bytes moved: those stay null."""
    w = cfg.workload
    rows = rank_rows(w.batch_size, world)
    n_micro = (w.batch_size // world) // mb
    engine.train()
    reset_peak_memory(device)

    def step_fn(step: int) -> Step:
        inputs, labels = make_batch(step, w, cfg.model.vocab_size, cfg.seed, device)
        inputs, labels = inputs[rows], labels[rows]

        def run() -> float:
            total = torch.zeros((), device=device)
            for i in range(n_micro):
                sl = slice(i * mb, (i + 1) * mb)
                logits = engine(inputs[sl])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[sl].flatten())
                engine.backward(loss)  # DeepSpeed scales by 1 / gradient_accumulation_steps
                engine.step()  # steps the optimizer at the accumulation boundary only
                total += loss.detach() / n_micro
            return mean_over_ranks(total, world)

        return Step(run)

    steps = measure_steps(step_fn, w, device, progress=dist.get_rank() == 0, out=Steps(iterations=measured.iterations))
    measured.losses = list(steps.losses.values())
    measured.peak_allocated_bytes, measured.peak_reserved_bytes = peak_memory(device)
