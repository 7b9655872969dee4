"""The optional compiled fast path (cuproc.fastpath, tools/build_fastpath.py, src/fastpath/fastpath_launch.c).

Both paths run in CI: the rest of the suite runs on whichever path this process has (the fast one
after ``pip install -e .`` with a compiler), and ``test_pure_path_reruns_driver_launch_and_ownership``
reruns the driver, launch and ownership tests with ``CUPROC_PURE_PYTHON=1``.  The fast path's own
checks compare against references that do not go through it: the cffi pointer itself, ``struct``
packing, the fake driver's record of what it was given.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import _cffi_backend
import cffi

import cuproc
from cuproc import DeviceBuffer, Module, Stream, _fastpath_digest, fastpath
from cuproc.errors import ClosedResourceError, InvalidValueError

from fakedriver import fake_image

ROOT = Path(__file__).resolve().parent.parent
# The package under test: the checkout's cuproc/, or, in CI's installed-wheel run, the installed one
# (that run deletes the sdist's cuproc/).  Copies of it never take its compiled module by accident.
PACKAGE = Path(cuproc.__file__).resolve().parent
COPY_IGNORE = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd")
ffi = cuproc.ffi
needs_fast = pytest.mark.skipif(not fastpath.active(), reason=f"the compiled fast path is {fastpath.status()}")
ALL_KINDS = ["int8_t", "int16_t", "int32_t", "int64_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t",
             "float", "double", "float*"]
ALL_FORMAT = "<bxhiqBxHIQf4xdQ"     # each at its own alignment (guide: "Kernel Execution")
IMAGE = fake_image({"empty": [8, 4, 4], "fake_pair": [8, 8], "all": [1, 2, 4, 8, 1, 2, 4, 8, 4, 8, 8]})


def run_python(code: str, copy: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter; with ``copy``, the cuproc in that folder, not the installed one
    (``-S``: an editable install's import hook would find the checkout's modules first)."""
    flags = []
    if copy is not None:
        paths = sysconfig.get_paths()
        # cffi where this interpreter finds it (site-packages, or a PYTHONPATH folder as on the GPU machine)
        cffi_dirs = {str(Path(m.__file__).resolve().parent) for m in (_cffi_backend,)} | \
            {str(Path(cffi.__file__).resolve().parent.parent)}
        env = {**env, "PYTHONPATH": os.pathsep.join([str(copy), paths["purelib"], paths["platlib"], *sorted(cffi_dirs)])}
        flags = ["-S"]
    return subprocess.run([sys.executable, *flags, "-c", code], check=False, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env}, cwd=copy or ROOT)


# ----------------------------------------------------------------------------- status and the switch

def test_status_says_why_and_the_variable_forces_the_pure_path():
    assert fastpath.status().startswith("on: " if fastpath.active() else "off: ")
    probe = "import cuproc.fastpath as f, cuproc; print(f.active(), f.status(), type(cuproc.ffi).__module__)"
    pure = run_python(probe, CUPROC_PURE_PYTHON="1")
    assert pure.returncode == 0 and pure.stdout.startswith("False off: CUPROC_PURE_PYTHON"), pure.stderr
    default = run_python(probe, CUPROC_PURE_PYTHON="0")
    assert default.returncode == 0 and "CUPROC_PURE_PYTHON" not in default.stdout, default.stderr
    if os.environ.get("CUPROC_PURE_PYTHON", "0") == "0":
        assert default.stdout.startswith(str(fastpath.active()))


def test_a_bad_value_of_the_variable_names_it():
    out = run_python("import cuproc", CUPROC_PURE_PYTHON="maybe")
    assert out.returncode != 0 and "ValueError" in out.stderr and "CUPROC_PURE_PYTHON='maybe'" in out.stderr


def test_a_module_built_from_other_headers_is_not_used(tmp_path):
    """A stale in-place build (headers changed since) must not be loaded: its types would differ."""
    if not fastpath.active():
        pytest.skip(f"the compiled fast path is {fastpath.status()}")
    import cuproc._fastpath_c as compiled
    copy = tmp_path / "cuproc"
    shutil.copytree(PACKAGE, copy, ignore=COPY_IGNORE)
    shutil.copy(compiled.__file__, copy)
    probe = "import cuproc.fastpath as f; print(f.active(), f.status())"
    same = run_python(probe, copy=tmp_path)            # the copy itself loads it: only the change below counts
    assert same.returncode == 0 and same.stdout.startswith("True on:"), same.stdout + same.stderr
    with open(copy / "_cffi_abi.py", "a") as f:   # the ABI module changed alone (a one-sided checkout or merge)
        f.write("\n# changed\n")
    out = run_python(probe, copy=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("False off:") and "without cuproc/_abi_digest.py" in \
        out.stdout, out.stdout + out.stderr
    # headers changed: both generated files moved on (tools/build_ffi.py), the build did not
    (copy / "_abi_digest.py").write_text(_fastpath_digest.abi_digest_module((copy / "_cffi_abi.py").read_bytes()))
    out = run_python(probe, copy=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("False off:") and "other headers" in out.stdout, out.stderr


@pytest.mark.parametrize("tool", _fastpath_digest.TOOL_INPUTS)
def test_a_module_built_by_other_tools_is_not_used_in_a_checkout(tmp_path, tool):
    """The .so is gitignored and survives a git pull that changes the launcher's argument tuple."""
    if not fastpath.active():
        pytest.skip(f"the compiled fast path is {fastpath.status()}")
    if not (ROOT / tool).is_file():
        pytest.skip(f"no {tool} here (an installed package is checked against its headers only)")
    import cuproc._fastpath_c as compiled
    shutil.copytree(PACKAGE, tmp_path / "cuproc", ignore=COPY_IGNORE)
    shutil.copy(compiled.__file__, tmp_path / "cuproc")
    for name in _fastpath_digest.TOOL_INPUTS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    probe = "import cuproc.fastpath as f; print(f.active(), f.status())"
    same = run_python(probe, copy=tmp_path)
    assert same.stdout.startswith("True on:"), same.stdout + same.stderr
    with open(tmp_path / tool, "a") as f:
        f.write("\n/* changed */\n" if tool.endswith(".c") else "\n# changed\n")
    out = run_python(probe, copy=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("False off:") and "other tools" in out.stdout, out.stderr


def test_the_build_digest_is_crc32_and_length_of_names_and_contents(tmp_path):
    """The reference: zlib.crc32 of the whole concatenation at once; one changed byte changes it."""
    import zlib
    (tmp_path / "a").write_bytes(b"one")
    (tmp_path / "b").write_bytes(bytes(range(256)) * 50)
    whole = b"a\0one\0b\0" + bytes(range(256)) * 50 + b"\0"
    assert _fastpath_digest.digest(tmp_path, ["a", "b"]) == f"{zlib.crc32(whole):08x}-{len(whole)}"
    before = _fastpath_digest.digest(tmp_path, ["a", "b"])
    (tmp_path / "b").write_bytes(bytes(range(256)) * 49 + bytes([1]) + bytes(range(1, 256)))
    assert _fastpath_digest.digest(tmp_path, ["a", "b"]) != before
    assert _fastpath_digest.digest(tmp_path, ["b", "a"]) != _fastpath_digest.digest(tmp_path, ["a", "b"])


def test_import_does_not_load_hashlib_or_pathlib():
    """The stale-build check runs at every import of the fast path: hashlib (OpenSSL) cost 2-3 ms,
    pathlib (urllib.parse, ipaddress) 2-4 ms.  Without site (-S), whose .pth files may import them."""
    out = run_python("import sys, cuproc, cuproc.driver, cuproc.fastpath as f; cuproc.use_device; "
                     "print(f.active(), f.status()); "
                     "print(sorted(m for m in ('hashlib', '_hashlib', 'pathlib') if m in sys.modules))",
                     copy=PACKAGE.parent)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "[]", out.stdout + out.stderr
    assert out.stdout.startswith(str(fastpath.active())), out.stdout    # the same path as this process


_FAKE_FFI = "class _Ffi:\n    def string(self, s):\n        return s\nffi = _Ffi()\n"


@pytest.mark.parametrize("module_text,reason", [
    # a module of an earlier build_fastpath.py, built from these headers: no cuproc_install_launcher
    ("class _Lib:\n    def cuproc_abi_digest(self):\n        return {abi!r}\nlib = _Lib()\n" + _FAKE_FFI,
     "AttributeError: '_Lib' object has no attribute 'cuproc_install_launcher'"),
    ("class _Lib:\n    def cuproc_abi_digest(self):\n        return b'x'\nlib = _Lib()\n" + _FAKE_FFI,
     "other headers"),
    ("class _Lib:\n    def __getattr__(self, name):\n        raise RuntimeError('broken ' + name)\n"
     "lib = _Lib()\n" + _FAKE_FFI, "RuntimeError: broken cuproc_abi_digest"),
])
def test_a_compiled_module_that_does_not_fit_never_breaks_import(tmp_path, module_text, reason):
    """Anything wrong with cuproc._fastpath_c turns the fast path off with its reason; import works."""
    shutil.copytree(PACKAGE, tmp_path / "cuproc", ignore=COPY_IGNORE)
    abi = _fastpath_digest.digest(tmp_path, _fastpath_digest.ABI_INPUTS).encode()
    (tmp_path / "cuproc" / "_fastpath_c.py").write_text(module_text.format(abi=abi))
    out = run_python("import cuproc, cuproc.fastpath as f; print(f.active(), f.status()); "
                     "print(cuproc.ffi.sizeof('CUdeviceptr'))", copy=tmp_path, CUPROC_PURE_PYTHON="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("False off: ") and reason in out.stdout and out.stdout.endswith("\n8\n"), out.stdout


def test_an_install_without_the_compiled_module_says_it_was_not_built_and_how_to_build_it(tmp_path):
    """No cuproc._fastpath_c (no compiler at install): the status names that and the fix, not Python's
    "partially initialized module" text of a failed ``from . import``."""
    shutil.copytree(PACKAGE, tmp_path / "cuproc", ignore=COPY_IGNORE)   # the copy has no *.so
    out = run_python("import cuproc, cuproc.fastpath as f; print(f.active()); print(f.status())",
                     copy=tmp_path, CUPROC_PURE_PYTHON="0")
    assert out.returncode == 0, out.stderr
    active, status = out.stdout.splitlines()
    assert active == "False" and status.startswith("off: not built at install"), status
    assert "no C compiler or Python headers" in status and "--force-reinstall" in status, status
    assert "tools/build_fastpath.py" in status, status
    assert "partially initialized" not in status


@needs_fast
def test_the_kind_values_and_slot_count_come_from_the_module():
    """Python reads the C enum and CUPROC_SLOTS from the module; check them against the C source."""
    import cuproc._fastpath_c as compiled
    source = (ROOT / "src" / "fastpath" / "fastpath_launch.c")
    if not source.is_file():
        pytest.skip("no src/fastpath/ here")
    enum = re.search(r"enum cuproc_kind \{(.*?)\};", source.read_text(), re.S).group(1)
    names = [n.strip() for n in enum.split(",")]
    kinds = fastpath.launcher_kinds()
    assert kinds is not None and sorted(kinds.values()) == list(range(len(names) - 1))   # all but K_COUNT
    assert kinds["pointer"] == names.index("CUPROC_K_PTR") and kinds["double"] == names.index("CUPROC_K_F64")
    assert compiled.lib.CUPROC_SLOTS >= 1


# ----------------------------------------------------------------------------- the trampolines

def test_an_in_place_build_renames_a_new_module_over_the_old_one(tmp_path, monkeypatch):
    """A process that has the old module loaded (mapped) keeps reading it while tools/build_fastpath.py
    builds in place: rewriting the file in place made a running test process die of SIGBUS."""
    import mmap
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_fastpath
    finally:
        sys.path.remove(str(ROOT / "tools"))
    (tmp_path / "cuproc").mkdir()
    target = tmp_path / "cuproc" / "_fastpath_c.test.so"
    target.write_bytes(b"old" * 4096)

    class Builder:
        def compile(self, tmpdir: str) -> str:
            built = Path(tmpdir) / target.name
            built.write_bytes(b"new" * 100)
            return str(built)
    monkeypatch.setattr(build_fastpath, "ffibuilder", lambda root: Builder())
    with open(target, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as old:
        assert build_fastpath.main(["--root", str(tmp_path)]) == 0
        assert old[:3] == b"old"   # the first page only: it exists in either file, so a wrong build fails here
    assert target.read_bytes() == b"new" * 100
    assert [p.name for p in (tmp_path / "cuproc").iterdir()] == [target.name]   # no partial file left
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask

    def refused(src: str, dst: str) -> None:
        raise PermissionError(f"{dst} is in use")   # e.g. Windows and a loaded .pyd
    monkeypatch.setattr(build_fastpath.os, "replace", refused)
    with pytest.raises(PermissionError):
        build_fastpath.main(["--root", str(tmp_path)])
    assert [p.name for p in (tmp_path / "cuproc").iterdir()] == [target.name]   # the partial file went too


def test_every_typedef_has_a_trampoline_except_by_value_structs(pfn_typedef_names):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_fastpath
    finally:
        sys.path.remove(str(ROOT / "tools"))
    parsed = build_fastpath.typedefs(ROOT / "headers")
    assert [name for name, _ in parsed] == pfn_typedef_names
    by_value = {name for name in pfn_typedef_names
                if any(a.kind in ("struct", "union") for a in ffi.typeof(name).args)}
    cdefs, bodies = build_fastpath.trampolines(ROOT / "headers", ffi)
    covered = {m.group(1) for c in cdefs if (m := re.match(r"CUresult cuproc_(PFN_\w+)\(PFN_\w+ cuproc_fn", c))}
    assert covered == set(pfn_typedef_names) - by_value
    assert by_value   # the CUmemLocation ones, passed as integers by cuproc.driver
    short = {name for name in covered if len(ffi.typeof(name).args) <= 1}
    slots = {re.match(r"CUresult cuproc_(PFN_\w+)_s\d\(", c).group(1) for c in cdefs if "cuproc_fn" not in c
             and c.startswith("CUresult")}
    assert slots == short and len(cdefs) == len(covered) + build_fastpath.SLOTS * len(short) + 1
    if fastpath.active():
        import cuproc._fastpath_c as compiled
        assert all(hasattr(compiled.lib, f"cuproc_{name}") for name in covered)
        assert all(hasattr(compiled.lib, f"cuproc_{name}_s{k}") for name in short for k in range(2))
        assert compiled.lib.cuproc_slot_claim(b"PFN_cuMemAlloc_v3020", 0, ffi.NULL) == -1   # two parameters


@needs_fast
def test_raw_names_call_the_resolved_pointer_with_c_semantics(fk):
    drv = cuproc.driver.default_driver()
    for name in ("cuCtxGetCurrent", "cuDriverGetVersion", "cuMemAlloc", "cuLaunchKernelEx"):
        public = getattr(drv, name)
        assert not isinstance(public, ffi.CData) and fastpath.pointer(public) is drv.resolution(name).function
    version, via_pointer = ffi.new("int *"), ffi.new("int *")
    assert drv.cuDriverGetVersion(version) == 0 == drv.resolution("cuDriverGetVersion").function(via_pointer)
    assert version[0] == via_pointer[0] == 13000
    assert drv.cuCtxGetCurrent(ffi.NULL) != 0                  # the driver's answer, not a Python error
    for bad in ((ffi.new("int *"),), (), (1,), (ffi.new("CUcontext *"), 1)):
        with pytest.raises(TypeError):                      # cffi's checks, as on the pointer
            drv.cuCtxGetCurrent(*bad)
    with pytest.raises(OverflowError):
        drv.cuDeviceGet(ffi.new("CUdevice *"), 1 << 40)


@needs_fast
def test_handles_at_other_versions_and_stream_flags_keep_their_own_pointers(sims):
    legacy = cuproc.Driver("12.4", library=str(sims["v2"].path))
    per_thread = cuproc.Driver("12.4", library=str(sims["v2"].path), per_thread_default_stream=True)
    old = cuproc.Driver("11.0", library=str(sims["v2"].path))
    seen = {}
    for drv in (legacy, per_thread, old):
        for name in ("cuMemcpyAsync", "cuCtxCreate", "cuMemAllocAsync"):
            public = getattr(drv, name)
            assert fastpath.pointer(public) is drv.resolution(name).function
            seen[(id(drv), name)] = int(ffi.cast("uintptr_t", fastpath.pointer(public)))
    assert seen[(id(legacy), "cuMemcpyAsync")] != seen[(id(per_thread), "cuMemcpyAsync")]
    assert seen[(id(legacy), "cuCtxCreate")] != seen[(id(old), "cuCtxCreate")]


@needs_fast
def test_slot_trampolines_never_share_a_slot_between_pointers(fake, sims):
    """cuDriverGetVersion (one parameter: slot trampolines) from four libraries in one process:
    each handle reaches its own library, whichever slot or bound trampoline it got."""
    libraries = [fake.path, sims["v2"].path, sims["v1"].path, sims["none"].path]
    handles = [cuproc.Driver(library=str(path)) for path in libraries] + [cuproc.Driver(library=str(fake.path))]
    for drv in handles:
        public, bare = drv.cuDriverGetVersion, drv.resolution("cuDriverGetVersion").function
        assert fastpath.pointer(public) is bare
        ours, theirs = ffi.new("int *"), ffi.new("int *")
        assert public(ours) == bare(theirs) == 0 and ours[0] == theirs[0]
    bound = [drv for drv in handles if isinstance(drv.cuDriverGetVersion, types.MethodType)]
    assert len(bound) >= 2     # four pointers, two slots (earlier tests may hold them): the bound form took over
    first, again = handles[0].cuDriverGetVersion, handles[-1].cuDriverGetVersion
    assert fastpath.pointer(first) == fastpath.pointer(again) and type(first) is type(again)   # one library


def test_by_value_struct_functions_take_the_same_arguments_on_both_paths(fk, pc):
    """cuMemPrefetchAsync / cuMemAdvise take a CUmemLocation by value: called here (this test runs on
    both paths) with the struct, the fake driver answers for the range it was given."""
    drv = cuproc.driver.default_driver()
    managed = ffi.new("CUdeviceptr *")
    assert drv.cuMemAllocManaged(managed, 256, 1) == 0
    location = ffi.new("CUmemLocation *", {"type": 1, "id": 0})[0]
    try:
        assert drv.cuMemPrefetchAsync(managed[0], 256, location, 0, ffi.NULL) == 0
        assert drv.cuMemAdvise(managed[0], 128, 1, location) == 0
        with pytest.raises(TypeError):
            drv.cuMemPrefetchAsync(managed[0], 256, location, 0)      # one argument short, as cffi says
        assert not isinstance(drv.cuMemAdvise, types.MethodType)    # no trampoline: driver.py converts
    finally:
        assert drv.cuMemFree(managed[0]) == 0


# ----------------------------------------------------------------------------- the prepared launch in C

VALUES = [-5, -300, -70000, -(1 << 40), 200, 60000, 4000000000, 1 << 63, 0.25, 1e300, None]


def _expected(values, address):
    vals = [address if v is None else v for v in values]
    vals[8] = struct.unpack("<f", struct.pack("<f", vals[8]))[0]
    return struct.pack(ALL_FORMAT, *vals)


def test_prepared_launch_packs_every_scalar_kind_as_c_does(fk, pc):
    fn = Module.load(IMAGE).get_function("all")
    buf = DeviceBuffer(64)
    run = fn.prepare(ALL_KINDS, 1, 1)
    assert isinstance(run, types.FunctionType) != fastpath.active()   # the C launcher when on
    for values in (VALUES, [-128, 32767, 1 << 31 - 1, -1, 255, 0, 1, (1 << 64) - 1, -1.5, -0.0, None],
                   [127, -32768, -(1 << 31), (1 << 63) - 1, 0, 65535, (1 << 32) - 1, 0, 3e38, 5e-324, None]):
        run(*[buf if v is None else v for v in values])
        assert fk.last_launch() == ("all", _expected(values, buf.ptr))
    np_values = [np.int8(-1), np.int16(2), np.int32(-3), np.int64(4), np.uint8(5), np.uint16(6), np.uint32(7),
                 np.uint64(8), np.float32(0.5), np.float64(-2.5), buf.ptr]
    run(*np_values)
    assert fk.last_launch()[1] == struct.pack(ALL_FORMAT, -1, 2, -3, 4, 5, 6, 7, 8, 0.5, -2.5, buf.ptr)
    run(True, 0, 0, 0, 0, 0, 0, 0, 1, 2, 0)                # bool is an int; an int is a float
    assert fk.last_launch()[1] == struct.pack(ALL_FORMAT, 1, 0, 0, 0, 0, 0, 0, 0, 1.0, 2.0, 0)
    assert fk.launch_count() == 5 and fk.stale_count() == 0
    if fastpath.active():
        assert run.fallbacks == 1           # only the first call (it claims the block) went to Python


@needs_fast
def test_the_c_launcher_hands_uncommon_calls_to_the_pure_one(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    run = fn.prepare(["float*", "int", "float"], 1, 32)
    buf = DeviceBuffer(64)
    for i in range(5):
        run(buf, i, 0.5 * i)
    assert run.fallbacks == 1 and fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 4, 2.0)
    run(buf, 7, np.float32(1.5))                           # converted in C (__float__)
    run(buf.ptr, 8, 1)
    assert run.fallbacks == 1 and fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 8, 1.0)
    run(buf.view(np.float32), 9, 1.0)                      # a CAI object: the pure writer
    assert run.fallbacks == 2 and fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 9, 1.0)
    Stream().close()                                       # EPOCH moves (memory frees do not): the pure launcher verifies once
    run(buf, 10, 1.0)
    run(buf, 11, 1.0)
    assert run.fallbacks == 3 and fk.launch_count() == 10


@needs_fast
def test_the_c_launcher_hands_a_buffer_whose_context_is_not_a_live_context_to_the_pure_one(fk, pc):
    """The C launcher reads a DeviceBuffer's context and that context's ended from their slots: a context
    slot that holds no Context (here a live Stream, whose ended slot reads None) or an ended Context goes
    to the pure launcher, which launches or refuses as it always does."""
    from cuproc.context import Context
    fn = Module.load(IMAGE).get_function("empty")
    run = fn.prepare(["float*", "int", "float"], 1, 32)
    buf = DeviceBuffer(64)
    run(buf, 1, 1.0)
    assert run.fallbacks == 1                              # the first call claims the block
    own, stream = buf.context, Stream()
    run(buf, 2, 1.0)
    assert run.fallbacks == 1                              # made in C
    try:
        buf.context = stream                               # not a Context: the pure launcher decides
        run(buf, 3, 1.0)
        assert run.fallbacks == 2 and fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 3, 1.0)
        ended = Context.create(0)
        ended.close()                                      # EPOCH moves: the next call is seen again once
        buf.context = own
        run(buf, 4, 1.0)
        assert run.fallbacks == 3
        buf.context = ended
        with pytest.raises(ClosedResourceError):
            run(buf, 5, 1.0)
        assert run.fallbacks == 4
    finally:
        buf.context = own
    run(buf, 6, 1.0)
    assert run.fallbacks == 4 and fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 6, 1.0)
    assert fk.launch_count() == 5
    stream.close()


@pytest.mark.parametrize("index,bad", [(0, 128), (1, -32769), (2, 1 << 31), (3, 1 << 63), (4, -1), (5, 65536),
                                       (6, 1 << 32), (7, -1), (7, 1 << 64), (2, 1.5), (2, "3"), (8, "x"),
                                       (10, -1), (10, 1 << 64), (10, "not a pointer"), (10, 0.5), (8, 1 << 1100),
                                       (9, -(1 << 1100))])
def test_prepared_launch_refuses_what_cffi_refuses_before_the_driver(fk, pc, index, bad):
    fn = Module.load(IMAGE).get_function("all")
    run = fn.prepare(ALL_KINDS, 1, 1)
    ok = [0] * 10 + [DeviceBuffer(64)]
    run(*ok)
    with pytest.raises(InvalidValueError):
        run(*ok[:index], bad, *ok[index + 1:])
    assert fk.launch_count() == 1
    run(*ok)                                               # the block is whole again afterwards
    assert fk.last_launch()[1] == struct.pack(ALL_FORMAT, *[0] * 10, ok[10].ptr)


def test_an_int_for_a_float_parameter_is_stored_as_cffi_stores_it(fk, pc):
    fn = Module.load(IMAGE).get_function("all")
    run = fn.prepare(ALL_KINDS, 1, 1)
    buf = DeviceBuffer(64)
    for v in ((1 << 24) + 1, -(1 << 53) - 1, (1 << 64) + 3, 10 ** 308, -3, 0):   # rounded, huge, plain
        run(*[0] * 8, v, v, buf)
        reference = (ffi.new("float *", v)[0], ffi.new("double *", v)[0])     # cffi's conversion
        assert fk.last_launch()[1] == struct.pack(ALL_FORMAT, *[0] * 8, *reference, buf.ptr)
    assert fk.launch_count() == 6
    if fastpath.active():
        assert run.fallbacks == 1           # the C launcher stored them (only the first call claims the block)


class IndexOnly:
    """An integer only through __index__: cffi (nb_int) refuses it for an integer parameter."""
    def __index__(self) -> int:
        return 7


class IntAndIndex:
    """__int__ and __index__ disagree: cffi converts through __int__, so both paths store 5."""
    def __int__(self) -> int:
        return 5

    def __index__(self) -> int:
        return 6


def test_prepared_launch_converts_integers_as_cffi_does_on_both_paths(fk, pc):
    fn = Module.load(IMAGE).get_function("all")
    run = fn.prepare(ALL_KINDS, 1, 1)
    ok = [0] * 10 + [DeviceBuffer(64)]
    run(*ok)
    with pytest.raises(InvalidValueError):
        run(*ok[:2], IndexOnly(), *ok[3:])
    with pytest.raises(TypeError):
        ffi.new("int32_t *", IndexOnly())                  # the reference: cffi refuses it
    assert fk.launch_count() == 1
    assert ffi.new("int32_t *", IntAndIndex())[0] == 5
    run(*ok[:2], IntAndIndex(), *ok[3:])
    assert fk.last_launch()[1] == struct.pack(ALL_FORMAT, 0, 0, 5, *[0] * 7, ok[10].ptr)


class Raising:
    """A value whose conversion raises ``error`` and counts its calls."""
    def __init__(self, error: type[BaseException]) -> None:
        self.error, self.calls = error, 0

    def _raise(self):
        self.calls += 1
        raise self.error("from the value's own conversion")

    __float__ = __int__ = __index__ = _raise


@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
@pytest.mark.parametrize("index", [2, 8])          # an int32_t, a float
def test_an_error_from_a_values_own_conversion_is_raised_once(fk, pc, error, index):
    """Never swallowed (KeyboardInterrupt, MemoryError) nor provoked a second time by a fallback."""
    fn = Module.load(IMAGE).get_function("all")
    run = fn.prepare(ALL_KINDS, 1, 1)
    ok = [0] * 10 + [DeviceBuffer(64)]
    run(*ok)
    value = Raising(error)
    with pytest.raises(error):
        run(*ok[:index], value, *ok[index + 1:])
    assert value.calls == 1 and fk.launch_count() == 1
    run(*ok)
    assert fk.last_launch()[1] == struct.pack(ALL_FORMAT, *[0] * 10, ok[10].ptr)


@needs_fast
def test_make_launcher_refuses_offsets_and_dimensions_it_cannot_store(fk, pc):
    """The C side checks what it is given (it writes into the block at these offsets, never read back)."""
    from cuproc.launch import EPOCH
    kinds = fastpath.launcher_kinds()
    block = ffi.new("char[]", 16)
    address = int(ffi.cast("uintptr_t", block))

    from cuproc.context import Context
    slots = (DeviceBuffer.ended, DeviceBuffer.context, DeviceBuffer.address, Context.ended)

    def make(offsets=(8,), size=16, grid=(1, 1, 1), blk=(1, 1, 1), shmem=0, kind="int64_t", slots=slots,
             context=Context, recheck=print):
        return fastpath.launcher_factory()(
            print, print, recheck, EPOCH, [EPOCH[0]], [None, False], DeviceBuffer, context, slots, block, False, 1, 0,
            0, grid,
            blk, shmem, 0, 0, 0, address, size, bytes([kinds[kind]]), tuple(offsets))
    assert make().fallbacks == 0                           # fits: offset 8 + 8 bytes in 16
    for bad in ({"offsets": (9,)}, {"offsets": (16,)}, {"offsets": (-1,)}, {"size": 8},
                {"offsets": (13,), "kind": "int32_t"}, {"size": -1},
                # the buffer's slots, read in C by offset: each must be an object slot of DeviceBuffer,
                # and ended one of the context's class too
                {"slots": slots[:3]}, {"slots": (*slots[:2], DeviceBuffer.ptr, slots[3])},
                {"slots": (DeviceBuffer.ended, Context.handle, *slots[2:])},
                {"slots": (*slots[:3], Context.handle)}, {"context": dict}, {"recheck": None}):
        with pytest.raises(ValueError, match="make_launcher"):
            make(**bad)
    for bad in ({"grid": (1 << 32, 1, 1)}, {"blk": (1, 1, -1)}, {"shmem": 1 << 32}, {"grid": (1.0, 1, 1)},
                {"blk": (1, (1 << 64) + 1, 1)}):
        with pytest.raises(ValueError, match="unsigned 32-bit"):
            make(**bad)
    assert make(grid=None, blk=None, shmem=None).fallbacks == 0    # the dimensions come with each call
    for bad in ({"grid": None}, {"grid": None, "blk": None}, {"grid": (1, 1)}, {"blk": [1, 1, 1]}):
        with pytest.raises(ValueError, match="make_launcher"):
            make(**bad)


def test_prepared_launch_keeps_the_pure_refusals(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    run = fn.prepare(["float*", "int", "float"], 1, 32)
    buf = DeviceBuffer(64)
    run(buf, 1, 1.0)
    with pytest.raises(TypeError, match=r"empty\[float\*, int, float\]"):
        run(buf, 1)                                        # Python's count error, naming the kernel
    with pytest.raises(TypeError):
        run(buf, 1, 1.0, x=1)
    other = DeviceBuffer(64)
    other.free()
    with pytest.raises(ClosedResourceError):
        run(other, 1, 1.0)
    run(buf.address, 2, 2.0)
    buf.free()
    with pytest.raises(ClosedResourceError):
        run(buf, 1, 1.0)
    assert fk.launch_count() == 2 and fk.stale_count() == 0


def test_prepared_launch_from_other_threads_uses_private_blocks(fk, pc):
    fn = Module.load(IMAGE).get_function("fake_pair")
    run = fn.prepare(["int64_t", "int64_t"], 1, 1)
    run(0, 1)                                              # this thread owns the shared block
    errors = []

    def worker(seed):
        try:
            for a in range(seed, seed + 40):
                run(a, 3 * a + 1)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(1000 * i,)) for i in range(3)]
    for t in threads:
        t.start()
    for a in range(40):
        run(a, 3 * a + 1)
    for t in threads:
        t.join()
    assert not errors and fk.launch_mismatches() == 0 and fk.launch_count() == 1 + 4 * 40


def test_prepared_launch_rebinds_and_raises_on_a_driver_error(fk, pc):
    fn = Module.load(IMAGE).get_function("empty")
    drv = cuproc.driver.default_driver()
    entry = "cuLaunchKernelEx" if drv.has("cuLaunchKernelEx", newer_driver_features=False) else "cuLaunchKernel"
    run = fn.prepare(["float*", "int", "float"], 1, 32)
    buf = DeviceBuffer(64)
    fk.fail(entry, 2)                                      # CUDA_ERROR_OUT_OF_MEMORY once
    with pytest.raises(cuproc.OutOfMemoryError):
        run(buf, 1, 1.0)
    drv.cuCtxSetCurrent(ffi.NULL)                          # no context current: the launch rebinds
    run(buf, 3, 1.0)
    assert fk.last_launch()[1] == struct.pack("<Qif", buf.ptr, 3, 1.0) and fk.binding_errors() <= 1


# ----------------------------------------------------------------------------- the checked call

def _python_reference(name: str, params: tuple[str, ...]):
    """A Python function with ``params`` as positional-only parameters: the reference for count and
    keyword messages (Python's own text, independent of both wrappers)."""
    namespace: dict = {}
    exec(f"def {name}({', '.join(params)}{', /' if params else ''}): pass", namespace)  # noqa: S102
    return namespace[name]


def _parameters(checked) -> tuple[str, ...]:
    """The exact parameters of a checked function, on either path."""
    if isinstance(checked, types.FunctionType):
        return checked.__code__.co_varnames[:checked.__code__.co_argcount]
    return checked.parameters


@pytest.mark.parametrize("generation", ["v2", "v1", "none"])
def test_preload_asks_the_driver_in_one_c_call_on_the_fast_path(sims, monkeypatch, generation):
    """preload() makes its cuGetProcAddress queries in one cuproc_ask_all call (src/fastpath/fastpath_resolve.c)
    on the fast path, for v2 and v1 drivers, and in Python for a dlsym-only driver or on the pure path.
    test_driver_sim's preload tests check the answers on both paths."""
    s = sims[generation]
    s.set_version(13000 if generation == "v2" else 11080 if generation == "v1" else 11020)
    real, calls = fastpath.ask_all(), []
    assert (real is None) == (not fastpath.active())   # the pure path has no batch: preload() asks in Python

    def counting(*args):
        calls.append(args[6])   # n, the number of names asked
        return real(*args)
    monkeypatch.setattr(fastpath, "ask_all", lambda: None if real is None else counting)
    drv = cuproc.Driver(library=str(s.path))
    counts = drv.preload()
    if real is None:
        assert not fastpath.active() and calls == []
    elif generation == "none":
        assert calls == []
    else:
        table = drv.registry.entries(drv.version, per_thread=False)
        driver = int(drv.driver_version)
        assert calls == [sum(1 for e in table.values() if e.availability == "available" and e.abi_version <= driver)]
        assert sum(counts.values()) == len(drv.registry)
        assert drv.has("cuMemAlloc") and drv.resolution("cuMemAlloc").status == "resolved"


def test_the_batchs_answers_are_read_as_one_query_reads_its_own():
    """cuproc_ask_all's (status code, address) pairs, decoded as the per-name query decodes its answer: only a
    success with a pointer resolves; a failed call (-1), an unknown code or a success with NULL is not found."""
    from cuproc.driver import _decoded
    q = ffi.typeof("CUdriverProcAddressQueryResult").relements
    ok, missing, too_new = (q["CU_GET_PROC_ADDRESS_SUCCESS"], q["CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND"],
                            q["CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT"])
    codes = [ok, ok, missing, too_new, -1, 99, missing]
    addresses = [0x1000, 0, 0, 0, 0x2000, 0x3000, 0x4000]
    assert _decoded(codes, addresses) == [
        ("resolved", 0x1000), ("symbol_not_found", None), ("symbol_not_found", None),
        ("version_not_sufficient", None), ("symbol_not_found", None), ("symbol_not_found", None),
        ("symbol_not_found", None)]


def test_a_compiled_module_without_the_batch_leaves_preload_in_python(sim, monkeypatch):
    """fastpath.ask_all() is None for a compiled module that lacks cuproc_ask_all, and preload() asks each
    name in Python then, with the same answers."""
    from cuproc import _ffi

    class Lib:
        pass
    monkeypatch.setattr(_ffi, "COMPILED", types.SimpleNamespace(lib=Lib()))
    assert fastpath.ask_all() is None
    drv = cuproc.Driver(library=str(sim.path))
    counts = drv.preload()
    assert counts["resolved"] > 0 and drv.resolution("cuMemAlloc").status == "resolved"
    assert cuproc.ffi.typeof(drv.resolution("cuMemAlloc").function).kind == "function"


@needs_fast
@pytest.mark.parametrize("generation", ["v2", "v1"])
def test_ask_all_answers_each_name_as_one_query_does(sims, generation):
    """cuproc_ask_all against the lookup function called once per name through cffi: the same pointers and
    statuses (a missing name: the v1 lookup fails, -1; a name below its first version; an unknown name), and
    a names buffer that ends early stops there, touching nothing after."""
    s = sims[generation]
    s.set_version(13000 if generation == "v2" else 11080)
    lib = cuproc.loader.open_library(str(s.path))
    v2 = lib.lookup == cuproc.loader.GET_PROC_ADDRESS_V2
    queries = [("cuMemAlloc", 3020), ("cuMemAlloc", 2000), ("cuNoSuchFunction", 12000), ("cuCtxCreate", 3020),
               ("cuStreamBeginCaptureToGraph", 12030), ("cuInit", 2000), ("cuMemAllocAsync", 11020),
               ("cuMemAlloc", 13050)]   # v2: above the driver's version, the call fails
    expected = []
    for name, version in queries:
        out, status = ffi.new("void **"), ffi.new("CUdriverProcAddressQueryResult *")
        rc = lib.get_proc_address(name.encode(), out, version, 0, status) if v2 else \
            lib.get_proc_address(name.encode(), out, version, 0)
        expected.append((int(ffi.cast("uintptr_t", out[0])), int(status[0]) if rc == 0 else -1))
    names = b"".join(name.encode() + b"\0" for name, _ in queries)
    n = len(queries)
    pointers, codes = ffi.new("void *[]", n), ffi.new("int[]", n)
    versions = ffi.new("int[]", [version for _, version in queries])
    lookup = fastpath.pointer(lib.get_proc_address)
    assert fastpath.ask_all()(lookup, v2, names, len(names), versions, 0, n, pointers, codes) == n
    got = list(zip(ffi.unpack(ffi.cast("uintptr_t *", pointers), n), ffi.unpack(codes, n)))
    assert got == expected
    assert expected[0][0] != 0 and expected[2][0] == 0 and any(code == -1 for _, code in expected)
    for i in range(n):
        pointers[i], codes[i] = ffi.cast("void *", 7), 7
    cut = len(b"".join(name.encode() + b"\0" for name, _ in queries[:3])) + 4   # the 4th name lacks its NUL
    assert fastpath.ask_all()(lookup, v2, names[:cut], cut, versions, 0, n, pointers, codes) == 3
    assert list(zip(ffi.unpack(ffi.cast("uintptr_t *", pointers), 3), ffi.unpack(codes, 3))) == expected[:3]
    assert [int(ffi.cast("uintptr_t", pointers[i])) for i in range(3, n)] == [7] * (n - 3)
    assert list(ffi.unpack(codes, n))[3:] == [7] * (n - 3)


def test_checked_call_is_c_on_the_fast_path_and_python_on_the_pure_one(sim):
    drv = cuproc.Driver(library=str(sim.path))
    checked = drv.checked.cuMemAlloc
    assert isinstance(checked, types.FunctionType) != fastpath.active()
    assert checked.__name__ == checked.__qualname__ == "cuMemAlloc" and "cuMemAlloc" in repr(checked)
    assert "CudaError" in checked.__doc__
    assert drv.checked.cuMemAlloc is checked                 # made once per handle and name
    assert _parameters(checked) == ("arg0_unsigned_long_long_ptr", "arg1_size_t")   # named for the C types
    if fastpath.active():
        assert checked.function is drv.cuMemAlloc            # the trampoline, called as is


@pytest.mark.parametrize("code,cls", [(2, cuproc.OutOfMemoryError), (1, InvalidValueError), (999, cuproc.CudaError)])
def test_checked_call_raises_what_the_handle_makes_of_the_result(sim, code, cls):
    drv = cuproc.Driver(library=str(sim.path))
    p = ffi.new("CUdeviceptr *")
    sim.set_result(code)
    assert drv.cuMemAlloc(p, 16) == code                     # the reference: the raw call's result
    expected = drv.error(code, "cuMemAlloc")
    sim.reset_last_called()
    with pytest.raises(cls) as info:
        drv.checked.cuMemAlloc(p, 16)
    assert sim.last_called() == "cuMemAlloc_v2"              # the driver was called, and said no
    err = info.value
    assert type(err) is type(expected) and err.code == code and err.call == "cuMemAlloc"
    assert str(err) == str(expected)
    sim.set_result(0)
    assert drv.checked.cuMemAlloc(p, 16) is None
    assert drv.checked.cuDriverGetVersion(ffi.new("int *")) is None   # one parameter (a slot trampoline)


def test_checked_call_refuses_a_wrong_count_and_keywords_with_pythons_own_text(sim):
    drv = cuproc.Driver(library=str(sim.path))
    cases = [("cuMemcpyHtoD", (0, ffi.NULL, 0)), ("cuMemAlloc", (ffi.new("CUdeviceptr *"), 16)),
             ("cuDriverGetVersion", (ffi.new("int *"),)), ("cuMemGetInfo", (ffi.new("size_t *"), ffi.new("size_t *")))]
    for name, ok in cases:
        checked = getattr(drv.checked, name)
        reference = _python_reference(name, _parameters(checked))
        assert len(_parameters(checked)) == len(ok)
        sim.reset_last_called()
        for count in range(len(ok) + 3):
            if count == len(ok):
                continue
            args = (ok * 3)[:count]
            with pytest.raises(TypeError) as ours:
                checked(*args)
            with pytest.raises(TypeError) as theirs:
                reference(*args)
            assert str(ours.value) == str(theirs.value)
        for keywords in ({"flag": 1}, {_parameters(checked)[-1]: ok[-1]}):
            with pytest.raises(TypeError) as ours:
                checked(*ok[:-1], **keywords)
            with pytest.raises(TypeError) as theirs:
                reference(*ok[:-1], **keywords)
            assert str(ours.value) == str(theirs.value) and name in str(ours.value)
        assert sim.last_called() == ""                        # no refused call reached the driver
        assert checked(*ok) is None


def test_checked_call_with_its_own_count_check_passes_every_count(sim):
    """cuInit is a Python wrapper (fork tracking): the checked form passes any count to it."""
    drv = cuproc.Driver(library=str(sim.path))
    ck = drv.checked.cuInit
    assert ck.__code__.co_argcount == 0 if isinstance(ck, types.FunctionType) else ck.parameters is None
    assert drv.checked.cuInit(0) is None
    with pytest.raises(TypeError, match="cuInit"):
        drv.checked.cuInit()
    with pytest.raises(TypeError, match="unexpected keyword argument 'flags'"):
        drv.checked.cuInit(flags=0)


def test_a_checked_call_keeps_its_raw_callable_alive_and_frees_it_with_itself(sim):
    from cuproc.driver import _make_checked
    drv = cuproc.Driver(library=str(sim.path))
    results = [0, 201, None, 0]

    def raw(value):               # a stand-in raw callable: returns the next result
        return results.pop(0)
    alive = __import__("weakref").ref(raw)
    checked = _make_checked(raw, "cuFake", drv.error, 1)
    del raw
    import gc
    gc.collect()
    assert alive() is not None
    assert checked(1) is None
    with pytest.raises(cuproc.errors.InvalidContextError) as info:
        checked(1)
    assert info.value.call == "cuFake" and info.value.code == 201
    assert checked(1) is None                                  # a false result that is no int: success, as `if rc`
    cycle = [checked]
    cycle.append(cycle)
    del checked, cycle, info     # (the traceback holds the pure wrapper's frame)
    gc.collect()
    assert alive() is None


def test_an_error_factory_that_fails_or_returns_no_exception_is_reported(sim):
    from cuproc.driver import _make_checked

    def broken(code, call):
        raise RuntimeError(f"factory broke on {call} {code}")
    checked = _make_checked(lambda v: 3, "cuFake", broken, 1)
    with pytest.raises(RuntimeError, match="factory broke on cuFake 3"):
        checked(0)
    checked = _make_checked(lambda v: 3, "cuFake", lambda code, call: "not an exception", 1)
    with pytest.raises(TypeError):
        checked(0)
    checked = _make_checked(lambda v: 1 << 80, "cuFake", lambda code, call: OverflowError(code), 1)
    with pytest.raises(OverflowError) as info:                 # no C long, still nonzero
        checked(0)
    assert info.value.args == (1 << 80,)


def test_checked_calls_from_threads_raise_and_return_their_own(fk):
    drv = cuproc.driver.default_driver()
    drv.checked.cuInit(0)
    get = drv.checked.cuDeviceGet
    failures: list[BaseException] = []

    def work():
        try:
            out = ffi.new("CUdevice *")
            for i in range(500):
                out[0] = -1
                assert get(out, 0) is None and out[0] == 0
                with pytest.raises(cuproc.CudaError) as info:
                    get(out, 1000 + i)
                assert info.value.call == "cuDeviceGet" and info.value.code == drv.cuDeviceGet(out, 1000 + i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]


def _outcome(call, *args, **kwargs) -> tuple[str, str]:
    try:
        return ("returned", repr(call(*args, **kwargs)))
    except Exception as exc:  # noqa: BLE001 - compared below
        return (type(exc).__name__, str(exc))


def test_in_a_forked_child_a_wrong_call_gets_the_same_refusal_on_both_paths(monkeypatch):
    """Count and keyword errors come before the fork refusal, in C as in the pure wrapper, and with
    Python's own text (review finding 4: the C call checked the fork first)."""
    from cuproc import _fork
    from cuproc.driver import _make_checked
    reached: list[tuple] = []

    def raw(a, b):
        reached.append((a, b))
        return 0
    made = _make_checked(raw, "cuFake", cuproc.errors.CudaError, 2)
    monkeypatch.setattr(fastpath, "checked_factory", lambda: None)
    pure = _make_checked(raw, "cuFake", cuproc.errors.CudaError, 2)
    assert isinstance(pure, types.FunctionType) and isinstance(made, types.FunctionType) != fastpath.active()
    reference = _python_reference("cuFake", _parameters(pure))
    calls = [((1,), {}), ((1, 2, 3), {}), ((), {}), ((1,), {"zz": 2}), ((1, 2), {"zz": 2}),
             ((1,), {_parameters(pure)[1]: 2})]
    saved = _fork.FORKED[0]
    _fork.FORKED[0] = True
    try:
        for args, kwargs in calls:
            expected = _outcome(reference, *args, **kwargs)
            assert expected[0] == "TypeError"
            assert _outcome(made, *args, **kwargs) == _outcome(pure, *args, **kwargs) == expected, (args, kwargs)
        refused = [_outcome(made, 1, 2), _outcome(pure, 1, 2)]   # a right call: the fork refusal
    finally:
        _fork.FORKED[0] = saved
    assert refused[0] == refused[1] and refused[0][0] == "ForkedProcessError" and "cuFake" in refused[0][1]
    assert reached == []                                       # nothing reached the raw function
    assert made(1, 2) is None and pure(3, 4) is None and reached == [(1, 2), (3, 4)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_checked_call_taken_before_fork_refuses_in_the_child(sim):
    code = f"""
import os, sys, cuproc
drv = cuproc.Driver(library={str(sim.path)!r})
assert drv.checked.cuInit(0) is None
alloc, version = drv.checked.cuMemAlloc, drv.checked.cuDriverGetVersion
p = cuproc.ffi.new('CUdeviceptr *')
assert alloc(p, 16) is None
pid = os.fork()
if pid == 0:
    codes = []
    for call in (lambda: alloc(p, 16), lambda: version(cuproc.ffi.new('int *'))):
        try:
            call()
            codes.append(1)
        except cuproc.ForkedProcessError as exc:
            codes.append(0 if exc.call in ('cuMemAlloc', 'cuDriverGetVersion') and 'spawn' in str(exc) else 2)
        except BaseException:
            codes.append(3)
    os._exit(int(''.join(map(str, codes)), 4))
status = os.waitpid(pid, 0)[1]
assert alloc(p, 16) is None                  # the parent goes on
sys.exit(os.waitstatus_to_exitcode(status))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, (out.returncode, out.stderr)   # both calls refused, naming themselves


@needs_fast
def test_make_checked_refuses_inconsistent_arguments():
    make = fastpath.checked_factory()
    from cuproc import _fork
    from cuproc.driver import forked_error
    good = dict(function=lambda a: 0, name="cuFake", params=("a",), error=print, forked=_fork.FORKED,
                forked_error=forked_error, doc="d")
    assert make(*good.values())("x") is None                # consistent: it builds and calls
    for field, bad in (("function", 1), ("params", ["a"]), ("params", (1,)), ("forked", [False, False]),
                       ("forked", (False,)), ("error", None), ("name", b"cuFake")):
        with pytest.raises(TypeError):
            make(*{**good, field: bad}.values())


@needs_fast
def test_make_stream_ordered_refuses_slots_that_are_not_the_classes_own():
    """The C fronts store a buffer's fields at the offsets of the member descriptors they are given:
    a descriptor of another class (whose offset could lie anywhere in a DeviceBuffer) is refused."""
    from cuproc import device_memory as dm
    from cuproc._resource import FORKED, Resource
    from cuproc.allocation import EXPORTS, Allocation
    make = fastpath.stream_ordered_factory()
    slots = (Resource.driver, Resource.ended, Allocation.context, Allocation.address, Allocation.nbytes,
             dm.DeviceBuffer.stream, dm.DeviceBuffer.pool, dm.DeviceBuffer.last_stream, cuproc.Context.stream_ordered,
             dm.Stream.context, dm.Stream.handle, dm.DeviceBuffer.claim_key)
    common = (dm.Stream, dm.DeviceBuffer, cuproc.Context, cuproc.ffi.typeof("CUstream"), FORKED, EXPORTS, "freed")
    fronts = make(*(print,) * 7, *common, slots)
    assert len(fronts) == 3                                   # consistent: it builds
    for bad in ((cuproc.Context.stream_ordered, *slots[1:]), (*slots[:8], dm.DeviceBuffer.stream, *slots[9:]),
                (*slots[:2], cuproc.Context.handle, *slots[3:]), (*slots[:10], dm.DeviceBuffer.stream, slots[11]),
                (*slots[:11], dm.Stream.handle)):
        with pytest.raises(ValueError, match="slot"):
            make(*(print,) * 7, *common, bad)
    with pytest.raises(TypeError):
        type(fronts[0])()                                     # made by the factory only


# ----------------------------------------------------------------------------- both paths in CI

@pytest.mark.slow   # a minute: CI runs it (the pure path's own run is CI's too)
@pytest.mark.skipif(not fastpath.active(), reason="this run already is the pure path")
def test_pure_path_reruns_driver_launch_and_ownership():
    files = ["tests/test_driver_sim.py", "tests/test_launch_cpu.py", "tests/test_launch_one_shot.py",
             "tests/test_objects_fake.py", "tests/test_ownership.py", "tests/test_memory_paths.py",
             "tests/test_fastpath.py", "tests/test_module_namespace.py", "tests/test_device_buffer_front.py",
             "tests/test_copy_front.py"]
    # Of the object tests, those that launch; not the build test (it does not depend on the path).  The
    # random sequences run both paths themselves (tests/test_sequences_fake.py).
    only = "(not test_objects_fake or launch or typed) and not install_without"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", only, *files]
    out = subprocess.run(command, check=False,
                         capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env={**os.environ, "CUPROC_PURE_PYTHON": "1"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.search(r"\d+ passed", out.stdout)


# ----------------------------------------------------------------------------- the build

def _build_ext(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """``setup.py build_ext --inplace`` in a copy of the project's build inputs under ``tmp_path``."""
    pytest.importorskip("setuptools")
    if not (ROOT / "setup.py").is_file():
        pytest.skip("needs the project's setup.py and tools/ next to tests/ (a checkout or an sdist)")
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path)
    # This runs setup.py with the environment's own setuptools (no build isolation), which may predate
    # PEP 639 metadata (setuptools 77): the optional build is under test here, not the license fields.
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text("".join(line for line in pyproject.read_text().splitlines(keepends=True)
                                 if not line.startswith(("license =", "license-files ="))))
    shutil.copytree(PACKAGE, tmp_path / "cuproc", ignore=COPY_IGNORE)   # an sdist in CI has none of its own
    shutil.copytree(ROOT / "headers", tmp_path / "headers", ignore=COPY_IGNORE)
    for name in _fastpath_digest.TOOL_INPUTS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    return subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], check=False,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, **env})


@pytest.mark.parametrize("value", ["1", "maybe"])
def test_cuproc_no_fastpath_skips_the_build_and_a_value_neither_on_nor_off_stops_it(tmp_path, value):
    """CUPROC_NO_FASTPATH is read by cuproc's one rule for its on/off variables (cuproc/_env.py): on, the
    build is skipped with the one notice; a typo stops the install naming the variable, never a silent side."""
    out = _build_ext(tmp_path, CC="/bin/false", CUPROC_NO_FASTPATH=value)
    assert not list((tmp_path / "cuproc").glob("_fastpath_c*"))
    if value == "1":
        notices = [line for line in out.stderr.splitlines() if line.startswith("cuproc: the optional compiled")]
        assert out.returncode == 0 and len(notices) == 1 and "CUPROC_NO_FASTPATH" in notices[0], out.stderr[-2000:]
    else:
        assert out.returncode != 0 and "CUPROC_NO_FASTPATH='maybe'" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow   # a pip install: over a minute, CI runs it
def test_install_without_a_working_compiler_succeeds_with_one_notice(tmp_path):
    """setup.py's build_ext with a compiler that fails: no extension, exit 0, one line saying so.

    (It runs ``setup.py build_ext`` directly, not pip: pip hides a successful backend's output, which
    is why docs/guide/getting-started.rst and docs/guide/speed.rst point users to ``cuproc.fastpath.status()``.)"""
    out = _build_ext(tmp_path, CC="/bin/false")
    assert out.returncode == 0, out.stderr[-3000:]
    notices = [line for line in out.stderr.splitlines() if line.startswith("cuproc: the optional compiled")]
    assert len(notices) == 1 and "pure Python" in notices[0]
    # the reason, whole: the error's type and the compiler's own last line, not a cut gcc command line
    assert "CompileError" in notices[0] and "/bin/false" in notices[0] and " -I" not in notices[0], notices[0]
    assert not list((tmp_path / "cuproc").glob("_fastpath_c*"))
    probe = run_python("import cuproc.fastpath as f; print(f.active(), f.status())", copy=tmp_path,
                       CUPROC_PURE_PYTHON="0")
    assert probe.stdout.startswith("False off: not built") and "no C compiler" in probe.stdout, probe.stderr


def test_the_fronts_typedefs_are_the_ones_the_c_sources_call_through():
    """fastpath.FRONT_TYPEDEFS (what the object layer checks a resolved function against before a C front
    calls it) names exactly the PFN_ types the C fronts cast their function pointers to."""
    from cuproc import _fastpath_digest
    casts = set()
    fronts = [s for s in _fastpath_digest.C_SOURCES if s != "src/fastpath/fastpath_resolve.c"]   # (that one: no front)
    for source in fronts:
        casts |= set(re.findall(r"\(\((PFN_\w+)\)", (ROOT / source).read_text()))
    assert casts == set(fastpath.FRONT_TYPEDEFS.values())
    for name, typedef in fastpath.FRONT_TYPEDEFS.items():
        assert typedef.startswith(f"PFN_{name}_v")


def test_without_the_gil_no_front_is_made_and_the_trampolines_stay(monkeypatch):
    """A free-threaded interpreter running without the GIL: every front relies on it to make a test and a
    store one step, so each factory answers None (the Python code, with its locks, is used), while the
    trampolines -- plain calls through a pointer -- stay."""
    factories = [fastpath.launcher_factory, fastpath.checked_factory, fastpath.one_shot_factory,
                 fastpath.stream_ordered_factory, fastpath.device_buffer_factory, fastpath.claim_factory,
                 fastpath.copy_factory]
    with_gil = [f() is not None for f in factories] + [fastpath.launcher_kinds() is not None]
    assert with_gil == [fastpath.active()] * len(with_gil)
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    assert [f() for f in factories] == [None] * len(factories) and fastpath.launcher_kinds() is None
    assert fastpath.active() == (fastpath.status().startswith("on"))   # the trampolines: unchanged
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: True, raising=False)   # a free-threaded build with it
    assert [f() is not None for f in factories] == [fastpath.active()] * len(factories)
