"""CUPROC_TEST_SHARD (tests/conftest.py): the shards tools/gpu_check.sh runs the suite in, test by test."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import shard_of

pytestmark = pytest.mark.tooling   # the GPU check's tooling, not the library: CI runs it (-m tooling)

ROOT = Path(__file__).resolve().parent.parent.parent
# a small file of this suite with parametrized tests: what the shards of a real run look like
SAMPLE = "tests/tooling/test_add_pytest_counts.py"


def _collected(shard: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CUPROC_TEST_SHARD"}
    if shard is not None:
        env["CUPROC_TEST_SHARD"] = shard
    # (the sample is a `slow` file, which the default selection leaves out: select every test of it)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co", "-m", "slow or not slow",
                           SAMPLE],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _ids(out: str) -> list[str]:
    return [line for line in out.splitlines() if "::" in line]


def test_the_shards_split_the_tests_one_by_one_into_parts_that_add_up_to_the_whole():
    whole = _ids(_collected(None).stdout)
    parts = [_ids(_collected(f"{k}/3").stdout) for k in (1, 2, 3)]
    assert len(whole) >= 6
    assert sorted(sum(parts, [])) == sorted(whole)                    # each test in exactly one shard
    assert [p for part in parts for p in part if part.count(p) > 1] == []
    assert max(map(len, parts)) - min(map(len, parts)) <= 1           # even, test by test
    assert parts[0] == whole[0::3] and parts[1] == whole[1::3]        # in collection order
    line = _collected("2/3").stdout.strip().splitlines()[-1]
    assert re.search(rf"{len(parts[1])}/{len(whole)} tests collected \({len(whole) - len(parts[1])} deselected\)",
                     line), line


@pytest.mark.parametrize("value", ["0/2", "3/2", "1", "a/b", "1/0", "-1/2"])
def test_a_malformed_shard_is_refused_naming_the_variable(value):
    with pytest.raises(pytest.UsageError, match="CUPROC_TEST_SHARD is K/N"):
        shard_of(value)
    out = _collected(value)
    assert out.returncode != 0 and "CUPROC_TEST_SHARD is K/N" in out.stdout + out.stderr


def test_well_formed_shards_are_read():
    assert shard_of("1/2") == (1, 2) and shard_of(" 2 / 2 ") == (2, 2) and shard_of("7/7") == (7, 7)
