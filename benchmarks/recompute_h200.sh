#!/usr/bin/env bash
# The recompute option and the micro-batch choice measured on the lent H200: TeraIO-Mixed at
# fig7_h200's Granite-8B cut seq_short point with system.options.recompute=off and auto
# (the default is auto by simulation, benchmarks/results/schedule_h200_traces.json; this
# measures it), then with workload.micro_batch_size=auto. Also the GPU tests of the engine's
# re-runs (tests/test_teraio_train.py -m gpu). TRIALS trials each.
# Writes into OUT (default ./recompute_out): the test log, each sweep's log, every job dir's
# result.json as <sweep>/<point dir>/result.json, rows.tar.gz and a summary line per row.
# Run from the repository root on the GPU machine:
#   source scripts/remote_env.sh && bash benchmarks/recompute_h200.sh
#   POINT (default seq_short; bs_small and bs_mid move 150-300 GB each way without recompute)
#   TRIALS (default 0)   BUDGET_S (default 540)   TIMEOUT_S (per point, default 240)
#   WHICH=tests|sweep|both (default sweep)
set -uo pipefail
OUT=${OUT:-recompute_out}
RUNS=${RUNS:-/tmp/recompute_runs}
POINT=${POINT:-seq_short}
TRIALS=${TRIALS:-0}
BUDGET_S=${BUDGET_S:-540}
TIMEOUT_S=${TIMEOUT_S:-240}
WHICH=${WHICH:-sweep}
# shellcheck source=scripts/device_call.sh
source scripts/device_call.sh
if [ "$WHICH" != sweep ]; then
  timeout -k 10 "$(( $(left) < 200 ? $(left) : 200 ))" python -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_teraio_train.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
fi
sweep() {  # $1: sweep name; the rest: overrides
  local name=$1; shift
  fig7_sweep "$name" model=granite_8b_8l "fig7.point=$POINT" system=teraio_mixed "trial=$TRIALS" "$@"
}
if [ "$WHICH" != tests ]; then
  sweep recompute_off system.options.recompute=off
  sweep recompute_auto system.options.recompute=auto
  # fig7_h200 derives a point's capacity from its micro-batch: the choice runs at the capacity
  # of the point's own micro-batch
  cap=$(python -c "from teraio.harness.compose import compose_run_config as c; print(c(['+experiment=fig7_h200', \
'model=granite_8b_8l', 'fig7.point=$POINT', 'system=teraio_mixed']).hardware.gpu_capacity_bytes)")
  sweep micro_batch_auto workload.micro_batch_size=auto workload.warmup_steps=4 "hardware.gpu_capacity_bytes=$cap"
fi
collect_rows
python - "$RUNS" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*/*/result.json")):
    r = json.loads(f.read_text())
    p, plan = r["point"], r.get("plan") or {}
    its = r.get("iterations") or [{}]
    err = (r.get("error") or "").strip().splitlines()[-1:] or [""]
    print(f"{f.parent.parent.name:17} {p['model']} bs{p['batch_size']}-mb{p['micro_batch_size']}-seq{p['seq_len']} "
          f"t{p['trial']} {r['status']:7} tokens/s={r.get('tokens_per_s')} recomputes={plan.get('recomputes')} "
          f"recompute_auto={plan.get('recompute_auto')} recomputed_bytes/it={its[-1].get('recomputed_bytes')} "
          f"micro_batch={(r.get('micro_batch') or {}).get('chosen')} {err[0][:200]}")
PY
