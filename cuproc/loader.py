"""Find and open the driver library, and take its symbol-lookup entry point.

Policy
------
* Opened on first use, never at import, so ``fork`` before first use is safe.
* The path is the caller's argument, else ``CUPROC_LIBCUDA``, else the
  platform's standard names and install locations.  When nothing opens,
  :class:`~cuproc.errors.DriverNotFoundError` lists every path with its OS error.
* Lookup prefers ``cuGetProcAddress_v2`` (CUDA 12.0+ drivers, reports a
  per-symbol status), then ``cuGetProcAddress`` (11.3-11.8 drivers), then
  plain symbol lookup of the registry's entry names (older drivers).  The
  one taken, and why, is recorded in :attr:`DriverLibrary.fallbacks`.
* One :class:`DriverLibrary` per path per process: several ``Driver``
  handles at different versions share it.
* The CUDA toolkit's link-time stub (``.../lib64/stubs/libcuda.so``) is not a
  driver: every call in it returns CUDA_ERROR_STUB_LIBRARY.  A library that
  answers cuDriverGetVersion with that code, or that was loaded from a
  ``stubs`` directory, is skipped like one that failed to open, and when
  nothing else opens :class:`~cuproc.errors.DriverNotFoundError` says a stub
  was found where a driver was expected.
* The library is opened with cffi's own loader (``_cffi_backend.load_library``,
  what cffi's in-line ``ffi.dlopen`` calls: dlopen/dlsym, or LoadLibrary/GetProcAddress
  on Windows; ``load_function`` and ``close_lib`` exist from cffi 1.12, and cuproc
  needs 1.15), not ctypes: importing ctypes cost a fresh process about 2 ms on its
  way to a usable device (issue 9's startup goal).
* An accepted driver stays loaded until the process ends, as it did when ctypes
  held it: cffi unloads a library when its handle is freed, which the interpreter's
  teardown would do while the driver may still run cuproc's callbacks.  On POSIX the
  library is pinned (a second dlopen with RTLD_NOLOAD | RTLD_NODELETE); elsewhere its
  handle is never freed.  Only a rejected stub is unloaded.
"""
from __future__ import annotations

import os
import sys

import _cffi_backend  # type: ignore[import-untyped, unused-ignore]  # cffi ships no stubs

from . import _fork
from ._ffi import ffi
from ._immortal import keep_forever
from .errors import DriverNotFoundError, result_code

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import Any

ENV_LIBRARY = "CUPROC_LIBCUDA"

if sys.platform == "win32":
    DEFAULT_CANDIDATES: tuple[str, ...] = ("nvcuda.dll",)
else:
    DEFAULT_CANDIDATES = (
        "libcuda.so.1",
        "libcuda.so",
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
        "/usr/lib64/libcuda.so.1",
        "/usr/local/nvidia/lib64/libcuda.so.1",
        "/usr/lib/wsl/lib/libcuda.so.1",
    )

CUDA_ERROR_STUB_LIBRARY = result_code("CUDA_ERROR_STUB_LIBRARY")   # the stub's answer to every call
STUB_MESSAGE = ("is the CUDA toolkit's stub library (CUDA_ERROR_STUB_LIBRARY), which only satisfies the "
                "linker: a stub was found where a driver was expected")

# How symbols are looked up, best first.
GET_PROC_ADDRESS_V2 = "cuGetProcAddress_v2"
GET_PROC_ADDRESS_V1 = "cuGetProcAddress"
DIRECT_LOOKUP = "dlsym"


class DriverLibrary:
    """An opened driver library and the bootstrap entry points cuproc needs from it."""

    def __init__(self, path: str, handle: Any) -> None:
        """``handle``: the library as :func:`dlopen` opened it."""
        self.path = path
        self._handle: Any = handle   # None once closed
        self._pinned: Any = None     # the RTLD_NODELETE handle of pin()
        self.fallbacks: list[str] = []
        v2 = self.symbol_address(GET_PROC_ADDRESS_V2)
        v1 = self.symbol_address(GET_PROC_ADDRESS_V1)
        if v2:
            self.lookup = GET_PROC_ADDRESS_V2
            self.get_proc_address = ffi.cast("PFN_cuGetProcAddress_v12000", v2)
        elif v1:
            self.lookup = GET_PROC_ADDRESS_V1
            self.get_proc_address = ffi.cast("PFN_cuGetProcAddress_v11030", v1)
            self.fallbacks.append(f"{GET_PROC_ADDRESS_V2} not exported (driver before 12.0): "
                                  f"using {GET_PROC_ADDRESS_V1}, which reports no per-symbol status")
        else:
            self.lookup = DIRECT_LOOKUP
            self.get_proc_address = None
            self.fallbacks.append(f"neither {GET_PROC_ADDRESS_V2} nor {GET_PROC_ADDRESS_V1} exported "
                                  "(driver before 11.3): looking up the registry's entry names directly")
        self.driver_get_version = self._required("cuDriverGetVersion", "PFN_cuDriverGetVersion_v2020")
        self.get_error_name = self._required("cuGetErrorName", "PFN_cuGetErrorName_v6000")
        self.get_error_string = self._required("cuGetErrorString", "PFN_cuGetErrorString_v6000")

    def _required(self, name: str, typedef: str):  # noqa: ANN202 - a cffi function pointer
        address = self.symbol_address(name)
        if not address:
            raise DriverNotFoundError([(self.path, f"opened, but it does not export {name}: not a CUDA driver")])
        return ffi.cast(typedef, address)

    def symbol_address(self, name: str) -> int | None:
        """The address the dynamic linker gives for ``name`` in this library (dlsym), or None."""
        try:
            address = self._handle.load_function(ffi.typeof("void *"), name)
        except AttributeError:   # cffi's answer to a name the library does not export
            return None
        return int(ffi.cast("uintptr_t", address)) or None

    def loaded_from(self) -> str | None:
        """The file the dynamic linker actually loaded (dladdr of cuDriverGetVersion), or None."""
        address = self.symbol_address("cuDriverGetVersion")
        if not address or sys.platform == "win32":
            return None
        try:
            process = _cffi_backend.load_library(None, _OPEN_FLAGS)   # held until the call is made
            # dladdr(const void *, Dl_info *): Dl_info's first member is the file name, and the
            # struct is four pointers on every POSIX system that has dladdr
            dladdr = process.load_function(ffi.typeof("int(*)(void *, void **)"), "dladdr")
        except (OSError, AttributeError):
            return None
        info = ffi.new("void *[4]")
        if not dladdr(ffi.cast("void *", address), info) or info[0] == ffi.NULL:
            return None
        return os.fsdecode(ffi.string(ffi.cast("char *", info[0]))) or None

    def is_stub(self) -> bool:
        """True for the toolkit's stub libcuda: it answers cuDriverGetVersion with
        CUDA_ERROR_STUB_LIBRARY; or it was loaded from a ``stubs`` directory and its symbol lookup
        (cuGetProcAddress) answers nothing either.  A library in a ``stubs`` directory that answers
        both is a driver, wherever it was installed."""
        rc = self.driver_get_version(ffi.new("int *"))
        if rc == CUDA_ERROR_STUB_LIBRARY:
            return True
        where = self.loaded_from() or self.path
        if "stubs" not in os.path.dirname(os.path.realpath(where)).split(os.sep):
            return False
        return rc != 0 or not self._looks_up("cuDriverGetVersion")

    def _looks_up(self, name: str) -> bool:
        """True when the lookup entry point resolves ``name`` (needs no cuInit); True for plain dlsym."""
        out = ffi.new("void **")
        if self.lookup == GET_PROC_ADDRESS_V2:
            rc = self.get_proc_address(name.encode(), out, 2020, 0, ffi.new("CUdriverProcAddressQueryResult *"))
        elif self.lookup == GET_PROC_ADDRESS_V1:
            rc = self.get_proc_address(name.encode(), out, 2020, 0)
        else:
            return True
        return rc == 0 and out[0] != ffi.NULL

    def pin(self) -> None:
        """Keep the library loaded until the process ends, whatever happens to this object (see the
        module's policy): called once it is accepted as the driver."""
        if hasattr(os, "RTLD_NODELETE") and hasattr(os, "RTLD_NOLOAD"):
            try:
                self._pinned = _cffi_backend.load_library(
                    self.path, _OPEN_FLAGS | os.RTLD_NOLOAD | os.RTLD_NODELETE)
                return
            except OSError:   # not reopened by its path (cannot happen for a library just opened)
                pass
        keep_forever(self._handle)

    def close(self) -> None:
        """Unload the library (dlclose / FreeLibrary): only for one never handed out (a rejected stub),
        whose entry points nothing holds."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.close_lib()

    def version_int(self) -> int:
        out = ffi.new("int *")
        rc = self.driver_get_version(out)
        if rc:
            from .errors import make_error
            raise make_error(rc, "cuDriverGetVersion")
        return out[0]

    def describe_error(self, code: int) -> tuple[str | None, str | None]:
        """(cuGetErrorName, cuGetErrorString) for ``code``; None where the driver has no answer."""
        out = ffi.new("const char **")
        name = ffi.string(out[0]).decode() if self.get_error_name(code, out) == 0 and out[0] else None
        text = ffi.string(out[0]).decode() if self.get_error_string(code, out) == 0 and out[0] else None
        return name, text


# Windows: 0, cffi's default, which from cffi 1.17 searches as ctypes does (a path's own directory for its
# dependencies, not the current directory); POSIX: resolved now, kept out of the global namespace.
_OPEN_FLAGS = 0 if sys.platform == "win32" else getattr(os, "RTLD_NOW", 0) | getattr(os, "RTLD_LOCAL", 0)


def dlopen(path: str) -> Any:
    """The library at ``path`` opened now and local to cuproc (RTLD_NOW | RTLD_LOCAL), as
    :class:`DriverLibrary` takes it; OSError when the dynamic linker refuses it."""
    return _cffi_backend.load_library(path, _OPEN_FLAGS)


_libraries: dict[str, DriverLibrary] = {}
_lock = _fork.lock()   # fresh in a forked child


def candidate_paths(path: str | os.PathLike[str] | None = None) -> list[str]:
    if path is not None:
        return [os.fspath(path)]
    env = os.environ.get(ENV_LIBRARY)
    return [env] if env else list(DEFAULT_CANDIDATES)


def open_library(path: str | os.PathLike[str] | None = None) -> DriverLibrary:
    """Open (once per process and path) the driver library; raise DriverNotFoundError listing every attempt."""
    attempts: list[tuple[str, str]] = []
    with _lock:
        for candidate in candidate_paths(path):
            if candidate in _libraries:
                return _libraries[candidate]
            try:
                handle = dlopen(candidate)
            except OSError as exc:   # "cannot load library '<candidate>': <the dynamic linker's reason>"
                reason = str(exc).removeprefix(f"cannot load library '{candidate}': ")
                attempts.append((candidate, reason or type(exc).__name__))
                continue
            try:
                lib = DriverLibrary(candidate, handle)
                stub = lib.is_stub()
            except DriverNotFoundError as exc:   # it opened, but it is no driver: the next candidate may be
                attempts.extend(exc.attempts)
                handle.close_lib()
                continue
            except BaseException:
                handle.close_lib()                # nothing holds it: a library taken by no one is unloaded
                raise
            if stub:
                attempts.append((candidate, STUB_MESSAGE))
                lib.close()
                continue
            lib.pin()
            _libraries[candidate] = lib
            return lib
    raise DriverNotFoundError(attempts)


def is_driver_available(path: str | os.PathLike[str] | None = None) -> bool:
    """True when a driver library opens and answers cuDriverGetVersion; never raises."""
    try:
        open_library(path).version_int()
    except Exception:  # noqa: BLE001 - the question is yes/no
        return False
    return True
