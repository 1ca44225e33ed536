"""Roofline (paper Fig. 3) from saved traces, on CPU."""
import numpy as np
import pandas as pd
import pytest

from teraio.roofline import BANDWIDTHS_GBPS, main, roofline
from teraio.synth import layered_trace


def test_main_writes_table_and_figure(tmp_path):
    paths, caps = [], []
    for n_layers, pressure in ((4, 1.6), (6, 2.2)):
        tr = layered_trace(n_layers, mm_seconds=10e-3)
        path = tmp_path / f"toy{n_layers}.json"
        tr.save(path)
        paths.append(path)
        caps.append(int(tr.peak_bytes() / pressure))
    df = main(paths, caps, tmp_path / "out")
    assert len(df) == 2 * len(BANDWIDTHS_GBPS)
    assert set(df["model"]) == {"toy-4x4", "toy-6x4"}
    assert df["modeled"].all() and (df["measure"] == "modeled").all()
    assert df["feasible"].all()
    thr = df["normalized_throughput"]
    assert ((thr > 0) & (thr <= 1)).all()
    for _, g in df.groupby("model"):
        g = g.sort_values("bandwidth_gbps")
        assert g["normalized_throughput"].iloc[-1] > g["normalized_throughput"].iloc[0]
        assert g["n_exposed"].iloc[0] > 0  # at 4 GB/s memory only fits by stalling
    for name in ("roofline.csv", "roofline.parquet", "fig3_roofline.png", "fig3_roofline.pdf"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    again = pd.read_parquet(tmp_path / "out" / "roofline.parquet")
    assert np.allclose(again["normalized_throughput"], thr)


def test_capacity_below_active_bytes_is_nan():
    tr = layered_trace(2)
    df = roofline({"toy": tr}, {"toy": 1 << 20}, bandwidths_gbps=(16,), progress=False)
    assert not df["feasible"].iloc[0] and np.isnan(df["normalized_throughput"].iloc[0])


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="capacity"):
        roofline({"toy": layered_trace(2)}, {}, progress=False)
    with pytest.raises(ValueError, match="one capacity"):
        main([tmp_path / "a.json"], [], tmp_path)
