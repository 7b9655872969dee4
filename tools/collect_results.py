"""Copy a GPU run's benchmark results into benchmarks/results/ under their dated names.

    python tools/collect_results.py PATH      # PATH: gpu_check.tar.gz, or a folder holding bench_*.md/json/png

Each benchmark writes ``bench_X.md``, ``bench_X.json`` and ``bench_X.png`` (``tools/gpu_check.sh`` packs
them into ``gpu_check.tar.gz``).  Here each gets the name ``<date>-<HHMM>-<gpu>[-pure]-bench_X.<ext>``
from its own JSON (the date the run wrote, ``h100``/``h200``/... from the GPU's name, ``pure`` when the
compiled fast path was off), and the Markdown's plot link is rewritten to the plot's new name: copied by
hand, the links kept naming ``bench_X.png``, which no results file has.  A name that exists is never
overwritten.  Prints what it wrote.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="gpu_check.tar.gz or a folder of bench_* files")
    p.add_argument("--dest", type=Path, default=RESULTS)
    args = p.parse_args(argv)
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
    print("\n".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
