"""CUDA arrays, mipmapped arrays and their copies (issue 39) on the stateful fake driver: every kind of array
and its descriptor in the ABI the requested version selects, copies host/device/array in both directions, 2-D
and 3-D, synchronous and on a stream, with regions and their bounds; lifetimes with handles the fake hands
out again; and the refusals of bad input, before the driver sees it.

The fake (tests/fakedriver_arrays.c) keeps real bytes per array and checks descriptors and copy regions as the
driver documents them, so a refusal cuproc missed shows as the driver's error here; ``fk`` checks that nothing
stale or misrouted reached it, and ``arrays`` that no array outlives the test's objects.
"""
from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

import cuproc
from cuproc import Context, DeviceBuffer, Stream
from cuproc import memory as mem
from cuproc.arrays import CudaArray, MipmappedArray, copy, descriptor_type
from cuproc.errors import ClosedResourceError, CudaError, InvalidValueError

from fakedriver import child_preamble
from subproc import run_python

ffi = cuproc.ffi


class ArrayRecords:
    """The fake's array counters (fakedriver_arrays.c's control functions)."""

    def __init__(self, fake):
        self.lib = fake.lib
        self.lib.fake_array_live.restype = ctypes.c_long
        self.lib.fake_array_live.argtypes = [ctypes.c_char_p]
        self.lib.fake_array_dangling.restype = ctypes.c_long

    def live(self, kind: str) -> int:
        n = self.lib.fake_array_live(kind.encode())
        assert n >= 0, kind
        return n

    def dangling(self) -> int:
        return self.lib.fake_array_dangling()


@pytest.fixture()
def arrays(fk, pc):
    """The fake's array records, fresh; afterwards (the test's objects collected) no array, mipmapped array,
    texture or surface object is left: cuproc gave back everything it made."""
    rec = ArrayRecords(fk)
    rec.lib.fake_array_reset()
    yield rec
    gc.collect()
    left = {kind: rec.live(kind) for kind in ("array", "mipmapped_array", "texture", "surface")}
    assert left == {"array": 0, "mipmapped_array": 0, "texture": 0, "surface": 0}, left


def _host(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.random(shape).astype(dtype)
    return rng.integers(0, np.iinfo(dtype).max, size=shape, dtype=dtype)


# ------------------------------------------------------------------------------------------------ kinds
@pytest.mark.parametrize("dims, flags, call, numpy_shape", [
    ((64,), {}, "cuArrayCreate", (64,)),
    ((16, 8), {}, "cuArrayCreate", (8, 16)),
    ((8, 4, 3), {}, "cuArray3DCreate", (3, 4, 8)),
    ((16, 0, 5), {"layered": True}, "cuArray3DCreate", (5, 16)),
    ((8, 4, 5), {"layered": True}, "cuArray3DCreate", (5, 4, 8)),
    ((8, 8, 6), {"cubemap": True}, "cuArray3DCreate", (6, 8, 8)),
    ((4, 4, 12), {"cubemap": True, "layered": True}, "cuArray3DCreate", (12, 4, 4)),
    ((16, 8), {"surface": True}, "cuArray3DCreate", (8, 16)),
    ((16, 8), {"texture_gather": True}, "cuArray3DCreate", (8, 16)),
])
def test_every_kind_of_array_is_made_and_described_by_the_driver(arrays, fk, dims, flags, call, numpy_shape):
    fk.clear_calls()
    a = CudaArray.create(*dims, dtype="uint16", channels=2, **flags)
    assert call in fk.calls()
    w, h, d = (dims + (0, 0))[:3]
    desc = a.descriptor()
    assert (desc["width"], desc["height"], desc["depth"], desc["channels"]) == (w, h, d, 2)
    assert desc["format"] == a.format == ffi.typeof("CUarray_format").relements["CU_AD_FORMAT_UNSIGNED_INT16"]
    assert desc["flags"] == a.flags
    assert a.numpy_shape == numpy_shape + (2,)
    assert a.element_size == 4 and a.nbytes == int(np.prod(numpy_shape)) * 4
    assert arrays.live("array") == 1
    a.close()
    a.close()                                   # idempotent, like a file's
    assert arrays.live("array") == 0 and a.closed


@pytest.mark.parametrize("dims, flags, words", [
    ((0,), {}, "width"),
    ((8, 0, 3), {}, "height > 0"),
    ((8, 4, 5), {"cubemap": True}, "square"),
    ((8, 8, 5), {"cubemap": True}, "depth 6"),
    ((8, 8, 7), {"cubemap": True, "layered": True}, "multiple of 6"),
    ((8, 8, 0), {"layered": True}, "layers"),
    ((8, 0), {"texture_gather": True}, "2-D"),
])
def test_shapes_the_driver_refuses_are_refused_first(arrays, fk, dims, flags, words):
    fk.clear_calls()
    with pytest.raises(InvalidValueError, match=words) as refused:
        CudaArray.create(*dims, **flags)
    assert refused.value.refused
    assert not any(c.startswith("cuArray") for c in fk.calls())


def test_the_fake_refuses_what_cuproc_refuses(arrays, fk):
    """The fake checks descriptors itself (so a refusal cuproc lacked would show): a cubemap that is not square,
    a 3-D array without height, five channels, a format that is not one."""
    drv = cuproc.default_driver()
    out = ffi.new("CUarray *")
    for w, h, d, fmt, nch, flags in ((8, 4, 6, 32, 1, 4), (8, 0, 3, 32, 1, 0), (8, 8, 0, 32, 5, 0),
                                     (8, 8, 0, 7, 1, 0)):
        desc = ffi.new("CUDA_ARRAY3D_DESCRIPTOR *", {"Width": w, "Height": h, "Depth": d, "Format": fmt,
                                                      "NumChannels": nch, "Flags": flags})
        assert drv.cuArray3DCreate(out, desc) == drv.CUDA_ERROR_INVALID_VALUE
    assert arrays.live("array") == 0


def test_bad_arguments_name_what_to_do(arrays):
    for kwargs, words in (({"dtype": "float64"}, "holds elements of"), ({"channels": 3}, "1, 2 or 4"),
                          ({"dtype": np.complex64}, "holds elements of")):
        with pytest.raises(InvalidValueError, match=words):
            CudaArray.create(8, 8, **kwargs)
    with pytest.raises(InvalidValueError, match="int >= 0"):
        CudaArray.create(8.0)                   # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="int >= 0"):
        CudaArray.create(8, True)               # type: ignore[arg-type]
    assert CudaArray.create(4, dtype=np.float32).dtype == "float32"   # NumPy types are taken
    assert CudaArray.create(4, dtype=np.dtype("int8")).dtype == "int8"
    assert CudaArray.create(4, dtype="CU_AD_FORMAT_HALF").dtype == "float16"


def test_the_descriptor_struct_is_the_one_the_requested_version_selects(sims):
    """cuArrayCreate_v2 (CUDA 3.2) changed the descriptor's sizes from unsigned int to size_t; the struct cuproc
    fills is the selected entry point's own parameter type, per requested version."""
    sim = sims["v2"]
    sim.set_version(13000)
    sim.set_result(0)
    old, new = cuproc.Driver("3.0", library=str(sim.path)), cuproc.Driver("12.0", library=str(sim.path))
    for call, v1, v2 in (("cuArrayCreate", "CUDA_ARRAY_DESCRIPTOR_v1", "CUDA_ARRAY_DESCRIPTOR_v2"),
                         ("cuArray3DCreate", "CUDA_ARRAY3D_DESCRIPTOR_v1", "CUDA_ARRAY3D_DESCRIPTOR_v2"),
                         ("cuMipmappedArrayCreate", None, "CUDA_ARRAY3D_DESCRIPTOR_v2"),
                         ("cuArray3DGetDescriptor", "CUDA_ARRAY3D_DESCRIPTOR_v1", "CUDA_ARRAY3D_DESCRIPTOR_v2"),
                         ("cuMemcpy2D", "CUDA_MEMCPY2D_v1", "CUDA_MEMCPY2D_v2"),
                         ("cuMemcpy3D", "CUDA_MEMCPY3D_v1", "CUDA_MEMCPY3D_v2")):
        assert descriptor_type(new, call) is ffi.typeof(v2)
        if v1 is not None:
            assert descriptor_type(old, call) is ffi.typeof(v1)
    ctx = Context(ffi.cast("CUcontext", 0x5000), driver=old)
    sim.reset_last_called()
    with pytest.raises(InvalidValueError, match="CUDA_ARRAY_DESCRIPTOR_v1") as refused:
        CudaArray.create(1 << 32, 4, context=ctx)
    assert refused.value.refused and sim.last_called() != "cuArrayCreate"
    with pytest.raises(ValueError, match="not one of"):
        descriptor_type(new, "cuMemAlloc")


# ------------------------------------------------------------------------------------------------ copies
def test_host_round_trips_2d_and_3d_sync_and_on_a_stream(arrays, fk):
    s = Stream()
    for dims, dtype, channels in (((32,), np.float32, 1), ((16, 8), np.uint8, 4), ((8, 4, 3), np.int16, 2),
                                  ((8, 0, 5), np.float32, 1)):
        a = CudaArray.create(*dims, dtype=np.dtype(dtype).name, channels=channels, layered=dims == (8, 0, 5))
        src = _host(a.numpy_shape, dtype)
        fk.clear_calls()
        a.copy_from(src)
        assert ("cuMemcpy3D" if a.depth else "cuMemcpy2D") in fk.calls()
        back = np.zeros_like(src)
        a.copy_to(back)
        np.testing.assert_array_equal(back, src)
        again = np.zeros_like(src)
        fk.clear_calls()
        a.copy_from(src[::-1].copy(), stream=s)
        a.copy_to(again, stream=s)
        assert ("cuMemcpy3DAsync" if a.depth else "cuMemcpy2DAsync") in fk.calls()
        s.synchronize()
        np.testing.assert_array_equal(again, src[::-1])


def test_regions_land_where_numpy_says(arrays):
    a = CudaArray.create(10, 6, 4, dtype="float32")
    full = _host(a.numpy_shape)
    a.copy_from(full)
    part = np.zeros((2, 3, 5), np.float32)             # (depth, height, width)
    a.copy_to(part, origin=(4, 2, 1), extent=(5, 3, 2))
    np.testing.assert_array_equal(part, full[1:3, 2:5, 4:9])
    patch = np.full((3, 2, 2), 7.5, np.float32)
    a.copy_from(patch, origin=(8, 4, 1))               # extent: from the origin to the end
    full[1:4, 4:6, 8:10] = 7.5
    back = np.empty_like(full)
    a.copy_to(back)
    np.testing.assert_array_equal(back, full)
    pitched = np.zeros((6, 16), np.float32)            # rows 64 bytes apart
    a.copy_to(pitched, extent=(10, 6, 1), pitch=64)
    np.testing.assert_array_equal(pitched[:, :10], full[0])


def test_device_and_array_to_array(arrays, fk):
    s = Stream()
    a = CudaArray.create(16, 8, dtype="uint32")
    b = CudaArray.create(16, 8, dtype="float32")       # same element size: a copy moves bytes
    src = _host(a.numpy_shape, np.uint32)
    with DeviceBuffer(src.nbytes) as d, DeviceBuffer(src.nbytes) as e:
        mem.copy(d, src)
        a.copy_from(d)
        copy(b, a)
        b.copy_to(e, stream=s)
        assert e.last_stream is s                      # the buffer remembers the stream (interop, frees)
        s.synchronize()
        out = np.zeros_like(src)
        mem.copy(out, e)
    np.testing.assert_array_equal(out, src)
    c = CudaArray.create(4, 4, dtype="uint32")
    copy(c, a, src_origin=(12, 4), extent=(4, 4))
    sub = np.zeros((4, 4), np.uint32)
    c.copy_to(sub)
    np.testing.assert_array_equal(sub, src[4:8, 12:16])
    assert fk.misrouted_count() == 0


def test_a_stream_ordered_free_waits_for_an_array_copy_on_another_stream(arrays, fk):
    """An async copy from an array into stream-ordered memory on stream B, the memory freed on its own stream A:
    the buffer's last_stream is B, so the free is ordered after the copy (the fake counts an unordered free,
    which a GPU's pool turns into a fault; fk asserts there is none)."""
    a = CudaArray.create(16, 4, dtype="float32")
    src = _host(a.numpy_shape)
    a.copy_from(src)
    s1, s2 = Stream(), Stream()
    for _ in range(2):
        buf = mem.alloc_async(src.nbytes, s1)
        a.copy_to(buf, stream=s2)
        assert buf.last_stream is s2
        mem.copy(back := np.zeros_like(src), buf, stream=s2)
        s2.synchronize()
        np.testing.assert_array_equal(back, src)
        a.copy_from(buf, stream=s2)
        buf.free_async()                  # on s1, after s2's work
    s1.synchronize()
    assert fk.unordered_frees() == 0


def test_copies_run_in_the_arrays_context(arrays, fk, pc):
    """A synchronous copy runs in whichever context is current: cuproc makes the array's current for it (the
    fake records one made in another as misrouted, and fk asserts there is none)."""
    other = Context.create(0)             # now current: the array below belongs to it
    a = CudaArray.create(8, 8, dtype="float32")
    src = _host(a.numpy_shape)
    pc.context.set_current()
    a.copy_from(src)
    back = np.zeros_like(src)
    a.copy_to(back)
    np.testing.assert_array_equal(back, src)
    a.close()
    other.destroy()


@pytest.mark.parametrize("case, words", [
    ("origin out", "outside"), ("extent out", "outside"), ("host small", "needs"), ("host read-only", "writable"),
    ("element size", "differ in size"), ("no array", "neither side"), ("pitch", "pitch"), ("mipmapped", "level"),
    ("bad side", "buffer-protocol"), ("linear origin", "linear memory"),
])
def test_bounds_and_kinds_are_checked_before_the_copy(arrays, fk, case, words):
    a = CudaArray.create(8, 4, dtype="float32")
    b = CudaArray.create(8, 4, dtype="float16")
    host = np.zeros((4, 8), np.float32)
    fk.clear_calls()
    with pytest.raises(InvalidValueError, match=words) as refused:
        if case == "origin out":
            a.copy_to(host, origin=(9, 0))
        elif case == "extent out":
            a.copy_to(host, origin=(2, 1), extent=(7, 2))
        elif case == "host small":
            a.copy_from(np.zeros(31, np.float32))
        elif case == "host read-only":
            a.copy_to(bytes(128))
        elif case == "element size":
            copy(a, b)
        elif case == "no array":
            copy(host, np.ones(32, np.float32))
        elif case == "pitch":
            a.copy_to(host, pitch=16)
        elif case == "mipmapped":
            copy(MipmappedArray.create(8, 8, levels=2), host)
        elif case == "bad side":
            copy(a, object())
        else:
            copy(a, host, src_origin=(1, 0))
    assert refused.value.refused
    assert not any(c.startswith("cuMemcpy") for c in fk.calls())


# ------------------------------------------------------------------------------------------------ memory.copy
@pytest.mark.parametrize("dims, dtype, channels, layered", [
    ((32,), np.float32, 1, False), ((16, 8), np.uint8, 4, False), ((8, 4, 3), np.int16, 2, False),
    ((8, 0, 5), np.float32, 1, True), ((6, 4, 3), np.float32, 1, True)])
@pytest.mark.parametrize("on_stream", [False, True])
def test_memory_copy_takes_arrays_host_device_and_array_round_trips(arrays, fk, dims, dtype, channels, layered,
                                                                    on_stream):
    """host -> array -> device -> array -> host through memory.copy alone, 2-D and 3-D, sync and on a stream: the
    driver's 2-D or 3-D copy (Async with a stream) each time, the data NumPy's."""
    s = Stream() if on_stream else None
    a = CudaArray.create(*dims, dtype=np.dtype(dtype).name, channels=channels, layered=layered)
    b = CudaArray.create(*dims, dtype=np.dtype(dtype).name, channels=channels, layered=layered)
    src = _host(a.numpy_shape, dtype)
    back = np.zeros_like(src)
    fk.clear_calls()
    with DeviceBuffer(src.nbytes) as dev:
        mem.copy(a, src, stream=s)
        mem.copy(dev, a, stream=s)
        mem.copy(b, dev, stream=s)
        assert dev.last_stream is s                   # the buffer remembers the stream (interop, frees)
        mem.copy(a, np.zeros_like(src), stream=s)     # overwritten, so the next copy must bring it back
        mem.copy(a, b, stream=s)
        mem.copy(back, a, stream=s)
        if s is not None:
            s.synchronize()
    np.testing.assert_array_equal(back, src)
    call = ("cuMemcpy3D" if a.depth else "cuMemcpy2D") + ("Async" if s is not None else "")
    assert [c for c in fk.calls() if c.startswith("cuMemcpy")] == [call] * 6


@pytest.mark.parametrize("case", ["shape", "dtype", "array extent", "array dtype", "device small", "host small",
                                  "nbytes", "mipmapped", "read-only"])
def test_memory_copy_refuses_a_side_that_does_not_match_the_array(arrays, fk, case):
    """Refused before any copy, naming both sides where they do not match: the array, and the other side's shape
    and dtype, extent or size."""
    a = CudaArray.create(8, 4, dtype="float32")
    other_array = CudaArray.create(4, 8, dtype="float32") if case == "array extent" else \
        CudaArray.create(8, 4, dtype="int32")
    fk.clear_calls()
    with DeviceBuffer(64) as small, pytest.raises(InvalidValueError) as refused:
        if case == "shape":
            mem.copy(a, other := np.zeros((8, 4), np.float32))       # the same bytes, transposed
        elif case == "dtype":
            mem.copy(other := np.zeros((4, 8), np.int32), a)         # the same element size
        elif case in ("array extent", "array dtype"):
            mem.copy(other_array, a)
        elif case == "device small":
            mem.copy(small, a)
        elif case == "host small":
            mem.copy(a, bytearray(127))
        elif case == "nbytes":
            mem.copy(np.zeros((4, 8), np.float32), a, 64)
        elif case == "mipmapped":
            mem.copy(MipmappedArray.create(8, 8, levels=2), np.zeros((8, 8), np.float32))
        else:
            mem.copy(bytes(128), a)
    text = str(refused.value)
    named = {"shape": str(other.shape) if case == "shape" else None, "dtype": "int32",
             "array extent": other_array.describe(), "array dtype": other_array.describe(),
             "device small": "64 bytes", "host small": "127 bytes"}
    if case in named:
        assert a.describe() in text and named[case] in text, text
    assert refused.value.refused
    assert not any(c.startswith("cuMemcpy") for c in fk.calls())


def test_memory_copy_takes_more_linear_memory_than_the_array_and_raw_addresses(arrays, fk):
    """Linear memory without a shape is checked by size: more than the array's bytes is fine (the array's worth
    is copied), as a linear copy takes the smaller side; a raw device address has no size to check."""
    a = CudaArray.create(8, 4, dtype="float32")
    src = _host(a.numpy_shape)
    with DeviceBuffer(4096) as big:
        mem.copy(big, src)
        mem.copy(a, big)
        mem.copy(a, big.ptr, a.nbytes)
        out = bytearray(a.nbytes + 16)
        mem.copy(out, a)
    np.testing.assert_array_equal(np.frombuffer(bytes(out[:a.nbytes]), np.float32).reshape(a.numpy_shape), src)
    assert out[a.nbytes:] == bytes(16)


def test_the_fake_checks_regions_too(arrays):
    """The driver's own bounds (what cuproc checks first): a region past the array is CUDA_ERROR_INVALID_VALUE."""
    drv = cuproc.default_driver()
    a = CudaArray.create(8, 4, dtype="float32")
    host = np.zeros(64, np.float32)
    p = ffi.new("CUDA_MEMCPY2D *")
    p.srcMemoryType, p.srcArray, p.srcXInBytes = 3, a.handle, 8
    p.dstMemoryType, p.dstHost, p.dstPitch = 1, ffi.from_buffer(host), 32
    p.WidthInBytes, p.Height = 32, 1                  # 8 + 32 > the row's 32 bytes
    assert drv.cuMemcpy2D(p) == drv.CUDA_ERROR_INVALID_VALUE
    p.srcXInBytes, p.WidthInBytes = 2, 4              # not whole elements
    assert drv.cuMemcpy2D(p) == drv.CUDA_ERROR_INVALID_VALUE


def test_mipmapped_levels(arrays, fk):
    m = MipmappedArray.create(16, 8, levels=4, dtype="float32")
    assert [m.level_extent(i) for i in range(4)] == [(16, 8, 0), (8, 4, 0), (4, 2, 0), (2, 1, 0)]
    levels = [m.level(i) for i in range(4)]
    for i, level in enumerate(levels):
        data = np.full(level.numpy_shape, float(i), np.float32)
        level.copy_from(data)
    back = np.zeros(levels[2].numpy_shape, np.float32)
    levels[2].copy_to(back)
    assert (back == 2).all() and back.shape == (2, 4)
    with pytest.raises(InvalidValueError, match="levels must be"):
        MipmappedArray.create(16, 8, levels=6)
    with pytest.raises(InvalidValueError, match="level must be"):
        m.level(4)
    fk.clear_calls()
    levels[0].close()                      # not owned: nothing is destroyed (cuArrayDestroy of a level is stale)
    assert "cuArrayDestroy" not in fk.calls()
    m.close()
    with pytest.raises(ClosedResourceError):
        levels[1].copy_to(back)
    assert arrays.live("array") == 0 and arrays.live("mipmapped_array") == 0


# ------------------------------------------------------------------------------------------------ lifetimes
def test_a_destroyed_array_refuses_even_when_its_handle_names_a_new_one(arrays, fk):
    a = CudaArray.create(8, 8, dtype="float32")
    old = int(ffi.cast("uintptr_t", a.handle))
    a.destroy()
    b = CudaArray.create(8, 8, dtype="float32")       # the fake hands the handle out again, as a GPU does
    assert int(ffi.cast("uintptr_t", b.handle)) == old
    host = np.zeros((8, 8), np.float32)
    with pytest.raises(ClosedResourceError):
        a.copy_from(host)
    with pytest.raises(ClosedResourceError):
        a.descriptor()
    b.copy_from(np.ones((8, 8), np.float32))           # the live one is untouched by the dead one's refusals
    b.copy_to(host)
    assert (host == 1).all()


def test_arrays_end_with_their_context(arrays, fk, pc):
    ctx = Context.create(0)
    a = CudaArray.create(8, dtype="float32")
    ctx.destroy()
    assert arrays.live("array") == 0
    with pytest.raises(ClosedResourceError):
        a.copy_from(np.zeros(8, np.float32))
    fk.clear_calls()
    a.close()                                          # its handle went with the context: no call
    assert "cuArrayDestroy" not in fk.calls()


def test_dropped_arrays_are_given_back(arrays):
    for _ in range(3):
        CudaArray.create(8, 8, dtype="float32")
        MipmappedArray.create(8, 8, levels=3).level(1)
    gc.collect()
    assert arrays.live("array") == 0 and arrays.live("mipmapped_array") == 0


def test_interpreter_exit_with_live_arrays_is_quiet(fake, tmp_path):
    """Arrays, levels and their copies dropped at exit, in whatever order the interpreter takes them: each is given
    back once, with no warning (a crash here would fail this test alone)."""
    code = child_preamble(fake.path) + (
        "import numpy as np, warnings\n"
        "warnings.simplefilter('error')\n"
        "from cuproc.arrays import CudaArray, MipmappedArray\n"
        "pc = cuproc.use_device(0)\n"
        "a = CudaArray.create(8, 8, dtype='float32', surface=True)\n"
        "m = MipmappedArray.create(8, 8, levels=2)\n"
        "level = m.level(1)\n"
        "a.copy_from(np.ones((8, 8), np.float32))\n"
        "print('stale', fake.stale_count())\n")
    proc = run_python(code)
    assert "stale 0" in proc.stdout and "Warning" not in proc.stderr, proc.stderr
