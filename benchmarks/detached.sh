#!/usr/bin/env bash
# A run of benchmarks/reference_h200.sh longer than one device call: `start` copies the
# repository to DETACHED_DIR/TAG/src and launches the run there in its own process session
# (setsid), which a warm GPU machine keeps running after the call returns; `wait` blocks
# until it has ended or SECONDS have passed, prints its log's tail, and once it has ended
# copies its archive and log to OUT. The run works in its copy because each device call
# replaces the repository's working tree on the machine with the caller's, which deletes a
# job dir that a run still writes under runs/reference/ (runs/reference/h200/fig7_h200/
# COMMAND.md); DeepSpeed's ops stay shared through a link to .torch_extensions/. The machine
# must stay warm in between (the next call within its idle release, 30 s on the lent H200);
# the reliable use is `start` then `wait` in the same call, with SECONDS near the call's limit.
#   detached.sh start TAG            (EXP, NAME, ARGS, BUDGET_S, TIMEOUT_S as reference_h200.sh)
#   detached.sh wait TAG SECONDS     (OUT: where the archive and log go)
# A run's state lives in DETACHED_DIR/TAG (default /tmp/detached).
# Run from the repository root on the GPU machine, after `source scripts/remote_env.sh`.
set -uo pipefail
verb=${1:?"usage: detached.sh start TAG | wait TAG SECONDS"}
TAG=${2:?"a TAG names the run (archive <TAG>.tar.gz)"}
dir=${DETACHED_DIR:-/tmp/detached}/$TAG
case "$verb" in
  start)
    [ -e "$dir" ] && { echo "a run tagged $TAG was already started ($dir)"; exit 2; }
    mkdir -p "$dir/out" "$dir/src" .torch_extensions
    tar -cf - --exclude=./.git --exclude=./.torch_extensions . | tar -xf - -C "$dir/src" || exit 1
    ln -s "$PWD/.torch_extensions" "$dir/src/.torch_extensions"
    cd "$dir/src" || exit 1
    TAG=$TAG OUT=$dir/out setsid bash -c 'bash benchmarks/reference_h200.sh; echo $? > "$0/rc"' \
      "$dir" < /dev/null > "$dir/stdout" 2>&1 &
    echo "started $TAG (pid $!) at $(date -u +%FT%TZ)";;
  wait)
    secs=${3:?"SECONDS: how long to wait at most"}
    [ -d "$dir" ] || { echo "no run tagged $TAG was started"; exit 2; }
    end=$((SECONDS + secs))
    while [ ! -e "$dir/rc" ] && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
    tail -n 30 "$dir/stdout"
    if [ -e "$dir/rc" ]; then
      mkdir -p "${OUT:?}" && cp "$dir"/out/* "$OUT"/ && echo "ended rc=$(cat "$dir/rc")"
    else
      echo "still running at $(date -u +%FT%TZ)"
    fi;;
  *) echo "unknown verb '$verb': valid are start, wait"; exit 2;;
esac
