"""IPC on a real GPU (issue 38): a spawned producer and consumer share memory and an event
(tests/ipc_workers.py says how the ordering is made observable), and the refusals and driver answers the
fake models are checked against the real driver."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, Event, ipc
from cuproc import memory as mem
from cuproc.errors import CudaError, InvalidContextError

import ipc_workers
from ipc_workers import run_child
from subproc import run_python

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
SLACK = 8 << 20   # cuMemGetInfo moves by driver bookkeeping too (page tables, other processes' contexts)


def _needs_nvrtc() -> None:
    from cuproc.nvrtc import is_nvrtc_available
    if not is_nvrtc_available():
        pytest.skip("no NVRTC on this machine (pip install 'cuproc[nvrtc]')")


@pytest.mark.parametrize("devices", [
    pytest.param((0, 0), id="one-gpu"),
    pytest.param((0, 1), id="gpu0-to-gpu1", marks=[
        pytest.mark.multi_gpu,
        pytest.mark.skipif(cuproc.is_driver_available() and cuproc.Device.count() < 2, reason="needs two GPUs")])])
def test_spawned_producer_and_consumer_share_memory_and_an_event(devices):
    """A producer process and a consumer process (on the producer's GPU, or one process per GPU: the
    consumer's kernel then reads and writes the producer's memory through peer access, which
    cuIpcOpenMemHandle's CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS gives it, and waits on its event)."""
    _needs_nvrtc()
    ctx = multiprocessing.get_context("spawn")
    to_consumer, to_producer, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=ipc_workers.producer, args=(to_consumer, to_producer, results, devices[0]))
    consumer = ctx.Process(target=ipc_workers.consumer, args=(to_consumer, to_producer, results, devices[1]))
    producer.start()
    consumer.start()
    reports = {}
    try:
        for _ in range(2):
            report = results.get(timeout=4 * ipc_workers.TIMEOUT)
            reports[report["role"]] = report
    finally:
        for process in (producer, consumer):
            process.join(30)
            if process.is_alive():
                process.kill()
    assert producer.exitcode == 0 and consumer.exitcode == 0, (producer.exitcode, consumer.exitcode)
    p, c = reports["producer"], reports["consumer"]
    nbytes = 4 * ipc_workers.N
    assert c["sizes"] == (nbytes, 4)
    assert p["timeouts"] == 0, "the producer's kernel gave up waiting: the flag was not set after the consumer queued"
    assert c["bad"] == 0, f"{c['bad']} elements read before the producer's kernel ran: the IPC event did not order"
    assert p["message"] == "written back" and p["write_back"], "the producer does not see the consumer's writes"
    assert p["taken"] >= nbytes                                  # the memory was really allocated...
    assert p["free1"] >= p["free0"] - SLACK                      # ...and is back in the producer
    assert c["free_after"] >= c["free_before"] - SLACK           # the consumer's mapping went with its close


def test_opening_in_the_exporting_process_is_refused_and_so_is_the_driver(primary):
    buf = DeviceBuffer(1 << 20)
    handle = ipc.export_memory(buf)
    with pytest.raises(InvalidContextError) as info:
        ipc.open_memory(handle)                          # cuproc's refusal, before the driver
    assert info.value.refused
    disguised = ipc.IpcMemoryHandle(handle.handle, handle.nbytes, os.getppid(), 0)
    with pytest.raises(CudaError) as info:               # the driver's own answer for its own process
        ipc.open_memory(disguised)
    assert not info.value.refused
    print(f"the driver answers an own-process cuIpcOpenMemHandle with {info.value.name}")
    event = Event(timing=False, interprocess=True)
    with pytest.raises(InvalidContextError):
        ipc.open_event(ipc.export_event(event))
    assert pickle.loads(pickle.dumps(handle)) == handle
    event.close()
    buf.free()


def test_forged_and_truncated_handles_are_errors_not_crashes():
    """In a child process (a driver that crashed on forged bytes would take only the child down)."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{str(ROOT)!r}]
        import numpy as np
        import cuproc
        from cuproc import DeviceBuffer, ipc, memory as mem
        from cuproc.errors import CudaError, InvalidValueError
        pc = cuproc.use_device(0)
        try:
            ipc.open_memory(bytes(95))
        except InvalidValueError as exc:
            assert exc.refused
        else:
            raise AssertionError("truncated bytes were not refused")
        for make, opener in ((ipc.IpcMemoryHandle, ipc.open_memory), (ipc.IpcEventHandle, ipc.open_event)):
            forged = make(os.urandom(64), 4096, os.getppid(), 0)
            try:
                opener(forged)
            except CudaError as exc:
                assert not exc.refused
                print(make.__name__, "forged:", exc.name)
            else:
                raise AssertionError("a forged handle opened")
        buf = DeviceBuffer(64)                      # the context still works
        mem.copy(buf, np.arange(16, dtype=np.uint32))
        buf.free()
        print("child ok")
    """)
    proc = run_python(script, timeout=120)
    assert "child ok" in proc.stdout
    print(proc.stdout)


def _child_reads_and_writes_pool_memory(shared: cuproc.MemoryPool) -> None:
    """The parent's allocation of ``shared``, filled, is read and written by a child through the imported
    pool.  The pointer is exported before the pool is (the order that failed with CUDA_ERROR_INVALID_VALUE
    while MemoryPool.create did not export the pool itself: see the diagnostic test below)."""
    stream = cuproc.Stream()
    buf = cuproc.alloc_async(1 << 20, stream, pool=shared)
    mem.copy(buf, np.arange(1 << 18, dtype=np.uint32), stream=stream)
    stream.synchronize()                              # the allocation and the copy are done before the child reads
    pointer = bytes(ipc.export_pointer(buf)).hex()
    handle = ipc.export_pool(shared)                  # a descriptor, or a fabric handle's bytes
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}]
        import numpy as np
        import cuproc
        from cuproc import ipc, memory as mem
        pc = cuproc.use_device(0)
        pool = ipc.import_pool({handle!r})
        imported = ipc.import_pointer(pool, bytes.fromhex({pointer!r}))
        got = np.empty(1 << 18, np.uint32)
        mem.copy(got, imported)
        assert (got == np.arange(1 << 18, dtype=np.uint32)).all()
        mem.copy(imported, np.full(4, 0xBEEF, np.uint32))
        imported.close()                              # before the exporter frees
        pool.close()
        print("child ok")
    """)
    run_child(script, handle if isinstance(handle, int) else None)
    out = np.empty(4, np.uint32)
    mem.copy(out, buf, 16)
    assert out.tolist() == [0xBEEF] * 4
    buf.free_async()
    stream.synchronize()
    stream.close()
    shared.close()


def test_a_shareable_pool_and_a_pointer_in_another_process(primary):
    _child_reads_and_writes_pool_memory(cuproc.MemoryPool.create(0, handle_type="posix_fd"))


def _pool_pointer_answers(drv) -> dict[str, str]:
    """cuMemPoolExportPointer's answers around the first export of a POSIX-shareable pool, through the
    drop-in layer (no cuproc object exports anything by itself here)."""
    name = lambda rc: cuproc.errors.result_name(rc) if rc else "CUDA_SUCCESS"   # noqa: E731
    props = cuproc.ffi.new("CUmemPoolProps *")
    props.allocType = drv.CU_MEM_ALLOCATION_TYPE_PINNED
    props.handleTypes = drv.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    props.location.type = drv.CU_MEM_LOCATION_TYPE_DEVICE
    pool, stream = cuproc.ffi.new("CUmemoryPool *"), cuproc.ffi.new("CUstream *")
    drv.checked.cuMemPoolCreate(pool, props)
    drv.checked.cuStreamCreate(stream, 0)
    ptrs = [cuproc.ffi.new("CUdeviceptr *") for _ in range(3)]
    data, fd = cuproc.ffi.new("CUmemPoolPtrExportData *"), cuproc.ffi.new("int *")
    answers = {}
    drv.checked.cuMemAllocFromPoolAsync(ptrs[0], 1 << 20, pool[0], stream[0])
    drv.checked.cuStreamSynchronize(stream[0])                      # the allocation is complete
    answers["complete allocation, pool never exported"] = name(drv.cuMemPoolExportPointer(data, ptrs[0][0]))
    drv.checked.cuMemPoolExportToShareableHandle(fd, pool[0], drv.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
    answers["the same allocation, pool exported"] = name(drv.cuMemPoolExportPointer(data, ptrs[0][0]))
    drv.checked.cuMemAllocFromPoolAsync(ptrs[1], 1 << 20, pool[0], stream[0])
    answers["an allocation still queued, pool exported"] = name(drv.cuMemPoolExportPointer(data, ptrs[1][0]))
    os.close(fd[0])
    drv.checked.cuMemAllocFromPoolAsync(ptrs[2], 1 << 20, pool[0], stream[0])
    drv.checked.cuStreamSynchronize(stream[0])
    answers["a new allocation, the pool's only descriptor closed"] = name(drv.cuMemPoolExportPointer(data, ptrs[2][0]))
    for ptr in ptrs:
        drv.checked.cuMemFreeAsync(ptr[0], stream[0])
    drv.checked.cuStreamSynchronize(stream[0])
    drv.checked.cuStreamDestroy(stream[0])
    drv.checked.cuMemPoolDestroy(pool[0])
    return answers


def test_diagnose_which_order_cuMemPoolExportPointer_needs(primary):
    """Diagnostic (issue 38): which hypothesis explains the CUDA_ERROR_INVALID_VALUE measured on an H200 with
    driver 580.  cuproc now exports a shareable pool as it is made (MemoryPool.share), on the reading that
    cuMemPoolExportPointer needs "an already shared memory pool"; this prints what the driver answers in
    each order, and holds the one fact the fix relies on: once exported, the pool's pointers export."""
    answers = _pool_pointer_answers(cuproc.default_driver())
    for case, answer in answers.items():
        print(f"cuMemPoolExportPointer, {case}: {answer}")
    first = answers["complete allocation, pool never exported"]
    print("hypothesis 'the pool must be exported first':", "confirmed" if first != "CUDA_SUCCESS" else
          "refuted (the never-exported pool's pointer exported: the old failure had another cause)")
    assert first in ("CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE")
    assert answers["the same allocation, pool exported"] == "CUDA_SUCCESS"


def test_fabric_pools_where_the_device_has_them(primary):
    """Fabric handles: refused with the attribute named where the device has none (an H200 without an IMEX
    channel set up, most likely); where it has them, a child imports the pool from its 64 bytes and reads
    and writes a pointer of it."""
    from cuproc.pools import fabric_supported
    if not fabric_supported(cuproc.Device(0)):
        with pytest.raises(CudaError) as info:
            cuproc.MemoryPool.create(0, handle_type="fabric")
        assert info.value.refused and info.value.name == "CUDA_ERROR_NOT_SUPPORTED"
        assert "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED" in str(info.value)
        print("no fabric handles on this device: refused as expected")
        return
    try:
        shared = cuproc.MemoryPool.create(0, handle_type="fabric")
    except CudaError as exc:
        if exc.name != "CUDA_ERROR_NOT_PERMITTED":
            raise
        pytest.skip(f"the device has fabric handles but this user has no IMEX channel: {exc}")
    _child_reads_and_writes_pool_memory(shared)
