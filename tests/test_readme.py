"""The README (issue 41): a first screen that starts a newcomer, links that resolve, a layout that names every module."""
from __future__ import annotations

import re
from pathlib import Path

import cuproc

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_first_screen_gives_the_install_the_main_job_and_the_tests():
    first = README.splitlines()[:40]
    text = "\n".join(first)
    assert "pip install cuproc" in text
    assert "pip install -e '.[test]'" in text and "cuproc-dump-symbols" in text
    assert any(line.strip().startswith("pytest") for line in first)
    for peer in ("cuda.bindings", "cuda.core", "CuPy", "PyCUDA", "numba"):
        assert peer in text, peer


def test_it_stays_short_and_every_relative_link_resolves():
    assert len(README.splitlines()) <= 150
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target


def test_the_layout_names_every_module():
    layout = README[README.index("## Layout"):]
    package = Path(cuproc.__file__).resolve().parent      # the checkout's, or the installed wheel's
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    assert len(modules) > 30
    missing = [m for m in modules if f"`{m}`" not in layout]
    assert not missing, f"modules the README's layout does not name: {missing}"
    assert "dump_symbols" in layout
