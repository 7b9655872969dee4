"""The fast paths of issue 9 keep cuproc's behaviour: one-shot launch caching, NumPy integers in
generated launchers, the per-thread current-context memo, checked calls of exact arity, preload,
and what a first allocation imports (all on the fake driver).  The benchmark harness's own tests are in
tests/tooling/test_bench_harness.py."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fakedriver import fake_image
from subproc import run_python
from threads import in_thread

import cuproc
from cuproc import Context, DeviceBuffer, Module, Stream, fastpath
from cuproc.errors import ClosedResourceError, CudaError, InvalidValueError


ROOT = Path(__file__).resolve().parent.parent
IMAGE = fake_image({"empty": [8, 4, 4], "wide": [8, 8, 4]})
SIG = ["float*", "int", "float"]


def test_one_shot_entries_follow_the_value_classes_not_just_their_count(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    fn.launch(1, 32, (buf, np.int32(3), np.float32(0.5)))
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 3, 0.5)
    fn.launch(1, 32, (buf, np.int32(-4), np.float32(1.5)))   # same classes: the same entry, new values
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, -4, 1.5)
    assert len(fn.launch_cache) == 1
    with pytest.raises(InvalidValueError):                     # int64 is 8 bytes: the driver's param info
        fn.launch(1, 32, (buf, np.int64(3), np.float32(0.5)))  # refuses it, never the int32 entry
    fn.launch(1, 32, (buf, np.float32(3), np.float32(0.5)))  # 4 bytes like int: its own entry, a float's bits
    assert fk.last_launch()[1] == struct.pack("<Qff", buf.ptr, 3.0, 0.5) and len(fn.launch_cache) == 2
    assert fk.launch_count() == 3


def test_values_whose_class_does_not_fix_the_type_are_keyed_by_their_type(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    fn.launch(1, 32, (buf, np.array(7, np.int32), np.array(2.5, np.float32)))   # 0-d arrays: class ndarray
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 7, 2.5)
    with pytest.raises(InvalidValueError):       # same classes, other dtype: never the int32 entry
        fn.launch(1, 32, (buf, np.array(7, np.int64), np.array(2.5, np.float32)))
    fn.launch(1, 32, (buf, np.array(8, np.int32), np.array(0.5, np.float32)))
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 8, 0.5)
    assert fk.launch_count() == 2


def test_one_shot_entries_are_per_stream_and_per_function(fk, pc):
    module = Module.load(IMAGE)
    fn, fn2 = module.get_function("empty"), Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    args = (buf, np.int32(1), np.float32(1))
    s1, s2 = Stream(), Stream()
    fn.launch(1, 32, args, stream=s1)
    fn.launch(1, 32, args, stream=s2)
    fn.launch(1, 32, args)
    assert len(fn.launch_cache) == 3 and not fn2.launch_cache
    fn2.launch(1, 32, args, stream=s1)
    assert len(fn2.launch_cache) == 1
    s1.close()
    with pytest.raises(ClosedResourceError):
        fn.launch(1, 32, args, stream=s1)       # the cached entry checks again once something ended
    fn.launch(1, 32, args, stream=s2)
    module.unload()
    with pytest.raises(ClosedResourceError):
        fn.launch(1, 32, args, stream=s2)
    assert fk.launch_count() == 5


def test_numpy_integers_go_straight_into_a_prepared_launch_and_keep_their_checks(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    run = fn.prepare(SIG, 1, 32)
    fn.launch(1, 32, (buf, np.int32(0), np.float32(0)))      # notes the NumPy integer class
    run(buf, np.int32(9), 1.0)
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 9, 1.0)
    run(buf, np.int64(-2), np.float32(3))
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, -2, 3.0)
    with pytest.raises(InvalidValueError, match="int"):
        run(buf, np.int64(1 << 40), 1.0)                     # out of range for int: refused, not wrapped
    with pytest.raises(InvalidValueError):
        run(buf, np.float32(2.5), 1.0)                       # a float for an int: refused, not truncated
    assert fk.launch_count() == 3


def test_current_context_memo_follows_the_thread_and_the_driver(fk, pc):
    ctx = Context.current()
    assert ctx is pc.context
    assert Context.current() is ctx
    assert in_thread(Context.current) == {"value": None}     # nothing current on the new thread
    other = Context.create(0)
    try:
        assert Context.current() is other                    # created and current: not the memo
        buf = DeviceBuffer(16)
        assert buf.context is other
        buf.free()
    finally:
        other.destroy()
    cuproc.driver.default_driver().cuCtxSetCurrent(ctx.handle)
    assert Context.current() is ctx


def test_checked_calls_take_exactly_the_typedefs_parameters(fk):
    drv = cuproc.driver.default_driver()
    checked = drv.checked
    count = cuproc.ffi.new("int *")
    assert checked.cuInit(0) is None
    assert checked.cuDeviceGetCount(count) is None and count[0] >= 1
    with pytest.raises(TypeError, match="cuDeviceGetCount"):
        checked.cuDeviceGetCount(count, 1)
    with pytest.raises(TypeError, match=r"^cuDeviceGetCount\(\) missing 1 required positional argument: "
                                        r"'arg0_int_ptr'$"):
        checked.cuDeviceGetCount()
    with pytest.raises(TypeError, match=r"^cuMemAlloc\(\) missing 1 .*'arg1_size_t'$"):
        checked.cuMemAlloc(cuproc.ffi.new("CUdeviceptr *"))
    with pytest.raises(CudaError) as info:
        checked.cuDeviceGet(cuproc.ffi.new("CUdevice *"), 999)
    assert info.value.call == "cuDeviceGet"


def test_preload_resolves_every_symbol_as_access_would(fk):
    drv = cuproc.Driver(library=str(fk.path))
    counts = drv.preload()
    assert sum(counts.values()) == len(drv.registry)
    expected: dict[str, int] = {}
    for name in drv.registry:
        status = drv.resolution(name).status
        expected[status] = expected.get(status, 0) + 1
        assert bool(getattr(drv, name)) == (status == "resolved")
    assert counts == expected and counts.get("resolved", 0) > 0
    assert drv.preload() == counts


def test_a_first_allocation_imports_only_what_it_needs(fake):
    code = ("import sys, cuproc; pc = cuproc.use_device(0); b = cuproc.DeviceBuffer(256); b.free(); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('cuproc', 'ctypes', '_ctypes')))))")
    env = {**os.environ, "CUPROC_LIBCUDA": str(fake.path)}
    out = run_python(code, env=env)
    modules = set(out.stdout.split())
    assert "cuproc.device_memory" in modules
    assert not modules & {"cuproc.memory", "cuproc.host_memory", "cuproc.pools", "cuproc.transfers",
                          "cuproc.launch", "cuproc.module", "cuproc._dlpack", "cuproc._header_toolkits",
                          "cuproc._header_enums",
                          "ctypes", "_ctypes"}


def test_a_first_copy_imports_no_arrays_module(fake):
    """memory.copy hands CUDA arrays to cuproc.arrays, but does not import it to ask: no array exists before that
    module was imported (it and the header tables it reads are a few ms of memory's import)."""
    code = ("import sys, numpy as np, cuproc; from cuproc import memory; pc = cuproc.use_device(0); "
            "b = cuproc.DeviceBuffer(256); memory.copy(b, np.zeros(64, np.float32)); b.free(); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('cuproc'))))")
    out = run_python(code, env={**os.environ, "CUPROC_LIBCUDA": str(fake.path)})
    modules = set(out.stdout.split())
    assert "cuproc.transfers" in modules and "cuproc.arrays" not in modules


def test_a_copy_during_another_threads_first_import_of_arrays_copies(fake):
    """While another thread is still importing cuproc.arrays, sys.modules holds the module half made: a copy that
    asks whether a side is an array copies as ever (no array exists yet).  The half-made module is stood for by
    an empty one under the same name."""
    code = ("import sys, types, numpy as np, cuproc; from cuproc import memory; pc = cuproc.use_device(0); "
            "sys.modules['cuproc.arrays'] = types.ModuleType('cuproc.arrays'); "
            "b = cuproc.DeviceBuffer(256); memory.copy(b, np.arange(64, dtype=np.float32)); "
            "out = np.zeros(64, np.float32); memory.copy(out, b); b.free(); print(int(out.sum()))")
    out = run_python(code, env={**os.environ, "CUPROC_LIBCUDA": str(fake.path)})
    assert out.stdout.strip() == str(sum(range(64)))


def test_a_first_allocation_imports_none_of_the_slow_stdlib_modules(fake):
    """typing, re and enum together are a few ms of a fresh process's startup (issue 9): cuproc names
    types for checkers only and compiles its few patterns where they are used; collections, functools
    and threading (which imports both) another 3-4 ms: cuproc's locks and per-thread namespaces come
    from _thread, its abstract base classes from _collections_abc.  warnings.py (0.3 ms): a finalizer's
    report calls the very warn it re-exports, from _warnings.  Without the site module, whose .pth files
    may import them first, and with only cuproc's and cffi's directories."""
    import cffi
    dirs = [str(Path(cuproc.__file__).parent.parent), str(Path(cffi.__file__).parent.parent)]
    code = (f"import sys; sys.path[:0] = {dirs!r}\n"
            "import cuproc; pc = cuproc.use_device(0); b = cuproc.DeviceBuffer(256); b.free(); "
            "print(cuproc.__file__); print(' '.join(sorted(sys.modules)))")
    out = run_python(code, env={**os.environ, "CUPROC_LIBCUDA": str(fake.path)}, flags=("-S",))
    where, modules = out.stdout.splitlines()
    assert Path(where).resolve() == Path(cuproc.__file__).resolve()      # the cuproc under test
    assert "cuproc.device_memory" in modules.split()
    assert not set(modules.split()) & {"typing", "re", "enum", "collections", "collections.abc", "functools",
                                       "threading", "warnings"}


def test_the_loader_finds_what_the_dynamic_linker_finds(fake):
    """symbol_address is dlsym (ctypes, an independent loader, is the reference); loaded_from is the
    file dladdr names; a missing name is None; close() unloads only the handle it was given."""
    import ctypes
    from cuproc import loader
    lib = loader.DriverLibrary(str(fake.path), loader.dlopen(str(fake.path)))
    reference = ctypes.CDLL(str(fake.path))
    for name in ("cuGetProcAddress_v2", "cuDriverGetVersion", "cuInit", "cuGetErrorName"):
        assert lib.symbol_address(name) == ctypes.cast(getattr(reference, name), ctypes.c_void_p).value
    assert lib.symbol_address("cuNoSuchFunction") is None
    assert Path(lib.loaded_from() or "").resolve() == fake.path.resolve()
    assert lib.lookup == loader.GET_PROC_ADDRESS_V2 and lib.version_int() > 0
    address = lib.symbol_address("cuInit")
    lib.close()
    assert lib.symbol_address("cuInit") is None                  # its own handle is gone
    # the library stays where it was for the other handle: a fresh dlsym (ctypes' [] does not cache)
    assert ctypes.cast(reference["cuInit"], ctypes.c_void_p).value == address
    with pytest.raises(OSError):
        loader.dlopen(str(fake.path.parent / "no-such-libcuda.so.1"))


def test_a_driver_the_dynamic_linker_cannot_pin_is_kept_by_a_reference_never_given_back(fake, monkeypatch):
    """Without RTLD_NODELETE (not POSIX), pin() keeps the library's own handle forever instead."""
    import _cffi_backend
    from cuproc import loader
    kept: list = []
    monkeypatch.delattr(os, "RTLD_NODELETE", raising=False)
    monkeypatch.setattr(loader, "keep_forever", kept.append)
    handle = loader.dlopen(str(fake.path))
    loader.DriverLibrary(str(fake.path), handle).pin()
    assert kept == [handle] and isinstance(handle, type(_cffi_backend.load_library(None)))


def test_the_default_registry_reads_the_toolkit_table_on_first_use():
    """Symbols of the default registry carry each typedef's toolkits from the table it imports late."""
    from cuproc._header_toolkits import PFN_TOOLKITS
    registry = cuproc.default_registry()
    for name in ("cuMemAlloc", "cuCtxCreate", "cuLaunchKernelEx", "cuStreamQuery"):
        for variant in registry[name].variants:
            assert variant.toolkits == PFN_TOOLKITS[variant.typedef] and variant.toolkits
    kept = registry.without(["cuMemAlloc"])
    assert kept["cuCtxCreate"].variants[0].toolkits == PFN_TOOLKITS[kept["cuCtxCreate"].variants[0].typedef]


def test_a_remembered_check_still_sees_its_own_end_and_its_parents_end(fk, pc):
    from cuproc import memory as mem
    buf = DeviceBuffer(64)
    view = buf.view(np.float32)
    buf.check("test")
    view.check("test")                          # both remembered at this epoch
    buf.free()                                  # a leaf: the epoch stays, its own end is seen
    for attempt in (lambda: buf.check("test"), lambda: view.check("test"),
                    lambda: mem.copy(view, np.zeros(16, np.float32))):
        with pytest.raises(ClosedResourceError):
            attempt()
    ctx = Context.create(0)
    stream = Stream(context=ctx)
    stream.check("test")
    ctx.destroy()                               # a parent ends: the stream's remembered check is void
    with pytest.raises(ClosedResourceError):
        stream.check("test")
    cuproc.driver.default_driver().cuCtxSetCurrent(pc.context.handle)


def test_a_reused_context_handle_ends_the_object_the_memo_remembers(fk, pc):
    # Another library creates a context and cuproc adopts it (A, remembered per thread); that library
    # destroys it and the driver hands the freed address to the next cuCtxCreate.  The fake never reuses
    # addresses, so the registration of the new context (C) under the same handle is made directly.
    from cuproc.context import CREATED, _register
    drv = cuproc.driver.default_driver()
    out = cuproc.ffi.new("CUcontext *")
    drv.checked.cuCtxCreate(out, cuproc.ffi.NULL, 0, 0)      # made outside cuproc's objects
    adopted = Context.current()
    assert adopted.kind == "adopted" and Context.current() is adopted     # the memo answers now
    reborn = _register(Context(out[0], driver=drv, kind=CREATED))
    assert adopted.ended == "replaced"
    assert Context.current() is reborn                       # never the remembered, replaced object
    buf = DeviceBuffer(16)
    assert buf.context is reborn
    buf.free()
    reborn.destroy()
    with pytest.raises(ClosedResourceError):
        adopted.check("test")
    drv.cuCtxSetCurrent(pc.context.handle)


@pytest.mark.parametrize("grid, block, shared_mem", [
    (1.0, 32, 0), (True, 32, 0), (1, 32.0, 0), ((1, 1.0), 32, 0), (1, 32, 0.0), (1, 32, False), (1, 32, -1)])
def test_a_warm_one_shot_entry_refuses_what_a_cold_launch_refuses(fk, pc, grid, block, shared_mem):
    args = (DeviceBuffer(64), np.int32(1), np.float32(1))
    for warm in (False, True):
        fn = Module.load(IMAGE).get_function("empty")
        if warm:
            fn.launch(1, 32, args)                           # the entry an equal-but-wrong key would hit
            fn.launch((1, 1), 32, args)
        with pytest.raises(InvalidValueError, match="grid|block|shared_mem"):
            fn.launch(grid, block, args, shared_mem=shared_mem)
        with pytest.raises(InvalidValueError, match="grid|block|shared_mem"):
            fn.launch(grid, block, args, signature=SIG, shared_mem=shared_mem)
    assert fk.launch_count() == 2


def test_numpy_integers_are_grid_block_and_shared_memory_cold_and_warm(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    for _ in range(2):                                       # cold, then from the entry
        fn.launch(np.int64(2), (np.int32(32), 1), (buf, np.int32(5), np.float32(1)), shared_mem=np.uint32(16))
        fn.launch(np.int64(2), np.int16(32), (buf, 5, 1.0), signature=SIG, shared_mem=np.int64(0))
    run = fn.prepare(SIG, np.int64(2), np.int32(32), shared_mem=np.int64(8))
    run(buf, 1, 2.0)
    assert fk.launch_count() == 5 and fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 1, 2.0)


def test_aligned_and_packed_struct_dtypes_get_their_own_one_shot_entries(fk, pc):
    fields = {"names": ["b"], "formats": ["<i4"]}
    packed, aligned = np.dtype(fields), np.dtype(fields, align=True)
    assert packed == aligned and hash(packed) == hash(aligned) and (packed.alignment, aligned.alignment) == (1, 4)
    fn = Module.load(fake_image({"s": [1, 4]})).get_function("s")      # a char, then 4 bytes at offset 4
    value = np.zeros((), aligned)
    value["b"] = -3
    fn.launch(1, 32, (np.int8(5), value), signature=["char", aligned])
    assert fk.last_launch()[1] == struct.pack("<b3xi", 5, -3)
    other = np.zeros((), packed)
    other["b"] = -4
    fn.launch(1, 32, (np.int8(5), other), signature=["char", packed])   # its own entry, at the driver's offset
    assert fk.last_launch()[1] == struct.pack("<b3xi", 5, -4)          # (the packed type alone would say 1)
    assert fk.launch_count() == 2 and len(fn.launch_cache) == 2


def test_another_thread_launches_a_shared_one_shot_entry_with_one_block_of_its_own(fk, pc, monkeypatch):
    from cuproc import launch as launch_module
    made: list[int] = []

    class Counted(launch_module.PackedArgs):
        def __init__(self, types, call="cuLaunchKernel"):
            made.append(threading.get_ident())
            super().__init__(types, call)
    fn = Module.load(IMAGE).get_function("empty")
    buf = DeviceBuffer(64)
    fn.launch(1, 32, (buf, np.int32(0), np.float32(0)))        # this thread owns the entry's block
    monkeypatch.setattr(launch_module, "PackedArgs", Counted)
    seen = []

    def worker():
        for i in range(5):
            fn.launch(1, 32, (buf, np.int32(i), np.float32(i / 2)))
            seen.append(fk.last_launch()[1])
    assert in_thread(worker) == {"value": None}
    assert seen == [struct.pack("<Qif", buf.ptr, i, i / 2) for i in range(5)]
    assert len(made) == 1 and len(fn.launch_cache) == 1        # one block for the thread, not one per launch
    fn.launch(1, 32, (buf, np.int32(7), np.float32(1)))         # the owner's block is untouched by the other
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 7, 1.0) and made == made[:1]
