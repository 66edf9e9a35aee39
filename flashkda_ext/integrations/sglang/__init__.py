"""flashkda_ext as a KDA kernel backend of SGLang 0.5.23 (docs/integrations.md, "SGLang").

Selection, one flag per phase, once flashkda_ext is installed (its `sglang.srt.plugins` entry point is loaded
by SGLang in every process):

    python -m sglang.launch_server ... --linear-attn-backend flashkda_ext --linear-attn-verify-backend flashkda_ext

In one process without the plugin loader: `flashkda_ext.integrations.sglang.install()` (undo: uninstall()).

FlashKDAExtKernel has the methods and call shapes of SGLang's LinearAttnKernelBase as 0.5.23's
KDAKernelDispatcher and KDAAttnBackend call them (kernel.py): packed_decode / decode, extend (radix-cache
track_state snapshot, FLA per-chunk h), target_verify (chains; the per-pool row table). What it cannot serve
exactly goes to SGLang's TritonKDAKernel, counted in STATS / REASONS. With FLASHKDA_EXT_SGLANG_PREFILL_GRAPH=1,
SGLang's breakable prefill CUDA graphs capture the extend through prefill_graph.PrefillGraphWrapper.
"""
from .kernel import REASONS, STATS, FlashKDAExtKernel
from .plugin import BACKEND_NAME, install, plugin, uninstall

__all__ = ["FlashKDAExtKernel", "STATS", "REASONS", "BACKEND_NAME", "install", "uninstall", "plugin"]
