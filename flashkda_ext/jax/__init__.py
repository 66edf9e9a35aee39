"""JAX front end: the same compiled TVM-FFI modules as the torch ops, called through XLA's FFI.

    import flashkda_ext.jax as kda_jax
    out, new_state = kda_jax.kda_decode(q, k, v, g, beta, state=pool, state_indices=idx, ...)

Each op takes and returns jax arrays and works eagerly and under jax.jit. Per call:

1. Arguments are checked in Python by flashkda_ext.validation (shape-only torch "meta" tensors stand
   in for the jax arrays), so a bad call raises the same ValueError/TypeError naming the argument as
   the torch op, before anything reaches XLA.
2. The route is picked from host-known metadata (flashkda_ext.dispatch), and the module's function
   is registered once per process as an XLA FFI target through jax-tvm-ffi: CPU arrays get the CPU
   backend module, CUDA arrays the CUDA module. XLA hands the target its stream.
3. jax.ffi.ffi_call runs it. Pools updated in place (decode state, conv cache, prefill state pool,
   checkpoints) are declared as input/output aliases, so XLA writes them in place when the input
   buffer is donated. Eager calls donate them by default (donate=True: the input arrays are consumed,
   as an in-place update would); under your own jax.jit, donate the pools with donate_argnums.

The module functions take outputs as arguments in a fixed order, with optional tensors passed as
None (docs/architecture.md), while an XLA FFI target receives all operands, then all results, then
attributes. An adapter (one per module and argument layout) puts them back in the ABI order: the
C++ wrapper of the helper module "ffi_reorder" (csrc/jax/ffi_reorder.cc), so after the first trace
a jitted step runs no Python of ours; a Python adapter only when that module cannot be loaded.

Steps 1 and 2 run once per call signature (shapes, dtypes, platform, options): a repeated eager
call reuses the validated plan and its jitted function (the verdict of a passed validation is
remembered; a call that fails it is checked, and raises, every time).

Layout: arrays.py (jax arrays -> meta tensors, platform, host values), targets.py (the ABI tables,
FFI target registration and adapters, the ffi_call), plan.py (route, per-signature memo, eager jit),
and the op front ends: decode.py (kda_decode, fused_kda_decode), prefill.py, verify.py (kda_verify,
fused_kda_verify).

Needs jax and jax-tvm-ffi: pip install "flashkda_ext[jax]".
"""
from __future__ import annotations

try:  # the submodules import them; checked here first so a missing one gets this message
    import jax  # noqa: F401
    import jax.numpy  # noqa: F401
    import jax_tvm_ffi  # noqa: F401
except ImportError as _err:  # tests/test_jax.py hides jax_tvm_ffi to check this message
    raise ImportError(
        "flashkda_ext.jax needs jax and jax-tvm-ffi; install them with "
        "`pip install \"flashkda_ext[jax]\"` (jax>=0.7.2, jax-tvm-ffi>=0.1.3). "
        f"Import failed with: {_err}") from _err

from .. import validation  # noqa: F401  the shared checks every front end calls (tests count the calls)
from .decode import fused_kda_decode, kda_decode
from .prefill import kda_prefill
from .targets import registered_targets
from .verify import fused_kda_verify, kda_verify

__all__ = ["kda_decode", "kda_prefill", "fused_kda_decode", "kda_verify", "fused_kda_verify", "registered_targets"]
