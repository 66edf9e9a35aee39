"""The ops' fast path: a serving loop repeats the same call metadata every step.

The first call of a kind is validated in full (flashkda_ext/validation/); the op then keeps an
entry here: the routed module's signature-checked function (`<function>_checked`,
csrc/common/binding.h "Call signatures"), the signature of the call's tensor arguments and the
scalars the function takes, under a key of the op's scalar arguments and leading dims. A later call
with that key goes straight to the checked function, which launches only when its arguments still
have the validated signature and otherwise returns without launching, so the op takes the full path.
Traced calls, and calls whose validation reads tensor values, always take the full path.
FLASHKDA_EXT_FAST_PATH=0 (read at import) sets ENABLED off: every call is checked in full.

The signature is taken on the caller's own tensors (no reshape or flatten before it), so it sees
exactly what the full check sees: shape, strides, dtype, device type and index, 16-byte alignment,
and whether a written tensor overlaps another argument. What DLPack does not carry into C++ is
checked here before the call (plain_ok, with the exact type): neg bits, requires_grad under grad mode, inference tensors
written outside inference mode. (A conj bit exists only on complex tensors, whose dtype alone
already differs from every validated signature.) One overlap the signature cannot see is checked there
too: kda_prefill's pool read and not committed (output_final_state=False) goes to the module's
initial_state, which it does not write, yet the full check refuses it over an input (ops.kda_prefill
compares addresses with the validated call's byte spans, validation._span_bytes). Anything else takes the
full check, which says what is wrong; tests/test_fast_path_differential.py (and
tests/test_bad_input_campaign18.py) prove cold and warm calls agree.

The ops call the checked function inside `try`: an argument TVM-FFI cannot pass (e.g. a meta
tensor) raises before any launch, and then the full path runs and raises the full check's error.
An error raised inside the function itself comes from the binding's checks or a failed launch, so
the full path never runs a kernel twice. (Inlined in each op, like the rest of the fast branch:
a helper function's call costs ~0.3 us there, a tenth of the whole fast path.)
"""
from __future__ import annotations

import torch

from . import dispatch, flag_reader, switches

# an on/off word, else a ValueError naming the variable at import ("false" or "off" silently kept it on)
ENABLED = switches.env_switch("FLASHKDA_EXT_FAST_PATH", True)
Tensor = torch.Tensor  # exact type: subclasses and other array types take the full path
_ENTRIES: dict = {}
_LIMIT = 512


_inference_mode = torch.is_inference_mode_enabled
_grad_enabled = torch.is_grad_enabled


def _py_plain_ok(read: tuple, written: tuple) -> bool:
    """True when every tensor of the call (None skipped: an absent required tensor changes the
    signature, so the checked function refuses it) is a plain torch.Tensor and has no property the
    signature cannot see but the full check refuses (validation.common._tensor, _inference_only):
    a neg bit; under grad mode requires_grad; outside inference mode, a written inference tensor.
    The exact-type test and the flag reads share one loop per tuple: called on every fast call, and
    plain loops with method-call syntax measured the cheapest form on CPython 3.11 (map() and
    comprehensions cost more); a serving loop under torch.inference_mode() pays for the type test and
    the neg bit alone. Outputs the op allocates itself are not passed: they have none of these.
    The compiled twin (flag_reader.py) gives the same answers ~20x faster and replaces it as
    `plain_ok` once built (in the background: no call waits for that build)."""
    if _inference_mode():
        for x in read:
            if x is not None and (type(x) is not Tensor or x.is_neg()):
                return False
        for x in written:
            if x is not None and (type(x) is not Tensor or x.is_neg()):
                return False
        return True
    grad = _grad_enabled()
    for x in read:
        if x is not None and (type(x) is not Tensor or x.is_neg() or grad and x.requires_grad):
            return False
    for x in written:
        if x is not None and (type(x) is not Tensor or x.is_neg() or x.is_inference() or grad and x.requires_grad):
            return False
    return True


plain_ok = flag_reader.load() or _py_plain_ok


def _install(native) -> None:
    """Make the compiled test plain_ok (called at once, or by its background build when done)."""
    global plain_ok
    if native is not None:
        plain_ok = native


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
    if plain_ok is _py_plain_ok:  # the first armed call: build the compiled test if it is missing
        _install(flag_reader.ensure(_install))
    if len(_ENTRIES) >= _LIMIT:
        _ENTRIES.clear()
    _ENTRIES[key] = (fn, fn(0, *sig_args, *tail), tail) + extra  # expected 0: the signature alone, no launch


def clear() -> None:
    _ENTRIES.clear()


def size() -> int:
    return len(_ENTRIES)
