"""NVRTC, CUDA's runtime compiler: found and opened on first use, as the driver is; its C functions; its errors.

Policy
------
* **Nothing at import.**  ``import cuproc`` does not import this module; ``cuproc.Program`` and
  :func:`cuproc.compile_kernel` import it when first used, and the library opens at the first call
  that needs it.  Without NVRTC everything else in cuproc works; compiling raises
  :class:`NvrtcNotFoundError`, which says what to install.
* **Where it is found**, first that opens: ``CUPROC_LIBNVRTC`` (a path or a name for the dynamic
  linker; when set, nothing else is tried), the NVRTC wheel (``pip install 'cuproc[nvrtc]'`` for
  CUDA 13's ``nvidia-cuda-nvrtc``; CUDA 12's is ``nvidia-cuda-nvrtc-cu12``, 11's ``-cu11``:
  :func:`wheel_name`; its ``nvidia/cu13/lib`` or, for CUDA 11 and 12, ``nvidia/cuda_nvrtc/lib``, newest
  major first, in every ``sys.path`` entry), a toolkit (``CUDA_HOME``, ``CUDA_PATH``, ``/usr/local/cuda``),
  then the dynamic linker's own search by name (``libnvrtc.so.13``, ...).  When the caller knows the
  driver's CUDA major (``prefer_major``, as :mod:`cuproc.program` passes it), every NVRTC of that major
  goes first, keeping that order among them: a cubin of a newer major may not load on the driver, and
  PTX of a newer major's ISA certainly does not.  :func:`locate` names the
  file without opening it: the compile cache keys on the file's identity (its build: path, size,
  modification time, device and inode; :class:`Location`), and a cache hit should not pay the 10-15 ms that
  opening the 140 MB library costs.  An opened library whose build is unknown (no file, no mapping) has no
  identity, and its compiles are not cached: a miss, never another build's hit.
* **Declarations** are those of ``headers/nvrtc.h``, trimmed from ``nvrtc.h`` of every pinned NVRTC by
  ``tools/gen_nvrtc_header.py`` and compiled into ``cuproc/_nvrtc_cffi.py`` (no parsing at run time).
  A function the opened NVRTC lacks raises :class:`NvrtcFunctionMissingError` when asked for, naming
  the NVRTC that first declared it and the one loaded; :meth:`NvrtcLibrary.has` asks without raising.
* **Version** from ``nvrtcVersion``, as a :class:`~cuproc.version.CudaVersion`.
* One :class:`NvrtcLibrary` per path per process; it stays loaded until the process ends.
* Its ``libnvrtc-builtins`` (which NVRTC opens by name at its first compile) is opened first from the
  library's own directory: NVRTC 13.0 has no ``$ORIGIN`` run path, so from a wheel it otherwise fails
  with "failed to open libnvrtc-builtins.so.13.0" unless ``LD_LIBRARY_PATH`` names that directory.
* :func:`compile_program` is the whole NVRTC round trip of one compilation (create, name
  expressions, compile, log, output, lowered names, destroy), with every failure raised as an
  :class:`NvrtcError`; choosing the architecture, the output and the cache is the object layer's
  (:mod:`cuproc.program`).
"""
from __future__ import annotations

import itertools
import os
import re
import sys

from . import _fork
from ._nvrtc_header_data import DECLARED, NVRTC_HEADERS
from .version import CudaVersion

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping
    from typing import Any

ENV_LIBRARY = "CUPROC_LIBNVRTC"
# The NVRTC wheel of each CUDA major on PyPI: nvidia-cuda-nvrtc has only CUDA 13 (and later) releases; CUDA
# 12's and 11's carry the major in the name.
_UNSUFFIXED_FROM = 13


def wheel_name(major: int) -> str:
    """The PyPI name of the NVRTC wheel of CUDA ``major``: ``nvidia-cuda-nvrtc`` from 13,
    ``nvidia-cuda-nvrtc-cu12`` and ``nvidia-cuda-nvrtc-cu11`` before."""
    return "nvidia-cuda-nvrtc" if major >= _UNSUFFIXED_FROM else f"nvidia-cuda-nvrtc-cu{major}"


def pip_install(version: CudaVersion | str | int, spec: str = "==", *, upgrade: bool = False) -> str:
    """The pip command for the NVRTC wheel of ``version``'s major: ``pip install
    'nvidia-cuda-nvrtc-cu12==12.8.*'`` for ``CudaVersion(12, 8)`` (``spec`` ``">="`` gives ``>=12.8``; a
    bare major ``12`` gives ``==12.*``)."""
    text = str(version)
    major = int(text.partition(".")[0])
    wanted = f"{text}.*" if spec == "==" else text
    return f"pip install {'-U ' if upgrade else ''}'{wheel_name(major)}{spec}{wanted}'"


def install_hint(major: int | None = None) -> str:
    """What to install to compile: for a CUDA ``major`` driver its NVRTC wheel; with no major known, the
    extra (CUDA 13's wheel) and the CUDA 12 one."""
    where = f"or set {ENV_LIBRARY} to the path of libnvrtc.so"
    if major is not None and major < _UNSUFFIXED_FROM:
        return f"install NVRTC for this CUDA {major} driver with {pip_install(major)}, {where}"
    return (f"install NVRTC with pip install 'cuproc[nvrtc]' (the nvidia-cuda-nvrtc wheel, CUDA 13; on a CUDA 12 "
            f"driver {pip_install(12)}), {where}")


INSTALL_HINT = install_hint()

if sys.platform == "win32":
    _LIB_DIR, _NAME = "bin", re.compile(r"^nvrtc64_(\d+)(?:_\d+)?\.dll$")
    _SONAMES: tuple[str, ...] = ("nvrtc64_130_0.dll", "nvrtc64_120_0.dll", "nvrtc64_112_0.dll")
    _TOOLKIT_DIRS: tuple[str, ...] = ("bin",)
else:
    _LIB_DIR, _NAME = "lib", re.compile(r"^libnvrtc\.so\.(\d+)(?:\.\d+)*$")
    _SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so")
    _TOOLKIT_DIRS = ("lib64", "lib")
_WHEEL_DIR = re.compile(r"^cu(\d+)$")


# --------------------------------------------------------------------------- errors

class NvrtcNotFoundError(OSError):
    """No NVRTC library could be opened; ``attempts`` lists each path with why it failed.  The message names
    the wheel of ``driver_major`` (the driver's CUDA major) where it is known."""

    def __init__(self, attempts: list[tuple[str, str]], driver_major: int | None = None) -> None:
        self.attempts, self.driver_major = attempts, driver_major
        tried = "".join(f"\n  {path}: {why}" for path, why in attempts) or " nothing (no candidate path)"
        super().__init__(f"NVRTC (CUDA's runtime compiler) is needed to compile from source, and none could be "
                         f"opened. Tried:{tried}\nTo compile, {install_hint(driver_major)}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.attempts, self.driver_major))


class NvrtcError(Exception):
    """An NVRTC call failed: ``code`` (nvrtcResult, or None when NVRTC was not called), ``name``
    (its enumerator), ``call`` (the C function) and ``hint`` (what to do)."""

    def __init__(self, message: str, *, call: str | None = None, code: int | None = None,
                 name: str | None = None, hint: str = "") -> None:
        self.call, self.code, self.name, self.hint = call, code, name, hint
        super().__init__(f"{message}. {hint}" if hint else message)


class NvrtcFunctionMissingError(NvrtcError):
    """The opened NVRTC does not export a function cuproc needs for what was asked (too old, or the
    function was dropped).  Not an AttributeError: ``hasattr`` and ``getattr(..., default)`` would
    swallow it; ask :meth:`NvrtcLibrary.has` instead."""


class CompileError(NvrtcError):
    """The source did not compile: ``log`` is NVRTC's program log (the errors, with file and line)."""

    def __init__(self, program: str, log: str, options: tuple[str, ...], code: int, name: str) -> None:
        self.log, self.program, self.options = log, program, options
        super().__init__(f"{program} failed to compile ({name}) with options {list(options)}:\n{log.rstrip()}",
                         call="nvrtcCompileProgram", code=code, name=name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (CompileError, (self.program, self.log, self.options, self.code, self.name))


# --------------------------------------------------------------------------- finding

def _numbered(directory: str) -> list[str]:
    """The NVRTC library files in ``directory``, newest major first (not libnvrtc-builtins)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := _NAME.match(n))]
    return [os.path.join(directory, n) for _, n in sorted(found, key=lambda t: (-t[0], -len(t[1]), t[1]))]


def _wheel_paths() -> Iterator[str]:
    """libnvrtc of the nvidia-cuda-nvrtc wheels in each sys.path entry: nvidia/cuNN/lib (13 and later)
    newest first, then nvidia/cuda_nvrtc/lib (the -cu12 and -cu11 wheels)."""
    for site in sys.path:
        root = os.path.join(site or ".", "nvidia")
        try:
            subdirs = os.listdir(root)
        except OSError:
            continue
        majors = sorted((int(m.group(1)) for d in subdirs if (m := _WHEEL_DIR.match(d))), reverse=True)
        for d in [f"cu{m}" for m in majors] + ["cuda_nvrtc"]:
            yield from _numbered(os.path.join(root, d, _LIB_DIR))


def _toolkit_paths() -> Iterator[str]:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             None if sys.platform == "win32" else "/usr/local/cuda"]
    for root in dict.fromkeys(r for r in roots if r):
        for sub in _TOOLKIT_DIRS:
            yield from _numbered(os.path.join(root, sub))


def major_of(path: str) -> int | None:
    """The CUDA major of an NVRTC library file by its name (``libnvrtc.so.12`` -> 12, ``nvrtc64_130_0.dll``
    -> 13); None for an unnumbered name."""
    m = _NAME.match(os.path.basename(path))
    if m is None:
        return None
    number = int(m.group(1))
    return number // 10 if number >= 100 else number


def _candidates(prefer_major: int | None = None) -> Iterator[str]:
    """:func:`candidate_paths`, one at a time (so that :func:`locate` stops at the first file)."""
    env = os.environ.get(ENV_LIBRARY)
    if env:
        yield env
        return
    found = list(dict.fromkeys(itertools.chain(_wheel_paths(), _toolkit_paths(), _SONAMES)))
    if prefer_major is not None:
        found.sort(key=lambda path: major_of(path) != prefer_major)   # stable: the order within stays
    yield from found


def candidate_paths(prefer_major: int | None = None) -> list[str]:
    """Where NVRTC is looked for, in order, those of CUDA major ``prefer_major`` first (see the module's
    policy)."""
    return list(_candidates(prefer_major))


class Location:
    """An NVRTC library file found without opening it: its path, size, modification time, device and inode (of
    the file a symlink names: a toolkit's ``libnvrtc.so.13`` links to ``libnvrtc.so.13.0.88``).

    :attr:`identity` names the build: two NVRTC builds of one minor (13.0.48 and 13.0.88) report the same
    ``nvrtcVersion`` and may emit different code, and a build installed in place of another changes the
    size or the modification time -- or, where an installer keeps both (a copy with its times preserved), the
    inode.  The compile cache keys on it, so a hit opens no NVRTC."""

    __slots__ = ("path", "size", "mtime_ns", "device", "inode")

    def __init__(self, path: str, size: int, mtime_ns: int, device: int, inode: int) -> None:
        self.path, self.size, self.mtime_ns, self.device, self.inode = path, size, mtime_ns, device, inode

    @classmethod
    def of_stat(cls, path: str, st: os.stat_result) -> Location:
        """The location of ``path`` as ``st`` (its ``os.stat``) describes the file."""
        return cls(path, st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)

    @property
    def identity(self) -> str:
        """``absolute path|size|mtime_ns|device|inode``, all of one ``stat``.  The path is not resolved through
        symlinks: the rest is the target's already, and resolving costs a system call per directory on a
        cache hit."""
        return f"{os.path.abspath(self.path)}|{self.size}|{self.mtime_ns}|{self.device}|{self.inode}"

    def __repr__(self) -> str:
        return f"<NVRTC at {self.path}>"


def _is_bare(path: str) -> bool:
    """True for a library name the dynamic linker searches for (``libnvrtc.so.13``), not a path."""
    return os.sep not in path and not (os.altsep and os.altsep in path)


def location_of(path: str) -> Location | None:
    """The :class:`Location` of the file at ``path``; None when it is not a file, or is a bare library name
    (``libnvrtc.so.13``): the dynamic linker searches its own directories for that, not the current one."""
    if _is_bare(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return Location.of_stat(path, st)


def _first_file(candidates: Iterable[str]) -> Location | None:
    """The first of ``candidates`` (in :func:`open_nvrtc`'s order) that is a file; None when a bare name comes
    first: which file the dynamic linker's search opens is known only by opening it, and a file ranked after
    that name is not the one that opens whenever the search finds it."""
    for path in candidates:
        if _is_bare(path):
            return None
        found = location_of(path)
        if found is not None:
            return found
    return None


def locate_preferring(driver_major: Callable[[], int | None]) -> Location | None:
    """:func:`locate`, preferring the CUDA major ``driver_major()`` gives -- asked only when the preference
    can change which file ranks first (library files of more than one major installed): the driver's version
    opens libcuda, which a cache hit with ``arch=`` given does not need.  None when no candidate is a file,
    or a bare name ranks before the first file (see :func:`locate`)."""
    if os.environ.get(ENV_LIBRARY):
        return locate()
    candidates = list(_candidates())
    if len({major_of(path) for path in candidates if not _is_bare(path)}) > 1:
        prefer = driver_major()
        if prefer is not None:
            candidates.sort(key=lambda path: major_of(path) != prefer)   # stable: as _candidates sorts them
    return _first_file(candidates)


def locate(prefer_major: int | None = None) -> Location | None:
    """The library :func:`open_nvrtc` would open first, when that is a file: None when no candidate is a
    file, or a bare name (the dynamic linker's search, which only opening resolves) ranks before the first
    file -- the driver's major puts its ``libnvrtc.so.12`` before a CUDA 13 wheel's file."""
    return _first_file(_candidates(prefer_major))


# --------------------------------------------------------------------------- the library

_DELETED = b" (deleted)"   # what /proc/self/maps appends to a file removed or replaced since it was mapped


def _mapping_of(ffi: Any, function: Any) -> tuple[bytes, bytes] | None:
    """(``start-end``, path) of the ``/proc/self/maps`` line whose file mapping holds ``function`` (a cffi
    function pointer; Linux); None elsewhere or when no mapping holds it."""
    try:
        address = int(ffi.cast("uintptr_t", function))
        with open("/proc/self/maps", "rb") as f:   # binary: no codec machinery, and paths stay as they are
            lines = f.read().splitlines()
    except (OSError, TypeError, ValueError):
        return None
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith(b"/"):
            start, _, end = fields[0].partition(b"-")
            if int(start, 16) <= address < int(end, 16):
                return fields[0], fields[5]
    return None


def _mapped_location(ffi: Any, function: Any) -> Location | None:
    """The :class:`Location` of the file the dynamic linker mapped ``function`` from.  A file replaced since
    (maps names it ``path (deleted)``) is stat'ed through ``/proc/self/map_files/<start>-<end>``, the mapped
    file itself: the path now names another build.  None when neither answers."""
    mapping = _mapping_of(ffi, function)
    if mapping is None:
        return None
    span, raw = mapping
    if not raw.endswith(_DELETED):
        return location_of(os.fsdecode(raw))
    try:
        st = os.stat(b"/proc/self/map_files/" + span)
    except OSError:   # no map_files (an old kernel without the capability, not Linux)
        return None
    return Location.of_stat(os.fsdecode(raw[:-len(_DELETED)]), st)


def _identity_of(path: str, function: Any, ffi: Any) -> str | None:
    """The :attr:`Location.identity` of the NVRTC opened from ``path``: of that file, or for a bare name (the
    dynamic linker's search) of the file ``function`` was mapped from.  None when neither is known: the
    compile cache is then not used with this library (a name and version would be shared by every build of
    that version: a stale hit, where no identity is only a miss)."""
    found = location_of(path)
    if found is None:
        found = _mapped_location(ffi, function)
    return found.identity if found is not None else None


class NvrtcLibrary:
    """An opened NVRTC: its C functions by name (cffi, declarations of ``headers/nvrtc.h``), its version and
    its :attr:`identity` -- the build of the file it was opened from, taken when it opened (see
    :class:`Location`), which the compile cache keys on; None when that file is unknown (then nothing it
    compiles is cached)."""

    def __init__(self, path: str, lib: Any, ffi: Any) -> None:
        self.path, self._lib, self.ffi = path, lib, ffi
        self._functions: dict[str, Any] = {}
        try:
            get_version = lib.nvrtcVersion
        except (AttributeError, ffi.error):
            raise NvrtcError(f"{path} opened, but it does not export nvrtcVersion: it is not NVRTC",
                             call="nvrtcVersion") from None
        major, minor = ffi.new("int *"), ffi.new("int *")
        rc = get_version(major, minor)
        if rc:
            raise NvrtcError(f"nvrtcVersion failed ({rc}) in {path}", call="nvrtcVersion", code=rc)
        self.version = CudaVersion(major[0], minor[0])
        self.identity = _identity_of(path, get_version, ffi)

    def has(self, name: str) -> bool:
        """True when this NVRTC exports ``name`` (a function of ``headers/nvrtc.h``)."""
        try:
            self.function(name)
        except NvrtcFunctionMissingError:
            return False
        return True

    def function(self, name: str) -> Any:
        """The C function ``name``; :class:`NvrtcFunctionMissingError` when this NVRTC lacks it."""
        fn = self._functions.get(name)
        if fn is None:
            if name not in DECLARED:
                raise NvrtcFunctionMissingError(f"{name} is not a function of nvrtc.h (NVRTC {', '.join(NVRTC_HEADERS)})",
                                                call=name)
            try:
                fn = self._functions[name] = getattr(self._lib, name)
            except (AttributeError, self.ffi.error):   # cffi's answer to a symbol the library lacks
                raise self._missing(name) from None
        return fn

    def _missing(self, name: str) -> NvrtcFunctionMissingError:
        first, last = DECLARED[name]
        loaded = f"the NVRTC loaded ({self.path}) is {self.version}"
        if CudaVersion.parse(first) > self.version:
            return NvrtcFunctionMissingError(
                f"{name} needs NVRTC {first} or newer; {loaded}", call=name,
                hint=f"install a newer NVRTC ({pip_install(first, '>=', upgrade=True)}), or point "
                     f"{ENV_LIBRARY} at one")
        if last != NVRTC_HEADERS[-1] and CudaVersion.parse(last) < self.version:
            return NvrtcFunctionMissingError(
                f"{name} was last declared by NVRTC {last}; {loaded}, which dropped it", call=name,
                hint="use what replaced it in this NVRTC")
        return NvrtcFunctionMissingError(f"{name} is not exported by {self.path} (NVRTC {self.version})",
                                         call=name, hint="the library may be damaged or not NVRTC; reinstall it")

    def error_name(self, code: int) -> str:
        """The nvrtcResult enumerator for ``code`` (from the declarations: needs no call)."""
        return str(self.ffi.typeof("nvrtcResult").elements.get(code, f"nvrtcResult({code})"))

    def check(self, rc: int, call: str, hint: str = "") -> None:
        """Raise :class:`NvrtcError` for a failed ``call``; its text from nvrtcGetErrorString."""
        if rc:
            raise NvrtcError(f"{call} failed: {self.error_name(rc)} ({rc}): {self.error_string(rc)}",
                             call=call, code=rc, name=self.error_name(rc), hint=hint)

    def error_string(self, code: int) -> str:
        try:
            text = self.function("nvrtcGetErrorString")(code)
            return self.ffi.string(text).decode(errors="replace") if text != self.ffi.NULL else ""
        except Exception:  # noqa: BLE001 - reporting an error must never hide it
            return ""

    def supported_archs(self) -> tuple[int, ...]:
        """The ``sm_XY`` numbers (XY) this NVRTC can compile for (nvrtcGetSupportedArchs)."""
        count = self.ffi.new("int *")
        self.check(self.function("nvrtcGetNumSupportedArchs")(count), "nvrtcGetNumSupportedArchs")
        archs = self.ffi.new("int[]", count[0])
        self.check(self.function("nvrtcGetSupportedArchs")(archs), "nvrtcGetSupportedArchs")
        return tuple(archs)

    def __repr__(self) -> str:
        return f"<cuproc.NvrtcLibrary {self.version} at {self.path}>"


_libraries: dict[str, NvrtcLibrary] = {}
_lock = _fork.lock()
_OPEN_FLAGS = 0 if sys.platform == "win32" else getattr(os, "RTLD_NOW", 0) | getattr(os, "RTLD_LOCAL", 0)


def open_nvrtc(path: str | os.PathLike[str] | None = None, *, prefer_major: int | None = None) -> NvrtcLibrary:
    """The NVRTC library at ``path``, else the first of :func:`candidate_paths` (``prefer_major``'s first)
    that opens (once per process and path).  :class:`NvrtcNotFoundError` lists every attempt when none does."""
    candidates = [os.fspath(path)] if path is not None else candidate_paths(prefer_major)
    attempts: list[tuple[str, str]] = []
    with _lock:
        for candidate in candidates:
            if candidate in _libraries:
                return _libraries[candidate]
            from ._nvrtc_cffi import ffi   # the out-of-line module: loads the type tables, parses nothing
            try:
                lib = ffi.dlopen(candidate, _OPEN_FLAGS)
            except OSError as exc:
                attempts.append((candidate, str(exc).removeprefix(f"cannot load library '{candidate}': ")))
                continue
            try:
                nvrtc = NvrtcLibrary(candidate, lib, ffi)
            except NvrtcError as exc:   # opened, but it is not NVRTC (no nvrtcVersion) or it failed
                attempts.append((candidate, str(exc)))
                continue
            _open_builtins(ffi, candidate, nvrtc.version)
            _libraries[candidate] = nvrtc
            return nvrtc
    raise NvrtcNotFoundError(attempts, prefer_major)


_builtins: list[Any] = []   # held for the process: NVRTC finds them by name when it compiles


def _open_builtins(ffi: Any, path: str, version: CudaVersion) -> None:
    """Open ``libnvrtc-builtins.so.<major>.<minor>`` from the directory of the NVRTC at ``path``, so that
    NVRTC's own dlopen by that name finds it loaded (glibc matches loaded libraries by their SONAME)."""
    if sys.platform == "win32" or os.sep not in path:
        return   # a bare name: the dynamic linker's own search found NVRTC and will find its builtins
    major, rest = divmod(int(version), 1000)
    builtins = os.path.join(os.path.dirname(os.path.realpath(path)), f"libnvrtc-builtins.so.{major}.{rest // 10}")
    if os.path.isfile(builtins):
        try:
            _builtins.append(ffi.dlopen(builtins, _OPEN_FLAGS))
        except OSError:
            pass   # NVRTC then says itself what it could not open, at compile


def is_nvrtc_available() -> bool:
    """True when an NVRTC opens; never raises."""
    try:
        open_nvrtc()
    except Exception:  # noqa: BLE001 - the question is yes/no
        return False
    return True


# --------------------------------------------------------------------------- one compilation

_OUTPUTS = {"ptx": ("nvrtcGetPTXSize", "nvrtcGetPTX"), "cubin": ("nvrtcGetCUBINSize", "nvrtcGetCUBIN"),
            "ltoir": ("nvrtcGetLTOIRSize", "nvrtcGetLTOIR")}
OUTPUT_KINDS = tuple(_OUTPUTS)


class RawOutput:
    """What one compilation gave: the code (``kind``), NVRTC's log, and each name expression's lowered name."""

    __slots__ = ("code", "kind", "log", "lowered")

    def __init__(self, code: bytes, kind: str, log: str, lowered: dict[str, str]) -> None:
        self.code, self.kind, self.log, self.lowered = code, kind, log, lowered


def compile_program(nvrtc: NvrtcLibrary, source: bytes, name: str, headers: Mapping[str, bytes],
                    options: Iterable[str], name_expressions: Iterable[str], kind: str) -> RawOutput:
    """Compile ``source`` with NVRTC and return ``kind`` ("ptx", "cubin" or "ltoir") of it.

    ``options`` go to nvrtcCompileProgram as given (the caller adds ``-arch``, and ``-dlto`` for LTO IR).
    A failed compilation raises :class:`CompileError` with the log; a kind this NVRTC cannot give (LTO IR
    before 12.0), :class:`NvrtcFunctionMissingError` -- before anything is compiled."""
    if kind not in _OUTPUTS:
        raise ValueError(f"no NVRTC output {kind!r}: expected one of {', '.join(OUTPUT_KINDS)}")
    ffi = nvrtc.ffi
    get_size, get_code = (nvrtc.function(n) for n in _OUTPUTS[kind])   # a missing one fails before compiling
    options = tuple(options)
    expressions = tuple(dict.fromkeys(name_expressions))
    keep = [ffi.new("char[]", v) for v in headers.values()] + [ffi.new("char[]", k.encode()) for k in headers]
    header_texts = ffi.new("char *[]", keep[:len(headers)]) if headers else ffi.NULL
    header_names = ffi.new("char *[]", keep[len(headers):]) if headers else ffi.NULL
    prog = ffi.new("nvrtcProgram *")
    nvrtc.check(nvrtc.function("nvrtcCreateProgram")(prog, source, name.encode(), len(headers), header_texts,
                                                     header_names), "nvrtcCreateProgram")
    try:
        for expr in expressions:
            nvrtc.check(nvrtc.function("nvrtcAddNameExpression")(prog[0], expr.encode()), "nvrtcAddNameExpression",
                        hint=f"name expression {expr!r}")
        c_options = [ffi.new("char[]", o.encode()) for o in options]
        rc = nvrtc.function("nvrtcCompileProgram")(prog[0], len(c_options), ffi.new("char *[]", c_options))
        log = _log(nvrtc, prog[0])
        if rc:
            raise CompileError(name, log, options, rc, nvrtc.error_name(rc))
        size = ffi.new("size_t *")
        nvrtc.check(get_size(prog[0], size), _OUTPUTS[kind][0])
        buf = ffi.new("char[]", size[0])
        nvrtc.check(get_code(prog[0], buf), _OUTPUTS[kind][1])
        code = ffi.unpack(buf, size[0])
        lowered: dict[str, str] = {}
        out = ffi.new("const char **")
        for expr in expressions:
            nvrtc.check(nvrtc.function("nvrtcGetLoweredName")(prog[0], expr.encode(), out), "nvrtcGetLoweredName",
                        hint=f"name expression {expr!r}: it must name a __global__ function or a __device__ "
                             f"variable of the program, e.g. 'axpy<float>' or '&axpy<float>'")
            lowered[expr] = ffi.string(out[0]).decode()
    finally:
        nvrtc.function("nvrtcDestroyProgram")(prog)
    if kind == "ptx":
        code = code.rstrip(b"\0")   # the size NVRTC reports counts the terminating NUL; loading adds it back
    return RawOutput(code, kind, log, lowered)


def _log(nvrtc: NvrtcLibrary, prog: Any) -> str:
    ffi = nvrtc.ffi
    size = ffi.new("size_t *")
    nvrtc.check(nvrtc.function("nvrtcGetProgramLogSize")(prog, size), "nvrtcGetProgramLogSize")
    buf = ffi.new("char[]", max(size[0], 1))
    nvrtc.check(nvrtc.function("nvrtcGetProgramLog")(prog, buf), "nvrtcGetProgramLog")
    return str(ffi.string(buf).decode(errors="replace"))


__all__ = ["CompileError", "ENV_LIBRARY", "Location", "NvrtcError", "NvrtcFunctionMissingError", "NvrtcLibrary",
           "NvrtcNotFoundError", "OUTPUT_KINDS", "RawOutput", "candidate_paths", "compile_program",
           "install_hint", "is_nvrtc_available", "locate", "location_of", "locate_preferring", "major_of", "open_nvrtc",
           "pip_install", "wheel_name"]
