"""A CUDA graph as the driver has it: its handle and lifetime, its nodes and edges, the graphs inside it
(child graphs, conditional bodies), and the records of what its nodes refer to.

Policy
------
* **The driver is the source of the structure.**  Nodes, roots and edges are
  read from the driver at each query (cuGraphGetNodes, cuGraphGetEdges at the
  handle's ABI), so a captured graph, the copy inside a child graph node or a
  graph another library made answers the same as one cuproc built.  A node
  cuproc did not add gets its object from cuGraphNodeGetType.
* **Records hold what nodes refer to.**  Each node cuproc knows has a
  :class:`~cuproc.graph_nodes.NodeRecord` in its graph, filed under the node's
  handle while the node lives; a body or child graph keeps its records in the
  record of the node it belongs to.  A node cuproc did not add has an empty
  record: cuproc keeps nothing for it (the driver owns what it uses).
* **Views own nothing.**  A body, a child graph node's graph or a graph being
  captured is a view (``owned`` False): closing or dropping it never destroys
  the driver's graph, which its node (or capture) owns.
* **A node the driver names is looked for everywhere.**  An error node from
  instantiation or update may sit in a child graph or a conditional body:
  :meth:`GraphStructure.find_node` searches the graph and every graph inside
  it, depth first.
"""
from __future__ import annotations

import weakref

from ._ffi import ffi
from ._resource import EPOCH, FORKED, Resource
from ._support import arity, handle_int, invalid
from .errors import ClosedResourceError, CudaError
from .graph_errors import NOT_SUPPORTED, add_note
from .graph_nodes import (GraphNode, NodeRecord, kernel_node_params, launches_recorded, node_array, node_class,
                          runtime_objects)

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from .context import Context
    from .driver import Driver
    from .graph_nodes import PendingFree


def dependencies_of(graph: GraphStructure, depends_on: Any, call: str) -> list[GraphNode]:
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


class GraphStructure(Resource):
    """The handle, lifetime, nodes, edges and records of a graph (the base of :class:`~cuproc.graph.Graph`;
    see the module docstring)."""

    _release_call = "cuGraphDestroy"
    _ended_word = "destroyed"

    context: Context
    handle: Any
    owned: bool
    owner: GraphNode | None
    _records: dict[int, NodeRecord]
    _capture: Any

    def _setup(self, driver: Driver, context: Context, handle: Any, *, owned: bool, records: dict[int, NodeRecord],
               owner: GraphNode | None, capture: Any = None) -> None:
        self.driver = driver
        self.context = context
        self.handle = handle
        self.owned = owned            # False: a body, a child graph node's graph, a capture's graph in progress
        self.owner = owner            # the node whose body this graph is
        self._records = records       # node handle -> what it refers to (shared by a body's views)
        self._capture = capture       # the StreamCapture making this graph, while it runs
        self.adopted = False          # True: another library's graph (Graph.from_handle), never destroyed here
        self.foreign_owner: Any = None   # what an adopted graph keeps alive (the library object that owns it)
        #: a captured graph's allocations (alloc_async in the capture, not freed there): (address, the
        #: GraphAllocation weakly), what its executable graphs track at each launch
        self._allocations: tuple[tuple[int, weakref.ref[Any]], ...] = ()
        #: graph allocations a free node of this (captured) graph frees: its executable graphs' launches do
        self.pending_frees: tuple[PendingFree, ...] = ()
        self.ended = None

    @classmethod
    def _view(cls, driver: Driver, context: Context, handle: Any, *, owner: GraphNode | None = None,
              records: dict[int, NodeRecord] | None = None, owned: bool = False,
              capture: Any = None) -> Any:
        graph = cls.__new__(cls)
        graph._setup(driver, context, handle, owned=owned, records={} if records is None else records, owner=owner,
                     capture=capture)
        return graph

    def _body(self, handle: Any, node: GraphNode, records: dict[int, NodeRecord]) -> Any:
        """A graph owned by ``node`` (a conditional body, a child graph node's graph), with its records: a
        view of this graph's class that never destroys the driver's graph."""
        return type(self)._view(self.driver, self.context, ffi.cast("CUgraph", handle), owner=node, records=records)

    # ---------------------------------------------------------------- resource
    def parents(self) -> tuple[Resource, ...]:
        return (self.owner,) if self.owner is not None else (self.context,)

    def describe(self) -> str:
        if self.handle is None:
            return "graph being captured" if self._capture is not None else "graph (never made)"
        kind = " (a node's body)" if self.owner is not None else " (another library's)" if self.adopted else ""
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
        if self.adopted:                  # another library's: this wrapper ends, the driver's graph stays
            self._claim("closed")
            return
        if not self.owned and self.handle is not None:
            raise invalid("cuGraphDestroy", f"{self.describe()} belongs to its node (or to a capture): destroy "
                                            "the node, or end the capture")
        self._give_back()
        self.pending_frees = ()   # its launches are over: frees none made are undone (PendingFree)

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

    def free_on_launch(self, frees: Iterable[PendingFree]) -> None:
        """``frees``: the graph allocations this graph's free nodes free (captured, or added by hand) -- kept
        (and so pending) while this graph or an executable graph made from it may launch (see
        graph_nodes.PendingFree)."""
        self.pending_frees = tuple(frees)

    def has_memory_nodes(self) -> bool:
        """Does this graph have a memory alloc or free node (the driver's node types, cuGraphNodeGetType)?  cuda.h
        restricts such a graph: its nodes and edges cannot be removed, it cannot be cloned or be a child graph,
        and it has at most one executable graph at a time (driver 580 answers CUDA_ERROR_NOT_SUPPORTED).  Asked
        only once the driver refused something (it walks every node)."""
        return any(self._node_type(h).type in ("mem_alloc", "mem_free") for h in self._handles("cuGraphGetNodes"))

    def note_removal_refused(self, err: CudaError, what: str) -> None:
        """Say why on ``err``, the driver's error for removing ``what`` (a node, an edge) from this graph, where it
        is CUDA_ERROR_NOT_SUPPORTED and the graph has memory nodes (cuda.h: none of such a graph's nodes or edges
        is removed)."""
        if err.code == NOT_SUPPORTED and self.has_memory_nodes():
            add_note(err, f"{what} stays: {self.describe()} has memory alloc or free nodes, and cuda.h allows no node "
                          "or edge of such a graph to be removed; build the graph again without it")

    # ---------------------------------------------------------------- nodes
    def _forget(self, node: GraphNode) -> None:
        self._records.pop(handle_int(node.handle), None)

    def _node(self, handle: Any) -> GraphNode:
        """The node object of a node handle of this graph (made once per record while it is alive)."""
        key = handle_int(handle)
        record = self._record_of(key)
        if record is None:
            record = self._records[key] = NodeRecord(key)
        node = record.wrapper() if record.wrapper is not None else None
        if node is None or node.ended is not None:
            node = self._node_type(handle)(self, handle, record)
        return node

    def _node_type(self, handle: Any) -> type[GraphNode]:
        """The node class of a node handle, as the driver says (cuGraphNodeGetType)."""
        out = ffi.new("CUgraphNodeType *")
        self.driver.check(self.context.call_current(self.driver.cuGraphNodeGetType, handle, out), "cuGraphNodeGetType")
        return node_class(out[0])

    def _record_of(self, key: int) -> NodeRecord | None:
        """The record filed under node handle ``key``.  In another library's graph (Graph.from_handle, and the
        graphs inside it) the owner may destroy a node behind cuproc's back and the driver hand its handle to
        a new node: a record whose node object was of another kind than the driver's node, or a kernel node's
        record whose function is not the one the driver's node launches (cuGraphKernelNodeGetParams), now
        belongs to the dead node -- it is dropped (its node object ends) and None returned, so nothing it
        kept or knew (a signature to pack new arguments by) is taken for the new node's."""
        record = self._records.get(key)
        if record is None or record.node_class is None or not any(g.adopted for g in self._lineage()):
            return record
        if self._still_describes(record, ffi.cast("CUgraphNode", key)):
            return record
        del self._records[key]
        dead = record.wrapper() if record.wrapper is not None else None
        if dead is not None and dead.ended is None:
            dead.ended = "destroyed (by its graph's owner: the driver gave its handle to another node)"
        return None

    def _still_describes(self, record: NodeRecord, handle: Any) -> bool:
        """True when the driver's node ``handle`` is still the node ``record`` was made for: of its kind, and
        for a kernel node one launching its function."""
        if self._node_type(handle) is not record.node_class:
            return False
        return record.kernel is None or launches_recorded(record, kernel_node_params(self.driver, self.context, handle))

    def find_node(self, handle: Any) -> GraphNode | None:
        """The node object of ``handle`` wherever it is: a node of this graph, or of a child graph or a
        conditional body inside it (depth first); None when no graph here has it.  What an error node the
        driver reports is looked up with."""
        key = handle_int(handle)
        if not key:
            return None
        nodes = self.nodes
        for node in nodes:
            if handle_int(node.handle) == key:
                return node
        for node in nodes:
            for inner in node._inner_graphs():
                found = inner.find_node(handle)
                if found is not None:
                    return found
        return None

    @property
    def nodes(self) -> list[GraphNode]:
        """Every node, in the order they were added (cuGraphGetNodes)."""
        return self._listed("cuGraphGetNodes")

    @property
    def root_nodes(self) -> list[GraphNode]:
        """The nodes that depend on nothing (cuGraphGetRootNodes)."""
        return self._listed("cuGraphGetRootNodes")

    def _listed(self, call: str) -> list[GraphNode]:
        return [self._node(h) for h in self._handles(call)]

    def _handles(self, call: str) -> list[Any]:
        """The node handles ``call`` (cuGraphGetNodes or cuGraphGetRootNodes) lists, in its order."""
        ctx = self._ready(call)
        drv = self.driver
        fn = getattr(drv, call)
        count = ffi.new("size_t *")
        drv.check(ctx.call_current(fn, self.handle, ffi.NULL, count), call)
        if not count[0]:
            return []
        out = ffi.new("CUgraphNode[]", count[0])
        drv.check(ctx.call_current(fn, self.handle, out, count), call)
        return [out[i] for i in range(count[0])]

    def _record_order(self, call: str) -> list[tuple[tuple[int, ...], NodeRecord]]:
        """Every node record with its place: (index,) in cuGraphGetNodes' order (the order in which an
        update pairs nodes), then (index, body, index in the body) for the nodes of bodies, recursively.
        A node without a record (one cuproc did not add and was never asked about: a captured graph's) refers
        to nothing cuproc keeps: it has no entry (a captured graph's instantiation makes no record per node)."""
        self._ready(call)
        order: list[tuple[tuple[int, ...], NodeRecord]] = []

        def walk(path: tuple[int, ...], record: NodeRecord) -> None:
            order.append((path, record))
            for b, body in enumerate(record.bodies):
                for i, inner in enumerate(list(body.values())):
                    walk((*path, b, i), inner)

        records = self._records
        if not records:
            return order
        for i, h in enumerate(self._handles("cuGraphGetNodes")):
            record = self._record_of(handle_int(h))
            if record is not None:
                walk((i,), record)
        return order

    def holds(self, record: NodeRecord) -> bool:
        """Whether ``record`` is still the record of a node of this graph (or of a body inside it): a node
        destroyed since has none here (its handle may be another node's now)."""
        return any(r is record for top in list(self._records.values()) for r in top.everything())

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
        dependencies_of(self, froms, call)
        dependencies_of(self, tos, call)
        drv = self.driver
        if not froms:
            return
        a, b = node_array(froms), node_array(tos)
        args = (self.handle, a, b, ffi.NULL, len(froms)) if arity(drv, call) == 5 else (self.handle, a, b, len(froms))
        rc = ctx.call_current(getattr(drv, call), *args)
        if rc:
            err = drv.error(rc, call)
            if call == "cuGraphRemoveDependencies":
                self.note_removal_refused(err, "the edge")
            raise err

    def add_dependencies(self, before: Any, after: Any) -> None:
        """Edges from each node of ``before`` to each node of ``after`` (cuGraphAddDependencies)."""
        call = "cuGraphAddDependencies"
        froms, tos = dependencies_of(self, before, call), dependencies_of(self, after, call)
        pairs = [(f, t) for t in tos for f in froms]
        self._edit_edges(call, [f for f, _ in pairs], [t for _, t in pairs])

    def remove_dependencies(self, before: Any, after: Any) -> None:
        """Remove the edges from each node of ``before`` to each node of ``after`` (cuGraphRemoveDependencies)."""
        call = "cuGraphRemoveDependencies"
        froms, tos = dependencies_of(self, before, call), dependencies_of(self, after, call)
        pairs = [(f, t) for t in tos for f in froms]
        self._edit_edges(call, [f for f, _ in pairs], [t for _, t in pairs])

    def _lineage(self) -> Iterable[GraphStructure]:
        """This graph and the graphs it is (nested) in."""
        graph: GraphStructure | None = self
        while graph is not None:
            yield graph
            graph = graph.owner.graph if graph.owner is not None else None

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

    def _runtime_objects(self) -> tuple:
        """What the driver reads of every node (nested bodies included) when it runs (graph_nodes.runtime_objects)."""
        return tuple(k for record in list(self._records.values()) for r in record.everything()
                     for k in runtime_objects(r))

    def _check_held(self, call: str) -> None:
        """Refuse ``call`` when something a node refers to has ended (before the driver sees the graph)."""
        for record in list(self._records.values()):
            for r in record.everything():
                for resource in r.held:
                    gone = resource.ended_owner()
                    if gone is not None:
                        raise ClosedResourceError(call, self.describe(), gone.describe(), gone.ended or "closed")


__all__ = ["GraphStructure", "dependencies_of"]
