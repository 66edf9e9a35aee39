"""GPU tests of kda_verify's draft trees (parent_tokens [N, T_max]: token t continues from the state stored
after token parent_tokens[n, t]) on every register-store CUDA kda_verify module, and the bulk-copy modules'
refusal. Per module, on fresh random trees (outputs NaN-poisoned): against the reference; every token
bitwise the last token of its root path run as a chain by the same module (a tree changes where a token
starts, nothing else); parents t - 1 bitwise the call without parent_tokens; parents the kernel cannot
serve (>= t, negative, a parent whose state is not stored) make the request padding, its slots untouched
and the other requests as without it. Through the op: trees at every band of jit/routes/kda_verify.json
(fp32 and bf16 state) agree with the reference. Run: python3 -m pytest -q tests/gpu/test_verify_tree_gpu.py
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import flashkda_ext  # noqa: E402
from gpu_common import bits, prebuild_selected, sdtype  # noqa: E402
from test_verify_gpu import RECORDS, V, call_module, check, make, reference  # noqa: E402

BULK = [n for n, r in RECORDS.items() if r["params"].get("bulk_state")]
TREE_NAMES = [n for n in RECORDS if n not in BULK]


@pytest.fixture(scope="module", autouse=True)
def _prebuild(request):
    prebuild_selected(request)


def random_parents(gen, lens, cols):
    """[N, T_max] int32: token t >= 1 of request n gets a random parent in [0, t); column 0 and the
    columns past the request's length hold junk (never read)."""
    cpu = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=gen, device=gen.device)))
    par = torch.randint(-9, 99, (len(lens), cols), generator=cpu, dtype=torch.int32)
    for n, L in enumerate(lens):
        for t in range(1, L):
            par[n, t] = int(torch.randint(0, t, (1,), generator=cpu))
    return par.cuda()


def tree_case(gen, lens, cols, name, H=4, HV=4, gate="softplus"):
    """make()'s call with every slot of the table live (a parent's state must be stored) and random parents."""
    a = make(gen, lens, cols, H, HV, sdtype(RECORDS[name]), gate)
    a["parent_tokens"] = random_parents(gen, lens, cols)
    return a


def run(name, a, gate="softplus"):
    T, HV = a["v"].shape[1], a["v"].shape[2]
    out = torch.full((1, T, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    call_module(name, a, out, gate)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("cols", [3, 4, 8, 12])
@pytest.mark.parametrize("name", TREE_NAMES)
def test_tree_matches_reference(name, cols):
    gen = torch.Generator(device="cuda").manual_seed(4200 + cols)
    lens = {3: [3, 1, 2, 3], 4: [4, 2, 4, 3], 8: [8, 5, 1, 8, 7], 12: [12, 9, 1, 12]}[cols]
    for gate, H, HV in (("softplus", 4, 4), ("bounded", 2, 8)):
        a = tree_case(gen, lens, cols, name, H, HV, gate)
        pool0 = a["state"].clone()
        ref_out, ref_pool = reference(a, gate, parent_tokens=a["parent_tokens"].cpu())
        out = run(name, a, gate)
        check(a, pool0, out, ref_out, ref_pool, f"{name} tree T_max={cols} {gate}")


@pytest.mark.parametrize("name", TREE_NAMES)
def test_every_token_equals_its_root_path_as_a_chain_bitwise(name):
    gen = torch.Generator(device="cuda").manual_seed(77)
    lens, cols = [6, 4], 6
    a = tree_case(gen, lens, cols, name)
    par = a["parent_tokens"].cpu()
    pool0 = a["state"].clone()
    out = run(name, a)
    starts = [0, lens[0]]
    for n, L in enumerate(lens):
        read = a["state_indices"][n, int(a["num_accepted_tokens"][n]) - 1]
        for t in range(L):
            path = [t]
            while path[-1] > 0:
                path.append(int(par[n, path[-1]]))
            path = path[::-1]  # 0 .. t
            rows = torch.tensor([starts[n] + j for j in path], device="cuda")
            P = len(path)
            slots = torch.arange(P, dtype=torch.int32, device="cuda") + 1
            state = torch.zeros(P + 1, *pool0.shape[1:], dtype=pool0.dtype, device="cuda")
            state[1] = pool0[read]
            b = dict(q=a["q"][:, rows], k=a["k"][:, rows], v=a["v"][:, rows], g=a["g"][:, rows],
                     beta=a["beta"][:, rows], A_log=a["A_log"], dt_bias=a["dt_bias"], state=state,
                     state_indices=slots.view(1, P), num_accepted_tokens=torch.ones(1, dtype=torch.int32, device="cuda"),
                     cu_seqlens=torch.tensor([0, P], dtype=torch.int32, device="cuda"))
            o = run(name, b)
            assert torch.equal(bits(o[0, P - 1]), bits(out[0, starts[n] + t])), (name, n, t, path)
            dst = int(a["state_indices"][n, t])
            assert torch.equal(bits(b["state"][P]), bits(a["state"][dst])), (name, n, t, "state")


@pytest.mark.parametrize("name", TREE_NAMES)
def test_chain_parents_equal_no_parents_bitwise(name):
    gen = torch.Generator(device="cuda").manual_seed(5)
    lens, cols = [8, 3, 5, 1, 8], 8
    a = tree_case(gen, lens, cols, name)
    a["parent_tokens"] = (torch.arange(cols, dtype=torch.int32, device="cuda") - 1).repeat(len(lens), 1)
    b = dict(a, parent_tokens=None, state=a["state"].clone())
    out_a, out_b = run(name, a), run(name, b)
    assert torch.equal(bits(out_a), bits(out_b))
    assert torch.equal(bits(a["state"]), bits(b["state"]))


@pytest.mark.parametrize("name", TREE_NAMES)
def test_parents_the_kernel_cannot_serve_make_the_request_padding(name):
    gen = torch.Generator(device="cuda").manual_seed(11)
    lens, cols = [4, 4, 4, 4], 4
    a = tree_case(gen, lens, cols, name)
    a["num_accepted_tokens"].fill_(1)
    par = a["parent_tokens"]
    par[0, 2] = 2          # not before the token
    par[1, 3] = -1         # negative
    par[2, 3] = 1
    a["state_indices"][2, 1] = -1  # request 2's token 3 names token 1, whose state is not stored
    pool0 = a["state"].clone()
    out = run(name, a)
    for n in range(3):
        assert torch.equal(out[0, 4 * n:4 * n + 4], torch.zeros_like(out[0, 4 * n:4 * n + 4])), n
    for s in range(pool0.shape[0]):
        if s not in {int(x) for x in a["state_indices"][3]}:
            assert torch.equal(bits(a["state"][s]), bits(pool0[s])), s
    # request 3 as served alone
    b = dict(a, state=pool0.clone())
    for key in ("q", "k", "v", "g", "beta"):
        b[key] = a[key][:, 12:16]
    b.update(state_indices=a["state_indices"][3:4].clone(), num_accepted_tokens=a["num_accepted_tokens"][3:4].clone(),
             cu_seqlens=torch.tensor([0, 4], dtype=torch.int32, device="cuda"), parent_tokens=par[3:4].clone())
    o = run(name, b)
    assert torch.equal(bits(o[0]), bits(out[0, 12:16]))
    assert torch.equal(bits(b["state"]), bits(a["state"]))


@pytest.mark.parametrize("name", BULK)
def test_bulk_modules_refuse_a_tree_and_write_nothing(name):
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = tree_case(gen, [3, 2], 3, name)
    pool0 = a["state"].clone()
    out = torch.full((1, 5, 4, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="parent_tokens"):
        call_module(name, a, out)
    torch.cuda.synchronize()
    assert out.isnan().all()
    assert torch.equal(bits(a["state"]), bits(pool0))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,HV,cols", [(2, 4, 4), (4, 8, 4), (8, 8, 3), (16, 8, 4), (12, 16, 4), (24, 16, 4),
                                       (16, 16, 6), (64, 8, 4)])
def test_op_serves_trees_at_every_band(state_dtype, N, HV, cols):
    """Through the public op (routes: no bulk-copy module for a tree) at work items 8 .. 512."""
    gen = torch.Generator(device="cuda").manual_seed(N * 100 + HV + cols)
    lens = [cols - (n % 2) for n in range(N)]
    name = next(n for n in TREE_NAMES if sdtype(RECORDS[n]) == state_dtype)
    a = tree_case(gen, lens, cols, name, H=HV // 2, HV=HV, gate="bounded")
    pool0 = a["state"].clone()
    ref_out, ref_pool = reference(a, "bounded", parent_tokens=a["parent_tokens"].cpu())
    out = torch.full((1, sum(lens), HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    flashkda_ext.kda_verify(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"],
                            state_indices=a["state_indices"], cu_seqlens=a["cu_seqlens"],
                            num_accepted_tokens=a["num_accepted_tokens"], A_log=a["A_log"], dt_bias=a["dt_bias"],
                            gate="bounded", lower_bound=-5.0, out=out, parent_tokens=a["parent_tokens"])
    check(a, pool0, out, ref_out, ref_pool, f"op tree N={N} HV={HV} T_max={cols} {state_dtype}")
