"""benchmarks.swap_bytes: the room of zero_infinity's swap files at an experiment's points."""
import json

from benchmarks import swap_bytes


def test_a_point_fits_a_drive_from_its_swap_bound_up(tmp_path):
    out = tmp_path / "s.json"
    point = "model=llama3_8b fig7.point=full"
    (row,) = [swap_bytes.needed("fig7_h200", point)]
    assert row["model"] == "llama3_8b"
    need = row["swap_bytes"]
    # each of the model's 8.0 B parameters: its FP32 weight, the optimizer's FP32 copy and
    # two AdamW moments (16 B), and most of them their gradient too
    assert 16 * 8.0e9 < need < 20 * 8.1e9
    swap_bytes.main(["--experiment", "fig7_h200", "--points", point, "--free-bytes", str(need - 1), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["points"] == [{**row, "fits": False}] and doc["command"].startswith("python -m benchmarks.swap_bytes")
    swap_bytes.main(["--experiment", "fig7_h200", "--points", point, "--free-bytes", str(need), "--out", str(out)])
    assert json.loads(out.read_text())["points"][0]["fits"] is True
