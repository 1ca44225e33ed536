"""How TeraIO-Mixed's host tier could be packed, on CPU: an *estimate*.

The host tier keeps each tensor in a slot for all its periods, shared only by tensors whose
periods never meet (``teraio.core.slots``), so its slots can fill the host cap while holding
far less at once (``MigrationPlan.tier_bytes_held``). This script plans a committed run's trace
again three ways, with the planner's host placement and room test replaced
(``teraio.core.planner._Planner``; the rest of the planner as it is):

* ``slots``: the planner as it is;
* ``arena``: one host region of the cap, each host migration at the lowest offset where its
  bytes meet no migration placed before it whose period meets its own
  (:class:`FirstFitArena`): what a host arena would plan; no tier runs such a plan yet;
* ``tensor_arena``: the same with one offset per tensor, its later host periods where its
  first went (:class:`TensorArena`): what a tier that addresses a tensor by its name, as
  today's do, could run;
* ``held_bound``: a migration fits where the bytes held over its period plus its own stay
  within the cap (:class:`HeldBytes`): an arena without fragmentation, the loosest room
  test (every set of migrations an arena holds passes it; the greedy planner's result with
  it need not be the best of the four).

Each plan is replayed through the simulator at the plan's rates.

    python benchmarks/host_packing.py JOB_DIR [JOB_DIR ...] [--host-cap-bytes N [N ...]] --out FILE.json

Per job and cap: bytes moved per tier, the most bytes each tier holds at once, exposed
migrations, simulated iteration and stall seconds per packing (the slots' bytes for
``slots``), and the floor on the drive (``replan.beyond_host``).
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
from teraio.core.slots import HOST_ALIGN, align_up  # noqa: E402
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


class FirstFitArena:
    """One host region of ``cap_bytes``: each period placed at the lowest offset where its
    bytes (rounded up to ``HOST_ALIGN``) meet no period placed before it whose ops meet
    its own (cyclic). What a host arena would do at plan time; its gaps are fragmentation."""

    def __init__(self, n_ops: int, a: np.ndarray, b: np.ndarray, cap_bytes: int):
        self.n, self.cap = n_ops, cap_bytes
        self.a, self.b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        self.lo = np.zeros(0, np.int64)
        self.hi = np.zeros(0, np.int64)
        self.off = np.zeros(0, np.int64)
        self.end = np.zeros(0, np.int64)

    def offset(self, period: int, nbytes: int) -> int:
        """The lowest free offset for ``period``'s ``nbytes``, or -1 where none fits the cap."""
        size = int(align_up(int(nbytes), HOST_ALIGN))
        meet = self.meets(period)
        order = np.argsort(self.off[meet], kind="stable")
        off, end = self.off[meet][order], self.end[meet][order]
        starts = np.concatenate([[0], np.maximum.accumulate(end)])
        fits = np.flatnonzero(np.concatenate([off, [self.cap]]) - starts >= size)
        return int(starts[fits[0]]) if len(fits) else -1

    def meets(self, period: int) -> np.ndarray:
        """bool per placed period: its ops meet ``period``'s (cyclic)."""
        a, b = self.a[period], self.b[period]
        meet = np.zeros(len(self.lo), dtype=bool)
        for shift in (-self.n, 0, self.n):
            meet |= (self.lo + shift < b) & (a < self.hi + shift)
        return meet

    def room(self, periods: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        return np.array([self.offset(p, s) >= 0 for p, s in zip(periods, nbytes)], dtype=bool)

    def place(self, period: int, nbytes: int) -> None:
        off = self.offset(period, nbytes)
        if off < 0:
            raise ValueError(f"period {period} ({nbytes} B) has no free offset under {self.cap} B")
        self.lo = np.append(self.lo, self.a[period])
        self.hi = np.append(self.hi, self.b[period])
        self.off = np.append(self.off, off)
        self.end = np.append(self.end, off + align_up(int(nbytes), HOST_ALIGN))

    @property
    def held_bytes(self) -> int:
        """The region's bytes in use: the highest end placed."""
        return int(self.end.max(initial=0))


class TensorArena(FirstFitArena):
    """:class:`FirstFitArena` with one offset per tensor: a tensor's later host periods go
    where its first went, or not to the host (a tier addressed by tensor name)."""

    def __init__(self, n_ops: int, a: np.ndarray, b: np.ndarray, cap_bytes: int, tid: np.ndarray):
        super().__init__(n_ops, a, b, cap_bytes)
        self.tid = np.asarray(tid, np.int64)
        self.at: dict[int, int] = {}  # tensor id -> its offset

    def offset(self, period: int, nbytes: int) -> int:
        fixed = self.at.get(int(self.tid[period]))
        if fixed is None:
            return super().offset(period, nbytes)
        meet = self.meets(period)
        end = fixed + align_up(int(nbytes), HOST_ALIGN)
        return -1 if ((self.off[meet] < end) & (fixed < self.end[meet])).any() else fixed

    def place(self, period: int, nbytes: int) -> None:
        self.at.setdefault(int(self.tid[period]), self.offset(period, nbytes))
        super().place(period, nbytes)


PACKINGS = {"arena": FirstFitArena, "tensor_arena": TensorArena, "held_bound": HeldBytes}


class HostPackingPlanner(planner_module._Planner):
    """The planner with its host slots replaced by ``packing`` (a class of :data:`PACKINGS`;
    each host migration names its own tensor as its slot)."""

    packing = HeldBytes

    def __init__(self, trace, capacity, tiers, host_cap, *args, **kwargs):
        super().__init__(trace, capacity, tiers, host_cap, *args, **kwargs)
        extra = {"tid": self.p_tid} if self.packing is TensorArena else {}
        self.bins["host"] = self.packing(self.n, self.a, self.b, host_cap, **extra)

    def host_room(self, idx: np.ndarray) -> np.ndarray:
        return self.bins["host"].room(idx, self.s[idx])

    def _place(self, c: int, tier: str) -> None:
        if tier == "host":
            self.bins["host"].place(c, int(self.s[c]))
        else:
            super()._place(c, tier)

    def slot_of(self, c: int, tier: str, trace: Trace) -> str:
        return trace.tensors[int(self.p_tid[c])].name if tier == "host" else super().slot_of(c, tier, trace)


def plan_like(trace: Trace, old: MigrationPlan, host_cap: int, packing: str = "slots") -> MigrationPlan:
    """``trace`` planned again with ``old``'s capacity and options at ``host_cap``, its host
    tier packed in slots (the planner's) or as ``packing`` names (:data:`PACKINGS`)."""
    m = old.meta
    args = dict(benefit=m["benefit"], min_tensor_bytes=m["min_tensor_bytes"], use_ssd=m["use_ssd"],
                allow_stalls=m["allow_stalls"], shared_ssd=m["shared_ssd"])
    tiers = TierBandwidth(**m["tiers_gbps"])
    if packing == "slots":
        return plan_migrations(trace, old.capacity_bytes, tiers, host_cap, **args)
    planner = type("Planner", (HostPackingPlanner,), {"packing": PACKINGS[packing]})
    with mock.patch.object(planner_module, "_Planner", planner):
        return plan_migrations(trace, old.capacity_bytes, tiers, host_cap, **args)


def compare(job: Path, host_cap: int | None) -> dict:
    trace = Trace.from_dict(_load(job, "trace"))
    old = MigrationPlan.from_dict(_load(job, "plan"))
    cap = old.meta["host_cap_bytes"] if host_cap is None else host_cap
    tiers = TierBandwidth(**old.meta["tiers_gbps"])
    return {"job": str(job), "capacity_bytes": old.capacity_bytes, "host_cap_bytes": cap,
            "ideal_s": float(trace.op_seconds.sum()), "beyond_host": beyond_host(trace, old.capacity_bytes, cap),
            "slots": summary(trace, plan_like(trace, old, cap), tiers),
            # no slot bytes: these pack by offset or by the bytes held (most_bytes_held)
            **{p: {k: v for k, v in summary(trace, plan_like(trace, old, cap, p), tiers).items()
                   if k != "slot_bytes"} for p in PACKINGS}}


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
    write_rows(args.out, "benchmarks/host_packing.py", argv, rows, ("slots", *PACKINGS))


if __name__ == "__main__":
    main()
