#!/usr/bin/env bash
# Set up this checkout on a Linux machine (idempotent; seconds when already done):
#   .venv (Python 3.11) with torch -- the 2.13.0 CPU build unless the venv already has a
#   torch --, the project with its test extra, libaio for DeepSpeed's async_io op (apt,
#   as root), and DeepSpeed's cpu_adam and async_io ops built once into .torch_extensions/.
# Used by both commands at the top of README.md and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# torch first and explicitly: left to a dependency resolver, 'torch' may pull a
# multi-GB CUDA build. On a GPU machine, install your CUDA torch into .venv first.
# numpy alongside, so that importing torch below does not warn that it is missing.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0 numpy
# torchtitan imports triton, which only CUDA builds of torch bring along (extra "cpu").
if .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  extras="test,cpu"
else
  extras="test"
fi
"${PIP[@]}" -e ".[$extras]"

if ! dpkg -s libaio-dev >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null
  else
    echo "setup.sh: libaio-dev is missing; run 'sudo apt-get install libaio-dev' (ZeRO-Infinity needs it)" >&2
  fi
fi

# Removes stale JIT-build locks first, then builds (minutes the first time) or just loads.
.venv/bin/python scripts/build_ds_ops.py
