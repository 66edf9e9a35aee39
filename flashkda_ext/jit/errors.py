"""Exceptions of the JIT machinery; each message names the module (or spec file) and what to do."""
from __future__ import annotations


class SpecError(ValueError):
    """A jit/ data file breaks a rule: names the file, the record (or route rule) and the rule."""

    def __init__(self, file, record, rule: str):
        self.file = str(file)
        self.record = record
        self.rule = rule
        where = f"{self.file}: record '{record}'" if record is not None else self.file
        super().__init__(f"flashkda_ext spec error: {where}: {rule}")


class ToolchainError(RuntimeError):
    """A compiler the build needs is missing."""


class BuildError(RuntimeError):
    """The compiler or linker failed; the message carries its output."""


class JitDisabledError(RuntimeError):
    """FLASHKDA_EXT_DISABLE_JIT=1 and no valid AOT artifact for the module."""


class ModuleMismatchError(RuntimeError):
    """A .so loaded as a module does not export that module's entry function (a foreign or
    mismatched file)."""


class LockTimeoutError(TimeoutError):
    """A cache lock was not acquired in time; names the lock file."""


class ManifestError(ValueError):
    """An AOT folder's manifest.json breaks its schema: names the file and the field."""

    def __init__(self, file, field: str, rule: str):
        self.file = str(file)
        self.field = field
        self.rule = rule
        super().__init__(f"flashkda_ext: AOT manifest {self.file}: {field}: {rule}")
