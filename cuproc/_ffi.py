"""The one cffi ``ffi`` of cuproc: the compiled fast path's when it is built and allowed, else the ABI module's.

Policy
------
* ``cuproc._cffi_abi`` (out-of-line ABI mode, pure Python, built from ``headers/`` by
  tools/build_ffi.py) always works and needs no compiler.
* ``cuproc._fastpath_c`` (API mode, built at install by setup.py from the same ``headers/``,
  tools/build_fastpath.py) is optional.  It declares the same types, and cffi cannot share
  struct types between an ABI-mode and an API-mode module, so when it is used its ``ffi``
  replaces the ABI one everywhere: cdata made by ``cuproc.ffi`` goes into its trampolines as is.
* It is used unless ``CUPROC_PURE_PYTHON`` is on (read once, at import), it is missing or
  does not load, or it was built from other headers than ``cuproc/_cffi_abi.py`` (its digest
  differs: a stale in-place build).  :data:`STATUS` says which and why
  (``cuproc.fastpath.status()``).
"""
from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path
from typing import Any

ENV_PURE = "CUPROC_PURE_PYTHON"
_ON = {"1", "true", "yes", "on"}
_OFF = {"", "0", "false", "no", "off"}


def _pure_requested() -> bool:
    text = os.environ.get(ENV_PURE, "").strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(f"{ENV_PURE}={os.environ[ENV_PURE]!r}: use 1 to force the pure-Python path, 0 or unset "
                     f"to use the compiled fast path when it is built")


def _abi_ffi() -> Any:
    from ._cffi_abi import ffi as abi_ffi
    return abi_ffi


def _load() -> tuple[Any, Any, str]:
    """(ffi, compiled module or None, why).  The ABI module is imported only when it is the one used."""
    if _pure_requested():
        return _abi_ffi(), None, f"off: {ENV_PURE} is set"
    try:
        _fastpath_c = importlib.import_module("cuproc._fastpath_c")
    except ImportError as exc:
        return _abi_ffi(), None, f"off: the compiled module cuproc._fastpath_c is not built ({exc})"
    digest = hashlib.sha256((Path(__file__).with_name("_cffi_abi.py")).read_bytes()).hexdigest()
    built_for = _fastpath_c.ffi.string(_fastpath_c.lib.cuproc_abi_digest()).decode()
    if built_for != digest:
        return _abi_ffi(), None, ("off: cuproc._fastpath_c was built from other headers than cuproc/_cffi_abi.py "
                               "(rebuild it: pip install -e . or python tools/build_fastpath.py)")
    if _fastpath_c.lib.cuproc_install_launcher() != 0:
        return _abi_ffi(), None, "off: cuproc._fastpath_c failed to set up its launcher (see the message above)"
    return _fastpath_c.ffi, _fastpath_c, f"on: compiled trampolines in {Path(_fastpath_c.__file__).name}"


ffi, COMPILED, STATUS = _load()

__all__ = ["COMPILED", "ENV_PURE", "STATUS", "ffi"]
