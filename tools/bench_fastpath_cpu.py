#!/usr/bin/env python3
"""CPU micro-benchmark of the compiled fast path against the pure path, on the stateful fake driver.

No GPU needed: the fake driver (tests/fakedriver.c) answers every call in C, so the numbers are
cuproc's own cost per call plus the fake's (small, and the same on both paths).  Each path runs in
its own process (``CUPROC_PURE_PYTHON=1`` for the pure one); per row, the best of 7 repeats.

    python tools/bench_fastpath_cpu.py            # prints a table: ns per call, pure vs fast

Rows: the bare cffi pointer (libffi, the floor cuproc's raw names had before the fast path),
``drv.cuCtxGetCurrent`` (1 argument) and its checked form, ``drv.cuLaunchKernelEx`` (4 arguments), and a prepared
launch of ``(float*, int, float)`` whose values change on every call.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
N = 100_000


def measure() -> dict[str, float]:
    sys.path.insert(0, str(ROOT / "tests"))
    from fakedriver import build, fake_image

    import cuproc
    from cuproc import Module, fastpath
    fake = build(Path(tempfile.mkdtemp(prefix="cuproc-bench-")))
    fake.set_launch_pause(False)   # the race detector sleeps per parameter: no use for timing
    drv = cuproc.Driver(library=str(fake.path))
    cuproc.set_default_driver(drv)
    ctx = cuproc.use_device(0)
    fn = Module.load(fake_image({"empty": [8, 4, 4]})).get_function("empty")
    buf = cuproc.DeviceBuffer(256)
    run = fn.prepare(["float*", "int", "float"], grid=1, block=32)
    prepared = run.prepared if hasattr(run, "prepared") else None
    out = cuproc.ffi.new("CUcontext *")
    ptr = drv.resolution("cuCtxGetCurrent").function
    launch_ptr = drv.resolution("cuLaunchKernelEx").function
    config = cuproc.ffi.new("CUlaunchConfig *")
    config.gridDimX = config.gridDimY = config.gridDimZ = 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 32, 1, 1
    params = cuproc.ffi.new("void *[]", [cuproc.ffi.new("uint64_t *", buf.address), cuproc.ffi.new("int *", 1),
                                        cuproc.ffi.new("float *", 1.0)])
    ints = list(range(1000))
    floats = [i * 0.5 for i in range(1000)]
    env = dict(ptr=ptr, out=out, raw=drv.cuCtxGetCurrent, checked=drv.checked.cuCtxGetCurrent, lptr=launch_ptr, lraw=drv.cuLaunchKernelEx,
               config=config, h=fn.handle, params=params, NULL=cuproc.ffi.NULL, run=run, buf=buf,
               ints=ints, floats=floats)
    rows = {
        "bare cffi pointer: cuCtxGetCurrent": "ptr(out)",
        "drv.cuCtxGetCurrent": "raw(out)",
        "drv.checked.cuCtxGetCurrent": "checked(out)",
        "bare cffi pointer: cuLaunchKernelEx (4 args)": "lptr(config, h, params, NULL)",
        "drv.cuLaunchKernelEx (4 args)": "lraw(config, h, params, NULL)",
        "prepared launch (float*, int, float), values change": "run(buf, ints[i % 1000], floats[i % 1000])",
    }
    result = {"fastpath": fastpath.status()}
    for name, stmt in rows.items():
        loop = f"for i in range({N}):\n    {stmt}"
        best = min(timeit.repeat(loop, globals=env, number=1, repeat=7))
        result[name] = best / N * 1e9
    # the empty loop's own cost, to subtract where a reader wants the call alone
    result["(loop overhead: for i in range + i % 1000 indexing)"] = min(timeit.repeat(
        f"for i in range({N}):\n    ints[i % 1000], floats[i % 1000]", globals=env, number=1, repeat=7)) / N * 1e9
    assert fake.stale_count() == 0 and fake.launch_count() > 0
    del prepared
    buf.free()
    ctx.release()
    return result


def main() -> int:
    if os.environ.get("CUPROC_BENCH_CHILD"):
        print(json.dumps(measure()))
        return 0
    results = {}
    for label, pure in (("pure", "1"), ("fast", "0")):
        env = dict(os.environ, CUPROC_BENCH_CHILD="1", CUPROC_PURE_PYTHON=pure)
        text = subprocess.run([sys.executable, __file__], env=env, check=True, capture_output=True,
                              text=True).stdout
        results[label] = json.loads(text.strip().splitlines()[-1])
    print(f"fast path: {results['fast'].pop('fastpath')}; pure: {results['pure'].pop('fastpath')}")
    print(f"| ns per call (best of 7 x {N}) | pure | fast | fast/pure |")
    print("|---|---|---|---|")
    for row in results["pure"]:
        p, f = results["pure"][row], results["fast"][row]
        print(f"| {row} | {p:.0f} | {f:.0f} | {f / p:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
