"""Modules, JIT linking, libraries and kernel launches on a real GPU, checked against NumPy."""
from __future__ import annotations

import queue
import runpy
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import cuproc
import cuproc.launch as L
from cuproc import Context, Device, DeviceBuffer, Library, Linker, Module, PrimaryContext
from cuproc import memory as mem
from cuproc.errors import CudaError, InvalidValueError

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
K = ROOT / "kernels"


@pytest.fixture()
def module(primary):
    with Module.load(K / "kernels.fatbin") as m:   # SASS for every GPU nvcc 13.0 supports
        yield m


def test_vector_add_example():
    result = runpy.run_path(str(ROOT / "examples" / "vector_add.py"))["main"]()
    rng = np.random.default_rng(0)
    a, b = rng.random(50_000, dtype=np.float32), rng.random(50_000, dtype=np.float32)
    np.testing.assert_allclose(result, a + b)


@pytest.mark.parametrize("artifact", ["kernels.cubin", "kernels.ptx", "kernels.fatbin"])
def test_load_each_format_from_file_and_bytes(primary, artifact):
    if artifact == "kernels.cubin" and Device(0).compute_capability != (9, 0):
        pytest.skip("kernels.cubin is sm_90's (the format's sample); the fatbin covers this GPU")
    for source in (K / artifact, (K / artifact).read_bytes()):
        with Module.load(source, {"OPTIMIZATION_LEVEL": 3, "MAX_REGISTERS": 64}) as m:
            assert m.jit.wall_ms >= 0.0
            fn = m.get_function("VecAdd_kernel")
            a = np.arange(1000, dtype=np.float32)
            with DeviceBuffer(a.nbytes) as da, DeviceBuffer(a.nbytes) as dc:
                mem.copy(da, a)
                fn.launch(4, 256, (da, da, dc, np.int32(a.size)))
                out = np.empty_like(a)
                mem.copy(out, dc)
            np.testing.assert_array_equal(out, 2 * a)


def test_ptx_error_carries_the_jit_log(primary):
    bad = (K / "kernels.ptx").read_text().replace("ret;", "this_is_not_ptx;", 1)
    with pytest.raises(CudaError) as exc:
        Module.load(bad.encode())
    assert "JIT error log" in str(exc.value) and "error" in str(exc.value).split("JIT error log")[1]


def test_unsupported_ptx_version_is_explained(primary):
    import re
    newer = re.sub(r"\.version \d+\.\d+", ".version 99.0", (K / "kernels.ptx").read_text(), count=1)
    with pytest.raises(CudaError) as exc:
        Module.load(newer.encode())
    assert exc.value.name in ("CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_PTX")
    if exc.value.name == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION":
        assert "99.0" in str(exc.value) and "PTX ISA" in str(exc.value)


def test_globals_and_attributes(module):
    counter = module.get_global("counter")
    value = np.zeros(1, np.int32)
    mem.copy(value, counter)
    assert value[0] == 42 and counter.nbytes == 4
    module.get_function("bump").launch(1, 1, (np.int32(5),))
    mem.copy(value, counter)
    assert value[0] == 47
    fn = module.get_function("VecAdd_kernel")
    assert fn.max_threads_per_block >= 256 and fn.num_registers > 0 and fn.shared_size_bytes == 0
    fn.max_dynamic_shared_size_bytes = 64 * 1024
    assert fn.max_dynamic_shared_size_bytes == 64 * 1024
    fn.set_cache_config("PREFER_L1")
    assert fn.max_active_blocks_per_sm(256) > 0
    grid, block = fn.suggested_block_size()
    assert grid > 0 and 0 < block <= 1024
    assert fn.param_info() == [(0, 8), (8, 8), (16, 8), (24, 4)]


@pytest.mark.parametrize("convention", ["params", "buffer"])
def test_guide_alignment_example_on_the_gpu(module, convention):
    out = DeviceBuffer(9 * 4)
    fn = module.get_function("guide_args")
    sig = ["int", "float4", "char", "float", "float*", "float2"]
    fn.launch(1, 1, (3, (1.5, 2.5, 3.5, 4.5), 7, 8.25, out, (9.5, 10.5)), signature=sig, convention=convention)
    host = np.zeros(9, np.float32)
    mem.copy(host, out)
    np.testing.assert_array_equal(host, [3, 1.5, 2.5, 3.5, 4.5, 7, 8.25, 9.5, 10.5])
    prepared = fn.prepare(sig, 1, 1, convention=convention)
    prepared(-4, np.array([0, 1, 2, 3], np.float32), 1, 0.5, out, (6, 7))
    mem.copy(host, out)
    np.testing.assert_array_equal(host, [-4, 0, 1, 2, 3, 1, 0.5, 6, 7])


def test_struct_float4_and_sixteen_mixed_arguments(module):
    dt = np.dtype([("mass", "f8"), ("id", "i4"), ("pos", "f4", 3)], align=True)
    out = DeviceBuffer(8 * 5)
    module.get_function("struct_arg").launch(1, 1, (np.array((2.5, 7, (1, 2, 3)), dt)[()], out))
    host = np.zeros(5)
    mem.copy(host, out)
    np.testing.assert_array_equal(host, [2.5, 7, 1, 2, 3])
    sig = ["char", "short", "int", "long long", "float", "double", "unsigned char", "unsigned short",
           "unsigned int", "unsigned long long", "float2", "float4", "int", "double", "char", "double*"]
    vals = [-3, 300, 70000, 1 << 40, 0.5, 0.25, 200, 60000, 4000000000, 1 << 50, (1.5, 2.5),
            (1.0, 2.0, 3.0, 4.0), -9, 1e-3, 12]
    module.get_function("mixed16").launch(1, 1, (*vals, out), signature=sig)
    mem.copy(host, out)
    expected = sum(v if not isinstance(v, tuple) else sum(v) for v in vals)
    assert host[0] == pytest.approx(expected, rel=1e-12)


def test_signature_checks_before_launch(module):
    fn = module.get_function("empty")
    with pytest.raises(InvalidValueError, match="takes 3 parameters"):
        fn.launch(1, 32, (np.int32(1), np.int32(2)))
    with pytest.raises(InvalidValueError, match="4 bytes"):
        fn.launch(1, 32, (0, 1, 2.0), signature=["float*", "int", "double"])
    with pytest.raises(InvalidValueError, match="signature"):
        fn.launch(1, 32, (0, 1, 2.0))                      # bare Python numbers


def test_cooperative_launches(module):
    fn = module.get_function("coop_sum")
    sms = Device(0).multiprocessor_count
    blocks = min(sms, fn.max_active_blocks_per_sm(64) * sms)
    data, out = DeviceBuffer(4 * blocks), DeviceBuffer(4)
    expected = blocks * (blocks + 1) // 2
    for how in ("cooperative", "launch_ex"):
        mem.memset(out, 0)
        if how == "cooperative":
            fn.launch(blocks, 64, (data, out), cooperative=True)
        else:
            L.launch_ex(fn, blocks, 64, (data, out), cooperative=True, priority=0)
        host = np.zeros(1, np.int32)
        mem.copy(host, out)
        assert host[0] == expected, how


def test_cluster_launch(module):
    if Device(0).compute_capability < (9, 0):
        pytest.skip("thread block clusters need compute capability 9.0")
    out = DeviceBuffer(4 * 8)
    L.launch_ex(module.get_function("cluster_rank"), 8, 32, (out,), cluster=(2, 1, 1))
    host = np.zeros(8, np.int32)
    mem.copy(host, out)
    np.testing.assert_array_equal(host, [0, 1] * 4)


def test_ptxjit_linking(primary):
    with Linker({"LOG_VERBOSE": 1}) as linker:
        linker.add_file(K / "ptxjit_a.ptx").add_data((K / "ptxjit_b.ptx").read_bytes(), "ptx", "b.ptx")
        cubin, result = linker.complete()
    assert cubin[:4] == b"\x7fELF" and result.wall_ms >= 0.0
    with Module.load(cubin) as m:
        data = np.arange(512, dtype=np.float32)
        with DeviceBuffer(data.nbytes) as d:
            mem.copy(d, data)
            m.get_function("ptxjit_kernel").launch(2, 256, (d, np.int32(512)))
            out = np.empty_like(data)
            mem.copy(out, d)
    np.testing.assert_array_equal(out, 3 * data + np.arange(512))


@pytest.mark.parametrize("requested", ["11.8", None])   # 11.8: no cuLibrary*, the per-context fallback
def test_library_in_primary_and_created_context(requested):
    drv = cuproc.Driver(requested) if requested else cuproc.driver.default_driver()
    lib = Library(K / "kernels.fatbin", driver=drv)
    assert lib.context_independent is (requested is None)
    kernel = lib.get_kernel("VecAdd_kernel")
    a = np.arange(256, dtype=np.float32)
    results = []
    primary = PrimaryContext(0, driver=drv)
    created = None
    for setup in ("primary", "created"):
        if setup == "primary":
            primary.__enter__()
        else:
            created = Context.create(0, driver=drv)
        with DeviceBuffer(a.nbytes, driver=drv) as d:
            mem.copy(d, a, driver=drv)
            kernel.launch(1, 256, (d, d, d, np.int32(256)))
            out = np.empty_like(a)
            mem.copy(out, d, driver=drv)
            results.append(out)
        assert kernel.function().handle is not None
        if setup == "primary":
            primary.__exit__(None, None, None)
        else:
            Context.pop(driver=drv)
            created.destroy()
    for out in results:
        np.testing.assert_array_equal(out, 2 * a)
    lib.unload()


def test_per_thread_default_stream_launches(primary):
    drv = cuproc.Driver(per_thread_default_stream=True)
    with Module.load(K / "kernels.fatbin", driver=drv) as m:
        a = np.arange(4096, dtype=np.float32)
        with DeviceBuffer(a.nbytes, driver=drv) as d:
            mem.copy(d, a, driver=drv)
            vec = m.get_function("VecAdd_kernel")
            prepared = vec.prepare(["float*", "float*", "float*", "int"], 16, 256)
            for _ in range(3):
                prepared(d, d, d, a.size)
            mem.copy(a, d, driver=drv)
    np.testing.assert_array_equal(a, np.arange(4096, dtype=np.float32) * 8)
    entry = prepared.entry
    assert drv.resolution(entry).entry_point == entry + "_ptsz"


@pytest.mark.parametrize("entry", ["cuLaunchKernelEx", "cuLaunchKernel", "one-shot"])
@pytest.mark.parametrize("convention", ["buffer", "params"])
def test_values_change_on_every_launch(module, entry, convention):
    """The generated launcher stores fresh values each call: N changes, only C[:N] is written."""
    vec = module.get_function("VecAdd_kernel")
    sig = ["float*", "float*", "float*", "int"]
    a, b = np.arange(4096, dtype=np.float32), np.full(4096, 0.5, np.float32)
    da, db, dc = DeviceBuffer(a.nbytes), DeviceBuffer(b.nbytes), DeviceBuffer(a.nbytes)
    mem.copy(da, a)
    mem.copy(db, b)
    prepared = None if entry == "one-shot" else vec.prepare(sig, 16, 256, convention=convention, entry=entry)
    for n in (4096, 1000, 17, 0):
        mem.memset(dc, 0)
        if prepared is None:
            vec.launch(16, 256, (da, db, dc.ptr, n), signature=sig, convention=convention)
        else:
            prepared(da, db, dc.ptr, n)
        c = np.empty_like(a)
        mem.copy(c, dc)
        np.testing.assert_array_equal(c[:n], a[:n] + b[:n])
        assert not c[n:].any()
    for buf in (da, db, dc):
        buf.free()
    with pytest.raises(InvalidValueError, match="freed"):
        (prepared or (lambda *v: vec.launch(16, 256, v, signature=sig)))(da, db, dc, 1)


@pytest.mark.multi_gpu
@pytest.mark.skipif(Device.count() < 2, reason="needs two GPUs")
def test_one_library_two_gpus():
    """The context-independent loading post: load once, launch the same CUkernel on two devices."""
    lib = Library(K / "kernels.fatbin")
    kernel = lib.get_kernel("VecAdd_kernel")
    a = np.arange(1024, dtype=np.float32)
    for ordinal in (0, 1):
        with PrimaryContext(ordinal):
            with DeviceBuffer(a.nbytes) as d:
                mem.copy(d, a)
                kernel.launch(4, 256, (d, d, d, np.int32(a.size)))
                out = np.empty_like(a)
                mem.copy(out, d)
            np.testing.assert_array_equal(out, 2 * a)
    lib.unload()


@pytest.mark.multi_gpu
@pytest.mark.skipif(Device.count() < 2, reason="needs two GPUs")
def test_a_thread_per_gpu_launches_and_copies_on_its_own_device():
    """One thread per device, each with its device's primary context, module, buffers and stream, their
    rounds interleaved: before each launch the current context is the thread's device's, every buffer it
    launches on lives on that device (cuPointerGetAttribute), and every result is right (NumPy)."""
    rounds, n = 40, 4096
    barrier, errors = threading.Barrier(2), []

    def work(ordinal: int) -> None:
        try:
            with PrimaryContext(ordinal):
                module = Module.load(K / "kernels.fatbin")
                add = module.get_function("VecAdd_kernel")
                stream = cuproc.Stream()
                with DeviceBuffer(4 * n) as a, DeviceBuffer(4 * n) as c:
                    for i in range(rounds):
                        barrier.wait(30)                              # both threads in each round
                        host = np.arange(n, dtype=np.float32) + 1000 * ordinal + i
                        mem.copy(a, host)
                        assert Context.current().device.ordinal == ordinal
                        assert {mem.pointer_attributes(b)["device_ordinal"] for b in (a, c)} == {ordinal}
                        add.launch(n // 256, 256, (a, a, c, np.int32(n)), stream=stream)
                        stream.synchronize()
                        out = np.empty_like(host)
                        mem.copy(out, c)
                        np.testing.assert_array_equal(out, 2 * host)
                stream.close()
                module.unload()
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            errors.append((ordinal, exc))
            barrier.abort()
    threads = [threading.Thread(target=work, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and errors == [], errors


def test_cached_one_shot_and_numpy_integer_launches_carry_every_value(module):
    """Issue 9's fast paths on the real driver: repeated one-shot launches (one cached entry, new values
    each time), NumPy integers stored straight into a prepared launch, and a signature-keyed entry."""
    counter = module.get_global("counter")
    start, value = np.zeros(1, np.int32), np.zeros(1, np.int32)
    mem.copy(start, counter)
    bump = module.get_function("bump")
    for i in range(1, 11):
        bump.launch(1, 1, (np.int32(i),))                      # cached by the class np.int32: 55 in all
    run = bump.prepare(["int"], 1, 1)
    for v in (np.int32(-3), np.int64(7), np.int16(2), 4):       # NumPy integers stored directly: +10
        run(v)
    for i in range(3):
        bump.launch(1, 1, (i,), signature=["int"])             # +3
    Context.current().synchronize()
    mem.copy(value, counter)
    assert value[0] - start[0] == 55 + 10 + 3
    with pytest.raises(InvalidValueError):
        run(np.int64(1 << 40))                                 # out of range for int: refused, not wrapped


def test_warm_one_shot_launches_through_the_c_front_carry_every_value(module):
    """With the fast path, warm fn.launch(grid, block, args) calls are made by the C front
    (cuproc.launch.launch.taken counts them); each launch's value still reaches the kernel."""
    counter = module.get_global("counter")
    start, value = np.zeros(1, np.int32), np.zeros(1, np.int32)
    mem.copy(start, counter)
    bump = module.get_function("bump")
    before = getattr(L.launch, "taken", None)                  # None: the pure path (no C front)
    for i in range(1, 21):
        bump.launch(1, 1, (np.int32(i),))                      # 210; the first makes the entry
    for i in range(1, 6):
        bump.launch(1, 1, (i,), signature=["int"])             # 15; the first makes the entry
    Context.current().synchronize()
    mem.copy(value, counter)
    assert value[0] - start[0] == 210 + 15
    if before is not None:
        assert L.launch.taken - before == 19 + 4


# launch_shape (kernels/kernels.cu) writes what reached it into its call's slot of SHAPE_WORDS words: the
# grid, the block, the dynamic shared memory size, slot + 1, then the blocks and the threads that ran.
SHAPE_WORDS = 10
SHAPE_SIG = ["unsigned long long*", "int"]
# Call k's dimensions: GRIDS[k % 7], BLOCKS[k % 5], SHARED[k % 9].  Each list holds more than four distinct
# values, so every call differs from each of the four before it in grid, block and shared memory alike: from
# the last call, from the last through the same entry (two forms in turn), and from the last through the same
# entry on the same thread (two threads in turn).  A launch that went out with an earlier call's value shows.
# The forms mix on purpose: exact ints (on the pure path, a call of exact ints after another stores only the
# fields that changed), tuples of 1-3 (y and z too), NumPy integers (with the fast path, the C launcher hands
# these calls to the pure one, so the same config is written by both in turn).
GRIDS = [3, (2, 3, 2), 5, 1, (4, np.int32(1), 3), 6, np.int64(2)]
BLOCKS = [64, 1024, (8, 4, 2), 256, 96]
SHARED = [0, 48 * 1024, 4096, 1000, 16 * 1024 + 4, np.int64(256), 32 * 1024, 8, 40000]


def _three(dims) -> tuple[int, ...]:
    """Grid or block dimensions as launch() reads them: (x, y, z), the missing ones 1."""
    dims = tuple(map(int, dims)) if isinstance(dims, tuple) else (int(dims),)
    return dims + (1,) * (3 - len(dims))


# what the tests rely on, above: more than four distinct values in each list
assert all(len({_three(d) for d in dims}) == len(dims) > 4 for dims in (GRIDS, BLOCKS)) \
    and len(set(map(int, SHARED))) == len(SHARED) > 4


def _launch_keywords(entry: str | None, convention: str) -> dict:
    """entry= and convention= where they are not the defaults: fn.launch(grid, block, args) with at most
    signature= and shared_mem= is the form the C front takes itself; any other keyword goes to the Python
    launch (both find the same entry, whose launcher takes the call's dimensions)."""
    return ({"entry": entry} if entry else {}) | ({"convention": convention} if convention != "buffer" else {})


def _launch_shape(fn, out, k: int, kw: dict) -> None:
    """Call k: slot k, k's dimensions; NumPy scalars (an entry keyed by classes) for k // 2 even, else
    ``signature=`` (an entry keyed by the signature)."""
    grid, block, shared = GRIDS[k % len(GRIDS)], BLOCKS[k % len(BLOCKS)], SHARED[k % len(SHARED)]
    if k // 2 % 2 == 0:
        fn.launch(grid, block, (out, np.int32(k)), shared_mem=shared, **kw)
    else:
        fn.launch(grid, block, (out, k), signature=SHAPE_SIG, shared_mem=shared, **kw)


def _check_shapes(out, calls: int) -> None:
    """Every call's slot holds its own grid, block, shared memory and count of blocks and threads run."""
    Context.current().synchronize()
    got = np.zeros((calls, SHAPE_WORDS), np.uint64)
    mem.copy(got, out)
    want = np.zeros_like(got)
    for k in range(calls):
        grid, block = _three(GRIDS[k % len(GRIDS)]), _three(BLOCKS[k % len(BLOCKS)])
        blocks = int(np.prod(grid))
        want[k] = (*grid, *block, int(SHARED[k % len(SHARED)]), k + 1, blocks, blocks * int(np.prod(block)))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("entry", [None, "cuLaunchKernelEx", "cuLaunchKernel"])
@pytest.mark.parametrize("convention", ["buffer", "params"])
def test_one_shot_dims_changing_on_every_launch_reach_the_kernel(module, entry, convention):
    """40 one-shot launches, each with a grid, block and shared memory size other than the four before, in
    two forms taking turns every two calls (NumPy scalars, signature=: two entries), through each entry
    point and convention: the kernel sees each call's own."""
    fn, calls, kw = module.get_function("launch_shape"), 40, _launch_keywords(entry, convention)
    before = getattr(L.launch, "taken", None)                  # None: the pure path (no C front)
    with DeviceBuffer(calls * SHAPE_WORDS * 8) as out:
        mem.memset(out, 0)
        for k in range(calls):
            _launch_shape(fn, out, k, kw)
        _check_shapes(out, calls)
    assert len(fn.launch_cache) == 2
    if before is not None and not kw:
        assert L.launch.taken - before == calls - 2            # all but each entry's first, by the C front


@pytest.mark.parametrize("together", [False, True], ids=["in-turn", "at-once"])
@pytest.mark.parametrize("entry", [None, "cuLaunchKernelEx", "cuLaunchKernel"])
@pytest.mark.parametrize("convention", ["buffer", "params"])
def test_one_shot_dims_from_a_second_thread_reach_the_kernel(module, entry, convention, together):
    """The main thread makes the even calls and owns both entries (it launches first through each); a
    second thread makes the odd ones through the same entries, with its own argument block and config.
    In turn: each call waits for the one before, so the owner's config and the private one each see dims
    other than their last.  At once: both threads launch freely, switching often.  Each call's slot holds
    its own dims."""
    fn, kw = module.get_function("launch_shape"), _launch_keywords(entry, convention)
    calls = 400 if together else 40
    todo: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()

    def second() -> None:
        for k in iter(todo.get, None):
            try:
                _launch_shape(fn, out, k, kw)
                done.put(None)
            except BaseException as exc:  # noqa: BLE001 - raised on the main thread
                done.put(exc)

    def second_done() -> None:
        error = done.get(timeout=60)
        if error is not None:
            raise error

    with DeviceBuffer(calls * SHAPE_WORDS * 8) as out:
        mem.memset(out, 0)
        _launch_shape(fn, out, 0, kw)                          # the main thread makes and owns both entries
        _launch_shape(fn, out, 2, kw)
        interval = sys.getswitchinterval()
        worker = threading.Thread(target=second)
        worker.start()
        try:
            if together:
                sys.setswitchinterval(1e-5)
                for k in range(1, calls, 2):
                    todo.put(k)
                for k in range(4, calls, 2):
                    _launch_shape(fn, out, k, kw)
                for _ in range(1, calls, 2):
                    second_done()
            else:
                for k in range(1, calls):                      # 1, 3, 4, 5, 6, ...
                    if k % 2:
                        todo.put(k)
                        second_done()
                    elif k > 2:
                        _launch_shape(fn, out, k, kw)
        finally:
            sys.setswitchinterval(interval)
            todo.put(None)
            worker.join()
        _check_shapes(out, calls)
    assert len(fn.launch_cache) == 2
