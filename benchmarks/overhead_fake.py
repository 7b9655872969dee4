"""Python-side cost per operation, measured against the stateful fake driver (no GPU needed).

The fake driver (tests/fakedriver.c) answers almost at once, so what this prints is what
cuproc's Python layer adds per operation on this CPU.  The floor is a bare cffi call loop
through the same function pointer.  Not a GPU benchmark (gpu_check runs bench_*.py only):
run it before and after a change to the object layer::

    python benchmarks/overhead_fake.py            # builds tests/fakedriver.c with cc
"""
from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import timeit
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def per_op_us(fn, number: int, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=1, repeat=repeat) if number == 1 else
               [timeit.timeit(fn, number=number) for _ in range(repeat)]) / number * 1e6


def measure(number: int, repeat: int = 5) -> dict[str, float]:
    import fakedriver
    from fakedriver import build, fake_image

    import cuproc
    from cuproc import memory
    # The fake pauses before reading each launch parameter (its race detector): a copy without the
    # pause, so a launch costs what the other calls cost and cuproc's own time shows.
    work = Path(tempfile.mkdtemp(prefix="cuproc-fake-"))
    source = fakedriver.C_SOURCE.read_text()
    pause = "  nanosleep(&ts, NULL);\n  sched_yield();\n"
    if pause not in source:
        raise SystemExit("tests/fakedriver.c changed: update the pause this benchmark removes")
    (work / "fakedriver.c").write_text(source.replace(pause, "  (void)ts;\n"))
    fakedriver.C_SOURCE = work / "fakedriver.c"
    fake = build(work)
    fake.reset()
    drv = cuproc.Driver(library=str(fake.path))
    cuproc.set_default_driver(drv)
    pc = cuproc.use_device(0)
    ffi = cuproc.ffi
    module = cuproc.Module.load(fake_image({"empty": [8, 4, 4]}))
    fn = module.get_function("empty")
    buf = cuproc.DeviceBuffer(1024)
    stream = cuproc.Stream(non_blocking=True)
    sig = ["float*", "int", "float"]
    prepared = fn.prepare(sig, 1, 32)
    raw_get, pctx = drv.cuCtxGetCurrent, ffi.new("CUcontext *")
    checked_get = drv.checked.cuCtxGetCurrent
    ns = cuproc.driver
    ns.cuCtxGetCurrent(pctx)
    alloc, free, pdev = drv.cuMemAlloc, drv.cuMemFree, ffi.new("CUdeviceptr *")
    alloc_a, free_a, hs = drv.cuMemAllocAsync, drv.cuMemFreeAsync, stream.handle
    pinned = memory.PinnedBuffer(4096)
    dev4k = cuproc.DeviceBuffer(4096)
    htod = drv.cuMemcpyHtoD
    hp = ffi.cast("void *", pinned.ptr)
    i32, f32 = np.int32, np.float32
    rows: dict[str, float] = {}

    def loop(name, body):
        rows[name] = per_op_us(body, number, repeat)

    loop("bare cffi cuCtxGetCurrent (local pointer)", lambda: raw_get(pctx))
    loop("cuproc.driver.cuCtxGetCurrent (module namespace)", lambda: ns.cuCtxGetCurrent(pctx))
    loop("drv.checked.cuCtxGetCurrent (bound)", lambda: checked_get(pctx))
    loop("prepared launch (float*, int, float)", lambda: prepared(buf, 7, 7))
    loop("one-shot launch, signature, Python int and float", lambda: fn.launch(1, 32, (buf, 7, 7.0), signature=sig))
    a, b = i32(7), f32(7)
    loop("one-shot launch, signature, NumPy scalars prebuilt", lambda: fn.launch(1, 32, (buf, a, b), signature=sig))
    loop("one-shot launch, NumPy scalars built per call", lambda: fn.launch(1, 32, (buf, i32(7), f32(7))))
    loop("one-shot launch, NumPy scalars prebuilt", lambda: fn.launch(1, 32, (buf, a, b)))
    loop("one-shot launch, NumPy scalars prebuilt, on a Stream", lambda: fn.launch(1, 32, (buf, a, b), stream=stream))
    loop("building the NumPy scalars alone (the caller's part above)", lambda: (buf, i32(7), f32(7)))
    # The grid changing launch after launch (grid = ceil(n / block) for a varying n): each row walks its
    # own cycle of grids, the fixed one too, so the three differ only in how many grids they meet.
    for label, count in (("the same grid", 1), ("8 grids in turn", 8), ("1000 grids in turn", 1000)):
        nxt = itertools.cycle(range(1, count + 1)).__next__
        loop(f"one-shot launch, NumPy scalars prebuilt, {label}", lambda nxt=nxt: fn.launch(nxt(), 32, (buf, a, b)))
        loop(f"one-shot launch, signature, {label}", lambda nxt=nxt: fn.launch(nxt(), 32, (buf, 7, 7.0), signature=sig))
    loop("bare cffi cuMemAlloc+cuMemFree", lambda: (alloc(pdev, 256), free(pdev[0])))
    loop("DeviceBuffer(256).free()", lambda: cuproc.DeviceBuffer(256).free())
    loop("bare cffi cuMemAllocAsync+cuMemFreeAsync", lambda: (alloc_a(pdev, 256, hs), free_a(pdev[0], hs)))
    loop("alloc_async(256, stream).free_async()", lambda: memory.alloc_async(256, stream).free_async())
    loop("bare cffi cuMemcpyHtoD 4 KiB pinned", lambda: htod(dev4k.address, hp, 4096))
    loop("memory.copy 4 KiB pinned -> device", lambda: memory.copy(dev4k, pinned))
    # Graph replay: one captured launch, launched through the bare pointer, the replay closure and
    # GraphExec.launch (what issue 36's host-time goal compares)
    with cuproc.capture(stream) as graph:
        fn.launch(1, 32, (buf, a, b), stream=stream)
    exe = graph.instantiate()
    graph_launch, he = drv.cuGraphLaunch, exe.handle
    replay = exe.replay(stream)
    loop("bare cffi cuGraphLaunch (local pointer)", lambda: graph_launch(he, hs))
    loop("GraphExec.replay(stream)() (prepared)", replay)
    loop("GraphExec.launch(stream)", lambda: exe.launch(stream))
    exe.close()
    graph.close()
    preload_ms = []
    for _ in range(5):
        d = cuproc.Driver(library=str(fake.path))
        d.open()
        d.registry  # noqa: B018 - built outside the timing
        t = timeit.default_timer()
        d.preload()
        preload_ms.append((timeit.default_timer() - t) * 1e3)
    rows["preload() every symbol, ms"] = min(preload_ms)
    for o in (pinned, dev4k, buf, stream):
        o.close()
    module.unload()
    drv.cuCtxSetCurrent(ffi.NULL)
    pc.release()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--number", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=5, help="timings per row; the fastest is printed")
    args = p.parse_args(argv)
    import cuproc
    print(f"cuproc fast path: {cuproc.fastpath.status()}")
    for name, value in measure(args.number, args.repeat).items():
        print(f"{value:9.3f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
