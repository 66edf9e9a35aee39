"""The gate's per-head parameters (A_log [H], dt_bias [H * K]) a benchmark draws.

- "random" (the benchmarks' default since issue 8): A_log uniform in [-1, -0.5], dt_bias N(0, 0.5^2). Every key of
  every token decays fast (~1 nat a token for the bounded gate at -5), so a split's warm-up is one chunk.
- "fla-init": as a freshly initialised KDA layer of fla 0.6.0 (`fla.layers.kda.KimiDeltaAttention`, read from the
  flash-linear-attention 0.6.0 wheel, 2026-12-04): dt log-uniform in [1e-3, 0.1] per key (at least 1e-4), dt_bias
  its inverse softplus (so softplus(dt_bias) = dt), and A_log 0 for the bounded ("safe") gate, log of a uniform
  draw in [1, 16] for the softplus one. A layer's slowest keys then decay by ~1e-3 nats a token, as long-memory
  channels do: trained weights move, but this is the nearest public stand-in for a real model's gates.
"""
from __future__ import annotations

import math

KINDS = ("random", "fla-init")


def draw(H, K, gate, kind, device="cpu", generator=None):
    """(A_log [H] float32, dt_bias [H * K] float32) for `gate` ("bounded", "softplus" or "log": the softplus gate's
    parameters, its decays computed outside)."""
    import torch

    kw = dict(device=device, generator=generator)
    if kind == "random":
        return torch.rand(H, **kw) * 0.5 - 1.0, torch.randn(H * K, **kw) * 0.5
    if kind != "fla-init":
        raise ValueError(f"gate parameters: unknown kind {kind!r} (one of {KINDS})")
    lo, hi = math.log(1e-3), math.log(0.1)
    dt = torch.exp(torch.rand(H * K, **kw) * (hi - lo) + lo).clamp_min(1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))   # inverse softplus
    if gate == "bounded":
        A_log = torch.zeros(H, device=device)
    else:
        A_log = torch.log(torch.rand(H, **kw) * 15.0 + 1.0)
    return A_log, dt_bias
