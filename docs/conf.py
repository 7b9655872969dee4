"""Sphinx configuration of cuproc's documentation site.

Build it (warnings are errors, as in CI)::

    pip install -e . -r docs/requirements.txt
    python -m sphinx -W --keep-going -b html docs /tmp/docs-out

autodoc imports cuproc from this checkout.  Importing cuproc never touches the CUDA driver (the
driver opens on first use), so the site builds on a machine without a GPU or driver.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import sys
import unicodedata
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # the checkout's cuproc, not another one installed in the environment

import cuproc  # noqa: E402  (after the path above)

# -- project -------------------------------------------------------------------------------------

project = "cuproc"
author = "the cuproc maintainers"
copyright = "the cuproc maintainers"   # noqa: A001  (Sphinx's name)
release = cuproc.__version__
version = ".".join(release.split(".")[:2])

# -- general -------------------------------------------------------------------------------------

extensions = [
    "sphinx.ext.autodoc",    # the API reference, from the docstrings
    "sphinx.ext.viewcode",   # links from the reference to the source it documents
]
# No napoleon: the docstrings are reST prose (``literals``, :class: roles), not Google/NumPy sections.

exclude_patterns = ["_build"]
root_doc = "index"
language = "en"
pygments_style = "sphinx"

# The docstrings name the driver's C functions, private helpers and other libraries' types in
# cross-reference roles (:func:`sweep`, :class:`~cuproc._resource.Resource`) that need not resolve:
# those render as plain code, as Sphinx does by default.  Kept explicit so that a later change to
# nitpicky does not turn each of them into a build error.
nitpicky = False

# -- autodoc -------------------------------------------------------------------------------------

autodoc_default_options = {
    "member-order": "bysource",
    "show-inheritance": True,
}
autodoc_member_order = "bysource"
autodoc_class_signature = "separated"   # __init__'s parameters under the class, as a method signature
autodoc_typehints = "signature"
autodoc_preserve_defaults = True         # defaults as written in the source, not as their repr
# The annotations are strings (``from __future__ import annotations``) naming types imported only for
# type checkers; autodoc shows them as written.
autodoc_typehints_format = "short"
add_module_names = False
python_display_short_literal_types = True

# -- HTML ----------------------------------------------------------------------------------------

html_theme = "alabaster"
html_title = f"cuproc {release}"
html_theme_options = {
    "description": "The CUDA driver API from Python, at the ABI version you ask for.",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "260px",
}
html_static_path: list[str] = []
html_show_sourcelink = False


# -- the CLI's own --help --------------------------------------------------------------------------

class CliHelp(SphinxDirective):
    """``.. cuproc-cli-help::`` -- the ``--help`` text of ``cuproc-dump-symbols``, taken from the
    command itself at build time (``cuproc.tools.dump_symbols.main``), so the page cannot drift from it."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from cuproc.tools import dump_symbols

        out = io.StringIO()
        width = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "96"   # argparse wraps at the terminal's width; make it fixed
        try:
            with contextlib.redirect_stdout(out):
                try:
                    dump_symbols.main(["--help"])
                except SystemExit:
                    pass
        finally:
            if width is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = width
        text = out.getvalue().rstrip() or "(cuproc-dump-symbols --help printed nothing)"
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


# -- cuproc's top-level names --------------------------------------------------------------------

class PublicNames(SphinxDirective):
    """``.. cuproc-public-names::`` -- every name of ``cuproc.__all__``, grouped by the module that
    defines it (where it is documented), read from the package at build time: a name added to or
    removed from ``__all__`` changes the table without an edit here.  Taking each name imports the
    lazy object layer, which touches no driver."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        groups: dict[str, list[str]] = {}
        for name in cuproc.__all__:
            value = getattr(cuproc, name)
            module = getattr(value, "__module__", None) if inspect.isclass(value) or inspect.isroutine(value) \
                else None
            groups.setdefault(module if isinstance(module, str) else "", []).append(name)
        lines = [".. list-table::", "   :header-rows: 1", "   :widths: 28 72", "",
                 "   * - defined in", "     - names"]
        for module, names in groups.items():
            where = f":mod:`{module}`" if module else "--"
            refs = ", ".join(f":py:obj:`~{module}.{name}`" if module else f"``{name}``" for name in names)
            lines += [f"   * - {where}", f"     - {refs}"]
        return self.parse_text_to_nodes("\n".join(lines))


# -- docstring hooks -------------------------------------------------------------------------------

def choose_members(app, what, name, obj, skip, options):  # noqa: ANN001, ANN201  (autodoc's event)
    """Which members autodoc documents, beyond its defaults: each class and function once, in the
    module that defines it; and a class's public methods also without a docstring
    (:func:`keep_public_methods`).

    Several modules list names of other modules in ``__all__`` (``cuproc.memory`` gathers every
    memory name, ``cuproc.program`` the errors and cache a compile raises or takes), and autodoc
    documents every ``__all__`` name as the module's own: the same class twice, and every
    annotation that names it an ambiguous reference (a warning).  The defining module's entry is
    the one kept; instances (constants) are not affected."""
    if what in ("class", "exception"):
        return keep_public_methods(name, obj, skip)
    if skip or what != "module" or not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return None
    documenting = getattr(app.env.current_document, "autodoc_module", "")
    defined_in = getattr(obj, "__module__", None)
    if documenting and isinstance(defined_in, str) and defined_in.startswith("cuproc") and defined_in != documenting:
        return True
    return None


def keep_public_methods(name: str, obj: object, skip: bool) -> bool | None:
    """A class's public methods and properties are documented even without a docstring of their own
    (``Module.get_function``): their signature is the reference.  Undocumented data attributes stay
    out (``undoc-members`` would add them, and a class attribute such as the nodes' ``type`` makes
    every annotation naming the builtin ``type`` an ambiguous reference)."""
    if not skip or name.startswith("_"):
        return None
    if inspect.isroutine(obj) or isinstance(obj, (property, classmethod, staticmethod)):
        return False
    return None


# An inline literal whose closing backquotes are followed at once by a letter (as in a plural of
# ``#define``) is not closed in reST ("Inline literal start-string without end-string").  Such
# docstrings are for their authors to fix; until they change, the letter is joined on with an escaped
# space (rendered as nothing).  Literals are paired left to right over the whole docstring, as
# docutils pairs them.
_LITERAL = re.compile(r"``(?=\S)(?:[^`]|`(?!`))*?(?<=\S)``", re.DOTALL)


def _may_follow_literal(char: str) -> bool:
    """docutils' rule for the character after an inline markup end-string."""
    return (char.isspace() or char in "-.,:;!?\\/'\")]}>"
            or unicodedata.category(char) in {"Pd", "Po", "Pe", "Pf", "Pi"})


def join_glued_literals(app, what, name, obj, options, lines):  # noqa: ANN001, ANN201  (autodoc's event)
    text = "\n".join(lines)
    if "``" not in text:
        return

    def close(found: re.Match[str]) -> str:
        after = found.end()
        glued = after < len(text) and not _may_follow_literal(text[after])
        return found.group(0) + ("\\ " if glued else "")

    fixed = _LITERAL.sub(close, text)
    if fixed != text:
        lines[:] = fixed.split("\n")


def setup(app):  # noqa: ANN001, ANN201  (Sphinx's hook)
    app.add_directive("cuproc-cli-help", CliHelp)
    app.add_directive("cuproc-public-names", PublicNames)
    app.connect("autodoc-skip-member", choose_members)
    app.connect("autodoc-process-docstring", join_glued_literals)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
