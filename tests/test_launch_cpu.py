"""Argument packing without a GPU: layout rules, type inference, conventions."""
import struct

import numpy as np
import pytest

import cuproc
import cuproc.launch as L
from cuproc.errors import InvalidValueError

GUIDE = ["int", "float4", "char", "float", "CUdeviceptr", "float2"]


def test_guide_example_offsets_and_bytes():
    """Programming guide, Kernel Execution: int, float4, char, float, CUdeviceptr, float2."""
    offsets, size = L.layout([L.arg_type(s) for s in GUIDE])
    assert offsets == [0, 16, 32, 36, 40, 48] and size == 56
    data = L.pack_bytes(GUIDE, [7, (1.0, 2.0, 3.0, 4.0), 5, 6.5, 0xABCDEF, (8.0, 9.0)])
    assert struct.unpack_from("<i", data, 0)[0] == 7
    assert struct.unpack_from("<4f", data, 16) == (1.0, 2.0, 3.0, 4.0)
    assert struct.unpack_from("<b", data, 32)[0] == 5
    assert struct.unpack_from("<f", data, 36)[0] == 6.5
    assert struct.unpack_from("<Q", data, 40)[0] == 0xABCDEF
    assert struct.unpack_from("<2f", data, 48) == (8.0, 9.0)


def test_vector_alignments():
    assert L.arg_type("float2").align == 8 and L.arg_type("float4").align == 16
    assert L.arg_type("double2").size == 16 and L.arg_type("int4").align == 16


def test_python_numbers_need_a_signature():
    with pytest.raises(InvalidValueError, match="signature"):
        L.infer_type(1.5)
    with pytest.raises(InvalidValueError, match="signature"):
        L.infer_type(3)
    assert L.infer_type(np.float32(1.5)).ctype == "float"
    assert L.infer_type(np.float64(1.5)).ctype == "double"
    assert L.infer_type(np.int64(3)).ctype == "int64_t"


def test_float_signature_stores_a_float_not_a_double():
    data = L.pack_bytes(["float", "double"], [1.1, 1.1])
    assert struct.unpack_from("<f", data, 0)[0] == pytest.approx(np.float32(1.1))
    assert struct.unpack_from("<d", data, 8)[0] == 1.1


def test_structs_from_numpy_and_cffi():
    dt = np.dtype([("mass", "f8"), ("id", "i4"), ("pos", "f4", 3)], align=True)
    t = L.arg_type(dt)
    assert (t.size, t.align) == (dt.itemsize, 8) == (24, 8)
    rec = np.array((2.5, 7, (1, 2, 3)), dtype=dt)[()]
    data = L.pack_bytes([dt], [rec])
    assert data == rec.tobytes()
    loc = cuproc.ffi.new("CUmemLocation *")
    loc.type, loc.id = 1, 5
    assert L.pack_bytes([cuproc.ffi.typeof("CUmemLocation")], [loc[0]]) == struct.pack("<ii", 1, 5)


def test_pointers_from_buffers_and_interfaces():
    class Fake:
        __cuda_array_interface__ = {"data": (0x7000, False), "shape": (1,), "typestr": "<f4", "version": 3}

    assert L.infer_type(Fake()).kind == "pointer"
    assert struct.unpack("<Q", L.pack_bytes(["float*"], [Fake()]))[0] == 0x7000
    with pytest.raises(InvalidValueError, match="device pointer"):
        L.pack_bytes(["float*"], ["nope"])


def test_argument_count_and_bad_dims():
    packed = L.PackedArgs([L.arg_type("int")])
    with pytest.raises(InvalidValueError, match="takes 1"):
        packed.fill([1, 2])
    with pytest.raises(InvalidValueError):
        L._dims((0, 1), "grid", "cuLaunchKernel")
    assert L._dims(5, "grid", "cuLaunchKernel") == (5, 1, 1) and L._dims((2, 3), "block", "cuLaunchKernel") == (2, 3, 1)


def test_both_conventions_point_at_the_same_block():
    packed = L.PackedArgs([L.arg_type(s) for s in GUIDE])
    for ptr, off in zip(packed.params, packed.offsets):
        assert int(cuproc.ffi.cast("uintptr_t", ptr)) == int(cuproc.ffi.cast("uintptr_t", packed.block)) + off
    extra = packed.extra
    consts = cuproc.driver.constants()
    assert extra[0] == consts["CU_LAUNCH_PARAM_BUFFER_POINTER"] and extra[2] == consts["CU_LAUNCH_PARAM_BUFFER_SIZE"]
    assert extra[4] == consts["CU_LAUNCH_PARAM_END"] and extra[1] == packed.block
    assert cuproc.ffi.cast("size_t *", extra[3])[0] == 56


# ---------------------------------------------------------------- the generated launcher, on the simulated driver
