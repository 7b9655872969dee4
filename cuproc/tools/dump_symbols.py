"""``cuproc-dump-symbols``: what the registry selects, and what the installed driver resolves.

Without a driver every status is ``not_checked``; the table is still the
registry's full answer for the requested version and flag.  With a driver
the status column is the driver's own answer (see ``cuproc.driver``).

Configuration is the library's: ``CUPROC_CUDA_VERSION``,
``CUPROC_PER_THREAD_DEFAULT_STREAM`` and ``CUPROC_LIBCUDA`` are read by the
same functions ``cuproc.Driver`` uses, with or without a driver, and the
command-line options override them.  A bad value is a usage error (exit 2)
naming the variable.  A reader that closes the pipe early (``| head``) ends
the output quietly with exit status 0.

Exit status: 0 with at least one symbol listed; 1 when nothing is left to list (no symbol matches a
pattern, or none of those matching is a newer-driver feature under ``--newer-only``; with ``--json``
stdout is then ``[]``, still a JSON document); 2 for a usage error.  ``-V`` is ``--version``, as in
most tools; the requested CUDA version is ``--cuda-version`` (short form ``-c``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .. import __version__
from ..errors import DriverNotFoundError
from ..driver import ENV_PER_THREAD, ENV_VERSION, Driver, env_per_thread, env_version
from ..loader import ENV_LIBRARY
from ..registry import Registry, Selection, default_registry
from ..version import CudaVersion

NOT_CHECKED = "not_checked"


def _version_arg(text: str) -> CudaVersion:
    try:
        return CudaVersion.parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cuproc-dump-symbols",
        description="Show, per CUDA driver symbol, the ABI variant cuproc selects and what the driver resolves.",
        epilog="Exit status: 0 when symbols are listed; 1 when none is left to list (no symbol matches the "
               "patterns, or none of them is a newer-driver feature under --newer-only); 2 for a usage error.  "
               "-V is --version; the short form of --cuda-version is -c.")
    p.add_argument("--version", "-V", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("patterns", nargs="*", metavar="PATTERN",
                   help="glob filters on the C name, e.g. 'cuMemcpy*' (default: every symbol)")
    p.add_argument("--cuda-version", "-c", type=_version_arg, metavar="VERSION",
                   help=f"requested CUDA version, e.g. 12.4 or 12040, at most the registry's newest (default: "
                        f"{ENV_VERSION}, else the driver's, capped at the registry's newest; the registry's newest "
                        "without a driver)")
    p.add_argument("--per-thread-default-stream", "--ptds", action=argparse.BooleanOptionalAction, default=None,
                   help=f"select the per-thread default stream entries (_ptds/_ptsz) (default: {ENV_PER_THREAD})")
    p.add_argument("--diff", nargs=2, type=_version_arg, metavar=("A", "B"),
                   help="list the symbols added, removed or re-versioned between versions A and B")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    driver = p.add_mutually_exclusive_group()
    driver.add_argument("--no-driver", action="store_true", help="do not open the driver (status: not_checked)")
    driver.add_argument("--library", metavar="PATH", help=f"driver library to open (default: {ENV_LIBRARY}, then libcuda.so.1)")
    p.add_argument("--newer-only", action="store_true",
                   help="only the symbols that do not exist at the requested version (newer-driver features)")
    return p


def _configure(parser: argparse.ArgumentParser, args: argparse.Namespace, registry: Registry) -> None:
    """Fill what the command line left open from the environment, as ``cuproc.Driver`` does.

    A requested version above the registry's newest is refused: the registry knows no ABI past its
    newest, so the answer would silently be the newest's."""
    source = "--cuda-version"
    try:
        if args.cuda_version is None:
            args.cuda_version, source = env_version(), ENV_VERSION
        if args.per_thread_default_stream is None:
            args.per_thread_default_stream = env_per_thread()
    except ValueError as exc:
        parser.error(str(exc))
    newest = registry.newest_version
    if args.cuda_version is not None and args.cuda_version > newest:
        parser.error(f"{source} {args.cuda_version}: the registry's newest version is CUDA {newest} (headers of "
                     f"CUDA {registry_toolkits()}); ask for {newest} or older")


def _open_driver(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Driver | None, str]:
    """Open the driver for status checks; (None, why) when there is none.

    No driver at the default places is a normal answer ("not available").  A library named by
    ``--library`` or CUPROC_LIBCUDA that does not open is a usage error naming where it came from.
    """
    if args.no_driver:
        return None, "not opened (--no-driver)"
    drv = Driver(args.cuda_version, per_thread_default_stream=args.per_thread_default_stream,
                 library=args.library)
    try:
        drv.open()
    except Exception as exc:  # noqa: BLE001 - any failure to open means "no driver" here
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        if args.library is not None:
            parser.error(f"--library {args.library}: cannot open a CUDA driver there ({why})")
        if os.environ.get(ENV_LIBRARY):
            parser.error(f"{ENV_LIBRARY}={os.environ[ENV_LIBRARY]!r}: cannot open a CUDA driver there ({why}); "
                         f"point it at libcuda.so.1 or unset it")
        return None, _not_available(exc)
    return drv, drv.describe()


def _not_available(exc: Exception) -> str:
    """The driver line without a driver: every path tried, with its reason, and the fix, on one line."""
    if isinstance(exc, DriverNotFoundError):
        reasons = {path: " ".join(reason.removeprefix(f"{path}: ").split()) for path, reason in exc.attempts}
        if len(set(reasons.values())) == 1:   # the usual case: not found anywhere, said once
            tried = f"{', '.join(reasons)}: {next(iter(reasons.values()))}"
        else:
            tried = "; ".join(f"{path} ({reason})" for path, reason in reasons.items())
        return (f"not available (tried {tried or 'no path'}); install the NVIDIA driver, or set {ENV_LIBRARY} "
                f"to the path of libcuda.so.1 (or pass --library PATH)")
    return f"not available ({type(exc).__name__}: {' '.join(str(exc).split())})"


def symbol_record(sel: Selection, driver: Driver | None, registry: Registry | None = None) -> dict[str, Any]:
    """One JSON object per symbol; the keys are a documented interface.  ``registry`` is the one
    ``sel`` came from (default: the driver's, else the default registry)."""
    if registry is None:
        registry = driver.registry if driver is not None else default_registry()
    record: dict[str, Any] = {
        "name": sel.symbol.name,
        "introduced": int(sel.symbol.introduced),
        "typedef": sel.typedef,
        "entry_point": sel.entry_point,
        "newer_driver_feature": sel.newer_driver_feature,
        "status": NOT_CHECKED,
        "query_version": int(sel.query_version) if sel.query_version else None,
        "per_thread_suffix": sel.symbol.per_thread_suffix,
        "variants": [{"version": int(v.version), "entry": v.entry, "typedef": v.typedef,
                      "toolkits": list(v.toolkits)} for v in sel.symbol.variants],
        "header": sel.symbol.header,
        "windows_only": sel.symbol.windows_only,
        # what C source means by the name at this version, when a header #defines it to another function
        "header_alias": registry.header_alias(sel.symbol.name, sel.requested),
        # the same in every record (the output stays a list of records): the version asked for, and
        # what cuDriverGetVersion reports (None without a driver)
        "requested_version": int(sel.requested),
        "driver_version": int(driver.driver_version) if driver is not None else None,
    }
    if driver is not None:
        info = driver.resolution(sel.symbol.name)
        record["status"] = info.status
        record["typedef"] = info.typedef if info.typedef else record["typedef"]
        record["resolved_entry_point"] = info.entry_point
        record["resolved_at"] = int(info.query_version) if info.query_version else None
    return record


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _print_diff(registry: Registry, args: argparse.Namespace) -> int:
    a, b = args.diff
    changes = registry.diff(a, b, per_thread=args.per_thread_default_stream, patterns=args.patterns)
    if args.json:
        print(json.dumps([{"name": c.name, "kind": c.kind,
                           "before": {"entry_point": c.before.entry_point, "typedef": c.before.typedef},
                           "after": {"entry_point": c.after.entry_point, "typedef": c.after.typedef}}
                          for c in changes], indent=1))
        return 0
    print(f"# {len(changes)} symbols differ between CUDA {a} and {b}"
          f"{' (per-thread default stream)' if args.per_thread_default_stream else ''}")
    rows = [[c.kind, c.name, c.before.entry_point or "-", c.after.entry_point or "-"] for c in changes]
    if rows:
        print(_table(rows, ["change", "symbol", f"entry at {a}", f"entry at {b}"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The console script.  A stdout closed under it (``| head``) ends it quietly with status 0; one
    closed before it started (``>&-``: no sys.stdout at all) is a one-line error, status 2."""
    if sys.stdout is None:
        if sys.stderr is not None:
            sys.stderr.write("cuproc-dump-symbols: standard output is closed; nothing can be printed "
                             "(redirect it to a file or a pipe)\n")
        return 2
    try:
        code = _run(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
        return 0
    return code


def _discard_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured in tests)
        pass


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    registry = default_registry()
    _configure(parser, args, registry)
    if args.patterns and not registry.filter(args.patterns):
        _nothing_to_list(parser, args, f"no symbol matches {' '.join(args.patterns)!r}")
    if args.diff:
        return _print_diff(registry, args)

    driver, driver_line = _open_driver(parser, args)
    requested = driver.version if driver is not None else (args.cuda_version or registry.newest_version)
    selections = [registry.select(s.name, requested, per_thread=args.per_thread_default_stream)
                  for s in registry.filter(args.patterns)]
    if args.newer_only:
        selections = [s for s in selections if s.newer_driver_feature]
        if not selections:   # as an unmatched pattern: nothing to list is exit status 1
            _nothing_to_list(parser, args, f"no {'matching ' if args.patterns else ''}symbol is a newer-driver "
                                           f"feature at CUDA {requested}")
    records = [symbol_record(sel, driver, registry) for sel in selections]

    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    print(f"# cuproc registry: {len(registry)} symbols, headers of CUDA {registry_toolkits()}")
    print(f"# requested CUDA {requested}; per-thread default stream: "
          f"{'on' if args.per_thread_default_stream else 'off'}")
    print(f"# driver: {driver_line}")
    rows = [[r["name"], str(CudaVersion.from_int(r["introduced"])), r["entry_point"] or "-",
             r["typedef"] or "-", r["status"] + _notes(r)] for r in records]
    print(_table(rows, ["symbol", "since", "entry point", "typedef", "status"]))
    return 0


def _nothing_to_list(parser: argparse.ArgumentParser, args: argparse.Namespace, why: str) -> None:
    """Exit status 1 with ``why`` on stderr.  Under ``--json`` stdout still gets ``[]``: a consumer that
    parses stdout gets a valid, empty document instead of a JSON decoding error on empty input."""
    if args.json:
        print("[]")
        sys.stdout.flush()   # before parser.exit: a closed pipe here is main's BrokenPipeError, status 0
    parser.exit(1, f"cuproc-dump-symbols: {why}\n")


def _notes(record: dict[str, Any]) -> str:
    """The status column's remarks: newer-driver feature, Windows only, header alias."""
    notes = [text for flag, text in ((record["newer_driver_feature"], "newer-driver feature"),
                                     (record["windows_only"], "Windows only"),
                                     (record["header_alias"], f"C source means {record['header_alias']}"))
             if flag]
    return f" ({'; '.join(notes)})" if notes else ""


def registry_toolkits() -> str:
    from .._header_data import TOOLKITS
    return ", ".join(TOOLKITS)


if __name__ == "__main__":
    sys.exit(main())
