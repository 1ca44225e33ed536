"""Re-plan committed TeraIO runs with the current planner, on CPU: for each job directory
(its ``trace.json[.gz]`` and ``plan.json[.gz]``), plan the trace again at the plan's own
capacity, bandwidths, host cap (or at each of ``--host-cap-bytes``: 0 plans TeraIO-SSD) and
options (or with ``--host-arena``: false, true or auto, ``plan_fastest``'s ``host_arena``;
with ``--ssd-cap-bytes``, the SSD tier's files within that room, ``ssd_cap_bytes``), and
replay both plans through the simulator. The trace is planned as saved, the profiled
step; ``--released-grads`` plans it as a run with ``release_grads`` does
(``Trace.with_released_grads``).

    python -m benchmarks.replan JOB_DIR [JOB_DIR ...] [--host-cap-bytes N [N ...]]
        [--host-arena {false,true,auto}] [--ssd-cap-bytes N] [--released-grads] --out FILE.json

Per job it reports, for the committed plan and the new one: bytes moved per tier and
iteration, the bytes of each tier's slots (a plan without shared slots, made before
``teraio.core.slots``, needs one slot per tensor name), the most bytes each tier holds at
once (``MigrationPlan.tier_bytes_held``), the exposed migrations, and the simulated
iteration and stall seconds (``teraio.perf.simulator.simulate``, FIFO); and, per host cap,
the floor on the drive's share (``beyond_host``). The rows are
:func:`teraio.perf.replan.replan`'s. The file ``--out`` is replaced atomically.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import command, refusing
from teraio.files import write_atomic
from teraio.perf.replan import replan

# --host-arena's values, as plan_fastest's host_arena takes them
HOST_ARENA = {"false": False, "true": True, "auto": "auto"}


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
    with refusing("benchmarks.replan"):
        rows = [replan(j, cap, arena, args.released_grads, args.ssd_cap_bytes)
                for j in args.jobs for cap in args.host_cap_bytes]
    write_rows(args.out, "benchmarks.replan", argv, rows, ("committed", "replanned"))


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


def write_rows(out: Path, module: str, argv: list[str], rows: list[dict], kinds: tuple[str, ...]) -> None:
    """Write ``rows`` (one per job and host cap, each with a ``plan_summary`` per kind) and the
    command (``benchmarks.command``) to ``out`` atomically, and print them."""
    write_atomic(out, json.dumps({"command": command(module, argv), "jobs": rows}, indent=1).encode())
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
