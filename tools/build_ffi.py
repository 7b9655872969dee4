#!/usr/bin/env python3
"""Compile ``headers/`` into the modules that ``import cuproc`` loads.

Why: ``ffi.cdef()`` over ~3,500 declarations takes about a second of
pycparser work, on every import.  cffi's *out-of-line ABI mode* does that
parse once, here, and writes a pure-Python module holding the parsed type
table (``cuproc/_cffi_abi.py``); loading it costs a few milliseconds and
needs no C compiler, at install or at run time.

It also writes ``cuproc/_header_data.py``: the ``#define`` constants (with
the C type of the pointer-valued ones) and each function's ``PFN_`` typedefs,
so the registry and tools need not read ``headers/``; and
``cuproc/_header_toolkits.py``: the toolkits that declare each typedef.  That
table is apart because resolving a function never reads it (only a registry
``Symbol`` does: ``dump_symbols``), and it was a quarter of the data module's
import, which every process pays on its first driver call.

Then ``cuproc/_cnames.pyi``, the type stub of the C-named namespace
(``tools/build_stubs.py``).  All four are checked in; ``tests/test_headers.py``
and ``tests/test_typing.py`` rebuild them and fail when they drift from ``headers/``.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import cffi

ROOT = Path(__file__).resolve().parent.parent
HEADER_ORDER = ("cuda_types.h", "cuda_pfn.h")
_DEFINE = re.compile(r"^#define (\w+) (-?\d+)$", re.M)
_PFN = re.compile(r"^PFN_(\w+?)_v(\d+)(_ptds|_ptsz)?$")


def _group(typedefs: dict) -> dict[str, list[str]]:
    """Each function's typedef names, default-stream ones oldest first, then per-thread ones newest
    first: the order cuproc.registry parses in one pass (any other order it sorts first)."""
    grouped: dict[str, list[str]] = {}
    for name in typedefs:
        grouped.setdefault(_PFN.match(name).group(1), []).append(name)

    def order(name: str) -> tuple[bool, int]:
        m = _PFN.match(name)
        per_thread = m.group(3) is not None
        return per_thread, -int(m.group(2)) if per_thread else int(m.group(2))
    return {sym: sorted(names, key=order) for sym, names in sorted(grouped.items())}


def _alias_spans(provenance: dict) -> dict[str, tuple[tuple[str, str | None], ...]]:
    """Each alias as the toolkits where its meaning changes (a target, or None: no alias)."""
    toolkits = [t["version"] for t in provenance["toolkits"]]
    spans: dict[str, tuple[tuple[str, str | None], ...]] = {}
    for alias, by_toolkit in sorted(provenance["header_aliases"].items()):
        changes: list[tuple[str, str | None]] = []
        for tk in toolkits:
            target = by_toolkit.get(tk)
            if (changes[-1][1] if changes else None) != target:
                changes.append((tk, target))
        spans[alias] = tuple(changes)
    return spans


def cdef_source(headers: Path) -> str:
    return "".join((headers / name).read_text() for name in HEADER_ORDER)


def abi_module_text(headers: Path) -> str:
    """The source of cuproc/_cffi_abi.py: cffi's out-of-line ABI module of headers/."""
    return _abi_module_text(cdef_source(headers))


@functools.lru_cache(maxsize=2)
def _abi_module_text(cdef: str) -> str:
    """:func:`abi_module_text` by the declarations' text: build_abi_module and _enumerators both need it, and
    one compile of the 1,147 typedefs takes about 0.7 s (keyed by content, never by path, so an edited
    header is never served stale)."""
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    ffi.set_source("cuproc._cffi_abi", None)
    with tempfile.TemporaryDirectory() as tmp:
        return Path(ffi.compile(tmpdir=tmp)).read_text()


def build_abi_module(headers: Path, out_dir: Path) -> Path:
    target = out_dir / "_cffi_abi.py"
    target.write_text(abi_module_text(headers))
    (out_dir / "_abi_digest.py").write_text(_digests().abi_digest_module(target.read_bytes()))
    return target


def _digests():  # type: ignore[no-untyped-def] - a module object
    """cuproc/_fastpath_digest.py, the one digest: a checkout's, loaded by path without importing cuproc;
    else (an unpacked sdist whose cuproc/ was removed, as in CI's installed-wheel run) the installed one."""
    if (ROOT / "cuproc" / "_fastpath_digest.py").is_file():
        from build_fastpath import digest_module
        return digest_module(ROOT)
    from cuproc import _fastpath_digest
    return _fastpath_digest


def _abi_keys(provenance: dict) -> tuple[int | tuple[int, ...], ...]:
    """Each function's ABI versions as the registry's own parser reads its typedef names
    (cuproc.registry.parsed_typedefs), which must find them in the order SYMBOL_TYPEDEFS lists: an int
    for a single name, else (count of default-stream versions, those versions, per-thread versions)."""
    sys.path.insert(0, str(ROOT))
    try:
        import cuproc.registry as registry
    finally:
        sys.path.remove(str(ROOT))
    # a checkout's own parser when it has one (an unpacked sdist without cuproc/ tests the installed one)
    if (ROOT / "cuproc").is_dir() and Path(registry.__file__).resolve().parent != (ROOT / "cuproc").resolve():
        raise RuntimeError(f"build_ffi: the registry imported is {registry.__file__}, not this checkout's")
    out: dict[str, int | tuple[int, ...]] = {}
    for sym, names in _group(provenance["pfn_typedefs"]).items():
        keys, base, per_thread, _ = registry.parsed_typedefs(sym, tuple(names))
        if base + tuple(name for _, name in per_thread) != tuple(names):
            raise RuntimeError(f"build_ffi: {sym}'s typedef names are not in the one-pass order: {names}")
        out[sym] = keys[0] if len(names) == 1 else (len(keys), *keys, *(key for key, _ in per_thread))
    return tuple(out[sym] for sym in sorted(out))


def _enumerators(headers: Path) -> dict[str, int]:
    """Every enumerator of headers/, in the order cuproc.driver.constants() took them from the ffi (each
    enum typedef's in ``ffi.list_types()`` order).  Its own module (``_header_enums``), read only by
    ``constants()``: asking the ffi realized every typedef there (about 1 ms of a first
    ``cuproc.driver`` function), and ``_header_data`` is on the way to a first allocation."""
    # The out-of-line module's ffi, made in memory: its typeof() reads the precompiled type tables, where
    # an in-line FFI parses a declaration of every typedef again for each query (about two minutes for
    # the 1,147 typedefs, of every run of tests/test_headers.py)
    namespace: dict[str, Any] = {}
    exec(compile(abi_module_text(headers), "_cffi_abi.py", "exec"), namespace)
    ffi = namespace["ffi"]
    out: dict[str, int] = {}
    for name in ffi.list_types()[0]:
        ctype = ffi.typeof(name)
        if ctype.kind == "enum":
            out.update(ctype.relements)
    return out


def build_header_data(headers: Path, out_dir: Path) -> list[Path]:
    provenance = json.loads((headers / "provenance.json").read_text())
    defines = {m.group(1): int(m.group(2)) for m in _DEFINE.finditer((headers / "cuda_types.h").read_text())}
    lines = [
        '"""Generated by tools/build_ffi.py from headers/; do not edit."""',
        "",
        "#: Object-like CU_/CUDA_ macros of cuda.h, as integers.",
        f"DEFINES: dict[str, int] = {defines!r}",
        "",
        "#: The macros that cuda.h defines as pointer casts, with their C type.",
        f"POINTER_CONSTANTS: dict[str, str] = {provenance['pointer_constants']!r}",
        "",
        "#: The toolkits merged into headers/, oldest first.",
        f"TOOLKITS: tuple[str, ...] = {tuple(t['version'] for t in provenance['toolkits'])!r}",
        "",
        "#: C function name -> its PFN typedef names (grouping only; the rules live in cuproc.registry).",
        "SYMBOL_TYPEDEFS: dict[str, tuple[str, ...]] = {",
        *(f"    {sym!r}: {tuple(names)!r}," for sym, names in _group(provenance["pfn_typedefs"]).items()),
        "}",
        "",
        "#: The ABI versions of each function, in the order of sorted(SYMBOL_TYPEDEFS): the one version of a",
        "#: single typedef name, else (n, n default-stream versions oldest first, the per-thread ones newest",
        "#: first), the order SYMBOL_TYPEDEFS lists the names in; flat, as few objects as a fresh process",
        "#: can load.  cuproc.registry's selection tables take them instead of parsing the names.",
        f"SYMBOL_ABI_KEYS: tuple[int | tuple[int, ...], ...] = {_abi_keys(provenance)!r}",
        "",
        "#: The newest ABI version any typedef has (driver encoding).",
        f"NEWEST_VERSION: int = {max(int(_PFN.match(n).group(2)) for n in provenance['pfn_typedefs'])}",
        "",
        "#: The functions of the typedef headers other than cudaTypedefs.h, with their header.",
        f"SYMBOL_HEADERS: dict[str, str] = {provenance['symbol_headers']!r}",
        "",
        "#: Functions whose typedef header declares them only under _WIN32 (cuWGLGetDevice).",
        f"WINDOWS_ONLY: frozenset[str] = frozenset({provenance['windows_only']!r})",
        "",
        "#: Header aliases (#define cuX cuY, cuY another function): alias -> ((toolkit, what C source",
        "#: means by the name from that toolkit on, or None), ...), oldest first.",
        f"HEADER_ALIASES: dict[str, tuple[tuple[str, str | None], ...]] = {_alias_spans(provenance)!r}",
        "",
    ]
    toolkits = [
        '"""Generated by tools/build_ffi.py from headers/; do not edit (read only by registry Symbols)."""',
        "",
        "#: PFN typedef name -> the toolkits whose typedef headers declare it.",
        "PFN_TOOLKITS: dict[str, tuple[str, ...]] = {",
        *(f"    {name!r}: {tuple(tks)!r}," for name, tks in provenance["pfn_typedefs"].items()),
        "}",
        "",
    ]
    enums = [
        '"""Generated by tools/build_ffi.py from headers/; do not edit (read only by cuproc.driver.constants)."""',
        "",
        "#: Every enumerator of the enum typedefs, as integers (what the ffi's enum types say).",
        f"ENUMERATORS: dict[str, int] = {_enumerators(headers)!r}",
        "",
    ]
    targets = [out_dir / "_header_data.py", out_dir / "_header_toolkits.py", out_dir / "_header_enums.py"]
    for target, text in zip(targets, (lines, toolkits, enums)):
        target.write_text("\n".join(text))
    return targets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile headers/ into cuproc/_cffi_abi.py (and _abi_digest.py), "
                                            "_header_data.py, _header_enums.py and _header_toolkits.py")
    p.add_argument("--headers", type=Path, default=ROOT / "headers")
    p.add_argument("--out", type=Path, default=ROOT / "cuproc")
    args = p.parse_args(argv)
    for target in (build_abi_module(args.headers, args.out), args.out / "_abi_digest.py",
                   *build_header_data(args.headers, args.out)):
        print(f"build_ffi: wrote {target}")
    from build_stubs import build_driver_stub   # the type stub of the C names follows the same data
    print(f"build_ffi: wrote {build_driver_stub(args.headers, args.out, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
