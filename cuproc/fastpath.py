"""Is the optional compiled fast path in use, and why (not)?

cuproc is complete in pure Python (cffi's ABI mode: every call goes through libffi).  When a C
compiler and the Python headers were there at install, setup.py also built
``cuproc._fastpath_c`` from the same ``headers/`` (tools/build_fastpath.py): C trampolines that
call the pointer cuGetProcAddress resolved, with its exact typedef, and a C packer for prepared
launches.  Nothing else changes: the same versioned resolution, the same arguments and results,
the same refusals.  ``CUPROC_PURE_PYTHON=1`` (read once, at import) turns it off.

Where it applies:

* ``drv.cuX`` is the trampoline bound to the resolved pointer (``cuproc.driver``); a typedef
  without a trampoline (one taking a struct by value, a signature declared at run time) stays
  the cffi pointer.  :func:`pointer` gives the pointer behind either, on both paths.
* ``drv.checked.cuX`` is a C callable (src/fastpath/fastpath_checked.c) doing what the pure path's
  generated Python wrapper does -- fork check, exact argument count, call, raise on a nonzero
  result -- without a Python frame.
* ``Function.prepare`` returns a C launcher (``cuproc.launch``) that stores the values into the
  argument block and calls cuLaunchKernel(Ex) in C; every other case -- another thread, an ended
  resource, a fork, a value it does not convert exactly as cffi would -- goes to the pure launcher.
* ``alloc_async(n, stream)`` and ``buffer.free_async()`` (or ``free_async(stream)`` with the buffer's own
  Stream) on a cuproc Stream make their driver call and build the buffer and its table entry in C
  (src/fastpath/fastpath_memory.c); every other form is the Python code.
* ``DeviceBuffer(n)`` (in the current context, or ``context=`` the current one) and ``buffer.free()`` /
  ``close()`` of such memory ask which context is current, allocate, build or claim the buffer, and
  free, in C (src/fastpath/fastpath_device_buffer.c); every resource's claim (``Resource._claim``: "not ended
  yet -> ended") is one C step under the GIL instead of a test and a store under a lock.
* ``Function.launch`` (``cuproc.launch.launch``) finds a warm one-shot entry and calls its launcher
  in C for the common form (at most ``signature=``, ``shared_mem=`` and ``stream=`` -- the default
  stream or a cuproc Stream); the launcher takes that call's grid, block and shared memory (exact
  ints, in C) with the values.  Every other call goes to the Python launch.
* ``memory.copy(dst, src[, nbytes])`` between a DeviceBuffer and pinned or registered host memory makes its
  checks, its driver call and its ``last_stream`` stores in C (src/fastpath/fastpath_copy.c); every other form,
  and a driver error, is the Python code.
* ``Driver.preload()`` makes its cuGetProcAddress queries for the names selected at its version in one
  C call (src/fastpath/fastpath_resolve.c) and keeps the same answers.
"""
from __future__ import annotations

import copyreg   # (already loaded by the interpreter's startup, except under -S: a small module)
import sys
import types

from . import _ffi

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def active() -> bool:
    """True when the compiled fast path is in use in this process."""
    return _ffi.COMPILED is not None


def status() -> str:
    """Why it is on or off, in one line: "on: ..." and the module, or "off: " with the reason and its fix
    (not built at install, ``CUPROC_PURE_PYTHON`` set, built from other sources than these, not loadable).
    Decided once, at ``import cuproc``."""
    return _ffi.STATUS


# slot trampoline -> the pointer its slot last handed out (for bare() and pointer()).  It keeps that cffi pointer
# (a few dozen bytes per slot, at most CUPROC_SLOTS per typedef) for the process's life, and a claimed
# slot is never freed: the pointer stays valid as long as its library is loaded, which cuproc never
# unloads.  Harmless today; a design that unloads libraries would need slots released.
_slot_pointers: dict[Any, Any] = {}

# The C launcher's argument kinds (src/fastpath/fastpath_launch.c enum cuproc_kind), by C type name.
_KIND_NAMES = {"pointer": "PTR", "int8_t": "I8", "int16_t": "I16", "int32_t": "I32", "int64_t": "I64",
               "uint8_t": "U8", "uint16_t": "U16", "uint32_t": "U32", "uint64_t": "U64", "float": "F32",
               "double": "F64"}


def trampoline(typedef: str, function: Any) -> Callable[..., int] | None:
    """The C trampoline for ``typedef`` calling ``function`` (a cffi pointer of that typedef), or None.

    A slot trampoline where the typedef has them and a slot holds (or takes) this very pointer
    (tools/build_fastpath.py: never rewritten, so handles with other pointers cannot share it);
    else the pointer-argument trampoline as a bound method, which puts the pointer in front of the
    caller's arguments without building a tuple (cheaper than functools.partial).
    """
    compiled = _ffi.COMPILED
    if compiled is None:
        return None
    call = getattr(compiled.lib, f"cuproc_{typedef}", None)
    if call is None or _ffi.ffi.typeof(function) is not _ffi.ffi.typeof(typedef):
        return None
    name = typedef.encode()
    for k in range(compiled.lib.CUPROC_SLOTS):
        claimed = compiled.lib.cuproc_slot_claim(name, k, function)
        if claimed < 0:
            break
        if claimed:
            slot = getattr(compiled.lib, f"cuproc_{typedef}_s{k}")
            _slot_pointers[slot] = function
            return slot
    return types.MethodType(call, function)


def bare(function: Any) -> Any:
    """The cffi function pointer behind what :func:`trampoline` returned, else ``function`` itself (a cffi
    pointer, or a wrapper: cuproc.driver asks this to tell what takes exactly the typedef's arguments)."""
    if isinstance(function, types.MethodType):
        return function.__self__
    try:
        return _slot_pointers.get(function, function)
    except TypeError:   # unhashable: no trampoline
        return function


def pointer(function: Any) -> Any:
    """The driver's own function pointer (a cffi function pointer) behind ``function``, on either path: the
    one documented way to reach it.

    ``function``: anything :mod:`cuproc.driver` hands out for a driver function -- ``drv.cuX``,
    ``cuproc.driver.cuX``, ``drv.resolve(...)``, ``drv.declare(...)``, the pointer itself -- which is, on the
    compiled fast path, a C trampoline calling that pointer, and on both paths for a few names a thin Python
    wrapper (cuInit, functions taking a struct by value, an :class:`~cuproc.driver.AliasedName`; those carry
    it as ``.function``).  ``ffi.cast("void *", pointer(f))`` is the address cuGetProcAddress handed out
    (``ffi.cast`` of a trampoline would give the trampoline's own address, or a TypeError).  Anything else --
    an Unavailable, ``drv.checked.cuX`` (which raises instead of returning the code), your own callable -- is
    returned as it is.
    """
    found = bare(function)
    if found is function and not isinstance(function, _ffi.ffi.CData):
        wrapped = getattr(function, "function", None)   # cuproc.driver's wrappers keep the pointer they call
        if isinstance(wrapped, _ffi.ffi.CData):
            return wrapped
    return found


def _gil_held() -> bool:
    """Whether this interpreter runs with the GIL: always before Python 3.13; on a free-threaded build, only
    when something enabled it (an extension module that needs it, ``PYTHON_GIL=1``)."""
    enabled = getattr(sys, "_is_gil_enabled", None)
    return enabled is None or bool(enabled())


def _factory(name: str) -> Any:
    """``cuproc._fastpath_c.<name>``, one of the factories its hand-written C publishes, or None
    without the fast path -- or without the GIL: every front makes a test and a store one step by holding
    it (a claim, the block's owner, the one-shot entry in use), so a free-threaded interpreter running
    without it uses the Python code, which takes locks, and keeps only the trampolines."""
    compiled = _ffi.COMPILED
    return None if compiled is None or not _gil_held() else getattr(compiled, name)


def launcher_factory() -> Callable[..., Callable[..., None]] | None:
    """``cuproc._fastpath_c.make_launcher`` (see src/fastpath/fastpath_launch.c), or None without the fast path."""
    return _factory("make_launcher")


def checked_factory() -> Callable[..., Callable[..., None]] | None:
    """``cuproc._fastpath_c.make_checked`` (see src/fastpath/fastpath_checked.c), or None without the fast path."""
    return _factory("make_checked")


def one_shot_factory() -> Callable[..., Any] | None:
    """``cuproc._fastpath_c.make_one_shot`` (see src/fastpath/fastpath_launch.c), or None without the fast path."""
    return _factory("make_one_shot")


def stream_ordered_factory() -> Callable[..., tuple[Any, Any]] | None:
    """``cuproc._fastpath_c.make_stream_ordered`` (see src/fastpath/fastpath_memory.c), or None without the fast path."""
    return _factory("make_stream_ordered")


def device_buffer_factory() -> Callable[..., tuple[Any, Any, Any]] | None:
    """``cuproc._fastpath_c.make_device_buffer`` (see src/fastpath/fastpath_device_buffer.c), or None without the fast path."""
    return _factory("make_device_buffer")


def claim_factory() -> Callable[..., Any] | None:
    """``cuproc._fastpath_c.make_claim`` (see src/fastpath/fastpath_device_buffer.c), or None without the fast path."""
    return _factory("make_claim")


def copy_factory() -> Callable[..., Any] | None:
    """``cuproc._fastpath_c.make_copy`` (see src/fastpath/fastpath_copy.c), or None without the fast path."""
    return _factory("make_copy")


def ask_all() -> Callable[..., int] | None:
    """``cuproc_ask_all`` (see src/fastpath/fastpath_resolve.c): many cuGetProcAddress queries in one C call,
    for ``Driver.preload()``; None without the fast path."""
    compiled = _ffi.COMPILED   # getattr: a module built before src/fastpath/fastpath_resolve.c lacks it
    return None if compiled is None else getattr(compiled.lib, "cuproc_ask_all", None)


#: The C type through which each compiled front calls its driver function (the fronts in
#: src/fastpath/fastpath_*.c cast to these): a name resolved to another ABI variant keeps its Python path.
#: Kept here, beside the compiled module, so that the object layer names no ABI version.
FRONT_TYPEDEFS = {"cuCtxGetCurrent": "PFN_cuCtxGetCurrent_v4000",
                  "cuMemAlloc": "PFN_cuMemAlloc_v3020",
                  "cuMemFree": "PFN_cuMemFree_v3020",
                  "cuMemcpyHtoD": "PFN_cuMemcpyHtoD_v3020",
                  "cuMemcpyDtoH": "PFN_cuMemcpyDtoH_v3020",
                  "cuLaunchKernel": "PFN_cuLaunchKernel_v4000",
                  "cuLaunchKernelEx": "PFN_cuLaunchKernelEx_v11060",
                  "cuMemAllocAsync": "PFN_cuMemAllocAsync_v11020",
                  "cuMemFreeAsync": "PFN_cuMemFreeAsync_v11020"}


def pointer_value(function: Any, typedef: str) -> int | None:
    """The address :func:`pointer` of ``function`` calls, when it is a driver pointer of ``typedef``'s
    C type; else None (an Unavailable, a Python stand-in): what the C fronts of the fast path call
    directly once they have checked that ``drv.cuX`` is still that very function."""
    ffi = _ffi.ffi
    raw = pointer(function)
    if not isinstance(raw, ffi.CData) or ffi.typeof(raw) is not ffi.typeof(typedef):
        return None
    return int(ffi.cast("uintptr_t", raw))


def pointer_reader(typedef: str) -> Callable[[Any], int | None]:
    """:func:`pointer_value` for ``typedef``, as the one-argument function a C front takes (what
    ``functools.partial`` would make, without importing functools at startup: issue 9)."""
    def read(function: Any) -> int | None:
        return pointer_value(function, typedef)
    return read


def dressed(front: Any, original: Any) -> Any:
    """``front`` (a C front) named and documented as the Python function it stands in for, with
    ``__wrapped__`` pointing at it: ``functools.update_wrapper``, which a fresh process would pay
    ``functools`` and ``collections`` for before its first allocation (issue 9)."""
    for attr in ("__module__", "__name__", "__qualname__", "__doc__", "__annotations__", "__type_params__"):
        try:
            value = getattr(original, attr)
        except AttributeError:
            continue
        setattr(front, attr, value)
    front.__dict__.update(getattr(original, "__dict__", {}))
    front.__wrapped__ = original
    copyreg.pickle(type(front), _by_name)
    return front


def _by_name(front: Any) -> str:
    """How pickle and copy take a front: by its name in its module, as they take the Python function it
    stands in for (pickle finds the front there and checks that it is this very object)."""
    return front.__qualname__


def launcher_kinds() -> dict[str, int] | None:
    """The C launcher's kind value per argument type ("pointer" or a scalar C type name), read from
    the compiled module (its ``enum cuproc_kind``), or None without the fast path."""
    compiled = _ffi.COMPILED
    if compiled is None or not _gil_held():   # (the C launcher is a front: see _factory)
        return None
    return {ctype: getattr(compiled.lib, f"CUPROC_K_{kind}") for ctype, kind in _KIND_NAMES.items()}


__all__ = ["active", "pointer", "status"]
