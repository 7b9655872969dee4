"""The nodes of a CUDA graph: what each kind holds, how its parameters are built, read and set.

Policy
------
* **One object per node.**  A :class:`GraphNode` names a node of one
  :class:`~cuproc.graph.Graph` (``node.graph``) and holds that graph.  What the
  node *refers to* -- the packed kernel argument block, the buffers and
  functions in its arguments, a host callable, an event, a child graph's own
  references -- is kept by the graph in a :class:`NodeRecord` under the node's
  handle, not by the node object: dropping a node object changes nothing, and a
  graph keeps what its nodes use for as long as it lives.  An executable graph
  takes a copy of those records (:mod:`cuproc.graph`).
* **Same packing as a launch.**  A kernel node's arguments are packed by
  :mod:`cuproc.launch`'s own code (signature or inferred C types, the driver's
  parameter sizes checked); a pointer argument may be a cuproc buffer, a view,
  an int address, or another library's array.
* **The ABI of the requested version.**  The parameter structs are the ones the
  handle's selected entry point takes (``CUDA_KERNEL_NODE_PARAMS`` v1 at 11.x,
  v2 from 12.0; ``cuGraphAddDependencies`` with or without edge data), read
  from the entry point's own typedef, never from a version number.
* **Lifetime.**  A node is a resource whose parent is its graph: once the graph
  (or its context) ends, the node refuses with
  :class:`~cuproc.errors.ClosedResourceError`.  ``destroy()`` (or ``close()``)
  removes it from the graph (``cuGraphDestroyNode``); dropping the object does
  not.  Nodes of a conditional node's body, or of a child graph node's graph,
  belong to the root graph and hold the node whose body they are in.
* **Host nodes.**  The callable is kept by the graph (and by every executable
  graph made from it, and by each launch until the launch has run:
  :mod:`cuproc.graph_exec`) and called by the driver when the stream reaches
  the node, later, on its own thread; an exception it raises is reported as a
  :class:`~cuproc.errors.CudaWarning` there and then, and kept in
  :attr:`HostNode.errors`, never lost.
* **Nodes cuproc did not add** (a captured graph's, a child graph's copy, an
  adopted graph's) have empty records: their kind comes from
  cuGraphNodeGetType, a child graph node's graph from
  cuGraphChildGraphNodeGetGraph, a conditional node's bodies from
  cuGraphNodeGetParams (CUDA 13.2; before it the dispatcher's error says so).
  Those graphs are views owned by their node, as the driver owns them.
"""
from __future__ import annotations

import itertools
import weakref

from . import _fork
from ._ffi import ffi
from ._immortal import keep_forever
from ._namedtuple import NamedTuple
from ._resource import Resource
from ._support import arity, handle_int, invalid
from .allocation import EXPORTS
from .context import Context
from .device_memory import DeviceBuffer, DeviceView, GlobalView, after_last_work
from .errors import CudaError, CudaWarning, SymbolNotFoundError, refusal
from .fill_args import check_element_bits, fill_count
from .graph_errors import NOT_SUPPORTED, add_note, require_at_requested_version
from .stream import Stream, stream_capturing, stream_handle

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import Any

    from .driver import Driver
    from .graph import Graph
    from .graph_structure import GraphStructure

_NODE_TYPES = ffi.typeof("CUgraphNodeType").elements            # value -> CU_GRAPH_NODE_TYPE_*
_NODE_TYPE = ffi.typeof("CUgraphNodeType").relements
CONDITIONAL_TYPES = {"if": 0, "while": 1, "switch": 2}           # CUgraphConditionalNodeType
_COND_ASSIGN_DEFAULT = 1                                          # CU_GRAPH_COND_ASSIGN_DEFAULT
_PINNED, _ON_DEVICE = 1, 1                                        # CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE


# ----------------------------------------------------------------------------- records

class NodeRecord:
    """What one node refers to, kept by its graph: ``keep`` (objects that must stay alive: the packed
    argument block, a host call, another library's array), ``held`` (cuproc resources checked before the
    graph is instantiated or launched: functions, buffers, events) and, for a conditional node or a child
    graph node, ``bodies`` (the records of the nodes in each of its graphs).  ``kernel`` is a kernel
    node's (function, packed arguments, values, dimensions, shared memory): what setting new arguments
    reuses; ``graphs`` the CUgraph handles of a conditional node's bodies; ``info`` what else a kind of
    node remembers (a conditional node's kind and handle).  ``runtime``, set on a child graph node cuproc added,
    is what the nodes of the child it copied read when they run (:func:`runtime_objects` of their records);
    ``keep`` holds all they refer to."""

    __slots__ = ("handle", "keep", "held", "bodies", "graphs", "kernel", "info", "runtime", "wrapper", "node_class",
                 "__weakref__")

    def __init__(self, handle: int, keep: tuple = (), held: tuple[Resource, ...] = (),
                 bodies: tuple[dict[int, NodeRecord], ...] = (), kernel: tuple | None = None) -> None:
        self.handle, self.keep, self.held, self.bodies, self.kernel = handle, keep, held, bodies, kernel
        self.graphs: tuple[Any, ...] = ()
        self.info: tuple[Any, ...] = ()
        self.runtime: tuple[Any, ...] | None = None
        self.wrapper: weakref.ref[GraphNode] | None = None
        #: the class of its node object (what the driver said the node is when the object was made)
        self.node_class: type[GraphNode] | None = None

    def everything(self) -> Iterable[NodeRecord]:
        """This record and those of the nodes in its bodies, recursively."""
        yield self
        for body in self.bodies:
            for record in list(body.values()):
                yield from record.everything()


def runtime_objects(record: NodeRecord) -> tuple:
    """What the driver reads of ``record``'s node when the node runs, not when it was made: a host node's
    callable (a HostCall), a copy's host memory (``runtime``, set by the copy), for a child graph node those
    of the nodes it copied (``runtime``, set when it was added).  The driver copied a kernel node's argument
    block and every other node's parameters when the node was made: they are not kept."""
    if record.runtime is not None:
        return record.runtime
    return tuple(k for k in record.keep if isinstance(k, HostCall))


def held_by(values: Iterable[Any]) -> tuple[tuple[Resource, ...], tuple[Any, ...]]:
    """(cuproc resources to check, other objects to keep alive) among the values a node refers to: a
    buffer or any resource as is, a view by its buffer, a ``__device__`` variable by its module or library
    (and context); another library's array (``__cuda_array_interface__``, DLPack) is only kept alive."""
    resources: list[Resource] = []
    keep: list[Any] = []
    for value in values:
        if isinstance(value, Resource):
            resources.append(value)
        elif isinstance(value, DeviceView):
            resources.append(value.buffer)
        elif isinstance(value, GlobalView):
            resources.append(value.owner)
            if value.context is not None:
                resources.append(value.context)
        elif not isinstance(value, (int, float, bool, bytes, str, ffi.CData)) and value is not None \
                and (hasattr(value, "__cuda_array_interface__") or hasattr(value, "__dlpack__")):
            keep.append(value)
    return tuple(dict.fromkeys(resources)), tuple(keep)


def param_struct(driver: Driver, call: str, index: int) -> Any:
    """The struct type the entry point ``call`` selected for this handle takes as argument ``index`` (a
    pointer type's item): the ABI of the requested version, read from its typedef."""
    res = driver.resolution(call)
    if res.typedef is None:
        raise driver.unavailable_error(res)
    return ffi.typeof(res.typedef).args[index].item


def node_array(nodes: Sequence[GraphNode]) -> Any:
    """A ``CUgraphNode[]`` of the nodes' handles (NULL for none)."""
    return ffi.new("CUgraphNode[]", [n.handle for n in nodes]) if nodes else ffi.NULL


# ----------------------------------------------------------------------------- host calls

class HostCall:
    """A host node's callable and what it raised, kept alive by the graph and its executable graphs.

    The driver calls :func:`_run_host_call` with the call's token; the token maps to this object
    weakly, so a host node whose graphs are all gone does nothing (its callable went with them)."""

    __slots__ = ("fn", "token", "errors", "__weakref__")

    def __init__(self, fn: Callable[[], Any]) -> None:
        if not callable(fn):
            raise invalid("cuGraphAddHostNode", f"a host node calls a Python callable, not {type(fn).__name__}")
        self.fn = fn
        self.errors: list[BaseException] = []
        with _host_lock:
            _next_token[0] += 1
            self.token = _next_token[0]
            _host_calls[self.token] = weakref.ref(self, _forget_token(self.token))

    def __repr__(self) -> str:
        return f"<cuproc host call {self.fn!r}, {len(self.errors)} error(s)>"


_host_calls: dict[int, weakref.ref[HostCall]] = {}
_host_lock = _fork.lock()
_next_token = [0]
#: errors kept per host call (the first ones: the warning reports every one)
_ERRORS_KEPT = 16


def _forget_token(token: int) -> Callable[[Any], None]:
    def forget(_: Any, _calls: dict = _host_calls) -> None:
        _calls.pop(token, None)
    return forget


def _run_host_call(user_data: Any, _calls: dict = _host_calls, _int: Any = handle_int,
                   _category: type = CudaWarning, _kept: int = _ERRORS_KEPT) -> None:
    """The C function every host node calls (on a driver thread).  Never raises: an exception of the
    callable becomes a warning (and is kept on the call); reads no module globals (the defaults), since
    the driver may call it during the interpreter's teardown."""
    try:
        ref = _calls.get(_int(user_data))
        call = ref() if ref is not None else None
        if call is None:
            return
        try:
            call.fn()
        except BaseException as exc:  # noqa: BLE001 - reported, never lost in a driver thread
            if len(call.errors) < _kept:
                call.errors.append(exc)
            import sys
            import warnings
            if not sys.is_finalizing():
                warnings.warn(f"a graph's host node raised {type(exc).__name__}: {exc} (in {call.fn!r})",
                              _category, stacklevel=1)
    except BaseException:  # noqa: BLE001 - nothing may leave a C callback
        pass


_trampoline: list[Any] = []


def host_trampoline() -> Any:
    """The one cffi callback around :func:`_run_host_call`, made on first use and never freed (the driver
    may call it after this module's teardown)."""
    with _host_lock:
        if not _trampoline:
            callback = ffi.callback("void(void *)", _run_host_call)
            keep_forever(callback)
            _trampoline.append(callback)
        return _trampoline[0]


def host_params(call: HostCall) -> Any:
    """``CUDA_HOST_NODE_PARAMS`` (v1) for a host call."""
    p = ffi.new("CUDA_HOST_NODE_PARAMS_v1 *")
    p.fn = host_trampoline()
    p.userData = ffi.cast("void *", call.token)
    return p


def adopted_host_call(fn_pointer: Any, user_data: Any) -> HostCall | None:
    """The HostCall for a host node that cuLaunchHostFunc made during a stream capture with
    :mod:`cuproc.stream`'s trampoline, whose pending record (the callable) it takes over; None for a
    node of another origin.  Such a record would be run once and dropped: a graph runs it each launch."""
    from .stream import take_host_function
    fn = take_host_function(fn_pointer, user_data)
    return None if fn is None else HostCall(fn)


# ----------------------------------------------------------------------------- conditional handles

class _U64:
    """The C type a conditional handle has as a kernel argument (``unsigned long long``), in the form
    cuproc's argument packing reads a NumPy dtype: a handle passed without a signature packs as a uint64."""

    kind, itemsize, alignment, fields = "u", 8, 8, None


class ConditionalHandle(int):
    """A conditional node's handle (``CUgraphConditionalHandle``, cuGraphConditionalHandleCreate).

    An int: pass it as a kernel argument (a ``unsigned long long``, with or without a signature) to a
    kernel that sets the condition (``cudaGraphSetConditional``).  ``default`` is the value each launch
    starts from (None: not reset at launch).  It belongs to its graph (``graph``, while that lives) and
    goes with it; it refers to the graph weakly (a graph's nodes keep their handle's value only)."""

    dtype = _U64()

    default: int | None
    _graph: weakref.ref[Graph]
    _records: dict[int, NodeRecord]

    def __new__(cls, value: int, graph: Graph, default: int | None) -> ConditionalHandle:
        self = super().__new__(cls, value)
        self.default = default
        self._graph = weakref.ref(graph)
        self._records = graph._records       # what identifies its graph (shared by the graph's views)
        return self

    @property
    def graph(self) -> Graph | None:
        return self._graph()

    def __repr__(self) -> str:
        return f"<cuproc.ConditionalHandle {int(self):#x} default={self.default}>"

    def __reduce__(self) -> Any:
        raise TypeError("a ConditionalHandle belongs to its graph and cannot be pickled")


# ----------------------------------------------------------------------------- nodes

class GraphNode(Resource):
    """A node of a graph (see the module docstring).  ``node.graph`` is its graph; ``type`` its kind
    (``"kernel"``, ``"memcpy"``, ...)."""

    _release_call = "cuGraphDestroyNode"
    _ended_word = "destroyed"
    type = "node"

    def __init__(self, graph: GraphStructure, handle: Any, record: NodeRecord) -> None:
        self.driver = graph.driver
        self.graph = graph
        self.handle = ffi.cast("CUgraphNode", handle)
        self.record = record
        record.wrapper = weakref.ref(self)
        record.node_class = type(self)
        self.ended = None

    # ------------------------------------------------------------ resource
    def parents(self) -> tuple[Resource, ...]:
        return (self.graph,)

    def describe(self) -> str:
        return f"{self.type} node {handle_int(self.handle):#x} of {self.graph.describe()}"

    def _drop_releases_a_handle(self) -> bool:
        return False

    def _drop(self) -> int:
        self.ended = "dropped"    # the node stays in its graph: only destroy() removes it
        return 0

    def _release(self) -> int:
        rc = self.graph.context.call_current(self.driver.cuGraphDestroyNode, self.handle)
        if not rc:
            self.graph._forget(self)
        return rc

    def destroy(self) -> None:
        """cuGraphDestroyNode: remove this node (and its edges) from the graph.  Idempotent.  See :meth:`close`."""
        if self.ended is None:
            self.check("cuGraphDestroyNode")
        self.close()

    def close(self) -> None:
        """cuGraphDestroyNode (idempotent; ``destroy`` and ``with node:`` come here).  In a graph with memory
        alloc or free nodes the driver refuses (cuda.h: no node of such a graph is removed; driver 580 answers
        CUDA_ERROR_NOT_SUPPORTED): the node stays in the graph and usable (the claim made before the call is
        taken back), and the error says why.  Asking the driver first costs nothing on the way that works."""
        try:
            super().close()
        except CudaError as exc:
            if exc.code != NOT_SUPPORTED or self.ended != self._ended_word:
                raise
            self.ended = None                 # the driver kept the node
            self.graph.note_removal_refused(exc, self.describe())
            raise

    def _use(self, call: str) -> Context:
        """Check this node for ``call``; the context to run it in."""
        self.check(call)
        return self.graph.context

    # ------------------------------------------------------------ dependencies
    @property
    def dependencies(self) -> list[GraphNode]:
        """The nodes this one runs after (cuGraphNodeGetDependencies, at the handle's ABI)."""
        return self._edges("cuGraphNodeGetDependencies")

    @property
    def dependents(self) -> list[GraphNode]:
        """The nodes that run after this one (cuGraphNodeGetDependentNodes)."""
        return self._edges("cuGraphNodeGetDependentNodes")

    def _edges(self, call: str) -> list[GraphNode]:
        ctx = self._use(call)
        drv = self.driver
        fn = getattr(drv, call)
        with_edges = arity(drv, call) == 4          # 12.3+: (node, nodes, edgeData, count)
        count = ffi.new("size_t *")
        args = (self.handle, ffi.NULL, ffi.NULL, count) if with_edges else (self.handle, ffi.NULL, count)
        drv.check(ctx.call_current(fn, *args), call)
        if not count[0]:
            return []
        out = ffi.new("CUgraphNode[]", count[0])
        args = (self.handle, out, ffi.NULL, count) if with_edges else (self.handle, out, count)
        drv.check(ctx.call_current(fn, *args), call)
        return [self.graph._node(out[i]) for i in range(count[0])]

    def _inner_graphs(self) -> tuple[Graph, ...]:
        """The graphs inside this node (a child graph node's graph, a conditional node's bodies): where
        :meth:`~cuproc.graph_structure.GraphStructure.find_node` looks further."""
        return ()

    def add_dependencies(self, *nodes: GraphNode) -> None:
        """Make this node run after ``nodes`` (cuGraphAddDependencies)."""
        self.graph._edit_edges("cuGraphAddDependencies", list(nodes), [self] * len(nodes))

    def remove_dependencies(self, *nodes: GraphNode) -> None:
        """Remove the edges from ``nodes`` to this node (cuGraphRemoveDependencies)."""
        self.graph._edit_edges("cuGraphRemoveDependencies", list(nodes), [self] * len(nodes))

    def __repr__(self) -> str:
        state = f" {self.ended}" if self.ended else ""
        return f"<cuproc.{type(self).__name__} {handle_int(self.handle):#x}{state}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GraphNode) and other.record is self.record and other.graph is self.graph

    def __hash__(self) -> int:
        return hash((id(self.graph), id(self.record)))


class KernelNodeParams(NamedTuple):
    """What cuGraphKernelNodeGetParams reports: the function (the cuproc Function the node was made with,
    while it is the driver's answer; else the raw CUfunction), grid, block, dynamic shared memory, and the
    argument block as the kernel receives it (empty for a node cuproc did not make)."""

    function: Any
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    arg_bytes: bytes


class KernelNode(GraphNode):
    """A kernel launch (cuGraphAddKernelNode).  ``params`` reads it back; :meth:`set_params` changes
    its arguments, grid, block or shared memory in the graph (an executable graph made before keeps what
    it had: set them there with :meth:`~cuproc.graph.GraphExec.set_kernel_args`)."""

    type = "kernel"

    @property
    def params(self) -> KernelNodeParams:
        p = kernel_node_params(self.driver, self._use("cuGraphKernelNodeGetParams"), self.handle)
        kernel = self.record.kernel
        function: Any = p.func
        arg_bytes = b""
        if kernel is not None:
            fn, packed = kernel[0], kernel[1]
            if launches_recorded(self.record, p):
                function = fn
            if p.kernelParams != ffi.NULL:   # one pointer per parameter, in the packed layout
                block = bytearray(packed.size)
                for i, (t, offset) in enumerate(zip(packed.types, packed.offsets)):
                    block[offset:offset + t.size] = ffi.buffer(p.kernelParams[i], t.size)
                arg_bytes = bytes(block)
        return KernelNodeParams(function, (p.gridDimX, p.gridDimY, p.gridDimZ),
                                (p.blockDimX, p.blockDimY, p.blockDimZ), p.sharedMemBytes, arg_bytes)

    def set_params(self, args: Sequence[Any] | None = None, *, grid: Any = None, block: Any = None,
                   shared_mem: int | None = None, signature: Sequence[Any] | None = None) -> None:
        """cuGraphKernelNodeSetParams: new arguments (packed as a launch packs them: by ``signature``,
        else by the node's own types), grid, block or shared memory; what is not given stays."""
        call = "cuGraphKernelNodeSetParams"
        ctx = self._use(call)
        kernel = self.record.kernel
        if kernel is None:
            raise invalid(call, f"{self.describe()} was not made by cuproc (a captured node): its argument "
                                "types are not known here; set it through the driver's own call")
        function, packed, values, dims, shared = kernel
        reuse = args is None and signature is None      # the block already holds these values
        new = kernel_parts(self.graph, function, call, values if args is None else args,
                           packed.types if signature is None else signature,
                           dims[:3] if grid is None else grid, dims[3:] if block is None else block,
                           shared if shared_mem is None else shared_mem, packed if reuse else None)
        p = kernel_struct(self.driver, call, 1, new)
        self.driver.check(ctx.call_current(self.driver.cuGraphKernelNodeSetParams, self.handle, p), call)
        apply_kernel(self.record, new)


def kernel_node_params(driver: Driver, context: Context, handle: Any) -> Any:
    """cuGraphKernelNodeGetParams of the kernel node ``handle`` (``context`` made current), in the struct of
    the ABI this driver's entry point selected (v1, or v2 with ``kern`` and ``ctx``)."""
    call = "cuGraphKernelNodeGetParams"
    p = ffi.new(ffi.getctype(param_struct(driver, call, 1), "*"))
    driver.check(context.call_current(driver.cuGraphKernelNodeGetParams, handle, p), call)
    return p


def launches_recorded(record: NodeRecord, params: Any) -> bool:
    """True when the kernel node whose driver parameters are ``params`` (:func:`kernel_node_params`) launches
    the function ``record`` holds -- in an adopted graph a node handle the driver gave again to another
    kernel node launches another function, whose arguments the record's signature must not pack."""
    return record.kernel is not None and handle_int(params.func) == handle_int(record.kernel[0].handle)


def kernel_parts(graph: GraphStructure, function: Any, call: str, args: Sequence[Any], signature: Sequence[Any] | None,
                 grid: Any, block: Any, shared_mem: Any, packed: Any = None) -> tuple:
    """(function, packed, values, dims, shared_mem, held, keep) of a kernel node: ``function`` a Function or
    Kernel (a library kernel becomes its CUfunction in the graph's context), the arguments packed by
    :mod:`cuproc.launch`'s own code (``packed``: an argument block to reuse as is), the dimensions checked."""
    from .launch import launch_dims, pack_arguments, shared_mem_bytes
    from .module import Function, Kernel
    if isinstance(function, Kernel):
        function = function.function(graph.context)
    elif not isinstance(function, Function):
        raise invalid(call, f"a kernel node launches a cuproc Function or Kernel, not {type(function).__name__}")
    if function.context is not None and function.context is not graph.context:
        raise invalid(call, f"{function.describe()} belongs to {function.context.describe()}, not to the graph's "
                            f"{graph.context.describe()}: a graph's kernels run in its context")
    given = tuple(args)
    if packed is None:
        packed = pack_arguments(function, call, given, signature)
    else:
        function.check(call)
    # what is kept to pack again: a conditional handle as its value (it refers to its graph, which keeps this)
    values = tuple(int(v) if isinstance(v, ConditionalHandle) else v for v in given)
    dim6 = (*launch_dims(grid, "grid", call), *launch_dims(block, "block", call))
    held, keep = held_by(given)
    return function, packed, values, dim6, shared_mem_bytes(shared_mem, call), (*function.ancestors(), function) + held, keep


def kernel_struct(driver: Driver, call: str, index: int, parts: tuple) -> Any:
    """The kernel node parameter struct ``call`` takes at this handle's ABI (v1 or v2), filled from
    :func:`kernel_parts`: kernelParams convention, the CUfunction (v2's kern and ctx left NULL)."""
    function, packed, _values, dims, shared = parts[:5]
    p = ffi.new(ffi.getctype(param_struct(driver, call, index), "*"))
    p.func = function.handle
    p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ = dims
    p.sharedMemBytes = shared
    p.kernelParams = packed.params
    p.extra = ffi.NULL
    return p


def apply_kernel(record: NodeRecord, parts: tuple) -> None:
    """Store a kernel node's new parts in its record (what the graph keeps and checks)."""
    function, packed, values, dims, shared, held, keep = parts
    record.kernel = (function, packed, values, dims, shared)
    record.keep = (packed, *keep)
    record.held = tuple(dict.fromkeys(held))


class MemcpyNode(GraphNode):
    """A copy (cuGraphAddMemcpyNode).  ``params`` is the driver's CUDA_MEMCPY3D; :meth:`set_params`
    gives it new sides."""

    type = "memcpy"

    @property
    def params(self) -> Any:
        ctx = self._use("cuGraphMemcpyNodeGetParams")
        p = ffi.new("CUDA_MEMCPY3D_v2 *")
        self.driver.check(ctx.call_current(self.driver.cuGraphMemcpyNodeGetParams, self.handle, p),
                          "cuGraphMemcpyNodeGetParams")
        return p[0]

    def set_params(self, dst: Any, src: Any, nbytes: int | None = None) -> None:
        """cuGraphMemcpyNodeSetParams: copy ``nbytes`` from ``src`` to ``dst`` (checked as memory.copy checks)."""
        call = "cuGraphMemcpyNodeSetParams"
        ctx = self._use(call)
        p, _ctx, held, keep, runtime = copy_struct(self.graph, call, dst, src, nbytes)
        self.driver.check(ctx.call_current(self.driver.cuGraphMemcpyNodeSetParams, self.handle, p), call)
        self.record.held, self.record.keep, self.record.runtime = held, keep, runtime


def copy_struct(graph: GraphStructure, call: str, dst: Any, src: Any,
                nbytes: int | None) -> tuple[Any, Context, tuple, tuple, tuple]:
    """(CUDA_MEMCPY3D, the context it runs in, resources held, objects kept, the host memory among them: what
    the driver reads or writes when the copy runs) of a 1-D copy between any two
    sides memory.copy takes, checked as it checks them (sizes, a read-only destination)."""
    from .transfers import _both_host, _checked_size, _place, _side
    d, s = _side(dst, call, writable=True), _side(src, call, writable=False)
    n = _checked_size(call, nbytes, d, s)
    if d.kind == "host" and s.kind == "host":
        raise _both_host()
    if d.context is not None and s.context is not None and d.context is not s.context and \
            d.kind != "host" and s.kind != "host":
        raise invalid(call, "a memcpy node copies within one context; these sides are in two")
    ctx = next((side.context for side in (d, s) if side.kind != "host" and side.context is not None), graph.context)
    p = ffi.new("CUDA_MEMCPY3D_v2 *")
    _place(graph.driver, p, "src", s)
    _place(graph.driver, p, "dst", d)
    p.WidthInBytes, p.Height, p.Depth = n, 1, 1
    held, keep = held_by((dst, src))
    hosts = tuple(side.keep for side in (d, s) if side.keep is not None and side.kind == "host")
    return p, ctx, held, keep + tuple(side.keep for side in (d, s) if side.keep is not None), hosts


class MemsetNode(GraphNode):
    """A fill (cuGraphAddMemsetNode).  ``params`` is the driver's CUDA_MEMSET_NODE_PARAMS."""

    type = "memset"

    @property
    def params(self) -> Any:
        ctx = self._use("cuGraphMemsetNodeGetParams")
        p = ffi.new("CUDA_MEMSET_NODE_PARAMS_v1 *")
        self.driver.check(ctx.call_current(self.driver.cuGraphMemsetNodeGetParams, self.handle, p),
                          "cuGraphMemsetNodeGetParams")
        return p[0]

    def set_params(self, dst: Any, value: int, count: int | None = None, *, element_bits: int = 8) -> None:
        """cuGraphMemsetNodeSetParams: fill ``count`` elements of ``element_bits`` of ``dst`` with ``value``."""
        call = "cuGraphMemsetNodeSetParams"
        ctx = self._use(call)
        p, _ctx, held, keep = memset_struct(self.graph, call, dst, value, count, element_bits)
        self.driver.check(ctx.call_current(self.driver.cuGraphMemsetNodeSetParams, self.handle, p), call)
        self.record.held, self.record.keep = held, keep


def memset_struct(graph: GraphStructure, call: str, dst: Any, value: int, count: int | None,
                  element_bits: int) -> tuple[Any, Context, tuple, tuple]:
    """(CUDA_MEMSET_NODE_PARAMS, its context, resources held, objects kept) of a 1-D fill, checked as
    memory.memset checks one."""
    from .transfers import _side
    size = check_element_bits(element_bits, call)
    d = _side(dst, call, writable=True)
    if d.kind != "device":
        raise invalid(call, "a memset node fills device memory; the destination is host memory")
    count = fill_count(call, d.ptr, d.nbytes, value, count, element_bits, minimum=1)
    p = ffi.new("CUDA_MEMSET_NODE_PARAMS_v1 *")
    p.dst, p.value, p.elementSize, p.width, p.height, p.pitch = d.ptr, value, size, count, 1, count * size
    held, keep = held_by((dst,))
    return p, d.context or graph.context, held, keep


class HostNode(GraphNode):
    """A call of a Python callable on a driver thread (cuGraphAddHostNode).  The callable must not call
    CUDA.  ``errors``: what it raised (each also reported as a CudaWarning)."""

    type = "host"

    @property
    def function(self) -> Any:
        call = self._call()
        return None if call is None else call.fn

    @property
    def errors(self) -> list[BaseException]:
        call = self._call()
        return [] if call is None else list(call.errors)

    def _call(self) -> HostCall | None:
        return next((k for k in self.record.keep if isinstance(k, HostCall)), None)

    def set_params(self, fn: Callable[[], Any]) -> None:
        """cuGraphHostNodeSetParams: call ``fn`` instead."""
        call = "cuGraphHostNodeSetParams"
        ctx = self._use(call)
        host = HostCall(fn)
        self.driver.check(ctx.call_current(self.driver.cuGraphHostNodeSetParams, self.handle, host_params(host)),
                          call)
        self.record.keep = (host,)


class _EventNode(GraphNode):
    _get = _set = ""

    @property
    def event(self) -> Any:
        """The event (the cuproc Event the node was made with, while it is the driver's answer)."""
        ctx = self._use(self._get)
        out = ffi.new("CUevent *")
        self.driver.check(ctx.call_current(getattr(self.driver, self._get), self.handle, out), self._get)
        for held in self.record.held:
            if handle_int(getattr(held, "handle", 0)) == handle_int(out[0]):
                return held
        return out[0]

    def set_event(self, event: Any) -> None:
        ctx = self._use(self._set)
        event.check(self._set)
        self.driver.check(ctx.call_current(getattr(self.driver, self._set), self.handle, event.handle), self._set)
        self.record.held = (event,)


class EventRecordNode(_EventNode):
    """Records an event (cuGraphAddEventRecordNode); the node holds the Event."""

    type = "event_record"
    _get, _set = "cuGraphEventRecordNodeGetEvent", "cuGraphEventRecordNodeSetEvent"


class EventWaitNode(_EventNode):
    """Waits for an event (cuGraphAddEventWaitNode); the node holds the Event."""

    type = "event_wait"
    _get, _set = "cuGraphEventWaitNodeGetEvent", "cuGraphEventWaitNodeSetEvent"


class ChildGraphNode(GraphNode):
    """A graph run as one node (cuGraphAddChildGraphNode, which copies the child: later changes to the
    child Graph do not reach the node).  ``child_graph`` is the node's own copy, which may be changed; it
    belongs to the node (a view: closing or dropping it destroys nothing)."""

    type = "graph"

    @property
    def child_graph(self) -> Graph:
        """The node's graph as the driver has it (cuGraphChildGraphNodeGetGraph), for any child graph node:
        one cuproc added, or one the driver made (a capture, a copy inside another child graph)."""
        call = "cuGraphChildGraphNodeGetGraph"
        ctx = self._use(call)
        out = ffi.new("CUgraph *")
        self.driver.check(ctx.call_current(self.driver.cuGraphChildGraphNodeGetGraph, self.handle, out), call)
        if not self.record.bodies:          # a node cuproc did not add: its graph's records start empty
            self.record.bodies = ({},)
        return self.graph._body(out[0], self, self.record.bodies[0])

    def _inner_graphs(self) -> tuple[Graph, ...]:
        return (self.child_graph,)


class EmptyNode(GraphNode):
    """A node that does nothing: a join point for dependencies (cuGraphAddEmptyNode)."""

    type = "empty"


class MemAllocNode(GraphNode):
    """Graph-owned device memory (cuGraphAddMemAllocNode): ``address`` is fixed when the node is made and
    valid in the graph's launches from this node on, until a free node (or, with
    ``AUTO_FREE_ON_LAUNCH``, the next launch)."""

    type = "mem_alloc"

    @property
    def params(self) -> Any:
        ctx = self._use("cuGraphMemAllocNodeGetParams")
        p = ffi.new("CUDA_MEM_ALLOC_NODE_PARAMS *")
        self.driver.check(ctx.call_current(self.driver.cuGraphMemAllocNodeGetParams, self.handle, p),
                          "cuGraphMemAllocNodeGetParams")
        return p[0]

    @property
    def address(self) -> int:
        return int(self.params.dptr)

    @property
    def nbytes(self) -> int:
        return int(self.params.bytesize)


#: How a graph allocation's buffer reads (its ``ended``) while its memory does not exist.
NOT_ALLOCATED = ("not allocated yet: it is a graph allocation (alloc_async during a stream capture) and the graph's "
                 "memory exists only from a launch of its executable graph until it is freed; launch it first")
FREED_UNTIL_LAUNCH = "freed (a graph allocation: the next launch of its executable graph allocates it again)"
PENDING_FREE = ("freed by a free node of a stream capture: the memory exists until a launch of that capture's "
                "graph frees it (should that capture fail, or its graph and executable graphs go unlaunched, it "
                "is allocated again and usable)")
#: How a graph allocation reads once it was collected while a free node of it was pending (a reference cycle
#: through the freeing graph): its memory is freed when that free is undone (PendingFree.undo).
DROPPED_PENDING = "dropped while a free of it was pending (freed once that free is undone)"
#: id(allocation) -> the serial number of its newest PendingFree (see PendingFree)
_NEWEST_FREE: dict[int, int] = {}
_FREE_SERIALS = itertools.count(1)
#: held while a graph allocation's pending state is tested and changed (a free into a capture or a free node
#: added by hand, an undo, a commit): a finalizer in another thread (the collector runs anywhere) never undoes
#: a free between another thread's test and its change.  Re-entrant: a finalizer may run while it is held.
_PENDING_LOCK = _fork.rlock()
#: the cuproc capture running on a stream: ``(driver, context, CUstream) -> StreamCapture | None``, set by
#: cuproc.stream_capture when imported (it sits above this module); None: cuproc runs no capture
CAPTURE_ON: list[Callable[[Driver, Context, Any], Any] | None] = [None]
#: the cuproc capture that prohibits this thread's "potentially unsafe" calls (cuMemFree...) now: ``() ->
#: StreamCapture | None``, set by cuproc.stream_capture when imported; None: cuproc runs no capture
PROHIBITING: list[Callable[[], Any] | None] = [None]


class PendingFree:
    """A :class:`GraphAllocation` freed by ``free_async`` into a stream capture cuproc runs: the free is a
    node of that capture's graph, so the memory stays allocated until a launch of that graph frees it.
    Held by the capture, then by its graph and every executable graph made from it or updated with it
    (``GraphExec.update``: the free node is the executable graph's then); a launch of one commits the free
    (:meth:`launched`).  A destroyed executable graph lets go of it at once.  When the capture fails
    (:meth:`undo`), or the last holder goes without a launch (the finalizer), the free never happens: the
    allocation is allocated and usable again -- its own finalizer frees it then, where it was dropped too
    (nothing leaks, nothing frees twice).  Such a graph is never a child graph: the driver clones a child
    graph and refuses one with memory nodes (``Graph.add_child_graph`` says so first).

    Several can exist for one allocation: one capture's free launched (the memory freed), its own graph
    launched again (allocated again), then freed into another capture.  Only the newest may undo the
    pending state, since that state is the newest's: an older one let go later (its graph dropped) would
    otherwise make memory another capture's graph is about to free usable again.  The newest is known by a
    serial number filed under the allocation's ``id`` (the allocation lives while any of its pending frees
    does, so the id is not reused meanwhile; the entry goes with the newest)."""

    __slots__ = ("allocation", "serial")

    def __init__(self, allocation: GraphAllocation) -> None:
        """Made before _PENDING_LOCK is taken (making an object may run a collection, and with it an older pending
        free's finalizer); :meth:`take_effect` then makes it the allocation's state."""
        self.allocation = allocation
        self.serial = next(_FREE_SERIALS)

    def take_effect(self) -> None:
        """With _PENDING_LOCK held and the allocation tested allocated: it is pending now, this its newest free.
        Plain stores only (nothing that makes an object, so no collection runs an older free's undo between)."""
        _NEWEST_FREE[id(self.allocation)] = self.serial
        self.allocation.ended = PENDING_FREE

    def check_allocated(self, call: str, graph: str) -> None:
        """Refuse a launch of ``graph`` that would free the memory while it is not allocated (freed already,
        or its graph not launched since): the driver would free it twice."""
        a = self.allocation
        if a.ended is not None and a.ended != PENDING_FREE:
            raise invalid(call, f"{graph} frees {a.describe()}, which is not allocated now ({a.ended}): launch "
                                "its own executable graph first")

    def launched(self) -> None:
        """A launch holding the free node was made: the memory is freed, until its graph's next launch."""
        with _PENDING_LOCK:
            self.allocation.ended = FREED_UNTIL_LAUNCH

    def undo(self) -> None:
        """The free will not happen (its capture failed, or no launch will make it): allocated again, when this
        is the allocation's newest pending free (an older one's state was replaced by a newer free's).  Where
        the allocation was collected meanwhile (both in one reference cycle, its finalizer first), its memory
        is freed now: nothing else would."""
        a = self.allocation
        with _PENDING_LOCK:
            if _NEWEST_FREE.get(id(a)) != self.serial:
                return
            del _NEWEST_FREE[id(a)]
            if a.ended == PENDING_FREE:
                a.ended = None
            dropped = a.ended == DROPPED_PENDING
        if dropped:
            a.free_after_drop()

    def __del__(self) -> None:
        try:
            self.undo()
        except Exception:  # noqa: BLE001 - a finalizer never raises (interpreter exit may have taken the lock)
            pass


class GraphAllocation(DeviceBuffer):
    """What ``alloc_async`` made during a stream capture that the capture did not free: a *graph
    allocation* (the capture made a memory alloc node, cuMemAllocAsync's documented behaviour), not pool
    memory.  Its address is fixed, but its memory exists only from a launch of the executable graph
    (``GraphExec.launch``) until it is freed; the next launch allocates it again, at the same address.

    * Before the first launch, and between a free and the next launch, it refuses every use
      (:class:`~cuproc.errors.ClosedResourceError`: ``ended`` says why) and ``free_async`` raises: the
      driver refuses to free memory its graph never allocated.
    * After a launch, it is device memory as any other, until ``free_async(stream)`` (cuMemFreeAsync,
      ordered after the launch; default: the launch's stream) or ``close()`` / ``free()`` (the same on the
      launch's stream while it lives, else cuMemFree).  The executable graph cannot be launched again
      until it is freed (cuGraphLaunch refuses; cuproc says so first), unless it was instantiated with
      ``AUTO_FREE_ON_LAUNCH``.
    * Dropped while allocated, its finalizer frees it; dropped otherwise, nothing is freed (nothing
      exists), and each later launch frees the allocation right after itself on the launch's stream.

    The capture turns the buffer ``alloc_async`` returned into this class when it ends (the object the
    caller holds); one freed inside the capture (a free node) simply ends as "freed"."""

    __slots__ = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a GraphAllocation is made by alloc_async during a stream capture (cuproc.capture)")

    def describe(self) -> str:
        return f"graph allocation of {self.nbytes} bytes at {self.address:#x}"

    def __del__(self) -> None:
        """Collected while a free node of it is pending (only possible in one reference cycle with that free's
        graph: the free holds it): nothing to free yet -- the memory is freed when the free is undone, which
        the pending free's own finalizer does (:meth:`PendingFree.undo`).  Otherwise as any DeviceBuffer."""
        if self.ended == PENDING_FREE:
            with _PENDING_LOCK:
                if self.ended == PENDING_FREE:
                    self.ended = DROPPED_PENDING
                    return
        DeviceBuffer.__del__(self)

    def free_after_drop(self) -> None:
        """Free the memory of a graph allocation collected while a free of it was pending, once that free was
        undone: its finalizer, now that there is memory to free (the same steps: put off while a stream capture
        prohibits the free)."""
        self.ended = None
        DeviceBuffer.__del__(self)

    @property
    def allocated(self) -> bool:
        """True from a launch of its executable graph until the memory is freed."""
        return self.ended is None

    def _release(self) -> int:
        """close() and the finalizer of allocated memory: cuMemFreeAsync on the stream of the launch that
        allocated it while that stream is usable and not being captured, else cuMemFree (the driver frees
        graph memory both ways).  Never a free into a capture: there it would be a node of another graph,
        and the memory would stay allocated (cuStreamIsCapturing asks first)."""
        h = self._free_stream()
        if h is not None:
            return self.context.call_on(h, self.driver.cuMemFreeAsync, self.address, h)
        return self.context.call(self.driver.cuMemFree, self.address)

    def _free_stream(self) -> Any:
        """The CUstream :meth:`_release` frees on: the launch's stream while it is usable and not being
        captured (cuStreamIsCapturing); None where it takes cuMemFree."""
        stream = self.stream
        if not isinstance(stream, Stream) or stream.ended_owner() is not None:
            return None
        try:
            capturing = stream_capturing(self.driver, self.context, stream.handle)
        except CudaError:
            return None   # not known: the synchronous free cannot end up in a capture
        return None if capturing else stream.handle

    def close(self) -> None:
        """Free the allocated memory now (cuMemFreeAsync on the launch's stream, or cuMemFree: see
        :meth:`_release`); idempotent.  Refused before the driver, the buffer left allocated, where that is
        cuMemFree while a stream capture cuproc runs prohibits this thread's "potentially unsafe" calls (mode
        "global", or "thread_local" begun on this thread): the driver would refuse cuMemFree and invalidate
        that capture.  Close it after the capture (as pool memory freed in a capture is refused and stays
        usable); a dropped one is freed when the capture ends (the finalizers' rule)."""
        if self.ended is None:
            self._refuse_synchronous_free_during_capture()
        super().close()

    def _refuse_synchronous_free_during_capture(self) -> None:
        """Raise (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, cuMemFree refused by cuproc) when :meth:`close`
        would take cuMemFree while a cuproc capture prohibits it in this thread."""
        find = PROHIBITING[0]
        capture = find() if find is not None else None
        if capture is None or self._free_stream() is not None:
            return
        raise refusal("cuMemFree", f"{self.describe()} was not freed and stays allocated: close() frees it with "
                                   "cuMemFree here (its stream is gone or being captured), which the stream capture "
                                   f"on {capture.describe()} prohibits (the driver would refuse it and invalidate "
                                   "that capture); close it after that capture ends, or free_async(stream) on a "
                                   "stream that is not being captured", code_name="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")

    def free_async(self, stream: Stream | Any | None = None) -> None:  # type: ignore[override]
        """cuMemFreeAsync of the allocated memory on ``stream`` (default: the stream of the launch that
        allocated it), ordered after that launch; the next launch allocates it again.  Idempotent once
        freed; refused (before the driver) while the graph never allocated it.

        On a stream being captured (cuStreamIsCapturing) the driver makes a free node in that capture's
        graph instead, which frees nothing until that graph is launched: the free is pending (see
        :class:`PendingFree`) -- the object refuses use as freed, and the memory is freed by the first
        launch of an executable graph made from the captured graph.  Refused in a capture cuproc does not
        run: whether its graph ever runs is not known here."""
        call = "cuMemFreeAsync"
        if self.ended == PENDING_FREE:
            target = self.stream if stream is None else stream
            if stream_capturing(self.driver, self.context, stream_handle(target, self.driver, call)):
                raise invalid(call, f"{self.describe()} has a free pending in another capture's graph (it frees the "
                                    "memory when that graph is launched): a second free node would free it twice; "
                                    "launch that graph first, or drop it unlaunched")
            return
        if self.ended == FREED_UNTIL_LAUNCH:
            return
        if self.ended == NOT_ALLOCATED:
            raise invalid(call, f"{self.describe()} was never allocated: its graph has not been launched (the "
                                "driver refuses to free it); launch the executable graph first, free it after")
        self.check(call)
        if id(self) in EXPORTS and self.has_views():
            raise BufferError(f"{call} was not called: {self.describe()} still has views (a DLPack export); drop "
                              "them first")
        target = self.stream if stream is None else stream
        h = stream_handle(target, self.driver, call)
        capture = self._capture_on(h, call)
        if capture is None:   # (a free node runs when its graph is launched: the launches' order orders it)
            after_last_work(self, self.context, h, target if isinstance(target, Stream) else None)
        self.driver.check(self.context.call_on(h, self.driver.cuMemFreeAsync, self.address, h), call)
        if capture is None:
            self.ended = FREED_UNTIL_LAUNCH
            return
        capture.free_pending(self._pending(call, "the capture now frees it twice; end it with an exception (its "
                                                 "graph is discarded)"))

    def free_by_node(self, call: str, graph: str) -> PendingFree:
        """A free node of this allocation is being added by hand (``Graph.add_free(buffer)``) to ``graph``:
        the free is pending from now, as a captured free is (:class:`PendingFree`, which the caller gives its
        graph).  Refused while the memory is not allocated now, or another graph's free of it is pending (two
        free nodes would free it twice), or a DLPack export of it is alive.  The last test and the change are
        one step (_PENDING_LOCK, under which nothing else is called): two threads adding a free node of it make
        one pending free, and refuse the other."""
        if self.ended == PENDING_FREE:
            raise invalid(call, f"{self.describe()} has a free pending in another graph (it frees the memory when "
                                "that graph is launched): a second free node would free it twice; launch that "
                                "graph first, or drop it unlaunched")
        if self.ended in (FREED_UNTIL_LAUNCH, NOT_ALLOCATED):
            raise invalid(call, f"{graph} cannot free {self.describe()} from here: it is not allocated now "
                                f"({self.ended}); add the free node after a launch of its executable graph")
        self.check(call)
        if id(self) in EXPORTS and self.has_views():
            raise BufferError(f"{call} was not called: {self.describe()} still has views (a DLPack export); drop "
                              "them first")
        return self._pending(call, "nothing is left for this free node to free")

    def _pending(self, call: str, then: str) -> PendingFree:
        """This allocation's free is pending from now (a free node made, captured or by hand): its PendingFree,
        made before the lock is taken (see PendingFree), then the test that it is still allocated and the change,
        as one step against a finalizer's undo.  ``then``: what it means that another thread freed it meanwhile."""
        pending = PendingFree(self)
        with _PENDING_LOCK:
            if self.ended is not None:
                raise invalid(call, f"{self.describe()} was freed, or a free node of it added, by another thread "
                                    f"meanwhile: {then}")
            pending.take_effect()
        return pending

    def _capture_on(self, h: Any, call: str) -> Any:
        """The cuproc capture running on stream ``h`` (None when it is not being captured); refused for a
        capture cuproc does not run."""
        if not stream_capturing(self.driver, self.context, h):
            return None
        find = CAPTURE_ON[0]
        capture = find(self.driver, self.context, h) if find is not None else None
        if capture is None:
            raise invalid(call, f"{self.describe()} would be freed by a node of a stream capture cuproc does not run "
                                "(another library's): whether that graph ever runs, and so whether the memory is "
                                "freed, is not known here; free it on a stream not being captured, or capture "
                                "with cuproc.capture")
        return capture

    def launched(self, stream: Stream | Any) -> None:
        """A launch on ``stream`` allocated this memory (called by ``GraphExec.launch``): usable again, to be
        freed on that stream by default."""
        if self.context.ended is None:
            self.stream = self.last_stream = stream
            self.ended = None


def adopt_graph_allocation(buffer: DeviceBuffer) -> GraphAllocation:
    """``buffer`` (what alloc_async returned during a capture, its claim on the pool entry already taken by
    the caller) as a :class:`GraphAllocation` that its graph has not allocated yet.  The object is the
    caller's: its class changes in place (GraphAllocation adds no slots)."""
    buffer.__class__ = GraphAllocation
    buffer.ended = NOT_ALLOCATED
    return buffer  # type: ignore[return-value]


class MemFreeNode(GraphNode):
    """Frees graph-owned memory (cuGraphAddMemFreeNode)."""

    type = "mem_free"

    @property
    def address(self) -> int:
        ctx = self._use("cuGraphMemFreeNodeGetParams")
        out = ffi.new("CUdeviceptr *")
        self.driver.check(ctx.call_current(self.driver.cuGraphMemFreeNodeGetParams, self.handle, out),
                          "cuGraphMemFreeNodeGetParams")
        return int(out[0])


class ConditionalNode(GraphNode):
    """IF, IF/ELSE, WHILE or SWITCH on a :class:`ConditionalHandle` (cuGraphAddNode, CUDA 12.3+).  Its
    ``bodies`` are graphs owned by the node (views: closing or dropping one destroys nothing): add their
    nodes there.  ``kind``: "if", "while" or "switch".

    For a node cuproc did not add (captured, or inside a child graph's copy), the bodies, kind and handle
    are read from the driver (cuGraphNodeGetParams, CUDA 13.2): at an older requested version they cannot
    be, and the dispatcher's error says so."""

    type = "conditional"

    def _learn(self, call: str) -> None:
        """Read a node cuproc did not add from the driver into its record (bodies, kind, handle) once."""
        record = self.record
        if record.graphs:
            return
        ctx = self._use(call)
        query = "cuGraphNodeGetParams"
        try:
            require_at_requested_version(self.driver, query)
        except Exception as exc:
            add_note(exc, f"{self.describe()} was not added by cuproc: its bodies are known only to the driver, "
                          f"which reports them through {query}")
            raise
        p = ffi.new("CUgraphNodeParams *")
        self.driver.check(ctx.call_current(self.driver.cuGraphNodeGetParams, self.handle, p), query)
        size, bodies = p.conditional.size, p.conditional.phGraph_out
        if bodies == ffi.NULL or any(bodies[i] == ffi.NULL for i in range(size)):
            raise invalid(query, f"the driver reported no body graphs for {self.describe()}")
        kinds = {value: name for name, value in CONDITIONAL_TYPES.items()}
        record.info = (kinds.get(p.conditional.type, "unknown"), int(p.conditional.handle))
        record.bodies = tuple({} for _ in range(size))
        record.graphs = tuple(ffi.cast("CUgraph", bodies[i]) for i in range(size))

    @property
    def bodies(self) -> tuple[Graph, ...]:
        self._learn("cuGraphAddNode")
        return tuple(self.graph._body(h, self, records) for h, records in zip(self.record.graphs, self.record.bodies))

    def _inner_graphs(self) -> tuple[Graph, ...]:
        try:
            return self.bodies
        except SymbolNotFoundError:     # a node the driver cannot describe at this version: nothing to search
            return ()

    @property
    def kind(self) -> str:
        """"if", "while" or "switch" (an IF node with an else body is an "if" with two bodies)."""
        self._learn("cuGraphAddNode")
        return self.record.info[0]

    @property
    def condition(self) -> int:
        """The value of the handle that decides."""
        self._learn("cuGraphAddNode")
        return self.record.info[1]

    @property
    def body(self) -> Graph:
        """The body of an IF or WHILE node (the first of ``bodies``)."""
        return self.bodies[0]

    @property
    def then_body(self) -> Graph:
        """An IF node's body run when the condition is not 0."""
        return self.bodies[0]

    @property
    def else_body(self) -> Graph:
        """An IF/ELSE node's body run when the condition is 0."""
        bodies = self.bodies
        if len(bodies) < 2:
            raise invalid("cuGraphAddNode", f"{self.describe()} has no else body (make it with add_if_else)")
        return bodies[1]


NODE_CLASSES: dict[str, type[GraphNode]] = {
    "CU_GRAPH_NODE_TYPE_KERNEL": KernelNode, "CU_GRAPH_NODE_TYPE_MEMCPY": MemcpyNode,
    "CU_GRAPH_NODE_TYPE_MEMSET": MemsetNode, "CU_GRAPH_NODE_TYPE_HOST": HostNode,
    "CU_GRAPH_NODE_TYPE_GRAPH": ChildGraphNode, "CU_GRAPH_NODE_TYPE_EMPTY": EmptyNode,
    "CU_GRAPH_NODE_TYPE_WAIT_EVENT": EventWaitNode, "CU_GRAPH_NODE_TYPE_EVENT_RECORD": EventRecordNode,
    "CU_GRAPH_NODE_TYPE_MEM_ALLOC": MemAllocNode, "CU_GRAPH_NODE_TYPE_MEM_FREE": MemFreeNode,
    "CU_GRAPH_NODE_TYPE_CONDITIONAL": ConditionalNode,
}


def node_class(type_value: int) -> type[GraphNode]:
    """The node class of a CUgraphNodeType value (GraphNode for a kind cuproc has no class for)."""
    return NODE_CLASSES.get(_NODE_TYPES.get(type_value, ""), GraphNode)


def alloc_params(graph: GraphStructure, nbytes: int) -> Any:
    """CUDA_MEM_ALLOC_NODE_PARAMS for ``nbytes`` of pinned device memory on the graph's device."""
    call = "cuGraphAddMemAllocNode"
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise invalid(call, f"nbytes must be a positive int, got {nbytes!r}")
    p = ffi.new("CUDA_MEM_ALLOC_NODE_PARAMS *")
    p.poolProps.allocType = _PINNED
    p.poolProps.location.type = _ON_DEVICE
    p.poolProps.location.id = graph.context.device.ordinal
    p.accessDescs = ffi.NULL
    p.accessDescCount = 0
    p.bytesize = nbytes
    return p



__all__ = ["ChildGraphNode", "ConditionalHandle", "ConditionalNode", "EmptyNode", "EventRecordNode", "EventWaitNode",
           "GraphAllocation", "GraphNode", "HostNode", "KernelNode", "KernelNodeParams", "MemAllocNode", "MemFreeNode", "MemcpyNode",
           "MemsetNode"]
