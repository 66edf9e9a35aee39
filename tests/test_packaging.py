"""The wheel carries csrc/, jit/ and trace_templates/ as package data, and an installed wheel finds
them (JIT must work from a wheel, not only from a checkout)."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA_DIRS = ("csrc", "jit", "trace_templates")
SKIP = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".cache", ".whl",
                              ".pytest_cache", "*.so", "*.o", "results")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Build from a copy: building in place would leave build/ and *.egg-info in the checkout.
    src = tmp_path_factory.mktemp("src") / "flashkda_ext_src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("flashkda_ext-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_every_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = []
    for d in DATA_DIRS:
        for f in (ROOT / d).rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".so", ".o", ".pyc"):
                expected.append("flashkda_ext/_data/" + f.relative_to(ROOT).as_posix())
    assert len(expected) > 20
    missing = [e for e in expected if e not in names]
    assert not missing, f"missing from the wheel: {missing[:10]}"
    assert "flashkda_ext/ops.py" in names


def test_installed_wheel_finds_its_data_and_specs(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = ("import flashkda_ext.paths as p, flashkda_ext.jit as j; r = p.data_root(); print(r); "
            "print(len(j.all_records()))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stdout + run.stderr
    root_line, count_line = run.stdout.strip().splitlines()[-2:]
    assert root_line == str(target / "flashkda_ext" / "_data")
    assert int(count_line) >= 3
