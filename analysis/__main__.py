"""``python -m analysis <sweep dir> [--out DIR]``: write the sweep's frames, tables and
figures (default ``<sweep dir>/analysis``) and print what was written."""
from __future__ import annotations

import argparse

from .report import analyze


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m analysis", description=__doc__)
    ap.add_argument("sweep_dir", help="directory holding the sweep's result.json files (searched recursively)")
    ap.add_argument("--out", default=None, help="output directory (default: <sweep dir>/analysis)")
    args = ap.parse_args(argv)
    try:
        paths = analyze(args.sweep_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"python -m analysis: {e}") from e
    for rel in paths:
        print(rel)
    index = paths.get("index.md")
    if index is not None:
        print(f"\nsee {index}")


if __name__ == "__main__":
    main()
