"""The test helpers themselves (tests/threads.py, tests/subproc.py): a helper that swallowed a thread's
exception or a child's exit status would turn every test built on it into one that cannot fail."""
from __future__ import annotations

import sys

import os
import subprocess
import threading
from pathlib import Path

import pytest

from subproc import run_python
from threads import in_thread, run_threads


def test_run_threads_runs_all_at_once_and_returns_results_in_order():
    barrier = threading.Barrier(4, timeout=10)        # breaks (and raises) unless all four run at once

    def step(k: int) -> tuple[int, int]:
        barrier.wait()
        return k, threading.get_ident()

    results = run_threads(step, 4)
    assert [k for k, _ in results] == [0, 1, 2, 3]
    assert len({ident for _, ident in results}) == 4 and threading.get_ident() not in {i for _, i in results}


def test_run_threads_raises_the_first_failure_after_all_ended():
    ended = []

    def step(k: int) -> None:
        if k in (1, 3):
            raise ValueError(f"thread {k}")
        ended.append(k)

    with pytest.raises(ValueError, match="thread 1") as info:
        run_threads(step, 4)
    assert sorted(ended) == [0, 2]                    # the others ran to their end first
    if sys.version_info >= (3, 11):                   # add_note
        assert "2 of 4 threads raised" in "".join(getattr(info.value, "__notes__", []))


def test_in_thread_hands_back_a_value_or_an_error():
    assert in_thread(threading.get_ident) != {"value": threading.get_ident()}   # another thread's
    error = ValueError("x")

    def fail() -> None:
        raise error
    assert in_thread(fail) == {"error": error}


def test_run_python_checks_the_exit_status_and_passes_argv_env_and_cwd(tmp_path):
    proc = run_python("""
        import os, sys
        print(*sys.argv[1:], os.environ["HELPER_VAR"], os.getcwd(), sep="\\n")
        """, "a", "b", env={**os.environ, "HELPER_VAR": "v"}, cwd=tmp_path)
    assert proc.stdout.splitlines() == ["a", "b", "v", str(tmp_path.resolve())]
    assert run_python("import sys; sys.exit(7)", returncode=7).returncode == 7
    assert run_python("import sys; sys.exit(5)", returncode=None).returncode == 5
    with pytest.raises(AssertionError, match=r"exited with 2, not 0(.|\n)*boom"):
        run_python("import sys; sys.stderr.write('boom'); sys.exit(2)")


def test_run_python_runs_a_script_file_and_gives_up_on_a_hang(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(sys.argv[1])\n")
    assert run_python(Path(script), "hello").stdout == "hello\n"
    with pytest.raises(subprocess.TimeoutExpired):
        run_python("import time; time.sleep(30)", timeout=1)
