"""Loading code: modules (cubin/PTX/fatbin), JIT linking, context-independent libraries, functions.

Policy
------
* JIT info and error logs are always captured; a failed load raises with the
  error log in the message.  CUDA_ERROR_UNSUPPORTED_PTX_VERSION says which
  PTX ISA the code needs and which this driver supports.
* A :class:`Library` loads once and serves every context.  Where the handle
  lacks ``cuLibraryLoadData`` (drivers or requested versions before 12.0) the
  same object loads a :class:`Module` into each context it meets.
* Modules, libraries, linkers and functions are resources
  (:mod:`cuproc._resource`): a module holds its context, a function its
  module (or its library kernel and context); unloading refuses further use
  of everything that depended on it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from . import _fork
from ._ffi import ffi
from ._resource import Resource
from ._support import get_driver, handle_int, invalid
from .context import Context, call_in
from .device_memory import GlobalView
from .driver import Driver
from .errors import CudaError, result_code
from .launch import launch as _one_shot_launch

_LOG_SIZE = 1 << 14
_UNSUPPORTED_PTX = result_code("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")


class JitResult:
    """What a JIT step reported: wall time (ms) and the info and error logs."""

    def __init__(self, wall_ms: float, info_log: str, error_log: str) -> None:
        self.wall_ms, self.info_log, self.error_log = wall_ms, info_log, error_log

    def __repr__(self) -> str:
        return f"<JitResult {self.wall_ms:.2f} ms, info {len(self.info_log)} chars, errors {len(self.error_log)}>"


class _JitOptions:
    """CUjit_option arrays with log buffers and wall time; user options by name or enum value."""

    def __init__(self, options: dict[str | int, Any] | None) -> None:
        self.info = ffi.new("char[]", _LOG_SIZE)
        self.error = ffi.new("char[]", _LOG_SIZE)
        opts: dict[int, Any] = {}
        jit = ffi.typeof("CUjit_option").relements
        for key, value in (options or {}).items():
            if isinstance(key, str):
                name = key if key.startswith("CU_JIT_") else "CU_JIT_" + key.upper()
                if name not in jit:
                    raise invalid("cuModuleLoadDataEx", f"no JIT option {name}")
                key = jit[name]
            opts[key] = value
        opts[jit["CU_JIT_INFO_LOG_BUFFER"]] = self.info
        opts[jit["CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES"]] = _LOG_SIZE
        opts[jit["CU_JIT_ERROR_LOG_BUFFER"]] = self.error
        opts[jit["CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES"]] = _LOG_SIZE
        opts[jit["CU_JIT_WALL_TIME"]] = 0
        self._wall_index = list(opts).index(jit["CU_JIT_WALL_TIME"])
        self.count = len(opts)
        self.keys = ffi.new("CUjit_option[]", list(opts))
        self.values = ffi.new("void *[]", [v if isinstance(v, ffi.CData) else ffi.cast("void *", int(v))
                                           for v in opts.values()])

    def result(self) -> JitResult:
        wall = ffi.cast("float *", ffi.addressof(self.values, self._wall_index))[0]
        return JitResult(wall, ffi.string(self.info).decode(errors="replace"),
                         ffi.string(self.error).decode(errors="replace"))


def _image(data: bytes | bytearray | memoryview | str | os.PathLike[str]) -> tuple[Any, bytes]:
    """(cffi char array, bytes) for a module image; PTX text gets its terminating NUL."""
    if isinstance(data, (str, os.PathLike)) and not (isinstance(data, str) and data.lstrip().startswith("//")):
        data = Path(data).read_bytes()
    if isinstance(data, str):
        data = data.encode()
    raw = bytes(data)
    if raw[:4] != b"\x7fELF" and not raw.endswith(b"\0") and (b".version" in raw[:4096] or b".target" in raw[:4096]):
        raw += b"\0"
    return ffi.from_buffer(raw), raw


def _load_error(drv: Driver, rc: int, call: str, raw: bytes, jit: _JitOptions | None) -> CudaError:
    extra = []
    if jit is not None:
        log = jit.result().error_log.strip()
        if log:
            extra.append(f"JIT error log:\n{log}")
    if rc == _UNSUPPORTED_PTX:
        m = re.search(rb"^\s*\.version\s+(\d+\.\d+)", raw, re.M)
        dv = drv.driver_version
        from .ptx_isa import max_ptx_isa   # the one table of PTX ISA per CUDA version; only on this error path
        limit = max_ptx_isa(dv)
        supported = str(limit) if limit is not None else "an ISA cuproc does not know"
        extra.append(f"the PTX declares ISA .version {m.group(1).decode() if m else '?'}, this CUDA {dv} "
                     f"driver accepts up to PTX ISA {supported}: rebuild with an older toolkit "
                     f"(or -arch for an older PTX ISA), or upgrade the driver")
    err = drv.error(rc, call)
    if extra:
        err = type(err)(err.code, call, name=err.name, description=err.description,
                        hint="; ".join(filter(None, [err.hint, *extra])))
    return err


class Module(Resource):
    """A module loaded into a context (cuModuleLoadDataEx), which it holds.

    ``unload()``/``close()`` (idempotent) or dropping it -- once no Function of it
    is left -- unloads it.  Its functions and globals refuse use afterwards.
    """

    _release_call = "cuModuleUnload"
    _ended_word = "unloaded"

    def __init__(self, handle: Any, context: Context, driver: Driver, jit: JitResult | None) -> None:
        self.handle, self.context, self.driver, self.jit, self.ended = handle, context, driver, jit, None

    @classmethod
    def load(cls, image: bytes | str | os.PathLike[str], options: dict[str | int, Any] | None = None, *,
             context: Context | None = None, driver: Driver | None = None) -> Module:
        """Load cubin, PTX or fatbin (bytes, or a path) into ``context`` (default: the current one),
        with JIT options by name (``{"OPTIMIZATION_LEVEL": 4, "MAX_REGISTERS": 64}``)."""
        ctx, run = Context.target(context, "cuModuleLoadDataEx", driver=driver)
        drv = ctx.driver
        buf, raw = _image(image)
        jit = _JitOptions(options)
        out = ffi.new("CUmodule *")
        rc = run(drv.cuModuleLoadDataEx, out, buf, jit.count, jit.keys, jit.values)
        if rc:
            raise _load_error(drv, rc, "cuModuleLoadDataEx", raw, jit)
        return cls(out[0], ctx, drv, jit.result())

    def parents(self) -> tuple[Resource, ...]:
        return (self.context,)

    def describe(self) -> str:
        return f"module {handle_int(self.handle):#x}"

    def _release(self) -> int:
        return self.context.call(self.driver.cuModuleUnload, self.handle)

    def unload(self) -> None:
        self.close()

    def get_function(self, name: str) -> Function:
        self.check("cuModuleGetFunction")
        out = ffi.new("CUfunction *")
        self.driver.check(self.context.call(self.driver.cuModuleGetFunction, out, self.handle, name.encode()),
                          "cuModuleGetFunction")
        return Function(out[0], self.driver, name, owner=self, context=self.context)

    def get_global(self, name: str) -> GlobalView:
        """A device view of a ``__device__`` variable: (address, size) with cuproc's copy/memset."""
        self.check("cuModuleGetGlobal")
        ptr, size = ffi.new("CUdeviceptr *"), ffi.new("size_t *")
        self.driver.check(self.context.call(self.driver.cuModuleGetGlobal, ptr, size, self.handle, name.encode()),
                          "cuModuleGetGlobal")
        return GlobalView(int(ptr[0]), size[0], self, self.context)

    def __repr__(self) -> str:
        return f"<cuproc.Module {handle_int(self.handle):#x}{' ' + self.ended if self.ended else ''}>"


class Linker(Resource):
    """JIT linking (cuLinkCreate / cuLinkAddData / cuLinkAddFile / cuLinkComplete)."""

    _release_call = "cuLinkDestroy"
    _ended_word = "destroyed"

    _TYPES = {"ptx": "CU_JIT_INPUT_PTX", "cubin": "CU_JIT_INPUT_CUBIN", "fatbin": "CU_JIT_INPUT_FATBINARY",
              "object": "CU_JIT_INPUT_OBJECT", "library": "CU_JIT_INPUT_LIBRARY"}

    def __init__(self, options: dict[str | int, Any] | None = None, *, driver: Driver | None = None) -> None:
        self.driver = drv = get_driver(driver)
        self._jit = _JitOptions(options)
        out = ffi.new("CUlinkState *")
        drv.checked.cuLinkCreate(self._jit.count, self._jit.keys, self._jit.values, out)
        self.handle = out[0]
        self._keep: list[Any] = []
        self.ended = None

    def describe(self) -> str:
        return f"linker {handle_int(self.handle):#x}"

    def _release(self) -> int:
        return self.driver.cuLinkDestroy(self.handle)

    def _input(self, kind: str) -> int:
        return ffi.typeof("CUjitInputType").relements[self._TYPES[kind]]

    def add_data(self, data: bytes | str, kind: str = "ptx", name: str = "input") -> Linker:
        self.check("cuLinkAddData")
        buf, raw = _image(data.encode() if isinstance(data, str) else data)
        self._keep.append(buf)
        rc = self.driver.cuLinkAddData(self.handle, self._input(kind), buf, len(raw), name.encode(), 0,
                                       ffi.NULL, ffi.NULL)
        if rc:
            raise _load_error(self.driver, rc, "cuLinkAddData", raw, self._jit)
        return self

    def add_file(self, path: str | os.PathLike[str], kind: str | None = None) -> Linker:
        self.check("cuLinkAddFile")
        kind = kind or {".ptx": "ptx", ".cubin": "cubin", ".fatbin": "fatbin", ".o": "object",
                        ".a": "library"}[Path(path).suffix]
        rc = self.driver.cuLinkAddFile(self.handle, self._input(kind), os.fspath(path).encode(), 0, ffi.NULL,
                                       ffi.NULL)
        if rc:
            raw = Path(path).read_bytes() if Path(path).is_file() else b""   # the error names a missing file
            raise _load_error(self.driver, rc, "cuLinkAddFile", raw, self._jit)
        return self

    def complete(self) -> tuple[bytes, JitResult]:
        """Link; returns (cubin bytes, JIT result with wall time and logs).  The linker stays usable
        for nothing else: close it afterwards (the cubin is already copied out)."""
        self.check("cuLinkComplete")
        cubin, size = ffi.new("void **"), ffi.new("size_t *")
        rc = self.driver.cuLinkComplete(self.handle, cubin, size)
        if rc:
            raise _load_error(self.driver, rc, "cuLinkComplete", b"", self._jit)
        return bytes(ffi.buffer(cubin[0], size[0])), self._jit.result()


class Library(Resource):
    """Context-independent code (cuLibraryLoadData): load once, launch in whatever context is current.

    Without ``cuLibrary*`` at the requested version (before 12.0) it keeps the image
    and loads a Module into each context the first time a kernel is asked for there;
    those modules (and so their contexts) are held until the library is unloaded.
    """

    _release_call = "cuLibraryUnload"
    _ended_word = "unloaded"

    def __init__(self, image: bytes | str | os.PathLike[str], options: dict[str | int, Any] | None = None, *,
                 driver: Driver | None = None) -> None:
        self.driver = drv = get_driver(driver)
        self._buf, self._raw = _image(image)
        self._options = options
        self.context_independent = drv.has("cuLibraryLoadData", newer_driver_features=False)
        self._modules: dict[int, Module] = {}
        self._modules_lock = _fork.lock()
        self.handle = None
        self.jit: JitResult | None = None
        if self.context_independent:
            jit = _JitOptions(options)
            out = ffi.new("CUlibrary *")
            rc = drv.cuLibraryLoadData(out, self._buf, jit.keys, jit.values, jit.count, ffi.NULL, ffi.NULL, 0)
            if rc:
                raise _load_error(drv, rc, "cuLibraryLoadData", self._raw, jit)
            self.handle = out[0]
            self.jit = jit.result()
        self.ended = None

    def describe(self) -> str:
        return f"library {handle_int(self.handle):#x}" if self.handle is not None else "library (per-context modules)"

    def _release(self) -> int:
        rc = 0
        with self._modules_lock:
            modules, self._modules = list(self._modules.values()), {}
        for mod in modules:
            try:
                mod.close()
            except CudaError as exc:
                rc = rc or exc.code
        if self.context_independent:
            rc = self.driver.cuLibraryUnload(self.handle) or rc
        return rc

    def unload(self) -> None:
        self.close()

    def module_for(self, context: Context) -> Module:
        """The per-context module standing in for this library where cuLibrary* is not used."""
        self.check("cuModuleLoadDataEx")
        with self._modules_lock:
            for key in [k for k, m in self._modules.items() if m.closed]:   # contexts that ended since
                del self._modules[key]
            mod = self._modules.get(id(context))
            if mod is None or mod.context is not context:
                mod = self._modules[id(context)] = Module.load(self._raw, self._options, context=context)
            return mod

    def get_kernel(self, name: str) -> Kernel:
        self.check("cuLibraryGetKernel")
        if not self.context_independent:
            return Kernel(None, self, name)
        out = ffi.new("CUkernel *")
        self.driver.checked.cuLibraryGetKernel(out, self.handle, name.encode())
        return Kernel(out[0], self, name)

    def get_global(self, name: str, *, context: Context | None = None) -> GlobalView:
        """The ``__device__`` variable in ``context`` (default: the current one)."""
        ctx, run = Context.target(context, "cuLibraryGetGlobal", driver=self.driver)
        if not self.context_independent:
            return self.module_for(ctx).get_global(name)
        self.check("cuLibraryGetGlobal")
        ptr, size = ffi.new("CUdeviceptr *"), ffi.new("size_t *")
        self.driver.check(run(self.driver.cuLibraryGetGlobal, ptr, size, self.handle, name.encode()),
                          "cuLibraryGetGlobal")
        return GlobalView(int(ptr[0]), size[0], self, ctx)

    def get_managed(self, name: str) -> tuple[int, int]:
        """(address, size) of a ``__managed__`` variable (cuLibraryGetManaged)."""
        self.check("cuLibraryGetManaged")
        ptr, size = ffi.new("CUdeviceptr *"), ffi.new("size_t *")
        self.driver.checked.cuLibraryGetManaged(ptr, size, self.handle, name.encode())
        return int(ptr[0]), size[0]


_FUNC_ERROR_END = result_code("CUDA_ERROR_INVALID_VALUE")


class Function(Resource):
    """A launchable function: a CUfunction of a module (bound to its context) or a library's CUkernel
    (``context`` None: it launches in the current context).  Holds its owner; refuses use once the
    owner or the context ended."""

    # Slots: the one-shot launch's C front reads launch_cache and launch_last at their offsets; a
    # __dict__ as before for everything else (a user's own attributes, vars(), mock.patch.object).
    __slots__ = ("handle", "name", "owner", "kernel", "context", "launch_cache", "launch_last", "__dict__")

    def __init__(self, handle: Any, driver: Driver, name: str, *, owner: Resource, context: Context | None = None,
                 kernel: Any = None) -> None:
        self.handle, self.driver, self.name, self.owner, self.kernel = handle, driver, name, owner, kernel
        self.context = context
        self.ended = None
        self.launch_cache: dict[Any, Any] = {}   # one-shot launches by shape (cuproc.launch.launch)
        # the C front's last hit, (key, entry) of launch_cache: taken without building the key
        self.launch_last: tuple | None = None

    def parents(self) -> tuple[Resource, ...]:
        return (self.owner, self.context) if self.context is not None else (self.owner,)

    def describe(self) -> str:
        return f"function {self.name}"

    def _call(self, call: str, *args: Any) -> None:
        self.check(call)
        self.driver.check(call_in(self.context, getattr(self.driver, call), *args), call)

    @staticmethod
    def _attr_enum(attr: str | int) -> int:
        if isinstance(attr, str):
            key = attr if attr.startswith("CU_FUNC_ATTRIBUTE_") else "CU_FUNC_ATTRIBUTE_" + attr.upper()
            return ffi.typeof("CUfunction_attribute").relements[key]
        return attr

    def attribute(self, attr: str | int) -> int:
        out = ffi.new("int *")
        self._call("cuFuncGetAttribute", out, self._attr_enum(attr), self.handle)
        return out[0]

    def set_attribute(self, attr: str | int, value: int) -> None:
        self._call("cuFuncSetAttribute", self.handle, self._attr_enum(attr), value)
    @property
    def max_threads_per_block(self) -> int:
        return self.attribute("MAX_THREADS_PER_BLOCK")

    @property
    def num_registers(self) -> int:
        return self.attribute("NUM_REGS")

    @property
    def shared_size_bytes(self) -> int:
        return self.attribute("SHARED_SIZE_BYTES")

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.attribute("MAX_DYNAMIC_SHARED_SIZE_BYTES")

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        self.set_attribute("MAX_DYNAMIC_SHARED_SIZE_BYTES", value)

    def set_cache_config(self, config: str | int) -> None:
        if isinstance(config, str):
            key = config if config.startswith("CU_FUNC_CACHE_") else "CU_FUNC_CACHE_" + config.upper()
            config = ffi.typeof("CUfunc_cache").relements[key]
        self._call("cuFuncSetCacheConfig", self.handle, config)

    def max_active_blocks_per_sm(self, block_size: int, dynamic_shared: int = 0) -> int:
        out = ffi.new("int *")
        self._call("cuOccupancyMaxActiveBlocksPerMultiprocessor", out, self.handle, block_size, dynamic_shared)
        return out[0]

    def suggested_block_size(self, dynamic_shared: int = 0, block_size_limit: int = 0) -> tuple[int, int]:
        """(minimum grid size for full occupancy, block size) from cuOccupancyMaxPotentialBlockSize."""
        grid, block = ffi.new("int *"), ffi.new("int *")
        self._call("cuOccupancyMaxPotentialBlockSize", grid, block, self.handle, ffi.NULL, dynamic_shared,
                   block_size_limit)
        return grid[0], block[0]

    def param_info(self) -> list[tuple[int, int]] | None:
        """[(offset, size)] of each parameter as the driver reports it (cuFuncGetParamInfo /
        cuKernelGetParamInfo), or None where the driver cannot say."""
        if self.kernel is not None and self.driver.has("cuKernelGetParamInfo"):
            call, target = "cuKernelGetParamInfo", self.kernel
        elif self.driver.has("cuFuncGetParamInfo"):
            call, target = "cuFuncGetParamInfo", self.handle
        else:
            return None
        self.check(call)
        fn = getattr(self.driver, call)
        out, offset, size = [], ffi.new("size_t *"), ffi.new("size_t *")
        while True:
            rc = call_in(self.context, fn, target, len(out), offset, size)
            if rc == _FUNC_ERROR_END:      # the index past the last parameter
                return out
            self.driver.check(rc, call)    # anything else is an error, not the end of the list
            out.append((offset[0], size[0]))

    def launch_target(self) -> Function:
        """What a launch binds to: this function (a per-context Kernel answers its current context's)."""
        return self

    def prepare(self, signature: Any, grid: Any = 1, block: Any = 1, *, shared_mem: int = 0,
                stream: Any = None, convention: str = "buffer", entry: str | None = None) -> Any:
        """Bind signature, grid, block and stream once; returns the launch function for them.

        ``run = fn.prepare(["float*", "int", "float"], grid, block)`` then ``run(buf, n, x)``
        per launch.  ``run.prepared`` is the PreparedLaunch (entry, convention, packed block).
        """
        from .launch import PreparedLaunch
        return PreparedLaunch(self, signature, grid, block, shared_mem=shared_mem, stream=stream,
                              convention=convention, entry=entry).launch

    # fn.launch(grid, block, args, signature=..., stream=...): cuproc.launch.launch itself, as a method
    # (no frame in between: a one-shot launch in a loop pays for every call it makes).
    launch = _one_shot_launch

    def __repr__(self) -> str:
        return f"<cuproc.Function {self.name}>"


class Kernel(Function):
    """A library kernel.  Launches in the current context; ``function()`` gives that context's CUfunction."""

    def __init__(self, handle: Any, library: Library, name: str) -> None:
        self.library = library
        self._per_context: dict[int, Function] = {}
        if handle is None:   # no cuLibrary: stands for the module loaded in each context
            super().__init__(None, library.driver, name, owner=library)
        else:
            super().__init__(ffi.cast("CUfunction", handle), library.driver, name, owner=library, kernel=handle)

    def function(self, context: Context | None = None) -> Function:
        """This kernel's CUfunction in ``context`` (default: the current one), via cuKernelGetFunction or
        the per-context module.  The Function holds this kernel and that context."""
        self.check("cuKernelGetFunction")
        ctx, run = Context.target(context, "cuKernelGetFunction", driver=self.driver)
        if self.kernel is None:     # per-context module: one Function per context, not one per launch
            found = self._per_context.get(id(ctx))
            if found is None or found.context is not ctx or found.closed:
                found = self._per_context[id(ctx)] = self.library.module_for(ctx).get_function(self.name)
            return found
        out = ffi.new("CUfunction *")
        self.driver.check(run(self.driver.cuKernelGetFunction, out, self.kernel), "cuKernelGetFunction")
        return Function(out[0], self.driver, self.name, owner=self, context=ctx)

    def launch_target(self) -> Function:
        return self if self.kernel is not None else self.function()


__all__ = ["Function", "JitResult", "Kernel", "Library", "Linker", "Module"]
