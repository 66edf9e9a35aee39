"""Definitions for given options: what `flashkda-ext trace dump OP` prints (meta tensors built from
the dump's options, problems reported by option name)."""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping

from .. import validation
from .definitions import build_definition, unsupported
from .call_facts import args_facts
from .templates import OPS, validate_definition

# the dump's option for each supported.json key (None: a relation between head counts)
_OPTION = {"input_dtypes": "--input-dtype", "state_dtypes": "--state-dtype", "gates": "--gate",
           "slot_modes": "--slot-mode", "head_dims_k": "--head-dim-k/--head-dim",
           "head_dims_v": "--head-dim-v/--head-dim", "value_heads": "--value-heads/--heads",
           "group_sizes": "--value-heads/--heads", None: "--value-heads/--heads", "A_log": "--gate"}
_DUMP_DTYPES = ("float32", "bfloat16", "float16")     # the floating dtypes flashinfer-bench names


def _option_dtype(option: str, value: str):
    import torch
    if value not in _DUMP_DTYPES:
        raise ValueError(f"{option}: expected one of {', '.join(_DUMP_DTYPES)} "
                         f"(flashinfer-bench dtype names), got {value!r}")
    return getattr(torch, value)


# the size options (each a positive int; value_heads and the head_dim_k/v options default to another)
_SIZES = ("heads", "value_heads", "head_dim", "head_dim_k", "head_dim_v", "rows", "slots", "tokens", "seqs")
_DEFAULTED = ("value_heads", "head_dim_k", "head_dim_v")
_MAX_ELEMENTS = (2 ** 63 - 1) // 8    # a meta tensor's bytes must fit torch's int64 (8: the widest dtype here)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _positive(option: str, value) -> int:
    """A size option: a positive int (validation's int rule: not a bool), ValueError naming it."""
    try:
        validation._int(option, value, "> 0")
    except TypeError as err:
        raise ValueError(str(err)) from None
    if value <= 0:
        raise ValueError(f"{option}: expected a positive integer, got {value}")
    return value


def _as_option(option: str, name: str, rule, *args) -> None:
    """Run an op's validation rule for argument `name`; its refusal names the dump's `option` instead."""
    try:
        rule(*args)
    except (TypeError, ValueError) as err:
        msg = str(err)
        raise ValueError(option + msg[len(name):] if msg.startswith(name + ":") else f"{option}: {msg}") from None


def _option_args(op: str, o: Mapping[str, Any]) -> Dict[str, Any]:
    """Public-op arguments as meta tensors (no memory, no device) for the dump's options."""
    import torch
    m = dict(device="meta")
    dt, sdt = _option_dtype("--input-dtype", o["input_dtype"]), _option_dtype("--state-dtype", o["state_dtype"])
    sizes = {}
    for opt in _SIZES:
        if o.get(opt) is None and opt in _DEFAULTED:       # absent: the option it defaults to
            continue
        sizes[opt] = _positive(_flag(opt), o[opt])
    H, rows, slots = o["heads"], o["rows"], o["slots"]
    HV = o["value_heads"] if o.get("value_heads") is not None else H
    K = o["head_dim_k"] if o.get("head_dim_k") is not None else o["head_dim"]
    V = o["head_dim_v"] if o.get("head_dim_v") is not None else o["head_dim"]
    gate = o["gate"]
    validation._choice("--gate", gate, validation.GATES)
    lower_bound = o["lower_bound"] if gate == "bounded" else None
    _as_option("--lower-bound", "lower_bound", validation._gate_bound, gate, lower_bound)
    _as_option("--checkpoint-every", "checkpoint_every", validation.check_checkpoint_every,
               o.get("checkpoint_every", 0))

    def e(*shape, dtype=torch.float32):
        if math.prod(shape) > _MAX_ELEMENTS:      # torch refuses with a traceback naming no option
            largest = max(sizes, key=lambda opt: sizes[opt])
            raise ValueError(f"{_flag(largest)}: {sizes[largest]} makes a tensor of shape {list(shape)}, more "
                             f"than {_MAX_ELEMENTS} elements (torch's int64 sizes)")
        return torch.empty(*shape, dtype=dtype, **m)
    gate_kw = dict(gate=gate, lower_bound=lower_bound)
    T, N = o["tokens"], o["seqs"]
    for key, option in (("step_rows", "--step-rows"), ("initial_slots", "--initial-slots"), ("tree", "--tree")):
        if o.get(key) and op != "kda_verify":
            raise ValueError(f"{option}: kda_verify's option, not {op}'s")
    if op in ("kda_verify", "fused_kda_verify"):
        if T < N:
            raise ValueError(f"--tokens: expected at least --seqs = {N} tokens (every request has one), got {T}")
        cols = -(-T // N)                # T_max: the fewest columns that hold T tokens in N requests
        verify = dict(state_indices=e(N, cols, dtype=torch.int32), cu_seqlens=e(N + 1, dtype=torch.int32),
                      num_accepted_tokens=e(N, dtype=torch.int32))
    if op == "fused_kda_verify":
        D = o["head_dim"]
        C = 3 * H * D
        return dict(x=e(1, T, C, dtype=dt), conv_weight=e(C, 4, dtype=dt), conv_state=e(slots, C, cols + 2, dtype=dt),
                    g=e(1, T, H, D, dtype=dt), beta=e(1, T, H, dtype=dt),
                    A_log=None if gate == "log" else e(H), dt_bias=None if gate == "log" else e(H * D),
                    state=e(slots, H, D, D, dtype=sdt), output_gate=e(1, T, H, D, dtype=dt), norm_weight=e(D),
                    **verify, **gate_kw)
    if op == "fused_kda_decode":
        D = o["head_dim"]
        C = 3 * H * D
        return dict(x=e(rows, C, dtype=dt), conv_weight=e(C, 4, dtype=dt), conv_state=e(slots, C, 3, dtype=dt),
                    g=e(rows, H, D, dtype=dt), beta=e(rows, H, dtype=dt),
                    A_log=None if gate == "log" else e(H), dt_bias=None if gate == "log" else e(H * D),
                    state_indices=e(rows, dtype=torch.int32), state=e(slots, H, D, D, dtype=sdt),
                    output_gate=e(rows, H, D, dtype=dt), norm_weight=e(D), slot_mode=o["slot_mode"], **gate_kw)
    if gate != "log":
        gate_kw.update(A_log=e(HV), dt_bias=e(HV * K))
    if op == "kda_decode":
        return dict(q=e(rows, H, K, dtype=dt), k=e(rows, H, K, dtype=dt), v=e(rows, HV, V, dtype=dt),
                    g=e(rows, HV, K, dtype=dt), beta=e(rows, HV, dtype=dt), state=e(slots, HV, V, K, dtype=sdt),
                    state_indices=e(rows, dtype=torch.int32), slot_mode=o["slot_mode"], **gate_kw)
    if op == "kda_verify":
        a = dict(q=e(1, T, H, K, dtype=dt), k=e(1, T, H, K, dtype=dt), v=e(1, T, HV, V, dtype=dt),
                 g=e(1, T, HV, K, dtype=dt), beta=e(1, T, HV, dtype=dt), state=e(slots, HV, V, K, dtype=sdt),
                 **verify, **gate_kw)
        if o.get("step_rows"):          # --slots rows of T_max slots, a row per request
            a.update(state=e(slots, cols, HV, V, K, dtype=sdt), state_indices=e(N, dtype=torch.int32))
        initial = int(o.get("initial_slots") or 0)
        if initial < 0:
            raise ValueError(f"--initial-slots: expected 0 (no start pool) or a positive integer, got {initial}")
        if initial:
            a.update(initial_state=e(initial, HV, V, K, dtype=sdt), initial_state_indices=e(N, dtype=torch.int32),
                     num_accepted_tokens=None)
        if o.get("tree"):               # a draft tree: parent_tokens [seqs, T_max]
            a["parent_tokens"] = e(N, cols, dtype=torch.int32)
        return a
    return dict(q=e(1, T, H, K, dtype=dt), k=e(1, T, H, K, dtype=dt), v=e(1, T, HV, V, dtype=dt),
                g=e(1, T, HV, K, dtype=dt), beta=e(1, T, HV, dtype=dt), cu_seqlens=e(N + 1, dtype=torch.int32),
                initial_state=e(N, HV, V, K, dtype=sdt), checkpoint_every=int(o["checkpoint_every"]), **gate_kw)


def definition_for_options(op: str, options: Mapping[str, Any]) -> dict:
    """The definition `flashkda-ext trace dump OP` prints for its options (argparse's names:
    heads, value_heads, head_dim, head_dim_k, head_dim_v, input_dtype, state_dtype, gate,
    lower_bound, slot_mode, backend, rows, slots, tokens, seqs, checkpoint_every; verify ops: seqs
    requests of tokens in all, T_max = ceil(tokens / seqs), with num_accepted_tokens; kda_verify also
    step_rows, initial_slots and tree, read with .get: absent means none). Raises
    ValueError naming the option for a value or combination that has no definition."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {list(OPS)}, got {op!r}")
    args = _option_args(op, options)
    f = args_facts(op, args, options["backend"])
    problems = unsupported(op, f)
    if problems:
        raise ValueError("; ".join(f"{_OPTION.get(key, key)}: {msg}" for key, msg in problems))
    definition = build_definition(op, f)
    validate_definition(definition)
    return definition
