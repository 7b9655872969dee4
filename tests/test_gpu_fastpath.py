"""The compiled fast path on a real GPU: trampolines against the driver's own symbols (ctypes/dlsym),
prepared launches in C against NumPy.  Runs on both paths (tools/gpu_check.sh reruns the GPU files
with CUPROC_PURE_PYTHON=1); the checks that only mean something with the fast path say so."""
from __future__ import annotations

import ctypes
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, Module, fastpath
from cuproc import memory as mem

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

K = Path(__file__).resolve().parent.parent / "kernels"
ffi = cuproc.ffi
SM_COUNT = 16   # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT


def test_status_is_reported():
    print(f"cuproc fast path: {fastpath.status()}")
    assert fastpath.status().startswith("on: " if fastpath.active() else "off: ")


def test_raw_names_agree_with_the_driver_symbols(primary):
    """cuDriverGetVersion, cuDeviceGetAttribute and cuCtxGetCurrent by cuproc's name and by dlsym."""
    lib = ctypes.CDLL("libcuda.so.1")
    drv = cuproc.driver.default_driver()
    ours, theirs = ffi.new("int *"), ctypes.c_int()
    assert drv.cuDriverGetVersion(ours) == 0 == lib.cuDriverGetVersion(ctypes.byref(theirs))
    assert ours[0] == theirs.value
    assert drv.cuDeviceGetAttribute(ours, SM_COUNT, 0) == 0 == lib.cuDeviceGetAttribute(
        ctypes.byref(theirs), SM_COUNT, 0)
    assert ours[0] == theirs.value > 0
    ctx, their_ctx = ffi.new("CUcontext *"), ctypes.c_void_p()
    assert drv.cuCtxGetCurrent(ctx) == 0 == lib.cuCtxGetCurrent(ctypes.byref(their_ctx))
    assert int(ffi.cast("uintptr_t", ctx[0])) == their_ctx.value == int(ffi.cast("uintptr_t", primary.handle))
    if fastpath.active():
        # the same address (a slot claimed earlier in the process by another handle with the same
        # pointer keeps that handle's cdata object, so identity is not the property)
        assert ffi.cast("void *", fastpath.pointer(drv.cuCtxGetCurrent)) == \
            ffi.cast("void *", drv.resolution("cuCtxGetCurrent").function) != ffi.NULL


def test_checked_errors_are_the_drivers_own(primary):
    """Real failing calls through drv.checked -- cuDeviceGet past the device count (two parameters) and
    cuDriverGetVersion(NULL) (one: a slot trampoline) -- raise the CudaError whose code is what the
    same call returns through dlsym, named and described by the driver's cuGetErrorName /
    cuGetErrorString (also by dlsym), and naming the call.  The C checked callable on the fast path."""
    lib = ctypes.CDLL("libcuda.so.1")
    drv = cuproc.driver.default_driver()
    count, dev = ffi.new("int *"), ffi.new("CUdevice *")
    drv.checked.cuDeviceGetCount(count)
    cases = [("cuDeviceGet", (dev, count[0] + 100), (ctypes.byref(ctypes.c_int()), count[0] + 100)),
             ("cuDriverGetVersion", (ffi.NULL,), (None,))]
    for name, ours, theirs in cases:
        checked = getattr(drv.checked, name)
        assert isinstance(checked, types.FunctionType) != fastpath.active()
        rc = getattr(lib, name)(*theirs)
        assert rc != 0 and getattr(drv, name)(*ours) == rc
        with pytest.raises(cuproc.CudaError) as info:
            checked(*ours)
        err_name, err_text = ctypes.c_char_p(), ctypes.c_char_p()
        assert lib.cuGetErrorName(rc, ctypes.byref(err_name)) == 0
        assert lib.cuGetErrorString(rc, ctypes.byref(err_text)) == 0
        err = info.value
        assert err.code == rc and err.call == name
        assert err.name == err_name.value.decode() and err.description == err_text.value.decode()
    assert drv.checked.cuDeviceGet(dev, 0) is None and dev[0] == 0
    version, theirs_version = ffi.new("int *"), ctypes.c_int()
    assert drv.checked.cuDriverGetVersion(version) is None
    assert lib.cuDriverGetVersion(ctypes.byref(theirs_version)) == 0 and version[0] == theirs_version.value


def test_prepared_vector_add_with_values_changing(primary):
    with Module.load(K / "kernels.fatbin") as m:
        run = m.get_function("VecAdd_kernel").prepare(["float*", "float*", "float*", "int"], grid=8, block=256)
        rng = np.random.default_rng(1)
        bufs = [DeviceBuffer(2048 * 4) for _ in range(3)]
        hosts = [rng.random(2048, dtype=np.float32) for _ in range(2)]
        for d, h in zip(bufs, hosts):
            mem.copy(d, h)
        outs = []   # kept: a buffer ending moves EPOCH, and the next launch re-verifies in Python
        for n in (2048, 1000, 1):
            out = DeviceBuffer(2048 * 4)
            outs.append(out)
            mem.copy(out, np.zeros(2048, np.float32))
            run(bufs[0], bufs[1], out, n)
            result = np.empty(2048, np.float32)
            mem.copy(result, out)
            np.testing.assert_array_equal(result[:n], hosts[0][:n] + hosts[1][:n])
            assert not result[n:].any()
        run(bufs[1], bufs[1].address, bufs[2], 2048)             # an int address is a pointer too
        result = np.empty(2048, np.float32)
        mem.copy(result, bufs[2])
        np.testing.assert_array_equal(result, 2 * hosts[1])
        if fastpath.active():
            assert run.fallbacks == 1                             # the first call claims the block


def test_prepared_launches_from_threads_never_mix_arguments(primary):
    slots_per_thread, threads = 256, 4
    with Module.load(K / "kernels.fatbin") as m, DeviceBuffer(2 * 8 * slots_per_thread * (threads + 1)) as log:
        run = m.get_function("record_pair").prepare(["long long*", "int", "long long", "long long"], 1, 1)

        def work(t):   # no context set up in the threads: the launch runs in its function's
            for i in range(slots_per_thread):
                slot = t * slots_per_thread + i
                a = 1000 * slot + 7
                run(log, slot, a, 3 * a + 1)
        pool = [threading.Thread(target=work, args=(t,)) for t in range(1, threads + 1)]
        for th in pool:
            th.start()
        work(0)
        for th in pool:
            th.join()
        primary.context.synchronize()
        pairs = np.empty(2 * slots_per_thread * (threads + 1), np.int64)
        mem.copy(pairs, log)
        a, b = pairs[0::2], pairs[1::2]
        np.testing.assert_array_equal(a, 1000 * np.arange(a.size) + 7)
        np.testing.assert_array_equal(b, 3 * a + 1)


def _pointer_context(address: int) -> int:
    """The context the driver says owns ``address`` (cuPointerGetAttribute by dlsym, not cuproc's path)."""
    lib = ctypes.CDLL("libcuda.so.1")
    out = ctypes.c_void_p()
    CU_POINTER_ATTRIBUTE_CONTEXT = 1
    assert lib.cuPointerGetAttribute(ctypes.byref(out), CU_POINTER_ATTRIBUTE_CONTEXT, ctypes.c_uint64(address)) == 0
    return out.value or 0


def test_device_buffers_land_in_the_right_context_carry_data_and_go_back(primary):
    """DeviceBuffer(n) (the C front on the fast path) allocates in the current context, or in ``context=``
    pushed when it is not current; the driver's own pointer attribute names that context, the memory
    carries what NumPy wrote through dlsym'd copies, and free(), close() and a drop give every byte back."""
    from cuproc._support import handle_int
    init, frees = (getattr(DeviceBuffer.__init__, "taken", 0),
                   getattr(DeviceBuffer.free, "taken", 0) + getattr(DeviceBuffer.close, "taken", 0))
    lib = ctypes.CDLL("libcuda.so.1")
    mine = handle_int(primary.context.handle)
    other = cuproc.Context.create(0)
    cuproc.Context.pop()                                       # created, not current
    mem.mem_info()
    free0 = mem.mem_info()[0]
    rng = np.random.default_rng(9)
    bufs = [DeviceBuffer(64 << 20) for _ in range(3)] + [DeviceBuffer(64 << 20, context=other)]
    assert [_pointer_context(b.address) for b in bufs] == [mine] * 3 + [handle_int(other.handle)]
    assert cuproc.Context.current() is primary.context        # the push for ``other`` was popped
    for b in bufs:
        data = rng.integers(0, 256, 4096, dtype=np.uint8)
        assert lib.cuMemcpyHtoD_v2(ctypes.c_uint64(b.address), data.ctypes.data_as(ctypes.c_void_p), 4096) == 0
        back = np.zeros(4096, np.uint8)
        mem.copy(back, b)
        assert np.array_equal(back, data)
    assert mem.mem_info()[0] <= free0 - 4 * (64 << 20)
    bufs[0].free()
    bufs[1].close()
    del bufs[2]                                                # dropped live: its finalizer frees it
    bufs[-1].free()
    assert all(b.freed for b in (bufs[0], bufs[1], bufs[-1]))
    assert mem.mem_info()[0] >= free0 - (2 << 20)
    other.destroy()
    if fastpath.active():                                      # the fronts made these calls themselves
        assert getattr(DeviceBuffer.__init__, "taken") >= init + 3
        assert getattr(DeviceBuffer.free, "taken") + getattr(DeviceBuffer.close, "taken") >= frees + 4


def test_copies_between_device_buffers_and_host_memory_match_numpy_and_the_drivers_own_copy(primary):
    """memory.copy between a DeviceBuffer and pinned (the C front on the fast path) or registered memory,
    both ways, whole and partial, on this thread (the primary context current) and on a new thread (none
    current: bound per call), one buffer in a created context that is not current: exactly the bytes asked
    for move, the rest stays as it was, read and written through dlsym'd copies (not cuproc's path)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    n = 1 << 20
    rng = np.random.default_rng(4)
    other = cuproc.Context.create(0)
    cuproc.Context.pop()                                       # created, not current
    before = getattr(mem.copy, "taken", 0)
    cases = [(DeviceBuffer(n), mem.PinnedBuffer(n)), (DeviceBuffer(n), mem.RegisteredHostMemory(np.zeros(n, np.uint8))),
             (DeviceBuffer(n, context=other), mem.PinnedBuffer(n))]

    def device_bytes(dev: DeviceBuffer) -> np.ndarray:
        got = np.zeros(n, np.uint8)
        with dev.context:                                      # (the dlsym'd calls need it current)
            assert lib.cuMemcpyDtoH_v2(got.ctypes.data, dev.address, n) == 0
        return got

    def set_device_bytes(dev: DeviceBuffer, data: np.ndarray) -> None:
        with dev.context:
            assert lib.cuMemcpyHtoD_v2(dev.address, data.ctypes.data, n) == 0

    def run(k: int) -> None:
        dev, host = cases[k]
        view = np.frombuffer(host.buffer, np.uint8)
        for size in (n, n // 2 + 3, 1):
            was = rng.integers(0, 256, n, dtype=np.uint8)
            set_device_bytes(dev, was)
            data = rng.integers(0, 256, n, dtype=np.uint8)
            view[:] = data
            mem.copy(dev, host, size)                          # in: size bytes, the rest as it was
            got = device_bytes(dev)
            assert np.array_equal(got[:size], data[:size]) and np.array_equal(got[size:], was[size:])
            view[:] = 0
            mem.copy(host, dev, size)                          # out: size bytes, the rest as it was
            assert np.array_equal(view[:size], data[:size]) and not view[size:].any()
            mem.copy(host, dev)                                # out, the whole (the smaller side: both n)
            assert np.array_equal(view, got)
    for k in range(len(cases)):
        run(k)
    done: list[int] = []
    t = threading.Thread(target=lambda: [run(k) or done.append(k) for k in range(len(cases))])
    t.start()
    t.join()
    assert done == [0, 1, 2] and cuproc.Context.current() is primary.context
    if fastpath.active():   # the front made the main thread's copies with pinned memory itself, but each pair's
        # first (the check); registered memory's are the Python code's (a registration may be read-only), and so
        # are the created context's buffer's: that context is not current, and a synchronous copy runs in the
        # current one (the front checks, the Python code pushes the buffer's; issue 35)
        assert getattr(mem.copy, "taken") == before + (3 * 3 - 1)
    for dev, host in cases:
        dev.free()
        host.close()
    other.destroy()
