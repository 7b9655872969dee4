"""tools/gpu_check.sh without a GPU: its summary stage and the start of a check, on a state folder made here
(a stub nvidia-smi on PATH; the script's python3 is this interpreter, which has cffi)."""
from __future__ import annotations

import pytest

import os
import re
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.tooling   # the GPU check's tooling, not the library: CI runs it (-m tooling)

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _stubbed(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 580.159.04, 143771 MiB'\n")
    # a wrapper, not a symlink: a symlink to a venv's python starts the base interpreter, without the venv's cffi
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPU_CHECK_STATE": str(tmp_path / "state"),
            "OUT": str(tmp_path / "out")}


def _goals(folder: Path, name: str, met: int, missed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["- [met] a goal: 1x (goal <= 2x)"] * met + ["- [MISSED] a goal: 3x (goal <= 2x)"] * missed
    (folder / f"{name}.md").write_text(f"# {name}\n\n## Goals\n\n" + "\n".join(lines) + "\n")


def test_the_summary_counts_each_benchmark_folders_goals_the_pure_paths_included(tmp_path):
    env = _stubbed(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    (state / "fastpath.txt").write_text("on: compiled trampolines\n")     # no build in a summary-only call
    (state / "pytest.log").write_text("12 passed, 1 skipped in 3.00s\n")
    (state / "pytest.rc").write_text("0\n")
    _goals(state, "bench_launch", 3, 1)
    _goals(state, "bench_memory", 2, 0)
    out = subprocess.run(["bash", str(SCRIPT), "summary"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    line = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0 and line.startswith("SUMMARY: 12 passed, 1 skipped"), out.stdout + out.stderr
    assert "benchmark goals: 5 met, 1 missed, 0 not evaluated in 2 files, pure path not run" in line
    _goals(state / "pure", "bench_launch", 0, 4)
    (state / "pure" / "bench_launch.md").write_text((state / "pure" / "bench_launch.md").read_text()
                                                    + "- [not evaluated (pure path)] a fast-path goal: 2x\n")
    (state / "pure" / "bench_launch.log").write_text("ran\n")
    (state / "pure" / "bench_memory.log").write_text("Traceback ...\n")    # crashed: a log, no results
    out = subprocess.run(["bash", str(SCRIPT), "summary"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    line = out.stdout.strip().splitlines()[-1]
    assert "pure path 0 met, 4 missed, 1 not evaluated in 1 files; FAILED: bench_memory" in line, line
    for md in state.glob("bench_*.md"):                                     # a bench stage where all crashed
        md.with_suffix(".log").write_text("Traceback ...\n")
        md.unlink()
    out = subprocess.run(["bash", str(SCRIPT), "summary"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    line = out.stdout.strip().splitlines()[-1]
    assert "benchmark goals: 0 met, 0 missed, 0 not evaluated in 0 files; FAILED: bench_launch bench_memory" in line
    assert "SKIPPED" not in line
    # GPU files that skipped themselves for want of a driver: named as a failure of the check, not a pass
    (state / "pytest_pure.log").write_text("SKIPPED [1] tests/test_gpu_launch.py:21: no CUDA driver on this machine\n"
                                           "1 skipped in 0.10s\n")
    out = subprocess.run(["bash", str(SCRIPT), "summary"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    line = out.stdout.strip().splitlines()[-1]
    assert line.endswith("; GPU TESTS SKIPPED, no driver opened: pytest_pure.log"), line


def test_a_new_check_clears_what_every_stage_left_the_pure_benchmarks_folder_included(tmp_path):
    """begin_check (run by the test stages) as the script defines it, on a state an earlier check left: a
    pure/ left behind went into every later archive, and collect_results then refused the new run."""
    state = tmp_path / "state"
    _goals(state / "pure", "bench_launch", 1, 0)
    _goals(state, "bench_memory", 1, 0)
    (state / "summary.txt").write_text("SUMMARY: old\n")
    (state / "gpu.txt").write_text("kept\n")
    text = SCRIPT.read_text()
    begin = re.search(r"^begin_check\(\) \{.*?\}$", text, re.S | re.M)
    assert begin is not None
    subprocess.run(["bash", "-c", f'STATE="$1"\n{begin.group(0)}\nbegin_check', "_", str(state)], check=True,
                   timeout=30)
    assert sorted(p.name for p in state.iterdir()) == ["gpu.txt"]
