"""Plan compile-time benchmarks: benchmarks.plan_compile and benchmarks.profile_reduced, run
on the CPU with small traces and a tiny model."""
import json

import pytest
import torch

from benchmarks import plan_compile, profile_reduced
from teraio.core.trace import Trace
from teraio.perf.synth import layered_trace


def test_plan_compile_adds_an_entry_and_keeps_the_others(tmp_path):
    path, out = tmp_path / "toy.json.gz", tmp_path / "pc.json"
    layered_trace(2, mm_seconds=10e-3).save(path)
    out.write_text(json.dumps({"what": "earlier", "entries": {"old": {"median_seconds": 1.0}}}))
    entry = plan_compile.main([str(path), "--label", "toy", "--paper-m", "180", "--host-cap-gb", "0.2",
                               "--repeats", "2", "--synthesize", "2:5", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert set(doc["entries"]) == {"old", "toy"} and doc["entries"]["toy"] == json.loads(json.dumps(entry))
    assert len(entry["seconds"]) == 2 and entry["median_seconds"] > 0
    assert entry["trace"]["n_ops"] == layered_trace(5).n_ops  # synthesized to 5 layers
    assert entry["trace"]["synthesized"]["n_layers"] == 5
    assert entry["setting"]["capacity_bytes"] == int(entry["trace"]["peak_bytes"] / 1.8)
    assert entry["plan"]["n_migrations"] > 0 and entry["plan"]["shortfall_bytes"] == 0
    assert entry["paper_seconds"] is None and "--synthesize 2:5" in entry["command"]
    # TeraIO's default packing: both planned, the faster kept and both simulated times kept
    assert entry["setting"]["host_arena"] == "auto" and entry["plan"]["host_arena"] in (True, False)
    assert set(entry["plan"]["host_arena_auto"]) == {"slots", "arena"}


def test_plan_compile_times_the_host_packing_it_is_given(tmp_path, capsys):
    path, out = tmp_path / "toy.json.gz", tmp_path / "pc.json"
    layered_trace(2, mm_seconds=10e-3).save(path)
    args = [str(path), "--label", "toy", "--paper-m", "180", "--host-cap-gb", "0.2", "--repeats", "1", "--out", str(out)]
    slots = plan_compile.main(args + ["--host-arena", "false"])
    assert slots["setting"]["host_arena"] is False and slots["plan"]["host_arena"] is False
    assert slots["plan"]["host_arena_auto"] is None
    region = plan_compile.main(args + ["--host-arena", "true"])
    assert region["plan"]["host_arena"] is True
    with pytest.raises(SystemExit):
        plan_compile.main(args + ["--host-arena", "region"])
    assert "invalid choice: 'region'" in capsys.readouterr().err


def test_plan_compile_times_the_schedule_search_beside_todays_planner(tmp_path):
    path, out = tmp_path / "toy.json.gz", tmp_path / "pc.json"
    layered_trace(2, mm_seconds=10e-3).save(path)
    entry = plan_compile.main([str(path), "--label", "toy", "--paper-m", "180", "--host-cap-gb", "0.2",
                               "--repeats", "2", "--schedule", "--out", str(out)])
    sched = entry["schedule"]
    assert len(sched["seconds"]) == len(entry["seconds"]) == 2
    assert sched["ratio_to_today"] == pytest.approx(sched["median_seconds"] / entry["median_seconds"])
    assert "on" in sched["recompute_auto"] and sched["shortfall_bytes"] == 0
    assert "schedule" not in plan_compile.main([str(path), "--label", "toy", "--paper-m", "180",
                                                "--repeats", "1", "--out", str(out)])


def test_plan_compile_refuses_a_model_that_fits():
    with pytest.raises(ValueError, match="paper_m=90"):
        plan_compile.time_plan(layered_trace(2), 90)


def test_profile_reduced_synthesizes_the_real_depth_and_times_the_planner(tmp_path):
    """A tiny Llama3 on the CPU: 2-layer profile -> 4 layers, against a real 4-layer
    profile, then the planner on the synthesized trace."""
    out = tmp_path / "out"
    s = profile_reduced.main(["--model", "llama3_tiny", "--set", "dim=64", "--set", "vocab_size=256",
                              "--layers", "2", "--target-layers", "4", "--seq-len", "32", "--device", "cpu",
                              "--compare-real", "--paper-m", "150", "--host-cap-gb", "0.001",
                              "--min-tensor-bytes", "4096", "--out-dir", str(out)])
    syn = Trace.load(out / "trace_synth4l.json.gz")
    assert Trace.load(out / "trace_2l.json.gz").meta["n_layers"] == 2
    assert syn.meta["n_layers"] == 4 and syn.meta["model"] == "llama3_tiny"
    c = s["compare_real"]
    assert c["n_ops"]["synthesized"] == c["n_ops"]["real"] == syn.n_ops and c["op_names_equal"]
    assert abs(c["peak_ratio"] - 1) <= 0.05 and c["peak_bytes"]["synthesized"] == syn.peak_bytes()
    assert c["kernel_seconds_ratio"] > 0  # CPU wall times: reported, not compared
    pc = json.loads((out / "plan_compile.json").read_text())["entries"]["llama3_tiny_synth4"]
    assert pc["trace"]["n_ops"] == syn.n_ops and pc["plan"]["n_migrations"] > 0
    assert json.loads((out / "summary.json").read_text())["plan_compile"]["seconds"] == pc["seconds"]


def test_profile_reduced_compares_with_a_saved_trace(tmp_path):
    real = profile_reduced.profile(profile_reduced.model_config("llama3_tiny", 3, ["dim=64"]),
                                   profile_reduced.WorkloadConfig(batch_size=1, seq_len=16), torch.device("cpu"))[0]
    real.save(tmp_path / "real.json")
    s = profile_reduced.main(["--model", "llama3_tiny", "--set", "dim=64", "--target-layers", "3",
                              "--seq-len", "16", "--device", "cpu", "--compare-trace", str(tmp_path / "real.json"),
                              "--out-dir", str(tmp_path / "out")])
    assert s["compare_trace"]["op_names_equal"] and s["compare_trace"]["live_peak_ratio"] == 1.0
    assert "plan_compile" not in s and not (tmp_path / "out" / "plan_compile.json").exists()


def test_profile_reduced_names_bad_models():
    with pytest.raises(ValueError, match="no .*nope.yaml; valid: .*llama3_70b"):
        profile_reduced.model_config("nope", 2, [])
    with pytest.raises(ValueError, match="inherits"):
        profile_reduced.model_config("llama3_70b_4l", 2, [])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        profile_reduced.model_config("llama3_tiny", 2, ["dim"])
    with pytest.raises(ValueError, match="unknown key"):
        profile_reduced.model_config("llama3_tiny", 2, ["width=3"])
    cfg = profile_reduced.model_config("llama3_70b", 2, [])
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.multiple_of, cfg.ffn_dim_multiplier,
            cfg.n_layers) == (8192, 64, 8, 128256, 4096, 1.3, 2)
