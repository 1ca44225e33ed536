"""The migration engine's tiers against the machine's own ceilings, measured in one run.

Ceilings: page-locked D2H and H2D copies of one large buffer (``torch`` ``copy_``), one
direction at a time and both at once (``raw_duplex_*``), and
``O_DIRECT`` writes and reads of 8 MiB requests from page-locked host memory, ``--raw-threads``
in flight, on the drive directory and on the RAM directories. Tiers: ``HostTier`` and
``SSDTier`` (as TeraIO opens them) moving ``--tensors`` device tensors of ``--tensor-mib``
each, all issued at once and then waited for, as the engine issues a step's transfers.
Each figure is the best of ``--repeats``. GB/s are 1e9 B/s.

Writes one JSON object to ``--out``: the ceilings (``raw_*_gbps``), the tiers'
(``host_d2h_gbps``, ``ssd_write_gbps``, ...), their ratios (``host_d2h_of_raw``,
``ssd_write_of_raw``, ...), and the SSD tier over the RAM directories
(``ram_dir_write_gbps``, ``ram_dir_read_gbps``, with kvikio's compat mode beside them where
kvikio is installed).

    python -m benchmarks.engine_bandwidth --drive /tmp/teraio_ssd/0 \\
        --ram-dirs /dev/shm/bw/0 /dev/shm/bw/1 /dev/shm/bw/2 /dev/shm/bw/3 --out engine.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time

import torch

from teraio.core import probe
from teraio.core.tiers.host import HostTier
from teraio.core.tiers.pinned import page_unlock, pinned_empty
from teraio.core.tiers.ssd import SSDTier

MIB = 1 << 20
ALIGN = 4096


def best_rate(nbytes: int, fn, repeats: int) -> float:
    best = 0.0
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def raw_copies(nbytes: int, repeats: int) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = pinned_empty(nbytes, "raw copy buffer")
    try:
        return {"raw_d2h_gbps": best_rate(nbytes, lambda: host.copy_(dev, non_blocking=True), repeats),
                "raw_h2d_gbps": best_rate(nbytes, lambda: dev.copy_(host, non_blocking=True), repeats)}
    finally:
        page_unlock(host)


def raw_duplex(nbytes: int, repeats: int) -> dict[str, float]:
    """Page-locked D2H and H2D copies of one large buffer each, at the same time on two
    streams (the host link both ways at once, as a step's evictions and prefetches use it):
    each direction's rate over its own copy's time (CUDA events on its stream), best of
    ``repeats``."""
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    host = [pinned_empty(nbytes, "duplex copy buffer") for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    best = {"raw_duplex_d2h_gbps": 0.0, "raw_duplex_h2d_gbps": 0.0}
    try:
        for _ in range(repeats):
            torch.cuda.synchronize()
            events = []
            for key, stream, dst, src in (("raw_duplex_d2h_gbps", streams[0], host[0], dev[0]),
                                          ("raw_duplex_h2d_gbps", streams[1], dev[1], host[1])):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record()
                    dst.copy_(src, non_blocking=True)
                    end.record()
                events.append((key, start, end))
            torch.cuda.synchronize()
            for key, start, end in events:
                best[key] = max(best[key], nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        return best
    finally:
        for h in host:
            page_unlock(h)


def raw_direct_io(dirs: list[str], nbytes: int, threads: int, repeats: int) -> dict[str, float]:
    """O_DIRECT 8 MiB requests from page-locked memory, ``threads`` in flight over the files
    (one per directory, ``nbytes`` spread evenly)."""
    req = 8 * MIB
    per_file = max(req, nbytes // len(dirs) // req * req)
    paths = [os.path.join(d, f"raw-{os.getpid()}.bin") for d in dirs]
    fds = []
    for p in paths:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(fd, 0, per_file)
        fds.append(fd)
    bufs = [pinned_empty(req + ALIGN, "raw I/O buffer") for _ in range(threads)]
    views = [memoryview(b.numpy()).cast("B")[-b.data_ptr() % ALIGN:][:req] for b in bufs]
    jobs = [(fd, off) for off in range(0, per_file, req) for fd in fds]
    total = len(jobs) * req

    def run(kind: str) -> None:
        def worker(i: int) -> None:
            for fd, off in jobs[i::threads]:
                n = (os.pwrite(fd, views[i], off) if kind == "write" else os.preadv(fd, [views[i]], off))
                if n != req:
                    raise OSError(f"raw {kind} moved {n} of {req} bytes")
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))

    try:
        return {"raw_write_gbps": best_rate(total, lambda: run("write"), repeats),
                "raw_read_gbps": best_rate(total, lambda: run("read"), repeats)}
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            os.unlink(p)
        for b in bufs:
            page_unlock(b)


def tier_rates(make_tier, n: int, nbytes: int, repeats: int) -> dict:
    """Write then read ``n`` device tensors of ``nbytes``, all in flight at once
    (``teraio.core.probe.tier_rates``, as TeraIO measures a tier itself)."""
    tensors = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda") for _ in range(n)]
    with make_tier({f"t{i}": nbytes for i in range(n)}) as tier:
        write, read = probe.tier_rates(tier, tensors, repeats)
        return {"write_gbps": write, "read_gbps": read, "mode": getattr(tier, "mode", "pinned")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drive", required=True, help="a directory on the drive the SSD tier uses")
    p.add_argument("--ram-dirs", nargs="+", required=True, help="directories in RAM (e.g. under /dev/shm)")
    p.add_argument("--raw-gib", type=float, default=4.0, help="bytes per raw measurement, GiB")
    p.add_argument("--raw-threads", type=int, default=8)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--tensor-mib", type=int, default=512)
    p.add_argument("--io-threads", type=int, default=4, help="SSD tier workers per directory")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    for d in [a.drive, *a.ram_dirs]:
        os.makedirs(d, exist_ok=True)
    raw_bytes = int(a.raw_gib * 2**30)
    tensor_bytes = a.tensor_mib * MIB
    out: dict = {"gpu": torch.cuda.get_device_name(), "tensors": a.tensors, "tensor_bytes": tensor_bytes,
                 "io_threads_per_dir": a.io_threads, "raw_threads": a.raw_threads, "repeats": a.repeats}

    def report(key: str, value) -> None:
        out[key] = value
        print(f"{key}: {value}", flush=True)

    for k, v in raw_copies(raw_bytes, a.repeats).items():
        report(k, v)
    for k, v in raw_duplex(raw_bytes, a.repeats).items():
        report(k, v)
    for k, v in raw_direct_io([a.drive], raw_bytes, a.raw_threads, a.repeats).items():
        report(k.replace("raw_", "raw_drive_"), v)
    for k, v in raw_direct_io(a.ram_dirs, raw_bytes, a.raw_threads, a.repeats).items():
        report(k.replace("raw_", "raw_ram_dir_"), v)

    host = tier_rates(lambda slots: HostTier(sum(slots.values()) + 64 * len(slots), slots, "cuda"),
                      a.tensors, tensor_bytes, a.repeats)
    report("host_d2h_gbps", host["write_gbps"])
    report("host_h2d_gbps", host["read_gbps"])
    ssd = tier_rates(lambda slots: SSDTier([a.drive], slots, threads=a.io_threads),
                     a.tensors, tensor_bytes, a.repeats)
    report("ssd_io_mode", ssd["mode"])
    report("ssd_write_gbps", ssd["write_gbps"])
    report("ssd_read_gbps", ssd["read_gbps"])
    ram = tier_rates(lambda slots: SSDTier(a.ram_dirs, slots, threads=a.io_threads),
                     a.tensors, tensor_bytes, a.repeats)
    report("ram_dir_io_mode", ram["mode"])
    report("ram_dir_write_gbps", ram["write_gbps"])
    report("ram_dir_read_gbps", ram["read_gbps"])
    try:
        kv = tier_rates(lambda slots: SSDTier(a.ram_dirs, slots, backend="kvikio", threads=a.io_threads),
                        a.tensors, tensor_bytes, a.repeats)
        report("ram_dir_kvikio_mode", kv["mode"])
        report("ram_dir_kvikio_write_gbps", kv["write_gbps"])
        report("ram_dir_kvikio_read_gbps", kv["read_gbps"])
    except ImportError as e:
        report("ram_dir_kvikio_error", str(e))

    report("host_d2h_of_raw", out["host_d2h_gbps"] / out["raw_d2h_gbps"])
    report("host_h2d_of_raw", out["host_h2d_gbps"] / out["raw_h2d_gbps"])
    report("ssd_write_of_raw", out["ssd_write_gbps"] / out["raw_drive_write_gbps"])
    report("ssd_read_of_raw", out["ssd_read_gbps"] / out["raw_drive_read_gbps"])
    report("ram_dir_write_of_raw", out["ram_dir_write_gbps"] / out["raw_ram_dir_write_gbps"])
    report("ram_dir_read_of_raw", out["ram_dir_read_gbps"] / out["raw_ram_dir_read_gbps"])
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
