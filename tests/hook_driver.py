"""A driver handle whose attribute hook runs a test's code while a compiled front looks a function up.

A front finds its driver function in the handle's dict, or, for a name not there, through the handle's
``__getattr__``: the one point where a front lets Python run before its driver call.  Tests put the names
to watch in ``drv.hooked`` and the code to run, one call per lookup, in ``drv.hooks``.
"""
from __future__ import annotations

from typing import Any

import cuproc


class HookDriver(cuproc.Driver):
    """``cuproc.Driver`` whose lookup of a name in ``self.hooked`` runs (and removes) the last of ``self.hooks``."""

    def __getattr__(self, name: str) -> Any:
        hooks = self.__dict__.get("hooks")
        if hooks and name in self.__dict__.get("hooked", ()):
            hooks.pop()()
        return super().__getattr__(name)
