"""``analysis.claims``: every claim's verdict follows its rule on hand-made rows; the committed
``runs/reference/h200/claims/`` files regenerate exactly from the committed rows, and
ae_README.md's generated blocks are those files; the claims table's cells are short (one or
two sentences), the detail file keeps each point. Also what the tables say each row ran
(its micro-batch, no steps for a modeled row, TeraIO's engine settings) and the fairness
table."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from analysis import aggregate as agg
from analysis import claims as cl
from analysis import load_sweep
from analysis.fairness import fairness_frame, fairness_table
from analysis.tables import throughput_table
from test_analysis import set_config, write_run

REPO = Path(__file__).resolve().parents[1]
REF = REPO / "runs" / "reference" / "h200"
# runs/reference/h200/claims/COMMAND.md's command, run from the repository root
REF_ARGS = ["runs/reference/h200/fig7_h200", "runs/reference/h200/fig9_h200",
            "--characterize", "runs/reference/cpu/characterize/characterize.csv",
            "--roofline", "runs/reference/cpu/fig3/roofline.csv",
            "--plan-compile", "benchmarks/results/plan_compile_cpu.json"]
WL = dict(batch=8, seq=64, micro=2)
TUNING = {"file": "tuning.json", "chosen": {"micro_batch_size": 2},
          "candidates": [{"setting": {"micro_batch_size": 2}, "status": "ok", "tokens_per_s": 100.0, "message": None},
                         {"setting": {"micro_batch_size": 4}, "status": "oom", "tokens_per_s": None,
                          "message": "CUDA out of memory"}]}


def edit(job: Path, **fields) -> None:
    r = json.loads((job / "result.json").read_text())
    r.update(fields)
    (job / "result.json").write_text(json.dumps(r))


def fig7(tmp_path: Path, mixed: float, zero: float | None, *, ideal: float = 1000.0, tuned: bool = True,
         ideal_measure: str = "measured", zero_status: str = "ok") -> cl.Evidence:
    """A ``fig7_x`` sweep of one point: Ideal, TeraIO-Mixed and (unless None) ZeRO-Offload
    trained at micro-batch 1 by a run-config setting, 2 trials each."""
    root = tmp_path / "fig7_x"
    write_run(root, "ideal", system="ideal", trial=0, tps=ideal, measure=ideal_measure, **WL)
    for t in (0, 1):
        write_run(root, f"mixed{t}", system="teraio_mixed", trial=t, tps=mixed, **WL)
        if zero is not None:
            job = write_run(root, f"zero{t}", system="zero_offload", trial=t, tps=zero, status=zero_status, **WL)
            r = json.loads((job / "result.json").read_text())
            r["config"]["system"] = {"name": "zero_offload", "options": {"micro_batch_size": 1, "stage": 3}}
            if zero_status == "ok":
                r["zero_micro_batch_size"] = 1
            if tuned:
                r["tuning"] = TUNING
            (job / "result.json").write_text(json.dumps(r))
    return cl.Evidence([load_sweep(root)])


def finding(ev: cl.Evidence, claim: str) -> cl.Finding:
    return next(c for c in cl.CLAIMS if c.id == claim).compute(ev)


@pytest.mark.parametrize("mixed, tuned, verdict", [
    (1500.0 * 0.7, True, cl.SUPPORTED),     # 1.5× a tuned ZeRO: ≥ 0.9 × 1.47
    (1500.0 * 0.7, False, cl.PARTLY),       # the same against an untuned ZeRO: capped
    (1100.0 * 0.7, True, cl.PARTLY),        # faster, not by 0.9 × 1.47
    (0.9 * 700.0, True, cl.NOT_SUPPORTED),  # slower
])
def test_c1_divides_teraio_mixed_by_the_best_zero_and_caps_an_untuned_baseline(tmp_path, mixed, tuned, verdict):
    ev = fig7(tmp_path, mixed, 700.0, tuned=tuned)
    f = finding(ev, "C1")
    assert f.verdict == verdict
    assert f"mean {mixed / 700.0:.2f}×" in f.ours
    assert ("not tuned" in f.ours) == (not tuned)
    assert "fig7_x/mixed/result.json" not in f.used and any("mixed" in u for u in f.used)


def test_a_finding_is_short_and_its_detail_names_each_point(tmp_path):
    ev = fig7(tmp_path, 800.0, 700.0)
    f = finding(ev, "C1")
    assert f.ours == "mean 1.14× over 1 point"
    assert f.detail == "per point: tiny bs8_seq64 1.14× (ZeRO-Offload)"
    table = cl.claims_table(cl.findings(ev), ["fig7_x"]).set_index("#")
    assert table.loc["C1", "ours"] == f.ours and table.loc["C1", "from"] == "fig7_x: 4 rows"
    detail = cl.claims_detail_table(cl.findings(ev)).set_index("#")
    assert detail.loc["C1", "ours, point by point"] == f.detail
    assert detail.loc["C1", "rows used"] == ", ".join(f.used)
    assert detail.loc["C22", "ours, point by point"] == "BERT-Large is not built"  # no detail: ours


def test_sources_count_each_sweeps_rows_and_name_other_files():
    used = ("fig7_x/a-t{0,1,2}/result.json", "fig7_x/b/result.json", "fig9_x/c-t{1}/result.json", "x/y.csv")
    assert cl.sources(used, ["fig7_x", "fig9_x"]) == "fig7_x: 4 rows, fig9_x: 1 row, x/y.csv"
    assert cl.sources((), ["fig7_x"]) == "none"


def test_a_claim_with_no_rows_is_not_measured_and_says_why(tmp_path):
    ev = fig7(tmp_path, 800.0, None)
    assert finding(ev, "C1").verdict == cl.NOT_MEASURED
    f = finding(ev, "C5")
    assert f.verdict == cl.NOT_MEASURED and "llama3_70b" in f.ours


def test_a_failed_zero_gives_no_ratio_and_is_named(tmp_path):
    f = finding(fig7(tmp_path, 800.0, 700.0, zero_status="oom"), "C1")
    assert f.verdict == cl.NOT_MEASURED and "ZeRO-Offload" in f.ours


def test_a_modeled_ideal_is_never_averaged_and_is_named(tmp_path):
    f = finding(fig7(tmp_path, 950.0, 700.0, ideal_measure="modeled"), "C2")
    assert f.verdict == cl.NOT_MEASURED
    assert "modeled Ideal" in f.ours and "95.0 %" in f.ours
    f = finding(fig7(tmp_path / "m", 950.0, 700.0), "C2")
    assert f.verdict == cl.SUPPORTED and "mean 95.0 %" in f.ours and "modeled" not in f.ours


def test_sweeps_holding_the_same_point_twice_are_refused(tmp_path):
    for name in ("fig7_a", "fig7_b"):
        write_run(tmp_path / name, "mixed", system="teraio_mixed", trial=0, tps=1.0, **WL)
    with pytest.raises(ValueError, match="fig7_a, fig7_b"):
        cl.Evidence([load_sweep(tmp_path / n) for n in ("fig7_a", "fig7_b")])


def test_every_claim_gets_a_verdict_on_a_sweep(tmp_path):
    ev = fig7(tmp_path, 800.0, 700.0)
    found = cl.findings(ev)
    assert [c.id for c, _ in found] == [f"C{i}" for i in range(1, 23)]
    assert {f.verdict for _, f in found} <= {cl.SUPPORTED, cl.PARTLY, cl.NOT_SUPPORTED, cl.NOT_MEASURED}


def test_tables_show_the_micro_batch_each_row_ran_and_no_steps_for_a_modeled_row(tmp_path):
    ev = fig7(tmp_path, 800.0, 700.0, ideal_measure="modeled")
    table = throughput_table(agg.add_pct_of_ideal(agg.summarize_runs(ev.runs))).set_index("System")
    assert table.loc["ZeRO-Offload", "µbatch"] == "1"    # ran at 1, the point's is 2
    assert table.loc["TeraIO-Mixed", "µbatch"] == "2"
    assert (table.loc["Ideal", "warm-up"], table.loc["Ideal", "steps"]) == ("n/a", "n/a")
    assert table.loc["TeraIO-Mixed", "steps"] == "2"
    assert set(table["Ideal is"]) == {"modeled"}


def test_fairness_lists_candidates_of_a_tuned_setting_and_says_when_untuned(tmp_path):
    frame = fairness_frame(fig7(tmp_path, 800.0, 700.0).runs).set_index("system")
    zero = frame.loc["zero_offload"]
    assert zero["tuned"] and zero["ran_with"] == "micro-batch 1, stage 3"
    assert zero["candidates"] == ("micro_batch_size 2: 100.0 tokens/s; "
                                  "micro_batch_size 4: oom (CUDA out of memory)")
    assert zero["how"] == "tuned by measurement: kept micro_batch_size 2"
    assert frame.loc["teraio_mixed", "how"] == "not tuned: the point's micro-batch"
    assert zero["engine"] == "n/a"
    untuned = fairness_frame(fig7(tmp_path / "u", 800.0, 700.0, tuned=False).runs).set_index("system")
    assert untuned.loc["zero_offload", "how"] == \
        "not tuned: micro-batch set in the run config (system.options.micro_batch_size)"
    assert len(fairness_table(untuned.reset_index())) == 3


def test_fairness_names_the_engine_settings_each_teraio_group_ran_with(tmp_path):
    """A TeraIO row made before an engine option existed says so; the host packing the plan
    kept and the SSD tier's I/O path come from the rows."""
    for t, options in enumerate(({"device_waits": True, "release_grads": False, "host_arena": "auto"},
                                 {"device_waits": True, "release_grads": False, "host_arena": "auto"})):
        job = write_run(tmp_path / "new", f"m{t}", system="teraio_mixed", trial=t, tps=1.0, **WL)
        edit(job, config={**json.loads((job / "result.json").read_text())["config"],
                          "system": {"name": "teraio_mixed", "options": options}},
             plan={"host_arena": True}, ssd_io_mode="direct")
    old = write_run(tmp_path / "old", "m", system="teraio_mixed", trial=0, tps=1.0, **WL)
    edit(old, config={**json.loads((old / "result.json").read_text())["config"],
                      "system": {"name": "teraio_mixed", "options": {"device_waits": False}}})
    new = fairness_frame(load_sweep(tmp_path / "new").runs)["engine"].tolist()
    assert new == ["device_waits true, release_grads false, host_arena auto, host tier kept as region, SSD I/O direct"]
    assert fairness_frame(load_sweep(tmp_path / "old").runs)["engine"].tolist() == [
        "device_waits false, release_grads absent (before the option: false), "
        "host_arena absent (before the option: slots)"]


def test_runtime_sums_each_groups_worker_time_failed_runs_included(tmp_path):
    from analysis.runtime import runtime_frame, runtime_table
    for t, (status, wall) in enumerate((("ok", 30.0), ("ok", 90.0), ("oom", 12.0))):
        edit(write_run(tmp_path, f"m{t}", system="teraio_mixed", trial=t, tps=1.0, status=status, **WL),
             wall_seconds=wall)
    edit(write_run(tmp_path, "i", system="ideal", trial=0, tps=1.0, **WL), wall_seconds=None)
    frame = runtime_frame(load_sweep(tmp_path).runs).set_index("system")
    assert frame.loc["teraio_mixed", ["runs", "ok", "min_s", "max_s", "total_s"]].tolist() == [3, 2, 12.0, 90.0, 132.0]
    assert frame.loc["ideal", "runs"] == 1 and frame.loc["ideal", "total_s"] == 0.0
    table = runtime_table(frame.reset_index()).set_index("System")
    assert table.loc["TeraIO-Mixed", "worker s per run"] == "12.0–90.0"
    assert table.loc["TeraIO-Mixed", "runs (ok)"] == "3 (2)"
    assert table.loc["Ideal", "worker s per run"] == "n/a"


def test_insert_replaces_each_block_and_refuses_a_document_without_one(tmp_path):
    made = tmp_path / "claims.md"
    made.write_text("| generated |\n")
    doc = tmp_path / "doc.md"
    doc.write_text("a\n<!-- analysis.claims:claims begin -->\nold\n<!-- analysis.claims:claims end -->\nb\n")
    assert cl.insert(doc, {"claims": made}) == ["claims"]
    assert doc.read_text() == ("a\n<!-- analysis.claims:claims begin -->\n| generated |\n"
                               "<!-- analysis.claims:claims end -->\nb\n")
    assert cl.block(doc.read_text(), "claims") == "| generated |"
    (tmp_path / "none.md").write_text("nothing here\n")
    with pytest.raises(ValueError, match="no generated block"):
        cl.insert(tmp_path / "none.md", {"claims": made})


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("claims")
    command = (REF / "claims" / "COMMAND.md").read_text()
    assert "python -m analysis.claims " + " ".join(REF_ARGS) + " --out runs/reference/h200/claims" in command
    here = os.getcwd()
    os.chdir(REPO)
    try:
        cl.main([*REF_ARGS, "--out", str(out)])
    finally:
        os.chdir(here)
    return out


def test_the_committed_claims_regenerate_exactly_from_the_committed_rows(regenerated):
    committed = sorted(p for p in (REF / "claims").iterdir() if p.suffix in (".md", ".tex") and p.stem != "COMMAND")
    assert {p.name for p in committed} == {f"{n}.{x}" for n in cl.WRITTEN for x in ("md", "tex")}
    for path in committed:
        assert (regenerated / path.name).read_text() == path.read_text(), path.name
    text = (regenerated / "claims.md").read_text()
    assert [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| C")] == \
        [f"C{i}" for i in range(1, 23)]


def test_the_committed_claims_table_has_short_cells(regenerated):
    """Each cell of our figure is one or two sentences (a sentence ends at '.', '!' or '?'
    followed by a space and a capital, or at the cell's end) of at most 60 words (runs of
    non-space characters); the point-by-point figures are in claims_detail.md."""
    import re
    rows = [line for line in (regenerated / "claims.md").read_text().splitlines() if line.startswith("| C")]
    assert len(rows) == 22
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        ours = cells[3]
        sentences = [t for t in re.split(r"(?<=[.!?])\s+(?=[A-Z])", ours) if t]
        assert 1 <= len(sentences) <= 2, (cells[0], ours)
        assert all(len(t.split()) <= 60 for t in sentences), (cells[0], ours)


def test_ae_readme_blocks_are_the_generated_files(regenerated):
    """The claims table is inserted; the other generated tables may be (ae_README links to
    their files to stay short), and where one is, it is the generated file."""
    readme = (REPO / "ae_README.md").read_text()
    assert cl.block(readme, "claims") is not None
    for name in cl.BLOCKS:
        if cl.block(readme, name) is not None:
            assert cl.block(readme, name) == (regenerated / f"{name}.md").read_text().strip(), name


def test_c18_reads_the_schedule_search_teraio_runs_by_default(tmp_path):
    """TeraIO plans with recompute=auto by default: where an entry timed the schedule search,
    C18 compares that time with the paper's, not the planner's without recompute."""
    entries = {k: {"median_seconds": 1.0, "schedule": {"median_seconds": t}}
               for k, t in (("llama3_8b", 2.0), ("granite_8b", 50.0), ("llama3_70b", 3.0))}
    path = tmp_path / "plan_compile.json"
    path.write_text(json.dumps({"entries": entries}))
    f = cl.c18(cl.Evidence([], plan_compile=path))
    assert "granite_8b 50" in f.ours and "recompute=auto" in f.ours
    assert f.verdict == cl.PARTLY  # 50 s > the paper's 37.9 s for Granite-8B
    for e in entries.values():
        del e["schedule"]
    path.write_text(json.dumps({"entries": entries}))
    f = cl.c18(cl.Evidence([], plan_compile=path))
    assert f.verdict == cl.SUPPORTED and "recompute=auto" not in f.ours


def cpu_rows(root: Path, mixed: float = 5537.0) -> Path:
    """A sweep of CPU rows, as the smoke sweep makes: Ideal, TeraIO-Mixed at 553.7 % of it and
    a ZeRO-Offload whose capacity nothing enforced."""
    write_run(root, "ideal", system="ideal", trial=0, tps=1000.0, device="cpu", **WL)
    write_run(root, "mixed", system="teraio_mixed", trial=0, tps=mixed, device="cpu", **WL)
    edit(write_run(root, "zero", system="zero_offload", trial=0, tps=700.0, device="cpu", **WL),
         capacity_enforced=False)
    return root


def test_claims_of_a_folder_without_a_fig7_sweep_are_not_measured(tmp_path, capsys):
    smoke = cpu_rows(tmp_path / "smoke")
    cl.main([str(smoke), "--out", str(tmp_path / "out")])  # once a KeyError in C16
    found = {c.id: f for c, f in cl.findings(cl.Evidence([load_sweep(smoke)]))}
    assert found["C2"].verdict == found["C16"].verdict == cl.NOT_MEASURED
    assert found["C16"].ours == "no fig7* sweep given" and found["C14"].ours == "no fig9* sweep given"


def test_a_gpu_claim_is_not_measured_from_rows_with_no_gpu(tmp_path):
    ev = cl.Evidence([load_sweep(cpu_rows(tmp_path / "fig7_cpu"))])
    found = {c.id: f for c, f in cl.findings(ev)}
    assert found["C2"].verdict == cl.NOT_MEASURED  # once supported, at 553.7 % of Ideal
    assert found["C2"].ours == "no row of the fig7* sweeps to read: 3 rows with no GPU"
    for claim in cl.CLAIMS:
        if claim.reads == "fig7":
            assert found[claim.id].verdict == cl.NOT_MEASURED, claim.id
    cl.write_claims(ev, tmp_path / "out")
    text = " ".join((tmp_path / "out" / "claims.md").read_text().split())
    assert "Read by no claim: 3 rows with no GPU" in text and "fig7_cpu/mixed" in text


def test_a_share_of_ideal_above_100_percent_is_flagged_and_never_supported(tmp_path):
    f = finding(fig7(tmp_path, 1500.0, 700.0), "C2")
    assert f.verdict == cl.PARTLY and "mean 150.0 %" in f.ours
    assert "flagged: 150.0 % of Ideal at 1 point, above Ideal" in f.ours


def test_a_row_cut_short_by_its_time_limit_is_read_by_no_claim(tmp_path):
    root = tmp_path / "fig7_x"
    fig7(tmp_path, 950.0, 700.0)
    job = root / "mixed1"
    r = json.loads((job / "result.json").read_text())
    r["config"]["workload"] = {"measure_steps": 3}  # it measured 2 of them
    r["time_limited"] = {"reason": "cut", "measured_steps": 2, "asked_steps": 3, "timeout_s": 60}
    (job / "result.json").write_text(json.dumps(r))
    ev = cl.Evidence([load_sweep(root)])
    assert ev.aside.values.tolist() == [["fig7_x", "mixed1", "fewer measured steps than asked"]]
    f = finding(ev, "C2")
    assert "fig7_x/mixed0/result.json" in f.used and "fig7_x/mixed1/result.json" not in f.used


def test_trials_of_different_configs_in_two_sweeps_are_refused(tmp_path):
    for t, (name, lr) in enumerate((("fig7_a", 1e-4), ("fig7_b", 1e-3))):
        job = write_run(tmp_path / name, "mixed", system="teraio_mixed", trial=t, tps=1.0, **WL)
        set_config(job, "workload.lr", lr)
    with pytest.raises(ValueError, match=r"workload\.lr: 0\.0001 in fig7_a/mixed, 0\.001 in fig7_b/mixed"):
        cl.Evidence([load_sweep(tmp_path / n) for n in ("fig7_a", "fig7_b")])


def llama3_70b_cut(tmp_path: Path, *, mixed_long: str = "ok") -> cl.Evidence:
    """A ``fig7_70b`` sweep of the Llama3-70B cut (``llama3_70b_2l``) at two points, 2 trials of
    each system: at 4 x 2,048 tokens Ideal 1,000 tokens/s, ZeRO-Infinity 300, TeraIO-Mixed 500,
    TeraIO-SSD 200; at 4 x 4,096 Ideal 800 (composed), ZeRO-Infinity ``oom``, TeraIO-Mixed 400
    (or ``mixed_long``'s failure), TeraIO-SSD 160; ZeRO-Offload ``oom`` at both (tuned, one drive
    each; test_analysis.PRICES: ZeRO-Offload on a $1,500 server, TeraIO-Mixed and
    ZeRO-Infinity $1,700 with their drives)."""
    root = tmp_path / "fig7_70b"
    plan = {2048: {"ideal": 1000.0, "zero_offload": None, "zero_infinity": 300.0, "teraio_mixed": 500.0,
                   "teraio_ssd": 200.0},
            4096: {"ideal": 800.0, "zero_offload": None, "zero_infinity": None,
                   "teraio_mixed": 400.0 if mixed_long == "ok" else None, "teraio_ssd": 160.0}}
    for seq, systems in plan.items():
        for system, tps in systems.items():
            for t in (0, 1):
                status = "ok" if tps is not None else mixed_long if system == "teraio_mixed" else "oom"
                job = write_run(root, f"{system}-{seq}-t{t}", system=system, trial=t, tps=tps, status=status,
                                batch=4, seq=seq, micro=1, n_ssd=1,
                                measure="composed" if (system, seq) == ("ideal", 4096) else "measured")
                r = json.loads((job / "result.json").read_text())
                r["point"]["model"] = "llama3_70b_2l"
                if system.startswith("zero"):
                    r["tuning"] = TUNING
                (job / "result.json").write_text(json.dumps(r))
    return cl.Evidence([load_sweep(root)])


def test_the_llama3_70b_claims_read_the_cuts_rows(tmp_path):
    """C5, C9, C13 and C15 read the Llama3-70B cut's rows (a fig7* sweep, models llama3_70b*):
    none of them is `not measured` for want of a Llama3-70B row."""
    ev = llama3_70b_cut(tmp_path)
    c5 = finding(ev, "C5")
    # ZeRO-Infinity 30 % of Ideal at its one point; TeraIO-Mixed 50 % at both; their ratio 500 / 300
    assert c5.ours == ("ZeRO-Offload failed at every point (oom×2); ZeRO-Infinity 30.0 % of Ideal at 1 point, "
                       "TeraIO-Mixed 50.0 % at 2 points; TeraIO-Mixed ÷ ZeRO-Infinity 1.67× over 1 point where both ran")
    assert c5.verdict == cl.SUPPORTED  # ZeRO-Offload failed, and 1.67 >= 0.9 x 1.33
    assert any("zero_offload" in u for u in c5.used) and any("ideal-4096" in u for u in c5.used)
    c9 = finding(ev, "C9")
    assert c9.verdict == cl.SUPPORTED and "ZeRO-Infinity oom at llama3_70b_2l bs4_seq4096" in c9.ours
    c13 = finding(ev, "C13")
    # tokens/s per $: TeraIO-Mixed 500 / 1,700 over ZeRO-Infinity 300 / 1,700 at 2,048 tokens
    assert "over ZeRO-Infinity 1.67× at 1 point" in c13.ours
    assert "over ZeRO-Offload: no point where both ran (failed at every point (oom×2))" in c13.ours
    assert c13.verdict == cl.PARTLY  # ZeRO-Infinity's holds (1.67 >= 0.9 x 1.47); ZeRO-Offload's is not measured
    c15 = finding(ev, "C15")
    assert c15.verdict == cl.NOT_MEASURED and "ran ok with 1 drive(s)" in c15.ours and "llama3_70b row" not in c15.ours
    found = dict((c.id, f) for c, f in cl.findings(ev))
    assert not [c for c in ("C5", "C9", "C13", "C15") if "no llama3_70b row" in found[c].ours]


def test_a_failed_llama3_70b_teraio_row_fails_c9_and_leaves_c5_its_other_point(tmp_path):
    ev = llama3_70b_cut(tmp_path, mixed_long="error")
    assert finding(ev, "C9").verdict == cl.NOT_SUPPORTED  # TeraIO-Mixed failed at 4,096 tokens
    c5 = finding(ev, "C5")
    assert "TeraIO-Mixed 50.0 % at 1 point" in c5.ours and c5.verdict == cl.SUPPORTED


def test_a_row_whose_plan_predates_the_host_packing_loads_with_its_config(tmp_path):
    """A TeraIO row made before ``host_arena`` existed (its plan and config name none, as the
    committed fig7_h200_first_estimate and fig9_h200 rows): its decision reads the plan it has
    (no region), and the row loads with the config it ran with, no choice added to it."""
    from analysis.trials import ran_with
    from teraio.trainer.options import decision

    job = write_run(tmp_path / "fig7_x", "mixed", system="teraio_mixed", trial=0, tps=100.0, **WL)
    edit(job, plan={"recomputes": 0})
    row = json.loads((job / "result.json").read_text())
    assert decision(row) == ({"recompute": "off", "host_arena": False, "host_update": "off"}, {})
    assert ran_with(row)["system"]["options"] == {}
    assert decision({**row, "plan": {"host_arena": 1}}) == ({"recompute": "off", "host_arena": True,
                                                             "host_update": "off"}, {})
    assert len(load_sweep(tmp_path / "fig7_x").runs) == 1
