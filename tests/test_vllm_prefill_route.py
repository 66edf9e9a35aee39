"""vLLM's chunk prefills route by their longest sequence, read from vLLM's own step metadata
(flashkda_ext/integrations/vllm/host_lengths.py), against the real vLLM 0.34.0 code: the layers' and the metadata
builders' sources, and the forward context, GDNAttentionMetadata and compute_causal_conv1d_metadata compiled from
the wheel (scripts/vllm_step_metadata.py)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

import vllm_wheel
from vllm_wheel import real, seen, tree  # noqa: F401  (fixtures)
from flashkda_ext import dispatch, validation
from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.integrations.vllm import host_lengths
from flashkda_ext.reference import kda_recurrent

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import vllm_step_metadata  # noqa: E402

H, K, V = 8, 8, 8
TOL = dict(rtol=2e-5, atol=2e-5)
SITE = "k3.chunk_kda_with_fused_gate"
BY_METADATA = "longest from vLLM's metadata"
APART = "longest from vLLM's metadata, decodes apart"
LAYERS = {"vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn": "chunk_kda_with_fused_gate",
          "vllm.models.kimi_k3.nvidia.kda": "chunk_kda_with_fused_gate",
          "vllm.model_executor.models.bailing_moe_v3": "chunk_kda"}
BUILDERS = ("vllm.v1.attention.backends.gdn_attn", "vllm.models.kimi_k3.nvidia.kda_metadata")


@pytest.fixture
def installed(real, tree):
    """The real modules with the adapters installed, and the step metadata compiled from the wheel."""
    real.step = vllm_step_metadata.load(tree)
    fkda_vllm.install()
    return real


# ---------------------------------------------------------------------------------------------
# the sources: what the lookup relies on


def _function_with_call(tree_src, callee):
    """The innermost function definitions that call `callee` by name."""
    return [f for f in ast.walk(tree_src) if isinstance(f, ast.FunctionDef)
            and any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == callee
                    for n in ast.walk(f))
            and not any(isinstance(g, ast.FunctionDef) and g is not f and any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == callee for n in ast.walk(g))
                for g in ast.walk(f))]


@pytest.mark.parametrize("module", LAYERS)
def test_the_layers_pass_the_metadatas_non_spec_offsets_as_cu_seqlens(tree, module):
    """Each chunk call's cu_seqlens is a name bound to `<metadata>.non_spec_query_start_loc` in the same function:
    the object host_lengths finds in the forward context."""
    src = ast.parse(vllm_wheel.source(tree, module))
    callee = LAYERS[module]
    functions = _function_with_call(src, callee)
    assert functions, f"{module} no longer calls {callee}"
    for f in functions:
        bound = {t.id for n in ast.walk(f) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute)
                 and n.value.attr == "non_spec_query_start_loc" for t in n.targets if isinstance(t, ast.Name)}
        for call in (n for n in ast.walk(f) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                     and n.func.id == callee):
            cu = next(kw.value for kw in call.keywords if kw.arg == "cu_seqlens")
            assert isinstance(cu, ast.Name) and cu.id in bound, (module, ast.unparse(cu), bound)


@pytest.mark.parametrize("module", BUILDERS)
def test_the_builders_count_conv_blocks_from_the_host_copy_of_those_offsets(tree, module):
    """GDN's and K3's metadata builders: nums_dict comes from non_spec_query_start_loc_cpu, the metadata's
    non_spec_query_start_loc is the device name of that pair, and every block that sets one name sets the other."""
    src = ast.parse(vllm_wheel.source(tree, module))
    build = next(f for f in ast.walk(src) if isinstance(f, ast.FunctionDef) and f.name == "build")
    conv = [n for n in ast.walk(build) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == "compute_causal_conv1d_metadata"]
    assert conv and all(isinstance(c.args[0], ast.Name) and c.args[0].id == "non_spec_query_start_loc_cpu"
                        for c in conv)
    made = [kw.value for n in ast.walk(build) if isinstance(n, ast.Call) for kw in n.keywords
            if kw.arg == "non_spec_query_start_loc"]
    assert made and all(isinstance(v, ast.Name) and v.id == "non_spec_query_start_loc" for v in made)
    pair = {"non_spec_query_start_loc", "non_spec_query_start_loc_cpu"}
    staged = [n for n in ast.walk(build) if isinstance(n, ast.If) and "_stage_decode" in ast.unparse(n.test)]
    if staged:
        # GDN's decode-only staging into the CUDA-graph buffers sets the device offsets alone; it runs only
        # without prefills, so nums_dict is None there and no chunk call is made
        stage = next(f for f in ast.walk(src) if isinstance(f, ast.FunctionDef) and f.name == "_stage_decode")
        assert "num_prefills == 0" in ast.unparse(stage)
    for node in ast.walk(build):
        if node in staged:
            continue
        for body in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if not isinstance(body, list):
                continue
            set_here = {t.id for s in body if isinstance(s, ast.Assign) for t in s.targets
                        if isinstance(t, ast.Name) and t.id in pair}
            assert set_here in (set(), pair), (module, getattr(body[0], "lineno", None), set_here)


# ---------------------------------------------------------------------------------------------
# the lookup on the real metadata


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_is_the_longest_rounded_up_to_eight(installed, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 300, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
    lengths[int(torch.randint(0, len(lengths), (1,), generator=gen))] = 1 + seed * 97    # one longer request
    m = vllm_step_metadata.step(installed.step, lengths, "cpu")
    T = sum(lengths)
    with vllm_step_metadata.forward(installed.step, {"model.layers.0.attn": m}):
        bound, how = host_lengths.longest(m.non_spec_query_start_loc, T)
    assert how == "vllm metadata"
    assert max(lengths) <= bound <= max(lengths) + 7 and bound <= T
    assert bound == min(T, -(-max(lengths) // 8) * 8)


def test_the_lookup_says_why_it_has_no_bound(installed):
    m = vllm_step_metadata.step(installed.step, [1, 1, 40], "cpu")
    cu = m.non_spec_query_start_loc
    assert host_lengths.longest(cu, 42) == (None, "vllm.forward_context is not loaded")
    with vllm_step_metadata.forward(installed.step, {"a": m}):
        assert host_lengths.longest(cu.clone(), 42)[1].startswith("cu_seqlens is not the non_spec_query_start_loc")
        assert host_lengths.longest(cu, 42) == (40, "vllm metadata")
    with installed.step.forward_context.override_forward_context(None):
        sys.modules["vllm.forward_context"] = installed.step.forward_context
        try:
            assert host_lengths.longest(cu, 42) == (None, "no vLLM forward context is set")
        finally:
            del sys.modules["vllm.forward_context"]
    decode_only = vllm_step_metadata.step(installed.step, [1, 1, 1], "cpu")
    decode_only.nums_dict = None                  # the builders leave it None without a prefill
    with vllm_step_metadata.forward(installed.step, {"a": decode_only}):
        assert "no host nums_dict" in host_lengths.longest(decode_only.non_spec_query_start_loc, 3)[1]
    other = vllm_step_metadata.step(installed.step, [5, 6], "cpu")
    m.nums_dict = other.nums_dict                 # counts of other offsets: refused, not trusted
    with vllm_step_metadata.forward(installed.step, {"a": m}):
        assert "counts 2 requests, cu_seqlens 3" in host_lengths.longest(cu, 42)[1]


def test_a_forward_context_given_new_metadata_is_read_again(installed):
    """The lookup is cached per forward context and its metadata: new metadata on the same context (even holding
    the same offsets tensor) is read again, not answered from the cache."""
    m = vllm_step_metadata.step(installed.step, [1, 1, 40], "cpu")
    with vllm_step_metadata.forward(installed.step, {"a": m}) as ctx:
        assert host_lengths.longest(m.non_spec_query_start_loc, 42) == (40, "vllm metadata")
        again = vllm_step_metadata.step(installed.step, [1, 17, 24], "cpu")
        again.non_spec_query_start_loc = m.non_spec_query_start_loc
        ctx.attn_metadata = {"a": again}
        assert host_lengths.longest(m.non_spec_query_start_loc, 42) == (24, "vllm metadata")


def test_dual_batch_overlap_finds_each_microbatchs_metadata(installed):
    a = vllm_step_metadata.step(installed.step, [1, 1, 30], "cpu")
    b = vllm_step_metadata.step(installed.step, [3, 70], "cpu")
    with vllm_step_metadata.forward(installed.step, [{"l0": a, "l1": a}, {"l0": b, "l1": b}]):
        assert host_lengths.longest(a.non_spec_query_start_loc, 32) == (32, "vllm metadata")
        assert host_lengths.longest(b.non_spec_query_start_loc, 73) == (72, "vllm metadata")
        assert host_lengths.longest(a.non_spec_query_start_loc, 32) == (32, "vllm metadata")


# ---------------------------------------------------------------------------------------------
# the served call and its route


def mixed_step(decodes, prompt, lower_bound, seed=0):
    """vLLM's usual prefill step: `decodes` one-token requests, then one prompt chunk (the layer's call)."""
    lengths = [1] * decodes + [prompt]
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    call = dict(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
                v=torch.randn(1, T, H, V, generator=gen), raw_g=torch.randn(1, T, H, K, generator=gen),
                raw_beta=torch.randn(1, T, H, generator=gen), A_log=torch.randn(H, generator=gen) * 0.5,
                g_bias=torch.randn(H * K, generator=gen) * 0.5, lower_bound=lower_bound,
                initial_state=torch.randn(N, H, V, K, generator=gen) * 0.3, output_final_state=True,
                use_qk_l2norm_in_kernel=True)
    return lengths, call


# the fused 16-token-chunk kernel unsplit: prefill_c16ws_* for the bounded gate (split by role), prefill_c16_* else
FUSED = ("prefill_c16_", "prefill_c16ws_")


def cuda_route(lengths, max_seqlen, gate, lower_bound):
    """The module a CUDA call of these lengths takes (H value heads, fp32 state), routed on the host."""
    meta = validation.prefill_route_meta("cuda", len(lengths), H, sum(lengths), max_seqlen, "f32", "o32", gate,
                                         False, lower_bound)
    return dispatch.module_name("kda_prefill", meta)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_a_mixed_step_is_served_and_routed_by_its_prompt_not_the_mean(installed, seen, lower_bound):
    lengths, call = mixed_step(48, 300, lower_bound)
    m = vllm_step_metadata.step(installed.step, lengths, "cpu")
    call["cu_seqlens"] = m.non_spec_query_start_loc
    before = fkda_vllm.ROUTED[SITE, APART]
    with vllm_step_metadata.forward(installed.step, {"model.layers.1.self_attn": m, "model.layers.2.self_attn": m}):
        o, h = installed.k3.chunk_kda_with_fused_gate(**call)
    assert fkda_vllm.ROUTED[SITE, APART] == before + 1
    # two calls (host_lengths.step_parts): the 48 decodes, then the prompt (its bound, 300 tokens rounded up to
    # vLLM's conv block of 8, capped at the part's 300 tokens), its offsets rebased
    assert [c["max_seqlen"] for c in seen[-2:]] == [1, 300]
    assert seen[-2]["cu_seqlens"].tolist() == list(range(49)) and seen[-1]["cu_seqlens"].tolist() == [0, 300]
    gate = dict(gate="softplus") if lower_bound is None else dict(gate="bounded", lower_bound=lower_bound)
    want_o, want_h, _ = kda_recurrent(call["q"], call["k"], call["v"], call["raw_g"], call["raw_beta"],
                                      A_log=call["A_log"], dt_bias=call["g_bias"], cu_seqlens=call["cu_seqlens"],
                                      initial_state=call["initial_state"], **gate)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(h.double(), want_h, **TOL)
    # on a GPU: by the mean (7 tokens) the step is the fused 16-token kernel's band, whose one CTA would walk the
    # 300-token prompt alone; by its longest it leaves that band, and alone the prompt routes as one sequence
    name = "bounded" if lower_bound is not None else "softplus"
    assert cuda_route(lengths, None, name, lower_bound).startswith(FUSED)
    assert not cuda_route(lengths, 304, name, lower_bound).startswith(FUSED)
    assert not cuda_route([300], 304, name, lower_bound).startswith(FUSED)


def test_a_uniform_step_keeps_the_fused_kernel(installed, seen):
    lengths = [64] * 48
    _, call = mixed_step(0, 1, -5.0)
    gen = torch.Generator().manual_seed(1)
    T, N = sum(lengths), len(lengths)
    call.update(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
                v=torch.randn(1, T, H, V, generator=gen), raw_g=torch.randn(1, T, H, K, generator=gen),
                raw_beta=torch.randn(1, T, H, generator=gen), initial_state=torch.randn(N, H, V, K, generator=gen))
    m = vllm_step_metadata.step(installed.step, lengths, "cpu")
    call["cu_seqlens"] = m.non_spec_query_start_loc
    with vllm_step_metadata.forward(installed.step, {"l": m}):
        installed.k3.chunk_kda_with_fused_gate(**call)
    assert seen[-1]["max_seqlen"] == 64
    assert cuda_route(lengths, 64, "bounded", -5.0).startswith(FUSED)


def test_without_a_forward_context_the_call_routes_by_the_mean_and_says_why(installed, seen):
    lengths, call = mixed_step(3, 20, -5.0)
    call["cu_seqlens"] = torch.tensor([0, 1, 2, 3, 23], dtype=torch.int32)
    key = (SITE, "by the mean: vllm.forward_context is not loaded")
    before = fkda_vllm.ROUTED[key]
    installed.k3.chunk_kda_with_fused_gate(**call)
    assert seen[-1]["max_seqlen"] is None and fkda_vllm.ROUTED[key] == before + 1


@pytest.mark.parametrize("decodes,final", [(10, True), (0, True), (10, False)], ids=["mixed", "prompts", "no-final"])
def test_bailings_vendored_chunk_is_routed_the_same_way(installed, seen, decodes, final):
    """vLLM's vendored chunk_kda (bailing_moe_v3): routed by its longest request, the step's one-token decodes served
    apart from its prompts (two kda_prefill calls), the result the float64 reference's over the whole step."""
    lengths, call = mixed_step(decodes, 45, None, seed=4)
    m = vllm_step_metadata.step(installed.step, lengths, "cpu")
    g = -torch.rand(1, sum(lengths), H, K)
    beta = torch.sigmoid(call["raw_beta"])
    how = APART if decodes else BY_METADATA
    before = fkda_vllm.ROUTED["vendored.chunk_kda", how]
    with vllm_step_metadata.forward(installed.step, {"l": m}):
        o, h = installed.vendored.chunk_kda(q=call["q"], k=call["k"], v=call["v"], g=g, beta=beta,
                                       initial_state=call["initial_state"], output_final_state=final,
                                       use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                       cu_seqlens=m.non_spec_query_start_loc)
    assert fkda_vllm.ROUTED["vendored.chunk_kda", how] == before + 1
    if decodes:   # the decodes' call, then the prompt's, its offsets rebased
        assert [c["max_seqlen"] for c in seen[-2:]] == [1, 45] and seen[-1]["cu_seqlens"].tolist() == [0, 45]
        assert seen[-2]["cu_seqlens"].tolist() == list(range(decodes + 1))
    else:
        assert seen[-1]["max_seqlen"] == 45
    want_o, want_h, _ = kda_recurrent(call["q"], call["k"], call["v"], g, beta, gate="log", beta_is_logit=False,
                                      cu_seqlens=m.non_spec_query_start_loc, initial_state=call["initial_state"])
    torch.testing.assert_close(o.double(), want_o, **TOL)
    if final:
        torch.testing.assert_close(h.double(), want_h, **TOL)
    else:
        assert h is None


# ---------------------------------------------------------------------------------------------
# the step's decodes apart from its prompts (host_lengths.step_parts)


@pytest.mark.parametrize("lengths,parts", [
    ([1, 1, 1, 40, 9], [(0, 3, 0, 3, 1), (3, 52, 3, 5, 40)]),       # vLLM's order: decodes, then prompts
    ([1, 90, 0, 0], [(0, 1, 0, 1, 1), (1, 91, 1, 4, 90)]),           # CUDA-graph padding after the prompt
    ([40, 9], [(0, 49, 0, 2, 40)]),                                  # no decode: one part
    ([1, 1, 1], [(0, 3, 0, 3, 3)]),                                  # no prompt: one part, bound 8 capped at T
    ([1, 40, 1], [(0, 42, 0, 3, 40)]),                               # a decode after a prompt: not vLLM's order
], ids=["decodes-first", "padding", "prompts", "decodes", "unordered"])
def test_the_parts_of_a_step(installed, lengths, parts):
    m = vllm_step_metadata.step(installed.step, lengths, "cpu")
    with vllm_step_metadata.forward(installed.step, {"l": m}):
        got, how = host_lengths.step_parts(m.non_spec_query_start_loc, sum(lengths))
    assert how == "vllm metadata" and got == parts


def test_a_step_of_decodes_and_prompts_is_served_in_two_calls_as_in_one(installed, seen):
    """The parts' outputs and final states are the one call's (the float64 reference over the whole step)."""
    lengths = [1] * 5 + [37, 64, 0]
    _, call = mixed_step(0, 1, -5.0)
    gen = torch.Generator().manual_seed(7)
    T, N = sum(lengths), len(lengths)
    call.update(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
                v=torch.randn(1, T, H, V, generator=gen), raw_g=torch.randn(1, T, H, K, generator=gen),
                raw_beta=torch.randn(1, T, H, generator=gen), initial_state=torch.randn(N, H, V, K, generator=gen),
                out=torch.full((1, T, H, V), float("nan")))
    m = vllm_step_metadata.step(installed.step, lengths, "cpu")
    call["cu_seqlens"] = m.non_spec_query_start_loc
    with vllm_step_metadata.forward(installed.step, {"l": m}):
        o, h = installed.k3.chunk_kda_with_fused_gate(**call)
    assert [c["max_seqlen"] for c in seen[-2:]] == [1, 64] and o is call["out"]
    want_o, want_h, _ = kda_recurrent(call["q"], call["k"], call["v"], call["raw_g"], call["raw_beta"],
                                      A_log=call["A_log"], dt_bias=call["g_bias"], cu_seqlens=call["cu_seqlens"],
                                      initial_state=call["initial_state"], gate="bounded", lower_bound=-5.0)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(h.double(), want_h, **TOL)


@pytest.mark.parametrize("case", ["padded-tokens", "undercounted-prompt"])
def test_a_step_split_in_parts_whose_later_part_is_refused_falls_back_writing_nothing(real, tree, seen, monkeypatch,
                                                                                       case):
    """Every part is checked before the first launches. The metadata's cut can miss the call: tokens padded past
    the last offset (the prompt's part then runs to T, past its offsets), or nums that undercount the prompt (its
    bound then below its length). Before, the decodes' part was served into out and the prompt's refused, so the
    fallback ran over an out already written."""
    fell = []

    def original(**kw):
        fell.append(kw)
        return "original"
    name = "chunk_kda_with_fused_gate"
    original.__signature__ = __import__("inspect").signature(getattr(real.k3, name))
    monkeypatch.setattr(real.k3, name, original)
    real.step = vllm_step_metadata.load(tree)
    fkda_vllm.install()
    lengths, call = mixed_step(3, 19, -5.0)
    m = vllm_step_metadata.step(real.step, lengths, "cpu")
    T = sum(lengths) + (1 if case == "padded-tokens" else 0)
    if case == "padded-tokens":
        gen = torch.Generator().manual_seed(5)
        call.update({n: torch.cat([call[n], torch.randn(1, 1, *call[n].shape[2:], generator=gen)], dim=1)
                     for n in ("q", "k", "v", "raw_g", "raw_beta")})
    else:
        m.nums_dict[host_lengths.BLOCK]["nums"][-1] = 1     # 8 tokens, the prompt 19
    call.update(cu_seqlens=m.non_spec_query_start_loc, out=torch.randn(1, T, H, V))
    out0, h0 = call["out"].clone(), call["initial_state"].clone()
    before = fkda_vllm.STATS[SITE, "fell_back"]
    with vllm_step_metadata.forward(real.step, {"l": m}):
        assert getattr(real.k3, name)(**call) == "original"
    assert fkda_vllm.STATS[SITE, "fell_back"] == before + 1 and len(fell) == 1
    assert seen == [] and torch.equal(call["out"], out0) and torch.equal(call["initial_state"], h0)
