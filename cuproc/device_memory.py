"""Device memory: linear allocations (cuMemAlloc, stream-ordered cuMemAllocAsync), typed views,
and ``__device__`` variables of modules and libraries.

Policy
------
* A :class:`DeviceBuffer` holds its context; a stream-ordered one also holds
  the stream (and pool) it came from.  Dropped without ``free``, a
  stream-ordered buffer is freed stream-ordered on that stream while the stream
  is usable, synchronously otherwise -- so a pool's memory always comes back.
* Allocation takes the context from what the caller already holds (``context=``,
  the stream) and asks the driver for the current one only when given nothing.
* A stream-ordered buffer is entered in its context's table of stream-ordered
  allocations (so that the context frees it before it goes), keyed by the
  buffer's own weak reference (``claim_key``), not its address.  Removing that
  entry -- one dict pop, atomic between threads -- is the one claim to free it:
  ``free_async``, ``close``, the finalizer and the context's teardown all
  remove it first, and only the one that got it calls cuMemFreeAsync
  (:meth:`~cuproc.context.Context.untrack_stream_ordered`).  Pools hand freed
  addresses out again at once; keyed per buffer, no buffer's claim can take
  the entry of a later buffer at the same address (a dead weak reference
  equals only itself).  The key also lets the teardown end a live buffer
  ("freed") without the table holding it.
* ``alloc_async(n, stream).free_async()`` on a cuproc Stream is the hot path of
  stream-ordered code: it makes exactly the two driver calls, in the stream's
  context as is (a binding error alone brings the push/retry of
  :meth:`~cuproc.context.Context.call`), and checks the stream, the context and
  fork with three reads instead of a walk of the parents.
* A buffer remembers the stream of the last stream-ordered work cuproc queued
  on it (``last_stream``: alloc_async, async copies and memsets; None for the
  default stream), which its ``__cuda_array_interface__`` and ``__dlpack__``
  hand to consumers (:mod:`cuproc.interop`).
* A :class:`DeviceView` holds its buffer; a :class:`GlobalView` holds its module
  or library.  Both refuse use once what they view has ended.
"""
from __future__ import annotations

import weakref

from . import _fork, fastpath
from ._ffi import ffi
from ._resource import DEFER_DROP, FORKED, Resource, report
from ._support import get_driver, handle_int, invalid
from .allocation import EXPORTS, Allocation
from .context import (Context, is_default_stream, pushing_failed, register_stream_ordered_memory,
                      synchronize_context)
from .driver import DEFAULT_HANDLE, Driver
from .errors import CudaError, add_note, result_code
from .interop import KDL_CUDA, DeviceArrayExports, cai, default_marker, typestr_of
from .stream import Stream, as_stream, default_stream, foreign_context, stream_capturing, stream_handle

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .pools import MemoryPool

_SIZE_MAX = (1 << (8 * ffi.sizeof("size_t"))) - 1
_EVENT_DISABLE_TIMING = 2                         # CU_EVENT_DISABLE_TIMING
_PER_THREAD = 2                                   # CU_STREAM_PER_THREAD's value
_CAPTURE_INVALIDATED = result_code("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
_LEGACY = 1                                       # CU_STREAM_LEGACY's
_DEVICE_POINTER = ffi.typeof("CUdeviceptr *")   # parsed once: ffi.new of a string parses it per call
_new_buffer = object.__new__                     # DeviceBuffer has no __new__ of its own: skips a lookup
_weak = weakref.ref
_scratch = _fork.per_thread()                     # per thread: the out-parameter of the hot path's cuMemAllocAsync


#: A stream-ordered buffer's entry in its context's table (``Context.stream_ordered``):
#: ``(address, stream)``, what freeing its memory needs without the buffer -- the stream is the cuproc
#: Stream it came from, or a raw CUstream.  A plain tuple: the table is written on every
#: ``alloc_async`` and a tuple is the cheapest object Python makes.
StreamOrderedEntry = tuple


def free_stream_ordered_entry(context: Context, key: weakref.ref[DeviceBuffer], entry: StreamOrderedEntry) -> int:
    """cuMemFreeAsync of an entry's memory, by the holder of the claim (whoever removed ``key`` from
    ``context``'s table); ends the buffer as "freed" if it lives.  Returns the CUresult.  The free is
    ordered after the work cuproc last queued on the buffer on another stream (:func:`after_last_work`;
    should that fail, after everything in the context: the claim is taken, so the memory must go now).
    A context's teardown that finds the buffer already collected -- in a reference cycle the weak
    reference is cleared before the finalizer runs -- still gives the memory back to its pool, after
    waiting for the context (what was queued on it is not known any more)."""
    buffer = key()
    if buffer is not None and buffer.ended is None:
        buffer.ended = "freed"
    address, stream = entry
    drv = context.driver
    # Stream-ordered memory goes back with cuMemFreeAsync: cuMemFree "succeeds" on it, but the
    # pool keeps counting it as used and never releases it (measured on driver 580).
    if isinstance(stream, Stream) and stream.ended_owner() is not None:
        # Its stream is gone: wait for everything in the context, then free on the default stream.
        rc = synchronize_context(context)
        return rc or context.call_current(drv.cuMemFreeAsync, address, default_stream(drv))
    handle = stream.handle if isinstance(stream, Stream) else stream   # its stream, or a raw or default one
    try:
        if buffer is None:
            raise LookupError("the buffer was collected: what was last queued on it is not known")
        after_last_work(buffer, context, handle, stream if isinstance(stream, Stream) else None)
    except (CudaError, LookupError) as exc:
        rc = synchronize_context(context)
        if buffer is not None:                # (a collected buffer's wait is the rule, not a failure)
            report(f"ordering the free of {describe_stream_ordered_entry(entry)} after its last work failed "
                   f"({exc}); it waited for its context instead")
        if rc:
            return rc
    return context.call_on(handle, drv.cuMemFreeAsync, address, handle)


def after_last_work(buffer: DeviceBuffer, context: Context, stream: Any, waiter: Stream | None = None) -> None:
    """Order a stream-ordered free on ``stream`` (a CUstream of ``context``) after the work cuproc last
    queued on ``buffer`` on another stream (its ``last_stream``: an async copy or memset there, or a
    synchronous memset or device-to-device copy, which the default stream runs after the call returns).
    A failure raises, naming the call that failed.

    Why: the pool hands the memory out again -- or releases it at the next synchronization -- once the
    free is done on *its* stream, whatever still runs on others.  Measured on an H200 (driver 580,
    2026-11-29): a memset queued on one stream, the buffer freed stream-ordered on another, then a
    synchronize: the memset faulted (CUDA_ERROR_ILLEGAL_ADDRESS, sticky for the context).  So where the
    last work went elsewhere, an event recorded there -- in that stream's own context, which may be
    another (a peer copy) -- is waited for here (cuEventRecord, cuStreamWaitEvent: the free still costs
    no host wait).  Where that stream is gone, its context is synchronized; where it is a per-thread
    default stream (which one depends on the thread that queued the work, not known here), the buffer's
    context is.  Nothing is done when the last work went to ``stream`` itself (the common case).
    Kernel launches do not set ``last_stream`` (the launch cannot tell what a kernel uses): after a
    kernel that uses the buffer on another stream, set it, or free on that stream."""
    order_after(buffer.last_stream, context, stream, waiter, home=buffer.context)


def _legacy_and_blocking(drv: Driver, last: Any, last_handle: Any, owner: Context, stream: Any, context: Context,
                         waiter: Stream | None) -> bool:
    """Whether the driver itself orders ``stream`` (of ``context``) after ``last`` (of ``owner``): one of them
    the legacy default stream, the other a blocking cuproc Stream *of the same context* (the legacy stream and
    that context's blocking streams wait for each other; another context's are not ordered with it)."""
    if drv.per_thread_default_stream or owner is not context:
        return False
    legacy = handle_int(_LEGACY)
    if handle_int(last_handle) == legacy:
        return waiter is not None and waiter.blocking
    if handle_int(stream) == legacy or handle_int(stream) == 0:
        return isinstance(last, Stream) and last.blocking
    return False


def order_after(last: Stream | int | None, context: Context, stream: Any, waiter: Stream | None = None,
                home: Context | None = None) -> None:
    """Make ``stream`` (a CUstream of ``context``; ``waiter``, its cuproc Stream where there is one) wait for
    the work queued so far on ``last`` (a buffer's ``last_stream``: a Stream, a raw handle as an int, None
    for the default stream), as :func:`after_last_work` says; nothing when they are the same stream, or
    when the driver orders them itself (the legacy default stream and a blocking stream).  ``home``: the
    context of the buffer whose ``last_stream`` it is, whose default stream None names (its work on a
    default stream ran with it current); ``context`` when not given -- for a peer copy's source that
    would be the other buffer's.  Raises, naming the call."""
    drv = context.driver
    owner = home if home is not None else context      # the context the last stream belongs to
    if isinstance(last, Stream):
        owner = last.context
        if last.ended_owner() is not None:             # closed (its work still runs), or its context gone
            if owner.ended is None:
                drv.check(synchronize_context(owner), "cuCtxSynchronize")
            return
        last_handle = last.handle
    else:
        last_handle = default_stream(drv) if last is None else ffi.cast("CUstream", last)
        if last is not None and last > _PER_THREAD:     # a raw stream of its own: its context, as the driver says
            owner = foreign_context(last, None, drv)
    if handle_int(last_handle) == handle_int(stream):
        return
    if _legacy_and_blocking(drv, last, last_handle, owner, stream, context, waiter):
        return                                         # ordered by the driver already
    if handle_int(last_handle) == _PER_THREAD:
        drv.check(synchronize_context(context), "cuCtxSynchronize")
        return
    event = owner.call_current(_recorded_event, drv, last_handle)
    try:
        drv.check(context.call_on(stream, drv.cuStreamWaitEvent, stream, event, 0), "cuStreamWaitEvent")
    finally:
        rc = owner.call(drv.cuEventDestroy, event)   # the driver keeps it until the wait is done
        if rc:
            report(f"destroying the event that ordered work after {owner.describe()}'s stream failed: "
                   f"{drv.error(rc, 'cuEventDestroy')}")


def _recorded_event(drv: Driver, stream: Any) -> Any:
    """A new event recorded on ``stream`` (in the current context, which must be the stream's)."""
    out = ffi.new("CUevent *")
    drv.check(drv.cuEventCreate(out, _EVENT_DISABLE_TIMING), "cuEventCreate")
    rc = drv.cuEventRecord(out[0], stream)
    if rc:
        drv.cuEventDestroy(out[0])       # (its context is current here)
        raise drv.error(rc, "cuEventRecord")
    return out[0]


def describe_stream_ordered_entry(entry: StreamOrderedEntry) -> str:
    return f"stream-ordered memory at {entry[0]:#x}"


register_stream_ordered_memory(free_stream_ordered_entry, describe_stream_ordered_entry)


class DeviceBuffer(DeviceArrayExports, Allocation):
    """Linear device memory from cuMemAlloc (or cuMemAllocAsync, see :func:`alloc_async`).

    Exports ``__cuda_array_interface__`` (v3) and DLPack as a 1-D uint8 array;
    :meth:`view` gives a typed, shaped view of the same memory.  ``last_stream`` is the stream
    of the last stream-ordered work cuproc queued on it (a Stream, a handle as an int, or None
    for the default stream); set it after launching a kernel that writes it on another stream,
    so that consumers synchronize with that stream.
    """

    __slots__ = ("stream", "pool", "last_stream", "claim_key")
    stream: Stream | Any | None        # where a stream-ordered buffer is freed
    pool: MemoryPool | None
    last_stream: Stream | int | None   # the last stream-ordered work on it (None: the default stream)
    #: a stream-ordered buffer's key in its context's table (``Context.stream_ordered``): its own weak
    #: reference, which the buffer keeps so that its finalizer finds the entry even after a reference
    #: cycle's collection cleared the reference; None for cuMemAlloc memory.  Set by alloc_async, never
    #: to be assigned: without its key a buffer cannot claim its memory, which then waits for the context
    claim_key: weakref.ref[DeviceBuffer] | None
    typestr = "|u1"
    _release_call = "cuMemFree"

    def __init__(self, nbytes: int, *, context: Context | None = None, driver: Driver | None = None) -> None:
        # Once only, before any driver call: a second __init__ would overwrite the handle of the memory this
        # buffer owns, and nothing would free it.  (The compiled front hands any buffer that is not fresh here.)
        if hasattr(self, "driver"):
            raise invalid("cuMemAlloc", "DeviceBuffer.__init__ was called on a buffer that is already initialized; "
                                        "a second allocation would leak the first (make a new DeviceBuffer)")
        if nbytes.__class__ is not int or nbytes <= 0 or nbytes > _SIZE_MAX:
            raise invalid("cuMemAlloc", f"size must be a positive int that a size_t holds, got {nbytes!r}")
        out = ffi.new(_DEVICE_POINTER)
        if context is None:           # Context.target's common case, inline: the current context, as is
            ctx = Context.require_current("cuMemAlloc", driver=driver)
            drv = ctx.driver
            rc = drv.cuMemAlloc(out, nbytes)
        else:
            ctx, run = Context.target(context, "cuMemAlloc", driver=driver)
            drv = ctx.driver
            rc = run(drv.cuMemAlloc, out, nbytes)
        if rc:
            raise drv.error(rc, "cuMemAlloc")
        self.driver = drv
        self.ended = None
        self.context = ctx
        self.address = int(out[0])
        self.nbytes = nbytes
        self.stream = self.pool = self.last_stream = self.claim_key = None

    def _release(self) -> int:
        """close() and the finalizer: cuMemFree, or for stream-ordered memory the claim (removing this
        buffer's entry from its context's table), then cuMemFreeAsync by whoever holds it."""
        if self.stream is None:                              # cuMemAlloc
            rc = self.driver.cuMemFree(self.address)         # Context.call's first attempt, inline
            return self._free_again(rc) if rc else 0
        key = self.claim_key
        entry = self.context.untrack_stream_ordered(key)
        if entry is None:                                    # free_async or the teardown took it
            return 0
        try:
            return free_stream_ordered_entry(self.context, key, entry)
        except CudaError as exc:
            if pushing_failed(exc):   # cuMemFreeAsync never ran: the entry goes back, for the teardown to free
                self.context.stream_ordered[key] = entry
            raise

    def _free_again(self, rc: int) -> int:
        """The rest of cuMemFree of this memory once its first attempt answered ``rc``: the context's rebind
        (a binding error gets a second attempt with the context pushed); returns what is left."""
        return self.context.rebind(rc, self.driver.cuMemFree, self.address)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.nbytes,)

    def view(self, dtype: Any, shape: tuple[int, ...] | int | None = None) -> DeviceView:
        return DeviceView(self, dtype, shape)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.context.device.ordinal)

    def free_async(self, stream: Stream | Any | None = None) -> None:
        """cuMemFreeAsync: the memory returns to its pool once prior work on ``stream`` is done
        (default: the stream it was allocated on, else the default stream).  Idempotent.

        Freeing on the very Stream it came from -- ``free_async()`` or ``free_async(buf.stream)``, the form
        users write -- is the fast path (three reads, no walk of the parents; in C on the compiled path);
        any other stream gets the full checks of the buffer and of that stream."""
        if self.ended is not None:
            return
        own = self.stream
        if (stream is None or stream is own) and own.__class__ is Stream:
            # The common case -- freed on the Stream it came from -- without a walk of the parents: the
            # buffer's parent is its context, which alloc_async took from this stream, so these reads are
            # the whole check.
            ctx = own.context
            if own.ended is not None or ctx.ended is not None or FORKED[0]:
                self.check("cuMemFreeAsync")
                own.check("cuMemFreeAsync")
            h = own.handle
        else:
            self.check("cuMemFreeAsync")
            target = stream if stream is not None else (own if isinstance(own, Stream) else None)
            h = stream_handle(target, self.driver, "cuMemFreeAsync")
            ctx = target.context if isinstance(target, Stream) else self.context
        if id(self) in EXPORTS and self.has_views():  # the inline test first (a DeviceBuffer adds no views)
            raise BufferError(f"cuMemFreeAsync was not called: {self.describe()} still has views (a DLPack "
                              f"export); drop them first")
        target = stream if stream is not None else own
        if self.last_stream is not target:            # the last work cuproc queued on it may have gone elsewhere
            after_last_work(self, self.context, h, target if isinstance(target, Stream) else None)
        address = self.address
        entry = None
        if own is not None:
            # Stream-ordered: the claim is removing its entry from the context's table, as every way of
            # freeing it does first (Context.untrack_stream_ordered, inline).  Ended either way: without
            # the claim, whoever has it (close, the teardown, another free_async) frees the memory.
            entry = self.context.stream_ordered.pop(self.claim_key, None)
            self.ended = "freed"
            if entry is None:
                return
        elif not self._claim("freed"):
            return
        if own.__class__ is Stream and h is own.handle:   # a Stream's own handle is never a default stream
            rc = self.driver.cuMemFreeAsync(address, h)  # Context.call's first attempt, inline
            if rc:
                _free_failed(ctx, rc, address, h, self)
            return
        try:
            rc = ctx.call_on(h, self.driver.cuMemFreeAsync, address, h)   # (a default stream: the current one's)
        except CudaError as exc:
            if not pushing_failed(exc):
                raise
            # The context could not be made current, so cuMemFreeAsync never ran: the claim is given back,
            # and the buffer stays live for close(), the context's teardown or the finalizer to free -- else
            # its memory would be lost to a claim that freed nothing.  Only then: any other exception (an
            # interrupt in the pop, after the free) keeps the claim, as the driver may have freed it.
            if entry is not None:
                self.context.stream_ordered[self.claim_key] = entry
            self.ended = None
            raise
        if rc:
            _free_failed(ctx, rc, address, h, self, rebind=False)


# DLPack copies of every device allocation (interop.DeviceArrayExports: a DeviceBuffer, imported and mapped
# memory too, whose classes import this module), set here once: interop sits below this module
DeviceArrayExports.copy_class = DeviceBuffer


def alloc_async(nbytes: int, stream: Stream | Any | None = None, *, pool: MemoryPool | None = None,
                context: Context | None = None, driver: Driver | None = None) -> DeviceBuffer:
    """Stream-ordered allocation (cuMemAllocAsync / cuMemAllocFromPoolAsync) on ``stream``.

    The buffer holds the stream: ``free_async()`` (or dropping it) frees it there.
    The context is the stream's; for a raw or default stream, ``context`` or the current one.
    No driver query is made: the context comes from the stream (or the caller), and the call runs
    as is in it (:meth:`~cuproc.context.Context.call` binds it only when the driver says it must).
    """
    if nbytes.__class__ is not int or nbytes < 0:
        raise invalid("cuMemAllocAsync", f"size must be an int >= 0, got {nbytes!r}")
    if stream.__class__ is Stream and pool is None:   # the common case: a cuproc Stream names its context
        ctx = stream.context
        if stream.ended is not None or ctx.ended is not None or FORKED[0]:
            stream.check("cuMemAllocAsync")  # raises, naming what ended
        drv = ctx.driver
        h = stream.handle
        alloc = drv.cuMemAllocAsync
        try:
            out = _scratch.out
        except AttributeError:
            out = _scratch.out = ffi.new(_DEVICE_POINTER)
        rc = alloc(out, nbytes, h)           # Context.call's first attempt, inline
        if rc:                               # (Python runs before out is read: a fresh one, in case it reenters)
            out = ffi.new(_DEVICE_POINTER)
            rc = ctx.rebind(rc, alloc, out, nbytes, h)
        last: Stream | int | None = stream
    else:
        out = ffi.new(_DEVICE_POINTER)
        stream, ctx, h, last, run = _placement(stream, context, driver)
        drv = ctx.driver
        if pool is None:
            rc = run(drv.cuMemAllocAsync, out, nbytes, h)
        else:
            pool.check("cuMemAllocFromPoolAsync")
            rc = run(drv.cuMemAllocFromPoolAsync, out, nbytes, pool.handle, h)
    if rc:
        raise drv.error(rc, "cuMemAllocAsync" if pool is None else "cuMemAllocFromPoolAsync")
    # out[0] is read before any allocation (a collection could run Python)
    return _stream_ordered_buffer(drv, ctx, out[0], nbytes, stream, last, pool)


def _stream_ordered_buffer(drv: Driver, ctx: Context, address: int, nbytes: int, stream: Stream | Any,
                           last: Stream | int | None, pool: MemoryPool | None) -> DeviceBuffer:
    """The DeviceBuffer of fresh stream-ordered memory and its entry in the context's table (the C front
    of the fast path builds the same two objects, slot by slot)."""
    buf = _new_buffer(DeviceBuffer)
    buf.driver = drv
    buf.ended = None
    buf.context = ctx
    buf.address = address
    buf.nbytes = nbytes
    buf.stream = stream
    buf.last_stream = last
    buf.pool = pool
    buf.claim_key = key = _weak(buf)
    ctx.stream_ordered[key] = (address, stream)   # removing it: the claim
    return buf


def _placement(stream: Stream | Any | None, context: Context | None, driver: Driver | None
               ) -> tuple[Stream | Any, Context, Any, Stream | int | None, Callable[..., int]]:
    """Where a stream-ordered allocation on anything but a cuproc Stream goes: (what the buffer keeps
    to be freed on, the context, the CUstream, its ``last_stream``, how to call into the context)."""
    if stream is not None and not isinstance(stream, Stream):
        stream = as_stream(stream, "cuMemAllocAsync", context=context, driver=driver)   # another library's
    if isinstance(stream, Stream):
        stream.check("cuMemAllocAsync")
        return stream, stream.context, stream.handle, stream, stream.context.call   # it names its context
    if stream is not None:
        given = Context.given(context, "cuMemAllocAsync") if context is not None else None
        drv = given.driver if given is not None else get_driver(driver)
        h = stream_handle(stream, drv)
        if not is_default_stream(h):                   # a raw stream of its own: its context, as the driver says
            ctx = foreign_context(handle_int(h), None, drv)
            if given is not None and given is not ctx and handle_int(given.handle) != handle_int(ctx.handle):
                raise invalid("cuMemAllocAsync", f"the stream belongs to {ctx.describe()}, not to context= "
                                                 f"{given.describe()}: the memory would be that stream's context's; "
                                                 "pass that context, or a stream of the one you mean")
            ctx.check("cuMemAllocAsync")
            return h, ctx, h, handle_int(h), ctx.call    # (the driver routes the call by the stream)
    ctx, run = Context.target(context, "cuMemAllocAsync", driver=driver)   # the default stream: the current one's
    h = stream_handle(stream, ctx.driver) if stream is not None else default_stream(ctx.driver)
    return h, ctx, h, handle_int(h) or None, run      # last_stream None: the default (NULL) stream


def _free_failed(ctx: Context, rc: int, address: int, stream: Any, buffer: DeviceBuffer | None = None, *,
                 rebind: bool = True) -> None:
    """The rest of a stream-ordered free after its first attempt answered ``rc``: the context's rebind
    (a binding error gets the second attempt), then the exception for what the driver said -- with
    ``buffer`` (whose claim was taken) kept live when the refusal was a stream capture's."""
    drv = ctx.driver
    if rebind:
        rc = ctx.rebind(rc, drv.cuMemFreeAsync, address, stream)
    if rc:
        err = drv.error(rc, "cuMemFreeAsync")
        if buffer is not None:
            _kept_if_captured(buffer, stream, err)
        raise err


def _kept_if_captured(buffer: DeviceBuffer, stream: Any, err: CudaError) -> None:
    """cuMemFreeAsync of ``buffer`` on ``stream`` was refused.  While the stream is being captured the
    driver frees only graph allocations (the free becomes a free node): this pool memory was not freed, so
    its claim goes back (the buffer stays live, for a free after the capture) and ``err`` says so."""
    try:
        capturing = stream_capturing(buffer.driver, buffer.context, stream) != 0
    except CudaError as exc:     # the question failed (as a push may): ``err`` stays the error
        capturing = exc.code == _CAPTURE_INVALIDATED
    if not capturing:
        return
    if buffer.claim_key is not None:             # pool memory: its entry in the context's table goes back
        buffer.context.stream_ordered[buffer.claim_key] = (buffer.address, buffer.stream)
    buffer.ended = None                          # (cuMemAlloc memory: the claim was the mark alone)
    note = (f"{buffer.describe()} was allocated outside the stream capture running on its stream: during a "
            "capture cuMemFreeAsync frees only memory allocated in the capture (a graph's); it was not freed and "
            "stays usable: free it after the capture (after the graph's last launch that uses it)")
    add_note(err, note)


# With the fast path, ``alloc_async``, ``DeviceBuffer.free_async`` and ``DeviceBuffer.__del__`` are C
# fronts over the Python code (src/fastpath/fastpath_memory.c): alloc_async(n, stream) on a live cuproc Stream
# and buffer.free_async() of such a buffer make their driver call and build (or claim) the buffer and its
# entry in C, and the finalizer of an ended buffer returns at once; every other call runs the Python
# code unchanged.  The C hands a driver error to the two functions below.
def _c_alloc_failed(stream: Stream, nbytes: int, rc: int, address: int | None = None) -> DeviceBuffer | None:
    """alloc_async's first attempt answered ``rc``: the rebind and retry, else the exception.  With an
    ``address``: memory that no object could come to own (out of memory building it), given back."""
    ctx, h = stream.context, stream.handle
    drv = ctx.driver
    if address is not None:
        ctx.call(drv.cuMemFreeAsync, address, h)     # (a Stream's handle: never a default stream)
        return None
    out = ffi.new(_DEVICE_POINTER)
    rc = ctx.rebind(rc, drv.cuMemAllocAsync, out, nbytes, h)
    if rc:
        raise drv.error(rc, "cuMemAllocAsync")
    return _stream_ordered_buffer(drv, ctx, out[0], nbytes, stream, stream, None)


def _c_free_failed(buffer: DeviceBuffer, rc: int) -> None:
    """free_async's first attempt answered ``rc`` (the claim is taken, the buffer ended)."""
    _free_failed(buffer.stream.context, rc, buffer.address, buffer.stream.handle, buffer)


_python_alloc_async = alloc_async
_make_stream_ordered = fastpath.stream_ordered_factory()
if _make_stream_ordered is not None:
    _slots = (Resource.driver, Resource.ended, Allocation.context, Allocation.address, Allocation.nbytes,
              DeviceBuffer.stream, DeviceBuffer.pool, DeviceBuffer.last_stream, Context.stream_ordered,
              Stream.context, Stream.handle, DeviceBuffer.claim_key)
    _front_alloc, _front_free, _front_del = _make_stream_ordered(
        _python_alloc_async, _c_alloc_failed,
        fastpath.pointer_reader(fastpath.FRONT_TYPEDEFS["cuMemAllocAsync"]),
        DeviceBuffer.free_async, _c_free_failed,
        fastpath.pointer_reader(fastpath.FRONT_TYPEDEFS["cuMemFreeAsync"]), Resource.__del__,
        Stream, DeviceBuffer, Context, ffi.typeof("CUstream"), FORKED, EXPORTS, "freed", _slots)
    alloc_async = fastpath.dressed(_front_alloc, _python_alloc_async)  # type: ignore[assignment]
    DeviceBuffer.free_async = fastpath.dressed(  # type: ignore[method-assign]
        _front_free, DeviceBuffer.free_async)
    # A freed buffer's finalizer has nothing to do: the C front returns at once (Resource.__del__ otherwise),
    # and, as the class's tp_finalize, without the generic slot's lookup and call of __del__.
    DeviceBuffer.__del__ = fastpath.dressed(_front_del, Resource.__del__)  # type: ignore[method-assign]
    _front_del.take_finalizer()


# With the fast path, ``DeviceBuffer.__init__``, ``close`` and ``free`` are C fronts over the Python code
# (src/fastpath/fastpath_device_buffer.c): DeviceBuffer(n) in the current context (or ``context=`` the current one)
# asks cuCtxGetCurrent, finds the context's object (remembered weakly per handle), allocates and stores
# the slots in C; free()/close() of cuMemAlloc memory claim and free in C, and so does the class's
# finalizer for such a buffer dropped live; every other call runs the Python code unchanged.  The C hands
# these a driver error, or asks for the current context's object:
def _c_sync_alloc_failed(driver: Driver, rc: int, call: str) -> None:
    """``call`` (cuCtxGetCurrent or cuMemAlloc) answered ``rc``: the exception, as __init__ raises it."""
    raise driver.error(rc, call)


def _c_current_context(driver: Driver) -> Context:
    """The current context's object for ``DeviceBuffer(n)`` (refused, naming cuMemAlloc, when there is none)."""
    return Context.require_current("cuMemAlloc", driver=driver)


def _c_sync_free_failed(buffer: DeviceBuffer, rc: int) -> None:
    """cuMemFree's first attempt answered ``rc`` (the buffer is claimed): the rebind, else the exception."""
    rc = buffer._free_again(rc)
    if rc:
        raise buffer.driver.error(rc, "cuMemFree")


def _c_sync_drop_failed(buffer: DeviceBuffer, rc: int) -> None:
    """The finalizer's cuMemFree of a dropped live buffer answered ``rc`` (it is ended "dropped"): the
    rebind, else the warning every finalizer gives (Resource._end_drop: it never raises)."""
    buffer._end_drop(buffer._free_again, rc)


_make_device_buffer = fastpath.device_buffer_factory()
_fronts = None if _make_device_buffer is None else _make_device_buffer(
        DeviceBuffer.__init__, _c_sync_alloc_failed, _c_current_context, Allocation.close, Allocation.free,
        _c_sync_free_failed, _c_sync_drop_failed,
        tuple(fastpath.pointer_reader(fastpath.FRONT_TYPEDEFS[name]) for name in ("cuCtxGetCurrent", "cuMemAlloc",
                                                                                  "cuMemFree")),
        DeviceBuffer, Context, Resource, ffi.typeof("CUcontext"), FORKED, EXPORTS, "freed", DEFAULT_HANDLE,
        DEFER_DROP,   # (while set, a drop is Resource.__del__'s: a running stream capture may keep the buffer)
        (Resource.driver, Resource.ended, Allocation.context, Allocation.address, Allocation.nbytes,
         DeviceBuffer.stream, DeviceBuffer.pool, DeviceBuffer.last_stream, DeviceBuffer.claim_key, Context.handle))
if _fronts is not None:   # (None on a free-threaded build: the fronts' claims need the GIL)
    _front_init, _front_close, _front_free = _fronts
    DeviceBuffer.__init__ = fastpath.dressed(_front_init, DeviceBuffer.__init__)  # type: ignore[method-assign]
    DeviceBuffer.close = fastpath.dressed(_front_close, Allocation.close)  # type: ignore[method-assign]
    DeviceBuffer.free = fastpath.dressed(_front_free, Allocation.free)  # type: ignore[method-assign]


class DeviceView(DeviceArrayExports):
    """A typed, shaped, C-contiguous view of a DeviceBuffer (holds the buffer)."""

    def __init__(self, buffer: DeviceBuffer, dtype: Any, shape: tuple[int, ...] | int | None) -> None:
        typestr, itemsize = typestr_of(dtype)
        if shape is None:
            shape = (buffer.nbytes // itemsize,)
        elif isinstance(shape, int):
            shape = (shape,)
        count = 1
        for dim in shape:
            count *= dim
        if count * itemsize > buffer.nbytes:
            raise invalid("view", f"shape {shape} of {typestr} needs {count * itemsize} bytes; "
                                  f"the buffer has {buffer.nbytes}")
        self.buffer, self.shape, self.typestr, self.nbytes = buffer, tuple(shape), typestr, count * itemsize

    @property
    def allocation(self) -> DeviceBuffer:
        return self.buffer

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    @property
    def context(self) -> Context:
        return self.buffer.context

    def check(self, call: str) -> None:
        self.buffer.check(call)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.buffer.__dlpack_device__()


class GlobalView:
    """A ``__device__`` variable: memory its module or library holds (never freed here).

    Holds ``owner`` (the Module or Library) and the context the address belongs to.
    """

    def __init__(self, address: int, nbytes: int, owner: Resource, context: Context | None) -> None:
        self.address, self.nbytes, self.owner, self.context = address, nbytes, owner, context

    def check(self, call: str) -> None:
        self.owner.check(call)
        if self.context is not None:
            self.context.check(call)

    @property
    def ptr(self) -> int:
        self.check("GlobalView.ptr")
        return self.address

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Its stream is the default stream's marker: cuproc does not track work on module globals."""
        return cai(self.ptr, (self.nbytes,), "|u1", default_marker(self.owner.driver))

    def __repr__(self) -> str:
        return f"<cuproc.GlobalView {self.nbytes} bytes at {self.address:#x}>"


__all__ = ["DeviceBuffer", "DeviceView", "GlobalView", "alloc_async"]
