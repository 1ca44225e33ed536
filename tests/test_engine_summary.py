"""The committed fig7_h200 engine comparison is what its summary script computes from the
committed rows (``benchmarks.engine_fig7_summary``), and that script refuses rows it
cannot compare."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import engine_fig7_summary
from teraio.core.bandwidth import TierBandwidth

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "benchmarks/results/engine_h200/fig7_trials"
BENCH = ROOT / "benchmarks/results/engine_h200.json"


def test_the_committed_section_is_recomputed_from_the_committed_rows():
    mod = engine_fig7_summary
    committed = json.loads(BENCH.read_text())["fig7_h200"]
    tiers = TierBandwidth(**committed["simulator_tiers_gbps"])
    section = mod.summarize(ROWS, tiers, mod.point_names(ROOT / "conf/experiment/fig7_h200_m_only.yaml"))
    assert section == committed["points"]
    assert set(section) == {"bs_small", "bs_mid"}
    for point in section.values():
        assert point["trials"] == 3 and all(len(v) == 3 for v in point["tokens_per_s"].values())
        assert point["mixed_of_ideal"] == pytest.approx(
            sum(point["tokens_per_s"]["teraio_mixed"]) / sum(point["tokens_per_s"]["ideal"]))


def test_a_row_that_is_not_ok_is_refused_by_name(tmp_path):
    mod = engine_fig7_summary
    job = next(p for p in sorted(ROWS.iterdir()) if "-zero_offload-" in p.name)
    shutil.copytree(job, tmp_path / job.name)
    row = json.loads((job / "result.json").read_text())
    row["status"] = "oom"
    (tmp_path / job.name / "result.json").write_text(json.dumps(row))
    names = mod.point_names(ROOT / "conf/experiment/fig7_h200_m_only.yaml")
    with pytest.raises(ValueError, match=f"{job.name}.*'oom'"):
        mod.summarize(tmp_path, TierBandwidth.uniform(1.0), names)


def test_a_point_without_one_of_the_systems_is_refused(tmp_path):
    mod = engine_fig7_summary
    for job in ROWS.iterdir():
        if "-bs8-" in job.name and "-zero_offload-" not in job.name and job.is_dir():
            shutil.copytree(job, tmp_path / job.name)
    names = mod.point_names(ROOT / "conf/experiment/fig7_h200_m_only.yaml")
    with pytest.raises(ValueError, match="bs_small: no rows of \\['zero_offload'\\]"):
        mod.summarize(tmp_path, TierBandwidth.uniform(1.0), names)
