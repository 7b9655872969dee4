"""A compiled front the garbage collector has cleared raises; it never calls through what tp_clear emptied.

Every C front (src/fastpath/fastpath_*.c) keeps its Python fallback, types and tables as object members, and its
tp_clear -- run when the collector breaks a reference cycle through the front, and at interpreter
shutdown -- sets them to NULL.  A front still reachable after that (from another object of the same
cycle, or a module being torn down) must answer with a RuntimeError, not dereference NULL.  The collector
clears a front only in rare orders, so these tests call each type's tp_clear directly (through ctypes,
after checking the type object's layout against what Python reports of it), then call the front the way
cuproc does.  Each runs in a child process: a front that still dereferences NULL crashes the child, and
the test reads its exit status.
"""
from __future__ import annotations

import pytest

import cuproc.fastpath
from fakedriver import child_preamble
from subproc import run_python

pytestmark = pytest.mark.skipif(not cuproc.fastpath.active(), reason="the compiled fast path is not built here")

# In the child: tp_clear of an object, called through its type's slot.  The slot's place in PyTypeObject
# (pointer-sized words: the object head, tp_name, tp_basicsize, tp_itemsize, tp_dealloc, ... tp_flags,
# tp_doc, tp_traverse, tp_clear) is the same in every CPython 3.8-3.13 on a 64-bit build; the child checks
# tp_basicsize and tp_flags against type.__basicsize__ and type.__flags__ before it trusts it.
CLEAR = '''
import ctypes, gc
WORD = ctypes.sizeof(ctypes.c_void_p)
def tp_clear(obj):
    t = type(obj)
    words = (ctypes.c_ssize_t * 25).from_address(id(t))
    assert words[4] == t.__basicsize__ and ctypes.c_ulong(words[21]).value == t.__flags__, "PyTypeObject layout"
    assert words[24], f"{t.__name__} has no tp_clear"
    assert ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object)(words[24])(obj) == 0
def refused(call, *args):
    try:
        call(*args)
    except RuntimeError as exc:
        assert "cleared by the garbage collector" in str(exc), exc
        return str(exc)
    raise AssertionError(f"{call!r} ran after its front was cleared")
'''


def _refusals(fake, body: str) -> int:
    """Run ``body`` in a child (exit status 0 asserted: no crash), which prints "ok" last; the number of
    refusals it printed."""
    out = run_python(child_preamble(fake.path) + CLEAR + body, timeout=120).stdout
    assert out.strip().endswith("ok"), out
    return out.count("cleared by the garbage collector")


def test_cleared_device_buffer_and_claim_fronts_raise(fake):
    assert _refusals(fake, '''
from cuproc.device_memory import DeviceBuffer
from cuproc._resource import Resource
ctx = cuproc.use_device(0)
kept = [DeviceBuffer(64) for _ in range(3)]     # made while the fronts work
init, close, free = (DeviceBuffer.__dict__[n] for n in ("__init__", "close", "free"))
claim = Resource.__dict__["_claim"]
for front in (init, close, free, claim):
    assert type(front).__module__.startswith("cuproc"), type(front)
    tp_clear(front)
print(refused(DeviceBuffer, 64))
print(refused(kept[0].close))
print(refused(kept[1].free))
print(refused(claim, kept[2], "freed"))
print(\"ok\")
''') == 4


def test_cleared_stream_ordered_copy_and_checked_fronts_raise(fake):
    assert _refusals(fake, '''
from cuproc import device_memory, transfers
from cuproc.device_memory import DeviceBuffer
ctx = cuproc.use_device(0)
stream = cuproc.Stream()
buf = device_memory.alloc_async(64, stream)
dev = DeviceBuffer(64)
host = cuproc.PinnedBuffer(64)
drv = cuproc.driver.default_driver()
checked = drv.checked.cuCtxSynchronize
assert type(checked).__name__ != "function", type(checked)
fronts = [device_memory.alloc_async, DeviceBuffer.__dict__["free_async"], transfers.copy, checked]
for front in fronts:
    tp_clear(front)
print(refused(device_memory.alloc_async, 64, stream))
print(refused(buf.free_async, stream))
print(refused(transfers.copy, dev, host))
print(refused(checked))
assert "cleared" in repr(checked), repr(checked)
print(\"ok\")
''') == 4


def test_cleared_launch_fronts_raise(fake):
    assert _refusals(fake, '''
from fakedriver import fake_image
from cuproc import launch as launch_module
ctx = cuproc.use_device(0)
fn = cuproc.Module.load(fake_image({"empty": [8, 4, 4]})).get_function("empty")
prepared = fn.prepare(["float*", "int", "float"], 1, 32)
assert type(prepared).__name__ != "function", type(prepared)
prepared(0, 2, 3.0)                             # works before
one_shot = launch_module.launch
assert type(one_shot).__name__ != "function", type(one_shot)
tp_clear(prepared)
tp_clear(one_shot)
print(refused(prepared, 0, 2, 3.0))
print(refused(one_shot, fn, 1, 32, (0, 2, 3.0)))
print(\"ok\")
''') == 2


def test_a_cleared_finalizer_front_leaves_drops_to_python_and_reports(fake):
    """The finalizer front is held by its class's table, so the collector never clears it; cleared anyway,
    dropping a buffer reports the failure (an unraisable RuntimeError) instead of reading the cleared front."""
    proc = run_python(child_preamble(fake.path) + CLEAR + '''
import sys
from cuproc.device_memory import DeviceBuffer
ctx = cuproc.use_device(0)
seen = []
sys.unraisablehook = lambda u: seen.append(str(u.exc_value))
front = DeviceBuffer.__dict__["__del__"]
assert front.finalizes_class
tp_clear(front)
refused(lambda: front.finalizes_class)
refused(front.take_finalizer)
b = DeviceBuffer(64)
b.free()
del b                                            # an ended buffer: the class's tp_finalize, front cleared
print(len(seen), seen[:1])
assert seen and all("cleared by the garbage collector" in s for s in seen), seen
print("ok")
''', timeout=120)
    assert proc.stdout.strip().endswith("ok")


def test_no_front_type_can_be_made_from_python(fk, pc):
    """An instance made by calling its type would be the cleared state from the start: only the factories make
    them, so every front type refuses to be called."""
    from cuproc import Module, launch, memory, transfers
    from cuproc._resource import Resource
    from cuproc.device_memory import DeviceBuffer
    from fakedriver import fake_image
    mod = Module.load(fake_image({"empty": [8, 4, 4]}))
    fronts = [mod.get_function("empty").prepare(["float*", "int", "float"], 1, 32), launch.launch,
              cuproc.driver.default_driver().checked.cuInit, DeviceBuffer.__dict__["__init__"],
              Resource.__dict__["_claim"], memory.alloc_async, transfers.copy]
    kinds = {type(front) for front in fronts}
    assert len(kinds) == 6 and not any(k.__module__ == "builtins" for k in kinds), kinds
    for kind in kinds:
        with pytest.raises(TypeError, match="cannot create"):
            kind()
    mod.unload()
