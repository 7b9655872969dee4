"""A simulated CUDA driver: a small shared library built from C with the machine's compiler.

It answers like the real driver, quirks included (measured on driver 580 / CUDA 13.0):

* ``cuGetProcAddress_v2`` above the driver's own version: CUDA_ERROR_INVALID_VALUE.
* a symbol the driver lacks (introduced after the driver's version): CUDA_SUCCESS,
  status SYMBOL_NOT_FOUND, NULL.
* below a symbol's first version: CUDA_SUCCESS, status VERSION_NOT_SUFFICIENT, NULL.
* per-thread entries exist from max(introduced, 7.0) on.
* ``cuGetProcAddress`` (v1, 11.3-11.8 drivers) reports failures as CUDA_ERROR_NOT_FOUND.

The driver's version is set at run time (``sim_set_driver_version``); which lookup
functions the library *exports* is fixed at build time, so there is one build
per generation: ``v2`` (12.0+), ``v1`` (11.3-11.8) and ``none`` (before 11.3).
Every entry stub records its own name (``sim_last_called``) and returns
``sim_set_result``'s code.  The lookup logic is written here in C, apart from
cuproc's Python registry; only the table of entries comes from the headers.
Functions the headers declare only for Windows (``windows_only`` in
``headers/provenance.json``) are left out, as a Linux driver lacks them.
``extra`` rows add entries the headers do not have, as a newer driver would.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_REAL = {"cuGetProcAddress", "cuGetProcAddress_v2", "cuDriverGetVersion", "cuInit", "cuGetErrorName",
         "cuGetErrorString"}
GENERATIONS = {"v2": ("-DSIM_GPA_V1", "-DSIM_GPA_V2"), "v1": ("-DSIM_GPA_V1",), "none": ()}


Row = tuple[str, int, str, "str | None"]


def _table() -> list[Row]:
    """(symbol, version, entry, per-thread entry) for every ABI variant in headers/ (Linux: no Windows-only)."""
    text = (ROOT / "headers" / "cuda_pfn.h").read_text()
    windows_only = set(json.loads((ROOT / "headers" / "provenance.json").read_text())["windows_only"])
    variants: dict[str, set[int]] = {}
    suffix: dict[str, str] = {}
    for name, version, pt in re.findall(r"\(\*PFN_(\w+?)_v(\d+)(_ptds|_ptsz)?\)", text):
        if name in windows_only:
            continue
        if pt:
            suffix[name] = pt
        else:
            variants.setdefault(name, set()).add(int(version))
    rows = []
    for name in sorted(variants):
        for k, version in enumerate(sorted(variants[name]), start=1):
            entry = name if k == 1 else f"{name}_v{k}"
            rows.append((name, version, entry, entry + suffix[name] if name in suffix else None))
    return rows


def _error_names() -> list[tuple[int, str]]:
    text = (ROOT / "headers" / "cuda_types.h").read_text()
    body = text[text.index("enum cudaError_enum"):]
    body = body[:body.index("}")]
    return [(int(v), n) for n, v in re.findall(r"(CUDA_\w+) = (-?\d+)", body)]


def source(extra: tuple[Row, ...] = ()) -> str:
    """The C source; ``extra`` rows (symbol, version, entry, per-thread entry or None) are entries the
    headers lack, such as a function only a newer driver has."""
    rows = _table() + list(extra)
    out = [
        "#include <string.h>",
        "#include <stddef.h>",
        "typedef int CUresult;",
        "typedef unsigned long long cuuint64_t;",
        "#define EXPORT __attribute__((visibility(\"default\")))",
        "static int sim_version = 13000;",
        "static const char *sim_last = \"\";",
        "static CUresult sim_result = 0;",
        "static int sim_inits = 0;",
        "EXPORT void sim_set_driver_version(int v) { sim_version = v; }",
        "EXPORT const char *sim_last_called(void) { return sim_last; }",
        "EXPORT void sim_reset_last_called(void) { sim_last = \"\"; }",
        "EXPORT void sim_set_result(int r) { sim_result = r; }",
        "EXPORT int sim_init_count(void) { return sim_inits; }",
    ]
    entries = sorted({e for _, _, e, _ in rows} | {pt for *_, pt in rows if pt})
    for entry in entries:
        if entry not in _REAL:
            out.append(f'EXPORT CUresult {entry}(void) {{ sim_last = "{entry}"; return sim_result; }}')
    out.append(r'''
EXPORT CUresult cuDriverGetVersion(int *v);
EXPORT CUresult cuInit(unsigned int flags);
EXPORT CUresult cuGetErrorName(CUresult code, const char **s);
EXPORT CUresult cuGetErrorString(CUresult code, const char **s);
#define FN_cuDriverGetVersion (void *)cuDriverGetVersion
#define FN_cuInit (void *)cuInit
#define FN_cuGetErrorName (void *)cuGetErrorName
#define FN_cuGetErrorString (void *)cuGetErrorString
#ifdef SIM_GPA_V2
EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, int *);
#define FN_cuGetProcAddress_v2 (void *)cuGetProcAddress_v2
#else
#define FN_cuGetProcAddress_v2 NULL
#endif
#ifdef SIM_GPA_V1
EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
#define FN_cuGetProcAddress (void *)cuGetProcAddress
#else
#define FN_cuGetProcAddress NULL
#endif
''')
    out.append("struct row { const char *symbol; int version; void *fn; void *pt_fn; };")
    out.append("static const struct row table[] = {")
    for name, version, entry, pt in rows:
        fn = f"(void *){entry}" if entry not in _REAL else f"FN_{entry}"
        ptfn = f"(void *){pt}" if pt else "NULL"
        out.append(f'  {{"{name}", {version}, {fn}, {ptfn}}},')
    out.append("  {NULL, 0, NULL, NULL}};")
    out.append("static const struct { int code; const char *name; } errors[] = {")
    out += [f'  {{{code}, "{name}"}},' for code, name in _error_names()]
    out.append("  {0, NULL}};")
    out.append(r'''
EXPORT CUresult cuDriverGetVersion(int *v) { if (!v) return 1; *v = sim_version; return 0; }
EXPORT CUresult cuInit(unsigned int flags) { sim_last = "cuInit"; if (flags) return 1; sim_inits++; return sim_result; }
EXPORT CUresult cuGetErrorName(CUresult code, const char **s) {
  for (int i = 0; errors[i].name; i++) if (errors[i].code == code) { *s = errors[i].name; return 0; }
  *s = NULL; return 1; }
EXPORT CUresult cuGetErrorString(CUresult code, const char **s) {
  for (int i = 0; errors[i].name; i++) if (errors[i].code == code) { *s = "simulated driver error text"; return 0; }
  *s = NULL; return 1; }

/* 0 found, 1 symbol not found, 2 version not sufficient, -1 invalid value */
static int lookup(const char *symbol, void **pfn, int version, cuuint64_t flags) {
  const struct row *best = NULL; int known = 0, has_pt = 0, first = 0;
  *pfn = NULL;
  if (version > sim_version) return -1;
  for (const struct row *r = table; r->symbol; r++) {
    if (strcmp(r->symbol, symbol) || r->version > sim_version) continue;
    if (!known || r->version < first) first = r->version;
    known = 1;
    if (r->pt_fn) has_pt = 1;
    if (r->version <= version && (!best || r->version > best->version)) best = r;
  }
  if (!known) return 1;
  if (!best) return 2;
  if ((flags & 2) && has_pt) {
    if (version < (first > 7000 ? first : 7000)) return 2;
    *pfn = best->pt_fn; return 0;
  }
  *pfn = best->fn; return 0;
}
#ifdef SIM_GPA_V2
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status) {
  int r = lookup(symbol, pfn, version, flags);
  if (r < 0) return 1;
  if (status) *status = r;
  return 0; }
#endif
#ifdef SIM_GPA_V1
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
  int r = lookup(symbol, pfn, version, flags);
  if (r < 0) return 1;
  return r == 0 ? 0 : 500; }
#endif
''')
    return "\n".join(out) + "\n"


class SimDriver:
    """A built simulated driver library and its control functions."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._lib.sim_last_called.restype = ctypes.c_char_p

    def set_version(self, version: int) -> None:
        self._lib.sim_set_driver_version(int(version))

    def set_result(self, code: int) -> None:
        self._lib.sim_set_result(code)

    def last_called(self) -> str:
        return self._lib.sim_last_called().decode()

    def reset_last_called(self) -> None:
        self._lib.sim_reset_last_called()

    def init_count(self) -> int:
        return self._lib.sim_init_count()


def build(out_dir: Path, generation: str = "v2", extra: tuple[Row, ...] = ()) -> SimDriver:
    """Compile (once per source content) the simulated driver of one lookup generation."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build the simulated driver")
    src = source(extra)
    tag = hashlib.sha256((src + generation).encode()).hexdigest()[:12]
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"libsimcuda-{generation}-{tag}.so"
    if not lib.exists():
        c_file = out_dir / f"simcuda-{tag}.c"
        c_file.write_text(src)
        subprocess.run([cc, "-shared", "-fPIC", "-O0", "-w", "-fvisibility=hidden", *GENERATIONS[generation],
                        "-o", str(lib), str(c_file)], check=True)
    return SimDriver(lib)
