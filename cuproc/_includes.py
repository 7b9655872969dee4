"""Which files on disk a compilation reads: the ``#include`` graph that the compile cache keys on.

Why: NVRTC reports no dependencies (it has no ``-MD``), yet a program that includes a file from disk
must miss the cache when that file changes.  So cuproc follows the includes itself, with NVRTC's own
search rules (checked against NVRTC 13.5):

* a name given in ``headers={...}`` wins, for ``"x"`` and ``<x>`` alike (its contents are in the key);
* ``#include "x"`` then looks in the including file's directory -- for the program itself and for
  the ``headers`` entries that is the directory of their name, relative to the current directory --
  then in each ``-I`` directory in order;
* ``#include <x>`` looks only in the ``-I`` directories;
* ``-include f`` (``--pre-include``) is looked for in the current directory, then in each ``-I``
  directory (not in the program's directory);
* a path is resolved as the file system resolves it (``link/../x.h`` is beside link's target), never
  normalized as text; a quoted include in a header reached through a symlink looks beside the link;
* ``"-I sub"`` as one option is ``sub/`` (:func:`include_dirs` says how NVRTC trims option values);
* a name found nowhere is NVRTC's built-in header (``cuda_fp16.h``, versioned with NVRTC, which the key
  holds) or a compile error (which is never cached).

What is recorded
----------------
:attr:`Closure.edges` lists every include in the order it is visited: the including file, the include
as written (``"x"`` or ``<x>``), the file it resolved to and that file's SHA-256.  The key holds all four,
so two headers that swap contents, or one name that resolves to another file, miss.  (Paths are in the
key: a tree that moves misses once.)

How lines are read
------------------
Comments are removed first (``//``, ``/* */``, and backslash-newline splices), so ``#include /* c */
"a.h"`` is followed and an include inside a comment is not.  ``#`` and the digraph ``%:`` both start a
directive.  An include inside ``#if 0`` still counts: a file that might be read is tracked, at worst
missing once more than needed.  Any ``#include``-like line that does not parse as ``"x"`` or ``<x>``
after that -- ``#include HEADER`` (a macro), ``#include_next``, ``#import`` -- cannot be followed:
:attr:`Closure.untracked` names it and the cache stays off for that compilation.

System headers
--------------
A file found under the ``include`` directory of a CUDA toolkit (``CUDA_HOME``, ``CUDA_PATH``,
``/usr/local/cuda``, ``/usr/local/cuda-*``) or of an NVIDIA wheel (``nvidia/*/include`` in a ``sys.path``
entry, where the NVRTC and CCCL wheels put theirs) is a *system header*: it is keyed by its path and its
file identity (inode, size, modification and change times; with the toolkit's ``version.json`` when it
has one), next to the NVRTC version that every key holds, and it is *not* opened or followed.  So CCCL
(``<cub/cub.cuh>``: 600 files, and computed includes such as ``#include __THRUST_HOST_SYSTEM_TAG_HEADER``
that no reader can follow) neither turns the cache off nor costs a walk.  The price: a system header
edited in place, behind the one the program names, is not seen; toolkits and wheels are replaced, not
edited.  Headers anywhere else (the program's, the user's ``-I`` directories) are followed and hashed
in full.

Files are hashed once per process while their identity (device, inode, size, modification and change
times) stays the same and their modification time was more than 2 s old when they were read (as ccache
does: a file written within a coarse timestamp's tick of being read may change again without its
modification time moving).  Only the digest and the includes are remembered, never the text.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import stat
import sys
import time

from . import _fork

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

# A directive: '#' or the digraph '%:', then 'include' and the rest of the line (comments already removed).
_DIRECTIVE = re.compile(rb'^[ \t]*(?:#|%:)[ \t]*(include_next|include|import)(?![A-Za-z0-9_])[ \t]*([^\n]*)$',
                        re.M)
_TARGET = re.compile(rb'(?:"([^"\n]+)"|<([^>\n]+)>)[ \t]*$')
# Comments, and the string and character literals that may contain '//' or '/*' without starting one.
_COMMENT_OR_LITERAL = re.compile(rb'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
_SPLICE = re.compile(rb'\\[ \t]*\r?\n')
_MAX_FILES = 10_000      # a closure this large is a runaway (an include cycle through symlinks): stop
SETTLE_NS = 2 * 10**9    # a file modified this recently when read is read again next time

# An include of a file: (quoted, name), or (None, the line) for one that cannot be followed.
_Include = tuple[bool | None, str]
# path -> (stat identity, digest, includes): no text, so a long process keeps little
_digests: dict[str, tuple[tuple[int, ...], str, tuple[_Include, ...]]] = {}
_digests_lock = _fork.lock()


class Closure:
    """What a compilation may read from disk.

    ``files`` maps each file followed (absolute path) to its SHA-256; ``edges`` lists every include in
    visit order as (including file, include as written, resolved file, digest) -- resolved file and digest
    are ``""`` for a name found nowhere, the digest is ``"headers"`` for a ``headers=`` entry and
    ``"system ..."`` for a system header; ``system`` lists the system headers not followed;
    ``untracked`` lists the includes that could not be followed (``#include MACRO``)."""

    __slots__ = ("edges", "files", "system", "untracked")

    def __init__(self) -> None:
        self.files: dict[str, str] = {}
        self.edges: list[tuple[str, str, str, str]] = []
        self.system: list[str] = []
        self.untracked: list[str] = []


def include_dirs(options: Iterable[str]) -> tuple[list[str], list[str]]:
    """(``-I`` directories, ``-include`` files) named by NVRTC options, in order, spelt as NVRTC reads them
    (checked against NVRTC 13.5): an option and a separate value (``"-I", " sub "``) lose their surrounding
    whitespace; the value joined to ``-I`` loses its leading spaces (``"-I sub"`` is ``sub/``); a value
    after ``=`` keeps them (``--include-path= sub`` is `` sub/``)."""
    dirs: list[str] = []
    pre: list[str] = []
    items = list(options)
    i = 0
    while i < len(items):
        opt = items[i].strip()
        for flags, out in ((("-I", "--include-path"), dirs), (("-include", "--pre-include"), pre)):
            for flag in flags:
                if opt == flag and i + 1 < len(items):
                    out.append(items[i + 1].strip())
                    i += 1
                elif opt.startswith(flag + "="):
                    out.append(opt[len(flag) + 1:])
                elif flag == "-I" and opt.startswith("-I") and len(opt) > 2:
                    out.append(opt[2:].lstrip(" "))
        i += 1
    return dirs, pre


def strip_comments(text: bytes) -> bytes:
    """``text`` without comments and line splices (string and character literals kept as they are)."""
    text = _SPLICE.sub(b"", text)
    return _COMMENT_OR_LITERAL.sub(lambda m: b" " if m.group(0)[:1] == b"/" else m.group(0), text)


def includes_of(text: bytes) -> tuple[_Include, ...]:
    """The includes of a source text, in order: (quoted?, name), or (None, the line) for one that
    cannot be followed."""
    if b"include" not in text and b"import" not in text:
        return ()
    out: list[_Include] = []
    for m in _DIRECTIVE.finditer(strip_comments(text)):
        word, rest = m.group(1), m.group(2).strip()
        target = _TARGET.match(rest) if word == b"include" else None
        if target is None:
            out.append((None, f"#{word.decode()} {rest.decode(errors='replace')}".rstrip()))
        elif target.group(1) is not None:
            out.append((True, target.group(1).decode(errors="surrogateescape")))
        else:
            out.append((False, target.group(2).decode(errors="surrogateescape")))
    return tuple(out)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read(path: str) -> tuple[str, tuple[_Include, ...]] | None:
    """(SHA-256, includes) of a file, remembered while its identity holds; None if it is no file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    identity = _identity(st)
    with _digests_lock:
        known = _digests.get(path)
    if known is not None and known[0] == identity:
        return known[1], known[2]
    read_at = time.time_ns()
    try:
        with open(path, "rb") as f:
            data = f.read()
        st = os.stat(path)
    except OSError:
        return None
    digest, includes = hashlib.sha256(data).hexdigest(), includes_of(data)
    with _digests_lock:
        if _identity(st) == identity and read_at - st.st_mtime_ns > SETTLE_NS:
            _digests[path] = (identity, digest, includes)
        else:
            _digests.pop(path, None)   # too fresh to trust its identity: read it again next time
    return digest, includes


# ----------------------------------------------------------------------------- system headers

_system: dict[tuple[object, ...], list[tuple[str, str]]] = {}


def system_include_dirs() -> list[tuple[str, str]]:
    """(include directory with a trailing separator, its toolkit's ``version.json`` or ``""``) of every
    toolkit and NVIDIA wheel (see the module's policy); resolved through symlinks."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if sys.platform != "win32":
        roots += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]
    where = (tuple(roots), tuple(sys.path))
    found = _system.get(where)
    if found is not None:
        return found
    out: dict[str, str] = {}
    for root in dict.fromkeys(r for r in roots if r):
        include = os.path.join(root, "include")
        if os.path.isdir(include):
            version = os.path.join(root, "version.json")
            out[os.path.realpath(include)] = version if os.path.isfile(version) else ""
    for site in sys.path:
        for include in sorted(glob.glob(os.path.join(glob.escape(site or "."), "nvidia", "*", "include"))):
            out.setdefault(os.path.realpath(include), "")
    found = _system[where] = [(d.rstrip(os.sep) + os.sep, v) for d, v in out.items()]
    return found


def _system_stamp(path: str, dirs: list[tuple[str, str]]) -> str | None:
    """The key of a system header at ``path`` (its identity, and its toolkit's version.json's), or None
    when ``path`` is not one."""
    real = os.path.realpath(path)
    for prefix, version in dirs:
        if real.startswith(prefix):
            try:
                st = os.stat(real)
                stamp = "system " + ",".join(map(str, _identity(st)))
                if version:
                    stamp += " " + ",".join(map(str, _identity(os.stat(version))))
            except OSError:
                return None
            return stamp
    return None


# ----------------------------------------------------------------------------- the closure

def _resolved(path: str) -> str:
    """``path`` named as the file system resolves it: its directory through every symlink and ``..`` in
    order (``link/../x.h`` is beside link's target, not ``./x.h``), the file's own name kept (a quoted include
    inside a symlinked header is looked for beside the link, as NVRTC does).  The same file reached by
    another spelling gets the same name: the key is stable and a cycle written with ``..`` ends."""
    directory, base = os.path.split(path)
    return os.path.join(os.path.realpath(directory), base)


def closure(source: bytes, name: str, headers: Mapping[str, bytes], options: Iterable[str]) -> Closure:
    """The files on disk that compiling ``source`` (program ``name``) with ``headers`` and ``options``
    may read, by NVRTC's search rules (see the module's policy)."""
    dirs, pre = include_dirs(options)
    cwd = os.getcwd()
    # Directories as written, joined to the current one but not normalized as text: "link/.." is the parent
    # of link's target, as the file system (and so NVRTC) resolves it, not the current directory.
    search = [os.path.join(cwd, d) for d in dirs]
    system: list[tuple[str, str]] | None = None   # found on the first include read from disk (globs: not for none)
    out = Closure()
    seen_headers: set[str] = set()
    main_dir = os.path.join(cwd, os.path.dirname(name))
    # (includer, its includes, directory of the including file); -include files first, as NVRTC reads them:
    # from the current directory, then the -I directories (never the program's directory)
    todo: list[tuple[str, tuple[_Include, ...], str]] = [(name, tuple((True, p) for p in pre), cwd)]
    todo.append((name, includes_of(source), main_dir))
    while todo:
        includer, includes, here = todo.pop()
        for quoted, include in includes:
            if quoted is None:
                out.untracked.append(include)
                continue
            written = f'"{include}"' if quoted else f"<{include}>"
            if include in headers:
                out.edges.append((includer, written, include, "headers"))
                if include not in seen_headers:
                    seen_headers.add(include)
                    todo.append((include, includes_of(headers[include]), os.path.join(cwd, os.path.dirname(include))))
                continue
            places = ([here] if quoted else []) + search
            for place in places:
                path = _resolved(os.path.join(place, include))
                if path in out.files:
                    out.edges.append((includer, written, path, out.files[path]))
                    break
                if system is None:
                    system = system_include_dirs()
                stamp = _system_stamp(path, system) if system and os.path.isfile(path) else None
                if stamp is not None:
                    out.edges.append((includer, written, path, stamp))
                    out.system.append(path)
                    break
                found = _read(path)
                if found is not None:
                    out.files[path] = found[0]
                    out.edges.append((includer, written, path, found[0]))
                    if len(out.files) > _MAX_FILES:
                        out.untracked.append(f"more than {_MAX_FILES} included files")
                        return out
                    todo.append((path, found[1], os.path.dirname(path)))
                    break
            else:
                out.edges.append((includer, written, "", ""))   # NVRTC's built-in header, or an error
    return out


__all__ = ["Closure", "closure", "include_dirs", "includes_of", "strip_comments", "system_include_dirs"]
