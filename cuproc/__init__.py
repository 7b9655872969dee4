"""cuproc: the CUDA driver API from Python, every entry point by its C name, at the ABI version you ask for.

Importing cuproc does not touch the driver: ``Driver`` handles open it on
first use, so forking before first use is safe.

Layers, bottom up: ``headers/`` -> ``cuproc._ffi`` (the ABI module, or the compiled fast path) -> ``loader`` ->
``registry`` -> ``driver`` (C names, errors) -> objects -> ``tools``.
"""
from __future__ import annotations

from ._ffi import ffi
from .driver import Driver, default_driver, is_driver_available, set_default_driver
from .errors import (
    ClosedResourceError,
    CudaError,
    CudaWarning,
    DriverNotFoundError,
    DriverTooOldError,
    ForkedProcessError,
    InvalidContextError,
    InvalidValueError,
    NotFoundError,
    NotInitializedError,
    OutOfMemoryError,
    SymbolNotFoundError,
)
from .registry import default_registry
from .version import CudaVersion

__version__ = "0.1.0"

__all__ = [
    "ClosedResourceError", "CudaWarning", "CudaError", "CudaVersion", "Driver", "DriverNotFoundError", "DriverTooOldError", "ForkedProcessError",
    "InvalidContextError", "InvalidValueError", "NotFoundError", "NotInitializedError", "OutOfMemoryError",
    "SymbolNotFoundError", "default_driver", "default_registry", "ffi", "is_driver_available",
    "set_default_driver",
]


def __getattr__(name: str) -> object:
    """The object layer loads on first use, so ``import cuproc`` stays cheap."""
    import importlib
    for module in ("context", "device", "stream", "memory", "module"):
        mod = importlib.import_module(f".{module}", __name__)
        if name in getattr(mod, "__all__", ()):
            value = getattr(mod, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'cuproc' has no attribute {name!r}")
