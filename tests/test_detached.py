"""benchmarks/detached.sh: a run started in its own process session is waited for, and its
archive and log reach OUT only once it has ended."""
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "detached.sh"
STUB = """echo "run $TAG"; i=0; while [ ! -e "$GO" ] && [ $i -lt 150 ]; do sleep 0.2; i=$((i + 1)); done
cat runs/row.json > "$OUT/$TAG.tar.gz"; echo log > "$OUT/$TAG.log"; exit 3
"""


def _sh(tmp_path, *args, **env):
    return subprocess.run(["bash", "benchmarks/detached.sh", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "DETACHED_DIR": str(tmp_path / "state"), **env})


def test_a_detached_run_is_waited_for_and_copied_out_when_it_ends(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / "detached.sh")
    (tmp_path / "benchmarks" / "reference_h200.sh").write_text(STUB)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "row.json").write_text("the row")
    go, out = tmp_path / "go", tmp_path / "out"
    assert "started a" in _sh(tmp_path, "start", "a", GO=str(go)).stdout
    assert _sh(tmp_path, "start", "a", GO=str(go)).returncode == 2  # one run per tag
    early = _sh(tmp_path, "wait", "a", "1", OUT=str(out))
    assert "still running" in early.stdout and not out.exists()
    # a later device call replaces the working tree: the run works in its own copy
    shutil.rmtree(tmp_path / "runs")
    go.touch()
    done = _sh(tmp_path, "wait", "a", "30", OUT=str(out))
    assert "ended rc=3" in done.stdout and "run a" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["a.log", "a.tar.gz"]
    assert (out / "a.tar.gz").read_text() == "the row"


def test_bad_verbs_and_unknown_tags_are_refused(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / "detached.sh")
    bad = _sh(tmp_path, "stop", "a")
    assert bad.returncode == 2 and "unknown verb 'stop': valid are start, wait" in bad.stdout
    assert _sh(tmp_path, "wait", "nope", "1").returncode == 2
