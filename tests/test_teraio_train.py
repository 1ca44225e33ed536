"""TeraIO end to end on CPU: profile → plan → migrate for 20 steps of a tiny Llama3 below
its un-offloaded peak, bit-identical to training without offload, and within the capacity
from the first allocation on (the steps before the plan included)."""
from __future__ import annotations

import gc
import json
import re
import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import teraio.core.engine
import teraio.core.tiers.host
import teraio.core.tiers.ssd
import teraio.trainer.trainer
import teraio.workload.pipeline
from conftest import GPU_FRACTION, GPU_MODEL, GPU_OPTIONS, WORK, ModelBuilt, cap_then_build, config

from teraio.systems.measure import param_digest
from teraio.workload.models import build_model
from teraio.core.profiler import iter_tensors
from teraio.result import measured_before, result_row
from teraio.workload.step import make_batch, make_optimizer, train_step
from teraio.core.engine import PlanDriftError
from teraio.core.bandwidth import TierBandwidth
from teraio.core.plan import MigrationPlan
from teraio.core.trace import Trace
from teraio.perf.choose import REGION_MARGIN
from teraio.trainer.runner import run
from benchmarks.replay_runs import replay
from benchmarks.tail_offloads import compare as compare_tail_offloads
from teraio.perf.replay import replayed_trace

CPU = torch.device("cpu")


def reference(device=CPU, workload=None, **model):
    cfg = config("teraio_ssd", "/unused", None, model=model, workload=workload)
    model = build_model(cfg.model, cfg.workload.seq_len, device, cfg.seed)
    opt = make_optimizer(model, cfg.workload.lr)
    losses = []
    for s in range(cfg.workload.warmup_steps + cfg.workload.measure_steps):
        x, y = make_batch(s, cfg.workload, cfg.model.vocab_size, cfg.seed, device)
        losses.append(train_step(model, opt, x, y, cfg.workload.micro_batch_size))
    return losses, param_digest(model)


@pytest.fixture(scope="module")
def ref():
    return reference()


def run_teraio(cfg, job_dir, device=CPU):
    job_dir.mkdir()
    return result_row(cfg.point(), cfg.to_dict(), run(cfg, job_dir, device))


# Mixed: SSD made slow so that host memory wins windows the SSD cannot cover.
@pytest.mark.parametrize("system,hw,options", [
    ("teraio_ssd", {}, {}),
    ("teraio_mixed", {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}, {"host_arena": False}),
    ("teraio_ssd", {}, {"release_grads": False}),
    ("teraio_mixed", {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}, {"host_arena": True}),
    ("teraio_mixed", {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}, {}),
    ("teraio_mixed", {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}, {"pending_limit": "capacity"}),
], ids=["ssd", "mixed", "ssd-held-grads", "mixed-arena", "mixed-auto", "mixed-pending-limit"])
def test_half_capacity_is_bit_identical(tmp_path, ref, system, hw, options):
    result = check_bit_identical(tmp_path, ref, system, hw, fraction=0.5, options=options)
    # The packing the plan kept (the option's, or by default the region only where it
    # simulates more than REGION_MARGIN faster; both times in the row): with the region
    # every host migration has its offset in it, else none has.
    plan = json.loads((tmp_path / "job" / "plan.json").read_text())
    arena = plan["meta"]["host_arena"]
    assert arena is options.get("host_arena", arena) is result["plan"]["host_arena"]
    assert plan["meta"]["stream_frees"] is False  # the CPU engine waits for every offload's copy
    assert all(it["pending_waits"] == 0 for it in result["iterations"])  # so none is pending
    if "host_arena" not in options and system == "teraio_mixed":
        simulated = result["plan"]["host_arena_auto"]
        assert set(simulated) == {"slots", "arena"}
        assert (simulated["arena"] < simulated["slots"] * (1 - REGION_MARGIN)) is arena
    elif "host_arena" not in options:  # no host tier: slots, the only packing planned
        assert list(result["plan"]["host_arena_auto"]) == ["slots"] and arena is False
    offsets = [m["offset"] for m in plan["migrations"] if m["tier"] == "host"]
    assert all((o >= 0) is arena for o in offsets)


class ResidentBytes(TorchDispatchMode):
    """Independent of TeraIO's own accounting: after every op, the bytes of every live
    storage seen so far (model parameters from the moment they are built, then whatever
    any op touches or makes), views counted once. A storage TeraIO holds off the device
    has 0 bytes (``resize_(0)``)."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.per_op: list[int] = []

    def watch(self, tensors):
        for t in tensors:
            s = t.untyped_storage()
            self.storages[s._cdata] = weakref.ref(s)

    def resident(self) -> int:
        return sum(s.nbytes() for r in self.storages.values() if (s := r()) is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.watch(iter_tensors(args, kwargs))
        self.watch(iter_tensors((out,), None))
        self.per_op.append(self.resident())
        return out


@pytest.mark.parametrize("system,hw", [
    ("teraio_ssd", {}),
    ("teraio_mixed", {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}),
], ids=["ssd", "mixed"])
def test_capped_from_the_first_allocation(tmp_path, ref, monkeypatch, capsys, system, hw):
    # 40 % of the un-offloaded peak: parameters, gradients and AdamW state alone are more
    # than that, so no step (the first, the profiled one) can run without offloading.
    watcher = ResidentBytes()
    build = teraio.workload.pipeline.build_model

    def build_and_watch(*args, **kwargs):
        model = build(*args, **kwargs)
        watcher.watch(model.parameters())
        watcher.watch(model.buffers())
        return model

    open_tiers = teraio.trainer.trainer.open_tiers
    seen_before_plan, watching = [], []

    def stop_watching_and_open_tiers(*args, **kwargs):
        # On a CPU the tiers' host memory would look like device memory to the watcher;
        # the engine's own accounting covers the steps from here on.
        if watching:
            watcher.__exit__(None, None, None)
            watching.clear()
            seen_before_plan.extend(watcher.per_op)
        return open_tiers(*args, **kwargs)

    taken_over = []
    take_over = teraio.core.tiers.host.HostTier.take_over
    monkeypatch.setattr(teraio.core.tiers.host.HostTier, "take_over",
                        lambda tier, name, buf: taken_over.append(name) or take_over(tier, name, buf))
    monkeypatch.setattr(teraio.workload.pipeline, "build_model", build_and_watch)
    monkeypatch.setattr(teraio.trainer.trainer, "open_tiers", stop_watching_and_open_tiers)
    (tmp_path / "ssd").mkdir()
    probe = run_teraio(config(system, tmp_path / "ssd", None, **hw), tmp_path / "probe")
    capacity = int(probe["unoffloaded_peak_bytes"] * 0.4)
    watching.append(watcher.__enter__())
    result = run_teraio(config(system, tmp_path / "ssd", capacity, **hw), tmp_path / "job")

    assert result["losses"] == ref[0] and result["final_params_sha256"] == ref[1]
    assert len(result["losses"]) == 20
    # Only a host tier takes the pager's copies over (whether the plan leaves any of them
    # on the host at op 0 depends on the CPU's op times; test_pager covers the take-over).
    if system == "teraio_ssd":
        assert not taken_over
    # Steps 0 and 1 (each thousands of ops) and the model build ran under the watcher.
    assert len(seen_before_plan) > 2000
    assert max(seen_before_plan) <= capacity, (max(seen_before_plan), capacity)
    assert [s["step"] for s in result["paged_steps"]] == [0, 1]
    for s in result["paged_steps"]:
        assert s["evictions"] > 0 and s["max_accounted_bytes"] <= capacity
    # The host memory the pager held: step 1 starts with the buffers step 0 kept for reuse.
    step0, step1 = (s["max_host_bytes"] for s in result["paged_steps"])
    assert 0 < step0 <= step1
    for it in result["iterations"]:
        assert it["max_accounted_bytes"] <= capacity
    assert result["plan"]["shortfall_bytes"] == 0
    assert result["capacity_bytes"] == capacity and result["capacity_emulated"] is True
    # The host tier's line, for a reader: human units, not raw byte counts.
    host_lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("host tier:")]
    assert len(host_lines) == (1 if result["plan"]["bytes_per_tier"].get("host") else 0), host_lines
    assert system == "teraio_ssd" or host_lines  # the slow drive leaves Mixed's plan a host tier
    for ln in host_lines:
        assert re.fullmatch(r"host tier: \d{1,3}(\.\d)? [kMGT]?B of \d{1,3}(\.\d)? [kMGT]?B adopted from the pager's "
                            r"free buffers, \d{1,3}(\.\d)? [kMGT]?B more taken over or allocated", ln), ln


# Sequence length 32 for steps 0-4, then 16 for steps 5-9, then 24.
SCHEDULE = {"seq_len_schedule": [32] * 5 + [16] * 5 + [24], "measure_steps": 12}


@pytest.mark.parametrize("system,hw", [
    ("teraio_ssd", {}),
    ("teraio_mixed", {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}),
], ids=["ssd", "mixed"])
def test_a_change_of_sequence_length_is_planned_anew_and_stays_bit_identical(tmp_path, system, hw):
    ref_losses, ref_digest = reference(workload=SCHEDULE)
    (tmp_path / "ssd").mkdir()
    probe = run_teraio(config(system, tmp_path / "ssd", None, workload=SCHEDULE, **hw), tmp_path / "probe")
    capacity = int(probe["unoffloaded_peak_bytes"] * 0.45)
    result = run_teraio(config(system, tmp_path / "ssd", capacity, workload=SCHEDULE, **hw), tmp_path / "job")

    assert result["losses"] == ref_losses and result["final_params_sha256"] == ref_digest
    assert [(r["step"], r["shape"]["seq_len"]) for r in result["replans"]] == [(5, 16), (10, 24)]
    for r in result["replans"]:
        assert r["plan"]["shortfall_bytes"] == 0 and r["plan"]["migrations"] > 0
        assert (tmp_path / "job" / r["artifacts"]["plan"]).exists()
    # Every step ran within the capacity: the paged ones (0, 1 and the replanned ones) and
    # the engine's; the replanned steps are not measured.
    assert [s["step"] for s in result["paged_steps"]] == [0, 1, 5, 10]
    assert all(s["max_accounted_bytes"] <= capacity for s in result["paged_steps"])
    assert all(it["max_accounted_bytes"] <= capacity for it in result["iterations"])
    assert [it["step"] for it in result["iterations"]] == [2, 3, 4, 6, 7, 8, 9, 11, 12, 13]
    assert [it["tokens"] for it in result["iterations"]][-1] == 2 * 24
    assert not list((tmp_path / "ssd").iterdir())

    # Without re-planning the changed step fails, naming what changed.
    cfg = config(system, tmp_path / "ssd", capacity, workload=SCHEDULE,
                 options={"replan_on_drift": False}, **hw)
    with pytest.raises(PlanDriftError, match="step 5 drifted from the profiled step: seq_len 32 -> 16"):
        run_teraio(cfg, tmp_path / "strict")


# 32, 16, 32, 16, 24, 16: two new lengths after the first, then lengths seen before.
REPEATS = {"seq_len_schedule": [32] * 4 + [16] * 3 + [32] * 3 + [16] * 3 + [24] * 3 + [16], "measure_steps": 15}


def test_a_length_seen_before_reuses_its_plan_and_a_replaced_engine_is_released(tmp_path, monkeypatch):
    ref_losses, ref_digest = reference(workload=REPEATS)
    engines: list[weakref.ref] = []
    live_at_start: list[int] = []
    init = teraio.core.engine.MigrationEngine.__init__

    def count_live_engines(self, *args, **kwargs):
        gc.collect()  # a replaced engine the run still held would survive this
        live_at_start.append(sum(r() is not None for r in engines))
        init(self, *args, **kwargs)
        engines.append(weakref.ref(self))

    (tmp_path / "ssd").mkdir()
    probe = run_teraio(config("teraio_ssd", tmp_path / "ssd", None, workload=REPEATS), tmp_path / "probe")
    capacity = int(probe["unoffloaded_peak_bytes"] * 0.45)
    monkeypatch.setattr(teraio.core.engine.MigrationEngine, "__init__", count_live_engines)
    result = run_teraio(config("teraio_ssd", tmp_path / "ssd", capacity, workload=REPEATS), tmp_path / "job")

    assert result["losses"] == ref_losses and result["final_params_sha256"] == ref_digest
    # Profiled: steps 1 (32), 4 (16) and 13 (24); the rest reuse a plan, with no profile.
    assert [s["step"] for s in result["paged_steps"]] == [0, 1, 4, 13]
    got = [(r["step"], r["shape"]["seq_len"], r.get("reused", False), r["artifacts"]["plan"]) for r in result["replans"]]
    assert got == [(4, 16, False, "plan.step4.json"), (7, 32, True, "plan.json"), (10, 16, True, "plan.step4.json"),
                   (13, 24, False, "plan.step13.json"), (16, 16, True, "plan.step4.json")]
    assert all(r["profile_seconds"] is None and r["plan_compile_seconds"] is None
               for r in result["replans"] if r.get("reused"))
    assert sorted(p.name for p in (tmp_path / "job").glob("plan*.json")) == [
        "plan.json", "plan.step13.json", "plan.step4.json"]
    # A reused plan's step runs on the engine and is measured; a profiled one is not.
    assert [it["step"] for it in result["iterations"]] == [2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 14, 15, 16]
    assert all(it["max_accounted_bytes"] <= capacity for it in result["iterations"])
    # One engine per plan started (6), each replaced one gone when the next starts.
    assert len(engines) == 6 and live_at_start == [0, 0, 0, 0, 0, 0]
    # The replaced engines' logs are written all the same: every step from the first measured on.
    with open(tmp_path / "job" / "oplog.csv") as f:
        steps = {int(line.split(",")[0]) for line in list(f)[1:]}
    assert steps == {it["step"] for it in result["iterations"]}
    assert not list((tmp_path / "ssd").iterdir())


def test_each_engines_audit_is_kept_in_the_row_though_its_step_is_a_warm_up(tmp_path, monkeypatch):
    # The allocator count stands in for CUDA's (off CUDA an engine audits nothing): 2 MiB more
    # than the plan accounts after every op. Each engine's first step (2, and 6 and 11 after
    # the re-plans) is audited; 2 and 6 are warm-up steps (no iteration row), and the row
    # keeps all three audits.
    init = teraio.core.engine.MigrationEngine.__init__

    def with_allocator_count(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._allocator_bytes = lambda: self._accounted(self._k) + (2 << 20)

    monkeypatch.setattr(teraio.core.engine.MigrationEngine, "__init__", with_allocator_count)
    workload = {**SCHEDULE, "warmup_steps": 7}
    (tmp_path / "ssd").mkdir()
    probe = run_teraio(config("teraio_ssd", tmp_path / "ssd", None, workload=workload), tmp_path / "probe")
    capacity = int(probe["unoffloaded_peak_bytes"] * 0.45)
    assert capacity // 100 < 2 << 20  # the overrun counts (above 1 % of the capacity)
    result = run_teraio(config("teraio_ssd", tmp_path / "ssd", capacity, workload=workload), tmp_path / "job")

    assert [it["step"] for it in result["iterations"]][0] == 7
    assert [a["step"] for a in result["audits"]] == [2, 6, 11]
    for a in result["audits"]:
        assert a["first"] == [0, 2 << 20] and a["largest"] == [0, 2 << 20]
    assert all("audit" not in it for it in result["iterations"])


# Drives (and for Mixed, host links) too slow to hide a move: what a chain of cheap ops makes
# again from resident inputs is recomputed instead. The planner plans with recompute on, not
# "auto": on a CPU the chains are small (the fused attention kernel is not recomputable,
# recompute.is_pure) and simulate within a few % of moving, so from one profile to the next
# "auto" keeps them or not (choose.REGION_MARGIN); test_recompute.py covers "auto"'s choice.
@pytest.mark.parametrize("system,hw", [
    ("teraio_ssd", {"ssd_write_gbps": 1e-4, "ssd_read_gbps": 1e-4}),
    ("teraio_mixed", {"ssd_write_gbps": 1e-4, "ssd_read_gbps": 1e-4, "host_d2h_gbps": 1e-4, "host_h2d_gbps": 1e-4}),
], ids=["ssd", "mixed"])
def test_recompute_recomputes_where_moving_cannot_hide_and_stays_bit_identical(tmp_path, ref, system, hw):
    result = check_bit_identical(tmp_path, ref, system, hw, fraction=0.4, options={"recompute": "on"})
    plan = result["plan"]
    assert plan["recomputes"] > 0 and plan["recomputed_bytes"] > 0
    for it in result["iterations"]:  # the engine made every dropped tensor again, each step
        assert it["recomputed_bytes"] == plan["recomputed_bytes"]


def test_micro_batch_auto_trains_the_candidate_with_the_shortest_simulated_iteration(tmp_path):
    from teraio.perf.simulator import simulate

    (tmp_path / "ssd").mkdir()
    work = {"batch_size": 4, "micro_batch_size": "auto", "warmup_steps": 4, "measure_steps": 2}
    cfg = config("teraio_mixed", tmp_path / "ssd", 1 << 20, workload=work,
                 ssd_write_gbps=0.5, ssd_read_gbps=0.5)
    result = run_teraio(cfg, tmp_path / "job")
    assert result["point"]["micro_batch_size"] == "auto"
    rec = result["micro_batch"]
    tried = [c["micro_batch_size"] for c in rec["candidates"]]
    assert tried == [4, 2, 1][:len(tried)] and all(c["status"] == "simulated" for c in rec["candidates"])
    best = min(rec["candidates"], key=lambda c: (c["simulated_seconds"], -c["micro_batch_size"]))
    assert rec["chosen"] == best["micro_batch_size"]
    # the run trained and planned the chosen micro-batch: its trace's shape, its plan replayed
    # at the run's rates simulates what the row says for it
    trace = Trace.load(tmp_path / "job" / "trace.json")
    assert trace.meta["micro_batch_size"] == rec["chosen"]
    assert len(result["iterations"]) == 2 and all(it["max_accounted_bytes"] <= 1 << 20 for it in result["iterations"])
    plan = MigrationPlan.load(tmp_path / "job" / "plan.json")
    tiers = TierBandwidth(0.5, 0.5, 50.0, 50.0)
    assert simulate(trace.with_released_grads(), plan, tiers, shared_ssd=True).iteration_seconds == pytest.approx(
        best["simulated_seconds"])
    # the steps before the choice are warm-ups: candidates profiled at steps 1.., then the loop
    assert [p["step"] for p in result["paged_steps"]] == list(range(1 + len(tried)))


def test_micro_batch_auto_simulates_candidates_whose_plans_update_parameters_in_host_memory(tmp_path):
    # Each candidate's plan may host parameters' AdamW updates (host_update: on): the search
    # simulates them at the run's measured host rate (a candidate's plan once failed there:
    # "the trace updates 15 parameters in host memory: simulate them with ... host_update_gbps").
    (tmp_path / "ssd").mkdir()
    work = {"batch_size": 4, "micro_batch_size": "auto", "warmup_steps": 4, "measure_steps": 2}
    cfg = config("teraio_mixed", tmp_path / "ssd", 1 << 20, workload=work, options={"host_update": "on"},
                 ssd_write_gbps=0.5, ssd_read_gbps=0.5)
    result = run_teraio(cfg, tmp_path / "job")
    assert result["host_update_gbps"] > 0
    rec = result["micro_batch"]
    assert all(c["status"] == "simulated" and c["simulated_seconds"] > 0 for c in rec["candidates"])
    assert result["plan"]["host_update"]["params"] > 0 and len(result["iterations"]) == 2


def test_micro_batch_auto_needs_warm_up_steps_for_its_candidates(tmp_path):
    cfg = config("teraio_ssd", tmp_path, 1 << 20, workload={"batch_size": 4, "micro_batch_size": "auto"})
    with pytest.raises(ValueError, match=r"warmup_steps=2: TeraIO needs >= 4 .*up to 3 profiled candidate"):
        run_teraio(cfg, tmp_path / "job")


def test_bandwidth_starved_plan_stalls_but_fits(tmp_path, ref):
    # 1 MB/s cannot hide anything: the plan's exposed migrations stall, memory still fits.
    result = check_bit_identical(tmp_path, ref, "teraio_ssd",
                                 {"ssd_write_gbps": 1e-3, "ssd_read_gbps": 1e-3}, fraction=0.4)
    assert all(it["stall_count"] > 0 for it in result["iterations"])


# On the GPU: CUDA streams, events, kvikio and the pinned pool in play; a model large enough
# that its capped peak is many allocator blocks.
@pytest.mark.gpu
@pytest.mark.parametrize("system,hw,options", [
    ("teraio_ssd", {}, {}),
    ("teraio_mixed", {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}, {"host_arena": False}),
    ("teraio_mixed", {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}, {"host_arena": False, "device_waits": False}),
    ("teraio_ssd", {}, {"release_grads": False}),
    ("teraio_mixed", {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}, {"host_arena": True}),
    ("teraio_mixed", {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}, {"host_arena": False, "pending_limit": "plan"}),
], ids=["ssd", "mixed", "mixed-host-waits", "ssd-held-grads", "mixed-arena", "mixed-pending-limit"])
def test_capped_run_is_bit_identical_on_gpu(tmp_path, system, hw, options):
    gpu = torch.device("cuda")
    ref = reference(gpu, **GPU_MODEL)
    settle_gpu()
    result = check_bit_identical(tmp_path, ref, system, hw, fraction=GPU_FRACTION, device=gpu, model=GPU_MODEL,
                                 options={**GPU_OPTIONS, **options}, between_runs=settle_gpu)
    settle_gpu()
    waits = [it["pending_waits"] for it in result["iterations"]]
    assert all(w >= 0 for w in waits) and (options.get("pending_limit", "off") != "off" or not any(waits))
    # the GPU's own timeline in the logs: every op's start on the compute stream, in op order
    # within a step; every host-tier copy's start and seconds on its stream
    import pandas as pd
    ops = pd.read_csv(tmp_path / "job" / "oplog.csv")
    assert ops["gpu_start_s"].notna().all() and (ops["gpu_end_s"] >= ops["gpu_start_s"]).all()
    assert all((g["gpu_start_s"].diff().dropna() >= 0).all() for _, g in ops.groupby("step"))
    moved = pd.read_csv(tmp_path / "job" / "transfers.csv")
    host = moved[moved["tier"] == "host"]
    assert host["copy_s"].gt(0).all() and host["gpu_start_s"].notna().all()
    assert moved.loc[moved["tier"] == "ssd", "copy_s"].isna().all()


def settle_gpu():
    """Free what the last run left in this process and check that nothing is: the emulated
    capacity caps the whole process, the plan covers only its own run, so a leftover here
    would be memory the plan never saw (a sweep runs each point in a fresh process).
    The cuBLAS workspaces PyTorch keeps per (handle, stream) in the caching allocator (32 MiB
    or more on Hopper, pytorch/pytorch#120925) outlast a run and ``empty_cache`` keeps them;
    ``torch._C._cuda_clearCublasWorkspaces`` frees them (PyTorch notes/cuda.rst, "cuBLAS
    workspaces")."""
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated()
    assert left == 0, f"{left} bytes still allocated between runs"




def check_bit_identical(tmp_path, ref, system, hw, fraction, device=CPU, model=None, options=None,
                        between_runs=lambda: None):
    ref_losses, ref_digest = ref
    (tmp_path / "ssd").mkdir()
    dev = {"device": device.type, "model": model, "options": options}
    probe = run_teraio(config(system, tmp_path / "ssd", None, **dev, **hw), tmp_path / "probe", device)
    between_runs()
    capacity = int(probe["unoffloaded_peak_bytes"] * fraction)
    result = run_teraio(config(system, tmp_path / "ssd", capacity, **dev, **hw), tmp_path / "job", device)

    assert result["losses"] == ref_losses
    assert result["final_params_sha256"] == ref_digest
    plan = result["plan"]
    assert plan["shortfall_bytes"] == 0 and plan["predicted_peak_bytes"] <= capacity
    assert len(result["iterations"]) == WORK["measure_steps"]
    for it in result["iterations"]:
        assert it["max_accounted_bytes"] <= capacity
        assert sum(it["bytes_offloaded"].values()) > 0
    if system == "teraio_mixed":
        assert plan["bytes_per_tier"]["host"] > 0
    else:
        assert plan["bytes_per_tier"]["host"] == 0
    # The side files the analysis reads exist and hold the measured steps.
    for name in ("trace.json", "plan.json", "oplog.csv", "transfers.csv"):
        assert (tmp_path / "job" / name).stat().st_size > 0
    assert json.loads((tmp_path / "job" / "plan.json").read_text())["format"] == "teraio.plan/1"
    # Offload files are gone after the run, and nothing else was left there.
    assert not list((tmp_path / "ssd").iterdir())
    return result


def test_too_small_offload_dir_is_refused_before_the_engine_runs(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    (tmp_path / "ssd").mkdir()
    probe = run_teraio(config("teraio_ssd", tmp_path / "ssd", None), tmp_path / "probe")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 20, 1 << 20, 4096))
    cfg = config("teraio_ssd", tmp_path / "ssd", probe["unoffloaded_peak_bytes"] // 2)
    (tmp_path / "job").mkdir()
    with pytest.raises(ValueError, match=str(tmp_path / "ssd")) as err:
        run(cfg, tmp_path / "job", CPU)
    result = result_row(cfg.point(), cfg.to_dict(), measured_before(err.value))
    assert "bytes" in str(err.value)
    assert result["iterations"] == []


def test_the_ssd_tier_is_planned_within_the_drives_free_room(tmp_path, ref, monkeypatch):
    # With half the room its SSD files take on a roomy drive, TeraIO-Mixed plans its SSD
    # files within that half, moves more through host memory, and trains bit-identically.
    import shutil

    (tmp_path / "ssd").mkdir()
    probe = run_teraio(config("teraio_mixed", tmp_path / "ssd", None), tmp_path / "probe")
    capacity = int(probe["unoffloaded_peak_bytes"] * 0.5)
    roomy = run_teraio(config("teraio_mixed", tmp_path / "ssd", capacity), tmp_path / "roomy")
    need = roomy["plan"]["ssd_file_bytes"]
    assert need > 0 and roomy["plan"]["ssd_cap_bytes"] > need
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real(p)._replace(free=teraio.core.tiers.ssd.SSD_FREE_RESERVE + need // 2))
    tight = run_teraio(config("teraio_mixed", tmp_path / "ssd", capacity), tmp_path / "tight")
    assert tight["plan"]["ssd_cap_bytes"] == need // 2 >= tight["plan"]["ssd_file_bytes"]
    assert tight["plan"]["bytes_per_tier"]["host"] > roomy["plan"]["bytes_per_tier"]["host"]
    assert tight["plan"]["shortfall_bytes"] == 0
    assert (tight["losses"], tight["final_params_sha256"]) == ref


def test_the_emulated_capacity_binds_before_the_model_is_built(tmp_path, monkeypatch):
    calls = cap_then_build(monkeypatch, teraio.trainer.trainer, teraio.workload.pipeline)
    cfg = config("teraio_mixed", tmp_path, 1 << 30, capacity_mode="reserve")
    with pytest.raises(ModelBuilt):
        run(cfg, tmp_path, CPU)
    assert calls == [("cap", 1 << 30, "reserve"), "build"]  # the config's mode


def test_a_capacity_the_plan_cannot_meet_stops_before_the_engine_runs(tmp_path):
    # 1 MB/s hides nothing and stalls are not allowed: the plan falls short of 40 %.
    (tmp_path / "ssd").mkdir()
    hw = {"ssd_write_gbps": 1e-3, "ssd_read_gbps": 1e-3}
    probe = run_teraio(config("teraio_ssd", tmp_path / "ssd", None, **hw), tmp_path / "probe")
    capacity = int(probe["unoffloaded_peak_bytes"] * 0.4)
    cfg = config("teraio_ssd", tmp_path / "ssd", capacity, options={"allow_stalls": False}, **hw)
    (tmp_path / "job").mkdir()
    with pytest.raises(ValueError, match=rf"plan for {capacity} B .* peaks at (\d+) B, \d+ B over; the smallest "
                                         r"capacity it reaches is hardware.gpu_capacity_bytes=\d+ \(or allow") as err:
        run(cfg, tmp_path / "job", CPU)
    result = result_row(cfg.point(), cfg.to_dict(), measured_before(err.value))
    assert result["iterations"] == [] and result["plan"]["shortfall_bytes"] > 0


def test_null_bandwidths_are_measured_once_per_machine_and_recorded(tmp_path, ref, monkeypatch):
    import teraio.core.probe

    monkeypatch.setenv("TERAIO_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    measure = teraio.core.probe.measure
    monkeypatch.setattr(teraio.core.probe, "measure",
                        lambda *a, **k: calls.append(a) or measure(*a, **{**k, "total_bytes": 8 << 20}))
    (tmp_path / "ssd").mkdir()
    hw = {"ssd_write_gbps": None, "ssd_read_gbps": None, "host_d2h_gbps": None, "host_h2d_gbps": 50.0}
    first = run_teraio(config("teraio_mixed", tmp_path / "ssd", None, **hw), tmp_path / "a")
    second = run_teraio(config("teraio_mixed", tmp_path / "ssd", None, **hw), tmp_path / "b")

    assert len(calls) == 1  # the second run found the first one's measurement
    for r in (first, second):
        g = r["tier_gbps"]
        assert all(g[k] > 0 for k in ("ssd_write_gbps", "ssd_read_gbps", "host_d2h_gbps"))
        assert g["host_h2d_gbps"] == 50.0 and g["source"]["host_h2d_gbps"] == "hardware config"
        assert r["losses"] == ref[0][:len(r["losses"])]
    assert first["tier_gbps"]["source"]["ssd_write_gbps"].startswith("measured ")
    assert second["tier_gbps"]["source"]["ssd_write_gbps"].endswith("(cached)")
    assert {k: second["tier_gbps"][k] for k in teraio.core.probe.KEYS} == \
        {k: first["tier_gbps"][k] for k in teraio.core.probe.KEYS}
    cache = json.loads((tmp_path / "cache" / "bandwidth.json").read_text())
    assert list(cache) == [teraio.core.probe.machine_key(CPU, [str(tmp_path / "ssd")])]
    assert not list((tmp_path / "ssd").iterdir())


def test_the_bandwidth_probe_refuses_a_tier_that_returns_other_bytes():
    import teraio.core.probe
    from teraio.core.tiers.base import Transfer
    from teraio.core.tiers.host import HostTier

    class Forgetful(HostTier):  # acknowledges reads without moving a byte
        def read(self, name, storage):
            return Transfer(name, "host pool", f"read of {name!r}", storage.nbytes())

    tensors = [torch.randint(0, 256, (4096,), dtype=torch.uint8) for _ in range(2)]
    with HostTier(1 << 20, {"t0": 4096, "t1": 4096}, CPU) as tier:
        write, read = teraio.core.probe.tier_rates(tier, tensors)
    assert write > 0 and read > 0
    with Forgetful(1 << 20, {"t0": 4096, "t1": 4096}, CPU) as tier:
        with pytest.raises(RuntimeError, match="a tier returned other bytes than it was given"):
            teraio.core.probe.tier_rates(tier, tensors)


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_host_update_trains_as_plain_training_does_and_the_row_says_what_it_hosted(tmp_path, ref, mode):
    ref_losses, _ = ref
    (tmp_path / "ssd").mkdir()
    hw = {"ssd_write_gbps": 0.5, "ssd_read_gbps": 0.5}
    probe = run_teraio(config("teraio_mixed", tmp_path / "ssd", None, **hw), tmp_path / "probe")
    capacity = int(probe["unoffloaded_peak_bytes"] * 0.5)
    result = run_teraio(config("teraio_mixed", tmp_path / "ssd", capacity, options={"host_update": mode}, **hw),
                        tmp_path / "job")
    hu = result["plan"]["host_update"]
    assert result["host_update_gbps"] > 0 and set(hu) >= {"params", "bytes", "off", "variants", "kept"}
    if mode == "on":
        assert hu["params"] > 0 and hu["kept"] is not None
        # the plan names what it hosts and the rate, so that the run replays (benchmarks.replay_runs)
        plan = json.loads((tmp_path / "job" / "plan.json").read_text())
        assert len(plan["meta"]["host_update_auto"]["hosted"]) == hu["params"]
        (tmp_path / "job" / "result.json").write_text(json.dumps(result))
        replayed = replay(tmp_path / "job")
        assert replayed["host_update_gbps"] == result["host_update_gbps"]
        assert replayed["simulated_edf_iteration_seconds"] is None
        # the trace it replays is the one the engine ran: the op log's ops, op by op
        ran = [line.split(",")[2] for line in (tmp_path / "job" / "oplog.csv").read_text().splitlines()[1:]
               if line.startswith(f"{result['iterations'][0]['step']},")]
        trace, _ = replayed_trace(Trace.load(tmp_path / "job" / "trace.json"), MigrationPlan.from_dict(plan))
        assert list(trace.op_names) == ran
        # and it simulates as the variant the planner kept did: none of this small run's
        # offloads is still copying at its step's end, so none was deferred after the choice
        assert plan["meta"]["tail_offloads"]["deferred"] == 0
        assert replayed["simulated_iteration_seconds"] == pytest.approx(hu["variants"][hu["kept"]]["seconds"])
        # the tail-offload comparison reads the run the same way (nothing to defer there either)
        tails = compare_tail_offloads(tmp_path / "job")
        assert tails["run_on_s"] == pytest.approx(replayed["simulated_iteration_seconds"]) and tails["deferred"] == 0
    else:  # kept only where it simulates more than the margin faster than the plan without
        best = hu["variants"][hu["kept"]]["seconds"] if hu["kept"] is not None else None
        assert (best is not None and best < hu["off"] * (1 - REGION_MARGIN)) == (hu["params"] > 0)
    # the host's fused AdamW: the same training to rounding (plain AdamW until the plan's engine)
    np.testing.assert_allclose(result["losses"], ref_losses, rtol=1e-4)
    for it in result["iterations"]:
        assert it["max_accounted_bytes"] <= capacity


def test_a_host_update_needs_the_host_tier():
    from teraio import systems
    with pytest.raises(ValueError, match=r"host_update='on': teraio_ssd has no host tier"):
        systems.check_options("teraio_ssd", {"host_update": "on"})
    with pytest.raises(ValueError, match=r"host_update='sometimes'; valid: off, on or auto"):
        systems.check_options("teraio_mixed", {"host_update": "sometimes"})
