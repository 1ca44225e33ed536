"""How much a host tier packed without gaps could give TeraIO-Mixed, on CPU: an *estimate*.

The host tier keeps each tensor in a slot for all its periods, shared only by tensors whose
periods never meet (``teraio.core.slots``), so its slots can fill the host cap while holding
far less at once (``MigrationPlan.tier_bytes_held``). This script plans a committed run's trace
again with the host cap on the bytes held at each op instead: a host migration fits where
the bytes already held over its period ``[offload_after, needed_by)`` plus its own stay within
the cap. That is what a host arena placing each migration at its own offset could reach
without fragmentation, an upper bound on any packing; no tier runs such a plan (the
planner's slots stay as they are: ``teraio.core.planner._Planner`` with its host placement and
room test replaced here). Both plans are replayed through the simulator at the plan's rates.

    python benchmarks/host_held_bound.py JOB_DIR [JOB_DIR ...] [--host-cap-bytes N [N ...]] --out FILE.json

Per job and cap: bytes moved per tier, the most bytes each tier holds at once, exposed
migrations, simulated iteration and stall seconds, for the plan with slots (today's planner,
with its slots' bytes) and the plan with the bound; and the floor on the drive
(``replan.beyond_host``).
The file ``--out`` is replaced atomically.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import teraio.core.planner as planner_module  # noqa: E402
from teraio.core.plan import MigrationPlan  # noqa: E402
from teraio.core.planner import TierBandwidth, plan_migrations  # noqa: E402
from teraio.core.trace import Trace  # noqa: E402

from replan import _load, beyond_host, summary, write_rows  # noqa: E402


class HeldBytes:
    """Host bytes held at each op (over a doubled, cyclic timeline), capped: the room test
    and placement of a host tier without gaps. Period ``i`` holds ``nbytes`` over
    ``[a[i], b[i])`` (``b`` unrolled, as ``teraio.core.planner.Periods``)."""

    def __init__(self, n_ops: int, a: np.ndarray, b: np.ndarray, cap_bytes: int):
        self.n, self.cap = n_ops, cap_bytes
        self.a, self.b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        self.held = np.zeros(2 * n_ops, dtype=np.int64)

    def room(self, periods: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """bool per period: its bytes fit beside what is held over it."""
        most = np.array([self.held[lo:hi].max() for lo, hi in zip(self.a[periods], self.b[periods])],
                        dtype=np.int64)
        return most + np.asarray(nbytes, np.int64) <= self.cap

    def place(self, period: int, nbytes: int) -> None:
        lo, hi = int(self.a[period]), int(self.b[period])
        for s, e in ((lo, hi), (lo - self.n, hi - self.n), (lo + self.n, hi + self.n)):
            s, e = max(s, 0), min(e, 2 * self.n)
            if e > s:
                self.held[s:e] += nbytes

    @property
    def held_bytes(self) -> int:
        return int(self.held.max())


class HeldBoundPlanner(planner_module._Planner):
    """The planner with its host slots replaced by :class:`HeldBytes` (each host migration
    names its own tensor as its slot)."""

    def __init__(self, trace, capacity, tiers, host_cap, *args, **kwargs):
        super().__init__(trace, capacity, tiers, host_cap, *args, **kwargs)
        self.bins["host"] = HeldBytes(self.n, self.a, self.b, host_cap)

    def host_room(self, idx: np.ndarray) -> np.ndarray:
        return self.bins["host"].room(idx, self.s[idx])

    def _place(self, c: int, tier: str) -> None:
        if tier == "host":
            self.bins["host"].place(c, int(self.s[c]))
        else:
            super()._place(c, tier)

    def slot_of(self, c: int, tier: str, trace: Trace) -> str:
        return trace.tensors[int(self.p_tid[c])].name if tier == "host" else super().slot_of(c, tier, trace)


def plan_like(trace: Trace, old: MigrationPlan, host_cap: int, bound: bool) -> MigrationPlan:
    """``trace`` planned again with ``old``'s capacity and options at ``host_cap``; with the
    held-bytes host bound if ``bound``."""
    m = old.meta
    args = dict(benefit=m["benefit"], min_tensor_bytes=m["min_tensor_bytes"], use_ssd=m["use_ssd"],
                allow_stalls=m["allow_stalls"], shared_ssd=m["shared_ssd"])
    tiers = TierBandwidth(**m["tiers_gbps"])
    if not bound:
        return plan_migrations(trace, old.capacity_bytes, tiers, host_cap, **args)
    with mock.patch.object(planner_module, "_Planner", HeldBoundPlanner):
        return plan_migrations(trace, old.capacity_bytes, tiers, host_cap, **args)


def compare(job: Path, host_cap: int | None) -> dict:
    trace = Trace.from_dict(_load(job, "trace"))
    old = MigrationPlan.from_dict(_load(job, "plan"))
    cap = old.meta["host_cap_bytes"] if host_cap is None else host_cap
    tiers = TierBandwidth(**old.meta["tiers_gbps"])
    return {"job": str(job), "capacity_bytes": old.capacity_bytes, "host_cap_bytes": cap,
            "ideal_s": float(trace.op_seconds.sum()), "beyond_host": beyond_host(trace, old.capacity_bytes, cap),
            "slots": summary(trace, plan_like(trace, old, cap, bound=False), tiers),
            # no slot bytes: the bound packs by the bytes held (most_bytes_held)
            "held_bound": {k: v for k, v in summary(trace, plan_like(trace, old, cap, bound=True), tiers).items()
                           if k != "slot_bytes"}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jobs", nargs="+", type=Path, help="job directories with trace and plan")
    ap.add_argument("--host-cap-bytes", type=int, nargs="+", default=[None],
                    help="host caps, bytes (default: each committed plan's)")
    ap.add_argument("--out", type=Path, required=True)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if any(c is not None and c <= 0 for c in args.host_cap_bytes):
        ap.error(f"--host-cap-bytes {args.host_cap_bytes}: each must be > 0 (TeraIO-Mixed)")
    rows = [compare(j, cap) for j in args.jobs for cap in args.host_cap_bytes]
    write_rows(args.out, "benchmarks/host_held_bound.py", argv, rows, ("slots", "held_bound"))


if __name__ == "__main__":
    main()
