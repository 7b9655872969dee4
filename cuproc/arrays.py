"""CUDA arrays: opaque, texture-laid-out device memory (cuArrayCreate, cuArray3DCreate, cuMipmappedArrayCreate),
and the copies into and out of them (cuMemcpy2D / cuMemcpy3D and their Async forms).

Policy
------
* **Ownership.**  A :class:`CudaArray` is a :class:`~cuproc._resource.Resource` whose parent is the
  context it was made in; ``close()`` (or ``destroy()``, a ``with`` block, or the finalizer) gives it back
  with cuArrayDestroy, from any thread.  A :class:`MipmappedArray` owns its levels: :meth:`MipmappedArray.level`
  returns a not-owned CudaArray that holds the mipmapped array and refuses use once it ended (the driver
  frees the levels with it; cuArrayDestroy is never called on one).
* **The ABI the requested version selects.**  The descriptor struct each call takes
  (``CUDA_ARRAY_DESCRIPTOR_v1`` with 32-bit sizes, or ``_v2`` with ``size_t`` ones; the same for the 3-D
  descriptor and ``CUDA_MEMCPY2D`` / ``CUDA_MEMCPY3D``) is read from the parameter type of the entry point
  the handle selected -- a capability of the ABI, never a comparison of version numbers.  A size that the
  selected struct cannot hold is refused before the call, naming the struct.
* **Checked before the driver sees anything.**  Dimensions against the kind of array (1-D, 2-D, 3-D,
  layered, cubemap: the rules of cuArray3DCreate's documentation), the channel count, and every copy's
  region against the array's extent and the linear side's size.  A refusal says the call was not made.
* **Copies** go through :func:`copy` (or :meth:`CudaArray.copy_from` / :meth:`CudaArray.copy_to`): host
  memory (any C-contiguous buffer-protocol object, or cuproc pinned memory), device memory (a
  DeviceBuffer, a view, an int address) or another array on either side.  ``memory.copy(dst, src)`` takes a
  CudaArray on either side too and copies the whole array (:func:`copy_whole`): the other side must match
  it -- an array of the same extent and element type, a NumPy-like host array of its
  :attr:`~CudaArray.numpy_shape` and dtype, or linear memory of at least its bytes.  Without a stream
  the copy is synchronous and runs with the array's context current (it would otherwise run in whichever
  context is current); with one it is queued there, after the work cuproc last queued on a DeviceBuffer
  side on another stream, and that buffer's ``last_stream`` becomes the stream.  Host memory given to an
  asynchronous copy must stay alive (and unchanged) until the stream has run it.
* Arrays are addressed in elements as CUDA counts them: ``x`` along the width, ``y`` along the height,
  ``z`` along the depth, a layer of a layered array, or a face of a cubemap.  The host layout of a whole
  array is C order ``(depth, height, width, channels)`` with the zero dimensions left out
  (:attr:`CudaArray.numpy_shape`).
"""
from __future__ import annotations

from typing import Any

from ._ffi import ffi
from ._header_data import DEFINES
from ._resource import FORKED, Resource
from ._support import handle_int, invalid
from .allocation import Allocation
from .context import Context
from .device_memory import DeviceBuffer, DeviceView, order_after
from .driver import Driver
from .stream import Stream, as_stream, default_stream

#: element type name -> (CUarray_format enumerator, bytes per channel)
FORMATS: dict[str, tuple[str, int]] = {
    "uint8": ("CU_AD_FORMAT_UNSIGNED_INT8", 1), "uint16": ("CU_AD_FORMAT_UNSIGNED_INT16", 2),
    "uint32": ("CU_AD_FORMAT_UNSIGNED_INT32", 4), "int8": ("CU_AD_FORMAT_SIGNED_INT8", 1),
    "int16": ("CU_AD_FORMAT_SIGNED_INT16", 2), "int32": ("CU_AD_FORMAT_SIGNED_INT32", 4),
    "float16": ("CU_AD_FORMAT_HALF", 2), "float32": ("CU_AD_FORMAT_FLOAT", 4),
}
_FORMAT_NAMES = {name: dtype for dtype, (name, _) in FORMATS.items()}
#: the integer formats (a texture over them may not filter linearly while it returns integers)
INTEGER_DTYPES = frozenset({"uint8", "uint16", "uint32", "int8", "int16", "int32"})
CHANNELS = (1, 2, 4)
LAYERED = DEFINES["CUDA_ARRAY3D_LAYERED"]
SURFACE_LDST = DEFINES["CUDA_ARRAY3D_SURFACE_LDST"]
CUBEMAP = DEFINES["CUDA_ARRAY3D_CUBEMAP"]
TEXTURE_GATHER = DEFINES["CUDA_ARRAY3D_TEXTURE_GATHER"]
_MEMORYTYPE = {"host": 1, "device": 2, "array": 3}   # CUmemorytype


def dtype_name(dtype: Any, call: str) -> str:
    """The element type's name in :data:`FORMATS` for a name ("float32"), a NumPy dtype or scalar type, or a
    CUarray_format enumerator's name; refused (naming ``call``) for anything a CUDA array cannot hold."""
    found: Any = _FORMAT_NAMES.get(dtype, dtype) if isinstance(dtype, str) else getattr(dtype, "name", None)
    if not isinstance(found, str):           # a NumPy scalar type (numpy.float32) or a Python class
        found = getattr(dtype, "__name__", str(dtype))
    name = str(found)
    if name not in FORMATS:
        raise invalid(call, f"a CUDA array holds elements of {', '.join(FORMATS)}; got {dtype!r}")
    return name


def _entry_struct(drv: Driver, call: str, index: int) -> Any:
    """The struct type parameter ``index`` of the entry point the handle selected for ``call`` points to:
    the descriptor ABI of the requested version (``CUDA_ARRAY_DESCRIPTOR_v1`` or ``_v2``...)."""
    res = drv.resolution(call)
    if res.typedef is None:
        raise drv.unavailable_error(res)
    return ffi.typeof(res.typedef).args[index].item


#: the calls that take a descriptor struct, and the position of its pointer among their parameters
STRUCT_PARAMETERS = {"cuArrayCreate": 1, "cuArray3DCreate": 1, "cuMipmappedArrayCreate": 1, "cuArrayGetDescriptor": 0,
                     "cuArray3DGetDescriptor": 0, "cuMemcpy2D": 0, "cuMemcpy2DAsync": 0, "cuMemcpy3D": 0,
                     "cuMemcpy3DAsync": 0}


def descriptor_type(driver: Driver, call: str) -> Any:
    """The struct type (a cffi CType) ``call`` takes in the ABI ``driver`` selected at its requested version
    (for cuArrayCreate: ``CUDA_ARRAY_DESCRIPTOR_v1`` with 32-bit sizes before CUDA 3.2, ``_v2`` after): what
    every call here fills."""
    if call not in STRUCT_PARAMETERS:
        raise ValueError(f"{call} is not one of {', '.join(STRUCT_PARAMETERS)}")
    return _entry_struct(driver, call, STRUCT_PARAMETERS[call])


def struct_name(ctype: Any) -> str:
    """``CUDA_ARRAY_DESCRIPTOR_v1`` for ``struct CUDA_ARRAY_DESCRIPTOR_v1_st`` (``..._v2`` for the unsuffixed
    tag, which the headers typedef as ``_v2``): the name the driver API documentation uses."""
    name = str(ctype.cname).removeprefix("struct ").removesuffix("_st")
    return name if name.endswith("_v1") else name + "_v2"


def _fill(struct: Any, call: str, **fields: int) -> None:
    """Store ``fields`` into a descriptor, refusing a value its (selected) field type cannot hold."""
    for name, value in fields.items():
        try:
            setattr(struct, name, value)
        except OverflowError:
            raise invalid(call, f"{name}={value} does not fit {struct_name(ffi.typeof(struct).item)}, the struct "
                                f"the requested CUDA version "
                                f"selects for {call} (request a newer version for 64-bit sizes)") from None


def _count(value: Any, what: str, call: str) -> int:
    if value.__class__ is bool or not isinstance(value, int) or value < 0:
        raise invalid(call, f"{what} must be an int >= 0, got {value!r}")
    return value


def check_shape(width: int, height: int, depth: int, flags: int, call: str) -> None:
    """The rules of cuArray3DCreate's documentation for the kind of array ``flags`` asks for."""
    layered, cubemap = bool(flags & LAYERED), bool(flags & CUBEMAP)
    if width <= 0:
        raise invalid(call, f"width must be > 0, got {width}")
    if cubemap:
        if width != height:
            raise invalid(call, f"a cubemap's faces are square: width ({width}) must equal height ({height})")
        if (not layered and depth != 6) or (layered and (depth <= 0 or depth % 6)):
            raise invalid(call, f"a cubemap has depth 6 (a layered one a multiple of 6: six faces per layer), "
                                f"got {depth}")
    elif layered:
        if depth <= 0:
            raise invalid(call, f"a layered array needs depth > 0 (the number of layers), got {depth}")
    elif depth and not height:
        raise invalid(call, f"a 3-D array needs height > 0 with depth {depth} (1-D: height 0 and depth 0)")


class CudaArray(Resource):
    """A CUDA array (cuArrayCreate / cuArray3DCreate): ``width`` x ``height`` x ``depth`` elements of ``dtype``
    with ``channels`` components each (0 for an unused dimension, as the driver counts).

    Made by :meth:`create`; a level of a :class:`MipmappedArray` comes from :meth:`MipmappedArray.level`.
    ``handle`` is the CUarray.  Its context must stay usable (it is held)."""

    __slots__ = ("handle", "context", "width", "height", "depth", "dtype", "channels", "flags", "owner")
    _release_call = "cuArrayDestroy"
    _ended_word = "destroyed"

    handle: Any
    context: Context
    owner: MipmappedArray | None

    def __init__(self, handle: Any, context: Context, width: int, height: int, depth: int, dtype: str, channels: int,
                 flags: int, owner: MipmappedArray | None = None) -> None:
        """Wrap a CUarray of ``context`` (owned unless ``owner``, the mipmapped array that owns it, is given)."""
        self.driver = context.driver
        self.ended = None
        self.handle, self.context, self.owner = handle, context, owner
        self.width, self.height, self.depth = width, height, depth
        self.dtype, self.channels, self.flags = dtype, channels, flags

    @classmethod
    def create(cls, width: int, height: int = 0, depth: int = 0, *, dtype: Any = "float32", channels: int = 1,
               layered: bool = False, cubemap: bool = False, surface: bool = False, texture_gather: bool = False,
               context: Context | None = None, driver: Driver | None = None) -> CudaArray:
        """A new array in ``context`` (default: the current one).

        1-D: ``width``; 2-D: ``width, height``; 3-D: ``width, height, depth``.  ``layered=True``: ``depth`` is
        the number of layers (of 1-D layers when ``height`` is 0).  ``cubemap=True``: ``width == height`` and
        ``depth`` 6 (a multiple of 6 when layered too).  ``surface=True`` allows surface objects over it
        (CUDA_ARRAY3D_SURFACE_LDST); ``texture_gather=True`` allows tex2Dgather.  A 1-D or 2-D array without
        flags is made with cuArrayCreate, anything else with cuArray3DCreate."""
        call = "cuArrayCreate"
        width, height, depth = (_count(v, n, call) for v, n in ((width, "width"), (height, "height"),
                                                               (depth, "depth")))
        name = dtype_name(dtype, call)
        if channels not in CHANNELS:
            raise invalid(call, f"channels must be 1, 2 or 4, got {channels!r}")
        flags = (LAYERED if layered else 0) | (CUBEMAP if cubemap else 0) | (SURFACE_LDST if surface else 0) | \
            (TEXTURE_GATHER if texture_gather else 0)
        if texture_gather and (depth or not height):
            raise invalid(call, "texture_gather=True needs a 2-D array (tex2Dgather reads 2-D textures)")
        call = "cuArrayCreate" if not flags and not depth else "cuArray3DCreate"
        check_shape(width, height, depth, flags, call)
        ctx, run = Context.target(context, call, driver=driver)
        drv = ctx.driver
        desc = ffi.new(ffi.getctype(_entry_struct(drv, call, 1), "*"))
        fmt = ffi.typeof("CUarray_format").relements[FORMATS[name][0]]
        _fill(desc, call, Width=width, Height=height)
        if call == "cuArray3DCreate":
            _fill(desc, call, Depth=depth, Flags=flags)
        desc.Format, desc.NumChannels = fmt, channels
        out = ffi.new("CUarray *")
        rc = run(getattr(drv, call), out, desc)
        if rc:
            raise drv.error(rc, call)
        return cls(out[0], ctx, width, height, depth, name, channels, flags)

    # ---------------------------------------------------------------- lifetime
    def parents(self) -> tuple[Resource, ...]:
        return (self.context,) if self.owner is None else (self.owner,)

    def describe(self) -> str:
        kind = "level of a mipmapped array" if self.owner is not None else "CUDA array"
        return f"{kind} {handle_int(self.handle):#x} ({self.extent_text})"

    def _release(self) -> int:
        if self.owner is not None:          # a mipmap level goes with its mipmapped array
            return 0
        return self.context.call(self.driver.cuArrayDestroy, self.handle)

    def _drop_releases_a_handle(self) -> bool:
        return self.owner is None

    def destroy(self) -> None:
        """cuArrayDestroy now (idempotent).  Texture and surface objects over it refuse use from then on."""
        self.close()

    # ---------------------------------------------------------------- what it is
    @property
    def extent_text(self) -> str:
        dims = "x".join(str(d) for d in (self.width, self.height, self.depth) if d) or "0"
        kinds = [word for bit, word in ((LAYERED, "layered"), (CUBEMAP, "cubemap"), (SURFACE_LDST, "surface"))
                 if self.flags & bit]
        return f"{dims} {self.dtype}x{self.channels}" + (f", {', '.join(kinds)}" if kinds else "")

    @property
    def element_size(self) -> int:
        """Bytes per element: channels times the channel's size."""
        return FORMATS[self.dtype][1] * self.channels

    @property
    def format(self) -> int:
        """The CUarray_format value."""
        return int(ffi.typeof("CUarray_format").relements[FORMATS[self.dtype][0]])

    @property
    def layered(self) -> bool:
        return bool(self.flags & LAYERED)

    @property
    def cubemap(self) -> bool:
        return bool(self.flags & CUBEMAP)

    @property
    def extent(self) -> tuple[int, int, int]:
        """(width, rows, slices) a copy addresses: height and depth count as 1 where they are 0."""
        return self.width, max(self.height, 1), max(self.depth, 1)

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        """The C-order host shape of the whole array: (depth, height, width[, channels]), zeros left out."""
        dims = tuple(d for d in (self.depth, self.height, self.width) if d)
        return dims + ((self.channels,) if self.channels > 1 else ())

    @property
    def nbytes(self) -> int:
        """The bytes of the whole array in the host layout (the driver's own layout is opaque)."""
        w, h, d = self.extent
        return w * h * d * self.element_size

    def descriptor(self) -> dict[str, int]:
        """What the driver says the array is (cuArray3DGetDescriptor, in the selected ABI): width, height,
        depth, format, channels, flags."""
        call = "cuArray3DGetDescriptor"
        self.check(call)
        desc = ffi.new(ffi.getctype(_entry_struct(self.driver, call, 0), "*"))
        rc = self.context.call(self.driver.cuArray3DGetDescriptor, desc, self.handle)
        if rc:
            raise self.driver.error(rc, call)
        return {"width": int(desc.Width), "height": int(desc.Height), "depth": int(desc.Depth),
                "format": int(desc.Format), "channels": int(desc.NumChannels), "flags": int(desc.Flags)}

    # ---------------------------------------------------------------- copies
    def copy_from(self, src: Any, *, origin: tuple[int, ...] = (0, 0, 0), extent: tuple[int, ...] | None = None,
                  pitch: int | None = None, stream: Stream | Any | None = None) -> None:
        """Copy ``src`` (host, device or another array) into this array's region at ``origin`` (see :func:`copy`)."""
        copy(self, src, dst_origin=origin, extent=extent, pitch=pitch, stream=stream)

    def copy_to(self, dst: Any, *, origin: tuple[int, ...] = (0, 0, 0), extent: tuple[int, ...] | None = None,
                pitch: int | None = None, stream: Stream | Any | None = None) -> None:
        """Copy this array's region at ``origin`` into ``dst`` (see :func:`copy`)."""
        copy(dst, self, src_origin=origin, extent=extent, pitch=pitch, stream=stream)

    def __repr__(self) -> str:
        state = self.ended or f"{handle_int(self.handle):#x}"
        return f"<cuproc.CudaArray {self.extent_text} at {state}>"


class MipmappedArray(Resource):
    """A mipmapped CUDA array (cuMipmappedArrayCreate): ``levels`` levels, level 0 of ``width`` x ``height`` x
    ``depth``; each level halves every dimension (down to 1).  :meth:`level` gives one level as a CudaArray
    to copy into; a texture object over the whole takes this object."""

    __slots__ = ("handle", "context", "width", "height", "depth", "dtype", "channels", "flags", "levels")
    _release_call = "cuMipmappedArrayDestroy"
    _ended_word = "destroyed"

    handle: Any
    context: Context
    width: int
    height: int
    depth: int
    dtype: str
    channels: int
    flags: int
    levels: int

    @classmethod
    def create(cls, width: int, height: int = 0, depth: int = 0, *, levels: int, dtype: Any = "float32",
               channels: int = 1, layered: bool = False, cubemap: bool = False, surface: bool = False,
               context: Context | None = None, driver: Driver | None = None) -> MipmappedArray:
        """A new mipmapped array in ``context`` (default: the current one); dimensions as for
        :meth:`CudaArray.create`.  ``levels`` must be at least 1 and at most 1 + log2 of the largest dimension
        (the driver's rule)."""
        call = "cuMipmappedArrayCreate"
        width, height, depth = (_count(v, n, call) for v, n in ((width, "width"), (height, "height"),
                                                               (depth, "depth")))
        name = dtype_name(dtype, call)
        if channels not in CHANNELS:
            raise invalid(call, f"channels must be 1, 2 or 4, got {channels!r}")
        flags = (LAYERED if layered else 0) | (CUBEMAP if cubemap else 0) | (SURFACE_LDST if surface else 0)
        check_shape(width, height, depth, flags, call)
        largest = max(width, height, 0 if layered else depth)
        most = largest.bit_length()              # 1 + floor(log2(largest))
        if levels.__class__ is not int or not 1 <= levels <= most:
            raise invalid(call, f"levels must be an int from 1 to {most} for a largest dimension of {largest}, "
                                f"got {levels!r}")
        ctx, run = Context.target(context, call, driver=driver)
        drv = ctx.driver
        desc = ffi.new(ffi.getctype(_entry_struct(drv, call, 1), "*"))
        _fill(desc, call, Width=width, Height=height, Depth=depth, Flags=flags)
        desc.Format = ffi.typeof("CUarray_format").relements[FORMATS[name][0]]
        desc.NumChannels = channels
        out = ffi.new("CUmipmappedArray *")
        rc = run(drv.cuMipmappedArrayCreate, out, desc, levels)
        if rc:
            raise drv.error(rc, call)
        self = cls.__new__(cls)
        self.driver, self.ended, self.handle, self.context = drv, None, out[0], ctx
        self.width, self.height, self.depth, self.dtype, self.channels = width, height, depth, name, channels
        self.flags, self.levels = flags, levels
        return self

    def parents(self) -> tuple[Resource, ...]:
        return (self.context,)

    def describe(self) -> str:
        return f"mipmapped array {handle_int(self.handle):#x} ({self.levels} levels)"

    def _release(self) -> int:
        return self.context.call(self.driver.cuMipmappedArrayDestroy, self.handle)

    def destroy(self) -> None:
        """cuMipmappedArrayDestroy now (idempotent); its levels and textures over it refuse use afterwards."""
        self.close()

    def level_extent(self, level: int) -> tuple[int, int, int]:
        """(width, height, depth) of ``level``: each nonzero dimension halved per level, never below 1 (the
        layers or faces of a layered or cubemap array are not halved)."""
        def half(n: int, keep: bool = False) -> int:
            return n if keep or not n else max(n >> level, 1)
        return half(self.width), half(self.height), half(self.depth, keep=bool(self.flags & (LAYERED | CUBEMAP)))

    def level(self, level: int) -> CudaArray:
        """Level ``level`` as a CudaArray (cuMipmappedArrayGetLevel): owned by this object, which it holds."""
        call = "cuMipmappedArrayGetLevel"
        if level.__class__ is not int or not 0 <= level < self.levels:
            raise invalid(call, f"level must be an int from 0 to {self.levels - 1}, got {level!r}")
        self.check(call)
        out = ffi.new("CUarray *")
        rc = self.context.call(self.driver.cuMipmappedArrayGetLevel, out, self.handle, level)
        if rc:
            raise self.driver.error(rc, call)
        w, h, d = self.level_extent(level)
        return CudaArray(out[0], self.context, w, h, d, self.dtype, self.channels, self.flags, owner=self)

    def __repr__(self) -> str:
        state = self.ended or f"{handle_int(self.handle):#x}"
        return f"<cuproc.MipmappedArray {self.width}x{self.height}x{self.depth} {self.dtype}x{self.channels}, " \
               f"{self.levels} levels at {state}>"


# ------------------------------------------------------------------------------------------------ copies
class _Side:
    """One side of an array copy: where it is and how it is laid out."""

    __slots__ = ("kind", "array", "address", "nbytes", "keep", "buffer", "context")

    def __init__(self, kind: str, array: CudaArray | None = None, address: int = 0, nbytes: int | None = None,
                 keep: Any = None, buffer: DeviceBuffer | None = None, context: Context | None = None) -> None:
        self.kind, self.array, self.address, self.nbytes, self.keep = kind, array, address, nbytes, keep
        self.buffer, self.context = buffer, context


def _side(obj: Any, call: str, *, writable: bool) -> _Side:
    if isinstance(obj, CudaArray):
        obj.check(call)
        return _Side("array", array=obj, context=obj.context)
    if isinstance(obj, Allocation):
        obj.check(call)
        if writable and obj.read_only:
            raise invalid(call, f"{obj.describe()} was registered read-only: it cannot be written")
        kind = "host" if obj.kind == "host" else "device"
        buffer = obj if obj.__class__ is DeviceBuffer and isinstance(obj, DeviceBuffer) else None
        return _Side(kind, address=obj.address, nbytes=obj.nbytes, keep=obj, buffer=buffer, context=obj.context)
    if isinstance(obj, DeviceView):
        obj.check(call)
        return _Side("device", address=obj.ptr, nbytes=obj.nbytes, keep=obj, buffer=obj.buffer, context=obj.context)
    if isinstance(obj, MipmappedArray):
        raise invalid(call, "copy into or out of one level of a mipmapped array: pass mipmapped.level(i)")
    if isinstance(obj, int) and not isinstance(obj, bool):
        if obj <= 0:
            raise invalid(call, f"a device address must be a positive int, got {obj}")
        return _Side("device", address=obj)
    try:
        cbuf = ffi.from_buffer(obj, require_writable=writable)
    except (TypeError, BufferError, ValueError) as exc:
        need = "a writable, C-contiguous" if writable else "a C-contiguous"
        raise invalid(call, f"each side is a CudaArray, device memory (a DeviceBuffer, a view, an int address) or "
                            f"{need} buffer-protocol host object; got {type(obj).__name__} ({exc})") from None
    return _Side("host", address=handle_int(cbuf), nbytes=len(cbuf), keep=cbuf)


def _triple(value: Any, what: str, call: str) -> tuple[int, int, int]:
    try:
        items = tuple(value)
    except TypeError:
        items = (value,)
    if not 1 <= len(items) <= 3 or any(i.__class__ is bool or not isinstance(i, int) or i < 0 for i in items):
        raise invalid(call, f"{what} is 1 to 3 ints >= 0 (x, y, z), got {value!r}")
    return items + (0,) * (3 - len(items))  # type: ignore[return-value]


def _check_region(side: _Side, origin: tuple[int, int, int], extent: tuple[int, int, int], label: str,
                  call: str) -> None:
    array = side.array
    assert array is not None
    limits = array.extent
    for axis, o, e, n in zip("xyz", origin, extent, limits):
        if o + e > n:
            raise invalid(call, f"the {label} region {axis} {o}..{o + e} is outside {array.describe()} "
                                f"(0..{n} along {axis}); nothing was copied")


def copy(dst: Any, src: Any, *, dst_origin: tuple[int, ...] = (0, 0, 0), src_origin: tuple[int, ...] = (0, 0, 0),
         extent: tuple[int, ...] | None = None, pitch: int | None = None, stream: Stream | Any | None = None
         ) -> None:
    """Copy a region between a CUDA array and host memory, device memory or another array (either direction).

    ``extent`` is (width, height, depth) in elements; it defaults to the whole array side (the source array
    when both are arrays) from its origin.  Origins apply to array sides.  A linear side starts at its
    beginning with rows of ``pitch`` bytes (default: packed, width times the element size) and
    ``height`` rows per slice; its size must cover the region.  Arrays of both sides must have the same
    element size.  cuMemcpy2D for 1-D and 2-D arrays, cuMemcpy3D otherwise (``Async`` with ``stream``),
    with the descriptor struct the requested version selects.  Asynchronous with a stream: host memory must
    stay alive until the stream has run the copy.
    """
    d, s = _side(dst, "cuMemcpy3D", writable=True), _side(src, "cuMemcpy3D", writable=False)
    if d.kind != "array" and s.kind != "array":
        raise invalid("cuMemcpy3D", "neither side is a CudaArray: use cuproc.memory.copy (or copy_2d / copy_3d) "
                                    "for linear memory")
    arrays = [x.array for x in (d, s) if x.array is not None]
    elem = arrays[0].element_size
    if any(a.element_size != elem for a in arrays):
        raise invalid("cuMemcpy3D", f"the arrays' elements differ in size ({arrays[0].element_size} and "
                                    f"{arrays[1].element_size} bytes): a copy moves whole elements")
    do, so = _triple(dst_origin, "dst_origin", "cuMemcpy3D"), _triple(src_origin, "src_origin", "cuMemcpy3D")
    if extent is None:
        base, origin = (s, so) if s.kind == "array" else (d, do)
        assert base.array is not None
        extent3 = tuple(n - o for n, o in zip(base.array.extent, origin))
        if any(e <= 0 for e in extent3):
            raise invalid("cuMemcpy3D", f"the origin {origin} is outside {base.array.describe()}")
        w, h, z = extent3
    else:
        w, h, z = _triple(extent, "extent", "cuMemcpy3D")
        h, z = max(h, 1), max(z, 1)
    three_d = any(a.depth for a in arrays) or z > 1
    call = "cuMemcpy3D" if three_d else "cuMemcpy2D"
    for side, origin, label in ((d, do, "destination"), (s, so, "source")):
        if side.kind == "array":
            _check_region(side, origin, (w, h, z), label, call)
        elif origin != (0, 0, 0):
            raise invalid(call, f"the {label} is linear memory: give its start (a slice, an address) instead of an "
                                f"origin")
    row = w * elem
    if pitch is not None and (pitch.__class__ is bool or not isinstance(pitch, int) or pitch < row):
        raise invalid(call, f"pitch must be an int >= the row's {row} bytes, got {pitch!r}")
    lpitch = row if pitch is None else pitch
    for side, label in ((d, "destination"), (s, "source")):
        if side.kind != "array" and side.nbytes is not None:
            needed = lpitch * h * (z - 1) + lpitch * (h - 1) + row if w else 0
            if needed > side.nbytes:
                raise invalid(call, f"the {label} needs {needed} bytes for a {w}x{h}x{z} region of {elem}-byte "
                                    f"elements (pitch {lpitch}); it has {side.nbytes}")
    if w == 0:
        return
    ctx = next(x.context for x in (d, s) if x.array is not None)
    assert ctx is not None
    drv = ctx.driver
    entry = call if stream is None else call + "Async"
    handle = None
    waiter = None
    if stream is not None:
        stream = as_stream(stream, entry, context=ctx, driver=drv)
        if isinstance(stream, Stream):
            stream.check(entry)
            handle, waiter = stream.handle, stream
        else:
            handle = ffi.cast("CUstream", stream)
    p = ffi.new(ffi.getctype(_entry_struct(drv, entry, 0), "*"))
    for prefix, side, origin in (("src", s, so), ("dst", d, do)):
        setattr(p, prefix + "MemoryType", _MEMORYTYPE[side.kind])
        if side.kind == "array":
            assert side.array is not None
            setattr(p, prefix + "Array", side.array.handle)
            _fill(p, call, **{prefix + "XInBytes": origin[0] * elem, prefix + "Y": origin[1]})
            if three_d:
                _fill(p, call, **{prefix + "Z": origin[2]})
        else:
            if side.kind == "host":
                setattr(p, prefix + "Host", ffi.cast("void *", side.address))
            else:
                _fill(p, call, **{prefix + "Device": side.address})
            _fill(p, call, **{prefix + "Pitch": lpitch})
            if three_d:
                _fill(p, call, **{prefix + "Height": h})
    _fill(p, call, WidthInBytes=row, Height=h)
    if three_d:
        _fill(p, call, Depth=z)
    buffers = [x.buffer for x in (d, s) if x.buffer is not None]
    last: Stream | int | None = None if stream is None else (stream if isinstance(stream, Stream)
                                                             else handle_int(handle) or None)
    fn = getattr(drv, entry)
    if FORKED[0]:
        ctx.check(entry)
    if stream is None:
        for buffer in buffers:                     # the default stream waits for work left on others
            if buffer.last_stream is not None:
                order_after(buffer.last_stream, ctx, default_stream(drv))
        rc = ctx.call_current(fn, p)
    else:
        for buffer in buffers:
            if buffer.last_stream is not last:
                order_after(buffer.last_stream, ctx, handle, waiter)
        rc = ctx.call_on(handle, fn, p, handle)
    if rc:
        raise drv.error(rc, entry)
    for buffer in buffers:
        buffer.last_stream = last


def _typed(obj: Any) -> tuple[tuple[int, ...], str] | None:
    """(shape, dtype name) of a host array that says what it holds (NumPy's, or one with the same ``shape``
    and ``dtype.name``), else None: raw bytes and device memory are checked by their size only."""
    name = getattr(getattr(obj, "dtype", None), "name", None)
    shape = getattr(obj, "shape", None)
    if not isinstance(name, str) or not isinstance(shape, tuple) or isinstance(obj, (Allocation, DeviceView)):
        return None
    return shape, name


def _matching(array: CudaArray, other: Any, side: _Side, label: str, call: str) -> None:
    """Refuse ``other`` (the ``label`` side, read into :class:`_Side` ``side``) unless it holds exactly what
    ``array`` holds: the same extent and element type for an array, the same NumPy shape and dtype for a
    typed host array, at least the array's bytes for any other linear memory."""
    whole = f"{array.describe()} (NumPy shape {array.numpy_shape}, {array.dtype}, {array.nbytes} bytes)"
    if side.array is not None:
        theirs = side.array
        if (theirs.width, theirs.height, theirs.depth, theirs.dtype, theirs.channels) != \
                (array.width, array.height, array.depth, array.dtype, array.channels):
            raise invalid(call, f"the arrays differ: the {label} is {theirs.describe()}, the other side is {whole}; "
                                f"for a region or a reinterpretation use cuproc.arrays.copy with extent= and "
                                f"origins")
        return
    typed = _typed(other)
    if typed is not None and typed != (array.numpy_shape, array.dtype):
        raise invalid(call, f"the {label} is a {type(other).__name__} of shape {typed[0]} and dtype {typed[1]}; the "
                            f"other side is {whole}: give a host array of that shape and dtype (or a region with "
                            f"cuproc.arrays.copy)")
    if side.nbytes is not None and side.nbytes < array.nbytes:
        raise invalid(call, f"the {label} has {side.nbytes} bytes; the other side is {whole}")


def copy_whole(dst: Any, src: Any, nbytes: int | None = None, *, stream: Stream | Any | None = None) -> None:
    """What ``cuproc.memory.copy(dst, src, nbytes, stream=...)`` does when either side is a CudaArray: copy the
    whole array, after checking that the other side holds the same (see the module docstring) -- a linear
    copy's "the smaller side" would cut an array at a row or reinterpret its shape.  ``nbytes``, if given, must
    be the array's size.  cuMemcpy2D / cuMemcpy3D (``Async`` with ``stream``) as :func:`copy` makes them, in the
    array's context; a region or another layout goes through :func:`copy` itself."""
    call = "cuMemcpy3D"
    d, s = _side(dst, call, writable=True), _side(src, call, writable=False)
    array = s.array if s.array is not None else d.array
    if array is None:
        raise invalid(call, "neither side is a CudaArray: cuproc.memory.copy copies linear memory itself")
    if s.array is not None:
        _matching(array, dst, d, "destination", call)
    else:
        _matching(array, src, s, "source", call)
    if nbytes is not None and (nbytes.__class__ is bool or nbytes != array.nbytes):
        raise invalid(call, f"a copy with a CUDA array moves the whole array, {array.nbytes} bytes; nbytes={nbytes!r} "
                            f"was given (for a region use cuproc.arrays.copy with extent=)")
    copy(dst, src, stream=stream)


__all__ = ["CUBEMAP", "FORMATS", "LAYERED", "STRUCT_PARAMETERS", "SURFACE_LDST", "TEXTURE_GATHER", "CudaArray",
           "MipmappedArray", "copy", "copy_whole", "descriptor_type", "dtype_name", "struct_name"]

#: What memory.copy hands to this module (a mipmapped array: refused in copy_whole).  The module's last line:
#: cuproc.transfers reads it from sys.modules, where a module another thread is still importing lacks it.
COPY_KINDS = (CudaArray, MipmappedArray)
