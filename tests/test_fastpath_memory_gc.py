"""The C fronts of stream-ordered allocation (src/fastpath/fastpath_memory.c) while Python runs inside them.

The fronts let Python run at a few points: the driver-function lookup (a ``__getattr__`` hook, and
``pointer_of`` for a function not seen before: Python code, and a hash of the function), and on 3.10
and 3.11 any allocation of a tracked object, through a cyclic collection (gc callbacks, finalizers).
That Python may call the front again or change what it has read.  Each case runs in a child, since
the failure is a crash; a gc callback acts only where the front is known to be under way, and on
< 3.12 the child asserts that it did act there (on 3.12+ a collection waits for the eval loop: it can
land in the lookup's Python code, never in the front's own allocations).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from subproc import run_python

import cuproc
from cuproc import Stream
from cuproc import device_memory as dm

ROOT = Path(__file__).resolve().parent.parent
FAST = cuproc.fastpath.active()
needs_front = pytest.mark.skipif(not FAST, reason="the C fronts exist only with the compiled fast path")

# The child's start: this checkout's cuproc on the fake driver, a stream, and the fronts warm (each has
# looked up and remembered the driver's own function).
PRELUDE = """
import gc, sys, types
sys.path[:0] = [{root!r}, {tests!r}]
from pathlib import Path
import cuproc
from cuproc import DeviceBuffer, fastpath
from cuproc.device_memory import alloc_async
from fakedriver import FakeDriver
fk = FakeDriver(Path({lib!r}))
cuproc.set_default_driver(cuproc.Driver(library={lib!r}))
pc = cuproc.use_device(0)
s = cuproc.Stream()
ctx, drv = s.context, s.context.driver
alloc_async(64, s).free_async()
assert alloc_async.taken == DeviceBuffer.free_async.taken == 1, "the fronts did not take the warm-up"
# pointer_of allocates tracked objects (more than a threshold of 1), so that a collection can land in it
# (its own code need not: functools.partial's call, which it was, did)
own_pointer = fastpath.pointer
def allocating_pointer(function):
    [[function] for _ in range(4)]
    return own_pointer(function)
fastpath.pointer = allocating_pointer
# the fronts' pointer_of: fastpath.pointer_reader's function, and what it calls
LOOKUP = {{fastpath.pointer_reader("").__code__, fastpath.pointer_value.__code__, allocating_pointer.__code__,
          own_pointer.__code__}}
state = {{"armed": False, "in_call": False, "acted": 0}}

def collecting(condition, action):
    # a gc callback running action() at the first collection where condition(its frame) holds
    def callback(phase, info):
        if phase == "start" and state["armed"] and condition(sys._getframe(1)):
            state["armed"] = False
            state["acted"] += 1
            action()
    return callback

def call_inside_collections(callback, call):
    # call() with a collection at (almost) every allocation, callback armed only meanwhile
    gc.collect()
    gc.callbacks.append(callback)
    gc.set_threshold(1)
    state["armed"] = state["in_call"] = True
    try:
        return call()
    finally:
        state["armed"] = state["in_call"] = False
        gc.set_threshold(700, 10, 10)
        gc.callbacks.remove(callback)

def in_lookup(frame):
    # pointer_of's Python code, or on 3.10/3.11 the C around it (call()'s lambda is the innermost frame
    # while the front runs; nothing else there allocates before pointer_of)
    return frame.f_code in LOOKUP or (sys.version_info < (3, 12) and state["in_call"]
                                      and frame.f_code.co_name == "<lambda>")
"""


def child(fake, body: str) -> list[str]:
    code = PRELUDE.format(root=str(ROOT), tests=str(ROOT / "tests"), lib=str(fake.path)) + body
    return run_python(code).stdout.split()


@needs_front
@pytest.mark.parametrize("front", ["alloc_async", "free_async"])
@pytest.mark.parametrize("how", ["a gc callback", "the stand-in's hash"])
def test_a_call_of_the_front_inside_its_function_lookup_releases_the_function_it_replaced_once(fake, front, how):
    """A stand-in replaces the driver's function on the handle; the front's lookup of it runs Python
    (pointer_of), which calls the same front again: that inner call replaces the remembered function
    first.  The outer call released the function it had seen before the Python ran a second time (a
    use after free: the old code crashed on both 3.11 and 3.12) and leaked the inner call's reference."""
    name = "cuMemAllocAsync" if front == "alloc_async" else "cuMemFreeAsync"
    out = child(fake, f"""
bufs = [alloc_async(64, s) for _ in range(2)]
if {front!r} == "alloc_async":
    outer, inner = (lambda: alloc_async(64, s)), (lambda: bufs.append(alloc_async(64, s)))
else:
    outer, inner = bufs[0].free_async, bufs[1].free_async
real = vars(drv)[{name!r}]                    # remembered by the front; held here and by stand_in
inner_ran = []
class StandIn:
    # a Python stand-in for the driver's function: the fronts leave calls through it to Python
    def __call__(self, *args):
        return real(*args)
    def __hash__(self):                       # taken by pointer_of (fastpath.pointer)
        if {how!r} == "the stand-in's hash" and not inner_ran:
            inner_ran.append(1)
            inner()
        return 1
stand_in = StandIn()
vars(drv)[{name!r}] = stand_in
refs = sys.getrefcount(real), sys.getrefcount(stand_in)
if {how!r} == "a gc callback":
    def act():
        inner_ran.append(1)
        inner()
    call_inside_collections(collecting(in_lookup, act), lambda: outer())
else:
    outer()
assert inner_ran or {how!r} == "a gc callback", "the stand-in's hash did not run"
assert (sys.getrefcount(real), sys.getrefcount(stand_in)) == (refs[0] - 1, refs[1] + 1), \\
    (refs, sys.getrefcount(real), sys.getrefcount(stand_in))
vars(drv)[{name!r}] = real                    # the driver's own function again: the fronts take it
before = alloc_async.taken, DeviceBuffer.free_async.taken
for b in bufs:
    b.free_async()
alloc_async(64, s).free_async()
assert alloc_async.taken == before[0] + 1 and DeviceBuffer.free_async.taken >= before[1] + 1
del bufs, b
s.close()
gc.collect()
print("ran" if inner_ran else "not-ran", fk.pool_used(0), fk.live("async_alloc"), fk.stale_count())
""")
    assert out[1:] == ["0", "0", "0"]
    assert out[0] == "ran"   # the inner call ran inside the outer one's lookup: the case is exercised


# The end of a child that freed everything it made: nothing left in the pool, the table or the fake driver.
FINISH = """
for b in keep:
    b.free_async()
assert fk.pool_used(0) == 0 and not ctx.stream_ordered
del buf, keep, b
s.close()
gc.collect()
print("fired" if fired else "not-fired", fk.live("async_alloc"), fk.stale_count())
"""


def assert_clean_and_fired(out: list[str]) -> None:
    """Nothing live or stale in the fake driver; before 3.12, the callback ran inside the front (the case
    is exercised: 3.12 runs no collection on an allocation)."""
    assert out[1:] == ["0", "0"]
    if sys.version_info < (3, 12):
        assert out[0] == "fired"


@needs_front
@pytest.mark.parametrize("change", ["a new table", "no table"])
def test_a_collection_while_the_alloc_front_builds_the_buffer_sees_the_table_replaced(fake, change):
    """After the driver call the front allocates the buffer, its weak reference and its entry; on
    3.10/3.11 a collection there runs Python, here a gc callback that replaces the context's table (the
    old one freed: a front that read it before would write into freed memory and lose the entry).  The
    entry goes to the new table; with no table the memory is given back and the call raises."""
    out = child(fake, f"""
keep = [alloc_async(64, s) for _ in range(3)]   # entries the old table hands over
t0, n0 = alloc_async.taken, len(ctx.stream_ordered)
def building(frame):                            # the driver call made, the entry not yet stored
    return alloc_async.taken == t0 + 1 and len(ctx.stream_ordered) == n0
saved = []
def replace():
    saved.append(dict(ctx.stream_ordered))
    ctx.stream_ordered = saved[0] if {change!r} == "a new table" else None
try:
    buf = call_inside_collections(collecting(building, replace), lambda: alloc_async(64, s))
except RuntimeError:
    buf = None
fired = state["acted"] == 1
if fired:
    ctx.stream_ordered = saved[0]
    if {change!r} == "a new table":
        assert buf.claim_key in ctx.stream_ordered and fk.pool_used(0) == 64 * 4
    else:
        assert buf is None and fk.pool_used(0) == 64 * 3   # given back
if buf is not None:
    buf.free_async()
""" + FINISH)
    assert_clean_and_fired(out)


@needs_front
def test_a_collection_inside_the_free_fronts_lookup_that_replaces_the_table_is_seen_by_its_claim(fake):
    """The free front's lookup of a function it has not seen (here a fresh bound method of the driver's
    own pointer: pointer_of runs, then the C call) runs Python; a gc callback there replaces the
    context's table (the old one freed).  The claim reads the table after the lookup: the entry leaves
    the table in use and the memory is freed exactly once (a front that read it before would claim in
    freed memory, and the entry left in the new table would be freed a second time)."""
    out = child(fake, """
keep = [alloc_async(64, s) for _ in range(3)]
buf = alloc_async(64, s)
real = vars(drv)["cuMemFreeAsync"]
vars(drv)["cuMemFreeAsync"] = types.MethodType(real.__func__, real.__self__)   # another object, same pointer
t0 = DeviceBuffer.free_async.taken
def replace():
    ctx.stream_ordered = dict(ctx.stream_ordered)
call_inside_collections(collecting(in_lookup, replace), lambda: buf.free_async())
fired = state["acted"] == 1
assert buf.ended == "freed" and buf.claim_key not in ctx.stream_ordered and fk.pool_used(0) == 64 * 3
assert DeviceBuffer.free_async.taken == t0 + 1   # the front's own claim
""" + FINISH)
    assert_clean_and_fired(out)


@needs_front
def test_a_call_inside_the_lookup_leaves_nothing_remembered_for_the_function_the_outer_call_found(fake):
    """The outer call finds the function through the handle's __getattr__ (not in its dict: nothing to
    remember on 3.12), which publishes a stand-in in the dict; a collection in pointer_of calls the front
    again, which finds the stand-in in the dict and remembers the dict for it.  The outer call then
    stores its own function: what the inner call remembered must go, or the next call on this handle
    takes the outer call's pointer for the dict's stand-in (on 3.12, where the fronts remember)."""
    out = child(fake, """
class Publishing(type(drv)):
    def __getattr__(self, name):
        hook = self.__dict__.get("hook")
        if hook is not None and name == "cuMemAllocAsync":
            self.__dict__["hook"] = None
            return hook()
        return super().__getattr__(name)
drv.__class__ = Publishing
real = vars(drv)["cuMemAllocAsync"]
calls, inner = [], []
def stand_in(*args):
    calls.append(args[1])
    return real(*args)
def hook():          # publish the stand-in; hand this lookup the driver's own pointer (another object)
    vars(drv)["cuMemAllocAsync"] = stand_in
    return types.MethodType(real.__func__, real.__self__)
del vars(drv)["cuMemAllocAsync"]
drv.hook = hook
t0 = alloc_async.taken
def in_pointer_of(frame):                     # the hook has run: what is left of the lookup is pointer_of
    return vars(drv)["hook"] is None and in_lookup(frame)
outer = call_inside_collections(collecting(in_pointer_of, lambda: inner.append(alloc_async(64, s))),
                                lambda: alloc_async(128, s))
ran = bool(inner)
assert vars(drv)["cuMemAllocAsync"] is stand_in and alloc_async.taken == t0 + 1   # the outer one's pointer
assert calls == ([64] if ran else [])
later = alloc_async(32, s)                    # the dict's stand-in: called
assert calls[-1] == 32 and alloc_async.taken == t0 + 1, (calls, alloc_async.taken - t0)
vars(drv)["cuMemAllocAsync"] = real
for b in [outer, later] + inner:
    b.free_async()
del outer, later, inner, b
s.close()
gc.collect()
print("ran" if ran else "not-ran", fk.pool_used(0), fk.live("async_alloc"), fk.stale_count())
""")
    assert out == ["ran", "0", "0", "0"]   # (the inner call ran inside pointer_of: the case is exercised)


class _BareStream:
    """A class with a Stream's context and handle slots but not a Resource's driver and ended."""

    __slots__ = ("context", "handle")


class _BareContext:
    """A class with a Context's table slot but not a Resource's driver and ended."""

    __slots__ = ("stream_ordered",)


@needs_front
def test_make_stream_ordered_refuses_a_class_without_the_slots_it_reads():
    """The front reads ``ended`` from Streams and Contexts and ``driver`` from Contexts at the offsets of
    DeviceBuffer's descriptors: a Stream or Context class that lacks them is refused at construction
    (the old code checked them against DeviceBuffer only, so the reads fell outside smaller objects)."""
    make = cuproc.fastpath.stream_ordered_factory()
    ffi = cuproc.ffi

    def build(stream_type, context_type, slots):
        return make(dm._python_alloc_async, dm._c_alloc_failed, lambda f: None, dm.DeviceBuffer.free_async,
                    dm._c_free_failed, lambda f: None, cuproc._resource.Resource.__del__, stream_type,
                    dm.DeviceBuffer, context_type, ffi.typeof("CUstream"), cuproc._resource.FORKED,
                    cuproc.allocation.EXPORTS, "freed", slots)

    assert len(build(Stream, cuproc.Context, dm._slots)) == 3        # cuproc's own classes: accepted
    bare = dm._slots[:9] + (_BareStream.context, _BareStream.handle) + dm._slots[11:]
    with pytest.raises(ValueError):
        build(_BareStream, cuproc.Context, bare)
    bare = dm._slots[:8] + (_BareContext.stream_ordered,) + dm._slots[9:]
    with pytest.raises(ValueError):
        build(Stream, _BareContext, bare)


@needs_front
def test_a_finalizer_run_by_the_release_calls_the_front_on_another_handle_and_each_call_keeps_its_pointer(fake):
    """Releasing the function the front replaced runs its finalizer, which calls the front on another
    Driver handle's stream (replacing what the front keeps).  The outer call still calls the pointer
    it looked up for its own handle, and the next call on the first handle looks its function up
    again instead of calling the other handle's (the release comes last, and each call returns its
    own address; 3.12 also keeps no stale memo)."""
    out = child(fake, """
ffi = cuproc.ffi
real = fastpath.pointer(vars(drv)["cuMemAllocAsync"])
seen = []

def recording(tag):        # the driver's own function, as a distinct pointer whose calls are seen
    def call(out, n, h):
        seen.append(tag)
        return real(out, n, h)
    return ffi.callback(ffi.typeof(real), call)
first, second = recording("first"), recording("second")
drv2 = cuproc.Driver(library=drv.library.path)
cuproc.set_default_driver(drv2)
pc2 = cuproc.use_device(0)
s2 = cuproc.Stream()
cuproc.set_default_driver(drv)
inner = []

class StandIn:             # not a driver pointer: the front calls it through Python
    def __call__(self, *args):
        return real(*args)

    def __del__(self):     # run by the outer call's release of it: the front again, on drv2
        vars(drv2)["cuMemAllocAsync"] = second
        inner.append(alloc_async(64, s2))
vars(drv)["cuMemAllocAsync"] = StandIn()
kept = alloc_async(64, s)  # the front keeps the stand-in: the last reference once replaced
vars(drv)["cuMemAllocAsync"] = first
taken = alloc_async.taken
outer = alloc_async(64, s)
outer_calls = list(seen)
seen.clear()
after = alloc_async(64, s)
assert alloc_async.taken == taken + 3, "the front did not take all three calls"
for b in (kept, outer, after, *inner):
    b.free_async()
print(len(inner), ",".join(outer_calls), ",".join(seen))
""")
    assert out == ["1", "second,first", "first"]   # inner on drv2, then the outer's own; then drv's again
