"""The one-shot launch's warm path (issue 9): with the fast path, ``Function.launch`` is a C front
(src/fastpath/fastpath_launch.c, make_one_shot) that takes warm entries of the common form itself; every
other call goes to the Python launch.  These tests check that it takes what it should, hands on
what it should not, keeps every refusal of the Python launch, and that launch_ex / cooperative
refusals name the call actually made; that grid, block and shared memory come with each launch (one
entry per key, nothing compiled for a new grid, bad dimensions refused naming the entry), and that
the entries stay bounded without being dropped all at once.  All on the fake driver; the pure path
is run as well.
(Warm one-shot entries in a forked child: tests/test_ownership.py, the fork test.)"""
from __future__ import annotations

import gc

import inspect
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fakedriver import fake_image
from subproc import run_python

import cuproc
import cuproc.launch as L
from cuproc import DeviceBuffer, Function, Module, Stream, fastpath
from cuproc.errors import ClosedResourceError, InvalidValueError

ROOT = Path(__file__).resolve().parent.parent
IMAGE = fake_image({"empty": [8, 4, 4]})
SIG = ["float*", "int", "float"]
FRONT = fastpath.active()
needs_front = pytest.mark.skipif(not FRONT, reason="the C front exists only with the compiled fast path")


def taken() -> int:
    return L.launch.taken  # type: ignore[attr-defined] - the C front's counter


def test_function_launch_is_the_module_launch_with_its_signature():
    assert Function.launch is L.launch
    params = list(inspect.signature(L.launch).parameters)
    assert params[:4] == ["function", "grid", "block", "args"] and "signature" in params
    assert "Launch once" in (L.launch.__doc__ or "")


@needs_front
def test_warm_common_forms_are_launched_by_the_front_with_their_values(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    fn.launch(1, 32, (buf, np.int32(0), np.float32(0)))              # cold: the Python launch makes the entry
    fn.launch(1, 32, (buf, 0, 0.0), signature=SIG)
    fn.launch(1, 32, (buf, 0, 0.0), signature=tuple(SIG))              # the same key as the list's
    before = taken()
    for i in range(1, 4):
        fn.launch(1, 32, (buf, np.int32(i), np.float32(i / 4)))
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, i / 4)
        fn.launch(1, 32, (buf.ptr, -i, 2.0 * i), signature=SIG)
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, -i, 2.0 * i)
        fn.launch(1, 32, (buf, i, 1.5), signature=tuple(SIG))
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, 1.5)
        L.launch(fn, 1, 32, (buf, np.int32(9), np.float32(1)))       # the module function is the front too
    assert taken() - before == 12 and len(fn.launch_cache) == 2
    assert fk.launch_count() == 15


@needs_front
@pytest.mark.parametrize("form", ["stream handle", "tuple grid", "numpy grid", "shared_mem", "entry", "convention",
                                  "list args", "signature None"])
def test_other_forms_go_to_the_python_launch_and_launch_right(fk, pc, form):
    """Grid, block and shared memory are not part of the key: the front takes any of them once warm and
    the launcher checks them; the other forms go to the Python launch."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    s = Stream()
    call = {"stream handle": lambda v, g: fn.launch(g, 32, v, stream=s.handle),
            "tuple grid": lambda v, g: fn.launch((g, 2), 32, v),
            "numpy grid": lambda v, g: fn.launch(np.int64(g), 32, v),
            "shared_mem": lambda v, g: fn.launch(g, 32, v, shared_mem=8 * g),
            "entry": lambda v, g: fn.launch(g, 32, v, entry="cuLaunchKernel"),
            "convention": lambda v, g: fn.launch(g, 32, v, convention="params"),
            "list args": lambda v, g: fn.launch(g, 32, list(v)),
            "signature None": lambda v, g: fn.launch(g, 32, v, signature=None)}[form]
    for i in range(3):
        before = taken()
        call((buf, np.int32(i), np.float32(i)), i + 1)
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, i)
        assert fk.last_launch_config()[:2] == ((i + 1, 2 if form == "tuple grid" else 1, 1), (32, 1, 1))
        if form in ("signature None", "tuple grid", "numpy grid", "shared_mem") and i:   # the front's, once warm
            assert taken() == before + 1
        else:
            assert taken() == before
    assert fk.launch_count() == 3


@needs_front
def test_warm_launches_on_a_stream_are_taken_for_that_very_stream(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    s1, s2 = Stream(), Stream()
    for s in (s1, s2, None):
        fn.launch(1, 32, (buf, np.int32(0), np.float32(0)), stream=s)      # cold: one entry per stream
        fn.launch(1, 32, (buf, 0, 0.0), signature=SIG, stream=s)
    assert len(fn.launch_cache) == 6
    before = taken()
    for i, s in enumerate((s1, s2, None, s2, s1)):
        fn.launch(1, 32, (buf, np.int32(i), np.float32(i)), stream=s)
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, i)
        fn.launch(1, 32, (buf, i, 0.5), stream=s, signature=SIG)           # keywords in either order
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, 0.5)
    assert taken() - before == 10 and len(fn.launch_cache) == 6
    key = next(k for k in fn.launch_cache if k[1] == ("stream", id(s1)) and k[0] != tuple(SIG))
    s3 = Stream()
    fn.launch_cache[key[:1] + (("stream", id(s3)),) + key[2:]] = fn.launch_cache[key]   # s1's entry at s3's id
    fn.launch(1, 32, (buf, np.int32(7), np.float32(7)), stream=s3)                       # not taken: its own entry
    assert taken() - before == 10 and fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 7, 7.0)
    s1.close()
    with pytest.raises(ClosedResourceError):
        fn.launch(1, 32, (buf, np.int32(1), np.float32(1)), stream=s1)
    assert taken() - before == 10


def _handle(stream: Stream | None) -> int:
    """The stream handle a launch on ``stream`` passes: None is the legacy default stream, CU_STREAM_LEGACY (0x1)."""
    return 1 if stream is None else int(cuproc.ffi.cast("uintptr_t", stream.handle))


@needs_front
def test_the_last_hit_is_taken_only_for_a_call_with_an_equal_key(fk, pc):
    """The front takes the entry it last found (``function.launch_last``) without building the key,
    so each part of the key must still select the launch: stream, the values' classes, and the
    signature's entries (read again on every call: a list can change in place); grid and block are not
    part of it, and each call launches with its own."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    s1, s2 = Stream(), Stream()
    sig = list(SIG)
    int_sig = ["float*", "int", "int"]
    calls = [  # (grid, block, stream, values, signature, packed format)
        (1, 32, None, (buf, np.int32(3), np.float32(1)), None, "<Qif"),
        (2, 32, None, (buf, np.int32(3), np.float32(1)), None, "<Qif"),
        (2, 64, None, (buf, np.int32(3), np.float32(1)), None, "<Qif"),
        (2, 64, s1, (buf, np.int32(3), np.float32(1)), None, "<Qif"),
        (2, 64, s2, (buf, np.int32(3), np.float32(1)), None, "<Qif"),
        (2, 64, s2, (buf, np.int32(3), np.int32(1)), None, "<Qii"),
        (2, 64, s2, (buf, 3, 1), sig, "<Qif"),
        (2, 64, s2, (buf, 3, 1), int_sig, "<Qii"),
        (2, 64, None, (buf, 3, 1), int_sig, "<Qii"),
    ]
    for grid, block, stream, values, signature, _ in calls:                   # cold: every entry made
        fn.launch(grid, block, values, signature=signature, stream=stream)
    keys = len({(tuple(signature or map(type, values)), id(stream)) for _, _, stream, values, signature, _ in calls})
    assert len(fn.launch_cache) == keys == len(calls) - 2        # the first three differ in grid or block only
    before = taken()
    for _ in range(2):   # each call differs from the one before it in one part of the key, or in its dims
        for grid, block, stream, values, signature, fmt in calls:
            fn.launch(grid, block, values, signature=signature, stream=stream)
            assert fk.last_launch()[1] == struct.pack(fmt, buf.ptr, 3, 1)
            assert fk.last_launch_config() == ((grid, 1, 1), (block, 1, 1), _handle(stream))
    assert taken() - before == 2 * len(calls) and len(fn.launch_cache) == keys
    for grid, block, stream, values, signature, fmt in calls:   # each key again and again: the record's hits
        fn.launch(grid, block, values, signature=signature, stream=stream)
        record = fn.launch_last
        for _ in range(3):
            fn.launch(grid, block, values, signature=signature, stream=stream)
            assert fn.launch_last is record and fk.last_launch()[1] == struct.pack(fmt, buf.ptr, 3, 1)
            assert fk.last_launch_config() == ((grid, 1, 1), (block, 1, 1), _handle(stream))
    assert taken() - before == 6 * len(calls)

    fn.launch(1, 32, (buf, 5, 7), signature=sig)                     # warm; now the last hit
    sig[2] = "int"                                                   # the same list, another signature
    fn.launch(1, 32, (buf, 5, 7), signature=sig)
    assert fk.last_launch()[1] == struct.pack("<Qii", buf.ptr, 5, 7)
    sig[2] = "float"
    fn.launch(1, 32, (buf, 6, 7), signature=sig)
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 6, 7)
    last = fn.launch_last
    equal = ["float*", "".join(["i", "nt"]), "".join(["flo", "at"])]      # equal strings, other objects
    fn.launch(1, 32, (buf, 7, 0.5), signature=equal)
    assert fn.launch_last is last and fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 7, 0.5)


@needs_front
def test_a_last_hit_for_another_stream_or_a_malformed_one_is_not_taken(fk, pc):
    """``launch_last`` is an ordinary slot: whatever it holds, a launch goes where its own key says,
    never on the stream of an entry made for another Stream, and never crashes."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    s1, s3 = Stream(), Stream()
    args = (buf, np.int32(1), np.float32(1))
    fn.launch(1, 32, args, stream=s1)
    fn.launch(1, 32, args, stream=s1)
    key, entry = fn.launch_last
    assert key[1] == ("stream", id(s1)) and entry[1]() is s1
    fn.launch_last = (key[:1] + (("stream", id(s3)),) + key[2:], entry)   # s1's entry under s3's key
    fn.launch(1, 32, args, stream=s3)
    assert fk.last_launch_config()[2] == _handle(s3)
    good = fn.launch_last
    for junk in ["junk", (), (1, 2), (key, "entry"), (("classes",) + key[1:], entry), (key[:3], entry),
                 (key + (1,), entry), (key[:2] + ("params", None), entry), (key[:3] + ("cuLaunchKernel",), entry),
                 (key, (entry[0], entry[1], [0, 1])), (key, entry[:2])]:
        fn.launch_last = junk
        fn.launch(1, 32, (buf, np.int32(2), np.float32(2)), stream=s1)
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 2, 2.0)
        assert fk.last_launch_config()[2] == _handle(s1)
    del fn.launch_last                                                    # an unset slot: the dict decides
    fn.launch(1, 32, (buf, np.int32(3), np.float32(3)), stream=s3)
    assert fk.last_launch_config()[2] == _handle(s3) and fn.launch_last is not good
    # s3's launcher under a weak reference to s1, keyed for s3: the key's stream keeps s1 off it
    s3_key, s3_entry = fn.launch_last
    fn.launch_last = (s3_key, (s3_entry[0], entry[1], s3_entry[2]))
    fn.launch(1, 32, (buf, np.int32(4), np.float32(4)), stream=s1)
    assert fk.last_launch_config()[2] == _handle(s1)
    # an entry for a raw stream handle (held: None, as the default stream's) under that handle's key:
    # not taken by a launch on the default stream
    fn.launch(1, 32, args, stream=s3.handle)
    raw_key = next(k for k in fn.launch_cache if isinstance(k[1], int))
    fn.launch_last = (raw_key, fn.launch_cache[raw_key])
    fn.launch(1, 32, (buf, np.int32(5), np.float32(5)))
    assert fk.last_launch_config()[2] == _handle(None)


@needs_front
@pytest.mark.parametrize("how", ["its key dropped", "the user clears it"])
def test_a_record_of_an_entry_the_cache_dropped_does_not_keep_its_key_off_the_front(fk, pc, how):
    """After the record's entry leaves the cache (its key dropped, or the cache cleared, by hand) and a
    resource ends, the key's new entry is taken by the front again, not left to the Python launch for
    good (review finding)."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    args = (buf, np.int32(1), np.float32(1))
    fn.launch(1, 32, args)
    fn.launch(1, 32, args)                                   # the record
    fn.launch(1, 32, (buf, 1, 1.0), signature=SIG)           # another entry, which stays
    if how == "its key dropped":
        del fn.launch_cache[fn.launch_last[0]]
        assert len(fn.launch_cache) == 1
    else:
        fn.launch_cache.clear()
    Stream().close()                                         # EPOCH moves
    fn.launch(1, 32, args)                                   # the Python launch: grid 1's entry again
    before = taken()
    for i in range(20):
        fn.launch(1, 32, (buf, np.int32(i), np.float32(i)))
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, i)
    assert taken() - before == 20 and fn.launch_last[1] is fn.launch_cache[fn.launch_last[0]]


def test_a_collection_inside_the_front_that_clears_the_cache_crashes_nothing(fk):
    """On 3.10 and 3.11 an allocation may run a collection, hence Python code: here, a gc callback
    that clears the function's cache while the front holds what it found there (review finding: a
    use after free).  In a child, since the failure is a crash; on 3.12+ collections wait for the
    eval loop, so the callback cannot run inside the front and the child only launches."""
    code = f"""
import gc, struct, sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
import numpy as np
import cuproc, cuproc.launch as L
from fakedriver import FakeDriver, fake_image
from pathlib import Path
fk = FakeDriver(Path({str(fk.path)!r}))
cuproc.set_default_driver(cuproc.Driver(library={str(fk.path)!r}))
pc = cuproc.use_device(0)
fn = cuproc.Module.load(fake_image({{"empty": [8, 4, 4]}})).get_function("empty")
buf = cuproc.DeviceBuffer(64)
args = (buf, np.int32(1), np.float32(1))
sig = ["float*", "int", "float"]
fn.launch(1, 32, args); fn.launch(1, 32, args)
fn.launch(2, 32, (buf, 1, 1.0), signature=sig); fn.launch(3, 32, (buf, 1, 1.0), signature=sig)
fn.launch(4, 32, (buf, 1, 1.0), signature=sig)  # the record: the signature's; the NumPy values take the dict path
armed, fired = [False], []
def callback(phase, info):
    if armed[0] and phase == "start":
        armed[0] = False
        fired.append(len(fn.launch_cache))
        fn.launch_cache.clear()               # as a user's clear() or another thread's eviction does
gc.collect()
gc.callbacks.append(callback)
gc.disable()
drain = [(i, i) for i in range(5000)]         # no free 2-tuple: the record is a fresh allocation
fill = [(i, i, i) for i in range(100)] + [(i,) * 7 for i in range(100)]
del fill                                      # the key's tuples come from the free lists
gc.set_threshold(1)
armed[0] = True
gc.enable()
fn.launch(1, 32, (buf, np.int32(5), np.float32(5)))
gc.disable()
gc.callbacks.remove(callback)
gc.set_threshold(700, 10, 10)
gc.enable()
assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 5, 5.0)
for i in range(3):
    fn.launch(1, 32, (buf, np.int32(i), np.float32(i)))
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, i)
gc.collect()
print("fired" if fired else "not fired", "front" if hasattr(L.launch, "taken") else "pure")
"""
    out = run_python(code).stdout.split()
    if sys.version_info < (3, 12) and out[1] == "front":
        assert out[0] == "fired"     # the callback ran inside the front: the case is exercised


@needs_front
@pytest.mark.parametrize("entry", [None, "cuLaunchKernel"])
def test_threads_sharing_a_function_launch_with_their_own_grid_and_values(fk, pc, entry):
    """Four threads take turns at one function's entries (one per signature: the grid is no part of the
    key), each with its own grid: fake_grid_pair counts a launch whose values or grid belong to another
    call.  The threads that do not own an entry's block launch with their own block and configuration."""
    from threads import run_threads
    fn = Module.load(fake_image({"fake_grid_pair": [8, 8]})).get_function("fake_grid_pair")
    sig = ["unsigned long long", "unsigned long long"]
    kw = {} if entry is None else {"entry": entry}     # None: the C front; an entry: the Python launch

    def work(k: int) -> int:   # a fresh thread: the launch makes the function's context current
        for i in range(400):
            a = 4 * i + k
            fn.launch(a % 4 + 1, 32, (a, 3 * a + 1), signature=sig, **kw)
            fn.launch(a % 4 + 1, 32, (np.uint64(a), np.uint64(3 * a + 1)), **kw)
        return 800
    assert sum(run_threads(work, 4)) == fk.launch_count() == 3200
    assert fk.launch_mismatches() == 0, fk.records()
    assert len(fn.launch_cache) == 2


@needs_front
def test_a_kernel_of_a_library_goes_to_the_python_launch(fk, pc):
    lib = cuproc.Library(IMAGE)
    kernel = lib.get_kernel("empty")
    assert type(kernel) is not Function
    buf = DeviceBuffer(64)
    before = taken()
    for i in range(3):
        kernel.launch(1, 32, (buf, np.int32(i), np.float32(1)))
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, 1.0)
    assert taken() == before


def test_a_resource_ending_sends_the_next_warm_call_through_the_checks(fk, pc):
    module = Module.load(IMAGE)
    fn = module.get_function("empty")
    buf = DeviceBuffer(64)
    args = (buf, np.int32(1), np.float32(1))
    fn.launch(1, 32, args)
    fn.launch(1, 32, args)
    Stream().close()                        # an unrelated parent ends (EPOCH moves): checked again, passes
    before = taken() if FRONT else 0
    fn.launch(1, 32, args)
    fn.launch(1, 32, args)
    if FRONT:
        assert taken() == before + 1        # the first call after the end went through the Python checks
    module.unload()
    with pytest.raises(ClosedResourceError):
        fn.launch(1, 32, args)
    with pytest.raises(ClosedResourceError):
        fn.launch(1, 32, args)              # still refused: nothing was remembered as checked
    assert fk.launch_count() == 4


def test_warm_entries_keep_the_refusals_of_a_cold_launch(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    fn.launch(1, 32, (buf, np.int32(1), np.float32(1)))
    fn.launch(1, 32, (buf, 1, 1.0), signature=SIG)
    with pytest.raises(InvalidValueError, match="int"):                  # a str for the int parameter
        fn.launch(1, 32, (buf, "x", 1.0), signature=SIG)
    with pytest.raises(InvalidValueError, match="int32_t|int"):            # out of range for int
        fn.launch(1, 32, (buf, 1 << 40, 1.0), signature=SIG)
    with pytest.raises(InvalidValueError):                                # one argument short
        fn.launch(1, 32, (buf, np.int32(1)))
    with pytest.raises(InvalidValueError):                                # a plain int without a signature
        fn.launch(1, 32, (buf, 1, np.float32(1)))
    with pytest.raises(InvalidValueError, match="grid"):
        fn.launch(0, 32, (buf, np.int32(1), np.float32(1)))
    other = DeviceBuffer(64)
    other.free()
    with pytest.raises(ClosedResourceError):                              # a freed buffer as the pointer
        fn.launch(1, 32, (other, np.int32(1), np.float32(1)))
    fn2 = Module.load(IMAGE).get_function("empty")                       # a new kernel: its own entries
    fn2.launch(1, 32, (buf, np.int32(2), np.float32(2)))
    assert len(fn2.launch_cache) == 1 and fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 2, 2.0)
    assert fk.launch_count() == 3


def test_arguments_given_as_another_iterable_are_read_once_and_a_non_iterable_is_refused(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    for i in range(2):
        fn.launch(1, 32, (v for v in (buf, np.int32(i), np.float32(i))))     # a generator, cold then warm
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, i)
        fn.launch(1, 32, iter([buf, i, 0.5]), signature=SIG)
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, 0.5)
    with pytest.raises(InvalidValueError, match="sequence of kernel arguments"):
        fn.launch(1, 32, 7)
    assert fk.launch_count() == 4


class _KeyRaisingType(str):
    """A C type string whose hash raises a LookupError: the cache lookup fails, the launch must not."""

    def __hash__(self) -> int:
        raise KeyError("no hash for this signature entry")


def test_a_signature_entry_whose_hash_raises_a_lookup_error_takes_the_general_path(fk, pc):
    """The Python launch treats a LookupError from the cache lookup as "no key" (general path); the C
    front must hand such a call on, not raise the lookup's error (review finding 9)."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    fn.launch(1, 32, (buf, 0, 0.0), signature=SIG)                    # a warm cache: the front looks it up
    odd = ["float*", _KeyRaisingType("int"), "float"]
    for i in range(1, 3):
        L._python_launch(fn, 1, 32, (buf, i, 0.5), signature=odd)      # the reference: launches
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, 0.5)
        fn.launch(1, 32, (buf, -i, 1.5), signature=odd)                # the front (fast path) agrees
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, -i, 1.5)
    assert fk.launch_count() == 5 and len(fn.launch_cache) == 1        # nothing stored under such a key


def test_launch_ex_and_cooperative_refusals_name_the_call_made(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    args = (buf, np.int32(1), np.float32(1))
    cases = [(lambda: L.launch_ex(fn, 0, 32, args), "cuLaunchKernelEx"),
             (lambda: L.launch_ex(fn, 1, (32, 0), args), "cuLaunchKernelEx"),
             (lambda: L.launch_ex(fn, 1, 32, args, shared_mem=-1), "cuLaunchKernelEx"),
             (lambda: L.launch_ex(fn, 1, 32, args, cluster=(0, 1)), "cuLaunchKernelEx"),
             (lambda: fn.launch(1.5, 32, args, cooperative=True), "cuLaunchCooperativeKernel"),
             (lambda: fn.launch(1, True, args, cooperative=True), "cuLaunchCooperativeKernel"),
             (lambda: fn.launch(1, 32, args, cooperative=True, shared_mem=-4), "cuLaunchCooperativeKernel"),
             (lambda: fn.prepare(SIG, 0, 32, entry="cuLaunchKernel"), "cuLaunchKernel"),
             (lambda: fn.prepare(SIG, 1, 32, entry="cuLaunchKernelEx", shared_mem=-1), "cuLaunchKernelEx")]
    for attempt, call in cases:
        with pytest.raises(InvalidValueError) as info:
            attempt()
        assert info.value.call == call and info.value.refused
    assert fk.launch_count() == 0


@pytest.mark.parametrize("entry", [None, "cuLaunchKernel", "cuLaunchKernelEx"])
def test_one_shot_and_prepared_refusals_name_the_entry_the_launch_makes(fk, pc, entry):
    """Argument, signature, shape and freed-buffer refusals name the driver call the launch would have made:
    the entry it records (cuLaunchKernelEx by default where the driver has it), never another."""
    fn = Module.load(IMAGE).get_function("empty")
    buf, gone = DeviceBuffer(64), DeviceBuffer(64)
    view = gone.view(np.float32)
    gone.free()

    class BadStream:                                    # another library's stream that answers wrongly
        def __cuda_stream__(self):
            return (0, "not a handle")
    fn.launch(1, 32, (buf, 1, 1.0), signature=SIG, entry=entry)             # a warm entry for the same key
    made = next(iter(fn.launch_cache.values()))[0].entry
    assert made == (entry or "cuLaunchKernelEx")
    run = fn.prepare(SIG, 1, 32, entry=entry)
    assert run.entry == made
    cases = [lambda: fn.launch(1, 32, (buf, "x", 1.0), signature=SIG, entry=entry),     # a value (warm entry)
             lambda: fn.launch(1, 32, (buf, 2**40, 1.0), signature=SIG, entry=entry),   # out of range
             lambda: fn.launch(1, 32, (gone, 1, 1.0), signature=SIG, entry=entry),      # a freed buffer
             lambda: fn.launch(1.5, 32, (buf, 1, 1.0), signature=SIG, entry=entry),     # a float grid
             lambda: fn.launch(1, 32, (buf, 1, 1.0), signature=["float*", "int", "floaty"], entry=entry),
             lambda: fn.launch(1, 32, (buf, 1), signature=["float*", "int"], entry=entry),   # the count
             lambda: fn.launch(1, 32, (buf, 1, 1.0), entry=entry),                    # a plain int, no signature
             lambda: fn.launch(1, 32, (gone, np.int32(1), np.float32(1)), entry=entry),  # inferred, freed
             lambda: fn.launch(1, 32, 7, entry=entry),                                # no sequence
             lambda: fn.launch(1, 32, (view, 1, 1.0), signature=SIG, entry=entry),    # a view of freed memory
             lambda: fn.launch(1, 32, (view, np.int32(1), np.float32(1)), entry=entry),
             lambda: fn.launch(np.int32(0), 32, (buf, 1, 1.0), signature=SIG, entry=entry),  # NumPy dims
             lambda: fn.launch(1, 32, (buf, 1, 1.0), signature=SIG, entry=entry, stream=BadStream()),
             lambda: run(buf, "x", 1.0), lambda: run(gone, 1, 1.0), lambda: run(view, 1, 1.0),
             lambda: fn.prepare(SIG, 1, 32, entry=entry, convention="neither")]
    for i, attempt in enumerate(cases):
        with pytest.raises(InvalidValueError) as info:
            attempt()
        assert (i, info.value.call, info.value.refused) == (i, made, True)
    with pytest.raises(ClosedResourceError):
        run(gone, 1, 1.0)
    class Grid:                                         # a grid object whose own driver call failed
        def __iter__(self):
            raise InvalidValueError(1, "cuDeviceGetAttribute")
    with pytest.raises(InvalidValueError) as info:
        fn.launch(Grid(), 32, (buf, 1, 1.0), signature=SIG, entry=entry)
    assert info.value.call == "cuDeviceGetAttribute" and not info.value.refused    # as it came, not renamed
    closed = Stream()
    closed.close()
    with pytest.raises(InvalidValueError) as info:    # refused as no kernel argument, not as a closed stream
        fn.launch(1, 32, (closed, np.int32(1), np.float32(1)), entry=entry)
    assert type(info.value) is InvalidValueError and info.value.call == made
    assert fk.launch_count() == 1


def _three(dims) -> tuple[int, int, int]:
    dims = tuple(int(d) for d in dims) if isinstance(dims, tuple) else (int(dims),)
    return dims + (1,) * (3 - len(dims))


def check_varying_dims(fk, entry: str | None) -> None:
    """A one-shot launch whose grid, block and shared memory change from launch to launch (also run in a
    pure-Python process, below): each launch gets its own dimensions from the one entry of its key; no
    launcher is made (compile() is not even asked); with the fast path the C launcher takes exact ints
    and tuples itself; bad dimensions are refused naming the entry, launch nothing and leave no stale
    dimension behind (the pure launcher stores only what changed since its last launch)."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    kw = {} if entry is None else {"entry": entry}   # None: the C front where there is one
    fn.launch(1, 32, (buf, np.int32(0), np.float32(0)), **kw)
    fn.launch(1, 32, (buf, 0, 0.0), signature=SIG, **kw)
    entries = dict(fn.launch_cache)
    made = L._compiled_source.cache_info()
    launchers = [e[0] for e in entries.values()]
    fallbacks = [getattr(f, "fallbacks", None) for f in launchers]   # the C launchers' (fast path)
    made_entry = launchers[0].entry
    assert made_entry == (entry or L.default_entry(fn.driver)) and len(entries) == 2
    count = fk.launch_count()

    def launch_both(grid, block, shared, i) -> None:
        fn.launch(grid, block, (buf, np.int32(i), np.float32(1)), shared_mem=shared, **kw)
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, 1.0)
        assert fk.last_launch_config()[:2] == (_three(grid), _three(block)) and fk.last_shared_mem() == shared
        fn.launch(grid, block, (buf, -i, 2.0), signature=SIG, shared_mem=shared, **kw)
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, -i, 2.0)
        assert fk.last_launch_config()[:2] == (_three(grid), _three(block)) and fk.last_shared_mem() == shared

    calls = [(5, 32, 0), ((5, 3), 32, 0), (5, 32, 0), (7, (8, 4), 16), (7, 32, 0), (7, 32, 16), (7, 64, 16),
             ((1, 2, 3), (4, 5, 6), 8), (1, 4, 0), (2**32 - 1, 1, 2**32 - 1), (1, 1, 0)]
    calls += [(g, 128, 0) for g in range(1, 1001, 7)]       # grid = ceil(n / block) for a new n each time
    for i, (grid, block, shared) in enumerate(calls):
        launch_both(grid, block, shared, i)
    assert fk.launch_count() - count == 2 * len(calls)
    assert list(fn.launch_cache) == list(entries) and all(fn.launch_cache[k] is e for k, e in entries.items())
    assert L._compiled_source.cache_info() == made           # no launcher made, nothing compiled
    assert [getattr(f, "fallbacks", None) for f in launchers] == fallbacks   # all taken by the C launchers
    launch_both(np.int64(3), np.int32(64), np.uint16(4), 1)  # NumPy integers: the pure launcher's
    launch_both((np.int64(3), 2), 64, 0, 2)

    bad_dims = [{"grid": 0}, {"grid": -1}, {"grid": 2**32}, {"grid": 1.5}, {"grid": 2.0}, {"grid": True},
                {"grid": (1, 0)}, {"grid": (2, 1, 1, 1)}, {"grid": ()}, {"grid": "x"}, {"grid": None},
                {"block": 0}, {"block": (32, 2**32)}, {"block": np.float32(32)}, {"block": 32.0},
                {"shared_mem": -1}, {"shared_mem": 2**32}, {"shared_mem": 1.0}, {"shared_mem": True},
                {"shared_mem": None}]
    for i, bad in enumerate(bad_dims):
        launch_both(2, 32, 1, i)                               # what the config holds before the refusal
        count = fk.launch_count()
        dims = {"grid": 2, "block": 32, "shared_mem": 1, **bad}
        for values, signature in (((buf, np.int32(1), np.float32(1)), None), ((buf, 1, 1.0), SIG)):
            with pytest.raises(InvalidValueError) as info:
                fn.launch(dims["grid"], dims["block"], values, signature=signature, shared_mem=dims["shared_mem"],
                          **kw)
            assert (bad, info.value.call, info.value.refused) == (bad, made_entry, True)
        assert fk.launch_count() == count
        launch_both(2, 32, 1, i)                               # the same again: nothing stale in between
        launch_both(3, (32, 2), 0, i)
    assert L._compiled_source.cache_info() == made and len(fn.launch_cache) == 2


def check_rebind_with_the_calls_dims(fk, entry: str | None) -> None:
    """A one-shot launch refused for want of its context is made again with that context pushed and
    with its own call's dimensions (cuLaunchKernel: passed again; cuLaunchKernelEx: in the config),
    and a driver error is raised, from the C launcher and the pure one alike."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    kw = {} if entry is None else {"entry": entry}
    fn.launch(1, 32, (buf, np.int32(0), np.float32(0)), **kw)
    made_entry = next(iter(fn.launch_cache.values()))[0].entry
    fk.fail(made_entry, 2)                                     # CUDA_ERROR_OUT_OF_MEMORY once
    with pytest.raises(cuproc.OutOfMemoryError):
        fn.launch(3, 64, (buf, np.int32(1), np.float32(1)), shared_mem=4, **kw)
    count = fk.launch_count()
    # The binding errors counted must be the launch's own: a collection while no context is current would
    # run finalizers of earlier garbage (a buffer's cuMemFree, a module's unload), each refused once too
    # (seen on the GPU host, whose GPU tests before this one moved the collector's timing).
    gc.collect()
    gc.disable()
    try:
        for i, (grid, block, shared) in enumerate([(5, 32, 8), ((2, 3), (4, 4), 0), (7, 16, 0),
                                                   (np.int64(9), 8, 2)]):
            fn.driver.cuCtxSetCurrent(cuproc.ffi.NULL)         # no context current: the launch rebinds
            errors = fk.binding_errors()
            fn.launch(grid, block, (buf, np.int32(i), np.float32(1)), shared_mem=shared, **kw)
            assert fk.binding_errors() == errors + 1, fk.binding_calls()   # refused once, then made in its context
            assert fk.last_launch_config()[:2] == (_three(grid), _three(block)) and fk.last_shared_mem() == shared
            assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, 1.0)
    finally:
        gc.enable()
        fn.driver.cuCtxSetCurrent(fn.context.handle)           # current again, as it was
    assert fk.launch_count() == count + 4


@pytest.mark.parametrize("entry", [None, "cuLaunchKernel", "cuLaunchKernelEx"])
def test_a_grid_changing_with_every_launch_launches_from_one_entry_with_its_own_dims(fk, pc, entry):
    check_varying_dims(fk, entry)
    check_rebind_with_the_calls_dims(fk, entry)


def test_a_grid_changing_with_every_launch_on_the_pure_path_too(fk):
    code = f"""
import sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
from pathlib import Path
import cuproc
from fakedriver import FakeDriver
from test_launch_one_shot import check_rebind_with_the_calls_dims, check_varying_dims
assert not cuproc.fastpath.active()
fk = FakeDriver(Path({str(fk.path)!r}))
cuproc.set_default_driver(cuproc.Driver(library={str(fk.path)!r}))
pc = cuproc.use_device(0)
for entry in (None, "cuLaunchKernel", "cuLaunchKernelEx"):
    check_varying_dims(fk, entry)
    check_rebind_with_the_calls_dims(fk, entry)
print("checked")
"""
    proc = run_python(code, env={**os.environ, "CUPROC_PURE_PYTHON": "1"})
    assert proc.stdout.split() == ["checked"]


def test_the_entries_stay_bounded_dropping_gone_streams_first_then_the_oldest_but_not_the_one_in_use(fk, pc):
    """A new key beyond the bound drops one entry, never all: first those of Streams that are gone, then
    the oldest, but not the C front's last hit (the entry in use).  A new stream for a signature seen
    before makes its launcher from the code already compiled."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    args = (buf, np.int32(1), np.float32(1))
    fn.launch(1, 32, args)
    fn.launch(2, 32, args)                                # with the fast path: the front's last hit
    (in_use,) = fn.launch_cache.values()
    streams = [Stream() for _ in range(L._PREPARED_PER_FUNCTION + 1)]   # made first: none at gone's id
    gone = Stream()
    fn.launch(1, 32, args, stream=gone)
    gone.close()
    del gone
    made = L._compiled_source.cache_info()
    for s in streams[:-3]:
        fn.launch(1, 32, args, stream=s)
    assert len(fn.launch_cache) == L._PREPARED_PER_FUNCTION
    assert L._compiled_source.cache_info().misses == made.misses     # new launchers, nothing compiled

    def held() -> set:
        return {id(e[1]()) if e[1] is not None else None for e in fn.launch_cache.values()}
    fn.launch(3, 32, args, stream=streams[-3])            # the gone Stream's entry makes room
    assert len(fn.launch_cache) == L._PREPARED_PER_FUNCTION and held() == {None} | set(map(id, streams[:-2]))
    fn.launch(4, 32, args, stream=streams[-2])            # then the oldest entry not in use
    oldest = streams[0] if FRONT else None                # without the front nothing is in use
    assert len(fn.launch_cache) == L._PREPARED_PER_FUNCTION
    assert held() == ({None} | set(map(id, streams[:-1]))) - {id(oldest) if oldest else None}
    assert any(e is in_use for e in fn.launch_cache.values()) == FRONT
    for i, s in enumerate([None, *streams]):              # every stream launches right, dropped or not
        fn.launch(i + 1, 32, (buf, np.int32(i), np.float32(1)), stream=s)
        assert fk.last_launch_config() == ((i + 1, 1, 1), (32, 1, 1), _handle(s))
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, 1.0)
        assert len(fn.launch_cache) <= L._PREPARED_PER_FUNCTION


def test_one_shot_launches_on_the_pure_path_too(fk):
    """The same warm/cold sequence in a process with CUPROC_PURE_PYTHON=1 (no C front)."""
    code = f"""
import sys, struct, numpy as np
sys.path.insert(0, {str(ROOT / 'tests')!r})
import cuproc, cuproc.launch as L
from fakedriver import fake_image
assert not cuproc.fastpath.active() and not hasattr(L.launch, "taken")
drv = cuproc.Driver(library={str(fk.path)!r})
cuproc.set_default_driver(drv)
pc = cuproc.use_device(0)
buf = cuproc.DeviceBuffer(64)
fn = cuproc.Module.load(fake_image({{"empty": [8, 4, 4]}})).get_function("empty")
for i in range(3):
    fn.launch(1, 32, (buf, np.int32(i), np.float32(i)))
    fn.launch(1, 32, (buf, i, 0.5), signature=["float*", "int", "float"])
assert len(fn.launch_cache) == 2
try:
    fn.launch(1, 32, (buf, "x", 0.5), signature=["float*", "int", "float"])
except cuproc.InvalidValueError:
    print("refused")
"""
    proc = run_python(code, env={**os.environ, "CUPROC_PURE_PYTHON": "1"})
    assert proc.stdout.strip() == "refused"


REENTRY = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import numpy as np
import cuproc
from fakedriver import FakeDriver, fake_image
fk = FakeDriver(Path({lib!r}))
fk.reset()
cuproc.set_default_driver(cuproc.Driver(library={lib!r}))
pc = cuproc.use_device(0)
fn = cuproc.Module.load(fake_image({{"fake_grid_pair": [8, 8]}})).get_function("fake_grid_pair")
sig = ["unsigned long long", "unsigned long long"]
seen = []


class Converts:
    '''A value whose conversion launches the same kernel again, on the same thread, with other dims and values.'''
    def __init__(self, how):
        self.how = how

    def __int__(self):
        fn.launch(2, 32, (1, 4), signature=sig, **kw)      # a = 1, b = 3a + 1, grid a % 4 + 1
        seen.append(fk.last_launch_config()[0][0])
        return 1
    if {index}:
        __index__ = __int__


for entry in (None, "cuLaunchKernel", "cuLaunchKernelEx"):
    kw = {{}} if entry is None else {{"entry": entry}}
    fn.launch(1, 32, (0, 1), signature=sig, **kw)
    fn.launch(1, 32, (0, 1), signature=sig, **kw)          # warm: the shared block is this thread's
    before = fk.launch_mismatches()
    fn.launch(1, 32, (0, Converts(entry)), signature=sig, **kw)   # a = 0, b = 1, grid 1
    assert fk.last_launch_config()[0][0] == 1, (entry, fk.last_launch_config())
    assert fk.last_launch()[1] == np.array([0, 1], np.uint64).tobytes(), (entry, fk.last_launch()[1])
    assert fk.launch_mismatches() == before and seen[-1] == 2, (entry, seen)
print("ok", len(seen))
"""


@pytest.mark.parametrize("pure", [False, True])
@pytest.mark.parametrize("index", [False, True])
def test_a_launch_made_while_a_value_converts_keeps_each_launch_its_own(fk, pure, index):
    """A value's __int__ (or __index__, which the C launcher converts itself) launching the same kernel with
    other dimensions and values, on the same thread, mid-conversion: each launch goes out with its own grid
    and arguments (the fake checks b = 3a + 1 and the grid against a), on both paths and every entry."""
    code = REENTRY.format(tests=str(ROOT / "tests"), lib=str(fk.path), index=index)
    env = {**os.environ, "CUPROC_PURE_PYTHON": "1" if pure else "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", "3"]


def test_a_cold_launch_with_bad_dims_builds_and_stores_nothing(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    fn.launch(1, 32, (buf, 1, 1.0), signature=SIG)
    kept = dict(fn.launch_cache)
    made = L._compiled_source.cache_info()
    count = fk.launch_count()
    for grid, block, shared in ((0, 32, 0), (1, -1, 0), (1, 32, 2**32), ((1, 0), 32, 0)):
        with pytest.raises(InvalidValueError) as info:
            fn.launch(grid, block, (buf, 1, 1.0), signature=["float*", "int", "double"], shared_mem=shared)
        assert info.value.call == L.default_entry(fn.driver)
    assert dict(fn.launch_cache) == kept and L._compiled_source.cache_info() == made
    assert fk.launch_count() == count


# ----------------------------------------------------------------------------- conversions that end things

class _Ending:
    """A kernel argument whose conversion to a C int or float (cffi's, the C launcher's) first runs ``act``:
    Python code in the middle of a launch, after the values before it were stored."""

    def __init__(self, act, value: int = 1) -> None:
        self.act, self.value = act, value

    def _run(self) -> int:
        act, self.act = self.act, None      # once: a launch made again from the start converts it again
        if act is not None:
            act()
        return self.value

    def __int__(self) -> int:
        return self._run()

    def __index__(self) -> int:
        return self._run()

    def __float__(self) -> float:
        return float(self._run())


@pytest.mark.parametrize("how", ["prepared", "one-shot with a signature"])
@pytest.mark.parametrize("where", [1, 2])   # the int parameter's conversion, the float parameter's
def test_a_buffer_freed_by_a_later_arguments_conversion_is_refused_before_the_driver(fk, pc, how, where):
    """The buffer's address was stored before the value's ``__int__`` / ``__float__`` freed it: the launch
    checks its pointer values again once a conversion ran Python, and raises naming the launch; no freed
    address reaches the driver (the fake counts one as a stale use)."""
    mod = Module.load(IMAGE)
    fn = mod.get_function("empty")
    keep, buf = DeviceBuffer(64), DeviceBuffer(64)
    run = fn.prepare(SIG, 1, 32) if how == "prepared" else None
    for _ in range(3):                                  # warm: the launcher's block claimed, the entry cached
        if run is not None:
            run(keep, 1, 1.0)
        else:
            fn.launch(1, 32, (keep, 1, 1.0), signature=SIG)
    args = [buf, 1, 1.0]
    args[where] = _Ending(buf.free)
    launches, stale = fk.launch_count(), fk.stale_count()
    with pytest.raises(ClosedResourceError) as info:
        if run is not None:
            run(*args)
        else:
            fn.launch(1, 32, tuple(args), signature=SIG)
    assert info.value.call == "cuLaunchKernelEx" and "freed" in str(info.value)
    assert fk.stale_count() == stale and fk.launch_count() == launches and buf.ended == "freed"
    # the launcher stays usable, with the block's pointer stored again
    other = DeviceBuffer(64)
    (run if run is not None else (lambda *a: fn.launch(1, 32, a, signature=SIG)))(other, 5, 2.5)
    assert fk.last_launch()[1] == struct.pack("<Qif", other.ptr, 5, 2.5) and fk.stale_count() == stale
    for x in (keep, other, mod):   # now: the exception's traceback keeps them until a collection
        x.close()


@pytest.mark.parametrize("how", ["prepared", "one-shot with a signature", "one-shot with NumPy scalars"])
def test_a_module_unloaded_by_an_arguments_conversion_is_refused_naming_it(fk, pc, how):
    """The function's module unloaded by a value's conversion: a ClosedResourceError naming the module (the
    epoch moved), not the driver's INVALID_HANDLE for a launch of an unloaded function."""
    mod = Module.load(IMAGE)
    fn = mod.get_function("empty")
    buf = DeviceBuffer(64)
    run = fn.prepare(SIG, 1, 32) if how == "prepared" else None
    values = (buf, np.int32(1), np.float32(1.0)) if how.endswith("NumPy scalars") else (buf, 1, 1.0)
    for _ in range(3):
        if run is not None:
            run(*values)
        elif how.endswith("NumPy scalars"):
            fn.launch(1, 32, values)
        else:
            fn.launch(1, 32, values, signature=SIG)
    stale = fk.stale_count()
    ending = _Ending(mod.unload)
    with pytest.raises(ClosedResourceError) as info:
        if run is not None:
            run(buf, ending, 1.0)
        else:   # an object of no NumPy class: the one-shot form needs the signature for it
            fn.launch(1, 32, (buf, ending, 1.0), signature=SIG)
    assert info.value.call == "cuLaunchKernelEx" and "unloaded" in str(info.value), str(info.value)
    assert mod.ended is not None and fk.stale_count() == stale
    buf.close()   # now: the exception's traceback keeps it until a collection


def test_values_converting_without_python_skip_the_second_check(fk, pc, monkeypatch):
    """Exact ints and floats, NumPy scalars and buffers: no conversion runs Python, so the launch does not
    check its values again (the check is paid only where Python ran)."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    run = fn.prepare(SIG, 1, 32)
    # (a NumPy class's first launch notes it: it converts in C from then on)
    for values in [(buf, 1, 1.0), (buf, 2, 3), (buf.ptr, np.int32(4), np.float32(5.0)), (buf, np.int64(6), np.float64(6))]:
        run(*values)
    calls = []
    original = DeviceBuffer.check
    monkeypatch.setattr(DeviceBuffer, "check", lambda self, call: (calls.append(call), original(self, call))[1])
    for values in [(buf, 1, 1.0), (buf, 2, 3), (buf.ptr, np.int32(4), np.float32(5.0)), (buf, np.int64(7), 8.5)]:
        run(*values)
    assert calls == []
    run(buf, _Ending(lambda: None), 1.0)     # a conversion that ran Python: the values checked again,
    assert calls == ([] if FRONT else ["cuLaunchKernelEx"])   # by the C launcher from the buffer's slots


class _Counted:
    """A value that counts its conversions; its first runs ``act`` (each later one returns the same value)."""

    def __init__(self, value: float, act=None) -> None:
        self.value, self.act, self.count = value, act, 0

    def _run(self):
        self.count += 1
        act, self.act = self.act, None
        if act is not None:
            act()
        return self.value

    def __int__(self) -> int:
        return int(self._run())

    def __index__(self) -> int:
        return int(self._run())

    def __float__(self) -> float:
        return float(self._run())


def test_something_else_ending_during_a_conversion_leaves_the_launch_as_it_was_converted_once(fk, pc):
    """An unrelated module unloaded by a value's conversion moves the epoch: the launch checks what it holds
    again, finds it live, and launches with the values as they were converted -- each once, on both paths."""
    fn = Module.load(IMAGE).get_function("empty")
    other = Module.load(IMAGE)
    buf = DeviceBuffer(64)
    run = fn.prepare(SIG, 1, 32)
    for _ in range(3):
        run(buf, 1, 1.0)
    value, real = _Counted(7, other.unload), _Counted(2.5)
    run(buf, value, real)
    assert other.ended is not None and (value.count, real.count) == (1, 1)
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 7, 2.5)


def test_a_launch_made_by_the_recheck_gets_a_block_of_its_own(fk, pc):
    """The recheck runs Python (a float value's class is noted through its ``dtype``): a launch of the same
    kernel made there takes a private block, and the outer launch sends its own values, not the nested one's."""
    fn = Module.load(IMAGE).get_function("empty")
    a, b = DeviceBuffer(64), DeviceBuffer(64)
    run = fn.prepare(SIG, 1, 32)
    for _ in range(3):
        run(a, 1, 1.0)
    sent = []

    class Nesting(_Counted):
        @property
        def dtype(self):
            run(b, 99, 9.0)
            sent.append(fk.last_launch()[1])
            raise AttributeError("dtype")

    run(a, Nesting(1), Nesting(2.0))
    assert fk.last_launch()[1] == struct.pack("<Qif", a.ptr, 1, 2.0)
    assert sent in ([], [struct.pack("<Qif", b.ptr, 99, 9.0)])   # (the C launcher reads no dtype: nothing nested)
    a.close()
    b.close()


def test_a_grid_whose_conversion_unloads_the_module_is_refused_naming_it(fk, pc):
    """Dimensions that are not exact ints are read through their ``__index__`` (or as a sequence): Python that
    may end what the launch holds, before any value is stored -- the launch checks the epoch after them."""
    mod = Module.load(IMAGE)
    fn = mod.get_function("empty")
    buf = DeviceBuffer(64)
    for _ in range(3):
        fn.launch(1, 32, (buf, 1, 1.0), signature=SIG)
    stale, launches = fk.stale_count(), fk.launch_count()
    with pytest.raises(ClosedResourceError) as info:
        fn.launch(_Counted(1, mod.unload), 32, (buf, 1, 1.0), signature=SIG)
    assert info.value.call == "cuLaunchKernelEx" and "unloaded" in str(info.value)
    assert fk.stale_count() == stale and fk.launch_count() == launches
    buf.close()


def test_another_threads_launch_checks_its_values_again_too(fk, pc):
    """A thread that is not the block's owner launches with a private block (filled by the general writers):
    a value's conversion freeing a buffer there is refused as well."""
    import threading
    fn = Module.load(IMAGE).get_function("empty")
    keep, buf = DeviceBuffer(64), DeviceBuffer(64)
    run = fn.prepare(SIG, 1, 32)
    run(keep, 1, 1.0)                      # this thread owns the shared block
    stale, outcome = fk.stale_count(), []

    def other() -> None:
        ctx = pc.context
        ctx.push()
        try:
            run(buf, _Ending(buf.free), 1.0)
        except ClosedResourceError as exc:
            outcome.append(exc.call)
        finally:
            ctx.pop()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert outcome == ["cuLaunchKernelEx"] and fk.stale_count() == stale and buf.ended == "freed"
    keep.close()


class CpuTensor:
    """A CPU tensor as torch exposes one: DLPack on kDLCPU and a data_ptr, which is a host address."""

    ndim, shape = 1, (4,)

    def __init__(self) -> None:
        self.host = np.zeros(4, np.float32)

    def __dlpack__(self, **kwargs):
        return self.host.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (1, 0)

    def data_ptr(self) -> int:
        return self.host.ctypes.data


class OneElementTensor:
    """A one-element CPU tensor as torch's converts: __int__, __index__ and __float__ give its element."""

    ndim, shape = 1, (1,)

    def __len__(self) -> int:
        return 1

    def __int__(self) -> int:
        return 3

    __index__ = __int__

    def __float__(self) -> float:
        return 2.5


def test_a_one_element_host_array_is_refused_for_a_scalar_parameter_too(fk, pc):
    """For int and float parameters as well, warm or cold, prepared or with a signature, on both paths: the
    array's own conversion would take its element, as the C launcher once did for an int (NumPy before 2.4
    converts int(np.array([3])) too) and both launchers for a float."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    prepared = fn.prepare(SIG, grid=1, block=32)
    prepared(buf, 1, 1.0)
    fn.launch(1, 32, (buf, 1, 1.0), signature=SIG)
    fk.clear_calls()
    for value in (OneElementTensor(), np.array([2.5], np.float32)):
        for args, where in (((buf, value, 1.0), r"argument 1 \(int\)"), ((buf, 1, value), r"argument 2 \(float\)")):
            for launch in (lambda: prepared(*args), lambda: fn.launch(1, 32, args, signature=SIG)):
                with pytest.raises(InvalidValueError, match=where + " is a host array"):
                    launch()
    assert not [c for c in fk.calls() if c.startswith("cuLaunch")]
    prepared(buf, np.int64(4), np.float32(0.5))                 # scalars still launch, through the same paths
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 4, 0.5)
    buf.free()


def test_a_host_array_is_refused_as_an_argument_on_every_form(fk, pc):
    """A host array (here of one element, whose bits would pass as a scalar or an address) or a CPU tensor
    is refused before the driver, naming the argument, in the one-shot form without a signature (inferred),
    with one, and in a prepared launch -- warm or cold, both paths; device memory still launches."""
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    prepared = fn.prepare(SIG, grid=1, block=32)
    prepared(buf, 1, 1.0)                                               # warm every form first
    fn.launch(1, 32, (buf, np.int32(1), np.float32(1)))
    fn.launch(1, 32, (buf, 1, 1.0), signature=SIG)
    hosts = [np.array([2.5]), np.array([0x1234], np.int64), np.zeros(4, np.float32), CpuTensor()]
    fk.clear_calls()
    for host in hosts:
        for launch in (lambda: fn.launch(1, 32, (host, np.int32(1), np.float32(1))),
                       lambda: fn.launch(1, 32, (host, 1, 1.0), signature=SIG),
                       lambda: prepared(host, 1, 1.0)):
            with pytest.raises(InvalidValueError, match="host array") as info:
                launch()
            assert "argument 0" in str(info.value)
        with pytest.raises(InvalidValueError, match=r"argument 1 \(int\)"):
            fn.launch(1, 32, (buf, np.array([3], np.int32), 1.0), signature=SIG)
        with pytest.raises(InvalidValueError, match="host array"):
            fn.launch(1, 32, (buf, np.array([3], np.int32), np.float32(1)))
    assert not [c for c in fk.calls() if c.startswith("cuLaunch")]
    fn.launch(1, 32, (buf, np.array(3, np.int32)[()], np.float32(1)))  # a scalar read out of an array
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 3, 1.0)
    buf.free()


def test_refusals_name_the_argument_and_its_type(fk, pc):
    """A value the parameter cannot take is refused as an InvalidValueError naming the argument by position
    and C type, including failures of the value's own protocols (a NumPy array's __index__)."""
    module = Module.load(fake_image({"ints": [4, 4, 4], "vec": [8], "ptr": [8]}))
    run = module.get_function("ints").prepare(["int", "int", "int"], grid=1, block=32)
    fk.clear_calls()
    for args, where in (((1, "x", 3), r"argument 1 \(int\)"), ((1, 2, 3.5), r"argument 2 \(int\)"),
                        ((1 << 40, 2, 3), r"argument 0 \(int\)")):
        with pytest.raises(InvalidValueError, match=where):
            run(*args)
    vec = module.get_function("vec").prepare(["float2"], grid=1, block=32)
    with pytest.raises(InvalidValueError, match=r"argument 0 \(float2\) takes 2 components"):
        vec(3)
    with pytest.raises(InvalidValueError, match=r"argument 0 \(float2\), component 1"):
        vec((1.0, "y"))
    ptr = module.get_function("ptr").prepare(["float*"], grid=1, block=32)
    class Dimmed:                                              # dimensions, __index__ and __int__, no item()
        ndim, shape = 1, (1,)

        def __index__(self) -> int:
            return 7

        __int__ = __index__

    class OddDims:                                             # an ndim that is no int, or raises: no array
        ndim = "1"

        def __index__(self) -> int:
            return 7

        __int__ = __index__

    ints = module.get_function("ints").prepare(["int", "int", "int"], grid=1, block=32)
    with pytest.raises(InvalidValueError, match=r"argument 2 \(int\) is a host array"):
        ints(1, 2, Dimmed())
    for value in (np.float64(2.0), np.array(2.0)):             # the latter's own __index__ refuses
        with pytest.raises(InvalidValueError, match=r"argument 0 \(float\*\) needs a device"):
            ptr(value)
    assert not [c for c in fk.calls() if c.startswith("cuLaunch")]       # every one refused before the driver
    ints(1, 2, OddDims())                                      # stored through its __int__, as any value
    assert fk.last_launch()[1] == struct.pack("<iii", 1, 2, 7)
    module.unload()
