"""What the CPU verify tests share (tests/test_verify.py, tests/test_verify_initial_state.py): a case is a dict of
kda_verify's arguments by name; run it through the public op, or through the reference (the spec)."""
import torch

import flashkda_ext
from flashkda_ext import reference as R

QKV = ("q", "k", "v", "g", "beta")


def run(a):
    kw = {n: x for n, x in a.items() if n not in QKV}
    return flashkda_ext.kda_verify(*(a[n] for n in QKV), **kw)


def reference(a):
    kw = {n: x for n, x in a.items() if n not in QKV + ("out", "max_seqlen")}
    return R.kda_verify_step(*(a[n] for n in QKV), **kw)


def clone(a):
    return {n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in a.items()}
