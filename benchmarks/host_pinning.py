"""How fast host memory becomes usable for GPU copies: page-locking fresh memory by three
routes, and device-to-host copies into fresh pageable, reused pageable and page-locked
buffers. Prints one JSON object (GB/s, 1 GB = 1e9 bytes) and writes it to ``--out``.

    python -m benchmarks.host_pinning --gib 4 --out pinning.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from teraio.core.tiers.pinned import page_lock, page_unlock


def rate(nbytes: int, fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0, help="buffer size, GiB")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    n = int(a.gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    out: dict[str, float] = {"bytes": n, "cpu_threads": torch.get_num_threads()}

    bufs = []
    out["pin_memory_alloc_gbps"] = rate(n, lambda: bufs.append(torch.empty(n, dtype=torch.uint8, pin_memory=True)))
    out["d2h_pinned_gbps"] = rate(n, lambda: bufs[-1].copy_(src, non_blocking=True))
    del bufs[:]

    fresh = torch.empty(n, dtype=torch.uint8)
    out["register_untouched_gbps"] = rate(n, lambda: page_lock(fresh, "probe"))
    page_unlock(fresh)
    del fresh

    touched = torch.empty(n, dtype=torch.uint8)
    out["first_touch_fill_gbps"] = rate(n, lambda: touched.fill_(0))
    out["register_touched_gbps"] = rate(n, lambda: page_lock(touched, "probe"))
    out["d2h_registered_gbps"] = rate(n, lambda: touched.copy_(src, non_blocking=True))
    page_unlock(touched)
    del touched

    pageable = torch.empty(n, dtype=torch.uint8)
    out["d2h_fresh_pageable_gbps"] = rate(n, lambda: pageable.copy_(src))
    out["d2h_reused_pageable_gbps"] = rate(n, lambda: pageable.copy_(src))
    out["h2d_reused_pageable_gbps"] = rate(n, lambda: src.copy_(pageable))
    text = json.dumps(out, indent=1)
    print(text)
    with open(a.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
