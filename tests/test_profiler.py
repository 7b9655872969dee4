"""cuproc.profiler on the stateful fake driver: the calls reach the driver, in the right context."""
import pytest

import cuproc
from cuproc import profiler


def test_start_stop_reach_the_driver(pc, fk):
    assert not fk.profiling()
    profiler.start()
    assert fk.profiling()
    profiler.stop()
    assert not fk.profiling()


def test_range_starts_and_stops(pc, fk):
    with profiler.range() as ctx:
        assert fk.profiling()
        assert ctx.handle == cuproc.Context.current().handle
    assert not fk.profiling()


def test_range_stops_when_the_body_raises(pc, fk):
    with pytest.raises(KeyError):
        with profiler.range():
            raise KeyError("body")
    assert not fk.profiling()


def test_explicit_context_is_made_current_for_the_call(pc, fk):
    ctx = cuproc.Context.current()
    drv = cuproc.driver.default_driver()
    drv.checked.cuCtxSetCurrent(cuproc.ffi.NULL)     # nothing current on this thread
    profiler.start(ctx)
    assert fk.profiling()
    profiler.stop(ctx)
    assert not fk.profiling()
    out = cuproc.ffi.new("CUcontext *")
    drv.checked.cuCtxGetCurrent(out)
    assert out[0] == cuproc.ffi.NULL                  # the thread's stack is as it was


def test_no_current_context_is_refused_before_the_driver(pc, fk):
    cuproc.driver.default_driver().checked.cuCtxSetCurrent(cuproc.ffi.NULL)
    with pytest.raises(cuproc.InvalidContextError, match="cuProfilerStart"):
        profiler.start()
    with pytest.raises(cuproc.InvalidContextError, match="cuProfilerStop"):
        profiler.stop()
    assert not fk.profiling()


def test_star_import_does_not_shadow_builtin_range():
    namespace: dict = {}
    exec("from cuproc.profiler import *", namespace)
    assert "range" not in namespace and {"start", "stop"} <= set(namespace)
    assert callable(profiler.range)
