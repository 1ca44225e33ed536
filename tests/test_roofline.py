"""Roofline (paper Fig. 3) from saved traces, on CPU, and its experiment (+experiment=fig3)."""
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from teraio.harness.fig3 import run as run_fig3
from teraio.perf.roofline import BANDWIDTHS_GBPS, OUTPUT_FILES, main, plot_roofline, roofline
from teraio.perf.synth import layered_trace
from teraio.core.trace import Trace

CONF = Path(__file__).resolve().parents[1] / "conf"


def data_lines(ax) -> list:
    """The plotted lines (seaborn also adds empty legend proxies)."""
    return [ln for ln in ax.get_lines() if len(ln.get_xdata())]


def test_main_writes_table_and_figure(tmp_path):
    paths, caps = [], []
    for n_layers, pressure, suffix in ((4, 1.6, ".json"), (6, 2.2, ".json.gz")):
        tr = layered_trace(n_layers, mm_seconds=10e-3)
        path = tmp_path / f"toy{n_layers}{suffix}"
        tr.save(path)
        paths.append(path)
        caps.append(int(tr.peak_bytes() / pressure))
    df = main(paths, caps, tmp_path / "out")
    assert len(df) == 2 * len(BANDWIDTHS_GBPS)
    assert set(df["model"]) == {"toy-4x4", "toy-6x4"}
    assert df["modeled"].all() and (df["measure"] == "modeled").all()
    moving = df[df["bandwidth_gbps"] > 0]
    assert moving["feasible"].all()
    thr = moving["normalized_throughput"]
    assert ((thr > 0) & (thr <= 1)).all()
    for _, g in moving.groupby("model"):
        g = g.sort_values("bandwidth_gbps")
        assert g["normalized_throughput"].iloc[-1] > g["normalized_throughput"].iloc[0]
        assert g["n_exposed"].iloc[0] > 0  # at 4 GB/s memory only fits by stalling
    for name in OUTPUT_FILES:
        assert (tmp_path / "out" / name).stat().st_size > 0
    again = pd.read_parquet(tmp_path / "out" / "roofline.parquet")
    assert np.allclose(again["normalized_throughput"], df["normalized_throughput"])


def test_zero_bandwidth_runs_only_what_fits():
    tr = layered_trace(3)
    peak = tr.peak_bytes()
    df = roofline({"over": tr, "fits": tr}, {"over": int(peak / 1.5), "fits": peak},
                  bandwidths_gbps=(0,), policies=("fifo", "edf"), progress=False).set_index(["model", "policy"])
    over, fits = df.loc[("over", "fifo")], df.loc[("fits", "edf")]
    assert over["normalized_throughput"] == 0.0 and math.isinf(over["iteration_seconds"])
    assert over["stop_reason"] == "no_bandwidth" and not over["feasible"]
    assert over["shortfall_bytes"] == peak - int(peak / 1.5)
    assert fits["normalized_throughput"] == 1.0 and fits["iteration_seconds"] == fits["ideal_seconds"]


def test_policies_share_one_plan_per_bandwidth():
    tr = layered_trace(4, mm_seconds=10e-3)
    df = roofline({"toy": tr}, {"toy": int(tr.peak_bytes() / 1.8)}, bandwidths_gbps=(8, 32),
                  policies=("fifo", "edf"), progress=False)
    assert len(df) == 4
    plan_cols = ["n_migrations", "n_exposed", "plan_compile_seconds", "shortfall_bytes"]
    for _, g in df.groupby("bandwidth_gbps"):
        assert list(g["policy"]) == ["fifo", "edf"]
        assert (g[plan_cols].nunique() == 1).all()


def test_capacity_below_active_bytes_is_nan():
    tr = layered_trace(2)
    df = roofline({"toy": tr}, {"toy": 1 << 20}, bandwidths_gbps=(16,), progress=False)
    assert not df["feasible"].iloc[0] and np.isnan(df["normalized_throughput"].iloc[0])


def test_plot_has_one_line_per_model_from_the_chosen_policy():
    df = pd.DataFrame({"model": ["a"] * 3 + ["b"] * 3, "bandwidth_gbps": [0, 4, 8] * 2,
                       "normalized_throughput": [0, .5, .9, 0, .3, .6], "policy": "edf"})
    df = pd.concat([df, df.assign(policy="fifo", normalized_throughput=df["normalized_throughput"] / 2)])
    ax = plot_roofline(df, policy="edf")
    lines = data_lines(ax)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
    assert [list(ln.get_ydata()) for ln in lines] == [[0, .5, .9], [0, .3, .6]]
    assert "modeled" in ax.get_ylabel()
    with pytest.raises(ValueError, match="policy='lifo'"):
        plot_roofline(df, policy="lifo")


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="capacity"):
        roofline({"toy": layered_trace(2)}, {}, progress=False)
    with pytest.raises(ValueError, match=r"bandwidths_gbps \[-4\]"):
        roofline({"toy": layered_trace(2)}, {"toy": 1 << 30}, bandwidths_gbps=(-4,), progress=False)
    with pytest.raises(ValueError, match="policies"):
        roofline({"toy": layered_trace(2)}, {"toy": 1 << 30}, policies=("lifo",), progress=False)
    with pytest.raises(ValueError, match="one capacity"):
        main([tmp_path / "a.json"], [], tmp_path)


def fig3_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=["+experiment=fig3", *overrides])


def test_fig3_experiment_makes_the_figure_from_saved_traces(tmp_path):
    small, large = layered_trace(3, mm_seconds=10e-3), layered_trace(5, mm_seconds=10e-3)
    small.save(tmp_path / "small.json.gz")
    large.save(tmp_path / "large.json")
    cfg = fig3_config([f"roofline.models.llama3_8b.trace={tmp_path / 'small.json.gz'}",
                       f"roofline.models.llama3_70b.trace={tmp_path / 'large.json'}",
                       "roofline.models.granite_8b.trace=null", "roofline.bandwidths_gbps=[0,8,64]"])
    df = run_fig3(cfg, tmp_path / "out")
    assert set(df["model"]) == {"llama3_8b", "llama3_70b"}  # granite_8b has no trace: left out
    assert len(df) == 2 * 3 * 2  # models x bandwidths x policies
    assert df["modeled"].all()
    # capacity = peak / the paper's M (percent)
    cap = df[df["model"] == "llama3_70b"]["capacity_bytes"].iloc[0]
    assert cap == int(large.peak_bytes() / 9.4085)
    for name in OUTPUT_FILES:
        assert (tmp_path / "out" / name).stat().st_size > 0
    ax = plot_roofline(pd.read_csv(tmp_path / "out" / "roofline.csv"), policy=cfg.roofline.policies[0])
    assert len(data_lines(ax)) == 2


def test_fig3_config_points_at_the_committed_trace_and_refuses_missing_ones(tmp_path):
    cfg = fig3_config([])
    assert cfg.roofline.bandwidths_gbps == list(BANDWIDTHS_GBPS)
    for model in cfg.roofline.models.values():
        assert (CONF.parent / model.trace).is_file()
    with pytest.raises(ValueError, match="no such file"):
        run_fig3(fig3_config([f"roofline.models.granite_8b.trace={tmp_path / 'nope.json'}"]), tmp_path)
    with pytest.raises(ValueError, match="run with \\+experiment=fig3"):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            run_fig3(compose(config_name="config"), tmp_path)


def test_gzip_trace_round_trips(tmp_path):
    tr = layered_trace(2)
    tr.save(tmp_path / "t.json.gz")
    assert (tmp_path / "t.json.gz").read_bytes()[:2] == b"\x1f\x8b"
    again = Trace.load(tmp_path / "t.json.gz")
    assert again.to_dict() == tr.to_dict()


def test_sweep_entry_point_runs_fig3(tmp_path):
    # `python -m teraio.sweep +experiment=fig3` goes to the roofline, not to a worker.
    import subprocess
    import sys

    layered_trace(3, mm_seconds=10e-3).save(tmp_path / "small.json.gz")
    out = subprocess.run(
        [sys.executable, "-m", "teraio.sweep", "+experiment=fig3", f"sweep.runs_dir={tmp_path / 'runs'}",
         f"roofline.models.llama3_8b.trace={tmp_path / 'small.json.gz'}", "roofline.models.granite_8b.trace=null",
         "roofline.models.llama3_70b.trace=null", "roofline.bandwidths_gbps=[0,16]"],
        capture_output=True, text=True, cwd=CONF.parent, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in OUTPUT_FILES:
        assert (tmp_path / "runs" / "fig3" / name).stat().st_size > 0
    assert not list((tmp_path / "runs" / "fig3").glob("*/result.json"))  # no worker ran
