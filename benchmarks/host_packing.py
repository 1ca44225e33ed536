"""How TeraIO-Mixed's host tier could be packed, on CPU: an *estimate*.

The host tier keeps each tensor in a slot for all its periods, shared only by tensors whose
periods never meet (``teraio.core.slots``), so its slots can fill the host cap while holding
far less at once (``MigrationPlan.tier_bytes_held``). This script plans a committed run's trace
again four ways, at the committed plan's settings (``teraio.perf.replay.plan_as_committed``),
its host tier placed by the rule each names (``plan_migrations``' ``host_arena`` or
``host_placement``; the rest of the planner as it is):

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

    python -m benchmarks.host_packing JOB_DIR [JOB_DIR ...] [--host-cap-bytes N [N ...]] --out FILE.json

Per job and cap: bytes moved per tier, the most bytes each tier holds at once, exposed
migrations, simulated iteration and stall seconds per packing (the slots' bytes for
``slots``), and the floor on the drive (``teraio.perf.replan.beyond_host``).
The file ``--out`` is replaced atomically.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from benchmarks import refusing
from benchmarks.replan import write_rows
from teraio.core.plan import MigrationPlan
from teraio.core.slots import HOST_ALIGN, HostArena
from teraio.core.trace import Trace
from teraio.perf import jobdir
from teraio.perf.replan import beyond_host, plan_summary
from teraio.perf.replay import plan_as_committed, plan_tiers


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
PLACEMENTS = {"arena": first_fit_arena, "held_bound": HeldBytes}  # the others: the planner's own


def plan_like(trace: Trace, old: MigrationPlan, host_cap: int, packing: str = "slots") -> MigrationPlan:
    """``trace`` planned again with ``old``'s capacity and options at ``host_cap``, its host
    tier packed in slots or a region (the planner's ``host_arena``) or as ``packing`` names
    (:data:`PLACEMENTS`, the planner's ``host_placement``)."""
    if packing not in PLACEMENTS:
        return plan_as_committed(trace, old, host_cap, host_arena=packing == "tensor_arena")
    return plan_as_committed(trace, old, host_cap, host_arena=False, host_placement=PLACEMENTS[packing])


def compare(job: Path, host_cap: int | None) -> dict:
    trace, old = jobdir.trace(job), jobdir.plan(job)
    cap = old.meta["host_cap_bytes"] if host_cap is None else host_cap
    tiers = plan_tiers(old)
    return {"job": str(job), "capacity_bytes": old.capacity_bytes, "host_cap_bytes": cap,
            "ideal_s": float(trace.op_seconds.sum()), "beyond_host": beyond_host(trace, old.capacity_bytes, cap),
            "slots": plan_summary(trace, plan_like(trace, old, cap), tiers),
            # no slot bytes: these pack by offset or by the bytes held (most_bytes_held)
            **{p: {k: v for k, v in plan_summary(trace, plan_like(trace, old, cap, p), tiers).items()
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
    with refusing("benchmarks.host_packing"):
        rows = [compare(j, cap) for j in args.jobs for cap in args.host_cap_bytes]
    write_rows(args.out, "benchmarks.host_packing", argv, rows, ("slots", *PACKINGS))


if __name__ == "__main__":
    main()
