"""pytest plugin for scripts/device.sh's integrations stage: registers the flashkda_ext backend with fla before fla's
own tests run, and counts per test how many chunk_kda / fused_recurrent_kda_fwd calls flashkda_ext served and
how many it refused (fla then ran Triton), with the refusal reasons. Load with `-p fla_backend_count`
(scripts/ on PYTHONPATH); the table goes to the terminal and to $OUT/fla_backend_counts.json.

Works with pytest-xdist (`-n N`; Triton's compiles are CPU-bound, so workers cut the run's time): the
counters live in each worker process, which writes them to a file of its own at session end; the
controller, which prints the summary, merges those files."""
import collections
import glob
import json
import os
import tempfile

import pytest

_ROWS = {}
_OUTCOMES = {}
# where xdist workers leave their counts for the controller (one file per worker)
_SHARE = os.environ.get("FLA_COUNT_DIR") or os.path.join(tempfile.gettempdir(), "fla_backend_count")


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    from flashkda_ext.integrations import fla as fkda_fla
    if os.environ.get("FLA_BACKEND_OFF") != "1":
        fkda_fla.register()
    if not _is_worker(config):
        os.makedirs(_SHARE, exist_ok=True)
        for stale in glob.glob(os.path.join(_SHARE, "*.json")):
            os.remove(stale)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    from flashkda_ext.integrations.fla import STATS
    before = collections.Counter(STATS)
    yield
    delta = collections.Counter(STATS)
    delta.subtract(before)
    _ROWS[item.nodeid] = {f"{entry}:{kind}": n for (entry, kind), n in delta.items() if n}


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _OUTCOMES[report.nodeid] = report.outcome


def _local_counts() -> dict:
    from flashkda_ext.integrations.fla import REASONS, STATS
    return {"per_test": _ROWS, "stats": {f"{a}|{b}": n for (a, b), n in STATS.items()},
            "reasons": [[e, r, n] for (e, r), n in REASONS.items()]}


def pytest_sessionfinish(session):
    if _is_worker(session.config):
        name = session.config.workerinput.get("workerid", str(os.getpid()))
        with open(os.path.join(_SHARE, f"{name}.json"), "w") as f:
            json.dump(_local_counts(), f)


def _merged() -> tuple[dict, collections.Counter, collections.Counter]:
    parts = [_local_counts()]
    for path in sorted(glob.glob(os.path.join(_SHARE, "*.json"))):
        with open(path) as f:
            parts.append(json.load(f))
    rows, stats, reasons = {}, collections.Counter(), collections.Counter()
    for part in parts:
        rows.update(part["per_test"])
        stats.update({tuple(k.split("|", 1)): n for k, n in part["stats"].items()})
        reasons.update({(e, r): n for e, r, n in part["reasons"]})
    return rows, stats, reasons


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    rows, stats, reasons = _merged()
    tr.section("flashkda_ext backend: calls served / refused per test")
    totals = collections.Counter()
    for nodeid, row in sorted(rows.items()):
        totals.update(row)
        cells = ", ".join(f"{k}={v}" for k, v in sorted(row.items())) or "no dispatched KDA call"
        tr.write_line(f"{_OUTCOMES.get(nodeid, '?'):7s} {nodeid.split('::')[-1]}: {cells}")
    tr.write_line(f"totals: {dict(sorted(totals.items()))}")
    tr.write_line(f"tests with a served call: {sum(1 for r in rows.values() if any(k.endswith(':served') for k in r))}"
                  f" of {len(rows)}")
    tr.section("refusal reasons")
    for (entry, reason), n in reasons.most_common():
        tr.write_line(f"{n:6d}  {entry}: {reason}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fla_backend_counts.json"), "w") as f:
            json.dump({"per_test": rows, "outcomes": _OUTCOMES, "stats": {f"{a}:{b}": n for (a, b), n in stats.items()},
                       "reasons": [[e, r, n] for (e, r), n in reasons.most_common()]}, f, indent=1)
