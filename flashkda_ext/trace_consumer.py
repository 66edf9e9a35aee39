"""A trace consumer, the way a graph compiler or kernel-evaluation tool would use flashkda_ext traces.

Standalone on purpose: it imports nothing from flashkda_ext (only json, ast, torch), so it can be
copied out and pointed at any trace directory. It shows the three things a consumer does:

* load a trace directory (``<definition>.json`` files and ``<definition>.workloads.jsonl`` lines);
* check a proposed call against a definition: bind its axes, then evaluate every constraint with a
  restricted evaluator (names, constants, arithmetic, comparisons, boolean logic, tuples; no calls,
  attributes or subscripts, so a constraint string cannot run code);
* regenerate inputs for a workload line: scalars as recorded, safetensors loaded, random tensors
  drawn in the domain the definition's ``domain:`` tags describe (valid slot indices, sorted
  offsets, non-positive log decays), so a replay is a call the op accepts.

    python -m flashkda_ext.trace_consumer TRACE_DIR [--run-reference]
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import re
import struct
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

# ---------------------------------------------------------------------------------------------
# restricted evaluation

_ALLOWED_NODES = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.Div,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn,
    ast.Is, ast.IsNot, ast.Name, ast.Load, ast.Constant, ast.Tuple, ast.List, ast.IfExp,
)


@functools.lru_cache(maxsize=4096)
def _compile(expr: str):
    tree = ast.parse(expr, mode="eval")
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError(f"expression {expr!r}: {type(node).__name__} is not allowed "
                             f"(only names, constants, arithmetic, comparisons and boolean logic)")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str, bool, type(None))):
            raise ValueError(f"expression {expr!r}: constant {node.value!r} is not allowed")
        if isinstance(node, ast.BinOp) and any(
                isinstance(x, (ast.Tuple, ast.List)) or (isinstance(x, ast.Constant) and isinstance(x.value, str))
                for x in (node.left, node.right)):
            # arithmetic is for numbers: 'x' * 10**9 would be a memory bomb, not a constraint
            raise ValueError(f"expression {expr!r}: arithmetic on strings or sequences is not allowed")
        if isinstance(node, ast.Name):
            names.add(node.id)
    return compile(tree, "<constraint>", "eval"), frozenset(names)


def safe_eval(expr: str, names: Mapping[str, Any]) -> Any:
    """Evaluate `expr` over `names` only; unknown names raise ValueError, no builtins exist."""
    code, used = _compile(expr)
    missing = sorted(n for n in used if n not in names)
    if missing:
        raise ValueError(f"expression {expr!r}: unknown name(s) {missing}")
    return eval(code, {"__builtins__": {}}, {n: names[n] for n in used})  # noqa: S307 - checked above


# ---------------------------------------------------------------------------------------------
# loading


def load_trace_dir(path: str) -> Tuple[Dict[str, dict], Dict[str, List[dict]]]:
    """({definition name: definition}, {definition name: [workload lines]})."""
    definitions, workloads = {}, {}
    for fn in sorted(os.listdir(path)):
        full = os.path.join(path, fn)
        if fn.endswith(".workloads.jsonl"):
            with open(full) as f:
                lines = [json.loads(line) for line in f if line.strip()]
            workloads[fn[: -len(".workloads.jsonl")]] = lines
        elif fn.endswith(".json"):
            with open(full) as f:
                d = json.load(f)
            definitions[d["name"]] = d
    return definitions, workloads


def axis_values(definition: dict, var_axes: Mapping[str, int]) -> Dict[str, int]:
    """All axes of the definition: const values plus the given var values (all must be given)."""
    values = {}
    for name, ax in definition["axes"].items():
        if ax["type"] == "const":
            values[name] = ax["value"]
        elif name in var_axes:
            values[name] = int(var_axes[name])
        else:
            raise ValueError(f"{definition['name']}: no value for var axis {name!r}")
    return values


def check_call(definition: dict, var_axes: Mapping[str, int]) -> List[str]:
    """The constraints the proposed call violates (empty: the definition accepts it)."""
    values = axis_values(definition, var_axes)
    return [c for c in definition.get("constraints") or [] if not safe_eval(c, values)]


def bind_axes(definition: dict, shapes: Mapping[str, Iterable[int]]) -> Dict[str, int]:
    """Var axis values from concrete input/output shapes; raises on a rank or const mismatch or
    an axis bound to two different sizes."""
    tensors = {**definition["inputs"], **definition["outputs"]}
    bound: Dict[str, int] = {}
    for name, shape in shapes.items():
        spec = tensors[name]
        shape = list(shape)
        if spec["shape"] is None or len(spec["shape"]) != len(shape):
            raise ValueError(f"{name}: expected axes {spec['shape']}, got shape {shape}")
        for axis, size in zip(spec["shape"], shape):
            ax = definition["axes"][axis]
            if ax["type"] == "const" and ax["value"] != size:
                raise ValueError(f"{name}: axis {axis} is const {ax['value']}, got {size}")
            if bound.setdefault(axis, size) != size:
                raise ValueError(f"{name}: axis {axis} is {bound[axis]} elsewhere, got {size}")
    return {a: v for a, v in bound.items() if definition["axes"][a]["type"] == "var"}


# ---------------------------------------------------------------------------------------------
# regenerating inputs

_TAG_DOMAIN = re.compile(r"^domain:(\w+)=(\w+)(?:\((\w+)\))?$")
_ST_DTYPES = {"I32": "int32", "I64": "int64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "I16": "int16", "I8": "int8", "BOOL": "bool", "F64": "float64"}


def read_safetensors(path: str, key: str):
    """One tensor from a .safetensors file (header length, JSON header, raw little-endian data)."""
    import torch
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = header[key]
        start, end = meta["data_offsets"]
        f.seek(8 + n + start)
        raw = bytearray(f.read(end - start))
    dtype = getattr(torch, _ST_DTYPES[meta["dtype"]])
    return torch.frombuffer(raw, dtype=dtype).reshape(meta["shape"]).clone() if raw else \
        torch.empty(meta["shape"], dtype=dtype)


def domains(definition: dict) -> Dict[str, Tuple[str, Optional[str]]]:
    out = {}
    for tag in definition.get("tags") or []:
        m = _TAG_DOMAIN.match(tag)
        if m:
            out[m.group(1)] = (m.group(2), m.group(3))
    return out


def _slot_indices(n: int, slots: int, slot_mode: str, null_slot0: bool, gen):
    import torch
    first = 1 if null_slot0 else 0
    live = max(slots - first, 0)
    if slot_mode == "repeated" and live > 0:
        idx = torch.randint(first, slots, (n,), generator=gen)
    else:
        perm = torch.randperm(live, generator=gen)[: n] + first
        idx = torch.full((n,), -1, dtype=torch.int64)
        idx[: perm.numel()] = perm
        if slot_mode == "padded" and n > 1:
            idx[torch.randperm(n, generator=gen)[: max(1, n // 4)]] = -1
    return idx.to(torch.int32)


def _offsets(n_plus_1: int, total: int, dtype, gen):
    import torch
    cuts = torch.sort(torch.randint(0, total + 1, (max(n_plus_1 - 2, 0),), generator=gen)).values
    return torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([total])]).to(dtype)


def make_inputs(definition: dict, workload_line: dict, trace_dir: str = ".", *, seed: int = 0,
                device: str = "cpu") -> Dict[str, Any]:
    """Inputs for one workload line, in the definition's input order (run(**inputs) replays it)."""
    import torch
    wl = workload_line["workload"]
    axes = axis_values(definition, wl["axes"])
    dom = domains(definition)
    tags = set(definition.get("tags") or [])
    slot_mode = next((t.split(":", 1)[1] for t in tags if t.startswith("slot_mode:")), "padded")
    null_slot0 = "null_slot0" in tags
    gen = torch.Generator().manual_seed(seed)
    inputs: Dict[str, Any] = {}
    for name, spec in definition["inputs"].items():
        src = wl["inputs"].get(name, {"type": "random"})
        if src["type"] == "scalar":
            inputs[name] = src["value"]
            continue
        if src["type"] == "safetensors":
            inputs[name] = read_safetensors(os.path.join(trace_dir, src["path"]), src["tensor_key"]).to(device)
            continue
        shape = [axes[a] for a in spec["shape"]]
        dtype = getattr(torch, spec["dtype"])
        kind, arg = dom.get(name, (None, None))
        if kind == "slot_index":
            t = _slot_indices(shape[0], axes[arg], slot_mode, null_slot0, gen)
        elif kind == "offsets":
            t = _offsets(shape[0], axes[arg], dtype, gen)
        elif not dtype.is_floating_point:
            t = torch.zeros(shape, dtype=torch.int64)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float32)
            if kind == "log_decay":
                t = -torch.nn.functional.softplus(t)
            elif kind == "probability":
                t = torch.sigmoid(t)
            elif name in ("A_log",):
                t = t * 0.5
            elif name in ("state", "initial_state", "conv_state"):
                t = t * 0.1
        inputs[name] = t.to(dtype=dtype, device=device)
    return inputs


def load_reference(definition: dict):
    """The definition's run(), executed in a fresh namespace."""
    namespace: Dict[str, Any] = {"__name__": f"reference_{definition['name']}"}
    exec(compile(definition["reference"], f"<reference {definition['name']}>", "exec"), namespace)  # noqa: S102
    return namespace["run"]


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir")
    p.add_argument("--run-reference", action="store_true",
                   help="regenerate the first workload of each definition and run its reference")
    args = p.parse_args(argv)
    definitions, workloads = load_trace_dir(args.trace_dir)
    bad = 0
    for name, d in definitions.items():
        lines = workloads.get(name, [])
        failing = [(ln["workload"]["uuid"], check_call(d, ln["workload"]["axes"])) for ln in lines]
        failing = [(u, f) for u, f in failing if f]
        bad += len(failing)
        print(f"{name}: {len(lines)} workload(s), {len(d.get('constraints') or [])} constraint(s), "
              f"{len(failing)} violating")
        for u, f in failing:
            print(f"  {u}: violates {f}")
        if args.run_reference and lines:
            run = load_reference(d)
            outs = run(**make_inputs(d, lines[0], args.trace_dir))
            outs = outs if isinstance(outs, tuple) else (outs,)
            shapes = {n: list(o.shape) for n, o in zip(d["outputs"], outs)}
            print(f"  reference ran: {shapes}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
