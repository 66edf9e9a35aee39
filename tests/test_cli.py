"""The command line: `python -m flashkda_ext info` and `selftest` run on a CPU machine and return 0;
selftest reports a wrong result as a failure; the subcommands' helpers behave."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashkda_ext import cli, jit

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


def test_info_text():
    r = run_cli("info", timeout=180)
    assert r.returncode == 0, r.stderr
    for word in ("tvm-ffi", "torch", "JIT cache", "AOT dirs", "routes"):
        assert word in r.stdout


def test_selftest_cpu_passes():
    """The README's main job on this machine (CPU routes; the nvcc compile check is tested below)."""
    r = run_cli("selftest", "--cpu-only", "--no-compile-check", timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "PASS" in r.stdout and "FAIL" not in r.stdout.split("family")[-1]
    for fam in ("kda_decode", "kda_prefill", "fused_kda_decode"):
        assert f"cpu_{fam}" in r.stdout


def test_selftest_reports_failures(monkeypatch, capsys):
    """With a zero tolerance every inexact result fails, and the exit code says so."""
    monkeypatch.setattr(cli, "tolerance", lambda *d: 0.0)
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


def test_max_rel_err_catches_nan_and_shape():
    a = torch.ones(3)
    assert cli.max_rel_err(a, a) == 0.0
    assert cli.max_rel_err(torch.tensor([1.0, float("nan"), 1.0]), a) == float("inf")
    assert cli.max_rel_err(torch.ones(2), a) == float("inf")
    assert abs(cli.max_rel_err(torch.tensor([1.0, 1.5]), torch.tensor([1.0, 2.0])) - 0.25) < 1e-12


def test_compile_check_without_nvcc_says_skipped(monkeypatch):
    from flashkda_ext.jit import toolchain

    def missing():
        raise jit.ToolchainError("no CUDA compiler found")

    monkeypatch.setattr(toolchain, "find_nvcc", missing)
    o = cli.compile_check(fresh=False)
    assert o.status == "SKIP" and o.detail == "skipped: no nvcc"


def test_compile_check_picks_a_cuda_module():
    rec = cli.pick_compile_module()
    cuda = [r for r in jit.all_records() if r["backend"] == "cuda"]
    if not cuda:
        assert rec is None
    else:
        assert rec["backend"] == "cuda" and rec["name"] in {r["name"] for r in cuda}


def test_cuda_case_choice_hits_every_reachable_rule():
    """The GPU selftest's shapes come from host metadata only: check on CPU (meta tensors) that each
    CUDA route rule a candidate can reach is chosen once, and that every chosen case really selects
    the module it is labelled with."""
    specs, unreached = cli.cuda_specs(quick=False, big_pool_bytes=64 << 30)
    for s in specs:
        assert s.device == "cuda"
        assert cli._spec_meta(s)[1] == s.extra["module"]
    keys = [(s.family, cli._spec_meta(s)) for s in specs]
    assert len(keys) == len(set(keys))
    # decode: when its routes exist, the repeated-slot rule is among those reached
    try:
        rules = {r["name"] for r in jit.routes_for("kda_decode")}
    except KeyError:
        rules = set()
    if "repeated" in rules:
        assert any(cli._spec_meta(s)[0] == "repeated" for s in specs if s.family == "kda_decode")


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
    if cli.benchmarks_dir() is None:
        pytest.skip("no benchmarks/ folder (installed wheel)")
    assert cli.main(["bench", "fused", "--help"]) == 0
    out = capfd.readouterr().out
    assert "bench_fused_decode.py" in out and "--dry-run" in out


@pytest.mark.parametrize("op,extra", [
    ("kda_decode", ["--gate", "bounded", "--state-dtype", "bfloat16", "--slot-mode", "padded"]),
    ("kda_prefill", ["--gate", "log", "--checkpoint-every", "64"]),
    ("fused_kda_decode", ["--heads", "16", "--backend", "cpu", "--input-dtype", "float32"]),
])
def test_trace_dump_every_op(op, extra, tmp_path):
    from flashkda_ext import trace

    out = tmp_path / "d.json"
    assert cli.main(["trace", "dump", op, *extra, "--check", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    trace.validate_definition(d)
    assert d["name"].startswith(op)
