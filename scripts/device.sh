#!/usr/bin/env bash
# The one device entry point: named stages on a GPU machine, each bounded by a timeout, each logging
# to $OUT/<stage>.log with a one-line summary on stdout. From the repository root:
#
#   STAGES="build tests bench" bash scripts/device.sh
#   bash scripts/device.sh --prepare-fla [FLA_GIT_DIR]    (here, before a run: fla's test files into .fla_tests/)
#
# Stages run in this order, whichever order STAGES names them (default "build tests selftest"):
#   build         the CUDA modules (BUILD: module names or globs; default every CUDA module), 16 at a time
#   tests         pytest over TESTS (default tests/gpu, the integration tests left out), TESTS_K: -k expression,
#                 TEST_WORKERS xdist workers (default 8 where pytest-xdist imports; the engine tests need .engines/);
#                 ACCURACY=routed (or module names) adds scripts/prefill_accuracy.py (errors against float64)
#   integrations  tests/gpu/test_integrations_gpu.py; fla's own tests/ops/test_kda.py with our backend
#                 registered, with its served / refused counts (carry .fla_tests; FLA_K narrows, FLA_WORKERS
#                 with pytest-xdist carried); flashinfer-bench's Benchmark over traced workloads (FB=0: not)
#   sanitizers    compute-sanitizer memcheck over every route (scripts/sanitize_routes.py; SANITIZE_ONLY: globs),
#                 racecheck and synccheck over RACE_ONLY (globs; default one module of each kind)
#   selftest      python3 -m flashkda_ext selftest (every route this machine reaches, against the reference)
#   bench         the routed modules over the issues' grids, no peers: OPS (default "decode fused verify
#                 prefill prefill_slow"; prefill_slow: issue 46's B1 rows at H8 / H16 with one slowly decaying key
#                 a head, bench_prefill.py --slow-keys 1; issue46, not in the default: issue 46's whole grid with
#                 the 1M row, GATES "bounded,softplus" or one of them, LIMIT_ISSUE46); BENCH_QUICK=1 the smaller grids
#   peers         the same grids beside the peers, the runs docs/performance.md cites: prefill with cuDNN and
#                 fla and vLLM's FlashKDA where .engines/vllm is carried (bench_prefill.py --peers cudnn,fla,flashkda, kernel
#                 time too), prefill_slow with cuDNN, issue46 with cuDNN and fla, decode (with the public-op arm)
#                 and verify with fla, fused decode with the unfused fla sequence; OPS as for bench
#   engines       issue 45's acceptance: vLLM's and SGLang's own Triton kernels (their wheels' files, carried in
#                 .engines/) against the adapters on identical inputs, graph replay (bench_vllm.py, bench_sglang.py):
#                 ENGINES (default "vllm sglang"), ENGINE_ROWS (1,64,1024), ENGINE_HEADS (8,12,24,32), ENGINE_MODES
#                 (graph; add kernel for the profiler's kernel time), VLLM_KINDS / SGLANG_PHASES (decode,verify;
#                 prefill / extend too), VLLM_ARGS / SGLANG_ARGS more flags (e.g. "--prefill-len 4096"), ENGINE_FLA=1
#                 adds the fla arm; a run cut by LIMIT_ENGINES keeps its cases
#   profile       Nsight Compute over one launch: PROFILE=prefill (default; PROFILE_ARGS, e.g. "--tokens
#                 32768 --heads 16"; SASS_KERNEL "kda_prep kda_state": per-instruction stalls split at
#                 barriers; PROFILE_KERNELS: the kernels ncu profiles, default "kda_prep|kda_state"), decode (PROFILE_ARGS "--module M --heads H --rows N") or verify ("--modules M,...");
#                 PROFILE=timeline: one prefill call's kernels on a timeline instead (torch.profiler, no ncu: which
#                 kernels ran side by side; PROFILE_ARGS as for prefill, default "--tokens 32768 --heads 8")
#   ab            A/B of a change: AB_BASE (a folder with the baseline's csrc/ and jit/, e.g. `git archive
#                 <rev> csrc jit | tar x -C .ab_base/base`, carried) against this tree, AB_BENCH (a shell command line,
#                 quotes kept; default:
#                 prefill, no peer, H16 + H64) in AB_ROUNDS interleaved rounds (base change, change base, ...),
#                 each arm with its own JIT cache; AB_MODULES built first; benchmarks/compare_runs.py compares.
#                 The host cost of the ops: a whole tree as AB_BASE (`git archive <rev> flashkda_ext csrc jit
#                 trace_templates benchmarks`), AB_BENCH="python3 benchmarks/bench_overhead.py --no-plot
#                 --no-progress", AB_COMPARE=overhead (benchmarks/overhead_ab.py)
#
# Knobs: OUT (default ./device_out); LIMIT_<STAGE> seconds for a stage's steps (defaults below; one device
# command has 10 minutes, so split a long list of stages over calls); DRY=1 prints each step's command
# instead of running it (works without a GPU: the CPU check of this script). Without a GPU the stages that
# need one say so and are skipped.
# Carried inputs: .whl/*.whl (`bash scripts/device_wheels.sh` fetches them: tvm-ffi, jax-tvm-ffi, fla-core, einops,
# cuDNN frontend and its CUDA bindings, jsonschema and its deps: not in the
# device image), .devaot/ (modules built here by `python aot.py --arch 9.0a --out .devaot --only GLOBS`:
# loaded without a rebuild), .triton_cache/ (fla's and the engines' compiled Triton kernels from an earlier
# run's triton_cache.tgz), .fla_tests/, .ab_base/.
# The device returns at most 8 files: logs and text go into $OUT/logs.tgz, results JSON and plots stay
# beside it unless there are more than 6 of them (then $OUT/results.tgz). Exit status 1 when a step failed
# (its name on the last line), 2 for a bad STAGES or argument.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ORDER=(build tests integrations sanitizers selftest bench peers engines profile ab)

if [ "${1:-}" = "--prepare-fla" ]; then
  mirror=${2:-/work/.mirror/fla-org+flash-linear-attention/repo}
  mkdir -p .fla_tests/tests/ops
  git --git-dir "$mirror" show HEAD:tests/conftest.py > .fla_tests/tests/conftest.py || exit 1
  git --git-dir "$mirror" show HEAD:tests/ops/test_kda.py > .fla_tests/tests/ops/test_kda.py || exit 1
  git --git-dir "$mirror" log -1 --format='fla snapshot %H %cd' > .fla_tests/SNAPSHOT
  cat .fla_tests/SNAPSHOT; exit 0
fi
if [ $# -gt 0 ]; then
  echo "device.sh takes no arguments but --prepare-fla; pick stages with STAGES=\"...\" (got: $*)" >&2; exit 2
fi
STAGES=${STAGES:-build tests selftest}
for s in $STAGES; do
  [[ " ${ORDER[*]} " == *" $s "* ]] || { echo "unknown stage '$s'; stages: ${ORDER[*]}" >&2; exit 2; }
done
want() { [[ " $STAGES " == *" $1 "* ]]; }
DRY=${DRY:-0}

OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHKDA_EXT_CACHE_DIR=${FLASHKDA_EXT_CACHE_DIR:-/tmp/fkda_cache}
export PYTHONPATH=$PWD/scripts:${PYTHONPATH:-}   # fla_backend_count (a pytest plugin) lives there
[ -d .triton_cache ] && export TRITON_CACHE_DIR=$PWD/.triton_cache
[ -f .devaot/manifest.json ] && export FLASHKDA_EXT_AOT_DIR=$PWD/.devaot${FLASHKDA_EXT_AOT_DIR:+:$FLASHKDA_EXT_AOT_DIR}

GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU=1; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
fi
# the carried wheels are fetched for the device image's Python: installed only where this python3 is that one
# (a checkout that holds them, run elsewhere, skips them with a line)
whl_ok() {
  local tag; tag=cp$(python3 -c 'import sys; print("%d%d" % sys.version_info[:2])')
  local w
  for w in .whl/*.whl; do   # (bash alone: the CPU test runs this with a bare PATH)
    if [[ $w =~ -(cp3[0-9]+)- && ${BASH_REMATCH[1]} != "$tag" ]]; then
      echo "== .whl skipped: its wheels are for ${BASH_REMATCH[1]}, this python3 is $tag"; return 1
    fi
  done
}
if ls .whl/*.whl >/dev/null 2>&1 && [ "$DRY" != 1 ] && whl_ok; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} || exit 1
fi

# step NAME LIMIT CMD...: one bounded, logged command (DRY=1: its line only)
step() {
  local name=$1 limit=$2; shift 2
  if [ "$DRY" = 1 ]; then echo "DRY $name (${limit} s): $*"; return 0; fi
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - t0 )) s"
  [ $rc = 0 ] || echo "$name" >> "$OUT/.failed"   # a file: steps in the background report too
  return $rc
}
# the lines of step NAME's log that matter (pattern $2, last ${3:-12})
show() { [ "$DRY" = 1 ] || [ ! -f "$OUT/$1.log" ] || grep -E "$2" "$OUT/$1.log" | tail -"${3:-12}"; }
needs_gpu() {
  [ "$GPU" = 1 ] || [ "$DRY" = 1 ] && return 0
  echo "== $1 skipped: no GPU"; return 1
}
PYTEST=(python3 -m pytest -q -rfE -p no:cacheprovider)
PASS="^(FAILED|ERROR)|passed|failed"
SAN="ERROR SUMMARY|RACECHECK SUMMARY|[0-9]+ failed$|FAIL"

if want build; then
  if command -v nvcc >/dev/null 2>&1 || [ "$DRY" = 1 ]; then
    set -f  # globs reach the builder as written
    # shellcheck disable=SC2086
    step build "${LIMIT_BUILD:-300}" python3 -m flashkda_ext build --backend cuda --parallel 16 --jobs 1 ${BUILD:-}
    set +f
    show build . 2
  else
    echo "== build skipped: no nvcc"
  fi
fi

if want tests && needs_gpu tests; then
  # TEST_WORKERS pytest-xdist workers (carried in .whl by device_wheels.sh; default 8 where it imports, 0: one
  # process): the whole of tests/gpu took 185 s at 8 on an H100 (h100-2026-12-07-3c10d4b); 12 ran out of GPU memory
  workers=${TEST_WORKERS:-}
  [ -z "$workers" ] && { python3 -c "import xdist" 2>/dev/null && workers=8 || workers=0; }
  nx=(); [ "$workers" != 0 ] && nx=(-n "$workers")
  set -f
  # shellcheck disable=SC2086
  step tests "${LIMIT_TESTS:-360}" "${PYTEST[@]}" "${nx[@]}" ${TESTS:-tests/gpu --ignore=tests/gpu/test_integrations_gpu.py} \
    ${TESTS_K:+-k "$TESTS_K"}
  set +f
  show tests "$PASS" 25
  if [ -n "${ACCURACY:-}" ]; then   # prefill modules' errors against the float64 recurrence
    [ "$ACCURACY" = routed ] && acc=() || acc=(--modules "$ACCURACY")
    step prefill_accuracy "${LIMIT_TESTS:-360}" python3 scripts/prefill_accuracy.py "${acc[@]}" --seeds 11,12,13
    show prefill_accuracy . 20
  fi
fi

if want integrations && needs_gpu integrations; then
  [ "$DRY" = 1 ] || python3 -c "import fla; print('fla', getattr(fla, '__version__', '?'))" 2>&1 \
    | tee "$OUT/fla_version.txt"
  # the GPU tests beside fla's tests (neither times anything), so their Triton compiles overlap
  step gpu_integrations "${LIMIT_INTEGRATIONS:-300}" "${PYTEST[@]}" -s tests/gpu/test_integrations_gpu.py &
  if [ -f .fla_tests/tests/ops/test_kda.py ]; then
    fla=("${PYTEST[@]}" -p fla_backend_count)
    python3 -c "import xdist" 2>/dev/null && fla+=(-n "${FLA_WORKERS:-4}")
    [ -n "${FLA_K:-}" ] && fla+=(-k "$FLA_K")
    step fla_kda "${LIMIT_INTEGRATIONS:-300}" "${fla[@]}" --rootdir .fla_tests .fla_tests/tests/ops/test_kda.py
  else
    echo "== fla_kda skipped: no .fla_tests/ (bash scripts/device.sh --prepare-fla here, then carry .fla_tests)"
  fi
  wait
  show gpu_integrations "$PASS|^SKIPPED" 15
  [ "$DRY" = 1 ] || [ ! -f "$OUT/fla_kda.log" ] || sed -n '/calls served/,$p' "$OUT/fla_kda.log" | tail -40
  if [ "${FB:-1}" = 1 ]; then
    rm -rf /tmp/fb_dataset
    (export FIB_CACHE_PATH=/tmp/fib_cache FB_ITERS=${FB_ITERS:-10}
     step fb_bench "${LIMIT_INTEGRATIONS:-300}" python3 scripts/fb_benchmark.py /tmp/fb_dataset "$OUT")
    show fb_bench . 22
  fi
fi

if want sanitizers && needs_gpu sanitizers; then
  # racecheck and synccheck are slow: one module of each kind by default (memcheck covers every module)
  race=decode_split8_f32_o32,decode_quartma_bf16_o64,decode_rowtma_bf16_o64,decode_seq_f32_o32
  race+=,prefill_*,fused_*_f32_o32,verify_*_bf16_o32,fused_verify_*
  RACE_ONLY=${RACE_ONLY:-$race}
  step memcheck "${LIMIT_SANITIZERS:-200}" compute-sanitizer --tool memcheck --error-exitcode 7 \
    python3 scripts/sanitize_routes.py ${SANITIZE_ONLY:+--only "$SANITIZE_ONLY"}
  show memcheck "$SAN" 4
  for t in racecheck synccheck; do
    step "$t" "${LIMIT_SANITIZERS:-200}" compute-sanitizer --tool "$t" --error-exitcode 7 \
      python3 scripts/sanitize_routes.py --only "$RACE_ONLY"
    show "$t" "$SAN" 4
  done
fi

if want selftest; then
  step selftest "${LIMIT_SELFTEST:-180}" python3 -m flashkda_ext selftest
  show selftest . 14
fi

# one benchmark of OPS: run_bench STAGE OP [peer flags...]
OPS=${OPS:-decode fused verify prefill prefill_slow}
COMMON=(--no-progress --out "$OUT")
run_bench() {
  local stage=$1 op=$2; shift 2
  local q=(); [ "${BENCH_QUICK:-0}" = 1 ] && q=(--quick)
  case $op in
    decode) step "${stage}_decode" "${LIMIT_DECODE:-300}" python3 benchmarks/bench_decode.py --states f32,bf16 \
              --name "${stage}_decode" "${q[@]}" "${COMMON[@]}" "$@";;
    fused) step "${stage}_fused" "${LIMIT_FUSED:-240}" python3 benchmarks/bench_fused_decode.py --modes graph \
              --rows 1,16,64,1024 --heads 16,64 --state f32,bf16 --name "${stage}_fused" "${q[@]}" "${COMMON[@]}" "$@";;
    verify) step "${stage}_verify" "${LIMIT_VERIFY:-300}" python3 benchmarks/bench_verify.py --modes graph \
              --name "${stage}_verify" "${q[@]}" "${COMMON[@]}" "$@";;
    prefill) step "${stage}_prefill" "${LIMIT_PREFILL:-400}" python3 benchmarks/bench_prefill.py --heads 16 \
              --name "${stage}_prefill_h16" "${q[@]}" "${COMMON[@]}" "$@";;
    # a trained model's long-memory channels: one key a head decays slowly, so every piece split's warm-up walks
    # back to the start (issue 46's random gates never show this; docs/performance.md's slow-key run)
    prefill_slow) step "${stage}_prefill_slow" "${LIMIT_PREFILL:-400}" python3 benchmarks/bench_prefill.py \
              --grid issue46 --heads 8,16 --cases "H8 B1 T8K,H8 B1 T32K,H16 B1 T8K,H16 B1 T32K" --gates bounded \
              --slow-keys 1 --slow-bias -20 \
              --name "${stage}_prefill_slowkeys" "${q[@]}" "${COMMON[@]}" "$@";;
    # issue 46's whole grid (H8-H96, both gates unless GATES names one, and 1 x 1M H16) in one results file, no
    # max_seqlen given (the bench's default); peers: cuDNN, and fla at H8 / H16 / H32. About 3 min a gate on an H100
    issue46) step "${stage}_issue46" "${LIMIT_ISSUE46:-560}" python3 benchmarks/bench_prefill.py --grid issue46 --long \
              --gates "${GATES:-bounded,softplus}" --fla-heads 8,16,32 --modes eager \
              --name "${stage}_issue46" "${q[@]}" "${COMMON[@]}" "$@";;
    *) echo "unknown op '$op' in OPS (decode fused verify prefill prefill_slow issue46)" >&2; return 2;;
  esac
  show "${stage}_$op" "geomean|summary" 6
}
if want bench && needs_gpu bench; then
  for op in $OPS; do
    case $op in
      fused) run_bench bench fused --no-unfused;;
      prefill|prefill_slow) run_bench bench "$op" --no-fla --modes eager;;
      *) run_bench bench "$op" --no-fla;;
    esac
  done
fi
if want peers && needs_gpu peers; then
  for op in $OPS; do
    case $op in
      decode) run_bench peers decode --op-arm;;
      prefill) run_bench peers prefill --peers cudnn,fla,flashkda --modes eager,kernel;;
      prefill_slow) run_bench peers prefill_slow --peers cudnn --no-fla --modes eager;;
      issue46) run_bench peers issue46 --peers cudnn,fla;;
      *) run_bench peers "$op";;
    esac
  done
fi

if want engines && needs_gpu engines; then
  eng=(--rows "${ENGINE_ROWS:-1,64,1024}" --heads "${ENGINE_HEADS:-8,12,24,32}" --modes "${ENGINE_MODES:-graph}"
       --no-plot --no-progress --out "$OUT")
  [ "${ENGINE_FLA:-0}" = 1 ] || eng+=(--no-fla)
  for e in ${ENGINES:-vllm sglang}; do
    case $e in
      # shellcheck disable=SC2086
      vllm) step engines_vllm "${LIMIT_ENGINES:-280}" python3 benchmarks/bench_vllm.py --kinds "${VLLM_KINDS:-decode,verify}" \
              "${eng[@]}" ${VLLM_ARGS:-};;
      # shellcheck disable=SC2086
      sglang) step engines_sglang "${LIMIT_ENGINES:-280}" python3 benchmarks/bench_sglang.py \
                --phases "${SGLANG_PHASES:-decode,verify}" "${eng[@]}" ${SGLANG_ARGS:-};;
      *) echo "unknown engine '$e' in ENGINES (vllm sglang)" >&2; continue;;
    esac
    show "engines_$e" "geomean" 6
  done
fi

if want profile && needs_gpu profile; then
  set -f
  case ${PROFILE:-prefill} in
    prefill)
      # shellcheck disable=SC2086
      # --launch-skip counts only the launches -k matches: 12 calls leave launches to profile past the 8 skipped when
      # PROFILE_KERNELS matches one kernel a call (6 calls did not: a kda_prep-only profile on 2026-12-04 caught nothing)
      step ncu_prefill "${LIMIT_PROFILE:-300}" ncu --clock-control none -k regex:"${PROFILE_KERNELS:-kda_prep|kda_state}" --launch-skip 8 \
        --launch-count 2 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --section SourceCounters --import-source yes -f -o "$OUT/prefill" python3 scripts/profile_prefill.py --calls 12 \
        ${PROFILE_ARGS:---tokens 32768 --heads 16}
      if [ "$DRY" != 1 ] && [ -f "$OUT/prefill.ncu-rep" ]; then
        ncu -i "$OUT/prefill.ncu-rep" --page details > "$OUT/prefill_details.txt" 2>&1
        grep -E "kda_|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|No Eligible" \
          "$OUT/prefill_details.txt" | head -30
        for sk in ${SASS_KERNEL:-kda_prep}; do
          ncu -i "$OUT/prefill.ncu-rep" --page source --csv --print-source sass --kernel-name regex:"$sk" \
            > "$OUT/prefill_${sk}_sass.csv" 2>&1
          # the CTAs and warps of that launch, from its "(grid)x(block)" line in the details page
          read -r ctas warps < <(grep -m1 -E "$sk[^ (]*(<[^>]*>)?\([A-Za-z]+\) \(" "$OUT/prefill_details.txt" \
            | grep -oE "\([0-9]+, [0-9]+, [0-9]+\)x\([0-9]+, [0-9]+, [0-9]+\)" | tr -c '0-9\n' ' ' \
            | awk '{print $1 * $2 * $3, $4 * $5 * $6 / 32}')
          [ -n "${ctas:-}" ] && python3 scripts/ncu_sass_segments.py "$OUT/prefill_${sk}_sass.csv" --ctas "$ctas" \
            --warps "$warps" | tee "$OUT/prefill_${sk}_segments.txt"
          gzip -f "$OUT/prefill_${sk}_sass.csv"
        done
      fi;;
    decode)
      # shellcheck disable=SC2086
      step ncu_decode "${LIMIT_PROFILE:-300}" ncu --clock-control none -k regex:kda_decode --launch-skip 4 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 scripts/profile_decode.py ${PROFILE_ARGS:---module decode_rowtma_bf16_o32 --heads 8 --rows 2048};;
    verify)
      # shellcheck disable=SC2086
      step ncu_verify "${LIMIT_PROFILE:-300}" ncu --clock-control none --kernel-name regex:kda_verify --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
        python3 scripts/verify_ncu_case.py --tokens 2 --heads 32 --rows 1024 \
        ${PROFILE_ARGS:---modules verify_stage2j8_bf16_o32,verify_bulk4j4_f32_o32};;
    timeline)   # one prefill call's kernels on a timeline (torch.profiler): does the state pass run beside the prep
      # shellcheck disable=SC2086
      step timeline "${LIMIT_PROFILE:-300}" python3 scripts/profile_prefill.py --calls 4 --timeline \
        ${PROFILE_ARGS:---tokens 32768 --heads 8}
      show timeline . 30;;
    *) echo "PROFILE must be prefill, decode, verify or timeline (got ${PROFILE})" >&2;;
  esac
  set +f
  show "ncu_${PROFILE:-prefill}" "kda_|Duration|Throughput|Occupancy|stalled" 60
fi

if want ab && needs_gpu ab; then
  : "${AB_BASE:?AB_BASE must name a folder holding the baseline csrc/ and jit/}"
  base=$(cd "$AB_BASE" && pwd) || exit 2
  bench=${AB_BENCH:-"python3 benchmarks/bench_prefill.py --no-fla --heads 16,64 --gates bounded,softplus --reps 8 --modes eager --no-plot --no-progress"}
  arm() {  # arm base|change CMD...: the command with that arm's data root and JIT cache
    local which=$1; shift
    if [ "$which" = base ]; then
      # a whole baseline tree (flashkda_ext/ too: host-cost A/Bs) runs its own package and benchmarks
      (export FLASHKDA_EXT_DATA_ROOT=$base FLASHKDA_EXT_CACHE_DIR=${AB_BASE_CACHE:-/tmp/fkda_cache_ab_base}
       if [ -d "$base/flashkda_ext" ]; then cd "$base" && export PYTHONPATH=$base:$PYTHONPATH; fi; "$@")
    else
      (export FLASHKDA_EXT_DATA_ROOT=$PWD; "$@")
    fi
  }
  set -f
  if [ -n "${AB_MODULES-prefill_vt*_f32}" ]; then
    for a in base change; do
      # shellcheck disable=SC2086
      arm $a step "ab_build_$a" "${LIMIT_BUILD:-300}" python3 -m flashkda_ext build --parallel 16 --jobs 1 \
        ${AB_MODULES-prefill_vt*_f32}
    done
  fi
  before=() after=() pairs=()
  for ((i = 1; i <= ${AB_ROUNDS:-2}; i++)); do
    order="base change"; (( i % 2 == 0 )) && order="change base"
    for a in $order; do
      # shellcheck disable=SC2086
      # through bash -c: AB_BENCH may quote an argument with spaces (a case name such as "H16 64x512")
      arm $a step "ab_${i}_$a" "${LIMIT_AB:-150}" bash -c "$bench"' "$@"' ab_bench --out "$OUT/ab_${i}_$a.json"
      if [ $a = base ]; then before+=("$OUT/ab_${i}_$a.json"); else after+=("$OUT/ab_${i}_$a.json"); fi
    done
    pairs+=("$OUT/ab_${i}_base.json" "$OUT/ab_${i}_change.json")
  done
  set +f
  join() { local IFS=,; echo "$*"; }
  if [ "${AB_COMPARE:-runs}" = overhead ]; then   # bench_overhead.py files: op minus direct, change minus base
    step ab_compare 60 python3 benchmarks/overhead_ab.py "${pairs[@]}"
  else
    step ab_compare 60 python3 benchmarks/compare_runs.py "$(join "${before[@]}")" "$(join "${after[@]}")"
  fi
  show ab_compare "geomean|  ours on|  [a-z]+ on " 40
fi

# Triton kernels compiled in this run (fla's; the engines' own), for a later one to carry (.triton_cache/): the
# first call of vLLM's chunk prefill compiles and autotunes for longer than a short LIMIT_ENGINES
if [ "$DRY" != 1 ] && { want integrations || want peers || want engines; }; then
  tc=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
  [ -d "$tc" ] && tar czf "$OUT/triton_cache.tgz" -C "$tc" .
fi
failed=$(cat "$OUT/.failed" 2>/dev/null | tr '\n' ' '); rm -f "$OUT/.failed"
# the device returns at most 8 files
if [ "$DRY" != 1 ]; then
  (cd "$OUT" && shopt -s nullglob && logs=(*.log *.txt) && [ ${#logs[@]} -gt 0 ] \
    && tar czf logs.tgz "${logs[@]}" && rm -f "${logs[@]}")
  (cd "$OUT" && shopt -s nullglob && res=(*.json *.png *.ncu-rep *.csv.gz) && [ ${#res[@]} -gt 6 ] \
    && tar czf results.tgz "${res[@]}" && rm -f "${res[@]}")
fi
[ -z "$failed" ] || { echo "failed steps: $failed"; exit 1; }
