"""DLPack in C terms: the tensor structs, the capsules, their deleters (export and import).

The structs are DLPack 1.x's (``dlpack.h``): ``DLManagedTensor`` for the legacy
``"dltensor"`` capsule and ``DLManagedTensorVersioned`` for ``"dltensor_versioned"``.
The tensor deleter must be a C function pointer; ctypes makes it without a compiler.
cuproc's capsules have no destructor (why: below).

Export: a managed tensor keeps its owner (the exporting object, and so the
allocation and its context) alive in :data:`_live` until the consumer calls the
deleter, exactly once -- or, for a capsule never consumed, until :func:`sweep`
finds it dropped.  While any such tensor of an allocation lives,
``id(allocation)`` is in :data:`EXPORTS` (explicit frees are refused then, see
:mod:`cuproc.allocation`).

Why a sweep and no capsule destructor: a destructor runs whenever the capsule
goes, also while an exception propagates (``(buf.__dlpack__(), 1/0)``, or a
consumer that refuses the device and drops the capsule with its error set).  A
destructor made by ctypes or cffi runs Python, which with an error pending turns
it into a SystemError (or crashed), and the export was never given back.  So
cuproc's capsules have no destructor -- dropping one runs nothing -- and keep a
reference here; an allocation's check for views (``has_views``, before a free
or the last release of its context) first sweeps: a capsule that nobody else
holds any more and that was never consumed gives its export back then (its
tensor's deleter runs), as does the next export.  Until then such a capsule keeps
its buffer alive.  A consumed capsule (renamed ``used_...``) is the consumer's:
it calls the deleter.

Import: :func:`consume` validates a capsule, renames it ``used_...`` (so its
producer's destructor leaves the tensor alone) and hands back what the tensor
says plus a function calling the producer's deleter at most once.
"""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any, Callable

from . import _fork
from ._immortal import keep_forever
from .allocation import EXPORTS, SWEEPS   # id(allocation) -> number of its live managed tensors

_TYPE_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}  # kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool
_TYPE_KINDS = {code: kind for kind, code in _TYPE_CODES.items()}
VERSION = (1, 0)                        # the DLPack version cuproc writes
FLAG_READ_ONLY = 1 << 0                 # DLPACK_FLAG_BITMASK_READ_ONLY
FLAG_IS_COPIED = 1 << 1                 # DLPACK_FLAG_BITMASK_IS_COPIED
# Capsule names: module constants, because a capsule keeps a pointer to its name's bytes.
LEGACY_NAME, VERSIONED_NAME = b"dltensor", b"dltensor_versioned"
_USED_NAMES = {LEGACY_NAME: b"used_dltensor", VERSIONED_NAME: b"used_dltensor_versioned"}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensor(ctypes.Structure):
    pass


class DLManagedTensorVersioned(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
_DeleterVersioned = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
_RawDeleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)     # calling a producer's deleter
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]
DLManagedTensorVersioned._fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                                     ("deleter", _DeleterVersioned), ("flags", ctypes.c_uint64),
                                     ("dl_tensor", DLTensor)]

_live: dict[int, tuple[Any, ...]] = {}   # address of a managed tensor -> (tensor, shape, owner, allocation key)
# address of a managed tensor -> (its capsule, the capsule's name): the exported capsules not yet consumed
# (see sweep)
_unconsumed: dict[int, tuple[Any, bytes]] = {}
# An object held the way an unconsumed capsule nobody else holds is (by one tuple in a dict): sweep compares
# a capsule's reference count with this one's, both read at that moment by the same function.
_ALONE: dict[int, tuple[Any, bytes]] = {0: (object(), b"")}
# Reentrant: the deleter and the sweep take it, and a garbage collection run while it is
# held can destroy a capsule on the same thread.  Fresh in a forked child.
_lock = _fork.rlock()

# Private prototypes: ctypes.pythonapi.PyCapsule_* are process-wide objects that any library may also
# configure (restype/argtypes); setting them here would change every other user's calls, and theirs ours.
def _capi(name: str, restype: Any, *argtypes: Any) -> Any:
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_PyCapsule_New = _capi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
# On a live capsule (import side), as Python objects.
_IsValid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_GetPointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
_SetName = _capi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)

# Interpreter exit: module teardown drops this module's globals, and a capsule left in a reference
# cycle is destroyed by the last garbage collection *after* that.  So the C callbacks and what they
# use must outlive the module: they bind it as default arguments, and the callbacks themselves (and
# _live, whose tensors the capsules point at) are made immortal below.  Once the interpreter is
# finalizing, a deleter frees nothing (the process is ending; its memory goes with it).


def _forget(address: int, _live: dict[int, tuple[Any, ...]] = _live, _exports: dict[int, int] = EXPORTS,
            _lock: Any = _lock, _finalizing: Callable[[], bool] = sys.is_finalizing,
            _unconsumed: dict[int, Any] = _unconsumed) -> None:
    if _finalizing():
        return
    with _lock:
        _unconsumed.pop(address, None)
        entry = _live.pop(address, None)
        if entry is not None and entry[3] is not None:
            left = _exports[entry[3]] - 1
            if left:
                _exports[entry[3]] = left
            else:
                del _exports[entry[3]]


@_Deleter
def _delete(managed: Any, _forget: Callable[[int], None] = _forget, _addressof: Any = ctypes.addressof) -> None:
    _forget(_addressof(managed.contents))


@_DeleterVersioned
def _delete_versioned(managed: Any, _forget: Callable[[int], None] = _forget,
                      _addressof: Any = ctypes.addressof) -> None:
    _forget(_addressof(managed.contents))


# _USED_NAMES too: PyCapsule_SetName keeps a pointer into its bytes, and a consumed foreign capsule
# (torch's, CuPy's) can outlive this module's teardown; its destructor then reads the name.
for _immortal in (_delete, _delete_versioned, _live, _USED_NAMES):
    keep_forever(_immortal)   # never freed: see above
del _immortal


def to_capsule(owner: Any, ptr: int, shape: tuple[int, ...], typestr: str, device: tuple[int, int], *,
               versioned: bool = False, copied: bool = False, readonly: bool = False,
               allocation: Any = None) -> Any:
    """A DLPack capsule for C-contiguous memory at ``ptr``, keeping ``owner`` alive until deleted.

    ``versioned`` makes a ``"dltensor_versioned"`` capsule (DLPack 1.x, with the read-only and
    is-copied flags), else a legacy ``"dltensor"`` one.  ``allocation`` is counted in :data:`EXPORTS`
    while the tensor lives (it must be alive as long as ``owner`` is)."""
    kind, bits = typestr[1], int(typestr[2:]) * 8
    if kind not in _TYPE_CODES or typestr[0] == ">":
        raise BufferError(f"DLPack cannot describe dtype {typestr!r}")
    managed: Any = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    shape_arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    t = managed.dl_tensor
    t.data = ptr
    t.device = DLDevice(*device)
    t.ndim = len(shape)
    t.dtype = DLDataType(_TYPE_CODES[kind], bits, 1)
    t.shape = shape_arr
    t.strides = None  # C-contiguous
    t.byte_offset = 0
    if versioned:
        managed.version = DLPackVersion(*VERSION)
        managed.flags = (FLAG_IS_COPIED if copied else 0) | (FLAG_READ_ONLY if readonly else 0)
        managed.deleter = _delete_versioned
    else:
        managed.deleter = _delete
    if _unconsumed:
        sweep()                 # what was dropped since: exporting in a loop keeps nothing behind
    address = ctypes.addressof(managed)
    key = id(allocation) if allocation is not None else None
    with _lock:
        _live[address] = (managed, shape_arr, owner, key)
        if key is not None:
            EXPORTS[key] = EXPORTS.get(key, 0) + 1
    name = VERSIONED_NAME if versioned else LEGACY_NAME
    capsule = _PyCapsule_New(address, name, None)   # no destructor: dropping it runs nothing (see the docstring)
    with _lock:
        _unconsumed[address] = (capsule, name)
    return capsule


def _references(table: dict[int, tuple[Any, bytes]], key: int) -> int:
    """The reference count of ``table[key]``'s object as this function sees it: :func:`sweep` reads a capsule's
    and :data:`_ALONE`'s through it, one after the other, so that both count the same references (the
    interpreter's own -- a frame, a tracer's view of its locals -- whatever the version)."""
    held = table[key][0]
    return sys.getrefcount(held)


def sweep() -> None:
    """Give back the exports of capsules dropped unconsumed (nobody but cuproc holds them: no more
    references than :data:`_ALONE`'s object has), and forget consumed ones (their consumer calls the
    deleter).  Runs no Python of anyone else's and needs no destructor."""
    with _lock:
        for address in list(_unconsumed):
            entry = _unconsumed.get(address)
            if entry is None:
                continue
            if not _IsValid(entry[0], entry[1]):
                del _unconsumed[address]              # consumed: the consumer calls the deleter
            elif _references(_unconsumed, address) <= _references(_ALONE, 0):
                del _unconsumed[address]              # nobody else holds it: the tensor's deleter, as DLPack says
                struct = DLManagedTensorVersioned if entry[1] == VERSIONED_NAME else DLManagedTensor
                deleter = ctypes.cast(struct.from_address(address).deleter, ctypes.c_void_p).value
                if deleter:
                    _RawDeleter(deleter)(address)
            del entry


SWEEPS.append(sweep)


class Imported:
    """What a consumed capsule's tensor says, and the way to give it back (:meth:`release`, once)."""

    __slots__ = ("ptr", "shape", "typestr", "device", "readonly", "_deleter", "_address", "_lock")

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, device: tuple[int, int], readonly: bool,
                 deleter: Callable[[int], None] | None, address: int) -> None:
        self.ptr, self.shape, self.typestr, self.device, self.readonly = ptr, shape, typestr, device, readonly
        self._deleter, self._address, self._lock = deleter, address, threading.Lock()

    def release(self) -> None:
        """Call the producer's deleter; later calls do nothing."""
        with self._lock:
            deleter, self._deleter = self._deleter, None
        if deleter is not None:
            deleter(self._address)


def c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], unit: int) -> bool:
    """True when ``strides`` (in multiples of ``unit``: 1 for DLPack's elements, the item size for
    CAI's bytes) lay ``shape`` out C-contiguously; a dimension of extent 1 may have any stride."""
    expected = unit
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim > 1 and stride != expected:
            return False
        expected *= dim
    return True


def consume(capsule: Any) -> Imported:
    """Take the tensor out of a DLPack capsule (versioned or legacy) and mark the capsule used.

    Refused (BufferError, the capsule left untouched so its producer frees it) for a capsule already
    consumed, a DLPack major version above 1, vector lanes, an unknown dtype or non-C-contiguous strides."""
    if type(capsule).__name__ != "PyCapsule":
        raise TypeError(f"expected a DLPack capsule, got {type(capsule).__name__}")
    versioned = bool(_IsValid(capsule, VERSIONED_NAME))
    if not versioned and not _IsValid(capsule, LEGACY_NAME):
        raise BufferError("this capsule is not an unconsumed DLPack tensor (a DLPack capsule can be consumed once)")
    name = VERSIONED_NAME if versioned else LEGACY_NAME
    address = _GetPointer(capsule, name)
    readonly = False
    if versioned:
        managed: Any = DLManagedTensorVersioned.from_address(address)
        if managed.version.major > VERSION[0]:
            raise BufferError(f"the tensor is DLPack {managed.version.major}.{managed.version.minor}; cuproc reads "
                              f"DLPack {VERSION[0]}.x")
        readonly = bool(managed.flags & FLAG_READ_ONLY)
    else:
        managed = DLManagedTensor.from_address(address)
    t = managed.dl_tensor
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    if lanes != 1 or code not in _TYPE_KINDS or bits % 8 or not bits:
        raise BufferError(f"cuproc cannot view DLPack dtype (code {code}, {bits} bits, {lanes} lanes)")
    itemsize = bits // 8
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides and not c_contiguous(shape, tuple(t.strides[i] for i in range(t.ndim)), 1):
        raise BufferError(f"the DLPack tensor (shape {shape}) is not C-contiguous; cuproc views only "
                          "C-contiguous memory (make a contiguous copy first)")
    typestr = ("|" if itemsize == 1 else "<") + _TYPE_KINDS[code] + str(itemsize)
    raw = ctypes.cast(managed.deleter, ctypes.c_void_p).value
    deleter = _RawDeleter(raw) if raw else None
    imported = Imported((t.data or 0) + t.byte_offset, shape, typestr, (t.device.device_type, t.device.device_id),
                        readonly, deleter, address)
    if _SetName(capsule, _USED_NAMES[name]):
        raise BufferError("the DLPack capsule could not be marked consumed")
    return imported


__all__ = ["DLManagedTensor", "DLManagedTensorVersioned", "DLTensor", "Imported", "EXPORTS", "VERSION",
           "c_contiguous", "consume", "to_capsule"]
