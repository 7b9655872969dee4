"""NVRTC's declarations: headers/nvrtc.h as tools/gen_nvrtc_header.py trims it, the modules built from it,
and the agreement of both with the nvrtc.h and the library installed here."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from cuproc import _nvrtc_header_data as data
from cuproc import nvrtc as nv
from cuproc.version import CudaVersion
from nvrtc_testing import needs_nvrtc, private_cache  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(data.__file__).resolve().parent   # the checkout's cuproc, or the installed wheel's (CI's sdist run)
sys.path.insert(0, str(ROOT / "tools"))
import gen_nvrtc_header as tool  # noqa: E402

HEADER = (ROOT / "headers" / "nvrtc.h").read_text()
PROVENANCE = json.loads((ROOT / "headers" / "nvrtc_provenance.json").read_text())


def _prototypes() -> dict[str, str]:
    """Function name -> its prototype line in headers/nvrtc.h (one line each, as the tool writes them)."""
    return {line.split("(")[0].split()[-1].lstrip("*"): line for line in HEADER.splitlines()
            if line.endswith(");") and not line.startswith(("typedef", "}"))}


def test_the_modules_are_built_from_the_header(tmp_path):
    shutil.copy(ROOT / "headers" / "nvrtc.h", tmp_path)
    shutil.copy(ROOT / "headers" / "nvrtc_provenance.json", tmp_path)
    tool.build_modules(tmp_path, tmp_path)
    for name in ("_nvrtc_cffi.py", "_nvrtc_header_data.py"):
        assert (tmp_path / name).read_text() == (PACKAGE / name).read_text(), \
            f"cuproc/{name} is stale: run python tools/gen_nvrtc_header.py --modules-only"


def test_the_declarations_parse_and_cover_every_function():
    import cffi
    ffi = cffi.FFI()
    ffi.cdef(tool.cdef_of(HEADER))   # the text parses as C
    from cuproc._nvrtc_cffi import ffi as built
    results = built.typeof("nvrtcResult").relements
    assert results["NVRTC_SUCCESS"] == 0 and results["NVRTC_ERROR_COMPILATION"] == 6
    assert set(_prototypes()) == set(data.DECLARED) == set(PROVENANCE["functions"])
    assert data.NVRTC_HEADERS == tuple(h["version"] for h in PROVENANCE["nvrtc"])
    assert data.DECLARED["nvrtcGetLTOIR"][0] == "12.0" and data.DECLARED["nvrtcCompileProgram"][0] == "11.8"
    assert data.MACROS["NVRTC_INSTALL_HEADERS_FORCE_OVERWRITE"] == 1


def _installed_headers() -> list[tuple[Path, bool]]:
    """(nvrtc.h, whether it is the one of the NVRTC found here) for the wheel's include/ beside the NVRTC
    found here, and a toolkit's."""
    found = []
    location = nv.locate()
    if location is not None:
        found.append((Path(location.path).resolve().parent.parent / "include" / "nvrtc.h", True))
    found.append((Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include" / "nvrtc.h", False))
    return [(p, beside) for p, beside in dict(found).items() if p.is_file()]


@pytest.mark.parametrize("header,beside", _installed_headers() or [(None, False)])
def test_the_trimmed_header_matches_the_installed_nvrtc_h(header, beside, tmp_path):
    """Every function of an installed nvrtc.h is in headers/nvrtc.h with the same prototype, as the tool
    trims it; a function it lacks is one its release did not have (newer, or dropped before it)."""
    if header is None:
        pytest.skip("no nvrtc.h installed here (pip install 'cuproc[nvrtc]')")
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C preprocessor ({cc})")
    pytest.importorskip("pycparser")
    (tmp_path / "nvrtc.h").write_bytes(header.read_bytes())
    installed = tool.extract("installed", tmp_path, cc)
    ours = _prototypes()
    for name, text in installed.functions.items():
        assert ours.get(name) == text, f"{name}: {header} declares {text!r}, headers/nvrtc.h {ours.get(name)!r}"
    version = nv.open_nvrtc().version if beside and nv.is_nvrtc_available() else None
    for name in set(ours) - set(installed.functions):
        first, last = (CudaVersion.parse(v) for v in data.DECLARED[name])
        if version is not None:   # the header of the NVRTC loaded here: its release did not have the function
            assert first > version or last < version, f"{name} ({first}-{last}) is missing from {header} ({version})"
        else:                     # a toolkit's header of unknown release: not one every pinned release had
            assert data.DECLARED[name] != (data.NVRTC_HEADERS[0], data.NVRTC_HEADERS[-1]), name
    for type_name, text in installed.types.items():   # the same types; an enum may have grown since
        assert re.search(rf"\b{type_name};", HEADER), type_name
        for enumerator in re.findall(r"(NVRTC_\w+ = \d+)", text):
            assert enumerator in HEADER, f"{type_name}: {enumerator}"


def test_the_tool_merges_oldest_first_and_refuses_a_changed_prototype():
    old = tool.NvrtcHeader("12.0", "a", {"nvrtcResult": "typedef int nvrtcResult;"},
                           {"nvrtcGone": "nvrtcResult nvrtcGone(void);", "nvrtcKept": "nvrtcResult nvrtcKept(int a);"},
                           {"NVRTC_X": 1})
    new = tool.NvrtcHeader("13.0", "b", {"nvrtcResult": "typedef int nvrtcResult;"},
                           {"nvrtcKept": "nvrtcResult nvrtcKept(int a);", "nvrtcNew": "nvrtcResult nvrtcNew(void);"}, {})
    text, provenance = tool.merge([old, new])
    assert provenance["functions"] == {"nvrtcGone": ["12.0"], "nvrtcKept": ["12.0", "13.0"], "nvrtcNew": ["13.0"]}
    assert "nvrtcResult nvrtcGone(void);" in text and "#define NVRTC_X 1" in text
    assert "'nvrtcGone': ('12.0', '12.0')" in tool.data_module_text(provenance)
    changed = tool.NvrtcHeader("13.0", "b", new.types, {"nvrtcKept": "nvrtcResult nvrtcKept(long a);"}, {})
    with pytest.raises(SystemExit, match="nvrtcKept changed"):
        tool.merge([old, changed])


@needs_nvrtc
def test_the_loaded_nvrtc_exports_what_its_release_declares_and_says_why_not():
    lib = nv.open_nvrtc()
    newest = CudaVersion.parse(data.NVRTC_HEADERS[-1])
    for name, (first, last) in data.DECLARED.items():
        first_v, last_v = CudaVersion.parse(first), CudaVersion.parse(last)
        expected = first_v <= lib.version and (last_v >= lib.version or last_v == newest)
        if lib.version > newest and last_v < newest:
            continue   # an NVRTC newer than the headers: what it kept of the dropped ones is unknown
        assert lib.has(name) == expected, name
        if not expected:
            with pytest.raises(nv.NvrtcFunctionMissingError) as err:
                lib.function(name)
            word = "needs NVRTC" if first_v > lib.version else "dropped"
            assert word in str(err.value) and str(lib.version) in str(err.value) and err.value.call == name
    with pytest.raises(nv.NvrtcFunctionMissingError, match="not a function of nvrtc.h"):
        lib.function("nvrtcNoSuchThing")
