"""Green contexts in the object layer (issue 38) on the stateful fake driver: SM resources, one split with
explicit groups, green contexts and their Context, streams and memory on them, lifetimes, a handle pinned
to 11.8 reaching the 12.4 calls, and bad input.

The fake (tests/fakedriver_green.c) gives each device 132 SMs in partitions of 8, tags the resources it
hands out (a resource cuproc made up is CUDA_ERROR_INVALID_RESOURCE_TYPE), and makes a context object per
green context that cuGreenCtxDestroy destroys with everything in it.
"""
from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, Module
from cuproc import memory as mem
from cuproc.errors import ClosedResourceError, CudaError, InvalidValueError
from cuproc.green_context import GreenContext, SmResource, supported

from fakedriver import fake_image

ffi = cuproc.ffi
INVALID_RESOURCE_TYPE, INVALID_RESOURCE_CONFIGURATION = 914, 915


@pytest.fixture()
def green(fk, pc):
    """Device 0's primary context current; afterwards no green context is left in the fake."""
    fk.lib.fake_green_live.restype = ctypes.c_long
    fk.lib.fake_green_live.argtypes = [ctypes.c_char_p]
    yield fk
    gc.collect()
    assert fk.lib.fake_green_live(b"green") == 0


def test_struct_layout_is_the_same_at_every_version():
    assert ffi.sizeof("CUdevResource") == 144 and ffi.offsetof("CUdevResource", "sm") == 96


def test_split_once_into_groups_and_a_remainder(green):
    assert supported()
    sms = SmResource.of_device(0)
    assert sms.sm_count == 132 and sms.device_ordinal == 0
    assert sms.group_count(16) == 8 and sms.group_count(13) == 8       # rounded up to the partition (8)
    groups, rest = sms.split(16, groups=2)
    assert [g.sm_count for g in groups] == [16, 16] and rest.sm_count == 100
    groups, rest = sms.split(32)                                         # as many as fit
    assert [g.sm_count for g in groups] == [32] * 4 and rest.sm_count == 4
    groups, rest = sms.split(64, groups=5)                               # fewer fit than asked
    assert len(groups) == 2 and rest.sm_count == 4


def test_bad_splits_are_refused_or_the_drivers_answer(green):
    sms = SmResource.of_device(0)
    for bad in (0, -8, 2.5):
        with pytest.raises(InvalidValueError):
            sms.split(bad)
    with pytest.raises(InvalidValueError):
        sms.split(16, groups=0)
    with pytest.raises(InvalidValueError):
        sms.split(200)                                                   # no group fits: nothing to ask
    with pytest.raises(CudaError) as info:
        sms.split(200, groups=1)
    assert info.value.code == INVALID_RESOURCE_CONFIGURATION
    forged = SmResource(ffi.new("CUdevResource *", {"type": 1}), sms.driver, 0)
    with pytest.raises(CudaError) as info:
        GreenContext(forged)
    assert info.value.code == INVALID_RESOURCE_TYPE
    with pytest.raises(InvalidValueError):
        GreenContext([])


def test_green_context_streams_memory_and_launches(green):
    (group,), _ = SmResource.of_device(0).split(16, groups=1)
    gctx = GreenContext(group)
    assert gctx.sm_count == 16 and not gctx.context.owned
    stream = gctx.stream()
    assert stream.context is gctx.context
    with gctx.context:
        buf = DeviceBuffer(64)
        module = Module.load(fake_image({"empty": [8, 4, 4]}))
    assert buf.context is gctx.context
    mem.memset(buf, 3)
    module.get_function("empty").launch(1, 32, (buf, np.int32(1), np.float32(2)), stream=stream)
    assert green.last_launch()[0] == "empty" and green.last_launch_config()[2] == int(ffi.cast("uintptr_t", stream.handle))
    stream.synchronize()
    out = np.zeros(4, np.uint8)
    mem.copy(out, buf, 4)
    assert out.tolist() == [3] * 4
    gctx.destroy()
    gctx.destroy()                                                       # idempotent
    for use in (lambda: stream.synchronize(), lambda: mem.memset(buf, 1), lambda: gctx.stream(),
                lambda: gctx.sm_count):
        with pytest.raises(ClosedResourceError):
            use()
    for thing in (buf, stream, module):
        thing.close()                                                    # their handles went with it


def test_dropped_green_context_is_destroyed(green):
    (group,), _ = SmResource.of_device(0).split(8, groups=1)
    gctx = GreenContext(group)
    ctx = gctx.context
    assert green.lib.fake_green_live(b"green") == 1
    del gctx
    gc.collect()
    assert green.lib.fake_green_live(b"green") == 0 and ctx.closed


def test_two_green_contexts_from_one_split_do_not_overlap(green):
    (a, b), rest = SmResource.of_device(0).split(24, groups=2)
    ga, gb = GreenContext(a), GreenContext(b)
    assert ga.sm_count + gb.sm_count + rest.sm_count == 132
    assert ga.context is not gb.context
    ga.close()
    gb.close()


def test_a_handle_pinned_to_11_8_reaches_the_12_4_calls(green, fake):
    """The calls are newer-driver features for an 11.8 handle: the registry's rules take them from the
    installed driver (a 13.0 fake here, a 580 driver on the GPU machine)."""
    old = cuproc.Driver("11.8", library=str(fake.path))
    assert supported(old)
    (group,), _ = SmResource.of_device(0, driver=old).split(8, groups=1)
    gctx = GreenContext(group)
    assert gctx.driver is old and gctx.sm_count == 8
    gctx.close()
