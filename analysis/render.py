"""Write a display table as Markdown and LaTeX (booktabs), with its caption and notes.

Own writers rather than ``DataFrame.to_markdown`` (needs ``tabulate``, not a dependency) or
``Styler.to_latex`` (escapes nothing by default, so every cell would need care anyway).
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

FAILED = "×"  # the paper's Fig. 7 mark for a run that failed (OOM, error, timeout)
NA = "n/a"
NOT_RUN = "not run"  # a system the sweep's not_run.yaml says has no row at this point

_LATEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
          "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}",
          "±": r"$\pm$", "×": r"$\times$", "÷": r"$\div$", "≥": r"$\geq$", "≤": r"$\leq$",
          "≠": r"$\neq$", "→": r"$\rightarrow$", "–": "--", "—": "---", "µ": r"$\mu$"}


def fmt(x, digits: int | None = None) -> str:
    """A number for a table cell: ``n/a`` for NaN/None; 1 decimal at ≥ 100, 2 at ≥ 1,
    else 3 significant digits, unless ``digits`` fixes the decimals."""
    if x is None or (isinstance(x, float) and math.isnan(x)) or x is pd.NA:
        return NA
    x = float(x)
    if digits is not None:
        return f"{x:.{digits}f}"
    if abs(x) >= 100:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def fmt_ci(mean, half, digits: int | None = None) -> str:
    """``mean ± half``, just ``mean`` when the half-width is NaN (n < 2)."""
    if half is None or (isinstance(half, float) and math.isnan(half)):
        return fmt(mean, digits)
    return f"{fmt(mean, digits)} ± {fmt(half, digits)}"


def latex_escape(text: str) -> str:
    return "".join(_LATEX.get(ch, ch) for ch in str(text))


def to_markdown(df: pd.DataFrame, caption: str, notes: list[str] = ()) -> str:
    def cell(v) -> str:
        return str(v).replace("|", r"\|").replace("\n", " ")
    lines = [f"**{caption}**", "", "| " + " | ".join(cell(c) for c in df.columns) + " |",
             "|" + "|".join("---" for _ in df.columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def to_latex(df: pd.DataFrame, caption: str, label: str, notes: list[str] = ()) -> str:
    cols = "l" * len(df.columns)
    lines = [r"\begin{table}[t]", r"\centering\small",
             rf"\caption{{{latex_escape(caption)}}}", rf"\label{{tab:{label}}}",
             rf"\begin{{tabular}}{{{cols}}}", r"\toprule",
             " & ".join(latex_escape(c) for c in df.columns) + r" \\", r"\midrule"]
    lines += [" & ".join(latex_escape(v) for v in row) + r" \\"
              for row in df.itertuples(index=False)]
    lines += [r"\bottomrule", r"\end{tabular}"]
    if notes:
        lines += [r"\par\footnotesize"] + [latex_escape(n) + r"\\" for n in notes]
    lines += [r"\end{table}"]
    return "\n".join(lines) + "\n"


def write_table(df: pd.DataFrame, stem: Path, caption: str, notes: list[str] = ()) -> list[Path]:
    """Write ``<stem>.md`` and ``<stem>.tex``; return both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    md, tex = stem.with_suffix(".md"), stem.with_suffix(".tex")
    md.write_text(to_markdown(df, caption, notes))
    tex.write_text(to_latex(df, caption, stem.name, notes))
    return [md, tex]
