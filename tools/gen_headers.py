#!/usr/bin/env python3
"""Regenerate ``headers/`` from the driver typedef headers of several CUDA toolkits.

Policy
------
* The typedef headers are the Linux ones the programming guide's Driver Entry
  Point Access section lists: ``cudaTypedefs.h``, ``cudaProfilerTypedefs.h``,
  ``cudaGLTypedefs.h``, ``cudaEGLTypedefs.h`` and ``cudaVDPAUTypedefs.h``,
  with the ``cuda*.h`` they include.  The GL, EGL and VDPAU types come from
  small stand-in headers (``STAND_INS``: the scalar types as their Khronos /
  VDPAU headers declare them, handles opaque), so no GL, EGL or VDPAU headers
  are needed; ``provenance.json`` lists them under ``stand_in_types``.
* **Windows-only** typedefs are found by a second pass with ``_WIN32``
  defined, over the same headers plus the Direct3D typedef headers
  (``cudaD3D9Typedefs.h``, ``cudaD3D10Typedefs.h``, ``cudaD3D11Typedefs.h``),
  which only the toolkit's Windows wheel ships: ``cuWGLGetDevice`` and the
  D3D functions.  Their typedefs, and the types only they need (the D3D
  enums, ``HGPUNV``; D3D interfaces as opaque stand-ins), join the Linux
  declarations; ``windows_only`` lists the functions.
* **Header aliases**: a ``#define cuX cuY`` in which ``cuY`` is another
  function, not an ABI name of ``cuX`` (``cuX_v2``, ``cuX_ptds``), changes what
  C source means by ``cuX``; ``provenance.json`` records each under
  ``header_aliases`` with the toolkits that define it
  (``cuGraphInstantiate`` -> ``cuGraphInstantiateWithFlags`` from 12.0).
* Each toolkit's headers are run through the C preprocessor with
  ``__CUDA_API_VERSION_INTERNAL`` defined, which is what exposes the typedefs
  of the *older* ABI variants (``PFN_cuMemAlloc_v2000`` and friends) and
  the ``_v1`` structs they take.  ``__CUDA_API_VERSION_INTERNAL_ODR`` hides
  the internal ``*_MAX`` enumerators again.
* The result is parsed with pycparser.  Every struct, union, enum and
  typedef is taken from the newest toolkit that declares it; every
  ``PFN_<name>_v<version>[_ptds|_ptsz]`` typedef of every toolkit is kept, so
  APIs that newer headers dropped (texture references, ...) stay callable.
* Constant expressions (enumerators, array bounds, ``sizeof`` of scalars and
  pointers) are folded to numbers; comments and macros disappear, except
  the object-like ``CU_*`` / ``CUDA_*`` macros, emitted as integer
  ``#define``s.  Those that are pointer casts (``CU_STREAM_LEGACY``) are
  recorded with their C type in ``provenance.json``.
* Output order is a dependency order that is a pure function of the
  inputs, so regenerating is byte-for-byte deterministic.

Usage::

    python tools/gen_headers.py                   # the six pinned toolkits (Linux + Windows wheels), via pip
    python tools/gen_headers.py --toolkit 13.0=/usr/local/cuda/include --out /tmp/h

Needs pip (for the wheels), a C preprocessor (``cc -E``) and pycparser.
None of that is needed to *install* or *use* cuproc.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from pycparser import c_ast, c_generator, c_parser

#: The toolkits merged into headers/, oldest first: (CUDA version, pip requirement).
PINNED_TOOLKITS: list[tuple[str, str]] = [
    ("11.8", "nvidia-cuda-runtime-cu11==11.8.89"),
    ("12.0", "nvidia-cuda-runtime-cu12==12.0.146"),
    ("12.4", "nvidia-cuda-runtime-cu12==12.4.127"),
    ("12.9", "nvidia-cuda-runtime-cu12==12.9.79"),
    ("13.0", "nvidia-cuda-runtime==13.0.96"),
    ("13.5", "nvidia-cuda-runtime==13.5.37"),
]

#: The typedef headers merged, in include order.
TYPEDEF_HEADERS = ("cudaTypedefs.h", "cudaProfilerTypedefs.h", "cudaGLTypedefs.h", "cudaEGLTypedefs.h",
                   "cudaVDPAUTypedefs.h")
#: Every header read from a toolkit (all six pinned toolkits have all of them).
HEADER_FILES = ("cuda.h", "cudaGL.h", "cudaEGL.h", "cudaVDPAU.h", *TYPEDEF_HEADERS)
#: Read when the toolkit has it; the runtime wheels do not ship it (STAND_INS has its one type).
OPTIONAL_HEADER_FILES = ("cudaProfiler.h",)
#: The Direct3D typedef headers and what they include, from the toolkit's Windows wheel.
D3D_TYPEDEF_HEADERS = ("cudaD3D9Typedefs.h", "cudaD3D10Typedefs.h", "cudaD3D11Typedefs.h")
WINDOWS_HEADER_FILES = ("cudaD3D9.h", "cudaD3D10.h", "cudaD3D11.h", *D3D_TYPEDEF_HEADERS)

#: Headers the typedef headers include but no toolkit ships: each stand-in type as its own
#: header declares it (GL and VDPAU scalars, EGL handles as void *), or opaque.
STAND_INS: dict[str, tuple[tuple[str, str], ...]] = {
    "GL/gl.h": (("GLenum", "typedef unsigned int GLenum;"), ("GLuint", "typedef unsigned int GLuint;")),
    "EGL/egl.h": (("EGLint", "typedef int EGLint;"),),
    "EGL/eglext.h": (("EGLImageKHR", "typedef void *EGLImageKHR;"),
                     ("EGLStreamKHR", "typedef void *EGLStreamKHR;"),
                     ("EGLSyncKHR", "typedef void *EGLSyncKHR;")),
    "vdpau/vdpau.h": (("VdpStatus", "typedef int VdpStatus;"),
                      ("VdpDevice", "typedef uint32_t VdpDevice;"),
                      ("VdpVideoSurface", "typedef uint32_t VdpVideoSurface;"),
                      ("VdpOutputSurface", "typedef uint32_t VdpOutputSurface;"),
                      ("VdpChromaType", "typedef uint32_t VdpChromaType;"),
                      ("VdpRGBAFormat", "typedef uint32_t VdpRGBAFormat;"),
                      # a function type in vdpau.h; cffi cannot name one, so it is opaque here
                      # (cudaVDPAU.h takes it only as ``VdpGetProcAddress *``)
                      ("VdpGetProcAddress", "typedef struct VdpGetProcAddress_opaque VdpGetProcAddress;")),
    # cudaProfiler.h's one type, as NVIDIA's cudaProfiler.h declares it; used only when the
    # toolkit lacks that header.
    "cudaProfiler.h": (("CUoutput_mode", "typedef enum CUoutput_mode_enum { CU_OUT_KEY_VALUE_PAIR = 0x00, "
                                         "CU_OUT_CSV = 0x01 } CUoutput_mode;"),),
    # Direct3D interfaces (COM objects: only ever passed by pointer), for the Windows-only pass.
    "rpcsal.h": (),
    "d3d9.h": tuple((n, f"typedef struct {n} {n};") for n in
                    ("IDirect3DDevice9", "IDirect3DResource9", "IDirect3DVertexBuffer9")),
    "dxgi.h": (("IDXGIAdapter", "typedef struct IDXGIAdapter IDXGIAdapter;"),),
    "D3D10_1.h": (("", '#include "dxgi.h"'),
                  *((n, f"typedef struct {n} {n};") for n in ("ID3D10Device", "ID3D10Resource"))),
    "D3D11_1.h": (("", '#include "dxgi.h"'),
                  *((n, f"typedef struct {n} {n};") for n in ("ID3D11Device", "ID3D11Resource"))),
}
_WINDOWS_STAND_INS = ("rpcsal.h", "d3d9.h", "dxgi.h", "D3D10_1.h", "D3D11_1.h")
_WINDOWS_FLAGS = ["-D_WIN32", "-D__stdcall="]
_ALIAS = re.compile(r"^#define (cu\w+) (cu\w+)$")

# Just enough of libc for cuda.h; these typedefs are cffi built-ins and are not emitted.
_FAKE_LIBC = (
    "typedef unsigned long size_t;\n"
    "typedef unsigned char uint8_t; typedef unsigned short uint16_t;\n"
    "typedef unsigned int uint32_t; typedef unsigned long long uint64_t;\n"
    "typedef signed char int8_t; typedef short int16_t; typedef int int32_t;\n"
    "typedef long long int64_t; typedef unsigned long uintptr_t; typedef long intptr_t;\n"
)
_FAKE_LIBC_HEADERS = ("stdlib.h", "stdint.h", "stddef.h")
_BUILTIN_TYPES = {
    "size_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t", "int8_t", "int16_t",
    "int32_t", "int64_t", "uintptr_t", "intptr_t",
}
_CPP_FLAGS = [
    "-E", "-nostdinc", "-undef", "-D__linux__", "-D__x86_64__", "-D__LP64__",
    "-D__CUDA_API_VERSION_INTERNAL", "-D__CUDA_API_VERSION_INTERNAL_ODR",
]
_DEFINE_PREFIX = "__cuproc_define_"
_MACRO_NAME = re.compile(r"^(CU|CUDA)_[A-Z0-9_]+$")
_MACRO_EXCLUDED = re.compile(r"^(CUDA_VERSION|CUDA_API_.*|CUDA_CB|CUDA_FORCE_.*)$")
_PFN_NAME = re.compile(r"^PFN_(\w+?)_v(\d+)(_ptds|_ptsz)?$")

# sizeof() of the scalar types that occur in array bounds (LP64).
_SCALAR_SIZES = {
    "char": 1, "signed char": 1, "unsigned char": 1, "short": 2, "unsigned short": 2,
    "int": 4, "unsigned int": 4, "unsigned": 4, "long": 8, "unsigned long": 8,
    "long long": 8, "unsigned long long": 8, "float": 4, "double": 8, "size_t": 8,
    "uint8_t": 1, "uint16_t": 2, "uint32_t": 4, "uint64_t": 8,
    "int8_t": 1, "int16_t": 2, "int32_t": 4, "int64_t": 8,
}


@dataclass
class Declaration:
    """One top-level C declaration, keyed by the name it defines."""

    key: str                   # "struct X", "union X", "enum X", or a typedef name
    text: str                  # the C text, constants folded
    deps: set[str] = field(default_factory=set)
    enumerators: list[str] = field(default_factory=list)


@dataclass
class ToolkitHeaders:
    """What one toolkit's cuda.h + cudaTypedefs.h declare."""

    version: str
    source: str
    sha256: str
    declarations: dict[str, Declaration]          # types, in the header's order
    pfn: dict[str, Declaration]                   # PFN typedefs
    defines: dict[str, tuple[int, str | None]]    # name -> (value, pointer C type or None)
    aliases: dict[str, str] = field(default_factory=dict)   # header alias -> the function it names
    windows_only: set[str] = field(default_factory=set)     # PFN typedefs declared only under _WIN32
    stand_ins: set[str] = field(default_factory=set)        # stand-in headers this toolkit needed
    symbol_headers: dict[str, str] = field(default_factory=dict)  # function -> the typedef header declaring it
    headers: set[str] = field(default_factory=set)          # the header files read from the toolkit


# --------------------------------------------------------------------------- reading

_LINUX_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64")
_WINDOWS_PLATFORMS = ("win_amd64",)


def download_toolkit(requirement: str, cache: Path, platforms: tuple[str, ...] = _LINUX_PLATFORMS) -> Path:
    """Fetch one toolkit wheel with pip (no dependencies) for ``platforms`` and return its path."""
    cache.mkdir(parents=True, exist_ok=True)
    name, version = requirement.split("==")
    stem = name.replace("-", "_") + "-" + version + "-"

    def matching() -> list[Path]:
        windows = platforms == _WINDOWS_PLATFORMS
        return [p for p in cache.glob("*.whl") if p.name.startswith(stem) and ("win_amd64" in p.name) == windows]

    found = matching()
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             *(f"--platform={p}" for p in platforms),
             "--python-version", "3.12", "-d", str(cache), requirement],
            check=True, stdout=subprocess.DEVNULL)
        found = matching()
    if len(found) != 1:
        raise SystemExit(f"gen_headers: expected one wheel for {requirement} in {cache}, found {found}")
    return found[0]


def _read(source: Path, wanted: tuple[str, ...]) -> dict[str, bytes]:
    texts: dict[str, bytes] = {}
    if source.is_dir():
        for name in wanted:
            if (source / name).is_file():
                texts[name] = (source / name).read_bytes()
    else:
        with zipfile.ZipFile(source) as wheel:
            for info in wheel.infolist():
                base = info.filename.rsplit("/", 1)[-1]
                if base in wanted and "/include/" in info.filename:
                    texts[base] = wheel.read(info)
    return texts


def read_header_texts(source: Path, windows: Path | None = None) -> dict[str, bytes]:
    """The HEADER_FILES (and OPTIONAL_HEADER_FILES present) from a wheel or an include directory, and
    the WINDOWS_HEADER_FILES from ``windows`` (the toolkit's Windows wheel or include directory)."""
    texts = _read(source, HEADER_FILES + OPTIONAL_HEADER_FILES)
    missing = set(HEADER_FILES) - set(texts)
    if windows is not None:
        win = _read(windows, WINDOWS_HEADER_FILES)
        texts.update(win)
        missing |= set(WINDOWS_HEADER_FILES) - set(win)
    if missing:
        raise SystemExit(f"gen_headers: {source}{f' / {windows}' if windows else ''} lacks {sorted(missing)}")
    return texts


def _stand_in_text(header: str) -> str:
    return "#pragma once\n" + "".join(text + "\n" for _, text in STAND_INS[header])


def _is_abi_name(name: str, target: str) -> bool:
    """``cuX_v2``, ``cuX_ptds``: another ABI of the same function, not an alias."""
    return re.fullmatch(rf"{re.escape(name)}(_v\d+)?(_ptds|_ptsz)?", target) is not None


class Preprocessed(NamedTuple):
    text: str                 # the Linux translation unit
    windows: str              # the same headers and the D3D ones, preprocessed with _WIN32
    aliases: dict[str, str]   # header alias -> the function it names
    stand_ins: set[str]       # stand-in headers used


def preprocess(texts: dict[str, bytes], cpp: str) -> Preprocessed:
    """Run the C preprocessor; append one probe declaration per object-like CU_/CUDA_ macro."""
    with tempfile.TemporaryDirectory(prefix="cuproc-gen-") as tmp:
        inc = Path(tmp, "include")
        fake = Path(tmp, "libc")
        inc.mkdir()
        fake.mkdir()
        for name, data in texts.items():
            (inc / name).write_bytes(data)
        for name in _FAKE_LIBC_HEADERS:
            (fake / name).write_text(_FAKE_LIBC)
        stand_ins = {h for h in STAND_INS if h not in texts}
        for header in stand_ins:
            Path(fake, header).parent.mkdir(parents=True, exist_ok=True)
            Path(fake, header).write_text(_stand_in_text(header))
        d3d = [h for h in D3D_TYPEDEF_HEADERS if h in texts]
        if not d3d:
            stand_ins -= set(_WINDOWS_STAND_INS)
        flags = [*_CPP_FLAGS, f"-I{fake}", f"-I{inc}"]
        includes = "".join(f'#include "{h}"\n' for h in TYPEDEF_HEADERS)
        Path(tmp, "all.h").write_text(includes)
        Path(tmp, "windows.h").write_text(includes + "".join(f'#include "{h}"\n' for h in d3d))
        macros = subprocess.run([cpp, "-dM", *flags, str(Path(tmp, "all.h"))],
                                check=True, capture_output=True, text=True).stdout
        names = []
        for line in macros.splitlines():
            m = re.match(r"#define (\w+) (.+)$", line)
            if m and _MACRO_NAME.match(m.group(1)) and not _MACRO_EXCLUDED.match(m.group(1)):
                names.append(m.group(1))
        # The aliases as user C source sees them: without __CUDA_API_VERSION_INTERNAL, which #undefs them.
        user_flags = [f for f in flags if not f.startswith("-D__CUDA_API_VERSION_INTERNAL")]
        user_macros = "".join(
            subprocess.run([cpp, "-dM", *user_flags, *platform, str(Path(tmp, unit))],
                           check=True, capture_output=True, text=True).stdout
            for unit, platform in (("all.h", []), ("windows.h", _WINDOWS_FLAGS)))
        aliases: dict[str, str] = {}
        for line in user_macros.splitlines():
            m = _ALIAS.match(line.strip())
            if m and not _is_abi_name(m.group(1), m.group(2)):
                aliases[m.group(1)] = m.group(2)
        probe = Path(tmp, "probe.c")
        probe.write_text(includes + "".join(
            f"int {_DEFINE_PREFIX}{n} = ({n});\n" for n in sorted(names)))
        text = subprocess.run([cpp, "-P", *flags, str(probe)],
                              check=True, capture_output=True, text=True).stdout
        windows = subprocess.run([cpp, "-P", *flags, *_WINDOWS_FLAGS, str(Path(tmp, "windows.h"))],
                                 check=True, capture_output=True, text=True).stdout
    return Preprocessed(text, windows, aliases, stand_ins)


# --------------------------------------------------------------------------- folding

class Folder:
    """Evaluates the integer constant expressions of one translation unit."""

    def __init__(self) -> None:
        self.constants: dict[str, int] = {}
        self.typedefs: dict[str, c_ast.Node] = {}
        self.enum_tags: set[str] = set()

    def value(self, node: c_ast.Node) -> int:
        if isinstance(node, c_ast.Constant):
            text = node.value.rstrip("uUlL")
            if node.type == "char":
                return ord(text.strip("'"))
            return int(text, 0) if not re.fullmatch(r"0[0-7]+", text) else int(text, 8)
        if isinstance(node, c_ast.ID):
            return self.constants[node.name]
        if isinstance(node, c_ast.UnaryOp):
            if node.op == "sizeof":
                return self.sizeof(node.expr)
            v = self.value(node.expr)
            return {"-": -v, "+": v, "~": ~v, "!": int(not v)}[node.op]
        if isinstance(node, c_ast.BinaryOp):
            a, b = self.value(node.left), self.value(node.right)
            ops = {"+": a + b, "-": a - b, "*": a * b, "|": a | b, "&": a & b, "^": a ^ b,
                   "<<": a << b, ">>": a >> b}
            if node.op in ops:
                return ops[node.op]
            if node.op in ("/", "%") and b:
                return int(a / b) if node.op == "/" else a - b * int(a / b)
            raise ValueError(f"cannot fold operator {node.op}")
        if isinstance(node, c_ast.Cast):
            return self.value(node.expr)
        if isinstance(node, c_ast.TernaryOp):
            return self.value(node.iftrue) if self.value(node.cond) else self.value(node.iffalse)
        raise ValueError(f"cannot fold {type(node).__name__}")

    def sizeof(self, node: c_ast.Node) -> int:
        decl = node.type if isinstance(node, c_ast.Typename) else node
        while True:
            if isinstance(decl, c_ast.PtrDecl):
                return 8
            if isinstance(decl, c_ast.TypeDecl):
                decl = decl.type
                continue
            if isinstance(decl, c_ast.Enum):
                return 4
            if isinstance(decl, c_ast.IdentifierType):
                name = " ".join(decl.names)
                if name in _SCALAR_SIZES:
                    return _SCALAR_SIZES[name]
                if name in self.typedefs:
                    decl = self.typedefs[name]
                    continue
            raise ValueError(f"cannot take sizeof of {decl}")

    def pointer_type(self, node: c_ast.Node) -> str | None:
        """The C type of an outermost pointer cast, as in ``((CUstream)0x1)``, else None."""
        if not isinstance(node, c_ast.Cast):
            return None
        decl = node.to_type.type
        text = c_generator.CGenerator().visit(node.to_type)
        while isinstance(decl, c_ast.TypeDecl) and isinstance(decl.type, c_ast.IdentifierType):
            name = " ".join(decl.type.names)
            if name not in self.typedefs:
                return None
            decl = self.typedefs[name]
        return text if isinstance(decl, c_ast.PtrDecl) else None


# --------------------------------------------------------------------------- extraction

def _references(node: c_ast.Node, own_tag: str | None = None) -> set[str]:
    """Typedef names and struct/union/enum tags a declaration mentions."""
    found: set[str] = set()

    class Visitor(c_ast.NodeVisitor):
        def visit_IdentifierType(self, n: c_ast.IdentifierType) -> None:
            found.add(" ".join(n.names))

        def visit_Struct(self, n: c_ast.Struct) -> None:
            if n.name and f"struct {n.name}" != own_tag:
                found.add(f"struct {n.name}")
            self.generic_visit(n)

        def visit_Union(self, n: c_ast.Union) -> None:
            if n.name and f"union {n.name}" != own_tag:
                found.add(f"union {n.name}")
            self.generic_visit(n)

        def visit_Enum(self, n: c_ast.Enum) -> None:
            if n.name and f"enum {n.name}" != own_tag:
                found.add(f"enum {n.name}")
            self.generic_visit(n)

    Visitor().visit(node)
    return found


def _tagged(node: c_ast.Node) -> tuple[str, c_ast.Node] | None:
    if isinstance(node, (c_ast.Struct, c_ast.Union, c_ast.Enum)) and node.name:
        kind = {c_ast.Struct: "struct", c_ast.Union: "union", c_ast.Enum: "enum"}[type(node)]
        return f"{kind} {node.name}", node
    return None


class Extractor:
    """Turns one preprocessed toolkit into folded, keyed declarations."""

    def __init__(self) -> None:
        self.folder = Folder()
        self.gen = c_generator.CGenerator()
        self.declarations: dict[str, Declaration] = {}
        self.pfn: dict[str, Declaration] = {}
        self.defines: dict[str, tuple[int, str | None]] = {}

    def run(self, ast: c_ast.FileAST) -> None:
        for ext in ast.ext:
            if isinstance(ext, c_ast.Typedef):
                self._typedef(ext)
            elif isinstance(ext, c_ast.Decl):
                self._decl(ext)

    def _fold_body(self, node: c_ast.Node) -> list[str]:
        """Fold enumerator values and array bounds in place; return the enumerators defined."""
        enumerators: list[str] = []
        folder = self.folder

        class Visitor(c_ast.NodeVisitor):
            def visit_Enum(self, n: c_ast.Enum) -> None:
                if n.values is None:
                    return
                nxt = 0
                for e in n.values.enumerators:
                    v = folder.value(e.value) if e.value is not None else nxt
                    folder.constants[e.name] = v
                    e.value = c_ast.Constant("int", str(v))
                    enumerators.append(e.name)
                    nxt = v + 1

            def visit_ArrayDecl(self, n: c_ast.ArrayDecl) -> None:
                if n.dim is not None:
                    n.dim = c_ast.Constant("int", str(folder.value(n.dim)))
                self.generic_visit(n)

        Visitor().visit(node)
        return enumerators

    def _add_tagged_definition(self, key: str, node: c_ast.Node) -> None:
        enumerators = self._fold_body(node)
        text = self.gen.visit(node) + ";"
        self.declarations[key] = Declaration(key, text, _references(node, key), enumerators)

    def _typedef(self, td: c_ast.Typedef) -> None:
        name = td.name
        if name in _BUILTIN_TYPES:
            return
        inner = td.type.type if isinstance(td.type, c_ast.TypeDecl) else None
        tagged = _tagged(inner) if inner is not None else None
        if tagged and getattr(inner, "decls" if not isinstance(inner, c_ast.Enum) else "values") is not None:
            # Split "typedef struct X {...} Y;" into the definition and "typedef struct X Y;".
            key, node = tagged
            self._add_tagged_definition(key, copy.deepcopy(node))
            reference = copy.deepcopy(td)
            body_less = copy.copy(inner)  # copy, not construct: node signatures vary across pycparser versions
            setattr(body_less, "values" if isinstance(inner, c_ast.Enum) else "decls", None)
            reference.type.type = body_less
            td = reference
        else:
            td = copy.deepcopy(td)
        enumerators = self._fold_body(td)
        self.folder.typedefs[name] = td.type
        text = self.gen.visit(td) + ";"
        decl = Declaration(name, text, _references(td.type), enumerators)
        if _PFN_NAME.match(name):
            self.pfn[name] = decl
        else:
            self.declarations[name] = decl

    def _decl(self, d: c_ast.Decl) -> None:
        if d.name and d.name.startswith(_DEFINE_PREFIX):
            macro = d.name[len(_DEFINE_PREFIX):]
            try:
                self.defines[macro] = (self.folder.value(d.init), self.folder.pointer_type(d.init))
            except (ValueError, KeyError):
                pass  # not an integer constant (a type alias or a string): not emitted
            return
        if isinstance(d.type, c_ast.FuncDecl) or d.name:
            return  # prototypes: cuproc resolves every function through cuGetProcAddress
        tagged = _tagged(d.type)
        if tagged:
            key, node = tagged
            has_body = (node.values if isinstance(node, c_ast.Enum) else node.decls) is not None
            if has_body:
                self._add_tagged_definition(key, copy.deepcopy(node))


def extract(version: str, source: Path, cpp: str, windows: Path | None = None) -> ToolkitHeaders:
    texts = read_header_texts(source, windows)
    pre = preprocess(texts, cpp)
    ex = Extractor()
    ex.run(c_parser.CParser().parse(pre.text, filename=f"cuda-{version}"))
    # Windows-only: the typedefs the _WIN32 pass adds, with the types only they need.
    win = Extractor()
    win.run(c_parser.CParser().parse(pre.windows, filename=f"cuda-{version}-win32"))
    windows_only = set(win.pfn) - set(ex.pfn)
    for name in sorted(windows_only):
        ex.pfn[name] = win.pfn[name]
    for key, decl in win.declarations.items():
        ex.declarations.setdefault(key, decl)
    digest = hashlib.sha256(b"".join(texts[name] for name in sorted(texts))).hexdigest()
    symbol_headers = {m.group(1): header for header in (*TYPEDEF_HEADERS, *D3D_TYPEDEF_HEADERS) if header in texts
                      for m in re.finditer(r"\*\s*PFN_(\w+?)_v\d+(?:_ptds|_ptsz)?\s*\)", texts[header].decode())}
    return ToolkitHeaders(version, source.name + (f" + {windows.name}" if windows else ""), digest,
                          ex.declarations, ex.pfn, ex.defines,
                          pre.aliases, windows_only, pre.stand_ins, symbol_headers, set(texts))


# --------------------------------------------------------------------------- merging

def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def _pfn_sort_key(name: str) -> tuple[str, int, str]:
    m = _PFN_NAME.match(name)
    assert m
    return (m.group(1), int(m.group(2)), m.group(3) or "")


def _dependency_order(decls: dict[str, Declaration], roots: list[str]) -> list[Declaration]:
    """Depth-first post-order; pointer-only cycles are broken where first met (cffi allows it)."""
    out: list[Declaration] = []
    state: dict[str, int] = {}

    def visit(key: str) -> None:
        if key not in decls or state.get(key):
            return
        state[key] = 1
        for dep in sorted(decls[key].deps):
            visit(dep)
        state[key] = 2
        out.append(decls[key])

    for key in roots:
        visit(key)
    return out


def merge(toolkits: list[ToolkitHeaders]) -> tuple[str, str, dict]:
    """Merge toolkits (oldest first) into (types header, PFN header, provenance)."""
    newest_first = sorted(toolkits, key=lambda t: _version_key(t.version), reverse=True)
    chosen: dict[str, Declaration] = {}
    chosen_from: dict[str, str] = {}
    order: list[str] = []
    for tk in newest_first:
        for key, decl in tk.declarations.items():
            if key not in chosen:
                chosen[key] = decl
                chosen_from[key] = tk.version
                order.append(key)

    # An enumerator may only be defined once.  An older-only enum whose members a newer
    # toolkit moved into a renamed enum becomes an alias of that enum
    # (13.5 renamed CUdevSmResourceSplit_flags to CUdevSmResourceSplitByCount_flags).
    owner: dict[str, str] = {}
    renamed: dict[str, str] = {}
    for key in order:
        moved = {owner[e] for e in chosen[key].enumerators if e in owner}
        if not moved:
            for e in chosen[key].enumerators:
                owner[e] = key
            continue
        if len(moved) != 1 or chosen_from[key] == chosen_from[next(iter(moved))] or \
                not set(chosen[key].enumerators) <= {e for e, k in owner.items() if k in moved}:
            raise SystemExit(f"gen_headers: {key} shares enumerators with {sorted(moved)}")
        new = moved.pop()
        if key.startswith("enum "):
            renamed[key] = new
        else:  # an anonymous enum behind a typedef: the typedef becomes an alias
            alias = new if not new.startswith("enum ") else new
            chosen[key] = Declaration(key, f"typedef {alias} {key};", {new})
    for old, new in renamed.items():
        del chosen[old]
        order.remove(old)
        for decl in chosen.values():
            if old in decl.deps:
                decl.text = re.sub(rf"\b{old}\b", new, decl.text)
                decl.deps = (decl.deps - {old}) | {new}

    pfn: dict[str, Declaration] = {}
    pfn_from: dict[str, list[str]] = {}
    for tk in toolkits:
        for name in tk.pfn:
            pfn_from.setdefault(name, []).append(tk.version)
    for tk in newest_first:
        for name, decl in tk.pfn.items():
            pfn.setdefault(name, decl)

    missing = {d for decl in list(chosen.values()) + list(pfn.values()) for d in decl.deps
               if d not in chosen and d not in _BUILTIN_TYPES and not d.startswith(("struct ", "union "))
               and d not in _SCALAR_SIZES and d not in ("void", "char", "float", "double", "signed",
                                                        "unsigned", "short", "long", "int")}
    if missing:
        raise SystemExit(f"gen_headers: undefined types {sorted(missing)}")

    defines: dict[str, tuple[int, str | None]] = {}
    for tk in newest_first:
        for name, value in tk.defines.items():
            if name not in defines and name not in owner:
                defines[name] = value

    roots = [k for k in order]
    ordered = _dependency_order(chosen, roots)
    types_lines = [d.text for d in ordered]
    types_lines += [f"#define {name} {value}" for name, (value, _) in sorted(defines.items())]
    pfn_lines = [pfn[n].text for n in sorted(pfn, key=_pfn_sort_key)]
    stand_in_types = {name: header for tk in toolkits for header in sorted(tk.stand_ins)
                      for name, _ in STAND_INS[header] if name}
    windows_only = {n for tk in toolkits for n in tk.windows_only}
    aliases: dict[str, dict[str, str]] = {}
    for tk in toolkits:
        for alias, target in tk.aliases.items():
            aliases.setdefault(alias, {})[tk.version] = target
    provenance = {
        "generator": "tools/gen_headers.py",
        "toolkits": [{"version": t.version, "source": t.source, "sha256": t.sha256,
                      "headers": sorted(t.headers)}
                     for t in toolkits],
        "stand_in_types": dict(sorted(stand_in_types.items())),
        "windows_only": sorted({_PFN_NAME.match(n).group(1) for n in windows_only}),
        "header_aliases": dict(sorted(aliases.items())),
        # the functions of every typedef header but cudaTypedefs.h, with their header
        "symbol_headers": dict(sorted((sym, header) for tk in toolkits for sym, header in tk.symbol_headers.items()
                                      if header != TYPEDEF_HEADERS[0])),
        "pfn_typedefs": {n: pfn_from[n] for n in sorted(pfn, key=_pfn_sort_key)},
        "types": {k: chosen_from[k] for k in sorted(chosen)},
        "pointer_constants": {n: t for n, (_, t) in sorted(defines.items()) if t},
    }
    return "\n".join(types_lines) + "\n", "\n".join(pfn_lines) + "\n", provenance


def write(out: Path, types_h: str, pfn_h: str, provenance: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_types.h").write_text(types_h)
    (out / "cuda_pfn.h").write_text(pfn_h)
    (out / "provenance.json").write_text(json.dumps(provenance, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toolkit", action="append", metavar="VERSION=PATH",
                   help="a toolkit wheel or include directory; repeat. Default: the pinned six, via pip")
    p.add_argument("--windows-toolkit", action="append", default=[], metavar="VERSION=PATH",
                   help="the Windows wheel or include directory with the D3D headers of --toolkit VERSION")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("CUPROC_TOOLKIT_CACHE",
                                                                      Path.home() / ".cache/cuproc-toolkits")))
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "headers")
    p.add_argument("--cpp", default=os.environ.get("CC", "cc"))
    args = p.parse_args(argv)
    if shutil.which(args.cpp) is None:
        p.error(f"no C preprocessor: {args.cpp!r} not found (set CC)")
    sources: list[tuple[str, Path]] = []
    windows: dict[str, Path] = {}
    if args.toolkit:
        for item in args.toolkit:
            version, _, path = item.partition("=")
            sources.append((version, Path(path)))
        for item in args.windows_toolkit:
            version, _, path = item.partition("=")
            windows[version] = Path(path)
    else:
        sources = [(v, download_toolkit(req, args.cache)) for v, req in PINNED_TOOLKITS]
        windows = {v: download_toolkit(req, args.cache, _WINDOWS_PLATFORMS) for v, req in PINNED_TOOLKITS}
    sources.sort(key=lambda s: _version_key(s[0]))
    toolkits = [extract(v, src, args.cpp, windows.get(v)) for v, src in sources]
    types_h, pfn_h, provenance = merge(toolkits)
    write(args.out, types_h, pfn_h, provenance)
    print(f"gen_headers: {len(provenance['types'])} types, {len(provenance['pfn_typedefs'])} PFN typedefs, "
          f"{types_h.count('#define')} defines from {', '.join(v for v, _ in sources)} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
