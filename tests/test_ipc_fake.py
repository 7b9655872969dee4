"""IPC of device memory and events in the object layer (issue 38) on the stateful fake driver: handles as
bytes and pickles, refusals before the driver (own process, truncated, forged, wrong kind), the driver's
answers (forged contents, an exited exporter), and opening in another process: close, never free.

The fake (tests/fakedriver_ipc.c) checks each handle's magic and checksum, refuses an open in the exporting
process with CUDA_ERROR_INVALID_CONTEXT as the real driver does, counts opens per context, and counts a
close of anything but opened memory -- or a cuMemFree of it -- as a stale use (the ``fk`` fixture fails on
any).  Bytes are not shared across processes in the fake; the data path is tests/test_gpu_ipc.py's.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import cuproc
from cuproc import DeviceBuffer, Event
from cuproc import ipc
from cuproc.errors import ClosedResourceError, CudaError, InvalidContextError, InvalidValueError
from cuproc.virtual_memory import GrowableBuffer

from fakedriver import child_preamble
from ipc_workers import run_child
from subproc import run_python

ffi = cuproc.ffi
INVALID_VALUE, INVALID_CONTEXT, NOT_SUPPORTED, NOT_PERMITTED = 1, 201, 801, 800


@pytest.fixture()
def opened(fk, pc):
    """Device 0's primary context current; afterwards no IPC memory is left open in this process."""
    fk.lib.fake_ipc_open_count.restype = ctypes.c_long
    yield fk
    assert fk.lib.fake_ipc_open_count() == 0


def test_handles_are_bytes_and_pickle(opened):
    buf = DeviceBuffer(4096)
    handle = ipc.export_memory(buf)
    data = bytes(handle)
    assert isinstance(data, bytes) and handle.nbytes == 4096 and handle.pid == os.getpid()
    assert ipc.IpcMemoryHandle.from_bytes(data) == handle and ipc.IpcMemoryHandle.from_bytes(bytearray(data)) == handle
    assert pickle.loads(pickle.dumps(handle)) == handle
    with pytest.raises(AttributeError):
        handle.nbytes = 1
    event = Event(timing=False, interprocess=True)
    eh = ipc.export_event(event)
    assert pickle.loads(pickle.dumps(eh)) == eh and eh != handle
    event.close()
    buf.free()


@pytest.mark.parametrize("damage", ["truncated", "padded", "not cuproc's", "an event's"])
def test_damaged_bytes_are_refused_before_the_driver(opened, damage):
    buf = DeviceBuffer(64)
    data = bytes(ipc.export_memory(buf))
    event = Event(timing=False, interprocess=True)
    bad = {"truncated": data[:-1], "padded": data + b"\0", "not cuproc's": b"X" + data[1:],
           "an event's": bytes(ipc.export_event(event))}[damage]
    opened.clear_calls()
    with pytest.raises(InvalidValueError) as info:
        ipc.open_memory(bad)
    assert info.value.refused and "cuIpcOpenMemHandle" not in opened.calls()
    event.close()
    buf.free()


def test_opening_in_the_exporting_process_is_refused(opened):
    buf = DeviceBuffer(64)
    handle = ipc.export_memory(buf)
    opened.clear_calls()
    with pytest.raises(InvalidContextError) as info:
        ipc.open_memory(handle)
    assert info.value.refused and "cuIpcOpenMemHandle" not in opened.calls()
    event = Event(timing=False, interprocess=True)
    with pytest.raises(InvalidContextError):
        ipc.open_event(ipc.export_event(event))
    # The driver's own bytes under another pid reach it: it refuses them as the real driver does, and the
    # error says why.
    disguised = ipc.IpcMemoryHandle(handle.handle, handle.nbytes, os.getppid(), 0)
    with pytest.raises(InvalidContextError) as info:
        ipc.open_memory(disguised)
    assert not info.value.refused and info.value.code == INVALID_CONTEXT
    assert "exported by this very process" in " ".join(info.value.__notes__)
    event.close()
    buf.free()


def test_forged_driver_bytes_are_the_drivers_error_not_a_crash(opened):
    forged = ipc.IpcMemoryHandle(os.urandom(64), 4096, os.getppid(), 0)
    with pytest.raises(CudaError) as info:
        ipc.open_memory(forged)
    assert info.value.code == INVALID_VALUE and not info.value.refused
    assert "came unchanged from export_*" in " ".join(info.value.__notes__)
    with pytest.raises(InvalidValueError):
        ipc.IpcMemoryHandle(b"short", 1, 1, 0)
    with pytest.raises(InvalidValueError):
        ipc.open_memory(object())  # type: ignore[arg-type]


def test_what_cannot_be_exported_is_refused(opened):
    stream = cuproc.Stream()
    pooled = cuproc.alloc_async(256, stream)
    with pytest.raises(InvalidValueError):
        ipc.export_memory(pooled)                  # pool memory: shared through an IPC pool
    pooled.free_async()
    grown = GrowableBuffer(2 << 20)
    with pytest.raises(InvalidValueError):
        ipc.export_memory(grown)                   # VMM memory: PhysicalMemory.export_fd
    grown.close()
    buf = DeviceBuffer(64)
    buf.free()
    with pytest.raises(ClosedResourceError):
        ipc.export_memory(buf)
    timed = Event(interprocess=False)
    with pytest.raises(InvalidValueError):
        ipc.export_event(timed)
    timed.close()
    stream.close()


def _export_in_child(fake_path) -> tuple[bytes, bytes]:
    """Memory and event handles exported by a process that has exited since."""
    script = child_preamble(fake_path) + textwrap.dedent("""
        from cuproc import ipc, DeviceBuffer, Event
        pc = cuproc.use_device(0)
        buf, event = DeviceBuffer(4096), Event(timing=False, interprocess=True)
        print(bytes(ipc.export_memory(buf)).hex(), bytes(ipc.export_event(event)).hex())
    """)
    memory, event = run_python(script).stdout.split()
    return bytes.fromhex(memory), bytes.fromhex(event)


def test_a_handle_of_an_exited_exporter_is_the_drivers_error(opened, fake):
    memory, event = _export_in_child(fake.path)
    with pytest.raises(CudaError) as info:
        ipc.open_memory(memory)
    assert info.value.code == INVALID_VALUE and not info.value.refused
    with pytest.raises(CudaError):
        ipc.open_event(event)


def test_another_process_opens_closes_and_never_frees(opened, fake):
    """A spawned importer (its own fake driver) opens the exporter's memory and event: the buffer has the
    size, is usable, closes (cuIpcCloseMemHandle), refuses free(), pickles to its handle, goes with its
    context; a second open in one context is the same address, each closed once."""
    buf = DeviceBuffer(4096)
    event = Event(timing=False, interprocess=True)
    memory, ev = bytes(ipc.export_memory(buf)).hex(), bytes(ipc.export_event(event)).hex()
    script = child_preamble(fake.path) + textwrap.dedent(f"""
        import ctypes, pickle
        import numpy as np
        from cuproc import ipc, memory as mem, Context, Stream
        from cuproc.errors import ClosedResourceError, InvalidValueError
        fake.lib.fake_ipc_open_count.restype = ctypes.c_long
        pc = cuproc.use_device(0)
        handle = ipc.IpcMemoryHandle.from_bytes(bytes.fromhex({memory!r}))
        a = ipc.open_memory(handle)
        assert a.nbytes == 4096 and isinstance(a, cuproc.Allocation)
        mem.memset(a, 7)
        out = np.zeros(16, np.uint8); mem.copy(out, a, 16); assert out.tolist() == [7] * 16
        b = pickle.loads(pickle.dumps(a))                  # pickles to its handle: opened again
        assert b.address == a.address and fake.lib.fake_ipc_open_count() == 2
        try:
            a.free()
        except InvalidValueError:
            pass
        else:
            raise AssertionError("free() of imported memory was not refused")
        a.close(); a.close()
        assert fake.lib.fake_ipc_open_count() == 1
        mem.memset(b, 1)                                   # still open through b
        b.close()
        try:
            mem.memset(a, 1)
        except ClosedResourceError:
            pass
        else:
            raise AssertionError("use after close was not refused")
        ctx = Context.create(0)
        c = ipc.open_memory(handle, context=ctx)
        Context.pop()
        ctx.destroy()                                      # the open goes with its context
        assert c.closed and fake.lib.fake_ipc_open_count() == 0
        c.close()
        e = ipc.open_event(bytes.fromhex({ev!r}))
        s = Stream()
        s.wait(e); e.record(s); e.synchronize(); assert e.query()
        e2 = pickle.loads(pickle.dumps(e))
        for x in (e, e2, s):
            x.close()
        del a, b, c
        import gc; gc.collect()
        assert fake.stale_count() == 0, fake.stale_calls()
        print("child ok")
    """)
    proc = run_python(script)
    assert "child ok" in proc.stdout
    buf.free()
    event.close()


def test_multiprocessing_spawn_carries_handles(opened, fake, tmp_path):
    """The handle objects pickle through multiprocessing (spawn) as they are."""
    buf = DeviceBuffer(512)
    handle = ipc.export_memory(buf)
    script = tmp_path / "spawned.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp, os, sys
        sys.path[:0] = [{str(os.path.dirname(os.path.dirname(__file__)))!r}, {str(os.path.dirname(__file__))!r}]

        def consume(queue, path):
            from pathlib import Path
            from fakedriver import FakeDriver
            import cuproc
            from cuproc import ipc
            fake = FakeDriver(Path(path)); fake.reset()
            cuproc.set_default_driver(cuproc.Driver(library=str(fake.path)))
            pc = cuproc.use_device(0)
            handle = queue.get()
            with ipc.open_memory(handle) as imported:
                queue.put((type(handle).__name__, imported.nbytes, handle.pid != os.getpid()))

        if __name__ == "__main__":
            import pickle
            handle = pickle.loads(bytes.fromhex(sys.argv[1]))
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            child = ctx.Process(target=consume, args=(queue, sys.argv[2]))
            child.start()
            queue.put(handle)
            child.join(60)
            print(queue.get(timeout=5))
    """))
    proc = subprocess.run([sys.executable, str(script), pickle.dumps(handle).hex(), str(fake.path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "('IpcMemoryHandle', 512, True)"
    buf.free()


@pytest.fixture(autouse=True)
def imex(imex_channel):
    """Every test here may make fabric handles (the fake's switch decides whether the device has them)."""
    return imex_channel


# ----------------------------------------------------------------------------- shareable pools

def test_pool_sharing_is_refused_where_it_cannot_work(opened):
    with pytest.raises(InvalidValueError):
        cuproc.MemoryPool.create(0, handle_type="win32")
    private = cuproc.MemoryPool.create(0)
    with pytest.raises(InvalidValueError):
        ipc.export_pool(private)                       # not made shareable
    stream = cuproc.Stream()
    plain = cuproc.alloc_async(256, stream)
    with pytest.raises(InvalidValueError):
        ipc.export_pointer(plain)                      # the device's default pool
    from_private = cuproc.alloc_async(256, stream, pool=private)
    with pytest.raises(InvalidValueError):
        ipc.export_pointer(from_private)
    shared = cuproc.MemoryPool.create(0, handle_type="posix_fd")
    fd = ipc.export_pool(shared)
    try:
        with pytest.raises(CudaError) as info:
            ipc.import_pool(fd)                        # in the process that made it
        assert "another, running process" in " ".join(info.value.__notes__)
    finally:
        os.close(fd)
    buf = cuproc.alloc_async(256, stream, pool=shared)
    pointer = ipc.export_pointer(buf)
    assert pickle.loads(pickle.dumps(pointer)) == pointer
    with pytest.raises(InvalidContextError):
        ipc.import_pointer(shared, pointer)            # this process's own allocation
    for b in (plain, from_private, buf):
        b.free_async()
    stream.synchronize()
    for thing in (stream, private, shared):
        thing.close()


def test_a_shared_pool_and_its_pointers_in_another_process(opened, fake):
    stream = cuproc.Stream()
    shared = cuproc.MemoryPool.create(0, handle_type="posix_fd")
    buf = cuproc.alloc_async(4096, stream, pool=shared)
    pointer = bytes(ipc.export_pointer(buf)).hex()
    fd = ipc.export_pool(shared)
    script = child_preamble(fake.path) + textwrap.dedent(f"""
        import gc
        import numpy as np
        from cuproc import ipc, memory as mem
        from cuproc.errors import ClosedResourceError
        pc = cuproc.use_device(0)
        pool = ipc.import_pool({fd})
        imported = ipc.import_pointer(pool, bytes.fromhex({pointer!r}))
        assert imported.nbytes == 4096 and imported.pool is pool
        mem.memset(imported, 5)
        out = np.zeros(8, np.uint8); mem.copy(out, imported, 8); assert out.tolist() == [5] * 8
        imported.close()                               # cuMemFree, before the exporter frees
        again = ipc.import_pointer(pool, bytes.fromhex({pointer!r}))
        pool.close()                                   # its imports go with it
        assert again.closed
        try:
            mem.memset(again, 1)
        except ClosedResourceError:
            pass
        else:
            raise AssertionError("memory of a destroyed imported pool was usable")
        again.close()
        gc.collect()
        assert fake.stale_count() == 0, fake.stale_calls()
        print("child ok")
    """)
    run_child(script, fd)
    buf.free_async()
    stream.synchronize()
    stream.close()
    shared.close()


def test_a_handle_pinned_to_11_8_passes_the_64_byte_handle_by_value(fake, fk):
    """cuIpcOpenMemHandle takes CUipcMemHandle by value: through an 11.8 handle (the v2 entry point of CUDA
    11.0) the bytes reach the driver intact -- the fake checks their checksum -- from a live exporter."""
    script = child_preamble(fake.path) + textwrap.dedent("""
        from cuproc import ipc, DeviceBuffer
        pc = cuproc.use_device(0)
        buf = DeviceBuffer(4096)
        print(bytes(ipc.export_memory(buf)).hex(), flush=True)
        sys.stdin.readline()                      # alive until the importer is done
    """)
    exporter = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
    try:
        data = bytes.fromhex(exporter.stdout.readline().strip())
        old = cuproc.Driver("11.8", library=str(fake.path))
        pc = cuproc.use_device(0, driver=old)
        opened = ipc.open_memory(data, driver=old)
        assert opened.nbytes == 4096 and opened.driver is old
        opened.close()
        assert fk.lib.fake_ipc_open_count() == 0
        old.cuCtxSetCurrent(ffi.NULL)
        pc.release()
    finally:
        exporter.communicate("done\n", timeout=60)
    assert exporter.returncode == 0


# ----------------------------------------------------------------------------- the pool is shared before its pointers

def _raw_shareable_pool(drv):
    """A POSIX-shareable pool made through the drop-in layer, never exported, and one allocation of it."""
    props = ffi.new("CUmemPoolProps *")
    props.allocType = drv.CU_MEM_ALLOCATION_TYPE_PINNED
    props.handleTypes = drv.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    props.location.type = drv.CU_MEM_LOCATION_TYPE_DEVICE
    pool, ptr = ffi.new("CUmemoryPool *"), ffi.new("CUdeviceptr *")
    drv.checked.cuMemPoolCreate(pool, props)
    drv.checked.cuMemAllocFromPoolAsync(ptr, 4096, pool[0], ffi.NULL)
    drv.checked.cuStreamSynchronize(ffi.NULL)
    return pool[0], ptr[0]


def test_the_driver_exports_pointers_only_of_a_pool_already_exported(opened):
    """The rule an H200 (driver 580) showed, which the fake keeps: cuMemPoolExportPointer answers
    CUDA_ERROR_INVALID_VALUE until the pool was exported once (cuMemPoolExportToShareableHandle)."""
    drv = cuproc.default_driver()
    pool, ptr = _raw_shareable_pool(drv)
    data, fd = ffi.new("CUmemPoolPtrExportData *"), ffi.new("int *")
    assert drv.cuMemPoolExportPointer(data, ptr) == INVALID_VALUE
    drv.checked.cuMemPoolExportToShareableHandle(fd, pool, drv.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
    os.close(fd[0])
    assert drv.cuMemPoolExportPointer(data, ptr) == 0
    drv.checked.cuMemFreeAsync(ptr, ffi.NULL)
    drv.checked.cuStreamSynchronize(ffi.NULL)
    drv.checked.cuMemPoolDestroy(pool)


def test_a_shareable_pool_is_exported_as_it_is_made_and_keeps_that_export(opened):
    """So export_pointer works before export_pool (the order the GPU test uses); a pool cuproc did not make
    is shared by export_pointer itself; the kept descriptor goes with the pool."""
    stream = cuproc.Stream()
    shared = cuproc.MemoryPool.create(0, handle_type="posix_fd")
    kept = shared.shared
    assert isinstance(kept, int) and os.readlink(f"/proc/self/fd/{kept}").startswith("/memfd:")
    assert not os.get_inheritable(kept)                        # no child process inherits the pool's own export
    buf = cuproc.alloc_async(256, stream, pool=shared)
    assert ipc.export_pointer(buf).nbytes == 256
    drv = cuproc.default_driver()
    raw, ptr = _raw_shareable_pool(drv)
    adopted = cuproc.MemoryPool(raw, driver=drv, owned=True)
    adopted.handle_type = "posix_fd"
    wrapped = cuproc.alloc_async(256, stream, pool=adopted)
    assert ipc.export_pointer(wrapped).nbytes == 256 and adopted.shared is not None
    for b in (buf, wrapped):
        b.free_async()
    stream.synchronize()
    drv.checked.cuMemFreeAsync(ptr, ffi.NULL)
    drv.checked.cuStreamSynchronize(ffi.NULL)
    for thing in (stream, shared, adopted):
        thing.close()
    with pytest.raises(OSError):
        os.fstat(kept)                             # closed with its pool


def test_import_pool_refuses_what_export_pool_cannot_have_given(opened):
    for bad in (-1, b"\0" * 63, "3", 2.0):
        with pytest.raises(InvalidValueError) as info:
            ipc.import_pool(bad)                   # type: ignore[arg-type]
        assert info.value.refused


# ----------------------------------------------------------------------------- fabric handles

def test_fabric_pools_are_refused_where_the_device_has_none(opened):
    opened.clear_calls()
    with pytest.raises(CudaError) as info:
        cuproc.MemoryPool.create(0, handle_type="fabric")
    assert info.value.refused and info.value.code == NOT_SUPPORTED
    assert "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED" in str(info.value)
    assert "cuMemPoolCreate" not in opened.calls()


def test_fabric_pools_are_refused_before_the_driver_without_an_imex_channel(opened, imex_channel):
    """Driver 580 made a fabric pool without a channel, refused its export, then aborted the process in
    cuMemPoolDestroy: no channel, no call."""
    opened.lib.fake_vmm_set_fabric(1)
    (imex_channel / "channel0").unlink()
    opened.clear_calls()
    with pytest.raises(CudaError) as info:
        cuproc.MemoryPool.create(0, handle_type="fabric")
    assert info.value.refused and info.value.name == "CUDA_ERROR_NOT_PERMITTED"
    assert "IMEX channel" in str(info.value) and "cuMemPoolCreate" not in opened.calls()


def test_a_fabric_pool_whose_export_fails_is_left_undestroyed_and_the_error_says_so(opened, fake):
    """Driver 580 aborted the process destroying such a pool: the export's error is raised, with a note, and
    cuMemPoolDestroy is never called for it."""
    opened.lib.fake_vmm_set_fabric(1)
    fake.fail("cuMemPoolExportToShareableHandle", NOT_PERMITTED)
    opened.clear_calls()
    with pytest.raises(CudaError) as info:
        cuproc.MemoryPool.create(0, handle_type="fabric")
    assert info.value.code == NOT_PERMITTED and not info.value.refused
    assert any("left undestroyed" in n for n in info.value.__notes__)
    assert "cuMemPoolCreate" in opened.calls() and "cuMemPoolDestroy" not in opened.calls()


def test_a_shareable_pools_export_is_made_once_by_racing_threads(opened):
    import threading
    made = []
    original = cuproc.MemoryPool.export_handle

    def slow_export(self):
        made.append(1)
        threading.Event().wait(0.05)
        return original(self)
    pool = cuproc.MemoryPool.create(0, handle_type="posix_fd")
    os.close(pool.shared)
    pool.shared = None                       # shareable, its export not made yet: two threads race to make it
    try:
        type(pool).export_handle = slow_export
        threads = [threading.Thread(target=pool.share) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    finally:
        type(pool).export_handle = original
    assert len(made) == 1 and isinstance(pool.shared, int)
    pool.close()


def test_a_fabric_pool_and_its_pointers_in_another_process(opened, fake):
    """Where the device has fabric handles (the fake's switch on): the pool exports 64 bytes, which travel
    like any value; the other process imports the pool from them, then a pointer."""
    opened.lib.fake_vmm_set_fabric(1)
    stream = cuproc.Stream()
    pool = cuproc.MemoryPool.create(0, handle_type="fabric")
    assert isinstance(pool.shared, bytes) and len(pool.shared) == 64
    buf = cuproc.alloc_async(4096, stream, pool=pool)
    pointer = bytes(ipc.export_pointer(buf)).hex()
    handle = ipc.export_pool(pool)
    assert isinstance(handle, bytes) and len(handle) == 64
    script = child_preamble(fake.path) + textwrap.dedent(f"""
        from cuproc import ipc, memory as mem
        from cuproc.errors import InvalidValueError
        fake.lib.fake_vmm_set_fabric(1)
        pc = cuproc.use_device(0)
        pool = ipc.import_pool(bytes.fromhex({handle.hex()!r}))
        assert pool.handle_type == "fabric" and pool.imported
        try:
            ipc.export_pool(pool)
        except InvalidValueError:
            pass
        else:
            raise AssertionError("an imported pool was exported again")
        imported = ipc.import_pointer(pool, bytes.fromhex({pointer!r}))
        mem.memset(imported, 5)
        imported.close()
        pool.close()
        assert fake.stale_count() == 0, fake.stale_calls()
        print("child ok")
    """)
    run_child(script)
    buf.free_async()
    stream.synchronize()
    stream.close()
    pool.close()
