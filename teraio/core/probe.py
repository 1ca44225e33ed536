"""Tier bandwidths the planner can trust: measured on this machine, through the tiers the
engine uses, where the hardware config leaves them null (paper §3.2 plans with the
bandwidth of each tier and direction; a figure typed into a config for other drives or
another host makes a plan that stalls).

A probe writes and then reads back ``n`` tensors of ``nbytes / n`` bytes each, all in
flight at once as the engine issues them (:func:`tier_rates`): through a ``HostTier`` (device <-> page-locked
host memory) and through an ``SSDTier`` over ``hardware.ssd_dirs`` (all drives together,
``O_DIRECT`` where the filesystem allows). Each figure is the best of two rounds, GB/s
(1e9 B/s). Results are cached per machine in ``<cache dir>/bandwidth.json`` (``cache dir``:
``$TERAIO_CACHE_DIR``, else ``~/.cache/teraio``), keyed by host, device and SSD
directories, so a sweep measures once.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch

from teraio.files import write_atomic
from teraio.core.tiers.host import HostTier
from teraio.core.tiers.ssd import SSDTier

KEYS: tuple[str, ...] = ("ssd_write_gbps", "ssd_read_gbps", "host_d2h_gbps", "host_h2d_gbps")


def cache_file() -> Path:
    return Path(os.environ.get("TERAIO_CACHE_DIR", "~/.cache/teraio")).expanduser() / "bandwidth.json"


def machine_key(device: torch.device, ssd_dirs: list[str]) -> str:
    """What a measurement holds for: this host, this device, these directories."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return "|".join([socket.gethostname(), name, *sorted(os.path.abspath(d) for d in ssd_dirs)])


def tier_rates(tier, tensors: list[torch.Tensor], repeats: int = 2) -> tuple[float, float]:
    """(write, read) GB/s of ``tier`` moving ``tensors`` (``uint8``, one slot ``t<i>`` each),
    all issued at once and then waited for, as the engine issues a step's transfers; each
    the best of ``repeats`` rounds. The tensors are zeroed before the reads, and must come
    back as they were written.

    Raises:
        RuntimeError: a tier returned other bytes than it was given.
    """
    device = tensors[0].device
    nbytes = sum(t.numel() for t in tensors)
    expected = [t.clone() for t in tensors]

    def best(io) -> float:
        rate = 0.0
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for tr in [io(f"t{i}", t.untyped_storage()) for i, t in enumerate(tensors)]:
                tr.wait()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rate = max(rate, nbytes / (time.perf_counter() - t0) / 1e9)
        return rate

    write = best(tier.write)
    for t in tensors:
        t.zero_()
    read = best(tier.read)
    if not all(torch.equal(t, e) for t, e in zip(tensors, expected)):
        raise RuntimeError("bandwidth probe: a tier returned other bytes than it was given")
    return write, read


def measure(device: torch.device, ssd_dirs: list[str], total_bytes: int = 1 << 30, n: int = 8,
            io_threads: int = 4) -> dict[str, float]:
    """Each of :data:`KEYS`, GB/s, measured now (the SSD figures over all of ``ssd_dirs``)."""
    each = total_bytes // n
    slots = {f"t{i}": each for i in range(n)}
    tensors = [torch.randint(0, 256, (each,), dtype=torch.uint8, device=device) for _ in range(n)]
    with HostTier(n * (each + 64), slots, device) as host:
        d2h, h2d = tier_rates(host, tensors)
    with SSDTier(list(ssd_dirs), slots, threads=io_threads) as ssd:
        write, read = tier_rates(ssd, tensors)
    return {"ssd_write_gbps": write, "ssd_read_gbps": read, "host_d2h_gbps": d2h, "host_h2d_gbps": h2d}


def measured_bandwidths(device: torch.device, ssd_dirs: list[str], io_threads: int = 4) -> dict:
    """The cached measurement for this machine, made now (and cached) if there is none:
    ``{"gbps": {key: GB/s}, "measured_at": ISO time, "key": machine key, "cached": bool}``."""
    path = cache_file()
    key = machine_key(device, ssd_dirs)
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key in cache:
        return {**cache[key], "key": key, "cached": True}
    print(f"measuring tier bandwidths on this machine (cached in {path})...", flush=True)
    entry = {"gbps": measure(device, ssd_dirs, io_threads=io_threads),
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = json.loads(path.read_text()) if path.exists() else {}  # another run may have written
    write_atomic(path, json.dumps({**fresh, key: entry}, indent=1).encode())
    return {**entry, "key": key, "cached": False}
