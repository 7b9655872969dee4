"""Start and stop profile collection: ``cuProfilerStart`` / ``cuProfilerStop``.

Policy
------
* Both driver calls act on the *current* context, so each function here runs
  them in a context through :meth:`Context.run` (made current only for the
  call; the thread's stack is left as it was).  Without an explicit context
  the thread's current one is used, and none current is an
  InvalidContextError before the driver is asked.
* Without a profiling tool attached (Nsight Systems with
  ``--capture-range=cudaProfilerApi``, ncu) both calls succeed and do nothing.
* ``with profiler.range():`` stops even when its body raises; a failing stop
  then becomes a :class:`~cuproc.errors.CudaWarning`, so it never hides the
  body's error.

::

    from cuproc import profiler
    with profiler.range():          # cuProfilerStart ... cuProfilerStop
        run(d, d, d, n)
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from .context import Context
from .errors import CudaError, CudaWarning

__all__ = ["start", "stop"]   # not range: a star import would shadow the builtin; use profiler.range


def _context(context: Context | None, call: str) -> Context:
    return Context.given(context, call) if context is not None else Context.require_current(call)


def start(context: Context | None = None) -> None:
    """cuProfilerStart in ``context`` (default: the current one): the attached tool starts collecting."""
    _context(context, "cuProfilerStart").run("cuProfilerStart")


def stop(context: Context | None = None) -> None:
    """cuProfilerStop in ``context`` (default: the current one): the attached tool stops collecting."""
    _context(context, "cuProfilerStop").run("cuProfilerStop")


@contextmanager
def range(context: Context | None = None) -> Iterator[Context]:  # noqa: A001 - profiler.range reads right
    """Collect profile data for the block: cuProfilerStart on entry, cuProfilerStop on exit."""
    ctx = _context(context, "cuProfilerStart")
    start(ctx)
    try:
        yield ctx
    except BaseException:
        try:
            stop(ctx)
        except CudaError as exc:
            warnings.warn(f"cuProfilerStop after an error in the profiled block failed: {exc}", CudaWarning,
                          stacklevel=3)
        raise
    stop(ctx)
