"""Green contexts on a real GPU (issue 38): a green context of >= 16 SMs computes right and runs its work on
at most that many SMs (read from %smid in the kernel), while a control launch in the primary context
spreads wider; a handle pinned to 11.8 reaches the 12.4 calls on a newer driver."""
from __future__ import annotations

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, Stream
from cuproc import memory as mem
from cuproc.green_context import GreenContext, SmResource, supported

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

BLOCKS = 2048
KERNEL = r"""
extern "C" __global__ void where_and_square(unsigned* smids, unsigned* squares, unsigned n) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    long long start = clock64();
    while (clock64() - start < 200000) { }          // long enough for the blocks to spread over what they may use
    if (threadIdx.x == 0) smids[blockIdx.x] = smid;
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) squares[i] = i * i;
}
"""


@pytest.fixture()
def needs_green(primary):
    from cuproc.nvrtc import is_nvrtc_available
    if not supported():
        pytest.skip("this driver has no green contexts (CUDA 12.4+)")
    if not is_nvrtc_available():
        pytest.skip("no NVRTC on this machine (pip install 'cuproc[nvrtc]')")
    return primary


def _run(context, stream) -> tuple[set[int], np.ndarray]:
    fn = cuproc.compile_kernel(KERNEL, "where_and_square", context=context)
    n = BLOCKS * 64
    with context:
        smids, squares = DeviceBuffer(4 * BLOCKS), DeviceBuffer(4 * n)
    fn.launch(BLOCKS, 64, (smids, squares, np.uint32(n)), stream=stream)
    stream.synchronize()
    ids, out = np.empty(BLOCKS, np.uint32), np.empty(n, np.uint32)
    mem.copy(ids, smids)
    mem.copy(out, squares)
    smids.free()
    squares.free()
    return set(ids.tolist()), out


def test_green_context_of_16_sms_runs_on_at_most_16(needs_green):
    sms = SmResource.of_device(0)
    (group,), rest = sms.split(16, groups=1)
    assert group.sm_count >= 16
    green = GreenContext(group)
    try:
        count = green.sm_count
        assert 16 <= count < sms.sm_count
        used, squares = _run(green.context, green.stream())
        n = BLOCKS * 64
        assert (squares == (np.arange(n, dtype=np.uint64) ** 2 % (1 << 32)).astype(np.uint32)).all()
        assert len(used) <= count, f"green work ran on {len(used)} SMs; the green context has {count}"
        control_used, _ = _run(needs_green.context, Stream(non_blocking=True))
        assert len(control_used) > count, f"the control launch used {len(control_used)} SMs"
        print(f"green: {count} SMs, work on {len(used)}; control on {len(control_used)} of {sms.sm_count}")
    finally:
        green.close()


def test_a_handle_pinned_to_11_8_reaches_green_contexts(needs_green):
    old = cuproc.Driver("11.8")
    assert supported(old), "the 12.4 calls should be newer-driver features for an 11.8 handle"
    (group,), _ = SmResource.of_device(0, driver=old).split(16, groups=1)
    green = GreenContext(group)
    try:
        assert green.driver is old and green.sm_count >= 16
        stream = green.stream()
        with green.context:
            buf = DeviceBuffer(256, driver=old)
        mem.memset(buf, 9, stream=stream)
        stream.synchronize()
        out = np.empty(256, np.uint8)
        mem.copy(out, buf)
        assert (out == 9).all()
        buf.free()
        stream.close()
    finally:
        green.close()
