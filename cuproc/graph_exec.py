"""Executable CUDA graphs: instantiation at the requested version's ABI, launch, upload, update, kernel
arguments set on the executable graph, and what a launch keeps alive until it has run.

Policy
------
* **Instantiation** takes ``cuGraphInstantiateWithParams`` where the requested
  version has it (12.0+: flags, an upload stream, the error node and result);
  before that ``cuGraphInstantiate`` -- the 11.x five-argument ABI, with its
  error node and log -- or, for flags, ``cuGraphInstantiateWithFlags``.  A
  refusal is :class:`~cuproc.graph_errors.GraphInstantiateError` naming the
  node, found wherever it is (a child graph, a conditional body).
* **What an executable graph holds.**  It keeps a copy of what its graph's
  nodes referred to (by place in the graph, never by a node handle, which the
  driver hands out again), so the graph may be dropped first.  A freed buffer
  or unloaded module it refers to makes :meth:`GraphExec.launch` refuse with
  :class:`~cuproc.errors.ClosedResourceError` before the driver sees it.
* **What a launch holds.**  The driver runs a graph's host nodes later, on the
  stream's work, and reads host memory a copy node names when the copy runs:
  after a launch returns, the callables and host memory must outlive the
  launch, even when the user drops the executable graph and its graph at once.
  A launch of a graph with such nodes therefore queues, after the graph on the
  same stream, a host function that lets them go (``cuLaunchHostFunc``): they
  are kept until the launch has run.  A graph of kernels, memsets and device
  copies queues nothing (the driver copied their parameters at instantiation).
* **Launching** on any stream of the graph's context, or on a default stream
  (then in the executable graph's context): :meth:`GraphExec.launch` checks,
  once per resource epoch, what the graph holds, and each buffer on every
  launch (memory ends without moving the epoch).  :meth:`GraphExec.replay`
  prepares the launch on one stream for a hot loop: the checked C call after
  one comparison of the epoch (see its docstring for what it does not check).
"""
from __future__ import annotations

import weakref

from . import _fork
from .allocation import EXPORTS
from ._ffi import ffi
from ._immortal import keep_forever
from ._resource import EPOCH, Resource, report
from ._support import arity, handle_int, invalid
from .errors import ClosedResourceError, CudaError, result_code
from .graph_errors import NOT_SUPPORTED, GraphInstantiateError, GraphUpdateError, flag_value, with_details
from .graph_nodes import PENDING_FREE, KernelNode, NodeRecord, PendingFree, kernel_parts, kernel_struct, runtime_objects
from .graph_structure import GraphStructure
from .stream import Stream, stream_handle

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import Any

    from .context import Context

_UPDATE_FAILURE = result_code("CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE")
INSTANTIATE_FLAGS = ffi.typeof("CUgraphInstantiate_flags").relements
_INSTANTIATE_RESULTS = ffi.typeof("CUgraphInstantiateResult").elements
_UPDATE_RESULTS = ffi.typeof("CUgraphExecUpdateResult").elements
_LOG_SIZE = 4096                # cuGraphInstantiate's (11.x ABI) log buffer


def instantiate_flags(flags: int | Iterable[str]) -> int:
    """``CUgraphInstantiate_flags`` as an int (names with or without ``CUDA_GRAPH_INSTANTIATE_FLAG_``)."""
    return flag_value(flags, INSTANTIATE_FLAGS, "CUDA_GRAPH_INSTANTIATE_FLAG_", "cuGraphInstantiate")


def one_executable_graph_note(graph: GraphStructure, rc: int, plausible: bool = True) -> str:
    """Why the driver likely answered CUDA_ERROR_NOT_SUPPORTED to an instantiation of ``graph``, or to an update
    with it, where the graph has memory alloc or free nodes (cuda.h: such a graph has at most one executable
    graph at a time; driver 580 counts one updated with the graph as its executable graph too); "" otherwise,
    or where the caller knows of another cause (``plausible`` False: a device launch, a result the driver
    gave).  The driver is the one that knows which executable graph that is (cuproc does not refuse first:
    dropped ones live until collected, and the driver's bookkeeping decides)."""
    if rc != NOT_SUPPORTED or not plausible:
        return ""
    try:
        memory = graph.has_memory_nodes()
    except CudaError:
        return ""
    return ("likely: the graph has memory alloc or free nodes, and such a graph has one executable graph at a time "
            "(the one instantiated from it, or updated with it): destroy that one first (exe.destroy()), or update "
            "it instead") if memory else ""


def instantiate(graph: GraphStructure, flags: int | Iterable[str] = 0, upload: Any = None) -> GraphExec:
    """The executable graph of ``graph`` (:meth:`cuproc.graph.Graph.instantiate`; see the module docstring)."""
    ctx = graph._ready("cuGraphInstantiate")
    graph._check_held("cuGraphInstantiate")
    drv = graph.driver
    value = instantiate_flags(flags)
    out = ffi.new("CUgraphExec *")
    log = ""
    result = None
    if drv.has("cuGraphInstantiateWithParams", newer_driver_features=False):
        call = "cuGraphInstantiateWithParams"
        p = ffi.new("CUDA_GRAPH_INSTANTIATE_PARAMS *")
        p.flags = value
        if upload is not None:
            p.flags |= INSTANTIATE_FLAGS["CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD"]
            p.hUploadStream = stream_handle(upload, drv, call)
        rc = ctx.call_current(drv.cuGraphInstantiateWithParams, out, graph.handle, p)
        error_node, result = p.hErrNode_out, _INSTANTIATE_RESULTS.get(p.result_out, str(p.result_out))
    elif value == 0 and upload is None:
        call = "cuGraphInstantiate"      # the 11.x ABI: error node and log buffer
        err = ffi.new("CUgraphNode *")
        buf = ffi.new("char[]", _LOG_SIZE)
        rc = ctx.call_current(drv.cuGraphInstantiate, out, graph.handle, err, buf, _LOG_SIZE)
        error_node, log = err[0], ffi.string(buf).decode(errors="replace")
    else:
        call = "cuGraphInstantiateWithFlags"
        if upload is not None:
            raise invalid(call, f"upload= needs cuGraphInstantiateWithParams, which CUDA {drv.version} (the "
                                "requested version) does not have: call exe.upload(stream) afterwards")
        rc = ctx.call_current(drv.cuGraphInstantiateWithFlags, out, graph.handle, value)
        error_node = ffi.NULL
    if rc:
        # the one-executable-graph rule is the likely cause of an 801 unless the driver gave a result of its own
        # or the graph was made for device launch (other causes of the same code)
        plausible = result in (None, "CUDA_GRAPH_INSTANTIATE_SUCCESS", "CUDA_GRAPH_INSTANTIATE_ERROR") \
            and not value & INSTANTIATE_FLAGS["CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH"]
        node = graph.find_node(error_node) if error_node != ffi.NULL else None
        details = [f"the driver's result: {result}" if result else "",
                   f"at {node.describe()}" if node is not None else "",
                   f"at node {handle_int(error_node):#x} (not found in the graph)"
                   if node is None and error_node != ffi.NULL else "",
                   f"log: {log}" if log else "", one_executable_graph_note(graph, rc, plausible)]
        raise with_details(GraphInstantiateError, drv.error(rc, call), ", ".join(filter(None, details)),
                           result=result, node=node, log=log)
    return GraphExec._made(graph, out[0], ctx, value)


# ----------------------------------------------------------------------------- what a launch holds until it ran
# token -> what one launch keeps alive; the host function queued after the launch pops it.
_in_flight: dict[int, tuple] = {}
_in_flight_lock = _fork.lock()
_GRAPH_MEMORY = _fork.rlock()     # launches of executable graphs that allocate or free graph memory (launch)
_next_flight = [0]
_flight_trampoline: list[Any] = []


def _launch_ran(user_data: Any, _records: dict = _in_flight, _int: Any = handle_int) -> None:
    """The host function queued after a launch (on a driver thread): the launch has run, let go of what it
    kept.  Never raises; reads no module globals (the driver may call it during the interpreter's teardown)."""
    try:
        _records.pop(_int(user_data), None)
    except BaseException:  # noqa: BLE001 - nothing may leave a C callback
        pass


def _launch_ran_trampoline() -> Any:
    """The one cffi callback around :func:`_launch_ran`, made on first use and never freed."""
    with _in_flight_lock:
        if not _flight_trampoline:
            callback = ffi.callback("void(void *)", _launch_ran)
            keep_forever(callback)
            _flight_trampoline.append(callback)
        return _flight_trampoline[0]


def hold_until_run(context: Context, stream: Any, kept: tuple) -> None:
    """Keep ``kept`` alive until the work queued on ``stream`` so far has run: a host function queued now
    lets it go.  When the driver refuses that host function, ``kept`` is kept for the process (a leak, never a
    callable freed under a running graph) and a warning says so."""
    trampoline = _launch_ran_trampoline()
    with _in_flight_lock:
        _next_flight[0] += 1
        token = _next_flight[0]
        _in_flight[token] = kept
    drv = context.driver
    rc = context.call_on(stream, drv.cuLaunchHostFunc, stream, trampoline, ffi.cast("void *", token))
    if rc:
        report(f"a graph launch's host nodes are kept for the process: queuing their release after the launch "
               f"failed ({drv.error(rc, 'cuLaunchHostFunc')})")


def in_flight_count() -> int:
    """How many launches still hold what they need (for tests)."""
    return len(_in_flight)


class GraphExec(Resource):
    """An executable graph (a CUgraphExec), made by :meth:`~cuproc.graph.Graph.instantiate` in the graph's
    context.

    ``launch(stream)`` and ``upload(stream)`` on any stream; ``update(graph)`` takes another graph of the
    same shape (cuGraphExecUpdate, :class:`GraphUpdateError` when it cannot); ``set_kernel_args(node, ...)``
    changes one kernel node here only; ``replay(stream)`` prepares the launch for a hot loop.  It keeps a
    copy of what its graph's nodes referred to (see the module docstring)."""

    _release_call = "cuGraphExecDestroy"
    _ended_word = "destroyed"

    context: Context
    handle: Any
    _source: weakref.ref[GraphStructure]
    _kernels: dict[tuple[int, ...], tuple]
    _places: dict[int, tuple[weakref.ref[NodeRecord], tuple[int, ...]]]
    _held: tuple[Resource, ...]
    _leaves: tuple[Resource, ...]
    _flight: tuple
    _graph_launch: Callable[..., int]
    _origin: dict[tuple[int, ...], weakref.ref[NodeRecord]]
    _allocations: tuple[tuple[int, weakref.ref[Any]], ...]
    _frees: tuple[PendingFree, ...]
    _tracks_memory: bool
    _fast_at: int                   # the epoch launch()'s fast path compares (-1: take every check)
    _auto_free: bool
    _lock: Any

    def __init__(self) -> None:
        raise TypeError("an executable graph is made by Graph.instantiate()")

    @classmethod
    def _made(cls, graph: GraphStructure, handle: Any, context: Context, flags: int = 0) -> GraphExec:
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
        #: the records of that graph by place: the node handles the driver takes (cuGraphExec*SetParams
        #: names a node by the graph the executable graph was instantiated from, also after an update)
        exe._origin = {path: weakref.ref(record) for path, record in order}
        exe._allocations = graph._allocations
        exe._hold_frees(graph.pending_frees)   # graph allocations its free nodes free (captured there)
        exe._auto_free = bool(flags & INSTANTIATE_FLAGS["CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH"])
        #: held by launch, upload, update and set_kernel_args: a launch sees the executable graph and what it
        #: keeps either before or after an update from another thread, never half of each
        exe._lock = _fork.rlock()   # re-entrant: packing runs user code (__index__, __dlpack__) under it
        exe._take(order)
        exe.ended = None
        return exe

    def _take(self, order: list[tuple[tuple[int, ...], NodeRecord]]) -> None:
        """Keep what a graph's nodes refer to (instantiation, update).  ``order`` is its node records by
        their place in the executable graph (a path: the node's index in cuGraphGetNodes' order, then a
        body's index and the node's in that body): what the executable graph knows of a node is filed by
        place, never by a node handle, which the driver hands out again."""
        self._keep_by_node: dict[tuple[int, ...], tuple] = {}
        self._held_by_node: dict[tuple[int, ...], tuple[Resource, ...]] = {}
        self._flight_by_node: dict[tuple[int, ...], tuple] = {}
        self._kernels = {}
        for path, record in order:
            self._keep_by_node[path] = (*record.keep, *record.bodies)
            self._held_by_node[path] = tuple(record.held)
            self._flight_by_node[path] = runtime_objects(record)
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
        flight = tuple(k for kept in self._flight_by_node.values() for k in kept)
        self._flight = (flight, self._held) if flight else ()
        self._checked_at = self._fast_at = -1          # (no epoch): the next launch checks them all

    # ---------------------------------------------------------------- resource
    def parents(self) -> tuple[Resource, ...]:
        return (self.context,)

    def describe(self) -> str:
        return f"executable graph {handle_int(self.handle):#x}"

    def _release(self) -> int:
        return self.context.call(self.driver.cuGraphExecDestroy, self.handle)

    def close(self) -> None:
        """cuGraphExecDestroy (idempotent).  The pending frees it held are let go whatever the driver answered
        (no launch of it will make them): each is undone once no graph or other executable graph holds it
        either (:class:`~cuproc.graph_nodes.PendingFree`), not when this object is collected."""
        with self._lock:
            try:
                super().close()
            finally:
                self._hold_frees(())

    destroy = close

    def _hold_frees(self, frees: tuple[PendingFree, ...]) -> None:
        """Hold ``frees``, the pending frees of the graph whose nodes this executable graph has now (the one it
        was instantiated from, or its last update's): its launches commit them.  Those held before are let go
        (undone once nothing else holds them).  Whether launches track memory is decided here, once, so that
        :meth:`launch`'s fast path tests one flag."""
        self._frees = frees
        self._tracks_memory = bool(self._allocations or frees)
        self._fast_at = -1

    @property
    def graph(self) -> GraphStructure | None:
        """The graph this was instantiated from, while it lives."""
        return self._source()

    def _verify(self, call: str) -> None:
        """Check this executable graph and everything its nodes refer to, for ``call``.  The epoch it is
        left checked at (what lets :meth:`launch` skip the checks) is set only when all of them passed;
        ``_fast_at``, the epoch :meth:`launch`'s fast path compares, only where launches track no graph memory
        (those take every check, every time)."""
        epoch = EPOCH[0]           # taken first: whatever ends during the walk moves it, and the next launch checks
        self._checked_at = self._fast_at = -1
        self.check(call)
        for resource in self._held:
            gone = resource.ended_owner()
            if gone is not None:
                self._checked_at = -1
                raise ClosedResourceError(call, self.describe(), gone.describe(), gone.ended or "closed")
        if self._checked_at == epoch and not self._tracks_memory:
            self._fast_at = epoch

    # ---------------------------------------------------------------- launch
    def launch(self, stream: Any = None) -> None:
        """cuGraphLaunch on ``stream`` (a Stream, another library's stream, a raw handle; None: the default
        stream, in this graph's context).  Asynchronous: host nodes and host memory the graph uses are kept
        until the launch has run (see the module docstring).

        On a cuproc Stream, with nothing ended since both were last checked (the resource epoch) and every
        buffer the graph refers to alive, it is the driver call alone (benchmarks/bench_graphs.py); anything
        else takes the full checks first.

        Threads: a launch waits for an :meth:`update` or :meth:`set_kernel_args` another thread is making
        (one lock per executable graph), so it launches the graph as it was before or after that change.
        The driver orders launches of one executable graph itself.  The lock is taken by a ``with`` statement,
        not ``acquire()`` and ``try``: an interrupt (KeyboardInterrupt) arriving between those two would leave it
        held for good, which ``with`` rules out; it costs about 100-150 ns more per launch on the GPU machine.

        A captured graph's allocations (:class:`~cuproc.graph_nodes.GraphAllocation`) are allocated by
        each launch: the launch is refused while one from the last launch is not freed (the driver would
        refuse it) unless the graph was instantiated with ``AUTO_FREE_ON_LAUNCH``; one whose buffer was
        dropped is freed right after each launch, on its stream."""
        with self._lock:
            epoch = EPOCH[0]
            # _fast_at: this executable graph and all it holds were checked at this epoch, and its launches
            # track no graph memory; a Stream's _checked_at: it was checked at this epoch (-1 from creation)
            if self._fast_at == epoch and stream.__class__ is Stream and stream._checked_at == epoch \
                    and stream.ended is None:
                for leaf in self._leaves:                # buffers end without moving the epoch
                    if leaf.ended is not None:
                        break
                else:
                    h = stream.handle        # a Stream's own stream: the driver routes the call by it
                    rc = self._graph_launch(self.handle, h)
                    if rc:
                        self._launch_failed(rc, h)
                    if self._flight:
                        hold_until_run(self.context, h, self._flight)
                    return
            if self._tracks_memory:
                # The graph allocations and pending frees it checks are shared with other executable graphs
                # (of the same captured graph, or the one that frees what this one allocates): check, launch and
                # commit as one step, or two threads could both find memory allocated and free it twice.
                with _GRAPH_MEMORY:
                    self._launch_checked(stream)
            else:
                self._launch_checked(stream)

    def _launch_checked(self, stream: Any) -> None:
        """launch() with every check: liveness, the stream, graph memory; the driver call; what it commits."""
        self._verify("cuGraphLaunch")
        h = stream_handle(stream, self.driver, "cuGraphLaunch")
        self._allocations_freed()
        for pending in self._frees:
            pending.check_allocated("cuGraphLaunch", self.describe())
        rc = self.context.call_on(h, self._graph_launch, self.handle, h)
        if rc:
            raise self.driver.error(rc, "cuGraphLaunch")
        for pending in self._frees:
            pending.launched()
        if self._allocations:
            self._allocated(stream if isinstance(stream, Stream) else h, h)
        if self._flight:
            hold_until_run(self.context, h, self._flight)

    def _allocations_freed(self) -> None:
        """Refuse a launch while memory the last launch allocated is not freed (cuGraphLaunch answers
        CUDA_ERROR_INVALID_VALUE then), unless each launch frees it (AUTO_FREE_ON_LAUNCH)."""
        if self._auto_free:
            for _address, ref in self._allocations:   # each launch frees it: never under a consumer's export
                buf = ref()
                if buf is not None and buf.ended is None and id(buf) in EXPORTS and buf.has_views():
                    raise BufferError(f"cuGraphLaunch was not called: {buf.describe()}, which this launch of "
                                      f"{self.describe()} would free (AUTO_FREE_ON_LAUNCH), still has views (a DLPack "
                                      "export); drop them first")
            return
        for _address, ref in self._allocations:
            buf = ref()
            if buf is not None and buf.ended is None:
                raise invalid("cuGraphLaunch", f"{buf.describe()}, which the last launch of {self.describe()} "
                                               "allocated, is not freed: the driver launches the graph again only "
                                               "once it is (buf.free_async(stream) after its last use), or "
                                               "instantiate with flags='AUTO_FREE_ON_LAUNCH'")
            if buf is not None and buf.ended == PENDING_FREE:
                raise invalid("cuGraphLaunch", f"{buf.describe()}, which the last launch of {self.describe()} "
                                               "allocated, is freed by a node of a captured graph not launched "
                                               "yet: launch that graph first (the memory exists until it runs)")

    def _allocated(self, stream: Any, h: Any) -> None:
        """After a launch on ``stream`` (``h``, its CUstream): the graph's allocations exist; those whose buffer
        was dropped have no one to free them and are freed now, after the launch on its stream."""
        drv = self.driver
        for address, ref in self._allocations:
            buf = ref()
            if buf is not None and buf.ended != "dropped":
                buf.launched(stream)
                continue
            rc = self.context.call_on(h, drv.cuMemFreeAsync, address, h)
            if rc:
                report(f"freeing the graph allocation at {address:#x} (its buffer was dropped) after a launch of "
                       f"{self.describe()} failed: {drv.error(rc, 'cuMemFreeAsync')}")

    def _launch_failed(self, rc: int, stream: Any) -> None:
        """The first attempt on a Stream answered ``rc``: the context's rebind (Context.call), else the error."""
        rc = self.context.rebind(rc, self._graph_launch, self.handle, stream)
        if rc:
            raise self.driver.error(rc, "cuGraphLaunch")

    def replay(self, stream: Stream) -> Callable[[], None]:
        """A callable that launches this executable graph on ``stream`` (the raw ``drv.cuGraphLaunch`` on the
        two handles, its result tested as :meth:`launch` tests it), for a hot loop: everything is checked here,
        and each call compares two numbers with the epoch it last checked at (below) before the driver call.
        A fork moves the
        epoch too (a child's call then raises ForkedProcessError from the checks), which is why the raw call
        needs no fork test of its own: ``drv.checked.cuGraphLaunch``, which has one, cost about 125 ns more
        per call (benchmarks/overhead_fake.py), the whole difference from the Python floor.

        The callable holds this executable graph and ``stream`` (its ``graph_exec`` and ``stream``
        attributes): dropping them does not end them.  Once either of them, or their context, ended (or the
        process forked) a call raises :class:`~cuproc.errors.ClosedResourceError` naming what ended (or
        ForkedProcessError) before any handle reaches the driver: the driver hands those handles out again.
        It does not see a buffer the graph refers to freed later (memory ends without moving the epoch): use
        :meth:`launch` where buffers may end.  A graph with host nodes or host memory is refused here: each of
        its launches must keep them until it ran (use :meth:`launch`).

        Its call compares the resource epoch with the one it last checked at, and with the executable graph's
        fast-path epoch (what :meth:`launch` compares), which an :meth:`update` or :meth:`set_kernel_args`
        resets: after one, the next call checks again, under the executable graph's lock, and refuses once the
        graph tracks graph memory (an update may bring a captured free).  The driver call itself does not take
        the lock (:meth:`launch` does): a replay racing an update or an argument change from another thread is
        the caller's to order, as for the driver's own executable graphs.

        It is a closure, not an instance of a class: calling an instance runs its ``__call__`` through the
        interpreter's slower slot (about 160 ns more per call than a function, CPython 3.11), which is the
        whole cost this exists to save."""
        call = "cuGraphLaunch"
        if not isinstance(stream, Stream):
            raise invalid(call, f"replay takes a cuproc Stream (its context's), not {type(stream).__name__}")
        self._verify(call)
        stream.check(call)
        if stream.context is not self.context:
            raise invalid(call, f"{stream.describe()} is not in {self.context.describe()}: replay on a stream of "
                                "the executable graph's context (launch() routes any other)")
        if self._flight:
            raise invalid(call, f"{self.describe()} has host nodes or host memory, which each launch keeps until it "
                                "ran: replay it with launch()")
        if self._tracks_memory:
            raise invalid(call, f"{self.describe()} allocates or frees graph memory (alloc_async, free_async in a "
                                "capture), which launches track: replay it with launch()")
        exe, launch, h, s = self, self._graph_launch, self.handle, stream.handle
        seen = EPOCH[0]          # the epoch at which this replay last found exe and its stream alive

        def replay(_epoch: list[int] = EPOCH) -> None:
            nonlocal seen
            # something ended somewhere (or fork), or exe changed (update, set_kernel_args: its _fast_at reset);
            # seen is this replay's own: another caller's check of exe (launch on another stream) is not of s
            if _epoch[0] != seen or exe._fast_at != seen:
                epoch = _epoch[0]
                exe._replay_checks(call, stream)
                seen = epoch
            rc = launch(h, s)
            if rc:
                exe._launch_failed(rc, s)

        replay.graph_exec = exe                  # type: ignore[attr-defined]
        replay.stream = stream                   # type: ignore[attr-defined]
        return replay

    def _replay_checks(self, call: str, stream: Stream) -> None:
        """A replay's checks, once something ended (or the process forked) or this executable graph changed:
        under the lock, this executable graph, all it holds and ``stream``; then refuse what a replay cannot
        launch (an update may have brought host nodes, host memory or graph memory)."""
        with self._lock:
            self._verify(call)
            stream.check(call)
            if self._flight or self._tracks_memory:
                self._fast_at = -1     # so every later call of the replay checks, and refuses, again
                raise invalid(call, f"{self.describe()} has host nodes, host memory or graph memory now (an update "
                                    "brought them), which each launch must track: launch it with launch()")

    def upload(self, stream: Any = None) -> None:
        """cuGraphUpload: make the launch's resources ready on ``stream`` ahead of the first launch."""
        with self._lock:
            self._verify("cuGraphUpload")
            drv = self.driver
            h = stream_handle(stream, drv, "cuGraphUpload")
            drv.check(self.context.call_on(h, drv.cuGraphUpload, self.handle, h), "cuGraphUpload")

    # ---------------------------------------------------------------- changes
    def update(self, graph: GraphStructure) -> None:
        """cuGraphExecUpdate: take ``graph``'s node parameters (same topology and node order).  When the
        driver cannot, :class:`GraphUpdateError` says why and names the node (found wherever it is in
        ``graph``: a child graph, a conditional body), and nothing changed.  Afterwards the nodes of
        ``graph`` address this executable graph's nodes (the driver pairs them by place), as those of the
        graph it was instantiated from still do: :meth:`set_kernel_args` takes either.  A launch from
        another thread waits for the update (see :meth:`launch`).

        The free nodes come with the nodes: ``graph``'s pending frees (``free_async`` in its capture, see
        :class:`~cuproc.graph_nodes.PendingFree`) are committed by this executable graph's launches from now
        on, and those of the graph it took its nodes from before are let go."""
        call = "cuGraphExecUpdate"
        if not isinstance(graph, GraphStructure):
            raise invalid(call, f"update takes a cuproc Graph, not {type(graph).__name__}")
        with self._lock:
            self._verify(call)
            graph._ready(call)
            graph._check_held(call)
            self._apply_update(call, graph)
            order = graph._record_order(call)
            self._take(order)
            self._hold_frees(graph.pending_frees)   # its free nodes are this executable graph's now
            origin = {id(r()): (r, path) for path, r in self._origin.items() if r() is not None}
            self._places = {**origin, **{id(record): (weakref.ref(record), path) for path, record in order}}

    def _apply_update(self, call: str, graph: GraphStructure) -> None:
        """The driver call of :meth:`update` at the handle's ABI; its refusal as GraphUpdateError."""
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
            failed = rc == _UPDATE_FAILURE
            error_node = graph.find_node(node) if failed and node != ffi.NULL else None
            from_node = graph.find_node(other) if failed and other != ffi.NULL else None
            details = "; ".join(filter(None, [
                f"the driver's reason: {reason}" + (f" at {error_node.describe()}" if error_node else ""),
                one_executable_graph_note(graph, rc, result == 0)]))
            raise with_details(GraphUpdateError, drv.error(rc, call), details, reason=reason, node=error_node,
                               from_node=from_node)

    def set_kernel_args(self, node: KernelNode, args: Sequence[Any] | None = None, *, grid: Any = None,
                        block: Any = None, shared_mem: int | None = None,
                        signature: Sequence[Any] | None = None) -> None:
        """cuGraphExecKernelNodeSetParams: new arguments (packed as a launch packs them, by the node's own
        types unless ``signature`` is given), grid, block or shared memory of a kernel node -- of the graph
        this was instantiated from, or of the graph of its last :meth:`update` -- for the next launches of
        this executable graph only.  The driver names the node by the graph it was instantiated from, which
        must still be alive (and the node in it)."""
        call = "cuGraphExecKernelNodeSetParams"
        if not isinstance(node, KernelNode):
            raise invalid(call, f"set_kernel_args takes a KernelNode, not {type(node).__name__}")
        with self._lock:
            self._verify(call)
            node.check(call)
            key = self._place_of(node, call)
            base = self._kernels.get(key)
            if base is None:
                raise invalid(call, f"{node.describe()} was not made by cuproc (a captured node): its argument "
                                    "types are not known here")
            function, packed, values, dims, shared = base
            reuse = args is None and signature is None
            parts = kernel_parts(node.graph, function, call, values if args is None else args,
                                 packed.types if signature is None else signature,
                                 dims[:3] if grid is None else grid, dims[3:] if block is None else block,
                                 shared if shared_mem is None else shared_mem, packed if reuse else None)
            p = kernel_struct(self.driver, call, 2, parts)
            self.driver.check(self.context.call_current(self.driver.cuGraphExecKernelNodeSetParams, self.handle,
                                                        self._driver_node(node, key, call), p), call)
            self._kernels[key] = parts[:5]
            self._keep_by_node[key] = (parts[1], *parts[6])
            self._held_by_node[key] = tuple(dict.fromkeys(parts[5]))
            self._refresh()

    def _place_of(self, node: KernelNode, call: str) -> tuple[int, ...]:
        """The place in this executable graph of ``node`` (of the graph it was instantiated from, or of its
        last update's); refused for any other node."""
        place = self._places.get(id(node.record))
        if place is None or place[0]() is not node.record:
            if node.record.kernel is None:
                raise invalid(call, f"{node.describe()} was not made by cuproc (a captured node): its argument "
                                    "types are not known here")
            raise invalid(call, f"{node.describe()} is not a node of the graph this executable graph was "
                                "instantiated from, nor of the graph of its last update (as they were then): a "
                                "node added later has no counterpart here")
        return place[1]

    def _driver_node(self, node: KernelNode, key: tuple[int, ...], call: str) -> Any:
        """The node handle the driver takes for place ``key``: that of the graph this was instantiated from
        (``node``'s own when it is one of that graph's), checked to be still that graph's node."""
        origin = self._origin.get(key)
        record = origin() if origin is not None else None
        if record is node.record:
            return node.handle
        source = self._source()
        if record is None or source is None or source.ended is not None or not source.holds(record):
            raise invalid(call, f"{node.describe()} is at the place of a node of the graph {self.describe()} was "
                                "instantiated from, which is gone (destroyed, or the node removed): the driver names "
                                "a node of an executable graph by that graph's; keep it alive to set arguments "
                                "here, or instantiate again")
        return ffi.cast("CUgraphNode", record.handle)

    def __repr__(self) -> str:
        state = f" {self.ended}" if self.ended else ""
        return f"<cuproc.GraphExec {handle_int(self.handle):#x}{state}>"


__all__ = ["GraphExec", "hold_until_run", "in_flight_count", "instantiate", "instantiate_flags"]
