"""Driver-layer benchmarks: import, open + first call, resolving every symbol, a trivial call.

Run on the GPU machine: ``python benchmarks/bench_driver.py --out DIR``.  Times cuproc beside the
C floor (``c_floor.c``), ctypes, bare cffi and cuda.bindings, all in this one run.  The trivial
call is cuCtxGetCurrent: a bare cffi call -- a cffi function pointer to the address the driver
resolved, held in a local -- is what cuproc's raw call is held to; cuproc's raw call is timed in each
way a user reaches it, and as the very object it publishes, held in a local (on the compiled fast path
that is a C trampoline, not a cffi pointer: it is the row the namespace's own overhead is read from).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    ROOT,
    Goals,
    build_c,
    child_ms,
    fast_path_active,
    machine,
    one_cpu,
    paired_ratio,
    per_call_us,
    round_order,
    smoke_driver,
    write_results, bench_args, bench_parser)

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # installed packages have .pyc
BARE = "bare cffi (a cffi function pointer to the resolved address, in a local)"
OWN_LOCAL = "cuproc raw, its published function in a local (drv.resolve; a C trampoline on the fast path)"
MODULE_ATTR = "cuproc raw, module namespace (cu.cuCtxGetCurrent; every name bound at the first function taken)"
PLAIN_MODULE = "the same function as the attribute of a plain one-name module (CPython's own module attribute load)"
BARE_LIB = "bare cffi, library attribute (lib.cuCtxGetCurrent on ffi.dlopen of the same libcuda)"
IMPORTED = "cuproc raw, imported name (from cuproc.driver import cuCtxGetCurrent)"
CHECKED = "cuproc checked (drv.checked.cuCtxGetCurrent, bound)"
BINDINGS = "cuda.bindings (returns a tuple)"
PRELOAD = "cuproc preload (every symbol), fresh process"
PRELOAD_QUERIES = "bare cffi loop over preload's own queries (symbol, query version, stream flag)"
PRELOAD_TABLE = "cuproc selection table alone (Registry.entries), fresh process"
PRELOAD_WARM = "cuproc preload, the registry's symbol tables built before the timing"
PRELOAD_TOUCH = "cuproc preload then drv.cuX of every symbol, fresh process (what preload defers)"
MODULE_FIRST = "cuproc first function from the module namespace (binds every name), fresh process, driver opened"


def c_floor(tmp: Path) -> dict | None:
    exe = build_c("c_floor.c", tmp, shared=False)
    if exe is None:
        return None
    from cuproc.registry import default_registry
    names = tmp / "names.txt"
    names.write_text("\n".join(default_registry()) + "\n")
    return json.loads(subprocess.run([str(exe), str(names)], capture_output=True, text=True, check=True).stdout)


def import_times(runs: int, smoke: bool) -> dict[str, float]:
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "cuproc")], env=ENV, check=True)
    timed = "import time; t = time.perf_counter(); {}; print((time.perf_counter() - t) * 1e3)"
    out = {"cuproc": child_ms(timed.format("import cuproc"), runs, env=ENV),
           "ctypes": child_ms(timed.format("import ctypes"), runs, env=ENV),
           "cffi (_cffi_backend)": child_ms(timed.format("import _cffi_backend"), runs, env=ENV)}
    if not smoke:
        try:
            out["cuda.bindings.driver"] = child_ms(timed.format("from cuda.bindings import driver"), runs, env=ENV)
        except subprocess.CalledProcessError:
            pass
    return out


def open_first_call_times(runs: int, smoke: bool) -> dict[str, float]:
    timed = "{setup}\nimport time; t = time.perf_counter()\n{body}\nprint((time.perf_counter() - t) * 1e3)"
    out = {"cuproc": child_ms(timed.format(
        setup="import cuproc; from cuproc import driver as cu; p = cuproc.ffi.new('int *')",
        body="cu.cuDriverGetVersion(p)"), runs, env=ENV)}
    if not smoke:
        out["ctypes"] = child_ms(timed.format(
            setup="import ctypes", body="ctypes.CDLL('libcuda.so.1').cuDriverGetVersion(ctypes.byref(ctypes.c_int()))"),
            runs, env=ENV)
        try:
            out["cuda.bindings"] = child_ms(timed.format(
                setup="from cuda.bindings import driver", body="driver.cuDriverGetVersion()"), runs, env=ENV)
        except subprocess.CalledProcessError:
            pass
    return out


def resolve_all_times(runs: int) -> dict[str, float]:
    """Both preload rows build the (version, flag) selection table inside the timing (Registry.entries),
    which reads every symbol's typedef names; in the second, the Symbols built before have parsed those of
    the 161 symbols with several typedefs, and the table takes those parses.
    preload() asks the driver only: each name's Resolution and published callable are made on first use,
    which the PRELOAD_TOUCH row adds back."""
    out = {"cuproc registry build": child_ms(
        "import cuproc.registry as r, time; t = time.perf_counter(); r.default_registry();"
        "print((time.perf_counter() - t) * 1e3)", runs, env=ENV)}
    out[PRELOAD] = child_ms(
        "import cuproc, time; d = cuproc.Driver(); d.open(); d.registry.newest_version;"
        "t = time.perf_counter(); d.preload(); print((time.perf_counter() - t) * 1e3)", runs, env=ENV)
    out[PRELOAD_WARM] = child_ms(
        "import cuproc, time; d = cuproc.Driver(); d.open(); r = d.registry; [r[n] for n in r];"
        "t = time.perf_counter(); d.preload(); print((time.perf_counter() - t) * 1e3)", runs, env=ENV)
    out[MODULE_FIRST] = child_ms(
        "import cuproc, time; from cuproc import driver as cu; cu.default_driver().open();"
        "t = time.perf_counter(); cu.cuCtxGetCurrent; print((time.perf_counter() - t) * 1e3)", runs, env=ENV)
    out[PRELOAD_TOUCH] = child_ms(
        "import cuproc, time; d = cuproc.Driver(); d.open(); d.registry.newest_version; names = list(d.registry);"
        "t = time.perf_counter(); d.preload(); [getattr(d, n) for n in names];"
        "print((time.perf_counter() - t) * 1e3)", runs, env=ENV)
    # The bare loops: a query list made untimed, then one cffi call per name through the library's own
    # cuGetProcAddress_v2.  Every name at the driver's version, flag 0; and the very queries preload() makes
    # (each available symbol at its selected ABI's query version, with the handle's stream flag): the floor of
    # making them from Python.  On the fast path preload() makes them in one C call, below this row; the C floor
    # row is the floor of the queries themselves.
    bare_loop = ("p = cuproc.ffi.new('void **'); s = cuproc.ffi.new('CUdriverProcAddressQueryResult *');"
                 "g = lib.get_proc_address; t = time.perf_counter()\n"
                 "for n, q, f in qs: g(n, p, q, f, s)\n"
                 "print((time.perf_counter() - t) * 1e3)")
    out["bare cffi loop over cuGetProcAddress_v2"] = child_ms(
        "import cuproc, time; from cuproc.loader import open_library; lib = open_library(); v = lib.version_int();"
        "qs = [(n.encode(), v, 0) for n in cuproc.default_registry()];" + bare_loop, runs, env=ENV)
    out[PRELOAD_QUERIES] = child_ms(
        "import cuproc, time; from cuproc.driver import FLAG_PER_THREAD, FLAG_LEGACY_STREAM;"
        "d = cuproc.Driver(); d.open(); lib = d.library; pt = d.per_thread_default_stream;"
        "f = FLAG_PER_THREAD if pt else FLAG_LEGACY_STREAM;"
        "qs = [(n.encode(), e.query_version, f) for n, e in d.registry.entries(d.version, per_thread=pt).items()"
        " if e.availability == cuproc.registry.AVAILABLE and e.abi_version <= lib.version_int()];" + bare_loop,
        runs, env=ENV)
    out[PRELOAD_TABLE] = child_ms(
        "import cuproc, time; d = cuproc.Driver(); d.open(); d.registry.newest_version;"
        "t = time.perf_counter(); d.registry.entries(d.version, per_thread=d.per_thread_default_stream);"
        "print((time.perf_counter() - t) * 1e3)", runs, env=ENV)
    return out


def _bare_cffi_library(path: str) -> dict | None:
    """{"lib": ffi.dlopen(path) of a fresh cffi FFI declaring cuCtxGetCurrent, "lp": a void **}, or None
    when the library does not export it (the fake driver's functions are reached only through
    cuGetProcAddress).  ABI mode (libffi), as bare cffi is without a compiler."""
    import cffi
    bare = cffi.FFI()
    bare.cdef("int cuCtxGetCurrent(void **pctx);")
    lib = bare.dlopen(path)
    try:
        lib.cuCtxGetCurrent
    except AttributeError:
        return None
    return {"lib": lib, "lp": bare.new("void **")}


ROUNDS = 15   # trivial-call rows take turns this many times


def _ratio(paired: dict[tuple[str, str], float], row: str, reference: str) -> str:
    """A paired ratio for a note, "n/a" where either row did not run."""
    value = paired.get((row, reference))
    return "n/a" if value is None else f"{value:.3f}"


class Interleaved(NamedTuple):
    best: dict[str, float]                 # each row's best round (µs per call)
    paired: dict[tuple[str, str], float]   # (row, reference): median over rounds of row / reference in that round
    rounds: int


def _interleaved(rows: dict[str, tuple[str, dict]], number: int, rounds: int,
                 pairs: list[tuple[str, str]]) -> Interleaved:
    """The rows take turns for ``rounds`` rounds (after one warm-up pass), pinned to one CPU, the
    order shuffled anew each round (harness.round_order).

    Why: a trivial call is about 0.1 µs, and two rows that make the very same call differed by a
    fifth in one run (a slow spell of the machine, or a move to another core, landing on one row).
    Pinned (to the highest CPU allowed: CPU 0 takes most interrupts), with each ratio a goal reads
    taken within a round and the median over the rounds, what moves both rows of a pair cancels,
    and a new order each round (harness.round_order) gives no row a fixed place after any other; each
    row's best round is kept for the table."""
    for stmt, g in rows.values():     # warm-up, before pinning (harness.one_cpu)
        per_call_us(stmt, max(number // 10, 1), repeat=1, globals=g)
    with one_cpu():
        times: dict[str, list[float]] = {name: [] for name in rows}
        names = list(rows)
        for r in range(rounds):
            for name in round_order(names, r):
                stmt, g = rows[name]
                times[name].append(per_call_us(stmt, number, repeat=3, globals=g))
    paired = {(a, b): r for a, b in pairs if a in times and b in times
              and (r := paired_ratio(times[a], times[b])) is not None}
    return Interleaved({name: min(v) for name, v in times.items()}, paired, rounds)


def published_and_bare(drv: object, name: str) -> tuple[object, object]:
    """(what cuproc publishes for ``name``: a trampoline on the fast path, else the cffi pointer; the cffi
    function pointer to the same resolved address, what a bare cffi user calls)."""
    from cuproc import fastpath
    published = drv.resolve(name)   # type: ignore[attr-defined]
    return published, fastpath.pointer(published)


def trivial_call_times(number: int, smoke: bool) -> Interleaved:
    import ctypes

    import cuproc
    from cuproc import driver as cu
    drv = cu.default_driver()
    drv.checked.cuInit(0)
    pctx = cuproc.ffi.new("CUcontext *")
    cu.cuCtxGetCurrent(pctx)
    raw, bare = published_and_bare(drv, "cuCtxGetCurrent")
    from cuproc.driver import cuCtxGetCurrent  # type: ignore[attr-defined]
    plain = types.ModuleType("plain")   # the control: what `module.name(p)` costs in CPython itself
    plain.cuCtxGetCurrent = cuCtxGetCurrent
    g = {"cu": cu, "drv": drv, "p": pctx, "raw": raw, "bare": bare, "imported": cuCtxGetCurrent, "plain": plain,
         "checked": drv.checked.cuCtxGetCurrent}
    rounds = 2 if smoke else ROUNDS
    rows: dict[str, tuple[str, dict]] = {
        BARE: ("bare(p)", g), OWN_LOCAL: ("raw(p)", g), IMPORTED: ("imported(p)", g), MODULE_ATTR: ("cu.cuCtxGetCurrent(p)", g),
        PLAIN_MODULE: ("plain.cuCtxGetCurrent(p)", g),
        "cuproc raw, handle attribute (drv.cuCtxGetCurrent)": ("drv.cuCtxGetCurrent(p)", g),
        CHECKED: ("checked(p)", g),
        "cuproc checked, via namespace lookup (cu.checked.cuCtxGetCurrent)": ("cu.checked.cuCtxGetCurrent(p)", g)}
    bare_lib = _bare_cffi_library(str(drv.library.path))
    if bare_lib is not None:   # the namespace form of bare cffi: an attribute load on its library object
        rows[BARE_LIB] = ("lib.cuCtxGetCurrent(lp)", bare_lib)
    if not smoke:
        lib = ctypes.CDLL(drv.library.path)
        cfn = lib.cuCtxGetCurrent
        cfn.argtypes, cfn.restype = [ctypes.c_void_p], ctypes.c_int
        rows["ctypes"] = ("cfn(cref)", {"cfn": cfn, "cref": ctypes.byref(ctypes.c_void_p())})
        try:
            from cuda.bindings import driver as cbd
            cbd.cuInit(0)
            rows[BINDINGS] = ("f()", {"f": cbd.cuCtxGetCurrent})
        except ImportError:
            pass
    # cu.cuCtxGetCurrent above was the module's first function: it bound every name and removed the lazy hook
    if "__getattr__" in vars(cu):
        raise RuntimeError("the module namespace is still lazy after a function was taken from it")
    return _interleaved(rows, number, rounds, [(MODULE_ATTR, BARE), (IMPORTED, BARE), (CHECKED, IMPORTED),
                                               (IMPORTED, BINDINGS), (MODULE_ATTR, PLAIN_MODULE),
                                               (PLAIN_MODULE, OWN_LOCAL), (MODULE_ATTR, OWN_LOCAL),
                                               (IMPORTED, OWN_LOCAL), (OWN_LOCAL, BARE)])


def main(argv: list[str] | None = None) -> int:
    args = bench_args(bench_parser(), argv)
    runs, number = (2, 2000) if args.smoke else (15, 100_000)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            fake = smoke_driver()
            ENV["CUPROC_LIBCUDA"] = str(fake.path)
            floor = None
        else:
            floor = c_floor(Path(tmp))
    data = {"machine": machine(), "smoke": args.smoke, "c_floor": floor,
            "import_ms": import_times(runs, args.smoke), "open_first_call_ms": open_first_call_times(runs, args.smoke),
            "resolve_all_ms": resolve_all_times(runs)}
    trivial = trivial_call_times(number, args.smoke)
    data["trivial_call_us"] = trivial.best
    data["trivial_call_paired_ratios"] = {f"{a} / {b}": r for (a, b), r in trivial.paired.items()}
    table = []
    for group, unit in (("import_ms", "ms"), ("open_first_call_ms", "ms"), ("resolve_all_ms", "ms"),
                        ("trivial_call_us", "µs")):
        floor_value = (floor or {}).get(group if group != "import_ms" else "", None)
        if floor_value is not None:
            table.append([group, "C floor", f"{floor_value:.4f} {unit}", "1.00"])
        for name, value in data[group].items():
            table.append([group, name, f"{value:.4f} {unit}", f"{value / floor_value:.2f}" if floor_value else ""])
    why = "smoke run" if args.smoke else None
    paired = trivial.paired
    goals = Goals()
    goals.check("raw call through cuproc.driver.cuX (module namespace, no preload()) <= 1.05x a bare cffi call "
                "(a cffi pointer in a local)", paired.get((MODULE_ATTR, BARE)), 1.05, why_not=why)
    goals.check("raw call through cuproc.driver.cuX <= 1.05x the very function it names, held in a local "
                "(the namespace's own cost: one module attribute load; this goal's reading before bbb76c7, when "
                "the row named bare cffi was the published function)", paired.get((MODULE_ATTR, OWN_LOCAL)), 1.05,
                why_not=why)
    goals.check("checked call <= 1.15x the raw call (both bound to a name)", paired.get((CHECKED, IMPORTED)), 1.15,
                why_not=why)
    goals.check("preload() of every symbol <= 2 ms (fresh process: registry tables built lazily inside)",
                data["resolve_all_ms"][PRELOAD], 2.0, unit=" ms", why_not=why)
    goals.check("preload() of every symbol <= 2 ms (registry tables built before)",
                data["resolve_all_ms"][PRELOAD_WARM], 2.0, unit=" ms", why_not=why)
    goals.check("import cuproc <= 40 ms (benchmarks/, earlier goal)", data["import_ms"]["cuproc"], 40.0, unit=" ms",
                why_not=why)
    goals.fast_only("fast path: trivial raw call <= cuda.bindings in the same run (ours / theirs)",
                    paired.get((IMPORTED, BINDINGS)), 1.0)
    notes = ["ratio column: against the C floor of the same group, same run.",
             f"trivial calls: the rows take turns for {trivial.rounds} rounds (after a warm-up pass), pinned to one CPU; the "
             "table shows each row's best round, and each goal's ratio is the median over the rounds of the ratio "
             "within a round",
             "the module namespace binds every C name when the first function is taken from it (what preload() "
             f"does): {data['resolve_all_ms'][MODULE_FIRST]:.2f} ms once per process in this run (the '{MODULE_FIRST}' "
             "row); a Driver handle stays lazy per symbol",
             "import, then open and a first call, fresh processes (medians added): " + ", ".join(
                 f"{who} {data['import_ms'][imp] + data['open_first_call_ms'][who]:.1f} ms"
                 for who, imp in (("cuproc", "cuproc"), ("cuda.bindings", "cuda.bindings.driver"), ("ctypes", "ctypes"))
                 if imp in data["import_ms"] and who in data["open_first_call_ms"]) +
             " (cuproc's first call goes through the module namespace: it binds every name)",
             "the bare cffi row calls the cffi function pointer to the address the driver resolved (what a bare "
             "cffi user holds); cuproc publishes that very pointer on the pure path and a C trampoline bound to it on "
             f"the fast path: cuproc's published function in a local reads {_ratio(paired, OWN_LOCAL, BARE)}x the bare "
             "cffi call in this run",
             "the imported-name row and the published-function row call the same object: their paired ratio, "
             f"{_ratio(paired, IMPORTED, OWN_LOCAL)}, is how far two identical rows differ in this run; the imported "
             f"name reads {_ratio(paired, IMPORTED, BARE)}x the bare cffi call (no goal: on the pure path it is the "
             "same object, on the fast path a trampoline against libffi)",
             "the bare cffi library-attribute row (ABI mode, libffi) is for information: no goal is read against it",
             "the module namespace's call is one module attribute load more than the published function in a local: "
             f"cuproc.driver.cuX reads {_ratio(paired, MODULE_ATTR, OWN_LOCAL)}x that; the control row, the same "
             f"function on a plain one-name module, reads {_ratio(paired, PLAIN_MODULE, OWN_LOCAL)}x, and "
             f"cuproc.driver.cuX {_ratio(paired, MODULE_ATTR, PLAIN_MODULE)}x the control (what cuproc's namespace "
             "adds over CPython's own load); on the pure path the published function is the bare cffi pointer, so "
             "there the namespace goal reads this load alone",
             f"compiled fast path active: {fast_path_active()}"]
    path = write_results(args.out, "bench_driver", data, table, ["group", "what", "time", "x C floor"], notes, goals)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
