#!/usr/bin/env bash
# What users switch on today, on the lent H200: the GPU tests of ideal_ac, fsdp_offload and
# torchao_offload (tests/test_users_baselines.py, tests/test_fsdp_offload.py, -m gpu), then the
# three systems through the sweep at fig7_h200's Llama3-8B cut seq_short point and at point
# `full` (the whole Llama3-8B, 4 x 2,048 tokens, the GPU's own capacity), TRIALS trials each.
# Writes into OUT (default ./users_baselines_out): the test log, each sweep's log, and every
# job dir's result.json (and log) as <sweep>/<point dir>/..., plus rows.tar.gz of them.
# Run from the repository root on the GPU machine:
#   source scripts/remote_env.sh && bash benchmarks/users_baselines_h200.sh
#   SYSTEMS (default ideal_ac,torchao_offload,fsdp_offload: the slowest last)   TRIALS (default 0)
#   STEPS (default "workload.warmup_steps=2 workload.measure_steps=2": fig7_h200 runs 3 + 4;
#   two warm-up steps keep ideal_ac's profiled one, two measured ones fit one device call)
#   BUDGET_S (default 540: tests and sweeps stop by then)   TIMEOUT_S (per point, default 240)
#   WHICH=tests|sweep|both (default both)
set -uo pipefail
OUT=${OUT:-users_baselines_out}
RUNS=${RUNS:-/tmp/users_baselines_runs}
SYSTEMS=${SYSTEMS:-ideal_ac,torchao_offload,fsdp_offload}
STEPS=${STEPS-workload.warmup_steps=2 workload.measure_steps=2}
TRIALS=${TRIALS:-0}
BUDGET_S=${BUDGET_S:-540}
TIMEOUT_S=${TIMEOUT_S:-240}
WHICH=${WHICH:-both}
# shellcheck source=scripts/device_call.sh
source scripts/device_call.sh
if [ "$WHICH" != sweep ]; then
  tests=$(ls tests/test_users_baselines.py tests/test_fsdp_offload.py 2>/dev/null)
  # shellcheck disable=SC2086
  timeout -k 10 "$(( $(left) < 150 ? $(left) : 150 ))" python -m pytest -m gpu -q -p no:cacheprovider $tests \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
fi
sweep() {  # $1: sweep name; the rest: overrides
  # shellcheck disable=SC2086  # STEPS holds several overrides
  fig7_sweep "$@" $STEPS "system=$SYSTEMS" "trial=$TRIALS"
}
if [ "$WHICH" != tests ]; then
  # point full first: its fsdp_offload and torchao_offload rows are refused up front (host memory)
  sweep users_l8_full model=llama3_8b fig7.point=full
  sweep users_l8cut_seq_short model=llama3_8b_4l fig7.point=seq_short
fi
collect_rows
python - "$RUNS" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("users_*/*/result.json")):
    r = json.loads(f.read_text())
    p, x = r["point"], r
    err = (r.get("error") or "").strip().splitlines()[-1:] or [""]
    print(f"{p['model']:13} bs{p['batch_size']}-mb{p['micro_batch_size']}-seq{p['seq_len']} {p['system']:16} "
          f"t{p['trial']} {r['status']:7} tokens/s={r.get('tokens_per_s')} mb_trained={x.get('micro_batch_size_trained')} "
          f"peak_alloc={r.get('peak_allocated_bytes')} saved_act={x.get('saved_activation_peak_bytes')} "
          f"host_state={x.get('host_state_bytes')} host_rss={r.get('peak_host_rss_bytes')} {err[0][:200]}")
PY
ls -la "$OUT"
