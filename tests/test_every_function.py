"""Issue 10 on the simulated driver: the profiler/GL/EGL/VDPAU symbols, Windows-only entries,
header aliases, and functions the user declares."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

import cuproc
from cuproc import fastpath
from cuproc.driver import AliasedName, Driver
from cuproc.errors import CudaError, DriverTooOldError, SymbolNotFoundError
from cuproc.registry import NOT_ON_THIS_PLATFORM, default_registry
from cuproc.tools import dump_symbols
from conftest import HEADERS
from simdriver import build
from subproc import run_python

# One symbol per new typedef header, with the entry CUDA 13.0 selects (from the header text's rule).
NEW_SYMBOLS = {"cuProfilerStart": "cuProfilerStart", "cuProfilerStop": "cuProfilerStop",
               "cuGLGetDevices": "cuGLGetDevices_v2", "cuGraphicsGLRegisterBuffer": "cuGraphicsGLRegisterBuffer",
               "cuEGLStreamConsumerConnect": "cuEGLStreamConsumerConnect",
               "cuVDPAUGetDevice": "cuVDPAUGetDevice", "cuVDPAUCtxCreate": "cuVDPAUCtxCreate_v2"}
# Only in a newer simulated driver: cuFooSim from 13.5 (per-thread entry too), as in the guide's example.
EXTRA = (("cuFooSim", 13050, "cuFooSim", "cuFooSim_ptsz"),)
CALL = "CUresult(*)(void)"


@pytest.fixture(scope="module")
def newer(tmp_path_factory):
    s = build(tmp_path_factory.mktemp("simnewer"), "v2", EXTRA)
    return s


@pytest.fixture()
def sim135(newer):
    newer.set_version(13050)
    newer.set_result(0)
    return newer


def test_provenance_lists_stand_ins_windows_only_and_aliases():
    prov = json.loads((HEADERS / "provenance.json").read_text())
    assert {"cuWGLGetDevice", "cuD3D9GetDevice", "cuD3D10GetDevices", "cuD3D11GetDevice",
            "cuGraphicsD3D11RegisterResource"} <= set(prov["windows_only"])
    assert len(prov["windows_only"]) == 45 and not any(n.startswith(("cuGL", "cuEGL", "cuVDPAU"))
                                                       for n in prov["windows_only"])
    assert prov["header_aliases"]["cuGraphInstantiate"] == {
        v: "cuGraphInstantiateWithFlags" for v in ("12.0", "12.4", "12.9", "13.0", "13.5")}
    assert {"GLuint", "GLenum", "EGLStreamKHR", "VdpDevice", "ID3D11Device"} <= set(prov["stand_in_types"])
    assert "HGPUNV" not in prov["stand_in_types"]                 # cudaGL.h declares it (_WIN32: void *)
    text = (HEADERS / "cuda_pfn.h").read_text()
    for name in ("PFN_cuProfilerStart_v4000", "PFN_cuGLGetDevices_v6050", "PFN_cuEGLStreamConsumerConnect_v7000",
                 "PFN_cuVDPAUGetDevice_v3010", "PFN_cuWGLGetDevice_v2020"):
        assert f"(*{name})" in text
    assert prov["symbol_headers"]["cuProfilerStart"] == "cudaProfilerTypedefs.h"
    assert prov["symbol_headers"]["cuVDPAUGetDevice"] == "cudaVDPAUTypedefs.h"
    assert prov["symbol_headers"]["cuEGLStreamConsumerConnect"] == "cudaEGLTypedefs.h"
    assert prov["symbol_headers"]["cuD3D9GetDevice"] == "cudaD3D9Typedefs.h"
    assert len(prov["symbol_headers"]) == 76 and "cuMemAlloc" not in prov["symbol_headers"]
    for tk in prov["toolkits"]:
        assert {"cudaGLTypedefs.h", "cudaEGLTypedefs.h", "cudaVDPAUTypedefs.h",
                "cudaProfilerTypedefs.h", "cudaD3D11Typedefs.h", "cudaD3D9.h"} <= set(tk["headers"])
        assert "win_amd64" in tk["source"]


def test_gl_egl_vdpau_types_parse_as_declared():
    ffi = cuproc.ffi
    assert ffi.sizeof("GLuint") == ffi.sizeof("GLenum") == 4
    assert ffi.typeof("EGLStreamKHR").kind == "pointer"
    assert ffi.sizeof("VdpDevice") == 4
    assert ffi.sizeof("CUeglFrame") > 0
    assert ffi.typeof("PFN_cuVDPAUGetDevice_v3010").args[2].cname == "struct VdpGetProcAddress_opaque *"
    assert ffi.typeof("PFN_cuD3D11GetDevice_v3000").args[1].cname == "struct IDXGIAdapter *"
    assert ffi.typeof("PFN_cuWGLGetDevice_v2020").args[1].cname == "void *"      # HGPUNV as cudaGL.h has it
    assert cuproc.driver.CU_D3D9_DEVICE_LIST_ALL == 1


def test_registry_selects_the_new_symbols():
    reg = default_registry()
    for name, entry in NEW_SYMBOLS.items():
        assert reg.select(name, "13.0").entry_point == entry
    assert reg.select("cuGLMapBufferObject", "13.0", per_thread=True).entry_point == "cuGLMapBufferObject_v2_ptds"


def test_windows_only_symbol_is_not_on_this_platform(sim):
    sel = default_registry().select("cuWGLGetDevice", "13.0")
    assert sel.symbol.windows_only and sel.availability == NOT_ON_THIS_PLATFORM and sel.entry_point is None
    drv = Driver("13.0", library=sim.path)
    assert not drv.has("cuWGLGetDevice")
    assert drv.resolution("cuWGLGetDevice").status == NOT_ON_THIS_PLATFORM
    with pytest.raises(SymbolNotFoundError, match="Windows"):
        drv.cuWGLGetDevice(cuproc.ffi.NULL, cuproc.ffi.NULL)
    with pytest.raises(SymbolNotFoundError, match="Windows"):
        drv.checked.cuWGLGetDevice(cuproc.ffi.NULL, cuproc.ffi.NULL)
    assert drv.preload().get(NOT_ON_THIS_PLATFORM) == 45
    with pytest.raises(SymbolNotFoundError, match="Windows"):
        drv.cuD3D11GetDevice(cuproc.ffi.NULL, cuproc.ffi.NULL)


@pytest.mark.parametrize("per_thread", [False, True])
def test_new_symbols_resolve_to_the_driver_entry(sim, per_thread):
    drv = Driver("13.0", per_thread_default_stream=per_thread, library=sim.path)
    for name, entry in NEW_SYMBOLS.items():
        sim.reset_last_called()
        assert cuproc.ffi.cast(CALL, fastpath.pointer(getattr(drv, name)))() == 0
        assert sim.last_called() == entry
    sim.reset_last_called()
    cuproc.ffi.cast(CALL, fastpath.pointer(drv.cuGLMapBufferObjectAsync))()
    assert sim.last_called() == ("cuGLMapBufferObjectAsync_v2_ptsz" if per_thread else "cuGLMapBufferObjectAsync_v2")


def test_dump_symbols_shows_alias_and_windows_only(capsys):
    assert dump_symbols.main(["--no-driver", "--json", "-c", "12.0", "cuGraphInstantiate", "cuWGLGetDevice"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["cuGraphInstantiate"]["header_alias"] == "cuGraphInstantiateWithFlags"
    assert records["cuGraphInstantiate"]["entry_point"] == "cuGraphInstantiate_v2"
    assert records["cuWGLGetDevice"]["windows_only"] is True and records["cuWGLGetDevice"]["entry_point"] is None
    assert records["cuWGLGetDevice"]["header"] == "cudaGLTypedefs.h"
    assert records["cuGraphInstantiate"]["header"] == "cudaTypedefs.h"
    dump_symbols.main(["--no-driver", "--json", "-c", "11.8", "cuGraphInstantiate"])
    assert json.loads(capsys.readouterr().out)[0]["header_alias"] is None
    dump_symbols.main(["--no-driver", "-c", "13.0", "cuGraphInstantiate", "cuWGLGetDevice"])
    out = capsys.readouterr().out
    assert re.search(r"^cuGraphInstantiate .*cuGraphInstantiateWithFlags", out, re.M)
    assert re.search(r"^cuWGLGetDevice .*Windows only", out, re.M)


# --------------------------------------------------------------------------- header aliases

def test_registry_header_alias_by_version():
    reg = default_registry()
    assert reg.header_alias("cuGraphInstantiate", "11.8") is None
    assert reg.header_alias("cuGraphInstantiate", "12.0") == "cuGraphInstantiateWithFlags"
    assert reg.header_alias("cuGraphInstantiate", "13.5") == "cuGraphInstantiateWithFlags"
    assert reg.header_alias("cuMemAlloc", "13.0") is None          # cuMemAlloc_v2 is an ABI name
    assert reg.aliased_names == {"cuGraphInstantiate"}


def test_aliased_name_calls_what_cugetprocaddress_returns(sim):
    drv = Driver("12.0", library=sim.path)
    fn = drv.cuGraphInstantiate
    assert "cuGraphInstantiateWithFlags" in repr(fn) and "cuGraphInstantiate_v2" in repr(fn)
    assert "cuGraphInstantiateWithFlags" in fn.__doc__
    sim.reset_last_called()
    null = cuproc.ffi.NULL
    assert fn(null, null, null, null, 0) == 0                      # the five-argument 11.0 ABI
    assert sim.last_called() == "cuGraphInstantiate_v2"
    assert drv.resolution("cuGraphInstantiate").entry_point == "cuGraphInstantiate_v2"


@pytest.mark.parametrize("checked", [False, True])
def test_wrong_arity_on_aliased_name_names_the_alias(sim, checked):
    drv = Driver("13.0", library=sim.path)
    ns = drv.checked if checked else drv
    sim.reset_last_called()
    with pytest.raises(TypeError, match="cuGraphInstantiateWithFlags"):
        ns.cuGraphInstantiate(cuproc.ffi.NULL, cuproc.ffi.NULL, 0)   # the C macro's three arguments
    assert sim.last_called() == ""                                   # nothing reached the driver
    with pytest.raises(TypeError) as info:                           # a right count, wrong type: cffi's own
        ns.cuGraphInstantiate(1, 2, 3, 4, 5)
    assert "cuGraphInstantiateWithFlags" not in str(info.value)


def test_unaliased_versions_stay_bare_pointers(sim):
    """Not AliasedName: the cffi pointer itself, or its trampoline where the fast path is on."""
    def bare(f: object) -> bool:
        return not isinstance(f, AliasedName) and isinstance(fastpath.pointer(f), cuproc.ffi.CData)
    drv = Driver("11.8", library=sim.path)
    assert bare(drv.cuGraphInstantiate)
    assert bare(drv.resolve("cuGraphInstantiate"))
    assert "cuGraphInstantiateWithFlags" in repr(drv.resolve("cuGraphInstantiate", "12.4"))
    assert bare(Driver("13.0", library=sim.path).cuMemAlloc)


# --------------------------------------------------------------------------- declare

def test_declare_a_function_only_a_newer_driver_has(sim135):
    drv = Driver("13.0", library=sim135.path)
    assert "cuFooSim" not in drv.registry
    fn = drv.declare("cuFooSim", "CUresult (*)(CUdevice *, int)")
    assert cuproc.ffi.typeof(fn).cname == "enum cudaError_enum(*)(int *, int)"
    sim135.reset_last_called()
    assert fn(cuproc.ffi.NULL, 0) == 0 and sim135.last_called() == "cuFooSim"
    assert drv.cuFooSim == fn and drv.is_declared("cuFooSim")
    sim135.set_result(1)
    with pytest.raises(CudaError) as info:
        drv.checked.cuFooSim(cuproc.ffi.NULL, 0)
    assert info.value.call == "cuFooSim"


def test_declare_as_typedef_text_or_cffi_type(sim135):
    drv = Driver(library=sim135.path)
    a = drv.declare("cuFooSim", "typedef CUresult (CUDAAPI *PFN_cuFooSim_v13050)(int x);")
    b = drv.declare("cuFooSim", cuproc.ffi.typeof("CUresult(*)(int)"), version="13.5")
    assert cuproc.ffi.typeof(a) is cuproc.ffi.typeof(b) and a == b


def test_declare_uses_the_stream_flag(sim135):
    drv = Driver(per_thread_default_stream=True, library=sim135.path)
    sim135.reset_last_called()
    drv.declare("cuFooSim", "CUresult (*)(void)")()
    assert sim135.last_called() == "cuFooSim_ptsz"


def test_declare_errors_name_the_versions(sim135):
    drv = Driver(library=sim135.path)
    with pytest.raises(SymbolNotFoundError, match=r"13\.0") as info:
        drv.declare("cuFooSim", "CUresult (*)(void)", version="13.0")        # below its first version
    assert not isinstance(info.value, DriverTooOldError)
    with pytest.raises(DriverTooOldError, match=r"14\.0.*13\.5"):
        drv.declare("cuFooSim", "CUresult (*)(void)", version="14.0")        # above the driver's
    with pytest.raises(SymbolNotFoundError, match="cuNoSuchThing"):
        drv.declare("cuNoSuchThing", "CUresult (*)(void)")
    assert not drv.is_declared("cuNoSuchThing")
    with pytest.raises(AttributeError):
        drv.cuNoSuchThing


def test_declare_on_an_older_driver_that_lacks_it(newer):
    newer.set_version(13000)
    drv = Driver(library=newer.path)
    with pytest.raises(SymbolNotFoundError, match=r"CUDA 13\.0 driver"):
        drv.declare("cuFooSim", "CUresult (*)(void)")


@pytest.mark.parametrize("signature, why", [
    ("garbage(", "cannot parse"), ("int (*)(int)", "return CUresult"), ("CUdevice", "not a function"),
    (3, "C text or a cffi type")])
def test_declare_rejects_bad_signatures(sim, signature, why):
    with pytest.raises(TypeError, match=why):
        Driver(library=sim.path).declare("cuFooSim", signature)


def test_declare_a_registry_name_needs_the_same_signature(sim):
    drv = Driver("13.0", library=sim.path)
    fn = drv.declare("cuMemAlloc", "CUresult (*)(CUdeviceptr *, size_t)", version="13.0")
    assert cuproc.ffi.cast("void *", fastpath.pointer(fn)) == cuproc.ffi.cast("void *", fastpath.pointer(drv.cuMemAlloc))
    with pytest.raises(TypeError) as info:
        drv.declare("cuMemAlloc", "CUresult (*)(unsigned int *, unsigned int)", version="13.0")
    text = str(info.value)
    assert "PFN_cuMemAlloc_v3020" in text and "unsigned int *" in text      # both signatures shown
    with pytest.raises(TypeError, match="PFN_cuGraphInstantiate_v11000"):
        drv.declare("cuGraphInstantiate", "CUresult (*)(CUgraphExec *, CUgraph, unsigned long long)")
    assert not drv.is_declared("cuMemAlloc")


def test_declare_refuses_names_that_are_not_driver_functions(sim):
    drv = Driver(library=sim.path)
    for name in ("open", "checked", "cu Foo", ""):
        with pytest.raises(ValueError, match="not a driver function name"):
            drv.declare(name, "CUresult (*)(void)")
    assert callable(drv.open)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_declared_function_refuses_after_fork(sim135):
    code = f"""
import ctypes, os, sys, cuproc
ctypes.CDLL({str(sim135.path)!r}).sim_set_driver_version(13050)   # the same library cuproc opens
drv = cuproc.Driver(library={str(sim135.path)!r})
drv.declare("cuFooSim", "CUresult (*)(void)")
assert drv.checked.cuInit(0) is None
pid = os.fork()
if pid == 0:
    codes = 0
    for get in (lambda: drv.cuFooSim, lambda: drv.checked.cuFooSim,
                lambda: drv.declare("cuFooSim", "CUresult (*)(void)")):
        try:
            get()
        except cuproc.ForkedProcessError:
            codes += 1
    os._exit(codes)
status = os.waitpid(pid, 0)[1]
sys.exit(os.waitstatus_to_exitcode(status))
"""
    run_python(code, returncode=3)


# --------------------------------------------------------------------------- review fixes

def test_reading_a_name_while_it_is_declared_never_says_forked(sim135):
    """A reader racing declare() gets AttributeError (not yet declared) or the function, never
    ForkedProcessError in a process that did not fork."""
    import threading
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[BaseException] = []
    try:
        for _ in range(1500):
            drv = Driver(library=sim135.path).open()
            go = threading.Event()

            def reader(drv: Driver = drv, go: threading.Event = go) -> None:
                go.wait()
                for _ in range(2000):
                    try:
                        drv.cuFooSim
                        return
                    except AttributeError:
                        pass
                    except Exception as exc:  # noqa: BLE001 - the test collects what went wrong
                        errors.append(exc)
                        return
            thread = threading.Thread(target=reader)
            thread.start()
            go.set()
            drv.declare("cuFooSim", "CUresult (*)(int)")
            thread.join()
            if errors:
                break
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors


def test_declared_by_value_struct_signature_is_callable(sim135):
    """cffi's ABI mode cannot pass CUmemLocation by value; declare() converts it as the registry does."""
    drv = Driver(library=sim135.path)
    fn = drv.declare("cuFooSim", "CUresult (*)(CUmemLocation, unsigned int)")
    loc = cuproc.ffi.new("CUmemLocation *", {"type": 1, "id": 3})
    sim135.reset_last_called()
    assert fn(loc[0], 0) == 0 and fn(loc, 0) == 0                 # a struct or a pointer to one
    assert sim135.last_called() == "cuFooSim"
    assert drv.cuFooSim is fn and drv.checked.cuFooSim(loc[0], 0) is None


def test_declared_names_are_known_to_has_and_resolution(sim135):
    drv = Driver(library=sim135.path)
    assert not drv.has("cuFooSim")
    drv.declare("cuFooSim", "CUresult (*)(void)", version="13.5")
    assert drv.has("cuFooSim")
    res = drv.resolution("cuFooSim")
    assert res.status == "resolved" and res.entry_point == "cuFooSim" and str(res.query_version) == "13.5"
    assert drv.resolution("cuFooSim", "13.5") == res
    with pytest.raises(KeyError):
        drv.resolution("cuNotDeclaredAnywhere")


def test_declaring_again_replaces_the_module_names_and_checked_wrappers(sim135):
    from cuproc import driver as module
    drv = Driver(library=sim135.path)
    cuproc.set_default_driver(drv)
    try:
        drv.declare("cuFooSim", "CUresult (*)(int)")
        one, checked_one = module.cuFooSim, module.checked.cuFooSim
        assert len(cuproc.ffi.typeof(one).args) == 1
        two = drv.declare("cuFooSim", "CUresult (*)(int, int)")
        assert module.cuFooSim is two                                 # not the stale one-argument pointer
        assert module.checked.cuFooSim is not checked_one
        assert module.checked.cuFooSim(1, 2) is None
        with pytest.raises(TypeError):
            module.checked.cuFooSim(1)
        other = Driver(library=sim135.path)                           # not the default: module untouched
        other.declare("cuFooSim", "CUresult (*)(void)")
        assert module.cuFooSim is two
    finally:
        cuproc.set_default_driver(None)


def test_checked_wrapper_is_built_from_the_function_published_under_the_lock(sim135):
    """A checked wrapper built while declare() replaces the function wraps the new one: the lookup
    and the store happen under the handle's lock, which declare() holds while it swaps."""
    import threading
    drv = Driver(library=sim135.path)
    drv.declare("cuFooSim", "CUresult (*)(int)")
    checked = drv.checked
    done = threading.Event()
    real_getattr = Driver.__getattribute__
    swapped = []

    class Racing(Driver):
        def __getattribute__(self, name: str):  # the first read of cuFooSim lets declare() run in between
            value = real_getattr(self, name)
            if name == "cuFooSim" and not swapped:
                swapped.append(True)
                t = threading.Thread(target=lambda: (drv.declare("cuFooSim", "CUresult (*)(int, int)"), done.set()))
                t.start()
                t.join(0.2)
            return value
    drv.__class__ = Racing
    try:
        wrapper = checked.cuFooSim
        assert done.wait(5)
        assert wrapper(1, 2) is None                                  # wraps the (int, int) declare() published
        assert drv.checked.cuFooSim is wrapper
    finally:
        drv.__class__ = Driver


def test_declare_names_a_foreign_ffi_and_runtime_names():
    import cffi
    other = cffi.FFI()
    other.cdef("typedef enum cudaError_enum { CUDA_SUCCESS = 0 } CUresult;")
    with pytest.raises(TypeError, match="another FFI"):
        Driver().declare("cuFooSim", other.typeof("CUresult(*)(int)"))
    for name in ("cudaMalloc", "cudaGetDeviceCount"):
        with pytest.raises(ValueError, match="runtime API"):
            Driver().declare(name, "CUresult (*)(void)")


def test_aliased_name_exposes_its_cffi_pointer(sim):
    drv = Driver("12.0", library=sim.path)
    fn = drv.cuGraphInstantiate
    assert not isinstance(fn, cuproc.ffi.CData)
    assert cuproc.ffi.typeof(fn.function) is cuproc.ffi.typeof("PFN_cuGraphInstantiate_v11000")
    assert cuproc.ffi.cast("void *", fn.function) == cuproc.ffi.cast("void *", drv.resolution("cuGraphInstantiate").function)
    assert ".function" in type(fn).__doc__


def test_dump_symbols_takes_aliases_from_the_drivers_registry(sim):
    from cuproc.registry import Registry
    reg = default_registry()
    mine = Registry.from_typedefs([v.typedef for v in reg["cuGraphInstantiate"].variants],
                                  header_aliases={"cuGraphInstantiate": [("11.0", "cuSomethingElse")]})
    drv = Driver("12.0", library=sim.path, registry=mine)
    sel = mine.select("cuGraphInstantiate", "12.0")
    assert dump_symbols.symbol_record(sel, drv)["header_alias"] == "cuSomethingElse"
    assert dump_symbols.symbol_record(reg.select("cuGraphInstantiate", "12.0"), None)["header_alias"] == \
        "cuGraphInstantiateWithFlags"
