#!/usr/bin/env bash
# Installs flashkda_ext (editable) with its test and JAX extras. Safe to run again.
# torch: an already installed build is kept (a CUDA build on a GPU machine); with none installed,
# the CPU build 2.13.0 is taken, so a CPU-only machine never downloads a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".[test,jax]"
