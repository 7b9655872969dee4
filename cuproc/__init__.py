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

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    # The object layer, loaded lazily by __getattr__ below; imported here so that type checkers
    # see the real classes.  tests/test_typing.py checks that these are exactly the ``__all__``
    # of the modules in _LAZY_MODULES.
    from .context import Context, PrimaryContext, PrimaryRetains, call_in, synchronize_context, use_device
    from .device import Device
    from .memory import (
        Allocation,
        DLPackArray,
        DeviceBuffer,
        DeviceView,
        GlobalView,
        HostMemory,
        ManagedBuffer,
        MemoryPool,
        PinnedBuffer,
        RegisteredHostMemory,
        alloc_async,
        copy,
        copy_2d,
        copy_3d,
        from_dlpack,
        mem_info,
        memset,
        memset_2d,
        pointer_attributes,
    )
    from .module import Function, JitResult, Kernel, Library, Linker, Module
    from .graph import Graph, GraphExec, GraphInstantiateError, GraphUpdateError
    from .graph_nodes import (
        ChildGraphNode,
        ConditionalHandle,
        ConditionalNode,
        EmptyNode,
        EventRecordNode,
        EventWaitNode,
        GraphAllocation,
        GraphNode,
        HostNode,
        KernelNode,
        KernelNodeParams,
        MemAllocNode,
        MemFreeNode,
        MemcpyNode,
        MemsetNode,
    )
    from .stream_capture import CaptureInfo, StreamCapture, capture, capture_info, capture_status
    from .virtual_memory import GrowableBuffer, PhysicalMemory, Reservation
    from .green_context import GreenContext, SmResource
    from .arrays import CudaArray, MipmappedArray
    from .textures import SurfaceObject, TextureObject
    from .tensor_map import TensorMap
    from .program import (
        CompileCache,
        CompileError,
        NvrtcError,
        NvrtcNotFoundError,
        ObjectCode,
        Program,
        compile_kernel,
    )
    from .stream import (
        Event,
        HostCallbackError,
        Stream,
        default_stream,
        launch_host_func,
        stream_context,
        stream_handle,
    )

__version__ = "0.1.0"   # the one place: pyproject.toml reads it ([tool.setuptools.dynamic])

# device_memory before memory: a first DeviceBuffer imports no host memory, pools or transfers.
# program last: it (and NVRTC's declarations, never NVRTC itself) loads only for its own names.
_LAZY_MODULES = ("context", "device", "stream", "device_memory", "memory", "module", "graph", "graph_nodes",
                 "stream_capture", "program")
# Single names of modules whose other names stay behind the module (cuproc.virtual_memory.granularity, ...;
# IPC's functions read best behind theirs: ``from cuproc import ipc``, then ipc.export_memory): name -> module.
_LAZY_NAMES = {"GrowableBuffer": "virtual_memory", "PhysicalMemory": "virtual_memory", "Reservation": "virtual_memory",
               "GreenContext": "green_context", "SmResource": "green_context", "CudaArray": "arrays",
               "MipmappedArray": "arrays", "SurfaceObject": "textures", "TextureObject": "textures",
               "TensorMap": "tensor_map"}

__all__ = [
    "ClosedResourceError", "CudaWarning", "CudaError", "CudaVersion", "Driver", "DriverNotFoundError", "DriverTooOldError", "ForkedProcessError",
    "InvalidContextError", "InvalidValueError", "NotFoundError", "NotInitializedError", "OutOfMemoryError",
    "SymbolNotFoundError", "default_driver", "default_registry", "ffi", "is_driver_available",
    "set_default_driver",
    # the object layer (lazy)
    "Context", "PrimaryContext", "PrimaryRetains", "call_in", "synchronize_context", "use_device", "Device",
    "Allocation", "DLPackArray", "DeviceBuffer", "DeviceView", "GlobalView", "HostMemory", "ManagedBuffer", "MemoryPool",
    "PinnedBuffer", "RegisteredHostMemory", "alloc_async", "copy", "copy_2d", "copy_3d", "from_dlpack", "mem_info", "memset",
    "memset_2d", "pointer_attributes", "Function", "JitResult", "Kernel", "Library", "Linker", "Module",
    "Event", "HostCallbackError", "Stream", "default_stream", "launch_host_func", "stream_context", "stream_handle",
    # CUDA graphs (lazy)
    "Graph", "GraphExec", "GraphInstantiateError", "GraphUpdateError", "ChildGraphNode", "ConditionalHandle",
    "ConditionalNode", "EmptyNode", "EventRecordNode", "EventWaitNode", "GraphNode", "HostNode", "KernelNode",
    "KernelNodeParams", "MemAllocNode", "MemFreeNode", "MemcpyNode", "MemsetNode", "GraphAllocation", "CaptureInfo",
    "StreamCapture", "capture", "capture_info", "capture_status",
    # virtual memory, green contexts, arrays, textures and tensor maps (lazy; IPC: from cuproc import ipc)
    "GrowableBuffer", "PhysicalMemory", "Reservation", "GreenContext", "SmResource", "CudaArray", "MipmappedArray",
    "SurfaceObject", "TextureObject", "TensorMap",
    # kernels from source (lazy; NVRTC itself opens at the first compile)
    "CompileCache", "CompileError", "NvrtcError", "NvrtcNotFoundError", "ObjectCode", "Program", "compile_kernel",
]


def _lazy(name: str) -> object:
    """The object layer loads on first use, so ``import cuproc`` stays cheap (``__getattr__``).
    ``__import__`` rather than importlib.import_module: the importlib package is another import."""
    import sys
    if name not in __all__:   # a submodule (``from . import nvrtc``) or a typo: importing the layer finds nothing
        raise AttributeError(f"module 'cuproc' has no attribute {name!r}")
    if name in _LAZY_NAMES:
        qualified = f"{__name__}.{_LAZY_NAMES[name]}"
        __import__(qualified)
        value = getattr(sys.modules[qualified], name)
        globals()[name] = value
        return value
    # the modules imported already first (``cuproc.Program`` after ``import cuproc.program`` loads no graphs)
    loaded = [m for m in _LAZY_MODULES if f"{__name__}.{m}" in sys.modules]
    for module in loaded + [m for m in _LAZY_MODULES if m not in loaded]:
        qualified = f"{__name__}.{module}"
        __import__(qualified)
        mod = sys.modules[qualified]
        if name in getattr(mod, "__all__", ()):
            value = getattr(mod, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'cuproc' has no attribute {name!r}")


if not TYPE_CHECKING:   # checkers see the TYPE_CHECKING imports above, so a misspelt name is an error
    __getattr__ = _lazy
