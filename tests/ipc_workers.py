"""The two processes of tests/test_gpu_ipc.py's producer/consumer test, importable by ``multiprocessing``'s
spawn (a module without pytest: a spawned child imports it by name); and :func:`run_child`, which the IPC and
VMM tests (fake and GPU) use to hand an exported descriptor to another process.

The protocol, made observable:

1. The producer fills ``data[i] = 3 i + 1``, exports ``data``, a one-word ``flag`` (0) and an interprocess
   event, and sends the handles.
2. The consumer opens the three and says so.  Only then the producer queues, on its stream,
   ``wait_then_add``: every thread spins until ``flag`` is 1 (at most ~50 s, counted in ``timeouts`` if it
   gives up), then adds 1000 to its element; it records the event there, and says so.
3. The consumer makes its stream wait for the event, queues ``check_and_write_back``
   (counts elements that are not ``3 i + 1001`` -- what the producer's kernel leaves -- then writes
   ``7 i``), and only *then* sets the flag, from another stream.  If the wait did not order its kernel
   after the producer's, the kernel would run first and count every element; if the wait blocked the flag,
   the producer's kernel would time out.
4. The producer sees ``7 i`` (the write-back), frees ``data`` while the consumer still has it open, and the
   consumer then closes it: neither crashes.  Each reports its free memory before and after.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys

KERNELS = r"""
extern "C" __global__ void fill(unsigned* data, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) data[i] = 3u * i + 1u;
}
extern "C" __global__ void wait_then_add(volatile unsigned* flag, unsigned* data, unsigned n, unsigned* timeouts) {
    long long start = clock64();
    while (*flag == 0u) {
        if (clock64() - start > 100000000000LL) { atomicAdd(timeouts, 1u); break; }
        __nanosleep(1000);
    }
    __threadfence();
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) data[i] += 1000u;
}
extern "C" __global__ void check_and_write_back(unsigned* data, unsigned n, unsigned* bad) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        if (data[i] != 3u * i + 1001u) atomicAdd(bad, 1u);
        data[i] = 7u * i;
    }
}
"""
N = 16 << 20                 # 64 MiB of uint32: large enough to see in cuMemGetInfo
BLOCK = 256
TIMEOUT = 120                # seconds any step waits for the other process


def run_child(script: str, fd: int | None = None, *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a new interpreter that inherits descriptor ``fd`` (as a Unix socket would send it),
    then close ``fd`` here whatever happened; asserts that the child exited 0 after printing "child ok"."""
    try:
        proc = subprocess.run([sys.executable, "-c", script], pass_fds=() if fd is None else (fd,),
                              capture_output=True, text=True, timeout=timeout)
    finally:
        if fd is not None:
            os.close(fd)
    assert proc.returncode == 0 and "child ok" in proc.stdout, proc.stderr[-3000:]
    return proc


def _word(buffer) -> int:
    import numpy as np

    from cuproc import memory as mem
    out = np.zeros(1, np.uint32)
    mem.copy(out, buffer, 4)
    return int(out[0])


def producer(to_consumer, from_consumer, results, device: int = 0) -> None:
    import numpy as np

    import cuproc
    from cuproc import DeviceBuffer, Event, Stream, ipc
    from cuproc import memory as mem
    pc = cuproc.use_device(device)
    grid = (N + BLOCK - 1) // BLOCK
    fill = cuproc.compile_kernel(KERNELS, "fill")
    wait_then_add = cuproc.compile_kernel(KERNELS, "wait_then_add")
    # cuMemGetInfo is the device's: the consumer's context (some 400 MiB) must exist before the first reading,
    # as it still does at the last (a pure-path GPU run read it before the consumer's context was made)
    assert from_consumer.get(timeout=TIMEOUT) == "ready"
    free0 = mem.mem_info()[0]
    data, flag, timeouts = DeviceBuffer(4 * N), DeviceBuffer(4), DeviceBuffer(4)
    mem.memset(flag, 0)
    mem.memset(timeouts, 0)
    fill.launch(grid, BLOCK, (data, np.uint32(N)))
    pc.context.synchronize()
    taken = free0 - mem.mem_info()[0]
    event = Event(timing=False, interprocess=True)
    to_consumer.put((ipc.export_memory(data), ipc.export_memory(flag), ipc.export_event(event)))
    assert from_consumer.get(timeout=TIMEOUT) == "opened"     # (the spin's clock starts only now)
    stream = Stream(non_blocking=True)
    wait_then_add.launch(grid, BLOCK, (flag, data, np.uint32(N), timeouts), stream=stream)
    event.record(stream)
    to_consumer.put("recorded")
    message, bad = from_consumer.get(timeout=TIMEOUT)
    stream.synchronize()
    out = np.empty(N, np.uint32)
    mem.copy(out, data)
    write_back = bool((out == 7 * np.arange(N, dtype=np.uint32)).all())
    data.free()                                   # while the consumer still holds the mapping
    to_consumer.put("freed")
    assert from_consumer.get(timeout=TIMEOUT) == "closed"
    gave_up = _word(timeouts)
    for thing in (flag, timeouts, event, stream):
        thing.close()
    del fill, wait_then_add
    gc.collect()
    results.put({"role": "producer", "message": message, "write_back": write_back, "timeouts": gave_up,
                 "taken": taken, "free0": free0, "free1": mem.mem_info()[0]})
    pc.release()
    to_consumer.put("released")                   # the consumer's last reading comes after this context's end


def consumer(from_producer, to_producer, results, device: int = 0) -> None:
    import numpy as np

    import cuproc
    from cuproc import DeviceBuffer, Stream, ipc
    from cuproc import memory as mem
    pc = cuproc.use_device(device)
    grid = (N + BLOCK - 1) // BLOCK
    check = cuproc.compile_kernel(KERNELS, "check_and_write_back")
    bad = DeviceBuffer(4)
    mem.memset(bad, 0)
    waiting, setter = Stream(non_blocking=True), Stream(non_blocking=True)
    free_before = mem.mem_info()[0]
    to_producer.put("ready")                      # this process's context exists: the producer may count
    memory_handle, flag_handle, event_handle = from_producer.get(timeout=TIMEOUT)
    data, flag = ipc.open_memory(memory_handle), ipc.open_memory(flag_handle)
    event = ipc.open_event(event_handle)
    sizes = (data.nbytes, flag.nbytes)
    to_producer.put("opened")
    assert from_producer.get(timeout=TIMEOUT) == "recorded"
    waiting.wait(event)
    check.launch(grid, BLOCK, (data, np.uint32(N), bad), stream=waiting)
    one = cuproc.PinnedBuffer(4)
    one.numpy(np.uint32)[0] = 1
    mem.copy(flag, one, 4, stream=setter)         # only now: the producer's kernel may go on
    setter.synchronize()
    waiting.synchronize()
    counted = _word(bad)
    to_producer.put(("written back", counted))
    assert from_producer.get(timeout=TIMEOUT) == "freed"
    data.close()                                  # the producer freed it already: closing must not crash
    flag.close()
    event.close()
    for thing in (bad, waiting, setter, one):
        thing.close()
    del check
    gc.collect()
    to_producer.put("closed")
    # cuMemGetInfo is the device's: the producer's first launches (its modules, loaded lazily, and their local
    # memory: some 490 MiB on an H200) came after free_before, so the reading that checks this process's close
    # waits for the producer's context to end (an H200 run, 2026-11-29, read it before and saw 486 MiB less)
    assert from_producer.get(timeout=TIMEOUT) == "released"
    results.put({"role": "consumer", "bad": counted, "sizes": sizes, "free_before": free_before,
                 "free_after": mem.mem_info()[0]})
    pc.release()
