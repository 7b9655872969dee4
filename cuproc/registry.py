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
* **Tables.** :meth:`Registry.entries` is every symbol's selection at one
  (version, flag) as plain :class:`Entry` rows, built once per pair and kept:
  ``Driver.preload`` walks it instead of building 561 Symbols and Selections.
  Entries, :class:`Symbol` and :meth:`Registry.select` come from one parse
  function of the typedef names and one selection rule (``_row``), so they cannot
  disagree; a table takes the 400 one-typedef symbols straight from their names,
  the same rule for one ABI, since a fresh ``preload()`` pays for every row.
* **Header aliases.** ``cuda.h`` may ``#define`` a name to another function
  (``cuGraphInstantiate`` -> ``cuGraphInstantiateWithFlags`` from 12.0).  The
  registry keeps the C name's own ABIs -- what cuGetProcAddress returns --
  and :meth:`Registry.header_alias` says what C source means by the name.
"""
from __future__ import annotations

import itertools
import sys

# collections.abc re-exports this module; importing it by that name runs the collections package's
# __init__, about 1.5 ms of a fresh process's startup that a first allocation does not need (issue 9).
from _collections_abc import Mapping

from ._namedtuple import NamedTuple
from .version import CudaVersion

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from .version import VersionLike

#: Per-thread-default-stream entries exist from this version on.
PER_THREAD_MIN_VERSION = CudaVersion(7, 0)
PER_THREAD_SUFFIXES = ("_ptds", "_ptsz")
_PER_THREAD_MIN_KEY = int(PER_THREAD_MIN_VERSION)
# NamedTuple rows made in bulk (561 per table) skip the generated __new__'s argument binding, as _make does.
_new = tuple.__new__
#: The platform whose driver has the Windows-only symbols (``sys.platform`` spelling).
WINDOWS = "win32"

# A versioned PFN typedef name (Registry.from_typedefs; compiled by re there: no re at startup, see driver.py)


class Feature(NamedTuple):
    """Something a function gained at a CUDA version without a new ABI (a new value of a field it already
    took): no typedef tells it, so the registry lists it (:data:`FEATURES`)."""

    introduced: CudaVersion
    what: str


#: name -> :class:`Feature`, asked through ``Driver.has_feature(name)``: like a symbol introduced after the
#: requested version, a feature newer than it is not taken (its behaviour is not the requested version's).
FEATURES: dict[str, Feature] = {
    "conditional_if_else": Feature(CudaVersion(12, 8), "an IF conditional node with an ELSE body (cuGraphAddNode, "
                                                       "CUDA_CONDITIONAL_NODE_PARAMS.size 2)"),
    "conditional_switch": Feature(CudaVersion(12, 8), "a SWITCH conditional node (cuGraphAddNode, "
                                                      "CU_GRAPH_COND_TYPE_SWITCH)"),
}

_PFN = r"^PFN_(\w+?)_v(\d+)(_ptds|_ptsz)?$"


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
    def entry_point(self) -> str | None:
        return self._abi()[0]

    @property
    def typedef(self) -> str | None:
        return self._abi()[1]

    @property
    def query_version(self) -> CudaVersion | None:
        """The version to pass to cuGetProcAddress for exactly this entry."""
        return self._abi()[2]

    def _abi(self) -> tuple[str | None, str | None, CudaVersion | None]:
        if not self.exists:
            return None, None, None
        v = self.variant
        assert v is not None   # exists
        entry, typedef, query = _entry_of(v.entry, v.typedef, v.per_thread_typedef, int(v.version),
                                          self.symbol.per_thread_suffix if self.per_thread else None)
        return entry, typedef, interned_version(query)


def _entry_of(entry: str, typedef: str, per_thread_typedef: str | None, version: int,
              suffix: str | None) -> tuple[str, str, int]:
    """(entry point, typedef, query version as the driver's integer) of an available variant;
    ``suffix`` is the per-thread suffix when the per-thread entry is wanted (and the symbol has
    one), else None.  The one rule behind :class:`Selection` and :meth:`Registry.entries`."""
    if suffix is None:
        return entry, typedef, version
    return entry + suffix, per_thread_typedef or typedef, max(version, _PER_THREAD_MIN_KEY)


class Entry(NamedTuple):
    """One symbol's selection at one requested version and flag, as the few plain values resolving
    it needs (:meth:`Registry.entries`): the same answers as :class:`Selection`'s properties, with
    versions as the driver's integers (12040), which cuGetProcAddress takes and which compare in C."""

    availability: str
    entry_point: str | None
    typedef: str | None
    query_version: int | None
    abi_version: int | None   # the selected variant's own version (None when none is selected)
    introduced: int


class _Abis(NamedTuple):
    """A symbol's typedef names parsed, oldest ABI first: what both :class:`Symbol` and :class:`Entry`
    are made from.  An ABI's entry name and per-thread typedef are worked out when asked for
    (:func:`_entry_name`, :func:`_per_thread_typedef`): a selection table needs only the selected one's."""

    keys: tuple[int, ...]               # the default-stream ABI versions as the driver's integers
    typedefs: tuple[str, ...]           # their typedefs
    per_thread: tuple[tuple[int, str], ...]   # (version, typedef) of each per-thread typedef, newest first
    suffix: str | None
    windows_only: bool


def _entry_name(sym: str, index: int) -> str:
    """The library entry of a symbol's ``index``-th ABI (oldest 0): ``sym``, then ``sym_v2``, ``sym_v3``..."""
    return sym if index == 0 else f"{sym}_v{index + 1}"


def _per_thread_typedef(abis: _Abis, index: int) -> str:
    """The typedef of the ``index``-th ABI's per-thread entry (the symbol has one).  Per-thread typedefs
    may carry their own version (PFN_cuMemcpyHtoD_v7000_ptds serves the 3020 ABI): the newest one the
    per-thread query, asked at max(ABI, 7.0), can reach and the ABI does not exceed; else the ABI's own."""
    version = abis.keys[index]
    reach = max(version, _PER_THREAD_MIN_KEY)
    for own, typedef in abis.per_thread:   # newest first: the first within reach is the newest
        if own <= reach:
            return typedef if own >= version else abis.typedefs[index]
    return abis.typedefs[index]


def _row(sym: str, abis: _Abis, requested: int, per_thread: bool, platform: str) -> Entry:
    """The selection rule: what R (the driver's integer) selects of ``sym``'s ABIs under the flag on
    ``platform``.  The variant with the greatest version <= R; none: not yet introduced.  A Windows-only
    symbol elsewhere is not on this platform; a per-thread entry below 7.0 does not exist; else it is
    available, with :func:`_entry_of`'s entry point, typedef and query version."""
    keys = abis.keys
    chosen = -1   # the index of the greatest key <= R (keys ascend; bisect would cost import cuproc 0.2 ms)
    for key in keys:
        if key > requested:
            break
        chosen += 1
    if chosen < 0:
        return _new(Entry, (NOT_YET_INTRODUCED, None, None, None, None, keys[0]))
    abi = keys[chosen]
    if abis.windows_only and platform != WINDOWS:
        return _new(Entry, (NOT_ON_THIS_PLATFORM, None, None, None, abi, keys[0]))
    suffix = abis.suffix if per_thread else None
    if suffix is None:
        return _new(Entry, (AVAILABLE, _entry_name(sym, chosen), abis.typedefs[chosen], abi, abi, keys[0]))
    if requested < _PER_THREAD_MIN_KEY:
        return _new(Entry, (PER_THREAD_NEEDS_7_0, None, None, None, abi, keys[0]))
    entry, typedef, query = _entry_of(_entry_name(sym, chosen), abis.typedefs[chosen],
                                      _per_thread_typedef(abis, chosen), abi, suffix)
    return _new(Entry, (AVAILABLE, entry, typedef, query, abi, keys[0]))


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
        # Each symbol's versions as parsed_typedefs reads its names, in the order of the sorted names: an
        # int for one name, else (n, n versions, per-thread versions).  Only default_registry() sets it,
        # from the generated SYMBOL_ABI_KEYS (tests/test_registry.py checks them against the names);
        # selection tables take them instead of the names.  Flat tuples, no dict: the header data is
        # imported on the way to a first call.
        self._abi_keys: tuple[int | tuple[int, ...], ...] | None = None
        self._toolkits = {} if toolkits is None else toolkits   # not "or": a table read late stays unread
        self._windows_only = frozenset(windows_only)
        self._headers = dict(symbol_headers or {})
        self._platform = platform
        self._aliases = {name: tuple((CudaVersion.parse(v), target) for v, target in spans)
                         for name, spans in (header_aliases or {}).items()}
        self._aliased = frozenset(self._aliases)
        self._symbols: dict[str, Symbol] = {}
        self._abis: dict[str, _Abis] = {}
        self._tables: dict[tuple[CudaVersion, bool], dict[str, Entry]] = {}
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
        import re
        for name in toolkits:
            m = re.match(_PFN, name)
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

    def _parse(self, sym: str) -> _Abis:
        """The ABIs of ``sym`` from its typedef names (cached; a race stores equal tuples)."""
        abis = self._abis.get(sym)
        if abis is None:
            abis = self._abis[sym] = _parse_typedefs(sym, self._typedefs[sym], sym in self._windows_only)
        return abis

    def _build(self, sym: str) -> Symbol:
        abis = self._parse(sym)
        toolkits = self._toolkits
        built = tuple(Variant(sym, interned_version(key), typedef, _entry_name(sym, i),
                              _per_thread_typedef(abis, i) if abis.suffix else None,
                              tuple(toolkits.get(typedef, ())))
                      for i, (key, typedef) in enumerate(zip(abis.keys, abis.typedefs)))
        return Symbol(sym, built, abis.suffix, abis.windows_only,
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
        abis = self._parse(name)
        row = _row(name, abis, int(requested), per_thread, self._platform)
        variant = None if row.abi_version is None else symbol.variants[abis.keys.index(row.abi_version)]
        return Selection(symbol, requested, per_thread, variant, row.availability)

    def entry(self, name: str, version: VersionLike, *, per_thread: bool = False) -> Entry:
        """``select(name, version, per_thread=...)`` as an :class:`Entry` (no Symbol is built)."""
        if name not in self._typedefs:
            raise KeyError(name)
        return _row(name, self._parse(name), int(CudaVersion.parse(version)), per_thread, self._platform)

    def entries(self, version: VersionLike, *, per_thread: bool = False) -> Mapping[str, Entry]:
        """Every symbol's :class:`Entry` at ``version`` and flag, in registry order: one table per
        (version, flag), built on first use and kept (what ``Driver.preload`` walks)."""
        requested = CudaVersion.parse(version)
        key = (requested, bool(per_thread))
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self._table(int(requested), bool(per_thread))
        return table

    def _table(self, requested: int, per_thread: bool) -> dict[str, Entry]:
        """Every symbol's :class:`Entry` at R (the driver's integer) in one pass over the typedef names.

        A symbol with one typedef spelt ``PFN_<name>_v<digits>`` (400 of 561) has one ABI and no
        per-thread entry, so its row comes straight from that name, with no _Abis made: :func:`_row`
        with one key and no suffix (not yet introduced above R, else off-platform or available, its own
        name the entry).  Every other symbol, or a name not spelt so, is parsed (which raises for a
        malformed one) and takes :func:`_row`.  The default registry reads neither: ``_abi_keys`` has
        every symbol's versions, read when headers/ were compiled (the names' parse was ~0.3 ms of a
        fresh preload()).  Parses are not kept: ~800 more long-lived tuples would cost a fresh
        process a second young-generation garbage collection inside preload() (~0.1 ms), and a
        Symbol or select() parses its name again in ~1 us."""
        table: dict[str, Entry] = {}
        platform, windows_only, cache, known_key = self._platform, self._windows_only, self._abis, _version_keys.get
        off_platform = windows_only if platform != WINDOWS else frozenset()
        abi_keys = self._abi_keys
        for (sym, typedefs), known in zip(self._typedefs.items(), abi_keys if abi_keys is not None else _NONE):
            if known is None and len(typedefs) == 1:
                name = typedefs[0]
                digits = name[len(sym) + 6:]
                known = known_key(digits)
                if known is None:
                    known = _version_key(digits)
                if known is None or name != f"PFN_{sym}_v{digits}":
                    known = None   # not spelt so: parsed below, which says what is wrong
            if known.__class__ is int:   # one ABI, no per-thread entry
                abi = known
                table[sym] = _new(Entry, (
                    (NOT_YET_INTRODUCED, None, None, None, None, abi) if abi > requested else   # type: ignore[operator]
                    (NOT_ON_THIS_PLATFORM, None, None, None, abi, abi) if sym in off_platform else
                    (AVAILABLE, sym, typedefs[0], abi, abi, abi)))
                continue
            abis = cache.get(sym)
            if abis is None:
                if known is None:
                    abis = _parse_typedefs(sym, typedefs, sym in windows_only)
                else:   # the versions read when headers/ were compiled: the names need no parse
                    abis = _abis_of_keys(known, typedefs, sym in windows_only)   # type: ignore[arg-type]
            table[sym] = _row(sym, abis, requested, per_thread, platform)
        return table

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


def parsed_typedefs(sym: str, typedefs: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...],
                                                                   tuple[tuple[int, str], ...], str | None]:
    """``sym``'s typedef names parsed, as plain tuples: (default-stream ABI versions oldest first, their
    typedefs, ((version, per-thread typedef), ...) newest first, the per-thread suffix or None); a malformed
    name raises ValueError naming it.  tools/build_ffi.py stores the versions it gives for the default
    registry (``_header_data.SYMBOL_ABI_KEYS``), which selection tables read instead of parsing."""
    keys, names, per_thread, suffix, _ = _parse_typedefs(sym, typedefs, False)
    return keys, names, per_thread, suffix


def _abis_of_keys(known: tuple[int, ...], typedefs: tuple[str, ...], windows_only: bool) -> _Abis:
    """What :func:`_parse_typedefs` gives for names listed in the one-pass order, from their versions as
    the generated SYMBOL_ABI_KEYS holds them: (n, n default-stream versions, the per-thread ones)."""
    n = known[0]
    per_thread = known[n + 1:]
    return _new(_Abis, (known[1:n + 1], typedefs[:n], tuple(zip(per_thread, typedefs[n:])),
                        typedefs[-1][-5:] if per_thread else None, windows_only))


def _parse_typedefs(sym: str, typedefs: tuple[str, ...], windows_only: bool) -> _Abis:
    """The ABIs of ``sym`` from its typedef names (a malformed one raises ValueError naming it): string
    operations, no regex, since every selection table parses the 161 symbols with several typedefs.
    Names listed oldest default-stream ABI first and per-thread ones after, newest first (as
    _header_data lists them), are taken in one pass; any other order is sorted (a repeated version:
    the last one listed)."""
    prefix = f"PFN_{sym}_v"
    start = len(prefix)
    known_key = _version_keys.get
    if len(typedefs) == 1:   # most symbols: one ABI, no per-thread entry
        key = known_key(typedefs[0][start:])
        if key is not None and typedefs[0].startswith(prefix):
            return _new(_Abis, ((key,), typedefs, (), None, windows_only))
    keys: list[int] = []
    base: list[str] = []
    per_thread: list[tuple[int, str]] = []
    suffix: str | None = None
    ordered = True
    for name in typedefs:
        own = name[-5:]
        per_thread_name = own in PER_THREAD_SUFFIXES
        digits = name[start:-5] if per_thread_name else name[start:]
        key = known_key(digits)
        if key is None or not name.startswith(prefix):
            key = _version_key(digits)
            if key is None or not name.startswith(prefix):
                raise ValueError(f"{name} is not a versioned PFN typedef of {sym}")
        if not per_thread_name:
            if per_thread or (keys and key <= keys[-1]):
                ordered = False
            keys.append(key)
            base.append(name)
            continue
        if suffix is not None and own != suffix:
            raise ValueError(f"{sym} has both per-thread suffixes {sorted((suffix, own))}")
        suffix = own
        if per_thread and key >= per_thread[-1][0]:
            ordered = False
        per_thread.append((key, name))
    if not keys:
        raise ValueError(f"{sym} has per-thread typedefs but no default-stream one")
    if not ordered:
        by_key = dict(zip(keys, base))
        keys = sorted(by_key)
        base = [by_key[key] for key in keys]
        per_thread = sorted(dict(per_thread).items(), reverse=True)
    return _new(_Abis, (tuple(keys), tuple(base), tuple(per_thread), suffix, windows_only))


_NONE = itertools.repeat(None)   # no versions given: every symbol's names are read

#: The driver integer of each version spelling a typedef name has had ("12050" -> 12050): a few dozen,
#: looked up instead of checked and converted again for each of ~960 names in a selection table.
_version_keys: dict[str, int] = {}


def _version_key(digits: str) -> int | None:
    """The integer of the version digits of a typedef name (remembered), or None when they are not
    ASCII digits."""
    if not (digits.isdigit() and digits.isascii()):
        return None
    key = _version_keys[digits] = int(digits)
    return key


_versions: dict[int, CudaVersion] = {}


def interned_version(value: int) -> CudaVersion:
    """The CudaVersion of a driver integer, one object per value: a registry holds ~700 versions,
    mostly the same few dozen, and :class:`Entry` rows carry the integers."""
    v = _versions.get(value)
    if v is None:
        v = _versions[value] = CudaVersion.from_int(value)
    return v


class _ToolkitsOnFirstRead(Mapping[str, tuple[str, ...]]):
    """The default registry's typedef -> toolkits table, imported when first read.

    Why: only :class:`Symbol` rows read it (``registry[name]``, ``dump_symbols``), never a
    resolution, and importing it cost as much as the rest of the header data together: a process's
    first driver call should not pay for it (issue 9's startup goal)."""

    _loaded: Mapping[str, tuple[str, ...]] | None = None

    def _table(self) -> Mapping[str, tuple[str, ...]]:
        table = self._loaded
        if table is None:       # two threads may both import: the module lock makes it one module
            from ._header_toolkits import PFN_TOOLKITS
            table = self._loaded = PFN_TOOLKITS
        return table

    def __getitem__(self, typedef: str) -> tuple[str, ...]:
        return self._table()[typedef]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


_default: list[Registry] = []   # default_registry()'s (functools.cache would import functools at startup)


def default_registry() -> Registry:
    """The registry of every toolkit merged into headers/ (built on first use, ~5 ms; one for the
    process: threads that race to build it may each build one, and all of them get the first)."""
    if _default:
        return _default[0]
    from ._header_data import (HEADER_ALIASES, NEWEST_VERSION, SYMBOL_ABI_KEYS, SYMBOL_HEADERS, SYMBOL_TYPEDEFS,
                               WINDOWS_ONLY)
    registry = Registry(SYMBOL_TYPEDEFS, _ToolkitsOnFirstRead(), windows_only=WINDOWS_ONLY,
                        symbol_headers=SYMBOL_HEADERS, header_aliases=HEADER_ALIASES)
    if len(SYMBOL_ABI_KEYS) == len(SYMBOL_TYPEDEFS):   # else a half-regenerated checkout: the names decide
        registry._abi_keys = SYMBOL_ABI_KEYS
    registry._newest = interned_version(NEWEST_VERSION)
    _default.append(registry)
    return _default[0]
