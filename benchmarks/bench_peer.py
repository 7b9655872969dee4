"""Peer-copy benchmark (issue 40): ``memory.copy`` between buffers of two devices against the driver's own
``cuMemcpyPeer``, timed in C.

Everything in one process, on the primary contexts of devices 0 and 1 and on the same buffers and streams
for every row: the C floor (``c_floor_peer.c``, a shared library called through ctypes), cuproc
(``memory.copy(dst, src)``, and ``memory.copy(dst, src, stream=s)`` then ``s.synchronize()``) and
cuda.bindings' ``cuMemcpyPeer`` / ``cuMemcpyPeerAsync`` with their handles built once.  Each row of a round
makes ``COPIES`` copies of 64 MiB or 256 MiB, device 0 to device 1 or back, and waits for them: the
synchronous rows with the destination's context current (memory.copy makes a synchronous peer copy there,
and cuMemcpyPeer needs a current context) and one cuCtxSynchronize at the end; the stream-ordered rows on a
stream of the source's context, with that context current, and one cuStreamSynchronize.  The C floor times
its copies and its wait in C; the other rows are timed from Python.  The rows take turns for ``ROUNDS``
rounds, in a new order each round (harness.round_order), on a thread pinned to one CPU; the table shows each
row's median GB/s, and each goal is the median over the rounds of the ratio within a round
(harness.paired_ratio).

The synchronous rows take turns as one group and the stream-ordered rows as another: cuproc orders a
buffer's work after the stream it last used (an event record and wait when the stream changes, interop's
``last_stream``), so alternating the two kinds would charge cuproc's rows an event per switch that the C
floor never makes.  A program that switches streams pays it; a stream of copies does not, and that is what
the goals read.

The rows run twice: first without peer access (the driver may stage such a copy; information only), then
with it enabled in both directions through the object layer (``Context.enable_peer_access``); the goals
read the second.  A row that fails -- cuda.bindings missing, or any other -- is dropped and reported, and
the others go on (in ``--smoke`` a failure of cuproc's rows ends the run: that is what a smoke run checks).
``--smoke`` uses the fake driver's two devices (a peer copy there is a memmove), and checks that cuproc's
rows make the driver calls ``CUPROC_CALLS`` states.  With one GPU both buffers live on device 0: the copies
are device-to-device, not peer copies, and the goals are not evaluated.  A non-smoke run takes a few
seconds on two H200s: it must fit a short lease on a two-GPU machine.
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
    Goals, bench_args, bench_parser, build_c, frozen_heap, machine, one_cpu, paired_ratio, peer, plot_panels,
    round_order, smoke_driver, write_results)

SIZES = (64 << 20, 256 << 20)
SMOKE_SIZES = (1 << 20,)
ROUNDS, COPIES = 5, 3                 # rounds of each row; copies per row per round
SMOKE_ROUNDS, SMOKE_COPIES = 2, 1
GOAL = 0.98                           # cuproc's bandwidth over the C floor's, at least

C_SYNC, C_ASYNC = "C floor cuMemcpyPeer", "C floor cuMemcpyPeerAsync+cuStreamSynchronize"
OURS_SYNC, OURS_ASYNC = "cuproc memory.copy(dst, src)", "cuproc memory.copy(dst, src, stream=s)+s.synchronize()"
BIND_SYNC, BIND_ASYNC = "cuda.bindings cuMemcpyPeer", "cuda.bindings cuMemcpyPeerAsync+cuStreamSynchronize"
#: each cuproc row, the C floor it is read against, and the floor's driver call
PAIRS = ((OURS_SYNC, C_SYNC, "synchronous", "cuMemcpyPeer"),
         (OURS_ASYNC, C_ASYNC, "stream-ordered", "cuMemcpyPeerAsync"))
#: the C floor of each row's kind, for the groups and the table's ratio column (in the table's order)
FLOOR_OF = {C_SYNC: C_SYNC, OURS_SYNC: C_SYNC, BIND_SYNC: C_SYNC,
            C_ASYNC: C_ASYNC, OURS_ASYNC: C_ASYNC, BIND_ASYNC: C_ASYNC}

PEER_OFF, PEER_ON, SAME_DEVICE = "peer access off", "peer access on", "device 0 only"
ONE_GPU_NOTE = "one GPU: device-to-device on device 0, not a peer copy"
#: the driver calls of each cuproc row in a steady round of its group (SMOKE_COPIES copies and the wait), checked
#: on the fake driver in --smoke: a peer copy between two devices (made with the destination's context current:
#: it is), a plain device-to-device copy when both buffers are in device 0's context
CUPROC_CALLS = {True: {OURS_SYNC: ["cuCtxGetCurrent", "cuMemcpyPeer", "cuCtxSynchronize"],
                       OURS_ASYNC: ["cuMemcpyPeerAsync", "cuStreamSynchronize"]},
                False: {OURS_SYNC: ["cuCtxGetCurrent", "cuMemcpyDtoD", "cuCtxSynchronize"],
                        OURS_ASYNC: ["cuMemcpyDtoDAsync", "cuStreamSynchronize"]}}


def as_int(cdata: Any) -> int:
    """A cffi handle (CUcontext, CUstream) as the integer ctypes and cuda.bindings take."""
    import cuproc
    return int(cuproc.ffi.cast("uintptr_t", cdata))


def load_floor(tmp: Path) -> Any | None:
    """c_floor_peer.c built and loaded with its signatures set; None without a C compiler."""
    path = build_c("c_floor_peer.c", tmp, shared=True)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    head: list[Any] = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p,
                       ctypes.c_ulonglong]    # count, dst, dst_ctx, src, src_ctx, bytes
    lib.c_peer.argtypes, lib.c_peer_async.argtypes = head, [*head, ctypes.c_void_p]
    lib.c_peer.restype = lib.c_peer_async.restype = ctypes.c_double
    lib.c_last_error.restype = ctypes.c_int
    return lib


class Copy:
    """One direction of one size: the buffers, their contexts, the stream and the copies per row."""

    def __init__(self, dst: Any, src: Any, stream: Any, copies: int) -> None:
        self.dst, self.src, self.stream, self.copies = dst, src, stream, copies
        self.nbytes = min(dst.nbytes, src.nbytes)

    def floor_rows(self, lib: Any) -> dict[str, Callable[[], float]]:
        """The C floor's two rows: seconds timed in C; a failed call raises with its CUresult (else a failed
        floor would time as the fastest row)."""
        args = (self.copies, self.dst.address, as_int(self.dst.context.handle), self.src.address,
                as_int(self.src.context.handle), self.nbytes)
        stream = as_int(self.stream.handle)

        def checked(seconds: float, call: str) -> float:
            if seconds < 0:
                raise RuntimeError(f"the C floor's {call} failed: " + (
                    "libcuda.so.1 or a symbol is missing" if seconds == -1 else f"CUresult {lib.c_last_error()}"))
            return seconds
        return {C_SYNC: lambda: checked(lib.c_peer(*args), "cuMemcpyPeer"),
                C_ASYNC: lambda: checked(lib.c_peer_async(*args, stream), "cuMemcpyPeerAsync")}

    def cuproc_rows(self) -> dict[str, Callable[[], float]]:
        """cuproc's two rows, timed from Python to completion."""
        from cuproc import memory
        dst, src, s, copies, ctx = self.dst, self.src, self.stream, self.copies, self.dst.context

        def sync() -> float:
            t = time.perf_counter()
            for _ in range(copies):
                memory.copy(dst, src)
            ctx.synchronize()
            return time.perf_counter() - t

        def stream_ordered() -> float:
            t = time.perf_counter()
            for _ in range(copies):
                memory.copy(dst, src, stream=s)
            s.synchronize()
            return time.perf_counter() - t
        return {OURS_SYNC: sync, OURS_ASYNC: stream_ordered}

    def bindings_rows(self) -> dict[str, Callable[[], float]]:
        """cuda.bindings' two rows, every handle built once (ImportError without the package)."""
        from cuda.bindings import driver as cbd
        d, dc = cbd.CUdeviceptr(self.dst.address), cbd.CUcontext(as_int(self.dst.context.handle))
        s, sc = cbd.CUdeviceptr(self.src.address), cbd.CUcontext(as_int(self.src.context.handle))
        stream, n, copies = cbd.CUstream(as_int(self.stream.handle)), self.nbytes, self.copies
        peer_copy, peer_async = cbd.cuMemcpyPeer, cbd.cuMemcpyPeerAsync
        ctx_sync, stream_sync = cbd.cuCtxSynchronize, cbd.cuStreamSynchronize

        def checked(result: tuple[Any, ...], call: str) -> None:
            if int(result[0]):
                raise RuntimeError(f"cuda.bindings' {call} failed: {result[0]!r}")

        def sync() -> float:
            t = time.perf_counter()
            for _ in range(copies):
                checked(peer_copy(d, dc, s, sc, n), "cuMemcpyPeer")
            checked(ctx_sync(), "cuCtxSynchronize")
            return time.perf_counter() - t

        def stream_ordered() -> float:
            t = time.perf_counter()
            for _ in range(copies):
                checked(peer_async(d, dc, s, sc, n, stream), "cuMemcpyPeerAsync")
            checked(stream_sync(stream), "cuStreamSynchronize")
            return time.perf_counter() - t
        return {BIND_SYNC: sync, BIND_ASYNC: stream_ordered}


def drop(name: str, exc: Exception, errors: dict[str, str], where: str, strict: bool) -> None:
    """A row failed: it is dropped with its error noted, and the other rows go on; under ``strict`` (a smoke
    run) a failure of cuproc's own rows is raised instead."""
    if strict and name.startswith("cuproc"):
        raise exc
    errors[f"{name} ({where})"] = f"{type(exc).__name__}: {exc}"[:300]


def take_turns(rows: dict[str, Callable[[], float]], rounds: int, errors: dict[str, str], where: str,
               strict: bool) -> tuple[dict[str, list[float]], str]:
    """Each row's seconds per round: the rows take turns for ``rounds`` rounds in a new order each round, on
    one CPU with the heap frozen, after one warm-up each before pinning (harness.one_cpu says why).  A row
    that fails is dropped with all its rounds (:func:`drop`).  Also the garbage collections' summary line,
    "" when none ran inside the timed block."""
    names = []
    for name, row in rows.items():
        try:
            row()
        except Exception as exc:  # noqa: BLE001 - see drop
            drop(name, exc, errors, where + ", warm-up", strict)
            continue
        names.append(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    with one_cpu(), frozen_heap() as heap:
        for r in range(rounds):
            for name in round_order(names, r):
                if name not in times:
                    continue
                heap.tag = name
                try:
                    times[name].append(rows[name]())
                except Exception as exc:  # noqa: BLE001 - see drop
                    drop(name, exc, errors, f"{where}, round {r + 1}", strict)
                    del times[name]
        heap.tag = None
    return times, heap.summary(names) if heap.seen else ""


@dataclass
class Plan:
    """What every mode of a run shares: the devices' contexts, buffers and streams, how many rounds and
    copies, and what the run records besides the times (errors, garbage collections, driver calls)."""

    smoke: bool
    fake: Any                          # the fake driver (--smoke), else None
    contexts: list[Any]                # device 0's primary context, and device 1's with two GPUs
    buffers: dict[str, tuple[Any, Any]]   # size -> (buffer A, buffer B): on devices 0 and 1, or both on 0
    streams: tuple[Any, Any]           # a non-blocking stream in each buffer's context
    rounds: int
    copies: int
    errors: dict[str, str] = field(default_factory=dict)
    gc_notes: list[str] = field(default_factory=list)
    calls: dict[str, list[str]] = field(default_factory=dict)

    @property
    def two(self) -> bool:
        """Two devices: the copies are peer copies."""
        return len(self.contexts) == 2

    def directions(self, size: str) -> list[tuple[str, Copy]]:
        """Both directions between the size's two buffers (A to B first), each on a stream of its source's
        context."""
        (a, b), (sa, sb) = self.buffers[size], self.streams
        names = ("0->1", "1->0") if self.two else ONE_GPU_DIRECTIONS
        return [(names[0], Copy(b, a, sa, self.copies)), (names[1], Copy(a, b, sb, self.copies))]

    def close(self) -> None:
        """Free the buffers and streams."""
        for resource in [*(b for pair in self.buffers.values() for b in pair), *self.streams]:
            resource.close()


ONE_GPU_DIRECTIONS = ("0->0 (A to B)", "0->0 (B to A)")


def one_mode(plan: Plan, lib: Any, mode: str) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Every size and direction in the current peer-access state: {size: {direction: {row: seconds}}}.
    The synchronous rows take turns as one group, then the stream-ordered rows as another (the module
    docstring says why)."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for size in plan.buffers:
        out[size] = {}
        for label, copy in plan.directions(size):
            rows = copy.cuproc_rows()
            if lib is not None:
                rows.update(copy.floor_rows(lib))
            if not plan.smoke:
                rows.update(peer(plan.errors, "cuda.bindings", copy.bindings_rows) or {})
            out[size][label] = {}
            # current while a group runs: the destination's context for the synchronous rows (where memory.copy
            # makes a synchronous peer copy), the stream's for the stream-ordered ones (so that no row relies on
            # the driver routing a call by a stream of another context than the current one)
            for floor, kind, current in ((C_SYNC, "synchronous", copy.dst.context),
                                         (C_ASYNC, "stream-ordered", copy.stream.context)):
                where = f"{mode}, {size}, {label}, {kind}"
                group = {name: row for name, row in rows.items() if FLOOR_OF[name] == floor}
                with current:
                    times, gc_line = take_turns(group, plan.rounds, plan.errors, where, plan.smoke)
                    if plan.fake is not None:
                        plan.calls[where] = count_calls(plan.fake, group, plan.two)
                out[size][label].update(times)
                if gc_line:
                    plan.gc_notes.append(f"{where}: {gc_line}")
    return out


def count_calls(fake: Any, rows: dict[str, Callable[[], float]], two: bool) -> list[str]:
    """On the fake driver: the driver calls of one more run of the group's cuproc row, refused (SystemExit)
    unless they are what CUPROC_CALLS states -- a peer copy timed as a plain one, or the reverse, or calls
    added to the timed path, would time something else than the goal reads."""
    name = next(name for name in rows if name in CUPROC_CALLS[two])
    fake.clear_calls()
    rows[name]()
    calls = fake.calls()
    if calls != CUPROC_CALLS[two][name]:
        raise SystemExit(f"{name} made {calls}, not {CUPROC_CALLS[two][name]}: the benchmark would not time "
                         "what it says")
    return calls


def enable_peers(contexts: list[Any]) -> str:
    """Peer access both ways through the object layer (Context.enable_peer_access); "" when on, else why not."""
    import cuproc
    d0, d1 = (ctx.device for ctx in contexts)
    if not (d0.can_access_peer(d1) and d1.can_access_peer(d0)):
        return "cuDeviceCanAccessPeer says devices 0 and 1 cannot access each other"
    try:
        contexts[0].enable_peer_access(contexts[1])
        contexts[1].enable_peer_access(contexts[0])
    except cuproc.CudaError as exc:
        return f"enabling it failed: {exc}"
    return ""


def disable_peers(contexts: list[Any]) -> None:
    """Peer access off again both ways (Context.disable_peer_access answers False where it was not on)."""
    contexts[0].disable_peer_access(contexts[1])
    contexts[1].disable_peer_access(contexts[0])


ENABLED = "enabled both ways"


def run_modes(plan: Plan, lib: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The rounds of every mode: without peer access, then with it (two devices), or device 0 alone.
    Returns the rounds by mode, and each mode's state (for the one with peer access: why it did not run)."""
    if not plan.two:
        return {SAME_DEVICE: one_mode(plan, lib, SAME_DEVICE)}, {SAME_DEVICE: ONE_GPU_NOTE}
    rounds = {PEER_OFF: one_mode(plan, lib, PEER_OFF)}
    try:
        why = enable_peers(plan.contexts)
        if not why:
            rounds[PEER_ON] = one_mode(plan, lib, PEER_ON)
    finally:
        disable_peers(plan.contexts)       # (also where one of the two directions was enabled)
    return rounds, {PEER_OFF: "not enabled (information, no goal)", PEER_ON: why or ENABLED}


def gbps(rounds: dict[str, Any], nbytes: dict[str, int], copies: int) -> dict[str, Any]:
    """Median GB/s per mode, size, direction and row."""
    return {mode: {size: {label: {name: copies * nbytes[size] / statistics.median(v) / 1e9
                                  for name, v in rows.items() if v and statistics.median(v) > 0}
                          for label, rows in by_dir.items()}
                   for size, by_dir in by_size.items()}
            for mode, by_size in rounds.items()}


def evaluate(rounds: dict[str, Any], state: dict[str, str], smoke: bool, errors: dict[str, str],
             sizes: list[str]) -> Goals:
    """cuproc's synchronous and stream-ordered rows against the C floor's, per size and direction, with peer
    access on: bandwidth over the floor's is the floor's time over ours, paired within each round."""
    goals = Goals()
    labels = ("0->1", "1->0") if PEER_ON in state else ONE_GPU_DIRECTIONS
    for size in sizes:
        for label in labels:
            rows = rounds.get(PEER_ON, {}).get(size, {}).get(label, {})
            for ours, floor, kind, call in PAIRS:
                goal = f"memory.copy {kind} peer copy {size} {label} >= {GOAL}x the C floor ({call})"
                why = goal_blocker(rows, ours, floor, state, smoke, errors)
                if why == FAILED:    # cuproc's own row failed: a miss, never left unread
                    goals.rows.append({"goal": goal, "status": "MISSED", "value": None, "limit": GOAL,
                                       "text": "cuproc's row failed (see the results table)"})
                    continue
                goals.check(goal, paired_ratio(rows[floor], rows[ours]) if why is None else None, GOAL,
                            at_most=False, why_not=why)
    return goals


FAILED = "cuproc's row failed"


def goal_blocker(rows: dict[str, list[float]], ours: str, floor: str, state: dict[str, str], smoke: bool,
                 errors: dict[str, str]) -> str | None:
    """Why a goal cannot be read: None when it can, FAILED when cuproc's row failed (a miss)."""
    if PEER_ON not in state:
        return ONE_GPU_NOTE
    if smoke:
        return "smoke run"
    if state[PEER_ON] != ENABLED:
        return f"peer access: {state[PEER_ON]}"
    if ours not in rows:
        return FAILED
    if floor not in rows:
        return "the C floor did not run: " + next((e for k, e in errors.items() if k.startswith(floor)),
                                                  errors.get("C floor", "see the results table"))
    return None


def table_rows(bw: dict[str, Any], errors: dict[str, str]) -> list[list[str]]:
    """One line per mode, size, direction and row, with its bandwidth over the C floor of its kind."""
    table = []
    for mode, by_size in bw.items():
        for size, by_dir in by_size.items():
            for label, rows in by_dir.items():
                for name, v in sorted(rows.items(), key=lambda kv: list(FLOOR_OF).index(kv[0])):
                    floor = rows.get(FLOOR_OF[name])
                    table.append([f"{mode}, {size}, {label}", name, f"{v:.1f} GB/s",
                                  f"{v / floor:.3f}" if floor else ""])
    for name, why in errors.items():
        table.append(["", name, "missing", why[:90]])
    return table


def plot(out: Path, bw: dict[str, Any], m: dict[str, Any]) -> str | None:
    """One panel per size and direction of the goals' mode (the last that ran), the C floor's synchronous
    row as the line."""
    mode = list(bw)[-1]
    panels = [([(name, v) for name, v in rows.items() if name != C_SYNC],
               (f"{C_SYNC} ({size}, {label})", rows[C_SYNC]) if C_SYNC in rows else None)
              for size, by_dir in bw[mode].items() for label, rows in by_dir.items()]
    return plot_panels(out / "bench_peer.png", f"Peer copies, {mode}, {m.get('gpu')}, {m['date']}, "
                       f"{m['cuproc_path']}", "GB/s (median)", panels)


def notes(plan: Plan, state: dict[str, str], devices: list[str]) -> list[str]:
    """The results file's notes: devices, peer-access states, how rows are timed and read, calls counted."""
    lines = [f"devices: {len(devices)} ({'; '.join(devices)})"]
    if not plan.two:
        lines.append(ONE_GPU_NOTE)
    lines += [f"{mode}: {why}" for mode, why in state.items() if why != ONE_GPU_NOTE]
    lines += [(f"each row, each round: {plan.copies} copies then the wait; median over {plan.rounds} rounds (rows "
               "in a new order each round, one CPU); synchronous rows with the destination's context current and "
               "one cuCtxSynchronize, stream-ordered rows on a stream of the source's context, current, and one "
               "cuStreamSynchronize, each kind taking turns as a group of its own; the C floor timed in C, the "
               "others from Python"),
              ("x C floor column: median bandwidth over the C floor's of the same kind (synchronous or "
               "stream-ordered); a goal's ratio is the median of per-round ratios, not the quotient of two rows")]
    if plan.calls:
        lines.append("driver calls of one cuproc row on the fake driver: " + "; ".join(
            f"{where}: {'+'.join(calls)}" for where, calls in plan.calls.items()))
    return lines + ["garbage collections inside the timed blocks: " + (" | ".join(plan.gc_notes) or "none")]


def make_plan(smoke: bool) -> tuple[Plan, list[Any], list[str]]:
    """The run's plan on the fake driver (smoke) or the real one: the primary contexts of devices 0 and 1
    retained (device 0's alone with one GPU) and each size's buffers and the streams made in them; also the
    retained PrimaryContexts and each device's name."""
    import cuproc
    fake = smoke_driver() if smoke else None
    count = cuproc.Device.count()
    if count < 1:
        raise SystemExit("bench_peer: no CUDA device")
    pcs = [cuproc.PrimaryContext(i).retain() for i in range(min(count, 2))]
    contexts = [pc.context for pc in pcs]
    a, b = contexts[0], contexts[-1]             # where buffers A and B live: devices 0 and 1, or 0 twice
    plan = Plan(smoke=smoke, fake=fake, contexts=contexts,
                buffers={f"{n >> 20} MiB": (cuproc.DeviceBuffer(n, context=a), cuproc.DeviceBuffer(n, context=b))
                         for n in (SMOKE_SIZES if smoke else SIZES)},
                streams=(cuproc.Stream(non_blocking=True, context=a), cuproc.Stream(non_blocking=True, context=b)),
                rounds=SMOKE_ROUNDS if smoke else ROUNDS, copies=SMOKE_COPIES if smoke else COPIES)
    return plan, pcs, [f"{i}: {cuproc.Device(i).name}" for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    args = bench_args(bench_parser(), argv)
    started = time.perf_counter()
    plan, pcs, devices = make_plan(args.smoke)
    nbytes = {size: pair[0].nbytes for size, pair in plan.buffers.items()}
    with tempfile.TemporaryDirectory() as tmp:
        # a floor that does not build is reported like a missing peer: the other rows still run
        lib = None if args.smoke else peer(plan.errors, "C floor", lambda: load_floor(Path(tmp)))
        if lib is None and not args.smoke:
            plan.errors.setdefault("C floor", "no C compiler: the floor rows did not run")
        rounds, state = run_modes(plan, lib)
    plan.close()
    for pc in pcs:
        pc.release()
    bw = gbps(rounds, nbytes, plan.copies)
    goals = evaluate(rounds, state, args.smoke, plan.errors, list(nbytes))
    seconds = time.perf_counter() - started
    data = {"machine": machine(), "smoke": args.smoke, "devices": devices, "peer_access": state,
            "copies_per_round": plan.copies, "GBps": bw, "rounds_s": rounds, "errors": plan.errors,
            "copy_calls": plan.calls, "run_seconds": seconds}
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_results(args.out, "bench_peer", data, table_rows(bw, plan.errors),
                         ["copy", "who", "bandwidth", "x C floor"],
                         [*notes(plan, state, devices), f"the run took {seconds:.1f} s (setup and every mode)"],
                         goals, [plot(args.out, bw, data["machine"])])
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
