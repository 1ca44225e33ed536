"""How TeraIO-Mixed's host tier could be packed, on CPU: an *estimate*.

The host tier keeps each tensor in a slot for all its periods, shared only by tensors whose
periods never meet (``teraio.core.slots``), so its slots can fill the host cap while holding
far less at once (``MigrationPlan.tier_bytes_held``). This script plans a committed run's trace
again three ways, with the planner's host placement and room test replaced
(``teraio.core.planner._Planner``; the rest of the planner as it is):

* ``slots``: the planner as it is;
* ``arena``: one host region of the cap, each host migration at the lowest offset where its
  bytes meet no migration placed before it whose period meets its own
  (:func:`first_fit_arena`): what a host arena addressed by period would plan; no tier
  runs such a plan;
* ``tensor_arena``: the same with one offset per tensor, its later host periods where its
  first went: the planner's ``host_arena`` (``teraio.core.slots.HostArena``), which TeraIO
  runs with ``system.options.host_arena=true``;
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
from teraio.core.bandwidth import TierBandwidth  # noqa: E402
from teraio.core.slots import HOST_ALIGN, HostArena  # noqa: E402
from teraio.core.trace import Trace  # noqa: E402

from replan import beyond_host, load_plan, load_trace, plan_as_committed, summary, write_rows  # noqa: E402


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


def first_fit_arena(n_ops: int, a: np.ndarray, b: np.ndarray, cap_bytes: int) -> HostArena:
    """One host region of ``cap_bytes``: each period placed at the lowest offset where its
    bytes (rounded up to ``HOST_ALIGN``) meet no period placed before it whose ops meet its
    own (cyclic), never bound to its tensor's other periods: the planner's
    :class:`~teraio.core.slots.HostArena` with each period a tensor of its own. What a host
    arena addressed by period would do at plan time; its gaps are fragmentation."""
    return HostArena(n_ops, np.arange(len(a)), a, b, cap_bytes, align=HOST_ALIGN)


PACKINGS = ("arena", "tensor_arena", "held_bound")
REPLACED = {"arena": first_fit_arena, "held_bound": HeldBytes}  # the others: the planner's own


class HostPackingPlanner(planner_module._Planner):
    """The planner with its host slots replaced by ``packing`` (a value of :data:`REPLACED`;
    each host migration names its own tensor as its slot)."""

    packing = HeldBytes

    def __init__(self, trace, capacity, tiers, host_cap, *args, **kwargs):
        super().__init__(trace, capacity, tiers, host_cap, *args, **kwargs)
        self.bins["host"] = self.packing(self.n, self.a, self.b, host_cap)

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
    tier packed in slots or a region (the planner's ``host_arena``) or as ``packing`` names
    (:data:`REPLACED`)."""
    if packing not in REPLACED:
        return plan_as_committed(trace, old, host_cap, host_arena=packing == "tensor_arena")
    planner = type("Planner", (HostPackingPlanner,), {"packing": staticmethod(REPLACED[packing])})
    with mock.patch.object(planner_module, "_Planner", planner):
        return plan_as_committed(trace, old, host_cap, host_arena=False)


def compare(job: Path, host_cap: int | None) -> dict:
    trace, old = load_trace(job), load_plan(job)
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
