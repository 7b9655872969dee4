"""``DeviceBuffer(n)`` and ``free()``/``close()`` on the fake driver, on both paths: what each makes of the
driver, and that the compiled fronts (src/fastpath/fastpath_device_buffer.c) keep every rule the Python code
keeps -- the context they find, refusals, driver errors, exports, threads, fork, a changed default handle.

On the fast path ``DeviceBuffer.__init__``, ``close`` and ``free`` are C fronts that count the calls they
made themselves (``taken``); on the pure path those counts read 0 and the same behaviour is asserted.
"""
from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import Context, DeviceBuffer, Stream
from cuproc._resource import EPOCH, Resource
from cuproc.errors import ClosedResourceError, CudaError, InvalidContextError, InvalidValueError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from hook_driver import HookDriver  # noqa: E402
from threads import run_threads  # noqa: E402

FAST = cuproc.fastpath.active()
PYTHON_INIT = getattr(DeviceBuffer.__init__, "__wrapped__", DeviceBuffer.__init__)
CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_CONTEXT = 2, 1, 201


def taken() -> tuple[int, int]:
    """(allocations the __init__ front made itself, frees the close and free fronts made); 0s when pure."""
    return (getattr(DeviceBuffer.__init__, "taken", 0),
            getattr(DeviceBuffer.free, "taken", 0) + getattr(DeviceBuffer.close, "taken", 0))


def state(buf: DeviceBuffer) -> tuple:
    return (type(buf), buf.driver, buf.ended, buf.context, buf.nbytes, buf.stream, buf.pool, buf.last_stream,
            buf.claim_key, hasattr(buf, "_checked_at"))


def python_made(nbytes: int, **kwargs) -> DeviceBuffer:
    buf = object.__new__(DeviceBuffer)
    PYTHON_INIT(buf, nbytes, **kwargs)
    return buf


def test_the_fronts_make_the_pair_and_build_what_the_python_code_builds(fk, pc):
    DeviceBuffer(8).free()                                    # warm: the context's object is remembered
    before = taken()
    fk.clear_calls()
    a = DeviceBuffer(256)
    assert fk.calls() == ["cuCtxGetCurrent", "cuMemAlloc"]
    b = python_made(256)
    assert taken()[0] == before[0] + FAST
    assert state(a) == state(b) and a.address != b.address and a.context is pc.context
    assert fk.live("device_alloc") == 2
    host = np.arange(256, dtype=np.uint8)
    cuproc.memory.copy(a, host)
    back = np.zeros(256, np.uint8)
    cuproc.memory.copy(back, a)
    assert np.array_equal(back, host)
    fk.clear_calls()
    a.free()
    b.close()
    assert fk.calls() == ["cuMemFree", "cuMemFree"] and taken()[1] == before[1] + 2 * FAST
    assert a.ended == b.ended == "freed" and fk.live("device_alloc") == 0
    a.free()                                                  # idempotent: nothing reaches the driver
    a.close()
    with a:
        pass
    assert fk.call_count() == 2
    with pytest.raises(ClosedResourceError):
        a.ptr
    with DeviceBuffer(64) as c:
        assert fk.live("device_alloc") == 1
    assert c.freed and fk.live("device_alloc") == 0 and fk.stale_count() == 0


def test_context_given_is_used_where_it_is_current_and_pushed_where_it_is_not(fk, pc):
    ctx = pc.context
    before = taken()
    buf = DeviceBuffer(128, context=ctx)                      # current: the front
    assert buf.context is ctx and taken()[0] == before[0] + FAST
    other = Context.create(0)                                 # now current
    fk.clear_calls()
    pushed = DeviceBuffer(128, context=ctx)                   # not current: the Python code pushes
    assert pushed.context is ctx and "cuCtxPushCurrent" in fk.calls() and "cuCtxPopCurrent" in fk.calls()
    assert Context.current() is other and taken()[0] == before[0] + FAST
    mine = DeviceBuffer(128)                                  # the current one: the created context
    assert mine.context is other and taken()[0] == before[0] + 2 * FAST
    mine.free()
    Context.pop()
    for b in (buf, pushed):
        b.free()
    other.destroy()
    assert fk.live("device_alloc") == 0 and fk.binding_errors() == 0 and fk.stale_count() == 0


def test_a_primary_context_object_is_taken_as_its_context_and_anything_else_is_refused(fk, pc):
    buf = DeviceBuffer(64, context=pc)                        # what use_device returned
    assert buf.context is pc.context
    buf.free()
    for bad in ("ctx", 3, pc.context.handle):
        with pytest.raises(InvalidValueError) as info:
            DeviceBuffer(64, context=bad)
        assert info.value.call == "cuMemAlloc"
    assert cuproc.memory.mem_info(pc)[1] > 0
    with pytest.raises(InvalidValueError) as info:
        cuproc.memory.mem_info("ctx")
    assert info.value.call == "cuMemGetInfo"
    assert fk.live("device_alloc") == 0


@pytest.mark.parametrize("bad", [0, -1, "64", 2.0, np.int64(64), True, 2**64, 2**70])
def test_a_bad_size_is_refused_naming_cumemalloc_before_the_driver(fk, pc, bad):
    fk.clear_calls()
    with pytest.raises(InvalidValueError) as info:
        DeviceBuffer(bad)
    assert info.value.call == "cuMemAlloc" and "cuMemAlloc" not in fk.calls() and fk.live("device_alloc") == 0


def test_no_current_context_is_refused_naming_cumemalloc(fk):
    before = taken()
    with pytest.raises(InvalidContextError) as info:
        DeviceBuffer(64)
    assert info.value.call == "cuMemAlloc" and taken() == before and fk.live("device_alloc") == 0


def test_a_driver_error_from_cumemalloc_is_raised_once_and_leaks_nothing(fk, pc):
    DeviceBuffer(8).free()
    fk.fail("cuMemAlloc", CUDA_ERROR_OUT_OF_MEMORY)
    fk.clear_calls()
    with pytest.raises(cuproc.errors.OutOfMemoryError) as info:
        DeviceBuffer(1 << 20)
    assert info.value.call == "cuMemAlloc" and fk.calls().count("cuMemAlloc") == 1
    gc.collect()
    assert fk.live("device_alloc") == 0
    DeviceBuffer(8).free()                                    # the next one works


def test_a_failed_free_is_claimed_first_raised_once_and_a_binding_error_is_retried(fk, pc):
    buf = DeviceBuffer(64)
    fk.fail("cuMemFree", CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(CudaError) as info:
        buf.free()
    assert info.value.call == "cuMemFree" and buf.ended == "freed"
    fk.clear_calls()
    buf.free()                                                # claimed: never a second free
    assert fk.call_count() == 0
    assert pc.context.driver.cuMemFree(buf.address) == 0      # the test's own clean-up of the fake's memory
    buf = DeviceBuffer(64)
    fk.fail("cuMemFree", CUDA_ERROR_INVALID_CONTEXT)          # the thread's context was destroyed elsewhere
    fk.clear_calls()
    buf.free()                                                # the context's rebind: pushed, freed again
    assert fk.calls()[:2] == ["cuMemFree", "cuCtxPushCurrent"] and fk.calls().count("cuMemFree") == 2
    assert buf.freed and fk.live("device_alloc") == 0


def test_an_exported_buffer_is_not_freed_until_the_export_goes(fk, pc):
    buf = DeviceBuffer(64)
    capsule = buf.__dlpack__()
    with pytest.raises(BufferError):
        buf.free()
    assert not buf.freed and fk.live("device_alloc") == 1
    del capsule
    gc.collect()
    buf.free()
    assert buf.freed and fk.live("device_alloc") == 0


@pytest.mark.parametrize("let_go", ["free", "drop"])
def test_use_after_the_context_ended_is_refused_and_frees_nothing(fk, let_go):
    ctx = Context.create(0)
    buf = DeviceBuffer(64)
    Context.pop()
    ctx.destroy()
    fk.clear_calls()
    if let_go == "free":
        buf.free()                                            # the memory went with its context
        assert buf.closed
    else:
        del buf                                               # its finalizer gives nothing back either
        gc.collect()
    assert "cuMemFree" not in fk.calls() and fk.stale_count() == 0
    with pytest.raises(ClosedResourceError):
        DeviceBuffer(64, context=ctx)


class Sub(DeviceBuffer):
    """Not exactly a DeviceBuffer: the fronts leave it to the Python code."""


def test_a_subclass_takes_the_python_code(fk, pc):
    before = taken()
    sub = Sub(64)
    assert type(sub) is Sub and sub.context is pc.context and taken() == before
    sub.free()
    assert sub.freed and taken() == before and fk.live("device_alloc") == 0


def test_the_context_remembered_is_never_stale_and_kept_alive_by_nothing(fk, pc):
    """The front remembers the current handle's Context weakly: after a reset the same handle comes back
    with a new Context object, which is the one handed out (never the ended one), and a created context
    dropped by everyone is collected (its drop destroys it)."""
    DeviceBuffer(64).free()
    old = pc.context
    pc.reset()                                                # the handle stays current and is reused
    buf = DeviceBuffer(64)
    assert old.ended is not None and buf.context is pc.context and buf.context is not old
    assert buf.context.handle == old.handle and buf.context.ended is None
    buf.free()
    created = Context.create(0)
    DeviceBuffer(64).free()
    Context.pop()
    ref = weakref.ref(created)
    del created
    gc.collect()
    assert ref() is None and fk.live("context") == 0


def test_a_new_default_handle_is_the_one_allocated_with(fk, fake):
    first = cuproc.use_device(0)
    DeviceBuffer(64).free()
    other = cuproc.Driver(library=str(fake.path))
    cuproc.set_default_driver(other)
    pc = cuproc.use_device(0)
    buf = DeviceBuffer(64)
    assert buf.driver is other and buf.context.driver is other
    buf.free()
    del pc, first
    gc.collect()
    assert fk.live("device_alloc") == 0


def test_resource_claim_is_one_step_and_moves_the_epoch_for_non_leaves_only(fk, pc):
    assert FAST == hasattr(Resource._claim, "__wrapped__")
    s = Stream()
    epoch = EPOCH[0]
    buf = DeviceBuffer(64)
    assert buf._claim("freed") is True and buf._claim("freed") is False and EPOCH[0] == epoch
    assert pc.context.driver.cuMemFree(buf.address) == 0      # claimed by hand: the clean-up is ours
    assert s._claim("destroyed") is True and EPOCH[0] == epoch + 1 and s._claim("x") is False
    assert s.ended == "destroyed" and EPOCH[0] == epoch + 1
    assert s.handle is not None and pc.context.driver.cuStreamDestroy(s.handle) == 0
    half = object.__new__(DeviceBuffer)
    with pytest.raises(AttributeError):                       # never initialized: as Python says
        half._claim("freed")


def test_threads_freeing_the_same_buffers_free_each_once(fk, pc):
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(30):
            bufs = [DeviceBuffer(64) for _ in range(16)]
            steps = [lambda: [b.free() for b in bufs], lambda: [b.close() for b in reversed(bufs)],
                     lambda: [Resource.close(b) for b in bufs], lambda: [DeviceBuffer(32).free() for _ in bufs]]
            gate = threading.Barrier(len(steps))

            def run(k: int) -> None:
                with pc.context:                          # each thread in the buffers' context
                    gate.wait()
                    steps[k]()
            run_threads(run, len(steps))
            assert all(b.freed for b in bufs) and fk.live("device_alloc") == 0
    finally:
        sys.setswitchinterval(switch)
    assert fk.stale_count() == 0


def test_a_new_thread_allocates_in_its_own_current_context(fk, pc):
    """The remembered context is per handle, not per thread: a thread with no context is refused, one with
    another context current gets that one."""
    ctx = pc.context
    other = Context.create(0)
    Context.pop()
    seen: list[object] = []

    def worker(k: int) -> None:
        if k == 0:
            try:
                DeviceBuffer(64)
            except InvalidContextError as exc:
                seen.append(exc.call)
        else:
            with other:
                b = DeviceBuffer(64)
                seen.append(b.context)
                b.free()
    run_threads(worker, 2)
    buf = DeviceBuffer(64)
    assert sorted(seen, key=str) == sorted(["cuMemAlloc", other], key=str) and buf.context is ctx
    buf.free()
    other.destroy()
    assert fk.live("device_alloc") == 0


@pytest.mark.skipif(not FAST, reason="the compiled front's order of reads (the Python code looks the function "
                                      "up after its checks, as every Python caller does)")
def test_lookup_running_python_that_ends_the_context_is_seen(fake):
    """Everything the __init__ front checks is read after the driver-function lookup, which can run Python
    (a handle's __getattr__): a context destroyed meanwhile is refused, as by the Python code."""
    gc.collect()
    fake.reset()
    drv = HookDriver(library=str(fake.path))
    drv.hooks, drv.hooked = [], ("cuMemAlloc",)
    cuproc.set_default_driver(drv)
    try:
        ctx = Context.create(0)
        DeviceBuffer(64).free()
        drv.__dict__.pop("cuMemAlloc", None)
        drv.hooks.append(lambda: (Context.pop(driver=drv), ctx.destroy()))
        binding = fake.binding_errors()
        fake.clear_calls()
        with pytest.raises(ClosedResourceError):
            DeviceBuffer(64, context=ctx)
        # refused before any allocation: no cuMemAlloc on the destroyed context (nor its binding error)
        assert "cuMemAlloc" not in fake.calls() and fake.binding_errors() == binding
        assert fake.live("device_alloc") == 0 and fake.stale_count() == 0
    finally:
        cuproc.set_default_driver(None)


FORK = r"""
import os, sys
sys.path.insert(0, {tests!r})
import cuproc
from cuproc.errors import ForkedProcessError
cuproc.set_default_driver(cuproc.Driver(library={lib!r}))
pc = cuproc.use_device(0)
kept = cuproc.DeviceBuffer(64)
cuproc.DeviceBuffer(64).free()
pid = os.fork()
if pid == 0:
    code = 0
    try:
        cuproc.DeviceBuffer(64)
        code = 3
    except ForkedProcessError:
        pass
    kept.free()                       # the parent's memory: nothing reaches the driver
    os._exit(code if kept.closed else 4)
_, status = os.waitpid(pid, 0)
kept.free()
print(os.waitstatus_to_exitcode(status), kept.freed)
"""


def test_after_fork_the_child_refuses_and_frees_nothing(fk):
    code = FORK.format(tests=str(ROOT / "tests"), lib=str(fk.path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "True"], proc.stdout
    assert fk.fork_violations() == 0


@pytest.mark.skipif(not FAST, reason="the compiled factories")
def test_the_factories_refuse_slots_that_are_not_the_classes_own():
    """The fronts read and store at the offsets of the member descriptors they are given: a descriptor of
    another class (whose offset could lie anywhere in the object) is refused, as is a bad claim set-up."""
    from cuproc import device_memory as dm
    from cuproc._resource import DEFER_DROP, FORKED
    from cuproc.allocation import EXPORTS, Allocation
    from cuproc.driver import DEFAULT_HANDLE
    make = cuproc.fastpath.device_buffer_factory()
    slots = (Resource.driver, Resource.ended, Allocation.context, Allocation.address, Allocation.nbytes,
             DeviceBuffer.stream, DeviceBuffer.pool, DeviceBuffer.last_stream, DeviceBuffer.claim_key, Context.handle)
    class Own(DeviceBuffer):    # the factory enters its close front for the class's drops: not DeviceBuffer's
        pass
    common = ((print,) * 3, Own, Context, Resource, cuproc.ffi.typeof("CUcontext"), FORKED, EXPORTS,
              "freed", DEFAULT_HANDLE, DEFER_DROP)
    fronts = make(*(print,) * 7, *common, slots)
    assert len(fronts) == 3                                   # consistent: it builds
    for bad in ((Context.handle, *slots[1:]), (*slots[:9], DeviceBuffer.stream), (*slots[:2], Context.handle,
                                                                                 *slots[3:]),
                (*slots[:9], dm.Stream.handle)):
        with pytest.raises(ValueError, match="slot"):
            make(*(print,) * 7, *common, bad)
    with pytest.raises(ValueError, match="inconsistent"):
        make(*(print,) * 7, *common[:8], [None, None], DEFER_DROP, slots)   # the default handle's list has one entry
    with pytest.raises(ValueError, match="inconsistent"):
        make(*(print,) * 7, *common[:9], [None, None], slots)   # so has DEFER_DROP
    claim = cuproc.fastpath.claim_factory()
    assert callable(claim(print, Resource, Resource.ended, EPOCH))
    with pytest.raises(ValueError, match="slot"):
        claim(print, Resource, DeviceBuffer.stream, EPOCH)     # not a Resource slot
    with pytest.raises(TypeError):
        type(fronts[0])()                                     # made by the factory only


def test_a_dropped_live_buffer_is_freed_and_a_failure_is_a_warning(fk, pc):
    DeviceBuffer(8).free()
    before = taken()
    fk.clear_calls()
    DeviceBuffer(64)                                          # dropped at once, live
    assert fk.calls() == ["cuCtxGetCurrent", "cuMemAlloc", "cuMemFree"] and fk.live("device_alloc") == 0
    assert taken() == (before[0] + FAST, before[1] + FAST)    # both in C on the fast path
    buf = DeviceBuffer(64)
    fk.fail("cuMemFree", CUDA_ERROR_INVALID_VALUE)
    address = buf.address
    with pytest.warns(cuproc.errors.CudaWarning, match="dropped without close.*cuMemFree"):
        del buf
        gc.collect()
    assert pc.context.driver.cuMemFree(address) == 0          # it was not freed: the test's own clean-up
    buf = DeviceBuffer(64)
    fk.fail("cuMemFree", CUDA_ERROR_INVALID_CONTEXT)          # a binding error: pushed and freed again
    fk.clear_calls()
    del buf
    gc.collect()
    assert fk.calls().count("cuMemFree") == 2 and "cuCtxPushCurrent" in fk.calls()
    assert fk.live("device_alloc") == 0 and fk.stale_count() == 0


@pytest.mark.parametrize("code", [4, 201])   # CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_INVALID_CONTEXT
def test_a_failed_cuctxgetcurrent_is_raised_naming_it_on_both_paths_alike(fk, pc, code):
    """A cuCtxGetCurrent failing once is raised naming that call, with no second attempt, on both paths."""
    DeviceBuffer(8).free()
    fk.fail("cuCtxGetCurrent", code)
    fk.clear_calls()
    with pytest.raises(CudaError) as info:
        DeviceBuffer(64)
    assert info.value.call == "cuCtxGetCurrent" and info.value.code == code and fk.calls() == ["cuCtxGetCurrent"]
    DeviceBuffer(8).free()
    for count in (1, -1):   # with context= given, the context is pushed whatever cuCtxGetCurrent answers
        fk.fail("cuCtxGetCurrent", code, count)
        try:
            buf = DeviceBuffer(64, context=pc.context)
        finally:
            fk.fail("cuCtxGetCurrent", 0, 0)
        assert buf.context is pc.context and fk.live("device_alloc") == 1
        buf.free()
    assert fk.live("device_alloc") == 0


def test_a_failed_cuctxgetcurrent_is_raised_naming_it(fk, pc):
    """A driver whose cuCtxGetCurrent answers CUDA_ERROR_NOT_INITIALIZED (as it does until cuInit) is raised
    naming that call: the C front hands that answer to the Python code, which asks again and raises its own."""
    DeviceBuffer(8).free()
    fk.fail("cuCtxGetCurrent", 3, -1)                         # CUDA_ERROR_NOT_INITIALIZED, until cleared
    fk.clear_calls()
    try:
        with pytest.raises(cuproc.errors.NotInitializedError) as info:
            DeviceBuffer(64)
    finally:
        fk.fail("cuCtxGetCurrent", 0, 0)
    assert info.value.call == "cuCtxGetCurrent" and "cuMemAlloc" not in fk.calls()
    DeviceBuffer(8).free()
    assert fk.live("device_alloc") == 0


FIRST_OBJECT = r"""
import sys
import cuproc
from cuproc.errors import InvalidContextError
cuproc.set_default_driver(cuproc.Driver(library={lib!r}))
cuproc.driver.default_driver()        # the handle is open, and no object has run cuInit for it yet
try:
    cuproc.DeviceBuffer(16)
except InvalidContextError as exc:
    print(exc.call)
pc = cuproc.use_device(0)
buf = cuproc.DeviceBuffer(16)
buf.free()
print(buf.freed)
"""


def test_a_first_buffer_before_cuinit_is_refused_as_by_the_python_code(fk):
    """DeviceBuffer(n) as a process's first object, on an open handle that no object initialized: the
    refusal is the Python code's (no context is current: cuMemAlloc not called), not the driver's
    CUDA_ERROR_NOT_INITIALIZED from a cuCtxGetCurrent made before cuInit (a fresh process: cuInit is
    done once per process, so no earlier test may have run it)."""
    proc = subprocess.run([sys.executable, "-c", FIRST_OBJECT.format(lib=str(fk.path))], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["cuMemAlloc", "True"], (proc.stdout, proc.stderr)


def test_a_half_made_buffer_is_left_to_the_python_code(fk, pc):
    """__init__ on an object whose slots are partly set (not what DeviceBuffer(n) makes) is the Python
    code's: the C stores only into a buffer with none set, so nothing it replaces is leaked."""
    marker = object()
    ref_count = sys.getrefcount(marker)
    half = object.__new__(DeviceBuffer)
    half.address = marker
    before = taken()
    DeviceBuffer.__init__(half, 64)
    assert taken() == before and half.address != marker and sys.getrefcount(marker) == ref_count
    half.free()
    assert fk.live("device_alloc") == 0


def test_the_default_handle_list_emptied_by_someone_else_is_no_crash(fk, pc):
    from cuproc.driver import DEFAULT_HANDLE
    DeviceBuffer(8).free()
    saved = DEFAULT_HANDLE[:]
    DEFAULT_HANDLE.clear()
    try:
        with pytest.raises(IndexError):                       # what the Python code meets: no crash
            DeviceBuffer(64)
    finally:
        DEFAULT_HANDLE[:] = saved
    DeviceBuffer(8).free()


def test_streams_and_events_take_a_primary_context_and_refuse_anything_else(fk, pc):
    own = Stream()
    for make, call in ((lambda c: Stream(context=c), "cuStreamCreateWithPriority"),
                       (lambda c: cuproc.stream.Event(context=c), "cuEventCreate"),
                       (lambda c: Stream.from_handle(own.handle, context=c), "Stream.from_handle")):
        made = make(pc)
        assert made.context is pc.context
        with pytest.raises(InvalidValueError) as info:
            make("ctx")
        assert info.value.call == call
