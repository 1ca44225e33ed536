"""The package layout is the architecture: lower layers never import higher ones.

0 base: configs, the result row, atomic files, signals as an exception, the registry of systems (data only)
1 ``teraio.core``: the paper's profiler, planner and engine with their tiers
2 ``teraio.perf``: the performance model (simulator, the settings it chooses, roofline, synthesis)
3 ``teraio.workload``: models and the training step every system trains
4 ``teraio.systems.*``: what every system's runner shares (the measurement loop, measurement, capacity)
5 the runners: TeraIO's run (``teraio.trainer``) and the systems it is compared with (``baselines``)
6 ``teraio.harness`` and ``teraio.sweep``: composing, checking and launching runs
7 ``analysis``: tables and figures from rows

The two kinds of runner stay apart, though they share a layer: ``baselines`` imports the shared
layer (layers 0, 3 and 4), the performance model (``teraio.perf``: a modeled Ideal replays a
TeraIO trace) and, of ``teraio.core``, only the tensor-lifetime profiler and its trace (the
saved activations they count); never TeraIO's trainer (``teraio.trainer``) or engine (the rest
of ``teraio.core``). TeraIO's run never imports ``baselines``.

Nor do two modules import each other, through any chain (an import circle), at module level or
inside a function.

Sizes: no function of ``teraio`` or ``baselines`` is longer than :data:`MAX_FUNCTION_LINES`, and
the runners (``teraio.trainer``, ``baselines``) and their shared layer (``teraio.systems``) share
state through attributes, never ``nonlocal``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASE = {"teraio", "teraio.config", "teraio.files", "teraio.interrupt", "teraio.result", "teraio.systems"}
ROOTS = ("teraio", "baselines", "analysis")
MAX_FUNCTION_LINES = 120
# What ``baselines`` may import of ``teraio.core`` (the rest is TeraIO's engine and planner).
BASELINES_MAY_USE_OF_CORE = ("teraio.core.profiler", "teraio.core.trace")


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer(module: str) -> int:
    if module in BASE:
        return 0
    for prefix, n in (("teraio.core", 1), ("teraio.perf", 2), ("teraio.workload", 3), ("teraio.systems", 4),
                      ("teraio.trainer", 5), ("baselines", 5), ("teraio.harness", 6), ("teraio.sweep", 6),
                      ("analysis", 7)):
        if within(module, prefix):
            return n
    raise KeyError(module)


def breaches(module: str, imports: set[str]) -> set[str]:
    """Of ``imports`` (what ``module`` imports), those the runners' rule forbids it: a module of
    ``baselines`` importing TeraIO's trainer or engine (``teraio.core`` but its profiler and
    trace), a module of TeraIO's run (``teraio.trainer``) importing ``baselines``."""
    if within(module, "baselines"):
        return {m for m in imports if within(m, "teraio.trainer") or
                (within(m, "teraio.core") and not any(within(m, ok) for ok in BASELINES_MAY_USE_OF_CORE))}
    if within(module, "teraio.trainer"):
        return {m for m in imports if within(m, "baselines")}
    return set()


def modules() -> dict[str, Path]:
    out = {}
    for root in ROOTS:
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
        found |= {n for n in names if n.split(".")[0] in ROOTS}
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


def test_the_runners_are_the_layout_the_issue_draws():
    # every compared system's runner lives in baselines/, TeraIO's in teraio/trainer/
    from teraio import systems

    for name in systems.names():
        spec = systems.get(name)
        home = "teraio.trainer" if spec.role == "teraio" else "baselines"
        assert within(spec.runner, home), (name, spec.runner)
        assert spec.runner in MODULES, spec.runner
    assert not [m for m in MODULES if within(m, "teraio") and layer(m) == 5 and not within(m, "teraio.trainer")]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, "baselines") or within(m, "teraio.trainer")))
def test_no_runner_crosses_to_the_other_kind(module):
    crossed = breaches(module, imported(MODULES[module], set(MODULES)))
    assert not crossed, f"{module} imports {sorted(crossed)} (tests/test_layout.py's docstring: the runners' rule)"


def test_the_runners_check_sees_a_breach(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from teraio.core.engine import MigrationEngine\nfrom teraio.perf.jobdir import read_trace\n\n\n"
                   "def f():\n    from teraio.trainer.trainer import TeraIOTrainer\n    import teraio.core.trace\n")
    found = imported(bad, set(MODULES))
    assert breaches("baselines.bad", found) == {"teraio.core.engine", "teraio.trainer.trainer"}
    assert breaches("baselines.bad", {"teraio.core.profiler", "teraio.systems.loop", "teraio.workload.step"}) == set()
    bad.write_text("def f():\n    from baselines.zero import run\n")
    assert breaches("teraio.trainer.bad", imported(bad, set(MODULES))) == {"baselines.zero"}
    assert breaches("teraio.harness.bad", {"baselines.zero"}) == set()  # the harness is above both


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
    long = {str(p.relative_to(REPO)): f for root in ("teraio", "baselines") for p in sorted((REPO / root).rglob("*.py"))
            if (f := long_functions(p))}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_no_runner_shares_state_through_nonlocal():
    runners = [REPO / "teraio" / "systems", REPO / "teraio" / "trainer", REPO / "baselines"]
    found = {str(p.relative_to(REPO)): n for d in runners for p in sorted(d.rglob("*.py")) if (n := nonlocal_lines(p))}
    assert not found, f"nonlocal in {found}: keep the run's state as attributes"


def test_the_size_checks_see_a_long_function_and_a_nonlocal(tmp_path):
    bad = tmp_path / "bad.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    bad.write_text(f"def long():\n{body}\n\ndef short():\n    y = 0\n\n    def inner():\n        nonlocal y\n"
                   "        y = 1\n    return inner\n")
    assert long_functions(bad) == [f"long ({MAX_FUNCTION_LINES + 1} lines)"]
    assert nonlocal_lines(bad) == [8 + MAX_FUNCTION_LINES]
