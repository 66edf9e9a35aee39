"""NVIDIA's cuDNN frontend KDA prefill as a benchmark peer (nvidia-cudnn-frontend >= 1.32, Hopper engine
`kda_hopper_cuda` pinned by plan name; see ../shared/PEERS.md).

cuDNN's layout is THD: q/k/v [T, H, D], g [T, H, K], beta [T, H], int32 cu_seqlens, state [N, H, V, K]
(the same k-last state layout as ours). The bounded gate goes in fused (safe_gate, gate_lower_bound,
a_log [H], dt_bias [H, K]); the softplus gate has no fused form there, so it goes in as the fp32 log
decay computed once outside the timed call (which favours cuDNN: its time leaves the gate out); the log
gate's decay (already the decay) goes in as fp32.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

ENGINE = "kda_hopper_cuda"


def available() -> Optional[str]:
    """None when cuDNN's KDA op can be imported, else the reason it cannot."""
    try:
        import cudnn.linear_attention as la  # noqa: F401
        la.kimi_delta_attention  # noqa: B018 (lazy export: resolves the op module)
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is absent
        return repr(e)[:200]
    return None


def version() -> Optional[str]:
    try:
        from importlib.metadata import version as v
        return v("nvidia-cudnn-frontend")
    except Exception:  # noqa: BLE001
        return None


def prefill_fn(q, k, v, g, beta, *, A_log, dt_bias, gate: str, lower_bound: float, scale: float,
               cu_seqlens, initial_state, plan_name: str = ENGINE) -> Callable[[], tuple]:
    """A zero-argument closure running cuDNN's KDA prefill on our [1, T, H, D] inputs; it returns
    (o [T, H, V], final_state [N, H, V, K])."""
    import cudnn.linear_attention as la

    H, K = g.shape[-2:]
    q3, k3, v3, b2 = q[0], k[0], v[0], beta[0]
    kw = dict(scale=scale, initial_state=initial_state.float().contiguous(), output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, plan_name=plan_name)
    if gate == "bounded":
        g3 = g[0]
        kw.update(safe_gate=True, gate_lower_bound=float(lower_bound), a_log=A_log.float().contiguous(),
                  dt_bias=dt_bias.float().reshape(H, K).contiguous())
    elif gate == "softplus":
        from flashkda_ext.reference.gates import gate_log_decay
        g3 = gate_log_decay(g[0], "softplus", A_log, dt_bias).contiguous()
    elif gate == "log":  # the fp32 log decay itself
        g3 = g[0].float().contiguous()
    else:
        raise ValueError(f"gate: {gate!r} has no cuDNN form here")
    cu = cu_seqlens.to(torch.int32).contiguous()

    def run():
        with torch.inference_mode():
            return la.kimi_delta_attention(q3, k3, v3, g3, b2, cu, **kw)

    return run
