"""CUDA graphs (issue 36): replaying a 256-kernel graph, and capturing one -- a section of the launch
benchmark (``bench_launch.py`` runs it and writes its rows, goals and plot panels into its own results);
run alone (``python benchmarks/bench_graphs.py``) it writes ``bench_graphs`` results for a quick look.

Replay: one executable graph of 256 launches of the empty (float*, int, float) kernel (grid 1, block 32,
captured from cuproc prepared launches), replayed on one stream by every launcher in the same process and
run -- the C loop over cuGraphLaunch (``c_floor_graph.c`` as a shared library, called between the Python
bursts, on the very same CUgraphExec and stream), cuproc's ``GraphExec.launch`` (the bound method in a
loop), cuproc's prepared replay (``exe.replay(stream)``: a closure holding the executable graph and the
stream that compares the resource epoch, then makes the checked C call on both handles), cuda.bindings'
``cuGraphLaunch`` with its handles built once, and cuda.core's
``Graph.launch`` (the same 256 launches built by its GraphBuilder: its own executable graph).

Host time is what the goal compares, and it is measured where the GPU cannot set it: bursts of
:data:`BURST` launches, the stream synchronized between bursts outside the timing, so the launch queue never
fills and each launch call returns as soon as the driver took it (what a C loop measures).  Steady: 200
launches then a synchronize -- end to end, which the GPU's run of the kernels sets (the host time of that
loop, also shown, is blocked on the full queue: for information).  All are per kernel (/ 256).  Rows take
turns in each round (shuffled orders), and every ratio is paired: the median over rounds of the row over the
C loop in the same round.  Goals: cuproc within 2% of C in host time (each cuproc row) and end to end.

Capture: 256 prepared launches captured on a stream (``with cuproc.capture(stream) as graph``) and
instantiated, then both destroyed, against the C floor (``c_graph_capture``: cuStreamBeginCapture, 256
cuLaunchKernel, cuStreamEndCapture, cuGraphInstantiateWithFlags) and cuda.core's ``GraphBuilder`` doing the
same work (begin_building, 256 ``launch`` calls with a LaunchConfig built once, end_building, complete).
Goal: cuproc faster than cuda.core.
"""
from __future__ import annotations

import ctypes
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402, I001
    ROOT, Goals, build_c, frozen_heap, machine, one_cpu, paired_ratio, peer, plot_panels, round_order, smoke_driver,
    write_results, bench_args, bench_parser)

CUBIN = ROOT / "kernels" / "kernels.cubin"
KERNELS = 256
BURST = 8
C_LOOP = "C loop over cuGraphLaunch"
CUPROC = "cuproc GraphExec.launch"
REPLAY = "cuproc GraphExec.replay (prepared)"
BINDINGS = "cuda.bindings cuGraphLaunch, handles built once"
CORE = "cuda.core Graph.launch (its GraphBuilder's graph)"
FLOOR = "Python floor: a closure calling the raw drv.cuGraphLaunch (no checks)"
CUPROC_ROWS = (CUPROC, REPLAY)
CAPTURE = "cuproc capture of 256 prepared launches + instantiate"
C_CAPTURE = "C capture of 256 cuLaunchKernel + cuGraphInstantiateWithFlags"
CORE_CAPTURE = "cuda.core GraphBuilder, 256 launches + complete"
HEADER = ["row", "burst host (ns/kernel)", "steady host (ns/kernel)", "end to end (ns/kernel)", "burst x C",
          "steady host x C", "end to end x C"]


@dataclass
class Row:
    """One replay launcher: ``burst(count)`` -> seconds per launch (host time), ``steady(count)`` -> (host,
    end to end) seconds per launch, ``sync()`` its stream's synchronize."""

    burst: Callable[[int], float]
    steady: Callable[[int], tuple[float, float]]
    sync: Callable[[], Any]


@dataclass
class Section:
    """What the graph benchmark adds to a results file: its data, table rows, notes and plot panels."""

    data: dict[str, Any]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    panels: list[tuple[list[tuple[str, float]], tuple[str, float] | None]] = field(default_factory=list)


def load_c_floor(tmp: Path, errors: dict[str, str]) -> Any:
    """The C floor library (c_floor_graph.c), or None (the reason in ``errors``)."""
    path = build_c("c_floor_graph.c", tmp, shared=True)
    if path is None:
        errors[C_LOOP] = errors[C_CAPTURE] = "no C compiler"
        return None
    lib = ctypes.CDLL(str(path))
    for name in ("c_graph_burst", "c_graph_steady", "c_graph_capture"):
        getattr(lib, name).restype = ctypes.c_double
    lib.c_graph_burst.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.c_graph_steady.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    lib.c_graph_capture.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int]
    return lib


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
    with cuproc.capture(stream) as graph:
        for i in range(KERNELS):
            run(buf, i, float(i))
    exe = graph.instantiate()
    exe.upload(stream)
    stream.synchronize()
    return {"pc": pc, "module": module, "fn": fn, "stream": stream, "buf": buf, "run": run, "graph": graph,
            "exe": exe}


def python_row(launch: Callable[[], Any], sync: Callable[[], Any]) -> Row:
    """A replay row of a Python launcher called as a user's loop calls it."""
    def burst(count: int) -> float:
        t = time.perf_counter()
        for _ in range(count):
            launch()
        return (time.perf_counter() - t) / count

    def steady(count: int) -> tuple[float, float]:
        t = time.perf_counter()
        for _ in range(count):
            launch()
        host = time.perf_counter()
        sync()
        return (host - t) / count, (time.perf_counter() - t) / count
    return Row(burst, steady, sync)


def replay_rows(env: dict[str, Any], lib: Any, errors: dict[str, str], smoke: bool) -> dict[str, Row]:
    from cuproc._support import handle_int
    exe, stream = env["exe"], env["stream"]
    sync = stream.synchronize
    rows: dict[str, Row] = {}
    launch, s = exe.launch, stream      # the bound method in the loop, as a user writes it: ``launch(s)``

    def cuproc_burst(count: int) -> float:
        t = time.perf_counter()
        for _ in range(count):
            launch(s)
        return (time.perf_counter() - t) / count

    def cuproc_steady(count: int) -> tuple[float, float]:
        t = time.perf_counter()
        for _ in range(count):
            launch(s)
        host = time.perf_counter()
        sync()
        return (host - t) / count, (time.perf_counter() - t) / count
    rows[CUPROC] = Row(cuproc_burst, cuproc_steady, sync)
    rows[REPLAY] = python_row(exe.replay(stream), sync)
    raw, eh, sh = exe.driver.cuGraphLaunch, exe.handle, stream.handle

    def floor() -> None:     # what any Python caller pays: a frame and the call into C, nothing checked
        raw(eh, sh)
    rows[FLOOR] = python_row(floor, sync)
    if lib is not None:
        h, st = ctypes.c_void_p(handle_int(exe.handle)), ctypes.c_void_p(handle_int(stream.handle))
        host = ctypes.c_double()

        def c_steady(count: int) -> tuple[float, float]:
            total = lib.c_graph_steady(h, st, count, ctypes.byref(host))
            return host.value, total
        rows[C_LOOP] = Row(lambda count: lib.c_graph_burst(h, st, count), c_steady, sync)
    if smoke:
        return rows

    def make_bindings() -> Row:
        from cuda.bindings import driver as cbd
        ch, cs = cbd.CUgraphExec(handle_int(exe.handle)), cbd.CUstream(handle_int(stream.handle))
        graph_launch = cbd.cuGraphLaunch
        if graph_launch(ch, cs)[0] != cbd.CUresult.CUDA_SUCCESS:
            raise RuntimeError("cuGraphLaunch failed")
        sync()
        return python_row(lambda: graph_launch(ch, cs), sync)
    made = peer(errors, BINDINGS, make_bindings)
    if made is not None:
        rows[BINDINGS] = made

    def make_core() -> Row:
        core = core_kit(env)
        gb, graph = core_build(core)
        cstream = core["stream"]
        graph.upload(cstream)
        cstream.sync()

        def core_launch() -> None:
            graph.launch(cstream)
        row = python_row(core_launch, cstream.sync)
        row.keep = (core, gb, graph)   # type: ignore[attr-defined]
        return row
    made = peer(errors, CORE, make_core)
    if made is not None:
        rows[CORE] = made
    return rows


def core_kit(env: dict[str, Any]) -> dict[str, Any]:
    """cuda.core's device, stream, the empty kernel, a LaunchConfig and the argument values, built once."""
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
    return {"device": cdev, "stream": cdev.create_stream(), "launch": core_launch,
            "kernel": ObjectCode.from_cubin(CUBIN.read_bytes()).get_kernel("empty"),
            "config": LaunchConfig(grid=1, block=32), "ptr": env["buf"].address,
            "i32": [np.int32(i) for i in range(KERNELS)], "f32": [np.float32(i) for i in range(KERNELS)]}


def core_build(core: dict[str, Any]) -> tuple[Any, Any]:
    """cuda.core's GraphBuilder capturing the 256 launches, completed: (the builder, its graph)."""
    gb = core["stream"].create_graph_builder()
    gb.begin_building()
    for i in range(KERNELS):
        core["launch"](gb, core["config"], core["kernel"], core["ptr"], core["i32"][i], core["f32"][i])
    gb.end_building()
    return gb, gb.complete()


def measure_replay(rows: dict[str, Row], smoke: bool) -> dict[str, dict]:
    bursts, steady, rounds = (5, 4, 3) if smoke else (60, 200, 9)
    names = list(rows)
    out: dict[str, dict] = {n: {"burst_rounds": [], "host_rounds": [], "steady_rounds": []} for n in names}
    for name in names:                  # warm-up: every row once
        rows[name].burst(BURST)
        rows[name].sync()
    with frozen_heap(), one_cpu():
        for r in range(bursts):
            for name in round_order(names, r):
                out[name]["burst_rounds"].append(rows[name].burst(BURST) / KERNELS * 1e6)
                rows[name].sync()       # (outside the timing: the next burst starts with an empty queue)
        for r in range(rounds):
            for name in round_order(names, 1000 + r):
                host, total = rows[name].steady(steady)
                out[name]["host_rounds"].append(host / KERNELS * 1e6)
                out[name]["steady_rounds"].append(total / KERNELS * 1e6)
    for v in out.values():
        v["burst_us"] = statistics.median(v["burst_rounds"])
        v["host_us"] = statistics.median(v["host_rounds"])
        v["steady_us"] = statistics.median(v["steady_rounds"])
    return out


def capture_rows(env: dict[str, Any], lib: Any, errors: dict[str, str], smoke: bool) -> dict[str, Callable[[], float]]:
    """name -> one capture + instantiate (and teardown), returning its seconds."""
    import cuproc
    from cuproc._support import handle_int
    run, stream, buf = env["run"], env["stream"], env["buf"]

    def cuproc_capture() -> float:
        t = time.perf_counter()
        with cuproc.capture(stream) as graph:
            for i in range(KERNELS):
                run(buf, i, float(i))
        exe = graph.instantiate()
        elapsed = time.perf_counter() - t
        exe.destroy()
        graph.destroy()
        return elapsed
    rows: dict[str, Callable[[], float]] = {CAPTURE: cuproc_capture}
    if lib is not None:
        f, s, p = (ctypes.c_void_p(handle_int(env["fn"].handle)), ctypes.c_void_p(handle_int(stream.handle)),
                   buf.address)

        def c_capture() -> float:
            elapsed = lib.c_graph_capture(f, s, p, KERNELS)
            if elapsed < 0:
                raise RuntimeError("the C capture failed")
            return elapsed
        rows[C_CAPTURE] = c_capture
    if smoke:
        return rows

    def make_core() -> Callable[[], float]:
        core = core_kit(env)

        def core_capture() -> float:
            t = time.perf_counter()
            gb, graph = core_build(core)
            elapsed = time.perf_counter() - t
            for obj in (graph, gb):
                close = getattr(obj, "close", None)
                if close is not None:
                    close()
            return elapsed
        core_capture()
        core_capture.keep = core   # type: ignore[attr-defined]
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


def run_section(smoke: bool, tmp: Path) -> Section:
    """Measure replay and capture (the default handle already set: the fake's in a smoke run); the section's
    data, rows, notes and plot panels.  Goals are :func:`check_goals`'."""
    errors: dict[str, str] = {}
    lib = None if smoke else load_c_floor(tmp, errors)
    env = setup(smoke)
    replay = measure_replay(replay_rows(env, lib, errors, smoke), smoke)
    captured = measure_capture(capture_rows(env, lib, errors, smoke), smoke)
    env["stream"].synchronize()
    section = Section({"replay": replay, "capture": captured, "errors": errors})
    c_ref = replay.get(C_LOOP)
    for name, v in sorted(replay.items(), key=lambda kv: kv[1]["burst_us"]):
        ratios = [paired_ratio(v[c], c_ref[c]) if c_ref else None for c in ("burst_rounds", "host_rounds",
                                                                               "steady_rounds")]
        section.rows.append([name, f"{v['burst_us'] * 1e3:.1f}", f"{v['host_us'] * 1e3:.1f}",
                             f"{v['steady_us'] * 1e3:.1f}", *(f"{r:.3f}" if r else "" for r in ratios)])
    c_cap, core = captured.get(C_CAPTURE), captured.get(CORE_CAPTURE)
    for name, v in captured.items():
        versus_c = paired_ratio(v["rounds_ms"], c_cap["rounds_ms"]) if c_cap else None
        versus_core = paired_ratio(v["rounds_ms"], core["rounds_ms"]) if core else None
        section.rows.append([name, f"{v['ms']:.3f} ms per graph", "", "",
                             f"{versus_c:.3f} x C" if versus_c else "", "",
                             f"{versus_core:.3f} x cuda.core" if versus_core else ""])
    for name, reason in errors.items():
        section.rows.append([name, "missing", "", "", "", "", reason[:70]])
    section.notes = [
        f"graphs: {KERNELS} launches of the empty kernel (grid 1, block 32), captured from a cuproc prepared launch; "
        "replayed on one created stream (cuda.core: its GraphBuilder's graph of the same launches, on its stream)",
        f"graphs, burst: bursts of {BURST} launches, the host time of the launch calls only (synchronized between "
        "bursts, untimed: the queue never fills, the GPU does not set it): the host-time goal; steady: 200 "
        "launches, the host time until the last returned (blocked on the full queue, for information), and with "
        "the synchronize, end to end (goal); all per kernel (a launch's time / 256), median over rounds",
        "graphs, ratios: the median over rounds of the row over the C loop in the same round (rows take turns)",
        "graphs, capture: one capture + instantiate per round (the graph and its executable graph destroyed after "
        "the timing), median over rounds; paired against the C floor and against cuda.core's GraphBuilder",
        "graphs, GraphExec.replay: a closure holding the executable graph and the stream: one comparison of the "
        "executable graph's fast-path epoch with the resource epoch (the full checks again only when something "
        "ended or the executable graph changed), then the raw drv.cuGraphLaunch on both handles, its result "
        "tested (see its docstring)",
        "graphs, Python floor: the raw C name called from a closure, its result not even read -- what any Python "
        "caller pays over the C loop (the interpreter between two driver calls); the replay's own cost is the "
        "difference between its row and this one"]
    section.panels = [
        ([(k, v["burst_us"] * 1e3) for k, v in replay.items() if k != C_LOOP],
         (C_LOOP + ", burst host time (ns/kernel)", c_ref["burst_us"] * 1e3) if c_ref else None),
        ([(k, v["steady_us"] * 1e3) for k, v in replay.items() if k != C_LOOP],
         (C_LOOP + ", end to end (ns/kernel)", c_ref["steady_us"] * 1e3) if c_ref else None),
        ([(k, v["ms"]) for k, v in captured.items() if k != C_CAPTURE],
         (C_CAPTURE + " (ms)", c_cap["ms"]) if c_cap else None)]
    return section


def check_goals(goals: Goals, section: Section, smoke: bool) -> None:
    """The graph goals, met or missed as measured (not evaluated in a smoke run, or without a reference)."""
    replay, captured = section.data["replay"], section.data["capture"]
    why = "smoke run" if smoke else None
    c_ref = replay.get(C_LOOP)
    for name in CUPROC_ROWS:
        ratio = paired_ratio(replay[name]["burst_rounds"], c_ref["burst_rounds"]) if c_ref else None
        goals.check(f"graph replay, host time per kernel (bursts of {BURST}, launch calls only): {name} within 2% "
                    "of C's cuGraphLaunch", ratio, 1.02, why_not=why or (None if c_ref else "no C loop"))
    floor = replay.get(FLOOR)
    ratio = paired_ratio(replay[REPLAY]["burst_rounds"], floor["burst_rounds"]) if floor else None
    goals.check(f"graph replay, host time per kernel (bursts of {BURST}): {REPLAY} within 2% of the Python floor "
                "(a closure calling the raw C name, nothing checked): what the replay's checks cost", ratio, 1.02,
                why_not=why or (None if floor else "no floor row"))
    ratio = paired_ratio(replay[CUPROC]["steady_rounds"], c_ref["steady_rounds"]) if c_ref else None
    measured = (f" ({c_ref['steady_us'] * KERNELS:.0f} µs per graph end to end against "
                f"{c_ref['burst_us'] * KERNELS:.1f} µs of C's host time per launch)") if c_ref else ""
    goals.check(f"graph replay, end-to-end time per kernel: {CUPROC} within 2% of C's cuGraphLaunch -- GPU-bound: "
                f"the GPU's run of the {KERNELS} kernels sets it{measured}, so any launcher that keeps the queue full "
                "meets it; it is not a launcher result (the host-time goals above are)", ratio, 1.02,
                why_not=why or (None if c_ref else "no C loop"))
    core = captured.get(CORE_CAPTURE)
    cap_ratio = paired_ratio(captured[CAPTURE]["rounds_ms"], core["rounds_ms"]) if core else None
    goals.check("capture of 256 prepared launches + instantiate: faster than cuda.core's GraphBuilder (ratio < 1)",
                cap_ratio, 1.0, why_not=why or (None if core else section.data["errors"].get(CORE_CAPTURE,
                                                                                            "cuda.core missing")))


def main(argv: list[str] | None = None) -> int:
    args = bench_args(bench_parser("the graph section of bench_launch.py, alone"), argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            smoke_driver()
        section = run_section(args.smoke, Path(tmp))
    goals = Goals()
    check_goals(goals, section, args.smoke)
    data = {"machine": machine(), "smoke": args.smoke, **section.data}
    args.out.mkdir(parents=True, exist_ok=True)
    title = f"CUDA graphs, {data['machine'].get('gpu')}, {data['machine']['date']}, {data['machine']['cuproc_path']}"
    plot = plot_panels(args.out / "bench_graphs.png", title, "ns per kernel (replay) / ms per graph (capture)",
                       section.panels)
    path = write_results(args.out, "bench_graphs", data, section.rows, HEADER, section.notes, goals, [plot])
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
