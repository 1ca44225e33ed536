"""The tools in ``benchmarks/`` are thin command lines on the package: each is listed in
``benchmarks/README.md`` with its ``python -m benchmarks.<name>`` command; none edits
``sys.path`` or patches a private name (what a tool needs of the planner is a documented
keyword, e.g. ``plan_migrations``' ``host_placement``); and ``benchmarks.teraio_core``
composes its runs from ``conf/``."""
from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
PATCHES = ("patch", "object", "dict", "multiple")


def tools() -> list[Path]:
    """The tools: every ``benchmarks/*.py`` but the package's ``__init__``, and every ``*.sh``."""
    return sorted(p for p in [*BENCH.glob("*.py"), *BENCH.glob("*.sh")] if p.name != "__init__.py")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def forbidden(path: Path) -> list[str]:
    """``line: what`` for each use of ``sys.path`` and each ``mock.patch`` (``patch``,
    ``patch.object``, ...) of a private name (``_X``, also as the last part of a dotted
    target) in the Python file ``path``; in a shell script, each ``sys.path``."""
    text = path.read_text()
    if path.suffix != ".py":
        return [f"{n}: sys.path" for n, line in enumerate(text.splitlines(), 1) if "sys.path" in line]
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and _dotted(node) == "sys.path":
            found.append(f"{node.lineno}: sys.path")
        elif isinstance(node, ast.Call) and "patch" in _dotted(node.func).split(".") \
                and _dotted(node.func).split(".")[-1] in PATCHES:
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            names += [_dotted(a) for a in node.args if isinstance(a, ast.Attribute)]
            found += [f"{node.lineno}: {_dotted(node.func)} of {n}" for n in names if _private(n)]
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_no_tool_edits_sys_path_or_patches_a_private_name():
    bad = {p.name: f for p in tools() if (f := forbidden(p))}
    assert not bad, f"benchmarks/ tools that edit sys.path or patch private names: {bad}"


def test_the_check_sees_a_sys_path_edit_and_a_private_patch(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nfrom unittest import mock\nimport teraio.core.planner as pm\n"
                   "sys.path.insert(0, '.')\nsys.path[:0] = ['x']\n"
                   "with mock.patch.object(pm, '_Planner', object):\n    pass\n"
                   "with mock.patch('teraio.core.planner._Planner'):\n    pass\n"
                   "with mock.patch.object(pm, 'plan_migrations', None):\n    pass\n")
    assert forbidden(bad) == ["4: sys.path", "5: sys.path", "6: mock.patch.object of _Planner",
                              "8: mock.patch of teraio.core.planner._Planner"]
    sh = tmp_path / "bad.sh"
    sh.write_text("python - <<'PY'\nimport sys; sys.path.insert(0, '.')\nPY\n")
    assert forbidden(sh) == ["2: sys.path"]


def unlisted(readme: str, paths: list[Path]) -> list[str]:
    """Tools of ``paths`` without a row of their own in ``readme``'s table (a line starting
    ``| `<file name>` |``) holding their command: ``python -m benchmarks.<name>`` for a
    Python tool, ``bash benchmarks/<file>`` for a shell script."""
    rows = {m.group(1): line for line in readme.splitlines() if (m := re.match(r"\| `([\w.]+)` \|", line))}
    out = []
    for p in paths:
        cmd = f"python -m benchmarks.{p.stem}" if p.suffix == ".py" else f"bash benchmarks/{p.name}"
        if cmd not in rows.get(p.name, ""):
            out.append(p.name)
    return out


def test_every_tool_is_listed_with_its_command():
    assert len(tools()) >= 20
    missing = unlisted((BENCH / "README.md").read_text(), tools())
    assert not missing, f"benchmarks/README.md lacks a row with the command of {missing}"


def test_the_listing_check_sees_a_missing_row_and_a_missing_command():
    readme = ("| `a.py` | x | `python -m benchmarks.a --out f` |\n| `b.py` | y | `python benchmarks/b.py` |\n"
              "| `c.sh` | z | `bash benchmarks/c.sh` |\n")
    paths = [Path(n) for n in ("a.py", "b.py", "c.sh", "d.py")]
    assert unlisted(readme, paths) == ["b.py", "d.py"]


def test_teraio_core_composes_its_runs_from_conf():
    """Ideal uncapped, the TeraIO systems at ``--capacity-gib``; the model, machine (its link
    rates) and each system's options as ``conf/`` gives them; overrides after the options
    win."""
    import yaml

    from benchmarks import teraio_core
    from teraio.harness.compose import compose_run_config

    hw = yaml.safe_load((REPO / "conf" / "hardware" / "h200.yaml").read_text())
    args = teraio_core.parser().parse_args(["--out", "x", "--host-cap-gib", "100", "--batch", "1",
                                            "hardware.ssd_write_gbps=2.0"])
    ideal, mixed = (compose_run_config(teraio_core.overrides(s, args)) for s in ("ideal", "teraio_mixed"))
    assert ideal.hardware.gpu_capacity_bytes is None
    assert mixed.hardware.gpu_capacity_bytes == 70 << 30 and mixed.hardware.host_mem_cap_bytes == 100 << 30
    assert (mixed.model.name, mixed.model.n_layers, mixed.model.dim) == ("llama3_8b", 32, 4096)
    assert (mixed.workload.batch_size, mixed.workload.micro_batch_size, mixed.workload.seq_len) == (1, 1, 2048)
    assert mixed.hardware.ssd_write_gbps == 2.0
    assert (mixed.hardware.ssd_read_gbps, mixed.hardware.host_d2h_gbps, mixed.hardware.host_h2d_gbps) == \
        (hw["ssd_read_gbps"], hw["host_d2h_gbps"], hw["host_h2d_gbps"])
    assert mixed.system.options["host_arena"] == "auto"  # conf/system/teraio_ssd.yaml's
    cut = teraio_core.parser().parse_args(["--out", "x", "--layers", "4"])
    assert compose_run_config(teraio_core.overrides("ideal", cut)).model.name == "llama3_8b_4l"


def test_a_host_placement_comes_without_host_arena():
    """``plan_migrations``' ``host_placement`` (what ``benchmarks.host_packing`` passes) is a
    callable, and not one beside the host region."""
    from teraio.core.bandwidth import TierBandwidth
    from teraio.core.planner import plan_migrations
    from teraio.perf.synth import layered_trace

    trace = layered_trace(2, mm_seconds=10e-3)
    args = (trace, trace.peak_bytes() // 2, TierBandwidth.uniform(1000.0), 1 << 30)
    with pytest.raises(ValueError, match="host_placement=.* with host_arena=True; valid: a callable"):
        plan_migrations(*args, host_arena=True, host_placement=lambda n, a, b, cap: None)
    with pytest.raises(ValueError, match="host_placement=3 with host_arena=False"):
        plan_migrations(*args, host_placement=3)
    placed = []

    class Everywhere:  # room everywhere, each placement recorded
        held_bytes = 0

        def __init__(self, n_ops, a, b, cap):
            self.n = n_ops

        def room(self, periods, nbytes):
            return np.ones(len(periods), bool)

        def place(self, period, nbytes):
            placed.append(period)

    plan = plan_migrations(*args, use_ssd=False, allow_stalls=True, host_placement=Everywhere)
    host = [m for m in plan.migrations if m.tier == "host"]
    assert host and len(placed) == len(host)
    assert all(m.slot == m.name and m.offset == -1 for m in host)


def regenerated(tmp_path, monkeypatch, tool, committed_file: str, key: str) -> tuple[list, list, list[str]]:
    """``(fresh, committed, argv)``: the entries under ``key`` of
    ``benchmarks/results/<committed_file>`` and of its command (``tool.main`` with its recorded
    arguments ``argv``) run again from the repository root, its ``--out`` into ``tmp_path``."""
    committed = json.loads((BENCH / "results" / committed_file).read_text())
    argv = shlex.split(committed["command"])[3:]
    out = tmp_path / "regenerated.json"
    argv[argv.index("--out") + 1] = str(out)
    monkeypatch.chdir(REPO)
    tool.main(argv)
    return json.loads(out.read_text())[key], committed[key], argv


@pytest.mark.parametrize("name", ["recompute_h100.json", "replay_microbatch_h100.json"])
def test_the_committed_replays_regenerate_from_their_rows(tmp_path, monkeypatch, name):
    """``benchmarks/results/recompute_h100.json`` and ``replay_microbatch_h100.json`` (plans
    whose host copies are launched in deadline order among them) are what their commands
    compute from the committed rows (measured means, plans, simulated iterations)."""
    from benchmarks import replay_runs

    fresh, committed, _ = regenerated(tmp_path, monkeypatch, replay_runs, name, "jobs")
    assert [j["job"] for j in fresh] == [j["job"] for j in committed]
    for new, old in zip(fresh, committed):
        assert new.keys() == old.keys()
        for key, value in old.items():
            if isinstance(value, float):
                assert new[key] == pytest.approx(value, rel=1e-9), (new["job"], key)
            else:
                assert new[key] == value, (new["job"], key)


def test_the_committed_tail_offloads_regenerate_from_their_rows(tmp_path, monkeypatch):
    """``benchmarks/results/tail_offloads/committed_runs.json`` is what its command computes
    from the committed rows, and no plan simulates more than 0.01 % slower with its tail
    offloads launched as the next step starts."""
    from benchmarks import tail_offloads

    fresh, committed, _ = regenerated(tmp_path, monkeypatch, tail_offloads, "tail_offloads/committed_runs.json", "jobs")
    for new, old in zip(fresh, committed, strict=True):
        assert new.keys() == old.keys()
        for key, value in old.items():
            assert new[key] == (pytest.approx(value, rel=1e-9) if isinstance(value, float) else value), (new["job"], key)
        assert new["next_step_s"] <= new["in_step_s"] * (1 + 1e-4)


def test_the_committed_microbatch_plans_regenerate_from_their_traces(tmp_path, monkeypatch):
    """``benchmarks/results/microbatch_plans/llama3_8b_cut_h100.json`` is what its command
    computes from the committed run and traces; a trace given without its label is refused
    before anything is planned."""
    from benchmarks import microbatch_plans

    fresh, committed, argv = regenerated(tmp_path, monkeypatch, microbatch_plans,
                                         "microbatch_plans/llama3_8b_cut_h100.json", "traces")
    assert [t["label"] for t in fresh] == [t["label"] for t in committed]
    for new, old in zip(fresh, committed):
        for setting in microbatch_plans.RECOMPUTE:
            assert new[setting].pop("bytes_per_tier") == old[setting].pop("bytes_per_tier")
            assert new[setting] == pytest.approx(old[setting], rel=1e-9), (new["label"], setting)
        assert new["ideal_s"] == pytest.approx(old["ideal_s"], rel=1e-9)
    with pytest.raises(SystemExit):
        microbatch_plans.main([argv[0], "--trace", "no_label.json.gz", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_a_replay_as_run_frees_host_offloads_without_a_wait_where_the_run_did():
    """``benchmarks.replay_runs``' as-run replay takes ``stream_frees`` from the row's config:
    ``device_waits`` (default true) on a CUDA device."""
    from benchmarks.replay_runs import run_stream_frees

    def row(device, **options):
        return {"config": {"system": {"options": options}, "hardware": {"device": device}}}

    assert run_stream_frees(row("cuda")) and run_stream_frees(row("cuda:1", device_waits=True))
    assert not run_stream_frees(row("cuda", device_waits=False)) and not run_stream_frees(row("cpu"))
