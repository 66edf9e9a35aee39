"""The PyTorch reference of KDA: the living spec (docs/semantics.md states it in words).

Plain, readable torch; any K and V; computes in the dtype asked for (float64 by default).
"""
from .chunked import chunk_step, kda_chunked
from .decode import causal_conv_update, fused_kda_decode_step, kda_decode_step, rmsnorm
from .gates import GATE_MODES, gate_log_decay, l2norm, prepare_token_inputs, softplus
from .prefill import is_padding, kda_recurrent
from .step import delta_step
from .verify import fused_kda_verify_step, kda_verify_step, verify_plan

__all__ = [
    "GATE_MODES", "causal_conv_update", "chunk_step", "delta_step", "fused_kda_decode_step", "fused_kda_verify_step",
    "gate_log_decay", "is_padding", "kda_chunked", "kda_decode_step", "kda_recurrent", "kda_verify_step", "l2norm",
    "prepare_token_inputs", "rmsnorm", "softplus", "verify_plan",
]
