"""Devices: enumeration, identity, attributes and whether peers can access each other (cuDevice*).

A :class:`Device` is a value (an ordinal on one driver handle); it owns
nothing, and knows nothing of contexts: this module sits below :mod:`cuproc.context`.  A device's
primary context is ``cuproc.PrimaryContext(device)`` (or ``cuproc.use_device(ordinal)``, retained and
current).  Peer access is state of two contexts, not of devices:
:meth:`cuproc.context.Context.enable_peer_access`; whether two devices can at all is
:meth:`Device.can_access_peer`.
"""
from __future__ import annotations

from ._ffi import ffi
from ._support import get_driver
from .driver import Driver

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import Any

_ATTR_PREFIX = "CU_DEVICE_ATTRIBUTE_"
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705


class Device:
    """One CUDA device, by ordinal."""

    def __init__(self, ordinal: int = 0, *, driver: Driver | None = None) -> None:
        self.driver = drv = get_driver(driver)
        out = ffi.new("CUdevice *")
        drv.checked.cuDeviceGet(out, ordinal)
        self.ordinal = ordinal
        self.handle = out[0]

    @classmethod
    def count(cls, *, driver: Driver | None = None) -> int:
        out = ffi.new("int *")
        get_driver(driver).checked.cuDeviceGetCount(out)
        return out[0]

    @classmethod
    def all(cls, *, driver: Driver | None = None) -> list[Device]:
        return [cls(i, driver=driver) for i in range(cls.count(driver=driver))]

    @classmethod
    def from_pci_bus_id(cls, bus_id: str, *, driver: Driver | None = None) -> Device:
        """The device at ``bus_id`` ("0000:3b:00.0"), via cuDeviceGetByPCIBusId."""
        drv = get_driver(driver)
        out = ffi.new("CUdevice *")
        drv.checked.cuDeviceGetByPCIBusId(out, bus_id.encode())
        return cls(out[0], driver=drv)

    # ---------------------------------------------------------------- identity
    @property
    def name(self) -> str:
        buf = ffi.new("char[256]")
        self.driver.checked.cuDeviceGetName(buf, 256, self.handle)
        return ffi.string(buf).decode()

    @property
    def uuid(self) -> str:
        """The device UUID as NVIDIA tools print it (GPU-xxxxxxxx-...)."""
        out = ffi.new("CUuuid *")
        self.driver.checked.cuDeviceGetUuid(out, self.handle)
        h = bytes(ffi.buffer(out.bytes, 16)).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    @property
    def pci_bus_id(self) -> str:
        buf = ffi.new("char[64]")
        self.driver.checked.cuDeviceGetPCIBusId(buf, 64, self.handle)
        return ffi.string(buf).decode()

    @property
    def total_memory(self) -> int:
        out = ffi.new("size_t *")
        self.driver.checked.cuDeviceTotalMem(out, self.handle)
        return out[0]

    @property
    def compute_capability(self) -> tuple[int, int]:
        return (self.attribute("COMPUTE_CAPABILITY_MAJOR"), self.attribute("COMPUTE_CAPABILITY_MINOR"))

    # ---------------------------------------------------------------- attributes
    def attribute(self, attr: str | int) -> int:
        """One CUdevice_attribute, by enumerator (``"MULTIPROCESSOR_COUNT"`` or the full name) or value."""
        code: int
        if isinstance(attr, str):
            name = attr if attr.startswith(_ATTR_PREFIX) else _ATTR_PREFIX + attr.upper()
            try:
                code = ffi.typeof("CUdevice_attribute").relements[name]
            except KeyError:
                raise KeyError(f"no device attribute {name}") from None
        else:
            code = attr
        out = ffi.new("int *")
        self.driver.checked.cuDeviceGetAttribute(out, code, self.handle)
        return out[0]

    def attributes(self) -> dict[str, int]:
        """Every attribute this driver answers, by enumerator name without the prefix."""
        result = {}
        out = ffi.new("int *")
        fn = self.driver.cuDeviceGetAttribute
        for name, value in ffi.typeof("CUdevice_attribute").relements.items():
            if name.endswith("_MAX") or fn(out, value, self.handle) != 0:
                continue  # unknown to this driver, or an alias's duplicate
            result[name[len(_ATTR_PREFIX):]] = out[0]
        return result

    @property
    def multiprocessor_count(self) -> int:
        return self.attribute("MULTIPROCESSOR_COUNT")

    @property
    def max_threads_per_block(self) -> int:
        return self.attribute("MAX_THREADS_PER_BLOCK")

    @property
    def warp_size(self) -> int:
        return self.attribute("WARP_SIZE")

    # ---------------------------------------------------------------- peers
    def can_access_peer(self, peer: Device) -> bool:
        out = ffi.new("int *")
        self.driver.checked.cuDeviceCanAccessPeer(out, self.handle, peer.handle)
        return bool(out[0])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.handle == self.handle and other.driver is self.driver

    def __hash__(self) -> int:
        return hash(self.handle)

    def __repr__(self) -> str:
        return f"<cuproc.Device {self.ordinal}>"

    def __reduce__(self) -> Any:
        raise TypeError("a Device belongs to one process's driver handle; pass its ordinal instead")


__all__ = ["Device"]
