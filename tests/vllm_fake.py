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
