"""What zero_infinity's swap files take on its drive at points of an experiment, beside a
drive's free bytes: :func:`baselines.zero.swap_bytes_of` (the files as DeepSpeed sizes
them), which the sweep and the runner check before DeepSpeed starts. On CPU, from the
configs alone.

    python -m benchmarks.swap_bytes --experiment fig7_h200 \\
        --points "model=llama3_8b fig7.point=full" "model=granite_8b_8l fig7.point=seq_short" \\
        --free-bytes N --out FILE.json

The file ``--out`` is replaced atomically.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from benchmarks import command
from teraio.files import write_atomic
from teraio.harness.compose import compose_run_config
from baselines import zero


def needed(experiment: str, point: str) -> dict:
    """The point's model and the bytes of its zero_infinity swap files, on one rank."""
    cfg = compose_run_config([f"+experiment={experiment}", *shlex.split(point), "system=zero_infinity"])
    return {"point": point, "model": cfg.model.name, "swap_bytes": zero.swap_bytes_of(cfg)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", required=True)
    ap.add_argument("--points", nargs="+", required=True, help="overrides of one point, quoted")
    ap.add_argument("--free-bytes", type=int, required=True, help="the drive's free bytes")
    ap.add_argument("--out", type=Path, required=True)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    rows = [{**r, "fits": r["swap_bytes"] <= args.free_bytes}
            for r in (needed(args.experiment, p) for p in args.points)]
    doc = {"command": command("benchmarks.swap_bytes", argv),
           "free_bytes": args.free_bytes, "points": rows}
    write_atomic(args.out, json.dumps(doc, indent=1).encode())
    for r in rows:
        print(f"{r['point']}: {r['swap_bytes']} B, {'fits' if r['fits'] else 'does not fit'} "
              f"{args.free_bytes} B free")


if __name__ == "__main__":
    main()
