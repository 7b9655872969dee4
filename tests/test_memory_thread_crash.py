"""Threads meeting, all at once, a driver function that the C fronts of ``alloc_async`` and
``DeviceBuffer.free_async`` have not seen yet (src/fastpath/fastpath_memory.c, ``cuproc_so_function``).

A front keeps the function ``drv.cuX`` was last seen to be (a reference) and the address it calls.  A
new one -- a new Driver handle's, or a stand-in a test put there -- is checked by a Python call
(``pointer_of``), during which other threads run and may replace the kept function too.  Each thread
must release only the reference its own store replaced: the front used to read the kept function
before that call and release it after, so two threads released the same reference, and when the front
held the last one (the previous Driver's function, in the test after another), the second release
wrote into freed memory -- the segfault seen in ``_scratch.out`` of alloc_async in
test_memory_paths.py's threaded test, under coverage.

The window is the Python call; the children widen it (``cuproc.fastpath.pointer``, which it calls,
sleeps first), so that every round has threads inside it together.  A child may crash: each runs in
its own process.  Without the fast path there is no front: the file is skipped.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from subproc import run_python

import cuproc

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not cuproc.fastpath.active(),
                                reason="the C fronts exist only with the compiled fast path")

CHILD = """
import sys, threading, time
sys.path[:0] = [{root!r}, {tests!r}]
from pathlib import Path
from fakedriver import FakeDriver
import cuproc
from cuproc import Context, Stream, fastpath
from cuproc import memory as mem

_pointer = fastpath.pointer
def slow_pointer(function):                 # the front's pointer_of: hand the GIL to the other threads
    time.sleep(0.002)
    return _pointer(function)
fastpath.pointer = slow_pointer

fake = FakeDriver(Path({lib!r}))
fake.reset()
cuproc.set_default_driver(cuproc.Driver(library=str(fake.path)))
pc = cuproc.use_device(0)
s = Stream()
drv = s.context.driver
name, threads, each = {name!r}, 4, 5
for k in range(12):
    mem.alloc_async(32, s).free_async()     # both fronts keep the driver's own functions
    real = getattr(drv, name)

    def stand_in(*args, real=real):         # not a driver pointer: the fronts run the Python code
        rc = real(*args)
        time.sleep(0)
        return rc
    mine = [[mem.alloc_async(32, s) for _ in range(each)] for _ in range(threads)]
    gate = threading.Barrier(threads)

    def work(bufs):
        s.context.push()
        gate.wait()
        if name == "cuMemAllocAsync":
            bufs.extend(mem.alloc_async(32, s) for _ in range(each))
        for b in bufs:
            b.free_async()
        Context.pop()
    setattr(drv, name, stand_in)
    before = sys.getrefcount(real)
    workers = [threading.Thread(target=work, args=(b,)) for b in mine]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    after = sys.getrefcount(real)
    # the only change meanwhile: the front that calls drv.<name> dropped the one reference it kept
    assert after == before - 1, f"round {{k}}: {{before}} references before, {{after}} after"
    setattr(drv, name, real)
    del real, stand_in, mine, workers
assert fake.pool_used(0) == 0
print("ok")
"""


@pytest.mark.parametrize("name", ["cuMemAllocAsync", "cuMemFreeAsync"])
def test_threads_seeing_a_new_driver_function_at_once_release_the_old_one_once(fake, name):
    out = run_python(CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), lib=str(fake.path), name=name),
                     timeout=120)
    assert out.stdout.split()[-1] == "ok"


def test_threads_allocating_after_a_new_driver_each_time_do_not_crash(fake):
    """The shape of the crash: the front holds the last reference to the previous Driver's function when
    threads first call alloc_async through a stand-in; released twice, it corrupted the allocator."""
    out = run_python(f"""
        import gc, sys, threading, time
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
        from pathlib import Path
        from fakedriver import FakeDriver
        import cuproc
        from cuproc import Context, Stream, fastpath
        from cuproc import memory as mem

        _pointer = fastpath.pointer
        def slow_pointer(function):
            time.sleep(0.002)
            return _pointer(function)
        fastpath.pointer = slow_pointer
        fake = FakeDriver(Path({str(fake.path)!r}))
        for _ in range(30):
            gc.collect()
            fake.reset()
            cuproc.set_default_driver(cuproc.Driver(library=str(fake.path)))
            pc = cuproc.use_device(0)
            mem.alloc_async(32, cuproc.Stream()).free_async()   # the front keeps this driver's function
            cuproc.set_default_driver(cuproc.Driver(library=str(fake.path)))
            pc2 = cuproc.use_device(0)                          # ... the only reference once it goes
            s = Stream()
            drv = s.context.driver
            real = drv.cuMemAllocAsync

            def stand_in(out, nbytes, stream, real=real):
                rc = real(out, nbytes, stream)
                time.sleep(0)
                return rc
            drv.cuMemAllocAsync = stand_in
            kept = [[] for _ in range(4)]
            gate = threading.Barrier(4)

            def allocate(mine):
                s.context.push()
                gate.wait()
                mine.extend(mem.alloc_async(32, s) for _ in range(20))
                Context.pop()
            workers = [threading.Thread(target=allocate, args=(k,)) for k in kept]
            for t in workers:
                t.start()
            for t in workers:
                t.join()
            drv.cuMemAllocAsync = real
            buffers = [b for k in kept for b in k]
            assert len({{b.address for b in buffers}}) == 80
            for b in buffers:
                b.free_async()
            del buffers, kept, workers
            cuproc.driver.default_driver().cuCtxSetCurrent(cuproc.ffi.NULL)
            for p in (pc, pc2):
                while p.retain_count:
                    p.release()
        print("ok")
    """, timeout=120)
    assert out.stdout.split()[-1] == "ok"
