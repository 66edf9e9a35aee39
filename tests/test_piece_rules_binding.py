"""The piece rules the bindings run (csrc/prefill/kda_piece_rules.h: pieces_for_waves, piece_chunks_for_work,
fused_split_pieces) against
scripts/warmup_lengths.py's mirror of them, which the CPU schedule tests and the GPU tests' premises use: the header
compiled as it is with the host C++ compiler into a small program, fed a grid of sizes, its answers compared with the
mirror's. Needs a C++ compiler only (no CUDA, no GPU)."""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from warmup_lengths import c16_split, piece_chunks_for_work, pieces_for_waves  # noqa: E402

from flashkda_ext.jit import toolchain  # noqa: E402

MAIN = r"""
#include "prefill/kda_piece_rules.h"
#include <cstdio>
int main() {
  long long slots, heads, seqs, chunks, max_pieces;
  while (std::scanf("%lld %lld %lld %lld %lld", &slots, &heads, &seqs, &chunks, &max_pieces) == 5)
    std::printf("%d %d %d %d %d %d\n", fkda::piece_chunks_for_work(slots, heads, seqs, chunks),
                fkda::pieces_for_waves(max_pieces, slots, heads * seqs, chunks),
                fkda::pieces_for_one_wave(max_pieces, slots, heads * seqs),
                fkda::fused_split_pieces(max_pieces, slots, slots, heads * seqs, chunks, false),
                fkda::fused_split_pieces(max_pieces, 2 * slots, slots, heads * seqs, chunks, false),
                fkda::fused_split_pieces(max_pieces, slots, slots, heads * seqs, chunks, true));
  return 0;
}
"""


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    try:
        cxx = toolchain.find_cxx()
    except Exception as e:  # noqa: BLE001 - no compiler on this machine
        pytest.skip(f"no C++ compiler: {e}")
    d = tmp_path_factory.mktemp("piece_rules")
    (d / "main.cc").write_text(MAIN)
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(ROOT / "csrc"), str(d / "main.cc"), "-o", str(d / "rules")],
                   check=True, capture_output=True, text=True)
    return d / "rules"


def test_the_mirror_gives_the_headers_answers(binary):
    cases = list(itertools.product((132, 264), (1, 8, 12, 16, 24, 48, 96), (1, 2, 4, 7, 16, 64, 383),
                                   (0, 1, 4, 34, 128, 512, 2048, 65536), (16, 64)))
    out = subprocess.run([str(binary)], input="".join(f"{s} {h} {n} {c} {p}\n" for s, h, n, c, p in cases),
                         check=True, capture_output=True, text=True).stdout.split("\n")
    assert len([x for x in out if x]) == len(cases)
    bad = []
    for (s, h, n, c, p), line in zip(cases, out):
        got = tuple(int(x) for x in line.split())
        # pieces_for_one_wave has no Python twin: c16_split inlines it as slots // items
        want = (piece_chunks_for_work(s, h, n, c), pieces_for_waves(p, s, h * n, c), max(1, min(p, s // (h * n))),
                c16_split(p, s, h * n, c), c16_split(p, s, h * n, c, decide_slots=2 * s),
                c16_split(p, s, h * n, c, past_one_wave=True))
        if got != want:
            bad.append(((s, h, n, c, p), got, want))
    assert not bad, bad[:5]
