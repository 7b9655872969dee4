"""Compiling from source on CPU: NVRTC loading, Program/ObjectCode, name expressions, includes, errors,
the target and architecture rules, the PTX ISA rule, and compiled code on the fake driver."""
from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import pytest

import cuproc
from cuproc import nvrtc as nv
from cuproc.program import ObjectCode, Program, normalize_arch
from cuproc.ptx_isa import NEWEST_KNOWN_CUDA, PtxIsa, driver_accepts, max_ptx_isa, ptx_isa_of
from cuproc.version import CudaVersion
from nvrtc_testing import ARCH, AXPY, SCALE_H, build_stub, needs_nvrtc, private_cache  # noqa: F401
from subproc import run_python

ROOT = Path(__file__).resolve().parent.parent
V = CudaVersion


# ----------------------------------------------------------------------------- loading NVRTC

def test_import_cuproc_opens_no_nvrtc():
    """import cuproc and reaching cuproc.Program load nothing of NVRTC; the first compile opens it."""
    proc = run_python(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        maps = lambda: open("/proc/self/maps").read()
        import cuproc
        assert not [m for m in sys.modules if "nvrtc" in m], [m for m in sys.modules if "nvrtc" in m]
        assert "libnvrtc" not in maps()
        cuproc.Program, cuproc.compile_kernel, cuproc.CompileError
        assert "libnvrtc" not in maps(), "reaching the names opened NVRTC"
        code = cuproc.Program("__global__ void k() {{}}").compile(arch={ARCH!r}, cache=False)
        print("opened", "libnvrtc" in maps(), code.kind)
    """, env={**os.environ, "CUPROC_NVRTC_CACHE": "0"}, returncode=None)
    if not nv.is_nvrtc_available():
        assert "NvrtcNotFoundError" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["opened", "True", "cubin"]


def test_without_nvrtc_the_rest_works_and_compiling_says_what_to_install(tmp_path):
    missing = tmp_path / "nowhere" / "libnvrtc.so.13"
    proc = run_python(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import cuproc
        from cuproc.nvrtc import is_nvrtc_available
        assert cuproc.CudaVersion.parse("13.0") == cuproc.CudaVersion(13, 0)
        assert cuproc.driver.CU_CTX_SCHED_AUTO == 0 and cuproc.ffi.new("CUdeviceptr *")[0] == 0
        assert cuproc.default_registry().select("cuMemAlloc", cuproc.CudaVersion(12, 0)) is not None
        assert not is_nvrtc_available()
        for cache in (False, None):
            try:
                cuproc.Program("__global__ void k() {{}}").compile(arch="sm_80", cache=cache)
            except cuproc.NvrtcNotFoundError as exc:
                print(str(exc).replace(chr(10), " "))
            else:
                raise SystemExit("compiled without NVRTC")
    """, env={**os.environ, "CUPROC_LIBNVRTC": str(missing), "CUPROC_NVRTC_CACHE_DIR": str(tmp_path / "c")})
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert "pip install 'cuproc[nvrtc]'" in line and "CUPROC_LIBNVRTC" in line and str(missing) in line


def test_candidates_prefer_the_variable_then_the_wheel(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPROC_LIBNVRTC", "/opt/x/libnvrtc.so.12")
    assert nv.candidate_paths() == ["/opt/x/libnvrtc.so.12"]
    monkeypatch.delenv("CUPROC_LIBNVRTC")
    site = tmp_path / "site"
    for sub, name in (("cu13/lib", "libnvrtc.so.13"), ("cu12/lib", "libnvrtc.so.12"),
                      ("cuda_nvrtc/lib", "libnvrtc.so.11.2"), ("cu13/lib", "libnvrtc-builtins.so.13.5")):
        (site / "nvidia" / sub).mkdir(parents=True, exist_ok=True)
        (site / "nvidia" / sub / name).write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(site)])
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    paths = nv.candidate_paths()
    wheel = [p for p in paths if p.startswith(str(site))]
    assert [Path(p).name for p in wheel] == ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2"]
    assert paths.index(wheel[-1]) < paths.index("libnvrtc.so.13")   # the dynamic linker's search comes last
    loc = nv.locate()
    assert loc is not None and loc.path == wheel[0]


def _wheel_site(monkeypatch, tmp_path, older: str) -> Path:
    """A sys.path of one site with the CUDA 13 NVRTC wheel's file and an older one (``older``, in
    nvidia/cuda_nvrtc/lib), no toolkit named and no CUPROC_LIBNVRTC; the site."""
    site = tmp_path / "site"
    for sub, name in (("cu13/lib", "libnvrtc.so.13"), ("cuda_nvrtc/lib", older)):
        (site / "nvidia" / sub).mkdir(parents=True, exist_ok=True)
        (site / "nvidia" / sub / name).write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(site)])
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    monkeypatch.delenv("CUPROC_LIBNVRTC", raising=False)
    return site


def test_the_drivers_major_is_preferred_when_several_are_installed(monkeypatch, tmp_path):
    """L3: NVRTC 12 for a CUDA 12 driver even where the 13 wheel is installed too; the order holds otherwise."""
    site = _wheel_site(monkeypatch, tmp_path, "libnvrtc.so.12")
    assert Path(nv.candidate_paths()[0]).name == "libnvrtc.so.13"
    assert Path(nv.candidate_paths(prefer_major=13)[0]).name == "libnvrtc.so.13"
    paths = nv.candidate_paths(prefer_major=12)
    wheel = [Path(p).name for p in paths if p.startswith(str(site))]
    assert wheel == ["libnvrtc.so.12", "libnvrtc.so.13"] and paths[0].startswith(str(site))
    assert paths.index("libnvrtc.so.12") < paths.index("libnvrtc.so.13")   # the linker's names too
    loc = nv.locate(12)
    assert loc is not None and Path(loc.path).name == "libnvrtc.so.12"


def test_a_compile_is_stored_under_the_build_that_compiled_it(tmp_path, monkeypatch):
    """L4: the file located before opening (its identity keys the first look-up) is not always the one that
    opens (replaced meanwhile): what was compiled goes under the opened library's build, never the located one."""
    from cuproc.compile_cache import CompileCache
    stub = build_stub(tmp_path)
    cache = CompileCache(tmp_path / "cache")
    real = nv.location_of(str(stub))
    assert real is not None
    located = nv.Location(real.path, real.size + 1, real.mtime_ns, real.device, real.inode)   # a lie: another build
    monkeypatch.setattr(nv, "location_of", lambda path: located)
    prog = Program("__global__ void k() {}")
    first = prog.compile(arch=ARCH, target="ptx", cache=cache, nvrtc=stub)
    assert first.nvrtc_version == V(11, 8) and not first.from_cache
    assert len(cache.entries()) == 1
    monkeypatch.undo()                                                # the truth: the key is the opened build's
    again = prog.compile(arch=ARCH, target="ptx", cache=cache, nvrtc=stub)
    assert again.from_cache and again.cache_key == first.cache_key


def test_a_bare_library_name_is_not_looked_for_in_the_current_directory(tmp_path, monkeypatch):
    """The dynamic linker resolves ``libnvrtc.so.13`` by its own search, never from the current directory:
    a file of that name there is not the NVRTC that opens, and must not name the build a key holds."""
    (tmp_path / "libnvrtc.so.13").write_bytes(b"not this one")
    monkeypatch.chdir(tmp_path)
    assert nv.location_of("libnvrtc.so.13") is None
    assert nv.location_of("./libnvrtc.so.13") is not None   # a path, as CUPROC_LIBNVRTC may give one


def test_an_nvrtc_opened_by_a_bare_name_has_the_identity_of_its_file(tmp_path):
    """The library the dynamic linker found by name is named by the file it mapped (/proc/self/maps), so
    that the key of what it compiles is its build, as for a library opened by path."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("no /proc/self/maps: a library opened by a bare name is keyed by its name and version")
    stub = build_stub(tmp_path)
    script = f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from cuproc import nvrtc as nv
        lib = nv.open_nvrtc({stub.name!r})
        print(lib.identity == nv.location_of({os.path.realpath(stub)!r}).identity, lib.identity)
    """
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    out = run_python(script, env=env).stdout.split()
    assert out[0] == "True" and out[1].startswith(os.path.realpath(stub) + "|")


def test_a_replacement_keeping_size_and_time_is_another_build(tmp_path):
    """A build copied over another with its size and modification time kept (``cp -p`` of a rebuilt file,
    an installer restoring times) is another file: the identity holds the device and inode too."""
    lib = build_stub(tmp_path)
    before = nv.location_of(str(lib))
    assert before is not None
    other = tmp_path / "other.so"
    other.write_bytes(lib.read_bytes())
    os.utime(other, ns=(before.mtime_ns, before.mtime_ns))
    os.replace(other, lib)                                   # same path, size and time; a new inode
    after = nv.location_of(str(lib))
    assert after is not None and (after.size, after.mtime_ns) == (before.size, before.mtime_ns)
    assert after.identity != before.identity


def test_an_nvrtc_replaced_after_loading_keeps_the_identity_of_the_file_it_was_loaded_from(tmp_path):
    """A library replaced on disk after the dynamic linker mapped it shows in /proc/self/maps as
    ``path (deleted)``: its identity is the mapped file's (through /proc/self/map_files), or none at all
    (no cache for its compiles), never a name and version every build of that version shares, nor the
    identity of the new file at that path."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("no /proc/self/maps: a library opened by a bare name is keyed by its file only there")
    stub = build_stub(tmp_path)
    (tmp_path / "two").mkdir()
    other = build_stub(tmp_path / "two", _stub_build("build-two"))
    script = f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        import cffi
        from cuproc import nvrtc as nv
        ffi = cffi.FFI()
        ffi.cdef("int nvrtcVersion(int *major, int *minor);")
        before = nv.location_of({str(stub)!r}).identity
        lib = ffi.dlopen({str(stub)!r})
        os.replace({str(other)!r}, {str(stub)!r})          # another build of the same version installed
        opened = nv.NvrtcLibrary({stub.name!r}, lib, ffi)  # as opened by the dynamic linker's search
        readable = os.access("/proc/self/map_files", os.R_OK)
        print(opened.identity == before, opened.identity is None, readable,
              opened.identity != nv.location_of({str(stub)!r}).identity)
    """
    same, none, readable, not_new = run_python(script).stdout.split()
    assert not_new == "True"
    assert (same, none) == (("True", "False") if readable == "True" else ("False", "True"))


def test_a_library_without_identity_is_not_cached(tmp_path):
    """An NVRTC whose build is unknown compiles every time and stores nothing: a miss, never a hit of
    another build's output."""
    from cuproc.compile_cache import CompileCache
    lib = nv.open_nvrtc(build_stub(tmp_path))
    lib.identity, known = None, lib.identity
    cache = CompileCache(tmp_path / "cache")
    try:
        code = Program("__global__ void k() {}").compile(arch=ARCH, target="ptx", cache=cache, nvrtc=lib)
    finally:
        lib.identity = known
    assert not code.from_cache and code.cache_key is None and "not cached" in code.cache_note
    assert cache.entries() == []


def test_a_bare_name_ranked_first_locates_no_file(monkeypatch, tmp_path):
    """Where the driver's major has no library file but has a name for the dynamic linker's search, that
    name ranks first and the open tries it first: the file of another major is not what a compile opens,
    so nothing is located (the compile opens NVRTC and keys on what opened)."""
    _wheel_site(monkeypatch, tmp_path, "libnvrtc.so.11.2")
    assert nv.candidate_paths(prefer_major=12)[0] == "libnvrtc.so.12"
    assert nv.locate(12) is None
    assert nv.locate_preferring(lambda: 12) is None
    found = nv.locate_preferring(lambda: 11)                 # a file of the driver's major ranks first
    assert found is not None and Path(found.path).name == "libnvrtc.so.11.2"


def _stub_build(tag: str) -> str:
    """The stand-in NVRTC's source as another build of the same version would be: its output says ``tag``."""
    from nvrtc_testing import STUB_SOURCE
    old = '".version 7.8\\n.target sm_80\\n"'
    assert old in STUB_SOURCE
    return STUB_SOURCE.replace(old, f'".version 7.8\\n.target sm_80\\n// {tag}\\n"')


def test_another_build_of_the_same_nvrtc_version_misses_and_the_same_build_hits(tmp_path):
    """Issue 37: two builds of one NVRTC minor (13.0.48, 13.0.88) report the same nvrtcVersion and may emit
    different code.  A build installed in place of another misses, in a fresh process, and compiles with
    the new build; the same build hits, without opening NVRTC."""
    lib_dir = tmp_path / "lib"
    lib_dir.mkdir()
    script = f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import cuproc
        code = cuproc.Program("__global__ void k() {{}}").compile(arch={ARCH!r}, target="ptx",
                                                                 cache={str(tmp_path / "cache")!r})
        print(code.from_cache, "libnvrtc" in open("/proc/self/maps").read(), code.code.decode().split("// ")[-1])
    """
    env = {**os.environ, "CUPROC_LIBNVRTC": str(lib_dir / "libnvrtc.so.11.2")}
    build_stub(lib_dir, _stub_build("build-one"))
    assert run_python(script, env=env).stdout.split() == ["False", "True", "build-one"]
    assert run_python(script, env=env).stdout.split() == ["True", "False", "build-one"]
    time.sleep(0.01)   # a new modification time even where the file system's clock is coarse
    build_stub(lib_dir, _stub_build("build-two"))                     # same version (11.8), another build
    assert run_python(script, env=env).stdout.split() == ["False", "True", "build-two"]
    assert run_python(script, env=env).stdout.split() == ["True", "False", "build-two"]


def test_a_missing_function_is_not_an_attribute_error():
    """hasattr() and getattr(x, name, default) would swallow it."""
    assert not issubclass(nv.NvrtcFunctionMissingError, AttributeError)
    assert issubclass(nv.NvrtcFunctionMissingError, nv.NvrtcError)


@needs_nvrtc
def test_version_and_supported_archs():
    lib = nv.open_nvrtc()
    assert isinstance(lib.version, CudaVersion) and lib.version >= V(11, 2)
    archs = lib.supported_archs()
    assert 80 in archs and archs == tuple(sorted(archs))
    assert nv.open_nvrtc() is lib   # one per process and path


def test_an_older_nvrtc_lacking_a_function_fails_clearly_before_compiling(tmp_path):
    stub = build_stub(tmp_path)
    lib = nv.open_nvrtc(stub)
    assert lib.version == V(11, 8)
    assert lib.has("nvrtcGetCUBIN") and not lib.has("nvrtcGetLTOIR")
    with pytest.raises(nv.NvrtcFunctionMissingError) as err:
        Program("__global__ void k() {}").compile(arch=ARCH, target="ltoir", nvrtc=lib, cache=False)
    assert err.value.call == "nvrtcGetLTOIRSize"   # the first of the two it needs
    assert "12.0" in str(err.value) and "11.8" in str(err.value) and str(stub) in str(err.value)
    assert "'nvidia-cuda-nvrtc-cu12>=12.0'" in str(err.value)   # the wheel that has 12.0 (issue 37, review)
    assert ctypes.c_long.in_dll(ctypes.CDLL(str(stub)), "stub_compiles").value == 0   # refused before compiling
    code = Program("__global__ void k() {}").compile(arch=ARCH, target="ptx", nvrtc=lib, cache=False)
    assert code.nvrtc_version == V(11, 8) and code.ptx_isa == PtxIsa(7, 8)
    assert ctypes.c_long.in_dll(ctypes.CDLL(str(stub)), "stub_compiles").value == 1


def test_a_library_that_is_not_nvrtc_is_skipped_with_its_reason(tmp_path):
    other = build_stub(tmp_path, "int not_nvrtc(void) { return 0; }\n", "libother.so")
    with pytest.raises(nv.NvrtcNotFoundError) as err:
        nv.open_nvrtc(other)
    assert err.value.attempts[0][0] == str(other) and "nvrtcVersion" in err.value.attempts[0][1]


# ----------------------------------------------------------------------------- compiling

@needs_nvrtc
def test_cubin_ptx_and_ltoir():
    prog = Program(AXPY, name="axpy.cu", headers={"scale.cuh": SCALE_H})
    cubin = prog.compile(arch=ARCH, cache=False)
    assert cubin.kind == "cubin" and cubin.code.startswith(b"\x7fELF") and cubin.arch == ARCH
    assert "no driver JIT" in cubin.reason and not cubin.from_cache
    ptx = prog.compile(arch="compute_80", cache=False)
    assert ptx.kind == "ptx" and b".target sm_80" in ptx.code and not ptx.code.endswith(b"\0")
    # the table's row for this NVRTC, read off its PTX.  An NVRTC newer than the table has no row (None):
    # accepted, so that CI tests the newest wheel users get rather than pinning below it (L5)
    row = max_ptx_isa(nv.open_nvrtc().version)
    assert ptx.ptx_isa == row or (row is None and ptx.ptx_isa is not None
                                  and ptx.ptx_isa > max_ptx_isa(NEWEST_KNOWN_CUDA))
    ptx_for_sm = prog.compile(arch=ARCH, target="ptx", cache=False)
    assert ptx_for_sm.kind == "ptx" and ptx_for_sm.arch == ARCH
    if nv.open_nvrtc().has("nvrtcGetLTOIR"):
        lto = prog.compile(arch=ARCH, target="ltoir", cache=False)
        assert lto.kind == "ltoir" and lto.code and not lto.code.startswith(b"\x7fELF")
        assert "-dlto" in lto.options
        assert "nvJitLink" in (lto.load_problem(V(13, 0)) or "")


@needs_nvrtc
def test_name_expressions_are_lowered():
    prog = Program(AXPY, headers={"scale.cuh": SCALE_H})
    code = prog.compile(arch=ARCH, name_expressions=["axpy<float>", "axpy<double>", "fill", "axpy<float>"],
                        cache=False)
    low = code.lowered_names
    assert set(low) == {"axpy<float>", "axpy<double>", "fill"}
    assert low["fill"] == "fill"                                   # extern "C": its own name
    assert low["axpy<float>"].startswith("_Z") and "axpyIf" in low["axpy<float>"]
    assert low["axpy<double>"].startswith("_Z") and "axpyId" in low["axpy<double>"]
    ptx = prog.compile(arch="compute_80", name_expressions=["axpy<double>"], cache=False)
    assert f".entry {ptx.lowered_names['axpy<double>']}(".encode() in ptx.code
    with pytest.raises(nv.CompileError) as err:
        prog.compile(arch=ARCH, name_expressions=["nosuch<int>"], cache=False)
    assert "nosuch" in err.value.log


@needs_nvrtc
def test_includes_from_headers_from_include_paths_and_beside_the_program(tmp_path, monkeypatch):
    src = '#include "a.h"\n#include <b.h>\n__device__ int total = A + B;\n'
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "b.h").write_text("#define B 20\n")
    (tmp_path / "a.h").write_text("#define A 1\n")
    monkeypatch.chdir(tmp_path)
    from_disk = Program(src).compile(arch="compute_80", include_paths=[tmp_path / "inc"], cache=False)
    assert b"total = 21;" in from_disk.code
    given = Program(src, headers={"a.h": "#define A 300\n"}).compile("-I" + str(tmp_path / "inc"),
                                                                    arch="compute_80", cache=False)
    assert b"total = 320;" in given.code                       # headers={} wins over the file beside
    with pytest.raises(nv.CompileError) as err:
        Program(src).compile(arch="compute_80", cache=False)   # <b.h> is searched only in -I directories
    assert "b.h" in err.value.log


@needs_nvrtc
def test_a_compile_error_raises_with_the_log_and_warnings_stay_on_the_result():
    with pytest.raises(nv.CompileError) as err:
        Program("__global__ void k() { nope; }", name="broken.cu").compile(arch=ARCH, cache=False)
    e = err.value
    assert isinstance(e, nv.NvrtcError) and e.name == "NVRTC_ERROR_COMPILATION" and e.code == 6
    assert 'identifier "nope" is undefined' in e.log and "broken.cu(1)" in e.log and e.log.strip() in str(e)
    warned = Program("__global__ void k() { int unused; }", name="w.cu").compile(arch=ARCH, cache=False)
    assert [w for w in warned.warnings if "w.cu(1): warning" in w and "unused" in w]
    assert all(": warning" in w for w in warned.warnings)
    assert Program("__global__ void k() {}").compile(arch=ARCH, cache=False).warnings == ()


@needs_nvrtc
def test_a_bad_option_is_nvrtcs_own_error():
    with pytest.raises(nv.CompileError) as err:
        Program("__global__ void k() {}").compile("--no-such-option", arch=ARCH, cache=False)
    assert err.value.name == "NVRTC_ERROR_INVALID_OPTION" and "no-such-option" in err.value.log


# ----------------------------------------------------------------------------- arguments

def test_arch_forms():
    for given in ("sm_90", 90, (9, 0), "90", "9.0", " sm_90 "):
        assert normalize_arch(given) == "sm_90"
    for kept in ("compute_90", "sm_90a", "compute_90a", "sm_100f", "sm_120"):
        assert normalize_arch(kept) == kept
    for bad in ("sm90", "gfx90a", "", 9, True, (9,), "sm_9", "compute_"):
        with pytest.raises(ValueError, match="not a GPU architecture"):
            normalize_arch(bad)


def test_bad_arguments_are_refused_before_nvrtc():
    with pytest.raises(TypeError, match="CUDA C\\+\\+ text"):
        Program(42)   # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NUL"):
        Program("a\0b")
    with pytest.raises(TypeError, match="header names"):
        Program("x", headers={1: "y"})   # type: ignore[dict-item]
    prog = Program("__global__ void k() {}")
    with pytest.raises(ValueError, match="target="):
        prog.compile(arch=ARCH, target="sass")
    with pytest.raises(ValueError, match="disagree"):
        prog.compile("-arch=sm_75", arch="sm_80")
    with pytest.raises(TypeError, match="options are strings"):
        prog.compile(3, arch=ARCH)   # type: ignore[arg-type]


@pytest.mark.parametrize("arch", [1000, (12, 10), (0, 9), (9, True), "sm_1000"])
def test_an_arch_no_gpu_has_is_refused_naming_the_argument_before_the_cache(arch, tmp_path):
    """Not an AssertionError from deep inside, and before any cache lookup or NVRTC (C3)."""
    prog = Program("__global__ void k() {}")
    missing = tmp_path / "no-libnvrtc.so"
    with pytest.raises(ValueError, match="arch") as err:
        prog.compile(arch=arch, cache=tmp_path / "cache", nvrtc=missing)
    assert repr(arch) in str(err.value)
    with pytest.raises(ValueError, match="-arch"):
        prog.compile("-arch=sm_1000", cache=tmp_path / "cache", nvrtc=missing)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("argument", ["name_expressions", "include_paths"])
def test_one_string_where_a_list_is_expected_is_refused(argument, tmp_path):
    """A str would be split into characters (C4)."""
    prog = Program("__global__ void k() {}")
    for value in ("axpy<float>", b"inc", tmp_path):
        with pytest.raises(TypeError, match=argument):
            prog.compile(arch=ARCH, cache=False, nvrtc=tmp_path / "none", **{argument: value})
    from cuproc.program import _Request
    with pytest.raises(TypeError, match="options"):
        _Request("-DN=4", ARCH, None, (), (), None, None)


def test_an_unsupported_ptx_message_knows_drivers_past_13_0():
    """module.py's UNSUPPORTED_PTX_VERSION message reads the one PTX ISA table (C5)."""
    from cuproc.errors import CudaError
    from cuproc.module import _UNSUPPORTED_PTX, _Image, _load_error

    class Driver:
        driver_version = V(13, 5)

        def error(self, rc, call):
            return CudaError(rc, call, name="CUDA_ERROR_UNSUPPORTED_PTX_VERSION", description="unsupported PTX")

    image = _Image(b".version 9.9\n", "k.ptx")
    err = _load_error(Driver(), _UNSUPPORTED_PTX, "cuModuleLoadDataEx", image, None)  # type: ignore[arg-type]
    assert "9.5" in str(err) and "9.9" in str(err) and "k.ptx" in str(err) and "older ISA" not in str(err)
    Driver.driver_version = V(14, 0)
    assert "9.5" not in str(_load_error(Driver(), _UNSUPPORTED_PTX, "cuModuleLoadDataEx", image, None))  # type: ignore[arg-type]


@needs_nvrtc
def test_arch_from_the_options_and_targets_that_do_not_fit():
    prog = Program("__global__ void k() {}")
    assert prog.compile("--gpu-architecture", "compute_80", cache=False).kind == "ptx"
    assert prog.compile("-arch=sm_80", cache=False).arch == "sm_80"
    with pytest.raises(ValueError, match="real architecture"):
        prog.compile(arch="compute_80", target="cubin", cache=False)
    with pytest.raises(ValueError, match="cannot compile for sm_10") as err:
        prog.compile(arch="sm_10", cache=False)
    assert "sm_80" in str(err.value)


def test_without_a_driver_the_arch_must_be_given(tmp_path):
    proc = run_python(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import cuproc
        try:
            cuproc.Program("__global__ void k() {{}}").compile(cache=False)
        except ValueError as exc:
            print(exc)
    """, env={**os.environ, "CUPROC_LIBCUDA": str(tmp_path / "no-libcuda.so.1")})
    assert "arch= is needed" in proc.stdout and "no CUDA driver" in proc.stdout


# ----------------------------------------------------------------------------- the PTX ISA rule

def test_ptx_isa_per_cuda_version():
    rows = {"11.0": "7.0", "11.8": "7.8", "12.0": "8.0", "12.1": "8.1", "12.2": "8.2", "12.3": "8.3", "12.4": "8.4",
            "12.5": "8.5", "12.6": "8.5", "12.7": "8.6", "12.8": "8.7", "12.9": "8.8", "13.0": "9.0", "13.1": "9.1",
            "13.2": "9.2", "13.3": "9.3", "13.4": "9.4", "13.5": "9.5"}   # every release from 11.8 to 13.5
    for cuda, isa in rows.items():
        assert str(max_ptx_isa(V.parse(cuda))) == isa, cuda
    known = [V(major, minor) for major in (11, 12, 13) for minor in range(10)
             if V(11, 0) <= V(major, minor) <= NEWEST_KNOWN_CUDA]
    isas = [max_ptx_isa(v) for v in known]
    assert None not in isas and isas == sorted(isas)   # no gap, and a release never accepts less than the one before
    for unknown in ("10.2", "13.6", "14.0"):
        assert max_ptx_isa(V.parse(unknown)) is None
    assert ptx_isa_of(b"//\n// Generated by NVIDIA NVVM Compiler\n.version 9.5\n.target sm_90\n") == PtxIsa(9, 5)
    assert ptx_isa_of("  .version 12.10\n") == PtxIsa(12, 10)
    assert ptx_isa_of(b"\x7fELF...") is None
    assert driver_accepts(PtxIsa(9, 5), V(13, 0)) is False
    assert driver_accepts(PtxIsa(9, 0), V(13, 0)) is True
    assert driver_accepts(PtxIsa(8, 8), V(13, 5)) is True
    assert driver_accepts(PtxIsa(9, 9), V(14, 0)) is None   # newer than cuproc knows: the driver decides


def _code(kind: str, text: bytes, nvrtc: str = "13.5") -> ObjectCode:
    return ObjectCode(text, kind, "sm_90", name="k.cu", log="", lowered_names={}, nvrtc_version=V.parse(nvrtc),
                      options=(), reason="test")


def test_load_problem_says_what_to_do():
    ptx = _code("ptx", b".version 9.5\n.target sm_90\n")
    problem = ptx.load_problem(V(13, 0))
    assert problem is not None and "9.5" in problem and "9.0" in problem and "target='cubin'" in problem
    assert "nvidia-cuda-nvrtc==13.0.*" in problem
    assert ptx.load_problem(V(13, 5)) is None and ptx.load_problem(V(14, 0)) is None
    assert _code("cubin", b"\x7fELF").load_problem(V(13, 0)) is None     # a newer minor: no JIT, it loads
    newer_major = _code("cubin", b"\x7fELF").load_problem(V(12, 8))     # minor compatibility stops at the major
    assert newer_major is not None and "12" in newer_major and "13.5" in newer_major
    assert _code("cubin", b"\x7fELF", nvrtc="12.9").load_problem(V(13, 0)) is None
    assert "nvJitLink" in (_code("ltoir", b"BC").load_problem(V(13, 0)) or "")
    with pytest.raises(ValueError, match="kind"):
        _code("sass", b"")


def _wheels_named(text: str) -> set[str]:
    import re
    return set(re.findall(r"'(nvidia-cuda-nvrtc[\w-]*)[=<>]", text))


def test_install_advice_names_the_wheel_of_the_drivers_major():
    """nvidia-cuda-nvrtc has CUDA 13 releases only: a CUDA 12 driver's NVRTC is nvidia-cuda-nvrtc-cu12
    (11's -cu11), so advice naming 'nvidia-cuda-nvrtc==12.8.*' could never be installed."""
    assert nv.pip_install(V(12, 8)) == "pip install 'nvidia-cuda-nvrtc-cu12==12.8.*'"
    assert nv.pip_install(V(13, 0)) == "pip install 'nvidia-cuda-nvrtc==13.0.*'"
    assert nv.wheel_name(11) == "nvidia-cuda-nvrtc-cu11"
    ptx_12 = _code("ptx", b".version 8.8\n.target sm_90\n", nvrtc="12.9").load_problem(V(12, 8))
    assert ptx_12 is not None and _wheels_named(ptx_12) == {"nvidia-cuda-nvrtc-cu12"} and "12.8.*" in ptx_12
    assert "target='cubin'" in ptx_12                                  # a 12.9 cubin loads on 12.8
    cubin = _code("cubin", b"\x7fELF").load_problem(V(12, 8))
    assert cubin is not None and _wheels_named(cubin) == {"nvidia-cuda-nvrtc-cu12"}
    assert _wheels_named(_code("cubin", b"\x7fELF").load_problem(V(11, 8)) or "") == {"nvidia-cuda-nvrtc-cu11"}
    refused = nv.NvrtcNotFoundError([("libnvrtc.so.12", "not found")], driver_major=12)
    assert _wheels_named(str(refused)) == {"nvidia-cuda-nvrtc-cu12"}
    assert "nvidia-cuda-nvrtc-cu12" in nv.INSTALL_HINT and "cuproc[nvrtc]" in nv.INSTALL_HINT
    from cuproc.program import _plan
    with pytest.raises(ValueError) as err:
        _plan("sm_120", None, V(12, 4), V(12, 8), arch_defaulted=False, supported=(75, 80, 90))
    assert _wheels_named(str(err.value)) == {"nvidia-cuda-nvrtc-cu12"}


def test_ptx_of_a_newer_major_is_not_told_to_become_a_cubin():
    """PTX from NVRTC 13.5 on a CUDA 12.8 driver: a cubin from that NVRTC is refused too (minor
    compatibility stops at the major), so the advice is an NVRTC of the driver's major."""
    problem = _code("ptx", b".version 9.5\n.target sm_90\n").load_problem(V(12, 8))
    assert problem is not None and "target='cubin'" not in problem
    assert _wheels_named(problem) == {"nvidia-cuda-nvrtc-cu12"} and "12.8.*" in problem
    from cuproc.program import _plan
    default = _plan("sm_90", None, V(13, 5), V(12, 8), arch_defaulted=True, supported=(75, 80, 90))
    assert default.kind == "cubin" and _wheels_named(default.reason) == {"nvidia-cuda-nvrtc-cu12"}


@needs_nvrtc
def test_the_default_says_why_when_nvrtc_is_newer_than_the_driver():
    from cuproc.program import _plan
    newer = _plan("sm_90", None, V(13, 5), V(13, 0), arch_defaulted=True, supported=(75, 80, 90))
    assert newer.kind == "cubin" and "newer than this CUDA 13.0 driver" in newer.reason and "9.5" in newer.reason
    same = _plan("sm_90", None, V(13, 0), V(13, 0), arch_defaulted=True, supported=(75, 80, 90))
    assert same.kind == "cubin" and "newer" not in same.reason
    # a device newer than anything NVRTC knows: PTX for NVRTC's newest arch, JIT-compiled by the driver
    fallback = _plan("sm_120", None, V(12, 4), V(13, 0), arch_defaulted=True, supported=(75, 80, 90))
    assert (fallback.kind, fallback.arch) == ("ptx", "compute_90") and "sm_120" in fallback.reason
    with pytest.raises(ValueError, match="cannot compile for sm_120"):
        _plan("sm_120", None, V(12, 4), V(13, 0), arch_defaulted=False, supported=(75, 80, 90))


# ----------------------------------------------------------------------------- on the fake driver

def test_compiled_module_on_the_fake_driver_takes_name_expressions(fk, pc):
    from fakedriver import fake_image
    lowered = "_Z4axpyIfEvT_PKS0_PS0_i"
    code = ObjectCode(fake_image({lowered: [4, 8, 8, 4], "fill": [8, 4, 4]}, {"_Z5tableILi4EE": 16}), "cubin",
                      "sm_90", name="axpy.cu", log="", lowered_names={"axpy<float>": lowered, "fill": "fill",
                                                                          "&table<4>": "_Z5tableILi4EE"},
                      nvrtc_version=V(13, 5), options=(), reason="test")
    mod = code.load()
    assert isinstance(mod, cuproc.Module) and mod.lowered_names["axpy<float>"] == lowered
    fn = mod.get_function("axpy<float>")
    assert fn.name == "axpy<float>" and mod.get_function(lowered).name == lowered
    launches = fk.launch_count()
    fn.launch(1, 32, (cuproc.ffi.cast("float", 2.0), 0, 0, cuproc.ffi.cast("int", 3)),
              signature=["float", "float*", "float*", "int"])
    fn.prepare(["float", "float*", "float*", "int"], 1, 32)(2.0, 0, 0, 3)
    assert fk.launch_count() == launches + 2
    assert mod.get_global("&table<4>").nbytes == 16
    with pytest.raises(cuproc.NotFoundError) as err:
        mod.get_function("axpy<double>")
    text = str(err.value)
    assert "'axpy<double>'" in text and "axpy.cu" in text and "name_expressions=['axpy<double>']" in text
    assert "axpy<float>" in text   # the expressions it was compiled with
    with pytest.raises(cuproc.NotFoundError, match="no variable 'nosuch'"):
        mod.get_global("nosuch")
    mod.unload()


def test_ptx_the_driver_cannot_load_is_refused_before_loading(fk, pc):
    code = _code("ptx", b".version 9.5\n.target sm_90\n.address_size 64\n")
    fk.clear_calls()
    with pytest.raises(cuproc.CudaError) as err:
        code.load()
    e = err.value
    assert e.refused and e.name == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION" and e.call == "cuModuleLoadDataEx"
    assert "9.5" in str(e) and "up to ISA 9.0" in str(e)          # the fake is a CUDA 13.0 driver
    assert not [c for c in fk.calls() if c.startswith("cuModuleLoad")]
    with pytest.raises(cuproc.InvalidValueError, match="nvJitLink"):
        _code("ltoir", b"BC\xc0\xde").load()
    with pytest.raises(cuproc.CudaError) as err:
        code.load_library()
    assert err.value.refused and err.value.name == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"


@needs_nvrtc
def test_the_default_arch_is_the_current_devices(fk, pc):
    code = Program("__global__ void k() {}").compile(cache=False)
    major, minor = cuproc.Device(0).compute_capability
    assert code.arch == f"sm_{major}{minor}" and code.kind == "cubin"


@needs_nvrtc
def test_a_hit_says_why_for_the_driver_it_loads_on(tmp_path, monkeypatch):
    """The default cubin's reason names the driver (NVRTC newer than it, or not); a hit in a process on
    another driver says it for that driver, not the stored one's words (issue 37, review)."""
    from cuproc import program
    cache = str(tmp_path / "c")
    nvrtc_version = nv.open_nvrtc().version
    older = V(nvrtc_version.major, 0) if nvrtc_version.minor else None
    if older is None or max_ptx_isa(nvrtc_version) == max_ptx_isa(older):
        pytest.skip("needs an NVRTC newer than the .0 driver of its major")
    monkeypatch.setattr(program, "_driver_version", lambda driver, context: older)
    first = Program("__global__ void k() {}").compile(arch=ARCH, cache=cache)
    assert not first.from_cache and "newer than this CUDA" in first.reason
    monkeypatch.setattr(program, "_driver_version", lambda driver, context: nvrtc_version)
    hit = Program("__global__ void k() {}").compile(arch=ARCH, cache=cache)
    assert hit.from_cache and "newer than this CUDA" not in hit.reason and ARCH in hit.reason
