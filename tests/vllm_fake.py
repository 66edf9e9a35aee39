"""A stand-in for the vllm modules flashkda_ext.integrations.vllm rebinds, for tests without vllm installed:
vLLM's ops module and KDA layer module (paths and op signatures as in vLLM 638d6e97), their KDA ops as
recording stubs. A stub records each call's arguments and returns ("original", name), or what impls[name]
returns for them (the GPU test runs fla's Triton there)."""
import sys
import types

OPS = "vllm.third_party.flash_linear_attention.ops.kda"
LAYER = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
NAMES = ("fused_recurrent_kda", "fused_recurrent_kda_fwd", "chunk_kda", "chunk_kda_with_fused_gate",
         "fused_kda_gate")


def _args(local: dict) -> dict:
    """A stub's arguments (locals() also holds the closure's `record`)."""
    return {k: v for k, v in local.items() if k != "record"}


def _stubs(calls: list, impls: dict) -> dict:
    def record(name, args):
        calls.append((name, args))
        impl = impls.get(name)
        return impl(**args) if impl else ("original", name)

    # vLLM's signatures (vllm/third_party/flash_linear_attention/ops/kda.py @ 638d6e97)
    def fused_recurrent_kda_fwd(q, k, v, g, beta, scale, initial_state, inplace_final_state=True, cu_seqlens=None,
                                ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False):
        return record("fused_recurrent_kda_fwd", _args(locals()))

    def fused_recurrent_kda(q, k, v, g, beta=None, scale=None, initial_state=None, inplace_final_state=True,
                            use_qk_l2norm_in_kernel=True, cu_seqlens=None, ssm_state_indices=None, **kwargs):
        return record("fused_recurrent_kda", _args(locals()))

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        return record("chunk_kda", _args(locals()))

    def chunk_kda_with_fused_gate(q, k, v, raw_g, beta, A_log, g_bias, scale=None, initial_state=None,
                                  output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        return record("chunk_kda_with_fused_gate", _args(locals()))

    def fused_kda_gate(g, A, head_k_dim, g_bias=None, beta=1.0, threshold=20.0):
        return record("fused_kda_gate", _args(locals()))

    local = dict(locals())
    return {name: local[name] for name in NAMES}


def install_fake_vllm(monkeypatch, impls=None) -> types.SimpleNamespace:
    """Put the fake modules into sys.modules (monkeypatch undoes it). The layer module holds the ops by name,
    as `from ...ops.kda import ...` leaves them."""
    calls: list = []
    impls = {} if impls is None else impls
    stubs = _stubs(calls, impls)
    modules = {}
    for full in (OPS, LAYER):
        parts = full.split(".")
        for i in range(1, len(parts)):
            pkg = ".".join(parts[:i])
            if pkg not in modules:
                modules[pkg] = types.ModuleType(pkg)
                modules[pkg].__path__ = []
        modules[full] = types.ModuleType(full)
    for name in NAMES:
        setattr(modules[OPS], name, stubs[name])
    for name in ("fused_recurrent_kda", "chunk_kda_with_fused_gate", "fused_kda_gate"):
        setattr(modules[LAYER], name, stubs[name])
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(ops=modules[OPS], layer=modules[LAYER], stubs=stubs, calls=calls, impls=impls,
                                 modules=modules)


def paged_mamba_cache(slots: int, shapes, dtypes, page_pad_bytes: int = 0, device="cpu", seed: int = 0) -> tuple:
    """A KDA layer's mamba cache as vLLM lays it out (vllm/v1/worker/gpu_model_runner.py, the MambaSpec branch of
    _reshape_kv_cache_tensors, at 638d6e97): one raw buffer of `slots` pages; state i is a view
    [slots, *shapes[i]] of dtypes[i] whose dim-0 stride is the page (page_size_bytes / element size) and whose
    storage offset is the bytes of the states before it, so each page holds every state of one slot back to back
    (KDA: conv q, conv k, conv v, then the recurrent state [HV, V, K] fp32). page_pad_bytes stands in for
    MambaSpec.page_size_padded (pages padded to the attention layers' page size). The buffer is random (never
    zeros), so padding a kernel overwrote would show. Returns (raw uint8 buffer, [state views])."""
    import math

    import torch
    sizes = [math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes)]
    page = sum(sizes) + page_pad_bytes
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (slots * page,), dtype=torch.uint8, generator=gen).to(device)
    views, offset = [], 0
    for shape, dtype, size in zip(shapes, dtypes, sizes):
        esize = torch.empty((), dtype=dtype).element_size()
        assert offset % esize == 0 and page % esize == 0
        dense = torch.empty((slots, *shape), device="meta").stride()
        views.append(torch.as_strided(raw.view(dtype), (slots, *shape), (page // esize, *dense[1:]),
                                      offset // esize))
        offset += size
    return raw, views


def kda_state_shapes(H: int, K: int, HV: int, V: int, num_spec: int = 0, conv_kernel: int = 4) -> tuple:
    """vLLM's KDA state shapes and dtypes (MambaStateShapeCalculator.kda_state_shape, SD conv layout, and
    kda_state_dtype with a bf16 model): three conv states [conv_kernel - 1 + num_spec, dim] and the recurrent
    state [HV, V, K] fp32."""
    import torch
    state_len = conv_kernel - 1 + num_spec
    shapes = ((state_len, HV * V), (state_len, H * K), (state_len, H * K), (HV, V, K))
    return shapes, (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)
