"""Kernels from source on a real GPU: compiled with NVRTC, loaded, launched and checked against NumPy;
code that loads on the installed driver when NVRTC is newer; the cache across processes; the messages."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer
from cuproc import memory as mem
from cuproc.compile_cache import CompileCache
from cuproc.errors import CudaError, NotFoundError
from cuproc.nvrtc import is_nvrtc_available, open_nvrtc
from cuproc.program import Program
from cuproc.ptx_isa import driver_accepts, max_ptx_isa
from nvrtc_testing import AXPY, private_cache  # noqa: F401
from subproc import run_python

pytestmark = pytest.mark.gpu
if not cuproc.is_driver_available():
    pytest.skip("no CUDA driver on this machine", allow_module_level=True)
if not is_nvrtc_available():
    pytest.skip("no NVRTC on this machine (pip install 'cuproc[nvrtc]')", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
N = 100_003
SOURCE = AXPY.replace('#include "scale.cuh"', '#include "scale.cuh"\n#include <offset.cuh>').replace(
    "y[i] * SCALE", "y[i] * SCALE + OFFSET_VALUE")
SCALE, OFFSET = 3, 0.5


@pytest.fixture()
def include_dir(tmp_path):
    (tmp_path / "offset.cuh").write_text(f"#define OFFSET_VALUE {OFFSET}\n")
    return tmp_path


def _program() -> Program:
    return Program(SOURCE, name="axpy.cu", headers={"scale.cuh": f"#define SCALE {SCALE}\n"})


def _axpy(fn: cuproc.Function, dtype: type, prepared: bool = False) -> None:
    rng = np.random.default_rng(7)
    x, y = rng.random(N).astype(dtype), rng.random(N).astype(dtype)
    a = dtype(2.5)
    with DeviceBuffer(x.nbytes) as dx, DeviceBuffer(y.nbytes) as dy:
        mem.copy(dx, x)
        mem.copy(dy, y)
        grid = (N + 255) // 256
        if prepared:
            c = "float" if dtype == np.float32 else "double"
            fn.prepare([c, f"{c}*", f"{c}*", "int"], grid, 256)(float(a), dx, dy, N)
        else:
            fn.launch(grid, 256, (a, dx, dy, np.int32(N)))
        out = np.empty_like(y)
        mem.copy(out, dy)
    np.testing.assert_allclose(out, a * x + y * SCALE + OFFSET, rtol=1e-6)


def test_templates_and_includes_compiled_launched_and_checked(primary, include_dir):
    code = _program().compile(include_paths=[include_dir], name_expressions=["axpy<float>", "axpy<double>"])
    major, minor = cuproc.Device(0).compute_capability
    assert code.kind == "cubin" and code.arch == f"sm_{major}{minor}"
    with code.load() as mod:
        _axpy(mod.get_function("axpy<float>"), np.float32)
        _axpy(mod.get_function("axpy<double>"), np.float64)
        _axpy(mod.get_function("axpy<double>"), np.float64, prepared=True)
        assert mod.load_eagerly() == 3


def test_one_liner_and_library(primary, include_dir):
    fill = cuproc.compile_kernel(AXPY, "fill", headers={"scale.cuh": "#define SCALE 1\n"})
    with DeviceBuffer(4 * N) as d:
        fill.launch((N + 127) // 128, 128, (d, np.float32(4.25), np.int32(N)))
        out = np.empty(N, np.float32)
        mem.copy(out, d)
    np.testing.assert_array_equal(out, np.full(N, 4.25, np.float32))
    axpy = cuproc.compile_kernel(SOURCE, "axpy<float>", headers={"scale.cuh": f"#define SCALE {SCALE}\n"},
                                 include_paths=[include_dir], program_name="axpy.cu")
    assert axpy.name == "axpy<float>"
    _axpy(axpy, np.float32)
    with pytest.raises(cuproc.CompileError):
        cuproc.compile_kernel("__global__ void k() { nope; }", "k")
    code = _program().compile(include_paths=[include_dir], name_expressions=["axpy<float>"])
    with code.load_library() as lib:
        _axpy(lib.get_kernel("axpy<float>"), np.float32)


def test_the_default_cubin_loads_when_nvrtc_is_newer_than_the_driver(primary, include_dir):
    """The real case of the issue: the NVRTC 13.5 wheel on a CUDA 13.0 driver (CUPROC_LIBNVRTC)."""
    nvrtc, driver = open_nvrtc().version, cuproc.default_driver().driver_version
    isa = max_ptx_isa(nvrtc)
    if isa is None or driver_accepts(isa, driver) is not False:
        pytest.skip(f"NVRTC {nvrtc} makes PTX this CUDA {driver} driver accepts: not the newer-NVRTC case")
    code = _program().compile(include_paths=[include_dir], name_expressions=["axpy<float>"])
    assert code.kind == "cubin" and "newer than this CUDA" in code.reason
    with code.load() as mod:
        _axpy(mod.get_function("axpy<float>"), np.float32)
    ptx = _program().compile(include_paths=[include_dir], target="ptx", name_expressions=["axpy<float>"])
    with pytest.raises(CudaError) as refused:
        ptx.load()
    assert refused.value.refused and refused.value.name == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"
    assert "target='cubin'" in str(refused.value)
    with pytest.raises(CudaError) as driver_says:   # and the driver agrees: it is not a guess
        cuproc.Module.load(ptx.code)
    assert not driver_says.value.refused and driver_says.value.name == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"


def test_ptx_the_driver_accepts_loads_and_runs(primary, include_dir):
    nvrtc, driver = open_nvrtc().version, cuproc.default_driver().driver_version
    isa = max_ptx_isa(nvrtc)
    if isa is not None and driver_accepts(isa, driver) is False:
        pytest.skip(f"NVRTC {nvrtc}'s PTX is newer than this CUDA {driver} driver accepts")
    major, minor = cuproc.Device(0).compute_capability
    code = _program().compile(include_paths=[include_dir], arch=f"compute_{major}{minor}",
                              name_expressions=["axpy<float>"])
    assert code.kind == "ptx"
    with code.load() as mod:
        _axpy(mod.get_function("axpy<float>"), np.float32)


CACHED_RUN = """
import sys, time
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
import numpy as np
import cuproc
from cuproc import memory as mem
pc = cuproc.use_device(0)
t1 = time.perf_counter()
code = cuproc.Program({src!r}, headers={{"scale.cuh": "#define SCALE 1\\n"}}).compile(
    name_expressions=["axpy<float>"], cache={cache!r})
mod = code.load()
fn = mod.get_function("axpy<float>")
t2 = time.perf_counter()
x = np.arange(1000, dtype=np.float32)
with cuproc.DeviceBuffer(x.nbytes) as dx, cuproc.DeviceBuffer(x.nbytes) as dy:
    mem.copy(dx, x); mem.copy(dy, x)
    fn.launch(4, 256, (np.float32(2), dx, dy, np.int32(x.size)))
    out = np.empty_like(x); mem.copy(out, dy)
assert (out == 3 * x).all()
print(code.from_cache, "libnvrtc" in open("/proc/self/maps").read(), f"{{(t2 - t1) * 1e3:.3f}}")
"""


def test_a_cache_hit_across_two_processes(tmp_path):
    script = CACHED_RUN.format(root=str(ROOT), src=AXPY, cache=str(tmp_path))
    first = run_python(script).stdout.split()
    second = run_python(script).stdout.split()
    assert first[:2] == ["False", "True"]
    assert second[:2] == ["True", "False"], "the hit opened NVRTC"
    print(f"source to loaded module: cold {first[2]} ms, cache hit in a fresh process {second[2]} ms")
    assert len(CompileCache(tmp_path).entries()) == 1


def test_not_found_messages_name_the_symbol_and_list_the_kernels(primary, include_dir):
    code = _program().compile(include_paths=[include_dir], name_expressions=["axpy<float>", "fill"])
    with code.load() as mod:
        with pytest.raises(NotFoundError) as err:
            mod.get_function("NoSuchKernel")
        text = str(err.value)
        assert "'NoSuchKernel'" in text and "axpy.cu" in text
        if cuproc.default_driver().has("cuModuleEnumerateFunctions"):
            low = code.lowered_names["axpy<float>"]
            assert f"axpy<float> ({low})" in text and "fill" in text   # the module's two kernels
        with pytest.raises(NotFoundError, match="no variable 'nosuch'"):
            mod.get_global("nosuch")
    with code.load_library() as lib:
        with pytest.raises(NotFoundError) as err:
            lib.get_kernel("NoSuchKernel")
        assert "'NoSuchKernel'" in str(err.value)
        if cuproc.default_driver().has("cuLibraryEnumerateKernels"):
            assert "fill" in str(err.value)


LAZY_RUN = """
import sys, re
sys.path.insert(0, {root!r})
import cuproc
from cuproc.module import loading_mode
from cuproc.program import ObjectCode
pc = cuproc.use_device(0)
print("mode:", loading_mode())
major, minor = cuproc.Device(0).compute_capability
ptx = cuproc.Program('extern "C" __global__ void fill(float* x) {{ x[0] = 1; }}').compile(
    arch=f"compute_{{major}}{{minor}}", cache=False)
bad = re.sub(rb"\\.version \\d+\\.\\d+", b".version 9.9", ptx.code, count=1)
code = ObjectCode(bad, "ptx", ptx.arch, name="bad.cu", log="", lowered_names={{}}, nvrtc_version=ptx.nvrtc_version,
                  options=(), reason="test")
try:
    code.load_library()
except cuproc.CudaError as exc:
    print("checked:", exc.refused, str(exc).replace(chr(10), " | "))
# past the check, as code loaded some other way would be: the plain Library and Module name it too
for kind in ("Library", "Module"):
    try:
        if kind == "Library":
            cuproc.Library.load_data(bad, name="bad.cu").get_kernel("fill")
        else:
            cuproc.Module.load_data(bad, name="bad.cu").get_function("fill")
        print("loaded:", kind)
    except cuproc.CudaError as exc:
        print("failed:", kind, exc.call, str(exc).replace(chr(10), " | "))
    try:   # eager=True: the error comes at the load, whatever the mode
        (cuproc.Library.load_data if kind == "Library" else cuproc.Module.load_data)(bad, name="bad.cu", eager=True)
        print("loaded eagerly:", kind)
    except cuproc.CudaError as exc:
        print("failed eagerly:", kind, exc.call, str(exc).replace(chr(10), " | "))
"""


def test_the_lazy_loading_error_names_the_image_its_ptx_version_and_the_limit():
    env = {**os.environ, "CUDA_MODULE_LOADING": "LAZY"}
    proc = run_python(LAZY_RUN.format(root=str(ROOT)), env=env)
    limit = max_ptx_isa(cuproc.default_driver().driver_version)
    lines = proc.stdout.splitlines()
    print("\n".join(lines))
    checked = [line for line in lines if line.startswith("checked:")]
    assert checked and "True" in checked[0] and "9.9" in checked[0]
    assert "mode: lazy" in lines
    failed = [line for line in lines if line.startswith("failed:")]
    assert len(failed) == 2, lines   # 9.9 loads on no driver cuproc knows: each fails, at load or at lookup
    for line in failed + [line for line in lines if line.startswith("failed eagerly:")]:
        assert "9.9" in line and "bad.cu" in line and (limit is None or f"{limit}" in line), line
        late = line.startswith("failed:") and ("cuLibraryGetKernel" in line or "cuModuleGetFunction" in line)
        if late:   # says why, as true of the code: a library JITs at its first lookup, a module under lazy loading
            assert ("first lookup" in line) if line.startswith("failed: Library ") else ("under lazy loading" in line)
    assert not [line for line in lines if line.startswith("loaded")], lines


def test_the_readmes_first_program_runs(tmp_path):
    """The README's first program, as a user pastes it (its own process, a cache folder of its own): its
    closing assert compares with NumPy."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("## A first program", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "compile_kernel" in code and "assert np.allclose" in code
    env = {**os.environ, "CUPROC_NVRTC_CACHE_DIR": str(tmp_path)}
    run_python(code + "\nprint('first program ok')\n", env=env, timeout=120)
