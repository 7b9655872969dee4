"""The fingerprint that ties a built ``cuproc._fastpath_c`` to the sources it was built from.

Why: the compiled module is gitignored and survives a ``git pull``; one built from other
headers (``cuproc/_cffi_abi.py``) would declare other types, and one built by another
``tools/build_fastpath.py`` or from other C sources (:data:`C_SOURCES`) would take other
``make_launcher`` / ``make_checked`` argument tuples.  tools/build_fastpath.py embeds
:func:`digest` of both groups in the module; cuproc._ffi recomputes them at import and does not
load a module whose digests differ.  The tools are checked only where they are (a checkout; an
installed package has none, and was built with it).

The digest is CRC-32 (``zlib.crc32``) and the length of the named inputs, not a cryptographic
hash: it detects a stale build, which is all it is for, and it runs on every ``import cuproc``
of the fast path -- ``hashlib`` costs 2-3 ms there (it loads OpenSSL), ``zlib`` about 0.3 ms (and
``os.path``, not ``pathlib``: pathlib brings urllib.parse and ipaddress, 2-4 ms).  Standard
library only: tools/build_fastpath.py loads this file by path, without importing cuproc.
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Iterable

ABI_INPUTS = ("cuproc/_cffi_abi.py",)
# The hand-written C that tools/build_fastpath.py compiles into the module, in that order.
C_SOURCES = ("tools/fastpath_launch.c", "tools/fastpath_checked.c", "tools/fastpath_memory.c",
             "tools/fastpath_resolve.c")
TOOL_INPUTS = ("tools/build_fastpath.py", *C_SOURCES)


def digest(root: str | os.PathLike[str], inputs: Iterable[str]) -> str:
    """``crc32-length`` over the names and contents of ``inputs`` (paths relative to ``root``)."""
    crc, length = 0, 0
    for name in inputs:
        with open(os.path.join(root, name), "rb") as f:
            content = f.read()
        for part in (name.encode(), b"\0", content, b"\0"):
            crc = zlib.crc32(part, crc)
            length += len(part)
    return f"{crc:08x}-{length}"
