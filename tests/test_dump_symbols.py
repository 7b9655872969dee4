"""The CLI, in-process (fast) and once as the installed console script."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cuproc.tools.dump_symbols import main

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"name", "introduced", "typedef", "entry_point", "newer_driver_feature", "status"}


def run(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_keys_and_values(capsys):
    code, out, _ = run(capsys, "--no-driver", "--json", "-c", "12.4", "--ptds", "cuMemcpyHtoD", "cuLibraryLoadData",
                       "cuGraphGetId")
    assert code == 0
    records = {r["name"]: r for r in json.loads(out)}
    assert set(records) == {"cuMemcpyHtoD", "cuLibraryLoadData", "cuGraphGetId"}
    for r in records.values():
        assert KEYS <= set(r)
        assert r["status"] == "not_checked"
        assert isinstance(r["introduced"], int)
    assert records["cuMemcpyHtoD"]["entry_point"] == "cuMemcpyHtoD_v2_ptds"
    assert records["cuMemcpyHtoD"]["introduced"] == 2000
    assert records["cuLibraryLoadData"]["entry_point"] == "cuLibraryLoadData"
    assert records["cuGraphGetId"]["entry_point"] is None
    assert records["cuGraphGetId"]["newer_driver_feature"] is True
    assert records["cuGraphGetId"]["typedef"] is None


def test_table_default_lists_every_symbol(capsys):
    code, out, _ = run(capsys, "--no-driver")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("# cuproc registry: 561 symbols")
    body = [line for line in lines if not line.startswith("#")][2:]
    assert len(body) == 561
    assert any(line.split()[:3] == ["cuCtxCreate", "2.0", "cuCtxCreate_v4"] for line in body)


def test_filters_are_globs(capsys):
    code, out, _ = run(capsys, "--no-driver", "--json", "cuCtx[CD]*")
    names = [r["name"] for r in json.loads(out)]
    assert names and all(n.startswith(("cuCtxC", "cuCtxD")) for n in names)
    assert "cuCtxCreate" in names and "cuCtxDestroy" in names


def test_diff(capsys):
    code, out, _ = run(capsys, "--diff", "12.4", "12.5", "--json")
    changes = {c["name"]: c for c in json.loads(out)}
    assert changes["cuCtxCreate"]["kind"] == "changed"
    assert changes["cuCtxCreate"]["after"]["entry_point"] == "cuCtxCreate_v4"
    code, out, _ = run(capsys, "--diff", "11.8", "12.0")
    assert code == 0 and "cuLibraryLoadData" in out and "added" in out


@pytest.mark.parametrize("args", [["-c", "twelve"], ["--diff", "12.0"], ["--bogus"], ["--cuda-version", "12045"]])
def test_bad_arguments_exit_nonzero_with_message(capsys, args):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code != 0
    assert "error" in capsys.readouterr().err


def test_unmatched_filter_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--no-driver", "cuNoSuchThing*"])
    assert exc.value.code == 1
    assert "no symbol matches" in capsys.readouterr().err


def test_console_script_and_tools_wrapper():
    script = shutil.which("cuproc-dump-symbols")
    commands = [[sys.executable, str(ROOT / "tools" / "dump_symbols")]]
    if script:
        commands.append([script])
    for cmd in commands:
        proc = subprocess.run([*cmd, "--json", "--no-driver", "cuInit"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)[0]["entry_point"] == "cuInit"


def test_version(capsys):
    import cuproc
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.split() == ["cuproc-dump-symbols", cuproc.__version__]


def _dump_symbols_command() -> list[str]:
    script = shutil.which("cuproc-dump-symbols")
    return [script] if script else [sys.executable, "-m", "cuproc.tools.dump_symbols"]


def test_closed_pipe_is_quiet_and_succeeds():
    """`cuproc-dump-symbols --json | head -c 100`: the reader leaves early; no traceback, status 0.
    The output is far larger than a pipe's buffer (see below), so the writer does meet the closed pipe."""
    proc = subprocess.Popen([*_dump_symbols_command(), "--json", "--no-driver"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.read(100)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err.decode()
    assert first and err == b""


def test_full_output_still_fits_a_pipe_reader():
    """The pipe handling does not swallow output: a reader that stays gets all of it."""
    proc = subprocess.run([*_dump_symbols_command(), "--json", "--no-driver"], capture_output=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == b""
    from cuproc.registry import default_registry
    assert len(json.loads(proc.stdout)) == len(default_registry())
    assert len(proc.stdout) > 4 << 16   # four times Linux's default pipe buffer


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX shell to close stdout")
def test_closed_stdout_is_a_one_line_error():
    """`cuproc-dump-symbols --json >&-`: no sys.stdout at all; a clear message and status 2, no traceback."""
    proc = subprocess.run(["sh", "-c", '"$@" >&-', "sh", *_dump_symbols_command(), "--json", "--no-driver"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("cuproc-dump-symbols: standard output is closed; nothing can be printed "
                                   "(redirect it to a file or a pipe)")


# ----------------------------------------------------------------------------- issue 41: a new user's frictions

def test_short_V_is_version_and_c_is_cuda_version(capsys):
    import cuproc
    with pytest.raises(SystemExit) as exc:
        main(["-V"])
    assert exc.value.code == 0 and capsys.readouterr().out.split() == ["cuproc-dump-symbols", cuproc.__version__]
    code, out, _ = run(capsys, "--no-driver", "--json", "-c", "11.8", "cuInit")
    assert code == 0 and json.loads(out)[0]["requested_version"] == 11080
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "-c VERSION" in capsys.readouterr().out   # the short form is listed in --help


def test_json_names_the_requested_and_driver_versions(capsys):
    code, out, _ = run(capsys, "--no-driver", "--json", "--cuda-version", "12.4", "cuInit", "cuCtxCreate")
    assert code == 0
    records = json.loads(out)
    assert [(r["requested_version"], r["driver_version"]) for r in records] == [(12040, None)] * 2


def test_json_driver_version_with_a_driver(sim, capsys):
    assert main(["--library", str(sim.path), "--json", "--cuda-version", "12.0", "cuInit"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["requested_version"] == 12000 and record["driver_version"] == 13000


def test_no_driver_line_names_the_paths_tried_and_the_fix(capsys, monkeypatch, tmp_path):
    from cuproc import loader
    missing = [str(tmp_path / "a" / "libcuda.so.1"), str(tmp_path / "b" / "libcuda.so.1")]
    monkeypatch.delenv("CUPROC_LIBCUDA", raising=False)
    monkeypatch.setattr(loader, "DEFAULT_CANDIDATES", tuple(missing))
    code, out, _ = run(capsys, "cuInit")
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.startswith("# driver:")]
    assert line.startswith("# driver: not available") and not line.rstrip().endswith("Tried:")
    assert all(path in line for path in missing), line
    assert "CUPROC_LIBCUDA" in line, line


def test_newer_only_without_a_match_exits_1_like_an_unmatched_pattern(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--no-driver", "--newer-only", "--cuda-version", "13.0", "cuInit"])
    assert exc.value.code == 1 and capsys.readouterr().err.strip()
    code, out, _ = run(capsys, "--no-driver", "--newer-only", "--json", "--cuda-version", "11.8", "cuLibraryLoadData")
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["cuLibraryLoadData"]


@pytest.mark.parametrize("args", [["cuNoSuchThing*"], ["--diff", "11.8", "12.0", "cuNoSuchThing*"],
                                  ["--newer-only", "--cuda-version", "13.0", "cuInit"]])
def test_json_with_nothing_to_list_prints_an_empty_list_and_exits_1(capsys, args):
    """A consumer parses stdout: nothing to list under --json is the document ``[]``, never empty output
    (which no JSON parser accepts); the exit status stays 1 and the reason goes to stderr."""
    with pytest.raises(SystemExit) as exc:
        main(["--no-driver", "--json", *args])
    out = capsys.readouterr()
    assert exc.value.code == 1 and out.err.strip()
    assert json.loads(out.out) == []


def test_json_with_nothing_to_list_in_a_process_of_its_own():
    """The same in a process of its own, where stdout is a real pipe flushed at exit."""
    proc = subprocess.run([sys.executable, "-m", "cuproc.tools.dump_symbols", "--no-driver", "--json", "cuNoSuchThing*"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "cuNoSuchThing" in proc.stderr
    assert json.loads(proc.stdout) == []


@pytest.mark.parametrize("args", [["--cuda-version", "99.0"], ["-c", "99.0"]])
def test_a_version_above_the_registrys_newest_is_refused(capsys, args):
    from cuproc.registry import default_registry
    with pytest.raises(SystemExit) as exc:
        main(["--no-driver", *args, "cuInit"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "99.0" in err and str(default_registry().newest_version) in err
    code, _, _ = run(capsys, "--no-driver", "--cuda-version", str(default_registry().newest_version), "cuInit")
    assert code == 0


def test_a_version_above_the_registrys_newest_from_the_environment_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("CUPROC_CUDA_VERSION", "99.0")
    with pytest.raises(SystemExit) as exc:
        main(["--no-driver", "cuInit"])
    assert exc.value.code == 2 and "CUPROC_CUDA_VERSION" in capsys.readouterr().err
