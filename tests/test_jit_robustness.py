"""The build cache and loader as a serving operator meets them: bad environment values, corrupt
cache entries, a read-only cache. Each test is a defect that was found and fixed (CPU toy module)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from flashkda_ext.devtools import testing
from flashkda_ext.jit import ensure_built, load_module, loader
from flashkda_ext.jit import builder, lock


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHKDA_EXT_AOT_DIR", raising=False)
    monkeypatch.delenv("FLASHKDA_EXT_DISABLE_JIT", raising=False)
    loader.clear_cache()
    yield testing.make_tree(tmp_path / "tree")
    loader.clear_cache()


def _call(tree) -> list:
    loader.clear_cache()
    y = torch.empty(2)
    load_module("toy_cpu", root=tree)["kda_decode"](torch.zeros(2), y)
    return y.tolist()


@pytest.mark.parametrize("value", ["2", "ture", "maybe", "disable"])
def test_a_misspelt_disable_jit_is_refused_not_read_as_off(tree, monkeypatch, value):
    # a typo used to mean "JIT on": a server meant to run prebuilt-only would compile silently
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", value)
    with pytest.raises(ValueError, match=f"FLASHKDA_EXT_DISABLE_JIT={value!r}"):
        load_module("toy_cpu", root=tree)
    assert not (tree.parent / "cache").exists()  # refused before anything was built


@pytest.mark.parametrize("value,disabled", [("1", True), ("TRUE", True), (" yes ", True),
                                            ("on", True), ("", False), ("0", False),
                                            ("false", False), ("No", False), ("off", False)])
def test_disable_jit_spellings(monkeypatch, value, disabled):
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", value)
    assert loader.jit_disabled() is disabled


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_jobs_below_one_is_refused(monkeypatch, value):
    # used to be clamped to 1 in silence: a one-job build of a CUDA module takes minutes
    monkeypatch.setenv("MAX_JOBS", value)
    with pytest.raises(ValueError, match=f"MAX_JOBS={value!r}"):
        builder._jobs(None)


@pytest.mark.parametrize("value", ["nan", "NaN"])
def test_lock_timeout_nan_is_refused(monkeypatch, value):
    # nan passed the "> 0" test by failing "<= 0", and filelock then waits forever
    monkeypatch.setenv("FLASHKDA_EXT_LOCK_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"FLASHKDA_EXT_LOCK_TIMEOUT={value!r}"):
        lock.lock_timeout()


def test_a_bad_cuda_arch_variable_is_named(monkeypatch):
    monkeypatch.setenv("FLASHKDA_EXT_CUDA_ARCH", "hopper")
    with pytest.raises(ValueError, match="FLASHKDA_EXT_CUDA_ARCH='hopper'"):
        builder.resolve_arch(testing.cuda_record())


def test_info_reports_a_bad_disable_jit_instead_of_crashing(monkeypatch):
    # `info` is what an operator runs to find out what is wrong: it must show the bad value
    from flashkda_ext.cli import info
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", "ture")
    monkeypatch.setattr(info, "spec_summary", lambda verbose=False: "skipped")  # slow, beside the point
    got = info.collect_info()
    assert "FLASHKDA_EXT_DISABLE_JIT='ture'" in got["jit_disabled"]
    assert "FLASHKDA_EXT_DISABLE_JIT='ture'" in info._jit_note(got["jit_disabled"])
