"""``cuproc.driver`` as a C-named namespace: lazy by default, every name bound by ``preload()``.

While the module answers names through its PEP 562 ``__getattr__``, CPython does not specialize
``cuproc.driver.cuX`` loads; ``preload()`` binds every C name and removes the hook.  These tests
check that binding gives exactly what the lazy path gives, and that everything that used to
re-resolve a name (a new default handle, ``declare()``, fork) still does.
"""
from __future__ import annotations

import dis
import os
import sys
from pathlib import Path

import pytest

import cuproc
from cuproc import driver as cu
from cuproc.driver import Driver
from simdriver import build as build_sim
from subproc import run_python

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def default_sim(sim):
    drv = Driver("12.0", library=sim.path)
    cu.set_default_driver(drv)
    yield drv
    cu.set_default_driver(None)


def _load_attr_ops(fn) -> list[str]:
    return [i.opname for i in dis.get_instructions(fn, adaptive=True) if i.opname.startswith("LOAD_ATTR")]


def test_preload_binds_what_the_lazy_namespace_gives(default_sim):
    lazy = Driver("12.0", library=default_sim.library.path)   # a second handle: the lazy answers
    assert "__getattr__" in vars(cu)
    counts = cu.preload()
    assert counts == lazy.preload()
    assert "__getattr__" not in vars(cu)
    bound = vars(cu)
    for name in lazy.registry:                    # every function, resolved the same way
        mine, ref = bound[name], getattr(lazy, name)
        assert type(mine) is type(ref), name
        assert mine is getattr(default_sim, name), name
    assert cu.CU_CTX_SCHED_BLOCKING_SYNC == lazy.CU_CTX_SCHED_BLOCKING_SYNC == 4   # cuda.h's value
    assert cu.CU_LAUNCH_PARAM_END == cuproc.ffi.NULL
    assert cu.CUdeviceptr is cuproc.ffi.typeof("CUdeviceptr")
    assert cu.checked is default_sim.checked
    assert cu.ffi is cuproc.ffi                   # the module's own attributes are untouched
    with pytest.raises(AttributeError, match="cuNoSuchFunction"):
        cu.cuNoSuchFunction  # noqa: B018


def test_unavailable_symbols_are_bound_and_still_refuse_when_called(default_sim):
    cu.preload()
    with pytest.raises(cuproc.errors.SymbolNotFoundError, match="Windows-only"):
        cu.cuWGLGetDevice(cuproc.ffi.NULL, cuproc.ffi.NULL, 0)


@pytest.mark.skipif(sys.implementation.name != "cpython" or sys.version_info < (3, 11),
                    reason="attribute-load specialization is CPython 3.11+")
def test_the_first_function_binds_every_name_and_module_loads_specialize(default_sim):
    monitoring = getattr(sys, "monitoring", None)
    if sys.gettrace() is not None or (monitoring is not None and monitoring.get_tool(monitoring.COVERAGE_ID)):
        pytest.skip("a tracer (coverage) is active, and CPython does not specialize while tracing")
    out = cuproc.ffi.new("CUcontext *")

    def constant_loop() -> None:
        for _ in range(64):
            cu.CU_CTX_SCHED_BLOCKING_SYNC  # noqa: B018

    constant_loop()
    constant_loop()
    assert "__getattr__" in vars(cu)                               # a constant needs no driver: still lazy
    assert "LOAD_ATTR_MODULE" not in _load_attr_ops(constant_loop)   # and the hook defeats specialization
    assert "cuCtxGetCurrent" not in vars(cu)

    def call_loop() -> None:
        for _ in range(64):
            cu.cuCtxGetCurrent(out)

    call_loop()
    call_loop()
    assert "__getattr__" not in vars(cu)                           # no preload(): the first function did it
    assert "LOAD_ATTR_MODULE" in _load_attr_ops(call_loop)
    constant_loop()
    constant_loop()
    assert "LOAD_ATTR_MODULE" in _load_attr_ops(constant_loop)
    lazy = Driver("12.0", library=default_sim.library.path)
    for name in lazy.registry:                                     # every function, as preload() binds it
        assert vars(cu)[name] is getattr(default_sim, name), name
        assert type(vars(cu)[name]) is type(getattr(lazy, name)), name
    assert vars(cu)["CUdeviceptr"] is cuproc.ffi.typeof("CUdeviceptr")
    assert vars(cu)["checked"] is default_sim.checked


def test_an_unavailable_function_says_why_when_asked_and_when_called(default_sim):
    got = cu.cuWGLGetDevice                                        # bound with every name
    assert isinstance(got, cu.Unavailable) and not got
    assert got.status == cuproc.registry.NOT_ON_THIS_PLATFORM and got.name == "cuWGLGetDevice"
    assert got.resolution is default_sim.resolution("cuWGLGetDevice")
    assert got.resolution.function is None and got.resolution.message
    with pytest.raises(cuproc.errors.SymbolNotFoundError) as info:
        got(cuproc.ffi.NULL, cuproc.ffi.NULL, 0)
    assert info.value.call == "cuWGLGetDevice"


def test_threads_taking_the_same_first_function_at_once_all_get_the_one_the_module_binds(sim):
    import threading
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                                   # switch threads as often as CPython allows
    try:
        for _trial in range(12):                                  # a fresh default handle each time: a fresh bind
            drv = Driver("12.0", library=sim.path)
            cu.set_default_driver(drv)
            got: list[object] = []
            start = threading.Barrier(6)

            def take() -> None:
                start.wait()
                got.append(cu.cuMemAlloc)

            threads = [threading.Thread(target=take) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert "__getattr__" not in vars(cu)
            assert len(got) == 6 and all(g is drv.cuMemAlloc is vars(cu)["cuMemAlloc"] for g in got)
    finally:
        sys.setswitchinterval(switch)
        cu.set_default_driver(None)


NO_DRIVER = """
import cuproc
from cuproc import driver as cu
checked = cu.checked                       # taking it opens nothing, as before
assert "__getattr__" in vars(cu) and cu.CU_CTX_SCHED_AUTO == 0
try:
    checked.cuInit(0)
except cuproc.errors.DriverNotFoundError:
    print("refused at the call")
"""


def test_without_a_driver_checked_and_constants_are_handed_out_and_calls_say_what_is_missing(tmp_path):
    env = dict(os.environ, CUPROC_LIBCUDA=str(tmp_path / "libcuda-missing.so"),
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    assert run_python(NO_DRIVER, env=env).stdout.strip() == "refused at the call"


def test_a_new_default_handle_restores_the_lazy_namespace(sim):
    cu.set_default_driver(Driver("12.0", library=sim.path))
    try:
        cu.preload()
        old = cu.cuCtxCreate
        newer = Driver("13.0", library=sim.path)
        cu.set_default_driver(newer)
        assert "__getattr__" in vars(cu) and "cuCtxCreate" not in vars(cu)
        assert cu.cuCtxCreate is newer.cuCtxCreate is not old
    finally:
        cu.set_default_driver(None)


@pytest.fixture(scope="module")
def sim135(tmp_path_factory):
    """A simulated 13.5 driver with one function no header declares (cuFooSim)."""
    s = build_sim(tmp_path_factory.mktemp("simfoo"), "v2", (("cuFooSim", 13050, "cuFooSim", "cuFooSim_ptsz"),))
    s.set_version(13050)
    s.set_result(0)
    return s


def test_declare_after_preload_makes_and_replaces_module_names(sim135):
    drv = Driver("13.0", library=sim135.path)
    cu.set_default_driver(drv)
    try:
        cu.preload()
        assert "__getattr__" not in vars(cu)
        first = drv.declare("cuFooSim", "CUresult (*)(int)")       # a name nothing bound yet
        assert cu.cuFooSim is first
        second = drv.declare("cuFooSim", "CUresult (*)(int, int)")   # replaces the bound one
        assert cu.cuFooSim is second is not first
        assert len(cuproc.ffi.typeof(cuproc.fastpath.pointer(cu.cuFooSim)).args) == 2
    finally:
        cu.set_default_driver(None)


# ---- races between the module's binding and a change of what it should bind (review findings 2, 3).
# Each test runs "the other thread" at the exact point of the window, from inside the resolving code.

def test_preload_racing_a_declare_binds_the_declared_function(sim135, monkeypatch):
    drv = Driver("13.0", library=sim135.path)
    cu.set_default_driver(drv)
    try:
        first = drv.declare("cuFooSim", "CUresult (*)(int)")
        assert cu.cuFooSim is first                   # bound on the module by the hook
        real = Driver.checked
        raced: list = []

        def checked(self):   # read by preload() after it resolved every other name, before it binds them
            if not raced:
                raced.append(self.declare("cuFooSim", "CUresult (*)(int, int)"))
            return real.fget(self)
        monkeypatch.setattr(Driver, "checked", property(checked))
        cu.preload()
        monkeypatch.undo()
        assert "__getattr__" not in vars(cu)          # preload() resolved again, and bound
        assert raced and drv.cuFooSim is raced[0] is not first
        assert cu.cuFooSim is raced[0]                # not the function the declare replaced
        assert cu.checked is drv.checked
        third = drv.declare("cuFooSim", "CUresult (*)(int)")
        assert cu.cuFooSim is third                   # and a later declare still reaches the module
    finally:
        cu.set_default_driver(None)


@pytest.mark.parametrize("name", ["cuCtxGetCurrent", "checked"])
def test_the_lazy_hook_racing_a_new_default_handle_keeps_nothing_of_the_old_one(sims, monkeypatch, name):
    d1, d2 = Driver("12.0", library=sims["v2"].path), Driver("12.0", library=sims["v1"].path)
    cu.set_default_driver(d1)
    try:
        real = Driver._c_name if name != "checked" else Driver.checked.fget

        def racing(self, *asked):
            value = real(self, *asked)
            if self is d1 and asked in ((), (name,)):
                cu.set_default_driver(d2)             # between the hook's resolve and its store
            return value
        if name == "checked":
            monkeypatch.setattr(Driver, "checked", property(racing))
        else:
            monkeypatch.setattr(Driver, "__getattr__", racing)
        got = getattr(cu, name)
        monkeypatch.undo()
        assert got is getattr(d1, name)               # the access that began on d1 gets d1's ...
        assert cu.default_driver() is d2
        assert getattr(cu, name) is getattr(d2, name) is not got   # ... but the module serves d2's
    finally:
        cu.set_default_driver(None)


def test_the_lazy_hook_racing_a_declare_does_not_keep_the_replaced_function(sim135):
    raced: list = []

    class Racing(Driver):
        def __getattribute__(self, name: str):
            value = super().__getattribute__(name)
            if name == "cuFooSim" and not raced:   # the declare lands between resolve and store
                raced.append(self.declare("cuFooSim", "CUresult (*)(int, int)"))
            return value
    drv = Racing("13.0", library=sim135.path)
    first = drv.declare("cuFooSim", "CUresult (*)(int)")
    cu.set_default_driver(drv)
    try:
        assert cu.cuFooSim is first                   # the access that began before the declare
        assert raced and cu.cuFooSim is raced[0] is not first
    finally:
        cu.set_default_driver(None)


FORK = """
import os, sys
import cuproc
from cuproc import driver as cu
cu.set_default_driver(cuproc.Driver(library={lib!r}))
assert cu.checked.cuInit(0) is None
cu.preload()
assert "__getattr__" not in vars(cu)
windows_only = cu.cuWGLGetDevice   # bound, its message not yet made: the child must not ask the driver for it
unopened = cuproc.Driver(library={lib!r})
pid = os.fork()
if pid == 0:
    checked = cu.checked               # handed out in the child (the hook is back); its calls refuse
    if "__getattr__" not in vars(cu) or not isinstance(checked, cuproc.driver.Checked):
        os._exit(3)
    cu.set_default_driver(unopened)    # a handle the parent never opened: taking checked must not open it
    opener = cuproc.driver.open_library
    cuproc.driver.open_library = lambda *args: os._exit(4)
    cu.checked
    cuproc.driver.open_library = opener
    try:
        unopened.publish_functions()
        os._exit(5)
    except cuproc.errors.ForkedProcessError:
        pass
    for call in (lambda: cu.cuCtxGetCurrent(cuproc.ffi.new("CUcontext *")),
                 lambda: windows_only(cuproc.ffi.NULL, cuproc.ffi.NULL, 0),
                 lambda: checked.cuInit(0)):
        try:
            call()
        except cuproc.errors.ForkedProcessError:
            continue
        except BaseException:
            os._exit(2)
        os._exit(1)
    os._exit(0)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_refuses_names_bound_before_the_fork(fk):
    code = FORK.format(lib=str(fk.path))
    proc = run_python(code, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                          [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])))
    assert proc.stdout.strip() == "0", proc.stderr
