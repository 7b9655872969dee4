"""CUDA graphs: a :class:`Graph` of nodes, its :class:`GraphExec` (instantiated, launched, updated), and
the errors of the two steps that can refuse a graph.

Policy
------
* **Building.**  ``Graph()`` is an empty graph in the current context (or
  ``context=``); ``add_kernel``, ``add_memcpy``, ``add_memset``, ``add_host``,
  ``add_event_record`` / ``add_event_wait``, ``add_child_graph``, ``add_alloc``
  / ``add_free``, ``add_empty`` and the conditional ``add_if`` /
  ``add_if_else`` / ``add_while`` / ``add_switch`` return node objects
  (:mod:`cuproc.graph_nodes`); ``depends_on=`` takes a node or several.  A
  stream capture (:mod:`cuproc.stream_capture`) makes a Graph too.
* **The requested version's ABIs.**  Every call is the entry point the
  handle selected: kernel node parameters v1 (11.x) or v2 (12.0+), edges with
  or without edge data (12.3+), ``cuGraphExecUpdate`` v1 or v2.  Instantiation
  takes ``cuGraphInstantiateWithParams`` where the requested version has it
  (12.0+: flags, an upload stream, the error node and result); before that
  ``cuGraphInstantiate`` -- the 11.x five-argument ABI, with its error node and
  log -- or, for flags, ``cuGraphInstantiateWithFlags``.  Conditional nodes need
  ``cuGraphConditionalHandleCreate`` *at the requested version* (12.3+): a
  handle pinned to an older one gets the dispatcher's error for that version
  (:class:`~cuproc.errors.SymbolNotFoundError`), not the driver's newer ABI.
* **What a graph holds.**  A graph keeps what its nodes refer to (the packed
  argument blocks, host callables, buffers, functions, events; a child graph's
  own references), and an executable graph keeps a copy of that: either may
  be dropped first, and a graph may go before the executable graphs made from
  it.  A freed buffer or unloaded module that a graph still refers to makes
  :meth:`Graph.instantiate` and :meth:`GraphExec.launch` refuse with
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
* **Launching** on any stream of the graph's context, or on a default stream
  (then in the executable graph's context): :meth:`GraphExec.launch` checks,
  once per resource epoch, what the graph holds, and each buffer on every
  launch (memory ends without moving the epoch).
"""
from __future__ import annotations

import os
import weakref

from ._ffi import ffi
from ._resource import EPOCH, FORKED, Resource
from ._support import arity, handle_int, invalid
from .context import Context
from .driver import Driver
from .errors import ClosedResourceError, CudaError, result_code
from .graph_nodes import (
    CONDITIONAL_TYPES,
    ChildGraphNode,
    ConditionalHandle,
    ConditionalNode,
    EmptyNode,
    EventRecordNode,
    EventWaitNode,
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
    node_class,
)
from .stream import Stream, stream_handle

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import Any

    from .stream_capture import CaptureInfo, StreamCapture

_UPDATE_FAILURE = result_code("CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE")
_INSTANTIATE_FLAGS = ffi.typeof("CUgraphInstantiate_flags").relements
_INSTANTIATE_RESULTS = ffi.typeof("CUgraphInstantiateResult").elements
_UPDATE_RESULTS = ffi.typeof("CUgraphExecUpdateResult").elements
_DOT_FLAGS = ffi.typeof("CUgraphDebugDot_flags").relements
_NODE_TYPE = ffi.typeof("CUgraphNodeType").relements
_COND_ASSIGN_DEFAULT = 1        # CU_GRAPH_COND_ASSIGN_DEFAULT
_LOG_SIZE = 4096                # cuGraphInstantiate's (11.x ABI) log buffer


class GraphInstantiateError(CudaError):
    """cuGraphInstantiate* refused the graph: ``result`` is the driver's CUgraphInstantiateResult name
    (None from the 11.x ABI, which has none), ``node`` the node it names (or None), ``log`` its text."""

    result: str | None = None
    node: GraphNode | None = None
    log: str = ""


class GraphUpdateError(CudaError):
    """cuGraphExecUpdate could not apply the graph: ``reason`` is the driver's CUgraphExecUpdateResult
    name, ``node`` the node of the new graph it names (or None), ``from_node`` the edge's other end
    where the driver gives one.  The executable graph is unchanged."""

    reason: str | None = None
    node: GraphNode | None = None
    from_node: GraphNode | None = None


def _with_details(cls: type, base: CudaError, details: str, **attributes: Any) -> CudaError:
    """``base`` (the driver's error for the call) as ``cls``, its hint extended by ``details``."""
    hint = "; ".join(filter(None, [details, base.hint]))
    err = cls(base.code, base.call, name=base.name, description=base.description, hint=hint)
    for key, value in attributes.items():
        setattr(err, key, value)
    return err


def _dependencies(graph: Graph, depends_on: Any, call: str) -> list[GraphNode]:
    """``depends_on`` (None, a node, or nodes) as a list of live nodes of ``graph``."""
    if depends_on is None:
        return []
    nodes = [depends_on] if isinstance(depends_on, GraphNode) else list(depends_on)
    for node in nodes:
        if not isinstance(node, GraphNode):
            raise invalid(call, f"depends_on takes graph nodes, not {type(node).__name__}")
        node.check(call)
        if node.graph._records is not graph._records:
            raise invalid(call, f"{node.describe()} is not a node of {graph.describe()}")
    return nodes


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (3.11+); on 3.10 the note is kept in ``__notes__`` all the same."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]


def require_at_requested_version(driver: Driver, name: str) -> None:
    """Raise the dispatcher's error for ``name`` at the handle's requested version unless the function
    exists there (a newer-driver feature is not taken: its ABI is not the requested version's)."""
    if driver.has(name, newer_driver_features=False):
        return
    err = driver.unavailable_error(driver.resolution(name, driver.version))
    add_note(err, f"cuproc's graph layer uses only the ABIs of the requested version (CUDA {driver.version}); "
                 f"request a version that has {name} (cuproc.Driver(version=...)) to use it")
    raise err


class Graph(Resource):
    """A CUDA graph (cuGraphCreate) in a context: nodes and their dependencies.  See the module docstring.

    ``close()`` / ``destroy()`` (idempotent) or dropping it destroys it; executable graphs made from it
    stay usable.  A graph yielded by a stream capture is usable once the ``with`` block ended."""

    _release_call = "cuGraphDestroy"
    _ended_word = "destroyed"

    def __init__(self, *, context: Context | None = None, driver: Driver | None = None) -> None:
        if context is not None:
            context = Context.given(context, "cuGraphCreate")
        ctx, _run = Context.target(context, "cuGraphCreate", driver=driver)
        drv = ctx.driver
        out = ffi.new("CUgraph *")
        drv.check(ctx.call_current(drv.cuGraphCreate, out, 0), "cuGraphCreate")
        self._setup(drv, ctx, out[0], owned=True, records={}, owner=None)

    def _setup(self, driver: Driver, context: Context, handle: Any, *, owned: bool, records: dict[int, NodeRecord],
               owner: GraphNode | None, capture: StreamCapture | None = None) -> None:
        self.driver = driver
        self.context = context
        self.handle = handle
        self.owned = owned            # False: a body, a child graph node's graph, a capture's graph in progress
        self.owner = owner            # the node whose body this graph is
        self._records = records       # node handle -> what it refers to (shared by a body's views)
        self._capture = capture       # the StreamCapture making this graph, while it runs
        self.ended = None

    @classmethod
    def _view(cls, driver: Driver, context: Context, handle: Any, *, owner: GraphNode | None = None,
              records: dict[int, NodeRecord] | None = None, owned: bool = False,
              capture: StreamCapture | None = None) -> Graph:
        graph = cls.__new__(cls)
        graph._setup(driver, context, handle, owned=owned, records={} if records is None else records, owner=owner,
                     capture=capture)
        return graph

    def _body(self, handle: Any, node: GraphNode, records: dict[int, NodeRecord]) -> Graph:
        """A graph owned by ``node`` (a conditional body, a child graph node's copy), with its records."""
        return Graph._view(self.driver, self.context, ffi.cast("CUgraph", handle), owner=node, records=records)

    # ---------------------------------------------------------------- resource
    def parents(self) -> tuple[Resource, ...]:
        return (self.owner,) if self.owner is not None else (self.context,)

    def describe(self) -> str:
        if self.handle is None:
            return "graph being captured" if self._capture is not None else "graph (never made)"
        kind = "" if self.owner is None else " (a node's body)"
        return f"graph {handle_int(self.handle):#x}{kind}"

    def _drop_releases_a_handle(self) -> bool:
        return self.owned and self.handle is not None

    def _release(self) -> int:
        if not self.owned or self.handle is None:
            return 0
        return self.driver.cuGraphDestroy(self.handle)

    def close(self) -> None:
        """cuGraphDestroy (idempotent).  The driver's graph does not belong to a context, so it is
        destroyed even after the context ended; a body or a capture's graph in progress is not ours."""
        if self.ended is not None:
            return
        if FORKED[0]:
            self._claim("left behind by fork()")
            return
        if self._capture is not None:
            raise invalid("cuGraphDestroy", "the graph is being captured: leave the with block first")
        if not self.owned and self.handle is not None:
            raise invalid("cuGraphDestroy", f"{self.describe()} belongs to its node (or to a capture): destroy "
                                            "the node, or end the capture")
        self._give_back()

    destroy = close

    def _drop(self) -> int:
        self.ended = "dropped"
        if FORKED[0] or not self.owned or self.handle is None:
            return 0
        EPOCH[0] += 1
        return self.driver.cuGraphDestroy(self.handle)

    def _ready(self, call: str) -> Context:
        """Check this graph for ``call`` (usable, not being captured); its context."""
        self.check(call)
        if self.handle is None:
            raise invalid(call, "the graph is still being captured: use it after the with block ends")
        return self.context

    # ---------------------------------------------------------------- nodes
    def _forget(self, node: GraphNode) -> None:
        self._records.pop(handle_int(node.handle), None)

    def _node(self, handle: Any) -> GraphNode:
        """The node object of a node handle of this graph (made once per record while it is alive)."""
        key = handle_int(handle)
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = NodeRecord(key)
        node = record.wrapper() if record.wrapper is not None else None
        if node is None or node.ended is not None:
            out = ffi.new("CUgraphNodeType *")
            self.driver.check(self.context.call_current(self.driver.cuGraphNodeGetType, handle, out),
                              "cuGraphNodeGetType")
            node = node_class(out[0])(self, handle, record)
        return node

    def _add(self, call: str, cls: type[GraphNode], depends_on: Any, args: tuple, record: NodeRecord,
             ctx: Context | None = None) -> GraphNode:
        """``call(&node, graph, deps, n, *args)`` in the graph's context; the node object of ``record``."""
        context = ctx or self._ready(call)
        deps = _dependencies(self, depends_on, call)
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
        p, ctx, held, keep = copy_struct(self, call, dst, src, nbytes)
        record = NodeRecord(0, keep=keep, held=held)
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
        nodes refer to.  Later changes to ``child`` do not reach the node (change ``node.child_graph``)."""
        call = "cuGraphAddChildGraphNode"
        self._ready(call)
        if not isinstance(child, Graph):
            raise invalid(call, f"a child graph node takes a cuproc Graph, not {type(child).__name__}")
        child._ready(call)
        child._check_held(call)
        keep, held = child._everything()
        record = NodeRecord(0, keep=keep, held=held, bodies=({},))
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

    def add_free(self, memory: MemAllocNode | int, *, depends_on: Any = None) -> MemFreeNode:
        """Free graph-owned memory (cuGraphAddMemFreeNode): a MemAllocNode's, or its address."""
        call = "cuGraphAddMemFreeNode"
        self._ready(call)
        if isinstance(memory, MemAllocNode):
            address = memory.address
        elif isinstance(memory, int) and not isinstance(memory, bool):
            address = memory
        else:
            raise invalid(call, f"a free node takes a MemAllocNode or an address, not {type(memory).__name__}")
        return self._add(call, MemFreeNode, depends_on, (address,), NodeRecord(0))  # type: ignore[return-value]

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
        takes two bodies from CUDA 12.8)."""
        return self._conditional("if", condition, 2, depends_on)

    def add_while(self, condition: ConditionalHandle, *, depends_on: Any = None) -> ConditionalNode:
        """WHILE: ``node.body`` runs again and again while the condition is not 0 (tested before each run)."""
        return self._conditional("while", condition, 1, depends_on)

    def add_switch(self, condition: ConditionalHandle, cases: int, *, depends_on: Any = None) -> ConditionalNode:
        """SWITCH: ``node.bodies[value]`` runs, none when the value is ``cases`` or more (CUDA 12.8)."""
        if isinstance(cases, bool) or not isinstance(cases, int) or cases < 1:
            raise invalid("cuGraphAddNode", f"cases must be a positive int, got {cases!r}")
        return self._conditional("switch", condition, cases, depends_on)

    def _conditional(self, kind: str, condition: ConditionalHandle, size: int, depends_on: Any) -> ConditionalNode:
        call = "cuGraphAddNode"
        ctx = self._ready(call)
        require_at_requested_version(self.driver, "cuGraphConditionalHandleCreate")
        require_at_requested_version(self.driver, call)
        if not isinstance(condition, ConditionalHandle):
            raise invalid(call, f"a conditional node takes the ConditionalHandle of graph.conditional_handle(), "
                                f"not {type(condition).__name__}")
        owner = condition.graph
        if owner is None or not any(g._records is condition._records for g in self._lineage()):
            raise invalid(call, "the condition belongs to another graph, not to this graph or a graph it is in")
        owner.check(call)
        deps = _dependencies(self, depends_on, call)
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

    def _lineage(self) -> Iterable[Graph]:
        """This graph and the graphs it is (nested) in."""
        graph: Graph | None = self
        while graph is not None:
            yield graph
            graph = graph.owner.graph if graph.owner is not None else None

    # ---------------------------------------------------------------- queries
    @property
    def nodes(self) -> list[GraphNode]:
        """Every node, in the order they were added (cuGraphGetNodes)."""
        return self._listed("cuGraphGetNodes")

    @property
    def root_nodes(self) -> list[GraphNode]:
        """The nodes that depend on nothing (cuGraphGetRootNodes)."""
        return self._listed("cuGraphGetRootNodes")

    def _listed(self, call: str) -> list[GraphNode]:
        ctx = self._ready(call)
        drv = self.driver
        fn = getattr(drv, call)
        count = ffi.new("size_t *")
        drv.check(ctx.call_current(fn, self.handle, ffi.NULL, count), call)
        if not count[0]:
            return []
        out = ffi.new("CUgraphNode[]", count[0])
        drv.check(ctx.call_current(fn, self.handle, out, count), call)
        return [self._node(out[i]) for i in range(count[0])]

    def _record_order(self, call: str) -> list[tuple[tuple[int, ...], NodeRecord]]:
        """Every node record with its place: (index,) in cuGraphGetNodes' order (the order in which an
        update pairs nodes), then (index, body, index in the body) for the nodes of bodies, recursively."""
        ctx = self._ready(call)
        drv = self.driver
        count = ffi.new("size_t *")
        drv.check(ctx.call_current(drv.cuGraphGetNodes, self.handle, ffi.NULL, count), "cuGraphGetNodes")
        out = ffi.new("CUgraphNode[]", max(count[0], 1))
        if count[0]:
            drv.check(ctx.call_current(drv.cuGraphGetNodes, self.handle, out, count), "cuGraphGetNodes")
        order: list[tuple[tuple[int, ...], NodeRecord]] = []

        def walk(path: tuple[int, ...], record: NodeRecord) -> None:
            order.append((path, record))
            for b, body in enumerate(record.bodies):
                for i, inner in enumerate(list(body.values())):
                    walk((*path, b, i), inner)

        for i in range(count[0]):
            key = handle_int(out[i])
            record = self._records.get(key)
            if record is None:
                record = self._records[key] = NodeRecord(key)
            walk((i,), record)
        return order

    @property
    def edges(self) -> list[tuple[GraphNode, GraphNode]]:
        """Every dependency as (from, to): ``to`` runs after ``from`` (cuGraphGetEdges at the handle's ABI)."""
        call = "cuGraphGetEdges"
        ctx = self._ready(call)
        drv = self.driver
        with_data = arity(drv, call) == 5           # 12.3+: (graph, from, to, edgeData, count)
        count = ffi.new("size_t *")
        first = (self.handle, ffi.NULL, ffi.NULL, ffi.NULL, count) if with_data else \
            (self.handle, ffi.NULL, ffi.NULL, count)
        drv.check(ctx.call_current(drv.cuGraphGetEdges, *first), call)
        if not count[0]:
            return []
        src, dst = ffi.new("CUgraphNode[]", count[0]), ffi.new("CUgraphNode[]", count[0])
        args = (self.handle, src, dst, ffi.NULL, count) if with_data else (self.handle, src, dst, count)
        drv.check(ctx.call_current(drv.cuGraphGetEdges, *args), call)
        return [(self._node(src[i]), self._node(dst[i])) for i in range(count[0])]

    def _edit_edges(self, call: str, froms: list[GraphNode], tos: list[GraphNode]) -> None:
        """cuGraphAddDependencies / cuGraphRemoveDependencies of the edges ``froms[i] -> tos[i]``."""
        ctx = self._ready(call)
        _dependencies(self, froms, call)
        _dependencies(self, tos, call)
        drv = self.driver
        if not froms:
            return
        a, b = node_array(froms), node_array(tos)
        args = (self.handle, a, b, ffi.NULL, len(froms)) if arity(drv, call) == 5 else (self.handle, a, b, len(froms))
        drv.check(ctx.call_current(getattr(drv, call), *args), call)

    def add_dependencies(self, before: Any, after: Any) -> None:
        """Edges from each node of ``before`` to each node of ``after`` (cuGraphAddDependencies)."""
        call = "cuGraphAddDependencies"
        froms, tos = _dependencies(self, before, call), _dependencies(self, after, call)
        pairs = [(f, t) for t in tos for f in froms]
        self._edit_edges(call, [f for f, _ in pairs], [t for _, t in pairs])

    def remove_dependencies(self, before: Any, after: Any) -> None:
        """Remove the edges from each node of ``before`` to each node of ``after`` (cuGraphRemoveDependencies)."""
        call = "cuGraphRemoveDependencies"
        froms, tos = _dependencies(self, before, call), _dependencies(self, after, call)
        pairs = [(f, t) for t in tos for f in froms]
        self._edit_edges(call, [f for f, _ in pairs], [t for _, t in pairs])

    @property
    def capture_info(self) -> CaptureInfo:
        """While this graph is being captured: its stream's capture state (:func:`cuproc.stream_capture.capture_info`)."""
        if self._capture is None:
            raise invalid("cuStreamGetCaptureInfo", "this graph is not being captured")
        return self._capture.info()

    # ---------------------------------------------------------------- what the nodes refer to
    def _everything(self) -> tuple[tuple, tuple[Resource, ...]]:
        """(objects kept, resources held) by every node, nested bodies included."""
        keep: list[Any] = []
        held: dict[int, Resource] = {}
        for record in list(self._records.values()):
            for r in record.everything():
                keep.extend(r.keep)
                keep.extend(r.bodies)
                for resource in r.held:
                    held.setdefault(id(resource), resource)
        return tuple(keep), tuple(held.values())

    def _check_held(self, call: str) -> None:
        """Refuse ``call`` when something a node refers to has ended (before the driver sees the graph)."""
        for record in list(self._records.values()):
            for r in record.everything():
                for resource in r.held:
                    gone = resource.ended_owner()
                    if gone is not None:
                        raise ClosedResourceError(call, self.describe(), gone.describe(), gone.ended or "closed")

    # ---------------------------------------------------------------- instantiate
    def instantiate(self, *, flags: int | Iterable[str] = 0, upload: Any = None) -> GraphExec:
        """An executable graph (made with the graph's context current).  ``flags``: an int or names of
        CUgraphInstantiate_flags ("AUTO_FREE_ON_LAUNCH", "USE_NODE_PRIORITY", ...); ``upload``: a stream
        to upload it on at once.  The entry point is the requested version's (see the module docstring);
        a refusal raises :class:`GraphInstantiateError` with the driver's result, node and log."""
        ctx = self._ready("cuGraphInstantiate")
        self._check_held("cuGraphInstantiate")
        drv = self.driver
        value = _instantiate_flags(flags)
        out = ffi.new("CUgraphExec *")
        log = ""
        result = None
        if drv.has("cuGraphInstantiateWithParams", newer_driver_features=False):
            call = "cuGraphInstantiateWithParams"
            p = ffi.new("CUDA_GRAPH_INSTANTIATE_PARAMS *")
            p.flags = value
            if upload is not None:
                p.flags |= _INSTANTIATE_FLAGS["CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD"]
                p.hUploadStream = stream_handle(upload, drv, call)
            rc = ctx.call_current(drv.cuGraphInstantiateWithParams, out, self.handle, p)
            error_node, result = p.hErrNode_out, _INSTANTIATE_RESULTS.get(p.result_out, str(p.result_out))
        elif value == 0 and upload is None:
            call = "cuGraphInstantiate"      # the 11.x ABI: error node and log buffer
            err = ffi.new("CUgraphNode *")
            buf = ffi.new("char[]", _LOG_SIZE)
            rc = ctx.call_current(drv.cuGraphInstantiate, out, self.handle, err, buf, _LOG_SIZE)
            error_node, log = err[0], ffi.string(buf).decode(errors="replace")
        else:
            call = "cuGraphInstantiateWithFlags"
            if upload is not None:
                raise invalid(call, f"upload= needs cuGraphInstantiateWithParams, which CUDA {drv.version} (the "
                                    "requested version) does not have: call exe.upload(stream) afterwards")
            rc = ctx.call_current(drv.cuGraphInstantiateWithFlags, out, self.handle, value)
            error_node = ffi.NULL
        if rc:
            node = self._node(error_node) if error_node != ffi.NULL else None
            details = [f"the driver's result: {result}" if result else "",
                       f"at {node.describe()}" if node is not None else "", f"log: {log}" if log else ""]
            raise _with_details(GraphInstantiateError, drv.error(rc, call), ", ".join(filter(None, details)),
                                result=result, node=node, log=log)
        return GraphExec._made(self, out[0], ctx)

    # ---------------------------------------------------------------- pictures
    def to_dot(self, *, verbose: bool = False, flags: int | Iterable[str] = 0) -> str:
        """The driver's DOT text of the graph (cuGraphDebugDotPrint).  ``verbose`` adds every parameter;
        ``flags``: an int or names of CUgraphDebugDot_flags ("KERNEL_NODE_PARAMS", "HANDLES", ...)."""
        call = "cuGraphDebugDotPrint"
        ctx = self._ready(call)
        value = _dot_flags(flags) | (_DOT_FLAGS["CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE"] if verbose else 0)
        import tempfile
        fd, path = tempfile.mkstemp(prefix="cuproc-graph-", suffix=".dot")
        os.close(fd)
        try:
            self.driver.check(ctx.call_current(self.driver.cuGraphDebugDotPrint, self.handle, os.fsencode(path),
                                               value), call)
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
        finally:
            os.unlink(path)

    def to_png(self, path: str | os.PathLike[str], *, verbose: bool = False) -> None:
        """The picture of :meth:`to_dot`, drawn by Graphviz's ``dot`` (which must be on PATH)."""
        image = _graphviz(self.to_dot(verbose=verbose), "png")
        with open(path, "wb") as f:
            f.write(image)

    def _repr_svg_(self) -> str | None:
        """The picture for Jupyter, when Graphviz's ``dot`` is on PATH (else None: no picture)."""
        import shutil
        if shutil.which("dot") is None or self.closed or self.handle is None:
            return None
        try:
            return _graphviz(self.to_dot(), "svg").decode()
        except Exception:  # noqa: BLE001 - a notebook shows the repr instead
            return None

    def __repr__(self) -> str:
        if self.handle is None:
            return f"<cuproc.Graph {'being captured' if self._capture is not None else self.ended}>"
        state = f" {self.ended}" if self.ended else ""
        return f"<cuproc.Graph {handle_int(self.handle):#x}{state}>"

    # ---------------------------------------------------------------- capture (cuproc.stream_capture)
    @classmethod
    def _capturing(cls, context: Context, capture: StreamCapture) -> Graph:
        return cls._view(context.driver, context, None, owned=True, capture=capture)

    def _captured(self, handle: Any) -> None:
        """The capture ended with ``handle``: this object owns it now (host functions the capture met are
        taken over from cuproc.stream's one-shot records, so that every launch runs them)."""
        first_token = self._capture._first_token if self._capture is not None else 0
        self.handle, self._capture = handle, None
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


def _instantiate_flags(flags: int | Iterable[str]) -> int:
    return _flag_value(flags, _INSTANTIATE_FLAGS, "CUDA_GRAPH_INSTANTIATE_FLAG_", "cuGraphInstantiate")


def _dot_flags(flags: int | Iterable[str]) -> int:
    return _flag_value(flags, _DOT_FLAGS, "CU_GRAPH_DEBUG_DOT_FLAGS_", "cuGraphDebugDotPrint")


def _flag_value(flags: int | Iterable[str], names: dict[str, int], prefix: str, call: str) -> int:
    if isinstance(flags, bool):
        raise invalid(call, f"flags is an int or flag names, not {flags!r}")
    if isinstance(flags, int):
        if flags < 0:
            raise invalid(call, f"flags must be >= 0, got {flags}")
        return flags
    if isinstance(flags, str):
        flags = [flags]
    value = 0
    for name in flags:
        key = name if str(name).startswith(prefix) else prefix + str(name).upper()
        if key not in names:
            raise invalid(call, f"no flag {key}; the flags are {', '.join(sorted(names))}")
        value |= names[key]
    return value


def _graphviz(dot: str, fmt: str) -> bytes:
    """``dot -T<fmt>`` of the DOT text: Graphviz draws the picture."""
    import shutil
    import subprocess
    program = shutil.which("dot")
    if program is None:
        raise FileNotFoundError("Graphviz's dot is not on PATH: install Graphviz to draw graphs (or write "
                                "graph.to_dot() to a file and draw it elsewhere)")
    return subprocess.run([program, f"-T{fmt}"], input=dot.encode(), capture_output=True, check=True).stdout


class GraphExec(Resource):
    """An executable graph (a CUgraphExec), made by :meth:`Graph.instantiate` in the graph's context.

    ``launch(stream)`` and ``upload(stream)`` on any stream; ``update(graph)`` takes another graph of the
    same shape (cuGraphExecUpdate, :class:`GraphUpdateError` when it cannot); ``set_kernel_args(node, ...)``
    changes one kernel node here only.  It keeps a copy of what its graph's nodes referred to."""

    _release_call = "cuGraphExecDestroy"
    _ended_word = "destroyed"

    context: Context
    handle: Any
    _source: weakref.ref[Graph]
    _kernels: dict[tuple[int, ...], tuple]
    _places: dict[int, tuple[weakref.ref[NodeRecord], tuple[int, ...]]]
    _held: tuple[Resource, ...]
    _leaves: tuple[Resource, ...]
    _graph_launch: Callable[..., int]

    def __init__(self) -> None:
        raise TypeError("an executable graph is made by Graph.instantiate()")

    @classmethod
    def _made(cls, graph: Graph, handle: Any, context: Context) -> GraphExec:
        exe = cls.__new__(cls)
        exe.driver = graph.driver
        exe.context = context
        exe.handle = handle
        exe._source = weakref.ref(graph)
        exe._kernels = {}
        exe._graph_launch = graph.driver.cuGraphLaunch
        order = graph._record_order("cuGraphInstantiate")
        #: the nodes that name this executable graph's nodes (those of the graph it was instantiated from,
        #: as the driver has it): id(record) -> (the record, weakly; its place)
        exe._places = {id(record): (weakref.ref(record), path) for path, record in order}
        exe._take(graph, order)
        exe.ended = None
        return exe

    def _take(self, graph: Graph, order: list[tuple[tuple[int, ...], NodeRecord]]) -> None:
        """Keep what ``graph``'s nodes refer to (instantiation, update).  ``order`` is its node records by
        their place in the executable graph (a path: the node's index in cuGraphGetNodes' order, then a
        body's index and the node's in that body): what the executable graph knows of a node is filed by
        place, never by a node handle, which the driver hands out again."""
        self._keep_by_node: dict[tuple[int, ...], tuple] = {}
        self._held_by_node: dict[tuple[int, ...], tuple[Resource, ...]] = {}
        self._kernels = {}
        for path, record in order:
            self._keep_by_node[path] = (*record.keep, *record.bodies)
            self._held_by_node[path] = tuple(record.held)
            if record.kernel is not None:
                self._kernels[path] = record.kernel
        self._refresh()

    def _refresh(self) -> None:
        held: dict[int, Resource] = {}
        for resources in self._held_by_node.values():
            for r in resources:
                held.setdefault(id(r), r)
        self._held = tuple(held.values())
        self._leaves = tuple(r for r in self._held if r._leaf)   # they end without moving EPOCH
        self._checked_at = -1          # (no epoch): the next launch checks them all

    # ---------------------------------------------------------------- resource
    def parents(self) -> tuple[Resource, ...]:
        return (self.context,)

    def describe(self) -> str:
        return f"executable graph {handle_int(self.handle):#x}"

    def _release(self) -> int:
        return self.context.call(self.driver.cuGraphExecDestroy, self.handle)

    destroy = Resource.close

    @property
    def graph(self) -> Graph | None:
        """The graph this was instantiated from, while it lives."""
        return self._source()

    def _verify(self, call: str) -> None:
        """Check this executable graph and everything its nodes refer to, for ``call``.  The epoch it is
        left checked at (what lets :meth:`launch` skip the checks) is set only when all of them passed."""
        self._checked_at = -1
        self.check(call)
        for resource in self._held:
            gone = resource.ended_owner()
            if gone is not None:
                self._checked_at = -1
                raise ClosedResourceError(call, self.describe(), gone.describe(), gone.ended or "closed")

    # ---------------------------------------------------------------- launch
    def launch(self, stream: Any = None) -> None:
        """cuGraphLaunch on ``stream`` (a Stream, another library's stream, a raw handle; None: the default
        stream, in this graph's context).  Asynchronous.

        On a cuproc Stream, with nothing ended since both were last checked (the resource epoch) and every
        buffer the graph refers to alive, it is the driver call alone (a replay's host time is C's,
        benchmarks/bench_graphs.py); anything else takes the full checks first."""
        epoch = EPOCH[0]
        if stream.__class__ is Stream and self._checked_at == epoch and stream.ended is None \
                and getattr(stream, "_checked_at", None) == epoch:
            for leaf in self._leaves:
                if leaf.ended is not None:
                    break
            else:
                h = stream.handle        # a Stream's own stream: the driver routes the call by it
                rc = self._graph_launch(self.handle, h)
                if rc:
                    self._launch_failed(rc, h)
                return
        self._verify("cuGraphLaunch")
        h = stream_handle(stream, self.driver, "cuGraphLaunch")
        rc = self.context.call_on(h, self._graph_launch, self.handle, h)
        if rc:
            raise self.driver.error(rc, "cuGraphLaunch")

    def _launch_failed(self, rc: int, stream: Any) -> None:
        """The first attempt on a Stream answered ``rc``: the context's rebind (Context.call), else the error."""
        rc = self.context.rebind(rc, self._graph_launch, self.handle, stream)
        if rc:
            raise self.driver.error(rc, "cuGraphLaunch")

    def upload(self, stream: Any = None) -> None:
        """cuGraphUpload: make the launch's resources ready on ``stream`` ahead of the first launch."""
        self._verify("cuGraphUpload")
        drv = self.driver
        h = stream_handle(stream, drv, "cuGraphUpload")
        drv.check(self.context.call_on(h, drv.cuGraphUpload, self.handle, h), "cuGraphUpload")

    # ---------------------------------------------------------------- changes
    def update(self, graph: Graph) -> None:
        """cuGraphExecUpdate: take ``graph``'s node parameters (same topology and node order).  When the
        driver cannot, :class:`GraphUpdateError` says why and names the node, and nothing changed."""
        call = "cuGraphExecUpdate"
        self._verify(call)
        if not isinstance(graph, Graph):
            raise invalid(call, f"update takes a cuproc Graph, not {type(graph).__name__}")
        graph._ready(call)
        graph._check_held(call)
        drv = self.driver
        if arity(drv, call) == 3:                  # 12.0+: (exec, graph, CUgraphExecUpdateResultInfo *)
            info = ffi.new("CUgraphExecUpdateResultInfo *")
            rc = self.context.call_current(drv.cuGraphExecUpdate, self.handle, graph.handle, info)
            result, node, other = info.result, info.errorNode, info.errorFromNode
        else:                                      # (exec, graph, CUgraphNode *, CUgraphExecUpdateResult *)
            err, res = ffi.new("CUgraphNode *"), ffi.new("CUgraphExecUpdateResult *")
            rc = self.context.call_current(drv.cuGraphExecUpdate, self.handle, graph.handle, err, res)
            result, node, other = res[0], err[0], ffi.NULL
        if rc:
            reason = _UPDATE_RESULTS.get(result, str(result))
            error_node = graph._node(node) if rc == _UPDATE_FAILURE and node != ffi.NULL else None
            from_node = graph._node(other) if rc == _UPDATE_FAILURE and other != ffi.NULL else None
            details = f"the driver's reason: {reason}" + (f" at {error_node.describe()}" if error_node else "")
            raise _with_details(GraphUpdateError, drv.error(rc, call), details, reason=reason, node=error_node,
                                from_node=from_node)
        self._take(graph, graph._record_order(call))

    def set_kernel_args(self, node: KernelNode, args: Sequence[Any] | None = None, *, grid: Any = None,
                        block: Any = None, shared_mem: int | None = None,
                        signature: Sequence[Any] | None = None) -> None:
        """cuGraphExecKernelNodeSetParams: new arguments (packed as a launch packs them, by the node's own
        types unless ``signature`` is given), grid, block or shared memory of a kernel node of the graph
        this was instantiated from, for the next launches of this executable graph only."""
        call = "cuGraphExecKernelNodeSetParams"
        self._verify(call)
        if not isinstance(node, KernelNode):
            raise invalid(call, f"set_kernel_args takes a KernelNode, not {type(node).__name__}")
        node.check(call)
        place = self._places.get(id(node.record))
        if place is None or place[0]() is not node.record:
            raise invalid(call, f"{node.describe()} is not a node of the graph this executable graph was "
                                "instantiated from (as it was then): a node added later has no counterpart here")
        key = place[1]
        base = self._kernels.get(key)
        if base is None:
            raise invalid(call, f"{node.describe()} was not made by cuproc (a captured node): its argument types "
                                "are not known here")
        function, packed, values, dims, shared = base
        reuse = args is None and signature is None
        parts = kernel_parts(node.graph, function, call, values if args is None else args,
                             packed.types if signature is None else signature,
                             dims[:3] if grid is None else grid, dims[3:] if block is None else block,
                             shared if shared_mem is None else shared_mem, packed if reuse else None)
        p = kernel_struct(self.driver, call, 2, parts)
        self.driver.check(self.context.call_current(self.driver.cuGraphExecKernelNodeSetParams, self.handle,
                                                    node.handle, p), call)
        self._kernels[key] = parts[:5]
        self._keep_by_node[key] = (parts[1], *parts[6])
        self._held_by_node[key] = tuple(dict.fromkeys(parts[5]))
        self._refresh()

    def __repr__(self) -> str:
        state = f" {self.ended}" if self.ended else ""
        return f"<cuproc.GraphExec {handle_int(self.handle):#x}{state}>"


__all__ = ["Graph", "GraphExec", "GraphInstantiateError", "GraphUpdateError"]

