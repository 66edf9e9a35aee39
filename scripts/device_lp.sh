#!/usr/bin/env bash
# Issue 32, stage 1 (prep efficiency), in one device call of ~6-8 minutes: build the routed prefill
# modules of the timed cases and the unrouted prefill_lp_* records (probes and candidates), the GPU
# prefill tests over the prefill_lp_* records, compute-sanitizer (memcheck, racecheck, synccheck) on
# them, their accuracy beside prefill_vt16_f32, then the prep kernel's time alone, module against
# module (scripts/prep_timing.py: 1 x 32768, 1 x 8192, 4 x 4096 at H16, both gates, cold L2), with
# its table (SM-cycles a chunk-head) printed last. Carry .whl (scripts/device_env.sh).
#
#   bash scripts/device_lp.sh            # LP_MODULES / LP_REPS / LP_ROUNDS / LP_SKIP (stage names) optional
#   LP_DRY=1 bash scripts/device_lp.sh   # CPU check of the script: every GPU stage skipped, timing --dry-run
#
# Results in $OUT: one log a stage, prep_timing.json, prep_timing.txt.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
LP_MODULES=${LP_MODULES:-prefill_lp_nostore_vt16_f32,prefill_lp_memonly_vt16_f32,prefill_lp_tf32_vt16_f32,prefill_lp_wub_vt16_f32,prefill_lp_both_vt16_f32}
SKIP=" ${LP_SKIP:-} "
DRY=()
if [ "${LP_DRY:-0}" = 1 ]; then SKIP=" build tests memcheck racecheck synccheck accuracy "; DRY=(--dry-run); fi
run_stage() { case "$SKIP" in *" $1 "*) echo "== $1 skipped";; *) stage "$@";; esac; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv,noheader 2>&1 | head -2
# routed modules of the timed cases: prefill_vt16_f32 (1 x 32768, 1 x 8192), prefill_vt64_f32 (4 x 4096)
run_stage build 200 python3 -m flashkda_ext build --backend cuda --parallel 16 --jobs 1 \
  prefill_vt16_f32 prefill_vt64_f32 'prefill_lp_*'
tail -2 "$OUT/build.log" 2>/dev/null
run_stage tests 170 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_prefill_gpu.py -k prefill_lp_
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" 2>/dev/null | tail -8
# memcheck on every prefill_lp_* record; racecheck and synccheck where shared memory or barriers
# changed (the W / U staging of wub and both; memonly's barrier and bulk copies)
for t in memcheck racecheck synccheck; do
  only='prefill_lp_*'; [ "$t" = memcheck ] || only='prefill_lp_wub_*,prefill_lp_both_*,prefill_lp_memonly_*'
  run_stage "$t" 80 compute-sanitizer --tool "$t" --error-exitcode 7 python3 scripts/sanitize_routes.py --only "$only"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|[0-9]+ failed$" "$OUT/$t.log" 2>/dev/null | head -3
done
run_stage accuracy 90 python3 scripts/prefill_accuracy.py --seeds 11,12 \
  --modules prefill_vt16_f32,prefill_lp_tf32_vt16_f32,prefill_lp_wub_vt16_f32,prefill_lp_both_vt16_f32
tail -12 "$OUT/accuracy.log" 2>/dev/null
run_stage timing 200 python3 scripts/prep_timing.py --modules "$LP_MODULES" --reps "${LP_REPS:-6}" \
  --rounds "${LP_ROUNDS:-2}" --out "$OUT/prep_timing.json" "${DRY[@]}"
sed -n '/^case /,$p' "$OUT/timing.log" > "$OUT/prep_timing.txt"
tail -3 "$OUT/timing.log" | grep -v "^k cyc" | grep -iE "error|Traceback" || true
cat "$OUT/prep_timing.txt"
