"""On/off environment variables, read one way for all of them: 1, true, yes, on / 0, false, no, off (any case,
spaces around); unset or empty: the variable's default; any other value is a ValueError naming the variable (a
typo must not silently mean the default: FLASHKDA_EXT_FAST_PATH=off once meant on)."""
from __future__ import annotations

import os

ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_switch(name: str, default: bool, on: str = "", off: str = "") -> bool:
    """The switch `name`; `on` / `off` say what 1 / 0 do, for the error's hint."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value == "":
        return default
    if value in ON or value in OFF:
        return value in ON
    on, off = (f"{what}; " if what else "" for what in (on, off))
    raise ValueError(f"{name}={raw!r} is not a switch; set 1 ({on}also true, yes, on) or 0 ({off}also false, no, "
                     f"off), or unset it for the default ({int(default)})")
