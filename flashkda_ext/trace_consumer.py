"""flashinfer-bench glue for flashkda_ext traces: only what flashinfer-bench itself does not do.

flashinfer-bench reads a trace directory (``TraceSet.from_path``), builds and runs a definition's
reference, draws random inputs, loads the stored index tensors and checks or benchmarks a Solution
(``DefaultEvaluator``, ``Benchmark``). This module adds:

* ``safe_eval`` / ``check_call``: evaluate a definition's constraints (flashinfer-bench stores
  them but never evaluates them) with a restricted evaluator (names, constants, arithmetic,
  comparisons, boolean logic, tuples; no calls, attributes or subscripts: a constraint string
  cannot run code);
* ``index_tensors`` / ``make_workload``: valid state_indices / cu_seqlens for chosen var axes, from
  the definition's ``domain:`` tags, stored through flashinfer-bench's own blob API (its random
  generator draws int32 in [-1024, 1024), which are no slot indices or offsets);
* ``solution``: a flashinfer-bench Python Solution that runs a definition through flashkda_ext's
  public op (``call_op`` maps the definition's inputs and fixed properties to the op's arguments).

    python -m flashkda_ext.trace_consumer TRACE_DIR     # load with flashinfer-bench, check constraints
"""
from __future__ import annotations

import argparse
import ast
import functools
import itertools
import numbers
import operator
import re
import sys
from typing import Any, Dict, List, Mapping, Optional

# ---------------------------------------------------------------------------------------------
# restricted evaluation

_ALLOWED_NODES = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.Div,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn,
    ast.Is, ast.IsNot, ast.Name, ast.Load, ast.Constant, ast.Tuple, ast.List, ast.IfExp,
)


_ARITH = {"Add": operator.add, "Sub": operator.sub, "Mult": operator.mul, "FloorDiv": operator.floordiv,
          "Mod": operator.mod, "Div": operator.truediv}
_GUARD = "__fkda_arith__"    # the checked arithmetic every BinOp becomes (no constraint can name it: see safe_eval)


def _arith(op, a, b):
    """`a op b` for numbers only, checked on the evaluated operands: 'x' * 10**9 or (1,) * 10**9 would be a
    memory bomb, not a constraint, whatever expression ('x' or 1, a conditional, a name) produced them."""
    for x in (a, b):
        if not isinstance(x, numbers.Number):
            raise TypeError(f"arithmetic on strings or sequences is not allowed (got {type(x).__name__})")
    return _ARITH[op](a, b)


class _CheckedArithmetic(ast.NodeTransformer):
    def visit_BinOp(self, node):
        self.generic_visit(node)
        call = ast.Call(func=ast.Name(id=_GUARD, ctx=ast.Load()),
                        args=[ast.Constant(value=type(node.op).__name__), node.left, node.right], keywords=[])
        return ast.copy_location(call, node)


@functools.lru_cache(maxsize=4096)
def _compile(expr: str):
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not a valid expression ({type(e).__name__}: {e})") from None
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError(f"{type(node).__name__} is not allowed "
                             f"(only names, constants, arithmetic, comparisons and boolean logic)")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str, bool, type(None))):
            raise ValueError(f"constant {node.value!r} is not allowed")
        if isinstance(node, ast.BinOp) and any(
                isinstance(x, (ast.Tuple, ast.List)) or (isinstance(x, ast.Constant) and isinstance(x.value, str))
                for x in (node.left, node.right)):
            # refused early where it is plain to see; _arith checks every operand as evaluated
            raise ValueError("arithmetic on strings or sequences is not allowed")
        if isinstance(node, ast.Name):
            names.add(node.id)
    if _GUARD in names:
        raise ValueError(f"the name {_GUARD!r} is reserved")
    tree = ast.fix_missing_locations(_CheckedArithmetic().visit(tree))
    try:
        code = compile(tree, "<constraint>", "eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not a valid expression ({type(e).__name__}: {e})") from None
    return code, frozenset(names)


def _evaluate(expr: str, names: Mapping[str, Any], what: str) -> Any:
    if not isinstance(expr, str):
        raise TypeError(f"{what}: expected a str, got {type(expr).__name__}")
    try:
        code, used = _compile(expr)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    missing = sorted(n for n in used if n not in names)
    if missing:
        raise ValueError(f"{what}: unknown name(s) {missing}")
    local = {n: names[n] for n in used}
    try:
        return eval(code, {"__builtins__": {}, _GUARD: _arith}, local)  # noqa: S307 - checked above
    except (ArithmeticError, TypeError, ValueError, RecursionError, MemoryError) as e:
        # 1/0, 'a' < 1, 'x' * n: the expression cannot be evaluated over these values
        raise ValueError(f"{what}: cannot be evaluated ({type(e).__name__}: {e})") from None


def safe_eval(expr: str, names: Mapping[str, Any]) -> Any:
    """Evaluate `expr` over `names` only; unknown names raise ValueError, no builtins exist, and an
    expression that cannot be evaluated (division by zero, comparing a str with an int, arithmetic on
    anything but numbers) raises ValueError naming it."""
    return _evaluate(expr, names, f"expression {expr!r}")


# ---------------------------------------------------------------------------------------------
# constraints


def _as_dict(definition) -> Dict[str, Any]:
    """A definition as its JSON dict: given as one, or as a flashinfer-bench Definition."""
    return definition if isinstance(definition, Mapping) else definition.model_dump(mode="json")


def check_call(definition, var_axes: Mapping[str, int]) -> List[str]:
    """The constraints a call with these var-axis values violates (empty: the definition accepts
    it). `definition`: a flashinfer-bench Definition or its JSON dict."""
    d = _as_dict(definition)
    values = {}
    for name, ax in d["axes"].items():
        if ax["type"] == "const":
            values[name] = ax["value"]
        elif name in var_axes:
            values[name] = _axis_int(d["name"], name, var_axes[name])
        else:
            raise ValueError(f"{d['name']}: no value for var axis {name!r}")
    return [c for c in d.get("constraints") or []
            if not _evaluate(c, values, f"{d['name']}: constraint {c!r}")]


def _axis_int(definition_name: str, axis: str, value) -> int:
    """A var axis's value: an int >= 0 (numpy's too; an axis is a tensor dimension), not a bool, a float (2.7 is
    no row count), a str or a negative int (torch's own error for the tensors drawn from it names no axis)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{definition_name}: var axis {axis!r}: expected an int, got "
                         f"{type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{definition_name}: var axis {axis!r}: expected an int >= 0 (a dimension), got {value}")
    return int(value)


def _option_int(name: str, value, low: int = 0) -> int:
    """An integer option of the consumer (seed, checkpoint_every): an int >= low, not a bool, a float or a str
    (int() would truncate 2.7 or read '4'; torch's manual_seed refuses a float naming no argument)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value}")
    return int(value)


# ---------------------------------------------------------------------------------------------
# index inputs

_TAG_DOMAIN = re.compile(r"^domain:(\w+)=(\w+)(?:\(([\w,]+)\))?$")   # kind(axis[,axis])


def _tags(definition) -> List[str]:
    return list(_as_dict(definition).get("tags") or [])


def _tag_value(definition, prefix: str, default: Optional[str] = None) -> Optional[str]:
    return next((t[len(prefix):] for t in _tags(definition) if t.startswith(prefix)), default)


def domains(definition) -> Dict[str, tuple]:
    out = {}
    for tag in _tags(definition):
        m = _TAG_DOMAIN.match(tag)
        if m:
            out[m.group(1)] = (m.group(2), m.group(3))
        elif isinstance(tag, str) and tag.startswith("domain:"):
            # a hand-edited tag (tree_parents(-1)) was dropped silently: its input was then never drawn
            raise ValueError(f"{_as_dict(definition).get('name')}: tag {tag!r}: expected "
                             f"domain:<input>=<kind> or domain:<input>=<kind>(<axis>[,<axis>])")
    return out


def _check_tree(d: Mapping[str, Any], name: str, arg: Optional[str]) -> None:
    """A tree_parents domain must describe kda_verify's parent_tokens as the op takes it: int32 [N, T_max], T_max
    the slot table's columns (a step row's steps); else the drawn table has another shape or dtype than the
    definition's (bool: every parent 0 / 1), or a bare KeyError names nothing."""
    tag = f"domain:{name}={'tree_parents' if arg is None else f'tree_parents({arg})'}"
    op = _tag_value(d, "op:")
    if op != "kda_verify":
        raise ValueError(f"{d['name']}: tag {tag!r}: tree_parents is kda_verify's domain, not {op!r}'s")
    spec = d["inputs"].get(name)
    if spec is None:
        raise ValueError(f"{d['name']}: tag {tag!r} names input {name!r}, which the definition does not have")
    si = (d["inputs"].get("state_indices") or {}).get("shape") or []
    state = (d["inputs"].get("state") or {}).get("shape") or []
    cols = si[1] if len(si) == 2 else (state[1] if len(si) == 1 and len(state) == 5 else None)
    if cols is None or arg != cols:
        raise ValueError(f"{d['name']}: tag {tag!r}: expected tree_parents({cols}), the axis of state_indices' "
                         f"T_max")
    if spec.get("shape") != [si[0], cols]:
        raise ValueError(f"{d['name']}: input {name}: expected shape {[si[0], cols]} ([N, T_max] as state_indices), "
                         f"got {spec.get('shape')}")
    if spec.get("dtype") != "int32":
        raise ValueError(f"{d['name']}: input {name}: expected dtype 'int32' (the op's), got {spec.get('dtype')!r}")


def _slot_indices(n: int, slots: int, slot_mode: str, null_slot0: bool, gen):
    import torch
    first = 1 if null_slot0 else 0
    live = max(slots - first, 0)
    if slot_mode == "repeated" and live > 0:
        idx = torch.randint(first, slots, (n,), generator=gen)
    else:
        perm = torch.randperm(live, generator=gen)[:n] + first
        idx = torch.full((n,), -1, dtype=torch.int64)
        idx[: perm.numel()] = perm
        if slot_mode == "padded" and n > 1:
            idx[torch.randperm(n, generator=gen)[: max(1, n // 4)]] = -1
    return idx.to(torch.int32)


def _offsets(n_plus_1: int, total: int, dtype, gen, longest: Optional[int] = None):
    """Random non-decreasing offsets from 0 to total; with `longest`, no sequence longer (a few
    random draws, then the even split, which fits whenever any split does)."""
    import torch
    for _ in range(20):
        cuts = torch.sort(torch.randint(0, total + 1, (max(n_plus_1 - 2, 0),), generator=gen)).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([total])])
        if longest is None or int(torch.diff(offsets).max()) <= longest:
            return offsets.to(dtype)
    n = max(n_plus_1 - 1, 1)
    return torch.tensor([i * total // n for i in range(n + 1)]).to(dtype)


def _draft_slots(n: int, cols: int, slots: int, null_slot0: bool, gen):
    """A verify table [n, cols]: distinct slots everywhere (so every stored slot is distinct and no
    request reads a slot another stores), about a quarter padding (-1), -1 where the pool runs out."""
    import torch
    first = 1 if null_slot0 else 0
    flat = torch.full((n * cols,), -1, dtype=torch.int64)
    perm = torch.randperm(max(slots - first, 0), generator=gen)[: n * cols] + first
    flat[: perm.numel()] = perm
    flat[torch.randperm(n * cols, generator=gen)[: (n * cols) // 4]] = -1
    return flat.reshape(n, cols).to(torch.int32)


def _draft_offsets(n_plus_1: int, total: int, longest: int, dtype, gen):
    """Offsets from 0 to total of n = n_plus_1 - 1 requests of 1 .. longest tokens each, or, with fewer tokens
    than requests (the verify constraints allow 1 <= total <= n * longest; a request may be empty), one token
    each for `total` random requests and none for the others."""
    import torch
    n = n_plus_1 - 1
    if total < n:
        lengths = [0] * n
        for r in torch.randperm(n, generator=gen)[:total].tolist():
            lengths[r] = 1
        return torch.tensor([0] + list(itertools.accumulate(lengths))).to(dtype)
    lengths = [1] * n
    room = [i for i in range(n) for _ in range(longest - 1)]   # one entry per token a request may add
    for j in torch.randperm(len(room), generator=gen)[: total - n].tolist():
        lengths[room[j]] += 1
    offsets = [0]
    for x in lengths:
        offsets.append(offsets[-1] + x)
    return torch.tensor(offsets).to(dtype)


def _tree_parents(drawn: Dict[str, Any], n: int, cols: int, null_slot0: bool, gen):
    """kda_verify's parent_tokens [n, cols] for the indices drawn so far (drawn: by input name): token
    t >= 1 of a request takes a uniform parent among its tokens before t whose state is stored (a live
    state_indices entry; a step row's tokens are all live or all padding). A request of >= 2 tokens
    whose token 0 stores nowhere has no such parent for token 1, so it is made padding (it reads column
    0, or no start slot), which any earlier token fits, and keeps the chain t - 1. Entries never read
    (column 0, tokens past a request's length) hold the chain's t - 1 too."""
    import torch
    pad = lambda s: s < 0 or (null_slot0 and s == 0)  # noqa: E731
    table = drawn["state_indices"].tolist()
    if drawn["state_indices"].dim() == 1:             # step rows: one row per request
        table = [[row] * cols for row in table]
    offsets = drawn["cu_seqlens"].tolist() if "cu_seqlens" in drawn else [i * cols for i in range(n + 1)]
    parents = torch.arange(-1, cols - 1).repeat(n, 1)
    for r, entries in enumerate(table):
        length = offsets[r + 1] - offsets[r]
        if length >= 2 and pad(entries[0]):            # token 1 has no stored token before it
            if "initial_state_indices" in drawn:
                drawn["initial_state_indices"][r] = -1
            elif "num_accepted_tokens" in drawn:
                drawn["num_accepted_tokens"][r] = 1
            continue
        stored = [t for t in range(length) if not pad(entries[t])]
        for t in range(1, length):
            before = [p for p in stored if p < t]
            parents[r, t] = before[int(torch.randint(len(before), (1,), generator=gen))]
    return parents


def index_tensors(definition, axes: Mapping[str, int], *, seed: int = 0,
                  checkpoint_every: int = 0) -> Dict[str, Any]:
    """Valid index inputs (those with a slot_index or offsets domain tag) for var-axis values
    `axes`: distinct slots (unique), some -1 (padded) or shared slots (repeated); offsets from 0 to
    seq_len, non-decreasing, and with checkpoints no sequence reaching more than num_checkpoints
    (a bound on index values that no constraint over axes can state); for verify: a slot table with
    distinct entries (draft_slots), offsets of 1 .. max_draft tokens per request (draft_offsets),
    accepted counts in [1, max_draft] (accepted_count), and kda_verify's draft tree (tree_parents: drawn
    last, from the tables and offsets above, see _tree_parents)."""
    import torch
    d = _as_dict(definition)
    checkpoint_every = _option_int("checkpoint_every", checkpoint_every)
    seed = _option_int("seed", seed, -(2 ** 63))
    violated = check_call(d, axes)   # names a missing var axis; indices for axes the definition refuses are none
    if violated:
        raise ValueError(f"axes: {dict(axes)} violate {d['name']}'s constraints {violated}")
    values = {a: (ax["value"] if ax["type"] == "const" else _axis_int(d["name"], a, axes[a]))
              for a, ax in d["axes"].items()}
    slot_mode = _tag_value(d, "slot_mode:", "padded")
    null_slot0 = "null_slot0" in _tags(d)
    gen = torch.Generator().manual_seed(seed)
    out, trees = {}, []
    kinds = domains(d)
    for name, (kind, arg) in kinds.items():
        if kind == "tree_parents":
            _check_tree(d, name, arg)
    if "parent_tokens" in d["inputs"] and kinds.get("parent_tokens", ("",))[0] != "tree_parents":
        # without its tag the table was not drawn: make_workload left it to flashinfer-bench's random int32
        raise ValueError(f"{d['name']}: input parent_tokens has no domain:parent_tokens=tree_parents(...) tag")
    for name, (kind, arg) in kinds.items():
        if kind == "tree_parents":
            trees.append((name, arg))                 # after the tables and offsets it depends on
            continue
        if kind not in ("slot_index", "offsets", "draft_slots", "draft_offsets", "accepted_count"):
            continue                                  # data domains (log_decay, probability): not indices
        spec = d["inputs"][name]
        n = values[spec["shape"][0]]
        dtype = getattr(torch, spec["dtype"])
        if kind == "draft_slots":
            out[name] = _draft_slots(n, values[spec["shape"][1]], values[arg], null_slot0, gen).to(dtype)
        elif kind == "draft_offsets":
            total, longest = arg.split(",")
            out[name] = _draft_offsets(n, values[total], values[longest], dtype, gen)
        elif kind == "accepted_count":
            out[name] = torch.randint(1, values[arg] + 1, (n,), generator=gen).to(dtype)
        elif kind == "slot_index":
            live = values[arg] - (1 if null_slot0 else 0)
            if slot_mode == "unique" and n > live:
                # "unique" promises distinct, non-negative slots: the padding _slot_indices would add breaks it
                raise ValueError(f"axes: {spec['shape'][0]} = {n} {name} entries need {n} distinct live slots under "
                                 f"slot_mode 'unique', but {arg} = {values[arg]} has {max(live, 0)}")
            out[name] = _slot_indices(n, values[arg], slot_mode, null_slot0, gen).to(dtype)
        elif kind == "offsets":
            longest = None
            if checkpoint_every and "num_checkpoints" in values:
                longest = (values["num_checkpoints"] + 1) * checkpoint_every - 1
            out[name] = _offsets(n, values[arg], dtype, gen, longest)
    for name, arg in trees:
        spec = d["inputs"][name]
        parents = _tree_parents(out, values[spec["shape"][0]], values[arg], null_slot0, gen)
        out[name] = parents.to(getattr(torch, spec["dtype"]))
    return out


def make_workload(trace_set, definition_name: str, axes: Mapping[str, int], *, seed: int = 0):
    """A flashinfer-bench Workload of the definition at `axes`: its index tensors from
    index_tensors(), stored with TraceSet.add_workload_blob_tensor; every other tensor random,
    scalars as given in `axes` (scalar inputs are looked up there by name)."""
    import uuid
    from flashinfer_bench.data import Workload
    definition = trace_set.definitions[definition_name]
    d = definition.model_dump(mode="json")
    missing = [n for n in definition.var_axes if n not in axes]
    missing += [n for n, spec in d["inputs"].items() if spec["shape"] is None and n not in axes]
    if missing:
        raise ValueError(f"axes: {definition_name} needs values for {missing} (var axes and scalar inputs)")
    var = {a: _axis_int(definition_name, a, axes[a]) for a in definition.var_axes}
    tensors = index_tensors(d, var, seed=seed, checkpoint_every=axes.get("checkpoint_every", 0))  # checks the axes
    uid = str(uuid.uuid4())
    inputs: Dict[str, Any] = {}
    if tensors:
        path = trace_set.add_workload_blob_tensor(definition_name, uid, tensors)
        inputs.update({n: {"type": "safetensors", "path": path, "tensor_key": n} for n in tensors})
    for name, spec in d["inputs"].items():
        if name in inputs:
            continue
        inputs[name] = {"type": "scalar", "value": axes[name]} if spec["shape"] is None else {"type": "random"}
    return Workload(axes=var, inputs=inputs, uuid=uid)


# ---------------------------------------------------------------------------------------------
# a flashkda_ext Solution


def op_spec(definition) -> Dict[str, Any]:
    """The public op and its fixed (non-data) arguments for a definition, read from its tags."""
    d = _as_dict(definition)
    tags = set(_tags(d))
    op = _tag_value(d, "op:")
    if op is None:
        raise ValueError(f"{d['name']}: no op: tag; not a flashkda_ext definition")
    from .trace.templates import OPS
    if op not in OPS:  # else a Solution is built for it and fails only when run (call_op's error)
        raise ValueError(f"{d['name']}: op: tag {op!r}; expected one of {', '.join(OPS)}")
    fixed: Dict[str, Any] = {"gate": _tag_value(d, "gate:"), "null_slot0": "null_slot0" in tags}
    if op in ("kda_decode", "fused_kda_decode"):
        fixed["slot_mode"] = _tag_value(d, "slot_mode:")
    if op in ("kda_decode", "kda_prefill", "kda_verify"):
        fixed["beta_is_logit"] = "domain:beta=probability" not in tags
    if op == "kda_prefill":
        fixed["output_final_state"] = "nofinal" not in tags and _tag_value(d, "state_mode:") != "none"
    return {"op": op, "fixed": fixed, "inputs": list(d["inputs"]), "outputs": list(d["outputs"])}


def call_op(spec: Mapping[str, Any], kw: Mapping[str, Any]):
    """Run the definition's inputs `kw` through flashkda_ext's op; returns its outputs in the
    definition's order (in-place outputs are the updated input tensors)."""
    import flashkda_ext
    op, fixed = spec["op"], spec["fixed"]
    # exactly the definition's inputs: a missing one was read as None (an optional argument left out, or a bare
    # KeyError), an extra one (A_log beside a definition without it) was handed to the op and served
    missing = [n for n in spec["inputs"] if n not in kw]
    extra = [n for n in kw if n not in spec["inputs"]]
    if missing or extra:
        raise ValueError(f"{op}: expected the definition's inputs {list(spec['inputs'])}; missing {missing}, "
                         f"unexpected {extra}")
    gate = dict(A_log=kw.get("A_log"), dt_bias=kw.get("dt_bias"), lower_bound=kw.get("lower_bound"),
                gate=fixed["gate"], scale=kw["scale"], null_slot0=fixed["null_slot0"])
    qkvgb = tuple(kw[n] for n in ("q", "k", "v", "g", "beta")) if "q" in kw else ()  # the unfused ops' lead
    if op in ("fused_kda_decode", "fused_kda_verify"):
        gate.pop("A_log"), gate.pop("dt_bias")   # positional in the fused ops
        lead = (kw["x"], kw["conv_weight"], kw["conv_state"], kw["g"], kw["beta"], kw.get("A_log"), kw.get("dt_bias"))
        if op == "fused_kda_decode":
            out = flashkda_ext.fused_kda_decode(*lead, kw["state_indices"], kw["state"], kw["output_gate"],
                                                kw["norm_weight"], norm_eps=kw["norm_eps"],
                                                slot_mode=fixed["slot_mode"], **gate)
        else:
            out = flashkda_ext.fused_kda_verify(*lead, kw["state"], kw["output_gate"], kw["norm_weight"],
                                                state_indices=kw["state_indices"], cu_seqlens=kw["cu_seqlens"],
                                                num_accepted_tokens=kw.get("num_accepted_tokens"),
                                                norm_eps=kw["norm_eps"], **gate)
        results = {"out": out, "conv_state_out": kw["conv_state"], "state_out": kw["state"]}
    elif op == "kda_decode":
        out = flashkda_ext.kda_decode(*qkvgb, state=kw["state"], state_indices=kw["state_indices"],
                                      beta_is_logit=fixed["beta_is_logit"], slot_mode=fixed["slot_mode"], **gate)
        results = {"out": out, "state_out": kw["state"]}
    elif op == "kda_verify":
        out = flashkda_ext.kda_verify(*qkvgb, state=kw["state"], state_indices=kw["state_indices"],
                                      cu_seqlens=kw["cu_seqlens"], num_accepted_tokens=kw.get("num_accepted_tokens"),
                                      beta_is_logit=fixed["beta_is_logit"], initial_state=kw.get("initial_state"),
                                      initial_state_indices=kw.get("initial_state_indices"),
                                      parent_tokens=kw.get("parent_tokens"), **gate)
        results = {"out": out, "state_out": kw["state"]}
    elif op == "kda_prefill":
        every = kw.get("checkpoint_every", 0)   # as given: the op refuses 2.7 / '2' / True, which int() read as 2 / 2 / 1
        res = flashkda_ext.kda_prefill(
            *qkvgb, beta_is_logit=fixed["beta_is_logit"],
            cu_seqlens=kw.get("cu_seqlens"), initial_state=kw.get("initial_state"), state=kw.get("state"),
            state_indices=kw.get("state_indices"), output_final_state=fixed["output_final_state"],
            final_state=kw.get("final_state"), checkpoint_every=every, checkpoints=kw.get("checkpoints"), **gate)
        results = {"out": res[0], "final_state_out": res[1], "state_out": res[1]}
        if every:
            results["checkpoints_out"] = res[2]
    else:
        raise ValueError(f"op: expected one of kda_decode, kda_prefill, fused_kda_decode, kda_verify, "
                         f"fused_kda_verify, got {op!r}")
    outs = tuple(results[name] for name in spec["outputs"])
    return outs[0] if len(outs) == 1 else outs


def solution_source(definition) -> str:
    spec = op_spec(definition)
    params = ", ".join(spec["inputs"])
    kwargs = ", ".join(f"{n}={n}" for n in spec["inputs"])
    return (f"# flashkda_ext's {spec['op']} for {_as_dict(definition)['name']} (generated by "
            f"flashkda_ext.trace_consumer.solution)\n"
            f"from flashkda_ext.trace_consumer import call_op\n\n"
            f"SPEC = {spec!r}\n\n\n"
            f"def run({params}):\n    return call_op(SPEC, dict({kwargs}))\n")


def solution(definition, *, target: str = "cuda", name: Optional[str] = None):
    """A flashinfer-bench Solution (Python, value-returning) running the definition through
    flashkda_ext's public op; `target` is its target_hardware entry."""
    from flashinfer_bench.data import BuildSpec, Solution, SourceFile, SupportedLanguages
    d = _as_dict(definition)
    return Solution(
        name=name or f"{d['name']}__flashkda_ext", definition=d["name"], author="flashkda_ext",
        spec=BuildSpec(language=SupportedLanguages.PYTHON, target_hardware=[target], entry_point="main.py::run",
                       dependencies=["flashkda_ext"], destination_passing_style=False),
        sources=[SourceFile(path="main.py", content=solution_source(d))],
        description=f"flashkda_ext.{op_spec(d)['op']} (the public op, in place where the op is)")


# ---------------------------------------------------------------------------------------------


def _line(e: BaseException) -> str:
    """An error in one line: pydantic's first error (where, what), else the message's first line."""
    try:
        first = e.errors()[0]    # pydantic's ValidationError
        where = ".".join(str(x) for x in first.get("loc", ()))
        return f"{type(e).__name__}: {where + ': ' if where else ''}{first['msg']}"
    except Exception:  # noqa: BLE001 - not a pydantic error
        pass
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _unreadable(root) -> Optional[str]:
    """The first file of a trace directory flashinfer-bench cannot read, and why ('path:line: error'), read as
    TraceSet.from_path reads it (its own error names no file)."""
    from pathlib import Path
    from flashinfer_bench.data import Definition, Solution, Trace
    for sub, model, pattern, workload in (("definitions", Definition, "*.json", None),
                                          ("solutions", Solution, "*.json", None),
                                          ("workloads", Trace, "*.jsonl", True), ("traces", Trace, "*.jsonl", False)):
        for p in sorted((Path(root) / sub).rglob(pattern)):
            try:
                text = p.read_text()
            except (OSError, UnicodeDecodeError) as e:
                return f"{p}: {_line(e)}"
            lines = text.splitlines() if workload is not None else [text]
            for i, line in enumerate(lines, 1):
                if workload is not None and not line.strip():
                    continue
                where = f"{p}:{i}" if workload is not None else str(p)
                try:
                    item = model.model_validate_json(line)
                except Exception as e:  # noqa: BLE001 - pydantic's ValidationError, a JSON error
                    return f"{where}: {_line(e)}"
                if workload is not None and item.is_workload_trace() != workload:
                    return f"{where}: {'an evaluated trace among workloads' if workload else 'a workload among traces'}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir")
    args = p.parse_args(argv)
    try:
        from flashinfer_bench.data import TraceSet
    except ImportError:
        print("flashinfer-bench is not installed (scripts/install.sh installs it without its GPU stack)",
              file=sys.stderr)
        return 2
    import os
    if not os.path.isdir(args.trace_dir):
        # TraceSet.from_path creates a missing folder and reports it empty: a typo passed as a clean run
        print(f"{args.trace_dir}: not a directory (expected a trace directory with definitions/ and workloads/)",
              file=sys.stderr)
        return 2
    try:
        ts = TraceSet.from_path(args.trace_dir)
    except Exception as e:  # noqa: BLE001 - a pydantic / JSON / assertion traceback naming no file
        print(f"{args.trace_dir}: cannot be loaded by flashinfer-bench: {_unreadable(args.trace_dir) or _line(e)}",
              file=sys.stderr)
        return 2
    bad = 0
    for name, d in sorted(ts.definitions.items()):
        lines = ts.workloads.get(name, [])
        failing = []
        for t in lines:
            try:
                failing.append((t.workload.uuid, check_call(d, t.workload.axes)))
            except (ValueError, TypeError) as e:   # a var axis missing or no int: named, not a traceback
                failing.append((t.workload.uuid, [f"cannot be checked: {e}"]))
        failing = [(u, f) for u, f in failing if f]
        bad += len(failing)
        print(f"{name}: {len(lines)} workload(s), {len(d.constraints)} constraint(s), {len(failing)} violating")
        for u, f in failing:
            print(f"  {u}: violates {f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
