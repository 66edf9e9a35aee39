"""One token of the gated delta rule on a state stored [HV, V, K] (key index last)."""
from __future__ import annotations

import torch


def delta_step(S, q, k, v, g, beta):
    """Advance every value head's state by one token and read it.

    S [HV, V, K]; q, k, g [HV, K] (q already scaled, q and k normalised, g the log decay);
    v [HV, V]; beta [HV]. Returns (o [HV, V], new S).
    """
    S = S * torch.exp(g)[:, None, :]                  # decay each key channel
    predicted = torch.einsum("hvk,hk->hv", S, k)      # S^T k in the K x V algebra
    u = beta[:, None] * (v - predicted)
    S = S + u[:, :, None] * k[:, None, :]             # rank-one write k u^T
    o = torch.einsum("hvk,hk->hv", S, q)              # read after the update
    return o, S
