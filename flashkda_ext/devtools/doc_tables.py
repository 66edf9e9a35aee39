"""Docs tables that restate the jit/ data, generated from it so that they cannot drift.

docs/api.md's "What each backend accepts" table is written here from jit/supported.json (the one
source of truth) and the CUDA module records' arches; the doc holds it between two marker comments,
and tests/test_doc_tables.py checks that the doc's copy equals a fresh one.

    python3 -m flashkda_ext.devtools.doc_tables            # exit 1 when docs/api.md is stale
    python3 -m flashkda_ext.devtools.doc_tables --write    # rewrite the table in docs/api.md
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .. import paths
from ..jit import all_records
from .. import supported

FAMILY_WORDS = {"kda_decode": "decode", "kda_prefill": "prefill", "fused_kda_decode": "fused",
                "kda_verify": "verify", "fused_kda_verify": "fused verify"}
BACKEND_WORDS = {"cuda": "CUDA", "cpu": "CPU"}
# (supported.json field, the row's label in the doc)
ROWS = (("input_dtypes", "input dtype (q, k, v, g, beta; x)"),
        ("head_dims_k", "head dim K"),
        ("head_dims_v", "head dim V"),
        ("value_heads", "value heads HV"),
        ("group_sizes", "group size HV / H"),
        ("state_dtypes", "state dtype"),
        ("gates", "gates"),
        ("slot_modes", "slot modes"))
BEGIN = "<!-- begin generated: {name} (flashkda_ext.devtools.doc_tables; edit the data, not this table) -->"
END = "<!-- end generated: {name} -->"


def _value(v) -> str:
    return "any" if v is None else ", ".join(str(x) for x in v)


def _join_words(words: List[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _cell(per_family: Dict[str, object]) -> str:
    """One value when every family agrees, else 'decode and prefill: ...; fused: ...'."""
    groups: Dict[str, List[str]] = {}
    for fam, v in per_family.items():
        groups.setdefault(_value(v), []).append(FAMILY_WORDS.get(fam, fam))
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{_join_words(fams)}: {v}" for v, fams in groups.items())


def _backend_heading(backend: str) -> str:
    arches = sorted({a for r in all_records() if r["backend"] == backend and backend != "cpu" for a in r["arches"]})
    word = BACKEND_WORDS.get(backend, backend)
    return f"{word} ({', '.join(arches)})" if arches else word


def supported_entries() -> Dict[str, Dict[str, dict]]:
    """{family: {backend: {key: allowed values, None for any}}} as flashkda_ext.supported reads them."""
    return {fam: {b: supported.supported(fam, b) for b in backends}
            for fam, backends in supported.families().items()}


def supported_table(entries: Optional[Dict[str, Dict[str, dict]]] = None) -> str:
    """The markdown table of what each backend of each family accepts, from jit/supported.json."""
    fams = supported_entries() if entries is None else entries
    backends = sorted({b for f in fams.values() for b in f}, key=lambda b: (b != "cuda", b))
    lines = ["| | " + " | ".join(_backend_heading(b) for b in backends) + " |",
             "|---|" + "---|" * len(backends)]
    for field, label in ROWS:
        cells = [_cell({fam: per[b][field] for fam, per in fams.items() if b in per}) for b in backends]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


GENERATED = {"supported": supported_table}


def _block_re(name: str) -> "re.Pattern[str]":
    return re.compile(re.escape(BEGIN.format(name=name)) + r"\n(.*?)\n?" + re.escape(END.format(name=name)),
                      re.DOTALL)


def block(text: str, name: str) -> Optional[str]:
    """The doc's copy of generated table `name`, or None when its markers are missing."""
    m = _block_re(name).search(text)
    return None if m is None else m.group(1).strip("\n")


def regenerate(text: str) -> str:
    for name, make in GENERATED.items():
        rx = _block_re(name)
        if not rx.search(text):
            raise ValueError(f"docs/api.md has no markers for the generated table '{name}'")
        text = rx.sub(lambda m: f"{BEGIN.format(name=name)}\n{make()}\n{END.format(name=name)}", text)
    return text


def api_doc() -> Path:
    return paths.PACKAGE_DIR.parent / "docs" / "api.md"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Check (default) or rewrite the generated tables of docs/api.md.")
    p.add_argument("--write", action="store_true", help="rewrite the tables in place")
    a = p.parse_args(argv)
    doc = api_doc()
    text = doc.read_text()
    new = regenerate(text)
    if a.write:
        doc.write_text(new)
        print(f"wrote {doc}")
        return 0
    if new != text:
        print(f"{doc}: generated tables are stale; run python3 -m flashkda_ext.devtools.doc_tables --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
