"""The resource model, on the stateful fake driver (CI has no GPU).

The fake validates every handle and address it is given and counts each one
that is stale -- what would have been a crash on a real driver.  Every test
here ends with that count at zero (the ``fk`` fixture checks), besides what it
asserts itself.  The fake's counters (live objects, primary reference counts,
pool bytes, launches) are its own bookkeeping, independent of cuproc's.
"""
from __future__ import annotations

import gc
import json
import os
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import cuproc
from subproc import run_python
from threads import in_thread, run_threads
from cuproc import Context, Device, DeviceBuffer, Event, Library, Module, PrimaryContext, Stream
from cuproc import memory as mem
from cuproc.errors import ClosedResourceError, CudaError, CudaWarning, InvalidValueError

from fakedriver import fake_image

ROOT = Path(__file__).resolve().parent.parent
SIG = ["float*", "int", "float"]
IMAGE = fake_image({"empty": [8, 4, 4], "fake_pair": [8, 8]}, {"counter": 4})
ffi = cuproc.ffi


def round_trip(buf, n=64):
    src = np.arange(n, dtype=np.float32)
    back = np.zeros_like(src)
    mem.copy(buf, src)
    mem.copy(back, buf)
    np.testing.assert_array_equal(back, src)


# ----------------------------------------------------------------------------- strong ownership

def test_a_buffer_holds_its_context(fk):
    ctx = Context.create(0)
    Context.pop()
    buf = DeviceBuffer(256, context=ctx)
    del ctx
    gc.collect()
    assert fk.live("context") == 1              # the buffer keeps its context
    round_trip(buf)
    del buf
    gc.collect()
    assert fk.live("context") == 0 and fk.live("device_alloc") == 0   # buffer first, then its context


def test_streams_and_events_hold_their_context(fk):
    ctx = Context.create(0)
    Context.pop()
    s, e = Stream(context=ctx), Event(context=ctx)
    del ctx
    gc.collect()
    e.record(s)
    s.synchronize()
    assert fk.live("context") == 1
    del s, e
    gc.collect()
    assert fk.live("context") == fk.live("stream") == fk.live("event") == 0


def test_a_function_holds_its_module_and_a_prepared_launch_its_function_and_stream(fk, pc):
    m = Module.load(IMAGE)
    fn = m.get_function("empty")
    s = Stream()
    run = fn.prepare(SIG, 1, 32, stream=s)
    buf = DeviceBuffer(256)
    del m, fn, s
    gc.collect()
    assert fk.live("module") == 1 and fk.live("stream") == 1
    run(buf, 64, 1.0)
    del run
    gc.collect()
    assert fk.live("module") == 0 and fk.live("stream") == 0



@pytest.mark.parametrize("kind", ["pinned", "managed"])
def test_a_host_view_holds_its_allocation(fk, pc, kind):
    make = mem.PinnedBuffer if kind == "pinned" else mem.ManagedBuffer
    a = make(4096).numpy(np.float32)         # the allocation object is dropped at once
    gc.collect()
    a[:] = 1.0                                # segfaulted before: the memory was freed under the view
    assert a.sum() == 1024
    live = "host_alloc" if kind == "pinned" else "managed_alloc"
    assert fk.live(live) == 1
    raw = a.base
    del a, raw
    gc.collect()
    assert fk.live(live) == 0


def test_host_memory_with_views_refuses_to_go(fk):
    ctx = Context.create(0)
    p = mem.PinnedBuffer(1024)
    view = p.numpy()
    with pytest.raises(BufferError, match="views"):
        p.free()
    Context.pop()
    with pytest.raises(BufferError, match="views"):
        ctx.destroy()
    view[:] = 7                               # still valid memory
    del view
    gc.collect()
    ctx.destroy()                             # no views left: destroyed, and the pinned memory with it
    assert p.closed and fk.live("host_alloc") == 0


# ----------------------------------------------------------------------------- explicit destruction

def test_destroying_a_context_invalidates_everything_made_in_it(fk):
    ctx = Context.create(0)
    buf, s, e = DeviceBuffer(256), Stream(), Event()
    m = Module.load(IMAGE)
    fn = m.get_function("empty")
    run = fn.prepare(SIG, 1, 32, stream=s)
    pinned = mem.PinnedBuffer(256)
    Context.pop()
    ctx.destroy()
    host = np.zeros(64, np.float32)
    attempts = {
        "copy": lambda: mem.copy(host, buf), "memset": lambda: mem.memset(buf, 0),
        "free_async": lambda: buf.free_async(), "sync": s.synchronize, "query": s.query,
        "record": lambda: e.record(), "get_function": lambda: m.get_function("empty"),
        "attribute": lambda: fn.num_registers, "launch": lambda: fn.launch(1, 1, (buf, np.int32(1), np.float32(1))),
        "prepared": lambda: run(0, 1, 1.0), "pinned": lambda: pinned.numpy(),
        "stream_on_dead": lambda: Stream(context=ctx), "alloc_in_dead": lambda: DeviceBuffer(64, context=ctx),
    }
    for name, attempt in attempts.items():
        with pytest.raises(ClosedResourceError, match="destroyed") as info:
            attempt()
        assert info.value.refused, name
        assert info.value.call != "cuMemFree", name          # the call named is the one attempted
    assert fk.live("context") == 0
    for obj in (buf, s, e, m, pinned, ctx):
        obj.close()                                # idempotent, and nothing left to free
    assert fk.stale_count() == 0


def test_launch_after_destroy_names_the_context_not_a_parameter_count(fk):
    ctx = Context.create(0)
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    Context.pop()
    ctx.destroy()
    with pytest.raises(ClosedResourceError) as info:
        fn.launch(1, 1, (buf, np.int32(1), np.float32(1)))
    assert "parameters" not in str(info.value) and "context" in str(info.value)


def test_unloading_a_module_invalidates_its_functions_and_launches(pc):
    m = Module.load(IMAGE)
    fn = m.get_function("empty")
    g = m.get_global("counter")
    run = fn.prepare(SIG, 1, 32)
    buf = DeviceBuffer(256)
    run(buf, 1, 1.0)
    m.unload()
    m.unload()                                    # idempotent
    for attempt in (lambda: run(buf, 1, 1.0), lambda: fn.launch(1, 1, (buf, np.int32(1), np.float32(1))),
                    lambda: fn.num_registers, lambda: mem.copy(np.zeros(1, np.int32), g)):
        with pytest.raises(ClosedResourceError, match="unloaded"):
            attempt()


def test_reset_invalidates_buffers_and_an_old_buffer_never_frees_a_new_one(pc):
    old = DeviceBuffer(256)
    stream = Stream()
    pc.reset()
    with pytest.raises(ClosedResourceError, match="reset"):
        round_trip(old)
    with pytest.raises(ClosedResourceError):
        stream.synchronize()
    new = DeviceBuffer(256)                       # the primary context lives on (still retained)
    del old, stream
    gc.collect()                                  # the old buffer's finalizer frees nothing
    round_trip(new)
    assert pc.retain_count == 1


def test_releasing_the_last_retain_ends_the_context_for_its_dependents(fk):
    pc = cuproc.use_device(0)
    buf = DeviceBuffer(256)
    pc.release()
    assert not fk.primary_active(0)
    with pytest.raises(ClosedResourceError, match="released"):
        round_trip(buf)
    del buf
    gc.collect()


def test_close_is_idempotent_everywhere(pc):
    m = Module.load(IMAGE)
    objs = [DeviceBuffer(64), mem.alloc_async(64), mem.PinnedBuffer(64), mem.ManagedBuffer(64), Stream(), Event(),
            m, m.get_function("empty"), mem.MemoryPool.create(0), Library(IMAGE),
            mem.RegisteredHostMemory(np.zeros(64, np.uint8))]
    for obj in objs:
        obj.close()
        obj.close()
        assert obj.closed


def test_threads_racing_to_close_one_buffer_free_it_once(fk, pc):
    """Resource._give_back claims before it releases: of two threads closing one buffer at once, one
    frees it and the other returns (release first, then claim, freed it twice ~100 times in 500 rounds
    here: the second cuMemFree reaches the fake as a stale pointer)."""
    import sys
    before, interval = fk.live("device_alloc"), sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(500):
            buf = DeviceBuffer(64)
            barrier = threading.Barrier(2)

            def close(_: int, buf: DeviceBuffer = buf, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                buf.close()

            run_threads(close, 2)
            assert buf.closed
    finally:
        sys.setswitchinterval(interval)
    assert fk.stale_count() == 0, fk.stale_calls()
    assert fk.live("device_alloc") == before


# ----------------------------------------------------------------------------- context binding

def test_a_new_thread_needs_no_setup(fk, pc):
    buf = DeviceBuffer(256)
    s = Stream()
    fn = Module.load(IMAGE).get_function("empty")
    run = fn.prepare(SIG, 1, 32, stream=s)
    before = fk.binding_errors()

    def work():
        assert Context.current() is None
        round_trip(buf)
        mem.memset(buf, 1)
        mem.memset(buf, 2, stream=s)
        run(buf, 64, 1.0)
        fn.launch(1, 32, (buf, np.int32(64), np.float32(1)))
        s.synchronize()
        mem.copy(buf, np.ones(64, np.float32), stream=s)
        assert Context.current() is None          # the thread's stack is as it was
        b2 = mem.alloc_async(64, s)
        b2.free_async()
        buf.free()

    box = in_thread(work)
    assert "error" not in box, box.get("error")
    assert fk.binding_errors() > before                 # the fake did refuse the unbound calls: the rebinding ran



def test_another_context_current_is_left_current(fk):
    a = Context.create(0)
    buf = DeviceBuffer(256)
    Context.pop()
    b = Context.create(0)                          # b is current now
    round_trip(buf)                                 # runs in a
    assert Context.current() is b and buf.context is a
    Context.pop()
    del buf
    gc.collect()


# ----------------------------------------------------------------------------- threads

def test_concurrent_launches_never_mix_arguments(fk, pc):
    fn = Module.load(IMAGE).get_function("fake_pair")
    run = fn.prepare(["long long", "long long"], 1, 1)
    start = fk.launch_count()

    def worker(tid):
        for i in range(1500):
            a = tid * 1_000_000 + i
            if i % 3:
                run(a, 3 * a + 1)
            else:
                fn.launch(1, 1, (np.int64(a), np.int64(3 * a + 1)))

    run_threads(worker, 8)
    assert fk.launch_count() - start == 8 * 1500
    assert fk.launch_mismatches() == 0



def test_concurrent_first_use_is_safe(fk):
    drv = cuproc.Driver(library=str(fk.path))
    barrier = threading.Barrier(8)

    def first_use(_):
        barrier.wait()
        pc = PrimaryContext(0, driver=drv)
        pc.retain()
        ctx = pc.context
        return pc, ctx, DeviceBuffer(64, context=ctx)

    results = run_threads(first_use, 8)
    assert len({id(pc) for pc, _, _ in results}) == 1          # one PrimaryContext per device
    assert len({id(ctx) for _, ctx, _ in results}) == 1         # one Context object per handle
    assert fk.primary_refcount(0) == 8
    for _, _, buf in results:
        round_trip(buf, 16)
    pc = results[0][0]
    for _ in range(8):
        pc.release()
    results.clear()
    gc.collect()
    assert not fk.primary_active(0)


# ----------------------------------------------------------------------------- primary contexts

def test_retains_exactly_what_the_user_asked_for(fk):
    pc = cuproc.use_device(0)
    assert fk.primary_refcount(0) == 1
    m = Module.load(IMAGE)
    bufs = [DeviceBuffer(64) for _ in range(3)]
    s = Stream()
    assert fk.primary_refcount(0) == 1                      # using the context takes no retains
    Context.current()
    assert fk.primary_refcount(0) == 1
    del m, bufs, s
    gc.collect()
    cuproc.driver.default_driver().cuCtxSetCurrent(ffi.NULL)
    pc.release()
    gc.collect()
    assert not fk.primary_active(0) and fk.primary_refcount(0) == 0


def test_classifying_a_foreign_context_retains_nothing(fk):
    drv = cuproc.driver.default_driver()
    drv.checked.cuInit(0)
    out = ffi.new("CUcontext *")
    drv.checked.cuDevicePrimaryCtxRetain(out, 0)       # another library's retain
    drv.checked.cuCtxSetCurrent(out[0])
    ctx = Context.current()
    assert ctx.kind == "adopted" and fk.primary_refcount(0) == 1
    buf = DeviceBuffer(256)
    round_trip(buf)
    del buf, ctx
    gc.collect()
    assert fk.primary_refcount(0) == 1                   # nothing retained or released by cuproc
    drv.checked.cuCtxSetCurrent(ffi.NULL)
    drv.checked.cuDevicePrimaryCtxRelease(0)
    assert not fk.primary_active(0)


def test_a_dropped_primary_context_gives_back_its_retains(fk):
    pc = PrimaryContext(0)
    pc.retain().retain()
    assert fk.primary_refcount(0) == 2
    del pc
    gc.collect()
    assert fk.primary_refcount(0) == 0


def test_dependents_keep_the_retains_until_they_go(fk):
    pc = cuproc.use_device(0)
    buf = DeviceBuffer(256)
    cuproc.driver.default_driver().cuCtxSetCurrent(ffi.NULL)
    del pc
    gc.collect()
    assert fk.primary_refcount(0) == 1               # the buffer holds the context, which holds the retain
    round_trip(buf)
    del buf
    gc.collect()
    assert fk.primary_refcount(0) == 0 and not fk.primary_active(0)


# ----------------------------------------------------------------------------- frees

def test_dropped_stream_ordered_buffers_come_back(fk, pc):
    s = Stream()
    bufs = [mem.alloc_async(1024, s) for _ in range(4)] + [mem.alloc_async(1024)]
    assert fk.pool_used(0) == 5 * 1024
    del bufs
    gc.collect()
    assert fk.pool_used(0) == 0
    b = mem.alloc_async(1024, s)
    s.close()                                        # its stream is gone: freed synchronously instead
    del b
    gc.collect()
    assert fk.pool_used(0) == 0



def test_a_failing_finalizer_warns_once_and_never_raises(fk, pc):
    buf = DeviceBuffer(64)
    fk.fail("cuMemFree", 700, 1)
    with pytest.warns(CudaWarning, match="cuMemFree") as record:
        del buf
        gc.collect()
    assert len([w for w in record if issubclass(w.category, CudaWarning)]) == 1
    fk.fail("cuMemFree", 0, 0)


def test_an_explicit_free_that_fails_raises_once(fk, pc):
    buf = DeviceBuffer(64)
    fk.fail("cuMemFree", 700, 1)
    with pytest.raises(CudaError) as info:
        buf.free()
    assert info.value.call == "cuMemFree" and not info.value.refused
    buf.free()                                          # never freed twice
    fk.fail("cuMemFree", 0, 0)


SHUTDOWN = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
import cuproc
from cuproc import memory as mem
from fakedriver import fake_image
cuproc.set_default_driver(cuproc.Driver(library={lib!r}))
pc = cuproc.use_device(0)
m = cuproc.Module.load(fake_image({{"empty": [8, 4, 4]}}))
fn = m.get_function("empty")
s = cuproc.Stream()
run = fn.prepare(["float*", "int", "float"], 1, 32, stream=s)
bufs = [cuproc.DeviceBuffer(64), mem.alloc_async(64, s), mem.PinnedBuffer(64)]
view = bufs[2].numpy()
ctx = cuproc.Context.create(0)
other = [cuproc.DeviceBuffer(64), cuproc.Stream()]
cuproc.Context.pop()
run(bufs[0], 1, 1.0)
"""


@pytest.mark.parametrize("ending, left_live", [
    ("", {"primary": 1}),                                                  # the retain goes with the process
    ("import atexit\n@atexit.register\ndef bye():\n    del globals()['view']\n    pc.release()", {}),  # atexit
    ("del pc, m, fn, s, run, bufs, view; import gc; gc.collect()", {}),  # dropped before the exit
])
def test_interpreter_exit_releases_children_first_and_silently(fk, tmp_path, ending, left_live):
    """Everything made in a context is released at exit, children before parents (no stale handle),
    and a created context is destroyed; the primary context's retains still held while the
    interpreter finalizes are left to the process exit (the driver would destroy the context while
    the process waits), unless released explicitly, as an atexit handler may."""
    report = tmp_path / "report.json"
    env = dict(os.environ, FAKE_REPORT=str(report))
    code = SHUTDOWN.format(tests=str(ROOT / "tests"), lib=str(fk.path)) + ending + "\n"
    proc = run_python(code, env=env)
    assert proc.stderr == "", proc.stderr
    left = json.loads(report.read_text())            # written by the fake when the process unloads it
    assert left["stale"] == 0, left
    assert left["live"] == left_live, left


def test_a_dropped_use_device_result_is_named_in_the_error_of_the_next_call(fk):
    """``cuproc.use_device(0)`` as a bare statement drops its PrimaryContext, whose retain goes with
    it, and the driver destroys the context that stays current on the thread: the next allocation's
    error says to keep what use_device returns (in a child: the fake records the destroyed context's
    use, which the fixture would count as a stale handle)."""
    code = f"""
import cuproc
cuproc.set_default_driver(cuproc.Driver(library={str(fk.path)!r}))
cuproc.use_device(0)
try:
    cuproc.DeviceBuffer(64)
except cuproc.errors.InvalidContextError as exc:
    print(exc)
"""
    proc = run_python(code)
    assert "CONTEXT_IS_DESTROYED" in proc.stdout and "use_device" in proc.stdout, proc.stdout


# ----------------------------------------------------------------------------- fork

FORK = """
import os, sys, numpy as np
sys.path.insert(0, {tests!r})
import cuproc
from cuproc import memory as mem
from fakedriver import fake_image
drv = cuproc.Driver(library={lib!r})
cuproc.set_default_driver(drv)
pc = cuproc.use_device(0)
buf = cuproc.DeviceBuffer(64)
fn = cuproc.Module.load(fake_image({{"empty": [8, 4, 4]}})).get_function("empty")
run = fn.prepare(["float*", "int", "float"], 1, 32)
checked = drv.checked.cuCtxGetCurrent
s = cuproc.Stream()
raw = drv.cuCtxGetCurrent
for _ in range(2):                     # warm one-shot entries (the fast path's C front takes them)
    fn.launch(1, 1, (buf, np.int32(1), np.float32(1)))
    fn.launch(1, 1, (buf, 1, 1.0), signature=["float*", "int", "float"])
pid = os.fork()
if pid == 0:
    refused = 0
    for attempt in (lambda: checked(cuproc.ffi.new("CUcontext *")), lambda: run(buf, 1, 1.0), lambda: buf.ptr,
                    lambda: mem.copy(np.zeros(16, np.float32), buf), s.synchronize,
                    lambda: fn.launch(1, 1, (buf, np.int32(1), np.float32(1))),
                    lambda: fn.launch(1, 1, (buf, 1, 1.0), signature=["float*", "int", "float"]),
                    lambda: cuproc.DeviceBuffer(64), lambda: drv.cuMemAlloc, lambda: cuproc.Context.current()):
        try:
            attempt()
        except cuproc.ForkedProcessError:
            refused += 1
    import ctypes
    try:
        buf.ptr
    except cuproc.ForkedProcessError as exc:
        refused -= 0 if exc.refused and "was not called" in str(exc) else 100
    violations = ctypes.CDLL({lib!r}).fake_fork_violations()
    os._exit(0 if refused == 10 and violations == 0 else 20 + refused)
_, status = os.waitpid(pid, 0)
run(buf, 1, 1.0)                       # the parent carries on
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_after_fork_everything_refuses_in_the_child(fk):
    code = FORK.format(tests=str(ROOT / "tests"), lib=str(fk.path))
    proc = run_python(code)
    assert proc.stdout.strip() == "0", proc.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_before_any_cuda_use_keeps_working_and_locks_are_fresh(fk):
    code = textwrap.dedent(f"""
        import os, sys, threading, numpy as np
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        import cuproc
        from cuproc import _fork, memory as mem
        held = _fork.lock()
        held.acquire()                    # held by the parent at fork time
        pid = os.fork()
        if pid == 0:
            ok = held.acquire(timeout=2)
            cuproc.set_default_driver(cuproc.Driver(library={str(fk.path)!r}))
            pc = cuproc.use_device(0)
            b = cuproc.DeviceBuffer(64)
            mem.copy(b, np.ones(16, np.float32))
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """)
    run_python(code)                             # exit 0: the child's lock was fresh and CUDA worked in it


# ----------------------------------------------------------------------------- errors name the call

def test_refusals_say_the_call_was_not_made(pc):
    with pytest.raises(InvalidValueError) as info:
        DeviceBuffer(-1)
    assert info.value.refused and "was not called" in str(info.value) and "failed" not in str(info.value)
    buf = DeviceBuffer(64)
    with pytest.raises(InvalidValueError) as info:
        mem.copy(buf, np.zeros(128, np.uint8), 128)
    assert info.value.refused and info.value.call == "cuMemcpy"
    buf.free()
    with pytest.raises(ClosedResourceError) as info:
        mem.copy(np.zeros(64, np.uint8), buf)
    assert "freed" in str(info.value) and info.value.call == "cuMemcpy"


def test_a_driver_error_still_says_failed(fk, pc):
    fk.fail("cuMemAlloc", 2, 1)
    with pytest.raises(cuproc.OutOfMemoryError) as info:
        DeviceBuffer(64)
    assert not info.value.refused and "cuMemAlloc failed" in str(info.value)


# ----------------------------------------------------------------------------- review findings

def test_close_of_a_context_keeps_the_same_rules_as_destroy(fk):
    ctx = Context.create(0)
    view = mem.PinnedBuffer(64).numpy()
    b = mem.alloc_async(1024, Stream())
    Context.pop()
    with pytest.raises(BufferError):
        ctx.close()
    del view
    gc.collect()
    ctx.close()
    assert b.closed and fk.pool_used(0) == 0 and fk.live("context") == 0


def test_a_primary_context_adopted_before_the_retain_ends_with_the_reset(fk):
    drv = cuproc.driver.default_driver()
    pc = PrimaryContext(0).retain()
    drv.checked.cuCtxSetCurrent(pc.handle)                 # made current by raw code, not by cuproc
    old = DeviceBuffer(64)                                 # its context object was adopted
    assert old.context is pc.context                       # ... and is the primary one: one object per handle
    pinned = mem.PinnedBuffer(64)
    view = pinned.numpy()
    with pytest.raises(BufferError):
        pc.reset()
    del view
    gc.collect()
    pc.reset()
    with pytest.raises(ClosedResourceError, match="reset"):
        round_trip(old)
    del old, pinned
    gc.collect()                                           # nothing stale is freed (the fixture checks)
    drv.checked.cuCtxSetCurrent(ffi.NULL)
    pc.release()


def test_a_foreign_retain_keeps_one_context_object(fk):
    drv = cuproc.driver.default_driver()
    pc = cuproc.use_device(0)
    buf = DeviceBuffer(256)
    out = ffi.new("CUcontext *")
    drv.checked.cuDevicePrimaryCtxRetain(out, 0)           # another library's retain
    pc.release()                                           # cuproc's last: the context lives on
    round_trip(buf)
    pc.retain()
    assert pc.context is buf.context                       # the same object, primary again
    drv.checked.cuDevicePrimaryCtxRelease(0)               # the foreign retain goes
    drv.checked.cuCtxSetCurrent(ffi.NULL)
    pc.release()                                           # now the driver destroys it
    with pytest.raises(ClosedResourceError, match="released"):
        buf.ptr
    del buf
    gc.collect()


def test_dropping_releases_at_once_without_the_garbage_collector(fk):
    gc.collect()
    gc.disable()
    try:
        pc = cuproc.use_device(0)
        m = Module.load(IMAGE)
        fn = m.get_function("empty")
        s = Stream()
        run = fn.prepare(SIG, 1, 32, stream=s)
        buf = DeviceBuffer(256)
        run(buf, 1, 1.0)
        fn.launch(1, 32, (buf, np.int32(1), np.float32(1)), stream=s)
        del run, s
        assert fk.live("stream") == 0                      # the prepared launch released its stream
        del fn, m
        assert fk.live("module") == 0                      # and the one-shot cache did not keep the module
        ctx = Context.create(0)
        Context.pop()
        lib = Library(IMAGE)
        kern = lib.get_kernel("empty")
        s2 = Stream(context=ctx)
        kern.launch(1, 32, (buf, np.int32(1), np.float32(1)), stream=s2)
        del s2, ctx
        assert fk.live("context") == 0                     # a cached kernel launch does not pin the context
        del kern, lib, buf
        cuproc.driver.default_driver().cuCtxSetCurrent(ffi.NULL)
        del pc
        assert fk.primary_refcount(0) == 0                 # an unreleased PrimaryContext dropped: retain back
    finally:
        gc.enable()


def test_a_failing_finalizer_is_visible_by_default(fk, tmp_path):
    code = textwrap.dedent(f"""
        import sys, gc, ctypes
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        import cuproc
        cuproc.set_default_driver(cuproc.Driver(library={str(fk.path)!r}))
        pc = cuproc.use_device(0)
        buf = cuproc.DeviceBuffer(64)
        ctypes.CDLL({str(fk.path)!r}).fake_fail(b"cuMemFree", 700, 1)
        del buf
        gc.collect()
        """)
    proc = run_python(code)
    assert "CudaWarning" in proc.stderr and "cuMemFree" in proc.stderr


@pytest.mark.parametrize("code", [201, 999])   # CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_UNKNOWN
def test_a_failed_push_for_another_context_is_reported_as_the_push(fk, pc, code):
    """Work for a context that is not current pushes it first; when that push fails, the error names
    cuCtxPushCurrent and its own code, not the call it was for, and the thread's stack is untouched."""
    other = Context.create(0)
    pc.context.set_current()
    for work, call in ((lambda: DeviceBuffer(16, context=other), "cuMemAlloc"),
                       (lambda: other.get_limit("STACK_SIZE"), "cuCtxGetLimit")):
        fk.fail("cuCtxPushCurrent", code)
        with pytest.raises(CudaError) as info:
            work()
        assert (info.value.call, info.value.code) == ("cuCtxPushCurrent", code), call
        assert Context.current().handle == pc.context.handle
    with DeviceBuffer(16, context=other) as buf:         # the push works again: so does the work
        assert buf.context is other
    assert Context.current().handle == pc.context.handle
    other.destroy()


def test_a_failed_pop_after_work_in_another_context_is_a_warning_and_the_work_is_kept(fk, pc):
    """Once the pushed call has run, a failed pop warns (naming cuCtxPopCurrent and its code) and the call's
    result stands: what it made is owned (freed once), nothing made runs twice."""
    drv = cuproc.driver.default_driver()
    other = Context.create(0)
    pc.context.set_current()
    made = []
    for make in (lambda: DeviceBuffer(1 << 20, context=other), lambda: Stream(context=other)):
        fk.fail("cuCtxPopCurrent", 999)
        with pytest.warns(CudaWarning) as record:
            made.append(make())
        assert any("cuCtxPopCurrent" in str(w.message) and "999" in str(w.message) for w in record)
        assert Context.current().handle == other.handle     # what the failed pop left on top, as it warned
        drv.checked.cuCtxPopCurrent(cuproc.ffi.new("CUcontext *"))
    assert fk.live("device_alloc") == 1 and fk.live("stream") == 1
    for thing in made:
        thing.close()
    assert fk.live("device_alloc") == 0 and fk.live("stream") == 0
    other.destroy()


def test_a_rebound_launch_whose_pop_fails_is_made_once_and_warns(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    run = fn.prepare(["float*", "int", "float"], 1, 32)
    buf = DeviceBuffer(64)
    run(buf, 1, 1.0)
    before = fk.launch_count()
    drv = cuproc.driver.default_driver()
    drv.cuCtxSetCurrent(cuproc.ffi.NULL)          # no context current: the launch pushes its own
    fk.fail("cuCtxPopCurrent", 999)
    with pytest.warns(CudaWarning, match="cuCtxPopCurrent"):
        run(buf, 3, 1.0)
    assert fk.launch_count() == before + 1
    drv.checked.cuCtxPopCurrent(cuproc.ffi.new("CUcontext *"))
    buf.close()


def test_reset_skips_a_known_context_it_cannot_push_on_a_driver_before_13(fk, monkeypatch):
    """Before 13.0 cuCtxGetDevice reads the current context, so reset's search for the primary context
    among the contexts cuproc knows pushes each: one that cannot be pushed (destroyed by another
    library) is skipped, not the end of the reset."""
    import cuproc.context as cc
    from cuproc import PrimaryContext
    drv = cuproc.driver.default_driver()
    real = drv.cuCtxGetDevice

    def before_13(out, *rest):                      # the pre-13.0 ABI: the current context's device
        current = cuproc.ffi.new("CUcontext *")
        drv.cuCtxGetCurrent(current)
        return real(out, current[0])
    monkeypatch.setattr(cc, "arity", lambda d, name: 1 if name == "cuCtxGetDevice" else cuproc._support.arity(d, name))
    monkeypatch.setattr(drv, "cuCtxGetDevice", before_13, raising=False)
    out = cuproc.ffi.new("CUcontext *")
    assert drv.cuInit(0) == 0 and drv.cuDevicePrimaryCtxRetain(out, 0) == 0   # another library's retain
    adopted = Context.adopt(out[0])
    fk.fail("cuCtxPushCurrent", 201)
    PrimaryContext(cuproc.Device(0)).reset()
    assert "cuDevicePrimaryCtxReset" in fk.calls()
    assert adopted.ended is None                    # not found (its push failed), so not ended by the reset
    assert drv.cuDevicePrimaryCtxRelease(0) == 0


def test_a_dropped_primary_retain_that_fails_to_release_keeps_its_code_when_describing_it_fails(fk, monkeypatch):
    """The finalizer's report names the failed call and its code even when making the driver's error
    raises in turn, and says how many retains were left."""
    drv = cuproc.driver.default_driver()
    pc = cuproc.use_device(0)
    pc.retain()
    drv.cuCtxSetCurrent(cuproc.ffi.NULL)

    def broken(*args, **kw):
        raise RuntimeError("error reporting broke")
    monkeypatch.setattr(drv, "error", broken)
    fk.fail("cuDevicePrimaryCtxRelease", 700)
    with pytest.warns(CudaWarning) as record:
        del pc
        gc.collect()
    monkeypatch.undo()
    text = " ".join(str(w.message) for w in record if issubclass(w.category, CudaWarning))
    assert "cuDevicePrimaryCtxRelease" in text and "700" in text and "2 of 2" in text, text
    assert drv.cuDevicePrimaryCtxRelease(0) == 0 and drv.cuDevicePrimaryCtxRelease(0) == 0   # both still held
