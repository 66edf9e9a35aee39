"""vLLM 0.34's FlashKDA as a prefill peer: Kimi K3's own prefill on an H200 (the layer's "auto" backend with a
bounded gate), the wheel's `_flashkda_C` extension called through K3's `_flashkda_prefill` (compiled from the
wheel's kda.py by scripts/vllm_step_metadata.py), from the folder scripts/prepare_vllm_engine.py fills
(.engines/vllm; carry it to the device).

Its inputs are ours as they stand: q / k / v / raw gate [1, T, H, 128] bf16, beta logits [1, T, H], A_log [H],
dt_bias [H * K], lower_bound, int32 offsets, state [N, H, V, K] (fp32 or bf16); l2norm of q / k, the beta sigmoid
and the bounded gate happen inside. Bounded gate only (K3 calls it with one), scale K ** -0.5 (its wrapper's).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
ENGINE_DIR = ROOT / ".engines" / "vllm"
_loaded: dict = {}     # engine folder -> (function, None) or (None, why not)


def load(engine_dir: Path = ENGINE_DIR):
    """(K3's `_flashkda_prefill` over the wheel's FlashKDA extension, None) or (None, why not), loaded once a
    folder: kda.py's function compiled from the wheel's source (vLLM 0.34's "auto" prefill backend of Kimi K3 on
    sm_90 with a bounded gate, so the engine's own kernel there, not the Triton op)."""
    engine_dir = Path(engine_dir)
    if engine_dir not in _loaded:
        try:
            if not (engine_dir / "vllm" / "_flashkda_C.abi3.so").is_file():
                raise FileNotFoundError(f"{engine_dir}: run scripts/prepare_vllm_engine.py and carry .engines/vllm")
            sys.path.insert(0, str(ROOT / "scripts"))
            import vllm_step_metadata
            fn = vllm_step_metadata.flashkda_prefill(engine_dir)
            if "vllm" not in sys.modules and str(engine_dir) not in sys.path:
                sys.path.insert(0, str(engine_dir))
            import vllm._flashkda_C  # noqa: F401  (registers torch.ops._flashkda_C)
            _loaded[engine_dir] = (fn, None)
        except Exception as e:  # noqa: BLE001  no CUDA, another torch ABI, an unprepared folder: no such peer
            _loaded[engine_dir] = (None, f"{type(e).__name__}: {e}"[:300])
    return _loaded[engine_dir]


def available() -> Optional[str]:
    """None when FlashKDA loads here, else the reason it does not."""
    return load()[1]


def prefill_fn(q, k, v, g, beta, *, A_log, dt_bias, lower_bound: float, cu_seqlens, initial_state, fn=None,
               checkpoint_offsets=None) -> Callable[[], tuple]:
    """A zero-argument closure calling `fn` (default: FlashKDA, load()) as K3's layer calls `_flashkda_prefill`,
    on our [1, T, H, D] inputs into buffers of its own: the workspace sized by the extension, the final state in
    the initial state's dtype (the pool's); with checkpoint_offsets (prefix caching's "align" mode) also a
    NaN-filled checkpoint buffer, the closure's `checkpoint_state`. It returns (o [1, T, H, V], final_state
    [N, H, V, K])."""
    if fn is None:
        fn, why = load()
        if fn is None:
            raise RuntimeError(f"FlashKDA does not load: {why}")
    T, H = q.shape[1], q.shape[2]
    N = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.to(torch.int32).contiguous()    # the same tensor where it is int32 already (vLLM's)
    init = initial_state.contiguous()
    ws = torch.empty(torch.ops._flashkda_C.get_workspace_size(T, H, N), dtype=torch.uint8, device=q.device)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    final = torch.empty(init.shape, dtype=init.dtype, device=init.device)
    ckpt = dict() if checkpoint_offsets is None else dict(
        checkpoint_state=torch.full(init.shape, float("nan"), dtype=init.dtype, device=init.device),
        checkpoint_offsets=checkpoint_offsets)

    def run():
        return fn(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, lower_bound=float(lower_bound),
                  initial_state=init, cu_seqlens=cu, out=out, final_state=final, workspace=ws, **ckpt)
    run.checkpoint_state = ckpt.get("checkpoint_state")
    return run
