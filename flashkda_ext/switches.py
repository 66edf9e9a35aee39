"""On/off environment variables, read one way for all of them: 1, true, yes, on / 0, false, no, off (any case,
spaces around); unset or empty: the variable's default; any other value is a ValueError naming the variable (a
typo must not silently mean the default: FLASHKDA_EXT_FAST_PATH=off once meant on)."""
from __future__ import annotations

import os
import sys

ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SwitchError(ValueError):
    """A switch set to a value that is no switch (a ValueError, so callers that catch ValueError still do)."""


def env_switch(name: str, default: bool, on: str = "", off: str = "") -> bool:
    """The switch `name`; `on` / `off` say what 1 / 0 do, for the error's hint."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value == "":
        return default
    if value in ON or value in OFF:
        return value in ON
    on, off = (f"{what}; " if what else "" for what in (on, off))
    raise SwitchError(f"{name}={raw!r} is not a switch; set 1 ({on}also true, yes, on) or 0 ({off}also false, no, "
                     f"off), or unset it for the default ({int(default)})")


def launched_as_cli() -> bool:
    """Whether this process is the command line's own (`python -m flashkda_ext ...` or the `flashkda-ext` script): the
    package's import reads some switches before any CLI code runs, so a bad one is reported by the import itself."""
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    while argv:     # the interpreter's own options, up to the module, the code or the script (its arguments follow)
        a = argv.pop(0)
        if a.startswith("-m"):
            return (a[2:] or (argv[0] if argv else "")) == "flashkda_ext"
        if a in ("-W", "-X"):   # the options that take a separate value
            argv = argv[1:]
        elif a == "-c" or a == "-" or not a.startswith("-"):
            break
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == "flashkda-ext"
