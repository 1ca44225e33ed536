"""Re-plan committed TeraIO runs with the current planner, on CPU: for each job directory
(its ``trace.json[.gz]`` and ``plan.json[.gz]``), plan the trace again at the plan's own
capacity, bandwidths, host cap (or at each of ``--host-cap-bytes``: 0 plans TeraIO-SSD) and
options (or with ``--host-arena``: false, true or auto, ``plan_fastest``'s ``host_arena``;
with ``--ssd-cap-bytes``, the SSD tier's files within that room, ``ssd_cap_bytes``), and
replay both plans through the simulator. The trace is planned as saved, the profiled
step; ``--released-grads`` plans it as a run with ``release_grads`` does
(``Trace.with_released_grads``).

    python benchmarks/replan.py JOB_DIR [JOB_DIR ...] [--host-cap-bytes N [N ...]]
        [--host-arena {false,true,auto}] [--ssd-cap-bytes N] [--released-grads] --out FILE.json

Per job it reports, for the committed plan and the new one: bytes moved per tier and
iteration, the bytes of each tier's slots (a plan without shared slots, made before
``teraio.core.slots``, needs one slot per tensor name), the most bytes each tier holds at
once (``MigrationPlan.tier_bytes_held``), the exposed migrations, and the simulated
iteration and stall seconds (``teraio.perf.simulator.simulate``, FIFO); and, per host cap,
the floor on the drive's share (:func:`beyond_host`).
The file ``--out`` is replaced atomically.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from teraio.core.bandwidth import TierBandwidth  # noqa: E402
from teraio.core.plan import MigrationPlan  # noqa: E402
from teraio.core.slots import HOST_ALIGN, align_up, ssd_file_bytes  # noqa: E402
from teraio.core.trace import Trace  # noqa: E402
from teraio.files import write_atomic  # noqa: E402
from teraio.perf.choose import plan_fastest  # noqa: E402
from teraio.perf.simulator import simulate  # noqa: E402


def _load(job: Path, stem: str) -> dict:
    for path, opener in ((job / f"{stem}.json", open), (job / f"{stem}.json.gz", gzip.open)):
        if path.exists():
            with opener(path, "rt") as f:
                return json.load(f)
    raise ValueError(f"{job}: no {stem}.json or {stem}.json.gz")


def owner_slots(plan: MigrationPlan, tier: str) -> dict[str, int]:
    """``tier``'s slots, owner name -> bytes: one per owner, or one per tensor name in a plan
    without shared slots."""
    return {m.name: m.nbytes for m in plan.migrations if m.tier == tier and m.slot in ("", m.name)}


def slot_bytes(plan: MigrationPlan) -> dict[str, int]:
    """Bytes of each tier's slots (:func:`owner_slots`; host slots rounded up as the host
    tier allocates them); for a host tier as one region (``host_arena``), the region's
    bytes in use."""
    out = {}
    for tier, align in (("ssd", 1), ("host", HOST_ALIGN)):
        out[tier] = sum(align_up(b, align) for b in owner_slots(plan, tier).values())
    if plan.meta.get("host_arena"):  # one region: its highest end
        out["host"] = plan.meta["slot_bytes"]["host"]
    return out


def ssd_files(plan: MigrationPlan) -> int:
    """Bytes the SSD tier's files take for the plan's SSD slots (:func:`owner_slots`, each in
    whole stripes, ``teraio.core.slots.ssd_file_bytes``)."""
    return int(ssd_file_bytes(np.array(list(owner_slots(plan, "ssd").values()), np.int64)).sum())


def beyond_host(trace: Trace, capacity_bytes: int, host_cap_bytes: int) -> dict[str, int]:
    """What no plan at this capacity and host cap can keep off the drive:
    ``{"bytes": b, "ops": n}``, where b is the most bytes that must be off the GPU beyond the
    host cap at any op (the trace's ``required_bytes`` less the capacity and the cap; 0
    where the two suffice) and n the number of ops where that is positive. The drive holds
    at least b at once, so each iteration writes and reads at least b there."""
    beyond = trace.required_bytes() - capacity_bytes - host_cap_bytes
    return {"bytes": int(max(beyond.max(), 0)), "ops": int((beyond > 0).sum())}


def summary(trace: Trace, plan: MigrationPlan, tiers: TierBandwidth) -> dict:
    sim = simulate(trace, plan, tiers)
    return {"migrations": len(plan.migrations), "exposed": plan.meta.get("n_exposed", 0),
            "bytes_per_tier": plan.bytes_per_tier(), "slot_bytes": slot_bytes(plan),
            "most_bytes_held": {t: int(plan.tier_bytes_held(t).max(initial=0)) for t in ("ssd", "host")},
            "predicted_peak_bytes": plan.predicted_peak_bytes, "shortfall_bytes": plan.shortfall_bytes,
            "ssd_file_bytes": ssd_files(plan),
            "host_arena": plan.meta.get("host_arena", False),
            **{k: plan.meta[k] for k in ("host_arena_auto",) if k in plan.meta},
            "simulated_iteration_s": sim.iteration_seconds, "simulated_stall_s": sim.stall_seconds}


def load_trace(job: Path, released_grads: bool = False) -> Trace:
    """``job``'s trace, as saved or (``released_grads``) as a run with ``release_grads``
    plans it (``Trace.with_released_grads``).

    Raises:
        ValueError: ``job`` has no trace.
    """
    trace = Trace.from_dict(_load(job, "trace"))
    return trace.with_released_grads() if released_grads else trace


def load_plan(job: Path) -> MigrationPlan:
    """``job``'s committed plan.

    Raises:
        ValueError: ``job`` has no plan.
    """
    return MigrationPlan.from_dict(_load(job, "plan"))


def plan_as_committed(trace: Trace, committed: MigrationPlan, host_cap_bytes: int | None = None,
                      host_arena: bool | str | None = None, ssd_cap_bytes: int | None = None,
                      recompute: bool | str = False) -> MigrationPlan:
    """``trace`` planned by the current planner as ``committed`` was: at its capacity, rates,
    host cap (``host_cap_bytes`` if given) and options (host packing: ``host_arena`` if given;
    the SSD files within ``ssd_cap_bytes`` if given, else as committed; ``recompute``, as
    ``plan_fastest`` takes it).

    Raises:
        ValueError: a bad ``host_arena`` (``plan_fastest``).
    """
    meta = committed.meta
    return plan_fastest(trace, committed.capacity_bytes, TierBandwidth(**meta["tiers_gbps"]),
                           host_cap_bytes=meta["host_cap_bytes"] if host_cap_bytes is None else host_cap_bytes,
                           benefit=meta["benefit"], min_tensor_bytes=meta["min_tensor_bytes"],
                           use_ssd=meta["use_ssd"], allow_stalls=meta["allow_stalls"],
                           shared_ssd=meta["shared_ssd"],
                           host_arena=meta.get("host_arena", False) if host_arena is None else host_arena,
                           ssd_cap_bytes=meta.get("ssd_cap_bytes") if ssd_cap_bytes is None else ssd_cap_bytes,
                           recompute=recompute)


def replan(job: Path, host_cap_bytes: int | None = None, host_arena: bool | str | None = None,
           released_grads: bool = False, ssd_cap_bytes: int | None = None) -> dict:
    """The committed plan of ``job`` and the current planner's, side by side; the new plan
    at ``host_cap_bytes`` if given, else at the committed plan's host cap, with
    ``host_arena`` if given, else the committed plan's, and its SSD files within
    ``ssd_cap_bytes`` if given; with ``released_grads`` both plans are simulated on the
    trace as a run with ``release_grads`` plans it.

    Raises:
        ValueError: ``job`` lacks its trace or plan, ``host_cap_bytes`` < 0, or a bad
            ``host_arena`` (``plan_fastest``).
    """
    if host_cap_bytes is not None and host_cap_bytes < 0:
        raise ValueError(f"host_cap_bytes={host_cap_bytes}; must be >= 0 (0: TeraIO-SSD)")
    trace = load_trace(job, released_grads)
    old = load_plan(job)
    meta = old.meta
    tiers = TierBandwidth(**meta["tiers_gbps"])
    host_cap = meta["host_cap_bytes"] if host_cap_bytes is None else host_cap_bytes
    new = plan_as_committed(trace, old, host_cap, host_arena, ssd_cap_bytes)
    return {"job": str(job), "capacity_bytes": old.capacity_bytes, "host_cap_bytes": meta["host_cap_bytes"],
            "replanned_host_cap_bytes": host_cap, "released_grads": released_grads,
            "replanned_ssd_cap_bytes": new.meta["ssd_cap_bytes"],
            "tiers_gbps": meta["tiers_gbps"], "ideal_s": float(trace.op_seconds.sum()),
            "beyond_host": beyond_host(trace, old.capacity_bytes, host_cap),
            "committed": summary(trace, old, tiers), "replanned": summary(trace, new, tiers)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jobs", nargs="+", type=Path, help="job directories with trace and plan")
    ap.add_argument("--host-cap-bytes", type=int, nargs="+", default=[None],
                    help="host caps of the new plans, bytes, one row per job and cap "
                         "(default: each committed plan's; 0: TeraIO-SSD)")
    ap.add_argument("--ssd-cap-bytes", type=int,
                    help="the new plans' room for SSD files, bytes (default: each committed plan's)")
    argv = sys.argv[1:] if argv is None else argv
    args, arena = parse_plan_options(ap, argv)
    rows = [replan(j, cap, arena, args.released_grads, args.ssd_cap_bytes)
            for j in args.jobs for cap in args.host_cap_bytes]
    write_rows(args.out, "benchmarks/replan.py", argv, rows, ("committed", "replanned"))


# --host-arena's values, as plan_fastest's host_arena takes them
HOST_ARENA = {"false": False, "true": True, "auto": "auto"}


def parse_plan_options(ap: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, bool | str | None]:
    """Add ``--host-arena``, ``--released-grads`` and ``--out`` to ``ap``, parse ``argv``:
    the arguments and the host packing as ``plan_fastest`` takes it (None: each committed
    plan's)."""
    ap.add_argument("--host-arena", choices=tuple(HOST_ARENA),
                    help="the new plans' host packing (default: each committed plan's)")
    ap.add_argument("--released-grads", action="store_true",
                    help="plan the trace as a run with release_grads does (Trace.with_released_grads)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    return args, None if args.host_arena is None else HOST_ARENA[args.host_arena]


def write_rows(out: Path, script: str, argv: list[str], rows: list[dict], kinds: tuple[str, ...]) -> None:
    """Write ``rows`` (one per job and host cap, each with a :func:`summary` per kind) and the
    command to ``out`` atomically, and print them."""
    write_atomic(out, json.dumps({"command": shlex.join(["python", script, *argv]), "jobs": rows},
                                 indent=1).encode())
    for r in rows:
        print(r["job"], f"(host cap of the new plans: {r.get('replanned_host_cap_bytes', r['host_cap_bytes'])} B)")
        for k in kinds:
            s = r[k]
            slots = f"slots {s['slot_bytes']} B, " if "slot_bytes" in s else ""
            slots += "host tier as one region, " if s.get("host_arena") else ""
            print(f"  {k}: {slots}moved {s['bytes_per_tier']} B, held at most "
                  f"{s['most_bytes_held']} B, simulated {s['simulated_iteration_s']:.1f} s/iteration "
                  f"(compute {r['ideal_s']:.1f} s)")


if __name__ == "__main__":
    main()
