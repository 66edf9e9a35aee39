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
        path = Path(env).expanduser().resolve()
        # a typo must not read as a spec tree without modules (every op then "has no route")
        if not (path / "jit").is_dir():
            raise ValueError(f"FLASHKDA_EXT_DATA_ROOT={env!r}: expected a folder holding csrc/ and jit/, "
                             f"but {path / 'jit'} is not a folder; unset it to use the package's own data")
        return path
    return paths.data_root().resolve()


def csrc_dir(root: Optional[PathLike] = None) -> Path:
    return data_root(root) / "csrc"


def jit_dir(root: Optional[PathLike] = None) -> Path:
    return data_root(root) / "jit"


def cache_dir(cache: Optional[PathLike] = None) -> Path:
    if cache is not None:
        if str(cache) == "":     # Path("") is the working directory: builds would land there
            raise ValueError("cache: expected a folder (or None: $FLASHKDA_EXT_CACHE_DIR), got ''")
        return Path(cache).resolve()
    return paths.cache_dir().resolve()


def schema_dir() -> Path:
    """Schemas always come from the package's own jit/schema: a test spec tree need not copy them."""
    own = paths.jit_dir() / "schema"
    return own
