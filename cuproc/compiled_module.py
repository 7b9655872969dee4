"""Compiled code in the driver: modules and libraries that take name expressions and say what went wrong.

Policy
------
* :class:`CompiledModule` and :class:`CompiledLibrary` are :class:`~cuproc.module.Module` and
  :class:`~cuproc.module.Library` (same loading, lifetime and launch), loaded from an
  :class:`~cuproc.program.ObjectCode`.  They add three things:
* **Names as written.**  ``get_function("axpy<float>")`` looks up the lowered name NVRTC gave for that
  name expression; the Function's ``name`` stays ``"axpy<float>"`` (for messages), and the module's
  ``lowered_names`` maps it to the name the driver knows.  A library's Kernel keeps the driver's name
  (where the driver lacks cuLibrary*, it is looked up again in each context's module).
* **Checked before loading.**  Code the driver cannot load (PTX of a newer ISA than its JIT accepts,
  LTO IR) is refused before any handle reaches the driver, with what to do
  (:meth:`~cuproc.program.ObjectCode.load_problem`).
* **Errors that name the symbol.**  A name that is not there raises NotFoundError naming it, its lowered
  name, the module's kernels (listed where the driver can enumerate them: cuModuleEnumerateFunctions /
  cuLibraryEnumerateKernels, CUDA 12.4+) and the name expressions it was compiled with.  A load
  error that surfaces at lookup -- under lazy loading (``CUDA_MODULE_LOADING=LAZY``, the default from CUDA
  12.2) the JIT runs at the first lookup, not at load -- names the code's kind, its PTX ISA and the newest
  ISA the driver accepts.  :meth:`CompiledModule.load_eagerly` loads every function at once (cuFuncLoad,
  12.4+), so such errors come where the code is loaded.
"""
from __future__ import annotations

from ._ffi import ffi
from ._support import get_driver
from .context import Context
from .errors import CudaError, NotFoundError, refusal
from .module import Function, Kernel, Library, Module
from .ptx_isa import max_ptx_isa

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .device_memory import GlobalView
    from .driver import Driver
    from .program import ObjectCode

_LOAD_ERRORS = frozenset({"CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_PTX", "CUDA_ERROR_NO_BINARY_FOR_GPU",
                          "CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
                          "CUDA_ERROR_JIT_COMPILATION_DISABLED"})


def _refuse_unloadable(code: ObjectCode, driver: Driver, call: str) -> None:
    problem = code.load_problem(driver.driver_version)
    if problem is not None:
        raise refusal(call, problem, code_name="CUDA_ERROR_UNSUPPORTED_PTX_VERSION" if code.kind == "ptx"
                      else "CUDA_ERROR_INVALID_VALUE")


class _CompiledNames:
    """What both compiled kinds share: the code they came from, its name expressions, the messages."""

    code_name = "compiled code"
    code_kind = ""
    code_description = ""
    lowered_names: dict[str, str] = {}
    driver: Driver

    def _take(self, code: ObjectCode) -> None:
        self.code_name, self.code_kind = code.name, code.kind
        isa = code.ptx_isa
        self.code_description = f"{code.kind} for {code.arch}" + (f", PTX ISA {isa}" if isa is not None else "")
        self.lowered_names = dict(code.lowered_names)

    def _lowered(self, name: str) -> str:
        if not isinstance(name, str):
            raise TypeError(f"a kernel or variable name is a str, not {type(name).__name__}")
        return self.lowered_names.get(name, name)

    def _shown(self, lowered: str) -> str:
        """A driver-level name as the user wrote it, where a name expression lowered to it."""
        for expr, low in self.lowered_names.items():
            if low == lowered and expr != lowered:
                return f"{expr} ({lowered})"
        return lowered

    def _explained(self, exc: CudaError, what: str, name: str, lowered: str,
                   names: Callable[[], list[str] | None]) -> CudaError:
        """``exc`` (a failed lookup of ``name``) with a hint that says what is there and what to do."""
        parts = []
        if exc.name == "CUDA_ERROR_NOT_FOUND":
            low = f" (lowered: {lowered})" if lowered != name else ""
            parts.append(f"{self.code_name} ({self.code_description}) has no {what} {name!r}{low}")
            try:
                found = names()
            except Exception:  # noqa: BLE001 - listing is a courtesy; it must never hide the error
                found = None
            if found is not None:
                parts.append(f"its kernels: {', '.join(self._shown(n) for n in found) or 'none'}")
            if name not in self.lowered_names:
                known = ", ".join(repr(e) for e in self.lowered_names) or "none"
                parts.append(f"a C++ name (a template, or a function not declared extern \"C\") is found through "
                             f"name_expressions=[{name!r}] at compile (this code's: {known})")
        elif exc.name in _LOAD_ERRORS:
            parts.append(self._load_hint(f"when {what} {name!r} was first asked for"))
        else:
            return exc
        return self._with_hint(exc, parts)

    def _load_hint(self, when: str) -> str:
        drv = self.driver.driver_version
        limit = max_ptx_isa(drv)
        return (f"the code failed to load {when} (under lazy loading, CUDA_MODULE_LOADING=LAZY and the default "
                f"from CUDA 12.2, the driver JIT-compiles it then): {self.code_name} is {self.code_description}; "
                f"this CUDA {drv} driver accepts PTX up to ISA {limit if limit is not None else '(unknown to cuproc)'}."
                f" Compile a cubin (target='cubin'), or set CUDA_MODULE_LOADING=EAGER to see such errors at load")

    @staticmethod
    def _with_hint(exc: CudaError, parts: list[str]) -> CudaError:
        hint = "; ".join(filter(None, [exc.hint if exc.name != "CUDA_ERROR_NOT_FOUND" else "", *parts]))
        return type(exc)(exc.code, exc.call, name=exc.name, description=exc.description, hint=hint)


class CompiledModule(_CompiledNames, Module):
    """A :class:`~cuproc.module.Module` loaded from compiled code (see the module's policy)."""

    @classmethod
    def from_code(cls, code: ObjectCode, options: dict[str | int, Any] | None = None, *,
                  context: Context | None = None, driver: Driver | None = None) -> CompiledModule:
        """Check ``code`` against the driver, then load it (cuModuleLoadDataEx) into ``context``."""
        drv = Context.given(context, "cuModuleLoadDataEx").driver if context is not None else get_driver(driver)
        _refuse_unloadable(code, drv, "cuModuleLoadDataEx")
        mod = cls.load(code.code, options, context=context, driver=driver)
        assert isinstance(mod, CompiledModule)
        mod._take(code)
        return mod

    def get_function(self, name: str) -> Function:
        """The kernel ``name``: a name expression it was compiled with (``"axpy<float>"``), or a name the
        driver knows (an ``extern "C"`` name, or a lowered one).  cuModuleGetFunction."""
        lowered = self._lowered(name)
        try:
            fn = super().get_function(lowered)
        except CudaError as exc:
            raise self._explained(exc, "kernel", name, lowered, self.kernel_names) from None
        fn.name = name   # for messages; the driver's name stays in lowered_names
        return fn

    def get_global(self, name: str) -> GlobalView:
        """The ``__device__`` variable ``name`` (a name expression, e.g. ``"table<4>"``, or a driver name)."""
        lowered = self._lowered(name)
        try:
            return super().get_global(lowered)
        except CudaError as exc:
            raise self._explained(exc, "variable", name, lowered, lambda: None) from None

    def _functions(self) -> list[Any] | None:
        """The module's CUfunctions (cuModuleGetFunctionCount + cuModuleEnumerateFunctions), or None
        where the driver lacks them."""
        drv = self.driver
        if not (drv.has("cuModuleGetFunctionCount") and drv.has("cuModuleEnumerateFunctions")):
            return None
        self.check("cuModuleEnumerateFunctions")
        count = ffi.new("unsigned int *")
        drv.check(self.context.call(drv.cuModuleGetFunctionCount, count, self.handle), "cuModuleGetFunctionCount")
        handles = ffi.new("CUfunction[]", count[0])
        drv.check(self.context.call(drv.cuModuleEnumerateFunctions, handles, count[0], self.handle),
                  "cuModuleEnumerateFunctions")
        return list(handles)

    def kernel_names(self) -> list[str] | None:
        """The names (as the driver knows them: lowered) of the module's kernels; None where the driver
        cannot enumerate them (before CUDA 12.4)."""
        handles = self._functions()
        if handles is None or not self.driver.has("cuFuncGetName"):
            return None
        out = ffi.new("const char **")
        names = []
        for handle in handles:
            self.driver.check(self.context.call(self.driver.cuFuncGetName, out, handle), "cuFuncGetName")
            names.append(ffi.string(out[0]).decode())
        return sorted(names)

    def load_eagerly(self) -> int:
        """Load every function now (cuFuncLoad, CUDA 12.4+): under lazy loading a JIT error then comes
        here instead of at a later lookup.  Returns how many functions there are."""
        handles = self._functions()
        if handles is None or not self.driver.has("cuFuncLoad"):
            raise refusal("cuFuncLoad", f"loading eagerly needs cuModuleEnumerateFunctions and cuFuncLoad (a CUDA "
                                        f"12.4 driver); this driver is {self.driver.driver_version}: set "
                                        f"CUDA_MODULE_LOADING=EAGER before CUDA starts instead",
                          code_name="CUDA_ERROR_NOT_SUPPORTED")
        for handle in handles:
            try:
                self.driver.check(self.context.call(self.driver.cuFuncLoad, handle), "cuFuncLoad")
            except CudaError as exc:
                if exc.name not in _LOAD_ERRORS:
                    raise
                raise self._with_hint(exc, [self._load_hint("when loading eagerly")]) from None
        return len(handles)


class CompiledLibrary(_CompiledNames, Library):
    """A :class:`~cuproc.module.Library` loaded from compiled code (see the module's policy)."""

    @classmethod
    def from_code(cls, code: ObjectCode, options: dict[str | int, Any] | None = None, *,
                  driver: Driver | None = None) -> CompiledLibrary:
        """Check ``code`` against the driver, then load it (cuLibraryLoadData)."""
        drv = get_driver(driver)
        _refuse_unloadable(code, drv, "cuLibraryLoadData")
        lib = cls(code.code, options, driver=drv)
        lib._take(code)
        return lib

    def get_kernel(self, name: str) -> Kernel:
        """The kernel ``name`` (a name expression or a driver name).  cuLibraryGetKernel."""
        lowered = self._lowered(name)
        try:
            return super().get_kernel(lowered)   # its name stays the driver's: per-context modules look it up
        except CudaError as exc:
            raise self._explained(exc, "kernel", name, lowered, self.kernel_names) from None

    def kernel_names(self) -> list[str] | None:
        """The names (lowered) of the library's kernels (cuLibraryEnumerateKernels + cuKernelGetName,
        CUDA 12.4+); None where the driver cannot say."""
        drv = self.driver
        if not self.context_independent or not all(
                drv.has(n) for n in ("cuLibraryGetKernelCount", "cuLibraryEnumerateKernels", "cuKernelGetName")):
            return None
        self.check("cuLibraryEnumerateKernels")
        count = ffi.new("unsigned int *")
        drv.checked.cuLibraryGetKernelCount(count, self.handle)
        handles = ffi.new("CUkernel[]", count[0])
        drv.checked.cuLibraryEnumerateKernels(handles, count[0], self.handle)
        out = ffi.new("const char **")
        names = []
        for handle in handles:
            drv.checked.cuKernelGetName(out, handle)
            names.append(ffi.string(out[0]).decode())
        return sorted(names)


__all__ = ["CompiledLibrary", "CompiledModule"]
