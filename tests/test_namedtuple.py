"""cuproc._namedtuple.NamedTuple makes, from typing.NamedTuple's class syntax, a class that behaves as typing's."""
from __future__ import annotations

import pickle
import sys
import typing

import pytest

from cuproc import registry
from cuproc._namedtuple import NamedTuple


class Row(NamedTuple):
    """A row."""

    name: str
    size: int
    tags: tuple[str, ...] = ()
    note: str | None = None

    def describe(self) -> str:
        return f"{self.name}:{self.size}"

    @property
    def tagged(self) -> bool:
        return bool(self.tags)


class TypingRow(typing.NamedTuple):
    name: str
    size: int
    tags: tuple[str, ...] = ()
    note: str | None = None


def test_a_record_is_a_namedtuple_like_typings():
    row = Row("a", 1)
    twin = TypingRow("a", 1)
    assert isinstance(row, tuple) and tuple(row) == tuple(twin) == ("a", 1, (), None)
    assert Row._fields == TypingRow._fields and Row._field_defaults == TypingRow._field_defaults
    assert Row.__match_args__ == TypingRow.__match_args__
    assert row._replace(size=2) == ("a", 2, (), None) and row._asdict() == twin._asdict()
    assert Row._make(["b", 3, ("x",), "n"]).tagged and Row(name="c", size=4, note="n").note == "n"
    assert repr(row) == "Row(name='a', size=1, tags=(), note=None)"
    assert row.describe() == "a:1" and not row.tagged
    assert Row.__doc__ == "A row." and Row.__qualname__ == "Row" and Row.__module__ == __name__
    assert Row.__annotations__["size"] == "int"         # kept unevaluated
    assert pickle.loads(pickle.dumps(row)) == row and type(pickle.loads(pickle.dumps(row))) is Row
    with pytest.raises(AttributeError):
        row.size = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        Row("a")  # type: ignore[call-arg]


class Bare(NamedTuple):
    x: int


CALLS = [((), {}), (("a",), {}), (("a", 1), {}), (("a", 1, ("t",)), {}), (("a", 1, (), "n"), {}),
         (("a", 1, (), "n", "extra"), {}), ((), {"name": "a", "size": 1}), (("a",), {"size": 1, "note": "n"}),
         (("a", 1), {"name": "b"}), (("a", 1), {"colour": "red"}), ((), {"size": 1}), (("a", 1), {"tags": ("u",)})]


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_a_call_builds_or_refuses_as_typings_record_does(args, kwargs):
    """Positional, keyword and default values, and the TypeError of a missing, repeated, unknown or extra
    argument, as typing.NamedTuple's class gives them."""
    try:
        want = TypingRow(*args, **kwargs)
    except TypeError:
        with pytest.raises(TypeError, match="Row.__new__"):
            Row(*args, **kwargs)
    else:
        got = Row(*args, **kwargs)
        assert type(got) is Row and tuple(got) == tuple(want) and got._asdict() == want._asdict()


def test_make_replace_copy_and_the_class_as_typings():
    import copy
    row, twin = Row("a", 1), TypingRow("a", 1)
    for bad in (["a"], ["a", 1, (), None, 5]):
        with pytest.raises(TypeError):
            TypingRow._make(bad)
        with pytest.raises(TypeError):
            Row._make(bad)
    unexpected = TypeError if sys.version_info >= (3, 13) else ValueError   # collections.namedtuple's, by version
    with pytest.raises(unexpected, match="colour"):
        twin._replace(colour="red")
    with pytest.raises(unexpected, match="colour"):
        row._replace(colour="red")
    assert copy.copy(row) == row and type(copy.deepcopy(row)) is Row and hash(row) == hash(tuple(row))
    assert not hasattr(row, "__dict__") and Row.__slots__ == ()
    assert Row.size.__doc__ == TypingRow.size.__doc__ and Row.size.__get__(row) == 1
    assert Bare.__doc__ == "Bare(x)" and Bare(3).x == 3 and repr(Bare(3)) == "Bare(x=3)"
    assert Bare.__new__ is Row.__new__   # one shared, uncompiled __new__


def test_a_record_has_what_typings_record_has():
    """Nothing collections.namedtuple puts on a class (on this Python: __replace__ from 3.13) is missing, the
    signature names the fields and their defaults, and a field may be called cls."""
    import inspect
    assert set(vars(TypingRow)) - set(vars(Row)) == {"__orig_bases__"}   # typing's own bookkeeping
    assert ("__replace__" in vars(Row)) == ("__replace__" in vars(TypingRow)) == (sys.version_info >= (3, 13))
    def parameters(cls: type) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]
    assert parameters(Row) == parameters(TypingRow) and parameters(Row)[2][2] == ()
    class Sub(Row):   # a __new__ of its own: its signature, not the record's fields
        def __new__(cls, name: str) -> Sub:
            return super().__new__(cls, name, 0)

    class TypingSub(TypingRow):
        def __new__(cls, name: str) -> TypingSub:
            return super().__new__(cls, name, 0)
    assert parameters(Sub) == parameters(TypingSub) and [p[0] for p in parameters(Sub)] == ["name"]
    assert not hasattr(Row("a", 1), "__signature__") and not hasattr(TypingRow("a", 1), "__signature__")
    assert Row._make.__doc__ and Row._replace.__doc__ and Row._asdict.__doc__ and Row.__new__.__doc__

    class Odd(NamedTuple):
        cls: int
        self: int = 0
    assert Odd(cls=1, self=2) == (1, 2) and Odd(1)._replace(cls=3) == (3, 0)
    if hasattr(__import__("copy"), "replace"):   # Python 3.13
        import copy
        assert copy.replace(Row("a", 1), size=2) == ("a", 2, (), None)


def test_a_field_without_a_default_may_not_follow_one_with_a_default():
    with pytest.raises(TypeError):
        class Bad(NamedTuple):
            name: str = ""
            size: int  # type: ignore[misc]


def test_a_record_takes_no_other_bases_and_fields_may_not_start_with_an_underscore():
    with pytest.raises(TypeError):
        class Mixed(NamedTuple, int):  # type: ignore[misc]
            x: int
    with pytest.raises(ValueError):
        class Private(NamedTuple):
            _x: int


def test_a_record_may_not_replace_what_namedtuple_makes():
    with pytest.raises(AttributeError):
        class Replacing(NamedTuple):
            x: int

            def _replace(self, **changes: int) -> Replacing:  # type: ignore[override]
                return self


def test_the_registrys_records_are_records():
    from cuproc import driver
    for cls in (registry.Variant, registry.Symbol, registry.Selection, registry.Entry, registry.Change,
                driver.Resolution):
        assert issubclass(cls, tuple) and cls._fields and cls.__doc__
        assert "__orig_bases__" not in vars(cls) and "__orig_bases__" in vars(TypingRow)   # made here, not by typing
