"""Memory pools for stream-ordered allocation (cuMemPool*).

Policy: a pool made by :meth:`MemoryPool.create` is owned (``close()``/drop
destroys it; the driver keeps its memory until outstanding allocations are
freed, and buffers allocated from it hold the pool).  A device's default pool
(:meth:`MemoryPool.default`) is not owned: ``close()`` leaves it alone.
"""
from __future__ import annotations

from typing import Any

from ._ffi import ffi
from ._resource import Resource
from ._support import get_driver, handle_int, invalid
from .device import Device
from .driver import Driver


class MemoryPool(Resource):
    """A stream-ordered memory pool: :meth:`create` (owned) or :meth:`default` (the device's)."""

    _release_call = "cuMemPoolDestroy"
    _ended_word = "destroyed"
    _U64 = ("RELEASE_THRESHOLD", "RESERVED_MEM_CURRENT", "RESERVED_MEM_HIGH", "USED_MEM_CURRENT", "USED_MEM_HIGH")

    #: "posix_fd" for a pool other processes can import (create's handle_type, or an imported pool)
    handle_type: str | None = None

    def __init__(self, handle: Any, *, driver: Driver, owned: bool) -> None:
        self.handle, self.driver, self.owned, self.ended = handle, driver, owned, None

    @classmethod
    def create(cls, device: Device | int = 0, *, release_threshold: int | None = None,
               handle_type: str | None = None, driver: Driver | None = None) -> MemoryPool:
        """cuMemPoolCreate on ``device``.  ``handle_type="posix_fd"`` makes the pool shareable with other
        processes (cuproc.ipc.export_pool, export_pointer); None: this process only."""
        if handle_type not in (None, "posix_fd"):
            raise invalid("cuMemPoolCreate", f"handle_type is 'posix_fd' or None, not {handle_type!r}")
        drv = get_driver(driver)
        ordinal = device.ordinal if isinstance(device, Device) else device
        props = ffi.new("CUmemPoolProps *")
        props.allocType = drv.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = drv.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if handle_type else 0
        props.location.type = drv.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = ordinal
        out = ffi.new("CUmemoryPool *")
        drv.checked.cuMemPoolCreate(out, props)
        pool = cls(out[0], driver=drv, owned=True)
        pool.handle_type = handle_type
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

    def describe(self) -> str:
        return f"memory pool {handle_int(self.handle):#x}"

    def _release(self) -> int:
        return self.driver.cuMemPoolDestroy(self.handle) if self.owned else 0

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


__all__ = ["MemoryPool"]
