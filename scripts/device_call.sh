# Sourced by the GPU scripts of benchmarks/ that run sweeps within one device call
# (users_baselines_h200.sh, recompute_h200.sh, reference.sh), from the repository root, with OUT, RUNS
# and BUDGET_S set (TIMEOUT_S too for fig7_sweep): makes OUT and RUNS (OUT made absolute), puts the checkout on
# PYTHONPATH and starts the budget of BUDGET_S seconds. Then:
#   left                        seconds of the budget left
#   exp_sweep EXP NAME OVERRIDE...  one sweep of experiment EXP named NAME under RUNS with the
#                               overrides (a sweep.name among them wins: rows of other options
#                               at the same point kept apart), stopped with the budget (its
#                               runs' deadline too; none started with 20 s or less left), its
#                               log in OUT/NAME.log
#   fig7_sweep NAME OVERRIDE... exp_sweep of fig7_h200, each run's timeout_s TIMEOUT_S
#   collect_rows                RUNS' rows, logs and configs into OUT/rows.tar.gz, and each
#                               result.json at the same path under OUT
mkdir -p "$OUT" "$RUNS"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - start))); }
exp_sweep() {
  local exp=$1 name=$2; shift 2
  local l; l=$(left)
  [ "$l" -gt 20 ] || { echo "no budget left for $name" | tee -a "$OUT/$name.log"; return; }
  timeout -k 20 "$l" python -m teraio.sweep -m "+experiment=$exp" "sweep.name=$name" "$@" "sweep.runs_dir=$RUNS" \
    sweep.make_ssd_dirs=true sweep.analyze=false "sweep.deadline=$(($(date +%s) + l))" \
    2>&1 | tee -a "$OUT/$name.log"
}
fig7_sweep() {
  local name=$1; shift
  exp_sweep fig7_h200 "$name" "$@" "timeout_s=$TIMEOUT_S"
}
collect_rows() {
  (cd "$RUNS" && find . -name 'result*.json' -o -name '*.log' -o -name 'resolved.yaml' | tar czf "$OUT/rows.tar.gz" -T -)
  (cd "$RUNS" && find . -name 'result.json' | while read -r f; do mkdir -p "$OUT/$(dirname "$f")"; cp "$f" "$OUT/$f"; done)
}
