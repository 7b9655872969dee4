"""The installed distribution's metadata: one version, the SPDX license and its file, the typing marker.

Runs wherever cuproc is installed (editable or from the wheel: CI does both); on a bare checkout on
PYTHONPATH (the GPU machine) there is no distribution to look at, and these skip.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import re
import sys
from pathlib import Path

import pytest

import cuproc

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dist() -> md.Distribution:
    try:
        found = md.distribution("cuproc")
    except md.PackageNotFoundError:
        pytest.skip("cuproc is not installed here (on sys.path only): no distribution metadata")
    origin = Path(cuproc.__file__).resolve().parent
    installed = [Path(str(f.locate())).resolve() for f in found.files or ()]
    direct = json.loads(found.read_text("direct_url.json") or "{}")
    editable_root = direct.get("url", "").removeprefix("file://") if direct.get("dir_info", {}).get("editable") else None
    if origin / "__init__.py" not in installed and (editable_root is None or Path(editable_root) != origin.parent):
        pytest.skip(f"the installed cuproc distribution is not the one imported from {origin}")
    return found


def test_one_version(dist):
    assert dist.version == cuproc.__version__


def test_spdx_license_and_its_file(dist):
    meta = dist.metadata
    assert meta["License-Expression"] == "MIT"
    assert meta.get("License") is None            # the deprecated free-text field is gone
    assert meta.get_all("License-File") == ["LICENSE"]
    assert not [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    license_files = [f for f in dist.files or () if f.name == "LICENSE"]
    if license_files:   # a wheel install ships it under .dist-info/licenses/
        assert "MIT License" in Path(str(license_files[0].locate())).read_text()


def test_platforms_and_python(dist):
    meta = dist.metadata
    assert set(meta.get_all("Platform") or []) == {"Linux x86_64", "Linux aarch64"}
    assert meta["Requires-Python"] == ">=3.10"
    assert "Typing :: Typed" in meta.get_all("Classifier")


def test_cffi_is_the_one_dependency():
    """What the README promises: one small dependency (CudaVersion.parse reads PEP 440 strings itself,
    tests/test_version_without_packaging.py).  Read from pyproject.toml, not from the installed metadata,
    which an editable install leaves stale until it is reinstalled."""
    toml = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        required = toml.load(f)["project"]["dependencies"]
    assert [re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] for r in required] == ["cffi"], required
    assert "one small dependency (cffi)" in " ".join((ROOT / "README.md").read_text().split())   # (lines rewrapped)


def test_typing_marker_and_stub_are_installed():
    package = Path(cuproc.__file__).resolve().parent
    assert (package / "py.typed").is_file() and (package / "_cnames.pyi").is_file()
