"""The checked-in kernels (kernels/, built by tools/build_kernels.sh) load on every GPU nvcc 13.0 supports
(issue 37): the fatbins carry SASS for sm_75 to sm_121 plus PTX a CUDA 13.0 driver can JIT for a newer GPU,
and the files stay small.  Read from the fatbin container's headers, so it runs on CPU (no cuobjdump)."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from cuproc.ptx_isa import PtxIsa, driver_accepts, ptx_isa_of
from cuproc.version import CudaVersion

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
FATBINS = ("kernels.fatbin", "graph_kernels.fatbin")
# What nvcc 13.0 builds SASS for (nvcc --list-gpu-code): the architectures a CUDA 13 driver runs.
NVCC_13_0 = (75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121)
DRIVER = CudaVersion(13, 0)       # the oldest driver the nvcc 13.0 artifacts are for
MAX_BYTES = 100_000               # per file: the repository stays small


def fatbin_entries(data: bytes) -> list[tuple[str, int, PtxIsa | None]]:
    """(kind "sass" or "ptx", architecture number, PTX ISA) of each entry of a fatbin container: a 16-byte
    header (magic 0xBA55ED50, version, header size, payload size), then entries, each a header (kind 1 PTX,
    2 ELF; its own size at 4; the payload size at 8; for PTX the ISA as minor, major at 24; the
    architecture at 28) and its payload."""
    magic, _, header, size = struct.unpack_from("<IHHQ", data, 0)
    assert magic == 0xBA55ED50, "not a fatbin container"
    out = []
    offset, end = header, header + size
    while offset < end:
        kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, offset)
        minor, major, arch = struct.unpack_from("<HHI", data, offset + 24)
        assert kind in (1, 2), f"unknown fatbin entry kind {kind} at {offset}"
        out.append(("ptx" if kind == 1 else "sass", arch, PtxIsa(major, minor) if kind == 1 else None))
        offset += entry_header + payload
    assert offset == end
    return out


@pytest.mark.parametrize("name", FATBINS)
def test_each_fatbin_has_sass_for_every_architecture_and_ptx_for_newer_gpus(name):
    entries = fatbin_entries((KERNELS / name).read_bytes())
    assert sorted(arch for kind, arch, _ in entries if kind == "sass") == list(NVCC_13_0)
    ptx = [(arch, isa) for kind, arch, isa in entries if kind == "ptx"]
    assert [arch for arch, _ in ptx] == [max(NVCC_13_0)]        # JIT-compiled on a GPU newer than all these
    assert all(driver_accepts(isa, DRIVER) for _, isa in ptx)   # by a CUDA 13.0 driver's JIT


def test_the_ptx_is_for_the_oldest_architecture_and_has_every_kernel():
    ptx = (KERNELS / "kernels.ptx").read_bytes()
    assert re.search(rb"^\.target sm_75\b", ptx, re.M)
    assert driver_accepts(ptx_isa_of(ptx), DRIVER)
    source = (KERNELS / "kernels.cu").read_text()
    kernels = re.findall(r'extern "C" __global__ void (\w+)\(', source)
    assert len(kernels) >= 10
    entries = re.findall(rb"^\.visible \.entry (\w+)\(", ptx, re.M)
    assert sorted(e.decode() for e in entries) == sorted(kernels)
    for linked in ("ptxjit_a.ptx", "ptxjit_b.ptx"):
        assert re.search(rb"^\.target sm_75\b", (KERNELS / linked).read_bytes(), re.M)


def test_the_artifacts_stay_small():
    for path in KERNELS.iterdir():
        assert path.stat().st_size <= MAX_BYTES, f"{path.name} is {path.stat().st_size} bytes"
    assert not (KERNELS / "graph_kernels.cubin").exists()   # replaced by graph_kernels.fatbin
