"""The hot memory paths on the fake driver: which driver calls each makes, and that the lean paths keep
every rule of the resource model (refusal after close of a parent, after free, after fork; binding from
another context; one free however many threads let go at once).

``fk.calls()`` lists the entry points the fake saw since ``fk.clear_calls()``: an extra query, sync or
context switch on a hot path shows here on CPU before it shows on a GPU benchmark.
"""
from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import Context, DeviceBuffer, Stream
from cuproc import memory as mem
from cuproc.device_memory import free_stream_ordered_entry
from cuproc.errors import ClosedResourceError, CudaError, CudaWarning

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_memory import COPY_CALLS  # noqa: E402 - the calls the benchmark's rows state, checked here
from fakedriver import FakeDriver, child_preamble  # noqa: E402
from hook_driver import HookDriver  # noqa: E402
from subproc import run_python  # noqa: E402
from threads import run_threads  # noqa: E402


def calls_of(fk, action):
    """The driver entry points ``action()`` calls (after one untimed run, so lazy set-up is done)."""
    fk.clear_calls()
    action()
    return fk.calls()


# ----------------------------------------------------------------------------- stream-ordered pairs

def test_alloc_async_pair_on_a_stream_is_the_two_driver_calls_and_nothing_else(fk, pc):
    s = Stream()
    mem.alloc_async(256, s).free_async()                     # warm
    fk.clear_calls()
    buf = mem.alloc_async(256, s)
    assert fk.calls() == ["cuMemAllocAsync"] and fk.pool_used(0) == 256
    assert buf.stream is s and buf.last_stream is s and buf.context is s.context and buf.pool is None
    host = np.arange(256, dtype=np.uint8)
    mem.copy(buf, host, stream=s)
    back = np.zeros(256, np.uint8)
    mem.copy(back, buf, stream=s)
    s.synchronize()
    assert np.array_equal(back, host)
    fk.clear_calls()
    buf.free_async()
    assert fk.calls() == ["cuMemFreeAsync"] and fk.pool_used(0) == 0
    assert buf.freed and buf.ended == "freed"
    buf.free_async()                                          # idempotent: no second call
    buf.close()
    assert fk.call_count() == 1
    with pytest.raises(ClosedResourceError, match="freed"):
        buf.ptr
    with pytest.raises(ClosedResourceError, match="freed"):
        mem.copy(buf, host)


def test_a_dropped_stream_ordered_buffer_is_freed_on_its_stream(fk, pc):
    s = Stream()
    buf = mem.alloc_async(512, s)
    fk.clear_calls()
    del buf
    gc.collect()
    assert fk.calls() == ["cuMemFreeAsync"] and fk.pool_used(0) == 0


def test_free_async_refuses_after_its_stream_was_closed_and_the_drop_still_frees(fk, pc):
    s = Stream()
    buf = mem.alloc_async(64, s)
    s.close()
    fk.clear_calls()
    with pytest.raises(ClosedResourceError, match="stream") as info:
        buf.free_async()
    assert info.value.refused and fk.calls() == []            # refused before the driver saw the address
    with pytest.raises(ClosedResourceError):
        mem.alloc_async(64, s)
    assert fk.calls() == [] and fk.pool_used(0) == 64
    buf.close()                                               # its stream is gone: the whole context waits
    assert fk.calls()[-1] == "cuMemFreeAsync" and fk.pool_used(0) == 0


def test_destroying_the_context_frees_its_stream_ordered_buffers_and_later_use_refuses(fk):
    ctx = Context.create(0)
    s = Stream()
    buf = mem.alloc_async(64, s)
    Context.pop()
    fk.clear_calls()
    ctx.destroy()                                             # frees the stream-ordered memory first
    assert fk.calls()[0] == "cuMemFreeAsync" and fk.pool_used(0) == 0 and buf.ended == "freed"
    fk.clear_calls()
    buf.free_async()                                          # already freed: nothing to do
    for attempt in (lambda: buf.ptr, lambda: mem.alloc_async(64, s), lambda: mem.copy(buf, bytes(64))):
        with pytest.raises(ClosedResourceError):
            attempt()
    with pytest.raises(ClosedResourceError, match="destroyed"):
        mem.alloc_async(64, s)
    assert fk.calls() == []


def test_a_stream_of_another_context_takes_the_work_as_is_when_another_context_is_current(fk):
    """A call that names its stream runs in that stream's context whichever one is current (driver 580 on an
    H200, tests/test_gpu_routing.py): one driver call, no push."""
    a = Context.create(0)
    s = Stream()                                               # a stream of context a
    Context.pop()
    b = Context.create(0)                                      # b is current now
    before = fk.binding_errors()
    fk.clear_calls()
    buf = mem.alloc_async(128, s)
    assert fk.calls() == ["cuMemAllocAsync"]
    assert buf.context is a and Context.current() is b        # the thread's stack is as it was
    fk.clear_calls()
    buf.free_async()
    assert fk.calls() == ["cuMemFreeAsync"]
    assert fk.binding_errors() == before and fk.misrouted_count() == 0
    assert fk.pool_used(0) == 0 and Context.current() is b
    Context.pop()
    b.destroy()
    s.close()
    a.destroy()


def test_a_driver_failure_is_not_retried_and_names_the_call(fk, pc):
    s = Stream()
    fk.fail("cuMemAllocAsync", 2, 1)                           # CUDA_ERROR_OUT_OF_MEMORY, once
    fk.clear_calls()
    with pytest.raises(CudaError, match="cuMemAllocAsync"):
        mem.alloc_async(64, s)
    assert fk.calls() == ["cuMemAllocAsync"]                  # not a binding error: no second attempt
    buf = mem.alloc_async(64, s)
    fk.fail("cuMemFreeAsync", 700, 1)
    with pytest.raises(CudaError, match="cuMemFreeAsync"):
        buf.free_async()
    assert buf.freed                                          # claimed first: never freed twice
    fk.fail("cuMemFreeAsync", 0, 0)


def test_free_async_refuses_while_exported_and_frees_after(fk, pc):
    s = Stream()
    buf = mem.alloc_async(64, s)
    capsule = buf.__dlpack__(stream=-1)
    with pytest.raises(BufferError, match="cuMemFreeAsync"):
        buf.free_async()
    assert not buf.freed and fk.pool_used(0) == 64
    del capsule
    gc.collect()
    buf.free_async()
    assert fk.pool_used(0) == 0


@pytest.mark.parametrize("rival", ["close", "free_async", "context"])
def test_threads_letting_go_of_one_buffer_free_it_once(fk, rival):
    """free_async against close(), another free_async, or the context's teardown, started together:
    the memory goes back exactly once (a second free would be a stale use in the fake)."""
    ctx = Context.create(0)
    s = Stream()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                               # threads interleave inside the calls
    try:
        race(fk, ctx, s, rival)
    finally:
        sys.setswitchinterval(switch)
    assert fk.pool_used(0) == 0 and fk.stale_count() == 0
    Context.pop()
    s.close()
    ctx.destroy()


def race(fk, ctx, s, rival):
    for _ in range(300):
        buf = mem.alloc_async(64, s)
        gate = threading.Barrier(2)
        errors: list[BaseException] = []

        def let_go(how, buf=buf, gate=gate, errors=errors):
            gate.wait()
            try:
                if how == "close":
                    buf.close()
                elif how == "free_async":
                    buf.free_async()
                else:
                    ctx.free_stream_ordered()
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)
        rivals = [threading.Thread(target=let_go, args=(h,)) for h in ("free_async", rival)]
        for t in rivals:
            t.start()
        for t in rivals:
            t.join()
        assert errors == [] and buf.freed


@pytest.mark.parametrize("late", ["close", "finalizer"])
def test_a_late_close_after_free_async_gave_the_address_back_frees_nothing(fk, pc, late):
    """Review finding 1, step by step: free_async takes the claim (removes the buffer's entry), close()
    or the finalizer starts before free_async marks the buffer ended, the memory is freed, and the pool
    hands the address to a new buffer.  The late close/finalizer must find no claim: no driver call,
    and the new buffer at the same address keeps its entry and is freed once, by its own free."""
    s = Stream()
    old = mem.alloc_async(256, s)
    ctx, x = old.context, old.address
    assert ctx.untrack_stream_ordered(old.claim_key) is not None   # free_async's claim (its inline pop)
    assert old.driver.cuMemFreeAsync(x, s.handle) == 0        # free_async's driver call
    new = mem.alloc_async(256, s)
    assert new.address == x and fk.async_reuses() == 1        # the pool gave the address back
    fk.clear_calls()
    if late == "close":
        old.close()                                           # ended was still None: close claims it ...
    else:
        del old                                               # ... and so does the finalizer
        gc.collect()
    assert fk.calls() == [] and fk.pool_used(0) == 256        # ... and frees nothing: the claim was taken
    assert not new.freed
    new.free_async()
    assert fk.calls() == ["cuMemFreeAsync"] and fk.pool_used(0) == 0 and fk.stale_count() == 0


def test_free_async_that_lost_the_claim_ends_the_buffer_and_frees_nothing(fk, pc):
    """Review finding 5: free_async finding the entry gone (another way of freeing took it) frees
    nothing and leaves the buffer ended, not looking live; the claim's holder frees it once."""
    s = Stream()
    buf = mem.alloc_async(64, s)
    entry = buf.context.untrack_stream_ordered(buf.claim_key)   # the claim, taken by "another thread"
    assert entry is not None and entry == (buf.address, buf.stream)
    assert buf.context.untrack_stream_ordered(buf.claim_key) is None   # ... once
    fk.clear_calls()
    buf.free_async()
    assert fk.calls() == [] and buf.freed and buf.ended == "freed"
    with pytest.raises(ClosedResourceError, match="freed"):
        buf.ptr
    assert free_stream_ordered_entry(buf.context, buf.claim_key, entry) == 0   # the holder of the claim frees it
    assert fk.calls() == ["cuMemFreeAsync"] and fk.pool_used(0) == 0
    buf.close()
    del buf
    gc.collect()
    assert fk.call_count() == 1 and fk.stale_count() == 0


def test_teardown_frees_a_buffer_allocated_while_it_runs(fk, monkeypatch):
    """Review finding 5: the context's teardown empties its table entry by entry, so a buffer allocated
    (by another thread, here by the driver call it makes) while it frees the others is freed too, not
    dropped from the table and left looking live with its pool counting it for good."""
    ctx = Context.create(0)
    s = Stream()
    first = mem.alloc_async(64, s)
    drv = ctx.driver
    real = drv.cuMemFreeAsync
    late: list[DeviceBuffer] = []

    def free_then_allocate(address, stream):
        rc = real(address, stream)
        if not late:
            late.append(mem.alloc_async(128, s))
        return rc
    monkeypatch.setattr(drv, "cuMemFreeAsync", free_then_allocate)
    Context.pop()
    ctx.destroy()
    monkeypatch.undo()
    assert len(late) == 1 and first.ended == "freed" and late[0].ended == "freed"
    assert fk.pool_used(0) == 0 and fk.live("async_alloc") == 0 and fk.stale_count() == 0


def test_teardown_reports_a_failed_free_and_frees_the_rest(fk):
    """A cuMemFreeAsync that fails in the context's teardown is a warning naming the buffer and the call;
    the other buffers are still freed once and the context is destroyed."""
    ctx = Context.create(0)
    s = Stream()
    bufs = [mem.alloc_async(64, s) for _ in range(3)]
    fk.fail("cuMemFreeAsync", 700, 1)                         # the first free fails, once
    Context.pop()
    fk.clear_calls()
    with pytest.warns(CudaWarning, match="cuMemFreeAsync") as caught:
        ctx.destroy()
    fk.fail("cuMemFreeAsync", 0, 0)
    assert len(caught) == 1 and any(f"{b.address:#x}" in str(caught[0].message) for b in bufs)
    assert fk.calls()[-1] == "cuCtxDestroy"
    assert fk.pool_used(0) == 64                    # the failed one alone: the context took it, the pool counts it
    assert all(b.ended == "freed" for b in bufs) and ctx.ended is not None and fk.stale_count() == 0


class _Holder:
    """Puts a buffer in a reference cycle (buffer -> holder -> buffer) through ``last_stream``, the one
    attribute a user sets: only the cycle collector frees it, weak references first, finalizer after."""

    def __init__(self, buf: DeviceBuffer) -> None:
        self.buf = buf
        buf.last_stream = self  # type: ignore[assignment]


def test_teardown_between_a_cycles_weakref_clearing_and_its_finalizer_frees_the_memory(fk):
    """Review (second round): the collector clears a cyclic buffer's weak references before its
    finalizer runs; a context teardown landing in between (here: in a weakref callback, which runs at
    exactly that moment) must still free the memory -- the entry holds the address and the stream --
    and the finalizer afterwards must free nothing."""
    ctx = Context.create(0)
    s = Stream()
    buf = mem.alloc_async(64, s)
    x = buf.address
    _Holder(buf)
    seen: list[object] = []

    def teardown_in_the_gap(_ref: object) -> None:
        seen.append(key() if key in ctx.stream_ordered else "no entry")
        ctx.free_stream_ordered()
    key = buf.claim_key
    probe = weakref.ref(buf, teardown_in_the_gap)
    fk.clear_calls()
    del buf
    gc.collect()
    assert probe() is None and seen == [None]     # the teardown ran with the buffer's weak reference dead
    # freed once, by the teardown, after waiting for the context (what was last queued on the memory is not
    # known without the buffer: device_memory.after_last_work); the finalizer found no entry
    assert fk.calls() == ["cuCtxSynchronize", "cuMemFreeAsync"]
    assert fk.pool_used(0) == 0 and fk.stale_count() == 0 and ctx.stream_ordered == {}
    Context.pop()
    s.close()
    ctx.destroy()
    assert x and fk.live("async_alloc") == 0


def test_a_created_context_dropped_in_one_cycle_with_its_buffer_gives_the_memory_back(fk):
    """Review (second round): a created context collected together with its stream-ordered buffer (one
    garbage cycle) is destroyed by its finalizer, which may run before the buffer's; it frees what is left
    in its table first, so the pool does not keep counting the memory.  Whatever the finalizers' order,
    the memory is freed once and the context destroyed once."""
    for trial in range(4):
        fk.clear_calls()
        ctx = Context.create(0)
        s = Stream()
        bufs = [mem.alloc_async(64 * (k + 1), s) for k in range(trial + 1)]
        for b in bufs:
            _Holder(b)
        Context.pop()
        del b, bufs, s, ctx
        gc.collect()
        calls = fk.calls()
        assert calls.count("cuCtxDestroy") == 1, calls   # a free's first attempt may find the context not current
        assert fk.pool_used(0) == 0 and fk.stale_count() == 0 and fk.live("async_alloc") == 0


@pytest.mark.parametrize("rival", ["close", "context", "finalizer"])
def test_threads_letting_go_of_many_buffers_with_reused_addresses_free_each_once(fk, rival, monkeypatch):
    """Review finding 8: many buffers, let go at once in two ways (free_async against close(), against the
    context's teardown; the teardown against dropping them), while a third thread allocates on the same
    stream and gets the freed addresses back (the fake reuses them, as a pool does).  Each allocation is
    freed exactly once: a late free of a reused address frees another buffer's memory (then that buffer's
    own free is stale) or takes its claim (then its memory stays counted by the pool)."""
    ctx = Context.create(0)
    s = Stream()
    drv = ctx.driver
    real_free = drv.cuMemFreeAsync
    real_untrack = Context.untrack_stream_ordered

    def free_then_yield(address, stream):        # the allocating thread may take the address at once
        rc = real_free(address, stream)
        time.sleep(0)
        return rc

    def yield_then_untrack(self, *args):          # close()/the finalizer: the others run between its
        time.sleep(1e-5)                           # claim and its table pop (a free and a reallocation)
        return real_untrack(self, *args)
    monkeypatch.setattr(drv, "cuMemFreeAsync", free_then_yield)
    monkeypatch.setattr(Context, "untrack_stream_ordered", yield_then_untrack)
    ctx.stream_ordered = YieldingTable(ctx.stream_ordered)    # free_async: widen claim-to-ended window
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        errors = race_many(fk, ctx, s, rival)
    finally:
        sys.setswitchinterval(switch)
        monkeypatch.undo()
    gc.collect()
    assert errors == []
    assert fk.async_reuses() > 100                            # the race ran with addresses handed back
    assert fk.stale_count() == 0 and fk.pool_used(0) == 0 and fk.live("async_alloc") == 0
    Context.pop()
    s.close()
    ctx.destroy()


class YieldingTable(dict):
    """A context's table of stream-ordered allocations whose pop yields to other threads once it took
    an entry: the moment between the claim and what the claimer does next is where rivals get in."""

    def pop(self, *args):
        entry = super().pop(*args)
        time.sleep(0)
        return entry


def race_many(fk, ctx, s, rival, rounds=60, width=8):
    errors: list[BaseException] = []
    for _ in range(rounds):
        bufs = [mem.alloc_async(64, s) for _ in range(width)]
        kept: list[DeviceBuffer] = []
        done: list[object] = []                        # the steps that have finished
        gate = threading.Barrier(3)

        def run(step, gate=gate, done=done):
            gate.wait()
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion of the caller
                errors.append(exc)
            finally:
                done.append(step)

        def free_each(bufs=bufs):
            for buf in bufs:
                buf.free_async()

        def close_each(bufs=bufs):
            for buf in bufs:
                buf.close()

        def drop_each(bufs=bufs):
            while bufs:
                bufs.pop()                             # the last reference: the finalizer frees it

        def allocate(kept=kept, done=done):
            while len(kept) < 8 * width and (not kept or len(done) < 2):
                kept.append(mem.alloc_async(64, s))   # takes the addresses freed meanwhile
                time.sleep(0)                         # (one at a time, for as long as the others run)
        steps = {"close": (free_each, close_each), "context": (free_each, ctx.free_stream_ordered),
                 "finalizer": (ctx.free_stream_ordered, drop_each)}[rival]
        threads = [threading.Thread(target=run, args=(step,)) for step in (*steps, allocate)]
        survivors = [] if rival == "finalizer" else list(bufs)
        del bufs
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(buf.freed for buf in survivors)
        # a late free of a reused address would have freed one of these under it
        assert fk.live("async_alloc") == sum(not buf.freed for buf in kept)
        for buf in kept:
            buf.free_async()
    return errors


def test_threads_allocating_on_one_stream_get_their_own_addresses(fk, pc, monkeypatch):
    """The hot path reuses a per-thread out-parameter: threads allocating at once on one stream each
    get the address the driver gave them (distinct, all counted by the pool, all freed once).  The
    driver entry is wrapped to yield to the other threads between writing the address and returning,
    so that an out-parameter shared between threads would be overwritten before it is read."""
    s = Stream()
    drv = s.context.driver
    real = drv.cuMemAllocAsync

    def alloc_then_yield(out, nbytes, stream):
        rc = real(out, nbytes, stream)
        time.sleep(0)
        return rc
    monkeypatch.setattr(drv, "cuMemAllocAsync", alloc_then_yield)
    kept: list[list[DeviceBuffer]] = [[] for _ in range(4)]
    gate = threading.Barrier(4)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def allocate(mine):
        s.context.push()                       # current, so that the first attempt is the one that counts
        gate.wait()
        for _ in range(250):
            mine.append(mem.alloc_async(32, s))
        Context.pop()
    try:
        workers = [threading.Thread(target=allocate, args=(k,)) for k in kept]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    finally:
        sys.setswitchinterval(switch)
        monkeypatch.undo()
    buffers = [b for k in kept for b in k]
    assert len(buffers) == 1000 and len({b.address for b in buffers}) == 1000
    assert fk.pool_used(0) == 1000 * 32
    for b in buffers:
        b.free_async()
    assert fk.pool_used(0) == 0


FORK = """
import os, sys
sys.path.insert(0, {tests!r})
import cuproc
from cuproc import memory as mem
from cuproc.device_memory import free_stream_ordered_entry
cuproc.set_default_driver(cuproc.Driver(library={lib!r}))
pc = cuproc.use_device(0)
s = cuproc.Stream()
buf = mem.alloc_async(64, s)
pid = os.fork()
if pid == 0:
    refused = 0
    for attempt in (buf.free_async, lambda: mem.alloc_async(64, s), lambda: buf.ptr):
        try:
            attempt()
        except cuproc.ForkedProcessError:
            refused += 1
    import ctypes, gc, warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.context.free_stream_ordered()       # the context's teardown leaves it alone too (no attempt)
        del buf                               # ... and so does the finalizer
        gc.collect()
    if caught:
        os._exit(20)
    os._exit(0 if refused == 3 and ctypes.CDLL({lib!r}).fake_fork_violations() == 0 else 10 + refused)
_, status = os.waitpid(pid, 0)
buf.free_async()                              # the parent still owns it
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_after_fork_the_stream_ordered_paths_refuse_in_the_child(fk):
    code = FORK.format(tests=str(ROOT / "tests"), lib=str(fk.path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0", proc.stdout


def test_device_buffer_pair_calls(fk, pc):
    DeviceBuffer(256).free()
    assert calls_of(fk, lambda: DeviceBuffer(256).free()) == ["cuCtxGetCurrent", "cuMemAlloc", "cuMemFree"]


# ----------------------------------------------------------------------------- copies

def _copy_rows(size):
    """The benchmark's copy rows as (row, action, check) on ``size`` bytes of fresh memory."""
    d = DeviceBuffer(size)
    pinned = mem.PinnedBuffer(size)
    pageable = np.zeros(size, np.uint8)
    pattern = (np.arange(size) % 251).astype(np.uint8)
    return d, pinned, pageable, pattern


@pytest.mark.parametrize("row", sorted(COPY_CALLS))
def test_each_benchmark_copy_row_makes_exactly_the_calls_it_states(fk, pc, row):
    size = 1 << 16
    d, pinned, pageable, pattern = _copy_rows(size)
    host = pinned.numpy() if row.startswith("pinned") else pageable
    h2d = "H2D" in row
    if h2d:
        host[:] = pattern
        action = lambda: mem.copy(d, pinned if row.startswith("pinned") else pageable)  # noqa: E731
    else:
        mem.copy(d, pattern)
        host[:] = 0
        action = lambda: mem.copy(pinned if row.startswith("pinned") else pageable, d)  # noqa: E731
    action()
    assert calls_of(fk, action) == COPY_CALLS[row]
    if h2d:
        back = np.zeros(size, np.uint8)
        mem.copy(back, d)
        assert np.array_equal(back, pattern)
    else:
        assert np.array_equal(host, pattern)
    del host
    pinned.close()
    d.close()


def _outcome(fk, action):
    """(driver calls, exception type or None) of ``action()``."""
    fk.clear_calls()
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - compared, not swallowed
        return fk.calls(), type(exc)
    return fk.calls(), None


def test_the_lean_copy_between_allocations_does_what_the_general_path_does(fk, pc, monkeypatch):
    """memory.copy between cuproc allocations without a stream skips the general path's records; a
    ``driver=`` argument forces the general path.  For each case both paths start from the same fresh
    bytes and must make the same calls, raise the same error, and leave the same bytes everywhere."""
    size = 4096
    d, e = DeviceBuffer(size), DeviceBuffer(2 * size)
    pinned, small = mem.PinnedBuffer(size), mem.PinnedBuffer(size // 2)
    managed = mem.ManagedBuffer(size)
    drv = cuproc.default_driver()
    cases = {
        "H2D": (d, pinned, None), "D2H": (pinned, d, None), "D2D": (e, d, None), "to managed": (managed, d, None),
        "from managed": (d, managed, None), "given nbytes": (d, pinned, 100), "given nbytes D2H": (pinned, e, 300),
        "overrun": (small, d, size), "bad nbytes": (d, pinned, -1), "both host": (pinned, small, None),
    }
    buffers = (d, e, pinned, small, managed)

    def fill(seed):             # fresh, distinct bytes in every buffer
        for i, b in enumerate(buffers):
            data = ((np.arange(b.nbytes) * (seed + 3) + 7 * i) % 251).astype(np.uint8)
            if isinstance(b, DeviceBuffer):
                mem.copy(b, data)
            else:
                b.numpy()[:] = data

    def contents():
        out = []
        for b in buffers:
            if b.kind == "host":
                out.append(b.numpy().tobytes())
            else:
                host = np.empty(b.nbytes, np.uint8)
                mem.copy(host, b)
                out.append(host.tobytes())
        return out

    for seed, (name, (dst, src, n)) in enumerate(cases.items()):
        fill(seed)
        before = contents()
        lean = _outcome(fk, lambda: mem.copy(dst, src, n))
        after_lean = contents()
        fill(seed)
        general = _outcome(fk, lambda: mem.copy(dst, src, n, driver=drv))
        assert lean == general, name
        assert after_lean == contents(), name
        changed = [i for i, (x, y) in enumerate(zip(before, after_lean)) if x != y]
        if general[1] is None and name != "both host":
            i, j = buffers.index(dst), buffers.index(src)
            count = min(dst.nbytes, src.nbytes) if n is None else n
            assert changed == [i], name
            assert after_lean[i][:count] == before[j][:count] and after_lean[i][count:] == before[i][count:], name
        else:
            assert changed == [], name
    from cuproc import transfers
    with monkeypatch.context() as m:             # the lean path is the one taken: it makes no _Side
        m.setattr(transfers, "_side", None)
        mem.copy(d, pinned)
    s = Stream()
    mem.copy(d, pinned, stream=s)
    assert d.last_stream is s and pinned.last_stream is s
    assert _outcome(fk, lambda: mem.copy(d, pinned)) == (["cuCtxGetCurrent", "cuMemcpyHtoD"], None)
    assert d.last_stream is None and pinned.last_stream is None      # a synchronous copy leaves none pending
    other = Context.create(1)                    # device memory of two contexts: the general path's peer copy
    Context.pop()
    try:
        far = DeviceBuffer(size, context=other)
        fill(99)
        mem.copy(far, d)
        # a synchronous peer copy runs with the destination's context current (the driver wants one current)
        assert _outcome(fk, lambda: mem.copy(far, d)) == (
            ["cuCtxGetCurrent", "cuCtxPushCurrent", "cuMemcpyPeer", "cuCtxPopCurrent"], None)
        assert _outcome(fk, lambda: mem.copy(d, far)) == (["cuCtxGetCurrent", "cuMemcpyPeer"], None)
        back = np.empty(size, np.uint8)
        mem.copy(back, far)
        assert back.tobytes() == contents()[0]
        far.free()
    finally:
        other.destroy()
    d.free()
    assert _outcome(fk, lambda: mem.copy(d, pinned)) == ([], ClosedResourceError)
    assert _outcome(fk, lambda: mem.copy(pinned, d)) == ([], ClosedResourceError)
    for b in (e, pinned, small, managed):
        b.close()


def test_async_copies_are_one_call_each_on_the_stream(fk, pc):
    s = Stream()
    d, pinned, pageable, pattern = _copy_rows(4096)
    pinned.numpy()[:] = pattern
    assert calls_of(fk, lambda: mem.copy(d, pinned, stream=s)) == ["cuMemcpyHtoDAsync"]
    assert calls_of(fk, lambda: mem.copy(pageable, d, stream=s)) == ["cuMemcpyDtoHAsync"]
    s.synchronize()
    assert np.array_equal(pageable, pattern) and d.last_stream is s and pinned.last_stream is s


# ----------------------------------------------------------------------------- the C front (fast path)
# On the fast path alloc_async, DeviceBuffer.free_async and DeviceBuffer.__del__ are C fronts
# (src/fastpath/fastpath_memory.c) over the Python code, which ``__wrapped__`` names; on the pure path they
# are that code.  These tests hold on both: the front builds what the code builds, and hands every
# other form to it unchanged.

FAST = cuproc.fastpath.active()
PYTHON_ALLOC = getattr(mem.alloc_async, "__wrapped__", mem.alloc_async)


def taken() -> tuple[int, int]:
    """(calls the alloc front made itself, calls the free front made itself); (0, 0) on the pure path."""
    return (getattr(mem.alloc_async, "taken", 0), getattr(DeviceBuffer.free_async, "taken", 0))


def state(buf: DeviceBuffer) -> tuple:
    entry = buf.context.stream_ordered[buf.claim_key]
    return (type(buf), buf.driver, buf.ended, buf.context, buf.nbytes, buf.stream, buf.last_stream, buf.pool,
            hasattr(buf, "_checked_at"), type(buf.claim_key), buf.claim_key() is buf, type(entry), entry,
            list(buf.context.stream_ordered).count(buf.claim_key))


def test_the_front_builds_the_buffer_and_entry_the_python_code_builds(fk, pc):
    s = Stream()
    before = taken()
    a = mem.alloc_async(256, s)
    b = PYTHON_ALLOC(256, s)
    assert taken()[0] == before[0] + FAST                     # the front made a itself (fast path)
    assert state(a)[:-3] == state(b)[:-3] and a.address != b.address
    assert state(a)[-3:] == (tuple, (a.address, s), 1) and state(b)[-3:] == (tuple, (b.address, s), 1)
    assert fk.pool_used(0) == 512
    a.free_async()
    b.free_async()
    assert taken()[1] == before[1] + 2 * FAST
    assert a.ended == b.ended == "freed" and a.claim_key not in a.context.stream_ordered
    assert b.claim_key not in b.context.stream_ordered
    assert fk.pool_used(0) == 0 and fk.stale_count() == 0
    a.free_async()                                            # idempotent, nothing reaches the driver
    assert fk.pool_used(0) == 0 and fk.stale_count() == 0


class OtherStream(Stream):
    """Not exactly a cuproc Stream: the front leaves it to the Python code."""


def test_the_front_hands_every_other_form_to_the_python_code(fk, pc, monkeypatch):
    s = Stream()
    pool = mem.MemoryPool.create(0)
    before = taken()
    other = OtherStream()
    made = [mem.alloc_async(64, s, pool=pool), mem.alloc_async(64), mem.alloc_async(64, other),
            mem.alloc_async(64, s.handle)]
    for bad, error in [(np.int64(64), ValueError), (-1, ValueError), ("64", ValueError), (2**70, Exception)]:
        with pytest.raises(error):
            mem.alloc_async(bad, s)
    assert taken() == before                                   # none of those was the front's
    for buf in made[1:]:                                       # on no cuproc Stream: the Python method
        buf.free_async()
    assert taken() == before
    made[0].free_async()                                       # from a pool, on a Stream: the front
    buf = mem.alloc_async(64, s)
    buf.free_async(s)                                          # its own stream given: the front too
    before = (before[0], before[1] + 2 * FAST)
    assert buf.freed and taken() == (before[0] + FAST, before[1])
    calls = []
    real = buf.driver.cuMemAllocAsync

    def counted(*args):
        calls.append(args[1])
        return real(*args)
    monkeypatch.setattr(buf.driver, "cuMemAllocAsync", counted)   # a stand-in on the handle: always called
    mem.alloc_async(32, s).free_async()                        # (the free is the driver's own: the front's)
    assert calls == [32] and taken() == (before[0] + FAST, before[1] + FAST)
    monkeypatch.undo()
    mem.alloc_async(32, s).free_async()                        # the driver's own function again: the front
    assert taken() == (before[0] + 2 * FAST, before[1] + 2 * FAST)
    published = vars(buf.driver)                               # written into the handle's dict directly, after
    published["cuMemAllocAsync"] = counted                     # the front has called (and remembered) the real one
    mem.alloc_async(16, s).free_async()
    assert calls == [32, 16] and taken() == (before[0] + 2 * FAST, before[1] + 3 * FAST)
    published["cuMemAllocAsync"] = real
    mem.alloc_async(16, s).free_async()
    assert calls == [32, 16] and taken() == (before[0] + 3 * FAST, before[1] + 4 * FAST)
    buf.driver.__dict__ = {**published, "cuMemAllocAsync": counted}   # another dict; the old one lives on
    mem.alloc_async(8, s).free_async()
    assert calls == [32, 16, 8] and taken() == (before[0] + 3 * FAST, before[1] + 5 * FAST)
    buf.driver.__dict__ = published
    mem.alloc_async(8, s).free_async()
    assert calls == [32, 16, 8] and taken() == (before[0] + 4 * FAST, before[1] + 6 * FAST)
    s.close()
    with pytest.raises(ClosedResourceError):
        mem.alloc_async(64, s)
    pool.close()
    assert fk.pool_used(0) == 0 and fk.stale_count() == 0


def test_the_finalizer_front_frees_a_live_buffer_and_refuses_nothing_else(fk, pc):
    s = Stream()
    buf = mem.alloc_async(64, s)
    del buf
    gc.collect()
    assert fk.pool_used(0) == 0 and fk.live("async_alloc") == 0
    DeviceBuffer.__del__(object())                             # not a buffer: the Python finalizer, a no-op
    kept = DeviceBuffer(64)
    kept.free()
    DeviceBuffer.__del__(kept)                                 # ended: nothing to give back
    assert fk.live("device_alloc") == 0 and fk.stale_count() == 0


def test_a_finalizer_assigned_to_the_class_replaces_the_front(fk, pc, monkeypatch):
    """On the fast path the front is DeviceBuffer's tp_finalize; assigning DeviceBuffer.__del__ (here a
    counting wrapper) must still take effect at once, as for any class, and restoring it restores the
    front's behaviour: a dropped live buffer is freed either way, a dropped freed one costs nothing."""
    s = Stream()
    seen: list[int] = []
    front = DeviceBuffer.__del__

    def counting(buf):
        seen.append(buf.nbytes)
        front(buf)
    monkeypatch.setattr(DeviceBuffer, "__del__", counting)
    try:
        mem.alloc_async(48, s)                                 # dropped at once, live
        mem.alloc_async(80, s).free_async()                    # dropped freed
        assert seen == [48, 80] and fk.pool_used(0) == 0 and fk.live("async_alloc") == 0
    finally:                                                   # (also when it failed: the tests after it)
        monkeypatch.undo()
        if FAST:
            front.take_finalizer()                             # the class's tp_finalize again, as at import
    assert DeviceBuffer.__del__ is front
    mem.alloc_async(48, s)
    mem.alloc_async(80, s).free_async()
    assert seen == [48, 80] and fk.pool_used(0) == 0 and fk.live("async_alloc") == 0 and fk.stale_count() == 0


@pytest.mark.skipif(not FAST, reason="the compiled fronts' own hooks")
def test_the_finalizer_front_is_the_class_finalizer_and_lets_ended_buffers_go_in_c(fk, pc):
    """On the fast path the finalizer front is DeviceBuffer's tp_finalize (installed once its __del__):
    an ended buffer is let go in C (counted in ``taken``), a live one goes to Resource.__del__ and is
    freed.  Only the finalizer front, as its class's own __del__, can take the slot."""
    front = DeviceBuffer.__del__
    assert front.finalizes_class
    s = Stream()
    before = front.taken
    mem.alloc_async(64, s).free_async()                        # dropped ended: C alone
    assert front.taken == before + 1
    mem.alloc_async(64, s)                                     # dropped live: Resource.__del__ frees it
    assert front.taken == before + 1 and fk.pool_used(0) == 0 and fk.live("async_alloc") == 0
    for other in (mem.alloc_async, DeviceBuffer.free_async):
        with pytest.raises(ValueError, match="only the finalizer front"):
            other.take_finalizer()
    # An assignment (of the same front: a monkeypatch's undo would be one more, after the test, and leave
    # the class on Python's own slot for every test after it) puts Python's own slot back ...
    try:
        DeviceBuffer.__del__ = front  # type: ignore[method-assign]
        assert not front.finalizes_class
        mem.alloc_async(64, s).free_async()                    # ... which calls the front as a method
        assert front.taken == before + 1 and fk.pool_used(0) == 0  # (not the class finalizer: not counted)
    finally:
        retaken = front.take_finalizer()                       # (an assert here would hide the failure above)
    assert retaken is True and front.finalizes_class


def test_a_reloaded_device_memory_module_installs_its_own_fronts(fake):
    """importlib.reload of cuproc.device_memory makes a new DeviceBuffer class: its fronts (and its
    finalizer) are its own, and buffers of either class are freed."""
    out = run_python(child_preamble(fake.path) + textwrap.dedent("""
        import gc, importlib
        from cuproc import device_memory as dm
        pc = cuproc.use_device(0)
        s = cuproc.Stream()
        old = dm.DeviceBuffer
        kept = dm.alloc_async(64, s)
        for _ in range(2):
            importlib.reload(dm)
            assert dm.DeviceBuffer is not old
            assert getattr(dm.DeviceBuffer.__del__, "finalizes_class", True)
            dm.alloc_async(64, s).free_async()
            dm.alloc_async(32, s)                  # dropped live: its class's finalizer frees it
        del kept
        gc.collect()
        print("live", fake.live("async_alloc"), "used", fake.pool_used(0))
        """), timeout=60).stdout
    assert out.strip().splitlines()[-1] == "live 0 used 0"


@pytest.mark.skipif(not FAST, reason="the compiled fronts' cache")
def test_the_fronts_keep_no_driver_handle_alive(fake):
    """The fronts remember which handle's function they called by identity only: a Driver used through
    them and then dropped is collected."""
    gc.collect()
    fake.reset()
    drv = cuproc.Driver(library=str(fake.path))
    ctx = Context.create(0, driver=drv)
    s = Stream(context=ctx)
    before = taken()
    for _ in range(3):
        mem.alloc_async(64, s).free_async()
    assert taken() == (before[0] + 3, before[1] + 3)
    s.close()
    Context.pop(driver=drv)
    ctx.destroy()
    ref = weakref.ref(drv)
    del s, ctx, drv
    gc.collect()
    assert ref() is None


@pytest.mark.skipif(not FAST, reason="the compiled fronts' order of reads")
def test_what_python_changes_during_the_fronts_lookup_is_seen(fake):
    """Everything the fronts check is read after the driver-function lookup: a stream closed, a context's
    or a buffer's driver replaced while the lookup runs Python is seen (the Python code takes over)."""
    gc.collect()
    fake.reset()
    drv = HookDriver(library=str(fake.path))
    drv.hooks, drv.hooked = [], ("cuMemAllocAsync", "cuMemFreeAsync")
    cuproc.set_default_driver(drv)
    try:
        pc = cuproc.use_device(0)
        other = cuproc.Driver(library=str(fake.path))

        def lookup_runs(hook):                 # the next lookup goes through __getattr__ and runs hook
            for name in ("cuMemAllocAsync", "cuMemFreeAsync"):
                drv.__dict__.pop(name, None)
            drv.hooks.append(hook)
        s = Stream()
        lookup_runs(s.close)
        with pytest.raises(ClosedResourceError):
            mem.alloc_async(64, s)
        s = Stream()
        before = taken()
        lookup_runs(lambda: setattr(s.context, "driver", other))
        buf = mem.alloc_async(64, s)
        assert buf.driver is other and taken() == before   # not the front's: the context's driver changed
        s.context.driver = drv
        buf.driver = drv
        buf.free_async()
        buf = mem.alloc_async(64, s)
        before = taken()
        lookup_runs(lambda: setattr(buf, "driver", other))
        buf.free_async()
        assert buf.ended == "freed" and taken() == before  # the Python method freed it
        del buf
        s.close()
        del pc
        gc.collect()
        assert fake.live("async_alloc") == 0 and fake.stale_count() == 0
    finally:
        cuproc.set_default_driver(None)


@pytest.mark.skipif(not FAST, reason="the compiled fronts' cache")
def test_a_function_found_through_another_handles_hook_is_not_remembered_for_the_first(fake, tmp_path):
    """The 3.12 cache is the last lookup's: a lookup on handle B (through its __getattr__) after A's was
    remembered must not leave A's key in place, or A's next allocation calls B's library."""
    gc.collect()
    fake.reset()
    a = cuproc.Driver(library=str(fake.path))
    cuproc.set_default_driver(a)
    try:
        pc = cuproc.use_device(0)
        sa = Stream()
        seen = []
        for tag in "bc":                                    # (the second handle meets a watched cache)
            copy = tmp_path / f"lib{tag}.so"
            shutil.copy(fake.path, copy)
            other = FakeDriver(copy)
            other.reset()
            b = cuproc.Driver(library=str(copy))
            ctx_b = Context.create(0, driver=b)
            sb = Stream(context=ctx_b)
            Context.pop(driver=b)
            mem.alloc_async(64, sa).free_async()        # A's function, from A's dict: remembered
            b.__dict__.pop("cuMemAllocAsync", None)      # B's, through its __getattr__
            kept = mem.alloc_async(128, sb)
            other.clear_calls()
            mem.alloc_async(256, sa).free_async()        # on A's stream: A's library only
            seen += other.calls()
            kept.free_async()
            sb.close()
            ctx_b.destroy()
        assert "cuMemAllocAsync" not in seen
        sa.close()
        del pc
    finally:
        cuproc.set_default_driver(None)


def test_threads_racing_the_c_claim_free_each_buffer_once(fk):
    """The fronts under threads, on the driver's own entry points and the plain table (the race tests
    above put Python stand-ins there, which the fronts leave to the Python code): free_async, close(),
    the context's teardown and new allocations on the same stream race over the same buffers while
    the pool hands freed addresses out again.  Every allocation is freed exactly once."""
    ctx = Context.create(0)
    s = Stream()
    before = taken()
    reuses = fk.async_reuses()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(40):
            bufs = [mem.alloc_async(64, s) for _ in range(16)]
            kept: list[DeviceBuffer] = []
            steps = [lambda: [b.free_async() for b in bufs], lambda: [b.close() for b in reversed(bufs)],
                     ctx.free_stream_ordered, lambda: kept.extend(mem.alloc_async(64, s) for _ in range(16))]
            gate = threading.Barrier(len(steps))

            def run(k: int) -> None:
                with ctx:                                 # each thread in the stream's context
                    gate.wait()
                    steps[k]()
            run_threads(run, len(steps))
            assert all(b.freed for b in bufs)
            assert fk.live("async_alloc") == sum(not b.freed for b in kept)
            for b in kept:
                b.free_async()
    finally:
        sys.setswitchinterval(switch)
    assert fk.async_reuses() > reuses and fk.stale_count() == 0 and fk.pool_used(0) == 0
    if FAST:                                              # the fronts made the calls, not the Python code
        assert taken()[0] - before[0] >= 40 * 16 and taken()[1] > before[1]
    Context.pop()
    s.close()
    ctx.destroy()


def test_an_allocation_subclass_naming_other_parents_is_closed_by_their_rule(fk):
    """close() checks an allocation's context inline only where the context is its one parent: a subclass
    that names another parent is closed by the resource model's walk, which releases nothing once any
    parent has ended (the handle went with its owner); one whose parents are alive frees as usual."""
    class Held(DeviceBuffer):
        __slots__ = ("holder",)

        def parents(self):
            return (self.context, self.holder)
    pc = cuproc.use_device(0)
    kept, dropped = Held(256), Held(256)
    kept.holder, dropped.holder = Stream(), Stream()
    dropped.holder.close()
    fk.clear_calls()
    dropped.close()
    assert dropped.closed and "cuMemFree" not in fk.calls()
    assert pc.context.driver.cuMemFree(dropped.address) == 0     # the test's own clean-up: the fake's memory
    fk.clear_calls()
    kept.close()
    assert kept.closed and "cuMemFree" in fk.calls()
    kept.holder.close()
    assert not Held._context_is_the_parent and DeviceBuffer._context_is_the_parent
