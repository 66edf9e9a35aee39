"""vLLM 0.34.0's own Triton KDA kernels (Kimi K3 / Kimi-Linear) against flashkda_ext through the vLLM adapters,
on identical inputs, one run (issue 45, the vLLM half of the GPU acceptance).

The vLLM side is the real wheel's kimi_k3 nvidia ops package, prepared here (no GPU needed) and carried:

    python3 scripts/prepare_vllm_engine.py                # -> .engines/vllm (ignored; carry it)
    python3 benchmarks/bench_vllm.py --out results/       # on the GPU: the whole grid
    python3 benchmarks/bench_vllm.py --quick              # rows {1, 64, 1024}, H {8, 32}
    python3 benchmarks/bench_vllm.py --dry-run            # CPU: the adapters against flashkda_ext.reference

install() rebinds the package's three names; "ours" calls them as the layers do (the adapter, which must
serve: a fallback is reported as an error of the case), "vllm_triton" calls the original each adapter wraps,
"fla" runs fla's kernels on the same inputs where fla imports. Kinds, as the layers call them:
- decode: fused_recurrent_kda_packed_decode, packed post-conv q|k|v [rows, 3*H*128], raw gate, beta logit
  a strided view of the projection, rows distinct slots of a pool whose slot 0 is vLLM's null block;
- verify: fused_recurrent_kda with a [rows, T_max] slot table and num_accepted_tokens in [1, T_max], q/k/v
  row-strided views of the post-conv buffer;
- prefill: chunk_kda_with_fused_gate over `rows` sequences of --prefill-len tokens from gathered states;
- mixed: vLLM's usual prefill step, `rows` one-token decodes and one --mixed-prompt-token prompt chunk in one
  chunk_kda_with_fused_gate call, inside a vLLM forward context holding the step's GDNAttentionMetadata
  (scripts/vllm_step_metadata.py: the wheel's own classes), so "ours" serves the decodes and the prompt as two
  calls, each routed by its own lengths (integrations/vllm/host_lengths.step_parts, since 03c3b36); "ours_by_mean"
  is the same call on a copy of the offsets, which the lookup does not find (one call routed by the mean, as before
  that lookup); "split" is the two calls written out here (the form measured before it was routed), its rel. L2
  against "ours" in the JSON: an independent check of the adapter's parts.
On a GPU, prefill and mixed points with the bounded gate also time "vllm_flashkda": Kimi K3's own prefill on an
H200 (its layer's "auto" backend: kda.py's `_flashkda_prefill` over the wheel's FlashKDA extension, both from the
prepared folder), its rel. L2 against "ours" in the JSON, and "ours_k3_layer": the opt-in adapter that takes
FlashKDA's place (FLASHKDA_EXT_VLLM_K3_PREFILL=1, integrations/vllm/k3_layer.py), into the same buffers.
Each point: bf16 and fp32 pools (--state-dtypes; --paged: laid out as vLLM pages them), softplus or bounded
gate (--lower-bound), heads H = HV.
Agreement is checked first on fresh copies (output and pool / final state, rel. L2 below --tol); the table is
the harness's (graph replay, eager, wall), baseline vllm_triton; JSON with the agreement and the served /
fallback counts per call site.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import peer_flashkda  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import vllm_step_metadata  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = V = 128
K3_OPS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"


def load_vllm(engine_dir: Path):
    """The real K3 ops package from the prepared folder, with the flashkda_ext adapters installed on it."""
    if not (engine_dir / "vllm").is_dir():
        raise SystemExit(f"{engine_dir}: no prepared vLLM folder; run `python3 scripts/prepare_vllm_engine.py`")
    sys.path.insert(0, str(engine_dir))
    ops = importlib.import_module(K3_OPS)
    from flashkda_ext.integrations import vllm as fkda_vllm
    report = fkda_vllm.install()
    skipped = {s: r for s, r in report.items() if isinstance(r, str)}
    if any(s.startswith("k3") for s in skipped):
        raise SystemExit(f"the adapters were not installed: {skipped}")
    return ops, fkda_vllm


def copy_pool(pool):
    """A copy with the same strides (a paged pool stays paged; clone() would make it dense)."""
    if pool is None:
        return None
    out = torch.empty_strided(pool.shape, pool.stride(), dtype=pool.dtype, device=pool.device)
    return out.copy_(pool)


def new_pool(slots, H, state_dtype, args, dev, gen):
    """The pool as vLLM lays it out with --paged (a page per slot: the conv state [3, 3*H*K] in bf16, then the
    recurrent state [H, V, K]), else dense; random small states."""
    states = (torch.randn(slots, H, V, K, generator=gen, device=dev) * 0.05).to(state_dtype)
    if not args.paged:
        return states
    esize = states.element_size()
    conv = 3 * 3 * H * K * 2
    page = conv + H * V * K * esize
    raw = torch.zeros(slots * page, dtype=torch.uint8, device=dev)
    pool = torch.as_strided(raw.view(state_dtype), states.shape, (page // esize, V * K, K, 1), conv // esize)
    return pool.copy_(states)


def _gen(seed, dev):
    # on the device: a 1024-request verify pool at H32 is 8.6 GB of fp32, slow to draw on the host
    return torch.Generator(device=dev).manual_seed(seed)


def inputs(kind, rows, H, state_dtype, lower_bound, args, dev, seed=0):
    """(call kwargs with the pool / initial state, the pool or None) as the layers build them."""
    gen = _gen(seed, dev)
    bf = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, device=dev) * scale).bfloat16()  # noqa: E731
    A_log = torch.rand(H, generator=gen, device=dev) * 0.5
    dt_bias = torch.randn(H * K, generator=gen, device=dev) * 0.5
    if kind == "decode":
        pool = new_pool(rows + 1, H, state_dtype, args, dev, gen)
        proj = bf(rows, H + 8)
        idx = (torch.randperm(rows, generator=gen, device=dev) + 1).to(torch.int32)
        return dict(mixed_qkv=bf(rows, 3 * H * K), raw_g=bf(1, rows, H, K), raw_beta=proj[:, :H].unsqueeze(0),
                    A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, initial_state=pool, state_indices=idx), pool
    if kind == "verify":
        tm = args.spec_tokens
        T = rows * tm
        mixed = bf(T, 3 * H * K)
        q, k, v = (x.unflatten(1, (H, K)).unsqueeze(0) for x in mixed.split(H * K, dim=-1))
        pool = new_pool(rows * tm + 1, H, state_dtype, args, dev, gen)
        table = (torch.randperm(rows * tm, generator=gen, device=dev) + 1).view(rows, tm).to(torch.int32)
        nat = torch.randint(1, tm + 1, (rows,), generator=gen, device=dev).to(torch.int32)
        return dict(q=q, k=k, v=v, raw_g=bf(1, T, H, K), raw_beta=bf(1, T, H + 8)[..., :H], A_log=A_log,
                    dt_bias=dt_bias, lower_bound=lower_bound, initial_state=pool,
                    cu_seqlens=torch.arange(0, T + 1, tm, dtype=torch.int32, device=dev),
                    ssm_state_indices=table, num_accepted_tokens=nat), pool
    lengths = [args.prefill_len] * rows if kind == "prefill" else [1] * rows + [args.mixed_prompt]
    T, N = sum(lengths), len(lengths)
    h0 = (torch.randn(N, H, V, K, generator=gen, device=dev) * 0.05).to(state_dtype)
    return dict(q=bf(1, T, H, K), k=bf(1, T, H, K), v=bf(1, T, H, V), raw_g=bf(1, T, H, K),
                raw_beta=bf(1, T, H + 8)[..., :H], A_log=A_log, g_bias=dt_bias, lower_bound=lower_bound,
                initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=torch.tensor([0] + lengths, device=dev).cumsum(0).to(torch.int32)), None


NAMES = {"decode": "fused_recurrent_kda_packed_decode", "verify": "fused_recurrent_kda",
         "prefill": "chunk_kda_with_fused_gate", "mixed": "chunk_kda_with_fused_gate"}


def with_pool(call, pool):
    return dict(call, initial_state=pool) if pool is not None else call


def reference(kind, call):
    """flashkda_ext.reference on the call (the dry run's comparison, where Triton cannot run)."""
    from flashkda_ext.reference import kda_decode_step, kda_recurrent, kda_verify_step
    lb = call["lower_bound"]
    gate = dict(gate="softplus") if lb is None else dict(gate="bounded", lower_bound=lb)
    if kind == "decode":
        m = call["mixed_qkv"]
        B, H = m.shape[0], call["raw_g"].shape[2]
        q, k, v = m.view(B, 3, H, K).unbind(1)
        o, pool = kda_decode_step(q, k, v, call["raw_g"][0], call["raw_beta"][0], state=call["initial_state"],
                                  state_indices=call["state_indices"], A_log=call["A_log"], dt_bias=call["dt_bias"],
                                  null_slot0=True, **gate)
        return o.unsqueeze(0), pool
    if kind == "verify":
        return kda_verify_step(*(call[n] for n in ("q", "k", "v", "raw_g", "raw_beta")), state=call["initial_state"],
                               state_indices=call["ssm_state_indices"], cu_seqlens=call["cu_seqlens"],
                               num_accepted_tokens=call["num_accepted_tokens"], A_log=call["A_log"],
                               dt_bias=call["dt_bias"], null_slot0=True, **gate)
    o, h, _ = kda_recurrent(*(call[n] for n in ("q", "k", "v", "raw_g", "raw_beta")), A_log=call["A_log"],
                            dt_bias=call["g_bias"], cu_seqlens=call["cu_seqlens"], initial_state=call["initial_state"],
                            **gate)
    return o, h


def own_v(name, call):
    """The call with a copy of v for vLLM's Triton chunk prefill, which writes its output into v when given no
    `out` (chunk.py, _chunk_kda_fwd_with_cumulative_g: `o=v if out is None else out`): the other arms keep the
    input."""
    return dict(call, v=call["v"].clone()) if name == "chunk_kda_with_fused_gate" and call.get("out") is None \
        else call


def agreement(kind, call, pool, ours_fn, theirs_fn):
    """(rel. L2 of the outputs, of the pools / final states) on fresh copies of the pools (and of v for vLLM's
    chunk prefill, own_v)."""
    a_pool, b_pool = copy_pool(pool), copy_pool(pool)
    o1, s1 = ours_fn(**with_pool(call, a_pool))
    if theirs_fn is None:
        o2, s2 = reference(kind, with_pool(call, b_pool))
    else:
        o2, s2 = theirs_fn(**with_pool(own_v(NAMES[kind], call), b_pool))
    if pool is not None:
        s1, s2 = a_pool, (b_pool if theirs_fn is not None else s2)
    return harness.rel_l2(o1, o2), harness.rel_l2(s1, s2)


def fla_arm(kind, call, pool):
    """fla's kernels on the same inputs (None where fla does not import or lacks the path)."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:  # noqa: BLE001  fla absent: no third arm
        return None
    lb = call["lower_bound"]
    gate = "softplus" if lb is None else "bounded"
    if kind == "decode":
        m = call["mixed_qkv"]
        B, H = m.shape[0], call["raw_g"].shape[2]
        q, k, v = (x.contiguous() for x in m.view(B, 3, H, K).unbind(1))
        return harness.fla_decode_fn(q, k, v, call["raw_g"][0].contiguous(), call["raw_beta"][0].contiguous(),
                                     state=pool, state_indices=call["state_indices"], A_log=call["A_log"],
                                     dt_bias=call["dt_bias"], gate=gate, lower_bound=lb)
    if kind == "verify":
        q, k, v = (call[n].contiguous() for n in ("q", "k", "v"))
        g, beta = call["raw_g"], call["raw_beta"].contiguous()
        return lambda: fused_recurrent_kda_fwd(
            q, k, v, g, beta, A_log=call["A_log"], dt_bias=call["dt_bias"], initial_state=pool, scale=K ** -0.5,
            inplace_final_state=True, state_v_first=True, cu_seqlens=call["cu_seqlens"],
            ssm_state_indices=call["ssm_state_indices"], num_accepted_tokens=call["num_accepted_tokens"],
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lb)
    return harness.fla_prefill_fn(call["q"], call["k"], call["v"], call["raw_g"], call["raw_beta"].contiguous(),
                                  A_log=call["A_log"], dt_bias=call["g_bias"], gate=gate, lower_bound=lb,
                                  cu_seqlens=call["cu_seqlens"], initial_state=call["initial_state"])


def flashkda_arm(fn, call, checkpoint_offsets=None):
    """() -> (out, final_state) of `fn` (vLLM's `_flashkda_prefill`, or an adapter in its place) as the K3 layer
    calls it on this benchmark's call (peer_flashkda.prefill_fn; the closure's `checkpoint_state` with
    checkpoint_offsets)."""
    return peer_flashkda.prefill_fn(call["q"], call["k"], call["v"], call["raw_g"], call["raw_beta"],
                                    A_log=call["A_log"], dt_bias=call["g_bias"], lower_bound=call["lower_bound"],
                                    cu_seqlens=call["cu_seqlens"], initial_state=call["initial_state"], fn=fn,
                                    checkpoint_offsets=checkpoint_offsets)


def split_arm(call, decodes):
    """The mixed step as two kda_prefill calls (decodes first, then the prompt), each routed by its own lengths:
    () -> (out, final_state) like the adapter's. Inputs dense as vLLM passes them to the chunk call."""
    import flashkda_ext as fk
    q, k, v, g, beta = (call[n] for n in ("q", "k", "v", "raw_g", "raw_beta"))
    lb = call["lower_bound"]
    gate = dict(gate="softplus") if lb is None else dict(gate="bounded", lower_bound=lb)
    cu, T = call["cu_seqlens"], q.shape[1]
    parts = [(slice(0, decodes), cu[:decodes + 1], slice(0, decodes), 1),
             (slice(decodes, T), cu[decodes:] - decodes, slice(decodes, cu.shape[0] - 1), T - decodes)]
    init = call["initial_state"]

    def run():
        h0 = init.float()
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        final = torch.empty(h0.shape, dtype=torch.float32, device=v.device)
        for tok, offsets, seqs, longest in parts:
            fk.kda_prefill(*(x[:, tok].contiguous() for x in (q, k, v, g)), beta[:, tok].contiguous(),
                           A_log=call["A_log"], dt_bias=call["g_bias"], scale=None, beta_is_logit=True,
                           cu_seqlens=offsets, initial_state=h0[seqs], final_state=final[seqs],
                           out=out[:, tok], max_seqlen=longest, **gate)
        return out, final
    return run


def measure(run, args, kind, name, rows, H, sd, lb, call, pool, adapter, original, fkda_vllm, site, served,
            rel_o, rel_s, how, accuracy, failed, flashkda=None, checkpoint_offsets=None):
    """One point after its agreement check: the accuracy record, then the arms timed side by side."""
    ok = fkda_vllm.STATS[site, "served"] == served + 1
    good = ok and rel_o < args.tol and rel_s < args.tol
    if kind == "mixed":     # the point is the route by the prompt: a call routed by the mean fails it
        good = good and len(how) == 1 and how[0].startswith("longest from vLLM's metadata")
    accuracy.append({"case": name, "served": ok, "rel_l2_out": rel_o, "rel_l2_state": rel_s, "ok": good,
                     "against": "vllm_triton" if original else "reference", "routed": how})
    if not good:
        failed.append(name)
    arms, notes_extra, ref = [], {}, []

    def ours_once():
        """Ours on the call, for the candidates' agreement (computed once a point)."""
        if not ref:
            ref.append(adapter(**dict(call)))
        return ref[0]
    if ok:
        mine = with_pool(call, copy_pool(pool))
        arms.append(harness.Arm("ours", lambda c=mine: adapter(**c)))
        if kind == "mixed":
            # a copy of the offsets is not the metadata's tensor: the lookup misses and the call routes by the mean
            by_mean = dict(mine, cu_seqlens=call["cu_seqlens"].clone())
            arms.append(harness.Arm("ours_by_mean", lambda c=by_mean: adapter(**c)))
            split = split_arm(call, rows)
            o_s, h_s = split()
            o_r, h_r = ours_once()
            notes_extra["split_rel_l2_out"] = harness.rel_l2(o_s, o_r)
            notes_extra["split_rel_l2_state"] = harness.rel_l2(h_s, h_r)
            if max(notes_extra["split_rel_l2_out"], notes_extra["split_rel_l2_state"]) >= args.tol:
                failed.append(f"{name} (split)")
            arms.append(harness.Arm("split", split))
    if original is not None:
        theirs = with_pool(own_v(NAMES[kind], call), copy_pool(pool))
        arms.append(harness.Arm("vllm_triton", lambda c=theirs: original(**c)))
        if flashkda is not None and kind in ("prefill", "mixed") and lb is not None:
            fk_run = flashkda_arm(flashkda, call, checkpoint_offsets)
            o_f, h_f = fk_run()
            o_r, h_r = ours_once()
            notes_extra["flashkda_rel_l2_out"] = harness.rel_l2(o_f, o_r)
            notes_extra["flashkda_rel_l2_state"] = harness.rel_l2(h_f.float(), h_r)
            arms.append(harness.Arm("vllm_flashkda", fk_run))
            # the opt-in k3_layer adapter in FlashKDA's place: its buffers, the final state in the pool's dtype
            layer_site = "k3_layer._flashkda_prefill"
            k3_run = flashkda_arm(fkda_vllm.adapter_for(layer_site, flashkda), call, checkpoint_offsets)
            if checkpoint_offsets is not None:   # the cut calls' checkpoint rows against FlashKDA's
                layer_served = fkda_vllm.STATS[layer_site, "served"]
                k3_run()
                rows_cut = [r for r, o in enumerate(checkpoint_offsets.tolist()) if o]
                notes_extra["checkpoints"] = len(rows_cut)
                notes_extra["flashkda_rel_l2_checkpoint"] = harness.rel_l2(
                    k3_run.checkpoint_state[rows_cut].float(), fk_run.checkpoint_state[rows_cut].float())
                if fkda_vllm.STATS[layer_site, "served"] != layer_served + 1 or \
                        notes_extra["flashkda_rel_l2_checkpoint"] >= args.tol:
                    failed.append(f"{name} (k3_layer checkpoints)")
            arms.append(harness.Arm("ours_k3_layer", k3_run))
        if not args.no_fla:
            fla = fla_arm(kind, call, copy_pool(pool))
            if fla is not None:
                arms.append(harness.Arm("fla", fla))
    nbytes = None if pool is None else harness.state_bytes(
        rows * H * (args.spec_tokens if kind == "verify" else 1), K, V, sd)
    params = dict(kind=kind, rows=rows, H=H, state_dtype=str(sd), lower_bound=lb)
    if kind == "mixed":
        params["prompt"] = args.mixed_prompt
        if args.mixed_cached:
            params["cached"] = args.mixed_cached
    run.add(harness.Case(name, params, arms, bytes=nbytes,
                         notes={"rel_l2_out": rel_o, "rel_l2_state": rel_s, "served": ok, "routed": how,
                                **notes_extra}))


def adapter_counters(fkda_vllm) -> dict:
    """The results' record of the adapters' served / fallback counts and fallback reasons, per call site."""
    return {"adapter_counts": {f"{s}|{w}": n for (s, w), n in fkda_vllm.STATS.items()},
            "fallback_reasons": {f"{s}|{r}": n for (s, r), n in fkda_vllm.REASONS.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap)
    ap.add_argument("--engine-dir", default=str(ROOT / ".engines" / "vllm"))
    ap.add_argument("--kinds", default="decode,verify,prefill,mixed")
    ap.add_argument("--rows", default="1,4,16,64,256,1024",
                    help="decode rows / verify requests / prefill sequences / mixed: decodes beside the prompt")
    ap.add_argument("--heads", default="8,12,24,32")
    ap.add_argument("--state-dtypes", default="float32,bfloat16")
    ap.add_argument("--lower-bound", type=float, default=-5.0, help="the bounded gate (K3); nan: softplus")
    ap.add_argument("--spec-tokens", type=int, default=4, help="verify: T_max (draft tokens + 1)")
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--prefill-max-rows", type=int, default=64, help="prefill: rows above this are left out")
    ap.add_argument("--mixed-prompt", type=int, default=4096, help="mixed: the prompt chunk's tokens")
    ap.add_argument("--mixed-cached", type=int, default=0,
                    help="mixed: tokens of the prompt cached before the step (a multiple of 16 > 0: prefix caching's "
                         "checkpoint falls inside the chunk, as vLLM's offset rule puts it; the FlashKDA and "
                         "ours_k3_layer arms then write it)")
    ap.add_argument("--paged", action="store_true", help="pools as vLLM pages them (conv state first in a page)")
    ap.add_argument("--tol", type=float, default=1e-2, help="rel. L2 agreement bound (bf16 inputs)")
    args = ap.parse_args(argv)
    cfg = harness.config_from_args(args)
    if args.quick:
        args.rows, args.heads = "1,64,1024", "8,32"
    if args.dry_run:
        args.rows, args.heads, args.prefill_len, args.mixed_prompt = "1,3", "2", 32, 40
    dev = torch.device(cfg.device)
    ops, fkda_vllm = load_vllm(Path(args.engine_dir))
    step_ns = vllm_step_metadata.load(Path(args.engine_dir)) if "mixed" in args.kinds.split(",") else None
    flashkda, flashkda_why = peer_flashkda.load(Path(args.engine_dir)) if cfg.is_cuda else (None, "no CUDA")
    lb = None if args.lower_bound != args.lower_bound else args.lower_bound   # nan: softplus
    kinds = [k for k in args.kinds.split(",") if k]
    rows_list = [int(r) for r in args.rows.split(",")]
    heads = [int(h) for h in args.heads.split(",")]
    dtypes = [getattr(torch, d) for d in args.state_dtypes.split(",")]
    run = harness.Run("bench_vllm", cfg, baseline="vllm_triton" if cfg.is_cuda else None,
                      extra_meta={"vllm": "0.34.0 (wheel, kimi_k3 nvidia ops)", "lower_bound": lb,
                                  "spec_tokens": args.spec_tokens, "prefill_len": args.prefill_len,
                                  "mixed_prompt": args.mixed_prompt, "mixed_cached": args.mixed_cached,
                                  "paged": args.paged})
    points = [(kind, r, H, sd) for kind in kinds for r in rows_list for H in heads for sd in dtypes
              if not (kind == "prefill" and r > args.prefill_max_rows)]
    run.start(len(points))
    accuracy, failed = [], []
    with torch.inference_mode():
        for kind, rows, H, sd in points:
            name = f"{kind} rows={rows} H={H} {str(sd).split('.')[-1]}"
            adapter = getattr(ops, NAMES[kind])
            original = adapter.__wrapped__ if cfg.is_cuda else None
            call, pool = inputs(kind, rows, H, sd, lb, args, dev)
            site = f"k3.{NAMES[kind]}"
            served = fkda_vllm.STATS[site, "served"]
            step, checkpoint_offsets = contextlib.nullcontext(), None
            if kind == "mixed":
                # the step's metadata holds the very offsets tensor the call passes, as in vLLM
                m = vllm_step_metadata.step(step_ns, [1] * rows + [args.mixed_prompt], dev)
                call["cu_seqlens"] = m.non_spec_query_start_loc
                if args.mixed_cached:
                    vllm_step_metadata.with_checkpoints(step_ns, m, [0] * rows + [args.mixed_cached])
                    if m.checkpoint is None:
                        raise SystemExit(f"--mixed-cached {args.mixed_cached}: vLLM's rule puts no checkpoint in "
                                         f"a {args.mixed_prompt}-token chunk after it")
                    checkpoint_offsets = m.checkpoint.checkpoint_offsets
                step = vllm_step_metadata.forward(step_ns, {"model.layers.0.self_attn": m})
            with step:
                routed = dict(fkda_vllm.ROUTED)
                try:
                    rel_o, rel_s = agreement(kind, call, pool, adapter, original)
                except Exception as e:  # noqa: BLE001  a point that cannot run is recorded, the sweep goes on
                    run.skipped.append({"case": name, "error": f"{type(e).__name__}: {e}"[:300]})
                    failed.append(name)
                    continue
                how = [k[1] for k, n in fkda_vllm.ROUTED.items() if k[0] == site and n > routed.get(k, 0)]
                measure(run, args, kind, name, rows, H, sd, lb, call, pool, adapter, original, fkda_vllm, site,
                        served, rel_o, rel_s, how, accuracy, failed, flashkda, checkpoint_offsets)
    run.extra["accuracy"] = accuracy
    run.extra.update(adapter_counters(fkda_vllm))
    run.extra["prefill_routed"] = {f"{s}|{r}": n for (s, r), n in fkda_vllm.ROUTED.items()}
    run.extra["vllm_flashkda"] = "timed (bounded gate prefill and mixed points)" if flashkda else flashkda_why
    run.finish()
    for a in accuracy:
        print(f"{a['case']:<40} served={a['served']} out {a['rel_l2_out']:.2e} state {a['rel_l2_state']:.2e} "
              f"vs {a['against']}{'' if a['ok'] else '  <-- FAIL'}")
    if failed:
        print(f"{len(failed)} point(s) failed agreement or did not run: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
