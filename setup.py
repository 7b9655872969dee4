"""Build hook for the optional compiled fast path; the project's metadata lives in pyproject.toml.

``cuproc._fastpath_c`` (tools/build_fastpath.py, from headers/) is built when a C compiler and the
Python headers are there.  It is never required: when anything about it fails, the install goes
on without it and prints one line saying so (cuproc then runs in pure Python, see
cuproc/fastpath.py).  ``CUPROC_NO_FASTPATH=1`` skips it on purpose.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
MODULE = "cuproc._fastpath_c"


def env_flag(name: str, on: str, off: str) -> bool:
    """cuproc's one rule for its on/off variables (cuproc/_env.py, loaded by path: the package is not
    importable while it is being built): a value that is neither on nor off stops the install with a
    message naming the variable, as CUPROC_PURE_PYTHON does at import; a typo never picks a side."""
    spec = importlib.util.spec_from_file_location("_cuproc_env", ROOT / "cuproc" / "_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return bool(module.flag(name, on, off))


def notice(reason: object) -> None:
    """One line on stderr.  For an exception: its type and the last line of its message (a compiler
    error's message ends with the command's exit status; the lines before it are the command).
    pip shows it only with -v: users find out through ``cuproc.fastpath.status()``, the one line that
    docs/guide/getting-started.rst ("Install") and docs/guide/speed.rst ("Which path runs, and why") give."""
    if isinstance(reason, BaseException):
        lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
        text = f"{type(reason).__name__}: {lines[-1]}" if lines else type(reason).__name__
    else:
        text = str(reason)
    print(f"cuproc: the optional compiled fast path was not built ({text}); cuproc runs in pure Python",
          file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext for one optional extension whose C source cffi generates here."""

    def run(self) -> None:
        if env_flag("CUPROC_NO_FASTPATH", "skip the compiled fast path", "build it where possible"):
            notice("CUPROC_NO_FASTPATH is set")
            return
        try:
            sys.path.insert(0, str(ROOT / "tools"))
            try:
                from build_fastpath import ffibuilder
            finally:
                sys.path.remove(str(ROOT / "tools"))
            Path(self.build_temp).mkdir(parents=True, exist_ok=True)
            generated = ffibuilder(ROOT).distutils_extension(tmpdir=self.build_temp)
            for ext in self.extensions:   # setuptools' own Extension, given cffi's source and flags
                for field in ("sources", "include_dirs", "define_macros", "undef_macros", "libraries",
                              "library_dirs", "extra_compile_args", "extra_link_args"):
                    setattr(ext, field, list(getattr(generated, field) or []))
            super().run()
        except Exception as exc:  # noqa: BLE001 - a missing compiler, headers, cffi: never fatal
            notice(exc)

    def get_outputs(self) -> list[str]:
        """Only what was built (the wheel and editable installs list these)."""
        return [path for path in super().get_outputs() if os.path.exists(path)]


setup(ext_modules=[Extension(MODULE, sources=[])], cmdclass={"build_ext": OptionalBuildExt})
