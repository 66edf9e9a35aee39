"""Route selection: host-known call metadata -> the module that serves it.

The rules are data (jit/routes/<family>.json, format in docs/architecture.md); this file only
evaluates them. Selection never looks at device memory, so it never synchronizes.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Iterable, Mapping, Optional

from . import jit


def rule_matches(when: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
    """True when every condition of a rule's `when` holds for `meta`."""
    for key, want in when.items():
        if key.endswith("_min") or key.endswith("_max"):
            field = key[:-4]
            have = meta.get(field)
            if have is None:
                return False  # a band on an unknown value never holds: stay on the fallback
            if key.endswith("_min") and not have >= want:
                return False
            if key.endswith("_max") and not have <= want:
                return False
        elif isinstance(want, list):
            if meta.get(key) not in want:
                return False
        elif meta.get(key) != want:
            return False
    return True


def prefill_workspace_need(module, total_tokens: int, num_seqs: int, value_heads: int) -> Optional[int]:
    """Bytes of scratch a prefill module needs for these sizes, or None when it takes none (the CPU
    backend): the one place both front ends (torch, JAX) ask it."""
    if not module.implements_function("kda_prefill_workspace_bytes"):
        return None
    return int(module["kda_prefill_workspace_bytes"](total_tokens, num_seqs, value_heads))


OPT_IN_ENV = "FLASHKDA_EXT_OPT_IN"


@functools.lru_cache(maxsize=8)
def _parse_opt_in(raw: str) -> frozenset:
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    known = jit.opt_in_tags()
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(f"flashkda_ext: environment variable {OPT_IN_ENV}={raw!r} names unknown opt-in "
                         f"route(s) {unknown}; known: {sorted(known)} (docs/jit.md, 'Opt-in routes')")
    return names


def opt_in() -> frozenset:
    """The opt-in route names enabled by $FLASHKDA_EXT_OPT_IN (comma-separated); an unknown name is a
    ValueError naming the variable, raised before anything launches, on every call."""
    return _parse_opt_in(os.environ.get(OPT_IN_ENV, ""))


def _opted_in_names(opted_in) -> frozenset:
    """An explicit collection of opt-in names. A str is refused: frozenset("persistent") is its letters, so
    module_name(..., "persistent") silently opted in to nothing."""
    if isinstance(opted_in, (str, bytes)):
        raise TypeError(f"opted_in: expected a collection of opt-in names, e.g. {{{opted_in!r}}}, got a "
                        f"{type(opted_in).__name__} {opted_in!r}")
    try:
        return frozenset(opted_in)
    except TypeError:
        raise TypeError(f"opted_in: expected a collection of opt-in names, got {type(opted_in).__name__}") from None


def select_rule(family: str, meta: Mapping[str, Any], opted_in: Optional[Iterable[str]] = None) -> dict:
    """The first rule of the family whose conditions hold, with its module name formatted. A rule with
    "opt_in" is considered only when its name is opted in (`opted_in`, default $FLASHKDA_EXT_OPT_IN)."""
    enabled = opt_in() if opted_in is None else _opted_in_names(opted_in)
    for rule in jit.routes_for(family):
        if "opt_in" in rule and rule["opt_in"] not in enabled:
            continue
        if rule_matches(rule.get("when", {}), meta):
            chosen = dict(rule)
            chosen["module"] = rule["module"].format(**meta)
            return chosen
    raise LookupError(f"{family}: no route matches {dict(meta)}; the routes file must end with a fallback")


@functools.lru_cache(maxsize=512)
def _module_for(family: str, meta_items: tuple):
    return jit.load_module(select_rule(family, dict(meta_items))["module"])


@functools.lru_cache(maxsize=512)
def _function_for(family: str, meta_items: tuple):
    return _module_for(family, meta_items)[family]


def function(family: str, meta: Mapping[str, Any]):
    """The TVM-FFI function that serves this call (module loaded or built once per process)."""
    return _function_for(family, tuple(sorted(meta.items())))


def checked_function(family: str, meta: Mapping[str, Any]):
    """The signature-checked twin of function() (csrc/common/binding.h, "Call signatures"), or None
    when the module has none."""
    module = _module_for(family, tuple(sorted(meta.items())))
    name = f"{family}_checked"
    return module[name] if module.implements_function(name) else None


def module_name(family: str, meta: Mapping[str, Any], opted_in: Optional[Iterable[str]] = None) -> str:
    return select_rule(family, meta, opted_in)["module"]


@functools.lru_cache(maxsize=512)
def gb_read_dtype(module: str, input_dtype: str) -> Optional[str]:
    """The dtype a kda_decode or kda_verify module reads g and beta in: None for a CPU module (each in its own
    dtype), "float32" for the CUDA twins with params.gb_f32 = 1 (routes' _gb32 rules), else the
    input dtype (q's)."""
    rec = jit.get_record(module)
    if rec["backend"] == "cpu":
        return None
    return "float32" if rec.get("params", {}).get("gb_f32") else input_dtype
