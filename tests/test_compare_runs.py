"""benchmarks/compare_runs.py: after / before per case, rounds (lowest median), per-module geomeans."""
import importlib
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
compare_runs = importlib.import_module("compare_runs")


def _run(path: Path, times: dict) -> Path:
    cases = [{"name": name, "params": {"module": module},
              "arms": {"ours": {"time_us": {"eager": {"median": t}}}}}
             for name, (module, t) in times.items()]
    path.write_text(json.dumps({"primary_mode": "eager", "cases": cases}))
    return path


def test_pairs_and_geomean(tmp_path, capsys):
    a = _run(tmp_path / "a.json", {"x": ("m1", 100.0), "y": ("m2", 200.0)})
    b = _run(tmp_path / "b.json", {"x": ("m1", 90.0), "y": ("m2", 220.0), "z": ("m2", 5.0)})
    out = compare_runs.compare([a], [b])
    assert abs(out["ours"] - (0.9 * 1.1) ** 0.5) < 1e-12  # z is only on one side: left out
    text = capsys.readouterr().out
    assert "ours on m1: 0.900 over 1 cases" in text and "ours on m2: 1.100" in text


def test_rounds_take_the_lowest_median_and_show_the_spread(tmp_path, capsys):
    a1 = _run(tmp_path / "a1.json", {"x": ("m", 100.0)})
    a2 = _run(tmp_path / "a2.json", {"x": ("m", 150.0)})  # a disturbed round
    b1 = _run(tmp_path / "b1.json", {"x": ("m", 96.0)})
    b2 = _run(tmp_path / "b2.json", {"x": ("m", 95.0)})
    assert compare_runs.main([f"{a1},{a2}", f"{b1},{b2}"]) == 0
    text = capsys.readouterr().out
    assert "lowest of the rounds" in text and "1.500/1.011" in text
    assert "geomean after/before, arm ours: 0.950" in text


def test_bad_arguments(tmp_path, capsys):
    assert compare_runs.main([str(tmp_path / "only_one.json")]) == 2
    assert compare_runs.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "missing a.json, b.json, skipped" in capsys.readouterr().out
