"""flashkda_ext.devtools.sass: machine-code statistics per kernel from cuobjdump output (registers,
spills, instruction, branch and barrier counts), for a module and against a baseline tree."""
import pytest

from flashkda_ext.devtools import sass, testing
from flashkda_ext.jit.toolchain import have_cuobjdump, have_nvcc

SASS = """
Fatbin elf code:
================
arch = sm_90a

\tcode for sm_90a
\t\tFunction : _Z3fooPf
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
                                                                                /* 0x000fe20000000800 */
        /*0010*/              @!P0 BRA 0x80 ;                                   /* 0x0000000000007947 */
        /*0020*/                   BSSY B0, 0x70 ;                              /* 0x0000000000007945 */
        /*0030*/                   MUFU.EX2 R4, -|R2| ;                         /* 0x0000000000007308 */
        /*0040*/                   STL [R1+0x4], R8 ;                           /* 0x0000000000007387 */
        /*0050*/               @P1 LDG.E.128 R4, desc[UR4][R2.64] ;             /* 0x0000000000007981 */
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                /* 0x0000000000007b1d */
        /*0070*/                   LDL.LU R7, [R1] ;                            /* 0x0000000000007983 */
        /*0080*/                   EXIT ;                                       /* 0x000000000000794d */
\t\t..........

\t\tFunction : _Z3barv
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;        /* 0x000000000000723c */
        /*0010*/                   EXIT ;                                       /* 0x000000000000794d */
"""

RES = """
Resource usage:
 Common:
  GLOBAL:0
 Function _Z3fooPf:
  REG:128 STACK:8 SHARED:1024 LOCAL:0 CONSTANT[0]:640 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z3barv:
  REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:360 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_opcodes_resources_and_groups_from_cuobjdump_text():
    ops = sass.parse_sass(SASS)
    assert ops["_Z3fooPf"] == ["LDC", "BRA", "BSSY", "MUFU", "STL", "LDG", "BAR", "LDL", "EXIT"]
    assert ops["_Z3barv"] == ["HMMA", "EXIT"]
    res = sass.parse_res_usage(RES)
    assert res["_Z3fooPf"]["REG"] == 128 and res["_Z3fooPf"]["STACK"] == 8 and res["_Z3barv"]["REG"] == 40
    foo = sass.summarize(ops["_Z3fooPf"], res["_Z3fooPf"])
    assert (foo["instructions"], foo["BRA"], foo["BSSY"], foo["BAR"], foo["MUFU"], foo["LDG"], foo["spill"]) == \
        (9, 1, 1, 1, 1, 1, 2)
    assert foo["REG"] == 128 and foo["STACK"] == 8
    bar = sass.summarize(ops["_Z3barv"], res["_Z3barv"])
    line = sass.format_row("_Z3barv", bar, 3)
    assert "REG 40" in line and "2 instr" in line and "HMMA 1" in line
    assert sass.format_delta(foo, foo).endswith("no difference in these counts")
    assert "instructions 9 -> 2" in sass.format_delta(foo, bar)


@pytest.mark.skipif(not (have_nvcc() and have_cuobjdump()), reason="needs nvcc and cuobjdump")
def test_toy_module_against_a_baseline(tmp_path, capsys):
    base = testing.make_tree(tmp_path / "base", cuda=True)
    other = testing.variant_tree(base, tmp_path / "other", add=7)
    kernels = sass.module_sass("toy_cuda", base, None, tmp_path)
    assert kernels and all(k["instructions"] > 0 and k["REG"] is not None for k in kernels.values())
    assert sass.main(["toy_cuda", "--base", str(base), "--change", str(other)]) == 0
    out = capsys.readouterr().out
    assert "base " in out and "change " in out and "change vs base" in out


def test_nvdisasm_is_looked_for_where_cuobjdump_will_run_it(tmp_path, monkeypatch):
    """cuobjdump -sass runs nvdisasm: NVDISASM_PATH first, then beside cuobjdump, then PATH."""
    from flashkda_ext.jit.toolchain import nvdisasm_dir
    tools, other = tmp_path / "bin", tmp_path / "other"
    tools.mkdir()
    other.mkdir()
    (tools / "cuobjdump").write_text("")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("NVDISASM_PATH", raising=False)
    assert nvdisasm_dir(str(tools / "cuobjdump")) is None
    (other / "nvdisasm").write_text("")
    monkeypatch.setenv("NVDISASM_PATH", str(other))
    assert nvdisasm_dir(str(tools / "cuobjdump")) == str(other)
    monkeypatch.delenv("NVDISASM_PATH")
    (tools / "nvdisasm").write_text("")
    assert nvdisasm_dir(str(tools / "cuobjdump")) == str(tools)
