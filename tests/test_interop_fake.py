"""The interchange protocols on the fake driver: CAI v3 streams, DLPack 1.x both ways, foreign streams.

The fake driver runs asynchronous work at once, so a stream handshake cannot race here: the
tests spy on the driver handle's cuEventRecord / cuStreamWaitEvent / cuStreamSynchronize and
check *which* streams were ordered after which.  Capsules are read back with cuproc's own
importer (``_dlpack.consume``) and, for host memory, with NumPy's ``from_dlpack``.
"""
from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import Context, DeviceBuffer, Stream, _dlpack
from cuproc import memory as mem
from cuproc._support import handle_int
from cuproc.errors import ClosedResourceError, InvalidValueError
from cuproc.interop import DLPackArray, from_dlpack
from subproc import run_python

ffi = cuproc.ffi
ROOT = Path(__file__).resolve().parent.parent

_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_IsValid.restype, _IsValid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_GetPointer.restype, _GetPointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def capsule_name(capsule) -> str:
    for name in (b"dltensor_versioned", b"dltensor", b"used_dltensor_versioned", b"used_dltensor"):
        if _IsValid(capsule, name):
            return name.decode()
    return "?"


def spy(monkeypatch, *names):
    """Record (name, args as ints) of every call the default handle makes to ``names``."""
    drv = cuproc.driver.default_driver()
    calls = []
    for name in names:
        real = getattr(drv, name)

        def wrapper(*args, _real=real, _name=name):
            calls.append((_name, tuple(handle_int(a) if isinstance(a, ffi.CData) and ffi.typeof(a).kind == "pointer"
                                       else a for a in args)))
            return _real(*args)
        monkeypatch.setattr(drv, name, wrapper)
    return calls


def waits(calls):
    """[(waiting stream, stream the event was recorded on)] from a spy's calls."""
    recorded, out = {}, []
    for name, args in calls:
        if name == "cuEventRecord":
            recorded[args[0]] = args[1]
        elif name == "cuStreamWaitEvent":
            out.append((args[0], recorded.get(args[1])))
    return out


def device_bytes(buf, n):
    out = np.zeros(n, np.uint8)
    mem.copy(out, buf, n)
    return out


class ForeignStream:
    """Another library's stream: a raw cuStreamCreate handle behind ``__cuda_stream__``."""

    def __init__(self):
        out = ffi.new("CUstream *")
        cuproc.driver.default_driver().checked.cuStreamCreate(out, 0)
        self.handle = out[0]

    def __cuda_stream__(self):
        return (0, handle_int(self.handle))

    def destroy(self):
        cuproc.driver.default_driver().checked.cuStreamDestroy(self.handle)


class TorchLikeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


class CupyLikeStream:          # CuPy's class is named Stream / ExternalStream: the ``ptr`` is read for *Stream
    def __init__(self, handle):
        self.ptr = handle


class CAI:
    def __init__(self, ptr, nbytes, *, readonly=False, stream=None, mask=None):
        self.__cuda_array_interface__ = {"data": (ptr, readonly), "shape": (nbytes,), "typestr": "|u1",
                                         "strides": None, "version": 3, "stream": stream, "mask": mask}


# ----------------------------------------------------------------------------- CAI export: the stream

def test_cai_stream_is_the_last_stream_or_the_default_marker(fk, pc):
    buf = DeviceBuffer(64)
    assert buf.__cuda_array_interface__["stream"] == 1                    # nothing recorded: legacy default
    s, s2 = Stream(), Stream()
    a = mem.alloc_async(32, s)
    assert a.__cuda_array_interface__["stream"] == handle_int(s.handle)
    mem.memset(buf, 7, stream=s2)
    assert buf.__cuda_array_interface__["stream"] == handle_int(s2.handle)
    assert buf.view(np.int32, (4, 4)).__cuda_array_interface__["stream"] == handle_int(s2.handle)
    mem.copy(buf, np.zeros(64, np.uint8), stream=s)
    assert buf.last_stream is s and buf.__cuda_array_interface__["stream"] == handle_int(s.handle)
    mem.copy(np.zeros(8, np.uint8), buf.view(np.uint8, 8), stream=s2)  # a view records on its buffer
    assert buf.last_stream is s2
    mem.memset(buf, 1)                                                   # synchronous: the default stream again
    assert buf.last_stream is None and buf.__cuda_array_interface__["stream"] == 1
    raw = ForeignStream()
    mem.copy(buf, np.zeros(64, np.uint8), stream=handle_int(raw.handle))   # a raw handle, as an int
    assert buf.last_stream == handle_int(raw.handle) == buf.__cuda_array_interface__["stream"]
    raw.destroy()
    a.free()
    for x in (s, s2):
        x.close()


def test_cai_of_a_buffer_whose_stream_was_closed_synchronizes_and_says_none(fk, pc, monkeypatch):
    s = Stream()
    buf = DeviceBuffer(64)
    buf.last_stream = s          # as after a kernel launched on s wrote it (the documented way to say so)
    s.close()
    calls = spy(monkeypatch, "cuCtxSynchronize")
    assert buf.__cuda_array_interface__["stream"] is None
    assert [name for name, _ in calls] == ["cuCtxSynchronize"] and buf.last_stream is None
    assert buf.__cuda_array_interface__["stream"] == 1                   # from now on: the default stream
    buf.free()


def test_per_thread_handle_exports_marker_2(fake):
    gc.collect()
    fake.reset()
    cuproc.set_default_driver(cuproc.Driver(library=str(fake.path), per_thread_default_stream=True))
    try:
        pc = cuproc.use_device(0)
        buf = DeviceBuffer(16)
        assert buf.__cuda_array_interface__["stream"] == 2
        assert mem.alloc_async(16).__cuda_array_interface__["stream"] == 2
        buf.free()
        gc.collect()
        pc.release()
    finally:
        cuproc.set_default_driver(None)
    assert fake.stale_count() == 0


def test_managed_cai_names_the_default_stream(fk, pc):
    m = mem.ManagedBuffer(64)
    assert m.__cuda_array_interface__["stream"] == 1
    m.free()


# ----------------------------------------------------------------------------- DLPack export

def test_dlpack_capsule_kind_follows_max_version(fk, pc):
    buf = DeviceBuffer(64)
    v = buf.view(np.float32, (4, 4))
    assert capsule_name(v.__dlpack__()) == "dltensor"                               # no max_version: legacy
    assert capsule_name(v.__dlpack__(max_version=(0, 8))) == "dltensor"
    cap = v.__dlpack__(max_version=(1, 3))
    assert capsule_name(cap) == "dltensor_versioned"
    managed = _dlpack.DLManagedTensorVersioned.from_address(_GetPointer(cap, b"dltensor_versioned"))
    assert (managed.version.major, managed.version.minor) == _dlpack.VERSION and managed.flags == 0
    t = _dlpack.consume(cap)
    assert (t.ptr, t.shape, t.typestr, t.device, t.readonly) == (buf.ptr, (4, 4), "<f4", (2, 0), False)
    assert capsule_name(cap) == "used_dltensor_versioned"
    with pytest.raises(TypeError):
        v.__dlpack__(max_version=1)
    with pytest.raises(TypeError):
        v.__dlpack__(None)                                                           # keyword-only, as the spec says
    t.release()
    buf.free()


def test_exported_device_memory_stays_alive_and_refuses_explicit_free(fk, pc):
    ctx = Context.create(0)
    buf = DeviceBuffer(64)
    cap = buf.__dlpack__(max_version=(1, 0))
    with pytest.raises(BufferError):
        buf.free()                                          # the consumer could not be told
    with pytest.raises(BufferError):
        ctx.destroy()
    assert not buf.freed and fk.live("device_alloc") == 1
    t = _dlpack.consume(cap)
    del cap, buf
    gc.collect()
    assert fk.live("device_alloc") == 1                     # the consumer's tensor holds the buffer
    t.release()
    gc.collect()
    assert fk.live("device_alloc") == 0                     # the deleter let it go: freed
    t.release()                                             # a second release does nothing
    ctx.destroy()


def test_last_primary_release_is_refused_while_device_memory_is_exported(fk):
    pc = cuproc.use_device(0)
    buf = DeviceBuffer(16)
    cap = buf.__dlpack__()
    with pytest.raises(BufferError):
        pc.release()
    assert pc.retain_count == 1 and fk.primary_refcount(0) == 1 and not buf.freed
    del cap
    buf.free()
    pc.release()
    assert fk.primary_refcount(0) == 0


def test_dropped_unconsumed_capsule_runs_its_deleter(fk, pc):
    buf = DeviceBuffer(64)
    before = len(_dlpack._live)
    for mv in (None, (1, 0)):
        cap = buf.__dlpack__(max_version=mv)
        assert len(_dlpack._live) == before + 1 and buf.has_views()
        del cap                                      # no destructor runs: the check for views sweeps
        assert not buf.has_views() and len(_dlpack._live) == before
    buf.free()


def test_copy_true_copies_on_the_pending_stream(fk, pc, monkeypatch):
    s = Stream()
    buf = DeviceBuffer(16)
    mem.copy(buf, np.arange(16, dtype=np.uint8), stream=s)
    calls = spy(monkeypatch, "cuMemcpyDtoDAsync")
    cap = buf.__dlpack__(max_version=(1, 0), copy=True, stream=-1)
    managed = _dlpack.DLManagedTensorVersioned.from_address(_GetPointer(cap, b"dltensor_versioned"))
    assert managed.flags == _dlpack.FLAG_IS_COPIED
    t = _dlpack.consume(cap)
    assert t.ptr != buf.ptr and calls[0][1][3] == handle_int(s.handle)               # on s, after the write
    assert device_bytes(t.ptr, 16).tolist() == list(range(16))
    buf.free()                                              # the copy is exported, not the original
    t.release()
    s.close()


def test_dl_device_rules(fk, pc):
    buf = DeviceBuffer(8)
    mem.copy(buf, np.arange(8, dtype=np.uint8))
    t = _dlpack.consume(buf.__dlpack__(dl_device=(2, 0)))
    assert t.ptr == buf.ptr
    t.release()
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(2, 1))                    # another GPU: no
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(1, 0), copy=False)        # the host, without a copy: no
    cap = buf.view(np.uint16).__dlpack__(dl_device=(1, 0), max_version=(1, 0))    # the host, copied
    t = _dlpack.consume(cap)
    assert t.device == (1, 0) and t.shape == (4,) and t.typestr == "<u2"
    host = np.ctypeslib.as_array((ctypes.c_uint16 * 4).from_address(t.ptr))
    assert host.tolist() == np.arange(8, dtype=np.uint8).view(np.uint16).tolist()
    t.release()
    if np.lib.NumpyVersion(np.__version__) >= "2.1.0":              # from_dlpack(device=) is NumPy 2.1+
        on_host = np.from_dlpack(buf.view(np.uint16), device="cpu")  # NumPy asks for dl_device=(kDLCPU, 0)
        assert on_host.tolist() == np.arange(8, dtype=np.uint8).view(np.uint16).tolist()
        assert not buf.has_views()                                   # a copy: the buffer is not exported
    with pytest.raises(TypeError):
        buf.__dlpack__(dl_device="cuda")
    buf.free()


def test_stream_handshake_orders_the_consumer_after_the_producer(fk, pc, monkeypatch):
    s, consumer = Stream(), Stream()
    buf = mem.alloc_async(64, s)
    calls = spy(monkeypatch, "cuEventRecord", "cuStreamWaitEvent", "cuEventCreate", "cuEventDestroy")
    _dlpack.consume(buf.__dlpack__(stream=handle_int(consumer.handle))).release()
    assert waits(calls) == [(handle_int(consumer.handle), handle_int(s.handle))]
    assert [n for n, _ in calls].count("cuEventDestroy") == 1 and fk.live("event") == 0
    calls.clear()
    _dlpack.consume(buf.__dlpack__(stream=handle_int(s.handle))).release()           # same stream: nothing
    _dlpack.consume(buf.__dlpack__(stream=-1)).release()                              # -1: no synchronization
    assert calls == []
    _dlpack.consume(buf.__dlpack__()).release()                                       # None: the legacy stream
    assert waits(calls) == [(1, handle_int(s.handle))]
    calls.clear()
    _dlpack.consume(buf.__dlpack__(stream=consumer)).release()                        # a Stream object is taken
    assert waits(calls) == [(handle_int(consumer.handle), handle_int(s.handle))]
    with pytest.raises(ValueError):
        buf.__dlpack__(stream=0)                                                      # ambiguous, per the spec
    with pytest.raises(TypeError):
        buf.__dlpack__(stream="s")
    consumer.close()
    with pytest.raises(ClosedResourceError):
        buf.__dlpack__(stream=consumer)
    buf.free_async()
    s.close()


def test_dlpack_of_freed_memory_or_ended_context_is_refused(fk):
    ctx = Context.create(0)
    buf = DeviceBuffer(16)
    v = buf.view(np.uint8)
    buf.free()
    with pytest.raises(ClosedResourceError):
        v.__dlpack__()
    buf2 = DeviceBuffer(16)
    ctx.destroy()
    with pytest.raises(ClosedResourceError):
        buf2.__dlpack__()
    with pytest.raises(ClosedResourceError):
        buf2.__cuda_array_interface__


# ----------------------------------------------------------------------------- host memory

@pytest.mark.parametrize("kind", ["pinned", "managed"])
def test_host_memory_exports_cuda_host_and_managed_devices(fk, pc, kind):
    buf = mem.PinnedBuffer(16) if kind == "pinned" else mem.ManagedBuffer(16)
    buf.numpy()[:] = np.arange(16, dtype=np.uint8)
    assert buf.__dlpack_device__() == ((3, 0) if kind == "pinned" else (13, 0))
    arr = np.from_dlpack(buf)                               # NumPy takes kDLCUDAHost and kDLCUDAManaged
    assert arr.ctypes.data == buf.ptr and arr.tolist() == list(range(16))
    with pytest.raises(BufferError):
        buf.free()                                          # NumPy's array still uses it
    on_cpu = _dlpack.consume(buf.__dlpack__(dl_device=(1, 0)))     # kDLCPU: the same bytes
    assert (on_cpu.ptr, on_cpu.device) == (buf.ptr, (1, 0))
    copied = _dlpack.consume(buf.__dlpack__(copy=True, max_version=(1, 0)))
    assert copied.ptr != buf.ptr and copied.device == buf.__dlpack_device__()
    assert bytes((ctypes.c_ubyte * 16).from_address(copied.ptr)) == bytes(range(16))
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(2, 0))
    del arr
    for t in (on_cpu, copied):
        t.release()
    gc.collect()
    buf.free()


# ----------------------------------------------------------------------------- DLPack import

class Producer:
    """Another library's tensor: exports a capsule whose deleter counts its calls."""

    def __init__(self, buf, *, readonly=False, versioned=True, device=(2, 0), strides=None, lanes=1):
        self.buf, self.readonly, self.versioned, self.device = buf, readonly, versioned, device
        self.strides, self.lanes, self.deleted, self.asked = strides, lanes, 0, []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.asked.append((stream, max_version))
        cap = _dlpack.to_capsule(self, self.buf.ptr, (self.buf.nbytes,), "|u1", self.device,
                                 versioned=self.versioned and max_version is not None, readonly=self.readonly)
        name = b"dltensor_versioned" if self.versioned and max_version is not None else b"dltensor"
        address = _GetPointer(cap, name)
        managed = _dlpack._live[address][0]

        def count(m):
            self.deleted += 1
            _dlpack._forget(ctypes.addressof(m.contents))    # what cuproc's own deleter does
        self._deleter = type(managed.deleter)(count)          # kept alive by the producer
        managed.deleter = self._deleter
        if self.strides is not None:
            self._strides = (ctypes.c_int64 * 1)(self.strides)
            managed.dl_tensor.strides = self._strides
        managed.dl_tensor.dtype.lanes = self.lanes
        return cap


def test_import_keeps_the_producer_alive_and_deletes_once(fk, pc):
    buf = DeviceBuffer(32)
    p = Producer(buf)
    s = Stream()
    arr = from_dlpack(p, stream=s)
    assert isinstance(arr, DLPackArray) and p.asked == [(handle_int(s.handle), (1, 0))]
    assert (arr.ptr, arr.shape, arr.typestr, arr.nbytes, arr.readonly) == (buf.ptr, (32,), "|u1", 32, False)
    assert arr.__cuda_array_interface__["stream"] == handle_int(s.handle)
    ref = weakref.ref(p)
    del p
    gc.collect()
    assert ref() is not None                                # the view holds the producer
    mem.copy(arr, np.full(32, 5, np.uint8))                 # usable wherever device memory is
    assert device_bytes(buf, 32).tolist() == [5] * 32
    producer = ref()
    arr.close()
    arr.close()
    del arr
    gc.collect()
    assert producer.deleted == 1 and ref() is not None      # the test still holds it; the view let go
    q = Producer(buf)
    from_dlpack(q)                                          # dropped at once: deleted by the finalizer
    gc.collect()
    assert q.deleted == 1 and q.asked == [(1, (1, 0))]      # None: the default stream's marker
    del producer, q
    gc.collect()
    buf.free()
    s.close()


def test_import_of_pinned_memory_passes_no_stream(fk, pc):
    pinned = mem.PinnedBuffer(32)
    arr = from_dlpack(pinned, stream=Stream())              # kDLCUDAHost: DLPack has no stream for it
    assert (arr.ptr, arr.device, arr.stream, arr.producer) == (pinned.ptr, (3, 0), None, pinned)
    with pytest.raises(BufferError):
        pinned.free()                                       # the import holds an export of it
    arr.close()
    pinned.free()


def test_import_of_a_capsule_and_of_a_legacy_producer(fk, pc):
    buf = DeviceBuffer(8)
    p = Producer(buf, versioned=False)
    arr = from_dlpack(p.__dlpack__(stream=1))               # a bare capsule
    assert arr.ptr == buf.ptr and arr.producer is None
    arr.close()
    assert p.deleted == 1
    with pytest.raises(BufferError):
        from_dlpack(_consumed(buf))
    with pytest.raises(TypeError):
        from_dlpack(object())
    buf.free()


def _consumed(buf):
    cap = buf.__dlpack__()
    _dlpack.consume(cap).release()
    return cap


def test_import_refusals_leave_the_capsule_to_its_producer(fk, pc):
    buf = DeviceBuffer(8)
    for bad in (Producer(buf, strides=2), Producer(buf, lanes=4)):
        with pytest.raises(BufferError):
            from_dlpack(bad)
        gc.collect()
        _dlpack.sweep()                                     # (what any check for views or export does)
        assert bad.deleted == 1                             # refused: the unconsumed capsule's tensor deleted
    host = Producer(buf, device=(1, 0))
    with pytest.raises(BufferError):
        from_dlpack(host)                                   # CPU memory: NumPy's business
    assert host.asked == []
    with pytest.raises(BufferError):
        from_dlpack(np.arange(4))                           # a NumPy array says kDLCPU
    buf.free()


def test_read_only_import_is_refused_as_a_destination(fk, pc):
    buf = DeviceBuffer(8)
    mem.copy(buf, np.arange(8, dtype=np.uint8))
    arr = from_dlpack(Producer(buf, readonly=True))
    assert arr.readonly and arr.__cuda_array_interface__["data"] == (buf.ptr, True)
    with pytest.raises(InvalidValueError):
        mem.copy(arr, np.zeros(8, np.uint8))
    with pytest.raises(InvalidValueError):
        mem.memset(arr, 0)
    assert device_bytes(arr, 8).tolist() == list(range(8))  # reading is fine
    arr.close()
    with pytest.raises(ClosedResourceError):
        arr.ptr
    buf.free()


def test_version_two_tensors_are_refused(fk, pc):
    buf = DeviceBuffer(8)
    cap = buf.__dlpack__(max_version=(1, 0))
    managed = _dlpack.DLManagedTensorVersioned.from_address(_GetPointer(cap, b"dltensor_versioned"))
    managed.version.major = 2
    with pytest.raises(BufferError):
        from_dlpack(cap)
    del cap
    buf.free()


FORK_IMPORT = """
import os, sys, gc, numpy as np
sys.path.insert(0, {tests!r})
import cuproc
from cuproc import _dlpack
from cuproc.interop import from_dlpack
drv = cuproc.Driver(library={lib!r})
cuproc.set_default_driver(drv)
pc = cuproc.use_device(0)
buf = cuproc.DeviceBuffer(64)
arr = from_dlpack(buf)
pid = os.fork()
if pid == 0:
    try:
        arr.ptr
        code = 1
    except cuproc.ForkedProcessError:
        code = 0
    live = len(_dlpack._live)
    del arr
    gc.collect()
    os._exit(code if len(_dlpack._live) == live else 2)   # the child never runs the parent's deleter
_, status = os.waitpid(pid, 0)
arr.close()
buf.free()
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_imported_arrays_refuse_after_fork_and_never_delete_in_the_child(fk):
    code = FORK_IMPORT.format(tests=str(ROOT / "tests"), lib=str(fk.path))
    proc = run_python(code)
    assert proc.stdout.strip() == "0", proc.stdout


# ----------------------------------------------------------------------------- CAI import

def test_cai_mask_read_only_and_stream_are_honoured(fk, pc, monkeypatch):
    buf = DeviceBuffer(16)
    with pytest.raises(InvalidValueError):
        mem.copy(CAI(buf.ptr, 16, mask=CAI(buf.ptr, 16)), np.zeros(16, np.uint8))
    with pytest.raises(InvalidValueError):
        mem.copy(CAI(buf.ptr, 16, readonly=True), np.zeros(16, np.uint8))
    with pytest.raises(InvalidValueError):
        mem.copy(CAI(buf.ptr, 16, stream=0), np.zeros(16, np.uint8))
    mem.copy(np.zeros(16, np.uint8), CAI(buf.ptr, 16, readonly=True))      # read-only source: fine
    producer, s = Stream(), Stream()
    calls = spy(monkeypatch, "cuStreamSynchronize", "cuEventRecord", "cuStreamWaitEvent")
    mem.copy(np.zeros(16, np.uint8), CAI(buf.ptr, 16, stream=handle_int(producer.handle)))
    assert calls == [("cuStreamSynchronize", (handle_int(producer.handle),))]   # synchronous: a host wait
    calls.clear()
    mem.memset(CAI(buf.ptr, 16, stream=handle_int(producer.handle)), 3, stream=s)
    assert waits(calls) == [(handle_int(s.handle), handle_int(producer.handle))]  # on a stream: an event
    calls.clear()
    mem.memset(CAI(buf.ptr, 16, stream=handle_int(s.handle)), 3, stream=s)      # the same stream: nothing
    mem.memset(CAI(buf.ptr, 16, stream=1), 3)              # synchronous, on the legacy stream it names: nothing
    assert calls == []
    cap = buf.__dlpack__()
    with pytest.raises(BufferError):
        buf.free_async()                                    # exported: refused like free()
    del cap
    buf.free()
    producer.close()
    s.close()


def test_cai_stream_of_another_context_is_waited_for_across_contexts(fk, monkeypatch):
    """The exporter's stream lives in context a, cuproc's work in b: the event is made and recorded in
    a, the wait runs in b (the fake counts a binding error for either done in the wrong one)."""
    a = Context.create(0)
    producer = Stream()
    Context.pop()
    b = Context.create(0)                                   # current from here on
    buf, s = DeviceBuffer(16), Stream()
    calls = spy(monkeypatch, "cuEventRecord", "cuStreamWaitEvent")
    mem.memset(CAI(buf.ptr, 16, stream=handle_int(producer.handle)), 2, stream=s)
    assert waits(calls) == [(handle_int(s.handle), handle_int(producer.handle))]
    assert fk.binding_errors() == 0, fk.binding_calls()
    s.synchronize()
    for x in (s, producer):
        x.close()
    buf.free()
    for ctx in (a, b):
        ctx.destroy()


# ----------------------------------------------------------------------------- streams

def test_stream_exports_cuda_stream_and_adopts_foreign_handles(fk, pc):
    s = Stream()
    assert s.__cuda_stream__() == (0, handle_int(s.handle))
    foreign = ForeignStream()
    owner_ref = weakref.ref(foreign)
    adopted = Stream.from_handle(foreign.__cuda_stream__()[1], owner=foreign)
    assert adopted.context is pc.context and not adopted.owned and adopted.priority == 0
    adopted.synchronize()
    live = fk.live("stream")
    adopted.close()
    del adopted
    gc.collect()
    assert fk.live("stream") == live and owner_ref() is not None       # never destroyed by cuproc
    foreign.destroy()
    for bad in (0, -3, "s", True):
        with pytest.raises(InvalidValueError):
            Stream.from_handle(bad)
    s.close()
    with pytest.raises(ClosedResourceError):
        s.__cuda_stream__()


def test_foreign_stream_objects_are_taken_wherever_a_stream_is(fk, pc):
    foreign = ForeignStream()
    h = handle_int(foreign.handle)
    buf = DeviceBuffer(16)
    for obj in (foreign, TorchLikeStream(h), CupyLikeStream(h)):
        mem.memset(buf, 9, stream=obj)
        assert isinstance(buf.last_stream, Stream) and buf.last_stream.owner is obj
        assert buf.__cuda_array_interface__["stream"] == h
    a = mem.alloc_async(16, foreign)
    assert a.stream.owner is foreign and a.context is pc.context
    a.free()
    cuproc.Event().record(CupyLikeStream(h)).synchronize()            # events take them too
    mem.memset(buf, 1, stream=TorchLikeStream(0))                       # torch's default stream is handle 0
    assert buf.last_stream is None and buf.__cuda_array_interface__["stream"] == 1   # the NULL stream: never 0
    with pytest.raises(TypeError, match="__cuda_stream__"):
        mem.memset(buf, 1, stream=object())
    with pytest.raises(TypeError):
        mem.memset(buf, 1, stream=type("Thing", (), {"ptr": h})())      # .ptr only on *Stream classes

    class Bad:
        def __cuda_stream__(self):
            return (1, h)
    with pytest.raises(InvalidValueError):
        mem.memset(buf, 1, stream=Bad())
    buf.free()
    gc.collect()
    foreign.destroy()


def test_a_prepared_launch_holds_a_foreign_stream(fk, pc):
    from fakedriver import fake_image
    fn = cuproc.Module.load(fake_image({"empty": [8, 4, 4]})).get_function("empty")
    foreign = ForeignStream()
    holder = TorchLikeStream(handle_int(foreign.handle))
    ref = weakref.ref(holder)
    run = fn.prepare(["float*", "int", "float"], 1, 32, stream=holder)
    del holder
    gc.collect()
    assert ref() is not None                                 # the launch keeps the foreign owner alive
    before = fk.launch_count()
    buf = DeviceBuffer(16)
    run(buf, 1, 1.0)
    fn.launch(1, 32, (buf, np.int32(1), np.float32(1)), stream=TorchLikeStream(handle_int(foreign.handle)))
    assert fk.launch_count() == before + 2
    buf.free()
    del run
    gc.collect()
    assert ref() is None
    foreign.destroy()


# ----------------------------------------------------------------------------- the loader and stub libraries

STUB_C = r"""
#define X(name, args) __attribute__((visibility("default"))) int name args { return 34; }
X(cuInit, (unsigned f))
#ifdef ANSWERS_VERSION
__attribute__((visibility("default"))) int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
#else
X(cuDriverGetVersion, (int *v))
#endif
#ifdef ANSWERS_LOOKUP
__attribute__((visibility("default"))) int cuGetProcAddress_v2(const char *s, void **p, int v,
                                                               unsigned long long f, int *st) {
    *p = (void *)cuDriverGetVersion; if (st) *st = 0; return 0;
}
#else
X(cuGetProcAddress_v2, (const char *s, void **p, int v, unsigned long long f, int *st))
#endif
X(cuGetProcAddress, (const char *s, void **p, int v, unsigned long long f))
X(cuGetErrorName, (int c, const char **s))
X(cuGetErrorString, (int c, const char **s))
"""


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    """A library that answers like the toolkit's stub libcuda (CUDA_ERROR_STUB_LIBRARY to everything):
    in a ``stubs`` directory, copied outside one, and a variant (in ``other/stubs``) that answers
    cuDriverGetVersion, recognizable only by where it lives."""
    out = tmp_path_factory.mktemp("stub")
    src = out / "stub.c"
    src.write_text(STUB_C)
    lib, answering = out / "stubs" / "libcuda.so", out / "other" / "stubs" / "libcuda.so"
    try:
        for path, flags in ((lib, []), (answering, ["-DANSWERS_VERSION"])):
            path.parent.mkdir(parents=True)
            subprocess.run(["cc", "-shared", "-fPIC", *flags, "-o", str(path), str(src)], check=True,
                           capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:  # pragma: no cover - CI has cc
        pytest.skip(f"no C compiler: {exc}")
    copy = out / "libcuda.so.1"
    copy.write_bytes(lib.read_bytes())
    return lib, copy, answering


def test_a_stub_library_is_not_taken_for_a_driver(stub):
    from cuproc import loader
    for path in stub:          # by its answer, by its answer outside stubs/, by where it lives
        with pytest.raises(cuproc.DriverNotFoundError, match="stub"):
            loader.open_library(str(path))
        assert not loader.is_driver_available(str(path))
    with pytest.raises(cuproc.DriverNotFoundError, match="stub"):
        cuproc.Driver(library=str(stub[1])).checked.cuInit(0)


def test_the_search_skips_a_stub_and_takes_the_driver_after_it(stub, fake, monkeypatch):
    from cuproc import loader
    monkeypatch.delenv(loader.ENV_LIBRARY, raising=False)
    monkeypatch.setattr(loader, "DEFAULT_CANDIDATES", (str(stub[0]), str(fake.path)))
    lib = loader.open_library()
    assert lib.path == str(fake.path) and not lib.is_stub()
    monkeypatch.setattr(loader, "DEFAULT_CANDIDATES", (str(stub[0]),))
    with pytest.raises(cuproc.DriverNotFoundError) as info:
        loader.open_library()
    assert info.value.attempts[0][0] == str(stub[0]) and "stub" in info.value.attempts[0][1]


def test_the_search_skips_a_library_that_is_no_driver_and_takes_the_driver_after_it(fake, monkeypatch):
    """A candidate that opens but exports no cuDriverGetVersion (here libm) is one failed attempt, not
    the end of the search: the driver after it is taken, and a search that finds none lists both."""
    from cuproc import loader
    monkeypatch.delenv(loader.ENV_LIBRARY, raising=False)
    monkeypatch.setattr(loader, "DEFAULT_CANDIDATES", ("libm.so.6", str(fake.path)))
    assert loader.open_library().path == str(fake.path)
    monkeypatch.setattr(loader, "DEFAULT_CANDIDATES", ("libm.so.6", "libcuproc-no-such-library.so"))
    with pytest.raises(cuproc.DriverNotFoundError) as info:
        loader.open_library()
    assert [path for path, _ in info.value.attempts] == ["libm.so.6", "libcuproc-no-such-library.so"]
    assert all(reason for _, reason in info.value.attempts)


def test_a_library_whose_probe_fails_otherwise_is_closed_before_the_error_propagates(fake, monkeypatch):
    from cuproc import loader
    closed: list[str] = []

    class Handle:          # the opened library, as dlopen returns it: only its close is watched
        def __init__(self, path: str) -> None:
            self.path = path

        def close_lib(self) -> None:
            closed.append(self.path)

    def failing(self, path, handle):
        raise MemoryError("the probe ran out of memory")
    monkeypatch.delenv(loader.ENV_LIBRARY, raising=False)
    monkeypatch.setattr(loader, "DEFAULT_CANDIDATES", ("libcuproc-probe-fails.so",))
    monkeypatch.setattr(loader, "dlopen", Handle)
    monkeypatch.setattr(loader.DriverLibrary, "__init__", failing)
    with pytest.raises(MemoryError):
        loader.open_library()
    assert closed == ["libcuproc-probe-fails.so"]
    monkeypatch.undo()                       # the library probes fine, but the stub test fails
    monkeypatch.delenv(loader.ENV_LIBRARY, raising=False)
    monkeypatch.setattr(loader, "DEFAULT_CANDIDATES", (str(fake.path),))
    monkeypatch.setattr(loader, "_libraries", {})
    real_dlopen = loader.dlopen
    opened: list = []

    def watched(path: str):
        handle = real_dlopen(path)
        opened.append(handle)
        return handle

    def stub_fails(self):
        raise MemoryError("the stub test ran out of memory")
    monkeypatch.setattr(loader, "dlopen", watched)
    monkeypatch.setattr(loader.DriverLibrary, "is_stub", stub_fails)
    with pytest.raises(MemoryError):
        loader.open_library()
    with pytest.raises(ValueError):           # cffi refuses a library that was closed
        opened[0].load_function(cuproc.ffi.typeof("void *"), "cuDriverGetVersion")


def test_a_rejected_stub_is_unloaded_and_the_driver_stays_loaded_through_exit(stub, fake):
    """The search dlcloses a stub it rejected; the driver it takes stays mapped after cuproc lets go of
    it and through the interpreter's teardown (cffi would unload a library whose handle is freed, while
    the driver may still call cuproc's callbacks): glibc's loader reports no "destroying link map" for it."""
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("reads glibc's LD_DEBUG report of unloaded libraries")
    stub_path, driver_path = os.path.realpath(stub[0]), os.path.realpath(fake.path)
    code = f"""
import gc, os, sys
sys.path.insert(0, {str(ROOT)!r})
import cuproc
from cuproc import loader
loader.DEFAULT_CANDIDATES = ({stub_path!r}, {driver_path!r})
lib = loader.open_library()
maps = open("/proc/self/maps").read()
print({stub_path!r} in maps, {driver_path!r} in maps)
pc = cuproc.use_device(0)
del lib
gc.collect()
"""
    env = {k: v for k, v in os.environ.items() if k not in ("CUPROC_LIBCUDA", "LD_DEBUG_OUTPUT")}
    proc = run_python(code, env={**env, "LD_DEBUG": "files"})
    assert proc.stdout.split() == ["False", "True"]
    destroyed = [line for line in proc.stderr.splitlines() if "destroying link map" in line]
    assert any(stub_path in line for line in destroyed)          # the check sees unloads
    assert not any(driver_path in line for line in destroyed)


def test_a_stub_found_by_name_is_recognized_by_where_it_was_loaded_from(stub):
    """The unversioned name, found through LD_LIBRARY_PATH in a stubs directory (the issue's case),
    even if the stub answered cuDriverGetVersion: dladdr names the file."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from cuproc import loader; "
            f"lib = loader.DriverLibrary('libcuda.so', loader.dlopen('libcuda.so')); "
            f"print(lib.loaded_from(), lib.is_stub())")
    env = dict(os.environ, LD_LIBRARY_PATH=str(stub[2].parent))
    proc = run_python(code, env=env)
    where, is_stub = proc.stdout.split()
    assert Path(where).resolve() == stub[2].resolve() and is_stub == "True"


# ----------------------------------------------------------------------------- review fixes

CAPSULE_PRELUDE = """
import gc, sys
import cuproc
cuproc.set_default_driver(cuproc.Driver(library={lib!r}))
pc = cuproc.use_device(0)
buf = cuproc.DeviceBuffer(64)
class Holder:
    pass
"""


def _run_script(tmp_path, fk, body):
    """Run ``body`` after CAPSULE_PRELUDE as a script file (as the reproducers ran: a ``-c`` main
    module is torn down differently); (exit status, stdout, stderr)."""
    script = tmp_path / "script.py"
    script.write_text(CAPSULE_PRELUDE.format(lib=str(fk.path)) + body)
    try:
        proc = subprocess.run([sys.executable, "-X", "faulthandler", str(script)], capture_output=True, text=True,
                              timeout=30, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        return None, "", f"timed out (a deadlock?): {exc.stderr!r}"
    return proc.returncode, proc.stdout.strip(), proc.stderr


@pytest.mark.parametrize("extra", ["", "h.v = buf.__dlpack__(max_version=(1, 0))\n"])
def test_an_unconsumed_capsule_in_a_cycle_at_exit_does_not_crash(fk, extra, tmp_path):
    """Module teardown must not free the capsule destructor, the deleters or the tensors before the
    final garbage collection runs the destructor (it segfaulted, status 139)."""
    body = "h = Holder()\nh.c = buf.__dlpack__()\n" + extra + "h.s = h   # only the last collection frees it\nprint('ok')\n"
    code, out, err = _run_script(tmp_path, fk, body)
    assert (code, out) == (0, "ok"), err


def test_a_collection_inside_the_export_lock_does_not_deadlock(fk, tmp_path):
    """A garbage collection run while the export lock is held (say, by an allocation inside it) can
    destroy a capsule, whose destructor takes the lock again on the same thread: held here on purpose,
    deterministically (a plain Lock hung; the subprocess times out then)."""
    body = """
from cuproc import _dlpack
with _dlpack._lock:
    h = Holder(); h.c = buf.__dlpack__(); h.s = h
    del h
    gc.collect()         # the destructor runs the deleter, which takes the lock
print(buf.has_views())
"""
    code, out, err = _run_script(tmp_path, fk, body)
    assert (code, out) == (0, "False"), err


class NullStream:
    """A library's default stream, as torch and cuda.core name it: handle 0."""

    def __cuda_stream__(self):
        return (0, 0)


def test_cai_never_names_stream_zero(fk, pc):
    """CAI v3 forbids stream 0: work on the NULL stream is the default stream's (marker 1 here)."""
    a = mem.alloc_async(64, 0)
    assert a.__cuda_array_interface__["stream"] == 1
    d = DeviceBuffer(64)
    for stream in (0, NullStream(), ffi.cast("CUstream", 0)):
        d.last_stream = Stream()                  # something else first, so the call must reset it
        mem.copy(d, np.zeros(64, np.uint8), stream=stream)
        assert d.__cuda_array_interface__["stream"] == 1
        d.last_stream = Stream()
        mem.memset(d, 0, stream=stream)
        assert d.__cuda_array_interface__["stream"] == 1
    d.last_stream = 0                             # set by hand: still never exported as 0
    assert d.__cuda_array_interface__["stream"] == 1
    a.free()
    d.free()


def test_an_imported_array_keeps_its_stream_and_never_names_it_closed(fk, pc, monkeypatch):
    src = DeviceBuffer(64)
    s = Stream()
    arr = from_dlpack(src, stream=s)
    assert arr.stream is s and arr.__cuda_array_interface__["stream"] == handle_int(s.handle)
    s.close()
    calls = spy(monkeypatch, "cuCtxSynchronize", "cuStreamSynchronize")
    assert arr.__cuda_array_interface__["stream"] is None      # closed: its context synchronized once
    assert [n for n, _ in calls] == ["cuCtxSynchronize"]
    mem.copy(np.zeros(64, np.uint8), arr)                       # nothing stale reaches the driver (fk)
    assert all(n != "cuStreamSynchronize" for n, _ in calls)
    arr.close()
    src.free()


def test_closing_an_imported_array_leaves_the_epoch(fk, pc):
    from cuproc._resource import EPOCH
    src = DeviceBuffer(64)
    arr = from_dlpack(src)
    before = EPOCH[0]
    arr.close()
    assert EPOCH[0] == before and arr.closed
    src.free()


@pytest.mark.parametrize("kind", ["pinned", "managed"])
def test_host_exports_wait_for_the_last_stream(fk, pc, monkeypatch, kind):
    """A stream-ordered copy into pinned or managed memory is waited for before a host (kDLCPU, or
    stream=None) export; a consumer's CUDA stream waits on the device instead."""
    host = mem.PinnedBuffer(64) if kind == "pinned" else mem.ManagedBuffer(64)
    d = DeviceBuffer(64)
    s = Stream()
    mem.copy(host, d, stream=s)
    assert host.last_stream is s
    calls = spy(monkeypatch, "cuStreamSynchronize", "cuEventRecord", "cuStreamWaitEvent")
    for args in ({}, {"dl_device": (1, 0)}):
        mem.copy(host, d, stream=s)
        calls.clear()
        _dlpack.consume(host.__dlpack__(**args)).release()
        assert calls == [("cuStreamSynchronize", (handle_int(s.handle),))], args
        assert host.last_stream is None
    mem.copy(host, d, stream=s)
    calls.clear()
    consumer = Stream()
    _dlpack.consume(host.__dlpack__(stream=consumer)).release()
    assert waits(calls) == [(handle_int(consumer.handle), handle_int(s.handle))]
    calls.clear()
    _dlpack.consume(host.__dlpack__(stream=-1)).release()          # -1: no synchronization at all
    assert calls == []
    gc.collect()
    host.free()
    d.free()


def test_a_foreign_streams_context_is_made_once_and_checked_at_each_use(fk, pc, monkeypatch):
    """Another library's stream: its Context object is made once per handle (while it lives) and
    each use checks it with one cuStreamGetCtx, so a handle made again in another context is never
    given the old one.  No weak reference to the other library's objects is kept (their teardown
    at interpreter exit must not depend on cuproc's)."""
    foreign, other = ForeignStream(), ForeignStream()
    d = DeviceBuffer(64)
    calls = spy(monkeypatch, "cuStreamGetCtx")
    seen = []
    for _ in range(3):
        mem.memset(d, 0, stream=foreign)
        mem.copy(d, np.zeros(64, np.uint8), stream=foreign)
        seen.append(d.last_stream.context)
    assert len(calls) == 6 and all(c is seen[0] for c in seen) and d.last_stream.owner is foreign
    assert seen[0] is pc.context                       # the fake made the stream in the current context
    mem.memset(d, 0, stream=other)
    assert len(calls) == 7 and d.last_stream.owner is other
    # The handle made again in another context (a driver may hand a destroyed handle out again): the
    # check sees another context, and the Context of the new one is made.
    ctx2 = Context.create(0)
    Context.pop()
    real = cuproc.driver.default_driver().cuStreamGetCtx

    def in_ctx2(h, out, *rest):
        rc = real(h, out, *rest)
        out[0] = ctx2.handle
        return rc
    monkeypatch.setattr(cuproc.driver.default_driver(), "cuStreamGetCtx", in_ctx2)
    mem.memset(d, 0, stream=foreign)
    assert d.last_stream.context is ctx2
    monkeypatch.undo()
    assert weakref.getweakrefcount(foreign) == 0 and weakref.getweakrefcount(other) == 0
    cai = CAI(d.ptr, 64, stream=handle_int(other.handle))
    waiter = Stream()
    mem.copy(np.zeros(64, np.uint8), cai, stream=waiter)   # a CAI exporter's stream: no weak reference either
    assert weakref.getweakrefcount(cai) == 0
    d.last_stream = None
    d.free()
    for f in (foreign, other):
        f.destroy()
    ctx2.destroy()


def test_from_dlpack_retries_only_for_a_missing_max_version(fk, pc):
    src = DeviceBuffer(16)

    class Broken:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, *, stream=None, max_version=None):
            if max_version is not None:        # a retry without it would hide this error
                raise TypeError("the producer's own bug")
            return src.__dlpack__(stream=stream)

    with pytest.raises(TypeError, match="the producer's own bug"):
        from_dlpack(Broken())

    class Old:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, *, stream=None):
            return src.__dlpack__(stream=stream)

    arr = from_dlpack(Old())
    assert arr.ptr == src.ptr
    arr.close()
    src.free()


def test_a_default_stream_consumer_waits_in_its_own_context(fk, pc, monkeypatch):
    """Marker 1 names the consumer's (current) context's default stream: the wait runs there, the
    event is recorded in the producer stream's context."""
    other = Context.create(0)            # current now
    try:
        buf = DeviceBuffer(16, context=pc.context)
        s = Stream(context=pc.context)
        mem.memset(buf, 0, stream=s)
        seen = []
        drv = cuproc.driver.default_driver()
        real = drv.cuStreamWaitEvent

        def wait(*args):
            seen.append(Context.current())
            return real(*args)
        monkeypatch.setattr(drv, "cuStreamWaitEvent", wait)
        _dlpack.consume(buf.__dlpack__(stream=1)).release()
        assert seen == [other]
        monkeypatch.undo()
        gc.collect()
        buf.free()
        s.close()
    finally:
        other.pop()
        other.destroy()


def test_internal_stream_helpers_are_not_public():
    import cuproc.stream
    for name in ("as_stream", "order_after", "foreign_stream_handle", "foreign_context"):
        assert name not in cuproc.__all__ and name not in cuproc.stream.__all__
        assert callable(getattr(cuproc.stream, name))
        with pytest.raises(AttributeError):
            getattr(cuproc, name)


STUB_PROBE = """
import ctypes, os, sys
from cuproc import loader
try:
    loader.open_library(sys.argv[1])
except Exception as exc:
    print(type(exc).__name__)
else:
    print("opened")
with open("/proc/self/maps") as maps:
    print(any(os.path.realpath(sys.argv[1]) in line for line in maps))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_a_driver_in_a_stubs_directory_is_taken_and_a_rejected_stub_is_unloaded(stub, tmp_path):
    """Where a library lives is only a hint: one in ``stubs/`` that answers cuDriverGetVersion and
    resolves symbols is a driver.  A rejected stub is dlclosed (it no longer appears in the maps)."""
    real = tmp_path / "stubs" / "libcuda.so"
    real.parent.mkdir()
    subprocess.run(["cc", "-shared", "-fPIC", "-DANSWERS_VERSION", "-DANSWERS_LOOKUP", "-o", str(real),
                    str(stub[0].parent.parent / "stub.c")], check=True, capture_output=True)
    for path, expected in ((real, ["opened", "True"]), (stub[0], ["DriverNotFoundError", "False"]),
                           (stub[2], ["DriverNotFoundError", "False"])):
        proc = run_python(STUB_PROBE, str(path), cwd=ROOT)
        assert proc.stdout.split() == expected, (path, proc.stdout)


def test_pinned_export_waits_on_a_stream_of_another_context(fk, pc):
    """The recorded last stream is synchronized in its own context, not the memory's."""
    p = mem.PinnedBuffer(64, portable=True)
    ctx = Context.create(0)
    try:
        s = Stream(context=ctx)
        d = DeviceBuffer(64, context=ctx)
        cuproc.driver.default_driver().cuCtxSetCurrent(pc.context.handle)
        mem.copy(p, d, stream=s)
        assert p.last_stream is s
        before = fk.binding_errors()
        capsule = p.__dlpack__()           # a host-side export: waits for s first
        assert fk.binding_errors() == before
        assert p.last_stream is None
        del capsule
        s.close()
        d.free()
    finally:
        ctx.destroy()


def test_dropping_a_foreign_stream_wrapper_leaves_the_epoch_alone(fk, pc):
    """Copies with another library's stream make not-owned wrappers; collecting one gives nothing
    back to the driver, so it must not send every hot path back to a full check."""
    from cuproc._resource import EPOCH
    s = Stream()

    class Foreign:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, handle_int(s.handle))
    d, h, foreign = DeviceBuffer(64), np.zeros(64, np.uint8), Foreign()
    mem.copy(d, h, stream=foreign)
    epoch = EPOCH[0]
    for _ in range(50):
        mem.copy(d, h, stream=foreign)    # each replaces the buffer's last stream wrapper
    gc.collect()
    assert EPOCH[0] == epoch
    owned = Stream()
    del owned
    gc.collect()
    assert EPOCH[0] > epoch                # an owned stream's drop still counts


def test_another_librarys_pythonapi_prototypes_change_nothing_in_cuproc(fk):
    """ctypes.pythonapi's function objects are shared by every library in the process: one that gives
    Py_IncRef or the PyCapsule calls its own argtypes/restype must not break cuproc's imports (which
    keep a host-function trampoline and DLPack callbacks forever) nor its DLPack exports."""
    code = f"""
    import ctypes, sys
    sys.path.insert(0, {str(ROOT)!r})
    api = ctypes.pythonapi
    api.Py_IncRef.argtypes = [ctypes.c_void_p]             # as another library might set them
    api.PyCapsule_New.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    import cuproc, cuproc.stream, cuproc._dlpack
    cuproc.set_default_driver(cuproc.Driver(library={str(fk.path)!r}))
    pc = cuproc.use_device(0)                               # held: its retain keeps the context
    buf = cuproc.DeviceBuffer(64)
    capsule = buf.__dlpack__()
    assert type(capsule).__name__ == "PyCapsule", capsule
    del capsule
    buf.free()
    print("ok")
    """
    assert run_python(code).stdout.strip() == "ok"
