"""The one rule for the on/off ``CUPROC_*`` variables, read by the bottom layers (ffi choice, driver).

A value that is neither on nor off raises ValueError naming the variable: a typo must never
silently pick one side.
"""
from __future__ import annotations

import os

ON = frozenset({"1", "true", "yes", "on"})
OFF = frozenset({"", "0", "false", "no", "off"})


def flag(name: str, on: str, off: str) -> bool:
    """``name`` read as on (True) or off (False, also when unset); ``on``/``off`` say what each means."""
    text = os.environ.get(name, "").strip().lower()
    if text in ON:
        return True
    if text in OFF:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(sorted(ON))} ({on}) or "
                     f"{', '.join(sorted(OFF - {''}))} ({off}), or unset it")
