"""``python -m benchmarks.reference card|plan|status|pack|unpack``: the reference grown call by
call (``benchmarks/reference.yaml``, :mod:`teraio.harness.reference`); ``benchmarks/reference.sh``
runs the first four on the GPU machine, ``unpack`` brings a call's rows home.

    card                      this machine's card folder (h100, h200) and its GPU's name
    plan --card C             the sweeps that run the next missing rows, one per line:
                              EXPERIMENT SWEEP TUNE_TIMEOUT_S OVERRIDE...
    status --card C           per chunk of the list, its rows done (or held)
    pack --card C --gpu NAME --since F --out A --tag T --budget S --ran F [--log F...]
                              the job folders written after F's time into archive A
                              (:mod:`teraio.harness.rowpack`), the sweeps started (lines of
                              --ran) and the logs with them
    unpack A [--runs DIR]     A's folders into runs/reference/<its card>/, its call appended to
                              that folder's COMMAND.md and its logs to logs/<tag>/; then status
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from teraio.harness import reference as ref
from teraio.harness import rowpack

RUNS = Path("runs/reference")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.reference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", type=Path, default=ref.LIST_PATH, help="the list (default benchmarks/reference.yaml)")
    ap.add_argument("--runs", type=Path, default=RUNS, help=f"the card folders' parent (default {RUNS})")
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("card")
    for verb in ("plan", "status"):
        sub.add_parser(verb).add_argument("--card", required=True, choices=sorted(set(ref.CARDS.values())))
    pk = sub.add_parser("pack")
    pk.add_argument("--card", required=True, choices=sorted(set(ref.CARDS.values())))
    pk.add_argument("--gpu", required=True, help="the GPU's name, as card printed it")
    pk.add_argument("--since", type=Path, required=True, help="a file made as the call began")
    pk.add_argument("--out", type=Path, required=True)
    pk.add_argument("--tag", required=True)
    pk.add_argument("--budget", type=int, required=True)
    pk.add_argument("--ran", type=Path, required=True, help="the sweeps started, one line each")
    pk.add_argument("--log", type=Path, nargs="*", default=[])
    up = sub.add_parser("unpack")
    up.add_argument("archive", type=Path)
    return ap


def _rows(card_dir: Path, entries: list[str]) -> dict[str, str]:
    """``<entry>/result.json`` -> its status, for each packed job folder with a row."""
    out = {}
    for e in entries:
        path = card_dir / e / "result.json"
        if path.is_file():
            out[f"{e}/result.json"] = json.loads(path.read_text()).get("status")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        if args.verb == "card":
            name = ref.gpu_name()
            print(ref.card_of(name), name)
            return
        listed = ref.load_list(args.list)
        if args.verb in ("plan", "status"):
            todo = ref.missing(listed, args.runs / args.card, args.card)
            lines = ([i.line() for i in ref.invocations(listed, todo)] if args.verb == "plan"
                     else ref.status_lines(listed, todo))
            print("\n".join(lines))
        elif args.verb == "pack":
            card_dir = args.runs / args.card
            sweeps = [c.sweep for c in listed.chunks]
            if ref.card_of(args.gpu) != args.card:
                raise ValueError(f"--gpu {args.gpu!r} is card {ref.card_of(args.gpu)!r}, not --card {args.card!r}")
            record = {"tag": args.tag, "card": args.card, "gpu_name": args.gpu, "budget_s": args.budget,
                      "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(args.since.stat().st_mtime)),
                      "sweeps": [ln for ln in args.ran.read_text().splitlines() if ln.strip()]}
            entries = rowpack.touched_entries(card_dir, sweeps, args.since.stat().st_mtime)
            record["rows"] = _rows(card_dir, entries)
            rowpack.pack(card_dir, entries, args.out, record, {f"logs/{args.tag}/{p.name}": p for p in args.log if p.is_file()})
            print(f"{args.out}: {len(entries)} entries, rows {json.dumps(record['rows'])}")
        else:
            card = rowpack.read_record(args.archive)["card"]
            record = rowpack.unpack(args.archive, args.runs / card)
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            ref.append_call(args.runs / card / "COMMAND.md", card, record, commit or "unknown")
            print(f"{args.runs / card}: {len(record['entries'])} entries; COMMAND.md: call {record['tag']} added")
            print("\n".join(ref.status_lines(listed, ref.missing(listed, args.runs / card, card))))
    except (OSError, ValueError) as e:
        raise SystemExit(f"python -m benchmarks.reference {args.verb}: {e}") from e


if __name__ == "__main__":
    main()
