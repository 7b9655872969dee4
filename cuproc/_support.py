"""What every object-layer module needs from the driver layer: a handle, cuInit once, checks.

Policy: objects take an optional ``driver=`` handle and default to the module
namespace's default handle, so one process can run objects at two ABI
versions side by side.  The object layer asks capability questions
(``driver.has(...)``, the arity of the selected typedef) and never compares
raw version numbers.
"""
from __future__ import annotations

from ._ffi import ffi
from .driver import Driver, default_driver
from .errors import CudaError, InvalidValueError, refusal, result_code

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import Any

CUDA_ERROR_INVALID_VALUE = result_code("CUDA_ERROR_INVALID_VALUE")
CUDA_ERROR_NOT_READY = result_code("CUDA_ERROR_NOT_READY")
CUDA_ERROR_INVALID_CONTEXT = result_code("CUDA_ERROR_INVALID_CONTEXT")


def get_driver(driver: Driver | None = None) -> Driver:
    """The handle to use, with cuInit(0) done once for it (:meth:`Driver.initialize`: the handle keeps
    the memo, so a new handle never inherits a dropped one's)."""
    drv = driver if driver is not None else default_driver()
    return drv if drv.initialized else drv.initialize()


def arity(driver: Driver, name: str) -> int:
    """Number of parameters of the ABI the handle selected for ``name`` (the capability probe
    for calls whose signature changed between versions, e.g. cuCtxCreate v2/v3/v4)."""
    res = driver.resolution(name)
    if res.typedef is None:
        raise driver.unavailable_error(res)
    return len(ffi.typeof(res.typedef).args)


def invalid(call: str, message: str) -> InvalidValueError:
    """An argument rejected before the driver saw it: the message says ``call`` was not made."""
    return refusal(call, message, InvalidValueError)  # type: ignore[return-value]


def handle_int(handle: Any) -> int:
    return int(ffi.cast("uintptr_t", handle))


__all__ = ["CudaError", "get_driver", "arity", "invalid", "handle_int"]
