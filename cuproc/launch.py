"""Kernel launch: argument packing, both cuLaunchKernel conventions, cuLaunchKernelEx, cooperative.

Policy
------
* **Exact C types.**  Arguments are packed by a signature (``["float*", "int",
  "float"]``) or, without one, from values that carry their C type: NumPy
  scalars, cuproc buffers / ``__cuda_array_interface__`` / DLPack objects
  (pointers), NumPy structured scalars and cffi structs (structs).  A bare
  Python ``int`` or ``float`` without a signature is refused: a float is never
  silently passed as a double to a float parameter.
* **Layout.**  Each argument sits at the next offset aligned to its own
  alignment (programming guide, "Kernel Execution"); vector types use their
  device alignment (float2: 8, float4: 16).
* **Conventions.**  ``convention="params"`` passes ``kernelParams`` (an array
  of pointers into the packed block); ``"buffer"`` passes the block through
  ``CU_LAUNCH_PARAM_BUFFER_POINTER`` / ``CU_LAUNCH_PARAM_BUFFER_SIZE``.
* **Checks.**  Where the driver reports parameter offsets and sizes
  (cuFuncGetParamInfo / cuKernelGetParamInfo), a wrong count or size raises
  before launch.
* **Prepare once, launch many.**  :class:`PreparedLaunch` owns the packed
  buffer and the argument array; a call only stores the new values and calls
  the driver.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ._cffi_abi import ffi
from ._header_data import DEFINES
from ._support import get_driver, invalid
from .stream import stream_handle

# Vector types: (component C type, count, device alignment) per the CUDA headers' __align__.
VECTOR_TYPES = {
    "char2": ("int8_t", 2, 2), "uchar2": ("uint8_t", 2, 2), "char4": ("int8_t", 4, 4), "uchar4": ("uint8_t", 4, 4),
    "short2": ("int16_t", 2, 4), "ushort2": ("uint16_t", 2, 4), "short4": ("int16_t", 4, 8),
    "ushort4": ("uint16_t", 4, 8), "int2": ("int32_t", 2, 8), "uint2": ("uint32_t", 2, 8),
    "int4": ("int32_t", 4, 16), "uint4": ("uint32_t", 4, 16), "float2": ("float", 2, 8),
    "float4": ("float", 4, 16), "double2": ("double", 2, 16), "longlong2": ("int64_t", 2, 16),
}
_SCALAR_ALIASES = {"char": "int8_t", "signed char": "int8_t", "unsigned char": "uint8_t", "short": "int16_t",
                   "unsigned short": "uint16_t", "int": "int32_t", "unsigned int": "uint32_t",
                   "unsigned": "uint32_t", "long long": "int64_t", "unsigned long long": "uint64_t",
                   "long": "int64_t", "unsigned long": "uint64_t", "size_t": "uint64_t", "bool": "uint8_t",
                   "CUdeviceptr": "uint64_t"}
_PARAM_BUFFER_POINTER = ffi.cast("void *", DEFINES["CU_LAUNCH_PARAM_BUFFER_POINTER"])
_PARAM_BUFFER_SIZE = ffi.cast("void *", DEFINES["CU_LAUNCH_PARAM_BUFFER_SIZE"])
_PARAM_END = ffi.cast("void *", DEFINES["CU_LAUNCH_PARAM_END"])
_NUMPY_KINDS = {("i", 1): "int8_t", ("i", 2): "int16_t", ("i", 4): "int32_t", ("i", 8): "int64_t",
                ("u", 1): "uint8_t", ("u", 2): "uint16_t", ("u", 4): "uint32_t", ("u", 8): "uint64_t",
                ("f", 4): "float", ("f", 8): "double", ("b", 1): "uint8_t"}


class ArgType:
    """How one parameter is laid out and written: size, alignment, and a writer into the packed block."""

    __slots__ = ("name", "size", "align", "kind", "ctype", "count")

    def __init__(self, name: str, size: int, align: int, kind: str, ctype: str | None = None,
                 count: int = 1) -> None:
        self.name, self.size, self.align, self.kind, self.ctype, self.count = name, size, align, kind, ctype, count

    def __repr__(self) -> str:
        return f"ArgType({self.name!r}, size={self.size}, align={self.align})"


def arg_type(spec: Any) -> ArgType:
    """An ArgType from a signature entry: a C type string, a NumPy (structured) dtype, or a cffi ctype."""
    if isinstance(spec, ArgType):
        return spec
    if isinstance(spec, str):
        text = " ".join(spec.replace("const ", "").split())
        if text.endswith("*"):
            return ArgType(text, 8, 8, "pointer", "uint64_t")
        if text in VECTOR_TYPES:
            comp, count, align = VECTOR_TYPES[text]
            return ArgType(text, ffi.sizeof(comp) * count, align, "vector", comp, count)
        ctype = _SCALAR_ALIASES.get(text, text)
        try:
            return ArgType(text, ffi.sizeof(ctype), ffi.alignof(ctype), "scalar", ctype)
        except ffi.error:
            raise invalid("cuLaunchKernel", f"unknown parameter type {spec!r}") from None
    if isinstance(spec, ffi.CType):
        return ArgType(spec.cname, ffi.sizeof(spec), ffi.alignof(spec), "bytes")
    dtype = getattr(spec, "dtype", spec)
    if hasattr(dtype, "itemsize") and hasattr(dtype, "alignment"):
        if dtype.fields is None and (dtype.kind, dtype.itemsize) in _NUMPY_KINDS:
            return arg_type(_NUMPY_KINDS[(dtype.kind, dtype.itemsize)])
        return ArgType(str(dtype), dtype.itemsize, dtype.alignment, "bytes")
    raise invalid("cuLaunchKernel", f"cannot tell the C type of signature entry {spec!r}")


def infer_type(value: Any) -> ArgType:
    """The ArgType a value carries by itself; Python ints and floats carry none."""
    if type(value) in (bool, int, float):  # exact: numpy.float64 subclasses float but knows its C type
        raise invalid("cuLaunchKernel", f"the argument {value!r} is a plain Python {type(value).__name__}: give "
                                        "a signature (kernel.prepare([...]) or signature=[...]) or a NumPy scalar "
                                        "such as numpy.float32(x), so its exact C type is known")
    if _device_address(value) is not None:
        return ArgType("void*", 8, 8, "pointer", "uint64_t")
    if isinstance(value, ffi.CData):
        return arg_type(ffi.typeof(value))
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        return arg_type(dtype)
    raise invalid("cuLaunchKernel", f"cannot pass a {type(value).__name__} as a kernel argument")


def _device_address(value: Any) -> int | None:
    ptr = getattr(value, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    if hasattr(value, "__dlpack__") and hasattr(value, "data_ptr"):
        return int(value.data_ptr())
    return None


def layout(types: Sequence[ArgType]) -> tuple[list[int], int]:
    """Offsets per the guide: each argument aligned to its own alignment; returns (offsets, total)."""
    offsets, offset = [], 0
    for t in types:
        offset = (offset + t.align - 1) // t.align * t.align
        offsets.append(offset)
        offset += t.size
    return offsets, offset


def _writer(t: ArgType, address: Any) -> Callable[[Any], None]:
    """A function storing one value at ``address`` (a char* into the packed block)."""
    if t.kind == "scalar":
        slot = ffi.cast(t.ctype + " *", address)

        def write(value: Any) -> None:
            slot[0] = value.item() if hasattr(value, "item") and not isinstance(value, ffi.CData) else value
        return write
    if t.kind == "pointer":
        slot = ffi.cast("uint64_t *", address)

        def write(value: Any) -> None:
            if isinstance(value, int):
                slot[0] = value
                return
            if isinstance(value, ffi.CData):
                slot[0] = int(ffi.cast("uintptr_t", value))
                return
            ptr = _device_address(value)
            if ptr is None:
                raise invalid("cuLaunchKernel", f"parameter {t.name} needs a device pointer, got "
                                                f"{type(value).__name__}")
            slot[0] = ptr
        return write
    if t.kind == "vector":
        slot = ffi.cast(t.ctype + " *", address)
        count = t.count

        def write(value: Any) -> None:
            items = list(value)
            if len(items) != count:
                raise invalid("cuLaunchKernel", f"{t.name} takes {count} components, got {len(items)}")
            for i, v in enumerate(items):
                slot[i] = v.item() if hasattr(v, "item") else v
        return write

    def write_bytes(value: Any) -> None:
        data = _struct_bytes(value)
        if len(data) != t.size:
            raise invalid("cuLaunchKernel", f"{t.name} is {t.size} bytes, the value is {len(data)}")
        ffi.memmove(address, data, t.size)
    return write_bytes


def _struct_bytes(value: Any) -> bytes:
    if isinstance(value, ffi.CData):
        return bytes(ffi.buffer(ffi.addressof(value) if ffi.typeof(value).kind in ("struct", "union") else value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if hasattr(value, "tobytes"):
        return value.tobytes()
    raise invalid("cuLaunchKernel", f"cannot pass a {type(value).__name__} as a struct")


def _dims(value: Any, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, int) or d < 1 for d in dims):
        raise invalid("cuLaunchKernel", f"{what} must be a positive int or a tuple of 1-3 positive ints, got {value!r}")
    return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]


class PackedArgs:
    """A packed argument block, its kernelParams array and its ``extra`` array, built once."""

    def __init__(self, types: Sequence[ArgType]) -> None:
        self.types = list(types)
        self.offsets, self.size = layout(self.types)
        self.block = ffi.new("char[]", max(self.size, 1))
        self.writers = [_writer(t, self.block + off) for t, off in zip(self.types, self.offsets)]
        self.params = ffi.new("void *[]", [self.block + off for off in self.offsets] or [ffi.NULL])
        self._size = ffi.new("size_t *", self.size)
        self.extra = ffi.new("void *[]", [_PARAM_BUFFER_POINTER, self.block, _PARAM_BUFFER_SIZE, self._size,
                                         _PARAM_END])

    def fill(self, values: Sequence[Any]) -> None:
        if len(values) != len(self.writers):
            raise invalid("cuLaunchKernel", f"the kernel takes {len(self.writers)} arguments, got {len(values)}")
        for write, value in zip(self.writers, values):
            write(value)


def check_signature(function: Any, packed: PackedArgs) -> None:
    """Compare our layout with the driver's parameter info, where the driver has it."""
    info = function.param_info()
    if info is None:
        return
    if len(info) != len(packed.types):
        raise invalid("cuLaunchKernel", f"{function.name} takes {len(info)} parameters; "
                                        f"{len(packed.types)} were given")
    for i, ((offset, size), t, ours) in enumerate(zip(info, packed.types, packed.offsets)):
        if size != t.size or offset != ours:
            raise invalid("cuLaunchKernel", f"{function.name} parameter {i} is {size} bytes at offset {offset}; "
                                            f"the argument given ({t.name}) is {t.size} bytes at offset {ours}")


class PreparedLaunch:
    """A kernel bound to its signature, grid, block and stream; calling it launches with new values.

    ``launcher(*args)`` writes the values into the reused packed block and calls
    cuLaunchKernel (raising CudaError on failure).  Nothing else is built per call.
    """

    def __init__(self, function: Any, signature: Sequence[Any], grid: Any = 1, block: Any = 1, *,
                 shared_mem: int = 0, stream: Any = None, convention: str = "buffer") -> None:
        if convention not in ("buffer", "params"):
            raise invalid("cuLaunchKernel", f"convention is 'buffer' or 'params', not {convention!r}")
        self.function = function
        self.driver = drv = get_driver(function.driver)
        self.packed = packed = PackedArgs([arg_type(s) for s in signature])
        check_signature(function, packed)
        gx, gy, gz = _dims(grid, "grid")
        bx, by, bz = _dims(block, "block")
        params, extra = (ffi.NULL, packed.extra) if convention == "buffer" else (packed.params, ffi.NULL)
        self._call = (function.handle, gx, gy, gz, bx, by, bz, shared_mem, stream_handle(stream, drv), params, extra)
        self._launch = drv.cuLaunchKernel
        self._writers = packed.writers
        self._error = drv.error

    def __call__(self, *args: Any) -> None:
        if len(args) != len(self._writers):
            raise invalid("cuLaunchKernel", f"{self.function.name} takes {len(self._writers)} arguments, "
                                            f"got {len(args)}")
        for write, value in zip(self._writers, args):
            write(value)
        rc = self._launch(*self._call)
        if rc:
            raise self._error(rc, "cuLaunchKernel")


_launch_cache: dict[tuple, PackedArgs] = {}


def launch(function: Any, grid: Any, block: Any, args: Sequence[Any] = (), *, signature: Sequence[Any] | None = None,
           shared_mem: int = 0, stream: Any = None, convention: str = "params", cooperative: bool = False) -> None:
    """Launch once (cuLaunchKernel, or cuLaunchCooperativeKernel with ``cooperative=True``)."""
    drv = get_driver(function.driver)
    types = [arg_type(s) for s in signature] if signature is not None else [infer_type(a) for a in args]
    key = (id(function), tuple((t.name, t.size, t.align, t.kind) for t in types))
    packed = _launch_cache.get(key)
    if packed is None:
        packed = PackedArgs(types)
        check_signature(function, packed)
        if len(_launch_cache) > 256:
            _launch_cache.clear()
        _launch_cache[key] = packed
    packed.fill(args)
    g, b = _dims(grid, "grid"), _dims(block, "block")
    h = stream_handle(stream, drv)
    if cooperative:
        drv.checked.cuLaunchCooperativeKernel(function.handle, *g, *b, shared_mem, h, packed.params)
    elif convention == "buffer":
        drv.checked.cuLaunchKernel(function.handle, *g, *b, shared_mem, h, ffi.NULL, packed.extra)
    else:
        drv.checked.cuLaunchKernel(function.handle, *g, *b, shared_mem, h, packed.params, ffi.NULL)


def launch_ex(function: Any, grid: Any, block: Any, args: Sequence[Any] = (), *,
              signature: Sequence[Any] | None = None, shared_mem: int = 0, stream: Any = None,
              cluster: Any = None, cooperative: bool = False, priority: int | None = None) -> None:
    """cuLaunchKernelEx with launch attributes: cluster dimensions, cooperative, priority."""
    drv = get_driver(function.driver)
    types = [arg_type(s) for s in signature] if signature is not None else [infer_type(a) for a in args]
    packed = PackedArgs(types)
    check_signature(function, packed)
    packed.fill(args)
    attrs = []
    if cluster is not None:
        attrs.append(("CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION", _dims(cluster, "cluster")))
    if cooperative:
        attrs.append(("CU_LAUNCH_ATTRIBUTE_COOPERATIVE", 1))
    if priority is not None:
        attrs.append(("CU_LAUNCH_ATTRIBUTE_PRIORITY", priority))
    array = ffi.new("CUlaunchAttribute[]", max(len(attrs), 1))
    ids = ffi.typeof("CUlaunchAttributeID").relements
    for slot, (name, value) in zip(array, attrs):
        slot.id = ids[name]
        if name.endswith("CLUSTER_DIMENSION"):
            slot.value.clusterDim.x, slot.value.clusterDim.y, slot.value.clusterDim.z = value
        elif name.endswith("COOPERATIVE"):
            slot.value.cooperative = value
        else:
            slot.value.priority = value
    config = ffi.new("CUlaunchConfig *")
    config.gridDimX, config.gridDimY, config.gridDimZ = _dims(grid, "grid")
    config.blockDimX, config.blockDimY, config.blockDimZ = _dims(block, "block")
    config.sharedMemBytes = shared_mem
    config.hStream = stream_handle(stream, drv)
    config.attrs = array
    config.numAttrs = len(attrs)
    drv.checked.cuLaunchKernelEx(config, function.handle, packed.params, ffi.NULL)


def pack_bytes(signature: Sequence[Any], values: Sequence[Any]) -> bytes:
    """The packed argument block for ``values`` (for inspection and tests)."""
    packed = PackedArgs([arg_type(s) for s in signature])
    packed.fill(values)
    return bytes(ffi.buffer(packed.block, packed.size))


__all__ = ["ArgType", "PackedArgs", "PreparedLaunch", "arg_type", "infer_type", "launch", "launch_ex", "layout",
           "pack_bytes"]
