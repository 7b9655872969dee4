#!/usr/bin/env python3
"""Generate and build ``cuproc._fastpath_c``, the optional compiled fast path, from ``headers/``.

Why: a call through a cffi function pointer in ABI mode goes through libffi; a call into a
cffi *API-mode* extension is a direct C call.  This module is one API-mode extension holding

* one trampoline per ``PFN_`` typedef of ``headers/cuda_pfn.h``:
  ``CUresult cuproc_PFN_x(PFN_x fn, <the typedef's parameters>) { return fn(<names>); }``.
  It calls the pointer it is given -- the one cuGetProcAddress returned for the variant
  cuproc.driver selected -- and never links against libcuda.  The pointer is an argument, not a
  global slot, because several ``Driver`` handles (other versions, stream flags, libraries)
  coexist in one process and must not share pointers; ``cuproc.fastpath`` binds it once per
  handle and symbol (a bound method: no cost per call beyond the argument).
  Typedefs taking a struct by value get none: cuproc.driver passes those as integers in the
  pure path, and the two paths must take the same arguments (they stay on the cffi pointer).
* for typedefs of at most one parameter, :data:`SLOTS` *slot* trampolines
  ``cuproc_PFN_x_s<k>(<parameters>)`` that call the pointer in a static slot.  cffi calls a
  function of one argument without building a tuple, so a trivial call costs ~60 ns instead of
  ~100 ns through the bound pointer argument (a no-op C function, this machine).  A slot is
  claimed once with one pointer (``cuproc_slot_claim``, compare-and-swap) and never rewritten,
  so handles that resolved the same pointer share it and a handle with another pointer takes the
  next slot, or the pointer-argument trampoline when all are taken.
* the prepared-launch packer of ``src/fastpath/fastpath_launch.c``.
* the checked call of ``src/fastpath/fastpath_checked.c`` (``drv.checked.cuX``: call, test the result, raise).
* stream-ordered allocation of ``src/fastpath/fastpath_memory.c`` (``alloc_async`` / ``DeviceBuffer.free_async``).
* synchronous allocation of ``src/fastpath/fastpath_device_buffer.c`` (``DeviceBuffer(n)``, ``close``/``free``) and
  the one-step claim of every resource (``Resource._claim``).
* ``memory.copy`` between a device buffer and host memory, ``src/fastpath/fastpath_copy.c``.
* ``preload()``'s driver queries in one call, ``src/fastpath/fastpath_resolve.c`` (``cuproc_ask_all``).
* the declarations of ``headers/`` themselves, so that the module's ``ffi`` knows every type:
  cffi cannot ``include()`` the out-of-line ABI module into an API-mode one, so with the fast
  path on, this ``ffi`` is *the* ffi of cuproc (``cuproc._ffi``) and cdata passes between the
  trampolines and the rest of cuproc without casts.
* ``cuproc_abi_digest()`` and ``cuproc_tools_digest()``: the digests (cuproc/_fastpath_digest.py) of
  ``cuproc/_cffi_abi.py`` and of this tool and its C sources (the ``make_launcher`` and
  ``make_checked`` argument tuples, the slot trampolines).  A module built from other headers or other tools is not loaded
  (``cuproc.fastpath.status()`` says so).
* the contract constants Python reads instead of repeating them: ``CUPROC_SLOTS`` and the
  ``enum cuproc_kind`` values of the launcher's argument kinds.

Rerunnable: everything comes from ``headers/`` (any typedef issue 10 adds gets its trampoline at
the next build).  ``setup.py`` calls :func:`ffibuilder` at install; ``python
tools/build_fastpath.py`` builds the module in place in a checkout.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

import cffi

ROOT = Path(__file__).resolve().parent.parent
HEADER_ORDER = ("cuda_types.h", "cuda_pfn.h")
MODULE = "cuproc._fastpath_c"
_PFN_DECL = re.compile(r"^typedef CUresult \(\*(PFN_\w+)\)\((.*)\);$", re.MULTILINE)


def typedefs(headers: Path) -> list[tuple[str, list[str]]]:
    """(typedef name, [parameter declarations]) of every PFN typedef, in header order."""
    text = (headers / "cuda_pfn.h").read_text()
    found = []
    for name, params in _PFN_DECL.findall(text):
        decls = [] if params.strip() == "void" else [p.strip() for p in params.split(",")]
        found.append((name, decls))
    if len(found) != text.count("typedef"):
        raise ValueError("cuda_pfn.h has a typedef this tool does not read (not 'typedef CUresult (*PFN_x)(...);')")
    return found


def _param_name(decl: str) -> str:
    names = re.findall(r"[A-Za-z_]\w*", decl)
    if len(names) < 2:   # headers/ names every parameter; a bare type would need a generated name
        raise ValueError(f"unnamed parameter {decl!r} in cuda_pfn.h")
    return names[-1]


def _passes_struct_by_value(ffi: cffi.FFI, name: str) -> bool:
    return any(arg.kind in ("struct", "union") for arg in ffi.typeof(name).args)


# Slot trampolines per typedef of at most one parameter (see the module docstring).
SLOTS = 2


def trampolines(headers: Path, ffi: cffi.FFI) -> tuple[list[str], list[str]]:
    """(cdef declarations, C definitions) of the trampolines, the slots and ``cuproc_slot_claim``."""
    cdefs, bodies, slotted = [], [], []
    for name, params in typedefs(headers):
        if _passes_struct_by_value(ffi, name):
            continue
        names = ", ".join(_param_name(p) for p in params)
        signature = f"CUresult cuproc_{name}({', '.join([f'{name} cuproc_fn', *params])})"
        cdefs.append(signature + ";")
        bodies.append(f"{signature} {{ return cuproc_fn({names}); }}")
        if len(params) <= 1:
            base = len(slotted) * SLOTS
            slotted.append(name)
            for k in range(SLOTS):
                slot_signature = f"CUresult cuproc_{name}_s{k}({', '.join(params) or 'void'})"
                cdefs.append(slot_signature + ";")
                bodies.append(f"{slot_signature} {{ return (({name})cuproc_slots[{base + k}])({names}); }}")
    table = ", ".join(f'"{name}"' for name in sorted(slotted))
    order = ", ".join(str(slotted.index(name) * SLOTS) for name in sorted(slotted))
    bodies.insert(0, f"static void *cuproc_slots[{max(len(slotted) * SLOTS, 1)}];")
    bodies.append(f"""
static const char *const cuproc_slot_names[] = {{{table}}};   /* sorted, for bsearch */
static const int cuproc_slot_bases[] = {{{order}}};
static int cuproc_slot_compare(const void *key, const void *item) {{
    return strcmp((const char *)key, *(const char *const *)item);
}}
/* 1: slot k of typedef holds fn (now or already); 0: it holds another pointer; -1: no such slot */
int cuproc_slot_claim(const char *typedef_name, int k, void *fn) {{
    const char *const *found = bsearch(typedef_name, cuproc_slot_names, {len(slotted)}, sizeof(char *),
                                       cuproc_slot_compare);
    void *expected = NULL;
    if (found == NULL || k < 0 || k >= {SLOTS} || fn == NULL) return -1;
    void **slot = &cuproc_slots[cuproc_slot_bases[found - cuproc_slot_names] + k];
    if (__atomic_compare_exchange_n(slot, &expected, fn, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return 1;
    return expected == fn;
}}""")
    cdefs.append("int cuproc_slot_claim(const char *typedef_name, int k, void *fn);")
    return cdefs, bodies


def _load(root: Path, name: str):  # type: ignore[no-untyped-def] - a module object
    """cuproc/<name>.py loaded by path, without importing cuproc (whose package import would load the
    very module being rebuilt)."""
    spec = importlib.util.spec_from_file_location(f"_cuproc_build_{name}", root / "cuproc" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digest_module(root: Path):  # type: ignore[no-untyped-def] - a module object
    """cuproc/_fastpath_digest.py: the one digest cuproc._ffi checks."""
    return _load(root, "_fastpath_digest")


def abi_ffi(root: Path) -> cffi.FFI:
    """The out-of-line ABI module's ffi (cuproc/_cffi_abi.py, generated from the same headers/: its digest is
    built into the module, and cuproc._ffi loads nothing else).  Why not the API-mode ffi being built:
    its ``typeof`` re-parses a declaration of every known typedef on each query, and asking it for each
    PFN typedef took 73 s of a 2-core machine's install; the ABI module answers from its tables in
    about 10 ms."""
    return _load(root, "_cffi_abi").ffi  # type: ignore[no-any-return]


# The launcher's argument kinds (src/fastpath/fastpath_launch.c enum cuproc_kind), declared to cffi so
# that Python reads their values from the module.
_KIND_CDEF = """enum cuproc_kind { CUPROC_K_PTR, CUPROC_K_I8, CUPROC_K_I16, CUPROC_K_I32, CUPROC_K_I64, CUPROC_K_U8,
    CUPROC_K_U16, CUPROC_K_U32, CUPROC_K_U64, CUPROC_K_F32, CUPROC_K_F64, CUPROC_K_COUNT };
#define CUPROC_SLOTS ...
"""


def ffibuilder(root: Path = ROOT) -> cffi.FFI:
    """The API-mode FFI of ``cuproc._fastpath_c`` (compile with ``.compile()`` or setuptools)."""
    headers = root / "headers"
    declarations = "".join((headers / name).read_text() for name in HEADER_ORDER)
    ffi = cffi.FFI()
    ffi.cdef(declarations)
    cdefs, bodies = trampolines(headers, abi_ffi(root))
    digests = digest_module(root)
    abi, tools = digests.digest(root, digests.ABI_INPUTS), digests.digest(root, digests.TOOL_INPUTS)
    ffi.cdef("\n".join(cdefs) + "\nconst char *cuproc_abi_digest(void);\nconst char *cuproc_tools_digest(void);\n"
             "int cuproc_install_launcher(void);\nint cuproc_install_checked(void);\nint cuproc_install_memory(void);\n"
             "int cuproc_install_device_buffer(void);\nint cuproc_install_copy(void);\n"
             "int cuproc_ask_all(void *lookup, int v2, const char *names, size_t size, const int *versions,\n"
             "                   unsigned long long flags, int n, void **pointers, int *statuses);\n" + _KIND_CDEF)
    source = "\n".join([
        "#include <stdint.h>", "#include <stddef.h>", "#include <string.h>", declarations,
        f"#define CUPROC_SLOTS {SLOTS}",
        *bodies,
        f'const char *cuproc_abi_digest(void) {{ return "{abi}"; }}',
        f'const char *cuproc_tools_digest(void) {{ return "{tools}"; }}',
        *((root / name).read_text() for name in digests.C_SOURCES),   # the hand-written C
    ])
    # The launcher and the checked call use the full C API (vectorcall, GIL state): no limited API.  -O1: the
    # trampolines are one call each, and -O2 doubles the build time for nothing measurable.
    ffi.set_source(MODULE, source, py_limited_api=False, define_macros=[("_CFFI_NO_LIMITED_API", None)],
                   extra_compile_args=["-O1"] if sys.platform != "win32" else [])
    return ffi


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build cuproc._fastpath_c in place (a checkout's cuproc/)")
    p.add_argument("--root", type=Path, default=ROOT)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(ffibuilder(args.root).compile(tmpdir=tmp))
        target = args.root / "cuproc" / built.name
        # A new file renamed over the old one: a process that has the old module loaded keeps its mapping
        # (rewriting the file in place made such a process, e.g. a test run, die of SIGBUS).  Windows
        # refuses to replace a loaded .pyd either way.
        fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(built.read_bytes())
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(partial, 0o666 & ~mask)   # what a plain new file gets (mkstemp makes it 0600)
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):   # the write or the rename failed: leave nothing behind
                os.unlink(partial)
    print(f"build_fastpath: wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
