"""Memory, in one namespace: allocations, transfers, pools and queries.

The pieces live in modules by concern -- :mod:`cuproc.allocation` (the
lifetime every allocation shares), :mod:`cuproc.device_memory`,
:mod:`cuproc.host_memory`, :mod:`cuproc.pools`, :mod:`cuproc.transfers`,
:mod:`cuproc.interop` -- and are gathered here, because users think of them
together (``from cuproc import memory; memory.copy(d, a)``).  This module adds
the two queries, :func:`mem_info` and :func:`pointer_attributes`.
"""
from __future__ import annotations

from typing import Any

from ._ffi import ffi
from ._support import get_driver, handle_int
from .allocation import Allocation
from .context import Context
from .device_memory import DeviceBuffer, DeviceView, GlobalView, alloc_async
from .driver import Driver
from .host_memory import HostMemory, ManagedBuffer, PinnedBuffer, RegisteredHostMemory
from .interop import DLPackArray, from_dlpack
from .pools import MemoryPool
from .transfers import copy, copy_2d, copy_3d, memset, memset_2d

# --------------------------------------------------------------------------- queries

def mem_info(context: Context | None = None, *, driver: Driver | None = None) -> tuple[int, int]:
    """(free, total) bytes on the device of ``context`` (default: the current one), via cuMemGetInfo."""
    ctx = Context.given(context, "cuMemGetInfo") if context is not None else Context.require_current(
        "cuMemGetInfo", driver=driver)
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    ctx.run("cuMemGetInfo", free, total)
    return free[0], total[0]


_MEMORY_TYPES = {1: "host", 2: "device", 3: "array", 4: "unified"}


def pointer_attributes(ptr: Any, *, driver: Driver | None = None) -> dict[str, Any]:
    """Classify any address (cuPointerGetAttribute): memory type, device, context, managed, range.

    Memory the driver does not know (ordinary pageable host memory) gives
    ``{"memory_type": None}``.
    """
    drv = get_driver(driver)
    address = ptr.ptr if hasattr(ptr, "ptr") else int(ptr)   # a cuproc object checks itself here
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


__all__ = ["Allocation", "DLPackArray", "DeviceBuffer", "DeviceView", "GlobalView", "HostMemory", "ManagedBuffer",
           "MemoryPool", "PinnedBuffer", "RegisteredHostMemory", "alloc_async", "copy", "copy_2d", "copy_3d",
           "from_dlpack", "mem_info", "memset", "memset_2d", "pointer_attributes"]
