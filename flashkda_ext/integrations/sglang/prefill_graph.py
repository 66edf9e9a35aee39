"""SGLang 0.5.23's breakable prefill CUDA graphs on flashkda_ext: the plan-and-run wrapper they drive.

SGLang captures the KDA extend inside its breakable prefill CUDA graphs (the default prefill graph backend on
CUDA) only for a kernel that is its Triton one or names a `prefill_graph_wrapper_cls`; for any other kernel each
KDA layer breaks the graph and its extend runs eagerly. With a wrapper class, SGLang's FlashInferKDAPrefillGraph
(sglang/srt/layers/attention/linear/kda_flashinfer_prefill_graph.py) makes one instance a layer, `wrapper_cls(device)`,
calls `plan(cu_seqlens)` outside the capture before every replay and `run(...)` inside it, with the keywords of
FlashInfer 0.7.4's RecurrentKDAPrefillWrapper.run. What it hands over (read in 0.5.23):

- `cu_seqlens`: the bucket's fixed-address int64 offsets [max_seqs + 1], refilled in place before each replay;
  padded sequences are empty and sit at the end, and the last offset is the batch's token count, which can be
  below the bucket's T (those rows belong to no sequence; SGLang zeroes them after the call);
- `initial_state` the layer's pool, `ssm_state_indices` int32 [max_seqs] with the padded sequences' -1 clamped to
  slot 0; the pool is updated in place at the indices (FlashInfer's contract; `output_final_state=False` only says
  no separate final state is returned), and an empty sequence must not write (slot 0 may be a live request's);
- the raw gate and beta logits, `use_qk_l2norm_in_kernel=True`, `use_gate_in_kernel=True`, `lower_bound` (None:
  softplus), `output = empty_like(q)`; checkpoints only with the mamba extra buffer (radix-cache tracking).

`PrefillGraphWrapper.run` serves that with kda_prefill in pool mode: the offsets stay on the device (no host read,
so the call can be captured, and replayed after `plan`'s caller refilled them), and an empty sequence's index
becomes padding on the device (start from zeros, write nothing). At capture only the bucket's bounds are known
(max_seqs sequences, T tokens), so the kernel is chosen on the device at each replay (`launches`): where the
route at the bounds (a chunk-64 module) and the route by the mean (the fused chunk-16 kernel) differ, both are
launched and the one whose band the replay's live lengths miss sees only empty sequences. Anything else SGLang
could pass (checkpoints, a precomputed gate, no l2norm, a returned final state) is refused with a ValueError
naming the argument; an unknown keyword is a TypeError.

The class is offered (FlashKDAExtKernel.prefill_graph_wrapper_cls) only with FLASHKDA_EXT_SGLANG_PREFILL_GRAPH=1,
without SGLang's mamba extra buffer and without an fp16 state pool asked for by --mamba-ssm-dtype or
SGLANG_MAMBA_SSM_DTYPE (a model config's own fp16 mamba_ssm_dtype is not visible here: run() then names the
pool). A captured route sees only the bucket's bounds, so whether capture beats the eager break at a given batch
is for the H200 to show (docs/integrations.md, "SGLang").
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import dispatch, switches, validation
from .dense import as_dense, dense_qkv, reshaped, token_layout
from .kernel import _gate, _params, _qkv_dims

ENV_VAR = "FLASHKDA_EXT_SGLANG_PREFILL_GRAPH"


def enabled() -> bool:
    """FLASHKDA_EXT_SGLANG_PREFILL_GRAPH: 1 / true / yes / on, or 0 / false / no / off / unset; else a ValueError."""
    return switches.env_switch(ENV_VAR, False, on="capture the extend", off="break the graph at it")


def wrapper_cls():
    """The class SGLang should capture the extend with, or None: the eager break (see the module's docstring)."""
    if not enabled():
        return None
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_exec
    mamba = get_exec().mamba
    # with the mamba extra buffer every replay may snapshot states at chunk boundaries (checkpoints), which a
    # captured call could only serve as a dense [max_seqs, T / 64] table: that stays on the eager extend
    if mamba.enable_mamba_extra_buffer:
        return None
    # an fp16 pool (--mamba-ssm-dtype float16, or SGLang's env override) is not ours to serve, and inside a captured
    # graph there is no fallback kernel: the eager extend falls back to SGLang's Triton kernel instead
    ssm_dtype = envs.SGLANG_MAMBA_SSM_DTYPE.get() or mamba.mamba_ssm_dtype
    return None if ssm_dtype == "float16" else PrefillGraphWrapper


# route metadata a rule may band on that the lengths decide, computed on the device from the offsets
_LENGTH_FIELDS = ("num_seqs", "total_tokens", "mean_seqlen", "work_items", "work_per_longest", "longest_vs_mean_pct")


def in_band_on_device(when: dict, cu: torch.Tensor, live: torch.Tensor, HV: int) -> torch.Tensor:
    """A 0-d bool tensor: whether a rule's conditions on the length fields hold for the live sequences of these
    offsets, with the values kda_prefill's route metadata gives them (validation.prefill_route_meta, max_seqlen
    known); no host read. Conditions on other fields are the host's (they do not depend on the lengths)."""
    lengths = cu[1:] - cu[:-1]
    n = live.sum()
    total = cu[-1] - cu[0]
    have = {"num_seqs": n, "total_tokens": total, "work_items": n * HV,
            "mean_seqlen": torch.div(total, n.clamp(min=1), rounding_mode="floor"),
            "work_per_longest": torch.div(total * HV, lengths.max().clamp(min=1), rounding_mode="floor"),
            "longest_vs_mean_pct": torch.div(100 * lengths.max() * n, total.clamp(min=1), rounding_mode="floor")}
    ok = torch.ones((), dtype=torch.bool, device=cu.device)
    for key, want in when.items():
        if key.endswith(("_min", "_max")) and key[:-4] in _LENGTH_FIELDS:
            ok = ok & (have[key[:-4]] >= want if key.endswith("_min") else have[key[:-4]] <= want)
    return ok


def launches(args, kw, cu, idx, live, T: int, HV: int):
    """The kda_prefill launches of a captured call on device offsets: (cu_seqlens, state_indices, max_seqlen) each.

    At capture only the bucket's bounds are known. Routed at them (max_seqlen = T: one sequence may hold every
    token) the call takes a chunk-64 module; routed by the mean (max_seqlen unknown) it may take the fused
    chunk-16 kernel, which serves many short sequences faster but walks a long one as a single CTA's chain.
    Where the two routes differ, both launch and the device decides from the replay's real lengths, by the mean
    route's own band (its rule's conditions on the length fields, evaluated on the live sequences): the launch
    not chosen sees every sequence empty and every slot as padding, so it reads and writes nothing (its CTAs
    return at once). Otherwise one launch at the bounds."""
    def route(max_seqlen):
        call = validation.check_kda_prefill(*args, cu_seqlens=cu, state_indices=idx, max_seqlen=max_seqlen, **kw)
        return dispatch.select_rule("kda_prefill", call.route_meta())
    bound, mean = route(T), route(None)
    if bound["module"] == mean["module"]:
        return [(cu, torch.where(live, idx, -1), T)]
    fused = in_band_on_device(mean.get("when", {}), cu, live, HV)
    none = torch.zeros_like(cu)
    return [(torch.where(fused, cu, none), torch.where(fused & live, idx, -1), None),
            (torch.where(fused, none, cu), torch.where(~fused & live, idx, -1), T)]


def _indices_in_pool(idx: torch.Tensor, pool, live: torch.Tensor) -> None:
    """Host slot indices: every entry below the pool's slot count, an empty sequence's too. run turns an empty
    sequence's entry into padding before kda_prefill sees it, and kda_prefill refuses an entry past the pool
    whatever its sequence's length: checked here, under SGLang's name, as a live slot given to two sequences (the
    binding would name its own state_indices). A pool that is no [slots, HV, V, K] tensor is left to kda_prefill."""
    if not (isinstance(pool, torch.Tensor) and pool.dim() == 4 and idx.device.type == "cpu"):
        return
    past = (idx >= pool.shape[0]).nonzero()
    if past.numel():
        n = int(past[0, 0])
        raise ValueError(f"ssm_state_indices: entry {n} = {int(idx[n])} is out of range for initial_state's "
                         f"{pool.shape[0]} slots (expected < {pool.shape[0]}; negative = padding)")
    seen = set()
    for slot, on in zip(idx.tolist(), live.tolist()):
        if on and slot >= 0:
            if slot in seen:
                raise ValueError(f"ssm_state_indices: slot {slot} is given to more than one live sequence (expected "
                                 f"each live slot once; an empty sequence's entry is not read)")
            seen.add(slot)


#: kda_prefill's argument names -> the names SGLang passes run() (its refusals name what the caller wrote)
_SGLANG_NAMES = {"state": "initial_state", "state_indices": "ssm_state_indices", "out": "output"}


def _named_as_sglang(fn):
    """fn (kda_prefill, or launches(), which checks the call to route it), its ValueError for state / state_indices /
    out renamed to initial_state / ssm_state_indices / output (the op refuses before it launches: nothing written)."""
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            name, sep, rest = str(e).partition(": ")
            if sep and name in _SGLANG_NAMES:
                raise ValueError(f"{_SGLANG_NAMES[name]}: {rest}") from None
            raise
    return call


class PrefillGraphWrapper:
    """SGLang's plan-and-run prefill wrapper interface (FlashInfer 0.7.4's RecurrentKDAPrefillWrapper shape)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cu_seqlens: Optional[torch.Tensor] = None

    def plan(self, cu_seqlens: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Keep the offsets tensor itself: SGLang refills it in place before each replay, and run reads it on the
        device. `non_blocking` changes nothing (nothing is copied)."""
        validation._bool("non_blocking", non_blocking)
        cu = validation._tensor("cu_seqlens", cu_seqlens)
        if cu.dim() != 1 or cu.shape[0] < 2 or cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens: expected int32 or int64 offsets [N+1] with N >= 1, got "
                             f"{list(cu.shape)} {cu.dtype}")
        if cu.device.type != self.device.type:
            raise ValueError(f"cu_seqlens: expected a tensor on {self.device.type} (the wrapper's device), "
                             f"got {cu.device}")
        self.cu_seqlens = cu

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
            scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
            output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = True, use_gate_in_kernel: bool = False,
            lower_bound: Optional[float] = None, output: Optional[torch.Tensor] = None, beta_is_logit: bool = False,
            state_checkpoints: Optional[torch.Tensor] = None, checkpoint_cu_starts: Optional[torch.Tensor] = None,
            checkpoint_every_n_tokens: int = 0, checkpoint_state_indices: Optional[torch.Tensor] = None,
            ssm_state_indices: Optional[torch.Tensor] = None):
        """The packed extend of the planned offsets on the pool, committed in place. Returns (output, None)."""
        from ...ops import kda_prefill
        if self.cu_seqlens is None:
            raise RuntimeError("run: called before plan(cu_seqlens)")
        for name, value, want in (("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel, True),
                                  ("use_gate_in_kernel", use_gate_in_kernel, True),
                                  ("output_final_state", output_final_state, False)):
            if validation._bool(name, value) != want:
                raise ValueError(f"{name}: flashkda_ext's captured SGLang prefill serves {name}={want} (what SGLang "
                                 f"0.5.23 passes), got {value}")
        # an int, not read by its truth (False, None, 0.0 are no interval), and each argument named as given
        validation._int("checkpoint_every_n_tokens", checkpoint_every_n_tokens, "(0: no checkpoints)")
        for name, value in (("state_checkpoints", state_checkpoints), ("checkpoint_cu_starts", checkpoint_cu_starts),
                            ("checkpoint_state_indices", checkpoint_state_indices),
                            ("checkpoint_every_n_tokens", checkpoint_every_n_tokens or None)):
            if value is not None:
                raise ValueError(f"{name}: checkpoints (state_checkpoints and its companions) in a captured prefill "
                                 f"are not served (flashkda_ext offers its wrapper only without SGLang's mamba extra "
                                 f"buffer); expected {0 if name == 'checkpoint_every_n_tokens' else None}")
        if initial_state is None or ssm_state_indices is None:
            missing = "initial_state" if initial_state is None else "ssm_state_indices"
            raise ValueError(f"{missing}: expected the layer's state pool and its int32 slot indices, got None")
        if A_log is None or dt_bias is None:
            raise ValueError(f"{'A_log' if A_log is None else 'dt_bias'}: use_gate_in_kernel=True needs A_log and "
                             f"dt_bias, got None")
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            validation._tensor(name, x)
        T, H, K, HV, V = _qkv_dims(q, v)
        if k.shape != q.shape:      # the host path cuts k to the planned rows: a k of another length would pass
            raise ValueError(f"k: expected shape [1, T, H, K] = {list(q.shape)} (q's), got {list(k.shape)}")
        token_layout("g", g, T, (HV, K))
        token_layout("beta", beta, T, (HV,))
        cu = self.cu_seqlens
        N = cu.shape[0] - 1
        idx = validation._tensor("ssm_state_indices", ssm_state_indices)
        if idx.shape != (N,) or idx.dtype != torch.int32:
            raise ValueError(f"ssm_state_indices: expected int32 [N] = [{N}] (one slot per planned sequence), got "
                             f"{list(idx.shape)} {idx.dtype}")
        pool = validation._tensor("initial_state", initial_state)
        out = validation._tensor("output", output) if output is not None else torch.empty_like(v)
        if tuple(out.shape) != (1, T, HV, V):
            raise ValueError(f"output: expected shape [1, T, HV, V] = {[1, T, HV, V]}, got {list(out.shape)}")
        # kda_prefill's layout rule for its out, checked here on the whole tensor: on host offsets the op sees only
        # the planned rows and would report their shape (its other refusals reach the caller renamed, _named_as_sglang)
        if not out.is_contiguous():
            raise ValueError(f"output: expected a contiguous [1, T, HV, V] tensor, got strides {list(out.stride())} "
                             f"for shape {list(out.shape)}")
        # named here as SGLang passes them (kda_prefill would name them state_indices / state / out)
        for name, x in (("ssm_state_indices", idx), ("initial_state", pool), ("output", out)):
            validation._same_device(name, x, q.device)
        live = cu[1:] > cu[:-1]          # an empty sequence (SGLang's padding, slot clamped to 0): no read, no write
        A, dt = _params(A_log, dt_bias)
        gate, lb = _gate(lower_bound, A)
        kw = dict(A_log=A, dt_bias=dt, lower_bound=lb, gate=gate, scale=scale, state=initial_state,
                  beta_is_logit=validation._bool("beta_is_logit", beta_is_logit), output_final_state=True)
        prefill = _named_as_sglang(kda_prefill)
        if cu.device.type == "cpu":      # host offsets: one call on exactly the tokens they own
            offsets = cu.tolist()
            # against q's T before any rows are cut: kda_prefill sees only the cut rows (its T is the last offset),
            # and a last offset past T or below 0 would cut other rows than it names (slice(0, -2) counts from the end)
            validation.check_offsets_span("cu_seqlens", offsets, T, " (q's tokens; rows past the last offset belong "
                                          "to no sequence)", at_most=True)
            _indices_in_pool(idx, initial_state, live)
            rows = slice(0, offsets[-1])
            tokens = rows.stop
            qh, kh, vh = (x[:, rows] for x in dense_qkv(q, k, v))
            # g and beta as T tokens before the cut (one of another length is refused, not cut to fit)
            g4, b3 = reshaped("g", g, (1, T, HV, K)), reshaped("beta", beta, (1, T, HV))
            prefill(qh, kh, vh, as_dense("g", g4[:, rows], q.dtype, (1, tokens, HV, K)),
                    as_dense("beta", b3[:, rows], q.dtype, (1, tokens, HV)), cu_seqlens=cu,
                    state_indices=torch.where(live, idx, -1), out=out[:, rows], **kw)
            return out, None
        args = (*dense_qkv(q, k, v), as_dense("g", g, q.dtype, (1, T, HV, K)),
                as_dense("beta", beta, q.dtype, (1, T, HV)))
        for cu_k, idx_k, max_seqlen in _named_as_sglang(launches)(args, dict(kw, out=out), cu, idx, live, T, HV):
            prefill(*args, cu_seqlens=cu_k, state_indices=idx_k, max_seqlen=max_seqlen, out=out, **kw)
        return out, None
