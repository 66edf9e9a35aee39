"""The longest sequence of a vLLM prefill call, read from vLLM's own host metadata, so that the call routes by
its longest sequence as SGLang's and fla's calls do (validation.prefill_route_meta, `work_per_longest`).

Why: vLLM 0.34 sends every non-speculative request of a step through one chunk call whenever the step has a
prefill, so its usual step is many one-token decodes beside one long prompt chunk. Routed by the mean length,
that step takes the fused 16-token kernel, whose one CTA a sequence walks the long chunk alone (measured 13x
slower than the chunk-64 route at B1 T8K H8, csrc/prefill/README.md).

How, without reading the device: the KDA layers (Kimi's shared GDN layer, K3's, bailing_moe_v3) pass
cu_seqlens = m.non_spec_query_start_loc of the step's GDNAttentionMetadata m, and the same m holds nums_dict,
built by vLLM's metadata builder from the host offsets for its causal conv: nums_dict[8]["nums"][r] =
ceil(len_r / 8), a host tensor. So 8 * max(nums) bounds the longest sequence from above by at most 7 tokens
(enough for routing, the only use of max_seqlen without checkpoints). m is found in the forward context by the
identity of cu_seqlens; one lookup a step and offsets (cached on the forward context object and its metadata,
which vLLM builds anew for each forward). Anything else gives None and the reason (the call then routes by the
mean, as before).
"""
from __future__ import annotations

import sys
import weakref
from typing import Optional, Tuple

import torch

BLOCK = 8      # vLLM's causal-conv block (compute_causal_conv1d_metadata: `for BLOCK_M in [8]`)

#: [weakref to the forward context, its attn_metadata then, {id(cu_seqlens): entry}], an entry [weakref(cu_seqlens),
#: the step's metadata or None, longest()'s answer, step_parts()'s answer] (answers None until first asked): every
#: KDA layer of a step passes the same cu_seqlens, so each answer is worked out once a step. A forward context
#: reused with new metadata, or a new one, starts afresh
_cache: list = [None, None, {}]


def _find(attn_metadata, cu_seqlens):
    """The metadata object whose non_spec_query_start_loc is cu_seqlens (a dict, or a list of dicts under
    vLLM's dual-batch overlap), else None."""
    groups = attn_metadata if isinstance(attn_metadata, (list, tuple)) else [attn_metadata]
    for group in groups:
        if not isinstance(group, dict):
            continue
        for m in group.values():
            if getattr(m, "non_spec_query_start_loc", None) is cu_seqlens:
                return m
    return None


def _block_counts(m, N: int) -> Tuple[Optional[torch.Tensor], str]:
    """(vLLM's host conv block counts nums_dict[8]['nums'] of the step's N requests, ceil(len / 8) each, or None;
    why not)."""
    nums_dict = getattr(m, "nums_dict", None)
    entry = nums_dict.get(BLOCK) if isinstance(nums_dict, dict) else None
    nums = entry.get("nums") if isinstance(entry, dict) else None
    if not isinstance(nums, torch.Tensor) or nums.device.type != "cpu" or nums.dim() != 1 \
            or nums.dtype.is_floating_point or nums.dtype.is_complex or nums.dtype == torch.bool:
        return None, f"the step's metadata has no host nums_dict[{BLOCK}]['nums'] (vLLM's conv block counts)"
    if nums.shape[0] != N:
        return None, (f"nums_dict[{BLOCK}]['nums'] counts {nums.shape[0]} requests, cu_seqlens {N} (not the "
                      f"offsets this call got)")
    return nums, "vllm metadata"


def _from_metadata(m, N: int, T: int) -> Tuple[Optional[int], str]:
    nums, why = _block_counts(m, N)
    if nums is None:
        return None, why
    if N == 0:
        return 0, "vllm metadata"
    top = int(nums.max())
    if top < 0:
        return None, f"nums_dict[{BLOCK}]['nums'] holds a negative count {top}"
    return min(T, BLOCK * top), "vllm metadata"


def _step_metadata(cu_seqlens):
    """(the step's metadata object whose non_spec_query_start_loc is cu_seqlens, or None; why not, or the cache
    entry [weakref(cu_seqlens), m, longest()'s answer or None, step_parts()'s answer or None] to fill). Never reads a device tensor; imports nothing
    (vLLM's forward_context is read only when loaded)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        return None, "no cu_seqlens"
    fc = sys.modules.get("vllm.forward_context")
    if fc is None:
        return None, "vllm.forward_context is not loaded"
    try:
        if not fc.is_forward_context_available():
            return None, "no vLLM forward context is set"
        ctx = fc.get_forward_context()
    except Exception as e:  # noqa: BLE001 - an engine of another shape: route by the mean, with the reason
        return None, f"vLLM's forward context did not answer ({type(e).__name__}: {e})"
    attn_metadata = getattr(ctx, "attn_metadata", None)
    owner = _cache[0]() if _cache[0] is not None else None
    if owner is not ctx or _cache[1] is not attn_metadata:
        try:
            _cache[0] = weakref.ref(ctx)
        except TypeError:
            _cache[0] = None
        _cache[1], _cache[2] = attn_metadata, {}
    hit = _cache[2].get(id(cu_seqlens))
    if hit is None or hit[0]() is not cu_seqlens:
        hit = [weakref.ref(cu_seqlens), _find(attn_metadata, cu_seqlens), None, None]
        if _cache[0] is not None:
            _cache[2][id(cu_seqlens)] = hit
    if hit[1] is None:
        return None, "cu_seqlens is not the non_spec_query_start_loc of any metadata in vLLM's forward context"
    return hit[1], hit


def longest(cu_seqlens, T: int) -> Tuple[Optional[int], str]:
    """(a host bound on the longest sequence of this call, within 7 tokens, or None; how it was had or why
    not)."""
    m, entry = _step_metadata(cu_seqlens)
    if m is None:
        return None, entry
    if entry[2] is None:
        entry[2] = _from_metadata(m, cu_seqlens.shape[0] - 1, T)
    return entry[2]


def checkpoint_lengths(cu_seqlens, checkpoint_offsets, T: int) -> Tuple[Optional[tuple], str]:
    """((offsets, lengths): vLLM's host copies of each request's prefix-cache checkpoint offset into its query
    (0: none) and of its query length, or None; why not). Read from the step's metadata m (found by cu_seqlens as
    above) when m.checkpoint (vLLM's MambaPrefillCheckpointMetadata) holds checkpoint_offsets itself."""
    m, entry = _step_metadata(cu_seqlens)
    if m is None:
        return None, entry
    ckpt = getattr(m, "checkpoint", None)
    if ckpt is None or getattr(ckpt, "checkpoint_offsets", None) is not checkpoint_offsets:
        return None, "checkpoint_offsets is not the step metadata's checkpoint.checkpoint_offsets"
    offsets, lengths = getattr(ckpt, "offsets", None), getattr(ckpt, "query_lens", None)
    N = cu_seqlens.shape[0] - 1
    if not isinstance(offsets, list) or not isinstance(lengths, list) or len(offsets) != N or len(lengths) != N \
            or not all(type(x) is int for x in offsets + lengths):
        return None, (f"the step metadata's checkpoint has no host offsets / query_lens of {N} ints (the "
                      f"requests of this call)")
    if sum(lengths) != T or any(n < 0 for n in lengths):
        return None, f"the checkpoint's host query_lens {lengths[:8]}... do not sum to this call's {T} tokens"
    if any(o != 0 and not 0 < o < n for o, n in zip(offsets, lengths)):
        return None, "a host checkpoint offset outside (0, its query length), vLLM's rule"
    # each length against the step's other host record of it, the conv block counts (ceil(len / 8), built from the
    # host offsets cu_seqlens was copied from): lengths that sum to T but put a cut in the wrong request are refused
    # (a difference within one block is not visible there; vLLM's own FlashInfer plan takes these lists as they are)
    nums, _ = _block_counts(m, N)
    if nums is not None and nums.tolist() != [-(-n // BLOCK) for n in lengths]:
        return None, (f"the checkpoint's host query_lens {lengths[:8]}... disagree with the step's conv block counts "
                      f"nums_dict[{BLOCK}]['nums'] (ceil(len / {BLOCK}) a request)")
    return (offsets, lengths), "vllm metadata"


def step_parts(cu_seqlens, T: int):
    """([(first token, end token, first request, end request, longest)], how): the kda_prefill calls of one vLLM
    chunk call. vLLM 0.34's Kimi layers send the step's one-token decodes (first, as vLLM orders a batch) and its
    prompts through one call; served apart, each part routes by its own lengths: the prompts by their longest, not
    beside hundreds of one-token sequences that make the call look wide (measured on the H200: 255 x 1 + 1 x 2048
    H8 0.31 ms in one call, 0.16 ms in two, benchmarks/bench_vllm.py arm `split`). The cut comes from the step
    metadata's host counts (num_decodes one-token decodes of num_decode_tokens tokens, then num_prefills prompts);
    without them one part routed by the longest (longest(), None where unknown)."""
    m, entry = _step_metadata(cu_seqlens)
    if m is None:   # one part, by the mean, with the reason (without cu_seqlens the requests are not counted)
        N = cu_seqlens.shape[0] - 1 if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 else 0
        return [(0, T, 0, N, None)], entry
    if entry[3] is None:
        entry[3] = _parts_from_metadata(m, cu_seqlens.shape[0] - 1, T, longest(cu_seqlens, T))
    return entry[3]


def _parts_from_metadata(m, N: int, T: int, bound_how) -> tuple:
    bound, how = bound_how
    whole = ([(0, T, 0, N, bound)], how)
    if bound is None:
        return whole
    nd, ndt, npf = (getattr(m, name, None) for name in ("num_decodes", "num_decode_tokens", "num_prefills"))
    if not all(type(x) is int for x in (nd, ndt, npf)) or not (0 < nd < N and npf > 0 and ndt == nd):
        return whole
    nums = m.nums_dict[BLOCK]["nums"]
    if bool((nums[:nd] != 1).any()):     # a decode is one token (ceil(1 / 8) = 1): counts of another step
        return whole
    rest = min(T - ndt, BLOCK * int(nums[nd:].max()))
    return [(0, ndt, 0, nd, 1), (ndt, T, nd, N, rest)], how
