"""Shared fixtures. GPU tests carry the ``gpu`` marker and skip only when no driver can be opened."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADERS = ROOT / "headers"


@pytest.fixture(scope="session")
def pfn_typedef_names() -> list[str]:
    """Every PFN typedef name in headers/, read straight from the text (independent of cuproc)."""
    text = (HEADERS / "cuda_pfn.h").read_text()
    return re.findall(r"\(\*(PFN_\w+)\)", text)
