"""Extract vLLM 0.34.0's KDA ops (Kimi K3 Triton kernels and the vendored fla copy) from the pinned wheel into a
folder that imports on its own: `sys.path.insert(0, folder); import vllm.models.kimi_k3.nvidia.ops.third_party.kda`.

    python3 scripts/prepare_vllm_engine.py                      # -> .engines/vllm (ignored), for the GPU run
    python3 scripts/prepare_vllm_engine.py --wheel /path/vllm-0.34.0-*.whl --dest DIR
    python3 scripts/prepare_vllm_engine.py --native             # + vLLM's _C for sm_90, packed (15 MB)

Only FILES are taken from the wheel (the modules those ops import, and the layer sources the conformance tests
read). Written over them, STUBS stand in for what those modules import and do not use for the KDA ops, so neither
vLLM's dependencies nor its heavy package __init__s are needed:
- vllm/platforms: current_platform answered from torch (CUDA or not, device capability, PDL from sm_90 on, as
  vLLM's CUDA platform decides it); vllm_version_matches_substr -> False;
- vllm/logger.py: init_logger = logging.getLogger;
- vllm/model_executor/custom_op.py: CustomOp (only the vendored module's norm class derives from it);
- the package __init__s on the way (vllm, vllm.models.kimi_k3, fla's ops, ...): empty.
The wheel is a local file (--wheel, or FLASHKDA_EXT_ENGINE_WHEELS naming a folder) or `pip download --no-deps`.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_wheels  # noqa: E402

VERSION = "0.34.0"
ROOT = Path(__file__).resolve().parents[1]
CACHE = engine_wheels.CACHE
K3_OPS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
VENDORED_OPS = "vllm.third_party.flash_linear_attention.ops.kda"

#: files (or folder prefixes) taken from the wheel
FILES = (
    "vllm/models/kimi_k3/nvidia/ops/third_party/kda/",
    "vllm/third_party/flash_linear_attention/",
    "vllm/triton_utils/",
    "vllm/envs.py",
    "vllm/utils/math_utils.py",
    "vllm/utils/gpu_sync_debug.py",
    "vllm/utils/torch_utils.py",
    "vllm/utils/platform_utils.py",
    "vllm/utils/torch_version.py",
    "vllm/model_executor/warmup/jit_warmup.py",
    "vllm/model_executor/warmup/jit_warmup_triton_helper.py",
    # read (not imported) by the conformance tests: the call sites and the state dtypes
    "vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py",
    "vllm/model_executor/layers/mamba/mamba_utils.py",
    "vllm/models/kimi_k3/nvidia/kda.py",
    "vllm/model_executor/models/bailing_moe_v3.py",
    # compiled in part by scripts/vllm_step_metadata.py (the forward context and a step's GDN metadata)
    "vllm/forward_context.py",
    "vllm/config/compilation.py",
    "vllm/v1/attention/backends/gdn_attn.py",
    "vllm/v1/attention/backends/utils.py",
    "vllm/models/kimi_k3/nvidia/kda_metadata.py",      # read: K3's metadata builder
    "vllm/_custom_ops.py",                              # compiled in part: K3's native fused decode wrapper
    # read: the architectures vLLM runs with breakable CUDA graphs (the KDA layer's _forward a break point)
    "vllm/config/vllm.py",
    "vllm/compilation/breakable_cudagraph.py",
    # prefix-cache checkpoints (mamba_cache_mode "align"): where a K3 prefill call's checkpoints fall
    "vllm/model_executor/layers/mamba/checkpoint.py",
    "vllm/model_executor/layers/mamba/kda_checkpoint.py",
    "vllm/v1/kv_cache_interface.py",
)

#: binaries taken from the wheel: vLLM's FlashKDA extension, K3's own prefill on an H200 (the peer of
#: benchmarks/bench_vllm.py; loaded only on a CUDA machine, through scripts/vllm_step_metadata.flashkda_prefill)
BINARIES = ("vllm/_flashkda_C.abi3.so",)
#: vLLM's main extension (K3's native fused decode, the peer of benchmarks/bench_vllm_native.py), 88 MB: with
#: --native, kept as NATIVE_PACKED, thinned to its sm_90 entries and xz-compressed (scripts/fatbin_thin.py, 15 MB)
NATIVE = "vllm/_C_stable_libtorch.abi3.so"
NATIVE_PACKED = "vllm/_C_stable_libtorch.sm90.so.xz"

_EMPTY_PACKAGES = ("vllm", "vllm/utils", "vllm/model_executor", "vllm/model_executor/warmup", "vllm/models",
                   "vllm/models/kimi_k3", "vllm/models/kimi_k3/nvidia", "vllm/models/kimi_k3/nvidia/ops",
                   "vllm/models/kimi_k3/nvidia/ops/third_party", "vllm/third_party",
                   "vllm/third_party/flash_linear_attention", "vllm/third_party/flash_linear_attention/ops")

_PLATFORM = '''"""flashkda_ext stub of vllm.platforms (scripts/prepare_vllm_engine.py): what the KDA ops ask,
answered from torch."""
from typing import NamedTuple

import torch


class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor


class _Platform:
    def is_cuda(self) -> bool:
        return torch.version.cuda is not None and torch.cuda.is_available()

    is_cuda_alike = is_cuda

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0):
        return DeviceCapability(*torch.cuda.get_device_capability(device_id)) if self.is_cuda() else None

    def _cap(self) -> int:
        cap = self.get_device_capability()
        return -1 if cap is None else cap.to_int()

    def has_device_capability(self, capability) -> bool:
        return self._cap() >= (capability if isinstance(capability, int) else capability[0] * 10 + capability[1])

    def is_device_capability(self, capability) -> bool:
        return self._cap() == (capability if isinstance(capability, int) else capability[0] * 10 + capability[1])

    def is_device_capability_family(self, capability: int) -> bool:
        return self._cap() // 10 == capability // 10

    def is_arch_support_pdl(self) -> bool:    # vLLM's CUDA platform: sm_90 and newer
        return self._cap() >= 90

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if self.is_cuda() else "cpu"

    def is_pin_memory_available(self) -> bool:
        return self.is_cuda()

    def is_confidential_compute(self) -> bool:
        return False


current_platform = _Platform()


def vllm_version_matches_substr(substr: str) -> bool:
    return False
'''

_CUSTOM_OP = '''"""flashkda_ext stub of vllm.model_executor.custom_op: the vendored fla module's norm class
derives from it."""
import torch


class CustomOp(torch.nn.Module):
    @classmethod
    def register(cls, name):
        return lambda op_cls: op_cls
'''

#: path -> source written over the wheel's files
STUBS = {
    **{f"{p}/__init__.py": "" for p in _EMPTY_PACKAGES},
    "vllm/platforms/__init__.py": _PLATFORM,
    "vllm/logger.py": "import logging\n\ninit_logger = logging.getLogger\n",
    "vllm/model_executor/custom_op.py": _CUSTOM_OP,
}


def find_wheel(wheel: str | None = None) -> Path:
    """The pinned wheel: `wheel`, else one in FLASHKDA_EXT_ENGINE_WHEELS or the cache, else pip download."""
    return engine_wheels.find_wheel("vllm", VERSION, given=wheel, cache=CACHE)


def prepare(wheel: Path, dest: Path) -> Path:
    """FILES from the wheel and STUBS into dest (done once: dest/.complete names the wheel and this list)."""
    stamp = dest / ".complete"
    tag = f"{wheel.name} {hashlib.sha256(repr((FILES, BINARIES, STUBS)).encode()).hexdigest()[:16]}"
    if stamp.exists() and stamp.read_text() == tag:
        return dest
    with engine_wheels.folder_lock(dest.parent):   # another process may be extracting: wait, then look again
        if stamp.exists() and stamp.read_text() == tag:
            return dest
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith(FILES) and name.endswith(".py") or name in BINARIES:
                    z.extract(name, dest)
        for rel, text in STUBS.items():
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        stamp.write_text(tag)
    return dest


def prepare_native(wheel: Path, dest: Path) -> Path:
    """vLLM's main extension into dest/NATIVE_PACKED, thinned to sm_90 and compressed (once per wheel)."""
    import tempfile
    import fatbin_thin
    packed = dest / NATIVE_PACKED
    stamp = packed.with_name(packed.name + ".complete")
    if packed.exists() and stamp.exists() and stamp.read_text() == wheel.name:
        return packed
    with engine_wheels.folder_lock(dest.parent):
        if packed.exists() and stamp.exists() and stamp.read_text() == wheel.name:
            return packed
        with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
            kept, zeroed = fatbin_thin.pack(Path(z.extract(NATIVE, tmp)), packed)
        stamp.write_text(wheel.name)
    print(f"{packed}: sm_90 entries {kept >> 20} MB kept, {zeroed >> 20} MB zeroed, {packed.stat().st_size >> 20} MB")
    return packed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", help=f"the vllm-{VERSION} wheel (default: a local copy, else pip download)")
    ap.add_argument("--dest", default=str(ROOT / ".engines" / "vllm"))
    ap.add_argument("--native", action="store_true",
                    help=f"also {NATIVE} thinned to sm_90 and xz-compressed (the native fused decode's peer)")
    args = ap.parse_args(argv)
    wheel = find_wheel(args.wheel)
    dest = prepare(wheel, Path(args.dest))
    if args.native:
        prepare_native(wheel, dest)
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
