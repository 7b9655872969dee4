"""``memory.copy`` between a DeviceBuffer and pinned or registered host memory, on the fake driver, on both
paths: what it makes of the driver, and that the compiled front (src/fastpath/fastpath_copy.c) keeps every rule
the Python code keeps -- sizes, refusals, ended objects, the context binding, driver errors, the streams
recorded, fork, threads, a stand-in for the driver function.

On the fast path ``memory.copy`` is a C front that counts the copies it made itself (``taken``); on the
pure path that count reads 0 and the same behaviour is asserted.
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import Context, DeviceBuffer, Stream, memory
from cuproc.errors import ClosedResourceError, CudaError, InvalidValueError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from fakedriver import child_preamble  # noqa: E402
from hook_driver import HookDriver  # noqa: E402
from subproc import run_python  # noqa: E402
from threads import run_threads  # noqa: E402

FAST = cuproc.fastpath.active()
CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_ILLEGAL_ADDRESS = 1, 700


def taken() -> int:
    """The copies the front made itself (0 on the pure path)."""
    return getattr(memory.copy, "taken", 0)


def host_kinds(n: int) -> list:
    """Host memory the GPU reaches: pinned (a class the front takes), and registered (a NumPy array's pages:
    the Python code's, since a registration may be read-only, which the front cannot see)."""
    pinned = memory.PinnedBuffer(n)
    registered = memory.RegisteredHostMemory(np.zeros(n, np.uint8))
    return [pinned, registered]


def by_front(host) -> int:
    """1 where the front makes copies with ``host`` itself (pinned memory, on the fast path), else 0."""
    return int(FAST and type(host) is memory.PinnedBuffer)


def fill(host, values: np.ndarray) -> None:
    np.frombuffer(host.buffer, np.uint8)[:] = values


def read(host) -> np.ndarray:
    return np.frombuffer(host.buffer, np.uint8).copy()


def test_both_directions_make_one_driver_call_and_move_the_bytes(fk, pc):
    rng = np.random.default_rng(1)
    for host in host_kinds(512):
        dev = DeviceBuffer(512)
        values = rng.integers(0, 256, 512, dtype=np.uint8)
        fill(host, values)
        memory.copy(dev, host)                                # first: the Python check, which it remembers
        fill(host, np.zeros(512, np.uint8))
        before = taken()
        fk.clear_calls()
        memory.copy(host, dev)
        # the current context asked first: a synchronous copy runs in whichever one is current
        assert fk.calls() == ["cuCtxGetCurrent", "cuMemcpyDtoH"] and taken() == before + by_front(host)
        assert np.array_equal(read(host), values)
        fill(host, values[::-1].copy())
        fk.clear_calls()
        memory.copy(dev, host)
        assert fk.calls() == ["cuCtxGetCurrent", "cuMemcpyHtoD"] and taken() == before + 2 * by_front(host)
        back = np.zeros(512, np.uint8)
        memory.copy(back, dev)                                # NumPy: the Python code
        assert np.array_equal(back, values[::-1]) and taken() == before + 2 * by_front(host)
        dev.free()
        host.close()
    assert fk.live("device_alloc") == 0 and fk.binding_errors() == 0


def test_the_size_defaults_to_the_smaller_side_and_a_given_size_is_checked(fk, pc):
    dev, (host, _) = DeviceBuffer(256), host_kinds(128)
    fill(host, np.arange(128, dtype=np.uint8))
    memory.copy(dev, host)                                    # 128 bytes: the smaller side
    before = taken()
    part = DeviceBuffer(256)
    memory.copy(part, dev, 0)                                 # (device to device: the Python code)
    memory.copy(host, dev, 64)
    memory.copy(host, dev, 0)                                 # nothing to copy: made as asked
    assert taken() == before + 2 * FAST
    got = np.zeros(256, np.uint8)
    memory.copy(got, dev)
    assert np.array_equal(got[:128], np.arange(128)) and not got[128:].any()
    for bad in (-1, 129, 257, True, 64.0, np.int64(64), "64"):
        fk.clear_calls()
        with pytest.raises(InvalidValueError) as info:
            memory.copy(host, dev, bad)
        assert info.value.call == "cuMemcpy" and fk.calls() == []
    assert taken() == before + 2 * FAST


def test_everything_else_goes_to_the_python_code_unchanged(fk, pc):
    class Mine(DeviceBuffer):
        pass
    dev, sub, (host, _) = DeviceBuffer(64), Mine(64), host_kinds(64)
    s = Stream()
    memory.copy(dev, host)
    before = taken()
    memory.copy(sub, host)                                    # a subclass
    memory.copy(dev.view(np.uint8), host)                     # a view
    memory.copy(dev, host, stream=s)                          # a stream
    s.synchronize()
    memory.copy(dev, host, 64, stream=None)                   # any keyword
    memory.copy(dev, sub)                                     # device to device
    memory.copy(dev, np.zeros(64, np.uint8))                  # a buffer-protocol object
    assert taken() == before
    with pytest.raises(InvalidValueError, match="both sides are host memory"):
        memory.copy(host, memory.PinnedBuffer(64))
    assert dev.last_stream is None                            # the stream's copy was followed by a synchronous one
    for x in (dev, sub, host):
        x.close()
    s.close()


def test_memory_of_a_context_subclass_goes_to_the_python_code(fk, pc):
    """A Context subclass may bind its own way (its call and rebind): the front takes exactly a Context."""
    class MyContext(Context):
        pass
    mine = MyContext.create(0)
    try:
        dev, host = DeviceBuffer(64), memory.PinnedBuffer(64)
        assert type(dev.context) is MyContext
        values = np.arange(64, dtype=np.uint8)
        fill(host, values)
        before = taken()
        memory.copy(dev, host)
        fill(host, np.zeros(64, np.uint8))
        memory.copy(host, dev)
        assert taken() == before and np.array_equal(read(host), values)
        dev.close()
        host.close()
    finally:
        mine.destroy()


def test_a_synchronous_copy_clears_what_stream_work_left_recorded(fk, pc):
    dev, (host, _) = DeviceBuffer(64), host_kinds(64)
    s = Stream()
    memory.copy(dev, host, stream=s)
    assert dev.last_stream is s and host.last_stream is s
    before = taken()
    memory.copy(host, dev)          # stream work recorded: the Python code orders the copy after it
    assert dev.last_stream is None and host.last_stream is None and taken() == before
    memory.copy(host, dev)          # nothing left on a stream: the front's
    assert taken() == before + FAST
    for x in (dev, host, s):
        x.close()


@pytest.mark.parametrize("ended_side", ["device", "pinned", "registered"])
def test_an_ended_side_is_refused_before_the_driver_whichever_it_is(fk, pc, ended_side):
    """Closing a buffer (a leaf) does not move the epoch: the other side stays checked, and the ended one
    is refused on its own ``ended``, in both directions."""
    dev, (pinned, registered) = DeviceBuffer(64), host_kinds(64)
    host = pinned if ended_side != "registered" else registered
    memory.copy(dev, host)
    memory.copy(host, dev)                                    # both checked at this epoch
    ended = dev if ended_side == "device" else host
    ended.close()
    fk.clear_calls()
    before = taken()
    for dst, src in ((dev, host), (host, dev)):
        with pytest.raises(ClosedResourceError):
            memory.copy(dst, src)
    assert fk.calls() == [] and taken() == before
    for x in (dev, pinned, registered):
        x.close()


def test_an_ended_context_is_refused_before_the_driver(fk, pc):
    (host, reg) = host_kinds(64)
    ctx = Context.create(0)
    mine = DeviceBuffer(64)
    memory.copy(mine, host)                                   # checked: the front's case from now on
    memory.copy(reg, mine)
    Context.pop()
    ctx.destroy()
    fk.clear_calls()
    with pytest.raises(ClosedResourceError):
        memory.copy(host, mine)
    with pytest.raises(ClosedResourceError):
        memory.copy(mine, reg)
    assert fk.calls() == []
    for x in (host, reg):
        x.close()


def test_a_given_size_or_the_smaller_side_is_what_moves(fk, pc):
    dev, (host, _) = DeviceBuffer(256), host_kinds(128)
    h = np.frombuffer(host.buffer, np.uint8)
    h[:] = np.arange(128, dtype=np.uint8)
    memory.copy(dev, host)                                    # checked (Python): 128 bytes
    before = taken()
    h[:] = 0xAA
    memory.copy(dev, host, 16)                                # 16 bytes in
    back = np.zeros(256, np.uint8)
    memory.copy(back, dev)
    assert (back[:16] == 0xAA).all() and np.array_equal(back[16:128], np.arange(16, 128))
    h[:] = 0x55
    memory.copy(host, dev, 8)                                 # 8 bytes out
    assert (h[:8] == 0xAA).all() and (h[8:] == 0x55).all()
    h[:] = 7
    memory.copy(host, dev)                                    # the smaller side: 128, no overrun of the host
    assert (h[:16] == 0xAA).all() and np.array_equal(h[16:], np.arange(16, 128))
    assert taken() == before + 3 * FAST
    del h
    dev.close()
    host.close()


def test_the_fronts_calls_leave_every_count_of_references_as_it_was(fk, pc):
    dev, (host, _) = DeviceBuffer(64), host_kinds(64)
    memory.copy(dev, host)
    s = Stream()
    ctx, drv = dev.context, dev.context.driver

    def counts() -> list[int]:
        return [sys.getrefcount(x) for x in (dev, host, ctx, drv, s)]
    def rounds(n: int) -> None:
        for _ in range(n):
            memory.copy(dev, host)
            memory.copy(host, dev, 32)
        fk.fail("cuMemcpyHtoD", CUDA_ERROR_ILLEGAL_ADDRESS, -1)
        for _ in range(n):
            with pytest.raises(CudaError):
                memory.copy(dev, host, 32)
        fk.fail("cuMemcpyHtoD", 0, 0)
    rounds(1)                                                 # (what a first failure leaves cached)
    first = counts()
    rounds(300)
    assert counts() == first
    memory.copy(dev, host, stream=s)                          # dev and host record s ...
    s.synchronize()
    held = sys.getrefcount(s)
    memory.copy(dev, host)                                    # ... until a synchronous copy releases both
    assert sys.getrefcount(s) == held - 2
    for x in (dev, host, s):
        x.close()


def test_another_current_context_is_bound_around_the_call(fk, pc):
    dev, (host, _) = DeviceBuffer(64), host_kinds(64)
    fill(host, np.full(64, 7, np.uint8))
    memory.copy(dev, host)
    other = Context.create(0)                                 # now current: dev's context is not
    before = taken()
    fk.clear_calls()
    fill(host, np.full(64, 9, np.uint8))
    memory.copy(host, dev, 8)      # the real driver would copy in `other` (on its default stream): dev's is pushed
    calls = fk.calls()
    assert calls[-3:] == ["cuCtxPushCurrent", "cuMemcpyDtoH", "cuCtxPopCurrent"] and calls.count("cuMemcpyDtoH") == 1
    assert set(calls[:-3]) == {"cuCtxGetCurrent"} and fk.misrouted_count() == 0
    assert Context.current() is other                         # the thread's stack as it was
    assert (read(host)[:8] == 7).all() and (read(host)[8:] == 9).all()   # the retry copied the size given
    assert taken() == before                                  # (the front handed the call to the Python code)
    Context.pop()
    with pc.context:                                          # with dev's context current: the front's own call
        memory.copy(host, dev)
    assert taken() == before + FAST
    other.push()
    Context.pop()
    other.destroy()
    for x in (dev, host):
        x.close()


def test_a_driver_error_is_raised_naming_the_call_and_records_nothing(fk, pc):
    dev, (host, _) = DeviceBuffer(64), host_kinds(64)
    s = Stream()
    memory.copy(dev, host, stream=s)
    memory.copy(dev, host)
    memory.copy(dev, host, stream=s)                          # both record s
    for call, dst, src in (("cuMemcpyHtoD", dev, host), ("cuMemcpyDtoH", host, dev)):
        fk.fail(call, CUDA_ERROR_ILLEGAL_ADDRESS)
        with pytest.raises(CudaError) as info:
            memory.copy(dst, src)
        assert info.value.call == call and info.value.code == CUDA_ERROR_ILLEGAL_ADDRESS
        assert dev.last_stream is s and host.last_stream is s  # a failed copy leaves the records alone
    s.synchronize()
    for x in (dev, host, s):
        x.close()


def test_a_stand_in_for_the_driver_function_is_called_as_the_python_code_calls_it(fk, pc):
    """The front calls the pointer behind ``drv.cuMemcpyHtoD`` only while it is the driver's own function of
    the front's C type; a Python stand-in put there (a test's, a tracer's) is what the Python code calls."""
    drv = pc.context.driver
    dev, (host, _) = DeviceBuffer(64), host_kinds(64)
    memory.copy(dev, host)
    seen = []
    real = drv.cuMemcpyHtoD

    def stand_in(*args):
        seen.append(args[2])
        return real(*args)
    drv.cuMemcpyHtoD = stand_in
    try:
        before = taken()
        memory.copy(dev, host, 32)
        assert seen == [32] and taken() == before
    finally:
        del drv.cuMemcpyHtoD
    memory.copy(dev, host, 16)
    assert seen == [32] and taken() == before + FAST
    for x in (dev, host):
        x.close()


@pytest.mark.skipif(not FAST, reason="the compiled front's order of lookup and checks")
def test_python_run_by_the_lookup_that_ends_a_side_is_seen(fake):
    """The front looks its driver function up before its checks: Python the lookup runs (a handle's
    ``__getattr__``) may close a side, which the front then sees and refuses, before the driver.  (The
    Python code checks first and looks the function up after: there such a hook is not guarded against.)"""
    fake.reset()
    drv = HookDriver(library=str(fake.path))
    ctx = Context.create(0, driver=drv)
    dev = DeviceBuffer(64, context=ctx)
    host = memory.PinnedBuffer(64, context=ctx)
    memory.copy(dev, host)
    drv.__dict__.pop("cuMemcpyDtoH", None)                    # looked up through __getattr__ next time
    drv.hooked, drv.hooks = ("cuMemcpyDtoH",), [dev.close]
    with pytest.raises(ClosedResourceError):
        memory.copy(host, dev)
    assert fake.live("device_alloc") == 0
    host.close()
    Context.pop(driver=drv)
    ctx.destroy()


def test_threads_copying_their_own_buffers_get_their_own_bytes(fk, pc):
    pairs = [(DeviceBuffer(4096), memory.PinnedBuffer(4096)) for _ in range(8)]
    for k, (dev, host) in enumerate(pairs):
        fill(host, np.full(4096, k, np.uint8))
        memory.copy(dev, host)
    before = taken()
    def work(k: int) -> None:
        dev, host = pairs[k]
        out = np.zeros(4096, np.uint8)
        if k % 2:                                             # half the threads with the context current:
            pc.context.push()                                 # the front's own calls, the rest bound per call
        for i in range(200):
            fill(host, np.full(4096, (k + i) % 256, np.uint8))
            memory.copy(dev, host)
            memory.copy(host, dev)
            memory.copy(out, dev)
            assert (out == (k + i) % 256).all(), f"thread {k} round {i} read another's bytes"
        if k % 2:
            Context.pop()
    binding = fk.binding_errors()
    run_threads(work, 8)
    # a thread without the context current goes to Python, which pushes it: never a call in no (or the
    # wrong) context, so no binding error either
    assert taken() == before + FAST * 4 * 200 * 2
    assert fk.binding_errors() == binding and fk.misrouted_count() == 0
    for dev, host in pairs:
        dev.close()
        host.close()


def test_after_fork_the_child_refuses(fk):
    out = run_python(child_preamble(fk.path) + textwrap.dedent("""
        from cuproc import memory
        pc = cuproc.use_device(0)
        dev, host = cuproc.DeviceBuffer(64), memory.PinnedBuffer(64)
        memory.copy(dev, host)
        memory.copy(host, dev)
        pid = os.fork()
        if pid == 0:
            try:
                memory.copy(host, dev)
            except cuproc.errors.CudaError as exc:
                os._exit(3 if "fork" in str(exc) else 4)
            os._exit(5)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), "violations", fake.fork_violations())
        """), timeout=60).stdout
    assert out.strip().splitlines()[-1] == "child 3 violations 0"


@pytest.mark.skipif(not FAST, reason="the compiled factory")
def test_the_factory_refuses_slots_that_are_not_the_classes_own():
    from cuproc import transfers
    from cuproc._resource import EPOCH, FORKED, Resource
    from cuproc.allocation import Allocation
    from cuproc.host_memory import HostMemory, PinnedBuffer
    make = cuproc.fastpath.copy_factory()
    readers = (print, print, print)
    members = (Resource.driver, Resource.ended, Resource._checked_at, Allocation.context, Allocation.address,
               Allocation.nbytes, Context.handle)
    ctype = cuproc.ffi.typeof("CUcontext")
    table = ((DeviceBuffer, False, DeviceBuffer.last_stream), (PinnedBuffer, True, HostMemory.last_stream))
    front = make(print, print, Context, ctype, FORKED, EPOCH, readers, table, members)
    assert callable(front) and front.taken == 0
    for bad_table in (((DeviceBuffer, False, HostMemory.last_stream),),      # another class's slot
                      ((PinnedBuffer, True, DeviceBuffer.last_stream),),
                      ((Context, False, DeviceBuffer.last_stream),)):        # not an Allocation
        with pytest.raises(ValueError, match="slot"):
            make(print, print, Context, ctype, FORKED, EPOCH, readers, bad_table, members)
    with pytest.raises(ValueError, match="slot"):
        make(print, print, Context, ctype, FORKED, EPOCH, readers, table, (Context.handle, *members[1:]))
    with pytest.raises(ValueError, match="slot"):     # the context's handle must be a Context slot
        make(print, print, Context, ctype, FORKED, EPOCH, readers, table, (*members[:6], DeviceBuffer.last_stream))
    with pytest.raises(ValueError, match="inconsistent"):
        make(print, print, Context, ctype, FORKED, EPOCH, readers[:2], table, members)
    with pytest.raises(ValueError, match="inconsistent"):
        make(print, print, Context, ctype, FORKED, EPOCH, readers, table * 3, members)   # more classes than room
    with pytest.raises(ValueError, match="not \\(class"):
        make(print, print, Context, ctype, FORKED, EPOCH, readers, ((DeviceBuffer, False),), members)
    with pytest.raises(TypeError):
        type(front)()                                         # made by the factory only
    assert memory.copy is transfers.copy and memory.copy.__wrapped__.__name__ == "copy"
