"""flashkda_ext.jax on a CUDA GPU: the JAX front end calls the CUDA modules the torch ops call, and
gets the same results on the same inputs (decode, prefill, fused decode), eagerly and under jax.jit,
with pools written in place (donated, same device address), and under XLA command buffers (CUDA
graphs) where the wrapper allows capture.

Needs a CUDA build of jax (e.g. `pip install "jax[cuda12]"`) and jax-tvm-ffi; skipped otherwise.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Let torch and XLA share the GPU: no up-front 75 % reservation by XLA.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("jax_tvm_ffi")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
try:
    GPU = jax.devices("gpu")[0]
except RuntimeError:
    pytest.skip("jax has no CUDA backend (install jax[cuda12])", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

import flashkda_ext as fk  # noqa: E402
import flashkda_ext.jax as kj  # noqa: E402
from flashkda_ext import dispatch, jit  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K = V = 128
pytestmark = pytest.mark.gpu


@pytest.fixture
def gen():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def has_cuda_module(family: str, meta: dict) -> bool:
    try:
        jit.get_record(dispatch.module_name(family, meta))
        return True
    except Exception:
        return False


def to_jax(t: torch.Tensor):
    """A jax copy on the GPU of a CUDA torch tensor."""
    torch.cuda.synchronize()
    return jnp.array(jax.dlpack.from_dlpack(t.detach().contiguous().clone()), copy=True)


def to_torch(a) -> torch.Tensor:
    a.block_until_ready()
    return torch.from_dlpack(a).clone()


def rnd(gen, *shape, dtype=torch.bfloat16, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).cuda()


DECODE_META = {"device": "cuda", "rows": 8, "value_heads": 8, "work_items": 64, "state": "f32",
               "offset": "o32", "slot_mode": "unique", "gate": "softplus"}


def decode_case(gen, rows, HV, H, slots, state_dtype, indices=None):
    d = dict(q=rnd(gen, rows, H, K), k=rnd(gen, rows, H, K), v=rnd(gen, rows, HV, V), g=rnd(gen, rows, HV, K),
             beta=rnd(gen, rows, HV), A_log=rnd(gen, HV, dtype=torch.float32, scale=0.5),
             dt_bias=rnd(gen, HV * K, dtype=torch.float32, scale=0.5),
             state=rnd(gen, slots, HV, V, K, dtype=state_dtype, scale=0.1))
    idx = torch.randperm(slots, generator=gen)[:rows] if indices is None else torch.tensor(indices)
    d["state_indices"] = idx.to(torch.int32).cuda()
    return d


@pytest.mark.skipif(not has_cuda_module("kda_decode", DECODE_META), reason="no CUDA decode module")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, HV, H, slot_mode, indices", [
    (1, 8, 8, "unique", None),
    (8, 16, 4, "unique", None),
    (64, 32, 32, "unique", None),          # a larger band: another route
    (6, 8, 8, "repeated", [3, -1, 3, 0, 5, 3]),
])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_decode_equals_torch(gen, state_dtype, rows, HV, H, slot_mode, indices, mode):
    d = decode_case(gen, rows, HV, H, 8 if indices else max(2 * rows, 4), state_dtype, indices)
    t_state = d["state"].clone()
    t_out = fk.kda_decode(d["q"], d["k"], d["v"], d["g"], d["beta"], state=t_state, state_indices=d["state_indices"],
                          A_log=d["A_log"], dt_bias=d["dt_bias"], slot_mode=slot_mode)
    j = {n: to_jax(x) for n, x in d.items()}
    addr = j["state"].unsafe_buffer_pointer()

    def f(state, a):
        return kj.kda_decode(a["q"], a["k"], a["v"], a["g"], a["beta"], state=state, state_indices=a["state_indices"],
                             A_log=a["A_log"], dt_bias=a["dt_bias"], slot_mode=slot_mode)
    rest = {n: x for n, x in j.items() if n != "state"}
    out, state = f(j["state"], rest) if mode == "eager" else jax.jit(f, donate_argnums=0)(j["state"], rest)
    assert j["state"].is_deleted() and state.unsafe_buffer_pointer() == addr      # written in place
    assert torch.equal(to_torch(out), t_out)
    assert torch.equal(to_torch(state), t_state)


FUSED_META = {"device": "cuda", "rows": 8, "value_heads": 8, "work_items": 64, "state": "f32",
              "offset": "o32", "slot_mode": "unique", "gate": "softplus"}


@pytest.mark.skipif(not has_cuda_module("fused_kda_decode", FUSED_META), reason="no CUDA fused decode module")
@pytest.mark.parametrize("rows, Hf", [(1, 8), (16, 16)])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_fused_decode_equals_torch(gen, rows, Hf, mode):
    D, slots = 128, 2 * rows + 1
    C = 3 * Hf * D
    d = dict(x=rnd(gen, rows, C), conv_weight=rnd(gen, C, 4, scale=0.5), conv_state=rnd(gen, slots, C, 3),
             g=rnd(gen, rows, Hf, D), beta=rnd(gen, rows, Hf), A_log=rnd(gen, Hf, dtype=torch.float32, scale=0.5),
             dt_bias=rnd(gen, Hf * D, dtype=torch.float32, scale=0.5),
             state_indices=torch.randperm(slots, generator=gen)[:rows].to(torch.int32).cuda(),
             state=rnd(gen, slots, Hf, D, D, dtype=torch.float32, scale=0.1), output_gate=rnd(gen, rows, Hf, D),
             norm_weight=rnd(gen, D, dtype=torch.float32))
    order = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state_indices", "state",
             "output_gate", "norm_weight")
    tc = {n: x.clone() for n, x in d.items()}
    t_out = fk.fused_kda_decode(*(tc[n] for n in order))
    j = [to_jax(d[n]) for n in order]
    fn = kj.fused_kda_decode if mode == "eager" else jax.jit(kj.fused_kda_decode, donate_argnums=(2, 8))
    out, conv, state = fn(*j)
    assert torch.equal(to_torch(out), t_out)
    assert torch.equal(to_torch(conv), tc["conv_state"]) and torch.equal(to_torch(state), tc["state"])


PREFILL_META = {"device": "cuda", "num_seqs": 3, "value_heads": 8, "total_tokens": 300, "max_seqlen": None,
                "mean_seqlen": 100, "work_items": 24, "state": "f32", "offset": "o32", "gate": "softplus", "checkpoints": False}


def _close_or_equal(a: torch.Tensor, b: torch.Tensor, rerun_equal: bool):
    if rerun_equal:
        assert torch.equal(a, b)
    else:   # the kernel itself is not bitwise reproducible: same result within bf16 rounding
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not has_cuda_module("kda_prefill", PREFILL_META), reason="no CUDA prefill module")
@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_prefill_equals_torch(gen, pool, mode):
    lens, HV = [70, 1, 129], 8
    T = sum(lens)
    d = dict(q=rnd(gen, 1, T, HV, K), k=rnd(gen, 1, T, HV, K), v=rnd(gen, 1, T, HV, V), g=rnd(gen, 1, T, HV, K),
             beta=rnd(gen, 1, T, HV), A_log=rnd(gen, HV, dtype=torch.float32, scale=0.5),
             dt_bias=rnd(gen, HV * K, dtype=torch.float32, scale=0.5),
             cu_seqlens=torch.tensor([0, 70, 71, T], dtype=torch.int32).cuda())
    if pool:
        d["state"] = rnd(gen, 5, HV, V, K, dtype=torch.float32, scale=0.1)
        d["state_indices"] = torch.tensor([3, -1, 0], dtype=torch.int32).cuda()
    else:
        d["initial_state"] = rnd(gen, 3, HV, V, K, dtype=torch.float32, scale=0.1)

    _prefill_jax_equals_torch(d, mode)



PREFILL_POS = ("q", "k", "v", "g", "beta")


def _prefill_jax_equals_torch(d, mode, **kw):
    """kda_prefill on d's tensors through JAX (eager or jit) equals the torch op's output and final state: bitwise
    where the torch op reruns bitwise, else within the kernels' tolerance (_close_or_equal)."""
    def torch_run():
        a = {n: x.clone() for n, x in d.items()}
        args = [a.pop(n) for n in PREFILL_POS]  # pop before the ** unpacking sees them
        return fk.kda_prefill(*args, **a, **kw)

    t_out, t_final = torch_run()
    t_out2, t_final2 = torch_run()
    rerun_equal = torch.equal(t_out, t_out2) and torch.equal(t_final, t_final2)
    j = {n: to_jax(x) for n, x in d.items()}
    if mode == "eager":
        args = [j.pop(n) for n in PREFILL_POS]
        out, final = kj.kda_prefill(*args, **j, **kw)
    else:
        out, final = jax.jit(lambda a: kj.kda_prefill(*(a[n] for n in PREFILL_POS),
                                                      **{n: x for n, x in a.items() if n not in PREFILL_POS}, **kw))(j)
    _close_or_equal(to_torch(out), t_out, rerun_equal)
    _close_or_equal(to_torch(final), t_final, rerun_equal)


@pytest.mark.skipif(not has_cuda_module("kda_prefill", PREFILL_META), reason="no CUDA prefill module")
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_prefill_in_the_fused_chunk16_band_equals_torch(gen, mode):
    """The bounded gate at lower_bound -5 over 48 sequences x 8 heads (route fused_chunk16: prefill_c16ws, no
    workspace): JAX's call is the torch op's (bitwise where the torch op reruns bitwise)."""
    from flashkda_ext.validation import prefill_route_meta
    lens, HV = [int(x) for x in torch.randint(1, 200, (48,), generator=gen)], 8
    T = sum(lens)
    assert dispatch.module_name("kda_prefill", prefill_route_meta("cuda", len(lens), HV, T, None, "f32", "o32",
                                                                  "bounded", False, lower_bound=-5.0)) == "prefill_c16ws_f32"
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    d = dict(q=rnd(gen, 1, T, HV, K), k=rnd(gen, 1, T, HV, K), v=rnd(gen, 1, T, HV, V), g=rnd(gen, 1, T, HV, K),
             beta=rnd(gen, 1, T, HV), A_log=rnd(gen, HV, dtype=torch.float32, scale=0.5),
             dt_bias=rnd(gen, HV * K, dtype=torch.float32, scale=0.5),
             cu_seqlens=torch.tensor(cu, dtype=torch.int32).cuda(),
             initial_state=rnd(gen, len(lens), HV, V, K, dtype=torch.float32, scale=0.1))
    _prefill_jax_equals_torch(d, mode, gate="bounded", lower_bound=-5.0)

GRAPH_SCRIPT = textwrap.dedent("""
    import os, sys, json
    import torch, jax, jax.numpy as jnp
    sys.path.insert(0, {root!r})
    import flashkda_ext as fk, flashkda_ext.jax as kj
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    R, H, S, K, steps = 4, 8, 16, 128, 6
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=gen).to(dt).cuda()
    xs = [dict(q=r(R, H, K), k=r(R, H, K), v=r(R, H, K), g=r(R, H, K), beta=r(R, H)) for _ in range(steps)]
    A, dtb = r(H, dt=torch.float32), r(H * K, dt=torch.float32)
    pool = 0.1 * r(S, H, K, K, dt=torch.float32)
    idx = torch.randperm(S, generator=gen)[:R].to(torch.int32).cuda()
    tp = pool.clone()
    touts = [fk.kda_decode(**x, state=tp, state_indices=idx, A_log=A, dt_bias=dtb) for x in xs]
    torch.cuda.synchronize()
    J = lambda t: jnp.array(jax.dlpack.from_dlpack(t.clone()), copy=True)
    stacked = {{n: jnp.stack([J(x[n]) for x in xs]) for n in xs[0]}}
    def body(state, x):
        out, state = kj.kda_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], state=state,
                                   state_indices=J_idx, A_log=J_A, dt_bias=J_dtb)
        return state, out
    J_idx, J_A, J_dtb = J(idx), J(A), J(dtb)
    run = jax.jit(lambda s, xs: jax.lax.scan(body, s, xs), donate_argnums=0)
    text = run.lower(J(pool), stacked).compile().as_text()
    for _ in range(3):     # replays of the captured graph must equal the torch steps each time
        state, outs = run(J(pool), stacked)
        ok = torch.equal(torch.from_dlpack(state).clone(), tp) and all(
            torch.equal(torch.from_dlpack(outs[i]).clone(), touts[i]) for i in range(steps))
        assert ok, "graph replay differs from the torch steps"
    print(json.dumps({{"command_buffer": "command_buffer" in text or "CommandBuffer" in text}}))
""")


@pytest.mark.skipif(not has_cuda_module("kda_decode", DECODE_META), reason="no CUDA decode module")
def test_decode_under_command_buffers_equals_torch():
    """A scan of decode steps compiled with XLA command buffers forced on for custom calls (fresh
    process: the flags must be set before XLA starts): replays equal the torch steps."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE"
                          " --xla_gpu_graph_min_graph_size=1").strip())
    seed = str(int.from_bytes(os.urandom(4), "little"))
    res = subprocess.run([sys.executable, "-c", GRAPH_SCRIPT.format(root=str(ROOT)), seed], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"seed {seed}\n{res.stdout}\n{res.stderr[-4000:]}"


@pytest.mark.skipif(not has_cuda_module("kda_decode", DECODE_META), reason="no CUDA decode module")
def test_registration_targets_cuda_modules(gen):
    d = decode_case(gen, 2, 8, 8, 4, torch.float32)
    j = {n: to_jax(x) for n, x in d.items()}
    kj.kda_decode(j.pop("q"), j.pop("k"), j.pop("v"), j.pop("g"), j.pop("beta"), **j)
    names = [n for n in kj.registered_targets() if ".kda_decode." in n]
    assert names and not any(n.startswith("flashkda_ext.cpu_") for n in names)
    # the CUDA targets reorder their arguments in C++ too (no Python per call)
    assert all(kj.targets._ADAPTERS[n][0] == "c++" for n in names)
