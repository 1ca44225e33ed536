#!/bin/bash
# Two measurement lanes on an nvidia-h200-x2 machine, one per GPU, in one device call, so
# that one call's start-up serves both GPUs. Each lane is a list of steps (shell commands)
# run in order on its GPU; every step gets what is left of the call's deadline, so the
# lanes end and their outputs are packed before the call's limit.
#
#   source scripts/remote_env.sh && bash benchmarks/h200x2_lanes.sh SECONDS OUT_DIR \
#       "gpu0 step 1" "gpu0 step 2" -- "gpu1 step 1" ...
#
# Each step runs with CUDA_VISIBLE_DEVICES set to its lane's GPU (LANE_GPUS="0 1" by
# default; LANE_GPUS="0 0" runs both lanes on a one-GPU machine, each process under its own
# emulated capacity, which together fit the GPU); its output goes to
# OUT_DIR/lane<g>.log. A step that runs past the deadline is killed (the sweep resumes
# such a point later: a killed point has no result.json). Exit status: 0.
# The lanes share the host's one drive: sweep points of drive-bound systems in the two lanes
# take turns on it (teraio/harness/drive_lock.py); other steps (benchmarks, tests) do not.
set -u
budget=$1 out=$2; shift 2
deadline=$((SECONDS + budget))
lane0=() lane1=()
while (($#)) && [[ $1 != -- ]]; do lane0+=("$1"); shift; done
(($#)) && shift
lane1=("$@")
read -r gpu0 gpu1 <<<"${LANE_GPUS:-0 1}"
mkdir -p "$out"

run_lane() {  # lane, gpu, steps...
  local lane=$1 gpu=$2; shift 2
  for step in "$@"; do
    local left=$((deadline - SECONDS))
    ((left > 5)) || { echo "[lane $lane] deadline: skipped: $step"; continue; }
    echo "[lane $lane] $(date +%T) ($left s left) $step"
    CUDA_VISIBLE_DEVICES=$gpu timeout --kill-after=10 "$left" bash -c "$step"
    local rc=$?
    echo "[lane $lane] $(date +%T) exit $rc"
  done
}

run_lane 0 "$gpu0" "${lane0[@]}" >"$out/lane0.log" 2>&1 &
run_lane 1 "$gpu1" "${lane1[@]}" >"$out/lane1.log" 2>&1 &
wait
exit 0
