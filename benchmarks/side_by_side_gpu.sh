#!/usr/bin/env bash
# TeraIO beside what it is compared with on one GPU, in one device call, any of:
#   tax:  benchmarks/engine_tax.py at fig7_h200's Llama3-8B cut seq_short (Ideal's step, the
#         engine with a plan that moves nothing, the profiled op times with and without the
#         pager, the GPU's clock and power per step);
#   rows: a fig7_h200 sweep (ROWS, default Ideal and TeraIO-Mixed at that point; the transfer
#         and op logs hold the GPU's own timeline), the GPU's clock sampled through it;
#   adam: benchmarks/host_adam.py (AdamW's update rate in host memory: torch's three CPU
#         implementations and DeepSpeed's CPU Adam, whose op is built first);
#   bw:   benchmarks/engine_bandwidth.py (the host link one way and both ways at once, the
#         drive, the tiers), run first: the card's own rates for a hardware config.
# Writes into OUT (default ./tax_out): engine_tax.json, its three traces in tax_traces.tar.gz,
# rows.tar.gz (the sweep's job dirs whole: rows, traces, plans, logs, and the GPU's clock and
# power sampled through them, clocks.csv), a summary line per row
# (summary.txt), timeline.json (benchmarks.gpu_timeline of the TeraIO rows), host_adam.json,
# engine_bandwidth.json.
# Run from the repository root on the GPU machine:
#   source scripts/remote_env.sh && bash benchmarks/side_by_side_gpu.sh
#   ROWS (the sweep's overrides, default below; several sweeps into the same rows separated by
#   ';', e.g. the baselines tuned in one and TeraIO with workload.micro_batch_size=auto, which
#   only TeraIO takes, in the next)   TRIALS (default 0; a sweep of ROWS that names trial=...
#   runs those instead)   BUDGET_S (default 540)
#   TIMEOUT_S (per point, default 200)   WHICH: any of bw,tax,rows,adam, comma-separated (default
#   tax,rows,adam)
#   ADAM_IMPLS (host_adam's --impls; default all four, DeepSpeed's op built first)
set -uo pipefail
OUT=${OUT:-tax_out}
RUNS=${RUNS:-/tmp/tax_runs}
TRIALS=${TRIALS:-0}
ROWS=${ROWS:-model=llama3_8b_4l fig7.point=seq_short system=ideal,teraio_mixed}
BUDGET_S=${BUDGET_S:-540}
TIMEOUT_S=${TIMEOUT_S:-200}
WHICH=${WHICH:-tax,rows,adam}
IFS=, read -ra parts <<< "$WHICH"
for w in "${parts[@]}"; do
  case $w in bw|tax|rows|adam) ;; *) echo "WHICH=$WHICH: '$w' is not one of bw, tax, rows, adam (comma-separated)" >&2; exit 2;; esac
done
ADAM_IMPLS=${ADAM_IMPLS:-fused,foreach,loop,deepspeed}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # as the sweep's workers
# shellcheck source=scripts/device_call.sh
source scripts/device_call.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv
case ,$WHICH, in *,bw,*)
  # the drive directory the h200 config's tiers use; RAM directories removed after (host memory)
  timeout -k 10 "$(left)" python -m benchmarks.engine_bandwidth --drive /tmp/teraio_ssd/0 \
    --ram-dirs /dev/shm/bw/0 /dev/shm/bw/1 /dev/shm/bw/2 /dev/shm/bw/3 --out "$OUT/engine_bandwidth.json" 2>&1 | tail -n 30
  rm -rf /dev/shm/bw;;
esac
case ,$WHICH, in *,tax,*)
  mkdir -p /tmp/tax && timeout -k 10 "$(left)" python -m benchmarks.engine_tax --out /tmp/tax/engine_tax.json \
    --rounds 3 --clocks /tmp/tax/clocks.csv 2>&1 | tail -n 40
  cp /tmp/tax/engine_tax.json "$OUT/" && tar czf "$OUT/tax_traces.tar.gz" -C /tmp/tax --exclude engine_tax.json .;;
esac
case ,$WHICH, in *,rows,*)
  # the GPU's clock and power through the rows (nvidia-smi every 100 ms; epoch times in the rows)
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms=100 \
    > "$RUNS/clocks.csv" 2>/dev/null & sampler=$!
  IFS=';' read -ra sweeps <<< "$ROWS"
  for rows in "${sweeps[@]}"; do
    # a sweep that names its own trials (trial=0) keeps them; the others take TRIALS
    case " $rows " in *" trial="*) trials=();; *) trials=("trial=$TRIALS");; esac
    # shellcheck disable=SC2086  # each holds several overrides
    fig7_sweep side_by_side $rows ${trials[@]+"${trials[@]}"}
  done
  kill "$sampler"
  tar czf "$OUT/rows.tar.gz" -C "$RUNS" --exclude '*.lock' .
  mapfile -t teraio_jobs < <(find "$RUNS" -maxdepth 2 -type d -name '*-teraio_*')
  [ "${#teraio_jobs[@]}" -gt 0 ] && python -m benchmarks.gpu_timeline "${teraio_jobs[@]}" --out "$OUT/timeline.json"
  python - "$RUNS" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*/*/result.json")):
    r = json.loads(f.read_text())
    p = r["point"]
    # the micro-batch it trained at: a baseline's own option wins over the point's (fig7_h200)
    trained = (r.get("micro_batch_size_trained") or r.get("zero_micro_batch_size")
               or (r.get("micro_batch") or {}).get("chosen") or p["micro_batch_size"])
    print(f"{p['system']:13} t{p['trial']} {r['status']:7} tokens/s={r.get('tokens_per_s')} "
          f"micro_batch={trained} stall_s={r.get('stall_seconds')} gpu={r.get('gpu_name')} "
          f"allocator={r.get('allocator_conf')}")
PY
  ;;
esac
case ,$WHICH, in *,adam,*)
  case ,$ADAM_IMPLS, in *,deepspeed,*) python scripts/build_ds_ops.py cpu_adam 2>&1 | tail -n 2;; esac
  timeout -k 10 "$(left)" python -m benchmarks.host_adam --impls "$ADAM_IMPLS" --out "$OUT/host_adam.json" 2>&1 \
    | tail -n 8;;
esac
