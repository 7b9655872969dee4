"""Copies and fills between host and device memory (cuMemcpy*, cuMemset*).

Policy
------
* Host sides take any buffer-protocol object without an intermediate copy
  (``ffi.from_buffer``); device sides are cuproc memory,
  ``__cuda_array_interface__`` exporters or int addresses.
* Sizes and bounds are checked before the driver sees anything; such a
  refusal says the call was not made.
* Every call runs bound to the context that owns the memory (or the stream's,
  for stream-ordered work): from any thread, with no setup
  (:meth:`cuproc.context.Context.call`).  A freed buffer, or one whose context
  ended, is refused before its address reaches the driver.
"""
from __future__ import annotations

from typing import Any

from ._ffi import ffi
from ._support import get_driver, handle_int, invalid
from .allocation import Allocation
from .context import Context, call_in
from .device_memory import DeviceView, GlobalView
from .driver import Driver
from .interop import typestr_of
from .stream import Stream, stream_handle


class _Side:
    """One side of a copy: where it is, its address, its size when known, its context when known."""

    __slots__ = ("kind", "ptr", "nbytes", "keep", "context")

    def __init__(self, kind: str, ptr: int, nbytes: int | None, keep: Any, context: Context | None) -> None:
        self.kind, self.ptr, self.nbytes, self.keep, self.context = kind, ptr, nbytes, keep, context


def _side(obj: Any, call: str, *, writable: bool) -> _Side:
    if isinstance(obj, Allocation):
        obj.check(call)
        kind = "host" if obj.kind == "host" else "device"
        return _Side(kind, obj.address, obj.nbytes, obj, obj.context)
    if isinstance(obj, (DeviceView, GlobalView)):
        obj.check(call)
        return _Side("device", obj.ptr, obj.nbytes, obj, obj.context)
    if isinstance(obj, int) and not isinstance(obj, bool):
        return _Side("device", obj, None, None, None)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("strides") not in (None, ()) and not _contiguous(cai):
            raise invalid(call, "a device array given through __cuda_array_interface__ must be C-contiguous")
        size = typestr_of(cai["typestr"])[1]
        for dim in cai["shape"]:
            size *= dim
        return _Side("device", int(cai["data"][0]), size, obj, None)
    try:
        cbuf = ffi.from_buffer(obj, require_writable=writable)
    except (TypeError, BufferError, ValueError) as exc:
        need = "a writable, C-contiguous" if writable else "a C-contiguous"
        raise invalid(call, f"the host side needs {need} buffer-protocol object "
                            f"({type(obj).__name__}: {exc})") from None
    return _Side("host", handle_int(cbuf), len(cbuf), cbuf, None)


def _contiguous(cai: dict[str, Any]) -> bool:
    itemsize = typestr_of(cai["typestr"])[1]
    expected = itemsize
    for dim, stride in zip(reversed(cai["shape"]), reversed(cai["strides"])):
        if dim > 1 and stride != expected:
            return False
        expected *= dim
    return True


def _checked_size(call: str, nbytes: int | None, *sides: _Side) -> int:
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


def _binding(stream: Any, *sides: _Side) -> Context | None:
    """The context a transfer runs in: the stream's, else the first device side's that cuproc knows."""
    if isinstance(stream, Stream):
        return stream.context
    for side in sides:
        if side.kind == "device" and side.context is not None:
            return side.context
    for side in sides:
        if side.context is not None:
            return side.context
    return None


def _run(ctx: Context | None, driver: Driver | None, call: str, *args: Any) -> None:
    drv = ctx.driver if ctx is not None else get_driver(driver)
    rc = call_in(ctx, getattr(drv, call), *args)
    if rc:
        raise drv.error(rc, call)


def _stream_arg(stream: Any, ctx: Context | None, driver: Driver | None, call: str) -> Any:
    drv = ctx.driver if ctx is not None else get_driver(driver)
    return stream_handle(stream, drv, call)


def copy(dst: Any, src: Any, nbytes: int | None = None, *, stream: Stream | Any | None = None,
         driver: Driver | None = None) -> None:
    """Copy between host and device memory in any direction; ``stream`` makes it asynchronous.

    ``nbytes`` defaults to the smaller side.  Device-to-device copies between
    two contexts go through cuMemcpyPeer.
    """
    d, s = _side(dst, "cuMemcpy", writable=True), _side(src, "cuMemcpy", writable=False)
    n = _checked_size("cuMemcpy", nbytes, d, s)
    ctx = _binding(stream, d, s)
    asynchronous = stream is not None
    tail = (_stream_arg(stream, ctx, driver, "cuMemcpyAsync"),) if asynchronous else ()
    suffix = "Async" if asynchronous else ""
    if d.kind == "device" and s.kind == "host":
        _run(ctx, driver, "cuMemcpyHtoD" + suffix, d.ptr, ffi.cast("void *", s.ptr), n, *tail)
    elif d.kind == "host" and s.kind == "device":
        _run(ctx, driver, "cuMemcpyDtoH" + suffix, ffi.cast("void *", d.ptr), s.ptr, n, *tail)
    elif d.kind == "device" and s.kind == "device":
        if d.context is not None and s.context is not None and d.context is not s.context:
            _run(ctx if asynchronous else None, d.context.driver, "cuMemcpyPeer" + suffix, d.ptr, d.context.handle,
                 s.ptr, s.context.handle, n, *tail)
        else:
            _run(ctx, driver, "cuMemcpyDtoD" + suffix, d.ptr, s.ptr, n, *tail)
    else:
        raise invalid("cuMemcpy", "both sides are host memory: use memoryview slicing or numpy.copyto")


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
    ctx = _binding(stream, d, s)
    drv = ctx.driver if ctx is not None else get_driver(driver)
    p = ffi.new("CUDA_MEMCPY2D *")
    for prefix, side, pitch in (("src", s, src_pitch), ("dst", d, dst_pitch)):
        _place(drv, p, prefix, side)
        setattr(p, prefix + "Pitch", pitch)
    p.WidthInBytes, p.Height = width_bytes, height
    if stream is None:
        _run(ctx, driver, "cuMemcpy2D", p)
    else:
        _run(ctx, driver, "cuMemcpy2DAsync", p, _stream_arg(stream, ctx, driver, "cuMemcpy2DAsync"))


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
    ctx = _binding(stream, d, s)
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
        _run(ctx, driver, "cuMemcpy3DAsync", p, _stream_arg(stream, ctx, driver, "cuMemcpy3DAsync"))


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
    if element_bits not in (8, 16, 32):
        raise invalid("cuMemsetD8", f"element_bits must be 8, 16 or 32, got {element_bits}")
    call = f"cuMemsetD{element_bits}"
    d = _side(dst, call, writable=True)
    if d.kind != "device":
        raise invalid(call, "memset fills device memory; the destination is host memory")
    size = element_bits // 8
    if count is None:
        if d.nbytes is None:
            raise invalid(call, "count is needed for a raw pointer")
        count = d.nbytes // size
    if count < 0 or (d.nbytes is not None and count * size > d.nbytes):
        raise invalid(call, f"{count} elements of {size} bytes do not fit the {d.nbytes}-byte destination")
    if not 0 <= value < (1 << element_bits):
        raise invalid(call, f"value {value} does not fit {element_bits} bits")
    ctx = _binding(stream, d)
    if stream is None:
        _run(ctx, driver, call, d.ptr, value, count)
    else:
        _run(ctx, driver, call + "Async", d.ptr, value, count, _stream_arg(stream, ctx, driver, call + "Async"))


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
    ctx = _binding(stream, d)
    if stream is None:
        _run(ctx, driver, call, d.ptr, pitch, value, width, height)
    else:
        _run(ctx, driver, call + "Async", d.ptr, pitch, value, width, height,
             _stream_arg(stream, ctx, driver, call + "Async"))


__all__ = ["copy", "copy_2d", "copy_3d", "memset", "memset_2d"]
