"""Small random inputs of every op for the bad-input campaigns (tests/test_bad_input_*.py), CPU tensors,
fresh values on every call (never zeros)."""
from __future__ import annotations

import torch

R, H, HV, K, V, SLOTS = 3, 2, 4, 8, 16, 6
FUSED_POS = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state_indices", "state",
             "output_gate", "norm_weight")
FUSED_VERIFY_POS = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state", "output_gate",
                    "norm_weight")


def rand(*s, seed=[0]):
    seed[0] += 1
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed[0]))


def i32(*x):
    return torch.tensor(x, dtype=torch.int32)


def decode_args():
    return dict(q=rand(R, H, K), k=rand(R, H, K), v=rand(R, HV, V), g=rand(R, HV, K), beta=rand(R, HV),
                state=rand(SLOTS, HV, V, K), state_indices=i32(4, 0, 2), A_log=rand(HV), dt_bias=rand(HV * K))


def verify_args():
    return dict(q=rand(1, 5, H, K), k=rand(1, 5, H, K), v=rand(1, 5, HV, V), g=rand(1, 5, HV, K), beta=rand(1, 5, HV),
                state=rand(SLOTS, HV, V, K), state_indices=torch.tensor([[1, 4, -1], [2, 5, 3]], dtype=torch.int32),
                cu_seqlens=i32(0, 2, 5), A_log=rand(HV), dt_bias=rand(HV * K))


def fused_args(D=8, Hf=3):
    C = 3 * Hf * D
    return dict(x=rand(R, C), conv_weight=rand(C, 4), conv_state=rand(SLOTS, C, 3), g=rand(R, Hf, D), beta=rand(R, Hf),
                A_log=rand(Hf), dt_bias=rand(Hf * D), state_indices=i32(1, 5, 3), state=rand(SLOTS, Hf, D, D),
                output_gate=rand(R, Hf, D), norm_weight=rand(D).abs() + 0.5)


def fused_verify_args(D=8, Hf=3, T=5):
    C = 3 * Hf * D
    return dict(x=rand(1, T, C), conv_weight=rand(C, 4), conv_state=rand(SLOTS, C, 5), g=rand(1, T, Hf, D),
                beta=rand(1, T, Hf), A_log=rand(Hf), dt_bias=rand(Hf * D), state=rand(SLOTS, Hf, D, D),
                output_gate=rand(1, T, Hf, D), norm_weight=rand(D).abs() + 0.5,
                state_indices=torch.tensor([[1, 4, -1], [2, 5, 3]], dtype=torch.int32), cu_seqlens=i32(0, 2, 5))


def fla_chunk_call(h=H, k=K, v=V, **extra):
    """fla's chunk_kda keywords (the gate, l2norm and beta sigmoid in the kernel, the state [HV, V, K])."""
    T, hv = 6, 4
    call = dict(q=rand(1, T, h, k), k=rand(1, T, h, k), v=rand(1, T, hv, v), g=rand(1, T, hv, k),
                beta=rand(1, T, hv), A_log=rand(hv), dt_bias=rand(hv * k), use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)
    call.update(extra)
    return call


def fla_decode_call(h=H, k=K, v=V, **extra):
    """fla's fused_recurrent_kda_fwd keywords for three one-token requests, the middle one padding (slot -1)."""
    N, hv = 3, 4
    call = dict(q=rand(1, N, h, k), k=rand(1, N, h, k), v=rand(1, N, hv, v), g=-rand(1, N, hv, k).abs(),
                beta=rand(1, N, hv).sigmoid(), initial_state=rand(SLOTS, hv, v, k), inplace_final_state=True,
                cu_seqlens=torch.arange(N + 1), ssm_state_indices=torch.tensor([4, -1, 1], dtype=torch.int32),
                use_qk_l2norm_in_kernel=True, state_v_first=True)
    call.update(extra)
    return call
