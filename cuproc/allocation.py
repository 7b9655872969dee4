"""What every allocation shares: its context, address, size, and how it is given back.

Policy: an allocation is a :class:`~cuproc._resource.Resource` whose parent is
the context it was made in.  It is freed with that context bound
(:meth:`~cuproc.context.Context.call`) from whichever thread lets go of it:
``free()``/``close()`` (idempotent, like a file's ``close``), a ``with`` block,
or -- the safety net -- its finalizer.  Using it after that, or after its
context ended, raises :class:`~cuproc.errors.ClosedResourceError` before the
driver sees the address.
"""
from __future__ import annotations

from typing import Any

from ._resource import FORKED, Resource
from .context import Context


class Allocation(Resource):
    """Memory at ``address`` of ``nbytes`` bytes, owned by ``context``."""

    __slots__ = ("context", "address", "nbytes")
    _ended_word = "freed"
    _leaf = True       # no resource names memory as its parent: freeing it leaves EPOCH alone
    kind = "device"

    context: Context
    address: int
    nbytes: int

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
