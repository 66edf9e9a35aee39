"""Every ```python block of README.md and docs/*.md runs on its own, so no example rots and a reader
can paste any one of them into a fresh interpreter.

Each block is a test of its own (id: file:line), run in a fresh namespace (no name an earlier block
made), from an empty working folder, with os.environ restored afterwards. A block is skipped only when
it says so on its first line: `# gpu-only` (runs when CUDA is available) or when it imports jax and jax
is not installed.
"""
import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
JAX_IMPORT = re.compile(r"^\s*(import jax\b|from jax\b|import flashkda_ext\.jax\b|from flashkda_ext(\.jax)? import jax\b"
                        r"|from flashkda_ext\.jax\b)", re.M)


def doc_files():
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    return [f for f in files if f.is_file()]


def python_blocks(text: str):
    """[(line number of the block's first code line, code)]."""
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start(1)) + 1
        out.append((line, m.group(1)))
    return out


def skip_reason(code: str):
    first = code.lstrip().splitlines()[0].strip().lower() if code.strip() else ""
    if first.startswith("# gpu-only") and not torch.cuda.is_available():
        return "marked gpu-only and no GPU here"
    if JAX_IMPORT.search(code) and (importlib.util.find_spec("jax") is None
                                    or importlib.util.find_spec("jax_tvm_ffi") is None):
        return "uses jax, which is not installed"
    return None


def test_fence_parser():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\n# gpu-only\ny = 2\n```\n"
    blocks = python_blocks(text)
    assert [b[1] for b in blocks] == ["x = 1\n", "# gpu-only\ny = 2\n"]
    assert blocks[0][0] == 3
    assert skip_reason(blocks[1][1]) == (None if torch.cuda.is_available() else "marked gpu-only and no GPU here")
    assert skip_reason("import numpy\n") is None


def all_blocks():
    """pytest params: one per python block of every doc file, id 'file:line'."""
    out = []
    for path in doc_files():
        rel = str(path.relative_to(ROOT))
        out += [pytest.param(rel, line, code, id=f"{rel}:{line}") for line, code in python_blocks(path.read_text())]
    return out


def test_every_doc_file_with_examples_is_collected():
    files = {p.values[0] for p in all_blocks()}
    assert "README.md" in files and "docs/api.md" in files and "docs/integrations.md" in files


@pytest.mark.parametrize("rel,line,code", all_blocks())
def test_doc_example_runs_on_its_own(rel, line, code, tmp_path, monkeypatch):
    why = skip_reason(code)
    if why:
        pytest.skip(why)
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    # examples that start `python -m flashkda_ext` find this checkout even without `pip install -e`
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    saved_env = dict(os.environ)
    ns = {"__name__": f"doc_example_{Path(rel).stem}_{line}"}
    try:
        exec(compile(code, f"{rel}:{line}", "exec"), ns)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{rel}, python block at line {line} failed on its own: {type(e).__name__}: {e}") from e
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def test_api_reference_covers_every_public_op_and_argument():
    """docs/api.md has a section per public op and names every one of its parameters, so an
    argument added to an op without documentation fails here."""
    import inspect

    import flashkda_ext

    text = (ROOT / "docs" / "api.md").read_text()
    for name in flashkda_ext.__all__:
        if name.startswith("__"):
            continue
        assert f"## {name}" in text, f"docs/api.md has no section for {name}"
        section = text.split(f"## {name}", 1)[1].split("\n## ", 1)[0]
        for param in inspect.signature(getattr(flashkda_ext, name)).parameters:
            assert f"`{param}`" in section, f"docs/api.md: {name} does not document argument {param!r}"
