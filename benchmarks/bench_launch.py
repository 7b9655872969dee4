"""Launch overhead: the empty (float*, int, float) kernel, grid 1, block 32, values changing every launch.

Every launcher in one process and one run on the GPU machine: the C loop (``c_floor_launch.c``, built
as a shared library and called between the Python bursts), cuproc's prepared launch (default and each
entry x convention), cuproc's one-shot launch, bare cffi, cuda.bindings, cuda.core and CuPy.  The
bursts go round-robin over all launchers, so drift in clocks or load hits every one alike.  Burst:
the median host time per enqueue over 200 bursts of 256; steady: 20,000 launches then a synchronize,
per launch.  The C program in its own process is reported too.  Goal: cuproc's prepared launch
<= 1.25x the C loop over cuLaunchKernel (burst), and faster than every peer.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, machine, write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
CUBIN = ROOT / "kernels" / "kernels.cubin"
BURST, REPS, STEADY = 256, 200, 20_000
DEFAULT = "cuproc prepared (default)"   # what Function.prepare gives without options
C_LOOPS = {"C loop over cuLaunchKernel": 0, "C loop over cuLaunchKernel (packed buffer)": 1,
           "C loop over cuLaunchKernelEx": 2, "C loop over cuLaunchKernelEx (packed buffer)": 3}
FLOOR = "C loop over cuLaunchKernel"


def build_c(tmp: Path) -> tuple[Path, Path]:
    cc = shutil.which("cc") or shutil.which("gcc")
    exe, lib = tmp / "c_floor_launch", tmp / "libc_floor_launch.so"
    src = str(HERE / "c_floor_launch.c")
    subprocess.run([cc, "-O2", "-o", str(exe), src, "-ldl"], check=True)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-DC_FLOOR_LIBRARY", "-o", str(lib), src, "-ldl"], check=True)
    return exe, lib


def c_floor_process(exe: Path) -> dict:
    """The C program in its own process (its own context): the floor with nothing else around."""
    return json.loads(subprocess.run([str(exe), str(CUBIN)], capture_output=True, text=True, check=True).stdout)


def measure_interleaved(loops: dict[str, Callable[[int], object]], natives: set[str],
                        sync: Callable[[], object]) -> dict:
    """Round-robin bursts over every launcher, then a steady run of each.

    ``loops[name](count)`` runs ``count`` launches; the C loops (``natives``) time themselves and
    return seconds per launch, the Python ones are timed here around the call.
    """
    def burst(name: str, count: int) -> float:
        if name in natives:
            return loops[name](count)
        t = time.perf_counter()
        loops[name](count)
        return (time.perf_counter() - t) / count

    for name in loops:   # warm up: the generated code, the driver's caches
        burst(name, BURST)
    bursts: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(REPS):
        for name in loops:
            sync()
            bursts[name].append(burst(name, BURST))
    out = {}
    for name in loops:
        sync()
        t = time.perf_counter()
        loops[name](STEADY)
        sync()
        out[name] = {"burst_us": statistics.median(bursts[name]) * 1e6,
                     "steady_us": (time.perf_counter() - t) / STEADY * 1e6}
    return out


def launchers(c_lib: Path) -> tuple[dict, dict]:
    import cuproc
    from cuproc import Module
    errors: dict = {}
    pythons: dict[str, Callable[[int], None]] = {}
    pc = cuproc.use_device(0)
    drv = cuproc.driver.default_driver()
    module = Module.load(CUBIN)
    fn = module.get_function("empty")
    buf = cuproc.DeviceBuffer(1024)
    sync = drv.checked.cuCtxSynchronize if cuproc._support.arity(drv, "cuCtxSynchronize") == 0 else \
        (lambda: drv.checked.cuCtxSynchronize(cuproc.ffi.NULL))
    sig = ["float*", "int", "float"]

    lib = ctypes.CDLL(str(c_lib))
    lib.c_floor_burst.restype = ctypes.c_double
    lib.c_floor_burst.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int]
    f_addr, ptr = int(cuproc.ffi.cast("uintptr_t", fn.handle)), buf.ptr
    natives = {name: (lambda count, v=v: lib.c_floor_burst(v, f_addr, ptr, count)) for name, v in C_LOOPS.items()}

    # Each Python launcher is measured as the loop a user writes around it, as the C loop is:
    # no wrapper per launch.  The float parameter gets the int i, stored as float: C's x = (float)i.
    default = fn.prepare(sig, 1, 32)

    def cuproc_default(count):
        for i in range(count):
            default(buf, i, i)
    pythons[DEFAULT] = cuproc_default
    for entry in ("cuLaunchKernelEx", "cuLaunchKernel"):
        for conv in ("buffer", "params"):
            if (entry, conv) != (default.entry, default.convention):
                def cuproc_variant(count, prepared=fn.prepare(sig, 1, 32, convention=conv, entry=entry)):
                    for i in range(count):
                        prepared(buf, i, i)
                pythons[f"cuproc prepared ({entry}, {conv})"] = cuproc_variant
    obj = cuproc.launch.PreparedLaunch(fn, sig, 1, 32)

    def cuproc_object(count):
        for i in range(count):
            obj(buf, i, i)
    pythons["cuproc PreparedLaunch object call"] = cuproc_object

    def cuproc_one_shot(count):
        for i in range(count):
            fn.launch(1, 32, (buf, i, i), signature=sig)
    pythons["cuproc Function.launch (signature)"] = cuproc_one_shot

    # bare cffi: the packed buffer by hand, through the same raw function pointers
    ffi = cuproc.ffi
    block = ffi.new("char[16]")
    p_ptr, p_n, p_x = ffi.cast("uint64_t *", block), ffi.cast("int *", block + 8), ffi.cast("float *", block + 12)
    p_ptr[0] = buf.ptr
    size = ffi.new("size_t *", 16)
    extra = ffi.new("void *[]", [ffi.cast("void *", 1), block, ffi.cast("void *", 2), size, ffi.cast("void *", 0)])
    raw, raw_ex, handle, null = drv.cuLaunchKernel, drv.cuLaunchKernelEx, fn.handle, ffi.NULL
    config = ffi.new("CUlaunchConfig *", {"gridDimX": 1, "gridDimY": 1, "gridDimZ": 1, "blockDimX": 32,
                                          "blockDimY": 1, "blockDimZ": 1})

    def bare(count):
        for i in range(count):
            p_n[0] = i
            p_x[0] = i
            raw(handle, 1, 1, 1, 32, 1, 1, 0, null, null, extra)

    def bare_ex(count):
        for i in range(count):
            p_n[0] = i
            p_x[0] = i
            raw_ex(config, handle, null, extra)
    pythons["bare cffi (packed buffer)"] = bare
    pythons["bare cffi (cuLaunchKernelEx, packed buffer)"] = bare_ex

    try:
        from cuda.bindings import driver as cbd
        _, cmod = cbd.cuModuleLoadData(CUBIN.read_bytes())
        _, cfn = cbd.cuModuleGetFunction(cmod, b"empty")
        types = (ctypes.c_void_p, ctypes.c_int, ctypes.c_float)

        def bindings(count):
            for i in range(count):
                cbd.cuLaunchKernel(cfn, 1, 1, 1, 32, 1, 1, 0, 0, ((ptr, i, float(i)), types), 0)
        pythons["cuda.bindings cuLaunchKernel"] = bindings
    except Exception:  # noqa: BLE001 - a peer that fails is reported, not fatal
        errors["cuda.bindings cuLaunchKernel"] = {"error": traceback.format_exc(limit=2)}

    try:
        try:
            from cuda.core import Device as CDevice, LaunchConfig, ObjectCode, launch as core_launch
        except ImportError:
            from cuda.core.experimental import Device as CDevice, LaunchConfig, ObjectCode, launch as core_launch
        cdev = CDevice(0)
        cdev.set_current()
        stream = cdev.default_stream
        kernel = ObjectCode.from_cubin(CUBIN.read_bytes()).get_kernel("empty")
        lconfig = LaunchConfig(grid=1, block=32)

        def core(count):
            for i in range(count):
                core_launch(stream, lconfig, kernel, ptr, np.int32(i), np.float32(i))
        pythons["cuda.core launch"] = core
    except Exception:  # noqa: BLE001
        errors["cuda.core launch"] = {"error": traceback.format_exc(limit=2)}

    try:
        import cupy
        rk = cupy.RawModule(path=str(CUBIN)).get_function("empty")

        def cupy_launch(count):
            for i in range(count):
                rk((1,), (32,), (ptr, np.int32(i), np.float32(i)))
        pythons["CuPy RawModule"] = cupy_launch
    except Exception:  # noqa: BLE001
        errors["CuPy RawModule"] = {"error": traceback.format_exc(limit=2)}

    results = measure_interleaved({**natives, **pythons}, set(natives), sync)
    results[DEFAULT]["entry"] = f"{default.entry}, {default.convention}"
    buf.close()
    module.unload()
    drv.cuCtxSetCurrent(ffi.NULL)
    pc.release()
    return results, errors


def plot(data: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = sorted(((k, v["burst_us"]) for k, v in data["launchers"].items()), key=lambda r: r[1])
    colours = {"cuproc": "#4c72b0", "C loop": "#55a868", "bare": "#bbbbbb"}
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 1.4))
    ax.barh([r[0] for r in rows], [r[1] for r in rows],
            color=[next((c for k, c in colours.items() if r[0].startswith(k)), "#999999") for r in rows])
    ax.invert_yaxis()
    ax.axvline(1.25 * data["launchers"][FLOOR]["burst_us"], color="red", linestyle="--", label="1.25x C loop")
    ax.set_xlabel("host time per launch, burst of 256 (µs)")
    ax.set_title(f"Launch overhead, {data['machine'].get('gpu')}, {data['machine']['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        exe, lib = build_c(Path(tmp))
        own_process = c_floor_process(exe)
        results, errors = launchers(lib)
    data = {"machine": machine(), "c_floor_own_process": own_process, "launchers": results, "errors": errors}
    base = results[FLOOR]["burst_us"]
    rows = []
    for name, v in results.items():
        rows.append([name, f"{v['burst_us']:.2f}", f"{v['steady_us']:.2f}", f"{v['burst_us'] / base:.2f}"])
    for key, name in zip(("params", "buffer", "ex_params", "ex_buffer"), C_LOOPS):
        v = own_process[key]
        rows.append([name + ", own process", f"{v['burst_us']:.2f}", f"{v['steady_us']:.2f}",
                     f"{v['burst_us'] / base:.2f}"])
    for name, v in errors.items():
        rows.append([name, "error", "", v["error"].strip().splitlines()[-1][:60]])
    ours = results[DEFAULT]["burst_us"]
    peers = {k: v["burst_us"] for k, v in results.items() if not k.startswith(("cuproc", "bare", "C loop"))}
    notes = [f"cuproc prepared launch (the default: {results[DEFAULT]['entry']}) / C loop over cuLaunchKernel "
             f"(burst, same process, interleaved): {ours / base:.2f}x (goal <= 1.25x); / the C program in its own "
             f"process: {ours / own_process['params']['burst_us']:.2f}x",
             "faster than every peer in this run: " + ("yes" if all(ours < v for v in peers.values()) else "NO") +
             " (" + ", ".join(f"{k} {v / ours:.2f}x ours" for k, v in peers.items()) + ")",
             "ratio column: burst time against the C loop over cuLaunchKernel in the same process and run",
             "plot: bench_launch.png"]
    args.out.mkdir(parents=True, exist_ok=True)
    plot(data, args.out / "bench_launch.png")
    path = write_results(args.out, "bench_launch", data, rows,
                         ["launcher", "burst of 256 (µs/launch)", "steady 20,000 + sync (µs)", "burst x C loop"], notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
