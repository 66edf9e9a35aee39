"""Bad-input campaign 21 (CPU backend): SGLang 0.5.23's captured-prefill wrapper (integrations/sglang/prefill_graph.py,
PrefillGraphWrapper), driven on CPU tensors as FlashInferKDAPrefillGraph drives it: plan(cu_seqlens) with the bucket's
int64 offsets (refilled in place), then run(...) with its keywords (raw gate and beta logits, A_log / dt_bias, the pool
and int32 slot indices with padding clamped to 0, output = a buffer like q). On CPU the offsets are host memory: run
reads them and serves exactly the tokens they own. A refused call is compared cold and warm (call_outcome: same
error, pool and output bitwise unchanged). Each case failed before its fix, except those marked "guard".

- cu_seqlens at run time: a last offset past q's T (also 2**31 + 5, and 2**32 + 10, which an int32 narrowing would
  wrap to a valid-looking 10) was reported as a shape error of `g`; a negative last offset cut its rows from the end
  (slice(0, -2)) and was reported under `g` with a negative element count; offsets not starting at 0, or falling,
  were named but checked against "T = <the last offset>" (or T - 1) instead of q's T. Now checked against q's T
  under cu_seqlens before any rows are cut.
- k, g or beta with a token count other than q's (T - 1, T + 1 rows): served on the host path, each cut to the
  planned rows, so the mismatch went unseen (the device path hands them whole to kda_prefill, which refuses). Now
  refused naming the argument.
- q, k, v, g or beta not a tensor (None, a list): an AttributeError or a bare TypeError from inside the wrapper,
  naming nothing. Now a TypeError naming it.
- ssm_state_indices (host): an entry past the pool on an empty (padded) sequence was turned into padding by the
  wrapper and served; kda_prefill refuses such an entry whatever its sequence's length (a live one's reached the
  binding and was named "cpu_kda_prefill::kda_prefill: argument 'state_indices'"). Now refused naming
  ssm_state_indices, before anything runs.
- checkpoint_every_n_tokens was read by its truth: False, None and 0.0 were served as 0, -1 refused under another
  argument's name (state_checkpoints); checkpoint_cu_starts or checkpoint_state_indices alone were refused under
  state_checkpoints too. Now an int (else a TypeError naming it), each checkpoint argument refused under its name.
- guard: padded sequences whose index SGLang clamped to slot 0 while slot 0 is a live request's, the last offset
  below T, the offsets refilled in place and planned again with other lengths: equal to flashkda_ext.reference,
  rows past the last offset and unaddressed slots bitwise unchanged.
- guard: what the wrapper does not serve (no l2norm, no in-kernel gate, a returned final state, a bool / NaN / >= 0
  lower_bound, a bool / NaN scale, A_log / dt_bias of the wrong size, int64 / float / wrongly sized indices, an
  unknown keyword) is refused naming the argument, the same cold and warm, with nothing written.
- guard: plan() refuses bool, 2-D and single offsets naming cu_seqlens.
- added 2026-12-07 (after the campaign): an output of another dtype than v or with strides, and a pool of a dtype
  or shape kda_prefill does not take, were refused under the op's names (out, state); the strided output's message
  showed the planned rows' shape, not the tensor given. Now named output / initial_state, checked on the whole tensor.
"""
from __future__ import annotations

import pytest
import torch

from flashkda_ext.devtools.testing import call_outcome
from flashkda_ext.integrations.sglang.prefill_graph import PrefillGraphWrapper
from flashkda_ext.reference import kda_recurrent

H, K, V, SLOTS, T = 2, 8, 16, 6, 12     # K != V catches a transposed state
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture(autouse=True)
def inference():
    with torch.inference_mode():
        yield


def graph_call(offsets=(0, 7, 10, 10), idx=(2, 4, 0), seed=2101):
    """A planned wrapper and run()'s keywords as FlashInferKDAPrefillGraph passes them; random inputs, a NaN-poisoned
    output (rows no sequence owns keep their bits)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, g = (torch.randn(1, T, H, K, generator=gen) for _ in range(3))
    w = PrefillGraphWrapper("cpu")
    w.plan(torch.tensor(offsets, dtype=torch.int64))
    kw = dict(q=q, k=k, v=torch.randn(1, T, H, V, generator=gen), g=g, beta=torch.randn(1, T, H, generator=gen),
              A_log=torch.randn(H, generator=gen), dt_bias=torch.randn(H * K, generator=gen),
              initial_state=torch.randn(SLOTS, H, V, K, generator=gen) * 0.3,
              ssm_state_indices=torch.tensor(idx, dtype=torch.int32), output_final_state=False,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
              output=torch.full((1, T, H, V), float("nan")))
    return w, kw


def refused_alike(w, kw, error, name):
    """The call is refused with `error` naming `name`, nothing written, and the same again (warm)."""
    cold = call_outcome(lambda a: w.run(**a)[0], kw)
    warm = call_outcome(lambda a: w.run(**a)[0], kw)
    assert cold[0] == "raise", "served"
    assert cold == warm
    assert cold[1] is error and cold[2].startswith(f"{name}:"), cold


@pytest.mark.parametrize("offsets", [
    (0, 7, 14, 14), (0, 7, 10, 2 ** 31 + 5), (0, 7, 10, 2 ** 32 + 10), (0, 7, 10, -2), (-5, -3, -2, -1),
    (2, 7, 10, 10), (0, 7, 5, 10)])
def test_run_checks_the_offsets_against_qs_tokens(offsets):
    w, kw = graph_call(offsets)
    refused_alike(w, kw, ValueError, "cu_seqlens")
    with pytest.raises(ValueError, match=rf"^cu_seqlens: .*T = {T}\b"):
        w.run(**kw)


@pytest.mark.parametrize("name, rows", [("k", T - 1), ("k", T + 1), ("g", T - 1), ("g", T + 1), ("beta", T - 1),
                                        ("beta", T + 1)])
def test_k_g_beta_of_another_length_than_q_are_refused(name, rows):
    w, kw = graph_call()
    kw[name] = torch.randn(1, rows, *kw[name].shape[2:])
    refused_alike(w, kw, ValueError, name)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
@pytest.mark.parametrize("value", [None, [1.0]], ids=["None", "list"])
def test_a_token_input_that_is_no_tensor_is_named(name, value):
    w, kw = graph_call()
    kw[name] = value
    refused_alike(w, kw, TypeError, name)


@pytest.mark.parametrize("idx", [(2, 4, SLOTS), (2, 4, 99), (SLOTS + 1, 4, 0)])
def test_an_index_past_the_pool_is_refused_even_for_an_empty_sequence(idx):
    w, kw = graph_call(idx=idx)
    refused_alike(w, kw, ValueError, "ssm_state_indices")


@pytest.mark.parametrize("change, error, name", [
    (dict(checkpoint_every_n_tokens=False), TypeError, "checkpoint_every_n_tokens"),
    (dict(checkpoint_every_n_tokens=None), TypeError, "checkpoint_every_n_tokens"),
    (dict(checkpoint_every_n_tokens=0.0), TypeError, "checkpoint_every_n_tokens"),
    (dict(checkpoint_every_n_tokens="0"), TypeError, "checkpoint_every_n_tokens"),
    (dict(checkpoint_every_n_tokens=-1), ValueError, "checkpoint_every_n_tokens"),
    (dict(checkpoint_cu_starts=torch.zeros(4, dtype=torch.int64)), ValueError, "checkpoint_cu_starts"),
    (dict(checkpoint_state_indices=torch.zeros(1, dtype=torch.int32)), ValueError, "checkpoint_state_indices"),
])
def test_each_checkpoint_argument_is_read_as_given_and_named(change, error, name):
    w, kw = graph_call()
    kw.update(change)
    refused_alike(w, kw, error, name)


def test_guard_padding_clamped_to_a_live_slot_and_refilled_offsets_match_the_reference():
    """SGLang's fill: the padded sequences' -1 clamped to slot 0, which a live request holds in the first and third
    batches; the offsets refilled in place in the planned tensor and planned again, one wrapper, one pool."""
    w, kw = graph_call()
    cu, pool = w.cu_seqlens, kw["initial_state"]
    for offsets, idx in (((0, 4, 11, 11), (0, 2, 0)), ((0, 2, 2, 2), (5, 0, 0)), ((0, 5, 9, 12), (3, 1, 0))):
        cu.copy_(torch.tensor(offsets))
        w.plan(cu)
        kw["ssm_state_indices"] = torch.tensor(idx, dtype=torch.int32)
        kw["output"] = out = torch.full((1, T, H, V), float("nan"))
        pool0 = pool.clone()
        n, live = offsets[-1], [i for i in range(3) if offsets[i + 1] > offsets[i]]
        got, none = w.run(**kw)
        assert got is out and none is None
        want_o, want_pool, _ = kda_recurrent(
            *(kw[x][:, :n] for x in ("q", "k", "v", "g", "beta")), gate="bounded", lower_bound=-5.0,
            A_log=kw["A_log"], dt_bias=kw["dt_bias"], beta_is_logit=True,
            cu_seqlens=torch.tensor([0] + [offsets[i + 1] for i in live], dtype=torch.int32), initial_state=pool0,
            state_indices=torch.tensor([idx[i] for i in live], dtype=torch.int32))
        torch.testing.assert_close(out[:, :n].double(), want_o, **TOL)
        assert torch.isnan(out[:, n:]).all()
        written = [idx[i] for i in live]
        torch.testing.assert_close(pool[written].double(), want_pool[written].double(), **TOL)
        untouched = [s for s in range(SLOTS) if s not in written]
        assert torch.equal(pool[untouched].view(torch.int32), pool0[untouched].view(torch.int32))


@pytest.mark.parametrize("change, error, name", [
    (dict(use_qk_l2norm_in_kernel=False), ValueError, "use_qk_l2norm_in_kernel"),
    (dict(use_gate_in_kernel=False), ValueError, "use_gate_in_kernel"),
    (dict(output_final_state=True), ValueError, "output_final_state"),
    (dict(lower_bound=True), TypeError, "lower_bound"),
    (dict(lower_bound=float("nan")), ValueError, "lower_bound"),
    (dict(lower_bound=0.0), ValueError, "lower_bound"),
    (dict(scale=True), TypeError, "scale"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(A_log=torch.zeros(H + 1)), ValueError, "A_log"),
    (dict(dt_bias=torch.zeros(H * K + 1)), ValueError, "dt_bias"),
    (dict(ssm_state_indices=torch.tensor([2, 4, 0])), ValueError, "ssm_state_indices"),
    (dict(ssm_state_indices=torch.tensor([2.0, 4.0, 0.0])), ValueError, "ssm_state_indices"),
    (dict(ssm_state_indices=torch.tensor([2, 4], dtype=torch.int32)), ValueError, "ssm_state_indices"),
])
def test_guard_what_is_not_served_is_refused_alike_cold_and_warm(change, error, name):
    w, kw = graph_call()
    kw.update(change)
    refused_alike(w, kw, error, name)


def test_guard_an_unknown_keyword_and_bad_plans_are_named():
    w, kw = graph_call()
    with pytest.raises(TypeError, match="new_flashinfer_argument"):
        w.run(**kw, new_flashinfer_argument=1)
    for offsets in (torch.tensor([False, True]), torch.tensor([[0, 3]]), torch.tensor([0])):
        with pytest.raises(ValueError, match="^cu_seqlens: "):
            PrefillGraphWrapper("cpu").plan(offsets)


@pytest.mark.parametrize("case", ["out_f64", "out_bf16", "out_strided", "out_transposed", "pool_f16", "pool_kv",
                                  "pool_3d"])
def test_output_and_pool_the_op_refuses_are_named_as_sglang_passes_them(case):
    w, kw = graph_call()
    name = "output" if case.startswith("out") else "initial_state"
    kw[name] = {"out_f64": lambda: torch.zeros(1, T, H, V, dtype=torch.float64),
                "out_bf16": lambda: torch.zeros(1, T, H, V, dtype=torch.bfloat16),
                "out_strided": lambda: torch.zeros(1, T, H, 2 * V)[..., ::2],
                "out_transposed": lambda: torch.zeros(1, T, V, H).transpose(2, 3),
                "pool_f16": lambda: torch.randn(SLOTS, H, V, K).half(),
                "pool_kv": lambda: torch.randn(SLOTS, H, K, V),
                "pool_3d": lambda: torch.randn(SLOTS, H, V * K)}[case]()
    refused_alike(w, kw, ValueError, name)
    if case == "out_strided":
        with pytest.raises(ValueError, match=rf"shape \[1, {T}, {H}, {V}\]"):    # the tensor given, not the rows cut
            w.run(**kw)
