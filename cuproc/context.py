"""Contexts: created contexts, the context stack, and primary contexts.

Policy
------
* The driver keeps one context stack per host thread; cuproc keeps no copy of
  it.  :meth:`Context.current` asks the driver every time.
* :meth:`Context.create` uses whichever ``cuCtxCreate`` ABI the handle selected:
  v2 ``(pctx, flags, dev)``, v3 with execution-affinity parameters, or v4
  with ``CUctxCreateParams`` -- told apart by the selected typedef's arity.
* One Python object per created context handle, so that destroying it is
  seen by every buffer that holds it (:attr:`Context.alive`).
* Primary contexts are reference counted by the driver.  A
  :class:`PrimaryContext` releases exactly what it retained, never more,
  and a finalizer returns what is still held.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

from ._cffi_abi import ffi
from ._support import arity, get_driver, handle_int, invalid
from .device import Device
from .driver import Driver
from .errors import InvalidContextError, result_code

_CTX_ERROR = result_code("CUDA_ERROR_INVALID_CONTEXT")
_wrappers: weakref.WeakValueDictionary[int, Context] = weakref.WeakValueDictionary()
_wrappers_lock = threading.Lock()
_recent: list[Context | None] = [None]


class Context:
    """A CUDA context handle.  Owned when made by :meth:`create` (then :meth:`destroy` frees it)."""

    def __init__(self, handle: Any, *, driver: Driver | None = None, owned: bool = False) -> None:
        self.driver = get_driver(driver)
        self.handle = ffi.cast("CUcontext", handle)
        self.owned = owned
        self._destroyed = False
        self.primary_device: Any = None   # the CUdevice, when this is a primary context held alive

    # ---------------------------------------------------------------- lifetime
    @classmethod
    def create(cls, device: Device | int = 0, flags: int = 0, *, driver: Driver | None = None,
               exec_affinity: list[Any] | None = None, params: Any = None) -> Context:
        """cuCtxCreate with the ABI the handle selected; the new context becomes current."""
        drv = get_driver(driver if driver is not None else getattr(device, "driver", None))
        dev = device if isinstance(device, Device) else Device(device, driver=drv)
        out = ffi.new("CUcontext *")
        n = arity(drv, "cuCtxCreate")
        if n == 3:                                          # v2: (pctx, flags, dev)
            if exec_affinity or params is not None:
                raise invalid("cuCtxCreate", "this ABI (cuCtxCreate_v2) takes no affinity or create params")
            drv.checked.cuCtxCreate(out, flags, dev.handle)
        elif n == 5:                                        # v3: (pctx, paramsArray, numParams, flags, dev)
            array = ffi.new("CUexecAffinityParam[]", exec_affinity or []) if exec_affinity else ffi.NULL
            drv.checked.cuCtxCreate(out, array, len(exec_affinity or []), flags, dev.handle)
        else:                                               # v4: (pctx, CUctxCreateParams*, flags, dev)
            drv.checked.cuCtxCreate(out, params if params is not None else ffi.NULL, flags, dev.handle)
        ctx = cls(out[0], driver=drv, owned=True)
        with _wrappers_lock:
            _wrappers[handle_int(ctx.handle)] = ctx
        return ctx

    @classmethod
    def wrap(cls, handle: Any, *, driver: Driver | None = None) -> Context:
        """The one object for an existing handle: the owning object when cuproc created it; for a
        primary context, an object that holds one retain for as long as anything references it
        (streams and buffers made in it keep it alive); else a non-owning one."""
        key = handle_int(handle)
        existing = _wrappers.get(key)
        if existing is not None and not existing._destroyed:
            _recent[0] = existing
            return existing
        with _wrappers_lock:
            existing = _wrappers.get(key)
            if existing is not None and not existing._destroyed:
                return existing
            ctx = cls(handle, driver=driver)
            ctx._hold_if_primary()
            _wrappers[key] = ctx
            _recent[0] = ctx   # keep the last-used context object alive: alloc/free loops stay cheap
            return ctx

    def _hold_if_primary(self) -> None:
        drv = self.driver
        dev = ffi.new("CUdevice *")
        if _context_device(drv, self.handle, dev) != 0:
            return
        primary = ffi.new("CUcontext *")
        if drv.cuDevicePrimaryCtxRetain(primary, dev[0]) != 0:
            return
        if primary[0] == self.handle:
            self.primary_device = dev[0]
            self._hold = weakref.finalize(self, _release_all, drv, dev[0], [1])
        else:
            drv.cuDevicePrimaryCtxRelease(dev[0])

    def destroy(self) -> None:
        """cuCtxDestroy.  Buffers allocated in it become unusable (their memory went with it)."""
        if not self.owned:
            raise invalid("cuCtxDestroy", "this Context does not own its handle (adopted or primary); "
                                          "only contexts made by Context.create are destroyed here")
        if self._destroyed:
            raise invalid("cuCtxDestroy", "this context was already destroyed")
        self.driver.checked.cuCtxDestroy(self.handle)
        self._destroyed = True

    close = destroy

    @property
    def alive(self) -> bool:
        return not self._destroyed

    def _require_alive(self, call: str) -> None:
        if self._destroyed:
            raise InvalidContextError(_CTX_ERROR, call, hint="the context was destroyed: its memory, modules "
                                                             "and streams went with it")

    # ---------------------------------------------------------------- the stack
    @classmethod
    def current(cls, *, driver: Driver | None = None) -> Context | None:
        """The context current on this thread, as the driver says; None when there is none."""
        drv = get_driver(driver)
        out = ffi.new("CUcontext *")
        drv.checked.cuCtxGetCurrent(out)
        return None if out[0] == ffi.NULL else cls.wrap(out[0], driver=drv)

    def push(self) -> Context:
        self._require_alive("cuCtxPushCurrent")
        self.driver.checked.cuCtxPushCurrent(self.handle)
        return self

    @classmethod
    def pop(cls, *, driver: Driver | None = None) -> Context:
        """Pop this thread's current context and return it."""
        drv = get_driver(driver)
        out = ffi.new("CUcontext *")
        rc = drv.cuCtxPopCurrent(out)
        if rc == _CTX_ERROR:
            raise InvalidContextError(rc, "cuCtxPopCurrent",
                                      hint="this thread's context stack is empty: nothing to pop")
        drv.check(rc, "cuCtxPopCurrent")
        return cls.wrap(out[0], driver=drv)

    def set_current(self) -> None:
        self._require_alive("cuCtxSetCurrent")
        self.driver.checked.cuCtxSetCurrent(self.handle)

    def __enter__(self) -> Context:
        return self.push()

    def __exit__(self, *exc: object) -> None:
        popped = Context.pop(driver=self.driver)
        if popped.handle != self.handle:
            popped.push()  # put back what someone else left on top, then say so
            raise InvalidContextError(_CTX_ERROR, "cuCtxPopCurrent", hint="the context on top of the stack at "
                                      "the end of a `with ctx:` block was not ctx: a push inside was not popped")

    # ---------------------------------------------------------------- queries (this context made current)
    def _query(self, call: str, ctype: str, *args: Any) -> Any:
        out = ffi.new(ctype)
        with self:
            getattr(self.driver.checked, call)(out, *args)
        return out[0]

    def synchronize(self) -> None:
        """Wait for all work in this context (cuCtxSynchronize; the 13.0 ABI names the context)."""
        self._require_alive("cuCtxSynchronize")
        if arity(self.driver, "cuCtxSynchronize") == 1:
            self.driver.checked.cuCtxSynchronize(self.handle)
        else:
            with self:
                self.driver.checked.cuCtxSynchronize()

    @property
    def device(self) -> Device:
        self._require_alive("cuCtxGetDevice")
        out = ffi.new("CUdevice *")
        self.driver.check(_context_device(self.driver, self.handle, out), "cuCtxGetDevice")
        return Device(out[0], driver=self.driver)

    @property
    def flags(self) -> int:
        return self._query("cuCtxGetFlags", "unsigned int *")

    @property
    def api_version(self) -> int:
        out = ffi.new("unsigned int *")
        self.driver.checked.cuCtxGetApiVersion(self.handle, out)
        return out[0]

    def get_limit(self, limit: str | int) -> int:
        return self._query("cuCtxGetLimit", "size_t *", _enum("CUlimit", "CU_LIMIT_", limit))

    def set_limit(self, limit: str | int, value: int) -> None:
        with self:
            self.driver.checked.cuCtxSetLimit(_enum("CUlimit", "CU_LIMIT_", limit), value)

    @property
    def cache_config(self) -> int:
        return self._query("cuCtxGetCacheConfig", "CUfunc_cache *")

    @cache_config.setter
    def cache_config(self, value: str | int) -> None:
        with self:
            self.driver.checked.cuCtxSetCacheConfig(_enum("CUfunc_cache", "CU_FUNC_CACHE_", value))

    @property
    def shared_mem_config(self) -> int:
        return self._query("cuCtxGetSharedMemConfig", "CUsharedconfig *")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Context) and handle_int(other.handle) == handle_int(self.handle)

    def __hash__(self) -> int:
        return handle_int(self.handle)

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else ("owned" if self.owned else "not owned")
        return f"<cuproc.Context {handle_int(self.handle):#x} {state}>"


class PrimaryContext:
    """A device's primary context.  Retain/release pair up; ``with`` retains and makes it current."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.driver = device.driver
        self._handle: Any = None
        self._retains = [0]  # shared with the finalizer
        self._finalizer = weakref.finalize(self, _release_all, self.driver, device.handle, self._retains)

    def retain(self) -> PrimaryContext:
        out = ffi.new("CUcontext *")
        self.driver.checked.cuDevicePrimaryCtxRetain(out, self.device.handle)
        self._handle = out[0]
        self._retains[0] += 1
        return self

    def release(self) -> None:
        if self._retains[0] == 0:
            raise invalid("cuDevicePrimaryCtxRelease", "this PrimaryContext holds no retain to release "
                                                       "(never release what you did not retain)")
        self.driver.checked.cuDevicePrimaryCtxRelease(self.device.handle)
        self._retains[0] -= 1

    @property
    def retain_count(self) -> int:
        """How many retains this object holds (the driver's own count includes other holders)."""
        return self._retains[0]

    @property
    def handle(self) -> Any:
        if self._retains[0] == 0:
            raise invalid("cuDevicePrimaryCtxRetain", "retain() the primary context before using its handle")
        return self._handle

    @property
    def context(self) -> Context:
        return Context.wrap(self.handle, driver=self.driver)

    def retained(self) -> _Retained:
        """``with pc.retained():`` holds a retain without making the context current."""
        return _Retained(self)

    def __enter__(self) -> Context:
        self.retain()
        try:
            return self.context.push()
        except BaseException:
            self.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            Context.pop(driver=self.driver)
        finally:
            self.release()

    def set_flags(self, flags: int) -> None:
        self.driver.checked.cuDevicePrimaryCtxSetFlags(self.device.handle, flags)

    @property
    def state(self) -> tuple[int, bool]:
        """(flags, active) via cuDevicePrimaryCtxGetState."""
        flags, active = ffi.new("unsigned int *"), ffi.new("int *")
        self.driver.checked.cuDevicePrimaryCtxGetState(self.device.handle, flags, active)
        return flags[0], bool(active[0])

    def reset(self) -> None:
        """cuDevicePrimaryCtxReset: destroys all its allocations and state, for every holder."""
        self.driver.checked.cuDevicePrimaryCtxReset(self.device.handle)


class _Retained:
    def __init__(self, pc: PrimaryContext) -> None:
        self.pc = pc

    def __enter__(self) -> PrimaryContext:
        return self.pc.retain()

    def __exit__(self, *exc: object) -> None:
        self.pc.release()


def _context_device(drv: Driver, handle: Any, out: Any) -> int:
    """cuCtxGetDevice for ``handle``: the 13.0 ABI names the context, older ones read the current one."""
    if arity(drv, "cuCtxGetDevice") == 2:
        return drv.cuCtxGetDevice(out, handle)
    rc = drv.cuCtxPushCurrent(handle)
    if rc:
        return rc
    try:
        return drv.cuCtxGetDevice(out)
    finally:
        drv.cuCtxPopCurrent(ffi.new("CUcontext *"))


def _release_all(driver: Driver, device: Any, retains: list[int]) -> None:
    """Finalizer: give back retains still held.  Never raises."""
    try:
        while retains[0] > 0:
            retains[0] -= 1
            driver.cuDevicePrimaryCtxRelease(device)
    except Exception:  # noqa: BLE001 - finalizers must not raise (interpreter shutdown, dead driver)
        pass


def _enum(ctype: str, prefix: str, value: str | int) -> int:
    if isinstance(value, int):
        return value
    name = value if value.startswith(prefix) else prefix + value.upper()
    return ffi.typeof(ctype).relements[name]


def use_device(ordinal: int = 0, *, driver: Driver | None = None) -> PrimaryContext:
    """The one-liner: retain device ``ordinal``'s primary context and make it current on this thread.

    Returns the retained :class:`PrimaryContext`; release it (or let it be
    collected) when done.
    """
    pc = Device(ordinal, driver=driver).primary_context().retain()
    pc.context.set_current()
    return pc


__all__ = ["Context", "PrimaryContext", "use_device"]
