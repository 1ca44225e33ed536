"""benchmarks/replan.py: committed TeraIO runs re-planned from their traces."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import replan  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "shared_slots" / "replan_fig7_h200.json"


def test_the_committed_replan_is_reproduced():
    """The Granite-8B cut's seq_short run: its committed plan gave each tensor a slot (145.3 GB
    of SSD slots); the shared-slot planner needs 29.1 GB, as the committed file says."""
    (entry,) = [e for e in json.loads(RESULT.read_text())["jobs"] if "granite_8b_8l" in e["job"]
                and "seq2560" in e["job"]]
    again = replan.replan(ROOT / entry["job"])
    for kind in ("committed", "replanned"):
        for key in ("slot_bytes", "bytes_per_tier", "migrations", "exposed", "predicted_peak_bytes"):
            assert again[kind][key] == entry[kind][key], (kind, key)
        assert again[kind]["simulated_iteration_s"] == pytest.approx(entry[kind]["simulated_iteration_s"], rel=1e-9)
    assert round(entry["committed"]["slot_bytes"]["ssd"] / 1e9, 1) == 145.3
    assert round(entry["replanned"]["slot_bytes"]["ssd"] / 1e9, 1) == 29.1
    assert entry["replanned"]["slot_bytes"]["host"] <= entry["host_cap_bytes"]


def test_a_job_without_its_trace_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no trace.json or trace.json.gz"):
        replan.replan(tmp_path)
