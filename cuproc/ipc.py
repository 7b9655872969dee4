"""Inter-process communication: device memory and events shared with other processes (legacy CUDA IPC).

Policy
------
* **Handles are values.**  :func:`export_memory` and :func:`export_event` return an
  :class:`IpcMemoryHandle` / :class:`IpcEventHandle`: the driver's 64 bytes plus what the importer must
  know (the size, the exporting process).  ``bytes(handle)`` is plain bytes to send through any channel
  (:meth:`IpcMemoryHandle.from_bytes` reads them back, refusing anything truncated or not made here),
  and the objects pickle to those bytes, so ``multiprocessing`` queues and pipes carry them.
* **Import** (:func:`open_memory`, :func:`open_event`) makes an :class:`IpcBuffer` (usable wherever a
  DeviceBuffer is: copies, memsets, launches, CAI, DLPack) or an :class:`IpcEvent` in the current (or
  given) context.  An IpcBuffer is *closed* with cuIpcCloseMemHandle -- never freed: the memory is the
  exporter's -- by ``close()``, a ``with`` block or its finalizer; it goes with its context (the driver
  unmaps it then).  Opening the same handle twice in a context gives the same address (the driver counts
  the opens), and each IpcBuffer closes its own open.
* **Refusals before the driver.**  A handle opened in the process that exported it is refused
  (``InvalidContextError``: the driver cannot map a process's own memory through IPC; use the buffer
  itself); so is a handle of the wrong kind or one truncated or forged.  What the driver alone can tell
  -- a handle whose memory was freed, or whose exporter exited -- comes back as the driver's error with
  what to check.  Nothing of this crashes the process.
* Only cuMemAlloc memory has a legacy IPC handle.  Stream-ordered memory is shared through its pool: one
  made with ``MemoryPool.create(..., handle_type="posix_fd")`` is exported as a file descriptor
  (:func:`export_pool`, cuMemPoolExportToShareableHandle) and imported in the other process
  (:func:`import_pool`); each allocation then travels as an :class:`IpcPoolPointer`
  (:func:`export_pointer` / :func:`import_pointer`, cuMemPoolExportPointer / cuMemPoolImportPointer), a
  value like the handles above.  An imported pool pointer (:class:`PoolBuffer`) holds its imported pool and
  is given back by cuMemFree, as the driver documents, before the exporter frees it.  VMM memory is
  shared through :meth:`cuproc.virtual_memory.PhysicalMemory.export_fd`.
* The exporter must keep its buffer (and event) alive while importers use them: freeing it under an
  importer leaves the importer's mapping to the driver (on a GPU the memory stays valid until every
  importer closed it).
"""
from __future__ import annotations

import os
import struct
from typing import Any

from ._ffi import ffi
from ._resource import Resource
from ._support import get_driver, handle_int, invalid
from .allocation import Allocation
from .context import Context
from .device_memory import DeviceBuffer, DeviceView
from .driver import Driver
from .errors import CudaError, InvalidContextError, refusal, result_code
from .interop import KDL_CUDA, DeviceArrayExports
from .pools import MemoryPool
from .stream import Event

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .stream import Stream

_MAGIC = b"cuproc-ipc\x01"
_MEMORY, _EVENT, _POOL_POINTER = 1, 2, 3
_POSIX_FD = 1                                  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_HEADER = struct.Struct("<11sBQqI")            # magic, kind, nbytes, pid, device ordinal
_DRIVER_BYTES = 64                             # sizeof(CUipcMemHandle) == sizeof(CUipcEventHandle)
_LAZY_ENABLE_PEER_ACCESS = 1                   # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_INVALID_CONTEXT = result_code("CUDA_ERROR_INVALID_CONTEXT")


class _IpcHandle:
    """The driver's 64-byte handle and what an importer needs; immutable; pickles to its bytes."""

    __slots__ = ("handle", "nbytes", "pid", "device_ordinal")
    _kind = 0
    _call = ""

    handle: bytes
    nbytes: int
    pid: int
    device_ordinal: int

    def __init__(self, handle: bytes, nbytes: int, pid: int, device_ordinal: int) -> None:
        if not isinstance(handle, bytes) or len(handle) != _DRIVER_BYTES:
            raise invalid(self._call, f"an IPC handle is {_DRIVER_BYTES} bytes of the driver's, "
                                      f"got {type(handle).__name__} of {len(handle) if isinstance(handle, bytes) else '?'}")
        object.__setattr__(self, "handle", handle)
        object.__setattr__(self, "nbytes", int(nbytes))
        object.__setattr__(self, "pid", int(pid))
        object.__setattr__(self, "device_ordinal", int(device_ordinal))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a {type(self).__name__} is a value; it cannot be changed")

    def __bytes__(self) -> bytes:
        return _HEADER.pack(_MAGIC, self._kind, self.nbytes, self.pid, self.device_ordinal) + self.handle

    to_bytes = __bytes__

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Any:
        """The handle ``bytes(handle)`` gave, read back; anything else -- truncated, padded, another kind's,
        not made by cuproc -- is refused with InvalidValueError before the driver sees it."""
        data = bytes(data)
        if len(data) != _HEADER.size + _DRIVER_BYTES:
            raise invalid(cls._call, f"an exported {cls.__name__} is {_HEADER.size + _DRIVER_BYTES} bytes, got "
                                     f"{len(data)} (truncated or padded in transit?)")
        magic, kind, nbytes, pid, ordinal = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise invalid(cls._call, "these bytes are not a handle cuproc exported (export_memory / export_event)")
        if kind != cls._kind:
            other = {_MEMORY: "a memory handle", _EVENT: "an event handle",
                     _POOL_POINTER: "a pool pointer"}.get(kind, f"kind {kind}")
            raise invalid(cls._call, f"these bytes are {other}, not an {cls.__name__}")
        return cls(data[_HEADER.size:], nbytes, pid, ordinal)

    def __reduce__(self) -> Any:
        return (type(self).from_bytes, (bytes(self),))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and bytes(self) == bytes(other)  # type: ignore[arg-type]

    def __hash__(self) -> int:
        return hash(bytes(self))

    def _refuse_own_process(self) -> None:
        if self.pid == os.getpid():
            raise refusal(self._call, f"this handle was exported by this process (pid {self.pid}); the driver cannot "
                                      f"open a process's own IPC handle (it answers CUDA_ERROR_INVALID_CONTEXT): use "
                                      f"the exported object itself here, and open the handle in another process",
                          InvalidContextError, "CUDA_ERROR_INVALID_CONTEXT")


class IpcMemoryHandle(_IpcHandle):
    """An exported cuMemAlloc allocation (cuIpcGetMemHandle): open it in another process with :func:`open_memory`."""

    __slots__ = ()
    _kind = _MEMORY
    _call = "cuIpcOpenMemHandle"

    def __repr__(self) -> str:
        return f"<cuproc.IpcMemoryHandle {self.nbytes} bytes on device {self.device_ordinal} of pid {self.pid}>"


class IpcEventHandle(_IpcHandle):
    """An exported interprocess event (cuIpcGetEventHandle): open it in another process with :func:`open_event`."""

    __slots__ = ()
    _kind = _EVENT
    _call = "cuIpcOpenEventHandle"

    def __repr__(self) -> str:
        return f"<cuproc.IpcEventHandle on device {self.device_ordinal} of pid {self.pid}>"


def export_memory(buffer: DeviceBuffer) -> IpcMemoryHandle:
    """cuIpcGetMemHandle of a DeviceBuffer made by cuMemAlloc (the whole allocation).  Keep the buffer alive
    while other processes use the memory."""
    call = "cuIpcGetMemHandle"
    if not isinstance(buffer, DeviceBuffer):
        raise invalid(call, f"export_memory takes a DeviceBuffer (cuMemAlloc memory), not {type(buffer).__name__} "
                            f"(share a pool's memory through a pool made with handle_type='posix_fd', VMM memory "
                            f"through PhysicalMemory.export_fd)")
    buffer.check(call)
    if buffer.stream is not None:
        raise invalid(call, f"{buffer.describe()} is stream-ordered pool memory, which has no legacy IPC handle: "
                            f"allocate it with DeviceBuffer(n) (cuMemAlloc) to export it")
    out = ffi.new("CUipcMemHandle *")
    ctx = buffer.context
    ctx.driver.check(ctx.call_current(ctx.driver.cuIpcGetMemHandle, out, buffer.address), call)
    return IpcMemoryHandle(bytes(ffi.buffer(out)), buffer.nbytes, os.getpid(), ctx.device.ordinal)


def _opened(drv: Driver, rc: int, call: str, what: str) -> CudaError:
    """The driver's refusal of an import, with what to check."""
    err = drv.error(rc, call)
    if rc == _INVALID_CONTEXT:
        err.add_note(f"the driver answers this for {what} exported by this very process (bytes made elsewhere "
                     f"than export_*, or a forked child): open it in another process")
    else:
        err.add_note(f"check that {what} came unchanged from export_* in a process that is still running and still "
                     f"holds the exported object")
    return err


class IpcBuffer(DeviceArrayExports, Allocation):
    """Device memory another process exported, opened here (cuIpcOpenMemHandle).

    Closed with cuIpcCloseMemHandle (``close()``, a ``with`` block, the finalizer), never freed: the memory is
    the exporter's.  Usable wherever a DeviceBuffer is.  Pickles to its handle (unpickling opens it)."""

    __slots__ = ("handle", "last_stream", "device_ordinal")
    _release_call = "cuIpcCloseMemHandle"
    _ended_word = "closed"
    typestr = "|u1"

    handle: IpcMemoryHandle
    last_stream: Stream | int | None

    def __init__(self, handle: IpcMemoryHandle, *, context: Context | None = None, driver: Driver | None = None) -> None:
        call = "cuIpcOpenMemHandle"
        if hasattr(self, "driver"):
            raise invalid(call, "IpcBuffer.__init__ was called twice; the first open would never be closed")
        if not isinstance(handle, IpcMemoryHandle):
            raise invalid(call, f"open_memory takes an IpcMemoryHandle (IpcMemoryHandle.from_bytes(data) reads sent "
                                f"bytes), not {type(handle).__name__}")
        handle._refuse_own_process()
        ctx, run = Context.target(context, call, driver=driver)
        drv = ctx.driver
        raw = ffi.new("CUipcMemHandle *")
        ffi.memmove(raw, handle.handle, _DRIVER_BYTES)
        out = ffi.new("CUdeviceptr *")
        rc = run(drv.cuIpcOpenMemHandle, out, raw[0], _LAZY_ENABLE_PEER_ACCESS)
        if rc:
            raise _opened(drv, rc, call, "this memory handle")
        self.driver, self.ended, self.context = drv, None, ctx
        self.address, self.nbytes, self.handle = int(out[0]), handle.nbytes, handle
        self.device_ordinal = handle.device_ordinal
        self.last_stream = None

    def _release(self) -> int:
        return self.context.call_current(self.driver.cuIpcCloseMemHandle, self.address)

    def free(self) -> None:
        """Refused: imported memory is closed (``close()``), never freed -- the exporter frees it."""
        raise invalid("cuMemFree", f"{self.describe()} is another process's memory: close() it "
                                   f"(cuIpcCloseMemHandle); the exporter frees it")

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]  # (DeviceArrayExports declares the attribute)
        return (self.nbytes,)

    def view(self, dtype: Any, shape: tuple[int, ...] | int | None = None) -> DeviceView:
        return DeviceView(self, dtype, shape)   # type: ignore[arg-type]

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.context.device.ordinal)

    def __reduce__(self) -> Any:
        return (open_memory, (self.handle,))


def open_memory(handle: IpcMemoryHandle | bytes, *, context: Context | None = None,
                driver: Driver | None = None) -> IpcBuffer:
    """Open another process's exported memory in the current (or given) context; ``handle`` is the
    IpcMemoryHandle or the bytes ``bytes(handle)`` gave."""
    value = IpcMemoryHandle.from_bytes(handle) if isinstance(handle, (bytes, bytearray, memoryview)) else handle
    return IpcBuffer(value, context=context, driver=driver)


def export_event(event: Event) -> IpcEventHandle:
    """cuIpcGetEventHandle of an event made with ``Event(timing=False, interprocess=True)``."""
    call = "cuIpcGetEventHandle"
    if not isinstance(event, Event):
        raise invalid(call, f"export_event takes a cuproc Event, not {type(event).__name__}")
    event.check(call)
    drv = event.driver
    need = drv.CU_EVENT_INTERPROCESS | drv.CU_EVENT_DISABLE_TIMING
    if event.flags & need != need:
        raise invalid(call, "only an event made with Event(timing=False, interprocess=True) can be exported "
                            "(CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)")
    out = ffi.new("CUipcEventHandle *")
    drv.check(event.context.call(drv.cuIpcGetEventHandle, out, event.handle), call)
    return IpcEventHandle(bytes(ffi.buffer(out)), 0, os.getpid(), event.context.device.ordinal)


class IpcEvent(Event):
    """An event another process exported, opened here (cuIpcOpenEventHandle): record it (the exporter's
    waits see it) or wait for it (streams, ``synchronize``, ``query``).  Destroyed with cuEventDestroy by
    ``close()`` or the finalizer, as the driver documents for imported events."""

    def __init__(self, handle: IpcEventHandle, *, context: Context | None = None,  # noqa: D107 - see the class
                 driver: Driver | None = None) -> None:
        call = "cuIpcOpenEventHandle"
        if not isinstance(handle, IpcEventHandle):
            raise invalid(call, f"open_event takes an IpcEventHandle (IpcEventHandle.from_bytes(data) reads sent "
                                f"bytes), not {type(handle).__name__}")
        handle._refuse_own_process()
        ctx, run = Context.target(context, call, driver=driver)
        drv = ctx.driver
        raw = ffi.new("CUipcEventHandle *")
        ffi.memmove(raw, handle.handle, _DRIVER_BYTES)
        out = ffi.new("CUevent *")
        rc = run(drv.cuIpcOpenEventHandle, out, raw[0])
        if rc:
            raise _opened(drv, rc, call, "this event handle")
        self.driver = drv
        self.flags = drv.CU_EVENT_INTERPROCESS | drv.CU_EVENT_DISABLE_TIMING
        self.context = ctx
        self.handle = out[0]
        self.ended = None
        self.ipc_handle = handle

    def describe(self) -> str:
        return f"imported event {handle_int(self.handle):#x}"

    def __reduce__(self) -> Any:
        return (open_event, (self.ipc_handle,))


def open_event(handle: IpcEventHandle | bytes, *, context: Context | None = None,
               driver: Driver | None = None) -> IpcEvent:
    """Open another process's exported event in the current (or given) context."""
    value = IpcEventHandle.from_bytes(handle) if isinstance(handle, (bytes, bytearray, memoryview)) else handle
    return IpcEvent(value, context=context, driver=driver)


# ---------------------------------------------------------------------------------------- shareable pools

def export_pool(pool: MemoryPool) -> int:
    """cuMemPoolExportToShareableHandle of a pool made with ``MemoryPool.create(..., handle_type="posix_fd")``:
    a POSIX file descriptor the caller owns (send it over a Unix socket -- ``multiprocessing.reduction``'s
    ``send_handle`` -- or let a child inherit it, then ``os.close`` it)."""
    call = "cuMemPoolExportToShareableHandle"
    if not isinstance(pool, MemoryPool):
        raise invalid(call, f"export_pool takes a cuproc MemoryPool, not {type(pool).__name__}")
    pool.check(call)
    if pool.handle_type != "posix_fd" or not pool.owned:
        raise invalid(call, f"{pool.describe()} was not made shareable: make it with "
                            f"MemoryPool.create(device, handle_type='posix_fd')")
    out = ffi.new("int *")
    pool.driver.check(pool.driver.cuMemPoolExportToShareableHandle(out, pool.handle, _POSIX_FD, 0), call)
    return int(out[0])


def import_pool(fd: int, *, driver: Driver | None = None) -> MemoryPool:
    """cuMemPoolImportFromShareableHandle of a descriptor another process exported (:func:`export_pool`): an
    imported pool, owned here (``close()`` destroys this process's import, cuMemPoolDestroy).  Import
    pointers of it with :func:`import_pointer`.  The caller keeps ``fd``."""
    call = "cuMemPoolImportFromShareableHandle"
    if fd.__class__ is not int or fd < 0:
        raise invalid(call, f"fd must be a file descriptor (an int >= 0), got {fd!r}")
    drv = get_driver(driver)
    out = ffi.new("CUmemoryPool *")
    rc = drv.cuMemPoolImportFromShareableHandle(out, ffi.cast("void *", fd), _POSIX_FD, 0)
    if rc:
        err = drv.error(rc, call)
        err.add_note("the descriptor must be one that export_pool gave in another, running process (a pool is "
                     "not imported into the process that made it: use the pool itself there)")
        raise err
    pool = MemoryPool(out[0], driver=drv, owned=True)
    pool.handle_type = "posix_fd"
    return pool


class IpcPoolPointer(_IpcHandle):
    """An allocation of a shareable pool exported by :func:`export_pointer` (cuMemPoolExportPointer): open
    it with :func:`import_pointer` on the pool imported in the other process."""

    __slots__ = ()
    _kind = _POOL_POINTER
    _call = "cuMemPoolImportPointer"

    def __repr__(self) -> str:
        return f"<cuproc.IpcPoolPointer {self.nbytes} bytes on device {self.device_ordinal} of pid {self.pid}>"


def export_pointer(buffer: DeviceBuffer) -> IpcPoolPointer:
    """cuMemPoolExportPointer of a buffer allocated from a shareable pool (``alloc_async(n, stream,
    pool=pool)``).  The importers must give it back before this process frees it."""
    call = "cuMemPoolExportPointer"
    if not isinstance(buffer, DeviceBuffer) or buffer.pool is None:
        raise invalid(call, "export_pointer takes a DeviceBuffer allocated from a shareable pool "
                            "(alloc_async(n, stream, pool=MemoryPool.create(..., handle_type='posix_fd')))")
    buffer.check(call)
    if buffer.pool.handle_type != "posix_fd":
        raise invalid(call, f"{buffer.describe()} comes from {buffer.pool.describe()}, which was not made "
                            f"shareable (handle_type='posix_fd')")
    out = ffi.new("CUmemPoolPtrExportData *")
    buffer.driver.check(buffer.context.call_current(buffer.driver.cuMemPoolExportPointer, out, buffer.address), call)
    return IpcPoolPointer(bytes(ffi.buffer(out)), buffer.nbytes, os.getpid(), buffer.context.device.ordinal)


class PoolBuffer(DeviceArrayExports, Allocation):
    """Memory of another process's shareable pool, imported here (cuMemPoolImportPointer).  Holds the imported
    pool; ``close()`` gives it back with cuMemFree, as the driver documents for imported pool memory (the
    exporter's own free must come after every importer's).  Usable wherever a DeviceBuffer is."""

    __slots__ = ("pool", "handle", "last_stream", "device_ordinal")
    _release_call = "cuMemFree"
    _ended_word = "closed"
    typestr = "|u1"

    pool: MemoryPool
    handle: IpcPoolPointer
    last_stream: Stream | int | None

    def __init__(self, pool: MemoryPool, handle: IpcPoolPointer, *, context: Context | None = None,
                 driver: Driver | None = None) -> None:
        call = "cuMemPoolImportPointer"
        if hasattr(self, "driver"):
            raise invalid(call, "PoolBuffer.__init__ was called twice; the first import would never be given back")
        if not isinstance(pool, MemoryPool) or not isinstance(handle, IpcPoolPointer):
            raise invalid(call, "import_pointer takes the imported MemoryPool (import_pool) and an IpcPoolPointer")
        handle._refuse_own_process()
        pool.check(call)
        ctx, run = Context.target(context, call, driver=driver if driver is not None else pool.driver)
        drv = ctx.driver
        data = ffi.new("CUmemPoolPtrExportData *")
        ffi.memmove(data, handle.handle, _DRIVER_BYTES)
        out = ffi.new("CUdeviceptr *")
        rc = run(drv.cuMemPoolImportPointer, out, pool.handle, data)
        if rc:
            raise _opened(drv, rc, call, "this pool pointer (on the pool import_pool made of its exporter's pool)")
        self.driver, self.ended, self.context, self.pool = drv, None, ctx, pool
        self.address, self.nbytes, self.handle = int(out[0]), handle.nbytes, handle
        self.device_ordinal = handle.device_ordinal
        self.last_stream = None

    def parents(self) -> tuple[Resource, ...]:
        return (self.context, self.pool)

    def _release(self) -> int:
        return self.context.call(self.driver.cuMemFree, self.address)

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]  # (DeviceArrayExports declares the attribute)
        return (self.nbytes,)

    def view(self, dtype: Any, shape: tuple[int, ...] | int | None = None) -> DeviceView:
        return DeviceView(self, dtype, shape)   # type: ignore[arg-type]

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.context.device.ordinal)


def import_pointer(pool: MemoryPool, handle: IpcPoolPointer | bytes, *, context: Context | None = None) -> PoolBuffer:
    """Import another process's pool allocation (its :func:`export_pointer`) from ``pool``, the import of its
    pool (:func:`import_pool`)."""
    value = IpcPoolPointer.from_bytes(handle) if isinstance(handle, (bytes, bytearray, memoryview)) else handle
    return PoolBuffer(pool, value, context=context)


__all__ = ["IpcBuffer", "IpcEvent", "IpcEventHandle", "IpcMemoryHandle", "IpcPoolPointer", "PoolBuffer",
           "export_event", "export_memory", "export_pointer", "export_pool", "import_pointer", "import_pool",
           "open_event", "open_memory"]
