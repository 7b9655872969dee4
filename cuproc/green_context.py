"""Green contexts: partitions of a device's SMs, and contexts whose work runs only on their partition.

Policy
------
* **Resources are values.**  :class:`SmResource` is a copy of the driver's ``CUdevResource`` of type SM
  (:meth:`SmResource.of_device`, :attr:`GreenContext.sm_resource`); the driver keeps its own data in the
  struct, so resources are only ever made by the driver and passed back unchanged.
* **One split, explicit groups.**  :meth:`SmResource.split` makes every group in *one*
  cuDevSmResourceSplitByCount call and returns the groups and the remainder, so groups never overlap
  (splitting again per context gave overlapping partitions in other libraries).  The count is rounded up
  by the driver to the device's minimum partition size; ask :meth:`SmResource.split` with ``groups=None``
  for as many as fit.  It never passes a NULL result with a count (the discovery-only form cuda.core got
  wrong): discovery is its own call (:meth:`SmResource.group_count`).
* **A GreenContext** (cuDevResourceGenerateDesc, then cuGreenCtxCreate with CU_GREEN_CTX_DEFAULT_STREAM)
  owns the green context; ``close()``/``destroy()`` or its finalizer destroys it (cuGreenCtxDestroy).  Its
  :attr:`~GreenContext.context` is the cuproc :class:`~cuproc.context.Context` of cuCtxFromGreenCtx:
  streams, memory and modules made in it (``Stream(context=green.context)``, or
  :meth:`GreenContext.stream`) run on the partition.  That Context is not owned (closing it does nothing);
  it ends when the GreenContext is destroyed, and everything made in it then refuses use.  Keep the
  GreenContext while you use its context, as you keep a PrimaryContext's retain.
* **Capability, not version.**  The calls are CUDA 12.4's (cuGreenCtxStreamCreate 12.5's); a handle
  pinned to an older version reaches them as newer-driver features when the installed driver has them
  (:func:`supported` asks the registry).  The struct's layout (144 bytes, the SM fields at offset 96) is
  the same in every version that has it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._ffi import ffi
from ._resource import FORKED, Resource
from ._support import get_driver, handle_int, invalid
from .context import Context, synchronize_context
from .device import Device
from .driver import Driver
from .errors import SymbolNotFoundError
from .stream import Stream

_CALLS = ("cuDeviceGetDevResource", "cuDevSmResourceSplitByCount", "cuDevResourceGenerateDesc", "cuGreenCtxCreate",
          "cuGreenCtxDestroy", "cuCtxFromGreenCtx", "cuGreenCtxGetDevResource")
_SM = 1                         # CU_DEV_RESOURCE_TYPE_SM
_DEFAULT_STREAM = 1             # CU_GREEN_CTX_DEFAULT_STREAM (cuGreenCtxCreate's one valid flag)
_NON_BLOCKING = 1               # CU_STREAM_NON_BLOCKING (cuGreenCtxStreamCreate's one valid flag)


def supported(driver: Driver | None = None) -> bool:
    """Whether this handle reaches the green-context calls (on a newer driver too: the registry's rules)."""
    drv = get_driver(driver)
    return all(drv.has(name) for name in _CALLS)


class SmResource:
    """A set of SMs as the driver describes it (a copy of its ``CUdevResource``); :attr:`sm_count` SMs of
    device :attr:`device_ordinal`."""

    __slots__ = ("_raw", "driver", "device_ordinal")

    def __init__(self, raw: Any, driver: Driver, device_ordinal: int) -> None:
        """Wraps a ``CUdevResource`` the driver filled (copied: the object owns its bytes)."""
        copy = ffi.new("CUdevResource *")
        ffi.memmove(copy, raw, ffi.sizeof("CUdevResource"))
        self._raw, self.driver, self.device_ordinal = copy, driver, device_ordinal

    @classmethod
    def of_device(cls, device: Device | int = 0, *, driver: Driver | None = None) -> SmResource:
        """cuDeviceGetDevResource: all SMs of ``device``."""
        drv = get_driver(driver if not isinstance(device, Device) else device.driver)
        dev = device if isinstance(device, Device) else Device(device, driver=drv)
        out = ffi.new("CUdevResource *")
        drv.check(drv.cuDeviceGetDevResource(dev.handle, out, _SM), "cuDeviceGetDevResource")
        return cls(out, drv, dev.ordinal)

    @property
    def sm_count(self) -> int:
        return int(self._raw.sm.smCount)

    @property
    def raw(self) -> Any:
        """The ``CUdevResource *`` (for the driver's calls; never change it)."""
        return self._raw

    def group_count(self, count: int) -> int:
        """How many groups of at least ``count`` SMs a split would make (cuDevSmResourceSplitByCount in its
        discovery form: result NULL)."""
        call = "cuDevSmResourceSplitByCount"
        _count(count, call)
        n = ffi.new("unsigned int *", 0)
        self.driver.check(self.driver.cuDevSmResourceSplitByCount(ffi.NULL, n, self._raw, ffi.NULL, 0, count), call)
        return int(n[0])

    def split(self, count: int, *, groups: int | None = None) -> tuple[list[SmResource], SmResource]:
        """cuDevSmResourceSplitByCount, once: ``groups`` groups (None: as many as fit) of at least ``count`` SMs
        each (the driver rounds up to the device's minimum partition), and the remainder.  Fewer groups than
        asked fit: the driver makes those that do (``len`` of the result says)."""
        call = "cuDevSmResourceSplitByCount"
        _count(count, call)
        wanted = self.group_count(count) if groups is None else groups
        if wanted.__class__ is not int or wanted <= 0:
            raise invalid(call, f"groups must be a positive int (or None: as many as fit), got {groups!r}"
                          if groups is not None else f"no group of {count} SMs fits in {self.sm_count} SMs")
        result = ffi.new("CUdevResource[]", wanted)
        n = ffi.new("unsigned int *", wanted)
        rest = ffi.new("CUdevResource *")
        self.driver.check(self.driver.cuDevSmResourceSplitByCount(result, n, self._raw, rest, 0, count), call)
        made = [SmResource(result + i, self.driver, self.device_ordinal) for i in range(n[0])]
        return made, SmResource(rest, self.driver, self.device_ordinal)

    def __repr__(self) -> str:
        return f"<cuproc.SmResource {self.sm_count} SMs of device {self.device_ordinal}>"

    def __reduce__(self) -> Any:
        raise TypeError("an SmResource is the driver's description in this process; it cannot be pickled")


def _count(count: Any, call: str) -> None:
    if count.__class__ is not int or count <= 0:
        raise invalid(call, f"count must be a positive int (SMs per group), got {count!r}")


class GreenContext(Resource):
    """A green context on the SMs of ``resources`` (cuDevResourceGenerateDesc, cuGreenCtxCreate); destroyed
    by ``close()``/``destroy()`` or its finalizer (cuGreenCtxDestroy).  :attr:`context` is its Context."""

    _release_call = "cuGreenCtxDestroy"
    _ended_word = "destroyed"

    def __init__(self, resources: SmResource | Sequence[SmResource], *, driver: Driver | None = None) -> None:
        call = "cuGreenCtxCreate"
        group = [resources] if isinstance(resources, SmResource) else list(resources)
        if not group or not all(isinstance(r, SmResource) for r in group):
            raise invalid(call, "a GreenContext is made from SmResources (SmResource.of_device(...).split(n))")
        ordinals = {r.device_ordinal for r in group}
        if len(ordinals) != 1:
            raise invalid(call, f"the resources are of devices {sorted(ordinals)}: a green context is on one device")
        drv = get_driver(driver if driver is not None else group[0].driver)
        device = Device(ordinals.pop(), driver=drv)
        array = ffi.new("CUdevResource[]", len(group))
        for i, r in enumerate(group):
            ffi.memmove(array + i, r.raw, ffi.sizeof("CUdevResource"))
        desc = ffi.new("CUdevResourceDesc *")
        drv.check(drv.cuDevResourceGenerateDesc(desc, array, len(group)), "cuDevResourceGenerateDesc")
        out = ffi.new("CUgreenCtx *")
        drv.check(drv.cuGreenCtxCreate(out, desc[0], device.handle, _DEFAULT_STREAM), call)
        self.driver, self.handle, self.device, self.ended = drv, out[0], device, None
        ctx = ffi.new("CUcontext *")
        rc = drv.cuCtxFromGreenCtx(ctx, self.handle)
        if rc:
            drv.cuGreenCtxDestroy(self.handle)
            self.ended = "destroyed"
            raise drv.error(rc, "cuCtxFromGreenCtx")
        self.context = Context.adopt(ctx[0], driver=drv)

    def describe(self) -> str:
        return f"green context {handle_int(self.handle):#x}"

    @property
    def sm_resource(self) -> SmResource:
        """cuGreenCtxGetDevResource: the SMs this green context runs on."""
        call = "cuGreenCtxGetDevResource"
        self.check(call)
        out = ffi.new("CUdevResource *")
        self.driver.check(self.driver.cuGreenCtxGetDevResource(self.handle, out, _SM), call)
        return SmResource(out, self.driver, self.device.ordinal)

    @property
    def sm_count(self) -> int:
        return self.sm_resource.sm_count

    def stream(self, *, priority: int = 0) -> Stream:
        """A non-blocking stream of this green context (``Stream(non_blocking=True, context=self.context)``:
        with the green context current, the driver makes it on the partition)."""
        self.check("cuStreamCreateWithPriority")
        return Stream(non_blocking=True, priority=priority, context=self.context)

    def _release(self) -> int:
        """Wait for the context's work, end the Context (its dependents refuse from now on), destroy."""
        ctx = self.context
        rc = 0
        if ctx.ended is None and not FORKED[0]:
            try:
                rc = synchronize_context(ctx)
            except SymbolNotFoundError:   # a handle without any cuCtxSynchronize ABI (a stand-in driver): no wait
                rc = 0
        ctx.end("destroyed with its green context")
        return self.driver.cuGreenCtxDestroy(self.handle) or rc

    def destroy(self) -> None:
        """cuGreenCtxDestroy (idempotent)."""
        self.close()

    def __repr__(self) -> str:
        return f"<cuproc.GreenContext {handle_int(self.handle):#x} {self.ended or 'live'}>"


__all__ = ["GreenContext", "SmResource", "supported"]
