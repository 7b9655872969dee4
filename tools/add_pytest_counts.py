"""Add up pytest result lines: what ``tools/gpu_check.sh summary`` prints for a suite run in halves.

Usage: ``python3 tools/add_pytest_counts.py LINE [LINE...]``, each LINE pytest's last result line
("483 passed, 8 skipped, 1 warning in 386.31s (0:06:26)") or "not run".  Prints one line of the same
form with every count and the seconds added up, and "(N parts)"; a part that did not run is named,
so that a summary never reads as complete when half the suite is missing.

Why a script: the device allows ten minutes a call, and on a slow machine the whole suite took
eight of them; ``gpu_check.sh`` can run it as two stages, and the closing note needs one line.
Standard library only (it runs before anything is installed).
"""
from __future__ import annotations

import re
import sys

# pytest's words, in the order it prints them
_ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings", "errors")
_SINGULAR = {"warning": "warnings", "error": "errors"}
_COUNT = re.compile(r"(\d+) (failed|passed|skipped|deselected|xfailed|xpassed|warnings?|errors?)\b")
_SECONDS = re.compile(r" in ([0-9.]+)s\b")


def add(lines: list[str]) -> str:
    """The pytest result ``lines`` added up into one line (see the module's docstring)."""
    totals: dict[str, int] = {}
    seconds = 0.0
    missing = []
    for k, line in enumerate(lines, 1):
        counts = _COUNT.findall(line)
        if not counts:
            missing.append(f"part {k} not run")
            continue
        for number, word in counts:
            word = _SINGULAR.get(word, word)
            totals[word] = totals.get(word, 0) + int(number)
        took = _SECONDS.search(line)
        if took:
            seconds += float(took.group(1))
    words = [f"{totals[w]} {w[:-1] if w in ('warnings', 'errors') and totals[w] == 1 else w}"
             for w in _ORDER if w in totals]
    text = ", ".join(words) if words else "nothing ran"
    return f"{text} in {seconds:.2f}s ({len(lines)} parts{'; ' + ', '.join(missing) if missing else ''})"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    print(add(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
