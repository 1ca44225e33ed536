#!/usr/bin/env bash
# The H200 reference rows, runs/reference/h200/<EXP>/: one chunk of a sweep per run of the script.
# The sweep resumes from the rows already committed there (it skips every ok row) and is
# stopped BUDGET_S seconds after the script started, DeepSpeed's op build included, so that
# the budgets of several runs of the script in one command add up (leave about 15 s per run
# for packing). The job dirs whose row this run wrote are packed into OUT/<TAG>.tar.gz
# (trace, plan, oplog and transfers gzipped; a retried point's earlier attempts in
# attempt.<n>/, teraio.sweep), to unpack into runs/reference/h200/<NAME>/ and commit.
#   EXP=fig7_h200|fig9_h200 (default fig7_h200)
#   NAME (sweep.name, the dir under runs/reference/h200/; default EXP): a variant measured
#        beside EXP's rows without touching them, e.g. NAME=fig7_h200_host_arena
#   ARGS="model=llama3_8b_4l fig7.point=bs_small system=ideal,teraio_mixed trial=0,1,2"
#   TAG (archive name)   BUDGET_S (default 540)   TIMEOUT_S (per run, default 900)
# Run from the repository root on the GPU machine, after `source scripts/remote_env.sh`.
set -uo pipefail
OUT=${OUT:-reference_out}
EXP=${EXP:-fig7_h200}
NAME=${NAME:-$EXP}
ARGS=${ARGS:-}
TAG=${TAG:-chunk}
BUDGET_S=${BUDGET_S:-540}
TIMEOUT_S=${TIMEOUT_S:-900}
RUNS=runs/reference/h200
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
marker=$(mktemp)
start=$SECONDS
case "$ARGS" in
  *zero_infinity*|"") python scripts/build_ds_ops.py cpu_adam async_io 2>&1 | tail -n 3;;
  *zero_offload*) python scripts/build_ds_ops.py cpu_adam 2>&1 | tail -n 3;;
esac
left=$((BUDGET_S - (SECONDS - start)))
[ "$left" -gt 0 ] || { echo "the op build took the whole budget of $BUDGET_S s" | tee "$OUT/$TAG.log"; exit 1; }
# The sweep starts no run that the rows of its other trials say would end after the budget
# (sweep.deadline); one that overruns is stopped at the budget.
# shellcheck disable=SC2086  # ARGS holds several overrides
timeout -k 20 "$left" python -m teraio.sweep -m "+experiment=$EXP" $ARGS "sweep.name=$NAME" "sweep.runs_dir=$RUNS" \
  sweep.make_ssd_dirs=true sweep.analyze=false "timeout_s=$TIMEOUT_S" "sweep.deadline=$(($(date +%s) + left))" \
  2>&1 | tee "$OUT/$TAG.log"
pkill -f teraio.harness.run && echo "stopped the run in progress at the budget" | tee -a "$OUT/$TAG.log"
cd "$RUNS/$NAME" || exit 1
stage=$(mktemp -d)
for d in */; do
  d=${d%/}
  [ "$d" = analysis ] && continue
  [ -n "$(find "$d" -maxdepth 1 -name 'result*.json' -newer "$marker")" ] || continue
  # every file of the job dir, earlier attempts' (attempt.<n>/) included; a side file is
  # packed gzipped, and a .gz beside its fresh uncompressed file is skipped (stale)
  find "$d" -type f ! -name '.*.lock' | while read -r f; do
    mkdir -p "$stage/$(dirname "$f")"
    case $f in
      *trace.json|*plan.json|*oplog.csv|*transfers.csv) gzip -c "$f" > "$stage/$f.gz";;
      *.gz) [ -e "${f%.gz}" ] || cp "$f" "$stage/$f";;
      *) cp "$f" "$stage/$f";;
    esac
  done
done
tar czf "$OUT/$TAG.tar.gz" -C "$stage" .
tar tzf "$OUT/$TAG.tar.gz" | grep -c 'result.json$'
ls -la "$OUT"
