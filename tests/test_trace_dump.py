"""`flashkda-ext trace dump`: definitions for given options, and a clear refusal naming the option
for a value or combination that has no definition (trace.definition_for_options)."""
from __future__ import annotations

import json

import pytest

from flashkda_ext import cli, trace

BASE = dict(heads=16, value_heads=None, head_dim=128, head_dim_k=None, head_dim_v=None,
            input_dtype="bfloat16", state_dtype="float32", gate="softplus", lower_bound=-5.0,
            slot_mode="unique", backend="cuda", rows=4, slots=64, tokens=256, seqs=2, checkpoint_every=0)


@pytest.mark.parametrize("op", trace.OPS)
def test_supported_options_give_a_valid_definition(op):
    d = trace.definition_for_options(op, BASE)
    trace.validate_definition(d)
    assert d["name"].startswith(op) and f"op:{op}" in d["tags"]


@pytest.mark.parametrize("op,change,option,words", [
    ("kda_decode", {"input_dtype": "fp32"}, "--input-dtype", "expected one of float32, bfloat16, float16"),
    ("kda_decode", {"state_dtype": "float64"}, "--state-dtype", "expected one of"),
    ("kda_decode", {"input_dtype": "float16"}, "--input-dtype", "'float16' is not supported by the cuda backend"),
    ("kda_prefill", {"state_dtype": "float16"}, "--state-dtype", "state dtype 'float16' is not supported"),
    ("kda_decode", {"heads": 7}, "--value-heads/--heads", "value heads 7"),
    ("kda_decode", {"heads": 16, "value_heads": 24}, "--value-heads/--heads", "num_v_heads % num_heads == 0"),
    ("kda_decode", {"head_dim": 64}, "--head-dim-k/--head-dim", "head_dim_k 64"),
    ("fused_kda_decode", {"heads": 4}, "--value-heads/--heads", "value heads 4"),
    ("kda_decode", {"rows": 0}, "--rows", "positive integer"),
    ("kda_verify", {"tokens": 1, "seqs": 2}, "--tokens", "at least --seqs = 2"),
    ("kda_verify", {"head_dim": 64}, "--head-dim-k/--head-dim", "head_dim_k 64"),
    ("fused_kda_verify", {"heads": 4}, "--value-heads/--heads", "value heads 4"),
])
def test_unsupported_options_are_refused_naming_the_option(op, change, option, words):
    with pytest.raises(ValueError) as e:
        trace.definition_for_options(op, dict(BASE, **change))
    assert str(e.value).startswith(option) and words in str(e.value), str(e.value)


def test_the_cpu_backend_takes_what_cuda_refuses():
    d = trace.definition_for_options("kda_decode", dict(BASE, input_dtype="float32", backend="cpu"))
    assert d["name"].endswith("_f32in_cpu") and d["constraints"] == []


def test_cli_prints_the_refusal_and_exits_2(capsys, tmp_path):
    assert cli.main(["trace", "dump", "kda_decode", "--input-dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "--input-dtype" in err and "'fp32'" in err and "Traceback" not in err
    out = tmp_path / "d.json"
    assert cli.main(["trace", "dump", "kda_prefill", "--checkpoint-every", "64", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert {"checkpoints", "final_state"} <= set(d["inputs"]) and "checkpoints_out" in d["outputs"]


@pytest.mark.parametrize("op", ["kda_verify", "fused_kda_verify"])
def test_verify_dump_holds_the_draft_table(op, capsys):
    """T_max = ceil(tokens / seqs) columns; the index inputs and the accepted counts are inputs."""
    assert cli.main(["trace", "dump", op, "--tokens", "7", "--seqs", "2", "--check"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["inputs"]["state_indices"]["shape"] == ["num_seqs", "max_draft"]
    assert {"cu_seqlens", "num_accepted_tokens"} <= set(d["inputs"]) and "state_out" in d["outputs"]
    assert d["name"].startswith(op) and "noaccepted" not in d["name"]


@pytest.mark.parametrize("flags,name_part", [(["--step-rows"], "_rows"), (["--initial-slots", "5"], "_init"),
                                             (["--step-rows", "--initial-slots", "5"], "_rows_init"),
                                             (["--tree"], "_tree"), (["--step-rows", "--tree"], "_rows_tree"),
                                             (["--initial-slots", "5", "--tree"], "_init_tree")])
def test_verify_dump_of_step_rows_a_start_pool_and_a_tree(flags, name_part, capsys):
    assert cli.main(["trace", "dump", "kda_verify", "--tokens", "7", "--seqs", "2", "--check"] + flags) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["name"].endswith(name_part)
    rows, init, tree = "--step-rows" in flags, "--initial-slots" in flags, "--tree" in flags
    assert d["inputs"]["state_indices"]["shape"] == (["num_seqs"] if rows else ["num_seqs", "max_draft"])
    assert len(d["inputs"]["state"]["shape"]) == (5 if rows else 4)
    assert ("initial_state_indices" in d["inputs"]) == init and ("num_accepted_tokens" in d["inputs"]) != init
    assert ("parent_tokens" in d["inputs"]) == tree
    assert ("domain:parent_tokens=tree_parents(max_draft)" in d["tags"]) == tree
    if tree:
        assert d["inputs"]["parent_tokens"]["shape"] == ["num_seqs", "max_draft"]
        assert d["inputs"]["parent_tokens"]["dtype"] == "int32"


@pytest.mark.parametrize("argv,option", [(["kda_verify", "--initial-slots", "-1"], "--initial-slots"),
                                         (["kda_decode", "--initial-slots", "3"], "--initial-slots"),
                                         (["fused_kda_verify", "--step-rows"], "--step-rows"),
                                         (["fused_kda_verify", "--tree"], "--tree")])
def test_dump_refuses_kda_verify_options_other_ops_cannot_use(argv, option, capsys):
    assert cli.main(["trace", "dump"] + argv) == 2
    assert f"flashkda-ext trace dump: {option}:" in capsys.readouterr().err


@pytest.mark.parametrize("argv,option,words", [
    (["kda_prefill", "--checkpoint-every", "-64"], "--checkpoint-every", "expected an int >= 0"),
    (["kda_decode", "--value-heads", "0"], "--value-heads", "positive integer, got 0"),
    (["kda_decode", "--head-dim-k", "0"], "--head-dim-k", "positive integer, got 0"),
    (["kda_decode", "--value-heads", "-16"], "--value-heads", "positive integer, got -16"),
    (["kda_decode", "--head-dim-v", "-8"], "--head-dim-v", "positive integer, got -8"),
    (["kda_decode", "--head-dim", "99999999999999999999"], "--head-dim", "elements"),
    (["kda_prefill", "--head-dim", "3000000000", "--backend", "cpu"], "--head-dim", "elements"),
    (["kda_decode", "--gate", "bounded", "--lower-bound", "nan"], "--lower-bound", "finite value < 0, got nan"),
    (["kda_decode", "--gate", "bounded", "--lower-bound", "5"], "--lower-bound", "finite value < 0, got 5.0"),
    (["kda_decode", "--out", "{tmp}/missing/d.json"], "--out", "does not exist"),
    (["kda_decode", "--out", "{tmp}"], "--out", "a directory"),
])
def test_dump_refuses_bad_option_values_naming_the_option(argv, option, words, capsys, tmp_path):
    """The op's own rules (validation), refused with exit 2 and no traceback, nothing written."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(["trace", "dump"] + argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"flashkda-ext trace dump: {option}: ") and words in captured.err, captured.err
    assert "Traceback" not in captured.err and captured.out == "" and list(tmp_path.iterdir()) == []
