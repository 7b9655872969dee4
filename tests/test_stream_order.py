"""A stream-ordered free waits for the work cuproc last queued on the memory on another stream.

Measured on an H200 (driver 580, 2026-11-29): a memset queued on one stream, the buffer freed
stream-ordered on another, a synchronize -- the memset faulted (CUDA_ERROR_ILLEGAL_ADDRESS), and random
sequences on the compiled path met CUDA_ERROR_LAUNCH_FAILED the same way.  The fake driver counts
such a free (``unordered_frees``); the ``fk`` fixture asserts it stays 0, and each test here also says
what ordered the free.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import cuproc
from cuproc import Context, Stream
from cuproc import memory as mem
from cuproc.errors import CudaWarning

ORDER = ["cuEventRecord", "cuStreamWaitEvent", "cuEventDestroy", "cuMemFreeAsync"]


def test_free_async_after_a_memset_on_another_stream_waits_for_it(fk, pc):
    own, other = Stream(non_blocking=True), Stream(non_blocking=True)
    buf = mem.alloc_async(256, own)
    mem.memset(buf, 7, stream=other)
    fk.clear_calls()
    buf.free_async()
    assert fk.calls()[-4:] == ORDER and fk.unordered_frees() == 0


def test_free_async_after_a_synchronous_memset_waits_for_the_default_stream(fk, pc):
    """cuMemsetD8 of device memory returns before it is done (the legacy stream runs it)."""
    own = Stream(non_blocking=True)
    buf = mem.alloc_async(256, own)
    mem.memset(buf, 7)
    buf.free_async()
    assert fk.unordered_frees() == 0


@pytest.mark.parametrize("how", ["drop", "close", "context teardown"])
def test_every_way_of_freeing_waits_for_the_last_stream(fk, pc, how):
    own, other = Stream(non_blocking=True), Stream(non_blocking=True)
    buf = mem.alloc_async(256, own)
    mem.copy(buf, np.zeros(256, np.uint8), stream=other)
    if how == "drop":
        del buf
        gc.collect()
    elif how == "close":
        buf.close()
    else:
        pc.release()              # the last retain: the teardown frees it
        assert buf.freed
    assert fk.unordered_frees() == 0 and fk.pool_used(0) == 0


def test_the_event_is_recorded_in_the_last_streams_own_context(fk, pc):
    """A copy on a stream of another context (a peer copy) leaves that stream as last_stream: the event
    must be made and recorded there, the wait made here (one context could not record on the other's)."""
    a = mem.alloc_async(256, Stream(non_blocking=True))
    ctx = Context.create(0)
    theirs = Stream(non_blocking=True)
    Context.pop()
    b = mem.DeviceBuffer(256, context=ctx)
    mem.copy(b, a, stream=theirs)
    assert a.last_stream is theirs
    a.free_async()
    assert a.freed and fk.unordered_frees() == 0 and fk.pool_used(0) == 0
    b.free()
    theirs.close()
    ctx.destroy()


def test_a_failed_ordering_after_the_claim_still_frees_the_memory(fk, pc):
    """close() takes the claim first; if the event cannot be made, the context is synchronized instead
    (said in a warning) and the memory still goes back to its pool -- never left behind for good."""
    own, other = Stream(non_blocking=True), Stream(non_blocking=True)
    buf = mem.alloc_async(256, own)
    mem.memset(buf, 7, stream=other)
    fk.fail("cuEventCreate", 2)           # CUDA_ERROR_OUT_OF_MEMORY
    with pytest.warns(CudaWarning, match="cuEventCreate"):
        buf.close()
    assert buf.freed and fk.pool_used(0) == 0 and fk.unordered_frees() == 0
    assert fk.live("async_alloc") == 0


def test_a_failed_ordering_in_free_async_refuses_before_the_claim(fk, pc):
    own, other = Stream(non_blocking=True), Stream(non_blocking=True)
    buf = mem.alloc_async(256, own)
    mem.memset(buf, 7, stream=other)
    fk.fail("cuEventCreate", 2)
    with pytest.raises(cuproc.CudaError) as info:
        buf.free_async()
    assert info.value.call == "cuEventCreate" and buf.ended is None   # nothing taken: it can be freed again
    buf.free_async()
    assert buf.freed and fk.unordered_frees() == 0


def test_work_on_a_per_thread_default_stream_is_waited_for_by_the_context(fk, pc):
    """Which per-thread stream a handle 2 names depends on the thread that queued the work: not known at
    the free, so the context is synchronized."""
    own = Stream(non_blocking=True)
    buf = mem.alloc_async(256, own)
    buf.last_stream = 2                   # (as after work queued on CU_STREAM_PER_THREAD)
    fk.clear_calls()
    buf.free_async()
    assert "cuCtxSynchronize" in fk.calls() and buf.freed


def test_the_hot_path_makes_no_extra_call(fk, pc):
    s = Stream()
    for free in (lambda b: b.free_async(), lambda b: b.free_async(s), lambda b: b.close()):
        buf = mem.alloc_async(256, s)
        mem.memset(buf, 1, stream=s)
        fk.clear_calls()
        free(buf)
        assert fk.calls() == ["cuMemFreeAsync"]
