"""The package layout is the architecture: lower layers never import higher ones.

0 base: configs, the result row, atomic files, the registry of systems (data only)
1 ``teraio.core``: the paper's profiler, planner and engine with their tiers and model
2 ``teraio.workload``: models and the training step every system trains
3 ``teraio.systems.*``: the runners (TeraIO, Ideal, ZeRO) and the shared measurement loop
4 ``teraio.harness`` and ``teraio.sweep``: composing, checking and launching runs
5 ``analysis``: tables and figures from rows
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASE = {"teraio", "teraio.config", "teraio.files", "teraio.result", "teraio.systems"}


def layer(module: str) -> int:
    if module in BASE:
        return 0
    for prefix, n in (("teraio.core", 1), ("teraio.workload", 2), ("teraio.systems.", 3),
                      ("teraio.harness", 4), ("teraio.sweep", 4), ("analysis", 5)):
        if module == prefix or module.startswith(prefix if prefix.endswith(".") else prefix + "."):
            return n
    raise KeyError(module)


def modules() -> dict[str, Path]:
    out = {}
    for root in ("teraio", "analysis"):
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported(path: Path, known: set[str]) -> set[str]:
    """Every repository module ``path`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in ("teraio", "analysis")}
    return found


MODULES = modules()


def test_every_module_has_a_layer():
    assert {m: layer(m) for m in MODULES}  # KeyError names a module outside the layout


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_higher_layer(module):
    up = {m for m in imported(MODULES[module], set(MODULES)) if layer(m) > layer(module)}
    assert not up, f"{module} (layer {layer(module)}) imports {sorted(up)}"


def test_the_layer_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from teraio.harness import run\n")
    assert imported(bad, set(MODULES)) == {"teraio.harness.run"}
    assert layer("teraio.harness.run") > layer("teraio.core.engine")
