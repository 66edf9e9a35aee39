"""Trace emission: flashinfer-bench Definitions and Workloads for the public ops' calls.

With FLASHKDA_EXT_TRACE_DIR set (read at import; ``refresh()`` reads it again), or inside
``with flashkda_ext.trace.tracing(dir):``, every public call writes, before its launch, into
flashinfer-bench's dataset layout (``flashinfer_bench.TraceSet.from_path(dir)`` loads it):

* ``<dir>/definitions/<op_type>/<definition>.json`` once per process and definition name (names
  encode every const axis and fixed property, so one name is one definition), and
* one line appended to ``<dir>/workloads/<op_type>/<definition>.jsonl``: the var axes, scalars as
  values, data tensors as ``random``, and the index tensors (state_indices, cu_seqlens, verify's
  num_accepted_tokens: they decide the work, and random integers are no valid indices) saved through
  the ``safetensors`` library to
  ``<dir>/blob/workloads/<op_type>/<definition>/<definition>_<content hash>.safetensors``. Saving a
  CUDA index tensor copies it to the host (the copy synchronises); during CUDA graph capture no copy
  is possible and the call is not traced (one warning).

Everything is built from the templates in trace_templates/ (data) and the supported set in
jit/supported.json; nothing here knows a head count or a dtype list. A call outside the supported set
gets no definition (``unsupported`` says why; ``definition_for_options`` raises it for
``flashkda-ext trace dump``). Tracing never changes results and never raises into the caller: a
failure warns once per process and the call goes on. docs/trace-format.md describes the output.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import threading
import uuid as _uuid
import warnings
from typing import Any, Dict, Iterator, Mapping, Optional

from . import paths
from .trace_consumer import safe_eval

ENV_DIR = "FLASHKDA_EXT_TRACE_DIR"
OPS = ("kda_decode", "kda_prefill", "fused_kda_decode", "kda_verify", "fused_kda_verify")

# flashinfer-bench's dtype names (the definition schema holds the same list; a test checks it)
FIB_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1",
              "int64", "int32", "int16", "int8", "bool")
_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", None: "none"}

# The one flag ops.py reads on every call: enabled() must stay a global lookup.
_dir: Optional[str] = None
_lock = threading.Lock()
_written: set = set()          # (directory, definition name) already written by this process
_warned: set = set()           # warning kinds already shown


def enabled() -> bool:
    return _dir is not None


def directory() -> Optional[str]:
    return _dir


def refresh() -> None:
    """Re-read FLASHKDA_EXT_TRACE_DIR."""
    global _dir
    _dir = os.environ.get(ENV_DIR) or None


refresh()


@contextlib.contextmanager
def tracing(dir: "os.PathLike[str] | str") -> Iterator[str]:
    """Trace every public call inside the block to `dir` (created on first write)."""
    global _dir
    previous = _dir
    _dir = os.fspath(dir)
    try:
        yield _dir
    finally:
        _dir = previous


# flashinfer-bench's dataset layout (flashinfer_bench.data.TraceSet: definitions_path,
# workloads_path, blob_workloads_path), relative to the trace directory


def definition_relpath(definition: Mapping[str, Any]) -> str:
    return os.path.join("definitions", definition["op_type"], f"{definition['name']}.json")


def workloads_relpath(definition: Mapping[str, Any]) -> str:
    return os.path.join("workloads", definition["op_type"], f"{definition['name']}.jsonl")


def blob_reldir(definition: Mapping[str, Any]) -> str:
    return os.path.join("blob", "workloads", definition["op_type"], definition["name"])


# ---------------------------------------------------------------------------------------------
# templates


@functools.lru_cache(maxsize=None)
def _schema(name: str) -> dict:
    with open(paths.trace_templates_dir() / "schema" / f"{name}.schema.json") as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def load_template(op: str) -> dict:
    """The template of a public op, checked against trace_templates/schema/template.schema.json."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {list(OPS)}, got {op!r}")
    path = paths.trace_templates_dir() / f"{op}.json"
    with open(path) as f:
        template = json.load(f)
    _check(template, "template", str(path))
    return template


@functools.lru_cache(maxsize=None)
def _source(rel: str) -> str:
    with open(paths.trace_templates_dir() / rel) as f:
        return f.read()


def _check(doc: Any, schema: str, what: str) -> None:
    import jsonschema
    errors = sorted(jsonschema.Draft202012Validator(_schema(schema)).iter_errors(doc),
                    key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        e = errors[0]
        where = "/".join(map(str, e.absolute_path)) or "(top level)"
        raise ValueError(f"{what}: at {where}: {e.message}")


def validate_definition(definition: dict) -> None:
    """Raise ValueError unless `definition` is a valid flashinfer-bench Definition (our schema plus
    the checks JSON Schema cannot say: declared axes, disjoint names, a top-level run())."""
    _check(definition, "definition", f"definition {definition.get('name')!r}")
    import ast
    axes = definition["axes"]
    for kind in ("inputs", "outputs"):
        for name, spec in definition[kind].items():
            for axis in spec["shape"] or []:
                if axis not in axes:
                    raise ValueError(f"{definition['name']}: {kind[:-1]} {name} uses undeclared axis {axis}")
    both = set(definition["inputs"]) & set(definition["outputs"])
    if both:
        raise ValueError(f"{definition['name']}: names used as input and output: {sorted(both)}")
    tree = ast.parse(definition["reference"])
    if not any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body):
        raise ValueError(f"{definition['name']}: reference defines no top-level run()")
    for c in definition.get("constraints") or []:
        ast.parse(c, mode="eval")


def validate_workload_line(line: dict, definition: Optional[dict] = None) -> None:
    """Raise ValueError unless `line` is a valid workload line (and, given its definition, binds
    exactly its var axes and names only its inputs, scalars for scalar inputs)."""
    _check(line, "workload", f"workload line of {line.get('definition')!r}")
    if definition is None:
        return
    wl = line["workload"]
    var = {a for a, ax in definition["axes"].items() if ax["type"] == "var"}
    if set(wl["axes"]) != var:
        raise ValueError(f"{definition['name']}: workload binds axes {sorted(wl['axes'])}, "
                         f"the definition's var axes are {sorted(var)}")
    if set(wl["inputs"]) != set(definition["inputs"]):
        raise ValueError(f"{definition['name']}: workload inputs {sorted(wl['inputs'])} differ from "
                         f"the definition's {sorted(definition['inputs'])}")
    for name, src in wl["inputs"].items():
        if (definition["inputs"][name]["shape"] is None) != (src["type"] == "scalar"):
            raise ValueError(f"{definition['name']}: input {name} is {src['type']} in the workload")


# ---------------------------------------------------------------------------------------------
# facts: what a template may read about one call


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
                       gate="softplus", scale=None, beta_is_logit=True, null_slot0=False),
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
        idx = a["state_indices"]
        N, cols = idx.shape[0], idx.shape[1]
        verify = dict(num_seqs=N, index_cols=cols, max_seqlen=cols if a["max_seqlen"] is None else a["max_seqlen"],
                      has_accepted=a["num_accepted_tokens"] is not None, slot_mode="padded")
        if op == "kda_verify":
            q, v, state = a["q"], a["v"], a["state"]
            return dict(common, **verify, total_tokens=q.shape[1], num_heads=q.shape[2], head_dim_k=q.shape[3],
                        value_heads=v.shape[2], head_dim_v=v.shape[3], slots=state.shape[0],
                        input_dtype=_dtype(q), state_dtype=_dtype(state), beta_is_logit=bool(a["beta_is_logit"]),
                        scale=_resolved_scale(a["scale"], q.shape[3]), g_dtype=_dtype(a["g"]),
                        beta_dtype=_dtype(a["beta"]))
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


# ---------------------------------------------------------------------------------------------
# building


def _when(entry: Mapping[str, Any], f: Mapping[str, Any]) -> bool:
    return "when" not in entry or bool(safe_eval(entry["when"], f))


def _supported_set(family: str, backend: str) -> Dict[str, Optional[list]]:
    from . import supported
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
    tags += [f"inplace:{e['name']}={e['aliases']}" for e in t["outputs"] if "aliases" in e and e["name"] in outputs]
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


def _index_tensors_on_host(inputs: Mapping[str, Any], names) -> Optional[Dict[str, Any]]:
    """The index tensors as CPU tensors, or None when they cannot be read: meta tensors (no data),
    or CUDA ones while a graph is being captured (a copy to the host would break the capture)."""
    tensors = {n: inputs[n] for n in names}
    if any(x.device.type == "meta" for x in tensors.values()):
        return None
    if any(x.device.type == "cuda" for x in tensors.values()):
        import torch
        if torch.cuda.is_current_stream_capturing():
            return None
    return {n: x.detach().to("cpu").contiguous() for n, x in tensors.items()}


def save_index_tensors(trace_dir: str, definition: Mapping[str, Any], tensors: Mapping[str, Any]) -> str:
    """Write `tensors` with safetensors under the definition's blob folder; returns the path
    relative to trace_dir. Named by content: a decode loop that reuses its indices writes one file."""
    import hashlib
    try:
        import safetensors.torch
    except ImportError as e:
        raise RuntimeError("tracing stores index tensors with the safetensors package: "
                           "pip install safetensors") from e
    data = safetensors.torch.save(dict(tensors))
    name = definition["name"]
    rel = os.path.join(blob_reldir(definition), f"{name}_{hashlib.sha1(data).hexdigest()[:20]}.safetensors")
    path = os.path.join(trace_dir, rel)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    return rel


def index_inputs(op: str, definition: Mapping[str, Any]) -> list:
    """The definition's index inputs (stored in every workload, never drawn at random)."""
    return [e["name"] for e in load_template(op)["inputs"] if e.get("index") and e["name"] in definition["inputs"]]


def build_workload(op: str, f: Mapping[str, Any], definition: dict, inputs: Mapping[str, Any],
                   trace_dir: Optional[str] = None) -> Optional[dict]:
    """One workload line. With trace_dir, the index tensors are saved there and referenced; None
    when they cannot be read (CUDA graph capture). Without, they are left `random` (a workload only
    for its axes, e.g. a constraint check)."""
    t = load_template(op)
    uid = str(_uuid.uuid4())
    axes = {a: int(safe_eval(t["axes"][a]["bind"], f))
            for a, ax in definition["axes"].items() if ax["type"] == "var"}
    sources = {}
    for e in t["inputs"]:
        name = e["name"]
        if name not in definition["inputs"]:
            continue
        if e["shape"] is None:
            value = safe_eval(e["scalar"], f)
            sources[name] = {"type": "scalar", "value": int(value) if e["dtype"].startswith("int") else float(value)}
        else:
            sources[name] = {"type": "random"}
    index = index_inputs(op, definition)
    if trace_dir is not None and index:
        host = _index_tensors_on_host(inputs, index)
        if host is None:
            return None
        rel = save_index_tensors(trace_dir, definition, host)
        for name in index:
            sources[name] = {"type": "safetensors", "path": rel, "tensor_key": name}
    return {"definition": definition["name"],
            "workload": {"uuid": uid, "axes": axes, "inputs": sources},
            "solution": None, "evaluation": None}


# ---------------------------------------------------------------------------------------------
# definitions for given options (`flashkda-ext trace dump`)

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


def _option_args(op: str, o: Mapping[str, Any]) -> Dict[str, Any]:
    """Public-op arguments as meta tensors (no memory, no device) for the dump's options."""
    import torch
    m = dict(device="meta")
    dt, sdt = _option_dtype("--input-dtype", o["input_dtype"]), _option_dtype("--state-dtype", o["state_dtype"])
    for opt in ("heads", "head_dim", "rows", "slots", "tokens", "seqs"):
        if int(o[opt]) <= 0:
            raise ValueError(f"--{opt.replace('_', '-')}: expected a positive integer, got {o[opt]}")
    H, rows, slots = o["heads"], o["rows"], o["slots"]
    HV = o.get("value_heads") or H
    K, V = o.get("head_dim_k") or o["head_dim"], o.get("head_dim_v") or o["head_dim"]
    gate = o["gate"]
    e = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, **m)  # noqa: E731
    gate_kw = dict(gate=gate, lower_bound=o["lower_bound"] if gate == "bounded" else None)
    T, N = o["tokens"], o["seqs"]
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
        return dict(q=e(1, T, H, K, dtype=dt), k=e(1, T, H, K, dtype=dt), v=e(1, T, HV, V, dtype=dt),
                    g=e(1, T, HV, K, dtype=dt), beta=e(1, T, HV, dtype=dt), state=e(slots, HV, V, K, dtype=sdt),
                    **verify, **gate_kw)
    return dict(q=e(1, T, H, K, dtype=dt), k=e(1, T, H, K, dtype=dt), v=e(1, T, HV, V, dtype=dt),
                g=e(1, T, HV, K, dtype=dt), beta=e(1, T, HV, dtype=dt), cu_seqlens=e(N + 1, dtype=torch.int32),
                initial_state=e(N, HV, V, K, dtype=sdt), checkpoint_every=int(o["checkpoint_every"]), **gate_kw)


def definition_for_options(op: str, options: Mapping[str, Any]) -> dict:
    """The definition `flashkda-ext trace dump OP` prints for its options (argparse's names:
    heads, value_heads, head_dim, head_dim_k, head_dim_v, input_dtype, state_dtype, gate,
    lower_bound, slot_mode, backend, rows, slots, tokens, seqs, checkpoint_every; verify ops: seqs
    requests of tokens in all, T_max = ceil(tokens / seqs), with num_accepted_tokens). Raises
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


# ---------------------------------------------------------------------------------------------
# emission


def _warn_once(kind: str, message: str) -> None:
    if kind in _warned:
        return
    _warned.add(kind)
    warnings.warn(f"flashkda_ext.trace: {message}", RuntimeWarning, stacklevel=3)


def emit(op: str, call: Any, inputs: Mapping[str, Any]) -> Optional[str]:
    """Write the call's definition (once per process) and one workload line. Never raises; returns
    the definition name, or None when nothing was written."""
    trace_dir = _dir
    if trace_dir is None:
        return None
    try:
        f = facts(op, call, inputs)
        definition = build_definition(op, f)
        odd = sorted({s["dtype"] for s in {**definition["inputs"], **definition["outputs"]}.values()}
                     - set(FIB_DTYPES))
        if odd:
            _warn_once("dtype", f"calls with dtype(s) {odd} are not traced: flashinfer-bench's format "
                                f"has no name for them (first: {definition['name']})")
            return None
        name = definition["name"]
        with _lock:
            workload = build_workload(op, f, definition, inputs, trace_dir)
            if workload is None:
                _warn_once("indices", "calls whose index tensors cannot be read (meta tensors, CUDA graph "
                                      "capture) are not traced: a workload needs their values "
                                      f"(first: {name})")
                return None
            if (trace_dir, name) not in _written:
                validate_definition(definition)
                path = os.path.join(trace_dir, definition_relpath(definition))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as fh:
                    json.dump(definition, fh, indent=2)
                    fh.write("\n")
                os.replace(tmp, path)
                _written.add((trace_dir, name))
            line = json.dumps(workload, separators=(",", ":"))
            path = os.path.join(trace_dir, workloads_relpath(definition))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # one write per line, flushed on close, so a crash in the launch that follows keeps it
            with open(path, "a") as fh:
                fh.write(line + "\n")
        return name
    except Exception as e:  # noqa: BLE001 - tracing must never break the user's call
        _warn_once("error", f"tracing failed for a call, which ran untraced; later failures are not reported "
                            f"({type(e).__name__}: {e})")
        return None
