"""Array interchange: ``__cuda_array_interface__`` (v3) and DLPack 1.x, both directions.

Policy
------
* **Streams.**  Device memory remembers the stream of the last stream-ordered
  work cuproc queued on it (``alloc_async``, an async copy or memset:
  :attr:`DeviceBuffer.last_stream <cuproc.device_memory.DeviceBuffer>`; a
  synchronous copy or memset resets it to the default stream).  Kernel
  launches are not tracked: after a launch on another stream, set
  ``buffer.last_stream = stream`` yourself.  CAI exports that stream, or the
  default-stream marker (1 legacy, 2 per-thread), so consumers synchronize;
  ``None`` only when nothing can be pending (its stream was closed and cuproc
  synchronized the context).  ``__dlpack__(stream=s)`` makes the consumer's
  stream ``s`` wait for that work with an event (cuEventRecord +
  cuStreamWaitEvent), without blocking the host; ``-1`` asks for no
  synchronization.
* **DLPack export** follows the array API's ``__dlpack__`` rules: a versioned
  capsule when ``max_version >= (1, 0)``, the legacy capsule otherwise;
  ``dl_device`` other than the memory's own is served by a copy to the host
  for ``(kDLCPU, 0)`` unless ``copy=False``, and is a ``BufferError`` for
  anything else; ``copy=True`` copies (stream-ordered after the pending work).
  Pinned and registered memory are ``kDLCUDAHost``, managed memory
  ``kDLCUDAManaged``; both also export as ``kDLCPU`` without a copy.
* **Lifetime.**  A capsule keeps the exporting object (so the allocation and
  its context) alive until its deleter runs; explicit frees are refused
  meanwhile (see :mod:`cuproc.allocation`).  CAI has no lifetime protocol.
* **Import.**  :func:`from_dlpack` views another library's tensor (or a
  capsule) as a :class:`DLPackArray` that keeps the producer alive and calls
  its deleter exactly once.  CAI objects given to copies and memsets are read
  per the spec (:func:`read_cai`): a mask is refused, a read-only array is
  refused as a destination, and the exporter's stream is waited for
  (:func:`wait_for_cai`).  As kernel arguments (:mod:`cuproc.launch`) only
  their address is read: synchronize with their stream yourself, or import
  them with :func:`from_dlpack`, whose stream handshake orders them.
"""
from __future__ import annotations

from ._ffi import ffi
from ._resource import Resource
from ._support import get_driver, handle_int, invalid
from .context import Context
from .driver import Driver
from .stream import Stream, as_stream, default_stream, foreign_context, order_after, stream_handle

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import Any

    from ._dlpack import Imported

# _dlpack (ctypes structures) loads on first export or import, not with every DeviceBuffer.

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13   # DLDeviceType values
LEGACY_STREAM, PER_THREAD_STREAM = 1, 2                             # CAI / DLPack default-stream markers


def default_marker(driver: Driver) -> int:
    """The protocols' number for the default stream this driver handle uses."""
    return PER_THREAD_STREAM if driver.per_thread_default_stream else LEGACY_STREAM


def stream_number(stream: Stream | int | None, driver: Driver) -> int | None:
    """A kept stream (a Stream, a raw handle as an int, None for the default) as CAI and DLPack number
    it -- never 0, which CAI v3 forbids: the NULL stream is the default stream, so its marker.

    A closed Stream gives None, after synchronizing its context (when still usable) so nothing can be
    pending: a blocking cuCtxSynchronize, the one side effect of reading an export's stream, paid once
    per closed stream (the caller then forgets it)."""
    if isinstance(stream, Stream):
        if stream.ended_owner() is None:
            return handle_int(stream.handle)
        if stream.context.ended_owner() is None:
            stream.context.synchronize()     # the stream is gone but its work may not be
        return None
    return stream or default_marker(driver)


def stream_marker(allocation: Any) -> int | None:
    """The stream a consumer of ``allocation`` must synchronize with, as CAI and DLPack number it.

    Its last stream's handle; the default-stream marker when none was recorded; None when its last
    stream was closed -- then the context is synchronized first, so nothing can be pending."""
    number = stream_number(allocation.last_stream, allocation.driver)
    if number is None:
        allocation.last_stream = None
    return number


def cai(ptr: int, shape: tuple[int, ...], typestr: str, stream: int | None, readonly: bool = False) -> dict[str, Any]:
    """A v3 ``__cuda_array_interface__`` dict for C-contiguous memory."""
    return {"shape": shape, "typestr": typestr, "data": (ptr, readonly), "version": 3, "strides": None,
            "stream": stream}


def _versioned(max_version: Any) -> bool:
    if max_version is None:
        return False
    if not (isinstance(max_version, tuple) and len(max_version) == 2 and all(isinstance(v, int) for v in max_version)):
        raise TypeError(f"__dlpack__: max_version is a (major, minor) tuple of ints or None, got {max_version!r}")
    return max_version[0] >= 1


def consumer_stream(stream: Any, driver: Driver) -> int | None:
    """The consumer's ``stream`` argument of ``__dlpack__`` for CUDA memory, per the spec: None means
    the legacy default stream (1), 1 and 2 the default streams, -1 no synchronization (returns None);
    0 is refused as ambiguous.  A cuproc Stream or another library's stream object is taken too."""
    if stream is None:
        return LEGACY_STREAM
    if isinstance(stream, bool) or not isinstance(stream, int):
        return handle_int(stream_handle(stream, driver, "__dlpack__"))
    if stream == -1:
        return None
    if stream <= 0:
        raise ValueError(f"__dlpack__: stream={stream} is not a CUDA stream (0 is ambiguous in DLPack: pass 1 for "
                         "the legacy default stream, 2 for the per-thread one, -1 for no synchronization)")
    return stream


def _device_name(device: tuple[int, int]) -> str:
    names = {KDL_CPU: "kDLCPU", KDL_CUDA: "kDLCUDA", KDL_CUDA_HOST: "kDLCUDAHost", KDL_CUDA_MANAGED: "kDLCUDAManaged"}
    return f"({names.get(device[0], device[0])}, {device[1]})"


def _target_device(dl_device: Any) -> tuple[int, int] | None:
    if dl_device is None:
        return None
    try:
        kind, ordinal = dl_device
        return (int(kind), int(ordinal))
    except (TypeError, ValueError):
        raise TypeError(f"__dlpack__: dl_device is a (device_type, device_id) pair or None, "
                        f"got {dl_device!r}") from None


def _dlpack_arguments(exporter: Any, driver: Driver, stream: Any, max_version: Any,
                      dl_device: Any) -> tuple[bool, int | None, tuple[int, int], tuple[int, int] | None]:
    """``__dlpack__``'s arguments checked: (versioned capsule?, the consumer's stream number or None
    for no synchronization, the exporter's own DLPack device, the requested one or None)."""
    return (_versioned(max_version), consumer_stream(stream, driver), exporter.__dlpack_device__(),
            _target_device(dl_device))


def _order_consumer(allocation: Any, consumer: int) -> None:
    """Make the consumer's stream wait for the allocation's pending work, on the device.

    The event is made in the producer stream's context (as cuEventRecord needs); the wait runs in the
    context the consumer's stream belongs to -- for a default-stream marker, the calling thread's
    current context (the consumer's), else the allocation's."""
    producer = stream_marker(allocation)
    if producer is None:
        return
    last = allocation.last_stream
    signaller = last.context if isinstance(last, Stream) else allocation.context
    waiter = None
    if consumer in (LEGACY_STREAM, PER_THREAD_STREAM):
        waiter = Context.current(driver=allocation.driver)
    waiter = waiter or allocation.context
    # The same number is the same stream only for a stream handle, or for a default stream in the same
    # context: marker 1 of a consumer whose current context is another names that context's stream.
    if consumer == producer and (consumer not in (LEGACY_STREAM, PER_THREAD_STREAM) or waiter is signaller):
        return
    order_after(signaller, consumer, producer, waiter)


class DeviceArrayExports:
    """Mixin for device memory: CAI v3 and DLPack from ``ptr``, ``shape``, ``typestr``, ``nbytes``,
    ``allocation`` (the DeviceBuffer) and ``__dlpack_device__``."""

    __slots__ = ()

    ptr: int
    shape: tuple[int, ...]
    typestr: str
    nbytes: int
    #: What a copy (``__dlpack__(copy=True)``) is made in: ``copy_class(nbytes, context=...)``, set once by
    #: cuproc.device_memory (DeviceBuffer for every allocation: an imported or mapped allocation's constructor
    #: takes a handle or a reservation, not a size; this module sits below cuproc.device_memory).
    copy_class: Any = None

    @property
    def allocation(self) -> Any:
        return self

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        ptr = self.ptr                     # checks the memory and its context first
        return cai(ptr, self.shape, self.typestr, stream_marker(self.allocation))

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: Any = None, copy: bool | None = None) -> Any:
        """A DLPack capsule; see the module docstring for the rules on each argument."""
        ptr = self.ptr
        alloc = self.allocation
        versioned, consumer, own, target = _dlpack_arguments(self, alloc.driver, stream, max_version, dl_device)
        if target is not None and target != own:
            if target != (KDL_CPU, 0) or copy is False:
                raise BufferError(f"__dlpack__: this memory is on {_device_name(own)}; it cannot be exported to "
                                  f"{_device_name(target)}" + (" without a copy (copy=False)" if copy is False else ""))
            host = self._to_host()
            return _dlpack().to_capsule(host, host.ctypes.data, self.shape, self.typestr, (KDL_CPU, 0),
                                      versioned=versioned, copied=True)
        source: Any = self._copy_on_device() if copy else self
        if consumer is not None:
            _order_consumer(source.allocation, consumer)
        source.allocation.context.add_exporter(source.allocation)
        return _dlpack().to_capsule(source, source.ptr if copy else ptr, self.shape, self.typestr, own,
                                  versioned=versioned, copied=bool(copy), allocation=source.allocation)

    def __dlpack_device__(self) -> tuple[int, int]:
        raise NotImplementedError

    def _producer_handle(self) -> Any:
        marker = stream_marker(self.allocation)
        return default_stream(self.allocation.driver) if marker is None else marker

    def _copy_on_device(self) -> Any:
        """A new buffer with these bytes, copied on the stream of the pending work (cuMemcpyDtoDAsync)."""
        alloc = self.allocation
        h = self._producer_handle()
        make = alloc.copy_class
        if make is None:
            raise BufferError(f"{alloc.describe()} cannot be copied by its exporter: copy it into a DeviceBuffer "
                              "(cuproc.memory.copy) and export that")
        new = make(max(self.nbytes, 1), context=alloc.context)
        alloc.context.run("cuMemcpyDtoDAsync", new.ptr, self.ptr, self.nbytes, ffi_stream(h))
        new.last_stream = alloc.last_stream
        return new.view(self.typestr, self.shape)

    def _to_host(self) -> Any:
        """A NumPy copy, complete when returned (cuStreamSynchronize of the pending work, cuMemcpyDtoH)."""
        import numpy as np
        alloc = self.allocation
        host = np.empty(self.shape, dtype=np.dtype(self.typestr))
        ctx = alloc.context
        ctx.run("cuStreamSynchronize", ffi_stream(self._producer_handle()))
        ctx.run("cuMemcpyDtoH", ffi.cast("void *", host.ctypes.data), self.ptr, self.nbytes)
        return host


class LinearDeviceExports(DeviceArrayExports):
    """DeviceArrayExports of memory that is one run of bytes on one device, seen as a 1-D uint8 array:
    memory another process exported (cuproc.ipc) and mapped virtual memory (cuproc.virtual_memory).
    Needs ``nbytes`` and ``device_ordinal`` (the device in this process's numbering)."""

    __slots__ = ()
    typestr = "|u1"
    device_ordinal: int

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]  # (DeviceArrayExports declares the attribute)
        return (self.nbytes,)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.device_ordinal)


def ffi_stream(handle: Any) -> Any:
    return ffi.cast("CUstream", handle)


class HostArrayExports:
    """Mixin for host memory the GPU can reach (pinned, registered, managed): DLPack as kDLCUDAHost or
    kDLCUDAManaged (or kDLCPU, the same bytes), from ``ptr``, ``nbytes``, ``context``."""

    __slots__ = ()
    _dlpack_type = KDL_CUDA_HOST

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self._dlpack_type, 0)

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: Any = None, copy: bool | None = None) -> Any:
        """A DLPack capsule of the bytes (uint8), ordered after the last stream-ordered work cuproc
        queued on the memory (``last_stream``): for a kDLCPU export, or ``stream=None`` (the consumer
        may read on the host), the host waits for that stream (cuStreamSynchronize) first; for a
        consumer's CUDA stream, that stream waits on the device (an event); ``-1`` skips both."""
        alloc: Any = self
        ptr = alloc.ptr
        versioned, consumer, own, target = _dlpack_arguments(self, alloc.driver, stream, max_version, dl_device)
        if target is not None and target not in (own, (KDL_CPU, 0)):
            raise BufferError(f"__dlpack__: host memory ({_device_name(own)}) cannot be exported to "
                              f"{_device_name(target)}")
        device = target or own
        # memory registered read-only: only a versioned capsule can say so (DLPack 1.0's flag); an unversioned
        # one would hand the consumer writable memory, so it is refused (as NumPy refuses), unless copied
        readonly = not copy and alloc.read_only
        if readonly and not versioned:
            raise BufferError(f"__dlpack__: {alloc.describe()} was registered read-only, which only a versioned "
                              f"DLPack capsule can say: pass max_version=(1, 0), or copy=True")
        if copy:
            alloc = self._copy_on_host()
            ptr = alloc.ptr
        elif stream is None or device == (KDL_CPU, 0):
            self._wait_on_host()
        elif consumer is not None:
            _order_consumer(alloc, consumer)
        alloc.context.add_exporter(alloc)
        return _dlpack().to_capsule(alloc, ptr, (alloc.nbytes,), "|u1", device, versioned=versioned,
                                  copied=bool(copy), readonly=readonly, allocation=alloc)

    def _wait_on_host(self) -> None:
        """Block until the recorded last stream's work is done (cuStreamSynchronize); then nothing is
        pending, so the record is dropped."""
        alloc: Any = self
        if alloc.last_stream is None:
            return                          # synchronous work only: already complete
        last = alloc.last_stream
        if isinstance(last, Stream):        # in the stream's own context, which may not be the memory's
            last.context.run("cuStreamSynchronize", last.handle)
        else:
            number = stream_number(last, alloc.driver)
            if number is not None:
                alloc.context.run("cuStreamSynchronize", ffi_stream(number))
        alloc.last_stream = None

    def _copy_type(self) -> type[Any]:
        """The class of the copy ``__dlpack__(copy=True)`` makes, which the memory's own class names
        (:mod:`cuproc.host_memory`: pinned memory, managed memory for managed), so that this module,
        below it, needs none of its classes."""
        raise NotImplementedError(f"{type(self).__name__} does not say what a copy of it is")

    def _copy_on_host(self) -> Any:
        """A new allocation of the same kind with these bytes, once the context's work is done."""
        alloc: Any = self
        alloc.context.synchronize()
        new = self._copy_type()(alloc.nbytes, context=alloc.context)
        import ctypes   # here, not with every DeviceBuffer; its memmove, unlike ffi.memmove, releases the GIL
        ctypes.memmove(new.ptr, alloc.ptr, alloc.nbytes)
        return new


# --------------------------------------------------------------------------- import: CAI

def read_cai(obj: Any, call: str, *, writable: bool) -> tuple[int, int, int | None]:
    """(address, size in bytes, stream or None) of a C-contiguous ``__cuda_array_interface__`` exporter.

    Refused before any driver call: a mask (cuproc has no masked arrays), a read-only array where
    ``writable`` is needed, non-C-contiguous strides, a stream that is not None or a positive int."""
    desc = obj.__cuda_array_interface__
    if desc.get("mask") is not None:
        raise invalid(call, f"the {type(obj).__name__} has a mask in its __cuda_array_interface__; cuproc takes "
                            "only unmasked arrays (fill the masked elements first)")
    ptr, readonly = desc["data"]
    if writable and readonly:
        raise invalid(call, f"the {type(obj).__name__} is read-only (its __cuda_array_interface__ says so) and "
                            "cannot be written")
    size = typestr_of(desc["typestr"])[1]
    shape = tuple(desc["shape"])
    strides = desc.get("strides")
    if strides is not None and not _dlpack().c_contiguous(shape, tuple(strides), size):
        raise invalid(call, "a device array given through __cuda_array_interface__ must be C-contiguous")
    for dim in shape:
        size *= dim
    stream = desc.get("stream")
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int) or stream <= 0):
        raise invalid(call, f"the {type(obj).__name__}'s __cuda_array_interface__ names stream {stream!r}; "
                            "the protocol allows None, 1, 2 or a stream handle (never 0)")
    return int(ptr or 0), size, stream


def wait_for_cai(stream: int, waiter: Stream | Any | None, context: Context | None, driver: Driver,
                 exporter: Context | None = None) -> None:
    """Make cuproc's use of a CAI array wait for the exporter's ``stream``, as the CAI spec asks.

    Work on a stream (``waiter``) waits on the device (an event); a synchronous call, which runs in
    ``context`` (on its default stream), waits on the host (cuStreamSynchronize of the exporter's
    stream).  A default-stream marker (1, 2) names the default stream of the exporter's context:
    ``exporter``, the context the driver records for the exported memory, when known (else
    ``context``).  Only when that is the context the call runs in does the default stream order the
    call by itself; measured on driver 580, another context's default stream is not ordered with it.
    A stream handle's context comes from :func:`cuproc.stream.foreign_context` (one cuStreamGetCtx per use)."""
    default = stream in (LEGACY_STREAM, PER_THREAD_STREAM)
    home = exporter if exporter is not None else context
    if waiter is not None:
        h = handle_int(stream_handle(waiter, driver, "cuStreamWaitEvent"))
        if h != stream:
            ctx = waiter.context if isinstance(waiter, Stream) else context
            ctx = ctx if ctx is not None else Context.require_current("cuStreamWaitEvent", driver=driver)
            # The event lives in the exporter stream's context; a default stream is the exporter's context's.
            signaller = (home or ctx) if default else foreign_context(stream, None, driver)
            order_after(signaller, h, stream, ctx)
        return
    if stream == default_marker(driver) and home is context:
        return          # a synchronous call runs on that default stream: already ordered after its work
    h = ffi_stream(stream)
    # a default stream (1, 2) is whichever context is current's: the exporter's, when known, must be
    rc = home.call_on(h, driver.cuStreamSynchronize, h) if home is not None else driver.cuStreamSynchronize(h)
    if rc:
        raise driver.error(rc, "cuStreamSynchronize")


def typestr_of(dtype: Any) -> tuple[str, int]:
    """(array-interface typestr, itemsize) for a NumPy dtype (or anything np.dtype takes) or a typestr."""
    if isinstance(dtype, str) and len(dtype) >= 3 and dtype[0] in "<>|=" and dtype[2:].isdigit():
        return dtype, int(dtype[2:])
    import numpy as np
    d = np.dtype(dtype)
    return d.str, d.itemsize


# --------------------------------------------------------------------------- import: DLPack

class DLPackArray(Resource):
    """Another library's memory, viewed through a DLPack capsule (see :func:`from_dlpack`).

    Holds the producer object (when given one) and the consumed tensor; ``close()`` (idempotent) or
    dropping it calls the producer's deleter, exactly once.  C-contiguous; ``readonly`` when the
    producer marked it so (cuproc then refuses it as a destination).  It exports
    ``__cuda_array_interface__`` (with the stream it was imported for) and can be passed wherever
    cuproc takes device memory.  ``stream`` is the stream it was imported for: a :class:`Stream`
    (kept, so a closed one is never named to the driver), else the protocol's number or None.
    """

    __slots__ = ("producer", "shape", "typestr", "nbytes", "device", "readonly", "stream", "stream_context",
                 "_tensor", "_ptr")
    _ended_word = "released"
    _release_call = "DLPack deleter"
    _leaf = True       # no resource names it as its parent: closing it leaves EPOCH alone

    def __init__(self, tensor: Imported, producer: Any, stream: Stream | int | None, driver: Driver,
                 stream_context: Context | None = None) -> None:
        self.driver, self.producer, self._tensor, self.stream = driver, producer, tensor, stream
        #: the context whose default stream a marker ``stream`` (1, 2) names: the one current at the import,
        #: where the producer ordered its work (None: not known, or a stream handle)
        self.stream_context = stream_context
        self.shape, self.typestr, self.device = tensor.shape, tensor.typestr, tensor.device
        self.readonly = tensor.readonly
        itemsize = typestr_of(tensor.typestr)[1]
        count = 1
        for dim in tensor.shape:
            count *= dim
        self.nbytes, self._ptr = count * itemsize, tensor.ptr
        self.ended = None

    def describe(self) -> str:
        return f"DLPack array {self.shape} {self.typestr} at {self._ptr:#x}"

    def _release(self) -> int:
        self._tensor.release()
        self.producer = None
        return 0

    @property
    def ptr(self) -> int:
        self.check("DLPackArray.ptr")
        return self._ptr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        stream = self.stream
        if isinstance(stream, Stream):
            stream = stream_number(stream, self.driver)
            if stream is None:
                self.stream = None       # closed, and its context synchronized: nothing pending
        return cai(self.ptr, self.shape, self.typestr, stream, self.readonly)

    def __repr__(self) -> str:
        return f"<cuproc.DLPackArray {self.shape} {self.typestr} on {_device_name(self.device)}" \
               f"{' read-only' if self.readonly else ''}{' ' + self.ended if self.ended else ''}>"


_IMPORTABLE = (KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED)


def from_dlpack(obj: Any, *, stream: Stream | Any | None = None, driver: Driver | None = None) -> DLPackArray:
    """View ``obj`` (anything with ``__dlpack__``, or a DLPack capsule) as a :class:`DLPackArray`.

    ``stream`` is where cuproc will use the memory (None: the default stream); the producer is asked
    to make it wait for its pending work (``__dlpack__(stream=...)``).  A bare capsule carries no
    stream handshake: the producer's work must already be complete or ordered.  CUDA device,
    pinned (kDLCUDAHost) and managed memory are taken; anything else is a BufferError.
    """
    drv = get_driver(driver)
    marker: int | None = None
    kept: Stream | Any | None = None
    if type(obj).__name__ == "PyCapsule":
        tensor, producer = _dlpack().consume(obj), None
    else:
        if not hasattr(obj, "__dlpack__"):
            raise TypeError(f"from_dlpack needs an object with __dlpack__ or a DLPack capsule, "
                            f"got {type(obj).__name__}")
        device = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else None
        if device is not None and device[0] not in _IMPORTABLE:
            raise BufferError(f"from_dlpack: the {type(obj).__name__} is on {_device_name(tuple(device))}; cuproc "
                              "takes CUDA device, pinned (kDLCUDAHost) or managed memory")
        on_host = device is not None and device[0] == KDL_CUDA_HOST     # pinned memory: no stream in DLPack
        if not on_host:
            kept = as_stream(stream, "from_dlpack", driver=drv)
            marker = handle_int(stream_handle(kept, drv, "from_dlpack")) or default_marker(drv)
        try:
            capsule = obj.__dlpack__(stream=marker, max_version=_dlpack().VERSION)
        except TypeError as exc:            # a producer from before DLPack 1.0 (no max_version)...
            if "max_version" not in str(exc):
                raise                       # ...else the producer's own error
            capsule = obj.__dlpack__(stream=marker)
        tensor, producer = _dlpack().consume(capsule), obj
    if tensor.device[0] not in _IMPORTABLE:
        tensor.release()
        raise BufferError(f"from_dlpack: the tensor is on {_device_name(tensor.device)}; cuproc takes CUDA device, "
                          "pinned (kDLCUDAHost) or managed memory")
    home = Context.current(driver=drv) if marker in (LEGACY_STREAM, PER_THREAD_STREAM) else None
    return DLPackArray(tensor, producer, kept if isinstance(kept, Stream) else marker, drv, home)


__all__ = ["DLPackArray", "DeviceArrayExports", "HostArrayExports", "KDL_CPU", "KDL_CUDA", "KDL_CUDA_HOST",
           "KDL_CUDA_MANAGED", "LinearDeviceExports", "cai", "consumer_stream", "default_marker", "from_dlpack", "read_cai",
           "stream_marker", "typestr_of", "wait_for_cai"]


def _dlpack():  # noqa: ANN202 - the module
    from . import _dlpack as module
    return module
