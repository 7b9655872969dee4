"""The arguments of a 1-D fill of device memory, checked once for every place that fills: memory.memset
(cuMemsetD8/16/32[Async]) and a graph's memset node (cuGraphAddMemsetNode / cuGraphMemsetNodeSetParams).

Policy
------
* **One rule, one message.**  Element width, count, value and alignment are
  refused here, before the driver is called, with the same words wherever the
  fill comes from.
* **Zero elements.**  A memset of 0 elements is a no-op the driver accepts; a
  memset *node* must fill at least one element (the driver refuses a node of
  width 0), so the caller says how few it takes (``minimum``).
"""
from __future__ import annotations

from ._support import invalid

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import Any

ELEMENT_BITS = (8, 16, 32)


def check_element_bits(element_bits: Any, call: str) -> int:
    """The element width in bytes for ``element_bits`` (8, 16 or 32)."""
    if isinstance(element_bits, bool) or element_bits not in ELEMENT_BITS:
        raise invalid(call, f"element_bits must be 8, 16 or 32, got {element_bits!r}")
    return element_bits // 8


def fill_count(call: str, ptr: int, nbytes: int | None, value: Any, count: Any, element_bits: int, *,
               minimum: int) -> int:
    """The number of elements a fill of ``ptr`` (a device address; ``nbytes``: its size, None for a raw
    pointer) writes: ``count``, or all of it when None.  Refuses a count below ``minimum`` or past the end,
    a value wider than ``element_bits``, and an address not aligned to the element."""
    size = check_element_bits(element_bits, call)
    if count is None:
        if nbytes is None:
            raise invalid(call, "count is needed for a raw pointer")
        count = nbytes // size
    if isinstance(count, bool) or not isinstance(count, int) or count < minimum or \
            (nbytes is not None and count * size > nbytes):
        least = "" if minimum <= 0 else f" (at least {minimum} element{'s' if minimum > 1 else ''})"
        raise invalid(call, f"{count!r} elements of {size} bytes do not fit the {nbytes}-byte destination{least}")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << element_bits):
        raise invalid(call, f"value {value!r} does not fit {element_bits} bits")
    if ptr % size:
        raise invalid(call, f"the destination {ptr:#x} is not aligned to {size} bytes")
    return count


__all__ = ["ELEMENT_BITS", "check_element_bits", "fill_count"]
