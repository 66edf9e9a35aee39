"""Trace emission: flashinfer-bench Definitions and Workloads for the public ops' calls.

With FLASHKDA_EXT_TRACE_DIR set (read at import; ``refresh()`` reads it again), or inside
``with flashkda_ext.trace.tracing(dir):``, every public call writes, before its launch (so a launch
that crashes the process leaves its trace; a call the module refuses, raising, has what it wrote
removed again by ``retract()``), into flashinfer-bench's dataset layout
(``flashinfer_bench.TraceSet.from_path(dir)`` loads it):

* ``<dir>/definitions/<op_type>/<definition>.json`` once per process and definition name (names
  encode every const axis and fixed property, so one name is one definition), and
* one line appended to ``<dir>/workloads/<op_type>/<definition>.jsonl``: the var axes, scalars as
  values, data tensors as ``random``, and the index tensors (state_indices, cu_seqlens, verify's
  num_accepted_tokens, initial_state_indices and parent_tokens: they decide the work, and random
  integers are no valid indices) saved through
  the ``safetensors`` library to
  ``<dir>/blob/workloads/<op_type>/<definition>/<definition>_<content hash>.safetensors``. Saving a
  CUDA index tensor copies it to the host (the copy synchronises); during CUDA graph capture no copy
  is possible and the call is not traced (one warning).

Everything is built from the templates in trace_templates/ (data) and the supported set in
jit/supported.json; nothing here knows a head count or a dtype list. A call outside the supported set
gets no definition (``unsupported`` says why; ``definition_for_options`` raises it for
``flashkda-ext trace dump``). Tracing never changes results and never raises into the caller: a
failure warns once per process and the call goes on. docs/trace-format.md describes the output.

Layout: emission.py (the trace directory, emit, retract), layout.py (the dataset's paths), templates.py
(loading templates, schema checks), call_facts.py (what a template reads about a call),
definitions.py (building a Definition, why a call has none), workloads.py (a workload line, saved
index tensors), options.py (the definition `flashkda-ext trace dump` prints).
"""
from .. import paths  # noqa: F401  (`flashkda-ext trace` prints trace.paths.trace_templates_dir())
from .call_facts import args_facts, facts, facts_from_args
from .definitions import UnsupportedCall, build_definition, render_constraints, unsupported
from .emission import ENV_DIR, FIB_DTYPES, directory, emit, enabled, refresh, retract, tracing
from .layout import blob_reldir, definition_relpath, workloads_relpath
from .options import definition_for_options
from .templates import OPS, load_template, validate_definition, validate_workload_line
from .workloads import build_workload, index_inputs, save_index_tensors

__all__ = ["UnsupportedCall", "build_definition", "render_constraints", "unsupported", "ENV_DIR", "FIB_DTYPES",
           "directory", "emit", "enabled", "refresh", "retract", "tracing", "args_facts", "facts", "facts_from_args",
           "blob_reldir", "definition_relpath", "workloads_relpath", "definition_for_options", "OPS",
           "load_template", "validate_definition", "validate_workload_line", "build_workload", "index_inputs",
           "save_index_tensors"]
