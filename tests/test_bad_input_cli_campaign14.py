"""Bad-input campaign 14: the command line (`python -m flashkda_ext ...`), aot.py and the JIT layer's
environment variables, driven as an operator would. Each case failed before its fix: a bad value or an
option the command does not use was refused by name (exit 2, or a ValueError naming the variable), before
anything is built, run or written, on every call.

- aot.py: --arch '' / '9.0a,' / 'bogus' / '9.0' (no AOT module builds sm_90: CPU modules only, in silence);
  --only '' or a pattern matching nothing; --out a file (a traceback); --root without csrc/ and jit/ (an
  empty list, exit 0); --cache '' (built into the working directory) or a file (a manifest still written);
  --list with an option only a build reads; a --jobs past a C int (ninja's -j wraps it).
- build: --list with --force / --jobs / --parallel / --aot / --arch (ignored); --arch 'bogus' or a CUDA arch
  for CPU modules (ignored); --aot '' (a JIT build instead); --aot a file (a traceback); --aot with
  --parallel / --force (aot.py has neither).
- trace dump: an option the op's definition does not use (fused --value-heads 32 printed the 16-head
  definition; --lower-bound without the bounded gate; --checkpoint-every on decode, ...); --out 'dir/'
  (wrote a file named dir).
- selftest: --seed -1 (aliases 2**64 - 1) or past 2**64 (every case failed on an overflow); --json '' /
  a directory / in a missing folder (a traceback after the whole run); --fresh-compile --no-compile-check.
- bench trace|jax --quick: --quick was dropped in silence.
- JIT env: MAX_JOBS / FLASHKDA_EXT_LOCK_TIMEOUT bad values were read only inside a build (after .locks/,
  .tmp/ and the dependency scan were written; never for a cached module); FLASHKDA_EXT_VERBOSE=true read
  as off; FLASHKDA_EXT_DATA_ROOT without jit/ read as a tree without modules; cache='' built into the
  working directory.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from flashkda_ext import cli, jit, paths
from flashkda_ext.devtools import testing
from flashkda_ext.jit import builder, roots

AOT_PY = paths.PACKAGE_DIR.parent / "aot.py"
needs_aot = pytest.mark.skipif(not AOT_PY.is_file(), reason="aot.py ships with the repository")


def _aot():
    return testing.aot_script("fkda_aot_campaign14")


def _listing(path):
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*")) if path.exists() else []


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty JIT cache of its own: a refused command must leave it so."""
    c = tmp_path / "cache"
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(c))
    for var in ("FLASHKDA_EXT_DISABLE_JIT", "FLASHKDA_EXT_AOT_DIR", "MAX_JOBS", "FLASHKDA_EXT_LOCK_TIMEOUT",
                "FLASHKDA_EXT_VERBOSE", "FLASHKDA_EXT_DATA_ROOT", "FLASHKDA_EXT_CUDA_ARCH"):
        monkeypatch.delenv(var, raising=False)
    return c


@pytest.fixture
def no_subprocess(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError(f"a refused command ran {a!r}")
    monkeypatch.setattr(subprocess, "call", refuse)


# --- aot.py -------------------------------------------------------------------------------------------

@needs_aot
@pytest.mark.parametrize("argv,words", [
    (["--arch", "", "--list"], "an empty item"),
    (["--arch", "9.0a,", "--list"], "an empty item"),
    (["--arch", "bogus", "--list"], "unknown arch 'bogus'"),
    (["--arch", "9.0", "--list"], "no AOT-whitelisted module builds sm_90"),
    (["--arch", "host,sm_90", "--out", "{tmp}/out"], "no AOT-whitelisted module builds sm_90"),
    (["--arch", "host", "--only", "", "--list"], "an empty item"),
    (["--arch", "host", "--only", "zzz_*", "--list"], "'zzz_*' matches no"),
    (["--arch", "host", "--only", "cpu_kda_verify,zzz", "--out", "{tmp}/out"], "'zzz' matches no"),
    (["--arch", "host", "--only", "cpu_kda_verify", "--out", "{tmp}/afile"], "--out: expected a directory"),
    (["--arch", "host", "--only", "cpu_kda_verify", "--out", "{tmp}/afile/sub"], "--out: cannot create"),
    (["--arch", "host", "--root", "{tmp}/emptyroot", "--list"], "--root: expected a folder holding"),
    (["--arch", "host", "--root", "{tmp}/missing", "--list"], "--root: expected a folder holding"),
    (["--arch", "host", "--root", "{tmp}/afile", "--list"], "--root: expected a folder holding"),
    (["--arch", "host", "--only", "cpu_kda_verify", "--out", "{tmp}/out", "--cache", ""], "--cache: expected"),
    (["--arch", "host", "--only", "cpu_kda_verify", "--out", "{tmp}/out", "--cache", "{tmp}/afile"],
     "--cache: expected"),
    (["--arch", "host", "--list", "--out", "{tmp}/out"], "--out: not used with --list"),
    (["--arch", "host", "--list", "--jobs", "2"], "--jobs: not used with --list"),
    (["--arch", "host", "--list", "--jobs", str(2**32 + 1)], "--jobs"),
])
def test_aot_refuses_bad_options_by_name_and_writes_nothing(argv, words, cache, tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "emptyroot").mkdir()
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before = _listing(tmp_path)
    with pytest.raises(SystemExit) as exc:
        _aot().main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and words in err, err
    assert "Traceback" not in err
    assert _listing(tmp_path) == before and (tmp_path / "afile").read_text() == "x"


@needs_aot
def test_aot_arch_of_a_tree_without_cuda_modules_still_builds_its_cpu_modules(tmp_path, capsys):
    """guard: a tree without CUDA modules takes any CUDA --arch (CPU modules always build)."""
    tree = testing.make_tree(tmp_path / "tree")
    assert _aot().main(["--root", str(tree), "--arch", "9.0a", "--list"]) == 0
    assert "toy_cpu" in capsys.readouterr().out


# --- build ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["--list", "cpu_kda_verify", "--force"], "--force: not used with --list"),
    (["--list", "cpu_kda_verify", "--jobs", "2"], "--jobs: not used with --list"),
    (["--list", "cpu_kda_verify", "--parallel", "2"], "--parallel: not used with --list"),
    (["--list", "cpu_kda_verify", "--aot", "{tmp}/aot"], "--aot: not used with --list"),
    (["--list", "cpu_*", "--arch", "9.0a"], "--arch: not used with --list"),
    (["cpu_kda_verify", "--arch", "bogus"], "--arch: unknown arch 'bogus'"),
    (["cpu_kda_verify", "--arch", "9.0a"], "--arch 9.0a: the chosen modules are CPU modules"),
    (["decode_row_*", "--arch", "8.0"], "no chosen CUDA module builds sm_80"),
    (["decode_row_*", "--arch", "host"], "--arch host: CUDA modules build"),
    (["cpu_kda_verify", "--aot", ""], "--aot: expected a directory, got ''"),
    (["cpu_kda_verify", "--aot", "{tmp}/afile"], "--aot: expected a directory"),
    (["cpu_kda_verify", "--aot", "{tmp}/aot", "--parallel", "2"], "--parallel: not used with --aot"),
    (["cpu_kda_verify", "--aot", "{tmp}/aot", "--force"], "--force: not used with --aot"),
])
def test_build_refuses_options_it_would_ignore(argv, words, cache, tmp_path, no_subprocess, capsys):
    (tmp_path / "afile").write_text("x")
    before = _listing(tmp_path)
    assert cli.main(["build"] + [a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("build: ") and words in captured.err, captured.err
    assert captured.out == "" and _listing(tmp_path) == before


def test_build_aot_hands_aot_py_only_the_whitelisted_modules(cache, tmp_path, monkeypatch, capsys):
    """build --all --aot: aot.py now refuses an --only naming a module it cannot build, so build leaves the
    modules that are not AOT-whitelisted out, and says so."""
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert cli.main(["build", "--all", "--aot", str(tmp_path / "aot")]) == 0
    only = calls[0][calls[0].index("--only") + 1].split(",")
    records = {r["name"]: r for r in jit.all_records()}
    assert only and all(records[n]["aot"] for n in only)
    skipped = [n for n, r in records.items() if not r["aot"]]
    if skipped:
        assert f"{len(skipped)} chosen module(s) not AOT-whitelisted" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--jobs", "--parallel"])
def test_build_count_past_a_c_int_is_refused(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["build", "cpu_kda_verify", flag, str(2**32 + 1)])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


# --- trace dump -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,option", [
    (["fused_kda_decode", "--value-heads", "32"], "--value-heads"),
    (["fused_kda_decode", "--head-dim-k", "64"], "--head-dim-k"),
    (["fused_kda_verify", "--head-dim-v", "64"], "--head-dim-v"),
    (["kda_prefill", "--slot-mode", "padded"], "--slot-mode"),
    (["kda_verify", "--slot-mode", "unique"], "--slot-mode"),
    (["kda_decode", "--checkpoint-every", "64"], "--checkpoint-every"),
    (["kda_decode", "--lower-bound", "-2"], "--lower-bound"),
    (["kda_prefill", "--gate", "log", "--lower-bound", "-2"], "--lower-bound"),
    (["kda_prefill", "--rows", "8"], "--rows"),
    (["kda_prefill", "--slots", "8"], "--slots"),
    (["kda_decode", "--tokens", "8"], "--tokens"),
    (["fused_kda_decode", "--seqs", "2"], "--seqs"),
    (["kda_decode", "--out", "{tmp}/new/"], "--out"),     # wrote a file named new
])
def test_dump_refuses_an_option_its_op_does_not_use(argv, option, tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "d.json")]
    assert cli.main(["trace", "dump"] + argv + out) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"flashkda-ext trace dump: {option}: "), captured.err
    assert captured.out == "" and _listing(tmp_path) == ["sub"]


def test_dump_defaults_still_fill_the_options_each_op_takes(tmp_path, capsys):
    """guard: the options the ops take, given or defaulted, still make their definitions."""
    import json
    for op, extra in (("kda_decode", ["--gate", "bounded"]), ("kda_prefill", []), ("kda_verify", []),
                      ("fused_kda_decode", []), ("fused_kda_verify", ["--gate", "log"])):
        assert cli.main(["trace", "dump", op, "--check"] + extra) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["name"].startswith(op)


# --- selftest and bench ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", ["-1", str(2**64), "1.5", ""])
def test_selftest_seed_out_of_range_is_refused(seed, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["selftest", "--seed", seed])
    assert exc.value.code == 2 and "--seed" in capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["--json", ""], "--json: expected a file"),
    (["--json", "{tmp}"], "--json: expected a file"),
    (["--json", "{tmp}/x/"], "--json: expected a file"),
    (["--json", "{tmp}/missing/r.json"], "does not exist"),
    (["--fresh-compile", "--no-compile-check"], "--fresh-compile"),
])
def test_selftest_refuses_before_running_anything(argv, words, tmp_path, monkeypatch, capsys):
    from flashkda_ext.cli import selftest

    def refuse(*a, **k):
        raise AssertionError("a refused selftest ran its cases")
    monkeypatch.setattr(selftest, "prebuild", refuse)
    assert cli.main(["selftest"] + [a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("selftest: ") and words in captured.err, captured.err
    assert captured.out == "" and _listing(tmp_path) == []


@pytest.mark.parametrize("which", ["trace", "jax"])
def test_bench_quick_on_a_script_without_one_is_refused(which, no_subprocess, capsys):
    from flashkda_ext.cli import bench
    if bench.benchmarks_dir() is None:
        pytest.skip("no benchmarks/ folder (installed wheel)")
    assert cli.main(["bench", which, "--quick"]) == 2
    assert "--quick" in capsys.readouterr().err


# --- the JIT layer's environment ------------------------------------------------------------------------

BAD_ENV = [("MAX_JOBS", "abc"), ("MAX_JOBS", "0"), ("MAX_JOBS", str(2**32 + 1)),
           ("FLASHKDA_EXT_LOCK_TIMEOUT", "soon"), ("FLASHKDA_EXT_VERBOSE", "2"),
           ("FLASHKDA_EXT_VERBOSE", "verbose")]


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """toy_cpu built once into a cache of its own (the cached-module cases)."""
    base = tmp_path_factory.mktemp("c14")
    tree = testing.make_tree(base / "tree")
    saved = {v: os.environ.pop(v, None) for v in ("MAX_JOBS", "FLASHKDA_EXT_LOCK_TIMEOUT", "FLASHKDA_EXT_VERBOSE")}
    try:
        jit.ensure_built("toy_cpu", root=tree, cache=base / "cache")
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    return tree, base / "cache"


@pytest.mark.parametrize("var,value", BAD_ENV)
def test_a_bad_build_setting_is_refused_before_the_cache_is_touched(var, value, cache, tmp_path, monkeypatch):
    tree = testing.make_tree(tmp_path / "tree")
    fresh = tmp_path / "fresh"
    monkeypatch.setenv(var, value)
    for _ in range(2):          # the first call and a later one alike
        with pytest.raises(ValueError, match=var):
            jit.ensure_built("toy_cpu", root=tree, cache=fresh)
    assert not fresh.exists()


@pytest.mark.parametrize("var,value", BAD_ENV)
def test_a_bad_build_setting_is_refused_for_a_cached_module_too(var, value, prebuilt, monkeypatch):
    tree, cached = prebuilt
    before = _listing(cached)
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        jit.ensure_built("toy_cpu", root=tree, cache=cached)
    assert _listing(cached) == before


@pytest.mark.parametrize("value", ["1", "true", "0", "off", ""])
def test_verbose_switch_values_are_taken(value, prebuilt, monkeypatch):
    """guard: the switch words FLASHKDA_EXT_DISABLE_JIT takes."""
    tree, cached = prebuilt
    monkeypatch.setenv("FLASHKDA_EXT_VERBOSE", value)
    assert jit.ensure_built("toy_cpu", root=tree, cache=cached).built is False


def test_a_job_count_past_a_c_int_is_refused():
    with pytest.raises(ValueError, match="jobs"):
        builder._check_jobs(2**32 + 1)


@pytest.mark.parametrize("what", ["missing", "empty", "file"])
def test_data_root_without_a_spec_tree_is_refused_by_name(what, tmp_path, monkeypatch):
    path = tmp_path / what
    if what == "empty":
        path.mkdir()
    elif what == "file":
        path.write_text("x")
    monkeypatch.setenv("FLASHKDA_EXT_DATA_ROOT", str(path))
    for _ in range(2):
        with pytest.raises(ValueError, match="FLASHKDA_EXT_DATA_ROOT"):
            jit.all_records()


def test_an_empty_cache_argument_is_not_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="cache"):
        roots.cache_dir("")
    with pytest.raises(ValueError, match="cache"):
        jit.ensure_built("cpu_kda_verify", cache="")
    assert _listing(tmp_path) == []
