# Sourced by the device scripts: output folder, carried wheels (.whl/: tvm-ffi, jax-tvm-ffi, fla are
# not in the device image, nor is jsonschema, which tracing needs: carry it with attrs, referencing,
# rpds-py and jsonschema-specifications as cp312 wheels), a JIT cache, prebuilt modules (.devaot/) and
# `stage NAME SECONDS CMD...`, which runs one bounded, logged step and prints a one-line summary.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} || exit 1
fi
export PYTHONUNBUFFERED=1 FLASHKDA_EXT_CACHE_DIR=${FLASHKDA_EXT_CACHE_DIR:-/tmp/fkda_cache}
# fla's compiled Triton kernels from an earlier run (device_bench.sh returns them as
# triton_cache.tgz; unpack it into the ignored .triton_cache/ and carry that): each new head count
# otherwise costs ~70 s of compilation on the device.
if [ -d .triton_cache ]; then export TRITON_CACHE_DIR=$PWD/.triton_cache; fi
# Modules built here ahead of time (no GPU needed): `python aot.py --arch 9.0a --out .devaot --only
# GLOBS`, then carry .devaot. The loader checks each artifact's identity against the tree's sources
# with the compiler versions its manifest records, so they load on the device without a rebuild; a
# JIT cache built here does not (its identity includes the local compiler versions, which differ).
# The carry limit is 64 MiB in all: name only the modules a run calls.
if [ -f .devaot/manifest.json ]; then export FLASHKDA_EXT_AOT_DIR=$PWD/.devaot${FLASHKDA_EXT_AOT_DIR:+:$FLASHKDA_EXT_AOT_DIR}; fi
stage() {
  local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - t0 )) s"
}
# fla's own tests/ops/test_kda.py (copied into .fla_tests/ by `device_integrations.sh --prepare`) with the
# flashkda_ext backend registered: scripts/fla_backend_count.py (scripts/ on PYTHONPATH) counts the calls it
# served and refused per test. fla_cmd [pytest options] sets the array FLA_CMD; FLA_K narrows the tests
# (pytest -k); with pytest-xdist carried they run in FLA_WORKERS workers (default 4): Triton's compiles
# are CPU-bound (2026-12-02: 8 workers beside the GPU tests ran 37 tests of the whole file in 300 s; 4
# workers ran the 29 forward-only cases in 206 s).
fla_cmd() {
  FLA_CMD=(python3 -m pytest -q -p no:cacheprovider -p fla_backend_count "$@")
  if python3 -c "import xdist" 2>/dev/null; then FLA_CMD+=(-n "${FLA_WORKERS:-4}"); fi
  if [ -n "${FLA_K:-}" ]; then FLA_CMD+=(-k "$FLA_K"); fi
  FLA_CMD+=(--rootdir .fla_tests .fla_tests/tests/ops/test_kda.py)
}
# the served / refused table (its last ${2:-40} lines) and the pass / fail lines of stage log $1
fla_summary() {
  sed -n '/calls served/,$p' "$OUT/$1.log" | tail -"${2:-40}"
  grep -E "^FAILED|passed|failed" "$OUT/$1.log" | tail -8
}
