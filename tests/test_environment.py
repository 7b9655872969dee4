"""CUPROC_* variables: the library and cuproc-dump-symbols read them the same way, with or without a
driver, a bad value is an error that names the variable, and docs/guide/environment.rst lists them all."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import cuproc
from cuproc.tools.dump_symbols import main

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(cuproc.__file__).resolve().parent      # the checkout's, or the installed wheel's (CI's sdist run)
ENVIRONMENT_PAGE = ROOT / "docs" / "guide" / "environment.rst"
VARIABLE = re.compile(r"CUPROC_[A-Z0-9_]*[A-Z0-9]")

BAD_VALUES = [("CUPROC_CUDA_VERSION", "bogus"), ("CUPROC_CUDA_VERSION", "12045"),
              ("CUPROC_PER_THREAD_DEFAULT_STREAM", "maybe"), ("CUPROC_PER_THREAD_DEFAULT_STREAM", "2")]


@pytest.fixture()
def sim_driver(sims, monkeypatch):
    """The simulated CUDA 13.0 driver, named by CUPROC_LIBCUDA."""
    sim = sims["v2"]
    sim.set_version(13000)
    sim.set_result(0)
    monkeypatch.setenv("CUPROC_LIBCUDA", str(sim.path))
    return sim


@pytest.fixture()
def no_driver(monkeypatch, tmp_path):
    """No driver at all: CUPROC_LIBCUDA unset and the default names not on this machine."""
    monkeypatch.delenv("CUPROC_LIBCUDA", raising=False)
    if cuproc.is_driver_available():
        pytest.skip("a CUDA driver is installed here; this case needs a machine without one")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("variable", "value"), BAD_VALUES)
def test_library_rejects_a_bad_value_naming_the_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=variable):
        cuproc.Driver()


@pytest.mark.parametrize("with_driver", [False, True], ids=["no-driver", "sim-driver"])
@pytest.mark.parametrize(("variable", "value"), BAD_VALUES)
def test_cli_rejects_a_bad_value_naming_the_variable(capsys, monkeypatch, request, with_driver, variable, value):
    request.getfixturevalue("sim_driver" if with_driver else "no_driver")
    monkeypatch.setenv(variable, value)
    for args in (["cuInit"], ["--no-driver", "cuInit"], ["--json", "cuInit"]):
        code, out, err = cli(capsys, *args)
        assert code == 2, (args, out, err)
        assert variable in err and out == ""


def test_cli_rejects_a_library_path_that_does_not_open(capsys, monkeypatch, tmp_path):
    missing = tmp_path / "libcuda.so.1"
    monkeypatch.setenv("CUPROC_LIBCUDA", str(missing))
    code, out, err = cli(capsys, "cuInit")
    assert code == 2 and "CUPROC_LIBCUDA" in err and str(missing) in err and out == ""
    monkeypatch.delenv("CUPROC_LIBCUDA")
    code, out, err = cli(capsys, "--library", str(missing), "cuInit")
    assert code == 2 and "--library" in err and out == ""
    # --no-driver does not open it, so the path is not checked
    monkeypatch.setenv("CUPROC_LIBCUDA", str(missing))
    assert cli(capsys, "--no-driver", "cuInit")[0] == 0


def test_no_driver_at_the_default_places_is_not_an_error(capsys, no_driver):
    code, out, _ = cli(capsys, "cuInit")
    assert code == 0 and "# driver: not available" in out


@pytest.mark.parametrize("with_driver", [False, True], ids=["no-driver", "sim-driver"])
def test_cli_and_library_read_the_same_configuration(capsys, monkeypatch, request, with_driver):
    request.getfixturevalue("sim_driver" if with_driver else "no_driver")
    monkeypatch.setenv("CUPROC_CUDA_VERSION", "11.8")
    monkeypatch.setenv("CUPROC_PER_THREAD_DEFAULT_STREAM", "yes")
    code, out, _ = cli(capsys, "--json", "cuMemcpyHtoD", "cuLibraryLoadData")
    assert code == 0
    records = {r["name"]: r for r in json.loads(out)}
    assert records["cuMemcpyHtoD"]["entry_point"] == "cuMemcpyHtoD_v2_ptds"
    assert records["cuLibraryLoadData"]["newer_driver_feature"] is True   # 12.0 > the requested 11.8
    if with_driver:
        drv = cuproc.Driver()
        assert (drv.version, drv.per_thread_default_stream) == (cuproc.CudaVersion(11, 8), True)
        assert records["cuMemcpyHtoD"]["status"] == drv.resolution("cuMemcpyHtoD").status == "resolved"
        assert records["cuMemcpyHtoD"]["resolved_entry_point"] == "cuMemcpyHtoD_v2_ptds"
    else:
        assert records["cuMemcpyHtoD"]["status"] == "not_checked"
    # the command line overrides the environment
    code, out, _ = cli(capsys, "--json", "--no-ptds", "-c", "12.4", "cuMemcpyHtoD")
    assert json.loads(out)[0]["entry_point"] == "cuMemcpyHtoD_v2"
    code, out, _ = cli(capsys, "cuMemcpyHtoD")
    assert "# requested CUDA 11.8; per-thread default stream: on" in out


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("ON", True), (" true ", True), ("off", False),
                                                 ("No", False), ("", False)])
def test_per_thread_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("CUPROC_PER_THREAD_DEFAULT_STREAM", value)
    assert cuproc.Driver().per_thread_default_stream is expected


def variable_literals(path: Path) -> set[str]:
    """The string literals in ``path`` that are a whole CUPROC_* name: how cuproc names what it reads
    (``ENV_VERSION = "CUPROC_CUDA_VERSION"``, ``env_flag("CUPROC_NO_FASTPATH", ...)``).  Docstrings and
    messages only mention names, and the pieces of an f-string (``f"CUPROC_K_{kind}"``: the fast path's C
    constants) are not names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pieces = {id(value) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for value in node.values}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces
            and VARIABLE.fullmatch(node.value)}


def read_by_the_product() -> set[str]:
    """Every CUPROC_* variable the package or its setup.py reads (not the tests', tools' or benchmarks')."""
    found = set().union(*(variable_literals(path) for path in PACKAGE.rglob("*.py")))
    return found | variable_literals(ROOT / "setup.py")


def test_the_literal_finder_sees_names_and_skips_mentions_and_fstring_pieces(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text('A = "CUPROC_ONE"\n"""CUPROC_TWO is mentioned."""\nB = f"CUPROC_K_{A}"\nC = "CUPROC_*"\n')
    assert variable_literals(source) == {"CUPROC_ONE"}


def test_every_variable_the_package_and_setup_read_is_on_the_environment_page():
    """A variable read by cuproc or setup.py has its row in docs/guide/environment.rst.  Those that only
    the tests, tools and benchmarks read (CUPROC_TEST_SHARD, CUPROC_GPU_SEQUENCES, ...) are not counted."""
    read = read_by_the_product()
    from cuproc.driver import ENV_PER_THREAD, ENV_VERSION   # the finder must see what the library reads
    from cuproc.loader import ENV_LIBRARY
    assert {ENV_VERSION, ENV_PER_THREAD, ENV_LIBRARY, "CUPROC_NO_FASTPATH"} <= read, read
    documented = set(VARIABLE.findall(ENVIRONMENT_PAGE.read_text()))
    missing = sorted(read - documented)
    assert not missing, f"read by cuproc or setup.py but not in {ENVIRONMENT_PAGE.relative_to(ROOT)}: {missing}"


def test_the_pages_library_and_install_rows_name_variables_that_are_read():
    """The other way: no row of the library's or the install's table is for a variable nothing reads."""
    product_part = ENVIRONMENT_PAGE.read_text().split("\nDevelopment and the GPU machine\n")[0]
    rows = set(re.findall(r"^ *\* - ``(CUPROC_\w+)``$", product_part, flags=re.MULTILINE))
    assert len(rows) >= 9, rows
    stale = sorted(rows - read_by_the_product())
    assert not stale, f"rows for variables neither cuproc nor setup.py reads: {stale}"
