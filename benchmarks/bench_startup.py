"""Startup: a fresh process to "device usable" (device 0's context current and a first 256-byte
allocation), side by side: C, ctypes + cuInit, cuproc, cuda.bindings, cuda.core, CuPy and torch.

Each row is the wall time of a whole fresh process, measured from here around ``subprocess.run``
(interpreter start included, the same for every Python row), median over several runs, the rows
taking turns.  Goal (issue 9): cuproc within 15 ms of ctypes + cuInit doing the same.  The results
also list the cuproc modules that a first allocation imported.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    ROOT,
    Goals,
    build_c,
    machine,
    plot_bars,
    smoke_driver,
    write_results,
)

PY = {
    "python -c pass (interpreter alone)": "pass",
    "ctypes + cuInit": (
        "import ctypes; l = ctypes.CDLL('libcuda.so.1'); l.cuInit(0); d = ctypes.c_int(); "
        "l.cuDeviceGet(ctypes.byref(d), 0); c = ctypes.c_void_p(); l.cuDevicePrimaryCtxRetain(ctypes.byref(c), d); "
        "l.cuCtxSetCurrent(c); p = ctypes.c_uint64(); "
        "assert l.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(256)) == 0"),
    "cuproc": "import cuproc; pc = cuproc.use_device(0); cuproc.DeviceBuffer(256)",
    "cuda.bindings": (
        "from cuda.bindings import driver as d; d.cuInit(0); _, dev = d.cuDeviceGet(0); "
        "_, c = d.cuDevicePrimaryCtxRetain(dev); d.cuCtxSetCurrent(c); e, p = d.cuMemAlloc(256); assert e == 0"),
    "cuda.core": (
        "try:\n from cuda.core import Device\nexcept ImportError:\n from cuda.core.experimental import Device\n"
        "dev = Device(0); dev.set_current(); dev.allocate(256, stream=dev.default_stream)"),   # 1.x: keyword-only
    "CuPy": "import cupy; cupy.cuda.Device(0).use(); cupy.cuda.alloc(256)",
    "torch": "import torch; torch.empty(256, dtype=torch.uint8, device='cuda')",
}
MODULES = ("import sys, cuproc; pc = cuproc.use_device(0); cuproc.DeviceBuffer(256); "
           "print(' '.join(sorted(m for m in sys.modules if m.startswith('cuproc'))))")


def run_once(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return (time.perf_counter() - t) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--smoke", action="store_true", help="cuproc on the fake driver only")
    p.add_argument("--runs", type=int, default=9)
    args = p.parse_args(argv)
    env = dict(os.environ)
    runs = 2 if args.smoke else args.runs
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        commands: dict[str, list[str]] = {}
        if args.smoke:
            env["CUPROC_LIBCUDA"] = str(smoke_driver().path)
            names = ["python -c pass (interpreter alone)", "cuproc"]
        else:
            exe = build_c("c_startup.c", Path(tmp), shared=False)
            if exe is not None:
                commands["C (dlopen, cuInit, primary context, cuMemAlloc)"] = [str(exe)]
            names = list(PY)
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "cuproc")], env=env, check=True)
        commands.update({name: [sys.executable, "-c", PY[name]] for name in names})
        for name, cmd in list(commands.items()):     # once each: a failing peer is reported, not timed
            try:
                run_once(cmd, env)
            except (subprocess.CalledProcessError, OSError) as exc:
                tail = getattr(exc, "stderr", b"") or b""
                errors[name] = (tail.decode(errors="replace").strip().splitlines() or [str(exc)])[-1][:160]
                del commands[name]
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(runs):
            for name, cmd in commands.items():
                times[name].append(run_once(cmd, env))
        modules = subprocess.run([sys.executable, "-c", MODULES], env=env, check=True, capture_output=True,
                                 text=True).stdout.split()
    ms = {name: statistics.median(v) for name, v in times.items()}
    goals = Goals()
    ours, ctypes_ms = ms.get("cuproc"), ms.get("ctypes + cuInit")
    goals.check("cuproc startup to device usable within 15 ms of ctypes + cuInit (median ours - median theirs)",
                ours - ctypes_ms if ours is not None and ctypes_ms is not None else None, 15.0, unit=" ms",
                why_not="smoke run" if args.smoke else None)
    if "cuproc" in times and "ctypes + cuInit" in times:   # the same goal on the worst pairing of runs
        goals.check("... and on the slowest cuproc run against the fastest ctypes + cuInit run",
                    max(times["cuproc"]) - min(times["ctypes + cuInit"]), 15.0, unit=" ms")
    data = {"machine": machine(), "smoke": args.smoke, "startup_ms": ms, "runs_ms": times, "errors": errors,
            "cuproc_modules_imported": modules}
    table = [[name, f"{v:.1f}", f"{min(times[name]):.1f} - {max(times[name]):.1f}",
              f"{v - ctypes_ms:+.1f}" if ctypes_ms else ""] for name, v in sorted(ms.items(), key=lambda kv: kv[1])]
    table += [[name, "missing", "", why[:70]] for name, why in errors.items()]
    notes = [f"median of {runs} fresh processes per row, rows taking turns; range: fastest - slowest run",
             f"cuproc modules imported by use_device(0) + DeviceBuffer(256) ({len(modules)}): {' '.join(modules)}"]
    args.out.mkdir(parents=True, exist_ok=True)
    plot = plot_bars(args.out / "bench_startup.png", f"Fresh process to device usable, {data['machine'].get('gpu')}, "
                     f"{data['machine']['date']}", "ms (median)",
                     [(k, v) for k, v in ms.items() if not k.startswith("C ")],
                     next(((k, v) for k, v in ms.items() if k.startswith("C ")), None))
    path = write_results(args.out, "bench_startup", data, table,
                         ["process", "ms (median)", "range (ms)", "median vs ctypes + cuInit"], notes,
                         goals, [plot])
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
