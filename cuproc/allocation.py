"""What every allocation shares: its context, address, size, and how it is given back.

Policy: an allocation is a :class:`~cuproc._resource.Resource` whose parent is
the context it was made in.  It is freed with that context bound
(:meth:`~cuproc.context.Context.call`) from whichever thread lets go of it:
``free()``/``close()`` (idempotent, like a file's ``close``), a ``with`` block,
or -- the safety net -- its finalizer.  Using it after that, or after its
context ended, raises :class:`~cuproc.errors.ClosedResourceError` before the
driver sees the address.

Exported memory stays valid while it is exported: a DLPack capsule (and the
consumer's array made from it) holds the exporting object, so dropping every
cuproc reference is safe, and the memory is freed when the consumer calls the
capsule's deleter.  Freeing it explicitly (or destroying its context) while an
export or a host view is alive is refused with ``BufferError``: the consumer
cannot be told its memory went away.  ``__cuda_array_interface__`` has no
lifetime protocol: a CAI consumer must keep the cuproc object alive itself.
"""
from __future__ import annotations

from ._resource import FORKED, Resource
from .context import Context

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

#: id(allocation) -> number of its live DLPack tensors.  Kept here, not in _dlpack, so that
#: checking for exports costs an allocation no import of the DLPack machinery; _dlpack counts in it
#: (each tensor holds its allocation, so an id here is never reused while counted).
EXPORTS: dict[int, int] = {}
#: What settles the count before a refusal: _dlpack registers its sweep of capsules dropped unconsumed
#: (they run no destructor; see cuproc._dlpack) when it is imported, which any entry in EXPORTS implies.
SWEEPS: list[Callable[[], None]] = []


class Allocation(Resource):
    """Memory at ``address`` of ``nbytes`` bytes, owned by ``context``."""

    __slots__ = ("context", "address", "nbytes")
    _ended_word = "freed"
    _leaf = True       # no resource names memory as its parent: freeing it leaves EPOCH alone
    kind = "device"
    #: memory that no copy, memset or writable view may write: a registration made with read_only=True
    #: (RegisteredHostMemory's property); a class attribute everywhere else
    read_only = False
    #: True where parents() is this class's (the context alone): close() then checks it inline
    _context_is_the_parent = True

    context: Context
    address: int
    nbytes: int

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._context_is_the_parent = cls.parents is Allocation.parents

    def parents(self) -> tuple[Resource, ...]:
        return (self.context,)

    def describe(self) -> str:
        return f"{type(self).__name__} of {self.nbytes} bytes at {self.address:#x}"

    @property
    def ptr(self) -> int:
        """The address; raises if this memory was freed or its context ended."""
        if self.ended is None and self.context.ended is None and not FORKED[0]:
            return self.address
        self.check(f"{type(self).__name__}.ptr")
        return self.address

    def has_views(self) -> bool:
        """True while a DLPack export of this memory (or, for host memory, a view) is alive."""
        if id(self) not in EXPORTS:
            return False
        for sweep in SWEEPS:          # capsules dropped unconsumed since the last look give theirs back
            sweep()
        return id(self) in EXPORTS

    def close(self) -> None:
        """Free now (idempotent).  Refused with BufferError while exports or views of the memory exist."""
        if self.ended is not None:
            return
        if self.has_views():
            raise BufferError(f"{self._release_call} was not called: {self.describe()} still has views "
                              f"(a DLPack export, a NumPy array or a memoryview of it); drop them first")
        if self._context_is_the_parent and self.context.ended is None and not FORKED[0]:
            # Resource.close with its walk of the parents done inline: an allocation's one parent is its
            # context, which has none (code that frees per step pays for every call here, issue 9); a
            # subclass that names other parents takes Resource.close's walk.
            self._give_back()
            return
        super().close()

    def free(self) -> None:
        """Give the memory back now (idempotent); a driver failure raises."""
        self.close()

    @property
    def freed(self) -> bool:
        return self.closed

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        state = self.ended or f"{self.address:#x}"
        return f"<cuproc.{type(self).__name__} {self.nbytes} bytes at {state}>"

    def __reduce__(self) -> Any:
        raise TypeError(f"a {type(self).__name__} is memory of this process and cannot be pickled")


__all__ = ["Allocation"]
