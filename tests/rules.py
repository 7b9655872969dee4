"""The resolution rules as measured on a real driver, restated for the tests apart from cuproc's code."""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEWEST = 13050
#: Declared only under _WIN32 (headers/provenance.json): no entry on other platforms.
WINDOWS_ONLY = frozenset(json.loads((ROOT / "headers" / "provenance.json").read_text())["windows_only"])


def typedefs_by_symbol() -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for t in re.findall(r"\(\*(PFN_\w+)\)", (ROOT / "headers" / "cuda_pfn.h").read_text()):
        grouped[re.match(r"^PFN_(\w+?)_v\d+", t).group(1)].append(t)
    return dict(grouped)


def base_versions(typedefs: list[str], name: str) -> list[int]:
    return sorted({int(m.group(1)) for t in typedefs
                   if (m := re.match(rf"^PFN_{name}_v(\d+)$", t))})


def expected_entry(typedefs: list[str], name: str, requested: int, per_thread: bool) -> str | None:
    """k-th distinct base version -> name / name_v<k>; per-thread adds the suffix from max(introduced, 7000)."""
    base = base_versions(typedefs, name)
    suffix = next((m.group(1) for t in typedefs if (m := re.match(rf"^PFN_{name}_v\d+(_ptds|_ptsz)$", t))), None)
    below = [v for v in base if v <= requested]
    if not below:
        return None
    k = base.index(below[-1]) + 1
    entry = name if k == 1 else f"{name}_v{k}"
    if per_thread and suffix:
        if requested < max(base[0], 7000):
            return None
        entry += suffix
    return entry


def expected_resolution(typedefs: list[str], name: str, requested: int, driver: int,
                        per_thread: bool) -> tuple[str, str | None]:
    """(status, entry) a handle at ``requested`` on a driver of version ``driver`` must give."""
    base = base_versions(typedefs, name)
    if name in WINDOWS_ONLY and sys.platform != "win32" and base[0] <= requested:
        return "not_on_this_platform", None
    if base[0] > requested:  # not at R: a newer-driver feature, if the driver has it
        if base[0] > driver:
            return "driver_too_old", None
        entry = expected_entry(typedefs, name, min(driver, NEWEST), per_thread)
        return ("resolved", entry) if entry else ("version_not_sufficient", None)
    entry = expected_entry(typedefs, name, requested, per_thread)
    if entry is None:
        return "version_not_sufficient", None
    selected = max(v for v in base if v <= requested)
    if selected > driver:
        return "driver_too_old", None
    return "resolved", entry
