"""Developer tools, off the op path: nothing under flashkda_ext's ops, dispatch or jit imports them.

ptxdiff  normalised PTX of a module from two source trees, kernel by kernel (scripts/ptx_diff.py)
sass     registers, spills and instruction counts per kernel from a cubin (scripts/sass_stats.py)
testing  a toy spec tree (csrc/ + jit/) for the JIT machinery's tests
"""
