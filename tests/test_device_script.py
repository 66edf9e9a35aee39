"""scripts/device.sh's stage logic on a CPU: the order of its steps, the commands the stages run (DRY=1),
what it refuses, the skip without a GPU and the exit status and logs of a failed step."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None or not SCRIPT.is_file(), reason="needs bash and scripts/")


def run(tmp_path, env=None, args=(), path=None):
    e = {k: v for k, v in os.environ.items() if k not in ("STAGES", "DRY", "OUT", "TESTS")}
    e.update(OUT=str(tmp_path / "out"), **(env or {}))
    if path is not None:
        e["PATH"] = path
    return subprocess.run([BASH, str(SCRIPT), *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)


def test_syntax():
    assert subprocess.run([BASH, "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the script reads pyproject.toml with tomllib")
def test_device_wheels_script_fetches_pyprojects_tvm_ffi_and_the_cudnn_peer():
    """scripts/device_wheels.sh (the wheels .whl/ carries) parses, and the specs it would fetch hold pyproject.toml's
    apache-tvm-ffi requirement as written there and the cuDNN peer's pinned frontend."""
    import tomllib
    wheels = ROOT / "scripts" / "device_wheels.sh"
    assert subprocess.run([BASH, "-n", str(wheels)]).returncode == 0
    r = subprocess.run([BASH, str(wheels), "--print-specs"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    specs = r.stdout.split()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    tvm = [d for d in deps if d.startswith("apache-tvm-ffi")]
    assert len(tvm) == 1 and "==" in tvm[0] and tvm[0] in specs
    assert "nvidia-cudnn-frontend==1.32.0" in specs
    bad = subprocess.run([BASH, str(wheels), "--fetch-all"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--print-specs" in bad.stderr


def test_dry_run_lists_the_steps_in_stage_order(tmp_path):
    r = run(tmp_path, {"DRY": "1", "STAGES": "peers selftest build"})
    assert r.returncode == 0, r.stderr
    steps = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("DRY ")]
    assert steps == ["build", "selftest", "peers_decode", "peers_fused", "peers_verify", "peers_prefill",
                     "peers_prefill_slow"]
    lines = {line.split()[1]: line for line in r.stdout.splitlines() if line.startswith("DRY ")}
    assert "benchmarks/bench_prefill.py" in lines["peers_prefill"]
    assert "--peers cudnn,fla" in lines["peers_prefill"] and "--modes eager,kernel" in lines["peers_prefill"]
    for op in ("decode", "verify", "fused"):
        assert "--no-fla" not in lines[f"peers_{op}"] and "--no-unfused" not in lines[f"peers_{op}"]
    assert "--op-arm" in lines["peers_decode"]
    slow = lines["peers_prefill_slow"]   # the long-memory regime: one slowly decaying key a head, beside cuDNN
    assert "--slow-keys 1" in slow and "--cases H8 B1 T8K,H8 B1 T32K,H16 B1 T8K,H16 B1 T32K" in slow
    assert "--peers cudnn" in slow and "--no-fla" in slow


def test_bench_leaves_the_peers_out_and_ops_pick(tmp_path):
    r = run(tmp_path, {"DRY": "1", "STAGES": "bench", "OPS": "verify prefill", "BENCH_QUICK": "1"})
    lines = [line for line in r.stdout.splitlines() if line.startswith("DRY ")]
    assert [line.split()[1] for line in lines] == ["bench_verify", "bench_prefill"]
    assert all("--no-fla" in line and "--quick" in line for line in lines)


def test_issue46_runs_the_whole_grid_with_its_peers(tmp_path):
    """OPS=issue46: issue 46's grid with the 1M row in one file; beside cuDNN and fla (at H8 / H16 / H32) under
    peers, no peer under bench; GATES narrows the gates."""
    r = run(tmp_path, {"DRY": "1", "STAGES": "bench peers", "OPS": "issue46", "GATES": "softplus"})
    assert r.returncode == 0, r.stderr
    lines = {line.split()[1]: line for line in r.stdout.splitlines() if line.startswith("DRY ")}
    assert list(lines) == ["bench_issue46", "peers_issue46"], r.stdout
    for line in lines.values():
        assert "bench_prefill.py --grid issue46 --long --gates softplus --fla-heads 8,16,32 --modes eager" in line
        assert line.startswith(("DRY bench_issue46 (560 s):", "DRY peers_issue46 (560 s):"))
    assert "--no-fla" in lines["bench_issue46"] and "--peers" not in lines["bench_issue46"]
    assert "--peers cudnn,fla" in lines["peers_issue46"] and "--no-fla" not in lines["peers_issue46"]
    r = run(tmp_path, {"DRY": "1", "STAGES": "peers", "OPS": "issue47"})
    assert "unknown op 'issue47'" in r.stderr and "issue46" in r.stderr


def test_engines_run_both_benches_over_issue_45s_grid(tmp_path):
    r = run(tmp_path, {"DRY": "1", "STAGES": "engines peers", "OPS": "decode"})
    lines = {line.split()[1]: line for line in r.stdout.splitlines() if line.startswith("DRY ")}
    assert list(lines) == ["peers_decode", "engines_vllm", "engines_sglang"], r.stdout
    assert "bench_vllm.py --kinds decode,verify" in lines["engines_vllm"]
    assert "bench_sglang.py --phases decode,verify" in lines["engines_sglang"]
    for line in (lines["engines_vllm"], lines["engines_sglang"]):
        assert "--rows 1,64,1024 --heads 8,12,24,32 --modes graph" in line and "--no-fla" in line
    r = run(tmp_path, {"DRY": "1", "STAGES": "engines", "ENGINES": "sglang", "ENGINE_FLA": "1",
                       "ENGINE_MODES": "graph,kernel", "SGLANG_PHASES": "extend", "LIMIT_ENGINES": "99",
                       "SGLANG_ARGS": "--states f32 --drafts 4"})
    lines = [line for line in r.stdout.splitlines() if line.startswith("DRY ")]
    assert len(lines) == 1 and lines[0].startswith("DRY engines_sglang (99 s):")
    assert "--phases extend" in lines[0] and "--modes graph,kernel" in lines[0] and "--no-fla" not in lines[0]
    assert lines[0].endswith("--states f32 --drafts 4")


def test_profile_timeline_runs_the_prefill_timeline(tmp_path):
    r = run(tmp_path, {"DRY": "1", "STAGES": "profile", "PROFILE": "timeline"})
    lines = [line for line in r.stdout.splitlines() if line.startswith("DRY ")]
    assert len(lines) == 1 and lines[0].startswith("DRY timeline"), r.stdout
    assert "scripts/profile_prefill.py --calls 4 --timeline --tokens 32768 --heads 8" in lines[0]
    assert "ncu" not in lines[0]


def test_knobs_reach_the_commands(tmp_path):
    r = run(tmp_path, {"DRY": "1", "STAGES": "build tests sanitizers", "BUILD": "verify_* decode_seq_*",
                       "TESTS": "tests/gpu/test_verify_gpu.py", "TESTS_K": "stage2", "SANITIZE_ONLY": "verify_*",
                       "LIMIT_TESTS": "77"})
    out = r.stdout
    assert "build --backend cuda --parallel 16 --jobs 1 verify_* decode_seq_*" in out
    assert "DRY tests (77 s):" in out and "tests/gpu/test_verify_gpu.py -k stage2" in out
    assert "sanitize_routes.py --only verify_*" in out


def test_test_workers_reach_pytest(tmp_path):
    """TEST_WORKERS n: pytest -n n over the GPU tests; 0: one process (the default where pytest-xdist does not import)."""
    r = run(tmp_path, {"DRY": "1", "STAGES": "tests", "TEST_WORKERS": "4", "TESTS": "tests/gpu/test_verify_gpu.py"})
    line = next(x for x in r.stdout.splitlines() if x.startswith("DRY tests"))
    assert "-p no:cacheprovider -n 4 tests/gpu/test_verify_gpu.py" in line, r.stdout
    r = run(tmp_path, {"DRY": "1", "STAGES": "tests", "TEST_WORKERS": "0", "TESTS": "tests/gpu/test_verify_gpu.py"})
    line = next(x for x in r.stdout.splitlines() if x.startswith("DRY tests"))
    assert " -n " not in line and line.endswith("-p no:cacheprovider tests/gpu/test_verify_gpu.py"), r.stdout


def test_unknown_stage_and_arguments_are_refused(tmp_path):
    r = run(tmp_path, {"DRY": "1", "STAGES": "build benchmark"})
    assert r.returncode == 2 and "unknown stage 'benchmark'" in r.stderr and "DRY" not in r.stdout
    r = run(tmp_path, {"DRY": "1"}, args=("build",))
    assert r.returncode == 2 and "STAGES" in r.stderr


def test_ab_needs_its_base(tmp_path):
    r = run(tmp_path, {"DRY": "1", "STAGES": "ab"})
    assert r.returncode != 0 and "AB_BASE" in r.stderr


def _no_gpu_path(tmp_path):
    """PATH without nvidia-smi (this machine has none; the test makes sure)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    tools = ("timeout", "tar", "gzip", "date", "grep", "tail", "cat", "tr", "rm", "mkdir", "dirname", "sed", "ls",
             "tee")
    for tool in tools:
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_gpu_stages_skip_without_a_gpu(tmp_path):
    r = run(tmp_path, {"STAGES": "tests sanitizers bench peers profile"}, path=_no_gpu_path(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    for stage in ("tests", "sanitizers", "bench", "peers", "profile"):
        assert f"== {stage} skipped: no GPU" in r.stdout


def test_a_failed_step_sets_the_exit_status_and_its_log_comes_back(tmp_path):
    # a fake nvidia-smi makes this a "GPU" machine; the tests step then fails on a missing path
    path = _no_gpu_path(tmp_path)
    fake = Path(path) / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'Fake GPU, 0.0'\n")
    fake.chmod(0o755)
    r = run(tmp_path, {"STAGES": "tests", "TESTS": "tests/no_such_dir"}, path=path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "failed steps: tests "
    out = tmp_path / "out"
    with tarfile.open(out / "logs.tgz") as t:
        assert {"tests.log", "gpu.txt"} <= set(t.getnames())
    assert not (out / "tests.log").exists() and not (out / ".failed").exists()


def test_profile_kernels_and_a_quoted_ab_bench_reach_their_commands(tmp_path):
    r = run(tmp_path, {"DRY": "1", "STAGES": "profile", "PROFILE_KERNELS": "kda_prefill_c16"})
    line = next(x for x in r.stdout.splitlines() if x.startswith("DRY ncu_prefill"))
    assert "-k regex:kda_prefill_c16 " in line, line
    r = run(tmp_path, {"DRY": "1", "STAGES": "profile"})
    assert "-k regex:kda_prep|kda_state " in next(x for x in r.stdout.splitlines() if x.startswith("DRY ncu_prefill"))
    base = tmp_path / "base"
    base.mkdir()
    r = run(tmp_path, {"DRY": "1", "STAGES": "ab", "AB_BASE": str(base), "AB_ROUNDS": "1", "AB_MODULES": "",
                       "AB_BENCH": "python3 b.py --cases 'H16 64x512,H8 64x512'"})
    line = next(x for x in r.stdout.splitlines() if x.startswith("DRY ab_1_base"))
    assert "bash -c python3 b.py --cases 'H16 64x512,H8 64x512' \"$@\" ab_bench --out" in line, line
