"""Calls the driver runs in whichever context is current are made with their memory's context current.

Measured on an H200 (driver 580, 2026-11-29, with context B current and objects of context A): a launch on a
stream of A, cuMemsetD8 and the synchronous copies of A's memory, cuMemFreeAsync on the default stream,
cuStreamSynchronize of A's stream, cuModuleUnload, cuStreamDestroy and cuEventDestroy all returned 0.  Only a
launch of A's function and an event record of A's event *on the default stream* were refused
(CUDA_ERROR_INVALID_HANDLE).  So cuproc's "as is first, bind on a binding error" carried a synchronous memset
of a created context's buffer out on the *primary* context's default stream; the buffer was freed and its
context destroyed before it ran, and the GPU random sequences stopped on CUDA_ERROR_LAUNCH_FAILED (seed
11000063).  The fake driver now does what the real one does and counts such a call (``misrouted_count``);
each test here asserts it stays 0 and that the data is right.
"""
from __future__ import annotations

import numpy as np
import pytest

import cuproc
from cuproc import Context, DeviceBuffer, Stream
from cuproc import memory as mem
from cuproc.errors import InvalidValueError

N = 64


def _routed(fk) -> None:
    assert fk.misrouted_count() == 0, f"run in another, current context: {fk.misrouted_calls()}"


@pytest.fixture()
def created(fk, pc):
    """A created context that is not current (the primary one is), destroyed afterwards."""
    ctx = Context.create(0)
    Context.pop()
    yield ctx
    ctx.destroy()


@pytest.fixture(params=["front", "python"])
def copy(request):
    """memory.copy as users call it (the compiled front where it is built) and its Python code."""
    return mem.copy if request.param == "front" else getattr(mem.copy, "__wrapped__", mem.copy)


def test_a_synchronous_memset_of_a_created_contexts_buffer_runs_in_that_context(fk, created):
    """The GPU's failing sequence: a created context's buffer, the primary context current, a memset."""
    buf = DeviceBuffer(N * 4, context=created)
    mem.memset(buf, 7)
    _routed(fk)
    back = np.zeros(N * 4, np.uint8)
    mem.copy(back, buf)
    assert (back == 7).all()
    buf.close()


@pytest.mark.parametrize("direction", ["htod", "dtoh"])
def test_a_synchronous_copy_runs_in_the_buffers_context(fk, pc, created, copy, direction):
    buf = DeviceBuffer(N * 4, context=created)
    src = np.arange(N, dtype=np.float32)
    pinned = mem.PinnedBuffer(N * 4)               # the front's case: device buffer and pinned memory
    with created:                                  # the pair checked once, with its context current: from
        copy(buf, pinned)                          # here on the front (where built) would take the copy
        copy(pinned, buf)                          # itself, were the context current
    pinned.numpy(np.float32)[:] = src
    taken = getattr(mem.copy, "taken", 0)
    fk.clear_calls()
    if direction == "htod":
        copy(buf, pinned)
    else:
        mem.copy(buf, src)
        copy(pinned, buf)
    _routed(fk)
    assert getattr(mem.copy, "taken", 0) == taken  # the front handed it to the Python code, which pushed
    assert "cuCtxPushCurrent" in fk.calls()
    back = np.zeros_like(src)
    mem.copy(back, buf)
    assert np.array_equal(back, src) and np.array_equal(pinned.numpy(np.float32), src)
    # the context was pushed for the call and popped: the primary one is current again
    assert Context.current() is pc.context
    buf.close()


class _Exported:
    """Another library's array over device memory (``__cuda_array_interface__``, no stream to wait for)."""

    def __init__(self, address: int, nbytes: int, stream: int | None = None) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "stream": stream}


def test_raw_and_exported_memory_runs_in_the_context_the_driver_records_for_it(fk, created):
    """A raw address or a CAI array names no cuproc context: the driver's record of the memory's context
    (CU_POINTER_ATTRIBUTE_CONTEXT) is where a synchronous call must run."""
    buf = DeviceBuffer(N * 4, context=created)
    mem.memset(_Exported(buf.ptr, N * 4), 7)
    mem.memset(buf.ptr, 8, N * 4)
    mem.copy(_Exported(buf.ptr, 16), np.full(16, 9, np.uint8))
    _routed(fk)
    back = np.zeros(N * 4, np.uint8)
    mem.copy(back, buf)
    assert (back[:16] == 9).all() and (back[16:] == 8).all()
    buf.close()


def test_a_failed_front_copy_is_raised_not_made_again(fk, pc, monkeypatch):
    """The front makes the copy with the context current: a binding answer is raised as the Python code raises
    it, never retried (a retry copied a second time where the Python code raised)."""
    import cuproc.transfers as transfers
    front = hasattr(mem.copy, "taken")             # the compiled copy front is built (else the Python copy alone)
    buf, pinned = DeviceBuffer(64), mem.PinnedBuffer(64)
    for _ in range(2):
        mem.copy(pinned, buf)                      # checked: the front's case from here on
    python_copy = transfers._copied_between_allocations

    def not_python(*args):
        raise AssertionError("the Python code ran: the front did not take the copy")
    for how in (mem.copy, mem.copy.__wrapped__) if front else (mem.copy,):
        monkeypatch.setattr(transfers, "_copied_between_allocations",
                            not_python if front and how is mem.copy else python_copy)
        fk.fail("cuMemcpyDtoH", cuproc.driver.CUDA_ERROR_INVALID_CONTEXT, 1)
        fk.clear_calls()
        with pytest.raises(cuproc.CudaError) as info:
            how(pinned, buf)
        assert info.value.call == "cuMemcpyDtoH" and fk.calls().count("cuMemcpyDtoH") == 1
    buf.close()
    pinned.close()


def test_a_raw_stream_of_another_context_belongs_to_that_context(fk, pc, created):
    """A raw stream handle names its own context (cuStreamGetCtx): work ordered after it records its event
    there, and memory allocated on it is that context's (it ends with it)."""
    s = Stream(context=created)
    raw = int(cuproc.ffi.cast("uintptr_t", s.handle))
    buf = mem.alloc_async(256, stream=raw)
    assert buf.context is created
    mem.memset(buf, 1, stream=raw)
    back = np.zeros(256, np.uint8)
    mem.copy(back, buf)                            # the default stream waits for the raw stream's memset
    assert (back == 1).all() and fk.binding_errors() == 0
    buf.free_async()
    _routed(fk)
    assert fk.live("async_alloc") == 0 and fk.stale_count() == 0
    s.close()


def test_a_blocking_stream_of_another_context_is_not_ordered_with_this_ones_default_stream(fk, pc, created):
    """The legacy stream waits for the blocking streams of its own context only: a copy on another context's
    blocking stream into a buffer freed on this context's default stream must be waited for explicitly."""
    s = Stream(context=created)                    # blocking
    near = mem.alloc_async(256, context=pc.context)
    far = DeviceBuffer(256, context=created)
    mem.copy(near, far, stream=s)                  # a peer copy on the other context's blocking stream
    near.free_async()                              # on the primary context's default stream
    assert fk.unordered_frees() == 0
    far.close()
    s.close()


def test_async_work_on_the_default_stream_runs_in_the_buffers_context(fk, created):
    buf = DeviceBuffer(N * 4, context=created)
    mem.memset(buf, 3, stream=cuproc.ffi.cast("CUstream", 0))      # asynchronous, on the default stream
    _routed(fk)
    back = np.zeros(N * 4, np.uint8)
    mem.copy(back, buf)
    assert (back == 3).all()
    buf.close()


def test_a_stream_ordered_buffer_of_the_default_stream_is_freed_in_its_context(fk, created):
    buf = mem.alloc_async(N * 4, context=created)  # the default stream of the context (pushed for the call)
    mem.memset(buf, 1)
    buf.free_async()                               # on that default stream: ctx's, not the primary one's
    _routed(fk)
    assert fk.unordered_frees() == 0 and fk.live("async_alloc") == 0


def test_work_on_a_stream_of_another_context_needs_no_push(fk, created):
    """A call that names its stream runs where that stream is: as is, one driver call."""
    s = Stream(context=created)
    buf = DeviceBuffer(N * 4, context=created)
    fk.clear_calls()
    mem.memset(buf, 5, stream=s)
    assert [c for c in fk.calls() if c.startswith("cuCtx")] == []
    s.synchronize()
    _routed(fk)
    buf.close()
    s.close()


def test_a_default_stream_value_is_not_a_stream_of_its_own(fk, pc):
    """A Stream object is never a default stream (the invariant that lets a Stream's calls go as is)."""
    for value in (0, 1, 2):
        with pytest.raises(InvalidValueError) as info:
            Stream.from_handle(value, context=pc.context)
        assert "default stream" in str(info.value)     # the reason given is the default stream, not another


# ----------------------------------------------------------------------------- review fixes of 2026-11-29

def _spy_current(monkeypatch, *names):
    """Record (name, first argument as an int, the current context's handle as an int) of every call the
    default handle makes to ``names``: where a call runs is the context current when it is made."""
    drv = cuproc.driver.default_driver()
    calls = []
    for name in names:
        real = getattr(drv, name)

        def wrapper(*args, _real=real, _name=name):
            cur = Context.current()
            first = args[0]
            if isinstance(first, cuproc.ffi.CData):
                first = int(cuproc.ffi.cast("uintptr_t", first))
            calls.append((_name, first, None if cur is None else handle_int(cur.handle)))
            return _real(*args)
        monkeypatch.setattr(drv, name, wrapper)
    return calls


def handle_int(h) -> int:
    return int(cuproc.ffi.cast("uintptr_t", h))


@pytest.mark.parametrize("marker", [1, 2])
def test_a_cai_export_on_another_contexts_default_stream_is_waited_for_in_that_context(fk, pc, created, monkeypatch,
                                                                                    marker):
    """CAI's stream 1 (2) is the legacy (per-thread) default stream of the exporter's context.  A synchronous copy
    runs in the cuproc side's context, whose default stream is not ordered with another context's: the exporter's
    default stream is synchronized with *its* context current (it returned early for 1, and synchronized the
    cuproc side's context's stream 2)."""
    exported = DeviceBuffer(64, context=created)
    mine = DeviceBuffer(64)                        # the primary context's, current
    calls = _spy_current(monkeypatch, "cuStreamSynchronize")
    mem.copy(mine, _Exported(exported.ptr, 64, stream=marker))       # a peer copy (the driver's record)
    assert calls == [("cuStreamSynchronize", marker, handle_int(created.handle))]   # the exporter's stream
    calls.clear()
    mem.copy(_Exported(mine.ptr, 64, stream=1), np.zeros(64, np.uint8))   # the context the copy runs in: its
    assert calls == []                                                      # legacy stream orders the call itself
    _routed(fk)
    exported.close()
    mine.close()


def test_a_dlpack_consumer_on_its_default_stream_waits_for_the_producers_in_another_context(fk, pc, created,
                                                                                        monkeypatch):
    """``__dlpack__(stream=1)``: the consumer's legacy stream, in the consumer's (current) context.  The producer's
    marker 1 is its own context's legacy stream: the same number, another stream -- so an event is recorded there
    (its context current) and waited for on the consumer's (it was skipped as 'the same stream')."""
    from cuproc import _dlpack
    buf = DeviceBuffer(64, context=created)
    mem.memset(buf, 4, stream=cuproc.ffi.cast("CUstream", 0))    # pending on the created context's default stream
    assert buf.last_stream is None
    calls = _spy_current(monkeypatch, "cuEventRecord", "cuStreamWaitEvent")
    _dlpack.consume(buf.__dlpack__(stream=1)).release()
    names = [(name, ctx) for name, _, ctx in calls]
    assert names == [("cuEventRecord", handle_int(created.handle)), ("cuStreamWaitEvent", handle_int(pc.context.handle))]
    calls.clear()
    with created:                                  # consumer and producer in one context: the same stream
        _dlpack.consume(buf.__dlpack__(stream=1)).release()
    assert calls == []
    buf.close()


def test_a_peer_copys_source_is_waited_for_on_its_own_contexts_default_stream(fk, pc, created, monkeypatch):
    """A source whose last work went to the default stream (last_stream None) names *its* context's default
    stream; a peer copy on a stream of the destination's context recorded the event on the destination's."""
    src = DeviceBuffer(256, context=created)
    mem.memset(src, 6, stream=cuproc.ffi.cast("CUstream", 0))    # on the created context's default stream
    dst = DeviceBuffer(256)
    s = Stream()                                   # the primary context's
    calls = _spy_current(monkeypatch, "cuEventRecord")
    mem.copy(dst, src, stream=s)
    assert [(name, ctx) for name, _, ctx in calls] == [("cuEventRecord", handle_int(created.handle))]
    s.synchronize()
    back = np.zeros(256, np.uint8)
    mem.copy(back, dst)
    assert (back == 6).all()
    _routed(fk)
    for x in (src, dst, s):
        x.close()


def test_a_synchronous_peer_copy_is_ordered_before_the_sources_later_free(fk, pc, created):
    """cuMemcpyPeer is serialized with all pending and future asynchronous work of the current, the source and the
    destination contexts (the driver API's documentation; the fake models it): the source's last_stream, None,
    names its own context's default stream, and a stream-ordered free of the source there needs no wait."""
    src = mem.alloc_async(256, context=created)
    mem.memset(src, 2)
    dst = DeviceBuffer(256)
    mem.copy(dst, src)
    src.free_async()
    assert fk.unordered_frees() == 0, fk.unordered_calls()
    back = np.zeros(256, np.uint8)
    mem.copy(back, dst)
    assert (back == 2).all()
    _routed(fk)
    dst.close()


def test_a_device_copy_with_a_raw_side_of_another_context_is_a_peer_copy(fk, pc, created):
    """A raw address (or CAI) of another context's memory: cuMemcpyDtoD would run in the cuproc side's context,
    unordered with the other's work (the fake counts it as misrouted); the driver's record makes it a peer copy."""
    far = DeviceBuffer(128, context=created)
    near = DeviceBuffer(128)
    mem.memset(far, 9)
    fk.clear_calls()
    mem.copy(near, far.ptr, 128)
    assert "cuMemcpyPeer" in fk.calls()
    mem.copy(far.ptr, near, 128, stream=Stream())
    _routed(fk)
    back = np.zeros(128, np.uint8)
    mem.copy(back, near)
    assert (back == 9).all()
    far.close()
    near.close()


def test_the_fake_counts_a_dtod_between_two_contexts_as_misrouted(fk, pc, created):
    """The model behind the test above: the real driver copies between two contexts' buffers with cuMemcpyDtoD,
    on the current context's default stream only."""
    far = DeviceBuffer(64, context=created)
    near = DeviceBuffer(64)
    drv = cuproc.driver.default_driver()
    assert drv.cuMemcpyDtoD(near.ptr, far.ptr, 64) == 0
    assert fk.misrouted_count() == 1 and fk.misrouted_calls() == ["cuMemcpyDtoD"]
    fk.clear_misrouted()
    far.close()
    near.close()


def test_a_failed_push_before_a_default_stream_free_leaves_the_buffer_live(fk, pc, created):
    """free_async on a default stream pushes the buffer's context; when the push fails, cuMemFreeAsync never ran:
    the claim is given back (it was kept, and the memory was lost) and a later free frees it."""
    buf = mem.alloc_async(256, context=created)
    assert fk.live("async_alloc") == 1
    fk.fail("cuCtxPushCurrent", cuproc.driver.CUDA_ERROR_INVALID_CONTEXT, 1)
    with pytest.raises(cuproc.CudaError) as info:
        buf.free_async()                           # on the stream it came from: the context's default stream
    assert info.value.call == "cuCtxPushCurrent" and buf.ended is None
    buf.free_async()
    assert buf.ended == "freed" and fk.live("async_alloc") == 0
    _routed(fk)


# ----------------------------------------------------------------------------- the second review (2026-11-29)

def test_a_dlpack_import_on_the_default_stream_is_read_after_the_producer_in_the_importing_context(
        fk, pc, created, monkeypatch):
    """from_dlpack with the primary context current asks the producer to order its work before *that* context's
    legacy stream; the array's marker 1 names it.  A later synchronous copy runs in the memory's context (the
    created one): the importing context's default stream must then be waited for (it returned early, and the
    copy could read before the producer's work on another context's non-blocking stream was done)."""
    from cuproc.interop import from_dlpack
    s = Stream(context=created, non_blocking=True)
    buf = mem.alloc_async(256, stream=s)
    mem.memset(buf, 7, stream=s)
    arr = from_dlpack(buf)                          # marker 1, the primary context current
    assert arr.stream == 1 and arr.stream_context is pc.context
    calls = _spy_current(monkeypatch, "cuStreamSynchronize")
    host = np.zeros(256, np.uint8)
    mem.copy(host, arr)
    assert calls == [("cuStreamSynchronize", 1, handle_int(pc.context.handle))]
    assert (host == 7).all()
    arr.close()
    buf.free_async()
    s.synchronize()
    s.close()


@pytest.mark.parametrize("how", ["raw", "cai", "copy_2d"])
def test_a_raw_device_side_binds_before_a_host_side_of_another_context(fk, pc, created, how):
    """Device memory of the created context, pinned memory of the primary one (current): the copy runs in the
    device memory's context, whose work it must follow (the host side's context won, and it ran misrouted)."""
    a = DeviceBuffer(256, context=created)
    pinned = mem.PinnedBuffer(256)
    mem.memset(a, 3)
    if how == "raw":
        mem.copy(pinned, a.address, 256)
        mem.copy(a.address, pinned, 256)
    elif how == "cai":
        mem.copy(pinned, _Exported(a.address, 256))
    else:
        mem.copy_2d(pinned, 16, a.address, 16, 16, 16)
    _routed(fk)
    assert (pinned.numpy(np.uint8) == 3).all()
    a.close()
    pinned.close()


def test_a_raw_address_of_another_contexts_pinned_memory_is_no_peer(fk, pc, created):
    """A raw int names device memory by default; one that is pinned host memory of another context is copied as
    is (cuMemcpyDtoD of UVA addresses), not with cuMemcpyPeer, which is for device memory."""
    pinned = mem.PinnedBuffer(64, context=created)
    pinned.numpy(np.uint8)[:] = 5
    near = DeviceBuffer(64)
    fk.clear_calls()
    mem.copy(near, pinned.address, 64)
    assert "cuMemcpyPeer" not in fk.calls()
    back = np.zeros(64, np.uint8)
    mem.copy(back, near)
    assert (back == 5).all()
    near.close()
    pinned.close()


def test_an_interrupt_after_the_free_keeps_the_claim(fk, pc, created, monkeypatch):
    """Only a failed push gives a free_async claim back.  An exception raised after cuMemFreeAsync ran (here a
    KeyboardInterrupt from the pop) keeps it: the memory is the pool's again, and a live object over it would free
    someone else's allocation at that address later."""
    import cuproc.context as context_module
    buf = mem.alloc_async(256, context=created)

    def interrupted(drv):
        drv.cuCtxPopCurrent(cuproc.ffi.new("CUcontext *"))   # the pop itself, then the signal's exception
        raise KeyboardInterrupt
    monkeypatch.setattr(context_module, "pop_pushed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        buf.free_async()
    monkeypatch.undo()
    assert buf.ended == "freed" and fk.live("async_alloc") == 0
    buf.free_async()                                 # idempotent: nothing reaches the driver
    assert fk.stale_count() == 0


def test_a_failed_push_in_close_keeps_the_memory_for_the_teardown(fk, pc, created):
    """close() of stream-ordered memory on its context's default stream pushes that context; a failed push raised
    and the entry was gone, so nothing ever freed the memory.  The entry goes back: the context's teardown frees it."""
    buf = mem.alloc_async(256, context=created)
    fk.fail("cuCtxPushCurrent", cuproc.driver.CUDA_ERROR_INVALID_CONTEXT, 1)
    with pytest.raises(cuproc.CudaError) as info:
        buf.close()
    assert info.value.call == "cuCtxPushCurrent" and fk.live("async_alloc") == 1
    created.destroy()                                # the teardown frees what its table still holds
    assert fk.live("async_alloc") == 0


def test_a_raw_stream_of_another_context_than_context_is_refused(fk, pc, created):
    """alloc_async(stream=<raw stream of the created context>, context=<the primary one>): the memory would be
    the stream's context's while cuproc recorded the other -- refused before the driver."""
    s = Stream(context=created)
    raw = int(cuproc.ffi.cast("uintptr_t", s.handle))
    fk.clear_calls()
    with pytest.raises(InvalidValueError) as info:
        mem.alloc_async(64, stream=raw, context=pc.context)
    assert info.value.call == "cuMemAllocAsync" and "cuMemAllocAsync" not in fk.calls()
    buf = mem.alloc_async(64, stream=raw, context=created)
    assert buf.context is created
    buf.free_async()
    s.synchronize()
    s.close()
