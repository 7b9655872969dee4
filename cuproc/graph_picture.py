"""A picture of a CUDA graph: the driver's DOT text (cuGraphDebugDotPrint) and Graphviz's drawing of it.

Policy
------
* **The driver draws the graph.**  :meth:`GraphPicture.to_dot` is the text the
  driver writes for the graph's handle, unchanged, with the flags asked for
  (``verbose``, or CUgraphDebugDot_flags by name or value): what a user sees is
  what the driver knows, bodies and child graphs included.
* **Graphviz is optional.**  ``to_png`` needs Graphviz's ``dot`` on PATH (a
  clear FileNotFoundError without it); a notebook's ``_repr_svg_`` shows no
  picture instead (None), never an error.
"""
from __future__ import annotations

import os

from ._ffi import ffi
from .graph_errors import flag_value

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from .context import Context
    from .driver import Driver

DOT_FLAGS = ffi.typeof("CUgraphDebugDot_flags").relements


def dot_flags(flags: int | Iterable[str]) -> int:
    """``CUgraphDebugDot_flags`` as an int (names with or without ``CU_GRAPH_DEBUG_DOT_FLAGS_``)."""
    return flag_value(flags, DOT_FLAGS, "CU_GRAPH_DEBUG_DOT_FLAGS_", "cuGraphDebugDotPrint")


class GraphPicture:
    """What :class:`~cuproc.graph.Graph` draws with (a mixin: it reads the graph's driver, handle and
    ``_ready``)."""

    driver: Driver
    handle: Any

    def _ready(self, call: str) -> Context:  # pragma: no cover - the Graph's own
        raise NotImplementedError

    def to_dot(self, *, verbose: bool = False, flags: int | Iterable[str] = 0) -> str:
        """The driver's DOT text of the graph (cuGraphDebugDotPrint).  ``verbose`` adds every parameter;
        ``flags``: an int or names of CUgraphDebugDot_flags ("KERNEL_NODE_PARAMS", "HANDLES", ...)."""
        call = "cuGraphDebugDotPrint"
        ctx = self._ready(call)
        value = dot_flags(flags) | (DOT_FLAGS["CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE"] if verbose else 0)
        import tempfile
        fd, path = tempfile.mkstemp(prefix="cuproc-graph-", suffix=".dot")
        os.close(fd)
        try:
            self.driver.check(ctx.call_current(self.driver.cuGraphDebugDotPrint, self.handle, os.fsencode(path),
                                               value), call)
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
        finally:
            os.unlink(path)

    def to_png(self, path: str | os.PathLike[str], *, verbose: bool = False) -> None:
        """The picture of :meth:`to_dot`, drawn by Graphviz's ``dot`` (which must be on PATH)."""
        image = graphviz(self.to_dot(verbose=verbose), "png")
        with open(path, "wb") as f:
            f.write(image)

    def _repr_svg_(self) -> str | None:
        """The picture for Jupyter, when Graphviz's ``dot`` is on PATH and the graph can be drawn (else None:
        no picture; a closed graph, or one still being captured, is drawn by no one)."""
        import shutil
        if shutil.which("dot") is None:
            return None
        try:
            return graphviz(self.to_dot(), "svg").decode()
        except Exception:  # noqa: BLE001 - a notebook shows the repr instead
            return None


def graphviz(dot: str, fmt: str) -> bytes:
    """``dot -T<fmt>`` of the DOT text: Graphviz draws the picture."""
    import shutil
    import subprocess
    program = shutil.which("dot")
    if program is None:
        raise FileNotFoundError("Graphviz's dot is not on PATH: install Graphviz to draw graphs (or write "
                                "graph.to_dot() to a file and draw it elsewhere)")
    return subprocess.run([program, f"-T{fmt}"], input=dot.encode(), capture_output=True, check=True).stdout


__all__ = ["GraphPicture", "dot_flags", "graphviz"]
