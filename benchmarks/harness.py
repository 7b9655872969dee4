"""Benchmark harness: timing helpers, machine facts, goals, plots and the results file.

Policy: every benchmark times cuproc *in the same run* as the C floor and the peers
(cuda.bindings, cuda.core, CuPy, ...), and results are compared as ratios, since absolute
times differ between machines and runs.  Every goal of the issue and of benchmarks/ is
printed as met or missed with its number -- none is left out; a goal that cannot be
evaluated in a run (a peer missing, the pure path where the goal is the compiled one's,
a smoke run) says so and why.  A peer that is missing or fails is reported, never fatal.

``--smoke`` (every bench_*.py): run end to end on a CPU against the fake driver of
tests/fakedriver.py, with the C floors and the peers skipped and few repetitions, so that
a benchmark is never first executed on the GPU machine.  Its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import timeit
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "benchmarks"


def per_call_us(stmt: Callable[[], Any] | str, number: int = 200_000, repeat: int = 7,
                globals: dict | None = None) -> float:
    """Best-of-``repeat`` time per call in microseconds (best: least disturbed by the machine)."""
    timer = timeit.Timer(stmt, globals=globals)
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e6


@contextmanager
def one_cpu() -> Iterator[None]:
    """Pin the calling thread to one CPU for the block (the highest allowed: CPU 0 takes most
    interrupts), then give it back its CPUs.

    Why: rows that make the very same calls differed by a fifth in one run when a slow spell, or a
    move to another core, landed on one of them.  Linux pins only the calling thread (pid 0), so
    the driver's own threads, made before, keep every CPU; a thread made inside the block inherits
    the one CPU, so warm-ups (where drivers and peers start their threads) belong before it.
    Elsewhere it does nothing."""
    pin = getattr(os, "sched_setaffinity", None)
    before = os.sched_getaffinity(0) if pin is not None else None
    if pin is not None and before:
        pin(0, {max(before)})
    try:
        yield
    finally:
        if pin is not None and before:
            pin(0, before)


class Collections:
    """The garbage collections that ran inside a :func:`frozen_heap` block, by the tag that was set
    when each started (``tag`` is whatever the timing loop last assigned: a row's name)."""

    def __init__(self, full_collection_ms: float, frozen: int) -> None:
        self.full_collection_ms = full_collection_ms   # one gc.collect() over the heap, before freezing
        self.frozen = frozen                           # objects moved out of the collector's scans
        self.tag: Any = None
        self.seen: dict[Any, list[tuple[int, float]]] = {}   # tag -> [(generation, ms), ...]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seen.setdefault(self.tag, []).append(
                (info["generation"], (time.perf_counter() - self._started) * 1e3))

    def summary(self, tags: list[Any]) -> str:
        """One line: the collections met under each of ``tags`` (generation counts and total ms), and
        the cost of the full collection the freeze took out of the timing."""
        parts = []
        for tag in tags:
            events = self.seen.get(tag, [])
            if events:
                gens = [sum(1 for g, _ in events if g == k) for k in range(3)]
                parts.append(f"{tag}: {'/'.join(map(str, gens))} ({sum(ms for _, ms in events):.2f} ms)")
        return (f"garbage collections inside the timed block, generation 0/1/2 (total time): "
                f"{'; '.join(parts) or 'none'}; {self.frozen:,} objects frozen before it, over which one full "
                f"collection took {self.full_collection_ms:.1f} ms")


@contextmanager
def frozen_heap() -> Iterator[Collections]:
    """Collect, freeze every object alive (``gc.freeze``) for the timed block, and record the
    collections that run inside it; unfreeze afterwards (Python 3.12 starts with a few hundred
    objects frozen, which ``gc.unfreeze`` returns to the collector as well: harmless for a benchmark).

    Why: the peers load tens of thousands of objects (torch, CuPy, cuda.core), and a full
    collection over them took 15.5 ms on the GPU host, landing in whichever row's round tipped the
    collector's threshold; one slow round is enough to turn a per-round lead.  The collector stays
    on: every row still pays for collecting its own garbage, and a row that keeps objects alive
    still triggers full collections (scans of what it made, not of the peers' heap).  The
    collections each row met are printed, so the effect can be read: in the 2026-11-25 runs no
    steady round met one, and the rounds' spread did not come from the collector."""
    already = gc.get_freeze_count()
    gc.collect()
    t = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - t) * 1e3
    gc.freeze()
    record = Collections(full_ms, gc.get_freeze_count() - already)
    gc.callbacks.append(record)
    try:
        yield record
    finally:
        gc.callbacks.remove(record)
        gc.unfreeze()


def round_order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order of rows that take turns: ``names`` shuffled with ``r`` as the seed (the same
    orders in every run), so that no row has a fixed place, nor always follows the same other row (a
    rotation keeps the cyclic order: every row but the first keeps its predecessor)."""
    order = list(names)
    random.Random(r).shuffle(order)
    return order


def paired_ratio(rows: list[float], references: list[float]) -> float | None:
    """The median over rounds of ``rows[i] / references[i]``: each ratio taken within one round (the
    rows took turns), so what moves both rows of a round -- clocks, load, a slow spell -- cancels.
    Lists of different lengths are refused: their rounds would not pair."""
    if len(rows) != len(references):
        raise ValueError(f"paired_ratio: {len(rows)} rounds against {len(references)}: they do not pair")
    ratios = [a / b for a, b in zip(rows, references) if b]
    return statistics.median(ratios) if ratios else None


def child_ms(code: str, runs: int = 15, env: dict | None = None) -> float:
    """Median over fresh interpreters of a duration (ms) the child prints itself."""
    values = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        values.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(values)


def source_commit() -> str | None:
    """The commit the benchmark ran on: ``CUPROC_BENCH_COMMIT`` (the device gets a copy of the work tree
    without .git, so the caller passes it), else git's HEAD with ``+changes`` for a dirty tree, else None."""
    given = os.environ.get("CUPROC_BENCH_COMMIT", "").strip()
    if given:
        return given
    try:
        top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
        if Path(top).resolve() != ROOT.resolve():     # a copy without .git inside another repository
            return None
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "") if head else None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            "cpu": platform.processor() or platform.machine(), "cuproc_path": fast_path_status(),
                            "commit": source_commit()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, check=True)
        info["gpu"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        info["gpu"] = None
    return info


def fast_path_active() -> bool:
    """Whether cuproc's compiled fast path is on (``cuproc.fastpath.active()``; absent: the pure path)."""
    try:
        from cuproc import fastpath  # type: ignore[attr-defined]
    except ImportError:
        return False
    try:
        return bool(fastpath.active())
    except Exception:  # noqa: BLE001 - a broken fast path is reported as not active
        return False


def fast_path_status() -> str:
    """The path a results file names: the compiled fast path, or pure Python and why
    (cuproc.fastpath.status(), which reads CUPROC_PURE_PYTHON by cuproc's own rule)."""
    if fast_path_active():
        return "compiled fast path (cffi API mode)"
    try:
        from cuproc import fastpath  # type: ignore[attr-defined]
        why = fastpath.status().removeprefix("off: ")
    except Exception:  # noqa: BLE001 - no cuproc, or one without fastpath: the path alone
        why = ""
    return "pure Python (cffi ABI mode)" + (f", {why}" if why else "")


def build_c(source: str, out_dir: Path, *, shared: bool) -> Path | None:
    """Compile benchmarks/<source> (a shared library or a program); None without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    stem = Path(source).stem
    target = out_dir / (f"lib{stem}.so" if shared else stem)
    flags = ["-O2", "-shared", "-fPIC", "-DC_FLOOR_LIBRARY"] if shared else ["-O2"]
    subprocess.run([cc, *flags, "-o", str(target), str(HERE / source), "-ldl"], check=True)
    return target


def smoke_driver() -> Any:
    """For ``--smoke``: the fake driver built from tests/fakedriver.c as cuproc's default handle."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fakedriver import build

    import cuproc
    fake = build(Path(tempfile.mkdtemp(prefix="cuproc-smoke-")))
    fake.reset()
    cuproc.set_default_driver(cuproc.Driver(library=str(fake.path)))
    return fake


def peer(errors: dict[str, str], name: str, make: Callable[[], Any]) -> Any:
    """``make()``, or None with the reason noted in ``errors`` (a missing or failing peer is reported)."""
    try:
        return make()
    except Exception:  # noqa: BLE001 - any failure of a peer is a row, not a crash
        errors[name] = traceback.format_exc(limit=2).strip().splitlines()[-1][:160]
        return None


class Goals:
    """The goals of one benchmark, each printed as met, missed, or not evaluated (and why)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def check(self, goal: str, value: float | None, limit: float | None, *, at_most: bool = True,
              unit: str = "x", why_not: str | None = None) -> None:
        """``value`` against ``limit`` (``at_most``: value <= limit, else value >= limit)."""
        if why_not is None and (value is None or limit is None):
            why_not = "a number it needs is missing in this run"
        if why_not is not None:
            self.rows.append({"goal": goal, "status": f"not evaluated ({why_not})", "value": value, "limit": limit})
            return
        met = value <= limit if at_most else value >= limit
        self.rows.append({"goal": goal, "status": "met" if met else "MISSED", "value": value, "limit": limit,
                          "text": f"{value:.3f}{unit} (goal {'<=' if at_most else '>='} {limit:g}{unit})"})

    def fast_only(self, goal: str, value: float | None, limit: float, **kw: Any) -> None:
        """A goal of the compiled fast path: evaluated only when it is active."""
        self.check(goal, value, limit, why_not=None if fast_path_active() else "pure path", **kw)

    def lines(self) -> list[str]:
        return [f"- [{r['status']}] {r['goal']}" + (f": {r['text']}" if "text" in r else
                                                    (f": {r['value']:.3f}" if isinstance(r["value"], float) else ""))
                for r in self.rows]


def plot_bars(path: Path, title: str, xlabel: str, rows: list[tuple[str, float]],
              floor: tuple[str, float] | None) -> str | None:
    """One bar per launcher or peer, the C floor as a vertical line; None (and no file) without matplotlib."""
    return plot_panels(path, title, xlabel, [(rows, floor)])


def plot_panels(path: Path, title: str, xlabel: str,
                panels: list[tuple[list[tuple[str, float]], tuple[str, float] | None]]) -> str | None:
    """:func:`plot_bars` for groups with floors of their own (synchronous and stream-ordered allocation):
    one panel per group, stacked, each with its own C floor line.  None (and no file) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colours = [("cuproc", "#4c72b0"), ("bare", "#bbbbbb"), ("C ", "#55a868")]
    heights = [0.38 * len(rows) + 0.9 for rows, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(heights) + 0.9), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (rows, floor) in zip(axes[:, 0], panels):
        rows = sorted(rows, key=lambda r: r[1])
        ax.barh([r[0] for r in rows], [r[1] for r in rows],
                color=[next((c for k, c in colours if r[0].startswith(k)), "#dd8452") for r in rows])
        ax.invert_yaxis()               # shortest bar on top: the legend goes to the top right, clear of bars
        ax.set_xlim(0, max([r[1] for r in rows] + [floor[1] if floor else 0]) * 1.12)
        if floor is not None:
            ax.axvline(floor[1], color="black", linestyle="--", label=floor[0])
            ax.legend(loc="upper right", fontsize=8)
        ax.set_xlabel(xlabel)
    fig.suptitle("\n".join(textwrap.wrap(title, 90)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


OUT_HELP = ("where the results (bench_X.md, .json, .png) go; default: a new temporary folder, printed.  "
            "tools/gpu_check.sh names one; tools/collect_results.py copies a run into benchmarks/results/")


def results_dir(out: Path | None) -> Path:
    """``--out`` as given, else a new temporary folder: a run (a ``--smoke`` run above all) never writes into
    the checkout unless told to (issue 41: untracked result files appeared in benchmarks/results/)."""
    return out if out is not None else Path(tempfile.mkdtemp(prefix="cuproc-bench-"))


SMOKE_HELP = "run on the fake driver, no C floor, no peers"


def bench_parser(description: str | None = None, smoke_help: str = SMOKE_HELP) -> argparse.ArgumentParser:
    """The options every benchmark takes, ``--out`` and ``--smoke``; a benchmark adds its own to it."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    return p


def bench_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed options, ``out`` made a folder by :func:`results_dir`'s rule."""
    args = parser.parse_args(argv)
    args.out = results_dir(args.out)
    return args


def write_results(out_dir: Path, name: str, data: dict[str, Any], table: list[list[str]],
                  header: list[str], notes: list[str], goals: Goals, plots: list[str | None] = ()) -> Path:
    """``<name>.md`` (machine, date, path, goals, table, notes, plots) and ``<name>.json`` in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {**data, "goals": goals.rows}
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    m = data["machine"]
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
    host = f"machine: GPU {m.get('gpu')}; CPU {m.get('cpu')}; Python {m['python']}; {m['platform']}"
    lines = [f"# {name}", "", f"date: {m['date']}", host, f"cuproc path: {m['cuproc_path']}",
             f"source: {m.get('commit') or 'unknown commit'}", ""]
    if data.get("smoke"):
        lines += ["SMOKE RUN on the fake driver: the numbers mean nothing; C floors and peers skipped.", ""]
    lines += ["## Goals", "", *goals.lines(), "", "## Results", ""]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in table]
    lines += ["", *notes, ""]
    lines += [f"![{p}]({p})" for p in plots if p]
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
