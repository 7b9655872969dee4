"""Copies and fills between host and device memory (cuMemcpy*, cuMemset*).

Policy
------
* Host sides take any buffer-protocol object without an intermediate copy
  (``ffi.from_buffer``); device sides are cuproc memory,
  ``__cuda_array_interface__`` exporters or int addresses.
* Sizes and bounds are checked before the driver sees anything; such a
  refusal says the call was not made.
* A CUDA array on either side of :func:`copy` (host, device or array to
  array) is copied whole by :mod:`cuproc.arrays` (cuMemcpy2D / cuMemcpy3D),
  after checking that the other side matches its shape and element type.
* Streams (:mod:`cuproc.interop`): each call records its stream as the
  ``last_stream`` of the cuproc memory it touches -- device, pinned,
  registered or managed (None, the default stream, for synchronous calls and
  the NULL stream) -- so that exports tell consumers what to wait for.  A ``__cuda_array_interface__`` side is read per its spec: a mask
  is refused, a read-only array is refused as a destination, and the call
  waits for the exporter's stream (an event on ``stream``, else a host wait).
  Another library's stream object is taken as ``stream``.
* Every call runs bound to the context that owns the memory (or the stream's,
  for stream-ordered work): from any thread, with no setup.  A synchronous
  call, or one on a default stream, runs in whichever context is current, so
  it is made with that context current (:meth:`cuproc.context.Context.call_current`;
  for raw, CAI and DLPack memory, the context the driver records for it); one
  on a stream of its own goes as is (:meth:`cuproc.context.Context.call_on`).  A freed buffer, or one whose context
  ended, is refused before its address reaches the driver.
"""
from __future__ import annotations

import sys
from typing import Any, Protocol

from . import fastpath
from ._ffi import ffi
from ._resource import EPOCH, FORKED, Resource
from ._support import get_driver, handle_int, invalid
from .allocation import Allocation
from .context import Context
from .device_memory import DeviceBuffer, DeviceView, GlobalView, order_after
from .driver import Driver
from .fill_args import check_element_bits, fill_count
from .host_memory import HostMemory, PinnedBuffer
from .interop import LEGACY_STREAM, PER_THREAD_STREAM, DLPackArray, read_cai, wait_for_cai
from .stream import Stream, as_stream, stream_handle


_ARRAYS_MODULE = __name__.rpartition(".")[0] + ".arrays"    # cuproc.arrays, under whatever name cuproc has


def _arrays_of(dst: Any, src: Any) -> Any:
    """cuproc.arrays, where ``dst`` or ``src`` is one of its arrays (what memory.copy gives to it: a mipmapped one
    is refused there); else None.  The module is not imported for a copy: no array exists before it was (it
    costs memory's import a few ms, and most programs make no array).  Its COPY_KINDS, set by its last line, is
    what is read: a module another thread is still importing does not have it yet (and has no array yet)."""
    kinds = getattr(sys.modules.get(_ARRAYS_MODULE), "COPY_KINDS", None)
    if kinds is None or not (isinstance(dst, kinds) or isinstance(src, kinds)):
        return None
    return sys.modules[_ARRAYS_MODULE]


class _Side:
    """One side of a copy: where it is, its address, its size when known, its context when known."""

    __slots__ = ("kind", "ptr", "nbytes", "keep", "context", "wait", "buffer", "home", "recorded")

    def __init__(self, kind: str, ptr: int, nbytes: int | None, keep: Any, context: Context | None,
                 wait: int | None = None, buffer: DeviceBuffer | HostMemory | None = None,
                 home: Context | None = None) -> None:
        self.kind, self.ptr, self.nbytes, self.keep, self.context = kind, ptr, nbytes, keep, context
        self.wait = wait      # a CAI exporter's stream, to wait for before the call
        self.buffer = buffer  # the DeviceBuffer or HostMemory whose last_stream the call sets
        self.home = home      # the context whose default stream ``wait`` (1, 2) names, when the importer knows it
        self.recorded: Any = _UNASKED   # the driver's record of the memory's context, asked once (_recorded)


_UNASKED = object()


def _recorded(side: _Side, driver: Driver | None) -> Context | None:
    """The context the driver records for ``side``'s device memory (:func:`_recorded_context`), asked once per
    side: a copy asked it up to three times (binding, the peer test, the exporter's stream)."""
    if side.recorded is _UNASKED:
        side.recorded = _recorded_context(side.ptr, driver)
    return side.recorded


def _side(obj: Any, call: str, *, writable: bool) -> _Side:
    if isinstance(obj, Allocation):
        obj.check(call)
        if writable and obj.read_only:
            raise _read_only(obj, call)
        kind = "host" if obj.kind == "host" else "device"
        return _Side(kind, obj.address, obj.nbytes, obj, obj.context, None, _tracked(obj))
    if isinstance(obj, (DeviceView, GlobalView)):
        obj.check(call)
        return _Side("device", obj.ptr, obj.nbytes, obj, obj.context, None,
                     obj.buffer if obj.__class__ is DeviceView else None)
    if isinstance(obj, int) and not isinstance(obj, bool):
        return _Side("device", obj, None, None, None)
    if hasattr(obj, "__cuda_array_interface__"):
        ptr, size, stream = read_cai(obj, call, writable=writable)
        # a DLPack import's default-stream marker names the default stream of the context current at the import
        home = obj.stream_context if obj.__class__ is DLPackArray else None
        return _Side("device", ptr, size, obj, None, stream, None, home)
    try:
        cbuf = ffi.from_buffer(obj, require_writable=writable)
    except (TypeError, BufferError, ValueError) as exc:
        need = "a writable, C-contiguous" if writable else "a C-contiguous"
        raise invalid(call, f"the host side needs {need} buffer-protocol object "
                            f"({type(obj).__name__}: {exc})") from None
    return _Side("host", handle_int(cbuf), len(cbuf), cbuf, None)


def _read_only(obj: Allocation, call: str) -> Exception:
    """The refusal of memory registered read-only as what a call would write (the driver would write it)."""
    return invalid(call, f"{obj.describe()} was registered read-only (read_only=True): it cannot be written; "
                         f"copy into writable memory")


def _tracked(obj: Allocation) -> DeviceBuffer | HostMemory | None:
    """The allocation whose ``last_stream`` a transfer sets: a plain DeviceBuffer or host memory."""
    if obj.__class__ is DeviceBuffer and isinstance(obj, DeviceBuffer) or isinstance(obj, HostMemory):
        return obj        # (the isinstance narrows the type for checkers; the class test decides)
    return None


class _Placed(Protocol):
    """What :func:`_checked_size` and :func:`_binding` read of a side: a :class:`_Side`, or an
    allocation itself (whose kind "managed" counts as device memory, as :func:`_side` maps it)."""

    @property
    def nbytes(self) -> int | None: ...
    @property
    def kind(self) -> str: ...
    @property
    def context(self) -> Context | None: ...


def _checked_size(call: str, nbytes: int | None, *sides: _Placed) -> int:
    known = [s.nbytes for s in sides if s.nbytes is not None]
    if nbytes is None:
        if not known:
            raise invalid(call, "nbytes is needed when neither side's size is known (raw pointers)")
        nbytes = min(known)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise invalid(call, f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise invalid(call, f"nbytes must be >= 0, got {nbytes}")
    for side, label in zip(sides, ("destination", "source")):
        if side.nbytes is not None and nbytes > side.nbytes:
            raise invalid(call, f"copying {nbytes} bytes overruns the {label} ({side.nbytes} bytes)")
    return nbytes


def _binding(stream: Any, *sides: _Placed, driver: Driver | None = None) -> Context | None:
    """The context a transfer runs in: the stream's, else the first device side's that cuproc knows, else
    (raw addresses, CAI and DLPack sides) the context the driver records for a device side's memory.  Why
    the last: a synchronous copy or memset runs in whichever context is current, on its default stream,
    unordered with the memory's own context (measured on driver 580); stream-ordered pool memory has no
    context (cuPointerGetAttribute answers NULL), and then the call runs as is."""
    if isinstance(stream, Stream):
        return stream.context
    for side in sides:
        if side.kind != "host" and side.context is not None:
            return side.context
    for side in sides:               # device memory before host memory: the copy's ordering is the device's
        if side.kind != "host":
            found = _recorded(side, driver)
            if found is not None:
                return found
    for side in sides:
        if side.context is not None:
            return side.context
    return None


def _recorded_context(address: int, driver: Driver | None) -> Context | None:
    """The Context object of the context the driver records for device memory at ``address``
    (CU_POINTER_ATTRIBUTE_CONTEXT), or None: no context (pool memory), or not device memory it knows."""
    drv = get_driver(driver)
    out = ffi.new("CUcontext *")
    if drv.cuPointerGetAttribute(out, drv.CU_POINTER_ATTRIBUTE_CONTEXT, address) or out[0] == ffi.NULL:
        return None
    return Context.adopt(out[0], driver=drv)


def _is_device_memory(address: int, driver: Driver | None) -> bool:
    """CU_POINTER_ATTRIBUTE_MEMORY_TYPE is CU_MEMORYTYPE_DEVICE: a raw address that is host memory of a
    context (pinned) is copied as is, not by cuMemcpyPeer, which is for device memory."""
    drv = get_driver(driver)
    out = ffi.new("unsigned int *")
    return drv.cuPointerGetAttribute(out, drv.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address) == 0 and \
        out[0] == drv.CU_MEMORYTYPE_DEVICE


def _peer_contexts(d: _Placed, s: _Placed) -> tuple[Context, Context] | None:
    """The two contexts of two device sides in different contexts cuproc knows (a peer copy,
    cuMemcpyPeer), else None."""
    dc, sc = d.context, s.context
    return (dc, sc) if dc is not None and sc is not None and dc is not sc else None


def _device_contexts(d: _Side, s: _Side, driver: Driver | None) -> tuple[Context, Context] | None:
    """:func:`_peer_contexts` for a device-to-device copy with a raw, CAI or DLPack side: its context is
    the one the driver records for its memory.  cuMemcpyDtoD between two contexts' memory runs in the
    current one, on its default stream, unordered with the other's work: cuMemcpyPeer is the call."""
    found = _peer_contexts(d, s)
    if found is not None or (d.context is not None and s.context is not None):
        return found
    dc = d.context if d.context is not None else _recorded(d, driver)
    sc = s.context if s.context is not None else _recorded(s, driver)
    if dc is None or sc is None or handle_int(dc.handle) == handle_int(sc.handle):
        return None
    for side, known in ((d, d.context), (s, s.context)):   # a raw address of pinned memory is no peer's
        if known is None and not _is_device_memory(side.ptr, driver):
            return None
    return dc, sc


def _both_host() -> Exception:
    """memory.copy's refusal of host memory on both sides (the general and the lean path)."""
    return invalid("cuMemcpy", "both sides are host memory: use memoryview slicing or numpy.copyto")


def _run(ctx: Context | None, driver: Driver | None, call: str, *args: Any, on: Any = None) -> None:
    """``call(*args)`` in ``ctx``: a synchronous copy or memset, or an asynchronous one on a default stream,
    runs in whichever context is current (on its default stream, unordered with ``ctx``'s work), so it is
    made with ``ctx`` current; one on a stream of its own goes where that stream is (Context.call_on).  ``on``:
    an asynchronous call's stream as given (a Stream is never a default stream: no test of its handle).
    With no context known (pool memory at a raw address), as is."""
    drv = ctx.driver if ctx is not None else get_driver(driver)
    fn = getattr(drv, call)
    if ctx is None:
        rc = fn(*args)
    elif not call.endswith("Async"):
        rc = ctx.call_current(fn, *args)
    elif on.__class__ is Stream:
        rc = ctx.call(fn, *args)
    else:
        rc = ctx.call_on(args[-1], fn, *args)
    if rc:
        raise drv.error(rc, call)


def _stream_arg(stream: Any, ctx: Context | None, driver: Driver | None, call: str) -> Any:
    drv = ctx.driver if ctx is not None else get_driver(driver)
    return stream_handle(stream, drv, call)


def _begin(stream: Any, driver: Driver | None, call: str, d: _Side,
           s: _Side | None = None) -> tuple[Any, Context | None, Any]:
    """Before a call: another library's stream object becomes a not-owned Stream (kept alive while a
    buffer records it), CAI exporters' streams are waited for.  Returns (stream, the context to run
    in, what the buffers' ``last_stream`` becomes: the Stream, a raw handle as an int, None for the
    default stream -- the NULL handle included, so that no export ever names stream 0)."""
    if stream is not None and not isinstance(stream, Stream):
        stream = as_stream(stream, call, driver=driver)
    ctx = _binding(stream, d, driver=driver) if s is None else _binding(stream, d, s, driver=driver)
    if d.wait is not None or (s is not None and s.wait is not None):
        drv = ctx.driver if ctx is not None else get_driver(driver)
        for side in (d, s):
            if side is not None and side.wait is not None:
                # a default-stream marker names the exporter's context's default stream
                exporter = (side.home or _recorded(side, drv)) if side.wait in (LEGACY_STREAM, PER_THREAD_STREAM) \
                    else None
                wait_for_cai(side.wait, stream, ctx, drv, exporter)
    last = stream if stream is None or isinstance(stream, Stream) else \
        handle_int(_stream_arg(stream, ctx, driver, call)) or None   # NULL: the default stream
    _order_sides(last, ctx, stream, driver, call, d, s)
    return stream, ctx, last


def _order_sides(last: Any, ctx: Context | None, stream: Any, driver: Driver | None, call: str,
                 *sides: _Side | None) -> None:
    """The call about to go on ``stream`` waits for the work cuproc queued last on each buffer it touches on
    another stream (:func:`~cuproc.device_memory.order_after`).  So the work on one buffer is one chain, and
    its ``last_stream`` -- the end of the chain -- is all a stream-ordered free must wait for: otherwise a
    memset on stream A, a copy on stream B, then a free ordered after B alone left A's memset running
    while the pool took the memory back (a device fault on a GPU).  Nothing when the stream stays the same."""
    if ctx is None:
        return
    handle = None
    for side in sides:
        buffer = side.buffer if side is not None else None
        if buffer is not None and buffer.last_stream is not last:
            if handle is None:
                handle = _stream_arg(stream, ctx, driver, call)
            order_after(buffer.last_stream, ctx, handle, stream if isinstance(stream, Stream) else None,
                        home=buffer.context)


def _end(last: Any, d: _Side, s: _Side | None = None) -> None:
    """After the call: the cuproc device memory it touched remembers the stream (one store per side)."""
    if d.buffer is not None:
        d.buffer.last_stream = last
    if s is not None and s.buffer is not None:
        s.buffer.last_stream = last


def copy(dst: Any, src: Any, nbytes: int | None = None, *, stream: Stream | Any | None = None,
         driver: Driver | None = None) -> None:
    """Copy between host and device memory in any direction; ``stream`` makes it asynchronous.

    ``nbytes`` defaults to the smaller side.  Device-to-device copies between
    two contexts go through cuMemcpyPeer.  A :class:`~cuproc.arrays.CudaArray`
    on either side copies the whole array, host, device or array to array,
    with cuMemcpy2D / cuMemcpy3D in the array's context, after checking that
    the other side matches it (:func:`cuproc.arrays.copy_whole`; ``driver`` is
    the array's own).
    """
    if stream is None and driver is None and isinstance(dst, Allocation) and isinstance(src, Allocation) \
            and _copied_between_allocations(dst, src, nbytes):
        return
    arrays = _arrays_of(dst, src)
    if arrays is not None:
        arrays.copy_whole(dst, src, nbytes, stream=stream)
        return
    d, s = _side(dst, "cuMemcpy", writable=True), _side(src, "cuMemcpy", writable=False)
    n = _checked_size("cuMemcpy", nbytes, d, s)
    stream, ctx, last = _begin(stream, driver, "cuMemcpyAsync", d, s)
    asynchronous = stream is not None
    tail = (_stream_arg(stream, ctx, driver, "cuMemcpyAsync"),) if asynchronous else ()
    suffix = "Async" if asynchronous else ""
    if d.kind == "device" and s.kind == "host":
        _run(ctx, driver, "cuMemcpyHtoD" + suffix, d.ptr, ffi.cast("void *", s.ptr), n, *tail, on=stream)
    elif d.kind == "host" and s.kind == "device":
        _run(ctx, driver, "cuMemcpyDtoH" + suffix, ffi.cast("void *", d.ptr), s.ptr, n, *tail, on=stream)
    elif d.kind == "device" and s.kind == "device":
        peer = _device_contexts(d, s, driver)
        if peer is not None:
            dc, sc = peer
            # synchronous: the driver still wants a current context (CUDA_ERROR_INVALID_CONTEXT with none,
            # measured on driver 580): the destination's
            _run(ctx if asynchronous else dc, dc.driver, "cuMemcpyPeer" + suffix, d.ptr, dc.handle,
                 s.ptr, sc.handle, n, *tail, on=stream)
            # (cuMemcpyPeer is serialized with all pending and future asynchronous work of the current, the
            # source and the destination context, per the driver API's documentation: the source's
            # last_stream, None, stays right for its own context.)
        else:
            _run(ctx, driver, "cuMemcpyDtoD" + suffix, d.ptr, s.ptr, n, *tail, on=stream)
    else:
        raise _both_host()
    _end(last, d, s)


def _copied_between_allocations(dst: Allocation, src: Allocation, nbytes: int | None) -> bool:
    """:func:`copy`'s most common case, cuproc memory on both sides and no stream, made with the
    general path's checks, context and calls but without its :class:`_Side` records and stream
    handling: those cost about 6 us of Python per call on an H100 (2026-11-24), which showed in the
    64 MiB copy goal (issue 9).  False, having done nothing after the checks, for two device sides
    in different contexts (the general path's cuMemcpyPeer).  (On the fast path a C front takes the
    commonest case before this function: see the end of the module.)"""
    dst.check("cuMemcpy")
    src.check("cuMemcpy")
    if dst.read_only:
        raise _read_only(dst, "cuMemcpy")
    # Both sizes are known, so the smaller one needs no check; a given size gets the general check.
    n = min(dst.nbytes, src.nbytes) if nbytes is None else _checked_size("cuMemcpy", nbytes, dst, src)
    plan = _direct_call(dst, src, n)
    if plan is None:
        return False
    ctx = _binding(None, dst, src)
    for side in (dst, src):                      # the default stream waits for work left on others
        buffer = _tracked(side)
        if buffer is not None and buffer.last_stream is not None and ctx is not None:
            order_after(buffer.last_stream, ctx, _stream_arg(None, ctx, None, plan[0]), home=buffer.context)
    _run(ctx, None, *plan)
    _synchronous_done(dst, src)
    return True


def _direct_call(dst: Allocation, src: Allocation, n: int) -> tuple[Any, ...] | None:
    """The driver call (its C name, then its arguments) that copies ``n`` bytes between two allocations
    in one context, or None for two device sides in different contexts (cuMemcpyPeer, the general path)."""
    to_device, from_device = dst.kind != "host", src.kind != "host"
    if to_device and from_device:
        if _peer_contexts(dst, src) is not None:
            return None
        return "cuMemcpyDtoD", dst.address, src.address, n
    if to_device:
        return "cuMemcpyHtoD", dst.address, ffi.cast("void *", src.address), n
    if from_device:
        return "cuMemcpyDtoH", ffi.cast("void *", dst.address), src.address, n
    raise _both_host()


def _synchronous_done(dst: Allocation, src: Allocation) -> None:
    """As :func:`_end`: a synchronous call leaves nothing pending on either side."""
    for side in (dst, src):
        buffer = _tracked(side)
        if buffer is not None:
            buffer.last_stream = None


def copy_2d(dst: Any, dst_pitch: int, src: Any, src_pitch: int, width_bytes: int, height: int, *,
            stream: Stream | Any | None = None, driver: Driver | None = None) -> None:
    """A pitched 2-D copy (cuMemcpy2D / cuMemcpy2DAsync) between host and device in any direction."""
    d, s = _side(dst, "cuMemcpy2D", writable=True), _side(src, "cuMemcpy2D", writable=False)
    if min(dst_pitch, src_pitch, width_bytes, height) < 0 or width_bytes > min(dst_pitch, src_pitch):
        raise invalid("cuMemcpy2D", "pitches, width and height must be >= 0 and width <= each pitch")
    for side, pitch, label in ((d, dst_pitch, "destination"), (s, src_pitch, "source")):
        needed = pitch * (height - 1) + width_bytes if height else 0
        if side.nbytes is not None and needed > side.nbytes:
            raise invalid("cuMemcpy2D", f"the {label} needs {needed} bytes for this copy; it has {side.nbytes}")
    stream, ctx, last = _begin(stream, driver, "cuMemcpy2DAsync", d, s)
    drv = ctx.driver if ctx is not None else get_driver(driver)
    p = ffi.new("CUDA_MEMCPY2D *")
    for prefix, side, pitch in (("src", s, src_pitch), ("dst", d, dst_pitch)):
        _place(drv, p, prefix, side)
        setattr(p, prefix + "Pitch", pitch)
    p.WidthInBytes, p.Height = width_bytes, height
    if stream is None:
        _run(ctx, driver, "cuMemcpy2D", p)
    else:
        _run(ctx, driver, "cuMemcpy2DAsync", p, _stream_arg(stream, ctx, driver, "cuMemcpy2DAsync"), on=stream)
    _end(last, d, s)


def copy_3d(dst: Any, dst_pitch: int, dst_height: int, src: Any, src_pitch: int, src_height: int,
            width_bytes: int, height: int, depth: int, *, stream: Stream | Any | None = None,
            driver: Driver | None = None) -> None:
    """A pitched 3-D copy of linear memory (cuMemcpy3D / cuMemcpy3DAsync)."""
    d, s = _side(dst, "cuMemcpy3D", writable=True), _side(src, "cuMemcpy3D", writable=False)
    if min(dst_pitch, src_pitch, dst_height, src_height, width_bytes, height, depth) < 0 or \
            width_bytes > min(dst_pitch, src_pitch) or height > min(dst_height, src_height):
        raise invalid("cuMemcpy3D", "sizes must be >= 0, width <= each pitch and height <= each slice height")
    for side, pitch, slice_h, label in ((d, dst_pitch, dst_height, "destination"),
                                        (s, src_pitch, src_height, "source")):
        needed = (pitch * slice_h * (depth - 1) + pitch * (height - 1) + width_bytes) if depth and height else 0
        if side.nbytes is not None and needed > side.nbytes:
            raise invalid("cuMemcpy3D", f"the {label} needs {needed} bytes for this copy; it has {side.nbytes}")
    stream, ctx, last = _begin(stream, driver, "cuMemcpy3DAsync", d, s)
    drv = ctx.driver if ctx is not None else get_driver(driver)
    p = ffi.new("CUDA_MEMCPY3D *")
    for prefix, side, pitch, slice_h in (("src", s, src_pitch, src_height), ("dst", d, dst_pitch, dst_height)):
        _place(drv, p, prefix, side)
        setattr(p, prefix + "Pitch", pitch)
        setattr(p, prefix + "Height", slice_h)
    p.WidthInBytes, p.Height, p.Depth = width_bytes, height, depth
    if stream is None:
        _run(ctx, driver, "cuMemcpy3D", p)
    else:
        _run(ctx, driver, "cuMemcpy3DAsync", p, _stream_arg(stream, ctx, driver, "cuMemcpy3DAsync"), on=stream)
    _end(last, d, s)


def _place(drv: Driver, p: Any, prefix: str, side: _Side) -> None:
    if side.kind == "host":
        setattr(p, prefix + "MemoryType", drv.CU_MEMORYTYPE_HOST)
        setattr(p, prefix + "Host", ffi.cast("void *", side.ptr))
    else:
        setattr(p, prefix + "MemoryType", drv.CU_MEMORYTYPE_DEVICE)
        setattr(p, prefix + "Device", side.ptr)


def memset(dst: Any, value: int, count: int | None = None, *, element_bits: int = 8,
           stream: Stream | Any | None = None, driver: Driver | None = None) -> None:
    """Fill ``count`` elements of 8, 16 or 32 bits (cuMemsetD8/D16/D32, Async with a stream)."""
    check_element_bits(element_bits, "cuMemsetD8")
    call = f"cuMemsetD{element_bits}"
    d = _side(dst, call, writable=True)
    if d.kind != "device":
        raise invalid(call, "memset fills device memory; the destination is host memory")
    count = fill_count(call, d.ptr, d.nbytes, value, count, element_bits, minimum=0)   # (cuproc.fill_args)
    stream, ctx, last = _begin(stream, driver, call + "Async", d)
    if stream is None:
        _run(ctx, driver, call, d.ptr, value, count)
    else:
        _run(ctx, driver, call + "Async", d.ptr, value, count, _stream_arg(stream, ctx, driver, call + "Async"),
             on=stream)
    _end(last, d)


def memset_2d(dst: Any, pitch: int, value: int, width: int, height: int, *, element_bits: int = 8,
              stream: Stream | Any | None = None, driver: Driver | None = None) -> None:
    """Fill a pitched 2-D region: ``width`` elements per row, ``height`` rows (cuMemsetD2D8/16/32)."""
    call = f"cuMemsetD2D{element_bits}"
    if element_bits not in (8, 16, 32):
        raise invalid(call, f"element_bits must be 8, 16 or 32, got {element_bits}")
    d = _side(dst, call, writable=True)
    size = element_bits // 8
    if min(pitch, width, height) < 0 or width * size > pitch:
        raise invalid(call, "pitch, width and height must be >= 0 and a row must fit the pitch")
    needed = pitch * (height - 1) + width * size if height else 0
    if d.nbytes is not None and needed > d.nbytes:
        raise invalid(call, f"the region needs {needed} bytes; the destination has {d.nbytes}")
    stream, ctx, last = _begin(stream, driver, call + "Async", d)
    if stream is None:
        _run(ctx, driver, call, d.ptr, pitch, value, width, height)
    else:
        _run(ctx, driver, call + "Async", d.ptr, pitch, value, width, height,
             _stream_arg(stream, ctx, driver, call + "Async"), on=stream)
    _end(last, d)


__all__ = ["copy", "copy_2d", "copy_3d", "memset", "memset_2d"]


def _c_copy_failed(rc: int, dst: Allocation, src: Allocation, n: int) -> None:
    """The C front's driver call (below; made only with the device side's context current) answered ``rc``
    (never 0): the exception naming the call, as :func:`_run` raises it."""
    ctx = _binding(None, dst, src)
    plan = _direct_call(dst, src, n)
    assert ctx is not None and plan is not None   # (the front takes a device buffer and host memory only)
    call, *_ = plan
    # No second attempt: the front made the call with the context current, so a binding answer is not
    # cuproc's to fix (another thread destroyed the context mid-call, say), and a retry would copy again
    # where the Python code (_run) raises: the same call, the same outcome on both paths.
    raise ctx.driver.error(rc, call)


# The compiled fast path's front over copy (src/fastpath/fastpath_copy.c): a DeviceBuffer and pinned host memory,
# either way, no stream, checked since the last resource ended -- the call and the stores in C, everything
# else to the Python function above.  Why: the Python layers' reach after a copy of tens of megabytes, which
# leaves the CPU's caches cold (issue 9; the C file's comment has the numbers).  Registered host memory is
# not among its classes: a registration may be read-only, which the front cannot see (it reads no such
# flag), so its copies take the Python code, which refuses one as a destination (a few microseconds more
# per copy).
_make_copy = fastpath.copy_factory()
_c_copy = None if _make_copy is None else _make_copy(
        copy, _c_copy_failed, Context, ffi.typeof("CUcontext"), FORKED, EPOCH,
        tuple(fastpath.pointer_reader(fastpath.FRONT_TYPEDEFS[name])
              for name in ("cuMemcpyHtoD", "cuMemcpyDtoH", "cuCtxGetCurrent")),
        tuple((cls, cls.kind == "host", owner.__dict__["last_stream"])    # (the slots' member descriptors)
              for cls, owner in ((DeviceBuffer, DeviceBuffer), (PinnedBuffer, HostMemory))),
        (Resource.__dict__["driver"], Resource.__dict__["ended"], Resource.__dict__["_checked_at"],
         Allocation.__dict__["context"], Allocation.__dict__["address"], Allocation.__dict__["nbytes"],
         Context.__dict__["handle"]))
if _c_copy is not None:   # (None on a free-threaded build)
    copy = fastpath.dressed(_c_copy, copy)
