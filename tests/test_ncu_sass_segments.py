"""scripts/ncu_sass_segments.py on a small synthetic Nsight Compute SASS export."""
import csv
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
segments = importlib.import_module("ncu_sass_segments")

HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
        "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
ROWS = [  # address, sass, samples, executed, wait, barrier, (not issued: ignored)
    ["0x10", "LDSM.16.M88.4 R4, [R2]", "10", "8", "10", "0", "99"],
    ["0x20", "HMMA.16816.F32.BF16 R8, R4, R6, R8", "30", "8", "30", "0", "99"],
    ["0x30", "BAR.SYNC.DEFER_BLOCKING 0x0", "20", "8", "0", "20", "99"],
    ["0x40", "@P0 BRA 0x10", "40", "16", "40", "0", "99"],
]


def test_segments_and_stall_reasons(tmp_path, capsys):
    path = tmp_path / "k.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["==PROF== a preamble line"])
        w.writerow(HEAD)
        w.writerows(ROWS)
    assert segments.main([str(path), "--ctas", "2", "--warps", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "5 instructions per warp, 100 stall samples"  # 40 executed / 8 warps
    seg0 = next(line for line in out if line.strip().startswith("0 "))
    assert "60.0%" in seg0 and "60.0%" in seg0.split("%", 1)[1]  # 60 of 100 samples, 24 of 40 instr
    assert "stall reasons: wait 80.0%, barrier 20.0%" in out
    ops = next(line for line in out if line.startswith("opcodes"))
    assert "BRA 40.0/40.0%" in ops and "HMMA 30.0/20.0%" in ops  # the guard @P0 is not the opcode


def test_show_lists_a_segments_instructions(tmp_path, capsys):
    path = tmp_path / "k.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEAD)
        w.writerows(ROWS)
    assert segments.main([str(path), "--ctas", "2", "--warps", "4", "--show", "1", "--show", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    i = out.index("segment 1: address, % of all samples, executions per warp, instruction")
    assert out[i + 1].split() == ["0x40", "40.00%", "2.00", "@P0", "BRA", "0x10"]  # 16 executions / 8 warps
    assert "no segment 5 (0..1)" in out


def test_a_report_of_two_launches_reads_the_first(tmp_path, capsys):
    """ncu --launch-count 2 exports two tables, each under its header (the c16 profile of 2026-12-04 crashed on the
    second header's 'Instructions Executed'): the first launch's table is the one read."""
    path = tmp_path / "k.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEAD)
        w.writerows(ROWS)
        w.writerow(HEAD)
        w.writerows([[r[0], r[1], "1000", "1000"] + r[4:] for r in ROWS])
    assert segments.main([str(path), "--ctas", "2", "--warps", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "5 instructions per warp, 100 stall samples"
