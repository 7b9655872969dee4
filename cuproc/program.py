"""Kernels from source: :class:`Program` compiles CUDA C++ with NVRTC, :class:`ObjectCode` loads the result.

Policy
------
* **What is made.**  ``compile(target=None)`` makes a cubin for a real architecture (``sm_90``) and PTX
  for a virtual one (``compute_90``); ``target="ptx"``, ``"cubin"`` or ``"ltoir"`` (NVRTC 12.0+, adds
  ``-dlto``) asks for one.  A cubin needs no JIT at load, so it loads on a driver of the NVRTC's CUDA
  major even when NVRTC is the newer minor (13.5 on a 13.0 driver, whose JIT would refuse the newer PTX
  ISA: CUDA_ERROR_UNSUPPORTED_PTX_VERSION) -- CUDA's minor version compatibility.  It does not reach
  across majors: a cubin from NVRTC 13 is not promised to load on a CUDA 12 driver, and
  :meth:`ObjectCode.load_problem` says so before loading.  So when several NVRTCs are installed, the
  one of the driver's major is preferred (:mod:`cuproc.nvrtc`).  :attr:`ObjectCode.reason` says why
  the target was chosen.
* **Which architecture.**  ``arch=`` (``"sm_90"``, ``"compute_90"``, ``"sm_90a"``, ``90``, ``(9, 0)``,
  or ``-arch`` in the options); else the device of the current context (device 0 when none is current),
  asked through :class:`~cuproc.device.Device`; with no driver it must be given.  When the device is
  newer than anything NVRTC can compile for, the default becomes PTX for NVRTC's newest architecture,
  which the driver JIT-compiles for the device.
* **PTX that this driver cannot load is refused before loading.**  :meth:`ObjectCode.load` compares the
  PTX's ``.version`` with the newest ISA the driver accepts (:mod:`cuproc.ptx_isa`) and says what to do.
* **Errors.**  A compile error raises :class:`~cuproc.nvrtc.CompileError` with NVRTC's log; the log of a
  compilation that succeeded (its warnings) is :attr:`ObjectCode.log`.  Without NVRTC,
  :class:`~cuproc.nvrtc.NvrtcNotFoundError` says what to install.
* **Names.**  ``name_expressions`` (``"axpy<float>"``, ``"&table<4>"``) are lowered by NVRTC; the loaded
  module's ``get_function``/``get_global`` take them as written.
* **Cache.**  Every compilation goes through :mod:`cuproc.compile_cache` unless ``cache=False``: a hit
  returns the stored code without opening NVRTC.
* A :class:`Program` holds no NVRTC handle: each ``compile`` creates and destroys its own, so a Program
  can be compiled from several threads and needs no closing.
"""
from __future__ import annotations

import os
import re

from . import compile_cache
from . import nvrtc as _nvrtc
from .compile_cache import CompileCache
from .nvrtc import CompileError, NvrtcError, NvrtcNotFoundError
from ._includes import closure
from .ptx_isa import PtxIsa, driver_accepts, max_ptx_isa, ptx_isa_of
from .version import CudaVersion

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping
    from typing import Any

    from .compiled_module import CompiledLibrary, CompiledModule
    from .context import Context
    from .driver import Driver
    from .module import Function

TARGETS = ("ptx", "cubin", "ltoir")
_ARCH = re.compile(r"^(sm|compute)_(\d{2,3})([af]?)$")
_ARCH_OPTIONS = ("-arch", "--gpu-architecture")
_WARNING_LINE = re.compile(r"^[^\n]*: warning\b[^\n]*$", re.M)   # "k.cu(5): warning #177-D: ..."


# --------------------------------------------------------------------------- arguments

def normalize_arch(arch: str | int | tuple[int, int], what: str = "arch") -> str:
    """``"sm_90"`` for ``90``, ``(9, 0)``, ``"90"``, ``"9.0"`` or ``"sm_90"``; ``compute_XY`` and the
    ``a``/``f`` suffixes (``sm_90a``) as given.  ValueError naming ``what`` (the argument) for anything
    else, also for numbers no architecture has (``1000``, ``(12, 10)``): a compute capability is a major
    of 1 to 99 and a minor of 0 to 9."""
    text: str | None = None
    if isinstance(arch, tuple):
        if (len(arch) == 2 and all(isinstance(p, int) and not isinstance(p, bool) for p in arch)
                and 1 <= arch[0] <= 99 and 0 <= arch[1] <= 9):
            text = f"sm_{arch[0]}{arch[1]}"
    elif isinstance(arch, int) and not isinstance(arch, bool):
        text = f"sm_{arch}"
    elif isinstance(arch, str):
        text = arch.strip()
        major, dot, minor = text.partition(".")   # string tests, not regexes: compiling one costs a first call
        if not dot and text.isdecimal() and 2 <= len(text) <= 3:                                   # "90"
            text = f"sm_{text}"
        elif dot and major.isdecimal() and 1 <= len(major) <= 2 and minor.isdecimal() and len(minor) == 1:   # "9.0"
            text = f"sm_{major}{minor}"
    if text is None or not _ARCH.match(text):
        raise ValueError(f"{what}={arch!r} is not a GPU architecture (expected e.g. 'sm_90', 'compute_90', "
                         f"'sm_90a', 90 or (9, 0): a compute capability of major 1-99, minor 0-9)")
    return text


def _not_text(what: str, value: object, example: str) -> None:
    """TypeError when ``value`` -- an argument that takes several items -- is one str (or bytes or path),
    which iterating would split into characters."""
    if isinstance(value, (str, bytes, bytearray, os.PathLike)):
        raise TypeError(f"{what} takes a list of items, not one {type(value).__name__} ({value!r}), which would be "
                        f"read character by character: pass a list, e.g. [{example}]")


def _major(version: CudaVersion) -> int:
    return int(version) // 1000


def _flat_options(options: Iterable[Any], what: str = "options") -> list[str]:
    """The options as NVRTC takes them: strings, given separately or as lists/tuples of strings."""
    _not_text(what, options, "'-std=c++17', '-DN=4'")
    out: list[str] = []
    for opt in options:
        if isinstance(opt, (list, tuple)):
            out += _flat_options(opt, what)
        elif isinstance(opt, str):
            if "\0" in opt:
                raise ValueError(f"option {opt!r} contains a NUL character")
            out.append(opt)
        else:
            raise TypeError(f"{what}: NVRTC options are strings (e.g. '-std=c++17', '-DN=4'), not "
                            f"{type(opt).__name__}: {opt!r}")
    return out


def _take_arch(options: list[str]) -> tuple[list[str], str | None]:
    """(options without any -arch, the architecture it named)."""
    rest: list[str] = []
    found: str | None = None
    i = 0
    while i < len(options):
        opt = options[i]
        flag, sep, value = opt.partition("=")
        if flag in _ARCH_OPTIONS:
            if not sep:
                if i + 1 >= len(options):
                    raise ValueError(f"{opt} needs an architecture after it (or use arch=)")
                value = options[i + 1]
                i += 1
            found = value
        elif opt.startswith("-arch") and flag == opt and len(opt) > 5 and opt[5:].startswith(("sm_", "compute_")):
            found = opt[5:]   # -archsm_90, as nvcc also accepts
        else:
            rest.append(opt)
        i += 1
    return rest, found


def _as_bytes(what: str, value: str | bytes) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    elif not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} is CUDA C++ text (str or bytes), not {type(value).__name__}")
    data = bytes(value)
    if b"\0" in data:
        raise ValueError(f"{what} contains a NUL byte: NVRTC reads it as a C string and would stop there")
    return data


def _default_arch(driver: Driver | None, context: Context | None) -> str:
    """sm_XY of the given context's device, else the current context's, else device 0's."""
    from ._support import get_driver
    from .context import Context
    from .device import Device
    from .errors import CudaError, DriverNotFoundError
    try:
        if context is not None:
            device = Context.given(context, "nvrtcCompileProgram").device
        else:
            drv = get_driver(driver)
            current = Context.current(driver=drv)
            device = current.device if current is not None else Device(0, driver=drv)
        major, minor = device.compute_capability
    except DriverNotFoundError:
        raise ValueError("arch= is needed: no CUDA driver is present to ask for the device's architecture "
                         "(pass e.g. arch='sm_90', or arch='compute_90' for PTX)") from None
    except CudaError as exc:
        raise ValueError(f"arch= is needed: the device's architecture could not be read ({exc})") from exc
    return f"sm_{major}{minor}"


def _driver_version(driver: Driver | None, context: Context | None) -> CudaVersion | None:
    """The CUDA version of the driver the code will load on; None without a driver."""
    from .driver import default_driver
    from .errors import CudaError, DriverNotFoundError
    try:
        if context is not None:
            from .context import Context
            return Context.given(context, "nvrtcCompileProgram").driver.driver_version
        return (driver if driver is not None else default_driver()).driver_version
    except (DriverNotFoundError, CudaError):
        return None


def _located(path: str | os.PathLike[str] | None, prefer_major: Callable[[], int | None]) -> str | None:
    """The build identity of the NVRTC a compile would open -- the file at ``path``, else the one
    :func:`~cuproc.nvrtc.locate_preferring` finds -- by a ``stat``, without opening it; None when it is
    known by a bare name only (the dynamic linker's search), which only opening it resolves -- also when a
    bare name ranks before the first file: the file is then not the one that opens wherever the search
    finds that name."""
    location = _nvrtc.locate_preferring(prefer_major) if path is None else _nvrtc.location_of(os.fspath(path))
    return location.identity if location is not None else None


# --------------------------------------------------------------------------- planning

class _Plan:
    """What one compile will ask NVRTC for, and why."""

    __slots__ = ("arch", "kind", "reason")

    def __init__(self, arch: str, kind: str, reason: str) -> None:
        self.arch, self.kind, self.reason = arch, kind, reason


def _plan(arch: str, target: str | None, nvrtc_version: CudaVersion, driver: CudaVersion | None,
          arch_defaulted: bool, supported: tuple[int, ...] | None) -> _Plan:
    """The architecture and output for a request (see the module's policy)."""
    m = _ARCH.match(arch)
    if m is None:   # normalize_arch let it through: a bug here, not the caller's
        raise ValueError(f"arch={arch!r} is not a GPU architecture (expected e.g. 'sm_90' or 'compute_90')")
    virtual, number = m.group(1) == "compute", int(m.group(2))
    if supported is not None and number not in supported:
        usable = [a for a in supported if a <= number]
        if not (arch_defaulted and target in (None, "ptx") and usable):
            loads_on = driver if driver is not None else nvrtc_version   # the NVRTC of the driver's major
            raise ValueError(f"NVRTC {nvrtc_version} cannot compile for {arch}: it supports "
                             f"{', '.join(f'sm_{a}' for a in supported)}; install a newer NVRTC that supports it "
                             f"({_nvrtc.pip_install(_major(loads_on), upgrade=True)}) or pass another arch=")
        newest = max(usable)
        return _Plan(f"compute_{newest}", "ptx",
                     f"NVRTC {nvrtc_version} cannot compile for this device ({arch}): PTX for compute_{newest}, "
                     f"which the driver JIT-compiles for the device at load")
    if target == "cubin" and virtual:
        raise ValueError(f"a cubin needs a real architecture (sm_{number}); {arch} is virtual and gives PTX: "
                         f"pass arch='sm_{number}', or target='ptx'")
    if target is not None:
        return _Plan(arch, target, f"{target} asked for")
    if virtual:
        return _Plan(arch, "ptx", f"PTX for the virtual architecture {arch}")
    reason = f"cubin for {arch}: it loads with no driver JIT"
    if driver is not None and _major(nvrtc_version) > _major(driver):
        # no cubin helps: minor version compatibility stops at the major (ObjectCode.load_problem refuses it)
        reason += (f"; but NVRTC {nvrtc_version} is of a newer CUDA major than this CUDA {driver} driver, which "
                   f"is not promised to load its cubins and cannot JIT its PTX: compile with an NVRTC "
                   f"{_major(driver)}.x ({_nvrtc.pip_install(_major(driver))})")
    elif driver is not None:
        isa = max_ptx_isa(nvrtc_version)
        if isa is not None and driver_accepts(isa, driver) is False:
            reason += (f"; NVRTC {nvrtc_version} is newer than this CUDA {driver} driver, whose JIT accepts PTX "
                       f"up to ISA {max_ptx_isa(driver)}, so PTX from it (ISA {isa}) would not load")
    return _Plan(arch, "cubin", reason)


# --------------------------------------------------------------------------- results

class ObjectCode:
    """Compiled code: ``code`` (bytes) of ``kind`` ("ptx", "cubin" or "ltoir") for ``arch``, with NVRTC's
    ``log``, the ``lowered_names`` of the name expressions, and how it was made (``reason``, the NVRTC
    version, whether it came ``from_cache``; ``cache_note`` says why it was not cached, when it was not)."""

    def __init__(self, code: bytes, kind: str, arch: str, *, name: str, log: str, lowered_names: Mapping[str, str],
                 nvrtc_version: CudaVersion, options: tuple[str, ...], reason: str, cache_key: str | None = None,
                 from_cache: bool = False, cache_note: str = "") -> None:
        if kind not in TARGETS:
            raise ValueError(f"no code kind {kind!r}: expected one of {', '.join(TARGETS)}")
        self.code, self.kind, self.arch, self.name, self.log = code, kind, arch, name, log
        self.lowered_names = dict(lowered_names)
        self.nvrtc_version, self.options, self._reason = nvrtc_version, options, reason
        self.cache_key, self.from_cache, self.cache_note = cache_key, from_cache, cache_note
        self._reason_on: Callable[[], CudaVersion | None] | None = None   # a hit's driver, asked when read

    @property
    def reason(self) -> str:
        """Why this target was chosen.  For a cubin from the cache, chosen by default, it is said again for
        the driver this process loads on (asked when read, so that a hit opens no libcuda): the one that
        compiled it may have been another."""
        if self._reason_on is not None:
            loads_on, self._reason_on = self._reason_on(), None
            self._reason = _plan(self.arch, None, self.nvrtc_version, loads_on, arch_defaulted=False,
                                 supported=None).reason
        return self._reason

    @property
    def warnings(self) -> tuple[str, ...]:
        """The warning lines of the log (``file(line): warning #177-D: ...``)."""
        return tuple(m.group(0).strip() for m in _WARNING_LINE.finditer(self.log))

    @property
    def ptx_isa(self) -> PtxIsa | None:
        """The PTX ISA this PTX declares (``.version``); None for a cubin or LTO IR."""
        return ptx_isa_of(self.code) if self.kind == "ptx" else None

    def load_problem(self, driver: CudaVersion) -> str | None:
        """Why a CUDA ``driver`` could not load this code, with what to do; None when nothing is known
        against it (a cubin from an NVRTC of the driver's major or older; PTX of an ISA the driver accepts,
        or for a driver newer than cuproc knows).  A cubin from a newer major is refused: CUDA's minor
        version compatibility does not cross majors."""
        if self.kind == "ltoir":
            return ("LTO IR is not loadable by itself: link it with nvJitLink into a cubin, or compile with "
                    "target='cubin'")
        newer_major = _major(self.nvrtc_version) > _major(driver)
        if self.kind == "cubin" and newer_major:
            return (f"{self.name} is a cubin from NVRTC {self.nvrtc_version}, a newer CUDA major than this CUDA "
                    f"{driver} driver: a driver loads cubins of its own major and older (minor version "
                    f"compatibility stops at the major). Compile with an NVRTC {_major(driver)}.x "
                    f"({_nvrtc.pip_install(_major(driver))}, or set CUPROC_LIBNVRTC to one; cuproc prefers "
                    f"the driver's major when several are installed), or upgrade the driver")
        isa = self.ptx_isa
        if isa is not None and driver_accepts(isa, driver) is False:
            # a cubin is the way out only where the cubin rule above lets it load: not from a newer major
            cubin = ("" if newer_major else
                     "compile a cubin instead (target='cubin' and a real arch like 'sm_90', the default), ")
            return (f"{self.name}'s PTX declares ISA .version {isa} (from NVRTC {self.nvrtc_version}), and this "
                    f"CUDA {driver} driver's JIT accepts PTX up to ISA {max_ptx_isa(driver)}: {cubin}use an NVRTC "
                    f"no newer than the driver ({_nvrtc.pip_install(driver)}, or set CUPROC_LIBNVRTC to one), or "
                    f"upgrade the driver")
        return None

    def load(self, options: dict[str | int, Any] | None = None, *, context: Context | None = None,
             driver: Driver | None = None, eager: bool = False) -> CompiledModule:
        """Load into ``context`` (default: the current one) as a module (cuModuleLoadDataEx), checked first
        against the driver (:meth:`load_problem`).  Its ``get_function`` takes the name expressions.
        ``eager=True`` loads every function now, so that a JIT error comes here even under lazy loading."""
        from .compiled_module import CompiledModule
        return CompiledModule.from_code(self, options, context=context, driver=driver, eager=eager)

    def load_library(self, options: dict[str | int, Any] | None = None, *,
                     driver: Driver | None = None, eager: bool = False) -> CompiledLibrary:
        """Load as a context-independent library (cuLibraryLoadData), checked as :meth:`load` is;
        ``eager=True`` loads every kernel into the current context now."""
        from .compiled_module import CompiledLibrary
        return CompiledLibrary.from_code(self, options, driver=driver, eager=eager)

    def __repr__(self) -> str:
        where = ", from cache" if self.from_cache else ""
        return f"<cuproc.ObjectCode {self.kind} for {self.arch}, {len(self.code)} bytes, NVRTC {self.nvrtc_version}{where}>"


def _entry_meta(code: ObjectCode) -> dict[str, Any]:
    return {"kind": code.kind, "arch": code.arch, "log": code.log, "lowered": code.lowered_names,
            "nvrtc": str(code.nvrtc_version), "reason": code.reason}


# --------------------------------------------------------------------------- programs

class _Request:
    """One compile's arguments, checked and normalized: options (without -arch), the architecture (given,
    or the device's), the target and the name expressions."""

    __slots__ = ("options", "arch", "arch_defaulted", "target", "expressions")

    def __init__(self, options: Iterable[Any], arch: str | int | tuple[int, int] | None, target: str | None,
                 name_expressions: Iterable[str], include_paths: Iterable[str | os.PathLike[str]],
                 driver: Driver | None, context: Context | None) -> None:
        if target is not None and target not in TARGETS:
            raise ValueError(f"target={target!r}: expected None, {', '.join(repr(t) for t in TARGETS)}")
        _not_text("include_paths=", include_paths, "'include', '/opt/lib/include'")
        _not_text("name_expressions=", name_expressions, "'axpy<float>'")
        opts = _flat_options(options) + ["-I" + os.fspath(path) for path in include_paths]
        opts, arch_option = _take_arch(opts)
        if arch is not None:
            arch = normalize_arch(arch)
        if arch_option is not None:
            arch_option = normalize_arch(arch_option, "-arch")
        if arch is not None and arch_option is not None and arch != arch_option:
            raise ValueError(f"arch={arch!r} and the option -arch={arch_option} disagree: give one")
        requested = arch if arch is not None else arch_option
        if target == "ltoir" and "-dlto" not in opts and "--dlink-time-opt" not in opts:
            opts.append("-dlto")
        self.options, self.target = opts, target
        self.arch = requested if requested is not None else _default_arch(driver, context)
        self.arch_defaulted = requested is None
        self.expressions = tuple(dict.fromkeys(_flat_options(name_expressions, "name_expressions=")))



class Program:
    """CUDA C++ source with the headers it includes by name, ready to compile with NVRTC.

    ``headers`` maps an include name (as written in ``#include "name"`` or ``<name>``) to its text;
    headers on disk are found through ``include_paths=`` (``-I``) as nvcc would find them, and the
    directory of ``name`` for ``#include "..."``.
    """

    def __init__(self, source: str | bytes, name: str = "program.cu",
                 headers: Mapping[str, str | bytes] | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a program name is a non-empty str (a file name for messages), not {name!r}")
        self.source = _as_bytes("the program source", source)
        self.name = name
        self.headers: dict[str, bytes] = {}
        for key, text in (headers or {}).items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"header names are non-empty str, as written in #include, not {key!r}")
            self.headers[key] = _as_bytes(f"header {key!r}", text)

    def __repr__(self) -> str:
        return f"<cuproc.Program {self.name}, {len(self.source)} bytes, {len(self.headers)} headers>"

    def compile(self, *options: str | Iterable[str], arch: str | int | tuple[int, int] | None = None,
                target: str | None = None, name_expressions: Iterable[str] = (),
                include_paths: Iterable[str | os.PathLike[str]] = (),
                cache: compile_cache.CompileCache | str | os.PathLike[str] | bool | None = None,
                nvrtc: _nvrtc.NvrtcLibrary | str | os.PathLike[str] | None = None,
                context: Context | None = None, driver: Driver | None = None) -> ObjectCode:
        """Compile with NVRTC options (``"-std=c++17"``, ``"-DN=4"``, ``"--use_fast_math"``) for ``arch``.

        ``target``: None (a cubin for a real arch, PTX for a virtual one), "ptx", "cubin" or "ltoir".
        ``name_expressions`` are lowered (:attr:`ObjectCode.lowered_names`).  ``cache``: see
        :func:`cuproc.compile_cache.resolve`.  ``nvrtc``: an NVRTC library or its path (default: found
        as :mod:`cuproc.nvrtc` says).  ``context``/``driver``: whose device gives the default arch.
        Raises CompileError (with the log), NvrtcNotFoundError, ValueError for bad arguments."""
        request = _Request(options, arch, target, name_expressions, include_paths, driver, context)
        store, note, included = self._cache_for(cache, request.options)
        lib, nvrtc_path = (nvrtc, None) if isinstance(nvrtc, _nvrtc.NvrtcLibrary) else (None, nvrtc)
        asked: list[int | None] = []

        def prefer() -> int | None:
            """The driver's major, asked once and only where several NVRTC majors are installed: a hit with
            arch= given then opens no libcuda (loading needs it, compiling and the cache do not)."""
            if not asked:
                loads_on = _driver_version(driver, context)
                asked.append(_major(loads_on) if loads_on is not None else None)
            return asked[0]

        def key_for(identity: str) -> str:
            return compile_cache.cache_key(source=self.source, name=self.name, headers=self.headers,
                                           included=included, options=request.options, arch=request.arch,
                                           kind=target or "auto", name_expressions=request.expressions,
                                           nvrtc_identity=identity)

        def loads_on() -> CudaVersion | None:
            return _driver_version(driver, context)
        key: str | None = None
        identity: str | None = None   # the NVRTC build the key holds
        if store is not None:
            identity = lib.identity if lib is not None else _located(nvrtc_path, prefer)
            if identity is not None:   # a hit opens no NVRTC
                key = key_for(identity)
                hit = self._from_cache(store, key, request, loads_on)
                if hit is not None:
                    return hit
        if lib is None:
            lib = _nvrtc.open_nvrtc(nvrtc_path, prefer_major=prefer() if nvrtc_path is None else None)
        if store is not None and lib.identity != identity:
            # found by a bare name only, or the file opened is not the one located (replaced meanwhile, or
            # another candidate opened): the key is the build that compiles, never the one located; a
            # build not known (lib.identity None) is not cached at all
            key = key_for(lib.identity) if lib.identity is not None else None
            hit = self._from_cache(store, key, request, loads_on) if key is not None else None
            if hit is not None:
                return hit
        code = self._compile_now(lib, request, loads_on())
        if store is not None and key is None:
            note = f"not cached: the file of {lib.path} is not known (its build names the key)"
        code.cache_key, code.cache_note = key, note
        if store is not None and key is not None:
            try:
                store.put(key, compile_cache.CacheEntry(code.code, _entry_meta(code)))
            except OSError as exc:   # a full disk or a read-only cache must not fail the compile
                code.cache_note = f"not stored in {store.directory}: {exc}"
                compile_cache.warn_unwritable(store, exc)
        return code

    def _cache_for(self, cache: compile_cache.CompileCache | str | os.PathLike[str] | bool | None,
                   options: list[str]) -> tuple[compile_cache.CompileCache | None, str, list[tuple[str, str, str, str]]]:
        """(the cache to use or None, why none, the includes in visit order: see :class:`~cuproc._includes.Closure`)."""
        store = compile_cache.resolve(cache)
        if store is None:
            return None, "cache off", []
        distrust = store.distrust()   # another user's cache, or one others can write to: warned once
        if distrust is not None:
            return None, f"not cached: {distrust}", []
        found = closure(self.source, self.name, self.headers, options)
        if found.untracked:
            return None, f"not cached: {', '.join(found.untracked)} cannot be followed", []
        return store, "", found.edges

    def _from_cache(self, store: compile_cache.CompileCache, key: str, request: _Request,
                    loads_on: Callable[[], CudaVersion | None]) -> ObjectCode | None:
        entry = store.get(key)
        if entry is None:
            return None
        meta = entry.meta
        try:
            code = ObjectCode(entry.code, meta["kind"], meta["arch"], name=self.name, log=meta["log"],
                              lowered_names=meta["lowered"], nvrtc_version=CudaVersion.parse(meta["nvrtc"]),
                              options=tuple(request.options), reason=meta["reason"], cache_key=key, from_cache=True)
        except (KeyError, TypeError, ValueError):   # written by another cuproc: compile again, and replace it
            return None
        if request.target is None and code.kind == "cubin":
            code._reason_on = loads_on   # the default cubin's reason names the driver: say it for this one
        return code

    def _compile_now(self, lib: _nvrtc.NvrtcLibrary, request: _Request, loads_on: CudaVersion | None) -> ObjectCode:
        supported = lib.supported_archs() if lib.has("nvrtcGetSupportedArchs") else None
        plan = _plan(request.arch, request.target, lib.version, loads_on,
                     arch_defaulted=request.arch_defaulted, supported=supported)
        raw = _nvrtc.compile_program(lib, self.source, self.name, self.headers, [*request.options, f"-arch={plan.arch}"],
                                     request.expressions, plan.kind)
        if not raw.code:
            raise _nvrtc.NvrtcError(f"NVRTC gave no {plan.kind} for {self.name} with options {request.options}",
                                    hint="-dlto makes LTO IR only: use target='ltoir', or drop -dlto")
        return ObjectCode(raw.code, plan.kind, plan.arch, name=self.name, log=raw.log, lowered_names=raw.lowered,
                          nvrtc_version=lib.version, options=tuple(request.options), reason=plan.reason)


def compile_kernel(source: str | bytes, name: str, *options: str | Iterable[str],
                   headers: Mapping[str, str | bytes] | None = None,
                   arch: str | int | tuple[int, int] | None = None,
                   include_paths: Iterable[str | os.PathLike[str]] = (),
                   cache: compile_cache.CompileCache | str | os.PathLike[str] | bool | None = None,
                   context: Context | None = None, driver: Driver | None = None,
                   program_name: str = "kernel.cu") -> Function:
    """Source in, launchable function out: compile ``source`` (cached), load it into ``context`` (default:
    the current one) and return its kernel ``name`` -- an ``extern "C"`` name, or any C++ name
    expression (``"axpy<float>"``), which is lowered for you.

    The function holds its module; launch it one-shot (``fn.launch(grid, block, (buf, n))``) or
    prepared (``run = fn.prepare(["float*", "int"], grid, block)``), as any module function."""
    code = Program(source, name=program_name, headers=headers).compile(
        *options, arch=arch, include_paths=include_paths, name_expressions=(name,), cache=cache,
        context=context, driver=driver)
    return code.load(context=context, driver=driver).get_function(name)


# cuproc's top-level names from here (cuproc.__getattr__ serves this module's __all__): the program
# layer's own, and the errors and cache a caller of compile() handles
__all__ = ["CompileCache", "CompileError", "NvrtcError", "NvrtcNotFoundError", "ObjectCode", "Program", "compile_kernel"]
