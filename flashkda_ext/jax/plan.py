"""From a validated call to a remembered plan: the route's module for the call, the per-signature
memo (a serving loop calls an op with the same shapes and options every step), and running a plan
eagerly (a jit that donates the in-place pools) or inside the caller's trace."""
from __future__ import annotations

import functools
from typing import Optional

import jax

from .. import dispatch
from .targets import _Plan, _command_buffers_allowed


@functools.lru_cache(maxsize=1024)
def _module_for(family: str, meta_items: tuple) -> str:
    """The route's module for host-known metadata (selection is pure: cached per process)."""
    return dispatch.module_name(family, dict(meta_items))


def _route(family: str, call) -> str:
    return _module_for(family, tuple(sorted(call.route_meta().items())))


class _Prepared:
    """What one call signature resolved to: the plan, the donated argument positions, and (eager
    calls) the jitted function for the plan, made on first use."""
    __slots__ = ("plan", "donated", "eager_fn")

    def __init__(self, plan: _Plan, donated: tuple):
        self.plan, self.donated, self.eager_fn = plan, donated, None


_PREPARED: dict = {}
_PREPARED_LIMIT = 512
_KEY_SCALARS = (type(None), bool, int, float, str)


def _signature(family: str, plat: str, args: tuple, options: tuple, extra=None):
    """A hashable key of everything the validation and the route read from a call (each array's
    shape and dtype or None, the platform, the options with their types: True is not 1, and extra
    host values such as cu_seqlens offsets), or None when an option is not a plain scalar (that
    call takes the full path every time). Only calls that passed validation are remembered, so a
    bad call is always checked, and raises, before anything reaches XLA."""
    key = [family, plat, extra, _command_buffers_allowed()]
    for x in args:
        key.append(None if x is None else (x.shape, x.dtype))
    for v in options:
        t = type(v)
        if t not in _KEY_SCALARS:
            return None
        key.append((t, v))
    return tuple(key)


def _prepared(key) -> Optional[_Prepared]:
    """The remembered plan of a call signature (None: not seen, or a key of None). _PREPARED is read
    here at call time, so replacing it (a test starting from an empty memo) reaches every op."""
    return None if key is None else _PREPARED.get(key)


def _remember(key, plan: _Plan, donated: tuple) -> _Prepared:
    prep = _Prepared(plan, donated)
    if key is not None:
        if len(_PREPARED) >= _PREPARED_LIMIT:
            _PREPARED.clear()
        _PREPARED[key] = prep
    return prep


def _run(impl, prep: _Prepared, args: tuple, eager: bool, names: tuple):
    """Inside a trace, call impl directly (donation is the enclosing jit's business); eagerly,
    through a jit of impl for this plan that donates the in-place pools (positions in args) when
    asked. The plan is bound, not a static argument, so a repeated eager call hashes nothing of ours.
    names: the op's argument names, in args' order (for the error below)."""
    if not eager:
        return impl(prep.plan, *args)
    for i in prep.donated:
        # XLA refuses a donated buffer that is another operand too, naming none (kda_verify's
        # initial_state=state, which the torch op takes): named here, before anything runs
        for j, x in enumerate(args):
            if j != i and x is args[i]:
                raise ValueError(f"{names[j]}: the same array as {names[i]}, which this eager call donates "
                                 f"(donate=True); pass a copy, or donate=False ({names[j]} is then read as it "
                                 f"was before the call)")
    fn = prep.eager_fn
    if fn is None:
        fn = prep.eager_fn = _eager_jit(impl, prep.plan, prep.donated)
    return fn(*args)


@functools.lru_cache(maxsize=None)
def _eager_jit(impl, plan: _Plan, donate: tuple):
    return jax.jit(functools.partial(impl, plan), donate_argnums=donate)


def _donate_positions(args: tuple, positions, donate: bool) -> tuple:
    if not isinstance(donate, bool):
        raise TypeError(f"donate: expected a bool, got {type(donate).__name__}")
    if not donate:
        return ()
    return tuple(i for i in positions if args[i] is not None)

