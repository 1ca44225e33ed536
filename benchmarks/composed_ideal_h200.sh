#!/usr/bin/env bash
# Ideal at fig7_h200's full Llama3-8B point (model=llama3_8b fig7.point=full: batch 4,
# micro-batch 1, 2,048 tokens; no cap) on the lent H200, where the whole step does not fit
# (its Ideal row was modeled from a trace): with system.options.measure=auto the worker tries
# the whole step, runs out of memory, and composes the step from its phases timed on the GPU
# (baselines.ideal.run_composed; the row's measure "composed", fell_back_from, composed).
# One sweep of its own (sweep.name=$NAME under $RUNS), so that the committed rows of
# runs/reference/h200/fig7_h200 are neither skipped into nor touched; the job dir's
# result.json and worker.log (as t<trial>_result.json, t<trial>_worker.log), the sweep's log and a
# summary are copied to $OUT.
#   OUT (default composed_out)   NAME (default fig7_h200_ideal_composed)   RUNS (default runs/reference/h200)
#   TRIALS (default 0; e.g. 0,1,2)   MEASURE (default auto; composed skips the whole-step try)
#   BUDGET_S (default 330: the sweep is stopped then)   TIMEOUT_S (per run, default 300)
# Run from the repository root on the GPU machine, one command:
#   source scripts/remote_env.sh && OUT=$OUT bash benchmarks/composed_ideal_h200.sh
set -uo pipefail
OUT=${OUT:-composed_out}
NAME=${NAME:-fig7_h200_ideal_composed}
RUNS=${RUNS:-runs/reference/h200}
TRIALS=${TRIALS:-0}
MEASURE=${MEASURE:-auto}
BUDGET_S=${BUDGET_S:-330}
TIMEOUT_S=${TIMEOUT_S:-300}
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/sweep.log"
timeout -k 20 "$BUDGET_S" python -m teraio.sweep -m +experiment=fig7_h200 model=llama3_8b fig7.point=full \
  system=ideal "trial=$TRIALS" "system.options.measure=$MEASURE" "sweep.name=$NAME" "sweep.runs_dir=$RUNS" \
  sweep.make_ssd_dirs=true sweep.analyze=false "timeout_s=$TIMEOUT_S" 2>&1 | tee -a "$OUT/sweep.log"
for job in "$RUNS/$NAME"/llama3_8b-ideal-h200-bs4-mb1-seq2048-t*; do
  [ -d "$job" ] || continue
  t=${job##*-}
  for f in result.json worker.log; do
    [ -f "$job/$f" ] && cp "$job/$f" "$OUT/${t}_$f"
  done
  python - "$job/result.json" <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
c = r.get("composed") or {}
print(sys.argv[1], r["status"], r["measure"], "tokens/s", r["tokens_per_s"],
      "fell back from", [f["measure"] for f in r.get("fell_back_from", [])],
      "peak GB", (r["peak_allocated_bytes"] or 0) / 1e9)
if c:
    fb, op = c["micro_batch_seconds"], c["optimizer_seconds"]
    print(f"  forward+backward x{c['micro_batches']}: mean {statistics.fmean(fb):.4f} s "
          f"(min {min(fb):.4f}, max {max(fb):.4f}); optimizer step: mean {statistics.fmean(op):.4f} s "
          f"(min {min(op):.4f}, max {max(op):.4f})")
PY
done | tee "$OUT/summary.txt"
ls -la "$OUT"
