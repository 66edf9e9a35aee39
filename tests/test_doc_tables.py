"""Docs tables that restate jit/ data match it: docs/api.md's "What each backend accepts" table is
the one generated from jit/supported.json, its slot_mode table lists the supported slot modes,
docs/jit.md's module-record key table lists the record schema's keys (and its abi values), and
docs/index.md's command table names only options the CLI has."""
import copy
import json
import re

import pytest

from flashkda_ext import cli, paths
from flashkda_ext.devtools import doc_tables

DOCS = paths.PACKAGE_DIR.parent / "docs"
pytestmark = pytest.mark.skipif(not DOCS.is_dir(), reason="docs/ ships with the checkout")


def _rows(text: str, first_cell: str):
    """The rows (lists of cells) of the markdown table whose header's first cell is first_cell."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and line.split("|")[1].strip() == first_cell:
            out = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                out.append([c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]])
            return out
    raise AssertionError(f"no table headed {first_cell!r}")


def test_api_backend_table_is_the_generated_one():
    text = (DOCS / "api.md").read_text()
    assert doc_tables.block(text, "supported") == doc_tables.supported_table(), \
        "docs/api.md is stale: python3 -m flashkda_ext.devtools.doc_tables --write"
    assert doc_tables.main([]) == 0


def test_generated_table_follows_the_data():
    """A change of supported.json changes the table (the cell is computed, not written)."""
    entries = {f: e for f, e in doc_tables.supported_entries().items()
               if f in ("kda_decode", "kda_prefill", "fused_kda_decode")}
    table = doc_tables.supported_table(entries)
    assert "| group size HV / H | decode and prefill: any; fused: 1 |" in table
    changed = copy.deepcopy(entries)
    changed["kda_prefill"]["cuda"]["group_sizes"] = [1]
    assert "| group size HV / H | decode: any; prefill and fused: 1 |" in doc_tables.supported_table(changed)


def test_api_slot_mode_table_lists_the_supported_slot_modes():
    data = json.loads((paths.jit_dir() / "supported.json").read_text())
    modes = {m for f in data["families"].values() for b in f.values() for m in b["slot_modes"]}
    rows = _rows((DOCS / "api.md").read_text(), "slot_mode")
    documented = {re.search(r'`"(\w+)"`', r[0]).group(1) for r in rows}
    assert documented == modes


def test_jit_record_key_table_matches_the_schema():
    schema = json.loads((paths.jit_dir() / "schema" / "modules.schema.json").read_text())
    record = schema["$defs"]["record"]
    rows = _rows((DOCS / "jit.md").read_text(), "key")
    keys = {r[0].strip("`") for r in rows}
    assert keys == set(record["properties"])
    abi = next(r[1] for r in rows if r[0] == "`abi`")
    assert set(re.findall(r"`(\w+)`", abi)) == set(record["properties"]["abi"]["enum"])


def test_index_command_table_names_real_options():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)).choices
    rows = _rows((DOCS / "index.md").read_text(), "command")
    named = set()
    for r in rows:
        for usage in re.findall(r"`([^`]+)`", r[0]):
            words = usage.split()
            cmd = words[0]
            assert cmd in subs, usage
            named.add(cmd)
            options = set()
            stack = [subs[cmd]]
            while stack:      # the options of the command and of its subcommands (trace dump)
                p = stack.pop()
                for a in p._actions:
                    options.update(a.option_strings)
                    if hasattr(a, "choices") and isinstance(a.choices, dict):
                        stack += list(a.choices.values())
            for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", usage):
                assert flag in options, f"{cmd}: {flag} is in docs/index.md but not in the CLI"
    assert named == set(subs)
