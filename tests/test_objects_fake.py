"""The object layer's behaviour, module by module, on the stateful fake driver (CI has no GPU).

Where test_ownership.py is about lifetimes, this file is about what each object does: values
that come back through a NumPy round trip, the fake's own counters (live objects, pool bytes,
the last launch's packed argument bytes) and the exception types of refusals.  The ``fk``
fixture checks afterwards that nothing stale reached the driver.
"""
from __future__ import annotations

import gc
import pickle
import struct
import sys
import weakref

import numpy as np
import pytest

import cuproc
from cuproc import Context, Device, DeviceBuffer, Event, Library, Module, PrimaryContext, Stream
from cuproc import memory as mem
from cuproc.errors import ClosedResourceError, CudaError, InvalidContextError, InvalidValueError, NotFoundError
from cuproc import launch as L
from cuproc.launch import launch_ex, pack_bytes
from cuproc.module import JitResult, Kernel, Linker
from cuproc.stream import HostCallbackError, default_stream, launch_host_func, stream_context, stream_handle
from cuproc._support import handle_int

from fakedriver import fake_image

SIG = ["float*", "int", "float"]
IMAGE = fake_image({"empty": [8, 4, 4], "fake_pair": [8, 8]}, {"counter": 16}, {"shared": 8})
INVALID_IMAGE = 200
NOT_READY = 600
UNSUPPORTED_PTX = 222
ffi = cuproc.ffi


@pytest.fixture()
def two(fk):
    """Two created contexts, on devices 0 and 1; none is current afterwards."""
    a = Context.create(0)
    Context.pop()
    b = Context.create(1)
    Context.pop()
    yield a, b
    gc.collect()
    for ctx in (a, b):
        ctx.destroy()


def host_of(obj, n, dtype=np.uint8):
    out = np.zeros(n, dtype)
    mem.copy(out, obj, out.nbytes)
    return out


class CAI:
    """A foreign device array: only ``__cuda_array_interface__``."""

    def __init__(self, ptr, shape, typestr="|u1", strides=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr,
                                         "strides": strides, "version": 3}


# ----------------------------------------------------------------------------- device.py

def test_device_identity_and_attributes(fk):
    devs = Device.all()
    assert Device.count() == len(devs) == 2
    d = devs[1]
    assert d.name == "Fake GPU 1" and d.total_memory == 1 << 30
    assert d.uuid.startswith("GPU-") and len(d.uuid) == 40 and d.uuid != devs[0].uuid
    assert Device.from_pci_bus_id(d.pci_bus_id) == d and d != devs[0] and hash(d) == hash(Device(1))
    assert d.compute_capability == (9, 0)
    assert d.attribute("MULTIPROCESSOR_COUNT") == d.attribute("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT") == 132
    assert d.attribute(16) == d.multiprocessor_count == 132
    assert (d.max_threads_per_block, d.warp_size) == (1024, 32)
    attrs = d.attributes()
    assert attrs["WARP_SIZE"] == 32 and attrs["COMPUTE_CAPABILITY_MAJOR"] == 9
    with pytest.raises(KeyError):
        d.attribute("NO_SUCH_ATTRIBUTE")
    with pytest.raises(TypeError):
        pickle.dumps(d)
    assert d.can_access_peer(devs[0]) and "1" in repr(d)


# ----------------------------------------------------------------------------- memory.py queries

def test_mem_info_counts_allocations(fk, pc):
    free0, total = mem.mem_info()
    buf = DeviceBuffer(1 << 20)
    free1, _ = mem.mem_info(pc.context)
    assert total == 1 << 30 and free0 - free1 == 1 << 20
    buf.free()
    assert mem.mem_info()[0] == free0


def test_mem_info_needs_a_context(fk):
    with pytest.raises(InvalidContextError):
        mem.mem_info()


def test_pointer_attributes_classify_memory(fk, pc):
    buf, pinned, managed = DeviceBuffer(256), mem.PinnedBuffer(64), mem.ManagedBuffer(64)
    info = mem.pointer_attributes(buf.ptr + 16)
    assert info["memory_type"] == "device" and info["device_ordinal"] == 0 and not info["is_managed"]
    assert info["context"] == handle_int(pc.context.handle) and info["range"] == (buf.ptr, 256)
    assert mem.pointer_attributes(buf)["range"] == (buf.ptr, 256)
    assert mem.pointer_attributes(pinned)["memory_type"] == "host"
    assert mem.pointer_attributes(managed)["is_managed"] is True
    assert mem.pointer_attributes(np.zeros(8).ctypes.data) == {"memory_type": None}


# ----------------------------------------------------------------------------- transfers.py

def test_copy_2d_round_trip_with_pitches(fk, pc):
    src = np.arange(32, dtype=np.uint8).reshape(4, 8)
    dev = DeviceBuffer(16 * 4)
    mem.copy_2d(dev, 16, src, 8, 6, 4)
    back = np.zeros((4, 8), np.uint8)
    mem.copy_2d(back, 8, dev, 16, 6, 4, stream=Stream())
    np.testing.assert_array_equal(back[:, :6], src[:, :6])
    assert not back[:, 6:].any()
    with pytest.raises(InvalidValueError):
        mem.copy_2d(dev, 4, src, 8, 6, 4)                 # width over a pitch
    with pytest.raises(InvalidValueError):
        mem.copy_2d(dev, 16, src, 8, 8, 5)                # more rows than the source has


def test_copy_3d_round_trip(fk, pc):
    src = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    dev = DeviceBuffer(8 * 4 * 2)                         # pitch 8, slice height 4, depth 2
    mem.copy_3d(dev, 8, 4, src, 4, 3, 4, 3, 2)
    back = np.zeros_like(src)
    s = Stream()
    mem.copy_3d(back, 4, 3, dev, 8, 4, 4, 3, 2, stream=s)
    np.testing.assert_array_equal(back, src)
    with pytest.raises(InvalidValueError):
        mem.copy_3d(dev, 8, 2, src, 4, 3, 4, 3, 2)        # rows over the slice height
    with pytest.raises(InvalidValueError):
        mem.copy_3d(dev, 8, 4, src, 4, 3, 4, 3, 3)        # a slice more than the source has


@pytest.mark.parametrize("bits,dtype,value", [(8, np.uint8, 0xAB), (16, np.uint16, 0xBEEF),
                                              (32, np.uint32, 0xDEADBEEF)])
def test_memset_2d_fills_only_the_region(fk, pc, bits, dtype, value):
    item = bits // 8
    dev = DeviceBuffer(16 * 3)
    mem.memset(dev, 0)
    mem.memset_2d(dev, 16, value, 2, 3, element_bits=bits)
    mem.memset_2d(dev, 16, value, 2, 1, element_bits=bits, stream=Stream())
    back = host_of(dev, 48).reshape(3, 16)
    rows = back[:, :2 * item].copy().view(dtype)
    assert (rows == value).all() and not back[:, 2 * item:].any()


def test_memset_variants_and_refusals(fk, pc):
    dev = DeviceBuffer(64)
    mem.memset(dev, 0x1234, element_bits=16)
    assert (host_of(dev, 32, np.uint16) == 0x1234).all()
    mem.memset(dev, 7, 4, element_bits=32, stream=Stream())
    out = host_of(dev, 16, np.uint32)
    assert (out[:4] == 7).all() and out[4] == 0x12341234
    for bad in (lambda: mem.memset(dev, 1, element_bits=12), lambda: mem.memset(dev, 256),
                lambda: mem.memset(dev, 1, 65), lambda: mem.memset(np.zeros(4, np.uint8), 1),
                lambda: mem.memset(dev.ptr, 1), lambda: mem.memset_2d(dev, 4, 1, 8, 2),
                lambda: mem.memset_2d(dev, 32, 1, 8, 3), lambda: mem.memset_2d(dev, 8, 1, 1, 1, element_bits=7)):
        with pytest.raises(InvalidValueError):
            bad()
    mem.memset(dev.ptr + 8, 9, 4)                         # a raw address with a count
    assert host_of(dev, 16)[8:12].tolist() == [9] * 4


def test_async_and_device_to_device_copies(fk, pc):
    s = Stream()
    src = np.arange(64, dtype=np.float32)
    a, b = DeviceBuffer(256), DeviceBuffer(256)
    mem.copy(a, src, stream=s)
    mem.copy(b, a)                                        # DtoD
    c = DeviceBuffer(256)
    mem.copy(c, b, stream=s)                              # DtoD async
    back = np.zeros_like(src)
    mem.copy(back, c, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(back, src)


def test_cai_and_raw_address_sides(fk, pc):
    buf = DeviceBuffer(64)
    src = np.arange(16, dtype=np.int32)
    mem.copy(CAI(buf.ptr, (16,), "<i4"), src)             # a foreign array's interface
    assert (host_of(buf, 16, np.int32) == src).all()
    mem.copy(buf.ptr + 32, np.full(4, -1, np.int32))      # a raw address takes the host side's size
    back = np.zeros(16, np.int32)
    mem.copy(back, CAI(buf.ptr, (4, 4), "<i4", strides=(16, 4)))   # explicit, C-contiguous strides
    assert back[:8].tolist() == list(range(8)) and (back[8:12] == -1).all()
    other = DeviceBuffer(64)
    mem.copy(other.ptr, buf.ptr, 64)                      # two raw addresses: nbytes given
    assert (host_of(other, 16, np.int32) == back).all()
    for bad in (lambda: mem.copy(other.ptr, buf.ptr),                         # no size known
                lambda: mem.copy(CAI(buf.ptr, (4, 4), "<i4", strides=(4, 16)), src),   # Fortran order
                lambda: mem.copy(np.zeros(4), np.ones(4)),                    # host to host
                lambda: mem.copy(buf, [1, 2, 3]),                             # not a buffer
                lambda: mem.copy(buf, src, -1), lambda: mem.copy(buf, src, 1.5),
                lambda: mem.copy(buf, np.zeros(128, np.uint8), 128)):         # overruns the buffer
        with pytest.raises(InvalidValueError):
            bad()


def test_driver_failures_in_transfers_and_allocations_raise(fk, pc):
    buf, pinned = DeviceBuffer(64), mem.PinnedBuffer(64)
    pinned.numpy()[:] = 5
    mem.copy(buf.ptr, pinned)                             # the pinned side names the context
    fk.fail("cuMemcpyHtoD", 2, 1)
    with pytest.raises(cuproc.OutOfMemoryError):
        mem.copy(buf, pinned)
    fk.fail("cuMemAllocAsync", 2, 1)
    with pytest.raises(cuproc.OutOfMemoryError):
        mem.alloc_async(64)
    b = mem.alloc_async(64)
    fk.fail("cuMemFreeAsync", 1, 1)
    with pytest.raises(InvalidValueError):
        b.free_async()
    assert b.freed and (host_of(buf, 64) == 5).all()


def test_peer_copies_between_two_devices(two):
    a, b = two
    x, y = DeviceBuffer(256, context=a), DeviceBuffer(256, context=b)
    src = np.arange(64, dtype=np.float32)
    mem.copy(x, src)
    mem.copy(y, x)                                        # cuMemcpyPeer, no context current
    assert (host_of(y, 64, np.float32) == src).all()
    mem.copy(x, np.zeros(64, np.float32))
    mem.copy(x, y, stream=Stream(context=a))              # cuMemcpyPeerAsync on a's stream
    assert (host_of(x, 64, np.float32) == src).all()
    assert Context.current() is None


# ----------------------------------------------------------------------------- pools.py

def test_default_pool_is_not_owned(fk, pc):
    pool = mem.MemoryPool.default(Device(0))
    s = Stream()
    bufs = [mem.alloc_async(1000, s), mem.alloc_async(24)]
    assert pool.used_bytes == fk.pool_used(0) == 1024
    assert pool.get_attribute("CU_MEMPOOL_ATTR_USED_MEM_HIGH") == 1024
    del bufs
    gc.collect()
    assert pool.used_bytes == 0
    pool.set_attribute("USED_MEM_HIGH", 0)                # reset the high-water mark
    assert pool.get_attribute("used_mem_high") == 0
    pool.set_attribute("REUSE_ALLOW_OPPORTUNISTIC", 0)
    assert pool.get_attribute("REUSE_ALLOW_OPPORTUNISTIC") == 0
    pool.trim(0)
    pool.close()                                          # not owned: nothing happens
    with pytest.raises(InvalidValueError):
        pool.destroy()
    assert pool.used_bytes == 0 and not pool.closed


def test_created_pool_serves_allocations(fk, pc):
    pool = mem.MemoryPool.create(Device(0), release_threshold=1 << 20)
    assert fk.live("pool") == 1 and pool.release_threshold == 1 << 20
    pool.release_threshold = 4096
    s = Stream()
    buf = mem.alloc_async(512, s, pool=pool)
    mem.copy(buf, np.arange(512, dtype=np.uint16)[:256])
    assert pool.used_bytes == 512 and fk.pool_used(0) == 0 and buf.pool is pool
    assert (host_of(buf, 256, np.uint16) == np.arange(256)).all()
    buf.free_async()
    assert pool.used_bytes == 0 and pool.release_threshold == 4096
    pool.destroy()
    assert fk.live("pool") == 0
    with pytest.raises(ClosedResourceError):
        pool.used_bytes
    with pytest.raises(ClosedResourceError):
        mem.alloc_async(64, s, pool=pool)


# ----------------------------------------------------------------------------- stream.py

def test_stream_priorities_flags_and_query(fk, pc):
    least, greatest = Stream.priority_range()
    assert (least, greatest) == (0, -5)
    s = Stream(priority=greatest, non_blocking=True)
    assert s.priority == greatest and s.flags == 1 and s.query()
    assert Stream(flags=0).flags == 0 and Stream().priority == 0
    assert stream_context(s) is pc.context and stream_context(None) is None
    assert stream_handle(None) == default_stream() and handle_int(stream_handle(s)) == handle_int(s.handle)
    assert handle_int(stream_handle(handle_int(s.handle))) == handle_int(s.handle)
    s.close()
    assert "closed" in repr(s) or s.closed


def test_events_order_streams_and_time(fk, pc):
    s, t = Stream(), Stream()
    start, end = Event(), Event(blocking_sync=True)
    start.record(s)
    mem.memset(DeviceBuffer(64), 1, stream=s)
    end.record(s)
    t.wait(end)
    t.synchronize()
    end.synchronize()
    assert start.query() and end.query() and start.elapsed_ms(end) > 0
    cheap = Event(timing=False, interprocess=True).record()
    with pytest.raises(CudaError):
        start.elapsed_ms(cheap)                           # timing disabled: the driver refuses
    cheap.close()
    with pytest.raises(ClosedResourceError):
        t.wait(cheap)


def test_host_callbacks_run_and_errors_surface_on_synchronize(fk, pc):
    s = Stream()
    ran = []
    s.launch_host_func(lambda: ran.append(1))
    launch_host_func(s, lambda: ran.append(2))
    s.synchronize()
    assert ran == [1, 2]

    def boom():
        raise KeyError("from the callback")

    s.launch_host_func(boom)
    with pytest.raises(HostCallbackError) as info:
        s.synchronize()
    assert isinstance(info.value.__cause__, KeyError)
    s.synchronize()                                       # reported once
    assert s.query()


def test_not_ready_is_false_and_a_refused_host_function_is_not_kept(fk, pc):
    s, e = Stream(), Event().record()
    fk.fail("cuStreamQuery", NOT_READY, 1)
    fk.fail("cuEventQuery", NOT_READY, 1)
    assert (s.query(), e.query()) == (False, False)
    assert (s.query(), e.query()) == (True, True)
    fk.fail("cuLaunchHostFunc", 1, 1)
    ran = []
    with pytest.raises(InvalidValueError):
        s.launch_host_func(lambda: ran.append(1))
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None and ran == []                    # the refused callback holds nothing


def test_the_host_trampoline_is_made_once_kept_forever_and_a_failure_to_make_it_keeps_nothing(fk, pc, monkeypatch):
    """The C function the driver calls for host functions is made by the first launch_host_func and never
    freed (the driver may call it during the interpreter's teardown); when making it fails, the call
    raises before any pending record exists, so the function and its stream are not kept."""
    from cuproc import stream as stream_module
    made = stream_module._host_trampoline()
    assert stream_module._host_trampoline() is made
    kept = weakref.ref(made)
    stream_module._trampoline.clear()                     # what the module's teardown does to its globals
    del made
    gc.collect()
    saved = [kept()]
    assert saved[0] is not None                           # one reference never given back

    def refuse(obj):
        raise RuntimeError("no callback today")
    monkeypatch.setattr(stream_module, "keep_forever", refuse)
    s, ran, pending = Stream(), [], dict(stream_module._pending)
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="no callback today"):
                s.launch_host_func(lambda: ran.append(1))
        assert stream_module._pending == pending and not stream_module._trampoline
    finally:
        stream_module._trampoline[:] = saved
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None and ran == []


def test_a_host_function_is_dropped_only_when_the_driver_never_queued_it(fk, pc, monkeypatch):
    """launch_host_func drops its pending record when the call fails before the driver queued the
    function (an exception from the call), and keeps it when the call is interrupted after (a
    KeyboardInterrupt): the function then still runs when the driver calls the trampoline."""
    from cuproc import stream as stream_module
    s, ran, queued = Stream(), [], []
    pending = dict(stream_module._pending)

    def refuses(*args):
        raise RuntimeError("refused before queueing")
    monkeypatch.setattr(s.driver, "cuLaunchHostFunc", refuses)
    with pytest.raises(RuntimeError, match="before queueing"):
        s.launch_host_func(lambda: ran.append("refused"))
    assert stream_module._pending == pending

    def queues_then_interrupted(stream, fn, data):
        queued.append((fn, data))
        raise KeyboardInterrupt
    monkeypatch.setattr(s.driver, "cuLaunchHostFunc", queues_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.launch_host_func(lambda: ran.append("queued"))
    (fn, data), = queued
    fn(data)                                              # the driver runs what it queued
    assert ran == ["queued"] and stream_module._pending == pending
    monkeypatch.undo()
    s.close()


# ----------------------------------------------------------------------------- context.py

def test_context_settings(fk):
    ctx = Context.create(1, flags=4)
    assert ctx.owned and ctx.device == Device(1) and ctx.flags == 4 and ctx.api_version == 3020
    assert ctx.get_limit("STACK_SIZE") == 1024
    ctx.set_limit("MALLOC_HEAP_SIZE", 1 << 24)
    ctx.set_limit(0, 4096)
    assert ctx.get_limit("CU_LIMIT_MALLOC_HEAP_SIZE") == 1 << 24 and ctx.get_limit(0) == 4096
    ctx.cache_config = "PREFER_SHARED"
    assert ctx.cache_config == ffi.typeof("CUfunc_cache").relements["CU_FUNC_CACHE_PREFER_SHARED"]
    ctx.cache_config = 0
    assert ctx.cache_config == 0 and ctx.shared_mem_config == 1
    ctx.synchronize()
    ctx.destroy()
    ctx.destroy()                                         # idempotent
    assert not ctx.alive and fk.live("context") == 0
    with pytest.raises(ClosedResourceError):
        ctx.get_limit("STACK_SIZE")


def test_destroying_a_context_frees_its_stream_ordered_memory(fk):
    ctx = Context.create(0)
    buf = mem.alloc_async(256, Stream())
    assert fk.pool_used(0) == 256
    ctx.destroy()
    assert buf.freed and fk.pool_used(0) == 0 and fk.live("async_alloc") == 0


def test_the_stack_push_pop_and_with_blocks(two):
    a, b = two
    assert Context.current() is None
    with a:
        assert Context.current() is a
        with b as inner:
            assert inner is b and Context.current() is b
        assert Context.current() is a
    b.set_current()
    assert Context.pop() is b and Context.current() is None
    assert Context.adopt(a.handle) is a and Context.wrap(b.handle) is b
    with pytest.raises(InvalidContextError):
        Context.pop()                                     # empty stack
    with pytest.raises(InvalidContextError):
        Context.require_current("cuMemAlloc")


def test_with_block_left_with_another_context_on_top_raises(two):
    a, b = two
    with pytest.raises(InvalidContextError):
        with a:
            b.push()                                      # never popped inside the block
    assert Context.pop() is b and Context.pop() is a   # b was put back on top of a
    assert Context.current() is None


def test_a_primary_context_cannot_be_destroyed(fk, pc):
    with pytest.raises(InvalidValueError):
        pc.context.destroy()
    pc.context.close()                                    # owns nothing: no-op
    assert pc.context.alive and pc.context.kind == "primary" and not pc.context.owned


def test_primary_context_state_flags_and_blocks(fk):
    pc = PrimaryContext(1)
    assert pc is PrimaryContext(Device(1)) and pc.state == (0, False)
    pc.set_flags(4)
    with pytest.raises(InvalidValueError):
        pc.handle                                         # not retained
    with pytest.raises(InvalidValueError):
        pc.release()
    with pc.retained() as held:
        assert held is pc and fk.primary_refcount(1) == 1 and pc.state == (4, True)
        assert Context.current() is None
    assert fk.primary_refcount(1) == 0 and not fk.primary_active(1)
    with pc as ctx:
        assert Context.current() is ctx and ctx.device == Device(1) and pc.retain_count == 1
        assert "1 retain" in repr(pc)
    assert Context.current() is None and not fk.primary_active(1)
    pc.reset()                                            # not retained: nothing to learn afterwards
    assert pc.state == (4, False) and pc.retain_count == 0


# ----------------------------------------------------------------------------- module.py

def test_module_load_from_bytes_and_files(fk, pc, tmp_path):
    path = tmp_path / "kernels.cubin"
    path.write_bytes(IMAGE)
    mods = [Module.load(IMAGE, {"OPTIMIZATION_LEVEL": 3, "CU_JIT_MAX_REGISTERS": 64}), Module.load(path),
            Module.load(str(path), {ffi.typeof("CUjit_option").relements["CU_JIT_OPTIMIZATION_LEVEL"]: 1})]
    assert fk.live("module") == 3 and isinstance(mods[0].jit, JitResult) and "JitResult" in repr(mods[0].jit)
    assert {m.get_function("empty").name for m in mods} == {"empty"}
    with pytest.raises(InvalidValueError) as info:
        Module.load(IMAGE, {"NO_SUCH_OPTION": 1})
    assert info.value.refused and fk.live("module") == 3
    with pytest.raises(CudaError) as info:
        Module.load(b"not an image\0")
    assert info.value.code == INVALID_IMAGE
    with pytest.raises(NotFoundError):
        mods[0].get_function("missing")
    fk.fail("cuModuleLoadDataEx", UNSUPPORTED_PTX, 1)
    with pytest.raises(CudaError) as info:
        Module.load_data("// PTX text, not a path\n.version 9.9\n.target sm_90\n")
    assert info.value.code == UNSUPPORTED_PTX
    mods[0].unload()
    assert "unloaded" in repr(mods[0]) and fk.live("module") == 2


def test_module_globals_copy_both_ways(fk, pc):
    m = Module.load(IMAGE)
    g = m.get_global("counter")
    assert g.nbytes == 16 and g.context is pc.context
    assert g.__cuda_array_interface__["data"][0] == g.ptr and "16 bytes" in repr(g)
    assert g.__cuda_array_interface__["stream"] == 1          # untracked: the legacy default stream
    mem.copy(g, np.array([1, 2, 3, 4], np.int32))
    assert host_of(g, 4, np.int32).tolist() == [1, 2, 3, 4]
    mem.memset(g, 0, element_bits=32)
    assert not host_of(g, 4, np.int32).any()


def test_function_attributes_and_occupancy(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    assert (fn.num_registers, fn.max_threads_per_block, fn.shared_size_bytes) == (32, 1024, 0)
    fn.max_dynamic_shared_size_bytes = 65536
    carveout = ffi.typeof("CUfunction_attribute").relements["CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT"]
    fn.set_attribute(carveout, 50)
    assert fn.max_dynamic_shared_size_bytes == 65536 and fn.attribute("PREFERRED_SHARED_MEMORY_CARVEOUT") == 50
    assert fn.attribute("CU_FUNC_ATTRIBUTE_PTX_VERSION") == 90
    fn.set_cache_config("PREFER_L1")
    fn.set_cache_config(0)
    assert fn.max_active_blocks_per_sm(256) == 8
    assert fn.suggested_block_size(block_size_limit=256) == (132 * 8, 256)
    assert fn.param_info() == [(0, 8), (8, 4), (12, 4)] and "empty" in repr(fn)
    with pytest.raises(InvalidValueError):
        fn.set_attribute("NUM_REGS", 1)                   # not settable: the driver refuses


def test_linker_output_loads(fk, pc, tmp_path):
    part = tmp_path / "part.cubin"
    part.write_bytes(fake_image({"second": [4]}))
    with Linker({"OPTIMIZATION_LEVEL": 2}) as linker:
        cubin, result = linker.add_data(fake_image({"first": [8]}), "cubin").add_file(part).complete()
        assert fk.live("link") == 1 and isinstance(result, JitResult)
    assert fk.live("link") == 0 and linker.closed
    m = Module.load(cubin)
    assert m.get_function("first").param_info() == [(0, 8)] and m.get_function("second").param_info() == [(0, 4)]
    junk = tmp_path / "junk.cubin"
    junk.write_bytes(b"garbage\0")
    with Linker() as bad:
        for attempt in (lambda: bad.add_data(b"garbage\0", "cubin"), lambda: bad.add_file(junk)):
            with pytest.raises(CudaError) as info:
                attempt()
            assert info.value.code == INVALID_IMAGE
    with pytest.raises(ClosedResourceError):
        bad.complete()
    with pytest.raises(CudaError) as info:
        Library(b"garbage\0")
    assert info.value.code == INVALID_IMAGE and fk.live("library") == 0


def test_library_kernels_globals_and_managed(fk, pc):
    lib = Library(IMAGE)
    assert lib.context_independent and fk.live("library") == 1
    k = lib.get_kernel("empty")
    assert isinstance(k, Kernel) and k.param_info() == [(0, 8), (8, 4), (12, 4)]
    g = lib.get_global("counter")
    mem.copy(g, np.arange(4, dtype=np.int32))
    assert host_of(lib.get_global("counter"), 4, np.int32).tolist() == [0, 1, 2, 3]
    address, size = lib.get_managed("shared")
    assert size == 8 and address
    buf = DeviceBuffer(64)
    k.launch(1, 32, (buf, np.int32(3), np.float32(0.5)))
    assert fk.last_launch() == ("empty", struct.pack("<Qif", buf.ptr, 3, 0.5))
    lib.unload()
    with pytest.raises(ClosedResourceError):
        lib.get_kernel("empty")


def test_kernel_function_in_two_contexts(fk, two):
    a, b = two
    k = Library(IMAGE).get_kernel("empty")
    with a:
        fa = k.function()
    with b:
        fb = k.function()
    assert fa.context is a and fb.context is b and handle_int(fa.handle) != handle_int(fb.handle)
    buf = DeviceBuffer(64, context=b)
    fb.launch(1, 1, (buf, np.int32(1), np.float32(2)))   # from no current context: bound to b
    assert fk.last_launch() == ("empty", struct.pack("<Qif", buf.ptr, 1, 2.0))


def test_kernel_function_for_a_context_that_is_not_current(two):
    a, b = two
    k = Library(IMAGE).get_kernel("empty")
    with b:
        fa, fb = k.function(a), k.function(b)
    handles = {handle_int(fa.handle), handle_int(fb.handle)}
    k.library.unload()                                    # nothing outlives the test when it fails
    assert len(handles) == 2


def test_an_explicit_context_wins_over_the_current_one(two):
    a, b = two
    with b:
        buf = DeviceBuffer(64, context=a)
        ordinal = mem.pointer_attributes(buf)["device_ordinal"]
        buf.free()
    assert ordinal == 0                                   # a is on device 0, b on device 1


def test_library_before_cuda_12_loads_a_module_per_context(fk):
    drv = cuproc.Driver("11.8", library=str(fk.path))    # no cuLibrary* at this version
    pcs = [PrimaryContext(i, driver=drv).retain() for i in (0, 1)]
    lib = Library(IMAGE, driver=drv)
    assert not lib.context_independent and fk.live("library") == 0 and "per-context" in lib.describe()
    k = lib.get_kernel("empty")
    f0, f1 = (k.function(pc.context) for pc in pcs)
    assert fk.live("module") == 2 and f0.context is pcs[0].context and f1.context is pcs[1].context
    g = lib.get_global("counter", context=pcs[1].context)
    mem.copy(g, np.arange(4, dtype=np.int32))
    assert host_of(g, 4, np.int32).tolist() == [0, 1, 2, 3]
    pcs[0].context.set_current()
    buf = DeviceBuffer(64)
    k.launch(1, 1, (buf, np.int32(2), np.float32(1)))   # the current context's module
    assert fk.last_launch() == ("empty", struct.pack("<Qif", buf.ptr, 2, 1.0))
    del f0, f1, g
    lib.unload()
    assert fk.live("module") == 0
    drv.cuCtxSetCurrent(ffi.NULL)
    del buf
    for pc in pcs:
        pc.release()


# ----------------------------------------------------------------------------- launch.py

def test_launch_conventions_and_one_shot_forms(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    expected = struct.pack("<Qif", buf.ptr, 5, 2.0)
    assert pack_bytes(SIG, (buf, 5, 2.0)) == expected
    run = fn.prepare(SIG, 1, 32, convention="params")
    run(buf, 5, 2.0)
    assert fk.last_launch() == ("empty", expected)
    fn.launch(2, (32, 2), (buf, np.int32(6), np.float32(2.0)))
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 6, 2.0)
    fn.launch(1, 32, (buf.ptr, 7, 2.0), signature=SIG, entry="cuLaunchKernel")
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 7, 2.0)
    with pytest.raises(InvalidValueError):
        fn.launch(1, 32, (buf, 7, np.float32(2.0)))       # a plain int without a signature
    with pytest.raises(InvalidValueError):
        fn.launch(1, 32, (buf, np.int32(7)))              # one argument short: the driver's param info says 3


def test_launch_ex_and_cooperative(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    s = Stream(priority=-1)
    before = fk.launch_count()
    launch_ex(fn, (2, 1, 1), 64, (buf, np.int32(1), np.float32(3)), cluster=(2, 1, 1), priority=-1, stream=s)
    assert fk.last_launch() == ("empty", struct.pack("<Qif", buf.ptr, 1, 3.0))
    launch_ex(fn, 1, 32, (buf, 2, 3.0), signature=SIG, cooperative=True)
    fn.launch(1, 32, (buf, np.int32(4), np.float32(3)), cooperative=True, stream=s)
    assert fk.launch_count() - before == 3
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 4, 3.0)
    with pytest.raises(InvalidValueError):
        launch_ex(fn, 1, 32, (buf, np.int32(1), np.float32(3)), cluster=(0, 1))


def test_one_shot_cache_is_per_stream_object(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    args = (buf, np.int32(1), np.float32(1))
    s = Stream()
    fn.launch(1, 32, args, stream=s)
    (first,) = fn.launch_cache.values()
    fn.launch(1, 32, args, stream=s)
    assert list(fn.launch_cache.values()) == [first] and first[1]() is s   # reused, held weakly
    s2 = Stream()
    key = next(iter(fn.launch_cache))
    key2 = key[:1] + (("stream", id(s2)),) + key[2:]
    fn.launch_cache[key2] = first                         # as if s2 were a new Stream at a dead one's id
    fn.launch(1, 32, args, stream=s2)
    assert fn.launch_cache[key2][0] is not first[0] and fn.launch_cache[key2][1]() is s2
    s.close()
    with pytest.raises(ClosedResourceError):
        fn.launch(1, 32, args, stream=s)
    assert fk.launch_count() == 3


TYPED = fake_image({"typed": [8, 16, 8, 4, 8]})
PAIR = np.dtype([("a", "<i4"), ("b", "<f4")])


def test_typed_arguments_pack_as_the_kernel_sees_them(fk, pc):
    fn = Module.load(TYPED).get_function("typed")
    buf = DeviceBuffer(64)
    run = fn.prepare(["float2", "float4", PAIR, "int", "void*"], 1, 1)
    layout = "<2f8x4fifi4xQ"                              # float2 @0, float4 @16, struct @32, int @40, ptr @48
    run((1.0, 2.0), np.arange(4, dtype=np.float32), np.array((7, 1.5), PAIR)[()], np.int32(9), np.uint64(buf.ptr))
    assert fk.last_launch() == ("typed", struct.pack(layout, 1, 2, 0, 1, 2, 3, 7, 1.5, 9, buf.ptr))
    L.PreparedLaunch(fn, ["float2", "float4", PAIR, "int", "void*"], 1, 1)([3.0, 4.0], [5.0, 6.0, 7.0, 8.0], struct.pack("<if", -1, 0.25), 10, ffi.cast("void *", buf.ptr))
    assert fk.last_launch()[1] == struct.pack(layout, 3, 4, 5, 6, 7, 8, -1, 0.25, 10, buf.ptr)
    run((0, 0), (0, 0, 0, 0), bytes(8), 0, buf.view(np.float32))
    assert fk.last_launch()[1][48:] == struct.pack("<Q", buf.ptr)
    ok = ((0, 0), (0, 0, 0, 0), bytes(8), 0, buf)
    for i, bad in ((0, (1.0,)), (2, bytes(4)), (2, object()), (3, "x"), (4, -1), (4, "not a pointer")):
        with pytest.raises(InvalidValueError):
            run(*ok[:i], bad, *ok[i + 1:])
    prepared = L.PreparedLaunch(fn, ["float2", "float4", PAIR, "int", "void*"], 1, 1)
    assert fk.launch_count() == 3 and "typed" in repr(prepared) and run.entry == prepared.entry
    with pytest.raises(TypeError):
        pickle.dumps(prepared)


def test_launch_refusals_before_the_driver(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    for bad in (lambda: fn.prepare(SIG, convention="bogus"), lambda: fn.prepare(SIG, entry="cuLaunch"),
                lambda: fn.prepare(SIG, shared_mem=-1), lambda: fn.prepare(["float*", "int", "double"]),
                lambda: fn.prepare(["float*", "int", "quux"]), lambda: fn.prepare(SIG, grid=(1, 0)),
                lambda: fn.prepare([object()]), lambda: fn.launch(1, 1, ("text", np.int32(1), np.float32(1)))):
        with pytest.raises(InvalidValueError):
            bad()
    assert pack_bytes([ffi.typeof("CUuuid")], [ffi.new("CUuuid *")[0]]) == bytes(16)
    s = Stream()
    run = fn.prepare(SIG, 1, 1, stream=s)
    s.close()
    with pytest.raises(ClosedResourceError):
        run(DeviceBuffer(64), 1, 1.0)
    assert fk.launch_count() == 0


def test_one_shot_cache_stays_bounded_and_library_kernels_bind_to_the_stream(fk, two):
    a, b = two
    k = Library(IMAGE).get_kernel("empty")
    buf = DeviceBuffer(64, context=b)
    s = Stream(context=b)
    launch_ex(k, 1, 1, (buf, np.int32(1), np.float32(1)), stream=s)     # no context current: the stream's
    fn = Module.load(IMAGE, context=a).get_function("empty")
    x = DeviceBuffer(64, context=a)
    for g in range(1, 70):
        fn.launch(g, 1, (x, np.int32(g), np.float32(0)))   # one entry: the grid comes with each launch
        assert fk.last_launch_config()[0] == (g, 1, 1)
    assert len(fn.launch_cache) == 1
    streams = [Stream(context=a) for _ in range(70)]
    for t in streams:                                       # an entry per stream: no more than 64 kept
        fn.launch(1, 1, (x, np.int32(1), np.float32(0)), stream=t)
    assert len(fn.launch_cache) == 64 and fk.launch_count() == 140 and Context.current() is None
    assert fk.last_launch() == ("empty", struct.pack("<Qif", x.ptr, 1, 0.0))


# ----------------------------------------------------------------------------- host_memory.py

def test_pinned_flags_mapping_and_views(fk, pc):
    drv = cuproc.driver.default_driver()
    plain = mem.PinnedBuffer(64)
    flagged = mem.PinnedBuffer(256, portable=True, mapped=True, write_combined=True)
    assert plain.flags == 0 and flagged.flags == (drv.CU_MEMHOSTALLOC_PORTABLE | drv.CU_MEMHOSTALLOC_DEVICEMAP |
                                                  drv.CU_MEMHOSTALLOC_WRITECOMBINED)
    assert flagged.device_pointer == flagged.ptr           # the fake maps host memory at its own address
    view = flagged.numpy(np.float32)
    view[:] = np.arange(64)
    dev = DeviceBuffer(256)
    mem.copy(dev, flagged)
    assert (host_of(dev, 64, np.float32) == np.arange(64)).all()
    with pytest.raises(BufferError):
        flagged.free()                                    # a view is alive
    del view
    gc.collect()
    flagged.free()
    assert fk.live("host_alloc") == 1
    with pytest.raises(InvalidValueError):
        mem.PinnedBuffer(-1)


def test_registered_host_memory(fk, pc):
    arr = np.arange(1024, dtype=np.uint8)
    reg = mem.RegisteredHostMemory(arr, portable=True, mapped=True)
    assert fk.live("registered") == 1 and reg.obj is arr and len(reg) == 1024
    dev = DeviceBuffer(1024)
    mem.copy(dev, reg)
    assert (host_of(dev, 1024) == arr).all()
    reg.unregister()
    frozen = np.arange(64, dtype=np.uint8)
    frozen.flags.writeable = False
    ro = mem.RegisteredHostMemory(frozen, read_only=True)
    mem.copy(dev, ro)
    assert fk.live("registered") == 1 and (host_of(dev, 64) == frozen).all()
    for bad in (lambda: mem.RegisteredHostMemory(frozen), lambda: mem.RegisteredHostMemory(arr[::2])):
        with pytest.raises(InvalidValueError):
            bad()
    assert fk.live("registered") == 1


def test_read_only_registered_memory_is_never_written(fk, pc):
    """Memory registered with read_only=True (here an immutable bytes) is refused as what any call would
    write -- copies on every path (twice: a second copy once took a compiled front), a stream-ordered copy,
    copy_2d, memset -- before the driver sees it; its views are read-only and an unversioned DLPack export,
    which cannot say so, is refused.  As a source it copies."""
    frozen = bytes(range(64))
    ro = mem.RegisteredHostMemory(frozen, read_only=True)
    dev = DeviceBuffer(64)
    mem.copy(dev, bytes(64))
    assert ro.read_only and not mem.RegisteredHostMemory(np.zeros(8, np.uint8)).read_only
    stream = Stream()
    writes = [lambda: mem.copy(ro, dev), lambda: mem.copy(ro, dev), lambda: mem.copy(ro, dev, 8),
              lambda: mem.copy(ro, dev, stream=stream), lambda: mem.copy(ro, np.zeros(64, np.uint8)),
              lambda: mem.copy_2d(ro, 8, dev, 8, 8, 8), lambda: mem.memset(ro, 7)]
    fk.clear_calls()
    for write in writes:
        with pytest.raises(InvalidValueError, match="registered read-only") as info:
            write()
        assert info.value.call in ("cuMemcpy", "cuMemcpy2D", "cuMemsetD8")
    assert fk.calls() == [] and frozen == bytes(range(64))
    mem.copy(dev, ro)                                          # the source side: read, as registered
    assert (host_of(dev, 64) == np.arange(64, dtype=np.uint8)).all()
    view = ro.buffer
    assert view.readonly and not ro.numpy().flags.writeable and view.obj is frozen   # no writable array behind it
    with pytest.raises(TypeError):
        view[0] = 1
    with pytest.raises(TypeError):
        view.obj[0] = 1
    with pytest.raises(AttributeError):
        ro.read_only = False                                   # fixed at registration
    del view
    with pytest.raises(BufferError, match="read-only"):
        ro.__dlpack__()
    through = np.from_dlpack(ro, device="cpu")                 # NumPy asks for a versioned capsule
    assert not through.flags.writeable and bytes(through) == frozen
    copied = np.from_dlpack(ro, device="cpu", copy=True)
    assert bytes(copied) == frozen
    del through, copied
    gc.collect()
    ro.unregister()
    for view in (lambda: ro.buffer, ro.numpy):                 # an unregistered registration has no views
        with pytest.raises(ClosedResourceError):
            view()
    stream.close()
    dev.free()
    assert fk.live("registered") == 0 and fk.live("device_alloc") == 0


def test_managed_prefetch_and_advise(fk, pc):
    buf = mem.ManagedBuffer(256)
    host = buf.numpy(np.int32)
    host[:] = np.arange(64)
    buf.prefetch(0)
    buf.prefetch(Device(0), stream=Stream())
    buf.prefetch("cpu")
    buf.advise("SET_READ_MOSTLY", 0)
    buf.advise("CU_MEM_ADVISE_SET_PREFERRED_LOCATION", "cpu")
    buf.advise(ffi.typeof("CUmem_advise").relements["CU_MEM_ADVISE_SET_ACCESSED_BY"], Device(0))
    assert buf.__cuda_array_interface__["data"][0] == buf.ptr and buf.__cuda_array_interface__["shape"] == (256,)
    dev = DeviceBuffer(256)
    mem.copy(dev, buf)
    assert (host_of(dev, 64, np.int32) == np.arange(64)).all()
    host_only = mem.ManagedBuffer(64, attach_global=False)
    assert mem.pointer_attributes(host_only)["is_managed"]
    with pytest.raises(InvalidValueError):
        mem.ManagedBuffer(0)


# ----------------------------------------------------------------------------- device_memory.py

def test_device_views_and_array_interfaces(fk, pc):
    buf = DeviceBuffer(64)
    v = buf.view(np.float32)
    assert v.shape == (16,) and v.typestr == "<f4" and v.nbytes == 64 and v.context is pc.context
    grid = buf.view("<i4", (2, 4))
    assert grid.__cuda_array_interface__ == {"shape": (2, 4), "typestr": "<i4", "data": (buf.ptr, False),
                                             "version": 3, "strides": None, "stream": 1}  # the legacy default stream
    assert buf.view(np.int16, 8).shape == (8,) and buf.__cuda_array_interface__["shape"] == (64,)
    with pytest.raises(InvalidValueError):
        buf.view(np.float64, (3, 3))                      # 72 bytes of a 64-byte buffer
    mem.copy(grid, np.arange(8, dtype=np.int32))
    assert host_of(buf, 8, np.int32).tolist() == list(range(8))
    assert v.__dlpack_device__() == (2, 0) and type(v.__dlpack__()).__name__ == "PyCapsule"
    with pytest.raises(BufferError):
        buf.view(">f4").__dlpack__()                     # DLPack has no big-endian types
    with pytest.raises(TypeError):
        pickle.dumps(buf)
    buf.free()
    assert buf.freed and "freed" in repr(buf)
    with pytest.raises(ClosedResourceError):
        mem.copy(np.zeros(8, np.int32), grid)


def test_allocation_refusals_and_free_async(fk, pc):
    for bad in (lambda: DeviceBuffer(0), lambda: DeviceBuffer(1.5), lambda: mem.alloc_async(-1)):
        with pytest.raises(InvalidValueError):
            bad()
    s = Stream()
    raw = mem.alloc_async(128, handle_int(s.handle))      # a raw stream handle
    assert fk.pool_used(0) == 128
    raw.free_async(s)
    plain = DeviceBuffer(64)
    plain.free_async()
    plain.free_async()                                    # idempotent
    assert fk.pool_used(0) == 0 and fk.live("device_alloc") == 0 and fk.live("async_alloc") == 0


@pytest.mark.parametrize("kind", ["PinnedBuffer", "ManagedBuffer"])
def test_numpy_frombuffer_of_host_memory_holds_it(pc, kind):
    """np.frombuffer(buf) (Python 3.12+: PEP 688 ``__buffer__``; before, ``buf.buffer``) must hold the
    memory: without __release_buffer__ NumPy released the buffer at once and kept only the object, so
    close() freed under the array."""
    buf = getattr(mem, kind)(4096)
    exporter = buf if sys.version_info >= (3, 12) else buf.buffer
    assert hasattr(type(buf), "__buffer__") == (sys.version_info >= (3, 12))
    arr = np.frombuffer(exporter, dtype=np.uint8)
    del exporter
    assert buf.has_views()
    with pytest.raises(BufferError):
        buf.close()
    arr[:] = 7                       # still this allocation's memory
    del arr
    gc.collect()
    buf.close()
    assert buf.ended is not None


def test_peer_access_is_state_of_two_contexts(fk):
    """cuCtxEnablePeerAccess acts on the current context and names the peer context: cuproc makes ``self`` current
    for the call, and the answer is per pair of contexts (not of devices).  A context of the same device is no peer,
    a primary context not retained is refused before the driver, a destroyed one is a closed resource."""
    fk.set_device_count(3)
    d0, d1 = Device(0), Device(1)
    assert d0.can_access_peer(d1) and not d0.can_access_peer(d0)
    p0, p1 = PrimaryContext(0).retain(), PrimaryContext(d1).retain()
    p1.context.set_current()                                  # not p0's: the call must make p0 current
    assert p0.context.enable_peer_access(p1) is True
    assert p0.context.enable_peer_access(p1.context) is False  # already: the same pair
    assert p1.context.enable_peer_access(p0) is True          # the other direction is another state
    assert Context.current() is p1.context
    same = Context.create(0)
    Context.pop()
    with pytest.raises(CudaError) as info:
        p0.context.enable_peer_access(same)
    assert info.value.call == "cuCtxEnablePeerAccess" and info.value.code == 101   # CUDA_ERROR_INVALID_DEVICE
    with pytest.raises(InvalidValueError, match="not retained"):
        p0.context.enable_peer_access(PrimaryContext(2))
    same.destroy()
    with pytest.raises(ClosedResourceError):
        p0.context.enable_peer_access(same)
    assert p0.context.disable_peer_access(p1) is True and p0.context.disable_peer_access(p1) is False
    assert p1.context.disable_peer_access(p0) is True
    cuproc.driver.default_driver().cuCtxSetCurrent(cuproc.ffi.NULL)
    for pc in (p0, p1):
        pc.release()
