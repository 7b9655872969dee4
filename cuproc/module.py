"""Loading code: modules (cubin/PTX/fatbin), JIT linking, context-independent libraries, functions.

Policy
------
* **Data or file, said explicitly.**  ``Module.load_data`` / ``Library.load_data`` /
  ``Linker.add_data`` take the image itself: bytes (a cubin, fatbin or PTX), or a ``str`` of PTX text.
  ``Module.load_file`` / ``Library.load_file`` / ``Linker.add_file`` take a path.  ``Module.load`` and
  ``Library(...)`` take either, told apart by type only: bytes-like is data, a ``str`` or
  ``os.PathLike`` is a path -- never guessed from the contents (a ``str`` of PTX text given as a path is
  refused with a pointer to ``load_data``, not opened as a file name; a ``str`` given as data with one
  line and no ``.version`` directive is a path, refused with a pointer to ``load_file``).  What kind of
  image bytes are (ELF: cubin; the fatbin magic; a ``.version`` directive: PTX) is read from the bytes,
  where it cannot be wrong, to NUL-terminate PTX, to say what the code is in messages, and as
  ``Linker.add_data``'s default input kind (``kind=`` overrides).
* JIT info and error logs are always captured; a failed load raises with the
  error log in the message.  CUDA_ERROR_UNSUPPORTED_PTX_VERSION names the image, the PTX ISA it declares
  and the newest this driver accepts (:mod:`cuproc.ptx_isa`).
* **Lookups that fail say what is there.**  A kernel or variable that is not found raises
  :class:`~cuproc.errors.NotFoundError` naming the symbol and the image, with the module's or library's
  kernels where the driver can enumerate them (``driver.has("cuModuleEnumerateFunctions")`` /
  ``"cuLibraryEnumerateKernels"``, CUDA 12.4+).
* **Lazy loading.**  Under ``CUDA_MODULE_LOADING=LAZY`` (the default from CUDA 12.2) the driver may compile
  a module's PTX when a kernel is first asked for, and a library's it compiles then in both modes (driver
  580, under ``CUDA_MODULE_LOADING=EAGER`` too), so a load that succeeded can fail at ``get_kernel`` /
  ``get_function``: that error names the image, its PTX ISA and the newest ISA the driver accepts, and
  says why it came late as is true of the code and the mode (a library: its first lookup; a module: lazy
  loading, only when the driver runs lazily).
  ``eager=True`` (or ``load_eagerly()``) loads every function at once (cuFuncLoad, CUDA 12.4+), so
  such errors come where the code is loaded -- for a library whatever the mode; :func:`loading_mode` says
  which mode the driver runs.
* A :class:`Library` loads once and serves every context.  Where the handle
  lacks ``cuLibraryLoadData`` (drivers or requested versions before 12.0) the
  same object loads a :class:`Module` into each context it meets.
* Modules, libraries, linkers and functions are resources
  (:mod:`cuproc._resource`): a module holds its context, a function its
  module (or its library kernel and context); unloading refuses further use
  of everything that depended on it.  :class:`~cuproc.launch.Function` is defined with the launch code
  (its one-shot launch is a C front that reads its slots) and served from here too.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from . import _fork
from ._ffi import ffi
from ._resource import Resource
from ._support import get_driver, handle_int, invalid
from .context import Context
from .device_memory import GlobalView
from .driver import Driver
from .errors import CudaError, refusal, result_code
from .launch import Function

TYPE_CHECKING = False   # typing.TYPE_CHECKING, spelt so that the checkers see the import below
if TYPE_CHECKING:
    from .ptx_isa import PtxIsa

_LOG_SIZE = 1 << 14
_UNSUPPORTED_PTX = result_code("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
_ELF_MAGIC = b"\x7fELF"
_FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")   # the fatbin container nvcc -fatbin writes
_DATA_TYPES = (bytes, bytearray, memoryview)
# What a failed lookup means the code did not load (lazily, the JIT runs at the lookup), not "not there".
_LOAD_ERRORS = frozenset({"CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_PTX", "CUDA_ERROR_NO_BINARY_FOR_GPU",
                          "CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
                          "CUDA_ERROR_JIT_COMPILATION_DISABLED"})


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


# --------------------------------------------------------------------------- images

def _declared_kernels(raw: bytes) -> list[str]:
    """The kernel names an image declares where its bytes show them, in order: PTX's ``.entry`` (PTX text,
    or PTX stored uncompressed in a fatbin) and an ELF cubin's ``.text.<name>`` sections (a cubin, or one
    in a fatbin).  Compressed fatbin members show none."""
    import re   # here: only an eager load of a library that listed no kernel reads the image
    found = re.findall(rb"\.entry\s+([A-Za-z_$][\w$]*)", raw)
    if _ELF_MAGIC in raw:
        found += re.findall(rb"\x00\.text\.([A-Za-z_$][\w$]*)(?=\x00)", raw)
    return list(dict.fromkeys(m.decode() for m in found))


class _Image:
    """A module image ready for the driver: ``raw`` (PTX NUL-terminated) and its cffi view, and what messages
    say of it: ``source`` (the file it came from, or the name given with the data) and ``kind``."""

    __slots__ = ("raw", "buffer", "source", "kind", "ptx_isa")
    raw: bytes
    buffer: Any
    source: str
    kind: str
    ptx_isa: PtxIsa | None

    def __init__(self, raw: bytes, source: str | None) -> None:
        if raw[:4] == _ELF_MAGIC:
            kind, isa = "cubin", None
        elif raw[:4] == _FATBIN_MAGIC:
            kind, isa = "fatbin", None
        else:
            from .ptx_isa import ptx_isa_of   # here: a cubin or fatbin never needs the PTX ISA rules
            isa = ptx_isa_of(raw)
            kind = "ptx" if isa is not None else "image"   # "image": not one cuproc reads; the driver decides
        if kind == "ptx" and not raw.endswith(b"\0"):
            raw += b"\0"          # the driver reads PTX as a C string
        self.raw, self.buffer, self.kind, self.ptx_isa = raw, ffi.from_buffer(raw), kind, isa
        self.source = source if source is not None else f"{'PTX' if kind == 'ptx' else kind} data ({len(raw)} bytes)"

    @property
    def description(self) -> str:
        """``"PTX, ISA 9.0"``, ``"cubin"``, ``"fatbin"``: what the code is, for messages."""
        if self.ptx_isa is not None:
            return f"PTX, ISA {self.ptx_isa}"
        return "a module image" if self.kind == "image" else self.kind

    @classmethod
    def from_data(cls, data: Any, call: str, name: str | None, file_entry: str) -> _Image:
        """The image in ``data``: bytes-like as is, a ``str`` as PTX text.  A path is refused, naming
        ``file_entry`` (the entry point for files)."""
        if isinstance(data, str):
            if "\0" in data.rstrip("\0"):      # a terminating NUL is the C string's own; one inside is not
                raise ValueError(f"{call}: PTX text contains a NUL character; the driver would stop reading there")
            if "\n" not in data.strip():
                from .ptx_isa import ptx_isa_of   # here: only a one-line str needs the PTX rules
                if ptx_isa_of(data) is None:     # one line and no .version directive: a path, not PTX
                    raise ValueError(f"{call}: a str here is PTX text, and {data.strip()[:60]!r} is no PTX (one "
                                     f"line, no .version directive) but a file path: use {file_entry} for a "
                                     f"file, or pass the image as bytes")
            raw = data.encode()
        elif isinstance(data, _DATA_TYPES):
            raw = bytes(data)
        elif isinstance(data, os.PathLike):
            raise TypeError(f"{call} takes the image itself (bytes, or a str of PTX text), not the path "
                            f"{os.fspath(data)!r}: use {file_entry} for a file")
        else:
            raise TypeError(f"{call} takes the image as bytes (cubin, fatbin or PTX) or a str of PTX text, "
                            f"not {type(data).__name__}")
        if not raw.strip(b"\0"):
            raise ValueError(f"{call}: the image is empty")
        return cls(raw, name)

    @classmethod
    def from_file(cls, path: Any, call: str, data_entry: str) -> _Image:
        """The image in the file at ``path`` (a ``str`` or ``os.PathLike``).  A ``str`` that is PTX or other
        text rather than a path is refused, naming ``data_entry`` (the entry point for data)."""
        if isinstance(path, str):
            if "\n" in path or "\0" in path:   # no path anyone means: text given where a path goes
                shown = path.lstrip()[:40].replace("\n", "\\n")
                raise ValueError(f"{call}: a str is a file path here, and {shown!r}... is text, not a path: "
                                 f"pass PTX text (or any image) with {data_entry}, or as bytes")
        elif not isinstance(path, os.PathLike):
            raise TypeError(f"{call} takes a path (str or os.PathLike), not {type(path).__name__}")
        fspath = os.fspath(path)
        with open(fspath, "rb") as f:    # FileNotFoundError names the path
            raw = f.read()
        if not raw.strip(b"\0"):
            raise ValueError(f"{call}: {fspath} is empty")
        return cls(raw, fspath)

    @classmethod
    def from_either(cls, image: Any, call: str, data_entry: str, file_entry: str) -> _Image:
        """bytes-like: the image; ``str`` or ``os.PathLike``: its path (by type, never by contents)."""
        if isinstance(image, _DATA_TYPES):
            return cls.from_data(image, call, None, file_entry)
        if isinstance(image, (str, os.PathLike)):
            return cls.from_file(image, call, data_entry)
        raise TypeError(f"{call} takes the image as bytes or its path (str or os.PathLike), not "
                        f"{type(image).__name__}: use {data_entry} for PTX text in a str")


def _load_error(drv: Driver, rc: int, call: str, image: _Image | None, jit: _JitOptions | None) -> CudaError:
    extra = []
    if jit is not None:
        log = jit.result().error_log.strip()
        if log:
            extra.append(f"JIT error log:\n{log}")
    if rc == _UNSUPPORTED_PTX:
        from .ptx_isa import max_ptx_isa   # the one table of PTX ISA per CUDA version; only on error paths
        dv = drv.driver_version
        limit = max_ptx_isa(dv)
        isa = image.ptx_isa if image is not None else None
        extra.append(f"{image.source if image is not None else 'the code'} declares PTX ISA .version "
                     f"{isa if isa is not None else '(unknown)'}, this CUDA {dv} driver accepts up to PTX ISA "
                     f"{limit if limit is not None else '(unknown to cuproc: newer than it knows)'}: load a cubin "
                     f"for the device, rebuild with an older toolkit (or -arch for an older PTX ISA), or upgrade "
                     f"the driver")
    err = drv.error(rc, call)
    if extra:
        err = type(err)(err.code, call, name=err.name, description=err.description,
                        hint="; ".join(filter(None, [err.hint, *extra])))
    return err


def _with_hint(exc: CudaError, parts: list[str]) -> CudaError:
    """``exc`` again, its hint replaced (NOT_FOUND's generic one) or extended by ``parts``."""
    hint = "; ".join(filter(None, [exc.hint if exc.name != "CUDA_ERROR_NOT_FOUND" else "", *parts]))
    return type(exc)(exc.code, exc.call, name=exc.name, description=exc.description, hint=hint)


def loading_mode(driver: Driver | None = None) -> str | None:
    """``"lazy"`` or ``"eager"``: how the driver loads modules in this process (cuModuleGetLoadingMode,
    CUDA 11.7+), as ``CUDA_MODULE_LOADING`` set it before CUDA started (lazy is the default from 12.2);
    None where the driver cannot say."""
    drv = get_driver(driver)
    if not drv.has("cuModuleGetLoadingMode"):
        return None
    out = ffi.new("CUmoduleLoadingMode *")
    drv.checked.cuModuleGetLoadingMode(out)
    return {1: "eager", 2: "lazy"}.get(int(out[0]))


class _CodeMessages:
    """What a Module and a Library say of their code when a lookup fails (see the module's policy).
    ``code_name`` names the code (its file, a program name), ``code_description`` what it is."""

    code_name = "module image"
    code_description = "a module image"
    driver: Driver

    def _describe(self, image: _Image) -> None:
        self.code_name, self.code_description = image.source, image.description

    def _lowered(self, name: str) -> str:
        """The driver's name for ``name`` (here: itself; compiled code maps name expressions)."""
        if not isinstance(name, str):
            raise TypeError(f"a kernel or variable name is a str, not {type(name).__name__}")
        return name

    def _shown(self, lowered: str) -> str:
        """A driver-level name as the user would write it (compiled code shows its name expression)."""
        return lowered

    def _name_hints(self, name: str, what: str) -> list[str]:
        """What to try when ``name`` is not there."""
        if what != "kernel" or name.startswith("_Z"):
            return []
        return [f"a C++ kernel's driver name is mangled (_Z...): declare it extern \"C\", give the mangled name, "
                f"or compile it with cuproc.Program and name_expressions=[{name!r}]"]

    def _lookup_error(self, exc: CudaError, what: str, name: str, lowered: str,
                      names: Callable[[], list[str] | None] | None) -> CudaError:
        """``exc`` (a failed lookup of ``name``) with a hint that says what is there and what to do."""
        parts = []
        if exc.name == "CUDA_ERROR_NOT_FOUND":
            low = f" (lowered: {lowered})" if lowered != name else ""
            parts.append(f"{self.code_name} ({self.code_description}) has no {what} {name!r}{low}")
            found = None
            if names is not None:
                try:
                    found = names()
                except Exception:  # noqa: BLE001 - listing is a courtesy; it must never hide the error
                    found = None
            if found is not None:
                parts.append(f"its kernels: {', '.join(self._shown(n) for n in found) or 'none'}")
            parts += self._name_hints(name, what)
        elif exc.name in _LOAD_ERRORS:
            parts.append(self._load_hint(f"when {what} {name!r} was first asked for"))
        else:
            return exc
        return _with_hint(exc, parts)

    def _late_load(self) -> tuple[str, str]:
        """(why a load error came at a lookup, what brings it to the load) for a module: lazy loading, when
        the driver runs it; under eager loading a module's code is JIT-compiled at load, and nothing more is
        known of a late error."""
        try:
            lazy = loading_mode(self.driver) == "lazy"
        except Exception:  # noqa: BLE001 - explaining an error must never hide it
            lazy = False
        if not lazy:
            return "", ""
        return (" (under lazy loading, CUDA_MODULE_LOADING=LAZY and the default from CUDA 12.2, the driver "
                "JIT-compiles code then, not at load)",
                "; load with eager=True (or set CUDA_MODULE_LOADING=EAGER) to see such errors at load")

    def _load_hint(self, when: str, *, late: bool = True) -> str:
        """What a load error says: the code, its PTX ISA (in ``code_description``), the newest ISA this driver
        accepts and what to do; ``late``: it surfaced at a lookup, so say why (:meth:`_late_load`)."""
        from .ptx_isa import max_ptx_isa
        drv = self.driver.driver_version
        limit = max_ptx_isa(drv)
        why, advice = self._late_load() if late else ("", "")
        return (f"{self.code_name} ({self.code_description}) failed to load {when}{why}; this CUDA {drv} driver "
                f"accepts PTX up to ISA {limit if limit is not None else '(unknown to cuproc: newer than it knows)'}"
                f". Load a cubin for the device (Program.compile(target='cubin')) or PTX of an ISA the driver "
                f"accepts{advice}")

    def _eager_error(self, exc: CudaError) -> CudaError:
        """``exc`` from loading eagerly (enumerating, cuKernelGetFunction, cuFuncLoad): a load error names
        the code; anything else is as the driver said."""
        if exc.name not in _LOAD_ERRORS:
            return exc
        return _with_hint(exc, [self._load_hint("when it was loaded eagerly", late=False)])


def _cannot_load_eagerly(driver: Driver, call: str, *, library: bool = False) -> CudaError:
    # CUDA_MODULE_LOADING=EAGER brings a module's JIT errors to its load, not a library's (driver 580)
    instead = ("ask for each kernel (get_kernel) right after loading instead, or load it as a Module under "
               "CUDA_MODULE_LOADING=EAGER" if library else "set CUDA_MODULE_LOADING=EAGER before CUDA starts instead")
    return refusal(call, f"loading eagerly needs {call} and the enumeration of kernels (a CUDA 12.4 driver); "
                         f"this driver is {driver.driver_version}: {instead}", code_name="CUDA_ERROR_NOT_SUPPORTED")


# --------------------------------------------------------------------------- modules

class Module(_CodeMessages, Resource):
    """A module loaded into a context (cuModuleLoadDataEx), which it holds.

    ``unload()``/``close()`` (idempotent) or dropping it -- once no Function of it
    is left -- unloads it.  Its functions and globals refuse use afterwards.
    """

    _release_call = "cuModuleUnload"
    _ended_word = "unloaded"

    def __init__(self, handle: Any, context: Context, driver: Driver, jit: JitResult | None,
                 image: _Image | None = None) -> None:
        self.handle, self.context, self.driver, self.jit, self.ended = handle, context, driver, jit, None
        if image is not None:
            self._describe(image)

    @classmethod
    def load(cls, image: bytes | bytearray | memoryview | str | os.PathLike[str],
             options: dict[str | int, Any] | None = None, *, context: Context | None = None,
             driver: Driver | None = None, eager: bool = False) -> Module:
        """Load a cubin, PTX or fatbin into ``context`` (default: the current one), with JIT options by name
        (``{"OPTIMIZATION_LEVEL": 4, "MAX_REGISTERS": 64}``).

        ``image``: bytes (the image), or a path (``str`` or ``os.PathLike``) -- by type: a ``str`` is always
        a path; PTX text goes to :meth:`load_data`.  ``eager=True`` loads every function now (see
        :meth:`load_eagerly`)."""
        img = _Image.from_either(image, "cuModuleLoadDataEx", "Module.load_data", "Module.load_file")
        return cls._load_image(img, options, context, driver, eager)

    @classmethod
    def load_data(cls, data: bytes | bytearray | memoryview | str, options: dict[str | int, Any] | None = None, *,
                  context: Context | None = None, driver: Driver | None = None, eager: bool = False,
                  name: str | None = None) -> Module:
        """Load the image in ``data``: bytes (cubin, fatbin or PTX) or a ``str`` of PTX text.  ``name`` is what
        messages call it (default: its kind and size).  As :meth:`load` otherwise."""
        img = _Image.from_data(data, "cuModuleLoadDataEx", name, "Module.load_file")
        return cls._load_image(img, options, context, driver, eager)

    @classmethod
    def load_file(cls, path: str | os.PathLike[str], options: dict[str | int, Any] | None = None, *,
                  context: Context | None = None, driver: Driver | None = None, eager: bool = False) -> Module:
        """Load the cubin, PTX or fatbin file at ``path``.  As :meth:`load` otherwise."""
        img = _Image.from_file(path, "cuModuleLoadDataEx", "Module.load_data")
        return cls._load_image(img, options, context, driver, eager)

    @classmethod
    def _load_image(cls, image: _Image, options: dict[str | int, Any] | None, context: Context | None,
                    driver: Driver | None, eager: bool) -> Module:
        ctx, run = Context.target(context, "cuModuleLoadDataEx", driver=driver)
        drv = ctx.driver
        jit = _JitOptions(options)
        out = ffi.new("CUmodule *")
        rc = run(drv.cuModuleLoadDataEx, out, image.buffer, jit.count, jit.keys, jit.values)
        if rc:
            raise _load_error(drv, rc, "cuModuleLoadDataEx", image, jit)
        mod = cls(out[0], ctx, drv, jit.result(), image)
        if eager and loading_mode(drv) != "eager":
            try:
                mod.load_eagerly()
            except BaseException:
                mod.close()
                raise
        return mod

    def parents(self) -> tuple[Resource, ...]:
        return (self.context,)

    def describe(self) -> str:
        return f"module {handle_int(self.handle):#x}"

    def _release(self) -> int:
        return self.context.call(self.driver.cuModuleUnload, self.handle)

    def unload(self) -> None:
        self.close()

    def get_function(self, name: str) -> Function:
        """The kernel ``name`` (cuModuleGetFunction).  NotFoundError names it and lists the module's kernels
        where the driver can; under lazy loading a load error surfaces here and names the code."""
        lowered = self._lowered(name)
        self.check("cuModuleGetFunction")
        out = ffi.new("CUfunction *")
        rc = self.context.call(self.driver.cuModuleGetFunction, out, self.handle, lowered.encode())
        if rc:
            raise self._lookup_error(self.driver.error(rc, "cuModuleGetFunction"), "kernel", name, lowered,
                                     self.kernel_names) from None
        return Function(out[0], self.driver, name, owner=self, context=self.context)

    def get_global(self, name: str) -> GlobalView:
        """A device view of a ``__device__`` variable: (address, size) with cuproc's copy/memset
        (cuModuleGetGlobal)."""
        lowered = self._lowered(name)
        self.check("cuModuleGetGlobal")
        ptr, size = ffi.new("CUdeviceptr *"), ffi.new("size_t *")
        rc = self.context.call(self.driver.cuModuleGetGlobal, ptr, size, self.handle, lowered.encode())
        if rc:
            raise self._lookup_error(self.driver.error(rc, "cuModuleGetGlobal"), "variable", name, lowered,
                                     None) from None
        return GlobalView(int(ptr[0]), size[0], self, self.context)

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
        """The names (as the driver knows them) of the module's kernels, sorted; None where the driver
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
        """Load every function now (cuModuleEnumerateFunctions + cuFuncLoad, CUDA 12.4+): under lazy loading
        a JIT error then comes here instead of at a later lookup.  Returns how many functions there are."""
        drv = self.driver
        if not drv.has("cuFuncLoad"):
            raise _cannot_load_eagerly(drv, "cuFuncLoad")
        try:
            handles = self._functions()
            if handles is None:
                raise _cannot_load_eagerly(drv, "cuModuleEnumerateFunctions")
            for handle in handles:
                drv.check(self.context.call(drv.cuFuncLoad, handle), "cuFuncLoad")
        except CudaError as exc:
            raise self._eager_error(exc) from None
        return len(handles)

    def __repr__(self) -> str:
        return f"<cuproc.Module {handle_int(self.handle):#x}{' ' + self.ended if self.ended else ''}>"


class Linker(Resource):
    """JIT linking (cuLinkCreate / cuLinkAddData / cuLinkAddFile / cuLinkComplete)."""

    _release_call = "cuLinkDestroy"
    _ended_word = "destroyed"

    _TYPES = {"ptx": "CU_JIT_INPUT_PTX", "cubin": "CU_JIT_INPUT_CUBIN", "fatbin": "CU_JIT_INPUT_FATBINARY",
              "object": "CU_JIT_INPUT_OBJECT", "library": "CU_JIT_INPUT_LIBRARY"}
    _SUFFIXES = {".ptx": "ptx", ".cubin": "cubin", ".fatbin": "fatbin", ".o": "object", ".a": "library"}

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

    def _input(self, kind: str, call: str) -> int:
        if kind not in self._TYPES:
            raise invalid(call, f"kind={kind!r} is no input kind: expected one of {', '.join(self._TYPES)}")
        return ffi.typeof("CUjitInputType").relements[self._TYPES[kind]]

    def add_data(self, data: bytes | bytearray | memoryview | str, kind: str | None = None,
                 name: str = "input") -> Linker:
        """Add an input given as data (cuLinkAddData): bytes, or a ``str`` of PTX text; a file goes to
        :meth:`add_file`.  ``kind`` defaults from the bytes where they say it (:meth:`_kind_of`: ELF for the
        GPU is a cubin, the fatbin magic a fatbin, ...), else PTX; given, it wins.  ``name`` names it in the
        linker's log."""
        self.check("cuLinkAddData")
        if kind is not None:
            self._input(kind, "cuLinkAddData")   # a bad kind= is refused before the data is read
        if isinstance(data, str) and kind not in (None, "ptx"):
            raise TypeError(f"cuLinkAddData: a str is PTX text (kind='ptx'); {kind} input is bytes")
        image = _Image.from_data(data, "cuLinkAddData", name, "Linker.add_file")
        input_type = self._input(kind if kind is not None else self._kind_of(image), "cuLinkAddData")
        self._keep.append(image.buffer)
        rc = self.driver.cuLinkAddData(self.handle, input_type, image.buffer, len(image.raw), name.encode(), 0,
                                       ffi.NULL, ffi.NULL)
        if rc:
            raise _load_error(self.driver, rc, "cuLinkAddData", image, self._jit)
        return self

    @staticmethod
    def _kind_of(image: _Image) -> str:
        """The input kind the bytes say: ELF for the GPU (e_machine EM_CUDA, 190) a cubin, ELF of another
        machine a host object (with device code embedded), the fatbin magic a fatbin, an ``ar`` archive a
        library; anything else PTX (the driver then says if it is not)."""
        raw = image.raw
        if image.kind == "cubin":
            machine = int.from_bytes(raw[18:20], "little" if raw[5:6] != b"\x02" else "big") if len(raw) >= 20 else 190
            return "cubin" if machine == 190 else "object"
        if image.kind == "fatbin":
            return "fatbin"
        if raw.startswith(b"!<arch>\n"):
            return "library"
        return "ptx"

    def add_file(self, path: str | os.PathLike[str], kind: str | None = None) -> Linker:
        """Add the file at ``path`` (cuLinkAddFile); ``kind`` defaults from its suffix (.ptx, .cubin,
        .fatbin, .o, .a)."""
        self.check("cuLinkAddFile")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"cuLinkAddFile takes a path (str or os.PathLike), not {type(path).__name__}: "
                            f"use add_data for bytes or PTX text")
        fspath = os.fspath(path)
        if kind is None:
            suffix = os.path.splitext(fspath)[1]
            if suffix not in self._SUFFIXES:
                raise invalid("cuLinkAddFile", f"cannot tell the input kind of {fspath!r} from its suffix: pass "
                                               f"kind= (one of {', '.join(self._TYPES)})")
            kind = self._SUFFIXES[suffix]
        input_type = self._input(kind, "cuLinkAddFile")
        rc = self.driver.cuLinkAddFile(self.handle, input_type, fspath.encode(), 0, ffi.NULL, ffi.NULL)
        if rc:
            image = None
            if os.path.isfile(fspath):      # what the message says of it; a missing file is named by the driver
                with open(fspath, "rb") as f:
                    image = _Image(f.read(), fspath)
            raise _load_error(self.driver, rc, "cuLinkAddFile", image, self._jit)
        return self

    def complete(self) -> tuple[bytes, JitResult]:
        """Link; returns (cubin bytes, JIT result with wall time and logs).  The linker stays usable
        for nothing else: close it afterwards (the cubin is already copied out)."""
        self.check("cuLinkComplete")
        cubin, size = ffi.new("void **"), ffi.new("size_t *")
        rc = self.driver.cuLinkComplete(self.handle, cubin, size)
        if rc:
            raise _load_error(self.driver, rc, "cuLinkComplete", None, self._jit)
        return bytes(ffi.buffer(cubin[0], size[0])), self._jit.result()


class Library(_CodeMessages, Resource):
    """Context-independent code (cuLibraryLoadData): load once, launch in whatever context is current.

    Without ``cuLibrary*`` at the requested version (before 12.0) it keeps the image
    and loads a Module into each context the first time a kernel is asked for there;
    those modules (and so their contexts) are held until the library is unloaded.
    """

    _release_call = "cuLibraryUnload"
    _ended_word = "unloaded"

    def __init__(self, image: bytes | bytearray | memoryview | str | os.PathLike[str] | _Image,
                 options: dict[str | int, Any] | None = None, *, driver: Driver | None = None,
                 eager: bool = False) -> None:
        """Load ``image``: bytes (the image) or a path (``str`` or ``os.PathLike``), told apart by type as
        :meth:`Module.load` does (:meth:`load_data` takes PTX text).  ``eager=True`` loads every kernel into
        the current context now (:meth:`load_eagerly`)."""
        self.driver = drv = get_driver(driver)
        img = image if isinstance(image, _Image) else _Image.from_either(
            image, "cuLibraryLoadData", "Library.load_data", "Library.load_file")
        self._image = img
        self._describe(img)
        self._options = options
        self.context_independent = drv.has("cuLibraryLoadData", newer_driver_features=False)
        self._modules: dict[int, Module] = {}
        self._modules_lock = _fork.lock()
        self.handle = None
        self.jit: JitResult | None = None
        if self.context_independent:
            jit = _JitOptions(options)
            out = ffi.new("CUlibrary *")
            rc = drv.cuLibraryLoadData(out, img.buffer, jit.keys, jit.values, jit.count, ffi.NULL, ffi.NULL, 0)
            if rc:
                raise _load_error(drv, rc, "cuLibraryLoadData", img, jit)
            self.handle = out[0]
            self.jit = jit.result()
        self.ended = None
        # Even under CUDA_MODULE_LOADING=EAGER a library defers a JIT error to its first lookup (measured on
        # driver 580, 2026-11-29): eager=True loads it here whatever the mode (cheap when the driver did).
        if eager:
            try:
                self.load_eagerly()
            except BaseException:
                self.close()
                raise

    @classmethod
    def load_data(cls, data: bytes | bytearray | memoryview | str, options: dict[str | int, Any] | None = None, *,
                  driver: Driver | None = None, eager: bool = False, name: str | None = None) -> Library:
        """A library from the image in ``data``: bytes (cubin, fatbin or PTX) or a ``str`` of PTX text.
        ``name`` is what messages call it (default: its kind and size)."""
        return cls(_Image.from_data(data, "cuLibraryLoadData", name, "Library.load_file"), options, driver=driver,
                   eager=eager)

    @classmethod
    def load_file(cls, path: str | os.PathLike[str], options: dict[str | int, Any] | None = None, *,
                  driver: Driver | None = None, eager: bool = False) -> Library:
        """A library from the cubin, PTX or fatbin file at ``path``."""
        return cls(_Image.from_file(path, "cuLibraryLoadData", "Library.load_data"), options, driver=driver,
                   eager=eager)

    def _late_load(self) -> tuple[str, str]:
        """A library's code is JIT-compiled at its first lookup under CUDA_MODULE_LOADING=EAGER as under LAZY
        (measured on driver 580): only eager=True brings the error to the load."""
        return (" (the driver JIT-compiles a library's code at its first lookup, whatever CUDA_MODULE_LOADING "
                "says)", "; load with eager=True to see such errors at load")

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
                mod = self._modules[id(context)] = Module._load_image(self._image, self._options, context, None,
                                                                      False)
                mod.code_name, mod.code_description = self.code_name, self.code_description
            return mod

    def get_kernel(self, name: str) -> Kernel:
        """The kernel ``name`` (cuLibraryGetKernel).  NotFoundError names it and lists the library's kernels
        where the driver can; under lazy loading a load error surfaces here and names the code."""
        lowered = self._lowered(name)
        self.check("cuLibraryGetKernel")
        if not self.context_independent:
            return Kernel(None, self, lowered)
        out = ffi.new("CUkernel *")
        rc = self.driver.cuLibraryGetKernel(out, self.handle, lowered.encode())
        if rc:
            raise self._lookup_error(self.driver.error(rc, "cuLibraryGetKernel"), "kernel", name, lowered,
                                     self.kernel_names) from None
        return Kernel(out[0], self, lowered)   # the driver's name: per-context modules look it up by it

    def get_global(self, name: str, *, context: Context | None = None) -> GlobalView:
        """The ``__device__`` variable in ``context`` (default: the current one)."""
        lowered = self._lowered(name)
        ctx, run = Context.target(context, "cuLibraryGetGlobal", driver=self.driver)
        if not self.context_independent:
            return self.module_for(ctx).get_global(lowered)
        self.check("cuLibraryGetGlobal")
        ptr, size = ffi.new("CUdeviceptr *"), ffi.new("size_t *")
        rc = run(self.driver.cuLibraryGetGlobal, ptr, size, self.handle, lowered.encode())
        if rc:
            raise self._lookup_error(self.driver.error(rc, "cuLibraryGetGlobal"), "variable", name, lowered,
                                     None) from None
        return GlobalView(int(ptr[0]), size[0], self, ctx)

    def get_managed(self, name: str) -> tuple[int, int]:
        """(address, size) of a ``__managed__`` variable (cuLibraryGetManaged)."""
        lowered = self._lowered(name)
        self.check("cuLibraryGetManaged")
        ptr, size = ffi.new("CUdeviceptr *"), ffi.new("size_t *")
        rc = self.driver.cuLibraryGetManaged(ptr, size, self.handle, lowered.encode())
        if rc:
            raise self._lookup_error(self.driver.error(rc, "cuLibraryGetManaged"), "managed variable", name,
                                     lowered, None) from None
        return int(ptr[0]), size[0]

    def _kernels(self) -> list[Any] | None:
        """The library's CUkernels (cuLibraryGetKernelCount + cuLibraryEnumerateKernels, CUDA 12.4+), or
        None where the driver lacks them."""
        drv = self.driver
        if not self.context_independent or not (drv.has("cuLibraryGetKernelCount")
                                                and drv.has("cuLibraryEnumerateKernels")):
            return None
        self.check("cuLibraryEnumerateKernels")
        count = ffi.new("unsigned int *")
        drv.checked.cuLibraryGetKernelCount(count, self.handle)
        handles = ffi.new("CUkernel[]", count[0])
        drv.checked.cuLibraryEnumerateKernels(handles, count[0], self.handle)
        return list(handles)

    def kernel_names(self) -> list[str] | None:
        """The names (as the driver knows them) of the library's kernels, sorted (cuLibraryEnumerateKernels +
        cuKernelGetName, CUDA 12.4+); None where the driver cannot say."""
        handles = self._kernels()
        if handles is None or not self.driver.has("cuKernelGetName"):
            return None
        out = ffi.new("const char **")
        names = []
        for handle in handles:
            self.driver.checked.cuKernelGetName(out, handle)
            names.append(ffi.string(out[0]).decode())
        return sorted(names)

    def load_eagerly(self, context: Context | None = None) -> int:
        """Load every kernel into ``context`` (default: the current one) now (cuLibraryGetModule, then
        cuKernelGetFunction + cuFuncLoad of each, CUDA 12.4+), so that a JIT error comes here, not at a later
        lookup or launch.  Returns how many kernels there are."""
        self.check("cuFuncLoad")
        ctx, run = Context.target(context, "cuFuncLoad", driver=self.driver)
        if not self.context_independent:
            return self.module_for(ctx).load_eagerly()
        drv = self.driver
        if not drv.has("cuFuncLoad"):
            raise _cannot_load_eagerly(drv, "cuFuncLoad", library=True)
        out = ffi.new("CUfunction *")
        try:
            if drv.has("cuLibraryGetModule"):   # loads the library into the context now (12.0), JIT included
                drv.check(run(drv.cuLibraryGetModule, ffi.new("CUmodule *"), self.handle), "cuLibraryGetModule")
            handles = self._kernels()
            if handles is None:
                raise _cannot_load_eagerly(drv, "cuLibraryEnumerateKernels", library=True)
            if not handles:
                # Measured on an H200 (driver 580, 2026-11-29): a library of PTX the JIT refuses loads, lists no
                # kernel, and fails only at cuLibraryGetKernel -- even with CUDA_MODULE_LOADING=EAGER.  The image
                # names its kernels (PTX's .entry, also in a fatbin; a cubin's .text.<name>): asking for each
                # brings the error here, where eager=True promises it.
                for name in _declared_kernels(self._image.raw):
                    drv.check(run(drv.cuLibraryGetKernel, ffi.new("CUkernel *"), self.handle, name.encode()),
                              "cuLibraryGetKernel")
            for kernel in handles:
                drv.check(run(drv.cuKernelGetFunction, out, kernel), "cuKernelGetFunction")
                drv.check(run(drv.cuFuncLoad, out[0]), "cuFuncLoad")
        except CudaError as exc:
            raise self._eager_error(exc) from None
        return len(handles)


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
        the per-context module.  The Function holds this kernel and that context.  Under lazy loading the
        kernel loads into the context here: a load error names the library's code."""
        self.check("cuKernelGetFunction")
        ctx, run = Context.target(context, "cuKernelGetFunction", driver=self.driver)
        if self.kernel is None:     # per-context module: one Function per context, not one per launch
            found = self._per_context.get(id(ctx))
            if found is None or found.context is not ctx or found.closed:
                found = self._per_context[id(ctx)] = self.library.module_for(ctx).get_function(self.name)
            return found
        out = ffi.new("CUfunction *")
        rc = run(self.driver.cuKernelGetFunction, out, self.kernel)
        if rc:
            raise self.library._lookup_error(self.driver.error(rc, "cuKernelGetFunction"), "kernel", self.name,
                                             self.name, None) from None
        return Function(out[0], self.driver, self.name, owner=self, context=ctx)

    def launch_target(self) -> Function:
        return self if self.kernel is not None else self.function()


__all__ = ["Function", "JitResult", "Kernel", "Library", "Linker", "Module"]
