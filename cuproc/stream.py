"""Streams, events and host callbacks.

Policy
------
* Every asynchronous operation takes a stream; ``None`` means the default
  stream the handle's per-thread flag selects (``CU_STREAM_PER_THREAD`` or
  ``CU_STREAM_LEGACY``), see :func:`default_stream`.
* A stream holds the context it was made in; it is destroyed with that
  context current, by :meth:`Stream.close` or its finalizer.
* Host callbacks (``cuLaunchHostFunc``) take any Python callable.  The
  callable is kept alive until it has run; an exception it raises is kept and
  re-raised (as :class:`HostCallbackError`) by the stream's next
  :meth:`Stream.synchronize`, not lost in a driver thread.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from ._cffi_abi import ffi
from ._support import CUDA_ERROR_NOT_READY, get_driver, handle_int
from .context import Context
from .driver import Driver
from .errors import InvalidContextError, result_code

CU_STREAM_LEGACY = ffi.cast("CUstream", 1)
CU_STREAM_PER_THREAD = ffi.cast("CUstream", 2)


class HostCallbackError(RuntimeError):
    """A host function launched on a stream raised; the original is the ``__cause__``."""


def default_stream(driver: Driver | None = None) -> Any:
    """The default stream handle: per-thread when the handle selects per-thread entries."""
    drv = get_driver(driver)
    return CU_STREAM_PER_THREAD if drv.per_thread_default_stream else CU_STREAM_LEGACY


def stream_handle(stream: Stream | Any | None, driver: Driver | None = None) -> Any:
    """A CUstream for ``stream`` (a Stream, a raw handle, an int, or None for the default)."""
    if stream is None:
        return default_stream(driver)
    if isinstance(stream, Stream):
        return stream.handle
    if isinstance(stream, int):
        return ffi.cast("CUstream", stream)
    return ffi.cast("CUstream", stream)


# One trampoline for every host callback: user data is a handle to the pending record.
_pending: dict[int, tuple[Callable[[], Any], Stream]] = {}
_pending_lock = threading.Lock()
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


class Stream:
    """A CUDA stream (cuStreamCreateWithPriority), bound to the context current at creation."""

    def __init__(self, *, non_blocking: bool = False, priority: int = 0, flags: int | None = None,
                 driver: Driver | None = None) -> None:
        self.driver = drv = get_driver(driver)
        self.context = Context.current(driver=drv)
        if self.context is None:
            raise InvalidContextError(result_code("CUDA_ERROR_INVALID_CONTEXT"), "cuStreamCreateWithPriority")
        if flags is None:
            flags = drv.CU_STREAM_NON_BLOCKING if non_blocking else drv.CU_STREAM_DEFAULT
        out = ffi.new("CUstream *")
        drv.checked.cuStreamCreateWithPriority(out, flags, priority)
        self.handle = out[0]
        self._callback_errors: list[BaseException] = []
        self._finalizer = weakref.finalize(self, _destroy_stream, drv, self.context, self.handle)

    @staticmethod
    def priority_range(*, driver: Driver | None = None) -> tuple[int, int]:
        """(least, greatest) priority; numerically lower is higher priority."""
        lo, hi = ffi.new("int *"), ffi.new("int *")
        get_driver(driver).checked.cuCtxGetStreamPriorityRange(lo, hi)
        return lo[0], hi[0]

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def priority(self) -> int:
        out = ffi.new("int *")
        self.driver.checked.cuStreamGetPriority(self.handle, out)
        return out[0]

    @property
    def flags(self) -> int:
        out = ffi.new("unsigned int *")
        self.driver.checked.cuStreamGetFlags(self.handle, out)
        return out[0]

    def synchronize(self) -> None:
        """Wait for the stream; re-raise the first exception a host callback raised since the last call."""
        self.driver.checked.cuStreamSynchronize(self.handle)
        if self._callback_errors:
            errors, self._callback_errors = self._callback_errors, []
            raise HostCallbackError(f"a host function on this stream raised {type(errors[0]).__name__}: "
                                    f"{errors[0]} ({len(errors)} error(s) in all)") from errors[0]

    def query(self) -> bool:
        """True when all work is done (cuStreamQuery), False while it runs."""
        rc = self.driver.cuStreamQuery(self.handle)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self.driver.check(rc, "cuStreamQuery")
        return True

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (cuStreamWaitEvent)."""
        self.driver.checked.cuStreamWaitEvent(self.handle, event.handle, 0)

    def launch_host_func(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on a driver thread once prior work on the stream is done (cuLaunchHostFunc).
        ``fn`` must not call CUDA."""
        launch_host_func(self, fn)

    def __repr__(self) -> str:
        return f"<cuproc.Stream {handle_int(self.handle):#x}>"


def launch_host_func(stream: Stream, fn: Callable[[], Any]) -> None:
    with _pending_lock:
        _next_token[0] += 1
        token = _next_token[0]
        _pending[token] = (fn, stream)
    rc = stream.driver.cuLaunchHostFunc(stream.handle, _host_trampoline, ffi.cast("void *", token))
    if rc:
        with _pending_lock:
            _pending.pop(token, None)
        stream.driver.check(rc, "cuLaunchHostFunc")


def _destroy_stream(driver: Driver, context: Context, handle: Any) -> None:
    """Finalizer: ``context`` (the object) is held until here, so the context is still alive."""
    try:
        if context.alive and driver.cuCtxPushCurrent(context.handle) == 0:
            driver.cuStreamDestroy(handle)
            driver.cuCtxPopCurrent(ffi.new("CUcontext *"))
    except Exception:  # noqa: BLE001 - finalizer
        pass


class Event:
    """A CUDA event.  ``timing=False`` gives CU_EVENT_DISABLE_TIMING (cheaper), ``interprocess``
    CU_EVENT_INTERPROCESS (needs timing off)."""

    def __init__(self, *, timing: bool = True, blocking_sync: bool = False, interprocess: bool = False,
                 driver: Driver | None = None) -> None:
        self.driver = drv = get_driver(driver)
        flags = 0
        if not timing:
            flags |= drv.CU_EVENT_DISABLE_TIMING
        if blocking_sync:
            flags |= drv.CU_EVENT_BLOCKING_SYNC
        if interprocess:
            flags |= drv.CU_EVENT_INTERPROCESS
        self.flags = flags
        self.context = Context.current(driver=drv)
        out = ffi.new("CUevent *")
        drv.checked.cuEventCreate(out, flags)
        self.handle = out[0]
        self._finalizer = weakref.finalize(self, _destroy_event, drv, self.context, self.handle)

    def record(self, stream: Stream | Any | None = None) -> Event:
        self.driver.checked.cuEventRecord(self.handle, stream_handle(stream, self.driver))
        return self

    def synchronize(self) -> None:
        self.driver.checked.cuEventSynchronize(self.handle)

    def query(self) -> bool:
        rc = self.driver.cuEventQuery(self.handle)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self.driver.check(rc, "cuEventQuery")
        return True

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded and complete)."""
        out = ffi.new("float *")
        self.driver.checked.cuEventElapsedTime(out, self.handle, end.handle)
        return out[0]

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Event:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _destroy_event(driver: Driver, context: Context | None, handle: Any) -> None:
    try:
        if context is None or context.alive:
            driver.cuEventDestroy(handle)
    except Exception:  # noqa: BLE001 - finalizer
        pass


__all__ = ["Event", "HostCallbackError", "Stream", "default_stream", "launch_host_func"]
