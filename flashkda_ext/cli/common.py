"""Small helpers shared by the subcommands: a text table, an error's first line, the families."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Optional

# the largest count a C int holds: ninja reads -j into one, so a larger --jobs would wrap in silence
from ..jit.builder import MAX_JOBS_VALUE as MAX_COUNT

GATES = ("softplus", "bounded", "log")
LOWER_BOUND = -5.0


def families() -> List[str]:
    """Every op family, as the route files name them (jit/routes/<family>.json): a family added
    there reaches `info` and the selftest without a list in code to update."""
    from .. import jit

    return sorted(jit.registry().routes)


def table(rows: List[List[str]], head: List[str]) -> str:
    """Left-aligned columns under a dashed rule. Written here, not taken from tabulate or rich: this
    is all the CLI needs, and either would be one more runtime dependency of every install (the wheel
    depends on tvm-ffi, torch, ninja, jsonschema and numpy only)."""
    cells = [head] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    sep = "  "
    lines = [sep.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, sep.join("-" * w for w in widths))
    return "\n".join(lines)


def positive_int(text: str) -> int:
    """argparse type of a count (jobs, modules in parallel): 0 or a negative count is refused by name, not
    clamped to 1 in silence; so is one past MAX_COUNT, which ninja's -j would narrow in silence."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected a whole number in 1..{MAX_COUNT}, got {text!r}")
    return value


def out_file_problem(option: str, value: str) -> Optional[str]:
    """A file option (trace dump --out, selftest --json): a file to write in a folder that exists, checked before
    anything runs. The problem, naming the option, or None."""
    if not value:
        return f"{option}: expected a file to write, got ''"
    path = Path(value)
    if path.is_dir() or value.endswith(("/", os.sep)):   # "dir/": Path drops the slash, a file named dir
        return f"{option}: expected a file to write, got {value!r} (a directory)"
    if not path.parent.is_dir():
        return f"{option}: the directory {str(path.parent)!r} of {value!r} does not exist"
    return None


def first_line(text) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def shorten(text: str, width: int) -> str:
    """text cut to at most `width` characters, an ellipsis marking the cut."""
    text = str(text)
    return text if len(text) <= width else text[:max(0, width - 3)] + "..."


def try_(fn: Callable, default=None):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  info must never crash on a broken optional part
        return default if default is not None else f"unavailable ({type(e).__name__}: {first_line(e)})"
