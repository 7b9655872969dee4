"""Memory benchmarks: allocation and free (synchronous and stream-ordered) and copy bandwidth.

Everything in one process on the GPU machine, on the primary context of device 0: the C floor
(``c_floor_memory.c``, a shared library called through ctypes on the same context and the same
buffers), cuproc, and the peers (cuda.bindings' raw pairs, cuda.core, CuPy).  Allocation loops are
not interleaved with other work: each loop runs alone, and the loops take turns for fifteen rounds
(in a new order each round, harness.round_order), on a timing thread pinned to one CPU.  The table shows
each loop's best round; each goal's ratio is the median over the rounds of the ratio within a
round, so that a slow spell of the machine cancels instead of landing on one row (one run read
the DeviceBuffer loop 1.34x the C floor when each loop ran its repetitions in one block).
The synchronous loops run twice, as two groups.  The goal's group, ``sync_us``, runs with one small
allocation of the same size alive in the context (``resident``), made before the group and freed after
it: the state of any program that holds memory.  With nothing else allocated, the driver gives a small
allocation's 2 MiB chunk back at every cuMemFree, and a pair costs 60-90 µs instead of 2-3 µs on an
H200 (the bench_memory run of 2026-11-28 04:32 UTC, HISTORY.md: 65.7 against 2.57 µs in C), which hides any
Python cost; every result before 2026-11-28 04:30 UTC was read in that state.  That state is still read,
for information, as the group ``sync_alone_us`` (no goal); ``allocation_state`` in the JSON says which
state each group ran in.
Copies: the same device buffer and the same host buffer for every row; every row is timed to completion
(the copy, then cuCtxSynchronize): the Python rows from Python, the C floor in C (``c_copy`` times its
copy and its synchronize itself and returns the seconds: timed from Python, the floor paid a ctypes call
and a second synchronize, which cuproc's row, a single C call since the copy front, did not -- a
reviewer's point, 2026-11-28), and each round runs the rows in a new random order (a fixed seed), so that no row always follows the
same other copy, on the pinned thread; a copy goal's ratio is the median over the rounds of the
ratio within a round.  Pageable host memory is one NumPy array used by both sides (so it is
allocated the same way for both).  ``COPY_CALLS`` states the driver calls memory.copy makes per row; the
tests (tests/test_memory_paths.py) and ``--smoke`` count them on the fake driver.
"""
from __future__ import annotations

import contextlib
import ctypes
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402, I001
    ROOT, Goals, build_c, frozen_heap, machine, one_cpu, paired_ratio, peer, plot_panels, round_order,
    smoke_driver, write_results, bench_args, bench_parser)

SMALL = 256                    # bytes per allocation (the size)
COPY_SIZES = (64 << 20, 256 << 20)
C_SYNC, C_ASYNC = "C floor cuMemAlloc+cuMemFree", "C floor cuMemAllocAsync+cuMemFreeAsync"
OURS_SYNC, OURS_ASYNC = "cuproc DeviceBuffer(n).free()", "cuproc alloc_async(n, stream).free_async()"
OURS_DROPPED = "cuproc DeviceBuffer(n), dropped (its finalizer frees)"
BIND_SYNC, BIND_ASYNC = "cuda.bindings cuMemAlloc+cuMemFree", "cuda.bindings cuMemAllocAsync+cuMemFreeAsync"
#: the driver calls one memory.copy makes, per row kind: the raw-name row's entry point and nothing else
#: (no pointer query, no sync, no context switch); checked on the fake driver by the tests and --smoke
# cuCtxGetCurrent first: a synchronous copy runs in whichever context is current (on its default stream), so
# memory.copy checks that the buffer's is (and pushes it when not; issue 35, measured on driver 580)
COPY_CALLS = {"pinned H2D": ["cuCtxGetCurrent", "cuMemcpyHtoD"], "pinned D2H": ["cuCtxGetCurrent", "cuMemcpyDtoH"],
              "pageable H2D": ["cuCtxGetCurrent", "cuMemcpyHtoD"], "pageable D2H": ["cuCtxGetCurrent", "cuMemcpyDtoH"]}


#: the state each allocation group runs in (recorded in the JSON: before 2026-11-28 04:30 UTC ``sync_us`` ran
#: with nothing else allocated)
ALLOCATION_STATE = {"sync_alone_us": "nothing else allocated in the context",
                    "sync_us": f"one {SMALL} B allocation alive in the context",
                    "stream_ordered_us": "from device 0's default pool, release threshold at its maximum"}
ALLOC_ROUNDS = 15    # allocation loops take turns this many times
SYNC_OPS, ASYNC_OPS = 20_000, 20_000   # operations per timed loop (2-5 us each with a resident allocation)
ALONE_OPS = 2_000     # the same with nothing else allocated: ~70 us per pair (the module docstring says why)
COPY_ROUNDS = 100    # copy rounds (each row once per round, shuffled): 40 left medians 2% apart for one call


def c_floor_loop(fn: Callable[..., float], *args: Any) -> Callable[[int], float]:
    """A C floor loop as the other rows' ``loop(k)``: it refuses, naming the driver's failure, when the
    C code says a call failed (a negative return) -- else a failed floor would time as the fastest row."""
    def loop(k: int) -> float:
        got = fn(k, *args)
        if got < 0:
            raise RuntimeError(f"the C floor's driver calls failed ({'no driver' if got == -1 else 'a call failed'})")
        return got
    return loop


def drop_peer(name: str, exc: Exception, errors: dict[str, str], when: str) -> None:
    """A loop failed: a peer's is dropped with its error noted (a peer that fails is reported, never
    ends the run); cuproc's own or the C floor's failure is raised."""
    if name.startswith(("cuproc", "C floor")):
        raise exc
    errors[name] = f"failed {when}: {type(exc).__name__}: {exc}"[:300]


def take_turns(loops: dict[str, tuple[Callable[[int], Any], int]], rounds: int, errors: dict[str, str]
               ) -> dict[str, list[float]]:
    """Each loop ``fn(n)`` timed alone (µs per operation), the loops taking turns for ``rounds`` rounds,
    in a new order each round (harness.round_order), on one CPU.  Each loop is warmed up first with a tenth
    of ``n`` (pools, caches), before the thread is pinned: a thread a driver or peer starts inside the
    pinned block would inherit the one CPU.  A peer's loop that fails in its warm-up or in a round is
    dropped, all its rounds with it, and its error noted (cuproc's and the C floor's failures raise)."""
    names = []
    for name, (fn, n) in loops.items():
        try:
            fn(max(n // 10, 1))
        except Exception as exc:  # noqa: BLE001 - see drop_peer
            drop_peer(name, exc, errors, "in its warm-up")
            continue
        names.append(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    with one_cpu(), frozen_heap():
        for r in range(rounds):
            for name in round_order(names, r):
                if name not in times:
                    continue
                fn, n = loops[name]
                t = time.perf_counter()
                try:
                    fn(n)
                except Exception as exc:  # noqa: BLE001 - see drop_peer
                    drop_peer(name, exc, errors, f"in round {r + 1}")
                    del times[name]
                    continue
                times[name].append((time.perf_counter() - t) / n * 1e6)
    return times


def keep_pool_memory(drv: Any) -> str:
    """Set the release threshold of device 0's default memory pool to its maximum ("" when done, else why
    not).  Every stream-ordered row allocates from that pool (the C floor, cuproc, cuda.bindings, cuda.core,
    CuPy), and with the default threshold, 0, whether a synchronize hands the pool's memory back to the
    driver varies from round to round: the C floor read 0.67 or 1.2 µs per pair round by round (04:22)."""
    import cuproc
    ffi, c = cuproc.ffi, cuproc.driver
    pool, limit = ffi.new("CUmemoryPool *"), ffi.new("cuuint64_t *", 2**64 - 1)
    try:
        drv.checked.cuDeviceGetDefaultMemPool(pool, 0)
        drv.checked.cuMemPoolSetAttribute(pool[0], c.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, limit)
    except cuproc.CudaError as exc:
        return f"the default pool keeps its release threshold: {exc}"
    return ""


@contextlib.contextmanager
def one_allocation_alive(drv: Any) -> Iterator[None]:
    """One allocation of ``SMALL`` bytes alive in the current context for the block (``sync_us``'s state).
    Freed after it; after a failed block, freed without checking: the block's error is the one to see."""
    import cuproc
    resident = cuproc.ffi.new("CUdeviceptr *")
    drv.checked.cuMemAlloc(resident, SMALL)
    try:
        yield
    except BaseException:
        drv.cuMemFree(resident[0])
        raise
    drv.checked.cuMemFree(resident[0])


def allocations(c_lib: Any, smoke: bool, ops: tuple[int, int, int], rounds: int, errors: dict
                ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list[float]]]]:
    """Each loop's best round (µs per alloc+free) per group, and every round's time (for paired ratios).
    ``ops``: operations per timed loop in the groups sync_us, stream_ordered_us and sync_alone_us."""
    import cuproc
    from cuproc import memory
    drv = cuproc.driver.default_driver()
    stream = cuproc.Stream(non_blocking=True)
    ffi = cuproc.ffi
    sync: dict[str, Callable[[int], Any]] = {}
    stream_ordered: dict[str, Callable[[int], Any]] = {}
    if c_lib is not None:
        h = int(ffi.cast("uintptr_t", stream.handle))
        sync[C_SYNC] = c_floor_loop(c_lib.c_alloc_free, SMALL)
        stream_ordered[C_ASYNC] = c_floor_loop(c_lib.c_alloc_free_async, SMALL, h)

    def objects(k):
        for _ in range(k):
            cuproc.DeviceBuffer(SMALL).free()

    def dropped(k):   # per-step code that lets the buffer go: its finalizer frees it (information only)
        for _ in range(k):
            cuproc.DeviceBuffer(SMALL)

    out_ptr = ffi.new("CUdeviceptr *")

    def raw(k, p=out_ptr, alloc=drv.cuMemAlloc, free=drv.cuMemFree):
        for _ in range(k):
            alloc(p, SMALL)
            free(p[0])

    def objects_async(k):
        for _ in range(k):
            memory.alloc_async(SMALL, stream).free_async()
        stream.synchronize()

    def raw_async(k, p=out_ptr, alloc=drv.cuMemAllocAsync, free=drv.cuMemFreeAsync,
                  hs=stream.handle):
        for _ in range(k):
            alloc(p, SMALL, hs)
            free(p[0], hs)
        stream.synchronize()
    sync[OURS_SYNC], sync[OURS_DROPPED], sync["cuproc raw C names (drv.cuMemAlloc)"] = objects, dropped, raw
    stream_ordered[OURS_ASYNC], stream_ordered["cuproc raw C names (drv.cuMemAllocAsync)"] = objects_async, raw_async
    if not smoke:
        made = peer(errors, "cuda.bindings", lambda: bindings_allocs(stream.__cuda_stream__()[1]))
        if made:
            sync[BIND_SYNC], stream_ordered[BIND_ASYNC] = made
        made = peer(errors, "cuda.core", core_allocs)
        if made:
            stream_ordered["cuda.core DeviceMemoryResource allocate+close(stream)"] = made
        made = peer(errors, "CuPy", cupy_allocs)
        if made:
            stream_ordered["CuPy malloc_async, freed on drop"] = made
    best: dict[str, dict[str, float]] = {}
    every: dict[str, dict[str, list[float]]] = {}
    for group, loops, n in (("sync_alone_us", sync, ops[2]), ("sync_us", sync, ops[0]),
                            ("stream_ordered_us", stream_ordered, ops[1])):
        # the goal's state: one small allocation alive (the module docstring)
        with one_allocation_alive(drv) if group == "sync_us" else contextlib.nullcontext():
            every[group] = take_turns({name: (fn, n) for name, fn in loops.items()}, rounds, errors)
        best[group] = {name: min(v) for name, v in every[group].items()}
    stream.close()
    return best, every


def bindings_allocs(stream_handle: Any) -> tuple[Callable, Callable]:
    from cuda.bindings import driver as cbd
    s = cbd.CUstream(int(stream_handle))
    alloc, free, alloc_a, free_a = cbd.cuMemAlloc, cbd.cuMemFree, cbd.cuMemAllocAsync, cbd.cuMemFreeAsync

    def pair(k):
        for _ in range(k):
            _, p = alloc(SMALL)
            free(p)

    def pair_async(k):
        for _ in range(k):
            _, p = alloc_a(SMALL, s)
            free_a(p, s)
        cbd.cuStreamSynchronize(s)
    return pair, pair_async


def core_allocs() -> Callable:
    try:
        from cuda.core import Device as CDevice
    except ImportError:
        from cuda.core.experimental import Device as CDevice
    dev = CDevice(0)
    dev.set_current()
    stream = dev.create_stream()
    mr = dev.memory_resource

    def allocs(k):
        for _ in range(k):
            mr.allocate(SMALL, stream=stream).close(stream=stream)
        stream.sync()
    allocs.keep = stream   # type: ignore[attr-defined]
    return allocs


def cupy_allocs() -> Callable:
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    malloc = cupy.cuda.memory.malloc_async

    def allocs(k):
        with stream:
            for _ in range(k):
                malloc(SMALL)
        stream.synchronize()
    return allocs


def copies(c_lib: Any, fake: Any, rounds: int, best: dict[str, dict[str, float]],
           every: dict[str, dict[str, list[float]]]) -> tuple[dict[str, dict[str, float]], dict[str, list[str]]]:
    """GB/s, median over ``rounds`` of copies by cuproc, the raw C name (through cuproc's pointer) and
    the C floor, each timed to completion, on the same buffers, in a new random order each round (the
    best copy of each row goes to ``best``, every round's seconds to ``every``); and, on the fake driver
    (``fake``), the driver calls each memory.copy row made."""
    import numpy as np

    import cuproc
    from cuproc import memory
    drv = cuproc.driver.default_driver()
    ffi = cuproc.ffi
    sync = drv.checked.cuCtxSynchronize if cuproc._support.arity(drv, "cuCtxSynchronize") == 0 else \
        (lambda: drv.checked.cuCtxSynchronize(ffi.NULL))
    order = random.Random(9)
    calls: dict[str, list[str]] = {}

    def one_size(size: int) -> dict[str, float]:
        d = cuproc.DeviceBuffer(size)
        pinned = memory.PinnedBuffer(size)
        ctypes.memset(pinned.ptr, 1, size)
        pageable = np.ones(size, np.uint8)
        hp = ffi.cast("void *", pinned.ptr)
        hpage = pageable.ctypes.data
        htod, dtoh = drv.cuMemcpyHtoD, drv.cuMemcpyDtoH

        def timed(fn: Callable[[], Any]) -> float:
            """The row's seconds: what a C floor returns (timed in C), else the Python call and a sync."""
            t = time.perf_counter()
            own = fn()
            sync()
            return own if isinstance(own, float) else time.perf_counter() - t

        def c_floor(direction: int, host: int) -> float:
            seconds = c_lib.c_copy(direction, d.address, host, size)
            if seconds < 0:
                raise RuntimeError("the C floor's copy failed")
            return seconds
        ours = {"pinned H2D": lambda: memory.copy(d, pinned), "pinned D2H": lambda: memory.copy(pinned, d),
                "pageable H2D": lambda: memory.copy(d, pageable), "pageable D2H": lambda: memory.copy(pageable, d)}
        copies_by_row: dict[str, Callable[[], Any]] = {f"{kind}, cuproc memory.copy": fn for kind, fn in ours.items()}
        copies_by_row["pinned H2D, raw C name"] = lambda: htod(d.address, hp, size)
        copies_by_row["pinned D2H, raw C name"] = lambda: dtoh(hp, d.address, size)
        if c_lib is not None:
            for kind, host in (("pinned", pinned.address), ("pageable", hpage)):
                for direction, name in ((0, "H2D"), (1, "D2H")):
                    copies_by_row[f"{kind} {name}, C floor"] = lambda dr=direction, h=host: c_floor(dr, h)
        if fake is not None:
            for kind, fn in ours.items():
                fake.clear_calls()
                fn()
                calls[kind] = fake.calls()
        names = list(copies_by_row)
        times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:          # warm up, before pinning (harness.one_cpu)
            timed(copies_by_row[name])
        with one_cpu(), frozen_heap():
            for _ in range(rounds):
                order.shuffle(names)
                for name in names:
                    times[name].append(timed(copies_by_row[name]))
        d.close()
        pinned.close()
        best[f"{size >> 20} MiB"] = {name: size / min(v) / 1e9 for name, v in times.items() if min(v) > 0}
        every[f"{size >> 20} MiB"] = times
        return {name: size / statistics.median(times[name]) / 1e9 for name in copies_by_row if min(times[name]) > 0}

    bw = {f"{size >> 20} MiB": one_size(size) for size in (COPY_SIZES if fake is None else (1 << 20,))}
    return bw, calls


def evaluate(alloc_rounds: dict[str, dict[str, list[float]]], copy_rounds: dict[str, dict[str, list[float]]],
             smoke: bool, errors: dict) -> Goals:
    """Every goal, each ratio paired within the rounds (:func:`harness.paired_ratio`)."""
    goals = Goals()
    why = "smoke run" if smoke else None
    s, a = alloc_rounds["sync_us"], alloc_rounds["stream_ordered_us"]
    goals.check(f"DeviceBuffer alloc+free of {SMALL} B <= 1.3x the C floor",
                paired_ratio(s[OURS_SYNC], s[C_SYNC]) if C_SYNC in s else None, 1.3, why_not=why)
    goals.check("stream-ordered alloc+free through the object layer <= cuda.bindings' raw pair (ours / theirs)",
                paired_ratio(a[OURS_ASYNC], a[BIND_ASYNC]) if BIND_ASYNC in a else None, 1.0,
                why_not=why or (None if BIND_ASYNC in a else
                                 f"cuda.bindings: {errors.get(BIND_ASYNC) or errors.get('cuda.bindings', 'missing')}"))
    for size in (f"{n >> 20} MiB" for n in COPY_SIZES):
        rows = copy_rounds.get(size, {})
        for direction in ("H2D", "D2H"):
            ours, raw = rows.get(f"pinned {direction}, cuproc memory.copy"), rows.get(f"pinned {direction}, C floor")
            # bandwidth over the floor's = the floor's time over ours, round by round
            goals.check(f"memory.copy pinned {direction} {size} >= 0.98x the driver's own call (C, same buffers)",
                        paired_ratio(raw, ours) if ours and raw else None, 0.98, at_most=False, why_not=why)
    return goals


def main(argv: list[str] | None = None) -> int:
    args = bench_args(bench_parser(), argv)
    import cuproc
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        c_lib = fake = None
        if args.smoke:
            fake = smoke_driver()
        else:
            path = build_c("c_floor_memory.c", Path(tmp), shared=True)
            if path is not None:
                c_lib = ctypes.CDLL(str(path))
                for fn in (c_lib.c_alloc_free, c_lib.c_alloc_free_async, c_lib.c_copy):
                    fn.restype = ctypes.c_double
                c_lib.c_alloc_free.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
                c_lib.c_alloc_free_async.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p]
                c_lib.c_copy.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_ulonglong]
        pc = cuproc.use_device(0)
        pool_note = keep_pool_memory(cuproc.driver.default_driver()) or "set to the maximum before the first round"
        turns, copy_turns = (2, 3) if args.smoke else (ALLOC_ROUNDS, COPY_ROUNDS)
        alloc, alloc_rounds = allocations(c_lib, args.smoke,
                                          (200, 200, 20) if args.smoke else (SYNC_OPS, ASYNC_OPS, ALONE_OPS),
                                          turns, errors)
        best: dict[str, dict[str, float]] = {}
        copy_rounds: dict[str, dict[str, list[float]]] = {}
        bw, calls = copies(c_lib, fake, copy_turns, best, copy_rounds)
        cuproc.driver.default_driver().cuCtxSetCurrent(cuproc.ffi.NULL)
        pc.release()
    goals = evaluate(alloc_rounds, copy_rounds, args.smoke, errors)
    if calls and calls != COPY_CALLS:
        raise SystemExit(f"memory.copy made other driver calls than COPY_CALLS states: {calls}")
    data = {"machine": machine(), "smoke": args.smoke, "allocation_us": alloc, "allocation_rounds_us": alloc_rounds,
            "allocation_state": ALLOCATION_STATE,
            "copy_GBps": bw, "copy_GBps_best": best, "copy_rounds_s": copy_rounds, "errors": errors,
            "copy_calls": COPY_CALLS}
    table = []
    for group, floor_name, label in (("sync_us", C_SYNC, f"alloc+free {SMALL} B"),
                                     ("sync_alone_us", C_SYNC, f"alloc+free {SMALL} B, nothing else allocated"),
                                     ("stream_ordered_us", C_ASYNC, f"stream-ordered {SMALL} B")):
        floor = alloc.get(group, {}).get(floor_name)
        for name, v in sorted(alloc.get(group, {}).items(), key=lambda kv: kv[1]):
            table.append([label, name, f"{v:.3f} µs", f"{v / floor:.2f}" if floor else ""])
    for size, rows in bw.items():
        for name, v in rows.items():
            kind = name.split(",")[0]
            floor = rows.get(f"{kind}, C floor")
            table.append([f"copy {size}", name, f"{v:.2f} GB/s", f"{v / floor:.3f}" if floor else ""])
    for name, why in errors.items():
        table.append(["", name, "missing", why[:70]])
    notes = ["ratio column: against the C floor of the same group, same process and run (copies: bandwidth ratio)",
             (f"alloc+free {SMALL} B: with one {SMALL} B allocation alive in the context (the goal's state); "
              "'nothing else allocated': the same loops with none, for information (the driver then gives the "
              "allocation's 2 MiB chunk back at every free, which costs tens of microseconds)"),
             ("statistics differ by group: allocation rows are the BEST of their rounds (each loop runs alone, "
              f"the loops taking turns for {turns} rounds, pinned to one CPU; the minimum is the least disturbed "
              f"run), copy rows the MEDIAN over {copy_turns} rounds (rows shuffled each round); every goal's ratio is "
              "the median over the rounds of the ratio within a round, so it is not the quotient of two table rows"),
             "stream-ordered loops synchronize their stream once at the end, inside the timing, on every side; "
             f"all of them allocate from device 0's default pool; its release threshold: {pool_note}",
             ("copies: every row timed to completion (copy + cuCtxSynchronize), the C floor in C, the others from Python; rows "
              "in a new random order each round; one memory.copy makes one driver call, the raw row's entry: "
              + ", ".join(f"{k} {'+'.join(v)}" for k, v in COPY_CALLS.items()) + " (counted on the fake driver)"),
             "for information, memory.copy against the raw C name row (the same driver entry, timed the same way "
             "from Python; median of per-round ratios): " + "; ".join(
                 f"{size} pinned {d} {paired_ratio(rows[raw], rows[ours]):.3f}x"
                 for size, rows in copy_rounds.items() for d in ("H2D", "D2H")
                 for raw, ours in [(f"pinned {d}, raw C name", f"pinned {d}, cuproc memory.copy")]
                 if raw in rows and ours in rows)]
    args.out.mkdir(parents=True, exist_ok=True)
    # one panel per group, each with its own C floor (the stream-ordered floor is a quarter of the other)
    panels = [([(k, v) for k, v in alloc.get(group, {}).items() if not k.startswith("C floor")],
               (f"{floor_name} ({label})", alloc[group][floor_name]) if floor_name in alloc.get(group, {}) else None)
              for group, floor_name, label in (("sync_us", C_SYNC, "one allocation alive"),
                                               ("stream_ordered_us", C_ASYNC, "stream-ordered"))]
    plot = plot_panels(args.out / "bench_memory.png", f"Allocation, {SMALL} B, {data['machine'].get('gpu')}, "
                       f"{data['machine']['date']}, {data['machine']['cuproc_path']}", "µs per alloc+free", panels)
    path = write_results(args.out, "bench_memory", data, table, ["operation", "who", "value", "x C floor"], notes,
                         goals, [plot])
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
