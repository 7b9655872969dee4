"""Kernel launch: argument packing, both cuLaunchKernel conventions, cuLaunchKernelEx, cooperative.

Policy
------
* **Exact C types.**  Arguments are packed by a signature (``["float*", "int",
  "float"]``) or, without one, from values that carry their C type: NumPy
  scalars, cuproc buffers / ``__cuda_array_interface__`` / DLPack objects
  (pointers), NumPy structured scalars and cffi structs (structs).  A bare
  Python ``int`` or ``float`` without a signature is refused: a float is never
  silently passed as a double to a float parameter.  A ``CUdeviceptr``
  parameter is a device pointer, as ``T*`` is: it takes the same values.
* **Layout.**  Each argument sits where the kernel reads it.  Where the driver
  reports parameter offsets (cuFuncGetParamInfo / cuKernelGetParamInfo, CUDA
  12.4+), those: the compiler aligns a parameter at its address in constant
  bank 0, where the parameters start at 0x160, 0x210 or 0x380 depending on the
  architecture, so a 64-aligned struct (a ``CUtensorMap``) after an ``int`` is
  at offset 48 on sm_90, not 64.  Otherwise each argument sits at the next
  offset aligned to its own alignment (programming guide, "Kernel
  Execution"), which agrees with every architecture up to 16-byte alignment;
  vector types use their device alignment (float2: 8, float4: 16).
* **Conventions.**  ``convention="params"`` passes ``kernelParams`` (an array
  of pointers into the packed block); ``"buffer"`` passes the block through
  ``CU_LAUNCH_PARAM_BUFFER_POINTER`` / ``CU_LAUNCH_PARAM_BUFFER_SIZE``.
* **Checks.**  Where the driver reports parameter offsets and sizes, a wrong
  count or size raises before launch.  Where it cannot, a ``"buffer"`` launch
  of a parameter aligned beyond 16 bytes is refused (its offset in the kernel
  is unknown): ``"params"`` lets the driver place each value.
* **Prepare once, launch many.**  :class:`PreparedLaunch` owns the packed
  buffer and the argument array; a call only stores the new values and calls
  the driver.  With the compiled fast path (:mod:`cuproc.fastpath`) and
  pointer/scalar arguments, the stores and the call happen in C, in front of
  the generated Python launcher, which takes every call the C one does not.
* **One-shot launches** (:func:`launch`, ``Function.launch``) keep a PreparedLaunch per argument
  types, stream, convention and entry on the function; grid, block and shared memory are not part of
  it but arguments of its launcher, checked and stored with each call (``grid = ceil(n / block)`` for
  a new ``n`` costs what a warm launch costs).  With the fast path, a C front finds a warm entry of
  the common form (``signature=``, ``stream=`` and ``shared_mem=`` at most) and calls its launcher;
  every other call, and any entry to check again, goes through the Python function with all its checks.
"""
from __future__ import annotations

import functools
import operator
import re
import threading
import weakref
from typing import Any, Callable, Sequence

from . import fastpath
from ._ffi import ffi
from ._header_data import DEFINES
from ._resource import EPOCH, FORKED, Resource
from ._support import get_driver, invalid
from .context import Context, call_in
from .driver import Driver, forked_error
from .errors import CudaError, result_code
from .interop import KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED
from .stream import Stream, as_stream, stream_handle

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
                   "long": "int64_t", "unsigned long": "uint64_t", "size_t": "uint64_t", "bool": "uint8_t"}
# The driver API's name for a device address (a 64-bit integer type in cuda.h; CUdeviceptr_v2 is the same type):
# C driver-API code declares kernel pointers so, and such a parameter takes what ``T*`` takes -- a DeviceBuffer,
# a view, a __cuda_array_interface__ or DLPack object, an int -- with the same liveness checks.
_DEVICE_POINTER_TYPES = frozenset({"CUdeviceptr", "CUdeviceptr_v2"})
_PARAM_BUFFER_POINTER = ffi.cast("void *", DEFINES["CU_LAUNCH_PARAM_BUFFER_POINTER"])
_PARAM_BUFFER_SIZE = ffi.cast("void *", DEFINES["CU_LAUNCH_PARAM_BUFFER_SIZE"])
_PARAM_END = ffi.cast("void *", DEFINES["CU_LAUNCH_PARAM_END"])
_CONTEXT_ERRORS = (result_code("CUDA_ERROR_INVALID_CONTEXT"), result_code("CUDA_ERROR_INVALID_HANDLE"),
                   result_code("CUDA_ERROR_CONTEXT_IS_DESTROYED"))   # what Context.call rebinds on
_NUMPY_KINDS = {("i", 1): "int8_t", ("i", 2): "int16_t", ("i", 4): "int32_t", ("i", 8): "int64_t",
                ("u", 1): "uint8_t", ("u", 2): "uint16_t", ("u", 4): "uint32_t", ("u", 8): "uint64_t",
                ("f", 4): "float", ("f", 8): "double", ("b", 1): "uint8_t"}


class ArgType:
    """How one parameter is laid out and written: size, alignment, and a writer into the packed block.

    ``offset``: where the kernel reads it, as the driver reported it for one function (:meth:`at`); None
    packs it at the next multiple of ``align`` (:func:`layout`)."""

    __slots__ = ("name", "size", "align", "kind", "ctype", "count", "offset")

    def __init__(self, name: str, size: int, align: int, kind: str, ctype: str | None = None,
                 count: int = 1, offset: int | None = None) -> None:
        self.name, self.size, self.align, self.kind, self.ctype, self.count = name, size, align, kind, ctype, count
        self.offset = offset

    def at(self, offset: int | None) -> ArgType:
        """This type placed at ``offset`` (None: at its alignment); a new object, so that a signature entry
        given as an ArgType is never changed."""
        return ArgType(self.name, self.size, self.align, self.kind, self.ctype, self.count, offset)

    def __repr__(self) -> str:
        at = "" if self.offset is None else f", offset={self.offset}"
        return f"ArgType({self.name!r}, size={self.size}, align={self.align}{at})"


def arg_type(spec: Any, call: str = "cuLaunchKernel") -> ArgType:
    """An ArgType from a signature entry: a C type string, a NumPy (structured) dtype, or a cffi ctype.
    ``call``: the launch a refusal names (the driver call the launch would have made)."""
    if isinstance(spec, ArgType):
        return spec
    if isinstance(spec, str):
        text = " ".join(spec.replace("const ", "").split())
        if text.endswith("*") or text in _DEVICE_POINTER_TYPES:
            return ArgType(text, 8, 8, "pointer", "uint64_t")
        if text in VECTOR_TYPES:
            comp, count, align = VECTOR_TYPES[text]
            return ArgType(text, ffi.sizeof(comp) * count, align, "vector", comp, count)
        ctype = _SCALAR_ALIASES.get(text, text)
        try:
            return ArgType(text, ffi.sizeof(ctype), ffi.alignof(ctype), "scalar", ctype)
        except ffi.error:
            raise invalid(call, f"unknown parameter type {spec!r}") from None
    if isinstance(spec, ffi.CType):
        return ArgType(spec.cname, ffi.sizeof(spec), ffi.alignof(spec), "bytes")
    dtype = getattr(spec, "dtype", spec)
    if hasattr(dtype, "itemsize") and hasattr(dtype, "alignment"):
        if dtype.fields is None and (dtype.kind, dtype.itemsize) in _NUMPY_KINDS:
            return arg_type(_NUMPY_KINDS[(dtype.kind, dtype.itemsize)], call)
        return ArgType(str(dtype), dtype.itemsize, dtype.alignment, "bytes")
    raise invalid(call, f"cannot tell the C type of signature entry {spec!r}")


def infer_type(value: Any, call: str = "cuLaunchKernel", index: int | None = None) -> ArgType:
    """The ArgType a value carries by itself; Python ints and floats carry none.  ``call`` as for
    :func:`arg_type`; ``index``: the argument's position, which a refusal names."""
    if type(value) in (bool, int, float):  # exact: numpy.float64 subclasses float but knows its C type
        raise invalid(call, f"the argument {value!r} is a plain Python {type(value).__name__}: give "
                            "a signature (kernel.prepare([...]) or signature=[...]) or a NumPy scalar "
                            "such as numpy.float32(x), so its exact C type is known")
    if _device_address(value, call) is not None:
        return ArgType("void*", 8, 8, "pointer", "uint64_t")
    if isinstance(value, ffi.CData):
        return arg_type(ffi.typeof(value), call)
    if _has_dims(value):
        raise _host_array(value, call, "the argument" if index is None else f"argument {index}")
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        return arg_type(dtype, call)
    raise invalid(call, f"cannot pass a {type(value).__name__} as a kernel argument")


def _has_dims(value: Any) -> bool:
    """Whether ``value`` is an array-like with one dimension or more (its ``ndim`` an int above 0): a NumPy
    array, a tensor.  A scalar (NumPy's have ``ndim`` 0), anything without ``ndim`` or with an ``ndim`` that
    is not an int, or that raises, is not."""
    try:
        ndim = value.ndim
    except Exception:   # noqa: BLE001 - a broken or missing attribute: not an array
        return False
    return type(ndim) is int and ndim > 0


def _host_array(value: Any, call: str, where: str) -> Exception:
    """The refusal of an array (``ndim`` of 1 or more) that is not device memory -- a NumPy array, a CPU
    tensor -- as a kernel argument: its bytes are on the host, where a kernel cannot read them (one of a
    single element would otherwise pass as its element's scalar, or as an address made of its bits)."""
    return invalid(call, f"{where} is a host array ({type(value).__name__} of shape {getattr(value, 'shape', '?')}), "
                         f"which a kernel cannot read: copy it into device memory (a DeviceBuffer and "
                         f"memory.copy) and pass that, or pass a scalar (numpy.float32(x), arr[()] ...)")


def _device_address(value: Any, call: str) -> int | None:
    """The device address ``value`` stands for (a cuproc allocation or view, a CAI or DLPack object), or
    None.  A ``ptr`` that refuses (a freed buffer, a view of one) raises its refusal renamed for ``call``,
    the launch: read first, so that a live argument pays nothing for it."""
    try:
        ptr = getattr(value, "ptr", None)
    except CudaError as exc:
        if exc.refused:
            raise exc.renamed(call) from None
        raise
    if isinstance(ptr, int):
        return ptr
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    if hasattr(value, "__dlpack__") and hasattr(value, "data_ptr"):
        # (a tensor such as torch's: an address the device can use only for memory on a CUDA device, pinned
        # or managed; a CPU tensor's is host memory)
        device = value.__dlpack_device__()[0] if hasattr(value, "__dlpack_device__") else None
        if device in (KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED):
            return int(value.data_ptr())
    return None


def layout(types: Sequence[ArgType]) -> tuple[list[int], int]:
    """(offsets, total size) of a packed block: each argument at its ``offset`` where the driver placed it
    (:func:`placed_types`), else per the guide, at the next multiple of its own alignment."""
    offsets, offset, end = [], 0, 0
    for t in types:
        offset = (offset + t.align - 1) // t.align * t.align if t.offset is None else t.offset
        offsets.append(offset)
        offset += t.size
        end = max(end, offset)
    return offsets, end


def _writer(t: ArgType, address: Any, call: str, index: int = 0) -> Callable[[Any], None]:
    """A function storing one value at ``address`` (a char* into the packed block); its refusals name
    ``call``, the launch's driver call, and the argument (``index``, its C type).  A value's own protocol
    failing (a NumPy array's ``__index__`` or ``item``, a sequence's length) is refused the same way."""
    where = f"argument {index} ({t.name})"
    if t.kind == "scalar":
        slot = ffi.cast(t.ctype + " *", address)

        def write(value: Any) -> None:
            if type(value) not in (int, float) and not isinstance(value, ffi.CData):
                if _has_dims(value):
                    raise _host_array(value, call, where)
                if hasattr(value, "item"):
                    _typed_class(value)    # a NumPy scalar class: generated launchers store it directly from now on
                    value = value.item()   # NumPy scalar: its exact value, then cffi's range check
            try:
                slot[0] = value
            except (TypeError, OverflowError) as exc:
                raise invalid(call, f"{where} cannot take {value!r}: {exc}") from None
        return write
    if t.kind == "pointer":
        slot = ffi.cast("uint64_t *", address)

        def write(value: Any) -> None:
            if not isinstance(value, int) and hasattr(value, "__index__") and _device_address(value, call) is None:
                if _has_dims(value):
                    raise _host_array(value, call, where)
                try:
                    value = value.__index__()   # a NumPy integer holding an address
                except (TypeError, ValueError) as exc:
                    raise invalid(call, f"{where} needs a device address, got {type(value).__name__}: {exc}") \
                        from None
            if isinstance(value, int):
                if not 0 <= value < 1 << 64:
                    raise invalid(call, f"{where} needs a device address, got {value}")
                slot[0] = value
                return
            if isinstance(value, ffi.CData):
                slot[0] = int(ffi.cast("uintptr_t", value))
                return
            ptr = _device_address(value, call)
            if ptr is None:
                if _has_dims(value):
                    raise _host_array(value, call, where)
                raise invalid(call, f"{where} needs a device pointer, got {type(value).__name__}")
            slot[0] = ptr
        return write
    if t.kind == "vector":
        slot = ffi.cast(t.ctype + " *", address)
        count = t.count

        def write(value: Any) -> None:
            try:
                items = list(value)
            except TypeError as exc:
                raise invalid(call, f"{where} takes {count} components, got {type(value).__name__}: {exc}") \
                    from None
            if len(items) != count:
                raise invalid(call, f"{where} takes {count} components, got {len(items)}")
            for i, v in enumerate(items):
                try:
                    slot[i] = v.item() if hasattr(v, "item") else v
                except (TypeError, ValueError, OverflowError) as exc:
                    raise invalid(call, f"{where}, component {i}, cannot take {v!r}: {exc}") from None
        return write

    def write_bytes(value: Any) -> None:
        data = _struct_bytes(value, call)
        if len(data) != t.size:
            raise invalid(call, f"{where} is {t.size} bytes, the value is {len(data)}")
        ffi.memmove(address, data, t.size)
    return write_bytes


def _struct_bytes(value: Any, call: str) -> bytes:
    if isinstance(value, ffi.CData):
        return bytes(ffi.buffer(ffi.addressof(value) if ffi.typeof(value).kind in ("struct", "union") else value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if hasattr(value, "tobytes"):
        return value.tobytes()
    raise invalid(call, f"cannot pass a {type(value).__name__} as a struct")


def _whole(value: Any) -> int:
    """``value`` as a Python int when it is an integer (an int, a NumPy integer); TypeError for
    anything else, bool included (``True`` is no grid size)."""
    if value.__class__ is bool:
        raise TypeError("bool")
    return operator.index(value)


_UINT_MAX = 0xFFFFFFFF   # every dimension and the shared memory size are unsigned ints in the driver's calls


def _dims(value: Any, what: str, call: str) -> tuple[int, int, int]:
    """Grid or block dimensions as three Python ints.  Integers of any integer type (NumPy's too)
    are taken; a float or bool is refused, never rounded or read as 1, and so is a dimension beyond
    an unsigned int.  ``call``: the driver call the refusal names (the one the launch would have made)."""
    try:
        dims = (_whole(value),) if hasattr(value, "__index__") else tuple(_whole(d) for d in value)
    except TypeError:
        dims = ()
    if not 1 <= len(dims) <= 3 or any(not 1 <= d <= _UINT_MAX for d in dims):
        raise invalid(call, f"{what} must be a positive int or a tuple of 1-3 positive ints (each below 2**32), "
                            f"got {value!r}")
    return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]


def _shared_mem(value: Any, call: str) -> int:
    """The dynamic shared memory size as a Python int (NumPy integers taken; floats and bools refused);
    ``call`` as for :func:`_dims`."""
    try:
        size = _whole(value)
    except TypeError:
        size = -1
    if not 0 <= size <= _UINT_MAX:
        raise invalid(call, f"shared_mem must be a non-negative int below 2**32, got {value!r}")
    return size


def _call_dims(grid: Any, block: Any, shared_mem: Any, call: str) -> tuple[int, ...]:
    """(gx, gy, gz, bx, by, bz, shared_mem) of one launch, checked (refusals name ``call``): a launcher
    that takes its dimensions with each call (a one-shot entry, see :func:`launch`) starts with this."""
    if grid.__class__ is int and block.__class__ is int and shared_mem.__class__ is int \
            and 0 < grid <= _UINT_MAX and 0 < block <= _UINT_MAX and 0 <= shared_mem <= _UINT_MAX:
        return (grid, 1, 1, block, 1, 1, shared_mem)
    return (*_dims(grid, "grid", call), *_dims(block, "block", call), _shared_mem(shared_mem, call))


def _store_dims(config: Any, dims: tuple[int, ...]) -> None:
    """Write (gx, gy, gz, bx, by, bz, shared_mem) into a CUlaunchConfig."""
    (config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.blockDimY, config.blockDimZ,
     config.sharedMemBytes) = dims


class PackedArgs:
    """A packed argument block, its kernelParams array and its ``extra`` array, built once.  ``call``: the
    launch's driver call, which its refusals name."""

    def __init__(self, types: Sequence[ArgType], call: str = "cuLaunchKernel") -> None:
        self.call = call
        self.types = list(types)
        self.offsets, self.size = layout(self.types)
        self.block = ffi.new("char[]", max(self.size, 1))
        self.writers = [_writer(t, self.block + off, call, i)
                        for i, (t, off) in enumerate(zip(self.types, self.offsets))]
        self.params = ffi.new("void *[]", [self.block + off for off in self.offsets] or [ffi.NULL])
        self._size = ffi.new("size_t *", self.size)
        self.extra = ffi.new("void *[]", [_PARAM_BUFFER_POINTER, self.block, _PARAM_BUFFER_SIZE, self._size,
                                         _PARAM_END])

    def fill(self, values: Sequence[Any]) -> None:
        if len(values) != len(self.writers):
            raise invalid(self.call, f"the kernel takes {len(self.writers)} arguments, got {len(values)}")
        for write, value in zip(self.writers, values):
            write(value)


#: The alignment up to which packing from offset 0 agrees with every architecture's kernels: the parameters
#: start in constant bank 0 at a multiple of 16 (0x160 on sm_75/sm_80, 0x210 on sm_90, 0x380 on sm_100/sm_120),
#: and the compiler aligns each at its address there.
_BANK_SAFE_ALIGNMENT = 16


def placed_types(function: Any, types: Sequence[ArgType], call: str, convention: str) -> list[ArgType]:
    """``types`` placed where ``function``'s kernel reads them: at the offsets the driver reports
    (cuFuncGetParamInfo / cuKernelGetParamInfo, asked once, when a launch is prepared), after refusing a
    wrong count or size.  Where the driver cannot say, at their natural alignment -- which a
    ``convention="buffer"`` launch cannot trust for a parameter aligned beyond 16 bytes (the driver copies
    the buffer as it is, and sm_90 reads a 64-aligned struct after an int at 48, not 64: a device fault), so
    that is refused, naming the kernel.  Refusals name ``call``."""
    info = function.param_info()
    if info is None:
        if convention == "buffer":
            for i, t in enumerate(types):
                if t.align > _BANK_SAFE_ALIGNMENT:
                    raise invalid(call, f"{function.name} parameter {i} ({t.name}) is aligned to {t.align} bytes, "
                                        f"and this driver cannot say where the kernel reads it (cuFuncGetParamInfo "
                                        f"/ cuKernelGetParamInfo: CUDA 12.4): the packed buffer could put it "
                                        f"elsewhere; launch with convention='params' (the driver places each "
                                        f"argument) or update the driver")
        return [t.at(None) for t in types]
    if len(info) != len(types):
        raise invalid(call, f"{function.name} takes {len(info)} parameters; {len(types)} were given")
    for i, ((_, size), t) in enumerate(zip(info, types)):
        if size != t.size:
            raise invalid(call, f"{function.name} parameter {i} is {size} bytes; the argument given ({t.name}) is "
                                f"{t.size} bytes")
    return [t.at(offset) for (offset, _), t in zip(info, types)]


class PreparedLaunch:
    """A kernel bound to its signature, grid, block and stream: the checks and the packing, once.

    Its :attr:`launch` is a function generated for this signature (see
    :func:`_launcher_source`): ``launch(*args)`` stores the new values into the reused
    packed block and calls the driver, raising CudaError on failure.  The common values
    (a Python int or float, a cuproc buffer) cost one cffi store each; anything else
    takes the general writer with its checks and messages.  ``Function.prepare``
    returns that function itself: any callable object in front of it costs 40-100 ns
    per launch, a few percent of the whole (benchmarks/results).

    The launch function holds what every launch needs -- the function, its module and
    context, the stream -- and nothing holds it back (no reference cycle: dropping it
    releases the stream and the module at once).  It carries ``entry``, ``convention``,
    ``grid``, ``block``, ``function`` and ``stream`` as attributes, and ``prepared``: this
    PreparedLaunch's state, reaching the launch function weakly (:class:`_LauncherPrepared`).

    Threads: the packed block belongs to the first thread that launches; any other thread
    launches with a block of its own, made once per thread (slower: the general writers; never
    shared).  Prepare per thread for speed.

    ``entry=None`` picks cuLaunchKernelEx where the requested version has it: the same
    driver work as cuLaunchKernel (the C loops over both in bench_launch) with the
    configuration built once, so each call converts four arguments instead of eleven.

    ``cached=True``: a one-shot entry kept on the function by :func:`launch`.  It holds neither
    the function nor the stream, and its launcher takes the dimensions with each call --
    ``launch(grid, block, shared_mem, *args)``, checked per call (refusals name the entry) -- so
    one entry serves every grid; ``grid``, ``block`` and ``shared_mem`` given here are not used.
    """

    def __init__(self, function: Any, signature: Sequence[Any], grid: Any = 1, block: Any = 1, *,
                 shared_mem: int = 0, stream: Any = None, convention: str = "buffer",
                 entry: str | None = None, cached: bool = False) -> None:
        if hasattr(function, "launch_target"):   # a per-context Kernel binds to the current context's function
            function = function.launch_target()
        self.function = function
        self.driver = drv = get_driver(function.driver)
        if entry is None:
            entry = default_entry(drv)
        if entry not in ("cuLaunchKernel", "cuLaunchKernelEx"):
            raise invalid(default_entry(drv), f"entry is 'cuLaunchKernel' or 'cuLaunchKernelEx', not {entry!r}")
        if convention not in ("buffer", "params"):
            raise invalid(entry, f"convention is 'buffer' or 'params', not {convention!r}")
        function.check(entry)
        types = placed_types(function, [arg_type(s, entry) for s in signature], entry, convention)
        self.packed = PackedArgs(types, entry)
        self.grid: tuple[int, int, int] | None = None    # None: given with each call (a one-shot entry)
        self.block: tuple[int, int, int] | None = None
        self.shared_mem: int | None = None
        self.convention, self.entry = convention, entry
        if not cached:
            self.grid, self.block = _dims(grid, "grid", entry), _dims(block, "block", entry)
            self.shared_mem = _shared_mem(shared_mem, entry)
            stream = as_stream(stream, entry, driver=drv)   # another library's stream: held, not owned
        self.stream = stream_handle(stream, drv, entry)
        self.stream_object = stream if isinstance(stream, Stream) else None
        self.config = None
        if entry == "cuLaunchKernelEx":   # the whole launch configuration in one struct, built once
            self.config, self._config_attrs = _launch_config(self.grid or (1, 1, 1), self.block or (1, 1, 1),
                                                             self.shared_mem or 0, self.stream, [])
        # ``cached``: a one-shot launch remembered on the function itself (cuproc.launch.launch).  It must
        # hold neither the function (a cycle through the function's cache) nor the stream or the stream's
        # context (the caller passes the stream, alive, on every call).
        self.launch = _compile_launcher(self, getattr(drv, entry), drv.error, cached)

    def fixed_arguments(self, packed: PackedArgs | None = None) -> tuple[Any, ...]:
        """The driver call's arguments for an argument block (default: the shared one).  With
        cuLaunchKernelEx the dimensions are in the config; cuLaunchKernel needs fixed ones."""
        packed = packed if packed is not None else self.packed
        params = packed.params if self.convention == "params" else ffi.NULL
        extra = packed.extra if self.convention == "buffer" else ffi.NULL
        if self.entry == "cuLaunchKernelEx":
            return (self.config, self.function.handle, params, extra)
        if self.grid is None or self.block is None:
            raise TypeError("a launch taking its dimensions per call has no fixed cuLaunchKernel arguments")
        return (self.function.handle, *self.grid, *self.block, self.shared_mem, self.stream, params, extra)

    def __call__(self, *args: Any) -> None:
        """Convenience; ``self.launch`` (what Function.prepare returns) skips this frame."""
        self.launch(*args)

    def __reduce__(self) -> Any:
        raise TypeError("a PreparedLaunch holds driver handles and cannot be pickled")

    def __repr__(self) -> str:
        dims = "dims per call" if self.grid is None else f"grid={self.grid} block={self.block}"
        return f"<cuproc.PreparedLaunch {self.launch.__name__} {dims} {self.entry}/{self.convention}>"


class _LauncherPrepared(PreparedLaunch):
    """``run.prepared``: the PreparedLaunch a launch function carries (on the pure and the compiled launcher).

    It is the prepared launch's own state -- the same packed block, configuration, function and stream
    objects, the same entry and convention -- but it reaches the launch function (``.launch``) weakly: a
    launch function holding a PreparedLaunch that held it back would be a reference cycle, and dropping
    ``run`` must release its stream and module at once, without the garbage collector.  So it launches
    (``prepared(*args)``, ``prepared.launch``) while ``run`` lives; after that ``.launch`` raises
    ReferenceError.
    """

    _launch_ref: Callable[[], Callable[..., None] | None]

    @classmethod
    def of(cls, prepared: PreparedLaunch, launch: Callable[..., None]) -> _LauncherPrepared:
        """``prepared``'s state (made, ``launch`` not yet stored on it) for its launch function ``launch``."""
        view = cls.__new__(cls)
        view.__dict__.update(prepared.__dict__)
        view.__dict__.pop("launch", None)
        view._launch_ref = weakref.ref(launch)
        return view

    @property
    def launch(self) -> Callable[..., None]:  # type: ignore[override]  # read-only: the function it came from
        launch = self._launch_ref()
        if launch is None:
            raise ReferenceError("the launch function this PreparedLaunch came from (run.prepared) is gone; "
                                 "keep run, or prepare again")
        return launch

    def __repr__(self) -> str:
        if self._launch_ref() is None:
            return f"<cuproc.PreparedLaunch of a dropped launch function, {self.entry}/{self.convention}>"
        return super().__repr__()


def default_entry(driver: Any) -> str:
    """The driver call a launch makes when none is named: cuLaunchKernelEx where the requested version
    has it (see :class:`PreparedLaunch`), else cuLaunchKernel."""
    return "cuLaunchKernelEx" if driver.has("cuLaunchKernelEx", newer_driver_features=False) else "cuLaunchKernel"


def _launch_support(prepared: PreparedLaunch, cu_launch: Any, cached: bool) -> dict[str, Any]:
    """The closures a launcher calls -- verify, private, rebind -- built from values, never from
    ``prepared`` (so the launcher does not keep the PreparedLaunch, and nothing forms a cycle)."""
    function, entry, drv = prepared.function, prepared.entry, prepared.driver
    stream_object = prepared.stream_object
    held: list[Resource] = list(function.ancestors()) + ([] if cached else [function])
    if stream_object is not None and not cached:
        held += [stream_object, *stream_object.ancestors()]
    stream_context_ref = weakref.ref(stream_object.context) if stream_object is not None else None
    if cached:
        stream_object = None          # closures below must not capture it
    resources = tuple(dict.fromkeys(held))
    # The context the launch is bound to: the function's, else the stream's; a library kernel on a
    # default stream launches in the current context.  A cached launch reaches the stream's weakly.
    if function.context is not None:
        bound = function.context
        context_of: Callable[[], Any] = lambda: bound  # noqa: E731
    elif stream_context_ref is not None:
        context_of = stream_context_ref if cached else (lambda ctx=prepared.stream_object.context: ctx)
    else:
        context_of = lambda: None  # noqa: E731
    describe = weakref.ref(function) if cached else (lambda: function)
    seen = [EPOCH[0]]

    def verify() -> None:
        """Raise unless everything the launch holds is usable; called only when some resource ended."""
        epoch = EPOCH[0]
        if FORKED[0]:
            raise forked_error(entry)
        for resource in resources:
            if resource.ended is not None:     # say it from the launch's point of view
                target = describe()
                if target is not None:
                    target.check(entry)
                if stream_object is not None:
                    stream_object.check(entry)
                resource.check(entry)
        seen[0] = epoch

    types, convention, config = prepared.packed.types, prepared.convention, prepared.config
    handle, stream, ex = function.handle, prepared.stream, entry == "cuLaunchKernelEx"
    per_call = prepared.grid is None    # a one-shot entry: the dimensions come with each call
    fixed_dims: tuple[int, ...] = () if prepared.grid is None or prepared.block is None else \
        (*prepared.grid, *prepared.block, prepared.shared_mem or 0)

    from .device_memory import DeviceView, GlobalView
    checked_pointers = (Resource, DeviceView, GlobalView)   # cuproc's device memory: what can end under a launch
    pointer_args = [i for i, t in enumerate(types) if t.kind == "pointer"]

    def recheck(values: Sequence[Any]) -> None:
        """Raise if what this launch holds, or a cuproc object among its pointer values, ended while the values
        were converted: a conversion that ran Python (a value's ``__int__`` freeing a buffer, unloading the
        module) must not send a freed address or an unloaded function to the driver.  A resource that can be
        a parent moves the epoch (:func:`verify`); memory is a leaf, so each pointer value is checked itself."""
        for i in pointer_args:    # (type(), not isinstance: a __class__ property is Python too)
            value = values[i]
            if issubclass(type(value), checked_pointers):
                value.check(entry)
        if EPOCH[0] != seen[0]:   # last: what ran above may have ended something too
            verify()

    blocks = threading.local()    # each other thread's own argument block, made on its first launch

    def private(values: Sequence[Any], grid: Any = None, block: Any = None, shared_mem: Any = None) -> None:
        """One launch with this thread's own argument block, for a thread that found the shared one
        taken (a one-shot entry first launched on another thread of a pool, a launcher shared by
        threads).  The block is made once per thread and goes with the thread; so is the launch
        configuration of a launcher taking grid, block and shared memory with each call."""
        launch_dims = _call_dims(grid, block, shared_mem, entry) if per_call else fixed_dims
        # A launch made while this thread's private launch converts its values (a value's __int__ launching
        # the same kernel) gets a block (and config) of its own, used once: the outer one's stay its own.
        nested = getattr(blocks, "busy", False)
        packed = None if nested else getattr(blocks, "packed", None)
        if packed is None:
            packed = PackedArgs(types, entry)
            made = _launch_config((1, 1, 1), (1, 1, 1), 0, stream, []) if per_call and ex else None
            if not nested:
                blocks.packed, blocks.config = packed, made   # config: (CUlaunchConfig, its attributes)
        else:
            made = blocks.config
        blocks.busy = True
        try:
            packed.fill(values)
            recheck(values)   # (while busy: Python it runs that launches this kernel gets a block of its own)
        finally:
            blocks.busy = nested
        params = packed.params if convention == "params" else ffi.NULL
        extra = packed.extra if convention == "buffer" else ffi.NULL
        if ex:
            own = config
            if per_call:
                own = made[0]
                _store_dims(own, launch_dims)
            args: tuple = (own, handle, params, extra)
        else:
            args = (handle, *launch_dims, stream, params, extra)
        rc = call_in(context_of(), cu_launch, *args)
        if rc:
            raise drv.error(rc, entry)

    # The launch again, as it was made: with cuLaunchKernelEx the config holds the call's dimensions;
    # cuLaunchKernel taking them per call is made again with the call's own (``dims`` of rebind)
    again = functools.partial(cu_launch, *prepared.fixed_arguments()) if ex or not per_call else None
    shared_params = prepared.packed.params if convention == "params" else ffi.NULL
    shared_extra = prepared.packed.extra if convention == "buffer" else ffi.NULL

    def rebind(rc: int, grid: Any = None, block: Any = None, shared_mem: Any = None) -> int:
        """After a context error, the same launch once more with its context pushed (by the block's owner);
        ``grid``, ``block``, ``shared_mem``: the call's, where they come with each call."""
        ctx = context_of()
        if ctx is None or rc not in _CONTEXT_ERRORS:
            return rc
        if again is None:
            return ctx.pushed(functools.partial(cu_launch, handle, *_call_dims(grid, block, shared_mem, entry), stream,
                                                shared_params, shared_extra))
        return ctx.pushed(again)

    return {"verify": verify, "private": private, "rebind": rebind, "recheck": recheck, "seen": seen,
            "holds": resources,
            # owner: [the thread that owns the shared block, whether its launch is converting values now]
            "ident": threading.get_ident, "owner": [None, False], "claim": {}.setdefault}


def _launcher_source(types: Sequence[ArgType], grid: tuple | None, block: tuple | None, shared_mem: int | None,
                     entry: str = "cuLaunchKernel", *, cache_pointers: bool = True) -> str:
    """Python source of a launch function specialised to one signature.

    Why generated: a loop over per-argument writer closures costs more than the
    launch itself adds in C.  Straight-line stores keep cuproc's time per launch
    within a few tens of nanoseconds of a bare cffi call.  Only ints (grid, block,
    shared memory) are formatted into the source; everything else is looked up in
    the function's globals.  A value cffi refuses (range, type) falls back to the
    general writers, which say which parameter and why.

    ``grid``, ``block`` and ``shared_mem`` None: the function takes them with each call, in front
    of the kernel's arguments -- ``launch(grid, block, shared_mem, *args)`` (a one-shot entry) --
    and checks them (``dims``, :func:`_call_dims`) before it stores anything; with cuLaunchKernelEx
    they go into the config, which only the block's owner writes.  ``lg``, ``lb``, ``ls``: the last
    grid, block and shared memory taken, when they were exact ints (else ``unset``): the very same
    objects again (a literal, a name bound once) are neither checked nor stored again -- identity
    cannot let another type through, as equality would (``2.0 == 2``, ``True == 1``) -- and other
    exact ints store only the config fields that changed (each store is a cffi call, about 0.1 us).

    ``cache_pointers=False`` stores every pointer (and checks and stores every call's dimensions) on
    every call: when the compiled launcher (src/fastpath/fastpath_launch.c) writes the same block and
    config, this one cannot know what is in them.
    """
    per_call = grid is None
    names = [_param_name(i, t) for i, t in enumerate(types)]
    dims = ["grid", "block", "shared_mem"] if per_call else []
    ex = entry == "cuLaunchKernelEx"
    # plain positional parameters: Python's own count check costs nothing, and its message
    # names the kernel and the missing parameter (see _compile_launcher for the name)
    lines = [f"def launch({', '.join(dims + names)}):"]
    cached = [f"p{i}" for i, t in enumerate(types) if t.kind == "pointer"] if cache_pointers else []
    held = (["lg", "lb", "ls"] + ([] if ex else ["d"])) if per_call and cache_pointers else []
    if cached or held:
        lines.append(f"    global {', '.join(cached + held)}")
    # One comparison stands for "nothing this launch holds has ended, and this is not a forked child".
    lines += ["    if epoch[0] != seen[0]:", "        verify()"]
    # The shared argument block belongs to one thread: the first to launch claims it (dict.setdefault
    # is atomic), and any other thread launches with a private block.  Cheaper than a lock by about
    # 0.25 us per launch, and two threads can never write one block.
    go_private = ("return private((" + "".join(n + ", " for n in names) + ")" + "".join(", " + d for d in dims)
                  + ")")
    lines += ["    t = ident()", "    if t != owner[0]:", "        if claim(0, t) != t:", "            " + go_private,
              "        owner[0] = t"]
    # owner[1]: the owner's launch is between its first store and its driver call.  A launch made meanwhile
    # on the same thread -- a value's __int__ or __float__ launching this kernel again -- takes a private
    # block: the shared block, the config and the dimensions stay the outer launch's.  (The C launcher sets
    # and reads the same flag.)
    lines += ["    if owner[1]:", "        " + go_private, "    owner[1] = True", "    try:"]
    guarded_from = len(lines)
    if per_call:
        check = "set_dims(grid, block, shared_mem)" if ex else f"d = dims(grid, block, shared_mem, {entry!r})"
        if cache_pointers:
            # exact ints in range: cuLaunchKernelEx stores the fields that changed (each a cffi call; y and
            # z stay 1) where the config holds lg, lb, ls, else all seven; anything else: checked in full
            if ex:
                store = ["            if lg is unset:", "                set_dims(grid, block, shared_mem)",
                         "            else:", "                if grid != lg:", "                    config.gridDimX = grid",
                         "                if block != lb:", "                    config.blockDimX = block",
                         "                if shared_mem != ls:", "                    config.sharedMemBytes = shared_mem"]
            else:
                store = ["            d = (grid, 1, 1, block, 1, 1, shared_mem)"]
            lines += ["    if grid is not lg or block is not lb or shared_mem is not ls:",
                      "        if type(grid) is int and type(block) is int and type(shared_mem) is int "
                      f"and 0 < grid <= {_UINT_MAX} and 0 < block <= {_UINT_MAX} and 0 <= shared_mem <= {_UINT_MAX}:",
                      *store, "            lg, lb, ls = grid, block, shared_mem", "        else:", f"            {check}",
                      "            lg = lb = ls = unset",
                      # reading other objects may have run Python (their __index__, __iter__) that ended what the
                      # launch holds: the values are stored after this, so the epoch is all there is to check
                      "            if epoch[0] != seen[0]:", "                verify()"]
        else:
            lines += [f"    {check}", "    if epoch[0] != seen[0]:", "        verify()"]
    body: list[str] = []
    for i, t in enumerate(types):
        a, slot = names[i], f"s{i}[0]"
        if t.kind == "pointer":
            # DeviceBuffer.ptr's own test, inlined (a property is a Python frame per launch);
            # a freed buffer or an ended context goes on to the general writer, which raises.
            # p{i} is the address in the slot: a 64-bit store costs more than the comparison, and
            # the same buffer launch after launch is the common case.  Other writers reset it.
            if cache_pointers:
                body += [f"if type({a}) is DeviceBuffer and {a}.ended is None and {a}.context.ended is None:",
                         f"    if {a}.address != p{i}:", f"        {slot} = p{i} = {a}.address",
                         f"elif type({a}) is int:",
                         f"    if {a} != p{i}:", f"        {slot} = p{i} = {a}",
                         "else:", f"    p{i} = None", "    conv = 1", f"    w{i}({a})"]
            else:
                body += [f"if type({a}) is DeviceBuffer and {a}.ended is None and {a}.context.ended is None:",
                         f"    {slot} = {a}.address", f"elif type({a}) is int:", f"    {slot} = {a}",
                         "else:", "    conv = 1", f"    w{i}({a})"]
        elif t.kind == "scalar" and t.ctype in ("float", "double"):
            # a plain real (int, float, a NumPy floating class met before) is stored as it is; any other value
            # goes to the writer, which refuses an array (whose own __float__ would take its one element) and
            # converts the rest through __float__, which may run Python
            body += [f"if type({a}) in reals:", f"    {slot} = {a}", "else:", "    conv = 1", f"    w{i}({a})"]
        elif t.kind == "scalar":
            # only an exact int is stored directly: cffi would truncate a NumPy float silently
            # (and a NumPy integer: cffi converts it exactly and checks its range)
            body += [f"if type({a}) is int or type({a}) in numpy_ints:", f"    {slot} = {a}", "else:",
                     "    conv = 1", f"    w{i}({a})"]
        else:
            body += ["conv = 1", f"w{i}({a})"]
    if body:
        # conv: some value's conversion may have run Python (its __int__, __float__, a writer's protocol
        # lookups), which may have ended what the launch holds or freed a buffer stored before it: the
        # launch checks them again (recheck) before the driver sees an address
        lines += ["    conv = 0", "    try:"] + ["        " + line for line in body]
        lines += ["    except (TypeError, OverflowError):"]
        lines += [f"        {p} = None" for p in cached]
        lines += ["        conv = 1", "        fill((" + "".join(n + ", " for n in names) + "))"]
        lines += ["    except BaseException:"]
        lines += [f"        {p} = None" for p in cached] or ["        pass"]
        lines += ["        raise"]
        # (before owner[1] is cleared: Python run by the recheck that launches this kernel again gets a block
        # of its own, as during the stores)
        lines += ["    if conv:", "        recheck((" + "".join(n + ", " for n in names) + "))"]
    lines[guarded_from:] = ["    " + line for line in lines[guarded_from:]] or ["        pass"]
    lines += ["    finally:", "        owner[1] = False"]
    if entry == "cuLaunchKernelEx":
        lines.append("    rc = launch_entry(config, handle, params, extra)")
    elif per_call:
        lines.append("    rc = launch_entry(handle, *d, stream, params, extra)")
    else:
        g, b = ", ".join(map(str, grid)), ", ".join(map(str, block))  # type: ignore[arg-type]
        lines.append(f"    rc = launch_entry(handle, {g}, {b}, {shared_mem}, stream, params, extra)")
    lines += ["    if rc:", f"        rc = rebind(rc{''.join(', ' + d for d in dims)})", "        if rc:",
              f"            raise error(rc, {entry!r})"]
    return "\n".join(lines) + "\n"


def _param_name(i: int, t: ArgType) -> str:
    """``arg3_int``, ``arg0_float_ptr``: what Python's count errors call each parameter."""
    return f"arg{i}_" + re.sub(r"\W+", "_", t.name.replace("*", "_ptr")).strip("_")


_UNSET = object()   # a generated launcher's last dimensions before any, or after ones it does not compare


def _dims_setter(config: Any, entry: str) -> Callable[[Any, Any, Any], None]:
    """``set_dims(grid, block, shared_mem)`` of a launcher taking its dimensions per call with
    cuLaunchKernelEx: checks them (refusals name ``entry``, before anything is stored) and stores all
    seven into ``config``."""
    def set_dims(grid: Any, block: Any, shared_mem: Any) -> None:
        _store_dims(config, _call_dims(grid, block, shared_mem, entry))
    return set_dims


@functools.lru_cache(maxsize=256)
def _compiled_source(source: str) -> Any:
    """The code object of a launcher's source, compiled once per distinct source: every launcher of the
    same signature and form (another stream, another function, a prepared launch made again) runs the
    same code under its own globals, so only the first pays for compile() (hundreds of microseconds)."""
    return compile(source, "<cuproc launcher>", "exec")


def _compile_launcher(prepared: PreparedLaunch, cu_launch: Any, error: Any, cached: bool) -> Callable[..., None]:
    """The launch function: the generated pure launcher, behind the compiled one where it applies."""
    packed = prepared.packed
    name = prepared.function.name
    from .device_memory import DeviceBuffer
    kinds = _compiled_kinds(prepared)
    env: dict[str, Any] = {
        "launch_entry": cu_launch, "config": prepared.config, "error": error,
        "DeviceBuffer": DeviceBuffer, "epoch": EPOCH, "numpy_ints": NUMPY_INTEGERS, "reals": REAL_CLASSES,
        "handle": prepared.function.handle, "stream": prepared.stream, "fill": packed.fill,
        "params": packed.params if prepared.convention == "params" else ffi.NULL,
        "extra": packed.extra if prepared.convention == "buffer" else ffi.NULL,
        **_launch_support(prepared, cu_launch, cached),
    }
    if prepared.grid is None:   # the dimensions come with each call
        env.update(dims=_call_dims, unset=_UNSET, lg=_UNSET, lb=_UNSET, ls=_UNSET, d=None)
        if prepared.config is not None:
            env["set_dims"] = _dims_setter(prepared.config, prepared.entry)
    for i, (t, off) in enumerate(zip(packed.types, packed.offsets)):
        env[f"w{i}"] = packed.writers[i]
        if t.kind in ("pointer", "scalar"):
            env[f"s{i}"] = ffi.cast((t.ctype or "uint64_t") + " *", packed.block + off)
        if t.kind == "pointer":
            env[f"p{i}"] = None   # nothing stored yet
    source = _launcher_source(packed.types, prepared.grid, prepared.block, prepared.shared_mem, prepared.entry,
                              cache_pointers=kinds is None)
    exec(_compiled_source(source), env)  # noqa: S102 - our own source, ints only
    launch = env.pop("launch")   # its globals must not name it: a function <-> globals cycle waits for gc
    title = f"{name}[{', '.join(t.name for t in packed.types)}]"   # "VecAdd[float*, int]() takes 2 ..."
    code = launch.__code__
    launch.__code__ = code.replace(co_name=title, co_filename=f"<cuproc launcher for {name}>",
                                   **({"co_qualname": title} if hasattr(code, "co_qualname") else {}))
    launch.__name__ = launch.__qualname__ = title
    if kinds is not None:
        launch = _compiled_launcher(prepared, launch, kinds, env)
        launch.__name__ = launch.__qualname__ = title
    launch.entry, launch.convention, launch.grid, launch.block = (prepared.entry, prepared.convention,
                                                                  prepared.grid, prepared.block)
    launch.function = None if cached else prepared.function
    launch.stream = None if cached else prepared.stream_object
    # ``run.prepared`` (Function.prepare's docstring): this launch's PreparedLaunch.  None for a one-shot
    # entry, which must hold neither the function nor the stream (see PreparedLaunch).
    launch.prepared = None if cached else _LauncherPrepared.of(prepared, launch)
    return launch


def _compiled_kinds(prepared: PreparedLaunch) -> bytes | None:
    """The C launcher's kind per argument, or None where it does not apply: no fast path, a vector
    or struct argument, or an entry resolved with another signature than the launcher calls."""
    compiled_kinds = fastpath.launcher_kinds()   # src/fastpath/fastpath_launch.c's enum, read from the module
    if compiled_kinds is None:
        return None
    kinds = []
    for t in prepared.packed.types:
        kind = compiled_kinds.get("pointer" if t.kind == "pointer" else t.ctype if t.kind == "scalar" else "")
        if kind is None:
            return None
        kinds.append(kind)
    res = prepared.driver.resolution(prepared.entry)
    compiled_for = fastpath.FRONT_TYPEDEFS[prepared.entry]
    if res.function is None or ffi.typeof(res.typedef) is not ffi.typeof(compiled_for):
        return None
    return bytes(kinds)


def _compiled_launcher(prepared: PreparedLaunch, pure: Callable[..., None], kinds: bytes,
                       env: dict[str, Any]) -> Callable[..., None]:
    """The C launcher (src/fastpath/fastpath_launch.c) over the same block, falling back to ``pure``.

    It takes the common case only -- the block's owner thread, EPOCH unchanged, values it converts
    exactly as cffi does, and where the dimensions come with each call, exact ints (or tuples of
    them) in an unsigned int's range -- and gives every other call to ``pure`` unchanged, so every
    refusal (closed parents, fork, another thread, a bad value or dimension) is the pure launcher's.
    A failed launch goes to ``on_error(rc)``, ``on_error(rc, grid, block, shared_mem)`` where the
    dimensions come per call: the same rebind-then-raise as the pure launcher's.
    """
    rebind, error, entry = env["rebind"], env["error"], prepared.entry

    def on_error(rc: int, *dims: Any) -> None:
        rc = rebind(rc, *dims)
        if rc:
            raise error(rc, entry)

    from .device_memory import DeviceBuffer
    packed = prepared.packed

    def address(cdata: Any) -> int:
        return 0 if cdata is None else int(ffi.cast("uintptr_t", cdata))

    keep = (packed, prepared.config, getattr(prepared, "_config_attrs", None), env["handle"], env["stream"])
    fn = prepared.driver.resolution(prepared.entry).function
    # A DeviceBuffer argument is read from the slots that its ended, context and address and its
    # context's ended resolve to (make_launcher refuses anything but those object slots), without a
    # getattr each: about 0.1 us of every launch that passes a buffer.  Looked up when the launcher is
    # made: a class patched later (a property over a slot) is not seen by launchers made before.
    slots = tuple(getattr(cls, name) for cls, name in ((DeviceBuffer, "ended"), (DeviceBuffer, "context"),
                                                       (DeviceBuffer, "address"), (Context, "ended")))
    return fastpath.launcher_factory()(  # type: ignore[misc] - _compiled_kinds checked it is there
        pure, on_error, env["recheck"], EPOCH, env["seen"], env["owner"], DeviceBuffer, Context, slots, keep,
        entry == "cuLaunchKernelEx",
        address(fn), address(prepared.config), address(env["handle"]), prepared.grid, prepared.block,
        prepared.shared_mem, address(env["stream"]), address(env["params"]), address(env["extra"]),
        address(packed.block), ffi.sizeof(packed.block), kinds, tuple(packed.offsets))


_PREPARED_PER_FUNCTION = 64   # one-shot entries (argument types, stream, ...) remembered per function
# Classes whose every instance has one C type: NumPy scalar types (added as they are first seen, so
# NumPy is never imported here) and cuproc's memory objects (pointers).  A one-shot launch of such
# values is cached under the tuple of their classes, which costs one ``map(type, args)`` to key.
_TYPED_CLASSES: set[type] = set()
# NumPy integer scalar classes: a generated launcher stores them into an integer slot directly
# (cffi converts them exactly and range-checks them); NumPy floats are refused there (they truncate).
NUMPY_INTEGERS: set[type] = set()
#: the classes whose conversion to a C float or double runs no Python: int, float, and each NumPy floating
#: scalar class once a launch met it (_typed_class)
REAL_CLASSES: set[type] = {int, float}


def _typed_class(value: Any) -> bool:
    """Whether every instance of ``type(value)`` has the C type ``value`` has (noting the class if so)."""
    cls = value.__class__
    if cls in _TYPED_CLASSES:
        return True
    dtype = getattr(value, "dtype", None)
    if cls.__module__ == "numpy" and dtype is not None and getattr(dtype, "type", None) is cls \
            and dtype.fields is None and (dtype.kind, dtype.itemsize) in _NUMPY_KINDS:
        if dtype.kind in "iub":
            NUMPY_INTEGERS.add(cls)
        elif dtype.kind == "f":
            REAL_CLASSES.add(cls)
    else:
        from .allocation import Allocation
        from .device_memory import DeviceView
        if not isinstance(value, (Allocation, DeviceView)):
            return False
    _TYPED_CLASSES.add(cls)
    return True


def launch(function: Any, grid: Any, block: Any, args: Sequence[Any] = (), *, signature: Sequence[Any] | None = None,
           shared_mem: int = 0, stream: Any = None, convention: str = "buffer", cooperative: bool = False,
           entry: str | None = None) -> None:
    """Launch once (cuLaunchKernel / cuLaunchKernelEx, or cuLaunchCooperativeKernel with ``cooperative=True``).

    Repeated one-shot launches reuse a :class:`PreparedLaunch` kept on the function
    (``function.launch_cache``), so a loop over ``launch`` costs little more than a prepared
    launch.  The key: the signature (or, without one, the classes of the values when each class
    has one C type -- NumPy scalars, cuproc buffers -- else the inferred C types), the stream,
    convention and entry.  Grid, block and shared memory are not in it: the entry's launcher
    takes them with each call and checks them there (a refusal names the entry), so a grid that
    changes with every launch costs what a fixed one costs.  The cache lives on the function, so
    a new kernel (or a library kernel in another context) never meets another's entry.  It never
    keeps a Stream alive: an entry for a Stream remembers it weakly and is used only for that very
    object (the caller holds it for the call).  Each entry notes the resource epoch at which the
    function and stream were last checked, and checks them again only when some resource has ended
    since (or the process forked).  At most :data:`_PREPARED_PER_FUNCTION` entries are kept: a new
    one beyond that drops those of Streams that are gone, then the oldest (:func:`_make_room`).
    """
    function = function.launch_target()
    if cooperative:
        _launch_cooperative(function, grid, block, args, signature, shared_mem, stream)
        return
    stream_key: Any = stream
    if stream is not None:
        if isinstance(stream, Stream):
            stream_key = ("stream", id(stream))
        else:
            try:
                stream_key = int(ffi.cast("uintptr_t", stream_handle(stream, function.driver)))
            except CudaError as exc:   # named for the launch, as above
                raise (exc.renamed(entry or default_entry(function.driver)) if exc.refused else exc) from None
    try:   # a signature with other entries than C type strings is never stored under this key (below)
        if signature is None:
            n = len(args)   # the classes, unrolled: tuple(map(type, args)) costs 0.1-0.2 us more
            classes = _CLASSES_OF[n](args) if n < _UNROLLED else tuple(map(type, args))
        else:
            classes = tuple(signature)
        key: tuple | None = (classes, stream_key, convention, entry)
        cached = function.launch_cache.get(key)
    except (TypeError, LookupError):   # an unhashable signature entry (a list), or args that are no
        key = cached = None           # sequence (no len(), or not indexed 0..n-1): the general path
        if args.__class__ is not tuple and args.__class__ is not list:
            args = _as_values(args, function, entry)   # a generator is read once, here
    if cached is not None and (stream_key.__class__ is not tuple or cached[1]() is stream):  # else: a new
        if cached[2][0] != EPOCH[0]:                                                # Stream at a dead one's id
            _recheck(function, stream, cached)
        cached[0](grid, block, shared_mem, *args)
        return
    _launch_uncached(function, grid, block, args, signature, shared_mem, stream, stream_key, convention, entry, key)


# With the fast path, ``launch`` is a C front over the function above (src/fastpath/fastpath_launch.c,
# make_one_shot): for fn.launch(grid, block, args) with at most ``signature=``, ``stream=`` (None or a
# Stream) and ``shared_mem=``, on an exact Function, it builds the same key, finds a warm entry for
# that very stream whose epoch is current, and calls its launcher with the call's grid, block and
# shared memory, which the launcher checks (the entry it last found, ``function.launch_last``, it
# takes without building the key); any other call -- a miss included -- runs the function above
# unchanged.  It is a method descriptor, so ``Function.launch = launch`` binds.
# [Function, Stream, Function.launch_cache, Function.launch_last (slot descriptors)], noted by the first
# (cold) launch
_FRONT_TYPES: list[Any] = [None, None, None, None]
_python_launch = launch
_make_one_shot = fastpath.one_shot_factory()
if _make_one_shot is not None:
    launch = functools.update_wrapper(  # type: ignore[assignment]  # the C front stands for the function
        _make_one_shot(_python_launch, _FRONT_TYPES, EPOCH, "buffer"), _python_launch)


_FUNC_ERROR_END = result_code("CUDA_ERROR_INVALID_VALUE")


class Function(Resource):
    """A launchable function: a CUfunction of a module (bound to its context) or a library's CUkernel
    (``context`` None: it launches in the current context).  Holds its owner; refuses use once the
    owner or the context ended."""

    # Slots: the one-shot launch's C front reads launch_cache and launch_last at their offsets; a
    # __dict__ as before for everything else (a user's own attributes, vars(), mock.patch.object).
    __slots__ = ("handle", "name", "owner", "kernel", "context", "launch_cache", "launch_last", "__dict__")

    def __init__(self, handle: Any, driver: Driver, name: str, *, owner: Resource, context: Context | None = None,
                 kernel: Any = None) -> None:
        self.handle, self.driver, self.name, self.owner, self.kernel = handle, driver, name, owner, kernel
        self.context = context
        self.ended = None
        self.launch_cache: dict[Any, Any] = {}   # one-shot launches by shape (cuproc.launch.launch)
        # the C front's last hit, (key, entry) of launch_cache: taken without building the key
        self.launch_last: tuple | None = None

    def parents(self) -> tuple[Resource, ...]:
        return (self.owner, self.context) if self.context is not None else (self.owner,)

    def describe(self) -> str:
        return f"function {self.name}"

    def _call(self, call: str, *args: Any) -> None:
        self.check(call)
        self.driver.check(call_in(self.context, getattr(self.driver, call), *args), call)

    @staticmethod
    def _attr_enum(attr: str | int) -> int:
        if isinstance(attr, str):
            key = attr if attr.startswith("CU_FUNC_ATTRIBUTE_") else "CU_FUNC_ATTRIBUTE_" + attr.upper()
            return ffi.typeof("CUfunction_attribute").relements[key]
        return attr

    def attribute(self, attr: str | int) -> int:
        out = ffi.new("int *")
        self._call("cuFuncGetAttribute", out, self._attr_enum(attr), self.handle)
        return out[0]

    def set_attribute(self, attr: str | int, value: int) -> None:
        self._call("cuFuncSetAttribute", self.handle, self._attr_enum(attr), value)
    @property
    def max_threads_per_block(self) -> int:
        return self.attribute("MAX_THREADS_PER_BLOCK")

    @property
    def num_registers(self) -> int:
        return self.attribute("NUM_REGS")

    @property
    def shared_size_bytes(self) -> int:
        return self.attribute("SHARED_SIZE_BYTES")

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.attribute("MAX_DYNAMIC_SHARED_SIZE_BYTES")

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        self.set_attribute("MAX_DYNAMIC_SHARED_SIZE_BYTES", value)

    def set_cache_config(self, config: str | int) -> None:
        if isinstance(config, str):
            key = config if config.startswith("CU_FUNC_CACHE_") else "CU_FUNC_CACHE_" + config.upper()
            config = ffi.typeof("CUfunc_cache").relements[key]
        self._call("cuFuncSetCacheConfig", self.handle, config)

    def max_active_blocks_per_sm(self, block_size: int, dynamic_shared: int = 0) -> int:
        out = ffi.new("int *")
        self._call("cuOccupancyMaxActiveBlocksPerMultiprocessor", out, self.handle, block_size, dynamic_shared)
        return out[0]

    def suggested_block_size(self, dynamic_shared: int = 0, block_size_limit: int = 0) -> tuple[int, int]:
        """(minimum grid size for full occupancy, block size) from cuOccupancyMaxPotentialBlockSize."""
        grid, block = ffi.new("int *"), ffi.new("int *")
        self._call("cuOccupancyMaxPotentialBlockSize", grid, block, self.handle, ffi.NULL, dynamic_shared,
                   block_size_limit)
        return grid[0], block[0]

    def param_info(self) -> list[tuple[int, int]] | None:
        """[(offset, size)] of each parameter as the driver reports it (cuFuncGetParamInfo /
        cuKernelGetParamInfo), or None where the driver cannot say.  Asked once per function (the answer
        cannot change while its handle lives): launch_ex, cooperative launches and graph kernel nodes ask on
        every call."""
        self.check("cuFuncGetParamInfo")
        memo = self.__dict__.get("_param_info")
        if memo is None:
            memo = self.__dict__["_param_info"] = (self._ask_param_info(),)
        return memo[0]

    def _ask_param_info(self) -> list[tuple[int, int]] | None:
        if self.kernel is not None and self.driver.has("cuKernelGetParamInfo"):
            call, target = "cuKernelGetParamInfo", self.kernel
        elif self.driver.has("cuFuncGetParamInfo"):
            call, target = "cuFuncGetParamInfo", self.handle
        else:
            return None
        self.check(call)
        fn = getattr(self.driver, call)
        out: list[tuple[int, int]] = []
        offset, size = ffi.new("size_t *"), ffi.new("size_t *")
        while True:
            rc = call_in(self.context, fn, target, len(out), offset, size)
            if rc == _FUNC_ERROR_END:      # the index past the last parameter
                return out
            self.driver.check(rc, call)    # anything else is an error, not the end of the list
            out.append((offset[0], size[0]))

    def launch_target(self) -> Function:
        """What a launch binds to: this function (a per-context Kernel answers its current context's)."""
        return self

    def prepare(self, signature: Any, grid: Any = 1, block: Any = 1, *, shared_mem: int = 0,
                stream: Any = None, convention: str = "buffer", entry: str | None = None) -> Any:
        """Bind signature, grid, block and stream once; returns the launch function for them.

        ``run = fn.prepare(["float*", "int", "float"], grid, block)`` then ``run(buf, n, x)``
        per launch.  ``run.prepared`` is the PreparedLaunch (entry, convention, packed block).
        """
        return PreparedLaunch(self, signature, grid, block, shared_mem=shared_mem, stream=stream,
                              convention=convention, entry=entry).launch

    # fn.launch(grid, block, args, signature=..., stream=...): cuproc.launch.launch itself (the C front
    # where built), as a method (no frame in between: a one-shot launch in a loop pays for every call).
    launch = launch

    def __repr__(self) -> str:
        return f"<cuproc.Function {self.name}>"


def _as_values(args: Any, function: Any, entry: str | None) -> tuple:
    """The kernel arguments of a one-shot launch given as any iterable, as a tuple."""
    try:
        return tuple(args)
    except TypeError:
        raise invalid(entry or default_entry(function.driver),
                      f"args is the sequence of kernel arguments, not a {type(args).__name__}") from None


# _CLASSES_OF[n](args): the exact classes (type(), as map(type, ...) gives) of n arguments as a tuple,
# one generated function per count: a one-shot launch keys its cache by them on every call.
_UNROLLED = 17
_CLASSES_OF: list[Callable[[Sequence[Any]], tuple]] = [
    eval(f"lambda a: ({''.join(f'type(a[{i}]), ' for i in range(n))})")   # our own source, ints only
    for n in range(_UNROLLED)]


def _type_key(t: ArgType) -> tuple:
    return (t.name, t.size, t.align, t.kind)


def _recheck(function: Any, stream: Any, cached: tuple) -> None:
    """Some resource ended since this entry last checked: the function and the stream, again."""
    epoch = EPOCH[0]
    call = cached[0].entry
    function.check(call)     # the launcher checks the function's owners, not the function
    if isinstance(stream, Stream):
        stream.check(call)
    cached[2][0] = epoch


def _launch_uncached(function: Any, grid: Any, block: Any, args: Sequence[Any], signature: Sequence[Any] | None,
                     shared_mem: int, stream: Any, stream_key: Any, convention: str, entry: str | None,
                     key: tuple | None) -> None:
    """A one-shot launch the cache did not have: check, prepare, remember (where the key allows), launch."""
    epoch = EPOCH[0]
    call = entry or default_entry(function.driver)
    function.check(call)
    if isinstance(stream, Stream):
        stream.check(call)
    cache = function.launch_cache
    if _FRONT_TYPES[0] is None:   # the classes the C front takes
        _FRONT_TYPES[:] = [Function, Stream, Function.__dict__["launch_cache"], Function.__dict__["launch_last"]]
    if signature is None:
        sig: tuple = tuple(infer_type(a, call, i) for i, a in enumerate(args))
        if key is not None and not all(_typed_class(a) for a in args):
            # a value whose class does not fix its C type (an ndarray, a cffi struct): key by the types
            key = ((tuple(map(_type_key, sig)),) + key[1:])
            cached = cache.get(key)
            if cached is not None and (stream_key.__class__ is not tuple or cached[1]() is stream):
                cached[2][0] = epoch
                cached[0](grid, block, shared_mem, *args)
                return
    else:
        sig = tuple(signature)
        if key is not None and any(s.__class__ is not str for s in sig):
            # a NumPy dtype or cffi type: equal entries can differ in layout (an aligned and a packed
            # structured dtype compare equal), so such signatures are keyed by the layouts only
            key = ((tuple(s if s.__class__ is str else (s, getattr(s, "alignment", None)) for s in sig),)
                   + key[1:])
            cached = cache.get(key)
            if cached is not None and (stream_key.__class__ is not tuple or cached[1]() is stream):
                cached[2][0] = epoch
                cached[0](grid, block, shared_mem, *args)
                return
    _call_dims(grid, block, shared_mem, call)   # refused dims build nothing and store nothing
    prepared = PreparedLaunch(function, sig, stream=stream, convention=convention, entry=entry, cached=True).launch
    if key is not None:
        if len(cache) >= _PREPARED_PER_FUNCTION:
            _make_room(function, cache)
        cache[key] = (prepared, weakref.ref(stream) if isinstance(stream, Stream) else None, [epoch])
    prepared(grid, block, shared_mem, *args)


def _make_room(function: Any, cache: dict) -> None:
    """Bring ``cache`` (a function's one-shot entries) below :data:`_PREPARED_PER_FUNCTION` for one more:
    first the entries of Streams that are gone (a Stream made per launch leaves one each), then the
    oldest, never the C front's last hit (the entry in use).  Other threads may change the cache
    meanwhile: it is read once, as a list, and entries are dropped by key, whichever is still there."""
    entries = list(cache.items())
    last = getattr(function, "launch_last", None)   # a slot: unset once deleted
    in_use = last[1] if last.__class__ is tuple and len(last) == 2 else None
    live = []
    for k, e in entries:
        if e[1] is not None and e[1]() is None:
            cache.pop(k, None)
            if e is in_use:
                function.launch_last = None
        elif e is not in_use:
            live.append(k)
    for k in live[:max(len(cache) + 1 - _PREPARED_PER_FUNCTION, 0)]:   # oldest first: insertion order
        cache.pop(k, None)


def launch_ex(function: Any, grid: Any, block: Any, args: Sequence[Any] = (), *,
              signature: Sequence[Any] | None = None, shared_mem: int = 0, stream: Any = None,
              cluster: Any = None, cooperative: bool = False, priority: int | None = None) -> None:
    """cuLaunchKernelEx with launch attributes: cluster dimensions, cooperative, priority."""
    if hasattr(function, "launch_target"):
        function = function.launch_target()
    call = "cuLaunchKernelEx"
    packed = _packed_once(function, call, args, signature)
    drv = function.driver
    attrs = []
    if cluster is not None:
        attrs.append(("CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION", _dims(cluster, "cluster", call)))
    if cooperative:
        attrs.append(("CU_LAUNCH_ATTRIBUTE_COOPERATIVE", 1))
    if priority is not None:
        attrs.append(("CU_LAUNCH_ATTRIBUTE_PRIORITY", priority))
    h = stream_handle(stream, drv, call)
    config, _attrs = _launch_config(_dims(grid, "grid", call), _dims(block, "block", call),
                                    _shared_mem(shared_mem, call), h, attrs)
    rc = call_in(_binding(function, stream), drv.cuLaunchKernelEx, config, function.handle, packed.params, ffi.NULL)
    drv.check(rc, call)


def _binding(function: Any, stream: Any) -> Any:
    """The context a launch runs in: the function's, else the stream's, else None (the current one)."""
    if function.context is not None:
        return function.context
    return stream.context if isinstance(stream, Stream) else None


def _launch_cooperative(function: Any, grid: Any, block: Any, args: Sequence[Any], signature: Sequence[Any] | None,
                        shared_mem: int, stream: Any) -> None:
    """cuLaunchCooperativeKernel (kernelParams convention: it takes no ``extra``)."""
    call = "cuLaunchCooperativeKernel"
    packed = _packed_once(function, call, args, signature)
    drv = function.driver
    call_args = (function.handle, *_dims(grid, "grid", call), *_dims(block, "block", call),
                 _shared_mem(shared_mem, call), stream_handle(stream, drv, call), packed.params)
    drv.check(call_in(_binding(function, stream), drv.cuLaunchCooperativeKernel, *call_args), call)


def _packed_once(function: Any, call: str, args: Sequence[Any], signature: Sequence[Any] | None) -> PackedArgs:
    """A fresh argument block for one launch, after the function's and the signature's checks, laid out where
    the kernel reads each argument (:func:`placed_types`).  For the kernelParams convention: cuLaunchKernelEx
    and cuLaunchCooperativeKernel here, graph kernel nodes (cuproc.graph_nodes) pass ``packed.params``."""
    function.check(call)
    types = ([arg_type(s, call) for s in signature] if signature is not None
             else [infer_type(a, call, i) for i, a in enumerate(args)])
    packed = PackedArgs(placed_types(function, types, call, "params"), call)
    packed.fill(args)
    return packed


def _launch_config(grid: tuple, block: tuple, shared_mem: int, stream: Any,
                   attrs: list[tuple[str, Any]]) -> tuple[Any, Any]:
    """(CUlaunchConfig, its attribute array): the config points into the array, so keep both."""
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
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_mem
    config.hStream = stream
    config.attrs = array
    config.numAttrs = len(attrs)
    return config, array


def pack_bytes(signature: Sequence[Any], values: Sequence[Any], *, function: Any = None,
               convention: str = "params") -> bytes:
    """The packed argument block for ``values`` (for inspection and tests): at natural alignment, or with
    ``function``, as a launch of it in ``convention`` packs them (at the offsets its driver reports)."""
    types = [arg_type(s) for s in signature]
    if function is not None:
        target = function.launch_target() if hasattr(function, "launch_target") else function
        types = placed_types(target, types, default_entry(target.driver), convention)
    packed = PackedArgs(types)
    packed.fill(values)
    return bytes(ffi.buffer(packed.block, packed.size))


# The argument packing and checks of a launch, for the other layers that build kernel launches (graph kernel
# nodes, cuproc.graph_nodes): importable from here, not part of the public API.
pack_arguments = _packed_once
launch_dims = _dims
shared_mem_bytes = _shared_mem

__all__ = ["ArgType", "Function", "PackedArgs", "PreparedLaunch", "arg_type", "infer_type", "launch", "launch_ex", "layout",
           "pack_bytes"]
