"""Process state that every layer consults: whether this process is a fork of one that used CUDA.

Policy: the CUDA driver cannot be used across ``fork()``.  A child forked
after ``cuInit`` succeeded gets :class:`~cuproc.errors.ForkedProcessError` from
everything cuproc handed out -- driver attributes, checked functions, prepared
launchers, objects -- before any call reaches the driver.  The one exception is
a raw function the user took on purpose (``cuproc.driver.cuX`` after the
first access: the cffi pointer itself, or for a few names a thin wrapper around
it -- cuInit, by-value struct arguments, a header alias's ``.function``): it
calls the driver as C would.

Locks made by :func:`lock` are fresh in the child, so a thread that held one
during ``fork()`` cannot deadlock it.  Forking before any CUDA use is safe.

The locks and the per-thread namespaces (:func:`per_thread`) every layer uses are made here, from
``_thread``, the primitives ``threading`` itself hands out (its ``Lock``, ``RLock`` and ``local``
are these types): importing ``threading`` costs a fresh process about a millisecond, most of it
the ``functools`` and ``collections`` it imports, none of which a first allocation needs (issue 9).

This module sits below the driver layer; it imports nothing of cuproc's.
"""
from __future__ import annotations

import _thread
import os
import weakref

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# FORKED[0] is True in a child forked after cuInit.  A one-element list so that hot paths can
# bind it once (a local or default argument) and test it for the cost of an index.
FORKED: list[bool] = [False]
_initialized_in_pid: list[int | None] = [None]
_locks: weakref.WeakSet[Any] = weakref.WeakSet()
_child_hooks: list[Callable[[], None]] = []


def note_initialized() -> None:
    """cuInit succeeded in this process."""
    _initialized_in_pid[0] = os.getpid()


def lock() -> _thread.LockType:
    """A lock (a ``threading.Lock``) that is re-initialized (released) in a forked child."""
    new = _thread.allocate_lock()
    _locks.add(new)
    return new


def rlock() -> _thread.RLock:
    """A re-entrant lock (a ``threading.RLock``) that is re-initialized in a forked child."""
    new = _thread.RLock()
    _locks.add(new)
    return new


def per_thread() -> Any:
    """A new ``threading.local()``: a namespace whose attributes each thread sees its own of."""
    return _thread._local()


def on_fork_in_child(hook: Callable[[], None]) -> None:
    """Run ``hook()`` in every forked child (after the locks are fresh); hooks never raise."""
    _child_hooks.append(hook)


def _after_fork_in_child() -> None:
    for held in list(_locks):
        held._at_fork_reinit()
    if _initialized_in_pid[0] is not None:
        _initialized_in_pid[0] = None
        FORKED[0] = True
    for hook in _child_hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - a fork hook must not break the child
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
