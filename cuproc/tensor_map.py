"""Tensor maps for the Tensor Memory Accelerator (Hopper and later): cuTensorMapEncodeTiled and
cuTensorMapEncodeIm2col over device memory, passed to kernels by value.

Policy
------
* **NumPy order in, the driver's order out.**  ``shape``, ``strides`` (in bytes) and ``box`` are given
  outermost first, as NumPy writes them; the driver takes the innermost dimension first (``globalDim[0]`` is
  the contiguous one), and so does the kernel's TMA coordinate list (``x`` first).  cuproc reverses them.
  The innermost stride must be the element size (the driver has no stride for it).
* **The driver's rules, checked before the call** (cuTensorMapEncodeTiled's documentation): rank 1 to 5
  (3 to 5 with interleave), the global address a multiple of 16 bytes (32 with 32-byte interleave),
  dimensions from 1 to 2^32, strides multiples of 16 (32) below 2^40, box sizes 1 to 256 with an inner box
  of a multiple of 16 bytes and no wider than the swizzle span, element strides 1 to 8, the NaN fill for
  floating-point types only, and the whole tensor inside the memory given.  A refusal names the rule.
* **A value, not a handle.**  A :class:`TensorMap` is 128 bytes the driver wrote; nothing is given back.
  It holds the memory it describes (a DeviceBuffer or view keeps its context), and refuses to be passed to
  a kernel once that memory was freed.
* **Passed by value**, as a ``const __grid_constant__ CUtensorMap`` parameter: it carries its C type the
  way a NumPy structured scalar does (``dtype``: 128 bytes, aligned to :attr:`TensorMap.param_alignment`;
  ``tobytes()``), so launches without a signature, signatures naming :func:`param_type` and prepared
  launches take it, in both launch conventions.  The alignment is 64 by default, the ``alignas(64)`` of
  CUDA 12's ``cuda.h`` and of ``cuda::ptx``'s declarations; CUDA 13's ``cuda.h`` declares ``alignas(128)``
  (``param_alignment=128``).
* **Where the kernel reads it.**  The compiler aligns a parameter at its address in constant bank 0, not in
  the parameter buffer, and the parameters start at 0x210 there on sm_90 (0x160 on sm_75 and sm_80, 0x380
  on sm_100 and sm_120; read from NVRTC 13.5's cubins): a 64-aligned map as the first parameter, or after an
  ``int``, is at offset 48 on Hopper, 32 on Ampere, 64 on Blackwell, and the driver reports just that
  (cuFuncGetParamInfo / cuKernelGetParamInfo, CUDA 12.4+).  :mod:`cuproc.launch` packs each argument at the
  offset the driver reports, in both conventions.  A driver that cannot say (before 12.4) leaves only C
  alignment from offset 0, which is wrong on sm_90: a ``convention="buffer"`` launch of a map is then refused
  before the call; ``convention="params"`` works (the driver places each argument).
"""
from __future__ import annotations

from typing import Any

from ._ffi import ffi
from ._support import handle_int, invalid
from .allocation import Allocation
from .device_memory import DeviceView

#: element type name -> (CUtensorMapDataType enumerator, bytes)
DATA_TYPES: dict[str, tuple[str, int]] = {
    "uint8": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1), "uint16": ("CU_TENSOR_MAP_DATA_TYPE_UINT16", 2),
    "uint32": ("CU_TENSOR_MAP_DATA_TYPE_UINT32", 4), "int32": ("CU_TENSOR_MAP_DATA_TYPE_INT32", 4),
    "uint64": ("CU_TENSOR_MAP_DATA_TYPE_UINT64", 8), "int64": ("CU_TENSOR_MAP_DATA_TYPE_INT64", 8),
    "float16": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT16", 2), "float32": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT32", 4),
    "float64": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT64", 8), "bfloat16": ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 2),
    "float32_ftz": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ", 4), "tfloat32": ("CU_TENSOR_MAP_DATA_TYPE_TFLOAT32", 4),
    "tfloat32_ftz": ("CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ", 4),
}
_FLOATS = frozenset({"float16", "float32", "float64", "bfloat16", "float32_ftz", "tfloat32", "tfloat32_ftz"})
INTERLEAVES = {"none": 0, "16b": 1, "32b": 2}
SWIZZLES = {"none": 0, "32b": 1, "64b": 2, "128b": 3, "128b_atom_32b": 4, "128b_atom_32b_flip_8b": 5,
            "128b_atom_64b": 6}
_SWIZZLE_SPAN = {0: None, 1: 32, 2: 64, 3: 128, 4: 128, 5: 128, 6: 128}
L2_PROMOTIONS = {"none": 0, "64b": 1, "128b": 2, "256b": 3}
OOB_FILLS = {"zero": 0, "nan": 1}   # NONE, NAN_REQUEST_ZERO_FMA
SIZE = 128
_IM2COL_CORNER = {3: 1 << 15, 4: 1 << 7, 5: 1 << 4}   # corners lie in [-limit, limit - 1] per rank


class TensorMapParam:
    """The C type of a tensor map as a kernel argument: 128 bytes aligned to ``alignment``, described the way
    :func:`cuproc.launch.arg_type` reads a NumPy structured dtype (kind, size, alignment, fields)."""

    kind, itemsize, fields = "V", SIZE, None

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment

    def __str__(self) -> str:
        return "CUtensorMap" if self.alignment == 64 else f"CUtensorMap(align {self.alignment})"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorMapParam) and other.alignment == self.alignment

    def __hash__(self) -> int:
        return hash(("CUtensorMap", self.alignment))


_PARAMS = {64: TensorMapParam(64), 128: TensorMapParam(128)}


def param_type(alignment: int = 64) -> TensorMapParam:
    """The signature entry for a ``const __grid_constant__ CUtensorMap`` parameter (see the module docstring
    for which ``alignment``: 64 for CUDA 12 headers and ``alignas(64)`` declarations, 128 for CUDA 13's)."""
    if alignment not in _PARAMS:
        raise invalid("cuLaunchKernel", f"a tensor map parameter is aligned to 64 or 128 bytes, got {alignment!r}")
    return _PARAMS[alignment]


def _name(dtype: Any, call: str) -> str:
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if not isinstance(name, str):
        name = getattr(dtype, "__name__", str(dtype))
    if name not in DATA_TYPES:
        raise invalid(call, f"a tensor map's element type is one of {', '.join(DATA_TYPES)}; got {dtype!r}")
    return name


def _ints(values: Any, what: str, call: str, *, rank: int | None = None) -> list[int]:
    try:
        items = [v if isinstance(v, int) and not isinstance(v, bool) else None for v in values]
    except TypeError:
        raise invalid(call, f"{what} must be a sequence of ints, got {values!r}") from None
    if any(i is None for i in items):
        raise invalid(call, f"{what} must be a sequence of ints, got {values!r}")
    if rank is not None and len(items) != rank:
        raise invalid(call, f"{what} has {len(items)} entries; the tensor's rank is {rank}")
    return items  # type: ignore[return-value]


def _choice(table: dict[str, int], value: str, what: str, call: str) -> int:
    if value not in table:
        raise invalid(call, f"{what} is one of {', '.join(table)}, got {value!r}")
    return table[value]


class TensorMap:
    """A tensor map: 128 bytes that tell the TMA unit how to move boxes of a tensor in device memory.

    Made by :meth:`tiled` or :meth:`im2col`; holds ``memory`` (what it describes).  Passing it to a kernel,
    or ``bytes(tensor_map)``, checks that the memory is still usable."""

    __slots__ = ("memory", "address", "data_type", "shape", "strides", "param_alignment", "_storage", "_map")

    def __init__(self, memory: Any, address: int, data_type: str, shape: tuple[int, ...], strides: tuple[int, ...],
                 param_alignment: int) -> None:
        self.memory, self.address, self.data_type = memory, address, data_type
        self.shape, self.strides = shape, strides
        self.param_alignment = param_type(param_alignment).alignment
        # 128 bytes at a multiple of 128 in a buffer of our own: the driver's documented alignment for the map
        # (64 in CUDA 12, 128 in CUDA 13's cuda.h) whichever applies
        self._storage = ffi.new("char[]", SIZE + 128)
        start = handle_int(self._storage)
        self._map = ffi.cast("CUtensorMap *", (start + 127) // 128 * 128)

    @property
    def dtype(self) -> TensorMapParam:
        """The C type as a kernel argument (see the module docstring)."""
        return _PARAMS[self.param_alignment]

    def with_param_alignment(self, alignment: int) -> TensorMap:
        """The same map, passed at another parameter alignment (128 for kernels built against CUDA 13's cuda.h)."""
        other = TensorMap(self.memory, self.address, self.data_type, self.shape, self.strides, alignment)
        ffi.memmove(other._map, self._map, SIZE)
        return other

    def tobytes(self) -> bytes:
        """The 128 bytes, as a kernel receives them; raises if the memory it describes was freed."""
        self.memory.check("a kernel launch with this TensorMap")
        return bytes(ffi.buffer(self._map, SIZE))

    __bytes__ = tobytes

    # ---------------------------------------------------------------- encoding
    @classmethod
    def _start(cls, memory: Any, dtype: Any, shape: Any, strides: Any, call: str, param_alignment: int
               ) -> tuple[TensorMap, str, int, list[int], list[int], int]:
        if not isinstance(memory, (Allocation, DeviceView)) or (isinstance(memory, Allocation)
                                                               and memory.kind == "host"):
            raise invalid(call, f"a tensor map describes device memory (a DeviceBuffer, a view, managed memory); "
                                f"got {type(memory).__name__}")
        memory.check(call)
        name = _name(dtype, call)
        elem = DATA_TYPES[name][1]
        dims = _ints(shape, "shape", call)
        rank = len(dims)
        if not 1 <= rank <= 5:
            raise invalid(call, f"a tensor map has rank 1 to 5, got shape {tuple(dims)}")
        if strides is None:
            packed, step = [], elem
            for d in reversed(dims):
                packed.append(step)
                step *= d
            steps = packed[::-1]
        else:
            steps = _ints(strides, "strides", call, rank=rank)
        if steps[-1] != elem:
            raise invalid(call, f"the innermost dimension must be contiguous: strides[-1] must be the element size "
                                f"({elem} bytes for {name}), got {steps[-1]}")
        for i, d in enumerate(dims):
            if not 1 <= d <= 1 << 32:
                raise invalid(call, f"shape[{i}] must be from 1 to 2**32, got {d}")
        extent = elem + sum((d - 1) * s for d, s in zip(dims, steps))
        if extent > memory.nbytes:
            raise invalid(call, f"a tensor of shape {tuple(dims)} with strides {tuple(steps)} spans {extent} bytes; "
                                f"the memory has {memory.nbytes}")
        tm = cls(memory, memory.ptr, name, tuple(dims), tuple(steps), param_alignment)
        return tm, name, elem, dims, steps, rank

    @staticmethod
    def _common(call: str, address: int, elem: int, rank: int, steps: list[int], interleave: int,
                element_strides: Any, name: str, oob: int) -> list[int]:
        align = 32 if interleave == INTERLEAVES["32b"] else 16
        if interleave and not 3 <= rank <= 5:
            raise invalid(call, f"an interleaved tensor map has rank 3 to 5, got {rank}")
        if address % align:
            raise invalid(call, f"the tensor must start at a multiple of {align} bytes; {address:#x} is not")
        for i, s in enumerate(steps[:-1]):
            if s % align or not 0 < s < 1 << 40:
                raise invalid(call, f"strides[{i}] must be a positive multiple of {align} bytes below 2**40, got {s}")
        estrides = [1] * rank if element_strides is None else _ints(element_strides, "element_strides", call,
                                                                     rank=rank)
        if any(not 1 <= e <= 8 for e in estrides):
            raise invalid(call, f"element_strides must each be 1 to 8, got {tuple(estrides)}")
        if oob and name not in _FLOATS:
            raise invalid(call, f"oob_fill='nan' is for floating-point types, not {name}")
        return estrides

    @classmethod
    def tiled(cls, memory: Any, dtype: Any, shape: Any, box: Any, *, strides: Any = None, element_strides: Any = None,
              interleave: str = "none", swizzle: str = "none", l2_promotion: str = "none", oob_fill: str = "zero",
              param_alignment: int = 64) -> TensorMap:
        """cuTensorMapEncodeTiled: boxes of ``box`` elements (NumPy order) of a tensor of ``shape`` and
        ``strides`` (bytes; default: C-contiguous) at the start of ``memory``.  Out-of-bounds elements of an
        edge box read as zero (``oob_fill='nan'``: NaN, floating point only)."""
        call = "cuTensorMapEncodeTiled"
        tm, name, elem, dims, steps, rank = cls._start(memory, dtype, shape, strides, call, param_alignment)
        inter = _choice(INTERLEAVES, interleave, "interleave", call)
        swz = _choice(SWIZZLES, swizzle, "swizzle", call)
        l2 = _choice(L2_PROMOTIONS, l2_promotion, "l2_promotion", call)
        oob = _choice(OOB_FILLS, oob_fill, "oob_fill", call)
        estrides = cls._common(call, tm.address, elem, rank, steps, inter, element_strides, name, oob)
        boxes = _ints(box, "box", call, rank=rank)
        if any(not 1 <= b <= 256 for b in boxes):
            raise invalid(call, f"box sizes must each be 1 to 256, got {tuple(boxes)}")
        inner = boxes[-1] * elem
        if inter == 0:
            if inner % 16:
                raise invalid(call, f"the inner box ({boxes[-1]} x {elem} bytes = {inner}) must be a multiple of 16 "
                                    f"bytes")
            span = _SWIZZLE_SPAN[swz]
            if span is not None and inner > span:
                raise invalid(call, f"the inner box ({inner} bytes) must not exceed the swizzle span ({span} bytes "
                                    f"for swizzle={swizzle!r})")
        drv = memory.context.driver
        c = _CArrays(dims, steps, estrides)
        box_c = ffi.new("cuuint32_t[]", boxes[::-1])
        rc = memory.context.call(drv.cuTensorMapEncodeTiled, tm._map,
                                 ffi.typeof("CUtensorMapDataType").relements[DATA_TYPES[name][0]], rank,
                                 ffi.cast("void *", tm.address), c.dims, c.strides, box_c, c.estrides, inter, swz,
                                 l2, oob)
        if rc:
            raise drv.error(rc, call)
        return tm

    @classmethod
    def im2col(cls, memory: Any, dtype: Any, shape: Any, *, lower_corner: Any, upper_corner: Any,
               channels_per_pixel: int, pixels_per_column: int, strides: Any = None, element_strides: Any = None,
               interleave: str = "none", swizzle: str = "none", l2_promotion: str = "none", oob_fill: str = "zero",
               param_alignment: int = 64) -> TensorMap:
        """cuTensorMapEncodeIm2col for a tensor of ``shape`` (NumPy order: N, [D, [H,]] W, C; rank 3 to 5).
        ``lower_corner`` / ``upper_corner`` are the bounding box's corners over the spatial dimensions (rank - 2
        of them, NumPy order), each within [-2**15, 2**15) for rank 3, [-2**7, 2**7) for 4, [-2**4, 2**4) for 5."""
        call = "cuTensorMapEncodeIm2col"
        tm, name, elem, dims, steps, rank = cls._start(memory, dtype, shape, strides, call, param_alignment)
        if not 3 <= rank <= 5:
            raise invalid(call, f"an im2col tensor map has rank 3 to 5, got shape {tuple(dims)}")
        inter = _choice(INTERLEAVES, interleave, "interleave", call)
        swz = _choice(SWIZZLES, swizzle, "swizzle", call)
        l2 = _choice(L2_PROMOTIONS, l2_promotion, "l2_promotion", call)
        oob = _choice(OOB_FILLS, oob_fill, "oob_fill", call)
        estrides = cls._common(call, tm.address, elem, rank, steps, inter, element_strides, name, oob)
        lower = _ints(lower_corner, "lower_corner", call, rank=rank - 2)
        upper = _ints(upper_corner, "upper_corner", call, rank=rank - 2)
        limit = _IM2COL_CORNER[rank]
        if any(not -limit <= v < limit for v in lower + upper):
            raise invalid(call, f"corners must lie in [{-limit}, {limit - 1}] for rank {rank}, got {tuple(lower)} and "
                                f"{tuple(upper)}")
        if channels_per_pixel.__class__ is not int or not 1 <= channels_per_pixel <= 256:
            raise invalid(call, f"channels_per_pixel must be 1 to 256, got {channels_per_pixel!r}")
        if pixels_per_column.__class__ is not int or not 1 <= pixels_per_column <= 1024:
            raise invalid(call, f"pixels_per_column must be 1 to 1024, got {pixels_per_column!r}")
        if inter == 0 and channels_per_pixel * elem % 16:
            raise invalid(call, f"channels_per_pixel x element size ({channels_per_pixel * elem} bytes) must be a "
                                f"multiple of 16 bytes without interleave")
        drv = memory.context.driver
        c = _CArrays(dims, steps, estrides)
        lower_c, upper_c = ffi.new("int[]", lower[::-1] or [0]), ffi.new("int[]", upper[::-1] or [0])
        rc = memory.context.call(drv.cuTensorMapEncodeIm2col, tm._map,
                                 ffi.typeof("CUtensorMapDataType").relements[DATA_TYPES[name][0]], rank,
                                 ffi.cast("void *", tm.address), c.dims, c.strides, lower_c, upper_c,
                                 channels_per_pixel, pixels_per_column, c.estrides, inter, swz, l2, oob)
        if rc:
            raise drv.error(rc, call)
        return tm

    def __repr__(self) -> str:
        return f"<cuproc.TensorMap {self.data_type}{list(self.shape)} over {self.memory!r}>"

    def __reduce__(self) -> Any:
        raise TypeError("a TensorMap holds an address of this process's device memory and cannot be pickled")


class _CArrays:
    """The driver's innermost-first arrays for a NumPy-order shape, strides and element strides."""

    def __init__(self, dims: list[int], steps: list[int], estrides: list[int]) -> None:
        self.dims = ffi.new("cuuint64_t[]", dims[::-1])
        self.strides = ffi.new("cuuint64_t[]", steps[::-1][1:] or [0])   # rank - 1 strides, dimension 1 up
        self.estrides = ffi.new("cuuint32_t[]", estrides[::-1])


__all__ = ["DATA_TYPES", "INTERLEAVES", "L2_PROMOTIONS", "OOB_FILLS", "SWIZZLES", "TensorMap", "TensorMapParam",
           "param_type"]
