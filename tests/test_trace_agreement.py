"""The agreement sweep: trace constraints, Python validation and the module contracts accept exactly
the same calls.

For every public op and backend, configurations around every supported value (head counts v-1, v,
v+1 of every listed count, group sizes, head dims, dtypes, gates, slot modes, state modes) are built
as meta tensors (no memory) and judged three ways:

* validation.check_<op>(..., backend=b) accepts or raises ValueError;
* tracing (facts from the arguments alone, so rejected calls are judged too) refuses the call
  (trace.unsupported: outside the supported set, which definitions do not restate), or emits a
  definition whose constraints (over var axes) all hold, or not;
* the module records of that family and backend (their FKDA_* macros, as the JIT renders them and
  as the CPU modules' fkda_contract() reports them) accept the dims and state dtype, or not.

Both directions are asserted: accepted by validation <=> not refused and every constraint holds; and where the
rejection is about dims or state dtype, the binding contract agrees.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from flashkda_ext import jit, supported, trace, trace_consumer, validation

META = "meta"
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DTYPE_OUTSIDE = (torch.int32,)          # never supported: rejection must come from the constraints too


def _t(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device=META)


def _listed_heads():
    vals = set()
    for fam in supported.FAMILIES:
        for be in supported.BACKENDS:
            s = supported.supported(fam, be)
            if s and s["value_heads"]:
                vals |= set(s["value_heads"])
    return sorted(vals)


HEADS = sorted({h for v in _listed_heads() for h in (v - 1, v, v + 1) if h >= 1} | {7, 9, 11, 13})
DIMS = [(128, 128), (64, 64), (127, 127), (129, 129), (256, 256), (128, 64), (64, 128)]
GATES = ("softplus", "bounded", "log")
SLOT_MODES = ("unique", "padded", "repeated")


def _gate(gate, HV, K):
    a = {"gate": gate}
    if gate != "log":
        a["A_log"], a["dt_bias"] = _t(HV), _t(HV * K)
    if gate == "bounded":
        a["lower_bound"] = -5.0
    return a


def decode_args(HV=32, group=1, K=128, V=128, dtype=torch.bfloat16, state_dtype=torch.float32,
                gate="softplus", slot_mode="unique", **_):
    H = max(HV // group, 1)
    return dict(q=_t(3, H, K, dtype=dtype), k=_t(3, H, K, dtype=dtype), v=_t(3, HV, V, dtype=dtype),
                g=_t(3, HV, K, dtype=dtype), beta=_t(3, HV, dtype=dtype), state=_t(5, HV, V, K, dtype=state_dtype),
                state_indices=_t(3, dtype=torch.int32), slot_mode=slot_mode, **_gate(gate, HV, K))


def prefill_args(HV=32, group=1, K=128, V=128, dtype=torch.bfloat16, state_dtype=torch.float32,
                 gate="softplus", state_mode="dense", varlen=True, ckpt=False, **_):
    H = max(HV // group, 1)
    B, T, N = (1, 8, 3) if varlen else (2, 4, 2)
    a = dict(q=_t(B, T, H, K, dtype=dtype), k=_t(B, T, H, K, dtype=dtype), v=_t(B, T, HV, V, dtype=dtype),
             g=_t(B, T, HV, K, dtype=dtype), beta=_t(B, T, HV, dtype=dtype), **_gate(gate, HV, K))
    if varlen:
        a["cu_seqlens"] = _t(N + 1, dtype=torch.int32)
    if state_mode == "pool":
        a["state"], a["state_indices"] = _t(6, HV, V, K, dtype=state_dtype), _t(N, dtype=torch.int32)
    elif state_mode == "dense":
        a["initial_state"] = _t(N, HV, V, K, dtype=state_dtype)
    else:
        a["output_final_state"] = False
    if ckpt:
        a["checkpoint_every"] = 2
        a["checkpoints"] = _t(N, 4, HV, V, K, dtype=state_dtype)
    return a


def fused_args(HV=32, K=128, dtype=torch.bfloat16, state_dtype=torch.float32, gate="softplus",
               slot_mode="unique", **_):
    H, D = HV, K
    C = 3 * H * D
    ga = _gate(gate, H, D)
    return dict(x=_t(2, C, dtype=dtype), conv_weight=_t(C, 4, dtype=dtype), conv_state=_t(4, C, 3, dtype=dtype),
                g=_t(2, H, D, dtype=dtype), beta=_t(2, H, dtype=dtype), A_log=ga.pop("A_log", None),
                dt_bias=ga.pop("dt_bias", None), state_indices=_t(2, dtype=torch.int32),
                state=_t(4, H, D, D, dtype=state_dtype), output_gate=_t(2, H, D, dtype=dtype),
                norm_weight=_t(D), slot_mode=slot_mode, **ga)


def _verify_indices(cols=2):
    # 3 requests, T_max = cols (2: T = 5 tokens fit; any value would do: meta tensors hold none)
    return dict(state_indices=_t(3, cols, dtype=torch.int32), cu_seqlens=_t(4, dtype=torch.int32),
                num_accepted_tokens=_t(3, dtype=torch.int32))


def verify_args(HV=32, group=1, K=128, V=128, dtype=torch.bfloat16, state_dtype=torch.float32,
                gate="softplus", layout="table", draft=(2, 5), tree=False, **_):
    """layout: table (pool + [N, T_max] slots), rows (step rows [R, T_max, ...] + [N] rows), init / rows_init
    (the same with the read-only start pool); draft: (T_max, T); tree: with parent_tokens [N, T_max]."""
    H = max(HV // group, 1)
    cols, T = draft
    a = dict(q=_t(1, T, H, K, dtype=dtype), k=_t(1, T, H, K, dtype=dtype), v=_t(1, T, HV, V, dtype=dtype),
             g=_t(1, T, HV, K, dtype=dtype), beta=_t(1, T, HV, dtype=dtype),
             state=_t(6, HV, V, K, dtype=state_dtype), **_verify_indices(cols), **_gate(gate, HV, K))
    if layout.startswith("rows"):
        a.update(state=_t(4, cols, HV, V, K, dtype=state_dtype), state_indices=_t(3, dtype=torch.int32))
    if layout.endswith("init"):
        a.update(initial_state=_t(5, HV, V, K, dtype=state_dtype), initial_state_indices=_t(3, dtype=torch.int32),
                 num_accepted_tokens=None)
    if tree:
        a["parent_tokens"] = _t(3, cols, dtype=torch.int32)
    return a


def fused_verify_args(HV=32, K=128, dtype=torch.bfloat16, state_dtype=torch.float32, gate="softplus", **_):
    H, D = HV, K
    C = 3 * H * D
    ga = _gate(gate, H, D)
    return dict(x=_t(1, 5, C, dtype=dtype), conv_weight=_t(C, 4, dtype=dtype), conv_state=_t(6, C, 4, dtype=dtype),
                g=_t(1, 5, H, D, dtype=dtype), beta=_t(1, 5, H, dtype=dtype), A_log=ga.pop("A_log", None),
                dt_bias=ga.pop("dt_bias", None), state=_t(6, H, D, D, dtype=state_dtype),
                output_gate=_t(1, 5, H, D, dtype=dtype), norm_weight=_t(D), **_verify_indices(), **ga)


ARGS = {"kda_decode": decode_args, "kda_prefill": prefill_args, "fused_kda_decode": fused_args,
        "kda_verify": verify_args, "fused_kda_verify": fused_verify_args}
CHECK = {"kda_decode": validation.check_kda_decode, "kda_prefill": validation.check_kda_prefill,
         "fused_kda_decode": validation.check_fused_kda_decode, "kda_verify": validation.check_kda_verify,
         "fused_kda_verify": validation.check_fused_kda_verify}


def configs(op):
    """Each dimension swept alone around a base config, plus a seeded sample of combinations."""
    axes = {
        "HV": HEADS,
        "group": [1, 2, 3, 4],
        "dims": DIMS,
        "dtype": FLOATS + DTYPE_OUTSIDE,
        "state_dtype": FLOATS,
        "gate": GATES,
    }
    if op == "kda_prefill":
        axes.update(state_mode=["none", "dense", "pool"], varlen=[True, False], ckpt=[False, True])
    elif op in ("kda_decode", "fused_kda_decode"):      # verify: no slot mode argument
        axes["slot_mode"] = list(SLOT_MODES)
    if op == "kda_verify":          # T_max = 1 with T < N: refused with a slot table only (it is decode's)
        axes.update(layout=["table", "rows", "init", "rows_init"], draft=[(2, 5), (1, 3), (1, 2), (2, 7)],
                    tree=[False, True])
    if op.startswith("fused_"):
        axes.pop("group")
        axes["dims"] = [(k, v) for k, v in DIMS if k == v]
    out = [{}]
    for key, values in axes.items():
        out += [{key: v} for v in values]
    rng = random.Random(4)
    keys = list(axes)
    for _ in range(150):
        out.append({k: rng.choice(axes[k]) for k in keys if rng.random() < 0.6})
    # heads x groups in full: the combination the binding's two lists judge together
    if "group" in axes:
        out += [{"HV": h, "group": g} for h, g in itertools.product(HEADS, axes["group"])]
    if "layout" in axes:            # verify layouts x draft shapes (x trees) in full: the T_max = 1 rule reads both
        out += [{"layout": x, "draft": y, "tree": z}
                for x, y, z in itertools.product(axes["layout"], axes["draft"], axes["tree"])]
    result = []
    for c in out:
        c = dict(c)
        if "dims" in c:
            c["K"], c["V"] = c.pop("dims")
        result.append(c)
    return result


def _judge(op, backend, cfg):
    args = ARGS[op](**cfg)
    try:
        call = CHECK[op](**args, backend=backend)
        accepted, reason = True, None
    except ValueError as e:
        call, accepted, reason = None, False, str(e)
    f = trace.args_facts(op, args, backend)
    # a call outside the supported set has no definition; one inside it has a definition whose
    # constraints (over var axes) the call may still violate
    violated = [msg for _, msg in trace.unsupported(op, f)]
    d = None
    if not violated:
        d = trace.build_definition(op, f)
        wl = trace.build_workload(op, f, d, args)
        violated = trace_consumer.check_call(d, wl["workload"]["axes"])
    return args, call, accepted, reason, d, violated


def _axis_values(op, f):
    """Every axis of the call's would-be definition (const values and var binds), refused or not."""
    t = trace.load_template(op)
    axes = trace.definitions._axes(t, f)
    return {a: (ax["value"] if ax["type"] == "const" else trace_consumer.safe_eval(t["axes"][a]["bind"], f))
            for a, ax in axes.items()}


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("op", trace.OPS)
def test_constraints_agree_with_validation_both_ways(op, backend):
    n_acc = n_rej = 0
    for cfg in configs(op):
        args, call, accepted, reason, d, violated = _judge(op, backend, cfg)
        if accepted:
            n_acc += 1
            assert violated == [], f"{op}/{backend} {cfg}: validation accepts, constraints reject {violated}"
            # the facts read from the arguments are the facts of the validated call
            f_call = trace.facts(op, call, args)
            assert trace.definitions._build_definition(op, f_call) == d, f"{op}/{backend} {cfg}: facts from args differ"
            f_args = trace.args_facts(op, args, backend)
            assert trace.build_workload(op, f_call, d, args)["workload"]["axes"] == \
                trace.build_workload(op, f_args, d, args)["workload"]["axes"], f"{op}/{backend} {cfg}"
        else:
            n_rej += 1
            assert violated, f"{op}/{backend} {cfg}: validation rejects ({reason}), constraints accept"
    assert n_acc >= 10 and n_rej >= 10, (n_acc, n_rej)   # the sweep really covers both sides


# ---------------------------------------------------------------------------------------------
# module contracts (the binding's ICHECKs read these macros)


def _contract_accepts(c, H, HV, K, V, state_dtype):
    if c["FKDA_HEAD_DIM_K"] not in (0, K) or c["FKDA_HEAD_DIM_V"] not in (0, V):
        return False
    if H <= 0 or HV % H != 0:
        return False
    if c["FKDA_NUM_SUPPORTED_VALUE_HEADS"] and HV not in c["FKDA_SUPPORTED_VALUE_HEADS"]:
        return False
    if c["FKDA_NUM_SUPPORTED_GROUP_SIZES"] and HV // H not in c["FKDA_SUPPORTED_GROUP_SIZES"]:
        return False
    want = {0: "float32", 1: "bfloat16"}.get(c["FKDA_STATE_BF16"])
    # A prefill with no state tensor at all is routed to the fp32-state modules (ops.kda_prefill).
    return want is None or want == (state_dtype or "float32")


def _records(op, backend):
    return [r for r in jit.all_records() if r["family"] == op and r["backend"] == backend]


def _dims_and_state(op, f):
    if op.startswith("fused_"):
        return f["num_heads"], f["num_heads"], f["head_dim"], f["head_dim"], f["state_dtype"]
    return f["num_heads"], f["value_heads"], f["head_dim_k"], f["head_dim_v"], f["state_dtype"]


DIM_KEYS = {None, "head_dims_k", "head_dims_v", "value_heads", "group_sizes"}   # None: shape relations


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("op", trace.OPS)
def test_constraints_agree_with_module_contracts(op, backend):
    records = _records(op, backend)
    if not records:
        pytest.skip(f"no {backend} module records of {op} in jit/modules yet")
    contracts = [jit.macros.contract_values(r) for r in records]
    checked = 0
    for cfg in configs(op):
        args, call, accepted, reason, d, violated = _judge(op, backend, cfg)
        f = trace.args_facts(op, args, backend)
        H, HV, K, V, sdt = _dims_and_state(op, f)
        binding_ok = any(_contract_accepts(c, H, HV, K, V, sdt) for c in contracts)
        values = _axis_values(op, f)
        var = {a for a, ax in trace.definitions._axes(trace.load_template(op), f).items() if ax["type"] == "var"}
        # a violated relation over var axes (token counts, T_max) is no key: "var" (no macro carries it)
        keys = {"var" if key is None and trace.definitions._names(expr) & var else key
                for expr, key in trace.render_constraints(trace.load_template(op), f, sources=True)
                if not trace_consumer.safe_eval(expr, values)}
        # the macros carry dims, head counts, group sizes and (unless -1 = any) the state dtype
        state_in_macros = all(c["FKDA_STATE_BF16"] in (0, 1) for c in contracts)
        judged = DIM_KEYS | ({"state_dtypes"} if state_in_macros else set())
        if keys - judged:      # rejected for a reason no macro carries (input dtype, gate, slot mode)
            continue
        checked += 1
        if not keys:
            assert binding_ok, f"{op}/{backend} {cfg}: constraints accept, no module's contract does"
        else:
            assert not binding_ok, f"{op}/{backend} {cfg}: constraints reject {violated}, a module accepts"
    assert checked >= 10


def test_cpu_module_contracts_match_rendered_macros():
    """What the built CPU modules report (fkda_contract) is what the sweep above assumed."""
    import json
    records = [r for op in trace.OPS for r in _records(op, "cpu")]
    if not records:
        pytest.skip("no CPU module records yet")
    try:
        modules = [(r, jit.load_module(r["name"])) for r in records]
    except Exception as e:  # noqa: BLE001 - a missing toolchain is reported, not failed, here
        pytest.skip(f"CPU modules cannot be built here: {type(e).__name__}: {e}")
    for r, m in modules:
        reported = json.loads(str(m["fkda_contract"]()))
        rendered = jit.macros.contract_values(r)
        for key in ("FKDA_HEAD_DIM_K", "FKDA_HEAD_DIM_V", "FKDA_SUPPORTED_VALUE_HEADS",
                    "FKDA_SUPPORTED_GROUP_SIZES", "FKDA_STATE_BF16"):
            assert reported[key] == rendered[key], (r["name"], key)
