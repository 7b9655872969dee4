"""Devices, contexts, streams, events and memory on a real GPU, checked against NumPy and peers."""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import cuproc
from threads import in_thread
from cuproc import Context, Device, DeviceBuffer, PrimaryContext, Stream
from cuproc import memory as mem
from cuproc.errors import ClosedResourceError, CudaError, InvalidContextError, InvalidValueError, OutOfMemoryError
from cuproc.stream import Event, HostCallbackError

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

ffi = cuproc.ffi



# ----------------------------------------------------------------------------- devices

def test_device_identity_against_cuda_bindings():
    from cuda.bindings import driver as cbd
    dev = Device(0)
    assert Device.count() >= 1
    err, total = cbd.cuDeviceTotalMem(0)
    assert dev.total_memory == total
    err, name = cbd.cuDeviceGetName(256, 0)
    assert dev.name == name.split(b"\0")[0].decode()
    err, sms = cbd.cuDeviceGetAttribute(cbd.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0)
    assert dev.multiprocessor_count == sms == dev.attributes()["MULTIPROCESSOR_COUNT"]
    assert dev.compute_capability >= (7, 0)
    assert dev.uuid.startswith("GPU-") and len(dev.uuid) == 40
    assert Device.from_pci_bus_id(dev.pci_bus_id) == dev
    assert dev.attribute("CU_DEVICE_ATTRIBUTE_WARP_SIZE") == dev.warp_size == 32
    with pytest.raises(CudaError):
        Device(Device.count())


# ----------------------------------------------------------------------------- contexts

@pytest.mark.parametrize("requested", ["11.3", "12.0", "13.0"])  # cuCtxCreate v2, v3, v4 ABIs
def test_create_with_each_ctxcreate_abi(requested):
    drv = cuproc.Driver(requested)
    ctx = Context.create(0, driver=drv)
    try:
        assert Context.current(driver=drv) == ctx
        assert ctx.device.ordinal == 0
        assert ctx.api_version >= 3020
        ctx.synchronize()
        assert ctx.get_limit("STACK_SIZE") > 0
    finally:
        assert Context.pop(driver=drv) == ctx
        ctx.destroy()
    ctx.destroy()                                    # idempotent, like every close
    with pytest.raises(ClosedResourceError, match="destroyed"):
        ctx.push()


def test_seeds_walkthrough():
    """Create A then B (B current); push A (A current); pop returns A, B current again; destroy both;
    retain and release device 0's primary context."""
    import runpy
    from pathlib import Path
    result = runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "context_walkthrough.py"))
    assert result["steps"] == ["B current after create", "A current after push", "pop returned A",
                               "B current after pop", "destroyed both", "primary retained and released"]


def test_with_block_restores_even_on_exception():
    a = Context.create(0)
    Context.pop()
    b = Context.create(0)
    try:
        with pytest.raises(ZeroDivisionError):
            with a:
                assert Context.current() == a
                1 / 0
        assert Context.current() == b
    finally:
        Context.pop()
        a.destroy()
        b.destroy()
    assert Context.current() is None


def test_threads_have_their_own_stacks():
    ctx = Context.create(0)
    try:
        assert in_thread(Context.current)["value"] is None          # a new thread has none
        assert Context.pop() == ctx                                  # pop here ...
        box = in_thread(lambda: (ctx.push(), Context.current() == ctx, Context.pop())[1])
        assert box["value"] is True                                  # ... push there
        err = in_thread(lambda: DeviceBuffer(16))["error"]
        assert isinstance(err, InvalidContextError) and "use_device" in str(err)
    finally:
        ctx.destroy()


def test_pop_empty_stack_says_so():
    assert Context.current() is None
    with pytest.raises(InvalidContextError, match="empty"):
        Context.pop()


def test_primary_context_refcount():
    pc = PrimaryContext(0)
    with pytest.raises(InvalidValueError):
        pc.release()                                 # never release what you did not retain
    with pc as ctx:
        assert Context.current() == ctx
        assert pc.state[1] is True and pc.retain_count == 1
    assert pc.retain_count == 0 and Context.current() is None
    pc.retain().retain()
    assert pc.retain_count == 2
    del pc
    gc.collect()                                     # the finalizer gives back both retains


# ----------------------------------------------------------------------------- streams and events

def test_streams_events_and_host_callbacks(primary):
    lo, hi = Stream.priority_range()
    with Stream(non_blocking=True, priority=hi) as s:
        assert s.priority == hi and s.flags & 1
        host = np.arange(1 << 20, dtype=np.float32)
        buf = DeviceBuffer(host.nbytes)
        start, end = Event(), Event()
        start.record(s)
        mem.copy(buf, host, stream=s)
        seen = []
        s.launch_host_func(lambda: seen.append(threading.get_ident()))
        end.record(s)
        s.synchronize()
        assert s.query() and end.query() and seen and seen[0] != threading.get_ident()
        assert end.elapsed_ms(end) == 0.0 and start.elapsed_ms(end) >= 0.0
        other = Stream()
        other.wait(end)
        back = np.empty_like(host)
        mem.copy(back, buf, stream=other)
        other.synchronize()
        np.testing.assert_array_equal(back, host)

        def boom():
            raise KeyError("from the driver thread")
        s.launch_host_func(boom)
        with pytest.raises(HostCallbackError) as exc:
            s.synchronize()
        assert isinstance(exc.value.__cause__, KeyError)
        s.synchronize()                               # reported once, then clear
        buf.close()
    no_timing = Event(timing=False, interprocess=True)
    assert no_timing.flags == cuproc.driver.CU_EVENT_DISABLE_TIMING | cuproc.driver.CU_EVENT_INTERPROCESS


# ----------------------------------------------------------------------------- memory

def test_device_round_trip_memset_and_dtod(primary):
    host = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    with DeviceBuffer(host.nbytes) as a, DeviceBuffer(host.nbytes) as b:
        mem.copy(a, host)
        mem.copy(b, a)
        back = np.zeros_like(host)
        mem.copy(back, b)
        np.testing.assert_array_equal(back, host)
        for bits, dtype in ((8, np.uint8), (16, np.uint16), (32, np.uint32)):
            mem.memset(a, 0xAB, element_bits=bits)
            raw = np.zeros(host.nbytes, np.uint8)
            mem.copy(raw, a)
            np.testing.assert_array_equal(raw.view(dtype), np.full(host.nbytes // (bits // 8), 0xAB, dtype))
        s = Stream()
        mem.memset(a, 7, 100, element_bits=32, stream=s)
        s.synchronize()
        raw = np.zeros(host.size, np.uint32)
        mem.copy(raw, a)
        assert (raw[:100] == 7).all() and (raw[100:] == 0xAB).all()


def test_2d_and_3d_copies_match_numpy(primary):
    rows, cols, pitch = 37, 50, 64
    host = np.arange(rows * cols, dtype=np.uint8).reshape(rows, cols)
    with DeviceBuffer(pitch * rows) as d:
        mem.memset(d, 0)
        mem.copy_2d(d, pitch, host, cols, cols, rows)
        raw = np.zeros((rows, pitch), np.uint8)
        mem.copy(raw, d)
        np.testing.assert_array_equal(raw[:, :cols], host)
        assert (raw[:, cols:] == 0).all()
        mem.memset_2d(d, pitch, 9, 10, rows)
        mem.copy(raw, d)
        assert (raw[:, :10] == 9).all() and (raw[:, 10:cols] == host[:, 10:]).all()
    vol = np.arange(4 * 5 * 6, dtype=np.uint8).reshape(4, 5, 6)
    with DeviceBuffer(8 * 5 * 4) as d:
        mem.copy_3d(d, 8, 5, vol, 6, 5, 6, 5, 4)
        back = np.zeros_like(vol)
        mem.copy_3d(back, 6, 5, d, 8, 5, 6, 5, 4)
        np.testing.assert_array_equal(back, vol)


def test_pinned_mapped_and_registered(primary):
    with mem.PinnedBuffer(1 << 16) as pinned:
        arr = np.frombuffer(pinned, dtype=np.int32)      # zero-copy through the buffer protocol
        arr[:] = np.arange(arr.size)
        with DeviceBuffer(pinned.nbytes) as d:
            mem.copy(d, pinned)
            arr[:] = 0
            mem.copy(pinned, d)
            np.testing.assert_array_equal(arr, np.arange(arr.size))
        assert mem.pointer_attributes(pinned.ptr)["memory_type"] == "host"
        del arr                                          # the array holds the memory: close() refuses before
    with mem.PinnedBuffer(4096, mapped=True, portable=True) as mapped:
        np.frombuffer(mapped, np.uint8)[:] = 5
        out = np.zeros(4096, np.uint8)
        mem.copy(out, mapped.device_pointer, 4096)       # read through its device address
        assert (out == 5).all()
    host = np.arange(1 << 18, dtype=np.float64)
    with mem.RegisteredHostMemory(host) as reg, DeviceBuffer(host.nbytes) as d:
        mem.copy(d, host)
        host[:] = -1
        mem.copy(host, d)
        np.testing.assert_array_equal(host, np.arange(1 << 18, dtype=np.float64))
        assert mem.pointer_attributes(reg.ptr)["memory_type"] == "host"
    bytes_reg = bytearray(8192)
    mem.RegisteredHostMemory(bytes_reg).close()


def test_read_only_registration_is_read_and_never_written(primary):
    """A bytes registered read-only (CU_MEMHOSTREGISTER_READ_ONLY, where the device supports it) copies to the
    device, read back through NumPy; copies into it are refused before the driver, and the bytes stay."""
    if not cuproc.Device(0).attribute("READ_ONLY_HOST_REGISTER_SUPPORTED"):
        pytest.skip("the device cannot register host memory read-only")
    frozen = bytes(np.arange(1 << 16, dtype=np.uint32).view(np.uint8))
    with mem.RegisteredHostMemory(frozen, read_only=True) as ro, DeviceBuffer(len(frozen)) as d:
        mem.copy(d, ro)
        back = np.zeros(len(frozen), np.uint8)
        mem.copy(back, d)
        np.testing.assert_array_equal(back.view(np.uint32), np.arange(1 << 16, dtype=np.uint32))
        mem.memset(d, 0)
        with pytest.raises(InvalidValueError, match="registered read-only"):
            mem.copy(ro, d)
        assert frozen == bytes(np.arange(1 << 16, dtype=np.uint32).view(np.uint8))


def test_managed_memory_prefetch_and_advise(primary):
    with mem.ManagedBuffer(1 << 20) as m:
        view = np.frombuffer(m, dtype=np.float32)
        view[:] = 3.0
        m.advise("SET_READ_MOSTLY", 0)
        m.prefetch(0)
        s = Stream()
        m.prefetch("cpu", s)
        s.synchronize()
        assert mem.pointer_attributes(m.ptr)["is_managed"] is True
        out = np.zeros(view.shape, view.dtype)
        del view                                         # the array holds the memory: close() refuses before
        mem.copy(out, m)
        assert (out == 3.0).all()


def test_stream_ordered_allocation_and_pools(primary):
    s = Stream()
    buf = mem.alloc_async(1 << 20, s)
    mem.memset(buf, 1, stream=s)
    out = np.zeros(1 << 20, np.uint8)
    mem.copy(out, buf, stream=s)
    buf.free_async(s)
    s.synchronize()
    assert (out == 1).all()
    with pytest.raises(InvalidValueError):
        buf.ptr
    pool = mem.MemoryPool.create(0, release_threshold=1 << 24)
    try:
        assert pool.release_threshold == 1 << 24
        b = mem.alloc_async(1 << 22, s, pool=pool)
        s.synchronize()
        assert pool.get_attribute("USED_MEM_CURRENT") >= 1 << 22
        b.free_async(s)
        s.synchronize()
        pool.trim(0)
        assert pool.get_attribute("USED_MEM_CURRENT") == 0
    finally:
        pool.destroy()
    default = mem.MemoryPool.default(0)
    assert default.get_attribute("RELEASE_THRESHOLD") >= 0
    with pytest.raises(InvalidValueError):
        default.destroy()


def test_a_late_close_after_the_pool_reused_the_address_frees_nothing(primary):
    """The claim rule of stream-ordered memory on a real pool: free_async's claim (removing the buffer's
    entry) and its cuMemFreeAsync on stream s, then a new allocation of the same size from the same pool
    on s right after, then a late close() of the old buffer.  The close must free nothing: the new
    buffer keeps its memory (a memset and copy round trip, and the pool's USED_MEM_CURRENT) until its
    own free_async gives it back.

    The pool hands the old address back: memory freed into a pool is reusable at once by a later
    allocation on the same stream (stream order guarantees the accesses never overlap, NVIDIA's
    stream-ordered allocator docs), and the pool keeps it (release threshold above n) rather than
    giving it back to the OS.  The precondition is asserted: without it nothing is shown."""
    n = 1 << 22
    s = Stream()
    pool = mem.MemoryPool.create(0, release_threshold=1 << 24)
    try:
        old = mem.alloc_async(n, s, pool=pool)
        x = old.address
        assert old.context.untrack_stream_ordered(old.claim_key) is not None   # free_async's claim ...
        assert old.driver.cuMemFreeAsync(x, s.handle) == 0        # ... and its driver call, on s
        new = mem.alloc_async(n, s, pool=pool)                    # same size, same pool, same stream
        assert new.address == x, (
            f"precondition: the pool put the next {n}-byte allocation on the same stream at {new.address:#x}, "
            f"not at the just-freed {x:#x}, so this run cannot show that a late close spares a newer buffer "
            "at the old address (the pool's reuse changed: rearrange the reuse, do not drop this check)")
        old.close()                                               # late: the claim is gone, nothing freed
        assert old.freed and not new.freed
        s.synchronize()
        assert pool.get_attribute("USED_MEM_CURRENT") >= n        # new's memory is still in use
        mem.memset(new, 7, stream=s)
        out = np.zeros(n, np.uint8)
        mem.copy(out, new, stream=s)
        s.synchronize()
        assert (out == 7).all()
        new.free_async()
        s.synchronize()
        pool.trim(0)
        assert pool.get_attribute("USED_MEM_CURRENT") == 0
    finally:
        s.synchronize()
        pool.destroy()


def test_per_thread_default_stream_copies(primary):
    drv = cuproc.Driver(per_thread_default_stream=True)
    host = np.arange(1000, dtype=np.int64)
    with DeviceBuffer(host.nbytes, driver=drv) as d:
        mem.copy(d, host, stream=cuproc.stream.default_stream(drv), driver=drv)
        back = np.zeros_like(host)
        mem.copy(back, d, driver=drv)
        np.testing.assert_array_equal(back, host)
    assert drv.resolution("cuMemcpyHtoDAsync").entry_point.endswith("_ptsz")


def test_cupy_and_torch_see_the_same_memory(primary):
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    host = np.arange(256, dtype=np.float32)
    with DeviceBuffer(host.nbytes) as buf:
        mem.copy(buf, host)
        view = buf.view(np.float32)
        c = cupy.asarray(view)                           # __cuda_array_interface__
        assert c.data.ptr == buf.ptr
        c *= 2
        t = torch.from_dlpack(view)                      # DLPack
        assert t.data_ptr() == buf.ptr and t.device.type == "cuda"
        t += 1
        t2 = torch.as_tensor(view, device="cuda")        # __cuda_array_interface__ again
        assert t2.data_ptr() == buf.ptr
        torch.cuda.synchronize()
        back = np.zeros_like(host)
        mem.copy(back, buf)
        np.testing.assert_array_equal(back, host * 2 + 1)
        c2 = cupy.from_dlpack(view)
        assert c2.data.ptr == buf.ptr
        del c, t, t2, c2


def test_pointer_attributes_classify(primary):
    with DeviceBuffer(1024) as d:
        info = mem.pointer_attributes(d)
        assert info["memory_type"] == "device" and info["device_ordinal"] == 0
        assert info["range"] == (d.ptr, 1024) and info["is_managed"] is False
    assert mem.pointer_attributes(np.zeros(16).ctypes.data)["memory_type"] is None


# ----------------------------------------------------------------------------- bad input and faults

def test_double_free_and_use_after_free(primary):
    buf = DeviceBuffer(64)
    buf.free()
    buf.free()                                            # free and close are idempotent, like a file's close
    with pytest.raises(ClosedResourceError, match="freed"):
        mem.copy(np.zeros(64, np.uint8), buf)
    buf.close()


def test_sizes_and_bounds_checked_before_the_driver(primary):
    with DeviceBuffer(64) as d:
        with pytest.raises(InvalidValueError, match="overruns"):
            mem.copy(d, np.zeros(128, np.uint8), 128)
        with pytest.raises(InvalidValueError, match="overruns"):
            mem.copy(np.zeros(32, np.uint8), d, 64)
        with pytest.raises(InvalidValueError, match=">= 0"):
            mem.copy(d, np.zeros(64, np.uint8), -1)
        with pytest.raises(InvalidValueError):
            mem.memset(d, 1, 65)
        with pytest.raises(InvalidValueError):
            DeviceBuffer(-5)
        strided = np.zeros((8, 16), np.uint8)[:, ::2]
        with pytest.raises(InvalidValueError, match="contiguous"):
            mem.copy(strided, d, 64)
        readonly = np.zeros(64, np.uint8)
        readonly.flags.writeable = False
        with pytest.raises(InvalidValueError, match="writable"):
            mem.copy(readonly, d)
        with pytest.raises(InvalidValueError, match="writable"):
            mem.copy(b"\0" * 64, d)
        with pytest.raises(InvalidValueError):
            mem.RegisteredHostMemory(strided)


def test_buffer_of_a_destroyed_context():
    ctx = Context.create(0)
    buf = DeviceBuffer(256)
    Context.pop()
    ctx.destroy()
    with pytest.raises(ClosedResourceError, match="destroyed") as info:
        mem.copy(np.zeros(256, np.uint8), buf)
    assert info.value.call == "cuMemcpy"                  # the call attempted, not cuMemFree
    buf.close()                                           # nothing to free any more: no error


def test_out_of_memory_then_everything_back(primary):
    free0, total = mem.mem_info()
    chunk = 1 << 32
    held = []
    with pytest.raises(OutOfMemoryError):
        for _ in range(total // chunk + 2):
            held.append(DeviceBuffer(chunk))
    assert len(held) >= (free0 // chunk) - 2
    for b in held:
        b.free()
    held.clear()
    free1, _ = mem.mem_info()
    # everything back: at least what was free before (cuMemGetInfo is the device's: memory another test or
    # process gave back meanwhile makes it more -- 32 MiB more on an H200 run, 2026-11-29)
    assert free1 >= free0 - (4 << 20), (free0, free1)


# ----------------------------------------------------------------------------- two GPUs

@pytest.mark.multi_gpu
@pytest.mark.skipif(cuproc.is_driver_available() and Device.count() < 2, reason="needs two GPUs")
def test_peer_access_and_copies():
    d0, d1 = Device(0), Device(1)
    assert d0.can_access_peer(d1)
    p0, p1 = PrimaryContext(d0).retain(), PrimaryContext(d1).retain()   # peer access lives in these
    assert p0.context.enable_peer_access(p1) and p1.context.enable_peer_access(p0)
    assert not p0.context.enable_peer_access(p1)           # still enabled: the contexts were held
    host = np.arange(1 << 16, dtype=np.uint32)
    with p0:
        a = DeviceBuffer(host.nbytes)
        mem.copy(a, host)
    with p1:
        b = DeviceBuffer(host.nbytes)
    for current in (p0, p1):                              # a context of each device current in turn
        with current:
            stream = cuproc.Stream()                      # the current device's
            for on in (None, stream):                     # synchronous, then on the stream
                mem.memset(b, 0)
                mem.copy(b, a, stream=on)                 # peer copy 0 -> 1
                if on is not None:
                    on.synchronize()
                back = np.zeros_like(host)
                mem.copy(back, b)
                np.testing.assert_array_equal(back, host)
                mem.memset(a, 0)
                mem.copy(a, b, stream=on)                 # and back 1 -> 0
                if on is not None:
                    on.synchronize()
                mem.copy(back, a)
                np.testing.assert_array_equal(back, host)
            stream.close()
    a.close()
    b.close()
    assert p0.context.disable_peer_access(p1) and p1.context.disable_peer_access(p0)
    assert not p0.context.disable_peer_access(p1)
    for pc in (p0, p1):
        pc.release()


def test_dropped_buffers_are_freed_by_the_safety_net(primary):
    """Never freed explicitly: the last reference going away frees the memory (device, async, pinned)."""
    free0, _ = mem.mem_info()
    bufs = [DeviceBuffer(64 << 20) for _ in range(4)] + [mem.alloc_async(64 << 20) for _ in range(4)]
    pinned = mem.PinnedBuffer(1 << 20)
    assert mem.mem_info()[0] <= free0 - 8 * (64 << 20)
    del bufs, pinned
    gc.collect()
    primary.context.synchronize()
    mem.MemoryPool.default().trim(0)     # stream-ordered frees go back to the pool first
    assert mem.mem_info()[0] >= free0 - (2 << 20)


# ----------------------------------------------------------------------------- issue 9: large copies, stream-ordered pairs

BIG = (64 << 20) + 4099           # >= 64 MiB, and not a multiple of a page


def _libcuda_copy(name):
    """The driver's own copy entry point by dlsym (independent of cuproc's copy path)."""
    import ctypes
    fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t] if "DtoH" in name else
                   [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t])
    return fn


def _device_bytes(d, n):
    out = np.zeros(n, np.uint8)
    assert _libcuda_copy("cuMemcpyDtoH_v2")(out.ctypes.data, d.ptr, n) == 0
    return out


def _to_device(d, data):
    assert _libcuda_copy("cuMemcpyHtoD_v2")(d.ptr, data.ctypes.data, data.nbytes) == 0


@pytest.mark.parametrize("host_kind", ["pinned", "pageable"])
def test_large_host_to_device_and_back_match_numpy(primary, host_kind):
    expected = np.random.default_rng(9).integers(0, 256, BIG, dtype=np.uint8)
    d = DeviceBuffer(BIG)
    pinned = mem.PinnedBuffer(BIG) if host_kind == "pinned" else None
    host = pinned.numpy() if pinned is not None else np.zeros(BIG, np.uint8)
    try:
        host[:] = expected
        mem.copy(d, pinned if pinned is not None else host)                 # H2D
        np.testing.assert_array_equal(_device_bytes(d, BIG), expected)
        reversed_bytes = expected[::-1].copy()
        _to_device(d, reversed_bytes)
        host[:] = 0
        mem.copy(pinned if pinned is not None else host, d)                 # D2H
        np.testing.assert_array_equal(host, reversed_bytes)
    finally:
        del host
        if pinned is not None:
            pinned.close()
        d.close()


def test_alloc_async_free_async_pairs_carry_data_and_return_the_memory(primary):
    s = Stream(non_blocking=True)
    default = mem.MemoryPool.default(0)
    gc.collect()
    Context.current().synchronize()
    used = default.used_bytes
    out = mem.PinnedBuffer(4096)
    view = out.numpy()
    for i in range(200):
        buf = mem.alloc_async(4096, s)
        assert buf.stream is s and buf.context is s.context
        mem.memset(buf, i % 256, stream=s)
        mem.copy(out, buf, stream=s)
        buf.free_async()
        s.synchronize()
        assert (view == i % 256).all(), i
        with pytest.raises(ClosedResourceError):
            buf.ptr
    dropped = [mem.alloc_async(1 << 20, s) for _ in range(8)]
    s.synchronize()
    assert default.used_bytes >= used + 8 * (1 << 20)
    del dropped                                         # the finalizers free them on s
    gc.collect()
    s.synchronize()
    assert default.used_bytes == used
    del view
    out.close()
    s.close()
