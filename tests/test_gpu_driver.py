"""Resolution and real calls on the real driver. Marked ``gpu``; skipped only when no driver opens."""
from __future__ import annotations

import ctypes
import json
import os

import numpy as np
import pytest

import cuproc
from cuproc import fastpath, loader
from cuproc.driver import AliasedName, Driver
from cuproc.errors import CudaError, InvalidContextError, OutOfMemoryError
from rules import expected_resolution, typedefs_by_symbol
from threads import in_thread

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

ffi = cuproc.ffi
REQUESTED = ["11.3", "11.8", "12.0", "12.4", "12.9", "13.0", "13.5"]


@pytest.fixture(scope="module")
def libcuda():
    return loader.open_library()


@pytest.mark.parametrize("per_thread", [False, True], ids=["legacy", "ptds"])
@pytest.mark.parametrize("requested", REQUESTED)
def test_real_matrix_pointers_equal_direct_lookup(libcuda, requested, per_thread):
    """Every resolved pointer is the address of the registry's entry name in libcuda itself."""
    drv = Driver(requested, per_thread_default_stream=per_thread)
    driver_version = int(drv.driver_version)
    typedefs = typedefs_by_symbol()
    mismatches = []
    for name in drv.registry:
        res = drv.resolution(name)
        status, entry = expected_resolution(typedefs[name], name, int(drv.version), driver_version, per_thread)
        if (res.status, status) == ("symbol_not_found", "resolved") and drv.registry[name].header != "cudaTypedefs.h":
            continue  # a GL/EGL/VDPAU/profiler function this driver lacks (test_gpu_every_function lists them)
        if res.status != status:
            mismatches.append((name, "status", res.status, status, res.message))
            continue
        if status == "resolved":
            address = libcuda.symbol_address(res.entry_point)
            got = int(ffi.cast("uintptr_t", res.function))
            if res.entry_point != entry or address != got:
                mismatches.append((name, "entry", res.entry_point, entry, (hex(got), address and hex(address))))
    report = os.environ.get("CUPROC_MATRIX_REPORT")
    if report and mismatches:
        with open(report, "a") as fh:
            fh.write(json.dumps({"requested": requested, "per_thread": per_thread, "mismatches": mismatches}) + "\n")
    assert not mismatches, mismatches[:10]


@pytest.mark.parametrize("per_thread", [False, True], ids=["legacy", "ptds"])
@pytest.mark.parametrize("requested", ["11.8", "12.4", "13.0", None])
def test_real_preload_answers_as_each_name_alone(requested, per_thread):
    """preload() on the real driver, then every resolution() and drv.cuX pointer equal those of a fresh
    handle resolving the names one at a time (statuses, messages, entries, query versions, addresses)."""
    one = Driver(requested, per_thread_default_stream=per_thread)
    pre = Driver(requested, per_thread_default_stream=per_thread)
    counts = pre.preload()
    assert sum(counts.values()) == len(pre.registry) and counts.get("resolved", 0) > 0
    for name in pre.registry:
        want, got = one.resolution(name), pre.resolution(name)
        assert got._replace(function=None) == want._replace(function=None), name
        if want.status != "resolved":
            assert got.function is None and not getattr(pre, name)
            continue
        address = int(ffi.cast("uintptr_t", want.function))
        assert int(ffi.cast("uintptr_t", got.function)) == address != 0, name
        published = getattr(pre, name)
        bare = published.function if isinstance(published, AliasedName) else fastpath.pointer(published)
        if isinstance(bare, ffi.CData):   # cuInit and by-value-struct wrappers hold theirs inside
            assert int(ffi.cast("uintptr_t", bare)) == address, name


@pytest.mark.parametrize("per_thread", [False, True], ids=["legacy", "ptds"])
@pytest.mark.parametrize("requested", ["11.8", "12.0", "12.4", "13.0"])
def test_smoke_round_trip(requested, per_thread):
    drv = Driver(requested, per_thread_default_stream=per_thread)
    cu, ck = drv, drv.checked
    assert cu.cuInit(0) == 0
    version = ffi.new("int *")
    assert cu.cuDriverGetVersion(version) == 0
    assert cuproc.CudaVersion.from_int(version[0]) == drv.driver_version
    dev = ffi.new("CUdevice *")
    ck.cuDeviceGet(dev, 0)
    name = ffi.new("char[256]")
    ck.cuDeviceGetName(name, 256, dev[0])
    assert ffi.string(name).decode().strip()
    ctx = ffi.new("CUcontext *")
    ck.cuDevicePrimaryCtxRetain(ctx, dev[0])
    try:
        ck.cuCtxSetCurrent(ctx[0])
        host = np.arange(1 << 16, dtype=np.float32) * 1.5
        back = np.zeros_like(host)
        dptr = ffi.new("CUdeviceptr *")
        assert cu.cuMemAlloc(dptr, host.nbytes) == 0                       # raw: C semantics
        try:
            assert cu.cuMemcpyHtoD(dptr[0], ffi.from_buffer(host), host.nbytes) == 0
            ck.cuMemcpyDtoH(ffi.from_buffer(back), dptr[0], host.nbytes)   # checked
            np.testing.assert_array_equal(back, host)
            ck.cuMemsetD32(dptr[0], 7, host.size)
            ck.cuMemcpyDtoH(ffi.from_buffer(back), dptr[0], host.nbytes)
            assert (back.view(np.uint32) == 7).all()
        finally:
            ck.cuMemFree(dptr[0])
    finally:
        ck.cuCtxSetCurrent(ffi.NULL)
        ck.cuDevicePrimaryCtxRelease(dev[0])


def test_real_errors_are_named_and_typed():
    drv = Driver()
    drv.checked.cuInit(0)
    dev = ffi.new("CUdevice *")
    with pytest.raises(CudaError) as exc:
        drv.checked.cuDeviceGet(dev, 9999)
    assert exc.value.name == "CUDA_ERROR_INVALID_DEVICE" and exc.value.description
    assert "cuDeviceGet" in str(exc.value)

    box = in_thread(lambda: drv.checked.cuMemAlloc(ffi.new("CUdeviceptr *"), 16))  # a new thread: no context
    assert isinstance(box.get("error"), InvalidContextError), box

    drv.checked.cuDeviceGet(dev, 0)
    ctx = ffi.new("CUcontext *")
    drv.checked.cuDevicePrimaryCtxRetain(ctx, dev[0])
    try:
        drv.checked.cuCtxSetCurrent(ctx[0])
        with pytest.raises(OutOfMemoryError):
            drv.checked.cuMemAlloc(ffi.new("CUdeviceptr *"), 1 << 50)
    finally:
        drv.checked.cuCtxSetCurrent(ffi.NULL)
        drv.checked.cuDevicePrimaryCtxRelease(dev[0])


def test_above_driver_version_gets_invalid_value_from_the_driver(libcuda):
    """The quirk the resolver is built around: asking above the driver's version is an error."""
    drv = Driver()
    above = int(drv.driver_version) + 10
    pfn, status = ffi.new("void **"), ffi.new("CUdriverProcAddressQueryResult *")
    rc = libcuda.get_proc_address(b"cuMemAlloc", pfn, above, 0, status)
    assert rc == drv.CUDA_ERROR_INVALID_VALUE
    rc = libcuda.get_proc_address(b"cuLibraryLoadData", pfn, 11080, 0, status)
    assert rc == 0 and status[0] == drv.CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT and pfn[0] == ffi.NULL


def test_direct_symbol_lookup_matches_ctypes(libcuda):
    cdll = ctypes.CDLL(libcuda.path)
    assert libcuda.symbol_address("cuMemAlloc_v2") == ctypes.cast(cdll.cuMemAlloc_v2, ctypes.c_void_p).value
