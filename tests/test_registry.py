"""The registry against the rules measured on a real driver, restated here independently."""
import re
from collections import defaultdict

import pytest

from cuproc.registry import PER_THREAD_MIN_VERSION, Registry, default_registry
from cuproc.version import CudaVersion
from rules import WINDOWS_ONLY, expected_entry

VERSIONS = ["2.0", "3.2", "4.0", "6.5", "7.0", "9.2", "10.0", "10.1", "11.3", "11.4", "11.8", "12.0",
            "12.3", "12.4", "12.5", "12.8", "12.9", "13.0", "13.1", "13.5"]


@pytest.fixture(scope="module")
def by_symbol(pfn_typedef_names):
    grouped = defaultdict(list)
    for t in pfn_typedef_names:
        grouped[re.match(r"^PFN_(\w+?)_v\d+", t).group(1)].append(t)
    return grouped


def test_symbol_count(by_symbol):
    assert len(default_registry()) == len(by_symbol) == 561  # 485 in cudaTypedefs.h, 32 in the other Linux headers, 44 D3D


@pytest.mark.parametrize("per_thread", [False, True])
@pytest.mark.parametrize("requested", VERSIONS)
def test_every_symbol_selects_by_the_rule(by_symbol, requested, per_thread):
    reg = default_registry()
    for name, typedefs in by_symbol.items():
        sel = reg.select(name, requested, per_thread=per_thread)
        expected = None if name in WINDOWS_ONLY else expected_entry(typedefs, name, int(CudaVersion.parse(requested)), per_thread)
        assert sel.entry_point == expected, (name, requested)
        if sel.entry_point is not None:
            assert sel.typedef in typedefs
            assert sel.query_version <= max(CudaVersion.parse(requested), PER_THREAD_MIN_VERSION)
            assert sel.variant.version <= CudaVersion.parse(requested)



@pytest.mark.parametrize("per_thread", [False, True])
@pytest.mark.parametrize("requested", VERSIONS)
def test_entry_table_says_what_select_says(requested, per_thread):
    """entries() (the table preload walks) and entry() agree with select() for every symbol, on both
    platforms; the table is built once per (version, flag)."""
    for platform in ("linux", "win32"):
        reg = default_registry().without(platform=platform)
        table = reg.entries(requested, per_thread=per_thread)
        assert list(table) == list(reg)
        for name in reg:
            sel = reg.select(name, requested, per_thread=per_thread)
            want = (sel.availability, sel.entry_point, sel.typedef,
                    None if sel.query_version is None else int(sel.query_version),
                    int(sel.variant.version) if sel.variant else None, int(sel.symbol.introduced))
            assert tuple(table[name]) == tuple(reg.entry(name, requested, per_thread=per_thread)) == want, name
        assert reg.entries(CudaVersion.parse(requested), per_thread=per_thread) is table
    with pytest.raises(KeyError):
        default_registry().entry("cuNoSuchFunction", requested)


def test_the_order_of_a_symbols_typedef_names_does_not_matter():
    """The registry parses names listed as _header_data lists them (default-stream oldest first, then
    per-thread newest first) in one pass and sorts any other order: both give the same tables, Symbols and
    selections, on both platforms; a repeated version (a leading zero) counts once, as its last spelling."""
    from cuproc._header_data import SYMBOL_TYPEDEFS
    from cuproc._header_toolkits import PFN_TOOLKITS
    reversed_names = {name: tuple(reversed(typedefs)) for name, typedefs in SYMBOL_TYPEDEFS.items()}
    assert sum(reversed_names[n] != SYMBOL_TYPEDEFS[n] for n in SYMBOL_TYPEDEFS) == 161
    for platform in ("linux", "win32"):
        listed, other = (Registry(data, PFN_TOOLKITS, windows_only=WINDOWS_ONLY, platform=platform)
                         for data in (SYMBOL_TYPEDEFS, reversed_names))
        for requested in ("6.5", "7.0", "11.4", "12.5", "13.0", "13.5"):
            for per_thread in (False, True):
                assert dict(other.entries(requested, per_thread=per_thread)) == \
                    dict(listed.entries(requested, per_thread=per_thread))
                for name in ("cuCtxCreate", "cuMemcpyHtoD", "cuStreamBeginCapture", "cuWGLGetDevice"):
                    a = listed.select(name, requested, per_thread=per_thread)
                    b = other.select(name, requested, per_thread=per_thread)
                    assert (a.availability, a.entry_point, a.typedef, a.query_version) == \
                        (b.availability, b.entry_point, b.typedef, b.query_version), (name, requested)
        assert all(other[name] == listed[name] for name in SYMBOL_TYPEDEFS)
    twice = Registry({"cuFoo": ["PFN_cuFoo_v2000", "PFN_cuFoo_v3020", "PFN_cuFoo_v02000"]})
    assert [(int(v.version), v.typedef, v.entry) for v in twice["cuFoo"].variants] == \
        [(2000, "PFN_cuFoo_v02000", "cuFoo"), (3020, "PFN_cuFoo_v3020", "cuFoo_v2")]
    assert tuple(twice.entries("2.0")["cuFoo"]) == ("available", "cuFoo", "PFN_cuFoo_v02000", 2000, 2000, 2000)


def test_the_default_registrys_tables_take_the_generated_versions_and_agree_with_parsing():
    """default_registry's selection tables take _header_data.SYMBOL_ABI_KEYS (every symbol's versions,
    read when headers/ were compiled) instead of parsing the names: the versions are what the registry's
    parser reads, and each table equals a parsing registry's, on both platforms, at versions around
    every ABI boundary, with both stream flags."""
    from cuproc._header_data import SYMBOL_ABI_KEYS, SYMBOL_TYPEDEFS
    from cuproc.registry import parsed_typedefs
    expected = []
    for sym in sorted(SYMBOL_TYPEDEFS):
        keys, _, per_thread, _ = parsed_typedefs(sym, SYMBOL_TYPEDEFS[sym])
        expected.append(keys[0] if len(SYMBOL_TYPEDEFS[sym]) == 1 else (len(keys), *keys, *(k for k, _ in per_thread)))
    assert SYMBOL_ABI_KEYS == tuple(expected) and sum(isinstance(v, tuple) for v in expected) == 161
    every = sorted({k for v in SYMBOL_ABI_KEYS for k in ((v,) if isinstance(v, int) else v[1:])})
    versions = sorted({v for k in every for v in (k - 10, k)} | {every[-1] + 10})
    for platform in ("linux", "win32"):
        taking, parsing = (Registry(SYMBOL_TYPEDEFS, windows_only=WINDOWS_ONLY, platform=platform) for _ in range(2))
        taking._abi_keys = SYMBOL_ABI_KEYS          # as default_registry() sets them
        for requested in versions:
            for per_thread in (False, True):
                v = CudaVersion.from_int(requested)
                assert dict(taking.entries(v, per_thread=per_thread)) == dict(parsing.entries(v, per_thread=per_thread))
    assert default_registry()._abi_keys is SYMBOL_ABI_KEYS
    assert default_registry().entries("12.0") == Registry(SYMBOL_TYPEDEFS, windows_only=WINDOWS_ONLY).entries("12.0")


def test_generated_data_lists_typedefs_in_the_one_pass_order():
    from cuproc._header_data import SYMBOL_TYPEDEFS
    for name, typedefs in SYMBOL_TYPEDEFS.items():
        parsed = [re.match(rf"^PFN_{name}_v(\d+)(_ptds|_ptsz)?$", t).groups() for t in typedefs]
        base = [int(v) for v, suffix in parsed if suffix is None]
        per_thread = [int(v) for v, suffix in parsed if suffix is not None]
        assert [s is not None for _, s in parsed] == [False] * len(base) + [True] * len(per_thread), name
        assert base == sorted(set(base)) and per_thread == sorted(set(per_thread), reverse=True), name


@pytest.mark.parametrize("name,requested,per_thread,entry", [
    ("cuCtxCreate", "2.0", False, "cuCtxCreate"),
    ("cuCtxCreate", "3.2", False, "cuCtxCreate_v2"),
    ("cuCtxCreate", "11.4", False, "cuCtxCreate_v3"),
    ("cuCtxCreate", "12.5", False, "cuCtxCreate_v4"),
    ("cuStreamGetCaptureInfo", "10.1", False, "cuStreamGetCaptureInfo"),
    ("cuStreamGetCaptureInfo", "11.3", False, "cuStreamGetCaptureInfo_v2"),
    ("cuStreamGetCaptureInfo", "12.3", False, "cuStreamGetCaptureInfo_v3"),
    ("cuCtxDestroy", "2.0", False, "cuCtxDestroy"),
    ("cuCtxDestroy", "4.0", False, "cuCtxDestroy_v2"),
    ("cuMemcpyHtoD", "13.0", True, "cuMemcpyHtoD_v2_ptds"),
    ("cuLaunchKernel", "13.0", True, "cuLaunchKernel_ptsz"),
    ("cuStreamBeginCapture", "10.1", True, "cuStreamBeginCapture_v2_ptsz"),
    ("cuMemcpyHtoD", "6.5", True, None),
    ("cuMemAlloc", "6.5", True, "cuMemAlloc_v2"),   # no per-thread form: same under every flag
    ("cuLibraryLoadData", "11.8", False, None),
    ("cuLibraryLoadData", "12.0", False, "cuLibraryLoadData"),
])
def test_measured_facts(name, requested, per_thread, entry):
    assert default_registry().select(name, requested, per_thread=per_thread).entry_point == entry


def test_query_version_is_the_variants_own_never_the_request():
    reg = default_registry()
    sel = reg.select("cuCtxCreate", "13.5")
    assert sel.query_version == CudaVersion(12, 5)
    pt = reg.select("cuMemcpyHtoD", "13.0", per_thread=True)
    assert pt.query_version == CudaVersion(7, 0) and pt.typedef == "PFN_cuMemcpyHtoD_v7000_ptds"
    assert reg.select("cuStreamBeginCapture", "10.0", per_thread=True).typedef == "PFN_cuStreamBeginCapture_v10000_ptsz"


def test_newer_driver_feature_is_told_apart():
    reg = default_registry()
    assert reg.select("cuLibraryLoadData", "11.8").newer_driver_feature
    assert not reg.select("cuLibraryLoadData", "12.0").newer_driver_feature
    assert not reg.select("cuMemcpyHtoD", "6.5", per_thread=True).newer_driver_feature
    assert reg.select("cuMemcpyHtoD", "6.5", per_thread=True).entry_point is None


def test_filter_and_diff():
    reg = default_registry()
    names = [s.name for s in reg.filter(["cuCtxCreate*", "cuMemcpyHtoD"])]
    assert names == sorted(names) and "cuCtxCreate" in names and "cuMemcpyHtoD" in names
    assert all(n.startswith("cuCtxCreate") or n == "cuMemcpyHtoD" for n in names)
    changes = {c.name: c for c in reg.diff("12.4", "12.5")}
    assert changes["cuCtxCreate"].kind == "changed"
    assert (changes["cuCtxCreate"].before.entry_point, changes["cuCtxCreate"].after.entry_point) == \
        ("cuCtxCreate_v3", "cuCtxCreate_v4")
    added = {c.name for c in reg.diff("11.8", "12.0") if c.kind == "added"}
    assert "cuLibraryLoadData" in added and "cuCtxCreate" not in added
    assert reg.diff("12.4", "12.4") == []


def test_registry_rejects_malformed_typedefs():
    with pytest.raises(ValueError):
        Registry.from_typedefs(["PFN_cuFoo"])
    with pytest.raises(ValueError):
        Registry.from_typedefs(["PFN_cuFoo_v7000_ptds"])
    with pytest.raises(ValueError):
        Registry.from_typedefs(["PFN_cuFoo_v2000", "PFN_cuFoo_v7000_ptds", "PFN_cuFoo_v7000_ptsz"])
    lazy = Registry({"cuFoo": ["PFN_cuFoo_vX"], "cuBar": ["PFN_cuBaz_v2000"]})   # validated on first use
    for name in ("cuFoo", "cuBar"):
        with pytest.raises(ValueError, match=name):
            lazy.entry(name, "13.0")
        with pytest.raises(ValueError, match=name):
            lazy.select(name, "13.0")
    # a selection table (what preload walks) refuses the same names, whether one typedef or several
    for typedefs in (["PFN_cuFoo_v２０００"], ["PFN_cuFoo_v-2000"], ["PFN_cuFoo_v2000", "PFN_cuFoo_v2000x"],
                     ["PFN_cuFoo_v2000", "PFN_cuFo_v3020"], ["PFN_cuFoo_v2000_ptds"], ["PFN_cuFoo_v2000", "PFN_cuFoo_v+3020"]):
        with pytest.raises(ValueError, match="cuFoo"):
            Registry({"cuFoo": typedefs}).entries("13.0")


def test_toolkits_recorded_for_every_variant():
    for sym in default_registry().values():
        for v in sym.variants:
            assert v.toolkits, v
    # APIs whose prototypes 13.x removed from cuda.h keep their typedefs, so the registry has them
    for name in ("cuDeviceComputeCapability", "cuTexRefSetArray", "cuTexRefGetAddress", "cuModuleGetTexRef"):
        assert default_registry().select(name, "13.0").entry_point is not None
    assert default_registry()["cuLibraryLoadData"].variants[0].toolkits[0] == "12.0"


def test_platform_is_a_registry_field_and_windows_selects_the_windows_only_entries():
    from cuproc.registry import AVAILABLE, NOT_ON_THIS_PLATFORM
    reg = default_registry()
    linux, windows = reg.without(platform="linux"), reg.without(platform="win32")
    assert (linux.platform, windows.platform) == ("linux", "win32")
    assert linux.select("cuWGLGetDevice", "13.0").availability == NOT_ON_THIS_PLATFORM
    sel = windows.select("cuWGLGetDevice", "13.0")
    assert sel.availability == AVAILABLE and sel.entry_point == "cuWGLGetDevice"
    assert windows.select("cuD3D11GetDevice", "13.0").exists
    made = Registry.from_typedefs(["PFN_cuWGLGetDevice_v2020"], windows_only=["cuWGLGetDevice"], platform="win32")
    assert made.select("cuWGLGetDevice", "13.0").exists
    assert not Registry.from_typedefs(["PFN_cuWGLGetDevice_v2020"], windows_only=["cuWGLGetDevice"],
                                      platform="linux").select("cuWGLGetDevice", "13.0").exists


def test_from_typedefs_takes_marks_headers_and_aliases():
    reg = Registry.from_typedefs(["PFN_cuWGLGetDevice_v2020", "PFN_cuGraphInstantiate_v11000"],
                                 windows_only=["cuWGLGetDevice"], symbol_headers={"cuWGLGetDevice": "cudaGLTypedefs.h"},
                                 header_aliases={"cuGraphInstantiate": [("12.0", "cuGraphInstantiateWithFlags")]},
                                 platform="linux")
    assert reg["cuWGLGetDevice"].windows_only and reg["cuWGLGetDevice"].header == "cudaGLTypedefs.h"
    assert reg.header_alias("cuGraphInstantiate", "12.4") == "cuGraphInstantiateWithFlags"
    assert reg.header_alias("cuGraphInstantiate", "11.8") is None
    assert reg.aliased_names == {"cuGraphInstantiate"}


def test_without_keeps_everything_it_knows_about_the_rest():
    full = default_registry()
    less = full.without(["cuDeviceGetCount", "cuCtxCreate"])
    assert "cuDeviceGetCount" not in less and "cuCtxCreate" not in less
    assert len(less) == len(full) - 2
    assert less.platform == full.platform
    for name in ("cuWGLGetDevice", "cuGraphInstantiate", "cuProfilerStart", "cuMemAlloc"):
        assert less[name] == full[name]
        for version in ("11.8", "12.0", "13.0"):
            assert less.select(name, version) == full.select(name, version)
            assert less.header_alias(name, version) == full.header_alias(name, version)
    assert less.aliased_names == full.aliased_names
    with pytest.raises(KeyError, match="cuNoSuch"):
        full.without(["cuNoSuch"])
