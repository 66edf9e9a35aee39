"""Argument validation shared by every public op.

Every rule raises before anything is launched: TypeError for a wrong kind of value, ValueError for a
wrong shape, dtype, device, layout or range, each naming the argument, what was expected and what was
received. What a backend supports (head dims, head counts, dtypes, gates, slot modes) is read from
jit/supported.json through flashkda_ext.supported, the same file the binding macros and the trace
constraints are rendered from.

common.py holds the rules every check is built from, memo.py the memo of a check's verdict, and one
module per op family its check and the call it returns (decode, prefill, fused_decode, verify,
fused_verify). Callers use this package's names: validation.check_kda_decode(...) and so on.
"""
from .common import (DTYPE_NAMES, GATE_MODE, GATES, INT32_MAX, SLOT_MODES, backend_of, check_apart,
                     check_offsets_span, dtype_name, inference_conflict, rows_as_read,
                     _same_view as same_view)
from .decode import DecodeCall, check_kda_decode
from .fused_decode import FusedDecodeCall, check_fused_kda_decode
from .fused_verify import FusedVerifyCall, check_fused_kda_verify
from .prefill import (PrefillCall, check_checkpoint_every, check_kda_prefill, check_max_seqlen, check_offset_count,
                      check_workspace, prefill_route_meta)
from .verify import VerifyCall, check_kda_verify, check_verify_values

# single-argument rules other modules reuse (context_parallel, custom_ops, integrations) and tests call
from .common import (_bool, _choice, _float, _gate_bound, _inference_only, _int, _ndim, _real,  # noqa: F401
                     _same_device, _slot_stride, _span_bytes, _tensor)

__all__ = ["DTYPE_NAMES", "GATE_MODE", "GATES", "INT32_MAX", "SLOT_MODES", "backend_of", "check_apart",
           "check_offsets_span", "dtype_name", "inference_conflict", "rows_as_read", "DecodeCall", "check_kda_decode",
           "FusedDecodeCall", "check_fused_kda_decode",
           "FusedVerifyCall", "check_fused_kda_verify", "PrefillCall", "check_kda_prefill", "check_workspace",
           "prefill_route_meta", "check_max_seqlen", "check_offset_count", "check_checkpoint_every", "VerifyCall",
           "check_kda_verify", "check_verify_values", "same_view"]
