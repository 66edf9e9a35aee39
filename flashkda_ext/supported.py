"""The supported set of every (family, backend), read from jit/supported.json.

Python validation, the macros rendered into each compile (FKDA_SUPPORTED_*, FKDA_HEAD_DIM_*) and the
trace constraints all come from here, so they cannot disagree.
"""
from __future__ import annotations

import copy
import functools
import json
from typing import Dict, List, Optional

from .jit import roots
from .jit.schema_check import validate

FAMILIES = ("kda_decode", "kda_prefill", "fused_kda_decode", "kda_verify", "fused_kda_verify")
BACKENDS = ("cpu", "cuda")
_KEYS = ("head_dims_k", "head_dims_v", "value_heads", "group_sizes", "input_dtypes",
         "state_dtypes", "gates", "slot_modes")


@functools.lru_cache(maxsize=8)
def _load(root_key: str) -> dict:
    path = roots.jit_dir(root_key) / "supported.json"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        # named like a schema error: a bare "Expecting value: line 1 column 1" named no file
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    with open(roots.schema_dir() / "supported.schema.json") as f:
        schema = json.load(f)
    errors = validate(schema, data)
    if errors:
        e = errors[0]
        where = "/".join(map(str, e.path)) or "(top level)"
        raise ValueError(f"{path}: at {where}: {e.message} (rule: {e.validator})")
    return data


def supported(family: str, backend: str, root=None) -> Optional[Dict[str, Optional[List]]]:
    """{key: list of allowed values, or None for 'any'}; None when the backend has no entry."""
    _name("family", family)
    _name("backend", backend)
    fams = _load(str(roots.data_root(root)))["families"]
    entry = fams.get(family, {}).get(backend)
    if entry is None:
        return None
    return {k: (None if v == "any" else copy.deepcopy(v)) for k, v in entry.items()}


def _name(what: str, value) -> None:
    # a list or dict failed as an unhashable dict key, naming nothing; None or an int read as "no entry"
    if not isinstance(value, str):
        known = FAMILIES if what == "family" else BACKENDS
        raise TypeError(f"{what}: expected a str (e.g. one of {', '.join(known)}), got {type(value).__name__} "
                        f"{value!r}")


def families(root=None) -> Dict[str, List[str]]:
    """{family: [backends]} as listed in jit/supported.json."""
    fams = _load(str(roots.data_root(root)))["families"]
    return {f: sorted(b) for f, b in fams.items()}


def clear_cache() -> None:
    _load.cache_clear()
