"""Machine-code (SASS) statistics of CUDA modules, optionally against a baseline tree
(flashkda_ext.devtools.sass): registers, spills, instruction counts, branches, barriers. No GPU needed,
only nvcc, cuobjdump and the nvdisasm it runs (the CUDA toolkit's, or
`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`).

    git archive <rev> csrc jit | tar x -C /tmp/base
    python3 scripts/sass_stats.py prefill_vt16_f32 --kernel prep --base /tmp/base
"""
import sys

from flashkda_ext.devtools.sass import main

if __name__ == "__main__":
    sys.exit(main())
