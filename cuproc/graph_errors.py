"""The errors of the two steps that can refuse a CUDA graph (instantiation and update), and the small rules
every graph module shares: how a refusal carries the driver's details, how a flags argument is read, and
how a newer-driver feature is refused at the handle's requested version.

Policy
------
* **One error per refusing step.**  :class:`GraphInstantiateError` and
  :class:`GraphUpdateError` are the driver's :class:`~cuproc.errors.CudaError`
  for the call (code, name, text), with what the driver said beyond the code:
  the result enum's name, the node it named (found in the graph or in any body
  or child graph inside it), the 11.x log.
* **Only the requested version's ABIs.**  A function the requested version does
  not have is refused with the dispatcher's own error, never taken from a newer
  driver (its ABI is not the one the handle was pinned to).
"""
from __future__ import annotations

from ._support import invalid
from .errors import CudaError, add_note, result_code

#: The driver's answer to what cuda.h forbids a graph with memory alloc or free nodes (removing a node or an
#: edge, a second executable graph; measured on driver 580)
NOT_SUPPORTED = result_code("CUDA_ERROR_NOT_SUPPORTED")

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from .driver import Driver
    from .graph_nodes import GraphNode


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


def with_details(cls: type, base: CudaError, details: str, **attributes: Any) -> CudaError:
    """``base`` (the driver's error for the call) as ``cls``, its hint extended by ``details``."""
    hint = "; ".join(filter(None, [details, base.hint]))
    err = cls(base.code, base.call, name=base.name, description=base.description, hint=hint)
    for key, value in attributes.items():
        setattr(err, key, value)
    return err


def require_at_requested_version(driver: Driver, name: str) -> None:
    """Raise the dispatcher's error for ``name`` at the handle's requested version unless the function
    exists there (a newer-driver feature is not taken: its ABI is not the requested version's)."""
    if driver.has(name, newer_driver_features=False):
        return
    err = driver.unavailable_error(driver.resolution(name, driver.version))
    add_note(err, f"cuproc's graph layer uses only the ABIs of the requested version (CUDA {driver.version}); "
                 f"request a version that has {name} (cuproc.Driver(version=...)) to use it")
    raise err


def flag_value(flags: int | Iterable[str], names: dict[str, int], prefix: str, call: str) -> int:
    """A flags argument as the driver's int: an int as is (>= 0), or flag names with or without ``prefix``
    (case-insensitive), OR-ed; an unknown name is refused, listing the known ones."""
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


__all__ = ["GraphInstantiateError", "GraphUpdateError", "add_note", "flag_value", "require_at_requested_version",
           "with_details"]
