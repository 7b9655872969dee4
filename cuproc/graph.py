"""CUDA graphs: a :class:`Graph` is built node by node (or made by a stream capture), then instantiated
into a :class:`~cuproc.graph_exec.GraphExec`.

The graph layer's modules, bottom up: :mod:`cuproc.graph_errors` (the refusals and shared rules),
:mod:`cuproc.graph_nodes` (the node kinds and their parameters), :mod:`cuproc.graph_structure` (handle,
lifetime, nodes, edges and records of any graph), :mod:`cuproc.graph_picture` (the DOT picture),
:mod:`cuproc.graph_exec` (instantiation, launch, update), this module (building), and
:mod:`cuproc.stream_capture` (graphs made by capturing a stream).

Policy
------
* **Building.**  ``Graph()`` is an empty graph in the current context (or
  ``context=``); ``add_kernel``, ``add_memcpy``, ``add_memset``, ``add_host``,
  ``add_event_record`` / ``add_event_wait``, ``add_child_graph``, ``add_alloc``
  / ``add_free``, ``add_empty`` and the conditional ``add_if`` /
  ``add_if_else`` / ``add_while`` / ``add_switch`` return node objects
  (:mod:`cuproc.graph_nodes`); ``depends_on=`` takes a node or several.
* **The requested version's ABIs.**  Every call is the entry point the
  handle selected: kernel node parameters v1 (11.x) or v2 (12.0+), edges with
  or without edge data (12.3+), ``cuGraphExecUpdate`` v1 or v2, the
  instantiate call (:mod:`cuproc.graph_exec`).  Conditional nodes need
  ``cuGraphConditionalHandleCreate`` *at the requested version* (12.3+): a
  handle pinned to an older one gets the dispatcher's error for that version
  (:class:`~cuproc.errors.SymbolNotFoundError`), not the driver's newer ABI.
* **What a graph holds.**  A graph keeps what its nodes refer to (the packed
  argument blocks, host callables, buffers, functions, events; a child graph's
  own references), and an executable graph keeps a copy of that: either may
  be dropped first, and a graph may go before the executable graphs made from
  it; a launch keeps what runs later (host nodes) until it ran.  A freed
  buffer or unloaded module that a graph still refers to makes
  :meth:`Graph.instantiate` and ``GraphExec.launch`` refuse with
  :class:`~cuproc.errors.ClosedResourceError` naming it, before the driver
  sees the graph.  A captured graph's nodes were made by the driver from the
  captured calls: cuproc cannot see which buffers they use, so the caller keeps
  those alive (its host functions are kept by the graph).
* **Contexts.**  A graph belongs to the context it was made in (its kernels,
  copies and memsets run there); an executable graph to the context it was
  instantiated in.  Destroying that context ends both: using either raises
  ``ClosedResourceError`` naming it.  The driver's graph outlives a context, so
  cuproc still destroys it (``cuGraphDestroy``) when the Graph goes; an
  executable graph went with its context.
"""
from __future__ import annotations

import weakref

from ._ffi import ffi
from ._support import arity, handle_int, invalid
from .context import Context
from .driver import Driver
from .graph_errors import GraphInstantiateError, GraphUpdateError, require_at_requested_version
from .graph_exec import GraphExec, instantiate
from .graph_nodes import (
    CONDITIONAL_TYPES,
    ChildGraphNode,
    ConditionalHandle,
    ConditionalNode,
    EmptyNode,
    EventRecordNode,
    EventWaitNode,
    GraphAllocation,
    GraphNode,
    HostCall,
    HostNode,
    KernelNode,
    MemAllocNode,
    MemcpyNode,
    MemFreeNode,
    MemsetNode,
    NodeRecord,
    adopted_host_call,
    alloc_params,
    apply_kernel,
    copy_struct,
    host_params,
    kernel_parts,
    kernel_struct,
    memset_struct,
    node_array,
)
from .graph_picture import GraphPicture
from .graph_structure import GraphStructure, dependencies_of

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import Any

    from .stream_capture import CaptureInfo, StreamCapture

_NODE_TYPE = ffi.typeof("CUgraphNodeType").relements
_COND_ASSIGN_DEFAULT = 1        # CU_GRAPH_COND_ASSIGN_DEFAULT


class Graph(GraphStructure, GraphPicture):
    """A CUDA graph (cuGraphCreate) in a context: nodes and their dependencies.  See the module docstring.

    ``close()`` / ``destroy()`` (idempotent) or dropping it destroys it; executable graphs made from it
    stay usable.  A graph yielded by a stream capture is usable once the ``with`` block ended."""

    def __init__(self, *, context: Context | None = None, driver: Driver | None = None) -> None:
        if context is not None:
            context = Context.given(context, "cuGraphCreate")
        ctx, _run = Context.target(context, "cuGraphCreate", driver=driver)
        drv = ctx.driver
        out = ffi.new("CUgraph *")
        drv.check(ctx.call_current(drv.cuGraphCreate, out, 0), "cuGraphCreate")
        self._setup(drv, ctx, out[0], owned=True, records={}, owner=None)

    @classmethod
    def from_handle(cls, handle: Any, *, owner: Any = None, context: Context | None = None,
                    driver: Driver | None = None) -> Graph:
        """A Graph over a CUgraph made elsewhere (cuda.core's, cuda.bindings', a raw handle or int), not owned:
        ``close()`` and dropping it never destroy the driver's graph.  It keeps ``owner`` (the library object
        the handle came from) alive as long as it lives.  Its nodes are read from the driver (cuproc keeps
        nothing for them); nodes added here are kept as for any Graph.  Its context is ``context``, else the
        current one: the context its nodes run in (a CUgraph itself belongs to none)."""
        call = "Graph.from_handle"
        if isinstance(handle, ffi.CData):
            handle = handle_int(handle)
        if not isinstance(handle, int) or isinstance(handle, bool) or handle <= 0:
            raise invalid(call, f"a graph handle is a nonzero int or a CUgraph, got {handle!r}")
        if context is not None:
            context = Context.given(context, call)
        ctx, _run = Context.target(context, call, driver=driver)
        graph = cls._view(ctx.driver, ctx, ffi.cast("CUgraph", handle))
        graph.adopted, graph.foreign_owner = True, owner
        graph._handles("cuGraphGetNodes")          # the driver's word that it is a graph (else its error)
        return graph

    # ---------------------------------------------------------------- nodes
    def _add(self, call: str, cls: type[GraphNode], depends_on: Any, args: tuple, record: NodeRecord,
             ctx: Context | None = None) -> GraphNode:
        """``call(&node, graph, deps, n, *args)`` in the graph's context; the node object of ``record``."""
        context = ctx or self._ready(call)
        deps = dependencies_of(self, depends_on, call)
        out = ffi.new("CUgraphNode *")
        drv = self.driver
        drv.check(context.call_current(getattr(drv, call), out, self.handle, node_array(deps), len(deps), *args), call)
        record.handle = handle_int(out[0])
        self._records[record.handle] = record
        return cls(self, out[0], record)

    def add_kernel(self, function: Any, grid: Any, block: Any, args: Sequence[Any] = (), *,
                   signature: Sequence[Any] | None = None, shared_mem: int = 0, depends_on: Any = None) -> KernelNode:
        """A kernel node (cuGraphAddKernelNode): ``function`` (a Function, or a library Kernel: its
        CUfunction in the graph's context) with ``args`` packed as a launch packs them."""
        call = "cuGraphAddKernelNode"
        ctx = self._ready(call)
        parts = kernel_parts(self, function, call, args, signature, grid, block, shared_mem)
        record = NodeRecord(0)
        apply_kernel(record, parts)
        node = self._add(call, KernelNode, depends_on, (kernel_struct(self.driver, call, 4, parts),), record, ctx)
        return node  # type: ignore[return-value]

    def add_memcpy(self, dst: Any, src: Any, nbytes: int | None = None, *, depends_on: Any = None) -> MemcpyNode:
        """A copy node (cuGraphAddMemcpyNode) between any two sides memory.copy takes (one context)."""
        call = "cuGraphAddMemcpyNode"
        self._ready(call)
        p, ctx, held, keep, runtime = copy_struct(self, call, dst, src, nbytes)
        record = NodeRecord(0, keep=keep, held=held)
        record.runtime = runtime
        return self._add(call, MemcpyNode, depends_on, (p, ctx.handle), record)  # type: ignore[return-value]

    def add_memset(self, dst: Any, value: int, count: int | None = None, *, element_bits: int = 8,
                   depends_on: Any = None) -> MemsetNode:
        """A fill node (cuGraphAddMemsetNode): ``count`` elements of ``element_bits`` (default: all of ``dst``)."""
        call = "cuGraphAddMemsetNode"
        self._ready(call)
        p, ctx, held, keep = memset_struct(self, call, dst, value, count, element_bits)
        record = NodeRecord(0, keep=keep, held=held)
        return self._add(call, MemsetNode, depends_on, (p, ctx.handle), record)  # type: ignore[return-value]

    def add_host(self, fn: Callable[[], Any], *, depends_on: Any = None) -> HostNode:
        """A host node (cuGraphAddHostNode): ``fn()`` on a driver thread at each launch; it must not call
        CUDA.  The graph keeps ``fn``; what it raises becomes a CudaWarning (see HostNode.errors)."""
        call = "cuGraphAddHostNode"
        self._ready(call)
        host = HostCall(fn)
        record = NodeRecord(0, keep=(host,))
        return self._add(call, HostNode, depends_on, (host_params(host),), record)  # type: ignore[return-value]

    def add_event_record(self, event: Any, *, depends_on: Any = None) -> EventRecordNode:
        """A node recording ``event`` (cuGraphAddEventRecordNode)."""
        return self._event_node("cuGraphAddEventRecordNode", EventRecordNode, event, depends_on)  # type: ignore

    def add_event_wait(self, event: Any, *, depends_on: Any = None) -> EventWaitNode:
        """A node waiting for ``event`` (cuGraphAddEventWaitNode)."""
        return self._event_node("cuGraphAddEventWaitNode", EventWaitNode, event, depends_on)  # type: ignore

    def _event_node(self, call: str, cls: type[GraphNode], event: Any, depends_on: Any) -> GraphNode:
        self._ready(call)
        from .stream import Event
        if not isinstance(event, Event):
            raise invalid(call, f"an event node takes a cuproc Event, not {type(event).__name__}")
        event.check(call)
        return self._add(call, cls, depends_on, (event.handle,), NodeRecord(0, held=(event,)))

    def add_child_graph(self, child: Graph, *, depends_on: Any = None) -> ChildGraphNode:
        """A node running a copy of ``child`` (cuGraphAddChildGraphNode); the node keeps what ``child``'s
        nodes refer to.  Later changes to ``child`` do not reach the node (change ``node.child_graph``).  A
        captured graph that allocates or frees graph memory is refused before the driver, which refuses to
        clone memory nodes (its frees are made by its own executable graph's launches only)."""
        call = "cuGraphAddChildGraphNode"
        self._ready(call)
        if not isinstance(child, Graph):
            raise invalid(call, f"a child graph node takes a cuproc Graph, not {type(child).__name__}")
        child._ready(call)
        child._check_held(call)
        if child.pending_frees or child._allocations:
            raise invalid(call, f"{child.describe()} allocates or frees graph memory (alloc_async, free_async in its "
                                "capture): the driver clones a child graph and refuses one with memory alloc or free "
                                "nodes (CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE); instantiate and launch it on its own")
        keep, held = child._everything()
        record = NodeRecord(0, keep=keep, held=held, bodies=({},))
        record.runtime = child._runtime_objects()
        return self._add(call, ChildGraphNode, depends_on, (child.handle,), record)  # type: ignore[return-value]

    def add_empty(self, *, depends_on: Any = None) -> EmptyNode:
        """A node that does nothing (cuGraphAddEmptyNode): one place for many dependencies."""
        return self._add("cuGraphAddEmptyNode", EmptyNode, depends_on, (), NodeRecord(0))  # type: ignore

    def add_alloc(self, nbytes: int, *, depends_on: Any = None) -> MemAllocNode:
        """Graph-owned device memory (cuGraphAddMemAllocNode) on the graph's device; ``node.address``."""
        call = "cuGraphAddMemAllocNode"
        self._ready(call)
        p = alloc_params(self, nbytes)
        return self._add(call, MemAllocNode, depends_on, (p,), NodeRecord(0))  # type: ignore[return-value]

    def add_free(self, memory: MemAllocNode | GraphAllocation | int, *, depends_on: Any = None) -> MemFreeNode:
        """Free graph-owned memory (cuGraphAddMemFreeNode): a MemAllocNode's, a captured graph allocation's
        (:class:`~cuproc.graph_nodes.GraphAllocation`), or an address.

        A graph allocation's free is tracked as a captured ``free_async`` is: pending from now (the buffer
        refuses use), made by this graph's launches, undone if none is made (the graph and its executable graph
        dropped unlaunched).  Only in a graph cuproc owns (not a node's body, not another library's graph).  A
        bare address is the driver's business alone: cuproc cannot tell that a buffer's memory was freed by it,
        so pass the buffer where you have one."""
        call = "cuGraphAddMemFreeNode"
        self._ready(call)
        pending = None
        if isinstance(memory, MemAllocNode):
            address = memory.address
        elif isinstance(memory, GraphAllocation):
            if not self.owned:     # a node's body, another library's graph or capture: launches cuproc never sees
                raise invalid(call, f"{self.describe()} is not a graph cuproc owns (a node's body, another library's "
                                    "graph or capture): free a graph allocation in a cuproc Graph of its own, whose "
                                    "launches (cuproc's) are what free it")
            address = memory.address
            pending = memory.free_by_node(call, self.describe())
        elif isinstance(memory, int) and not isinstance(memory, bool):
            address = memory
        else:
            raise invalid(call, f"a free node takes a MemAllocNode, a GraphAllocation or an address, not "
                                f"{type(memory).__name__}")
        try:
            node = self._add(call, MemFreeNode, depends_on, (address,), NodeRecord(0))
        except BaseException:
            if pending is not None:
                pending.undo()
            raise
        if pending is not None:
            self.free_on_launch((*self.pending_frees, pending))
        return node  # type: ignore[return-value]

    # ---------------------------------------------------------------- conditional nodes
    def conditional_handle(self, default: int | None = None) -> ConditionalHandle:
        """A handle for conditional nodes (cuGraphConditionalHandleCreate, CUDA 12.3+): each launch starts
        from ``default`` (CU_GRAPH_COND_ASSIGN_DEFAULT) or, with None, from what the last one left.  A
        kernel sets it (``cudaGraphSetConditional``); pass the handle to it as an argument."""
        call = "cuGraphConditionalHandleCreate"
        ctx = self._ready(call)
        require_at_requested_version(self.driver, call)
        if default is not None and (isinstance(default, bool) or not isinstance(default, int)
                                    or not 0 <= default < 1 << 32):
            raise invalid(call, f"default must be None or an unsigned int, got {default!r}")
        out = ffi.new("CUgraphConditionalHandle *")
        flags = 0 if default is None else _COND_ASSIGN_DEFAULT
        self.driver.check(ctx.call_current(self.driver.cuGraphConditionalHandleCreate, out, self.handle, ctx.handle,
                                           default or 0, flags), call)
        return ConditionalHandle(int(out[0]), self, default)

    def add_if(self, condition: ConditionalHandle, *, depends_on: Any = None) -> ConditionalNode:
        """IF: ``node.then_body`` runs when the condition is not 0."""
        return self._conditional("if", condition, 1, depends_on)

    def add_if_else(self, condition: ConditionalHandle, *, depends_on: Any = None) -> ConditionalNode:
        """IF/ELSE: ``node.then_body`` when the condition is not 0, ``node.else_body`` otherwise (the driver
        takes two bodies from CUDA 12.8: a handle pinned to an older version refuses, see
        ``Driver.has_feature``)."""
        return self._conditional("if", condition, 2, depends_on)

    def add_while(self, condition: ConditionalHandle, *, depends_on: Any = None) -> ConditionalNode:
        """WHILE: ``node.body`` runs again and again while the condition is not 0 (tested before each run)."""
        return self._conditional("while", condition, 1, depends_on)

    def add_switch(self, condition: ConditionalHandle, cases: int, *, depends_on: Any = None) -> ConditionalNode:
        """SWITCH: ``node.bodies[value]`` runs, none when the value is ``cases`` or more (CUDA 12.8: a handle
        pinned to an older version refuses, see ``Driver.has_feature``)."""
        if isinstance(cases, bool) or not isinstance(cases, int) or cases < 1:
            raise invalid("cuGraphAddNode", f"cases must be a positive int, got {cases!r}")
        return self._conditional("switch", condition, cases, depends_on)

    def _conditional(self, kind: str, condition: ConditionalHandle, size: int, depends_on: Any) -> ConditionalNode:
        call = "cuGraphAddNode"
        ctx = self._ready(call)
        require_at_requested_version(self.driver, "cuGraphConditionalHandleCreate")
        require_at_requested_version(self.driver, call)
        feature = "conditional_switch" if kind == "switch" else "conditional_if_else" if size == 2 else None
        if feature is not None and not self.driver.has_feature(feature):
            raise self.driver.feature_error(feature, call)
        if not isinstance(condition, ConditionalHandle):
            raise invalid(call, f"a conditional node takes the ConditionalHandle of graph.conditional_handle(), "
                                f"not {type(condition).__name__}")
        owner = condition.graph
        if owner is None or not any(g._records is condition._records for g in self._lineage()):
            raise invalid(call, "the condition belongs to another graph, not to this graph or a graph it is in")
        owner.check(call)
        deps = dependencies_of(self, depends_on, call)
        p = ffi.new("CUgraphNodeParams *")      # (zeroed: the driver wants every unused byte 0)
        p.type = _NODE_TYPE["CU_GRAPH_NODE_TYPE_CONDITIONAL"]
        p.conditional.handle = int(condition)
        p.conditional.type = CONDITIONAL_TYPES[kind]
        p.conditional.size = size
        p.conditional.ctx = ctx.handle          # (phGraph_out: the driver points it at the node's own array)
        out = ffi.new("CUgraphNode *")
        drv = self.driver
        if arity(drv, call) == 6:       # 12.3+: (node, graph, deps, edgeData, count, params)
            args: tuple = (out, self.handle, node_array(deps), ffi.NULL, len(deps), p)
        else:
            args = (out, self.handle, node_array(deps), len(deps), p)
        drv.check(ctx.call_current(drv.cuGraphAddNode, *args), call)
        record = NodeRecord(handle_int(out[0]), bodies=tuple({} for _ in range(size)))
        bodies = p.conditional.phGraph_out       # CUDA-owned, valid while the node lives: read the handles now
        if bodies == ffi.NULL or any(bodies[i] == ffi.NULL for i in range(size)):
            raise invalid(call, "the driver made the conditional node but gave no body graphs (phGraph_out)")
        record.graphs = tuple(ffi.cast("CUgraph", bodies[i]) for i in range(size))
        record.info = (kind, int(condition))
        self._records[record.handle] = record
        return ConditionalNode(self, out[0], record)


    @property
    def capture_info(self) -> CaptureInfo:
        """While this graph is being captured: its stream's capture state (:func:`cuproc.stream_capture.capture_info`)."""
        if self._capture is None:
            raise invalid("cuStreamGetCaptureInfo", "this graph is not being captured")
        return self._capture.info()

    # ---------------------------------------------------------------- instantiate
    def instantiate(self, *, flags: int | Iterable[str] = 0, upload: Any = None) -> GraphExec:
        """An executable graph (made with the graph's context current).  ``flags``: an int or names of
        CUgraphInstantiate_flags ("AUTO_FREE_ON_LAUNCH", "USE_NODE_PRIORITY", ...); ``upload``: a stream
        to upload it on at once.  The entry point is the requested version's (:mod:`cuproc.graph_exec`);
        a refusal raises :class:`GraphInstantiateError` with the driver's result, node and log."""
        return instantiate(self, flags, upload)

    def __repr__(self) -> str:
        if self.handle is None:
            return f"<cuproc.Graph {'being captured' if self._capture is not None else self.ended}>"
        state = f" {self.ended}" if self.ended else ""
        return f"<cuproc.Graph {handle_int(self.handle):#x}{state}>"

    # ---------------------------------------------------------------- capture (cuproc.stream_capture)
    @classmethod
    def _capturing(cls, context: Context, capture: StreamCapture) -> Graph:
        return cls._view(context.driver, context, None, owned=True, capture=capture)

    def _captured(self, handle: Any, allocations: Sequence[GraphAllocation] = ()) -> None:
        """The capture ended with ``handle``: this object owns it now (host functions the capture met are
        taken over from cuproc.stream's one-shot records, so that every launch runs them).  ``allocations``:
        the buffers alloc_async made in the capture that it did not free, now the graph's (its executable
        graphs track them, weakly: see GraphExec.launch)."""
        first_token = self._capture._first_token if self._capture is not None else 0
        self.handle, self._capture = handle, None
        self._allocations = tuple((buf.address, weakref.ref(buf)) for buf in allocations)
        from .stream import host_function_streams
        if host_function_streams(first_token):
            for node in self.nodes:
                if isinstance(node, HostNode):
                    self._adopt_host_node(node)

    def _adopt_host_node(self, node: HostNode) -> None:
        call = "cuGraphHostNodeGetParams"
        p = ffi.new("CUDA_HOST_NODE_PARAMS_v1 *")
        self.driver.check(self.context.call_current(self.driver.cuGraphHostNodeGetParams, node.handle, p), call)
        host = adopted_host_call(p.fn, p.userData)
        if host is None:
            return
        self.driver.check(self.context.call_current(self.driver.cuGraphHostNodeSetParams, node.handle,
                                                    host_params(host)), "cuGraphHostNodeSetParams")
        node.record.keep = (host,)

    def _discard(self, how: str) -> None:
        """The capture failed: no graph (nothing to destroy here)."""
        self._capture = None
        self._claim(how)


__all__ = ["Graph", "GraphExec", "GraphInstantiateError", "GraphUpdateError"]
