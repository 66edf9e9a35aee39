"""Small cases of the public ops for the trace tests: keyword arguments for one call of each op
(CASE[op](**kw)), the variants every trace test runs over (VARIANTS, IDS), and the check that
validates a call like the op (CHECK). Shared by test_trace.py and test_trace_flashinfer_bench.py."""
from __future__ import annotations

import torch

from flashkda_ext import validation

def _gate_args(gate, HV, K, gen, flat_dt=True):
    a = {"gate": gate}
    if gate in ("softplus", "bounded"):
        a["A_log"] = torch.randn(HV, generator=gen) * 0.5
        a["dt_bias"] = torch.randn(HV * K if flat_dt else (HV, K), generator=gen)
    if gate == "bounded":
        a["lower_bound"] = -5.0
    return a


def decode_case(*, H=2, HV=4, K=8, V=6, rows=5, slots=7, dtype=torch.float32, state_dtype=torch.float32,
                gate="softplus", slot_mode="unique", null_slot0=False, beta_is_logit=True, bare=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    g = r(rows, HV, K)
    if gate == "log":
        g = -torch.nn.functional.softplus(g.float()).to(dtype)
    beta = r(rows, HV) if beta_is_logit else torch.rand(rows, HV, generator=gen).to(dtype)
    idx = {"unique": [1, 4, 0, 6, 2], "padded": [3, -1, 0, -1, 5], "repeated": [2, 2, -1, 5, 2]}[slot_mode][:rows]
    a = dict(q=r(rows, H, K), k=r(rows, H, K), v=r(rows, HV, V), g=g, beta=beta,
             state=(torch.randn(slots, HV, V, K, generator=gen) * 0.1).to(state_dtype),
             state_indices=torch.tensor(idx, dtype=torch.int32), slot_mode=slot_mode,
             null_slot0=null_slot0, beta_is_logit=beta_is_logit, **_gate_args(gate, HV, K, gen))
    if bare:                        # the bounded gate's A_log and dt_bias are optional
        del a["A_log"], a["dt_bias"]
    return a


def prefill_case(*, H=2, HV=4, K=8, V=6, lens=(3, 0, 5), dtype=torch.float32, state_dtype=torch.float32,
                 gate="softplus", mode="dense", varlen=True, final=True, checkpoint_every=0,
                 cu_dtype=torch.int32, null_slot0=False, seed=1):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    N = len(lens)
    if varlen:
        B, T = 1, sum(lens)
    else:
        B, T = N, lens[0]
    a = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
             output_final_state=final, checkpoint_every=checkpoint_every, **_gate_args(gate, HV, K, gen))
    if gate == "log":
        a["g"] = -torch.nn.functional.softplus(a["g"].float()).to(dtype)
    if varlen:
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + n)
        a["cu_seqlens"] = torch.tensor(offs, dtype=cu_dtype)
    if mode == "dense":
        a["initial_state"] = (torch.randn(N, HV, V, K, generator=gen) * 0.1).to(state_dtype)
    elif mode == "pool":
        a["state"] = (torch.randn(N + 3, HV, V, K, generator=gen) * 0.1).to(state_dtype)
        a["state_indices"] = torch.tensor([4, -1, 0, 2, 1][:N], dtype=torch.int32)
        a["null_slot0"] = null_slot0
    return a


def fused_case(*, H=2, D=8, rows=4, slots=6, dtype=torch.float32, state_dtype=torch.float32, gate="softplus",
               slot_mode="unique", null_slot0=False, conv_dtype=None, seed=2):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    C = 3 * H * D
    idx = {"unique": [1, 4, 0, 5], "padded": [3, -1, 0, 5], "repeated": [2, 2, -1, 2]}[slot_mode][:rows]
    ga = _gate_args(gate, H, D, gen)
    a = dict(x=r(rows, C), conv_weight=(torch.randn(C, 4, generator=gen) * 0.5).to(conv_dtype or dtype),
             conv_state=r(slots, C, 3), g=r(rows, H, D), beta=r(rows, H), A_log=ga.pop("A_log", None),
             dt_bias=ga.pop("dt_bias", None), state_indices=torch.tensor(idx, dtype=torch.int32),
             state=(torch.randn(slots, H, D, D, generator=gen) * 0.1).to(state_dtype),
             output_gate=r(rows, H, D), norm_weight=torch.rand(D, generator=gen) + 0.5,
             slot_mode=slot_mode, null_slot0=null_slot0, **ga)
    if gate == "log":
        a["g"] = -torch.nn.functional.softplus(a["g"].float()).to(dtype)
    return a


# verify: 3 requests of 3, 1, 2 draft tokens (T_max = 3); distinct stored slots, padding for tokens
# a request stores nowhere; num_accepted_tokens picks the read column (2 reads slot 2 of request 0)
VERIFY_LENS = (3, 1, 2)
VERIFY_SLOTS = [[1, 2, 3], [4, -1, -1], [5, 6, -1]]
VERIFY_ACCEPTED = [2, 1, 1]
# the new forms: step rows (a row of state [R, T_max, ...] per request; -1: a padding request) and a
# read-only start pool (initial_state [5, ...], a start slot per request; -1: a padding request)
VERIFY_ROWS = [3, -1, 0]
VERIFY_STARTS = [4, 1, -1]
# a draft tree (parent_tokens): token 2 of request 0 branches off token 0; 9 and 7 sit where no token reads
VERIFY_PARENTS = [[9, 0, 0], [9, 7, 7], [9, 0, 7]]


def _verify_indices(lens, slots, accepted, cols, with_accepted):
    cols = cols or max(lens)
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    a = dict(cu_seqlens=torch.tensor(offs, dtype=torch.int32),
             state_indices=torch.tensor([row[:cols] for row in slots], dtype=torch.int32))
    if with_accepted:
        a["num_accepted_tokens"] = torch.tensor([min(x, cols) for x in accepted], dtype=torch.int32)
    return a


def verify_case(*, H=2, HV=4, K=8, V=6, lens=VERIFY_LENS, slots=9, dtype=torch.float32,
                state_dtype=torch.float32, gate="softplus", accepted=True, null_slot0=False, beta_is_logit=True,
                index_slots=VERIFY_SLOTS, num_accepted=VERIFY_ACCEPTED, step_rows=False, initial=False, tree=False,
                seed=3):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    T, cols = sum(lens), max(lens)
    g = r(1, T, HV, K)
    if gate == "log":
        g = -torch.nn.functional.softplus(g.float()).to(dtype)
    beta = r(1, T, HV) if beta_is_logit else torch.rand(1, T, HV, generator=gen).to(dtype)
    pool = lambda *lead: (torch.randn(*lead, HV, V, K, generator=gen) * 0.1).to(state_dtype)  # noqa: E731
    a = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=g, beta=beta, state=pool(slots),
             null_slot0=null_slot0, beta_is_logit=beta_is_logit, **_gate_args(gate, HV, K, gen),
             **_verify_indices(lens, index_slots, num_accepted, cols, accepted))
    if step_rows:
        a["state"] = pool(len(lens) + 2, cols)
        a["state_indices"] = torch.tensor(VERIFY_ROWS[:len(lens)], dtype=torch.int32)
    if initial:
        a["initial_state"] = pool(5)
        a["initial_state_indices"] = torch.tensor(VERIFY_STARTS[:len(lens)], dtype=torch.int32)
    if tree:
        a["parent_tokens"] = torch.tensor([row[:cols] for row in VERIFY_PARENTS[:len(lens)]], dtype=torch.int32)
    return a


def fused_verify_case(*, H=2, D=8, lens=VERIFY_LENS, slots=9, extra_len=1, dtype=torch.float32,
                      state_dtype=torch.float32, gate="softplus", accepted=True, null_slot0=False, conv_dtype=None,
                      seed=4):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    T, C, cols = sum(lens), 3 * H * D, max(lens)
    ga = _gate_args(gate, H, D, gen)
    a = dict(x=r(1, T, C), conv_weight=(torch.randn(C, 4, generator=gen) * 0.5).to(conv_dtype or dtype),
             conv_state=r(slots, C, cols + 2 + extra_len), g=r(1, T, H, D), beta=r(1, T, H),
             A_log=ga.pop("A_log", None), dt_bias=ga.pop("dt_bias", None),
             state=(torch.randn(slots, H, D, D, generator=gen) * 0.1).to(state_dtype), output_gate=r(1, T, H, D),
             norm_weight=torch.rand(D, generator=gen) + 0.5, null_slot0=null_slot0, **ga,
             **_verify_indices(lens, VERIFY_SLOTS, VERIFY_ACCEPTED, cols, accepted))
    if gate == "log":
        a["g"] = -torch.nn.functional.softplus(a["g"].float()).to(dtype)
    return a


CHECK = {"kda_decode": validation.check_kda_decode, "kda_prefill": validation.check_kda_prefill,
         "fused_kda_decode": validation.check_fused_kda_decode, "kda_verify": validation.check_kda_verify,
         "fused_kda_verify": validation.check_fused_kda_verify}
CASE = {"kda_decode": decode_case, "kda_prefill": prefill_case, "fused_kda_decode": fused_case,
        "kda_verify": verify_case, "fused_kda_verify": fused_verify_case}
VERIFY_OPS = ("kda_verify", "fused_kda_verify")

VARIANTS = [
    ("kda_decode", {}),
    ("kda_decode", {"gate": "bounded", "slot_mode": "padded", "dtype": torch.bfloat16}),
    ("kda_decode", {"gate": "log", "slot_mode": "repeated", "state_dtype": torch.bfloat16}),
    ("kda_decode", {"H": 4, "HV": 4, "K": 6, "V": 6, "null_slot0": True, "slot_mode": "padded"}),
    ("kda_decode", {"beta_is_logit": False, "dtype": torch.float16}),
    ("kda_decode", {"gate": "bounded", "bare": True}),
    ("kda_prefill", {}),
    ("kda_prefill", {"mode": "pool", "gate": "bounded"}),
    ("kda_prefill", {"mode": "pool", "null_slot0": True, "final": False}),
    ("kda_prefill", {"mode": "none", "final": False, "gate": "log"}),
    ("kda_prefill", {"mode": "none", "final": True, "checkpoint_every": 2}),
    ("kda_prefill", {"mode": "dense", "checkpoint_every": 2, "cu_dtype": torch.int64,
                     "state_dtype": torch.bfloat16, "dtype": torch.bfloat16}),
    ("kda_prefill", {"varlen": False, "lens": (4, 4), "mode": "dense"}),
    ("fused_kda_decode", {}),
    ("fused_kda_decode", {"gate": "bounded", "slot_mode": "padded", "dtype": torch.bfloat16,
                          "conv_dtype": torch.float32}),
    ("fused_kda_decode", {"gate": "log", "slot_mode": "repeated", "state_dtype": torch.bfloat16,
                          "null_slot0": True}),
    ("kda_verify", {}),
    ("kda_verify", {"gate": "bounded", "accepted": False, "dtype": torch.bfloat16, "state_dtype": torch.bfloat16}),
    ("kda_verify", {"gate": "log", "null_slot0": True, "beta_is_logit": False, "H": 4, "HV": 4, "K": 6, "V": 6}),
    ("kda_verify", {"lens": (1, 1, 1), "accepted": False}),                  # T_max = 1: served by kda_decode
    ("kda_verify", {"initial": True, "accepted": False}),
    ("kda_verify", {"step_rows": True}),
    ("kda_verify", {"step_rows": True, "initial": True, "accepted": False, "gate": "bounded",
                    "dtype": torch.bfloat16, "state_dtype": torch.bfloat16}),
    ("kda_verify", {"step_rows": True, "initial": True, "accepted": False, "null_slot0": True, "lens": (2, 0, 1)}),
    ("kda_verify", {"lens": (1, 1, 1), "initial": True, "accepted": False, "gate": "log"}),  # T_max = 1: verify module
    ("kda_verify", {"tree": True}),                                          # draft trees
    ("kda_verify", {"tree": True, "initial": True, "accepted": False, "gate": "bounded",
                    "state_dtype": torch.bfloat16}),
    ("kda_verify", {"tree": True, "step_rows": True, "null_slot0": True, "gate": "log"}),
    ("fused_kda_verify", {}),
    ("fused_kda_verify", {"gate": "log", "accepted": False, "state_dtype": torch.bfloat16, "null_slot0": True}),
    ("fused_kda_verify", {"gate": "bounded", "dtype": torch.bfloat16, "conv_dtype": torch.float32, "extra_len": 0}),
]
IDS = [f"{op}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'base'}" for op, kw in VARIANTS]
