"""Family records (jit/modules/*.json "families") expanded into module records by
flashkda_ext/jit/families.py, and the routes' generated _gb32 twin rules (docs/jit.md, "Family records")."""
import json
from pathlib import Path

import pytest

from flashkda_ext.devtools import testing
from flashkda_ext.jit import SpecError, all_records, get_record, registry, routes_for, specs
from flashkda_ext.jit.families import expand_family, expand_file

# Every CUDA record of decode, fused decode, verify and fused verify as it was written out by hand before
# the family format (minus its description), from the live set of issue 44's step 1.
FROZEN = json.loads((Path(__file__).parent / "data" / "live_cuda_records.json").read_text())
FAMILY_FILES = ("decode_cuda", "fused_decode_cuda", "verify_cuda", "fused_verify_cuda")


def test_the_expansion_equals_the_frozen_records():
    got = {r["name"]: r for r in all_records()
           if specs.record_file(r["name"]) in {f"jit/modules/{f}.json" for f in FAMILY_FILES}}
    assert sorted(got) == sorted(FROZEN)
    for name, want in FROZEN.items():
        rec = {k: v for k, v in got[name].items() if k not in ("name", "description")}
        assert rec == want, name
        assert "\n" not in got[name]["description"] and len(got[name]["description"]) <= 200, name


def test_family_axes_overrides_and_params():
    common = {"family": "kda_decode", "threads": 64, "params": {"pdl": 1, "v_tile": 16}}
    twins = {"state": ["float32", "bfloat16"], "offset": [32, 64], "gb32": True}
    fam = {"stem": "x", "threads": 128, "params": {"v_tile": 32}, "twins": {"offset": [64]},
           "by_state": {"bfloat16": {"min_blocks": 3, "params": {"stages": 4}}}, "description": "d"}
    recs = expand_family(fam, common, twins)
    assert [r["name"] for r in recs] == ["x_f32_o64", "x_f32_o64_gb32", "x_bf16_o64", "x_bf16_o64_gb32"]
    f32, f32g, bf16, bf16g = recs
    assert f32["threads"] == 128 and f32["params"] == {"pdl": 1, "v_tile": 32} and "min_blocks" not in f32
    assert (f32["state_dtype"], f32["slot_offset_bits"]) == ("float32", 64)
    assert f32g["params"] == {"pdl": 1, "v_tile": 32, "gb_f32": 1} and f32g["description"].startswith("d;")
    assert bf16["min_blocks"] == 3 and bf16["params"] == {"pdl": 1, "v_tile": 32, "stages": 4}
    assert bf16g["params"]["gb_f32"] == 1 and bf16g["state_dtype"] == "bfloat16"
    assert "stem" not in f32 and "twins" not in f32 and "by_state" not in f32
    assert common == {"family": "kda_decode", "threads": 64, "params": {"pdl": 1, "v_tile": 16}}  # untouched
    # plain records stay as written, before the families' records
    plain = testing.cuda_record()
    records, twin_of = expand_file({"modules": [plain], "families": [fam], "common": common, "twins": twins})
    assert records[0] == plain and twin_of == {"x_f32_o64": "x_f32_o64_gb32", "x_bf16_o64": "x_bf16_o64_gb32"}


def _family_tree(tmp_path, fam=None, rules=None):
    root = testing.make_tree(tmp_path, cuda=True)
    base = {k: v for k, v in testing.cuda_record().items()
            if k not in ("name", "state_dtype", "slot_offset_bits", "description")}
    fam = fam or {"stem": "toy_fam", "description": "a toy family"}
    testing.write_json(root / "jit" / "modules" / "toy_cuda.json",
                       {"description": "d", "common": base, "twins": {"state": ["float32", "bfloat16"],
                                                                      "offset": [32, 64], "gb32": True},
                        "families": [fam]})
    rules = rules or [{"name": "fallback", "when": {"device": "cuda"}, "module": "toy_fam_{state}_{offset}"}]
    testing.write_json(root / "jit" / "routes" / "kda_decode.json",
                       {"family": "kda_decode", "description": "d",
                        "rules": [{"name": "cpu", "when": {"device": "cpu"}, "module": "toy_cpu"}] + rules})
    return root


def test_generated_records_and_twin_rules(tmp_path):
    root = _family_tree(tmp_path)
    assert get_record("toy_fam_f32_o64_gb32", root)["params"] == {"add": 2, "gb_f32": 1}
    rules = routes_for("kda_decode", root)
    assert [r["name"] for r in rules] == ["cpu", "fallback_gb32", "fallback"]
    assert rules[1]["when"] == {"device": "cuda", "gb": "f32"} and rules[1]["module"] == "toy_fam_{state}_{offset}_gb32"
    assert registry(root).routed >= {"toy_fam_f32_o32", "toy_fam_f32_o64_gb32"}


@pytest.mark.parametrize("fam,parts", [
    ({"stem": "toy_fam", "threads": 100, "description": "d"},
     ["record 'toy_fam_f32_o32'", "threads 100 is not a multiple of the warp size"]),
    ({"stem": "toy_fam", "by_state": {"float32": {"smem_bytes": -1}}, "description": "d"},
     ["families/0/by_state/float32/smem_bytes: -1 is less than the minimum of 0"]),
    ({"stem": "toy_fam", "description": "x" * 161}, ["families/0/description"]),
    ({"stem": "toy_fam", "state_dtype": "float32", "description": "d"}, ["'state_dtype' was unexpected"]),
])
def test_a_bad_family_is_a_spec_error_naming_the_record(tmp_path, fam, parts):
    with pytest.raises(SpecError) as ei:
        registry(_family_tree(tmp_path, fam))
    assert all(p in str(ei.value) for p in parts), str(ei.value)


def test_a_rule_whose_modules_mix_twin_axes_is_refused(tmp_path):
    root = _family_tree(tmp_path)
    path = root / "jit" / "modules" / "toy_cuda.json"
    data = json.loads(path.read_text())
    # the same stem split in two: the f32 modules with gb32 twins, the bf16 ones without
    data["families"] = [{"stem": "toy_fam", "twins": {"state": ["float32"]}, "description": "d"},
                        {"stem": "toy_fam", "twins": {"state": ["bfloat16"], "gb32": False}, "description": "d"}]
    testing.write_json(path, data)
    with pytest.raises(SpecError, match="rule fallback.*some of its modules have a gb32 twin and some not"):
        registry(root)


def test_a_generated_twin_rule_is_not_written_by_hand(tmp_path):
    root = _family_tree(tmp_path, rules=[
        {"name": "fallback", "when": {"device": "cuda"}, "module": "toy_fam_{state}_{offset}"},
        {"name": "fallback_gb32", "when": {"device": "cuda", "gb": "f32"}, "module": "toy_fam_{state}_{offset}_gb32"}])
    with pytest.raises(SpecError, match="rule names must be unique"):
        registry(root)


def test_a_family_without_an_offset_axis_names_no_offset():
    """prefill's naming: {stem}_{state}, slot_offset_bits from the fields."""
    recs = expand_family({"stem": "p", "slot_offset_bits": 64, "description": "d"}, {"params": {}},
                         {"state": ["float32", "bfloat16"]})
    assert [(r["name"], r["slot_offset_bits"], r["state_dtype"]) for r in recs] == [
        ("p_f32", 64, "float32"), ("p_bf16", 64, "bfloat16")]
