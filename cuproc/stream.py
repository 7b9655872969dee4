"""Streams, events and host callbacks.

Policy
------
* Every asynchronous operation takes a stream; ``None`` means the default
  stream the handle's per-thread flag selects (``CU_STREAM_PER_THREAD`` or
  ``CU_STREAM_LEGACY``), see :func:`default_stream`.
* Streams and events are resources (:mod:`cuproc._resource`): they hold the
  context they were made in, run every call in it from any thread, and refuse
  use once closed or once that context ended.
* Host callbacks (``cuLaunchHostFunc``) take any Python callable.  The
  callable is kept alive until it has run; an exception it raises is kept and
  re-raised (as :class:`HostCallbackError`) by the stream's next
  :meth:`Stream.synchronize`, not lost in a driver thread.
"""
from __future__ import annotations

from typing import Any, Callable

from . import _fork
from ._ffi import ffi
from ._resource import Resource
from ._support import CUDA_ERROR_NOT_READY, get_driver, handle_int
from .context import Context
from .driver import Driver

CU_STREAM_LEGACY = ffi.cast("CUstream", 1)
CU_STREAM_PER_THREAD = ffi.cast("CUstream", 2)


class HostCallbackError(RuntimeError):
    """A host function launched on a stream raised; the original is the ``__cause__``."""


def default_stream(driver: Driver | None = None) -> Any:
    """The default stream handle: per-thread when the handle selects per-thread entries."""
    drv = get_driver(driver)
    return CU_STREAM_PER_THREAD if drv.per_thread_default_stream else CU_STREAM_LEGACY


def stream_handle(stream: Stream | Any | None, driver: Driver | None = None, call: str = "stream") -> Any:
    """A CUstream for ``stream`` (a Stream, a raw handle, an int, or None for the default).
    A closed Stream (or one whose context ended) raises before its handle is used."""
    if stream is None:
        return default_stream(driver)
    if isinstance(stream, Stream):
        stream.check(call)
        return stream.handle
    return ffi.cast("CUstream", stream)


def stream_context(stream: Stream | Any | None) -> Context | None:
    """The context a stream argument belongs to, when cuproc knows it."""
    return stream.context if isinstance(stream, Stream) else None


# One trampoline for every host callback: user data is a handle to the pending record.
_pending: dict[int, tuple[Callable[[], Any], Stream]] = {}
_pending_lock = _fork.lock()
_next_token = [0]


@ffi.callback("void(void *)")
def _host_trampoline(user_data: Any) -> None:
    token = handle_int(user_data)
    with _pending_lock:
        fn, stream = _pending.pop(token)
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - kept and re-raised on the caller's thread
        stream._callback_errors.append(exc)


class Stream(Resource):
    """A CUDA stream (cuStreamCreateWithPriority) in the context current at creation, which it holds.

    Every operation runs in that context from any thread; ``close()`` (idempotent) or dropping the
    last reference destroys it.  Work already queued on it still runs.
    """

    _release_call = "cuStreamDestroy"

    def __init__(self, *, non_blocking: bool = False, priority: int = 0, flags: int | None = None,
                 context: Context | None = None, driver: Driver | None = None) -> None:
        self.driver = drv = get_driver(driver if context is None else context.driver)
        ctx, run = Context.target(context, "cuStreamCreateWithPriority", driver=drv)
        if flags is None:
            flags = drv.CU_STREAM_NON_BLOCKING if non_blocking else drv.CU_STREAM_DEFAULT
        out = ffi.new("CUstream *")
        drv.check(run(drv.cuStreamCreateWithPriority, out, flags, priority), "cuStreamCreateWithPriority")
        self.context = ctx
        self.handle = out[0]
        self._callback_errors: list[BaseException] = []
        self.ended = None           # last: a half-built object has nothing to release

    def parents(self) -> tuple[Resource, ...]:
        return (self.context,)

    def describe(self) -> str:
        return f"stream {handle_int(self.handle):#x}"

    def _release(self) -> int:
        return self.context.call(self.driver.cuStreamDestroy, self.handle)

    @staticmethod
    def priority_range(*, driver: Driver | None = None) -> tuple[int, int]:
        """(least, greatest) priority; numerically lower is higher priority."""
        lo, hi = ffi.new("int *"), ffi.new("int *")
        get_driver(driver).checked.cuCtxGetStreamPriorityRange(lo, hi)
        return lo[0], hi[0]

    def _run(self, call: str, *args: Any) -> int:
        self.check(call)
        return self.context.call(getattr(self.driver, call), self.handle, *args)

    @property
    def priority(self) -> int:
        out = ffi.new("int *")
        self.driver.check(self._run("cuStreamGetPriority", out), "cuStreamGetPriority")
        return out[0]

    @property
    def flags(self) -> int:
        out = ffi.new("unsigned int *")
        self.driver.check(self._run("cuStreamGetFlags", out), "cuStreamGetFlags")
        return out[0]

    def synchronize(self) -> None:
        """Wait for the stream; re-raise the first exception a host callback raised since the last call."""
        self.driver.check(self._run("cuStreamSynchronize"), "cuStreamSynchronize")
        if self._callback_errors:
            errors, self._callback_errors = self._callback_errors, []
            raise HostCallbackError(f"a host function on this stream raised {type(errors[0]).__name__}: "
                                    f"{errors[0]} ({len(errors)} error(s) in all)") from errors[0]

    def query(self) -> bool:
        """True when all work is done (cuStreamQuery), False while it runs."""
        rc = self._run("cuStreamQuery")
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self.driver.check(rc, "cuStreamQuery")
        return True

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (cuStreamWaitEvent)."""
        event.check("cuStreamWaitEvent")
        self.driver.check(self._run("cuStreamWaitEvent", event.handle, 0), "cuStreamWaitEvent")

    def launch_host_func(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on a driver thread once prior work on the stream is done (cuLaunchHostFunc).
        ``fn`` must not call CUDA."""
        launch_host_func(self, fn)

    def __repr__(self) -> str:
        return f"<cuproc.Stream {handle_int(self.handle):#x}{' ' + self.ended if self.ended else ''}>"


def launch_host_func(stream: Stream, fn: Callable[[], Any]) -> None:
    """cuLaunchHostFunc on ``stream``; the pending record keeps ``fn`` and the stream alive until it ran."""
    stream.check("cuLaunchHostFunc")
    with _pending_lock:
        _next_token[0] += 1
        token = _next_token[0]
        _pending[token] = (fn, stream)
    rc = stream.context.call(stream.driver.cuLaunchHostFunc, stream.handle, _host_trampoline,
                             ffi.cast("void *", token))
    if rc:
        with _pending_lock:
            _pending.pop(token, None)
        stream.driver.check(rc, "cuLaunchHostFunc")


class Event(Resource):
    """A CUDA event in the current context, which it holds.  ``timing=False`` gives
    CU_EVENT_DISABLE_TIMING (cheaper), ``interprocess`` CU_EVENT_INTERPROCESS (needs timing off)."""

    _release_call = "cuEventDestroy"

    def __init__(self, *, timing: bool = True, blocking_sync: bool = False, interprocess: bool = False,
                 context: Context | None = None, driver: Driver | None = None) -> None:
        self.driver = drv = get_driver(driver if context is None else context.driver)
        flags = 0
        if not timing:
            flags |= drv.CU_EVENT_DISABLE_TIMING
        if blocking_sync:
            flags |= drv.CU_EVENT_BLOCKING_SYNC
        if interprocess:
            flags |= drv.CU_EVENT_INTERPROCESS
        self.flags = flags
        ctx, run = Context.target(context, "cuEventCreate", driver=drv)
        out = ffi.new("CUevent *")
        drv.check(run(drv.cuEventCreate, out, flags), "cuEventCreate")
        self.context = ctx
        self.handle = out[0]
        self.ended = None

    def parents(self) -> tuple[Resource, ...]:
        return (self.context,)

    def describe(self) -> str:
        return f"event {handle_int(self.handle):#x}"

    def _release(self) -> int:
        return self.context.call(self.driver.cuEventDestroy, self.handle)

    def _run(self, call: str, *args: Any) -> int:
        self.check(call)
        return self.context.call(getattr(self.driver, call), self.handle, *args)

    def record(self, stream: Stream | Any | None = None) -> Event:
        h = stream_handle(stream, self.driver, "cuEventRecord")
        self.driver.check(self._run("cuEventRecord", h), "cuEventRecord")
        return self

    def synchronize(self) -> None:
        self.driver.check(self._run("cuEventSynchronize"), "cuEventSynchronize")

    def query(self) -> bool:
        rc = self._run("cuEventQuery")
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self.driver.check(rc, "cuEventQuery")
        return True

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded and complete)."""
        self.check("cuEventElapsedTime")
        end.check("cuEventElapsedTime")
        out = ffi.new("float *")
        self.driver.check(self.context.call(self.driver.cuEventElapsedTime, out, self.handle, end.handle),
                          "cuEventElapsedTime")
        return out[0]


__all__ = ["Event", "HostCallbackError", "Stream", "default_stream", "launch_host_func", "stream_context",
           "stream_handle"]
