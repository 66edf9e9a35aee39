"""flag_reader: the compiled fast-path tensor test gives the Python test's answer on every case; its
build runs in the background (no call waits for it) and a failed one warns once."""
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from flashkda_ext import fast_path, flag_reader


@pytest.fixture(scope="module")
def native():
    try:
        return flag_reader.build()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the compiled flag test could not be built here ({type(e).__name__})")


def _cases():
    plain = torch.randn(3, 4)
    with torch.inference_mode():
        inference = torch.randn(3)
    leaf = torch.randn(3, requires_grad=True)
    items = {
        "plain": plain,
        "none": None,
        "neg view": torch.randn(3)._neg_view(),
        "int32 neg view": torch.arange(3, dtype=torch.int32)._neg_view(),
        "requires_grad": leaf,
        "non-leaf requires_grad": leaf * 2,
        "inference tensor": inference,
        "parameter (a subclass)": torch.nn.Parameter(torch.randn(2)),
        "list": [1, 2],
        "int": 3,
        "bool tensor": torch.ones(2, dtype=torch.bool),
        "empty": torch.empty(0),
    }
    for name, x in items.items():
        for where in ("read", "written"):
            yield f"{name} {where}", x, where


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_native_matches_python(native, mode):
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    plain = torch.randn(2)
    seen = set()
    with ctx():
        for name, x, where in _cases():
            read, written = ((plain, x), (plain,)) if where == "read" else ((plain,), (x, None))
            want = fast_path._py_plain_ok(read, written)
            assert native(read, written) is want, (name, mode)
            seen.add(want)
        assert native((), ()) is True and fast_path._py_plain_ok((), ()) is True
    assert seen == {True, False}  # the table has cases of both answers in every mode


def test_native_refuses_other_than_two_tuples(native):
    with pytest.raises(TypeError, match="two tuples"):
        native([torch.randn(1)], ())
    with pytest.raises(TypeError, match="two tuples"):
        native((torch.randn(1),))


def test_fast_path_uses_the_compiled_test_once_built(native):
    x = torch.randn(2)
    # with the extension built, importing the package installs it as the fast path's test
    code = ("import flashkda_ext; from flashkda_ext import fast_path, flag_reader; "
            "print(fast_path.plain_ok is flag_reader.load())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    assert native((x,), (x,)) is True


def test_opting_out_keeps_the_python_test():
    env = dict(os.environ, FLASHKDA_EXT_NATIVE_FLAGS="0")
    code = ("import flashkda_ext; from flashkda_ext import fast_path, flag_reader; "
            "print(fast_path.plain_ok is fast_path._py_plain_ok, flag_reader.ensure(print))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["True", "None"]


@pytest.fixture
def unbuilt(monkeypatch):
    """This process as if the compiled test were not built and no build had been tried."""
    monkeypatch.setattr(flag_reader, "_native", None)
    monkeypatch.setattr(flag_reader, "_tried", False)
    monkeypatch.setattr(flag_reader, "_worker", None)
    monkeypatch.setattr(flag_reader, "_built_file", lambda: None)
    monkeypatch.setattr(flag_reader, "failed_before", lambda: None)
    monkeypatch.delenv("FLASHKDA_EXT_DISABLE_JIT", raising=False)
    monkeypatch.delenv("FLASHKDA_EXT_NATIVE_FLAGS", raising=False)


def test_the_armed_call_does_not_wait_for_the_build(unbuilt, monkeypatch):
    release, ready = threading.Event(), []

    def compiled(read, written):  # stands for the compiled test
        return True

    def slow_child(proc):
        assert proc == "child" and release.wait(60)
        flag_reader._native = compiled  # what load() finds once the child has built it
        return None

    monkeypatch.setattr(flag_reader, "start_child", lambda: "child")
    monkeypatch.setattr(flag_reader, "wait_child", slow_child)
    t0 = time.perf_counter()
    assert flag_reader.ensure(ready.append) is None
    assert time.perf_counter() - t0 < 1.0 and ready == []   # returned while the build still runs
    assert flag_reader.ensure(ready.append) is None          # one build per process
    release.set()
    assert flag_reader.wait(60) is compiled
    assert ready == [compiled]                               # handed over once, when done


def test_a_failed_build_warns_once_and_leaves_the_python_test(unbuilt, monkeypatch):
    monkeypatch.setattr(flag_reader, "start_child", lambda: "child")
    monkeypatch.setattr(flag_reader, "wait_child", lambda proc: "OSError: no compiler")
    ready = []
    with pytest.warns(RuntimeWarning, match="did not build.*no compiler"):
        assert flag_reader.ensure(ready.append) is None
        assert flag_reader.wait(60) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flag_reader.ensure(ready.append) is None  # one attempt per process: no second warning
        assert flag_reader.wait(60) is None
    assert ready == []


def test_the_child_builds_for_the_next_process_after_this_one_exits(tmp_path):
    """A short script arms the fast path and exits at once; the build it started still finishes
    (here with a compiler that takes 2 s), and the next process loads the compiled test at import."""
    cxx = tmp_path / "slow-g++"
    cxx.write_text('#!/bin/sh\ncase " $* " in *" -c "*) sleep 2 ;; esac\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    env = dict(os.environ, CXX=str(cxx), FLASHKDA_EXT_CACHE_DIR=str(tmp_path / "cache"))
    for name in ("FLASHKDA_EXT_DISABLE_JIT", "FLASHKDA_EXT_NATIVE_FLAGS"):
        env.pop(name, None)
    arm = ("from flashkda_ext import fast_path, flag_reader; "
           "fast_path._install(flag_reader.ensure(fast_path._install)); print(fast_path.plain_ok is fast_path._py_plain_ok)")
    r = subprocess.run([sys.executable, "-c", arm], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["True"], r.stderr   # exited before the build was done
    check = ("import flashkda_ext; from flashkda_ext import fast_path, flag_reader; "
             "print(fast_path.plain_ok is flag_reader.load() is not None)")
    deadline = time.time() + 300
    while time.time() < deadline:
        r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
        if r.stdout.split() == ["True"]:
            break
        time.sleep(2)
    assert r.stdout.split() == ["True"], r.stderr
    assert list((tmp_path / "cache" / ".tmp").iterdir()) == []


def test_a_build_that_failed_before_is_not_retried(unbuilt, monkeypatch, tmp_path):
    monkeypatch.setattr(flag_reader, "failed_before", lambda: tmp_path)
    monkeypatch.setattr(flag_reader, "build", lambda jobs=None: pytest.fail("retried a failed build"))
    with pytest.warns(RuntimeWarning, match=f"failed to build before.*{tmp_path}.*build` retries"):
        assert flag_reader.ensure(print) is None
    assert flag_reader._worker is None
