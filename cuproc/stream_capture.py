"""Stream capture: ``with cuproc.capture(stream) as graph:`` records what is enqueued on a stream into a Graph.

Policy
------
* **What is captured** is whatever the driver captures: prepared and one-shot
  launches, asynchronous copies and memsets, stream-ordered allocations and
  frees, event records and waits (another stream that waits for an event
  recorded in the capture joins it, and must be joined back), host functions.
  The graph yielded by the ``with`` statement becomes usable when the block
  ends (:meth:`~cuproc.graph.Graph.instantiate`, ``nodes``, ``to_dot``...).
  Host functions launched on the stream during the capture are taken over by
  the graph (cuproc.stream runs such a function once; a graph runs it at every
  launch).
* **Modes** (``mode=``): ``"global"`` (the driver's default), ``"thread_local"``
  or ``"relaxed"`` -- which "potentially unsafe" calls (a synchronous
  allocation, copy or synchronize) other code may make while the capture runs.
  The ABI is the requested version's: ``cuStreamBeginCapture`` with a mode
  (10.1+), or without one (only ``"global"`` then).
* **Refusals.**  The legacy default stream cannot be captured: cuproc refuses
  before the driver is called (capture a :class:`~cuproc.stream.Stream`, or
  the per-thread default stream).  A call the driver refuses during the capture
  (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and its kin) raises as usual, naming
  the call, with a note saying that a capture was running and why such a call
  is not allowed.
* **A failed block.**  An exception inside the block -- or a capture the driver
  invalidated (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, from an earlier refused
  call whose exception was caught) -- ends the capture (``cuStreamEndCapture``
  is always called, so the stream is usable again), discards the graph (the
  yielded Graph ends as "discarded"; the driver's partial graph is destroyed)
  and raises: the block's own exception, or the invalidation's.  Nothing is
  left for a finalizer to tear down: host functions launched on the stream or
  on streams that joined the capture are forgotten, and buffers that
  ``alloc_async`` made there end as "discarded" (their addresses were a
  graph's that never existed; nothing is freed).
* **The thread.**  Outside mode ``"relaxed"`` the driver lets only the thread
  that began a capture end it: leaving the block on another thread is refused
  (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, before the driver is called) and
  the capture runs on, until its own thread leaves the block.  When the block
  raised, its exception stays the one raised: the refusal is added to it as a
  note and reported as a :class:`~cuproc.errors.CudaWarning`.
* **Graph allocations.**  A buffer ``alloc_async`` made during a capture that
  ends well and that the capture did not free (``free_async`` in the block
  makes a free node, the common case) becomes a
  :class:`~cuproc.graph_nodes.GraphAllocation`: its memory exists from a
  launch of the graph until it is freed (see there).  Pool memory allocated
  before the capture cannot be freed in it (the driver frees only graph
  allocations during a capture): the refusal leaves that buffer usable.
* **Finalizers.**  A cuproc object dropped while a capture prohibits the
  thread's "potentially unsafe" calls (mode ``"global"``: every thread; mode
  ``"thread_local"``: its own) would release its handle with such a call
  (cuMemFree, cuModuleUnload, cuGraphExecDestroy), which the driver refuses,
  invalidating the capture.  cuproc keeps it instead and releases it when the
  last such capture ended.  An explicit ``close()`` that would be such a call
  (a graph allocation's cuMemFree) is refused there, before the driver, and
  leaves the object usable: close it after the capture.
* **Queries**: :func:`capture_status` (cuStreamIsCapturing) and
  :func:`capture_info` (cuStreamGetCaptureInfo at the handle's ABI: the status,
  the capture's id, and from 11.3 the graph being captured and the nodes the
  next captured work will depend on); ``graph.capture_info`` inside the block.
  For a capture cuproc runs, the graph is the one the ``with`` statement
  yields (its nodes are that graph's own); for another's, a view valid only
  while that capture runs.  A raw stream handle is its own context's
  (cuStreamGetCtx), as everywhere in cuproc.
"""
from __future__ import annotations

import _thread

from . import _fork, _resource
from ._ffi import ffi
from ._namedtuple import NamedTuple
from ._resource import Resource, report
from ._support import arity, get_driver, handle_int, invalid
from .context import Context, is_default_stream
from .driver import Driver
from .errors import CudaError, refusal, result_code
from .graph import Graph
from .graph_errors import add_note
from .graph_nodes import CAPTURE_ON, PROHIBITING, adopt_graph_allocation
from .stream import (
    CU_STREAM_PER_THREAD,
    Stream,
    as_stream,
    default_stream,
    foreign_context,
    host_function_mark,
    host_function_streams,
    stream_capturing,
    take_host_functions,
)

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import Any

    from .device_memory import DeviceBuffer
    from .graph_nodes import GraphNode, PendingFree

MODES = {"global": 0, "thread_local": 1, "relaxed": 2}          # CUstreamCaptureMode
_STATUS = {0: "none", 1: "active", 2: "invalidated"}             # CUstreamCaptureStatus
_INVALIDATED = result_code("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
_CAPTURE_ERRORS = frozenset(result_code(n) for n in (
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
    "CUDA_ERROR_STREAM_CAPTURE_MERGE", "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
    "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "CUDA_ERROR_CAPTURED_EVENT",
    "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"))


class CaptureInfo(NamedTuple):
    """A stream's capture state (cuStreamGetCaptureInfo): ``status`` "none", "active" or "invalidated";
    ``id`` the capture's id; ``graph`` the graph being captured (a view: it is the capture's) and
    ``dependencies`` the nodes the next captured work will depend on (None for both where the
    requested version's ABI does not report them)."""

    status: str
    id: int
    graph: Graph | None
    dependencies: tuple[GraphNode, ...] | None


def _target(stream: Any, context: Context | None, driver: Driver | None,
            call: str) -> tuple[Stream | None, Any, Context]:
    """(the Stream if there is one, the CUstream, the context) of a stream argument: a Stream, another
    library's stream, a raw handle or int (its own context's, cuStreamGetCtx), None for the handle's
    default stream (in ``context`` or the current one)."""
    if stream is not None and not isinstance(stream, (Stream, int, ffi.CData)):
        stream = as_stream(stream, call, context=context, driver=driver)
    if isinstance(stream, Stream):
        stream.check(call)
        return stream, stream.handle, stream.context
    if context is not None:
        context = Context.given(context, call)
    if stream is not None and context is None and not is_default_stream(ffi.cast("CUstream", stream)):
        drv = get_driver(driver)
        return None, ffi.cast("CUstream", stream), foreign_context(handle_int(ffi.cast("CUstream", stream)), None, drv)
    ctx, _run = Context.target(context, call, driver=driver)
    h = default_stream(ctx.driver) if stream is None else ffi.cast("CUstream", stream)
    return None, h, ctx


def _mode(mode: str | int, call: str) -> int:
    if isinstance(mode, int) and not isinstance(mode, bool) and mode in MODES.values():
        return mode
    if isinstance(mode, str) and mode.lower().removeprefix("cu_stream_capture_mode_") in MODES:
        return MODES[mode.lower().removeprefix("cu_stream_capture_mode_")]
    raise invalid(call, f"mode is one of {', '.join(MODES)} (or its CUstreamCaptureMode value), not {mode!r}")


def _key(driver: Driver, context: Context, handle: Any, thread: int) -> tuple[int, int, int, int]:
    """What names one running capture's stream: the handle (the per-thread default stream's with its
    context and thread: each thread has its own)."""
    h = handle_int(handle)
    if h == handle_int(CU_STREAM_PER_THREAD):
        return (id(driver), h, handle_int(context.handle), thread)
    return (id(driver), h, 0, 0)


# ----------------------------------------------------------------------------- finalizers during a capture
# A capture in mode "global" prohibits "potentially unsafe" calls in every thread, one in "thread_local"
# mode in its own thread; a finalizer's release (cuMemFree, cuModuleUnload, cuGraphExecDestroy...) is such
# a call, which the driver refuses -- invalidating the capture.  While cuproc runs such a capture, a
# resource dropped where the calls are prohibited is kept here, and released once the last such capture
# ended (by the thread that ended it, after cuStreamEndCapture).
_running: dict[tuple[int, int, int, int], StreamCapture] = {}    # by _key: cuproc's captures running now
_state = _fork.per_thread()         # .prohibiting: this thread's running captures not in mode "relaxed"
_global = [0]                       # running captures in mode "global" (any thread)
_total = [0]                        # running captures not in mode "relaxed" (any thread)
_deferred: list[Resource] = []
#: Re-entrant: code holding it allocates, so a collection can run a finalizer there whose drop is put off
#: (_defer_drop takes it again); a plain lock deadlocked the thread on itself.
_lock = _fork.rlock()


def _forget_after_fork() -> None:
    """In a forked child: no capture runs (the parent's are the parent's, and the child cannot use CUDA), so
    nothing prohibits a release and no finalizer is put off; a parent's capture left in a with block ends
    there without counting (see StreamCapture._finish)."""
    global _state
    _running.clear()
    _state = _fork.per_thread()
    _global[0] = _total[0] = 0
    _deferred.clear()           # the parent's handles: their finalizers release nothing in the child
    _resource.DEFER_DROP[0] = None


_fork.on_fork_in_child(_forget_after_fork)


def _prohibited() -> bool:
    """Does a running cuproc capture prohibit this thread's unsafe calls?"""
    return bool(_global[0] or getattr(_state, "prohibiting", 0))


def _defer_drop(resource: Resource) -> bool:
    """cuproc._resource's DEFER_DROP hook: keep ``resource`` for later when its release is prohibited now."""
    if not _prohibited() or not resource._drop_releases_a_handle():
        return False
    with _lock:
        _deferred.append(resource)
    return True


def _began(mode: int) -> None:
    """A capture in ``mode`` began on this thread.  The first that prohibits releases sets cuproc._resource's
    DEFER_DROP hook: while it is set, every finalizer asks it (the compiled DeviceBuffer finalizer too, which
    leaves such a drop to Resource.__del__); with no such capture running it is None, and drops cost nothing
    more."""
    if mode == MODES["relaxed"]:
        return
    with _lock:
        _state.prohibiting = getattr(_state, "prohibiting", 0) + 1
        _global[0] += mode == MODES["global"]
        _total[0] += 1
        _resource.DEFER_DROP[0] = _defer_drop


def _ended(mode: int) -> None:
    """A capture in ``mode`` begun on this thread ended: release what was kept, once nothing prohibits it.  The
    last capture that prohibited releases clears the DEFER_DROP hook."""
    global _deferred
    fresh: list[Resource] = []
    with _lock:
        if mode != MODES["relaxed"]:
            _state.prohibiting = max(getattr(_state, "prohibiting", 0) - 1, 0)
            _global[0] -= mode == MODES["global"]
            _total[0] -= 1
            if _total[0] == 0:
                _resource.DEFER_DROP[0] = None
        kept: list[Resource] = []
        if not _prohibited():
            # a swap, no allocation: a finalizer run by a collection here appends to the list it then finds
            kept, _deferred = _deferred, fresh
    for resource in kept:
        if resource.ended is None:
            resource._end_drop(resource._drop)
    del kept


class StreamCapture:
    """``with StreamCapture(stream, mode) as graph:`` -- what :meth:`Stream.capture` returns (see the
    module docstring).  Entered once."""

    def __init__(self, stream: Any = None, mode: str | int = "global", *, context: Context | None = None,
                 driver: Driver | None = None) -> None:
        call = "cuStreamBeginCapture"
        self.mode = _mode(mode, call)
        self.stream, self.handle, self.context = _target(stream, context, driver, call)
        self.driver = self.context.driver
        if is_default_stream(self.handle) and handle_int(self.handle) != handle_int(CU_STREAM_PER_THREAD):
            raise refusal(call, "the legacy default stream cannot be captured (the driver refuses it: other "
                                "streams synchronize with it): capture a cuproc.Stream(), or the per-thread default "
                                "stream (cuproc.stream.CU_STREAM_PER_THREAD, or a handle made with "
                                "per_thread_default_stream=True)", code_name="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        self.graph: Graph | None = None
        self._id = 0                   # the driver's capture id, asked for when first needed (see id)
        self.thread = 0
        self._key: tuple[int, int, int, int] | None = None
        self._frees: list[PendingFree] = []   # graph allocations freed by free nodes of this capture

    def describe(self) -> str:
        if self.stream is not None:
            return self.stream.describe()
        return "the per-thread default stream" if handle_int(self.handle) == 2 else f"stream {handle_int(self.handle):#x}"

    def __enter__(self) -> Graph:
        call = "cuStreamBeginCapture"
        if self.graph is not None:
            raise invalid(call, "a StreamCapture is entered once: make another (cuproc.capture(stream))")
        if self.stream is not None:
            self.stream.check(call)
        drv = self.driver
        args = (self.handle, self.mode) if arity(drv, call) == 2 else (self.handle,)
        if len(args) == 1 and self.mode != MODES["global"]:
            raise invalid(call, f"the requested version's cuStreamBeginCapture (CUDA {drv.version}) takes no mode: "
                                "only mode='global'")
        self._first_token = host_function_mark()       # host functions launched from here on
        self._first_buffers = set(self.context.stream_ordered)   # stream-ordered allocations made from here on
        drv.check(self.context.call_on(self.handle, drv.cuStreamBeginCapture, *args), call)
        self.thread = _thread.get_ident()
        self.graph = Graph._capturing(self.context, self)
        self._key = _key(drv, self.context, self.handle, self.thread)
        with _lock:
            _running[self._key] = self
        _began(self.mode)
        return self.graph

    @property
    def id(self) -> int:
        """The driver's id of this capture (cuStreamGetCaptureInfo), asked once, when something needs it (a
        joined stream to match, a capture_info query): most captures never do, and the capture's own cost
        is what issue 36's goal against cuda.core's GraphBuilder measures."""
        if not self._id and self.graph is not None and self.graph._capture is self:
            self._id = _capture_id(self.driver, self.context, self.handle)
        return self._id

    def _members(self) -> list[Stream]:
        """The cuproc Streams in this capture (asked before it ends): the captured one and those that joined
        it (forked by an event) on which a host function or a stream-ordered allocation was made."""
        found: dict[int, Stream] = {}
        if self.stream is not None:
            found[id(self.stream)] = self.stream
        candidates = host_function_streams(self._first_token)
        for key, (_address, stream) in list(self.context.stream_ordered.items()):
            if key not in self._first_buffers and isinstance(stream, Stream):
                candidates.append(stream)
        for stream in candidates:
            if id(stream) in found or stream.ended_owner() is not None:
                continue
            if not self.id:
                break
            try:
                if _capture_id(stream.driver, stream.context, stream.handle) == self.id:
                    found[id(stream)] = stream
            except CudaError:
                continue
        return list(found.values())

    def free_pending(self, pending: PendingFree) -> None:
        """A graph allocation was freed by a free node of this capture (GraphAllocation.free_async): the
        free is made by launches of its graph, once the capture ends well; undone if it fails."""
        self._frees.append(pending)

    def _fail(self, how: str, members: list[Stream] | None) -> None:
        """The capture failed: discard the graph, forget the host functions and end the stream-ordered
        buffers it made (their addresses were a graph's that never existed; no driver call); graph
        allocations it freed are allocated again (their free nodes went with the graph)."""
        assert self.graph is not None
        self.graph._discard(how)
        frees, self._frees = self._frees, []
        for pending in frees:
            pending.undo()
        streams = members if members is not None else ([self.stream] if self.stream is not None else [])
        take_host_functions(self._first_token, streams)
        for buffer in self._allocated_here(streams):
            buffer._claim("discarded (allocated during a stream capture that failed)")

    def _allocated_here(self, streams: list[Stream]) -> list[DeviceBuffer]:
        """The buffers alloc_async made during this capture on its streams and that it did not free, each
        taken out of its context's table of pool memory (the claim: their addresses are the graph's, never
        the pool's, so nothing may cuMemFreeAsync them as pool memory)."""
        handles = {handle_int(s.handle) for s in streams} | {handle_int(self.handle)}
        taken: list[DeviceBuffer] = []
        for key, (_address, stream) in list(self.context.stream_ordered.items()):
            if key in self._first_buffers or _handle_of(stream) not in handles:
                continue
            if self.context.untrack_stream_ordered(key) is not None:
                buffer = key()
                if buffer is not None:
                    taken.append(buffer)
        return taken

    def _finish(self) -> None:
        """The capture is over (whatever became of it): it no longer prohibits anything.  One this process's
        state does not list (begun before a fork, in the parent) counted nothing here."""
        key = self._key
        with _lock:
            listed = key is not None and _running.get(key) is self
            if key is not None and listed:
                del _running[key]
        if listed:
            _ended(self.mode)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        graph, drv = self.graph, self.driver
        assert graph is not None
        if graph.ended is not None or graph._capture is None:
            raise invalid("cuStreamEndCapture", "this capture has ended already")
        if self.mode != MODES["relaxed"] and _thread.get_ident() != self.thread:
            # The driver would answer CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD and go on capturing.
            err = refusal("cuStreamEndCapture", f"the capture on {self.describe()} (mode "
                                                f"{self._mode_name()!r}) was begun by another thread, which must "
                                                "end it (leave the with block there): it is still running",
                          code_name="CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD")
            if exc is None:
                raise err
            # The block's own exception stays the one raised; the thread problem goes with it and is reported.
            add_note(exc, f"leaving the capture failed too: {err}")
            report(f"a with block capturing {self.describe()} raised {type(exc).__name__} and was left on another "
                   f"thread than the one that began the capture: {err}")
            return
        try:
            self._exit(exc)
        finally:
            self._finish()

    def _mode_name(self) -> str:
        return next(name for name, value in MODES.items() if value == self.mode)

    def _exit(self, exc: BaseException | None) -> None:
        graph, drv = self.graph, self.driver
        assert graph is not None
        if self.stream is not None and self.stream.ended_owner() is not None:   # closed in the block
            self._fail("discarded (its stream ended during the capture)", None)
            if exc is None:
                self.stream.check("cuStreamEndCapture")
            return
        members = self._members()
        out = ffi.new("CUgraph *")
        try:
            rc = self.context.call_on(self.handle, drv.cuStreamEndCapture, self.handle, out)
        except BaseException as failure:   # (a push that failed: the block's own exception stands)
            self._fail("discarded (ending the capture failed)", members)
            if exc is None:
                raise
            add_note(exc, f"ending the capture on {self.describe()} failed too: {failure}")
            return
        if exc is None:
            if rc:
                self._fail("discarded (the capture failed)", members)
                err = drv.error(rc, "cuStreamEndCapture")
                if rc == _INVALIDATED:
                    add_note(err, f"the capture on {self.describe()} was invalidated by an earlier call in the with "
                                  "block that the driver refused during the capture (its exception was caught): "
                                  "nothing was captured; the stream is usable again")
                raise err
            graph._captured(out[0], [adopt_graph_allocation(b) for b in self._allocated_here(members)])
            frees, self._frees = self._frees, []
            graph.free_on_launch(frees)
            return
        # The block raised: no graph, whatever the driver made of it.
        if rc == 0 and out[0] != ffi.NULL:
            destroyed = drv.cuGraphDestroy(out[0])
            if destroyed:
                add_note(exc, f"destroying the partial graph failed: {drv.error(destroyed, 'cuGraphDestroy')}")
        elif rc and rc != _INVALIDATED:
            add_note(exc, f"ending the capture failed too: {drv.error(rc, 'cuStreamEndCapture')}")
        self._fail("discarded (the with block raised)", members)
        if isinstance(exc, CudaError) and exc.code in _CAPTURE_ERRORS and not exc.refused:
            add_note(exc, f"{exc.call} was made while {self.describe()} was being captured (mode "
                          f"{self._mode_name()!r}): the driver does not allow it during a capture (a synchronous or "
                          "implicitly synchronizing call, or work that cannot become a graph node); the capture was "
                          "ended and its graph discarded")
        return

    def info(self) -> CaptureInfo:
        """:func:`capture_info` of the stream being captured."""
        return capture_info(self.stream if self.stream is not None else self.handle, context=self.context)

    def __repr__(self) -> str:
        return f"<cuproc.StreamCapture on {self.describe()}>"


def _handle_of(stream: Any) -> int:
    return handle_int(stream.handle if isinstance(stream, Stream) else ffi.cast("CUstream", stream))


def _capture_id(driver: Driver, context: Context, handle: Any) -> int:
    """The id of the capture running on stream ``handle`` (cuStreamGetCaptureInfo; 0: none)."""
    call = "cuStreamGetCaptureInfo"
    status, cid = ffi.new("CUstreamCaptureStatus *"), ffi.new("cuuint64_t *")
    n = arity(driver, call)
    args: tuple = (handle, status, cid) + (ffi.NULL,) * (n - 3)
    driver.check(context.call_on(handle, getattr(driver, call), *args), call)
    return int(cid[0]) if status[0] else 0


def _running_on(driver: Driver, context: Context, handle: Any) -> StreamCapture | None:
    """The capture cuproc runs on stream ``handle`` -- the captured stream, or one that joined it (matched by
    the driver's capture id) -- or None (graph_nodes.CAPTURE_ON: a free into a capture is pending there)."""
    with _lock:
        found = _running.get(_key(driver, context, handle, _thread.get_ident()))
        running = [c for c in _running.values() if c.driver is driver]
    if found is not None:
        return found
    cid = _capture_id(driver, context, handle)
    return next((c for c in running if cid and c.id == cid), None)


CAPTURE_ON[0] = _running_on


def _prohibiting() -> StreamCapture | None:
    """A capture cuproc runs that prohibits this thread's "potentially unsafe" calls now: one in mode "global"
    (any thread's), or one in mode "thread_local" begun on this thread; None when none does
    (graph_nodes.PROHIBITING: a graph allocation's close() refuses cuMemFree then)."""
    me = _thread.get_ident()
    with _lock:
        return next((c for c in _running.values()
                     if c.mode == MODES["global"] or (c.mode == MODES["thread_local"] and c.thread == me)), None)


PROHIBITING[0] = _prohibiting


def capture(stream: Any = None, mode: str | int = "global", *, context: Context | None = None,
            driver: Driver | None = None) -> StreamCapture:
    """``with capture(stream) as graph:``: see the module docstring.  A function of this module, not a method
    of :class:`~cuproc.stream.Stream`: the capture yields a Graph, whose layer sits above streams (its kernels,
    copies and memsets take streams), so streams do not know captures and the imports flow one way.
    ``stream``: a Stream, another library's stream, a raw handle, or None for the handle's default stream
    (the per-thread one; the legacy one is refused)."""
    return StreamCapture(stream, mode, context=context, driver=driver)


def capture_status(stream: Any = None, *, context: Context | None = None, driver: Driver | None = None) -> str:
    """"none", "active" or "invalidated" (cuStreamIsCapturing)."""
    call = "cuStreamIsCapturing"
    _stream, h, ctx = _target(stream, context, driver, call)
    status = stream_capturing(ctx.driver, ctx, h)
    return _STATUS.get(status, str(status))


def capture_info(stream: Any = None, *, context: Context | None = None, driver: Driver | None = None) -> CaptureInfo:
    """The stream's capture state (cuStreamGetCaptureInfo, with the arguments of the ABI the handle
    selected: v1 status and id; v2 (11.3+) also the graph and the dependencies; v3 (12.3+) edge data too)."""
    call = "cuStreamGetCaptureInfo"
    _stream, h, ctx = _target(stream, context, driver, call)
    drv = ctx.driver
    n = arity(drv, call)
    status, cid = ffi.new("CUstreamCaptureStatus *"), ffi.new("cuuint64_t *")
    graph_out, deps, count = ffi.new("CUgraph *"), ffi.new("CUgraphNode **"), ffi.new("size_t *")
    if n == 3:
        args: tuple = (h, status, cid)
    elif n == 6:
        args = (h, status, cid, graph_out, deps, count)
    else:
        args = (h, status, cid, graph_out, deps, ffi.new("CUgraphEdgeData **"), count)
    drv.check(ctx.call_on(h, getattr(drv, call), *args), call)
    state = _STATUS.get(status[0], str(status[0]))
    if n == 3 or state != "active" or graph_out[0] == ffi.NULL:
        return CaptureInfo(state, int(cid[0]), None, None if n == 3 else ())
    with _lock:
        running = _running.get(_key(drv, ctx, h, _thread.get_ident()))
    if running is not None and running.id == int(cid[0]) and running.graph is not None:
        graph = running.graph            # cuproc's capture: the Graph its with statement yields
    else:
        graph = Graph._view(drv, ctx, graph_out[0])     # another's: valid while that capture runs
    return CaptureInfo(state, int(cid[0]), graph, tuple(graph._node(deps[0][i]) for i in range(count[0])))


__all__ = ["CaptureInfo", "StreamCapture", "capture", "capture_info", "capture_status"]
