"""Validate data against a jit/ JSON Schema with jsonschema (draft 2020-12).

Only what jsonschema leaves to its caller lives here: every error, in a stable order (by JSON
path), as (path, message, validator) tuples that SpecError / ManifestError messages quote.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple

import jsonschema


class Problem(NamedTuple):
    path: list       # JSON path of the offending element
    message: str
    validator: str   # the schema keyword that failed


def validate(schema: dict, data: Any) -> List[Problem]:
    """Every problem, sorted by path (empty when valid)."""
    errs = jsonschema.Draft202012Validator(schema).iter_errors(data)
    return sorted((Problem(list(e.absolute_path), e.message, e.validator) for e in errs),
                  key=lambda p: [str(x) for x in p.path])
