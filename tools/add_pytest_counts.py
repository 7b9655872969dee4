"""Add up pytest result lines: what ``tools/gpu_check.sh summary`` prints for a suite run in halves.

Prints one line of the same form as pytest's ("483 passed, 8 skipped, 1 warning in 386.31s") with
every count and the seconds added up, and "(N parts)".  Only pytest's own result line counts
("N word, N word ... in S s" or "no tests ran in S s", with or without its "=" rule): a part whose
argument is anything else (the log had none: the part did not run, or a time limit killed it before
pytest printed one) is named, so that a summary never reads as complete when part of the suite is
missing.  Counts of words this script does not know (a plugin's "rerun") are added up and kept too,
after pytest's own.

``--line LOG`` prints a log's last such line ("not run" without the file), which is what
``gpu_check.sh`` passes on: one pattern for both.  ``--shards LINE...``: the lines are the shards of one
run (``CUPROC_TEST_SHARD``, tests/conftest.py), in which every test is deselected in each shard but its
own: their "deselected" counts say nothing of the run and are left out of the sum.

Why a script: the device allows ten minutes a call, and on a slow machine the whole suite took
eight of them; ``gpu_check.sh`` can run it as two stages, and the closing note needs one line.
Standard library only (it runs before anything is installed).
"""
from __future__ import annotations

import re
import sys

USAGE = ("usage: python3 tools/add_pytest_counts.py [--shards] LINE [LINE...]   (each pytest's last result line, "
         "or 'not run'; --shards: the shards of one run, deselected counts left out)\n"
         "       python3 tools/add_pytest_counts.py --line LOG                   (LOG's last result line: what a LINE is)")

# pytest's words, in the order it prints them
_ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings", "errors")
_PLURAL = {"warning": "warnings", "error": "errors"}
# pytest's result line: its counts (or "no tests ran"), " in <seconds>s", perhaps " (h:mm:ss)", nothing after
RESULT_LINE = re.compile(r"^=*\s*(?P<counts>\d+ [a-z]+(?:, \d+ [a-z]+)*|no tests ran) in (?P<seconds>[0-9.]+)s"
                         r"(?: \(\d+:\d\d:\d\d\))?\s*=*$")
_COUNT = re.compile(r"(\d+) ([a-z]+)")


def add(lines: list[str], *, shards: bool = False) -> str:
    """The pytest result ``lines`` added up into one line (see the module's docstring); ``shards``: the
    lines are shards of one run, whose "deselected" counts are left out."""
    totals: dict[str, int] = {}
    seconds = 0.0
    missing = []
    for k, line in enumerate(lines, 1):
        found = RESULT_LINE.match(line.strip())
        if found is None:
            missing.append(f"part {k}: no result line")
            continue
        for number, word in _COUNT.findall(found["counts"]):
            word = _PLURAL.get(word, word)
            if shards and word == "deselected":
                continue
            totals[word] = totals.get(word, 0) + int(number)
        seconds += float(found["seconds"])
    order = [w for w in _ORDER if w in totals] + [w for w in totals if w not in _ORDER]
    words = [f"{totals[w]} {w[:-1] if w in _PLURAL.values() and totals[w] == 1 else w}" for w in order]
    text = ", ".join(words) if words else "no tests ran"
    return f"{text} in {seconds:.2f}s ({len(lines)} parts{'; ' + ', '.join(missing) if missing else ''})"


def last_line(log: str) -> str:
    """The last pytest result line in the file ``log``: "not run" when there is no such file, "no result
    line" when it has none (the same test as :func:`add`'s, so the two agree on what a result is)."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if RESULT_LINE.match(line.strip())]
    except FileNotFoundError:
        return "not run"
    return lines[-1] if lines else "no result line"


def main(argv: list[str]) -> int:
    shards = bool(argv) and argv[0] == "--shards"
    lines = argv[1:] if shards else argv
    if not lines or (lines[0] == "--line" and (shards or len(lines) != 2)):
        print(USAGE, file=sys.stderr)
        return 2
    print(last_line(lines[1]) if lines[0] == "--line" else add(lines, shards=shards))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
