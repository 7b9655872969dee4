"""Texture and surface objects and tensor maps (issue 39) on the stateful fake driver: what each is made over,
the descriptors the driver gets back, the 64-bit values and the 128-byte maps in the argument bytes of every
launch form, what they keep alive and when they refuse, and the driver's rules checked before the call.

The fake (tests/fakedriver_arrays.c) checks texture and tensor-map descriptors as the driver documents them
and records the bytes of each launch (``last_launch``); ``fk`` checks that nothing stale or misrouted reached
it, and ``arrays`` that no array, texture or surface object outlives the test's objects.
"""
from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, Module
from cuproc.arrays import CudaArray, MipmappedArray
from cuproc.errors import ClosedResourceError, CudaError, InvalidValueError
from cuproc.launch import launch, pack_bytes
from cuproc.tensor_map import TensorMap, param_type
from cuproc.textures import SurfaceObject, TextureObject

from fakedriver import child_preamble, fake_image
from subproc import run_python
from test_arrays_fake import arrays  # noqa: F401  (the fixture)

ffi = cuproc.ffi
TEX = ["unsigned long long", "CUtexObject", "int"]
IMAGE = fake_image({"objects": [8, 8, 4], "after_int": [4, "128@64"], "after_int_128": [4, "128@128"],
                    "pointer": [8]})


def _aligned_buffer(nbytes: int, align: int = 512) -> DeviceBuffer:
    """A buffer whose address is a multiple of ``align`` (the fake spaces allocations 256 bytes apart)."""
    kept = []
    while True:
        buf = DeviceBuffer(nbytes)
        if buf.ptr % align == 0:
            for k in kept:
                k.free()
            return buf
        kept.append(buf)


def _unaligned_buffer(nbytes: int) -> DeviceBuffer:
    kept = []
    while True:
        buf = DeviceBuffer(nbytes)
        if buf.ptr % 512:
            for k in kept:
                k.free()
            return buf
        kept.append(buf)


# ------------------------------------------------------------------------------------------------ textures
def test_textures_over_every_resource_say_what_they_read(arrays):
    a = CudaArray.create(8, 4, dtype="float32")
    m = MipmappedArray.create(16, 16, levels=3, dtype="uint8", channels=4)
    buf = _aligned_buffer(4096)
    t_array = TextureObject.create(a, filter_mode="linear", normalized_coords=True, address_mode=("wrap", "mirror"))
    t_mip = TextureObject.create(m, read_mode="normalized_float", filter_mode="linear", mipmap_filter_mode="linear")
    t_linear = TextureObject.create(buf, dtype="int32", nbytes=1024)
    t_pitch = TextureObject.create(buf, dtype="float32", channels=2, width=6, height=4, pitch=64,
                                   address_mode="border", border_color=(1, 2, 3, 4))
    assert t_array.resource_desc() == {"type": 0, "array": int(ffi.cast("uintptr_t", a.handle))}
    assert t_mip.resource_desc() == {"type": 1, "mipmapped_array": int(ffi.cast("uintptr_t", m.handle))}
    assert t_linear.resource_desc() == {"type": 2, "address": buf.ptr, "nbytes": 1024}
    assert t_pitch.resource_desc() == {"type": 3, "address": buf.ptr, "width": 6, "height": 4, "pitch": 64}
    desc = t_array.texture_desc()
    assert desc["address_mode"] == (0, 2, 2) and desc["filter_mode"] == 1
    assert desc["flags"] == 0x2                    # CU_TRSF_NORMALIZED_COORDINATES (floats are never promoted)
    assert not t_mip.texture_desc()["flags"] & 0x1     # normalized floats: not read as integers
    assert t_linear.texture_desc()["flags"] & 0x1      # element type: CU_TRSF_READ_AS_INTEGER
    assert t_pitch.texture_desc()["border_color"] == (1.0, 2.0, 3.0, 4.0)
    assert len({t.handle for t in (t_array, t_mip, t_linear, t_pitch)}) == 4
    assert arrays.live("texture") == 4
    for t in (t_array, t_mip, t_linear, t_pitch):
        t.close()
        t.close()
    assert arrays.live("texture") == 0


@pytest.mark.parametrize("case, words", [
    ("linear integer", "linear filtering returns floating point"),
    ("wrap unnormalized", "normalized"),
    ("linear memory filtered", "tex1Dfetch"),
    ("no dtype", "dtype="),
    ("pitch alignment", "TEXTURE_PITCH_ALIGNMENT"),
    ("pitch short", "pitch"),
    ("pitch overrun", "need"),
    ("linear size", "multiple"),
    ("unaligned", "TEXTURE_ALIGNMENT"),
    ("mode", "address_mode"),
    ("mode type", "address_mode"),
    ("border", "numbers"),
    ("border size", "4 components"),
    ("anisotropy", "max_anisotropy"),
    ("filter", "filter modes"),
    ("read mode", "read_mode"),
    ("host", "host memory"),
    ("clamps", "exceeds"),
    ("srgb", "8-bit"),
    ("normalized 32-bit", "8- and 16-bit"),
    ("resource", "resource must be"),
])
def test_texture_rules_are_checked_before_the_driver_call(arrays, fk, case, words):
    a = CudaArray.create(8, 4, dtype="uint8")
    buf = _aligned_buffer(2048)
    fk.clear_calls()
    with pytest.raises(InvalidValueError, match=words) as refused:
        if case == "linear integer":
            TextureObject.create(a, filter_mode="linear")
        elif case == "wrap unnormalized":
            TextureObject.create(a, address_mode="wrap")
        elif case == "linear memory filtered":
            TextureObject.create(buf, dtype="float32", filter_mode="linear")
        elif case == "no dtype":
            TextureObject.create(buf)
        elif case == "pitch alignment":
            TextureObject.create(buf, dtype="float32", width=4, height=4, pitch=48)
        elif case == "pitch short":
            TextureObject.create(buf, dtype="float32", width=16, height=4, pitch=32)
        elif case == "pitch overrun":
            TextureObject.create(buf, dtype="float32", width=8, height=64, pitch=64)
        elif case == "linear size":
            TextureObject.create(buf, dtype="float32", nbytes=10)
        elif case == "unaligned":
            TextureObject.create(_unaligned_buffer(1024), dtype="float32")
        elif case == "mode":
            TextureObject.create(a, address_mode="repeat")
        elif case == "border":
            TextureObject.create(a, border_color=("red", 0, 0, 0))
        elif case == "border size":
            TextureObject.create(a, border_color=(0, 0))
        elif case == "anisotropy":
            TextureObject.create(a, max_anisotropy=2.5)
        elif case == "mode type":
            TextureObject.create(a, address_mode=1)
        elif case == "filter":
            TextureObject.create(a, filter_mode="cubic")
        elif case == "read mode":
            TextureObject.create(a, read_mode="float")
        elif case == "host":
            TextureObject.create(cuproc.PinnedBuffer(1024), dtype="float32")
        elif case == "clamps":
            TextureObject.create(MipmappedArray.create(8, 8, levels=3), min_mipmap_level_clamp=2.0,
                                 max_mipmap_level_clamp=1.0)
        elif case == "normalized 32-bit":
            TextureObject.create(CudaArray.create(4, 4, dtype="float32"), read_mode="normalized_float")
        elif case == "srgb":
            TextureObject.create(CudaArray.create(4, 4, dtype="float32"), srgb=True)
        else:
            TextureObject.create(np.zeros(4, np.float32))
    assert refused.value.refused
    assert "cuTexObjectCreate" not in fk.calls()


def test_the_fake_refuses_what_cuproc_refuses(arrays):
    """Straight to the driver, the same rules come back as CUDA_ERROR_INVALID_VALUE (the fake is no softer)."""
    drv = cuproc.default_driver()
    a = CudaArray.create(8, 4, dtype="uint8")
    r = ffi.new("CUDA_RESOURCE_DESC *")
    r.resType = 0
    r.res.array.hArray = a.handle
    t = ffi.new("CUDA_TEXTURE_DESC *")
    t.filterMode, t.flags = 1, 0x1                 # linear filtering of integers read as integers
    out = ffi.new("CUtexObject *")
    assert drv.cuTexObjectCreate(out, r, t, ffi.NULL) == drv.CUDA_ERROR_INVALID_VALUE
    s = ffi.new("CUsurfObject *")
    assert drv.cuSurfObjectCreate(s, r) == drv.CUDA_ERROR_INVALID_VALUE   # not made with surface=True
    assert arrays.live("texture") == 0 and arrays.live("surface") == 0


def test_surfaces_need_surface_arrays(arrays, fk):
    a = CudaArray.create(8, 4, dtype="float32", surface=True)
    s = SurfaceObject.create(a)
    assert s.resource_desc() == {"type": 0, "array": int(ffi.cast("uintptr_t", a.handle))}
    level = MipmappedArray.create(8, 8, levels=2, surface=True).level(1)
    s2 = SurfaceObject.create(level)
    fk.clear_calls()
    with pytest.raises(InvalidValueError, match="surface=True"):
        SurfaceObject.create(CudaArray.create(8, dtype="float32"))
    with pytest.raises(InvalidValueError, match="CudaArray"):
        SurfaceObject.create(DeviceBuffer(64))     # type: ignore[arg-type]
    assert "cuSurfObjectCreate" not in fk.calls()
    assert arrays.live("surface") == 2
    del s, s2
    gc.collect()
    assert arrays.live("surface") == 0


# ------------------------------------------------------------------------------------------------ lifetimes
def test_a_texture_keeps_its_array_alive(arrays):
    a = CudaArray.create(8, 4, dtype="float32")
    t = TextureObject.create(a)
    m = MipmappedArray.create(8, 8, levels=2)
    tm = TextureObject.create(m)
    buf = _aligned_buffer(1024)
    tl = TextureObject.create(buf, dtype="float32")
    del a, m, buf
    gc.collect()
    assert arrays.live("array") == 1 + 2 and arrays.live("mipmapped_array") == 1
    assert t.item() and tm.item() and tl.item()    # all still usable
    del t, tm, tl
    gc.collect()
    assert arrays.live("array") == 0 and arrays.live("texture") == 0 and arrays.dangling() == 0


def test_closing_what_a_texture_reads_makes_it_refuse_and_its_close_still_destroys_it(arrays, fk):
    a = CudaArray.create(8, 4, dtype="float32", surface=True)
    t, s = TextureObject.create(a), SurfaceObject.create(a)
    buf = _aligned_buffer(1024)
    tl = TextureObject.create(buf, dtype="float32")
    handle = tl.handle
    tl.item()                                      # a check passed (and remembered)
    buf.free()                                     # a leaf's end moves no epoch: the texture still asks
    with pytest.raises(ClosedResourceError):
        tl.item()
    a.close()                                      # allowed, as in C: the driver does not refuse it
    assert arrays.dangling() == 2
    for obj in (t, s, tl):
        with pytest.raises(ClosedResourceError):
            obj.item()
        assert obj.closed
    fk.clear_calls()
    for obj in (t, s, tl):
        obj.close()                                # the handles are the context's: destroyed all the same
    assert {"cuTexObjectDestroy", "cuSurfObjectDestroy"} <= set(fk.calls())
    assert arrays.live("texture") == 0 and arrays.live("surface") == 0
    again = TextureObject.create(_aligned_buffer(1024), dtype="float32")
    assert again.handle == handle                  # the value comes back: only the object tells them apart
    with pytest.raises(ClosedResourceError):
        tl.item()


def test_textures_end_with_their_context(arrays, fk, pc):
    ctx = cuproc.Context.create(0)
    t = TextureObject.create(CudaArray.create(8, dtype="float32"))
    ctx.destroy()
    assert arrays.live("texture") == 0
    with pytest.raises(ClosedResourceError):
        t.item()
    fk.clear_calls()
    t.close()
    assert "cuTexObjectDestroy" not in fk.calls()


# ------------------------------------------------------------------------------------------------ launches
@pytest.fixture()
def kernels(arrays):
    mod = Module.load(IMAGE)
    yield mod
    mod.unload()


def _u64(data: bytes, offset: int) -> int:
    return int.from_bytes(data[offset:offset + 8], "little")


@pytest.mark.parametrize("form", ["inferred", "signature", "prepared", "prepared params", "signature params",
                                  "launch_ex", "packed"])
def test_objects_pass_by_value_in_every_launch_form(kernels, fk, form):
    a = CudaArray.create(8, 4, dtype="float32", surface=True)
    t, s = TextureObject.create(a), SurfaceObject.create(a)
    fn = kernels.get_function("objects")
    args = (t, s, np.int32(7))
    if form == "inferred":
        launch(fn, 1, 1, args)
    elif form == "signature":
        launch(fn, 1, 1, args, signature=TEX)
    elif form == "signature params":
        launch(fn, 1, 1, args, signature=TEX, convention="params")
    elif form == "prepared":
        fn.prepare(TEX, 1, 1)(*args)
    elif form == "prepared params":
        fn.prepare(TEX, 1, 1, convention="params")(*args)
    elif form == "launch_ex":
        cuproc.launch.launch_ex(fn, 1, 1, args, signature=TEX)
    else:
        data = pack_bytes(TEX, args)
        assert _u64(data, 0) == t.handle and _u64(data, 8) == s.handle
        return
    name, data = fk.last_launch()
    assert name == "objects" and len(data) == 20
    assert _u64(data, 0) == t.handle and _u64(data, 8) == s.handle
    assert int.from_bytes(data[16:20], "little") == 7


#: The compiler aligns a parameter at its address in constant bank 0, where sm_90 puts the parameters from 0x210:
#: a 64-aligned struct lands at offset 48 (first, or after an int; 128-aligned: 112), which the driver reports (on
#: an H200 too) and the fake models.  cuproc.launch packs at the driver's offsets, so the map arrives where the
#: kernel reads it in every form and convention (the fake copies a "buffer" block verbatim).
@pytest.mark.parametrize("form", ["inferred", "prepared", "prepared params", "signature params", "128 aligned"])
def test_a_tensor_map_passes_by_value_where_the_driver_places_it(kernels, fk, form):
    buf = _aligned_buffer(32 * 32 * 2)
    tm = TensorMap.tiled(buf, "float16", (32, 32), (8, 8))
    fn = kernels.get_function("after_int_128" if form == "128 aligned" else "after_int")
    offset = fn.param_info()[1][0]                 # the driver's word: 48 (112 for 128-aligned) on sm_90
    sig = ["int", param_type()]
    if form == "inferred":
        launch(fn, 1, 1, (np.int32(3), tm))
    elif form == "prepared":
        fn.prepare(sig, 1, 1)(3, tm)
    elif form == "prepared params":
        fn.prepare(sig, 1, 1, convention="params")(3, tm)
    elif form == "signature params":
        launch(fn, 1, 1, (3, tm), signature=sig, convention="params")
    else:
        launch(fn, 1, 1, (np.int32(3), tm.with_param_alignment(128)))
    data = fk.last_launch()[1]
    assert data[:4] == (3).to_bytes(4, "little") and data[offset:offset + 128] == bytes(tm)


def test_the_fake_lays_parameters_out_as_sm_90_does(kernels):
    """The image's ``<size>@<alignment>`` parameters, at the offsets NVRTC 13.5's sm_90 cubins record (and a
    malformed one is an invalid image, as the driver answers for a broken cubin)."""
    assert kernels.get_function("after_int").param_info() == [(0, 4), (48, 128)]
    assert kernels.get_function("after_int_128").param_info() == [(0, 4), (112, 128)]
    assert kernels.get_function("objects").param_info() == [(0, 8), (8, 8), (16, 4)]   # up to 16: as packed
    for bad in ("128@3", "128@", "128@0"):
        with pytest.raises(CudaError) as failed:
            Module.load(fake_image({"k": [4, bad]}))
        assert failed.value.name == "CUDA_ERROR_INVALID_IMAGE"


def test_objects_are_not_pointers_and_dead_ones_are_not_passed(kernels, fk):
    a = CudaArray.create(8, dtype="float32")
    t = TextureObject.create(a)
    fn = kernels.get_function("pointer")
    fk.clear_calls()
    with pytest.raises(InvalidValueError, match="device pointer"):
        launch(fn, 1, 1, (t,), signature=["float*"])
    run = kernels.get_function("objects").prepare(TEX, 1, 1)
    run(t, t, 1)
    a.close()
    with pytest.raises(ClosedResourceError):
        run(t, t, 1)                                # the texture's array was destroyed
    assert fk.launch_count() == 1
    buf = _aligned_buffer(1024)
    tm = TensorMap.tiled(buf, "float32", (16, 16), (4, 4))
    assert pack_bytes(["int", param_type()], (1, tm))[64:] == bytes(tm)
    buf.free()
    with pytest.raises(ClosedResourceError):
        pack_bytes(["int", param_type()], (1, tm))   # the map's memory was freed
    with pytest.raises(ClosedResourceError):
        bytes(tm)


# ------------------------------------------------------------------------------------------------ tensor maps
def test_tiled_and_im2col_maps_reach_the_driver_innermost_first(arrays):
    buf = _aligned_buffer(8 * 16 * 32 * 4)
    tm = TensorMap.tiled(buf, np.float32, (8, 16, 32), (2, 4, 8), element_strides=(1, 1, 2), swizzle="32b")
    words = np.frombuffer(bytes(tm), np.uint64)
    assert words[0] == buf.ptr
    assert words[1] & 0xFF == 7 and (words[1] >> 8) & 0xFF == 3 and (words[1] >> 24) & 0xFF == 1
    assert list(words[2:5]) == [32, 16, 8]           # globalDim, innermost first
    assert list(words[7:9]) == [128, 16 * 128]       # globalStrides of dimensions 1 and 2, in bytes
    assert [int(w) & 0xFFFFFFFF for w in words[11:14]] == [8, 4, 2]
    assert [int(w) >> 32 for w in words[11:14]] == [2, 1, 1]
    strided = TensorMap.tiled(buf, "uint8", (4, 64), (4, 16), strides=(128, 1))
    assert np.frombuffer(bytes(strided), np.uint64)[7] == 128
    im = TensorMap.im2col(buf, "float16", (2, 8, 8, 16), lower_corner=(-1, -1), upper_corner=(1, 1),
                          channels_per_pixel=16, pixels_per_column=32)
    assert np.frombuffer(bytes(im), np.uint64)[2] == 16
    assert tm.dtype is param_type(64) and tm.with_param_alignment(128).dtype is param_type(128)
    assert bytes(tm.with_param_alignment(128)) == bytes(tm)
    with pytest.raises(InvalidValueError, match="64 or 128"):
        param_type(32)
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(tm)


@pytest.mark.parametrize("kwargs, words", [
    ({"shape": (16, 16), "box": (4, 2)}, "multiple of 16 bytes"),             # inner box 8 bytes
    ({"shape": (16, 16), "box": (4, 300)}, "1 to 256"),
    ({"shape": (16, 16), "box": (4, 4), "strides": (72, 4)}, "multiple of 16"),
    ({"shape": (16, 16), "box": (4, 4), "strides": (64, 8)}, "contiguous"),
    ({"shape": (64, 64), "box": (4, 4)}, "spans"),                           # 16 KiB over 4 KiB
    ({"shape": (16, 16), "box": (4, 4), "element_strides": (1, 9)}, "1 to 8"),
    ({"shape": (16, 16), "box": (4, 16), "swizzle": "32b"}, "swizzle span"),
    ({"shape": (16, 16), "box": (4, 4), "interleave": "16b"}, "rank 3 to 5"),
    ({"shape": (16, 16), "box": (4, 4), "dtype": "int32", "oob_fill": "nan"}, "floating-point"),
    ({"shape": (1, 1, 1, 1, 1, 1), "box": (1,) * 6}, "rank 1 to 5"),
    ({"shape": (16, 16), "box": (4,)}, "rank is 2"),
    ({"shape": (16, 16), "box": (4, 4), "dtype": "complex64"}, "element type"),
    ({"shape": (16, 16), "box": (4, 4), "swizzle": "256b"}, "swizzle is one of"),
    ({"shape": (16, 0), "box": (4, 4)}, "2\\*\\*32"),
])
def test_tensor_map_rules_are_checked_before_the_driver_call(arrays, fk, kwargs, words):
    buf = _aligned_buffer(4096)
    dtype = kwargs.pop("dtype", "float32")
    fk.clear_calls()
    with pytest.raises(InvalidValueError, match=words) as refused:
        TensorMap.tiled(buf, dtype, **kwargs)
    assert refused.value.refused
    assert "cuTensorMapEncodeTiled" not in fk.calls()


def test_im2col_rules_and_memory_kinds(arrays, fk):
    buf = _aligned_buffer(2 * 8 * 8 * 16 * 2)
    fk.clear_calls()
    base = {"lower_corner": (0, 0), "upper_corner": (0, 0), "channels_per_pixel": 16, "pixels_per_column": 8}
    for change, words in (({"lower_corner": (-200, 0)}, "corners"), ({"channels_per_pixel": 0}, "1 to 256"),
                          ({"pixels_per_column": 2000}, "1 to 1024"), ({"channels_per_pixel": 4}, "16 bytes"),
                          ({"upper_corner": (0,)}, "rank is 2")):
        with pytest.raises(InvalidValueError, match=words):
            TensorMap.im2col(buf, "float16", (2, 8, 8, 16), **{**base, **change})
    with pytest.raises(InvalidValueError, match="rank 3 to 5"):
        TensorMap.im2col(buf, "float16", (8, 16), **base)
    with pytest.raises(InvalidValueError, match="device memory"):
        TensorMap.tiled(cuproc.PinnedBuffer(4096), "float32", (16, 16), (4, 4))
    with pytest.raises(InvalidValueError, match="device memory"):
        TensorMap.tiled(np.zeros(1024, np.float32), "float32", (16, 16), (4, 4))
    assert not any(c.startswith("cuTensorMap") for c in fk.calls())


def test_the_fake_checks_tensor_maps_too(arrays):
    """The driver's own rules (what cuproc checks first): a stride that is not a multiple of 16 bytes, a map
    not 64-byte aligned, a global address the driver does not know."""
    drv = cuproc.default_driver()
    buf = _aligned_buffer(4096)
    storage = ffi.new("char[]", 256)
    start = (int(ffi.cast("uintptr_t", storage)) + 127) // 128 * 128
    dims, box = ffi.new("cuuint64_t[]", [16, 16]), ffi.new("cuuint32_t[]", [4, 4])
    ones = ffi.new("cuuint32_t[]", [1, 1])
    for address, stride, at, expected in ((buf.ptr, 72, start, drv.CUDA_ERROR_INVALID_VALUE),
                                          (buf.ptr, 64, start + 8, drv.CUDA_ERROR_INVALID_VALUE),
                                          (buf.ptr, 64, start, 0)):
        rc = drv.cuTensorMapEncodeTiled(ffi.cast("CUtensorMap *", at), 7, 2, ffi.cast("void *", address), dims,
                                        ffi.new("cuuint64_t[]", [stride]), box, ones, 0, 0, 0, 0)
        assert rc == expected


def test_interpreter_exit_with_live_textures_is_quiet(fake):
    """Textures, surfaces and what they read dropped at exit in whatever order: each handle given back once,
    no warning, nothing stale (a crash here fails this test alone)."""
    code = child_preamble(fake.path) + (
        "import warnings\n"
        "warnings.simplefilter('error')\n"
        "from cuproc.arrays import CudaArray\n"
        "from cuproc.textures import TextureObject, SurfaceObject\n"
        "from cuproc.tensor_map import TensorMap\n"
        "pc = cuproc.use_device(0)\n"
        "a = CudaArray.create(8, 8, dtype='float32', surface=True)\n"
        "t, s = TextureObject.create(a, filter_mode='linear'), SurfaceObject.create(a)\n"
        "buf = cuproc.DeviceBuffer(4096)\n"
        "tm = TensorMap.tiled(buf, 'float32', (16, 16), (4, 4))\n"
        "cycle = [t, s, tm]\n"
        "cycle.append(cycle)\n"
        "print('stale', fake.stale_count())\n")
    proc = run_python(code)
    assert "stale 0" in proc.stdout and "Warning" not in proc.stderr, proc.stderr


def test_legacy_texture_and_surface_references_stay_reachable_by_c_name(sims):
    """Objects replace them, but where the requested version has cuTexRef* and cuSurfRef*, the C names reach the
    driver unchanged (the simulated driver records which entry point was called)."""
    sim = sims["v2"]
    sim.set_version(13000)
    sim.set_result(0)
    drv = cuproc.Driver("12.0", library=str(sim.path))
    for name in ("cuTexRefSetArray", "cuTexRefSetFilterMode", "cuSurfRefSetArray", "cuModuleGetTexRef"):
        assert drv.has(name), name
    sim.reset_last_called()
    assert drv.cuTexRefSetFilterMode(ffi.NULL, drv.CU_TR_FILTER_MODE_LINEAR) == 0
    assert sim.last_called() == "cuTexRefSetFilterMode"
