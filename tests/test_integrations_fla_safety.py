"""Bad input through fla's adapter (issue 45, "Adapter safety"): int64 indices, offsets and counts are
range-checked before the int32 narrowing (2**32 + 1 must never become slot 1), a decode batch's offsets
are read (an empty request's slot is never written), and fla's host offsets cu_seqlens_cpu are checked
against cu_seqlens where both are in host memory. Each refused call raises the same error on the first
call and after a valid one, and leaves every tensor as it was. CPU backend; no fla needed."""
import pytest
import torch

from flashkda_ext.integrations import common_checks
from flashkda_ext.integrations import fla as fkda_fla
from flashkda_ext.reference import kda_decode_step, kda_recurrent, kda_verify_step

H, HV, K, V, SLOTS = 2, 4, 8, 16, 6
TOL = dict(rtol=2e-5, atol=2e-5)
FLAGS = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)
WRAP = 2 ** 32 + 1      # a plain .to(torch.int32) makes this 1


@pytest.fixture(autouse=True)
def no_grad():
    fkda_fla._VERDICTS.clear()    # verdicts made with host_values patched must not outlive the test
    with torch.inference_mode():
        yield
    fkda_fla._VERDICTS.clear()


def tokens(T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=-torch.rand(1, T, HV, K, generator=gen),
                beta=r(1, T, HV))


def pool(seed=1):
    return torch.randn(SLOTS, HV, V, K, generator=torch.Generator().manual_seed(seed)) * 0.3


def refused_alike(call, match):
    """The call raises ValueError matching `match` cold and after a valid call of the same form, the
    verifier having accepted it (values are not metadata), and writes nothing."""
    valid = dict(call, initial_state=call["initial_state"].clone(), **VALID[call["_form"]])
    bad = {k: v for k, v in call.items() if k != "_form"}
    valid.pop("_form")
    fkda_fla._VERDICTS.clear()
    before = {k: v.clone() for k, v in bad.items() if isinstance(v, torch.Tensor)}
    errors = []
    for warm in (False, True):
        if warm:
            assert fkda_fla.fused_recurrent_kda_fwd_verifier(**valid) == (True, None)
            fkda_fla.serve_fused_recurrent_kda_fwd(**valid)
        assert fkda_fla.fused_recurrent_kda_fwd_verifier(**bad) == (True, None)
        with pytest.raises(ValueError, match=match) as e:
            fkda_fla.serve_fused_recurrent_kda_fwd(**bad)
        errors.append(str(e.value))
        for name, x in before.items():
            assert torch.equal(bad[name], x), f"{name} written by a refused call"
    assert errors[0] == errors[1]


# the valid twin of each bad call's form (replacing the bad argument)
VALID = {"decode": dict(ssm_state_indices=torch.tensor([4, 0, 2]), cu_seqlens=torch.arange(4)),
         "verify": dict(ssm_state_indices=torch.tensor([[1, 4, -1], [2, 5, 3]]), num_accepted_tokens=torch.tensor(
             [2, 1]), cu_seqlens=torch.tensor([0, 2, 5]))}


def decode_call(**change):
    return dict(tokens(3), initial_state=pool(), cu_seqlens=torch.arange(4), ssm_state_indices=torch.tensor(
        [4, 0, 2]), _form="decode", **FLAGS) | change


def verify_call(**change):
    return dict(tokens(5), initial_state=pool(), cu_seqlens=torch.tensor([0, 2, 5]), ssm_state_indices=torch.tensor(
        [[1, 4, -1], [2, 5, 3]]), num_accepted_tokens=torch.tensor([2, 1]), _form="verify", **FLAGS) | change


def test_decode_slot_index_that_would_wrap_is_refused():
    refused_alike(decode_call(ssm_state_indices=torch.tensor([4, WRAP, 2])),
                  rf"^ssm_state_indices: entry \[1\] = {WRAP} is out of range")


def test_decode_slot_index_past_the_pool_names_the_callers_argument():
    refused_alike(decode_call(ssm_state_indices=torch.tensor([4, SLOTS, 2])),
                  rf"^ssm_state_indices: entry \[1\] = {SLOTS} .* <= {SLOTS - 1} \(a pool of {SLOTS} slots")


def test_unpadded_decode_slot_index_that_would_wrap_is_refused():
    call = dict(tokens(1), ssm_state_indices=torch.tensor([WRAP]), initial_state=pool(), **FLAGS)
    call = {k: (v.reshape(1, 1, *v.shape[2:]) if isinstance(v, torch.Tensor) and k in "qkvgbeta" else v)
            for k, v in call.items()}
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
    with pytest.raises(ValueError, match=r"^ssm_state_indices: entry \[0\]"):
        fkda_fla.serve_fused_recurrent_kda_fwd(**call)


@pytest.mark.parametrize("name,value,match", [
    ("ssm_state_indices", torch.tensor([[1, 4, -1], [2, WRAP, 3]]), r"^ssm_state_indices: entry \[1, 1\]"),
    ("num_accepted_tokens", torch.tensor([2, WRAP]), r"^num_accepted_tokens: entry \[1\] .* \[1, 3\] \(T_max = 3\)"),
    ("num_accepted_tokens", torch.tensor([0, 1]), r"^num_accepted_tokens: entry \[0\] = 0"),
    ("cu_seqlens", torch.tensor([0, WRAP + 1, 5]), r"^cu_seqlens: entry \[1\]"),
])
def test_verify_int64_arguments_are_range_checked(name, value, match):
    refused_alike(verify_call(**{name: value}), match)


def test_decode_batch_with_an_empty_request_never_writes_its_slot():
    """cu_seqlens [0, 1, 1, 2] with T = N = 3 (CUDA-graph style: request 1 empty, row 2 owned by no
    request): request 2's token is row 1 and uses slot idx[2]; the empty request's live slot idx[1] is
    untouched; row 2 outputs zeros."""
    a = tokens(3, seed=5)
    p0 = pool()
    p = p0.clone()
    idx = torch.tensor([4, 1, 2])
    call = dict(a, initial_state=p, cu_seqlens=torch.tensor([0, 1, 1, 2]), ssm_state_indices=idx, **FLAGS)
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
    o, final = fkda_fla.serve_fused_recurrent_kda_fwd(**call)
    rows = torch.tensor([4, 2], dtype=torch.int32)
    want_o, want_pool = kda_decode_step(a["q"][0, :2], a["k"][0, :2], a["v"][0, :2], a["g"][0, :2],
                                        a["beta"][0, :2], state=p0, state_indices=rows, gate="log")
    assert final is p
    torch.testing.assert_close(o[0, :2].double(), want_o, **TOL)
    assert torch.equal(o[0, 2], torch.zeros(HV, V))
    torch.testing.assert_close(p.double(), want_pool.double(), **TOL)
    assert torch.equal(p[1], p0[1])


def test_decode_batch_with_a_multi_token_request_is_refused_naming_cu_seqlens():
    """[0, 2, 2, 3]: request 0 has two tokens, request 1 none; with one slot a request that is no decode
    batch (served as three rows it wrote the empty request's slot)."""
    refused_alike(decode_call(cu_seqlens=torch.tensor([0, 2, 2, 3])),
                  r"^cu_seqlens: with 1-D ssm_state_indices .* request 0 has 2")


def test_device_offsets_route_the_decode_batch_to_verify(monkeypatch):
    """Offsets only on the device (stood in for by making them unreadable to the adapter): the decode
    batch goes to kda_verify with state_indices (idx[n], -1), which reads them there. [0, 2, 2, 3]: the
    empty request's slot is untouched; request 0's outputs are its two-token recurrence, its first
    token's state stored in its slot; request 2 is a plain decode row."""
    monkeypatch.setattr(common_checks, "host_values", lambda x: x is None)
    a = tokens(3, seed=7)
    p0 = pool()
    p = p0.clone()
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    idx = torch.tensor([4, 1, 2], dtype=torch.int32)
    call = dict(a, initial_state=p, cu_seqlens=cu, ssm_state_indices=idx, **FLAGS)
    fkda_fla._VERDICTS.clear()
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
    o, _ = fkda_fla.serve_fused_recurrent_kda_fwd(**call)
    table = torch.tensor([[4, -1], [1, -1], [2, -1]], dtype=torch.int32)
    want_o, want_pool = kda_verify_step(a["q"], a["k"], a["v"], a["g"], a["beta"], state=p0, state_indices=table,
                                        cu_seqlens=cu, gate="log")
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(p.double(), want_pool.double(), **TOL)
    assert torch.equal(p[1], p0[1])
    one = kda_decode_step(a["q"][0, :1], a["k"][0, :1], a["v"][0, :1], a["g"][0, :1], a["beta"][0, :1], state=p0,
                          state_indices=idx[:1], gate="log")[1]
    torch.testing.assert_close(p[4].double(), one[4].double(), **TOL)
    # int64 offsets on the device cannot be range-checked without a sync: refused with the reason
    ok, why = fkda_fla.fused_recurrent_kda_fwd_verifier(**dict(call, cu_seqlens=cu.long()))
    assert not ok and "cu_seqlens" in why and "sync" in why
    ok, why = fkda_fla.fused_recurrent_kda_fwd_verifier(**{k: v for k, v in verify_call().items() if k != "_form"})
    assert not ok and "cu_seqlens" in why and "sync" in why       # the verify form's int64 offsets too


def test_device_slot_indices_out_of_range_become_padding(monkeypatch):
    """On a device an int64 slot index past the pool (or one that would wrap) is never read on the host:
    it becomes padding in the narrowing pass, so its row outputs zeros and no slot is written."""
    monkeypatch.setattr(common_checks, "host_values", lambda x: x is None)
    a = tokens(3, seed=9)
    p0 = pool()
    p = p0.clone()
    call = dict(a, initial_state=p, cu_seqlens=torch.arange(4, dtype=torch.int32),
                ssm_state_indices=torch.tensor([4, WRAP, 2]), **FLAGS)
    fkda_fla._VERDICTS.clear()
    o, _ = fkda_fla.serve_fused_recurrent_kda_fwd(**call)
    assert torch.equal(o[0, 1], torch.zeros(HV, V))
    for s in (0, 1, 3, 5):
        assert torch.equal(p[s], p0[s]), s


def chunk_call(cu, cu_cpu, **extra):
    T = int(cu[-1])
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=-torch.rand(1, T, HV, K, generator=gen),
                beta=r(1, T, HV), cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **FLAGS, **extra)


@pytest.mark.parametrize("extra", [dict(output_final_state=True),
                                   dict(output_final_state=True, return_intermediate_states=True)])
@pytest.mark.parametrize("cu_cpu", [torch.tensor([0, 60, 130]), torch.tensor([0, 75, 130])])
def test_chunk_host_offsets_that_disagree_are_refused_naming_cu_seqlens_cpu(cu_cpu, extra):
    """Before: one form raised an error naming max_seqlen (never passed), the other returned the wrong h."""
    call = chunk_call(torch.tensor([0, 70, 130]), cu_cpu, **extra)
    for _ in range(2):   # first call and a repeat (the verdict memoized)
        assert fkda_fla.chunk_kda_verifier(**call) == (True, None)
        with pytest.raises(ValueError, match=r"^cu_seqlens_cpu: expected the host copy of cu_seqlens"):
            fkda_fla.serve_chunk_kda(**call)


def test_chunk_host_offsets_are_checked_on_their_own():
    for bad, match in [(torch.tensor([0, 70]), "expected the 3 offsets"),
                       (torch.tensor([0, 80, 70]), "expected non-decreasing offsets from 0 to T = 130"),
                       (torch.tensor([0.0, 70.0, 130.0]), "expected a 1-D int32 or int64 tensor in host memory")]:
        with pytest.raises(ValueError, match="^cu_seqlens_cpu: " + match):
            fkda_fla.serve_chunk_kda(**chunk_call(torch.tensor([0, 70, 130]), bad, output_final_state=True))
    # agreeing copies are served, and equal the reference
    cu = torch.tensor([0, 70, 130])
    call = chunk_call(cu, cu.clone(), output_final_state=True)
    o, ht = fkda_fla.serve_chunk_kda(**call)
    want_o, want_ht, _ = kda_recurrent(call["q"], call["k"], call["v"], call["g"], call["beta"], gate="log",
                                       cu_seqlens=cu)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(ht.double(), want_ht, **TOL)


@pytest.mark.parametrize("form,name", [("decode", "ssm_state_indices"), ("verify", "ssm_state_indices"),
                                       ("verify", "num_accepted_tokens")])
def test_bool_index_tensors_are_refused_not_made_slots_0_and_1(form, name):
    """Before: a bool ssm_state_indices / num_accepted_tokens passed the verifier and was narrowed to int32,
    so a mask [True, False, True] served slots 1, 0, 1 (decode) and wrote the pool."""
    call = decode_call() if form == "decode" else verify_call()
    call.pop("_form")
    call[name] = call[name] != 0 if name == "ssm_state_indices" else torch.tensor([True, True])
    before = call["initial_state"].clone()
    for _ in range(2):
        ok, why = fkda_fla.fused_recurrent_kda_fwd_verifier(**call)
        assert not ok and f"requires {name} as an integer tensor, got torch.bool" in why
        with pytest.raises(fkda_fla.Refused, match=name):
            fkda_fla.serve_fused_recurrent_kda_fwd(**call)
        assert torch.equal(call["initial_state"], before)


def test_common_narrowing_leaves_a_bool_tensor_for_the_op_to_name():
    mask = torch.tensor([True, False])
    assert common_checks.narrow_int32("x", mask, pad=-1) is mask


@pytest.mark.parametrize("cu", [None, torch.tensor([0, 1, 2])], ids=["batch-rows", "packed"])
def test_dense_in_place_states_fewer_than_the_sequences_are_refused_naming_initial_state(cu):
    """inplace_final_state=True without indices updates initial_state[n] for every sequence n. Before: the
    verifier accepted an initial_state of fewer rows; the CPU then raised naming state_indices (never passed)
    and a GPU would start the missing sequences from zero and store nothing."""
    a = tokens(2, seed=4) if cu is not None else {k: x.view(2, 1, *x.shape[2:]) for k, x in tokens(2, seed=4).items()}
    call = dict(a, initial_state=pool()[:1].clone(), inplace_final_state=True, cu_seqlens=cu, **FLAGS)
    before = call["initial_state"].clone()
    ok, why = fkda_fla.fused_recurrent_kda_fwd_verifier(**call)
    assert not ok and "initial_state" in why and "N = 2" in why
    with pytest.raises(fkda_fla.Refused, match="initial_state"):
        fkda_fla.serve_fused_recurrent_kda_fwd(**call)
    assert torch.equal(call["initial_state"], before)
    # as many states as sequences (or more): served in place
    call["initial_state"] = pool()[:2].clone()
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
    fkda_fla.serve_fused_recurrent_kda_fwd(**call)


def test_verify_request_longer_than_the_table_names_cu_seqlens():
    """Campaign 13: a request of 4 tokens beside a 3-column table raised naming max_seqlen, which fla's caller
    never passes (the adapter adds it)."""
    refused_alike(verify_call(cu_seqlens=torch.tensor([0, 1, 5])),
                  r"^cu_seqlens: a request of 4 tokens, more than the 3 columns")


@pytest.mark.parametrize("form", ["decode", "verify"])
def test_unsigned_slot_indices_are_refused_not_wrapped(form):
    """Campaign 13: uint64 2**64 - 1 became -1 (padding) on its way to int64, before the range check."""
    call = decode_call() if form == "decode" else verify_call()
    idx = call["ssm_state_indices"].clamp(min=0)
    idx.view(-1)[1] = -1                                    # its bits: 2**64 - 1 as uint64
    idx = idx.view(torch.uint64)
    call["ssm_state_indices"] = idx
    call.pop("_form")
    before = call["initial_state"].clone()
    with pytest.raises(ValueError, match="^ssm_state_indices: .*unsigned"):
        fkda_fla.serve_fused_recurrent_kda_fwd(**call)
    assert torch.equal(call["initial_state"], before)


@pytest.mark.parametrize("bad", [torch.tensor([[0, 70, 130]]), torch.tensor(130)], ids=["2-D", "0-d"])
def test_chunk_host_offsets_of_another_shape_are_refused_by_the_verifier_not_raised(bad):
    """Campaign 13: the verdict's memo key read cu_seqlens_cpu with tolist() before the check, and a 2-D or 0-d one
    raised TypeError (unhashable list / int not iterable) out of the verifier."""
    call = chunk_call(torch.tensor([0, 70, 130]), bad, output_final_state=True)
    fkda_fla._VERDICTS.clear()
    ok, why = fkda_fla.chunk_kda_verifier(**call)      # a verdict, not an exception
    assert not ok and "cu_seqlens_cpu: expected a 1-D" in why
    with pytest.raises(ValueError, match="^cu_seqlens_cpu: expected a 1-D"):
        fkda_fla.serve_chunk_kda(**call)


@pytest.mark.parametrize("extra", [dict(), dict(return_intermediate_states=True)], ids=["o", "h"])
@pytest.mark.parametrize("bad, match", [
    (torch.tensor([0.0, 70.0, 130.0]), "expected a 1-D int32 or int64 tensor in host memory"),
    (torch.tensor([0, 70, 130], dtype=torch.int16), "expected a 1-D int32 or int64 tensor in host memory"),
    (torch.tensor([0, 70, 130], device="meta"), "expected a 1-D int32 or int64 tensor in host memory"),
    ([0, 70, 130], "expected a 1-D int32 or int64 tensor in host memory"),
    (torch.tensor([0, 80, 70]), "expected non-decreasing offsets from 0 to T = 130"),
    (torch.tensor([0, 130]), "expected the 3 offsets of cu_seqlens"),
], ids=["float", "int16", "meta", "list", "decreasing", "count"])
def test_chunk_host_offsets_the_verifier_refuses_name_cu_seqlens_cpu(bad, match, extra):
    """Before: the verifier skipped the host copy, and with return_intermediate_states read its lengths
    unchecked: a float or int16 copy was refused naming max_seqlen (never passed), a meta one raised
    NotImplementedError out of the verifier, a list an AttributeError reason; without h it said served."""
    call = chunk_call(torch.tensor([0, 70, 130]), bad, output_final_state=True, **extra)
    fkda_fla._VERDICTS.clear()
    for _ in range(2):      # first call and a repeat (memoized where the copy can be keyed)
        ok, why = fkda_fla.chunk_kda_verifier(**call)
        assert not ok and why.startswith("flashkda_ext does not serve this call: cu_seqlens_cpu: " + match), why
        with pytest.raises(ValueError, match="^cu_seqlens_cpu: " + match):
            fkda_fla.serve_chunk_kda(**call)


def test_chunk_empty_host_offsets_name_cu_seqlens_cpu():
    """Campaign 13: empty offsets passed the length check and host[0] raised IndexError."""
    call = chunk_call(torch.tensor([0, 70, 130]), None, output_final_state=True, return_intermediate_states=True)
    call.update(cu_seqlens=torch.zeros(0, dtype=torch.long), cu_seqlens_cpu=torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="^cu_seqlens_cpu: "):
        fkda_fla.serve_chunk_kda(**call)


@pytest.mark.parametrize("name,dtype", [("initial_state", torch.int64), ("initial_state", torch.bool),
                                        ("initial_state", torch.complex64), ("g", torch.int32),
                                        ("beta", torch.bool)])
def test_chunk_a_non_float_tensor_is_refused_not_cast(name, dtype):
    """Campaign 13: the conversions (float to float) also cast integer, bool and complex tensors the op itself
    refuses, and served them (a complex state without its imaginary part)."""
    cu = torch.tensor([0, 70, 130])
    call = chunk_call(cu, cu.clone(), output_final_state=True)
    call["initial_state"] = torch.randn(2, HV, V, K)
    call[name] = (call[name] * 3).to(dtype)
    fkda_fla._VERDICTS.clear()
    ok, why = fkda_fla.chunk_kda_verifier(**call)
    assert not ok and "floating-point" in why, why


@pytest.mark.parametrize("chunk", [64.0, torch.tensor(64)], ids=["float", "tensor"])
def test_chunk_size_that_only_equals_64_is_refused(chunk):
    """Campaign 13: 64.0 or tensor(64) passed `in (32, 64)` and reached the op as checkpoint_every, whose error named
    an argument the caller never passed; fla runs such a call itself."""
    cu = torch.tensor([0, 70, 130])
    call = chunk_call(cu, cu.clone(), output_final_state=True, return_intermediate_states=True, chunk_size=chunk)
    fkda_fla._VERDICTS.clear()
    ok, why = fkda_fla.chunk_kda_verifier(**call)
    assert not ok and "chunk_size" in why and "checkpoint_every" not in why, why
