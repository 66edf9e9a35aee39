"""flashkda_ext.jax.kda_verify on the CPU backend: the same compiled module as the torch op, so the
results equal the torch op bitwise, eagerly and under jax.jit (T_max = 1 through kda_decode's module
too); host index values are checked with the torch op's messages; the pool is donated eagerly."""
import os

import pytest
import torch

jax = pytest.importorskip("jax")
pytest.importorskip("jax_tvm_ffi")
import jax.numpy as jnp  # noqa: E402

import flashkda_ext as fk  # noqa: E402

kj = pytest.importorskip("flashkda_ext.jax")

H, HV, K, V = 2, 4, 16, 8  # K != V catches transposes; HV = 2 H exercises grouped heads


def to_jax(t):
    return jnp.array(jax.dlpack.from_dlpack(t.detach().contiguous().clone()), copy=True)


def case(gen, lens, cols, state_dtype=torch.float32):
    N, T = len(lens), sum(lens)
    slots = N * cols + 3
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=r(1, T, HV, K), beta=r(1, T, HV),
                state=(r(slots, HV, V, K) * 0.5).to(state_dtype),
                state_indices=torch.randperm(slots, generator=gen)[:N * cols].reshape(N, cols).to(torch.int32),
                cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
                num_accepted_tokens=torch.randint(1, cols + 1, (N,), generator=gen, dtype=torch.int32),
                A_log=r(HV) * 0.3, dt_bias=r(HV * K) * 0.5)


POS = ("q", "k", "v", "g", "beta")


def assert_equals_the_torch_op(a, donate_argnums=()):
    """kj.kda_verify on the case a (torch tensors by name, q..beta first) gives the torch op's output and state
    bitwise, eagerly and under jax.jit (donate_argnums passed to it); returns the case as JAX arrays."""
    j = {n: to_jax(x) for n, x in a.items()}
    t_state = a["state"].clone()
    t_out = fk.kda_verify(*(a[n] for n in POS), **{n: (t_state if n == "state" else x) for n, x in a.items()
                                                  if n not in POS})
    out, new_state = kj.kda_verify(*(j[n] for n in POS), **{n: x for n, x in j.items() if n not in POS},
                                   donate=False)
    assert torch.equal(torch.from_dlpack(out), t_out) and torch.equal(torch.from_dlpack(new_state), t_state)
    names = tuple(j)
    fn = jax.jit(lambda *xs: kj.kda_verify(*xs[:5], **dict(zip(names[5:], xs[5:]))), donate_argnums=donate_argnums)
    out2, state2 = fn(*(j[n] for n in names))
    assert torch.equal(torch.from_dlpack(out2), t_out) and torch.equal(torch.from_dlpack(state2), t_state)
    return j


@pytest.mark.parametrize("lens,cols,sd", [([3, 1, 4], 4, torch.float32), ([2, 2], 2, torch.bfloat16),
                                          ([1, 1, 1], 1, torch.bfloat16)])
def test_equals_the_torch_op_eager_and_jitted(lens, cols, sd):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    a = case(gen, lens, cols, sd)
    assert list(a)[5] == "state"
    assert_equals_the_torch_op(a, donate_argnums=(5,))


def test_host_values_are_checked_with_the_torch_messages():
    gen = torch.Generator().manual_seed(1)
    a = case(gen, [3, 1, 4], 4)
    a["state_indices"][1, 0] = a["state_indices"][0, 0]  # one slot written by two requests
    j = {n: to_jax(x) for n, x in a.items()}
    with pytest.raises(ValueError) as torch_err:
        fk.kda_verify(*(a[n] for n in POS), **{n: x for n, x in a.items() if n not in POS})
    with pytest.raises(ValueError) as jax_err:
        kj.kda_verify(*(j[n] for n in POS), **{n: x for n, x in j.items() if n not in POS})
    assert str(jax_err.value) == str(torch_err.value) and str(jax_err.value).startswith("state_indices:")
    with pytest.raises(ValueError, match="^q: expected the packed layout"):
        kj.kda_verify(*(jnp.concatenate([j[n], j[n]]) for n in POS), **{n: x for n, x in j.items() if n not in POS})


def test_fused_verify_equals_the_torch_op_eager_and_jitted():
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    Hf, D, lens, cols = 2, 8, [3, 1, 2], 3
    C, T, N = 3 * Hf * D, sum(lens), len(lens)
    slots = N * cols + 2
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    a = dict(x=r(1, T, C), conv_weight=r(C, 4) * 0.5, conv_state=r(slots, C, cols + 2), g=r(1, T, Hf, D),
             beta=r(1, T, Hf), A_log=r(Hf) * 0.3, dt_bias=r(Hf * D) * 0.5, state=r(slots, Hf, D, D) * 0.5,
             output_gate=r(1, T, Hf, D), norm_weight=r(D) + 1.0)
    kw = dict(state_indices=torch.randperm(slots, generator=gen)[:N * cols].reshape(N, cols).to(torch.int32),
              cu_seqlens=torch.tensor([0, 3, 4, 6], dtype=torch.int32),
              num_accepted_tokens=torch.randint(1, cols + 1, (N,), generator=gen, dtype=torch.int32))
    t = {n: x.clone() for n, x in a.items()}
    t_out = fk.fused_kda_verify(*t.values(), **kw)
    j, jkw = {n: to_jax(x) for n, x in a.items()}, {n: to_jax(x) for n, x in kw.items()}
    out, conv, state = kj.fused_kda_verify(*j.values(), **jkw, donate=False)
    assert torch.equal(torch.from_dlpack(out), t_out)
    assert torch.equal(torch.from_dlpack(conv), t["conv_state"]) and torch.equal(torch.from_dlpack(state), t["state"])
    fn = jax.jit(lambda *xs: kj.fused_kda_verify(*xs[:10], state_indices=xs[10], cu_seqlens=xs[11],
                                                 num_accepted_tokens=xs[12]), donate_argnums=(2, 7))
    out2, conv2, state2 = fn(*j.values(), *jkw.values())
    assert torch.equal(torch.from_dlpack(out2), t_out) and torch.equal(torch.from_dlpack(state2), t["state"])
    assert torch.equal(torch.from_dlpack(conv2), t["conv_state"])


@pytest.mark.parametrize("step_rows", [False, True])
@pytest.mark.parametrize("lens,cols", [([3, 1, 4], 4), ([1, 0, 1], 1)])
def test_second_start_pool_equals_the_torch_op(lens, cols, step_rows):
    """initial_state / initial_state_indices (kda_verify's read-only start pool), with a pool and table or step
    rows, through XLA: the torch op's results bitwise, eagerly and jitted; the second pool's host indices
    checked with the torch message."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    a = case(gen, lens, cols)
    del a["num_accepted_tokens"]
    a["initial_state"] = torch.randn(5, HV, V, K, generator=gen)
    a["initial_state_indices"] = torch.tensor([4, -1, 2][:len(lens)], dtype=torch.int32)
    if step_rows:  # state [R, T_max, HV, V, K], one row per request (the last one padding)
        a["state"] = torch.randn(5, cols, HV, V, K, generator=gen)
        a["state_indices"] = torch.tensor([3, 0, -1][:len(lens)], dtype=torch.int32)
    j = assert_equals_the_torch_op(a)
    bad = dict(j, initial_state_indices=to_jax(torch.tensor([0, 5, 1][:len(lens)], dtype=torch.int32)))
    with pytest.raises(ValueError, match="^initial_state_indices:"):
        kj.kda_verify(*(bad[n] for n in POS), **{n: x for n, x in bad.items() if n not in POS}, donate=False)


@pytest.mark.parametrize("step_rows", [False, True])
def test_draft_tree_equals_the_torch_op(step_rows):
    """parent_tokens (a draft tree) through XLA: the torch op's results bitwise, eagerly and jitted; a parent
    after its token refused with the torch message."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    lens, cols = [4, 2, 3], 4
    a = case(gen, lens, cols)
    a["parent_tokens"] = torch.tensor([[-3, 0, 0, 1], [9, 0, 7, 7], [0, 0, 1, 5]], dtype=torch.int32)
    if step_rows:  # state [R, T_max, HV, V, K], one row per request
        del a["num_accepted_tokens"]
        a["state"] = torch.randn(4, cols, HV, V, K, generator=gen)
        a["state_indices"] = torch.tensor([3, 0, 1], dtype=torch.int32)
    j = assert_equals_the_torch_op(a)
    bad = dict(j, parent_tokens=to_jax(torch.tensor([[0, 0, 2, 1], [0, 0, 0, 0], [0, 0, 1, 0]], dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"^parent_tokens: entry \[0, 2\] = 2"):
        kj.kda_verify(*(bad[n] for n in POS), **{n: x for n, x in bad.items() if n not in POS}, donate=False)


def test_host_values_are_checked_against_each_calls_own_max_seqlen():
    """Campaign 13: the validated call the value checks read was kept by plan, which max_seqlen does not change, so
    after a valid max_seqlen=4 call a max_seqlen=2 one (a request of 4 tokens) passed, and a valid max_seqlen=None
    call after a refused one was refused."""
    gen = torch.Generator().manual_seed(2)
    a = case(gen, [3, 1, 4], 4)
    j = {n: to_jax(x) for n, x in a.items()}
    call = lambda m: kj.kda_verify(*(j[n] for n in POS), **{n: x for n, x in j.items() if n not in POS},  # noqa: E731
                                   max_seqlen=m, donate=False)
    for m in (2, 4, 2, None, 3):
        if m is not None and m < 4:
            with pytest.raises(ValueError, match="^max_seqlen: "):
                call(m)
        else:
            call(m)


def test_fused_verify_host_values_are_checked_against_each_calls_own_max_seqlen():
    """Campaign 13, as above for fused_kda_verify."""
    gen = torch.Generator().manual_seed(3)
    Hf, D, cols, T, N, slots = 2, 8, 3, 6, 3, 11
    C = 3 * Hf * D
    r = lambda *s: to_jax(torch.randn(*s, generator=gen))  # noqa: E731
    a = (r(1, T, C), r(C, 4), r(slots, C, cols + 2), r(1, T, Hf, D), r(1, T, Hf), r(Hf), r(Hf * D),
         r(slots, Hf, D, D), r(1, T, Hf, D), r(D))
    kw = dict(state_indices=to_jax(torch.arange(1, 10, dtype=torch.int32).reshape(N, cols)),
              cu_seqlens=to_jax(torch.tensor([0, 3, 4, 6], dtype=torch.int32)),
              num_accepted_tokens=to_jax(torch.tensor([1, 2, 3], dtype=torch.int32)))
    for m in (2, 3, 2, None):
        if m == 2:
            with pytest.raises(ValueError, match="^max_seqlen: "):
                kj.fused_kda_verify(*a, **kw, max_seqlen=m, donate=False)
        else:
            kj.fused_kda_verify(*a, **kw, max_seqlen=m, donate=False)
