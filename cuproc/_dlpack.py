"""DLPack export: a ``dltensor`` capsule over memory a cuproc object owns.

The capsule and the tensor's deleter must be C function pointers; ctypes makes
both without a compiler.  The DLManagedTensor keeps the exporting object
alive until the consumer (or the capsule's destructor, if never consumed)
calls the deleter.
"""
from __future__ import annotations

import ctypes
from typing import Any

from . import _fork

_TYPE_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}  # kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_live: dict[int, tuple[Any, ...]] = {}   # address of the DLManagedTensor -> what it keeps alive
_lock = _fork.lock()   # fresh in a forked child
_CAPSULE_NAME = b"dltensor"

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# The destructor gets a capsule whose refcount is already zero: handle it as a raw pointer only
# (PYFUNCTYPE: these are C-API calls, made holding the GIL).
_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid = ctypes.cast(_PyCapsule_IsValid, ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p))
_PyCapsule_GetPointer = ctypes.cast(ctypes.pythonapi.PyCapsule_GetPointer,
                                    ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p))


@_Deleter
def _delete(managed: Any) -> None:
    with _lock:
        _live.pop(ctypes.addressof(managed.contents), None)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int) -> None:
    # Not consumed (still named "dltensor"): we own the tensor and must delete it.
    if _PyCapsule_IsValid(capsule, _CAPSULE_NAME):
        address = _PyCapsule_GetPointer(capsule, _CAPSULE_NAME)
        with _lock:
            _live.pop(address, None)


def to_capsule(owner: Any, ptr: int, shape: tuple[int, ...], typestr: str, device: tuple[int, int]) -> Any:
    """A DLPack capsule for C-contiguous memory at ``ptr`` (keeps ``owner`` alive)."""
    kind, bits = typestr[1], int(typestr[2:]) * 8
    if kind not in _TYPE_CODES or typestr[0] == ">":
        raise TypeError(f"DLPack cannot describe dtype {typestr!r}")
    managed = DLManagedTensor()
    shape_arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    t = managed.dl_tensor
    t.data = ptr
    t.device = DLDevice(*device)
    t.ndim = len(shape)
    t.dtype = DLDataType(_TYPE_CODES[kind], bits, 1)
    t.shape = shape_arr
    t.strides = None  # C-contiguous
    t.byte_offset = 0
    managed.deleter = _delete
    address = ctypes.addressof(managed)
    with _lock:
        _live[address] = (managed, shape_arr, owner)
    return _PyCapsule_New(address, _CAPSULE_NAME, ctypes.cast(_capsule_destructor, ctypes.c_void_p))
