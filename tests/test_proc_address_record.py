"""The registry and the simulated driver against a recording of a real driver's cuGetProcAddress_v2.

``tests/data/proc_addresses-<driver>.json`` is written on a GPU machine by
``tools/record_proc_addresses.py``: for every symbol, every CUDA version 1.0-15.9 and each of
the three flags, the exported entry the real driver returned (or its status / return code).
The simulated driver names its stubs with the registry's own rule, so without this file no
CI test could show that rule wrong.  Here:

* **the registry**: for every symbol it knows, at every recorded version up to the driver's
  own and under both stream flags, the entry it selects is the one the driver returned at
  that version, and also the one the driver returns at the version cuproc actually asks at
  (the variant's own); where the registry says the symbol does not exist, the driver said why
  (not found / version not sufficient) the same way;
* **the simulated driver** (at the recorded driver version) answers every cell, above the
  driver's version included, exactly as the real one did;
* **completeness**: every function the real driver hands out is in the registry, except the
  ones listed in ``NOT_IN_REGISTRY`` (each with the reason).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from cuproc.registry import AVAILABLE, PER_THREAD_NEEDS_7_0, default_registry
from cuproc.version import CudaVersion

ROOT = Path(__file__).resolve().parent.parent
RECORDINGS = sorted((ROOT / "tests" / "data").glob("proc_addresses-*.json"))
LEGACY, PER_THREAD = "1", "2"

#: Functions the recorded driver hands out that headers/ does not declare, and why (none today:
#: the profiler, GL, EGL and VDPAU typedef headers brought the 31 this list once held).
NOT_IN_REGISTRY: dict[str, str] = {}

#: Functions headers/ declares for Linux that the recorded driver neither exports nor hands out.
#: The registry cannot know this (cuproc reports ``symbol_not_found`` at resolution); the
#: simulated driver, a generic one, has them.
NOT_IN_THIS_DRIVER: dict[str, str] = {
    "cuEventCreateFromEGLSync": "cudaEGLTypedefs.h; an EGL-sync function the x86-64 580 driver does not provide",
}

pytestmark = pytest.mark.skipif(not RECORDINGS, reason="no recording in tests/data (run tools/record_proc_addresses.py on a GPU machine)")


def _recorder():  # noqa: ANN202 - the tool module
    spec = importlib.util.spec_from_file_location("record_proc_addresses", ROOT / "tools" / "record_proc_addresses.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _answers(runs: list, versions: list[int]) -> dict[int, str]:
    """Expand one flag's runs to an answer per recorded version."""
    out: dict[int, str] = {}
    i = 0
    for v in versions:
        while i + 1 < len(runs) and runs[i + 1][0] <= v:
            i += 1
        out[v] = runs[i][1]
    return out


def _flag_runs(symbol: dict, flag: str) -> list:
    runs = symbol[flag]
    return symbol["0"] if runs == "=0" else runs


def _expected(name: str, version: int, per_thread: bool, driver: CudaVersion) -> str:
    """What the registry says the driver answers for ``name`` at ``version`` (<= the driver's)."""
    sel = default_registry().select(name, CudaVersion.from_int(version), per_thread=per_thread)
    if sel.symbol.windows_only or name in NOT_IN_THIS_DRIVER:
        return "status:SYMBOL_NOT_FOUND"
    if sel.availability == AVAILABLE:
        return sel.entry_point
    if sel.availability == PER_THREAD_NEEDS_7_0:
        return "status:VERSION_NOT_SUFFICIENT"
    return "status:SYMBOL_NOT_FOUND" if sel.symbol.introduced > driver else "status:VERSION_NOT_SUFFICIENT"


@pytest.fixture(params=RECORDINGS, ids=[p.stem for p in RECORDINGS])
def recording(request: pytest.FixtureRequest) -> dict:
    return _load(request.param)


def test_registry_selects_what_the_real_driver_returned(recording: dict) -> None:
    driver = CudaVersion.from_int(recording["driver_version"])
    reg = default_registry()
    versions = [v for v in recording["versions"] if v <= int(driver)]
    mismatches, cells = [], 0
    for name in reg:
        symbol = recording["symbols"].get(name)
        assert symbol is not None, f"{name} is in the registry but was not recorded: re-record"
        for flag, per_thread in ((LEGACY, False), (PER_THREAD, True)):
            real = _answers(_flag_runs(symbol, flag), recording["versions"])
            for v in versions:
                cells += 1
                want = _expected(name, v, per_thread, driver)
                if real[v] != want:
                    mismatches.append(f"{name} at {CudaVersion.from_int(v)} flag={recording['flags'][flag]}: "
                                      f"registry {want}, driver {real[v]}")
                sel = reg.select(name, CudaVersion.from_int(v), per_thread=per_thread)
                if sel.exists and name not in NOT_IN_THIS_DRIVER and real[int(sel.query_version)] != sel.entry_point:
                    mismatches.append(f"{name} asked at {sel.query_version} (selected at {CudaVersion.from_int(v)}) "
                                      f"flag={recording['flags'][flag]}: registry {sel.entry_point}, "
                                      f"driver {real[int(sel.query_version)]}")
    assert cells > 100_000
    assert not mismatches, f"{len(mismatches)} of {cells} cells differ:\n" + "\n".join(mismatches[:40])


def test_default_flag_answers_like_the_legacy_stream_flag(recording: dict) -> None:
    """cuproc asks with CU_GET_PROC_ADDRESS_LEGACY_STREAM; the recording says DEFAULT is the same."""
    differ = [n for n, s in recording["symbols"].items() if _flag_runs(s, LEGACY) != s["0"]]
    assert not differ


def test_simulated_driver_answers_every_cell_like_the_real_one(recording: dict, sims) -> None:
    sim = sims["v2"]
    sim.set_version(recording["driver_version"])
    simulated = _recorder().record(str(sim.path))["symbols"]
    reg = default_registry()
    mismatches, cells = [], 0
    for name in reg:
        if name in NOT_IN_THIS_DRIVER:
            continue
        for flag in recording["flags"]:
            real = _answers(_flag_runs(recording["symbols"][name], flag), recording["versions"])
            sim_answers = _answers(_flag_runs(simulated[name], flag), recording["versions"])
            for v in recording["versions"]:
                cells += 1
                if real[v] != sim_answers[v]:
                    mismatches.append(f"{name} at {CudaVersion.from_int(v)} flag={recording['flags'][flag]}: "
                                      f"simulated {sim_answers[v]}, driver {real[v]}")
    assert cells > 100_000
    assert not mismatches, f"{len(mismatches)} of {cells} cells differ:\n" + "\n".join(mismatches[:40])


def test_registry_and_driver_differ_only_where_listed(recording: dict) -> None:
    reg = default_registry()
    driver = recording["driver_version"]
    handed_out = {
        name for name, symbol in recording["symbols"].items()
        if any(not a.startswith(("status:", "rc:")) and v <= driver
               for flag in recording["flags"] for v, a in _flag_runs(symbol, flag))
    }
    never = {n for n in reg if not reg[n].windows_only and n not in handed_out
             and int(reg[n].introduced) <= driver}
    assert never == set(NOT_IN_THIS_DRIVER), f"never handed out: {sorted(never)}"
    missing = handed_out - set(reg)
    assert missing == set(NOT_IN_REGISTRY), (
        f"handed out but not in the registry, and not listed: {sorted(missing - set(NOT_IN_REGISTRY))}; "
        f"listed but now in the registry or not handed out: {sorted(set(NOT_IN_REGISTRY) - missing)}")


def test_recording_names_exported_entries_only(recording: dict) -> None:
    """Every answer is an exported entry, a status or a return code: no pointer left unnamed."""
    odd = {(n, a) for n, s in recording["symbols"].items() for f in recording["flags"]
           for _, a in _flag_runs(s, f) if a in ("unexported", "null")}
    assert not odd


def test_recorder_reads_the_dynamic_symbol_table(sims) -> None:
    """The tool's ELF reader finds the simulated driver's stubs and nothing undefined."""
    functions = _recorder().elf_functions(str(sims["v2"].path))
    assert {"cuGetProcAddress_v2", "cuCtxCreate_v4", "cuMemcpyHtoD_v2_ptds"} <= set(functions)
    assert "strcmp" not in functions   # imported, not defined


@pytest.mark.gpu
def test_recording_of_this_driver_is_current(tmp_path) -> None:
    """On a GPU machine: recording the installed driver again gives the committed file's answers."""
    import cuproc
    if not cuproc.is_driver_available():
        pytest.skip("no CUDA driver on this machine")
    fresh = _recorder().record("libcuda.so.1")
    committed = ROOT / "tests" / "data" / f"proc_addresses-{fresh['driver_version']}.json"
    if not committed.exists():
        pytest.skip(f"no recording for driver {fresh['driver_version']}: run tools/record_proc_addresses.py")
    old = _load(committed)
    if old["driver_library"] != fresh["driver_library"]:
        pytest.skip(f"recorded on {old['driver_library']}, this is {fresh['driver_library']}")
    assert {n: fresh["symbols"][n] for n in old["symbols"]} == old["symbols"]
    # Names added to the registry since the recording must be ones this driver does not hand out.
    never = {"0": [[1000, "status:SYMBOL_NOT_FOUND"], [fresh["driver_version"] + 10, "rc:CUDA_ERROR_INVALID_VALUE"]],
             "1": "=0", "2": "=0"}
    unrecorded = {n for n in fresh["symbols"] if n not in old["symbols"] and fresh["symbols"][n] != never}
    assert not unrecorded, f"re-record: the registry gained {sorted(unrecorded)}, which this driver hands out"
