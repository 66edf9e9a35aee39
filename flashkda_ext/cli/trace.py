"""`flashkda-ext trace list | dump`: a thin mapping onto flashkda_ext.trace (the templates, and
trace.definition_for_options for the flashinfer-bench Definition of the dump's options)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..trace.options import _flag
from .common import GATES, LOWER_BOUND, first_line, out_file_problem, table


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
    try:
        _check_out(args.out)
        options = _with_defaults(op, vars(args))
        definition = trace.definition_for_options(op, options)
    except ValueError as e:
        print(f"flashkda-ext trace dump: {e}", file=sys.stderr)
        return 2
    if args.check:
        trace.validate_definition(definition)
    text = json.dumps(definition, indent=2)
    if args.out is not None:
        try:
            Path(args.out).write_text(text + "\n")
        except OSError as e:         # checked above; still refused (no permission, a full disk) without a traceback
            print(f"flashkda-ext trace dump: --out: cannot write {args.out!r} ({e.strerror or e})", file=sys.stderr)
            return 2
        print(f"wrote {args.out} ({definition['name']})")
    else:
        print(text)
    return 0


_DECODE, _VERIFY = ("kda_decode", "fused_kda_decode"), ("kda_verify", "fused_kda_verify")
# options that have no place in some ops' definitions (e.g. fused ops have one head count and one head
# dim): given there, they are refused by name, not dropped in silence (a fused --value-heads 32 printed
# the 16-head definition); with their defaults, given to the ops that take them
_NOT_FOR = {"value_heads": ("fused_kda_decode", "fused_kda_verify"),
            "head_dim_k": ("fused_kda_decode", "fused_kda_verify"),
            "head_dim_v": ("fused_kda_decode", "fused_kda_verify"),
            "slot_mode": ("kda_prefill",) + _VERIFY, "checkpoint_every": _DECODE + _VERIFY,
            "rows": ("kda_prefill",) + _VERIFY, "slots": ("kda_prefill",), "tokens": _DECODE, "seqs": _DECODE}
_DEFAULTS = {"slot_mode": "unique", "checkpoint_every": 0, "rows": 4, "slots": 64, "tokens": 256, "seqs": 2,
             "lower_bound": LOWER_BOUND}


def _with_defaults(op: str, options: dict) -> dict:
    """The dump's options with the defaults filled in; ValueError naming an option the op has no use for."""
    for key, ops in _NOT_FOR.items():
        if op in ops and options.get(key) is not None:
            raise ValueError(f"{_flag(key)}: {op} takes no {_flag(key)} (its definition does not depend on it)")
    if options.get("lower_bound") is not None and options["gate"] != "bounded":
        raise ValueError(f"--lower-bound: only the bounded gate has one (add --gate bounded), not {options['gate']}")
    return {**options, **{k: v for k, v in _DEFAULTS.items() if options.get(k) is None}}


def _check_out(out) -> None:
    """--out: a file to write, in a directory that exists (checked before anything is built or written)."""
    problem = None if out is None else out_file_problem("--out", out)
    if problem:
        raise ValueError(problem)

def add_parser(sub) -> None:
    s = sub.add_parser("trace", help="list trace templates or dump a definition")
    tsub = s.add_subparsers(dest="trace_cmd")
    tsub.add_parser("list", help="the templates and their axes")
    d = tsub.add_parser("dump", help="the flashinfer-bench Definition for given const axes")
    from ..trace import OPS            # every op with a trace template
    d.add_argument("op", choices=list(OPS), help="the op whose Definition to write")
    d.add_argument("--heads", type=int, default=16, help="H (q/k heads)")
    d.add_argument("--value-heads", type=int, default=None, help="HV (default H)")
    d.add_argument("--head-dim", type=int, default=128, help="K = V = D")
    d.add_argument("--head-dim-k", type=int, default=None, help="K when it differs from V (default --head-dim)")
    d.add_argument("--head-dim-v", type=int, default=None, help="V when it differs from K (default --head-dim)")
    d.add_argument("--input-dtype", default="bfloat16", help="q/k/v/g/beta dtype (default bfloat16)")
    d.add_argument("--state-dtype", default="float32", help="recurrent state dtype (default float32)")
    d.add_argument("--gate", default="softplus", choices=list(GATES), help="gate form (default softplus)")
    d.add_argument("--lower-bound", type=float, default=None,
                   help=f"the bounded gate's lower bound (default {LOWER_BOUND})")
    d.add_argument("--slot-mode", default=None, choices=["unique", "padded", "repeated"],
                   help="decode: how state_indices address the pool (default unique)")
    d.add_argument("--backend", default="cuda", choices=["cuda", "cpu"], help="backend the call targets")
    d.add_argument("--rows", type=int, default=None,
                   help="decode: rows, a var axis (default 4; does not change the definition)")
    d.add_argument("--slots", type=int, default=None,
                   help="decode, verify: state pool slots (a var axis; default 64)")
    d.add_argument("--tokens", type=int, default=None, help="prefill, verify: total tokens (default 256)")
    d.add_argument("--seqs", type=int, default=None,
                   help="prefill: sequences; verify: requests (T_max = ceil(tokens / seqs); default 2)")
    d.add_argument("--step-rows", action="store_true",
                   help="kda_verify: state as step rows [slots, T_max, HV, V, K], state_indices [seqs] (a row each)")
    d.add_argument("--initial-slots", type=int, default=0,
                   help="kda_verify: slots of a read-only start pool initial_state (0: none; then no "
                        "num_accepted_tokens)")
    d.add_argument("--tree", action="store_true",
                   help="kda_verify: a draft tree, parent_tokens [seqs, T_max] (the token each draft token "
                        "continues from)")
    d.add_argument("--checkpoint-every", type=int, default=None,
                   help="prefill: state checkpoint interval in tokens (0: none)")
    d.add_argument("--check", action="store_true", help="validate against the definition schema")
    d.add_argument("--out", default=None, help="write to this file")
    s.set_defaults(run=cmd_trace, parser=s)
