#!/usr/bin/env bash
# The same rows under several settings of how the device's memory is held, in one device call:
# PyTorch's CUDA caching allocator (PYTORCH_CUDA_ALLOC_CONF) and the way the emulated capacity
# binds (hardware.capacity_mode, teraio.systems.memory_cap). One benchmarks/side_by_side_gpu.sh
# rows sweep per setting, each in its own runs dir, its files in OUT/<name>/. Each row records
# the allocator setting (allocator_conf) and its config the capacity mode; each iteration
# counts the allocator's retries (allocator.alloc_retries). Under the emulated capacity every
# retry is a device sync, so TeraIO's steps pay for them
# (runs/reference/h100/allocator_retries/COMMAND.md, runs/reference/h100/allocator_settings/).
# Run from the repository root on the GPU machine:
#   source scripts/remote_env.sh && OUT=$OUT bash benchmarks/allocator_gpu.sh
#   CONFS  settings separated by ';', each name=allocator-setting or
#          name=allocator-setting|overrides (overrides, space-separated, added to every sweep of
#          ROWS: e.g. hardware.capacity_mode=reserve); default below: the default allocator
#          setting with each capacity mode (names: letters, digits, _ and -)
#   ROWS   the sweeps' overrides, as side_by_side_gpu.sh takes them (';' between sweeps; default
#          TeraIO-Mixed at micro-batch 4 at fig7_h200's Llama3-8B cut seq_short)
#   TRIALS (default 0)   TIMEOUT_S (per point, default 150)
#   RUNS_ROOT (default /tmp): each setting's runs dir is RUNS_ROOT/allocator_<name>, emptied first
#   BUDGET_S (default 500): shared by the settings in order, each given an equal share of what is
#          left less OVERHEAD_S (default 20: its packing and summaries, run outside its share)
set -uo pipefail
OUT=${OUT:-allocator_out}
CONFS=${CONFS:-fraction=expandable_segments:True|hardware.capacity_mode=fraction;reserve=expandable_segments:True|hardware.capacity_mode=reserve}
ROWS=${ROWS:-model=llama3_8b_4l fig7.point=seq_short system=teraio_mixed workload.micro_batch_size=4}
TRIALS=${TRIALS:-0}
TIMEOUT_S=${TIMEOUT_S:-150}
BUDGET_S=${BUDGET_S:-500}
OVERHEAD_S=${OVERHEAD_S:-20}
RUNS_ROOT=${RUNS_ROOT:-/tmp}
IFS=';' read -ra sweeps <<< "$ROWS"
for sweep in "${sweeps[@]}"; do  # a blank sweep would run fig7_h200's default points
  [[ $sweep =~ [^[:space:]] ]] || { echo "ROWS='$ROWS': a sweep between ';' is blank; give each its overrides" >&2; exit 2; }
done
IFS=';' read -ra confs <<< "$CONFS"
[ "${#confs[@]}" -gt 0 ] || { echo "CONFS='$CONFS': give at least one name=setting" >&2; exit 2; }
declare -A seen
for c in "${confs[@]}"; do  # every name and setting checked before anything runs
  name=${c%%=*}
  setting=${c#*=}
  [[ $c == *=* && $name =~ ^[A-Za-z0-9_-]+$ && -n ${setting%%|*} ]] || {
    echo "CONFS entry '$c': give name=setting or name=setting|overrides (name: letters, digits, _ and -; e.g. default=expandable_segments:True)" >&2
    exit 2; }
  [ -z "${seen[$name]:-}" ] || { echo "CONFS: the name '$name' is given twice; each setting needs its own" >&2; exit 2; }
  seen[$name]=1
done
mkdir -p "$OUT"
start=$SECONDS
for i in "${!confs[@]}"; do
  name=${confs[$i]%%=*} conf=${confs[$i]#*=} extra=
  [[ $conf == *'|'* ]] && extra=${conf#*|} conf=${conf%%|*}
  rows=
  for sweep in "${sweeps[@]}"; do rows+="${rows:+;}$sweep${extra:+ $extra}"; done
  share=$(( (BUDGET_S - (SECONDS - start)) / (${#confs[@]} - i) - OVERHEAD_S ))
  echo "== $name: PYTORCH_CUDA_ALLOC_CONF=$conf${extra:+, $extra}, ${share} s"
  # a runs dir of its own, empty: the sweep would resume a row made under another setting
  # (the setting is the environment's, not the point's config)
  rm -rf "$RUNS_ROOT/allocator_$name"
  env -u PYTORCH_ALLOC_CONF "PYTORCH_CUDA_ALLOC_CONF=$conf" "RUNS=$RUNS_ROOT/allocator_$name" "OUT=$OUT/$name" WHICH=rows "TRIALS=$TRIALS" \
    "BUDGET_S=$share" "TIMEOUT_S=$TIMEOUT_S" "ROWS=$rows" bash benchmarks/side_by_side_gpu.sh
done
