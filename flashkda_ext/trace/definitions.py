"""Definitions: a call's flashinfer-bench Definition built from its op's template and facts (name,
axes, inputs, outputs, constraints from jit/supported.json, the rendered reference), and why a call
has none (unsupported, UnsupportedCall)."""
from __future__ import annotations

import functools
from typing import Any, Dict, Mapping, Optional

from .expr import safe_eval
from .templates import _source, load_template


def _when(entry: Mapping[str, Any], f: Mapping[str, Any]) -> bool:
    return "when" not in entry or bool(safe_eval(entry["when"], f))


def _supported_set(family: str, backend: str) -> Dict[str, Optional[list]]:
    from .. import supported
    sup = supported.supported(family, backend)
    if sup is None:
        raise ValueError(f"jit/supported.json has no entry for {family} on {backend}")
    return sup


def render_constraints(template: dict, f: Mapping[str, Any], *, sources: bool = False) -> list:
    """The definition's constraints; with sources=True, (constraint, supported.json key or None)."""
    sup = _supported_set(template["family"], f["backend"])
    out = []
    for c in template["constraints"]:
        if not _when(c, f):
            continue
        if "expr" in c:
            out.append((c["expr"], None))
            continue
        allowed = sup[c["supported"]]
        if allowed is None:          # 'any': nothing to say
            continue
        listed = "(" + ", ".join(repr(x) for x in allowed) + ("," if len(allowed) == 1 else "") + ")"
        subject = c["axis_expr"] if "axis_expr" in c else repr(f[c["fact"]])
        out.append((f"{subject} in {listed}", c["supported"]))
    return out if sources else [expr for expr, _ in out]


@functools.lru_cache(maxsize=256)
def _render_reference(op: str, constants: tuple, params: tuple, name: str) -> str:
    t = load_template(op)
    ref = t["reference"]
    lines = [f"# Reference of {name}, emitted by flashkda_ext.trace from trace_templates/{op}.json.",
             "# Self-contained (torch only). run(...) takes the definition's inputs in order and",
             "# returns its outputs in order; it never modifies its inputs (in-place outputs are",
             "# returned as updated copies).",
             "import torch", ""]
    lines += [f"{k} = {v!r}" for k, v in constants]
    body = "\n\n".join(_source(p).strip("\n") for p in ref["files"])
    call = ", ".join(f"{p}={p}" for p in params)
    run = f"def run({', '.join(params)}):\n    return {ref['entry']}({call})\n"
    return "\n".join(lines) + "\n\n\n" + body + "\n\n\n" + run


def _names_in(template_part: Any, out: set) -> None:
    """Fact names a template part reads (expressions and format fields), except var-axis binds and
    workload scalars, which never change the definition."""
    import ast
    import string
    if isinstance(template_part, dict):
        for k, v in template_part.items():
            if k in ("bind", "scalar", "axis_expr") or (k == "expr" and "supported" not in template_part):
                continue
            if k in ("when", "value") and isinstance(v, str):
                out |= {n.id for n in ast.walk(ast.parse(v, mode="eval")) if isinstance(n, ast.Name)}
            elif k == "fact":
                out.add(v)
            else:
                _names_in(v, out)
    elif isinstance(template_part, list):
        for v in template_part:
            _names_in(v, out)
    elif isinstance(template_part, str):
        for _, field, _, _ in string.Formatter().parse(template_part):
            if field:
                out.add(field.split(".")[0].split("[")[0])


@functools.lru_cache(maxsize=None)
def _definition_keys(op: str) -> tuple:
    t = load_template(op)
    names = {"backend", "has_A_log", "has_dt_bias"}   # pick the supported set; unsupported() reads them
    _names_in({k: v for k, v in t.items() if k != "reference"}, names)
    for expr in t["reference"]["constants"].values():
        _names_in({"when": expr}, names)
    return tuple(sorted(names))


_definitions: Dict[tuple, dict] = {}


def build_definition(op: str, f: Mapping[str, Any]) -> dict:
    """The flashinfer-bench Definition of a call with facts `f` (not validated here). Cached on the
    facts the template reads for it; the returned dict is shared: do not modify it."""
    key = (op,) + tuple((k, f.get(k)) for k in _definition_keys(op))
    d = _definitions.get(key)
    if d is None:
        if len(_definitions) > 1024:
            _definitions.clear()
        d = _definitions[key] = _build_definition(op, f)
    return d


class UnsupportedCall(ValueError):
    """A call outside the backend's supported set (or breaking a relation between const axes):
    it has no definition. `problems` holds (supported.json key or None, message) pairs."""

    def __init__(self, op: str, problems: list):
        self.problems = problems
        super().__init__(f"{op}: " + "; ".join(m for _, m in problems))


def _names(expr: str) -> set:
    import ast
    return {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}


def _axes(t: dict, f: Mapping[str, Any]) -> Dict[str, dict]:
    axes = {}
    for axis, spec in t["axes"].items():
        if not _when(spec, f):
            continue
        entry = {"type": spec["type"]}
        if spec["type"] == "const":
            entry["value"] = int(safe_eval(spec["value"], f))
        entry["description"] = spec["description"]
        axes[axis] = entry
    return axes


def _split_constraints(op: str, f: Mapping[str, Any], axes: Mapping[str, dict]):
    """(constraints over var axes: the definition's; problems: false constraints over const axes
    and fixed properties). A constraint that names no var axis has one value per definition: in a
    definition it could only say `True` (a no-op) or be false (no call could match)."""
    const = {a: ax["value"] for a, ax in axes.items() if ax["type"] == "const"}
    kept, problems = [], []
    for expr, key in render_constraints(load_template(op), f, sources=True):
        if _names(expr) - set(const):
            kept.append(expr)
        elif not safe_eval(expr, const):
            if key is None:
                problems.append((None, f"{expr} does not hold for {const}"))
            else:
                allowed = _supported_set(load_template(op)["family"], f["backend"])[key]
                subject = expr.rsplit(" in (", 1)[0]
                value = safe_eval(subject, const)
                problems.append((key, f"{_SUBJECTS.get(key, key)} {value!r} is not supported by the "
                                      f"{f['backend']} backend (supported: {', '.join(map(repr, allowed))})"))
    return kept, problems


_SUBJECTS = {"head_dims_k": "head_dim_k", "head_dims_v": "head_dim_v", "value_heads": "value heads",
             "group_sizes": "group size value_heads // heads", "input_dtypes": "input dtype",
             "state_dtypes": "state dtype", "gates": "gate", "slot_modes": "slot mode"}


def unsupported(op: str, f: Mapping[str, Any]) -> list:
    """Why a call with facts `f` has no definition: [(supported.json key or None, message)], or
    [] when it has one. Fused definitions carry A_log and dt_bias whenever the gate reads them (the
    op takes them positionally), so a fused call leaving one out of a gate that reads it has none."""
    problems = _split_constraints(op, f, _axes(load_template(op), f))[1]
    if op.startswith("fused_") and f["gate"] != "log" and not (f["has_A_log"] and f["has_dt_bias"]):
        problems.append(("A_log", f"gate {f['gate']!r} without A_log or dt_bias: fused definitions "
                                  f"carry both (the op takes them positionally; zeros are the identity)"))
    return problems


def _build_definition(op: str, f: Mapping[str, Any]) -> dict:
    t = load_template(op)
    fmt = lambda s: s.format_map(f)  # noqa: E731
    name = "_".join(fmt(p["format"]) for p in t["name"] if _when(p, f))
    problems = unsupported(op, f)
    if problems:
        raise UnsupportedCall(op, problems)
    axes = _axes(t, f)

    def tensors(entries):
        out = {}
        for e in entries:
            if not _when(e, f):
                continue
            desc = fmt(e["description"])
            if "aliases" in e:
                desc += (f" (in-place: the op writes this into input '{e['aliases']}'; a reference "
                         f"returns it as a new tensor)")
            out[e["name"]] = {"shape": e["shape"], "dtype": fmt(e["dtype"]), "description": desc}
        return out

    inputs, outputs = tensors(t["inputs"]), tensors(t["outputs"])
    tags = [fmt(tag["format"]) for tag in t["tags"] if _when(tag, f)]
    # the output entries that apply to this call (a template may hold one entry per variant of the same output)
    tags += [f"inplace:{e['name']}={e['aliases']}" for e in t["outputs"] if "aliases" in e and _when(e, f)]
    constants = tuple((k, safe_eval(v, f)) for k, v in t["reference"]["constants"].items())
    return {
        "name": name,
        "op_type": t["op_type"],
        "description": fmt(t["description"]),
        "tags": tags,
        "axes": axes,
        "inputs": inputs,
        "outputs": outputs,
        "constraints": _split_constraints(op, f, axes)[0],
        "reference": _render_reference(op, constants, tuple(inputs), name),
    }
