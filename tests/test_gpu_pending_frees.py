"""Pending frees of graph allocations (issue 36) on a real GPU: what tests/test_graphs_fake.py assumes of the
driver -- cuGraphAddChildGraphNode refuses a child with memory nodes, cuGraphExecUpdate takes a free node of the
same address, cuMemFree is refused during a global capture -- and cuproc's answers on top of it."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import cuproc
from cuproc import Graph, Stream
from cuproc import memory as mem
from cuproc.errors import CudaError, InvalidValueError
from cuproc.stream_capture import capture, capture_status

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

from test_gpu_graphs import BLOCK, GRID, N, host, kit  # noqa: E402, F401  (kit: the fixture)

ffi = cuproc.ffi


def _pending_free(kit):
    """(allocating graph, its executable graph launched once, the buffer, another stream, a captured graph
    freeing the buffer on it): the free is pending."""
    with capture(kit.stream) as g:
        buf = mem.alloc_async(4 * N, kit.stream)
        kit.fill.launch(GRID, BLOCK, (buf, np.int32(N), np.float32(7.0)), stream=kit.stream)
    exe = g.instantiate()
    exe.launch(kit.stream)
    kit.stream.synchronize()
    other = Stream()
    with capture(other) as frees:
        buf.free_async(other)
    assert not buf.allocated
    return g, exe, buf, other, frees


def _freed_and_allocated_again(kit):
    """``_pending_free``, its free made by a launch of the freeing graph, then the allocating graph launched again
    (the driver launches it only once the memory was freed): the buffer is allocated; (as _pending_free)."""
    g, exe, buf, other, frees = _pending_free(kit)
    frees.instantiate().launch(other)
    other.synchronize()
    exe.launch(kit.stream)
    kit.stream.synchronize()
    assert buf.allocated
    return g, exe, buf, other, frees


def _relaunched_and_freed(kit, exe, buf):
    """The allocating graph launched again (the driver does so only once the memory was freed): the buffer is
    allocated, filled again; then freed."""
    exe.launch(kit.stream)
    kit.stream.synchronize()
    assert buf.allocated
    np.testing.assert_array_equal(host(buf), np.full(N, 7.0, np.float32))
    buf.free_async()
    kit.stream.synchronize()


def test_the_driver_refuses_a_child_graph_with_memory_nodes(kit):
    """cuda.h: cuGraphAddChildGraphNode returns an error for a child with allocation or free nodes (the fake
    does the same); cuproc refuses first, and the pending free stays its own graph's."""
    g, exe, buf, other, frees = _pending_free(kit)
    parent = Graph()
    drv = kit.stream.context.driver
    node = ffi.new("CUgraphNode *")
    for child in (frees, g):
        assert drv.cuGraphAddChildGraphNode(node, parent.handle, ffi.NULL, 0, child.handle) != 0
        with pytest.raises(InvalidValueError) as info:
            parent.add_child_graph(child)
        assert info.value.refused
    assert parent.nodes == []
    freeing = frees.instantiate()
    freeing.launch(other)
    other.synchronize()
    _relaunched_and_freed(kit, exe, buf)


def test_an_update_with_a_captured_graph_takes_its_pending_frees(kit):
    """cuGraphExecUpdate of an executable graph of one free node with a captured graph's free node of the same
    address (the fake accepts it): its launch frees the memory and commits the pending free."""
    g, exe, buf, other, frees = _pending_free(kit)
    by_hand = Graph()
    by_hand.add_free(buf.address)
    updated = by_hand.instantiate()
    updated.update(frees)
    updated.launch(other)
    other.synchronize()
    del frees
    gc.collect()
    assert not buf.allocated
    _relaunched_and_freed(kit, exe, buf)


def test_closing_a_graph_allocation_during_a_global_capture_of_its_stream_is_refused(kit):
    """cuproc refuses the cuMemFree a global capture prohibits: the capture is not invalidated (its end hands
    out a graph), the buffer stays allocated, and closes afterwards."""
    g, exe, buf, other, frees = _freed_and_allocated_again(kit)
    with capture(kit.stream) as unrelated:
        with pytest.raises(CudaError) as info:
            buf.close()
        assert info.value.refused and buf.allocated
    assert unrelated.nodes == [] and capture_status(kit.stream) == "none"
    buf.close()
    assert not buf.allocated
    _relaunched_and_freed(kit, exe, buf)


def test_an_older_freeing_graph_let_go_leaves_a_newer_pending_free_pending(kit):
    """The first capture's free launched, the memory allocated again by the allocating graph, then freed into a
    second capture: dropping the first freeing graph leaves the buffer unusable (the second graph still frees
    the memory; the driver refuses the allocating graph's launch until it ran), and that launch frees it."""
    from cuproc.errors import ClosedResourceError
    g, exe, buf, other, frees = _freed_and_allocated_again(kit)
    third = Stream()
    with capture(third) as second:
        buf.free_async(third)
    del frees
    gc.collect()
    assert not buf.allocated
    with pytest.raises(ClosedResourceError):
        host(buf)
    drv = kit.stream.context.driver
    assert drv.cuGraphLaunch(exe.handle, kit.stream.handle) != 0     # the driver: the memory is still allocated
    second_exe = second.instantiate()
    second_exe.launch(third)
    third.synchronize()
    assert not buf.allocated
    _relaunched_and_freed(kit, exe, buf)


def test_a_free_node_added_by_hand_frees_a_graph_allocation(kit):
    """Graph.add_free(buffer): the hand-built graph's launch frees the memory (the driver then launches the
    allocating graph again, which it refuses while the memory is allocated)."""
    g, exe, buf, other, frees = _freed_and_allocated_again(kit)
    by_hand = Graph()
    by_hand.add_free(buf)
    assert not buf.allocated
    drv = kit.stream.context.driver
    assert drv.cuGraphLaunch(exe.handle, kit.stream.handle) != 0     # the driver: still allocated
    by_hand.instantiate().launch(kit.stream)
    kit.stream.synchronize()
    _relaunched_and_freed(kit, exe, buf)


def test_no_node_of_a_graph_with_memory_nodes_is_destroyed(kit):
    """cuda.h: nodes of a graph with memory alloc or free nodes cannot be destroyed.  The driver answers
    CUDA_ERROR_NOT_SUPPORTED (raw call, and through destroy(), whose error says why); the node stays usable:
    the free it makes still frees the memory (the driver then launches the allocating graph again)."""
    g, exe, buf, other, frees = _pending_free(kit)
    [node] = frees.nodes
    drv = kit.stream.context.driver
    assert drv.cuGraphDestroyNode(node.handle) == drv.CUDA_ERROR_NOT_SUPPORTED
    with pytest.raises(CudaError) as info:
        node.destroy()
    assert info.value.code == drv.CUDA_ERROR_NOT_SUPPORTED and "memory alloc or free" in str(info.value.__notes__)
    assert node.ended is None and node.address == buf.address and frees.nodes == [node]
    frees.instantiate().launch(other)
    other.synchronize()
    _relaunched_and_freed(kit, exe, buf)


def test_a_graph_with_memory_nodes_has_one_executable_graph_at_a_time(kit):
    """cuda.h: at most one executable graph of a graph with memory nodes; the driver counts one updated with
    the graph too (both answered CUDA_ERROR_NOT_SUPPORTED, which the error explains)."""
    from cuproc.graph import GraphInstantiateError, GraphUpdateError
    g, exe, buf, other, frees = _pending_free(kit)
    first = frees.instantiate()
    with pytest.raises(GraphInstantiateError, match="one executable graph at a time"):
        frees.instantiate()
    by_hand = Graph()
    by_hand.add_free(buf.address)
    updated = by_hand.instantiate()
    with pytest.raises(GraphUpdateError, match="one executable graph at a time"):
        updated.update(frees)
    first.destroy()
    updated.update(frees)
    with pytest.raises(GraphInstantiateError, match="one executable graph at a time"):
        frees.instantiate()
    updated.launch(other)
    other.synchronize()
    assert not buf.allocated
    updated.destroy()
    _relaunched_and_freed(kit, exe, buf)
