"""Issue 10 on the real driver: the profiler/GL/EGL/VDPAU symbols against dlsym, the profiler,
a function declared by hand, and the cuGraphInstantiate header alias.  Marked ``gpu``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import cuproc
from cuproc import fastpath
from cuproc import loader, profiler
from cuproc.driver import Driver
from cuproc.errors import DriverTooOldError, SymbolNotFoundError
from cuproc.registry import default_registry
from rules import expected_entry, typedefs_by_symbol

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

ffi = cuproc.ffi


def address(fn) -> int:
    return int(ffi.cast("uintptr_t", fn))


@pytest.fixture(scope="module")
def libcuda():
    return loader.open_library()


def new_header_symbols() -> list[str]:
    reg = default_registry()
    return [n for n in reg if reg[n].header != "cudaTypedefs.h" and not reg[n].windows_only]


def handed_out_in_recording(driver_version: int, per_thread: bool) -> set[str] | None:
    """The names tests/data/proc_addresses-<driver>.json says this driver hands out at its own version
    under the flag (None when there is no recording of this driver version)."""
    path = Path(__file__).resolve().parent / "data" / f"proc_addresses-{driver_version}.json"
    if not path.exists():
        return None
    recording = json.loads(path.read_text())
    out = set()
    for name, symbol in recording["symbols"].items():
        runs = symbol["2" if per_thread else "1"]
        runs = symbol["0"] if runs == "=0" else runs
        answer = [a for v, a in runs if v <= driver_version][-1]
        if not answer.startswith(("status:", "rc:")):
            out.add(name)
    return out


@pytest.mark.parametrize("per_thread", [False, True], ids=["legacy", "ptds"])
@pytest.mark.parametrize("requested", ["11.8", "12.0", "12.9", "13.0"])
def test_new_header_symbols_equal_dlsym(libcuda, requested, per_thread):
    """Each profiler/GL/EGL/VDPAU function the driver exports resolves to dlsym of the expected entry."""
    drv = Driver(requested, per_thread_default_stream=per_thread)
    typedefs = typedefs_by_symbol()
    resolved, absent, declined, wrong = [], [], [], []
    for name in new_header_symbols():
        entry = expected_entry(typedefs[name], name, int(drv.version), per_thread)
        exported = libcuda.symbol_address(entry)
        res = drv.resolution(name)
        if res.status == "resolved":
            resolved.append(name)
            if res.entry_point != entry or address(res.function) != exported:
                wrong.append((name, res.entry_point, entry, hex(address(res.function)), exported and hex(exported)))
        elif res.status != "symbol_not_found":
            wrong.append((name, res.status, entry, res.message))
        elif exported is not None:
            declined.append(name)       # exported, but cuGetProcAddress does not hand it out
        else:
            absent.append(name)
    print(f"\nnew-header symbols at {requested} ({'ptds' if per_thread else 'legacy'}): {len(resolved)} resolved "
          f"= dlsym; not exported: {absent}; exported but not resolved: {declined}")
    assert not wrong, wrong
    assert not declined, f"exported but cuGetProcAddress did not hand them out: {declined}"
    recorded = handed_out_in_recording(int(drv.driver_version), per_thread)
    if recorded is not None:
        assert set(resolved) == recorded & set(new_header_symbols())   # 30 of the 31 Linux ones on 580
    else:
        assert len(resolved) >= 25      # no recording of this driver: the 580 driver exports 30 of 31


def test_windows_only_is_refused_on_linux(libcuda):
    drv = Driver()
    assert libcuda.symbol_address("cuWGLGetDevice") is None
    assert not drv.has("cuWGLGetDevice")
    with pytest.raises(SymbolNotFoundError, match="Windows"):
        drv.cuWGLGetDevice(ffi.new("CUdevice *"), ffi.NULL)


def test_profiler_calls_reach_the_driver_and_succeed(primary):
    drv = cuproc.driver.default_driver()
    assert drv.cuProfilerStart() == 0      # CUDA_SUCCESS with a current context, tool or not
    assert drv.cuProfilerStop() == 0
    profiler.start()
    profiler.stop()
    with profiler.range(primary.context) as ctx:
        assert ctx is primary.context
    out = ffi.new("CUcontext *")
    drv.checked.cuCtxGetCurrent(out)
    assert out[0] == primary.context.handle


def test_declare_by_hand_equals_dlsym_and_calls(libcuda, primary):
    """A handle whose registry lacks cuDeviceGetCount and cuCtxCreate declares them as the guide's cuFoo."""
    drv = Driver(registry=default_registry().without(["cuDeviceGetCount", "cuCtxCreate"]))
    assert drv.registry["cuWGLGetDevice"].windows_only                # everything else as the default has it
    assert "cuDeviceGetCount" not in drv.registry
    count = drv.declare("cuDeviceGetCount", "CUresult (*)(int *)")
    assert address(count) == libcuda.symbol_address("cuDeviceGetCount")
    n = ffi.new("int *")
    assert count(n) == 0
    reference = ffi.new("int *")
    cuproc.driver.default_driver().checked.cuDeviceGetCount(reference)
    assert n[0] == reference[0] >= 1
    drv.checked.cuDeviceGetCount(n)                                   # checked form after declare
    # the version picks the ABI, as cuGetProcAddress does: 11.4's cuCtxCreate is cuCtxCreate_v3
    v3 = drv.declare("cuCtxCreate", "CUresult (*)(CUcontext *, CUexecAffinityParam *, int, unsigned int, CUdevice)",
                     version="11.4")
    assert address(v3) == libcuda.symbol_address("cuCtxCreate_v3")
    v4 = drv.declare("cuCtxCreate", "CUresult (*)(CUcontext *, CUctxCreateParams *, unsigned int, CUdevice)",
                     version="12.5")
    assert address(v4) == libcuda.symbol_address("cuCtxCreate_v4")
    with pytest.raises(DriverTooOldError):
        drv.declare("cuDeviceGetCount", "CUresult (*)(int *)", version=int(drv.driver_version) + 1000)
    with pytest.raises(SymbolNotFoundError):
        drv.declare("cuNoSuchFunctionAnywhere", "CUresult (*)(void)")
    full = Driver()
    declared = full.declare("cuMemAlloc", "CUresult (*)(CUdeviceptr *, size_t)")
    resolved = full.resolve("cuMemAlloc", full.driver_version)
    assert ffi.cast("void *", fastpath.pointer(declared)) == ffi.cast("void *", fastpath.pointer(resolved))


def test_graph_instantiate_alias_on_the_real_driver(libcuda, primary):
    drv = Driver("12.0")
    fn = drv.cuGraphInstantiate
    assert address(fn.function) == libcuda.symbol_address("cuGraphInstantiate_v2")
    graph = ffi.new("CUgraph *")
    drv.checked.cuGraphCreate(graph, 0)
    execs = [ffi.new("CUgraphExec *"), ffi.new("CUgraphExec *")]
    try:
        with pytest.raises(TypeError, match="cuGraphInstantiateWithFlags"):
            drv.checked.cuGraphInstantiate(execs[0], graph[0], 0)      # what C means: three arguments
        drv.checked.cuGraphInstantiate(execs[0], graph[0], ffi.NULL, ffi.NULL, 0)   # the 11.0 ABI
        drv.checked.cuGraphInstantiateWithFlags(execs[1], graph[0], 0)
        assert execs[0][0] != ffi.NULL and execs[1][0] != ffi.NULL
    finally:
        for e in execs:
            if e[0] != ffi.NULL:
                drv.checked.cuGraphExecDestroy(e[0])
        drv.checked.cuGraphDestroy(graph[0])
