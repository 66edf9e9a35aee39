"""The constraint / binding expressions of the trace templates, evaluated by trace_consumer.safe_eval (the one
evaluator: no builtins, checked arithmetic), imported at the first use: importing flashkda_ext does not load
trace_consumer, so `python -m flashkda_ext.trace_consumer` runs it once, as __main__ (runpy warned of a second
copy when the package had imported it)."""
from __future__ import annotations

from typing import Any, Mapping


def safe_eval(expr: str, names: Mapping[str, Any]) -> Any:
    from ..trace_consumer import safe_eval as evaluate
    return evaluate(expr, names)
