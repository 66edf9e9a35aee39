"""prefill_workspace_bytes routes as kda_prefill does: for every argument that can change the route (max_seqlen,
gate, lower_bound, state dtype, checkpoints), the module it sizes the scratch for is the one the call takes, so a
CUDA-graph capture sized by it never meets a larger need; its own bad arguments raise, naming them, by the op's
own checks (validation.check_max_seqlen, _gate_bound, check_checkpoint_every)."""
import pytest
import torch

from flashkda_ext import dispatch, ops, validation

H, K = 8, 16


def cuda_module_of_call(N, T, **kw):
    """The CUDA route of kda_prefill for this call: its checked call's metadata with the device set to cuda."""
    q = torch.zeros(1, T, H, K)
    cu = torch.arange(0, T + 1, T // N, dtype=torch.int32)
    gate = kw.get("gate", "softplus")
    params = {} if gate == "log" else dict(A_log=torch.zeros(H), dt_bias=torch.zeros(H * K))
    state = kw.pop("state_dtype", torch.float32)
    call = validation.check_kda_prefill(q, q, q, q, torch.zeros(1, T, H), cu_seqlens=cu,
                                        initial_state=torch.zeros(N, H, K, K, dtype=state), **params, **kw)
    return dispatch.module_name("kda_prefill", dict(call.route_meta(), device="cuda", offset="o32")), q, cu, state


@pytest.mark.parametrize("kw", [
    {}, dict(max_seqlen=512), dict(max_seqlen=4096), dict(gate="bounded", lower_bound=-5.0),
    dict(gate="bounded", lower_bound=-6.0), dict(gate="log"), dict(checkpoint_every=64),
    dict(state_dtype=torch.bfloat16), dict(gate="bounded", lower_bound=-5.0, max_seqlen=8192),
])
def test_the_workspace_is_sized_for_the_calls_route(kw):
    N, T = 64, 64 * 512
    want, q, cu, state = cuda_module_of_call(N, T, **dict(kw))
    meta = ops._workspace_route_meta(q, q, cu, kw.get("max_seqlen"), kw.get("gate", "softplus"),
                                     kw.get("lower_bound"), state, kw.get("checkpoint_every", 0))
    assert dispatch.module_name("kda_prefill", meta) == want


def test_the_routes_differ_across_those_arguments():
    """The grid above is not vacuous: the arguments move this call between modules."""
    N, T = 64, 64 * 512
    names = {cuda_module_of_call(N, T, **dict(kw))[0] for kw in (
        {}, dict(max_seqlen=8192), dict(gate="bounded", lower_bound=-6.0), dict(state_dtype=torch.bfloat16))}
    assert len(names) >= 3, names


@pytest.mark.parametrize("kw, match", [
    (dict(max_seqlen=10 ** 6), "max_seqlen"), (dict(max_seqlen=1.5), "max_seqlen"), (dict(gate="tanh"), "gate"),
    (dict(gate="bounded"), "lower_bound"), (dict(gate="bounded", lower_bound=0.5), "lower_bound"),
    (dict(lower_bound=-5.0), "lower_bound"), (dict(state_dtype=torch.float16), "state_dtype"),
    (dict(gate="bounded", lower_bound=float("-inf")), "lower_bound"),    # as kda_prefill: a finite bound
    (dict(max_seqlen=32), "max_seqlen"),                                  # unpacked: every row is T = 64 tokens
    (dict(checkpoint_every=-1), "checkpoint_every"),
])
def test_bad_arguments_are_named(kw, match):
    q = torch.zeros(1, 64, H, K)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.prefill_workspace_bytes(q, q, **kw)
