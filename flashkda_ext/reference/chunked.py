"""The chunked (WY / UT) form of the KDA recurrence: what prefill kernels compute.

Algebra in the K x V orientation (S_kv = stored state transposed); per chunk of C tokens with
cumulative log decay G (C x K, G_i = g_1 + ... + g_i):
    L[i,j]   = beta_i sum_d k_id k_jd exp(G_id - G_jd)     (j < i)
    T        = (I + L)^-1 Diag(beta)
    W        = T (exp(G) o K),   U = T V
    Aqk[i,j] = sum_d q_id k_jd exp(G_id - G_jd)             (j <= i)
    V'       = U - W S
    O        = (Q o exp(G)) S + Aqk V'
    S        = Diag(exp(G_C)) S + (exp(G_C - G) o K)^T V'
The pairwise exponent G_i - G_j (j <= i) is always <= 0, so this elementwise form cannot overflow.
"""
from __future__ import annotations

import torch

from . import checks
from .prefill import run_prefill


def chunk_step(S_kv, q, k, v, g, beta):
    """One chunk for all heads. S_kv [HV, K, V]; q, k, g [HV, C, K]; v [HV, C, V]; beta [HV, C].
    Returns (O [HV, C, V], new S_kv)."""
    HV, C, K = q.shape
    G = torch.cumsum(g, dim=1)
    diff = G[:, :, None, :] - G[:, None, :, :]                      # [HV, i, j, K]
    rows = torch.arange(C, device=q.device)
    strict = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]
    # zero the exponent outside the causal triangle before exp, so nothing there can overflow
    decay = torch.exp(torch.where(causal[None, :, :, None], diff, torch.zeros_like(diff)))
    kk = torch.einsum("hid,hjd,hijd->hij", k, k, decay)
    L = torch.where(strict, beta[:, :, None] * kk, torch.zeros_like(kk))
    Aqk = torch.where(causal, torch.einsum("hid,hjd,hijd->hij", q, k, decay), torch.zeros_like(kk))
    eye = torch.eye(C, dtype=q.dtype, device=q.device).expand(HV, C, C)
    Tm = torch.linalg.solve_triangular(eye + L, torch.diag_embed(beta), upper=False,
                                       unitriangular=True)
    W = Tm @ (torch.exp(G) * k)
    U = Tm @ v
    V_new = U - W @ S_kv
    O = (q * torch.exp(G)) @ S_kv + Aqk @ V_new
    G_last = G[:, -1:, :]                                           # [HV, 1, K]
    S_kv = torch.exp(G_last).transpose(1, 2) * S_kv + (torch.exp(G_last - G) * k).transpose(1, 2) @ V_new
    return O, S_kv


def _chunked_sequence_fn(chunk_size):
    def run(q, k, v, g, beta, S, checkpoint_every):
        L_total = q.shape[0]
        o = torch.zeros_like(v)
        S_kv = S.transpose(1, 2)                                    # stored [HV, V, K] -> [HV, K, V]
        ckpts = []
        for s in range(0, L_total, chunk_size):
            e = min(s + chunk_size, L_total)                        # last chunk may be ragged
            per_head = lambda x: x[s:e].transpose(0, 1)             # [C, HV, .] -> [HV, C, .]
            O, S_kv = chunk_step(S_kv, per_head(q), per_head(k), per_head(v), per_head(g),
                                 beta[s:e].transpose(0, 1))
            o[s:e] = O.transpose(0, 1)
            if checkpoint_every and e % checkpoint_every == 0:
                ckpts.append(S_kv.transpose(1, 2).clone())
        return o, S_kv.transpose(1, 2).contiguous(), ckpts
    return run


def kda_chunked(q, k, v, g, beta, *, gate="softplus", A_log=None, dt_bias=None, lower_bound=None,
                scale=None, beta_is_logit=True, cu_seqlens=None, initial_state=None,
                state_indices=None, null_slot0=False, output_final_state=True, checkpoint_every=0,
                dtype=torch.float64, chunk_size=64):
    """Same contract and results as kda_recurrent, computed chunk by chunk (WY/UT form).

    checkpoint_every must be a multiple of chunk_size (checkpoints fall on chunk boundaries,
    as in the prefill kernels).
    """
    chunk_size = checks.count("chunk_size", chunk_size, 1)   # True passed as 1, 2.5 failed in range()
    checkpoint_every = checks.count("checkpoint_every", checkpoint_every, 0)
    if checkpoint_every and checkpoint_every % chunk_size != 0:
        raise ValueError(f"checkpoint_every={checkpoint_every} must be a multiple of "
                         f"chunk_size={chunk_size}")
    return run_prefill(_chunked_sequence_fn(chunk_size), q, k, v, g, beta, gate=gate, A_log=A_log,
                       dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                       beta_is_logit=beta_is_logit, cu_seqlens=cu_seqlens,
                       initial_state=initial_state, state_indices=state_indices,
                       null_slot0=null_slot0, output_final_state=output_final_state,
                       checkpoint_every=checkpoint_every, dtype=dtype)
