"""benchmarks.swap_bytes: zero_infinity's swap lower bound at an experiment's points."""
import json

from benchmarks import swap_bytes


def test_a_point_fits_a_drive_from_its_swap_bound_up(tmp_path):
    out = tmp_path / "s.json"
    point = "model=llama3_8b fig7.point=full"
    (row,) = [swap_bytes.needed("fig7_h200", point)]
    assert row["model"] == "llama3_8b"
    need = row["swap_bytes_at_least"]
    assert need > 12 * 7 * 10**9  # 12 B per element of most of the model's 8.0 B parameters
    swap_bytes.main(["--experiment", "fig7_h200", "--points", point, "--free-bytes", str(need - 1), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["points"] == [{**row, "fits": False}] and doc["command"].startswith("python -m benchmarks.swap_bytes")
    swap_bytes.main(["--experiment", "fig7_h200", "--points", point, "--free-bytes", str(need), "--out", str(out)])
    assert json.loads(out.read_text())["points"][0]["fits"] is True
