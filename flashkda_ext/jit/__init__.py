"""JIT specs -> identity -> ninja build -> loaded TVM-FFI module. See docs/jit.md."""
from .builder import BuildResult, build_module, ensure_built, resolve_arch
from .errors import (BuildError, JitDisabledError, LockTimeoutError, ManifestError, SpecError,
                     ToolchainError)
from .identity import module_identity
from .loader import load_module
from .macros import render_header, render_macros
from .specs import all_records, get_record, opt_in_tags, registry, routes_for

__all__ = ["load_module", "get_record", "all_records", "routes_for", "opt_in_tags", "build_module",
           "ensure_built", "resolve_arch", "module_identity", "render_header", "render_macros",
           "registry", "BuildResult", "BuildError", "JitDisabledError", "LockTimeoutError",
           "ManifestError", "SpecError", "ToolchainError"]
