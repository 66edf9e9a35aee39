"""The command line: `python -m flashkda_ext info` and `selftest` run on a CPU machine and return 0;
selftest reports a wrong result as a failure; the subcommands' helpers behave."""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashkda_ext import cli, jit, paths
from flashkda_ext.cli import bench, selftest, selftest_cases, selftest_shapes

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, timeout):
    env = dict(os.environ)
    env.pop("FLASHKDA_EXT_TRACE_DIR", None)
    return subprocess.run([sys.executable, "-m", "flashkda_ext", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_info_runs_and_reports_versions():
    r = run_cli("info", "--json", timeout=180)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    import tvm_ffi

    assert info["tvm_ffi"] == tvm_ffi.__version__
    assert info["torch"] == torch.__version__
    assert "cxx" in info["compilers"]
    fams = info["spec"]["families"]
    assert "kda_decode/cpu" in fams and fams["kda_decode/cpu"]["modules"] >= 1
    assert info["gpu"]["available"] == torch.cuda.is_available()
    # every family a route file routes, each with its rules in file order
    route_files = sorted(p.stem for p in (paths.data_root() / "jit" / "routes").glob("*.json"))
    assert len(route_files) >= 5 and sorted(info["spec"]["routes"]) == route_files
    for fam in route_files:
        assert [r["name"] for r in info["spec"]["routes"][fam]] == [r["name"] for r in jit.routes_for(fam)]


def test_info_text():
    r = run_cli("info", timeout=180)
    assert r.returncode == 0, r.stderr
    for word in ("tvm-ffi", "torch", "JIT cache", "AOT dirs", "routes"):
        assert word in r.stdout
    routes = r.stdout.split("routes (first match wins)")[1]
    for p in (paths.data_root() / "jit" / "routes").glob("*.json"):
        assert f"\n{p.stem} " in routes, p.stem


def test_selftest_cpu_passes():
    """The README's main job on this machine (CPU routes; the nvcc compile check is tested below)."""
    r = run_cli("selftest", "--cpu-only", "--no-compile-check", timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "PASS" in r.stdout and "FAIL" not in r.stdout
    route_files = [p.stem for p in (paths.data_root() / "jit" / "routes").glob("*.json")]
    assert "fused_kda_verify" in route_files
    for fam in route_files:  # every family the route files route has a CPU case that passed
        assert re.search(rf"^PASS  {fam} cpu ", r.stdout, re.M), fam
        assert f"cpu_{fam}" in r.stdout
    wide = [line for line in r.stdout.splitlines() if len(line) > selftest_cases.LINE_WIDTH]
    assert not wide, wide


def test_selftest_reports_failures(monkeypatch, capsys):
    """With a zero tolerance every inexact result fails, and the exit code says so."""
    monkeypatch.setattr(selftest_cases, "tolerance", lambda *d: 0.0)
    rc = cli.main(["selftest", "--cpu-only", "--no-compile-check", "--only", "kda_decode:f32*", "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL" in out and "> tol" in out


def test_selftest_json(tmp_path, capsys):
    path = tmp_path / "st.json"
    rc = cli.main(["selftest", "--cpu-only", "--no-compile-check", "--only", "fused_kda_decode", "--seed", "5",
                   "--json", str(path)])
    assert rc == 0, capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["seed"] == 5
    ran = [o for o in doc["outcomes"] if o["family"] == "fused_kda_decode"]
    assert ran and all(o["status"] == "PASS" for o in ran)
    assert all(o["out_err"] is not None and o["out_err"] <= o["tol"] for o in ran)


def test_a_routed_family_the_selftest_cannot_run_fails(monkeypatch):
    monkeypatch.setattr(selftest, "families", lambda: ["kda_decode", "kda_new"])
    (o,) = selftest.uncovered_families(selftest_cases.cpu_specs())
    assert o.status == "FAIL" and o.family == "kda_new" and "jit/routes/kda_new.json" in o.detail
    monkeypatch.setattr(selftest, "families", lambda: ["kda_decode", "fused_kda_verify"])
    cases = [c for c in selftest_cases.cpu_specs() if c.family != "fused_kda_verify"]
    (o,) = selftest.uncovered_families(cases)
    assert o.status == "FAIL" and o.family == "fused_kda_verify" and "no CPU case" in o.detail
    assert selftest.uncovered_families(selftest_cases.cpu_specs()) == []


def test_max_rel_err_catches_nan_and_shape():
    a = torch.ones(3)
    assert selftest_cases.max_rel_err(a, a) == 0.0
    assert selftest_cases.max_rel_err(torch.tensor([1.0, float("nan"), 1.0]), a) == float("inf")
    assert selftest_cases.max_rel_err(torch.ones(2), a) == float("inf")
    assert abs(selftest_cases.max_rel_err(torch.tensor([1.0, 1.5]), torch.tensor([1.0, 2.0])) - 0.25) < 1e-12


def test_compile_check_without_nvcc_says_skipped(monkeypatch):
    from flashkda_ext.jit import toolchain

    def missing():
        raise jit.ToolchainError("no CUDA compiler found")

    monkeypatch.setattr(toolchain, "find_nvcc", missing)
    o = selftest.compile_check(fresh=False)
    assert o.status == "SKIP" and o.detail == "skipped: no nvcc"


def test_compile_check_picks_a_cuda_module():
    rec = selftest.pick_compile_module()
    cuda = [r for r in jit.all_records() if r["backend"] == "cuda"]
    if not cuda:
        assert rec is None
    else:
        assert rec["backend"] == "cuda" and rec["name"] in {r["name"] for r in cuda}


def test_cuda_case_choice_hits_every_reachable_rule():
    """The GPU selftest's shapes come from host metadata only: check on CPU (meta tensors) that each
    CUDA route rule a candidate can reach is chosen once, and that every chosen case really selects
    the module it is labelled with."""
    specs, unreached = selftest_shapes.cuda_specs(quick=False, big_pool_bytes=64 << 30, long_bytes=64 << 30)
    for s in specs:
        assert s.device == "cuda"
        assert selftest_shapes._spec_meta(s)[1] == s.extra["module"]
    keys = [(s.family, selftest_shapes._spec_meta(s)) for s in specs]
    assert len(keys) == len(set(keys))
    # decode: when its routes exist, the repeated-slot rule is among those reached
    try:
        rules = {r["name"] for r in jit.routes_for("kda_decode")}
    except KeyError:
        rules = set()
    if "repeated" in rules:
        assert any(selftest_shapes._spec_meta(s)[0] == "repeated" for s in specs if s.family == "kda_decode")
    # every routed family's CUDA modules are in the GPU selftest (the families from the route files)
    for fam in (p.stem for p in (paths.data_root() / "jit" / "routes").glob("*.json")):
        cuda = {r["name"] for r in jit.all_records() if r["family"] == fam and r["backend"] == "cuda"}
        routed = {s.extra["module"] for s in specs if s.family == fam}
        assert routed and routed <= cuda, fam
        opt_in = {r["name"] for r in jit.routes_for(fam) if "opt_in" in r}  # taken only when opted in
        assert not [u for u in unreached if u.startswith(f"{fam}: rule") and u.split("'")[1] not in opt_in], unreached
        if fam.endswith("verify"):  # and every verify module (decode's shadowed twins are reported)
            assert not [u for u in unreached if u.startswith(fam + ":")], unreached


def test_build_list_and_trace_commands(capsys, tmp_path):
    assert cli.main(["build", "--list", "cpu_*"]) == 0
    assert "cpu_kda_decode" in capsys.readouterr().out
    assert cli.main(["build", "no_such_module_*"]) == 2
    capsys.readouterr()
    assert cli.main(["trace", "list"]) == 0
    assert "kda_prefill" in capsys.readouterr().out
    out = tmp_path / "def.json"
    assert cli.main(["trace", "dump", "kda_decode", "--heads", "4", "--value-heads", "8", "--check",
                     "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["axes"]["num_heads"]["value"] == 4 and d["axes"]["num_v_heads"]["value"] == 8


def test_build_cpu_module(capsys):
    assert cli.main(["build", "cpu_kda_decode"]) == 0
    assert "1/1 ok" in capsys.readouterr().out


def test_bench_runs_the_script(capfd):
    """`bench NAME [flags]` runs benchmarks/<script> with the flags passed on (here just --help; the
    scripts' CPU dry runs are tested in test_bench_harness.py)."""
    if bench.benchmarks_dir() is None:
        pytest.skip("no benchmarks/ folder (installed wheel)")
    assert cli.main(["bench", "fused", "--help"]) == 0
    out = capfd.readouterr().out
    assert "bench_fused_decode.py" in out and "--dry-run" in out


@pytest.mark.parametrize("op,extra", [
    ("kda_decode", ["--gate", "bounded", "--state-dtype", "bfloat16", "--slot-mode", "padded"]),
    ("kda_prefill", ["--gate", "log", "--checkpoint-every", "64"]),
    ("fused_kda_decode", ["--heads", "16", "--backend", "cpu", "--input-dtype", "float32"]),
    ("kda_verify", ["--gate", "bounded", "--state-dtype", "bfloat16", "--tokens", "8", "--seqs", "4"]),
    ("fused_kda_verify", ["--heads", "16", "--gate", "log", "--tokens", "6", "--seqs", "3"]),
])
def test_trace_dump_every_op(op, extra, tmp_path):
    from flashkda_ext import trace

    out = tmp_path / "d.json"
    assert cli.main(["trace", "dump", op, *extra, "--check", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    trace.validate_definition(d)
    assert d["name"].startswith(op)


# ---------------------------------------------------------------------------------------------
# the defects of issue 34, one test each


def test_selftest_with_jit_disabled_builds_nothing(tmp_path):
    """selftest loads modules as the ops do: with FLASHKDA_EXT_DISABLE_JIT=1 and no AOT artifact it
    reports the loader's refusal per case and builds nothing (it used to rebuild every CPU module)."""
    cache, aot = tmp_path / "cache", tmp_path / "aot"
    aot.mkdir()
    env = dict(os.environ, FLASHKDA_EXT_DISABLE_JIT="1", FLASHKDA_EXT_CACHE_DIR=str(cache),
               FLASHKDA_EXT_AOT_DIR=str(aot))
    env.pop("FLASHKDA_EXT_TRACE_DIR", None)
    r = subprocess.run([sys.executable, "-m", "flashkda_ext", "selftest", "--cpu-only", "--only", "kda_decode:f32*",
                        "--seed", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    assert "FLASHKDA_EXT_DISABLE_JIT=1 forbids" in r.stdout
    assert "JIT:" not in r.stdout and "built in" not in r.stdout
    assert not list(cache.rglob("*.so")) and not list(cache.rglob("meta.json"))
    assert "compile check" in r.stdout and "SKIP" in r.stdout   # the nvcc check builds too: skipped


@pytest.fixture
def fresh_loads(monkeypatch):
    """An empty FIRST_LOAD_S for the test (the cases and the driver share the one dict)."""
    loads = {}
    monkeypatch.setattr(selftest_cases, "FIRST_LOAD_S", loads)
    monkeypatch.setattr(selftest, "FIRST_LOAD_S", loads)
    return loads


def test_prebuild_takes_a_verified_aot_artifact_and_builds_nothing(monkeypatch, fresh_loads):
    from flashkda_ext.jit import loader

    loaded = []
    monkeypatch.setattr(loader, "find_aot", lambda rec, arch, root=None: (Path("/aot/x.so"), []))
    monkeypatch.setattr(jit, "ensure_built", lambda *a, **k: pytest.fail("built although an AOT artifact verified"))
    monkeypatch.setattr(loader, "load_module", lambda name, *a, **k: loaded.append(name))
    assert selftest.prebuild(["cpu_kda_decode"]) == {}
    assert loaded == ["cpu_kda_decode"] and "cpu_kda_decode" in fresh_loads


def test_load_time_is_the_load_not_the_build(monkeypatch, fresh_loads, capsys):
    """Right after a build, a case's "load" is the module's first load, timed apart from the build."""
    import time

    from flashkda_ext.jit import loader

    def slow_build(name, arch=None, **kw):
        time.sleep(0.5)
        return jit.BuildResult(name, "host", "0" * 64, Path("/cache/x.so"), True, 0.5, {})

    monkeypatch.setattr(loader, "find_aot", lambda rec, arch, root=None: (None, []))
    monkeypatch.setattr(loader, "jit_disabled", lambda: False)
    monkeypatch.setattr(jit, "ensure_built", slow_build)
    monkeypatch.setattr(loader, "load_module", lambda name, *a, **k: time.sleep(0.02))
    assert selftest.prebuild(["cpu_kda_decode"]) == {}
    assert 0.015 < fresh_loads["cpu_kda_decode"] < 0.4
    assert "built in 0.5 s" in capsys.readouterr().out
    assert selftest_cases.load_seconds("cpu_kda_decode") == fresh_loads["cpu_kda_decode"]


def test_selftest_only_matching_nothing_says_so(capsys):
    rc = cli.main(["selftest", "--cpu-only", "--no-compile-check", "--only", "nosuch"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--only nosuch matched no case" in err and "kda_decode" in err


def test_bench_help_exits_zero(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "decode" in out and "bench_prefill.py" in out
    assert cli.main(["bench"]) == 2
    assert "name a benchmark" in capsys.readouterr().err


def test_build_unknown_module_is_a_short_error_with_suggestions(capsys):
    assert cli.main(["build", "cpu_kda_decod"]) == 2
    err = capsys.readouterr().err
    assert "no module matches 'cpu_kda_decod'" in err and "did you mean cpu_kda_decode" in err
    assert len(err) < 400        # not the whole list of module names
    assert cli.main(["build", "nosuch_module"]) == 2
    err = capsys.readouterr().err
    assert "'nosuch_module'" in err and "build --list" in err and len(err) < 400


def test_build_backend_alone_builds_that_backend(monkeypatch, capsys):
    built = []

    def fake_build(name, arch=None, **kw):
        built.append(name)
        return jit.BuildResult(name, "host", "0" * 64, Path(f"/cache/{name}.so"), False, 0.0, {})

    monkeypatch.setattr(jit, "ensure_built", fake_build)
    assert cli.main(["build", "--backend", "cpu"]) == 0
    cpu = sorted(r["name"] for r in jit.all_records() if r["backend"] == "cpu")
    assert sorted(built) == cpu
    out = capsys.readouterr().out
    assert f"{len(cpu)}/{len(cpu)} ok" in out
    assert cli.main(["build", "--backend", "cpu", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]]
    assert sorted(listed) == cpu
    assert cli.main(["build"]) == 2
    assert "--backend" in capsys.readouterr().err


def _walk_parsers(parser, path=()):
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk_parsers(sub, path + (name,))


def test_every_option_has_help_text():
    import argparse

    missing = []
    for path, parser in _walk_parsers(cli.build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help:
                missing.append(" ".join(path + (action.dest,)))
    assert not missing


def _bench_module(name):
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_bench_results_default_outside_the_checkout(monkeypatch, tmp_path):
    if bench.benchmarks_dir() is None:
        pytest.skip("no benchmarks/ folder (installed wheel)")
    harness = _bench_module("harness")
    assert ROOT not in harness.DEFAULT_OUT.resolve().parents
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(tmp_path))
    assert harness._default_out() == tmp_path / "bench-results"
    decode = _bench_module("bench_decode")
    cfg = harness.config_from_args(decode.parse([]))
    assert ROOT not in Path(cfg.out_dir).resolve().parents


def test_bench_overhead_never_negative():
    if bench.benchmarks_dir() is None:
        pytest.skip("no benchmarks/ folder (installed wheel)")
    ov = _bench_module("bench_overhead")
    summary = lambda median, spread: {"median": median, "p10": median - spread, "p90": median + spread}  # noqa: E731
    noisy = ov.overhead(summary(10.0, 1.0), summary(10.4, 1.0))      # "op" faster than "direct": noise
    assert noisy["us"] == 0.0 and not noisy["resolved"] and noisy["measured_us"] < 0
    text = ov.format_overhead("validate_dispatch", noisy)
    assert "within noise" in text and "-0.4" in text and "noise +-2.0" in text
    real = ov.overhead(summary(15.0, 0.5), summary(10.0, 0.5))
    assert real["resolved"] and real["us"] == 5.0
    assert ov.format_overhead("trace", real) == "trace 5.0 us (noise +-1.0)"


def test_outcome_lines_fit_100_columns():
    o = selftest_cases.Outcome("kda_prefill", "T=8x1088 HV=64 bf16 softplus pool ckpt=64 slots=2097153 extra",
                               "cuda", route="pool_varlen_checkpointed_long", module="prefill_fast_vt64s_bf16_o64",
                               status="FAIL", out_err=1.23e-3, state_err=4.5e-2, tol=3e-2, load_s=0.012,
                               call_ms=12.5, detail="error 4.50e-02 > tol 3e-02; " * 8)
    lines = o.lines()
    assert all(len(line) <= selftest_cases.LINE_WIDTH for line in lines), lines
    text = "\n".join(lines)
    assert "prefill_fast_vt64s_bf16_o64" in text and "load 12 ms" in text and "call 12.50 ms" in text


@pytest.mark.parametrize("gate,pool,null_slot0", [("softplus", False, False), ("bounded", True, False),
                                                 ("bounded", True, True)])
def test_long_prefill_reference_in_windows_equals_the_recurrence(gate, pool, null_slot0, monkeypatch):
    """The selftest's reference for prompts of >= LONG_PREFILL_TOKENS (kda_chunked on every head at once, each sequence
    in windows, a window from the state the one before ended with) gives the float64 recurrence's output (kept in
    float32: its memory at 1M tokens) and final state (a pool: its padding and untouched slots as they were), on a
    short call with windows of 32 tokens: a sequence in one partial window, an empty one, one over two windows."""
    monkeypatch.setattr(selftest_cases, "LONG_REFERENCE_CHUNK", 16)
    monkeypatch.setattr(selftest_cases, "LONG_REFERENCE_WINDOW", 32)
    torch.manual_seed(3)
    T, HV, K, V = 70, 3, 8, 6
    q, k = torch.randn(1, T, HV, K, dtype=torch.float64), torch.randn(1, T, HV, K, dtype=torch.float64)
    v, g = torch.randn(1, T, HV, V, dtype=torch.float64), torch.randn(1, T, HV, K, dtype=torch.float64)
    beta = torch.randn(1, T, HV, dtype=torch.float64)
    kw = dict(cu_seqlens=torch.tensor([0, 30, 30, 70], dtype=torch.int32), checkpoint_every=0, gate=gate,
              A_log=torch.rand(HV) - 1.0, dt_bias=torch.randn(HV * K) * 0.5)
    if gate == "bounded":
        kw["lower_bound"] = -5.0
    if pool:    # the empty sequence on slot 1, the last on the null block when slot 0 is one (padding)
        kw.update(initial_state=torch.randn(6, HV, V, K, dtype=torch.float64),
                  state_indices=torch.tensor([4, 1, 0 if null_slot0 else 2], dtype=torch.int32), null_slot0=null_slot0)
    else:
        kw.update(initial_state=torch.randn(3, HV, V, K, dtype=torch.float64))
    from flashkda_ext.reference import kda_recurrent

    want_o, want_f, _ = kda_recurrent(q, k, v, g, beta, **kw)
    got_o, got_f, _ = selftest_cases._windowed_prefill_reference(q, k, v, g, beta, kw)
    assert got_o.dtype == torch.float32 and selftest_cases.max_rel_err(got_o, want_o) < 1e-6
    assert got_f.dtype == want_f.dtype and selftest_cases.max_rel_err(got_f, want_f) < 1e-9
    if pool:
        assert torch.equal(got_f[[0, 3, 5]], kw["initial_state"][[0, 3, 5]])     # slots no sequence names


def test_long_prefill_reference_in_windows_dense_batch_and_no_initial_state(monkeypatch):
    """The windowed reference on a dense batch (B = 2, no offsets) from zero states: the recurrence's output and final
    states, each sequence over three windows."""
    monkeypatch.setattr(selftest_cases, "LONG_REFERENCE_CHUNK", 8)
    monkeypatch.setattr(selftest_cases, "LONG_REFERENCE_WINDOW", 16)
    torch.manual_seed(4)
    B, T, HV, K, V = 2, 40, 2, 8, 8
    q, k = torch.randn(B, T, HV, K), torch.randn(B, T, HV, K)
    v, g, beta = torch.randn(B, T, HV, V), torch.randn(B, T, HV, K), torch.randn(B, T, HV)
    kw = dict(cu_seqlens=None, checkpoint_every=0, gate="softplus", A_log=torch.rand(HV) - 1.0,
              dt_bias=torch.randn(HV * K) * 0.5)
    from flashkda_ext.reference import kda_recurrent

    want_o, want_f, _ = kda_recurrent(q, k, v, g, beta, **kw)
    got_o, got_f, _ = selftest_cases._windowed_prefill_reference(q, k, v, g, beta, kw)
    assert selftest_cases.max_rel_err(got_o, want_o) < 1e-6 and selftest_cases.max_rel_err(got_f, want_f) < 1e-9


@pytest.mark.parametrize("flag", ["--jobs", "--parallel"])
def test_build_counts_below_one_are_refused_by_name(flag, capsys):
    from flashkda_ext import cli
    with pytest.raises(SystemExit) as exc:       # argparse's exit 2: no clamp to 1 in silence
        cli.main(["build", "--list", "cpu_*", flag, "0"])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
