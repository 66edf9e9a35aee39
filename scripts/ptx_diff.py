"""Normalised PTX of CUDA modules from two source trees, kernel by kernel (flashkda_ext.devtools.ptxdiff):
is a refactor a no-op for the GPU code? No GPU needed, only nvcc.

    git archive <rev> csrc jit | tar x -C /tmp/base
    python3 scripts/ptx_diff.py prefill_vt16_f32 prefill_vt64s_f32 --base /tmp/base

Exit status 0 when every kernel is identical, 1 when one differs.
"""
import sys
from pathlib import Path

# this checkout's package, not an installed one: from a git worktree, an editable install of another
# checkout would make the change side (default: the package's own tree) that other checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashkda_ext.devtools.ptxdiff import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
