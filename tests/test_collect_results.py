"""tools/collect_results.py: a GPU run's benchmark files copied under dated names, plot links following."""
from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from collect_results import collect, main

pytestmark = pytest.mark.slow   # the results tooling, not the library; CI runs it


def _run(folder: Path, name: str, *, gpu: str, path: str, date: str = "2026-11-28 03:07 UTC") -> None:
    machine = {"date": date, "gpu": gpu, "cuproc_path": path}
    (folder / f"{name}.json").write_text(json.dumps({"machine": machine}))
    (folder / f"{name}.md").write_text(f"# {name}\n\ntable\n\n![{name}.png]({name}.png)\n")
    (folder / f"{name}.png").write_bytes(b"\x89PNG")


def test_each_file_gets_its_dated_name_and_the_plot_link_follows(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    _run(src, "bench_launch", gpu="NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB", path="compiled fast path")
    _run(src, "bench_memory", gpu="NVIDIA H200, 580.82.07, 143771 MiB", path="pure Python (cffi ABI mode)")
    written = collect(src, dest)
    assert sorted(p.name for p in written) == sorted([
        "2026-11-28-0307-h100-bench_launch.json", "2026-11-28-0307-h100-bench_launch.md",
        "2026-11-28-0307-h100-bench_launch.png", "2026-11-28-0307-h200-pure-bench_memory.json",
        "2026-11-28-0307-h200-pure-bench_memory.md", "2026-11-28-0307-h200-pure-bench_memory.png"])
    md = (dest / "2026-11-28-0307-h100-bench_launch.md").read_text()
    assert "![2026-11-28-0307-h100-bench_launch.png](2026-11-28-0307-h100-bench_launch.png)" in md
    assert "(bench_launch.png)" not in md
    assert (dest / "2026-11-28-0307-h100-bench_launch.png").read_bytes() == b"\x89PNG"


def test_an_existing_result_is_never_overwritten(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    _run(src, "bench_launch", gpu="NVIDIA H100 80GB HBM3", path="compiled fast path")
    (dest / "2026-11-28-0307-h100-bench_launch.md").write_text("earlier\n")
    _run(src, "bench_driver", gpu="NVIDIA H100 80GB HBM3", path="compiled fast path")   # sorts first
    with pytest.raises(FileExistsError):
        collect(src, dest)
    assert (dest / "2026-11-28-0307-h100-bench_launch.md").read_text() == "earlier\n"
    assert sorted(p.name for p in dest.iterdir()) == ["2026-11-28-0307-h100-bench_launch.md"]   # nothing copied


@pytest.mark.parametrize(("gpu", "kind"), [("NVIDIA GH200 480GB, 580.1, 97871 MiB", "gh200"), ("NVIDIA L40S", "l40s"),
                                           ("NVIDIA A100-SXM4-80GB", "a100"), (None, "nogpu")])
def test_the_gpu_tag_is_the_models_first_word_with_a_digit(tmp_path, gpu, kind):
    src = tmp_path / "src"
    src.mkdir()
    _run(src, "bench_memory", gpu=gpu, path="compiled fast path")
    assert collect(src, tmp_path / "dest")[0].name.startswith(f"2026-11-28-0307-{kind}-bench_memory")


def test_the_command_reads_gpu_checks_archive_and_refuses_an_unreadable_date(tmp_path, capsys):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    _run(src, "bench_startup", gpu="NVIDIA H100", path="compiled fast path")
    archive = tmp_path / "gpu_check.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname=".")
    assert main([str(archive), "--dest", str(dest)]) == 0
    assert (dest / "2026-11-28-0307-h100-bench_startup.md").exists()
    _run(src, "bench_startup", gpu="NVIDIA H100", path="compiled fast path", date="yesterday")
    assert main([str(src), "--dest", str(dest)]) == 1
    assert "yesterday" in capsys.readouterr().err


def test_an_unreadable_archive_is_refused_with_a_message(tmp_path, capsys):
    bad = tmp_path / "gpu_check.tar.gz"
    bad.write_bytes(b"not an archive")
    assert main([str(bad), "--dest", str(tmp_path / "dest")]) == 1
    assert str(bad) in capsys.readouterr().err
    assert not (tmp_path / "dest").exists()


def test_the_pure_paths_results_in_pure_come_along_and_two_for_one_name_copy_nothing(tmp_path):
    """gpu_check's benchpure stage writes the pure path's results into pure/, beside the fast path's."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "pure").mkdir(parents=True)
    _run(src, "bench_launch", gpu="NVIDIA H200, 580.159.04, 143771 MiB", path="compiled fast path")
    _run(src / "pure", "bench_launch", gpu="NVIDIA H200, 580.159.04, 143771 MiB",
         path="pure Python (cffi ABI mode), forced by CUPROC_PURE_PYTHON")
    written = collect(src, dest)
    assert sorted(p.name for p in written if p.suffix == ".md") == [
        "2026-11-28-0307-h200-bench_launch.md", "2026-11-28-0307-h200-pure-bench_launch.md"]
    pure = (dest / "2026-11-28-0307-h200-pure-bench_launch.md").read_text()
    assert "![2026-11-28-0307-h200-pure-bench_launch.png](2026-11-28-0307-h200-pure-bench_launch.png)" in pure
    again, dest2 = tmp_path / "again", tmp_path / "dest2"
    (again / "pure").mkdir(parents=True)
    for folder in (again, again / "pure"):             # both on one path: one name for two results
        _run(folder, "bench_launch", gpu="NVIDIA H200, 580.159.04, 143771 MiB", path="compiled fast path")
    with pytest.raises(FileExistsError):
        collect(again, dest2)
    assert not dest2.exists() or not any(dest2.iterdir())


def test_a_newer_run_replaces_the_older_files_and_each_gets_a_row_in_the_history(tmp_path):
    dest = tmp_path / "dest"
    for date, goals in (("2026-11-27 10:00 UTC", "- [met] a: 1.0x\n- [MISSED] b: 2.0x\n"),
                        ("2026-11-28 11:00 UTC", "- [met] a: 0.9x\n- [met] b: 1.1x\n")):
        src = tmp_path / date[:10]
        src.mkdir()
        _run(src, "bench_launch", gpu="NVIDIA H200, 580.159.04, 143771 MiB", path="compiled fast path", date=date)
        (src / "bench_launch.md").write_text((src / "bench_launch.md").read_text() + goals)
        _run(src, "bench_memory", gpu="NVIDIA H200, 580.159.04, 143771 MiB", path="pure Python", date=date)
        assert main([str(src), "--dest", str(dest)]) == 0
    left = sorted(p.name for p in dest.iterdir())
    assert left == ["2026-11-28-1100-h200-bench_launch.json", "2026-11-28-1100-h200-bench_launch.md",
                    "2026-11-28-1100-h200-bench_launch.png", "2026-11-28-1100-h200-pure-bench_memory.json",
                    "2026-11-28-1100-h200-pure-bench_memory.md", "2026-11-28-1100-h200-pure-bench_memory.png",
                    "HISTORY.md"]
    rows = [line for line in (dest / "HISTORY.md").read_text().splitlines() if line.startswith("| 2026")]
    assert len(rows) == 4
    launch = [r.split(" | ") for r in rows if "bench_launch" in r]
    assert [(r[0], r[5], r[6]) for r in launch] == [("| 2026-11-27 10:00 UTC", "1", "1"),
                                                      ("| 2026-11-28 11:00 UTC", "2", "0")]


def test_the_repository_keeps_the_latest_result_per_benchmark_and_path_and_the_history():
    """Issue 41: benchmarks/results/ holds at most a JSON, a Markdown and a plot per benchmark and path."""
    from collect_results import RESULTS, _stem_key
    keys: dict[tuple[str, bool], set[str]] = {}
    for f in RESULTS.iterdir():
        if f.name == "HISTORY.md":
            continue
        key = _stem_key(f.name.rsplit(".", 1)[0])
        assert key is not None, f"{f.name}: not a dated result name"
        keys.setdefault(key[:2], set()).add(f.name.rsplit(".", 1)[0])
    assert keys and all(len(stems) == 1 for stems in keys.values()), keys
