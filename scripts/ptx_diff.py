"""Normalised PTX of CUDA modules from two source trees, kernel by kernel (flashkda_ext.devtools.ptxdiff):
is a refactor a no-op for the GPU code? No GPU needed, only nvcc.

    git archive <rev> csrc jit | tar x -C /tmp/base
    python3 scripts/ptx_diff.py prefill_vt16_f32 prefill_vt64s_f32 --base /tmp/base

Exit status 0 when every kernel is identical, 1 when one differs.
"""
import sys

from flashkda_ext.devtools.ptxdiff import main

if __name__ == "__main__":
    sys.exit(main())
