"""Where a trace goes and the writing of it: the trace directory (FLASHKDA_EXT_TRACE_DIR, read at
import and by refresh(); tracing(dir) for a block), and emit(), which writes a call's definition
once per process and one workload line, and never raises into the caller (a failure warns once)."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
from typing import Any, Iterator, Mapping, Optional

from .definitions import build_definition
from .call_facts import facts
from .layout import definition_relpath, workloads_relpath
from .templates import validate_definition
from .workloads import build_workload

ENV_DIR = "FLASHKDA_EXT_TRACE_DIR"

# flashinfer-bench's dtype names (the definition schema holds the same list; a test checks it)
FIB_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1",
              "int64", "int32", "int16", "int8", "bool")

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


def tracing(dir: "os.PathLike[str] | str") -> "contextlib.AbstractContextManager[str]":
    """Trace every public call inside the block to `dir` (created on first write). `dir` is checked
    here, before any block runs: a str or path, not empty ('' would write into the current directory;
    FLASHKDA_EXT_TRACE_DIR='' means off, and a block meant to trace should not silently not)."""
    try:
        path = os.fspath(dir)
    except TypeError:
        raise TypeError(f"dir: expected a str or os.PathLike trace directory, got {type(dir).__name__}") from None
    if not isinstance(path, str):
        raise TypeError(f"dir: expected a str or os.PathLike trace directory, got {type(path).__name__} {path!r}")
    if not path:
        raise ValueError("dir: expected a trace directory, got '' (an empty path; to turn tracing off, "
                         "leave the block out)")
    return _tracing(path)


@contextlib.contextmanager
def _tracing(path: str) -> Iterator[str]:
    global _dir
    previous = _dir
    _dir = path
    try:
        yield _dir
    finally:
        _dir = previous



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
