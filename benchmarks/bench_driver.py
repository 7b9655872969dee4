"""Driver-layer benchmarks: import, open + first call, resolving every symbol, a trivial call.

Run on the GPU machine: ``python benchmarks/bench_driver.py --out DIR``.  Times
cuproc beside the C floor (``c_floor.c``), ctypes, bare cffi and cuda-bindings,
all in this one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, child_ms, machine, per_call_us, write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # installed packages have .pyc


def c_floor() -> dict | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    from cuproc.registry import default_registry
    with tempfile.TemporaryDirectory() as tmp:
        exe, names = Path(tmp, "c_floor"), Path(tmp, "names.txt")
        names.write_text("\n".join(default_registry()) + "\n")
        subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "c_floor.c"), "-ldl"], check=True)
        return json.loads(subprocess.run([str(exe), str(names)], capture_output=True, text=True,
                                         check=True).stdout)


def import_times() -> dict[str, float]:
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "cuproc")], env=ENV, check=True)
    timed = "import time; t = time.perf_counter(); {}; print((time.perf_counter() - t) * 1e3)"
    out = {
        "cuproc": child_ms(timed.format("import cuproc"), env=ENV),
        "ctypes": child_ms(timed.format("import ctypes"), env=ENV),
        "cffi (_cffi_backend)": child_ms(timed.format("import _cffi_backend"), env=ENV),
    }
    try:
        out["cuda.bindings.driver"] = child_ms(timed.format("from cuda.bindings import driver"), env=ENV)
    except subprocess.CalledProcessError:
        pass
    return out


def open_first_call_times() -> dict[str, float]:
    timed = ("{setup}\nimport time; t = time.perf_counter()\n{body}\nprint((time.perf_counter() - t) * 1e3)")
    out = {
        "cuproc": child_ms(timed.format(
            setup="import cuproc; from cuproc import driver as cu; p = cuproc.ffi.new('int *')",
            body="cu.cuDriverGetVersion(p)"), env=ENV),
        "ctypes": child_ms(timed.format(
            setup="import ctypes", body="ctypes.CDLL('libcuda.so.1').cuDriverGetVersion(ctypes.byref(ctypes.c_int()))"),
            env=ENV),
    }
    try:
        out["cuda.bindings"] = child_ms(timed.format(
            setup="from cuda.bindings import driver", body="driver.cuDriverGetVersion()"), env=ENV)
    except subprocess.CalledProcessError:
        pass
    return out


def resolve_all_times() -> dict[str, float]:
    out = {}
    out["cuproc registry build"] = child_ms(
        "import cuproc.registry as r, time; t = time.perf_counter(); r.default_registry();"
        "print((time.perf_counter() - t) * 1e3)", env=ENV)
    out["cuproc preload (every symbol)"] = child_ms(
        "import cuproc, time; cuproc.default_registry(); d = cuproc.Driver(); d.open();"
        "t = time.perf_counter(); d.preload(); print((time.perf_counter() - t) * 1e3)", env=ENV)
    out["bare cffi loop over cuGetProcAddress_v2"] = child_ms(
        "import cuproc, time; from cuproc.loader import open_library; lib = open_library();"
        "names = [n.encode() for n in cuproc.default_registry()]; v = lib.version_int();"
        "p = cuproc.ffi.new('void **'); s = cuproc.ffi.new('CUdriverProcAddressQueryResult *');"
        "g = lib.get_proc_address; t = time.perf_counter()\n"
        "for n in names: g(n, p, v, 0, s)\n"
        "print((time.perf_counter() - t) * 1e3)", env=ENV)
    return out


def trivial_call_times() -> dict[str, float]:
    import ctypes

    import cuproc
    from cuproc import driver as cu
    drv = cu.default_driver()
    drv.checked.cuInit(0)
    pctx = cuproc.ffi.new("CUcontext *")
    raw = drv.cuCtxGetCurrent
    checked = drv.checked.cuCtxGetCurrent
    cu.cuCtxGetCurrent(pctx)
    lib = ctypes.CDLL(drv.library.path)
    cfn = lib.cuCtxGetCurrent
    cfn.argtypes, cfn.restype = [ctypes.c_void_p], ctypes.c_int
    cctx = ctypes.c_void_p()
    cref = ctypes.byref(cctx)
    g = {"cu": cu, "drv": drv, "p": pctx, "raw": raw, "checked": checked, "cfn": cfn, "cref": cref}
    out = {
        "bare cffi (local function pointer)": per_call_us("raw(p)", globals=g),
        "cuproc raw, module namespace (cu.cuCtxGetCurrent)": per_call_us("cu.cuCtxGetCurrent(p)", globals=g),
        "cuproc raw, handle attribute (drv.cuCtxGetCurrent)": per_call_us("drv.cuCtxGetCurrent(p)", globals=g),
        "cuproc checked (drv.checked.cuCtxGetCurrent)": per_call_us("checked(p)", globals=g),
        "cuproc checked, via namespace lookup": per_call_us("cu.checked.cuCtxGetCurrent(p)", globals=g),
        "ctypes": per_call_us("cfn(cref)", globals=g),
    }
    try:
        from cuda.bindings import driver as cbd
        cbd.cuInit(0)
        out["cuda.bindings (returns a tuple)"] = per_call_us("f()", globals={"f": cbd.cuCtxGetCurrent})
    except ImportError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    floor = c_floor()
    data = {"machine": machine(), "c_floor": floor, "import_ms": import_times(),
            "open_first_call_ms": open_first_call_times(), "resolve_all_ms": resolve_all_times(),
            "trivial_call_us": trivial_call_times()}
    table = []
    for group, unit in (("import_ms", "ms"), ("open_first_call_ms", "ms"), ("resolve_all_ms", "ms"),
                        ("trivial_call_us", "µs")):
        floor_value = (floor or {}).get(group if group != "import_ms" else "", None)
        if floor_value is not None:
            table.append([group, "C floor", f"{floor_value:.4f} {unit}", "1.00"])
        for name, value in data[group].items():
            ratio = f"{value / floor_value:.2f}" if floor_value else ""
            table.append([group, name, f"{value:.4f} {unit}", ratio])
    tc = data["trivial_call_us"]
    bare = tc["bare cffi (local function pointer)"]
    notes = [
        f"raw call / bare cffi: {tc['cuproc raw, handle attribute (drv.cuCtxGetCurrent)'] / bare:.2f}x "
        f"(module namespace {tc['cuproc raw, module namespace (cu.cuCtxGetCurrent)'] / bare:.2f}x); "
        f"checked call: {tc['cuproc checked (drv.checked.cuCtxGetCurrent)']:.3f} µs (goal <= 0.35 µs)",
        f"import cuproc: {data['import_ms']['cuproc']:.1f} ms (goal <= 40 ms)",
        "ratio column: against the C floor of the same group, same run.",
    ]
    path = write_results(args.out, "bench_driver", data, table, ["group", "what", "time", "x C floor"], notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
