"""Where the JIT machinery reads its data (csrc/ and jit/) and keeps its cache.

Every public function of flashkda_ext.jit takes an optional ``root``; without one,
$FLASHKDA_EXT_DATA_ROOT (a folder holding csrc/ and jit/) wins over the package's own data
(flashkda_ext.paths). Tests use either to point the machinery at a temporary spec tree.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from .. import paths

PathLike = Union[str, os.PathLike]


def data_root(root: Optional[PathLike] = None) -> Path:
    if root is not None:
        return Path(root).resolve()
    env = os.environ.get("FLASHKDA_EXT_DATA_ROOT")
    if env:
        return Path(env).expanduser().resolve()
    return paths.data_root().resolve()


def csrc_dir(root: Optional[PathLike] = None) -> Path:
    return data_root(root) / "csrc"


def jit_dir(root: Optional[PathLike] = None) -> Path:
    return data_root(root) / "jit"


def cache_dir(cache: Optional[PathLike] = None) -> Path:
    if cache is not None:
        return Path(cache).resolve()
    return paths.cache_dir().resolve()


def schema_dir() -> Path:
    """Schemas always come from the package's own jit/schema: a test spec tree need not copy them."""
    own = paths.jit_dir() / "schema"
    return own
