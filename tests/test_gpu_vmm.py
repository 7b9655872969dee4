"""Virtual memory management on a real GPU (issue 38): the growable buffer's issue tests (reserve 1 GiB,
map 32 MiB, grow three times with the data kept, physical memory taken only as it grows, all of it back
after close, a failed grow leaving the buffer as it was), the extend and move paths forced with a blocking
reservation, kernels on the grown memory, and an exported POSIX descriptor mapped by another process."""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import memory as mem
from cuproc.errors import CudaError, InvalidValueError
from cuproc.virtual_memory import GrowableBuffer, PhysicalMemory, Reservation, granularity, supported

from ipc_workers import run_child

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
SLACK = 8 * MiB      # cuMemGetInfo also moves by the driver's own bookkeeping (page tables)
KERNEL = r"""
extern "C" __global__ void iota(unsigned* p, unsigned long long n, unsigned offset) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = (unsigned)i + offset;
}
extern "C" __global__ void copy_words(unsigned* src, unsigned* dst, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
"""


@pytest.fixture()
def iota(primary):
    from cuproc.nvrtc import is_nvrtc_available
    if not is_nvrtc_available():
        pytest.skip("no NVRTC on this machine (pip install 'cuproc[nvrtc]')")
    fn = cuproc.compile_kernel(KERNEL, "iota")

    def run(buf, start: int, count: int, offset: int) -> None:
        fn.launch((count + 255) // 256, 256, (buf.ptr + 4 * start, count, offset),
                  signature=["unsigned*", "unsigned long long", "unsigned"])
        primary.context.synchronize()
    return run


def words(buf, start: int, count: int) -> np.ndarray:
    out = np.empty(count, np.uint32)
    mem.copy(out, buf.ptr + 4 * start, out.nbytes)
    return out


def test_supported_and_granularity(primary):
    assert supported()
    g = granularity()
    assert g >= 64 * 1024 and g & (g - 1) == 0 and granularity(option="recommended") % g == 0
    print(f"VMM granularity: minimum {g}, recommended {granularity(option='recommended')}")


def test_reserve_1gib_map_32mib_grow_three_times(primary, iota):
    free0 = mem.mem_info()[0]
    buf = GrowableBuffer(32 * MiB, reserve=1 << 30)
    address = buf.address
    assert buf.capacity == 1 << 30 and buf.mapped_bytes == 32 * MiB
    assert free0 - mem.mem_info()[0] >= 32 * MiB - SLACK
    assert free0 - mem.mem_info()[0] <= 32 * MiB + SLACK          # taken only as it grows: not the 1 GiB
    iota(buf, 0, 8 * MiB, 0)                                        # 32 MiB of words, by a kernel
    size = 32 * MiB
    for new in (64 * MiB, 96 * MiB, 128 * MiB):
        buf.grow(new)
        assert buf.address == address and buf.nbytes == new and len(buf.reservations) == 1
        taken = free0 - mem.mem_info()[0]
        assert new - SLACK <= taken <= new + SLACK, (new, taken)
        iota(buf, size // 4, (new - size) // 4, 7)                 # the grown part, by a kernel
        assert (words(buf, 0, 8 * MiB) == np.arange(8 * MiB, dtype=np.uint32)).all()   # kept
        size = new
    tail = words(buf, 32 * MiB - 16, 16)                            # the last words: the last grow's kernel
    assert (tail == np.arange(8 * MiB - 16, 8 * MiB, dtype=np.uint32) + 7).all()
    buf.close()
    assert mem.mem_info()[0] >= free0 - SLACK
    assert mem.pointer_attributes(address) == {"memory_type": None}


def test_a_failed_grow_leaves_the_buffer_as_it_was(primary, iota):
    g = granularity()
    buf = GrowableBuffer(g, reserve=2 * g, address="fixed")
    blocker = Reservation(g, near=buf.address + buf.capacity)
    try:
        if blocker.address != buf.address + buf.capacity:
            pytest.skip("the driver placed the blocking reservation elsewhere: the out-of-range grow cannot be forced")
        iota(buf, 0, g // 4, 3)
        buf.grow(2 * g)
        before = (buf.address, buf.nbytes, buf.mapped_bytes, buf.capacity, mem.mem_info()[0])
        with pytest.raises(InvalidValueError):
            buf.grow(3 * g)
        after = (buf.address, buf.nbytes, buf.mapped_bytes, buf.capacity, mem.mem_info()[0])
        assert after[:4] == before[:4] and abs(after[4] - before[4]) <= SLACK
        assert (words(buf, 0, g // 4) == np.arange(g // 4, dtype=np.uint32) + 3).all()
        iota(buf, 0, 2 * g // 4, 5)                                   # still mapped and accessible
    finally:
        blocker.close()
    buf.close()


def test_grow_extends_in_place_or_moves_and_keeps_the_data(primary, iota):
    g = granularity()
    buf = GrowableBuffer(g)
    address = buf.address
    iota(buf, 0, g // 4, 11)
    buf.grow(3 * g)                                                   # past the reservation
    moved = buf.address != address
    print("extended in place" if not moved else "moved (the next addresses were not free)")
    assert (words(buf, 0, g // 4) == np.arange(g // 4, dtype=np.uint32) + 11).all()
    iota(buf, 0, 3 * g // 4, 1)
    buf.grow(5 * g)                                                   # a second grow works
    assert (words(buf, 0, 3 * g // 4) == np.arange(3 * g // 4, dtype=np.uint32) + 1).all()
    buf.close()


def test_grow_moves_when_blocked_without_a_copy(primary, iota):
    g = granularity()
    free0 = mem.mem_info()[0]
    buf = GrowableBuffer(g)
    blocker = Reservation(g, near=buf.address + buf.capacity)
    try:
        if blocker.address != buf.address + buf.capacity:
            pytest.skip("the driver placed the blocking reservation elsewhere: the move cannot be forced")
        iota(buf, 0, g // 4, 9)
        chunk, old = buf.chunks[0], buf.address
        buf.grow(2 * g)
        assert buf.address != old and len(buf.reservations) == 1
        assert buf.chunks[0] is chunk                                 # the same physical memory, not a copy
        assert (words(buf, 0, g // 4) == np.arange(g // 4, dtype=np.uint32) + 9).all()
        iota(buf, 0, 2 * g // 4, 2)
        assert mem.pointer_attributes(old) == {"memory_type": None}   # the old range is unmapped
        buf.grow(4 * g)                                               # and again
        assert (words(buf, 0, 2 * g // 4) == np.arange(2 * g // 4, dtype=np.uint32) + 2).all()
    finally:
        blocker.close()
    buf.close()
    assert mem.mem_info()[0] >= free0 - SLACK


def test_exported_descriptor_is_mapped_by_another_process(primary, iota):
    g = granularity(handle_type="posix_fd")
    buf = GrowableBuffer(g, handle_type="posix_fd")
    iota(buf, 0, g // 4, 100)
    fd = buf.chunks[0].export_fd()
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}]
        import numpy as np
        import cuproc
        from cuproc import memory as mem
        from cuproc.virtual_memory import PhysicalMemory, Reservation
        pc = cuproc.use_device(0)
        phys = PhysicalMemory.import_fd({fd}, {g})
        res = Reservation({g})
        mapping = res.map(phys)
        got = np.empty(16, np.uint32)
        mem.copy(got, mapping, got.nbytes)
        assert got.tolist() == list(range(100, 116)), got
        mem.copy(mapping, np.full(4, 0xC0FFEE, np.uint32))
        res.close(); phys.close()
        print("child ok")
    """)
    run_child(script, fd)
    assert words(buf, 0, 4).tolist() == [0xC0FFEE] * 4
    buf.close()


def test_physical_memory_outlives_its_handle_while_mapped(primary, iota):
    g = granularity()
    free0 = mem.mem_info()[0]
    res, phys = Reservation(g), PhysicalMemory(g)
    mapping = res.map(phys)
    phys.release()                                                    # the mapping keeps the memory
    iota(mapping, 0, g // 4, 4)
    assert (words(mapping, 0, 8) == np.arange(8, dtype=np.uint32) + 4).all()
    res.close()                                                       # unmaps, then frees the range
    assert mapping.ended == "unmapped"
    assert mem.mem_info()[0] >= free0 - SLACK


def test_fabric_memory_where_the_device_has_it(primary, iota):
    """Fabric handles: refused with the attribute named where the device has none; where it has them, a
    child imports a chunk from its 64 bytes, maps it and reads the parent's words."""
    from cuproc.pools import fabric_supported
    if not fabric_supported(cuproc.Device(0)):
        for make in (lambda: PhysicalMemory(granularity(), handle_type="fabric"),
                     lambda: GrowableBuffer(granularity(), handle_type="fabric")):
            with pytest.raises(CudaError) as info:
                make()
            assert info.value.refused and info.value.name == "CUDA_ERROR_NOT_SUPPORTED"
            assert "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED" in str(info.value)
        print("no fabric handles on this device: refused as expected")
        return
    try:
        g = granularity(handle_type="fabric")
        buf = GrowableBuffer(g, handle_type="fabric")
    except CudaError as exc:
        if exc.name != "CUDA_ERROR_NOT_PERMITTED":
            raise
        pytest.skip(f"the device has fabric handles but this user has no IMEX channel: {exc}")
    iota(buf, 0, g // 4, 200)
    handle = buf.chunks[0].export_fabric()
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}]
        import numpy as np
        import cuproc
        from cuproc import memory as mem
        from cuproc.virtual_memory import PhysicalMemory, Reservation
        pc = cuproc.use_device(0)
        phys = PhysicalMemory.import_fabric(bytes.fromhex({handle.hex()!r}), {g})
        res = Reservation({g})
        mapping = res.map(phys)
        got = np.empty(16, np.uint32)
        mem.copy(got, mapping, got.nbytes)
        assert got.tolist() == list(range(200, 216)), got
        res.close(); phys.close()
        print("child ok")
    """)
    run_child(script)
    buf.close()


@pytest.mark.multi_gpu
def test_a_peer_device_reads_a_grown_buffer(primary, iota):
    """Peer access to a VMM buffer (cuMemSetAccess for device 1, checked with cuMemGetAccess): a kernel on
    device 1 reads all of it, before and after it grows (issue 40; run where the machine has two GPUs)."""
    if cuproc.Device.count() < 2:
        pytest.skip("needs two GPUs")
    g = granularity()
    buf = GrowableBuffer(g, peers=[1])
    iota(buf, 0, g // 4, 21)
    other = cuproc.PrimaryContext(1).retain()
    try:
        with other.context:                                           # compiled and loaded for device 1
            copy = cuproc.compile_kernel(KERNEL, "copy_words")
        for size in (g, 2 * g):                                       # before the grow, and after it
            if size > buf.nbytes:
                buf.grow(size)
                iota(buf, g // 4, g // 4, g // 4 + 21)                 # the new chunk, by device 0
            assert [m.access(1) for m in buf.mappings] == ["readwrite"] * len(buf.mappings)
            n = size // 4
            with other.context:
                there = cuproc.DeviceBuffer(size)
                mem.copy(there, buf, g)                                # device 1 copies device 0's VMM memory...
                copy.launch((n + 255) // 256, 256, (buf.ptr, there.ptr, n),   # ...and its kernel reads it all
                            signature=["unsigned*", "unsigned*", "unsigned long long"])
                other.context.synchronize()
                got = np.empty(n, np.uint32)
                mem.copy(got, there)
                there.free()
            np.testing.assert_array_equal(got, np.arange(n, dtype=np.uint32) + 21)
        del copy
    finally:
        other.release()
    buf.close()
