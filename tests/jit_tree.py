"""The `tree` fixture of the JIT cache tests: a toy data root built by devtools.testing, with an empty cache
of its own and no AOT folder or JIT switch from the environment."""
from __future__ import annotations

import pytest

from flashkda_ext.devtools import testing
from flashkda_ext.jit import loader


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHKDA_EXT_AOT_DIR", raising=False)
    monkeypatch.delenv("FLASHKDA_EXT_DISABLE_JIT", raising=False)
    loader.clear_cache()
    yield testing.make_tree(tmp_path / "tree")
    loader.clear_cache()
