"""The fake driver itself, driven through cuproc's C-named driver layer (not the object layer).

Each test starts from ``fake.reset()``; the records (stale uses, binding errors) are asserted
exactly, since provoking them is the point here.  So the tests run with reuse off (``drv``: every
handle and cuMemAlloc address new, every stale use counted), except those of reuse itself
(``reusing``), which is the fake's default and what the object-layer tests run under.
"""
from __future__ import annotations

import ctypes
import os
import struct
import subprocess

import pytest

import cuproc
from cuproc import ffi
from fakedriver import fake_image
from threads import in_thread, run_threads

SUCCESS = 0
INVALID_VALUE = 1
NOT_INITIALIZED = 3
INVALID_IMAGE = 200
INVALID_CONTEXT = 201
INVALID_HANDLE = 400
NOT_FOUND = 500
CONTEXT_IS_DESTROYED = 709


@pytest.fixture(scope="session")
def session_driver(fake):
    drv = cuproc.Driver(library=str(fake.path))
    assert drv.cuInit(0) == SUCCESS
    return drv


@pytest.fixture
def drv(fake, session_driver):
    fake.reset()
    fake.set_reuse(False)
    yield session_driver
    fake.reset()
    fake.set_reuse(True)


@pytest.fixture
def reusing(drv, fake):
    """``drv`` with the fake's default: handles and addresses handed out again."""
    fake.set_reuse(True)
    return drv


def ok(rc: int) -> None:
    assert rc == SUCCESS, rc


def new_ctx(drv, dev: int = 0):
    ctx = ffi.new("CUcontext *")
    ok(drv.cuCtxCreate(ctx, ffi.NULL, 0, dev))
    return ctx[0]


def alloc(drv, n: int) -> int:
    p = ffi.new("CUdeviceptr *")
    ok(drv.cuMemAlloc(p, n))
    return p[0]


def load(drv, image: bytes):
    mod = ffi.new("CUmodule *")
    ok(drv.cuModuleLoadData(mod, image))
    return mod[0]


def function(drv, mod, name: str):
    f = ffi.new("CUfunction *")
    ok(drv.cuModuleGetFunction(f, mod, name.encode()))
    return f[0]


def params(*values: tuple[str, int]):
    """kernelParams for (ctype, value) pairs; returns the array and what keeps it alive."""
    boxes = [ffi.new(f"{ctype} *", value) for ctype, value in values]
    return ffi.new("void *[]", [ffi.cast("void *", b) for b in boxes]), boxes


# ---------------------------------------------------------------- resolution
def test_resolution_through_cuproc(drv, fake):
    assert drv.has("cuMemAlloc")
    assert drv.resolution("cuMemAlloc").status == "resolved"
    assert drv.resolution("cuCtxCreate").entry_point == "cuCtxCreate_v4"
    assert drv.resolution("cuTexRefCreate").status == "symbol_not_found"  # not modelled
    count = ffi.new("int *")
    ok(drv.cuDeviceGetCount(count))
    assert count[0] == 2
    fake.set_device_count(4)
    ok(drv.cuDeviceGetCount(count))
    assert count[0] == 4


def test_lookup_rules(fake):
    lookup = fake.lib.cuGetProcAddress_v2
    lookup.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_ulonglong,
                       ctypes.POINTER(ctypes.c_int)]
    pfn, status = ctypes.c_void_p(), ctypes.c_int(-1)
    assert lookup(b"cuMemAlloc", ctypes.byref(pfn), 13010, 0, ctypes.byref(status)) == INVALID_VALUE
    assert lookup(b"cuMemAlloc", ctypes.byref(pfn), 13000, 0, ctypes.byref(status)) == SUCCESS
    assert pfn.value and status.value == 0
    assert lookup(b"cuNoSuchThing", ctypes.byref(pfn), 13000, 0, ctypes.byref(status)) == SUCCESS
    assert not pfn.value and status.value == 1
    # an older ABI than the one implemented (cuCtxCreate v1 at CUDA 2.0) is refused, not faked
    assert lookup(b"cuCtxCreate", ctypes.byref(pfn), 2000, 0, ctypes.byref(status)) == SUCCESS
    assert not pfn.value and status.value == 2


def test_error_names(drv):
    s = ffi.new("const char **")
    ok(drv.cuGetErrorName(INVALID_HANDLE, s))
    assert ffi.string(s[0]) == b"CUDA_ERROR_INVALID_HANDLE"
    assert drv.cuGetErrorName(123456, s) == INVALID_VALUE


# ---------------------------------------------------------------- stale uses
def test_double_free_is_stale(drv, fake):
    new_ctx(drv)
    p = alloc(drv, 1024)
    assert fake.live("device_alloc") == 1 and fake.device_bytes_live(0) == 1024
    ok(drv.cuMemFree(p))
    assert drv.cuMemFree(p) == INVALID_VALUE
    assert fake.stale_count() == 1
    assert fake.stale_calls() == ["cuMemFree"]
    assert fake.live("device_alloc") == 0 and fake.device_bytes_live(0) == 0


def test_destroyed_handles_are_stale(drv, fake):
    ctx = new_ctx(drv)
    s = ffi.new("CUstream *")
    ok(drv.cuStreamCreate(s, 0))
    ok(drv.cuStreamDestroy(s[0]))
    assert drv.cuStreamSynchronize(s[0]) == INVALID_HANDLE
    ok(drv.cuCtxDestroy(ctx))
    assert drv.cuCtxPushCurrent(ctx) == CONTEXT_IS_DESTROYED
    assert drv.cuCtxSynchronize(ffi.NULL) == INVALID_CONTEXT  # nothing current: a binding error
    assert fake.stale_calls() == ["cuStreamSynchronize", "cuCtxPushCurrent"]
    assert fake.binding_errors() == 1


def test_context_destroy_frees_its_resources(drv, fake):
    ctx = new_ctx(drv)
    p = alloc(drv, 4096)
    s = ffi.new("CUstream *")
    ok(drv.cuStreamCreate(s, 0))
    e = ffi.new("CUevent *")
    ok(drv.cuEventCreate(e, 0))
    mod = load(drv, fake_image({"k": [8]}, {"g": 64}))
    assert [fake.live(k) for k in ("context", "device_alloc", "stream", "event", "module", "global")] == [1] * 6
    ok(drv.cuCtxDestroy(ctx))
    assert [fake.live(k) for k in ("context", "device_alloc", "stream", "event", "module", "global")] == [0] * 6
    assert fake.device_bytes_live(0) == 0
    current = ffi.new("CUcontext *")
    ok(drv.cuCtxGetCurrent(current))
    assert current[0] == ffi.NULL  # popped from this thread's stack
    ctx2 = new_ctx(drv)
    assert drv.cuMemFree(p) == INVALID_VALUE
    assert drv.cuModuleUnload(mod) == INVALID_HANDLE
    assert fake.stale_count() == 2
    assert ctx2 != ctx  # handles are never reused


# ---------------------------------------------------------------- contexts and threads
def test_new_thread_has_no_current_context(drv, fake):
    ctx = new_ctx(drv)
    seen = {}

    def worker():
        current = ffi.new("CUcontext *")
        seen["current"] = drv.cuCtxGetCurrent(current), current[0]
        seen["alloc"] = drv.cuMemAlloc(ffi.new("CUdeviceptr *"), 16)
        ok(drv.cuCtxPushCurrent(ctx))
        seen["alloc_bound"] = drv.cuMemAlloc(ffi.new("CUdeviceptr *"), 16)

    assert in_thread(worker) == {"value": None}
    assert seen == {"current": (SUCCESS, ffi.NULL), "alloc": INVALID_CONTEXT, "alloc_bound": SUCCESS}
    assert fake.binding_errors() == 1 and fake.stale_count() == 0
    current = ffi.new("CUcontext *")
    ok(drv.cuCtxGetCurrent(current))
    assert current[0] == ctx


def test_stack_push_pop_set(drv, fake):
    a, b = new_ctx(drv), new_ctx(drv, 1)
    current, dev = ffi.new("CUcontext *"), ffi.new("CUdevice *")
    ok(drv.cuCtxGetDevice(dev, ffi.NULL))
    assert dev[0] == 1
    ok(drv.cuCtxPopCurrent(current))
    assert current[0] == b
    ok(drv.cuCtxGetDevice(dev, ffi.NULL))
    assert dev[0] == 0
    ok(drv.cuCtxSetCurrent(b))  # replaces a
    ok(drv.cuCtxGetCurrent(current))
    assert current[0] == b
    ok(drv.cuCtxSetCurrent(ffi.NULL))
    ok(drv.cuCtxSetCurrent(ffi.NULL))  # no-op on an empty stack
    assert drv.cuCtxPopCurrent(current) == INVALID_CONTEXT
    ok(drv.cuCtxGetDevice(dev, a))  # explicit context: none needs to be current
    assert fake.stale_count() == 0 and fake.binding_errors() == 0


def test_primary_context_refcount(drv, fake):
    first, again = ffi.new("CUcontext *"), ffi.new("CUcontext *")
    ok(drv.cuDevicePrimaryCtxRetain(first, 0))
    ok(drv.cuDevicePrimaryCtxRetain(again, 0))
    assert first[0] == again[0]
    assert fake.primary_refcount(0) == 2 and fake.primary_active(0) and fake.live("primary") == 1
    ok(drv.cuCtxPushCurrent(first[0]))
    alloc(drv, 256)
    ok(drv.cuCtxPopCurrent(ffi.NULL))
    ok(drv.cuDevicePrimaryCtxRelease(0))
    assert fake.primary_active(0)
    ok(drv.cuDevicePrimaryCtxRelease(0))
    assert fake.primary_refcount(0) == 0 and not fake.primary_active(0)
    assert fake.live("device_alloc") == 0  # went with the context
    flags, active = ffi.new("unsigned int *"), ffi.new("int *")
    ok(drv.cuDevicePrimaryCtxGetState(0, flags, active))
    assert active[0] == 0
    assert drv.cuCtxPushCurrent(first[0]) == CONTEXT_IS_DESTROYED  # stale
    ok(drv.cuDevicePrimaryCtxRetain(again, 0))
    assert again[0] != first[0]  # a new activation, a new handle
    ok(drv.cuCtxPushCurrent(again[0]))
    p = alloc(drv, 256)
    ok(drv.cuDevicePrimaryCtxReset(0))  # its contents go; the retain and the handle stay
    assert fake.primary_refcount(0) == 1 and fake.primary_active(0) and fake.live("device_alloc") == 0
    assert drv.cuMemFree(p) == INVALID_VALUE
    alloc(drv, 256)
    ok(drv.cuDevicePrimaryCtxRelease(0))
    assert not fake.primary_active(0) and fake.live("device_alloc") == 0
    assert drv.cuDevicePrimaryCtxRelease(0) == INVALID_CONTEXT  # over-release
    assert fake.stale_calls() == ["cuCtxPushCurrent", "cuMemFree", "cuDevicePrimaryCtxRelease"]


# ---------------------------------------------------------------- binding
def test_another_current_context_is_routed_as_the_real_driver_routes_it(drv, fake):
    """What driver 580 did on an H200 with context B current and objects of context A (2026-11-29, tests/
    test_gpu_routing.py measures it): calls that name a stream, event or module of A run in A; a synchronous
    memset or copy of A's memory runs in B (misrouted: recorded); a launch of A's function and a record of A's
    event on the default stream are refused with CUDA_ERROR_INVALID_HANDLE (binding errors); with no context
    current, a binding error (INVALID_CONTEXT)."""
    a = new_ctx(drv)
    p = alloc(drv, 64)
    s, e = ffi.new("CUstream *"), ffi.new("CUevent *")
    ok(drv.cuStreamCreate(s, 0))
    ok(drv.cuEventCreate(e, 0))
    f = function(drv, load(drv, fake_image({"k": [8]})), "k")
    arg = ffi.new("unsigned long long *", p)
    params = ffi.new("void *[1]", [arg])
    new_ctx(drv)  # b is current now
    ok(drv.cuStreamSynchronize(s[0]))
    ok(drv.cuEventRecord(e[0], s[0]))
    ok(drv.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s[0], params, ffi.NULL))
    assert fake.binding_errors() == 0 and fake.misrouted_count() == 0
    assert drv.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, ffi.NULL, params, ffi.NULL) == INVALID_HANDLE
    assert drv.cuEventRecord(e[0], ffi.NULL) == INVALID_HANDLE
    assert fake.binding_calls() == ["cuLaunchKernel", "cuEventRecord"]     # (each refused on the default stream)
    ok(drv.cuMemsetD8(p, 1, 64))                    # carried out, in b
    out = ffi.new("char[64]")
    ok(drv.cuMemcpyDtoH(out, p, 64))
    assert ffi.buffer(out)[:] == b"\x01" * 64
    ok(drv.cuMemsetD8Async(p, 2, 64, s[0]))         # on a's named stream: routed there, not misrouted
    q = alloc(drv, 64)
    ok(drv.cuMemcpyDtoD(q, p, 64))                  # b's and a's memory, b current: a's side is unordered
    assert fake.misrouted_count() == 3
    assert fake.misrouted_calls() == ["cuMemsetD8", "cuMemcpyDtoH", "cuMemcpyDtoD"]
    sb = ffi.new("CUstream *")
    ok(drv.cuStreamCreate(sb, 0))                   # a stream of b: a's function and event are refused there
    assert drv.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, sb[0], params, ffi.NULL) == INVALID_HANDLE
    assert drv.cuEventRecord(e[0], sb[0]) == INVALID_HANDLE
    ok(drv.cuMemFree(p))                            # routed by the pointer
    out_ctx = ffi.new("CUcontext *")
    ok(drv.cuCtxPopCurrent(out_ctx))
    ok(drv.cuCtxPopCurrent(out_ctx))                # none current now
    assert drv.cuStreamSynchronize(s[0]) == INVALID_CONTEXT
    assert drv.cuMemcpyPeer(q, a, q, a, 64) == INVALID_CONTEXT     # both contexts named, none current
    assert fake.stale_count() == 0


def test_memory_round_trip(drv, fake):
    np = pytest.importorskip("numpy")
    new_ctx(drv)
    host = ffi.new("void **")
    ok(drv.cuMemAllocHost(host, 4096))
    pinned = np.frombuffer(ffi.buffer(host[0], 4096), dtype=np.uint8)
    pinned[:] = np.arange(4096) % 251
    p = alloc(drv, 4096)
    ok(drv.cuMemcpyHtoD(p, host[0], 4096))
    out = np.zeros(4096, np.uint8)
    ok(drv.cuMemcpy(ffi.cast("CUdeviceptr", ffi.from_buffer(out)), p, 4096))  # unified: host target
    assert (out == pinned).all()
    ok(drv.cuMemsetD32(p, 0x01020304, 4))
    ok(drv.cuMemcpyDtoH(ffi.from_buffer(out), p, 16))
    assert list(out[:4]) == [4, 3, 2, 1]
    assert drv.cuMemcpyDtoH(ffi.from_buffer(out), p + 1, 4096) == INVALID_VALUE  # overrun: stale
    kind, size = ffi.new("unsigned int *"), ffi.new("size_t *")
    ok(drv.cuPointerGetAttribute(kind, 2, p + 10))
    ok(drv.cuPointerGetAttribute(size, 12, p + 10))
    assert (kind[0], size[0]) == (2, 4096)
    ok(drv.cuPointerGetAttribute(kind, 2, ffi.cast("CUdeviceptr", host[0])))
    assert kind[0] == 1
    assert drv.cuPointerGetAttribute(kind, 2, fake.device_window() - 4096) == INVALID_VALUE  # a query
    # a 2D copy: 4 rows of 8 bytes out of a pitch-16 device buffer
    copy = ffi.new("CUDA_MEMCPY2D *")
    copy.srcMemoryType, copy.srcDevice, copy.srcPitch = 2, p, 16
    copy.dstMemoryType, copy.dstHost, copy.dstPitch = 1, ffi.from_buffer(out), 8
    copy.WidthInBytes, copy.Height = 8, 4
    ok(drv.cuMemcpy2D(copy))
    ok(drv.cuMemFreeHost(host[0]))
    assert drv.cuMemFreeHost(host[0]) == INVALID_VALUE
    assert fake.stale_calls() == ["cuMemcpyDtoH", "cuMemFreeHost"]
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    ok(drv.cuMemGetInfo(free, total))
    assert total[0] - free[0] == 4096


def test_pool_accounting(drv, fake):
    new_ctx(drv)
    s = ffi.new("CUstream *")
    ok(drv.cuStreamCreate(s, 0))
    p = ffi.new("CUdeviceptr *")
    ok(drv.cuMemAllocAsync(p, 1000, s[0]))
    assert fake.pool_used(0) == 1000 and fake.live("async_alloc") == 1
    pool = ffi.new("CUmemoryPool *")
    ok(drv.cuDeviceGetDefaultMemPool(pool, 0))
    used = ffi.new("cuuint64_t *")
    ok(drv.cuMemPoolGetAttribute(pool[0], 7, used))  # USED_MEM_CURRENT
    assert used[0] == 1000
    ok(drv.cuMemFreeAsync(p[0], s[0]))
    assert fake.pool_used(0) == 0 and fake.device_bytes_live(0) == 0
    ok(drv.cuMemPoolGetAttribute(pool[0], 8, used))  # USED_MEM_HIGH
    assert used[0] == 1000
    ok(drv.cuMemAllocAsync(p, 500, ffi.NULL))  # legacy stream of the current context
    ok(drv.cuCtxDestroy(drv_current(drv)))
    assert fake.live("async_alloc") == 0          # freed with its context ...
    assert fake.pool_used(0) == 500               # ... but still counted by its pool, as on driver 580


def test_stream_ordered_addresses_are_reused_like_a_pools(drv, fake):
    """A range freed by cuMemFreeAsync goes to the next allocation from its pool that fits (most recent
    first), so a late second free of the old address frees the new allocation and the new one's own
    free is then a stale use.  cuMemAlloc addresses are never reused."""
    new_ctx(drv)
    s = ffi.new("CUstream *")
    ok(drv.cuStreamCreate(s, 0))
    p = ffi.new("CUdeviceptr *")
    ok(drv.cuMemAllocAsync(p, 256, s[0]))
    x = p[0]
    ok(drv.cuMemFreeAsync(x, s[0]))
    ok(drv.cuMemAllocAsync(p, 4096, s[0]))                 # does not fit in x's range: a new address
    big = p[0]
    assert big != x and fake.async_reuses() == 0
    ok(drv.cuMemAllocAsync(p, 100, s[0]))                  # fits: gets x back
    assert p[0] == x and fake.async_reuses() == 1 and fake.pool_used(0) == 4096 + 100
    ok(drv.cuMemFreeAsync(x, s[0]))                         # a "late" free of x frees the new allocation ...
    assert drv.cuMemFreeAsync(x, s[0]) == INVALID_VALUE    # ... whose own free is then stale
    assert fake.stale_calls() == ["cuMemFreeAsync"] and fake.pool_used(0) == 4096
    ok(drv.cuMemFreeAsync(big, s[0]))
    ok(drv.cuMemAllocAsync(p, 4096, s[0]))                 # the most recently freed range first
    assert p[0] == big and fake.async_reuses() == 2
    ok(drv.cuMemFreeAsync(big, s[0]))
    a = alloc(drv, 256)
    ok(drv.cuMemFree(a))
    assert alloc(drv, 256) != a                            # cuMemAlloc: never reused
    fake.reset()                                           # forgets the freed ranges
    new_ctx(drv)
    ok(drv.cuMemAllocAsync(p, 256, ffi.NULL))
    assert p[0] not in (x, big) and fake.async_reuses() == 0


def async_alloc(drv, n: int, stream, pool=None) -> int:
    """cuMemAllocAsync (the device's pool) or cuMemAllocFromPoolAsync (pool) on stream."""
    p = ffi.new("CUdeviceptr *")
    ok(drv.cuMemAllocAsync(p, n, stream) if pool is None else drv.cuMemAllocFromPoolAsync(p, n, pool, stream))
    return p[0]


def new_pool(drv, dev: int = 0):
    props = ffi.new("CUmemPoolProps *")
    props.allocType = 1                  # CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = 1              # CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = dev
    pool = ffi.new("CUmemoryPool *")
    ok(drv.cuMemPoolCreate(pool, props))
    return pool[0]


def test_a_freed_range_goes_back_to_its_own_pool_only(drv, fake):
    """A range freed with cuMemFreeAsync is handed out again by the pool it came from, to
    cuMemAllocAsync (the device's pool) and cuMemAllocFromPoolAsync (a created pool) alike, and by
    no other pool."""
    new_ctx(drv)
    mine = new_pool(drv)
    x = async_alloc(drv, 256, ffi.NULL, mine)
    ok(drv.cuMemFreeAsync(x, ffi.NULL))
    y = async_alloc(drv, 256, ffi.NULL)                     # the device's default pool: not x
    assert y != x and fake.async_reuses() == 0
    ok(drv.cuMemFreeAsync(y, ffi.NULL))
    other = new_pool(drv)
    z = async_alloc(drv, 256, ffi.NULL, other)              # another created pool: neither
    assert z not in (x, y) and fake.async_reuses() == 0
    assert async_alloc(drv, 256, ffi.NULL, mine) == x       # x's own pool gives x back ...
    assert async_alloc(drv, 256, ffi.NULL) == y             # ... and the default pool y
    assert fake.async_reuses() == 2 and fake.stale_count() == 0


def test_a_freed_range_never_moves_to_another_device(drv, fake):
    ctx0 = new_ctx(drv, 0)
    x = async_alloc(drv, 256, ffi.NULL)
    ok(drv.cuMemFreeAsync(x, ffi.NULL))
    new_ctx(drv, 1)                                         # device 1's default pool
    assert async_alloc(drv, 256, ffi.NULL) != x and fake.async_reuses() == 0
    ok(drv.cuMemFreeAsync(async_alloc(drv, 256, ffi.NULL, new_pool(drv, 1)), ffi.NULL))
    ok(drv.cuCtxSetCurrent(ctx0))
    assert async_alloc(drv, 256, ffi.NULL) == x             # x was there for device 0 all along
    assert fake.async_reuses() == 1 and fake.stale_count() == 0


@pytest.mark.parametrize("how", ["cuMemFree", "context destroy", "primary reset", "pool destroy"])
def test_memory_freed_other_than_by_cuMemFreeAsync_is_never_reused(drv, fake, how):
    """Only cuMemFreeAsync gives a range back to its pool.  Freed by cuMemFree, with its context
    (destroyed or reset) or with its pool, a range is gone for good, and the first three stay counted
    as used by the pool (as on driver 580).  The same pool still reuses what cuMemFreeAsync gives it."""
    if how == "primary reset":
        primary = ffi.new("CUcontext *")
        ok(drv.cuDevicePrimaryCtxRetain(primary, 0))
        ok(drv.cuCtxSetCurrent(primary[0]))
    else:
        new_ctx(drv)
    pool = new_pool(drv) if how == "pool destroy" else None
    x = async_alloc(drv, 256, ffi.NULL, pool)
    if how == "cuMemFree":
        ok(drv.cuMemFree(x))
    elif how == "context destroy":
        ok(drv.cuCtxDestroy(drv_current(drv)))
        new_ctx(drv)
    elif how == "primary reset":
        ok(drv.cuDevicePrimaryCtxReset(0))
        ok(drv.cuCtxSetCurrent(primary[0]))                 # the handle lives on while retained
    else:
        ok(drv.cuMemPoolDestroy(pool))
        pool = new_pool(drv)
    assert fake.live("async_alloc") == 0
    if pool is None:
        assert fake.pool_used(0) == 256                     # the default pool still counts x
    y = async_alloc(drv, 256, ffi.NULL, pool)
    assert y != x and fake.async_reuses() == 0
    ok(drv.cuMemFreeAsync(y, ffi.NULL))
    assert async_alloc(drv, 256, ffi.NULL, pool) == y and fake.async_reuses() == 1
    assert fake.stale_count() == 0


def drv_current(drv):
    current = ffi.new("CUcontext *")
    ok(drv.cuCtxGetCurrent(current))
    return current[0]


# ---------------------------------------------------------------- modules, libraries, launches
def test_launch_records_both_conventions(drv, fake):
    new_ctx(drv)
    mod = load(drv, fake_image({"axpy": [4, 8, 8], "fake_pair": [8, 8]}))
    f = function(drv, mod, "axpy")
    offset, size = ffi.new("size_t *"), ffi.new("size_t *")
    ok(drv.cuFuncGetParamInfo(f, 1, offset, size))
    assert (offset[0], size[0]) == (8, 8)
    assert drv.cuFuncGetParamInfo(f, 3, offset, size) == INVALID_VALUE
    p = alloc(drv, 64)
    args, keep = params(("float", 2.0), ("unsigned long long", p), ("unsigned long long", p + 8))
    ok(drv.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, ffi.NULL, args, ffi.NULL))
    expected = struct.pack("<f4xQQ", 2.0, p, p + 8)
    assert fake.last_launch() == ("axpy", expected)

    buf = ffi.new("char[]", expected)
    size_box = ffi.new("size_t *", len(expected))
    extra = ffi.new("void *[]", [ffi.cast("void *", 1), buf, ffi.cast("void *", 2), size_box, ffi.NULL])
    config = ffi.new("CUlaunchConfig *")
    config.gridDimX = config.gridDimY = config.gridDimZ = 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 64, 1, 1
    ok(drv.cuLaunchKernelEx(config, f, ffi.NULL, extra))
    assert fake.last_launch() == ("axpy", expected) and fake.launch_count() == 2

    ok(drv.cuMemFree(p))
    assert drv.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, ffi.NULL, args, ffi.NULL) == INVALID_VALUE
    assert fake.stale_calls() == ["cuLaunchKernel"] and fake.launch_count() == 2
    assert drv.cuModuleGetFunction(ffi.new("CUfunction *"), mod, b"nope") == NOT_FOUND
    assert drv.cuModuleLoadData(ffi.new("CUmodule *"), b"\x7fELF\0") == INVALID_IMAGE


def test_race_detector_counts_mismatches(drv, fake):
    ctx = new_ctx(drv)
    f = function(drv, load(drv, fake_image({"fake_pair": [8, 8]})), "fake_pair")
    args, keep = params(("unsigned long long", 5), ("unsigned long long", 16))
    ok(drv.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, ffi.NULL, args, ffi.NULL))
    assert fake.launch_mismatches() == 0
    args, keep = params(("unsigned long long", 5), ("unsigned long long", 17))
    ok(drv.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, ffi.NULL, args, ffi.NULL))
    assert fake.launch_mismatches() == 1

    def worker(seed: int) -> None:  # each thread its own argument block: never a mismatch
        ok(drv.cuCtxPushCurrent(ctx))
        for i in range(50):
            a = seed * 1000 + i
            own, own_keep = params(("unsigned long long", a), ("unsigned long long", 3 * a + 1))
            ok(drv.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, ffi.NULL, own, ffi.NULL))

    run_threads(worker, 8)
    assert fake.launch_count() == 2 + 8 * 50 and fake.launch_mismatches() == 1


def test_library_kernels_per_context(drv, fake):
    lib = ffi.new("CUlibrary *")
    ok(drv.cuLibraryLoadData(lib, fake_image({"k": [8]}, {"g": 16}), ffi.NULL, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0))
    kernel = ffi.new("CUkernel *")
    ok(drv.cuLibraryGetKernel(kernel, lib[0], b"k"))
    a = new_ctx(drv)
    fa, fb = ffi.new("CUfunction *"), ffi.new("CUfunction *")
    ok(drv.cuKernelGetFunction(fa, kernel[0]))
    g = ffi.new("CUdeviceptr *")
    ok(drv.cuLibraryGetGlobal(g, ffi.NULL, lib[0], b"g"))
    new_ctx(drv)
    ok(drv.cuKernelGetFunction(fb, kernel[0]))
    assert fa[0] != fb[0] and fake.live("function") == 2 and fake.live("global") == 1
    args, keep = params(("unsigned long long", 0))
    ok(drv.cuLaunchKernel(ffi.cast("CUfunction", kernel[0]), 1, 1, 1, 1, 1, 1, 0, ffi.NULL, args, ffi.NULL))
    ok(drv.cuCtxDestroy(a))
    assert fake.live("function") == 1 and fake.live("global") == 0 and fake.live("library") == 1
    ok(drv.cuLibraryUnload(lib[0]))
    assert fake.live("function") == 0 and fake.live("kernel") == 0
    assert fake.stale_count() == 0 and fake.binding_errors() == 0


def test_link(drv, fake):
    state = ffi.new("CUlinkState *")
    ok(drv.cuLinkCreate(0, ffi.NULL, ffi.NULL, state))
    for part in (fake_image({"a": [4]}), fake_image({"b": [8]}, {"g": 4})):
        ok(drv.cuLinkAddData(state[0], 1, ffi.from_buffer(part), len(part), b"part", 0, ffi.NULL, ffi.NULL))
    out, size = ffi.new("void **"), ffi.new("size_t *")
    ok(drv.cuLinkComplete(state[0], out, size))
    new_ctx(drv)
    mod = load(drv, ffi.buffer(out[0], size[0])[:])
    function(drv, mod, "a")
    function(drv, mod, "b")
    ok(drv.cuLinkDestroy(state[0]))
    assert fake.live("link") == 0


# ---------------------------------------------------------------- failure injection, fork
def test_failure_injection(drv, fake):
    new_ctx(drv)
    p = alloc(drv, 8)
    fake.fail("cuMemFree", 700, count=1)
    assert drv.cuMemFree(p) == 700
    assert fake.live("device_alloc") == 1  # nothing was done
    ok(drv.cuMemFree(p))
    fake.fail("cuMemAlloc", 2, count=-1)
    assert drv.cuMemAlloc(ffi.new("CUdeviceptr *"), 8) == 2
    assert drv.cuMemAlloc(ffi.new("CUdeviceptr *"), 8) == 2
    fake.fail("cuMemAlloc", 0, count=0)
    alloc(drv, 8)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_is_refused(drv, fake):
    get_count = drv.cuDeviceGetCount  # the raw pointer: cuproc's own fork guard stays out of the way
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            rc = get_count(ffi.new("int *"))
            code = 0 if rc == NOT_INITIALIZED and fake.fork_violations() == 1 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fake.fork_violations() == 0  # counted in the child only
    ok(get_count(ffi.new("int *")))


def test_builds_warning_free(tmp_path):
    """The C source compiles with -Wall -Wextra without a warning (unused parameters aside)."""
    import shutil
    from fakedriver import C_SOURCE, tables
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "fakedriver_tables.h").write_text(tables(C_SOURCE.read_text()))
    result = subprocess.run([cc, "-fsyntax-only", "-Wall", "-Wextra", "-Wno-unused-parameter",
                             "-Wno-missing-field-initializers", "-pthread", "-std=gnu11", "-I", str(tmp_path),
                             str(C_SOURCE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and not result.stderr, result.stderr


# ---------------------------------------------------------------- reuse (the default mode)
def test_reuse_hands_destroyed_handles_out_again_most_recent_first(reusing, fake):
    drv = reusing
    ctx = new_ctx(drv)
    before = fake.handle_reuses()
    s = ffi.new("CUstream *")
    ok(drv.cuStreamCreate(s, 0))
    first = s[0]
    ok(drv.cuStreamCreate(s, 0))
    second = s[0]
    ok(drv.cuStreamDestroy(first))
    ok(drv.cuStreamDestroy(second))
    e = ffi.new("CUevent *")
    ok(drv.cuEventCreate(e, 0))
    assert e[0] == ffi.cast("CUevent", second)       # another kind takes the last freed handle
    ok(drv.cuStreamCreate(s, 0))
    assert s[0] == first
    assert fake.handle_reuses() - before >= 2
    mod = load(drv, fake_image({"k": [8]}))
    ok(drv.cuModuleUnload(mod))
    assert load(drv, fake_image({"k": [8]})) == mod
    ok(drv.cuCtxDestroy(ctx))          # takes the module, the event and the stream with it
    assert new_ctx(drv) == ctx         # freed last of all: the context's own handle comes first
    assert fake.stale_count() == 0


def test_reuse_gives_a_primary_context_one_handle_over_its_activations(reusing, fake):
    drv = reusing
    out = ffi.new("CUcontext *")
    ok(drv.cuDevicePrimaryCtxRetain(out, 0))
    first = out[0]
    ok(drv.cuDevicePrimaryCtxRelease(0))
    assert not fake.primary_active(0)
    new_ctx(drv)                        # a created context does not take the primary's handle
    ok(drv.cuDevicePrimaryCtxRetain(out, 0))
    assert out[0] == first and fake.primary_active(0)
    fake.reset()                        # across a reset too
    ok(drv.cuDevicePrimaryCtxRetain(out, 0))
    assert out[0] == first


def test_reuse_hands_cumemalloc_addresses_out_again(reusing, fake):
    drv = reusing
    ctx = new_ctx(drv)
    a, b = alloc(drv, 4096), alloc(drv, 4096)
    assert fake.sync_reuses() == 0
    ok(drv.cuMemFree(a))
    ok(drv.cuMemFree(b))
    assert alloc(drv, 1000) == b        # the most recently freed range that fits
    assert alloc(drv, 4096) == a
    big = alloc(drv, 1 << 20)
    assert big not in (a, b)
    c = alloc(drv, 64)
    ok(drv.cuCtxDestroy(ctx))           # memory freed with its context comes back too
    new_ctx(drv)
    assert alloc(drv, 64) in (a, b, big, c)
    assert fake.sync_reuses() == 3 and fake.stale_count() == 0


def test_reuse_off_gives_new_values(drv, fake):
    ctx = new_ctx(drv)
    a = alloc(drv, 4096)
    ok(drv.cuMemFree(a))
    assert alloc(drv, 4096) != a
    ok(drv.cuCtxDestroy(ctx))
    assert new_ctx(drv) != ctx
    out = ffi.new("CUcontext *")
    ok(drv.cuDevicePrimaryCtxRetain(out, 0))
    first = out[0]
    ok(drv.cuDevicePrimaryCtxRelease(0))
    ok(drv.cuDevicePrimaryCtxRetain(out, 0))
    assert out[0] != first
    assert fake.handle_reuses() == 0 and fake.sync_reuses() == 0


def test_reuse_off_from_the_environment(fake, tmp_path):
    """FAKEDRIVER_REUSE=0 before the library loads turns reuse off (for a child process's whole run)."""
    script = (f"import ctypes; lib = ctypes.CDLL({str(fake.path)!r}); print(lib.fake_reuse())")
    for value, expected in (("0", "0"), ("1", "1"), (None, "1")):
        env = {k: v for k, v in os.environ.items() if k != "FAKEDRIVER_REUSE"}
        if value is not None:
            env["FAKEDRIVER_REUSE"] = value
        out = subprocess.run([os.sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


# ---------------------------------------------------------------- ordering: unordered frees
NON_BLOCKING = 1        # CU_STREAM_NON_BLOCKING
PER_THREAD = 0x2        # CU_STREAM_PER_THREAD


def new_stream(drv, flags: int = NON_BLOCKING):
    s = ffi.new("CUstream *")
    ok(drv.cuStreamCreate(s, flags))
    return s[0]


def new_event(drv):
    e = ffi.new("CUevent *")
    ok(drv.cuEventCreate(e, 0))
    return e[0]


def test_a_free_not_ordered_after_another_streams_memset_is_counted(drv, fake):
    """The H200 case: memory allocated on S1, written on S2, freed on S1 with nothing ordering S2's
    write before the free.  On the GPU S2's memset can fault (CUDA_ERROR_ILLEGAL_ADDRESS)."""
    new_ctx(drv)
    s1, s2 = new_stream(drv), new_stream(drv)
    p = async_alloc(drv, 256, s1)
    ok(drv.cuMemsetD8Async(p, 7, 256, s2))
    ok(drv.cuMemFreeAsync(p, s1))
    assert fake.unordered_frees() == 1 and fake.unordered_calls() == ["cuMemFreeAsync"]
    assert fake.records()["unordered"] == 1 and fake.stale_count() == 0
    fake.reset()
    assert fake.unordered_frees() == 0 and fake.unordered_calls() == []


@pytest.mark.parametrize("order", ["same stream", "event wait", "event chain", "stream sync", "stream query",
                                   "context sync", "event sync", "event query", "copy to host"])
def test_a_free_ordered_after_the_memset_is_not_counted(drv, fake, order):
    """What orders S2's memset before S1's free: running on S1 itself, S1 waiting for an event recorded
    after it on S2 (directly, or through a third stream that waited for it), or the host knowing it is
    done (S2 or the context synchronized, the event synchronized or queried, a copy to the host on the
    legacy stream, which waited for the blocking S2)."""
    new_ctx(drv)
    s1, s2 = new_stream(drv), new_stream(drv, 0 if order == "copy to host" else NON_BLOCKING)
    p = async_alloc(drv, 256, s1)
    ok(drv.cuMemsetD8Async(p, 7, 256, s1 if order == "same stream" else s2))
    e = new_event(drv)
    if order == "event wait":
        ok(drv.cuEventRecord(e, s2))
        ok(drv.cuStreamWaitEvent(s1, e, 0))
    elif order == "event chain":                    # S2 -> S3 -> S1: S3's event covers what S3 waited for
        s3, e3 = new_stream(drv), new_event(drv)
        ok(drv.cuEventRecord(e, s2))
        ok(drv.cuStreamWaitEvent(s3, e, 0))
        ok(drv.cuEventRecord(e3, s3))
        ok(drv.cuStreamWaitEvent(s1, e3, 0))
    elif order == "stream sync":
        ok(drv.cuStreamSynchronize(s2))
    elif order == "stream query":
        ok(drv.cuStreamQuery(s2))
    elif order == "context sync":
        ok(drv.cuCtxSynchronize(ffi.NULL))
    elif order in ("event sync", "event query"):
        ok(drv.cuEventRecord(e, s2))
        ok(drv.cuEventSynchronize(e) if order == "event sync" else drv.cuEventQuery(e))
    elif order == "copy to host":
        ok(drv.cuMemcpyDtoH(ffi.new("char[4]"), p, 4))
    ok(drv.cuMemFreeAsync(p, s1))
    assert fake.unordered_frees() == 0, fake.records()


def test_an_event_orders_only_the_work_recorded_before_it(drv, fake):
    new_ctx(drv)
    s1, s2, e = new_stream(drv), new_stream(drv), new_event(drv)
    p = async_alloc(drv, 256, s1)
    ok(drv.cuEventRecord(e, s2))
    ok(drv.cuMemsetD8Async(p, 7, 256, s2))          # after the record: the event does not cover it
    ok(drv.cuStreamWaitEvent(s1, e, 0))
    ok(drv.cuEventSynchronize(e))
    ok(drv.cuMemFreeAsync(p, s1))
    assert fake.unordered_frees() == 1


@pytest.mark.parametrize("holds", ["pointer", "pointer inside a struct", "nothing"])
def test_a_launch_touches_what_its_argument_block_points_into(drv, fake, holds):
    """Any 8-byte aligned word of the packed arguments that points into an allocation: a launch on S2
    using it, then a free on S1, is counted; a launch that does not name it is not."""
    new_ctx(drv)
    mod = load(drv, fake_image({"ptr": [8], "pair": [4, 16]}))
    s1, s2 = new_stream(drv), new_stream(drv)
    p = async_alloc(drv, 256, s1)
    if holds == "pointer inside a struct":         # a 16-byte parameter whose second word is p + 8
        packed = ffi.new("char[]", struct.pack("<I12xQQ", 1, 0, p + 8))
        size = ffi.new("size_t *", 32)
        extra = ffi.new("void *[]", [ffi.cast("void *", 1), packed, ffi.cast("void *", 2), size, ffi.NULL])
        ok(drv.cuLaunchKernel(function(drv, mod, "pair"), 1, 1, 1, 1, 1, 1, 0, s2, ffi.NULL, extra))
    else:
        args, keep = params(("unsigned long long", p if holds == "pointer" else 12345))
        ok(drv.cuLaunchKernel(function(drv, mod, "ptr"), 1, 1, 1, 1, 1, 1, 0, s2, args, ffi.NULL))
    ok(drv.cuMemFreeAsync(p, s1))
    assert fake.unordered_frees() == (0 if holds == "nothing" else 1)


@pytest.mark.parametrize("writer, freer, counted", [
    ("legacy", "blocking", 0),                 # a blocking stream's work follows earlier legacy work
    ("legacy", "non-blocking", 1),
    ("legacy", "per-thread", 0),               # documented: it synchronizes with the legacy stream
    ("blocking", "legacy", 0),                 # legacy work follows earlier blocking-stream work
    ("non-blocking", "legacy", 1),
    ("blocking", "other blocking", 1),         # two blocking streams are not ordered with each other ...
    ("blocking, then legacy work", "other blocking", 0),   # ... unless legacy work came in between
])
def test_the_legacy_stream_orders_blocking_streams(drv, fake, writer, freer, counted):
    new_ctx(drv)
    streams = {"legacy": ffi.NULL, "per-thread": ffi.cast("CUstream", PER_THREAD),
               "blocking": new_stream(drv, 0), "other blocking": new_stream(drv, 0),
               "non-blocking": new_stream(drv, NON_BLOCKING)}
    p = async_alloc(drv, 256, streams[freer])
    ok(drv.cuMemsetD8Async(p, 7, 256, streams[writer.split(",")[0]]))
    if writer.endswith("legacy work"):
        q = async_alloc(drv, 64, ffi.NULL)
        ok(drv.cuMemsetD8Async(q, 0, 64, ffi.NULL))
    ok(drv.cuMemFreeAsync(p, streams[freer]))
    assert fake.unordered_frees() == counted, fake.records()


@pytest.mark.parametrize("how", ["cuMemFree", "context destroy", "primary release", "primary reset"])
def test_implicitly_synchronizing_calls_complete_work_and_are_never_counted(drv, fake, how):
    """cuMemFree waits for the device, a context's end (destroy, last primary release, primary reset) for
    the context's work: none is an unordered free, and the work waited for is complete for the frees
    that follow.  Here: S2 (in another context for the ends, so that p outlives it) writes p, then the
    implicitly synchronizing call, then p is freed on S1 without any other order."""
    a_ctx = new_ctx(drv)
    s1 = new_stream(drv)
    p = async_alloc(drv, 256, s1)
    if how == "cuMemFree":
        s2 = new_stream(drv)
        a = alloc(drv, 256)
        ok(drv.cuMemsetD8Async(a, 7, 256, s2))
        ok(drv.cuMemsetD8Async(p, 7, 256, s2))
        ok(drv.cuMemFree(a))
    else:
        if how == "context destroy":
            other = new_ctx(drv)
        else:
            primary = ffi.new("CUcontext *")
            ok(drv.cuDevicePrimaryCtxRetain(primary, 0))
            ok(drv.cuCtxPushCurrent(primary[0]))
            other = primary[0]
        s2, q = new_stream(drv), alloc(drv, 256)
        ok(drv.cuMemcpyPeerAsync(p, a_ctx, q, other, 256, s2))     # S2 (other context) writes p
        if how == "context destroy":
            ok(drv.cuCtxDestroy(other))
        else:
            ok(drv.cuCtxPopCurrent(ffi.NULL))
            ok(drv.cuDevicePrimaryCtxReset(0) if how == "primary reset" else drv.cuDevicePrimaryCtxRelease(0))
        assert drv_current(drv) == a_ctx
    ok(drv.cuMemFreeAsync(p, s1))
    assert fake.unordered_frees() == 0 and fake.stale_count() == 0 and fake.binding_errors() == 0


def test_a_destroyed_streams_work_is_kept_under_its_own_identity(reusing, fake):
    """A stream destroyed with work pending: the work still runs.  A new stream that gets its handle
    back is another stream, so its free is not ordered after the old one's memset."""
    drv = reusing
    new_ctx(drv)
    s1, s2 = new_stream(drv), new_stream(drv)
    p = async_alloc(drv, 256, s1)
    ok(drv.cuMemsetD8Async(p, 7, 256, s2))
    ok(drv.cuStreamDestroy(s2))
    s3 = new_stream(drv)
    assert s3 == s2
    ok(drv.cuMemFreeAsync(p, s3))
    assert fake.unordered_frees() == 1 and fake.stale_count() == 0


@pytest.mark.parametrize("write, freer, counted", [
    ("memset", "non-blocking", 1),             # a synchronous memset returns before it is done
    ("memset", "blocking", 0),                 # ... on the legacy stream, which blocking streams follow
    ("memset", "legacy", 0),
    ("device copy", "non-blocking", 1),        # so does a device-to-device copy
    ("device copy", "blocking", 0),
])
def test_synchronous_memsets_and_device_copies_are_legacy_stream_work(drv, fake, write, freer, counted):
    new_ctx(drv)
    stream = {"legacy": ffi.NULL, "blocking": new_stream(drv, 0), "non-blocking": new_stream(drv, NON_BLOCKING)}[freer]
    p = async_alloc(drv, 256, stream)
    if write == "memset":
        ok(drv.cuMemsetD8(p, 7, 256))
    else:
        q = alloc(drv, 256)
        ok(drv.cuMemcpyDtoD(q, p, 256))
    ok(drv.cuMemFreeAsync(p, stream))
    assert fake.unordered_frees() == counted, fake.records()
