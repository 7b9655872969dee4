"""Benchmark harness: timing helpers, machine facts, and the results file.

Policy: every benchmark times cuproc *in the same run* as the C floor and the
peers (ctypes, bare cffi, cuda-bindings, ...), and results are compared as
ratios, since absolute times differ between machines and runs.
"""
from __future__ import annotations

import datetime
import json
import platform
import statistics
import subprocess
import sys
import timeit
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


def per_call_us(stmt: Callable[[], Any] | str, number: int = 200_000, repeat: int = 7,
                globals: dict | None = None) -> float:
    """Best-of-``repeat`` time per call in microseconds (best: least disturbed by the machine)."""
    timer = timeit.Timer(stmt, globals=globals)
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e6


def child_ms(code: str, runs: int = 15, env: dict | None = None) -> float:
    """Median over fresh interpreters of a duration (ms) the child prints itself."""
    values = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        values.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(values)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "date": datetime.date.today().isoformat()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, check=True)
        info["gpu"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError):
        info["gpu"] = None
    return info


def write_results(out_dir: Path, name: str, data: dict[str, Any], table: list[list[str]],
                  header: list[str], notes: list[str]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
    lines = [f"# {name}", "", f"machine: {data['machine']}", ""]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in table]
    lines += ["", *notes, ""]
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(lines))
    return path
