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
  does not load, or it was built from other sources than these (cuproc/_fastpath_digest.py: other
  headers than ``cuproc/_cffi_abi.py``, whose digest ``cuproc/_abi_digest.py`` holds, or, in a
  checkout, another tools/build_fastpath.py or
  hand-written C source: a stale in-place build).  Any failure while checking it (a module
  from an older build lacking a function) turns it off; importing cuproc never fails because of
  it.  :data:`STATUS` says which and why (``cuproc.fastpath.status()``).
* ``cuproc.ffi`` is this one ffi.  Code of your own must make its cdata with ``cuproc.ffi``: with
  the fast path on, cdata of ``cuproc._cffi_abi.ffi`` (or of any other FFI) passed to ``drv.cuX``
  raises ``TypeError`` (cffi: "initializer for ctype ... must be a ..., not ..."), while the pure
  path happens to accept the ABI module's own.
"""
from __future__ import annotations

import os

from ._env import flag

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import Any

ENV_PURE = "CUPROC_PURE_PYTHON"


def _pure_requested() -> bool:
    return flag(ENV_PURE, "force the pure-Python path", "use the compiled fast path when it is built")


def _abi_ffi() -> Any:
    from ._cffi_abi import ffi as abi_ffi
    return abi_ffi


_REBUILD = "rebuild it: pip install -e . or python tools/build_fastpath.py"
#: The status of an install without the compiled module (setup.py builds it only where it can).
NOT_BUILT = ("off: not built at install (no C compiler or Python headers, or CUPROC_NO_FASTPATH): to build it, "
             "install a C compiler and the Python headers (python3-dev), then reinstall with "
             "pip install --no-cache-dir --force-reinstall cuproc, or run python tools/build_fastpath.py in a checkout")


def _load() -> tuple[Any, Any, str]:
    """(ffi, compiled module or None, why).  The ABI module is imported only when it is the one used."""
    if _pure_requested():
        return _abi_ffi(), None, f"off: {ENV_PURE} is set"
    try:
        from . import _fastpath_c
    except ImportError as exc:
        if exc.name == __package__:   # "cannot import name '_fastpath_c'": there is no such module
            return _abi_ffi(), None, NOT_BUILT
        return _abi_ffi(), None, f"off: cuproc._fastpath_c does not load ({exc}; {_REBUILD})"
    try:
        stale = _stale(_fastpath_c)
        if stale:
            return _abi_ffi(), None, f"off: {stale}"
        lib = _fastpath_c.lib
        if (lib.cuproc_install_launcher() != 0 or lib.cuproc_install_checked() != 0 or lib.cuproc_install_memory() != 0
                or lib.cuproc_install_device_buffer() != 0 or lib.cuproc_install_copy() != 0):
            return _abi_ffi(), None, ("off: cuproc._fastpath_c failed to set up its launcher, checked call, "
                                      "allocation or copy fronts (see the message above)")
    except Exception as exc:  # noqa: BLE001 - e.g. a module of an older build: never fatal to import cuproc
        return _abi_ffi(), None, (f"off: cuproc._fastpath_c is not usable ({type(exc).__name__}: {exc}; "
                                  f"{_REBUILD})")
    return _fastpath_c.ffi, _fastpath_c, f"on: compiled trampolines in {os.path.basename(_fastpath_c.__file__)}"


def _stale(module: Any) -> str:
    """Why ``module`` does not fit these sources, with the fix ("" when it fits)."""
    from . import _abi_digest   # written with cuproc/_cffi_abi.py: its digest, not recomputed per import
    built = module.ffi.string(module.lib.cuproc_abi_digest()).decode()
    if built != _abi_digest.DIGEST:
        return f"cuproc._fastpath_c was built from other headers than cuproc/_cffi_abi.py ({_REBUILD})"
    try:   # absent in a sourceless install (bytecode only), where there is nothing to compare
        size = os.stat(os.path.join(os.path.dirname(__file__), "_cffi_abi.py")).st_size
    except OSError:
        size = _abi_digest.ABI_SIZE
    if size != _abi_digest.ABI_SIZE:
        return ("cuproc/_cffi_abi.py changed without cuproc/_abi_digest.py, which tools/build_ffi.py writes with it "
                "(run python tools/build_ffi.py; a rebuilt fast path would not fit either)")
    from . import _fastpath_digest   # here: the pure path needs none of it
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))   # os.path: pathlib costs 2-4 ms
    if all(os.path.isfile(os.path.join(root, name)) for name in _fastpath_digest.TOOL_INPUTS):   # a checkout
        built = module.ffi.string(module.lib.cuproc_tools_digest()).decode()
        if built != _fastpath_digest.digest(root, _fastpath_digest.TOOL_INPUTS):
            return (f"cuproc._fastpath_c was built from other tools than {', '.join(_fastpath_digest.TOOL_INPUTS)} "
                    f"({_REBUILD})")
    return ""


ffi, COMPILED, STATUS = _load()

__all__ = ["COMPILED", "ENV_PURE", "STATUS", "ffi"]
