"""The resource model: one rule for lifetime, refusal after close, fork, and finalizers.

Every object that holds a driver handle is a :class:`Resource`.

* **Strong ownership.**  A resource holds what it needs as plain attributes (a
  buffer its context, a function its module, a prepared launch its function
  and stream), so Python's own reference counting keeps every parent alive
  while a child can still use it, and frees children before parents -- also
  at interpreter exit.
* **Explicit destruction invalidates dependents.**  ``close()`` (and
  ``destroy()``, ``free()``, ``unload()``) sets :attr:`Resource.ended` to how
  the object ended.  Before touching the driver, every operation calls
  :meth:`Resource.check`, which walks the object's parents
  (:meth:`Resource.parents`); if any of them has ended, it raises
  :class:`~cuproc.errors.ClosedResourceError` naming both, and no handle
  reaches the driver.  ``close()`` is idempotent everywhere, like a file's.
* **One finalizer.**  ``__del__`` is the safety net for objects dropped without
  ``close()``: it releases the handle once, never raises, and reports a driver
  failure as a :class:`~cuproc.errors.CudaWarning` (silent only while the
  interpreter itself is shutting down).  A release that a running stream
  capture prohibits is put off to the capture's end (:data:`DEFER_DROP`).  A child whose parent already ended
  releases nothing: its handle went with the parent.
* **Fork.**  In a child forked after CUDA was initialized, ``check`` raises
  :class:`~cuproc.errors.ForkedProcessError` and finalizers do nothing (the
  handles belong to the parent process).
* **Threads.**  Any thread may use, close or drop any object; each step is
  safe on its own.  Closing or destroying an object (or its context) while
  *another thread is in the middle of a call* with it is a race in the
  program, as it is in C: cuproc checks before each call, and the driver call
  itself is not guarded against a concurrent destroy.
* **A cheap validity token.**  :data:`EPOCH` changes whenever a resource that
  others can depend on ends (and at fork).  Hot paths (a prepared launch,
  :meth:`Resource.check` itself) verify the parents once and then only compare
  the epoch they saw with the current one.  A *leaf* (an allocation: nothing
  names it as a parent) ends without moving the epoch, so allocating and freeing
  in a loop does not send every other object back to a full check; every check
  of a leaf reads its own ``ended`` first.

Subclasses provide ``_release()`` (the driver call that gives the handle back,
returning its CUresult) and ``_release_call`` (its C name, for errors).
"""
from __future__ import annotations

import sys

# warnings.warn itself (warnings.py re-exports it), without importing warnings.py on the way to a first
# allocation (issue 9)
try:
    from _warnings import warn as _warn_function
except ImportError:  # pragma: no cover - an interpreter without the C accelerator
    from warnings import warn as _warn_function

from . import _fork, fastpath
from .driver import Driver, forked_error
from .errors import ClosedResourceError, CudaWarning

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any

# EPOCH[0] changes whenever a resource ends and in a forked child: hot paths cache the epoch at
# which they last verified their parents and re-verify only when it moved.
EPOCH: list[int] = [0]
FORKED = _fork.FORKED
_CLAIM = _fork.lock()   # makes "not ended yet -> ended" one step when threads close the same object
#: ``DEFER_DROP[0](resource)``, when set, is asked by every finalizer before it gives a handle back: True
#: means it took the resource and will end it later (``resource._end_drop(resource._drop)``).  Set by
#: cuproc.stream_capture while a capture that prohibits releases runs (None otherwise), which must keep a
#: finalizer's release (cuMemFree, cuModuleUnload, cuGraphExecDestroy...) out of it (this module cannot
#: import that one).  The compiled DeviceBuffer finalizer is handed this list and, while it is set, leaves a
#: drop to ``Resource.__del__`` (src/fastpath/README.md's contract).
DEFER_DROP: list[Callable[[Resource], bool] | None] = [None]


def _bump_epoch_in_child() -> None:
    EPOCH[0] += 1


_fork.on_fork_in_child(_bump_epoch_in_child)


class Resource:
    """Something that holds a driver handle and gives it back once (see the module docstring)."""

    __slots__ = ("driver", "ended", "_checked_at", "__weakref__")

    #: the C name of the call ``_release`` makes (for errors and warnings)
    _release_call = "release"
    #: the word for how it ended after ``close()`` ("freed", "destroyed", "unloaded", ...)
    _ended_word = "closed"
    #: True where no resource names this one as a parent (see "A cheap validity token")
    _leaf = False

    driver: Driver
    ended: str | None   # None while usable; else how it ended

    # ---------------------------------------------------------------- what subclasses give
    def parents(self) -> tuple[Resource, ...]:
        """The resources this one cannot be used without (its context, module, stream...)."""
        return ()

    def _release(self) -> int:
        """Give the handle back to the driver; return the CUresult.  Called at most once."""
        return 0

    def describe(self) -> str:
        """How messages name this object."""
        return f"this {type(self).__name__}"

    # ---------------------------------------------------------------- the rules
    def ended_owner(self) -> Resource | None:
        """This object, or the first parent (depth first) that has ended; None when all are usable."""
        if self.ended is not None:
            return self
        for parent in self.parents():
            gone = parent.ended_owner()
            if gone is not None:
                return gone
        return None

    def ancestors(self) -> Iterator[Resource]:
        """Every resource this one depends on, transitively (self excluded)."""
        for parent in self.parents():
            yield parent
            yield from parent.ancestors()

    def check(self, call: str) -> None:
        """Raise unless this object and everything it depends on are usable in this process.

        A check that passed is remembered with the :data:`EPOCH` it saw: until some resource
        ends (or the process forks) the next check is one comparison, not a walk of the parents."""
        epoch = EPOCH[0]
        if self.ended is None and getattr(self, "_checked_at", None) == epoch:   # unset until a check passed
            return
        if FORKED[0]:
            raise forked_error(call)
        gone = self.ended_owner()
        if gone is not None:
            raise ClosedResourceError(call, self.describe(), gone.describe(), gone.ended or "closed")
        self._checked_at = epoch

    @property
    def closed(self) -> bool:
        """True once this object, or something it depends on, has ended."""
        return self.ended_owner() is not None

    def _claim(self, how: str, /) -> bool:
        """Mark this object ended; False if it already was (another thread closed it first).

        On the compiled fast path this method is a C function doing the same test and store with no
        Python code between them, so in one step under the GIL, without the lock (see the end of this
        module): then it is the one claim there is, which the C close of a DeviceBuffer also makes."""
        with _CLAIM:
            if self.ended is not None:
                return False
            self.ended = how
        if not self._leaf:
            EPOCH[0] += 1
        return True

    def close(self) -> None:
        """Give the handle back now.  Idempotent; a driver failure raises (once)."""
        if self.ended is not None:
            return
        if FORKED[0]:
            self._claim("left behind by fork()")
            return
        for parent in self.parents():
            if parent.ended_owner() is not None:
                self._claim(self._ended_word)   # the handle went with its owner: nothing to give back
                return
        self._give_back()

    def _give_back(self) -> None:
        """The end of :meth:`close` once every parent is known alive: claim, then release.  The claim
        comes first, whatever the driver says: the handle is never given back twice."""
        if not self._claim(self._ended_word):
            return
        rc = self._release()
        if rc:
            raise self.driver.error(rc, self._release_call)

    def _drop_releases_a_handle(self) -> bool:
        """Does dropping this object give a handle back to the driver?  A wrapper of a handle owned
        elsewhere does not, so its collection need not send every hot path back to a full check."""
        return True

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # On the fast path a dropped live DeviceBuffer of cuMemAlloc memory is let go by the steps of _drop in C
        # (src/fastpath/fastpath_device_buffer.c, cuproc_db_drop), which hands a failure to _end_drop: a change here
        # is a change there.
        try:
            if self.ended is not None:
                return
        except AttributeError:      # __init__ failed before the handle existed: nothing to give back
            return
        defer = DEFER_DROP[0]
        if defer is not None and defer(self):   # kept (resurrected) until a stream capture ended
            return
        self._end_drop(self._drop)

    def _drop(self) -> int:
        """What dropping a live object does: end it as "dropped" and give its handle back (none in a forked
        child, or once a parent ended: the handle went with it); returns the CUresult."""
        if FORKED[0] or any(p.ended_owner() is not None for p in self.parents()):
            self.ended = "dropped"
            return 0
        self.ended = "dropped"
        if not self._leaf and self._drop_releases_a_handle():
            EPOCH[0] += 1
        return self._release()

    def _end_drop(self, release: Callable[..., int], *args: Any) -> None:
        """``release(*args)`` for a finalizer: it never raises; a failure -- an exception, or a nonzero
        CUresult -- is reported as a warning (:func:`report`)."""
        try:
            rc = release(*args)
        except Exception as exc:  # noqa: BLE001 - a finalizer never raises
            report(f"releasing {self.describe()} at collection raised {exc!r}")
            return
        if rc:
            report(f"{self.describe()} was dropped without close() and releasing it failed: "
                   f"{failure_text(self.driver, rc, self._release_call)}")

    def __reduce__(self) -> Any:
        raise TypeError(f"a {type(self).__name__} holds a driver handle and cannot be pickled")


_make_claim = fastpath.claim_factory()
_c_claim = None if _make_claim is None else _make_claim(Resource._claim, Resource, Resource.ended, EPOCH)
if _c_claim is not None:   # (None on a free-threaded build: the lock stays)
    Resource._claim = fastpath.dressed(_c_claim, Resource._claim)  # type: ignore[method-assign]


def failure_text(driver: Any, rc: int, call: str) -> str:
    """What a finalizer says about ``call`` answering ``rc``: the driver's name and text for the code, or,
    when describing it fails in turn, the bare code -- error reporting never hides the failure."""
    try:
        return str(driver.error(rc, call))
    except Exception:  # noqa: BLE001 - the code itself is what must not be lost
        return f"{call} returned CUresult {rc}"


def report(message: str, _finalizing: Any = sys.is_finalizing, _warn: Any = _warn_function) -> None:
    """A finalizer's failure, as a warning; silent while the interpreter shuts down (the exit stays quiet)."""
    try:
        if not _finalizing():
            _warn(message, CudaWarning, stacklevel=3)
    except Exception:  # noqa: BLE001 - warnings may be half torn down
        pass


__all__ = ["DEFER_DROP", "EPOCH", "Resource", "report"]
