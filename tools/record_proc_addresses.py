#!/usr/bin/env python3
"""Record what a real driver's cuGetProcAddress_v2 answers, for every symbol, version and flag.

Run it on a machine with a GPU driver; it writes ``tests/data/proc_addresses-<driver>.json``,
the ground truth that CI checks the registry's selection rules and the simulated driver
against (tests/test_proc_address_record.py).  Re-record on a newer driver with::

    python3 tools/record_proc_addresses.py            # add --library PATH for another libcuda

Why it is built this way:

* **Which names.** Every name in cuproc's registry, plus every base name the driver
  library exports (``cuX``, ``cuX_v2``, ``cuX_ptds`` ... all give ``cuX``), read from its
  ELF dynamic symbol table.  So a function the registry lacks still shows up, and the
  recording does not depend on cuproc's headers being complete.
* **Which versions.** Every CUDA version the driver's integer encoding can name
  (``major*1000 + minor*10``) from 1.0 to 15.9: all points where an answer can change,
  every point between them, and versions above the driver's own.
* **Which flags.** ``CU_GET_PROC_ADDRESS_DEFAULT``, ``_LEGACY_STREAM`` and
  ``_PER_THREAD_DEFAULT_STREAM``.
* **What answer.** The exported entry the returned pointer belongs to (matched against
  the dynamic symbol table, so an alias shows as ``a|b``), else the query status, else
  the return code's name.  No addresses are written: the file is deterministic for a
  given driver build.
* **Compact.** Per symbol and flag, the answers as runs over the version grid
  (``[first_version, answer]``); a flag that answers like ``DEFAULT`` is written ``"=0"``.

This tool uses ctypes and the ELF format only (not cuproc's loader or driver), so that
the recording is independent of the code it checks.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import re
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = {0: "CU_GET_PROC_ADDRESS_DEFAULT", 1: "CU_GET_PROC_ADDRESS_LEGACY_STREAM",
         2: "CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM"}
QUERY_STATUS = {0: None, 1: "status:SYMBOL_NOT_FOUND", 2: "status:VERSION_NOT_SUFFICIENT"}
VERSIONS = [major * 1000 + minor * 10 for major in range(1, 16) for minor in range(10)]
_ENTRY_SUFFIX = re.compile(r"(_v\d+)?(_ptds|_ptsz)?$")


def elf_functions(path: str) -> dict[str, int]:
    """Defined function symbols of an ELF64 shared library's .dynsym: name -> st_value."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path} is not an ELF64 file")
    endian = "<" if data[5] == 1 else ">"
    shoff, = struct.unpack_from(endian + "Q", data, 0x28)
    shentsize, shnum = struct.unpack_from(endian + "HH", data, 0x3A)
    sections = [struct.unpack_from(endian + "IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out: dict[str, int] = {}
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 11:   # SHT_DYNSYM
            continue
        str_offset = sections[link][4]
        for pos in range(offset, offset + size, entsize or 24):
            st_name, st_info, _other, st_shndx, st_value, _size = struct.unpack_from(endian + "IBBHQQ", data, pos)
            if st_shndx == 0 or (st_info & 0xF) not in (2, 10):   # undefined, or not FUNC / GNU_IFUNC
                continue
            end = data.index(b"\0", str_offset + st_name)
            out[data[str_offset + st_name:end].decode()] = st_value
    return out


def loaded_path(address: int) -> str:
    """The file mapped at ``address`` in this process (from /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= address < hi and len(parts) == 6:
            return parts[5]
    raise RuntimeError(f"no mapping holds address {address:#x}")


def record(library: str) -> dict[str, object]:
    lib = ctypes.CDLL(library)
    gpa = lib.cuGetProcAddress_v2
    gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                    ctypes.POINTER(ctypes.c_int)]
    get_name = lib.cuGetErrorName
    get_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    version = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        raise RuntimeError("cuDriverGetVersion failed: is this a CUDA driver?")

    path = os.path.realpath(loaded_path(ctypes.cast(lib.cuGetProcAddress_v2, ctypes.c_void_p).value))
    functions = elf_functions(path)
    base = ctypes.cast(lib.cuGetProcAddress_v2, ctypes.c_void_p).value - functions["cuGetProcAddress_v2"]
    by_address: dict[int, list[str]] = {}
    for name, value in functions.items():
        by_address.setdefault(base + value, []).append(name)

    names = {_ENTRY_SUFFIX.sub("", n) for n in functions if n.startswith("cu") and not n.startswith("cudbg")}
    try:
        sys.path.insert(0, str(ROOT))
        from cuproc.registry import default_registry
        names |= set(default_registry())
    except ImportError as exc:   # the recording still covers every exported name
        print(f"note: cuproc's registry not importable ({exc}); recording exported names only", file=sys.stderr)

    def rc_name(rc: int) -> str:
        text = ctypes.c_char_p()
        return "rc:" + (text.value.decode() if get_name(rc, ctypes.byref(text)) == 0 and text.value else str(rc))

    pfn, status = ctypes.c_void_p(), ctypes.c_int()
    symbols: dict[str, dict[str, object]] = {}
    for name in sorted(names):
        encoded = name.encode()
        per_flag: dict[str, object] = {}
        for flag in FLAGS:
            runs: list[list[object]] = []
            for v in VERSIONS:
                pfn.value, status.value = None, -1
                rc = gpa(encoded, ctypes.byref(pfn), v, flag, ctypes.byref(status))
                if rc != 0:
                    answer = rc_name(rc)
                elif status.value != 0:
                    answer = QUERY_STATUS.get(status.value, f"status:{status.value}")
                elif not pfn.value:
                    answer = "null"
                else:
                    answer = "|".join(sorted(by_address.get(pfn.value, ["unexported"])))
                if not runs or runs[-1][1] != answer:
                    runs.append([v, answer])
            per_flag[str(flag)] = "=0" if flag and runs == per_flag["0"] else runs
        symbols[name] = per_flag

    return {
        "driver_version": version.value,
        "driver_library": os.path.basename(path),
        "recorded": datetime.date.today().isoformat(),
        "tool": "tools/record_proc_addresses.py",
        "versions": VERSIONS,
        "flags": {str(k): v for k, v in FLAGS.items()},
        "symbols": symbols,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", default=os.environ.get("CUPROC_LIBCUDA", "libcuda.so.1"),
                        help="the driver library to open (default: CUPROC_LIBCUDA, else libcuda.so.1)")
    parser.add_argument("--out", type=Path, help="output file (default: tests/data/proc_addresses-<driver>.json)")
    args = parser.parse_args(argv)
    data = record(args.library)
    out = args.out or ROOT / "tests" / "data" / f"proc_addresses-{data['driver_version']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # One symbol a line: small diffs when re-recorded, and still plain JSON.
    symbols = data.pop("symbols")
    head = json.dumps(data, sort_keys=True)[:-1]
    lines = [f"{json.dumps(n)}: {json.dumps(symbols[n], separators=(',', ':'))}" for n in sorted(symbols)]
    out.write_text(head + ', "symbols": {\n' + ",\n".join(lines) + "\n}}\n")
    print(f"{out}: {len(symbols)} symbols x {len(VERSIONS)} versions x {len(FLAGS)} flags, "
          f"driver {data['driver_version']} ({data['driver_library']}), {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
