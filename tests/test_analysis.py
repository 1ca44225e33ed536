"""Tables from hand-made result rows hold exactly the expected
numbers; figures are written with the expected bars and lines; pandas 3 + seaborn 0.13
split grouped data correctly."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pandas as pd
import pytest
import seaborn as sns
from matplotlib.figure import Figure

from analysis import aggregate as agg
from analysis import analyze, load_sweep
from analysis.load import describe
from analysis.__main__ import main
from analysis.bandwidth import op_bandwidth, share_above
from analysis.cost import cost_efficiency, cost_frame, cost_saving, resolve_prices
from analysis.figures import (NoData, fig7_throughput, fig8_breakdown, fig9_host_memory,
                              fig10_bandwidth, slot)
from analysis.stats import mean_ci, t_interval, t_quantile
from teraio.result import result_row, write_result

GIB = 2**30
T1 = math.tan(math.pi * 0.475)                 # t_{0.975, df=1}, closed form
T2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)       # t_{0.975, df=2}, closed form
PRICES = {"server_base": 1000.0, "server_1tb": 1500.0, "ssd_each": 100.0, "n_ssd": 2,
          "pure_gpu_servers": 9000.0, "source": "test prices"}
INSTRUMENTED = {"ideal", "teraio_ssd", "teraio_mixed"}


def write_run(root, name, *, system, batch, seq, micro, trial, tps=None, status="ok",
              host_cap=8 * GIB, n_ssd=2, m=1.5, artifacts=None, hardware="cpu_test",
              measure="measured", iteration_extra=None, device="cuda"):
    """One hand-made result.json: two measured iterations at ``tps`` tokens/s; TeraIO and
    Ideal report stalls (10 % of the time) and migration (50 %), ZeRO reports neither;
    ``iteration_extra`` is added to each iteration; ``device``: the config's, a GPU's unless
    told."""
    point = {"model": "tiny", "system": system, "hardware": hardware, "batch_size": batch,
             "micro_batch_size": micro, "seq_len": seq, "trial": trial}
    config = {"hardware": {"name": hardware, "device": device, "host_mem_cap_bytes": host_cap,
                           "ssd_dirs": [f"/ssd{i}" for i in range(n_ssd)], "prices": PRICES,
                           "n_gpus": 1}}
    r = result_row(point, config)
    r["status"] = status
    r["measure"] = measure
    r["memory_pressure"] = m
    r["capacity_bytes"] = 4 * GIB
    if status != "ok":
        r["error"] = f"{status}: hand-made failure"
    else:
        tokens = batch * seq
        s = tokens / tps
        inst = system in INSTRUMENTED
        r["iterations"] = [{
            "step": k, "seconds": s, "tokens": tokens, "tokens_per_s": tps, "loss": 1.0,
            "stall_count": 2 if inst else None, "stall_seconds": 0.1 * s if inst else None,
            "migration_seconds": 0.5 * s if inst else None,
            "bytes_offloaded": {"ssd": 1e9 if inst else None, "host": 2e9 if inst else None},
            "bytes_prefetched": {"ssd": 1e9 if inst else None, "host": 2e9 if inst else None},
            **(iteration_extra or {}),
        } for k in (3, 4)]
        r["tokens_per_s"] = tps
        r["stall_count"] = 4 if inst else None
        r["stall_seconds"] = 0.2 * s if inst else None
        r["peak_allocated_bytes"] = 3 * GIB
        r["peak_reserved_bytes"] = 3.5 * GIB
        r["peak_host_rss_bytes"] = (5 + trial) * GIB
        r["artifacts"] = artifacts or {}
    if micro is None:  # as rows made before the host peak was recorded
        del r["peak_host_rss_bytes"]
    job = root / name
    job.mkdir(parents=True)
    write_result(job / "result.json", r)
    return job


def make_sweep(root):
    """Config A (bs4_seq64) with every system, one teraio_ssd trial failed; config B
    (bs8_seq64) with ZeRO-Offload OOM in every trial, ZeRO-Infinity not run, and
    TeraIO-SSD rows that lack micro_batch_size."""
    A = dict(batch=4, seq=64, micro=1)
    B = dict(batch=8, seq=64, micro=2, m=1.8)
    for sysname, vals in {"ideal": [100, 110], "teraio_mixed": [90, 96, 93],
                          "zero_offload": [60, 64], "zero_infinity": [50, 55]}.items():
        for t, v in enumerate(vals):
            arts = ({"transfers": "transfers.csv", "oplog": "oplog.csv"}
                    if sysname == "teraio_mixed" and t == 0 else None)
            job = write_run(root, f"A_{sysname}_{t}", system=sysname, trial=t, tps=v,
                            artifacts=arts, **A)
            if arts:
                write_engine_logs(job)
    write_run(root, "A_teraio_ssd_0", system="teraio_ssd", trial=0, tps=80, **A)
    write_run(root, "A_teraio_ssd_1", system="teraio_ssd", trial=1, tps=84, **A)
    write_run(root, "A_teraio_ssd_2", system="teraio_ssd", trial=2, status="error", **A)
    for sysname, vals in {"ideal": [200, 210], "teraio_mixed": [150, 160]}.items():
        for t, v in enumerate(vals):
            write_run(root, f"B_{sysname}_{t}", system=sysname, trial=t, tps=v, **B)
    for t, v in enumerate([120, 130]):
        write_run(root, f"B_teraio_ssd_{t}", system="teraio_ssd", trial=t, tps=v,
                  **{**B, "micro": None})
    for t in (0, 1):
        write_run(root, f"B_zero_offload_{t}", system="zero_offload", trial=t, status="oom", **B)
    return root


def write_engine_logs(job):
    pd.DataFrame({"step": [4] * 4, "op": [0, 1, 2, 3], "op_name": ["mm", "add", "mm", "relu"],
                  "t_start_s": [0.0, 1.0, 2.0, 3.0], "seconds": [1.0] * 4,
                  "stall_s": [0.0] * 4}).to_csv(job / "oplog.csv", index=False)
    pd.DataFrame({"step": [4, 4, 4, 3], "tier": ["ssd", "host", "ssd", "ssd"],
                  "direction": ["offload", "prefetch", "prefetch", "offload"],
                  "nbytes": [2e9, 3e9, 1e9, 9e9], "op_issued": [0, 1, 3, 0],
                  "op_done": [1, 2, 3, 0], "t_issued_s": [0.0, 1.5, 3.5, 0.0],
                  "t_done_s": [2.0, 3.0, 3.5, 1.0]}).to_csv(job / "transfers.csv", index=False)


@pytest.fixture
def sweep_dir(tmp_path):
    return make_sweep(tmp_path / "sweepA")


def row(df, **keys):
    sel = np.ones(len(df), bool)
    for k, v in keys.items():
        sel &= (df[k].isna() if v is None else df[k] == v).to_numpy(bool)
    assert sel.sum() == 1, f"{keys}: {sel.sum()} rows"
    return df[sel].iloc[0]


# ---- statistics ------------------------------------------------------------------------

def test_t_quantile_matches_closed_forms_and_table():
    assert t_quantile(0.975, 1) == pytest.approx(T1, rel=1e-12)
    assert t_quantile(0.975, 2) == pytest.approx(T2, rel=1e-12)
    table = [3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
             2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
             2.052, 2.048, 2.045, 2.042]
    assert [round(t_quantile(0.975, df), 3) for df in range(3, 31)] == table
    assert t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-6)
    assert t_quantile(0.025, 5) == -t_quantile(0.975, 5)
    with pytest.raises(ValueError, match="p=1.5"):
        t_quantile(1.5, 3)


def test_mean_ci_excludes_nan_and_needs_two_values():
    mean, half, n = mean_ci([90.0, 96.0, float("nan"), 93.0])
    assert (mean, n) == (93.0, 3)
    assert half == pytest.approx(T2 * 3.0 / math.sqrt(3), rel=1e-12)
    assert math.isnan(mean_ci([5.0])[1]) and mean_ci([])[2] == 0


# ---- loading ---------------------------------------------------------------------------

def test_load_frames_keep_failed_and_missing_keys(sweep_dir):
    (sweep_dir / "junk").mkdir()
    (sweep_dir / "junk" / "result.json").write_text("{not json")
    with pytest.warns(UserWarning, match="junk"):
        sweep = load_sweep(sweep_dir)
    runs, its = sweep.runs, sweep.iterations
    assert sweep.name == "sweepA" and len(sweep.skipped) == 1
    assert len(runs) == 20
    assert runs["status"].value_counts().to_dict() == {"ok": 17, "oom": 2, "error": 1}
    assert runs["micro_batch_size"].isna().sum() == 2
    assert str(runs["batch_size"].dtype) == "Int64"
    assert set(runs["config"]) == {"bs4_seq64", "bs8_seq64"}
    assert (runs["n_ssd"] == 2).all() and (runs["host_mem_cap_bytes"] == 8 * GIB).all()
    assert len(its) == 2 * 17
    mixed = its[(its["system"] == "teraio_mixed") & (its["trial"] == 0) & (its["batch_size"] == 4)]
    s = 256 / 90
    assert mixed["overlapped_seconds"].tolist() == pytest.approx([0.4 * s] * 2)
    assert mixed["compute_seconds"].tolist() == pytest.approx([0.5 * s] * 2)
    zero = its[its["system"] == "zero_offload"]
    assert zero["stall_seconds"].isna().all() and zero["compute_seconds"].isna().all()


def test_load_rejects_empty_dir(tmp_path):
    with pytest.raises(ValueError, match="no loadable result.json"):
        load_sweep(tmp_path)


# ---- tables --------------------------------------------------------------------------

def test_throughput_numbers_exact(sweep_dir):
    sweep = load_sweep(sweep_dir)
    s = agg.add_pct_of_ideal(agg.summarize_runs(sweep.runs))
    assert len(s) == 9                                  # 5 systems in A, 4 in B (one lacks µbatch)
    mixed = row(s, system="teraio_mixed", batch_size=4)
    assert (mixed["n"], mixed["n_failed"]) == (3, 0)
    assert mixed["tokens_per_s_mean"] == 93.0
    assert mixed["tokens_per_s_ci95"] == pytest.approx(T2 * 3.0 / math.sqrt(3), rel=1e-12)
    assert mixed["pct_of_ideal"] == pytest.approx(100 * 93 / 105, rel=1e-12)
    assert mixed["ideal_measure"] == "measured"
    ssd = row(s, system="teraio_ssd", batch_size=4)     # the failed trial is excluded
    assert (ssd["n"], ssd["n_failed"], ssd["failures"]) == (2, 1, "error")
    assert ssd["tokens_per_s_mean"] == 82.0
    assert ssd["tokens_per_s_ci95"] == pytest.approx(T1 * 2.0, rel=1e-12)  # sd·t/√2, sd = 2√2
    oom = row(s, system="zero_offload", batch_size=8)
    assert (oom["n"], oom["n_failed"], oom["failures"]) == (0, 2, "oom×2")
    assert math.isnan(oom["tokens_per_s_mean"]) and math.isnan(oom["pct_of_ideal"])
    assert (mixed["measured_steps"], oom["measured_steps"]) == ("2", "")
    nokey = row(s, system="teraio_ssd", batch_size=8, micro_batch_size=None)
    assert nokey["n"] == 2 and nokey["tokens_per_s_mean"] == 125.0
    assert nokey["pct_of_ideal"] == pytest.approx(100 * 125 / 205)
    assert oom["memory_pressure"] == 1.8
    assert ((s["system"] == "zero_infinity") & (s["batch_size"] == 8)).sum() == 0


def test_speedups_exact(sweep_dir):
    sweep = load_sweep(sweep_dir)
    sp = agg.speedups(agg.select_best(agg.summarize_runs(sweep.runs)))
    assert len(sp) == 8
    get = lambda t, z, b: row(sp, teraio=t, zero=z, batch_size=b)
    assert get("teraio_ssd", "zero_offload", 4)["speedup"] == pytest.approx(82 / 62)
    assert get("teraio_ssd", "zero_infinity", 4)["speedup"] == pytest.approx(82 / 52.5)
    assert get("teraio_mixed", "zero_offload", 4)["speedup"] == pytest.approx(93 / 62)
    assert get("teraio_mixed", "zero_infinity", 4)["speedup"] == pytest.approx(93 / 52.5)
    b_off = get("teraio_mixed", "zero_offload", 8)
    assert math.isnan(b_off["speedup"]) and b_off["note"] == "ZeRO-Offload failed (oom×2)"
    assert get("teraio_ssd", "zero_infinity", 8)["note"] == "ZeRO-Infinity not run"
    summ = agg.speedup_summary(sp)
    both = row(summ, teraio="teraio_mixed", zero="both")
    assert both["n_points"] == 2
    assert both["mean"] == pytest.approx((93 / 62 + 93 / 52.5) / 2)
    assert both["geomean"] == pytest.approx(math.sqrt(93 / 62 * 93 / 52.5))
    assert both["max"] == pytest.approx(93 / 52.5)


def test_the_users_baselines_get_their_own_speedups_outside_the_zero_series(tmp_path):
    """TeraIO over each baseline users switch on today is its own pair; the series row
    ("both", the paper's ZeRO series of claims C1/C3) stays ZeRO-Offload and ZeRO-Infinity."""
    wl = dict(batch=4, seq=64, micro=1, trial=0)
    for name, system, tps in (("m", "teraio_mixed", 100), ("zo", "zero_offload", 50), ("zi", "zero_infinity", 25),
                              ("ac", "ideal_ac", 200), ("fs", "fsdp_offload", 40)):
        write_run(tmp_path / "s", name, system=system, tps=tps, **wl)
    sp = agg.speedups(agg.select_best(agg.summarize_runs(load_sweep(tmp_path / "s").runs)))
    get = lambda z: row(sp, teraio="teraio_mixed", zero=z)
    assert get("ideal_ac")["speedup"] == pytest.approx(0.5) and get("fsdp_offload")["speedup"] == pytest.approx(2.5)
    assert "torchao_offload" not in set(sp["zero"])  # not in this sweep: no pair
    summ = agg.speedup_summary(sp)
    both = row(summ, teraio="teraio_mixed", zero="both")
    assert both["n_points"] == 2 and both["mean"] == pytest.approx((2 + 4) / 2)
    assert row(summ, teraio="teraio_mixed", zero="ideal_ac")["mean"] == pytest.approx(0.5)


def test_pct_of_ideal_summary(sweep_dir):
    best = agg.add_pct_of_ideal(agg.select_best(agg.summarize_runs(load_sweep(sweep_dir).runs)))
    summ = agg.pct_of_ideal_summary(best)
    mixed = row(summ, system="teraio_mixed")
    assert mixed["n_points"] == 2
    assert mixed["mean"] == pytest.approx((100 * 93 / 105 + 100 * 155 / 205) / 2)
    assert row(summ, system="zero_offload")["n_points"] == 1     # its OOM point is left out
    assert "ideal" not in set(summ["system"])


def test_iteration_summary_exact(sweep_dir):
    its = agg.summarize_iterations(load_sweep(sweep_dir).iterations)
    mixed = row(its, system="teraio_mixed", batch_size=4)
    secs = [256 / v for v in (90, 96, 93)]
    assert mixed["n"] == 3 and mixed["n_iterations"] == 6 and mixed["instrumented"]
    assert mixed["stall_seconds_mean"] == pytest.approx(0.1 * np.mean(secs))
    assert mixed["stall_seconds_ci95"] == pytest.approx(
        T2 * 0.1 * np.std(secs, ddof=1) / math.sqrt(3))
    assert mixed["stall_share"] == pytest.approx(0.1)
    assert mixed["migration_gbps"] == pytest.approx(6e9 * 6 / (2 * sum(secs)) / 1e9)
    zero = row(its, system="zero_offload", batch_size=4)
    assert not zero["instrumented"] and math.isnan(zero["stall_seconds_mean"])


def test_written_tables_show_values_failures_and_missing_keys(sweep_dir, tmp_path):
    paths = analyze(sweep_dir, tmp_path / "out")
    md = paths["tables/throughput.md"].read_text()
    assert ("sweep sweepA: 20 runs (17 ok, 3 failed), 2–3 trial(s) per point; hardware cpu_test "
            "(no GPU: a machinery check, not comparable with the paper)") in md
    lines = {tuple(c.strip() for c in ln.strip("|").split("|")) for ln in md.splitlines()
             if ln.startswith("| tiny")}
    assert ("tiny", "cpu_test", "bs4_seq64", "8.00", "2", "1", "TeraIO-Mixed", "measured", "3", "n/a", "2",
            "0", f"93.00 ± {T2 * math.sqrt(3):.2f}", "88.6", "measured") in lines
    assert ("tiny", "cpu_test", "bs4_seq64", "8.00", "2", "1", "TeraIO-SSD", "measured", "2", "n/a", "2",
            "1 (error)", f"82.00 ± {2 * T1:.2f}", f"{100 * 82 / 105:.1f}", "measured") in lines
    assert ("tiny", "cpu_test", "bs8_seq64", "8.00", "2", "2", "ZeRO-Offload", "measured", "0", "n/a", "n/a",
            "2 (oom×2)", "×", "×", "measured") in lines
    assert ("tiny", "cpu_test", "bs8_seq64", "8.00", "2", "n/a", "TeraIO-SSD", "measured", "2", "n/a", "2",
            "0", f"125.0 ± {T1 * 5 * math.sqrt(2) / math.sqrt(2):.2f}", f"{100 * 125 / 205:.1f}",
            "measured") in lines
    tex = paths["tables/throughput.tex"].read_text()
    assert r"93.00 $\pm$ 7.45" in tex and r"$\times$" in tex and r"\caption{" in tex
    sp = paths["tables/speedup.md"].read_text()
    assert f"{93 / 52.5:.2f}×" in sp and "ZeRO-Offload failed (oom×2)" in sp
    mem = paths["tables/memory.md"].read_text()
    assert "180.00" in mem and "75.0" in mem          # M = 180 %, peak 3 GiB of 4 GiB
    host_rss = {(c[2], c[6]): c[-1] for c in (tuple(x.strip() for x in ln.strip("|").split("|"))
                                              for ln in mem.splitlines() if ln.startswith("| tiny"))}
    assert host_rss[("bs4_seq64", "TeraIO-Mixed")] == "6.00"  # mean of 5, 6 and 7 GiB
    assert host_rss[("bs4_seq64", "TeraIO-SSD")] == "5.50"    # the failed trial left out
    assert host_rss[("bs8_seq64", "TeraIO-SSD")] == "n/a"     # rows without the key
    assert host_rss[("bs8_seq64", "ZeRO-Offload")] == "×"
    for name in ("stalls", "bytes", "speedup_summary", "pct_of_ideal_summary", "cost", "cost_saving",
                 "cost_efficiency", "migration_bandwidth"):
        assert paths[f"tables/{name}.md"].stat().st_size > 0
        assert paths[f"tables/{name}.tex"].stat().st_size > 0
    runs = pd.read_parquet(paths["runs.parquet"])
    assert len(runs) == 20 and runs["micro_batch_size"].isna().sum() == 2
    assert len(pd.read_csv(paths["iterations.csv"])) == 34


def table_lines(md: str) -> set[tuple[str, ...]]:
    return {tuple(c.strip() for c in ln.strip("|").split("|")) for ln in md.splitlines()
            if ln.startswith("| tiny")}


def test_systems_not_run_at_a_point_are_listed_with_why(sweep_dir, tmp_path):
    # make_sweep runs ZeRO-Infinity at bs4_seq64 only; not_run.yaml beside the rows says why.
    before = table_lines(analyze(sweep_dir, tmp_path / "before")["tables/throughput.md"].read_text())
    (sweep_dir / "not_run.yaml").write_text("zero_infinity: >-\n  one slow\n  drive here\n")
    md = analyze(sweep_dir, tmp_path / "out")["tables/throughput.md"].read_text()
    lines = table_lines(md)
    not_run = ("tiny", "cpu_test", "bs8_seq64", "8.00", "2", "n/a", "ZeRO-Infinity", "n/a", "0", "n/a",
               "n/a", "0", "not run", "n/a", "n/a")
    assert lines - before == {not_run} and before <= lines
    assert "ZeRO-Infinity: one slow drive here" in md
    assert load_sweep(sweep_dir).not_run == {"zero_infinity": "one slow drive here"}


@pytest.mark.parametrize("text,message", [
    ("zero_three: too slow\n", "system 'zero_three' unknown; valid: "),
    ("zero_infinity: ''\n", "zero_infinity: ''; must be a non-empty text"),
    ("- zero_infinity\n", "must map system names to text, got list"),
])
def test_a_bad_not_run_file_is_named(sweep_dir, text, message):
    (sweep_dir / "not_run.yaml").write_text(text)
    with pytest.raises(ValueError, match="not_run.yaml: " + message.replace("(", r"\(")):
        load_sweep(sweep_dir)


def test_modeled_ideal_is_labelled(tmp_path):
    root = tmp_path / "sweepM"
    wl = dict(batch=4, seq=64, micro=1)
    write_run(root, "ideal", system="ideal", trial=0, tps=400, measure="modeled", **wl)
    for t, v in enumerate([100, 104]):
        write_run(root, f"mixed_{t}", system="teraio_mixed", trial=t, tps=v, **wl)
    sweep = load_sweep(root)
    s = agg.add_pct_of_ideal(agg.summarize_runs(sweep.runs))
    mixed = row(s, system="teraio_mixed")
    assert mixed["pct_of_ideal"] == pytest.approx(25.5) and mixed["ideal_measure"] == "modeled"
    ax = fig7_throughput(sweep).axes[0]
    hatched = {round(p.get_x() + p.get_width() / 2, 6): p.get_hatch() for p in gids(ax, "bar")}
    assert hatched == {round(slot(0, 0, 2), 6): None, round(slot(0, 1, 2), 6): "//"}
    assert describe(sweep).endswith("(no GPU: a machinery check, not comparable with the paper)")
    modeled_only = dataclasses.replace(sweep, runs=sweep.runs[sweep.runs["measure"] == "modeled"])
    assert describe(modeled_only).endswith("hardware cpu_test (modeled rows only: estimates, no run)")


def test_cli_names_a_bad_dir(tmp_path):
    with pytest.raises(SystemExit, match="is not a directory"):
        main([str(tmp_path / "nope")])


# ---- cost ------------------------------------------------------------------------------

def test_cost_ratios(sweep_dir):
    sweep = load_sweep(sweep_dir)
    costs = cost_frame(sweep)
    cost = {s: row(costs, system=s, batch_size=4)["cost_usd"]
            for s in ("teraio_ssd", "teraio_mixed", "zero_offload", "zero_infinity")}
    assert cost == {"teraio_ssd": 1200.0, "teraio_mixed": 1700.0, "zero_offload": 1500.0,
                    "zero_infinity": 1700.0}
    sv = cost_saving(sweep)
    assert row(sv, teraio="teraio_ssd")["saving"] == pytest.approx(7.5)
    assert row(sv, teraio="teraio_ssd")["paper_table3"] == pytest.approx(
        499_591.4 / 85_499.9)                          # 5.84×, not the paper's 5.88×
    eff = cost_efficiency(costs)
    assert row(eff, teraio="teraio_mixed", zero="zero_offload")["ratio"] == pytest.approx(
        (93 / 1700) / (62 / 1500))
    assert row(eff, teraio="teraio_mixed", zero="zero_infinity")["ratio"] == pytest.approx(93 / 52.5)
    assert len(eff) == 4                                # config B has no ok ZeRO


def test_prices_fallback_and_validation():
    p, src = resolve_prices({})
    assert src == "paper Table 3 (fallback)"
    assert p["pure_gpu_servers"] / (p["server_1tb"] + p["n_ssd"] * p["ssd_each"]) == pytest.approx(
        5.406, abs=1e-3)
    p, src = resolve_prices({"server_base": 1.0})
    assert "paper Table 3 for server_1tb" in src and p["server_base"] == 1.0
    with pytest.raises(ValueError, match="unknown key.*'gpu'"):
        resolve_prices({"gpu": 3.0})
    with pytest.raises(ValueError, match="ssd_each=-1"):
        resolve_prices({"ssd_each": -1})


# ---- figures -------------------------------------------------------------------------

def gids(ax, gid, kind="patches"):
    return [a for a in getattr(ax, kind) if a.get_gid() == gid]


def test_fig7_bars_errorbars_and_failures(sweep_dir):
    fig = fig7_throughput(load_sweep(sweep_dir))
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    bars = gids(ax, "bar")
    assert len(bars) == 8                               # 5 systems in A + 3 ok in B
    order = ["zero_infinity", "zero_offload", "teraio_ssd", "teraio_mixed", "ideal"]
    heights = {round(b.get_x() + b.get_width() / 2, 6): b.get_height() for b in bars}
    assert heights[round(slot(0, order.index("teraio_mixed"), 5), 6)] == pytest.approx(93.0)
    assert heights[round(slot(1, order.index("teraio_ssd"), 5), 6)] == pytest.approx(125.0)
    failed = gids(ax, "failed", "lines")
    assert len(failed) == 1
    assert failed[0].get_xdata()[0] == pytest.approx(slot(1, order.index("zero_offload"), 5))
    assert round(slot(1, order.index("zero_infinity"), 5), 6) not in heights  # not run: nothing
    # seaborn draws one error bar (with caps) per bar; its extent is our t interval
    err = [ln for ln in ax.lines if ln.get_gid() is None]
    assert len(err) == 8
    x_mixed = slot(0, order.index("teraio_mixed"), 5)
    mixed = [ln for ln in err if np.nanmean(ln.get_xdata()) == pytest.approx(x_mixed)]
    assert len(mixed) == 1
    y = mixed[0].get_ydata()
    assert [np.nanmin(y), np.nanmax(y)] == pytest.approx(list(t_interval([90, 96, 93])))
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["bs4_seq64\nM=150%", "bs8_seq64\nM=180%"]
    assert "sweepA" in fig.texts[0].get_text() and "cpu_test" in fig.texts[0].get_text()


def test_fig8_segments_and_not_instrumented(sweep_dir):
    fig = fig8_breakdown(load_sweep(sweep_dir))
    ax = fig.axes[0]
    for seg in ("stall", "overlapped", "compute"):
        assert len(gids(ax, seg)) == 6                 # ideal, TeraIO-SSD, TeraIO-Mixed × A, B
    assert len(gids(ax, "total")) == 2                 # ZeRO-Offload and ZeRO-Infinity in A
    assert len(gids(ax, "failed", "lines")) == 1       # ZeRO-Offload OOM in B
    assert sum(t.get_text() == "total only:\nnot instrumented" for t in ax.texts) == 2
    x = slot(0, 3, 5)                                  # TeraIO-Mixed, config A
    seg = {g: [p for p in gids(ax, g) if abs(p.get_x() + p.get_width() / 2 - x) < 1e-9][0]
           for g in ("stall", "overlapped", "compute")}
    mean_s = np.mean([256 / v for v in (90, 96, 93)])
    assert seg["stall"].get_height() == pytest.approx(0.1 * mean_s)
    assert seg["overlapped"].get_height() == pytest.approx(0.4 * mean_s)
    assert seg["compute"].get_height() == pytest.approx(0.5 * mean_s)
    assert seg["compute"].get_y() == pytest.approx(0.5 * mean_s)


@pytest.mark.parametrize("named", [False, True], ids=["one-hardware-name", "knobs-in-the-name"])
def test_fig9_lines_per_ssd_count(tmp_path, named):
    # named: each point's hardware named after its knobs, as conf/experiment/fig9*.yaml do
    root = tmp_path / "sweep9"
    wl = dict(batch=4, seq=64, micro=1)

    def hw(n_ssd, cap):
        return {"hardware": f"cpu_test-{n_ssd}ssd-{cap}gb"} if named else {}
    for n_ssd in (2, 4):
        for cap in (16, 32, 64):
            for t in (0, 1):
                write_run(root, f"m_{n_ssd}_{cap}_{t}", system="teraio_mixed", trial=t,
                          tps=10 * cap + n_ssd + t, host_cap=cap * GIB, n_ssd=n_ssd, **wl, **hw(n_ssd, cap))
    write_run(root, "zi_16", system="zero_infinity", trial=0, status="oom", host_cap=16 * GIB,
              n_ssd=4, **wl, **hw(4, 16))
    for cap in (32, 64):
        write_run(root, f"zi_{cap}", system="zero_infinity", trial=0, tps=cap, host_cap=cap * GIB,
                  n_ssd=4, **wl, **hw(4, cap))
    write_run(root, "ideal", system="ideal", trial=0, tps=1000, **wl)
    fig = fig9_host_memory(load_sweep(root))
    ax = fig.axes[0]
    assert len(gids(ax, "series", "lines")) == 3
    series = {c.get_label(): c.lines[0] for c in ax.containers}
    assert sorted(series) == [
        "TeraIO-Mixed, 2 SSD(s)", "TeraIO-Mixed, 4 SSD(s)", "ZeRO-Infinity, 4 SSD(s)"]
    two = series["TeraIO-Mixed, 2 SSD(s)"]
    assert list(two.get_xdata()) == [16, 32, 64]
    assert list(two.get_ydata()) == pytest.approx([162.5, 322.5, 642.5])
    assert len(gids(ax, "ideal", "lines")) == 1
    assert len(gids(ax, "failed", "lines")) == 1
    # Fig. 7 of the same sweep: a panel per (host cap, SSDs), most with a single system,
    # whose bars must still sit in that system's slot
    fig7 = fig7_throughput(load_sweep(root))
    assert len(fig7.axes) == 7
    bars = [p for ax in fig7.axes for p in gids(ax, "bar")]
    assert len(bars) == 9 and all(p.get_width() == pytest.approx(0.8 / 3) for p in bars)
    assert sum(len(gids(ax, "failed", "lines")) for ax in fig7.axes) == 1


def test_fig9_draws_systems_the_cap_does_not_bind_as_reference_lines(tmp_path):
    """fig9_h200's reference point: Ideal and the users' baselines at one cap (conf/experiment/
    fig9_h200.yaml); each a horizontal line across the panel, a failed one a legend entry."""
    root, wl = tmp_path / "sweep9", dict(batch=4, seq=64, micro=1, n_ssd=1, trial=0)
    for cap in (4, 8):
        write_run(root, f"m_{cap}", system="teraio_mixed", tps=10 * cap, host_cap=cap * GIB, **wl)
    write_run(root, "ac", system="ideal_ac", tps=700, host_cap=4 * GIB, **wl)
    write_run(root, "fsdp", system="fsdp_offload", tps=300, host_cap=4 * GIB, **wl)
    write_run(root, "tao", system="torchao_offload", status="error", host_cap=4 * GIB, **wl)
    ax = fig9_host_memory(load_sweep(root)).axes[0]
    assert len(gids(ax, "series", "lines")) == 1
    refs = {ln.get_label(): ln.get_ydata()[0] for ln in gids(ax, "reference", "lines")}
    assert refs == {"Ideal+AC": 700, "FSDP2-Offload": 300}
    (failed,) = gids(ax, "reference_failed", "lines")
    assert failed.get_label() == "torchao-Offload: error"


def test_fig9_skipped_without_host_cap_sweep(sweep_dir):
    with pytest.raises(NoData, match="two or more host-memory caps"):
        fig9_host_memory(load_sweep(sweep_dir))


def test_fig10_bandwidth_lines(sweep_dir):
    fig, shares = fig10_bandwidth(load_sweep(sweep_dir))
    ax = fig.axes[0]
    off, pre = gids(ax, "offload", "lines"), gids(ax, "prefetch", "lines")
    assert len(off) == len(pre) == 1
    assert list(off[0].get_ydata()) == pytest.approx([1.0, 1.0, 0.0, 0.0])
    assert list(pre[0].get_ydata()) == pytest.approx([0.0, 1.0, 2.0, 1.0])
    assert shares["step"].tolist() == [4]
    assert shares["share_above_16gbps"].tolist() == [0.0]


def test_bandwidth_binning_and_share():
    ops = pd.DataFrame({"step": 1, "op": [0, 1, 2, 3], "op_name": "x",
                        "t_start_s": [0.0, 0.5, 0.5, 2.0], "seconds": [0.5, 0.0, 1.5, np.nan],
                        "stall_s": 0.0})
    tr = pd.DataFrame({"step": 1, "tier": "ssd", "direction": ["offload", "offload", "prefetch"],
                       "nbytes": [1e9, 4e9, 5e8], "op_issued": 0, "op_done": 1,
                       "t_issued_s": [0.0, 0.25, 1.0], "t_done_s": [1.0, 0.75, 1.0]})
    bw = op_bandwidth(tr, ops, 1)
    # op 0 [0, .5): 1 GB/s + 8 GB/s over [.25, .5) -> (0.5 + 2) GB / 0.5 s = 5 GB/s
    # op 3 was logged without a duration: a zero-length bin at t = 2 s, nothing in flight
    assert bw["offload_gbps"].tolist() == pytest.approx([5.0, 9.0, (0.5 + 2) / 1.5, 0.0])
    assert bw["prefetch_gbps"].tolist() == pytest.approx([0.0, 0.0, 0.5 / 1.5, 0.0])
    assert share_above(tr, 0.0, 2.0, 1, threshold_gbps=4.0) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="direction"):
        op_bandwidth(tr.assign(direction="evict"), ops, 1)


# ---- end to end ------------------------------------------------------------------------

def test_analyze_writes_everything_and_names_skips(sweep_dir, capsys):
    main([str(sweep_dir)])
    out = sweep_dir / "analysis"
    for stem in ("fig7_throughput", "fig8_breakdown", "fig10_bandwidth"):
        for ext in ("png", "pdf"):
            assert (out / "figures" / f"{stem}.{ext}").stat().st_size > 1000
    assert not (out / "figures" / "fig9_host_memory.png").exists()
    index = (out / "index.md").read_text()
    assert "fig9_host_memory: no system was run at two or more host-memory caps" in index
    assert "fig7_throughput.png" in capsys.readouterr().out
    # a second run re-reads the sweep, not its own outputs
    paths = analyze(sweep_dir)
    assert len(pd.read_parquet(paths["runs.parquet"])) == 20


# ---- pandas 3 + seaborn 0.13 -----------------------------------------------------------

def test_pinned_versions():
    assert int(pd.__version__.split(".")[0]) == 3
    assert sns.__version__.startswith("0.13.")


@pytest.mark.parametrize("dtype", ["str", "string", "category"])
def test_seaborn_barplot_splits_pandas3_dtypes(dtype):
    """Grouped bars with a callable errorbar over pandas 3 string / categorical columns
    (categories ordered unlike hue_order) must put each group's data in its own slot;
    seaborn #3893 / #3922 are this kind of mis-split."""
    df = pd.DataFrame({"x": ["a", "a", "a", "a", "b", "b", "b"],
                       "h": ["z", "z", "y", "y", "z", "y", "y"],
                       "v": [1.0, 3.0, 10.0, 12.0, 5.0, 20.0, 22.0]})
    if dtype == "category":
        df["x"] = pd.Categorical(df["x"], categories=["b", "a"])
        df["h"] = pd.Categorical(df["h"], categories=["z", "y", "w"])
    else:
        df = df.astype({"x": dtype, "h": dtype})
    fig = Figure()
    ax = fig.subplots()
    sns.barplot(data=df, x="x", y="v", hue="h", order=["a", "b"], hue_order=["w", "y", "z"],
                errorbar=t_interval, legend=False, ax=ax)
    bars = {round(p.get_x() + p.get_width() / 2, 6): p.get_height() for p in ax.patches}
    assert bars == pytest.approx({round(slot(0, 1, 3), 6): 11.0, round(slot(0, 2, 3), 6): 2.0,
                                  round(slot(1, 1, 3), 6): 21.0, round(slot(1, 2, 3), 6): 5.0})
    ends = sorted(tuple(np.round(ln.get_ydata(), 9)) for ln in ax.lines
                  if np.isfinite(ln.get_ydata()).all())
    expect = sorted(tuple(np.round(t_interval(v), 9)) for v in ([10.0, 12.0], [20.0, 22.0], [1.0, 3.0]))
    assert ends == expect                              # b/z has n = 1: no interval


def test_ideal_only_sweep_is_analyzed(tmp_path):
    # No TeraIO or ZeRO rows: the speedup tables are empty, not a crash.
    for trial in range(2):
        write_run(tmp_path, f"ideal_{trial}", system="ideal", batch=4, seq=64, micro=2, trial=trial, tps=100.0 + trial)
    written = analyze(tmp_path)
    assert any(str(p).endswith("throughput.md") for p in written)


def test_title_of_a_narrow_figure_stays_inside_it(tmp_path):
    # One configuration: the narrowest Fig. 7. Its two-line title used to run off both edges.
    root = tmp_path / "a_sweep_with_a_rather_long_name_for_its_title"
    for system, tps in (("ideal", 400), ("teraio_mixed", 100)):
        write_run(root, system, system=system, batch=4, seq=64, micro=2, trial=0, tps=tps)
    fig = fig7_throughput(load_sweep(root))
    fig.canvas.draw()
    box = fig.texts[0].get_window_extent()
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width
    assert "a_sweep_with_a_rather_long_name_for_its_title" in fig.texts[0].get_text().replace("\n", "")


def test_ok_rows_that_are_not_finite_count_as_failed_and_stay_out_of_n(tmp_path):
    root = tmp_path / "sweep"
    cfg = dict(system="teraio_mixed", batch=4, seq=64, micro=2)
    write_run(root, "t0", trial=0, tps=90.0, **cfg)
    write_run(root, "t1", trial=1, tps=96.0, **cfg)
    write_run(root, "t2", trial=2, tps=float("nan"), **cfg)  # written as null: no tokens/s
    job = write_run(root, "t3", trial=3, tps=93.0, **cfg)
    r = json.loads((job / "result.json").read_text())
    r["iterations"][1]["loss"] = "NaN"  # as a writer without the JSON guard would leave it
    (job / "result.json").write_text(json.dumps(r))
    sweep = load_sweep(root)
    assert sorted(sweep.runs["status"]) == ["non-finite", "non-finite", "ok", "ok"]
    (g,) = agg.summarize_runs(sweep.runs).to_dict("records")
    assert (g["n"], g["n_failed"], g["failures"]) == (2, 2, "non-finite×2")
    assert g["tokens_per_s_mean"] == 93.0
    assert "(2 ok, 2 failed)" in describe(sweep)


def test_a_small_host_cap_is_shown_in_mib_and_the_header_says_so():
    from analysis.tables import _host_cap
    header, cells = _host_cap(pd.Series([4 * 2**20, 8 * GIB, None]))
    assert header == "Host cap (MiB)" and list(cells) == ["4.00", "8192.0", "n/a"]
    header, cells = _host_cap(pd.Series([8 * GIB, None]))
    assert header == "Host cap (GiB)" and list(cells) == ["8.00", "n/a"]


def test_figure_titles_break_between_phrases_not_inside_one():
    from analysis.figures import _wrap_phrases
    text = "Fig. 7 — average training throughput (bars: mean of ok trials; error bars: 95% t-CI; M: memory pressure)"
    assert _wrap_phrases(text, 60).splitlines() == [
        "Fig. 7 — average training throughput", "(bars: mean of ok trials; error bars: 95% t-CI;",
        "M: memory pressure)"]
    assert _wrap_phrases("short", 60) == "short"


@pytest.mark.parametrize("sweep", ["h200/fig7_h200_slice", "h200/fig7_h200", "h100/side_by_side"])
def test_the_committed_gpu_sweeps_regenerate_their_tables_exactly(tmp_path, sweep):
    from pathlib import Path
    slice_dir = Path(__file__).resolve().parents[1] / "runs" / "reference" / sweep
    paths = analyze(slice_dir, tmp_path / "out")
    committed = sorted((slice_dir / "analysis" / "tables").iterdir())
    assert committed and {p.name for p in committed} <= {Path(k).name for k in paths if k.startswith("tables/")}
    for table in committed:
        assert (tmp_path / "out" / "tables" / table.name).read_text() == table.read_text(), table.name


def test_trials_of_different_lengths_show_each_count_of_measured_and_warm_up_steps(tmp_path):
    cfg = dict(system="teraio_ssd", batch=4, seq=64, micro=2)
    write_run(tmp_path, "t0", trial=0, tps=90.0, **cfg)
    job = write_run(tmp_path, "t1", trial=1, tps=96.0, **cfg)
    r = json.loads((job / "result.json").read_text())
    r["iterations"] += [{**r["iterations"][-1], "step": k} for k in (5, 6)]
    r["config"]["workload"] = {"warmup_steps": 0, "measure_steps": 4}
    (job / "result.json").write_text(json.dumps(r))
    (g,) = agg.summarize_runs(load_sweep(tmp_path).runs).to_dict("records")
    assert g["measured_steps"] == "2/4"
    assert g["warmup_steps"] == "0"  # trial 0's config names none: no count
    from analysis.tables import throughput_table
    table = throughput_table(agg.add_pct_of_ideal(agg.summarize_runs(load_sweep(tmp_path).runs)))
    assert (table["warm-up"].tolist(), table["steps"].tolist()) == (["0"], ["2/4"])


def test_tier_rates_are_exact_on_a_hand_made_log():
    from analysis.bandwidth import tier_rates
    from teraio.core.engine import union_seconds
    # step 3, ssd: two offloads overlapping ([0, 1] and [0.5, 1.5]: 1.5 s busy) and a prefetch
    # in [1, 3] (2 s; both directions: [0, 3]); step 4, ssd: one prefetch in [0, 0.5];
    # host: one offload of zero length (no busy time).
    log = pd.DataFrame({"step": [3, 3, 3, 4, 4], "tier": ["ssd", "ssd", "ssd", "ssd", "host"],
                        "direction": ["offload", "offload", "prefetch", "prefetch", "offload"],
                        "nbytes": [2e9, 1e9, 4e9, 1e9, 5e9],
                        "t_issued_s": [0.0, 0.5, 1.0, 0.0, 2.0], "t_done_s": [1.0, 1.5, 3.0, 0.5, 2.0]})
    assert union_seconds(list(zip([0.0, 0.5, 1.0, 4.0], [1.0, 1.5, 3.0, 4.5]))) == 3.5 and union_seconds([]) == 0.0
    host, ssd = tier_rates(log).to_dict("records")
    assert (ssd["tier"], ssd["steps"], ssd["offload_gb"], ssd["prefetch_gb"]) == ("ssd", 2, 1.5, 2.5)
    assert ssd["busy_s"] == (3.0 + 0.5) / 2
    assert ssd["offload_gbps"] == 3 / 1.5 and ssd["prefetch_gbps"] == 5 / 2.5
    assert ssd["gbps"] == pytest.approx(8 / 3.5, rel=1e-12)
    assert host["offload_gb"] == 2.5 and math.isnan(host["offload_gbps"]) and math.isnan(host["gbps"])
    assert math.isnan(ssd["offload_copy_gbps"]) and math.isnan(host["prefetch_copy_gbps"])  # no copy_s column
    with pytest.raises(ValueError, match=r"direction\(s\) \['sideways'\]"):
        tier_rates(log.assign(direction="sideways"))


def test_copy_stream_rates_count_only_the_seconds_the_copies_ran():
    from analysis.bandwidth import tier_rates
    # host offloads of 2 and 4 GB, issued long before their copies ran (issue to done: 10 s
    # in all), copied in 0.1 s and 0.2 s; one prefetch of 1 GB in 0.05 s; an ssd transfer
    # has no copy time and its tier no copy-stream rate.
    log = pd.DataFrame({"step": [3, 3, 3, 3], "tier": ["host", "host", "host", "ssd"],
                        "direction": ["offload", "offload", "prefetch", "offload"],
                        "nbytes": [2e9, 4e9, 1e9, 1e9], "t_issued_s": [0.0, 0.0, 5.0, 0.0],
                        "t_done_s": [5.0, 5.0, 10.0, 1.0], "copy_s": [0.1, 0.2, 0.05, None]})
    host, ssd = tier_rates(log).to_dict("records")
    assert host["offload_gbps"] == 6 / 5 and host["offload_copy_gbps"] == pytest.approx(6 / 0.3, rel=1e-12)
    assert host["prefetch_copy_gbps"] == pytest.approx(1 / 0.05, rel=1e-12)
    assert math.isnan(ssd["offload_copy_gbps"]) and math.isnan(ssd["prefetch_copy_gbps"])


def test_the_tier_rate_table_names_each_run_with_a_log_and_its_planned_rates(sweep_dir, tmp_path):
    job = sweep_dir / "A_teraio_mixed_0"
    r = json.loads((job / "result.json").read_text())
    r["tier_gbps"] = {"ssd_write_gbps": 2.6, "ssd_read_gbps": 1.8, "host_d2h_gbps": 55.0, "host_h2d_gbps": 54.0}
    (job / "result.json").write_text(json.dumps(r))
    md = analyze(sweep_dir, tmp_path / "out")["tables/tier_rates.md"].read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| tiny")]
    # write_engine_logs: steps 3 and 4; ssd moves 11 GB offloaded ([0, 1] in step 3, [0, 2] in
    # step 4) and 1 GB prefetched at one instant; host 3 GB prefetched in [1.5, 3]
    assert rows == [
        "| tiny | bs4_seq64 | TeraIO-Mixed | A_teraio_mixed_0 | host | 2 | 0 | 1.50 | 0.75 | n/a | 2.00 | 2.00 | n/a / n/a | 55.00 / 54.00 |",
        "| tiny | bs4_seq64 | TeraIO-Mixed | A_teraio_mixed_0 | ssd | 2 | 5.50 | 0.5 | 1.50 | 3.67 | n/a | 4.00 | n/a / n/a | 2.60 / 1.80 |"]


def test_the_recovery_table_averages_the_engines_unplanned_work(tmp_path):
    # TeraIO-Mixed's two trials count their urgent fetches, op retries, drops, deferrals and
    # spills per iteration; TeraIO-SSD's row predates the counts (n/a); Ideal has none (no line).
    cfg = dict(batch=4, seq=64, micro=2)
    counts = [(2, 4, 1e9, 1, 0.5e9), (4, 6, 3e9, 3, 1.5e9)]
    for t, (urgent, retries, dropped, deferred, spilled) in enumerate(counts):
        write_run(tmp_path, f"mixed_{t}", system="teraio_mixed", trial=t, tps=90.0, **cfg,
                  iteration_extra=dict(urgent_count=urgent, oom_retries=retries, dropped_bytes=dropped,
                                       deferred_prefetches=deferred, spilled_bytes=spilled))
    write_run(tmp_path, "ssd_0", system="teraio_ssd", trial=0, tps=80.0, **cfg,
              iteration_extra={"urgent_count": 7})
    write_run(tmp_path, "ideal_0", system="ideal", trial=0, tps=100.0, **cfg)
    paths = analyze(tmp_path, tmp_path / "out")
    lines = table_lines(paths["tables/recovery.md"].read_text())
    assert {ln[6:] for ln in lines} == {("TeraIO-Mixed", "measured", "2", "3.00", "5.00", "2.00", "2.00", "1.00"),
                                        ("TeraIO-SSD", "measured", "1", "7.00", "n/a", "n/a", "n/a", "n/a")}


def test_a_figure_written_twice_has_the_same_bytes(sweep_dir, tmp_path):
    # The PDF carries no creation date: re-running an analysis leaves its figures unchanged.
    from analysis.figures import save_figure

    fig = fig7_throughput(load_sweep(sweep_dir))
    first = {p.suffix: p.read_bytes() for p in save_figure(fig, tmp_path / "a" / "fig7")}
    second = {p.suffix: p.read_bytes() for p in save_figure(fig, tmp_path / "b" / "fig7")}
    assert first == second and b"/CreationDate" not in first[".pdf"]


@pytest.mark.parametrize("edit, named", [
    (lambda r: r.update(format="teraio.result/2"), "teraio.result/2"),
    (lambda r: r.update(format="teraio.result/9-beta"), "9-beta"),
    (lambda r: r.pop("point"), "'point'"),
    (lambda r: r["point"].pop("seq_len"), "point.seq_len"),
    (lambda r: r.pop("iterations"), "'iterations'"),
    (lambda r: r.update(iterations=[]), "iterations"),
    (lambda r: r.pop("status"), "'status'"),
    (lambda r: r.update(status="maybe"), "maybe"),
])
def test_a_row_of_an_unknown_format_or_missing_a_key_is_skipped_naming_it(sweep_dir, edit, named):
    path = sweep_dir / "A_teraio_mixed_1" / "result.json"
    row = json.loads(path.read_text())
    edit(row)
    path.write_text(json.dumps(row))
    with pytest.warns(UserWarning) as caught:
        sweep = load_sweep(sweep_dir)
    warned = [str(w.message) for w in caught if "skipping" in str(w.message)]
    assert len(warned) == 1 and str(path) in warned[0] and named in warned[0]
    assert len(sweep.runs) == 19 and str(path) in sweep.skipped[0][0]
    assert "A_teraio_mixed_1" not in set(sweep.runs["job_dir"])


def test_an_ok_row_whose_warmup_loss_was_not_finite_is_flagged_not_counted(sweep_dir):
    # JSON has no NaN: the worker writes a loss that was not finite as null (teraio.result).
    path = sweep_dir / "A_teraio_mixed_1" / "result.json"
    row = json.loads(path.read_text())
    row["losses"] = [None, 1.0, 1.0, 1.0, 1.0]  # step 0, a warm-up step, diverged
    path.write_text(json.dumps(row))
    runs = load_sweep(sweep_dir).runs
    flagged = runs[runs["job_dir"] == "A_teraio_mixed_1"].iloc[0]
    assert flagged["status"] == "non-finite" and flagged["failed"]
    assert runs[runs["job_dir"] == "A_teraio_mixed_0"].iloc[0]["status"] == "ok"


def test_a_row_whose_cap_was_not_enforced_is_marked_in_the_throughput_table(sweep_dir, tmp_path):
    path = sweep_dir / "A_zero_offload_0" / "result.json"
    row = json.loads(path.read_text())
    row["capacity_enforced"] = False  # zero.run on a CPU device
    path.write_text(json.dumps(row))
    runs = load_sweep(sweep_dir).runs
    assert runs.loc[runs["cap_not_enforced"], "job_dir"].tolist() == ["A_zero_offload_0"]
    analyze(sweep_dir, tmp_path / "out")
    text = " ".join((tmp_path / "out" / "tables" / "throughput.md").read_text().split())
    assert "cap not enforced: ZeRO-Offload ran where nothing held it" in text


def test_a_row_whose_micro_batch_teraio_chose_reads_as_the_choice(tmp_path):
    job = write_run(tmp_path, "auto", system="teraio_mixed", batch=4, seq=64, micro=2, trial=0, tps=100.0)
    r = json.loads((job / "result.json").read_text())
    r["point"]["micro_batch_size"] = "auto"
    r["micro_batch"] = {"candidates": [], "chosen": 2}
    (job / "result.json").write_text(json.dumps(r))
    write_run(tmp_path, "ideal", system="ideal", batch=4, seq=64, micro=2, trial=0, tps=200.0)
    runs = load_sweep(tmp_path).runs
    assert runs.set_index("system").loc["teraio_mixed", "micro_batch_size"] == 2
    assert runs.set_index("system").loc["teraio_mixed", "ran_micro_batch_size"] == 2
    analyze(tmp_path, tmp_path / "out")  # the tables and figures of such a sweep are made


def set_config(job, key: str, value) -> None:
    """Set the dotted ``key`` of the run config in ``job``'s row to ``value``."""
    r = json.loads((job / "result.json").read_text())
    *sections, name = key.split(".")
    cfg = r["config"]
    for s in sections:
        cfg = cfg.setdefault(s, {})
    cfg[name] = value
    (job / "result.json").write_text(json.dumps(r))


@pytest.mark.parametrize("key, values", [("workload.lr", [1e-4, 1e-3]),
                                         ("hardware.gpu_capacity_bytes", [4 * GIB, 8 * GIB])])
def test_trials_made_with_different_configs_are_refused_naming_the_key_and_values(tmp_path, key, values):
    for t, v in enumerate(values):
        set_config(write_run(tmp_path / "s", f"t{t}", system="ideal", batch=4, seq=64, micro=2, trial=t, tps=100.0),
                   key, v)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as e:
        load_sweep(tmp_path / "s")
    assert f"{values[0]!r} in s/t0" in str(e.value) and f"{values[1]!r} in s/t1" in str(e.value)
    with pytest.raises(SystemExit, match=f"python -m analysis: .*{key}"):
        main([str(tmp_path / "s")])
    assert not (tmp_path / "s" / "analysis").exists()  # refused before anything is written


def test_trials_pool_where_only_what_makes_them_trials_differs_or_auto_chose_the_same(tmp_path):
    jobs = [write_run(tmp_path, f"t{t}", system="teraio_mixed", batch=4, seq=64, micro=2, trial=t, tps=100.0)
            for t in range(3)]
    for t, job in enumerate(jobs):
        set_config(job, "seed", t)
        set_config(job, "timeout_s", 100 * (t + 1))
        set_config(job, "workload.measure_steps", 2 + t)
        set_config(job, "system.options.host_arena", False if t == 0 else "auto")
        r = json.loads((job / "result.json").read_text())
        r["plan"] = {"host_arena": False}  # auto chose what trial 0 was told
        (job / "result.json").write_text(json.dumps(r))
    assert len(load_sweep(tmp_path).runs) == 3
    r = json.loads((jobs[2] / "result.json").read_text())
    r["plan"] = {"host_arena": True}  # now auto chose otherwise
    (jobs[2] / "result.json").write_text(json.dumps(r))
    with pytest.raises(ValueError, match=r"system\.options\.host_arena: False in .*/t0, False in .*/t1, True in "):
        load_sweep(tmp_path)


def recompute_trials(root, settings, failed=()):
    """Three TeraIO trials of one point whose plans recompute, trial t run with
    ``recompute=settings[t]``; those in ``failed`` are error rows."""
    jobs = [write_run(root, f"t{t}", system="teraio_mixed", batch=4, seq=64, micro=2, trial=t, tps=100.0)
            for t in range(3)]
    for t, job in enumerate(jobs):
        set_config(job, "system.options.recompute", settings[t])
        r = json.loads((job / "result.json").read_text())
        r["plan"] = {"host_arena": False, "recomputes": 3}
        if t in failed:
            r.update(status="error", error="RuntimeError: boom", tokens_per_s=None)
        (job / "result.json").write_text(json.dumps(r))
    return jobs


def test_the_trial_that_decided_a_point_pools_with_the_trials_that_ran_its_choice(tmp_path):
    # teraio.harness.tune.decided: trial 0 ran with recompute auto and kept a plan that
    # recomputes; trials 1 and 2 ran with "on", its choice
    jobs = recompute_trials(tmp_path, ["auto", "on", "on"])
    assert len(load_sweep(tmp_path).runs) == 3
    set_config(jobs[2], "system.options.recompute", "off")
    with pytest.raises(ValueError, match=r"system\.options\.recompute: 'on' in .*/t0, 'on' in .*/t1, 'off' in "):
        load_sweep(tmp_path)


def test_a_deciding_trial_that_failed_pools_with_the_trials_after_it(tmp_path):
    # teraio.harness.tune.decided: trial 0 was to decide recompute and failed (no record),
    # trial 1 decided it (auto, its plan recomputes), trial 2 ran its choice
    jobs = recompute_trials(tmp_path, ["auto", "auto", "on"], failed=(0,))
    assert len(load_sweep(tmp_path).runs) == 3
    # an ok trial still on auto that chose otherwise does not pool
    set_config(jobs[2], "system.options.recompute", "off")
    with pytest.raises(ValueError, match=r"system\.options\.recompute: 'auto' in .*/t0, 'on' in .*/t1, 'off' in "):
        load_sweep(tmp_path)


def test_a_trial_its_time_limit_cut_short_is_marked_in_the_throughput_table(tmp_path):
    for t in (0, 1):
        job = write_run(tmp_path, f"t{t}", system="fsdp_offload", batch=4, seq=64, micro=2, trial=t, tps=100.0)
        set_config(job, "workload.measure_steps", 2 if t == 0 else 3)  # trial 1 measured 2 of 3
    runs = load_sweep(tmp_path).runs
    assert agg.cut_short(runs).tolist() == [False, True]
    from analysis.tables import throughput_table
    table = throughput_table(agg.add_pct_of_ideal(agg.summarize_runs(runs)))
    assert table["steps"].tolist() == ["2 (1 cut short)"]
    analyze(tmp_path, tmp_path / "out")
    text = " ".join((tmp_path / "out" / "tables" / "throughput.md").read_text().split())
    assert "cut short: ok trials that measured fewer steps than their point asks" in text


def test_every_table_names_the_card_a_row_ran_on_and_never_pools_two_cards(tmp_path):
    """Rows of the h200 hardware config made on an H100 and on an H200: each table's Hardware
    column and the captions name the card (analysis.load.hardware_label), and their trials are
    two groups, not one; a row with no GPU keeps the config's name."""
    from analysis.figures import machine_of
    from analysis.tables import throughput_table

    for t, gpu in enumerate(("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", "NVIDIA H200")):
        job = write_run(tmp_path / "s", f"t{t}", system="ideal", batch=4, seq=64, micro=2, trial=t,
                        tps=100.0 * (t + 1), hardware="h200")
        r = json.loads((job / "result.json").read_text())
        r["gpu_name"] = gpu
        (job / "result.json").write_text(json.dumps(r))
    sweep = load_sweep(tmp_path / "s")
    table = throughput_table(agg.add_pct_of_ideal(agg.summarize_runs(sweep.runs)))
    assert list(table["Hardware"]) == ["h200 on NVIDIA H100 80GB HBM3", "h200 on NVIDIA H200"]
    assert describe(sweep).endswith("hardware h200 on NVIDIA H100 80GB HBM3, h200 on NVIDIA H200")
    # a failure that names no GPU (the sweep wrote it) takes its sweep's one card
    job = write_run(tmp_path / "one", "t0", system="ideal", batch=4, seq=64, micro=2, trial=0, tps=1.0,
                    hardware="h200")
    r = json.loads((job / "result.json").read_text())
    r["gpu_name"] = "NVIDIA H100 80GB HBM3"
    (job / "result.json").write_text(json.dumps(r))
    write_run(tmp_path / "one", "t1", system="ideal", batch=4, seq=64, micro=2, trial=1, status="oom", hardware="h200")
    one = load_sweep(tmp_path / "one").runs
    assert set(one["hardware"]) == {"h200 on NVIDIA H100 80GB HBM3"} and one["gpu_name"].isna().sum() == 1
    write_run(tmp_path / "cpu", "t0", system="ideal", batch=4, seq=64, micro=2, trial=0, tps=1.0, device="cpu")
    assert list(load_sweep(tmp_path / "cpu").runs["hardware"]) == ["cpu_test"]
    assert machine_of("h200-1ssd-4gb on NVIDIA H200") == "h200 on NVIDIA H200"
    assert machine_of("paper_h100nvl-2ssd-16gb") == "paper_h100nvl"
