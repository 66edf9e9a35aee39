"""flashkda_ext/integrations/vllm/_post_import.py: a callback right after a module's first import."""
from __future__ import annotations

import importlib
import sys

import pytest

from flashkda_ext.integrations.vllm import _post_import


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh top-level module file on sys.path, not imported yet; the finder's callbacks dropped afterwards."""
    name = f"fk_post_import_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n\n\ndef f():\n    return VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    _post_import.cancel(name)
    sys.modules.pop(name, None)


def test_the_callback_runs_once_after_the_body_and_the_finder_leaves(package):
    seen = []
    _post_import.when_imported(package, lambda m: seen.append(m.f()))
    assert seen == [] and _post_import.pending() == [package]
    module = importlib.import_module(package)
    assert seen == [1] and _post_import.pending() == []
    assert module.__spec__.origin.endswith(f"{package}.py")
    assert module.__loader__.get_source(package).startswith("VALUE")      # the real loader, not a wrapper
    importlib.reload(module)
    assert seen == [1]                                  # a reload is not a first import
    _post_import.cancel(package)
    assert _post_import._FINDER not in sys.meta_path


def test_an_imported_module_is_refused_and_nothing_waits(package):
    importlib.import_module(package)
    seen = []
    with pytest.raises(ValueError, match="imported already"):
        _post_import.when_imported(package, seen.append)
    assert seen == [] and _post_import.pending() == []


def test_a_missing_module_still_fails_to_import_and_cancel_forgets_it(package):
    name = package + "_missing"
    _post_import.when_imported(name, lambda m: pytest.fail("no such module"))
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)
    assert name in _post_import.pending()
    _post_import.cancel(name)
    assert name not in _post_import.pending()
