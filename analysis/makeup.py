"""``python -m analysis.makeup [EXPERIMENT]``: how a scaled experiment's points (default
``fig7_h200``) stand against the paper's memory make-up, estimated from the models' shapes
(:func:`analysis.breakdown.scaled_frame`), as the experiment file quotes it."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import breakdown as bd


def scaled_table_lines(experiment: str = "fig7_h200", conf_dir: Path = bd.CONF_DIR) -> list[str]:
    """:func:`analysis.breakdown.scaled_frame` as Markdown table lines (header first), as the experiment file
    quotes them."""
    f = bd.scaled_frame(experiment, conf_dir)
    head = ["model", "point", "batch", "µbatch", "seq", "est. peak GB", "paper M %", "M here %",
            "persistent %", "paper stage 0 %", "paper stage 1 %", "distance", "largest op % of capacity", "paper's %",
            "AdamW's largest op % of capacity", "ZeRO's one sequence % of capacity",
            "TeraIO-SSD on the drive at once GB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in f.itertuples(index=False):
        cells = [r.model, r.point, r.batch_size, r.micro_batch_size, r.seq_len, f"{r.peak_bytes / 1e9:.1f}",
                 f"{r.paper_m:.2f}", f"{r.m_here:.0f}", f"{100 * r.persistent_share:.1f}",
                 f"{100 * r.paper_persistent_stage0:.1f}", f"{100 * r.paper_persistent_stage1:.1f}",
                 f"{r.distance:.1f}", f"{100 * r.largest_op_share:.0f}", f"{100 * r.paper_largest_op_share:.0f}",
                 f"{100 * r.update_op_share:.0f}", f"{100 * r.zero_sequence_share:.0f}",
                 f"{r.ssd_floor_bytes / 1e9:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m analysis.makeup", description=__doc__)
    ap.add_argument("experiment", nargs="?", default="fig7_h200", choices=bd.SCALED,
                    help="a scaled experiment under conf/experiment")
    print("\n".join(scaled_table_lines(ap.parse_args(argv).experiment)))


if __name__ == "__main__":
    main()
