"""Launch overhead: the empty (float*, int, float) kernel, grid 1, block 32, values changing every launch.

Every launcher in one run on the GPU machine: the C loop (``c_floor_launch.c``), cuproc's prepared
launch (both conventions), cuproc's one-shot launch, bare cffi with a packed buffer, cuda.bindings,
cuda.core and CuPy.  Burst: the median host time per enqueue over 200 bursts of 256; steady: 20,000
launches then a synchronize, per launch.  Goal: cuproc's prepared launch <= 1.25x the C loop's burst.
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, machine, write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
CUBIN = ROOT / "kernels" / "kernels.cubin"
BURST, REPS, STEADY = 256, 200, 20_000
DEFAULT = "cuproc prepared (default)"   # what Function.prepare gives without options


def c_floor() -> dict:
    cc = shutil.which("cc") or shutil.which("gcc")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp, "c_floor_launch")
        subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "c_floor_launch.c"), "-ldl"], check=True)
        return json.loads(subprocess.run([str(exe), str(CUBIN)], capture_output=True, text=True,
                                         check=True).stdout)


def measure(launch_one, sync) -> dict:
    for i in range(BURST):  # warm up
        launch_one(i)
    sync()
    bursts = []
    for _ in range(REPS):
        sync()
        t = time.perf_counter()
        for i in range(BURST):
            launch_one(i)
        bursts.append((time.perf_counter() - t) / BURST)
    sync()
    t = time.perf_counter()
    for i in range(STEADY):
        launch_one(i)
    sync()
    steady = (time.perf_counter() - t) / STEADY
    return {"burst_us": statistics.median(bursts) * 1e6, "steady_us": steady * 1e6}


def launchers() -> dict:
    import cuproc
    from cuproc import Module
    out: dict = {}
    pc = cuproc.use_device(0)
    data_label = ""
    drv = cuproc.driver.default_driver()
    module = Module.load(CUBIN)
    fn = module.get_function("empty")
    buf = cuproc.DeviceBuffer(1024)
    sync = drv.checked.cuCtxSynchronize if cuproc._support.arity(drv, "cuCtxSynchronize") == 0 else \
        (lambda: drv.checked.cuCtxSynchronize(cuproc.ffi.NULL))
    sig = ["float*", "int", "float"]

    default = fn.prepare(sig, 1, 32)   # the value for the float parameter is an int: stored as float, like C's (float)i
    out[DEFAULT] = measure(lambda i: default(buf, i, i), sync)
    out["cuproc prepared, float(i) passed"] = measure(lambda i: default(buf, i, float(i)), sync)
    for entry in ("cuLaunchKernelEx", "cuLaunchKernel"):
        for conv in ("buffer", "params"):
            if (entry, conv) == (default.entry, default.convention):
                continue
            prepared = fn.prepare(sig, 1, 32, convention=conv, entry=entry)
            out[f"cuproc prepared ({entry}, {conv})"] = measure(lambda i: prepared(buf, i, i), sync)
    run = default.launcher()
    out["cuproc prepared .launcher()"] = measure(lambda i: run(buf, i, i), sync)
    data_label = f"{default.entry}, {default.convention}"
    out["cuproc Function.launch (signature)"] = measure(
        lambda i: fn.launch(1, 32, (buf, i, float(i)), signature=sig), sync)

    # bare cffi: the packed buffer by hand, through the same raw function pointer
    ffi = cuproc.ffi
    block = ffi.new("char[16]")
    p_ptr, p_n, p_x = ffi.cast("uint64_t *", block), ffi.cast("int *", block + 8), ffi.cast("float *", block + 12)
    p_ptr[0] = buf.ptr
    size = ffi.new("size_t *", 16)
    extra = ffi.new("void *[]", [ffi.cast("void *", 1), block, ffi.cast("void *", 2), size, ffi.cast("void *", 0)])
    raw = drv.cuLaunchKernel
    handle = fn.handle

    def bare(i):
        p_n[0] = i
        p_x[0] = i
        raw(handle, 1, 1, 1, 32, 1, 1, 0, ffi.NULL, ffi.NULL, extra)
    out["bare cffi (packed buffer)"] = measure(bare, sync)
    raw_ex = drv.cuLaunchKernelEx
    config = ffi.new("CUlaunchConfig *", {"gridDimX": 1, "gridDimY": 1, "gridDimZ": 1, "blockDimX": 32,
                                          "blockDimY": 1, "blockDimZ": 1})

    def bare_ex(i):
        p_n[0] = i
        p_x[0] = i
        raw_ex(config, handle, ffi.NULL, extra)
    out["bare cffi (cuLaunchKernelEx, packed buffer)"] = measure(bare_ex, sync)

    try:
        from cuda.bindings import driver as cbd
        _, cmod = cbd.cuModuleLoadData(CUBIN.read_bytes())
        _, cfn = cbd.cuModuleGetFunction(cmod, b"empty")
        ptr = buf.ptr
        types = (None, ctypes.c_int, ctypes.c_float)

        def bindings(i):
            cbd.cuLaunchKernel(cfn, 1, 1, 1, 32, 1, 1, 0, 0, ((ptr, i, float(i)), (ctypes.c_void_p,) + types[1:]), 0)
        out["cuda.bindings cuLaunchKernel"] = measure(bindings, sync)
    except Exception:  # noqa: BLE001 - a peer that fails is reported, not fatal
        out["cuda.bindings cuLaunchKernel"] = {"error": traceback.format_exc(limit=2)}

    try:
        try:
            from cuda.core import Device as CDevice, LaunchConfig, ObjectCode, launch as core_launch
        except ImportError:
            from cuda.core.experimental import Device as CDevice, LaunchConfig, ObjectCode, launch as core_launch
        cdev = CDevice(0)
        cdev.set_current()
        stream = cdev.default_stream
        kernel = ObjectCode.from_cubin(CUBIN.read_bytes()).get_kernel("empty")
        config = LaunchConfig(grid=1, block=32)
        ptr = buf.ptr

        def core(i):
            core_launch(stream, config, kernel, ptr, np.int32(i), np.float32(i))
        out["cuda.core launch"] = measure(core, sync)
    except Exception:  # noqa: BLE001
        out["cuda.core launch"] = {"error": traceback.format_exc(limit=2)}

    try:
        import cupy
        rk = cupy.RawModule(path=str(CUBIN)).get_function("empty")
        ptr = buf.ptr

        def cupy_launch(i):
            rk((1,), (32,), (ptr, np.int32(i), np.float32(i)))
        out["CuPy RawModule"] = measure(cupy_launch, sync)
    except Exception:  # noqa: BLE001
        out["CuPy RawModule"] = {"error": traceback.format_exc(limit=2)}

    buf.close()
    module.unload()
    drv.cuCtxSetCurrent(ffi.NULL)
    pc.release()
    out[DEFAULT]["entry"] = data_label
    return out


def plot(data: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [("C loop", data["c_floor"]["params"]["burst_us"])] + [
        (k, v["burst_us"]) for k, v in data["launchers"].items() if "burst_us" in v]
    rows.sort(key=lambda r: r[1])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh([r[0] for r in rows], [r[1] for r in rows],
            color=["#4c72b0" if r[0].startswith("cuproc") else "#999999" for r in rows])
    ax.axvline(1.25 * data["c_floor"]["params"]["burst_us"], color="red", linestyle="--", label="1.25x C loop")
    ax.set_xlabel("host time per launch, burst of 256 (µs)")
    ax.set_title(f"Launch overhead, {data['machine'].get('gpu')}, {data['machine']['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    floor = c_floor()
    data = {"machine": machine(), "c_floor": floor, "launchers": launchers()}
    c_names = {"params": "C loop over cuLaunchKernel", "buffer": "C loop over cuLaunchKernel (packed buffer)",
               "ex_params": "C loop over cuLaunchKernelEx", "ex_buffer": "C loop over cuLaunchKernelEx (packed buffer)"}
    base = floor["params"]["burst_us"]
    rows = [[c_names[k], f"{v['burst_us']:.2f}", f"{v['steady_us']:.2f}", f"{v['burst_us'] / base:.2f}"]
            for k, v in floor.items()]
    for name, v in data["launchers"].items():
        if "error" in v:
            rows.append([name, "error", "", v["error"].strip().splitlines()[-1][:60]])
        else:
            rows.append([name, f"{v['burst_us']:.2f}", f"{v['steady_us']:.2f}", f"{v['burst_us'] / base:.2f}"])
    ours = data["launchers"][DEFAULT]["burst_us"]
    peers = {k: v["burst_us"] for k, v in data["launchers"].items()
             if not k.startswith(("cuproc", "bare")) and "burst_us" in v}
    notes = [f"cuproc prepared launch (the default: {data['launchers'][DEFAULT].get('entry')}) / C loop over "
             f"cuLaunchKernel (burst): {ours / base:.2f}x (goal <= 1.25x)",
             "faster than every peer in this run: " + ("yes" if all(ours < v for v in peers.values()) else "NO") +
             " (" + ", ".join(f"{k} {v / ours:.2f}x ours" for k, v in peers.items()) + ")",
             "plot: bench_launch.png"]
    args.out.mkdir(parents=True, exist_ok=True)
    plot(data, args.out / "bench_launch.png")
    path = write_results(args.out, "bench_launch", data, rows,
                         ["launcher", "burst of 256 (µs/launch)", "steady 20,000 + sync (µs)", "burst x C loop"], notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
