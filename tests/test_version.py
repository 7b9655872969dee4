import pytest
from packaging.version import Version

from cuproc.version import CudaVersion


@pytest.mark.parametrize("text,major,minor,encoded", [
    ("12.4", 12, 4, 12040), ("12.4.1", 12, 4, 12040), ("11.1", 11, 1, 11010),
    ("13.0", 13, 0, 13000), ("13", 13, 0, 13000), ("12040", 12, 4, 12040), (" 11.8 ", 11, 8, 11080),
])
def test_parse_strings(text, major, minor, encoded):
    v = CudaVersion.parse(text)
    assert (v.major, v.minor) == (major, minor)
    assert int(v) == encoded


def test_eleven_one_is_not_eleven_hundred():
    assert int(CudaVersion.parse("11.1")) == 11010
    assert CudaVersion.from_int(11010) == CudaVersion(11, 1)
    assert CudaVersion.from_int(11100) == CudaVersion(11, 10)


@pytest.mark.parametrize("value", [12040, (12, 4), (12, 4, 1), [12, 4], Version("12.4.1"), CudaVersion(12, 4)])
def test_parse_other_forms(value):
    assert CudaVersion.parse(value) == CudaVersion(12, 4)


def test_round_trip_over_every_driver_integer():
    for major in range(1, 20):
        for minor in range(0, 100):
            v = CudaVersion(major, minor)
            assert CudaVersion.from_int(int(v)) == v
            assert CudaVersion.parse(str(v)) == v
            assert CudaVersion.parse(int(v)) == v


def test_ordering_and_hash():
    vs = [CudaVersion.parse(s) for s in ("13.0", "11.8", "12.10", "12.9", "12.4")]
    assert [str(v) for v in sorted(vs)] == ["11.8", "12.4", "12.9", "12.10", "13.0"]
    assert len({CudaVersion(12, 4), CudaVersion.parse("12.4.7"), CudaVersion.from_int(12040)}) == 1
    assert CudaVersion(12, 4) != 12040  # no silent int equality: compare versions with versions


@pytest.mark.parametrize("bad", ["", "abc", "12.x", 12, 12045, -1, True, (12, "4"), (), 3.5, None])
def test_rejects_bad_input(bad):
    with pytest.raises((TypeError, ValueError)):
        CudaVersion.parse(bad)


def test_immutable():
    v = CudaVersion(12, 4)
    with pytest.raises(AttributeError):
        v.major = 13
