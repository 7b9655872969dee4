"""Loading code on a real GPU (issue 37, "module loading, clearer"): the checked-in fatbin on this GPU, data
and paths said apart, not-found messages with the kernels the driver enumerates, lazy loading's late error
and eager loading.  The fake-driver twin is tests/test_modules_fake.py."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, Library, Module
from cuproc import memory as mem
from cuproc.errors import NotFoundError
from cuproc.module import Linker, loading_mode
from cuproc.ptx_isa import max_ptx_isa
from subproc import run_python

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
K = ROOT / "kernels"
KERNELS = sorted(re.findall(r'extern "C" __global__ void (\w+)\(', (K / "kernels.cu").read_text()))


def _vec_add(fn: cuproc.Function) -> None:
    a = np.arange(1000, dtype=np.float32)
    with DeviceBuffer(a.nbytes) as da, DeviceBuffer(a.nbytes) as dc:
        mem.copy(da, a)
        fn.launch(4, 256, (da, da, dc, np.int32(a.size)))
        out = np.empty_like(a)
        mem.copy(out, dc)
    np.testing.assert_array_equal(out, 2 * a)


def test_the_fatbin_runs_on_this_gpu_through_every_entry_point(primary):
    fatbin = K / "kernels.fatbin"
    ptx_text = (K / "kernels.ptx").read_text()
    for mod in (Module.load(fatbin), Module.load(str(fatbin)), Module.load(fatbin.read_bytes()),
                Module.load_file(fatbin), Module.load_data(fatbin.read_bytes()), Module.load_data(ptx_text)):
        with mod:
            _vec_add(mod.get_function("VecAdd_kernel"))
    for lib in (Library(fatbin), Library.load_data(ptx_text), Library.load_file(fatbin)):
        _vec_add(lib.get_kernel("VecAdd_kernel"))
        lib.unload()
    with pytest.raises(ValueError, match="load_data"):
        Module.load(ptx_text)                        # a str is a path: text there is refused, not opened
    with Linker() as linker:
        cubin, _ = linker.add_data(ptx_text, "ptx", "kernels.ptx").complete()
    with Module.load(cubin) as mod:                  # the linker's cubin, for this very GPU
        _vec_add(mod.get_function("VecAdd_kernel"))


def test_not_found_names_the_symbol_and_lists_the_kernels(primary):
    drv = cuproc.default_driver()
    with Module.load(K / "kernels.fatbin") as mod:
        with pytest.raises(NotFoundError) as err:
            mod.get_function("NoSuchKernel")
        text = str(err.value)
        assert "'NoSuchKernel'" in text and "kernels.fatbin" in text
        if drv.has("cuModuleEnumerateFunctions"):
            assert set(KERNELS) <= set(mod.kernel_names())
            assert all(name in text for name in KERNELS)
        with pytest.raises(NotFoundError, match="'nosuch'"):
            mod.get_global("nosuch")
    lib = Library(K / "kernels.fatbin")
    with pytest.raises(NotFoundError) as err:
        lib.get_kernel("NoSuchKernel")
    assert "'NoSuchKernel'" in str(err.value)
    if drv.has("cuLibraryEnumerateKernels"):
        assert set(KERNELS) <= set(lib.kernel_names()) and "VecAdd_kernel" in str(err.value)
    lib.unload()


def test_loading_eagerly_loads_every_kernel(primary):
    if not cuproc.default_driver().has("cuFuncLoad"):
        pytest.skip("cuFuncLoad is CUDA 12.4")
    with Module.load(K / "kernels.fatbin", eager=True) as mod:
        assert mod.load_eagerly() >= len(KERNELS)
        _vec_add(mod.get_function("VecAdd_kernel"))
    lib = Library(K / "kernels.fatbin", eager=True)
    assert lib.load_eagerly() >= len(KERNELS)
    _vec_add(lib.get_kernel("VecAdd_kernel"))
    lib.unload()


LAZY = """
import re, sys
sys.path.insert(0, {root!r})
import cuproc
from cuproc.module import loading_mode
pc = cuproc.use_device(0)
print("mode:", loading_mode())
text = open({ptx!r}).read()
bad = re.sub(r"\\.version \\d+\\.\\d+", ".version 9.9", text, count=1)
for kind, load, lookup in (("Library", cuproc.Library.load_data, "get_kernel"),
                           ("Module", cuproc.Module.load_data, "get_function")):
    for eager in (False, True):
        try:
            loaded = load(bad, name="newer.ptx", eager=eager)
        except cuproc.CudaError as exc:
            print("failed:", kind, eager, "at-load", exc.call, exc.name, str(exc).replace(chr(10), " | "))
            continue
        try:
            getattr(loaded, lookup)("VecAdd_kernel")
            print("loaded:", kind, eager)
        except cuproc.CudaError as exc:
            print("failed:", kind, eager, "at-lookup", exc.call, exc.name, str(exc).replace(chr(10), " | "))
"""


@pytest.mark.parametrize("mode", ["LAZY", "EAGER"])
def test_a_ptx_too_new_for_the_driver_names_the_image_and_both_isas(mode):
    env = {**os.environ, "CUDA_MODULE_LOADING": mode}
    lines = run_python(LAZY.format(root=str(ROOT), ptx=str(K / "kernels.ptx")), env=env).stdout.splitlines()
    print("\n".join(lines))      # which call failed, on this driver: the closing note reports it
    assert f"mode: {mode.lower()}" in lines
    limit = max_ptx_isa(cuproc.default_driver().driver_version)
    failed = [line for line in lines if line.startswith("failed:")]
    assert len(failed) == 4, lines                   # ISA 9.9 loads on no driver cuproc knows
    for line in failed:
        assert "newer.ptx" in line and "9.9" in line and (limit is None or f"{limit}" in line), line
        if " at-lookup " in line:                   # a late failure says why it is late, as true in this mode:
            if line.startswith("failed: Library "):  # a library's JIT runs at its first lookup in both modes
                assert "first lookup" in line and "eager=True" in line, line
                assert "under lazy loading" not in line and "set CUDA_MODULE_LOADING=EAGER" not in line, line
            else:                                    # a module's is late only under lazy loading
                assert ("under lazy loading" in line) == (mode == "LAZY"), line
    late = [line for line in failed if " True at-lookup " in line]
    assert not late, late                            # eager=True: at the load, never at the lookup


def test_the_loading_mode_is_reported(primary):
    if not cuproc.default_driver().has("cuModuleGetLoadingMode"):
        pytest.skip("cuModuleGetLoadingMode is CUDA 11.7")
    expected = {"EAGER": "eager", "LAZY": "lazy"}.get(os.environ.get("CUDA_MODULE_LOADING", ""), "lazy")
    assert loading_mode() == expected
