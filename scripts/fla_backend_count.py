"""pytest plugin for scripts/device_integrations.sh: registers the flashkda_ext backend with fla before fla's
own tests run, and counts per test how many chunk_kda / fused_recurrent_kda_fwd calls flashkda_ext served and
how many it refused (fla then ran Triton), with the refusal reasons. Load with `-p fla_backend_count`
(scripts/ on PYTHONPATH); the table goes to the terminal and to $OUT/fla_backend_counts.json."""
import collections
import json
import os

import pytest

_ROWS = {}
_OUTCOMES = {}


def pytest_configure(config):
    from flashkda_ext.integrations import fla as fkda_fla
    if os.environ.get("FLA_BACKEND_OFF") != "1":
        fkda_fla.register()


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


def pytest_terminal_summary(terminalreporter):
    from flashkda_ext.integrations.fla import REASONS, STATS
    tr = terminalreporter
    tr.section("flashkda_ext backend: calls served / refused per test")
    totals = collections.Counter()
    for nodeid, row in sorted(_ROWS.items()):
        totals.update(row)
        cells = ", ".join(f"{k}={v}" for k, v in sorted(row.items())) or "no dispatched KDA call"
        tr.write_line(f"{_OUTCOMES.get(nodeid, '?'):7s} {nodeid.split('::')[-1]}: {cells}")
    tr.write_line(f"totals: {dict(sorted(totals.items()))}")
    tr.write_line(f"tests with a served call: {sum(1 for r in _ROWS.values() if any(k.endswith(':served') for k in r))}"
                  f" of {len(_ROWS)}")
    tr.section("refusal reasons")
    for (entry, reason), n in REASONS.most_common():
        tr.write_line(f"{n:6d}  {entry}: {reason}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fla_backend_counts.json"), "w") as f:
            json.dump({"per_test": _ROWS, "outcomes": _OUTCOMES, "stats": {f"{a}:{b}": n for (a, b), n in STATS.items()},
                       "reasons": [[e, r, n] for (e, r), n in REASONS.most_common()]}, f, indent=1)
