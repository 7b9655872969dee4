"""What type checkers see: the generated stub of the C names, the lazy exports, and mypy/pyright on the
README's code blocks and examples/ (no error), and on wrong calls (the errors they must report).

The checkers run against the ``cuproc`` that ``import cuproc`` finds: the checkout, or an installed
wheel (CI runs the suite against both).  mypy is part of the ``test`` extra; outside CI (the GPU
machine runs the suite without installing the extras) the checker tests skip when it is missing.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import textwrap
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

import cuproc
from cuproc import driver

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(cuproc.__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
import build_stubs  # noqa: E402
from subproc import run_python  # noqa: E402

pytestmark = pytest.mark.slow   # runs mypy and pyright (pip install -e '.[test,typing]'); CI runs it


# --------------------------------------------------------------------------- the stub and the runtime

def test_stub_matches_headers():
    """The shipped stub is what tools/build_stubs.py makes from headers/ (rerun tools/build_ffi.py)."""
    fresh = build_stubs.stub_text(ROOT / "headers", PACKAGE)
    assert fresh == (PACKAGE / build_stubs.STUB_NAME).read_text(), \
        f"cuproc/{build_stubs.STUB_NAME} is stale: run tools/build_ffi.py"


def _stub_names() -> tuple[dict[str, str], set[str], set[str]]:
    """From the stub: (annotation of each constant/type on a handle, functions on a handle,
    the names of the module namespace)."""
    text = (PACKAGE / build_stubs.STUB_NAME).read_text()
    handle, module = text.split("\nclass CFunctions", 1)[1].split("\n_default: CFunctions[int]\n", 1)
    values = dict(re.findall(r"^    (\w+): (Final.*)$", handle, re.M))
    functions = set(re.findall(r"^    def (\w+)\(self", handle, re.M))
    functions |= set(re.findall(r"^    (\w+): HeaderAlias_\1\[_R\]$", handle, re.M))   # header aliases
    module_names = set(re.findall(r"^(\w+) = _default\.\1$", module, re.M))
    return values, functions, module_names


def test_stub_declares_what_the_runtime_has():
    values, functions, module_names = _stub_names()
    assert functions == set(driver.default_registry())
    constants = driver.constants()
    for name, annotation in values.items():
        if annotation.startswith("Final = "):
            assert constants[name] == int(annotation.removeprefix("Final = ")), name
        elif annotation.startswith("Final[CType]"):
            assert driver.ffi.typeof(name).cname == annotation.split("# ", 1)[1], name
        else:
            assert annotation.startswith("Final[CData]") and driver.ffi.typeof(constants[name]).kind == "pointer"
    assert set(values) == set(constants) | set(driver.ffi.list_types()[0])
    # the module answers the cu*/CU* names only (cuproc.driver.__getattr__)
    assert module_names == {n for n in [*values, *functions] if n.startswith(("cu", "CU"))}


def test_stub_signatures_follow_the_abi():
    text = (PACKAGE / build_stubs.STUB_NAME).read_text()
    # one parameter per C parameter, positional-only; ints where C takes integers
    assert "    def cuMemAlloc(self, dptr: CData, bytesize: SupportsIndex, /) -> _R:" in text
    assert "    def cuInit(self, Flags: SupportsIndex, /) -> _R:" in text
    # variants of different arity are overloads: 3 (CUDA 2.0/3.2), 5 (11.4) and 4 (12.5) arguments
    overloads = re.findall(r"^    @overload\n    def cuCtxCreate\(self, (.*?)\) -> _R:", text, re.M)
    assert sorted(o.count(":") for o in overloads) == [3, 4, 5]
    assert "    def cuCtxSynchronize(self) -> _R:" in text
    # the docstring gives the C declaration
    assert "CUresult cuMemAlloc(CUdeviceptr_v2 *dptr, size_t bytesize)" in text


def test_stub_generator_maps_c_types_as_cffi_passes_them():
    ffi = driver.ffi
    assert build_stubs._python_type(ffi.typeof("unsigned long long")) == "SupportsIndex"
    assert build_stubs._python_type(ffi.typeof("_Bool")) == "SupportsIndex"
    assert build_stubs._python_type(ffi.typeof("CUdevice_attribute")) == "SupportsIndex"   # enum
    assert build_stubs._python_type(ffi.typeof("double")) == "float"
    assert build_stubs._python_type(ffi.typeof("char")) == "bytes"
    assert build_stubs._python_type(ffi.typeof("CUstream")) == "CData"                     # a handle
    assert build_stubs._python_type(ffi.typeof("CUmemLocation")) == "CData"                # by-value struct
    with pytest.raises(ValueError, match="long double"):   # a new kind of parameter fails the build, loudly
        build_stubs._python_type(ffi.typeof("long double"))
    assert build_stubs._param_names(["CUdeviceptr *", "int lambda", "int x", "int x", "void **extra"]) == \
        ["arg0", "lambda_", "x", "x_", "extra"]


def test_lazy_exports_are_visible_to_type_checkers():
    """The names cuproc/__init__.py imports under TYPE_CHECKING are exactly what __getattr__ serves."""
    source = Path(cuproc.__file__).read_text()
    block = source.split("if TYPE_CHECKING:", 1)[1].split("\n__version__", 1)[0]
    imported = set(re.findall(r"\b([A-Za-z_]\w*),?\s*$", re.sub(r"#.*", "", block), re.M))
    imported |= {n for line in re.findall(r"import ([^(\n]+)$", block, re.M) for n in re.findall(r"\w+", line)}
    served: set[str] = set()
    for module in cuproc._LAZY_MODULES:
        served |= set(importlib.import_module(f"cuproc.{module}").__all__)
    for name, module in cuproc._LAZY_NAMES.items():
        assert name in importlib.import_module(f"cuproc.{module}").__all__
        served.add(name)
    assert imported - {"import"} == served
    assert served <= set(cuproc.__all__)
    for name in cuproc.__all__:
        assert getattr(cuproc, name) is not None


def test_py_typed_ships_with_the_package():
    assert (PACKAGE / "py.typed").is_file()
    assert (PACKAGE / build_stubs.STUB_NAME).is_file()


# --------------------------------------------------------------------------- the checkers

README_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)   # fenced, also inside a list item

WRONG_CALLS = """\
import cuproc
from cuproc import driver as cu

cu.cuInit()
cu.cuMemAlloc(cu.ffi.new("CUdeviceptr *"))
drv = cuproc.Driver("12.0")
drv.cuInit(0, 1)
drv.checked.cuCtxSynchronize(1, 2)
ok: int = cu.cuCtxSynchronize() + cu.CU_CTX_SCHED_AUTO
cuproc.Module.load(1, 2, 3, 4, 5)
cu.checked.cuInit()
cu.cuMemAloc(0)
drv.CU_CTX_SCHED_AUTOO
cuproc.DeviceBufer(16)
"""
WRONG_COUNTS = {4, 5, 7, 8, 10, 11}   # line 9 is right: the argument count of a CUDA 2.0 ABI
MISSPELT = {12, 13, 14}


ALIASES = """\
import cuproc
from cuproc import driver as cu

pointer = cuproc.Driver().cuGraphInstantiate.function
also = cu.cuGraphInstantiate.function
means: str = cu.cuGraphInstantiate.alias
rc: int = cu.cuGraphInstantiate(cu.ffi.NULL, cu.ffi.NULL, cu.ffi.NULL, cu.ffi.NULL, 0)
"""


def _sources(tmp_path: Path) -> list[Path]:
    """The README's Python blocks as files, and examples/."""
    blocks = README_BLOCK.findall((ROOT / "README.md").read_text())
    assert len(blocks) >= 2
    files = []
    for i, (_indent, block) in enumerate(blocks):
        path = tmp_path / f"readme_block_{i}.py"
        path.write_text(textwrap.dedent(block))
        files.append(path)
    examples = sorted((ROOT / "examples").glob("*.py"))
    assert examples
    aliases = tmp_path / "header_aliases.py"     # what the README says of drv.cuGraphInstantiate
    aliases.write_text(ALIASES)
    return files + examples + [aliases]


def _installed_in_site_packages() -> bool:
    paths = [*site.getsitepackages(), site.getusersitepackages()]
    return any(PACKAGE.parent == Path(p).resolve() for p in paths)


def _checker_env() -> dict[str, str]:
    """Point a checker at the cuproc under test: the checkout (also behind an editable install's
    import hook, which checkers cannot follow), or site-packages, where they find it themselves."""
    env = dict(os.environ)
    if not _installed_in_site_packages():
        env["MYPYPATH"] = str(PACKAGE.parent)
    return env


def _need(module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        if os.environ.get("CI"):
            raise AssertionError(f"{module} is missing in CI: pip install -e '.[test,typing]' installs it") from None
        pytest.skip(f"{module} is not installed (pip install -e '.[test,typing]')")


def _mypy(tmp_path: Path, files: list[Path]) -> subprocess.CompletedProcess[str]:
    # --follow-imports=silent: cuproc's own modules are checked as an installed package's are
    # (their errors are not the user's); the user's files are checked in full, --strict.
    cmd = [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
           "--cache-dir", os.devnull, "--python-executable", sys.executable, *map(str, files)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=_checker_env(), timeout=300)


def test_mypy_accepts_readme_and_examples(tmp_path):
    _need("mypy")
    proc = _mypy(tmp_path, _sources(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout


def test_mypy_reports_wrong_argument_counts_and_misspelt_names(tmp_path):
    _need("mypy")
    bad = tmp_path / "wrong_calls.py"
    bad.write_text(WRONG_CALLS)
    proc = _mypy(tmp_path, [bad])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = re.findall(r"^wrong_calls\.py:(\d+): error: .*\[([\w-]+)\]$", proc.stdout, re.M)
    assert {int(n) for n, code in errors if code in ("call-arg", "call-overload")} == WRONG_COUNTS, proc.stdout
    assert {int(n) for n, code in errors if code == "attr-defined"} == MISSPELT, proc.stdout
    assert {int(n) for n, _ in errors} == WRONG_COUNTS | MISSPELT, proc.stdout


def _pyright(tmp_path: Path, files: list[Path]) -> dict:
    _need("pyright")
    config: dict[str, object] = {"pythonVersion": f"{sys.version_info.major}.{sys.version_info.minor}"}
    if not _installed_in_site_packages():
        config["extraPaths"] = [str(PACKAGE.parent)]
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", sys.executable,
           "-p", str(tmp_path / "pyrightconfig.json"), *map(str, files)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    if proc.returncode not in (0, 1):   # 2+: pyright itself did not run (no node, bad configuration)
        message = f"pyright did not run (rc {proc.returncode}): {proc.stderr.strip()[-500:]}"
        if os.environ.get("CI") or shutil.which("node"):
            raise AssertionError(message)
        pytest.skip(message)
    return json.loads(proc.stdout)


def test_pyright_accepts_readme_and_examples(tmp_path):
    report = _pyright(tmp_path, _sources(tmp_path))
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    assert errors == []
    assert report["summary"]["filesAnalyzed"] >= 4


def test_pyright_reports_wrong_argument_counts_and_misspelt_names(tmp_path):
    bad = tmp_path / "wrong_calls.py"
    bad.write_text(WRONG_CALLS)
    report = _pyright(tmp_path, [bad])
    errors = [(d["range"]["start"]["line"] + 1, d.get("rule")) for d in report["generalDiagnostics"]
              if d["severity"] == "error"]
    assert {n for n, rule in errors if rule == "reportCallIssue"} == WRONG_COUNTS, errors
    assert {n for n, rule in errors if rule == "reportAttributeAccessIssue"} == MISSPELT, errors
    assert {n for n, _ in errors} == WRONG_COUNTS | MISSPELT, errors


UNAIDED = """\
import cuproc
from cuproc import driver as cu

buf = cuproc.DeviceBuffer(16)
size: int = buf.nbytes
rc: int = cu.cuInit(0)
"""


def _found_unaided() -> bool:
    """True when a fresh interpreter outside the checkout imports cuproc from a plain sys.path entry
    (a wheel, or an editable install in ``compat``/``strict`` mode), not through an import hook."""
    code = "import sys, cuproc, pathlib; p = pathlib.Path(cuproc.__file__).resolve().parent.parent; " \
           "print(any(pathlib.Path(e or '.').resolve() == p for e in sys.path))"
    return run_python(code, cwd="/", returncode=None).stdout.strip() == "True"


def test_checkers_find_the_installed_cuproc_unaided(tmp_path):
    """As a user's project sees cuproc: no MYPYPATH, no extraPaths, run outside the checkout.  A plain
    ``pip install -e .`` (an import hook the checkers cannot follow) is the one install this cannot
    hold for; the README says to use ``--config-settings editable_mode=compat`` there."""
    _need("mypy")
    if not _found_unaided():
        pytest.skip("cuproc is installed editable behind an import hook, which type checkers cannot follow "
                    "(pip install -e . --config-settings editable_mode=compat, see the README)")
    user = tmp_path / "user_code.py"
    user.write_text(UNAIDED)
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
                           "--cache-dir", os.devnull, "--python-executable", sys.executable, str(user)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0 and "Success" in proc.stdout, proc.stdout + proc.stderr
    _need("pyright")
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({"pythonVersion": f"{sys.version_info[0]}."
                                                                              f"{sys.version_info[1]}"}))
    proc = subprocess.run([sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", sys.executable,
                           "-p", str(tmp_path / "pyrightconfig.json"), str(user)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    if proc.returncode not in (0, 1):
        if os.environ.get("CI") or shutil.which("node"):
            raise AssertionError(f"pyright did not run (rc {proc.returncode}): {proc.stderr.strip()[-500:]}")
        pytest.skip(f"pyright did not run (rc {proc.returncode})")
    report = json.loads(proc.stdout)
    assert [d for d in report["generalDiagnostics"] if d["severity"] == "error"] == [], report
