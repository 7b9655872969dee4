"""Put a GPU run's benchmark results into benchmarks/results/: one Markdown file and one plot per benchmark.

    python tools/collect_results.py PATH      # PATH: gpu_check.tar.gz, or a folder holding bench_*.md/json/png
    python tools/collect_results.py --rebuild-history

Each benchmark writes ``bench_X.md``, ``bench_X.json`` and ``bench_X.png`` (``tools/gpu_check.sh`` packs
them into ``gpu_check.tar.gz``; the pure path's run, if any, into ``pure/``).  The repository keeps, per
benchmark, what a reader uses (issue 41: 418 of the repository's 555 files were results):

* ``bench_X.md``: the latest run on the compiled fast path, then the latest on the pure path, each with
  its JSON below it (a collapsed block: the history table is rebuilt from it);
* ``bench_X.png``: the fast path's plot (the pure path's is not kept: its table says the same);
* ``HISTORY.md``: one row per run ever collected (date, GPU, path, commit, goals met and missed).

A run older than the one a file already holds for its path is refused (nothing is written): the files hold the
latest, git holds the rest.  Prints what it wrote.
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
PATHS = ("fast", "pure")
_HEADINGS = {"fast": "## On the compiled fast path", "pure": "## On the pure path (CUPROC_PURE_PYTHON=1)"}
_SECTION = re.compile(r"<!-- (fast|pure) path -->\n(.*?)<!-- end of (?:fast|pure) path -->\n", re.DOTALL)
_JSON = re.compile(r"```json\n(.*?)\n```", re.DOTALL)
_DATE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC")


def path_of(data: dict) -> str:
    """"pure" when the run's JSON says the compiled fast path was off, else "fast"."""
    return "pure" if str(data.get("machine", {}).get("cuproc_path", "")).startswith("pure") else "fast"


def run_date(data: dict, name: str) -> str:
    """The run's date ('YYYY-MM-DD HH:MM UTC', which sorts as text); anything else is refused."""
    date = data.get("machine", {}).get("date", "")
    if not _DATE.fullmatch(str(date)):
        raise ValueError(f"{name}.json: date {date!r} is not 'YYYY-MM-DD HH:MM UTC'")
    return str(date)


def section(name: str, path: str, markdown: str, data: dict) -> str:
    """One path's part of ``bench_X.md``: the run's Markdown one heading level down (its title dropped), the
    plot kept for the fast path only, and the JSON in a collapsed block."""
    lines = markdown.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    body = []
    for line in lines:
        if line.startswith(f"![{name}.png]"):
            if path != "fast":
                continue
        elif line.startswith("#"):
            line = "#" + line
        body.append(line)
    raw = json.dumps(data, sort_keys=True)
    return (f"<!-- {path} path -->\n{_HEADINGS[path]}\n\n" + "\n".join(body).strip("\n") +
            f"\n\n<details><summary>{name}.json</summary>\n\n```json\n{raw}\n```\n\n</details>\n\n"
            f"<!-- end of {path} path -->\n")


def read_sections(text: str) -> dict[str, str]:
    """{path: section text} of a ``bench_X.md`` this tool wrote."""
    return {m.group(1): m.group(0) for m in _SECTION.finditer(text)}


def section_data(text: str) -> dict:
    """The JSON a section carries."""
    m = _JSON.search(text)
    if m is None:
        raise ValueError("a results section without its JSON block")
    return json.loads(m.group(1))


def compose(name: str, sections: dict[str, str]) -> str:
    return f"# {name}\n\n" + "\n".join(sections[p] for p in PATHS if p in sections)


def collect(source: Path, dest: Path = RESULTS) -> tuple[list[Path], list[tuple[str, str, dict]]]:
    """Merge every ``bench_*.json`` of ``source`` (and ``source/pure``), with its ``.md`` and ``.png``, into
    ``dest``'s files.  Returns (files written, [(benchmark, its new Markdown section, its JSON)]).
    Everything is checked before anything is written."""
    runs: dict[tuple[str, str], tuple[Path, dict]] = {}
    for js in sorted(source.glob("bench_*.json")) + sorted(source.glob("pure/bench_*.json")):
        data = json.loads(js.read_text())
        key = (js.stem, path_of(data))
        if key in runs:
            raise FileExistsError(f"two {key[1]}-path results of {js.stem} ({runs[key][0]}, {js}): nothing written")
        run_date(data, js.stem)
        runs[key] = (js, data)
    plan: dict[str, dict[str, str]] = {}
    new: list[tuple[str, str, dict]] = []
    for (name, path), (js, data) in sorted(runs.items()):
        target = dest / f"{name}.md"
        sections = plan.get(name) or (read_sections(target.read_text()) if target.exists() else {})
        if path in sections:
            held = run_date(section_data(sections[path]), name)
            if held > run_date(data, name):
                raise FileExistsError(f"{target} holds a newer {path}-path run ({held}) than {js} "
                                      f"({data['machine']['date']}): nothing written")
        md = js.with_suffix(".md")
        sections[path] = section(name, path, md.read_text() if md.exists() else "", data)
        plan[name] = sections
        new.append((name, sections[path], data))
    written: list[Path] = []
    for name, sections in plan.items():
        dest.mkdir(parents=True, exist_ok=True)
        (dest / f"{name}.md").write_text(compose(name, sections))
        written.append(dest / f"{name}.md")
        plot = next((js.with_suffix(".png") for (n, p), (js, _) in runs.items() if n == name and p == "fast"), None)
        if plot is not None and plot.exists():
            shutil.copyfile(plot, dest / f"{name}.png")
            written.append(dest / f"{name}.png")
    return written, new


TABLE_START = "<!-- runs: tools/collect_results.py writes this table -->"
TABLE_END = "<!-- end of runs -->"
TABLE_HEAD = ("| run | GPU | path | commit | benchmark | goals met | missed | first goal |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |")


def history_row(name: str, data: dict, markdown: str) -> str:
    """The Runs table's row for one result: its goal lines counted ("- [met]", "- [MISSED]") and the first one."""
    m = data.get("machine", {})
    goals = [line[2:] for line in markdown.splitlines() if line.startswith(("- [met]", "- [MISSED]"))]
    met = sum(g.startswith("[met]") for g in goals)
    first = goals[0].replace("|", "/") if goals else "(no goals)"
    gpu = (m.get("gpu") or "no GPU").split(",")[0]
    return (f"| {m.get('date', '?')} | {gpu} | {path_of(data)} | {m.get('commit', '?')} | {name} | "
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
        head += ("## Runs\n\nOne row per benchmark result collected (tools/collect_results.py); "
                 "`bench_X.md` holds the latest run of each path, git the rest.\n\n")
        old = []
    merged = sorted(set(old) | set(rows))
    history.write_text(f"{head}{TABLE_START}\n{TABLE_HEAD}\n" + "\n".join(merged) + f"\n{TABLE_END}{tail}")


def current_rows(dest: Path) -> list[str]:
    """The Runs rows of every section the folder's files hold."""
    rows = []
    for md in sorted(dest.glob("bench_*.md")):
        for text in read_sections(md.read_text()).values():
            rows.append(history_row(md.stem, section_data(text), text))
    return rows


def _extract(archive: Path, into: str) -> None:
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):       # Python 3.10.12 / 3.11.4 and newer
            tar.extractall(into, filter="data")
        else:                                     # older: plain files and folders inside ``into`` only
            inside = [m for m in tar.getmembers() if (m.isfile() or m.isdir())
                      and Path(into, m.name).resolve().is_relative_to(Path(into).resolve())]
            tar.extractall(into, members=inside)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, nargs="?", help="gpu_check.tar.gz or a folder of bench_* files")
    p.add_argument("--dest", type=Path, default=RESULTS)
    p.add_argument("--rebuild-history", action="store_true",
                   help="add a Runs row to HISTORY.md for every run the folder's files hold")
    args = p.parse_args(argv)
    if args.rebuild_history:
        rows = current_rows(args.dest)
        add_history(rows, args.dest / "HISTORY.md")
        print(f"collect_results: {len(rows)} runs in the Runs table")
        return 0
    if args.source is None:
        p.error("a source is needed (or --rebuild-history)")
    with tempfile.TemporaryDirectory() as tmp:
        source = args.source
        if source.is_file():
            try:
                _extract(source, tmp)
            except tarfile.TarError as exc:
                print(f"collect_results: {source} is not a readable archive: {exc}", file=sys.stderr)
                return 1
            source = Path(tmp)
        try:
            written, new = collect(source, args.dest)
        except (FileExistsError, ValueError, KeyError) as exc:
            print(f"collect_results: {exc}", file=sys.stderr)
            return 1
    if not written:
        print(f"collect_results: no bench_*.json in {args.source}", file=sys.stderr)
        return 1
    add_history([history_row(name, data, text) for name, text, data in new], args.dest / "HISTORY.md")
    print("\n".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
