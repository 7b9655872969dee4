"""Issue 35, four items, on the fake driver and on whichever path this process has (the suite runs on
both: ``CUPROC_PURE_PYTHON=1`` for the pure one); the pointer test also runs each path in a child.

A. ``cuproc.fastpath.pointer(f)`` is the driver's own function pointer behind any function cuproc.driver
   hands out -- ``drv.cuX``, ``cuproc.driver.cuX``, ``resolve()``, ``declare()``, the wrappers (cuInit,
   by-value structs, an AliasedName) -- on both paths: the address cuGetProcAddress gives.
B. A kernel parameter declared ``CUdeviceptr`` takes what a ``T*`` one takes, in every launch form, with
   the same liveness checks.
C. ``run.prepared`` (what Function.prepare's docstring promises) is the PreparedLaunch, on both launchers,
   without a reference cycle.
D. ``buf.free_async(buf.stream)`` takes the path of ``buf.free_async()``; another stream keeps its checks.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from fakedriver import fake_image
from subproc import run_python

import cuproc
import cuproc.launch as L
from cuproc import DeviceBuffer, Driver, Module, Stream, fastpath
from cuproc import driver as cu
from cuproc.device_memory import alloc_async
from cuproc.errors import ClosedResourceError, InvalidValueError

ROOT = Path(__file__).resolve().parent.parent
ffi = cuproc.ffi
IMAGE = fake_image({"empty": [8, 4, 4]})


# ----------------------------------------------------------------------------- A. the function pointer

def proc_address(path: object, name: str, version: int, flags: int) -> int:
    """What the driver library at ``path`` hands out for ``name`` (its cuGetProcAddress_v2, through ctypes:
    nothing of cuproc's), or 0."""
    lib = ctypes.CDLL(str(path))   # the same instance the driver handle opened (one per file)
    lookup = lib.cuGetProcAddress_v2
    lookup.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                       ctypes.POINTER(ctypes.c_int)]
    out, status = ctypes.c_void_p(), ctypes.c_int(-1)
    assert lookup(name.encode(), ctypes.byref(out), version, flags, ctypes.byref(status)) == 0
    return out.value or 0


def address_of(function: object) -> int:
    """The address :func:`cuproc.fastpath.pointer` gives for ``function``, checked to be a cffi function pointer."""
    raw = fastpath.pointer(function)
    assert isinstance(raw, ffi.CData) and ffi.typeof(raw).kind == "function", (function, raw)
    return int(ffi.cast("uintptr_t", raw))


def expected(drv: Driver, name: str) -> int:
    res = drv.resolution(name)
    return proc_address(drv.library.path, name, int(res.query_version), cu.FLAG_LEGACY_STREAM)


# plain (two parameters: a bound trampoline), one parameter (slot trampolines), cuInit (fork-tracking
# wrapper), CUmemLocation by value (converting wrappers)
NAMES = ("cuMemAlloc", "cuCtxGetCurrent", "cuInit", "cuMemAdvise", "cuMemPrefetchAsync")


def test_pointer_is_the_address_cuGetProcAddress_gives_for_every_published_form(fk):
    drv = Driver(library=str(fk.path))
    for name in NAMES:
        want = expected(drv, name)
        assert want != 0
        assert address_of(getattr(drv, name)) == want, name
        assert address_of(drv.resolve(name)) == want, name
        assert address_of(drv.resolution(name).function) == want, name   # a cffi pointer is its own
        assert address_of(getattr(cu, name)) == expected(cu.default_driver(), name), name   # the module namespace


def test_pointer_of_declared_names(fk):
    """declare() of names the registry lacks (a bare cffi pointer; a by-value struct's converting wrapper)
    and of one it has (resolved as the registry does: a trampoline on the fast path)."""
    lacking = Driver(library=str(fk.path), registry=cuproc.default_registry().without(["cuMemAlloc", "cuMemAdvise"]))
    alloc = lacking.declare("cuMemAlloc", "CUresult (*)(CUdeviceptr *, size_t)")
    advise = lacking.declare("cuMemAdvise", "CUresult (*)(CUdeviceptr, size_t, CUmem_advise, CUmemLocation)")
    at = int(lacking.driver_version)
    assert address_of(alloc) == proc_address(fk.path, "cuMemAlloc", at, cu.FLAG_LEGACY_STREAM) != 0
    assert address_of(advise) == proc_address(fk.path, "cuMemAdvise", at, cu.FLAG_LEGACY_STREAM) != 0
    assert address_of(lacking.cuMemAdvise) == address_of(advise)
    drv = Driver(library=str(fk.path))
    known = drv.declare("cuMemAlloc", drv.resolution("cuMemAlloc").typedef)
    assert address_of(known) == expected(drv, "cuMemAlloc")


def test_pointer_of_an_aliased_name_is_its_function(sim):
    drv = Driver("12.4", library=str(sim.path))
    aliased = drv.cuGraphInstantiate
    assert isinstance(aliased, cu.AliasedName)
    assert fastpath.pointer(aliased) is aliased.function
    assert address_of(aliased) == expected(drv, "cuGraphInstantiate") != 0


def test_pointer_leaves_what_is_no_driver_function_as_it_is(fk):
    drv = Driver(library=str(fk.path))
    stand_in = object()
    assert fastpath.pointer(stand_in) is stand_in
    assert fastpath.pointer(len) is len
    # drv.checked.cuX raises instead of returning the code: not the driver's function (take drv.cuX)
    assert not isinstance(fastpath.pointer(drv.checked.cuMemAlloc), ffi.CData)


_CHILD = """
import ctypes, json, sys
sys.path.insert(0, {tests!r})
import cuproc
from cuproc import driver as cu, fastpath
from test_pointer_launch_items import NAMES, proc_address
path = {path!r}
drv = cuproc.Driver(library=path)
cuproc.set_default_driver(drv)
base = ctypes.cast(ctypes.CDLL(path).cuGetProcAddress_v2, ctypes.c_void_p).value
out = {{"fast": fastpath.active()}}
for name in NAMES:
    res = drv.resolution(name)
    want = proc_address(path, name, int(res.query_version), cu.FLAG_LEGACY_STREAM)
    got = [int(cuproc.ffi.cast("uintptr_t", fastpath.pointer(f)))
           for f in (getattr(drv, name), drv.resolve(name), getattr(cu, name))]
    out[name] = [g - base for g in got] + [want - base]
print(json.dumps(out))
"""


def test_pointer_gives_the_same_addresses_on_both_paths(fk):
    """Each path in a child of its own: the same offsets into the fake library (ASLR moves its base per process),
    equal to what its cuGetProcAddress hands out."""
    code = _CHILD.format(tests=str(ROOT / "tests"), path=str(fk.path))
    seen = {}
    for pure in ("1", "0"):
        proc = run_python(code, env={**os.environ, "CUPROC_PURE_PYTHON": pure})
        seen[pure] = json.loads(proc.stdout.splitlines()[-1])
    assert seen["1"].pop("fast") is False
    fast_on = seen["0"].pop("fast")
    assert fast_on == fastpath.active() or os.environ.get("CUPROC_PURE_PYTHON") == "1"
    assert seen["1"] == seen["0"]
    for name, offsets in seen["1"].items():
        assert len(set(offsets)) == 1, (name, offsets)


# ----------------------------------------------------------------------------- B. CUdeviceptr parameters

class ArrayInterface:
    """Another library's device array: only ``__cuda_array_interface__``."""

    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (ptr, False), "version": 3}


def values(buf: DeviceBuffer) -> list:
    return [buf, buf.view(np.float32), ArrayInterface(buf.ptr), buf.ptr, np.uint64(buf.ptr)]


@pytest.mark.parametrize("ptr_type", ["CUdeviceptr", "CUdeviceptr_v2", "const CUdeviceptr"])
@pytest.mark.parametrize("entry", ["cuLaunchKernel", "cuLaunchKernelEx"])
def test_a_cudeviceptr_parameter_takes_what_a_pointer_takes_when_prepared(fk, pc, ptr_type, entry):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    sig = [ptr_type, "int", "float"]
    run = fn.prepare(sig, 1, 32, entry=entry)
    for i, value in enumerate(values(buf) * 2):   # twice: cold, then each kind of value again (warm)
        run(value, i, 0.5)
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, 0.5)
    assert L.pack_bytes(sig, [buf, 1, 2.0]) == struct.pack("<Qif", buf.ptr, 1, 2.0)


@pytest.mark.parametrize("entry", [None, "cuLaunchKernel", "cuLaunchKernelEx"])
def test_a_cudeviceptr_parameter_takes_what_a_pointer_takes_in_one_shot_launches(fk, pc, entry):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    sig = ["CUdeviceptr", "int", "float"]
    kw = {} if entry is None else {"entry": entry}
    for i, value in enumerate(values(buf) * 2):
        fn.launch(1, 32, (value, i, 0.25), signature=sig, **kw)
        assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, i, 0.25)
    L.launch_ex(fn, 1, 32, (buf, 7, 1.0), signature=sig)
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 7, 1.0)
    L.launch(fn, 1, 32, (buf, 8, 1.0), signature=sig, cooperative=True)
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 8, 1.0)


def test_a_cudeviceptr_parameter_refuses_a_freed_buffer_before_the_driver(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    sig = ["CUdeviceptr", "int", "float"]
    run = fn.prepare(sig, 1, 32)
    live, freed = DeviceBuffer(64), DeviceBuffer(64)
    run(freed, 0, 0.0)
    fn.launch(1, 32, (freed, 0, 0.0), signature=sig)    # warm entries, each having taken this very buffer
    freed.free()
    count = fk.launch_count()
    for launch in (lambda v: run(v, 1, 1.0), lambda v: fn.launch(1, 32, (v, 1, 1.0), signature=sig),
                   lambda v: L.launch_ex(fn, 1, 32, (v, 1, 1.0), signature=sig)):
        for value in (freed, freed.view(np.float32)):
            with pytest.raises(ClosedResourceError):
                launch(value)
        assert fk.launch_count() == count
        launch(live)                                     # the launch itself still works
        count += 1
        assert fk.launch_count() == count
    with pytest.raises(InvalidValueError):               # no address: refused as for float*
        run(1.5, 1, 1.0)
    with pytest.raises(InvalidValueError):
        run(-1, 1, 1.0)


# ----------------------------------------------------------------------------- C. run.prepared

@pytest.mark.parametrize("convention", ["buffer", "params"])
def test_run_prepared_is_its_prepared_launch(fk, pc, convention):
    fn = Module.load(IMAGE).get_function("empty")
    s = Stream()
    buf = DeviceBuffer(64)
    run = fn.prepare(["float*", "int", "float"], (2, 1), 32, stream=s, convention=convention)
    prepared = run.prepared
    assert isinstance(prepared, L.PreparedLaunch)
    assert prepared.launch is run
    assert (prepared.entry, prepared.convention, prepared.grid, prepared.block) == \
        (run.entry, convention, (2, 1, 1), (32, 1, 1))
    assert prepared.function is fn and prepared.stream_object is s
    run(buf, 3, 0.5)
    packed = prepared.packed                              # the block this launcher writes
    assert bytes(ffi.buffer(packed.block, packed.size)) == fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 3, 0.5)
    prepared(buf, 4, 1.5)                                 # and calling it launches
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 4, 1.5)
    assert repr(prepared).startswith("<cuproc.PreparedLaunch")
    made = L.PreparedLaunch(fn, ["float*", "int", "float"], 1, 32)
    assert made.launch.prepared.launch is made.launch and made.launch.prepared.packed is made.packed


def test_run_prepared_makes_no_reference_cycle(fk):
    gc.collect()
    gc.disable()
    try:
        pc = cuproc.use_device(0)
        fn = Module.load(IMAGE).get_function("empty")
        s = Stream()
        run = fn.prepare(["float*", "int", "float"], 1, 32, stream=s)
        run(0, 1, 1.0)
        assert run.prepared.stream_object is s
        del run, s
        assert fk.live("stream") == 0                      # dropping the launch released its stream at once
        fn.launch(1, 32, (DeviceBuffer(64), np.int32(1), np.float32(1)))
        assert next(iter(fn.launch_cache.values()))[0].prepared is None   # a one-shot entry holds no function
        del fn
        assert fk.live("module") == 0
        cuproc.driver.default_driver().cuCtxSetCurrent(ffi.NULL)
        pc.release()
    finally:
        gc.enable()


# ----------------------------------------------------------------------------- D. free_async on its own stream

def python_calls(action) -> int:
    """How many Python functions ``action()`` runs (sys.setprofile's "call" events, its own frame excluded)."""
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1
    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return count[0] - 1


def test_free_async_on_its_own_stream_takes_the_path_of_free_async(fk, pc):
    s = Stream()
    for _ in range(3):                                    # warm: the driver's functions are resolved and bound
        alloc_async(256, s).free_async()
        alloc_async(256, s).free_async(s)
    traces, costs = [], []
    for args, kwargs in (((), {}), ((s,), {}), ((None,), {}), ((), {"stream": s})):
        buf = alloc_async(256, s)
        fk.clear_calls()
        costs.append(python_calls(lambda: buf.free_async(*args, **kwargs)))
        traces.append(fk.calls())
        assert buf.ended == "freed" and not s.context.stream_ordered
        buf.free_async(*args, **kwargs)                   # idempotent
    assert traces == [["cuMemFreeAsync"]] * 4
    assert costs == [costs[0]] * 4, costs                 # the same code, no walk of the parents


def test_free_async_on_another_stream_keeps_its_checks(fk, pc):
    s, other = Stream(), Stream()
    buf = alloc_async(256, s)
    fk.clear_calls()
    buf.free_async(other)             # allowed: ordered after the work on ``other``, and after the allocation on s
    assert fk.calls()[-4:] == ["cuEventRecord", "cuStreamWaitEvent", "cuEventDestroy", "cuMemFreeAsync"]
    assert buf.ended == "freed" and fk.unordered_frees() == 0
    buf = alloc_async(256, s)
    other.close()
    fk.clear_calls()
    with pytest.raises(ClosedResourceError):
        buf.free_async(other)
    assert fk.calls() == [] and buf.ended is None
    buf.free_async(s)
    assert buf.ended == "freed"


@pytest.mark.parametrize("explicit", [False, True])
def test_free_async_on_its_own_closed_stream_is_refused_either_way(fk, pc, explicit):
    s = Stream()
    buf = alloc_async(256, s)
    s.close()
    fk.clear_calls()
    with pytest.raises(ClosedResourceError):
        buf.free_async(s) if explicit else buf.free_async()
    assert fk.calls() == [] and buf.ended is None
    buf.close()                                           # its stream gone: the context is synchronized, then freed
    assert buf.ended is not None and not s.context.stream_ordered
