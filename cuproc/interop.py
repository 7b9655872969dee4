"""Array interfaces of device memory: ``__cuda_array_interface__`` (v3) and DLPack export.

Policy: an exporter hands out its address only after its own checks
(``ptr`` raises for freed memory or an ended context); the DLPack capsule
keeps the exporting object -- and so the allocation and its context -- alive
until the consumer's deleter runs (see :mod:`cuproc._dlpack`).
"""
from __future__ import annotations

from typing import Any

KDL_CUDA = 2  # DLPack device type of CUDA device memory


class DeviceArrayExports:
    """Mixin: CAI and DLPack from ``ptr``, ``shape``, ``typestr`` and ``__dlpack_device__``."""

    __slots__ = ()

    ptr: int
    shape: tuple[int, ...]
    typestr: str

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return cai(self.ptr, self.shape, self.typestr)

    def __dlpack__(self, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        from ._dlpack import to_capsule
        return to_capsule(self, self.ptr, self.shape, self.typestr, self.__dlpack_device__())

    def __dlpack_device__(self) -> tuple[int, int]:
        raise NotImplementedError


def cai(ptr: int, shape: tuple[int, ...], typestr: str) -> dict[str, Any]:
    """A v3 ``__cuda_array_interface__`` dict for C-contiguous memory."""
    return {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3, "strides": None,
            "stream": None}


def typestr_of(dtype: Any) -> tuple[str, int]:
    """(array-interface typestr, itemsize) for a NumPy dtype (or anything np.dtype takes) or a typestr."""
    if isinstance(dtype, str) and len(dtype) >= 3 and dtype[0] in "<>|=" and dtype[2:].isdigit():
        return dtype, int(dtype[2:])
    import numpy as np
    d = np.dtype(dtype)
    return d.str, d.itemsize


__all__ = ["DeviceArrayExports", "KDL_CUDA", "cai", "typestr_of"]
