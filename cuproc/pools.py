"""Memory pools for stream-ordered allocation (cuMemPool*).

Policy: a pool made by :meth:`MemoryPool.create` is owned (``close()``/drop
destroys it; the driver keeps its memory until outstanding allocations are
freed, and buffers allocated from it hold the pool).  A device's default pool
(:meth:`MemoryPool.default`) is not owned: ``close()`` leaves it alone.

A *shareable* pool (``handle_type="posix_fd"`` or ``"fabric"``) is exported once as it is made
(:meth:`MemoryPool.share`, cuMemPoolExportToShareableHandle), and keeps that export until it is
destroyed: the driver exports pointers only "from an already shared memory pool"
(cuMemPoolExportPointer's documentation) and answers CUDA_ERROR_INVALID_VALUE before that, so a pointer
can then be exported first and the pool sent afterwards, in whatever order the caller finds natural.
The handle types are checked here for pools and for VMM memory alike (:func:`shareable_handle_type`):
fabric handles only where the device reports CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED.
"""
from __future__ import annotations

import os
from typing import Any

from . import _fork
from ._ffi import ffi
from ._resource import Resource
from ._support import get_driver, handle_int, invalid
from .device import Device
from .driver import Driver
from .errors import CudaError, InvalidValueError, add_note, refusal, result_code

#: CU_MEM_HANDLE_TYPE_* by cuproc's name: what pools and VMM memory (cuproc.virtual_memory) are shared by
HANDLE_TYPES: dict[str | None, int] = {None: 0, "posix_fd": 1, "fabric": 8}
FABRIC_ATTRIBUTE = "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"
FABRIC_HANDLE_BYTES = 64                        # sizeof(CUmemFabricHandle)
_NOT_PERMITTED = result_code("CUDA_ERROR_NOT_PERMITTED")


def fabric_supported(device: Device) -> bool:
    """cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED); a driver too old to know the
    attribute (CUDA_ERROR_INVALID_VALUE) has no fabric handles either."""
    try:
        return bool(device.attribute(FABRIC_ATTRIBUTE))
    except InvalidValueError:
        return False


_SHARING = _fork.lock()     # one export per pool (share) when threads race to make it

#: Where the IMEX channels that fabric handles need appear (nvidia-imex makes them); tests point it elsewhere.
IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"


def imex_channel_available() -> bool:
    """Whether this process may open an IMEX channel (an entry of :data:`IMEX_CHANNELS` it can read and
    write): fabric handles need one.  Checked before the driver is asked, because driver 580 on an H200
    without a channel made a fabric pool, refused its export (CUDA_ERROR_NOT_PERMITTED), then corrupted its
    heap in cuMemPoolDestroy (the process aborted: "double free or corruption"; 2026-11-29)."""
    try:
        names = os.listdir(IMEX_CHANNELS)
    except OSError:
        return False
    return any(os.access(os.path.join(IMEX_CHANNELS, n), os.R_OK | os.W_OK) for n in names)


def shareable_handle_type(name: str | None, ordinal: int, driver: Driver, call: str) -> int:
    """The CU_MEM_HANDLE_TYPE_* of ``name`` (None, ``"posix_fd"`` or ``"fabric"``) for memory on device
    ``ordinal``.

    A fabric handle is refused where the device does not report it: the driver's own answer there
    (cuMemCreate / cuMemPoolCreate: CUDA_ERROR_NOT_SUPPORTED or INVALID_VALUE) does not say why."""
    if name not in HANDLE_TYPES:
        raise invalid(call, f"handle_type is 'posix_fd', 'fabric' or None, not {name!r}")
    if name == "fabric" and not fabric_supported(Device(ordinal, driver=driver)):
        raise refusal(call, f"device {ordinal} has no fabric handles ({FABRIC_ATTRIBUTE} is 0: they need an "
                            f"NVLink fabric with IMEX); share memory between processes of one machine with "
                            f"handle_type='posix_fd'", code_name="CUDA_ERROR_NOT_SUPPORTED")
    if name == "fabric" and not imex_channel_available():
        raise refusal(call, f"this process may open no IMEX channel ({IMEX_CHANNELS}/channel*), which fabric "
                            f"handles need (set up nvidia-imex and its channels, the same one in every process "
                            f"that shares); share memory between processes of one machine with "
                            f"handle_type='posix_fd'", code_name="CUDA_ERROR_NOT_PERMITTED")
    return HANDLE_TYPES[name]


def shareable_error(drv: Driver, rc: int, call: str, handle_type: str | None) -> CudaError:
    """The driver's error for ``call`` on shareable memory, with what to check for fabric handles (the
    process needs an IMEX channel: CUDA_ERROR_NOT_PERMITTED otherwise, as cuMemCreate documents)."""
    err = drv.error(rc, call)
    if handle_type == "fabric" and rc == _NOT_PERMITTED:
        add_note(err, "fabric handles need an IMEX channel this user may open (/dev/nvidia-caps-imex-channels/"
                      "channel*), the same one in the exporting and the importing process")
    return err


class MemoryPool(Resource):
    """A stream-ordered memory pool: :meth:`create` (owned) or :meth:`default` (the device's)."""

    _release_call = "cuMemPoolDestroy"
    _ended_word = "destroyed"
    _U64 = ("RELEASE_THRESHOLD", "RESERVED_MEM_CURRENT", "RESERVED_MEM_HIGH", "USED_MEM_CURRENT", "USED_MEM_HIGH")

    #: "posix_fd" or "fabric" for a pool other processes can import (create's handle_type, or an imported pool)
    handle_type: str | None = None
    #: the pool's own export (a descriptor it keeps open, or a fabric handle's bytes): see :meth:`share`
    shared: int | bytes | None = None
    #: made by cuMemPoolImportFromShareableHandle (cuproc.ipc.import_pool): another process's pool
    imported: bool = False

    def __init__(self, handle: Any, *, driver: Driver, owned: bool) -> None:
        self.handle, self.driver, self.owned, self.ended = handle, driver, owned, None

    @classmethod
    def create(cls, device: Device | int = 0, *, release_threshold: int | None = None,
               handle_type: str | None = None, driver: Driver | None = None) -> MemoryPool:
        """cuMemPoolCreate on ``device``.  ``handle_type="posix_fd"`` (or ``"fabric"``, where the device
        reports CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) makes the pool shareable with other
        processes (cuproc.ipc.export_pool, export_pointer), and exports it at once (:meth:`share`);
        None: this process only."""
        call = "cuMemPoolCreate"
        drv = get_driver(driver)
        ordinal = device.ordinal if isinstance(device, Device) else device
        props = ffi.new("CUmemPoolProps *")
        props.allocType = drv.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = shareable_handle_type(handle_type, ordinal, drv, call)
        props.location.type = drv.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = ordinal
        out = ffi.new("CUmemoryPool *")
        rc = drv.cuMemPoolCreate(out, props)
        if rc:
            raise shareable_error(drv, rc, call, handle_type)
        pool = cls(out[0], driver=drv, owned=True)
        pool.handle_type = handle_type
        try:
            if handle_type is not None:
                pool.share()
            if release_threshold is not None:
                pool.release_threshold = release_threshold
        except BaseException as exc:
            if handle_type == "fabric" and pool.shared is None:
                # Driver 580 corrupted its heap destroying a fabric pool whose export it had refused (the
                # process aborted): such a pool is left to the process's end, never destroyed.  Said as a
                # note on the error (a warning here could replace it, under -W error).
                pool._claim("left undestroyed: its fabric export failed")
                note = (f"{pool.describe()} was left undestroyed: its fabric export failed, and destroying such a "
                        "pool aborted the process on driver 580")
                add_note(exc, note)
            else:
                pool.close()
            raise
        return pool

    def export_handle(self) -> int | bytes:
        """cuMemPoolExportToShareableHandle in the pool's handle type: a new POSIX file descriptor the caller
        owns (``"posix_fd"``), or the 64 bytes of a CUmemFabricHandle (``"fabric"``)."""
        call = "cuMemPoolExportToShareableHandle"
        self.check(call)
        kind = HANDLE_TYPES.get(self.handle_type, 0)
        if not kind or self.imported:
            raise invalid(call, f"{self.describe()} was not made shareable here: make it with "
                                f"MemoryPool.create(device, handle_type='posix_fd') (an imported pool is "
                                f"exported by the process that made it)")
        out = ffi.new("CUmemFabricHandle *") if self.handle_type == "fabric" else ffi.new("int *")
        rc = self.driver.cuMemPoolExportToShareableHandle(out, self.handle, kind, 0)
        if rc:
            raise shareable_error(self.driver, rc, call, self.handle_type)
        return bytes(ffi.buffer(out)) if self.handle_type == "fabric" else int(out[0])  # type: ignore[index]

    def share(self) -> None:
        """Export the pool once and keep that export (:attr:`shared`) while the pool lives; idempotent.

        cuMemPoolExportPointer works only on a pool "already shared", as its documentation says (an H200 with
        driver 580 answered CUDA_ERROR_INVALID_VALUE to a pointer exported before the pool; the diagnostic in
        tests/test_gpu_ipc.py records the answer in each order), so :meth:`create` calls this for every
        shareable pool.  The descriptor is kept open rather than closed
        at once: the pool stays shared for as long as it lives, whatever the driver does once the last
        descriptor of a pool is closed."""
        with _SHARING:
            if self.shared is None:
                shared = self.export_handle()
                if isinstance(shared, int):
                    try:
                        os.set_inheritable(shared, False)   # kept by this process only: no child inherits it
                    except BaseException:
                        os.close(shared)
                        raise
                self.shared = shared

    @classmethod
    def default(cls, device: Device | int = 0, *, driver: Driver | None = None) -> MemoryPool:
        drv = get_driver(driver)
        dev = device if isinstance(device, Device) else Device(device, driver=drv)
        out = ffi.new("CUmemoryPool *")
        drv.checked.cuDeviceGetDefaultMemPool(out, dev.handle)
        return cls(out[0], driver=drv, owned=False)

    def describe(self) -> str:
        return f"memory pool {handle_int(self.handle):#x}"

    def _release(self) -> int:
        rc = self.driver.cuMemPoolDestroy(self.handle) if self.owned else 0
        if isinstance(self.shared, int):
            os.close(self.shared)      # the pool's own export (share): never given to anyone
        return rc

    def close(self) -> None:
        """Destroy an owned pool (idempotent); the default pool is not owned: no-op."""
        if self.owned:
            super().close()

    def destroy(self) -> None:
        """cuMemPoolDestroy of an owned pool (idempotent); refused for a device's default pool."""
        if not self.owned:
            raise invalid("cuMemPoolDestroy", "the device's default pool is not owned and cannot be destroyed")
        self.close()

    def _attr(self, name: str) -> tuple[int, str]:
        key = name if name.startswith("CU_MEMPOOL_ATTR_") else "CU_MEMPOOL_ATTR_" + name.upper()
        short = key[len("CU_MEMPOOL_ATTR_"):]
        return ffi.typeof("CUmemPool_attribute").relements[key], "cuuint64_t *" if short in self._U64 else "int *"

    def get_attribute(self, name: str) -> int:
        self.check("cuMemPoolGetAttribute")
        attr, ctype = self._attr(name)
        out = ffi.new(ctype)
        self.driver.checked.cuMemPoolGetAttribute(self.handle, attr, out)
        return int(out[0])

    def set_attribute(self, name: str, value: int) -> None:
        self.check("cuMemPoolSetAttribute")
        attr, ctype = self._attr(name)
        self.driver.checked.cuMemPoolSetAttribute(self.handle, attr, ffi.new(ctype, value))

    @property
    def release_threshold(self) -> int:
        return self.get_attribute("RELEASE_THRESHOLD")

    @release_threshold.setter
    def release_threshold(self, value: int) -> None:
        self.set_attribute("RELEASE_THRESHOLD", value)

    @property
    def used_bytes(self) -> int:
        """USED_MEM_CURRENT: bytes handed out and not yet freed."""
        return self.get_attribute("USED_MEM_CURRENT")

    def trim(self, min_bytes_to_keep: int = 0) -> None:
        self.check("cuMemPoolTrimTo")
        self.driver.checked.cuMemPoolTrimTo(self.handle, min_bytes_to_keep)


__all__ = ["FABRIC_ATTRIBUTE", "HANDLE_TYPES", "IMEX_CHANNELS", "MemoryPool", "fabric_supported",
           "imex_channel_available", "shareable_error", "shareable_handle_type"]
