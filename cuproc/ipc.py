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
  (:func:`import_pool`); ``handle_type="fabric"`` (where the device reports
  CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) exports 64 bytes instead, which travel like the handles
  above.  Each allocation then travels as an :class:`IpcPoolPointer` (:func:`export_pointer` /
  :func:`import_pointer`, cuMemPoolExportPointer / cuMemPoolImportPointer), a value like the handles
  above.  The driver exports pointers only of a pool already exported, so a shareable pool is exported
  as it is made (:meth:`MemoryPool.share`): pointers and the pool may be sent in either order.  An imported pool pointer (:class:`PoolBuffer`) holds its imported pool and
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
from .errors import CudaError, InvalidContextError, add_note, refusal, result_code
from .interop import LinearDeviceExports
from .pools import FABRIC_HANDLE_BYTES, HANDLE_TYPES, MemoryPool, shareable_error
from .stream import Event

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .stream import Stream

_MAGIC = b"cuproc-ipc\x01"
_MEMORY, _EVENT, _POOL_POINTER = 1, 2, 3
_HEADER = struct.Struct("<11sBQqI")            # magic, kind, nbytes, pid, device ordinal
_DRIVER_BYTES = 64                             # sizeof(CUipcMemHandle) == sizeof(CUipcEventHandle)
_LAZY_ENABLE_PEER_ACCESS = 1                   # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_INVALID_CONTEXT = result_code("CUDA_ERROR_INVALID_CONTEXT")


class _IpcHandle:
    """The driver's 64-byte handle and what an importer needs; immutable; pickles to its bytes."""

    __slots__ = ("handle", "nbytes", "pid", "device_ordinal")
    _kind = 0
    _call = ""
    _ctype = ""

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

    def __repr__(self) -> str:
        size = f" {self.nbytes} bytes" if self.nbytes else ""
        return f"<cuproc.{type(self).__name__}{size} on device {self.device_ordinal} of pid {self.pid}>"

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
    _ctype = "CUipcMemHandle"


class IpcEventHandle(_IpcHandle):
    """An exported interprocess event (cuIpcGetEventHandle): open it in another process with :func:`open_event`."""

    __slots__ = ()
    _kind = _EVENT
    _call = "cuIpcOpenEventHandle"
    _ctype = "CUipcEventHandle"


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


def _open_legacy(handle: Any, kind: type[IpcMemoryHandle | IpcEventHandle], out_type: str, context: Context | None,
                 driver: Driver | None, *flags: int) -> tuple[Driver, Context, Any]:
    """What opening either legacy handle takes: its kind checked and this process's own refused (before the
    driver), then cuIpcOpenMemHandle / cuIpcOpenEventHandle of its 64 bytes, by value, in the target
    context; (driver, context, what the call gave)."""
    call, what = kind._call, "memory" if kind is IpcMemoryHandle else "event"
    if not isinstance(handle, kind):
        raise invalid(call, f"open_{what} takes an {kind.__name__} ({kind.__name__}.from_bytes(data) reads sent "
                            f"bytes), not {type(handle).__name__}")
    handle._refuse_own_process()
    ctx, run = Context.target(context, call, driver=driver)
    drv = ctx.driver
    raw = ffi.new(f"{kind._ctype} *")
    ffi.memmove(raw, handle.handle, _DRIVER_BYTES)
    out = ffi.new(out_type)
    rc = run(getattr(drv, call), out, raw[0], *flags)
    if rc:
        raise _opened(drv, rc, call, f"this {what} handle")
    return drv, ctx, out[0]


def _opened(drv: Driver, rc: int, call: str, what: str) -> CudaError:
    """The driver's refusal of an import, with what to check."""
    err = drv.error(rc, call)
    if rc == _INVALID_CONTEXT:
        add_note(err, f"the driver answers this for {what} exported by this very process (bytes made elsewhere "
                      f"than export_*, or a forked child): open it in another process")
    else:
        add_note(err, f"check that {what} came unchanged from export_* in a process that is still running and "
                      f"still holds the exported object")
    return err


class _ImportedBuffer(LinearDeviceExports, Allocation):
    """What the two kinds of imported memory share: another process's bytes mapped in a context here, a 1-D
    uint8 array on that context's device (the importer's numbering of it), imported once per object."""

    __slots__ = ("handle", "last_stream")
    _ended_word = "closed"

    last_stream: Stream | int | None

    @property
    def device_ordinal(self) -> int:  # type: ignore[override]  # (LinearDeviceExports declares the attribute)
        """The device of the importing context, in this process's numbering (the exporter's may differ)."""
        return self.context.device.ordinal

    def _refuse_reuse(self, call: str) -> None:
        if hasattr(self, "driver"):
            raise invalid(call, f"{type(self).__name__}.__init__ was called twice; the first import would never be "
                                f"given back")

    def _imported(self, drv: Driver, ctx: Context, address: int, handle: _IpcHandle) -> None:
        self.driver, self.ended, self.context = drv, None, ctx
        self.address, self.nbytes, self.handle = address, handle.nbytes, handle
        self.last_stream = None

    def view(self, dtype: Any, shape: tuple[int, ...] | int | None = None) -> DeviceView:
        """A typed, shaped view (it holds this memory)."""
        return DeviceView(self, dtype, shape)   # type: ignore[arg-type]


class IpcBuffer(_ImportedBuffer):
    """Device memory another process exported, opened here (cuIpcOpenMemHandle).

    Closed with cuIpcCloseMemHandle (``close()``, a ``with`` block, the finalizer), never freed: the memory is
    the exporter's.  Usable wherever a DeviceBuffer is.  Pickles to its handle (unpickling opens it)."""

    __slots__ = ()
    _release_call = "cuIpcCloseMemHandle"

    handle: IpcMemoryHandle

    def __init__(self, handle: IpcMemoryHandle, *, context: Context | None = None, driver: Driver | None = None) -> None:
        self._refuse_reuse("cuIpcOpenMemHandle")
        drv, ctx, address = _open_legacy(handle, IpcMemoryHandle, "CUdeviceptr *", context, driver,
                                         _LAZY_ENABLE_PEER_ACCESS)
        self._imported(drv, ctx, int(address), handle)

    def _release(self) -> int:
        return self.context.call_current(self.driver.cuIpcCloseMemHandle, self.address)

    def free(self) -> None:
        """Refused: imported memory is closed (``close()``), never freed -- the exporter frees it."""
        raise invalid("cuMemFree", f"{self.describe()} is another process's memory: close() it "
                                   f"(cuIpcCloseMemHandle); the exporter frees it")

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
        drv, ctx, event = _open_legacy(handle, IpcEventHandle, "CUevent *", context, driver)
        self.driver = drv
        self.flags = drv.CU_EVENT_INTERPROCESS | drv.CU_EVENT_DISABLE_TIMING
        self.context = ctx
        self.handle = event
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

def export_pool(pool: MemoryPool) -> int | bytes:
    """cuMemPoolExportToShareableHandle of a pool made with ``MemoryPool.create(..., handle_type=...)``.

    ``"posix_fd"``: a new POSIX file descriptor the caller owns (send it over a Unix socket --
    ``multiprocessing.reduction``'s ``send_handle`` -- or let a child inherit it, then ``os.close`` it).
    ``"fabric"``: the 64 bytes of a CUmemFabricHandle, sent through any channel.  Either may come before or
    after :func:`export_pointer` of the pool's allocations (the pool was exported as it was made)."""
    call = "cuMemPoolExportToShareableHandle"
    if not isinstance(pool, MemoryPool):
        raise invalid(call, f"export_pool takes a cuproc MemoryPool, not {type(pool).__name__}")
    return pool.export_handle()


def import_pool(handle: int | bytes, *, driver: Driver | None = None) -> MemoryPool:
    """cuMemPoolImportFromShareableHandle of what another process's :func:`export_pool` gave: a descriptor
    (an int; the caller keeps it) or a fabric handle's 64 bytes.  The pool is owned here (``close()``
    destroys this process's import, cuMemPoolDestroy); import pointers of it with :func:`import_pointer`."""
    call = "cuMemPoolImportFromShareableHandle"
    if isinstance(handle, (bytes, bytearray, memoryview)) and len(handle) == FABRIC_HANDLE_BYTES:
        kind, os_handle = "fabric", ffi.new("CUmemFabricHandle *")
        ffi.memmove(os_handle, bytes(handle), FABRIC_HANDLE_BYTES)
    elif handle.__class__ is int and handle >= 0:   # type: ignore[operator]
        kind, os_handle = "posix_fd", ffi.cast("void *", handle)
    else:
        raise invalid(call, f"import_pool takes a file descriptor (an int >= 0) or a fabric handle's "
                            f"{FABRIC_HANDLE_BYTES} bytes, as export_pool gave them; got {handle!r:.80}")
    drv = get_driver(driver)
    out = ffi.new("CUmemoryPool *")
    rc = drv.cuMemPoolImportFromShareableHandle(out, os_handle, HANDLE_TYPES[kind], 0)
    if rc:
        err = shareable_error(drv, rc, call, kind)
        add_note(err, "the handle must be one that export_pool gave in another, running process (a pool is "
                      "not imported into the process that made it: use the pool itself there)")
        raise err
    pool = MemoryPool(out[0], driver=drv, owned=True)
    pool.handle_type, pool.imported = kind, True
    return pool


class IpcPoolPointer(_IpcHandle):
    """An allocation of a shareable pool exported by :func:`export_pointer` (cuMemPoolExportPointer): open
    it with :func:`import_pointer` on the pool imported in the other process."""

    __slots__ = ()
    _kind = _POOL_POINTER
    _call = "cuMemPoolImportPointer"


def export_pointer(buffer: DeviceBuffer) -> IpcPoolPointer:
    """cuMemPoolExportPointer of a buffer allocated from a shareable pool (``alloc_async(n, stream,
    pool=pool)``).  The importers must give it back before this process frees it, and must not touch it
    before the allocation is done on its stream (synchronize it, or send an IPC event recorded after it)."""
    call = "cuMemPoolExportPointer"
    if not isinstance(buffer, DeviceBuffer) or buffer.pool is None:
        raise invalid(call, "export_pointer takes a DeviceBuffer allocated from a shareable pool "
                            "(alloc_async(n, stream, pool=MemoryPool.create(..., handle_type='posix_fd')))")
    buffer.check(call)
    pool = buffer.pool
    if pool.handle_type is None or pool.imported:
        raise invalid(call, f"{buffer.describe()} comes from {pool.describe()}, which was not made "
                            f"shareable (handle_type='posix_fd' or 'fabric')")
    pool.share()                  # the driver exports pointers only of a pool already exported
    out = ffi.new("CUmemPoolPtrExportData *")
    buffer.driver.check(buffer.context.call_current(buffer.driver.cuMemPoolExportPointer, out, buffer.address), call)
    return IpcPoolPointer(bytes(ffi.buffer(out)), buffer.nbytes, os.getpid(), buffer.context.device.ordinal)


class PoolBuffer(_ImportedBuffer):
    """Memory of another process's shareable pool, imported here (cuMemPoolImportPointer).  Holds the imported
    pool; ``close()`` gives it back with cuMemFree, as the driver documents for imported pool memory (the
    exporter's own free must come after every importer's).  Usable wherever a DeviceBuffer is."""

    __slots__ = ("pool",)
    _release_call = "cuMemFree"

    pool: MemoryPool
    handle: IpcPoolPointer

    def __init__(self, pool: MemoryPool, handle: IpcPoolPointer, *, context: Context | None = None,
                 driver: Driver | None = None) -> None:
        call = "cuMemPoolImportPointer"
        self._refuse_reuse(call)
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
        self.pool = pool
        self._imported(drv, ctx, int(out[0]), handle)

    def parents(self) -> tuple[Resource, ...]:
        return (self.context, self.pool)

    def _release(self) -> int:
        return self.context.call(self.driver.cuMemFree, self.address)


def import_pointer(pool: MemoryPool, handle: IpcPoolPointer | bytes, *, context: Context | None = None) -> PoolBuffer:
    """Import another process's pool allocation (its :func:`export_pointer`) from ``pool``, the import of its
    pool (:func:`import_pool`)."""
    value = IpcPoolPointer.from_bytes(handle) if isinstance(handle, (bytes, bytearray, memoryview)) else handle
    return PoolBuffer(pool, value, context=context)


__all__ = ["IpcBuffer", "IpcEvent", "IpcEventHandle", "IpcMemoryHandle", "IpcPoolPointer", "PoolBuffer",
           "export_event", "export_memory", "export_pointer", "export_pool", "import_pointer", "import_pool",
           "open_event", "open_memory"]
