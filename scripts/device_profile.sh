#!/usr/bin/env bash
# Hardware counters (Nsight Compute) for the prefill kernels on a lent H200: one warm call of each
# shape, the chunk-preparation and the state-pass kernels, details plus per-instruction stalls (SASS
# export, split at barriers by scripts/ncu_sass_segments.py; the CUDA-source page comes back without
# metrics). Reports and text go to $OUT.
#   bash scripts/device_profile.sh ["--tokens 32768 --heads 16" ...]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
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
  ncu -i "$OUT/prefill_$i.ncu-rep" --page source --csv --print-source sass --kernel-name regex:kda_prep \
    > "$OUT/prefill_${i}_prep_sass.csv" 2>&1
  grep -E "kda_|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible" \
    "$OUT/prefill_${i}_details.txt" | head -30
  # CTAs of the prep launch: the grid line of its details block
  ctas=$(grep -m1 -oE "kda_prep_lite_kernel\(PrepArgs\) \([0-9]+, [0-9]+, 1\)" "$OUT/prefill_${i}_details.txt" \
    | grep -oE "[0-9]+, [0-9]+" | awk -F', ' '{print $1 * $2}')
  [ -n "$ctas" ] && python3 scripts/ncu_sass_segments.py "$OUT/prefill_${i}_prep_sass.csv" --ctas "$ctas" --warps 8
  gzip -f "$OUT/prefill_${i}_prep_sass.csv"
done
