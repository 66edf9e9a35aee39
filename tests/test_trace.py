"""Trace emission (flashkda_ext.trace): schemas, templates, emitted definitions and workloads,
references that run standalone, the consumer, and tracing's promises (never raises, written before
the launch, taken back when the module refuses the call, no effect on results)."""
from __future__ import annotations

import json
import os
import warnings

import jsonschema
import pytest
import safetensors.torch
import torch

import flashkda_ext
from flashkda_ext import ops, reference, trace, trace_consumer, validation
from flashkda_ext.paths import trace_templates_dir
from trace_cases import (CASE, CHECK, IDS, VARIANTS, VERIFY_OPS, decode_case, fused_case, prefill_case,
                         verify_case)

SCHEMAS = ("definition", "workload", "template")


def definition_files(trace_dir):
    return sorted((trace_dir / "definitions").rglob("*.json"))


def read_workloads(trace_dir, d):
    path = trace_dir / trace.workloads_relpath(d)
    return [json.loads(s) for s in path.read_text().splitlines()]


def traced(op, args, tmp_path):
    """Validate like the op, emit; returns (definition, [workload lines])."""
    call = CHECK[op](**args)
    with trace.tracing(tmp_path):
        name = trace.emit(op, call, args)
    assert name is not None
    (path,) = definition_files(tmp_path)
    d = json.loads(path.read_text())
    assert d["name"] == name and path == tmp_path / trace.definition_relpath(d)
    return d, read_workloads(tmp_path, d)


def axis_values(d, var_axes):
    return {a: (ax["value"] if ax["type"] == "const" else var_axes[a]) for a, ax in d["axes"].items()}


def reference_inputs(d, args, line, trace_dir, seed=5):
    """The emitted run()'s arguments for this call, shaped as the definition says; destination
    buffers the call left to the op (final_state, checkpoints) are drawn at random."""
    axes = axis_values(d, line["workload"]["axes"])
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, spec in d["inputs"].items():
        src = line["workload"]["inputs"][name]
        if src["type"] == "scalar":
            out[name] = src["value"]
            continue
        shape = [axes[a] for a in spec["shape"]]
        x = args.get(name)
        if x is None:
            x = torch.randn(shape, generator=gen).to(getattr(torch, spec["dtype"]))
        out[name] = x.reshape(shape)
        if src["type"] == "safetensors":
            saved = safetensors.torch.load_file(os.path.join(trace_dir, src["path"]))[src["tensor_key"]]
            assert torch.equal(saved, x)
    return out


def package_reference(op, a, run_inputs):
    """flashkda_ext.reference in float32, outputs in the definition's order and dtypes."""
    opts = dict(gate=a["gate"], A_log=a.get("A_log"), dt_bias=a.get("dt_bias"),
                lower_bound=a.get("lower_bound"), null_slot0=a.get("null_slot0", False), dtype=torch.float32)
    if op == "kda_decode":
        out, pool = reference.kda_decode_step(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"],
                                              state_indices=a["state_indices"],
                                              beta_is_logit=a["beta_is_logit"], **opts)
        return [out, pool]
    if op == "fused_kda_decode":
        opts.pop("A_log"), opts.pop("dt_bias")
        opts.update(norm_eps=a.get("norm_eps", 1e-5))
        out, conv, pool = reference.fused_kda_decode_step(
            a["x"], a["conv_weight"], a["conv_state"], a["g"], a["beta"], a["A_log"], a["dt_bias"],
            a["state_indices"], a["state"], a["output_gate"], a["norm_weight"], **opts)
        return [out, conv, pool]
    if op in VERIFY_OPS:
        opts.update(state_indices=a["state_indices"], cu_seqlens=a["cu_seqlens"],
                    num_accepted_tokens=a.get("num_accepted_tokens"))
        if op == "kda_verify":
            return list(reference.kda_verify_step(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"],
                                                  beta_is_logit=a["beta_is_logit"], initial_state=a.get("initial_state"),
                                                  initial_state_indices=a.get("initial_state_indices"),
                                                  parent_tokens=a.get("parent_tokens"), **opts))
        opts.pop("A_log"), opts.pop("dt_bias")
        return list(reference.fused_kda_verify_step(
            a["x"], a["conv_weight"], a["conv_state"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["state"],
            a["output_gate"], a["norm_weight"], norm_eps=a.get("norm_eps", 1e-5), **opts))
    pool = a.get("state")
    out, final, ckpt = reference.kda_recurrent(
        a["q"], a["k"], a["v"], a["g"], a["beta"], cu_seqlens=a.get("cu_seqlens"),
        initial_state=pool if pool is not None else a.get("initial_state"),
        state_indices=a.get("state_indices"), output_final_state=a["output_final_state"],
        checkpoint_every=a["checkpoint_every"], **opts)
    res = [out]
    if a["output_final_state"]:
        res.append(final)
    if a["checkpoint_every"]:
        # entries a sequence does not reach keep the buffer's values
        buf = run_inputs["checkpoints"].float().clone()
        reached = (torch.diff(a["cu_seqlens"]) if a.get("cu_seqlens") is not None
                   else torch.full((buf.shape[0],), a["q"].shape[1])) // a["checkpoint_every"]
        for n, c in enumerate(reached.tolist()):
            buf[n, :c] = ckpt[n, :c]
        res.append(buf)
    return res


# ---------------------------------------------------------------------------------------------
# schemas and templates


@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_files_are_valid_json_schema(name):
    schema = json.loads((trace_templates_dir() / "schema" / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)


def test_definition_schema_dtypes_are_flashinfer_bench_names():
    schema = json.loads((trace_templates_dir() / "schema" / "definition.schema.json").read_text())
    assert tuple(schema["$defs"]["dtype"]["enum"]) == trace.FIB_DTYPES
    assert "float64" not in trace.FIB_DTYPES and "unknown" not in trace.FIB_DTYPES


@pytest.mark.parametrize("op", trace.OPS)
def test_template_validates_and_names_real_files(op):
    t = trace.load_template(op)            # validates against template.schema.json
    assert t["op"] == op and hasattr(flashkda_ext, op)
    for rel in t["reference"]["files"]:
        assert (trace_templates_dir() / rel).is_file()
    # every tensor axis is declared; no input/output name clash
    for e in t["inputs"] + t["outputs"]:
        assert all(a in t["axes"] for a in e["shape"] or [])
    assert not {e["name"] for e in t["inputs"]} & {e["name"] for e in t["outputs"]}
    # inputs follow the public op's argument order, so run(*inputs) reads like the op
    import inspect
    params = list(inspect.signature(getattr(flashkda_ext, op)).parameters)
    names = [e["name"] for e in t["inputs"] if e["name"] in params]
    assert names == sorted(names, key=params.index)


def test_template_schema_rejects_a_broken_template():
    t = json.loads(json.dumps(trace.load_template("kda_decode")))
    t["constraints"].append({"supported": "head_count"})          # unknown key, no subject
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(t, json.loads((trace_templates_dir() / "schema" / "template.schema.json").read_text()))


def test_definition_checks_reject_bad_definitions(tmp_path):
    d, lines = traced("kda_decode", decode_case(), tmp_path)
    trace.validate_definition(d)
    for mutate in (lambda x: x["inputs"]["q"].update(dtype="float64"),
                   lambda x: x["inputs"]["q"].update(dtype="unknown"),
                   lambda x: x["outputs"].update(state=x["outputs"].pop("state_out")),   # reuses an input name
                   lambda x: x["inputs"]["q"].update(shape=["rows", "heads_nowhere", "head_dim_k"]),
                   lambda x: x.update(reference="def not_run():\n    pass\n"),
                   lambda x: x["axes"]["num_heads"].update(value=0)):
        bad = json.loads(json.dumps(d))
        mutate(bad)
        with pytest.raises(ValueError):
            trace.validate_definition(bad)
    bad_line = json.loads(json.dumps(lines[0]))
    bad_line["workload"]["axes"].pop("rows")
    with pytest.raises(ValueError):
        trace.validate_workload_line(bad_line, d)
    bad_line = json.loads(json.dumps(lines[0]))
    bad_line["workload"]["inputs"]["scale"] = {"type": "random"}
    with pytest.raises(ValueError):
        trace.validate_workload_line(bad_line, d)


# ---------------------------------------------------------------------------------------------
# emission


@pytest.mark.parametrize("op,kw", VARIANTS, ids=IDS)
def test_emitted_definition_and_workload_validate(op, kw, tmp_path):
    args = CASE[op](**kw)
    d, lines = traced(op, args, tmp_path)
    trace.validate_definition(d)
    assert len(lines) == 1
    trace.validate_workload_line(lines[0], d)
    assert lines[0]["definition"] == d["name"]
    # the recorded call satisfies its own definition's constraints, none of which is constant
    assert trace_consumer.check_call(d, lines[0]["workload"]["axes"]) == []
    var = {a for a, ax in d["axes"].items() if ax["type"] == "var"}
    for c in d["constraints"]:
        assert trace.definitions._names(c) & var, c
    # every var axis is bound by an input (flashinfer-bench binds axes from inputs only), to the
    # value the workload recorded
    inputs = reference_inputs(d, args, lines[0], tmp_path)
    bound = {}
    for n, spec in d["inputs"].items():
        for a, size in zip(spec["shape"] or [], getattr(inputs[n], "shape", ())):
            if a in var:
                assert bound.setdefault(a, size) == size, (n, a)
    assert bound == lines[0]["workload"]["axes"]
    # every axis is used by some tensor
    used = {a for spec in {**d["inputs"], **d["outputs"]}.values() for a in spec["shape"] or []}
    assert used == set(d["axes"])
    # index inputs are stored, never random
    for n in trace.index_inputs(op, d):
        assert lines[0]["workload"]["inputs"][n]["type"] == "safetensors", n
    # each tag once (a template with one output entry per variant of state_out tagged it twice)
    assert len(d["tags"]) == len(set(d["tags"])), d["tags"]
    # const axes are in the name; in-place outputs are marked
    for axis in ("num_heads", "head_dim_k", "head_dim"):
        if axis in d["axes"]:
            assert str(d["axes"][axis]["value"]) in d["name"]
    for out, spec in d["outputs"].items():
        if out.endswith("_out"):
            src = out[: -len("_out")]
            assert src in d["inputs"] and f"inplace:{out}={src}" in d["tags"]
            assert "in-place" in spec["description"]


@pytest.mark.parametrize("op,kw", VARIANTS, ids=IDS)
def test_emitted_reference_runs_standalone_and_matches_package_reference(op, kw, tmp_path):
    args = CASE[op](**kw)
    d, lines = traced(op, args, tmp_path)
    import ast
    imported = {a.name.split(".")[0] for n in ast.walk(ast.parse(d["reference"]))
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in getattr(n, "names", [])}
    imported |= {n.module.split(".")[0] for n in ast.walk(ast.parse(d["reference"]))
                 if isinstance(n, ast.ImportFrom) and n.module}
    assert imported == {"torch"}                        # self-contained: torch only
    namespace = {}
    exec(compile(d["reference"], "<emitted reference>", "exec"), namespace)  # fresh namespace
    run_inputs = reference_inputs(d, args, lines[0], tmp_path)
    before = {n: x.clone() for n, x in run_inputs.items() if torch.is_tensor(x)}
    got = namespace["run"](**run_inputs)
    got = list(got) if isinstance(got, tuple) else [got]
    for n, x in before.items():                          # run() leaves its inputs alone
        assert torch.equal(run_inputs[n], x), n
    want = package_reference(op, args, run_inputs)
    assert len(got) == len(want) == len(d["outputs"])
    axes = axis_values(d, lines[0]["workload"]["axes"])
    for (name, spec), x, y in zip(d["outputs"].items(), got, want):
        assert list(x.shape) == [axes[a] for a in spec["shape"]], name
        assert str(x.dtype) == f"torch.{spec['dtype']}", name
        tol = 2e-2 if x.dtype in (torch.bfloat16, torch.float16) else 1e-5
        torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol, msg=name)
        assert torch.isfinite(x.float()).all(), name


@pytest.mark.parametrize("kw", [dict(initial=True, accepted=False), dict(step_rows=True),
                                dict(step_rows=True, initial=True, accepted=False)], ids=["init", "rows", "rows_init"])
def test_verify_start_pool_and_step_rows_are_in_the_description(kw, tmp_path, monkeypatch):
    """kda_verify's initial_state / initial_state_indices and step rows are traced (no warning), described
    as they are (shapes, axes, the stored start indices), and they matter: the op agrees with the emitted
    reference, which, with the start pool left out, computes something else."""
    monkeypatch.setattr(trace.emission, "_warned", set())
    args = verify_case(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d, lines = traced("kda_verify", args, tmp_path)
    ins, wl = d["inputs"], lines[0]["workload"]
    pool = ["num_v_heads", "head_dim_v", "head_dim_k"]
    if kw.get("initial"):
        assert ins["initial_state"]["shape"] == ["num_initial_slots"] + pool
        assert ins["initial_state_indices"]["shape"] == ["num_seqs"] and "num_accepted_tokens" not in ins
        assert wl["axes"]["num_initial_slots"] == 5 and wl["inputs"]["initial_state_indices"]["type"] == "safetensors"
        assert "_init" in d["name"] and "noaccepted" not in d["name"]
    if kw.get("step_rows"):
        assert ins["state"]["shape"] == d["outputs"]["state_out"]["shape"] == ["num_rows", "max_draft"] + pool
        assert ins["state_indices"]["shape"] == ["num_seqs"] and "num_slots" not in d["axes"]
        assert wl["axes"]["num_rows"] == 5 and wl["axes"]["max_draft"] == 3
        assert "_rows" in d["name"] and "state_layout:rows" in d["tags"]
        assert "domain:state_indices=slot_index(num_rows)" in d["tags"]
    namespace = {}
    exec(compile(d["reference"], "<emitted reference>", "exec"), namespace)
    run_inputs = reference_inputs(d, args, lines[0], tmp_path)
    want_out, want_state = namespace["run"](**run_inputs)
    op_args = verify_case(**kw)
    got_out = flashkda_ext.kda_verify(**op_args)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(op_args["state"], want_state, rtol=1e-5, atol=1e-5)
    if kw.get("initial"):
        dropped = dict(run_inputs, initial_state=None, initial_state_indices=None)
        assert not torch.allclose(namespace["run"](**dropped)[0], got_out, atol=1e-3)


def test_definition_written_once_per_name_workloads_appended(tmp_path):
    args = decode_case()
    call = CHECK["kda_decode"](**args)
    with trace.tracing(tmp_path):
        n1 = trace.emit("kda_decode", call, args)
        (path,) = definition_files(tmp_path)
        os.remove(path)                                # not rewritten: deduplicated per process
        n2 = trace.emit("kda_decode", call, args)
        other = decode_case(rows=3)                    # same definition, another workload
        n3 = trace.emit("kda_decode", CHECK["kda_decode"](**other), other)
    assert n1 == n2 == n3
    assert not path.exists()
    lines = [json.loads(s) for s in (tmp_path / "workloads" / "kda" / f"{n1}.jsonl").read_text().splitlines()]
    assert [ln["workload"]["axes"]["rows"] for ln in lines] == [5, 5, 3]
    assert len({ln["workload"]["uuid"] for ln in lines}) == 3


def test_names_identify_definitions(tmp_path):
    """One name, one definition; different definitions, different names."""
    seen = {}
    for op, kw in VARIANTS + [("kda_decode", {"gate": "bounded"}), ("kda_decode", {"HV": 2}),
                              ("kda_prefill", {"mode": "pool"}), ("kda_prefill", {"final": False}),
                              ("kda_prefill", {"mode": "none", "final": False}),
                              ("fused_kda_decode", {"dtype": torch.float16, "conv_dtype": torch.float32}),
                              ("kda_verify", {"accepted": False}), ("kda_verify", {"gate": "log"}),
                              ("fused_kda_verify", {"accepted": False}), ("fused_kda_verify", {"gate": "log"})]:
        args = CASE[op](**kw)
        d = trace.build_definition(op, trace.facts(op, CHECK[op](**args), args))
        body = json.dumps({k: v for k, v in d.items() if k != "name"}, sort_keys=True)
        assert seen.setdefault(d["name"], body) == body, d["name"]
    bodies = list(seen.values())
    assert len(set(bodies)) == len(bodies)
    assert "kda_decode_h2_hv4_dk8_dv6_f32state_f32in_cpu" in seen


def test_definition_cache_is_keyed_on_everything_the_template_reads():
    for op, kw in VARIANTS:
        args = CASE[op](**kw)
        f = trace.facts(op, CHECK[op](**args), args)
        assert trace.build_definition(op, f) == trace.definitions._build_definition(op, f)
        # var-axis facts and workload scalars do not change the definition ...
        g = dict(f, rows=99, slots=98, seqlen=97, scale=0.5, lower_bound=-1.5)
        assert trace.build_definition(op, g) is trace.build_definition(op, f)
        # ... every other fact the template reads does
        for key in trace.definitions._definition_keys(op):
            assert key in f, (op, key)
        h = dict(f, gate="log" if f["gate"] != "log" else "bounded", has_A_log=True, has_dt_bias=True)
        assert trace.build_definition(op, h)["name"] != trace.build_definition(op, f)["name"]


def test_example_name_shape():
    # the example name: a CUDA call, H = HV = 32, K = V = 128, fp32 state, defaults
    q = torch.empty(4, 32, 128, dtype=torch.bfloat16, device="meta")
    args = dict(q=q, k=q, v=q, g=q, beta=torch.empty(4, 32, dtype=torch.bfloat16, device="meta"),
                state=torch.empty(9, 32, 128, 128, device="meta"),
                state_indices=torch.empty(4, dtype=torch.int32, device="meta"),
                A_log=torch.empty(32, device="meta"), dt_bias=torch.empty(32 * 128, device="meta"))
    call = validation.check_kda_decode(**args, backend="cuda")
    d = trace.build_definition("kda_decode", trace.facts("kda_decode", call, args))
    assert d["name"] == "kda_decode_h32_d128_f32state"
    assert d["constraints"] == []       # the supported set is checked when emitting, not restated
    # a head count outside the supported set has no definition
    args7 = dict(args, q=torch.empty(4, 7, 128, dtype=torch.bfloat16, device="meta"))
    args7.update(k=args7["q"], v=args7["q"], g=args7["q"], beta=torch.empty(4, 7, dtype=torch.bfloat16, device="meta"),
                 state=torch.empty(9, 7, 128, 128, device="meta"), A_log=torch.empty(7, device="meta"),
                 dt_bias=torch.empty(7 * 128, device="meta"))
    f7 = trace.args_facts("kda_decode", args7, "cuda")
    assert [key for key, _ in trace.unsupported("kda_decode", f7)] == ["value_heads"]
    with pytest.raises(trace.UnsupportedCall, match="value heads 7 is not supported by the cuda backend"):
        trace.build_definition("kda_decode", f7)


# ---------------------------------------------------------------------------------------------
# tracing's promises


def test_enabled_follows_env_and_context(tmp_path, monkeypatch):
    monkeypatch.delenv(trace.ENV_DIR, raising=False)
    trace.refresh()
    assert not trace.enabled()
    with trace.tracing(tmp_path / "a") as d:
        assert trace.enabled() and d == str(tmp_path / "a")
        with trace.tracing(tmp_path / "b"):
            assert trace.directory() == str(tmp_path / "b")
        assert trace.directory() == str(tmp_path / "a")
    assert not trace.enabled()
    monkeypatch.setenv(trace.ENV_DIR, str(tmp_path / "env"))
    trace.refresh()
    try:
        assert trace.directory() == str(tmp_path / "env")
    finally:
        monkeypatch.delenv(trace.ENV_DIR)
        trace.refresh()
    assert not trace.enabled()


def test_tracing_refuses_an_empty_directory_before_the_block(tmp_path, monkeypatch):
    """tracing('') would write definitions/, workloads/ and blob/ into the current directory."""
    monkeypatch.chdir(tmp_path)
    for bad in ("", b"", None, 3):
        with pytest.raises((ValueError, TypeError), match=r"^dir: "):
            trace.tracing(bad)                         # refused at the call, before any `with`
    assert not trace.enabled() and list(tmp_path.iterdir()) == []


def test_emit_is_a_noop_when_disabled(tmp_path):
    assert not trace.enabled()
    args = decode_case()
    assert trace.emit("kda_decode", CHECK["kda_decode"](**args), args) is None
    assert list(tmp_path.iterdir()) == []


def test_failure_warns_once_and_never_raises(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")                             # makedirs under a file fails
    monkeypatch.setattr(trace.emission, "_warned", set())
    args = decode_case()
    call = CHECK["kda_decode"](**args)
    with trace.tracing(blocker / "sub"):
        with pytest.warns(RuntimeWarning, match="tracing failed"):
            assert trace.emit("kda_decode", call, args) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")             # a second failure stays silent
            assert trace.emit("kda_decode", call, args) is None
            assert trace.emit("kda_decode", object(), {}) is None   # garbage in: still no raise


def test_float64_calls_are_skipped_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(trace.emission, "_warned", set())
    args = decode_case(dtype=torch.float64)
    call = CHECK["kda_decode"](**args)
    with trace.tracing(tmp_path):
        with pytest.warns(RuntimeWarning, match="float64"):
            assert trace.emit("kda_decode", call, args) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert trace.emit("kda_decode", call, args) is None
    assert not tmp_path.exists() or definition_files(tmp_path) == []


class _Boom(RuntimeError):
    pass


def _crash(*_a, **_k):
    raise _Boom("launch crashed")


@pytest.fixture
def fresh_memos():
    """Validation verdicts (and the route function kept on them) are memoized per process: a test
    that patches the launch path starts and ends with empty memos, so it neither sees nor leaks one."""
    checks = (ops.validation.check_kda_decode, ops.validation.check_kda_prefill,
              ops.validation.check_fused_kda_decode, ops.validation.check_kda_verify,
              ops.validation.check_fused_kda_verify)
    for check in checks:
        check.cache_clear()
    ops.clear_call_caches()
    yield
    for check in checks:
        check.cache_clear()
    ops.clear_call_caches()


def snapshot(trace_dir):
    """Every file under trace_dir with its bytes, and every folder."""
    if not trace_dir.exists():
        return {}, []
    files = {str(p.relative_to(trace_dir)): p.read_bytes() for p in trace_dir.rglob("*") if p.is_file()}
    return files, sorted(str(p.relative_to(trace_dir)) for p in trace_dir.rglob("*") if p.is_dir())


class _Refused(ValueError):
    pass


@pytest.mark.parametrize("error", [_Refused, _Boom], ids=["refused", "launch-error"])
@pytest.mark.parametrize("op", trace.OPS)
def test_the_trace_is_on_disk_at_the_launch_and_a_refusing_launch_takes_it_back(op, error, tmp_path, monkeypatch,
                                                                                fresh_memos):
    """The trace is written before the launch (a launch that crashes the process leaves it): the launch
    finds it on disk. A launch that refuses the call (ValueError / TypeError, as the modules' argument checks
    raise) has it removed again; any other error (a launch failure the runtime reports) keeps it."""
    trace_dir = tmp_path / "trace"                     # made by the emit: gone again after the retract
    at_launch = []

    def launch(*_a, **_k):
        at_launch.append(snapshot(trace_dir)[0])
        raise error("launch failed")

    monkeypatch.setattr(ops.dispatch, "function", lambda *a, **k: launch)
    monkeypatch.setattr(ops.dispatch, "select_rule", lambda *a, **k: {"module": "crash"})

    class _Module:
        def implements_function(self, name):
            return False

        def __getitem__(self, name):
            return launch

    monkeypatch.setattr(ops.jit, "load_module", lambda *a, **k: _Module())
    monkeypatch.setattr(ops.jit, "get_record", lambda *a, **k: {"params": {}})
    args = CASE[op]()
    with trace.tracing(trace_dir):
        with pytest.raises(error):
            getattr(flashkda_ext, op)(**args)
    (files,) = at_launch
    (def_rel,) = [p for p in files if p.startswith("definitions")]
    d = json.loads(files[def_rel])
    (wl_rel,) = [p for p in files if p.startswith("workloads")]
    (line,) = [json.loads(s) for s in files[wl_rel].decode().splitlines()]
    trace.validate_definition(d)
    trace.validate_workload_line(line, d)
    assert any(p.startswith("blob") for p in files)    # every op saves index tensors
    if error is _Refused:
        assert not trace_dir.exists()
    else:
        assert snapshot(trace_dir)[0] == files


def _out_of_range(op):
    """A call of op the CPU module refuses by an index value (validation passes it: emitted, then raised)."""
    if op == "kda_prefill":
        a = prefill_case(mode="pool")
    else:
        a = CASE[op](slot_mode="padded")
    a["state_indices"][-1] = 99
    return a


REFUSED_OPS = ("kda_decode", "kda_prefill", "fused_kda_decode")


@pytest.mark.parametrize("op", REFUSED_OPS)
def test_a_call_the_module_refuses_leaves_no_trace(op, tmp_path):
    fn = getattr(flashkda_ext, op)
    with pytest.raises(Exception) as plain:
        fn(**_out_of_range(op))
    assert "out of range" in str(plain.value)
    trace_dir = tmp_path / "trace"
    with trace.tracing(trace_dir):
        with pytest.raises(type(plain.value)) as traced_error:   # the same error as without tracing
            fn(**_out_of_range(op))
        assert str(traced_error.value) == str(plain.value)
        assert not trace_dir.exists()                  # no line, blob, definition, or folder
        good = _out_of_range(op)
        good["state_indices"][-1] = -1
        fn(**good)                                     # the definition is written again with its first line
    (path,) = definition_files(trace_dir)
    assert len(read_workloads(trace_dir, json.loads(path.read_text()))) == 1


@pytest.mark.parametrize("op", REFUSED_OPS)
def test_a_refused_call_keeps_what_earlier_calls_wrote(op, tmp_path):
    """After a good call, a refused call of the same definition removes its own line only: the good
    call's line, blob and definition stay byte for byte, and so does a blob the refused call shares
    (content-addressed: the good call on a larger pool used the same indices)."""
    fn = getattr(flashkda_ext, op)
    bad = _out_of_range(op)
    pools = [k for k in ("state", "conv_state") if k in bad]
    big = dict(bad, **{k: torch.cat([bad[k]] * 20) for k in pools})  # 99 is in range: a good call
    with trace.tracing(tmp_path):
        fn(**big)
        before = snapshot(tmp_path)
        with pytest.raises(ValueError, match="out of range"):
            fn(**_out_of_range(op))
        assert snapshot(tmp_path) == before
        bad["state_indices"][0] = -1                   # a blob of its own, removed again
        with pytest.raises(ValueError, match="out of range"):
            fn(**bad)
        assert snapshot(tmp_path) == before
    files = before[0]
    assert sum(p.startswith("blob") for p in files) == 1 and sum(p.startswith("definitions") for p in files) == 1
    (path,) = definition_files(tmp_path)
    assert len(read_workloads(tmp_path, json.loads(path.read_text()))) == 1


def test_retract_undoes_only_the_last_emit_of_the_call_and_never_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(trace.emission, "_warned", set())
    args = decode_case()
    call = CHECK["kda_decode"](**args)
    with trace.tracing(tmp_path):
        name = trace.emit("kda_decode", call, args)
        before = snapshot(tmp_path)
        # an emit that writes nothing drops the earlier call's record: nothing is retracted
        f64 = decode_case(dtype=torch.float64)
        with pytest.warns(RuntimeWarning, match="float64"):
            assert trace.emit("kda_decode", CHECK["kda_decode"](**f64), f64) is None
        trace.retract()
        assert snapshot(tmp_path) == before
        # a line another writer appended after ours: ours is kept (one warning), nothing is corrupted
        assert trace.emit("kda_decode", call, args) == name
        wl = tmp_path / trace.workloads_relpath(json.loads(definition_files(tmp_path)[0].read_text()))
        with open(wl, "a") as fh:
            fh.write('{"other": 1}\n')
        kept = snapshot(tmp_path)
        with pytest.warns(RuntimeWarning, match="is kept"):
            trace.retract()
        assert snapshot(tmp_path) == kept
        trace.retract()                                # the record went with the first retract
        assert snapshot(tmp_path) == kept
        # a failure to undo warns once and never raises
        trace.emit("kda_decode", call, args)
        wl.unlink()
        with pytest.warns(RuntimeWarning, match="could not be removed"):
            trace.retract()


def _has_routes(op):
    try:
        ops.jit.routes_for(op)
        return True
    except KeyError:
        return False


@pytest.mark.parametrize("op,kw", VARIANTS, ids=IDS)
def test_public_ops_traced_on_cpu_identical_results(op, kw, tmp_path):
    if not _has_routes(op):
        pytest.skip(f"no jit/routes/{op}.json in this tree yet")
    fn = getattr(flashkda_ext, op)
    plain_args, traced_args = CASE[op](**kw), CASE[op](**kw)
    plain = fn(**plain_args)
    with trace.tracing(tmp_path):
        got = fn(**traced_args)
    plain = plain if isinstance(plain, tuple) else (plain,)
    got = got if isinstance(got, tuple) else (got,)
    for x, y in zip(plain, got):               # bitwise, NaN (checkpoint slots the op leaves) included
        assert (x is None and y is None) or torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
        assert x is None or torch.equal(x.isnan(), y.isnan())
    for name in ("state", "conv_state", "initial_state"):   # in-place caches agree too
        if plain_args.get(name) is not None:
            assert torch.equal(plain_args[name], traced_args[name])
    (def_file,) = definition_files(tmp_path)
    d = json.loads(def_file.read_text())
    trace.validate_definition(d)
    lines = read_workloads(tmp_path, d)
    for line in lines:
        trace.validate_workload_line(line, d)
    # the definition's reference, run on the call's inputs, is what the backend computed
    namespace = {}
    exec(compile(d["reference"], "<emitted reference>", "exec"), namespace)
    # the op's own destination buffers (what the call wrote into) as the reference's inputs
    replay = dict(CASE[op](**kw))
    if op == "kda_prefill":
        replay.update(final_state=got[1] if "final_state" in d["inputs"] else None,
                      checkpoints=got[2] if "checkpoints" in d["inputs"] else None)
    ref = namespace["run"](**reference_inputs(d, replay, lines[0], tmp_path))
    ref = ref if isinstance(ref, tuple) else (ref,)
    if op == "kda_prefill":                    # the op returns (out, state[, checkpoints])
        backend_out = [got[0]] + [got[1]] * bool({"final_state_out", "state_out"} & set(d["outputs"])) \
            + list(got[2:])
    else:
        backend_out = [got[0]] + [traced_args[o[: -len("_out")]] for o in d["outputs"] if o.endswith("_out")]
    assert len(backend_out) == len(ref)
    for x, y in zip(backend_out, ref):
        tol = 2e-2 if y.dtype in (torch.bfloat16, torch.float16) else 1e-5
        torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# the consumer


def test_index_tensors_for_new_axes_are_valid_calls():
    """index_tensors draws indices the op accepts, per the definition's domain: and slot_mode tags."""
    for op, kw in VARIANTS:
        args = CASE[op](**kw)
        f = trace.facts(op, CHECK[op](**args), args)
        d = trace.build_definition(op, f)
        wl = trace.build_workload(op, f, d, args)
        idx = trace_consumer.index_tensors(d, wl["workload"]["axes"], seed=3,
                                           checkpoint_every=args.get("checkpoint_every", 0))
        assert set(idx) == set(trace.index_inputs(op, d))
        call = CHECK[op](**dict(args, **idx))
        if op in VERIFY_OPS:                    # verify index values are checked apart from the metadata
            validation.check_verify_values(call, idx["cu_seqlens"], idx["state_indices"],
                                           idx.get("num_accepted_tokens"),
                                           initial_state_indices=idx.get("initial_state_indices"),
                                           parent_tokens=idx.get("parent_tokens"))


def test_consumer_flags_violations_and_refuses_code(tmp_path):
    d, lines = traced("kda_prefill", prefill_case(), tmp_path)
    axes = dict(lines[0]["workload"]["axes"])
    assert trace_consumer.check_call(d, axes) == []
    assert trace_consumer.check_call(d, dict(axes, batch=2)) == ["batch == 1"]
    assert "num_seqs_p1 == num_seqs + 1" in trace_consumer.check_call(d, dict(axes, num_seqs_p1=9))
    with pytest.raises(ValueError):
        trace_consumer.check_call(d, {k: v for k, v in axes.items() if k != "batch"})
    for evil in ("__import__('os').system('true')", "().__class__", "[x for x in (1,)]",
                 "open('f')", "rows ** 10 ** 10", "'x' * 1000000000", "(1,) * 1000000000",
                 "rows.__class__", "{'a': 1}['a']"):
        with pytest.raises(ValueError):
            trace_consumer.safe_eval(evil, {"rows": 1})
    assert trace_consumer.safe_eval("rows in (1, 2) and not x", {"rows": 2, "x": False}) is True


@pytest.mark.parametrize("bomb", ["('x' or 1) * 1000000000", "('x' if 1 else 0) * 1000000000",
                                  "((1, 2) and (3, 4)) * 1000000000", "1000000000 * (rows and 'x')",
                                  "(s or 1) * 1000000000", "((1,) if rows else 0) + (2,)", "('a' or 0) % rows"])
def test_safe_eval_checks_the_evaluated_operands_of_arithmetic(bomb):
    """The guard sees the values arithmetic gets, whatever expression produced them (not only literals)."""
    with pytest.raises(ValueError, match="arithmetic on strings or sequences is not allowed"):
        trace_consumer.safe_eval(bomb, {"rows": 1, "s": "x"})
    assert trace_consumer.safe_eval("(rows or 1) * 3 + (2 if rows else 0)", {"rows": 4}) == 14


@pytest.mark.parametrize("constraint,words", [("1 / 0", "ZeroDivisionError"), ("rows % 0 == 0", "ZeroDivisionError"),
                                              ("'a' < 1", "TypeError"), ("-'a'", "TypeError"), ("1 +", "not a valid")])
def test_check_call_names_a_constraint_that_cannot_be_evaluated(constraint, words):
    d = {"name": "defn", "axes": {"rows": {"type": "var"}}, "constraints": ["rows > 0", constraint]}
    with pytest.raises(ValueError) as e:
        trace_consumer.check_call(d, {"rows": 2})
    assert str(e.value).startswith(f"defn: constraint {constraint!r}") and words in str(e.value), str(e.value)


@pytest.mark.parametrize("value", [2.7, True, "12", float("nan"), None])
def test_check_call_takes_only_int_var_axis_values(value):
    d = {"name": "defn", "axes": {"rows": {"type": "var"}, "H": {"type": "const", "value": 2}},
         "constraints": ["rows > 0"]}
    with pytest.raises(ValueError, match=r"^defn: var axis 'rows': expected an int, got "):
        trace_consumer.check_call(d, {"rows": value})
    assert trace_consumer.check_call(d, {"rows": 3}) == [] and trace_consumer.check_call(d, {"rows": 0}) == ["rows > 0"]


def test_fused_calls_without_the_gate_parameters_a_gate_reads_are_not_traced(tmp_path, monkeypatch):
    """fused_kda_decode takes A_log and dt_bias positionally: its definitions carry both for the
    gates that read them, so a bounded call leaving them out has no definition."""
    monkeypatch.setattr(trace.emission, "_warned", set())
    args = dict(fused_case(gate="bounded"), A_log=None, dt_bias=None)
    call = CHECK["fused_kda_decode"](**args)
    f = trace.facts("fused_kda_decode", call, args)
    assert [key for key, _ in trace.unsupported("fused_kda_decode", f)] == ["A_log"]
    with trace.tracing(tmp_path):
        with pytest.warns(RuntimeWarning, match="fused definitions carry both"):
            assert trace.emit("fused_kda_decode", call, args) is None
    def definition(a):
        return trace.build_definition("fused_kda_decode", trace.facts("fused_kda_decode", CHECK["fused_kda_decode"](**a), a))

    # the op's positional order; the log gate, where the op requires None in their places, has neither
    assert list(definition(fused_case(gate="bounded"))["inputs"])[:8] == [
        "x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state_indices"]
    assert not {"A_log", "dt_bias"} & set(definition(fused_case(gate="log"))["inputs"])


def test_index_tensors_that_cannot_be_read_are_not_traced(tmp_path, monkeypatch):
    """Meta index tensors hold no values (nor can CUDA ones be copied during graph capture): a
    workload without them could not be evaluated, so the call is not traced, with one warning."""
    monkeypatch.setattr(trace.emission, "_warned", set())
    q = torch.empty(2, 2, 8, device="meta")
    args = dict(q=q, k=q, v=q, g=q, beta=torch.empty(2, 2, device="meta"), state=torch.empty(3, 2, 8, 8, device="meta"),
                state_indices=torch.empty(2, dtype=torch.int32, device="meta"), A_log=torch.empty(2, device="meta"),
                dt_bias=torch.empty(16, device="meta"))
    call = validation.check_kda_decode(**args, backend="cpu")
    with trace.tracing(tmp_path):
        with pytest.warns(RuntimeWarning, match="index tensors cannot be read"):
            assert trace.emit("kda_decode", call, args) is None
    assert not tmp_path.exists() or definition_files(tmp_path) == []


def test_host_index_tensors_are_saved_once_per_content(tmp_path):
    args = decode_case(slot_mode="padded")
    call = CHECK["kda_decode"](**args)
    with trace.tracing(tmp_path):
        for _ in range(3):
            name = trace.emit("kda_decode", call, args)
        other = dict(args, state_indices=torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32))
        trace.emit("kda_decode", CHECK["kda_decode"](**other), other)
    (path,) = definition_files(tmp_path)
    lines = read_workloads(tmp_path, json.loads(path.read_text()))
    paths = [ln["workload"]["inputs"]["state_indices"]["path"] for ln in lines]
    assert len(set(paths[:3])) == 1 and paths[3] != paths[0]
    blobs = tmp_path / "blob" / "workloads" / "kda" / name
    assert sorted(p.name for p in blobs.iterdir()) == sorted({os.path.basename(p) for p in paths})
    got = safetensors.torch.load_file(str(tmp_path / paths[3]))["state_indices"]
    assert torch.equal(got, other["state_indices"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_index_tensors_saved_and_calls_during_capture_not_traced(tmp_path, monkeypatch):
    monkeypatch.setattr(trace.emission, "_warned", set())
    dev = "cuda"
    args = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in decode_case(slot_mode="padded").items()}
    call = validation.check_kda_decode(**args, backend="cpu")   # emission only: no kernel needed
    with trace.tracing(tmp_path):
        name = trace.emit("kda_decode", call, args)
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), pytest.warns(RuntimeWarning, match="graph"):
            with torch.cuda.graph(graph, stream=stream):
                assert trace.emit("kda_decode", call, args) is None
                args["out"] = args["q"].new_zeros(1)         # something to capture
    (path,) = definition_files(tmp_path)
    lines = read_workloads(tmp_path, json.loads(path.read_text()))
    assert len(lines) == 1 and lines[0]["definition"] == name
    assert lines[0]["workload"]["inputs"]["state_indices"]["type"] == "safetensors"


def test_the_consumer_runs_as_a_module_without_a_second_copy():
    """`python -m flashkda_ext.trace_consumer` (docs/trace-format.md): importing the package does not load
    trace_consumer, so runpy runs it once (it warned of a second copy when the trace package imported it)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import sys, flashkda_ext; print('flashkda_ext.trace_consumer' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert r.stdout.strip() == "False"
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "flashkda_ext.trace_consumer", "--help"],
                       capture_output=True, text=True, cwd=root)
    assert r.returncode == 0 and "usage:" in r.stdout and "RuntimeWarning" not in r.stderr, r.stderr
