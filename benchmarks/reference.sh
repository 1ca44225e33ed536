#!/usr/bin/env bash
# The reference grown call by call (benchmarks/reference.yaml, teraio.harness.reference): on the
# GPU machine, within BUDGET_S seconds of one device call, the first rows of the list missing
# from runs/reference/<card>/ (<card>: h100 or h200, from the GPU's name), each sweep through
# python -m teraio.sweep (resumable; sweep.deadline at the budget's end). The job folders it
# wrote, with the call's record and log, are packed into OUT/<TAG>.tar.gz; bring them home with
#   python -m benchmarks.reference unpack OUT/<TAG>.tar.gz
# Of runs/reference/ it needs <card>/ only: runs/reference/h200 (for an H100 call) and
# runs/reference/archive may be left out of the working tree sent to the machine.
#   BUDGET_S (default 560: a call's 600 s less the transfers)   TAG (default call)   OUT
# Each run may take what is left of the budget less a sweep's start (timeout_s); a run that
# times out with at least the list's full_run_s counts as done (it does not fit a call), one
# stopped by the budget (interrupted) runs again in the next call, first.
# Run from the repository root on the GPU machine, after `source scripts/remote_env.sh`.
set -uo pipefail
OUT=${OUT:-reference_out}
TAG=${TAG:-call}
BUDGET_S=${BUDGET_S:-560}
START_S=40   # a sweep's own start before its first worker (Hydra, the checks of every point)
MIN_S=90     # no sweep starts with less of the budget left
marker=$(mktemp)
ran=$(mktemp)
card=$(python -m benchmarks.reference card) || exit 1
read -r CARD GPU <<< "$card"
RUNS=runs/reference/$CARD
# shellcheck source=scripts/device_call.sh
source scripts/device_call.sh
start=0      # the budget counts from this script's start (SECONDS), the card's look-up included
log="$OUT/$TAG.log"
echo "card $CARD, budget $BUDGET_S s" | tee "$log"
plan=$(python -m benchmarks.reference plan --card "$CARD" 2>&1) || { echo "$plan" | tee -a "$log"; exit 1; }
echo "$plan" | tee -a "$log"
case "$plan" in
  *zero_infinity*) python scripts/build_ds_ops.py cpu_adam async_io 2>&1 | tail -n 3 | tee -a "$log";;
  *zero_offload*) python scripts/build_ds_ops.py cpu_adam 2>&1 | tail -n 3 | tee -a "$log";;
esac
while read -r exp sweep tune overrides; do
  [ -n "$exp" ] || continue
  l=$(left)
  if [ "$l" -le "$MIN_S" ]; then
    echo "left for the next call ($l s of the budget left): $exp $sweep $overrides" | tee -a "$log"
    continue
  fi
  echo "$exp $sweep $overrides" >> "$ran"
  # shellcheck disable=SC2086  # overrides holds several
  exp_sweep "$exp" "$sweep" $overrides "timeout_s=$((l - START_S))" "sweep.tune.timeout_s=$tune" < /dev/null
done <<< "$plan"
python -m benchmarks.reference pack --card "$CARD" --gpu "$GPU" --since "$marker" --ran "$ran" --tag "$TAG" \
  --budget "$BUDGET_S" --out "$OUT/$TAG.tar.gz" --log "$log" "$OUT"/fig*.log 2>&1 | tee -a "$log"
ls -la "$OUT"
