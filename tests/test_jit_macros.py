"""Macros rendered from a record plus jit/supported.json (docs/architecture.md lists them)."""
import json
import re

import pytest

from flashkda_ext import supported
from flashkda_ext.devtools import testing
from flashkda_ext.jit import get_record, render_header, render_macros
from flashkda_ext.jit.macros import contract_values, define_flags

CONTRACT = ["FKDA_MODULE_NAME", "FKDA_FAMILY", "FKDA_THREADS", "FKDA_SMEM_BYTES", "FKDA_MIN_BLOCKS",
            "FKDA_CLUSTER_X", "FKDA_CLUSTER_Y", "FKDA_CLUSTER_Z", "FKDA_PERSISTENT_K",
            "FKDA_STATE_BF16", "FKDA_SLOT_OFFSET_BITS", "FKDA_HEAD_DIM_K", "FKDA_HEAD_DIM_V",
            "FKDA_SUPPORTED_VALUE_HEADS", "FKDA_NUM_SUPPORTED_VALUE_HEADS",
            "FKDA_SUPPORTED_GROUP_SIZES", "FKDA_NUM_SUPPORTED_GROUP_SIZES"]


@pytest.fixture
def root(tmp_path):
    return testing.make_tree(tmp_path, cuda=True)


def test_cuda_macros_from_record_and_supported(root):
    rec = get_record("toy_cuda", root)
    rec.update(cluster=[2, 1, 1], persistent_k=3, state_dtype="bfloat16", slot_offset_bits=64,
               params={"chunk": 64, "add": 2})
    m = dict(render_macros(rec, root))
    assert list(m)[:len(CONTRACT)] == CONTRACT
    sup = supported.supported("kda_decode", "cuda", root)
    assert m["FKDA_MODULE_NAME"] == '"toy_cuda"' and m["FKDA_FAMILY"] == '"kda_decode"'
    assert (m["FKDA_THREADS"], m["FKDA_SMEM_BYTES"], m["FKDA_MIN_BLOCKS"]) == ("128", "512", "2")
    assert (m["FKDA_CLUSTER_X"], m["FKDA_CLUSTER_Y"], m["FKDA_CLUSTER_Z"]) == ("2", "1", "1")
    assert m["FKDA_PERSISTENT_K"] == "3" and m["FKDA_STATE_BF16"] == "1"
    assert m["FKDA_SLOT_OFFSET_BITS"] == "64"
    assert m["FKDA_HEAD_DIM_K"] == str(sup["head_dims_k"][0])
    assert m["FKDA_SUPPORTED_VALUE_HEADS"] == "{" + ",".join(map(str, sup["value_heads"])) + "}"
    assert m["FKDA_NUM_SUPPORTED_VALUE_HEADS"] == str(len(sup["value_heads"]))
    assert m["FKDA_PARAM_CHUNK"] == "64" and m["FKDA_PARAM_ADD"] == "2"


def test_cpu_any_conventions(root):
    m = dict(render_macros(get_record("toy_cpu", root), root))
    assert m["FKDA_STATE_BF16"] == "-1"          # CPU modules accept any state dtype
    assert m["FKDA_HEAD_DIM_K"] == "0" and m["FKDA_HEAD_DIM_V"] == "0"
    assert m["FKDA_SUPPORTED_VALUE_HEADS"] == "{}" and m["FKDA_NUM_SUPPORTED_VALUE_HEADS"] == "0"


def test_header_and_contract_json(root):
    rec = get_record("toy_cuda", root)
    text = render_header(rec, root)
    defined = dict(re.findall(r"^#define (\w+) (.*)$", text, re.MULTILINE))
    assert set(CONTRACT) <= set(defined)
    contract = json.loads(json.loads(defined["FKDA_CONTRACT_JSON"]))  # C literal -> JSON -> dict
    assert contract == contract_values(rec, root)
    assert define_flags(rec, root)[2] == "-DFKDA_THREADS=128"


def test_multiple_head_dims_rejected(root):
    sup = root / "jit" / "supported.json"
    data = json.loads(sup.read_text())
    data["families"]["kda_decode"]["cuda"]["head_dims_k"] = [64, 128]
    sup.write_text(json.dumps(data))
    supported.clear_cache()
    try:
        with pytest.raises(ValueError, match="FKDA_HEAD_DIM_K"):
            render_macros(testing.cuda_record(), root)
    finally:
        supported.clear_cache()
