"""Adapters that let serving stacks call flashkda_ext in their own call shapes (docs/integrations.md).

fla: a backend for fla's registry (flashkda_ext.integrations.fla.register()).
sglang: SGLang 0.5.23's KDA kernel backend (a package: the kernel, its sglang.srt.plugins entry point, install()).
vllm: install() rebinds the KDA ops of vLLM 0.34 (Kimi K3 / Kimi-Linear, and the vendored fla copy) to adapters.
Here: the per-chunk state layout both adapters return.
"""
import torch


def fla_chunk_states(initial: torch.Tensor, checkpoints: torch.Tensor, lengths: list, chunk: int) -> torch.Tensor:
    """FLA's per-chunk states h (what fla's chunk_kda and SGLang return with return_intermediate_states:
    the state entering each chunk) from kda_prefill's checkpoints taken every `chunk` tokens. For request
    n: [initial_n, ckpt[n, 0], ..., ckpt[n, ceil(len_n / chunk) - 2]], concatenated over requests, as
    [1, NT, HV, V, K] (one gather; the index is built on the host from the host lengths)."""
    N, C = checkpoints.shape[0], checkpoints.shape[1]
    flat = torch.cat([initial.to(checkpoints.dtype), checkpoints.reshape(N * C, *checkpoints.shape[2:])])
    order = []
    for n, L in enumerate(lengths):
        chunks = -(-L // chunk)
        if chunks > 0:
            order.append(n)
            order.extend(N + n * C + j for j in range(chunks - 1))
    index = torch.tensor(order, dtype=torch.long).to(flat.device, non_blocking=True)
    return flat.index_select(0, index).unsqueeze(0)
