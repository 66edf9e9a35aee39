"""scripts/custom_op_floor.py on the CPU: every op's custom-op call and its no-op twin of the same schema
accept the script's arguments, and each section prints its rows with times."""
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
floor = importlib.import_module("custom_op_floor")

OPS = ("kda_decode", "fused_kda_decode", "kda_prefill", "kda_verify", "fused_kda_verify")


def test_every_section_runs_and_prints_times(capsys):
    assert floor.main(["--device", "cpu", "--blocks", "2", "--number", "2"]) == 0
    out = capsys.readouterr().out
    for op in OPS:
        row = re.search(rf"^  {op} +(\d+) args  public +([\d.]+)  custom +([\d.]+)  floor +([\d.]+)", out, re.M)
        assert row, f"no row for {op}:\n{out}"
        assert all(float(x) > 0 for x in row.groups()[1:])
    for label in ("0 args", "16 args", "aten.alias", "bool", "SymInt? None", "six scalars packed in one str"):
        # the per-argument rows are differences of two timings: noise can print one below zero
        assert re.search(rf"^  {re.escape(label)}.* -?\d+\.\d+", out, re.M), f"no row {label!r}:\n{out}"


def test_custom_op_call_writes_what_the_public_op_writes():
    """The script's custom-op arguments are the public call's, in schema order: same out, same pool."""
    calls = floor.op_calls(torch.device("cpu"), 2, 8)
    pub, custom, args = calls["kda_decode"]
    state, out = args[5], args[15]
    state0 = state.clone()
    pub()
    want_state, want_out = state.clone(), out.clone()
    state.copy_(state0)
    out.fill_(float("nan"))
    custom(*args)
    assert torch.equal(state, want_state) and torch.equal(out, want_out)
    assert not torch.equal(want_state, state0)  # the step did write the pool


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        floor.main(["--only", "ops,nope"])
    assert e.value.code == 2
    assert "--only: unknown section(s) ['nope']" in capsys.readouterr().err
