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
        L._dims((0, 1), "grid")
    assert L._dims(5, "grid") == (5, 1, 1) and L._dims((2, 3), "block") == (2, 3, 1)


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

class _FakeFunction:
    """What PreparedLaunch needs of a Function, with no parameter info (the user's signature rules)."""

    def __init__(self, drv):
        self.driver, self.handle, self.name = drv, cuproc.ffi.NULL, "fake"

    def param_info(self):
        return None


@pytest.fixture()
def sim_driver(sims):
    sim = sims["v2"]
    sim.set_version(13000)
    sim.set_result(0)
    return sim, cuproc.Driver(library=sim.path)


SIG = ["float*", "int", "float", "float4"]


@pytest.mark.parametrize("entry", ["cuLaunchKernel", "cuLaunchKernelEx"])
@pytest.mark.parametrize("convention", ["buffer", "params"])
def test_prepared_launch_stores_values_then_calls_the_driver(sim_driver, convention, entry):
    sim, drv = sim_driver
    prepared = L.PreparedLaunch(_FakeFunction(drv), SIG, (2, 3), 64, convention=convention, entry=entry)
    if entry == "cuLaunchKernelEx":
        c = prepared.config
        assert (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ) == (2, 3, 1, 64, 1, 1)
    for values in [(0x1000, 7, 1.5, (1, 2, 3, 4)),
                   (np.uint64(0x2000), np.int32(-3), np.float32(0.25), np.arange(4, dtype=np.float32)),
                   (0x1000, 2**31 - 1, 3, [0.5] * 4)]:      # an int for a float parameter: stored as float
        # (the third address equals the first: the launcher's cached address must not hide the second)
        sim.reset_last_called()
        prepared(*values)
        assert sim.last_called() == entry
        got = bytes(cuproc.ffi.buffer(prepared.packed.block, prepared.packed.size))
        assert got == L.pack_bytes(SIG, values)
    ptr_int, n, x = struct.unpack_from("<Qif", got)
    assert (ptr_int, n, x) == (0x1000, 2**31 - 1, 3.0)


def test_prepared_launch_refuses_bad_values_before_the_driver(sim_driver):
    sim, drv = sim_driver
    prepared = L.PreparedLaunch(_FakeFunction(drv), SIG, 1, 32)
    sim.reset_last_called()
    with pytest.raises(TypeError, match=r"fake\[float\*, int, float, float4\]\(\) missing 1 .*'arg3_float4'"):
        prepared(1, 2, 3)
    with pytest.raises(TypeError, match=r"fake\[float\*, int, float, float4\]\(\) takes 4 positional"):
        prepared.launch(1, 2, 3, (1, 2, 3, 4), 5)
    assert sim.last_called() != "cuLaunchKernel"
    bad = [((1, 2**40, 1.0, (0,) * 4), "int"),                 # out of int32 range
           ((1, 1.5, 1.0, (0,) * 4), "int"),                   # a float for an int parameter
           ((1, np.float32(2.5), 1.0, (0,) * 4), "int"),       # ... also as a NumPy float
           ((-1, 1, 1.0, (0,) * 4), "device address"),
           ((object(), 1, 1.0, (0,) * 4), "device pointer"),
           ((1, 1, "x", (0,) * 4), "float"),
           ((1, 1, 1.0, (0,) * 3), "4 components")]
    for values, words in bad:
        sim.reset_last_called()
        with pytest.raises(InvalidValueError) as exc:
            prepared(*values)
        assert words in str(exc.value) and "cuLaunchKernel" in str(exc.value), (values, str(exc.value))
        assert sim.last_called() != "cuLaunchKernel", values


def test_prepared_launch_raises_the_drivers_error(sim_driver):
    sim, drv = sim_driver
    prepared = L.PreparedLaunch(_FakeFunction(drv), ["int"], 1, 1)
    sim.set_result(cuproc.driver.CUDA_ERROR_INVALID_HANDLE)
    try:
        with pytest.raises(cuproc.CudaError) as exc:
            prepared(1)
    finally:
        sim.set_result(0)
    assert exc.value.name == "CUDA_ERROR_INVALID_HANDLE" and exc.value.call == prepared.entry
    assert prepared.entry == "cuLaunchKernelEx"        # 13.0 has it: the four-argument call is the default
    assert L.PreparedLaunch(_FakeFunction(cuproc.Driver("11.3", library=sim.path)), ["int"]).entry == "cuLaunchKernel"


def test_prepared_launch_with_a_freed_buffer_raises(sim_driver):
    """A freed cuproc buffer is refused on the fast path too (its ptr property checks)."""
    from cuproc.memory import DeviceBuffer
    sim, drv = sim_driver
    buf = DeviceBuffer.__new__(DeviceBuffer)
    buf._freed, buf._free_call = True, "cuMemFree"
    prepared = L.PreparedLaunch(_FakeFunction(drv), ["float*"], 1, 1)
    sim.reset_last_called()
    with pytest.raises(InvalidValueError, match="freed"):
        prepared(buf)
    assert sim.last_called() != "cuLaunchKernel"


def test_prepared_launch_rechecks_a_buffer_every_launch(sim_driver):
    """The address cache never skips the freed / destroyed-context test."""
    from cuproc.errors import InvalidContextError
    from cuproc.memory import DeviceBuffer
    sim, drv = sim_driver

    class FakeContext:
        _destroyed = False
        alive = True

    buf = DeviceBuffer.__new__(DeviceBuffer)
    buf._freed, buf._free_call, buf._ptr, buf.context = False, "cuMemFree", 0x5000, FakeContext()
    prepared = L.PreparedLaunch(_FakeFunction(drv), ["float*"], 1, 1)
    prepared(buf)
    assert struct.unpack_from("<Q", cuproc.ffi.buffer(prepared.packed.block, 8))[0] == 0x5000
    buf.context._destroyed, buf.context.alive = True, False
    with pytest.raises(InvalidContextError):
        prepared(buf)
    buf.context._destroyed, buf.context.alive, buf._freed = False, True, True
    with pytest.raises(InvalidValueError, match="freed"):
        prepared(buf)
