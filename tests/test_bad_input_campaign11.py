"""Bad-input campaign 11 (CPU backend): the engine adapters driven as an integrator would; each case failed
before its fix.

- SGLang extend: a track_state that cannot be written (an expanded view, an inference tensor outside
  inference mode, a leaf requiring grad) failed in torch's copy_ after the pool had been committed.
- vLLM vendored fused_recurrent_kda: 1-D ssm_state_indices with fewer entries than requests were
  broadcast (one index: every request wrote that slot) or failed with torch's broadcast error.
- vLLM K3 fused_recurrent_kda: an empty or 2-D cu_seqlens failed with an IndexError / a torch error
  instead of falling back.
- SGLang's kernel: an index tensor, gate or beta with the wrong number of entries, a head count that is no
  positive int, an out of the wrong shape failed in reshape / split / view without the argument's name.
- JAX kda_verify with initial_state the (donated) state array failed in XLA's Execute, naming no argument.
Every refusal leaves every tensor bitwise as it was.
"""
from __future__ import annotations

import pytest
import torch

from flashkda_ext.integrations.sglang import FlashKDAExtKernel
from sglang_call_probe import packed_qkv, verify_setup
from vllm_adapter_probe import adapter, fell_back

H, K, V, SLOTS = 2, 8, 8, 6


def rand(*s, seed=[100]):
    seed[0] += 1
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed[0]))


def unchanged(tensors: dict, call, exc, match):
    """call() raises exc matching `match` and leaves every tensor of `tensors` bitwise as it was."""
    before = {n: t.clone() for n, t in tensors.items()}
    with pytest.raises(exc, match=match):
        call()
    for n, t in tensors.items():
        assert torch.equal(t.view(torch.int32), before[n].view(torch.int32)), f"a refused call wrote {n}"


# --- SGLang extend: track_state is written after the pool is committed ------------------------------------

def extend_call(track_state):
    T = 9
    mixed = rand(T, 2 * H * K + H * V)
    q, k, v = mixed.split([H * K, H * K, H * V], dim=-1)
    pool = rand(SLOTS, H, V, K)
    kw = dict(ssm_states=pool, cache_indices=torch.tensor([4, 1], dtype=torch.int32),
              query_start_loc=torch.tensor([0, 5, T], dtype=torch.int32), A_log=rand(H), dt_bias=rand(H * K),
              extend_seq_lens_cpu=[5, 4], track_state=track_state, track_chunk_idx=torch.tensor([1, 1]))
    args = (q.unflatten(-1, (H, K))[None], k.unflatten(-1, (H, K))[None], v.unflatten(-1, (H, V))[None],
            rand(1, T, H, K), rand(1, T, H).sigmoid())
    return pool, lambda: FlashKDAExtKernel(chunk_size=4).extend(*args, **kw)


def inference_track():
    with torch.inference_mode():
        return torch.zeros(2, H, V, K)


# campaign 19: an inference / grad-requiring track_state is one SGLang's chunk_kda writes (through its pointer), so the
# call now falls back to it, counted, with nothing written (here, without a fallback kernel: NotImplementedError
# naming track_state); an expanded one it could not write correctly either, so that stays a ValueError
TRACKS = {
    "expanded": (lambda: torch.zeros(1, H, V, K).expand(2, H, V, K), ValueError, r"^track_state: expected a pool"),
    "inference": (inference_track, NotImplementedError, r"^extend: track_state is an inference tensor"),
    "requires_grad": (lambda: torch.zeros(2, H, V, K, requires_grad=True), NotImplementedError,
                      r"^extend: track_state requires grad"),
}


@pytest.mark.parametrize("kind", TRACKS)
def test_sglang_extend_refuses_a_track_state_it_cannot_write_before_the_pool_is_committed(kind):
    make, error, match = TRACKS[kind]
    track = make()
    pool, call = extend_call(track)
    unchanged({"ssm_states": pool}, call, error, match)
    # a plain dense buffer is served (and the pool committed)
    pool, call = extend_call(torch.zeros(2, H, V, K))
    pool0 = pool.clone()
    call()
    assert not torch.equal(pool, pool0)


# --- vLLM adapters: malformed metadata falls back (counted), never broadcast or an unnamed torch error -------

@pytest.mark.parametrize("idx", [[5], [4, 5]], ids=["one", "two"])
def test_vllm_vendored_decode_with_fewer_slot_indices_than_requests_falls_back(idx):
    """Before: [5] for 3 requests was broadcast (all three wrote slot 5); [4, 5] failed in torch.where."""
    N = 3
    pool = rand(SLOTS, H, V, K)
    kw = dict(q=rand(1, N, H, K), k=rand(1, N, H, K), v=rand(1, N, H, V), g=-rand(1, N, H, K).abs(),
              beta=rand(1, N, H).sigmoid(), initial_state=pool, inplace_final_state=True,
              cu_seqlens=torch.tensor([0, 1, 2, 3]), ssm_state_indices=torch.tensor(idx))
    fn = adapter("vendored.fused_recurrent_kda")
    pool0 = pool.clone()
    fell_back("vendored.fused_recurrent_kda", lambda: fn(**kw), "ssm_state_indices")
    assert torch.equal(pool, pool0)
    # one index a request is served
    fn(**dict(kw, ssm_state_indices=torch.tensor([1, 2, 3])))
    assert [n for n in range(SLOTS) if not torch.equal(pool[n], pool0[n])] == [1, 2, 3]


@pytest.mark.parametrize("cu", [torch.zeros(0, dtype=torch.int64), torch.tensor([[0, 2, 5]])], ids=["empty", "2d"])
def test_vllm_k3_verify_with_malformed_cu_seqlens_falls_back(cu):
    """Before: IndexError (empty) / 'only one element tensors can be converted' (2-D), uncounted."""
    T = 5
    pool = rand(8, H, V, K)
    kw = dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, H, V), raw_g=rand(1, T, H, K),
              raw_beta=rand(1, T, H), A_log=rand(H), dt_bias=rand(H * K), lower_bound=None, initial_state=pool,
              cu_seqlens=cu, ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6]]))
    pool0 = pool.clone()
    fell_back("k3.fused_recurrent_kda", lambda: adapter("k3.fused_recurrent_kda")(**kw), "cu_seqlens")
    assert torch.equal(pool, pool0)


# --- SGLang's kernel: wrong-sized arguments are named ---------------------------------------------------

def packed_decode_call(**bad):
    B = 3
    pool = rand(SLOTS, H, V, K)
    kw = dict(A_log=rand(H), dt_bias=rand(H * K), scale=K ** -0.5, ssm_states=pool,
              cache_indices=torch.tensor([0, 1, 2], dtype=torch.int32), num_v_heads=H, head_v_dim=V)
    a, b = rand(B, H * K), rand(B, H)
    args = dict(mixed_qkv=rand(B, 2 * H * K + H * V), a=a, b=b)
    args.update((n, x) for n, x in bad.items() if n in args)
    kw.update((n, x) for n, x in bad.items() if n not in args)
    return pool, lambda: FlashKDAExtKernel().packed_decode(args["mixed_qkv"], args["a"], args["b"], **kw)


def decode_call(**bad):
    N = 3
    mixed = rand(N, 2 * H * K + H * V)
    q, k, v = packed_qkv(mixed, H, K, V)
    pool = rand(SLOTS, H, V, K)
    kw = dict(A_log=rand(H), dt_bias=rand(H * K), ssm_states=pool, cache_indices=torch.tensor([0, 1, 2], dtype=torch.int32),
              query_start_loc=torch.arange(N + 1, dtype=torch.int32))
    kw.update(bad)
    return pool, lambda: FlashKDAExtKernel().decode(q, k, v, rand(N, H * K), rand(N, H), **kw)


def verify_call(**bad):
    T = 5
    q, k, v, pool, buf, kw = verify_setup(rand, H, K, V, SLOTS)
    a, b = rand(T, H * K), rand(T, H)
    args = dict(a=a, b=b)
    args.update((n, x) for n, x in bad.items() if n in args)
    kw.update((n, x) for n, x in bad.items() if n not in args)
    return {"ssm_states": pool, "intermediate_states_buffer": buf}, \
        lambda: FlashKDAExtKernel().target_verify(rand(H), rand(H * K), q, k, v, args["a"], args["b"], **kw)


NAMED = [
    ("packed_decode", dict(cache_indices=torch.tensor([0, 1], dtype=torch.int32)), ValueError, r"^cache_indices: "),
    ("packed_decode", dict(a=rand(2, H * K)), ValueError, r"^a: "),
    ("packed_decode", dict(b=rand(2, H)), ValueError, r"^b: "),
    ("packed_decode", dict(num_v_heads=-2), ValueError, r"^num_v_heads: "),
    ("packed_decode", dict(num_v_heads=2.0), TypeError, r"^num_v_heads: "),
    ("packed_decode", dict(head_v_dim=True), TypeError, r"^head_v_dim: "),
    ("packed_decode", dict(ssm_states=[0]), TypeError, r"^ssm_states: "),
    ("decode", dict(out=torch.zeros(5)), ValueError, r"^out: "),
    ("decode", dict(out=torch.zeros(3 * H * V)), ValueError, r"^out: "),
    ("target_verify", dict(out=torch.zeros(1, 5, H)), ValueError, r"^out: "),
    ("target_verify", dict(a=rand(4, H * K)), ValueError, r"^a: "),
    ("target_verify", dict(b=rand(5, H + 1)), ValueError, r"^b: "),
]


@pytest.mark.parametrize("method,bad,exc,match", NAMED,
                         ids=[f"{m}-{next(iter(b))}-{i}" for i, (m, b, _, _) in enumerate(NAMED)])
def test_sglang_wrong_sized_arguments_are_named_and_write_nothing(method, bad, exc, match):
    if method == "packed_decode":
        pool, call = packed_decode_call(**bad)
        tensors = {"ssm_states": pool}
    elif method == "decode":
        pool, call = decode_call(**bad)
        tensors = {"ssm_states": pool}
    else:
        tensors, call = verify_call(**bad)
    unchanged(tensors, call, exc, match)


# --- JAX: an eager call's donated pool passed again as another operand -------------------------------------

def test_jax_verify_with_initial_state_the_donated_state_is_named():
    """Before: kda_verify(initial_state=state) (torch takes the same view) failed eagerly in XLA's Execute
    ("Attempt to use a buffer that was previously donated"), naming no argument."""
    pytest.importorskip("jax")
    pytest.importorskip("jax_tvm_ffi")
    import jax.numpy as jnp
    import numpy as np

    import flashkda_ext.jax as kj
    from bad_input_cases import verify_args

    t = verify_args()
    a = {n: jnp.asarray(x.numpy()) for n, x in t.items()}
    idx = jnp.asarray(np.array([4, 1], np.int32))
    pos = [a.pop(n) for n in ("q", "k", "v", "g", "beta")]
    for _ in range(2):   # cold, then with the signature's plan remembered
        with pytest.raises(ValueError, match=r"^initial_state: the same array as state, which .* donates"):
            kj.kda_verify(*pos, initial_state=a["state"], initial_state_indices=idx, **a)
        assert not a["state"].is_deleted() and np.array_equal(np.asarray(a["state"]), t["state"].numpy())
    # donate=False reads initial_state as it was before the call: served as from a copy of the pool
    out, _ = kj.kda_verify(*pos, initial_state=a["state"], initial_state_indices=idx, donate=False, **a)
    want, _ = kj.kda_verify(*pos, initial_state=jnp.array(a["state"], copy=True), initial_state_indices=idx,
                            donate=False, **a)
    assert np.array_equal(np.asarray(out), np.asarray(want))
