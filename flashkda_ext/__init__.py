"""flashkda_ext: KDA (Kimi Delta Attention) inference kernels for NVIDIA Hopper.

Public ops (PyTorch tensors in and out; CPU tensors run the CPU backend through the same TVM-FFI
machinery): kda_decode, kda_prefill, fused_kda_decode, kda_verify, fused_kda_verify; context-parallel prefill over a
torch.distributed group: cp_plan, cp_prefill (flashkda_ext.context_parallel). The PyTorch reference (the spec) is
flashkda_ext.reference; JAX wrappers are in flashkda_ext.jax (needs jax and jax-tvm-ffi).
"""
import sys as _sys

from . import switches

try:
    from .ops import fused_kda_decode, fused_kda_verify, kda_decode, kda_prefill, kda_verify, prefill_workspace_bytes
    from .context_parallel import cp_prefill, plan as cp_plan
except switches.SwitchError as e:
    # a switch read at import (FLASHKDA_EXT_FAST_PATH, FLASHKDA_EXT_NATIVE_FLAGS) that is no switch: the command line
    # reports it as it reports its own bad settings (one line, exit status 2); a library import raises it
    if not switches.launched_as_cli():
        raise
    print(f"flashkda-ext: error: {e}", file=_sys.stderr)
    raise SystemExit(2) from None

__version__ = "0.1.0"
__all__ = ["kda_decode", "kda_prefill", "fused_kda_decode", "kda_verify", "fused_kda_verify",
           "prefill_workspace_bytes", "cp_plan", "cp_prefill", "__version__"]
