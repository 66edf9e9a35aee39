"""Kimi K3's native fused decode in vLLM 0.34.0 (`vllm._custom_ops.fused_kda_decode`: conv update, gate, KDA step,
gated RMSNorm in one launch of vLLM's `_C` extension; the layer's "auto" decode at 12 / 24 / 48 / 96 heads on an
H200) against flashkda_ext's adapter of it (integrations/vllm/k3_native.py -> fused_kda_decode), on identical
inputs as the layer holds them, one run (issue 45).

The vLLM side: the wheel's wrapper, compiled from the prepared folder's vllm/_custom_ops.py, over the wheel's own
extension, carried thinned to its sm_90 entries and xz-compressed (scripts/fatbin_thin.py; the same cubins):

    python3 scripts/prepare_vllm_engine.py --native      # -> .engines/vllm (+ _C, 15 MB; carry it)
    python3 benchmarks/bench_vllm_native.py --out results/
    python3 benchmarks/bench_vllm_native.py --dry-run    # CPU: the adapter against flashkda_ext.reference

Each point: rows 1-1024 one-token decodes on distinct slots (slot 0, vLLM's null block, unused), H heads, fp32
state (the native kernel's only), the bounded gate (--lower-bound; nan: softplus), the layer's inputs: x, output
gate and beta column slices of one projection, raw g [1, T, H, D], the conv cache in vLLM's default layout
(--conv-layout SD: [slots, 3, 3*H*D] through the layer's transpose; DS: [slots, 3*H*D, 3]) and the state pool in one
paged cache, the width-major decode weight [3, 4, H*D] as the layer's loader fills it. Agreement first, on fresh
copies of the cache: output and state rel. L2 below --tol, the conv cache bitwise (both shift the same bf16 values).
Arms: "ours" (the adapter; it must serve) and "vllm_native"; the table is the harness's, baseline vllm_native.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm  # noqa: E402
import harness  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fatbin_thin  # noqa: E402
import prepare_vllm_engine  # noqa: E402
import vllm_step_metadata  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
D, W = 128, 4
SITE = "k3_native.fused_kda_decode"


def layer_call(rows, H, gen, dev, conv_layout="SD", lower_bound=-5.0, slots=None, indices=None):
    """(the layer's call of ops.fused_kda_decode, the paged cache's storage, the canonical conv weight [3*H*D, 4]):
    x, output_gate and raw_beta column slices of one projection (kda.py's forward splits its in_proj output),
    raw_g [1, T, H, D], the conv cache and the fp32 state of one paged cache (a page a slot: conv cache, then
    state), the width-major weight as the layer's _make_decode_conv1d_weight_loader fills it, out [1, T, H, D]
    poisoned. Slots 1..rows in a random order unless `indices`."""
    HD, C = H * D, 3 * H * D
    slots = rows + 2 if slots is None else slots
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    proj = r(rows, C + HD + HD + H + 8).to(torch.bfloat16)
    x, og = proj[:, :C], proj[:, C:C + HD].view(rows, H, D)
    raw_beta = proj[:, C + 2 * HD:C + 2 * HD + H].unsqueeze(0)
    raw_g = r(1, rows, H, D).to(torch.bfloat16)
    conv_bytes, page = C * (W - 1) * 2, C * (W - 1) * 2 + HD * D * 4
    store = torch.zeros(slots * page, dtype=torch.uint8, device=dev)
    conv, state = cache_views(store, slots, H, conv_layout)
    conv.copy_((0.2 * r(slots, C, W - 1)).to(torch.bfloat16))
    state.copy_(0.05 * r(slots, H, D, D))
    conv_weight = 0.3 * r(C, 1, W)                      # the layer's conv1d.weight [3*H*D, 1, 4], fp32
    decode_weight = torch.empty(3, W, HD, device=dev)
    for part in range(3):   # _make_decode_conv1d_weight_loader: loaded_shard.squeeze(1).transpose(0, 1)
        decode_weight[part].copy_(conv_weight[part * HD:(part + 1) * HD].squeeze(1).transpose(0, 1))
    if indices is None:
        indices = (torch.randperm(rows, generator=gen, device=dev) + 1).tolist()
    call = dict(x=x, weight=decode_weight, bias=None, conv_state=conv, raw_g=raw_g, raw_beta=raw_beta,
                A_log=0.5 * r(H), dt_bias=0.1 * r(HD), state_indices=torch.tensor(indices, dtype=torch.int32, device=dev),
                state=state, out=torch.full((1, rows, H, D), float("nan"), dtype=torch.bfloat16, device=dev),
                lower_bound=lower_bound, output_gate=og, norm_weight=r(D), norm_eps=1e-5)
    assert conv.data_ptr() - store.data_ptr() == 0 and state.data_ptr() - store.data_ptr() == conv_bytes
    return call, store, conv_weight.view(C, W)


def cache_views(store, slots, H, conv_layout):
    """(conv_state [slots, 3*H*D, 3], state [slots, H, D, D] fp32) over the paged cache `store`."""
    C = 3 * H * D
    conv_bytes = C * (W - 1) * 2
    page = conv_bytes + H * D * D * 4
    if conv_layout == "SD":     # vLLM's default [slots, 3, C], seen through the layer's transpose
        conv = torch.as_strided(store.view(torch.bfloat16), (slots, W - 1, C), (page // 2, C, 1)).transpose(-1, -2)
    else:
        conv = torch.as_strided(store.view(torch.bfloat16), (slots, C, W - 1), (page // 2, W - 1, 1))
    state = torch.as_strided(store.view(torch.float32), (slots, H, D, D), (page // 4, D * D, D, 1), conv_bytes // 4)
    return conv, state


def on_copy(call, store, H, conv_layout):
    """The call on a fresh copy of the paged cache (and of out)."""
    fresh = store.clone()
    conv, state = cache_views(fresh, call["state"].shape[0], H, conv_layout)
    return dict(call, conv_state=conv, state=state, out=torch.empty_like(call["out"])), fresh


def load_native(engine_dir: Path):
    """(vLLM's wrapper over its loaded `_C`, None) or (None, why)."""
    packed = engine_dir / prepare_vllm_engine.NATIVE_PACKED
    if not packed.exists():
        return None, f"{packed} missing: run `python3 scripts/prepare_vllm_engine.py --native`"
    try:
        so = fatbin_thin.unpack(packed, Path(tempfile.mkdtemp()) / "_C_stable_libtorch.abi3.so")
        torch.ops.load_library(str(so))
        torch.ops._C.fused_kda_decode      # noqa: B018  (registered by the extension)
    except Exception as e:  # noqa: BLE001  the reason goes into the results
        return None, f"vLLM's _C did not load: {type(e).__name__}: {e}"[:300]
    return vllm_step_metadata.fused_kda_decode(engine_dir), None


def reference_arm(call, weight):
    """flashkda_ext.reference on the call: (out [1, T, H, D], conv cache, state)."""
    from flashkda_ext.reference.decode import fused_kda_decode_step
    lb = call["lower_bound"]
    o, conv, state = fused_kda_decode_step(
        call["x"], weight, call["conv_state"], call["raw_g"][0], call["raw_beta"][0], call["A_log"], call["dt_bias"],
        call["state_indices"], call["state"], call["output_gate"], call["norm_weight"],
        gate="softplus" if lb is None else "bounded", lower_bound=lb, null_slot0=True)
    return o.unsqueeze(0), conv, state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap)
    ap.add_argument("--engine-dir", default=str(ROOT / ".engines" / "vllm"))
    ap.add_argument("--rows", default="1,4,16,64,256,1024")
    ap.add_argument("--heads", default="12,24,48,96")
    ap.add_argument("--lower-bound", type=float, default=-5.0, help="the bounded gate (K3); nan: softplus")
    ap.add_argument("--conv-layout", default="SD", choices=("SD", "DS"))
    ap.add_argument("--tol", type=float, default=1e-2, help="rel. L2 agreement bound (bf16 output)")
    args = ap.parse_args(argv)
    cfg = harness.config_from_args(args)
    if args.quick:
        args.rows, args.heads = "1,64,1024", "12,96"
    if args.dry_run:
        args.rows, args.heads = "1,3", "2"
    dev = torch.device(cfg.device)
    from flashkda_ext.integrations import vllm as fkda_vllm
    native, why = load_native(Path(args.engine_dir)) if cfg.is_cuda else (None, "no CUDA")
    if cfg.is_cuda and native is None:
        raise SystemExit(why)
    wrapper = native or vllm_step_metadata.fused_kda_decode(Path(args.engine_dir))
    adapter = fkda_vllm.adapter_for(SITE, wrapper)
    lb = None if args.lower_bound != args.lower_bound else args.lower_bound
    points = [(r, h) for r in (int(x) for x in args.rows.split(",")) for h in (int(x) for x in args.heads.split(","))]
    run = harness.Run("bench_vllm_native", cfg, baseline="vllm_native" if native else None,
                      extra_meta={"vllm": "0.34.0 (wheel: _custom_ops.fused_kda_decode over its _C, sm_90 entries)",
                                  "lower_bound": lb, "conv_layout": args.conv_layout, "state": "float32"})
    run.start(len(points))
    accuracy, failed = [], []
    with torch.inference_mode():
        for rows, H in points:
            name = f"native decode rows={rows} H={H}"
            call, store, weight = layer_call(rows, H, torch.Generator(device=dev).manual_seed(rows * 131 + H), dev,
                                             args.conv_layout, lb)
            served = fkda_vllm.STATS[SITE, "served"]
            mine, _ = on_copy(call, store, H, args.conv_layout)
            o1 = adapter(**mine)
            ok = fkda_vllm.STATS[SITE, "served"] == served + 1
            if native is not None:
                theirs, _ = on_copy(call, store, H, args.conv_layout)
                o2 = native(**theirs)
                conv2, state2 = theirs["conv_state"], theirs["state"]
            else:
                o2, conv2, state2 = reference_arm(call, weight)
            rel_o = harness.rel_l2(o1.float(), o2.float())
            rel_s = harness.rel_l2(mine["state"], state2.to(mine["state"].dtype))
            conv_same = bool(torch.equal(mine["conv_state"], conv2.to(mine["conv_state"].dtype)))
            good = ok and rel_o < args.tol and rel_s < args.tol and conv_same
            accuracy.append({"case": name, "served": ok, "rel_l2_out": rel_o, "rel_l2_state": rel_s,
                             "conv_bitwise": conv_same, "ok": good,
                             "against": "vllm_native" if native else "reference"})
            if not good:
                failed.append(name)
            arms = []
            if ok:
                c1, _ = on_copy(call, store, H, args.conv_layout)
                arms.append(harness.Arm("ours", lambda c=c1: adapter(**c)))
            if native is not None:
                c2, _ = on_copy(call, store, H, args.conv_layout)
                arms.append(harness.Arm("vllm_native", lambda c=c2: native(**c)))
            run.add(harness.Case(name, dict(kind="native_decode", rows=rows, H=H, state_dtype=str(torch.float32),
                                             lower_bound=lb), arms,
                                 bytes=harness.state_bytes(rows * H, D, D, torch.float32),
                                 notes={"rel_l2_out": rel_o, "rel_l2_state": rel_s, "conv_bitwise": conv_same,
                                        "served": ok}))
    run.extra["accuracy"] = accuracy
    run.extra.update(bench_vllm.adapter_counters(fkda_vllm))
    run.finish()
    for a in accuracy:
        print(f"{a['case']:<36} served={a['served']} out {a['rel_l2_out']:.2e} state {a['rel_l2_state']:.2e} "
              f"conv {'bitwise' if a['conv_bitwise'] else 'DIFFERS'} vs {a['against']}{'' if a['ok'] else '  <-- FAIL'}")
    if failed:
        print(f"{len(failed)} point(s) failed agreement: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
