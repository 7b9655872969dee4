"""CUDA graphs (issue 36) on a real GPU, checked against NumPy: a captured mix of work replayed 1,000
times, the same work built node by node, kernel arguments changed on the executable graph, a WHILE
node, capture on the per-thread default stream, the graph functions at requested versions 11.8, 12.0,
12.4 and 13.0 (pointer identity with dlsym, and the whole graph layer on a handle pinned to each), the
DOT export against the driver's own, and bad input (what could crash runs in a fresh interpreter)."""
from __future__ import annotations

import gc
import os
import re
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, Event, Graph, Module, PinnedBuffer, Stream
from cuproc import loader
from cuproc import memory as mem
from cuproc.driver import Driver
from cuproc.errors import ClosedResourceError, CudaError, SymbolNotFoundError
from cuproc.graph import GraphUpdateError
from cuproc.graph_exec import in_flight_count
from cuproc.registry import default_registry
from cuproc.stream import CU_STREAM_PER_THREAD
from cuproc.stream_capture import capture, capture_info, capture_status
from rules import expected_entry, typedefs_by_symbol
from subproc import run_python

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
CUBIN = ROOT / "kernels" / "graph_kernels.fatbin"   # kernels.cu and the graph kernels, for every GPU
ffi = cuproc.ffi
N = 1 << 12
BLOCK = 256
GRID = (N + BLOCK - 1) // BLOCK
VADD = ["float*", "float*", "float*", "int"]


@pytest.fixture()
def kit(primary):
    class Kit:
        pass
    k = Kit()
    k.module = Module.load(CUBIN)
    k.vadd = k.module.get_function("VecAdd_kernel")
    k.fill = k.module.get_function("fill_value")
    k.stream = Stream()
    yield k
    k.stream.synchronize()


def host(buf, n=N, dtype=np.float32):
    out = np.zeros(n, dtype)
    mem.copy(out, buf, out.nbytes)
    return out


def pinned_with(values: np.ndarray, **where) -> PinnedBuffer:
    buf = PinnedBuffer(values.nbytes, **where)
    view = buf.numpy(values.dtype)
    view[:] = values
    del view                                      # (a live view refuses the buffer's free)
    return buf


# ----------------------------------------------------------------------------- capture and replay

def _mixed_work(kit, run, x, acc, tmp, src, stream):
    """One replay's work: tmp <- src (a copy of pinned memory), x <- 0 then 1.5 (memset, fill),
    acc += tmp (prepared launch), acc += x (one-shot launch)."""
    mem.copy(tmp, src, stream=stream)
    mem.memset(x, 0, stream=stream)
    kit.fill.launch(GRID, BLOCK, (x, np.int32(N), np.float32(1.5)), stream=stream)
    run(tmp, acc, acc, N)
    kit.vadd.launch(GRID, BLOCK, (x, acc, acc, np.int32(N)), stream=stream)


def test_capture_of_mixed_work_replayed_1000_times(kit):
    rng = np.random.default_rng(1)
    values = rng.random(N, dtype=np.float32).round(3)
    src = pinned_with(values)
    x, acc, tmp = DeviceBuffer(4 * N), DeviceBuffer(4 * N), DeviceBuffer(4 * N)
    mem.memset(acc, 0)
    run = kit.vadd.prepare(VADD, GRID, BLOCK, stream=kit.stream)
    with cuproc.capture(kit.stream) as graph:
        assert capture_status(kit.stream) == "active"
        _mixed_work(kit, run, x, acc, tmp, src, kit.stream)
    assert capture_status(kit.stream) == "none"
    assert sorted(n.type for n in graph.nodes) == ["kernel", "kernel", "kernel", "memcpy", "memset"]
    exe = graph.instantiate()
    expected = np.zeros(N, np.float32)
    for _ in range(1000):
        exe.launch(kit.stream)
        expected += values
        expected += np.float32(1.5)
    kit.stream.synchronize()
    np.testing.assert_allclose(host(acc), expected, rtol=1e-5)


def test_the_same_work_built_node_by_node(kit):
    rng = np.random.default_rng(2)
    values = rng.random(N, dtype=np.float32).round(3)
    src = pinned_with(values)
    x, acc, tmp = DeviceBuffer(4 * N), DeviceBuffer(4 * N), DeviceBuffer(4 * N)
    mem.memset(acc, 0)
    g = Graph()
    copy = g.add_memcpy(tmp, src)
    wipe = g.add_memset(x, 0, depends_on=copy)
    fill = g.add_kernel(kit.fill, GRID, BLOCK, (x, np.int32(N), np.float32(1.5)), depends_on=wipe)
    first = g.add_kernel(kit.vadd, GRID, BLOCK, (tmp, acc, acc, np.int32(N)), depends_on=fill)
    g.add_kernel(kit.vadd, GRID, BLOCK, (x, acc, acc, np.int32(N)), depends_on=first)
    exe = g.instantiate()
    del g, src, x, tmp                                  # the executable graph holds them
    gc.collect()
    for _ in range(1000):
        exe.launch(kit.stream)
    kit.stream.synchronize()
    np.testing.assert_allclose(host(acc), 1000 * (values + np.float32(1.5)), rtol=1e-4)


def test_kernel_arguments_change_on_the_executable_graph(kit):
    """A value, a buffer and a count change between launches; the graph itself does not."""
    a, b = DeviceBuffer(4 * N), DeviceBuffer(4 * N)
    mem.memset(a, 0)
    mem.memset(b, 0)
    g = Graph()
    node = g.add_kernel(kit.fill, GRID, BLOCK, (a, np.int32(N), np.float32(1.0)))
    before = node.params.arg_bytes
    exe = g.instantiate()
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(a), np.ones(N, np.float32))
    exe.set_kernel_args(node, (a, np.int32(N), np.float32(2.0)))
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(a), np.full(N, 2.0, np.float32))
    exe.set_kernel_args(node, (b, np.int32(N // 3), np.float32(3.0)))
    exe.launch(kit.stream)
    expected = np.zeros(N, np.float32)
    expected[:N // 3] = 3.0
    np.testing.assert_array_equal(host(b), expected)
    np.testing.assert_array_equal(host(a), np.full(N, 2.0, np.float32))
    assert node.params.arg_bytes == before


@pytest.mark.parametrize("k", [5, 0])
def test_while_node_runs_k_iterations(kit, k):
    set_condition = kit.module.get_function("set_condition")
    countdown = kit.module.get_function("countdown")
    state = DeviceBuffer(8)                               # [counter, iterations]
    mem.copy(state, np.array([k, 0], np.int32))
    g = Graph()
    handle = g.conditional_handle(default=0)
    first = g.add_kernel(set_condition, 1, 1, (handle, state))
    loop = g.add_while(handle, depends_on=first)
    loop.body.add_kernel(countdown, 1, 1, (handle, state, state.address + 4),
                         signature=["unsigned long long", "int*", "int*"])
    exe = g.instantiate()
    exe.launch(kit.stream)
    kit.stream.synchronize()
    assert host(state, 2, np.int32).tolist() == [0, k]
    mem.copy(state, np.array([3, 0], np.int32))
    exe.launch(kit.stream)
    kit.stream.synchronize()
    assert host(state, 2, np.int32).tolist() == [0, 3]


def test_if_else_node(kit):
    set_condition = kit.module.get_function("set_condition")
    out = DeviceBuffer(4 * N)
    for value, expected in ((1, 1.0), (0, 2.0)):
        state = DeviceBuffer(8)
        mem.copy(state, np.array([value, 0], np.int32))
        g = Graph()
        handle = g.conditional_handle()
        node = g.add_if_else(handle, depends_on=g.add_kernel(set_condition, 1, 1, (handle, state)))
        node.then_body.add_kernel(kit.fill, GRID, BLOCK, (out, np.int32(N), np.float32(1.0)))
        node.else_body.add_kernel(kit.fill, GRID, BLOCK, (out, np.int32(N), np.float32(2.0)))
        g.instantiate().launch(kit.stream)
        kit.stream.synchronize()
        np.testing.assert_array_equal(host(out), np.full(N, expected, np.float32))


def test_capture_on_the_per_thread_default_stream():
    drv = Driver(per_thread_default_stream=True)
    pc = cuproc.use_device(0, driver=drv)
    try:
        fill = Module.load(CUBIN, context=pc.context).get_function("fill_value")
        buf = DeviceBuffer(4 * N, context=pc.context)
        with capture(driver=drv) as graph:             # the handle's default stream: the per-thread one
            assert capture_status(driver=drv) == "active"
            mem.memset(buf, 0, stream=CU_STREAM_PER_THREAD)
            fill.launch(GRID, BLOCK, (buf, np.int32(N // 2), np.float32(4.0)), stream=CU_STREAM_PER_THREAD)
        exe = graph.instantiate()
        exe.launch(None)
        drv.check(drv.cuStreamSynchronize(CU_STREAM_PER_THREAD), "cuStreamSynchronize")
        expected = np.zeros(N, np.float32)
        expected[:N // 2] = 4.0
        np.testing.assert_array_equal(host(buf), expected)
        del exe, graph, buf, fill
        gc.collect()
    finally:
        drv.cuCtxSetCurrent(ffi.NULL)
        pc.release()


# ----------------------------------------------------------------------------- requested versions

def graph_symbols() -> list[str]:
    reg = default_registry()
    return sorted(n for n in reg if (n.startswith("cuGraph") and not n.startswith("cuGraphics"))
                  or "Capture" in n or n.startswith("cuUserObject"))


@pytest.fixture(scope="module")
def libcuda():
    return loader.open_library()


@pytest.mark.parametrize("per_thread", [False, True], ids=["legacy", "ptds"])
@pytest.mark.parametrize("requested", ["11.8", "12.0", "12.4", "13.0"])
def test_graph_functions_resolve_to_dlsym(libcuda, requested, per_thread):
    drv = Driver(requested, per_thread_default_stream=per_thread)
    typedefs = typedefs_by_symbol()
    wrong, declined, resolved = [], [], []
    for name in graph_symbols():
        entry = expected_entry(typedefs[name], name, int(drv.version), per_thread)
        res = drv.resolution(name)
        if entry is None:                       # not at R: a newer-driver feature, or nothing
            continue
        exported = libcuda.symbol_address(entry)
        if res.status == "resolved" and not res.newer_driver_feature:
            resolved.append(name)
            if res.entry_point != entry or int(ffi.cast("uintptr_t", res.function)) != exported:
                wrong.append((name, res.entry_point, entry))
        elif exported is not None:
            declined.append((name, res.status))
    assert not wrong, wrong
    assert not declined, declined
    assert {"cuGraphCreate", "cuGraphLaunch", "cuStreamBeginCapture", "cuGraphAddKernelNode"} <= set(resolved)


def exercise(drv: Driver) -> dict:
    """The graph layer on a handle pinned to ``drv.version``: explicit graph, instantiate, launch, update,
    kernel arguments, capture and its queries, DOT, and conditional nodes where the version has them."""
    seen: dict = {}
    pc = cuproc.use_device(0, driver=drv)
    try:
        _exercise(drv, pc.context, seen)          # (everything it made is gone when it returns)
        gc.collect()
    finally:
        drv.cuCtxSetCurrent(ffi.NULL)
        pc.release()
    return seen


def _exercise(drv: Driver, ctx: cuproc.Context, seen: dict) -> None:
    module = Module.load(CUBIN, context=ctx)
    vadd, fill = module.get_function("VecAdd_kernel"), module.get_function("fill_value")
    stream = Stream(context=ctx)
    values = np.arange(N, dtype=np.float32)
    src = pinned_with(values, context=ctx)
    a, b, c = (DeviceBuffer(4 * N, context=ctx) for _ in range(3))
    g = Graph(context=ctx)
    copy = g.add_memcpy(a, src)
    ones = g.add_kernel(fill, GRID, BLOCK, (b, np.int32(N), np.float32(1.0)))
    add = g.add_kernel(vadd, GRID, BLOCK, (a, b, c, np.int32(N)), depends_on=[copy, ones])
    calls: list = []
    g.add_host(lambda: calls.append(1), depends_on=add)
    rec = g.add_event_record(Event(timing=False, context=ctx), depends_on=add)
    child = Graph(context=ctx)
    child.add_memset(b, 0)
    g.add_child_graph(child, depends_on=rec)
    assert set(add.dependencies) == {copy, ones} and len(g.edges) == 5
    exe = g.instantiate()
    exe.upload(stream)
    exe.launch(stream)
    stream.synchronize()
    np.testing.assert_array_equal(host(c), values + 1)
    assert calls == [1] and host(b).sum() == 0
    exe.set_kernel_args(add, (a, a, c, np.int32(N)))
    exe.launch(stream)
    stream.synchronize()
    np.testing.assert_array_equal(host(c), 2 * values)
    g2 = Graph(context=ctx)
    g2.add_kernel(vadd, GRID, BLOCK, (a, a, c, np.int32(N)))
    with pytest.raises(GraphUpdateError):
        exe.update(g2)
    with cuproc.capture(stream, mode="relaxed") as captured:
        info = capture_info(stream)
        seen["capture_info"] = (info.status, info.dependencies)
        vadd.launch(GRID, BLOCK, (a, a, c, np.int32(N)), stream=stream)
    captured_exe = captured.instantiate()
    captured_exe.update(g2)                       # the same shape: applies
    captured_exe.launch(stream)
    stream.synchronize()
    seen["dot"] = [g.to_dot() == drivers_dot(drv, g, 0), g.to_dot(verbose=True) == drivers_dot(drv, g, 1),
                   g.to_dot(flags=["KERNEL_NODE_PARAMS", "HANDLES"]) == drivers_dot(drv, g, 4 | 1024)]
    if drv.has("cuGraphConditionalHandleCreate", newer_driver_features=False):
        state = DeviceBuffer(8, context=ctx)
        mem.copy(state, np.array([4, 0], np.int32))
        w = Graph(context=ctx)
        handle = w.conditional_handle(default=0)
        first = w.add_kernel(module.get_function("set_condition"), 1, 1, (handle, state))
        loop = w.add_while(handle, depends_on=first)
        loop.body.add_kernel(module.get_function("countdown"), 1, 1, (handle, state, state.address + 4),
                             signature=["unsigned long long", "int*", "int*"])
        w.instantiate().launch(stream)
        stream.synchronize()
        seen["while"] = host(state, 2, np.int32).tolist()
    else:
        with pytest.raises(SymbolNotFoundError):
            Graph(context=ctx).conditional_handle()
        seen["while"] = None
    stream.synchronize()


@pytest.mark.parametrize("requested", ["11.8", "12.0", "12.4", "13.0"])
def test_the_graph_layer_on_a_handle_pinned_to(requested):
    drv = Driver(requested)
    seen = exercise(drv)
    status, deps = seen["capture_info"]
    assert status == "active" and deps == ()
    assert seen["dot"] == [True, True, True]
    has_conditionals = drv.version >= cuproc.CudaVersion(12, 3)
    assert seen["while"] == ([0, 4] if has_conditionals else None)
    instantiate = drv.resolution("cuGraphInstantiateWithParams")
    assert (instantiate.status == "resolved" and not instantiate.newer_driver_feature) == \
        (drv.version >= cuproc.CudaVersion(12, 0))


# ----------------------------------------------------------------------------- the picture

def test_dot_has_one_statement_per_kernel_node_as_the_drivers_own(kit):
    a = DeviceBuffer(4 * N)
    g = Graph()
    prev = None
    for i in range(5):
        prev = g.add_kernel(kit.fill, GRID, BLOCK, (a, np.int32(N), np.float32(i)), depends_on=prev)
    g.add_memset(a, 0, depends_on=prev)
    dot = g.to_dot()
    drv = cuproc.driver.default_driver()
    assert dot == drivers_dot(drv, g, 0)
    # the flags reach the driver as the C enum's values: CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE = 1,
    # KERNEL_NODE_PARAMS = 4, HANDLES = 1024 (each form against the driver's own DOT of the same handle)
    assert g.to_dot(verbose=True) == drivers_dot(drv, g, 1) != dot
    flagged = g.to_dot(flags=["KERNEL_NODE_PARAMS", "CU_GRAPH_DEBUG_DOT_FLAGS_HANDLES"])
    assert flagged == drivers_dot(drv, g, 4 | 1024) != dot
    assert g.to_dot(flags=1024) == drivers_dot(drv, g, 1024)
    statements = re.findall(r'^"[^"]+"\s*\[(.*?)\];?\s*$', dot, re.M | re.S)   # node statements (no edges)
    assert len(statements) == 6
    assert sum("fill_value" in s for s in statements) == 5
    assert len(g.to_dot(verbose=True)) > len(dot)


def drivers_dot(drv: Driver, graph: Graph, flags: int) -> str:
    """The driver's own DOT of ``graph``'s handle (cuGraphDebugDotPrint called directly with ``flags``)."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        drv.check(drv.cuGraphDebugDotPrint(graph.handle, path.encode(), flags), "cuGraphDebugDotPrint")
        return Path(path).read_text()
    finally:
        os.unlink(path)


# ----------------------------------------------------------------------------- lifetimes the driver sees

def test_a_launch_keeps_its_host_node_after_the_graph_and_executable_graph_are_dropped(kit):
    """The driver calls host nodes later, from its own thread: the executable graph and its graph dropped
    right after the launch (behind a kernel that keeps the GPU busy), the callable still runs, once; an
    exception it raises is a warning at the next synchronize and kept on the node, never lost."""
    calls: list[int] = []
    a = DeviceBuffer(4 * N)
    g = Graph()
    prev = None
    for i in range(64):                                # the GPU is busy when the host node is reached
        prev = g.add_kernel(kit.fill, GRID, BLOCK, (a, np.int32(N), np.float32(i)), depends_on=prev)
    g.add_host(lambda: calls.append(1), depends_on=prev)
    exe = g.instantiate()
    exe.launch(kit.stream)
    del exe, g, prev                                   # (a node object holds its graph)
    gc.collect()
    kit.stream.synchronize()
    gc.collect()
    assert calls == [1]
    assert in_flight_count() == 0

    def boom():
        raise RuntimeError("in a host node")
    g = Graph()
    node = g.add_host(boom)
    exe = g.instantiate()
    with pytest.warns(cuproc.CudaWarning, match="host node raised RuntimeError"):
        exe.launch(kit.stream)
        kit.stream.synchronize()
    assert [str(e) for e in node.errors] == ["in a host node"]


def test_error_nodes_are_found_in_child_graphs(kit):
    """cuGraphExecUpdate names a node inside the new graph's child graph (the driver's copy, which cuproc
    did not add): the error's node is that node, read from the driver."""
    a = DeviceBuffer(4 * N)
    child = Graph()
    child.add_memset(a, 0)
    first = Graph()
    first.add_child_graph(child)
    other = Graph()
    other.add_kernel(kit.fill, GRID, BLOCK, (a, np.int32(N), np.float32(1.0)))
    second = Graph()
    outer = second.add_child_graph(other)
    exe = first.instantiate()
    with pytest.raises(GraphUpdateError) as info:
        exe.update(second)
    inner = outer.child_graph.nodes
    # the driver documents errorNode as a node of the new graph; whether it names the child graph node or the
    # node inside its copy, cuproc must find it (before, a node inside a child graph was not looked for)
    node = info.value.node
    assert node is not None and (node == outer or node in inner), (info.value.reason, node)


def test_nodes_cuproc_did_not_add_are_read_from_the_driver(kit):
    """A captured graph and a child graph's copy: node kinds, a child graph node's graph and its nodes come
    from the driver; the views own nothing."""
    a = DeviceBuffer(4 * N)
    inner = Graph()
    inner.add_kernel(kit.fill, GRID, BLOCK, (a, np.int32(N), np.float32(5.0)))
    middle = Graph()
    middle.add_child_graph(inner)
    g = Graph()
    outer = g.add_child_graph(middle)
    (copy,) = outer.child_graph.nodes
    assert copy.type == "graph"
    (kernel,) = copy.child_graph.nodes
    assert kernel.type == "kernel" and kernel.params.grid == (GRID, 1, 1)
    with pytest.raises(cuproc.InvalidValueError, match="belongs to its node"):
        copy.child_graph.close()
    g.instantiate().launch(kit.stream)
    kit.stream.synchronize()
    np.testing.assert_array_equal(host(a), np.full(N, 5.0, np.float32))


def test_a_graph_of_another_library_is_adopted(kit):
    """A CUgraph built through the raw C names: Graph.from_handle reads its nodes from the driver, instantiates
    and launches it, and never destroys it (its owner does)."""
    drv = cuproc.driver.default_driver()
    a = DeviceBuffer(4 * N)
    raw, node = ffi.new("CUgraph *"), ffi.new("CUgraphNode *")
    drv.check(drv.cuGraphCreate(raw, 0), "cuGraphCreate")
    p = ffi.new("CUDA_MEMSET_NODE_PARAMS_v1 *")
    p.dst, p.value, p.elementSize, p.width, p.height, p.pitch = a.address, 7, 1, 4 * N, 1, 4 * N
    drv.check(drv.cuGraphAddMemsetNode(node, raw[0], ffi.NULL, 0, p, cuproc.Context.current().handle),
              "cuGraphAddMemsetNode")
    g = Graph.from_handle(raw[0], owner=raw)
    assert [n.type for n in g.nodes] == ["memset"] and g.nodes[0].params.value == 7
    g.instantiate().launch(kit.stream)
    kit.stream.synchronize()
    assert (host(a, 4 * N, np.uint8) == 7).all()
    g.close()
    drv.check(drv.cuGraphDestroy(raw[0]), "cuGraphDestroy")   # still the owner's: not destroyed by close()


def test_a_conditional_node_cuproc_did_not_add_shows_its_bodies_where_the_driver_can(kit):
    """A WHILE node inside a child graph's copy: its bodies come from cuGraphNodeGetParams (CUDA 13.2) where
    the requested version has it; before, the dispatcher's error names that call."""
    drv = cuproc.driver.default_driver()
    if not drv.has("cuGraphConditionalHandleCreate", newer_driver_features=False):
        pytest.skip("no conditional nodes at this driver's version")
    child = Graph()
    handle = child.conditional_handle(default=0)
    child.add_while(handle).body.add_empty()
    g = Graph()
    try:
        outer = g.add_child_graph(child)
    except CudaError as exc:
        pytest.skip(f"this driver takes no conditional node in a child graph: {exc}")
    (copy,) = outer.child_graph.nodes
    assert copy.type == "conditional"
    if drv.has("cuGraphNodeGetParams", newer_driver_features=False):
        assert copy.kind == "while" and [n.type for n in copy.body.nodes] == ["empty"]
    else:
        with pytest.raises(SymbolNotFoundError, match="cuGraphNodeGetParams"):
            copy.body


def test_a_prepared_replay_launches_the_graph(kit):
    a = DeviceBuffer(4 * N)
    mem.memset(a, 0)
    g = Graph()
    g.add_kernel(kit.vadd, GRID, BLOCK, (a, kit_ones(kit), a, np.int32(N)))
    exe = g.instantiate()
    replay = exe.replay(kit.stream)
    for _ in range(100):
        replay()
    kit.stream.synchronize()
    np.testing.assert_array_equal(host(a), np.full(N, 100.0, np.float32))
    exe.destroy()
    with pytest.raises(ClosedResourceError):        # before the driver sees the destroyed handle
        replay()


def kit_ones(kit) -> DeviceBuffer:
    ones = DeviceBuffer(4 * N)
    kit.fill.launch(GRID, BLOCK, (ones, np.int32(N), np.float32(1.0)), stream=kit.stream)
    kit.stream.synchronize()
    kit.keep = ones
    return ones


# ----------------------------------------------------------------------------- bad input

def test_launching_after_destroy_is_refused(kit):
    g = Graph()
    g.add_kernel(kit.fill, 1, 1, (DeviceBuffer(4), np.int32(1), np.float32(1.0)))
    exe = g.instantiate()
    exe.destroy()
    with pytest.raises(ClosedResourceError, match="destroyed"):
        exe.launch(kit.stream)
    g.destroy()
    with pytest.raises(ClosedResourceError, match="destroyed"):
        g.instantiate()


def test_an_update_that_cannot_apply(kit):
    a = DeviceBuffer(4 * N)
    g = Graph()
    g.add_kernel(kit.fill, GRID, BLOCK, (a, np.int32(N), np.float32(1.0)))
    exe = g.instantiate()
    other = Graph()
    m = other.add_memset(a, 0)
    with pytest.raises(GraphUpdateError) as info:
        exe.update(other)
    # the C semantics: the exec's one node is a kernel, the new graph's a memset -- the node type changed,
    # and cuGraphExecUpdate's errorNode is the node of the new graph (CUgraphExecUpdateResultInfo)
    assert info.value.reason == "CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED" and info.value.node == m
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(a), np.ones(N, np.float32))


def test_capture_on_the_legacy_stream_is_refused(primary):
    with pytest.raises(CudaError, match="legacy default stream cannot be captured") as info:
        capture(None, driver=Driver(per_thread_default_stream=False))
    assert info.value.refused


def test_exception_and_invalidation_in_a_capture_in_a_subprocess():
    """Both end the capture, discard the graph and raise; the stream works afterwards; the process exits
    cleanly (cuda.core's users reported crashes here: cuda-python #2918, #2834)."""
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}]
        import numpy as np
        import cuproc
        from cuproc import memory as mem
        pc = cuproc.use_device(0)
        fill = cuproc.Module.load({str(CUBIN)!r}).get_function("fill_value")
        s = cuproc.Stream()
        buf = cuproc.DeviceBuffer(4 * 256)
        try:
            with cuproc.capture(s) as g1:
                fill.launch(1, 256, (buf, np.int32(256), np.float32(1.0)), stream=s)
                raise KeyError("inside")
        except KeyError:
            pass
        assert "discarded" in g1.ended
        try:
            with cuproc.capture(s) as g2:
                fill.launch(1, 256, (buf, np.int32(256), np.float32(1.0)), stream=s)
                try:
                    cuproc.DeviceBuffer(64)          # cuMemAlloc: not allowed during a global capture
                except cuproc.CudaError as exc:
                    print("refused", exc.call, exc.name)
                try:
                    s.synchronize()
                except cuproc.CudaError as exc:
                    print("refused", exc.call, exc.name)
        except cuproc.CudaError as exc:
            print("ended", exc.call, exc.name)
        assert "discarded" in g2.ended
        with cuproc.capture(s) as g3:
            fill.launch(1, 256, (buf, np.int32(256), np.float32(3.0)), stream=s)
        g3.instantiate().launch(s)
        out = np.zeros(256, np.float32)
        mem.copy(out, buf)
        print("result", float(out.sum()))
        lost = cuproc.Stream()
        cm = cuproc.capture(lost)
        cm.__enter__()                                # a capture never ended: left to the process exit
    """)
    proc = run_python(code, timeout=120)
    assert "result 768.0" in proc.stdout
    assert "ended cuStreamEndCapture CUDA_ERROR_STREAM_CAPTURE_INVALIDATED" in proc.stdout
    assert "refused" in proc.stdout


def test_conditional_nodes_before_12_3_are_refused():
    drv = Driver("12.0")
    pc = cuproc.use_device(0, driver=drv)
    try:
        g = Graph(context=pc.context)
        with pytest.raises(SymbolNotFoundError, match="12.0"):
            g.conditional_handle(default=1)
        del g
    finally:
        drv.cuCtxSetCurrent(ffi.NULL)
        pc.release()


# ----------------------------------------------------------------------------- issue 36's leftovers

def _capture_allocating(kit, value):
    with capture(kit.stream) as g:
        buf = mem.alloc_async(4 * N, kit.stream)
        kit.fill.launch(GRID, BLOCK, (buf, np.int32(N), np.float32(value)), stream=kit.stream)
    return g, buf


def test_a_captured_allocation_exists_from_a_launch_until_it_is_freed(kit):
    from cuproc.errors import InvalidValueError
    from cuproc.graph_nodes import GraphAllocation
    g, buf = _capture_allocating(kit, 7.0)
    assert isinstance(buf, GraphAllocation) and not buf.allocated
    with pytest.raises(ClosedResourceError):
        mem.memset(buf, 0, stream=kit.stream)
    with pytest.raises(InvalidValueError):
        buf.free_async()
    exe = g.instantiate()
    for value in (7.0, 7.0):
        exe.launch(kit.stream)
        kit.stream.synchronize()
        np.testing.assert_array_equal(host(buf), np.full(N, value, np.float32))
        with pytest.raises(InvalidValueError):
            exe.launch(kit.stream)                   # refused by cuproc before the driver (see the next test)
        buf.free_async()
    kit.stream.synchronize()
    del buf
    gc.collect()
    exe.launch(kit.stream)                           # a dropped allocation: freed after each launch
    exe.launch(kit.stream)
    kit.stream.synchronize()


def test_the_driver_refuses_a_relaunch_with_an_unfreed_graph_allocation(kit):
    """What cuproc's refusal stands for (cuGraphLaunch's documentation): checked on the raw call."""
    g, buf = _capture_allocating(kit, 1.0)
    exe = g.instantiate()
    exe.launch(kit.stream)
    drv = kit.stream.context.driver
    assert drv.cuGraphLaunch(exe.handle, kit.stream.handle) != 0
    buf.free_async()
    assert drv.cuGraphLaunch(exe.handle, kit.stream.handle) == 0     # freed: the driver launches it again
    kit.stream.synchronize()
    assert drv.cuMemFreeAsync(buf.address, kit.stream.handle) == 0   # (that launch's allocation, raw)
    kit.stream.synchronize()


def test_auto_free_on_launch_relaunches_a_graph_allocation(kit):
    g, buf = _capture_allocating(kit, 4.0)
    exe = g.instantiate(flags="AUTO_FREE_ON_LAUNCH")
    for _ in range(3):
        exe.launch(kit.stream)
        kit.stream.synchronize()
        np.testing.assert_array_equal(host(buf), np.full(N, 4.0, np.float32))
    buf.free_async()
    kit.stream.synchronize()


def test_pool_memory_freed_inside_a_capture_is_refused_and_stays_usable(kit):
    pre = mem.alloc_async(4 * N, kit.stream)
    with pytest.raises(CudaError):
        with capture(kit.stream):
            pre.free_async()                         # cuMemFreeAsync during a capture takes graph memory only
    assert pre.ended is None and capture_status(kit.stream) == "none"
    mem.memset(pre, 1, stream=kit.stream)
    pre.free_async()
    kit.stream.synchronize()


def test_kernel_args_set_through_the_nodes_of_the_updated_graph(kit):
    a, c = DeviceBuffer(4 * N), DeviceBuffer(4 * N)
    g1 = Graph()
    g1.add_kernel(kit.fill, GRID, BLOCK, (a, np.int32(N), np.float32(1.0)))
    exe = g1.instantiate()
    g2 = Graph()
    n2 = g2.add_kernel(kit.fill, GRID, BLOCK, (c, np.int32(N), np.float32(2.0)))
    exe.update(g2)
    exe.set_kernel_args(n2, (c, np.int32(N), np.float32(6.0)))      # the driver is given g1's node
    exe.launch(kit.stream)
    kit.stream.synchronize()
    np.testing.assert_array_equal(host(c), np.full(N, 6.0, np.float32))
