"""teraio.perf.jobdir: a job folder's files, plain or gzip-compressed, of one run or of one
of several runs in a folder (``prefix``)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from teraio.perf import jobdir
from teraio.perf.synth import layered_trace

ROOT = Path(__file__).resolve().parents[1]


def test_the_plain_file_is_read_before_its_gzip_copy(tmp_path):
    (tmp_path / "result.json.gz").write_bytes(gzip.compress(json.dumps({"status": "packed"}).encode()))
    assert jobdir.side_file(tmp_path, "result.json") == tmp_path / "result.json.gz"
    assert jobdir.result(tmp_path) == {"status": "packed"}
    (tmp_path / "result.json").write_text(json.dumps({"status": "plain"}))
    assert jobdir.result(tmp_path) == {"status": "plain"}
    assert jobdir.side_file(tmp_path, "trace.json") is None


def test_a_prefix_names_one_run_of_a_folder(tmp_path):
    trace = layered_trace(2)
    trace.save(tmp_path / "call1_teraio_mixed_trace.json.gz")
    assert jobdir.trace(tmp_path, "call1_teraio_mixed_").op_names == trace.op_names
    with pytest.raises(ValueError, match=r"no call2_teraio_mixed_trace.json or call2_teraio_mixed_trace.json.gz"):
        jobdir.trace(tmp_path, "call2_teraio_mixed_")


def test_a_committed_job_folder_is_read_whole():
    job = ROOT / "runs/reference/h200/fig9_h200/llama3_8b_4l-teraio_mixed-h200-1ssd-4gb-bs8-mb2-seq3072-t2"
    row, cfg, plan = jobdir.result(job), jobdir.run_config(job), jobdir.plan(job)  # plan and trace: .gz
    trace = jobdir.trace(job)
    assert cfg.point() == row["point"] and plan.n_ops == trace.n_ops
    held, released = trace.required_bytes(), jobdir.trace(job, released_grads=True).required_bytes()
    assert (released <= held).all() and released.sum() < held.sum()  # gradients freed after their update


def test_job_dirs_are_the_folders_with_a_row(tmp_path):
    for name, files in (("a-ideal", ["result.json"]), ("b-teraio_mixed", ["result.json.gz"]), ("c-ideal", []),
                        ("d-ideal", ["trace.json"])):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("{}")
    (tmp_path / "result.json").write_text("{}")  # a file, not a job folder
    assert [p.name for p in jobdir.job_dirs(tmp_path)] == ["a-ideal", "b-teraio_mixed"]
    assert [p.name for p in jobdir.job_dirs(tmp_path, "*ideal*")] == ["a-ideal"]
