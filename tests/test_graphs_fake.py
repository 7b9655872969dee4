"""CUDA graphs in the object layer (issue 36) on the stateful fake driver: capture, explicit graphs,
instantiation at each ABI, launch results, updates, executable-graph kernel arguments, conditional nodes,
the DOT picture, lifetimes, and bad input.

The fake (tests/fakedriver_graphs.c) runs a graph's copies and memsets for real bytes and gives four
kernels their GPU namesakes' effect inside graphs (VecAdd_kernel, fill_value, set_condition,
countdown), so results are checked against NumPy here as on the GPU.  The ``fk`` fixture checks that
nothing stale, unordered or misrouted reached the fake; ``graphs`` checks that no graph or executable
graph is left once the test's objects are gone.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import textwrap
import warnings
import weakref

import numpy as np
import pytest

import cuproc
from cuproc import Context, DeviceBuffer, Event, Graph, Module, Stream
from cuproc import memory as mem
from cuproc.errors import ClosedResourceError, CudaError, CudaWarning, InvalidValueError, SymbolNotFoundError
from cuproc.graph import GraphInstantiateError, GraphUpdateError
from cuproc.graph_exec import in_flight_count
from cuproc.graph_nodes import (ChildGraphNode, ConditionalNode, EmptyNode, EventRecordNode, EventWaitNode, HostNode,
                                KernelNode, MemAllocNode, MemcpyNode, MemFreeNode, MemsetNode)
from cuproc.launch import pack_bytes
from cuproc.stream import CU_STREAM_PER_THREAD
from cuproc.stream_capture import capture, capture_info, capture_status

from fakedriver import child_preamble, fake_image
from subproc import run_python

ffi = cuproc.ffi
N = 64
VADD = ["float*", "float*", "float*", "int"]
FILL = ["float*", "int", "float"]
IMAGE = fake_image({"VecAdd_kernel": [8, 8, 8, 4], "fill_value": [8, 4, 4], "set_condition": [8, 8],
                    "countdown": [8, 8, 8], "empty": [8, 4, 4]})
UNSUPPORTED, INVALIDATED = 900, 901


class Graphs:
    """The fake's graph counters (fake_graph_live and friends)."""

    def __init__(self, fake):
        self.lib = fake.lib
        self.lib.fake_graph_live.restype = ctypes.c_long
        self.lib.fake_graph_live.argtypes = [ctypes.c_char_p]
        self.lib.fake_graph_launches.restype = ctypes.c_long
        self.lib.fake_conditional_value.restype = ctypes.c_long
        self.lib.fake_conditional_value.argtypes = [ctypes.c_ulonglong]
        self.lib.fake_run_host_work.restype = ctypes.c_long
        self.lib.fake_host_work_pending.restype = ctypes.c_long

    def live(self, kind: str) -> int:
        n = self.lib.fake_graph_live(kind.encode())
        assert n >= 0, kind
        return n

    def launches(self) -> int:
        return self.lib.fake_graph_launches()

    def condition(self, handle: int) -> int:
        return self.lib.fake_conditional_value(int(handle))

    def pending_host_work(self) -> int:
        """Host calls a graph launch queued that have not run yet (the fake runs them at a synchronize)."""
        return self.lib.fake_host_work_pending()


@pytest.fixture()
def graphs(fk):
    """The fake's graph state, fresh; afterwards (every object of the test collected) no graph, executable
    graph or capture is left in the fake -- cuproc gave back all it made."""
    g = Graphs(fk)
    g.lib.fake_graph_reset()
    yield g
    gc.collect()
    left = {kind: g.live(kind) for kind in ("graph", "graph_exec", "capture")}
    g.lib.fake_graph_reset()
    assert left == {"graph": 0, "graph_exec": 0, "capture": 0}, left


@pytest.fixture()
def kit(pc, graphs):
    """Device 0's primary context current, the fake kernels loaded, three buffers of N floats (a = 0..N-1,
    b = 1, c = 0) and a stream."""
    class Kit:
        pass
    k = Kit()
    k.graphs, k.pc, k.ctx = graphs, pc, pc.context
    k.module = Module.load(IMAGE)
    k.vadd = k.module.get_function("VecAdd_kernel")
    k.fill = k.module.get_function("fill_value")
    k.a, k.b, k.c = (DeviceBuffer(4 * N) for _ in range(3))
    mem.copy(k.a, np.arange(N, dtype=np.float32))
    mem.copy(k.b, np.ones(N, np.float32))
    mem.memset(k.c, 0)
    k.stream = Stream()
    yield k
    k.stream.synchronize()


def handle_of(obj) -> int:
    return int(ffi.cast("uintptr_t", obj.handle))


def host(buf, n=N, dtype=np.float32):
    out = np.zeros(n, dtype)
    mem.copy(out, buf, out.nbytes)
    return out


# ----------------------------------------------------------------------------- the ABI the fake and cuproc share

def test_struct_sizes_are_the_fakes():
    """The parameter structs cuproc fills are the sizes tests/fakedriver_graphs.c asserts for its own."""
    sizes = {"CUDA_KERNEL_NODE_PARAMS_v2": 72, "CUDA_MEMSET_NODE_PARAMS_v1": 40, "CUDA_HOST_NODE_PARAMS_v1": 16,
             "CUmemPoolProps": 88, "CUDA_MEM_ALLOC_NODE_PARAMS": 120, "CUDA_CONDITIONAL_NODE_PARAMS": 32,
             "CUgraphNodeParams": 256, "CUgraphEdgeData": 8, "CUDA_GRAPH_INSTANTIATE_PARAMS": 32,
             "CUgraphExecUpdateResultInfo": 24, "CUDA_MEMCPY3D_v2": 200}
    assert {name: ffi.sizeof(name) for name in sizes} == sizes
    assert ffi.offsetof("CUgraphNodeParams", "conditional") == 16


# ----------------------------------------------------------------------------- explicit graphs

def test_explicit_graph_runs_and_matches_numpy(kit):
    g = Graph()
    fill = g.add_kernel(kit.fill, 1, N, (kit.b, np.int32(N), np.float32(2.5)))
    add = g.add_kernel(kit.vadd, 1, N, (kit.a, kit.b, kit.c, np.int32(N)), depends_on=fill)
    pinned = cuproc.PinnedBuffer(4 * N)
    back = g.add_memcpy(pinned, kit.c, depends_on=add)
    wipe = g.add_memset(kit.a, 0, element_bits=32, depends_on=back)
    seen = []
    note = g.add_host(lambda: seen.append(1), depends_on=wipe)
    assert [type(n) for n in g.nodes] == [KernelNode, KernelNode, MemcpyNode, MemsetNode, HostNode]
    assert g.root_nodes == [fill]
    assert g.edges == [(fill, add), (add, back), (back, wipe), (wipe, note)]
    assert add.dependencies == [fill] and add.dependents == [back] and fill.dependencies == []
    exe = g.instantiate()
    exe.launch(kit.stream)
    kit.stream.synchronize()
    expected = np.arange(N, dtype=np.float32) + 2.5
    np.testing.assert_array_equal(host(kit.c), expected)
    np.testing.assert_array_equal(pinned.numpy(np.float32), expected)
    np.testing.assert_array_equal(host(kit.a), np.zeros(N, np.float32))
    assert seen == [1] and kit.graphs.launches() == 1


def test_dependencies_can_be_added_and_removed(kit):
    g = Graph()
    x, y, z = g.add_empty(), g.add_empty(), g.add_empty()
    assert isinstance(x, EmptyNode) and g.edges == []
    z.add_dependencies(x, y)
    assert set(z.dependencies) == {x, y} and x.dependents == [z]
    g.add_dependencies([x], [y])
    assert y.dependencies == [x]
    z.remove_dependencies(x)
    assert z.dependencies == [y]
    assert g.root_nodes == [x]
    other = Graph()
    with pytest.raises(InvalidValueError, match="not a node of"):
        z.add_dependencies(other.add_empty())
    with pytest.raises(InvalidValueError, match="depends_on takes graph nodes"):
        g.add_empty(depends_on=[kit.a])


def test_kernel_node_packs_exactly_as_a_launch(kit):
    """The node's argument bytes are the launch code's, and KernelNode.params reads them back."""
    empty = kit.module.get_function("empty")
    args = (kit.a, np.int32(7), np.float32(1.5))
    g = Graph()
    node = g.add_kernel(empty, 2, 32, args)
    assert node.params.arg_bytes == pack_bytes(FILL, args)
    assert node.params.grid == (2, 1, 1) and node.params.block == (32, 1, 1) and node.params.function is empty
    assert node.params.shared_mem == 0 and node.graph is g and node.type == "kernel"


def test_kernel_node_bytes_reach_the_fake_as_a_launchs(kit, fk):
    empty = kit.module.get_function("empty")
    args = (kit.a, np.int32(7), np.float32(1.5))
    empty.prepare(FILL, 2, 32, stream=kit.stream)(*args)
    direct = fk.last_launch()
    g = Graph()
    g.add_kernel(empty, 2, 32, args)
    g.instantiate().launch(kit.stream)
    assert fk.last_launch() == direct == ("empty", pack_bytes(FILL, args))
    assert fk.last_launch_config()[:2] == ((2, 1, 1), (32, 1, 1))


def test_kernel_node_with_signature_and_a_library_kernel(kit, fk):
    lib = cuproc.Library(IMAGE)
    kernel = lib.get_kernel("fill_value")
    g = Graph()
    node = g.add_kernel(kernel, 1, N, (kit.c, N, 4.0), signature=FILL)   # plain Python numbers: the signature
    assert node.params.function.context is kit.ctx
    g.instantiate().launch(kit.stream)
    np.testing.assert_array_equal(host(kit.c), np.full(N, 4.0, np.float32))


def test_node_params_read_and_set(kit, fk):
    g = Graph()
    k = g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(1.0)))
    m = g.add_memset(kit.a, 7, 4, depends_on=k)
    assert (m.params.dst, m.params.value, m.params.elementSize, m.params.width) == (kit.a.address, 7, 1, 4)
    k.set_params((kit.c, np.int32(N // 2), np.float32(9.0)), block=32)
    m.set_params(kit.a, 0x01020304, N, element_bits=32)
    assert k.params.block == (32, 1, 1) and k.params.arg_bytes == pack_bytes(FILL, (kit.c, N // 2, 9.0))
    assert m.params.elementSize == 4
    cp = g.add_memcpy(kit.b, kit.c, depends_on=m)
    assert cp.params.WidthInBytes == 4 * N
    cp.set_params(kit.b, kit.a, 16)
    calls = []
    h = g.add_host(lambda: calls.append("first"), depends_on=cp)
    h.set_params(lambda: calls.append("second"))
    ev = Event(timing=False)
    rec = g.add_event_record(ev, depends_on=h)
    wait = g.add_event_wait(ev, depends_on=rec)
    assert isinstance(rec, EventRecordNode) and isinstance(wait, EventWaitNode)
    assert rec.event is ev and wait.event is ev
    ev2 = Event()
    rec.set_event(ev2)
    assert rec.event is ev2
    g.instantiate().launch(kit.stream)
    kit.stream.synchronize()
    expected = np.zeros(N, np.float32)
    expected[:N // 2] = 9.0
    np.testing.assert_array_equal(host(kit.c), expected)
    assert host(kit.a, dtype=np.uint32)[0] == 0x01020304
    assert host(kit.b, dtype=np.uint32)[:4].tolist() == [0x01020304] * 4
    assert calls == ["second"]


def test_child_graph_and_memory_nodes(kit):
    child = Graph()
    child.add_memset(kit.c, 0x3F800000, element_bits=32)     # 1.0f
    g = Graph()
    alloc = g.add_alloc(4 * N)
    assert isinstance(alloc, MemAllocNode) and alloc.nbytes == 4 * N
    fill = g.add_kernel(kit.fill, 1, N, (alloc.address, np.int32(N), np.float32(3.0)), signature=FILL,
                        depends_on=alloc)
    node = g.add_child_graph(child, depends_on=fill)
    add = g.add_kernel(kit.vadd, 1, N, (alloc.address, kit.c, kit.b, np.int32(N)), signature=VADD, depends_on=node)
    free = g.add_free(alloc, depends_on=add)
    assert isinstance(node, ChildGraphNode) and isinstance(free, MemFreeNode) and free.address == alloc.address
    assert [type(n) for n in node.child_graph.nodes] == [MemsetNode]
    del child
    gc.collect()                                    # the node has its own copy; the parent keeps the buffer
    exe = g.instantiate()
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(kit.b), np.full(N, 4.0, np.float32))


# ----------------------------------------------------------------------------- instantiate, launch

def test_instantiate_uses_with_params_at_13_0(kit, fk):
    g = Graph()
    g.add_memset(kit.c, 1)
    fk.clear_calls()
    exe = g.instantiate(flags=["AUTO_FREE_ON_LAUNCH"], upload=kit.stream)
    assert "cuGraphInstantiateWithParams" in fk.calls()
    exe.upload(kit.stream)
    exe.launch(kit.stream)
    exe.launch(None)                                # the default stream, in the executable graph's context
    exe.launch(CU_STREAM_PER_THREAD)
    with pytest.raises(InvalidValueError, match="no flag"):
        g.instantiate(flags=["FASTER"])


def test_instantiate_errors_name_result_and_node(kit):
    g = Graph()
    x, y = g.add_empty(), g.add_empty()
    y.add_dependencies(x)
    x.add_dependencies(y)                            # a cycle: refused at instantiation
    with pytest.raises(GraphInstantiateError) as info:
        g.instantiate()
    assert info.value.result == "CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE" and info.value.node in (x, y)
    h = Graph()
    h.conditional_handle()
    with pytest.raises(GraphInstantiateError, match="CONDITIONAL_HANDLE_UNUSED"):
        h.instantiate()


def test_an_error_node_in_a_conditional_body_is_found_there(kit):
    """The driver names a node of a WHILE body (a cycle there): the error's node is that body's node."""
    g = Graph()
    handle = g.conditional_handle(default=0)
    loop = g.add_while(handle)
    body = loop.body
    n1 = body.add_empty()
    n2 = body.add_empty(depends_on=n1)
    body.add_dependencies(n2, n1)                      # a cycle inside the body
    with pytest.raises(GraphInstantiateError) as info:
        g.instantiate()
    node = info.value.node
    assert node in (n1, n2) and node.graph.owner == loop and node not in g.nodes
    assert info.value.result == "CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE"


def test_an_update_error_node_in_a_child_graph_is_found_there(kit):
    """cuGraphExecUpdate names a node inside the new graph's child graph (the driver's copy): the error's
    node is that node, queried from the driver (cuproc did not add it)."""
    first, second = Graph(), Graph()
    child = Graph()
    child.add_memset(kit.c, 0)
    first.add_child_graph(child)
    other = Graph()
    other.add_empty()
    node = second.add_child_graph(other)
    exe = first.instantiate()
    with pytest.raises(GraphUpdateError) as info:
        exe.update(second)
    assert info.value.reason == "CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED"
    inner = node.child_graph.nodes
    assert len(inner) == 1 and info.value.node == inner[0] and isinstance(info.value.node, EmptyNode)


def test_nodes_cuproc_did_not_add_are_read_from_the_driver(kit, graphs):
    """A child graph node inside a child graph's copy (the driver made it): its graph and that graph's nodes
    come from the driver; the views own nothing (closing one is refused, dropping one destroys nothing)."""
    inner = Graph()
    inner.add_memset(kit.c, 7)
    middle = Graph()
    middle.add_child_graph(inner)
    g = Graph()
    outer = g.add_child_graph(middle)
    copy = outer.child_graph.nodes
    assert len(copy) == 1 and isinstance(copy[0], ChildGraphNode)
    deepest = copy[0].child_graph
    nodes = deepest.nodes
    assert [type(n) for n in nodes] == [MemsetNode] and nodes[0].params.value == 7
    assert deepest.owner == copy[0] and not deepest.owned
    with pytest.raises(InvalidValueError, match="belongs to its node"):
        deepest.close()
    live = graphs.live("graph")
    del deepest, nodes
    gc.collect()
    assert graphs.live("graph") == live


def test_a_graph_of_another_library_is_adopted_and_never_destroyed_here(kit, graphs):
    """Graph.from_handle: a CUgraph built through the raw C names (as another library builds one) -- its nodes,
    a child graph node's graph and its nodes come from the driver; the adopted graph keeps its owner alive,
    instantiates and launches; closing or dropping it leaves the driver's graph to its owner."""
    drv = kit.pc.context.driver
    raw, child, node = ffi.new("CUgraph *"), ffi.new("CUgraph *"), ffi.new("CUgraphNode *")
    drv.check(drv.cuGraphCreate(child, 0), "cuGraphCreate")
    p = ffi.new("CUDA_MEMSET_NODE_PARAMS_v1 *")
    p.dst, p.value, p.elementSize, p.width, p.height, p.pitch = kit.c.address, 9, 1, 4 * N, 1, 4 * N
    drv.check(drv.cuGraphAddMemsetNode(node, child[0], ffi.NULL, 0, p, kit.pc.context.handle), "memset node")
    drv.check(drv.cuGraphCreate(raw, 0), "cuGraphCreate")
    drv.check(drv.cuGraphAddChildGraphNode(node, raw[0], ffi.NULL, 0, child[0]), "child graph node")
    drv.check(drv.cuGraphDestroy(child[0]), "cuGraphDestroy")

    class Owner:
        pass
    owner = Owner()
    owner_ref = weakref.ref(owner)
    g = Graph.from_handle(raw[0], owner=owner)
    del owner
    gc.collect()
    assert owner_ref() is not None and "another library" in g.describe()
    (outer,) = g.nodes
    assert isinstance(outer, ChildGraphNode)
    (fill,) = outer.child_graph.nodes
    assert isinstance(fill, MemsetNode) and fill.params.value == 9
    g.instantiate().launch(kit.stream)
    kit.stream.synchronize()
    assert (host(kit.c, 4 * N, np.uint8) == 9).all()
    live = graphs.live("graph")
    g.close()
    assert graphs.live("graph") == live and g.closed
    del g, outer, fill
    gc.collect()
    assert owner_ref() is None and graphs.live("graph") == live
    drv.check(drv.cuGraphDestroy(raw[0]), "cuGraphDestroy")   # the owner's to destroy
    for bad in (0, -1, True, "graph"):
        with pytest.raises(InvalidValueError, match="graph handle"):
            Graph.from_handle(bad)


def test_a_conditional_node_cuproc_did_not_add_needs_cuGraphNodeGetParams(kit):
    """A WHILE node inside a child graph's copy: its bodies are the driver's, reported by cuGraphNodeGetParams
    (CUDA 13.2); at the fake's 13.0 the dispatcher's error says so, naming the call."""
    child = Graph()
    handle = child.conditional_handle(default=0)
    child.add_while(handle).body.add_empty()
    g = Graph()
    outer = g.add_child_graph(child)
    (copy,) = outer.child_graph.nodes
    assert isinstance(copy, ConditionalNode)
    with pytest.raises(SymbolNotFoundError, match="cuGraphNodeGetParams") as info:
        copy.body
    assert any("not added by cuproc" in note for note in getattr(info.value, "__notes__", []))
    assert g.find_node(copy.handle) == copy              # the search passes over what it cannot open


def test_instantiate_at_11_8_takes_the_five_argument_abi(fk, graphs):
    """A handle pinned to 11.8 instantiates with cuGraphInstantiate (error node, log) and launches."""
    drv = cuproc.Driver("11.8", library=str(fk.path))
    pc = cuproc.use_device(0, driver=drv)
    try:
        assert drv.resolution("cuGraphInstantiate").entry_point == "cuGraphInstantiate_v2"
        assert not drv.has("cuGraphInstantiateWithParams", newer_driver_features=False)
        buf = DeviceBuffer(64, context=pc.context)
        g = Graph(driver=drv)
        g.add_memset(buf, 0xAB)
        fk.clear_calls()
        exe = g.instantiate()
        assert "cuGraphInstantiate" in fk.calls() and "cuGraphInstantiateWithParams" not in fk.calls()
        s = Stream(driver=drv)
        exe.launch(s)
        assert host(buf, 64, np.uint8).tolist() == [0xAB] * 64
        fk.fail("cuGraphInstantiate", 1)             # CUDA_ERROR_INVALID_VALUE, with no error node or log
        with pytest.raises(GraphInstantiateError) as info:
            g.instantiate()
        assert info.value.call == "cuGraphInstantiate" and info.value.result is None
        assert info.value.node is None and info.value.log == ""
        del exe, g, s, buf, info
        gc.collect()
    finally:
        drv.cuCtxSetCurrent(ffi.NULL)
        pc.release()


@pytest.mark.parametrize("version", ["11.8", "12.0"])
def test_the_older_abis_of_update_capture_info_and_edges(fk, graphs, version):
    """Pinned before 12.0, cuGraphExecUpdate is the 10.2 ABI (error node and result through pointers); before
    12.3, cuStreamGetCaptureInfo is the 11.3 one and cuGraphGetEdges the 10.0 one (no edge data).  The
    fake's shims of those ABIs answer as its 13.0 ones do: the reason and the node of a refused update, the
    graph and dependencies of a running capture, the edges of a graph."""
    drv = cuproc.Driver(version, library=str(fk.path))
    pc = cuproc.use_device(0, driver=drv)
    try:
        assert drv.resolution("cuStreamGetCaptureInfo").entry_point == "cuStreamGetCaptureInfo_v2"
        assert drv.resolution("cuGraphGetEdges").entry_point == "cuGraphGetEdges"
        assert drv.resolution("cuGraphExecUpdate").entry_point == \
            ("cuGraphExecUpdate" if version == "11.8" else "cuGraphExecUpdate_v2")
        buf = DeviceBuffer(64, context=pc.context)
        g = Graph(driver=drv)
        first = g.add_memset(buf, 1)
        second = g.add_memset(buf, 2, depends_on=first)
        assert g.edges == [(first, second)]
        exe = g.instantiate()
        other = Graph(driver=drv)
        other.add_memset(buf, 3)
        other.add_memset(buf, 4)                    # no edge: the topology changed
        with pytest.raises(GraphUpdateError) as info:
            exe.update(other)
        assert info.value.reason == "CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED"
        changed = Graph(driver=drv)
        changed.add_memset(buf, 5)
        node = changed.add_empty(depends_on=changed.nodes[0])
        with pytest.raises(GraphUpdateError) as info:
            exe.update(changed)
        assert info.value.reason == "CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED" and info.value.node == node
        same = Graph(driver=drv)
        same.add_memset(buf, 6, depends_on=same.add_memset(buf, 7))
        exe.update(same)
        s = Stream(driver=drv)
        exe.launch(s)
        assert host(buf, 64, np.uint8).tolist() == [6] * 64
        with capture(s) as captured:
            mem.memset(buf, 8, stream=s)
            info = capture_info(s)
            assert info.status == "active" and info.graph is captured and len(info.dependencies) == 1
        del exe, g, other, changed, same, node, first, second, captured, info, s, buf
        gc.collect()
    finally:
        drv.cuCtxSetCurrent(ffi.NULL)
        pc.release()


# ----------------------------------------------------------------------------- update, kernel arguments

def _vadd_graph(kit, a, b, c, n=N):
    g = Graph()
    node = g.add_kernel(kit.vadd, 1, N, (a, b, c, np.int32(n)))
    return g, node


def test_update_applies_a_graph_of_the_same_shape(kit):
    g1, _ = _vadd_graph(kit, kit.a, kit.b, kit.c)
    exe = g1.instantiate()
    d = DeviceBuffer(4 * N)
    g2, _ = _vadd_graph(kit, kit.a, kit.a, d)
    exe.update(g2)
    del g1, g2
    gc.collect()
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(d), 2 * np.arange(N, dtype=np.float32))
    np.testing.assert_array_equal(host(kit.c), np.zeros(N, np.float32))


def test_update_that_cannot_apply_says_why_and_changes_nothing(kit):
    g1, _ = _vadd_graph(kit, kit.a, kit.b, kit.c)
    exe = g1.instantiate()
    g2, k2 = _vadd_graph(kit, kit.a, kit.b, kit.c)
    g2.add_empty(depends_on=k2)
    with pytest.raises(GraphUpdateError) as info:
        exe.update(g2)
    assert info.value.reason == "CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED"
    assert info.value.code == 910 and "TOPOLOGY_CHANGED" in str(info.value)
    g3 = Graph()
    m = g3.add_memset(kit.c, 0)
    with pytest.raises(GraphUpdateError) as info:
        exe.update(g3)
    assert info.value.reason == "CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED" and info.value.node == m
    exe.launch(kit.stream)                          # still the first graph's work
    np.testing.assert_array_equal(host(kit.c), np.arange(N, dtype=np.float32) + 1)
    with pytest.raises(InvalidValueError, match="takes a cuproc Graph"):
        exe.update("g2")


def test_kernel_args_set_on_the_executable_graph_only(kit):
    """A value, a buffer and a count change between launches; the graph's node does not."""
    g = Graph()
    node = g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(1.0)))
    before = node.params.arg_bytes
    exe = g.instantiate()
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(kit.c), np.ones(N, np.float32))
    exe.set_kernel_args(node, (kit.c, np.int32(N), np.float32(2.0)))          # a value
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(kit.c), np.full(N, 2.0, np.float32))
    d = DeviceBuffer(4 * N)
    mem.memset(d, 0)
    exe.set_kernel_args(node, (d, np.int32(N // 4), np.float32(3.0)))        # a buffer and a count
    exe.launch(kit.stream)
    expected = np.zeros(N, np.float32)
    expected[:N // 4] = 3.0
    np.testing.assert_array_equal(host(d), expected)
    exe.set_kernel_args(node, (d, N, 5.0), grid=2, block=32, signature=FILL)
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(d), np.full(N, 5.0, np.float32))
    assert node.params.arg_bytes == before and node.params.block == (N, 1, 1)
    del d
    gc.collect()                                    # the executable graph holds the buffer its arguments name
    exe.launch(kit.stream)
    other, other_node = _vadd_graph(kit, kit.a, kit.b, kit.c)
    with pytest.raises(InvalidValueError, match="not a node of the graph"):
        exe.set_kernel_args(other_node, (kit.a, kit.b, kit.c, np.int32(1)))
    with pytest.raises(InvalidValueError, match="takes 3"):
        exe.set_kernel_args(node, (kit.c, np.int32(N)))


# ----------------------------------------------------------------------------- capture

def test_capture_of_mixed_work_replays(kit, fk):
    """Prepared and one-shot launches, copies, memsets, stream-ordered memory, an event fork/join with a
    second stream and a host function, captured once and replayed: the result depends on every replay."""
    acc = DeviceBuffer(4 * N)
    mem.memset(acc, 0)
    side = Stream()
    src = np.full(N, 0.5, np.float32)
    pinned = cuproc.PinnedBuffer(4 * N)
    pinned.numpy(np.float32)[:] = src
    add = kit.vadd.prepare(VADD, 1, N, stream=kit.stream)
    forked, joined = Event(timing=False), Event(timing=False)
    calls = []
    with cuproc.capture(kit.stream) as graph:
        assert capture_status(kit.stream) == "active" and graph.capture_info.status == "active"
        tmp = mem.alloc_async(4 * N, kit.stream)
        mem.copy(tmp, pinned, stream=kit.stream)                         # 0.5 each
        add(tmp, acc, acc, N)                                           # acc += 0.5
        forked.record(kit.stream)
        side.wait(forked)
        kit.fill.launch(1, N, (kit.c, np.int32(N), np.float32(2.0)), stream=side)   # one-shot, on the fork
        joined.record(side)
        kit.stream.wait(joined)
        kit.vadd.launch(1, N, (kit.c, acc, acc, np.int32(N)), stream=kit.stream)    # acc += 2
        mem.memset(kit.c, 0, stream=kit.stream)
        kit.stream.launch_host_func(lambda: calls.append(len(calls)))
        tmp.free_async()
    assert capture_status(kit.stream) == "none"
    assert graph.ended is None and len(graph.nodes) == 8
    exe = graph.instantiate()
    for _ in range(10):
        exe.launch(kit.stream)
    kit.stream.synchronize()
    np.testing.assert_array_equal(host(acc), np.full(N, 25.0, np.float32))
    assert calls == list(range(10))                 # the host function runs at every launch
    assert fk.launch_count() >= 30


def test_capture_queries(kit):
    assert capture_status(kit.stream) == "none"
    assert capture_info(kit.stream) == ("none", 0, None, ())
    with capture(kit.stream, mode="relaxed") as graph:
        info = capture_info(kit.stream)
        assert info.status == "active" and info.id > 0 and info.dependencies == ()
        kit.fill.launch(1, N, (kit.c, np.int32(N), np.float32(1.0)), stream=kit.stream)
        info = graph.capture_info
        assert [type(n) for n in info.dependencies] == [KernelNode] and info.graph is not None
        with pytest.raises(InvalidValueError, match="still being captured"):
            graph.instantiate()
        assert "being captured" in repr(graph)
    assert graph.ended is None
    with pytest.raises(InvalidValueError, match="not being captured"):
        graph.capture_info


def test_capture_on_the_legacy_stream_is_refused_before_the_driver(kit, fk):
    fk.clear_calls()
    for stream in (None, 0, 1, cuproc.stream.CU_STREAM_LEGACY):
        with pytest.raises(CudaError, match="legacy default stream cannot be captured") as info:
            capture(stream)
        assert info.value.refused and info.value.code == UNSUPPORTED
    assert "cuStreamBeginCapture" not in fk.calls()
    with pytest.raises(InvalidValueError, match="mode is one of"):
        cuproc.capture(kit.stream, mode="loose")


def test_capture_on_the_per_thread_default_stream(fk, graphs):
    drv = cuproc.Driver(library=str(fk.path), per_thread_default_stream=True)
    pc = cuproc.use_device(0, driver=drv)
    try:
        fn = Module.load(IMAGE, context=pc.context).get_function("fill_value")
        buf = DeviceBuffer(4 * N, context=pc.context)
        with capture(driver=drv) as graph:               # None: the handle's default stream, the per-thread one
            fn.launch(1, N, (buf, np.int32(N), np.float32(6.0)), stream=CU_STREAM_PER_THREAD)
            mem.memset(buf, 0, 4, stream=CU_STREAM_PER_THREAD)
        graph.instantiate().launch(None)
        expected = np.full(N, 6.0, np.float32)
        expected[0] = 0
        np.testing.assert_array_equal(host(buf), expected)
        del graph, buf, fn
        gc.collect()
    finally:
        drv.cuCtxSetCurrent(ffi.NULL)
        pc.release()


def test_a_forbidden_call_in_a_capture_names_the_call(kit, graphs):
    with pytest.raises(CudaError) as info:
        with cuproc.capture(kit.stream) as graph:
            kit.fill.launch(1, N, (kit.c, np.int32(N), np.float32(1.0)), stream=kit.stream)
            DeviceBuffer(64)                        # cuMemAlloc: not allowed while a global capture runs
    assert info.value.call == "cuMemAlloc" and info.value.code == UNSUPPORTED and not info.value.refused
    assert any("being captured" in note for note in info.value.__notes__)
    assert graph.ended and "discarded" in graph.ended
    with pytest.raises(ClosedResourceError):
        graph.instantiate()
    _stream_still_works(kit)
    assert graphs.live("capture") == 0 and graphs.live("graph") == 0


def test_an_exception_in_a_capture_discards_it(kit, graphs):
    fn = lambda: None  # noqa: E731
    fn_ref = weakref.ref(fn)
    with pytest.raises(ZeroDivisionError):
        with cuproc.capture(kit.stream) as graph:
            kit.fill.launch(1, N, (kit.c, np.int32(N), np.float32(1.0)), stream=kit.stream)
            kit.stream.launch_host_func(fn)
            1 / 0
    assert "discarded" in graph.ended
    del fn
    gc.collect()
    assert fn_ref() is None                         # the host function that will never run is not kept
    _stream_still_works(kit)
    assert graphs.live("capture") == 0 and graphs.live("graph") == 0


def test_an_invalidated_capture_raises_at_the_end(kit, graphs):
    with pytest.raises(CudaError) as info:
        with cuproc.capture(kit.stream) as graph:
            try:
                kit.stream.synchronize()            # refused during the capture, which it invalidates
            except CudaError as exc:
                assert exc.code == UNSUPPORTED and exc.call == "cuStreamSynchronize"
            assert capture_status(kit.stream) == "invalidated"
            with pytest.raises(CudaError) as inner:
                kit.fill.launch(1, N, (kit.c, np.int32(N), np.float32(1.0)), stream=kit.stream)
            assert inner.value.code == INVALIDATED
    assert info.value.call == "cuStreamEndCapture" and info.value.code == INVALIDATED
    assert any("invalidated" in note for note in info.value.__notes__)
    assert "discarded" in graph.ended
    _stream_still_works(kit)


def test_relaxed_mode_allows_unsafe_calls(kit):
    with cuproc.capture(kit.stream, mode="relaxed") as graph:
        buf = DeviceBuffer(64)                      # allowed in relaxed mode
        kit.fill.launch(1, 16, (buf, np.int32(16), np.float32(8.0)), stream=kit.stream)
    graph.instantiate().launch(kit.stream)
    np.testing.assert_array_equal(host(buf, 16), np.full(16, 8.0, np.float32))


def _stream_still_works(kit):
    assert capture_status(kit.stream) == "none"
    kit.fill.launch(1, N, (kit.c, np.int32(N), np.float32(7.0)), stream=kit.stream)
    mem.memset(kit.a, 0, stream=kit.stream)
    kit.stream.synchronize()
    with cuproc.capture(kit.stream) as again:
        kit.fill.launch(1, N, (kit.c, np.int32(N), np.float32(7.0)), stream=kit.stream)
    assert len(again.nodes) == 1


# ----------------------------------------------------------------------------- the review of issue 36

def test_objects_dropped_during_a_capture_are_released_after_it(kit, fk, graphs):
    """A finalizer's cuMemFree, cuModuleUnload or cuGraphExecDestroy is refused by the driver during a
    global capture (and invalidates it): cuproc keeps such objects until the capture ended."""
    scratch = DeviceBuffer(1 << 20)
    module = Module.load(IMAGE)
    g0 = Graph()
    g0.add_memset(kit.c, 0)
    exe0 = g0.instantiate()
    before = fk.device_bytes_live(0)
    refs = [weakref.ref(o) for o in (scratch, module, exe0)]
    finalizer = DeviceBuffer.__dict__.get("__del__")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaWarning)
        with cuproc.capture(kit.stream) as graph:
            kit.fill.launch(1, N, (kit.a, np.int32(N), np.float32(1.0)), stream=kit.stream)
            assert DeviceBuffer.__dict__.get("__del__") is finalizer      # (the class's finalizer stays: on the fast
            assert getattr(finalizer, "finalizes_class", True)           # path its C asks DEFER_DROP)
            del scratch, module, exe0
            gc.collect()
            assert fk.device_bytes_live(0) == before           # not yet: the capture prohibits it
            kit.fill.launch(1, N, (kit.a, np.int32(N), np.float32(2.0)), stream=kit.stream)
    assert len(graph.nodes) == 2
    gc.collect()
    assert fk.device_bytes_live(0) == before - (1 << 20)        # freed once the capture ended
    assert [r() for r in refs] == [None, None, None] and graphs.live("graph_exec") == 0


def test_capture_info_is_the_capture_graph_and_ends_with_it(kit):
    with cuproc.capture(kit.stream) as graph:
        kit.fill.launch(1, N, (kit.a, np.int32(N), np.float32(1.0)), stream=kit.stream)
        info = graph.capture_info
        assert capture_info(kit.stream).graph is graph
    assert info.graph is graph
    graph.add_empty(depends_on=info.dependencies)                # its nodes are the graph's own
    graph.close()
    other = Graph()                                              # may get the destroyed graph's handle
    other.add_memset(kit.a, 7)
    with pytest.raises(ClosedResourceError):
        info.graph.nodes
    with pytest.raises(ClosedResourceError):
        info.dependencies[0].params
    assert len(other.nodes) == 1


def test_a_failed_capture_ends_its_stream_ordered_buffers(kit, fk):
    with pytest.raises(KeyError):
        with cuproc.capture(kit.stream):
            tmp = mem.alloc_async(4 * N, kit.stream)
            raise KeyError("in the block")
    assert tmp.closed                                            # its address never existed
    with pytest.raises(ClosedResourceError):
        mem.memset(tmp, 0, stream=kit.stream)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaWarning)
        del tmp
        gc.collect()


def test_kernel_args_follow_an_update_and_refuse_nodes_the_exec_never_had(kit):
    a, b = kit.a, kit.c
    g1 = Graph()
    n1 = g1.add_kernel(kit.fill, 1, N, (a, np.int32(N), np.float32(1.0)))
    exe = g1.instantiate()
    g2 = Graph()
    g2.add_kernel(kit.fill, 1, N, (b, np.int32(N), np.float32(2.0)))
    exe.update(g2)
    mem.memset(a, 0)
    exe.set_kernel_args(n1, grid=1, block=N)                     # the rest is the exec's: g2's, not g1's
    exe.launch(kit.stream)
    kit.stream.synchronize()
    assert host(a)[0] == 0 and host(b)[0] == 2
    spare = DeviceBuffer(4 * N)
    exe.set_kernel_args(n1, (spare, np.int32(N), np.float32(3.0)))
    del g2
    gc.collect()
    b_free = DeviceBuffer(4 * N)
    exe.update(_fill_graph(kit, b_free))
    exe.set_kernel_args(n1, (spare, np.int32(N), np.float32(3.0)))
    b_free.free()                                                # the exec no longer uses it
    exe.launch(kit.stream)
    kit.stream.synchronize()
    n1.destroy()
    n2 = g1.add_kernel(kit.vadd, 1, N, (a, a, b, np.int32(N)))   # may get n1's handle back
    with pytest.raises(InvalidValueError, match="not a node of the graph"):
        exe.set_kernel_args(n2, (a, a, b, np.int32(N)))


def _fill_graph(kit, buf):
    g = Graph()
    g.add_kernel(kit.fill, 1, N, (buf, np.int32(N), np.float32(2.0)))
    return g


def test_a_failed_capture_forgets_host_functions_of_joined_streams(kit):
    from cuproc import stream as stream_module
    side = Stream()
    fork, join = Event(timing=False), Event(timing=False)
    fn = lambda: None  # noqa: E731
    fn_ref, side_ref = weakref.ref(fn), weakref.ref(side)
    mark = stream_module.host_function_mark()
    with pytest.raises(KeyError):
        with cuproc.capture(kit.stream):
            fork.record(kit.stream)
            side.wait(fork)
            side.launch_host_func(fn)
            join.record(side)
            kit.stream.wait(join)
            raise KeyError("in the block")
    del fn, side
    gc.collect()
    assert stream_module.host_function_streams(mark) == []
    assert fn_ref() is None and side_ref() is None


@contextlib.contextmanager
def _captured_on_another_thread(kit, cm):
    """``cm`` entered on a thread of its own (which launches one kernel in it), for the body of the with
    statement to act on it from this one; the thread leaves the capture when the body is done."""
    import threading
    begun, leave = threading.Event(), threading.Event()

    def its_thread():
        kit.ctx.push()
        try:
            cm.__enter__()
            kit.fill.launch(1, N, (kit.a, np.int32(N), np.float32(1.0)), stream=kit.stream)
            begun.set()
            leave.wait(30)
            cm.__exit__(None, None, None)
        finally:
            Context.pop()

    t = threading.Thread(target=its_thread)
    t.start()
    try:
        assert begun.wait(30)
        yield
    finally:
        leave.set()
        t.join()


def test_leaving_a_capture_on_another_thread_is_refused_and_it_runs_on(kit):
    cm = cuproc.capture(kit.stream)
    with _captured_on_another_thread(kit, cm):
        with pytest.raises(CudaError) as info:
            cm.__exit__(None, None, None)                       # not the thread that began it
        assert info.value.refused and info.value.name == "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"
        assert cm.graph.ended is None and capture_status(kit.stream) == "active"
    assert capture_status(kit.stream) == "none" and len(cm.graph.nodes) == 1


def test_a_raw_stream_is_captured_in_its_own_context(kit, fk):
    other = Context.create(0)
    try:
        module = Module.load(IMAGE)
        fill = module.get_function("fill_value")
        s, buf = Stream(), DeviceBuffer(4 * N)
        Context.pop()                                            # the primary context current again
        raw = int(ffi.cast("uintptr_t", s.handle))
        with capture(raw) as graph:
            fill.launch(1, N, (buf, np.int32(N), np.float32(5.0)), stream=s)
        assert graph.context is other
        exe = graph.instantiate()
        assert exe.context is other
        exe.launch(s)
        s.synchronize()
        assert host(buf)[0] == 5.0
        del exe, graph, s, buf, fill, module
        gc.collect()
    finally:
        other.destroy()


def test_a_capture_is_entered_once(kit):
    cap = cuproc.capture(kit.stream)
    with cap:
        pass
    with pytest.raises(InvalidValueError, match="entered once"):
        with cap:
            pass


# ----------------------------------------------------------------------------- conditional nodes

def _counter(value):
    buf = DeviceBuffer(8)
    mem.copy(buf, np.array([value, 0], np.int32))
    return buf


@pytest.mark.parametrize("k", [3, 0, 1])
def test_while_node_runs_k_iterations(kit, k):
    set_condition = kit.module.get_function("set_condition")
    countdown = kit.module.get_function("countdown")
    counter = _counter(k)                               # [counter, iterations]
    g = Graph()
    handle = g.conditional_handle(default=0)
    first = g.add_kernel(set_condition, 1, 1, (handle, counter))        # the handle packs as a uint64
    loop = g.add_while(handle, depends_on=first)
    assert isinstance(loop, ConditionalNode) and loop.kind == "while" and loop.condition == handle
    loop.body.add_kernel(countdown, 1, 1, (handle, counter, counter.address + 4),
                         signature=["unsigned long long", "int*", "int*"])
    exe = g.instantiate()
    exe.launch(kit.stream)
    assert host(counter, 2, np.int32).tolist() == [0, k]
    mem.copy(counter, np.array([2, 0], np.int32))
    exe.launch(kit.stream)
    assert host(counter, 2, np.int32).tolist() == [0, 2]


def test_if_else_and_switch(kit):
    set_condition = kit.module.get_function("set_condition")
    for value, expected in ((1, 1.0), (0, 2.0)):
        counter = _counter(value)
        g = Graph()
        handle = g.conditional_handle()
        first = g.add_kernel(set_condition, 1, 1, (handle, counter))
        node = g.add_if_else(handle, depends_on=first)
        node.then_body.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(1.0)))
        node.else_body.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(2.0)))
        g.instantiate().launch(kit.stream)
        np.testing.assert_array_equal(host(kit.c), np.full(N, expected, np.float32))
    g = Graph()
    handle = g.conditional_handle(default=2)             # each launch starts at 2: the third case
    node = g.add_switch(handle, 3)
    for case, body in enumerate(node.bodies):
        body.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(10 + case)))
    g.instantiate().launch(kit.stream)
    np.testing.assert_array_equal(host(kit.c), np.full(N, 12.0, np.float32))
    only_if = g.add_if(handle, depends_on=node)
    with pytest.raises(InvalidValueError, match="no else body"):
        only_if.else_body
    with pytest.raises(InvalidValueError, match="cases must be"):
        g.add_switch(handle, 0)
    other = Graph()
    with pytest.raises(InvalidValueError, match="belongs to"):
        other.add_while(handle)
    with pytest.raises(InvalidValueError, match="ConditionalHandle"):
        other.add_while(int(handle))


def test_a_body_refuses_once_its_node_is_destroyed(kit):
    g = Graph()
    handle = g.conditional_handle(default=1)
    node = g.add_if(handle)
    body = node.then_body
    body.add_empty()
    node.destroy()
    with pytest.raises(ClosedResourceError):
        body.add_empty()
    with pytest.raises(InvalidValueError, match="belongs to its node"):
        Graph._view(g.driver, g.context, body.handle, owner=None).close()


def test_conditional_nodes_at_12_0_raise_the_dispatchers_error(fk, graphs):
    """A handle pinned to 12.0 has no cuGraphConditionalHandleCreate: the dispatcher's error for 12.0, made
    before any driver call (the driver's 12.3 ABI is not taken as a newer-driver feature)."""
    drv = cuproc.Driver("12.0", library=str(fk.path))
    pc = cuproc.use_device(0, driver=drv)
    try:
        assert drv.has("cuGraphConditionalHandleCreate")             # the driver has it, at its own version
        g = Graph(driver=drv)
        fk.clear_calls()
        with pytest.raises(SymbolNotFoundError, match="does not exist at CUDA 12.0") as info:
            g.conditional_handle(default=1)
        assert any("requested version" in n for n in info.value.__notes__)
        assert "cuGraphConditionalHandleCreate" not in fk.calls()
        new = Graph()                                   # a 13.0 graph's handle, on the 12.0 graph: still refused
        handle = new.conditional_handle()
        with pytest.raises(SymbolNotFoundError):
            g.add_while(handle)
        new.add_if(handle)
        del g, new, handle
        gc.collect()
    finally:
        drv.cuCtxSetCurrent(ffi.NULL)
        pc.release()


def test_if_else_and_switch_need_a_handle_at_12_8(fk, graphs):
    """IF with an ELSE body and SWITCH are CUDA 12.8 features of cuGraphAddNode (12.3's ABI): a handle pinned
    to 12.4 refuses them before the driver is called (IF and WHILE work there); at 12.8 they are made."""
    for version, newer in (("12.4", False), ("12.8", True)):
        drv = cuproc.Driver(version, library=str(fk.path))
        pc = cuproc.use_device(0, driver=drv)
        try:
            assert drv.has_feature("conditional_if_else") is newer and drv.has_feature("conditional_switch") is newer
            g = Graph(driver=drv)
            handle = g.conditional_handle(default=1)
            g.add_if(handle)
            g.add_while(handle)
            fk.clear_calls()
            if newer:
                assert len(g.add_if_else(handle).bodies) == 2 and len(g.add_switch(handle, 3).bodies) == 3
            else:
                with pytest.raises(SymbolNotFoundError, match="12.8"):
                    g.add_if_else(handle)
                with pytest.raises(SymbolNotFoundError, match="12.8"):
                    g.add_switch(handle, 3)
                assert "cuGraphAddNode" not in fk.calls()
            del g, handle
            gc.collect()
        finally:
            drv.cuCtxSetCurrent(ffi.NULL)
            pc.release()


@pytest.mark.skipif(not hasattr(cuproc._fork.os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_capture_has_no_capture_state(fk):
    """fork() inside a capture's with block: the child's capture state is empty (nothing put off, no hook on
    finalizers), and the with block ending there counts nothing; the parent's capture ends as usual."""
    code = child_preamble(fk.path) + textwrap.dedent("""
        from cuproc import _resource, stream_capture as sc
        pc = cuproc.use_device(0)
        s = cuproc.Stream()
        clean = False
        try:
            with sc.capture(s) as graph:
                pid = os.fork()
                if pid == 0:
                    clean = (not sc._running and sc._global[0] == 0 and sc._total[0] == 0 and not sc._deferred
                             and _resource.DEFER_DROP[0] is None and not sc._prohibited())
        except cuproc.ForkedProcessError:      # the child's block ends: cuStreamEndCapture is refused there
            assert pid == 0
        if pid == 0:
            after = sc._global[0] == 0 and sc._total[0] == 0 and not sc._prohibited()
            os._exit(0 if clean and after else 3 if not clean else 4)
        _, status = os.waitpid(pid, 0)
        assert graph.instantiate() is not None and not sc._running and sc._global[0] == 0
        print(os.waitstatus_to_exitcode(status))
        """)
    proc = run_python(code)
    assert proc.stdout.strip() == "0", proc.stdout


# ----------------------------------------------------------------------------- the picture

def test_to_dot_names_every_node(kit, monkeypatch):
    g = Graph()
    k1 = g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(1.0)))
    g.add_kernel(kit.vadd, 1, N, (kit.a, kit.b, kit.c, np.int32(N)), depends_on=k1)
    g.add_memset(kit.a, 0)
    dot = g.to_dot()
    assert dot.startswith("digraph")
    statements = [line for line in dot.splitlines() if line.startswith('"') and "[" in line and "->" not in line]
    assert len(statements) == 3 and dot.count("KERNEL") == 2 and dot.count("->") == 1
    assert "<<<" not in dot.replace("\\", "") and "<<<" in g.to_dot(verbose=True).replace("\\", "")
    # the flags reach the driver as the C enum's values: the fake's own DOT of the same handle with
    # CU_GRAPH_DEBUG_DOT_FLAGS_KERNEL_NODE_PARAMS | CU_GRAPH_DEBUG_DOT_FLAGS_HANDLES (4 | 1024) is the reference
    flagged = g.to_dot(flags=["KERNEL_NODE_PARAMS", "CU_GRAPH_DEBUG_DOT_FLAGS_HANDLES"])
    assert flagged == _drivers_dot(g, 4 | 1024) and flagged != dot
    assert g.to_dot(flags=1024) == _drivers_dot(g, 1024) != flagged
    assert all(f"{int(ffi.cast('uintptr_t', n.handle)):#x}" in flagged for n in g.nodes)   # HANDLES names each node
    assert "<<<" in flagged.replace("\\", "") and "<<<" not in g.to_dot(flags=["HANDLES"]).replace("\\", "")
    assert g.to_dot(verbose=True) == _drivers_dot(g, 1)
    with pytest.raises(InvalidValueError, match="no flag"):
        g.to_dot(flags=["SHINY"])
    import shutil
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert g._repr_svg_() is None
    with pytest.raises(FileNotFoundError, match="Graphviz"):
        g.to_png("/nonexistent/graph.png")


def _drivers_dot(graph, flags: int) -> str:
    """The driver's own DOT of ``graph``'s handle with ``flags`` (cuGraphDebugDotPrint, called directly)."""
    import os
    import tempfile
    drv = graph.driver
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        drv.check(drv.cuGraphDebugDotPrint(graph.handle, path.encode(), flags), "cuGraphDebugDotPrint")
        with open(path) as f:
            return f.read()
    finally:
        os.unlink(path)


# ----------------------------------------------------------------------------- lifetimes

@pytest.mark.parametrize("order", [("g", "node", "exe"), ("exe", "node", "g"), ("node", "exe", "g")])
def test_drop_in_any_order(kit, order, graphs):
    g = Graph()
    node = g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(1.0)))
    exe = g.instantiate()
    scope = {"g": g, "node": node, "exe": exe}
    refs = {name: weakref.ref(obj) for name, obj in scope.items()}
    del g, node, exe
    for name in order:
        del scope[name]
        gc.collect()
        if refs["exe"]() is not None:
            refs["exe"]().launch(kit.stream)            # what is left still works
        if refs["g"]() is not None:
            refs["g"]().instantiate().launch(kit.stream)
    assert [r() for r in refs.values()] == [None, None, None]
    assert graphs.live("graph") == 0 and graphs.live("graph_exec") == 0
    np.testing.assert_array_equal(host(kit.c), np.ones(N, np.float32))


def test_reused_handles_never_reach_a_dead_objects_successor(kit, fk):
    """The fake hands a destroyed graph's, node's or executable graph's handle to the next one made, as the
    driver does: the dead object refuses, and closing or dropping it never touches its successor."""
    g1 = Graph()
    n1 = g1.add_empty()
    e1 = g1.instantiate()
    old = (g1.handle, n1.handle, e1.handle)
    e1.destroy()
    n1.destroy()
    g1.destroy()
    g2 = Graph()
    n2 = g2.add_empty()
    e2 = g2.instantiate()
    assert fk.handle_reuses() >= 3 and (g2.handle, n2.handle, e2.handle) == old
    with pytest.raises(ClosedResourceError):
        g1.add_empty()
    with pytest.raises(ClosedResourceError):
        n1.add_dependencies(n2)
    with pytest.raises(ClosedResourceError):
        e1.launch(kit.stream)
    for dead in (g1, n1, e1):
        dead.close()
    del g1, n1, e1
    gc.collect()
    assert g2.nodes == [n2]
    e2.launch(kit.stream)


def test_a_graph_holds_what_its_nodes_refer_to(kit):
    class Callable:
        def __call__(self):
            pass
    fn = Callable()
    fn_ref = weakref.ref(fn)
    buf = DeviceBuffer(4 * N)
    buf_ref = weakref.ref(buf)
    g = Graph()
    g.add_kernel(kit.fill, 1, N, (buf, np.int32(N), np.float32(1.0)))
    g.add_host(fn)
    del fn, buf
    gc.collect()
    assert fn_ref() is not None and buf_ref() is not None
    exe = g.instantiate()
    del g
    gc.collect()
    assert fn_ref() is not None and buf_ref() is not None       # the executable graph holds them now
    exe.launch(kit.stream)
    kit.stream.synchronize()                                    # (the launch ran: it holds nothing more)
    np.testing.assert_array_equal(host(buf_ref()), np.ones(N, np.float32))
    del exe
    gc.collect()
    assert fn_ref() is None and buf_ref() is None


@pytest.mark.parametrize("where", ["graph", "child graph", "while body"])
def test_a_launch_keeps_its_host_nodes_until_it_ran(kit, where):
    """The fake runs host nodes later (at the next synchronize), as the driver does: the executable graph
    and its graph dropped right after the launch, the callable still runs, once, and goes afterwards."""
    calls = []

    class Host:
        def __call__(self):
            calls.append(1)
    fn = Host()
    fn_ref = weakref.ref(fn)
    g = Graph()
    if where == "graph":
        g.add_host(fn)
    elif where == "child graph":
        child = Graph()
        child.add_host(fn)
        g.add_child_graph(child)
        del child
    else:
        state = DeviceBuffer(8)
        mem.copy(state, np.array([1, 0], np.int32))
        handle = g.conditional_handle(default=0)
        first = g.add_kernel(kit.module.get_function("set_condition"), 1, 1, (handle, state),
                             signature=["unsigned long long", "int*"])
        loop = g.add_while(handle, depends_on=first)
        loop.body.add_kernel(kit.module.get_function("countdown"), 1, 1, (handle, state, state.address + 4),
                             signature=["unsigned long long", "int*", "int*"])
        loop.body.add_host(fn)
    exe = g.instantiate()
    exe.launch(kit.stream)
    first = loop = handle = None                 # (a conditional handle holds its graph's records)
    del fn, exe, g, first, loop, handle
    gc.collect()
    assert kit.graphs.pending_host_work() == 2 and calls == []     # the host node, then the launch's release
    assert fn_ref() is not None                                 # kept by the launch, not by any object
    assert in_flight_count() >= 1
    kit.stream.synchronize()                                    # the driver runs the host node now
    assert calls == [1] and kit.graphs.pending_host_work() == 0
    gc.collect()
    assert fn_ref() is None and in_flight_count() == 0


def test_a_child_graph_of_kernels_is_no_host_work_and_a_child_copy_from_host_memory_is(kit, fk):
    """A child graph node's kernels and device copies queue nothing after a launch and can be replayed; a
    child (nested one level more) that copies from host memory keeps that memory until the launch ran."""
    child = Graph()
    child.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(5.0)))
    child.add_memcpy(kit.b, kit.a)
    g = Graph()
    g.add_child_graph(child)
    exe = g.instantiate()
    fk.clear_calls()
    exe.launch(kit.stream)
    assert "cuLaunchHostFunc" not in fk.calls()
    exe.replay(kit.stream)()
    kit.stream.synchronize()
    np.testing.assert_array_equal(host(kit.c), np.full(N, 5.0, np.float32))
    src = np.full(N, 7.0, np.float32)
    inner = Graph()
    inner.add_memcpy(kit.c, src)
    middle = Graph()
    middle.add_child_graph(inner)
    hosted = Graph()
    hosted.add_child_graph(middle)
    exe = hosted.instantiate()
    with pytest.raises(InvalidValueError, match="host nodes"):
        exe.replay(kit.stream)
    del inner, middle, hosted
    exe.launch(kit.stream)
    assert fk.calls()[-2:] == ["cuGraphLaunch", "cuLaunchHostFunc"]     # the launch keeps src until it ran
    kit.stream.synchronize()
    np.testing.assert_array_equal(host(kit.c), np.full(N, 7.0, np.float32))


def test_a_launch_keeps_host_memory_a_copy_node_reads(kit):
    """A copy node from host memory: the array is kept by each launch until the launch ran."""
    src = np.arange(N, dtype=np.float32)
    src_ref = weakref.ref(src)
    g = Graph()
    g.add_host(lambda: None)                                    # (queues the launch's work behind host work)
    g.add_memcpy(kit.c, src)
    exe = g.instantiate()
    del src, g
    exe.launch(kit.stream)
    del exe
    gc.collect()
    assert src_ref() is not None
    kit.stream.synchronize()
    gc.collect()
    assert src_ref() is None
    np.testing.assert_array_equal(host(kit.c), np.arange(N, dtype=np.float32))


def test_a_prepared_replay_is_the_checked_driver_call(kit, fk, graphs):
    """exe.replay(stream): cuGraphLaunch alone per call (no cuCtxGetCurrent, nothing queued after it); a graph
    with host nodes and a stream of another context are refused when it is made."""
    g = Graph()
    g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(3.0)))
    exe = g.instantiate()
    replay = exe.replay(kit.stream)
    before = graphs.launches()
    fk.clear_calls()
    for _ in range(3):
        replay()
    assert fk.calls() == ["cuGraphLaunch"] * 3 and graphs.launches() == before + 3
    np.testing.assert_array_equal(host(kit.c), np.full(N, 3.0, np.float32))
    exe.destroy()
    with pytest.raises(ClosedResourceError):
        exe.replay(kit.stream)
    hosted = Graph()
    hosted.add_host(lambda: None)
    with pytest.raises(InvalidValueError, match="host nodes"):
        hosted.instantiate().replay(kit.stream)
    with pytest.raises(InvalidValueError, match="cuproc Stream"):
        g.instantiate().replay(None)
    other = Context.create(0)
    try:
        foreign = Stream()
    finally:
        Context.pop()
    with pytest.raises(InvalidValueError, match="context"):
        g.instantiate().replay(foreign)
    del foreign
    other.destroy()


def test_a_failed_launch_raises_the_drivers_error_on_every_path(kit, fk, graphs):
    """cuGraphLaunch answering an error: the fast path of launch() (a checked Stream, nothing ended since),
    its full checks (a stream never checked) and a replay each raise CudaError naming cuGraphLaunch with the
    driver's code (replay tests the raw call's result itself since it no longer calls drv.checked)."""
    g = Graph()
    g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(3.0)))
    exe = g.instantiate()
    exe.launch(kit.stream)                           # checks both: the next launch is the fast path
    replay = exe.replay(kit.stream)
    code = cuproc.driver.CUDA_ERROR_LAUNCH_FAILED
    for launch in (lambda: exe.launch(kit.stream), replay, lambda: exe.launch(Stream())):
        before = graphs.launches()
        fk.fail("cuGraphLaunch", code, count=-1)
        try:
            with pytest.raises(CudaError) as info:
                launch()
        finally:
            fk.fail("cuGraphLaunch", 0, count=0)
        assert info.value.code == code and "cuGraphLaunch" in str(info.value)
        assert graphs.launches() == before
    replay()                                         # and each works again once the driver does
    exe.launch(kit.stream)
    assert graphs.launches() == before + 2


def test_a_stream_is_checked_before_its_first_fast_launch(kit, fk, graphs):
    """A Stream starts unchecked (its _checked_at is no epoch), so launch() takes the full checks the first
    time it sees one, also one made by Stream.from_handle; a stream whose context ended is refused there."""
    g = Graph()
    g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(3.0)))
    exe = g.instantiate()
    exe.launch(kit.stream)
    ctx = Context.create(0)
    try:
        foreign = Stream()
    finally:
        Context.pop()
    wrapped = Stream.from_handle(handle_of(foreign), context=ctx)
    ctx.destroy()
    before = graphs.launches()
    for s in (foreign, wrapped):
        with pytest.raises(ClosedResourceError, match="context"):
            exe.launch(s)
    assert graphs.launches() == before
    fresh = Stream()
    exe.launch(fresh)
    fresh.synchronize()
    assert graphs.launches() == before + 1


@pytest.mark.skipif(not hasattr(cuproc._fork.os, "fork"), reason="needs fork")
def test_a_replay_and_a_launch_refuse_in_a_forked_child(fk):
    """A replay made before fork() refuses in the child (ForkedProcessError from its checks, which the fork's
    move of the epoch sends it to) without calling the driver; so does launch() (the moved epoch sends it to its
    full checks too)."""
    code = child_preamble(fk.path) + textwrap.dedent("""
        import numpy as np
        from fakedriver import fake_image
        pc = cuproc.use_device(0)
        module = cuproc.Module.load(fake_image({"fill_value": [8, 4, 4]}))
        buf = cuproc.DeviceBuffer(64)
        s = cuproc.Stream()
        g = cuproc.Graph()
        g.add_kernel(module.get_function("fill_value"), 1, 16, (buf, np.int32(16), np.float32(1.0)))
        exe = g.instantiate()
        exe.launch(s)
        replay = exe.replay(s)
        replay()
        s.synchronize()
        pid = os.fork()
        if pid == 0:
            refused = 0
            for call in (replay, lambda: exe.launch(s)):
                try:
                    call()
                except cuproc.ForkedProcessError:
                    refused += 1
            # the child's own count of driver calls after fork (the fake counts per process)
            os._exit(0 if refused == 2 and fake.fork_violations() == 0 else 3 if refused != 2 else 4)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        """)
    proc = run_python(code)
    assert proc.stdout.strip() == "0", proc.stdout + proc.stderr


def test_a_replay_holds_its_executable_graph_and_stream_and_refuses_once_they_ended(kit, fk, graphs):
    """A replay keeps what it launches alive, and once its stream, its executable graph or their context
    ended it refuses (ClosedResourceError) before a handle the driver hands out again reaches it."""
    g = Graph()
    g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(3.0)))
    exe = g.instantiate()
    s = Stream()
    replay = exe.replay(s)
    old = handle_of(s)
    s.close()
    s2 = Stream()                                   # the fake, as the driver, hands s's handle out again
    assert handle_of(s2) == old
    before = graphs.launches()
    with pytest.raises(ClosedResourceError) as info:
        replay()
    assert graphs.launches() == before and "stream" in str(info.value)
    replay = exe.replay(s2)
    exe_ref = weakref.ref(exe)
    del exe
    gc.collect()
    assert exe_ref() is not None                    # the replay holds it
    other = g.instantiate()
    replay()                                        # its own executable graph, alive (fk: nothing stale)
    assert graphs.launches() == before + 1
    exe_ref().destroy()
    with pytest.raises(ClosedResourceError) as info:
        replay()
    assert graphs.launches() == before + 1 and "executable graph" in str(info.value)
    s2.synchronize()
    del replay, other
    ctx = Context.create(0)
    try:
        module = Module.load(IMAGE)
        buf = DeviceBuffer(4 * N)
        h = Graph()
        h.add_kernel(module.get_function("fill_value"), 1, N, (buf, np.int32(N), np.float32(1.0)))
        s3 = Stream()
        replay = h.instantiate().replay(s3)
        replay()
        s3.synchronize()
    finally:
        Context.pop()
    ctx.destroy()
    with pytest.raises(ClosedResourceError) as info:
        replay()
    assert graphs.launches() == before + 2 and "context" in str(info.value)
    del replay, h, s3, buf, module


def test_a_graph_of_kernels_queues_nothing_after_its_launch(kit, fk):
    g = Graph()
    g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(1.0)))
    exe = g.instantiate()
    fk.clear_calls()
    exe.launch(kit.stream)
    assert "cuLaunchHostFunc" not in fk.calls()


def test_ended_resources_refuse_instantiate_and_launch(kit):
    buf = DeviceBuffer(4 * N)
    g = Graph()
    g.add_kernel(kit.fill, 1, N, (buf, np.int32(N), np.float32(1.0)))
    exe = g.instantiate()
    exe.launch(kit.stream)                              # checked: the next launch is the driver call alone
    buf.free()
    for _ in range(2):
        with pytest.raises(ClosedResourceError, match="executable graph .* freed"):
            exe.launch(kit.stream)
    with pytest.raises(ClosedResourceError, match="freed"):
        g.instantiate()
    module = Module.load(IMAGE)
    g2 = Graph()
    g2.add_kernel(module.get_function("fill_value"), 1, N, (kit.c, np.int32(N), np.float32(1.0)))
    exe2 = g2.instantiate()
    module.unload()
    for _ in range(2):                                  # refused again: a refusal leaves nothing checked
        with pytest.raises(ClosedResourceError, match="unloaded"):
            exe2.launch(kit.stream)
    exe2.destroy()
    exe2.destroy()                                      # idempotent
    with pytest.raises(ClosedResourceError, match="destroyed"):
        exe2.launch(kit.stream)


def test_destroying_the_context_ends_graph_and_executable_graph(fk, graphs):
    ctx = Context.create(0)
    try:
        mod = Module.load(IMAGE)
        buf = DeviceBuffer(4 * N)
        g = Graph()
        node = g.add_kernel(mod.get_function("fill_value"), 1, N, (buf, np.int32(N), np.float32(1.0)))
        exe = g.instantiate()
        s = Stream()
        exe.launch(s)
    finally:
        Context.pop()
    del mod, buf
    ctx.destroy()
    assert graphs.live("graph_exec") == 0 and graphs.live("graph") == 1       # the driver's graph outlives it
    with pytest.raises(ClosedResourceError, match="executable graph .* context .* destroyed"):
        exe.launch(s)
    with pytest.raises(ClosedResourceError, match="graph .* context .* destroyed"):
        g.instantiate()
    with pytest.raises(ClosedResourceError):
        node.params
    exe.destroy()                                       # nothing to give back: it went with its context
    del g, node, exe, s
    gc.collect()
    assert graphs.live("graph") == 0                    # cuproc destroyed the graph all the same


def test_a_host_node_exception_is_a_warning_never_lost(kit):
    def boom():
        raise RuntimeError("in a host node")
    g = Graph()
    node = g.add_host(boom)
    exe = g.instantiate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exe.launch(kit.stream)                          # (the driver runs host nodes later)
    assert node.errors == []
    with pytest.warns(CudaWarning, match="host node raised RuntimeError: in a host node"):
        kit.stream.synchronize()
    assert [str(e) for e in node.errors] == ["in a host node"] and node.function is boom
    del exe, g
    gc.collect()
    exe2 = node.graph.instantiate()
    exe2.launch(kit.stream)
    del exe2
    gc.collect()
    with pytest.warns(CudaWarning, match="in a host node"):     # an executable graph dropped at once: reported too
        kit.stream.synchronize()


def test_graph_nodes_refuse_bad_input_before_the_driver(kit, fk):
    g = Graph()
    fk.clear_calls()
    with pytest.raises(InvalidValueError, match="takes 3"):
        g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N)))
    with pytest.raises(InvalidValueError, match="plain Python"):
        g.add_kernel(kit.fill, 1, N, (kit.c, N, 1.0))
    with pytest.raises(InvalidValueError, match="grid"):
        g.add_kernel(kit.fill, 0, N, (kit.c, np.int32(N), np.float32(1.0)))
    with pytest.raises(InvalidValueError, match="does not fit 8 bits"):
        g.add_memset(kit.c, 256)
    with pytest.raises(InvalidValueError, match="overruns"):
        g.add_memcpy(kit.c, kit.a, 8 * N)
    with pytest.raises(InvalidValueError, match="Python callable"):
        g.add_host(42)
    with pytest.raises(InvalidValueError, match="Event"):
        g.add_event_record(kit.stream)
    with pytest.raises(InvalidValueError, match="positive int"):
        g.add_alloc(0)
    with pytest.raises(InvalidValueError, match="default"):
        g.conditional_handle(default=-1)
    assert not [c for c in fk.calls() if c.startswith("cuGraphAdd")]
    freed = DeviceBuffer(64)
    freed.free()
    with pytest.raises(ClosedResourceError):
        g.add_memset(freed, 0)
    g.close()
    with pytest.raises(ClosedResourceError, match="destroyed"):
        g.add_empty()


def test_memset_and_memset_nodes_share_one_check(kit, fk):
    """cuproc.fill_args checks both: the same refusals before the driver, and the one difference said -- a
    memset of 0 elements is the driver's no-op, a memset node must fill one element at least."""
    g = Graph()
    fk.clear_calls()
    for fill in (lambda **kw: mem.memset(kit.c, **kw), lambda **kw: g.add_memset(kit.c, **kw)):
        with pytest.raises(InvalidValueError, match="does not fit 8 bits"):
            fill(value=256)
        with pytest.raises(InvalidValueError, match="element_bits"):
            fill(value=0, element_bits=12)
        with pytest.raises(InvalidValueError, match="do not fit"):
            fill(value=0, count=4 * N + 1)
        with pytest.raises(InvalidValueError, match="do not fit"):
            fill(value=0, count=True)
    with pytest.raises(InvalidValueError, match="not aligned"):
        mem.memset(kit.c.address + 2, 0, 4, element_bits=32)
    with pytest.raises(InvalidValueError, match="not aligned"):
        g.add_memset(kit.c.address + 2, 0, 4, element_bits=32)
    assert not [c for c in fk.calls() if c.startswith(("cuMemset", "cuGraphAdd"))]
    mem.memset(kit.c, 0, 0)                                     # nothing to fill: the driver's no-op
    with pytest.raises(InvalidValueError, match="at least 1 element"):
        g.add_memset(kit.c, 0, 0)


# ----------------------------------------------------------------------------- what could crash: a fresh interpreter

def test_teardown_at_exit_in_a_subprocess(fk):
    """An invalidated capture, a discarded one, graphs and executable graphs with host nodes still alive at
    interpreter exit, in every order the teardown picks: the child exits 0 and leaves nothing stale."""
    code = child_preamble(fk.path) + textwrap.dedent(f"""
        import numpy as np
        from cuproc import memory as mem
        from fakedriver import fake_image
        pc = cuproc.use_device(0)
        mod = cuproc.Module.load(fake_image({{"fill_value": [8, 4, 4]}}))
        fn = mod.get_function("fill_value")
        s = cuproc.Stream()
        buf = cuproc.DeviceBuffer(256)
        try:
            with cuproc.capture(s) as lost:
                fn.launch(1, 64, (buf, np.int32(64), np.float32(1.0)), stream=s)
                try:
                    s.synchronize()
                except cuproc.CudaError:
                    pass
        except cuproc.CudaError as exc:
            assert exc.code == 901, exc
        try:
            with cuproc.capture(s) as thrown:
                raise KeyError("x")
        except KeyError:
            pass
        g = cuproc.Graph()
        g.add_kernel(fn, 1, 64, (buf, np.int32(64), np.float32(2.0)))
        g.add_host(lambda: None)
        exe = g.instantiate()
        exe.launch(s)
        cycle = [g, exe]
        cycle.append(cycle)                       # collected (or not) by the interpreter's teardown
        with cuproc.capture(s) as captured:
            s.launch_host_func(lambda: None)
        exe2 = captured.instantiate()
        exe2.launch(s)
        print("stale", fake.stale_count())
    """)
    assert "stale 0" in run_python(code).stdout


def test_launching_from_threads_and_dropping_meanwhile_in_a_subprocess(fk):
    code = child_preamble(fk.path) + textwrap.dedent("""
        import threading, gc
        import numpy as np
        from fakedriver import fake_image
        pc = cuproc.use_device(0)
        fn = cuproc.Module.load(fake_image({"fill_value": [8, 4, 4]})).get_function("fill_value")
        buf = cuproc.DeviceBuffer(256)
        g = cuproc.Graph()
        g.add_kernel(fn, 1, 64, (buf, np.int32(64), np.float32(1.0)))
        g.add_host(lambda: None)
        exe = g.instantiate()
        del g
        def run():
            pc.context.push()
            s = cuproc.Stream()
            for _ in range(50):
                exe.launch(s)
            s.synchronize()
            cuproc.Context.pop()
        threads = [threading.Thread(target=run) for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        del exe
        gc.collect()
        print("stale", fake.stale_count())
    """)
    assert "stale 0" in run_python(code).stdout


# ----------------------------------------------------------------------------- issue 36's leftovers
from cuproc.graph_nodes import DROPPED_PENDING, GraphAllocation  # noqa: E402


def _capture_allocating(kit, value=7.0):
    """A captured graph that allocates a buffer (alloc_async in the capture, not freed there) and fills it."""
    with cuproc.capture(kit.stream) as g:
        buf = mem.alloc_async(4 * N, kit.stream)
        kit.fill.launch(1, N, (buf, np.int32(N), np.float32(value)), stream=kit.stream)
    return g, buf


def test_a_captured_allocation_exists_from_a_launch_until_it_is_freed(kit):
    g, buf = _capture_allocating(kit)
    assert isinstance(buf, GraphAllocation) and not buf.allocated
    with pytest.raises(ClosedResourceError, match="not allocated yet"):
        mem.memset(buf, 0, stream=kit.stream)                  # its memory does not exist before a launch
    with pytest.raises(InvalidValueError, match="never allocated"):
        buf.free_async()                                       # the driver refuses it: nothing changes
    exe = g.instantiate()
    exe.launch(kit.stream)
    assert buf.allocated
    np.testing.assert_array_equal(host(buf), np.full(N, 7.0, np.float32))
    with pytest.raises(InvalidValueError, match="not freed"):
        exe.launch(kit.stream)                                 # the driver would refuse it too
    buf.free_async()
    buf.free_async()                                           # idempotent until the next launch
    assert not buf.allocated
    with pytest.raises(ClosedResourceError):
        mem.memset(buf, 0, stream=kit.stream)
    mem_before = buf.address
    exe.launch(kit.stream)                                     # allocated again, at the same address
    assert buf.allocated and buf.address == mem_before
    np.testing.assert_array_equal(host(buf), np.full(N, 7.0, np.float32))
    buf.free_async(kit.stream)
    kit.stream.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaWarning)            # its finalizer frees nothing the graph never made
        del buf
        gc.collect()
        exe.launch(kit.stream)                                 # and a dropped allocation is freed after each launch
        exe.launch(kit.stream)
        kit.stream.synchronize()


def test_a_dropped_graph_allocation_is_freed_by_its_finalizer_and_after_later_launches(kit):
    g, buf = _capture_allocating(kit)
    exe = g.instantiate()
    exe.launch(kit.stream)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaWarning)
        del buf                                                # allocated: the finalizer frees it
        gc.collect()
        for _ in range(3):
            exe.launch(kit.stream)                             # each launch's allocation is freed after it
    kit.stream.synchronize()
    del g
    gc.collect()
    with pytest.raises(InvalidValueError, match="replay it with launch"):
        exe.replay(kit.stream)


def test_auto_free_on_launch_relaunches_a_graph_allocation(kit):
    g, buf = _capture_allocating(kit, 4.0)
    exe = g.instantiate(flags="AUTO_FREE_ON_LAUNCH")
    for _ in range(3):
        exe.launch(kit.stream)
        np.testing.assert_array_equal(host(buf), np.full(N, 4.0, np.float32))
    buf.free_async()
    kit.stream.synchronize()


def test_auto_free_on_launch_never_frees_under_a_dlpack_export(kit):
    from cuproc import _dlpack
    g, buf = _capture_allocating(kit, 4.0)
    exe = g.instantiate(flags="AUTO_FREE_ON_LAUNCH")
    exe.launch(kit.stream)
    exported = _dlpack.consume(buf.__dlpack__(max_version=(1, 0)))
    with pytest.raises(BufferError):
        exe.launch(kit.stream)                                 # it would free what the consumer reads
    assert buf.allocated
    exported.release()
    gc.collect()
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(buf), np.full(N, 4.0, np.float32))
    buf.free_async()
    kit.stream.synchronize()


def _launched_allocation(kit):
    """A captured allocating graph, instantiated and launched once: its buffer allocated (filled with 7)."""
    g, buf = _capture_allocating(kit)
    exe = g.instantiate()
    exe.launch(kit.stream)
    kit.stream.synchronize()
    return g, exe, buf


def test_a_graph_allocation_freed_in_a_failed_capture_stays_allocated(kit):
    """free_async into a capture only adds a free node to that capture's graph: when the capture fails, the
    memory was never freed -- the buffer is usable, frees for real, and its graph launches again."""
    g, exe, buf = _launched_allocation(kit)
    other = Stream()
    with pytest.raises(KeyError):
        with cuproc.capture(other):
            buf.free_async(other)
            assert not buf.allocated                           # pending: the caller freed it
            raise KeyError("the block fails")
    assert buf.allocated
    np.testing.assert_array_equal(host(buf), np.full(N, 7.0, np.float32))
    buf.free_async()
    exe.launch(kit.stream)                                     # the driver found it freed
    kit.stream.synchronize()
    assert buf.allocated
    buf.free_async()


def test_a_graph_allocation_freed_in_a_capture_is_freed_by_its_graphs_launch_only(kit):
    """A capture that ends well leaves the free pending until a launch of its graph: before it, the allocating
    graph may not launch again (the memory still exists); a launch frees it; the freeing graph gone unlaunched,
    the memory is the buffer's again (nothing leaks)."""
    g, exe, buf = _launched_allocation(kit)
    other = Stream()
    with cuproc.capture(other) as frees:
        buf.free_async(other)
    assert [type(n) for n in frees.nodes] == [MemFreeNode] and not buf.allocated
    with pytest.raises(InvalidValueError, match="not launched yet"):
        exe.launch(kit.stream)                                 # the driver would refuse it: still allocated
    freeing = frees.instantiate()
    freeing.launch(other)
    other.synchronize()
    exe.launch(kit.stream)                                     # freed by that launch: allocated again
    kit.stream.synchronize()
    assert buf.allocated
    np.testing.assert_array_equal(host(buf), np.full(N, 7.0, np.float32))
    freeing.launch(other)                                      # frees this launch's allocation too
    other.synchronize()
    assert not buf.allocated
    with pytest.raises(InvalidValueError, match="not allocated now"):
        freeing.launch(other)                                  # a second free of freed memory is refused
    exe.launch(kit.stream)
    kit.stream.synchronize()
    with cuproc.capture(other) as unlaunched:
        buf.free_async(other)
    assert not buf.allocated
    del unlaunched
    gc.collect()
    assert buf.allocated                                       # no launch will free it: the buffer's again
    buf.free_async()
    kit.stream.synchronize()


def test_a_second_free_into_another_capture_while_one_is_pending_is_refused(kit):
    """Two free nodes for one allocation would free it twice: the second capture's free is refused (its
    capture fails), and the first, pending one still frees the memory when its graph is launched."""
    g, exe, buf = _launched_allocation(kit)
    first, second = Stream(), Stream()
    with cuproc.capture(first) as frees:
        buf.free_async(first)
    with pytest.raises(InvalidValueError, match="free pending"):
        with cuproc.capture(second):
            buf.free_async(second)
    buf.free_async()                                           # outside a capture: the pending free stands
    freeing = frees.instantiate()
    freeing.launch(first)
    first.synchronize()
    assert not buf.allocated
    exe.launch(kit.stream)                                     # allocated again, and freed once more below
    kit.stream.synchronize()
    buf.free_async()
    kit.stream.synchronize()


def test_an_older_freeing_graph_let_go_leaves_a_newer_pending_free_pending(kit):
    """One capture's free launched, the memory allocated again, then freed into a second capture: the first
    freeing graph, dropped now, must not make the buffer usable (the state is the second free's, and that
    graph's launch still frees the memory); the second, dropped unlaunched, does."""
    g, exe, buf, other, frees, freeing = _freed_and_allocated_again(kit)
    third = Stream()
    with cuproc.capture(third) as second:
        buf.free_async(third)
    assert not buf.allocated
    del frees, freeing
    gc.collect()                                               # the first pending free goes
    assert not buf.allocated                                   # still the second's
    with pytest.raises(ClosedResourceError):
        host(buf)
    with pytest.raises(InvalidValueError, match="not launched yet"):
        exe.launch(kit.stream)
    del second
    gc.collect()                                               # the newest goes unlaunched: the buffer's again
    assert buf.allocated
    np.testing.assert_array_equal(host(buf), np.full(N, 7.0, np.float32))
    buf.free_async()
    kit.stream.synchronize()


def test_a_free_node_added_by_hand_for_a_graph_allocation_is_a_pending_free(kit):
    """Graph.add_free(buffer) of a graph allocation: pending from then (the buffer refuses use, the allocating
    graph may not launch again), made by the hand-built graph's launch (the allocating graph then launches
    again), undone when that graph goes unlaunched; refused while it is not allocated, or pending elsewhere."""
    g, exe, buf = _launched_allocation(kit)
    by_hand = Graph()
    node = by_hand.add_free(buf)
    assert isinstance(node, MemFreeNode) and node.address == buf.address and not buf.allocated
    with pytest.raises(InvalidValueError, match="free pending"):
        Graph().add_free(buf)                                  # a second free node would free it twice
    with pytest.raises(InvalidValueError, match="not launched yet"):
        exe.launch(kit.stream)
    with pytest.raises(InvalidValueError, match="memory"):
        Graph().add_child_graph(by_hand)                       # the driver clones children: refused first
    foreign = Graph()
    with pytest.raises(InvalidValueError, match="another library"):
        Graph.from_handle(handle_of(foreign)).add_free(buf)    # launches cuproc does not make could free it
    freeing = by_hand.instantiate()
    freeing.launch(kit.stream)
    kit.stream.synchronize()
    assert not buf.allocated
    with pytest.raises(InvalidValueError, match="not allocated now"):
        Graph().add_free(buf)                                  # freed: nothing to free until the next launch
    exe.launch(kit.stream)                                     # the driver found it freed
    kit.stream.synchronize()
    assert buf.allocated
    unlaunched = Graph()
    unlaunched.add_free(buf)
    assert not buf.allocated
    del unlaunched
    gc.collect()
    assert buf.allocated                                       # nothing will free it: the buffer's again
    np.testing.assert_array_equal(host(buf), np.full(N, 7.0, np.float32))
    buf.free_async()
    kit.stream.synchronize()


def test_no_node_or_edge_of_a_graph_with_memory_nodes_is_removed(kit, fk):
    """cuda.h: nodes and edges of a graph with memory alloc or free nodes cannot be removed (driver 580, and the
    fake: CUDA_ERROR_NOT_SUPPORTED).  The driver's refusal is raised with why; the node is not left marked
    destroyed (destroy, close, ``with node:``), stays usable, and the pending free it makes still frees the
    memory."""
    g, exe, buf, other, frees = _pending_free(kit)
    [node] = frees.nodes
    drv = kit.ctx.driver
    assert drv.cuGraphDestroyNode(node.handle) == drv.CUDA_ERROR_NOT_SUPPORTED      # the fake, as the driver
    for remove in (node.destroy, node.close):
        with pytest.raises(CudaError) as info:
            remove()
        assert info.value.code == drv.CUDA_ERROR_NOT_SUPPORTED and "memory alloc or free" in str(info.value.__notes__)
        assert node.ended is None and node.address == buf.address
    with pytest.raises(CudaError):
        with node:
            pass
    assert node.ended is None and frees.nodes == [node]
    by_hand = Graph()
    alloc = by_hand.add_alloc(256)
    free = by_hand.add_free(alloc, depends_on=alloc)
    for remove in (lambda: by_hand.remove_dependencies(alloc, free), lambda: free.remove_dependencies(alloc)):
        with pytest.raises(CudaError) as info:
            remove()
        assert info.value.code == drv.CUDA_ERROR_NOT_SUPPORTED and "memory alloc or free" in str(info.value.__notes__)
    assert [(a.handle, b.handle) for a, b in by_hand.edges] == [(alloc.handle, free.handle)]
    plain = Graph()
    a, b = plain.add_empty(), plain.add_empty()
    plain.add_dependencies(a, b)
    plain.remove_dependencies(a, b)                            # other graphs: as before
    b.destroy()
    assert plain.edges == [] and len(plain.nodes) == 1
    frees.instantiate().launch(other)                          # the free node is there, and frees
    other.synchronize()
    assert not buf.allocated
    exe.launch(kit.stream)
    kit.stream.synchronize()
    buf.free_async()
    kit.stream.synchronize()


def test_a_graph_with_memory_nodes_has_one_executable_graph_at_a_time(kit):
    """cuda.h: at most one executable graph of a graph with memory nodes exists at a time; driver 580 counts one
    updated with the graph too (CUDA_ERROR_NOT_SUPPORTED, as the fake).  The error says so; once that executable
    graph is destroyed, the graph instantiates again."""
    g, exe, buf, other, frees = _pending_free(kit)
    first = frees.instantiate()
    with pytest.raises(GraphInstantiateError, match="one executable graph at a time") as info:
        frees.instantiate()
    assert info.value.code == kit.ctx.driver.CUDA_ERROR_NOT_SUPPORTED
    by_hand = Graph()
    by_hand.add_free(buf.address)                              # the same shape, untracked address
    updated = by_hand.instantiate()
    with pytest.raises(GraphUpdateError, match="one executable graph at a time"):
        updated.update(frees)                                  # first is frees' executable graph
    first.destroy()
    updated.update(frees)                                      # now it is the updated one ...
    with pytest.raises(GraphInstantiateError, match="one executable graph at a time"):
        frees.instantiate()                                    # ... which the driver counts as frees'
    by_hand.instantiate().destroy()                            # and no more as by_hand's (driver 580, measured)
    updated.launch(other)
    other.synchronize()
    assert not buf.allocated
    updated.destroy()
    frees.instantiate().destroy()
    exe.launch(kit.stream)
    kit.stream.synchronize()
    buf.free_async()
    kit.stream.synchronize()


def test_a_replay_refuses_once_an_update_brought_graph_memory(kit, graphs):
    """A replay made of an executable graph that tracked nothing (a free node of a bare address), then updated
    with a captured free (a pending free its launches must commit): the replay's next call checks again and
    refuses (launch() commits the free), so no launch frees the memory behind the buffer's back."""
    g, exe, buf = _launched_allocation(kit)
    other = Stream()
    with cuproc.capture(other) as frees:
        buf.free_async(other)
    by_hand = Graph()
    by_hand.add_free(buf.address)                              # untracked: a replay is allowed
    updated = by_hand.instantiate()
    replay = updated.replay(other)
    updated.update(frees)
    before = graphs.launches()
    with pytest.raises(InvalidValueError, match="launch it with launch"):
        replay()
    assert graphs.launches() == before and not buf.allocated
    updated.launch(other)                                      # commits the pending free
    other.synchronize()
    updated.destroy()
    del frees, by_hand
    gc.collect()
    assert not buf.allocated                                   # freed, not "allocated again"
    exe.launch(kit.stream)
    kit.stream.synchronize()
    assert buf.allocated
    buf.free_async()
    kit.stream.synchronize()


def test_a_graph_allocation_collected_before_its_pending_free_is_freed_by_the_undo(kit, fk):
    """A graph allocation and the graph of a pending free of it collected together (a reference cycle through
    that graph): whichever finalizer runs first, the memory is freed once (the allocating graph launches again:
    the fake, as the driver, refuses that while it is allocated).  The allocation's finalizer first is made
    sure of by calling it first (the collector's order is its own)."""
    for finalizer_first in (True, False):
        g, exe, buf = _launched_allocation(kit)
        other = Stream()
        with cuproc.capture(other) as frees:
            buf.free_async(other)
        if finalizer_first:
            buf.__del__()                                      # as the collector does, the allocation first
            assert buf.ended == DROPPED_PENDING
        frees.cycle = frees                                    # a user's reference cycle through the graph
        del frees, buf
        gc.collect()
        kit.stream.synchronize()
        exe.launch(kit.stream)                                 # the memory was freed: the driver agrees
        kit.stream.synchronize()
        exe.destroy()
        del g, exe
        gc.collect()


def test_an_older_pending_free_let_go_in_another_thread_never_undoes_a_newer_one(kit, monkeypatch):
    """An older pending free's finalizer (another thread's collection) tests whether it is the newest and, if
    so, undoes: a free node added meanwhile by another thread must wait for that step (one lock), or the older
    one undoes the newer's state and the buffer reads allocated while a graph still frees it.  The window is
    widened by a slow lookup in the finalizer's thread."""
    import threading
    import time
    from cuproc import graph_nodes
    g, exe, buf, other, frees, freeing = _freed_and_allocated_again(kit)

    class Slow(dict):
        def get(self, key, default=None):
            value = dict.get(self, key, default)
            if threading.current_thread().name == "collector":
                time.sleep(0.2)                                # another thread runs here
            return value
    monkeypatch.setattr(graph_nodes, "_NEWEST_FREE", Slow(graph_nodes._NEWEST_FREE))
    holder = [frees, freeing]
    del frees, freeing

    def collect():
        holder.clear()
        gc.collect()
    t = threading.Thread(target=collect, name="collector")
    t.start()
    time.sleep(0.05)
    by_hand = Graph()
    by_hand.add_free(buf)                                      # the newest pending free
    t.join(10)
    assert not buf.allocated                                   # still by_hand's to free
    by_hand.instantiate().launch(kit.stream)
    kit.stream.synchronize()
    assert not buf.allocated
    exe.launch(kit.stream)
    kit.stream.synchronize()
    buf.free_async()
    kit.stream.synchronize()


def test_two_freeing_graphs_of_one_allocation_launched_from_two_threads_free_it_once(kit):
    """Two different graphs that free one allocation (an older free launched, the memory allocated again, a newer
    free pending: both find it allocated): launched from two threads at once, the checks, launches and commits
    of graph-memory launches are one step across executable graphs (one lock), so one frees and the other is
    refused before the driver (never a second free)."""
    import threading
    g, exe, buf, other, frees, older = _freed_and_allocated_again(kit)
    third = Stream()
    with cuproc.capture(third) as second:
        buf.free_async(third)
    newer = second.instantiate()
    started, outcomes = threading.Barrier(2), []
    for e in (older, newer):
        graph_launch = e._graph_launch

        def slowly(*args, graph_launch=graph_launch):
            threading.Event().wait(0.05)           # between the check and the commit: the window
            return graph_launch(*args)
        e._graph_launch = slowly

    def run(e, s):
        started.wait(10)
        try:
            e.launch(s)
            outcomes.append("launched")
        except CudaError as exc:
            outcomes.append("refused" if exc.refused else f"driver: {exc.name}")
    threads = [threading.Thread(target=run, args=pair) for pair in ((older, other), (newer, third))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    other.synchronize()
    third.synchronize()
    assert sorted(outcomes) == ["launched", "refused"], outcomes
    assert not buf.allocated
    older.destroy()
    newer.destroy()


def test_a_collection_while_a_free_node_is_added_never_undoes_it(kit, monkeypatch):
    """An older pending free finalized by a collection in the same thread while a newer free node is being added
    (the collection triggered by making the new pending free) is no longer the newest by then: the buffer stays
    pending, the new graph's to free."""
    from cuproc import graph_nodes
    g, exe, buf, other, frees, freeing = _freed_and_allocated_again(kit)   # the older free's entry the newest
    frees.cycle = frees                                        # the older freeing graph ends by a collection only
    freeing.destroy()
    del frees, freeing
    serials = graph_nodes._FREE_SERIALS

    class CollectFirst:
        def __iter__(self):
            return self

        def __next__(self):
            gc.collect()                                       # a collection as the new PendingFree is made
            return next(serials)
    monkeypatch.setattr(graph_nodes, "_FREE_SERIALS", CollectFirst())
    by_hand = Graph()
    by_hand.add_free(buf)
    assert not buf.allocated
    monkeypatch.undo()
    by_hand.instantiate().launch(kit.stream)
    kit.stream.synchronize()
    exe.launch(kit.stream)
    kit.stream.synchronize()
    buf.free_async()
    kit.stream.synchronize()


def test_a_replay_checks_its_own_stream_whoever_checked_the_executable_graph(kit, graphs):
    """A replay's stream closed, then the executable graph checked by someone else (launch on another stream,
    upload, another replay): the replay still refuses before the driver sees its stream's handle, which the
    driver hands out again."""
    g = Graph()
    g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(3.0)))
    exe = g.instantiate()
    for other_check in ("launch", "upload", "replay"):
        s = Stream()
        replay = exe.replay(s)
        replay()
        s.synchronize()
        s.close()
        reused = Stream()
        if other_check == "launch":
            exe.launch(reused)
        elif other_check == "upload":
            exe.upload(reused)
        else:
            exe.replay(reused)()
        reused.synchronize()
        before = graphs.launches()
        with pytest.raises(ClosedResourceError, match="stream"):
            replay()
        assert graphs.launches() == before
        reused.close()


_DEADLOCK_PREAMBLE = """
import gc, threading, time
from cuproc import memory as mem
from cuproc import _dlpack, stream_capture
pc = cuproc.use_device(0)
s = cuproc.Stream()

def launched_allocation():
    with cuproc.capture(s) as g:
        buf = mem.alloc_async(256, s)
    exe = g.instantiate()
    exe.launch(s)
    s.synchronize()
    return g, exe, buf

gc.disable()
# a pending free of another allocation in a reference cycle: garbage only a collection finds
g2, exe2, buf2 = launched_allocation()
o2 = cuproc.Stream()
with cuproc.capture(o2) as frees2:
    buf2.free_async(o2)
frees2.cycle = frees2
del frees2

def probe(a, b, timeout=5.0):
    ta, tb = threading.Thread(target=a, daemon=True), threading.Thread(target=b, daemon=True)
    tb.start(); ta.start()
    ta.join(timeout); tb.join(0.1)
    print("DEADLOCK" if ta.is_alive() and tb.is_alive() else "ok", flush=True)
    os._exit(0)
"""


@pytest.mark.parametrize("case", ["dlpack lock", "capture lock"])
def test_a_pending_free_collected_under_another_lock_never_deadlocks(fk, case):
    """A pending free's finalizer (a collection) runs wherever objects are made, also under another module's
    lock: the DLPack export table's (while another thread adds a free node of an exported buffer), and the stream
    capture table's during a global capture (the collected allocation's memory freed, its drop put off).  Neither
    waits forever: _PENDING_LOCK is held around plain stores only, and the capture table's lock is re-entrant."""
    body = {
        "dlpack lock": """
g, exe, buf = launched_allocation()
capsule = buf.__dlpack__()          # an export alive: add_free asks has_views()
by_hand = cuproc.Graph()
b_holds = threading.Event()

def a():
    b_holds.wait()
    try:
        by_hand.add_free(buf)
    except BufferError:
        pass

def b():
    with _dlpack._lock:
        b_holds.set()
        time.sleep(0.3)
        gc.collect()                # the pending free's finalizer: undo
probe(a, b)
""",
        "capture lock": """
g, exe, buf = launched_allocation()
o = cuproc.Stream()
with cuproc.capture(o) as frees:
    buf.free_async(o)
frees.cycle = frees
del frees, buf
done = threading.Event()
cap_stream = cuproc.Stream()

def a():
    with cuproc.capture(cap_stream):        # global: releases put off (DEFER_DROP)
        with stream_capture._lock:
            gc.collect()                    # the allocation and its pending free: freed, put off
    done.set()

def b():
    done.wait()
probe(a, b)
"""}[case]
    proc = run_python(child_preamble(fk.path) + _DEADLOCK_PREAMBLE + body, timeout=60)
    assert proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-2000:]


def test_one_freeing_graph_launched_from_two_threads_frees_once(kit):
    """The executable graph of a captured free (one only: the driver allows one per graph with memory nodes),
    launched from two threads at once: its check that the memory is allocated, the launch and the commit are one
    step, so one launch frees the memory and the other is refused before the driver (never a second free the
    driver must answer)."""
    import threading
    g, exe, buf = _launched_allocation(kit)
    other = Stream()
    with cuproc.capture(other) as frees:
        buf.free_async(other)
    freeing = frees.instantiate()
    started, outcomes = threading.Barrier(2), []
    graph_launch = freeing._graph_launch

    def slowly(*args):
        threading.Event().wait(0.05)               # between the check and the commit: the window
        return graph_launch(*args)
    freeing._graph_launch = slowly

    def run():
        started.wait(10)
        try:
            freeing.launch(other)
            outcomes.append("launched")
        except CudaError as exc:
            outcomes.append("refused" if exc.refused else f"driver: {exc.name}")
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    other.synchronize()
    assert sorted(outcomes) == ["launched", "refused"], outcomes
    assert not buf.allocated
    freeing.destroy()


def test_closing_a_graph_allocation_never_frees_into_a_capture_of_its_stream(kit):
    """close() frees on the launch's stream -- but not while that stream is being captured: the free would be
    a node of that capture's graph, and the memory would stay allocated.  The synchronous free is used."""
    g, exe, buf = _launched_allocation(kit)
    with cuproc.capture(kit.stream, mode="relaxed") as unrelated:
        buf.close()
    assert not buf.allocated and unrelated.nodes == []
    exe.launch(kit.stream)                                     # the memory was freed: the driver agrees
    kit.stream.synchronize()
    buf.free_async()


def _pending_free(kit):
    """``_launched_allocation`` and then a capture on another stream that frees the buffer: (the allocating
    graph, its executable graph, the buffer, the other stream, the freeing graph); the free is pending."""
    g, exe, buf = _launched_allocation(kit)
    other = Stream()
    with cuproc.capture(other) as frees:
        buf.free_async(other)
    assert not buf.allocated
    return g, exe, buf, other, frees


def _freed_and_allocated_again(kit):
    """``_pending_free``, its free made by a launch of the freeing graph, then the allocating graph launched again:
    (the allocating graph, its executable graph, the buffer, the other stream, the freeing graph, its executable
    graph); the buffer is allocated, and the freeing graph's pending free is the newest, committed."""
    g, exe, buf, other, frees = _pending_free(kit)
    freeing = frees.instantiate()
    freeing.launch(other)                                      # the (older) free made
    other.synchronize()
    exe.launch(kit.stream)                                     # allocated again
    kit.stream.synchronize()
    assert buf.allocated
    return g, exe, buf, other, frees, freeing


def test_a_graph_that_frees_or_allocates_graph_memory_is_never_a_child_graph(kit):
    """The driver clones a child graph and refuses one with memory alloc or free nodes (cuda.h,
    CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE): cuproc refuses a captured one before it, so a pending free is
    made by its own graph's launches only -- no parent's launch frees the memory behind the buffer's back."""
    g, exe, buf, other, frees = _pending_free(kit)
    parent = Graph()
    for child in (frees, g):
        with pytest.raises(InvalidValueError, match="memory") as info:
            parent.add_child_graph(child)
        assert info.value.refused
    assert parent.nodes == [] and not buf.allocated
    drv = kit.ctx.driver
    node = ffi.new("CUgraphNode *")
    assert drv.cuGraphAddChildGraphNode(node, parent.handle, ffi.NULL, 0, frees.handle) != 0   # the fake agrees
    freeing = frees.instantiate()
    freeing.launch(other)
    other.synchronize()
    exe.launch(kit.stream)                                     # freed by that launch only: allocated again
    kit.stream.synchronize()
    assert buf.allocated
    buf.free_async()
    kit.stream.synchronize()


def test_an_update_with_a_captured_graph_takes_its_pending_frees(kit):
    """An executable graph updated with a captured graph's nodes frees what that graph's free nodes free:
    its launch commits the pending free (the buffer reads freed, and stays so when the captured graph goes),
    so the allocating graph launches again and nothing frees the memory a second time."""
    g, exe, buf, other, frees = _pending_free(kit)
    by_hand = Graph()
    by_hand.add_free(buf.address)                              # the same shape: one free node, same address
    updated = by_hand.instantiate()
    updated.update(frees)
    updated.launch(other)
    other.synchronize()
    assert not buf.allocated
    del frees
    gc.collect()
    assert not buf.allocated                                   # committed: never undone into "allocated"
    exe.launch(kit.stream)                                     # the memory was freed: the driver agrees
    kit.stream.synchronize()
    assert buf.allocated
    buf.free_async()
    kit.stream.synchronize()


def test_a_destroyed_executable_graph_lets_go_of_its_pending_frees(kit):
    """Destroying the only holder of a pending free that no launch made undoes it at once (not when the object
    is collected): the buffer is allocated and usable again, and frees for real."""
    g, exe, buf, other, frees = _pending_free(kit)
    freeing = frees.instantiate()
    del frees
    gc.collect()
    assert not buf.allocated                                   # the executable graph still holds the free
    freeing.destroy()
    assert buf.allocated
    np.testing.assert_array_equal(host(buf), np.full(N, 7.0, np.float32))
    buf.free_async()
    exe.launch(kit.stream)
    kit.stream.synchronize()
    buf.free_async()
    kit.stream.synchronize()


def test_closing_a_graph_allocation_during_a_global_capture_of_its_stream_is_refused(kit):
    """close() while its stream is captured in mode "global" would take cuMemFree, which that capture prohibits
    (the driver refuses it and invalidates the capture): cuproc refuses it first, the buffer stays allocated
    and the capture ends well; closed afterwards, it is freed."""
    g, exe, buf = _launched_allocation(kit)
    with cuproc.capture(kit.stream) as unrelated:
        with pytest.raises(CudaError) as info:
            buf.close()
        assert info.value.refused and info.value.name == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
        assert buf.allocated
    assert unrelated.nodes == [] and capture_status(kit.stream) == "none"
    other = Stream()
    with cuproc.capture(other):                                # another stream's capture: cuMemFreeAsync on its own
        buf.close()
    assert not buf.allocated
    exe.launch(kit.stream)                                     # the memory was freed: the driver agrees
    kit.stream.synchronize()
    buf.close()
    kit.stream.synchronize()


def test_a_buffer_allocated_and_freed_in_the_capture_is_a_free_node(kit):
    with cuproc.capture(kit.stream) as g:
        tmp = mem.alloc_async(4 * N, kit.stream)
        kit.fill.launch(1, N, (tmp, np.int32(N), np.float32(1.0)), stream=kit.stream)
        kit.vadd.launch(1, N, (tmp, kit.b, kit.c, np.int32(N)), stream=kit.stream)
        tmp.free_async()
    assert type(tmp) is DeviceBuffer and tmp.ended == "freed"
    assert [type(n) for n in g.nodes].count(MemFreeNode) == 1
    exe = g.instantiate()
    for _ in range(3):
        exe.launch(kit.stream)                                 # freed in the graph: relaunches need nothing
    np.testing.assert_array_equal(host(kit.c), np.full(N, 2.0, np.float32))


def test_pool_memory_freed_inside_a_capture_is_refused_and_stays_usable(kit, graphs):
    pre = mem.alloc_async(4 * N, kit.stream)
    with pytest.raises(CudaError) as info:
        with cuproc.capture(kit.stream):
            pre.free_async()                                   # the driver frees only graph memory in a capture
    assert any("allocated outside the stream capture" in n for n in getattr(info.value, "__notes__", []))
    assert pre.ended is None and capture_status(kit.stream) == "none"
    mem.memset(pre, 1, stream=kit.stream)
    pre.free_async()                                           # still its pool's, freed once
    kit.stream.synchronize()
    assert pre.ended == "freed"


def test_synchronous_memory_freed_inside_a_capture_is_refused_and_stays_usable(kit, graphs):
    """cuMemAlloc memory (no stream-ordered entry): the refusal keeps the driver's error and the buffer."""
    pre = DeviceBuffer(4 * N)
    with pytest.raises(CudaError) as info:
        with cuproc.capture(kit.stream):
            pre.free_async(kit.stream)
    assert not isinstance(info.value, TypeError) and pre.ended is None
    assert None not in kit.stream.context.stream_ordered and capture_status(kit.stream) == "none"
    mem.memset(pre, 1, stream=kit.stream)
    pre.free()
    assert pre.ended is not None


def test_a_graph_allocation_with_a_dlpack_export_is_not_freed(kit):
    from cuproc import _dlpack
    g, buf = _capture_allocating(kit)
    exe = g.instantiate()
    exe.launch(kit.stream)
    exported = _dlpack.consume(buf.__dlpack__(max_version=(1, 0)))
    with pytest.raises(BufferError):
        buf.free_async()                                       # a consumer still reads it
    assert buf.allocated
    exported.release()
    gc.collect()
    buf.free_async()
    kit.stream.synchronize()
    assert not buf.allocated


def test_a_value_packed_under_the_executables_lock_may_launch_it(kit):
    """set_kernel_args packs under the executable graph's lock, and packing runs the values' own Python: a
    value that launches the same executable graph (here its __cuda_array_interface__) must not hang its thread."""
    import threading
    g = Graph()
    node = g.add_kernel(kit.fill, 1, N, (kit.a, np.int32(N), np.float32(1.0)))
    exe = g.instantiate()

    class Launching:
        @property
        def __cuda_array_interface__(self) -> dict:
            exe.launch(kit.stream)
            return kit.a.__cuda_array_interface__
    done = []
    worker = threading.Thread(target=lambda: done.append(
        exe.set_kernel_args(node, (Launching(), np.int32(N), np.float32(3.0)))), daemon=True)
    worker.start()
    worker.join(10)
    assert done == [None], "set_kernel_args hung on its own lock"
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(kit.a), np.full(N, 3.0, np.float32))
    exe.destroy()
    g.destroy()


def test_kernel_args_set_through_the_nodes_of_the_updated_graph(kit):
    """After update(g2), g2's nodes address the executable graph's nodes (the driver takes g1's handles)."""
    g1 = _fill_graph(kit, kit.a)
    exe = g1.instantiate()
    g2 = Graph()
    n2 = g2.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(2.0)))
    exe.update(g2)
    exe.set_kernel_args(n2, (kit.c, np.int32(N), np.float32(6.0)))
    exe.launch(kit.stream)
    np.testing.assert_array_equal(host(kit.c), np.full(N, 6.0, np.float32))
    del g1
    gc.collect()                                               # the driver names nodes by g1's: gone now
    with pytest.raises(InvalidValueError, match="instantiated from, which is gone"):
        exe.set_kernel_args(n2, (kit.c, np.int32(N), np.float32(8.0)))


@contextlib.contextmanager
def _adopted_graph_with_a_dead_kernel_node(kit):
    """(driver, the raw CUgraph, its adopted Graph, a fill_value node cuproc added that the owner then destroyed
    behind cuproc's back); the raw graph is destroyed afterwards."""
    drv = kit.ctx.driver
    raw = ffi.new("CUgraph *")
    drv.check(drv.cuGraphCreate(raw, 0), "cuGraphCreate")
    try:
        g = Graph.from_handle(raw[0])
        old = g.add_kernel(kit.fill, 1, N, (kit.c, np.int32(N), np.float32(1.0)))
        drv.check(drv.cuGraphDestroyNode(old.handle), "cuGraphDestroyNode")     # behind cuproc's back
        yield drv, raw, g, old
    finally:
        drv.check(drv.cuGraphDestroy(raw[0]), "cuGraphDestroy")


def test_an_adopted_graph_never_takes_a_dead_nodes_record_for_a_reused_handle(kit, graphs):
    """Another library's graph: cuproc adds a kernel node; the owner destroys it and adds a memset node,
    which the driver gives the same handle.  The adopted graph describes the new node, not the dead one."""
    with _adopted_graph_with_a_dead_kernel_node(kit) as (drv, raw, g, old):
        node = ffi.new("CUgraphNode *")
        p = ffi.new("CUDA_MEMSET_NODE_PARAMS_v1 *")
        p.dst, p.value, p.elementSize, p.width, p.height, p.pitch = kit.c.address, 5, 1, 4 * N, 1, 4 * N
        drv.check(drv.cuGraphAddMemsetNode(node, raw[0], ffi.NULL, 0, p, kit.ctx.handle), "memset node")
        assert handle_of(old) == int(ffi.cast("uintptr_t", node[0]))          # the fake reuses handles
        (now,) = g.nodes
        assert isinstance(now, MemsetNode) and now != old and now.record.kernel is None
        assert old.closed                                                    # the dead node refuses
        exe = g.instantiate()
        exe.launch(kit.stream)
        np.testing.assert_array_equal(host(kit.c, 4 * N, np.uint8), np.full(4 * N, 5, np.uint8))
        del exe, g, now, old
        gc.collect()


def test_an_adopted_graph_never_packs_a_dead_kernel_nodes_signature_for_another_kernel(kit, graphs):
    """Another library's graph: cuproc adds a fill_value node; the owner destroys it and adds a VecAdd_kernel
    node, which the driver gives the same handle.  Both are kernel nodes: the record of the dead one (its
    function, signature and arguments) is not taken for the new one (cuGraphKernelNodeGetParams names
    another function), so new arguments are never packed by fill_value's signature for VecAdd_kernel."""
    from cuproc.graph_nodes import param_struct
    with _adopted_graph_with_a_dead_kernel_node(kit) as (drv, raw, g, old):
        values = [ffi.new("CUdeviceptr *", b.address) for b in (kit.a, kit.b, kit.c)] + [ffi.new("int *", N)]
        p = ffi.new(ffi.getctype(param_struct(drv, "cuGraphAddKernelNode", 4), "*"))
        p.func, p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ = kit.vadd.handle, 1, 1, 1, N, 1, 1
        p.kernelParams = params = ffi.new("void *[]", [ffi.cast("void *", v) for v in values])
        node = ffi.new("CUgraphNode *")
        drv.check(drv.cuGraphAddKernelNode(node, raw[0], ffi.NULL, 0, p), "kernel node")
        assert handle_of(old) == int(ffi.cast("uintptr_t", node[0]))          # the fake reuses handles
        (now,) = g.nodes
        assert isinstance(now, KernelNode) and now != old and now.record.kernel is None
        assert old.closed                                                    # the dead node refuses
        assert int(ffi.cast("uintptr_t", now.params.function)) == handle_of(kit.vadd)   # the raw CUfunction
        exe = g.instantiate()
        with pytest.raises(InvalidValueError, match="not made by cuproc"):
            exe.set_kernel_args(now, (kit.c, np.int32(N), np.float32(7.0)))
        exe.launch(kit.stream)
        np.testing.assert_array_equal(host(kit.c), np.arange(N, dtype=np.float32) + 1)
        del exe, g, now, old, params
        gc.collect()


def test_an_exception_leaving_a_capture_on_another_thread_stays_the_one_raised(kit):
    cm = cuproc.capture(kit.stream)
    with _captured_on_another_thread(kit, cm):
        error = KeyError("the block's own")
        with pytest.warns(CudaWarning, match="another thread"):
            assert not cm.__exit__(KeyError, error, None)       # not suppressed: the with statement re-raises it
        assert any("another thread" in n for n in error.__notes__)
        assert capture_status(kit.stream) == "active"
    assert capture_status(kit.stream) == "none"


def test_a_launch_waits_for_an_update_from_another_thread(kit, monkeypatch):
    """update() and launch() share the executable graph's lock: no launch runs while an update is made."""
    import threading
    import time
    drv = kit.ctx.driver
    updating, overlaps = [False], []
    real_update, real_launch = drv.cuGraphExecUpdate, drv.cuGraphLaunch

    def slow_update(*args):
        updating[0] = True
        time.sleep(0.02)
        try:
            return real_update(*args)
        finally:
            updating[0] = False

    def watched_launch(*args):
        overlaps.append(updating[0])
        return real_launch(*args)

    monkeypatch.setattr(drv, "cuGraphExecUpdate", slow_update)
    monkeypatch.setattr(drv, "cuGraphLaunch", watched_launch)
    exe = _fill_graph(kit, kit.c).instantiate()
    graphs_ = [_fill_graph(kit, kit.c), _fill_graph(kit, kit.a)]
    stop = threading.Event()

    def launcher():
        while not stop.is_set():
            exe.launch(kit.stream)

    t = threading.Thread(target=launcher)
    t.start()
    try:
        for i in range(10):
            exe.update(graphs_[i % 2])
    finally:
        stop.set()
        t.join()
    kit.stream.synchronize()
    assert overlaps and not any(overlaps)
