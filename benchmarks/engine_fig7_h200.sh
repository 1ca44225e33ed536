#!/usr/bin/env bash
# fig7_h200_m_only's Llama3-8B-class points for the engine's comparison: Ideal, TeraIO-Mixed and
# ZeRO-Offload, with each system's defaults and the hardware file's bandwidths. Packs what this
# run of the script ran into OUT/<TAG>.tar.gz: every row's result.json and, for TeraIO-Mixed, the trace,
# plan, transfers.csv and oplog.csv that benchmarks/engine_fig7_summary.py replays.
#   POINTS=bs_small,bs_mid   TRIALS=0,1,2   TAG=name of this run's archive
#   TIMEOUT_S (per point, default 300)
# Run from the repository root on the GPU machine, after `source scripts/remote_env.sh`.
set -uo pipefail
OUT=${OUT:-engine_fig7_out}
RUNS=${RUNS:-/tmp/engine_fig7_runs}
POINTS=${POINTS:-bs_small,bs_mid}
TRIALS=${TRIALS:-0,1,2}
TAG=${TAG:-engine_fig7}
TIMEOUT_S=${TIMEOUT_S:-300}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python scripts/build_ds_ops.py cpu_adam 2>&1 | tail -n 3
python -m teraio.sweep -m +experiment=fig7_h200_m_only model=llama3_8b_4l "fig7.point=$POINTS" \
  "trial=$TRIALS" system=ideal,teraio_mixed,zero_offload sweep.make_ssd_dirs=true \
  "sweep.runs_dir=$RUNS" sweep.name=fig7_h200_m_only sweep.analyze=false "timeout_s=$TIMEOUT_S" \
  2>&1 | tee "$OUT/$TAG.log"
cd "$RUNS/fig7_h200_m_only" || exit 1
files=()
for d in */; do
  d=${d%/}
  [ -f "$d/result.json" ] && files+=("$d/result.json")
  case $d in *-teraio_mixed-*)
    for f in trace.json plan.json transfers.csv oplog.csv; do [ -f "$d/$f" ] && files+=("$d/$f"); done;;
  esac
done
tar czf "$OUT/$TAG.tar.gz" "${files[@]}"
ls -la "$OUT"
