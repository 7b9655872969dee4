"""CUDA graphs (issue 36): replaying a 256-kernel graph, and capturing one.

Replay: one executable graph of 256 launches of the empty (float*, int, float) kernel (grid 1, block 32,
captured from cuproc prepared launches), replayed on one stream by every launcher in the same process and
run -- the C loop over cuGraphLaunch (``c_floor_graph.c`` as a shared library, called between the Python
bursts, on the very same CUgraphExec and stream), cuproc's ``GraphExec.launch`` (the bound method in a
loop), and cuda.bindings' ``cuGraphLaunch`` with its handles built once.  Burst: host time per launch over
bursts of 8 launches (the stream is synchronized between bursts, outside the timing): what the call itself
costs, for information.  Steady: 200 launches -- the host time until the last one returned (the launch
queue fills, as in a replay loop) -- then a synchronize: end to end.  All are given per kernel (/ 256).  The rows take turns in each round
(shuffled orders), and every ratio is paired: the median over rounds of the row over the C loop in the
same round.  Goals: cuproc within 2% of C in steady host time and end to end.

Capture: 256 prepared launches captured on a stream (``with stream.capture() as graph``) and instantiated,
then both destroyed, against cuda.core's ``GraphBuilder`` doing the same work (begin_building, 256
``launch`` calls with a LaunchConfig built once, end_building, complete).  Goal: cuproc faster.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402, I001
    ROOT, Goals, build_c, frozen_heap, machine, one_cpu, paired_ratio, peer, plot_panels, round_order, smoke_driver,
    write_results, OUT_HELP, results_dir)

CUBIN = ROOT / "kernels" / "kernels.cubin"
KERNELS = 256
C_LOOP = "C loop over cuGraphLaunch"
CUPROC = "cuproc GraphExec.launch"
BINDINGS = "cuda.bindings cuGraphLaunch, handles built once"
CAPTURE = "cuproc capture of 256 prepared launches + instantiate"
CORE_CAPTURE = "cuda.core GraphBuilder, 256 launches + complete"


def setup(smoke: bool) -> dict[str, Any]:
    """The device, the empty kernel, a stream, a buffer, and the 256-kernel graph captured and instantiated."""
    import cuproc
    pc = cuproc.use_device(0)
    if smoke:
        sys.path.insert(0, str(ROOT / "tests"))
        from fakedriver import fake_image
        module = cuproc.Module.load(fake_image({"empty": [8, 4, 4]}))
    else:
        module = cuproc.Module.load(CUBIN)
    fn = module.get_function("empty")
    stream = cuproc.Stream()
    buf = cuproc.DeviceBuffer(1024)
    run = fn.prepare(["float*", "int", "float"], 1, 32, stream=stream)
    with stream.capture() as graph:
        for i in range(KERNELS):
            run(buf, i, float(i))
    exe = graph.instantiate()
    exe.upload(stream)
    stream.synchronize()
    return {"pc": pc, "module": module, "fn": fn, "stream": stream, "buf": buf, "run": run, "graph": graph,
            "exe": exe}


def replay_rows(env: dict[str, Any], lib: Any, errors: dict[str, str], smoke: bool) -> dict[str, tuple]:
    """name -> (burst(count) -> seconds per launch, steady(count) -> seconds per launch, synchronize)."""
    from cuproc._support import handle_int
    exe, stream = env["exe"], env["stream"]
    sync = stream.synchronize
    rows: dict[str, tuple] = {}

    def cuproc_burst(count: int, launch: Callable = exe.launch, s: Any = stream) -> float:
        t = time.perf_counter()
        for _ in range(count):
            launch(s)
        return (time.perf_counter() - t) / count

    def cuproc_steady(count: int) -> tuple[float, float]:
        t = time.perf_counter()
        launch, s = exe.launch, stream
        for _ in range(count):
            launch(s)
        host = time.perf_counter()
        sync()
        return (host - t) / count, (time.perf_counter() - t) / count
    rows[CUPROC] = (cuproc_burst, cuproc_steady)
    if lib is not None:
        h, st = ctypes.c_void_p(handle_int(exe.handle)), ctypes.c_void_p(handle_int(stream.handle))

        def c_burst(count: int) -> float:
            return lib.c_graph_burst(h, st, count)

        host = ctypes.c_double()

        def c_steady(count: int) -> tuple[float, float]:
            total = lib.c_graph_steady(h, st, count, ctypes.byref(host))
            return host.value, total
        rows[C_LOOP] = (c_burst, c_steady)
    if not smoke:
        def make_bindings() -> tuple:
            from cuda.bindings import driver as cbd
            ch, cs = cbd.CUgraphExec(handle_int(exe.handle)), cbd.CUstream(handle_int(stream.handle))
            launch = cbd.cuGraphLaunch
            if launch(ch, cs)[0] != cbd.CUresult.CUDA_SUCCESS:
                raise RuntimeError("cuGraphLaunch failed")
            sync()

            def burst(count: int) -> float:
                t = time.perf_counter()
                for _ in range(count):
                    launch(ch, cs)
                return (time.perf_counter() - t) / count

            def steady(count: int) -> tuple[float, float]:
                t = time.perf_counter()
                for _ in range(count):
                    launch(ch, cs)
                host = time.perf_counter()
                sync()
                return (host - t) / count, (time.perf_counter() - t) / count
            return burst, steady
        made = peer(errors, BINDINGS, make_bindings)
        if made is not None:
            rows[BINDINGS] = made
    return rows


def measure_replay(env: dict[str, Any], rows: dict[str, tuple], smoke: bool) -> dict[str, dict]:
    burst, bursts, steady, rounds = (2, 5, 4, 3) if smoke else (8, 60, 200, 9)
    sync = env["stream"].synchronize
    names = list(rows)
    out: dict[str, dict] = {n: {"burst_rounds": [], "host_rounds": [], "steady_rounds": []} for n in names}
    for name in names:                  # warm-up: every row once
        rows[name][0](burst)
        sync()
    with frozen_heap(), one_cpu():
        for r in range(bursts):
            for name in round_order(names, r):
                out[name]["burst_rounds"].append(rows[name][0](burst) / KERNELS * 1e6)
                sync()
        for r in range(rounds):
            for name in round_order(names, 1000 + r):
                host, total = rows[name][1](steady)
                out[name]["host_rounds"].append(host / KERNELS * 1e6)
                out[name]["steady_rounds"].append(total / KERNELS * 1e6)
    for v in out.values():
        v["burst_us"] = statistics.median(v["burst_rounds"])
        v["host_us"] = statistics.median(v["host_rounds"])
        v["steady_us"] = statistics.median(v["steady_rounds"])
    return out


def capture_rows(env: dict[str, Any], errors: dict[str, str], smoke: bool) -> dict[str, Callable[[], float]]:
    """name -> one capture + instantiate (and teardown), returning its seconds."""
    run, stream, buf = env["run"], env["stream"], env["buf"]

    def cuproc_capture() -> float:
        t = time.perf_counter()
        with stream.capture() as graph:
            for i in range(KERNELS):
                run(buf, i, float(i))
        exe = graph.instantiate()
        elapsed = time.perf_counter() - t
        exe.destroy()
        graph.destroy()
        return elapsed
    rows: dict[str, Callable[[], float]] = {CAPTURE: cuproc_capture}
    if smoke:
        return rows

    def make_core() -> Callable[[], float]:
        import numpy as np
        try:
            from cuda.core import Device as CDevice
            from cuda.core import LaunchConfig, ObjectCode
            from cuda.core import launch as core_launch
        except ImportError:
            from cuda.core.experimental import Device as CDevice
            from cuda.core.experimental import LaunchConfig, ObjectCode
            from cuda.core.experimental import launch as core_launch
        cdev = CDevice(0)
        cdev.set_current()
        cstream = cdev.create_stream()
        kernel = ObjectCode.from_cubin(CUBIN.read_bytes()).get_kernel("empty")
        config = LaunchConfig(grid=1, block=32)
        ptr = buf.address
        i32 = [np.int32(i) for i in range(KERNELS)]
        f32 = [np.float32(i) for i in range(KERNELS)]

        def core_capture() -> float:
            t = time.perf_counter()
            gb = cstream.create_graph_builder()
            gb.begin_building()
            for i in range(KERNELS):
                core_launch(gb, config, kernel, ptr, i32[i], f32[i])
            gb.end_building()
            graph = gb.complete()
            elapsed = time.perf_counter() - t
            for obj in (graph, gb):
                close = getattr(obj, "close", None)
                if close is not None:
                    close()
            return elapsed
        core_capture()
        core_capture.keep = (cdev, cstream, kernel)   # type: ignore[attr-defined]
        return core_capture
    made = peer(errors, CORE_CAPTURE, make_core)
    if made is not None:
        rows[CORE_CAPTURE] = made
    return rows


def measure_capture(rows: dict[str, Callable[[], float]], smoke: bool) -> dict[str, dict]:
    rounds = 3 if smoke else 25
    names = list(rows)
    out: dict[str, dict] = {n: {"rounds_ms": []} for n in names}
    for name in names:
        rows[name]()
    with frozen_heap(), one_cpu():
        for r in range(rounds):
            for name in round_order(names, 2000 + r):
                out[name]["rounds_ms"].append(rows[name]() * 1e3)
    for v in out.values():
        v["ms"] = statistics.median(v["rounds_ms"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    p.add_argument("--smoke", action="store_true", help="run on the fake driver, no C floor, no peers")
    args = p.parse_args(argv)
    args.out = results_dir(args.out)
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            smoke_driver()
            lib = None
        else:
            path = build_c("c_floor_graph.c", Path(tmp), shared=True)
            lib = None
            if path is not None:
                lib = ctypes.CDLL(str(path))
                for name in ("c_graph_burst", "c_graph_steady"):
                    getattr(lib, name).restype = ctypes.c_double
                lib.c_graph_burst.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
                lib.c_graph_steady.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                               ctypes.POINTER(ctypes.c_double)]
            else:
                errors[C_LOOP] = "no C compiler"
        env = setup(args.smoke)
        replay = measure_replay(env, replay_rows(env, lib, errors, args.smoke), args.smoke)
        captured = measure_capture(capture_rows(env, errors, args.smoke), args.smoke)
        env["stream"].synchronize()
    goals = Goals()
    why = "smoke run" if args.smoke else None
    for column, label in (("host_rounds", "host time"), ("steady_rounds", "end-to-end time")):
        ratio = (paired_ratio(replay[CUPROC][column], replay[C_LOOP][column])
                 if C_LOOP in replay else None)
        goals.check(f"graph replay, {label} per kernel: cuproc GraphExec.launch within 2% of C's cuGraphLaunch",
                    ratio, 1.02, why_not=why if why else (None if ratio is not None else "no C loop"))
    core = captured.get(CORE_CAPTURE)
    cap_ratio = (paired_ratio(captured[CAPTURE]["rounds_ms"], core["rounds_ms"]) if core else None)
    goals.check("capture of 256 prepared launches + instantiate: faster than cuda.core's GraphBuilder (ratio < 1)",
                cap_ratio, 1.0, why_not=why if why else (None if core else "cuda.core missing"))
    data = {"machine": machine(), "smoke": args.smoke, "replay": replay, "capture": captured, "errors": errors}
    c_ref = replay.get(C_LOOP)
    rows = []
    for name, v in sorted(replay.items(), key=lambda kv: kv[1]["burst_us"]):
        ratios = [paired_ratio(v[c], c_ref[c]) if c_ref else None for c in ("burst_rounds", "host_rounds",
                                                                               "steady_rounds")]
        rows.append([name, f"{v['burst_us'] * 1e3:.1f}", f"{v['host_us'] * 1e3:.1f}", f"{v['steady_us'] * 1e3:.1f}",
                     *(f"{r:.3f}" if r else "" for r in ratios)])
    for name, v in captured.items():
        ratio = paired_ratio(v["rounds_ms"], core["rounds_ms"]) if core else None
        rows.append([name, f"{v['ms']:.3f} ms per graph", "", "", "", "", f"{ratio:.3f} x cuda.core" if ratio else ""])
    for name, reason in errors.items():
        rows.append([name, "missing", "", "", "", "", reason[:70]])
    notes = [f"the graph: {KERNELS} launches of the empty kernel (grid 1, block 32), captured from a cuproc prepared "
             "launch; replayed on one created stream",
             "burst: bursts of 8 launches, host time only (synchronized between bursts, untimed): the cost of the "
             "call itself, for information; steady: 200 launches, the host time until the last launch returned "
             "(goal), and with cuStreamSynchronize, end to end (goal); all per kernel (a launch's time / 256), "
             "median over rounds",
             "ratios: the median over rounds of the row over the C loop in the same round (rows take turns)",
             "capture: one capture + instantiate per round (the graph and its executable graph destroyed after the "
             "timing), median over rounds; the ratio is paired the same way against cuda.core's GraphBuilder"]
    args.out.mkdir(parents=True, exist_ok=True)
    title = f"CUDA graphs, {data['machine'].get('gpu')}, {data['machine']['date']}, {data['machine']['cuproc_path']}"
    plot = plot_panels(args.out / "bench_graphs.png", title, "ns per kernel (replay) / ms per graph (capture)",
                       [([(k, v["burst_us"] * 1e3) for k, v in replay.items() if k != C_LOOP],
                         (C_LOOP + ", burst", c_ref["burst_us"] * 1e3) if c_ref else None),
                        ([(k, v["steady_us"] * 1e3) for k, v in replay.items() if k != C_LOOP],
                         (C_LOOP + ", end to end", c_ref["steady_us"] * 1e3) if c_ref else None),
                        ([(k, v["ms"]) for k, v in captured.items()], None)])
    path = write_results(args.out, "bench_graphs", data, rows,
                         ["row", "burst (ns/kernel)", "steady host (ns/kernel)", "end to end (ns/kernel)",
                          "burst x C", "steady host x C", "end to end x C"],
                         notes, goals, [plot])
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
