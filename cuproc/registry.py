"""The versioned symbol registry: pure data and selection rules, no I/O.

Every driver function has one or more ABI *variants*, one per
``PFN_<name>_v<version>`` typedef in ``cudaTypedefs.h``.  The rules below
were checked against a real 580 driver for all 485 symbols of CUDA 11.8-13.5:

* **Entry names.** The k-th distinct version among a symbol's typedefs is
  the library entry ``<name>`` for k = 1 and ``<name>_v<k>`` for k >= 2
  (cuCtxCreate: 2000 -> ``cuCtxCreate``, 3020 -> ``_v2``, 11040 -> ``_v3``).
* **Selection.** A requested CUDA version R selects the variant with the
  greatest version <= R.  A symbol with no such variant does not exist at
  R; when a newer driver has it, it is a *newer-driver feature*.
* **Per-thread default stream.** A symbol with ``_ptds``/``_ptsz`` typedefs
  resolves, under the per-thread flag, to the selected entry plus that
  suffix, from version max(introduced, 7.0) on; below 7.0 to nothing.
* **Query version.** cuGetProcAddress is asked at the selected variant's
  own version (7.0 at least for per-thread entries), never at R, so a
  driver newer than the headers cannot hand back an ABI without a typedef.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from typing import TYPE_CHECKING

from .version import CudaVersion

if TYPE_CHECKING:
    from .version import VersionLike

#: Per-thread-default-stream entries exist from this version on.
PER_THREAD_MIN_VERSION = CudaVersion(7, 0)
PER_THREAD_SUFFIXES = ("_ptds", "_ptsz")

_PFN = re.compile(r"^PFN_(\w+?)_v(\d+)(_ptds|_ptsz)?$")


class _Record:
    """Immutable slotted record: cheap to build by the thousand, no dataclasses import."""

    __slots__ = ()

    def __init__(self, *values: object) -> None:
        for name, value in zip(self.__slots__, values, strict=True):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in self.__slots__))

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"{type(self).__name__}({fields})"


class Variant(_Record):
    """One ABI of one driver function.

    ``version`` introduced the ABI; ``typedef`` and ``entry`` name its
    default-stream form; ``per_thread_typedef`` is the typedef of its
    per-thread entry (None when the symbol has none); ``toolkits`` are the
    toolkits whose cudaTypedefs.h declare ``typedef``.
    """

    __slots__ = ("symbol", "version", "typedef", "entry", "per_thread_typedef", "toolkits")
    symbol: str
    version: CudaVersion
    typedef: str
    entry: str
    per_thread_typedef: str | None
    toolkits: tuple[str, ...]


class Symbol(_Record):
    """A driver function and all its ABI variants, oldest first."""

    __slots__ = ("name", "variants", "per_thread_suffix")
    name: str
    variants: tuple[Variant, ...]
    per_thread_suffix: str | None   # "_ptds", "_ptsz" or None

    @property
    def introduced(self) -> CudaVersion:
        return self.variants[0].version

    @property
    def newest(self) -> CudaVersion:
        return self.variants[-1].version


# Why a selection has, or lacks, an entry point.
AVAILABLE = "available"
NOT_YET_INTRODUCED = "not_yet_introduced"      # introduced after R: a newer-driver feature
PER_THREAD_NEEDS_7_0 = "per_thread_needs_7_0"  # per-thread entries start at CUDA 7.0


class Selection(_Record):
    """What the registry picks for one symbol at one requested version and flag."""

    __slots__ = ("symbol", "requested", "per_thread", "variant", "availability")
    symbol: Symbol
    requested: CudaVersion
    per_thread: bool
    variant: Variant | None
    availability: str

    @property
    def exists(self) -> bool:
        return self.availability == AVAILABLE

    @property
    def newer_driver_feature(self) -> bool:
        return self.availability == NOT_YET_INTRODUCED

    @property
    def uses_per_thread_entry(self) -> bool:
        return self.exists and self.per_thread and self.symbol.per_thread_suffix is not None

    @property
    def entry_point(self) -> str | None:
        if not self.exists:
            return None
        if self.uses_per_thread_entry:
            return self.variant.entry + self.symbol.per_thread_suffix
        return self.variant.entry

    @property
    def typedef(self) -> str | None:
        if not self.exists:
            return None
        return self.variant.per_thread_typedef if self.uses_per_thread_entry else self.variant.typedef

    @property
    def query_version(self) -> CudaVersion | None:
        """The version to pass to cuGetProcAddress for exactly this entry."""
        if not self.exists:
            return None
        if self.uses_per_thread_entry:
            return max(self.variant.version, PER_THREAD_MIN_VERSION)
        return self.variant.version


class Change(_Record):
    """One symbol whose selection differs between two versions; kind is added/removed/changed."""

    __slots__ = ("name", "kind", "before", "after")
    name: str
    kind: str
    before: Selection
    after: Selection


class Registry(Mapping[str, Symbol]):
    """All symbols, by C name."""

    def __init__(self, symbols: Iterable[Symbol]) -> None:
        self._symbols = {s.name: s for s in sorted(symbols, key=lambda s: s.name)}

    @classmethod
    def from_typedefs(cls, typedefs: Mapping[str, Iterable[str]] | Iterable[str]) -> Registry:
        """Build from PFN typedef names (optionally mapped to the toolkits declaring them)."""
        toolkits = dict(typedefs) if isinstance(typedefs, Mapping) else {n: () for n in typedefs}
        grouped: dict[str, dict[tuple[int, str], str]] = {}
        for name in toolkits:
            m = _PFN.match(name)
            if m is None:
                raise ValueError(f"not a versioned PFN typedef: {name}")
            grouped.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3) or "")] = name
        symbols = []
        for sym, variants in grouped.items():
            base_versions = sorted({v for v, suffix in variants if not suffix})
            suffixes = {suffix for _, suffix in variants if suffix}
            if len(suffixes) > 1:
                raise ValueError(f"{sym} has both per-thread suffixes {sorted(suffixes)}")
            if not base_versions:
                raise ValueError(f"{sym} has per-thread typedefs but no default-stream one")
            suffix = suffixes.pop() if suffixes else None
            pt_versions = sorted(v for v, s in variants if s)
            built = []
            for k, v in enumerate(base_versions, start=1):
                typedef = variants[(v, "")]
                pt_typedef = None
                if suffix:
                    # Per-thread typedefs may carry their own version (PFN_cuMemcpyHtoD_v7000_ptds
                    # serves the 3020 ABI): take the newest one the per-thread query can reach.
                    reach = max(v, int(PER_THREAD_MIN_VERSION))
                    own = [p for p in pt_versions if v <= p <= reach]
                    pt_typedef = variants[(own[-1], suffix)] if own else typedef
                built.append(Variant(sym, CudaVersion.from_int(v), typedef,
                                     sym if k == 1 else f"{sym}_v{k}", pt_typedef,
                                     tuple(toolkits[typedef])))
            symbols.append(Symbol(sym, tuple(built), suffix))
        return cls(symbols)

    # Mapping protocol -----------------------------------------------------------------
    def __getitem__(self, name: str) -> Symbol:
        return self._symbols[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._symbols)

    def __len__(self) -> int:
        return len(self._symbols)

    # Queries ---------------------------------------------------------------------------
    @property
    def newest_version(self) -> CudaVersion:
        """The newest ABI version any symbol has: the highest version worth requesting."""
        return max(s.newest for s in self._symbols.values())

    def select(self, name: str, version: VersionLike, *, per_thread: bool = False) -> Selection:
        """The variant and entry point of ``name`` at requested version ``version``."""
        symbol = self._symbols[name]
        requested = CudaVersion.parse(version)
        chosen = None
        for variant in symbol.variants:
            if variant.version > requested:
                break
            chosen = variant
        if chosen is None:
            availability = NOT_YET_INTRODUCED
        elif per_thread and symbol.per_thread_suffix and requested < PER_THREAD_MIN_VERSION:
            availability = PER_THREAD_NEEDS_7_0
        else:
            availability = AVAILABLE
        return Selection(symbol, requested, per_thread, chosen, availability)

    def filter(self, patterns: Iterable[str] | None = None) -> list[Symbol]:
        """Symbols whose name matches any of the glob ``patterns`` (all when none given)."""
        pats = list(patterns or [])
        if not pats:
            return list(self._symbols.values())
        from fnmatch import fnmatchcase
        return [s for n, s in self._symbols.items() if any(fnmatchcase(n, p) for p in pats)]

    def diff(self, before: VersionLike, after: VersionLike, *, per_thread: bool = False,
             patterns: Iterable[str] | None = None) -> list[Change]:
        """Symbols added, removed, or given another entry point between two versions."""
        changes = []
        for sym in self.filter(patterns):
            a = self.select(sym.name, before, per_thread=per_thread)
            b = self.select(sym.name, after, per_thread=per_thread)
            if a.entry_point == b.entry_point:
                continue
            kind = "added" if a.entry_point is None else "removed" if b.entry_point is None else "changed"
            changes.append(Change(sym.name, kind, a, b))
        return changes


@cache
def default_registry() -> Registry:
    """The registry of every toolkit merged into headers/ (built on first use, ~5 ms)."""
    from ._header_data import PFN_TOOLKITS
    return Registry.from_typedefs(PFN_TOOLKITS)
