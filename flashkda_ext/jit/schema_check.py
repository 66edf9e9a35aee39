"""Validate a jit/ file against its JSON Schema: jsonschema when installed, else a small built-in
checker of the subset of draft 2020-12 the jit/ schemas use (so the package still loads on a machine
where only torch and tvm-ffi are present, e.g. a bare GPU image).
"""
from __future__ import annotations

import re
from typing import Any, List, NamedTuple, Optional


class Problem(NamedTuple):
    path: list       # JSON path of the offending element
    message: str
    validator: str   # the schema keyword that failed


def validate(schema: dict, data: Any, *, use_jsonschema: Optional[bool] = None) -> List[Problem]:
    """Every problem, sorted by path (empty when valid)."""
    if use_jsonschema is None or use_jsonschema:
        try:
            import jsonschema
        except ImportError:
            if use_jsonschema:
                raise
        else:
            errs = jsonschema.Draft202012Validator(schema).iter_errors(data)
            return sorted((Problem(list(e.absolute_path), e.message, e.validator) for e in errs),
                          key=lambda p: [str(x) for x in p.path])
    out: List[Problem] = []
    _Mini(schema).check(schema, data, [], out)
    return sorted(out, key=lambda p: [str(x) for x in p.path])


_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


class _Mini:
    def __init__(self, root: dict):
        self.root = root

    def _ref(self, ref: str) -> dict:
        node = self.root
        for part in ref.lstrip("#/").split("/"):
            node = node[part]
        return node

    def check(self, s: dict, v: Any, path: list, out: list) -> None:
        if "$ref" in s:
            self.check(self._ref(s["$ref"]), v, path, out)
        if "type" in s:
            types = s["type"] if isinstance(s["type"], list) else [s["type"]]
            if not any(_TYPES[t](v) for t in types):
                out.append(Problem(path, f"{v!r} is not of type {', '.join(map(repr, types))}", "type"))
                return
        if "enum" in s and not any(v == e and type(v) is type(e) for e in s["enum"]):
            out.append(Problem(path, f"{v!r} is not one of {s['enum']!r}", "enum"))
        if "const" in s and v != s["const"]:
            out.append(Problem(path, f"{s['const']!r} was expected", "const"))
        if "anyOf" in s:
            if not any(not self._errors(sub, v, path) for sub in s["anyOf"]):
                out.append(Problem(path, f"{v!r} is not valid under any of the given schemas", "anyOf"))
        if isinstance(v, str):
            if "pattern" in s and not re.search(s["pattern"], v):
                out.append(Problem(path, f"{v!r} does not match {s['pattern']!r}", "pattern"))
            if len(v) < s.get("minLength", 0):
                out.append(Problem(path, f"{v!r} should be non-empty" if s["minLength"] == 1
                                   else f"{v!r} is too short", "minLength"))
            if "maxLength" in s and len(v) > s["maxLength"]:
                out.append(Problem(path, f"{v!r} is too long", "maxLength"))
        if _TYPES["number"](v):
            if "minimum" in s and v < s["minimum"]:
                out.append(Problem(path, f"{v!r} is less than the minimum of {s['minimum']!r}", "minimum"))
            if "maximum" in s and v > s["maximum"]:
                out.append(Problem(path, f"{v!r} is greater than the maximum of {s['maximum']!r}", "maximum"))
        if isinstance(v, list):
            if len(v) < s.get("minItems", 0):
                out.append(Problem(path, f"{v!r} should be non-empty" if s["minItems"] == 1
                                   else f"{v!r} is too short", "minItems"))
            if "maxItems" in s and len(v) > s["maxItems"]:
                out.append(Problem(path, f"{v!r} is too long", "maxItems"))
            if s.get("uniqueItems") and len({repr(x) for x in v}) != len(v):
                out.append(Problem(path, f"{v!r} has non-unique elements", "uniqueItems"))
            if "items" in s:
                for i, x in enumerate(v):
                    self.check(s["items"], x, path + [i], out)
        if isinstance(v, dict):
            for k in s.get("required", []):
                if k not in v:
                    out.append(Problem(path, f"{k!r} is a required property", "required"))
            props = s.get("properties", {})
            extra = [k for k in v if k not in props]
            ap = s.get("additionalProperties", True)
            if ap is False and extra:
                out.append(Problem(path, "Additional properties are not allowed ("
                                   + ", ".join(map(repr, extra))
                                   + (" was" if len(extra) == 1 else " were") + " unexpected)",
                                   "additionalProperties"))
            for k, x in v.items():
                if k in props:
                    self.check(props[k], x, path + [k], out)
                elif isinstance(ap, dict):
                    self.check(ap, x, path + [k], out)
                if "propertyNames" in s:  # reported like jsonschema: the inner error, at the object
                    out.extend(self._errors(s["propertyNames"], k, path))

    def _errors(self, s, v, path) -> list:
        out: list = []
        self.check(s, v, path, out)
        return out
