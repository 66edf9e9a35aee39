"""Bad-input campaign 31 (CPU only): the trace consumer's Solution glue (call_op), the emitted references
(trace_templates/reference/*.py, a Definition's `reference`), check_call / make_workload and the consumer's CLI, driven
with the bug class found in every serving adapter: tensors read by element count (a transposed, heads-first or flat
layout served on scrambled values), beside wrong dtypes, devices, index values, scalar types, missing / extra names
and aliasing. The rule: bad input gets a clear error naming the argument (the file, the axis) before anything is
written; a served call equals the op called directly on the declared layout, bitwise. Each case failed before its
fix, except those marked "guard".

- call_op read prefill's checkpoint_every with int(): 2.7 was served as 2, '2' as 2, True as 1 (the op refuses all
  three). Now passed as given: the op's TypeError naming checkpoint_every, nothing written.
- call_op took any names: a missing input was read as None (an optional argument left out: initial_state,
  num_accepted_tokens) or a bare KeyError ('scale'), an extra one was handed to the op. Now a ValueError naming the
  missing / unexpected inputs, before the op runs.
- reference, the gate: dt_bias was reshaped to [HV, K] by element count, so a [K, HV] dt_bias (contiguous or a .t()
  view) was served scrambled; an A_log [1, HV] / [2, 2] was served. Now A_log [HV], dt_bias [HV, K] or flat [HV*K]
  (the op's layouts), else a ValueError naming it.
- reference, the data: q / k / v / g / beta were read by broadcasting (a decode beta [HV, 1] at rows = 1 was one beta
  for every head) or failed unnamed (einsum / reshape errors); an int / bool q, beta, A_log was read as numbers. Now
  each checked against q / v (k as q, g [.., HV, K], beta [.., HV]) and refused naming it.
- reference, index tensors: decode's state_indices shorter than rows left the last rows zero (served), a longer one
  or a 2-D one failed unnamed; float cu_seqlens (prefill, verify), num_accepted_tokens, initial_state_indices and
  step-row state_indices were truncated by int() and served; a bool state_indices failed unnamed; prefill's
  state_indices of another length than the sequences failed unnamed, a short num_accepted_tokens too. Now an integer
  tensor of the declared shape, or a TypeError / ValueError naming it.
- reference, scalars: scale / lower_bound / norm_eps went through float(): '0.3' and True were served; prefill's
  checkpoint_every 2.7 was used as a float modulus (served, different checkpoints), '2' failed unnamed. Now refused
  naming them.
- CLI (`python -m flashkda_ext.trace_consumer DIR`): a malformed definition or workload file was a pydantic
  traceback naming no file; a folder that does not exist was created (TraceSet.from_path) and reported as a clean,
  empty run (exit 0); a workload without one of its var axes was a traceback from check_call. Now exit 2 with
  'DIR: cannot be loaded ...: FILE[:LINE]: error' / 'DIR: not a directory', nothing created, and a workload that
  cannot be checked is listed as violating (exit 1).
- guard: call_op refuses every same-element-count layout, wrong dtype, meta tensor, out-of-range index, bad scale
  and an input overlapping the pool as the op does, naming it, the pool unchanged; a flat dt_bias is served bitwise
  as [HV, K]; check_call / index_tensors / make_workload refuse bad var axes (missing, bool, float, negative,
  violating a constraint) naming the axis, make_workload before any blob is written.
Not fixed (noted): the references are dtype-generic (an fp16 q where float32 is declared is computed in fp32; the
op refuses it; flashinfer-bench checks the dtype of every input it loads or draws), take a meta tensor with torch's
own error, and take scale / lower_bound values the op refuses (nan, scale <= 0).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

import flashkda_ext as fk
from flashkda_ext import trace, trace_consumer as tc, validation

from bad_input_cases import FUSED_POS, decode_args, fused_args, i32, rand, verify_args

H, HV, K, V, SLOTS = 2, 4, 8, 16, 6
LEAD = ("q", "k", "v", "g", "beta")


def definition(op, args, lead=LEAD):
    b = dict(args)
    call = getattr(validation, f"check_{op}")(*[b.pop(n) for n in lead], **b)
    return trace.build_definition(op, trace.facts(op, call, args))


def reference(d, kw):
    ns = {}
    exec(compile(d["reference"], "<emitted reference>", "exec"), ns)
    return ns["run"](**kw)


def clone(kw):
    return {n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}


def same(a, b):
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


@pytest.fixture(scope="module")
def dec():
    a = decode_args()
    d = definition("kda_decode", a)
    kw = {n: a.get(n) for n in d["inputs"]}
    kw.update(scale=0.3, dt_bias=a["dt_bias"].reshape(HV, K))
    return d, tc.op_spec(d), kw


def prefill_args():
    T = 8
    return dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, HV, V), g=rand(1, T, HV, K), beta=rand(1, T, HV),
                A_log=rand(HV), dt_bias=rand(HV * K), cu_seqlens=torch.tensor([0, 3, 8]), state=rand(SLOTS, HV, V, K),
                state_indices=i32(1, 4), checkpoint_every=2, checkpoints=torch.zeros(2, 4, HV, V, K), scale=0.3)


@pytest.fixture(scope="module")
def pre():
    a = prefill_args()
    d = definition("kda_prefill", a)
    kw = {n: a.get(n) for n in d["inputs"]}
    kw["dt_bias"] = a["dt_bias"].reshape(HV, K)
    return d, tc.op_spec(d), kw


# ---------------------------------------------------------------------------------------------
# call_op


def test_call_op_serves_the_declared_layout_bitwise_as_the_op(dec, pre):   # guard
    for d, spec, kw, op in ((*dec, fk.kda_decode), (*pre, fk.kda_prefill)):
        direct = clone(kw)
        direct["dt_bias"] = direct["dt_bias"].flatten()       # the op's other layout: same values
        want = op(*[direct.pop(n) for n in LEAD], **direct)
        want = want if isinstance(want, tuple) else (want, direct["state"])
        got = tc.call_op(spec, clone(kw))
        got = got if isinstance(got, tuple) else (got,)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), d["name"]


@pytest.mark.parametrize("every, exc", [(2.7, TypeError), ("2", TypeError), (True, TypeError), (2.0, TypeError),
                                        (-2, ValueError)])          # -2: guard (int() kept it)
def test_call_op_refuses_a_checkpoint_every_int_would_truncate(pre, every, exc):
    _, spec, kw = pre
    kw = clone(kw)
    kw["checkpoint_every"] = every
    state, ckpt = kw["state"].clone(), kw["checkpoints"].clone()
    with pytest.raises(exc, match="checkpoint_every"):
        tc.call_op(spec, kw)
    assert torch.equal(kw["state"], state) and torch.equal(kw["checkpoints"], ckpt)


@pytest.mark.parametrize("change", ["missing_scale", "missing_A_log", "missing_q", "missing_state_indices",
                                    "extra_lower_bound", "extra_initial_state", "extra_typo"])
def test_call_op_refuses_missing_or_extra_inputs_naming_them(dec, change):
    _, spec, kw = dec
    kw = clone(kw)
    how, name = change.split("_", 1)
    word = {"missing": "missing", "extra": "unexpected"}[how]
    if how == "missing":
        del kw[name]
    else:
        name = {"lower_bound": "lower_bound", "initial_state": "initial_state", "typo": "stat"}[name]
        kw[name] = -5.0 if name == "lower_bound" else rand(SLOTS, HV, V, K)
    state = kw.get("state", torch.zeros(0)).clone()
    with pytest.raises(ValueError, match=rf"{word} \[[^]]*'{name}'"):
        tc.call_op(spec, kw)
    if "state" in kw:
        assert torch.equal(kw["state"], state)


def test_call_op_refuses_missing_num_accepted_tokens_rather_than_serve_without_it():
    a = dict(verify_args(), num_accepted_tokens=i32(2, 1))
    d = definition("kda_verify", a)
    spec = tc.op_spec(d)
    kw = {n: a.get(n) for n in d["inputs"]}
    kw.update(scale=0.3)
    del kw["num_accepted_tokens"]
    state = kw["state"].clone()
    with pytest.raises(ValueError, match="missing \\['num_accepted_tokens'\\]"):
        tc.call_op(spec, kw)
    assert torch.equal(kw["state"], state)


def _bad(kw):
    """Same-element-count layouts, dtypes, devices, index values, scalars, overlaps: name -> (changes, argument)."""
    st = kw["state"]
    return {
        "dt_bias_K_HV": (dict(dt_bias=kw["dt_bias"].t().contiguous()), "dt_bias"),
        "dt_bias_t_view": (dict(dt_bias=kw["dt_bias"].t()), "dt_bias"),
        "A_log_1_HV": (dict(A_log=kw["A_log"][None]), "A_log"),
        "A_log_2_2": (dict(A_log=kw["A_log"].reshape(2, 2)), "A_log"),
        "beta_HV_R": (dict(beta=kw["beta"].t().contiguous()), "beta"),
        "g_R_K_HV": (dict(g=kw["g"].transpose(1, 2).contiguous()), "g"),
        "g_flat": (dict(g=kw["g"].reshape(3, -1)), "g"),
        "v_R_V_HV": (dict(v=kw["v"].transpose(1, 2).contiguous()), "v|g"),
        "k_H_R_K": (dict(k=kw["k"].transpose(0, 1).contiguous()), "k"),
        "state_K_V": (dict(state=st.transpose(2, 3).contiguous()), "state"),
        "state_indices_R_1": (dict(state_indices=kw["state_indices"][:, None]), "state_indices"),
        "state_indices_short": (dict(state_indices=kw["state_indices"][:2]), "state_indices"),
        "state_indices_float": (dict(state_indices=kw["state_indices"].float()), "state_indices"),
        "state_indices_bool": (dict(state_indices=kw["state_indices"].bool()), "state_indices"),
        "state_indices_past_pool": (dict(state_indices=i32(SLOTS, 0, 2)), "state_indices"),
        "q_int": (dict(q=kw["q"].int()), "q"),
        "q_bool": (dict(q=kw["q"].bool()), "q"),
        "beta_int": (dict(beta=kw["beta"].int()), "beta"),
        "A_log_int": (dict(A_log=kw["A_log"].int()), "A_log"),
        "scale_str": (dict(scale="0.3"), "scale"),
        "scale_bool": (dict(scale=True), "scale"),
        "scale_tensor": (dict(scale=torch.tensor(0.3)), "scale"),
    }


OP_ONLY = {  # refused by the op (call_op), not by the dtype-generic reference: see the docstring's "not fixed"
    "q_fp16": (lambda kw: dict(q=kw["q"].half()), "k|q"), "g_fp16": (lambda kw: dict(g=kw["g"].half()), "g"),
    "A_log_bf16": (lambda kw: dict(A_log=kw["A_log"].bfloat16()), "A_log"),
    "state_meta": (lambda kw: dict(state=kw["state"].to("meta")), "state"),
    "q_meta": (lambda kw: dict(q=kw["q"].to("meta")), "k|q"),
    "state_indices_meta": (lambda kw: dict(state_indices=kw["state_indices"].to("meta")), "state_indices"),
    "scale_nan": (lambda kw: dict(scale=float("nan")), "scale"), "scale_negative": (lambda kw: dict(scale=-1.0), "scale"),
    "v_in_the_pool": (lambda kw: dict(v=kw["state"].view(-1)[:3 * HV * V].view(3, HV, V)), "state|v|out"),
}


@pytest.mark.parametrize("case", sorted(_bad(decode_args() | dict(dt_bias=torch.zeros(HV, K), scale=0.3)))
                         + sorted(OP_ONLY))
def test_call_op_refuses_as_the_op_naming_the_argument_pool_unchanged(dec, case):   # guard
    _, spec, kw = dec
    kw = clone(kw)
    change, name = (OP_ONLY[case][0](kw), OP_ONLY[case][1]) if case in OP_ONLY else _bad(kw)[case]
    kw.update(change)
    state = kw["state"].clone() if kw["state"].device.type != "meta" else None
    with pytest.raises((ValueError, TypeError), match=rf"^(\S+: argument ')?({name})\b"):
        tc.call_op(spec, kw)
    if state is not None:
        assert torch.equal(kw["state"], state)


# ---------------------------------------------------------------------------------------------
# the emitted references


@pytest.mark.parametrize("case", sorted(_bad(decode_args() | dict(dt_bias=torch.zeros(HV, K), scale=0.3))))
def test_decode_reference_refuses_naming_the_argument(dec, case):
    d, _, kw = dec
    kw = clone(kw)
    change, name = _bad(kw)[case]
    kw.update(change)
    # guards: state_indices_past_pool (already named), state_K_V ([S, HV, K, V]: the einsum's error, V != K)
    if case == "state_K_V":
        with pytest.raises(RuntimeError):
            reference(d, kw)
        return
    with pytest.raises((ValueError, TypeError), match=rf"^({name})\b"):
        reference(d, kw)


def test_decode_reference_beta_heads_first_at_one_row_is_refused():
    a = decode_args()
    a.update({n: a[n][:1] for n in LEAD}, state_indices=i32(2))
    d = definition("kda_decode", a)
    kw = {n: a.get(n) for n in d["inputs"]}
    kw.update(scale=0.3, dt_bias=a["dt_bias"].reshape(HV, K))
    want = reference(d, clone(kw))
    assert torch.allclose(want[0], tc.call_op(tc.op_spec(d), clone(kw))[0], atol=1e-5)    # guard: the reference
    with pytest.raises(ValueError, match="^beta"):   # was broadcast: beta[0, 0] for every head
        reference(d, dict(clone(kw), beta=kw["beta"].reshape(HV, 1)))


def test_reference_serves_dt_bias_flat_bitwise_as_declared(dec):   # guard
    d, _, kw = dec
    want = reference(d, clone(kw))
    assert same(reference(d, dict(clone(kw), dt_bias=kw["dt_bias"].flatten())), want)
    assert same(reference(d, dict(clone(kw), dt_bias=kw["dt_bias"].t().contiguous().t())), want)  # strides honoured


@pytest.mark.parametrize("case, name", [("scale_str", "scale"), ("scale_bool", "scale"), ("every_float", "checkpoint_every"),
                                        ("every_str", "checkpoint_every"), ("every_bool", "checkpoint_every"),
                                        ("every_negative", "checkpoint_every"), ("cu_float", "cu_seqlens"),
                                        ("cu_2d", "cu_seqlens"), ("state_indices_short", "state_indices"),
                                        ("state_indices_float", "state_indices"), ("dt_bias_K_HV", "dt_bias")])
def test_prefill_reference_refuses_naming_the_argument(pre, case, name):
    d, _, kw = pre
    kw = clone(kw)
    kw.update({"scale_str": dict(scale="0.3"), "scale_bool": dict(scale=True), "every_float": dict(checkpoint_every=2.7),
               "every_str": dict(checkpoint_every="2"), "every_bool": dict(checkpoint_every=True),
               "every_negative": dict(checkpoint_every=-2),
               "cu_float": dict(cu_seqlens=torch.tensor([0.0, 3.5, 8.0])), "cu_2d": dict(cu_seqlens=kw["cu_seqlens"][None]),
               "state_indices_short": dict(state_indices=kw["state_indices"][:1]),
               "state_indices_float": dict(state_indices=kw["state_indices"].float()),
               "dt_bias_K_HV": dict(dt_bias=kw["dt_bias"].t().contiguous())}[case])
    with pytest.raises((ValueError, TypeError), match=rf"^{name}\b"):
        reference(d, kw)


def verify_case(layout):
    a = verify_args()
    if layout == "accepted":
        a["num_accepted_tokens"] = i32(2, 1)
    elif layout == "init":
        a.update(initial_state=rand(SLOTS, HV, V, K), initial_state_indices=i32(3, 0))
    elif layout == "rows":
        a.update(state=rand(4, 3, HV, V, K), state_indices=i32(2, 0))
    d = definition("kda_verify", a)
    kw = {n: a.get(n) for n in d["inputs"]}
    kw.update(scale=0.3, dt_bias=a["dt_bias"].reshape(HV, K))
    return d, kw


@pytest.mark.parametrize("layout, name, bad", [
    ("table", "cu_seqlens", lambda x: x.float() + torch.tensor([0, 0.5, 0])),
    ("table", "cu_seqlens", lambda x: x.bool()),           # guard: offsets [1, 1, 1] were already named
    ("table", "state_indices", lambda x: x.float()),
    ("accepted", "num_accepted_tokens", lambda x: x.float() + 0.5),
    ("accepted", "num_accepted_tokens", lambda x: x[:1]),
    ("accepted", "num_accepted_tokens", lambda x: x[:, None]),
    ("init", "initial_state_indices", lambda x: x.float() + 0.5),
    ("init", "initial_state_indices", lambda x: x[:1]),
    ("rows", "state_indices", lambda x: x.float() + 0.5),
    ("rows", "state_indices", lambda x: x[:, None]),
])
def test_verify_reference_refuses_index_tensors_it_would_truncate_or_cut(layout, name, bad):
    d, kw = verify_case(layout)
    reference(d, clone(kw))                                  # guard: the good call is served
    with pytest.raises((ValueError, TypeError), match=rf"^{name}\b"):
        reference(d, dict(clone(kw), **{name: bad(kw[name])}))


@pytest.mark.parametrize("layout", ["table", "accepted", "init", "rows"])
def test_verify_reference_agrees_with_call_op(layout):   # guard (the references' new checks take every layout)
    d, kw = verify_case(layout)
    want = reference(d, clone(kw))
    got = tc.call_op(tc.op_spec(d), clone(kw))
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(got, want))


@pytest.mark.parametrize("case", ["norm_eps_str", "norm_eps_bool", "scale_str", "state_indices_short",
                                  "state_indices_float", "dt_bias_K_H", "beta_flat"])
def test_fused_decode_reference_refuses_naming_the_argument(case):
    a = fused_args()
    d = definition("fused_kda_decode", a, lead=FUSED_POS)
    kw = {n: a.get(n) for n in d["inputs"]}
    kw.update(scale=0.3, norm_eps=1e-5, dt_bias=a["dt_bias"].reshape(3, 8))
    want = reference(d, clone(kw))
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(tc.call_op(tc.op_spec(d), clone(kw)), want))  # guard
    name = case.rsplit("_", 1)[0] if case.startswith(("norm_eps", "scale")) else case.split("_short")[0].split(
        "_float")[0]
    name = {"dt_bias_K": "dt_bias", "beta_fl": "beta"}.get(case[:-2], name)
    change = {"norm_eps_str": dict(norm_eps="1e-5"), "norm_eps_bool": dict(norm_eps=True), "scale_str": dict(scale="0.3"),
              "state_indices_short": dict(state_indices=kw["state_indices"][:2]),
              "state_indices_float": dict(state_indices=kw["state_indices"].float()),
              "dt_bias_K_H": dict(dt_bias=kw["dt_bias"].t().contiguous()),
              "beta_flat": dict(beta=kw["beta"].flatten())}[case]    # each row's [1] was broadcast over H
    with pytest.raises((ValueError, TypeError), match=rf"^{name}\b"):
        reference(d, dict(clone(kw), **change))


def test_bounded_reference_refuses_a_lower_bound_that_is_no_number():
    a = dict(decode_args(), gate="bounded", lower_bound=-5.0)
    d = definition("kda_decode", a)
    kw = {n: a.get(n) for n in d["inputs"]}
    kw.update(scale=0.3, dt_bias=a["dt_bias"].reshape(HV, K))
    assert "lower_bound" in kw
    reference(d, clone(kw))                                                           # guard
    for bad in ("-5", True):
        with pytest.raises(TypeError, match="^lower_bound"):
            reference(d, dict(clone(kw), lower_bound=bad))


# ---------------------------------------------------------------------------------------------
# check_call / make_workload


@pytest.fixture()
def traced(tmp_path):
    a = dict(prefill_args())
    b = dict(a)
    with trace.tracing(str(tmp_path)):
        fk.kda_prefill(*[b.pop(n) for n in LEAD], **b)
    return tmp_path


@pytest.mark.parametrize("axes, match", [
    (dict(num_seqs_p1=3, batch=1, seq_len=8, num_slots=6, num_checkpoints=4), r"no value for var axis 'num_seqs'"),
    (dict(num_seqs=True), r"var axis 'num_seqs': expected an int"),
    (dict(num_seqs=2.0), r"var axis 'num_seqs': expected an int"),
    (dict(seq_len=-1), r"var axis 'seq_len': expected an int >= 0"),
    (dict(num_seqs_p1=5), r"num_seqs_p1 == num_seqs \+ 1"),
])
def test_bad_var_axes_are_named_and_make_workload_writes_nothing(traced, axes, match):   # guard
    from flashinfer_bench.data import TraceSet
    ts = TraceSet.from_path(str(traced))
    (name, d), = ts.definitions.items()
    good = dict(ts.workloads[name][0].workload.axes)
    axes = axes if "num_seqs_p1" in axes and len(axes) > 1 else dict(good, **axes)
    blobs = sorted(glob.glob(str(traced / "blob" / "**" / "*"), recursive=True))
    with pytest.raises(ValueError, match=match):
        if "num_seqs_p1 ==" in match:
            assert tc.check_call(d, axes)      # a list of violated constraints...
            raise ValueError(" ".join(tc.check_call(d, axes)))
        tc.check_call(d, axes)
    with pytest.raises(ValueError, match=r"num_seqs|seq_len"):
        tc.make_workload(ts, name, dict(axes, scale=0.3, checkpoint_every=2))
    assert sorted(glob.glob(str(traced / "blob" / "**" / "*"), recursive=True)) == blobs


# ---------------------------------------------------------------------------------------------
# the CLI


def cli(path, capsys):
    rc = tc.main([str(path)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_cli_names_a_malformed_definition_file(traced, capsys):
    (f,) = glob.glob(str(traced / "definitions" / "**" / "*.json"), recursive=True)
    open(f, "w").write('{"name": \n')
    rc, text = cli(traced, capsys)
    assert rc == 2 and f in text and "Invalid JSON" in text


def test_cli_names_a_definition_of_the_wrong_schema(traced, capsys):
    (f,) = glob.glob(str(traced / "definitions" / "**" / "*.json"), recursive=True)
    d = json.load(open(f))
    d["axes"]["seq_len"]["type"] = "varr"
    json.dump(d, open(f, "w"))
    rc, text = cli(traced, capsys)
    assert rc == 2 and f in text and "axes.seq_len" in text


def test_cli_names_a_malformed_workload_line(traced, capsys):
    (f,) = glob.glob(str(traced / "workloads" / "**" / "*.jsonl"), recursive=True)
    with open(f, "a") as fh:
        fh.write('{"definition": "x",\n')
    rc, text = cli(traced, capsys)
    assert rc == 2 and f"{f}:2" in text


def test_cli_lists_a_workload_without_its_var_axis(traced, capsys):
    (f,) = glob.glob(str(traced / "workloads" / "**" / "*.jsonl"), recursive=True)
    line = json.loads(open(f).read())
    del line["workload"]["axes"]["num_seqs"]
    open(f, "w").write(json.dumps(line) + "\n")
    rc, text = cli(traced, capsys)
    assert rc == 1 and "no value for var axis 'num_seqs'" in text and line["workload"]["uuid"] in text


def test_cli_refuses_a_folder_that_does_not_exist_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "no_such_trace"
    rc, text = cli(missing, capsys)
    assert rc == 2 and str(missing) in text and "not a directory" in text
    assert not missing.exists()


def test_cli_subprocess_has_no_traceback(traced):
    (f,) = glob.glob(str(traced / "definitions" / "**" / "*.json"), recursive=True)
    open(f, "w").write("not json")
    r = subprocess.run([sys.executable, "-m", "flashkda_ext.trace_consumer", str(traced)], capture_output=True,
                       text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 2 and "Traceback" not in r.stderr and f in r.stderr, r.stderr


def test_cli_still_passes_a_good_folder(traced, capsys):   # guard
    rc, text = cli(traced, capsys)
    assert rc == 0 and "1 workload(s)" in text and "0 violating" in text
