"""The package's rooms: the op path (ops, dispatch, jit) imports no developer tool."""
import subprocess
import sys

OP_PATH = ("import flashkda_ext, flashkda_ext.ops, flashkda_ext.dispatch, flashkda_ext.jit, "
           "flashkda_ext.jit.loader, flashkda_ext.jit.builder, flashkda_ext.jit.checks, flashkda_ext.cli; "
           "import sys; print(sorted(m for m in sys.modules if m.startswith('flashkda_ext.devtools')))")


def test_op_path_imports_no_devtools():
    r = subprocess.run([sys.executable, "-c", OP_PATH], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_jit_holds_no_diagnostics():
    import flashkda_ext.jit as jit
    from pathlib import Path

    names = {p.stem for p in Path(jit.__file__).parent.glob("*.py")}
    assert not names & {"ptxdiff", "sass", "testing", "resources", "doc_tables"}
