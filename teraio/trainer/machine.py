"""What a TeraIO run reads of the machine and opens on it: the GPU capacity it binds to, the
tier bandwidths it plans with, the tiers its plan uses, the stream its steps run on.
"""
from __future__ import annotations

import contextlib

import torch

from teraio.config import RunConfig
from teraio.core import probe
from teraio.core.bandwidth import TierBandwidth
from teraio.core.tiers.host import HostTier
from teraio.core.tiers.ssd import SSDTier
from teraio.result import Measurements
from teraio.workload.models import model_state_bytes


def tier_bandwidth(cfg: RunConfig, device: torch.device | None = None, io_threads: int = 4,
                   measured: Measurements | None = None) -> TierBandwidth:
    """Planner bandwidths (GB/s). Given ones from ``cfg.hardware`` (the SSD tier aggregates
    its drives, one directory per drive); null ones measured on ``device`` over the tiers
    (``teraio.core.probe``, cached per machine). ``measured`` gets ``tier_gbps``: the values and
    where each came from.

    Raises:
        ValueError: a bandwidth is null and no device is given to measure it on.
    """
    hw = cfg.hardware
    n = len(hw.ssd_dirs)
    given = {"ssd_write_gbps": None if hw.ssd_write_gbps is None else hw.ssd_write_gbps * n,
             "ssd_read_gbps": None if hw.ssd_read_gbps is None else hw.ssd_read_gbps * n,
             "host_d2h_gbps": hw.host_d2h_gbps, "host_h2d_gbps": hw.host_h2d_gbps}
    missing = [k for k, v in given.items() if v is None]
    gbps, source = dict(given), dict.fromkeys(given, "hardware config")
    if missing:
        if device is None:
            raise ValueError(f"hardware.{missing[0]} is null (measure it) but no device was given to measure on")
        m = probe.measured_bandwidths(device, list(hw.ssd_dirs), io_threads)
        for k in missing:
            gbps[k] = m["gbps"][k]
            source[k] = f"measured {m['measured_at']}" + (" (cached)" if m["cached"] else "")
    if measured is not None:
        measured.tier_gbps = {**gbps, "source": source}
    return TierBandwidth(**gbps)


def open_tiers(plan, cfg: RunConfig, device: torch.device, io_threads: int = 4) -> dict:
    """The tiers the plan uses, with a slot per migrated tensor or shared as the plan says
    (``MigrationPlan.shared_slots``), the host tier one region where the plan places it so
    (``MigrationPlan.host_offsets``). The SSD tier puts one uniquely named file in each
    drive's directory, so concurrent runs never collide, and refuses a missing, unwritable
    or too small directory, naming it and the bytes needed.
    """
    slots: dict[str, dict[str, int]] = {"ssd": {}, "host": {}}
    for m in plan.migrations:
        slots[m.tier][m.name] = m.nbytes
    tiers = {}
    if slots["ssd"]:
        tiers["ssd"] = SSDTier(list(cfg.hardware.ssd_dirs), slots["ssd"], threads=io_threads,
                               shares=plan.shared_slots("ssd"))
    if slots["host"]:
        offsets = plan.host_offsets()
        tiers["host"] = HostTier(cfg.hardware.host_mem_cap_bytes, slots["host"], device,
                                 shares=None if offsets else plan.shared_slots("host"), offsets=offsets)
    return tiers


@contextlib.contextmanager
def compute_stream(device: torch.device):
    """Run the step on a non-blocking CUDA stream: kvikio's compat-mode copies run on its
    own streams, and on the legacy default stream every one of them would serialize with
    the training kernels."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.stream(torch.cuda.Stream(device)):
        yield


def device_capacity(cfg: RunConfig, device: torch.device) -> tuple[int | None, bool]:
    """(capacity in bytes, emulated?): ``hardware.gpu_capacity_bytes`` when given (emulated);
    else on CUDA the device's free memory now, before the run allocates anything (the real
    GPU); else (CPU) None, uncapped."""
    if cfg.hardware.gpu_capacity_bytes is not None:
        return int(cfg.hardware.gpu_capacity_bytes), True
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), False
    return None, False


def check_model_fits(cfg: RunConfig, limit: int | None) -> None:
    """TeraIO builds the model on the device; refuse, before allocating anything, a model
    whose parameters and buffers alone exceed the bytes it may use there.

    Raises:
        ValueError: naming the model, its bytes and the limit.
    """
    if limit is None:
        return
    need = model_state_bytes(cfg.model, cfg.workload.seq_len)
    if need > limit:
        raise ValueError(
            f"model {cfg.model.name}: its parameters and buffers take {need} B, above the {limit} B "
            f"TeraIO may use on the device (capacity less headroom); the model is built on the device, "
            f"so its parameters alone must fit there")
