"""Host memory the GPU can reach: pinned (cuMemAllocHost / cuMemHostAlloc), registered
(cuMemHostRegister) and managed (cuMemAllocManaged) allocations.

Policy
------
* Every view of the memory -- ``.buffer``, ``.numpy()``, ``memoryview(buf)``
  (``__buffer__``, Python 3.12+) -- holds the allocation, so the memory cannot
  be freed under it by dropping the allocation.  (Except a read-only
  registration's: its views are of the registered object itself, which owns
  the pages, so they stay valid host memory after unregistering, and they
  neither hold the registration nor stop it from being unregistered.)
* Freeing explicitly while views exist is refused with ``BufferError``, as is
  destroying (or releasing the last retain of, or resetting) the context the
  memory lives in: a NumPy array cannot be told its memory went away, and a
  write through it would crash the process.
* Calls whose signature changed between versions (cuMemPrefetchAsync,
  cuMemAdvise) are dispatched on the arity of the ABI the handle selected.
"""
from __future__ import annotations

import ctypes
import sys
import weakref
from typing import Any

from ._ffi import ffi
from ._support import arity, handle_int, invalid
from .allocation import Allocation
from .context import Context
from .device import Device
from .driver import Driver
from .interop import KDL_CUDA_MANAGED, HostArrayExports, cai, stream_marker
from .stream import Stream, stream_handle


class HostMemory(HostArrayExports, Allocation):
    """Host memory with zero-copy views that keep it alive; DLPack exports it as kDLCUDAHost
    (managed memory: kDLCUDAManaged), see :mod:`cuproc.interop`."""

    __slots__ = ("_views", "last_stream")
    kind = "host"
    last_stream: Stream | int | None   # the last stream-ordered copy cuproc queued on it (None: none pending)

    def _copy_type(self) -> type[HostMemory]:
        """A DLPack copy of host memory is pinned memory (managed memory: managed, below)."""
        return PinnedBuffer

    def _start(self, drv: Driver, ctx: Context, address: int, nbytes: int) -> None:
        self.driver, self.ended, self.context, self.address, self.nbytes = drv, None, ctx, address, nbytes
        self._views: dict[int, weakref.ref[Any]] | None = None
        self.last_stream = None

    @property
    def buffer(self) -> memoryview:
        """A writable byte memoryview over the memory (zero-copy); it holds this allocation."""
        address = self.ptr
        view = (ctypes.c_ubyte * self.nbytes).from_address(address)
        view._cuproc_owner = self     # the view keeps the allocation (and its context) alive
        if self._views is None:
            self._views = {}
            self.context.add_exporter(self)
        views, key = self._views, id(view)   # ctypes arrays are unhashable: track them by id, weakly
        views[key] = weakref.ref(view, lambda _ref, views=views, key=key: views.pop(key, None))
        return memoryview(view).cast("B")   # plain bytes: ctypes' "<B" format refuses slice assignment

    def has_views(self) -> bool:
        """True while a view made by :attr:`buffer` / :meth:`numpy` / ``memoryview``, or a DLPack
        export, is alive."""
        return bool(self._views) or super().has_views()

    def __buffer__(self, flags: int) -> memoryview:
        return self.buffer

    def __release_buffer__(self, view: memoryview) -> None:
        """Nothing to do (the view made by ``__buffer__`` is released by CPython).  Defining it sets the
        type's bf_releasebuffer, so NumPy (>= 1.25) keeps a memoryview export for ``np.frombuffer(buf)``
        instead of releasing the buffer at once: the view then holds the allocation, and ``close()``
        refuses while the array lives (without it the array outlives a successful free)."""

    def numpy(self, dtype: Any = "u1") -> Any:
        """A NumPy array over the memory (zero-copy), over :attr:`buffer`: it holds this allocation as that
        view does, and is read-only where the memory is."""
        import numpy as np
        return np.frombuffer(self.buffer, dtype=dtype)


class PinnedBuffer(HostMemory):
    """Page-locked host memory: cuMemAllocHost, or cuMemHostAlloc with portable/mapped/write-combined."""

    __slots__ = ("flags",)
    _release_call = "cuMemFreeHost"

    def __init__(self, nbytes: int, *, portable: bool = False, mapped: bool = False,
                 write_combined: bool = False, context: Context | None = None, driver: Driver | None = None) -> None:
        if nbytes.__class__ is not int or nbytes < 0:
            raise invalid("cuMemHostAlloc", f"size must be an int >= 0, got {nbytes!r}")
        ctx, run = Context.target(context, "cuMemHostAlloc", driver=driver)
        drv = ctx.driver
        flags = ((drv.CU_MEMHOSTALLOC_PORTABLE if portable else 0) |
                 (drv.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0) |
                 (drv.CU_MEMHOSTALLOC_WRITECOMBINED if write_combined else 0))
        out = ffi.new("void **")
        if flags:
            drv.check(run(drv.cuMemHostAlloc, out, nbytes, flags), "cuMemHostAlloc")
        else:
            drv.check(run(drv.cuMemAllocHost, out, nbytes), "cuMemAllocHost")
        self.flags = flags
        self._start(drv, ctx, handle_int(out[0]), nbytes)

    def _release(self) -> int:
        return self.context.call(self.driver.cuMemFreeHost, ffi.cast("void *", self.address))

    @property
    def device_pointer(self) -> int:
        """The device address of mapped memory (cuMemHostGetDevicePointer)."""
        out = ffi.new("CUdeviceptr *")
        self.context.run("cuMemHostGetDevicePointer", out, ffi.cast("void *", self.ptr), 0)
        return int(out[0])


class RegisteredHostMemory(HostMemory):
    """An existing writable, contiguous host buffer, page-locked in place (cuMemHostRegister).
    It holds the object it registered until unregistered.

    ``read_only=True`` registers a buffer that may be read-only (a ``bytes``, a read-only array) with
    CU_MEMHOSTREGISTER_READ_ONLY: the memory is then ``read_only``, which every writer refuses before
    the driver sees it -- a copy or memset into it, and a writable view (``buffer`` and ``numpy()``
    are read-only, a DLPack export says so) -- since the driver itself would write those pages."""

    __slots__ = ("obj", "_cbuf", "_read_only")
    _release_call = "cuMemHostUnregister"
    _ended_word = "unregistered"

    def __init__(self, obj: Any, *, portable: bool = False, mapped: bool = False, read_only: bool = False,
                 context: Context | None = None, driver: Driver | None = None) -> None:
        self._read_only = bool(read_only)   # first: read by the writers' refusals, even of a half-made object
        try:
            cbuf = ffi.from_buffer(obj, require_writable=not read_only)
        except (TypeError, BufferError, ValueError) as exc:
            raise invalid("cuMemHostRegister", f"needs a {'writable, ' if not read_only else ''}C-contiguous "
                                               f"buffer ({type(obj).__name__}: {exc})") from None
        ctx, run = Context.target(context, "cuMemHostRegister", driver=driver)
        drv = ctx.driver
        flags = ((drv.CU_MEMHOSTREGISTER_PORTABLE if portable else 0) |
                 (drv.CU_MEMHOSTREGISTER_DEVICEMAP if mapped else 0) |
                 (drv.CU_MEMHOSTREGISTER_READ_ONLY if read_only else 0))
        drv.check(run(drv.cuMemHostRegister, cbuf, len(cbuf), flags), "cuMemHostRegister")
        self.obj, self._cbuf = obj, cbuf   # keep the memory alive while registered
        self._start(drv, ctx, handle_int(cbuf), len(cbuf))

    def _release(self) -> int:
        return self.context.call(self.driver.cuMemHostUnregister, self._cbuf)

    @property
    def read_only(self) -> bool:  # type: ignore[override]  # a class attribute, False, on other memory
        """Registered with read_only=True: no copy, memset or view of cuproc's writes it (fixed at registration)."""
        return self._read_only

    @property
    def buffer(self) -> memoryview:
        """A byte memoryview over the memory (zero-copy).  Writable, and holding this registration, as every
        host memory's view (:attr:`HostMemory.buffer`); for a read-only registration, a read-only view of the
        registered object itself, whose ``.obj`` is that object (a writable array over its pages, as the others'
        ``.obj`` is, would let anyone write an immutable ``bytes``).  It needs no hold on the registration: the
        object owns the pages, which stay valid host memory once unregistered."""
        if not self._read_only:
            return super().buffer
        self.check("RegisteredHostMemory.buffer")
        return memoryview(self.obj).cast("B").toreadonly()

    def unregister(self) -> None:
        self.close()


class ManagedBuffer(HostMemory):
    """Unified memory (cuMemAllocManaged): usable from host and device, with prefetch and advise."""

    __slots__ = ()
    kind = "managed"
    _release_call = "cuMemFree"
    _dlpack_type = KDL_CUDA_MANAGED

    def _copy_type(self) -> type[HostMemory]:
        return ManagedBuffer

    def __init__(self, nbytes: int, *, attach_global: bool = True, context: Context | None = None,
                 driver: Driver | None = None) -> None:
        if nbytes.__class__ is not int or nbytes <= 0:
            raise invalid("cuMemAllocManaged", f"size must be a positive int, got {nbytes!r}")
        ctx, run = Context.target(context, "cuMemAllocManaged", driver=driver)
        drv = ctx.driver
        out = ffi.new("CUdeviceptr *")
        flags = drv.CU_MEM_ATTACH_GLOBAL if attach_global else drv.CU_MEM_ATTACH_HOST
        drv.check(run(drv.cuMemAllocManaged, out, nbytes, flags), "cuMemAllocManaged")
        self._start(drv, ctx, int(out[0]), nbytes)

    def _release(self) -> int:
        return self.context.call(self.driver.cuMemFree, self.address)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Its stream is that of the last stream-ordered copy cuproc queued on it, else the default
        stream's marker (kernel launches are not tracked)."""
        ptr = self.ptr
        return cai(ptr, (self.nbytes,), "|u1", stream_marker(self))

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA_MANAGED, self.context.device.ordinal)

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
        address = self.ptr
        h = stream_handle(stream, self.driver, "cuMemPrefetchAsync")
        ctx = stream.context if isinstance(stream, Stream) else self.context
        if arity(self.driver, "cuMemPrefetchAsync") == 5:
            ctx.run("cuMemPrefetchAsync", address, self.nbytes, location, 0, h)
        else:
            ctx.run("cuMemPrefetchAsync", address, self.nbytes, device, h)

    def advise(self, advice: str | int, target: Device | int | str) -> None:
        """cuMemAdvise, e.g. ``advise("SET_READ_MOSTLY", 0)`` or ``("SET_PREFERRED_LOCATION", "cpu")``."""
        if isinstance(advice, str):
            name = advice if advice.startswith("CU_MEM_ADVISE_") else "CU_MEM_ADVISE_" + advice.upper()
            advice = ffi.typeof("CUmem_advise").relements[name]
        location, device = self._location(target)
        address = self.ptr
        if arity(self.driver, "cuMemAdvise") == 4 and "CUmemLocation" in str(
                ffi.typeof(self.driver.resolution("cuMemAdvise").typedef).args[3]):
            self.context.run("cuMemAdvise", address, self.nbytes, advice, location)
        else:
            self.context.run("cuMemAdvise", address, self.nbytes, advice, device)


if sys.version_info < (3, 12):  # no __buffer__ protocol: numpy.frombuffer(buf.buffer) instead
    del HostMemory.__buffer__, HostMemory.__release_buffer__


__all__ = ["HostMemory", "ManagedBuffer", "PinnedBuffer", "RegisteredHostMemory"]
