"""Shared fixtures. GPU tests carry the ``gpu`` marker and skip only when no driver can be opened."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from simdriver import build

ROOT = Path(__file__).resolve().parent.parent
HEADERS = ROOT / "headers"


@pytest.fixture(scope="session")
def pfn_typedef_names() -> list[str]:
    """Every PFN typedef name in headers/, read straight from the text (independent of cuproc)."""
    text = (HEADERS / "cuda_pfn.h").read_text()
    return re.findall(r"\(\*(PFN_\w+)\)", text)


@pytest.fixture(scope="session")
def sims(tmp_path_factory):
    """The simulated driver, one library per lookup generation (cuGetProcAddress_v2, v1, dlsym only)."""
    try:
        out = tmp_path_factory.mktemp("simdriver")
        return {gen: build(out, gen) for gen in ("v2", "v1", "none")}
    except (RuntimeError, subprocess.CalledProcessError) as exc:  # pragma: no cover - CI has cc
        pytest.skip(f"cannot build the simulated driver: {exc}")


@pytest.fixture(scope="session")
def fake(tmp_path_factory):
    """The stateful fake driver (tests/fakedriver.c), built once per session."""
    from fakedriver import build as build_fake
    try:
        return build_fake(tmp_path_factory.mktemp("fakedriver"))
    except (RuntimeError, subprocess.CalledProcessError) as exc:  # pragma: no cover - CI has cc
        pytest.skip(f"cannot build the fake driver: {exc}")
