"""How the real driver routes a call made while another context is current, and cuproc's binding of each kind.

The fake driver (tests/fakedriver.c) models what these tests measure: calls that name a stream, event or
module of context A run in A whichever context is current; a synchronous copy or memset of A's memory, or
anything on the default stream, runs in the *current* context; a launch of A's function or a record of A's
event on the default stream is refused with CUDA_ERROR_INVALID_HANDLE.  The raw calls are made with C names
(no cuproc object in the way); NumPy is the reference for data.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import Context, DeviceBuffer, Module, Stream
from cuproc import memory as mem

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
FATBIN = (ROOT / "kernels" / "kernels.fatbin").read_bytes()
ffi = cuproc.ffi
INVALID_HANDLE = cuproc.driver.CUDA_ERROR_INVALID_HANDLE


def test_what_the_driver_carries_out_in_another_context(primary):
    drv = cuproc.driver.default_driver()
    a = Context.create(0)                       # current now
    mod = Module.load(FATBIN, context=a)
    fn = mod.get_function("empty")
    s = Stream(context=a, non_blocking=True)
    ev = cuproc.Event(context=a, timing=False)
    buf = DeviceBuffer(4096, context=a)
    Context.pop()
    b = Context.create(0)                       # another context current
    try:
        p, n, x = ffi.new("unsigned long long *", buf.ptr), ffi.new("int *", 0), ffi.new("float *", 0)
        params = ffi.new("void *[3]", [p, n, x])
        launch = drv.cuLaunchKernel
        # refused on a default stream (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) -- the current context's --
        # and on a stream of another context: the handle is not that stream's context's
        own = Stream(non_blocking=True)             # a stream of b
        for default in (0, 1, 2):
            h = ffi.cast("CUstream", default)
            assert launch(fn.handle, 1, 1, 1, 32, 1, 1, 0, h, params, ffi.NULL) == INVALID_HANDLE
            assert drv.cuEventRecord(ev.handle, h) == INVALID_HANDLE
        assert launch(fn.handle, 1, 1, 1, 32, 1, 1, 0, own.handle, params, ffi.NULL) == INVALID_HANDLE
        assert drv.cuEventRecord(ev.handle, own.handle) == INVALID_HANDLE
        own.close()
        # carried out: a named stream of A, and A's memory by a synchronous memset (on B's default stream)
        assert launch(fn.handle, 1, 1, 1, 32, 1, 1, 0, s.handle, params, ffi.NULL) == 0
        assert drv.cuMemsetD8(buf.ptr, 9, 4096) == 0
        assert drv.cuStreamSynchronize(s.handle) == 0
        b.synchronize()
        back = np.zeros(4096, np.uint8)
        mem.copy(back, buf)
        assert (back == 9).all()
    finally:
        b.destroy()
        buf.close()
        s.close()
        ev.close()
        mod.close()
        a.destroy()


def test_a_memset_of_a_created_contexts_buffer_then_its_end_leaves_the_primary_context_usable(primary):
    """The GPU random sequences' stop (seed 11000063, CUDA_ERROR_LAUNCH_FAILED at the next synchronize of
    the primary context): a created context's buffer memset with the primary context current, then the
    buffer freed and the context destroyed."""
    for _ in range(20):
        ctx = Context.create(0)
        Context.pop()
        buf = DeviceBuffer(1 << 20, context=ctx)
        mem.memset(buf, 7)
        assert Context.current() is primary.context
        back = np.zeros(1 << 20, np.uint8)
        mem.copy(back, buf)
        assert (back == 7).all()
        mem.memset(buf, 5)
        del buf
        ctx.destroy()
        primary.context.synchronize()           # raised CUDA_ERROR_LAUNCH_FAILED when the memset ran here
