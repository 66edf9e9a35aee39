"""Bad-input campaign 17 (CPU only): context-parallel prefill driven as an integrator drives it, over a real
torch.distributed process group (gloo: a one-process group here, two spawned processes below, every collective
under a gloo timeout and every spawn under a deadline, so a deadlock fails instead of hanging), and
flashkda_ext.supported. plan.py and summary.py were campaign 14's. Each case failed before its fix, except those
marked "guard".

- context_parallel.exchange: cp_prefill's group= was handed to torch unchecked: a list of ranks failed as
  "unhashable type: 'list'", a rank number or a str as "Group 0 is not registered", a destroyed group (or one of
  an earlier default group) as "Group <...> is not registered", none naming the argument. Now TypeError /
  ValueError naming group, on every rank that passes it (each refuses locally, before any collective).
- supported: a supported.json that is not JSON (or not UTF-8) raised a bare JSONDecodeError / UnicodeDecodeError
  naming no file (the spec registry reads it too: a broken test tree said nothing of where); a family or backend
  that is not a str failed as an unhashable dict key (a list, a dict) or read as "no entry" (None, an int).
  Now ValueError naming the file, TypeError naming the argument. A misspelt key in a backend entry (the schema's
  backend object took any key) was never read: jit/schema/supported.schema.json now refuses it, naming where.
- context_parallel: with an NCCL group the exchange ran on the current CUDA device whatever device the inputs were
  on (all ranks' buffers on GPU 0 where an integrator never called set_device): a q on another GPU is now refused
  naming q and the device to set, inside the agreement round.
"""
from __future__ import annotations

import datetime
import json

import pytest
import torch
import torch.distributed as dist

from flashkda_ext import context_parallel as cp
from flashkda_ext import paths, supported
from gloo_ranks import one_rank_fixture, outcome as _outcome, ranks_fixture

H, HV, K, V = 1, 2, 8, 4       # grouped value heads, K != V
GLOO_TIMEOUT = datetime.timedelta(seconds=5)   # a collective no rank joins fails after this, never hangs
SPAWN_DEADLINE_S = 60


def inputs(cu, seed=1700, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    T = cu[-1]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    d = dict(q=randn(1, T, H, K), k=randn(1, T, H, K), v=randn(1, T, HV, V), g=randn(1, T, HV, K),
             beta=randn(1, T, HV))
    gate = dict(A_log=torch.rand(HV, generator=gen) - 1.0, dt_bias=torch.randn(HV * K, generator=gen))
    return d, gate


def mine(d, p, rank):
    a, b = p.token_range(rank)
    return [d[n][:, a:b].clone() for n in ("q", "k", "v", "g", "beta")]


def raises_twice(exc, match, fn):
    """The same named error on the first call and on a repeated one."""
    for _ in range(2):
        with pytest.raises(exc, match=match):
            fn()


def bitwise_equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool((a.view(torch.uint8) == b.view(torch.uint8)).all())


# ---------------------------------------------------------------------------------------------
# a one-process gloo group (world size 1)


world1 = one_rank_fixture(GLOO_TIMEOUT.total_seconds())


CU1 = [0, 3, 3, 9]   # an empty sequence


@pytest.mark.parametrize("group", [[0], 0, "gloo", object()], ids=["ranks_list", "rank_int", "str", "object"])
def test_cp_prefill_refuses_a_group_that_is_not_a_process_group(world1, group):
    d, gate = inputs(CU1)
    p = cp.plan(CU1, 1)
    raises_twice(TypeError, r"group: expected a torch.distributed ProcessGroup",
                 lambda: cp.cp_prefill(*mine(d, p, 0), plan=p, group=group, **gate))


def test_cp_prefill_refuses_a_destroyed_group(world1):
    d, gate = inputs(CU1)
    p = cp.plan(CU1, 1)
    gone = dist.new_group([0])
    dist.destroy_process_group(gone)
    raises_twice(ValueError, r"group: not a process group of the current torch.distributed world",
                 lambda: cp.cp_prefill(*mine(d, p, 0), plan=p, group=gone, **gate))


def test_cp_prefill_live_groups_guard(world1):
    """guard: None, group.WORLD and a live new_group of the one rank all run, bitwise simulate()'s result."""
    d, gate = inputs(CU1)
    p = cp.plan(CU1, 1)
    h0 = torch.randn(3, HV, V, K)
    sim = cp.simulate(*(d[n] for n in ("q", "k", "v", "g", "beta")), plan=p, initial_state=h0, **gate)[0]
    for group in (None, dist.group.WORLD, dist.new_group([0])):
        out, final = cp.cp_prefill(*mine(d, p, 0), plan=p, group=group, initial_state=h0, **gate)
        assert bitwise_equal(out, sim[0]) and bitwise_equal(final, sim[1])


def test_an_input_on_another_gpu_than_the_nccl_exchange_is_refused_naming_it():
    """The exchange's device rule (NCCL runs on the current CUDA device; no GPU here, so the rule is checked on
    devices, not tensors): a CUDA input on another GPU is refused naming it; the same GPU, a CPU input, or a gloo
    exchange (on the CPU) with any input pass."""
    nccl = object.__new__(cp.exchange.GroupExchange)
    nccl.device = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"^q: on cuda:1, but this rank's NCCL exchange runs on .*cuda:0.*set_device"):
        nccl.check_device("q", torch.device("cuda", 1))
    nccl.check_device("q", torch.device("cuda", 0))
    nccl.check_device("q", torch.device("cpu"))
    gloo = object.__new__(cp.exchange.GroupExchange)
    gloo.device = torch.device("cpu")
    gloo.check_device("q", torch.device("cuda", 1))


def test_cp_prefill_checks_q_against_the_exchange_device_before_any_collective(world1, monkeypatch):
    """cp_prefill hands q's device to the rule inside the agreement round (so every rank hears of a refusal)."""
    seen = []
    monkeypatch.setattr(cp.exchange.GroupExchange, "check_device",
                        lambda self, name, device: seen.append((name, device)))
    d, gate = inputs(CU1)
    p = cp.plan(CU1, 1)
    cp.cp_prefill(*mine(d, p, 0), plan=p, **gate)
    assert seen == [("q", torch.device("cpu"))]


# ---------------------------------------------------------------------------------------------
# two spawned gloo processes: every scenario once, outcomes kept per scenario and rank


def _scenarios(rank, world):
    """{name: outcome} for this rank; each value is picklable. Every scenario is made by every rank."""
    res = {}
    CU = [0, 5, 12]
    d, gate = inputs(CU)
    p = cp.plan(CU, world)          # cut at token 6, inside sequence 1
    x = mine(d, p, rank)
    whole = [d[n] for n in ("q", "k", "v", "g", "beta")]

    # defect: a list of ranks as group, on every rank; then a valid call on the same world still runs
    res["group_list"] = [_outcome(lambda: cp.cp_prefill(*x, plan=p, group=list(range(world)), **gate))
                         for _ in range(2)]

    def valid():
        out, final = cp.cp_prefill(*x, plan=p, **gate)
        sim = cp.simulate(*whole, plan=p, **gate)[rank]
        return bitwise_equal(out, sim[0]) and bitwise_equal(final, sim[1])
    res["after_group_list"] = _outcome(valid)

    # guard: a plan for another world size on rank 1 only: it names the plan, rank 0 names rank 1
    p3 = cp.plan(CU, world + 1)
    res["plan_world_one_rank"] = _outcome(lambda: cp.cp_prefill(*x, plan=p3 if rank == 1 else p, **gate))

    # guard: state dtypes that differ between ranks (float64 on rank 0): refused on both, pool unwritten
    pool = torch.randn(3, HV, V, K, dtype=torch.float64 if rank == 0 else torch.float32)
    before = pool.clone()
    idx = torch.tensor([2, 0], dtype=torch.int32)
    res["state_dtype_differs"] = _outcome(lambda: cp.cp_prefill(*x, plan=p, state=pool, state_indices=idx, **gate))
    res["state_dtype_differs_pool_kept"] = bitwise_equal(pool, before)

    # guard: fewer tokens than ranks (rank 0 empty) and an empty prompt, with checkpoints: bitwise simulate()
    for name, cu_small in (("shorter_than_ranks", [0, 1]), ("empty_prompt", [0, 0, 0])):
        ds, gs = inputs(cu_small)
        ps = cp.plan(cu_small, world)
        h0 = torch.randn(len(cu_small) - 1, HV, V, K, generator=torch.Generator().manual_seed(17))

        def run_small():
            got = cp.cp_prefill(*mine(ds, ps, rank), plan=ps, initial_state=h0, checkpoint_every=1, **gs)
            sim = cp.simulate(*(ds[n] for n in ("q", "k", "v", "g", "beta")), plan=ps, initial_state=h0,
                              checkpoint_every=1, **gs)[rank]
            return [bitwise_equal(a, b) for a, b in zip(got, sim)] + [list(got[0].shape)]
        res[name] = _outcome(run_small)
    return res


# each rank's results from one spawn of two gloo processes (tests/gloo_ranks.py: killed, and the test failed, past
# its deadline)
gloo2 = ranks_fixture(_scenarios, world=2, gloo_timeout_s=GLOO_TIMEOUT.total_seconds(), deadline_s=SPAWN_DEADLINE_S)


def test_gloo_every_rank_refuses_a_list_of_ranks_as_group(gloo2):
    for rank, res in enumerate(gloo2):
        for kind, msg in res["group_list"]:   # the first call and a repeated one
            assert kind == "TypeError" and "group: expected a torch.distributed ProcessGroup" in msg, \
                f"rank {rank}: {kind}: {msg}"
        assert res["after_group_list"] == ("ok", True), f"rank {rank}: {res['after_group_list']}"


def test_gloo_plan_for_another_world_size_on_one_rank_guard(gloo2):
    kind0, msg0 = gloo2[0]["plan_world_one_rank"]
    kind1, msg1 = gloo2[1]["plan_world_one_rank"]
    assert kind1 == "ValueError" and "plan: made for world_size = 3, but the group has 2 ranks" in msg1, msg1
    assert kind0 == "ValueError" and "rank(s) [1] refused their arguments" in msg0, msg0


def test_gloo_state_dtype_differing_between_ranks_guard(gloo2):
    for rank, res in enumerate(gloo2):
        kind, msg = res["state_dtype_differs"]
        assert kind == "ValueError" and "different plans or arguments" in msg, f"rank {rank}: {kind}: {msg}"
        assert res["state_dtype_differs_pool_kept"], f"rank {rank}: a refused call wrote its pool"


@pytest.mark.parametrize("name, tokens", [("shorter_than_ranks", [0, 1]), ("empty_prompt", [0, 0])])
def test_gloo_fewer_tokens_than_ranks_guard(gloo2, name, tokens):
    for rank, res in enumerate(gloo2):
        kind, got = res[name]
        assert kind == "ok", f"rank {rank}: {kind}: {got}"
        assert got[:3] == [True, True, True], f"rank {rank}: out / final / checkpoints differ from simulate()"
        assert got[3] == [1, tokens[rank], HV, V], f"rank {rank}: out shape {got[3]}"


# ---------------------------------------------------------------------------------------------
# supported


def _tree(tmp_path, content: bytes):
    (tmp_path / "jit").mkdir()
    path = tmp_path / "jit" / "supported.json"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("content", [b"{not json", b'{"description": "x", "families": {}', b"\xff\xfe\x00{}"],
                         ids=["not_json", "truncated", "not_utf8"])
def test_supported_names_a_file_that_is_not_json(tmp_path, content):
    path = _tree(tmp_path, content)
    want = f"{path.resolve()}: not valid JSON"
    raises_twice(ValueError, want, lambda: supported.supported("kda_prefill", "cpu", tmp_path))
    raises_twice(ValueError, want, lambda: supported.families(tmp_path))


@pytest.mark.parametrize("family, backend, name", [
    (["kda_prefill"], "cpu", "family"), (None, "cpu", "family"), (1, "cpu", "family"),
    ("kda_prefill", ["cpu"], "backend"), ("kda_prefill", {}, "backend"), ("kda_prefill", None, "backend"),
])
def test_supported_refuses_a_family_or_backend_that_is_not_a_str(family, backend, name):
    raises_twice(TypeError, f"{name}: expected a str", lambda: supported.supported(family, backend))


def test_supported_names_guard(tmp_path):
    """guard: a well-formed tree still loads, and a str without an entry is still None."""
    sup = supported.supported("kda_prefill", "cpu")
    assert sup["state_dtypes"] == ["float32", "float64", "bfloat16"]
    assert supported.supported("no_such_family", "cpu") is None and supported.supported("kda_prefill", "tpu") is None


def test_supported_refuses_an_unknown_key_in_a_backend_entry(tmp_path):
    """A misspelt key of a backend entry (state_dtype for state_dtypes beside the right one) was let through by
    the schema and never read: now the file is refused naming where."""
    real = json.loads((paths.jit_dir() / "supported.json").read_text())
    real["families"]["kda_prefill"]["cpu"]["state_dtype"] = ["float32"]
    _tree(tmp_path, json.dumps(real).encode())
    raises_twice(ValueError, r"at families/kda_prefill/cpu: .*state_dtype.*\(rule: additionalProperties\)",
                 lambda: supported.supported("kda_prefill", "cpu", tmp_path))
