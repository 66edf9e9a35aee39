"""Spec loading: the repository's jit/ files validate, and each broken rule gives one clear error
naming the file, the record and the rule."""
import json

import jsonschema
import pytest

from flashkda_ext import paths, supported
from flashkda_ext.devtools import testing
from flashkda_ext.jit import SpecError, all_records, get_record, registry, routes_for


def test_repository_specs_validate():
    reg = registry()  # raises SpecError on any broken rule
    assert set(reg.routes) <= {"kda_decode", "kda_prefill", "fused_kda_decode", "kda_verify", "fused_kda_verify"}
    for name in reg.records:
        assert get_record(name)["name"] == name


def test_schemas_are_valid_json_schema():
    for p in sorted((paths.jit_dir() / "schema").glob("*.schema.json")):
        jsonschema.Draft202012Validator.check_schema(json.loads(p.read_text()))


def test_supported_api():
    s = supported.supported("kda_decode", "cuda")
    assert s["head_dims_k"] == [128] and s["group_sizes"] is None  # "any" -> None
    assert supported.supported("kda_decode", "cpu")["value_heads"] is None
    assert supported.supported("no_such_family", "cpu") is None


def test_toy_tree_loads(tmp_path):
    root = testing.make_tree(tmp_path, cuda=True)
    names = [r["name"] for r in all_records(root)]
    assert names == ["toy_cpu", "toy_cuda"]
    rules = routes_for("kda_decode", root)
    assert [r["module"] for r in rules] == ["toy_cpu", "toy_cuda"]


def _modules_file(root):
    return root / "jit" / "modules" / "toy_cpu.json"


def _edit_record(root, **changes):
    path = _modules_file(root)
    data = json.loads(path.read_text())
    data["modules"][0].update(changes)
    for k, v in list(changes.items()):
        if v is None:
            del data["modules"][0][k]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("changes, rule", [
    ({"threads": None}, "'threads' is a required property"),
    ({"backend": "tpu"}, "backend: 'tpu' is not one of"),
    ({"sources": ["cpu/missing.cc"]}, "source 'cpu/missing.cc' does not exist"),
    ({"entry": "kda_prefill"}, "entry must be the family's function name 'kda_decode'"),
    ({"arches": ["sm_90a"]}, "a cpu module's arches must be [\"host\"]"),
    ({"abi": "per_row_grid"}, "a cpu module's abi must be 'host'"),
    ({"flags": ["-DFKDA_THREADS=3"]}, "flag '-DFKDA_THREADS=3' is set by the builder"),
    ({"params": {"tile": 1, "TILE": 2}}, "params names collide"),
    ({"params": {"tile": 1.5}}, "params/tile: 1.5 is not of type 'integer'"),
    ({"state_dtype": "float16"}, "state_dtype: 'float16' is not one of"),
    ({"extra": 1}, "Additional properties are not allowed ('extra' was unexpected)"),
])
def test_malformed_record_names_file_record_rule(tmp_path, changes, rule):
    root = testing.make_tree(tmp_path)
    _edit_record(root, **changes)
    with pytest.raises(SpecError) as ei:
        registry(root)
    msg = str(ei.value)
    assert "jit/modules/toy_cpu.json" in msg and "record 'toy_cpu'" in msg
    assert rule in msg, msg


def test_cuda_rules(tmp_path):
    root = testing.make_tree(tmp_path, cuda=True)
    path = root / "jit" / "modules" / "toy_cuda.json"
    for change, rule in [({"threads": 100}, "not a multiple of the warp size"),
                         ({"state_dtype": "any"}, "state_dtype 'any' is for cpu modules"),
                         ({"cluster": [4, 4, 2]}, "Hopper allows at most 16"),
                         ({"abi": "persistent_rows"}, "needs persistent_k > 0"),
                         ({"abi": "cluster_pair"}, "needs a cluster of more than one CTA"),
                         ({"smem_bytes": 200000}, "exceeds 233472 bytes of shared memory per SM"),
                         ({"arches": ["host"]}, "arches are sm_XX targets")]:
        rec = testing.cuda_record(**change)
        testing.write_json(path, {"description": "d", "modules": [rec]})
        with pytest.raises(SpecError, match="record 'toy_cuda'") as ei:
            registry(root)
        assert rule in str(ei.value), str(ei.value)


def test_helper_family_rules(tmp_path):
    """A helper module (family ffi_reorder: no kernel, no route, no jit/supported.json entry) is host
    C++ with no params; its macros render as "any"; no route may pick it."""
    from flashkda_ext.jit import macros
    root = testing.make_tree(tmp_path)
    path = root / "jit" / "modules" / "zz_helper.json"
    helper = dict(testing.cpu_record(), name="toy_helper", family="ffi_reorder", entry="ffi_reorder",
                  params={})
    testing.write_json(path, {"description": "d", "modules": [helper]})
    assert get_record("toy_helper", root)["family"] == "ffi_reorder"
    vals = macros.contract_values(get_record("toy_helper", root), root)
    assert vals["FKDA_HEAD_DIM_K"] == 0 and vals["FKDA_NUM_SUPPORTED_VALUE_HEADS"] == 0
    for change, rule in [({"backend": "cuda", "arches": ["sm_90a"], "abi": "per_row_grid", "threads": 32,
                           "state_dtype": "float32"}, "'ffi_reorder' is a helper family"),
                         ({"params": {"add": 1}}, "params empty"),
                         ({"entry": "make_reorder"}, "entry must be the family's function name")]:
        testing.write_json(path, {"description": "d", "modules": [dict(helper, **change)]})
        with pytest.raises(SpecError, match="record 'toy_helper'") as ei:
            registry(root)
        assert rule in str(ei.value), str(ei.value)
    testing.write_json(path, {"description": "d", "modules": [helper]})
    _write_rules(root, [{"name": "cpu", "when": {"device": "cpu"}, "module": "toy_helper"}])
    with pytest.raises(SpecError, match="module 'toy_helper' is ffi_reorder/cpu, not kda_decode/cpu"):
        registry(root)


def test_duplicate_name_names_both_files(tmp_path):
    root = testing.make_tree(tmp_path)
    testing.write_json(root / "jit" / "modules" / "zz_dup.json",
                       {"description": "d", "modules": [testing.cpu_record()]})
    with pytest.raises(SpecError, match=r"zz_dup.json: record 'toy_cpu': name is not unique: "
                                        r"also defined in jit/modules/toy_cpu.json"):
        registry(root)


def test_invalid_json_names_file(tmp_path):
    root = testing.make_tree(tmp_path)
    _modules_file(root).write_text("{not json")
    with pytest.raises(SpecError, match=r"toy_cpu.json: not valid JSON"):
        registry(root)


def _write_rules(root, rules, family="kda_decode"):
    testing.write_json(root / "jit" / "routes" / f"{family}.json",
                       {"family": family, "description": "d", "rules": rules})


def test_route_rules(tmp_path):
    root = testing.make_tree(tmp_path, cuda=True)
    cpu = {"name": "cpu", "when": {"device": "cpu"}, "module": "toy_cpu"}
    cuda = {"name": "fallback", "when": {"device": "cuda"}, "module": "toy_cuda"}
    cases = [
        ([cpu, {"name": "f", "when": {"device": "cuda"}, "module": "toy_{state}"}],
         "rule f", "module 'toy_f32' (from 'toy_{state}') is not defined"),
        ([cpu, {"name": "f", "when": {"device": "cuda"}, "module": "toy_cpu"}],
         "rule f", "module 'toy_cpu' is kda_decode/cpu, not kda_decode/cuda"),
        ([cpu, {"name": "r", "when": {"device": "cuda", "colour": 1}, "module": "toy_cuda"}, cuda],
         "rule r", "condition 'colour' is not route metadata"),
        ([cpu, {"name": "r", "when": {"device": "cuda", "state_min": 1}, "module": "toy_cuda"}, cuda],
         "rule r", "range condition 'state_min' needs a numeric key"),
        ([cpu, {"name": "r", "when": {"device": "cuda"}, "module": "toy_{foo}"}],
         "rule r", "placeholder '{foo}'"),
        ([cpu, cuda, {"name": "late", "when": {"device": "cuda", "rows_max": 4}, "module": "toy_cuda"}],
         "rule late", "unreachable"),
        ([cpu], None, "no always-true fallback rule"),
    ]
    for rules, record, rule in cases:
        _write_rules(root, rules)
        with pytest.raises(SpecError) as ei:
            registry(root)
        msg = str(ei.value)
        assert "jit/routes/kda_decode.json" in msg and rule in msg, msg
        if record:
            assert f"record '{record}'" in msg, msg


def test_route_placeholders_expand_over_allowed_values(tmp_path):
    root = testing.make_tree(tmp_path, cuda=True)
    # one module per (state, offset) so that a formatted route is valid only if all four exist
    recs = [testing.cuda_record(name=f"toy_{s}_{o}", state_dtype=d, slot_offset_bits=b)
            for s, d in (("f32", "float32"), ("bf16", "bfloat16")) for o, b in (("o32", 32), ("o64", 64))]
    testing.write_json(root / "jit" / "modules" / "toy_cuda.json", {"description": "d", "modules": recs})
    _write_rules(root, [{"name": "cpu", "when": {"device": "cpu"}, "module": "toy_cpu"},
                        {"name": "f", "when": {"device": "cuda"}, "module": "toy_{state}_{offset}"}])
    assert routes_for("kda_decode", root)[1]["module"] == "toy_{state}_{offset}"
    # restricting the condition to f32 makes a missing bf16 module acceptable
    testing.write_json(root / "jit" / "modules" / "toy_cuda.json",
                       {"description": "d", "modules": [r for r in recs if "f32" in r["name"]]})
    _write_rules(root, [{"name": "cpu", "when": {"device": "cpu"}, "module": "toy_cpu"},
                        {"name": "a", "when": {"device": "cuda", "state": "f32"},
                         "module": "toy_{state}_{offset}"},
                        {"name": "f", "when": {"device": "cuda"}, "module": "toy_f32_o32"}])
    assert len(routes_for("kda_decode", root)) == 3
    _write_rules(root, [{"name": "cpu", "when": {"device": "cpu"}, "module": "toy_cpu"},
                        {"name": "f", "when": {"device": "cuda"}, "module": "toy_{state}_{offset}"}])
    with pytest.raises(SpecError, match="module 'toy_bf16_o32'"):
        registry(root)


def test_routes_file_named_by_family(tmp_path):
    root = testing.make_tree(tmp_path)
    (root / "jit" / "routes" / "kda_decode.json").rename(root / "jit" / "routes" / "decode.json")
    with pytest.raises(SpecError, match="must be named kda_decode.json"):
        registry(root)


def test_unknown_module_name_lists_known(tmp_path):
    root = testing.make_tree(tmp_path)
    with pytest.raises(KeyError, match="no JIT module named 'nope'.*toy_cpu"):
        get_record("nope", root)


def test_data_root_env(tmp_path, monkeypatch):
    root = testing.make_tree(tmp_path)
    monkeypatch.setenv("FLASHKDA_EXT_DATA_ROOT", str(root))
    assert [r["name"] for r in all_records()] == ["toy_cpu"]


_BAD_RECORDS = [{"threads": None}, {"backend": "tpu"}, {"params": {"tile": 1.5}}, {"extra": 1},
                {"cluster": [1, 1]}, {"threads": 0}, {"name": "Bad-Name"}, {"arches": []},
                {"sources": ["a.cc", "a.cc"]}, {"slot_offset_bits": 16}, {"aot": 1},
                {"params": {"1x": 2}}, {"description": ""}]


@pytest.mark.parametrize("change", _BAD_RECORDS, ids=[next(iter(c)) + str(i) for i, c in
                                                       enumerate(_BAD_RECORDS)])
def test_schema_check_reports_each_bad_record(change):
    # schema_check is jsonschema plus a stable order; each bad field is reported at its path
    from flashkda_ext.jit.schema_check import validate
    schema = json.loads((paths.jit_dir() / "schema" / "modules.schema.json").read_text())
    rec = testing.cpu_record(**change)
    rec = {k: v for k, v in rec.items() if v is not None}
    problems = validate(schema, {"description": "d", "modules": [rec]})
    assert problems and problems[0].path[:2] == ["modules", 0]
    key = next(iter(change))
    assert key in problems[0].path or key in problems[0].message
    assert validate(schema, {"description": "d", "modules": [testing.cpu_record()]}) == []


def test_repository_files_satisfy_their_schemas():
    from flashkda_ext.jit.schema_check import validate
    for kind, pattern in (("modules", "modules/*.json"), ("routes", "routes/*.json"),
                          ("supported", "supported.json")):
        schema = json.loads((paths.jit_dir() / "schema" / f"{kind}.schema.json").read_text())
        for p in sorted(paths.jit_dir().glob(pattern)):
            assert validate(schema, json.loads(p.read_text())) == [], p


def test_opt_out_generates_the_way_back_before_its_rule(tmp_path):
    """A rule's "opt_out" {"tag", "module"} becomes an opt-in twin <rule>_<tag> in the same band, just before it,
    sending the call to that module; the rule itself loses the key. A twin naming an unknown module is refused."""
    root = testing.make_tree(tmp_path, cuda=True)
    path = root / "jit" / "modules" / "toy_cuda.json"
    testing.write_json(path, {"description": "d", "modules": [testing.cuda_record(), testing.cuda_record(name="toy_new")]})
    cpu = {"name": "cpu", "when": {"device": "cpu"}, "module": "toy_cpu"}
    fallback = {"name": "fallback", "when": {"device": "cuda"}, "module": "toy_cuda"}
    new = {"name": "new", "when": {"device": "cuda", "rows_min": 8}, "module": "toy_new",
           "opt_out": {"tag": "old", "module": "toy_cuda"}}
    _write_rules(root, [cpu, new, fallback])
    reg = registry(root)
    names = [r["name"] for r in reg.routes["kda_decode"]["rules"]]
    assert names == ["cpu", "new_old", "new", "fallback"] and reg.opt_in_tags == {"old"}
    twin, rule = reg.routes["kda_decode"]["rules"][1:3]
    assert twin["when"] == rule["when"] and twin["opt_in"] == "old" and twin["module"] == "toy_cuda"
    assert "opt_out" not in rule and "opt_in" not in rule
    _write_rules(root, [cpu, dict(new, opt_out={"tag": "old", "module": "toy_gone"}), fallback])
    with pytest.raises(SpecError) as ei:
        registry(root)
    assert "toy_gone" in str(ei.value) and "new_old" in str(ei.value), str(ei.value)


def test_opt_in_marks_agree_between_records_and_rules(tmp_path):
    """An opt_in record is reached by opt-in rules only; an opt-in rule may reach a default record too (an
    escape hatch back to it, kda_prefill's exact_chain)."""
    root = testing.make_tree(tmp_path, cuda=True)
    path = root / "jit" / "modules" / "toy_cuda.json"
    opt = testing.cuda_record(name="toy_opt", opt_in=True)
    testing.write_json(path, {"description": "d", "modules": [testing.cuda_record(), opt]})
    cpu = {"name": "cpu", "when": {"device": "cpu"}, "module": "toy_cpu"}
    fallback = {"name": "fallback", "when": {"device": "cuda"}, "module": "toy_cuda"}
    _write_rules(root, [cpu, {"name": "mine", "when": {"device": "cuda"}, "opt_in": "toy", "module": "toy_opt"},
                        fallback])
    assert registry(root).opt_in_tags == {"toy"} and "toy_opt" in registry(root).routed
    _write_rules(root, [cpu, {"name": "back", "when": {"device": "cuda"}, "opt_in": "plain", "module": "toy_cuda"},
                        {"name": "mine", "when": {"device": "cuda"}, "opt_in": "toy", "module": "toy_opt"}, fallback])
    assert registry(root).opt_in_tags == {"plain", "toy"}
    for rules, rule in [([cpu, {"name": "mine", "when": {"device": "cuda"}, "module": "toy_opt"}, fallback],
                         "module 'toy_opt' is marked opt_in in jit/modules, but the rule is not an opt-in rule"),
                        # an opt-in rule is no fallback: the device still needs an always-true rule
                        ([cpu, {"name": "mine", "when": {"device": "cuda"}, "opt_in": "toy", "module": "toy_opt"}],
                         "no always-true fallback rule")]:
        _write_rules(root, rules)
        with pytest.raises(SpecError) as ei:
            registry(root)
        assert rule in str(ei.value), str(ei.value)
