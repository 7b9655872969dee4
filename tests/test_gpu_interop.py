"""The interchange protocols on a real GPU, with CuPy, PyTorch and cuda.core, both directions.

Every value is checked against NumPy on the host.  The stream handshake is checked two ways:
a result that would be wrong without synchronization (a long chain of memsets on a cuproc
stream, then the consumer reads on its own stream), and an ordering that can be observed
deterministically (the cuproc stream is held by cuStreamWaitValue32 on a flag; the consumer's
work must not finish until the flag is released).
"""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, Stream
from cuproc import memory as mem
from cuproc._support import handle_int
from cuproc.interop import DLPackArray, default_marker, from_dlpack

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

ffi = cuproc.ffi
BIG = 1 << 30           # 1 GiB: each memset of it takes ~0.3-0.5 ms on an H100/H200


def slow_then_fill(stream: Stream, target: DeviceBuffer, value: int, rounds: int = 40) -> DeviceBuffer:
    """Queue ~15-20 ms of memsets on ``stream``, then fill ``target`` with ``value`` (32-bit) on it."""
    scratch = mem.alloc_async(BIG, stream)
    for i in range(rounds):
        mem.memset(scratch, i & 0xFF, stream=stream)
    mem.memset(target, value, element_bits=32, stream=stream)
    return scratch


def host_copy(buf, dtype, n):
    out = np.zeros(n, dtype)
    mem.copy(out, buf, out.nbytes)
    return out


# ----------------------------------------------------------------------------- cuproc -> PyTorch

def test_torch_reads_cuproc_work_on_its_own_stream_through_dlpack(primary):
    torch = pytest.importorskip("torch")
    n = 1 << 22
    target = DeviceBuffer(4 * n)
    mem.memset(target, 0, element_bits=32)
    cuproc.Context.current().synchronize()
    s = Stream(non_blocking=True)
    scratch = slow_then_fill(s, target, 7)
    assert target.__cuda_array_interface__["stream"] == handle_int(s.handle)
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        t = torch.from_dlpack(target.view(np.int32))        # torch passes ts: the handshake orders it after s
        total = int(t.sum().item())                          # .item() waits for ts only
    assert t.data_ptr() == target.ptr and total == 7 * n
    del t
    s.synchronize()
    scratch.free_async(s)
    target.free()
    s.close()


def test_torch_work_waits_for_a_held_cuproc_stream(primary):
    """Deterministic ordering: s is held by cuStreamWaitValue32 until the host releases a flag.
    With the handshake torch's sum cannot finish before the release; without it (stream=-1) it does."""
    torch = pytest.importorskip("torch")
    drv = cuproc.driver.default_driver()
    flag, target = DeviceBuffer(4), DeviceBuffer(4 * 1024)
    for b in (flag, target):
        mem.memset(b, 0, element_bits=32)
    cuproc.Context.current().synchronize()
    s, releaser = Stream(non_blocking=True), Stream(non_blocking=True)
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):                     # warm torch's allocator: no cudaMalloc while s is held
        torch.zeros(1024, dtype=torch.int32, device="cuda").sum().item()

    def release() -> None:
        mem.memset(flag, 1, element_bits=32, stream=releaser)

    rc = drv.cuStreamWaitValue32(s.handle, flag.ptr, 1, drv.CU_STREAM_WAIT_VALUE_GEQ)
    if rc == drv.CUDA_ERROR_NOT_SUPPORTED:
        pytest.skip("this device has no stream memory operations")
    drv.check(rc, "cuStreamWaitValue32")
    safety = threading.Timer(10.0, release)         # never leave s held, even if this thread got stuck
    safety.start()
    try:
        mem.memset(target, 5, element_bits=32, stream=s)
        with torch.cuda.stream(ts):
            unsynced = torch.from_dlpack(target.view(np.int32).__dlpack__(stream=-1)).sum()
            free_done = torch.cuda.Event()
            free_done.record(ts)
            synced = torch.from_dlpack(target.view(np.int32)).sum()    # handshake with ts
            done = torch.cuda.Event()
            done.record(ts)
        time.sleep(0.3)
        held = not done.query()
        not_held = free_done.query()
    finally:
        release()                                                      # let s go, whatever happened
        safety.cancel()
    releaser.synchronize()
    done.synchronize()
    assert held, "torch's work finished while the cuproc stream it was ordered after was still held"
    assert not_held and int(unsynced.item()) == 0                        # the control: no handshake, no wait
    assert int(synced.item()) == 5 * 1024
    s.synchronize()
    for x in (flag, target):
        x.free()
    s.close()
    releaser.close()


def test_dlpack_keeps_the_buffer_and_copies_when_asked(primary):
    torch = pytest.importorskip("torch")
    host = np.arange(1024, dtype=np.float32)
    buf = DeviceBuffer(host.nbytes)
    mem.copy(buf, host)
    t = torch.from_dlpack(buf.view(np.float32))
    with pytest.raises(BufferError):
        buf.free()                                           # torch still uses it
    del buf
    gc.collect()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(t.cpu().numpy(), host)     # still valid: the capsule held the buffer
    view = cuproc.DeviceBuffer(host.nbytes).view(np.float32)
    mem.copy(view, host)
    c = torch.from_dlpack(view.__dlpack__(copy=True))
    assert c.data_ptr() != view.ptr
    np.testing.assert_array_equal(c.cpu().numpy(), host)
    try:
        on_host = np.from_dlpack(view, device="cpu")         # dl_device=(kDLCPU, 0): a host copy
    except TypeError:
        on_host = None                                       # NumPy before 2.1 has no device=
    if on_host is not None:
        np.testing.assert_array_equal(on_host, host)
    del t, c


# ----------------------------------------------------------------------------- cuproc -> CuPy

def test_cupy_synchronizes_on_the_cai_stream(primary):
    cupy = pytest.importorskip("cupy")
    n = 1 << 22
    target = DeviceBuffer(4 * n)
    mem.memset(target, 0, element_bits=32)
    cuproc.Context.current().synchronize()
    s = Stream(non_blocking=True)
    scratch = slow_then_fill(s, target, 3)
    c = cupy.asarray(target.view(np.int32))                   # CuPy waits for the CAI's stream (s)
    with cupy.cuda.Stream(non_blocking=True):
        total = int(c.sum())
    assert c.data.ptr == target.ptr and total == 3 * n
    m = mem.ManagedBuffer(256)
    m.numpy()[:] = np.arange(256, dtype=np.uint8)
    cm = cupy.from_dlpack(m)                                  # kDLCUDAManaged
    assert int(cm.sum()) == int(np.arange(256, dtype=np.uint8).sum())
    del c, cm
    s.synchronize()
    scratch.free_async(s)
    target.free()
    m.free()
    s.close()


# ----------------------------------------------------------------------------- PyTorch / CuPy -> cuproc

def test_torch_and_cupy_arrays_import_as_cuproc_views(primary):
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    s = Stream()
    expected = np.arange(4096, dtype=np.float32) * 3
    t = torch.arange(4096, dtype=torch.float32, device="cuda") * 3   # on torch's current stream
    a = from_dlpack(t, stream=s)                             # torch makes s wait for its stream
    assert isinstance(a, DLPackArray) and a.ptr == t.data_ptr() and a.shape == (4096,) and a.typestr == "<f4"
    del t
    gc.collect()
    junk = torch.ones(1 << 20, device="cuda")                 # the allocator must not reuse a's memory
    out = np.zeros_like(expected)
    mem.copy(out, a, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(out, expected)
    a.close()
    a.close()
    c = cupy.arange(100, dtype=cupy.int64) * 2
    b = from_dlpack(c)
    assert b.ptr == c.data.ptr and b.typestr == "<i8"
    np.testing.assert_array_equal(host_copy(b, np.int64, 100), np.arange(100) * 2)
    d = DeviceBuffer(800)
    mem.copy(d, b)                                            # a DLPack view is device memory to cuproc
    np.testing.assert_array_equal(host_copy(d, np.int64, 100), np.arange(100) * 2)
    del junk
    b.close()
    d.free()
    s.close()


# ----------------------------------------------------------------------------- streams across libraries

def test_foreign_streams_are_taken_and_ours_are_understood(primary):
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    buf = DeviceBuffer(4096)
    ts, cs = torch.cuda.Stream(), cupy.cuda.Stream(non_blocking=True)
    for value, stream in ((1, ts), (2, cs)):
        mem.memset(buf, value, stream=stream)
        assert buf.last_stream.owner is stream and not buf.last_stream.owned
        stream.synchronize()
        assert set(host_copy(buf, np.uint8, 4096).tolist()) == {value}
    a = mem.alloc_async(256, ts)
    a.free_async()
    ours = Stream()
    ext = torch.cuda.ExternalStream(ours.__cuda_stream__()[1])
    with torch.cuda.stream(ext):
        x = torch.full((64,), 9.0, device="cuda")
    ours.synchronize()
    assert float(x.sum().item()) == 9.0 * 64
    buf.free()
    ours.close()


def test_cuda_core_streams_both_ways(primary):
    core = pytest.importorskip("cuda.core")
    CoreDevice = getattr(core, "Device", None)
    if CoreDevice is None:                                     # cuda.core before 0.4: the experimental namespace
        from cuda.core.experimental import Device as CoreDevice
    dev = CoreDevice(0)
    dev.set_current()
    theirs = dev.create_stream()
    buf = DeviceBuffer(64)
    mem.memset(buf, 4, stream=theirs)                          # their __cuda_stream__
    theirs.sync()
    assert set(host_copy(buf, np.uint8, 64).tolist()) == {4}
    ours = Stream()
    wrapped = dev.create_stream(ours)                          # ours through __cuda_stream__
    assert int(wrapped.handle) == handle_int(ours.handle)
    adopted = Stream.from_handle(int(theirs.handle), owner=theirs)
    adopted.close()                                            # not owned: their stream lives on
    mem.memset(buf, 6, stream=theirs)
    theirs.sync()
    assert set(host_copy(buf, np.uint8, 64).tolist()) == {6}
    buf.free()
    ours.close()


# ----------------------------------------------------------------------------- host exports, stream 0

def test_numpy_reads_a_pinned_buffer_only_after_its_async_copy(primary):
    """copy(pinned, d, stream=s) is recorded on the pinned buffer; np.from_dlpack (stream None, a
    host reader) makes the host wait for s first.  s is busy for ~15-20 ms before the copy, so a
    read that did not wait would see the zeros the buffer starts with."""
    n = 1 << 24
    d = DeviceBuffer(4 * n)
    pinned = mem.PinnedBuffer(4 * n)
    pinned.numpy()[:] = 0
    s = Stream(non_blocking=True)
    scratch = slow_then_fill(s, d, 7)
    mem.copy(pinned, d, stream=s)
    assert pinned.last_stream is s
    arr = np.from_dlpack(pinned).view(np.int32)
    assert pinned.last_stream is None
    assert (arr == 7).all()
    del arr
    gc.collect()
    scratch.free_async(s)
    s.synchronize()
    pinned.free()
    d.free()


def test_torch_default_stream_is_never_exported_as_stream_0(primary):
    torch = pytest.importorskip("torch")
    default = torch.cuda.default_stream()
    assert default.cuda_stream == 0                       # torch's name for the NULL stream
    marker = default_marker(cuproc.driver.default_driver())   # 1 (legacy) unless per-thread
    d = DeviceBuffer(64)
    mem.memset(d, 1, stream=default)
    assert d.__cuda_array_interface__["stream"] == marker != 0
    a = mem.alloc_async(64, default)
    assert a.__cuda_array_interface__["stream"] == marker
    a.free()
    d.free()
