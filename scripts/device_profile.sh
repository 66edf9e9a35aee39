#!/usr/bin/env bash
# Hardware counters (Nsight Compute) for the prefill kernels on a lent H200: one warm call of each
# shape, the chunk-preparation and the state-pass kernels, details plus per-instruction stalls (SASS
# export, split at barriers by scripts/ncu_sass_segments.py; the CUDA-source page comes back without
# metrics). Reports and text go to $OUT.
#   bash scripts/device_profile.sh ["--tokens 32768 --heads 16" ...]
# SASS_KERNEL (default kda_prep): which kernels' per-instruction exports are split and summarised,
# space-separated (kda_state for the state pass; "kda_prep kda_state" for both from one report).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
# "CTAS WARPS" of the first launch of kernel $1 in an ncu details page $2, from its line
# "  void kda_state_kernel<16, 3, float>(StateArgs) (8, 16, 1)x(128, 1, 1), Context ..."
launch_shape() {
  grep -m1 -E "$1[^ (]*(<[^>]*>)?\([A-Za-z]+\) \(" "$2" \
    | grep -oE "\([0-9]+, [0-9]+, [0-9]+\)x\([0-9]+, [0-9]+, [0-9]+\)" \
    | tr -c '0-9\n' ' ' | awk '{print $1 * $2 * $3, $4 * $5 * $6 / 32}'
}
SHAPES=("$@"); [ ${#SHAPES[@]} -eq 0 ] && SHAPES=("--tokens 32768 --heads 16")
i=0
for shape in "${SHAPES[@]}"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  stage "ncu_$i" 150 ncu --clock-control none -k regex:'kda_prep|kda_state' --launch-skip 8 --launch-count 2 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section SourceCounters --import-source yes -f -o "$OUT/prefill_$i" python3 scripts/profile_prefill.py --calls 6 $shape
  echo "   shape $i: $shape"
  ncu -i "$OUT/prefill_$i.ncu-rep" --page details > "$OUT/prefill_${i}_details.txt" 2>&1
  grep -E "kda_|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible" \
    "$OUT/prefill_${i}_details.txt" | head -30
  for sk in ${SASS_KERNEL:-kda_prep}; do
    ncu -i "$OUT/prefill_$i.ncu-rep" --page source --csv --print-source sass --kernel-name regex:"$sk" \
      > "$OUT/prefill_${i}_${sk}_sass.csv" 2>&1
    # CTAs and warps of that launch, from the grid x block line of its details block
    read -r ctas warps < <(launch_shape "$sk" "$OUT/prefill_${i}_details.txt")
    echo "   $sk: $ctas CTAs of $warps warps"
    [ -n "$ctas" ] && python3 scripts/ncu_sass_segments.py "$OUT/prefill_${i}_${sk}_sass.csv" --ctas "$ctas" --warps "$warps"
    gzip -f "$OUT/prefill_${i}_${sk}_sass.csv"
  done
done
