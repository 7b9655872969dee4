"""Objects that must outlive the interpreter's teardown: one reference each, never given back.

Why: C code may still reach them after Python has cleared its modules -- the driver calling a
host-function trampoline or a DLPack consumer calling a deleter (cffi callbacks), or the driver
library itself, which must stay loaded while the process exits.  A reference held by a module
global is dropped by that teardown; one taken with ``Py_IncRef`` is not.

ctypes (``Py_IncRef`` through ``ctypes.pythonapi``) is imported by the first call, not at import:
it costs a fresh process about 2 ms, and cuproc's way to a usable device never needs it (issue 9's
startup goal).  Bottom layer: imports nothing of cuproc, so the loader can use it.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_incref: list[Callable[[Any], None]] = []   # the prototype, made on first use


def keep_forever(obj: Any) -> None:
    """Take one reference to ``obj`` that is never given back."""
    if not _incref:
        import ctypes
        # A private prototype: ctypes.pythonapi's function objects are process-wide, and another
        # library may give Py_IncRef other argtypes (then a call through it fails or passes the wrong thing).
        _incref.append(ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi)))
    _incref[0](obj)


__all__ = ["keep_forever"]
