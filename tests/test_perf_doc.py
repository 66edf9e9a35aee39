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
    data = json.loads(perf_doc.SOURCES.read_text())
    entries = [e for es in data["ops"].values() for e in es] + data["engines"]
    named = [f"benchmarks/results/{f}" for e in entries for k in ("file", "plot") if e.get(k)
             for f in ([e[k]] if isinstance(e[k], str) else e[k])]
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
        keys = dict(re.findall(r"([A-Z]+): (\d{4}-\d\d-\d\d, [0-9a-f]{7}, (?:H100, )?\[[^]]+\]\([^)]+\))",
                               runs.group(1)))
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
    """Each peer arm in the prefill results (fla, cudnn) adds its column and its lines; without fla the notes say
    the run had no fla arm; a run of one gate names the gate in the README row."""
    def arms(with_fla, with_cudnn):
        srcs = copy.deepcopy(sources)
        for src in srcs["kda_prefill"]:
            for c in src.doc["cases"]:
                a = c["arms"]
                ours = a["ours"]["time_us"]["eager"]["median"]
                a.pop("fla", None)
                a.pop("cudnn", None)
                if with_fla:
                    a["fla"] = {"time_us": {"eager": {"median": 3 * ours}}}
                if with_cudnn:
                    a["cudnn"] = {"time_us": {"eager": {"median": 2 * ours}}}
                c.setdefault("notes", {}).pop("checks", None)
        return srcs
    gates = sorted({c["params"]["gate"] for src in sources["kda_prefill"] for c in src.doc["cases"]})
    both = arms(True, True)
    text = perf_doc.render(both)
    assert "| fla us | cuDNN us |" in text and "event time over fla geomean 3.00x" in text
    assert "against cuDNN where its output is finite" in text and "geomean 2.00x, behind at 0 rows" in text
    readme = perf_doc.readme_block(both)
    for src in sources["kda_prefill"]:
        g = {c["params"]["gate"] for c in src.doc["cases"]}
        heads = sorted({c["params"]["H"] for c in src.doc["cases"]})
        slow = max(c["params"].get("slow_keys", 0) for c in src.doc["cases"])
        label = "`kda_prefill`, f32 state" + (f", {g.pop()} gate" if len(g) == 1 else "") + \
            (f", H{heads[0]}-{heads[-1]}" if len(heads) > 1 else f", H{heads[0]}") + \
            (f", {slow} slowly decaying key{'s' if slow > 1 else ''} a head" if slow else "")
        drawn = sorted({c["params"].get("gate_params", "random") for c in src.doc["cases"]} - {"random"})
        label += ", gate parameters " + " / ".join(drawn) if drawn else ""
        assert "| opt-in arm |" not in readme   # a run's opt-in arm is a candidate of ours, not a peer
        assert f"| {label} | cuDNN | 2.00x (2.00x) |" in readme and f"| {label} | fla | 3.00x (3.00x) |" in readme
    only_cudnn = "\n".join(perf_doc.prefill_section(arms(False, True)["kda_prefill"]))
    assert "fla us" not in only_cudnn and "cuDNN us" in only_cudnn and "no fla arm in this run" in only_cudnn
    neither = "\n".join(perf_doc.prefill_section(arms(False, False)["kda_prefill"]))
    assert "cuDNN us" not in neither and "against cuDNN" not in neither
    assert gates


def _site(sources, name):
    return next(s for s in sources["engines"] if s.name == name)


def _engine_case(site, name):
    """The case the tables show: the last file's, where several runs measured the point."""
    return [c for c, _ in site.cases() if c["name"] == name][-1]


def test_engines_section_lists_every_call_site(sources):
    text = perf_doc.DOC.read_text()
    assert re.search(r"^## Engines \(vLLM, SGLang\)$", text, re.M)
    names = [s.name for s in sources["engines"]]
    assert names == ["vLLM 0.34.0 packed decode", "vLLM 0.34.0 Kimi K3's native fused decode",
                     "vLLM 0.34.0 speculative verify", "SGLang 0.5.23 packed decode", "SGLang 0.5.23 target_verify",
                     "SGLang 0.5.23 target_verify with draft trees", "SGLang 0.5.23 extend",
                     "vLLM 0.34.0 chunk prefill"]
    for site in sources["engines"]:
        assert site.cases(), site.name
        run = r"\d{4}-\d\d-\d\d, [0-9a-f]{7}(?: \(H100\))?"
        assert re.search(rf"^- {re.escape(site.name)} \({run}(; {run})*\): ", text, re.M), site.name
        assert f"| {site.name} (adapter) |" in perf_doc.README.read_text()


def test_engine_tables_follow_the_data(sources):
    """A changed engine median or agreement changes the row, the summary line and the README row (points picked
    from whatever the data holds: one with an fla arm made 2x, one made 0.5x, one made to disagree)."""
    name = "vLLM 0.34.0 packed decode"
    pts = perf_doc._site_points(_site(sources, name))
    n, agree = len(pts), sum(1 for p in pts if p[4])
    behind = sum(1 for p, a, e, *_ in pts if a and e and e / a <= 1)
    changed = copy.deepcopy(sources)
    site = _site(changed, name)
    shown = {}
    for c, _ in site.cases():   # the later file's case is the one the tables show
        shown[perf_doc._point(c)] = c
    ahead = [(pt, c) for pt, c in shown.items() if perf_doc._agreement(site, c)[0]
             and c["arms"][site.arm]["time_us"]["graph"]["median"] > c["arms"]["ours"]["time_us"]["graph"]["median"]]
    pt2, case = next((pt, c) for pt, c in ahead if "fla" in c["arms"])
    (pt_slow, slow), (pt_bad, bad) = [x for x in ahead if x[0] != pt2][:2]
    ours = case["arms"]["ours"]["time_us"]["graph"]["median"]
    fla = case["arms"]["fla"]["time_us"]["graph"]["median"]
    case["arms"]["vllm_triton"]["time_us"]["graph"]["median"] = 2 * ours
    slow["arms"]["vllm_triton"]["time_us"]["graph"]["median"] = 0.5 * slow["arms"]["ours"]["time_us"]["graph"]["median"]
    bad["notes"]["served"] = False
    before, after = perf_doc.render(sources), perf_doc.render(changed)
    st, h, r = pt2
    row = f"| {st} | {h} | {r} | {perf_doc._us(ours)} | {perf_doc._us(2 * ours)} | {perf_doc._us(fla)} | 2.00x | yes ("
    assert row not in before and row in after
    section = after.split(f"### {site.engine} {site.site}")[1].split("\n### ")[0]
    st, h, r = pt_bad
    assert section.split(f"| {st} | {h} | {r} |")[1].splitlines()[0].count(" | no (") == 1
    line = next(x for x in after.splitlines() if x.startswith(f"- {name} ("))
    assert f"missed at {behind + 1} of {n} points" in line and f"{perf_doc._label(pt_slow)} 0.500x" in line
    assert f"outputs agree at {agree - 1} of {n}" in line
    old = next(x for x in before.splitlines() if x.startswith(f"- {name} ("))
    assert f"outputs agree at {agree} of {n}" in old and perf_doc._label(pt_slow) + " 0.500x" not in old
    assert perf_doc.readme_block(changed) != perf_doc.readme_block(sources)


def test_engine_target_met_and_missed_come_from_the_ratios(sources):
    fast = copy.deepcopy(sources)
    site = _site(fast, "SGLang 0.5.23 packed decode")
    for c, _ in site.cases():
        c["arms"]["sglang"]["time_us"]["graph"]["median"] = 1.5 * c["arms"]["ours"]["time_us"]["graph"]["median"]
    line = next(x for x in perf_doc.engines_section(fast["engines"]) if x.startswith("- SGLang 0.5.23 packed decode ("))
    assert "geomean 1.50x, slowest 1.50x" in line and f"met at all {len(site.cases())} points" in line
    del site.cases()[0][0]["arms"]["sglang"]   # a point without the engine's time is not a point met
    line = next(x for x in perf_doc.engines_section(fast["engines"]) if x.startswith("- SGLang 0.5.23 packed decode ("))
    assert f"missed at 1 of {len(site.cases())} points: 1 row H8 f32 not timed" in line


def test_engines_not_measured_is_derived_from_the_data(sources):
    def gaps(srcs):
        return next(x for x in perf_doc.engines_section(srcs) if x.startswith("Not measured of issue 45's grid"))

    now = gaps(sources["engines"])
    vllm = "vLLM 0.34.0 packed decode, vLLM 0.34.0 speculative verify"
    sglang = "SGLang 0.5.23 packed decode, SGLang 0.5.23 target_verify"
    # every head count has a run now (extend: H8, then H12 / H24 / H32; vLLM prefill: H8 / H32, then H12 / H24)
    assert "(SGLang 0.5.23 extend)" in now and "H 12 / 24 / 32 (SGLang 0.5.23 extend)" not in now
    assert "bf16 state (vLLM 0.34.0 chunk prefill)" in now and "H 12 / 24 (vLLM 0.34.0 chunk prefill)" not in now
    # the paged rows 4 / 16 / 256 runs (vLLM), then SGLang's rows 4 / 16 / 256; decode's fp32 rows 384 / 512 runs
    assert "rows 1-1024 other than 1 / 4 / 16 / 64 / 256 / 1024 (vLLM 0.34.0 Kimi K3's native fused decode, " \
           "vLLM 0.34.0 speculative verify, SGLang 0.5.23 target_verify)" in now
    # K3's native decode: only its own part of the grid (12 / 24 heads, fp32; no fla op) is asked of it
    assert "(vLLM 0.34.0 Kimi K3's native fused decode)" not in now
    assert "rows 1-1024 other than 1 / 4 / 16 / 64 / 256 / 384 / 512 / 1024 (vLLM 0.34.0 packed decode)" in now
    assert "rows 1-1024 other than 1 / 4 / 16 / 64 / 256 / 384 / 1024 (SGLang 0.5.23 packed decode)" in now
    assert "H16" not in now     # outside issue 45's heads: a run's H16 points add no holes
    assert "an fla arm" in now and "prefill through the vLLM 0.34.0 adapter" not in now   # a run now exists
    holes = "vLLM 0.34.0 speculative verify at "
    # every point of the site's grid has a run now (the f7cb79b run timed the one point the earlier runs' limits
    # cut off, 1024 rows H32 bf16; the 1bbbfd3 run H8 bf16 at rows 4 / 16 / 256)
    assert holes not in now
    holed = copy.deepcopy(sources)
    verify_srcs = _site(holed, "vLLM 0.34.0 speculative verify").srcs
    # without the runs that timed it (f7cb79b, then fdcaaf0's H200 acceptance grid) the point is a hole again
    verify_srcs[:] = [src for src in verify_srcs if "f7cb79b" not in src.file and "fdcaaf0" not in src.file]
    assert "1024 rows H32 bf16" in gaps(holed["engines"]).split(holes)[1].split(";")[0]
    filled = copy.deepcopy(sources)
    verify = _site(filled, "vLLM 0.34.0 speculative verify")
    doc = verify.srcs[-1].doc   # the points the runs did not reach, added to the last file
    for dtype in ("float32", "bfloat16"):
        for h in (8, 12, 24, 32):
            for rows in (1, 4, 16, 64, 256, 1024):
                name = f"verify rows={rows} H={h} {dtype}"
                if any(c["name"] == name for c, _ in verify.cases()):
                    continue
                c = copy.deepcopy(_engine_case(verify, f"verify rows=64 H=32 {dtype}"))
                c["params"].update(rows=rows, H=h)
                c["name"] = name
                doc["cases"].append(c)
    for src in verify.srcs:
        for c in src.doc["cases"]:
            c["arms"]["fla"] = {"time_us": {"graph": {"median": 100.0}}}
    text = "\n".join(perf_doc.engines_section(filled["engines"]))
    after = gaps(filled["engines"])
    assert holes not in after and "an fla arm" in after
    assert "| fla us |" in text and "| f32 | 12 | 1 | 4 |" in text


def test_an_engine_point_measured_twice_shows_the_later_run(sources):
    name = "decode rows=1 H=8 float32"
    site = _site(sources, "vLLM 0.34.0 packed decode")
    timed = [i for i, src in enumerate(site.srcs) if any(c["name"] == name for c in src.doc["cases"])]
    assert len(timed) >= 2     # the first and the last run that time the point (later runs may not)
    assert next(src for c, src in site.cases() if c["name"] == name) is site.srcs[timed[-1]]
    changed = copy.deepcopy(sources)
    for i, src in ((timed[0], "earlier"), (timed[-1], "later")):
        case = next(c for c in _site(changed, site.name).srcs[i].doc["cases"] if c["name"] == name)
        case["arms"]["ours"]["time_us"]["graph"]["median"] = 999.0
        shown = "| f32 | 8 | 1 | 999.0 |" in perf_doc.render(changed)
        assert shown == (src == "later"), src


def test_engine_kernel_time_line_follows_the_data(sources):
    prefix = "- vLLM 0.34.0 packed decode, kernel time"
    before = next(x for x in perf_doc.render(sources).splitlines() if x.startswith(prefix))
    assert "1 row H8 f32 0.99x" in before
    changed = copy.deepcopy(sources)
    case = next(c for c, _ in _site(changed, "vLLM 0.34.0 packed decode").kernel_cases()
                if c["name"] == "decode rows=1 H=8 float32")
    ours = case["arms"]["ours"]["time_us"]["kernel"]["median"]
    case["arms"]["vllm_triton"]["time_us"]["kernel"]["median"] = 3 * ours
    after = next(x for x in perf_doc.render(changed).splitlines() if x.startswith(prefix))
    assert "1 row H8 f32 3.00x" in after
    for src in _site(changed, "vLLM 0.34.0 packed decode").srcs:   # no kernel time in any run: no line
        for c in src.doc["cases"]:
            c["arms"]["ours"]["time_us"].pop("kernel", None)
    assert not any(x.startswith(prefix) for x in perf_doc.render(changed).splitlines())


def test_engine_agreement_needs_a_verdict(sources):
    """A vLLM run records the errors, not the verdict: without the entry's bound the page is refused."""
    no_tol = copy.deepcopy(sources)
    _site(no_tol, "vLLM 0.34.0 packed decode").tol = None
    with pytest.raises(ValueError, match="tol"):
        perf_doc.engines_section(no_tol["engines"])


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
    # the budget grows with the kept runs (3 MiB filled on 2026-12-06 with 79 run folders); what keeps it small is the
    # compact form below, one file a measured question, and history read from git
    sizes = [p.stat().st_size for p in RESULTS.rglob("*.json")]
    assert sum(sizes) < 4 * 2 ** 20, f"benchmarks/results holds {sum(sizes)} bytes of JSON (budget 4 MiB)"
    loose = []
    for p in RESULTS.glob("*/*.json"):  # the run folders (INDEX.json and current.json are indexes)
        doc = json.loads(p.read_text())
        if results_compact.dumps(results_compact.compact(doc)) != p.read_text():
            loose.append(p.relative_to(ROOT).as_posix())
    assert not loose, f"not in compact form (python3 benchmarks/results_compact.py FILE): {loose}"


def test_engine_kernel_time_outlives_a_later_graph_only_run(sources):
    """A point's kernel time stays on its line, citing its own run, when a later run times it in graph
    replay only (the later run's graph time is the table's)."""
    site = _site(sources, "vLLM 0.34.0 packed decode")
    name = "decode rows=1 H=8 float32"
    shown = next(src for c, src in site.cases() if c["name"] == name)
    timed = next(src for c, src in site.kernel_cases() if c["name"] == name)
    last = [src for src in site.srcs if any(c["name"] == name for c in src.doc["cases"])][-1]
    assert shown is last and timed is not shown
    assert "kernel" not in _engine_case(site, name)["arms"]["ours"]["time_us"]
    line = next(x for x in perf_doc.render(sources).splitlines()
                if x.startswith("- vLLM 0.34.0 packed decode, kernel time"))
    assert f"1 row H8 f32 0.99x ({timed.key})" in line


SYNTHETIC_FOLDER = "-".join(("h200", "2026-12-05", "abcdef0"))  # built from parts (tests/test_provenance.py scans)


def _fused_verify_source(tmp_path, cases, gate="softplus"):
    """A synthetic bench_fused_verify.py results document (compact form) as a cited source, written under
    tmp_path: nothing of it goes into benchmarks/results."""
    folder = tmp_path / SYNTHETIC_FOLDER
    folder.mkdir(exist_ok=True)
    doc = {"benchmark": "fused_verify", "meta": {"gpu": "NVIDIA H200", "gate": gate, "config": {"modes": ["graph"]}},
           "copy_ceiling": {"GBps": 4000.0}, "baseline": "unfused", "primary_mode": "graph", "cases": []}
    for state, T, rows, heads, fused, unfused, step, pct in cases:
        arm = lambda t, p=None: {"time_us": {"graph": {"median": t}},  # noqa: E731
                                 **({"bandwidth": {"graph": {"pct_copy": p}}} if p is not None else {})}
        doc["cases"].append({"name": f"{state}_T{T}_h{heads}_r{rows}",
                             "params": {"rows": rows, "T": T, "heads": heads, "state": state,
                                        "work_items": rows * heads},
                             "arms": {"fused": arm(fused, pct), "unfused": arm(unfused), "step": arm(step)}})
    (folder / "fused_verify.json").write_text(json.dumps(doc))
    return perf_doc.Source({"file": f"{folder.name}/fused_verify.json"}, root=tmp_path)


def test_fused_verify_section_cites_the_current_run(sources):
    """docs/performance.md's fused verify section is the cited run's table (not the "Not measured yet" text),
    naming every file current.json lists, and the README has its rows."""
    assert sources["fused_kda_verify"], "current.json cites a fused verify run"
    section = perf_doc.DOC.read_text().split("## Fused verify (`fused_kda_verify`)")[1].split("\n## ")[0]
    assert "Not measured yet" not in section
    for src in sources["fused_kda_verify"]:
        assert Path(src.file).name in section, src.file
    assert "`fused_kda_verify`, f32 state" in perf_doc.readme_block(sources)


def test_fused_verify_section_renders_a_cited_run(sources, tmp_path):
    """Once current.json lists a bench_fused_verify.py run under ops.fused_kda_verify, its section is a table like
    fused decode's (fused / unfused / step, fused over step) with the fused op's % of copy, a line per state with
    the figures, the run cited, and a README row against the unfused sequence."""
    cited = copy.deepcopy(sources)
    cited["fused_kda_verify"] = [_fused_verify_source(tmp_path, [
        ("f32", 4, 1, 16, 10.0, 40.0, 9.0, 20.0),
        ("f32", 4, 1024, 64, 1000.0, 2000.0, 950.0, 85.0),
        ("bf16", 2, 64, 32, 30.0, 120.0, 25.0, 50.0),
        ("bf16", 8, 256, 16, 200.0, None, 190.0, 61.0),    # no unfused time at this point (a failed arm)
    ], gate="bounded")]
    text = perf_doc.render(cited)
    section = text.split("## Fused verify (`fused_kda_verify`)")[1].split("\n## ")[0]
    assert "Not measured yet" not in section
    assert "| state | T | requests x heads | fused us | unfused us | x unfused | step us | fused / step | " \
           "fused % of copy | run |" in section
    assert "| f32 | 4 | 1 x H16 | 10.0 | 40.0 | 4.00x | 9.0 | 1.11 | 20% | A |" in section
    assert "| f32 | 4 | 1024 x H64 | 1000 | 2000 | 2.00x | 950.0 | 1.05 | 85% | A |" in section
    assert "| bf16 | 2 | 64 x H32 | 30.0 | 120.0 | 4.00x | 25.0 | 1.20 | 50% | A |" in section
    assert "| bf16 | 8 | 256 x H16 | 200.0 | - | - | 190.0 | 1.05 | 61% | A |" in section
    assert ("- f32 (2026-12-05, abcdef0, bounded gate): over the unfused sequence geomean 2.83x, lowest at <= 64 "
            "requests 4.00x, at >= 1024 requests 2.00x; fused / step 1.05-1.11; from 2048 work items 85.0-85.0% of "
            "copy.") in section
    assert ("- bf16 (2026-12-05, abcdef0, bounded gate): over the unfused sequence geomean 4.00x, lowest at <= 64 "
            "requests 4.00x, at >= 1024 requests -; fused / step 1.05-1.20; from 2048 work items 50.0-61.0% of "
            "copy.") in section
    assert f"Runs: A: 2026-12-05, abcdef0, [fused_verify.json](../benchmarks/results/{SYNTHETIC_FOLDER}/" \
           "fused_verify.json)." in section
    readme = perf_doc.readme_block(cited)
    assert "| `fused_kda_verify`, f32 state | the unfused engine sequence (fla step) | 2.83x (2.00x) | graph replay " \
           "| 2026-12-05, abcdef0 |" in readme
    # the other sections are untouched
    assert text.split("## Fused verify")[0] == perf_doc.render(sources).split("## Fused verify")[0]


def test_fused_verify_section_reads_the_benchmarks_own_output(sources, tmp_path):
    """bench_fused_verify.py's results document (a CPU dry run, its arms and mode renamed as a GPU run with fla
    names them) renders: a row per case, the figures computed."""
    import bench_fused_verify
    out = tmp_path / SYNTHETIC_FOLDER
    assert bench_fused_verify.main(["--dry-run", "--no-progress", "--no-plot", "--out", str(out)]) == 0
    doc = json.loads((out / "fused_verify.json").read_text())
    for c in doc["cases"]:
        c["arms"]["unfused"] = c["arms"].pop("unfused_torch")
        for arm in c["arms"].values():
            arm["time_us"]["graph"] = arm["time_us"].pop("wall")
            if "bandwidth" in arm:
                arm["bandwidth"]["graph"] = arm["bandwidth"].pop("wall")
    (out / "fused_verify.json").write_text(json.dumps(doc))
    src = perf_doc.Source({"file": f"{out.name}/fused_verify.json"}, root=tmp_path)
    src.key = "A"
    lines = perf_doc.fused_verify_section([src])
    rows = [x for x in lines if x.startswith("| f32 | 4 |")]
    assert len(rows) == len(doc["cases"]) == 2
    assert all(" - |" not in r for r in rows), rows
    assert any(x.startswith("- f32 (2026-12-05, abcdef0, softplus gate): over the unfused sequence geomean ")
               for x in lines)


def test_a_slow_key_run_is_labelled_apart_in_the_readme(sources):
    """A prefill run on slowly decaying keys (bench_prefill.py --slow-keys) is another data regime than the random-gate
    grid: its README row says so, and a run without slow keys never gets the label."""
    for label, _, _, _, _, src in perf_doc.summary_rows(sources):
        slow = any(c["params"].get("slow_keys") for c in src.doc["cases"])
        assert ("slowly decaying key" in label) == slow, label
    plain = sources["kda_prefill"][0]
    slow = copy.deepcopy(plain)
    for c in slow.doc["cases"]:
        c["params"]["slow_keys"] = 1
    rows = perf_doc.summary_rows({"kda_prefill": [plain, slow]})
    labels = {id(s): lab for lab, _, _, _, _, s in rows}
    assert labels[id(slow)].endswith("1 slowly decaying key a head"), labels[id(slow)]
    assert "slowly" not in labels[id(plain)] and labels[id(plain)].startswith("`kda_prefill`, f32 state, bounded gate")


def test_a_run_on_other_gate_parameters_is_labelled_apart_in_the_readme(sources):
    """A prefill run whose A_log / dt_bias were drawn otherwise than at random (bench_prefill.py --gate-params) is
    another data regime: its README row names the draw; the random draw (the default, no param) gets no label."""
    src = copy.deepcopy(sources["kda_prefill"][0])
    for c in src.doc["cases"]:
        c["params"]["gate_params"] = "fla-init"
    labels = [lab for lab, _, _, _, _, s in perf_doc.summary_rows({"kda_prefill": [src]}) if s is src]
    assert labels and all(lab.endswith("gate parameters fla-init") for lab in labels), labels
    for lab, _, _, _, _, s in perf_doc.summary_rows(sources):
        drawn = {c["params"].get("gate_params", "random") for c in s.doc["cases"]}
        assert ("gate parameters" in lab) == (drawn != {"random"}), lab
