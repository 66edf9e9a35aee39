"""The GPU tests (tests/gpu/, skipped without CUDA) call the benchmarks' input builders and runners; CI has no
GPU, so a benchmark signature change could leave them calling the old one until a device run (5aca949 changed
bench_sglang.extend_inputs, and every extend case of test_sglang_gpu.py failed with a TypeError on the next GPU
run, two sessions later). Here each such call is bound to the function's current signature, without running it."""
import ast
import importlib
import inspect
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
GPU_TESTS = sorted((ROOT / "tests" / "gpu").glob("*.py"))


def bench_calls(path: Path):
    """(line, module, function, positional count, keyword names) of every call alias.function(...) where alias
    names a module of benchmarks/ imported by the file; calls with *args / **kwargs are left out."""
    tree = ast.parse(path.read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (BENCH / f"{a.name}.py").exists():
                    aliases[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in aliases):
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                continue
            yield (node.lineno, aliases[node.func.value.id], node.func.attr, len(node.args),
                   [k.arg for k in node.keywords])


CALLS = [(p.name, *c) for p in GPU_TESTS for c in bench_calls(p)]


def test_the_gpu_tests_call_benchmarks():
    assert len(CALLS) >= 10 and {c[2] for c in CALLS} >= {"bench_sglang", "bench_vllm"}


@pytest.mark.parametrize("file, line, module, function, npos, keywords", CALLS,
                         ids=[f"{c[0]}:{c[1]}:{c[3]}" for c in CALLS])
def test_gpu_test_calls_bind_to_the_benchmark_signature(file, line, module, function, npos, keywords):
    sys.path.insert(0, str(BENCH))
    try:
        mod = importlib.import_module(module)
    finally:
        sys.path.remove(str(BENCH))
    fn = getattr(mod, function, None)
    assert fn is not None, f"{file}:{line}: {module}.{function} no longer exists"
    if not callable(fn) or inspect.isclass(fn):
        return
    try:
        inspect.signature(fn).bind(*range(npos), **dict.fromkeys(keywords))
    except TypeError as e:
        pytest.fail(f"{file}:{line}: {module}.{function}(...) does not bind to its signature "
                    f"{inspect.signature(fn)}: {e}")
