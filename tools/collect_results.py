"""Copy a GPU run's benchmark results into benchmarks/results/ under their dated names.

    python tools/collect_results.py PATH      # PATH: gpu_check.tar.gz, or a folder holding bench_*.md/json/png

Each benchmark writes ``bench_X.md``, ``bench_X.json`` and ``bench_X.png`` (``tools/gpu_check.sh`` packs
them into ``gpu_check.tar.gz``).  Here each gets the name ``<date>-<HHMM>-<gpu>[-pure]-bench_X.<ext>``
from its own JSON (the date the run wrote, ``h100``/``h200``/... from the GPU's name, ``pure`` when the
compiled fast path was off), and the Markdown's plot link is rewritten to the plot's new name: copied by
hand, the links kept naming ``bench_X.png``, which no results file has.  A name that exists is never
overwritten.  Prints what it wrote.

The folder keeps the *latest* run of each benchmark and path (fast, pure) -- its JSON, Markdown and plot --
and ``HISTORY.md``, whose "Runs" table gets one row per collected result (date, GPU, path, commit, goals met
and missed, the first goal's line): older files of the same benchmark and path are removed once their row is
in the table (git keeps them).  ``--rebuild-history`` writes the table from every result in the folder, then
prunes it, the same way.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def dated_stem(data: dict, name: str) -> str:
    """``2026-11-25-1431-h100-bench_launch`` (``-pure`` before the name on the pure path) from a results JSON."""
    m = data["machine"]
    date = re.fullmatch(r"(\d{4}-\d\d-\d\d) (\d\d):(\d\d) UTC", m["date"])
    if date is None:
        raise ValueError(f"{name}.json: date {m['date']!r} is not 'YYYY-MM-DD HH:MM UTC'")
    model = (m.get("gpu") or "").split(",")[0]       # "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB"
    kind = next((t.lower() for t in re.split(r"[\s-]+", model) if re.search(r"\d", t)), "nogpu")
    pure = "-pure" if str(m.get("cuproc_path", "")).startswith("pure") else ""
    return f"{date.group(1)}-{date.group(2)}{date.group(3)}-{kind}{pure}-{name}"


def collect(source: Path, dest: Path = RESULTS) -> list[Path]:
    """Copy every ``bench_*.json`` in ``source`` with its ``.md`` and ``.png`` into ``dest`` under dated names."""
    plan: list[tuple[str, str, dict[str, Path], Path]] = []   # every name is checked before anything is written
    # gpu_check's benchpure stage leaves the pure path's results in pure/ (their JSON names the path)
    for js in sorted(source.glob("bench_*.json")) + sorted(source.glob("pure/bench_*.json")):
        name, folder = js.stem, js.parent
        stem = dated_stem(json.loads(js.read_text()), name)
        plan.append((name, stem, {ext: dest / f"{stem}.{ext}" for ext in ("json", "md", "png")
                                  if (folder / f"{name}.{ext}").exists()}, folder))
    taken = [str(t) for _, _, targets, _ in plan for t in targets.values() if t.exists()]
    stems = [stem for _, stem, _, _ in plan]
    if len(set(stems)) != len(stems):
        raise FileExistsError(f"two results would take one name ({', '.join(sorted(stems))}): nothing copied")
    if taken:
        raise FileExistsError(f"{', '.join(taken)} exists: nothing copied, nothing overwritten")
    written: list[Path] = []
    for name, stem, targets, folder in plan:
        dest.mkdir(parents=True, exist_ok=True)
        for ext, target in targets.items():
            if ext == "md":
                text = (folder / f"{name}.md").read_text()
                text = text.replace(f"![{name}.png]({name}.png)", f"![{stem}.png]({stem}.png)")
                target.write_text(text)
            else:
                shutil.copyfile(folder / f"{name}.{ext}", target)
            written.append(target)
    return written


TABLE_START = "<!-- runs: tools/collect_results.py writes this table -->"
TABLE_END = "<!-- end of runs -->"
TABLE_HEAD = ("| run | GPU | path | commit | benchmark | goals met | missed | first goal |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |")
_STEM = re.compile(r"(\d{4}-\d\d-\d\d)(?:-(\d{4}))?-([a-z0-9]+)(-pure)?-(bench_\w+)")


def _stem_key(stem: str) -> tuple[str, bool, str] | None:
    """(benchmark, pure?, sortable date) of a dated stem, or None for another name."""
    m = _STEM.fullmatch(stem)
    return None if m is None else (m.group(5), bool(m.group(4)), f"{m.group(1)}-{m.group(2) or '0000'}")


def history_row(stem: str, data: dict, markdown: str) -> str:
    """The Runs table's row for one result: its goal lines counted ("- [met]", "- [MISSED]") and the first one."""
    m = data.get("machine", {})
    goals = [line[2:] for line in markdown.splitlines() if line.startswith(("- [met]", "- [MISSED]"))]
    met = sum(g.startswith("[met]") for g in goals)
    first = goals[0].replace("|", "/") if goals else "(no goals)"
    key = _stem_key(stem)
    path = "pure" if key and key[1] else "fast"
    gpu = (m.get("gpu") or "no GPU").split(",")[0]
    return (f"| {m.get('date', '?')} | {gpu} | {path} | {m.get('commit', '?')} | {key[0] if key else stem} | "
            f"{met} | {len(goals) - met} | {first} |")


def add_history(rows: list[str], history: Path) -> None:
    """Add ``rows`` to HISTORY.md's Runs table (made at the top when missing), keeping it sorted by run date."""
    text = history.read_text() if history.exists() else "# Benchmark history\n"
    if TABLE_START in text:
        head, rest = text.split(TABLE_START, 1)
        table, tail = rest.split(TABLE_END, 1)
        old = [line for line in table.splitlines() if line.startswith("| 20")]
    else:
        first_break = text.find("\n\n")
        head = text if first_break < 0 else text[:first_break + 2]
        tail = "\n" if first_break < 0 else "\n\n" + text[first_break + 2:]
        head += ("## Runs\n\nOne row per benchmark result collected (tools/collect_results.py); the folder keeps "
                 "the latest files of each benchmark and path, git the rest.\n\n")
        old = []
    merged = sorted(set(old) | set(rows))
    history.write_text(f"{head}{TABLE_START}\n{TABLE_HEAD}\n" + "\n".join(merged) + f"\n{TABLE_END}{tail}")


def prune(dest: Path) -> list[Path]:
    """Remove every dated result but the latest of each benchmark and path; returns what it removed."""
    latest: dict[tuple[str, bool], str] = {}
    stems = {f.name.rsplit(".", 1)[0] for f in dest.glob("20*-bench_*.*")}
    by_key: dict[tuple[str, bool], list[tuple[str, str]]] = {}
    for stem in stems:
        key = _stem_key(stem)
        if key is not None:
            by_key.setdefault(key[:2], []).append((key[2], stem))
    for key, found in by_key.items():
        latest[key] = max(found)[1]
    removed = []
    for f in sorted(dest.glob("20*-bench_*.*")):
        stem = f.name.rsplit(".", 1)[0]
        key = _stem_key(stem)
        if key is not None and latest[key[:2]] != stem:
            f.unlink()
            removed.append(f)
    return removed


def rows_for(dest: Path, stems: list[str]) -> list[str]:
    """The Runs rows of the results ``stems`` in ``dest`` (each needs its JSON)."""
    rows = []
    for stem in stems:
        js, md = dest / f"{stem}.json", dest / f"{stem}.md"
        if js.exists():
            rows.append(history_row(stem, json.loads(js.read_text()), md.read_text() if md.exists() else ""))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, nargs="?", help="gpu_check.tar.gz or a folder of bench_* files")
    p.add_argument("--dest", type=Path, default=RESULTS)
    p.add_argument("--rebuild-history", action="store_true",
                   help="write HISTORY.md's Runs table from every result in --dest, then keep the latest only")
    args = p.parse_args(argv)
    if args.rebuild_history:
        stems = sorted({f.name.rsplit(".", 1)[0] for f in args.dest.glob("20*-bench_*.json")})
        add_history(rows_for(args.dest, stems), args.dest / "HISTORY.md")
        print(f"collect_results: {len(stems)} results in the Runs table; removed {len(prune(args.dest))} older files")
        return 0
    if args.source is None:
        p.error("a source is needed (or --rebuild-history)")
    with tempfile.TemporaryDirectory() as tmp:
        source = args.source
        if source.is_file():
            try:
                tar = tarfile.open(source)
            except tarfile.TarError as exc:
                print(f"collect_results: {source} is not a readable archive: {exc}", file=sys.stderr)
                return 1
            with tar:
                if hasattr(tarfile, "data_filter"):       # Python 3.10.12 / 3.11.4 and newer
                    tar.extractall(tmp, filter="data")
                else:                                     # older: plain files and folders inside tmp only
                    inside = [m for m in tar.getmembers() if (m.isfile() or m.isdir())
                              and Path(tmp, m.name).resolve().is_relative_to(Path(tmp).resolve())]
                    tar.extractall(tmp, members=inside)
            source = Path(tmp)
        try:
            written = collect(source, args.dest)
        except (FileExistsError, ValueError, KeyError) as exc:
            print(f"collect_results: {exc}", file=sys.stderr)
            return 1
    if not written:
        print(f"collect_results: no bench_*.json in {args.source}", file=sys.stderr)
        return 1
    stems = sorted({w.name.rsplit(".", 1)[0] for w in written if w.suffix == ".json"})
    add_history(rows_for(args.dest, stems), args.dest / "HISTORY.md")
    removed = prune(args.dest)
    print("\n".join(str(w) for w in written))
    if removed:
        print(f"collect_results: removed {len(removed)} older files (their rows are in HISTORY.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
