"""Contexts: created contexts, the context stack, primary contexts, and running a call in a context.

Policy
------
* **Kinds.**  A :class:`Context` is *created* (made by :meth:`Context.create`;
  owned: :meth:`~Context.destroy`, or dropping the last reference, destroys it),
  *primary* (a device's primary context while a :class:`PrimaryContext` holds
  retains on it) or *adopted* (a handle some other code made current; cuproc
  owns nothing of it and never retains, creates or releases anything to
  classify it).  One live object per handle, so destroying it is seen by
  everything made in it.
* **Binding.**  Every operation runs in its object's context, from any
  thread.  The driver routes a call in one of two ways, and cuproc binds
  each accordingly (measured on driver 580 with another context current):

  - *By a handle*: a call on a stream, event, module or function that names
    it (a launch or memset on a stream, a stream synchronize, an unload) runs
    in that object's context whichever context is current.
    :meth:`Context.call` makes it as is; only when the driver answers that
    the current context is absent or destroyed (or, for a launch or an event
    record on the default stream, that the handle is not the current
    context's) is the object's context pushed for a second attempt and
    popped again.
  - *By the current context*: a synchronous copy or memset, anything on the
    default stream (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD), creating
    and allocating.  The driver carries it out *in whichever context is
    current*, even on another context's memory: unordered with that
    context's work, so a free there may run first (a device fault, seen on
    an H200).  :meth:`Context.call_current` makes it with the object's
    context current (pushed and popped only when another one is);
    :meth:`Context.call_on` picks between the two by the stream argument.

  The calling thread's stack is never changed behind its back, and a thread
  whose current context is already right pays one cuCtxGetCurrent at most.
* **Primary contexts** are reference counted by the driver.  cuproc retains
  one exactly as often as :meth:`PrimaryContext.retain` (or
  :func:`use_device`) is called, and releases exactly that: explicitly, or
  when the PrimaryContext and everything made in its context are gone --
  except at interpreter exit, where the retains that are left go with the
  process (:func:`_give_back` says why).  When
  the last release (or :meth:`PrimaryContext.reset`) ends the driver's
  context, the :class:`Context` object ends with it and its dependents refuse.
* **Host memory views** (NumPy arrays over pinned memory) cannot be
  invalidated, so destroying, resetting or releasing the last retain of a
  context while such views exist is refused with ``BufferError``.  Leaving a
  ``with pc:`` (or ``with pc.retained():``) block never fails for views the
  block may not have made (another thread's): the block's retain is then
  *kept by the context* -- its objects keep it alive -- and given back once
  nothing made in it is left and the PrimaryContext is gone (the safety net of
  :class:`PrimaryRetains`), or taken over by the next ``retain()`` (no driver
  call), or given back by the next ``release()`` once the views are gone.
"""
from __future__ import annotations

import sys
import weakref

from . import _fork
from ._ffi import ffi
from ._resource import FORKED, Resource, failure_text, report
from ._support import arity, get_driver, handle_int, invalid
from .device import CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, Device
from .driver import Driver
from .errors import CudaError, InvalidContextError, refusal, result_code

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_CTX_ERROR = result_code("CUDA_ERROR_INVALID_CONTEXT")
_HANDLE_ERROR = result_code("CUDA_ERROR_INVALID_HANDLE")
_DESTROYED_CURRENT = result_code("CUDA_ERROR_CONTEXT_IS_DESTROYED")   # the thread's current one, not ours
CREATED, PRIMARY, ADOPTED = "created", "primary", "adopted"

_known: weakref.WeakValueDictionary[tuple[int, int], Context] = weakref.WeakValueDictionary()
_known_lock = _fork.lock()
_scratch = _fork.per_thread()   # per-thread out-parameters for the binding retry


def _no_stream_ordered_memory(*args: Any) -> Any:
    raise AssertionError("a stream-ordered entry exists, but cuproc.device_memory registered no way to free it")


#: How a context's teardown frees a stream-ordered entry and names it: (free(context, key, entry) ->
#: CUresult, describe(entry) -> str).  cuproc.device_memory, which makes every entry, registers them
#: when it is imported (it imports this module, so this one cannot import it, least of all during
#: interpreter shutdown, when a teardown may run).
_stream_ordered_memory: tuple[Callable[[Context, Any, Any], int], Callable[[Any], str]] = (
    _no_stream_ordered_memory, _no_stream_ordered_memory)


def register_stream_ordered_memory(free: Callable[[Context, Any, Any], int], describe: Callable[[Any], str]) -> None:
    """How :meth:`Context.free_stream_ordered` frees an entry (called once, by cuproc.device_memory)."""
    global _stream_ordered_memory
    _stream_ordered_memory = (free, describe)


def _popped() -> Any:
    out = getattr(_scratch, "ctx", None)
    if out is None:
        out = _scratch.ctx = ffi.new("CUcontext *")
    return out


class Context(Resource):
    """A CUDA context handle (see the module docstring for the three kinds)."""

    __slots__ = ("handle", "kind", "primary", "_exporters", "stream_ordered")
    _release_call = "cuCtxDestroy"
    _ended_word = "destroyed"

    def __init__(self, handle: Any, *, driver: Driver | None = None, kind: str = ADOPTED,
                 primary: PrimaryRetains | None = None) -> None:
        self.driver = get_driver(driver)
        self.handle = ffi.cast("CUcontext", handle)
        self.kind = kind
        self.primary = primary          # the retains that keep a primary context alive (held strongly)
        self._exporters: weakref.WeakSet[Any] = weakref.WeakSet()
        #: its live stream-ordered allocations, ``buffer.claim_key -> (address, stream)``: part of the
        #: API cuproc.device_memory uses (its hot paths read it inline).  The key is the buffer's weak
        #: reference; the entry is what freeing the memory needs
        #: (:func:`~cuproc.device_memory.free_stream_ordered_entry`).  The claim rule: removing a
        #: buffer's entry is the claim to free it (see :meth:`untrack_stream_ordered`)
        self.stream_ordered: dict[Any, tuple[int, Any]] = {}
        self.ended = None

    # ---------------------------------------------------------------- kinds and lookup
    @property
    def owned(self) -> bool:
        """True for a context cuproc created (and destroys)."""
        return self.kind == CREATED

    @classmethod
    def create(cls, device: Device | int = 0, flags: int = 0, *, driver: Driver | None = None,
               exec_affinity: list[Any] | None = None, params: Any = None) -> Context:
        """cuCtxCreate with the ABI the handle selected; the new context becomes current."""
        drv = get_driver(driver if driver is not None else getattr(device, "driver", None))
        dev = device if isinstance(device, Device) else Device(device, driver=drv)
        out = ffi.new("CUcontext *")
        n = arity(drv, "cuCtxCreate")
        if n == 3:                                          # v2: (pctx, flags, dev)
            if exec_affinity or params is not None:
                raise invalid("cuCtxCreate", "this ABI (cuCtxCreate_v2) takes no affinity or create params")
            drv.checked.cuCtxCreate(out, flags, dev.handle)
        elif n == 5:                                        # v3: (pctx, paramsArray, numParams, flags, dev)
            array = ffi.new("CUexecAffinityParam[]", exec_affinity or []) if exec_affinity else ffi.NULL
            drv.checked.cuCtxCreate(out, array, len(exec_affinity or []), flags, dev.handle)
        else:                                               # v4: (pctx, CUctxCreateParams*, flags, dev)
            drv.checked.cuCtxCreate(out, params if params is not None else ffi.NULL, flags, dev.handle)
        return _register(cls(out[0], driver=drv, kind=CREATED))

    @classmethod
    def adopt(cls, handle: Any, *, driver: Driver | None = None) -> Context:
        """The one live object for ``handle``: cuproc's own when it created or retained it, else an
        adopted (not owned) one.  Never retains, creates or releases anything."""
        drv = get_driver(driver)
        key = (id(drv), handle_int(handle))
        found = _known.get(key)
        if found is not None and found.ended is None:
            return found
        with _known_lock:
            found = _known.get(key)
            if found is not None and found.ended is None:
                return found
            ctx = cls(handle, driver=drv, kind=ADOPTED)
            _known[key] = ctx
            return ctx

    wrap = adopt

    @classmethod
    def current(cls, *, driver: Driver | None = None) -> Context | None:
        """The context current on this thread, as the driver says (cuCtxGetCurrent); None when there is none."""
        return cls._current(get_driver(driver))

    @classmethod
    def _current(cls, drv: Driver) -> Context | None:
        """:meth:`current` for an initialized handle.  The driver is asked every time (other code may
        change the thread's context); the object for its answer is remembered weakly per thread, so
        asking again for the same handle skips the process-wide lookup (:meth:`adopt`).  An ended
        object is never returned from there."""
        out = _popped()
        rc = drv.cuCtxGetCurrent(out)
        if rc:
            raise drv.error(rc, "cuCtxGetCurrent")
        handle = out[0]
        try:
            ctx = _scratch.last()
        except AttributeError:                 # the thread's first question
            ctx = None
        if ctx is not None and ctx.handle == handle and ctx.driver is drv and ctx.ended is None:
            return ctx                         # (a remembered handle is never NULL)
        if handle == ffi.NULL:
            return None
        ctx = cls.adopt(handle, driver=drv)
        _scratch.last = weakref.ref(ctx)
        return ctx

    @classmethod
    def require_current(cls, call: str, *, driver: Driver | None = None) -> Context:
        """The current context, or an error saying ``call`` needs one (before the driver is asked)."""
        ctx = cls._current(get_driver(driver))
        if ctx is None:
            raise refusal(call, "no context is current on this thread: call cuproc.use_device(0) (or retain "
                                "a primary context / create one) first", InvalidContextError,
                          "CUDA_ERROR_INVALID_CONTEXT")
        if FORKED[0] or ctx.ended is not None:   # a context has no parents: this is all check() asks
            ctx.check(call)
        return ctx

    @classmethod
    def target(cls, context: Context | None, call: str, *,
               driver: Driver | None = None) -> tuple[Context, Callable[..., int]]:
        """Where a call that acts on "the current context" (create, allocate) goes: ``context`` if
        given, else the current one, checked usable for ``call``; and the way to call into it
        (:meth:`call_current` for a given context, which may not be current; a plain call otherwise)."""
        if context is None:     # it is current: the call goes straight to the driver
            return cls.require_current(call, driver=driver), _as_is
        if context.__class__ is not Context:
            context = cls.given(context, call)
        context.check(call)
        return context, context.call_current

    @classmethod
    def given(cls, context: Any, call: str) -> Context:
        """The Context that a ``context=`` argument names: a Context as is, or the context of the
        PrimaryContext that :func:`use_device` returns (which must be retained); anything else is
        refused, naming ``call``, before it can fail as an attribute error somewhere inside."""
        if isinstance(context, Context):
            return context
        if isinstance(context, PrimaryContext):
            if context.retain_count == 0:
                raise invalid(call, f"context= is device {context.device.ordinal}'s primary context, which is not "
                                    "retained: retain() it (or use cuproc.use_device) first")
            return context.context
        raise invalid(call, f"context= takes a cuproc Context (or the PrimaryContext cuproc.use_device returns), "
                            f"not {type(context).__name__}")

    # ---------------------------------------------------------------- lifetime
    def describe(self) -> str:
        return f"context {handle_int(self.handle):#x} ({self.kind})"

    def destroy(self) -> None:
        """cuCtxDestroy.  Everything made in it (memory, streams, modules) ends with it and refuses use.
        Idempotent.  Only a created context can be destroyed."""
        if self.kind != CREATED:
            raise invalid("cuCtxDestroy", f"{self.describe()} is not owned by this object: only contexts made by "
                                          "Context.create are destroyed here (release a PrimaryContext instead)")
        self.close()

    def close(self) -> None:
        """Destroy a created context (idempotent); a primary or adopted one owns nothing: no-op.
        Refused while NumPy views or DLPack exports of memory made in it exist; its stream-ordered memory is
        freed first (the driver would leave the pool counting it as used)."""
        if self.kind == CREATED and self.ended is None:
            self.refuse_if_views("cuCtxDestroy")
            self.free_stream_ordered()
            super().close()
            _forget(self)

    def _release(self) -> int:
        # Dropped (or closed): any entry left belongs to a buffer collected in a reference cycle
        # with this object, whose finalizer has not run yet; free its memory while the context is here.
        self.free_stream_ordered()
        return self.driver.cuCtxDestroy(self.handle) if self.kind == CREATED else 0

    def end(self, how: str) -> None:
        """The driver's context is gone (last primary release, reset): this object and its dependents
        refuse from now on.  For the resource model's owners (PrimaryContext), not for users."""
        if self._claim(how):
            _forget(self)

    def untrack_stream_ordered(self, key: Any) -> tuple[int, Any] | None:
        """Remove the entry under ``key`` (a buffer's ``claim_key``) from the table of stream-ordered
        allocations and return it, or None when it was gone: getting the entry is the claim to free
        the memory (:func:`~cuproc.device_memory.free_stream_ordered_entry`).

        One rule for every way such memory is freed -- the buffer's ``free_async``, ``close()`` and
        finalizer, and this context's teardown (:meth:`free_stream_ordered`): each removes the entry
        first (one dict pop, atomic between threads), and only the one that got it frees the
        memory.  The key is the buffer's own weak reference, not the address: a pool that hands a
        freed address out again can never make one buffer's claim take another buffer's entry, and
        the finalizer of a buffer collected in a reference cycle still finds its entry.
        """
        if key.__class__ is not weakref.ref:   # (a buffer passed for its key would look like a lost claim)
            raise TypeError(f"untrack_stream_ordered takes a buffer's claim_key (a weak reference), not {key!r}")
        return self.stream_ordered.pop(key, None)

    def free_stream_ordered(self) -> None:
        """Free this context's stream-ordered allocations now (each on its stream).

        Called before the context is destroyed, reset or released for the last time: the
        driver frees such memory with the context, but its pool keeps counting it as used
        and never gives it back (measured on driver 580).  Entry by entry, each removed first
        (the claim of :meth:`untrack_stream_ordered`) until the table is empty, so that a buffer
        allocated or freed by another thread while the loop runs is neither lost nor freed twice
        (one allocated after the loop and before the context ends is not covered: the context is
        marked ended only afterwards).  An entry whose buffer was already collected -- in a
        reference cycle the weak reference is cleared before the finalizer runs, and this teardown
        can land in between -- is freed all the same: the entry holds the address and the stream.
        Live buffers end as "freed".  In a forked child nothing is freed (the memory is the parent's).
        """
        if FORKED[0]:
            return
        table = self.stream_ordered
        while table:
            free, describe = _stream_ordered_memory   # read only when there is something to free
            try:
                key, entry = table.popitem()    # the claim (atomic): an entry taken by another thread is not seen
            except KeyError:                    # emptied by other threads since the test
                break
            try:
                rc = free(self, key, entry)
                failure = str(self.driver.error(rc, "cuMemFreeAsync")) if rc else ""
            except Exception as exc:  # noqa: BLE001 - the context goes anyway; say what was lost
                failure = repr(exc)
            if failure:
                report(f"freeing {describe(entry)} before its context went failed: {failure}")

    def add_exporter(self, allocation: Any) -> None:
        """Note memory that has handed out views or DLPack exports (destroying the context under them
        is refused while :meth:`~cuproc.allocation.Allocation.has_views` says they live)."""
        self._exporters.add(allocation)

    def refuse_if_views(self, call: str) -> None:
        for allocation in list(self._exporters):
            if allocation.has_views():
                raise BufferError(f"{call} was not called: memory allocated in {self.describe()} still has views "
                                  f"({allocation.describe()}: a DLPack export, a NumPy array or a memoryview); "
                                  f"drop them first")

    @property
    def alive(self) -> bool:
        return self.ended is None

    # ---------------------------------------------------------------- binding
    def call(self, function: Callable[..., int], *args: Any) -> int:
        """``function(*args)`` in this context; returns the CUresult (see the module docstring).

        A thread whose current context is right pays one driver call.  On
        CUDA_ERROR_INVALID_CONTEXT / INVALID_HANDLE / CONTEXT_IS_DESTROYED (the
        thread's current context was destroyed by someone else; this one is alive,
        or :meth:`check` would have refused) this context is pushed, the call made
        again, and the context popped: the thread's stack is as before.
        """
        rc = function(*args)
        return self.rebind(rc, function, *args) if rc else rc

    def rebind(self, rc: int, function: Callable[..., int], *args: Any) -> int:
        """The rest of :meth:`call` once ``function(*args)`` answered ``rc``: a binding error gets the
        second attempt with this context pushed; any other code stands.  Hot paths that make the first
        attempt inline (no extra Python frame per call) hand a non-zero code here.

        A failed push raises its own error (cuCtxPushCurrent): the attempt is :func:`with_pushed`'s.  Returning the
        first answer instead had the caller raise the binding error under its call's name (``cuMemFree failed:
        CUDA_ERROR_INVALID_CONTEXT``), hiding why the second attempt was never made.  Finalizers reach this
        through ``Resource._end_drop``, which turns the exception into a warning."""
        if rc == _CTX_ERROR or rc == _HANDLE_ERROR or rc == _DESTROYED_CURRENT:
            return with_pushed(self.driver, self.handle, function, *args)
        return rc

    def pushed(self, function: Callable[..., int], *args: Any) -> int:
        """``function(*args)`` with this context pushed and popped again (:func:`with_pushed`)."""
        return with_pushed(self.driver, self.handle, function, *args)

    def call_current(self, function: Callable[..., int], *args: Any) -> int:
        """``function(*args)`` with this context current, for calls that act on whatever context is
        current (create, allocate, limits, a synchronous copy or memset, anything on the default
        stream): they succeed in the wrong one, so :meth:`call`'s retry on error cannot be relied on.
        Pushes and pops only when another context is current."""
        drv = self.driver
        out = _popped()
        if drv.cuCtxGetCurrent(out) == 0 and out[0] == self.handle:
            return function(*args)
        return self.pushed(function, *args)

    def call_on(self, stream: Any, function: Callable[..., int], *args: Any) -> int:
        """``function(*args)``, a call whose CUstream argument is ``stream``: on a stream of its own the
        driver routes it by that stream (:meth:`call`); on a default stream it runs in the current
        context (:meth:`call_current`).  See the module docstring."""
        if is_default_stream(stream):
            return self.call_current(function, *args)
        return self.call(function, *args)

    def run(self, call: str, *args: Any) -> None:
        """``call`` (a C name) with this context current, raising CudaError on failure."""
        self.check(call)
        self.driver.check(self.call_current(getattr(self.driver, call), *args), call)

    # ---------------------------------------------------------------- the stack
    def push(self) -> Context:
        self.check("cuCtxPushCurrent")
        self.driver.checked.cuCtxPushCurrent(self.handle)
        return self

    @classmethod
    def pop(cls, *, driver: Driver | None = None) -> Context:
        """Pop this thread's current context and return it."""
        drv = get_driver(driver)
        out = ffi.new("CUcontext *")
        rc = drv.cuCtxPopCurrent(out)
        if rc == _CTX_ERROR:
            raise InvalidContextError(rc, "cuCtxPopCurrent",
                                      hint="this thread's context stack is empty: nothing to pop")
        drv.check(rc, "cuCtxPopCurrent")
        return cls.adopt(out[0], driver=drv)

    def set_current(self) -> None:
        self.check("cuCtxSetCurrent")
        self.driver.checked.cuCtxSetCurrent(self.handle)

    def __enter__(self) -> Context:
        return self.push()

    def __exit__(self, *exc: object) -> None:
        popped = Context.pop(driver=self.driver)
        if popped.handle != self.handle:
            popped.push()  # put back what someone else left on top, then say so
            raise refusal("Context.__exit__", "the context on top of the stack at the end of a `with ctx:` block "
                          "was not ctx (a push inside was not popped); it was left on the stack",
                          InvalidContextError, "CUDA_ERROR_INVALID_CONTEXT")

    # ---------------------------------------------------------------- queries (in this context)
    def _query(self, call: str, ctype: str, *args: Any) -> Any:
        out = ffi.new(ctype)
        self.run(call, out, *args)
        return out[0]

    def synchronize(self) -> None:
        """Wait for all work in this context (cuCtxSynchronize; the 13.0 ABI names the context)."""
        self.check("cuCtxSynchronize")
        self.driver.check(synchronize_context(self), "cuCtxSynchronize")

    def enable_peer_access(self, peer: Context | PrimaryContext) -> bool:
        """cuCtxEnablePeerAccess: let this context access the memory of ``peer`` (a Context, or a retained
        PrimaryContext), with this context made current for the call.  False if it already could.

        Peer access is state of the two contexts, not of their devices: it lasts while both live, so a
        primary context must stay retained (``use_device`` or ``retain()``) for as long as it is needed.
        Whether the devices can at all: :meth:`cuproc.device.Device.can_access_peer`."""
        other = Context.given(peer, "cuCtxEnablePeerAccess")
        self.check("cuCtxEnablePeerAccess")
        other.check("cuCtxEnablePeerAccess")
        rc = self.call_current(self.driver.cuCtxEnablePeerAccess, other.handle, 0)
        if rc == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
            return False
        self.driver.check(rc, "cuCtxEnablePeerAccess")
        return True

    def disable_peer_access(self, peer: Context | PrimaryContext) -> bool:
        """cuCtxDisablePeerAccess: undo :meth:`enable_peer_access`.  False if access was not enabled."""
        other = Context.given(peer, "cuCtxDisablePeerAccess")
        self.check("cuCtxDisablePeerAccess")
        other.check("cuCtxDisablePeerAccess")
        rc = self.call_current(self.driver.cuCtxDisablePeerAccess, other.handle)
        if rc == CUDA_ERROR_PEER_ACCESS_NOT_ENABLED:
            return False
        self.driver.check(rc, "cuCtxDisablePeerAccess")
        return True

    @property
    def device(self) -> Device:
        self.check("cuCtxGetDevice")
        out = ffi.new("CUdevice *")
        self.driver.check(_context_device(self.driver, self.handle, out), "cuCtxGetDevice")
        return Device(out[0], driver=self.driver)

    @property
    def flags(self) -> int:
        return self._query("cuCtxGetFlags", "unsigned int *")

    @property
    def api_version(self) -> int:
        self.check("cuCtxGetApiVersion")
        out = ffi.new("unsigned int *")
        self.driver.checked.cuCtxGetApiVersion(self.handle, out)
        return out[0]

    def get_limit(self, limit: str | int) -> int:
        return self._query("cuCtxGetLimit", "size_t *", _enum("CUlimit", "CU_LIMIT_", limit))

    def set_limit(self, limit: str | int, value: int) -> None:
        self.run("cuCtxSetLimit", _enum("CUlimit", "CU_LIMIT_", limit), value)

    @property
    def cache_config(self) -> int:
        return self._query("cuCtxGetCacheConfig", "CUfunc_cache *")

    @cache_config.setter
    def cache_config(self, value: str | int) -> None:
        self.run("cuCtxSetCacheConfig", _enum("CUfunc_cache", "CU_FUNC_CACHE_", value))

    @property
    def shared_mem_config(self) -> int:
        return self._query("cuCtxGetSharedMemConfig", "CUsharedconfig *")

    def __repr__(self) -> str:
        state = self.ended or self.kind
        return f"<cuproc.Context {handle_int(self.handle):#x} {state}>"


def with_pushed(drv: Driver, handle: Any, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with ``handle`` pushed on this thread's context stack and popped again
    (:func:`pop_pushed`), leaving the stack as it was.

    A failed push raises its own error (cuCtxPushCurrent), not the code of the call it was for: raised
    under that call's name, it blamed the wrong function and gave its advice."""
    rc = drv.cuCtxPushCurrent(handle)
    if rc:
        raise drv.error(rc, "cuCtxPushCurrent")
    try:
        return function(*args)
    finally:
        pop_pushed(drv)


def pushing_failed(exc: BaseException) -> bool:
    """Is ``exc`` :func:`with_pushed`'s own failure -- the context could not be made current, so the call it
    was for never ran?  A caller that claimed something for that call (a free) may give the claim back then,
    and only then: after any other exception the call may have run."""
    return isinstance(exc, CudaError) and exc.call == "cuCtxPushCurrent"


def pop_pushed(drv: Driver) -> None:
    """Pop the context cuproc pushed for one call (:func:`with_pushed`, :meth:`Context.rebind`).  A failed
    pop is a :class:`CudaWarning`, not an exception: the call has run by then (an allocation made, a kernel
    queued), and raising would lose what it made, or invite a retry that runs it twice."""
    rc = drv.cuCtxPopCurrent(_popped())
    if rc:
        report(f"popping the context pushed for a call failed; this thread's context stack keeps it on top: "
               f"{failure_text(drv, rc, 'cuCtxPopCurrent')}")


def synchronize_context(context: Context) -> int:
    """cuCtxSynchronize of ``context``, returning the CUresult: the 13.0 ABI names the context,
    older ones wait for the current one (so it is made current for the call)."""
    drv = context.driver
    if arity(drv, "cuCtxSynchronize") == 1:
        return drv.cuCtxSynchronize(context.handle)
    return context.pushed(drv.cuCtxSynchronize)


def _as_is(function: Callable[..., int], *args: Any) -> int:
    return function(*args)


def call_in(context: Context | None, function: Callable[..., int], *args: Any) -> int:
    """``function(*args)`` bound to ``context`` (:meth:`Context.call`), or as is when there is none
    (a raw address or a library kernel: the current context)."""
    return context.call(function, *args) if context is not None else function(*args)


def is_default_stream(stream: Any) -> bool:
    """Whether a CUstream value names no stream of its own -- NULL, CU_STREAM_LEGACY (1) or
    CU_STREAM_PER_THREAD (2): the default stream of whichever context is current."""
    return stream is None or handle_int(stream) <= 2


def _register(ctx: Context) -> Context:
    """Make ``ctx`` the one object for its handle.  A live object already there names a context
    that is gone (the driver handed its freed address out again, e.g. after another library
    destroyed a context cuproc had adopted): it ends as "replaced", so nothing -- the per-thread
    memo of :meth:`Context.current`, memory made in it -- mistakes the new context for it."""
    key = (id(ctx.driver), handle_int(ctx.handle))
    with _known_lock:
        old = _known.get(key)
        _known[key] = ctx
    if old is not None and old is not ctx:
        old.end("replaced")     # its _forget leaves the new entry alone
    return ctx


def _forget(ctx: Context) -> None:
    key = (id(ctx.driver), handle_int(ctx.handle))
    with _known_lock:
        if _known.get(key) is ctx:
            del _known[key]


class _Counts:
    """What a :class:`PrimaryRetains` holds with the driver, apart from the object: its finalizer
    (:func:`_give_back`) gets this, never the object, so nothing can hand the object out again while
    its retains are being given back."""

    __slots__ = ("driver", "device", "count", "kept")

    def __init__(self, driver: Driver, device: Any) -> None:
        self.driver, self.device, self.count, self.kept = driver, device, 0, 0


class PrimaryRetains:
    """The retains cuproc holds on one device's primary context: a count, given back when the last
    holder goes (:func:`_give_back`).

    Shared by the :class:`PrimaryContext` of the device and by the primary
    :class:`Context` objects it hands out, which hold it strongly: the retains
    outlive the PrimaryContext for as long as anything made in the context is
    alive, and go (deterministically, no reference cycle) when the last holder does.

    The safety net is a ``weakref.finalize``, not ``__del__``: CPython clears weak references only after
    ``__del__`` has run, so while a ``__del__`` released (the GIL free during the driver call, 56-89 ms on
    a GPU) the weak table of instances still handed the object to another thread, which retained through
    it -- and the finalizer, which runs once, never gave that retain back.  A finalize callback runs after
    the weak references are cleared: :meth:`of` then makes a new object.
    """

    _instances: weakref.WeakValueDictionary[tuple[int, int], PrimaryRetains] = weakref.WeakValueDictionary()
    _instances_lock = _fork.lock()

    def __init__(self, driver: Driver, device: Any) -> None:
        self.driver, self.device = driver, device
        self._counts = counts = _Counts(driver, device)
        self.handle: Any = None          # the context of the current activation, while retained
        self.lock = _fork.rlock()
        weakref.finalize(self, _give_back, counts).atexit = False   # at exit: left to the process exit

    @property
    def count(self) -> int:
        """The retains held for :meth:`PrimaryContext.retain` calls not yet released."""
        return self._counts.count

    @count.setter
    def count(self, value: int) -> None:
        self._counts.count = value

    @property
    def kept(self) -> int:
        """Retains a ``with`` block could not give back (host views of memory made in the context were
        alive): held by the context for its objects, not counted in ``count`` (see the module docstring)."""
        return self._counts.kept

    @kept.setter
    def kept(self, value: int) -> None:
        self._counts.kept = value

    @classmethod
    def of(cls, device: Device) -> PrimaryRetains:
        """The device's live PrimaryRetains (one whose retains are being given back is no longer in the
        weak table: see the class docstring)."""
        key = (id(device.driver), device.ordinal)
        with cls._instances_lock:
            found = cls._instances.get(key)
            if found is None:
                found = cls._instances[key] = cls(device.driver, device.handle)
            return found

    def keep_one(self) -> None:
        """One of ``count`` becomes a retain kept by the context for its objects (a ``with`` block's
        exit that the views of memory made in the context refused)."""
        with self.lock:
            self.count -= 1
            self.kept += 1

    def give_back_kept(self, ctx: Context | None) -> None:
        """Release the kept retains once no view of memory made in ``ctx`` is left (else keep them)."""
        with self.lock:
            if not self.kept:
                return
            if ctx is not None:
                try:
                    ctx.refuse_if_views("cuDevicePrimaryCtxRelease")
                except BufferError:
                    return
            while self.kept:
                self.driver.checked.cuDevicePrimaryCtxRelease(self.device)
                self.kept -= 1

    def context(self) -> Context:
        """The one live Context object for the retained handle: an existing one (adopted before the
        retain, or made for an earlier PrimaryContext) becomes primary and holds these retains."""
        with _known_lock:
            key = (id(self.driver), handle_int(self.handle))
            ctx = _known.get(key)
            if ctx is None or ctx.ended is not None:
                ctx = Context(self.handle, driver=self.driver, kind=PRIMARY, primary=self)
                _known[key] = ctx
            elif ctx.kind != PRIMARY or ctx.primary is not self:
                ctx.kind, ctx.primary = PRIMARY, self
            return ctx

    def known_context(self) -> Context | None:
        """The live Context object for the current handle, whatever its kind (never creates one)."""
        if self.handle is None:
            return None
        ctx = _known.get((id(self.driver), handle_int(self.handle)))
        return ctx if ctx is not None and ctx.ended is None else None

    def end_if_inactive(self, how: str) -> None:
        """After the last retain went: when the driver destroyed the context, its object ends."""
        flags, active = ffi.new("unsigned int *"), ffi.new("int *")
        self.driver.checked.cuDevicePrimaryCtxGetState(self.device, flags, active)
        if not active[0]:
            ctx = self.known_context()
            self.handle = None
            if ctx is not None:
                ctx.end(how)


def _give_back(counts: _Counts, _finalizing: Callable[[], bool] = sys.is_finalizing,
               _forked: list[bool] = FORKED) -> None:
    """The safety net of a :class:`PrimaryRetains`: give back the retains it still held once it is gone
    (nothing made in the context is left).  Never raises; a failure is a warning.

    Not while the interpreter finalizes: the last release makes the driver destroy the context
    while the process waits (56-89 ms for one context and a buffer, timed by a probe on an H100,
    driver 580, 2026-11-25), and the process exit reclaims it anyway -- cuda.core leaves it
    there too.  What was made in the context and finalized by the teardown has been freed by
    then (its objects hold the context, so they go first).  An explicit
    :meth:`PrimaryContext.release`, an ``atexit`` handler's included, still releases; so does a
    thread that ends before the interpreter does."""
    if _finalizing():   # first, and through defaults: module globals may be gone by now
        return
    try:
        count, counts.count, counts.kept = counts.count + counts.kept, 0, 0
        if not count or _forked[0]:
            return
        for given in range(count):
            rc = counts.driver.cuDevicePrimaryCtxRelease(counts.device)
            if rc:   # the rest would fail alike: say how many are left to the process exit
                report(f"releasing a dropped primary context retain failed ({count - given} of {count} not "
                       f"released): {failure_text(counts.driver, rc, 'cuDevicePrimaryCtxRelease')}")
                return
    except Exception as exc:  # noqa: BLE001 - a finalizer never raises
        report(f"releasing a dropped primary context retain raised {exc!r}")


class PrimaryContext:
    """A device's primary context, one object per (driver handle, device).

    ``retain()``/``release()`` pair up; ``with pc:`` retains and makes it current.
    The retains live in a :class:`PrimaryRetains` that the Context objects of the
    primary context share, so what is not released explicitly is given back once
    this object and everything made in the context are gone -- or, when that is the
    interpreter's exit, left to the process exit (:func:`_give_back`).
    """

    _instances: weakref.WeakValueDictionary[tuple[int, int], PrimaryContext] = weakref.WeakValueDictionary()
    _instances_lock = _fork.lock()

    def __new__(cls, device: Device | int = 0, *, driver: Driver | None = None) -> PrimaryContext:
        if not isinstance(device, Device):
            device = Device(device, driver=driver)
        key = (id(device.driver), device.ordinal)
        with cls._instances_lock:
            found = cls._instances.get(key)
            if found is None:
                found = super().__new__(cls)
                found.device, found.driver = device, device.driver
                found._retains = PrimaryRetains.of(device)
                found._context = None
                cls._instances[key] = found
            return found

    def __init__(self, device: Device | int = 0, *, driver: Driver | None = None) -> None:
        """Device ``device``'s (a Device, or an ordinal on ``driver``) primary context, not retained yet;
        shared per device: see ``__new__``."""

    def retain(self) -> PrimaryContext:
        """cuDevicePrimaryCtxRetain: one more retain held for this device.  A retain the context kept for
        its objects (see the module docstring) is taken over instead, with no driver call."""
        out = ffi.new("CUcontext *")
        r = self._retains
        with r.lock:
            if r.kept:
                r.kept -= 1
                r.count += 1
                return self
            self.driver.checked.cuDevicePrimaryCtxRetain(out, r.device)
            r.count += 1
            if r.handle is None or handle_int(out[0]) != handle_int(r.handle):
                r.handle = out[0]
                self._context = None
            return self

    def release(self) -> None:
        """cuDevicePrimaryCtxRelease of one retain cuproc holds.  Releasing the last one first frees the
        stream-ordered memory made in the context (the driver would leave its pool counting it) and is
        refused while NumPy views or DLPack exports of memory made in it exist; when the driver then destroys the
        context (no other holder), its Context object and everything made in it end."""
        r = self._retains
        with r.lock:
            if r.count == 0:
                raise invalid("cuDevicePrimaryCtxRelease", "cuproc holds no retain of this primary context to "
                                                           "release (never release what you did not retain)")
            ctx = r.known_context()
            if r.count == 1:
                r.give_back_kept(ctx)      # no longer needed once the views are gone
                if ctx is not None and not r.kept:
                    ctx.refuse_if_views("cuDevicePrimaryCtxRelease")
                    ctx.free_stream_ordered()
            self.driver.checked.cuDevicePrimaryCtxRelease(r.device)
            r.count -= 1
            if r.count == 0 and not r.kept:
                self._context = None
                r.end_if_inactive("released (its last retain)")

    @property
    def retain_count(self) -> int:
        """How many retains cuproc holds (the driver's own count includes other holders)."""
        return self._retains.count

    @property
    def handle(self) -> Any:
        if self._retains.count == 0:
            raise invalid("cuDevicePrimaryCtxRetain", "retain() the primary context before using its handle")
        return self._retains.handle

    @property
    def context(self) -> Context:
        """The Context object of the retained primary context (it holds the retains)."""
        r = self._retains
        with r.lock:
            if r.count == 0:
                raise invalid("cuDevicePrimaryCtxRetain", "retain() the primary context before using its context")
            ctx = self._context
            if ctx is None or ctx.ended is not None:
                ctx = self._context = r.context()
            return ctx

    def retained(self) -> _Retained:
        """``with pc.retained():`` holds a retain without making the context current."""
        return _Retained(self)

    def __enter__(self) -> Context:
        self.retain()
        try:
            return self.context.push()
        except BaseException:
            self.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            Context.pop(driver=self.driver)
        finally:
            self._release_at_exit()

    def _release_at_exit(self) -> None:
        """A ``with`` block's release: where views of memory made in the context refuse it, the retain is
        kept by the context for its objects (see the module docstring) -- leaving a block never fails for
        objects it may not have made."""
        try:
            self.release()
        except BufferError:
            self._retains.keep_one()

    def set_flags(self, flags: int) -> None:
        self.driver.checked.cuDevicePrimaryCtxSetFlags(self.device.handle, flags)

    @property
    def state(self) -> tuple[int, bool]:
        """(flags, active) via cuDevicePrimaryCtxGetState."""
        flags, active = ffi.new("unsigned int *"), ffi.new("int *")
        self.driver.checked.cuDevicePrimaryCtxGetState(self.device.handle, flags, active)
        return flags[0], bool(active[0])

    def reset(self) -> None:
        """cuDevicePrimaryCtxReset: destroys all its allocations and state, for every holder.  Everything
        cuproc made in it ends and refuses use; retains stay held (the driver does not release them)."""
        r = self._retains
        with r.lock:
            if r.handle is None:     # not retained by cuproc: find the handle without retaining
                ctx = None
                for known in list(_known.values()):
                    if known.ended is None and known.driver is self.driver and known.kind != CREATED:
                        dev = ffi.new("CUdevice *")
                        try:
                            found = _context_device(self.driver, known.handle, dev) == 0 and dev[0] == r.device
                        except CudaError:   # a context that cannot be made current (destroyed elsewhere)
                            continue
                        if found:
                            ctx = known
            else:
                ctx = r.known_context()
            if ctx is not None:
                ctx.refuse_if_views("cuDevicePrimaryCtxReset")
                ctx.free_stream_ordered()
            self.driver.checked.cuDevicePrimaryCtxReset(r.device)
            if ctx is not None:
                ctx.end("reset")
            self._context = None
            if r.count:           # still retained: learn the (possibly new) handle without a net retain
                out = ffi.new("CUcontext *")
                self.driver.checked.cuDevicePrimaryCtxRetain(out, r.device)
                self.driver.checked.cuDevicePrimaryCtxRelease(r.device)
                r.handle = out[0]
            else:
                r.handle = None

    def __repr__(self) -> str:
        return f"<cuproc.PrimaryContext device {self.device.ordinal}, {self._retains.count} retain(s)>"


class _Retained:
    def __init__(self, pc: PrimaryContext) -> None:
        self.pc = pc

    def __enter__(self) -> PrimaryContext:
        return self.pc.retain()

    def __exit__(self, *exc: object) -> None:
        self.pc._release_at_exit()


def _context_device(drv: Driver, handle: Any, out: Any) -> int:
    """cuCtxGetDevice for ``handle``: the 13.0 ABI names the context, older ones read the current one."""
    if arity(drv, "cuCtxGetDevice") == 2:
        return drv.cuCtxGetDevice(out, handle)
    return with_pushed(drv, handle, drv.cuCtxGetDevice, out)   # a raw handle: no Context object yet


def _enum(ctype: str, prefix: str, value: str | int) -> int:
    if isinstance(value, int):
        return value
    name = value if value.startswith(prefix) else prefix + value.upper()
    return ffi.typeof(ctype).relements[name]


def use_device(ordinal: int = 0, *, driver: Driver | None = None) -> PrimaryContext:
    """The one-liner: retain device ``ordinal``'s primary context and make it current on this thread.

    Returns the retained :class:`PrimaryContext`: keep it while you use the device, and
    ``release()`` it when done (what is still held is released once it and everything
    made in it are gone, and left to the process exit at interpreter exit).  Dropped at
    once (a bare ``cuproc.use_device(0)`` statement), it takes its retain with it.
    """
    pc = PrimaryContext(ordinal, driver=driver).retain()
    pc.context.set_current()
    return pc


__all__ = ["Context", "PrimaryContext", "PrimaryRetains", "call_in", "synchronize_context", "use_device"]
