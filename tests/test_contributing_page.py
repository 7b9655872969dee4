"""docs/guide/contributing.rst against what pytest really reads (issue 41's review): every marker of
``pyproject.toml`` is described, and the default selection is quoted as it is, not as it once was."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "guide" / "contributing.rst").read_text()


def pytest_options() -> dict:
    """pyproject.toml's [tool.pytest.ini_options] (tomllib: Python 3.11+; tomli before)."""
    toml = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return toml.load(f)["tool"]["pytest"]["ini_options"]


def test_every_marker_is_described() -> None:
    """Each marker pyproject.toml declares is a term of the page's marker list (a line ````name````)."""
    declared = {line.split(":", 1)[0].strip() for line in pytest_options()["markers"]}
    assert {"gpu", "stress", "slow", "tooling"} <= declared, declared
    described = set(re.findall(r"^``(\w+)``$", PAGE, flags=re.MULTILINE))
    assert not declared - described, f"markers the page does not describe: {sorted(declared - described)}"


def test_the_default_selection_is_quoted_as_pyproject_has_it() -> None:
    """The page quotes addopts whole, so that its -m expression (what a plain ``pytest`` leaves out) is the real one."""
    addopts = pytest_options()["addopts"]
    assert "-m 'not stress" in addopts   # what the default selection leaves to CI
    assert f'addopts = "{addopts}"' in PAGE, f"the page does not quote addopts = {addopts!r}"
