"""Random sequences on the fake driver, under reuse of handles and addresses, checked against a model.

``tests/sequences.py`` runs each sequence's operations with a model of what each object should be
(alive, or ended and why): an operation must be refused (ClosedResourceError) exactly when it involves
something ended, and carried out otherwise.  The fake hands handles and addresses out again as a GPU
does, so a table, claim or finalizer that takes a new object for an old one shows up here as a live
object refused or a dead one used.  Half the sequences run from four threads, some fork, and each run
is made once as is and once after a warm-up that releases the primary context's last retain and
retains it again (how issue 35's defect was seen on a GPU).  The pure and the compiled path must agree
on every operation of every single-threaded sequence.

The default run is a short one (240 sequences); the stress run (``pytest -m stress``, which CI runs) makes 5,000.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "sequences.py"


def _start(fake_path: Path, out: Path, *, pure: bool, warm_up: bool, sequences: int, seed: int) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("FAKEDRIVER_REUSE", None)             # the fake's default: reuse
    if pure:
        env["CUPROC_PURE_PYTHON"] = "1"
    else:
        env.pop("CUPROC_PURE_PYTHON", None)
    args = [sys.executable, str(SCRIPT), "--fake", str(fake_path), "--sequences", str(sequences), "--ops", "30",
            "--seed", str(seed), "--outcomes", str(out)]
    if warm_up:
        args.append("--warm-up")
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run_both_paths(fake_path: Path, tmp: Path, sequences: int, seed: int, parallel: int = 2) -> dict[str, int]:
    """Both paths, with and without the warm-up, ``sequences`` each; ``parallel`` children at a time.
    Asserts every run clean and the two paths' outcomes equal; returns the summed counts."""
    runs = [(pure, warm) for warm in (False, True) for pure in (False, True)]
    results: dict[tuple[bool, bool], dict] = {}
    outcomes: dict[tuple[bool, bool], dict[str, str]] = {}
    for first in range(0, len(runs), parallel):
        batch = runs[first:first + parallel]
        procs = {run: _start(fake_path, tmp / f"outcomes-{run[0]}-{run[1]}.json", pure=run[0], warm_up=run[1],
                             sequences=sequences, seed=seed) for run in batch}
        for run, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"{run}: exit {proc.returncode}\n{stderr[-3000:]}"
            results[run] = json.loads(stdout.strip().splitlines()[-1])
            outcomes[run] = json.loads((tmp / f"outcomes-{run[0]}-{run[1]}.json").read_text())
    total: dict[str, int] = {}
    for (pure, warm), result in results.items():
        where = f"{'pure' if pure else 'compiled'} path{', after the warm-up' if warm else ''}"
        assert result["failures"] == [], f"{where}:\n" + "\n".join(result["failures"][:3])
        assert result["leftovers"] == [], f"{where}: {result['leftovers'][:5]}"
        assert result["stale"] == 0, f"{where}: {result['stale_calls']}"
        assert result["unordered"] == 0, f"{where}: frees not ordered after the work on the memory: " \
                                         f"{result['unordered_calls']}"
        for key, n in result["counts"].items():
            total[key] = total.get(key, 0) + n
    for warm in (False, True):
        compiled, pure = outcomes[(False, warm)], outcomes[(True, warm)]
        assert compiled.keys() == pure.keys() and len(compiled) >= sequences // 2 - 1
        differ = [seed for seed in compiled if compiled[seed] != pure[seed]]
        assert not differ, (f"the paths disagree in {len(differ)} sequences; seed {differ[0]}:\n"
                            f"compiled: {compiled[differ[0]]}\npure:     {pure[differ[0]]}")
    return total


def test_random_sequences_follow_the_model_on_both_paths(fk, tmp_path):
    counts = run_both_paths(fk.path, tmp_path, sequences=60, seed=3)
    assert counts["sequences"] == 240 and counts["refused"] > 0 and counts.get("forks", 0) > 0


@pytest.mark.stress
def test_5000_random_sequences_follow_the_model_on_both_paths(fk, tmp_path):
    counts = run_both_paths(fk.path, tmp_path, sequences=1250, seed=7)
    assert counts["sequences"] >= 5000 and counts["threaded"] >= 2000 and counts.get("forks", 0) > 0
    assert counts.get("resets", 0) > 0 and counts["refused"] > 0
    print(json.dumps(counts))
