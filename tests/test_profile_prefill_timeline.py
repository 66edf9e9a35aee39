"""scripts/profile_prefill.py --timeline's report (the part that needs no GPU): kernels in start order with
their spans, and how long each pair ran side by side."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import profile_prefill  # noqa: E402


def test_timeline_reports_spans_and_overlap():
    lines = profile_prefill.timeline_lines([("kda_prep", 0.0, 250.0), ("kda_state", 5.0, 700.0), ("copy", 700.0, 710.0)])
    assert lines[1].split() == ["0.0", "250.0", "250.0", "kda_prep"]
    assert lines[2].split() == ["5.0", "700.0", "695.0", "kda_state"]
    side = [x for x in lines if "side by side" in x]
    assert side == ["  side by side 245.0 us: kda_prep | kda_state"]   # touching spans (700) do not count
    assert lines[-1] == "  call: 710.0 us from the first kernel's start to the last one's end; kernels' sum 955.0 us"


def test_timeline_of_kernels_in_series_has_no_overlap_line():
    lines = profile_prefill.timeline_lines([("a", 0.0, 10.0), ("b", 12.0, 20.0)])
    assert not any("side by side" in x for x in lines)
    assert lines[-1].startswith("  call: 20.0 us") and "sum 18.0 us" in lines[-1]
