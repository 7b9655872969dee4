"""PTX ISA versions: the ISA a PTX text declares, and the newest ISA each CUDA driver's JIT accepts.

Policy
------
* One table, from the PTX ISA release notes (each CUDA release's new ISA), for CUDA 11.0 to 13.5;
  the 11.8, 12.0, 12.4, 12.9, 13.0 and 13.5 rows were also read off PTX that each of those NVRTCs
  emitted.  CUDA 12.6 kept 8.5.  NVIDIA's release history gives ISA 8.6 to CUDA 12.7, a version never
  released as a toolkit (12.6 was followed by 12.8); the row is kept so that the table says what NVIDIA's
  says (cuda-python's ``cuda.bindings.utils`` maps 8.6 to 12.7 too).
* A CUDA version between two rows accepts what the older row says (a release never accepts less than
  the one before it).  A version past the newest row is *unknown*: :func:`max_ptx_isa` answers None and
  callers let the driver decide, rather than refuse PTX that a newer driver may well accept.
* This is version logic, so it lives at the bottom (``cuproc/version.py`` beside it): the object layer
  asks :func:`driver_accepts` and never compares versions itself.
"""
from __future__ import annotations

import re

from ._namedtuple import NamedTuple
from .version import CudaVersion


class PtxIsa(NamedTuple):
    """A PTX ISA version, as ``.version 9.0`` writes it."""

    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


# (CUDA major, minor) -> the newest PTX ISA its driver JIT (and its NVRTC / nvcc) handles.
_TABLE: dict[tuple[int, int], PtxIsa] = {
    (11, 0): PtxIsa(7, 0), (11, 1): PtxIsa(7, 1), (11, 2): PtxIsa(7, 2), (11, 3): PtxIsa(7, 3),
    (11, 4): PtxIsa(7, 4), (11, 5): PtxIsa(7, 5), (11, 6): PtxIsa(7, 6), (11, 7): PtxIsa(7, 7),
    (11, 8): PtxIsa(7, 8),
    (12, 0): PtxIsa(8, 0), (12, 1): PtxIsa(8, 1), (12, 2): PtxIsa(8, 2), (12, 3): PtxIsa(8, 3),
    (12, 4): PtxIsa(8, 4), (12, 5): PtxIsa(8, 5), (12, 6): PtxIsa(8, 5), (12, 7): PtxIsa(8, 6),
    (12, 8): PtxIsa(8, 7),
    (12, 9): PtxIsa(8, 8),
    (13, 0): PtxIsa(9, 0), (13, 1): PtxIsa(9, 1), (13, 2): PtxIsa(9, 2), (13, 3): PtxIsa(9, 3),
    (13, 4): PtxIsa(9, 4), (13, 5): PtxIsa(9, 5),
}
_KNOWN = sorted(_TABLE)
NEWEST_KNOWN_CUDA = CudaVersion(*_KNOWN[-1])
_VERSION_LINE = re.compile(rb"^[ \t]*\.version[ \t]+(\d+)\.(\d+)", re.M)


def max_ptx_isa(cuda: CudaVersion) -> PtxIsa | None:
    """The newest PTX ISA a CUDA ``cuda`` driver accepts, or None when cuproc does not know
    (older than 11.0, or newer than :data:`NEWEST_KNOWN_CUDA`)."""
    major, rest = divmod(int(cuda), 1000)
    key = (major, rest // 10)
    if key in _TABLE:
        return _TABLE[key]
    if key > _KNOWN[-1] or key < _KNOWN[0]:
        return None
    return _TABLE[max(k for k in _KNOWN if k < key)]


def ptx_isa_of(ptx: bytes | str) -> PtxIsa | None:
    """The ISA a PTX text declares (its ``.version`` directive), or None when it has none (not PTX)."""
    data = ptx.encode() if isinstance(ptx, str) else ptx
    m = _VERSION_LINE.search(data, 0, 1 << 16)   # the directive comes before any code
    return PtxIsa(int(m.group(1)), int(m.group(2))) if m else None


def driver_accepts(isa: PtxIsa, driver: CudaVersion) -> bool | None:
    """True when a CUDA ``driver`` JIT accepts PTX of ``isa``, False when it does not, None when
    cuproc cannot tell (a driver newer than the table): then the driver decides at load."""
    limit = max_ptx_isa(driver)
    return None if limit is None else isa <= limit


__all__ = ["NEWEST_KNOWN_CUDA", "PtxIsa", "driver_accepts", "max_ptx_isa", "ptx_isa_of"]
