"""Regression tests for the defects confirmed in issue 35, on the fake driver and on both paths (run this file
with and without ``CUPROC_PURE_PYTHON=1``; the children of the subprocess tests inherit the setting).

1. A DLPack capsule dropped while an exception is in flight (``(buf.__dlpack__(), 1 / 0)``, or NumPy
   refusing the device) must leave that exception as it was and release the export.
3. The "cuInit done" memo of the object layer belongs to the Driver handle: a new handle that Python places
   at a dropped one's address still gets cuInit, and nothing is kept per handle ever made.
4. ``DeviceBuffer.__init__`` on a buffer already initialized is refused before any driver call.
5. ``Context.rebind``'s failed push is raised as the push's own error (cuCtxPushCurrent).
"""
from __future__ import annotations

import gc
import json
import shutil
import textwrap
import weakref

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, ffi
from cuproc import memory as mem
from cuproc._support import get_driver
from cuproc.errors import CudaError, CudaWarning, InvalidValueError
from fakedriver import child_preamble
from subproc import run_python

PYTHON_INIT = getattr(DeviceBuffer.__init__, "__wrapped__", DeviceBuffer.__init__)   # the pure __init__


# ----------------------------------------------------------------------------- 1. DLPack, exception in flight
# Each case runs in a child: before the fix the interpreter could crash (a NULL exception on the stack).
_DLPACK_CHILD = """
import json
import numpy as np
pc = cuproc.use_device(0)
buf = cuproc.DeviceBuffer(64)
try:
    {expression}
except BaseException as exc:   # noqa: BLE001 - what arrives is the result
    raised = [type(exc).__module__, type(exc).__name__, isinstance(exc, SystemError)]
else:
    raised = None
views = buf.has_views()
try:
    buf.free()
    freed = buf.freed
except BaseException as exc:   # noqa: BLE001
    freed = type(exc).__name__
print(json.dumps({{"raised": raised, "views": views, "freed": freed, "live": fake.live("device_alloc")}}))
"""


def _dlpack_child(fake, expression: str) -> dict:
    proc = run_python(child_preamble(fake.path) + textwrap.dedent(_DLPACK_CHILD.format(expression=expression)),
                      returncode=None)
    assert proc.returncode == 0, f"the child crashed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_capsule_dropped_while_an_exception_propagates_keeps_it_and_releases_the_export(fake):
    out = _dlpack_child(fake, "(buf.__dlpack__(), 1 / 0)")
    assert out["raised"] == ["builtins", "ZeroDivisionError", False]
    assert out == {"raised": out["raised"], "views": False, "freed": True, "live": 0}


def test_numpy_refusing_the_device_raises_its_own_error_and_the_buffer_is_freeable(fake):
    out = _dlpack_child(fake, "np.from_dlpack(buf)")
    assert out["raised"] is not None and out["raised"][2] is False   # NumPy's refusal, not a SystemError
    assert (out["views"], out["freed"], out["live"]) == (False, True, 0)


# ----------------------------------------------------------------------------- 3. the cuInit memo
def test_a_new_handle_at_a_dropped_handles_address_still_runs_cuinit(fake, tmp_path):
    """Python reuses a dropped object's address: a memo of "cuInit done" kept by ``id(handle)`` made a new
    handle there, on another library, skip cuInit and fail with CUDA_ERROR_NOT_INITIALIZED."""
    other = tmp_path / "libfakecuda_other.so"
    shutil.copy(fake.path, other)          # the loader opens one copy per file: its own state, cuInit not called
    seen = set()
    for _ in range(20):                    # handles initialized, then dropped: their addresses are free again
        drv = cuproc.Driver(library=str(fake.path))
        get_driver(drv)
        seen.add(id(drv))
        del drv
    gc.collect()
    kept = []                              # held, so each new handle takes the next free address
    for _ in range(20000):
        drv = cuproc.Driver(library=str(other))
        if id(drv) in seen:
            break                          # the case of the defect (the usual one: CPython reuses the address)
        kept.append(drv)
    # (else: no address came back this time; the last handle, never initialized, must still get cuInit)
    del kept
    assert get_driver(drv) is drv
    count = ffi.new("int *")
    drv.checked.cuDeviceGetCount(count)    # NotInitializedError had cuInit been skipped
    assert count[0] >= 1
    assert drv.initialized


def test_get_driver_keeps_nothing_per_handle(fake):
    """The memo lives on the handle: handles made and dropped leave no entry behind, and none is kept alive."""
    import cuproc._support as support

    def sizes() -> dict[str, int]:
        return {name: len(value) for name, value in vars(support).items()
                if not name.startswith("__") and isinstance(value, (set, frozenset, dict, list, weakref.WeakSet))}

    get_driver(cuproc.Driver(library=str(fake.path)))
    gc.collect()
    before = sizes()
    refs = []
    for _ in range(50):
        drv = cuproc.Driver(library=str(fake.path))
        assert get_driver(drv) is drv
        refs.append(weakref.ref(drv))
        del drv
    gc.collect()
    assert sizes() == before
    assert not any(ref() for ref in refs)


# ----------------------------------------------------------------------------- 4. DeviceBuffer.__init__ again
@pytest.mark.parametrize("init", ["method", "python"])
def test_a_second_init_of_a_buffer_is_refused_before_the_driver(fk, pc, init):
    """On the fast path ``buf.__init__`` is the C front, which hands a buffer that is not fresh to the Python
    code; ``python`` calls that code directly.  Either refuses without a driver call and without touching
    the buffer, which stays usable; an ended buffer is refused too."""
    call = (lambda buf, *a, **k: buf.__init__(*a, **k)) if init == "method" else PYTHON_INIT
    buf = DeviceBuffer(64)
    address, live = buf.address, fk.live("device_alloc")
    for kwargs in ({}, {"context": pc.context}):
        fk.clear_calls()
        with pytest.raises(InvalidValueError) as info:
            call(buf, 128, **kwargs)
        assert info.value.refused and info.value.call == "cuMemAlloc"
        assert fk.calls() == [] and fk.live("device_alloc") == live
        assert (buf.address, buf.nbytes, buf.ended, buf.context) == (address, 64, None, pc.context)
    data = np.arange(64, dtype=np.uint8)
    mem.copy(buf, data)
    back = np.zeros(64, np.uint8)
    mem.copy(back, buf)
    assert (back == data).all()
    buf.free()
    assert buf.freed and fk.live("device_alloc") == live - 1
    with pytest.raises(InvalidValueError):
        call(buf, 64)
    assert fk.live("device_alloc") == live - 1 and buf.ended == "freed"


# ----------------------------------------------------------------------------- 5. Context.rebind's push
@pytest.mark.parametrize("code", [201, 999])   # CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_UNKNOWN
def test_a_failed_push_in_rebind_is_raised_as_the_push(fk, pc, code):
    """No context current: cuMemFree and the copy answer a binding error, the rebind pushes the buffer's
    context, and that push fails: the error names cuCtxPushCurrent and its code, not the call it was for.
    A finalizer reaching the same push warns instead of raising."""
    drv = pc.context.driver
    host = np.zeros(64, np.uint8)
    buf = DeviceBuffer(64)
    address = buf.address
    drv.cuCtxSetCurrent(ffi.NULL)          # the buffer's context is not current: a binding error first
    for work in (lambda: mem.copy(host, buf), buf.free):
        fk.fail("cuCtxPushCurrent", code)
        fk.clear_calls()
        with pytest.raises(CudaError) as info:
            work()
        assert (info.value.call, info.value.code) == ("cuCtxPushCurrent", code)
        assert "cuCtxPushCurrent" in fk.calls() and "cuCtxPopCurrent" not in fk.calls()
    assert buf.ended == "freed"            # claimed before the driver call, as any failed free is
    pc.context.set_current()
    assert drv.cuMemFree(address) == 0     # it was not freed: the test's own clean-up
    buf = DeviceBuffer(64)
    address = buf.address
    drv.cuCtxSetCurrent(ffi.NULL)
    fk.fail("cuCtxPushCurrent", code)
    with pytest.warns(CudaWarning):
        del buf
        gc.collect()
    pc.context.set_current()
    assert fk.live("device_alloc") == 1    # the dropped buffer's free never happened
    assert drv.cuMemFree(address) == 0
