"""tools/add_pytest_counts.py: the one summary line of a GPU suite run in two halves (tools/gpu_check.sh)."""
from __future__ import annotations

import pytest

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from add_pytest_counts import add

pytestmark = pytest.mark.tooling   # the GPU check's tooling, not the library: CI runs it (-m tooling)


def test_two_halves_add_up_every_count_and_the_seconds():
    line = add(["483 passed, 8 skipped, 1 warning in 386.31s (0:06:26)", "295 passed, 8 skipped in 89.43s (0:01:29)"])
    assert line == "778 passed, 16 skipped, 1 warning in 475.74s (2 parts)"
    assert add(["1 passed, 1 warning in 1.0s", "1 passed, 1 warning in 1.0s"]) == "2 passed, 2 warnings in 2.00s (2 parts)"


def test_failures_and_errors_are_kept_and_come_first():
    line = add(["2 failed, 10 passed, 1 error in 3.00s", "1 failed, 4 passed, 2 errors in 1.50s"])
    assert line == "3 failed, 14 passed, 3 errors in 4.50s (2 parts)"


def test_every_kind_of_count_is_kept_unknown_ones_after_pytests_own():
    line = add(["1 failed, 3 passed, 2 deselected, 1 xfailed, 1 rerun in 2.0s", "1 xpassed, 4 passed in 1.0s"])
    assert line == "1 failed, 7 passed, 2 deselected, 1 xfailed, 1 xpassed, 1 rerun in 3.00s (2 parts)"


def test_a_half_without_a_result_line_is_named():
    line = add(["483 passed, 8 skipped in 386.31s", "not run"])
    assert line == "483 passed, 8 skipped in 386.31s (2 parts; part 2: no result line)"
    killed = "........................................................................ [ 72%]"   # a timeout's log tail
    assert add([killed, "no tests ran in 0.01s"]) == "no tests ran in 0.01s (2 parts; part 1: no result line)"


def test_only_pytests_own_result_line_counts():
    assert add(["===== 3 passed, 1 skipped in 1.50s =====", "8 skipped in 1.0s"]) == \
        "3 passed, 9 skipped in 2.50s (2 parts)"
    for other in ("fp16 passed in 1s", "cu12 driver: 3 failed to load", "1 passed in 1.5s, 2 failed"):
        assert add([other]).endswith("(1 parts; part 1: no result line)"), other


def test_the_command_line_prints_the_sum_and_refuses_no_arguments():
    script = str(ROOT / "tools" / "add_pytest_counts.py")
    out = subprocess.run([sys.executable, script, "1 passed in 1.0s", "2 passed in 2.0s"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "3 passed in 3.00s (2 parts)"
    refused = subprocess.run([sys.executable, script], check=False, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout == ""


def test_a_logs_last_result_line_is_what_the_sum_takes(tmp_path):
    """--line picks what gpu_check.sh passes on: the log's last pytest result line, by the same pattern."""
    script = str(ROOT / "tools" / "add_pytest_counts.py")
    log = tmp_path / "pytest.log"
    log.write_text("....\n3 passed in 1.00s\nexit noise: 12 failed to load\n")

    def line(path: Path) -> str:
        return subprocess.run([sys.executable, script, "--line", str(path)], capture_output=True, text=True,
                              check=True).stdout.strip()
    assert line(log) == "3 passed in 1.00s"
    log.write_text("........ [ 72%]\n")                                   # a time limit cut it short
    assert line(log) == "no result line"
    assert line(tmp_path / "absent.log") == "not run"
    refused = subprocess.run([sys.executable, script, "--line"], check=False, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout == ""


def test_shards_of_one_run_leave_their_deselected_counts_out():
    shards = ["400 passed, 3 skipped, 406 deselected in 100.00s", "1 failed, 402 passed, 406 deselected in 90.00s"]
    assert add(shards, shards=True) == "1 failed, 802 passed, 3 skipped in 190.00s (2 parts)"
    assert add(shards) == "1 failed, 802 passed, 3 skipped, 812 deselected in 190.00s (2 parts)"   # not shards: kept
    script = str(ROOT / "tools" / "add_pytest_counts.py")
    out = subprocess.run([sys.executable, script, "--shards", *shards], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1 failed, 802 passed, 3 skipped in 190.00s (2 parts)"
    for bad in (["--shards"], ["--shards", "--line", "x.log"]):
        refused = subprocess.run([sys.executable, script, *bad], check=False, capture_output=True, text=True)
        assert refused.returncode == 2 and refused.stdout == "", bad
