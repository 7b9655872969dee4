"""Compiled code in the driver: modules and libraries that take name expressions and are checked before loading.

Policy
------
* :class:`CompiledModule` and :class:`CompiledLibrary` are :class:`~cuproc.module.Module` and
  :class:`~cuproc.module.Library` (same loading, lifetime, launch and messages: a lookup that fails names
  the symbol and lists the kernels where the driver can; under lazy loading a load error at lookup names
  the code, its PTX ISA and the newest the driver accepts; ``eager=True`` / ``load_eagerly()``), loaded
  from an :class:`~cuproc.program.ObjectCode`.  They add three things:
* **Names as written.**  ``get_function("axpy<float>")`` looks up the lowered name NVRTC gave for that
  name expression; the Function's ``name`` stays ``"axpy<float>"`` (for messages), and the module's
  ``lowered_names`` maps it to the name the driver knows.  A library's Kernel keeps the driver's name
  (where the driver lacks cuLibrary*, it is looked up again in each context's module).
* **Checked before loading.**  Code the driver cannot load (PTX of a newer ISA than its JIT accepts,
  LTO IR) is refused before any handle reaches the driver, with what to do
  (:meth:`~cuproc.program.ObjectCode.load_problem`).
* **Messages in the program's terms.**  The code is called by its program name and described by kind,
  architecture and PTX ISA; a name that is not there lists the kernels by their name expressions and
  says how a C++ name is found (``name_expressions=`` at compile).
"""
from __future__ import annotations

from ._support import get_driver
from .context import Context
from .errors import refusal
from .module import Library, Module, loading_mode

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import Any

    from .driver import Driver
    from .program import ObjectCode


def _refuse_unloadable(code: ObjectCode, driver: Driver, call: str) -> None:
    problem = code.load_problem(driver.driver_version)
    if problem is not None:
        raise refusal(call, problem, code_name="CUDA_ERROR_UNSUPPORTED_PTX_VERSION" if code.kind == "ptx"
                      else "CUDA_ERROR_INVALID_VALUE")


class _CompiledNames:
    """What both compiled kinds add to the messages of Module and Library: the program's names."""

    lowered_names: dict[str, str] = {}
    code_name: str
    code_description: str

    def _take(self, code: ObjectCode) -> None:
        """Describe the code as the program it came from (name, kind, arch, PTX ISA), with its names."""
        isa = code.ptx_isa
        self.code_name = code.name
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

    def _name_hints(self, name: str, what: str) -> list[str]:
        if name in self.lowered_names:
            return []
        known = ", ".join(repr(e) for e in self.lowered_names) or "none"
        return [f"a C++ name (a template, or a function not declared extern \"C\") is found through "
                f"name_expressions=[{name!r}] at compile (this code's: {known})"]


class CompiledModule(_CompiledNames, Module):
    """A :class:`~cuproc.module.Module` loaded from compiled code (see the module's policy)."""

    @classmethod
    def from_code(cls, code: ObjectCode, options: dict[str | int, Any] | None = None, *,
                  context: Context | None = None, driver: Driver | None = None,
                  eager: bool = False) -> CompiledModule:
        """Check ``code`` against the driver, then load it (cuModuleLoadDataEx) into ``context``."""
        drv = Context.given(context, "cuModuleLoadDataEx").driver if context is not None else get_driver(driver)
        _refuse_unloadable(code, drv, "cuModuleLoadDataEx")
        mod = cls.load_data(code.code, options, context=context, driver=driver, name=code.name)
        assert isinstance(mod, CompiledModule)
        mod._take(code)
        if eager and loading_mode(drv) != "eager":   # after _take: a load error then names the program
            try:
                mod.load_eagerly()
            except BaseException:
                mod.close()
                raise
        return mod


class CompiledLibrary(_CompiledNames, Library):
    """A :class:`~cuproc.module.Library` loaded from compiled code (see the module's policy)."""

    @classmethod
    def from_code(cls, code: ObjectCode, options: dict[str | int, Any] | None = None, *,
                  driver: Driver | None = None, eager: bool = False) -> CompiledLibrary:
        """Check ``code`` against the driver, then load it (cuLibraryLoadData)."""
        drv = get_driver(driver)
        _refuse_unloadable(code, drv, "cuLibraryLoadData")
        lib = cls.load_data(code.code, options, driver=drv, name=code.name)
        assert isinstance(lib, CompiledLibrary)
        lib._take(code)
        # eager=True whatever CUDA_MODULE_LOADING says, as Library does: a library defers a JIT error to its
        # first lookup in both modes (driver 580); after _take, so that a load error names the program
        if eager:
            try:
                lib.load_eagerly()
            except BaseException:
                lib.close()
                raise
        return lib


__all__ = ["CompiledLibrary", "CompiledModule"]
