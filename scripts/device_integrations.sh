#!/usr/bin/env bash
# GPU acceptance of the adoption layer (issue 29) on a lent H200 (device tool). Logs go to $OUT.
#   bash scripts/device_integrations.sh            the GPU tests + fla's own KDA tests with the backend
#   bash scripts/device_integrations.sh --prepare  (here, before the run) copy fla's test files from a
#                                                  fetched fla snapshot into the ignored .fla_tests/
# Needs, carried in .whl/ (cp312 / pure-python wheels, see device_env.sh): fla-core >= 0.6 (the `fla`
# package; flash-linear-attention itself only adds fla.layers/models and transformers, not needed here),
# einops; triton comes with the device image's torch. Carry .fla_tests too.
# FLA_K narrows fla's tests (pytest -k); BASELINE=1 also runs them once without the backend (fla's own
# pass/fail on this image, to tell our regressions from fla-vs-snapshot drift); BENCH=1 adds the layer
# benchmark (benchmarks/bench_layer.py: fla / fla backend / ours / compiled, and the adapter casts).
# STAGES picks what runs (one device command has 10 minutes): "build" (every CUDA module, 16 at a time, so the
# tests do not build them one by one), "gpu" (tests/gpu/test_integrations_gpu.py), "fla" (fla's test_kda.py
# with the backend), "bench" (the layer benchmark); default "gpu fla". With pytest-xdist and execnet carried,
# fla's tests run in FLA_WORKERS workers (device_env.sh's fla_cmd): one process hit a 280 s limit after 66 tests.
set -uo pipefail
if [ "${1:-}" = "--prepare" ]; then
  mirror=${2:-/work/.mirror/fla-org+flash-linear-attention/repo}
  dest="$(dirname "$0")/../.fla_tests"
  mkdir -p "$dest/tests/ops"
  git --git-dir "$mirror" show HEAD:tests/conftest.py > "$dest/tests/conftest.py" || exit 1
  git --git-dir "$mirror" show HEAD:tests/ops/test_kda.py > "$dest/tests/ops/test_kda.py" || exit 1
  git --git-dir "$mirror" log -1 --format='fla snapshot %H %cd' > "$dest/SNAPSHOT"
  cat "$dest/SNAPSHOT"; exit 0
fi
source "$(dirname "$0")/device_env.sh"
export PYTHONPATH=$PWD/scripts:${PYTHONPATH:-}
STAGES=${STAGES:-gpu fla}
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
python3 -c "import fla, flashkda_ext; print('fla', getattr(fla, '__version__', '?'))" | tee "$OUT/fla_version.txt"
if has build; then
  stage build 170 python3 -m flashkda_ext build --backend cuda --all --parallel 16 --jobs 1
  tail -1 "$OUT/build.log"
fi
# the GPU tests run beside fla's tests (both are correctness checks, no timing), so their Triton compiles overlap
if has gpu; then
  stage gpu_integrations ${GPU_LIMIT:-300} python3 -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_integrations_gpu.py &
fi
if ! has fla; then :
elif [ -f .fla_tests/tests/ops/test_kda.py ]; then
  cat .fla_tests/SNAPSHOT 2>/dev/null
  if [ "${BASELINE:-0}" = 1 ]; then
    fla_cmd
    FLA_BACKEND_OFF=1 stage fla_kda_baseline 240 "${FLA_CMD[@]}"
    grep -E "passed|failed" "$OUT/fla_kda_baseline.log" | tail -2
  fi
  fla_cmd -rfE
  stage fla_kda ${FLA_LIMIT:-280} "${FLA_CMD[@]}"
  fla_summary fla_kda 60
else
  echo "no .fla_tests/: run 'bash scripts/device_integrations.sh --prepare' here and carry .fla_tests"
fi
wait
if has gpu; then grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_integrations.log" | tail -15; fi
if has bench || [ "${BENCH:-0}" = 1 ]; then
  stage bench_layer ${BENCH_LIMIT:-540} python3 benchmarks/bench_layer.py --no-progress --out "$OUT" ${BENCH_ARGS:-}
  tail -30 "$OUT/bench_layer.log"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.txt *.json 2>/dev/null)
