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
    pinned.numpy(np.float32)[:] = src
    fk.clear_calls()
    if direction == "htod":
        copy(buf, pinned)
    else:
        mem.copy(buf, src)
        copy(pinned, buf)
    _routed(fk)
    back = np.zeros_like(src)
    mem.copy(back, buf)
    assert np.array_equal(back, src) and np.array_equal(pinned.numpy(np.float32), src)
    # the context was pushed for the call and popped: the primary one is current again
    assert Context.current() is pc.context
    buf.close()


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
        with pytest.raises(InvalidValueError, match="default stream of whichever context is current"):
            Stream.from_handle(value, context=pc.context)
