"""Virtual memory management in the object layer (issue 38) on the stateful fake driver: reservations,
physical memory, mappings and access as resources, the growable buffer (in place, extended, moved,
failed), exportable handles (POSIX file descriptors, across processes too), lifetimes and bad input.

The fake (tests/fakedriver_vmm.c) backs physical memory with memfds mapped at the device addresses'
offsets, so mapped bytes are real and shared as on a GPU; it counts a free of a reservation that is not
one as reserved, a release of a handle not held, and a use of unmapped memory as stale uses (the ``fk``
fixture fails on any).  ``vmm`` checks that nothing VMM is left once a test's objects are gone.
"""
from __future__ import annotations

import ctypes
import gc
import os
import pickle
import struct
import textwrap

import numpy as np
import pytest

import cuproc
from cuproc import Context, DeviceBuffer, Module
from cuproc import memory as mem
from cuproc.errors import ClosedResourceError, CudaError, InvalidValueError, OutOfMemoryError
from cuproc.virtual_memory import GrowableBuffer, Mapping, PhysicalMemory, Reservation, granularity, supported

from fakedriver import child_preamble, fake_image
from ipc_workers import run_child
from subproc import run_python

ffi = cuproc.ffi
MiB = 1 << 20
G = 2 * MiB                    # the fake's granularity
OUT_OF_MEMORY, INVALID_VALUE, NOT_SUPPORTED = 2, 1, 801


class Vmm:
    """The fake's VMM counters (fake_vmm_live)."""

    def __init__(self, fake):
        self.fake = fake
        self.lib = fake.lib
        self.lib.fake_vmm_live.restype = ctypes.c_long
        self.lib.fake_vmm_live.argtypes = [ctypes.c_char_p]

    def live(self) -> dict[str, int]:
        return {kind: self.lib.fake_vmm_live(kind.encode()) for kind in ("physical", "handle", "reservation", "mapping")}


NOTHING = {"physical": 0, "handle": 0, "reservation": 0, "mapping": 0}


@pytest.fixture()
def vmm(fk, pc):
    """Device 0's primary context current on a fresh fake; afterwards (the test's objects collected) no
    physical memory, handle, reservation or mapping is left: cuproc gave back all it made."""
    v = Vmm(fk)
    assert v.live() == NOTHING
    yield v
    gc.collect()
    left = v.live()
    fk.lib.fake_vmm_reset()
    assert left == NOTHING


def host(buf, n, dtype=np.uint32):
    out = np.zeros(n, dtype)
    mem.copy(out, buf, out.nbytes)
    return out


@pytest.fixture(autouse=True)
def imex(imex_channel):
    """Every test here may make fabric handles (the fake's switch decides whether the device has them)."""
    return imex_channel


# ----------------------------------------------------------------------------- the ABI the fake and cuproc share

def test_struct_sizes_are_the_fakes():
    assert {name: ffi.sizeof(name) for name in ("CUmemAllocationProp", "CUmemAccessDesc", "CUmemLocation")} == \
        {"CUmemAllocationProp": 32, "CUmemAccessDesc": 12, "CUmemLocation": 8}
    assert ffi.sizeof("CUmemGenericAllocationHandle") == 8


def test_supported_and_granularity(vmm):
    assert supported()
    assert granularity() == G and granularity(0, option="recommended") == G
    with pytest.raises(InvalidValueError):
        granularity(option="smallest")
    with pytest.raises(InvalidValueError):
        granularity(handle_type="win32")
    vmm.fake.clear_calls()
    with pytest.raises(CudaError) as info:
        granularity(handle_type="fabric")           # no fabric on this device: refused, naming the attribute
    assert info.value.code == NOT_SUPPORTED and info.value.refused
    assert "cuMemGetAllocationGranularity" not in vmm.fake.calls()


# ----------------------------------------------------------------------------- the growable-buffer tests

def test_reserve_1gib_map_32mib_grow_three_times(vmm):
    """Physical memory is taken only as the buffer grows; the address and the data stay put; after close
    the range is unmapped and mem_info is back where it started."""
    free0 = mem.mem_info()[0]
    buf = GrowableBuffer(32 * MiB, reserve=1 << 30)
    address = buf.address
    assert (buf.nbytes, buf.mapped_bytes, buf.capacity) == (32 * MiB, 32 * MiB, 1 << 30)
    assert free0 - mem.mem_info()[0] == 32 * MiB
    data = np.arange(8 * MiB, dtype=np.uint32)
    mem.copy(buf, data)
    old = 32 * MiB
    for step, size in enumerate((64 * MiB, 96 * MiB, 128 * MiB), start=1):
        buf.grow(size)
        assert buf.address == address and buf.nbytes == size and len(buf.reservations) == 1
        assert free0 - mem.mem_info()[0] == size                  # taken only as it grows
        assert (host(buf, data.size) == data).all()               # kept, no copy
        mem.memset(address + old, step, size - old)               # the grown range is memory
        old = size
    tail = np.zeros(4, np.uint32)
    mem.copy(tail, address + 128 * MiB - 16, 16)
    assert tail.tolist() == [0x03030303] * 4
    assert vmm.live() == {"physical": 4, "handle": 4, "reservation": 1, "mapping": 4}
    buf.close()
    assert mem.mem_info()[0] == free0
    assert vmm.live() == NOTHING
    assert mem.pointer_attributes(address) == {"memory_type": None}   # unmapped
    with pytest.raises(ClosedResourceError):
        buf.grow(256 * MiB)


def test_a_failed_grow_out_of_range_leaves_the_buffer_as_it_was(vmm):
    buf = GrowableBuffer(4 * MiB, reserve=8 * MiB, address="fixed")
    blocker = DeviceBuffer(64)                   # takes the addresses right after the reservation
    mem.copy(buf, np.arange(1024, dtype=np.uint32))
    before = (buf.address, buf.nbytes, buf.mapped_bytes, buf.capacity, vmm.live())
    buf.grow(8 * MiB)                            # inside the reservation: fine
    before = (buf.address, buf.nbytes, buf.mapped_bytes, buf.capacity, vmm.live())
    with pytest.raises(InvalidValueError) as info:
        buf.grow(10 * MiB)
    assert info.value.refused and "address='fixed'" in str(info.value)
    assert (buf.address, buf.nbytes, buf.mapped_bytes, buf.capacity, vmm.live()) == before
    assert host(buf, 1024).tolist() == list(range(1024))
    mem.memset(buf, 1)                           # still mapped and accessible, every byte
    buf.close()
    blocker.free()


# ----------------------------------------------------------------------------- grow paths

def test_grow_past_the_reservation_extends_it_in_place(vmm):
    buf = GrowableBuffer(2 * MiB)                # reserves exactly 2 MiB
    address = buf.address
    mem.copy(buf, np.full(16, 7, np.uint32))
    buf.grow(5 * MiB)                            # the next addresses are free: a second reservation there
    assert buf.address == address and buf.capacity == 6 * MiB and len(buf.reservations) == 2
    assert buf.nbytes == 5 * MiB and buf.mapped_bytes == 6 * MiB
    buf.grow(9 * MiB)                            # and again: a second grow works
    assert buf.address == address and len(buf.reservations) == 3 and buf.mapped_bytes == 10 * MiB
    mem.memset(buf, 0xAB)                        # one contiguous range across the reservations
    out = np.zeros(9 * MiB, np.uint8)
    mem.copy(out, buf)
    assert (out == 0xAB).all()
    assert vmm.live()["reservation"] == 3
    buf.close()                                  # each reservation freed as reserved (a stale use otherwise)


def test_grow_moves_when_the_next_addresses_are_taken_and_keeps_the_memory(vmm):
    buf = GrowableBuffer(4 * MiB, reserve=4 * MiB)
    blocker = DeviceBuffer(64)
    data = np.arange(MiB, dtype=np.uint32)
    mem.copy(buf, data)
    first_chunk = buf.chunks[0]
    old = buf.address
    buf.grow(6 * MiB)
    assert buf.address != old and buf.capacity == 8 * MiB and len(buf.reservations) == 1
    assert buf.chunks[0] is first_chunk          # the same physical memory, mapped at the new address
    assert (host(buf, data.size) == data).all()
    assert mem.pointer_attributes(old) == {"memory_type": None}   # the old range is gone
    assert vmm.live() == {"physical": 2, "handle": 2, "reservation": 1, "mapping": 2}
    for size in (8 * MiB, 12 * MiB, 20 * MiB):  # repeated grows, moving or not
        DeviceBuffer(64)                          # (freed at once: its range comes back to the next cuMemAlloc)
        buf.grow(size)
        assert (host(buf, data.size) == data).all() and buf.nbytes == size
    buf.close()
    blocker.free()


def test_a_grow_whose_extension_lands_elsewhere_frees_only_that_reservation(vmm):
    """The driver placed the extension away from the hint: it is the buffer's (it reserved it), so it is
    given back -- with its own pointer and size (anything else is a stale use in the fake) -- and the buffer
    moves."""
    buf = GrowableBuffer(2 * MiB)
    blocker = DeviceBuffer(64)
    old = buf.address
    buf.grow(4 * MiB)
    assert buf.address != old and len(buf.reservations) == 1
    assert vmm.live()["reservation"] == 1           # the misplaced extension did not leak
    buf.close()
    blocker.free()


def test_a_failed_adjacent_reserve_frees_nothing(vmm, fk):
    """cuda.core freed the pointer of a reserve that had failed; here a failed reserve made nothing, and
    nothing is freed for it (the fake counts a free of a range that is no reservation as a stale use)."""
    buf = GrowableBuffer(2 * MiB)
    old = buf.address
    fk.fail("cuMemAddressReserve", OUT_OF_MEMORY, 1)   # the extension fails; the move's reserve works
    buf.grow(4 * MiB)
    assert buf.address != old and len(buf.reservations) == 1 and buf.nbytes == 4 * MiB
    assert vmm.live()["reservation"] == 1
    buf.close()


@pytest.mark.parametrize("failing", ["cuMemCreate", "cuMemMap", "cuMemSetAccess"])
def test_a_grow_that_fails_in_place_gives_back_what_it_made(vmm, fk, failing):
    buf = GrowableBuffer(2 * MiB, reserve=8 * MiB)
    mem.copy(buf, np.arange(16, dtype=np.uint32))
    before = (buf.address, buf.nbytes, buf.mapped_bytes, vmm.live())
    fk.fail(failing, OUT_OF_MEMORY, 1)
    with pytest.raises(OutOfMemoryError):
        buf.grow(6 * MiB)
    assert (buf.address, buf.nbytes, buf.mapped_bytes, vmm.live()) == before
    assert host(buf, 16).tolist() == list(range(16))
    buf.grow(6 * MiB)                            # and it can still grow
    buf.close()


@pytest.mark.parametrize("failing", ["cuMemCreate", "cuMemMap", "cuMemSetAccess"])
def test_a_grow_that_fails_after_extending_gives_the_extension_back(vmm, fk, failing):
    buf = GrowableBuffer(2 * MiB)
    before = (buf.address, buf.nbytes, buf.mapped_bytes, buf.capacity, len(buf.reservations), vmm.live())
    fk.fail(failing, OUT_OF_MEMORY, 1)
    with pytest.raises(OutOfMemoryError):
        buf.grow(4 * MiB)                        # the extension is reserved, then the new chunk fails
    assert (buf.address, buf.nbytes, buf.mapped_bytes, buf.capacity, len(buf.reservations), vmm.live()) == before
    buf.grow(4 * MiB)                            # the addresses after it were given back: it extends again
    assert len(buf.reservations) == 2 and buf.address == before[0]
    buf.close()


@pytest.mark.parametrize("failing", ["cuMemCreate", "cuMemMap", "cuMemSetAccess"])
def test_a_move_that_fails_leaves_the_old_mappings_and_their_access(vmm, fk, failing):
    """cuda.core's rollback lost the access grants of the old range; here the old range is never touched
    before the new one is complete."""
    buf = GrowableBuffer(4 * MiB)
    blocker = DeviceBuffer(64)
    mem.copy(buf, np.arange(16, dtype=np.uint32))
    before = (buf.address, buf.nbytes, buf.mapped_bytes, buf.capacity, vmm.live())
    # the move maps the old chunk (cuMemMap, cuMemSetAccess) before it creates a new one: fail the last step
    fk.fail(failing, OUT_OF_MEMORY, 1)
    with pytest.raises(OutOfMemoryError):
        buf.grow(8 * MiB)
    assert (buf.address, buf.nbytes, buf.mapped_bytes, buf.capacity, vmm.live()) == before
    assert [m.access() for m in buf.mappings] == ["readwrite"]
    mem.memset(buf, 5)                           # accessible: the fake would count a stale use otherwise
    assert host(buf, 2).tolist() == [0x05050505] * 2
    buf.grow(8 * MiB)
    buf.close()
    blocker.free()


def test_a_move_is_refused_while_dlpack_exports_hold_the_old_address(vmm):
    buf = GrowableBuffer(2 * MiB)
    blocker = DeviceBuffer(64)
    capsule = buf.__dlpack__(stream=-1)
    with pytest.raises(BufferError):
        buf.grow(4 * MiB)
    assert buf.nbytes == 2 * MiB and vmm.live()["reservation"] == 1
    del capsule
    gc.collect()
    buf.grow(4 * MiB)
    buf.close()
    blocker.free()


# ----------------------------------------------------------------------------- a DeviceBuffer's uses

def test_usable_wherever_a_device_buffer_is(vmm, fk):
    buf = GrowableBuffer(3 * MiB)
    view = buf.view("f4", 16)
    mem.copy(view, np.arange(16, dtype=np.float32))
    assert host(buf, 16, np.float32).tolist() == list(range(16))
    cai = buf.__cuda_array_interface__
    assert cai["data"] == (buf.address, False) and cai["shape"] == (3 * MiB,) and cai["typestr"] == "|u1"
    assert buf.__dlpack_device__() == (2, 0)
    module = Module.load(fake_image({"empty": [8, 4, 4]}))
    module.get_function("empty").launch(1, 32, (buf, np.int32(3), np.float32(0.5)))
    assert fk.last_launch() == ("empty", struct.pack("<Qif", buf.address, 3, 0.5))
    other = DeviceBuffer(64)
    mem.copy(other, buf, 64)
    assert host(other, 16, np.float32).tolist() == list(range(16))
    info = mem.pointer_attributes(buf)
    assert info["memory_type"] == "device" and info["device_ordinal"] == 0
    with pytest.raises(TypeError):
        pickle.dumps(buf)
    buf.close()
    other.free()


def test_dropped_buffer_gives_everything_back(vmm):
    free0 = mem.mem_info()[0]
    buf = GrowableBuffer(6 * MiB)
    buf.grow(10 * MiB)
    del buf
    gc.collect()
    assert vmm.live() == NOTHING and mem.mem_info()[0] == free0


def test_context_destroyed_first_refuses_use_but_close_gives_back(vmm, pc):
    ctx = Context.create(0)
    try:
        free0 = mem.mem_info(ctx)[0]
        buf = GrowableBuffer(4 * MiB, context=ctx)
    finally:
        Context.pop()
    ctx.destroy()
    with pytest.raises(ClosedResourceError):
        buf.grow(8 * MiB)
    with pytest.raises(ClosedResourceError):
        buf.ptr
    assert vmm.live()["physical"] == 1             # the memory is the device's: still there
    buf.close()                                    # and given back all the same
    assert vmm.live() == NOTHING and mem.mem_info()[0] == free0


def test_reused_addresses_and_handles_never_reach_a_closed_object(vmm, fk):
    first = GrowableBuffer(2 * MiB)
    address, handle = first.address, first.chunks[0].handle
    chunk = first.chunks[0]
    first.close()
    second = GrowableBuffer(2 * MiB)               # the fake hands both out again, as the driver does
    assert second.address == address and second.chunks[0].handle == handle
    mem.memset(second, 9)
    for use in (lambda: first.grow(4 * MiB), lambda: mem.memset(first, 1), lambda: chunk.export_fd()):
        with pytest.raises(ClosedResourceError):
            use()
    first.close()
    chunk.close()                                  # idempotent: nothing reaches the driver
    assert host(second, 1).tolist() == [0x09090909]
    second.close()


def test_bad_arguments_are_refused_before_the_driver(vmm, fk):
    fk.clear_calls()
    for make in (lambda: GrowableBuffer(-1), lambda: GrowableBuffer(1.5), lambda: GrowableBuffer(2, address="moving"),
                 lambda: GrowableBuffer(2, handle_type="win32"), lambda: Reservation(0), lambda: PhysicalMemory(-4)):
        with pytest.raises(InvalidValueError) as info:
            make()
        assert info.value.refused
    buf = GrowableBuffer(3 * MiB)                  # 4 MiB mapped
    with pytest.raises(InvalidValueError):
        buf.grow(2 * MiB)                          # it only grows
    fk.clear_calls()
    buf.grow(3 * MiB)                              # the same size: nothing to do
    buf.grow(4 * MiB)                              # within the mapped bytes: no driver call either
    assert fk.call_count() == 0 and (buf.nbytes, buf.mapped_bytes) == (4 * MiB, 4 * MiB)
    with pytest.raises(CudaError) as info:
        PhysicalMemory(G + 1)                      # not a multiple of the granularity: the driver's answer
    assert info.value.code == INVALID_VALUE
    buf.close()


# ----------------------------------------------------------------------------- the three resources

def test_closing_in_any_order_gives_back_exactly_once(vmm):
    for order in ("physical first", "reservation first", "mapping first"):
        res = Reservation(4 * MiB)
        phys = PhysicalMemory(2 * MiB)
        mapping = res.map(phys, offset=2 * MiB)
        assert isinstance(mapping, Mapping) and mapping.address == res.address + 2 * MiB
        assert mapping.access() == "readwrite" and mapping.access(1) == "none"
        mem.copy(mapping, np.arange(4, dtype=np.uint32))
        if order == "physical first":
            phys.release()                     # the mapping keeps the memory
            assert host(mapping, 4).tolist() == [0, 1, 2, 3]
            res.close()                        # unmaps it first
            assert mapping.ended == "unmapped" and vmm.live() == NOTHING
        elif order == "reservation first":
            res.close()
            assert mapping.closed and vmm.live() == {"physical": 1, "handle": 1, "reservation": 0, "mapping": 0}
            mapping.close()                    # its range went with the reservation: nothing to unmap
            phys.close()
        else:
            mapping.close()
            phys.close()
            res.close()
        assert vmm.live() == NOTHING


def test_map_refuses_overruns_and_a_mapping_without_access_is_not_memory(vmm, fk):
    res = Reservation(4 * MiB)
    phys = PhysicalMemory(2 * MiB)
    with pytest.raises(InvalidValueError):
        res.map(phys, offset=4 * MiB)
    with pytest.raises(InvalidValueError):
        res.map(phys, physical_offset=2 * MiB)
    mapping = res.map(phys, access=None)
    assert mapping.access() == "none"
    assert mem.pointer_attributes(mapping.address) == {"memory_type": None}   # not usable until access is set
    mapping.set_access("read")
    assert mapping.access() == "read"
    with pytest.raises(InvalidValueError):
        mapping.set_access("write")
    mapping.set_access()
    mem.memset(mapping, 1)
    res.close()
    phys.close()


def test_exported_fd_maps_the_same_memory(vmm):
    phys = PhysicalMemory(2 * MiB, handle_type="posix_fd")
    fd = phys.export_fd()
    try:
        imported = PhysicalMemory.import_fd(fd, 2 * MiB)
    finally:
        os.close(fd)
    assert imported.imported and imported.device_ordinal == 0
    a, b = Reservation(2 * MiB), Reservation(2 * MiB)
    ma, mb = a.map(phys), b.map(imported)
    mem.copy(ma, np.arange(8, dtype=np.uint32))
    assert host(mb, 8).tolist() == list(range(8))   # one physical allocation behind both
    for r in (a, b):
        r.close()
    imported.close()
    phys.close()
    plain = PhysicalMemory(2 * MiB)
    with pytest.raises(InvalidValueError):
        plain.export_fd()                          # made without handle_type="posix_fd"
    plain.close()


def test_importing_a_forged_or_closed_descriptor_is_a_clear_error(vmm, tmp_path):
    path = tmp_path / "not-gpu-memory"
    path.write_bytes(b"x" * 4096)
    with open(path, "rb") as f:
        with pytest.raises(CudaError) as info:
            PhysicalMemory.import_fd(f.fileno(), 2 * MiB)
    assert info.value.code == INVALID_VALUE and "export_fd" in "".join(getattr(info.value, "__notes__", []))
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(CudaError):
        PhysicalMemory.import_fd(r, 2 * MiB)          # closed
    with pytest.raises(InvalidValueError):
        PhysicalMemory.import_fd(-1, 2 * MiB)


@pytest.mark.parametrize("handle_type", ["posix_fd", "fabric"])
def test_an_exported_chunk_shares_memory_with_another_process(vmm, fake, handle_type):
    """A descriptor crosses the process boundary (inherited here, as a Unix socket would send it); a fabric
    handle (where the device has them: the fake's switch on) is 64 bytes sent as any value.  The child
    imports and maps the memory, reads the parent's bytes and writes its own back."""
    fabric = handle_type == "fabric"
    vmm.lib.fake_vmm_set_fabric(int(fabric))
    buf = GrowableBuffer(2 * MiB, handle_type=handle_type)
    mem.copy(buf, np.arange(64, dtype=np.uint32))
    chunk = buf.chunks[0]
    with pytest.raises(InvalidValueError):
        chunk.export_fd() if fabric else chunk.export_fabric()     # only the type it was made for
    fd = None if fabric else chunk.export_fd()
    imported = (f"PhysicalMemory.import_fabric(bytes.fromhex({chunk.export_fabric().hex()!r}), {2 * MiB})" if fabric
                else f"PhysicalMemory.import_fd({fd}, {2 * MiB})")
    script = child_preamble(fake.path) + textwrap.dedent(f"""
        import numpy as np
        from cuproc import memory as mem
        from cuproc.virtual_memory import PhysicalMemory, Reservation
        fake.lib.fake_vmm_set_fabric({int(fabric)})
        pc = cuproc.use_device(0)
        phys = {imported}
        assert phys.imported and phys.handle_type == {handle_type!r}
        res = Reservation({2 * MiB})
        mapping = res.map(phys)
        got = np.zeros(64, np.uint32)
        mem.copy(got, mapping, got.nbytes)
        assert got.tolist() == list(range(64)), got
        mem.copy(mapping, np.full(4, 0xC0FFEE, np.uint32))
        res.close(); phys.close()
        assert fake.stale_count() == 0, fake.stale_calls()
        print("child ok")
    """)
    run_child(script, fd)
    assert host(buf, 4).tolist() == [0xC0FFEE] * 4
    buf.close()


def test_a_fabric_handle_of_released_memory_is_the_drivers_error(vmm):
    vmm.lib.fake_vmm_set_fabric(1)
    assert cuproc.Device(0).attribute("HANDLE_TYPE_FABRIC_SUPPORTED") == 1
    phys = PhysicalMemory(G, handle_type="fabric")
    handle = phys.export_fabric()
    with pytest.raises(InvalidValueError):
        PhysicalMemory.import_fabric(handle[:-1], G)          # truncated: refused before the driver
    phys.close()
    with pytest.raises(CudaError) as info:
        PhysicalMemory.import_fabric(handle, G)               # its memory was released: the driver's answer
    assert info.value.code == INVALID_VALUE and "export_fabric" in " ".join(info.value.__notes__)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_refuses_and_gives_nothing_back(vmm, fake):
    """In a child forked after CUDA was initialized, every use refuses and close() or a drop calls nothing:
    the reservation, the physical memory and the mappings are the parent's."""
    script = child_preamble(fake.path) + textwrap.dedent("""
        import ctypes, gc
        from cuproc import ForkedProcessError
        from cuproc.virtual_memory import GrowableBuffer, PhysicalMemory, Reservation
        pc = cuproc.use_device(0)
        buf = GrowableBuffer(4 << 20, handle_type="posix_fd")
        res, phys = Reservation(2 << 20), PhysicalMemory(2 << 20)
        pid = os.fork()
        if pid == 0:
            refused = 0
            for use in (lambda: buf.grow(8 << 20), lambda: buf.ptr, lambda: buf.chunks[0].export_fd(),
                        lambda: res.map(phys)):
                try:
                    use()
                except ForkedProcessError:
                    refused += 1
            for thing in (buf, res, phys):
                thing.close()
            del buf, res, phys
            gc.collect()
            os._exit(0 if refused == 4 and fake.fork_violations() == 0 else 10 + refused)
        _, status = os.waitpid(pid, 0)
        buf.grow(8 << 20)                 # the parent's objects are intact
        for thing in (buf, res, phys):
            thing.close()
        live = {k: fake.lib.fake_vmm_live(k.encode()) for k in ("physical", "reservation", "mapping")}
        print(os.waitstatus_to_exitcode(status), sorted(live.values()))
    """)
    proc = run_python(script)
    assert proc.stdout.split("\n")[-2] == "0 [0, 0, 0]", proc.stdout


def test_peers_get_access_and_fixed_buffers_still_extend_in_place(vmm):
    buf = GrowableBuffer(2 * MiB, peers=[1, cuproc.Device(0)], address="fixed")
    assert buf.peers == (1,)
    assert [(m.access(0), m.access(1)) for m in buf.mappings] == [("readwrite", "readwrite")]
    address = buf.address
    buf.grow(4 * MiB)                 # the next addresses are free: "fixed" extends where it is
    assert buf.address == address and len(buf.reservations) == 2
    assert [(m.access(0), m.access(1)) for m in buf.mappings] == [("readwrite", "readwrite")] * 2
    buf.close()


# ----------------------------------------------------------------------------- fabric handles

def test_fabric_memory_is_refused_where_the_device_has_none(vmm):
    vmm.fake.clear_calls()
    for make in (lambda: PhysicalMemory(G, handle_type="fabric"), lambda: GrowableBuffer(G, handle_type="fabric")):
        with pytest.raises(CudaError) as info:
            make()
        assert info.value.refused and info.value.code == NOT_SUPPORTED
        assert "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED" in str(info.value)
    assert "cuMemCreate" not in vmm.fake.calls()


def test_a_dlpack_copy_of_virtual_memory_is_a_device_buffer_with_its_bytes(vmm):
    """__dlpack__(copy=True) needs new memory of the same bytes: a DeviceBuffer (a GrowableBuffer's or a
    Mapping's constructor takes a size policy or a reservation, not the copy's byte count)."""
    from cuproc import _dlpack
    res, phys = Reservation(4 * MiB), PhysicalMemory(2 * MiB)
    mapping = res.map(phys)
    for buf in (GrowableBuffer(3 * MiB), mapping):
        mem.copy(buf, np.arange(64, dtype=np.uint32))
        copied = _dlpack.consume(buf.__dlpack__(copy=True, max_version=(1, 0)))
        assert copied.ptr != buf.ptr and not res.address <= copied.ptr < res.address + res.nbytes
        assert host(copied.ptr, 64).tolist() == list(range(64))
        assert mem.pointer_attributes(copied.ptr)["memory_type"] == "device"
        copied.release()
        gc.collect()
        buf.close()
    phys.release()
    res.close()
