"""Where the package's data lives: csrc/, jit/ and trace_templates/.

An installed wheel carries them under flashkda_ext/_data/ (see setup.py); a checkout or an editable
install reads them from the repository root. Nothing else in the package hard-codes these locations.
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
_DATA_DIRS = ("csrc", "jit", "trace_templates")


def data_root() -> Path:
    """The folder that holds csrc/, jit/ and trace_templates/."""
    shipped = PACKAGE_DIR / "_data"
    if (shipped / "jit").is_dir():
        return shipped
    checkout = PACKAGE_DIR.parent
    if (checkout / "jit").is_dir():
        return checkout
    raise FileNotFoundError(
        "flashkda_ext: cannot find its data folders (csrc/, jit/, trace_templates/) under "
        f"{shipped} or {checkout}; reinstall the package")


def csrc_dir() -> Path:
    return data_root() / "csrc"


def jit_dir() -> Path:
    return data_root() / "jit"


def trace_templates_dir() -> Path:
    return data_root() / "trace_templates"


def cache_dir() -> Path:
    """JIT build cache: $FLASHKDA_EXT_CACHE_DIR, else ~/.cache/flashkda_ext."""
    env = os.environ.get("FLASHKDA_EXT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "flashkda_ext"
