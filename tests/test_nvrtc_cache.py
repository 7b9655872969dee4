"""The compile cache on CPU: keys (a changed header misses, nothing else does), where it lives and how it
is switched off, atomic and concurrent writes, corruption, eviction, and a hit that opens no NVRTC."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from cuproc import compile_cache as cc
from cuproc import nvrtc as nv
from cuproc._includes import closure, include_dirs
from cuproc.compile_cache import CacheEntry, CompileCache, cache_key
from cuproc.program import Program
from nvrtc_testing import ARCH, AXPY, SCALE_H, needs_nvrtc, private_cache  # noqa: F401
from subproc import run_python

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- keys

EDGE = ("k.cu", '"c.h"', "/x/c.h", "c" * 64)
BASE = dict(source=b"src", name="k.cu", headers={"a.h": b"A", "b.h": b"B"}, included=[EDGE],
            options=("-O3", "-DN=1"), arch="sm_90", kind="cubin", name_expressions=("f<int>", "g"),
            nvrtc_identity="/x/libnvrtc.so.13.0.48|141163664|1")


def test_every_part_of_a_key_counts_and_nothing_else_does():
    key = cache_key(**BASE)
    changes = [("source", b"src2"), ("name", "j.cu"), ("headers", {"a.h": b"A2", "b.h": b"B"}),
               ("headers", {"a.h": b"A", "c.h": b"B"}), ("included", [EDGE[:3] + ("d" * 64,)]),
               ("included", [("k.cu", "<c.h>", *EDGE[2:])]), ("included", [("j.cu", *EDGE[1:])]),
               ("included", [(*EDGE[:2], "/y/c.h", EDGE[3])]), ("included", [EDGE, EDGE]),
               ("options", ("-DN=1", "-O3")), ("options", ("-O3",)), ("arch", "sm_80"), ("kind", "ptx"),
               ("name_expressions", ("f<int>",)),
               # another build of one version: another file, or one replaced in place (size, modification time)
               ("nvrtc_identity", "/x/libnvrtc.so.13.0.88|141163664|1"),
               ("nvrtc_identity", "/x/libnvrtc.so.13.0.48|141163665|1"),
               ("nvrtc_identity", "/x/libnvrtc.so.13.0.48|141163664|2")]
    keys = {key}
    for field, value in changes:
        other = cache_key(**{**BASE, field: value})
        assert other not in keys, field
        keys.add(other)
    same = [("headers", {"b.h": b"B", "a.h": b"A"}), ("name_expressions", ("g", "f<int>", "g")),
            ("included", (EDGE,))]
    for field, value in same:
        assert cache_key(**{**BASE, field: value}) == key, field
    # parts are length-prefixed: moving bytes between two parts is another key
    assert cache_key(**{**BASE, "source": b"srck", "name": ".cu"}) != key


def test_include_closure_follows_nvrtcs_search(tmp_path, monkeypatch):
    (tmp_path / "inc" / "sub").mkdir(parents=True)
    (tmp_path / "inc" / "top.h").write_text('#include "sub/mid.h"\n#include <cuda_fp16.h>\n')
    (tmp_path / "inc" / "sub" / "mid.h").write_text('#include "leaf.h"\n#include "top.h"\n')   # a cycle
    (tmp_path / "inc" / "sub" / "leaf.h").write_text("#define LEAF 1\n")
    (tmp_path / "beside.h").write_text("#define BESIDE 1\n")
    (tmp_path / "pre.h").write_text("#define PRE 1\n")
    monkeypatch.chdir(tmp_path)
    src = b'#include <top.h>\n#include "beside.h"\n#include "given.h"\n  #  include "nowhere.h"\n'
    found = closure(src, "k.cu", {"given.h": b'#include "leaf2.h"\n'}, ["-I", "inc", "-include", "pre.h"])
    names = sorted(os.path.relpath(p, tmp_path) for p in found.files)
    assert names == ["beside.h", "inc/sub/leaf.h", "inc/sub/mid.h", "inc/top.h", "pre.h"]
    assert found.untracked == []
    # <...> is not searched beside the program
    assert not closure(b"#include <beside.h>\n", "k.cu", {}, []).files
    assert closure(b"#include HEADER\n", "k.cu", {}, []).untracked == ["#include HEADER"]
    assert include_dirs(["-Ia", "-I", "b", "--include-path=c", "--include-path", "d", "-Ie", "--pre-include=p",
                         "-include", "q", "-DI=1"]) == (["a", "b", "c", "d", "e"], ["p", "q"])


def test_which_name_resolved_to_which_contents_is_keyed(tmp_path, monkeypatch):
    """Two headers that swap contents read the same set of digests: the key must still change (C1)."""
    monkeypatch.chdir(tmp_path)
    src = b'#include "a.h"\n#include "b.h"\n'

    def key():
        edges = closure(src, "k.cu", {}, []).edges
        return cache_key(**{**BASE, "included": edges})

    (tmp_path / "a.h").write_text("#define V 1\n")
    (tmp_path / "b.h").write_text("#undef V\n#define V 2\n")
    before = key()
    (tmp_path / "a.h").write_text("#undef V\n#define V 2\n")
    (tmp_path / "b.h").write_text("#define V 1\n")
    assert key() != before


@pytest.mark.parametrize("line", [b'#include /* c */ "a.h"\n', b'#include\t/**/<a.h>\n', b'%:include "a.h"\n',
                                  b'/* x */ # include "a.h" // y\n', b'#include \\\n "a.h"\n', b'#include"a.h"\n'])
def test_every_spelling_of_an_include_is_followed(tmp_path, monkeypatch, line):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.h").write_text("#define V 1\n")
    found = closure(line, "k.cu", {}, ["-I."])
    assert list(found.files) == [str(tmp_path / "a.h")] and found.untracked == []


@pytest.mark.parametrize("line", [b"#include HEADER\n", b"#include /* c */ HEADER\n", b'#include_next "a.h"\n',
                                  b'#include "a.h" trailing\n', b"%:include <a.h\n", b'#import "a.h"\n'])
def test_an_include_that_does_not_parse_turns_the_cache_off(tmp_path, monkeypatch, line):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.h").write_text("#define V 1\n")
    assert closure(line, "k.cu", {}, ["-I."]).untracked


def test_includes_in_comments_and_strings_are_not_followed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.h").write_text("#define V 1\n")
    src = b'// #include "a.h"\n/*\n#include "a.h"\n*/\nconst char* s = "/* not a comment";\n'
    found = closure(src, "k.cu", {}, [])
    assert found.files == {} and found.untracked == []
    assert closure(src + b'#include "a.h"\n', "k.cu", {}, []).files


def test_a_rewritten_header_is_hashed_again_and_no_text_is_kept(tmp_path, monkeypatch):
    """The per-process memo must not serve a stale digest (L1): identity includes the change time, and a
    file modified within 2 s of being read is read again."""
    from cuproc import _includes
    monkeypatch.chdir(tmp_path)
    h = tmp_path / "cfg.h"
    h.write_text("#define V 1\n")
    st = os.stat(h)
    a = closure(b'#include "cfg.h"\n', "k.cu", {}, [])
    h.write_text("#define V 2\n")                                  # same inode and size
    os.utime(h, ns=(st.st_atime_ns, st.st_mtime_ns))                 # a coarse clock's view: same mtime
    assert closure(b'#include "cfg.h"\n', "k.cu", {}, []).files != a.files
    assert str(h) not in _includes._digests                          # too fresh to remember
    old = time.time_ns() - 10 * 10**9
    os.utime(h, ns=(old, old))
    closure(b'#include "cfg.h"\n', "k.cu", {}, [])
    known = _includes._digests[str(h)]
    assert not any(isinstance(part, bytes) for part in known)      # the digest and includes, never the text


def test_system_headers_are_keyed_by_path_not_walked(tmp_path, monkeypatch):
    """Headers of a toolkit or NVIDIA wheel (CCCL's computed includes) keep the cache on and are not
    walked; a user's header that includes one is still hashed in full (L2)."""
    from cuproc import _includes
    toolkit = tmp_path / "cuda"
    (toolkit / "include" / "cub").mkdir(parents=True)
    (toolkit / "include" / "cub" / "cub.cuh").write_text('#include "detail.cuh"\n')
    (toolkit / "include" / "cub" / "detail.cuh").write_text("#include __THRUST_HOST_SYSTEM_TAG_HEADER\n")
    (toolkit / "version.json").write_text("{}")
    user = tmp_path / "user"
    user.mkdir()
    (user / "mine.h").write_text("#include <cub/cub.cuh>\n")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    monkeypatch.setattr(_includes, "_system", {})
    opts = ["-I", str(user), "-I", str(toolkit / "include")]
    found = closure(b'#include "mine.h"\n', "k.cu", {}, opts)
    assert found.untracked == [] and list(found.files) == [str(user / "mine.h")]
    assert found.system == [str(toolkit / "include" / "cub" / "cub.cuh")]
    assert [e[3].startswith("system ") for e in found.edges] == [False, True]
    # a user header with a computed include still turns the cache off
    (user / "mine.h").write_text("#include USER_HEADER\n")
    assert closure(b'#include "mine.h"\n', "k.cu", {}, opts).untracked == ["#include USER_HEADER"]
    # the toolkit replaced: another key
    (user / "mine.h").write_text("#include <cub/cub.cuh>\n")
    before = closure(b'#include "mine.h"\n', "k.cu", {}, opts).edges
    (toolkit / "include" / "cub" / "cub.cuh").unlink()
    (toolkit / "include" / "cub" / "cub.cuh").write_text('#include "detail.cuh"\n// 13.1\n')
    assert closure(b'#include "mine.h"\n', "k.cu", {}, opts).edges != before


# ----------------------------------------------------------------------------- where, and off

def test_the_cache_directory_follows_xdg_and_the_variables(monkeypatch, tmp_path):
    if sys.platform in ("win32", "darwin"):
        pytest.skip("the XDG rule is the Linux one")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cc.user_cache_dir() == str(tmp_path / "home" / ".cache" / "cuproc")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")   # the spec: a relative value is invalid
    assert cc.user_cache_dir() == str(tmp_path / "home" / ".cache" / "cuproc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.user_cache_dir() == str(tmp_path / "xdg" / "cuproc")
    monkeypatch.delenv("CUPROC_NVRTC_CACHE_DIR")
    assert cc.default_directory() == str(tmp_path / "xdg" / "cuproc" / "nvrtc")
    monkeypatch.setenv("CUPROC_NVRTC_CACHE_DIR", str(tmp_path / "mine"))
    assert cc.resolve(None).directory == str(tmp_path / "mine")   # type: ignore[union-attr]
    assert cc.resolve(str(tmp_path / "arg")).directory == str(tmp_path / "arg")   # type: ignore[union-attr]
    own = CompileCache(tmp_path / "obj")
    assert cc.resolve(own) is own and cc.resolve(False) is None
    for off in ("0", "off", "False", "no"):
        monkeypatch.setenv("CUPROC_NVRTC_CACHE", off)
        assert cc.resolve(None) is None and cc.resolve(True) is not None
    monkeypatch.setenv("CUPROC_NVRTC_CACHE", "maybe")
    with pytest.raises(ValueError, match="CUPROC_NVRTC_CACHE"):
        cc.resolve(None)
    with pytest.raises(TypeError, match="cache="):
        cc.resolve(3)   # type: ignore[arg-type]


def test_sizes():
    assert cc.parse_size("512M") == 512 << 20 and cc.parse_size("2GiB") == 2 << 30 and cc.parse_size("100") == 100
    assert cc.parse_size("1.5k") == 1536
    for bad in ("", "lots", "-1", "0"):
        with pytest.raises(ValueError):
            cc.parse_size(bad)


# ----------------------------------------------------------------------------- entries

KEY = "ab" + "0" * 62


def test_entries_round_trip_privately(tmp_path):
    cache = CompileCache(tmp_path / "c")
    assert cache.get(KEY) is None
    cache.put(KEY, CacheEntry(b"\x7fELF code", {"kind": "cubin", "log": "w", "lowered": {"f<int>": "_Z1fIiEvv"}}))
    entry = cache.get(KEY)
    assert entry is not None and entry.code == b"\x7fELF code" and entry.meta["lowered"] == {"f<int>": "_Z1fIiEvv"}
    assert cache.stats["hits"] == 1 and cache.stats["misses"] == 1 and cache.stats["stores"] == 1
    assert oct(os.stat(tmp_path / "c").st_mode & 0o777) == "0o700"
    assert oct(os.stat(cache.path_of(KEY)).st_mode & 0o777) == "0o600"
    assert [p for p, _, _ in cache.entries()] == [cache.path_of(KEY)]   # no temporary file left behind
    with pytest.raises(ValueError, match="not a cache key"):
        cache.get("../../etc/passwd")


@pytest.mark.parametrize("damage", ["flip", "truncate", "moved", "empty"])
def test_a_corrupt_entry_is_a_miss_and_removed(tmp_path, damage):
    cache = CompileCache(tmp_path)
    cache.put(KEY, CacheEntry(b"code" * 100, {"kind": "cubin"}))
    path = Path(cache.path_of(KEY))
    data = path.read_bytes()
    target = path
    if damage == "flip":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    else:   # a whole, valid entry under another key's name
        other = "cd" + "1" * 62
        target = Path(cache.path_of(other))
        target.parent.mkdir(parents=True)
        target.write_bytes(data)
    assert cache.get(target.name) is None
    assert cache.stats["corrupt"] == 1 and not target.exists()


def test_eviction_removes_least_recently_used_first(tmp_path):
    cache = CompileCache(tmp_path, max_bytes=10_000)
    keys = [f"{i:02x}" + "e" * 62 for i in range(8)]
    now = time.time()
    for i, key in enumerate(keys[:6]):
        cache.put(key, CacheEntry(os.urandom(1500), {}))
        os.utime(cache.path_of(key), (now - 100 + i, now - 100 + i))   # oldest first
    assert cache.get(keys[0]) is not None                                # used now: the most recent
    stale = Path(cache.path_of(keys[0])).parent / ".tmp-abandoned"
    stale.write_bytes(b"x")
    os.utime(stale, (now - 7200, now - 7200))
    fresh = Path(cache.path_of(keys[0])).parent / ".tmp-in-flight"
    fresh.write_bytes(b"x")
    for key in keys[6:]:
        cache.put(key, CacheEntry(os.urandom(1500), {}))
    left = {Path(p).name for p, _, _ in cache.entries()}
    assert cache.size() <= 10_000
    assert keys[0] in left and keys[7] in left and keys[1] not in left   # LRU, not oldest-written
    assert cache.stats["evicted"] >= 1
    assert ".tmp-abandoned" not in left and ".tmp-in-flight" in left
    cache.put("ff" + "0" * 62, CacheEntry(os.urandom(20_000), {}))       # larger than the whole cache
    assert cache.get("ff" + "0" * 62) is None


WRITER = """
import os, sys, random
sys.path.insert(0, {root!r})
from cuproc.compile_cache import CompileCache, CacheEntry
cache = CompileCache({dir!r}, max_bytes={max_bytes})
me = int(sys.argv[1])
keys = ["{shared}", *[f"{{me:02x}}{{i:02x}}" + "a" * 60 for i in range(5)]]
for n in range(150):
    key = random.choice(keys)
    payload = os.urandom(random.randint(10, 30000))
    cache.put(key, CacheEntry(payload, {{"writer": me, "n": n, "size": len(payload)}}))
    got = cache.get(random.choice(keys))
    if got is not None:
        assert len(got.code) == got.meta["size"], "torn entry"
print(cache.stats["corrupt"], cache.stats["stores"])
"""


@pytest.mark.parametrize("max_bytes", [1 << 30, 100_000])   # the second evicts while others write
def test_concurrent_writers_and_readers_never_see_a_torn_entry(tmp_path, max_bytes):
    import subprocess
    shared = "5" * 64
    script = WRITER.format(root=str(ROOT), dir=str(tmp_path), max_bytes=max_bytes, shared=shared)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        corrupt, stores = map(int, out.split())
        assert corrupt == 0 and stores == 150
    cache = CompileCache(tmp_path, max_bytes=max_bytes)
    names = [Path(p).name for p, _, _ in cache.entries()]
    assert not [n for n in names if n.startswith(".tmp-")]
    for name in names:
        entry = cache.get(name)
        assert entry is not None and len(entry.code) == entry.meta["size"]
    assert cache.stats["corrupt"] == 0
    if max_bytes < 1 << 30:
        assert cache.size() <= max_bytes + 4 * 31_000   # each writer may have one entry past the limit in flight


# ----------------------------------------------------------------------------- with NVRTC

@needs_nvrtc
def test_a_changed_header_misses_and_nothing_else_does(tmp_path, monkeypatch):
    cache = CompileCache(tmp_path / "cache")
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "disk.cuh").write_text("#define DISK 1\n")
    src = AXPY.replace('#include "scale.cuh"', '#include "scale.cuh"\n#include <disk.cuh>')

    def build(scale: str = SCALE_H, names: tuple[str, ...] = ("axpy<float>", "axpy<double>"), *opts: str) -> bool:
        code = Program(src, name="axpy.cu", headers={"scale.cuh": scale}).compile(
            *opts, arch=ARCH, name_expressions=names, include_paths=[inc], cache=cache)
        assert set(code.lowered_names) == set(names)
        return code.from_cache

    assert build() is False
    assert build() is True
    assert build(SCALE_H, ("axpy<double>", "axpy<float>", "axpy<float>")) is True   # order, repeats: a hit
    assert build("#define SCALE 2\n") is False                                      # a given header changed
    assert build() is True                                                          # the old one still there
    assert build(SCALE_H, ("axpy<float>",)) is False
    assert build(SCALE_H, ("axpy<float>", "axpy<double>"), "-DEXTRA") is False
    (inc / "disk.cuh").write_text("#define DISK 2\n")                               # a header on disk changed
    assert build() is False
    os.utime(inc / "disk.cuh", (1, 1))                                               # touched, same contents
    assert build() is True
    assert cache.stats["corrupt"] == 0


@needs_nvrtc
def test_a_corrupt_entry_is_rebuilt_by_the_next_compile(tmp_path):
    cache = CompileCache(tmp_path)
    prog = Program(AXPY, headers={"scale.cuh": SCALE_H})
    first = prog.compile(arch=ARCH, name_expressions=["axpy<float>"], cache=cache)
    assert first.cache_key is not None
    path = Path(cache.path_of(first.cache_key))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    again = prog.compile(arch=ARCH, name_expressions=["axpy<float>"], cache=cache)
    assert not again.from_cache and cache.stats["corrupt"] == 1 and again.code == first.code
    hit = prog.compile(arch=ARCH, name_expressions=["axpy<float>"], cache=cache)
    assert hit.from_cache and hit.code == first.code and hit.lowered_names == first.lowered_names
    assert hit.log == first.log and hit.reason == first.reason and hit.arch == first.arch


@needs_nvrtc
def test_uncachable_and_unwritable(tmp_path):
    macro = Program('#define HEADER "x.h"\n#include HEADER\n__global__ void k() {}', headers={"x.h": ""})
    code = macro.compile(arch=ARCH, cache=CompileCache(tmp_path / "c"))
    assert code.cache_key is None and "#include HEADER" in code.cache_note
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="not writable"):
        stored = Program("__global__ void k() {}").compile(arch=ARCH, cache=CompileCache(blocker / "cache"))
    assert stored.kind == "cubin" and stored.cache_note.startswith("not stored")
    assert Program("__global__ void k() {}").compile(arch=ARCH, cache=False).cache_note == "cache off"


@pytest.mark.parametrize("value", ["inf", "nan", "1e999", "lots", "-5M", "0"])
def test_a_bad_cache_size_warns_and_keeps_the_default(value, monkeypatch, tmp_path):
    monkeypatch.setenv("CUPROC_NVRTC_CACHE_SIZE", value)
    monkeypatch.setattr(cc, "_warned", set())
    with pytest.warns(RuntimeWarning, match="CUPROC_NVRTC_CACHE_SIZE"):
        assert CompileCache(tmp_path).max_bytes == cc.DEFAULT_MAX_BYTES
    with pytest.raises(ValueError):
        cc.parse_size(value)


@needs_nvrtc
def test_an_unwritable_cache_warns_and_compiles(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "_warned", set())
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CUPROC_NVRTC_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match="not writable"):
        code = Program("__global__ void k() {}").compile(arch=ARCH)
    assert code.kind == "cubin" and not code.from_cache


@needs_nvrtc
def test_a_hit_in_a_fresh_process_opens_no_nvrtc(tmp_path):
    script = f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import cuproc
        code = cuproc.Program({AXPY!r}, headers={{"scale.cuh": {SCALE_H!r}}}).compile(
            arch="sm_80", name_expressions=["axpy<float>"], cache={str(tmp_path)!r})
        print(code.from_cache, "libnvrtc" in open("/proc/self/maps").read(), code.lowered_names["axpy<float>"])
    """
    first = run_python(script).stdout.split()
    second = run_python(script).stdout.split()
    assert first[:2] == ["False", "True"]
    assert second[:2] == ["True", "False"] and second[2] == first[2]


@needs_nvrtc
def test_a_hit_with_arch_given_opens_no_driver_and_loads_no_object_layer(tmp_path, fake):
    """A hit needs no driver: with one NVRTC major installed and ``arch=`` given, libcuda is not opened
    (loading opens it), nor is the object layer imported (issue 37)."""
    if len({nv.major_of(p) for p in nv.candidate_paths() if os.path.isfile(p)}) != 1:
        pytest.skip("several NVRTC majors installed: the driver's major is asked to choose one")
    script = f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from cuproc.program import Program
        code = Program({AXPY!r}, headers={{"scale.cuh": {SCALE_H!r}}}).compile(
            arch="sm_80", name_expressions=["axpy<float>"], cache={str(tmp_path)!r})
        maps = open("/proc/self/maps").read()
        print(code.from_cache, {fake.path.name!r} in maps, "cuproc.module" in sys.modules, "cuproc.context" in sys.modules)
    """
    env = {**os.environ, "CUPROC_LIBCUDA": str(fake.path)}
    first = run_python(script, env=env).stdout.split()
    second = run_python(script, env=env).stdout.split()
    assert first[0] == "False"      # compiled (asking the driver, for the reason it gives the target)
    assert second == ["True", "False", "False", "False"]


def test_the_top_level_names_of_an_imported_module_load_nothing_else():
    """``cuproc.Program`` once ``cuproc.program`` is imported (as the compile benchmark does before its
    clock) takes it from there: no graphs, transfers or host memory are imported on the way (they cost a
    fresh process tens of milliseconds), and a submodule name never goes through the lazy lookup."""
    script = f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import cuproc, cuproc.program
        before = set(sys.modules)
        from cuproc import nvrtc, compile_cache
        assert cuproc.Program is cuproc.program.Program and cuproc.compile_kernel is cuproc.program.compile_kernel
        print(sorted(m for m in set(sys.modules) - before if m.startswith("cuproc")))
    """
    assert run_python(script).stdout.split() == ["[]"]


# ----------------------------------------------------------------------------- the closure against NVRTC

KERNEL_NAMED_BY = 'extern "C" __global__ void NAME() {{}}\n'   # its .entry is whatever the header #defines


def _entry_of(code) -> str:
    import re
    found = re.findall(rb"\.entry\s+(\w+)", code.code)
    assert len(found) == 1, code.code[:400]
    return found[0].decode()


def _built(src: str, name: str, cache: CompileCache, *options: str) -> tuple[str, bool]:
    """(the kernel's name, as the header NVRTC read defined it; whether it came from the cache)."""
    code = Program(src, name=name).compile(*options, arch="compute_80", cache=cache)
    return _entry_of(code), code.from_cache


def _changed_header_misses(tmp_path, write, src: str, name: str, *options: str) -> None:
    """Compile, rewrite the header NVRTC read (``write(value)``), compile again: a miss with the new value."""
    cache = CompileCache(tmp_path / "cache")
    write("first")
    assert _built(src, name, cache, *options) == ("first", False)
    assert _built(src, name, cache, *options) == ("first", True)
    write("second")
    assert _built(src, name, cache, *options) == ("second", False)


@needs_nvrtc
@pytest.mark.parametrize("options", [("-I sub",), ("-I  sub ",), ("-I", " sub "), ("--include-path", " sub")])
def test_an_include_directory_with_spaces_is_the_one_nvrtc_reads(tmp_path, monkeypatch, options):
    """NVRTC takes ``-I sub`` as one option (and strips the spaces around a separate value): the closure must
    follow ``sub/``, not `` sub``, or a changed header there is a stale hit."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    _changed_header_misses(tmp_path, lambda v: (tmp_path / "sub" / "cfg.h").write_text(f"#define NAME {v}\n"),
                           '#include "cfg.h"\n' + KERNEL_NAMED_BY.format(), "k.cu", *options)
    assert include_dirs(list(options)) == (["sub"], [])


@needs_nvrtc
def test_a_leading_space_after_the_equals_sign_is_kept_as_nvrtc_keeps_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / " sub").mkdir()
    _changed_header_misses(tmp_path, lambda v: (tmp_path / " sub" / "cfg.h").write_text(f"#define NAME {v}\n"),
                           '#include "cfg.h"\n' + KERNEL_NAMED_BY.format(), "k.cu", "--include-path= sub")
    assert include_dirs(["--include-path= sub ", "-I= sub"]) == ([" sub", " sub"], [])


@needs_nvrtc
@pytest.mark.parametrize("with_include_path", [False, True])
def test_a_pre_include_is_looked_for_where_nvrtc_looks(tmp_path, monkeypatch, with_include_path):
    """``-include config.h`` of a program named ``src/k.cu``: NVRTC reads ./config.h (then the -I
    directories), not src/config.h."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.h").write_text("#define NAME beside_the_program\n")
    options = ["-include", "config.h"]
    where = tmp_path
    if with_include_path:
        (tmp_path / "inc").mkdir()
        options += ["-I", "inc"]
        where = tmp_path / "inc"       # not in the current directory: the -I directory's
    _changed_header_misses(tmp_path, lambda v: (where / "config.h").write_text(f"#define NAME {v}\n"),
                           KERNEL_NAMED_BY.format(), "src/k.cu", *options)


@needs_nvrtc
def test_an_include_through_a_symlink_and_dot_dot_is_the_file_nvrtc_reads(tmp_path, monkeypatch):
    """``#include "link/../x.h"``, link -> real/deep: the file system resolves link first, so NVRTC reads
    real/x.h, not ./x.h (which a textual normalization would give)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "deep")
    (tmp_path / "x.h").write_text("#define NAME textual\n")
    _changed_header_misses(tmp_path, lambda v: (tmp_path / "real" / "x.h").write_text(f"#define NAME {v}\n"),
                           '#include "link/../x.h"\n' + KERNEL_NAMED_BY.format(), "k.cu")


def test_includes_through_symlinks_keep_stable_keys_and_end(tmp_path, monkeypatch):
    """Paths are no longer normalized as text: the same closure twice gives the same edges, and a cycle
    written with ``..`` (each visit a longer spelling) still ends, each file once."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.h").write_text('#include "../d/b.h"\n')
    (tmp_path / "d" / "b.h").write_text('#include "../d/a.h"\n#include "./a.h"\n')
    src = b'#include "d/a.h"\n'
    first = closure(src, "k.cu", {}, [])
    assert first.edges == closure(src, "k.cu", {}, []).edges and first.untracked == []
    real = os.path.realpath(tmp_path / "d")
    assert sorted(first.files) == [os.path.join(real, "a.h"), os.path.join(real, "b.h")]
    assert len(first.edges) == 4


# ----------------------------------------------------------------------------- whose directory

@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="no user ids (Windows: ACLs)")
@pytest.mark.parametrize("folder", [".", "entries", "shard"])
def test_a_cache_others_can_write_to_is_not_used(tmp_path, monkeypatch, folder):
    """The cache holds code that will run: a cache folder writable by others (0777) is warned about once and
    neither read nor written -- a planted entry is not served (issue 37, review)."""
    monkeypatch.setattr(cc, "_warned", set())
    monkeypatch.setattr(cc, "_trusted_dirs", set())
    cache = CompileCache(tmp_path / "c")
    cache.put(KEY, CacheEntry(b"planted code", {"kind": "cubin"}))
    target = {".": cache.directory, "entries": cache.entries_dir, "shard": os.path.dirname(cache.path_of(KEY))}[folder]
    os.chmod(target, 0o777)
    monkeypatch.setattr(cc, "_trusted_dirs", set())            # a fresh process: the first use checks
    fresh = CompileCache(tmp_path / "c")
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        assert fresh.get(KEY) is None
    other = KEY[:2] + "1" * 62                                  # another entry of the same shard
    fresh.put(other, CacheEntry(b"x", {}))
    assert not os.path.exists(fresh.path_of(other)) and fresh.stats["stores"] == 0
    assert fresh.distrust(KEY) is not None
    os.chmod(target, 0o700)
    assert fresh.distrust(KEY) is None and fresh.get(KEY) is not None


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="no user ids (Windows: ACLs)")
def test_a_cache_of_another_user_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "_warned", set())
    monkeypatch.setattr(cc, "_trusted_dirs", set())
    cache = CompileCache(tmp_path / "c")
    cache.put(KEY, CacheEntry(b"code", {}))
    me = os.geteuid()
    monkeypatch.setattr(cc.os, "geteuid", lambda: me + 1)    # as seen by another user
    with pytest.warns(RuntimeWarning, match="belongs to user"):
        assert cache.get(KEY) is None


@needs_nvrtc
@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="no user ids (Windows: ACLs)")
def test_a_compile_with_a_world_writable_cache_warns_once_and_compiles_without_it(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "_warned", set())
    monkeypatch.setattr(cc, "_trusted_dirs", set())
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.warns(RuntimeWarning, match="not used"):
        first = Program("__global__ void k() {}").compile(arch=ARCH, cache=str(shared))
    assert not first.from_cache and first.cache_key is None and "writable" in first.cache_note
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                           # once per directory
        again = Program("__global__ void k() {}").compile(arch=ARCH, cache=str(shared))
    assert not again.from_cache and os.listdir(shared) == []
