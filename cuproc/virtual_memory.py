"""Virtual memory management: reserve addresses, create physical memory, map it, grant access, grow.

Policy
------
* **Three resources, one release each.**  :class:`PhysicalMemory` (cuMemCreate, given back by
  cuMemRelease), :class:`Reservation` (cuMemAddressReserve, given back by cuMemAddressFree) and
  :class:`Mapping` (cuMemMap, given back by cuMemUnmap).  A Mapping holds its Reservation and its
  PhysicalMemory, so neither can be collected under it.  The driver frees physical memory once it has
  no mapping and no unreleased handle, and frees a reservation only when it is given back with exactly
  the pointer and size it was reserved with -- so every reservation is its own object, and nothing here
  ever frees an address it did not reserve.
* **Any order of closing is safe.**  Closing a Reservation first unmaps its live mappings (their
  objects end as "unmapped"); releasing PhysicalMemory that is still mapped drops the handle only (the
  mapping keeps the memory, as the driver documents); closing a Mapping leaves both alone.
* **Contexts.**  Each object keeps the context that was current (or given) when it was made and makes
  its driver calls with that context current while it lives; a Mapping and a :class:`GrowableBuffer`
  also use it for copies, memsets and exports, like any allocation, and refuse use once it ended.  The
  memory itself is the device's, not the context's: destroying the context does not free it, so
  ``close()`` (and the finalizer) still give everything back afterwards.
* **Unmapping waits.**  Work queued on a range must be done before the range is unmapped (the GPU
  would fault on it): closing a Mapping or a GrowableBuffer, and moving a GrowableBuffer, first
  synchronize its context (cuCtxSynchronize), as cuMemFree does implicitly.  Work queued in *other*
  contexts on the memory is the caller's to finish first.
* **A growable buffer** (:class:`GrowableBuffer`) reserves addresses once and maps physical chunks as
  it grows: the address and the data stay put, with no copy.  When the reservation is full it asks for
  the addresses right after it (a second reservation, kept as such); when those are taken it reserves a
  larger range elsewhere and maps the *same* physical chunks there (the data still is not copied; the
  address changes) -- unless it was made with ``address="fixed"``, which refuses instead.  A grow that
  fails leaves the buffer exactly as it was: the old mappings, their access and their address are not
  touched until the new ones are complete, and everything the attempt made is given back.
* **Exportable memory.**  ``handle_type="posix_fd"`` makes physical memory exportable as a file descriptor
  (:meth:`PhysicalMemory.export_fd`); ``"fabric"`` as the 64 bytes of a CUmemFabricHandle
  (:meth:`PhysicalMemory.export_fabric`), only where the device reports
  CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED -- elsewhere it is refused, naming the attribute,
  before the driver is asked (:func:`cuproc.pools.shareable_handle_type`).
* Capability, not version: these calls exist from CUDA 10.2 on; the object layer asks
  ``driver.has(...)`` (:func:`supported`), never the version number.
"""
from __future__ import annotations

import weakref
from typing import Any, Literal

from . import _fork
from ._ffi import ffi
from ._resource import FORKED, Resource, report
from ._support import get_driver, invalid
from .allocation import Allocation
from .context import Context, synchronize_context
from .device import Device
from .device_memory import DeviceView
from .driver import Driver
from .errors import CudaError, InvalidValueError, add_note, refusal
from .interop import LinearDeviceExports
from .pools import FABRIC_HANDLE_BYTES, HANDLE_TYPES, shareable_error, shareable_handle_type

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from .stream import Stream

HandleType = Literal["posix_fd", "fabric"]
Access = Literal["none", "read", "readwrite"]
_ACCESS = {"none": 0, "read": 1, "readwrite": 3}                # CU_MEM_ACCESS_FLAGS_PROT_*
_ACCESS_NAMES = {v: k for k, v in _ACCESS.items()}
_GRANULARITY = {"minimum": 0, "recommended": 1}                 # CU_MEM_ALLOC_GRANULARITY_*
_CALLS = ("cuMemCreate", "cuMemRelease", "cuMemAddressReserve", "cuMemAddressFree", "cuMemMap", "cuMemUnmap",
          "cuMemSetAccess", "cuMemGetAllocationGranularity")


def supported(driver: Driver | None = None) -> bool:
    """Whether this driver handle has the virtual memory management calls (a capability question)."""
    drv = get_driver(driver)
    return all(drv.has(name) for name in _CALLS)


def _ordinal(device: Device | int | None, context: Context) -> int:
    if device is None:
        return context.device.ordinal
    return device.ordinal if isinstance(device, Device) else int(device)


def _placed(device: Device | int | None, context: Context, handle_type: str | None, call: str) -> tuple[int, int]:
    """The device ordinal (default: the context's) and the CU_MEM_HANDLE_TYPE_* checked for it."""
    ordinal = _ordinal(device, context)
    return ordinal, shareable_handle_type(handle_type, ordinal, context.driver, call)


def _properties(ordinal: int, handle_type: int) -> Any:
    """A CUmemAllocationProp for pinned device memory on ``ordinal`` (the handle's ABI: one layout, v1)."""
    prop = ffi.new("CUmemAllocationProp *")
    prop.type = 1                      # CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = handle_type
    prop.location.type = 1             # CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def _in(context: Context | None, function: Callable[..., int], *args: Any) -> int:
    """``function(*args)`` with ``context`` current while it lives; as is once it ended (VMM calls name
    their memory, not a context, and what was made must still go back)."""
    if context is not None and context.ended is None and not FORKED[0]:
        return context.call_current(function, *args)
    return function(*args)


def _context(context: Context | None, call: str, driver: Driver | None) -> Context:
    ctx, _ = Context.target(context, call, driver=driver)
    return ctx


def _round_up(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity


def _size(value: Any, call: str, what: str, *, zero: bool = False) -> int:
    if value.__class__ is not int or value < 0 or (value == 0 and not zero):
        raise invalid(call, f"{what} must be {'an int >= 0' if zero else 'a positive int'}, got {value!r}")
    return value


def granularity(device: Device | int | None = None, *, option: Literal["minimum", "recommended"] = "minimum",
                handle_type: HandleType | None = None, context: Context | None = None,
                driver: Driver | None = None) -> int:
    """cuMemGetAllocationGranularity: the unit of sizes, offsets and addresses for VMM memory on ``device``
    (default: the context's).  Every size given to :meth:`PhysicalMemory.create`, :meth:`Reservation.reserve`
    and :meth:`Reservation.map` must be a multiple of the ``"minimum"``; ``"recommended"`` is faster."""
    call = "cuMemGetAllocationGranularity"
    if option not in _GRANULARITY:
        raise invalid(call, f"option is 'minimum' or 'recommended', not {option!r}")
    ctx = _context(context, call, driver)
    prop = _properties(*_placed(device, ctx, handle_type, call))
    out = ffi.new("size_t *")
    drv = ctx.driver
    drv.check(_in(ctx, drv.cuMemGetAllocationGranularity, out, prop, _GRANULARITY[option]), call)
    return int(out[0])


def _check_multiple(call: str, granule: int, **values: int) -> None:
    for name, value in values.items():
        if value % granule:
            raise invalid(call, f"{name} ({value}) must be a multiple of the allocation granularity ({granule} "
                                f"bytes; cuproc.virtual_memory.granularity() gives it)")


class PhysicalMemory(Resource):
    """Physical device memory with no address (cuMemCreate), or imported from another process
    (cuMemImportFromShareableHandle).  Map it into a :class:`Reservation` to use it.

    ``close()``/``release()`` give the handle back (cuMemRelease); memory still mapped stays until its
    last mapping goes.  ``handle`` is the CUmemGenericAllocationHandle as an int."""

    __slots__ = ("handle", "nbytes", "device_ordinal", "handle_type", "imported", "context")
    _release_call = "cuMemRelease"
    _ended_word = "released"
    _leaf = True

    handle: int
    nbytes: int
    device_ordinal: int
    handle_type: str | None
    imported: bool
    context: Context

    def __init__(self, nbytes: int, device: Device | int | None = None, *, handle_type: HandleType | None = None,
                 context: Context | None = None, driver: Driver | None = None) -> None:
        """cuMemCreate of ``nbytes`` (a multiple of :func:`granularity`) on ``device`` (default: the
        context's); ``handle_type="posix_fd"`` makes it exportable (:meth:`export_fd`), ``"fabric"`` (where
        the device has fabric handles) by :meth:`export_fabric`."""
        call = "cuMemCreate"
        if hasattr(self, "driver"):
            raise invalid(call, "PhysicalMemory.__init__ was called twice; the first allocation would leak")
        _size(nbytes, call, "nbytes")
        ctx = _context(context, call, driver)
        drv = ctx.driver
        ordinal, kind = _placed(device, ctx, handle_type, call)
        out = ffi.new("CUmemGenericAllocationHandle *")
        rc = _in(ctx, drv.cuMemCreate, out, nbytes, _properties(ordinal, kind), 0)
        if rc:
            raise shareable_error(drv, rc, call, handle_type)
        self._start(drv, ctx, int(out[0]), nbytes, ordinal, handle_type, imported=False)

    def _start(self, drv: Driver, ctx: Context, handle: int, nbytes: int, ordinal: int, handle_type: str | None,
               *, imported: bool) -> None:
        self.driver, self.ended, self.context = drv, None, ctx
        self.handle, self.nbytes, self.device_ordinal = handle, nbytes, ordinal
        self.handle_type, self.imported = handle_type, imported

    @classmethod
    def import_fd(cls, fd: int, nbytes: int, *, context: Context | None = None,
                  driver: Driver | None = None) -> PhysicalMemory:
        """cuMemImportFromShareableHandle of a POSIX file descriptor another process exported
        (:meth:`export_fd`, sent over a Unix socket or inherited).  ``nbytes`` is the exporter's size (the
        descriptor does not carry it).  The caller keeps ``fd`` (close it when done); the imported handle is
        this object's, released by ``close()``."""
        if fd.__class__ is not int or fd < 0:
            raise invalid("cuMemImportFromShareableHandle", f"fd must be a file descriptor (an int >= 0), got {fd!r}")
        return cls._import(ffi.cast("void *", fd), "posix_fd", nbytes, context, driver)

    @classmethod
    def import_fabric(cls, data: bytes, nbytes: int, *, context: Context | None = None,
                      driver: Driver | None = None) -> PhysicalMemory:
        """cuMemImportFromShareableHandle of a fabric handle another process exported (:meth:`export_fabric`:
        64 bytes, sent through any channel).  ``nbytes`` is the exporter's size.  Needs an IMEX channel
        shared with the exporter (else the driver answers CUDA_ERROR_NOT_PERMITTED)."""
        if not isinstance(data, (bytes, bytearray)) or len(data) != FABRIC_HANDLE_BYTES:
            raise invalid("cuMemImportFromShareableHandle", f"a fabric handle is {FABRIC_HANDLE_BYTES} bytes (as "
                                                            f"export_fabric gave them), got {data!r:.80}")
        raw = ffi.new("CUmemFabricHandle *")
        ffi.memmove(raw, bytes(data), FABRIC_HANDLE_BYTES)
        return cls._import(raw, "fabric", nbytes, context, driver)

    @classmethod
    def _import(cls, os_handle: Any, handle_type: str, nbytes: int, context: Context | None,
                driver: Driver | None) -> PhysicalMemory:
        call = "cuMemImportFromShareableHandle"
        _size(nbytes, call, "nbytes")
        ctx = _context(context, call, driver)
        drv = ctx.driver
        out = ffi.new("CUmemGenericAllocationHandle *")
        rc = _in(ctx, drv.cuMemImportFromShareableHandle, out, os_handle, HANDLE_TYPES[handle_type])
        if rc:
            err = shareable_error(drv, rc, call, handle_type)
            method = "export_fd" if handle_type == "posix_fd" else "export_fabric"
            add_note(err, f"the handle must be one that cuMemExportToShareableHandle gave (PhysicalMemory.{method}) "
                          f"for memory made with handle_type={handle_type!r}, its memory not yet released")
            raise err
        mem = cls.__new__(cls)
        prop = ffi.new("CUmemAllocationProp *")
        rc = _in(ctx, drv.cuMemGetAllocationPropertiesFromHandle, prop, out[0])
        mem._start(drv, ctx, int(out[0]), nbytes, prop.location.id if rc == 0 else ctx.device.ordinal, handle_type,
                   imported=True)
        return mem

    def describe(self) -> str:
        origin = "imported " if self.imported else ""
        return f"{origin}PhysicalMemory {self.handle:#x} of {self.nbytes} bytes on device {self.device_ordinal}"

    def _release(self) -> int:
        return _in(self.context, self.driver.cuMemRelease, self.handle)

    def close(self) -> None:
        """cuMemRelease of this handle (idempotent).  Mapped memory stays until its last mapping goes."""
        if self.ended is None and FORKED[0]:
            self._claim("left behind by fork()")
            return
        if self.ended is None:
            self._give_back()     # the context is no parent: the memory is the device's

    release = close

    def _drop(self) -> int:
        self.ended = "dropped"
        return 0 if FORKED[0] else self._release()

    def export_fd(self) -> int:
        """cuMemExportToShareableHandle as a POSIX file descriptor: a new descriptor the caller owns (send
        it to another process, then ``os.close`` it).  Needs ``handle_type="posix_fd"`` at creation."""
        return int(self._export("posix_fd", ffi.new("int *"))[0])

    def export_fabric(self) -> bytes:
        """cuMemExportToShareableHandle as a fabric handle: 64 bytes to send through any channel (to a process
        on this machine or, over an NVLink fabric, another one).  Needs ``handle_type="fabric"`` at creation."""
        return bytes(ffi.buffer(self._export("fabric", ffi.new("CUmemFabricHandle *"))))

    def _export(self, handle_type: str, out: Any) -> Any:
        call = "cuMemExportToShareableHandle"
        self.check(call)
        if self.handle_type != handle_type:
            raise invalid(call, f"{self.describe()} was made with handle_type={self.handle_type!r}: it cannot be "
                                f"exported as {handle_type!r} (make it with PhysicalMemory(..., "
                                f"handle_type={handle_type!r}))")
        rc = _in(self.context, self.driver.cuMemExportToShareableHandle, out, self.handle, HANDLE_TYPES[handle_type], 0)
        if rc:
            raise shareable_error(self.driver, rc, call, handle_type)
        return out

    def __repr__(self) -> str:
        return f"<cuproc.{self.describe() if self.ended is None else 'PhysicalMemory ' + self.ended}>"


class Reservation(Resource):
    """A range of device addresses with nothing behind it yet (cuMemAddressReserve).

    ``close()`` unmaps whatever is still mapped in it, then gives the range back (cuMemAddressFree, with
    exactly the pointer and size reserved)."""

    __slots__ = ("address", "nbytes", "context", "_mappings")
    _release_call = "cuMemAddressFree"
    _ended_word = "freed"

    address: int
    nbytes: int
    context: Context

    def __init__(self, nbytes: int, *, alignment: int = 0, near: int = 0, context: Context | None = None,
                 driver: Driver | None = None) -> None:
        """cuMemAddressReserve of ``nbytes`` (a multiple of :func:`granularity`).  ``near``: an address the
        driver should use if it is free (a hint: :attr:`address` says where the range really is)."""
        call = "cuMemAddressReserve"
        if hasattr(self, "driver"):
            raise invalid(call, "Reservation.__init__ was called twice; the first range would leak")
        _size(nbytes, call, "nbytes")
        _size(alignment, call, "alignment", zero=True)
        _size(near, call, "near", zero=True)
        ctx = _context(context, call, driver)
        drv = ctx.driver
        out = ffi.new("CUdeviceptr *")
        drv.check(_in(ctx, drv.cuMemAddressReserve, out, nbytes, alignment, near, 0), call)
        self.driver, self.ended, self.context = drv, None, ctx
        self.address, self.nbytes = int(out[0]), nbytes
        self._mappings: weakref.WeakSet[Mapping] = weakref.WeakSet()

    @property
    def end(self) -> int:
        """The first address after the range."""
        return self.address + self.nbytes

    def describe(self) -> str:
        return f"Reservation of {self.nbytes} bytes at {self.address:#x}"

    def map(self, physical: PhysicalMemory, *, offset: int = 0, physical_offset: int = 0, nbytes: int | None = None,
            access: Access | None = "readwrite", devices: Iterable[Device | int] | None = None,
            context: Context | None = None) -> Mapping:
        """cuMemMap ``nbytes`` (default: all of ``physical`` from ``physical_offset``) of ``physical`` at
        ``offset`` into this range, then cuMemSetAccess for ``devices`` (default: the memory's device) --
        ``access=None`` leaves access to a later :meth:`Mapping.set_access` (until then the memory faults)."""
        return Mapping(self, physical, offset=offset, physical_offset=physical_offset, nbytes=nbytes, access=access,
                       devices=devices, context=context)

    def _release(self) -> int:
        return _in(self.context, self.driver.cuMemAddressFree, self.address, self.nbytes)

    def close(self) -> None:
        """Unmap what is still mapped here, then cuMemAddressFree (idempotent)."""
        if self.ended is not None:
            return
        if FORKED[0]:
            self._claim("left behind by fork()")
            return
        for mapping in sorted(self._mappings, key=lambda m: m.address):
            mapping.close()
        self._give_back()

    free = close

    def _drop(self) -> int:
        # Dropped: no Mapping holds it any more, so nothing is mapped in it through cuproc.
        self.ended = "dropped"
        return 0 if FORKED[0] else self._release()

    def __repr__(self) -> str:
        return f"<cuproc.Reservation {self.nbytes} bytes at {self.ended or hex(self.address)}>"


class _VirtualDeviceMemory(LinearDeviceExports, Allocation):
    """What mapped memory shares with a DeviceBuffer: a 1-D uint8 array for CAI, DLPack, copies, memsets
    and launches; typed views; released whatever became of its context."""

    __slots__ = ("last_stream", "device_ordinal")
    last_stream: Stream | int | None

    def view(self, dtype: Any, shape: tuple[int, ...] | int | None = None) -> DeviceView:
        """A typed, shaped view (it holds this memory)."""
        return DeviceView(self, dtype, shape)   # type: ignore[arg-type]

    def _settle(self) -> None:
        """Wait for the work queued in the context (before an unmap: the GPU would fault on a gone range)."""
        ctx = self.context
        if ctx.ended is None and not FORKED[0]:
            rc = synchronize_context(ctx)
            if rc:
                raise self.driver.error(rc, "cuCtxSynchronize")

    def close(self) -> None:
        """Give the memory back now (idempotent), even after its context ended: it is the device's.
        Refused with BufferError while DLPack exports of it exist."""
        if self.ended is not None:
            return
        if self.has_views():
            raise BufferError(f"{self._release_call} was not called: {self.describe()} still has views "
                              f"(a DLPack export); drop them first")
        if FORKED[0]:
            self._claim("left behind by fork()")
            return
        if self._gone_with_parent():
            self._claim(self._ended_word)
            return
        self._settle()
        self._give_back()

    def _gone_with_parent(self) -> bool:
        return False

    def _drop(self) -> int:
        self.ended = "dropped"
        if FORKED[0] or self._gone_with_parent():
            return 0
        return self._release()


class Mapping(_VirtualDeviceMemory):
    """Physical memory mapped at addresses of a reservation (cuMemMap): device memory once access is set.

    Holds its :class:`Reservation` and :class:`PhysicalMemory`.  ``close()`` unmaps it (cuMemUnmap) after
    waiting for its context's work; closing the reservation unmaps it too."""

    __slots__ = ("reservation", "physical", "physical_offset")
    _release_call = "cuMemUnmap"
    _ended_word = "unmapped"

    reservation: Reservation
    physical: PhysicalMemory
    physical_offset: int

    def __init__(self, reservation: Reservation, physical: PhysicalMemory, *, offset: int = 0,
                 physical_offset: int = 0, nbytes: int | None = None, access: Access | None = "readwrite",
                 devices: Iterable[Device | int] | None = None, context: Context | None = None) -> None:
        call = "cuMemMap"
        if hasattr(self, "driver"):
            raise invalid(call, "Mapping.__init__ was called twice; the first mapping would leak")
        if not isinstance(reservation, Reservation) or not isinstance(physical, PhysicalMemory):
            raise invalid(call, "map a PhysicalMemory into a Reservation (Reservation.map(physical))")
        reservation.check(call)
        physical.check(call)
        _size(offset, call, "offset", zero=True)
        _size(physical_offset, call, "physical_offset", zero=True)
        size = physical.nbytes - physical_offset if nbytes is None else _size(nbytes, call, "nbytes")
        if size <= 0 or physical_offset + size > physical.nbytes:
            raise invalid(call, f"mapping {size} bytes from offset {physical_offset} overruns {physical.describe()}")
        if offset + size > reservation.nbytes:
            raise invalid(call, f"mapping {size} bytes at offset {offset} overruns {reservation.describe()}")
        ctx = _context(context if context is not None else reservation.context, call, None)
        drv = ctx.driver
        address = reservation.address + offset
        drv.check(_in(ctx, drv.cuMemMap, address, size, physical_offset, physical.handle, 0), call)
        self.driver, self.ended, self.context = drv, None, ctx
        self.address, self.nbytes = address, size
        self.reservation, self.physical, self.physical_offset = reservation, physical, physical_offset
        self.device_ordinal = physical.device_ordinal
        self.last_stream = None
        reservation._mappings.add(self)
        if access is not None:
            try:
                self.set_access(access, devices)
            except BaseException:
                if self._claim("unmapped"):     # unmapped again: a failed map() leaves nothing behind
                    rc = self._release()
                    if rc:
                        report(f"unmapping {self.describe()} after cuMemSetAccess failed failed in turn: "
                               f"{self.driver.error(rc, 'cuMemUnmap')}")
                raise

    def parents(self) -> tuple[Resource, ...]:
        return (self.context, self.reservation)

    def _gone_with_parent(self) -> bool:
        return self.reservation.ended is not None   # the reservation's close unmapped it

    def describe(self) -> str:
        return f"Mapping of {self.nbytes} bytes at {self.address:#x}"

    def _release(self) -> int:
        return _in(self.context, self.driver.cuMemUnmap, self.address, self.nbytes)

    unmap = _VirtualDeviceMemory.close

    def set_access(self, access: Access = "readwrite", devices: Iterable[Device | int] | None = None) -> None:
        """cuMemSetAccess of the whole mapping for ``devices`` (default: the memory's own device)."""
        call = "cuMemSetAccess"
        self.check(call)
        _set_access(self.context, self.address, self.nbytes, access, devices, self.device_ordinal, call)

    def access(self, device: Device | int | None = None) -> str:
        """cuMemGetAccess: "none", "read" or "readwrite" for ``device`` (default: the memory's own)."""
        call = "cuMemGetAccess"
        self.check(call)
        location = ffi.new("CUmemLocation *")
        location.type = 1
        location.id = self.device_ordinal if device is None else _ordinal(device, self.context)
        out = ffi.new("unsigned long long *")
        self.driver.check(_in(self.context, self.driver.cuMemGetAccess, out, location, self.address), call)
        return _ACCESS_NAMES.get(int(out[0]), str(int(out[0])))


def _set_access(context: Context, address: int, nbytes: int, access: str, devices: Iterable[Device | int] | None,
                default: int, call: str) -> None:
    if access not in _ACCESS:
        raise invalid(call, f"access is 'none', 'read' or 'readwrite', not {access!r}")
    ordinals = [default] if devices is None else [d.ordinal if isinstance(d, Device) else int(d) for d in devices]
    if not ordinals:
        raise invalid(call, "devices is empty: name at least one device to give access to")
    desc = ffi.new("CUmemAccessDesc[]", len(ordinals))
    for entry, ordinal in zip(desc, ordinals):
        entry.location.type = 1
        entry.location.id = ordinal
        entry.flags = _ACCESS[access]
    drv = context.driver
    drv.check(_in(context, drv.cuMemSetAccess, address, nbytes, desc, len(ordinals)), call)


def _close_all(resources: Iterable[Resource]) -> int:
    """Close each (a failure does not stop the others); the first failure's CUresult, the rest as warnings."""
    first = 0
    for resource in resources:
        try:
            resource.close()
        except CudaError as exc:
            if first:
                report(f"closing {resource.describe()} failed: {exc}")
            else:
                first = exc.code
    return first


class GrowableBuffer(_VirtualDeviceMemory):
    """Device memory that grows in place: addresses reserved once, physical chunks mapped as it grows.

    Usable wherever a DeviceBuffer is (copies, memsets, launches, CAI, DLPack).  ``nbytes`` is the usable
    size; :attr:`mapped_bytes` the physical memory behind it (``nbytes`` rounded up to the granularity);
    :attr:`capacity` the addresses reserved.  See the module docstring for how :meth:`grow` keeps the
    address and the data, and what it does when the reservation is full.
    """

    __slots__ = ("granularity", "handle_type", "address_policy", "peers", "_reservations", "_chunks", "_lock")
    _release_call = "cuMemUnmap"

    granularity: int
    handle_type: str | None
    address_policy: str
    peers: tuple[int, ...]
    _reservations: list[Reservation]
    _chunks: list[Mapping]

    def __init__(self, nbytes: int, *, reserve: int = 0, address: Literal["may_move", "fixed"] = "may_move",
                 handle_type: HandleType | None = None, peers: Sequence[Device | int] = (),
                 context: Context | None = None, driver: Driver | None = None) -> None:
        """``nbytes`` usable now; ``reserve``: the addresses to reserve up front (at least ``nbytes``; rounded up
        to the granularity).  ``address="fixed"``: a grow past the reservation may only extend it where it
        is (else it is refused), never move the buffer.  ``handle_type="posix_fd"`` makes the chunks
        exportable (:attr:`chunks`; ``"fabric"`` where the device has fabric handles).  ``peers``: other devices given read-write access too."""
        call = "GrowableBuffer"
        if hasattr(self, "driver"):
            raise invalid(call, "GrowableBuffer.__init__ was called twice; the first buffer would leak")
        _size(nbytes, call, "nbytes", zero=True)
        _size(reserve, call, "reserve", zero=True)
        if address not in ("may_move", "fixed"):
            raise invalid(call, f"address is 'may_move' or 'fixed', not {address!r}")
        ctx = _context(context, "cuMemAddressReserve", driver)
        ordinal = ctx.device.ordinal
        granule = granularity(ordinal, handle_type=handle_type, context=ctx)
        self.driver, self.ended, self.context = ctx.driver, None, ctx
        self.device_ordinal, self.granularity, self.handle_type = ordinal, granule, handle_type
        self.address_policy = address
        self.peers = tuple(o for o in (p.ordinal if isinstance(p, Device) else int(p) for p in peers) if o != ordinal)
        self.last_stream = None
        self._lock = _fork.lock()
        self._reservations, self._chunks = [], []
        self.nbytes = 0
        first = Reservation(_round_up(max(nbytes, reserve, 1), granule), alignment=granule, context=ctx)
        self.address = first.address
        self._reservations = [first]
        try:
            self._grow(nbytes, "GrowableBuffer")
        except BaseException:
            self.ended = "freed"      # (nothing is mapped: the failed grow gave back what it made)
            first.close()
            raise

    # ------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        """Bytes of addresses reserved from :attr:`address` on (the buffer grows in place up to here)."""
        return sum(r.nbytes for r in self._reservations)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of physical memory mapped (``nbytes`` rounded up to the granularity)."""
        return sum(m.nbytes for m in self._chunks)

    @property
    def chunks(self) -> tuple[PhysicalMemory, ...]:
        """The physical chunks in address order (export each with :meth:`PhysicalMemory.export_fd`)."""
        return tuple(m.physical for m in self._chunks)

    @property
    def mappings(self) -> tuple[Mapping, ...]:
        """The mappings of the chunks, in address order (their access, their addresses)."""
        return tuple(self._chunks)

    @property
    def reservations(self) -> tuple[Reservation, ...]:
        """The reservations the buffer's addresses lie in, in address order (one, until it was extended)."""
        return tuple(self._reservations)

    def describe(self) -> str:
        return f"GrowableBuffer of {self.nbytes} bytes at {self.address:#x}"

    # ------------------------------------------------------------ growing
    def grow(self, nbytes: int) -> None:
        """Make ``nbytes`` usable (at least the current size), keeping the data.  In place while the addresses
        after the buffer can be had; else moved to a larger reservation (the same physical memory mapped
        there, no copy) -- refused for ``address="fixed"``.  A failure leaves the buffer as it was."""
        call = "GrowableBuffer.grow"
        _size(nbytes, call, "nbytes", zero=True)
        with self._lock:
            self.check(call)
            if nbytes < self.nbytes:
                raise invalid(call, f"a GrowableBuffer only grows: {nbytes} bytes is less than its {self.nbytes}")
            self._grow(nbytes, call)

    def _grow(self, nbytes: int, call: str) -> None:
        need = _round_up(nbytes, self.granularity)
        have = self.mapped_bytes
        if need > have:
            extended = need > self.capacity and self._extend(need - self.capacity)
            if need > self.capacity and not extended:
                if self.address_policy == "fixed":
                    raise refusal(call, f"{self.describe()} cannot grow to {nbytes} bytes where it is: its "
                                        f"reservation ({self.capacity} bytes) is full and the addresses after it are "
                                        f"taken, and it was made with address='fixed' (reserve more up front, or "
                                        f"use address='may_move')", InvalidValueError)
                self._move(need)
            else:
                try:
                    self._chunks += self._map_new(have, need, self._reservations)
                except BaseException:
                    if extended:                      # the extension goes too: the buffer is as it was
                        self._reservations.pop().close()
                    raise
        self.nbytes = nbytes

    def _extend(self, extra: int) -> bool:
        """Reserve the ``extra`` bytes right after the buffer's addresses; True when they are now the buffer's.
        A reservation the driver placed elsewhere is the buffer's to give back (it reserved it) and is; a
        failed reserve made none, and nothing is freed."""
        end = self.address + self.capacity
        try:
            extension = Reservation(_round_up(extra, self.granularity), alignment=self.granularity, near=end,
                                    context=self.context)
        except CudaError:
            return False
        if extension.address != end:
            extension.close()
            return False
        self._reservations.append(extension)
        return True

    def _map_new(self, start: int, stop: int, reservations: Sequence[Reservation]) -> list[Mapping]:
        """New physical chunks mapped at offsets [start, stop) of ``reservations`` (contiguous from their first
        one's address), one chunk per reservation crossed, access granted.  On failure everything made here is
        given back and the error raised."""
        made: list[Mapping] = []
        base = reservations[0].address
        try:
            for res in reservations:
                lo, hi = max(start, res.address - base), min(stop, res.end - base)
                if lo >= hi:
                    continue
                physical = PhysicalMemory(hi - lo, self.device_ordinal, handle_type=self.handle_type,  # type: ignore[arg-type]
                                          context=self.context)
                try:
                    made.append(self._map(res, physical, lo - (res.address - base)))
                except BaseException:
                    physical.close()
                    raise
        except BaseException:
            _close_all([*reversed(made), *(m.physical for m in made)])
            raise
        return made

    def _map(self, reservation: Reservation, physical: PhysicalMemory, offset: int) -> Mapping:
        return Mapping(reservation, physical, offset=offset, devices=(self.device_ordinal, *self.peers),
                       context=self.context)

    def _move(self, need: int) -> None:
        """Map the same physical chunks into a new, larger reservation, add the missing ones, then let the old
        addresses go.  Until the new mappings are complete the old ones are untouched (a failure leaves the
        buffer as it was, access included)."""
        if self.has_views():
            raise BufferError(f"GrowableBuffer.grow: {self.describe()} must move to grow, and it has DLPack exports "
                              f"that would keep the old address; drop them first (or reserve more up front)")
        target = Reservation(_round_up(max(need, 2 * self.capacity), self.granularity), alignment=self.granularity,
                             context=self.context)
        remapped: list[Mapping] = []
        try:
            offset = 0
            for old in self._chunks:
                remapped.append(self._map(target, old.physical, offset))
                offset += old.nbytes
            added = self._map_new(offset, need, [target])
            self._settle()                    # work queued on the old addresses ends before they are unmapped
        except BaseException:
            _close_all([*reversed(remapped), target])
            raise
        old_chunks, old_reservations = self._chunks, self._reservations
        self._chunks, self._reservations = remapped + added, [target]
        self.address = target.address
        self.last_stream = None
        rc = _close_all([*reversed(old_chunks), *old_reservations])
        if rc:
            report(f"{self.describe()} moved, but giving back its old addresses failed: "
                   f"{self.driver.error(rc, 'cuMemUnmap')}")

    # ------------------------------------------------------------ release
    def _release(self) -> int:
        """Unmap every chunk, release every physical handle, free every reservation -- each its own
        resource's release, all attempted; the first failure's CUresult."""
        with self._lock:
            chunks, reservations = self._chunks, self._reservations
            return _close_all([*reversed(chunks), *(m.physical for m in chunks), *reversed(reservations)])

    def __repr__(self) -> str:
        state = self.ended or f"{self.address:#x}"
        return f"<cuproc.GrowableBuffer {self.nbytes} of {self.capacity} bytes at {state}>"


__all__ = ["GrowableBuffer", "Mapping", "PhysicalMemory", "Reservation", "granularity", "supported"]
