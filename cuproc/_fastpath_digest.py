"""The digest that ties a built ``cuproc._fastpath_c`` to the sources it was built from.

Why: the compiled module is gitignored and survives a ``git pull``; one built from other
headers (``cuproc/_cffi_abi.py``) would declare other types, and one built by another
``tools/build_fastpath.py`` / ``tools/fastpath_launch.c`` would take another ``make_launcher``
argument tuple.  tools/build_fastpath.py embeds :func:`digest` of both groups in the module;
cuproc._ffi recomputes them and does not load a module whose digests differ.  The tools are
checked only where they are (a checkout; an installed package has none, and was built with it).
Standard library only: tools/build_fastpath.py loads this file by path, without importing cuproc.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

ABI_INPUTS = ("cuproc/_cffi_abi.py",)
TOOL_INPUTS = ("tools/build_fastpath.py", "tools/fastpath_launch.c")


def digest(root: Path, inputs: Iterable[str]) -> str:
    """SHA-256 over the names and contents of ``inputs`` (paths relative to ``root``)."""
    h = hashlib.sha256()
    for name in inputs:
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return h.hexdigest()
