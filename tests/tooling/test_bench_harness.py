"""The benchmark harness (benchmarks/): every benchmark's smoke run end to end on the fake driver, and the
rules its goals read (paired ratios within rounds, leads against ranges, warm-up and pinning, orders)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fakedriver import fake_image
from subproc import run_python
from threads import in_thread

import cuproc
from cuproc import Context, DeviceBuffer, Module, Stream, fastpath
from cuproc.errors import ClosedResourceError, CudaError, InvalidValueError

pytestmark = pytest.mark.tooling   # the benchmark harness, not the library: CI runs it (-m tooling)

ROOT = Path(__file__).resolve().parent.parent.parent
IMAGE = fake_image({"empty": [8, 4, 4], "wide": [8, 8, 4]})
SIG = ["float*", "int", "float"]


@pytest.mark.parametrize("bench", sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py")))
def test_benchmarks_run_end_to_end_in_smoke_mode(bench, tmp_path, monkeypatch):
    run_python(ROOT / "benchmarks" / bench, "--smoke", "--out", str(tmp_path), timeout=240)
    text = (tmp_path / bench.replace(".py", ".md")).read_text()
    goals = text.split("## Goals", 1)[1].split("## Results", 1)[0]
    lines = [line for line in goals.splitlines() if line.startswith("- [")]
    assert lines and all(line.startswith(("- [met]", "- [MISSED]", "- [not evaluated")) for line in lines)
    assert "cuproc path:" in text and "SMOKE RUN" in text
    if bench == "bench_driver.py":   # the module-namespace row and the cost of its first function are there
        import json
        monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
        import bench_driver as b
        data = json.loads((tmp_path / "bench_driver.json").read_text())
        assert {b.BARE, b.OWN_LOCAL, b.MODULE_ATTR} <= set(data["trivial_call_us"])
        assert b.MODULE_FIRST in data["resolve_all_ms"] and b.PLAIN_MODULE in data["trivial_call_us"]
    if bench == "bench_launch.py":   # the one-shot rows went through the C front where there is one
        made = re.search(r"one-shot launches made by the C front \([^)]*\): ([\d,]+)", text)
        assert (made is not None and int(made.group(1).replace(",", "")) > 0) if fastpath.active() else \
            "no C front (pure path)" in text
        import json
        monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
        import bench_launch as b
        rows = json.loads((tmp_path / "bench_launch.json").read_text())["launchers"]
        assert {b.GRID_NP, b.GRID_SIG, b.ONE_SHOT_NP, b.ONE_SHOT_SIG} <= set(rows)   # the changing grid's rows ran
        assert all(rows[r]["burst_us"] > 0 for r in (b.GRID_NP, b.GRID_SIG))
        import bench_graphs as g                          # the graph section joined the launch results
        graphs = json.loads((tmp_path / "bench_launch.json").read_text())["graphs"]
        assert {g.CUPROC, g.REPLAY} <= set(graphs["replay"]) and g.CAPTURE in graphs["capture"]
        assert "## CUDA graphs" in text and sum("graph replay" in line for line in lines) == 4
    if bench == "bench_peer.py":     # the fake's two devices: peer copies, without and with peer access
        import json
        monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
        import bench_peer as p
        data = json.loads((tmp_path / "bench_peer.json").read_text())
        assert data["peer_access"][p.PEER_ON] == p.ENABLED and set(data["GBps"]) == {p.PEER_OFF, p.PEER_ON}
        assert all(calls == p.CUPROC_CALLS[True][p.OURS_ASYNC if "stream-ordered" in where else p.OURS_SYNC]
                   for where, calls in data["copy_calls"].items()) and len(data["copy_calls"]) == 8
        assert len(lines) == 4 and all("(smoke run)" in line for line in lines)


def test_bench_driver_times_a_real_cffi_pointer_as_bare_cffi(fk, monkeypatch):
    """The goal "cu.cuX costs what a bare cffi call costs" is read against a cffi function pointer to the
    resolved address, not against cuproc's own published object (a C trampoline on the fast path)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_driver as b
    drv = cuproc.default_driver()
    published, bare = b.published_and_bare(drv, "cuCtxGetCurrent")
    address = int(cuproc.ffi.cast("uintptr_t", bare))
    assert int(cuproc.ffi.cast("uintptr_t", fastpath.pointer(published))) == address
    assert isinstance(bare, cuproc.ffi.CData) and cuproc.ffi.typeof(bare).kind == "function"
    assert address == int(cuproc.ffi.cast("uintptr_t", drv.resolution("cuCtxGetCurrent").function)) != 0
    assert (bare is not published) == fastpath.active()


def test_a_launcher_failing_in_the_benchmark_is_reported_and_the_run_goes_on(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch

    def broken(count):
        raise TypeError("allocate() takes 2 positional arguments")   # a peer's API changed
    counted = []
    errors: dict[str, str] = {}
    out = bench_launch.measure_interleaved({"peer": broken, "ours": counted.append}, set(), lambda: None,
                                           4, 3, 8, errors)
    assert set(out) == {"ours"} and "allocate()" in errors["peer"]
    assert counted.count(8) == 2 * bench_launch.STEADY_ROUNDS and counted.count(4) == 4   # warm-up + 3 bursts
    low, high = out["ours"]["steady_range_us"]
    assert low <= out["ours"]["steady_us"] <= high


def test_benchmark_ratios_use_the_c_loop_over_the_rows_own_entry_point(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch as b
    ex = ("cuLaunchKernelEx", "buffer")
    assert b.floor_of(b.DEFAULT, *ex) == "C loop over cuLaunchKernelEx (packed buffer)"
    assert b.floor_of("cuproc prepared (cuLaunchKernel, params)", *ex) == "C loop over cuLaunchKernel"
    assert b.floor_of(b.ONE_SHOT_SIG, *ex) == "C loop over cuLaunchKernelEx (packed buffer)"
    assert b.floor_of(b.BINDINGS_EX, *ex) == "C loop over cuLaunchKernelEx"
    assert {b.floor_of(e, *ex) for e in (b.DEFAULT, b.BINDINGS, b.BINDINGS_EX)} <= set(b.C_LOOPS)
    measured = (("C loop over cuLaunchKernelEx (packed buffer)", 3.36), ("C loop over cuLaunchKernel", 3.42),
                (b.DEFAULT, 4.24))
    loops = {name: {"burst_us": us, "steady_us": 2 * us, "steady_range_us": [2 * us, 2 * us],
                    "burst_rounds_us": [us] * 5, "steady_rounds_us": [2 * us] * 3} for name, us in measured}
    goals, _ = b.evaluate(loops, {}, False, ex)
    row = next(r for r in goals.rows if r["goal"].startswith("burst: prepared launch <= 1.25x"))
    assert row["value"] == pytest.approx(4.24 / 3.36)             # the Ex loop, not the cheaper-looking one
    assert any(r["goal"].startswith("steady: prepared launch <= 1.25x") and r["value"] == pytest.approx(4.24 / 3.36)
               for r in goals.rows)


def test_the_changing_grid_goals_read_each_form_against_its_fixed_grid_twin_and_the_fastest_peer_row(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch as b
    from cuproc.launch import _PREPARED_PER_FUNCTION
    assert len(set(b.grid_values(20_000))) == b.GRID_VALUES > _PREPARED_PER_FUNCTION   # more than the old bound
    results = _rows(**{b.ONE_SHOT_NP: [2.0] * 5, b.GRID_NP: [2.1] * 5, b.ONE_SHOT_SIG: [1.5] * 5,
                       b.GRID_SIG: [1.8] * 5, b.GRID_CORE: [9.0] * 5, b.GRID_CORE_PREBUILT: [4.2] * 5})
    missing = "ModuleNotFoundError: No module named 'cupy'"
    goals, _ = b.evaluate(results, {b.CUPY: missing}, False, ("cuLaunchKernelEx", "buffer"))
    for col in ("burst", "steady"):
        for row, value, status in ((f"{col}: {b.GRID_NP} <= 1.10x the same with a fixed grid", 1.05, "met"),
                                   (f"{col}: {b.GRID_SIG} <= 1.10x the same with a fixed grid", 1.2, "MISSED"),
                                   (f"{col}: one-shot with NumPy scalars, grid changing every launch, faster than "
                                    f"{b.GRID_CORE_PREBUILT}", 2.0, "met")):   # cuda.core's faster row
            assert (_goal(goals, row)["value"], _goal(goals, row)["status"]) == (pytest.approx(value), status)
        cupy = _goal(goals, f"{col}: one-shot with NumPy scalars, grid changing every launch, faster than {b.GRID_CUPY}")
        assert cupy["status"] == f"not evaluated ({missing})"


def _rows(**rounds: list[float]) -> dict:
    """bench_launch results from each row's rounds (the same values for bursts and steady rounds)."""
    import statistics
    return {name: {"burst_us": statistics.median(v), "steady_us": statistics.median(v),
                   "steady_range_us": [min(v), max(v)], "burst_rounds_us": v, "steady_rounds_us": v}
            for name, v in rounds.items()}


def _goal(goals, start: str) -> dict:
    return next(r for r in goals.rows if r["goal"].startswith(start))


def test_benchmark_ratios_are_taken_within_each_round(monkeypatch):
    """A slow spell that hits both rows of a round cancels: the ratio is the median of the per-round
    ratios (1.1 here), not the quotient of the medians (5.5 / 4 = 1.375)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch as b
    ex = ("cuLaunchKernelEx", "buffer")
    c = [3.0, 4.0, 5.0]
    goals, _ = b.evaluate(_rows(**{"C loop over cuLaunchKernelEx (packed buffer)": c,
                                   b.DEFAULT: [3.3, 6.0, 5.5]}), {}, False, ex)
    for col in ("burst", "steady"):
        assert _goal(goals, f"{col}: prepared launch <= 1.20x")["value"] == pytest.approx(1.1)
        assert _goal(goals, f"{col}: prepared launch <= 1.20x")["status"] == "met"


@pytest.mark.parametrize(("theirs", "every", "less_range"), [
    ([4.4, 7.6, 4.2, 4.4, 4.4], (True, 0.05), (False, 0.1 - 0.85)),   # one slow round of theirs: ahead in every round
    ([4.4, 4.4, 3.9, 4.4, 4.4], (False, -0.025), (False, 0.1 - 0.125)),  # behind in one round: both readings missed
    ([4.4, 4.5, 4.3, 4.4, 4.4], (True, 0.075), (True, 0.1 - 0.05)),  # steady lead, narrow range: both met
])
def test_the_lead_over_cuda_bindings_is_read_against_the_range_and_in_every_round(theirs, every, less_range, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch as b
    ex = ("cuLaunchKernelEx", "buffer")
    results = _rows(**{"C loop over cuLaunchKernelEx (packed buffer)": [3.9] * 5, b.DEFAULT: [4.0] * 5,
                       b.BINDINGS_EX: theirs})
    goals, spread = b.evaluate(results, {}, False, ex)
    for col in ("burst", "steady"):
        for start, (met, value) in ((f"{col}: prepared launch (default) ahead of cuda.bindings' fastest row in every",
                                     every),
                                    (f"{col}: prepared launch (default) ahead of cuda.bindings' fastest row by more",
                                     less_range)):
            row = _goal(goals, start)
            assert row["value"] == pytest.approx(value) and row["status"] == ("met" if met else "MISSED"), start
    assert spread["steady_spread"] == pytest.approx(max(theirs) / 4 - min(theirs) / 4)   # the range is reported


def test_the_steady_blocks_are_reported_beside_the_goal_which_reads_single_rounds(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch as b
    ex = ("cuLaunchKernelEx", "buffer")
    theirs = [4.4] * 15
    theirs[7] = 7.6                                   # one slow round of theirs, in the third block of three
    results = _rows(**{"C loop over cuLaunchKernelEx (packed buffer)": [3.9] * 15, b.DEFAULT: [4.0] * 15,
                       b.BINDINGS_EX: theirs})
    goals, spread = b.evaluate(results, {}, False, ex)
    assert spread["steady_block_leads"] == pytest.approx([0.1] * 5)   # each block's paired median
    assert spread["steady_block_spread"] == pytest.approx(0.0)
    row = _goal(goals, "steady: prepared launch (default) ahead of cuda.bindings' fastest row by more")
    assert row["value"] == pytest.approx(0.1 - 0.8) and row["status"] == "MISSED"   # the goal: single rounds


def test_the_steady_lead_rule_is_also_read_for_the_c_loop_for_information(monkeypatch):
    """The same steady reading for the default launch's own C loop against the same cuda.bindings row: what
    the rule gives a launcher with no Python in it (reported, not a goal)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch as b
    ex = ("cuLaunchKernelEx", "buffer")
    floor = [4.0, 4.0, 4.4, 4.0, 4.0]
    results = _rows(**{"C loop over cuLaunchKernelEx (packed buffer)": floor, b.DEFAULT: [4.1] * 5,
                       b.BINDINGS_EX: [4.4] * 5})
    goals, spread = b.evaluate(results, {}, False, ex)
    reading = spread["floor_steady"]
    assert reading["row"] == "C loop over cuLaunchKernelEx (packed buffer)"
    assert reading["lead"] == pytest.approx(0.1) and reading["smallest"] == pytest.approx(0.0)
    assert reading["spread"] == pytest.approx(0.1)
    assert not any(r["goal"].startswith("the same steady reading") for r in goals.rows)


def test_memory_goals_are_paired_within_rounds_and_a_failed_c_floor_refuses(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_memory as m
    c, ours = [70.0, 90.0, 72.0], [75.0, 96.0, 77.0]             # one slow round hit both loops
    alloc = {"sync_us": {m.C_SYNC: c, m.OURS_SYNC: ours}, "stream_ordered_us": {}}
    copies = {"64 MiB": {"pinned H2D, C floor": [1.00, 1.30, 1.00], "pinned H2D, cuproc memory.copy": [1.01, 1.31, 1.50]}}
    goals = m.evaluate(alloc, copies, False, {})
    sync = _goal(goals, "DeviceBuffer alloc+free")
    assert sync["value"] == pytest.approx(ours[2] / c[2]) and sync["status"] == "met"   # median of 1.071, 1.067, 1.069
    h2d = _goal(goals, "memory.copy pinned H2D 64 MiB")
    assert h2d["value"] == pytest.approx(1 / 1.01) and h2d["status"] == "met"          # bandwidth: floor's time / ours
    assert _goal(goals, "memory.copy pinned D2H 64 MiB")["status"].startswith("not evaluated")
    with pytest.raises(RuntimeError):
        m.c_floor_loop(lambda k, size: -2.0, 256)(10)
    assert m.c_floor_loop(lambda k, size: 1e-6 * k, 256)(10) == pytest.approx(1e-5)
    calls: list[str] = []

    def peer(n):
        calls.append("peer")
        if calls.count("peer") > 2:                            # its warm-up and round 1 pass
            raise TypeError("the peer's API changed")
    errors: dict[str, str] = {}
    timed = m.take_turns({"cuproc a": (lambda n: calls.append("a"), 4), "b": (peer, 2)}, 3, errors)
    assert list(timed) == ["cuproc a"] and len(timed["cuproc a"]) == 3 and min(timed["cuproc a"]) >= 0
    assert set(errors) == {"b"} and calls.count("peer") == 3          # dropped when it failed, rounds and all

    def broken(n):
        calls.append("broken")
        raise TypeError("the peer's API changed")
    errors = {}
    timed = m.take_turns({"cuproc a": (lambda n: None, 4), "c": (broken, 2)}, 2, errors)
    assert list(timed) == ["cuproc a"] and set(errors) == {"c"} and calls.count("broken") == 1   # never timed
    with pytest.raises(ValueError):
        m.paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(TypeError):                              # cuproc's own loop failing ends the run
        m.take_turns({"cuproc a": (peer, 1)}, 2, {})
    reason = "failed in round 2: TypeError: the peer's API changed"
    goals = m.evaluate({"sync_us": {}, "stream_ordered_us": {m.OURS_ASYNC: [1.0]}}, {}, False, {m.BIND_ASYNC: reason})
    assert reason in _goal(goals, "stream-ordered alloc+free")["status"]     # the reason it dropped out, as filed


def test_the_allocation_goal_is_read_with_one_small_allocation_alive_and_the_bare_state_for_information(
        fk, pc, monkeypatch):
    """With nothing else allocated the driver hands a small allocation's chunk back at every free (60-90 µs a
    pair on an H200, against 2-3 µs), which hides any Python cost: the goal's group runs with one allocation of
    the same size alive, the other group with none; each frees what it made."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_memory as m
    seen: list[tuple[tuple[str, ...], int]] = []
    real = m.take_turns

    def watching(loops, rounds, errors):
        seen.append((tuple(loops), fk.device_bytes_live(0)))      # before the group's loops run
        return real(loops, rounds, errors)
    monkeypatch.setattr(m, "take_turns", watching)
    before = fk.device_bytes_live(0)
    best, every = m.allocations(None, True, (5, 5, 3), 2, {})
    sync_rows = (m.OURS_SYNC, m.OURS_DROPPED, "cuproc raw C names (drv.cuMemAlloc)")
    assert [rows for rows, _ in seen] == [sync_rows, sync_rows,
                                          (m.OURS_ASYNC, "cuproc raw C names (drv.cuMemAllocAsync)")]
    assert [live for _, live in seen[:2]] == [before, before + m.SMALL]
    assert list(every) == ["sync_alone_us", "sync_us", "stream_ordered_us"]
    assert all(len(v) == 2 for group in every.values() for v in group.values())
    assert fk.device_bytes_live(0) == before                  # the resident allocation went too


@contextlib.contextmanager
def _pinning_logged(log: list):
    """Stands in for harness.one_cpu: marks where the timed, pinned block begins and ends in ``log``."""
    log.append("pin")
    yield
    log.append("unpin")


def test_launch_rounds_warm_up_before_pinning_and_take_a_new_order_each_round(monkeypatch):
    """Every launcher warms up before the thread is pinned (a thread a driver or peer starts inside
    the pinned block would inherit the one CPU), and each round runs the rows in harness.round_order's
    order for it, bursts and steady rounds alike; a steady round runs every row twice, the second pass
    in another order that never starts with the row that ended the first."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch
    log: list = []
    monkeypatch.setattr(bench_launch, "one_cpu", lambda: _pinning_logged(log))
    names = ["a", "b", "c"]
    loops = {n: (lambda count, n=n: log.append((n, count))) for n in names}
    bench_launch.measure_interleaved(loops, set(), lambda: None, 4, 3, 8)
    pin = log.index("pin")
    assert log[:pin] == [(n, 4) for n in names] and log[-1] == "unpin"
    timed = log[pin + 1:-1]
    bursts = [n for n, count in timed if count == 4]
    steady = [n for n, count in timed if count == 8]
    assert len(timed) == len(bursts) + len(steady)
    assert bursts == [n for r in range(3) for n in bench_launch.round_order(names, r)]
    assert len(steady) == 2 * 3 * bench_launch.STEADY_ROUNDS
    for r in range(bench_launch.STEADY_ROUNDS):
        first, second = steady[6 * r:6 * r + 3], steady[6 * r + 3:6 * r + 6]
        assert first == bench_launch.round_order(names, r)
        assert sorted(second) == names and second[0] != first[-1]


def test_adjacent_rounds_run_the_picked_rows_alone_in_mirrored_order_and_average_the_two_runs(monkeypatch):
    """After the steady rounds of every row, the rows the picker names (given each row's median burst) run
    alone for ADJACENT_ROUNDS rounds, each in round_order's order and then its reverse; a row's round time
    is the mean of its two runs, so a drift linear in time costs every row of the round the same."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch
    log: list = []
    clock = [0.0]
    monkeypatch.setattr(bench_launch.time, "perf_counter", lambda: clock[0])
    names = ["a", "b", "c", "d"]

    def run(count, n):
        log.append((n, count))
        clock[0] += count * 1e-6 * (2.0 if n == "b" else 1.0) + len(log) * 1e-3   # a clock that drifts
    loops = {n: (lambda count, n=n: run(count, n)) for n in names}
    given: list = []

    def pick(medians):
        given.append(sorted(medians))
        return ["a", "b", "c"]
    out = bench_launch.measure_interleaved(loops, set(), lambda: None, 4, 3, 8, adjacent=pick)
    assert given == [names]
    tail = [n for n, count in log[-6 * bench_launch.ADJACENT_ROUNDS:]]
    for r in range(bench_launch.ADJACENT_ROUNDS):
        order = bench_launch.round_order(["a", "b", "c"], r)
        assert tail[6 * r:6 * r + 6] == order + order[::-1]
    assert "adjacent_rounds_us" not in out["d"]
    for r in range(bench_launch.ADJACENT_ROUNDS):
        a, b, c = (out[n]["adjacent_rounds_us"][r] for n in "abc")
        assert a == pytest.approx(c) and b > a      # the drift cancels between a and c; b is slower per launch


def test_no_adjacent_rounds_without_rows_to_compare(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch as b
    assert b.adjacent_rows({b.DEFAULT: 4.0, "C loop over cuLaunchKernelEx (packed buffer)": 3.9},
                           ("cuLaunchKernelEx", "buffer")) == []
    picked = b.adjacent_rows({b.DEFAULT: 4.0, b.BINDINGS: 5.0, b.BINDINGS_EX: 4.8,
                              "C loop over cuLaunchKernelEx (packed buffer)": 3.9}, ("cuLaunchKernelEx", "buffer"))
    assert picked == [b.DEFAULT, b.BINDINGS_EX, "C loop over cuLaunchKernelEx (packed buffer)"]


@pytest.mark.parametrize("theirs", [[4.4, 4.5, 4.3, 4.4, 4.4], [4.4, 6.0, 4.3, 4.4, 4.4]])
def test_the_adjacent_rounds_read_the_lead_by_the_same_rule_for_information(theirs, monkeypatch):
    """The adjacent rounds' lead and range are reported (with the C loop's reading), never as a goal: the
    all-row rounds' goal stands as it reads."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch as b
    ex = ("cuLaunchKernelEx", "buffer")
    floor = "C loop over cuLaunchKernelEx (packed buffer)"
    results = _rows(**{floor: [3.9] * 5, b.DEFAULT: [4.0] * 5, b.BINDINGS_EX: [4.4, 7.6, 4.2, 4.4, 4.4]})
    for name, rounds in ((floor, [3.9] * 5), (b.DEFAULT, [4.0] * 5), (b.BINDINGS_EX, theirs)):
        results[name]["adjacent_rounds_us"] = rounds
    goals, spread = b.evaluate(results, {}, False, ex)
    near = spread["adjacent"]
    assert near["leads"] == pytest.approx([t / 4.0 - 1 for t in theirs])
    assert near["lead"] == pytest.approx(statistics.median(t / 4.0 - 1 for t in theirs))
    assert near["spread"] == pytest.approx((max(theirs) - min(theirs)) / 4.0)
    assert near["floor"]["lead"] == pytest.approx(statistics.median(t / 3.9 - 1 for t in theirs))
    assert not any("adjacent" in r["goal"] for r in goals.rows)
    assert _goal(goals, "steady: prepared launch (default) ahead of cuda.bindings' fastest row by more")[
        "status"] == "MISSED"                                                # the all-row rounds' reading stands
    del results[b.DEFAULT]["adjacent_rounds_us"]                            # an older results file
    assert "adjacent" not in b.evaluate(results, {}, False, ex)[1]


def test_a_smoke_run_with_a_bindings_row_reports_the_adjacent_rounds_as_information(tmp_path, monkeypatch):
    """End to end on the fake driver, with a stand-in for cuda.bindings' row (the smoke run has no peers):
    the adjacent rounds run, their reading and the C loop's are notes, and no goal reads them."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch as b
    made = b.launchers

    def with_bindings(*args):
        loops, natives, sync, errors, default, close = made(*args)
        loops[b.BINDINGS_EX] = loops["bare cffi (cuLaunchKernelEx, packed buffer)"]
        loops["C loop over cuLaunchKernelEx (packed buffer)"] = loops["bare cffi (cuLaunchKernelEx, packed buffer)"]
        return loops, natives, sync, errors, default, close
    monkeypatch.setattr(b, "launchers", with_bindings)
    try:
        assert b.main(["--smoke", "--out", str(tmp_path)]) == 0
    finally:
        cuproc.set_default_driver(None)
    data = json.loads((tmp_path / "bench_launch.json").read_text())
    for row in (b.DEFAULT, b.BINDINGS_EX, "C loop over cuLaunchKernelEx (packed buffer)"):
        assert len(data["launchers"][row]["adjacent_rounds_us"]) == b.ADJACENT_ROUNDS
    text = (tmp_path / "bench_launch.md").read_text()
    assert "adjacent steady rounds, for information, not a goal" in text
    assert "the adjacent rounds' reading for the C loop over cuLaunchKernelEx (packed buffer)" in text
    assert not any("adjacent" in g["goal"] for g in data["goals"])


def test_a_steady_round_keeps_each_rows_faster_run(monkeypatch):
    """A slow spell that hits one of a row's two runs in a round is not what the round records; a row
    slow in both runs is recorded slow (the faster of its runs, not another row's)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch
    passes = {"once": 0, "twice": 0}

    def slow_first_run(count):
        if count == 8:
            passes["once"] += 1
            if passes["once"] % 2:                 # the first of the round's two runs
                time.sleep(0.02)

    def always_slow(count):
        if count == 8:
            passes["twice"] += 1
            time.sleep(0.02)
    out = bench_launch.measure_interleaved({"once": slow_first_run, "twice": always_slow, "quick": lambda count: None},
                                           set(), lambda: None, 4, 3, 8)
    assert passes == {"once": 2 * bench_launch.STEADY_ROUNDS, "twice": 2 * bench_launch.STEADY_ROUNDS}
    slept = 0.02 / 8 * 1e6                         # µs per launch of a run that slept
    assert max(out["once"]["steady_rounds_us"]) < slept / 4
    assert min(out["twice"]["steady_rounds_us"]) >= slept


def test_frozen_heap_freezes_what_was_alive_records_collections_by_tag_and_unfreezes(monkeypatch):
    """Inside the block the objects alive before it are out of the collector's scans (and the collector
    is still on); each collection is recorded under the tag set when it ran; afterwards nothing is
    frozen (3.12's own startup freeze included) and the callback is gone, also when the block raises."""
    import gc
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import harness
    already = gc.get_freeze_count()                # 3.12 starts with some objects frozen
    assert gc.isenabled()
    callbacks = list(gc.callbacks)
    before = [[] for _ in range(10)]                # tracked containers, alive before the block
    with harness.frozen_heap() as heap:
        assert heap.frozen > len(before) and gc.get_freeze_count() > already + len(before) and gc.isenabled()
        heap.tag = "row a"
        gc.collect(0)
        heap.tag = "row b"
        gc.collect(2)
        gc.collect(1)
    assert gc.get_freeze_count() == 0 and gc.callbacks == callbacks
    assert [g for g, _ in heap.seen["row a"]] == [0] and [g for g, _ in heap.seen["row b"]] == [2, 1]
    assert all(ms >= 0 for events in heap.seen.values() for _, ms in events)
    line = heap.summary(["row a", "row b", "row c"])
    assert "row a: 1/0/0" in line and "row b: 0/1/1" in line and "row c" not in line
    with pytest.raises(ZeroDivisionError), harness.frozen_heap():
        1 / 0
    assert gc.get_freeze_count() == 0 and gc.callbacks == callbacks


def test_steady_rounds_note_the_collections_each_row_met(monkeypatch):
    """The collections in the steady rounds are attributed to the row being timed (a row that
    collects in every round is named with its count), the bursts' are not counted."""
    import gc
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_launch
    loops = {"quiet": lambda count: None, "noisy": lambda count: gc.collect(2) if count == 8 else gc.collect(0)}
    notes: list[str] = []
    bench_launch.measure_interleaved(loops, set(), lambda: None, 4, 3, 8, {}, notes)
    assert len(notes) == 1 and f"noisy: 0/0/{2 * bench_launch.STEADY_ROUNDS} (" in notes[0], notes
    assert "quiet:" not in notes[0]


@pytest.mark.skipif(sys.platform != "linux", reason="the exit clock's library is built for Linux")
def test_the_exit_clock_puts_python_teardown_and_the_c_exit_each_in_its_part(monkeypatch, tmp_path):
    """Sleeps placed in each part of a child's exit land in that part: in Python's teardown (an atexit
    handler registered before the clock's, so run after it); in the C exit, a C atexit handler that a
    library registers while the child runs (as libcuda does at cuInit: before the clock registers
    its own, so run after it) and a library finalizer (run after every atexit handler).  A child
    that skips its exit (os._exit) leaves no stamps, and that is an error, not a zero."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import subprocess

    import bench_startup
    import harness
    lib = harness.build_c("exit_stamp.c", tmp_path, shared=True)
    if lib is None:
        pytest.skip("no C compiler")
    sleepers = {}
    for name, body in (("fini", "__attribute__((destructor)) static void f(void) { usleep(200000); }"),
                       ("atexit", "static void s(void) { usleep(200000); }\n"
                                  "__attribute__((constructor)) static void r(void) { atexit(s); }")):
        src = tmp_path / f"{name}.c"
        src.write_text(f"#include <stdlib.h>\n#include <unistd.h>\n{body}\n")
        sleepers[name] = tmp_path / f"lib{name}.so"
        subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(sleepers[name]), str(src)],
                       check=True)
    stamps, env = tmp_path / "stamps", dict(os.environ)

    def parts(code: str) -> tuple[float, float]:
        return bench_startup.exit_parts(code, lib, env, stamps)

    quiet = parts("pass")
    assert all(x >= 0 for x in quiet) and max(quiet) < 150
    python_part, c_part = parts("import atexit, time; atexit.register(time.sleep, 0.2)")
    assert python_part >= 200 and c_part < 150
    for name in sleepers:
        python_part, c_part = parts(f"import ctypes; ctypes.CDLL({str(sleepers[name])!r})")
        assert python_part < 150 and c_part >= 200, name
    with pytest.raises(RuntimeError, match="exit clock"):
        parts("import os; os._exit(0)")


def test_round_orders_give_no_row_a_fixed_predecessor(monkeypatch):
    """Over the startup benchmark's 21 rounds of its 12 rows, no row follows the same row in more than a
    third of the rounds (rotating the order each round kept every predecessor but the first row's), and
    the orders are the same in every run."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import harness
    names = [f"row {i}" for i in range(12)]
    orders = [harness.round_order(names, r) for r in range(21)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert orders == [harness.round_order(names, r) for r in range(21)] and orders[0] != orders[1]
    for name in names:
        before = [order[order.index(name) - 1] for order in orders if order.index(name) > 0]
        assert max(before.count(other) for other in set(before)) <= 21 // 3, (name, before)


def test_memory_loops_warm_up_before_pinning_then_take_turns_in_a_new_order_each_round(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_memory
    log: list = []
    monkeypatch.setattr(bench_memory, "one_cpu", lambda: _pinning_logged(log))
    loops = {n: (lambda count, n=n: log.append((n, count)), 20) for n in ("x", "y", "z")}
    times = bench_memory.take_turns(loops, 3, {})
    assert log[:4] == [("x", 2), ("y", 2), ("z", 2), "pin"] and log[-1] == "unpin"   # a tenth of n, first
    assert [n for n, _ in log[4:-1]] == [n for r in range(3) for n in bench_memory.round_order(["x", "y", "z"], r)]
    assert {n: len(v) for n, v in times.items()} == {"x": 3, "y": 3, "z": 3}


def test_trivial_call_rows_warm_up_before_pinning_and_take_a_new_order_each_round(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_driver
    log: list = []
    monkeypatch.setattr(bench_driver, "one_cpu", lambda: _pinning_logged(log))
    rows = {n: (f"log.append({n!r})", {"log": log}) for n in ("p", "q", "r")}
    bench_driver._interleaved(rows, 1, 3, [("p", "q")])
    pin = log.index("pin")
    assert log[:pin] == ["p", "q", "r"] and log[-1] == "unpin"
    timed = log[pin + 1:-1]
    assert len(timed) == 9 * 3                   # three rounds of three rows, each timed best of three
    assert timed[::3] == [n for r in range(3) for n in bench_driver.round_order(["p", "q", "r"], r)]
    assert all(timed[i:i + 3] == [timed[i]] * 3 for i in range(0, len(timed), 3))


def test_bench_peer_with_one_device_copies_on_device_0_and_reads_no_goal(fk, tmp_path, monkeypatch):
    """Fewer than two devices: both buffers on device 0 (cuMemcpyDtoD, not cuMemcpyPeer), every row still
    run, the notes say it, and no goal is read -- because of the one GPU, not only because of --smoke."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_peer as p
    fk.set_device_count(1)
    monkeypatch.setattr(p, "smoke_driver", lambda: fk)
    assert p.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_peer.json").read_text())
    assert data["peer_access"] == {p.SAME_DEVICE: p.ONE_GPU_NOTE} and list(data["GBps"]) == [p.SAME_DEVICE]
    assert {w.split(", ")[-1]: c for w, c in data["copy_calls"].items()} == {
        "synchronous": p.CUPROC_CALLS[False][p.OURS_SYNC], "stream-ordered": p.CUPROC_CALLS[False][p.OURS_ASYNC]}
    assert all(set(rows) == {p.OURS_SYNC, p.OURS_ASYNC} for rows in data["GBps"][p.SAME_DEVICE]["1 MiB"].values())
    assert [g["status"] for g in data["goals"]] == [f"not evaluated ({p.ONE_GPU_NOTE})"] * 4
    assert p.ONE_GPU_NOTE in (tmp_path / "bench_peer.md").read_text().split("## Results", 1)[1]


def test_bench_peer_drops_a_failing_row_and_keeps_the_others(monkeypatch):
    """A row that fails in its warm-up or in a round is dropped, its error noted, and the other rows keep
    every round; cuproc's own failure is a missed goal, never an unread one (and ends a smoke run)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_peer as p
    monkeypatch.setattr(p, "one_cpu", contextlib.nullcontext)
    calls = {"n": 0}

    def fails_in_round_two() -> float:
        calls["n"] += 1
        if calls["n"] == 3:          # warm-up, round 1, then round 2
            raise RuntimeError("lost the device")
        return 2.0

    def never_runs() -> float:
        raise ImportError("no cuda.bindings")
    rows = {p.C_SYNC: lambda: 1.0, p.OURS_SYNC: fails_in_round_two, p.BIND_SYNC: never_runs}
    errors: dict[str, str] = {}
    times, _ = p.take_turns(rows, 4, errors, "here", strict=False)
    assert times == {p.C_SYNC: [1.0] * 4}
    assert set(errors) == {f"{p.OURS_SYNC} (here, round 2)", f"{p.BIND_SYNC} (here, warm-up)"}
    rounds = {p.PEER_ON: {"64 MiB": {"0->1": {**times, p.C_ASYNC: [1.0] * 4, p.OURS_ASYNC: [1.25] * 4},
                                     "1->0": {p.OURS_SYNC: [1.0] * 4, p.OURS_ASYNC: [1.0] * 4}}}}
    goals = p.evaluate(rounds, {p.PEER_ON: p.ENABLED}, False, {p.C_SYNC: "no C compiler"}, ["64 MiB"])
    by_goal = {g["goal"].split(" >=")[0]: g for g in goals.rows}
    assert by_goal["memory.copy synchronous peer copy 64 MiB 0->1"]["status"] == "MISSED"
    assert by_goal["memory.copy stream-ordered peer copy 64 MiB 0->1"]["value"] == pytest.approx(0.8)
    assert by_goal["memory.copy stream-ordered peer copy 64 MiB 0->1"]["status"] == "MISSED"
    assert by_goal["memory.copy synchronous peer copy 64 MiB 1->0"]["status"] == \
        "not evaluated (the C floor did not run: no C compiler)"       # no floor row: nothing to read against
    calls["n"] = 2
    with pytest.raises(RuntimeError, match="lost the device"):
        p.take_turns(rows, 4, {}, "here", strict=True)
