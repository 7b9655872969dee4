"""headers/ and the generated ffi: parseable, complete, in sync, deterministic."""
import filecmp
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(importlib.util.find_spec("cuproc").origin).parent   # the checkout's, or the installed wheel's
LOCAL_TOOLKIT = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
sys.path.insert(0, str(ROOT / "tools"))
import build_ffi  # noqa: E402
import gen_headers  # noqa: E402
from subproc import run_python  # noqa: E402


def test_every_declaration_parses_with_cffi():
    import cffi
    ffi = cffi.FFI()
    ffi.cdef(build_ffi.cdef_source(ROOT / "headers"))
    typedefs = set(ffi.list_types()[0])
    pfn = re.findall(r"\(\*(PFN_\w+)\)", (ROOT / "headers" / "cuda_pfn.h").read_text())
    assert len(pfn) == len(set(pfn)) >= 685
    assert set(pfn) <= typedefs
    from cuproc._cffi_abi import ffi as abi_ffi  # typeof() on the in-line ffi re-parses: slow
    for name in pfn:
        assert abi_ffi.typeof(name).kind == "function"  # cffi: a function pointer type


def test_headers_are_trimmed():
    for name in ("cuda_types.h", "cuda_pfn.h"):
        text = (ROOT / "headers" / name).read_text()
        assert "/*" not in text and "//" not in text
        assert not re.search(r"^#(?!define \w+ -?\d+$)", text, re.M), "only integer #defines survive"
        assert "CUDAAPI" not in text and "__attribute__" not in text and "sizeof" not in text


def test_generated_modules_match_headers(tmp_path):
    build_ffi.build_abi_module(ROOT / "headers", tmp_path)
    build_ffi.build_header_data(ROOT / "headers", tmp_path)
    for name in ("_cffi_abi.py", "_abi_digest.py", "_header_data.py", "_header_toolkits.py", "_header_enums.py"):
        assert filecmp.cmp(tmp_path / name, PACKAGE / name, shallow=False), \
            f"cuproc/{name} is stale: run tools/build_ffi.py"


def test_the_abi_digest_module_holds_the_digest_of_the_abi_module():
    """cuproc._ffi compares a compiled fast path with _abi_digest.DIGEST instead of reading _cffi_abi.py:
    the two must agree (a hand edit of either would let a stale build load, or refuse a fresh one)."""
    from cuproc import _abi_digest, _fastpath_digest
    assert _abi_digest.DIGEST == _fastpath_digest.digest(PACKAGE.parent, _fastpath_digest.ABI_INPUTS)
    assert _abi_digest.ABI_SIZE == (PACKAGE / "_cffi_abi.py").stat().st_size
    assert re.fullmatch(r"[0-9a-f]{8}-\d+", _abi_digest.DIGEST)


def test_the_generated_enumerators_are_what_the_ffi_enum_types_say():
    import cuproc
    from cuproc._header_enums import ENUMERATORS
    ffi = cuproc.ffi                                  # the ffi in use (the fast path's, where it is built)
    from_ffi: dict[str, int] = {}
    for name in ffi.list_types()[0]:
        ctype = ffi.typeof(name)
        if ctype.kind == "enum":
            from_ffi.update(ctype.relements)
    assert ENUMERATORS == from_ffi and len(from_ffi) > 1000
    table = cuproc.driver.constants()
    assert all(table[k] == v for k, v in from_ffi.items())   # every enumerator is a constant of the namespace


def test_ffi_has_types_enums_and_constants():
    from cuproc._cffi_abi import ffi
    from cuproc._header_data import DEFINES, POINTER_CONSTANTS
    assert ffi.sizeof("CUdeviceptr") == 8
    assert ffi.typeof("CUresult").relements["CUDA_ERROR_NOT_FOUND"] == 500
    assert ffi.typeof("CUdriverProcAddress_flags").relements["CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM"] == 2
    assert ffi.sizeof("CUlaunchAttributeValue") == 64
    assert ffi.sizeof("CUuuid") == 16
    # older-ABI structs exist for the old typedefs
    assert ffi.sizeof("CUDA_MEMCPY2D_v1") < ffi.sizeof("CUDA_MEMCPY2D_v2")
    assert DEFINES["CU_LAUNCH_PARAM_END"] == 0 and DEFINES["CU_LAUNCH_PARAM_BUFFER_POINTER"] == 1
    assert DEFINES["CU_LAUNCH_PARAM_BUFFER_SIZE"] == 2 and DEFINES["CU_IPC_HANDLE_SIZE"] == 64
    assert POINTER_CONSTANTS["CU_STREAM_PER_THREAD"] == "CUstream"
    assert DEFINES["CU_DEVICE_CPU"] == -1


def test_typedef_signatures_match_the_abi():
    from cuproc._cffi_abi import ffi
    old, new = ffi.typeof("PFN_cuMemAlloc_v2000"), ffi.typeof("PFN_cuMemAlloc_v3020")
    assert ffi.sizeof(old.args[0].item) == 4 and ffi.sizeof(new.args[0].item) == 8
    assert len(ffi.typeof("PFN_cuGetProcAddress_v12000").args) == 5
    assert len(ffi.typeof("PFN_cuGetProcAddress_v11030").args) == 4


@pytest.mark.slow   # runs the header generator (seconds each): CI runs it
@pytest.mark.skipif(not (LOCAL_TOOLKIT / "cudaTypedefs.h").exists() or shutil.which("cc") is None,
                    reason="needs a local CUDA toolkit's include directory and a C preprocessor")
def test_generator_is_deterministic_on_the_local_toolkit(tmp_path):
    outs = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert gen_headers.main(["--toolkit", f"13.0={LOCAL_TOOLKIT}", "--out", str(out)]) == 0
        outs.append(out)
    for name in ("cuda_types.h", "cuda_pfn.h", "provenance.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    # the local toolkit's typedefs are all in the merged headers/
    local = set(re.findall(r"\(\*(PFN_\w+)\)", (outs[0] / "cuda_pfn.h").read_text()))
    merged = set(re.findall(r"\(\*(PFN_\w+)\)", (ROOT / "headers" / "cuda_pfn.h").read_text()))
    assert local and local <= merged


@pytest.mark.slow   # runs the header generator (seconds each): CI runs it
@pytest.mark.skipif(not (LOCAL_TOOLKIT / "cudaGLTypedefs.h").exists() or shutil.which("cc") is None,
                    reason="needs a local CUDA toolkit's include directory and a C preprocessor")
def test_generator_merges_every_linux_typedef_header_whatever_the_hash_seed(tmp_path):
    """Two runs in fresh interpreters with different hash seeds give the same bytes, and hold the profiler,
    GL, EGL and VDPAU typedefs, the Windows-only cuWGLGetDevice and the cuGraphInstantiate alias."""
    import json
    for seed in ("1", "2"):
        run_python(ROOT / "tools" / "gen_headers.py", "--toolkit", f"13.0={LOCAL_TOOLKIT}", "--out", str(tmp_path / seed),
                   env={**os.environ, "PYTHONHASHSEED": seed}, timeout=300)
    for name in ("cuda_types.h", "cuda_pfn.h", "provenance.json"):
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes(), name
    prov = json.loads((tmp_path / "1" / "provenance.json").read_text())
    assert prov["windows_only"] == ["cuWGLGetDevice"]          # no Windows include dir given: no D3D
    assert prov["header_aliases"] == {"cuGraphInstantiate": {"13.0": "cuGraphInstantiateWithFlags"}}
    assert "cudaProfiler.h" in prov["toolkits"][0]["headers"]  # the toolkit's own, not the stand-in
    assert "CUoutput_mode" not in prov["stand_in_types"]
    pfn = (tmp_path / "1" / "cuda_pfn.h").read_text()
    for name in ("PFN_cuProfilerStart_v4000", "PFN_cuGLGetDevices_v6050", "PFN_cuEGLStreamConsumerConnect_v7000",
                 "PFN_cuVDPAUGetDevice_v3010", "PFN_cuWGLGetDevice_v2020"):
        assert f"(*{name})" in pfn
