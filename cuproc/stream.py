"""Streams, events and host callbacks.

Policy
------
* Every asynchronous operation takes a stream; ``None`` means the default
  stream the handle's per-thread flag selects (``CU_STREAM_PER_THREAD`` or
  ``CU_STREAM_LEGACY``), see :func:`default_stream`.
* Streams and events are resources (:mod:`cuproc._resource`): they hold the
  context they were made in, run every call in it from any thread, and refuse
  use once closed or once that context ended.
* Streams of other libraries are accepted wherever a stream is: any object
  with ``__cuda_stream__`` (the cuda.core protocol: ``(version, handle)``), a
  PyTorch stream (``.cuda_stream``), a CuPy stream (``.ptr``), a raw CUstream
  or an int.  :meth:`Stream.from_handle` wraps one as a Stream that is not
  owned (``close()`` never destroys it) and keeps its foreign owner alive;
  cuproc objects that keep a stream (a stream-ordered buffer) wrap it so.
  Each Stream exports ``__cuda_stream__`` itself.
* Host callbacks (``cuLaunchHostFunc``) take any Python callable.  The
  callable is kept alive until it has run; an exception it raises is kept and
  re-raised (as :class:`HostCallbackError`) by the stream's next
  :meth:`Stream.synchronize`, not lost in a driver thread.
"""
from __future__ import annotations

import weakref

from . import _fork
from ._ffi import ffi
from ._resource import Resource, report
from ._immortal import keep_forever
from ._support import CUDA_ERROR_NOT_READY, arity, get_driver, handle_int, invalid
from .context import Context
from .driver import Driver

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

CU_STREAM_LEGACY = ffi.cast("CUstream", 1)
CU_STREAM_PER_THREAD = ffi.cast("CUstream", 2)


class HostCallbackError(RuntimeError):
    """A host function launched on a stream raised; the original is the ``__cause__``."""


def default_stream(driver: Driver | None = None) -> Any:
    """The default stream handle: per-thread when the handle selects per-thread entries."""
    drv = get_driver(driver)
    return CU_STREAM_PER_THREAD if drv.per_thread_default_stream else CU_STREAM_LEGACY


def stream_handle(stream: Stream | Any | None, driver: Driver | None = None, call: str = "stream") -> Any:
    """A CUstream for ``stream`` (a Stream, a raw handle, an int, another library's stream, or None
    for the default).  A closed Stream (or one whose context ended) raises before its handle is used."""
    if stream is None:
        return default_stream(driver)
    if isinstance(stream, Stream):
        stream.check(call)
        return stream.handle
    if isinstance(stream, (int, ffi.CData)):
        return ffi.cast("CUstream", stream)
    return ffi.cast("CUstream", foreign_stream_handle(stream, call))


def foreign_stream_handle(obj: Any, call: str = "stream") -> int:
    """The CUstream value of another library's stream object, as an int.

    ``__cuda_stream__()`` (cuda.core's protocol; PyTorch and CuPy streams of recent versions) first,
    then PyTorch's ``.cuda_stream`` and CuPy's ``.ptr`` (on objects whose type is named ``*Stream``).
    """
    protocol = getattr(obj, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        if not (isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value)):
            raise invalid(call, f"{type(obj).__name__}.__cuda_stream__() returned {value!r}; the protocol "
                                "gives (version, handle) as two ints")
        if value[0] != 0:
            raise invalid(call, f"{type(obj).__name__}.__cuda_stream__() is version {value[0]}; cuproc reads "
                                "version 0")
        return value[1]
    for attribute in ("cuda_stream", "ptr"):
        value = getattr(obj, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and \
                (attribute == "cuda_stream" or type(obj).__name__.endswith("Stream")):
            return value
    raise TypeError(f"{call}: a stream must be a cuproc.Stream, an object with __cuda_stream__ (cuda.core, "
                    f"PyTorch, CuPy streams), a raw CUstream or int handle, or None for the default stream; "
                    f"got {type(obj).__name__}")


def as_stream(stream: Stream | Any | None, call: str = "stream", *,
              context: Context | None = None, driver: Driver | None = None) -> Stream | Any | None:
    """``stream`` as cuproc keeps it: a Stream, None or a raw handle stay; another library's stream
    object becomes a not-owned :class:`Stream` that keeps that object alive."""
    if stream is None or isinstance(stream, (Stream, int, ffi.CData)):
        return stream
    handle = foreign_stream_handle(stream, call)
    if handle <= 2:     # a library's name for a default stream (NULL, legacy, per-thread): nothing to keep
        return ffi.cast("CUstream", handle)
    drv = get_driver(driver if context is None else context.driver)
    return Stream.from_handle(handle, owner=stream, context=foreign_context(handle, context, drv),
                              driver=drv)


# (id(driver), stream handle) -> weakly, the Context cuStreamGetCtx named for that handle.  Keyed by the
# handle, with weak references to cuproc's own Contexts only: a module-level table of weak references to
# other libraries' objects (their streams, their arrays) met one of theirs freed without its weak
# references cleared, and the table's teardown at interpreter exit crashed (SIGSEGV in
# _PyModule_Clear of this module, measured on the H200 with torch, CuPy and cuda.core loaded).
_contexts: dict[tuple[int, int], weakref.ref[Context]] = {}
_CONTEXTS_KEPT = 64     # handles remembered at most (the table starts over beyond)


def _stream_context(driver: Driver, stream: Any) -> tuple[int, Any]:
    """cuStreamGetCtx of ``stream`` (a CUstream) at the ABI the handle selected: (CUresult, CUcontext)."""
    out = ffi.new("CUcontext *")
    args = (stream, out, ffi.NULL) if arity(driver, "cuStreamGetCtx") == 3 else (stream, out)
    return driver.cuStreamGetCtx(*args), out[0]


def foreign_context(handle: int, context: Context | None, driver: Driver) -> Context:
    """The context of another library's stream ``handle``: ``context`` when given, else cuStreamGetCtx's
    answer.  The Context object is made once per handle and driver and found again while it lives;
    each use asks cuStreamGetCtx once more (a handle can be destroyed and made again in another
    context), which is all a known handle costs."""
    if context is not None:
        return context      # (Stream.from_handle takes it through Context.given)
    key = (id(driver), handle)
    ref = _contexts.get(key)
    known = ref() if ref is not None else None
    if known is not None and known.ended is None and known.driver is driver:
        rc, current = _stream_context(driver, ffi.cast("CUstream", handle))
        if rc == 0 and handle_int(current) == handle_int(known.handle):
            return known
    found = Stream.from_handle(handle, driver=driver).context
    if len(_contexts) >= _CONTEXTS_KEPT:
        _contexts.clear()
    _contexts[key] = weakref.ref(found)
    return found


def order_after(context: Context, waiter: Any, signaller: Any, waiter_context: Context | None = None) -> None:
    """Make later work on stream ``waiter`` wait for the work queued on ``signaller`` so far, without
    blocking the host: cuEventRecord on ``signaller`` and cuStreamWaitEvent on ``waiter``, with a
    timing-free event made in ``context`` -- the signaller's, as cuEventRecord needs -- and destroyed
    at once (the driver keeps it until it fired).  The wait runs in ``waiter_context`` when known
    (the event may belong to another context), else in ``context``."""
    drv = context.driver
    run = context.call_current
    out = ffi.new("CUevent *")
    drv.check(run(drv.cuEventCreate, out, drv.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    event = out[0]
    try:
        drv.check(run(drv.cuEventRecord, event, ffi.cast("CUstream", signaller)), "cuEventRecord")
        wait = (waiter_context or context).call_current
        drv.check(wait(drv.cuStreamWaitEvent, ffi.cast("CUstream", waiter), event, 0), "cuStreamWaitEvent")
    except BaseException:
        try:
            run(drv.cuEventDestroy, event)
        except Exception as cleanup:  # noqa: BLE001 - the first error stands; the cleanup's is a warning
            report(f"destroying the event of a failed stream wait failed too: {cleanup}")
        raise
    drv.check(run(drv.cuEventDestroy, event), "cuEventDestroy")


def stream_context(stream: Stream | Any | None) -> Context | None:
    """The context a stream argument belongs to, when cuproc knows it."""
    return stream.context if isinstance(stream, Stream) else None


# One trampoline for every host callback: user data is a handle to the pending record.
_pending: dict[int, tuple[Callable[[], Any], Stream]] = {}
_pending_lock = _fork.lock()
_next_token = [0]


def _run_host_function(user_data: Any, _handle_int: Any = handle_int, _lock: Any = _pending_lock,
                       _records: Any = _pending) -> None:
    token = _handle_int(user_data)
    with _lock:
        record = _records.pop(token, None)
    if record is None:   # dropped by launch_host_func, whose call raised: nothing to run (and no
        return           # KeyError to raise inside a C callback)
    fn, stream = record
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - kept and re-raised on the caller's thread
        stream._callback_errors.append(exc)


_trampoline: list[Any] = []   # the one cffi callback around _run_host_function, made on first use


def _host_trampoline() -> Any:
    """The C function the driver calls for every host function (``_run_host_function``).

    Made by the first launch_host_func, not at import: the callback and keep_forever's ctypes cost a
    process that never runs a host function about 2 ms (issue 9's startup goal).  launch_host_func
    takes it before it stores its pending record, so a failure here leaves no record behind.  The
    driver may call it after this module's teardown (a host function still pending at exit), so its C
    closure is never freed (one leaked reference, as cuproc._dlpack does for its callbacks), and it
    reads no module globals (the defaults above)."""
    with _pending_lock:
        if not _trampoline:
            callback = ffi.callback("void(void *)", _run_host_function)
            keep_forever(callback)
            _trampoline.append(callback)
        return _trampoline[0]


def host_function_mark() -> int:
    """A mark of the host functions launched so far (for :func:`take_host_functions`): what a stream capture
    notes when it begins, to find the host functions it met."""
    return _next_token[0]


def take_host_function(fn_pointer: Any, user_data: Any) -> Callable[[], Any] | None:
    """The callable of a host function that :func:`launch_host_func` queued -- ``fn_pointer`` and
    ``user_data`` as a host node made of it by a stream capture reports them -- whose record is removed:
    the caller (a graph, which runs it at each launch) keeps it from now on.  None for another function or
    a record already gone."""
    if not _trampoline or fn_pointer != _trampoline[0]:
        return None
    with _pending_lock:
        record = _pending.pop(handle_int(user_data), None)
    return None if record is None else record[0]


def take_host_functions(since: int, streams: Any) -> int:
    """Forget the host functions launched after mark ``since`` on any of ``streams`` (Stream objects):
    a failed stream capture's, which will never run.  Returns how many went."""
    with _pending_lock:
        gone = [t for t, (_fn, s) in _pending.items() if t > since and any(s is x for x in streams)]
        for token in gone:
            del _pending[token]
    return len(gone)


def host_function_streams(since: int) -> list[Stream]:
    """The streams of the host functions launched after mark ``since`` and not run yet (each once)."""
    with _pending_lock:
        found = [s for t, (_fn, s) in _pending.items() if t > since]
    return list({id(s): s for s in found}.values())


class Stream(Resource):
    """A CUDA stream (cuStreamCreateWithPriority) in the context current at creation, which it holds.

    Every operation runs in that context from any thread; ``close()`` (idempotent) or dropping the
    last reference destroys it.  Work already queued on it still runs.  A Stream has ``__slots__`` and
    no instance ``__dict__`` (the compiled fast path reads its context and handle by offset): subclass
    it to attach attributes.
    """

    __slots__ = ("context", "handle", "owned", "owner", "_callback_errors", "blocking")
    context: Context
    handle: Any                       # the CUstream (a cffi cdata)
    owned: bool                       # False for another library's stream (from_handle): never destroyed here
    owner: Any                        # that library's object, kept alive with this one
    _callback_errors: list[BaseException]
    _release_call = "cuStreamDestroy"

    def __init__(self, *, non_blocking: bool = False, priority: int = 0, flags: int | None = None,
                 context: Context | None = None, driver: Driver | None = None) -> None:
        if context is not None:
            context = Context.given(context, "cuStreamCreateWithPriority")
        self.driver = drv = get_driver(driver if context is None else context.driver)
        ctx, run = Context.target(context, "cuStreamCreateWithPriority", driver=drv)
        if flags is None:
            flags = drv.CU_STREAM_NON_BLOCKING if non_blocking else drv.CU_STREAM_DEFAULT
        out = ffi.new("CUstream *")
        drv.check(run(drv.cuStreamCreateWithPriority, out, flags, priority), "cuStreamCreateWithPriority")
        self.context = ctx
        self.handle = out[0]
        self.owned, self.owner = True, None
        self._callback_errors = []
        #: made without CU_STREAM_NON_BLOCKING: its work and the legacy default stream's are ordered both
        #: ways by the driver (False where not known: another library's stream)
        self.blocking = not flags & drv.CU_STREAM_NON_BLOCKING
        self._checked_at = -1       # not checked yet: hot paths (GraphExec.launch) compare it without getattr
        self.ended = None           # last: a half-built object has nothing to release

    @classmethod
    def from_handle(cls, handle: Any, *, owner: Any = None, context: Context | None = None,
                    driver: Driver | None = None) -> Stream:
        """A Stream over a CUstream made elsewhere (an int or a raw handle), not owned: ``close()``
        and dropping it never destroy the handle.  It keeps ``owner`` (the library object the handle
        came from) alive as long as it lives.  Its context is ``context``, else the driver's answer
        (cuStreamGetCtx); keeping the stream's context alive is the owner's business."""
        if context is not None:
            context = Context.given(context, "Stream.from_handle")
        drv = get_driver(driver if context is None else context.driver)
        if isinstance(handle, ffi.CData):
            handle = handle_int(handle)
        if not isinstance(handle, int) or isinstance(handle, bool) or handle <= 2:
            # The driver call a bad handle stops: cuStreamGetCtx, unless the context was given.  A Stream is
            # never a default stream (0, CU_STREAM_LEGACY = 1, CU_STREAM_PER_THREAD = 2): those are whichever
            # context is current's, so calls on them are bound differently (Context.call_on).
            raise invalid("cuStreamGetCtx" if context is None else "Stream.from_handle",
                          f"a stream handle is an int above 2 or a CUstream, got {handle!r} (0, 1 and 2 name "
                          "the default stream of whichever context is current: pass None, or the value itself "
                          "where a call takes a stream)")
        h = ffi.cast("CUstream", handle)
        if context is None:
            rc, found = _stream_context(drv, h)
            drv.check(rc, "cuStreamGetCtx")
            context = Context.adopt(found, driver=drv)
        context.check("Stream.from_handle")
        stream = cls.__new__(cls)
        stream.driver, stream.context, stream.handle = drv, context, h
        stream.owned, stream.owner = False, owner
        stream._callback_errors = []
        stream.blocking = False     # not known without asking the driver: treated as non-blocking
        stream._checked_at = -1
        stream.ended = None
        return stream

    def __cuda_stream__(self) -> tuple[int, int]:
        """The cuda.core stream protocol: (protocol version 0, the CUstream as an int)."""
        self.check("__cuda_stream__")
        return (0, handle_int(self.handle))

    def parents(self) -> tuple[Resource, ...]:
        return (self.context,)

    def describe(self) -> str:
        return f"stream {handle_int(self.handle):#x}" + ("" if self.owned else " (not owned)")

    def _drop_releases_a_handle(self) -> bool:
        return self.owned

    def _release(self) -> int:
        if not self.owned:
            return 0          # another library's stream: theirs to destroy
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
    trampoline = _trampoline[0] if _trampoline else _host_trampoline()
    with _pending_lock:
        _next_token[0] += 1
        token = _next_token[0]
        _pending[token] = (fn, stream)
    try:
        rc = stream.context.call(stream.driver.cuLaunchHostFunc, stream.handle, trampoline, ffi.cast("void *", token))
    except Exception:   # refused before the driver queued it: the record must not stay.  A KeyboardInterrupt
        with _pending_lock:   # may come after the driver queued it: the record stays, so the function runs.
            _pending.pop(token, None)
        raise
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
        if context is not None:
            context = Context.given(context, "cuEventCreate")
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


def stream_capturing(driver: Driver, context: Context, h: Any) -> int:
    """cuStreamIsCapturing of stream ``h`` in ``context``: its CUstreamCaptureStatus (0: not capturing)."""
    call = "cuStreamIsCapturing"
    out = ffi.new("CUstreamCaptureStatus *")
    driver.check(context.call_on(h, driver.cuStreamIsCapturing, h, out), call)
    return int(out[0])


# as_stream, foreign_context, foreign_stream_handle and order_after are the interop layer's helpers, and
# stream_capturing the memory and graph layers': importable from here, not part of the public API.
__all__ = ["Event", "HostCallbackError", "Stream", "default_stream", "launch_host_func", "stream_context",
           "stream_handle"]
