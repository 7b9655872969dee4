"""Resolution, the C-named namespace and errors, against the simulated driver (no GPU needed)."""
from __future__ import annotations

import json
import os
import pickle
import threading

import pytest

import cuproc
from cuproc import fastpath
from cuproc import driver as driver_module
from cuproc import loader
from cuproc.driver import Driver
from cuproc.errors import (
    CudaError,
    DriverNotFoundError,
    DriverTooOldError,
    InvalidContextError,
    InvalidValueError,
    NotFoundError,
    NotInitializedError,
    OutOfMemoryError,
    SymbolNotFoundError,
)
from rules import expected_resolution, typedefs_by_symbol
from subproc import run_python
from threads import run_threads


REAL_FUNCTIONS = {"cuInit", "cuDriverGetVersion", "cuGetErrorName", "cuGetErrorString", "cuGetProcAddress"}
VERSIONS = [11030, 11080, 12000, 12040, 12090, 13000, 13050]
CALL = "CUresult(*)(void)"


def call0(fn):
    """Call an entry stub with no arguments (stubs take none; the real typedef would want them).

    With the compiled fast path, ``drv.cuX`` is a trampoline calling the resolved pointer: cast that."""
    return cuproc.ffi.cast(CALL, fastpath.pointer(fn))()


def sim_for(sims, driver_version):
    gen = "v2" if driver_version >= 12000 else "v1" if driver_version >= 11030 else "none"
    s = sims[gen]
    s.set_version(driver_version)
    s.set_result(0)
    return s


@pytest.fixture(scope="module")
def typedefs():
    return typedefs_by_symbol()


@pytest.mark.slow   # the whole compatibility matrix on simulated drivers (most of this file's time): CI runs it
@pytest.mark.parametrize("per_thread", [False, True], ids=["legacy", "ptds"])
@pytest.mark.parametrize("driver_version", VERSIONS)
def test_compatibility_matrix(sims, typedefs, driver_version, per_thread):
    """Every requested version x this driver version x flag x every symbol lands in the expected entry."""
    s = sim_for(sims, driver_version)
    for requested in VERSIONS:
        drv = Driver(requested, per_thread_default_stream=per_thread, library=s.path)
        assert int(drv.driver_version) == driver_version
        for name, tds in typedefs.items():
            status, entry = expected_resolution(tds, name, requested, driver_version, per_thread)
            res = drv.resolution(name)
            assert res.status == status, (name, requested, driver_version, per_thread, res.message)
            fn = getattr(drv, name)
            if status != "resolved":
                assert not fn
                with pytest.raises(SymbolNotFoundError):
                    fn()
                continue
            assert res.entry_point == entry
            if name in REAL_FUNCTIONS:  # implemented for real: compare addresses, do not call blind
                address = loader.open_library(s.path).symbol_address(entry)
                assert int(cuproc.ffi.cast("uintptr_t", res.function)) == address
                continue
            s.reset_last_called()
            call0(res.function)
            assert s.last_called() == entry, (name, requested, driver_version, per_thread)


def test_v1_lookup_fallback_is_recorded(sims):
    s = sim_for(sims, 11080)
    drv = Driver("11.8", library=s.path)
    assert drv.library.lookup == "cuGetProcAddress"
    assert any("cuGetProcAddress_v2 not exported" in f for f in drv.library.fallbacks)
    assert "fallback" in drv.describe()
    assert drv.resolution("cuMemAlloc").entry_point == "cuMemAlloc_v2"


def test_direct_lookup_fallback(sims):
    s = sim_for(sims, 11020)
    drv = Driver(library=s.path, per_thread_default_stream=True)
    assert drv.library.lookup == "dlsym"
    assert drv.version == cuproc.CudaVersion(11, 2)
    s.reset_last_called()
    call0(drv.cuMemcpyHtoD)
    assert s.last_called() == "cuMemcpyHtoD_v2_ptds"
    assert drv.resolution("cuMemAllocAsync").status == "resolved"          # 11.2: there
    assert drv.resolution("cuLibraryLoadData").status == "driver_too_old"  # 12.0: not yet


def test_default_version_is_min_of_driver_and_registry(sim):
    assert Driver(library=sim.path).version == cuproc.CudaVersion(13, 0)
    sim.set_version(14000)
    assert Driver(library=sim.path).version == cuproc.default_registry().newest_version
    sim.set_version(12040)
    assert Driver(library=sim.path).version == cuproc.CudaVersion(12, 4)


def test_newer_driver_feature_resolves_at_the_drivers_version(sim):
    drv = Driver("11.8", library=sim.path)
    res = drv.resolution("cuLibraryLoadData")
    assert res.status == "resolved" and res.newer_driver_feature
    sim.reset_last_called()
    call0(drv.cuLibraryLoadData)
    assert sim.last_called() == "cuLibraryLoadData"
    assert drv.has("cuLibraryLoadData")
    assert not drv.has("cuLibraryLoadData", newer_driver_features=False)   # not part of 11.8 itself
    assert Driver("12.0", library=sim.path).has("cuLibraryLoadData", newer_driver_features=False)


def test_driver_too_old_raises_at_call_time_with_versions(sim):
    sim.set_version(12000)
    drv = Driver("12.0", library=sim.path)            # opening is fine
    fn = drv.cuLibraryGetKernelCount
    assert not drv.has("cuLibraryGetKernelCount")
    with pytest.raises(DriverTooOldError) as exc:
        fn()
    msg = str(exc.value)
    assert "cuLibraryGetKernelCount" in msg and "12.4" in msg and "12.0" in msg
    assert exc.value.call == "cuLibraryGetKernelCount" and exc.value.name == "CUDA_ERROR_NOT_FOUND"


def test_requested_above_driver_never_reaches_the_driver(sim):
    sim.set_version(12000)
    drv = Driver("13.0", library=sim.path)
    assert drv.resolution("cuMemAlloc").status == "resolved"           # 3.2 ABI: fine
    res = drv.resolution("cuCtxCreate")                                # 12.5 ABI selected at 13.0
    assert res.status == "driver_too_old"
    assert "12.5" in res.message and "request CUDA 12.0" in res.message


def test_explicit_version_for_one_symbol(sim):
    drv = Driver("13.0", library=sim.path)
    sim.reset_last_called()
    call0(drv.resolve("cuCtxCreate", version="11.4"))
    assert sim.last_called() == "cuCtxCreate_v3"
    sim.reset_last_called()
    call0(drv.cuCtxCreate)
    assert sim.last_called() == "cuCtxCreate_v4"
    with pytest.raises(SymbolNotFoundError):
        drv.resolve("cuLibraryLoadData", version="11.8")


def test_raw_form_returns_codes_and_checked_form_raises(sim):
    drv = Driver(library=sim.path)
    pctx = cuproc.ffi.new("CUcontext *")
    assert drv.cuCtxGetCurrent(pctx) == 0
    assert drv.checked.cuCtxGetCurrent(pctx) is None
    cases = {2: OutOfMemoryError, 3: NotInitializedError, 201: InvalidContextError, 1: InvalidValueError,
             500: NotFoundError, 999: CudaError}
    for code, cls in cases.items():
        sim.set_result(code)
        assert drv.cuMemAlloc(cuproc.ffi.new("CUdeviceptr *"), 16) == code
        with pytest.raises(cls) as exc:
            drv.checked.cuMemAlloc(cuproc.ffi.new("CUdeviceptr *"), 16)
        err = exc.value
        assert err.code == code and err.call == "cuMemAlloc"
        assert err.name == cuproc.errors.result_name(code)
        assert err.description == "simulated driver error text"
        assert "cuMemAlloc" in str(err) and err.name in str(err)
    assert issubclass(OutOfMemoryError, MemoryError) and issubclass(InvalidValueError, ValueError)


def test_error_reporting_failure_never_hides_the_error(sim):
    drv = Driver(library=sim.path)
    sim.set_result(123456)  # unknown to cuGetErrorName: the driver says no
    with pytest.raises(CudaError) as exc:
        drv.checked.cuCtxSynchronize(cuproc.ffi.NULL)  # the 13.0 ABI takes a context
    assert exc.value.code == 123456 and exc.value.call == "cuCtxSynchronize"


def test_a_refusal_renamed_for_the_call_being_made_keeps_its_class_code_and_details():
    from cuproc.errors import ClosedResourceError
    first = ClosedResourceError("DeviceBuffer.ptr", "DeviceBuffer of 64 bytes", "DeviceBuffer of 64 bytes", "freed")
    err = first.renamed("cuLaunchKernelEx")
    assert type(err) is ClosedResourceError and err.refused and err.call == "cuLaunchKernelEx"
    assert (err.code, err.name, err.hint, err.resource) == (first.code, first.name, first.hint, first.resource)
    assert str(err).startswith("cuLaunchKernelEx was not called: ") and first.call == "DeviceBuffer.ptr"
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is ClosedResourceError and again.call == "cuLaunchKernelEx" and str(again) == str(err)
    first.__notes__ = ["seen while packing"]                 # what add_note() makes (Python 3.11+)
    renamed = first.renamed("cuLaunchKernel")
    assert renamed.__notes__ == ["seen while packing"]
    renamed.__notes__.append("only on the copy")
    assert first.__notes__ == ["seen while packing"]
    with pytest.raises(TypeError):                # a driver's answer stays the answer to its own call
        CudaError(2, "cuMemAlloc").renamed("cuLaunchKernel")


def test_constants_and_types_by_c_name(sim):
    drv = Driver(library=sim.path)
    assert drv.CU_CTX_SCHED_AUTO == 0 and drv.CUDA_ERROR_OUT_OF_MEMORY == 2
    assert drv.CU_LAUNCH_PARAM_END_AS_INT == 0
    assert int(cuproc.ffi.cast("uintptr_t", drv.CU_STREAM_PER_THREAD)) == 2
    assert cuproc.ffi.typeof(drv.CU_STREAM_LEGACY) is cuproc.ffi.typeof("CUstream")
    assert drv.CUdeviceptr is cuproc.ffi.typeof("CUdeviceptr")
    assert drv.checked.CU_MEMHOSTALLOC_PORTABLE == 1
    with pytest.raises(AttributeError):
        drv.cuNoSuchFunction
    assert "cuMemAlloc" in dir(drv)


def test_resolution_is_lazy_cached_and_thread_safe(sim):
    drv = Driver(library=sim.path)
    assert drv._lib is None                     # nothing opened by construction
    results = run_threads(lambda _: {n: getattr(drv, n) for n in drv.registry}, 8)
    for r in results[1:]:
        assert all(r[n] is results[0][n] for n in r)
    counts = drv.preload()
    assert sum(counts.values()) == len(drv.registry)
    assert counts["resolved"] + counts.get("driver_too_old", 0) + counts.get("not_on_this_platform", 0) == len(drv.registry)


def test_environment_configuration(sim, monkeypatch):
    monkeypatch.setenv("CUPROC_LIBCUDA", str(sim.path))
    monkeypatch.setenv("CUPROC_CUDA_VERSION", "12.4")
    for value, expected in [("1", True), ("yes", True), ("0", False), ("false", False), ("", False)]:
        monkeypatch.setenv("CUPROC_PER_THREAD_DEFAULT_STREAM", value)
        drv = Driver()
        assert drv.per_thread_default_stream is expected
        assert drv.version == cuproc.CudaVersion(12, 4)
    monkeypatch.setenv("CUPROC_CUDA_VERSION", "twelve")
    with pytest.raises(ValueError, match="CUPROC_CUDA_VERSION"):
        Driver()
    assert Driver("11.8", per_thread_default_stream=True).version == cuproc.CudaVersion(11, 8)


def test_module_namespace_uses_the_default_handle(sim):
    driver_module.set_default_driver(Driver("12.0", library=sim.path))
    try:
        sim.reset_last_called()
        assert call0(driver_module.cuCtxCreate) == 0
        assert sim.last_called() == "cuCtxCreate_v3"
        assert "cuCtxCreate" in vars(driver_module)   # cached as a plain attribute
        sim.set_result(2)
        with pytest.raises(OutOfMemoryError):
            driver_module.checked.cuMemAlloc(cuproc.ffi.new("CUdeviceptr *"), 1)
    finally:
        driver_module.set_default_driver(None)
    assert "cuCtxCreate" not in vars(driver_module)


def test_two_versions_side_by_side(sim):
    old, new = Driver("11.4", library=sim.path), Driver("13.0", library=sim.path)
    sim.reset_last_called()
    call0(old.cuCtxCreate)
    assert sim.last_called() == "cuCtxCreate_v3"
    call0(new.cuCtxCreate)
    assert sim.last_called() == "cuCtxCreate_v4"


# ----------------------------------------------------------------------------- loader

def test_loader_error_lists_every_path(monkeypatch, tmp_path):
    monkeypatch.delenv("CUPROC_LIBCUDA", raising=False)
    missing = [str(tmp_path / "nope1.so"), str(tmp_path / "nope2.so")]
    monkeypatch.setattr(loader, "DEFAULT_CANDIDATES", tuple(missing))
    with pytest.raises(DriverNotFoundError) as exc:
        loader.open_library()
    assert [p for p, _ in exc.value.attempts] == missing
    assert all(err for _, err in exc.value.attempts)
    assert "CUPROC_LIBCUDA" in str(exc.value) and missing[1] in str(exc.value)
    assert loader.is_driver_available() is False


def test_env_library_path_and_not_a_driver(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPROC_LIBCUDA", str(tmp_path / "missing.so"))
    with pytest.raises(DriverNotFoundError, match="missing.so"):
        Driver().open()
    libm = "libm.so.6"
    with pytest.raises(DriverNotFoundError, match="cuDriverGetVersion"):
        loader.open_library(libm)
    assert cuproc.is_driver_available() is False


def test_import_touches_no_driver(sim):
    code = ("import cuproc, cuproc.driver; "
            "maps = open('/proc/self/maps').read(); "
            "assert 'libsimcuda' not in maps and 'libcuda' not in maps, 'driver loaded at import'; "
            "d = cuproc.Driver(); assert d._lib is None")
    env = dict(os.environ, CUPROC_LIBCUDA=str(sim.path))
    run_python(code, env=env)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_use_after_fork_says_so(sim):
    code = f"""
import os, sys, cuproc
drv = cuproc.Driver(library={str(sim.path)!r})
drv.cuMemAlloc                       # resolved before fork, no cuInit: a child may still use it
pid = os.fork()
if pid == 0:
    drv.cuMemAlloc(cuproc.ffi.new('CUdeviceptr *'), 1)
    os._exit(0)
assert os.waitpid(pid, 0)[1] == 0
assert drv.checked.cuInit(0) is None
pid = os.fork()
if pid == 0:
    try:
        drv.cuMemAlloc
    except cuproc.ForkedProcessError as exc:
        os._exit(7 if 'spawn' in str(exc) else 3)
    os._exit(4)
status = os.waitpid(pid, 0)[1]
sys.exit(os.waitstatus_to_exitcode(status))
"""
    run_python(code, returncode=7)


def test_dump_symbols_with_a_driver(sim, capsys):
    from cuproc.tools.dump_symbols import main
    assert main(["--library", str(sim.path), "--json", "-c", "12.0", "cuLibraryLoadData", "cuGraphGetId",
                 "cuCtxCreate"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["cuCtxCreate"]["status"] == "resolved"
    assert records["cuCtxCreate"]["entry_point"] == "cuCtxCreate_v3"
    assert records["cuGraphGetId"]["status"] == "driver_too_old"
    assert records["cuLibraryLoadData"]["status"] == "resolved"
    assert main(["--library", str(sim.path), "cuCtxCreate"]) == 0
    header = capsys.readouterr().out.splitlines()[2]
    assert "CUDA 13.0 driver at" in header and "cuGetProcAddress_v2" in header


def test_by_value_struct_with_anonymous_union_is_passed_as_its_integer_image(sim):
    """cuMemAdvise/cuMemPrefetchAsync take CUmemLocation by value; cffi's ABI mode cannot, so the
    driver layer passes the same 8 bytes as a uint64_t."""
    from cuproc.driver import struct_as_integer
    loc = cuproc.ffi.new("CUmemLocation *")
    loc.type, loc.id = 1, 3
    assert struct_as_integer(cuproc.ffi.typeof("CUmemLocation"), loc[0]) == (3 << 32) | 1
    assert struct_as_integer(cuproc.ffi.typeof("CUmemLocation"), loc) == (3 << 32) | 1
    drv = Driver(library=sim.path)
    sim.reset_last_called()
    assert drv.cuMemAdvise(0, 16, 1, loc[0]) == 0
    assert sim.last_called() == "cuMemAdvise_v2"
    sim.reset_last_called()
    assert drv.cuMemPrefetchAsync(0, 16, loc[0], 0, cuproc.ffi.NULL) == 0
    assert sim.last_called() == "cuMemPrefetchAsync_v2"


# ----------------------------------------------------------------------------- preload == one name at a time

def _address(published: object) -> int | None:
    """The address a published ``drv.cuX`` calls (a cffi pointer, its trampoline, or an AliasedName's
    ``.function``), or None for the wrappers that have none of their own (cuInit, by-value structs)."""
    bare = published.function if isinstance(published, driver_module.AliasedName) else fastpath.pointer(published)
    return int(cuproc.ffi.cast("uintptr_t", bare)) if isinstance(bare, cuproc.ffi.CData) else None


def _refusal(unavailable: driver_module.Unavailable) -> tuple[type, str]:
    with pytest.raises(CudaError) as info:
        unavailable()
    return type(info.value), str(info.value)


@pytest.mark.slow   # a matrix too: CI runs it
@pytest.mark.parametrize("per_thread", [False, True], ids=["legacy", "ptds"])
@pytest.mark.parametrize(("requested", "driver_version"), [
    ("6.5", 13000), ("11.8", 13000), ("12.4", 13000), ("13.0", 13000), ("13.5", 13000), (None, 12040),
    ("13.0", 11080), ("12.0", 11020)])
def test_preload_answers_as_resolving_each_name_alone(sims, requested, driver_version, per_thread):
    """preload() then every resolution() and drv.cuX equal what a fresh handle gives resolving the names one
    by one: statuses, messages, entry points, typedefs, query versions, pointers, the published object's
    kind and its refusal (cuGetProcAddress_v2, v1 and dlsym drivers; both stream flags; newer-driver features
    below 13.0; a requested version above the driver's)."""
    s = sim_for(sims, driver_version)
    one = Driver(requested, per_thread_default_stream=per_thread, library=str(s.path))
    pre = Driver(requested, per_thread_default_stream=per_thread, library=str(s.path))
    names = list(one.registry)
    expected = {name: one.resolution(name) for name in names}
    early = names[::7]                       # some names resolved and published before preload
    for name in early:
        getattr(pre, name)
    counts = pre.preload()
    statuses: dict[str, int] = {}
    for res in expected.values():
        statuses[res.status] = statuses.get(res.status, 0) + 1
    assert counts == statuses and sum(counts.values()) == len(names)
    for name in names:
        want, got = expected[name], pre.resolution(name)
        assert got._replace(function=None) == want._replace(function=None), name
        if want.function is None:
            assert got.function is None
        else:
            assert cuproc.ffi.typeof(got.function) is cuproc.ffi.typeof(want.function), name
            assert int(cuproc.ffi.cast("uintptr_t", got.function)) == \
                int(cuproc.ffi.cast("uintptr_t", want.function)) != 0, name
        mine, theirs = getattr(pre, name), getattr(one, name)
        assert type(mine) is type(theirs), name
        assert getattr(pre, name) is mine                      # one published object per name
        assert pre.has(name) == one.has(name) == (want.status == "resolved")
        if isinstance(theirs, driver_module.Unavailable):
            assert mine.resolution == got and _refusal(mine) == _refusal(theirs), name
        else:
            assert _address(mine) == _address(theirs) == (None if _address(theirs) is None else
                                                          int(cuproc.ffi.cast("uintptr_t", want.function)))
    assert pre.preload() == counts


def test_preload_after_the_stream_flag_changed_keeps_each_answer_with_its_own_entry(sim):
    """A name preload() asked under one stream flag answers with that flag's entry point, typedef and
    pointer after a second preload() under the other flag, as a resolution cached before the change does;
    the names the first preload() did not take (none here) would follow the new flag."""
    legacy = Driver("13.0", per_thread_default_stream=False, library=str(sim.path))
    ptds = Driver("13.0", per_thread_default_stream=True, library=str(sim.path))
    drv = Driver("13.0", per_thread_default_stream=False, library=str(sim.path))
    first = drv.preload()
    drv.per_thread_default_stream = True
    assert drv.preload() == first
    for name in ("cuMemcpyHtoD", "cuLaunchKernel", "cuStreamBeginCapture", "cuMemAlloc"):
        got, want = drv.resolution(name), legacy.resolution(name)
        assert got._replace(function=None) == want._replace(function=None), name
        assert int(cuproc.ffi.cast("uintptr_t", got.function)) == int(cuproc.ffi.cast("uintptr_t", want.function))
    assert ptds.resolution("cuMemcpyHtoD").entry_point == "cuMemcpyHtoD_v2_ptds"   # the flag does matter here
    assert drv.resolution("cuMemcpyHtoD").entry_point == "cuMemcpyHtoD_v2"


def test_preload_from_several_threads_publishes_one_object_per_name(sim):
    drv = Driver("12.4", library=str(sim.path))
    names = list(drv.registry)
    seen: list[dict[str, object]] = []
    counts: list[dict[str, int]] = []
    start = threading.Barrier(6)

    def worker(k: int) -> None:
        start.wait()
        if k % 2:
            counts.append(drv.preload())
        seen.append({n: getattr(drv, n) for n in (names if k % 3 else reversed(names))})

    run_threads(worker, 6)
    assert len(seen) == 6 and len(counts) == 3 and counts[0] == counts[1] == counts[2]
    assert all(s[n] is seen[0][n] for s in seen for n in names)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_preload_answers_are_dropped_in_a_forked_child(sim):
    code = f"""
import os, sys, cuproc
drv = cuproc.Driver(library={str(sim.path)!r})
assert drv.checked.cuInit(0) is None
assert drv.preload()["resolved"] > 0          # answers taken, nothing published yet
pid = os.fork()
if pid == 0:
    for call in (lambda: drv.cuMemAlloc, drv.preload):
        try:
            call()
        except cuproc.ForkedProcessError:
            continue
        os._exit(3)
    os._exit(7)
status = os.waitpid(pid, 0)[1]
assert drv.cuMemAlloc                         # the parent keeps its answers
sys.exit(os.waitstatus_to_exitcode(status))
"""
    run_python(code, returncode=7)
