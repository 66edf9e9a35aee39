"""Where a trace goes and the writing of it: the trace directory (FLASHKDA_EXT_TRACE_DIR, read at
import and by refresh(); tracing(dir) for a block), emit(), which writes a call's definition once per
process and one workload line, and retract(), which undoes the last emit of this thread when the op's
module refused that call (raised): a refused call writes nothing, while a launch that crashes the
process keeps its trace (emit runs before the launch). Neither raises into the caller (a failure
warns once)."""
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
from .workloads import build_workload, makedirs

ENV_DIR = "FLASHKDA_EXT_TRACE_DIR"

# flashinfer-bench's dtype names (the definition schema holds the same list; a test checks it)
FIB_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1",
              "int64", "int32", "int16", "int8", "bool")

# The one flag ops.py reads on every call: enabled() must stay a global lookup.
_dir: Optional[str] = None
_lock = threading.Lock()
_written: set = set()          # (directory, definition name) already written by this process
_warned: set = set()           # warning kinds already shown
_last = threading.local()      # .undo: what this thread's last emit wrote (_Undo), for retract()


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


class _Undo:
    """What one emit wrote: the paths it created (folders, the blob, the definition file), in the
    order made; the definition file among them, if it was not on disk before; and the workload line
    it appended (the file, the line's offset and bytes, whether the file was new)."""
    __slots__ = ("key", "created", "definition", "workloads", "offset", "line", "new_file")

    def __init__(self, key: tuple) -> None:
        self.key = key
        self.created: list = []
        self.definition: Optional[str] = None


def emit(op: str, call: Any, inputs: Mapping[str, Any]) -> Optional[str]:
    """Write the call's definition (once per process) and one workload line. Never raises; returns
    the definition name, or None when nothing was written. What it wrote is kept (per thread, until
    the next emit) for retract()."""
    _last.undo = None                  # an earlier call's record is never retracted for this one
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
            undo = _Undo((trace_dir, name))
            workload = build_workload(op, f, definition, inputs, trace_dir, undo.created)
            if workload is None:
                _warn_once("indices", "calls whose index tensors cannot be read (meta tensors, CUDA graph "
                                      "capture) are not traced: a workload needs their values "
                                      f"(first: {name})")
                return None
            if (trace_dir, name) not in _written:
                validate_definition(definition)
                path = os.path.join(trace_dir, definition_relpath(definition))
                makedirs(os.path.dirname(path), undo.created)
                fresh = not os.path.exists(path)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as fh:
                    json.dump(definition, fh, indent=2)
                    fh.write("\n")
                os.replace(tmp, path)
                _written.add((trace_dir, name))
                if fresh:
                    undo.created.append(path)
                    undo.definition = path
            line = (json.dumps(workload, separators=(",", ":")) + "\n").encode()
            path = os.path.join(trace_dir, workloads_relpath(definition))
            makedirs(os.path.dirname(path), undo.created)
            undo.new_file = not os.path.exists(path)
            # written straight to the file (no buffer), so a crash in the launch that follows keeps it
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                done = 0
                while done < len(line):
                    done += os.write(fd, line[done:])
                end = os.lseek(fd, 0, os.SEEK_CUR)   # O_APPEND: just past our line
            finally:
                os.close(fd)
            undo.workloads, undo.offset, undo.line = path, end - len(line), line
            _last.undo = undo
        return name
    except Exception as e:  # noqa: BLE001 - tracing must never break the user's call
        _warn_once("error", f"tracing failed for a call, which ran untraced; later failures are not reported "
                            f"({type(e).__name__}: {e})")
        return None


def retract() -> None:
    """Undo what this thread's last emit() wrote: the ops call it when their module refused the call
    they had just traced (the launch raised), so that a refused call leaves no trace. The workload
    line is cut off its file if it is still the file's last (otherwise another writer appended after
    it and everything is kept: one warning); a file emit created that is left empty goes, and so do
    the blob emit created (content-addressed: one that was there may be referenced by earlier lines),
    the definition file if emit wrote it where there was none and no workload line of it remains (it
    is then written again by the next call), and the folders emit created, if empty. Does nothing
    when there is no record (it is dropped by the next emit and by retract itself). Never raises."""
    undo = getattr(_last, "undo", None)
    if undo is None:
        return
    _last.undo = None
    try:
        with _lock:
            _undo(undo)
    except Exception as e:  # noqa: BLE001 - like emit, never into the caller
        _warn_once("retract", f"the trace of a call its module refused could not be removed; later failures "
                              f"are not reported ({type(e).__name__}: {e})")


def _undo(undo: _Undo) -> None:
    path, line, offset = undo.workloads, undo.line, undo.offset
    with open(path, "rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(offset)
        if size != offset + len(line) or fh.read(len(line)) != line:
            _warn_once("retract-kept", f"the workload line of a call its module refused is kept: the file "
                                       f"changed after it ({path})")
            return
        fh.truncate(offset)
    if offset == 0 and undo.new_file:
        os.remove(path)
    for p in reversed(undo.created):
        if p == undo.definition:
            if offset > 0:            # earlier workload lines of this definition remain
                continue
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
            _written.discard(undo.key)
        elif os.path.isdir(p):
            with contextlib.suppress(OSError):  # not empty: another call's files are there
                os.rmdir(p)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
