"""Kimi K3's prefill with prefix-cache checkpoints (vLLM's mamba_cache_mode "align", on with prefix caching), served
by the opt-in adapter (flashkda_ext/integrations/vllm/k3_layer.py) as calls cut at each request's checkpoint, against
the real vLLM 0.34.0 code: `_flashkda_prefill` compiled from the wheel, the checkpoint offsets from the wheel's
compute_mamba_prefill_checkpoints with FlashKDA's alignment, the metadata and forward context from the wheel
(scripts/vllm_step_metadata.py), and the sources that say where the adapter's host offsets come from."""
from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest
import torch

import vllm_wheel
from vllm_wheel import real, real_fn, seen, tree  # noqa: F401  (fixtures)
from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.integrations.vllm import k3_layer
from flashkda_ext.reference import kda_recurrent

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import vllm_step_metadata  # noqa: E402

H, K, V = 2, 8, 8
SITE = k3_layer.SITE
LAYER = "model.layers.0.self_attn"


@pytest.fixture
def step_ns(real, tree):
    return vllm_step_metadata.load(tree)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


def layer_call(m, state_dtype, seed):
    """The K3 layer's call for the step m: cu_seqlens is m's non_spec_query_start_loc and checkpoint_offsets
    m.checkpoint's tensor (the objects the layer passes); outputs and checkpoint buffer poisoned."""
    gen = torch.Generator().manual_seed(seed)
    cu = m.non_spec_query_start_loc
    T, N = int(cu[-1]), cu.shape[0] - 1
    proj = torch.randn(1, T, H + 3, generator=gen)
    return dict(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
                v=torch.randn(1, T, H, V, generator=gen), g=torch.randn(1, T, H, K, generator=gen),
                beta=proj[..., :H], A_log=torch.randn(H, generator=gen) * 0.5,
                dt_bias=torch.randn(H * K, generator=gen) * 0.5, lower_bound=-5.0,
                initial_state=(torch.randn(N, H, V, K, generator=gen) * 0.3).to(state_dtype), cu_seqlens=cu,
                out=torch.full((1, T, H, V), float("nan")),
                final_state=torch.full((N, H, V, K), float("nan"), dtype=state_dtype),
                workspace=torch.empty(64, dtype=torch.uint8),
                checkpoint_state=torch.full((N, H, V, K), float("nan"), dtype=state_dtype),
                checkpoint_offsets=m.checkpoint.checkpoint_offsets)


def reference(call, lengths):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return kda_recurrent(call["q"], call["k"], call["v"], call["g"], call["beta"], gate="bounded", lower_bound=-5.0,
                         A_log=call["A_log"], dt_bias=call["dt_bias"], cu_seqlens=cu,
                         initial_state=call["initial_state"])


def test_the_cut_calls_cover_the_tokens_in_order():
    cut = k3_layer.cut_at_checkpoints
    assert cut([0, 0], [3, 5]) == [(0, 8, 0, 1, [3, 5], False)]
    assert cut([0, 32, 0], [1, 70, 1]) == [(0, 33, 0, 1, [1, 32], False), (33, 72, 1, 2, [38, 1], True)]
    assert cut([16, 0, 48], [20, 0, 50]) == [
        (0, 16, 0, 0, [16], False), (16, 68, 0, 2, [4, 0, 48], True), (68, 70, 2, 2, [2], True)]
    # the step's decodes apart (a break before its first prompt), then the prompt's cut
    assert cut([0, 0, 32, 0], [1, 1, 70, 9], breaks={2}) == [
        (0, 2, 0, 1, [1, 1], False), (2, 34, 2, 2, [32], False), (34, 81, 2, 3, [38, 9], True)]
    assert cut([0, 0], [1, 9], breaks={0}) == [(0, 10, 0, 1, [1, 9], False)]


# ---------------------------------------------------------------------------------------------
# the sources: where the host offsets come from


def test_the_layer_passes_the_metadatas_checkpoint_offsets_and_the_builder_keeps_host_copies(tree):
    """K3's `_forward` passes checkpoint_offsets = checkpoint.checkpoint_offsets with checkpoint = m.checkpoint and
    cu_seqlens = the same m's non_spec_query_start_loc; MambaPrefillCheckpointBuilder.build fills the host lists
    offsets / query_lens from the lists it turned into that tensor."""
    src = ast.parse(vllm_wheel.source(tree, "vllm.models.kimi_k3.nvidia.kda"))
    calls = [n for n in ast.walk(src) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "_flashkda_prefill"
             and any(kw.arg == "checkpoint_offsets" for kw in n.keywords)]
    assert calls
    assigns = {ast.unparse(t): ast.unparse(n.value) for n in ast.walk(src) if isinstance(n, ast.Assign)
               for t in n.targets}
    for c in calls:
        kw = {k.arg: ast.unparse(k.value) for k in c.keywords}
        assert kw["checkpoint_offsets"] == "checkpoint_offsets" and kw["cu_seqlens"] == "non_spec_query_start_loc"
    assert assigns["checkpoint_offsets"] == "checkpoint.checkpoint_offsets" and assigns["checkpoint"] == "m.checkpoint"
    build_src = ast.parse((tree / "vllm/model_executor/layers/mamba/checkpoint.py").read_text())
    build = next(f for f in ast.walk(build_src) if isinstance(f, ast.FunctionDef) and f.name == "build")
    made = next(n for n in ast.walk(build) if isinstance(n, ast.Call) and ast.unparse(n.func) ==
                "MambaPrefillCheckpointMetadata")
    kw = {k.arg: ast.unparse(k.value) for k in made.keywords}
    assert kw == {"offsets": "checkpoint_offsets", "query_lens": "query_lens", "request_rows": "request_rows_tensor",
                  "block_cols": "checkpoint_cols_tensor"}
    assert ast.unparse(made.args[0]) == "checkpoint_offsets_tensor"
    h2d = next(n for n in ast.walk(build) if isinstance(n, ast.Assign)
               and ast.unparse(n.targets[0]) == "checkpoint_offsets_tensor")
    assert ast.unparse(h2d.value.args[0]) == "checkpoint_offsets"


# ---------------------------------------------------------------------------------------------
# served on the real step metadata


STEPS = {   # query lengths, tokens cached before the step (multiples of 16 put checkpoints in reach)
    "decodes+prompt": ([1, 1, 1, 150, 1], [40, 7, 99, 32, 5]),
    "decodes-first": ([1, 1, 1, 150, 70], [40, 7, 99, 32, 0]),    # as vLLM orders a step: its decodes apart
    "two-prompts": ([70, 1, 0, 90, 33], [16, 3, 0, 0, 64]),
    "first-is-cut": ([64, 1], [0, 9]),
}


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(STEPS))
def test_served_with_each_requests_state_at_its_checkpoint(step_ns, real_fn, seen, name, state_dtype):
    lengths, computed = STEPS[name]
    m = vllm_step_metadata.with_checkpoints(step_ns, vllm_step_metadata.step(step_ns, lengths, "cpu"), computed)
    offsets = m.checkpoint.offsets
    assert any(offsets)
    call = layer_call(m, state_dtype, seed=len(name))
    adapter = fkda_vllm.adapter_for(SITE, real_fn)
    served = fkda_vllm.STATS[SITE, "served"]
    with vllm_step_metadata.forward(step_ns, {LAYER: m}):
        o, h = adapter(**call)
    assert fkda_vllm.STATS[SITE, "served"] == served + 1
    assert o is call["out"] and h is call["final_state"]
    want_o, want_h, _ = reference(call, lengths)
    tol = dict(rtol=2e-5, atol=2e-5) if state_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o.double(), want_o, **tol)
    torch.testing.assert_close(h.double(), want_h, **tol)
    cut = [r for r, off in enumerate(offsets) if off]
    prefix_call = dict(call, q=[], k=[], v=[], g=[], beta=[])
    starts = torch.tensor([0] + lengths).cumsum(0).tolist()
    for key in ("q", "k", "v", "g", "beta"):
        prefix_call[key] = torch.cat([call[key][:, starts[r]:starts[r] + offsets[r]] for r in cut], dim=1)
    prefix_call["initial_state"] = call["initial_state"][cut]
    _, want_ckpt, _ = reference(prefix_call, [offsets[r] for r in cut])
    torch.testing.assert_close(call["checkpoint_state"][cut].double(), want_ckpt, **tol)
    # the rows without a checkpoint are vLLM's to ignore, and stay as they were
    rest = [r for r in range(len(lengths)) if not offsets[r]]
    assert torch.isnan(call["checkpoint_state"][rest]).all()
    # one kda_prefill call more than there are checkpoints (and one for the decodes of a step in vLLM's order),
    # each routed by its longest piece
    apart = name == "decodes-first"
    assert len(seen) == len(cut) + 1 + apart
    calls = k3_layer.cut_at_checkpoints(offsets, lengths, breaks={3} if apart else ())
    assert [c["max_seqlen"] for c in seen] == [max(c[4]) for c in calls]


def test_no_checkpoint_in_the_step_is_one_call_a_part(step_ns, real_fn, seen):
    """vLLM passes no checkpoint when no request reaches one (build returns None): one kda_prefill call for the
    decode, one for the prompt (host_lengths.step_parts)."""
    m = vllm_step_metadata.with_checkpoints(step_ns, vllm_step_metadata.step(step_ns, [1, 40], "cpu"), [3, 5])
    assert m.checkpoint is None
    m.checkpoint = type("NoCheckpoint", (), {"checkpoint_offsets": torch.zeros(2, dtype=torch.int32)})()
    call = layer_call(m, torch.float32, seed=1)
    del call["checkpoint_state"], call["checkpoint_offsets"]
    with vllm_step_metadata.forward(step_ns, {LAYER: m}):
        fkda_vllm.adapter_for(SITE, real_fn)(**call)
    assert [c["max_seqlen"] for c in seen] == [1, 40]


# ---------------------------------------------------------------------------------------------
# what it cannot cut runs FlashKDA, counted


def _recorder(real_fn, seen):
    def recorder(**kw):
        seen.append(kw)
        return "flashkda"
    recorder.__signature__ = inspect.signature(real_fn)
    return recorder


@pytest.mark.parametrize("how,reason", [
    ("no forward context", "need vLLM's host offsets to cut the call at: vllm.forward_context is not loaded"),
    ("another offsets tensor", "is not the step metadata's checkpoint.checkpoint_offsets"),
    ("no host offsets", "has no host offsets / query_lens"),
    ("state without offsets", "come together"),
    # the same sum, the cut in another request: each length against vLLM's conv block counts (nums_dict[8])
    ("lengths swapped", "disagree with the step's conv block counts"),
])
def test_without_vllms_host_offsets_it_runs_flashkda_with_the_reason_counted(step_ns, real_fn, how, reason):
    lengths, computed = STEPS["decodes+prompt"]
    m = vllm_step_metadata.with_checkpoints(step_ns, vllm_step_metadata.step(step_ns, lengths, "cpu"), computed)
    call = layer_call(m, torch.float32, seed=2)
    if how == "another offsets tensor":
        call["checkpoint_offsets"] = m.checkpoint.checkpoint_offsets.clone()
    if how == "no host offsets":
        m.checkpoint.offsets = None
    if how == "state without offsets":
        call["checkpoint_offsets"] = None
    if how == "lengths swapped":
        lens, offs = m.checkpoint.query_lens, m.checkpoint.offsets   # the prompt's length and checkpoint moved to
        j = lens.index(max(lens))                                     # request 0 (a decode on the device): valid
        assert lens[0] != lens[j] and offs[j] > 0                     # lists by vLLM's own rules, the same sum
        lens[0], lens[j] = lens[j], lens[0]
        offs[0], offs[j] = offs[j], offs[0]
    seen = []
    adapter = fkda_vllm.adapter_for(SITE, _recorder(real_fn, seen))
    fell = fkda_vllm.STATS[SITE, "fell_back"]
    if how == "no forward context":
        result = adapter(**call)
    else:
        with vllm_step_metadata.forward(step_ns, {LAYER: m}):
            result = adapter(**call)
    assert result == "flashkda" and fkda_vllm.STATS[SITE, "fell_back"] == fell + 1 and len(seen) == 1
    assert seen[0]["checkpoint_state"] is call["checkpoint_state"]
    assert any(s == SITE and reason in r for s, r in fkda_vllm.REASONS), dict(fkda_vllm.REASONS)
    assert torch.isnan(call["out"]).all() and torch.isnan(call["checkpoint_state"]).all()


def test_an_inference_checkpoint_buffer_outside_inference_mode_runs_flashkda_before_anything_is_written(
        step_ns, real_fn):
    """checkpoint_state is written by copy_ between the cut calls, not through the op: an inference tensor there,
    outside inference mode, let the first call write out and final_state and then raised from the copy. Now the call
    runs FlashKDA (counted) with nothing written."""
    lengths, computed = STEPS["decodes+prompt"]
    m = vllm_step_metadata.with_checkpoints(step_ns, vllm_step_metadata.step(step_ns, lengths, "cpu"), computed)
    call = layer_call(m, torch.float32, seed=3)             # made under the autouse inference_mode
    with torch.inference_mode(False), torch.no_grad():
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "out", "final_state",
                     "workspace"):
            call[name] = call[name].clone()                 # ordinary tensors; checkpoint_state stays inference
        assert call["checkpoint_state"].is_inference() and not call["out"].is_inference()
        seen = []
        adapter = fkda_vllm.adapter_for(SITE, _recorder(real_fn, seen))
        fell = fkda_vllm.STATS[SITE, "fell_back"]
        with vllm_step_metadata.forward(step_ns, {LAYER: m}):
            assert adapter(**call) == "flashkda"
    assert fkda_vllm.STATS[SITE, "fell_back"] == fell + 1 and len(seen) == 1
    assert any(s == SITE and "checkpoint_state is an inference tensor" in r for s, r in fkda_vllm.REASONS)
    assert torch.isnan(call["out"]).all() and torch.isnan(call["final_state"]).all()
    assert torch.isnan(call["checkpoint_state"]).all()


def test_a_checkpoint_buffer_requiring_grad_runs_flashkda_before_anything_is_written(step_ns, real_fn):
    """The same rule's other half: a checkpoint_state requiring grad under grad mode let the first call write out
    and final_state, then the copy_ raised ("a leaf Variable that requires grad is being used in an in-place
    operation"). Now the call runs FlashKDA (counted) with nothing written."""
    lengths, computed = STEPS["decodes+prompt"]
    m = vllm_step_metadata.with_checkpoints(step_ns, vllm_step_metadata.step(step_ns, lengths, "cpu"), computed)
    with torch.inference_mode(False):
        call = layer_call(m, torch.float32, seed=3)
        call["checkpoint_state"].requires_grad_(True)
        seen = []
        adapter = fkda_vllm.adapter_for(SITE, _recorder(real_fn, seen))
        fell = fkda_vllm.STATS[SITE, "fell_back"]
        with torch.enable_grad(), vllm_step_metadata.forward(step_ns, {LAYER: m}):
            assert adapter(**call) == "flashkda"
    assert fkda_vllm.STATS[SITE, "fell_back"] == fell + 1 and len(seen) == 1
    assert any(s == SITE and "checkpoint_state requires grad" in r for s, r in fkda_vllm.REASONS)
    assert torch.isnan(call["out"]).all() and torch.isnan(call["final_state"]).all()
    assert torch.isnan(call["checkpoint_state"]).all()
