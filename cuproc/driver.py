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
  the same arguments (a few are thin wrappers: cuInit, by-value struct arguments,
  :class:`AliasedName`).  The driver's own function pointer, on either path and for
  any of them (``drv.cuX``, ``cuproc.driver.cuX``, :meth:`Driver.resolve`,
  :meth:`Driver.declare`), is ``cuproc.fastpath.pointer(f)``: ``ffi.cast("void *", f)``
  of a trampoline would give the trampoline's address, or a TypeError.
  After the first access it is a plain attribute, so a call costs what a call of
  that object costs (on the fast path, about half a bare cffi call through the pointer).  ``drv.checked.cuMemAlloc`` raises
  :class:`~cuproc.errors.CudaError` instead of returning a code.
* **Resolution** is lazy, cached per symbol, thread-safe.  :meth:`Driver.preload` asks the
  driver for every symbol in one pass and keeps only its answers; each name's Resolution and
  published callable are made on first use, the same as without preload.  The module namespace
  binds every name when its first function is taken (:func:`preload`): a ``__getattr__`` left on
  the module would keep CPython from specializing ``cuproc.driver.cuX`` loads.  Each symbol is asked
  for at its selected variant's *own* version (see :mod:`cuproc.registry`),
  never at the requested version R, and both the return code and the query
  status are read.
* **Newer-driver features.**  A symbol that does not exist at R but does on the
  installed driver resolves at the driver's version with its matching typedef.
* **Too old.**  When the driver lacks what a symbol needs, the attribute is a
  callable that raises :class:`~cuproc.errors.DriverTooOldError` (or
  :class:`~cuproc.errors.SymbolNotFoundError`) when called -- never at import or
  open.  ``has(name)`` asks without raising.
* **Windows-only functions** (cuWGLGetDevice) are Unavailable elsewhere, with
  status ``not_on_this_platform``.
* **Header aliases.**  ``drv.cuGraphInstantiate`` is what cuGetProcAddress
  returns for that name (the 5-argument ABI), although ``cuda.h`` 12.0+ makes
  C source's ``cuGraphInstantiate`` mean ``cuGraphInstantiateWithFlags``.  For
  such names (few: :meth:`Registry.aliased_names`) the attribute is a thin
  :class:`AliasedName` whose repr and docstring say so and whose wrong-arity
  call names the alias.  It is not a cffi pointer: its ``.function`` is (for
  ``ffi.cast`` or an address), which ``fastpath.pointer()`` gives as well.
* **Functions cuproc's headers lack.**  :meth:`Driver.declare` resolves any
  name with a signature you give, as the programming guide's ``cuFoo``
  example does.
* **fork.**  Nothing touches the driver at import.  A child forked after CUDA
  was initialized gets :class:`~cuproc.errors.ForkedProcessError` on first use,
  not an obscure failure.
* **Types.**  The names come from ``__getattr__`` (or the namespace's binding) at run time; type checkers
  see instead the declarations that ``tools/build_stubs.py`` generates from
  ``headers/`` into ``_cnames.pyi`` (every function with its parameters, every
  constant and type), so a wrong argument count or a misspelt name is reported
  before the program runs.
* **Environment.**  ``CUPROC_CUDA_VERSION`` and ``CUPROC_PER_THREAD_DEFAULT_STREAM``
  are read by :func:`env_version` and :func:`env_per_thread` (the CLI uses the
  same two); a value they do not understand is a ValueError naming the variable.
"""
from __future__ import annotations

import os
import weakref

from . import _fork, errors, fastpath
from ._namedtuple import NamedTuple
from ._env import flag
from ._ffi import ffi as ffi  # re-exported: cuproc.driver.ffi is part of the C-named namespace
from .loader import DIRECT_LOOKUP, GET_PROC_ADDRESS_V2, DriverLibrary, open_library
from .registry import (AVAILABLE, FEATURES, NOT_ON_THIS_PLATFORM, NOT_YET_INTRODUCED, PER_THREAD_NEEDS_7_0, Entry,
                       Registry, Selection, default_registry, interned_version)
from .version import CudaVersion

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping
    from typing import Any

    # The C names as type checkers see them: generated from headers/ by tools/build_stubs.py.
    from ._cnames import *  # noqa: F403
    from ._cnames import CFunctions
    _DriverFunctions = CFunctions[int]      # Driver(...).cuX returns the CUresult
    _CheckedFunctions = CFunctions[None]    # Driver(...).checked.cuX raises instead
else:
    _DriverFunctions = _CheckedFunctions = object

ENV_VERSION = "CUPROC_CUDA_VERSION"
ENV_PER_THREAD = "CUPROC_PER_THREAD_DEFAULT_STREAM"

# Resolution statuses (also dump_symbols' status column).
RESOLVED = "resolved"
SYMBOL_NOT_FOUND = "symbol_not_found"
VERSION_NOT_SUFFICIENT = "version_not_sufficient"
DRIVER_TOO_OLD = "driver_too_old"
# NOT_ON_THIS_PLATFORM ("not_on_this_platform", from the registry): a Windows-only function elsewhere.

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
_VOID_PP = ffi.typeof("void **")                                     # parsed once, not per symbol
_QUERY_RESULT_P = ffi.typeof("CUdriverProcAddressQueryResult *")
_CUDA_ERROR_NOT_FOUND = errors.result_code("CUDA_ERROR_NOT_FOUND")
_new = tuple.__new__   # preload() makes 561 _Answer rows: skip the generated __new__'s argument binding


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


class _Answer(NamedTuple):
    """The driver's raw answer for one symbol (:meth:`Driver.preload` keeps these until first use)."""

    entry: Entry             # the registry's selection as plain values
    requested: CudaVersion   # the version it was selected at (the driver's for a newer-driver feature)
    newer_driver_feature: bool
    status: str
    pointer: Any             # when resolved, the void * (or its address, an int, from preload's C batch); else None


def _decoded(codes: Iterable[int], addresses: Iterable[int]) -> list[tuple[str, Any]]:
    """(status, address or None) per query of cuproc_ask_all, read as one ``ask_v2`` query reads its
    answer: the symbol status, and SYMBOL_NOT_FOUND for a failed call (code -1), an unknown status, or
    a success with a NULL pointer."""
    out = []
    for code, address in zip(codes, addresses):
        status = _QUERY_STATUS.get(code, SYMBOL_NOT_FOUND)
        out.append((RESOLVED, address) if status == RESOLVED and address else
                   (SYMBOL_NOT_FOUND if status == RESOLVED else status, None))
    return out


class Unavailable:
    """Stands in for a function the driver cannot provide; raises when called, is false in a bool test.

    Its :class:`Resolution` (the message saying why) is made when first asked for: the module
    namespace binds every name at once, and building the messages of the ~80 a driver lacks
    would cost more than binding the rest."""

    __slots__ = ("_driver", "name", "status", "_resolution")

    def __init__(self, driver: Driver, name: str, status: str, resolution: Resolution | None = None) -> None:
        self._driver = driver
        self.name = name
        self.status = status
        self._resolution = resolution

    @property
    def resolution(self) -> Resolution:
        """What the driver answered for this name (:meth:`Driver.resolution`)."""
        res = self._resolution
        if res is None:
            if _fork.FORKED[0]:   # the answer is gone with the fork; asking again would touch the driver
                raise forked_error(self.name)
            res = self._resolution = self._driver.resolution(self.name)
        return res

    def __call__(self, *args: object) -> int:
        if _fork.FORKED[0]:
            raise forked_error(self.name)
        raise self._driver.unavailable_error(self.resolution)

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<unavailable {self.name}: {self.status}>"


# --------------------------------------------------------------------------- fork safety

_live_drivers: weakref.WeakSet[Driver] = weakref.WeakSet()
_module_cache: set[str] = set()


def _forget_after_fork() -> None:
    """In a child forked after cuInit: drop every cached pointer so each access re-checks."""
    if not _fork.FORKED[0]:
        return
    for drv in list(_live_drivers):
        drv._forget_resolutions()
    _unbind_module_names()


_fork.on_fork_in_child(_forget_after_fork)


def forked_error(call: str) -> errors.ForkedProcessError:
    """The refusal cuproc's objects, checked calls and lazily resolved names give in a child forked after
    CUDA was initialized.  A raw C function taken before the fork (``drv.cuX`` or ``cuproc.driver.cuX``
    held in a variable) is the driver's own function and is not guarded (see the README's fork note)."""
    return errors.ForkedProcessError(errors.result_code("CUDA_ERROR_NOT_INITIALIZED"), call, hint=errors.FORK_HINT)


# --------------------------------------------------------------------------- names that are not functions

_constants: dict[str, Any] | None = None
_type_names: frozenset[str] | None = None


def constants() -> dict[str, Any]:
    """Every enumerator and #define of headers/, by C name (pointer-valued ones as cffi pointers)."""
    global _constants
    if _constants is None:
        from ._header_data import DEFINES, POINTER_CONSTANTS
        from ._header_enums import ENUMERATORS   # generated: asking the ffi for them realized every typedef
        table: dict[str, Any] = dict(ENUMERATORS)
        table.update(DEFINES)
        for name, ctype_name in POINTER_CONSTANTS.items():
            table[name] = ffi.cast(ctype_name, DEFINES[name])
        _constants = table
    return _constants


def _names_of_types() -> frozenset[str]:
    """Every typedef name of headers/ (the C type names the namespace answers)."""
    global _type_names
    if _type_names is None:
        _type_names = frozenset(ffi.list_types()[0])
    return _type_names


def _is_type_name(name: str) -> bool:
    return name in _names_of_types()


# --------------------------------------------------------------------------- the handle

def env_version() -> CudaVersion | None:
    """The requested version from CUPROC_CUDA_VERSION (None when unset or empty).

    Raises ValueError naming the variable when it is set to something that is not a CUDA
    version.  The library and ``cuproc-dump-symbols`` both read it here.
    """
    text = os.environ.get(ENV_VERSION, "").strip()
    if not text:
        return None
    try:
        return CudaVersion.parse(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{ENV_VERSION}={text!r}: {exc}; set it to a CUDA version such as 12.4 or 12040, "
                         f"or unset it") from None


def env_per_thread() -> bool:
    """The stream flag from CUPROC_PER_THREAD_DEFAULT_STREAM: 1/true/yes/on, or 0/false/no/off/empty.

    Raises ValueError naming the variable for any other value, so that a typo does not silently
    select the legacy stream.  The library and ``cuproc-dump-symbols`` both read it here.
    """
    return flag(ENV_PER_THREAD, "per-thread default stream", "legacy default stream")


class Driver(_DriverFunctions):
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
        self._requested = CudaVersion.parse(version) if version is not None else env_version()
        self.per_thread_default_stream = (
            env_per_thread() if per_thread_default_stream is None else bool(per_thread_default_stream))
        self._library_path = library
        self._registry = registry
        self._lib: DriverLibrary | None = None
        self._version: CudaVersion | None = None
        self._driver_version: CudaVersion | None = None
        self._driver_int = 0                          # the same, as the driver's integer (compared per symbol)
        self._lock = _fork.rlock()
        self._resolutions: dict[str, Resolution] = {}
        self._answers: dict[str, _Answer] = {}        # preload()'s raw answers, made Resolutions on first use
        self._asked: dict[str, Any] = {}              # preload()'s bare answers at R (see _preloaded)
        self._asked_table: Mapping[str, Entry] = {}   # the registry table preload() walked: their entries
        self._out: tuple[Any, Any] | None = None      # cuGetProcAddress's out-parameters, reused under the lock
        self._declared: dict[str, Resolution] = {}    # declare()d names the registry lacks
        self._checked: Checked | None = None
        self._initialized = False                     # cuInit(0) succeeded through this handle (initialize())
        _live_drivers.add(self)

    # ---------------------------------------------------------------- opening
    def open(self) -> Driver:
        """Open the driver library and read its version (idempotent, thread-safe)."""
        if self._lib is None:
            with self._lock:
                if self._lib is None:
                    lib = open_library(self._library_path)
                    self._driver_int = lib.version_int()
                    self._driver_version = CudaVersion.from_int(self._driver_int)
                    if self._requested is not None:
                        self._version = self._requested
                    else:
                        self._version = min(self._driver_version, self.registry.newest_version)
                    self._lib = lib
        return self

    @property
    def initialized(self) -> bool:
        """True once :meth:`initialize` (cuInit(0)) succeeded through this handle."""
        return self._initialized

    def initialize(self) -> Driver:
        """cuInit(0) through this handle, once (thread-safe); raises its CudaError, and tries again next time.

        The object layer calls it for every handle it uses (``_support.get_driver``).  The memo is this
        handle's own, so it lives and dies with the handle: a memo kept elsewhere by ``id(handle)`` let a new
        handle (on another library) that Python placed at a dropped one's address skip cuInit, and grew with
        every handle ever made."""
        if not self._initialized:
            with self._lock:
                if not self._initialized:
                    self.checked.cuInit(0)
                    self._initialized = True
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
        a known symbol or a name :meth:`declare` resolved; raises KeyError for any other name."""
        declared = self._declared.get(name)
        if declared is not None and (version is None or CudaVersion.parse(version) == declared.query_version):
            return declared
        if version is None and name in self._resolutions:
            return self._resolutions[name]
        self.open()
        with self._lock:
            if version is None:
                if name in self._resolutions:
                    return self._resolutions[name]
                answer = self._preloaded(name)
                if answer is not None:   # preload() asked the driver already
                    result = self._resolutions[name] = self._resolution_of(name, answer)
                    return result
            requested = self._version if version is None else CudaVersion.parse(version)
            result = self._resolve(name, requested, explicit=version is not None)
            if version is None:
                self._resolutions[name] = result
            return result

    def _resolve(self, name: str, requested: CudaVersion, *, explicit: bool) -> Resolution:
        reg = self.registry
        if name not in reg:
            raise KeyError(f"cuproc's registry has no driver function {name!r}")
        entry = reg.entry(name, requested, per_thread=self.per_thread_default_stream)
        fallback = None if explicit else self._newer_driver_version(requested)
        return self._resolution_of(name, self._answer(name, entry, requested, fallback))

    def _newer_driver_version(self, requested: CudaVersion) -> CudaVersion | None:
        """Where a symbol not yet introduced at ``requested`` is looked up instead, as a newer-driver
        feature: the driver's version (at most the newest the registry knows), when above ``requested``;
        else None (then nothing is selected there either: no variant is <= ``requested``)."""
        at = min(self.driver_version, self.registry.newest_version)
        return at if at > requested else None

    def _answer(self, name: str, entry: Entry, requested: CudaVersion, fallback: CudaVersion | None,
                ask: Callable[[str, str, int], tuple[str, Any]] | None = None,
                per_thread: bool | None = None) -> _Answer:
        """What the driver says for ``name`` selected as ``entry`` at ``requested``: the decisions and
        the one cuGetProcAddress query, building no Python objects beyond the answer tuple
        (:meth:`_resolution_of` turns one into a Resolution when it is asked for).  ``fallback``: where a
        symbol not yet introduced at ``requested`` is selected again (:meth:`_newer_driver_version`; None:
        nowhere, as for an explicitly requested version).  Called with the lock held; ``ask`` is
        :meth:`_asker`'s query when the caller made it once for many names, and ``per_thread`` the stream
        choice that caller read once (None: this handle's now)."""
        newer = False
        driver = self._driver_int
        if entry.availability == NOT_YET_INTRODUCED and fallback is not None:
            at_driver = self.registry.entry(name, fallback, per_thread=self.per_thread_default_stream
                                            if per_thread is None else per_thread)
            if at_driver.availability == AVAILABLE:
                entry, requested, newer = at_driver, fallback, True
        availability = entry.availability
        if availability == AVAILABLE:
            if entry.abi_version > driver:  # type: ignore[operator]
                return _new(_Answer, (entry, requested, newer, DRIVER_TOO_OLD, None))
            if ask is None:
                ask = self._asker()
            status, pointer = ask(name, entry.entry_point, entry.query_version)  # type: ignore[arg-type]
            return _new(_Answer, (entry, requested, newer, status, pointer))
        if availability == NOT_YET_INTRODUCED:
            status = DRIVER_TOO_OLD if entry.introduced > driver else VERSION_NOT_SUFFICIENT
        elif availability == PER_THREAD_NEEDS_7_0:
            status = VERSION_NOT_SUFFICIENT
        else:
            status = NOT_ON_THIS_PLATFORM
        return _new(_Answer, (entry, requested, newer, status, None))

    def _preloaded(self, name: str) -> _Answer | None:
        """preload()'s answer for ``name``, taken out (None when it has none).  Called with the lock held.

        Where preload() asked the driver for the entry selected at R (nearly every name), it kept only
        what the driver said, in ``_asked``: the pointer when resolved (a void *, or its address as an int from
        the fast path's batch), else the status.  The rest of the
        answer is known: the entry is the registry table's row preload() walked, at R, no newer-driver
        feature.  Every other name's answer is a whole :class:`_Answer` in ``_answers``."""
        answer = self._answers.pop(name, None)
        if answer is None:
            got = self._asked.pop(name, None)
            if got is not None:
                entry, version = self._asked_table[name], self._version
                answer = _new(_Answer, (entry, version, False, got, None) if isinstance(got, str) else
                              (entry, version, False, RESOLVED, got))
        return answer

    def _preloaded_status(self, name: str) -> str:
        """The status of a name preload() has an answer for, or which has been resolved."""
        got = self._asked.get(name)
        if got is not None:
            return got if isinstance(got, str) else RESOLVED
        res = self._resolutions.get(name)
        return res.status if res is not None else self._answers[name].status

    def _resolution_of(self, name: str, answer: _Answer) -> Resolution:
        """The :class:`Resolution` an answer stands for: the typed pointer, or the failure's message."""
        entry, requested, newer, status, pointer = answer
        if status != RESOLVED:
            sel = self.registry.select(name, requested, per_thread=self.per_thread_default_stream)
            return self._failed(sel, status, newer)
        function = ffi.cast(_callable_type(entry.typedef), pointer)  # type: ignore[arg-type]
        return _new(Resolution, (name, RESOLVED, entry.entry_point, entry.typedef,
                                 interned_version(entry.query_version), newer, function, None))  # type: ignore[arg-type]

    def _ask(self, name: str, entry: str, version: CudaVersion) -> tuple[str, Any]:
        """cuGetProcAddress(name, version) under this handle's flag (dlsym of ``entry`` on drivers
        without it); (status, void* or None).  Called with the lock held."""
        return self._asker()(name, entry, int(version))

    def _asker(self, flags: int | None = None) -> Callable[[str, str, int], tuple[str, Any]]:
        """The query :meth:`_ask` makes, as a function bound to this handle's library, stream flag
        (``flags``, else this handle's now) and out-parameters (allocated once, reused: call it with the
        lock held).  preload() calls it for many names in a row, so it looks nothing up per call."""
        lib = self._lib
        assert lib is not None
        if lib.lookup == DIRECT_LOOKUP:
            symbol_address = lib.symbol_address

            def ask_dlsym(name: str, entry: str, version: int) -> tuple[str, Any]:
                address = symbol_address(entry)
                return (RESOLVED, ffi.cast("void *", address)) if address else (SYMBOL_NOT_FOUND, None)
            return ask_dlsym
        if self._out is None:
            self._out = (ffi.new(_VOID_PP), ffi.new(_QUERY_RESULT_P))
        pfn, out_status = self._out
        if flags is None:
            flags = self._stream_flag()
        get_proc_address, null, statuses = lib.get_proc_address, ffi.NULL, _QUERY_STATUS
        if lib.lookup == GET_PROC_ADDRESS_V2:
            def ask_v2(name: str, entry: str, version: int) -> tuple[str, Any]:
                if get_proc_address(name.encode(), pfn, version, flags, out_status) != _CUDA_SUCCESS:
                    return SYMBOL_NOT_FOUND, None
                answer = statuses.get(out_status[0], SYMBOL_NOT_FOUND)
                if answer != RESOLVED:
                    return answer, None
                pointer = pfn[0]
                return (RESOLVED, pointer) if pointer != null else (SYMBOL_NOT_FOUND, None)
            return ask_v2

        def ask_v1(name: str, entry: str, version: int) -> tuple[str, Any]:
            if get_proc_address(name.encode(), pfn, version, flags) != _CUDA_SUCCESS:
                return SYMBOL_NOT_FOUND, None
            pointer = pfn[0]
            return (RESOLVED, pointer) if pointer != null else (SYMBOL_NOT_FOUND, None)
        return ask_v1

    def _ask_all(self, queries: list[tuple[str, str, int]], ask: Callable[[str, str, int], tuple[str, Any]],
                 flags: int) -> list[tuple[str, Any]]:
        """``[ask(name, entry, version) for each query]`` (``ask`` made with ``flags``): on the fast path
        through cuGetProcAddress in one C call (src/fastpath/fastpath_resolve.c; from Python each query costs
        ~1.2 us, the driver's lookup under 0.1 us), with the same statuses and the pointers as integers.
        Called with the lock held."""
        lib = self._lib
        batch = fastpath.ask_all()
        assert lib is not None
        if batch is None or lib.lookup == DIRECT_LOOKUP or not queries:
            return [ask(name, entry, version) for name, entry, version in queries]
        n = len(queries)
        names = "\0".join([name for name, _, _ in queries]).encode() + b"\0"
        pointers, codes = ffi.new("void *[]", n), ffi.new("int[]", n)
        done = batch(fastpath.pointer(lib.get_proc_address), lib.lookup == GET_PROC_ADDRESS_V2, names, len(names),
                     ffi.new("int[]", [version for _, _, version in queries]), flags, n, pointers, codes)
        if done != n:   # names are C identifiers: a NUL inside one would be a cuproc bug
            raise RuntimeError(f"cuproc_ask_all asked {done} of {n} names (a cuproc bug)")
        return _decoded(ffi.unpack(codes, n), ffi.unpack(ffi.cast("uintptr_t *", pointers), n))

    def _stream_flag(self, per_thread: bool | None = None) -> int:
        """The cuGetProcAddress flag of a default-stream choice (None: this handle's now)."""
        if per_thread is None:
            per_thread = self.per_thread_default_stream
        return FLAG_PER_THREAD if per_thread else FLAG_LEGACY_STREAM

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
        elif status == NOT_ON_THIS_PLATFORM:
            message = (f"{name} is not on this platform: it is a Windows-only function ({sel.symbol.header} "
                       f"declares it for _WIN32 only), which no driver here has")
        else:
            message = (f"the CUDA {drv} driver at {self._lib.path} has no entry point for {name} "
                       f"(asked for {sel.entry_point} at CUDA {sel.query_version})")
        return Resolution(name, status, sel.entry_point, sel.typedef, sel.query_version, newer, None, message)

    def resolve(self, name: str, version: object = None) -> Callable[..., int]:
        """The raw function ``name`` at R, or at ``version`` for this one symbol; raises if unavailable.

        It returns the CUresult, as ``drv.<name>`` does, and is what ``drv.<name>`` is: the cffi function
        pointer on the pure path, a C trampoline calling it on the compiled fast path, a thin wrapper for a
        few names (see the module docstring).  ``cuproc.fastpath.pointer(f)`` is the driver's own pointer
        on either path (:attr:`Resolution.function` of :meth:`resolution` is the same pointer)."""
        res = self.resolution(name, version)
        if res.function is None:
            raise self.unavailable_error(res)
        return self._with_alias(name, res, _public(name, res), self._version if version is None else version)

    def _with_alias(self, name: str, res: Resolution, function: Callable[..., int],
                    version: object) -> Callable[..., int]:
        """``function``, or an :class:`AliasedName` around it when C source means another function by
        ``name`` at ``version`` (only the few names a header #defines: the rest stay bare pointers)."""
        if name not in self.registry.aliased_names:
            return function
        alias = self.registry.header_alias(name, version)
        return function if alias is None else AliasedName(function, res, alias, CudaVersion.parse(version))

    def declare(self, name: str, signature: Any, version: object = None) -> Callable[..., int]:
        """Resolve ``name`` with a signature you supply: the programming guide's ``cuFoo`` example,
        for a function that a driver newer than cuproc's headers has.

        ``signature``: C text (``"CUresult (*)(CUdevice *, int)"``, or a typedef statement as the
        typedef headers write it, ``"typedef CUresult (CUDAAPI *PFN_cuFoo_v12000)(int x);"``) or
        a cffi type; it must return CUresult.  ``version``: the CUDA version to ask
        ``cuGetProcAddress`` at (default: the driver's own).  The query uses this handle's
        stream flag.  Returns the function as ``drv.<name>`` is, returning CUresult: for a name the
        registry lacks, the cffi pointer (or, for a signature with a by-value struct cffi cannot pass
        (CUmemLocation), the same small converting wrapper registry functions get); for a name it
        knows, what :meth:`resolve` gives (a C trampoline calling the pointer on the compiled fast
        path).  ``cuproc.fastpath.pointer(f)`` is the driver's own pointer in every case, on either
        path.  A name the registry lacks is then
        also ``drv.<name>`` and ``drv.checked.<name>``, known to :meth:`has` and :meth:`resolution`;
        declaring it again replaces all of them (the module namespace's too).

        A name the registry knows resolves as the registry does, and only when your signature
        agrees with the one it selects at ``version`` (else TypeError showing both).  Raises
        DriverTooOldError when ``version`` is above the driver's, SymbolNotFoundError when the
        driver has no such function at ``version``.
        """
        if not _is_driver_name(name):
            raise ValueError(f"declare({name!r}): not a driver function name (cu followed by letters, digits, _)")
        if name.startswith("cuda"):
            raise ValueError(f"declare({name!r}): a CUDA runtime API name (libcudart); declare() resolves driver "
                             f"API functions (cuXxx) through cuGetProcAddress, which has no runtime functions")
        if _fork.FORKED[0]:
            raise forked_error(name)
        ctype = _declared_type(name, signature)
        self.open()
        driver_version = self._driver_version
        assert driver_version is not None
        at = driver_version if version is None else CudaVersion.parse(version)
        if name in self.registry:
            sel = self.registry.select(name, at, per_thread=self.per_thread_default_stream)
            if sel.exists and ffi.typeof(sel.typedef) is not ctype:
                raise TypeError(f"declare({name!r}): your signature {ctype.cname} disagrees with the "
                                f"registry's {sel.typedef} at CUDA {at}: {ffi.typeof(sel.typedef).cname}. "
                                f"Use drv.{name}, or declare the signature the driver has")
            return self.resolve(name, at)
        res = Resolution(name, RESOLVED, None, ctype.cname, at, False, None, None)
        if at > driver_version:
            res = res._replace(status=DRIVER_TOO_OLD, message=(
                f"{name} was declared at CUDA {at}; this driver supports {driver_version}. Upgrade the "
                f"NVIDIA driver, or declare it at CUDA {driver_version} or lower"))
        else:
            with self._lock:
                status, pointer = self._ask(name, name, at)
            if status == RESOLVED:
                res = res._replace(entry_point=name, function=ffi.cast(_callable_type(ctype.cname), pointer))
            else:
                why = ("exists in this driver only from a newer CUDA version: declare it at a higher one "
                       f"(at most {driver_version})" if status == VERSION_NOT_SUFFICIENT else
                       "is not a function this driver has (check the spelling and the driver version)")
                res = res._replace(status=status, message=(
                    f"the CUDA {driver_version} driver at {self._lib.path} answered {status} for {name} at "
                    f"CUDA {at}: it {why}"))
        if res.function is None:
            raise self.unavailable_error(res)
        public = _public(name, res)
        with self._lock:   # __dict__ first: a reader that sees the name in _declared finds it there
            self.__dict__[name] = public
            self._declared[name] = res
            if self._checked is not None:
                self._checked.__dict__.pop(name, None)
        _forget_module_name(self, name)
        return public

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

    def has_feature(self, feature: str) -> bool:
        """Does this handle have ``feature`` (cuproc.registry.FEATURES: what a function gained at a CUDA
        version without a new ABI) at its requested version, on this driver?  A feature newer than the
        requested version is not taken, as a newer-driver function is not by ``has(...,
        newer_driver_features=False)``: :meth:`feature_error` says what to do."""
        introduced = FEATURES[feature].introduced
        return self.version >= introduced and self.driver_version >= introduced

    def feature_error(self, feature: str, call: str) -> errors.CudaError:
        """The exception for ``call`` asking for ``feature`` where :meth:`has_feature` says no:
        DriverTooOldError when the driver lacks it, else SymbolNotFoundError naming the requested version."""
        f = FEATURES[feature]
        if self.driver_version < f.introduced:
            return errors.DriverTooOldError(_CUDA_ERROR_NOT_FOUND, call, name="CUDA_ERROR_NOT_FOUND", hint=(
                f"{f.what} needs a CUDA {f.introduced} driver; this driver supports {self.driver_version}. Upgrade "
                "the NVIDIA driver"))
        return errors.SymbolNotFoundError(_CUDA_ERROR_NOT_FOUND, call, name="CUDA_ERROR_NOT_FOUND", hint=(
            f"{f.what} does not exist at CUDA {self.version} (the requested version); it was introduced in "
            f"{f.introduced}: request CUDA {f.introduced} or later (cuproc.Driver(version=...)) to use it"))

    def is_declared(self, name: str) -> bool:
        """Was ``name`` resolved by :meth:`declare` (a function cuproc's registry lacks)?"""
        return name in self._declared

    def preload(self) -> dict[str, int]:
        """Ask the driver for every symbol now (one pass under one lock); returns the count of each status.

        Only the driver's answers are taken here; the :class:`Resolution` and the published callable
        (a trampoline on the fast path) of each name are made on its first use, as they are without
        preload, and answer the same."""
        self.open()
        if _fork.FORKED[0]:
            raise forked_error("preload")
        counts: dict[str, int] = {}
        version = self._version
        assert version is not None
        per_thread = self.per_thread_default_stream   # read once: the table, the queries and the flag agree
        flags = self._stream_flag(per_thread)
        table = self.registry.entries(version, per_thread=per_thread)
        asked, answers, answer, driver = self._asked, self._answers, self._answer, self._driver_int
        fallback = self._newer_driver_version(version)
        with self._lock:
            ask = self._asker(flags)
            if asked and self._asked_table is not table:
                # per_thread_default_stream changed since the last preload(): its bare answers keep the
                # entries they were asked for
                for name in list(asked):
                    earlier = self._preloaded(name)
                    assert earlier is not None   # the name was in _asked
                    answers[name] = earlier
            self._asked_table = table
            known = asked.keys() | answers.keys() | self._resolutions.keys()   # empty on a fresh handle
            queries: list[tuple[str, str, int]] = []
            for name, entry in table.items():
                availability, entry_point, _, query_version, abi_version, _ = entry
                if name in known:
                    status = self._preloaded_status(name)
                elif availability == AVAILABLE and abi_version <= driver:  # type: ignore[operator]
                    # _answer's common case: one query each, asked below together (one C call on the fast
                    # path; a name selected again at the driver's version is asked above, alone), and only
                    # what the driver said is kept
                    queries.append((name, entry_point, query_version))  # type: ignore[arg-type]
                    continue
                else:
                    got = answers[name] = answer(name, entry, version, fallback, ask, per_thread)
                    status = got.status
                counts[status] = counts.get(status, 0) + 1
            for (name, _, _), (status, pointer) in zip(queries, self._ask_all(queries, ask, flags)):
                asked[name] = pointer if status == RESOLVED else status
                counts[status] = counts.get(status, 0) + 1
        return counts

    def publish_functions(self) -> dict[str, Any]:
        """Make every function of this handle -- the registry's, at R, and the declared ones -- what
        ``self.<name>`` gives, now where it was not yet, and return them by name (in registry order).

        Why: the module namespace binds all of them at once (:func:`cuproc.driver.preload`), and one
        pass under the lock costs a fraction of as many attribute misses.  Call :meth:`preload` first
        to ask the driver in one pass too; without it each name is asked for here.  Milliseconds:
        another thread's first use of a name waits for it."""
        self.open()
        if _fork.FORKED[0]:
            raise forked_error("publish_functions")
        found = self.__dict__
        out: dict[str, Any] = {}
        with self._lock:   # as in _c_name: one published object per name, whichever thread is first
            for name in [*self.registry, *self._declared]:
                value = found.get(name)
                if value is None:
                    status = None if name in self._resolutions else self._answered(name)
                    if status is not None and status != RESOLVED:
                        value = Unavailable(self, name, status)   # its message when asked for
                    else:
                        value = self._published(name, self.resolution(name))
                    found[name] = value
                out[name] = value
        return out

    def _answered(self, name: str) -> str | None:
        """The status preload() got for ``name``, None when it has none (peeked: still there for
        :meth:`resolution`).  Called with the lock held."""
        got = self._asked.get(name)
        if got is not None:
            return got if isinstance(got, str) else RESOLVED
        answer = self._answers.get(name)
        return None if answer is None else answer.status

    def _published(self, name: str, res: Resolution) -> Any:
        """What ``self.<name>`` becomes: the function, or an Unavailable that raises when called."""
        if res.function is None:
            return Unavailable(self, name, res.status, res)
        return self._with_alias(name, res, _public(name, res), self._version)

    def unavailable_error(self, res: Resolution) -> errors.CudaError:
        """The exception calling a function that did not resolve raises (:class:`Unavailable`)."""
        cls = errors.DriverTooOldError if res.status == DRIVER_TOO_OLD else errors.SymbolNotFoundError
        return cls(_CUDA_ERROR_NOT_FOUND, res.name, name="CUDA_ERROR_NOT_FOUND", hint=res.message)

    def _forget_resolutions(self) -> None:
        """After fork: drop cached pointers so the next access re-checks the process state."""
        for name in [*self._resolutions, *self._declared]:
            self.__dict__.pop(name, None)
        self._resolutions.clear()
        self._answers.clear()   # _declared stays: its names refuse in __getattr__
        self._asked.clear()
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
    def _c_name(self, name: str) -> Any:
        """``drv.cuX``, ``drv.CU_X``, ``drv.CUtype``: resolved on first access (``__getattr__``)."""
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._declared:      # in __dict__ unless fork() dropped it
            if _fork.FORKED[0]:
                raise forked_error(name)
            with self._lock:            # a declare() of this name in flight has stored it once we hold this
                value = self.__dict__.get(name)
            if value is not None:
                return value
        if name in self.registry:
            if _fork.FORKED[0]:
                raise forked_error(name)
            res = self.resolution(name)
            with self._lock:  # one published object per name, whichever thread gets here first
                value = self.__dict__.get(name)
                if value is None:
                    value = self.__dict__[name] = self._published(name, res)  # later: plain attribute loads
            return value
        table = constants()
        if name in table:
            return table[name]
        if _is_type_name(name):
            return ffi.typeof(name)
        raise AttributeError(f"no CUDA driver function, constant or type named {name!r}")

    if not TYPE_CHECKING:   # checkers see the declared C names only (CFunctions), so a misspelt one is an error
        __getattr__ = _c_name

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.registry) | set(constants()))


# By-value struct parameters that cffi's ABI mode cannot pass (they hold anonymous unions), with the
# integer type of the same size.  Small structs of integers travel in integer registers on x86-64
# SysV, AArch64 and Windows x64, so passing their little-endian image as that integer is the same call.
_BY_VALUE_AS_INTEGER = {"struct CUmemLocation_st": "uint64_t"}
# The same, keyed by the cffi type, made on first use (a race makes two equal maps and keeps the first):
# _signature asks every typedef whether it takes one of these, and testing its argument types is a set
# test, where reading each argument's C name builds a string per argument (about 3 us of the 20 us a
# first ``drv.cuX`` of an 11-argument function took).  Both the test and the swap read this one map.
_by_value_types: list[dict[Any, str]] = []


class _Signature(NamedTuple):
    """What publishing a function of one typedef needs, worked out once per typedef (:func:`_signature`)."""

    ctype: Any                  # the typedef's cffi type
    callable_type: Any          # the same, or with unpassable by-value structs as integers
    swapped: tuple[int, ...]    # the argument positions passed as integers


_signatures: dict[str, _Signature] = {}


def _signature(typedef: str) -> _Signature:
    """The typedef's types, cached: every first ``drv.cuX`` needs them, and ``ffi.typeof`` of a string
    costs microseconds (cffi's types are unique per string, so the cache changes no answer)."""
    sig = _signatures.get(typedef)
    if sig is None:
        ctype = ffi.typeof(typedef)
        if not _by_value_types:
            _by_value_types.append({ffi.typeof(cname): integer for cname, integer in _BY_VALUE_AS_INTEGER.items()})
        as_integer = _by_value_types[0]
        args = ctype.args
        swapped = () if as_integer.keys().isdisjoint(args) else tuple(i for i, a in enumerate(args) if a in as_integer)
        callable_type = ctype
        if swapped:
            passed = [as_integer.get(a, a.cname) for a in args]
            callable_type = ffi.typeof(f"{ctype.result.cname}(*)({', '.join(passed)})")
        sig = _signatures[typedef] = _Signature(ctype, callable_type, swapped)   # a race stores equal values
    return sig


def _callable_type(typedef: str) -> Any:
    """The typedef, or the same signature with unpassable by-value structs as integers."""
    return _signature(typedef).callable_type


def _public(name: str, res: Resolution) -> Callable[..., int]:
    """What ``driver.<name>`` is: the function at the resolved pointer -- its compiled trampoline
    when the fast path is on (:mod:`cuproc.fastpath`), else the cffi pointer itself -- except for
    cuInit (tracked for fork safety) and functions taking a by-value struct as an integer
    (converted here; those have no trampoline)."""
    function = res.function
    ctype, _, swapped = _signature(res.typedef)  # type: ignore[arg-type]
    if not swapped:
        function = fastpath.trampoline(res.typedef, function) or function  # type: ignore[arg-type]
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
    call.function = function  # type: ignore[attr-defined]  # the cffi pointer it calls, for fastpath.pointer()
    return call


# A typedef statement as the headers write one: its return type and parameter list.  A pattern, compiled
# by re on first use: cuproc imports no re (with enum, ~1.5 ms) on the way to a first allocation.
_TYPEDEF_STATEMENT = r"^\s*typedef\s+(.+?)\(\s*(?:CUDAAPI\s*)?\*\s*\w*\s*\)\s*(\(.*\))\s*;?\s*$"


def _is_driver_name(name: object) -> bool:
    """``cu`` followed by one or more ASCII letters, digits and underscores."""
    return (isinstance(name, str) and len(name) > 2 and name.startswith("cu") and name.isascii()
            and name[2:].replace("_", "a").isalnum())


def _declared_type(name: str, signature: Any) -> Any:
    """The pointer-to-function cffi type of a user's signature (C text or a cffi type)."""
    if isinstance(signature, str):
        import re
        m = re.match(_TYPEDEF_STATEMENT, signature, re.S)
        text = f"{m.group(1).replace('CUDAAPI', '')}(*){m.group(2)}" if m else signature
        try:
            ctype = ffi.typeof(text)
        except ffi.error as exc:
            raise TypeError(f"declare({name!r}): cannot parse signature {signature!r} ({exc}); give a C "
                            f"function pointer type such as 'CUresult (*)(CUdevice *, int)'") from None
    elif isinstance(signature, ffi.CType):
        ctype = signature
        try:
            ours = ffi.typeof(ctype.cname) is ctype
        except ffi.error:
            ours = False
        if not ours:
            raise TypeError(f"declare({name!r}): {ctype.cname} is a type from another FFI; build the signature "
                            f"with cuproc.ffi (cuproc.ffi.typeof(...)) or give C text")
    else:
        raise TypeError(f"declare({name!r}): signature must be C text or a cffi type, not "
                        f"{type(signature).__name__}")
    if ctype.kind != "function":   # cffi's kind of a pointer-to-function type
        raise TypeError(f"declare({name!r}): {ctype.cname} is not a function pointer type such as "
                        f"'CUresult (*)(CUdevice *, int)'")
    if ctype.result is not ffi.typeof("CUresult"):
        raise TypeError(f"declare({name!r}): {ctype.cname} returns {ctype.result.cname}; driver "
                        f"functions return CUresult")
    return ctype


class AliasedName:
    """``drv.<name>`` for a name that a CUDA header ``#define``s to another function.

    It calls what cuGetProcAddress returns for ``name`` (the C-named namespace's
    contract), at the cost of one Python call; its repr and docstring say what C
    source means by the name, and a call with the wrong number of arguments
    raises TypeError naming the alias.  It is a Python object, not a cffi
    pointer: ``.function`` is the cffi pointer (``ffi.cast("void *", f.function)``).
    """

    def __init__(self, function: Callable[..., int], res: Resolution, alias: str, version: CudaVersion) -> None:
        self._call = function                       # the trampoline where the fast path is on
        self.function = fastpath.pointer(function)  # the cffi pointer, on either path
        self.name = res.name
        self.alias = alias
        self.entry_point = res.entry_point
        self.typedef = res.typedef
        self.nargs = len(ffi.typeof(res.typedef).args)
        self.__doc__ = (f"{self.name}: the driver entry {self.entry_point} ({self.typedef}, {self.nargs} "
                        f"arguments), which cuGetProcAddress returns for this name.  C source compiled "
                        f"against the CUDA {version} headers means {alias} by {self.name} (they "
                        f"#define {self.name} {alias}); call {alias} for that.")

    def __call__(self, *args: Any) -> int:
        try:
            return self._call(*args)
        except TypeError:
            if len(args) == self.nargs:
                raise
            raise TypeError(f"{self.name}() takes {self.nargs} arguments ({self.typedef}), got {len(args)}: "
                            f"in C source {self.name} is a macro for {self.alias} (the CUDA headers #define "
                            f"{self.name} {self.alias}); call {self.alias} for that") from None

    def __repr__(self) -> str:
        return (f"<cuproc function {self.name} = {self.entry_point} ({self.typedef}); C source means "
                f"{self.alias} by {self.name}>")


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
    cuInit.function = fastpath.bare(function)  # type: ignore[attr-defined]  # for fastpath.pointer()
    return cuInit


class Checked(_CheckedFunctions):
    """``driver.checked.cuX(...)``: calls ``cuX`` and raises CudaError on any result but CUDA_SUCCESS."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def _c_name(self, name: str) -> Any:
        """``drv.checked.cuX``: the checked wrapper, made on first access (``__getattr__``)."""
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._driver, name)
        if name not in self._driver.registry and not self._driver.is_declared(name):
            return value  # constants and types pass through
        with self._driver._lock:   # declare() replaces the function and drops our wrapper under this lock
            wrapper = self.__dict__.get(name)
            if wrapper is None:
                function = getattr(self._driver, name)
                # A bare pointer or its trampoline has a known arity; wrappers (aliases, by-value structs)
                # check their own.
                bare = fastpath.bare(function)
                arity = len(ffi.typeof(bare).args) if isinstance(bare, ffi.CData) else None
                wrapper = _make_checked(function, name, self._driver.error, arity)
                self.__dict__[name] = wrapper
        return wrapper

    if not TYPE_CHECKING:   # as for Driver: checkers see the declared C names only
        __getattr__ = _c_name

    def __dir__(self) -> list[str]:
        return dir(self._driver)


def _identifier(text: str) -> str:
    r"""``text`` with each run of characters other than letters, digits and ``_`` made one ``_`` (what
    re.sub(r"\W+", "_", text) gives, without importing re on a first checked call)."""
    out: list[str] = []
    in_run = False
    for ch in text:
        word = ch.isalnum() or ch == "_"
        if word or not in_run:
            out.append(ch if word else "_")
        in_run = not word
    return "".join(out)


def _make_checked(function: Callable[..., int], name: str, error: Callable[[int, str], errors.CudaError],
                  arity: int | None = None) -> Callable[..., None]:
    """``name`` raising on failure: fork check, call ``function``, ``raise error(rc, name)`` when the
    result is not 0.  With the typedef's ``arity`` known, it takes exactly that many positional-only
    parameters, named for their C types, so a wrong count says what is missing: "cuMemAlloc()
    missing 1 required positional argument: 'arg1_size_t'"; otherwise any count (``function``
    checks its own).  Keyword arguments are refused.

    On the compiled fast path it is a C callable (src/fastpath/fastpath_checked.c, through
    :func:`cuproc.fastpath.checked_factory`): the goal of issue 9 is a checked call within 1.15x
    of the raw one.  On the pure path it is a generated Python function (no argument tuple is
    built and unpacked per call), which cannot meet that goal: its frame alone costs more than
    15% of a ~100 ns trivial call.  Both give the same results, errors and messages.
    """
    params: tuple[str, ...] | None = None
    if arity is not None:
        bare = fastpath.bare(function)
        types = [t.cname for t in ffi.typeof(bare).args] if isinstance(bare, ffi.CData) else []
        if len(types) != arity:
            types = ["value"] * arity
        params = tuple(f"arg{i}_" + _identifier(t.replace("*", " ptr")).strip("_") for i, t in enumerate(types))
    doc = f"{name}, raising cuproc.CudaError on failure (returns None)."
    make = fastpath.checked_factory()
    if make is not None:
        return make(function, name, params, error, _fork.FORKED, forked_error, doc)
    passed = "*args" if params is None else ", ".join(params)
    signature = passed if params is None or not params else passed + ", /"   # positional only, as in C
    source = (f"def make(function, error, forked, forked_error):\n"
              f"    def {name}({signature}):\n"
              f"        if forked[0]:   # a checked function captured before fork() refuses in the child\n"
              f"            raise forked_error({name!r})\n"
              f"        rc = function({passed})\n"
              f"        if rc:\n"
              f"            raise error(rc, {name!r})\n"
              f"    return {name}\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<cuproc checked {name}>", "exec"), namespace)  # noqa: S102 - a C name and ints only
    call = namespace["make"](function, error, _fork.FORKED, forked_error)
    if hasattr(call.__code__, "co_qualname"):   # Python's count errors say "cuMemAlloc()", not "make.<locals>..."
        call.__code__ = call.__code__.replace(co_qualname=name)
    call.__qualname__ = name
    call.__doc__ = doc
    return call


# --------------------------------------------------------------------------- the module as namespace

#: The handle behind the module namespace, as a one-element list (None until first use): the compiled
#: fast path reads it on every ``DeviceBuffer(n)`` (src/fastpath/fastpath_device_buffer.c), where a module
#: global would cost a dict lookup by name.  Written only by default_driver() and set_default_driver().
DEFAULT_HANDLE: list[Driver | None] = [None]
_default_lock = _fork.lock()
# Bumped (under _default_lock) whenever what the module namespace should bind changes: a new default
# handle, a declare() on it, a fork.  The lazy hook and preload() resolve outside the lock (resolving
# can re-enter it, and it is not reentrant), then bind only if this has not moved meanwhile -- else a
# declare() or set_default_driver() racing them would be undone by their stale values.
_module_generation = 0


def default_driver() -> Driver:
    """The handle behind ``cuproc.driver.cuX``: configured by CUPROC_* variables, opened on first use."""
    drv = DEFAULT_HANDLE[0]
    if drv is None:
        with _default_lock:
            drv = DEFAULT_HANDLE[0]
            if drv is None:
                drv = DEFAULT_HANDLE[0] = Driver()
    return drv


def set_default_driver(driver: Driver | None) -> None:
    """Replace the handle behind the module namespace (None: a fresh one from the environment)."""
    with _default_lock:
        DEFAULT_HANDLE[0] = driver
        _unbind_module_names()


def _unbind_module_names(names: Iterable[str] | None = None) -> None:
    """Drop the C names cached on the module (``names``, or every one), put the lazy hook back (so
    the next access resolves again, on the current default handle, with the fork check; preload()
    may have removed it) and move the generation (so a resolution in flight binds nothing stale).
    Callers hold _default_lock, except the fork hook (the child has one thread)."""
    global _module_generation
    _module_generation += 1
    module = globals()
    for name in list(_module_cache) if names is None else [n for n in names if n in _module_cache]:
        module.pop(name, None)
        _module_cache.discard(name)
    if not TYPE_CHECKING:
        module["__getattr__"] = _module_c_name


def _forget_module_name(driver: Driver, name: str) -> None:
    """declare() made or replaced ``name`` on ``driver``: if it is the default handle, the module
    namespace drops its cached copy, so ``cuproc.driver.<name>`` resolves again."""
    with _default_lock:
        if DEFAULT_HANDLE[0] is driver:
            _unbind_module_names((name,))


_C_PREFIXES = ("cu", "CU")   # what the namespace answers: functions, constants and types by C name
_PRELOAD_ATTEMPTS = 3   # rounds a racing declare() may cost the binding before the namespace stays lazy


def preload() -> dict[str, int]:
    """Resolve every symbol of the default handle now (:meth:`Driver.preload`), and make every C
    name -- functions, constants, types -- and ``checked`` a plain attribute of this module.

    The first function this module hands out (``cuproc.driver.cuX``, ``from cuproc.driver import
    cuX`` or ``checked``) does the same, so calling this is only needed to take that cost (10-17 ms
    once on the H100 host of the benchmarks) at a moment of your choosing.  Why bind everything at once: while this
    module answers C names lazily it has a PEP 562 ``__getattr__``, and CPython does not
    specialize attribute loads on a module that has one, so every ``cuproc.driver.cuX`` would pay a
    generic attribute lookup (about a fifth of a trivial driver call).  Once every name is bound,
    the hook is removed and ``cuproc.driver.cuX`` costs one module attribute load more than the
    function it names (a C trampoline on the fast path, the cffi pointer on the pure one).  A :class:`Driver` handle stays lazy per symbol.  :func:`set_default_driver`, a
    ``declare()`` on the default handle that replaces a name, and a fork put the hook back.  With
    the hook gone a misspelt name gets Python's own ``AttributeError``.  Returns
    :meth:`Driver.preload`'s count of each status."""
    drv = default_driver()
    counts = drv.preload()
    _bind_namespace(drv)
    return counts


def _bind_namespace(drv: Driver) -> None:
    """Bind every C name of ``drv`` on this module and remove the lazy hook, unless the default
    handle changed or the process forked meanwhile.

    A declare() on the default handle while the names are resolved makes it resolve them again
    (a few times at most; then it stays lazy, which is always correct); a new default handle or a
    fork meanwhile leaves the namespace lazy."""
    for _attempt in range(_PRELOAD_ATTEMPTS):
        generation = _module_generation
        if DEFAULT_HANDLE[0] is not drv or _fork.FORKED[0]:   # replaced, or forked, meanwhile: stay lazy
            return
        values = _module_values(drv)
        with _default_lock:
            if generation == _module_generation:
                _bind_module_values(values)
                return


def _module_values(drv: Driver) -> dict[str, Any]:
    """Every C name of ``drv`` -- functions, constants, types -- and its ``checked``, resolved now,
    with the precedence a lookup on ``drv`` has (function, then constant, then type)."""
    values: dict[str, Any] = {name: ffi.typeof(name) for name in _names_of_types() if name.startswith(_C_PREFIXES)}
    values.update((name, value) for name, value in constants().items() if name.startswith(_C_PREFIXES))
    values.update(drv.publish_functions())
    values["checked"] = drv.checked
    return values


def _bind_module_values(values: dict[str, Any]) -> None:
    """Bind ``values`` as module attributes and remove the lazy hook (caller holds _default_lock and
    has checked that nothing changed since they were resolved)."""
    module = globals()
    for name, value in values.items():
        if name in module and name not in _module_cache:
            continue                  # the module's own attribute wins, as with the hook
        module[name] = value
        _module_cache.add(name)
    if not TYPE_CHECKING:
        module.pop("__getattr__", None)


def is_driver_available() -> bool:
    """True when a driver opens and answers; never raises."""
    from .loader import is_driver_available as available
    return available()


checked: Checked   # the default handle's checked functions (made on first access below)


def _opens(drv: Driver) -> bool:
    """Does ``drv`` open (a driver is there and answers)?  Never raises: ``cuproc.driver.checked``
    is handed out without a driver, as before, and its calls say what is missing."""
    try:
        drv.open()
    except (errors.DriverNotFoundError, errors.CudaError):
        return False
    return True


def _module_c_name(name: str) -> Any:
    """``cuproc.driver.cuX``: the default handle's, cached as a module attribute (``__getattr__``); the
    first function (or ``checked``, once a driver opens) binds every name and removes this hook.

    Resolved outside _default_lock (resolving may take it), cached only if neither the default
    handle nor its declared names changed meanwhile; otherwise returned uncached, so the next
    access resolves on what is current."""
    if name != "checked" and not name.startswith(_C_PREFIXES):
        raise AttributeError(f"module 'cuproc.driver' has no attribute {name!r}")
    generation = _module_generation
    drv = default_driver()
    value: Any = drv.checked if name == "checked" else getattr(drv, name)   # raises what drv.<name> raises
    # (a forked child gets checked, whose calls refuse, and binds nothing: nor does it open the driver)
    function = not _fork.FORKED[0] and (
        _opens(drv) if name == "checked" else (name in drv.registry or drv.is_declared(name)))
    if function:
        # A function: a program that calls one through the module calls more, so bind every name now
        # (preload()) and drop this hook; its loads then specialize (see preload).  Constants and types
        # alone keep the module lazy (they need no driver), as ``checked`` does where no driver opens.
        drv.preload()
        _bind_namespace(drv)
        return value
    with _default_lock:
        if generation == _module_generation and DEFAULT_HANDLE[0] is drv:
            globals()[name] = value   # cache: the next access is a plain module attribute load
            _module_cache.add(name)
    return value


if not TYPE_CHECKING:   # checkers see the declared C names only (cuproc/_cnames.pyi), so a misspelt one is an error
    __getattr__ = _module_c_name
