"""Bad-input campaign 12 (CPU backend): the engine adapters driven as an integrator would. Each case failed
before its fix, except those marked "guard" (behaviour that was already right, pinned here beside the fix
that depends on it).

- fla: lower_bound=True was dropped with the log gate (use_gate_in_kernel=False) and the call served;
  chunk_kda's chunk_size 7, max_num_seqs, safe_gate=True without a lower_bound in [-5, 0) (fla raises),
  disable_recompute with return_intermediate_states (fla asserts) were served; an int flag was read truthily.
"""
from __future__ import annotations

import pytest
import torch

from flashkda_ext.integrations import fla as fkda_fla

H, K, V, SLOTS = 2, 8, 8, 6


def rand(*s, seed=[1200]):
    seed[0] += 1
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed[0]))


# --- fla: lower_bound and chunk_kda's hints ---------------------------------------------------------------------


@pytest.fixture
def inference():
    with torch.inference_mode():
        yield


def fla_chunk(**extra):
    T, HV = 6, 4
    call = dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, HV, V), g=rand(1, T, HV, K),
                beta=rand(1, T, HV), A_log=rand(HV), dt_bias=rand(HV * K), use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)
    call.update(extra)
    return call


def fla_decode(**extra):
    N, HV = 3, 4
    call = dict(q=rand(1, N, H, K), k=rand(1, N, H, K), v=rand(1, N, HV, V), g=-rand(1, N, HV, K).abs(),
                beta=rand(1, N, HV).sigmoid(), initial_state=rand(SLOTS, HV, V, K), inplace_final_state=True,
                cu_seqlens=torch.arange(N + 1), ssm_state_indices=torch.tensor([4, -1, 1], dtype=torch.int32),
                use_qk_l2norm_in_kernel=True, state_v_first=True)
    call.update(extra)
    return call


@pytest.mark.parametrize("gate_in_kernel", [True, False])
def test_fla_bool_lower_bound_is_refused_naming_the_bool(inference, gate_in_kernel):
    """Before: with the log gate (use_gate_in_kernel=False) lower_bound=True was dropped and the call served;
    with the gate in the kernel the op's refusal named the bool (now the adapter's does, before any mapping)."""
    ok, reason = fkda_fla.chunk_kda_verifier(**fla_chunk(lower_bound=True, use_gate_in_kernel=gate_in_kernel))
    assert not ok and "lower_bound as a number or None, got bool True" in reason
    ok, reason = fkda_fla.fused_recurrent_kda_fwd_verifier(**fla_decode(lower_bound=True,
                                                                        use_gate_in_kernel=gate_in_kernel))
    assert not ok and "got bool True" in reason


REFUSED_HINTS = [
    (dict(chunk_size=7), "chunk_size 32 or 64"),
    (dict(chunk_size=True), "chunk_size 32 or 64"),
    (dict(max_num_seqs=4), "max_num_seqs"),
    (dict(safe_gate=True), "lower_bound in [-5, 0)"),                     # no lower_bound: fla raises
    (dict(safe_gate=True, lower_bound=-6.0), "lower_bound in [-5, 0)"),
    (dict(disable_recompute=True, return_intermediate_states=True), "disable_recompute"),
    (dict(safe_gate=1, lower_bound=-5.0), "safe_gate as a bool"),
    (dict(output_final_state=1), "output_final_state as a bool"),
    (dict(transpose_state_layout=True), "transpose_state_layout"),        # guard: an unknown keyword
]


@pytest.mark.parametrize("extra,reason", REFUSED_HINTS, ids=[next(iter(e)) + str(i)
                                                              for i, (e, _) in enumerate(REFUSED_HINTS)])
def test_fla_chunk_kda_hints_it_cannot_honour_are_refused(inference, extra, reason):
    call = fla_chunk(**extra)
    if extra.get("return_intermediate_states"):
        call["output_final_state"] = False
    before = fkda_fla.STATS["chunk_kda", "refused"]
    ok, why = fkda_fla.chunk_kda_verifier(**call)
    assert not ok and reason in why, why
    assert fkda_fla.STATS["chunk_kda", "refused"] == before + 1


HONOURED_HINTS = [dict(chunk_size=32), dict(safe_gate=True, lower_bound=-5.0), dict(disable_recompute=True),
                  dict(safe_gate=True, use_gate_in_kernel=False, A_log=None, dt_bias=None)]


@pytest.mark.parametrize("extra", HONOURED_HINTS, ids=range(len(HONOURED_HINTS)))
def test_fla_chunk_kda_hints_that_do_not_change_the_result_are_served_exactly(inference, extra):
    """Guard (the other side of the refusals above): chunk_size 32, safe_gate (fla's kernel choice),
    disable_recompute (a backward-pass memory choice) compute the same recurrence: served, equal to the call
    without them."""
    call = fla_chunk(**extra)
    plain = {n: x for n, x in call.items() if n not in ("chunk_size", "safe_gate", "disable_recompute")}
    assert fkda_fla.chunk_kda_verifier(**call) == (True, None)
    o, _ = fkda_fla.serve_chunk_kda(**call)
    want, _ = fkda_fla.serve_chunk_kda(**plain)
    assert torch.equal(o, want)
