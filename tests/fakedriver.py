"""A stateful fake CUDA driver: tests/fakedriver.c, built with the machine's C compiler.

Where ``simdriver`` answers symbol lookups, this one keeps state: devices, per-thread context
stacks, primary contexts, memory with real bytes, pools, streams, events, modules, libraries,
launches.  It exists to test cuproc's object layer on a machine without a GPU, and above all to
turn what would be a crash on a real driver into a number a test can assert is 0:

* ``stale_count()`` -- uses of a destroyed, unknown or wrong-kind handle, or of a device pointer
  outside every live allocation (``stale_calls()`` names the last 16 calls);
* ``binding_errors()`` -- operations with no (or a destroyed) context current, and launches and
  event records on the default stream of another context's function or event, which the real
  driver refuses with CUDA_ERROR_INVALID_HANDLE (``binding_calls()``): cuproc's first attempt
  may meet these, and its second attempt binds the right context;
* ``misrouted_count()`` -- operations on memory of one context that run in whichever context is
  current (a synchronous copy or memset, an asynchronous one on the default stream) made while
  another context is current (``misrouted_calls()``).  The real driver (580) carries them out on
  the *current* context's default stream, unordered with the memory's own context: on an H200 a
  memset of a created context's buffer made with the primary context current, then the buffer's
  free and its context's destruction, ended in CUDA_ERROR_LAUNCH_FAILED.  The fake does the same
  and records it; no cuproc call may make one;
* ``launch_mismatches()`` -- launches of ``fake_pair(a, b)`` with ``b != 3*a + 1``: the fake waits
  before reading the argument block, so callers that share one between threads are caught; and of
  ``fake_grid_pair(a, b)`` that break that rule or have a grid whose x is not ``a % 4 + 1`` (a
  launch made with another call's grid);
* ``last_launch()`` / ``last_launch_config()`` / ``last_shared_mem()`` -- the last launch's kernel and
  argument bytes, its grid, block and stream, and its dynamic shared memory size;
* ``unordered_frees()`` -- cuMemFreeAsync calls that free memory which asynchronous work on another
  stream may still use (``unordered_calls()``): a memset, copy or launch (a pointer into the memory
  in its argument block) not ordered before the free by running on the same stream, by a
  synchronize (stream, context, event, cuMemFree), by an event the freeing stream waited for, or by
  the legacy stream's implicit ordering with blocking streams.  Why: on an H200, an allocation on
  S1, a memset of it on S2 behind a long kernel, cuMemFreeAsync on S1 and cuStreamSynchronize(S1)
  let the pool release or reuse the memory, and S2's memset fails with CUDA_ERROR_ILLEGAL_ADDRESS (a
  sticky error).  The fake does all work at once, so it can only record the missing order;
* ``fork_violations()`` -- calls made in a child forked after ``cuInit``.
* ``calls()`` / ``call_count()`` -- the entry points called since ``clear_calls()``: which driver
  calls a cuproc operation makes, so that an extra query or sync shows on CPU.

Load it with ``cuproc.Driver(library=str(fake.path))``; the control functions below read the
same library instance (the dynamic loader opens one copy per file).

Choices made where the real driver is vaguer or more forgiving (the fake is strict on purpose):

* Calls that create or allocate need a live current context (CUDA_ERROR_INVALID_CONTEXT).  An
  operation on a stream, event, module or device allocation of another context, or a launch of its
  CUfunction on a named stream, is carried out as the real driver (580) does (measured with another
  context current: cuLaunchKernel on the function's stream, cuMemsetD8 and the synchronous copies,
  cuStreamSynchronize/Query, cuEventSynchronize, cuMemFree, cuMemFreeAsync, cuModuleUnload,
  cuStreamDestroy and cuEventDestroy all returned 0); with *no* context current it is a binding
  error (strict: not measured).  The default stream is always the current context's.  Queries of an explicit stream
  (priority, flags, context), function attributes and occupancy need no current context.
* Context independent: devices, primary contexts, cuCtxCreate/Destroy and the stack calls,
  libraries and kernels, the linker, pools, cuPointerGetAttribute, cuMemFreeHost,
  cuMemHostUnregister, cuMemcpyPeer (the contexts are arguments).
* cuCtxDestroy destroys everything of the context, pinned and registered host memory
  included (it stays mapped a while, so a numpy view does not crash, but freeing it again is a
  stale use).  Destroying a primary context with cuCtxDestroy is a stale use.
* cuDevicePrimaryCtxRelease without a retain is a stale use (an over-release).  With reuse on
  (below), every activation of a device's primary context has the same handle, as on a GPU; with
  it off, each gets a new one (so a handle kept past the last release is stale).
  cuDevicePrimaryCtxReset destroys everything made in the primary context but keeps
  the retains and the handle, as the driver documents ("resetting the primary context does not
  release it").
* cuInit is required first (CUDA_ERROR_NOT_INITIALIZED); ``reset()`` keeps it, and keeps the
  devices' default pools (new statistics), because cuproc initializes once per process.
* **Values are reused as the real driver reuses them** (the default): the handle of a destroyed
  stream, event, module, function, library, kernel, pool or context goes to the next object
  made, the most recently freed first (``handle_reuses()``), across ``reset()`` too; a device's
  primary context keeps one handle over all its activations; cuMemAlloc takes the most recently
  freed cuMemAlloc range that fits (``sync_reuses()``).  So a stale handle or address can name a
  live object, as on a GPU, and only cuproc's own identity rules keep a dead object from acting
  on a live one -- the class of bug this mode exists to show.  ``set_reuse(False)`` (or
  ``FAKEDRIVER_REUSE=0`` in the environment before the library loads) gives every object a new
  handle and every cuMemAlloc a new address, so that every stale use is counted: for the tests
  that assert a stale use is caught by the fake itself.
* Stream-ordered addresses come back in both modes, the way a real pool reuses them: a range
  freed by cuMemFreeAsync goes back to its pool, and the next allocation from that same pool
  (cuMemAllocAsync: the device's pool; cuMemAllocFromPoolAsync: the given one) that fits gets the
  most recently freed one (``async_reuses()`` counts it), so that a late second free of an
  address is seen (it frees the new allocation, whose own free is then stale).  Never across
  pools (so never across devices), and never a range freed by cuMemFree, by destroying or
  resetting its context (the pool keeps counting those as used, as on driver 580) or by
  destroying its pool.  Device addresses come
  from a reserved, inaccessible window (``device_window()``): dereferencing one on the host faults.
* Asynchronous work happens at once; cuLaunchHostFunc calls the function on the calling thread.
  Its order is still modelled, for ``unordered_frees()`` (see the top of fakedriver.c): work
  numbers per stream, vector clocks for event waits, the legacy stream ordered both ways with
  blocking streams (the per-thread stream counts as one, as the driver documents); synchronous
  memsets of device memory and device-to-device copies are legacy-stream work (they return
  before they are done, per CUDA's API synchronization behavior), copies with host memory on
  one side and no stream complete the legacy stream and the blocking streams.
* Every entry has the CUDA 13.0 ABI, and a few also an older one (a shim that translates to the
  13.0 one: cuGraphExecUpdate 10.2, cuStreamGetCaptureInfo 11.3, cuGraphGetEdges 10.0, for the
  graph layer at older requested versions); asked for an older variant than any implemented,
  cuGetProcAddress_v2 answers VERSION_NOT_SUFFICIENT rather than hand out a function of another
  signature.

Image format (``fake_image``)::

    FAKECUBIN
    kernel <name> <param size>[@<alignment>] ...
    global <name> <nbytes>
    managed <name> <nbytes>
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
C_SOURCE = Path(__file__).resolve().parent / "fakedriver.c"
GRAPHS_SOURCE = Path(__file__).resolve().parent / "fakedriver_graphs.c"   # #included by fakedriver.c
VMM_SOURCE = Path(__file__).resolve().parent / "fakedriver_vmm.c"         # #included by fakedriver.c
IPC_SOURCE = Path(__file__).resolve().parent / "fakedriver_ipc.c"         # #included by fakedriver.c
GREEN_SOURCE = Path(__file__).resolve().parent / "fakedriver_green.c"     # #included by fakedriver.c
ARRAYS_SOURCE = Path(__file__).resolve().parent / "fakedriver_arrays.c"   # #included by fakedriver.c
ABI_VERSION = 13000
CFLAGS = ("-shared", "-fPIC", "-O1", "-Wall", "-pthread", "-std=gnu11", "-fvisibility=hidden")
LIVE_KINDS = ("context", "primary", "device_alloc", "host_alloc", "managed_alloc", "registered",
              "async_alloc", "global", "stream", "event", "module", "function", "library", "kernel",
              "link", "pool")


def _variants() -> dict[str, list[tuple[int, str]]]:
    """symbol -> [(version, entry point)] of its ABI variants in headers/, oldest first.

    Read from the header text (like simdriver), not from cuproc's registry, so that a mistake
    in the registry cannot hide behind the same mistake here."""
    text = (ROOT / "headers" / "cuda_pfn.h").read_text()
    versions: dict[str, set[int]] = {}
    for name, version, per_thread in re.findall(r"\(\*PFN_(\w+?)_v(\d+)(_ptds|_ptsz)?\)", text):
        if not per_thread:
            versions.setdefault(name, set()).add(int(version))
    return {name: [(v, name if k == 1 else f"{name}_v{k}") for k, v in enumerate(sorted(vs), start=1)]
            for name, vs in versions.items()}


def _error_names() -> list[tuple[int, str]]:
    text = (ROOT / "headers" / "cuda_types.h").read_text()
    body = text[text.index("enum cudaError_enum"):]
    body = body[:body.index("}")]
    return [(int(v), n) for n, v in re.findall(r"(CUDA_\w+) = (-?\d+)", body)]


def _implemented(c_text: str) -> list[str]:
    """Entry points fakedriver.c defines: functions named cu... returning CUresult."""
    return re.findall(r"^(?:static|EXPORT) CUresult (cu[A-Z]\w*)\(", c_text, re.M) + \
        re.findall(r"^MEMSET_\w+\((cu[A-Z]\w*),", c_text, re.M)


def tables(c_text: str) -> str:
    """fakedriver_tables.h: the lookup table and the error names.

    Raises RuntimeError when the C file implements an entry that is no variant of its symbol in headers/,
    or an older variant of a symbol whose CUDA 13.0 variant it does not implement (its signature would
    not be the one cuproc calls)."""
    variants = _variants()
    implemented = _implemented(c_text)
    rows, problems = [], []
    for entry in implemented:
        symbol = re.sub(r"_v\d+$", "", entry)
        current = [(v, e) for v, e in variants.get(symbol, []) if v <= ABI_VERSION]
        own = [v for v, e in current if e == entry]
        if not current:
            problems.append(f"{entry}: headers/ have no {symbol} at CUDA 13.0")
        elif not own:
            problems.append(f"{entry}: no variant of {symbol} up to CUDA 13.0 has that entry name")
        elif current[-1][1] not in implemented:
            problems.append(f"{entry}: CUDA 13.0 selects {current[-1][1]}, which is not implemented")
        else:
            rows.append((symbol, own[0], entry))
    if problems:
        raise RuntimeError("fakedriver.c does not match headers/: " + "; ".join(problems))
    out = ["/* generated by tests/fakedriver.py */", "static const struct entry entries[] = {"]
    out += [f'  {{"{symbol}", {version}, (void *){entry}}},' for symbol, version, entry in sorted(rows)]
    out += ["  {NULL, 0, NULL}};", "static const struct error_name error_names[] = {"]
    for code, name in _error_names():
        text = name.removeprefix("CUDA_ERROR_").removeprefix("CUDA_").lower().replace("_", " ")
        out.append(f'  {{{code}, "{name}", "{text} (fake driver)"}},')
    out.append("  {0, NULL, NULL}};")
    return "\n".join(out) + "\n"


def fake_image(kernels: dict[str, list[int]] | None = None, globals: dict[str, int] | None = None,
               managed: dict[str, int] | None = None, *, ptx: str | None = None) -> bytes:
    """A FAKECUBIN image (NUL-terminated) for cuModuleLoadData / cuLibraryLoadData / the linker.

    ``kernels``: name -> parameter sizes in bytes (each aligned to its size, 16 at most; a string
    ``"128@64"`` is a parameter of 128 bytes aligned to 64, such as a tensor map);
    ``globals``: ``__device__`` variables, name -> bytes; ``managed``: ``__managed__`` ones;
    ``ptx``: the image stands for PTX of that ISA (``"9.9"``: a ``.version 9.9`` line, which cuproc reads
    as it reads PTX's), which the fake's JIT (a CUDA 13.0 driver's: up to 9.0) refuses with
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION: a module at load; a library at load when loading eagerly, at the
    first lookup of a kernel or variable (or cuKernelGetFunction, cuFuncLoad) when lazily
    (``set_lazy_loading``), as the driver does."""
    lines = ["FAKECUBIN"] + ([f".version {ptx}"] if ptx is not None else [])   # as PTX declares its ISA
    lines += [" ".join(["kernel", name, *map(str, sizes)]) for name, sizes in (kernels or {}).items()]
    if ptx is not None:   # PTX names its kernels (.entry): a comment here, which cuproc reads as it reads PTX
        lines += [f"# .entry {name}" for name in (kernels or {})]
    lines += [f"global {name} {n}" for name, n in (globals or {}).items()]
    lines += [f"managed {name} {n}" for name, n in (managed or {}).items()]
    return ("\n".join(lines) + "\n").encode() + b"\0"


class FakeDriver:
    """A built fake driver library and its control functions (see the module docstring)."""

    image = staticmethod(fake_image)

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        lib = self._lib = ctypes.CDLL(str(path))
        for name in ("fake_stale_count", "fake_binding_errors", "fake_live", "fake_launch_count",
                     "fake_launch_mismatches", "fake_fork_violations", "fake_call_count", "fake_async_reuses",
                     "fake_sync_reuses", "fake_handle_reuses", "fake_unordered_frees", "fake_misrouted_count"):
            getattr(lib, name).restype = ctypes.c_long
        for name in ("fake_pool_used", "fake_device_bytes_live", "fake_device_window"):
            getattr(lib, name).restype = ctypes.c_ulonglong
        lib.fake_last_shared_mem.restype = ctypes.c_uint
        lib.fake_live.argtypes = [ctypes.c_char_p]
        lib.fake_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]

    @property
    def lib(self) -> ctypes.CDLL:
        """The library through ctypes (its exported cuInit, cuGetProcAddress_v2, fake_*)."""
        return self._lib

    def reset(self) -> None:
        """Destroy everything and clear the records (not while other threads use the fake); the virtual
        memory of fakedriver_vmm.c (reservations, mappings, physical allocations) and the green contexts
        of fakedriver_green.c too."""
        self._lib.fake_reset()
        self._lib.fake_vmm_reset()
        self._lib.fake_green_reset()

    def set_device_count(self, n: int) -> None:
        self._lib.fake_set_device_count(int(n))

    def stale_count(self) -> int:
        return self._lib.fake_stale_count()

    def stale_calls(self) -> list[str]:
        return self._names(self._lib.fake_stale_calls)

    def binding_errors(self) -> int:
        return self._lib.fake_binding_errors()

    def binding_calls(self) -> list[str]:
        return self._names(self._lib.fake_binding_calls)

    def calls(self) -> list[str]:
        """The entry points called since :meth:`clear_calls` (or ``reset()``), oldest first: all of
        them while there are at most 16 (``call_count()`` says how many), else the last 16."""
        return self._names(self._lib.fake_calls)

    def call_count(self) -> int:
        return self._lib.fake_call_count()

    def clear_calls(self) -> None:
        self._lib.fake_clear_calls()

    def live(self, kind: str) -> int:
        """Live objects of one kind, one of LIVE_KINDS ("context" counts created contexts,
        "primary" active primary ones, "pool" created pools, not the default ones)."""
        n = self._lib.fake_live(kind.encode())
        if n < 0:
            raise ValueError(f"unknown kind {kind!r}; one of {', '.join(LIVE_KINDS)}")
        return n

    def primary_refcount(self, dev: int) -> int:
        return self._lib.fake_primary_refcount(int(dev))

    def profiling(self) -> bool:
        """Between cuProfilerStart and cuProfilerStop."""
        return bool(self._lib.fake_profiling())

    def primary_active(self, dev: int) -> bool:
        return bool(self._lib.fake_primary_active(int(dev)))

    def pool_used(self, dev: int) -> int:
        """USED_MEM_CURRENT of the device's default pool."""
        return self._lib.fake_pool_used(int(dev))

    def device_bytes_live(self, dev: int) -> int:
        """Device memory held on dev: cuMemAlloc, stream-ordered and module/library variables."""
        return self._lib.fake_device_bytes_live(int(dev))

    def async_reuses(self) -> int:
        """Stream-ordered allocations that got back an address freed by cuMemFreeAsync into their
        pool (since ``reset()``)."""
        return self._lib.fake_async_reuses()

    def sync_reuses(self) -> int:
        """cuMemAlloc allocations that got back a freed cuMemAlloc range (since ``reset()``; reuse on)."""
        return self._lib.fake_sync_reuses()

    def handle_reuses(self) -> int:
        """Objects made under a dead object's handle (since ``reset()``; reuse on)."""
        return self._lib.fake_handle_reuses()

    def set_reuse(self, on: bool) -> None:
        """Hand handles and cuMemAlloc addresses out again as the real driver does (True, the default),
        or never (False: every stale handle or address is counted by ``stale_count()``)."""
        self._lib.fake_set_reuse(int(bool(on)))

    @property
    def reuse(self) -> bool:
        return bool(self._lib.fake_reuse())

    def set_lazy_loading(self, on: bool) -> None:
        """Load libraries lazily (True: CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2: their PTX is
        compiled at the first lookup) or eagerly, from now on.  At cuInit the fake reads
        CUDA_MODULE_LOADING, as the driver does."""
        self._lib.fake_set_lazy_loading(int(bool(on)))

    @property
    def lazy_loading(self) -> bool:
        return bool(self._lib.fake_lazy_loading())

    def launch_count(self) -> int:
        return self._lib.fake_launch_count()

    def set_launch_pause(self, on: bool) -> None:
        """Launches pause while reading the argument block (the race detector); off for timing only."""
        self._lib.fake_set_launch_pause(1 if on else 0)

    def launch_mismatches(self) -> int:
        return self._lib.fake_launch_mismatches()

    def last_launch(self) -> tuple[str, bytes]:
        """(kernel name, packed argument bytes) of the last successful launch."""
        name = ctypes.create_string_buffer(256)
        args = ctypes.create_string_buffer(32768)
        n = self._lib.fake_last_launch(name, len(name), args, len(args))
        return name.value.decode(), args.raw[:n]

    def last_launch_config(self) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
        """(grid, block, stream handle as an int, 0 for the default stream) of the last successful launch."""
        dims = (ctypes.c_uint * 6)()
        stream = ctypes.c_size_t()
        self._lib.fake_last_launch_config(dims, ctypes.byref(stream))
        return tuple(dims[:3]), tuple(dims[3:]), stream.value  # type: ignore[return-value]

    def last_shared_mem(self) -> int:
        """The dynamic shared memory size of the last successful launch."""
        return self._lib.fake_last_shared_mem()

    def fork_violations(self) -> int:
        return self._lib.fake_fork_violations()

    def unordered_frees(self) -> int:
        """cuMemFreeAsync calls that freed memory another stream's work was not ordered before
        (since ``reset()``; see the module docstring)."""
        return self._lib.fake_unordered_frees()

    def unordered_calls(self) -> list[str]:
        return self._names(self._lib.fake_unordered_calls)

    def misrouted_count(self) -> int:
        """Operations on memory of one context run in another, current one (since ``reset()``; see the
        module docstring)."""
        return self._lib.fake_misrouted_count()

    def misrouted_calls(self) -> list[str]:
        return self._names(self._lib.fake_misrouted_calls)

    def clear_misrouted(self) -> None:
        """Forget the misrouted calls recorded so far (for a test that makes one on purpose)."""
        self._lib.fake_clear_misrouted()

    def fail(self, call: str, code: int, count: int = 1) -> None:
        """The next ``count`` calls of ``call`` (C base name, "cuMemFree") return ``code`` and do
        nothing; ``count=-1``: every call until cleared; ``count=0``: clear."""
        if self._lib.fake_fail(call.encode(), int(code), int(count)) != 0:
            raise RuntimeError("too many failure injections at once (32)")

    def device_window(self) -> int:
        """First address of the device address window (1 TiB or less from here)."""
        return self._lib.fake_device_window()

    def records(self) -> dict[str, object]:
        """The counters in one dict, for assertion messages."""
        return {"stale": self.stale_count(), "stale_calls": self.stale_calls(),
                "binding": self.binding_errors(), "binding_calls": self.binding_calls(),
                "unordered": self.unordered_frees(), "unordered_calls": self.unordered_calls(),
                "misrouted": self.misrouted_count(), "misrouted_calls": self.misrouted_calls(),
                "launch_mismatches": self.launch_mismatches(), "fork_violations": self.fork_violations()}

    @staticmethod
    def _names(function) -> list[str]:
        buf = ctypes.create_string_buffer(4096)
        function(buf, len(buf))
        return [n for n in buf.value.decode().split(",") if n]


def build(out_dir: Path) -> FakeDriver:
    """Compile fakedriver.c (once per content of it and of headers/) into out_dir and load it."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build the fake driver")
    c_text = C_SOURCE.read_text()
    graphs_text = GRAPHS_SOURCE.read_text()
    included = {source.name: source.read_text() for source in (VMM_SOURCE, IPC_SOURCE, GREEN_SOURCE, ARRAYS_SOURCE)}
    header = tables("\n".join([c_text, graphs_text, *included.values()]))
    tag = hashlib.sha256((c_text + graphs_text + "".join(included.values()) + header + " ".join(CFLAGS)).encode()
                         ).hexdigest()[:12]
    out_dir = Path(out_dir)
    lib = out_dir / f"libfakecuda-{tag}.so"
    if not lib.exists():
        work = out_dir / f"fakecuda-{tag}"
        work.mkdir(parents=True, exist_ok=True)
        (work / "fakedriver.c").write_text(c_text)
        (work / GRAPHS_SOURCE.name).write_text(graphs_text)
        for name, text in included.items():
            (work / name).write_text(text)
        (work / "fakedriver_tables.h").write_text(header)
        tmp = work / lib.name
        subprocess.run([cc, *CFLAGS, "-I", str(work), "-o", str(tmp), str(work / "fakedriver.c")],
                       check=True)
        tmp.replace(lib)  # atomic: a concurrent build never loads a half-written library
    return FakeDriver(lib)


def child_preamble(path: Path) -> str:
    """The start of a script a test runs in a fresh interpreter (tests/subproc.py): the checkout and tests/
    on ``sys.path``, cuproc imported, the fake driver at ``path`` reset as ``fake`` and made the default
    handle; what follows makes its own objects (indented by nothing: the caller dedents its own part)."""
    return (f"import os, sys\n"
            f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
            f"from pathlib import Path\n"
            f"from fakedriver import FakeDriver\n"
            f"import cuproc\n"
            f"fake = FakeDriver(Path({str(path)!r}))\n"
            f"fake.reset()\n"
            f"cuproc.set_default_driver(cuproc.Driver(library=str(fake.path)))\n")
