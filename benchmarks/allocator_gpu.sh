#!/usr/bin/env bash
# The same rows under several settings of PyTorch's CUDA caching allocator, in one device call:
# one benchmarks/side_by_side_gpu.sh rows sweep per setting (PYTORCH_CUDA_ALLOC_CONF), each in
# its own runs dir, its files in OUT/<name>/. Each row records the setting it ran with
# (allocator_conf), and each iteration the allocator's retries (allocator.alloc_retries).
# Under the emulated capacity every retry is a device sync, so TeraIO's steps pay for them
# (runs/reference/h100/allocator_retries/COMMAND.md).
# Run from the repository root on the GPU machine:
#   source scripts/remote_env.sh && OUT=$OUT bash benchmarks/allocator_gpu.sh
#   CONFS  name=setting pairs separated by ';' (default below; names: letters, digits, _ and -)
#   ROWS   the sweep's overrides, as side_by_side_gpu.sh takes them (default TeraIO-Mixed at
#          micro-batch 4 at fig7_h200's Llama3-8B cut seq_short)
#   TRIALS (default 0)   TIMEOUT_S (per point, default 150)
#   BUDGET_S (default 500): shared by the settings in order, each given an equal share of what is
#          left less OVERHEAD_S (default 20: its packing and summaries, run outside its share)
set -uo pipefail
OUT=${OUT:-allocator_out}
CONFS=${CONFS:-default=expandable_segments:True;split1g=expandable_segments:True,max_split_size_mb:1024;gc90=expandable_segments:True,garbage_collection_threshold:0.9}
ROWS=${ROWS:-model=llama3_8b_4l fig7.point=seq_short system=teraio_mixed workload.micro_batch_size=4}
TRIALS=${TRIALS:-0}
TIMEOUT_S=${TIMEOUT_S:-150}
BUDGET_S=${BUDGET_S:-500}
OVERHEAD_S=${OVERHEAD_S:-20}
IFS=';' read -ra confs <<< "$CONFS"
[ "${#confs[@]}" -gt 0 ] || { echo "CONFS='$CONFS': give at least one name=setting" >&2; exit 2; }
declare -A seen
for c in "${confs[@]}"; do  # every name and setting checked before anything runs
  name=${c%%=*}
  [[ $c == *=* && $name =~ ^[A-Za-z0-9_-]+$ && -n ${c#*=} ]] || {
    echo "CONFS entry '$c': give name=setting (name: letters, digits, _ and -; e.g. default=expandable_segments:True)" >&2
    exit 2; }
  [ -z "${seen[$name]:-}" ] || { echo "CONFS: the name '$name' is given twice; each setting needs its own" >&2; exit 2; }
  seen[$name]=1
done
mkdir -p "$OUT"
start=$SECONDS
for i in "${!confs[@]}"; do
  name=${confs[$i]%%=*} conf=${confs[$i]#*=}
  share=$(( (BUDGET_S - (SECONDS - start)) / (${#confs[@]} - i) - OVERHEAD_S ))
  echo "== $name: PYTORCH_CUDA_ALLOC_CONF=$conf, ${share} s"
  # a runs dir of its own, empty: the sweep would resume a row made under another setting
  # (the setting is the environment's, not the point's config)
  rm -rf "/tmp/allocator_$name"
  env -u PYTORCH_ALLOC_CONF "PYTORCH_CUDA_ALLOC_CONF=$conf" "RUNS=/tmp/allocator_$name" "OUT=$OUT/$name" WHICH=rows "TRIALS=$TRIALS" \
    "BUDGET_S=$share" "TIMEOUT_S=$TIMEOUT_S" "ROWS=$ROWS" bash benchmarks/side_by_side_gpu.sh
done
