#!/usr/bin/env bash
# The full Llama3-8B at 4 x 2,048 tokens (4 micro-batches) on one H200: Ideal and TeraIO-Mixed
# with the GPU's own capacity, then TeraIO-Mixed at an emulated 70 GiB, then the summary JSON
# (python -m benchmarks.beyond_capacity). Writes into OUT (default ./beyond_capacity_out): the JSON,
# each sweep's log, the rows and TeraIO-Mixed's trace.
#   WHICH=real|emulated|both (default both)   TIMEOUT_S (per point, default 900)
# Run from the repository root on the GPU machine (after `source scripts/remote_env.sh` there).
set -uo pipefail
OUT=${OUT:-beyond_capacity_out}
RUNS=${RUNS:-/tmp/beyond_capacity_runs}
WHICH=${WHICH:-both}
TIMEOUT_S=${TIMEOUT_S:-900}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
POINT=(model=llama3_8b hardware=h200 workload.batch_size=4 workload.micro_batch_size=1 workload.seq_len=2048
       hardware.host_mem_cap_bytes=90000000000 workload.warmup_steps=3 workload.measure_steps=3
       sweep.make_ssd_dirs=true "sweep.runs_dir=$RUNS" sweep.analyze=false "timeout_s=$TIMEOUT_S")
if [ "$WHICH" != emulated ]; then
  python -m teraio.sweep -m "${POINT[@]}" system=ideal,teraio_mixed sweep.name=beyond_capacity \
    2>&1 | tee "$OUT/real_capacity_sweep.log"
fi
if [ "$WHICH" != real ]; then
  python -m teraio.sweep -m "${POINT[@]}" system=teraio_mixed sweep.name=beyond_capacity_70gib \
    hardware.gpu_capacity_bytes=75161927680 2>&1 | tee "$OUT/emulated_70gib_sweep.log"
fi
args=(--sweep "$RUNS/beyond_capacity" --out "$OUT/beyond_capacity_h200.json")
[ -d "$RUNS/beyond_capacity_70gib" ] && args+=(--emulated "$RUNS/beyond_capacity_70gib")
[ -d "$RUNS/beyond_capacity" ] && python -m benchmarks.beyond_capacity "${args[@]}"
for d in "$RUNS"/beyond_capacity*/*/; do
  name=$(basename "$(dirname "$d")")_$(basename "$d" | cut -d- -f2)
  cp "$d/result.json" "$OUT/${name}_result.json"
  [ -f "$d/trace.json" ] && gzip -c "$d/trace.json" > "$OUT/${name}_trace.json.gz"
done
ls -la "$OUT"
