"""Running Python in a fresh interpreter, for tests of what is per process: fork, interpreter exit,
what an import loads, the environment read at startup, and anything that could crash (a crash
there fails one test, not the whole suite)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path


def run_python(code: str | Path, *argv: str, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
               timeout: float = 60, returncode: int | None = 0,
               flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with arguments ``argv`` in a new process of this interpreter, output captured as text.
    ``flags``: the interpreter's own options, before the code (``("-S",)``: no site module).

    ``code``: the text of a script (dedented, run with ``-c``) or the Path of a script file.
    ``env``: the child's whole environment; None gives it this process's, as ``subprocess`` does.
    Nothing is added to it: a script that needs ``tests/`` or the checkout on ``sys.path`` puts them
    there itself, and ``PYTHONPATH`` is whatever the caller passes.  A child still running after
    ``timeout`` seconds is killed (``subprocess.TimeoutExpired``).

    Asserts that the child exited with ``returncode`` (None: any), its output the message; returns the
    finished process for the checks of its output."""
    source = [str(code)] if isinstance(code, Path) else ["-c", textwrap.dedent(code)]
    proc = subprocess.run([sys.executable, *flags, *source, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)
    if returncode is not None and proc.returncode != returncode:
        raise AssertionError(f"the child exited with {proc.returncode}, not {returncode}\n"
                             f"--- its stdout (end):\n{proc.stdout[-2000:]}\n--- its stderr (end):\n{proc.stderr[-3000:]}")
    return proc
