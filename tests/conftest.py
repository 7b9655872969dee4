"""Shared fixtures. GPU tests carry the ``gpu`` marker and skip only when no driver can be opened."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from simdriver import build

ROOT = Path(__file__).resolve().parent.parent
HEADERS = ROOT / "headers"


def shard_of(value: str) -> tuple[int, int]:
    """``CUPROC_TEST_SHARD``'s "K/N" as (K, N), 1 <= K <= N; a UsageError naming the variable otherwise."""
    found = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", value)
    if found is None or not 1 <= int(found[1]) <= int(found[2]):
        raise pytest.UsageError(f"CUPROC_TEST_SHARD is K/N with 1 <= K <= N (the K-th of N shards), not {value!r}")
    return int(found[1]), int(found[2])


def pytest_collection_finish(session):
    """Freeze what collection made (the test modules, their items, cuproc's import-time objects) out of the
    garbage collector's reach: the fake-driver fixtures call ``gc.collect()`` around every test (finalizers
    must run before the fake's counters are read), and scanning those few hundred thousand long-lived objects
    each time cost about 0.15 s a test -- most of a checkout's ``pytest``.  Objects a test makes are collected
    as always."""
    import gc
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """``CUPROC_TEST_SHARD=K/N``: run every N-th test from the K-th on, the rest deselected.

    Why: tools/gpu_check.sh runs the suite in two device calls (one may run ten minutes); shards taken
    test by test stay even as files are added, where every other *file* did not (one new file moved the
    slow GPU files into one half, which then ran past its call)."""
    value = os.environ.get("CUPROC_TEST_SHARD")
    if not value:
        return
    k, n = shard_of(value)
    kept = [item for i, item in enumerate(items) if i % n == k - 1]
    dropped = [item for i, item in enumerate(items) if i % n != k - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def pfn_typedef_names() -> list[str]:
    """Every PFN typedef name in headers/, read straight from the text (independent of cuproc)."""
    text = (HEADERS / "cuda_pfn.h").read_text()
    return re.findall(r"\(\*(PFN_\w+)\)", text)


@pytest.fixture(scope="session")
def sims(tmp_path_factory):
    """The simulated driver, one library per lookup generation (cuGetProcAddress_v2, v1, dlsym only)."""
    try:
        out = tmp_path_factory.mktemp("simdriver")
        return {gen: build(out, gen) for gen in ("v2", "v1", "none")}
    except (RuntimeError, subprocess.CalledProcessError) as exc:  # pragma: no cover - CI has cc
        pytest.skip(f"cannot build the simulated driver: {exc}")


@pytest.fixture()
def sim(sims):
    """The cuGetProcAddress_v2 simulated driver as a CUDA 13.0 driver whose entries return CUDA_SUCCESS."""
    s = sims["v2"]
    s.set_version(13000)
    s.set_result(0)
    return s



@pytest.fixture(scope="session")
def fake(tmp_path_factory):
    """The stateful fake driver (tests/fakedriver.c), built once per session."""
    from fakedriver import build as build_fake
    try:
        return build_fake(tmp_path_factory.mktemp("fakedriver"))
    except (RuntimeError, subprocess.CalledProcessError) as exc:  # pragma: no cover - CI has cc
        pytest.skip(f"cannot build the fake driver: {exc}")


@pytest.fixture()
def fk(fake):
    """A fresh fake driver state as cuproc's default handle; afterwards nothing stale reached it."""
    import gc

    import cuproc
    gc.collect()
    fake.reset()
    fake.set_reuse(True)      # handles and addresses come back, as on a GPU (fk_strict: never)
    cuproc.set_default_driver(cuproc.Driver(library=str(fake.path)))
    yield fake
    gc.collect()
    # What survived the collection is alive (test modules' state, pytest's reports): frozen out of the later
    # collections' reach, which then scan only what the next test makes.  Setup and teardown of a checkout's
    # pytest fell from 84 s to 6 s (1323 tests, this machine, 2026-11-29); each test still gets a full
    # collection of its own objects before the fake's counters are read.
    gc.freeze()
    stale, calls = fake.stale_count(), fake.stale_calls()
    unordered, unordered_calls = fake.unordered_frees(), fake.unordered_calls()
    misrouted, misrouted_calls = fake.misrouted_count(), fake.misrouted_calls()
    cuproc.set_default_driver(None)
    assert stale == 0, f"stale handles reached the driver in: {calls}"
    assert unordered == 0, f"stream-ordered frees not ordered after work on the memory: {unordered_calls}"
    assert misrouted == 0, f"work on a context's memory ran in another, current context: {misrouted_calls}"


@pytest.fixture()
def fk_strict(fk):
    """``fk`` with reuse off: every handle and cuMemAlloc address is new, so a stale use of one is
    counted by the fake itself (a test of what the fake catches, not of cuproc's identity rules)."""
    fk.set_reuse(False)
    yield fk
    fk.set_reuse(True)


@pytest.fixture()
def pc(fk):
    """Device 0's primary context retained and current (on the fake driver); released afterwards."""
    import cuproc
    pc = cuproc.use_device(0)
    yield pc
    cuproc.driver.default_driver().cuCtxSetCurrent(cuproc.ffi.NULL)
    while pc.retain_count:
        pc.release()


@pytest.fixture()
def primary():
    """Device 0's primary context retained and current on the real driver (GPU tests); released afterwards."""
    import cuproc
    pc = cuproc.use_device(0)
    yield pc
    cuproc.driver.default_driver().cuCtxSetCurrent(cuproc.ffi.NULL)
    pc.release()


@pytest.fixture()
def imex_channel(tmp_path, monkeypatch):
    """An IMEX channel this process may open (fabric handles need one: cuproc.pools.imex_channel_available),
    in a folder of the test's; a test that wants none empties the folder."""
    from cuproc import pools
    folder = tmp_path / "imex-channels"
    folder.mkdir()
    (folder / "channel0").write_bytes(b"")
    monkeypatch.setattr(pools, "IMEX_CHANNELS", str(folder))
    return folder
