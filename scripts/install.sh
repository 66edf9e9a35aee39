#!/usr/bin/env bash
# Installs flashkda_ext (editable) with its test and JAX extras, and flashinfer-bench. Safe to run again.
# torch: an already installed build is kept (a CUDA build on a GPU machine); with none installed,
# the CPU build 2.13.0 is taken, so a CPU-only machine never downloads a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".[test,jax]"
# flashinfer-bench, the trace consumer (docs/trace-format.md): --no-deps, since its requirements pull
# flashinfer-python and a CUDA DSL stack that reading, checking and benchmarking traces never import;
# what its import does need (pydantic, safetensors, docstring-parser) is pinned in the test extra.
"$PY" -m pip install -q --disable-pip-version-check --no-deps flashinfer-bench==0.1.2
