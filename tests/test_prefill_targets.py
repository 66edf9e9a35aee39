"""benchmarks/prefill_targets.py's reading of issue 46's cuDNN targets (no GPU: cases written by hand in
bench_prefill.py's harness format)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import prefill_targets as pt  # noqa: E402


def case(name, gate, ours_ms, cudnn_ms, finite=True):
    arm = lambda ms: {"time_us": {"eager": {"median": ms * 1e3}}}  # noqa: E731
    return {"params": {"case": name, "gate": gate}, "arms": {"ours": arm(ours_ms), "cudnn": arm(cudnn_ms)},
            "notes": {"checks": {"cudnn": {"finite": finite, "out_rel_l2": 1e-3}}}}


def test_behind_rows_and_geomean_count_finite_rows_only():
    r = pt.evaluate_cudnn([case("H8 B1 T32K", "bounded", 0.6, 0.4), case("H8 B1 T2K", "bounded", 0.05, 0.5),
                           case("H8 B1 T32K", "softplus", 0.6, 0.1, finite=False)])
    assert [n for n, _ in r["ratios"]] == ["H8 B1 T32K bounded", "H8 B1 T2K bounded"]
    assert r["behind"] == [("H8 B1 T32K bounded", 0.6, 0.4)]
    assert r["nonfinite"] == ["H8 B1 T32K softplus"]
    text = pt.report_cudnn("t", r)
    assert "behind at 1" in text and "non-finite at 1" in text


def test_limits_flag_missed_targets():
    r = pt.evaluate_cudnn([case("H16 64x512", "bounded", 0.45, 0.8), case("H8 B1 T32K", "bounded", 0.3, 0.4)])
    text = pt.report_cudnn("t", r)
    assert "H16 64x512 bounded: 0.450 ms (target <= 0.5 ms)\n" in text + "\n"
    assert "H8 B1 T32K bounded: 0.300 ms (target <= 0.25 ms)  MISSED" in text
