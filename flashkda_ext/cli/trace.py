"""`flashkda-ext trace list | dump`: a thin mapping onto flashkda_ext.trace (the templates, the
facts of a call, the flashinfer-bench Definition); the call is described by meta tensors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Tuple

from .common import FAMILIES, GATES, LOWER_BOUND, first_line, table


def _trace_args(op: str, a) -> Tuple[dict, str]:
    """Public-op arguments as meta tensors for the given const axes (no memory, no device)."""
    import torch

    m = dict(device="meta")
    dt = getattr(torch, a.input_dtype)
    sdt = getattr(torch, a.state_dtype)
    backend = a.backend
    H = a.heads
    HV = a.value_heads or H
    K = a.head_dim_k or a.head_dim
    V = a.head_dim_v or a.head_dim
    rows, slots = a.rows, a.slots
    gate_kw = {"gate": a.gate}
    if a.gate != "log":
        gate_kw.update(A_log=torch.empty(HV, **m), dt_bias=torch.empty(HV * K, **m))
    if a.gate == "bounded":
        gate_kw["lower_bound"] = a.lower_bound
    if op == "kda_decode":
        args = dict(q=torch.empty(rows, H, K, dtype=dt, **m), k=torch.empty(rows, H, K, dtype=dt, **m),
                    v=torch.empty(rows, HV, V, dtype=dt, **m), g=torch.empty(rows, HV, K, dtype=dt, **m),
                    beta=torch.empty(rows, HV, dtype=dt, **m), state=torch.empty(slots, HV, V, K, dtype=sdt, **m),
                    state_indices=torch.empty(rows, dtype=torch.int32, **m), slot_mode=a.slot_mode, **gate_kw)
    elif op == "fused_kda_decode":
        D = a.head_dim
        C = 3 * H * D
        gate_kw = {"gate": a.gate}
        A_log = None if a.gate == "log" else torch.empty(H, **m)
        dt_bias = None if a.gate == "log" else torch.empty(H * D, **m)
        if a.gate == "bounded":
            gate_kw["lower_bound"] = a.lower_bound
        args = dict(x=torch.empty(rows, C, dtype=dt, **m), conv_weight=torch.empty(C, 4, dtype=dt, **m),
                    conv_state=torch.empty(slots, C, 3, dtype=dt, **m), g=torch.empty(rows, H, D, dtype=dt, **m),
                    beta=torch.empty(rows, H, dtype=dt, **m), A_log=A_log, dt_bias=dt_bias,
                    state_indices=torch.empty(rows, dtype=torch.int32, **m),
                    state=torch.empty(slots, H, D, D, dtype=sdt, **m), output_gate=torch.empty(rows, H, D, dtype=dt, **m),
                    norm_weight=torch.empty(D, **m), slot_mode=a.slot_mode, **gate_kw)
    else:
        T, N = a.tokens, a.seqs
        args = dict(q=torch.empty(1, T, H, K, dtype=dt, **m), k=torch.empty(1, T, H, K, dtype=dt, **m),
                    v=torch.empty(1, T, HV, V, dtype=dt, **m), g=torch.empty(1, T, HV, K, dtype=dt, **m),
                    beta=torch.empty(1, T, HV, dtype=dt, **m), cu_seqlens=torch.empty(N + 1, dtype=torch.int32, **m),
                    initial_state=torch.empty(N, HV, V, K, dtype=sdt, **m), checkpoint_every=a.checkpoint_every,
                    **gate_kw)
    return args, backend


def cmd_trace(args) -> int:
    from .. import trace

    if not args.trace_cmd:
        args.parser.print_help()
        return 0
    if args.trace_cmd == "list":
        rows = []
        for op in trace.OPS:
            try:
                t = trace.load_template(op)
            except Exception as e:  # noqa: BLE001
                rows.append([op, "-", "-", f"template error: {first_line(e)}"])
                continue
            const = [a for a, s in t["axes"].items() if s["type"] == "const"]
            var = [a for a, s in t["axes"].items() if s["type"] == "var"]
            rows.append([op, t.get("op_type", "-"), ",".join(const), ",".join(var)])
        print(table(rows, ["op", "op_type", "const axes", "var axes"]))
        print(f"\ntemplates: {trace.paths.trace_templates_dir()}; "
              f"dump one with `flashkda-ext trace dump OP --heads H ...`")
        return 0
    op = args.op
    call_args, backend = _trace_args(op, args)
    f = trace.args_facts(op, call_args, backend)
    definition = trace.build_definition(op, f)
    if args.check:
        trace.validate_definition(definition)
    text = json.dumps(definition, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out} ({definition['name']})")
    else:
        print(text)
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("trace", help="list trace templates or dump a definition")
    tsub = s.add_subparsers(dest="trace_cmd")
    tsub.add_parser("list", help="the templates and their axes")
    d = tsub.add_parser("dump", help="the flashinfer-bench Definition for given const axes")
    d.add_argument("op", choices=list(FAMILIES), help="the op whose Definition to write")
    d.add_argument("--heads", type=int, default=16, help="H (q/k heads)")
    d.add_argument("--value-heads", type=int, default=None, help="HV (default H)")
    d.add_argument("--head-dim", type=int, default=128, help="K = V = D")
    d.add_argument("--head-dim-k", type=int, default=None, help="K when it differs from V (default --head-dim)")
    d.add_argument("--head-dim-v", type=int, default=None, help="V when it differs from K (default --head-dim)")
    d.add_argument("--input-dtype", default="bfloat16", help="q/k/v/g/beta dtype (default bfloat16)")
    d.add_argument("--state-dtype", default="float32", help="recurrent state dtype (default float32)")
    d.add_argument("--gate", default="softplus", choices=list(GATES), help="gate form (default softplus)")
    d.add_argument("--lower-bound", type=float, default=LOWER_BOUND, help="the bounded gate's lower bound")
    d.add_argument("--slot-mode", default="unique", choices=["unique", "padded", "repeated"],
                   help="decode: how state_indices address the pool (default unique)")
    d.add_argument("--backend", default="cuda", choices=["cuda", "cpu"], help="backend the call targets")
    d.add_argument("--rows", type=int, default=4, help="a var-axis value (does not change the definition)")
    d.add_argument("--slots", type=int, default=64, help="decode: state pool slots (a var axis)")
    d.add_argument("--tokens", type=int, default=256, help="prefill: total tokens")
    d.add_argument("--seqs", type=int, default=2, help="prefill: sequences")
    d.add_argument("--checkpoint-every", type=int, default=0,
                   help="prefill: state checkpoint interval in tokens (0: none)")
    d.add_argument("--check", action="store_true", help="validate against the definition schema")
    d.add_argument("--out", default=None, help="write to this file")
    s.set_defaults(run=cmd_trace, parser=s)
