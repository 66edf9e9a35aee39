"""The ops' fast path: a serving loop repeats the same call metadata every step.

The first call of a kind is validated in full (flashkda_ext/validation.py); the op then keeps an
entry here: the routed module's signature-checked function (`<function>_checked`,
csrc/common/binding.h "Call signatures"), the signature of the call's tensor arguments and the
scalars the function takes, under a key of the op's scalar arguments and leading dims. A later call
with that key goes straight to the checked function, which launches only when its arguments still
have the validated signature and otherwise returns without launching, so the op takes the full path.
Traced calls, and calls whose validation reads tensor values, always take the full path.
FLASHKDA_EXT_FAST_PATH=0 (read at import) sets ENABLED off: every call is checked in full.
"""
from __future__ import annotations

import os

import torch

from . import dispatch

ENABLED = os.environ.get("FLASHKDA_EXT_FAST_PATH", "1") != "0"
Tensor = torch.Tensor  # exact type: subclasses and other array types take the full path
_ENTRIES: dict = {}
_LIMIT = 512


def plain_or_none(*xs) -> bool:
    """Each of xs is None or a plain torch.Tensor."""
    for x in xs:
        if x is not None and type(x) is not Tensor:
            return False
    return True


def get(key):
    """The entry under key: (checked function, signature, tail, *extra), or None."""
    try:
        return _ENTRIES.get(key)
    except TypeError:  # an unhashable argument: the full path says what is wrong with it
        return None


def put(key, family: str, call, sig_args: tuple, tail: tuple, extra: tuple = ()) -> None:
    """Keep the entry of a call just validated and launched with (*sig_args, *tail), when its module
    has a checked function and the key hashes."""
    fn = dispatch.checked_function(family, call.route_meta())
    if fn is None:
        return
    try:
        hash(key)
    except TypeError:
        return
    if len(_ENTRIES) >= _LIMIT:
        _ENTRIES.clear()
    _ENTRIES[key] = (fn, fn(0, *sig_args, *tail), tail) + extra  # expected 0: the signature alone, no launch


def clear() -> None:
    _ENTRIES.clear()


def size() -> int:
    return len(_ENTRIES)
