"""Registry checks on the repository's jit/ data: unique names, sources exist, routes name modules,
sources read their launch macros (not literals), and CUDA modules' -Xptxas -v report fits the record.

The resource check compiles each CUDA module device-only (nvcc -cubin with the record's flags: the
same ptxas report as a full build, a fifth of its time), MAX_JOBS at a time (default: every core),
all started at the first case. The first CUDA module runs by default, the rest are marked slow;
test_compile_only_report_matches_a_build holds the shortcut to what a full build reports.
"""
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashkda_ext import paths
from flashkda_ext.devtools import testing
from flashkda_ext.devtools.resources import ptxas_report
from flashkda_ext.jit import all_records, ensure_built, registry
from flashkda_ext.jit.checks import (blocks_by_registers, macro_usage_problems, parse_ptxas,
                                     required_macros, resource_problems)
from flashkda_ext.jit.toolchain import have_nvcc

RECORDS = all_records()
CUDA = [r for r in RECORDS if r["backend"] == "cuda"]


def test_unique_names_across_files():
    # the registry refuses a duplicate (tests/test_jit_specs.py); here: none slipped through it
    names = [r["name"] for r in RECORDS]
    dups = [n for n, c in Counter(names).items() if c > 1]
    assert not dups and len(names) == len(registry().records)


def test_sources_exist():
    missing = [(r["name"], s) for r in RECORDS for s in r["sources"]
               if not (paths.csrc_dir() / s).is_file()]
    assert not missing


def test_routes_name_existing_modules():
    reg = registry()
    for family, data in reg.routes.items():
        for rule in data["rules"]:
            when = rule["when"]
            devices = when.get("device", ["cpu", "cuda"])
            for d in [devices] if isinstance(devices, str) else devices:
                for name in reg._expand(rule["module"], when, family, d, "", rule["name"]):
                    assert name in reg.records, (family, rule["name"], name)
                    assert reg.records[name]["family"] == family


@pytest.mark.parametrize("rec", RECORDS, ids=[r["name"] for r in RECORDS])
def test_sources_read_launch_macros(rec):
    assert macro_usage_problems(rec) == []


def test_macro_usage_check_catches_problems(tmp_path):
    root = testing.make_tree(tmp_path, cuda=True)
    rec = testing.cuda_record(params={"add": 2, "unused_tile": 4}, persistent_k=2,
                              abi="persistent_rows")
    probs = macro_usage_problems(rec, root)
    assert any("FKDA_PARAM_UNUSED_TILE" in p for p in probs)
    assert any("FKDA_PERSISTENT_K" in p for p in probs)
    assert "FKDA_THREADS" in required_macros(rec)
    src = root / "csrc" / "decode" / "toy.cu"
    text = src.read_text()
    src.write_text(text.replace("__launch_bounds__(FKDA_THREADS", "__launch_bounds__(128"))
    assert any("__launch_bounds__ with a literal" in p
               for p in macro_usage_problems(testing.cuda_record(), root))
    src.write_text(text.replace(", FKDA_THREADS, FKDA_SMEM_BYTES>>>", ", 128, FKDA_SMEM_BYTES>>>"))
    assert any("literal block size" in p for p in macro_usage_problems(testing.cuda_record(), root))
    # a guard that only tests whether a macro is defined, or a comment, is not a use
    (root / "csrc" / "common" / "toy.h").write_text(
        "#pragma once\n#if !defined(FKDA_PARAM_EXTRA)\n#error x\n#endif\n// FKDA_PARAM_EXTRA\n"
        "inline double toy_offset() { return 0.5; }\n")
    rec = testing.cpu_record(params={"add": 1, "extra": 2})
    assert [p for p in macro_usage_problems(rec, root) if "FKDA_PARAM_EXTRA" in p]


SAMPLE_PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'
ptxas info    : Function properties for _Z3fooPf
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 2048 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3barPf' for 'sm_90a'
ptxas info    : Function properties for _Z3barPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
"""


def test_ptxas_report_parsing_and_limits():
    k = parse_ptxas(SAMPLE_PTXAS)
    assert k["_Z3fooPf"] == {"arch": "sm_90a", "registers": 255, "smem": 2048, "stack": 8,
                             "spill_stores": 4, "spill_loads": 4}
    assert k["_Z3barPf"]["registers"] == 32 and k["_Z3barPf"]["smem"] == 0
    assert blocks_by_registers(255, 256) == 1 and blocks_by_registers(128, 256) == 2
    ok = testing.cuda_record(threads=256, min_blocks=1, smem_bytes=100000)
    assert resource_problems(ok, SAMPLE_PTXAS) == []
    regs = resource_problems(dict(ok, min_blocks=2), SAMPLE_PTXAS)
    assert len(regs) == 1 and "255 registers" in regs[0] and "_Z3fooPf" in regs[0]
    smem = resource_problems(dict(ok, smem_bytes=231000), SAMPLE_PTXAS)
    assert any("over the 232448 limit" in p for p in smem)
    assert resource_problems(ok, "") == ["toy_cuda: the -Xptxas -v report lists no kernel"]


_CUDA_PARAMS = [pytest.param(r, id=r["name"], marks=[] if i == 0 else [pytest.mark.slow])
                for i, r in enumerate(CUDA)]


@pytest.fixture(scope="session")
def ptxas_reports(request):
    """{module: future of its ptxas report} for the modules of the selected resource cases, compiled
    in threads (each nvcc a process of its own) in the order the cases run."""
    names = [item.callspec.params["rec"]["name"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_cuda_resources_fit_record"]
    jobs = max(1, int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1))
    pool = ThreadPoolExecutor(max_workers=jobs)
    futures = {n: pool.submit(ptxas_report, n) for n in dict.fromkeys(names)}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.skipif(not have_nvcc(), reason="needs nvcc")
@pytest.mark.parametrize("rec", _CUDA_PARAMS)
def test_cuda_resources_fit_record(rec, ptxas_reports):
    report = ptxas_reports[rec["name"]].result()
    assert parse_ptxas(report), "no kernel in the -Xptxas -v report"
    assert resource_problems(rec, report) == []


@pytest.mark.skipif(not have_nvcc() or not CUDA, reason="needs nvcc and a CUDA module")
def test_compile_only_report_matches_a_build(tmp_path):
    """The device-only compile the resource cases read reports what a full build's ptxas.log does."""
    rec = CUDA[0]
    res = ensure_built(rec["name"], root=None, cache=tmp_path / "cache")
    built = parse_ptxas((res.path.parent / "ptxas.log").read_text())
    assert built and parse_ptxas(ptxas_report(rec["name"], res.arch)) == built
