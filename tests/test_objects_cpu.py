"""Object-layer logic that needs no driver: size and bounds checks, typestrs, DLPack capsules."""
import gc

import numpy as np
import pytest

from cuproc import _dlpack
from cuproc import interop
from cuproc import transfers as mem
from cuproc.errors import InvalidValueError


class HostExport:
    """Exports host memory through cuproc's capsule builder, so NumPy (a CPU consumer) can check it."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return _dlpack.to_capsule(self, self.arr.ctypes.data, self.arr.shape, self.arr.dtype.str, (1, 0))

    def __dlpack_device__(self):
        return (1, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint16, np.int64, np.complex64, np.bool_])
def test_dlpack_capsule_is_read_correctly_and_shares_memory(dtype):
    src = (np.arange(24) % 2 == 0) if dtype is np.bool_ else np.arange(24).astype(dtype)
    src = src.reshape(2, 3, 4)
    before = len(_dlpack._live)
    view = np.from_dlpack(HostExport(src))
    assert view.shape == (2, 3, 4) and view.dtype == src.dtype
    np.testing.assert_array_equal(view, src)
    assert view.ctypes.data == src.ctypes.data            # same memory, no copy
    del view
    gc.collect()
    assert len(_dlpack._live) == before                    # the consumer called the deleter


def test_unconsumed_capsule_frees_its_tensor():
    before = len(_dlpack._live)
    capsule = HostExport(np.zeros(4)).__dlpack__()
    assert len(_dlpack._live) == before + 1
    del capsule                      # no destructor runs (cuproc._dlpack says why): the next sweep frees it
    gc.collect()
    _dlpack.sweep()
    assert len(_dlpack._live) == before


def test_size_checks():
    dst = mem._Side("device", 0x1000, 64, None, None)
    src = mem._Side("host", 0x2000, 128, None, None)
    assert mem._checked_size("cuMemcpy", None, dst, src) == 64
    for bad in (-1, 65, 1.5, True):
        with pytest.raises(InvalidValueError):
            mem._checked_size("cuMemcpy", bad, dst, src)
    raw = mem._Side("device", 0x1000, None, None, None)
    with pytest.raises(InvalidValueError, match="nbytes is needed"):
        mem._checked_size("cuMemcpy", None, raw, raw)


def test_host_sides_need_contiguous_and_writable_buffers():
    arr = np.zeros((4, 8), np.float32)
    side = mem._side(arr, "cuMemcpy", writable=True)
    assert side.kind == "host" and side.nbytes == arr.nbytes and side.ptr == arr.ctypes.data
    with pytest.raises(InvalidValueError, match="contiguous"):
        mem._side(arr[:, ::2], "cuMemcpy", writable=False)
    with pytest.raises(InvalidValueError, match="writable"):
        mem._side(b"abc", "cuMemcpy", writable=True)
    assert mem._side(b"abc", "cuMemcpy", writable=False).nbytes == 3


def test_cuda_array_interface_sides():
    class Fake:
        __cuda_array_interface__ = {"shape": (4, 5), "typestr": "<f8", "data": (0xABC000, False), "version": 3,
                                    "strides": None}

    side = mem._side(Fake(), "cuMemcpy", writable=True)
    assert (side.kind, side.ptr, side.nbytes) == ("device", 0xABC000, 160)
    Fake.__cuda_array_interface__ = dict(Fake.__cuda_array_interface__, strides=(80, 16))
    with pytest.raises(InvalidValueError, match="contiguous"):
        mem._side(Fake(), "cuMemcpy", writable=True)


def test_typestr():
    assert interop.typestr_of(np.float32) == ("<f4", 4)
    assert interop.typestr_of("<i8") == ("<i8", 8)
    assert interop.cai(0x10, (3,), "<f4", 1)["data"] == (0x10, False)
