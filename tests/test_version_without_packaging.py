"""cuproc depends on cffi only (issue 41's review): CudaVersion.parse reads a PEP 440 version string
without the ``packaging`` distribution, and gives the major.minor that ``packaging`` would."""
from __future__ import annotations

import pytest
from packaging.version import Version   # pytest's own dependency: present wherever the tests run

from cuproc.version import CudaVersion
from subproc import run_python

# How CUDA versions reach a program: toolkits, drivers, and the versions of the packages that carry them
# (nvidia-cuda-nvrtc 13.0.48, cuda-python 12.6.2.post1, pre-releases, local builds).
PEP440_FORMS = ["12.4rc1", "12.4.0rc2", "v12.4", "V13.0.1", "12.8.93.1", "12.6.2.post1", "12.6.2-1",
                "12.4.dev3", "12.4.1a1.post2.dev3", "13.0+cu130", "12.9.1+local.build-7", "11.8.0-beta.2",
                "12.1.105.post20240315", "12.0.0preview1", "12.2_rc_3"]
NOT_VERSIONS = ["\u0661\u0662.\u0664rc1", "\u00b2", "12.\u0664",   # digits of other scripts
                "12.x", "12.4.", ".12.4", "12..4", "12.4 rc1", "12.4+", "1!12.4", "12.4-", "cuda12.4", "12.4rc1x"]


@pytest.mark.parametrize("text", PEP440_FORMS)
def test_a_pep_440_string_gives_the_release_packaging_reads(text):
    release = Version(text).release
    assert CudaVersion.parse(text) == CudaVersion(release[0], release[1] if len(release) > 1 else 0)


@pytest.mark.parametrize("text", NOT_VERSIONS)
def test_what_is_not_a_version_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="not a CUDA version"):
        CudaVersion.parse(text)


def test_parse_never_imports_packaging():
    """In a process where ``import packaging`` fails: the forms above still parse, and a Version-like
    object still counts by its ``release`` (tests/test_packaging.py checks that nothing but cffi is required)."""
    proc = run_python(f"""
        import sys
        sys.modules["packaging"] = None   # any import of packaging now raises ImportError
        from cuproc.version import CudaVersion
        for text in {PEP440_FORMS!r}:
            CudaVersion.parse(text)
        class Release:
            release = (12, 4, 1)
        print(CudaVersion.parse("12.4rc1"), CudaVersion.parse(Release()))
        """)
    assert proc.stdout.split() == ["12.4", "12.4"]
