"""The package layout is the architecture: lower layers never import higher ones.

0 base: configs, the result row, atomic files, signals as an exception, the registry of systems (data only)
1 ``teraio.core``: the paper's profiler, planner and engine with their tiers
2 ``teraio.perf``: the performance model (simulator, the settings it chooses, roofline, synthesis)
3 ``teraio.workload``: models and the training step every system trains
4 ``teraio.systems.*``: the runners (TeraIO, Ideal, ZeRO) and the shared measurement loop
5 ``teraio.harness`` and ``teraio.sweep``: composing, checking and launching runs
6 ``analysis``: tables and figures from rows

Nor do two modules import each other, through any chain (an import circle), at module level or
inside a function.

Sizes: no function of ``teraio`` is longer than :data:`MAX_FUNCTION_LINES`, and the runners
(``teraio.systems``) share state through attributes, never ``nonlocal``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASE = {"teraio", "teraio.config", "teraio.files", "teraio.interrupt", "teraio.result", "teraio.systems"}
MAX_FUNCTION_LINES = 120


def layer(module: str) -> int:
    if module in BASE:
        return 0
    for prefix, n in (("teraio.core", 1), ("teraio.perf", 2), ("teraio.workload", 3), ("teraio.systems.", 4),
                      ("teraio.harness", 5), ("teraio.sweep", 5), ("analysis", 6)):
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


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> modules it imports): its strongly connected
    components of more than one module, each sorted (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next((m for m in edges if m in graph), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_graph(paths: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the other repository modules it imports, at module level or inside a function
    (a module's import of itself is no circle: ``teraio.sweep`` under ``__main__`` imports its
    importable copy, so that launchers pickle a reference to it)."""
    return {m: (imported(path, set(paths)) & set(paths)) - {m} for m, path in paths.items()}


def test_no_import_circle():
    found = circles(import_graph(MODULES))
    assert not found, f"modules that import each other (through a chain): {found}"


def test_the_circle_check_sees_a_circle(tmp_path):
    # a -> b at module level, b -> c inside a function, c -> a: one circle; d only imports it
    # (and itself)
    sources = {"teraio.a": "from teraio.b import x\n", "teraio.b": "def f():\n    import teraio.c\n",
               "teraio.c": "from teraio import a\n", "teraio.d": "from teraio.a import y\nimport teraio.d\n"}
    paths = {}
    for name, text in sources.items():
        paths[name] = tmp_path / f"{name}.py"
        paths[name].write_text(text)
    assert circles(import_graph(paths)) == [["teraio.a", "teraio.b", "teraio.c"]]
    paths["teraio.c"].write_text("x = 1\n")  # the chain broken: no circle
    assert circles(import_graph(paths)) == []


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name (n lines)`` of each function or method of ``path`` longer than ``limit`` lines,
    its docstring included."""
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def nonlocal_lines(path: Path) -> list[int]:
    """Lines of ``path`` holding a ``nonlocal`` statement."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Nonlocal)]


def test_no_function_is_longer_than_the_limit():
    long = {str(p.relative_to(REPO)): f for p in sorted((REPO / "teraio").rglob("*.py")) if (f := long_functions(p))}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_no_runner_shares_state_through_nonlocal():
    found = {str(p.relative_to(REPO)): n for p in sorted((REPO / "teraio" / "systems").rglob("*.py"))
             if (n := nonlocal_lines(p))}
    assert not found, f"nonlocal in {found}: keep the run's state as attributes"


def test_the_size_checks_see_a_long_function_and_a_nonlocal(tmp_path):
    bad = tmp_path / "bad.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    bad.write_text(f"def long():\n{body}\n\ndef short():\n    y = 0\n\n    def inner():\n        nonlocal y\n"
                   "        y = 1\n    return inner\n")
    assert long_functions(bad) == [f"long ({MAX_FUNCTION_LINES + 1} lines)"]
    assert nonlocal_lines(bad) == [8 + MAX_FUNCTION_LINES]
