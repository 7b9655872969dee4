"""The one CUDA version type.

The driver speaks integers (``cuDriverGetVersion``, the ``cudaVersion``
argument of ``cuGetProcAddress``): ``major * 1000 + minor * 10``, so 12.4 is
12040 and 11.1 is 11010 (writing 11100 for 11.1 is the classic bug).  People
speak strings ("12.4").  Everything in cuproc converts at the edge with
:meth:`CudaVersion.parse` and compares ``CudaVersion`` objects inside.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import Union

    #: Anything :meth:`CudaVersion.parse` accepts.
    VersionLike = Union["CudaVersion", str, int, tuple[int, ...]]

_DRIVER_INT_MIN = 1000  # ints below this are not driver-encoded versions (CUDA 1.0 is 1000)

#: A PEP 440 version's public form as ``packaging.version.Version`` reads it (no epoch): an optional
#: ``v``, the release numbers, then pre-, post- and dev-release and local labels ("12.4rc1",
#: "12.6.2.post1", "v13.0", "12.8.93+local").  Only the release's first two numbers matter here.
_PEP440_RELEASE = (r"v?([0-9]+)(?:\.([0-9]+))?(?:\.[0-9]+)*"
                   r"(?:[-_.]?(?:alpha|beta|preview|pre|rc|a|b|c)[-_.]?[0-9]*)?"
                   r"(?:-[0-9]+|[-_.]?(?:post|rev|r)[-_.]?[0-9]*)?"
                   r"(?:[-_.]?dev[-_.]?[0-9]*)?"
                   r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?")


class CudaVersion:
    """A CUDA version, ``major.minor``; the patch level never changes an ABI and is dropped.

    Immutable, hashable and ordered; ``int(v)`` is the driver's encoding.
    """

    __slots__ = ("major", "minor", "_key")

    def __init__(self, major: int, minor: int = 0) -> None:
        if isinstance(major, bool) or isinstance(minor, bool) or \
                not (isinstance(major, int) and isinstance(minor, int)):
            raise TypeError(f"CudaVersion needs ints, got {major!r}.{minor!r}")
        if major < 1 or not 0 <= minor <= 99:
            raise ValueError(f"not a CUDA version: {major}.{minor}")
        object.__setattr__(self, "major", major)
        object.__setattr__(self, "minor", minor)
        object.__setattr__(self, "_key", major * 1000 + minor * 10)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CudaVersion is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CudaVersion) and self._key == other._key

    def __lt__(self, other: CudaVersion) -> bool:
        return self._key < other._key

    def __le__(self, other: CudaVersion) -> bool:
        return self._key <= other._key

    def __gt__(self, other: CudaVersion) -> bool:
        return self._key > other._key

    def __ge__(self, other: CudaVersion) -> bool:
        return self._key >= other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __reduce__(self) -> tuple:
        return (CudaVersion, (self.major, self.minor))

    @classmethod
    def from_int(cls, value: int) -> CudaVersion:
        """Decode the driver's integer: 12040 -> 12.4, 11010 -> 11.1."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"a driver version integer is an int, got {value!r}")
        if value < _DRIVER_INT_MIN or value % 10:
            raise ValueError(
                f"{value} is not a driver-encoded CUDA version (major*1000 + minor*10, e.g. 12040 for 12.4)")
        return cls(value // 1000, (value % 1000) // 10)

    @classmethod
    def parse(cls, value: VersionLike) -> CudaVersion:
        """Accept ``"12.4"``, ``"12.4.1"``, ``"12040"``, ``12040``, ``(12, 4)``, a PEP 440 string such as
        ``"12.4rc1"`` or ``"12.6.2.post1"`` (a package's version), a :class:`packaging.version.Version`
        (by its ``release``; cuproc does not depend on packaging), or a ``CudaVersion``."""
        if isinstance(value, CudaVersion):
            return value
        if isinstance(value, bool):
            raise TypeError(f"not a CUDA version: {value!r}")
        if isinstance(value, int):
            if value < _DRIVER_INT_MIN:
                raise ValueError(
                    f"ambiguous CUDA version {value}: write \"{value}.0\" or the driver's integer {value * 1000}")
            return cls.from_int(value)
        if isinstance(value, (tuple, list)):
            if not 1 <= len(value) <= 3 or not all(isinstance(p, int) and not isinstance(p, bool) for p in value):
                raise ValueError(f"not a CUDA version: {value!r} (expected (major, minor[, patch]))")
            return cls(value[0], value[1] if len(value) > 1 else 0)
        if isinstance(value, str):
            text = value.strip()
            if not text.isascii():       # str.isdigit and \d take other scripts' digits ("١٢", "²")
                raise ValueError(f"not a CUDA version: {value!r} (expected e.g. \"12.4\" or 12040)")
            if text.isdigit() and int(text) >= _DRIVER_INT_MIN:  # "12040"; "13" means 13.0
                return cls.from_int(int(text))
            parts = text.split(".")
            if 1 <= len(parts) <= 3 and all(p.isdigit() for p in parts):  # the common case, no regular expression
                return cls(int(parts[0]), int(parts[1]) if len(parts) > 1 else 0)
            import re   # deferred: not loaded by ``import cuproc``, and rarely needed (startup, issue 9)
            match = re.fullmatch(_PEP440_RELEASE, text, flags=re.IGNORECASE)
            if match is None:
                raise ValueError(f"not a CUDA version: {value!r} (expected e.g. \"12.4\" or 12040)")
            return cls(int(match[1]), int(match[2] or 0))
        release = getattr(value, "release", None)  # a packaging.version.Version, read without importing packaging
        if isinstance(release, tuple):
            return cls.parse(tuple(release[:2]))
        raise TypeError(f"not a CUDA version: {value!r}")

    def __int__(self) -> int:
        return self._key

    def __index__(self) -> int:
        return int(self)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    def __repr__(self) -> str:
        return f"CudaVersion({self.major}, {self.minor})"
