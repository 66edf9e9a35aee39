"""SGLang 0.5.23's own Triton KDA kernels against flashkda_ext through its SGLang adapter, on the same inputs.

    python benchmarks/bench_sglang.py --prepare      # once: copy SGLang's kernel files out of the pinned wheel
    python benchmarks/bench_sglang.py [--quick] [--phases decode,extend,verify] [--out DIR]

--prepare finds the sglang 0.5.23 wheel (--wheel, FLASHKDA_EXT_ENGINE_WHEELS, .cache/engines/, else a pinned
`pip download --no-deps`) and copies exactly the files below into the ignored .engines/sglang/. The run then
imports them by path with the stubs named in `_stub` (platform probes answered for this GPU; nothing else of
SGLang is imported) and calls SGLang's real TritonKDAKernel methods, as its KDAKernelDispatcher does:

  packed_decode  (forward_decode's route: mixed_qkv after the conv)   vs FlashKDAExtKernel.packed_decode
  extend         (chunk_kda on the pool, raw gate and beta logits)    vs FlashKDAExtKernel.extend
  target_verify  (chains of D drafts into the intermediate buffer;    vs FlashKDAExtKernel.target_verify
                 --tree: binary draft trees, retrieve_parent_token)
  graph_extend   (--phases graph_extend) one batch in one bucket of SGLang's breakable prefill CUDA graph, three
                 ways: FlashKDAExtKernel.extend as SGLang runs it where the graph breaks at a KDA layer (arm
                 "ours", eager: read its wall time, the Python counts); SGLang's real FlashInferKDAPrefillGraph
                 driving flashkda_ext's PrefillGraphWrapper (FLASHKDA_EXT_SGLANG_PREFILL_GRAPH=1; arm "captured",
                 read its graph time); SGLang's own captured extend, TritonKDAKernel.extend on the bucket's chunk
                 tables from its real KDAPrefillGraphMetadata (arm "sglang", graph time: SGLang's default)

over rows (requests) 1-1024, H = HV in {8, 12, 24, 32}, K = V = 128, bf16 activations, fp32 and bf16 state
pools, softplus gate (extend and graph_extend: --gate bounded for Kimi K3's, lower_bound -5; --extend-batches for
extend batches of mixed lengths, e.g. 1x4000+32x100). Each point first checks agreement (rel. L2 of outputs and
written states from identical copies; the run exits 1 if any point disagrees), then times ours / SGLang's Triton / fla (decode and extend;
fla has no entry in SGLang's verify layout) with benchmarks/harness.py, speedups quoted against SGLang.
Not run here: SGLang's CUDA packed-decode fast path (sglang/kernels/ops/attention/kda_packed_decode.py, a
JIT module taken for B >= 8, K = V = 128, bf16 activations, fp32 pool): its JIT needs SGLang's runtime, so
`covered()` is stubbed False and SGLang's packed decode runs its Triton kernel at every point.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import types
import zipfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import engine_wheels  # noqa: E402
import harness  # noqa: E402

VERSION = "0.5.23"
ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / ".engines" / "sglang"
FLA = "sglang/kernels/ops/attention/fla/"
FLA_FILES = ("chunk_delta_h", "chunk_intra", "chunk_intra_token_parallel", "cumsum", "fused_norm_gate",
             "fused_recurrent", "index", "kda", "l2norm", "op", "utils")
FILES = tuple(FLA + f + ".py" for f in FLA_FILES) + (
    "sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py",
    "sglang/srt/layers/attention/linear/kernels/kernel_backend.py",
    "sglang/srt/layers/attention/linear/kernels/kda_triton.py",
    "sglang/srt/layers/attention/linear/kda_flashinfer_prefill_graph.py",
    "sglang/srt/layers/attention/linear/kda_prefill_graph.py")
K = V = 128
TOL = {"o": 2e-2, torch.float32: 1e-2, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------------------------------
# SGLang's kernels from the wheel


def find_wheel(given=None) -> Path:
    return engine_wheels.find_wheel("sglang", VERSION, given=given)


def prepare(wheel=None) -> Path:
    with zipfile.ZipFile(find_wheel(wheel)) as z:
        for name in FILES:
            target = ENGINE / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
    (ENGINE / "VERSION").write_text(VERSION + "\n")
    return ENGINE


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def _stub() -> None:
    """What the copied files import from the rest of SGLang, answered for this process's GPU."""
    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention.linear",
                 "sglang.kernels.jit", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention",
                 "sglang.srt.layers.attention.linear", "sglang.srt.layers.attention.linear.kernels"):
        _module(name, __path__=[str(ENGINE / name.replace(".", "/"))])
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    no = lambda *a, **k: False  # noqa: E731
    _module("sglang.srt.utils", __path__=[], is_cpu=no, is_hip=no, is_npu=no, is_xpu=no,
            is_cuda=torch.cuda.is_available, is_gfx95_supported=no, cpu_has_amx_support=no,
            get_device_sm=lambda: cap[0] * 10 + cap[1], is_sm90_supported=lambda: cap == (9, 0),
            cdiv=lambda a, b: -(-a // b), next_power_of_2=lambda n: 1 << (n - 1).bit_length())
    _module("sglang.srt.utils.common", torch_release=tuple(int(x) for x in torch.__version__.split("+")[0]
                                                           .split(".")[:2]))
    _module("sglang.kernels.jit.utils", is_arch_support_pdl=lambda: cap[0] >= 9,
            get_jit_cuda_arch=lambda: types.SimpleNamespace(major=cap[0], minor=cap[1]))
    # the CUDA packed-decode JIT module is not built here (module docstring): SGLang then runs Triton
    packed = _module("sglang.kernels.ops.attention.kda_packed_decode", covered=no)
    _module("sglang.kernels.ops.attention", __path__=[str(ENGINE / "sglang/kernels/ops/attention")],
            kda_packed_decode=packed)

    def ring(*a, **k):
        raise NotImplementedError("ReplaySSM is not part of this benchmark")
    _module("sglang.kernels.ops.attention.linear.fused_recurrent_linear_replayssm",
            fused_recurrent_linear_replayssm_decode=ring)


def load_sglang():
    """SGLang's TritonKDAKernel (the real class, on its real Triton ops) from .engines/sglang/."""
    if not (ENGINE / "VERSION").exists():
        raise SystemExit(f"{ENGINE} is missing: run `python benchmarks/bench_sglang.py --prepare` first")
    _stub()
    from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel
    return TritonKDAKernel()


# ---------------------------------------------------------------------------------------------
# inputs and agreement


def params(H, gen, dev):
    A_log = (torch.rand(H, generator=gen, device=dev) * 2.5 - 2.0).float()
    return A_log, (torch.randn(H * K, generator=gen, device=dev) * 0.5).float()


def decode_inputs(rows, H, sdt, gen, dev, slots):
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    mixed = r(rows, 3 * H * K).bfloat16()                 # H = HV, K = V: q | k | v after the conv
    a, b = (r(rows, H * K) - 1.0).bfloat16(), r(rows, H).bfloat16()
    A_log, dt_bias = params(H, gen, dev)
    pool = (r(slots, H, V, K) * 0.3).to(sdt)
    idx = torch.randperm(slots, generator=gen, device=dev)[:rows].to(torch.int32)
    return dict(mixed_qkv=mixed, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5, ssm_states=pool,
                cache_indices=idx, num_v_heads=H, head_v_dim=V)


def extend_inputs(lens, H, sdt, gen, dev, slots, lower_bound=None):
    """One extend batch of requests of these lengths on a pool of `slots` (raw gate: softplus, or the bounded gate
    with `lower_bound`, as Kimi K3 calls it)."""
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    rows, T = len(lens), sum(lens)
    q, k, v = (r(1, T, H, K).bfloat16() for _ in range(3))
    g, beta = (r(1, T, H, K) - 1.0).bfloat16(), r(1, T, H).bfloat16()
    A_log, dt_bias = params(H, gen, dev)
    pool = (r(slots, H, V, K) * 0.3).to(sdt)
    idx = torch.randperm(slots, generator=gen, device=dev)[:rows].to(torch.int32)
    qsl = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=dev)
    return (q, k, v, g, beta), dict(ssm_states=pool, cache_indices=idx, query_start_loc=qsl, A_log=A_log,
                                    dt_bias=dt_bias, lower_bound=lower_bound, beta_is_raw=True,
                                    extend_seq_lens_cpu=list(lens))


def parse_batches(spec):
    """'1x4000+32x100,8x1024+8x64' -> [('1x4000+32x100', [4000, 100, ...]), ...]: extend batches of these requests."""
    out = []
    for item in filter(None, spec.split(",")):
        lens = []
        for part in item.split("+"):
            n, _, length = part.partition("x")
            if not (n.isdigit() and length.isdigit()) or int(n) < 1:
                raise SystemExit(f"--extend-batches: {part!r} is not <requests>x<length>")
            lens += [int(length)] * int(n)
        out.append((item, lens))
    return out


def verify_inputs(rows, D, H, sdt, gen, dev, slots, tree=False):
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    T = rows * D
    q, k, v = (r(1, T, H, K).bfloat16() for _ in range(3))
    a, b = (r(T, H * K) - 1.0).bfloat16(), r(T, H).bfloat16()
    A_log, dt_bias = params(H, gen, dev)
    pool = (r(slots, H, V, K) * 0.3).to(sdt)
    idx = torch.randperm(slots, generator=gen, device=dev)[:rows].to(torch.int32)
    buf = torch.zeros(rows + 1, D, H, V, K, dtype=sdt, device=dev)     # MambaPool's rows + its discard row
    table = torch.arange(rows + 1, dtype=torch.int32, device=dev)      # build_verify_intermediate_state_indices
    return (A_log, dt_bias, q, k, v, a, b), dict(
        ssm_states=pool, cache_indices=idx, query_start_loc=torch.arange(0, T + 1, D, dtype=torch.int32, device=dev),
        intermediate_states_buffer=buf, intermediate_state_indices=table, cache_steps=D,
        retrieve_parent_token=binary_tree(rows, D, dev) if tree else None)


def binary_tree(rows, D, dev):
    """retrieve_parent_token [rows, D] int32 (as SGLang's graph buffers hold it) of a binary draft tree: token t's
    parent is (t - 1) // 2 (column 0: the root, -1)."""
    return (torch.arange(D, device=dev, dtype=torch.int32) - 1).div(2, rounding_mode="floor").repeat(rows, 1)


class _Struct:
    """msgspec.Struct where msgspec is not installed: the tables class only stores its fields."""
    def __init_subclass__(cls, **kwargs):
        pass

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def load_graph_tables():
    """SGLang's KDAPrefillGraphMetadata (a bucket's static tables, which its captured Triton extend reads) from
    .engines/sglang, after load_sglang(); its other imports answered: msgspec.Struct where msgspec is absent, the
    conv's block size (8, the wheel's value) and the track path's names (track=False here: not used)."""
    if importlib.util.find_spec("msgspec") is None:
        _module("msgspec", Struct=_Struct)
    _module("sglang.kernels.ops.mamba", __path__=[])
    _module("sglang.kernels.ops.mamba.causal_conv1d_triton", CAUSAL_CONV1D_FWD_BLOCK_M=8, PAD_SLOT_ID=-1,
            causal_conv1d_fn=None)
    _module("sglang.kernels.ops.mamba.kda_prefill_track", TRACK_CHUNK_STATE=2, TRACK_FINAL_STATE=1,
            kda_track_conv_window=None, kda_track_ssm_state=None)
    _module("sglang.srt.layers.attention.mamba", __path__=[])
    _module("sglang.srt.layers.attention.mamba.prefill_track_metadata", build_prefill_track_plan=None)
    from sglang.srt.layers.attention.linear.kda_prefill_graph import KDAPrefillGraphMetadata
    return KDAPrefillGraphMetadata


def load_prefill_graph():
    """SGLang's FlashInferKDAPrefillGraph (imports only numpy and torch) from .engines/sglang/, by path."""
    path = ENGINE / "sglang/srt/layers/attention/linear/kda_flashinfer_prefill_graph.py"
    spec = importlib.util.spec_from_file_location("sglang_kda_flashinfer_prefill_graph", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FlashInferKDAPrefillGraph


# graph_extend: (name, bucket tokens, lengths); max_seqs = min(bucket, 128), SGLang's default cap
GRAPH_EXTEND = [("b8192_1x8000", 8192, [8000]), ("b8192_4x2000", 8192, [2000] * 4),
                ("b8192_64x120", 8192, [120] * 64), ("b8192_1x4000_32x100", 8192, [4000] + [100] * 32),
                ("b512_1x500", 512, [500]), ("b512_16x30", 512, [30] * 16)]


def graph_extend_case(bucket, lens, H, sdt, gen, dev, ours, graph_cls, sglang=None, tables_cls=None,
                      lower_bound=None):
    """The eager extend (host lengths given, as SGLang passes them), the captured bucket's call and (with sglang
    and tables_cls) SGLang's captured Triton extend on the same batch; each on its own copy of the pool.
    Returns (eager fn, captured fn, sglang fn or None, agreement)."""
    from flashkda_ext.integrations.sglang.prefill_graph import PrefillGraphWrapper
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    T, N, max_seqs = sum(lens), len(lens), min(bucket, 128)
    q, k, v = (r(1, bucket, H, K).bfloat16() for _ in range(3))
    g, beta = (r(1, bucket, H, K) - 1.0).bfloat16(), r(1, bucket, H).bfloat16()
    A_log, dt_bias = params(H, gen, dev)
    pool = (r(2 * max_seqs, H, V, K) * 0.3).to(sdt)
    idx = torch.randperm(2 * max_seqs, generator=gen, device=dev)[:N].to(torch.int32)
    offsets = [0] + torch.tensor(lens).cumsum(0).tolist()
    qsl = torch.tensor(offsets, dtype=torch.int32, device=dev)
    pool_e, pool_c = pool.clone(), pool.clone()

    def eager():
        return ours.extend(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], ssm_states=pool_e, cache_indices=idx,
                           query_start_loc=qsl, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, beta_is_raw=True,
                           extend_seq_lens_cpu=list(lens))

    # SGLang's bucket tables as its KDAPrefillGraphMetadata.fill leaves them: padded sequences empty at the end
    # (-1 slots), the offsets' tail at the batch's token count
    meta = types.SimpleNamespace(
        cu_seqlens=torch.tensor(offsets + [T] * (max_seqs - N), dtype=torch.int64, device=dev),
        cache_indices=torch.cat([idx, torch.full((max_seqs - N,), -1, dtype=torch.int32, device=dev)]))
    captured_graph = graph_cls(wrapper_cls=PrefillGraphWrapper, num_tokens=bucket, max_seqs=max_seqs, track=False,
                               device=dev)
    captured_graph.fill(meta, list(lens), None)
    layer = types.SimpleNamespace(layer_id=0, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)

    def captured():
        return captured_graph.run(layer=layer, q=q, k=k, v=v, g=g, beta=beta, ssm_states=pool_c, h_track=None)

    triton = None
    if sglang is not None:
        tables = tables_cls.allocate(num_tokens=bucket, max_seqs_cap=max_seqs, track=False,
                                     cache_index_dtype=torch.int32, device=dev)
        tables.fill(extend_seq_lens=list(lens), cache_indices=idx,
                    extend_prefix_lens=torch.ones(N, dtype=torch.int64, device=dev), track_rows=None)
        pool_s = pool.clone()

        def triton():       # as kda_extend_in_graph calls the dispatcher's extend
            return sglang.extend(q, k, v, g, beta, ssm_states=pool_s, cache_indices=tables.cache_indices,
                                 query_start_loc=tables.cu_seqlens, A_log=A_log, dt_bias=dt_bias,
                                 lower_bound=lower_bound,
                                 beta_is_raw=True, extend_seq_lens_cpu=None, is_spec_decode=False,
                                 return_intermediate_states=False, track_state=None, track_chunk_idx=None,
                                 chunk_indices=tables.chunk_indices, chunk_offsets=tables.chunk_offsets)
    with torch.inference_mode():
        o_e, o_c = eager(), captured()
        o_s = triton() if triton is not None else None
    res = {"o": harness.rel_l2(o_e.float(), o_c[:, :T].float()),
           "state": harness.rel_l2(pool_e[idx.long()].float(), pool_c[idx.long()].float())}
    res["ok"] = res["o"] < TOL["o"] and res["state"] < TOL[sdt]
    if o_s is not None:
        o_s = o_s[0] if isinstance(o_s, tuple) else o_s
        res["o_sglang"] = harness.rel_l2(o_e.float(), o_s[:, :T].float())
        res["state_sglang"] = harness.rel_l2(pool_e[idx.long()].float(), pool_s[idx.long()].float())
        res["ok"] = res["ok"] and res["o_sglang"] < TOL["o"] and res["state_sglang"] < TOL[sdt]
    return eager, captured, triton, res


def _out(x):
    """[1, T, HV, V] from either kernel (SGLang's packed decode returns a transposed view)."""
    return x[0] if isinstance(x, tuple) else x


def agreement(phase, ours, sglang, args, kw) -> dict:
    """Both kernels once from identical copies of every state they write: rel. L2 of the outputs and of the
    states written (the pool for decode / extend, the buffer for verify)."""
    written = "intermediate_states_buffer" if phase == "target_verify" else "ssm_states"
    runs = {}
    for name, kern in (("ours", ours), ("sglang", sglang)):
        kw2 = dict(kw, **{written: kw[written].clone()})
        with torch.inference_mode():
            o = _out(getattr(kern, phase)(*args, **kw2))
        runs[name] = (o.reshape(-1, o.shape[-2], o.shape[-1]).float(), kw2[written].float())
    (o1, s1), (o2, s2) = runs["ours"], runs["sglang"]
    if phase == "target_verify":   # rows past the requests (the discard row) are written by neither
        s1, s2 = s1[:-1], s2[:-1]
    res = {"o": harness.rel_l2(o1, o2), "state": harness.rel_l2(s1, s2)}
    res["ok"] = res["o"] < TOL["o"] and res["state"] < TOL[kw[written].dtype]
    return res


# ---------------------------------------------------------------------------------------------
# the run


def fla_decode(inp):
    H = inp["num_v_heads"]
    q, k, v = (x.reshape(-1, H, K) for x in inp["mixed_qkv"].split([H * K] * 3, -1))
    return harness.fla_decode_fn(q.contiguous(), k.contiguous(), v.contiguous(), inp["a"].view(-1, H, K),
                                 inp["b"], state=inp["ssm_states"], state_indices=inp["cache_indices"],
                                 A_log=inp["A_log"], dt_bias=inp["dt_bias"], scale=inp["scale"])


def fla_extend(args, kw):
    q, k, v, g, beta = args
    pool = kw["ssm_states"]
    lb = kw.get("lower_bound")
    return harness.fla_prefill_fn(q, k, v, g, beta, A_log=kw["A_log"], dt_bias=kw["dt_bias"],
                                  gate="softplus" if lb is None else "bounded", lower_bound=lb,
                                  cu_seqlens=kw["query_start_loc"],
                                  initial_state=pool.index_select(0, kw["cache_indices"].long()))


def run_graph_extend(cfg, ours, sglang, heads, state_names, states, disagree, lower_bound=None) -> dict:
    graph_cls, tables_cls = load_prefill_graph(), load_graph_tables()
    run = harness.Run("sglang_graph_extend", cfg, baseline="sglang", primary_mode="graph",
                      extra_meta={"sglang": VERSION, "gate": "softplus" if lower_bound is None else "bounded",
                                  "lower_bound": lower_bound, "K": K, "V": V,
                                  "arms": "ours: the eager extend at SGLang's graph break (read its wall time: no "
                                          "graph mode); captured: flashkda_ext's wrapper in the bucket's graph; "
                                          "sglang: SGLang's Triton extend in the bucket's graph (its default)"})
    grid = [(s, H, c) for s in state_names for H in heads for c in GRAPH_EXTEND]
    run.start(len(grid))
    agree = {}
    for sname, H, (name, bucket, lens) in grid:
        gen = torch.Generator(device=cfg.device).manual_seed(H * 7919 + bucket + len(lens))
        eager, captured, triton, res = graph_extend_case(bucket, lens, H, states[sname], gen, cfg.device, ours,
                                                         graph_cls, sglang, tables_cls, lower_bound)
        label = f"{sname}_h{H}_{name}"
        agree[label] = res
        if not res["ok"]:
            disagree.append(("graph_extend", label, res))
        arms = [harness.Arm("ours", eager, graph=False), harness.Arm("captured", captured, graph=True),
                harness.Arm("sglang", triton, graph=True)]
        with torch.inference_mode():
            run.add(harness.Case(label, dict(state=sname, heads=H, bucket=bucket, rows=len(lens), tokens=sum(lens),
                                             phase="graph_extend"), arms, notes=dict(agreement=res)))
        torch.cuda.empty_cache()
    run.extra.update(agreement=agree)
    run.finish()
    return run.summary()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap)
    ap.add_argument("--prepare", action="store_true", help="copy SGLang's kernel files from the wheel and exit")
    ap.add_argument("--wheel", default=None, help="the sglang 0.5.23 wheel (default: found or downloaded)")
    ap.add_argument("--phases", default="decode,extend,verify")
    ap.add_argument("--rows", default="", help="comma list of requests (decode, verify)")
    ap.add_argument("--heads", default="", help="comma list of H = HV")
    ap.add_argument("--states", default="f32,bf16")
    ap.add_argument("--drafts", type=int, default=3, help="draft tokens per request (verify)")
    ap.add_argument("--tree", action="store_true",
                    help="verify: draft trees (token t's parent (t - 1) // 2, speculative topk > 1) instead of chains")
    ap.add_argument("--gate", choices=["softplus", "bounded"], default="softplus",
                    help="extend's and graph_extend's gate: softplus (Kimi-Linear) or bounded at lower_bound -5 "
                         "(Kimi K3)")
    ap.add_argument("--extend-batches", default="",
                    help="extend batches instead of the grid, e.g. '1x8000,4x2000,1x4000+32x100,8x1024+8x64'")
    args = ap.parse_args(argv)
    if args.prepare:
        print(f"prepared {prepare(args.wheel)}")
        return 0
    cfg = harness.config_from_args(args)
    if not cfg.is_cuda:
        raise SystemExit("bench_sglang.py needs a CUDA GPU (SGLang's kernels are Triton)")
    from flashkda_ext.integrations.sglang import REASONS, STATS, FlashKDAExtKernel
    sglang = load_sglang()
    ours = FlashKDAExtKernel(fallback=None)       # a fallback would be a silent SGLang arm: none here
    ints = lambda s, d: [int(x) for x in s.split(",")] if s else d  # noqa: E731
    rows_list = ints(args.rows, [1, 64, 1024] if args.quick else [1, 8, 32, 128, 512, 1024])
    heads = ints(args.heads, [8, 32] if args.quick else [8, 12, 24, 32])
    extend_grid = [(1, 4096), (16, 256), (1024, 16)] if args.quick else \
        [(1, 4096), (4, 1024), (16, 512), (64, 128), (256, 64), (1024, 16)]
    extend_grid = parse_batches(args.extend_batches) or [(f"r{n}x{L}", [L] * n) for n, L in extend_grid]
    lower_bound = -5.0 if args.gate == "bounded" else None
    states = {"f32": torch.float32, "bf16": torch.bfloat16}
    phases = args.phases.split(",")
    no_fla = args.no_fla or importlib.util.find_spec("fla") is None
    dev, disagree, summary = cfg.device, [], {}
    for phase in phases:
        if phase == "graph_extend":
            summary[phase] = run_graph_extend(cfg, ours, sglang, heads, args.states.split(","), states, disagree,
                                              lower_bound)
            continue
        method = {"decode": "packed_decode", "extend": "extend", "verify": "target_verify"}[phase]
        run = harness.Run(f"sglang_{phase}", cfg, baseline="sglang",
                          primary_mode="eager" if phase == "extend" else "graph",
                          extra_meta={"sglang": VERSION, "gate": args.gate if phase == "extend" else "softplus",
                                      "K": K, "V": V})
        grid = [(s, H, p) for s in args.states.split(",") for H in heads
                for p in (extend_grid if phase == "extend" else rows_list)]
        run.start(len(grid))
        agree = {}
        for sname, H, point in grid:
            sdt = states[sname]
            gen = torch.Generator(device=dev).manual_seed(H * 7919 + (len(point[1]) if phase == "extend" else point))
            if phase == "decode":
                inp = decode_inputs(point, H, sdt, gen, dev, slots=max(2 * point, 64))
                a_args, kw, name, rows = (inp.pop("mixed_qkv"), inp.pop("a"), inp.pop("b")), inp, f"r{point}", point
                fla_fn = None if no_fla else fla_decode(dict(inp, mixed_qkv=a_args[0], a=a_args[1], b=a_args[2]))
            elif phase == "extend":
                name, lens = point
                rows = len(lens)
                a_args, kw = extend_inputs(lens, H, sdt, gen, dev, slots=max(2 * rows, 64), lower_bound=lower_bound)
                fla_fn = None if no_fla else fla_extend(a_args, kw)
            else:
                rows = point
                a_args, kw = verify_inputs(rows, args.drafts, H, sdt, gen, dev, slots=max(2 * rows, 64),
                                           tree=args.tree)
                name, fla_fn = f"r{rows}_d{args.drafts}{'_tree' if args.tree else ''}", None
            label = f"{sname}_h{H}_{name}"
            res = agreement(method, ours, sglang, a_args, kw)
            agree[label] = res
            if not res["ok"]:
                disagree.append((phase, label, res))
            graph = phase != "extend"       # SGLang's chunk_kda reads its offsets on the host (a sync)
            arms = [harness.Arm("ours", lambda m=getattr(ours, method): m(*a_args, **kw), graph=graph),
                    harness.Arm("sglang", lambda m=getattr(sglang, method): m(*a_args, **kw), graph=graph)]
            if fla_fn is not None:
                arms.append(harness.Arm("fla", fla_fn, graph=graph))
            with torch.inference_mode():
                run.add(harness.Case(label, dict(state=sname, heads=H, rows=rows, phase=phase), arms,
                                     notes=dict(agreement=res)))
            del a_args, kw
            torch.cuda.empty_cache()
        run.extra.update(agreement=agree, served={"|".join(map(str, k)) if isinstance(k, tuple) else k: n
                                                  for k, n in STATS.items()}, fallbacks={f"{m}: {r}": n for (m, r), n in
                                                                          REASONS.items()})
        run.finish()
        summary[phase] = run.summary()
    print("summary", json.dumps(summary, default=str))
    for phase, label, res in disagree:
        print(f"DISAGREE {phase} {label}: {res}", file=sys.stderr)
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
