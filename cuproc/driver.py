"""The drop-in C-named namespace: every driver function, enum, constant and type by its C name.

Two ways in::

    from cuproc import driver as cu      # the module: a default handle, configured by environment
    cu.cuInit(0)

    drv = cuproc.Driver("12.0")          # an explicit handle pinned to the CUDA 12.0 ABIs
    drv.cuInit(0)

Policy
------
* **C semantics.**  ``drv.cuMemAlloc(pdptr, n)`` calls the resolved function
  pointer: it returns the CUresult, and out-parameters come from ``ffi.new``.
  It is the cffi function pointer itself, or with the compiled fast path
  (:mod:`cuproc.fastpath`) a C trampoline bound to that same pointer, which takes
  the same arguments.  After the first access it is a plain attribute, so a call
  costs what a bare call through the pointer costs.  ``drv.checked.cuMemAlloc`` raises
  :class:`~cuproc.errors.CudaError` instead of returning a code.
* **Resolution** is lazy, cached per symbol, thread-safe.  Each symbol is asked
  for at its selected variant's *own* version (see :mod:`cuproc.registry`),
  never at the requested version R, and both the return code and the query
  status are read.
* **Newer-driver features.**  A symbol that does not exist at R but does on the
  installed driver resolves at the driver's version with its matching typedef.
* **Too old.**  When the driver lacks what a symbol needs, the attribute is a
  callable that raises :class:`~cuproc.errors.DriverTooOldError` (or
  :class:`~cuproc.errors.SymbolNotFoundError`) when called -- never at import or
  open.  ``has(name)`` asks without raising.
* **fork.**  Nothing touches the driver at import.  A child forked after CUDA
  was initialized gets :class:`~cuproc.errors.ForkedProcessError` on first use,
  not an obscure failure.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable, NamedTuple

from . import _fork, errors, fastpath
from ._ffi import ffi
from .loader import DIRECT_LOOKUP, GET_PROC_ADDRESS_V2, DriverLibrary, open_library
from .registry import NOT_YET_INTRODUCED, PER_THREAD_NEEDS_7_0, Registry, Selection, default_registry
from .version import CudaVersion

ENV_VERSION = "CUPROC_CUDA_VERSION"
ENV_PER_THREAD = "CUPROC_PER_THREAD_DEFAULT_STREAM"
_OFF = {"", "0", "false", "no", "off"}

# Resolution statuses (also dump_symbols' status column).
RESOLVED = "resolved"
SYMBOL_NOT_FOUND = "symbol_not_found"
VERSION_NOT_SUFFICIENT = "version_not_sufficient"
DRIVER_TOO_OLD = "driver_too_old"

_flags = ffi.typeof("CUdriverProcAddress_flags").relements
FLAG_LEGACY_STREAM = _flags["CU_GET_PROC_ADDRESS_LEGACY_STREAM"]
FLAG_PER_THREAD = _flags["CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM"]
_query = ffi.typeof("CUdriverProcAddressQueryResult").relements
_QUERY_STATUS = {
    _query["CU_GET_PROC_ADDRESS_SUCCESS"]: RESOLVED,
    _query["CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND"]: SYMBOL_NOT_FOUND,
    _query["CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT"]: VERSION_NOT_SUFFICIENT,
}
_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_FOUND = errors.result_code("CUDA_ERROR_NOT_FOUND")


class Resolution(NamedTuple):
    """What the driver answered for one symbol: status, the entry and typedef used, the pointer."""

    name: str
    status: str
    entry_point: str | None
    typedef: str | None
    query_version: CudaVersion | None
    newer_driver_feature: bool
    function: Any            # the cffi function pointer, or None
    message: str | None      # why not resolved


class Unavailable:
    """Stands in for a function the driver cannot provide; raises when called, is false in a bool test."""

    __slots__ = ("resolution", "_error")

    def __init__(self, resolution: Resolution, error: Callable[[], errors.CudaError]) -> None:
        self.resolution = resolution
        self._error = error

    def __call__(self, *args: object) -> int:
        raise self._error()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<unavailable {self.resolution.name}: {self.resolution.status}>"


# --------------------------------------------------------------------------- fork safety

_live_drivers: weakref.WeakSet[Driver] = weakref.WeakSet()
_module_cache: set[str] = set()


def _forget_after_fork() -> None:
    """In a child forked after cuInit: drop every cached pointer so each access re-checks."""
    if not _fork.FORKED[0]:
        return
    for drv in list(_live_drivers):
        drv._forget_resolutions()
    module = globals()
    for name in _module_cache:
        module.pop(name, None)
    _module_cache.clear()


_fork.on_fork_in_child(_forget_after_fork)


def forked_error(call: str) -> errors.ForkedProcessError:
    """The refusal every cuproc callable gives in a child forked after CUDA was initialized."""
    return errors.ForkedProcessError(errors.result_code("CUDA_ERROR_NOT_INITIALIZED"), call, hint=errors.FORK_HINT)


# --------------------------------------------------------------------------- names that are not functions

_constants: dict[str, Any] | None = None
_type_names: frozenset[str] | None = None


def constants() -> dict[str, Any]:
    """Every enumerator and #define of headers/, by C name (pointer-valued ones as cffi pointers)."""
    global _constants
    if _constants is None:
        from ._header_data import DEFINES, POINTER_CONSTANTS
        table: dict[str, Any] = {}
        for name in ffi.list_types()[0]:
            ctype = ffi.typeof(name)
            if ctype.kind == "enum":
                table.update(ctype.relements)
        table.update(DEFINES)
        for name, ctype_name in POINTER_CONSTANTS.items():
            table[name] = ffi.cast(ctype_name, DEFINES[name])
        _constants = table
    return _constants


def _is_type_name(name: str) -> bool:
    global _type_names
    if _type_names is None:
        _type_names = frozenset(ffi.list_types()[0])
    return name in _type_names


# --------------------------------------------------------------------------- the handle

def _env_version() -> CudaVersion | None:
    text = os.environ.get(ENV_VERSION, "").strip()
    if not text:
        return None
    try:
        return CudaVersion.parse(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{ENV_VERSION}={text!r}: {exc}") from None


def _env_per_thread() -> bool:
    return os.environ.get(ENV_PER_THREAD, "").strip().lower() not in _OFF


class Driver:
    """A handle on the driver at one requested CUDA version and stream flag.

    ``version``: the CUDA version whose ABIs you code against (``"12.4"``,
    ``12040``, a :class:`CudaVersion`); default ``CUPROC_CUDA_VERSION``, else
    min(driver version, newest version in the registry).
    ``per_thread_default_stream``: select the ``_ptds``/``_ptsz`` entries;
    default ``CUPROC_PER_THREAD_DEFAULT_STREAM``.
    ``library``: the driver library; default ``CUPROC_LIBCUDA``, else
    ``libcuda.so.1``.  Constructing a handle does no I/O; the first
    function access (or :meth:`open`) opens the driver.
    """

    def __init__(self, version: object = None, *, per_thread_default_stream: bool | None = None,
                 library: str | os.PathLike[str] | None = None, registry: Registry | None = None) -> None:
        self._requested = CudaVersion.parse(version) if version is not None else _env_version()
        self.per_thread_default_stream = (
            _env_per_thread() if per_thread_default_stream is None else bool(per_thread_default_stream))
        self._library_path = library
        self._registry = registry
        self._lib: DriverLibrary | None = None
        self._version: CudaVersion | None = None
        self._driver_version: CudaVersion | None = None
        self._lock = _fork.rlock()
        self._resolutions: dict[str, Resolution] = {}
        self._checked: Checked | None = None
        _live_drivers.add(self)

    # ---------------------------------------------------------------- opening
    def open(self) -> Driver:
        """Open the driver library and read its version (idempotent, thread-safe)."""
        if self._lib is None:
            with self._lock:
                if self._lib is None:
                    lib = open_library(self._library_path)
                    self._driver_version = CudaVersion.from_int(lib.version_int())
                    if self._requested is not None:
                        self._version = self._requested
                    else:
                        self._version = min(self._driver_version, self.registry.newest_version)
                    self._lib = lib
        return self

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = default_registry()
        return self._registry

    @property
    def version(self) -> CudaVersion:
        """The requested CUDA version R: the ABIs this handle selects."""
        return self.open()._version  # type: ignore[return-value]

    @property
    def driver_version(self) -> CudaVersion:
        """What ``cuDriverGetVersion`` reports: the newest CUDA version the driver supports."""
        return self.open()._driver_version  # type: ignore[return-value]

    @property
    def library(self) -> DriverLibrary:
        return self.open()._lib  # type: ignore[return-value]

    def describe(self) -> str:
        lib = self.library
        text = f"CUDA {self.driver_version} driver at {lib.path}; lookup via {lib.lookup}"
        if lib.fallbacks:
            text += " (fallback: " + "; ".join(lib.fallbacks) + ")"
        return text

    def __repr__(self) -> str:
        if self._lib is None:
            req = self._requested or "default"
            return f"<cuproc.Driver CUDA {req}, per-thread={self.per_thread_default_stream}, not opened>"
        return (f"<cuproc.Driver CUDA {self._version}, per-thread={self.per_thread_default_stream}, "
                f"driver {self._driver_version} at {self._lib.path}>")

    # ---------------------------------------------------------------- resolution
    def resolution(self, name: str, version: object = None) -> Resolution:
        """Resolve ``name`` (at R, or at ``version`` when given) and say how it went. Never raises for
        a known symbol; raises KeyError for a name the registry does not know."""
        if version is None and name in self._resolutions:
            return self._resolutions[name]
        self.open()
        with self._lock:
            if version is None and name in self._resolutions:
                return self._resolutions[name]
            requested = self._version if version is None else CudaVersion.parse(version)
            result = self._resolve(name, requested, explicit=version is not None)
            if version is None:
                self._resolutions[name] = result
            return result

    def _resolve(self, name: str, requested: CudaVersion, *, explicit: bool) -> Resolution:
        reg = self.registry
        if name not in reg:
            raise KeyError(f"cuproc's registry has no driver function {name!r}")
        per_thread = self.per_thread_default_stream
        sel = reg.select(name, requested, per_thread=per_thread)
        newer = False
        driver_version = self._driver_version
        assert driver_version is not None
        if sel.availability == NOT_YET_INTRODUCED and not explicit:
            at_driver = reg.select(name, min(driver_version, reg.newest_version), per_thread=per_thread)
            if at_driver.exists:
                sel, newer = at_driver, True
        if sel.availability == NOT_YET_INTRODUCED:
            return self._failed(sel, DRIVER_TOO_OLD if sel.symbol.introduced > driver_version else
                                VERSION_NOT_SUFFICIENT, newer)
        if sel.availability == PER_THREAD_NEEDS_7_0:
            return self._failed(sel, VERSION_NOT_SUFFICIENT, newer)
        if sel.variant.version > driver_version:
            return self._failed(sel, DRIVER_TOO_OLD, newer)
        status, pointer = self._query(sel)
        if status != RESOLVED:
            return self._failed(sel, status, newer)
        function = ffi.cast(_callable_type(sel.typedef), pointer)
        return Resolution(name, RESOLVED, sel.entry_point, sel.typedef, sel.query_version, newer, function, None)

    def _query(self, sel: Selection) -> tuple[str, Any]:
        """Ask the driver for exactly the selected entry; (status, void* or None)."""
        lib = self._lib
        assert lib is not None
        if lib.lookup == DIRECT_LOOKUP:
            address = lib.symbol_address(sel.entry_point)
            return (RESOLVED, ffi.cast("void *", address)) if address else (SYMBOL_NOT_FOUND, None)
        pfn = ffi.new("void **")
        flags = FLAG_PER_THREAD if self.per_thread_default_stream else FLAG_LEGACY_STREAM
        symbol = sel.symbol.name.encode()
        if lib.lookup == GET_PROC_ADDRESS_V2:
            status = ffi.new("CUdriverProcAddressQueryResult *")
            rc = lib.get_proc_address(symbol, pfn, int(sel.query_version), flags, status)
            if rc != _CUDA_SUCCESS:
                return SYMBOL_NOT_FOUND, None
            answer = _QUERY_STATUS.get(status[0], SYMBOL_NOT_FOUND)
        else:
            rc = lib.get_proc_address(symbol, pfn, int(sel.query_version), flags)
            answer = RESOLVED if rc == _CUDA_SUCCESS else SYMBOL_NOT_FOUND
        if answer == RESOLVED and pfn[0] == ffi.NULL:
            answer = SYMBOL_NOT_FOUND
        return answer, (pfn[0] if answer == RESOLVED else None)

    def _failed(self, sel: Selection, status: str, newer: bool) -> Resolution:
        name = sel.symbol.name
        drv = self._driver_version
        if status == DRIVER_TOO_OLD:
            needs = sel.variant.version if sel.variant is not None else sel.symbol.introduced
            message = (f"{name} needs a CUDA {needs} driver; this driver supports {drv}. "
                       f"Upgrade the NVIDIA driver")
            if sel.variant is not None and sel.requested > drv:
                message += (f", or request CUDA {drv} (Driver(version={str(drv)!r})) to get the "
                            f"ABI this driver has")
        elif status == VERSION_NOT_SUFFICIENT:
            message = (f"{name} has no per-thread default stream entry before CUDA 7.0 (requested "
                       f"{sel.requested})" if sel.availability == PER_THREAD_NEEDS_7_0 else
                       f"{name} does not exist at CUDA {sel.requested}; it was introduced in "
                       f"{sel.symbol.introduced}")
        else:
            message = (f"the CUDA {drv} driver at {self._lib.path} has no entry point for {name} "
                       f"(asked for {sel.entry_point} at CUDA {sel.query_version})")
        return Resolution(name, status, sel.entry_point, sel.typedef, sel.query_version, newer, None, message)

    def resolve(self, name: str, version: object = None) -> Callable[..., int]:
        """The raw function ``name`` at R, or at ``version`` for this one symbol; raises if unavailable."""
        res = self.resolution(name, version)
        if res.function is None:
            raise self._unavailable_error(res)
        return _public(name, res)

    def has(self, name: str, *, newer_driver_features: bool = True) -> bool:
        """Does the installed driver provide ``name`` to this handle?  Never raises.

        ``newer_driver_features=False`` asks whether ``name`` exists at the requested version
        itself: code pinned to an older version uses it to pick the API that version had
        (Library falls back to per-context modules below 12.0) instead of reaching ahead.
        """
        try:
            res = self.resolution(name)
        except Exception:  # noqa: BLE001 - a yes/no question
            return False
        return res.status == RESOLVED and (newer_driver_features or not res.newer_driver_feature)

    def preload(self) -> dict[str, int]:
        """Resolve every symbol now; returns the count of each status."""
        counts: dict[str, int] = {}
        for name in self.registry:
            getattr(self, name)
            status = self._resolutions[name].status
            counts[status] = counts.get(status, 0) + 1
        return counts

    def _unavailable_error(self, res: Resolution) -> errors.CudaError:
        cls = errors.DriverTooOldError if res.status == DRIVER_TOO_OLD else errors.SymbolNotFoundError
        return cls(_CUDA_ERROR_NOT_FOUND, res.name, name="CUDA_ERROR_NOT_FOUND", hint=res.message)

    def _forget_resolutions(self) -> None:
        """After fork: drop cached pointers so the next access re-checks the process state."""
        for name in list(self._resolutions):
            self.__dict__.pop(name, None)
        self._resolutions.clear()
        self._checked = None

    # ---------------------------------------------------------------- errors
    def error(self, code: int, call: str | None = None) -> errors.CudaError:
        """The exception for CUresult ``code`` from ``call``, named and described by the driver."""
        extra = errors.FORK_HINT if _fork.FORKED[0] else None
        describe = self._lib.describe_error if self._lib is not None else None
        return errors.make_error(code, call, describe, extra)

    def check(self, code: int, call: str | None = None) -> None:
        """Raise the matching CudaError when ``code`` is not CUDA_SUCCESS."""
        if code:
            raise self.error(code, call)

    @property
    def checked(self) -> Checked:
        """The same functions, raising :class:`~cuproc.errors.CudaError` instead of returning codes."""
        if self._checked is None:
            self._checked = Checked(self)
        return self._checked

    # ---------------------------------------------------------------- the C names
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self.registry:
            if _fork.FORKED[0]:
                raise forked_error(name)
            res = self.resolution(name)
            with self._lock:  # one published object per name, whichever thread gets here first
                value = self.__dict__.get(name)
                if value is None:
                    if res.function is None:
                        value = Unavailable(res, lambda res=res: self._unavailable_error(res))
                    else:
                        value = _public(name, res)
                    self.__dict__[name] = value  # later accesses are plain attribute loads
            return value
        table = constants()
        if name in table:
            return table[name]
        if _is_type_name(name):
            return ffi.typeof(name)
        raise AttributeError(f"no CUDA driver function, constant or type named {name!r}")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.registry) | set(constants()))


# By-value struct parameters that cffi's ABI mode cannot pass (they hold anonymous unions), with the
# integer type of the same size.  Small structs of integers travel in integer registers on x86-64
# SysV, AArch64 and Windows x64, so passing their little-endian image as that integer is the same call.
_BY_VALUE_AS_INTEGER = {"struct CUmemLocation_st": "uint64_t"}


def _callable_type(typedef: str) -> Any:
    """The typedef, or the same signature with unpassable by-value structs as integers."""
    ctype = ffi.typeof(typedef)
    if not any(a.cname in _BY_VALUE_AS_INTEGER for a in ctype.args):
        return ctype
    args = [_BY_VALUE_AS_INTEGER.get(a.cname, a.cname) for a in ctype.args]
    return ffi.typeof(f"{ctype.result.cname}(*)({', '.join(args)})")


def _public(name: str, res: Resolution) -> Callable[..., int]:
    """What ``driver.<name>`` is: the function at the resolved pointer -- its compiled trampoline
    when the fast path is on (:mod:`cuproc.fastpath`), else the cffi pointer itself -- except for
    cuInit (tracked for fork safety) and functions taking a by-value struct as an integer
    (converted here; those have no trampoline)."""
    function = res.function
    ctype = ffi.typeof(res.typedef)
    swapped = [i for i, a in enumerate(ctype.args) if a.cname in _BY_VALUE_AS_INTEGER]
    if not swapped:
        function = fastpath.trampoline(res.typedef, function) or function
    if name == "cuInit":
        return _tracking_cuinit(function)
    if not swapped:
        return function

    def call(*values: Any) -> int:
        converted = list(values)
        for i in swapped:
            converted[i] = struct_as_integer(ctype.args[i], values[i])
        return function(*converted)

    call.__name__ = call.__qualname__ = name
    return call


def struct_as_integer(ctype: Any, value: Any) -> int:
    """The little-endian integer image of a small by-value struct (a cdata struct or pointer to one)."""
    if ffi.typeof(value).kind == "pointer":
        value = value[0]
    box = ffi.new(ffi.getctype(ctype, "*"), value)
    return int.from_bytes(ffi.buffer(box), "little")


def _tracking_cuinit(function: Callable[[int], int]) -> Callable[[int], int]:
    """cuInit, noting success so a forked child can be told why CUDA fails there."""
    def cuInit(flags: int) -> int:  # noqa: N802 - the C name
        rc = function(flags)
        if rc == _CUDA_SUCCESS:
            _fork.note_initialized()
        return rc
    return cuInit


class Checked:
    """``driver.checked.cuX(...)``: calls ``cuX`` and raises CudaError on any result but CUDA_SUCCESS."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._driver, name)
        if name not in self._driver.registry:
            return value  # constants and types pass through
        with self._driver._lock:
            wrapper = self.__dict__.get(name)
            if wrapper is None:
                wrapper = _make_checked(value, name, self._driver.error)
                self.__dict__[name] = wrapper
        return wrapper

    def __dir__(self) -> list[str]:
        return dir(self._driver)


def _make_checked(function: Callable[..., int], name: str,
                  error: Callable[[int, str], errors.CudaError]) -> Callable[..., None]:
    def call(*args: Any, _forked: list[bool] = _fork.FORKED) -> None:
        if _forked[0]:   # a checked function captured before fork() refuses in the child
            raise forked_error(name)
        rc = function(*args)
        if rc:
            raise error(rc, name)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"{name}, raising cuproc.CudaError on failure (returns None)."
    return call


# --------------------------------------------------------------------------- the module as namespace

_default: Driver | None = None
_default_lock = _fork.lock()


def default_driver() -> Driver:
    """The handle behind ``cuproc.driver.cuX``: configured by CUPROC_* variables, opened on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Driver()
    return _default


def set_default_driver(driver: Driver | None) -> None:
    """Replace the handle behind the module namespace (None: a fresh one from the environment)."""
    global _default
    with _default_lock:
        _default = driver
        module = globals()
        for name in _module_cache:
            module.pop(name, None)
        _module_cache.clear()


def is_driver_available() -> bool:
    """True when a driver opens and answers; never raises."""
    from .loader import is_driver_available as available
    return available()


def __getattr__(name: str) -> Any:
    if name == "checked":
        value: Any = default_driver().checked
        globals()[name] = value
        _module_cache.add(name)
        return value
    if not name.startswith(("cu", "CU")):
        raise AttributeError(f"module 'cuproc.driver' has no attribute {name!r}")
    value = getattr(default_driver(), name)
    globals()[name] = value   # cache: the next access is a plain module attribute load
    _module_cache.add(name)
    return value
