"""Family records -> module records: the one place the twin axes are expanded (docs/jit.md, "Family
records").

A spec file may list, beside plain "modules", "families": each one a stem plus the fields its modules
share. A module record is the file's "common" fields, then the family's, then the family's
"by_state" entry for the module's state dtype (later wins; "params" merge key by key), completed by
the twin axes ("twins": the file's, each key overridden by the family's):

    state   state dtypes        name + _f32 / _bf16     state_dtype
    offset  slot-offset widths  name + _o32 / _o64      slot_offset_bits
    gb32    true: a second twin  name + _gb32            params.gb_f32 = 1 (g and beta read as fp32)

so `{stem}_{state}_o{offset}[_gb32]`; without an "offset" axis the names carry no `_oNN` and
slot_offset_bits comes from the fields. The result is an ordinary record, checked like a plain one.
"""
from __future__ import annotations

import copy
import itertools
from typing import Dict, List, Tuple

STATE_TAGS = {"float32": "f32", "bfloat16": "bf16", "float64": "f64", "float16": "f16"}  # name tags
GB32_SUFFIX = "_gb32"
_FAMILY_ONLY = ("stem", "twins", "by_state")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = {**out.get("params", {}), **v} if k == "params" else copy.deepcopy(v)
    return out


def expand_family(fam: dict, common: dict, twins: dict) -> List[dict]:
    """Every module record of one family record, in axis order (state, offset, gb32)."""
    axes = {**twins, **fam.get("twins", {})}
    base = _merge(common, {k: v for k, v in fam.items() if k not in _FAMILY_ONLY})
    out = []
    # no "offset" axis: no _oNN in the names, slot_offset_bits from the fields (prefill's naming);
    # no "state" axis leaves state_dtype unset, which the record schema then refuses
    for state, bits, gb in itertools.product(axes.get("state", [None]), axes.get("offset", [None]),
                                             (False, True) if axes.get("gb32") else (False,)):
        rec = _merge(base, fam.get("by_state", {}).get(state, {}))
        rec["name"] = (fam["stem"] + (f"_{STATE_TAGS[state]}" if state else "") + (f"_o{bits}" if bits else "")
                       + (GB32_SUFFIX if gb else ""))
        if state:
            rec["state_dtype"] = state
        if bits:
            rec["slot_offset_bits"] = bits
        if gb:
            rec["params"] = {**rec["params"], "gb_f32": 1}
            rec["description"] = f"{rec['description']}; g and beta read as fp32"
        out.append(rec)
    return out


def expand_file(data: dict) -> Tuple[List[dict], Dict[str, str]]:
    """(records, gb32 twin of each generated base record) of one spec file: its plain "modules" first,
    then each family's records."""
    records = [copy.deepcopy(r) for r in data.get("modules", [])]
    twin_of: Dict[str, str] = {}
    for fam in data.get("families", []):
        recs = expand_family(fam, data.get("common", {}), data.get("twins", {}))
        names = {r["name"] for r in recs}
        twin_of.update({n[:-len(GB32_SUFFIX)]: n for n in names if n.endswith(GB32_SUFFIX)})
        records += recs
    return records, twin_of
