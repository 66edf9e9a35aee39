"""Measurements are cited by date and commit, never by a bare run label.

Older notes called a set of device runs "session N" and filed its data under
benchmarks/results/h200-<date>-sN/, which a reader cannot resolve. The folders are now
h200-<date>-<commit> and benchmarks/results/INDEX.json maps every old label to its date, commit and
folder (a folder cut from the tree stays listed: git history keeps it). These tests keep the labels
from coming back and the folder names, the index and the references to the folders in agreement.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "INDEX.json"
SCANNED_DIRS = ("docs", "jit", "csrc", "tests", "scripts", "benchmarks", "flashkda_ext")
SCANNED_FILES = ("README.md",)
TEXT_SUFFIXES = {".md", ".json", ".py", ".cu", ".cuh", ".h", ".cc", ".cpp", ".sh", ".txt", ".toml"}

# "session N", "Sessions N-M", "session-N"; the label may wrap onto the next line.
SESSION_LABEL = re.compile(r"\b[Ss]essions?[-\s]+\d+\b")
# A results folder named by a session number (h200-<date>-s<N>).
SESSION_FOLDER = re.compile(r"\bh200-\d{4}-\d\d-\d\d-s\d+\b")
# the GPU of the runs first: h200, or h100 on a day the device lent only an H100
FOLDER_NAME = re.compile(r"^h[12]00-(\d{4}-\d\d-\d\d)-([0-9a-f]{7})$")
FOLDER_REF = re.compile(r"\bh[12]00-\d{4}-\d\d-\d\d(?:-[0-9A-Za-z]+)?\b")
# A results file cited inside its folder; the name may hold * and {a,b} (run11_tiny_{1,2}.json).
FILE_REF = re.compile(r"\b(h[12]00-\d{4}-\d\d-\d\d-[0-9a-f]{7})/([A-Za-z0-9_*{},.-]*[A-Za-z0-9_*}])")


def _scanned_files():
    paths = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for top in SCANNED_DIRS:
        base = ROOT / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if not path.is_file() or path.suffix not in TEXT_SUFFIXES:
                continue
            if "__pycache__" in path.parts or path == INDEX:
                continue
            # A results folder's run files are raw output, kept as they were written; its README
            # is prose and is held to the rule.
            if RESULTS in path.parents and path.name != "README.md":
                continue
            paths.append(path)
    return paths


def _index():
    with open(INDEX, encoding="utf-8") as f:
        return json.load(f)


def _results_folders():
    return sorted(p.name for p in RESULTS.iterdir() if p.is_dir())


def test_scan_covers_the_project():
    # Guards the scan itself: it must see the performance page, the records and the kernels.
    names = {p.relative_to(ROOT).as_posix() for p in _scanned_files()}
    for expected in ("docs/performance.md", "jit/routes/kda_decode.json",
                     "csrc/prefill/kda_prefill_prep.cuh", "tests/test_provenance.py"):
        assert expected in names


def test_label_patterns_catch_the_old_forms():
    # Built from parts so that this file does not hold the labels it bans.
    sess, folder = "session", "-".join(("h200", "2026-11-30", "s16"))
    for text in (f"{sess} 12", f"S{sess[1:]}s 3-9", f"({sess}-7)", f"as in {sess}\n  15."):
        assert SESSION_LABEL.search(text), text
    assert SESSION_FOLDER.search(f"benchmarks/results/{folder}/run8_prefill_h16.json")
    for text in ("2026-11-30, 4d00ff6", "a profiler session a sample", "an earlier session",
                 "h200-2026-11-30-4d00ff6"):
        assert not SESSION_LABEL.search(text) and not SESSION_FOLDER.search(text), text


def test_no_bare_session_labels():
    hits = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for pattern in (SESSION_LABEL, SESSION_FOLDER):
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                hits.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    assert not hits, (
        "bare run labels; cite '<date>, <commit>' and the results folder instead "
        "(benchmarks/results/INDEX.json maps old labels):\n" + "\n".join(hits))


def test_results_folders_are_named_by_date_and_commit():
    bad = [name for name in _results_folders() if not FOLDER_NAME.match(name)]
    assert not bad, f"results folders must be h200-<date>-<7-hex commit> (h100- for an H100's runs): {bad}"


def test_index_lists_every_folder():
    entries = _index()["sessions"]
    later = _index().get("folders", [])  # folders named by date and commit from the start
    folders = set(_results_folders())
    listed = [Path(e["folder"]).name for e in entries + later]
    assert len(listed) == len(set(listed)), "a folder is listed twice in INDEX.json"
    assert folders <= set(listed), f"not in INDEX.json: {sorted(folders - set(listed))}"
    for e in later:
        assert (e["date"], e["commit"]) == FOLDER_NAME.match(Path(e["folder"]).name).groups(), e
    labels = [e["label"] for e in entries]
    assert len(labels) == len(set(labels)), "a label is listed twice in INDEX.json"
    for e in entries:
        date, commit = FOLDER_NAME.match(Path(e["folder"]).name).groups()
        assert (e["date"], e["commit"]) == (date, commit), e
        assert e["short_label"] == "s" + e["label"].split()[-1], e
        assert SESSION_FOLDER.search(e["former_folder"]) or e["former_folder"].endswith(date), e


def test_every_folder_has_a_readme():
    # The README says what ran (command, tree) for the files kept there.
    missing = [name for name in _results_folders() if not (RESULTS / name / "README.md").is_file()]
    assert not missing, f"results folders without a README: {missing}"


def test_folder_references_name_existing_folders():
    folders = set(_results_folders())
    dangling = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in FOLDER_REF.finditer(text):
            if m.group(0) not in folders:
                line = text.count("\n", 0, m.start()) + 1
                dangling.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert not dangling, "references to results folders that do not exist:\n" + "\n".join(dangling)


def _expand_braces(pattern):
    # glob has no {a,b}; the notes use it for run pairs, so expand it here.
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [name for alt in m.group(1).split(",")
            for name in _expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


def test_expand_braces():
    assert _expand_braces("run11_tiny_{1,2}.json") == ["run11_tiny_1.json", "run11_tiny_2.json"]
    assert _expand_braces("run{1,2}_{a,b}") == ["run1_a", "run1_b", "run2_a", "run2_b"]


def test_cited_results_files_exist():
    missing = []
    cited = 0
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in FILE_REF.finditer(text):
            folder, name = m.groups()
            cited += 1
            if not all(any((RESULTS / folder).glob(p)) for p in _expand_braces(name)):
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert cited > 50, "the scan found too few results files cited to be looking in the right place"
    assert not missing, "cited results files that do not exist:\n" + "\n".join(missing)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs a git checkout to resolve the commits")
def test_index_commits_exist():
    names = []
    for e in _index()["sessions"]:
        names += [e["commit"], *e["results_added_in"], *e["code_commits_since_previous"]]
    query = "".join(f"{c}^{{commit}}\n" for c in names)
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, input=query,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    missing = [c for c, line in zip(names, out) if line.endswith("missing")]
    assert not missing, f"INDEX.json names commits this checkout does not have: {missing}"
