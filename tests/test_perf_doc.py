"""docs/performance.md and the README's speed block are what benchmarks/perf_doc.py makes of the results
they cite, every cited results file exists, and the kept results stay compact."""
import copy
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
pytestmark = pytest.mark.skipif(not (RESULTS / "current.json").is_file(), reason="benchmarks/ ships with the checkout")
sys.path.insert(0, str(BENCH))

import perf_doc  # noqa: E402
import results_compact  # noqa: E402


@pytest.fixture(scope="module")
def sources():
    return perf_doc.load()


def test_performance_doc_is_the_generated_one(sources):
    assert perf_doc.DOC.read_text() == perf_doc.render(sources), \
        "docs/performance.md is stale: python3 benchmarks/perf_doc.py"


def test_readme_block_is_the_generated_one(sources):
    text = perf_doc.README.read_text()
    assert perf_doc.with_readme_block(text, perf_doc.readme_block(sources)) == text, \
        "README.md's speed block is stale: python3 benchmarks/perf_doc.py"
    assert perf_doc.main(["--check"]) == 0


def test_every_op_has_a_section(sources):
    text = perf_doc.DOC.read_text()
    for op in ("kda_decode", "fused_kda_decode", "kda_verify", "fused_kda_verify", "kda_prefill"):
        assert re.search(rf"^## .*\(`{op}`\)$", text, re.M), op
        assert op in sources, f"benchmarks/results/current.json has no entry for {op}"


def test_cited_results_exist():
    doc = perf_doc.DOC.read_text()
    cited = re.findall(r"\(\.\./(benchmarks/results/[^)\s]+)\)", doc)
    entries = [e for es in json.loads(perf_doc.SOURCES.read_text())["ops"].values() for e in es]
    named = [f"benchmarks/results/{e[k]}" for e in entries for k in ("file", "plot") if e.get(k)]
    assert set(named) <= set(cited), "a source of current.json is not cited by the page"
    missing = [p for p in cited if not (ROOT / p).is_file()]
    assert cited and not missing, f"docs/performance.md cites files that do not exist: {missing}"


def test_every_figure_names_its_run(sources):
    # Each table row ends with a run key that the op's "Runs:" line resolves to date, commit and file.
    text = perf_doc.DOC.read_text()
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| state |")
                and not r.startswith("| case |") and "---" not in r]
        if not rows:
            continue
        runs = re.search(r"^Runs: (.*)$", section, re.M)
        assert runs, section.splitlines()[0]
        keys = dict(re.findall(r"([A-Z]): (\d{4}-\d\d-\d\d, [0-9a-f]{7}, \[[^]]+\]\([^)]+\))", runs.group(1)))
        for row in rows:
            assert row.rstrip(" |").split("| ")[-1].strip() in keys, row


def _doc(sources, op, i=0):
    return sources[op][i].doc


def test_tables_follow_the_data(sources):
    """A changed median changes the page (cells are computed, not written)."""
    changed = copy.deepcopy(sources)
    case = _doc(changed, "kda_verify")["cases"][0]
    case["arms"]["ours"]["time_us"]["graph"]["median"] = 1234.5
    before, after = perf_doc.render(sources), perf_doc.render(changed)
    assert "1234 / " not in before
    assert "1234 / " in after


def test_one_run_of_both_states_reads_as_two(sources):
    """bench_decode.py --states f32,bf16 writes one file: its table is that of one file per state."""
    merged = copy.deepcopy(sources)
    f32, bf16 = merged["kda_decode"]
    f32.doc["cases"] = f32.doc["cases"] + bf16.doc["cases"]
    merged["kda_decode"] = [f32]
    def rows(srcs):  # the table rows without their run key
        text = "\n".join(perf_doc.decode_section(srcs))
        return [r.rsplit("|", 2)[0] for r in text.splitlines() if r.startswith(("| f32 |", "| bf16 |"))]

    assert rows(merged["kda_decode"]) == rows(sources["kda_decode"])


def test_prefill_gets_a_column_per_peer(sources):
    """A cudnn arm in the prefill results adds a cuDNN column and a geomean line; without it, neither."""
    assert "cuDNN us" not in perf_doc.render(sources) or any(
        "cudnn" in c["arms"] for c in _doc(sources, "kda_prefill")["cases"])
    with_cudnn = copy.deepcopy(sources)
    for c in _doc(with_cudnn, "kda_prefill")["cases"]:
        ours = c["arms"]["ours"]["time_us"]["eager"]["median"]
        c["arms"]["cudnn"] = {"time_us": {"eager": {"median": 2 * ours}}}
    text = perf_doc.render(with_cudnn)
    assert "| fla us | cuDNN us |" in text
    assert "against cuDNN where its output is finite" in text and "geomean 2.00x, behind at 0 rows" in text
    assert "| `kda_prefill`, f32 state | cuDNN | 2.00x (2.00x) |" in perf_doc.readme_block(with_cudnn)


def test_results_folder_names_give_date_and_commit(tmp_path):
    bad = "-".join(("h200", "2026-12-01"))  # no commit; built from parts (tests/test_provenance.py scans)
    (tmp_path / bad).mkdir()
    (tmp_path / bad / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="h200-<date>-<commit>"):
        perf_doc.Source({"file": f"{bad}/x.json"}, root=tmp_path)


def test_compact_keeps_the_medians_and_is_stable():
    run = {"benchmark": "decode", "partial": False, "primary_mode": "graph", "baseline": "fla",
           "meta": {"gpu": "NVIDIA H200", "host": "vm", "config": {"modes": ["graph"], "reps": 60, "out_dir": "/x"}},
           "copy_ceiling": {"bytes": 1, "median_us": 2.0, "GBps": 4283.248, "samples": 20}, "summary": {"x": 1},
           "cases": [{"name": "a", "params": {"state": "f32"}, "bytes": 10, "notes": {}, "flops": None,
                      "arms": {"ours": {"time_us": {"graph": {"median": 3.04825, "p10": 3.0, "p90": 3.1, "n": 48}},
                                        "bandwidth": {"graph": {"GBps": 343.99, "pct_copy": 8.0752}}}},
                      "speedup": {"ours": {"graph": 1.2}}}]}
    small = results_compact.compact(run)
    assert small["cases"][0]["arms"]["ours"] == {"time_us": {"graph": {"median": 3.048}},
                                                "bandwidth": {"graph": {"pct_copy": 8.08}}}
    assert small["meta"] == {"gpu": "NVIDIA H200", "config": {"modes": ["graph"], "reps": 60}}
    assert small["copy_ceiling"] == {"GBps": 4283.2}
    assert results_compact.compact(small) == small
    other = {"rows": [1, 2]}
    assert results_compact.compact(other) is other


def test_kept_results_are_compact():
    sizes = [p.stat().st_size for p in RESULTS.rglob("*.json")]
    assert sum(sizes) < 3 * 2 ** 20, f"benchmarks/results holds {sum(sizes)} bytes of JSON (budget 3 MiB)"
    loose = []
    for p in RESULTS.glob("*/*.json"):  # the run folders (INDEX.json and current.json are indexes)
        doc = json.loads(p.read_text())
        if results_compact.dumps(results_compact.compact(doc)) != p.read_text():
            loose.append(p.relative_to(ROOT).as_posix())
    assert not loose, f"not in compact form (python3 benchmarks/results_compact.py FILE): {loose}"
