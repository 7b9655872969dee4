"""Exceptions: one base carrying the CUresult, subclasses for the errors people catch.

Policy: every message names the failing call, the CUDA error name and what
to do next.  Names and texts come from the driver (``cuGetErrorName`` /
``cuGetErrorString``) when it can answer, else from the headers' enum; a
failure while building the message never hides the original error.
"""
from __future__ import annotations

from ._ffi import ffi

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable

_RESULT_NAMES: dict[int, str] | None = None


def result_name(code: int) -> str:
    """The CUresult enumerator for ``code`` per the headers (no driver needed)."""
    global _RESULT_NAMES
    if _RESULT_NAMES is None:
        _RESULT_NAMES = dict(ffi.typeof("CUresult").elements)
    return _RESULT_NAMES.get(code, f"CUresult({code})")


def result_code(name: str) -> int:
    return ffi.typeof("CUresult").relements[name]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (3.11+); on 3.10, which has no ``add_note``, the note is kept in ``__notes__`` all
    the same (what traceback prints from 3.11 on, and what tests read)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]


# What to do, per error.  Keyed by name so the table reads like the driver documentation.
_HINTS = {
    "CUDA_ERROR_NOT_INITIALIZED": "call cuInit(0) first (the object layer does this for you)",
    "CUDA_ERROR_DEINITIALIZED": "the driver is shutting down; do not call CUDA from atexit handlers or finalizers",
    "CUDA_ERROR_INVALID_CONTEXT": "no usable context is current on this thread: make one current "
                                  "(cuDevicePrimaryCtxRetain + cuCtxSetCurrent, or cuCtxCreate)",
    "CUDA_ERROR_CONTEXT_IS_DESTROYED": ("the context was destroyed; create or retain a new one (a primary context "
                                        "goes with its last retain: keep what cuproc.use_device() returns, "
                                        "pc = cuproc.use_device(0), while you use the device)"),
    "CUDA_ERROR_OUT_OF_MEMORY": "free memory (or allocate less) and retry; cuMemGetInfo shows what is left",
    "CUDA_ERROR_INVALID_VALUE": "an argument is outside what the driver accepts; check it against the "
                                "driver API documentation of this call",
    "CUDA_ERROR_NOT_FOUND": "the named symbol does not exist",
    "CUDA_ERROR_NO_DEVICE": "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and nvidia-smi)",
    "CUDA_ERROR_INVALID_DEVICE": "the device ordinal is out of range; cuDeviceGetCount gives the count",
    "CUDA_ERROR_INVALID_HANDLE": "the handle is invalid or was already destroyed",
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION": "the PTX was built by a newer toolkit than this driver supports; "
                                          "rebuild for an older PTX ISA or upgrade the driver",
    "CUDA_ERROR_INSUFFICIENT_DRIVER": "the installed driver is older than this call needs; upgrade the driver",
}

FORK_HINT = ("this process is a fork() of one that had already initialized CUDA, and the CUDA driver cannot "
             "be used across fork(): start workers with multiprocessing's 'spawn' or 'forkserver' method")


class CudaError(Exception):
    """A CUDA driver call failed.

    ``code`` is the CUresult, ``name`` its enumerator (``cuGetErrorName``),
    ``description`` the driver's text (``cuGetErrorString``) and ``call``
    the C name of the function that failed.
    """

    #: True when cuproc refused the call before the driver saw anything (``code`` is then the
    #: CUresult the driver would have given, and the message does not claim the driver answered).
    refused = False

    def __init__(self, code: int, call: str | None = None, *, name: str | None = None,
                 description: str | None = None, hint: str | None = None) -> None:
        self.code = code
        self.call = call
        self.name = name or result_name(code)
        self.description = description or ""
        self.hint = hint if hint is not None else _HINTS.get(self.name, "")
        super().__init__(self._message())

    def _message(self) -> str:
        if self.refused:
            return f"{self.call} was not called: {self.hint}" if self.call else str(self.hint)
        where = f"{self.call} failed: " if self.call else ""
        text = f"{where}{self.name} ({self.code})"
        if self.description:
            text += f": {self.description}"
        if self.hint:
            text += f". {self.hint}"
        return text

    def __reduce__(self) -> tuple:
        return (_rebuild, (type(self), self.code, self.call, self.name, self.description, self.hint,
                           self.refused))

    def renamed(self, call: str) -> CudaError:
        """This refusal (same class, code and attributes) for ``call``: a refusal made on the way to a
        call -- a freed buffer's ``ptr`` read while packing a launch -- names the call the caller was
        making, not the step that noticed.  Only refusals: a driver's answer belongs to the call that got it."""
        if not self.refused:
            raise TypeError(f"only a refusal can be renamed; {self} is the driver's answer to {self.call}")
        err = type(self).__new__(type(self))
        err.__dict__.update(self.__dict__)
        if "__notes__" in err.__dict__:          # the copy's notes are its own
            err.__notes__ = list(self.__notes__)
        err.call = call
        err.args = (err._message(),)
        return err


def _rebuild(cls: type, code: int, call: str | None, name: str, description: str, hint: str,
             refused: bool = False) -> CudaError:
    err = cls.__new__(cls)
    err.refused = refused
    CudaError.__init__(err, code, call, name=name, description=description, hint=hint)
    return err


class NotInitializedError(CudaError):
    """CUDA_ERROR_NOT_INITIALIZED / DEINITIALIZED: cuInit has not run (or the driver is going away)."""


class InvalidValueError(CudaError, ValueError):
    """CUDA_ERROR_INVALID_VALUE, or an argument cuproc rejected before the driver saw it."""


class OutOfMemoryError(CudaError, MemoryError):
    """CUDA_ERROR_OUT_OF_MEMORY."""


class InvalidContextError(CudaError):
    """CUDA_ERROR_INVALID_CONTEXT / CONTEXT_IS_DESTROYED: no usable context is current."""


class NotFoundError(CudaError, LookupError):
    """CUDA_ERROR_NOT_FOUND: a named symbol, kernel or attribute does not exist."""


class SymbolNotFoundError(NotFoundError):
    """The driver has no entry point for this function at this version and flag."""


class DriverTooOldError(SymbolNotFoundError):
    """The function needs a newer CUDA driver than the one installed."""


class ForkedProcessError(CudaError):
    """CUDA was initialized before this process was forked; the child cannot use it.
    Raised by cuproc before the driver is called (``refused``)."""

    refused = True


class ClosedResourceError(InvalidValueError):
    """An object was used after it, or something it depends on, was closed or destroyed.

    Raised by cuproc before any handle reaches the driver (``refused`` is True).
    ``resource`` describes the object used; ``closed`` the one that was closed
    (the object itself, or its context, module, stream, ...).
    """

    refused = True

    def __init__(self, call: str, resource: str, closed: str, how: str) -> None:
        self.resource, self.closed_resource = resource, closed
        if resource == closed:
            hint = f"{resource} was {how}; it cannot be used any more"
        else:
            hint = f"{resource} cannot be used: {closed}, which it depends on, was {how}"
        super().__init__(result_code("CUDA_ERROR_INVALID_VALUE"), call, hint=hint)


class CudaWarning(RuntimeWarning):
    """A driver call made on cuproc's own initiative failed where raising is impossible
    (a finalizer freeing a dropped object).  Reported once per failure, never silently:
    a RuntimeWarning, which Python shows by default (a ResourceWarning would be hidden)."""


def refusal(call: str, message: str, cls: type[CudaError] | None = None,
            code_name: str = "CUDA_ERROR_INVALID_VALUE") -> CudaError:
    """An error for a call cuproc refused before the driver saw it: it says so instead of
    claiming that ``call`` failed with a driver error."""
    err_cls = cls or error_class(code_name)
    err = err_cls.__new__(err_cls)
    err.refused = True
    CudaError.__init__(err, result_code(code_name), call, hint=message)
    return err


class DriverNotFoundError(OSError):
    """No CUDA driver library could be opened; ``attempts`` lists each path and its OS error."""

    def __init__(self, attempts: list[tuple[str, str]]) -> None:
        self.attempts = attempts
        lines = "\n".join(f"  {path}: {err}" for path, err in attempts)
        super().__init__(
            "no CUDA driver library could be opened. Tried:\n" + lines +
            "\nInstall the NVIDIA driver, or set CUPROC_LIBCUDA to the path of libcuda.so.1")


_CLASSES: dict[str, type[CudaError]] = {
    "CUDA_ERROR_NOT_INITIALIZED": NotInitializedError,
    "CUDA_ERROR_DEINITIALIZED": NotInitializedError,
    "CUDA_ERROR_INVALID_VALUE": InvalidValueError,
    "CUDA_ERROR_OUT_OF_MEMORY": OutOfMemoryError,
    "CUDA_ERROR_INVALID_CONTEXT": InvalidContextError,
    "CUDA_ERROR_CONTEXT_IS_DESTROYED": InvalidContextError,
    "CUDA_ERROR_NOT_FOUND": NotFoundError,
}


def error_class(name: str) -> type[CudaError]:
    return _CLASSES.get(name, CudaError)


def make_error(code: int, call: str | None,
               describe: Callable[[int], tuple[str | None, str | None]] | None = None,
               extra_hint: str | None = None) -> CudaError:
    """Build the exception for ``code``.  ``describe`` asks the driver for (name, text);
    if it fails, the headers' name is used and the original error still comes out."""
    name = description = None
    if describe is not None:
        try:
            name, description = describe(code)
        except Exception:  # noqa: BLE001 - error reporting must never hide the error itself
            name = description = None
    name = name or result_name(code)
    hint = _HINTS.get(name, "")
    if extra_hint:
        hint = f"{hint}; {extra_hint}" if hint else extra_hint
    return error_class(name)(code, call, name=name, description=description, hint=hint)
