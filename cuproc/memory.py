"""Memory: device, pinned, registered, managed and stream-ordered allocations; fill, copy, queries.

Policy
------
* Every allocation holds the context it was made in and is freed with that
  context made current, from whichever thread lets go of it: by ``close()``,
  a ``with`` block, or -- the safety net -- a finalizer that never raises.
* ``free()`` on a freed buffer, or any use of it, raises
  :class:`~cuproc.errors.InvalidValueError`; using a buffer whose context was
  destroyed raises :class:`~cuproc.errors.InvalidContextError`.  ``close()``
  is idempotent, like a file's.
* Host sides of copies take any buffer-protocol object without an
  intermediate copy (``ffi.from_buffer``).  Sizes and bounds are checked
  before the driver sees them.
* Calls whose signature changed between versions (cuMemPrefetchAsync,
  cuMemAdvise) are dispatched on the arity of the ABI the handle selected.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any

from ._cffi_abi import ffi
from ._support import arity, get_driver, handle_int, invalid
from .context import Context
from .device import Device
from .driver import Driver
from .errors import InvalidContextError, result_code
from .stream import Stream, stream_handle

_CTX_ERROR = result_code("CUDA_ERROR_INVALID_CONTEXT")
KDL_CUDA = 2  # DLPack device type of CUDA device memory
_NO_CONTEXT_HINT = ("no context is current on this thread: call cuproc.use_device(0) (or retain a primary "
                    "context / create one) first")


def _current_context(drv: Driver, call: str) -> Context:
    ctx = Context.current(driver=drv)
    if ctx is None:
        raise InvalidContextError(_CTX_ERROR, call, hint=_NO_CONTEXT_HINT)
    return ctx


def _in_context(drv: Driver, ctx: Context, call: str, *args: Any) -> int:
    """Call ``call`` with ``ctx`` pushed; returns the CUresult.  Used by frees (any thread)."""
    rc = drv.cuCtxPushCurrent(ctx.handle)
    if rc:
        return rc
    try:
        return getattr(drv, call)(*args)
    finally:
        drv.cuCtxPopCurrent(ffi.new("CUcontext *"))


def _release(drv: Driver, ctx: Context, call: str, *args: Any) -> None:
    """Finalizer body: free with the owning context current; never raises."""
    try:
        if ctx.alive:
            _in_context(drv, ctx, call, *args)
    except Exception:  # noqa: BLE001 - finalizers must not raise (shutdown, dead driver)
        pass


class _Allocation:
    """Common lifetime handling: context, freed state, close/with/finalizer."""

    _free_call = "cuMemFree"
    kind = "device"

    def _track(self, drv: Driver, ctx: Context, ptr: int, nbytes: int, free_arg: Any) -> None:
        self.driver, self.context, self._ptr, self.nbytes = drv, ctx, ptr, nbytes
        self._owned_arg = free_arg
        self._freed = False

    def __del__(self) -> None:
        # The safety net: free what was never freed, with its context current.  __del__ rather
        # than weakref.finalize: a finalizer object costs about a microsecond per allocation,
        # most of what a stream-ordered alloc/free pair adds to the driver's own time.
        try:
            if not self._freed:
                self._freed = True
                _release(self.driver, self.context, self._free_call, self._owned_arg)
        except Exception:  # noqa: BLE001 - half-built object, or interpreter shutdown
            pass

    @property
    def ptr(self) -> int:
        """The address; raises if the buffer was freed or its context destroyed."""
        if self._freed or self.context._destroyed:   # one test on the launch path; details below
            if self._freed:
                raise invalid(self._free_call, f"this {type(self).__name__} was freed; it cannot be used")
            raise InvalidContextError(_CTX_ERROR, self._free_call, hint="the context this buffer was allocated "
                                      "in was destroyed, and its memory with it")
        return self._ptr

    def free(self) -> None:
        """Free now; a second free raises (a double free is a bug worth hearing about)."""
        self.ptr  # noqa: B018 - raises on double free / destroyed context
        self._freed = True   # first: whatever the driver answers, never free twice
        rc = _in_context(self.driver, self.context, self._free_call, self._free_arg())
        self.driver.check(rc, self._free_call)

    def _free_arg(self) -> Any:
        return self._ptr

    def close(self) -> None:
        """Free if not yet freed (idempotent); silently done if the context is already gone."""
        if not self._freed and self.context.alive:
            self.free()
        self._freed = True

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def freed(self) -> bool:
        return self._freed

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        state = "freed" if self._freed else f"{self._ptr:#x}"
        return f"<cuproc.{type(self).__name__} {self.nbytes} bytes at {state}>"


class _DeviceArray:
    """``__cuda_array_interface__`` (v3) and DLPack from ``ptr``, ``shape``, ``typestr`` and
    ``__dlpack_device__``: what a buffer and its typed views export alike."""

    ptr: int
    shape: tuple[int, ...]
    typestr: str

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return _cai(self.ptr, self.shape, self.typestr)

    def __dlpack__(self, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        from ._dlpack import to_capsule
        return to_capsule(self, self.ptr, self.shape, self.typestr, self.__dlpack_device__())


class DeviceBuffer(_DeviceArray, _Allocation):
    """Linear device memory from cuMemAlloc (or cuMemAllocAsync, see :func:`alloc_async`).

    Exports ``__cuda_array_interface__`` (v3) and DLPack as a 1-D uint8 array;
    :meth:`view` gives a typed, shaped view of the same memory.
    """

    typestr = "|u1"

    def __init__(self, nbytes: int, *, driver: Driver | None = None) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise invalid("cuMemAlloc", f"size must be a positive int, got {nbytes!r}")
        drv = get_driver(driver)
        ctx = _current_context(drv, "cuMemAlloc")
        out = ffi.new("CUdeviceptr *")
        drv.checked.cuMemAlloc(out, nbytes)
        self._track(drv, ctx, int(out[0]), nbytes, int(out[0]))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.nbytes,)

    def view(self, dtype: Any, shape: tuple[int, ...] | int | None = None) -> DeviceView:
        return DeviceView(self, dtype, shape)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.context.device.ordinal)

    def free_async(self, stream: Stream | Any | None = None) -> None:
        """cuMemFreeAsync: the memory returns to its pool once prior work on ``stream`` is done."""
        ptr = self.ptr
        self._freed = True
        self.driver.checked.cuMemFreeAsync(ptr, stream_handle(stream, self.driver))


class DeviceView(_DeviceArray):
    """A typed, shaped, C-contiguous view of a DeviceBuffer (keeps the buffer alive)."""

    def __init__(self, buffer: DeviceBuffer, dtype: Any, shape: tuple[int, ...] | int | None) -> None:
        typestr, itemsize = _typestr(dtype)
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
    def ptr(self) -> int:
        return self.buffer.ptr

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.buffer.__dlpack_device__()


class GlobalView:
    """A ``__device__`` variable of a module or library: memory its owner holds (never freed here)."""

    def __init__(self, ptr: int, nbytes: int, owner: Any, context: Context | None) -> None:
        self._ptr, self.nbytes, self.owner, self.context = ptr, nbytes, owner, context

    @property
    def ptr(self) -> int:
        if self.context is not None and not self.context.alive:
            raise InvalidContextError(_CTX_ERROR, "cuModuleGetGlobal", hint="its context was destroyed")
        return self._ptr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return _cai(self.ptr, (self.nbytes,), "|u1")

    def __repr__(self) -> str:
        return f"<cuproc.GlobalView {self.nbytes} bytes at {self._ptr:#x}>"


def _cai(ptr: int, shape: tuple[int, ...], typestr: str) -> dict[str, Any]:
    return {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3, "strides": None,
            "stream": None}


def _typestr(dtype: Any) -> tuple[str, int]:
    """(array-interface typestr, itemsize) for a NumPy dtype (or anything np.dtype takes) or a typestr."""
    if isinstance(dtype, str) and len(dtype) >= 3 and dtype[0] in "<>|=" and dtype[2:].isdigit():
        return dtype, int(dtype[2:])
    import numpy as np
    d = np.dtype(dtype)
    return d.str, d.itemsize


def alloc_async(nbytes: int, stream: Stream | Any | None = None, *, pool: MemoryPool | None = None,
                driver: Driver | None = None) -> DeviceBuffer:
    """Stream-ordered allocation (cuMemAllocAsync / cuMemAllocFromPoolAsync); free with free_async."""
    if nbytes < 0:
        raise invalid("cuMemAllocAsync", f"size must be >= 0, got {nbytes}")
    drv = get_driver(driver)
    # a Stream knows its context (the one its memory belongs with): no cuCtxGetCurrent per allocation
    ctx = stream.context if isinstance(stream, Stream) and stream.driver is drv else \
        _current_context(drv, "cuMemAllocAsync")
    out = ffi.new("CUdeviceptr *")
    h = stream_handle(stream, drv)
    if pool is None:
        drv.checked.cuMemAllocAsync(out, nbytes, h)
    else:
        drv.checked.cuMemAllocFromPoolAsync(out, nbytes, pool.handle, h)
    buf = DeviceBuffer.__new__(DeviceBuffer)
    buf._track(drv, ctx, int(out[0]), nbytes, int(out[0]))
    return buf


# --------------------------------------------------------------------------- host memory

class _HostMemory(_Allocation):
    """Host memory the GPU can reach: buffer protocol (``__buffer__``, or ``.buffer`` before 3.12)."""

    kind = "host"

    @property
    def buffer(self) -> Any:
        """A writable buffer-protocol object over the memory (zero-copy)."""
        return ffi.buffer(ffi.cast("char *", self.ptr), self.nbytes)

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self.buffer)

    def numpy(self, dtype: Any = "u1") -> Any:
        import numpy as np
        return np.frombuffer(self.buffer, dtype=dtype)


class PinnedBuffer(_HostMemory):
    """Page-locked host memory: cuMemAllocHost, or cuMemHostAlloc with portable/mapped/write-combined."""

    _free_call = "cuMemFreeHost"

    def __init__(self, nbytes: int, *, portable: bool = False, mapped: bool = False,
                 write_combined: bool = False, driver: Driver | None = None) -> None:
        if nbytes < 0:
            raise invalid("cuMemHostAlloc", f"size must be >= 0, got {nbytes}")
        drv = get_driver(driver)
        ctx = _current_context(drv, "cuMemHostAlloc")
        flags = ((drv.CU_MEMHOSTALLOC_PORTABLE if portable else 0) |
                 (drv.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0) |
                 (drv.CU_MEMHOSTALLOC_WRITECOMBINED if write_combined else 0))
        out = ffi.new("void **")
        if flags:
            drv.checked.cuMemHostAlloc(out, nbytes, flags)
        else:
            drv.checked.cuMemAllocHost(out, nbytes)
        self.flags = flags
        address = handle_int(out[0])
        self._track(drv, ctx, address, nbytes, out[0])

    def _free_arg(self) -> Any:
        return ffi.cast("void *", self._ptr)

    @property
    def device_pointer(self) -> int:
        """The device address of mapped memory (cuMemHostGetDevicePointer)."""
        out = ffi.new("CUdeviceptr *")
        with self.context:
            self.driver.checked.cuMemHostGetDevicePointer(out, ffi.cast("void *", self.ptr), 0)
        return int(out[0])


class RegisteredHostMemory(_HostMemory):
    """An existing writable, contiguous host buffer, page-locked in place (cuMemHostRegister)."""

    _free_call = "cuMemHostUnregister"

    def __init__(self, obj: Any, *, portable: bool = False, mapped: bool = False, read_only: bool = False,
                 driver: Driver | None = None) -> None:
        drv = get_driver(driver)
        try:
            cbuf = ffi.from_buffer(obj, require_writable=not read_only)
        except (TypeError, BufferError, ValueError) as exc:
            raise invalid("cuMemHostRegister", f"needs a {'writable, ' if not read_only else ''}C-contiguous "
                                               f"buffer ({type(obj).__name__}: {exc})") from None
        ctx = _current_context(drv, "cuMemHostRegister")
        flags = ((drv.CU_MEMHOSTREGISTER_PORTABLE if portable else 0) |
                 (drv.CU_MEMHOSTREGISTER_DEVICEMAP if mapped else 0) |
                 (drv.CU_MEMHOSTREGISTER_READ_ONLY if read_only else 0))
        drv.checked.cuMemHostRegister(cbuf, len(cbuf), flags)
        self.obj, self._cbuf = obj, cbuf   # keep the memory alive while registered
        self._track(drv, ctx, handle_int(cbuf), len(cbuf), cbuf)

    def _free_arg(self) -> Any:
        return self._cbuf

    unregister = _Allocation.close


class ManagedBuffer(_HostMemory):
    """Unified memory (cuMemAllocManaged): usable from host and device, with prefetch and advise."""

    kind = "managed"

    def __init__(self, nbytes: int, *, attach_global: bool = True, driver: Driver | None = None) -> None:
        if nbytes <= 0:
            raise invalid("cuMemAllocManaged", f"size must be > 0, got {nbytes}")
        drv = get_driver(driver)
        ctx = _current_context(drv, "cuMemAllocManaged")
        out = ffi.new("CUdeviceptr *")
        flags = drv.CU_MEM_ATTACH_GLOBAL if attach_global else drv.CU_MEM_ATTACH_HOST
        drv.checked.cuMemAllocManaged(out, nbytes, flags)
        self._track(drv, ctx, int(out[0]), nbytes, int(out[0]))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return _cai(self.ptr, (self.nbytes,), "|u1")

    def _location(self, target: Device | int | str) -> tuple[Any, int]:
        """(CUmemLocation, legacy CUdevice) for a device, an ordinal, or "cpu"."""
        loc = ffi.new("CUmemLocation *")
        if target == "cpu":
            loc.type, loc.id = self.driver.CU_MEM_LOCATION_TYPE_HOST, 0
            return loc[0], self.driver.CU_DEVICE_CPU
        ordinal = target.ordinal if isinstance(target, Device) else int(target)
        loc.type, loc.id = self.driver.CU_MEM_LOCATION_TYPE_DEVICE, ordinal
        return loc[0], Device(ordinal, driver=self.driver).handle

    def prefetch(self, target: Device | int | str, stream: Stream | Any | None = None) -> None:
        """cuMemPrefetchAsync to a device or "cpu" (v2 ABI: a CUmemLocation; v1: a device ordinal)."""
        location, device = self._location(target)
        h = stream_handle(stream, self.driver)
        if arity(self.driver, "cuMemPrefetchAsync") == 5:
            self.driver.checked.cuMemPrefetchAsync(self.ptr, self.nbytes, location, 0, h)
        else:
            self.driver.checked.cuMemPrefetchAsync(self.ptr, self.nbytes, device, h)

    def advise(self, advice: str | int, target: Device | int | str) -> None:
        """cuMemAdvise, e.g. ``advise("SET_READ_MOSTLY", 0)`` or ``("SET_PREFERRED_LOCATION", "cpu")``."""
        if isinstance(advice, str):
            name = advice if advice.startswith("CU_MEM_ADVISE_") else "CU_MEM_ADVISE_" + advice.upper()
            advice = ffi.typeof("CUmem_advise").relements[name]
        location, device = self._location(target)
        if arity(self.driver, "cuMemAdvise") == 4 and "CUmemLocation" in str(
                ffi.typeof(self.driver.resolution("cuMemAdvise").typedef).args[3]):
            self.driver.checked.cuMemAdvise(self.ptr, self.nbytes, advice, location)
        else:
            self.driver.checked.cuMemAdvise(self.ptr, self.nbytes, advice, device)


# --------------------------------------------------------------------------- pools

class MemoryPool:
    """A stream-ordered memory pool: :meth:`create` (owned) or :meth:`default` (the device's)."""

    _U64 = ("RELEASE_THRESHOLD", "RESERVED_MEM_CURRENT", "RESERVED_MEM_HIGH", "USED_MEM_CURRENT", "USED_MEM_HIGH")

    def __init__(self, handle: Any, *, driver: Driver, owned: bool) -> None:
        self.handle, self.driver, self.owned = handle, driver, owned
        self._finalizer = weakref.finalize(self, _destroy_pool, driver, handle) if owned else None

    @classmethod
    def create(cls, device: Device | int = 0, *, release_threshold: int | None = None,
               driver: Driver | None = None) -> MemoryPool:
        drv = get_driver(driver)
        ordinal = device.ordinal if isinstance(device, Device) else device
        props = ffi.new("CUmemPoolProps *")
        props.allocType = drv.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = drv.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = ordinal
        out = ffi.new("CUmemoryPool *")
        drv.checked.cuMemPoolCreate(out, props)
        pool = cls(out[0], driver=drv, owned=True)
        if release_threshold is not None:
            pool.release_threshold = release_threshold
        return pool

    @classmethod
    def default(cls, device: Device | int = 0, *, driver: Driver | None = None) -> MemoryPool:
        drv = get_driver(driver)
        dev = device if isinstance(device, Device) else Device(device, driver=drv)
        out = ffi.new("CUmemoryPool *")
        drv.checked.cuDeviceGetDefaultMemPool(out, dev.handle)
        return cls(out[0], driver=drv, owned=False)

    def _attr(self, name: str) -> tuple[int, str]:
        key = name if name.startswith("CU_MEMPOOL_ATTR_") else "CU_MEMPOOL_ATTR_" + name.upper()
        short = key[len("CU_MEMPOOL_ATTR_"):]
        return ffi.typeof("CUmemPool_attribute").relements[key], "cuuint64_t *" if short in self._U64 else "int *"

    def get_attribute(self, name: str) -> int:
        attr, ctype = self._attr(name)
        out = ffi.new(ctype)
        self.driver.checked.cuMemPoolGetAttribute(self.handle, attr, out)
        return int(out[0])

    def set_attribute(self, name: str, value: int) -> None:
        attr, ctype = self._attr(name)
        self.driver.checked.cuMemPoolSetAttribute(self.handle, attr, ffi.new(ctype, value))

    @property
    def release_threshold(self) -> int:
        return self.get_attribute("RELEASE_THRESHOLD")

    @release_threshold.setter
    def release_threshold(self, value: int) -> None:
        self.set_attribute("RELEASE_THRESHOLD", value)

    def trim(self, min_bytes_to_keep: int = 0) -> None:
        self.driver.checked.cuMemPoolTrimTo(self.handle, min_bytes_to_keep)

    def destroy(self) -> None:
        if not self.owned:
            raise invalid("cuMemPoolDestroy", "the device's default pool is not owned and cannot be destroyed")
        self._finalizer()

    close = destroy


def _destroy_pool(driver: Driver, handle: Any) -> None:
    try:
        driver.cuMemPoolDestroy(handle)
    except Exception:  # noqa: BLE001 - finalizer
        pass


# --------------------------------------------------------------------------- fill and copy

class _Side:
    """One side of a copy: where it is, its address and (when known) its size."""

    __slots__ = ("kind", "ptr", "nbytes", "keep", "context")

    def __init__(self, kind: str, ptr: int, nbytes: int | None, keep: Any, context: Context | None) -> None:
        self.kind, self.ptr, self.nbytes, self.keep, self.context = kind, ptr, nbytes, keep, context


def _side(obj: Any, call: str, *, writable: bool) -> _Side:
    if isinstance(obj, (DeviceBuffer, ManagedBuffer)):
        return _Side("device", obj.ptr, obj.nbytes, obj, obj.context)
    if isinstance(obj, DeviceView):
        return _Side("device", obj.ptr, obj.nbytes, obj, obj.buffer.context)
    if isinstance(obj, GlobalView):
        return _Side("device", obj.ptr, obj.nbytes, obj, obj.context)
    if isinstance(obj, _HostMemory):
        return _Side("host", obj.ptr, obj.nbytes, obj, None)
    if isinstance(obj, int) and not isinstance(obj, bool):
        return _Side("device", obj, None, None, None)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("strides") not in (None, ()) and not _contiguous(cai):
            raise invalid(call, "a device array given through __cuda_array_interface__ must be C-contiguous")
        size = _typestr(cai["typestr"])[1]
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
    itemsize = _typestr(cai["typestr"])[1]
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


def copy(dst: Any, src: Any, nbytes: int | None = None, *, stream: Stream | Any | None = None,
         driver: Driver | None = None) -> None:
    """Copy between host and device memory in any direction; ``stream`` makes it asynchronous.

    Host objects are any buffer-protocol object (zero-copy); device objects are
    cuproc buffers, ``__cuda_array_interface__`` exporters or int addresses.
    ``nbytes`` defaults to the smaller side.  Device-to-device copies between
    two contexts go through cuMemcpyPeer.
    """
    drv = get_driver(driver)
    d, s = _side(dst, "cuMemcpy", writable=True), _side(src, "cuMemcpy", writable=False)
    n = _checked_size("cuMemcpy", nbytes, d, s)
    asynchronous = stream is not None
    h = stream_handle(stream, drv) if asynchronous else None
    tail = (h,) if asynchronous else ()
    suffix = "Async" if asynchronous else ""
    if d.kind == "device" and s.kind == "host":
        getattr(drv.checked, "cuMemcpyHtoD" + suffix)(d.ptr, ffi.cast("void *", s.ptr), n, *tail)
    elif d.kind == "host" and s.kind == "device":
        getattr(drv.checked, "cuMemcpyDtoH" + suffix)(ffi.cast("void *", d.ptr), s.ptr, n, *tail)
    elif d.kind == "device" and s.kind == "device":
        if d.context is not None and s.context is not None and d.context != s.context:
            getattr(drv.checked, "cuMemcpyPeer" + suffix)(d.ptr, d.context.handle, s.ptr, s.context.handle, n,
                                                          *tail)
        else:
            getattr(drv.checked, "cuMemcpyDtoD" + suffix)(d.ptr, s.ptr, n, *tail)
    else:
        raise invalid("cuMemcpy", "both sides are host memory: use memoryview slicing or numpy.copyto")


def copy_2d(dst: Any, dst_pitch: int, src: Any, src_pitch: int, width_bytes: int, height: int, *,
            stream: Stream | Any | None = None, driver: Driver | None = None) -> None:
    """A pitched 2-D copy (cuMemcpy2D / cuMemcpy2DAsync) between host and device in any direction."""
    drv = get_driver(driver)
    d, s = _side(dst, "cuMemcpy2D", writable=True), _side(src, "cuMemcpy2D", writable=False)
    if min(dst_pitch, src_pitch, width_bytes, height) < 0 or width_bytes > min(dst_pitch, src_pitch):
        raise invalid("cuMemcpy2D", "pitches, width and height must be >= 0 and width <= each pitch")
    for side, pitch, label in ((d, dst_pitch, "destination"), (s, src_pitch, "source")):
        needed = pitch * (height - 1) + width_bytes if height else 0
        if side.nbytes is not None and needed > side.nbytes:
            raise invalid("cuMemcpy2D", f"the {label} needs {needed} bytes for this copy; it has {side.nbytes}")
    p = ffi.new("CUDA_MEMCPY2D *")
    for prefix, side, pitch in (("src", s, src_pitch), ("dst", d, dst_pitch)):
        _place(drv, p, prefix, side)
        setattr(p, prefix + "Pitch", pitch)
    p.WidthInBytes, p.Height = width_bytes, height
    if stream is None:
        drv.checked.cuMemcpy2D(p)
    else:
        drv.checked.cuMemcpy2DAsync(p, stream_handle(stream, drv))


def copy_3d(dst: Any, dst_pitch: int, dst_height: int, src: Any, src_pitch: int, src_height: int,
            width_bytes: int, height: int, depth: int, *, stream: Stream | Any | None = None,
            driver: Driver | None = None) -> None:
    """A pitched 3-D copy of linear memory (cuMemcpy3D / cuMemcpy3DAsync)."""
    drv = get_driver(driver)
    d, s = _side(dst, "cuMemcpy3D", writable=True), _side(src, "cuMemcpy3D", writable=False)
    if min(dst_pitch, src_pitch, dst_height, src_height, width_bytes, height, depth) < 0 or \
            width_bytes > min(dst_pitch, src_pitch) or height > min(dst_height, src_height):
        raise invalid("cuMemcpy3D", "sizes must be >= 0, width <= each pitch and height <= each slice height")
    for side, pitch, slice_h, label in ((d, dst_pitch, dst_height, "destination"),
                                        (s, src_pitch, src_height, "source")):
        needed = (pitch * slice_h * (depth - 1) + pitch * (height - 1) + width_bytes) if depth and height else 0
        if side.nbytes is not None and needed > side.nbytes:
            raise invalid("cuMemcpy3D", f"the {label} needs {needed} bytes for this copy; it has {side.nbytes}")
    p = ffi.new("CUDA_MEMCPY3D *")
    for prefix, side, pitch, slice_h in (("src", s, src_pitch, src_height), ("dst", d, dst_pitch, dst_height)):
        _place(drv, p, prefix, side)
        setattr(p, prefix + "Pitch", pitch)
        setattr(p, prefix + "Height", slice_h)
    p.WidthInBytes, p.Height, p.Depth = width_bytes, height, depth
    if stream is None:
        drv.checked.cuMemcpy3D(p)
    else:
        drv.checked.cuMemcpy3DAsync(p, stream_handle(stream, drv))


def _place(drv: Driver, p: Any, prefix: str, side: _Side) -> None:
    if side.kind == "host":
        setattr(p, prefix + "MemoryType", drv.CU_MEMORYTYPE_HOST)
        setattr(p, prefix + "Host", ffi.cast("void *", side.ptr))
    else:
        setattr(p, prefix + "MemoryType", drv.CU_MEMORYTYPE_DEVICE)
        setattr(p, prefix + "Device", side.ptr)


def _owning_context(side: _Side) -> Any:
    """``with`` the context that owns this memory pushed, when cuproc knows it; else a no-op."""
    return side.context if side.context is not None else contextlib.nullcontext()


def memset(dst: Any, value: int, count: int | None = None, *, element_bits: int = 8,
           stream: Stream | Any | None = None, driver: Driver | None = None) -> None:
    """Fill ``count`` elements of 8, 16 or 32 bits (cuMemsetD8/D16/D32, Async with a stream)."""
    drv = get_driver(driver)
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
    if stream is None:
        with _owning_context(d):   # memset needs the memory's own context (another device's is refused)
            getattr(drv.checked, call)(d.ptr, value, count)
    else:
        getattr(drv.checked, call + "Async")(d.ptr, value, count, stream_handle(stream, drv))


def memset_2d(dst: Any, pitch: int, value: int, width: int, height: int, *, element_bits: int = 8,
              stream: Stream | Any | None = None, driver: Driver | None = None) -> None:
    """Fill a pitched 2-D region: ``width`` elements per row, ``height`` rows (cuMemsetD2D8/16/32)."""
    drv = get_driver(driver)
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
    if stream is None:
        with _owning_context(d):
            getattr(drv.checked, call)(d.ptr, pitch, value, width, height)
    else:
        getattr(drv.checked, call + "Async")(d.ptr, pitch, value, width, height, stream_handle(stream, drv))


# --------------------------------------------------------------------------- queries

def mem_info(*, driver: Driver | None = None) -> tuple[int, int]:
    """(free, total) bytes on the current context's device (cuMemGetInfo)."""
    drv = get_driver(driver)
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    drv.checked.cuMemGetInfo(free, total)
    return free[0], total[0]


_MEMORY_TYPES = {1: "host", 2: "device", 3: "array", 4: "unified"}


def pointer_attributes(ptr: Any, *, driver: Driver | None = None) -> dict[str, Any]:
    """Classify any address (cuPointerGetAttribute): memory type, device, context, managed, range.

    Memory the driver does not know (ordinary pageable host memory) gives
    ``{"memory_type": None}``.
    """
    drv = get_driver(driver)
    address = ptr.ptr if hasattr(ptr, "ptr") else int(ptr)
    mtype = ffi.new("unsigned int *")
    rc = drv.cuPointerGetAttribute(mtype, drv.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
    if rc == drv.CUDA_ERROR_INVALID_VALUE:
        return {"memory_type": None}
    drv.check(rc, "cuPointerGetAttribute")
    info: dict[str, Any] = {"memory_type": _MEMORY_TYPES.get(mtype[0], mtype[0])}
    ordinal, managed = ffi.new("int *"), ffi.new("unsigned int *")
    ctx = ffi.new("CUcontext *")
    start, size = ffi.new("CUdeviceptr *"), ffi.new("size_t *")
    if drv.cuPointerGetAttribute(ordinal, drv.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address) == 0:
        info["device_ordinal"] = ordinal[0]
    if drv.cuPointerGetAttribute(managed, drv.CU_POINTER_ATTRIBUTE_IS_MANAGED, address) == 0:
        info["is_managed"] = bool(managed[0])
    if drv.cuPointerGetAttribute(ctx, drv.CU_POINTER_ATTRIBUTE_CONTEXT, address) == 0:
        info["context"] = handle_int(ctx[0])
    if drv.cuPointerGetAttribute(start, drv.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, address) == 0 and \
            drv.cuPointerGetAttribute(size, drv.CU_POINTER_ATTRIBUTE_RANGE_SIZE, address) == 0:
        info["range"] = (int(start[0]), size[0])
    return info


if sys.version_info < (3, 12):  # no __buffer__ protocol: numpy.frombuffer(buf.buffer) instead
    del _HostMemory.__buffer__


__all__ = ["DeviceBuffer", "DeviceView", "GlobalView", "ManagedBuffer", "MemoryPool", "PinnedBuffer", "RegisteredHostMemory",
           "alloc_async", "copy", "copy_2d", "copy_3d", "mem_info", "memset", "memset_2d", "pointer_attributes"]
