"""The versioned symbol registry: pure data and selection rules, no I/O.

Every driver function has one or more ABI *variants*, one per
``PFN_<name>_v<version>`` typedef in ``cudaTypedefs.h``.  The rules below
were checked against a real 580 driver for the 485 symbols of cudaTypedefs.h (CUDA 11.8-13.5):

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
* **Windows only.** A symbol its typedef header declares only under
  ``_WIN32`` (cuWGLGetDevice) has no entry on other platforms: its selection
  there is ``not_on_this_platform``.  The platform is a registry field
  (``platform=``, default ``sys.platform``), so either answer can be asked for anywhere.
* **Header aliases.** ``cuda.h`` may ``#define`` a name to another function
  (``cuGraphInstantiate`` -> ``cuGraphInstantiateWithFlags`` from 12.0).  The
  registry keeps the C name's own ABIs -- what cuGetProcAddress returns --
  and :meth:`Registry.header_alias` says what C source means by the name.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from typing import TYPE_CHECKING, NamedTuple

from .version import CudaVersion

if TYPE_CHECKING:
    from .version import VersionLike

#: Per-thread-default-stream entries exist from this version on.
PER_THREAD_MIN_VERSION = CudaVersion(7, 0)
PER_THREAD_SUFFIXES = ("_ptds", "_ptsz")
#: The platform whose driver has the Windows-only symbols (``sys.platform`` spelling).
WINDOWS = "win32"

_PFN = re.compile(r"^PFN_(\w+?)_v(\d+)(_ptds|_ptsz)?$")


class Variant(NamedTuple):
    """One ABI of one driver function.

    ``version`` introduced the ABI; ``typedef`` and ``entry`` name its
    default-stream form; ``per_thread_typedef`` is the typedef of its
    per-thread entry (None when the symbol has none); ``toolkits`` are the
    toolkits whose cudaTypedefs.h declare ``typedef``.
    """

    symbol: str
    version: CudaVersion
    typedef: str
    entry: str
    per_thread_typedef: str | None
    toolkits: tuple[str, ...]


class Symbol(NamedTuple):
    """A driver function and all its ABI variants, oldest first."""

    name: str
    variants: tuple[Variant, ...]
    per_thread_suffix: str | None   # "_ptds", "_ptsz" or None
    windows_only: bool = False      # declared only under _WIN32 (cuWGLGetDevice)
    header: str = "cudaTypedefs.h"  # the typedef header that declares it

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
NOT_ON_THIS_PLATFORM = "not_on_this_platform"  # a Windows-only symbol, elsewhere


class Selection(NamedTuple):
    """What the registry picks for one symbol at one requested version and flag."""

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


class Change(NamedTuple):
    """One symbol whose selection differs between two versions; kind is added/removed/changed."""

    name: str
    kind: str
    before: Selection
    after: Selection


class Registry(Mapping[str, Symbol]):
    """All symbols, by C name.  Each :class:`Symbol` is built on first use, so resolving
    one function does not pay for all 561.

    ``windows_only``: names that exist only when ``platform`` is Windows; ``symbol_headers``:
    the typedef header of each name (default cudaTypedefs.h); ``header_aliases``: per name,
    (version, target) spans of a header ``#define`` (target None ends one); ``platform``: the
    ``sys.platform`` the selections are for.
    """

    def __init__(self, symbol_typedefs: Mapping[str, Iterable[str]],
                 toolkits: Mapping[str, Iterable[str]] | None = None, *,
                 windows_only: Iterable[str] = (), symbol_headers: Mapping[str, str] | None = None,
                 header_aliases: Mapping[str, Iterable[tuple[VersionLike, str | None]]] | None = None,
                 platform: str = sys.platform) -> None:
        self._typedefs = {name: tuple(symbol_typedefs[name]) for name in sorted(symbol_typedefs)}
        self._toolkits = toolkits or {}
        self._windows_only = frozenset(windows_only)
        self._headers = dict(symbol_headers or {})
        self._platform = platform
        self._aliases = {name: tuple((CudaVersion.parse(v), target) for v, target in spans)
                         for name, spans in (header_aliases or {}).items()}
        self._aliased = frozenset(self._aliases)
        self._symbols: dict[str, Symbol] = {}
        self._newest: CudaVersion | None = None

    @classmethod
    def from_typedefs(cls, typedefs: Mapping[str, Iterable[str]] | Iterable[str], *,
                      windows_only: Iterable[str] = (), symbol_headers: Mapping[str, str] | None = None,
                      header_aliases: Mapping[str, Iterable[tuple[VersionLike, str | None]]] | None = None,
                      platform: str = sys.platform) -> Registry:
        """Build from PFN typedef names (optionally mapped to the toolkits declaring them); the
        keywords are the constructor's (without them no name is Windows-only or aliased)."""
        toolkits = dict(typedefs) if isinstance(typedefs, Mapping) else {n: () for n in typedefs}
        grouped: dict[str, list[str]] = {}
        for name in toolkits:
            m = _PFN.match(name)
            if m is None:
                raise ValueError(f"not a versioned PFN typedef: {name}")
            grouped.setdefault(m.group(1), []).append(name)
        registry = cls(grouped, toolkits, windows_only=windows_only, symbol_headers=symbol_headers,
                       header_aliases=header_aliases, platform=platform)
        for sym in grouped:  # validate eagerly: bad input fails here, not at first use
            registry[sym]
        return registry

    @property
    def platform(self) -> str:
        """The ``sys.platform`` whose driver the selections describe (Windows-only names need "win32")."""
        return self._platform

    def without(self, names: Iterable[str] = (), *, platform: str | None = None) -> Registry:
        """This registry less ``names``, keeping everything else it knows about the rest (Windows-only
        marks, headers, aliases; its platform unless ``platform`` is given): a handle that must
        ``declare()`` those names uses it."""
        drop = set(names)
        unknown = drop - set(self._typedefs)
        if unknown:
            raise KeyError(f"without(): the registry has no {sorted(unknown)}")
        kept = {n: t for n, t in self._typedefs.items() if n not in drop}
        return Registry(kept, self._toolkits, windows_only=self._windows_only - drop,
                        symbol_headers={n: h for n, h in self._headers.items() if n not in drop},
                        header_aliases={n: a for n, a in self._aliases.items() if n not in drop},
                        platform=self._platform if platform is None else platform)

    def _build(self, sym: str) -> Symbol:
        variants: dict[tuple[int, str], str] = {}
        for name in self._typedefs[sym]:
            m = _PFN.match(name)
            if m is None or m.group(1) != sym:
                raise ValueError(f"{name} is not a versioned PFN typedef of {sym}")
            variants[(int(m.group(2)), m.group(3) or "")] = name
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
            built.append(Variant(sym, _version(v), typedef, sym if k == 1 else f"{sym}_v{k}", pt_typedef,
                                 tuple(self._toolkits.get(typedef, ()))))
        return Symbol(sym, tuple(built), suffix, sym in self._windows_only,
                      self._headers.get(sym, Symbol._field_defaults["header"]))

    # Mapping protocol -----------------------------------------------------------------
    def __getitem__(self, name: str) -> Symbol:
        symbol = self._symbols.get(name)
        if symbol is None:
            if name not in self._typedefs:
                raise KeyError(name)
            symbol = self._symbols[name] = self._build(name)  # idempotent: a race builds equal objects
        return symbol

    def __contains__(self, name: object) -> bool:
        return name in self._typedefs

    def __iter__(self) -> Iterator[str]:
        return iter(self._typedefs)

    def __len__(self) -> int:
        return len(self._typedefs)

    # Queries ---------------------------------------------------------------------------
    @property
    def newest_version(self) -> CudaVersion:
        """The newest ABI version any symbol has: the highest version worth requesting."""
        if self._newest is None:
            self._newest = max(self[name].newest for name in self)
        return self._newest

    def select(self, name: str, version: VersionLike, *, per_thread: bool = False) -> Selection:
        """The variant and entry point of ``name`` at requested version ``version``."""
        symbol = self[name]
        requested = CudaVersion.parse(version)
        chosen = None
        for variant in symbol.variants:
            if variant.version > requested:
                break
            chosen = variant
        if chosen is None:
            availability = NOT_YET_INTRODUCED
        elif symbol.windows_only and self._platform != WINDOWS:
            availability = NOT_ON_THIS_PLATFORM
        elif per_thread and symbol.per_thread_suffix and requested < PER_THREAD_MIN_VERSION:
            availability = PER_THREAD_NEEDS_7_0
        else:
            availability = AVAILABLE
        return Selection(symbol, requested, per_thread, chosen, availability)

    def header_alias(self, name: str, version: VersionLike) -> str | None:
        """The function C source means by ``name`` when compiled against CUDA ``version``'s headers,
        when a header ``#define`` makes it another function than ``name`` (else None)."""
        requested = CudaVersion.parse(version)
        target = None
        for since, to in self._aliases.get(name, ()):
            if since > requested:
                break
            target = to
        return target

    @property
    def aliased_names(self) -> frozenset[str]:
        """Every name some toolkit's headers #define to another function."""
        return self._aliased

    def filter(self, patterns: Iterable[str] | None = None) -> list[Symbol]:
        """Symbols whose name matches any of the glob ``patterns`` (all when none given)."""
        pats = list(patterns or [])
        if not pats:
            return [self[n] for n in self]
        from fnmatch import fnmatchcase
        return [self[n] for n in self if any(fnmatchcase(n, p) for p in pats)]

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


_versions: dict[int, CudaVersion] = {}


def _version(value: int) -> CudaVersion:
    """Interned versions: a registry holds ~700 of them, mostly the same few dozen."""
    v = _versions.get(value)
    if v is None:
        v = _versions[value] = CudaVersion.from_int(value)
    return v


@cache
def default_registry() -> Registry:
    """The registry of every toolkit merged into headers/ (built on first use, ~5 ms)."""
    from ._header_data import (HEADER_ALIASES, NEWEST_VERSION, PFN_TOOLKITS, SYMBOL_HEADERS, SYMBOL_TYPEDEFS,
                               WINDOWS_ONLY)
    registry = Registry(SYMBOL_TYPEDEFS, PFN_TOOLKITS, windows_only=WINDOWS_ONLY, symbol_headers=SYMBOL_HEADERS,
                        header_aliases=HEADER_ALIASES)
    registry._newest = _version(NEWEST_VERSION)
    return registry
