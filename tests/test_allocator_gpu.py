"""benchmarks/allocator_gpu.sh: each allocator setting runs the rows it is given, whole, in a
runs dir of its own; bad settings are refused before anything runs."""
import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "allocator_gpu.sh"
# stands in for side_by_side_gpu.sh: one line per call, with what the call was given
STUB = 'echo "$PYTORCH_CUDA_ALLOC_CONF|$ROWS|$RUNS|$OUT|$WHICH|$TRIALS|${PYTORCH_ALLOC_CONF-unset}" >> "$CALLS"\n'


def run_script(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    (tmp_path / "benchmarks").mkdir(exist_ok=True)
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / "allocator_gpu.sh")
    (tmp_path / "benchmarks" / "side_by_side_gpu.sh").write_text(STUB)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    done = subprocess.run(["bash", "benchmarks/allocator_gpu.sh"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={"PATH": os.environ["PATH"], "CALLS": str(calls), "RUNS_ROOT": str(tmp_path),
                                           "OUT": str(tmp_path / "out"), "PYTORCH_ALLOC_CONF": "x", **env})
    return done, [line.split("|") for line in calls.read_text().splitlines()]


def test_each_setting_runs_the_rows_whole(tmp_path):
    rows = "model=llama3_8b_4l fig7.point=seq_short system=teraio_mixed workload.micro_batch_size=4"
    done, calls = run_script(tmp_path, ROWS=rows, TRIALS="0,1",
                             CONFS="a=expandable_segments:True;b=expandable_segments:True,max_split_size_mb:1024")
    assert done.returncode == 0, done.stderr
    assert [c[0] for c in calls] == ["expandable_segments:True", "expandable_segments:True,max_split_size_mb:1024"]
    # the overrides reach the sweep as one value: a setting that ran fig7_h200's default points
    # instead of these (the rows split at their spaces) is what this guards against
    assert [c[1] for c in calls] == [rows, rows]
    assert [c[2] for c in calls] == [str(tmp_path / "allocator_a"), str(tmp_path / "allocator_b")]
    assert [c[3] for c in calls] == [str(tmp_path / "out" / "a"), str(tmp_path / "out" / "b")]
    assert {(c[4], c[5], c[6]) for c in calls} == {("rows", "0,1", "unset")}


def test_a_settings_overrides_join_every_sweep_of_the_rows(tmp_path):
    rows = "model=a system=ideal;model=a system=teraio_mixed workload.micro_batch_size=4"
    done, calls = run_script(tmp_path, ROWS=rows,
                             CONFS="f=expandable_segments:True|hardware.capacity_mode=fraction;"
                                   "r=expandable_segments:True|hardware.capacity_mode=reserve")
    assert done.returncode == 0, done.stderr
    assert [c[0] for c in calls] == ["expandable_segments:True"] * 2
    assert [c[1] for c in calls] == [
        "model=a system=ideal hardware.capacity_mode=fraction;"
        "model=a system=teraio_mixed workload.micro_batch_size=4 hardware.capacity_mode=fraction",
        "model=a system=ideal hardware.capacity_mode=reserve;"
        "model=a system=teraio_mixed workload.micro_batch_size=4 hardware.capacity_mode=reserve"]


def test_bad_settings_are_refused_before_anything_runs(tmp_path):
    for confs, why in (("a=x;a=y", "given twice"), ("a b=x", "give name=setting"), ("a=", "give name=setting"),
                       ("a=|x=1", "give name=setting")):
        done, calls = run_script(tmp_path, CONFS=confs)
        assert done.returncode == 2 and why in done.stderr and calls == [], (confs, done.stderr)
    for rows in ("model=a;;model=b", ";model=a", " "):
        done, calls = run_script(tmp_path, ROWS=rows, CONFS="a=x|y=1")
        assert done.returncode == 2 and "is blank" in done.stderr and calls == [], (rows, done.stderr)
