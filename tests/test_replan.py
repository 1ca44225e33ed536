"""Committed TeraIO runs re-planned from their traces: ``teraio.perf.replan`` and the tools
on it (``benchmarks.replan``, ``benchmarks.host_packing``, ``benchmarks.plan_sensitivity``)."""
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import host_packing
from benchmarks import replan as replan_tool
from teraio.perf import jobdir, replan
from teraio.perf.replay import replayed_trace

ROOT = Path(__file__).resolve().parents[1]

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


def test_the_granite_host_cap_floor_is_reproduced():
    """At the 64 GB host cap the Granite-8B cut must keep 9.4 GB on the drive, at 274 ops,
    while the plan's host slots hold at most 54.2 GB at once (replan_granite_host_caps.md)."""
    doc = json.loads((RESULT.parent / "replan_granite_host_caps.json").read_text())
    (entry,) = [e for e in doc["jobs"] if e["replanned_host_cap_bytes"] == 64 * 10**9]
    again = replan.replan(ROOT / entry["job"], 64 * 10**9)
    assert again["beyond_host"] == entry["beyond_host"] == {"bytes": 9429707941, "ops": 274}
    held = again["replanned"]["most_bytes_held"]
    assert held == entry["replanned"]["most_bytes_held"]
    assert round(held["host"] / 1e9, 1) == 54.2 < again["replanned"]["slot_bytes"]["host"] / 1e9


def test_beyond_host_is_what_capacity_and_host_cap_leave_over():
    from teraio.core.trace import TensorRecord, Trace

    trace = Trace(["a", "b", "c", "d"], [1.0] * 4,
                  [TensorRecord(0, "param:w", 10, "param", True, [0, 1, 2, 3]),
                   TensorRecord(1, "op1:out0", 50, "activation", False, [1, 2])],
                  op_allocated_bytes=[10, 60, 64, 10])  # op c's own workspace: 4 B more
    assert replan.beyond_host(trace, 20, 25) == {"bytes": 19, "ops": 2}
    assert replan.beyond_host(trace, 20, 44) == {"bytes": 0, "ops": 0}


def test_a_job_without_its_trace_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no trace.json or trace.json.gz"):
        replan.replan(tmp_path)
    with pytest.raises(ValueError, match=r"host_cap_bytes=-1; must be >= 0"):
        replan.replan(ROOT / "no-such-job", host_cap_bytes=-1)


def test_one_row_per_host_cap_and_the_command_beside_them(tmp_path):
    job = "runs/reference/h200/fig7_h200/llama3_8b_4l-teraio_mixed-h200-bs8-mb2-seq3072-t0"
    out = tmp_path / "r.json"
    replan_tool.main([str(ROOT / job), "--host-cap-bytes", "0", str(64 * 10**9), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["command"].endswith(f"--host-cap-bytes 0 {64 * 10**9} --out {out}")
    row, same_cap = doc["jobs"]
    (committed,) = [e for e in json.loads(RESULT.read_text())["jobs"] if e["job"] == job]
    assert same_cap["replanned"]["slot_bytes"] == committed["replanned"]["slot_bytes"]
    assert row["replanned_host_cap_bytes"] == 0 and row["host_cap_bytes"] == 64 * 10**9
    new = row["replanned"]
    assert new["slot_bytes"]["host"] == new["bytes_per_tier"]["host"] == 0 < new["bytes_per_tier"]["ssd"]
    assert new["simulated_iteration_s"] > 10 * row["committed"]["simulated_iteration_s"]


def test_held_bytes_fit_a_period_beside_what_is_held_over_it():
    # 10 ops; period 0 holds [2, 5), period 1 [4, 8), period 2 wraps: [8, 13) = ops 8, 9, 0, 1, 2.
    held = host_packing.HeldBytes(10, np.array([2, 4, 8]), np.array([5, 8, 13]), cap_bytes=100)
    held.place(0, 60)
    assert held.room(np.array([1, 2]), np.array([40, 40])).tolist() == [True, True]
    assert held.room(np.array([1, 2]), np.array([41, 41])).tolist() == [False, False]  # op 4; op 2
    held.place(2, 40)
    assert held.held_bytes == 100
    assert held.room(np.array([1]), np.array([40])).tolist() == [True]  # meets period 0 only
    assert held.room(np.array([1]), np.array([41])).tolist() == [False]


def test_a_first_fit_arena_places_each_period_at_the_lowest_free_offset():
    # 10 ops, cap 256 B, sizes rounded up to 64 B. Periods: 0 [0, 4), 1 [2, 6), 2 [5, 9),
    # 3 [8, 12) = ops 8, 9, 0, 1 (wraps), 4 [3, 5).
    arena = host_packing.first_fit_arena(10, np.array([0, 2, 5, 8, 3]), np.array([4, 6, 9, 12, 5]), cap_bytes=256)
    arena.place(0, 64)
    assert arena.offset(1, 100) == 64          # meets period 0: above it
    arena.place(1, 100)                        # [64, 192)
    assert arena.offset(2, 64) == 0            # meets period 1 only: below it
    arena.place(2, 64)
    assert arena.offset(3, 64) == 64           # meets periods 0 (wrapping) and 2, both at 0
    assert arena.offset(4, 65) == -1           # meets 0 and 1: [192, 256) holds 64 B, not 128
    assert arena.room(np.array([4, 4]), np.array([64, 65])).tolist() == [True, False]
    assert arena.held_bytes == 192
    with pytest.raises(ValueError, match="period 4 .65 B. of tensor 4 has no free offset in the 256 B region"):
        arena.place(4, 65)


def test_the_committed_host_packings_are_reproduced_and_keep_to_the_cap():
    """The Granite-8B cut's seq_short: slots hold at most 54.2 GB of the 64 GB cap (67.4 s
    simulated); a first-fit arena holds up to the cap (30.8 s), one offset per tensor 24.6 s,
    the held-bytes room test 25.5 s (host_packing_fig7_h200.md)."""
    doc = json.loads((RESULT.parent / "host_packing_fig7_h200.json").read_text())
    (entry,) = [e for e in doc["jobs"] if "granite_8b_8l" in e["job"] and "seq2560" in e["job"]]
    again = host_packing.compare(ROOT / entry["job"], entry["host_cap_bytes"])
    kinds = ("slots", "arena", "tensor_arena", "held_bound")
    for kind in kinds:
        for key in ("bytes_per_tier", "most_bytes_held", "migrations", "exposed"):
            assert again[kind][key] == entry[kind][key], (kind, key)
        assert again[kind]["most_bytes_held"]["host"] <= entry["host_cap_bytes"]
    assert again["slots"]["most_bytes_held"]["host"] < again["arena"]["most_bytes_held"]["host"]
    assert [round(again[k]["simulated_iteration_s"], 1) for k in kinds] == [67.4, 30.8, 24.6, 25.5]
    ssd = [again[k]["bytes_per_tier"]["ssd"] for k in kinds]
    assert ssd[3] < ssd[2] < ssd[1] < ssd[0]


def test_the_default_host_packing_kept_at_the_granite_cut_is_reproduced():
    """host_arena_auto.md: planned as its run planned it, the Granite-8B cut's seq_short trace
    is simulated at 68.19 s per iteration in slots and 25.88 s as one region, and the
    default (auto) keeps the region."""
    doc = json.loads((RESULT.parent / "host_arena_auto_fig7_h200.json").read_text())
    (entry,) = [e for e in doc["jobs"] if "granite_8b_8l" in e["job"] and "seq2560" in e["job"]]
    again = replan.replan(ROOT / entry["job"], host_arena="auto", released_grads=True)
    simulated = again["replanned"]["host_arena_auto"]
    assert simulated == pytest.approx(entry["replanned"]["host_arena_auto"], rel=1e-9)
    assert (round(simulated["slots"], 2), round(simulated["arena"], 2)) == (68.19, 25.88)
    assert again["replanned"]["host_arena"] is entry["replanned"]["host_arena"] is True
    assert again["replanned"]["bytes_per_tier"] == entry["replanned"]["bytes_per_tier"]


def test_a_run_s_own_plan_is_given_back_when_planned_as_the_run_did():
    """A fig9_h200 run of the current planner (release_grads): its trace planned with every
    gradient released after its last use, as the run planned it, gives the committed plan's
    summary back exactly; planned as saved it need not."""
    job = ROOT / "runs/reference/h200/fig9_h200/llama3_8b_4l-teraio_mixed-h200-1ssd-4gb-bs8-mb2-seq3072-t2"
    again = replan.replan(job, released_grads=True)
    assert again["replanned"] == again["committed"]
    assert again["replanned"]["host_arena"] is False and again["replanned"]["migrations"] == 449


def test_every_planning_file_still_names_the_trace_and_plan_it_was_made_from():
    """Each entry of a committed planning file (``"jobs"``: replan.py, host_packing.py,
    tail_offloads.py) names a job dir whose trace and plan are the ones it was made from: the
    compute time (``ideal_s``) of the trace as the plan was made for it
    (``teraio.perf.replay.replayed_trace``: without the device updates of parameters updated
    in host memory), the plan's capacity, and the committed plan's migrations and bytes per
    tier where the entry records them. A rerun that moves a job dir's first attempt to
    ``attempt.<n>/`` replaces the dir's own trace and plan, and fails this."""
    docs = {f: json.loads(f.read_text()) for f in sorted((ROOT / "benchmarks" / "results").rglob("*.json"))}
    docs = {f: doc for f, doc in docs.items() if isinstance(doc, dict) and isinstance(doc.get("jobs"), list)}
    assert len(docs) >= 9
    checked = 0
    for f, doc in docs.items():
        for entry in doc["jobs"]:
            job = ROOT / entry["job"]
            plan = jobdir.plan(job)
            trace, _ = replayed_trace(jobdir.trace(job), plan)  # as planned: hosted updates out
            where = (f.name, entry["job"])
            assert float(trace.op_seconds.sum()) == entry["ideal_s"], where
            assert plan.capacity_bytes == entry["capacity_bytes"], where
            if "committed" in entry:
                assert len(plan.migrations) == entry["committed"]["migrations"], where
                assert plan.bytes_per_tier() == entry["committed"]["bytes_per_tier"], where
            checked += 1
    assert checked >= 40


def test_plans_from_two_profiles_of_one_step_differ_as_the_committed_file_says():
    """The Granite-8B cut's seq_short, fig7_h200 trials 0 and 2: the same ops and tensors, op
    times a median 2.4 % apart; planned from trial 2's times the step simulates 3.9 s longer
    under either trial's times (benchmarks/results/plan_sensitivity/COMMAND.md)."""
    from benchmarks import plan_sensitivity

    doc = json.loads((ROOT / "benchmarks" / "results" / "plan_sensitivity" / "granite_seq_short_fig7_h200.json").read_text())
    rows = [doc["jobs"][0], doc["jobs"][2]]
    again = plan_sensitivity.sensitivity([ROOT / r["job"] for r in rows], released_grads=True)["jobs"]
    for new, old in zip(again, rows):
        assert new["replanned"] == old["replanned"]
        for j, m in ((0, 0), (1, 2)):
            assert new["simulated_s"][j] == pytest.approx(old["simulated_s"][m], rel=1e-9)
    (a, b), (c, d) = again[0]["simulated_s"], again[1]["simulated_s"]
    assert c - a > 3.5 and d - b > 3.5 and abs(a - b) < 0.3
    assert round(100 * again[1]["op_rel_diff_median"], 1) == 2.4


def test_plan_sensitivity_refuses_runs_of_other_configurations(tmp_path):
    from benchmarks import plan_sensitivity

    d = ROOT / "runs" / "reference" / "h200" / "fig7_h200"
    with pytest.raises(ValueError, match=r"1 job\(s\) given; need 2 or more"):
        plan_sensitivity.sensitivity([d / "llama3_8b_4l-teraio_mixed-h200-bs8-mb2-seq3072-t0"])
    with pytest.raises(ValueError, match=r"other ops or tensors than"):
        plan_sensitivity.sensitivity([d / "llama3_8b_4l-teraio_mixed-h200-bs8-mb2-seq3072-t0",
                                      d / "llama3_8b_4l-teraio_mixed-h200-bs16-mb8-seq1536-t0"])


def test_jittered_op_times_alone_move_the_plan_as_the_committed_file_says():
    """Trial 0's trace of the Granite-8B cut's seq_short planned with its op times jittered by
    3 % (seed 0) simulates at the committed value under its own times; bad arguments are
    refused."""
    from benchmarks import plan_sensitivity

    doc = json.loads((ROOT / "benchmarks" / "results" / "plan_sensitivity" / "granite_seq_short_fig7_h200.json").read_text())
    job = ROOT / doc["jitter"]["job"]
    again = plan_sensitivity.jitter(job, doc["jitter"]["fraction"], 1, released_grads=True)
    assert again["simulated_s"][0] == pytest.approx(doc["jitter"]["simulated_s"][0], rel=1e-9)
    assert again["ssd_bytes"][0] == doc["jitter"]["ssd_bytes"][0]
    assert again["own_s"] == pytest.approx(doc["jobs"][0]["simulated_s"][0], rel=1e-9)
    assert len(set(doc["jitter"]["ssd_bytes"])) > 1
    with pytest.raises(ValueError, match=r"fraction=1.5, seeds=2: need 0 < fraction < 1"):
        plan_sensitivity.jitter(job, 1.5, 2)


def test_plan_sensitivity_refuses_a_bad_jitter_before_it_plans(tmp_path, capsys):
    from benchmarks import plan_sensitivity

    with pytest.raises(SystemExit):  # no trace exists there: it would fail later if it planned
        plan_sensitivity.main([str(tmp_path / "a"), str(tmp_path / "b"), "--jitter", "0.03", "2.5",
                               "--out", str(tmp_path / "out.json")])
    assert "--jitter 0.03 2.5: FRACTION must be in (0, 1) and SEEDS a whole number >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_the_drive_room_replan_is_reproduced():
    """Trial 1's first attempt at the Granite-8B cut's bs_mid planned 70.8 GB of SSD slots
    where the drive had 68.4 GB free; planned within that room (less 1 GiB) its trace falls
    3.16 GB short, while trial 0's plan is unchanged (benchmarks/results/ssd_room/)."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "ssd_room" / "replan_granite_bs_mid.json").read_text())
    first, trial0, _ = doc["jobs"]
    room = 68_409_909_248 - (1 << 30)
    for entry in (first, trial0):
        again = replan.replan(ROOT / entry["job"], ssd_cap_bytes=room, released_grads=True)
        assert again["replanned_ssd_cap_bytes"] == entry["replanned_ssd_cap_bytes"] == room
        for kind in ("committed", "replanned"):
            for key in ("ssd_file_bytes", "shortfall_bytes", "bytes_per_tier", "migrations"):
                assert again[kind][key] == entry[kind][key], (entry["job"], kind, key)
    assert first["committed"]["ssd_file_bytes"] == 70_836_027_392 > room >= first["replanned"]["ssd_file_bytes"]
    assert first["replanned"]["shortfall_bytes"] == 3_159_051_069
    assert trial0["replanned"]["migrations"] == trial0["committed"]["migrations"]
    assert trial0["replanned"]["bytes_per_tier"] == trial0["committed"]["bytes_per_tier"]


@pytest.mark.parametrize("tool", ["replan", "replay_runs", "schedule", "host_packing"])
def test_a_truncated_trace_stops_a_tool_with_one_line_naming_it(tmp_path, tool):
    import importlib
    import shutil

    job = tmp_path / "job"
    shutil.copytree(ROOT / "runs/reference/h200/fig7_h200/llama3_8b_4l-teraio_mixed-h200-bs8-mb2-seq3072-t0", job)
    trace = jobdir.side_file(job, "trace.json")
    trace.write_bytes(trace.read_bytes()[:1000])
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"benchmarks.{tool}").main([str(job), "--out", str(out)])
    assert str(e.value) == f"python -m benchmarks.{tool}: {trace} is damaged (EOFError: Compressed file ended " \
                           "before the end-of-stream marker was reached)"
    assert not out.exists()
