"""The trace templates (trace_templates/<op>.json, data) and the JSON Schema checks of templates,
definitions and workload lines."""
from __future__ import annotations

import functools
import json
from typing import Any, Optional

from .. import paths

OPS = ("kda_decode", "kda_prefill", "fused_kda_decode", "kda_verify", "fused_kda_verify")


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

