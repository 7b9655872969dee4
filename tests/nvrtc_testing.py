"""What the NVRTC tests share: whether NVRTC is here, a private cache directory, the kernels, and a
stand-in NVRTC built from C (an "older NVRTC" that lacks a function, for the clear-error path)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cuproc import nvrtc as _nv


def _nvrtc_absent() -> bool:
    """True only when no NVRTC is installed: no candidate file exists.  One that exists and does not
    open is a broken install, and the tests run and fail on it rather than skip."""
    try:
        _nv.open_nvrtc()
    except _nv.NvrtcNotFoundError:
        return _nv.locate() is None
    return False


NVRTC_ABSENT = _nvrtc_absent()
HAVE_NVRTC = not NVRTC_ABSENT
needs_nvrtc = pytest.mark.skipif(NVRTC_ABSENT, reason="NVRTC is not installed")

#: A real architecture every NVRTC from 11.8 to 13.5 compiles for.
ARCH = "sm_80"

AXPY = r"""
#include "scale.cuh"
template <typename T>
__global__ void axpy(T a, const T* x, T* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i] * SCALE;
}
extern "C" __global__ void fill(float* out, float value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"""
SCALE_H = "#define SCALE 1\n"


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Every test caches in its own directory, never in the user's."""
    directory = tmp_path_factory.mktemp("nvrtc-cache")
    monkeypatch.setenv("CUPROC_NVRTC_CACHE_DIR", str(directory))
    monkeypatch.delenv("CUPROC_NVRTC_CACHE", raising=False)
    monkeypatch.delenv("CUPROC_NVRTC_CACHE_SIZE", raising=False)
    return directory


def loaded_libraries() -> str:
    """This process's memory map (Linux): which shared libraries are loaded."""
    return Path("/proc/self/maps").read_text()


# A stand-in NVRTC: an "11.8" that has everything cuproc needs for PTX and cubins but not nvrtcGetLTOIR
# (NVRTC 12.0), and counts its nvrtcCompileProgram calls.  Its output is a fixed text.
STUB_SOURCE = r"""
#include <stdlib.h>
#include <string.h>
typedef struct prog { int unused; } *nvrtcProgram;
static const char CODE[] = ".version 7.8\n.target sm_80\n";
long stub_compiles = 0;
int nvrtcVersion(int *major, int *minor) { *major = 11; *minor = 8; return 0; }
const char *nvrtcGetErrorString(int rc) { return rc ? "stub error" : "NVRTC_SUCCESS"; }
int nvrtcGetNumSupportedArchs(int *n) { *n = 1; return 0; }
int nvrtcGetSupportedArchs(int *a) { a[0] = 80; return 0; }
int nvrtcCreateProgram(nvrtcProgram *p, const char *src, const char *name, int n, const char *const *h,
                       const char *const *names) { *p = malloc(sizeof(struct prog)); return 0; }
int nvrtcDestroyProgram(nvrtcProgram *p) { free(*p); *p = 0; return 0; }
int nvrtcAddNameExpression(nvrtcProgram p, const char *e) { return 0; }
int nvrtcGetLoweredName(nvrtcProgram p, const char *e, const char **out) { *out = e; return 0; }
int nvrtcCompileProgram(nvrtcProgram p, int n, const char *const *o) { stub_compiles++; return 0; }
int nvrtcGetProgramLogSize(nvrtcProgram p, size_t *s) { *s = 1; return 0; }
int nvrtcGetProgramLog(nvrtcProgram p, char *log) { log[0] = 0; return 0; }
int nvrtcGetPTXSize(nvrtcProgram p, size_t *s) { *s = sizeof CODE; return 0; }
int nvrtcGetPTX(nvrtcProgram p, char *out) { memcpy(out, CODE, sizeof CODE); return 0; }
int nvrtcGetCUBINSize(nvrtcProgram p, size_t *s) { *s = sizeof CODE; return 0; }
int nvrtcGetCUBIN(nvrtcProgram p, char *out) { memcpy(out, CODE, sizeof CODE); return 0; }
"""


def build_stub(directory: Path, source: str = STUB_SOURCE, name: str = "libnvrtc.so.11.2") -> Path:
    """Compile ``source`` into a shared library in ``directory``; skip the test without a C compiler."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) to build a stand-in NVRTC")
    src = directory / "stub_nvrtc.c"
    src.write_text(source)
    out = directory / name
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(src)], check=True, capture_output=True)
    return out
