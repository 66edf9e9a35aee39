"""The CPU backend's 16-bit float conversions (csrc/common/host_dtype.h) against torch's: every
bf16 and fp16 bit pattern widened to float32, and float32 values narrowed to both, with exact
ties, values next to ties, subnormals, overflow, infinities and NaN among fresh random ones."""
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch

from flashkda_ext import paths

PROGRAM = r"""
#include <cstdio>
#include <cstdint>
#include <vector>
#include "common/host_dtype.h"
// stdin: n float32; stdout: n bf16 bits, n f16 bits, then all 65536 bf16 and f16 patterns as float32
int main() {
  std::vector<float> xs;
  float x;
  while (std::fread(&x, sizeof x, 1, stdin) == 1) xs.push_back(x);
  for (float v : xs) { uint16_t b = fkda::float_to_bf16(v); std::fwrite(&b, 2, 1, stdout); }
  for (float v : xs) { uint16_t h = fkda::float_to_f16(v); std::fwrite(&h, 2, 1, stdout); }
  for (uint32_t p = 0; p < 65536; ++p) { float f = fkda::bf16_to_float(uint16_t(p)); std::fwrite(&f, 4, 1, stdout); }
  for (uint32_t p = 0; p < 65536; ++p) { float f = fkda::f16_to_float(uint16_t(p)); std::fwrite(&f, 4, 1, stdout); }
  return 0;
}
"""


@pytest.fixture(scope="module")
def convert(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    import tvm_ffi.libinfo  # dlpack/dlpack.h ships with tvm-ffi's headers

    d = tmp_path_factory.mktemp("host_dtype")
    (d / "conv.cc").write_text(PROGRAM)
    incs = [f"-I{paths.csrc_dir()}"] + [f"-I{p}" for p in tvm_ffi.libinfo.include_paths()]
    subprocess.run([cxx, "-O1", "-std=c++17", *incs, str(d / "conv.cc"), "-o", str(d / "conv")], check=True)

    def run(xs: np.ndarray):
        res = subprocess.run([str(d / "conv")], input=xs.astype(np.float32).tobytes(), capture_output=True,
                             check=True).stdout
        n = len(xs)
        bf = np.frombuffer(res[:2 * n], dtype=np.uint16)
        hf = np.frombuffer(res[2 * n:4 * n], dtype=np.uint16)
        wide = np.frombuffer(res[4 * n:], dtype=np.float32)
        return bf, hf, wide[:65536], wide[65536:]
    return run


def bits16(t):
    return t.view(torch.int16).numpy().view(np.uint16)


def test_narrowing_and_widening_match_torch(convert):
    seed = random.SystemRandom().randrange(2**31)
    rng = np.random.default_rng(seed)
    parts = [rng.standard_normal(20000).astype(np.float32) * np.float32(10.0) ** rng.integers(-8, 6, 20000)]
    # exact ties and their neighbours for both targets: a 16-bit value plus half its ulp, +-1 float ulp
    for dt, drop in ((torch.bfloat16, 16), (torch.float16, 13)):
        base = torch.from_numpy(rng.standard_normal(3000).astype(np.float32)).to(dt).float().numpy()
        u = base.view(np.uint32)
        if dt == torch.float16:
            # fp16 keeps 10 mantissa bits: a tie sets bit 12 of the float32 mantissa
            tie = (u | np.uint32(1 << 12)).view(np.float32)
        else:
            tie = (u | np.uint32(1 << (drop - 1))).view(np.float32)
        parts += [tie, np.nextafter(tie, np.float32(np.inf)), np.nextafter(tie, np.float32(-np.inf))]
    # subnormals of fp16, overflow edges, specials
    parts.append(rng.uniform(-6.2e-5, 6.2e-5, 4000).astype(np.float32))
    parts.append(np.array([65504, 65519.99, 65520, 65536, -65520, 1e30, -1e30, np.inf, -np.inf, 0.0, -0.0,
                           5.96e-8, 2.98e-8, 2.99e-8, 1e-45, 3.4e38], dtype=np.float32))
    xs = np.concatenate(parts)
    bf, hf, _, _ = convert(xs)
    t = torch.from_numpy(xs)
    want_bf, want_hf = bits16(t.to(torch.bfloat16)), bits16(t.to(torch.float16))
    bad = np.nonzero(bf != want_bf)[0]
    assert bad.size == 0, f"bf16 (seed {seed}): {xs[bad[:5]]} -> {bf[bad[:5]]}, torch {want_bf[bad[:5]]}"
    bad = np.nonzero(hf != want_hf)[0]
    assert bad.size == 0, f"fp16 (seed {seed}): {xs[bad[:5]]} -> {hf[bad[:5]]}, torch {want_hf[bad[:5]]}"
    # NaN stays NaN in both
    bf, hf, _, _ = convert(np.array([np.nan, -np.nan], dtype=np.float32))
    assert torch.isnan(torch.from_numpy(bf.astype(np.int16)).view(torch.bfloat16)).all()
    assert torch.isnan(torch.from_numpy(hf.astype(np.int16)).view(torch.float16)).all()


def test_every_16_bit_pattern_widens_like_torch(convert):
    _, _, wide_bf, wide_hf = convert(np.zeros(0, dtype=np.float32))
    pats = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    for got, dt in ((wide_bf, torch.bfloat16), (wide_hf, torch.float16)):
        want = pats.view(dt).float().numpy()
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), dt
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)), dt
