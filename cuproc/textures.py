"""Texture and surface objects (cuTexObjectCreate, cuSurfObjectCreate): how kernels read CUDA arrays and linear
memory through the texture units, and write arrays through surfaces.

Policy
------
* **Objects, not references.**  Texture and surface *references* (``cuTexRef*``, ``cuSurfRef*``, bound to a
  module's global) are deprecated by NVIDIA and removed from CUDA 12's runtime; the driver still exports
  them, and where the requested version has them they stay reachable by C name (``cuproc.driver`` /
  ``Driver.cuTexRefSetArray`` ...), unwrapped.  Objects replace them: a 64-bit value made once and passed to
  any kernel as an ``unsigned long long`` (``cudaTextureObject_t`` / ``cudaSurfaceObject_t``).
* **A texture keeps what it reads alive.**  A :class:`TextureObject` holds its resource (a
  :class:`~cuproc.arrays.CudaArray`, a :class:`~cuproc.arrays.MipmappedArray`, a DeviceBuffer or view), which
  holds its context, so dropping every other reference to the array is safe.  Closing the resource
  explicitly while a texture over it lives is allowed (as in C); from then on the texture refuses to be
  passed to a kernel, naming both, and its ``close()`` still destroys the texture handle (which belongs to
  the context, not to the array).
* **Passed to kernels by value.**  The objects carry their C type the way NumPy scalars do: ``dtype``
  (an unsigned 64-bit integer) and ``item()`` (the handle, after checking that the object and everything
  it reads are usable).  So ``launch(fn, grid, block, [tex, out])`` without a signature and signatures
  naming ``"unsigned long long"``, ``"uint64_t"`` or ``"CUtexObject"`` take them, in both launch
  conventions and prepared launches.  They are not integers (no ``__index__``): a texture given where a
  pointer is expected is refused, not passed as an address.
* **Checked before the driver call**: the texture descriptor's modes, linear filtering only where the
  texture returns floating point, wrap and mirror only with normalized coordinates, linear memory's
  alignment (CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT) and a pitch's (TEXTURE_PITCH_ALIGNMENT), sizes within the
  memory, and surfaces only over arrays made with ``surface=True``.
"""
from __future__ import annotations

from typing import Any

from ._ffi import ffi
from ._resource import FORKED, Resource
from ._support import invalid
from .allocation import Allocation
from .arrays import FORMATS, INTEGER_DTYPES, SURFACE_LDST, CudaArray, MipmappedArray, dtype_name
from .context import Context
from .device_memory import DeviceView

ADDRESS_MODES = {"wrap": 0, "clamp": 1, "mirror": 2, "border": 3}
FILTER_MODES = {"point": 0, "linear": 1}
READ_MODES = ("element_type", "normalized_float")
_READ_AS_INTEGER = 0x01            # CU_TRSF_READ_AS_INTEGER
_NORMALIZED_COORDINATES = 0x02     # CU_TRSF_NORMALIZED_COORDINATES
_SRGB = 0x10                       # CU_TRSF_SRGB
_DISABLE_TRILINEAR = 0x20          # CU_TRSF_DISABLE_TRILINEAR_OPTIMIZATION
_SEAMLESS_CUBEMAP = 0x40           # CU_TRSF_SEAMLESS_CUBEMAP
_RESOURCE = {"array": 0, "mipmapped_array": 1, "linear": 2, "pitch2d": 3}   # CUresourcetype


class ObjectValue:
    """The C type of a texture or surface object as a kernel argument: an unsigned 64-bit integer,
    described the way :func:`cuproc.launch.arg_type` reads a NumPy dtype (kind, size, alignment)."""

    kind, itemsize, alignment, fields, name = "u", 8, 8, None, "uint64"

    def __repr__(self) -> str:
        return "ObjectValue(uint64)"


OBJECT_VALUE = ObjectValue()


class _ObjectBase(Resource):
    """What texture and surface objects share: the value, the resource it reads, the context it belongs to."""

    __slots__ = ("handle", "context", "resource")
    _ended_word = "destroyed"
    _leaf = True                  # nothing names a texture or surface as its parent
    #: the C type as a kernel argument (see the module docstring)
    dtype = OBJECT_VALUE

    handle: int
    context: Context
    resource: Any

    def parents(self) -> tuple[Resource, ...]:
        found = [self.resource] if isinstance(self.resource, Resource) else []
        return (*found, self.context)

    def check(self, call: str) -> None:
        """Usable for ``call``: the resource is asked every time (freeing memory, a leaf, moves no epoch: a
        check remembered from before would let a texture over freed memory through), then the rest."""
        self.resource.check(call)
        super().check(call)

    def item(self) -> int:
        """The object's 64-bit value for a kernel argument; raises if it, or what it reads, has ended."""
        self.check(f"a kernel launch with this {type(self).__name__}")
        return self.handle

    def close(self) -> None:
        """Destroy the object now (idempotent).  Its handle belongs to its context: it is destroyed as long as
        the context lives, even when the resource it read was closed first."""
        if self.ended is not None:
            return
        if FORKED[0]:
            self._claim("left behind by fork()")
            return
        if self.context.ended_owner() is not None:
            self._claim(self._ended_word)     # it went with its context
            return
        self._give_back()

    def destroy(self) -> None:
        """cuTexObjectDestroy / cuSurfObjectDestroy now (idempotent): :meth:`close`."""
        self.close()

    def _drop(self) -> int:
        """The finalizer's release: as :meth:`close`, the handle goes back while its context lives."""
        if FORKED[0] or self.context.ended_owner() is not None:
            self.ended = "dropped"
            return 0
        self.ended = "dropped"
        return self._release()

    def __repr__(self) -> str:
        state = self.ended or f"{self.handle:#x}"
        return f"<cuproc.{type(self).__name__} over {self.resource!r} at {state}>"


def _context_of(resource: Any, call: str) -> Context:
    context = getattr(resource, "context", None)
    if not isinstance(context, Context):
        raise invalid(call, f"the resource must be a CudaArray, a MipmappedArray or device memory (a DeviceBuffer, a "
                            f"view); got {type(resource).__name__}")
    return context


def _modes(address_mode: Any, call: str) -> tuple[int, int, int]:
    names: tuple[Any, ...]
    try:
        names = (address_mode,) * 3 if isinstance(address_mode, str) else tuple(address_mode)
    except TypeError:
        names = ()
    if not 1 <= len(names) <= 3 or any(not isinstance(n, str) or n not in ADDRESS_MODES for n in names):
        raise invalid(call, f"address_mode is one of {', '.join(ADDRESS_MODES)} or 1-3 of them (x, y, z), "
                            f"got {address_mode!r}")
    names = names + (names[-1],) * (3 - len(names))
    return tuple(ADDRESS_MODES[n] for n in names)  # type: ignore[return-value]


class TextureObject(_ObjectBase):
    """A texture object (cuTexObjectCreate) over an array, a mipmapped array, or linear or pitched 2-D device
    memory.  Made by :meth:`create`; pass it to kernels as a ``cudaTextureObject_t``."""

    __slots__ = ("kind_of_resource", "dtype_name", "channels")
    _release_call = "cuTexObjectDestroy"

    kind_of_resource: str   # "array", "mipmapped_array", "linear" or "pitch2d"
    dtype_name: str         # the element type (cuproc.arrays.FORMATS)
    channels: int

    @classmethod
    def create(cls, resource: Any, *, address_mode: Any = "clamp", filter_mode: str = "point",
               read_mode: str = "element_type", normalized_coords: bool = False, srgb: bool = False,
               border_color: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0), max_anisotropy: int = 0,
               mipmap_filter_mode: str = "point", mipmap_level_bias: float = 0.0,
               min_mipmap_level_clamp: float = 0.0, max_mipmap_level_clamp: float | None = None,
               disable_trilinear_optimization: bool = False, seamless_cubemap: bool = False,
               dtype: Any = None, channels: int = 1, nbytes: int | None = None, width: int | None = None,
               height: int | None = None, pitch: int | None = None) -> TextureObject:
        """A texture over ``resource``, made in its context.

        Arrays and mipmapped arrays bring their element type.  Device memory (a DeviceBuffer or view) needs
        ``dtype`` (and ``channels``): with ``height`` it is a pitched 2-D texture of ``width`` x ``height``
        elements, rows ``pitch`` bytes apart (default: packed); without, a linear one of ``nbytes`` (default:
        all of it), read with ``tex1Dfetch`` (integer coordinates, point filtering: the texture units
        neither filter nor wrap linear memory).

        ``filter_mode`` "point" or "linear" (bilinear / trilinear: floating-point results only, so not with
        ``read_mode="element_type"`` on an integer format); ``read_mode`` "element_type" (elements as they
        are: CU_TRSF_READ_AS_INTEGER for integer formats) or "normalized_float" (8- and 16-bit integers to
        [0, 1] or [-1, 1]); ``address_mode`` one of
        "wrap", "clamp", "mirror", "border" or one per dimension ("wrap" and "mirror" need
        ``normalized_coords=True``).  ``max_mipmap_level_clamp`` defaults to the last level of a mipmapped
        array."""
        call = "cuTexObjectCreate"
        context = _context_of(resource, call)
        resource.check(call)
        drv = context.driver
        rdesc = ffi.new("CUDA_RESOURCE_DESC *")
        if isinstance(resource, CudaArray):
            kind, name, nch = "array", resource.dtype, resource.channels
            rdesc.res.array.hArray = resource.handle
        elif isinstance(resource, MipmappedArray):
            kind, name, nch = "mipmapped_array", resource.dtype, resource.channels
            rdesc.res.mipmap.hMipmappedArray = resource.handle
        elif isinstance(resource, (Allocation, DeviceView)):
            if isinstance(resource, Allocation) and resource.kind == "host":
                raise invalid(call, "a texture reads device memory; this is host memory")
            if dtype is None:
                raise invalid(call, "a texture over device memory needs dtype= (and channels=): the memory has none")
            name, nch = dtype_name(dtype, call), channels
            if nch not in (1, 2, 4):
                raise invalid(call, f"channels must be 1, 2 or 4, got {channels!r}")
            kind = "linear" if height is None else "pitch2d"
            _linear(resource, rdesc, kind, name, nch, nbytes, width, height, pitch, context, call)
        else:
            raise invalid(call, f"the resource must be a CudaArray, a MipmappedArray or device memory (a DeviceBuffer, "
                                f"a view); got {type(resource).__name__}")
        rdesc.resType = _RESOURCE[kind]
        if filter_mode not in FILTER_MODES or mipmap_filter_mode not in FILTER_MODES:
            raise invalid(call, f"filter modes are 'point' or 'linear', got {filter_mode!r} / {mipmap_filter_mode!r}")
        if read_mode not in READ_MODES:
            raise invalid(call, f"read_mode is 'element_type' or 'normalized_float', got {read_mode!r}")
        modes = _modes(address_mode, call)
        if not normalized_coords and any(m in (ADDRESS_MODES["wrap"], ADDRESS_MODES["mirror"]) for m in modes):
            raise invalid(call, "address modes 'wrap' and 'mirror' work on normalized coordinates only: pass "
                                "normalized_coords=True (unnormalized coordinates are clamped)")
        integer = name in INTEGER_DTYPES
        if filter_mode == "linear" and integer and read_mode == "element_type":
            raise invalid(call, f"linear filtering returns floating point: read {name} as normalized floats "
                                f"(read_mode='normalized_float') or filter with 'point'")
        if read_mode == "normalized_float" and not (integer and FORMATS[name][1] <= 2):
            raise invalid(call, f"read_mode='normalized_float' maps 8- and 16-bit integers to [0, 1] or [-1, 1]; "
                                f"{name} is read as it is (read_mode='element_type')")
        if kind == "linear" and (filter_mode != "point" or normalized_coords):
            raise invalid(call, "a linear-memory texture is read with tex1Dfetch: integer coordinates and point "
                                "filtering only (use a pitch2d texture or an array to filter)")
        if srgb and not (integer and FORMATS[name][1] == 1):
            raise invalid(call, "srgb=True applies to 8-bit integer formats")
        if max_anisotropy.__class__ is not int or not 0 <= max_anisotropy <= 16:
            raise invalid(call, f"max_anisotropy must be an int from 0 to 16, got {max_anisotropy!r}")
        if max_mipmap_level_clamp is None:
            max_mipmap_level_clamp = float(resource.levels - 1) if isinstance(resource, MipmappedArray) else 0.0
        try:
            border = tuple(float(c) for c in border_color)
            mipmap_level_bias, min_mipmap_level_clamp, max_mipmap_level_clamp = (
                float(mipmap_level_bias), float(min_mipmap_level_clamp), float(max_mipmap_level_clamp))
        except (TypeError, ValueError) as exc:
            raise invalid(call, f"border_color and the mipmap level bias and clamps are numbers ({exc})") from None
        if len(border) != 4:
            raise invalid(call, f"border_color has 4 components, got {border_color!r}")
        if min_mipmap_level_clamp > max_mipmap_level_clamp:
            raise invalid(call, f"min_mipmap_level_clamp ({min_mipmap_level_clamp}) exceeds max_mipmap_level_clamp "
                                f"({max_mipmap_level_clamp})")
        tdesc = ffi.new("CUDA_TEXTURE_DESC *")
        tdesc.addressMode = list(modes)
        tdesc.filterMode = FILTER_MODES[filter_mode]
        tdesc.mipmapFilterMode = FILTER_MODES[mipmap_filter_mode]
        # (READ_AS_INTEGER only where it means something: an integer format read as it is; floats are never
        # promoted, and 32-bit integers never are either)
        tdesc.flags = ((_READ_AS_INTEGER if read_mode == "element_type" and integer else 0)
                       | (_NORMALIZED_COORDINATES if normalized_coords else 0) | (_SRGB if srgb else 0)
                       | (_DISABLE_TRILINEAR if disable_trilinear_optimization else 0)
                       | (_SEAMLESS_CUBEMAP if seamless_cubemap else 0))
        tdesc.maxAnisotropy = max_anisotropy
        tdesc.mipmapLevelBias = mipmap_level_bias
        tdesc.minMipmapLevelClamp, tdesc.maxMipmapLevelClamp = min_mipmap_level_clamp, max_mipmap_level_clamp
        tdesc.borderColor = list(border)
        out = ffi.new("CUtexObject *")
        rc = context.call_current(drv.cuTexObjectCreate, out, rdesc, tdesc, ffi.NULL)
        if rc:
            raise drv.error(rc, call)
        self = cls.__new__(cls)
        self.driver, self.ended, self.handle, self.context, self.resource = drv, None, int(out[0]), context, resource
        self.kind_of_resource, self.dtype_name, self.channels = kind, name, nch
        return self

    def describe(self) -> str:
        return f"texture object {self.handle:#x} over {self.resource.describe()}"

    def _release(self) -> int:
        return self.context.call(self.driver.cuTexObjectDestroy, self.handle)

    def resource_desc(self) -> dict[str, int]:
        """What the driver says the texture reads (cuTexObjectGetResourceDesc): its type and handle or address."""
        call = "cuTexObjectGetResourceDesc"
        self.check(call)
        out = ffi.new("CUDA_RESOURCE_DESC *")
        self.driver.check(self.context.call(self.driver.cuTexObjectGetResourceDesc, out, self.handle), call)
        return _resource_dict(out)

    def texture_desc(self) -> dict[str, Any]:
        """What the driver says the texture does (cuTexObjectGetTextureDesc): modes and flags as set."""
        call = "cuTexObjectGetTextureDesc"
        self.check(call)
        out = ffi.new("CUDA_TEXTURE_DESC *")
        self.driver.check(self.context.call(self.driver.cuTexObjectGetTextureDesc, out, self.handle), call)
        return {"address_mode": tuple(out.addressMode), "filter_mode": int(out.filterMode), "flags": int(out.flags),
                "max_anisotropy": int(out.maxAnisotropy), "border_color": tuple(out.borderColor)}


def _linear(resource: Any, rdesc: Any, kind: str, name: str, channels: int, nbytes: int | None, width: int | None,
            height: int | None, pitch: int | None, context: Context, call: str) -> None:
    """Fill a linear or pitch-2D resource descriptor, checked against the memory and the device's rules."""
    address, size = resource.ptr, resource.nbytes
    elem = FORMATS[name][1] * channels
    device = context.device
    align = device.attribute("TEXTURE_ALIGNMENT")
    if align > 0 and address % align:
        raise invalid(call, f"texture memory must start at a multiple of {align} bytes (TEXTURE_ALIGNMENT); "
                            f"{address:#x} is not: use an allocation's start")
    fmt = ffi.typeof("CUarray_format").relements[FORMATS[name][0]]
    if kind == "linear":
        n = size - size % elem if nbytes is None else nbytes
        if n.__class__ is not int or n <= 0 or n % elem or n > size:
            raise invalid(call, f"nbytes must be a positive multiple of the {elem}-byte element within the "
                                f"{size} bytes of memory, got {nbytes!r}")
        most = device.attribute("MAXIMUM_TEXTURE1D_LINEAR_WIDTH")
        if most > 0 and n // elem > most:
            raise invalid(call, f"{n // elem} elements exceed MAXIMUM_TEXTURE1D_LINEAR_WIDTH ({most})")
        rdesc.res.linear.devPtr, rdesc.res.linear.format = address, fmt
        rdesc.res.linear.numChannels, rdesc.res.linear.sizeInBytes = channels, n
        return
    if not isinstance(width, int) or not isinstance(height, int) or isinstance(width, bool) or \
            isinstance(height, bool) or width <= 0 or height <= 0:
        raise invalid(call, f"a pitch2d texture needs width and height > 0, got {width!r} x {height!r}")
    row = width * elem
    step = row if pitch is None else pitch
    pitch_align = device.attribute("TEXTURE_PITCH_ALIGNMENT")
    if step.__class__ is not int or step < row or (pitch_align > 0 and step % pitch_align):
        raise invalid(call, f"pitch must be an int >= the row's {row} bytes and a multiple of {pitch_align} "
                            f"(TEXTURE_PITCH_ALIGNMENT), got {step!r}")
    needed = step * (height - 1) + row
    if needed > size:
        raise invalid(call, f"{width} x {height} elements with pitch {step} need {needed} bytes; the memory has {size}")
    p = rdesc.res.pitch2D
    p.devPtr, p.format, p.numChannels, p.width, p.height, p.pitchInBytes = address, fmt, channels, width, height, step


def _resource_dict(out: Any) -> dict[str, int]:
    kind = int(out.resType)
    found: dict[str, int] = {"type": kind}
    if kind == 0:
        found["array"] = int(ffi.cast("uintptr_t", out.res.array.hArray))
    elif kind == 1:
        found["mipmapped_array"] = int(ffi.cast("uintptr_t", out.res.mipmap.hMipmappedArray))
    elif kind == 2:
        found.update(address=int(out.res.linear.devPtr), nbytes=int(out.res.linear.sizeInBytes))
    else:
        found.update(address=int(out.res.pitch2D.devPtr), width=int(out.res.pitch2D.width),
                     height=int(out.res.pitch2D.height), pitch=int(out.res.pitch2D.pitchInBytes))
    return found


class SurfaceObject(_ObjectBase):
    """A surface object (cuSurfObjectCreate) over a CUDA array made with ``surface=True``: kernels read and write
    it with surf1Dread / surf2Dwrite ... (x in *bytes*).  Pass it to kernels as a ``cudaSurfaceObject_t``."""

    __slots__ = ()
    _release_call = "cuSurfObjectDestroy"

    @classmethod
    def create(cls, array: CudaArray) -> SurfaceObject:
        """A surface over ``array`` (or a level of a mipmapped array), made in its context."""
        call = "cuSurfObjectCreate"
        if not isinstance(array, CudaArray):
            raise invalid(call, f"a surface is made over a CudaArray (a mipmapped array's level(i) too), not "
                                f"{type(array).__name__}")
        array.check(call)
        if not array.flags & SURFACE_LDST:
            raise invalid(call, f"{array.describe()} was not made for surfaces: create it with surface=True "
                                f"(CUDA_ARRAY3D_SURFACE_LDST)")
        context = array.context
        rdesc = ffi.new("CUDA_RESOURCE_DESC *")
        rdesc.resType = _RESOURCE["array"]
        rdesc.res.array.hArray = array.handle
        out = ffi.new("CUsurfObject *")
        drv = context.driver
        rc = context.call_current(drv.cuSurfObjectCreate, out, rdesc)
        if rc:
            raise drv.error(rc, call)
        self = cls.__new__(cls)
        self.driver, self.ended, self.handle, self.context, self.resource = drv, None, int(out[0]), context, array
        return self

    def describe(self) -> str:
        return f"surface object {self.handle:#x} over {self.resource.describe()}"

    def _release(self) -> int:
        return self.context.call(self.driver.cuSurfObjectDestroy, self.handle)

    def resource_desc(self) -> dict[str, int]:
        """What the driver says the surface writes (cuSurfObjectGetResourceDesc)."""
        call = "cuSurfObjectGetResourceDesc"
        self.check(call)
        out = ffi.new("CUDA_RESOURCE_DESC *")
        self.driver.check(self.context.call(self.driver.cuSurfObjectGetResourceDesc, out, self.handle), call)
        return _resource_dict(out)


__all__ = ["ADDRESS_MODES", "FILTER_MODES", "OBJECT_VALUE", "READ_MODES", "SurfaceObject", "TextureObject"]
