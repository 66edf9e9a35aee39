"""Argument checks of the reference's public functions: a bad argument is an error naming it, never a wrong
result (a float offset truncated by int(), a str flag taken by truth value, an integer compute dtype) or a bare
IndexError / AttributeError from the arithmetic."""
from __future__ import annotations

import math
import numbers

import torch

COMPUTE_DTYPES = (torch.float32, torch.float64)   # the reference never does arithmetic in bf16 / fp16


def tensor(name: str, x, ndim=None, what: str = "") -> torch.Tensor:
    """A torch.Tensor (of `ndim` dims when given) whose values are real numbers: complex lost its imaginary part
    in .to(dtype) and bool passed as 0 / 1."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor{' ' + what if what else ''}, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {what}, got shape {tuple(x.shape)}")
    if x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected a real-valued tensor, got {x.dtype}")
    return x


def count(name: str, value, minimum: int) -> int:
    """An int >= minimum (a numpy integer too), not a bool or a float (2.5 checkpoints sized nothing)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def real(name: str, value, rule: str) -> float:
    """A finite real number (not a bool or a str) obeying rule "< 0", "> 0" or ">= 0"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a finite float {rule}, got {type(value).__name__} {value!r}")
    x = float(value)
    ok = {"< 0": x < 0, "> 0": x > 0, ">= 0": x >= 0}[rule]
    if not math.isfinite(x) or not ok:
        raise ValueError(f"{name}: expected a finite float {rule}, got {value!r}")
    return x


def compute_dtype(dtype) -> torch.dtype:
    """The dtype the reference computes in: an integer one gave integer outputs, bf16 a raw RuntimeError."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype: expected torch.float32 or torch.float64 (the compute dtype), got {dtype!r}")
    return dtype


def host_ints(name: str, values, ndim: int = 1) -> list:
    """Host integers from an integer tensor of `ndim` dims, or (1-D) a list / tuple of ints: a float entry
    (2.7 -> 2), a bool and a wrong number of dims were taken in silence or failed unnamed."""
    if torch.is_tensor(values):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got {values.dtype}")
        if values.dim() != ndim:
            raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(values.shape)}")
        return values.tolist()
    if ndim != 1 or not isinstance(values, (list, tuple)):
        raise TypeError(f"{name}: expected a {ndim}-D integer tensor{' or a list of ints' if ndim == 1 else ''}, "
                        f"got {type(values).__name__}")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name}: expected ints, got {type(x).__name__} {x!r}")
    return [int(x) for x in values]
