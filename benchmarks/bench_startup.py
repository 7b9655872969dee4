"""Startup: a fresh process to "device usable" (device 0's context current and a first 256-byte
allocation), side by side: C, ctypes + cuInit, cuproc, cuda.bindings, cuda.core, CuPy and torch.

Two measures per fresh process, the rows taking turns round by round, in a new order each round
(:func:`harness.round_order`: in a fixed order, or one rotated by a row each round, ctypes nearly
always followed the interpreter-only row and cuproc nearly always followed ctypes, a process whose
driver teardown had just ended):

* **wall**: the whole process, timed from here around ``subprocess.run`` (interpreter start
  included, the same for every Python row);
* **in-process**: what the child's own script takes, from its first statement to the device being
  usable, printed by the child (interpreter start excluded: it is the same for every Python row
  and it is most of the wall time's noise).

Goal (issue 9): from a fresh interpreter to device usable, cuproc within 15 ms of ctypes + cuInit
doing the same.  It is read four ways, each printed met or missed, each the median of *paired*
differences (cuproc minus ctypes in the same round, so both see the same machine state): the wall
times of the two rows that leave by ``os._exit`` as soon as the device is usable; the same for the
rows that exit normally (the whole process: cuproc's exit is its modules' teardown, and it leaves the
primary context retain to the process exit, as ctypes, cuda.bindings and cuda.core do); the
in-process times; and the in-process times when ctypes has done dlopen, cuInit and the first primary-context retain
before the child's clock starts, in both rows (what each adds to the driver's own work).  The
spread of each paired difference (quartiles) is printed beside it.  cuInit itself (hundreds of ms, varying by tens of ms between
processes) is in both sides of every difference.  The results also list the cuproc modules a first
allocation imported, and where cuproc's in-process time goes (import / use_device / first buffer).
"""
from __future__ import annotations

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
    round_order,
    smoke_driver,
    write_results, bench_args, bench_parser)

CTYPES = "ctypes + cuInit"
EXIT_ROW = "cuproc, leaving by os._exit (no teardown)"
CTYPES_EXIT_ROW = "ctypes + cuInit, leaving by os._exit (no teardown)"
WARM_ROW = "cuproc, after ctypes did dlopen + cuInit + retain (not timed)"
CTYPES_WARM_ROW = "ctypes, after dlopen + cuInit + retain (not timed)"
# The driver's own heavy work, done before the child's clock starts in the two *_WARM_ROW rows.
DRIVER_WORK = ("import ctypes; l = ctypes.CDLL('libcuda.so.1'); l.cuInit(0); d = ctypes.c_int(); "
               "l.cuDeviceGet(ctypes.byref(d), 0); c = ctypes.c_void_p(); "
               "l.cuDevicePrimaryCtxRetain(ctypes.byref(c), d)")
# What ctypes does once the driver's work is done: the context current, a first allocation.
CTYPES_USABLE = ("l.cuCtxSetCurrent(c); p = ctypes.c_uint64(); "
                 "assert l.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(256)) == 0")
CTYPES_CODE = f"{DRIVER_WORK}; {CTYPES_USABLE}"
CUPROC_CODE = "import cuproc; pc = cuproc.use_device(0); cuproc.DeviceBuffer(256)"
PY = {
    "python -c pass (interpreter alone)": "pass",
    CTYPES: CTYPES_CODE,
    "cuproc": CUPROC_CODE,
    # The same two, leaving as soon as the device is usable, without interpreter teardown: the goal's
    # "fresh interpreter to device usable" in wall time.  The difference to the rows that exit normally
    # is what each exit costs: cuproc's is its modules' teardown (the buffer went when it was dropped)
    # and, like ctypes and cuda.bindings, it leaves the primary context to the process exit.  The
    # exit is also timed inside the child (exit_parts), which the wall times are too noisy to show.
    EXIT_ROW: CUPROC_CODE,
    CTYPES_EXIT_ROW: CTYPES_CODE,
    # What each adds to the driver's own work: the child's clock starts after DRIVER_WORK, so cuInit
    # and the first primary-context retain (hundreds of ms, varying by tens of ms between processes,
    # and the same calls on both sides) are out of the in-process number.
    WARM_ROW: CUPROC_CODE,
    CTYPES_WARM_ROW: CTYPES_USABLE,
    "cuda.bindings": (
        "from cuda.bindings import driver as d; d.cuInit(0); _, dev = d.cuDeviceGet(0); "
        "_, c = d.cuDevicePrimaryCtxRetain(dev); d.cuCtxSetCurrent(c); e, p = d.cuMemAlloc(256); assert e == 0"),
    "cuda.core": (
        "try:\n from cuda.core import Device\nexcept ImportError:\n from cuda.core.experimental import Device\n"
        "dev = Device(0); dev.set_current(); dev.allocate(256, stream=dev.default_stream)"),   # 1.x: keyword-only
    "CuPy": "import cupy; cupy.cuda.Device(0).use(); cupy.cuda.alloc(256)",
    "torch": "import torch; torch.empty(256, dtype=torch.uint8, device='cuda')",
}
HARD_EXIT = (EXIT_ROW, CTYPES_EXIT_ROW, WARM_ROW, CTYPES_WARM_ROW)
SETUP = {WARM_ROW: DRIVER_WORK, CTYPES_WARM_ROW: DRIVER_WORK}
# The row each row's wall time is compared with in the table: the same way of leaving.
REFERENCE = {EXIT_ROW: CTYPES_EXIT_ROW, WARM_ROW: CTYPES_WARM_ROW, CTYPES_WARM_ROW: CTYPES_WARM_ROW}
# Where cuproc's in-process time goes, printed by a child as three numbers (ms).
PHASES = ("import time; t0 = time.perf_counter(); import cuproc; t1 = time.perf_counter(); "
          "pc = cuproc.use_device(0); t2 = time.perf_counter(); cuproc.DeviceBuffer(256); t3 = time.perf_counter(); "
          "print((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)")
MODULES = ("import sys, cuproc; pc = cuproc.use_device(0); cuproc.DeviceBuffer(256); "
           "print(' '.join(sorted(m for m in sys.modules if m.startswith('cuproc'))))")


# Heavy peers (seconds per process) run every HEAVY_EVERY-th round only, so the rows that the goal
# compares get many rounds inside the benchmark's time limit.
HEAVY = ("CuPy", "cuda.core", "torch")
HEAVY_EVERY = 3


def timed_script(code: str, *, hard_exit: bool = False, setup: str = "") -> str:
    """``setup`` (untimed), then ``code`` between the child's own clock readings: it prints its
    in-process ms last (and with ``hard_exit`` leaves by ``os._exit(0)``, skipping the interpreter's
    teardown)."""
    end = "\nimport os, sys; sys.stdout.flush(); os._exit(0)" if hard_exit else ""
    return (f"{setup}\nimport time as _t\n_t0 = _t.perf_counter()\n{code}\n"
            f"print((_t.perf_counter() - _t0) * 1e3){end}")


# Appended to a child's code for the exit clock (exit_stamp.c has the C half, registered last so that
# it runs first in exit(): right after Python's teardown).  Python's atexit handlers run first in that
# teardown.
EXIT_STAMP = ("\nimport atexit as _ae, ctypes as _ce, os as _oe, time as _te\n"
              "_ae.register(lambda: open(_oe.environ['EXIT_STAMP_FILE'], 'a').write(f'python {_te.monotonic():.6f}\\n'))\n"
              "assert _ce.CDLL(_oe.environ['EXIT_STAMP_LIB']).exit_stamp_register() == 0")
EXIT_ROWS = ("cuproc", CTYPES)   # the rows whose exits are timed in the child
EXIT_RUNS = 15


def exit_parts(code: str, stamp_lib: Path, env: dict, stamp_file: Path) -> tuple[float, float]:
    """One child running ``code`` with the exit clock: (ms of Python's teardown, from its first
    atexit handler to the C atexit handler registered last; ms of the C exit with the kernel's part,
    from there until this process saw the child end).  CLOCK_MONOTONIC is one clock for both
    processes.  A child that leaves no stamps (it skipped its exit) raises RuntimeError."""
    stamp_file.write_text("")
    subprocess.run([sys.executable, "-c", code + EXIT_STAMP], check=True, capture_output=True,
                   env=dict(env, EXIT_STAMP_LIB=str(stamp_lib), EXIT_STAMP_FILE=str(stamp_file)))
    ended = time.monotonic()
    stamps = dict(line.split() for line in stamp_file.read_text().splitlines() if line.strip())
    if "python" not in stamps or "c" not in stamps:
        raise RuntimeError(f"the exit clock got {stamps or 'no stamps'}")
    python, c = float(stamps["python"]), float(stamps["c"])
    return (c - python) * 1e3, (ended - c) * 1e3


def run_once(cmd: list[str], env: dict) -> tuple[float, float | None]:
    """(wall ms, in-process ms printed by a Python child, else None)."""
    t = time.perf_counter()
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    wall = (time.perf_counter() - t) * 1e3
    inner = None
    if cmd[0] == sys.executable:
        lines = out.stdout.strip().splitlines()
        inner = float(lines[-1]) if lines else None
    return wall, inner


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return q[0], q[2]


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(smoke_help="cuproc on the fake driver only")
    p.add_argument("--runs", type=int, default=21, help="rounds (heavy peers: every third round)")
    args = bench_args(p, argv)
    env = dict(os.environ)
    runs = 2 if args.smoke else args.runs
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        commands: dict[str, list[str]] = {}
        if args.smoke:
            env["CUPROC_LIBCUDA"] = str(smoke_driver().path)
            names = ["python -c pass (interpreter alone)", "cuproc", EXIT_ROW]
        else:
            exe = build_c("c_startup.c", Path(tmp), shared=False)
            if exe is not None:
                commands["C (dlopen, cuInit, primary context, cuMemAlloc)"] = [str(exe)]
            names = list(PY)
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "cuproc")], env=env, check=True)
        commands.update({name: [sys.executable, "-c", timed_script(PY[name], hard_exit=name in HARD_EXIT,
                                                                 setup=SETUP.get(name, ""))]
                         for name in names})
        for name, cmd in list(commands.items()):     # once each: a failing peer is reported, not timed
            try:
                run_once(cmd, env)
            except (subprocess.CalledProcessError, OSError) as exc:
                tail = getattr(exc, "stderr", b"") or b""
                errors[name] = (tail.decode(errors="replace").strip().splitlines() or [str(exc)])[-1][:160]
                del commands[name]
        times: dict[str, list[float]] = {name: [] for name in commands}
        inner: dict[str, list[float]] = {name: [] for name in commands}
        # ours - theirs, in-process, same round: (cuproc, ctypes) and the two rows after the driver's work
        pairs = {"cold": ("cuproc", CTYPES), "warm": (WARM_ROW, CTYPES_WARM_ROW)}
        # ours - theirs, wall, same round: leaving by os._exit once usable, and the whole process
        wall_pairs = {"wall": (EXIT_ROW, CTYPES_EXIT_ROW), "wall with exit": ("cuproc", CTYPES)}
        paired: dict[str, list[float]] = {k: [] for k in (*pairs, *wall_pairs)}
        phases: list[list[float]] = []
        warm_phases: list[list[float]] = []   # the same, after the driver's work (the warm rows' setup)
        for rnd in range(runs):
            this_round: dict[str, float] = {}
            this_wall: dict[str, float] = {}
            for name in round_order(list(commands), rnd):   # no row always follows the same one
                if name in HEAVY and rnd % HEAVY_EVERY:
                    continue
                wall, own = run_once(commands[name], env)
                times[name].append(wall)
                this_wall[name] = wall
                if own is not None:
                    inner[name].append(own)
                    this_round[name] = own
            for key, (ours_row, theirs_row) in pairs.items():
                if ours_row in this_round and theirs_row in this_round:
                    paired[key].append(this_round[ours_row] - this_round[theirs_row])
            for key, (ours_row, theirs_row) in wall_pairs.items():
                if ours_row in this_wall and theirs_row in this_wall:
                    paired[key].append(this_wall[ours_row] - this_wall[theirs_row])
            scripts = [(PHASES, phases)] + ([] if args.smoke else [(f"{DRIVER_WORK}\n{PHASES}", warm_phases)])
            for script, into in scripts:
                out = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True,
                                     text=True)
                into.append([float(x) for x in out.stdout.split()[-3:]])
        modules = subprocess.run([sys.executable, "-c", MODULES], env=env, check=True, capture_output=True,
                                 text=True).stdout.split()
        # The exit, timed in the child (separate processes, after the rounds: the rows above run as is).
        exits_timed: dict[str, list[tuple[float, float]]] = {}
        exit_runs = 2 if args.smoke else EXIT_RUNS
        stamp_lib = None if sys.platform != "linux" else build_c("exit_stamp.c", Path(tmp), shared=True)
        for name in (n for n in EXIT_ROWS if n in commands and stamp_lib is not None):
            try:
                exits_timed[name] = [exit_parts(PY[name], stamp_lib, env, Path(tmp) / "exit_stamps")
                                     for _ in range(exit_runs)]
            except (subprocess.CalledProcessError, RuntimeError) as exc:   # reported; the rounds stand
                errors[f"{name}, exit timed in the child"] = str(exc)[:160]
    ms = {name: statistics.median(v) for name, v in times.items()}
    own_ms = {name: statistics.median(v) for name, v in inner.items() if v}
    goals = Goals()
    smoke_why = "smoke run" if args.smoke else None
    # The goal is "a fresh interpreter to device usable", read four ways, each printed met or missed.
    def paired_median(key: str) -> tuple[float | None, str]:
        values = paired[key]
        if not values:
            return None, ""
        lo, hi = quartiles(values)
        return statistics.median(values), f"; quartiles {lo:+.1f} / {hi:+.1f} ms over {len(values)} rounds"

    value, spread = paired_median("wall")
    goals.check("cuproc startup to device usable within 15 ms of ctypes + cuInit (wall, fresh process to device "
                f"usable, both leaving by os._exit there; median of paired same-round differences{spread})",
                value, 15.0, unit=" ms", why_not=smoke_why)
    value, spread = paired_median("wall with exit")
    goals.check("... the same, the whole process (wall, exit included: like ctypes, cuproc leaves the primary "
                f"context to the process exit; median of paired same-round differences{spread})",
                value, 15.0, unit=" ms", why_not=smoke_why)
    value, spread = paired_median("cold")
    goals.check("cuproc startup within 15 ms of ctypes + cuInit (in-process: interpreter start and exit excluded; "
                f"median of paired same-round differences{spread})", value, 15.0, unit=" ms", why_not=smoke_why)
    value, spread = paired_median("warm")
    goals.check("... and what each adds to the driver's own work (in-process, after ctypes did dlopen, cuInit and "
                f"the first primary-context retain, untimed, in both; median of paired same-round differences{spread})",
                value, 15.0, unit=" ms", why_not=smoke_why)
    phase_names = ("import cuproc", "use_device(0)", "first DeviceBuffer(256)")
    phase_ms = {k: statistics.median(p[i] for p in phases) for i, k in enumerate(phase_names)}
    warm_phase_ms = {k: statistics.median(p[i] for p in warm_phases) for i, k in enumerate(phase_names)
                     if warm_phases}
    data = {"machine": machine(), "smoke": args.smoke, "startup_ms": ms, "in_process_ms": own_ms,
            "runs_ms": times, "in_process_runs_ms": inner, "paired_cuproc_minus_ctypes_ms": paired,
            "exit_parts_ms": exits_timed, "cuproc_phases_ms": phase_ms, "cuproc_phases_after_driver_work_ms": warm_phase_ms, "errors": errors, "cuproc_modules_imported": modules}
    exits = {name: ms[name] - ms[quick] for name, quick in (("cuproc", EXIT_ROW), (CTYPES, CTYPES_EXIT_ROW))
             if name in ms and quick in ms}

    def versus(values: dict[str, float], name: str) -> str:
        """The row against its reference (the ctypes row that leaves and starts its clock the same way)."""
        reference = REFERENCE.get(name, CTYPES)
        return f"{values[name] - values[reference]:+.1f}" if name in values and reference in values else ""

    table = [[name, f"{v:.1f}", f"{min(times[name]):.1f} - {max(times[name]):.1f}", versus(ms, name),
              f"{own_ms[name]:.1f}" if name in own_ms else "", versus(own_ms, name)]
             for name, v in sorted(ms.items(), key=lambda kv: kv[1])]
    table += [[name, "missing", "", why[:70], "", ""] for name, why in errors.items()]
    notes = [f"{runs} rounds, rows taking turns in a new order each round ({', '.join(HEAVY)}: "
             f"every {HEAVY_EVERY}rd round); medians; range: fastest - slowest run",
             "in-process: from the child's first statement to device usable, printed by the child "
             "(interpreter start excluded)",
             "vs columns: against the ctypes row that leaves the same way (os._exit rows against the os._exit ctypes "
             "row, rows after the driver's work against that ctypes row, every other row against ctypes + cuInit)",
             "exit (median wall, normal exit minus os._exit once usable): " +
             ", ".join(f"{k} {v:+.1f} ms" for k, v in exits.items()) +
             "; at exit cuproc frees what is still alive (children before parents; in this row nothing: the "
             "buffer was freed when dropped) and, as ctypes does, leaves the primary context to the process exit; "
             "cuproc's includes its modules' own teardown",
             f"exit timed in the child (median over {exit_runs} processes each, after the rounds; Python's teardown "
             "from its first atexit handler to the C atexit handler registered last / the C exit, libcuda's exit "
             "work included, with the kernel's part, until the parent saw the child end): " + ("; ".join(
                 f"{name} {statistics.median(p for p, _ in v):.1f} / {statistics.median(c for _, c in v):.1f} ms"
                 for name, v in exits_timed.items()) or "not measured (no C compiler, or not Linux)"),
             "cuproc in-process phases (median, separate processes): " +
             ", ".join(f"{k} {v:.2f} ms" for k, v in phase_ms.items()) +
             ("; after the driver's work: " + ", ".join(f"{k} {v:.2f} ms" for k, v in warm_phase_ms.items())
              if warm_phase_ms else ""),
             f"cuproc modules imported by use_device(0) + DeviceBuffer(256) ({len(modules)}): {' '.join(modules)}"]
    args.out.mkdir(parents=True, exist_ok=True)
    plot = plot_bars(args.out / "bench_startup.png", f"Fresh process to device usable, {data['machine'].get('gpu')}, "
                     f"{data['machine']['date']}", "ms (median)",
                     [(k, v) for k, v in ms.items() if not k.startswith("C ")],
                     next(((k, v) for k, v in ms.items() if k.startswith("C ")), None))
    path = write_results(args.out, "bench_startup", data, table,
                         ["process", "wall ms (median)", "wall range (ms)", "wall vs ctypes",
                          "in-process ms (median)", "in-process vs ctypes"], notes,
                         goals, [plot])
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
