"""tools/collect_results.py: a GPU run's benchmark results merged into one Markdown file and one plot per benchmark."""
from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from collect_results import RESULTS, collect, current_rows, main, read_sections, section_data

pytestmark = pytest.mark.tooling   # the results tooling, not the library: CI runs it (-m tooling)

H200 = "NVIDIA H200, 580.159.04, 143771 MiB"
PURE = "pure Python (cffi ABI mode), forced by CUPROC_PURE_PYTHON"


def _run(folder: Path, name: str, *, path: str = "compiled fast path", date: str = "2026-11-28 03:07 UTC",
         goals: str = "- [met] a: 1.0x\n", plot: bytes = b"\x89PNG") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    machine = {"date": date, "gpu": H200, "cuproc_path": path, "commit": "abc1234"}
    (folder / f"{name}.json").write_text(json.dumps({"machine": machine, "rows": [1, 2]}))
    (folder / f"{name}.md").write_text(f"# {name}\n\ndate: {date}\n\n## Goals\n\n{goals}\n![{name}.png]({name}.png)\n")
    (folder / f"{name}.png").write_bytes(plot)


def test_one_markdown_file_and_one_plot_per_benchmark_both_paths_in_the_file(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    _run(src, "bench_launch", plot=b"fast plot")
    _run(src / "pure", "bench_launch", path=PURE, plot=b"pure plot", goals="- [MISSED] a: 2.0x\n")
    _run(src, "bench_memory")
    written, new = collect(src, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["bench_launch.md", "bench_launch.png", "bench_memory.md",
                                                       "bench_memory.png"]
    assert sorted(p.name for p in written) == sorted(p.name for p in dest.iterdir())
    assert (dest / "bench_launch.png").read_bytes() == b"fast plot"          # the fast path's plot, not the pure one's
    text = (dest / "bench_launch.md").read_text()
    sections = read_sections(text)
    assert sorted(sections) == ["fast", "pure"]
    assert text.count("![bench_launch.png](bench_launch.png)") == 1 and "bench_launch.png" in sections["fast"]
    assert "[MISSED]" in sections["pure"] and "[MISSED]" not in sections["fast"]
    assert "### Goals" in sections["fast"] and text.count("\n# ") == 0       # headings one level down
    assert section_data(sections["pure"])["machine"]["cuproc_path"] == PURE  # the JSON is carried, whole
    assert section_data(sections["fast"])["rows"] == [1, 2]
    assert len(new) == 3


def test_a_later_run_of_one_path_replaces_that_path_only_and_an_older_one_is_refused(tmp_path):
    dest = tmp_path / "dest"
    _run(tmp_path / "a", "bench_launch", date="2026-11-27 10:00 UTC")
    _run(tmp_path / "a" / "pure", "bench_launch", path=PURE, date="2026-11-27 10:05 UTC")
    collect(tmp_path / "a", dest)
    _run(tmp_path / "b", "bench_launch", date="2026-11-28 11:00 UTC", goals="- [met] b: 0.9x\n")
    collect(tmp_path / "b", dest)
    sections = read_sections((dest / "bench_launch.md").read_text())
    assert section_data(sections["fast"])["machine"]["date"] == "2026-11-28 11:00 UTC"
    assert section_data(sections["pure"])["machine"]["date"] == "2026-11-27 10:05 UTC"   # kept
    before = (dest / "bench_launch.md").read_text()
    _run(tmp_path / "c", "bench_launch", date="2026-11-26 09:00 UTC")
    with pytest.raises(FileExistsError, match="newer"):
        collect(tmp_path / "c", dest)
    assert (dest / "bench_launch.md").read_text() == before


def test_two_results_for_one_path_write_nothing(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    for folder in (src, src / "pure"):             # both on the fast path: two results for one file section
        _run(folder, "bench_launch")
    with pytest.raises(FileExistsError):
        collect(src, dest)
    assert not dest.exists()


def test_the_command_reads_gpu_checks_archive_fills_the_history_and_refuses_an_unreadable_date(tmp_path, capsys):
    src, dest = tmp_path / "src", tmp_path / "dest"
    _run(src, "bench_startup", goals="- [met] a: 1.0x\n- [MISSED] b: 2.0x\n")
    archive = tmp_path / "gpu_check.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname=".")
    assert main([str(archive), "--dest", str(dest)]) == 0
    rows = [line for line in (dest / "HISTORY.md").read_text().splitlines() if line.startswith("| 2026")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[:7] == ["2026-11-28 03:07 UTC", "NVIDIA H200", "fast", "abc1234", "bench_startup", "1", "1"]
    assert rows == current_rows(dest)                                  # --rebuild-history reads the same back
    _run(src, "bench_startup", date="yesterday")
    assert main([str(src), "--dest", str(dest)]) == 1
    assert "yesterday" in capsys.readouterr().err


def test_an_unreadable_archive_is_refused_with_a_message(tmp_path, capsys):
    bad = tmp_path / "gpu_check.tar.gz"
    bad.write_bytes(b"not an archive")
    assert main([str(bad), "--dest", str(tmp_path / "dest")]) == 1
    assert str(bad) in capsys.readouterr().err
    assert not (tmp_path / "dest").exists()


def test_the_repository_keeps_a_markdown_file_and_a_plot_per_benchmark_and_the_history():
    """Issue 41: benchmarks/results/ holds at most a file and a plot per benchmark, plus HISTORY.md, and every
    run those files hold has its row in the history."""
    names = sorted(p.name for p in RESULTS.iterdir())
    benchmarks = {n.rsplit(".", 1)[0] for n in names if n != "HISTORY.md"}
    assert "HISTORY.md" in names and benchmarks
    for bench in benchmarks:
        assert (ROOT / "benchmarks" / f"{bench}.py").exists(), f"{bench}: no such benchmark"
        assert set(names) & {f"{bench}.md", f"{bench}.png"} <= set(names)
        assert f"{bench}.md" in names, f"{bench}.png without its results file"
    assert len(names) <= 2 * len(benchmarks) + 1
    history = (RESULTS / "HISTORY.md").read_text()
    assert all(row in history for row in current_rows(RESULTS))
