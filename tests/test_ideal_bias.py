"""analysis.ideal_bias: a modeled or composed Ideal against Ideal measured at the same point."""
from __future__ import annotations

import numpy as np
import pytest

from analysis.ideal_bias import bias_frame, main
from analysis.load import load_sweep
from teraio.core.trace import TensorRecord, Trace
from teraio.result import result_row, write_result


def write_row(root, name, system, seconds, *, measure="measured", batch=4, micro=2, seq=8, trace=None,
              gpu_name="GPU X", status="ok"):
    point = {"model": "tiny", "system": system, "hardware": "gpu", "batch_size": batch,
             "micro_batch_size": micro, "seq_len": seq, "trial": int(name[-1])}
    r = result_row(point, {"hardware": {"name": "gpu", "n_gpus": 1}}, status=status, gpu_name=gpu_name,
                   error=None if status == "ok" else "torch.OutOfMemoryError: CUDA out of memory")
    r["measure"] = measure
    r["iterations"] = [{"step": 2, "seconds": s, "tokens": batch * seq, "tokens_per_s": batch * seq / s}
                       for s in seconds]
    r["tokens_per_s"] = batch * seq * len(seconds) / sum(seconds) if seconds else None
    job = root / name
    job.mkdir(parents=True)
    if trace is not None:  # a whole step of the point: its kernel times add up to `trace`
        tensors = [TensorRecord(0, "param:w", 64, "param", True, [0, 1]),
                   TensorRecord(1, "optim:w:exp_avg", 64, "optim", True, [1])]
        Trace(op_names=["mm", "lerp_"], op_seconds=np.array([trace - 1.0, 1.0]), tensors=tensors,
              meta={"model": "tiny", "batch_size": batch, "micro_batch_size": micro, "seq_len": seq}
              ).save(job / "trace.json.gz")
        r["artifacts"] = {"trace": "trace.json"}  # committed gzipped, as reference rows are
    write_result(job / "result.json", r)


def test_modeled_and_composed_ideal_against_the_measured_one(tmp_path, capsys):
    write_row(tmp_path, "ideal-t0", "ideal", [2.0, 2.0])
    write_row(tmp_path, "ideal-t1", "ideal", [3.0, 3.0])  # measured: mean iteration 2.5 s
    write_row(tmp_path, "mixed-t0", "teraio_mixed", [9.0, 9.0], trace=3.0)
    write_row(tmp_path, "mixed-t1", "teraio_mixed", [9.0, 9.0], trace=2.75)
    write_row(tmp_path, "ideal-composed-t0", "ideal", [2.6], measure="composed")
    # Another point: an estimate but no measured Ideal, so no ratio.
    write_row(tmp_path, "other-t0", "teraio_mixed", [9.0], seq=16, trace=5.0)
    frame = bias_frame([load_sweep(tmp_path)])
    assert list(frame["how"]) == ["composed", "modeled from teraio_mixed"]
    composed, modeled = frame.iloc[0], frame.iloc[1]
    assert (modeled["measured_s"], modeled["measured_n"], modeled["estimate_n"]) == (2.5, 2, 2)
    assert modeled["estimate_s"] == pytest.approx(2.875)
    assert (modeled["ratio"], modeled["ratio_min"], modeled["ratio_max"]) == pytest.approx((1.15, 1.1, 1.2))
    assert composed["ratio"] == pytest.approx(2.6 / 2.5) and composed["estimate_n"] == 1

    main([str(tmp_path), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "ideal_bias.md").read_text()
    assert "| tiny | 4 | 2 | 8 | GPU X | modeled from teraio_mixed | 2.500 (2) | 2.875 (2) | 1.150 (1.100–1.200) |" in md
    assert (tmp_path / "out" / "ideal_bias.tex").exists()


def test_a_cpu_sweep_without_a_gpu_name_gets_its_ratio(tmp_path):
    """On a CPU no row names a GPU (all missing, float64), while the estimates' frame is
    text: the smoke sweep's analysis failed to merge them."""
    write_row(tmp_path, "ideal-t0", "ideal", [2.0], gpu_name=None)
    write_row(tmp_path, "mixed-t0", "teraio_mixed", [9.0], trace=3.0, gpu_name=None)
    frame = bias_frame([load_sweep(tmp_path)])
    assert list(frame["how"]) == ["modeled from teraio_mixed"]
    assert frame.iloc[0]["ratio"] == pytest.approx(1.5)


def test_no_point_with_both_is_said(tmp_path):
    write_row(tmp_path, "ideal-t0", "ideal", [2.0])
    with pytest.raises(SystemExit, match="no point has both"):
        main([str(tmp_path), "--out", str(tmp_path / "out")])


def test_the_analysis_takes_a_composed_ideal_over_a_modeled_one(tmp_path):
    from analysis.aggregate import add_pct_of_ideal, summarize_runs

    write_row(tmp_path, "ideal-modeled-t0", "ideal", [0.16], measure="modeled")  # 200 tokens/s
    write_row(tmp_path, "ideal-composed-t0", "ideal", [0.32], measure="composed")  # 100 tokens/s
    write_row(tmp_path, "mixed-t0", "teraio_mixed", [0.64])  # 50 tokens/s
    out = add_pct_of_ideal(summarize_runs(load_sweep(tmp_path).runs))
    mixed = out[out["system"] == "teraio_mixed"].iloc[0]
    assert mixed["ideal_measure"] == "composed" and mixed["pct_of_ideal"] == pytest.approx(50.0)
    write_row(tmp_path, "ideal-t0", "ideal", [0.64])  # measured, 50 tokens/s: still first
    out = add_pct_of_ideal(summarize_runs(load_sweep(tmp_path).runs))
    mixed = out[out["system"] == "teraio_mixed"].iloc[0]
    assert mixed["ideal_measure"] == "measured" and mixed["pct_of_ideal"] == pytest.approx(100.0)


def test_where_ideal_ran_out_of_memory_it_is_modeled_from_teraios_trace_and_labelled(tmp_path):
    from analysis.ideal_bias import modeled_ideals
    from analysis.tables import write_tables

    write_row(tmp_path, "ideal-t0", "ideal", [], status="oom")  # not even one micro-batch fits
    write_row(tmp_path, "mixed-t0", "teraio_mixed", [4.0, 4.0], trace=2.0)  # 8 tokens/s; its step's kernels 2 s
    write_row(tmp_path, "mixed-t1", "teraio_mixed", [4.0], trace=2.0)
    # Another point where Ideal ran ok: its own row, never a model.
    write_row(tmp_path, "ideal-t2", "ideal", [1.0], seq=16)
    write_row(tmp_path, "mixed-t2", "teraio_mixed", [4.0], seq=16, trace=2.0)
    sweep = load_sweep(tmp_path)
    modeled = modeled_ideals(sweep)
    assert modeled.to_dict("records") == [{"model": "tiny", "hardware": "gpu on GPU X", "batch_size": 4, "seq_len": 8,
                                           "ideal_tokens_per_s": 16.0,
                                           "ideal_measure": "modeled from TeraIO-Mixed's trace"}]
    write_tables(sweep, tmp_path / "out")
    md = (tmp_path / "out" / "throughput.md").read_text()
    mixed = [ln for ln in md.splitlines() if "| TeraIO-Mixed |" in ln and "bs4_seq8 |" in ln]
    assert len(mixed) == 1 and "| 50.0 |" in mixed[0] and "modeled from TeraIO-Mixed's trace" in mixed[0], md
    assert "Ideal ran out of memory at tiny bs4 seq8" in md
    other = [ln for ln in md.splitlines() if "| TeraIO-Mixed |" in ln and "bs4_seq16 |" in ln]
    assert len(other) == 1 and "| 25.0 |" in other[0] and "| measured |" in other[0], md
