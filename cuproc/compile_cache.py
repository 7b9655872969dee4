"""The disk cache of compiled code: a compilation done once is loaded from disk in every later process.

Policy
------
* **Key.**  SHA-256 over everything that decides the output, each part length-prefixed: the source,
  the program name, every ``headers=`` entry (name and contents), every include the ``#include`` lines
  reach in visit order -- the including file, the include as written, the file it resolved to and that
  file's SHA-256 (:mod:`cuproc._includes`; a system header by its path and identity, not its contents) --
  the options in order, the architecture, the output
  kind, the name expressions (a set: order and repeats do not matter) and the NVRTC build: the
  :attr:`~cuproc.nvrtc.Location.identity` of the library file (path, size, modification time, device, inode),
  finer than ``nvrtcVersion``, which says 13.0 for both 13.0.48 and 13.0.88.  So a changed header misses,
  and so does another NVRTC build or a library replaced in place, and nothing else does.  (CuPy keys on every header at once, #9664, and never
  hits for name expressions, #10173.)
* **Where.**  ``CUPROC_NVRTC_CACHE_DIR``, else the user's cache directory as platformdirs' ``user_cache_dir``
  has it (``$XDG_CACHE_HOME`` when set to an absolute path, else ``~/.cache``, on Linux; ``~/Library/Caches``
  on macOS; ``%LOCALAPPDATA%`` on Windows) plus ``cuproc/nvrtc``.  ``cache=`` of a compile overrides
  both (a directory or a :class:`CompileCache`); ``cache=False`` or ``CUPROC_NVRTC_CACHE=0`` turns it off.
  Directories are made private to the user (0700): the cache holds code that will run.
* **Writes are atomic.**  An entry is written to a temporary file beside its place and moved there with
  ``os.replace``, so a reader sees the whole old entry, the whole new one, or none; concurrent processes
  writing one key write the same bytes and the last rename wins.  No lock is taken anywhere.
* **Corruption is detected.**  An entry carries a SHA-256 of its contents and the key it was stored
  under; one that fails either check (a torn disk write, a truncated copy) is a miss, is deleted and is
  written again by the compilation that follows.
* **Only the user's own directories are trusted.**  The cache holds code that will run, so a cache
  directory, its ``entries`` folder and each shard folder must belong to this
  user (``st_uid == os.geteuid()``) and not be writable by group or others, checked on first use in a
  process (on Windows, which has neither, this is left to the ACLs).  One that is not warns once
  (RuntimeWarning) and the compile goes on without the cache.  A folder not made yet passes: cuproc makes
  it private.
* **Never fails a compile.**  A cache directory that cannot be written warns once
  (RuntimeWarning) and the compile goes on without storing; a ``CUPROC_NVRTC_CACHE_SIZE`` that is not
  a size (``inf``, ``lots``) warns once and the default limit holds.
* **Size.**  At most ``max_bytes`` (``CUPROC_NVRTC_CACHE_SIZE``, e.g. ``512M``; default 1 GiB): after a
  write that takes the total above it, the least recently used entries go (a hit refreshes the entry's
  modification time) until the total is below 90 % of it.  Temporary files abandoned by killed
  processes go after an hour.
* **A hit opens no NVRTC.**  Opening the 140 MB library costs 10-15 ms, more than a hit may.  The key
  holds the identity of the NVRTC file that would be opened (a ``stat``, no reading), and the entry the
  NVRTC version that made it, so a hit in a fresh process neither opens nor reads the library.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time

from ._env import OFF, ON

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import Any

ENV_DIR = "CUPROC_NVRTC_CACHE_DIR"
ENV_SWITCH = "CUPROC_NVRTC_CACHE"
ENV_SIZE = "CUPROC_NVRTC_CACHE_SIZE"
DEFAULT_MAX_BYTES = 1 << 30
KEY_FORMAT = b"cuproc-nvrtc-key-3"   # bump when what goes into a key changes
_MAGIC = b"CUPROC-NVRTC-ENTRY-1\n"
_DIGEST_SIZE = 32
_STALE_TEMP_SECONDS = 3600
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def user_cache_dir(app: str = "cuproc") -> str:
    """The user's cache directory for ``app``, by platformdirs' rule (``user_cache_dir(app, appauthor=False)``),
    without depending on platformdirs."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.join(os.path.expanduser("~"), "AppData", "Local")
        return os.path.join(base, app, "Cache")
    if sys.platform == "darwin":
        return os.path.join(os.path.expanduser("~/Library/Caches"), app)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = xdg if os.path.isabs(xdg) else os.path.expanduser("~/.cache")   # the XDG spec ignores a relative value
    return os.path.join(base, app)


def default_directory() -> str:
    """``CUPROC_NVRTC_CACHE_DIR``, else :func:`user_cache_dir` ``/nvrtc``."""
    return os.environ.get(ENV_DIR) or os.path.join(user_cache_dir(), "nvrtc")


def enabled_by_environment() -> bool:
    """False when ``CUPROC_NVRTC_CACHE`` says off; a value that is neither on nor off is a ValueError
    naming the variable (a typo must not silently pick a side)."""
    text = os.environ.get(ENV_SWITCH, "").strip().lower()
    if text in ON or text == "":
        return True
    if text in OFF:
        return False
    raise ValueError(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]!r}: expected one of {', '.join(sorted(ON))} (cache "
                     f"compiled code) or {', '.join(sorted(OFF - {''}))} (compile every time), or unset it")


def parse_size(text: str) -> int:
    """``"512M"``, ``"2G"``, ``"1048576"`` -> bytes (K, M, G, T are powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS and not t[-1:].isdigit() else ""
    number = t[:-1] if unit else t
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        value = math.nan
    if not math.isfinite(value):   # "inf", "nan", "1e999": no size (int() of them is not even a ValueError)
        raise ValueError(f"not a size: {text!r} (expected bytes, or a number with K, M, G or T)")
    if value < 1:
        raise ValueError(f"a cache size must be positive, got {text!r}")
    return int(value)


def size_from_environment() -> int:
    """``CUPROC_NVRTC_CACHE_SIZE`` in bytes, else :data:`DEFAULT_MAX_BYTES`.  A value that is not a size
    warns (once per value) and gives the default: the limit tunes the cache, and a typo in it must not
    fail every compile."""
    text = os.environ.get(ENV_SIZE, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        return parse_size(text)
    except ValueError as exc:
        if text not in _warned:
            _warned.add(text)
            import warnings
            warnings.warn(f"{ENV_SIZE}={text!r} ignored, the cache keeps its default limit of "
                          f"{DEFAULT_MAX_BYTES >> 20} MiB: {exc}", RuntimeWarning, stacklevel=3)
        return DEFAULT_MAX_BYTES


_warned: set[object] = set()   # bad sizes, unwritable and untrusted directories already warned about


def warn_unwritable(cache: CompileCache, exc: OSError) -> None:
    """Warn, once per directory, that ``cache`` could not store a compilation (the compile went on)."""
    if cache.directory not in _warned:
        _warned.add(cache.directory)
        import warnings
        warnings.warn(f"the NVRTC compile cache in {cache.directory} is not writable ({exc}): compiling "
                      f"without storing; set {ENV_DIR} to a writable directory, or {ENV_SWITCH}=0",
                      RuntimeWarning, stacklevel=3)


_trusted_dirs: set[str] = set()   # directories found to be the user's own and private, this process


def _untrusted(path: str) -> str | None:
    """Why the directory ``path`` must not be trusted (another user's, or writable by group or others), or
    None: it is the user's and private (remembered for the process), or it does not exist yet."""
    if path in _trusted_dirs or not hasattr(os, "geteuid"):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None   # not there (yet): made private when it is made; an unreadable one fails on use
    me = os.geteuid()
    if st.st_uid != me:
        return f"{path} belongs to user {st.st_uid}, not to this user ({me})"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})"
    _trusted_dirs.add(path)
    return None


def warn_untrusted(cache: CompileCache, reason: str) -> None:
    """Warn, once per directory, that ``cache`` is not used because ``reason`` (the compile goes on)."""
    if ("untrusted", cache.directory) not in _warned:
        _warned.add(("untrusted", cache.directory))
        import warnings
        warnings.warn(f"the NVRTC compile cache in {cache.directory} is not used: {reason}, so others could "
                      f"plant code in it; compiling without the cache. Make it yours and private (chmod "
                      f"go-w), or set {ENV_DIR} to a private directory, or {ENV_SWITCH}=0",
                      RuntimeWarning, stacklevel=4)


def _hash_parts(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256(KEY_FORMAT)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def cache_key(*, source: bytes, name: str, headers: Mapping[str, bytes],
              included: Iterable[tuple[str, str, str, str]], options: Iterable[str], arch: str, kind: str,
              name_expressions: Iterable[str], nvrtc_identity: str) -> str:
    """The key of one compilation (see the module's policy).  ``included``: every include in visit order
    as (including file, include as written, the file it resolved to, that file's digest), as
    :attr:`cuproc._includes.Closure.edges` lists them: which name resolved to which contents counts, not
    only which contents were read.  ``nvrtc_identity``: the compiling NVRTC's build
    (:attr:`cuproc.nvrtc.NvrtcLibrary.identity`, or :attr:`cuproc.nvrtc.Location.identity` of the file
    that would be opened)."""
    parts: list[bytes] = [b"source", source, b"name", name.encode()]
    for header in sorted(headers):
        parts += [b"header", header.encode(), headers[header]]
    for edge in included:
        parts += [b"included", *map(os.fsencode, edge)]
    parts += [b"options", *(o.encode() for o in options), b"arch", arch.encode(), b"kind", kind.encode()]
    parts += [b"names", *sorted({n.encode() for n in name_expressions})]
    parts += [b"nvrtc", os.fsencode(nvrtc_identity)]   # a path; not .encode(errors=...): its first look-up is slow
    return _hash_parts(parts)


class CacheEntry:
    """One stored compilation: ``code`` and what was known about it (``meta``: kind, arch, log, lowered
    names, NVRTC version, ...: plain JSON values)."""

    __slots__ = ("code", "meta")

    def __init__(self, code: bytes, meta: dict[str, Any]) -> None:
        self.code, self.meta = code, meta


class CompileCache:
    """Compiled code on disk under ``directory`` (default :func:`default_directory`), at most ``max_bytes``.

    Safe to share between threads and processes; see the module's policy.  ``stats`` counts this
    object's hits, misses, stores, corrupt entries removed and entries evicted."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, max_bytes: int | None = None) -> None:
        self.directory = os.path.abspath(os.fspath(directory) if directory is not None else default_directory())
        if max_bytes is None:
            max_bytes = size_from_environment()
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stats = {"hits": 0, "misses": 0, "stores": 0, "corrupt": 0, "evicted": 0}

    def __repr__(self) -> str:
        return f"<cuproc.CompileCache {self.directory} max {self.max_bytes} bytes>"

    # ---------------------------------------------------------------- layout
    @property
    def entries_dir(self) -> str:
        return os.path.join(self.directory, "entries")

    def path_of(self, key: str) -> str:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"not a cache key: {key!r} (64 lowercase hex digits)")
        return os.path.join(self.entries_dir, key[:2], key)

    def _make_dirs(self, path: str) -> None:
        """``path`` (under the cache directory) and every directory on the way, private to the user."""
        if not os.path.isdir(path):
            rel = os.path.relpath(path, self.directory)
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            where = self.directory
            for part in rel.split(os.sep):
                where = os.path.join(where, part)
                os.makedirs(where, mode=0o700, exist_ok=True)

    def distrust(self, key: str | None = None) -> str | None:
        """Why this cache must not be used -- a folder of it (the directory, ``entries`` and ``key``'s
        shard) is another user's or writable by group or others -- or None (see the module's policy).
        Warns once per directory when there is a reason."""
        dirs = [self.directory, self.entries_dir]
        if key is not None:
            dirs.append(os.path.dirname(self.path_of(key)))
        for path in dirs:
            reason = _untrusted(path)
            if reason is not None:
                warn_untrusted(self, reason)
                return reason
        return None

    # ---------------------------------------------------------------- entries
    def get(self, key: str) -> CacheEntry | None:
        """The entry stored under ``key``, or None (also for a corrupt one, which is deleted, and in a
        cache that is not trusted: :meth:`distrust`)."""
        path = self.path_of(key)
        if self.distrust(key) is not None:
            self.stats["misses"] += 1
            return None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            self.stats["misses"] += 1
            return None
        entry = _decode(data, key)
        if entry is None:
            self.stats["corrupt"] += 1
            self.stats["misses"] += 1
            _remove(path)
            return None
        self.stats["hits"] += 1
        try:
            os.utime(path)   # least recently *used* goes first
        except OSError:
            pass             # a read-only cache still serves
        return entry

    def put(self, key: str, entry: CacheEntry) -> None:
        """Store ``entry`` under ``key`` atomically, then evict down to the size limit.  An entry larger
        than the whole limit is not stored."""
        data = _encode(key, entry)
        if len(data) > self.max_bytes or self.distrust(key) is not None:
            return
        path = self.path_of(key)
        self._write_atomically(path, data)
        self.stats["stores"] += 1
        self.evict(keep=path)

    def entries(self) -> list[tuple[str, int, int]]:
        """(path, size, modification time in ns) of every stored entry and temporary file."""
        out = []
        try:
            shards = os.scandir(self.entries_dir)
        except OSError:
            return []
        with shards:
            for shard in shards:
                if not shard.is_dir(follow_symlinks=False):
                    continue
                try:
                    with os.scandir(shard.path) as files:
                        for f in files:
                            try:
                                st = f.stat(follow_symlinks=False)
                            except OSError:
                                continue   # removed by another process meanwhile
                            out.append((f.path, st.st_size, st.st_mtime_ns))
                except OSError:
                    continue
        return out

    def size(self) -> int:
        """Bytes the entries take (file sizes)."""
        return sum(size for _, size, _ in self.entries())

    def evict(self, *, keep: str | None = None) -> None:
        """Delete least recently used entries until the total is below 90 % of ``max_bytes`` (only when it
        is above ``max_bytes``), and temporary files older than an hour."""
        files = self.entries()
        now = time.time_ns()
        total = 0
        live = []
        for path, size, mtime in files:
            if os.path.basename(path).startswith(".tmp-"):
                if now - mtime > _STALE_TEMP_SECONDS * 10**9:
                    _remove(path)
                continue
            total += size
            live.append((mtime, path, size))
        if total <= self.max_bytes:
            return
        target = self.max_bytes * 9 // 10
        for _, path, size in sorted(live):
            if total <= target:
                break
            if path == keep:
                continue
            if _remove(path):
                self.stats["evicted"] += 1
            total -= size   # gone either way: removed here, or by another process that evicts too

    def clear(self) -> None:
        """Delete every entry."""
        for path, _, _ in self.entries():
            _remove(path)

    def _write_atomically(self, path: str, data: bytes) -> None:
        """``data`` at ``path`` (under the cache directory): written to a temporary file beside it, then
        moved there with ``os.replace`` (see the module's policy)."""
        directory = os.path.dirname(path)
        self._make_dirs(directory)
        import tempfile   # here: a hit never writes, and the module costs a fresh process milliseconds
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise


def _encode(key: str, entry: CacheEntry) -> bytes:
    meta = json.dumps({**entry.meta, "key": key}, sort_keys=True, separators=(",", ":")).encode()
    body = len(meta).to_bytes(8, "little") + meta + entry.code
    return _MAGIC + hashlib.sha256(body).digest() + body


def _decode(data: bytes, key: str) -> CacheEntry | None:
    """The entry in ``data``, or None when it is damaged, not an entry, or stored under another key."""
    start = len(_MAGIC) + _DIGEST_SIZE
    if not data.startswith(_MAGIC) or len(data) < start + 8:
        return None
    body = memoryview(data)[start:]
    if hashlib.sha256(body).digest() != data[len(_MAGIC):start]:
        return None
    size = int.from_bytes(body[:8], "little")
    try:
        meta = json.loads(bytes(body[8:8 + size]).decode())   # str: json.loads(bytes) first guesses the codec
    except ValueError:   # UnicodeDecodeError included
        return None
    if not isinstance(meta, dict) or meta.pop("key", None) != key:
        return None
    return CacheEntry(bytes(body[8 + size:]), meta)


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def resolve(cache: CompileCache | str | os.PathLike[str] | bool | None) -> CompileCache | None:
    """The cache a compile uses: ``None`` (the default: :func:`default_directory`, unless
    ``CUPROC_NVRTC_CACHE`` is off), ``False`` (none), ``True`` (the default even when the variable says
    off), a directory, or a :class:`CompileCache`."""
    if cache is None:
        return _default() if enabled_by_environment() else None
    if cache is False:
        return None
    if cache is True:
        return _default()
    if isinstance(cache, CompileCache):
        return cache
    if isinstance(cache, (str, os.PathLike)):
        return CompileCache(cache)
    raise TypeError(f"cache= takes None, True, False, a directory or a CompileCache, not {type(cache).__name__}")


_defaults: dict[tuple[str, str], CompileCache] = {}


def _default() -> CompileCache:
    """One default cache per directory and size setting (so its stats add up across compiles)."""
    key = (default_directory(), os.environ.get(ENV_SIZE, ""))
    found = _defaults.get(key)
    if found is None:
        found = _defaults[key] = CompileCache(key[0])
    return found


__all__ = ["CacheEntry", "CompileCache", "DEFAULT_MAX_BYTES", "ENV_DIR", "ENV_SIZE", "ENV_SWITCH", "cache_key",
           "default_directory", "enabled_by_environment", "parse_size", "resolve", "size_from_environment",
           "user_cache_dir", "warn_unwritable", "warn_untrusted"]
