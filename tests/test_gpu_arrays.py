"""CUDA arrays, texture and surface objects and tensor maps on a real GPU (issue 39), checked against NumPy.

Kernels are compiled with NVRTC (cuproc.program).  The texture tests use CUDA's own filtering rule as the
programming guide states it (appendix "Texture Fetching"): with linear filtering, a texel coordinate ``x`` is
read at ``xB = x - 0.5``, between texels ``i = floor(xB)`` and ``i + 1`` with weight ``a = frac(xB)`` held in
9-bit fixed point (8 fractional bits).  On the 1/256 grid the weights are exact, and with small integer texels
every product and sum is exact in float32, so the GPU must equal the NumPy model bit for bit; the same points
are chosen so that most of them differ from the nearest texel, which the test asserts too (a nearest-point
fetch cannot pass it).

The tensor-map test needs sm_90 (TMA) and is skipped before; it loads tiles of a matrix whose size is not a
multiple of the box (edge tiles read zeros past the end), with the map placed after an ``int``.  The driver
places a 64-aligned struct by its constant-bank address (at 48 on sm_90, see DRIVER_LAYOUT), and cuproc.launch
packs each argument at the offset the driver reports, in both conventions and both launch forms.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, Stream
from cuproc import memory as mem
from cuproc.arrays import CudaArray, MipmappedArray
from cuproc.errors import InvalidValueError
from cuproc.launch import launch
from cuproc.nvrtc import is_nvrtc_available
from cuproc.program import Program
from cuproc.tensor_map import TensorMap, param_type
from cuproc.textures import SurfaceObject, TextureObject

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)
if not is_nvrtc_available():
    pytest.skip("no NVRTC on this machine (pip install 'cuproc[nvrtc]')", allow_module_level=True)

KERNELS = r"""
extern "C" __global__ void fetch2d(cudaTextureObject_t tex, float* out, const float* xs, const float* ys, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = tex2D<float>(tex, xs[i], ys[i]);
}
extern "C" __global__ void fetch3d(cudaTextureObject_t tex, float* out, int w, int h, int d) {
    int x = threadIdx.x, y = blockIdx.x, z = blockIdx.y;
    if (x < w && y < h && z < d) out[(z * h + y) * w + x] = tex3D<float>(tex, x + 0.5f, y + 0.5f, z + 0.5f);
}
extern "C" __global__ void fetch_layered(cudaTextureObject_t tex, float* out, int w, int h, int layers) {
    int x = threadIdx.x, y = blockIdx.x, layer = blockIdx.y;
    if (x < w && y < h && layer < layers)
        out[(layer * h + y) * w + x] = tex2DLayered<float>(tex, x + 0.5f, y + 0.5f, layer);
}
extern "C" __global__ void fetch_linear(cudaTextureObject_t tex, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = tex1Dfetch<float>(tex, i);
}
extern "C" __global__ void fetch_lod(cudaTextureObject_t tex, float* out, float level) {
    out[threadIdx.x] = tex2DLod<float>(tex, 0.5f, 0.5f, level);
}
extern "C" __global__ void surface_write(cudaSurfaceObject_t surf, int w, int h) {
    int x = threadIdx.x, y = blockIdx.x;
    if (x < w && y < h) surf2Dwrite<float>(x * 1000.0f + y, surf, x * (int)sizeof(float), y);
}
extern "C" __global__ void surface_read(cudaSurfaceObject_t surf, float* out, int w, int h) {
    int x = threadIdx.x, y = blockIdx.x;
    if (x < w && y < h) out[y * w + x] = surf2Dread<float>(surf, x * (int)sizeof(float), y);
}
"""

# A tile loader with TMA (cp.async.bulk.tensor) and an mbarrier, in inline PTX (sm_90).  The map is declared as
# CUDA 12's cuda.h and cuda::ptx declare CUtensorMap: 128 bytes, alignas(64); after the int it lands at 64.
TMA = r"""
struct alignas(64) TensorMap { unsigned long long opaque[16]; };
#define BOX_W 16
#define BOX_H 8
extern "C" __global__ void tma_load_tile(int tag, const __grid_constant__ TensorMap tmap, float* out, int tiles_x) {
    __shared__ alignas(128) float tile[BOX_H * BOX_W];
    __shared__ alignas(8) unsigned long long bar;
    unsigned bar_addr = (unsigned)__cvta_generic_to_shared(&bar);
    unsigned tile_addr = (unsigned)__cvta_generic_to_shared(tile);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar_addr) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        unsigned long long state;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;"
                     : "=l"(state) : "r"(bar_addr), "r"((unsigned)(BOX_W * BOX_H * sizeof(float))) : "memory");
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3}], [%4];"
                     :: "r"(tile_addr), "l"(reinterpret_cast<unsigned long long>(&tmap)),
                        "r"((int)blockIdx.x * BOX_W), "r"((int)blockIdx.y * BOX_H), "r"(bar_addr) : "memory");
        asm volatile("{\n\t.reg .pred ready;\n"
                     "TMA_WAIT:\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], 0;\n\t"
                     "@!ready bra TMA_WAIT;\n}" :: "r"(bar_addr) : "memory");
        (void)state;
    }
    __syncthreads();
    int base = (blockIdx.y * tiles_x + blockIdx.x) * BOX_H * BOX_W;
    for (int i = threadIdx.x; i < BOX_H * BOX_W; i += blockDim.x) out[base + i] = tile[i] + (float)tag;
}
"""
BOX = (8, 16)      # (rows, columns): BOX_H, BOX_W above


@pytest.fixture(scope="module")
def module():
    pc = cuproc.use_device(0)
    mod = Program(KERNELS, name="arrays_test.cu").compile().load()
    yield mod
    mod.unload()
    pc.release()


def _download(buf: DeviceBuffer, shape, dtype=np.float32) -> np.ndarray:
    out = np.empty(shape, dtype)
    mem.copy(out, buf)
    return out


# ------------------------------------------------------------------------------------------------ the model
def bilinear(texels: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """CUDA's linear filtering of a 2-D texture, clamp addressing, unnormalized coordinates (the programming
    guide's formula), in float64."""
    h, w = texels.shape
    xb, yb = xs.astype(np.float64) - 0.5, ys.astype(np.float64) - 0.5
    i, j = np.floor(xb).astype(int), np.floor(yb).astype(int)
    a = np.round((xb - i) * 256) / 256          # 9-bit fixed point, 8 fractional bits
    b = np.round((yb - j) * 256) / 256
    i0, i1 = np.clip(i, 0, w - 1), np.clip(i + 1, 0, w - 1)
    j0, j1 = np.clip(j, 0, h - 1), np.clip(j + 1, 0, h - 1)
    t = texels.astype(np.float64)
    return ((1 - a) * (1 - b) * t[j0, i0] + a * (1 - b) * t[j0, i1] + (1 - a) * b * t[j1, i0]
            + a * b * t[j1, i1])


def nearest(texels: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    h, w = texels.shape
    return texels[np.clip(np.floor(ys).astype(int), 0, h - 1), np.clip(np.floor(xs).astype(int), 0, w - 1)]


def _points(w: int, h: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Points on the 1/256 grid over the whole texture, [0, w) x [0, h): the outer half texels filter with a
    clamped neighbour index (beyond the texture, the guide's coordinate clamping and the index clamping of the
    model part ways, so no point is taken there)."""
    rng = np.random.default_rng(seed)
    xs = rng.integers(0, w * 256, n) / 256
    ys = rng.integers(0, h * 256, n) / 256
    return xs.astype(np.float32), ys.astype(np.float32)


def _fetch2d(module, tex, xs, ys) -> np.ndarray:
    n = len(xs)
    with DeviceBuffer(4 * n) as dx, DeviceBuffer(4 * n) as dy, DeviceBuffer(4 * n) as out:
        mem.copy(dx, xs)
        mem.copy(dy, ys)
        launch(module.get_function("fetch2d"), (n + 127) // 128, 128, (tex, out, dx, dy, np.int32(n)))
        return _download(out, n)


# ------------------------------------------------------------------------------------------------ textures
def test_bilinear_fetch_is_cudas_filter_within_its_precision_and_not_nearest_point(module):
    """Measured on an H200 (driver 580, 2026-11-29): on the 1/256 grid the hardware's result is NOT the guide's
    formula exactly (83% of 8192 points differ, by up to 0.18 for texels 0..63, every result a multiple of
    1/256): the filter computes in reduced fixed-point precision.  So the check is the guide's formula within that
    precision -- one 1/256 step of the largest texel -- and unlike nearest-point sampling beyond it."""
    rng = np.random.default_rng(39)
    texels = rng.integers(0, 64, (12, 16)).astype(np.float32)
    a = CudaArray.create(16, 12, dtype="float32")
    a.copy_from(texels)
    tex = TextureObject.create(a, filter_mode="linear", address_mode="clamp")
    xs, ys = _points(16, 12, 8192, seed=1)
    got = _fetch2d(module, tex, xs, ys).astype(np.float64)
    want = bilinear(texels, xs, ys)
    tolerance = float(texels.max()) / 256
    error = np.abs(got - want)
    assert error.max() <= tolerance, f"{int((error > tolerance).sum())} points off by up to {error.max()}"
    point = nearest(texels, xs, ys)
    far = np.abs(want - point) > 2 * tolerance          # where the two filters tell apart beyond the precision
    assert far.mean() > 0.5, "the points chosen do not tell bilinear from nearest-point filtering"
    assert (np.abs(got[far] - point[far]) > tolerance).all()


def test_point_filtering_is_exact(module):
    rng = np.random.default_rng(7)
    texels = rng.random((9, 13)).astype(np.float32)
    a = CudaArray.create(13, 9, dtype="float32")
    a.copy_from(texels)
    tex = TextureObject.create(a, filter_mode="point")
    xs, ys = _points(13, 9, 4096, seed=2)
    np.testing.assert_array_equal(_fetch2d(module, tex, xs, ys), nearest(texels, xs, ys))


def test_8_bit_texels_read_as_normalized_floats(module):
    """read_mode='normalized_float': an unsigned 8-bit texel v reads as v / 255 (the driver's promotion)."""
    texels = np.arange(256, dtype=np.uint8).reshape(16, 16)
    a = CudaArray.create(16, 16, dtype="uint8")
    a.copy_from(texels)
    tex = TextureObject.create(a, read_mode="normalized_float")
    xs, ys = _points(16, 16, 2048, seed=6)
    got = _fetch2d(module, tex, xs, ys)
    np.testing.assert_allclose(got, nearest(texels, xs, ys) / np.float32(255), rtol=0, atol=1e-6)


def test_a_surface_write_reads_back_by_copy_and_by_kernel(module):
    w, h = 24, 10
    a = CudaArray.create(w, h, dtype="float32", surface=True)
    surf = SurfaceObject.create(a)
    launch(module.get_function("surface_write"), h, 32, (surf, np.int32(w), np.int32(h)))
    want = (np.arange(w)[None, :] * 1000.0 + np.arange(h)[:, None]).astype(np.float32)
    back = np.zeros((h, w), np.float32)
    a.copy_to(back)                                 # (synchronous: after the kernel on the default stream)
    np.testing.assert_array_equal(back, want)
    with DeviceBuffer(back.nbytes) as out:
        read = module.get_function("surface_read").prepare(["unsigned long long", "float*", "int", "int"], h, 32,
                                                           convention="params")
        read(surf, out, w, h)
        np.testing.assert_array_equal(_download(out, (h, w)), want)


def test_a_3d_array_round_trip_and_a_fetch_of_every_texel(module):
    w, h, d = 20, 6, 5
    rng = np.random.default_rng(3)
    vol = rng.random((d, h, w)).astype(np.float32)
    a = CudaArray.create(w, h, d, dtype="float32")
    s = Stream()
    a.copy_from(vol, stream=s)
    back = np.zeros_like(vol)
    a.copy_to(back, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(back, vol)
    with DeviceBuffer(vol.nbytes) as dev:           # device <-> array too, then a region
        a.copy_to(dev)
        np.testing.assert_array_equal(_download(dev, vol.shape), vol)
    part = np.zeros((2, 3, 4), np.float32)
    a.copy_to(part, origin=(5, 2, 1), extent=(4, 3, 2))
    np.testing.assert_array_equal(part, vol[1:3, 2:5, 5:9])
    tex = TextureObject.create(a)                   # point filtering at texel centres: every texel as stored
    with DeviceBuffer(vol.nbytes) as out:
        run = module.get_function("fetch3d").prepare([tex.dtype, "float*", "int", "int", "int"], (h, d), 32)
        run(tex, out, w, h, d)
        np.testing.assert_array_equal(_download(out, vol.shape), vol)


@pytest.mark.parametrize("dims, dtype, channels", [((40, 24), np.float32, 1), ((16, 12), np.uint8, 4),
                                                    ((20, 6, 5), np.float32, 1), ((9, 7, 3), np.int16, 2)])
@pytest.mark.parametrize("on_stream", [False, True])
def test_memory_copy_round_trips_through_arrays(module, dims, dtype, channels, on_stream):
    """host -> array -> device -> array -> host through cuproc.memory.copy alone (cuMemcpy2D/3D, Async on a
    stream), 2-D and 3-D, against NumPy: every element back where it was."""
    s = Stream() if on_stream else None
    a = CudaArray.create(*dims, dtype=np.dtype(dtype).name, channels=channels)
    b = CudaArray.create(*dims, dtype=np.dtype(dtype).name, channels=channels)
    rng = np.random.default_rng(len(dims) * 10 + channels)
    src = (rng.random(a.numpy_shape) * 100).astype(dtype)
    zeros, back = np.zeros_like(src), np.zeros_like(src)   # host memory alive until the stream has run it
    with DeviceBuffer(src.nbytes) as dev:
        mem.copy(a, src, stream=s)
        mem.copy(dev, a, stream=s)
        mem.copy(b, dev, stream=s)
        mem.copy(a, zeros, stream=s)                       # so that the next copy must bring the data back
        mem.copy(a, b, stream=s)
        mem.copy(back, a, stream=s)
        if s is not None:
            s.synchronize()
        np.testing.assert_array_equal(back, src)
        np.testing.assert_array_equal(_download(dev, src.shape, dtype), src)   # the device copy in between
    a.close()
    b.close()


def test_a_layered_array(module):
    w, h, layers = 16, 4, 3
    data = np.stack([np.full((h, w), 10.0 * k, np.float32) + np.arange(w, dtype=np.float32) for k in range(layers)])
    a = CudaArray.create(w, h, layers, dtype="float32", layered=True)
    a.copy_from(data)
    one = np.zeros((h, w), np.float32)
    a.copy_to(one, origin=(0, 0, 2), extent=(w, h, 1))
    np.testing.assert_array_equal(one, data[2])
    tex = TextureObject.create(a)
    with DeviceBuffer(data.nbytes) as out:
        launch(module.get_function("fetch_layered"), (h, layers), 32, (tex, out, np.int32(w), np.int32(h),
                                                                       np.int32(layers)))
        np.testing.assert_array_equal(_download(out, data.shape), data)


def test_linear_and_pitched_memory_textures(module):
    n = 1000
    values = np.arange(n, dtype=np.float32) * 0.5
    # a large allocation starts at a multiple of TEXTURE_ALIGNMENT (512); a small one may not
    with DeviceBuffer(1 << 21) as buf, DeviceBuffer(values.nbytes) as out:
        mem.copy(buf, values)
        tex = TextureObject.create(buf, dtype="float32", nbytes=values.nbytes)
        launch(module.get_function("fetch_linear"), (n + 127) // 128, 128, (tex, out, np.int32(n)))
        np.testing.assert_array_equal(_download(out, n), values)
    pitch_align = cuproc.Device(0).attribute("TEXTURE_PITCH_ALIGNMENT")
    w, h = 10, 7
    pitch = -(-w * 4 // pitch_align) * pitch_align
    image = np.random.default_rng(5).random((h, w)).astype(np.float32)
    with DeviceBuffer(1 << 21) as buf:
        mem.copy_2d(buf, pitch, image, w * 4, w * 4, h)
        tex = TextureObject.create(buf, dtype="float32", width=w, height=h, pitch=pitch)
        xs, ys = _points(w, h, 2048, seed=9)
        np.testing.assert_array_equal(_fetch2d(module, tex, xs, ys), nearest(image, xs, ys))


def test_a_mipmapped_texture_reads_each_level(module):
    m = MipmappedArray.create(16, 16, levels=3, dtype="float32")
    for level in range(3):
        lv = m.level(level)
        lv.copy_from(np.full(lv.numpy_shape, float(level + 1), np.float32))
    tex = TextureObject.create(m, normalized_coords=True)
    fn = module.get_function("fetch_lod")
    with DeviceBuffer(4 * 32) as out:
        for level in range(3):
            launch(fn, 1, 32, (tex, out, np.float32(level)))
            assert (_download(out, 32) == level + 1).all()


def test_a_texture_keeps_its_array_alive_on_the_gpu(module):
    texels = np.arange(12 * 16, dtype=np.float32).reshape(12, 16)
    a = CudaArray.create(16, 12, dtype="float32")
    a.copy_from(texels)
    tex = TextureObject.create(a)
    del a                                            # the texture holds it
    gc.collect()
    for _ in range(8):                               # churn: new arrays get the freed handles, if any were freed
        CudaArray.create(16, 12, dtype="float32").copy_from(np.zeros((12, 16), np.float32))
    xs, ys = _points(16, 12, 1024, seed=4)
    np.testing.assert_array_equal(_fetch2d(module, tex, xs, ys), nearest(texels, xs, ys))


# ------------------------------------------------------------------------------------------------ tensor maps
@pytest.fixture(scope="module")
def tma(module):
    major, _ = cuproc.Device(0).compute_capability
    if major < 9:
        pytest.skip(f"TMA needs sm_90 or newer; device 0 is sm_{major}x")
    mod = Program(TMA, name="tma_test.cu").compile().load()
    yield mod.get_function("tma_load_tile")
    mod.unload()


def _tiles(matrix: np.ndarray) -> np.ndarray:
    """The boxes of ``matrix`` in launch order (row of tiles by row), zeros past its edges."""
    bh, bw = BOX
    rows, cols = -(-matrix.shape[0] // bh), -(-matrix.shape[1] // bw)
    padded = np.zeros((rows * bh, cols * bw), matrix.dtype)
    padded[:matrix.shape[0], :matrix.shape[1]] = matrix
    return padded.reshape(rows, bh, cols, bw).transpose(0, 2, 1, 3).reshape(-1)


#: Where the driver puts each parameter of tma_load_tile(int, TensorMap (alignas 64), float*, int), per compute
#: capability: the compiler aligns a parameter at its address in constant bank 0, where sm_90 starts the
#: parameters at 0x210 (sm_75/sm_80 at 0x160, sm_100/sm_120 at 0x380).  Read from NVRTC 13.5's cubins
#: (EIATTR_KPARAM_INFO); cuFuncGetParamInfo reports the same (the refusal issue 39 quotes: offset 48).
DRIVER_LAYOUT = {(9, 0): [(0, 4), (48, 128), (176, 8), (184, 4)], (10, 0): [(0, 4), (64, 128), (192, 8), (200, 4)],
                 (12, 0): [(0, 4), (64, 128), (192, 8), (200, 4)]}
TMA_SIGNATURE = ["int", param_type(), "float*", "int"]


def test_the_driver_places_the_tensor_map_by_its_constant_bank_address(tma):
    """What cuproc's packing must agree with: (offset, size) per parameter, as the driver reports them."""
    info = tma.param_info()
    if info is None:
        pytest.skip("this driver handle has no cuFuncGetParamInfo (CUDA 12.4+)")
    cc = cuproc.Device(0).compute_capability
    if cc not in DRIVER_LAYOUT:
        pytest.skip(f"no recorded layout for sm_{cc[0]}{cc[1]}: the driver says {info}")
    assert info == DRIVER_LAYOUT[cc]


@pytest.mark.parametrize("convention", ["buffer", "params"])
@pytest.mark.parametrize("form", ["one-shot", "prepared"])
def test_tma_loads_tiles_edge_tiles_included(tma, form, convention):
    """cuproc packs the map where the driver says the kernel reads it (48 after the int on sm_90, 64 on sm_100),
    in both conventions; a driver that cannot say refuses a packed buffer before the call."""
    info = tma.param_info()
    rows, cols = 37, 72                               # not multiples of the 8 x 16 box: edge tiles
    matrix = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + 1
    grid = (-(-cols // BOX[1]), -(-rows // BOX[0]))
    with DeviceBuffer(matrix.nbytes) as src, DeviceBuffer(4 * grid[0] * grid[1] * BOX[0] * BOX[1]) as out:
        mem.copy(src, matrix)
        tm = TensorMap.tiled(src, "float32", matrix.shape, BOX)
        if info is None and convention == "buffer":   # (before CUDA 12.4) where the map goes is unknown
            with pytest.raises(InvalidValueError, match="convention='params'"):
                launch(tma, grid, 128, (np.int32(1000), tm, out, np.int32(grid[0])), convention=convention)
            return
        if form == "one-shot":
            launch(tma, grid, 128, (np.int32(1000), tm, out, np.int32(grid[0])), convention=convention)
        else:
            run = tma.prepare(TMA_SIGNATURE, grid, 128, convention=convention)
            if info is not None:
                assert run.prepared.packed.offsets == [offset for offset, _ in info]
            run(1000, tm, out, grid[0])
        got = _download(out, grid[0] * grid[1] * BOX[0] * BOX[1])
    np.testing.assert_array_equal(got - 1000, _tiles(matrix))
