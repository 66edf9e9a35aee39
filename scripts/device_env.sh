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
