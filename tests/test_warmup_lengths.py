"""scripts/warmup_lengths.py (CPU): the piece splits' warm-up lengths for the benchmarks' gate parameters.

What csrc/prefill/README.md says from it ("Piece split", realistic gates): on the benchmarks' random gates a warm-up is
one chunk (bounded) or a few hundred tokens (softplus); with A_log / dt_bias drawn as fla 0.6.0 initialises a KDA layer
the slowest key of a token decays by ~1e-3 nats, and warm-ups walk thousands of tokens back, many of them to chunk 0.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]


def script():
    spec = importlib.util.spec_from_file_location("warmup_lengths", ROOT / "scripts" / "warmup_lengths.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_fla_init_gates_walk_far_back_and_random_gates_do_not(gate):
    wl = script()
    T, H, P = 8192, 2, 8
    res = {}
    for kind in ("random", "fla-init"):
        cb = wl.chunk_bounds(T, H, gate, kind, torch.Generator().manual_seed(0), 64)
        w, per = wl.walks(cb, P)
        assert per == 16 and len(w) == H * (P - 1)
        res[kind] = sorted(x for x, _ in w)
    # random: a warm-up is one chunk (bounded) or a few hundred tokens (softplus), below the 1024-token piece
    assert res["random"][-1] <= (1 if gate == "bounded" else 15), res["random"]
    # fla-init: the median warm-up is longer than a piece, and some walk to chunk 0 (a piece starts exact only there)
    assert res["fla-init"][len(res["fla-init"]) // 2] > 16, res["fla-init"]


def test_the_walk_stops_at_the_first_crossing_and_at_chunk_0():
    wl = script()
    cb = torch.tensor([[-10.0], [-10.0], [-10.0], [-30.0], [-1.0], [-1.0]], dtype=torch.float64)
    w, per = wl.walks(cb, 3)   # pieces of 2 chunks: piece 1 starts at chunk 2, piece 2 at chunk 4
    assert per == 2
    assert w == [(2, True), (1, False)]   # -10 - 10 > -24: to chunk 0; -30 <= -24 at once


def test_the_script_prints_its_table(capsys):
    script().main(["--tokens", "4096", "--heads", "2"])
    out = capsys.readouterr().out
    assert "fla-init" in out and "random" in out and out.count("\n") == 6


@pytest.mark.parametrize("kind", ["random", "fla-init"])
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_the_bound_holds_over_the_true_attenuation(gate, kind):
    """The splits' bound (sum over tokens of log2 max alpha) is an upper bound of log2 ||P||_2, P the product of the
    token transitions (I - beta k k^T) Diag(alpha) (float64, random unit keys): the operator-norm argument the
    warm-ups rest on (csrc/prefill/README.md, "Piece split"). Far from tight on these keys: the delta rule erases."""
    res = script().true_attenuation(256, gate, kind, torch.Generator().manual_seed(5), [16, 64, 256])
    assert [t for t, _, _ in res] == [16, 64, 256]
    for t, true, bound in res:
        assert true <= bound + 1e-9, (t, true, bound)
    assert res[-1][1] < res[-1][2] - 1.0   # the erasure shows within 256 tokens
