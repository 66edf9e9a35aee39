"""Facts: what a template may read about one call, from a validated call or from the public op's
arguments alone (for calls validation rejects)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", None: "none"}


def _dtype(x) -> Optional[str]:
    if x is None:
        return None
    return str(x.dtype).replace("torch.", "")


_OP_DEFAULTS = {
    "kda_decode": dict(A_log=None, dt_bias=None, lower_bound=None, gate="softplus", scale=None,
                       beta_is_logit=True, slot_mode="unique", null_slot0=False),
    "kda_prefill": dict(A_log=None, dt_bias=None, lower_bound=None, gate="softplus", scale=None,
                        beta_is_logit=True, cu_seqlens=None, initial_state=None, state=None,
                        state_indices=None, output_final_state=True, final_state=None,
                        checkpoint_every=0, checkpoints=None, max_seqlen=None, null_slot0=False),
    "fused_kda_decode": dict(lower_bound=None, gate="softplus", norm_eps=1e-5, scale=None,
                             slot_mode="unique", null_slot0=False),
    "kda_verify": dict(num_accepted_tokens=None, max_seqlen=None, A_log=None, dt_bias=None, lower_bound=None,
                       gate="softplus", scale=None, beta_is_logit=True, null_slot0=False, initial_state=None,
                       initial_state_indices=None, parent_tokens=None),
    "fused_kda_verify": dict(num_accepted_tokens=None, max_seqlen=None, lower_bound=None, gate="softplus",
                             norm_eps=1e-5, scale=None, null_slot0=False),
}


def _resolved_scale(scale, head_dim: int) -> float:
    return float(head_dim) ** -0.5 if scale is None else float(scale)


def facts_from_args(op: str, args: Mapping[str, Any], backend: str) -> Dict[str, Any]:
    """The call's facts from the public op's arguments alone (no validation): the same keys and
    values validation.check_<op> puts in its call (a test checks they agree), so constraints can be
    evaluated for calls that validation rejects too."""
    a = {**_OP_DEFAULTS[op], **args}
    lb = a["lower_bound"]
    common = dict(backend=backend, gate=a["gate"], null_slot0=bool(a["null_slot0"]),
                  lower_bound=0.0 if lb is None else float(lb))
    if op == "kda_decode":
        q, v, state = a["q"], a["v"], a["state"]
        return dict(common, rows=q.shape[0], num_heads=q.shape[1], head_dim_k=q.shape[2],
                    value_heads=v.shape[1], head_dim_v=v.shape[2], slots=state.shape[0],
                    input_dtype=_dtype(q), state_dtype=_dtype(state), slot_mode=a["slot_mode"],
                    beta_is_logit=bool(a["beta_is_logit"]), scale=_resolved_scale(a["scale"], q.shape[2]),
                    g_dtype=_dtype(a["g"]), beta_dtype=_dtype(a["beta"]))
    if op == "fused_kda_decode":
        g, state = a["g"], a["state"]
        return dict(common, rows=g.shape[0], num_heads=g.shape[1], head_dim=g.shape[2],
                    slots=state.shape[0], input_dtype=_dtype(a["x"]), state_dtype=_dtype(state),
                    slot_mode=a["slot_mode"], norm_eps=float(a["norm_eps"]),
                    scale=_resolved_scale(a["scale"], g.shape[2]))
    if op in ("kda_verify", "fused_kda_verify"):
        idx, state = a["state_indices"], a["state"]
        rows = state.shape[0] if op == "kda_verify" and state.dim() == 5 else 0  # kda_verify's step rows
        N, cols = idx.shape[0], (state.shape[1] if rows else idx.shape[1])
        verify = dict(num_seqs=N, index_cols=cols, max_seqlen=cols if a["max_seqlen"] is None else a["max_seqlen"],
                      has_accepted=a["num_accepted_tokens"] is not None, slot_mode="padded")
        if op == "kda_verify":
            q, v, state = a["q"], a["v"], a["state"]
            return dict(common, **verify, total_tokens=q.shape[1], num_heads=q.shape[2], head_dim_k=q.shape[3],
                        value_heads=v.shape[2], head_dim_v=v.shape[3], slots=rows * cols if rows else state.shape[0],
                        rows=rows,
                        input_dtype=_dtype(q), state_dtype=_dtype(state), beta_is_logit=bool(a["beta_is_logit"]),
                        scale=_resolved_scale(a["scale"], q.shape[3]), g_dtype=_dtype(a["g"]),
                        beta_dtype=_dtype(a["beta"]),
                        initial_slots=-1 if a["initial_state"] is None else a["initial_state"].shape[0],
                        tree=a["parent_tokens"] is not None)
        g, state = a["g"], a["state"]
        return dict(common, **verify, total_tokens=g.shape[1], num_heads=g.shape[2], head_dim=g.shape[3],
                    slots=state.shape[0], conv_len=a["conv_state"].shape[-1], input_dtype=_dtype(a["x"]),
                    state_dtype=_dtype(state), norm_eps=float(a["norm_eps"]),
                    scale=_resolved_scale(a["scale"], g.shape[3]))
    q, v = a["q"], a["v"]
    B, T = q.shape[0], q.shape[1]
    cu = a["cu_seqlens"]
    N = B if cu is None else cu.shape[0] - 1
    init, final, ckpt = a["initial_state"], a["final_state"], a["checkpoints"]
    if a["state"] is not None:
        mode, sdtype, slots = "pool", _dtype(a["state"]), a["state"].shape[0]
    else:
        slots = N
        sdtype = _dtype(init) or _dtype(final) or ("float32" if a["output_final_state"] else None)
        mode = "dense" if (init is not None or final is not None or a["output_final_state"]) else "none"
    every = int(a["checkpoint_every"])
    ckpt_slots = 0
    if every > 0:
        sdtype = sdtype or _dtype(ckpt) or "float32"
        longest = a["max_seqlen"] if a["max_seqlen"] is not None else T
        ckpt_slots = ckpt.shape[1] if ckpt is not None else longest // every
    return dict(common, batch=B, seqlen=T, num_seqs=N, total_tokens=B * T, num_heads=q.shape[2],
                head_dim_k=q.shape[3], value_heads=v.shape[2], head_dim_v=v.shape[3],
                input_dtype=_dtype(q), state_dtype=sdtype, state_mode=mode, slots=slots,
                output_final_state=bool(a["output_final_state"]), checkpoint_every=every,
                checkpoint_slots=ckpt_slots, cu_seqlens_dtype=_dtype(cu),
                beta_is_logit=bool(a["beta_is_logit"]), scale=_resolved_scale(a["scale"], q.shape[3]))


def facts(op: str, call: Any, inputs: Mapping[str, Any]) -> Dict[str, Any]:
    """Facts of a validated call: the call's fields (authoritative), plus what only the arguments
    say (which optional inputs were given), plus short names for the definition name."""
    if dataclasses.is_dataclass(call):
        f = {fld.name: getattr(call, fld.name) for fld in dataclasses.fields(call)}   # asdict is slow
    else:
        f = dict(call)
    f["has_A_log"] = inputs.get("A_log") is not None
    f["has_dt_bias"] = inputs.get("dt_bias") is not None
    if op == "kda_prefill":
        f["varlen"] = f.get("cu_seqlens_dtype") is not None
        # ops.py hands the pool in as initial_state in pool mode; only dense mode reads this flag
        f["has_initial_state"] = inputs.get("initial_state") is not None
        f["slot_mode"] = "padded" if f["state_mode"] == "pool" else None
    if op in ("kda_verify", "fused_kda_verify"):
        f["has_accepted"] = inputs.get("num_accepted_tokens") is not None
        f["slot_mode"] = "padded"       # what validation checks a verify call's indices as
    if op == "kda_verify":              # flags, not the counts: R and slots2 are var axes
        f["step_rows"] = f["rows"] > 0
        f["has_initial"] = f["initial_slots"] >= 0
    if op in ("fused_kda_decode", "fused_kda_verify"):
        f["conv_weight_dtype"] = _dtype(inputs["conv_weight"])
        f["conv_weight_short"] = _SHORT.get(f["conv_weight_dtype"], f["conv_weight_dtype"])
    f["state_short"] = _SHORT.get(f.get("state_dtype"), f.get("state_dtype"))
    f["input_short"] = _SHORT.get(f["input_dtype"], f["input_dtype"])
    for name in ("g", "beta"):  # kda_decode and kda_verify read g and beta in their own dtype (q's or float32)
        if f"{name}_dtype" in f:
            f[f"{name}_short"] = _SHORT.get(f[f"{name}_dtype"], f[f"{name}_dtype"])
    return f


def args_facts(op: str, args: Mapping[str, Any], backend: str) -> Dict[str, Any]:
    """facts() for arguments that were never validated (the agreement sweep uses this)."""
    return facts(op, facts_from_args(op, args, backend), args)

