"""``NamedTuple`` for cuproc's record types: typing's class syntax, made into a tuple class here.

Why: ``typing.NamedTuple`` evaluates every field's annotation when it makes the class (under
``from __future__ import annotations`` each one is a string, compiled into a ``ForwardRef``) and
does more bookkeeping besides; ``collections.namedtuple`` compiles a ``__new__`` for each class
(``eval``).  ``import cuproc`` makes nine record classes: through ``collections.namedtuple`` they
took about 1.7 ms of the ~7 ms import on the GPU machine (2026-11-25, H100 host), and the startup
goal (issue 9) is counted in milliseconds.  Here a record class is one ``type()`` call: its fields
are C accessors, and ``__new__``, ``_make``, ``_replace``, ``_asdict``, ``__repr__`` and
``__getnewargs__`` are functions shared by every record.

Type checkers see ``typing.NamedTuple`` itself.  At run time a class body written for it makes the
same kind of class as ``collections.namedtuple`` of the annotated fields in order, with the body's
defaults, docstring and methods, and the annotations kept unevaluated (tests/test_namedtuple.py
compares them with ``typing.NamedTuple``'s, which ``collections.namedtuple`` makes).  As with typing's, a field without a default may not follow one with a default,
a field may not start with an underscore, and the body may not replace what a record is made with
(``_replace``, ``__new__``, ...).  The module that subclasses it needs ``from __future__ import
annotations``: Python 3.14 would otherwise keep the annotations lazy, out of the class body's
namespace, and the class refuses to be made.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import NamedTuple as NamedTuple
else:
    try:   # the field accessor collections.namedtuple uses (C); a property over itemgetter elsewhere
        from _collections import _tuplegetter
    except ImportError:  # pragma: no cover - every CPython has it
        from operator import itemgetter as _itemgetter

        def _tuplegetter(index: int, doc: str) -> property:   # type: ignore[misc]
            return property(_itemgetter(index), doc=doc)

    import sys

    _tuple_new = tuple.__new__
    # What _replace raises for a name that is no field: collections.namedtuple's, ValueError before 3.13
    _UNEXPECTED_FIELD = TypeError if sys.version_info >= (3, 13) else ValueError

    # What a class body holds that is not a field, a method or a docstring of the record.
    _BODY_ONLY = frozenset({"__annotations__", "__module__", "__qualname__"})
    # What a record is made with and a body may not replace (typing refuses most of these too).
    _RESERVED = frozenset({"__new__", "__init__", "__slots__", "__getnewargs__", "__replace__", "__signature__",
                           "_fields", "_field_defaults", "_make", "_replace", "_asdict", "_source"})

    def _new(_cls, /, *args, **kwargs):   # noqa: ANN001, ANN002, ANN003, ANN202 - every record's __new__
        """Create a new instance of the record (the fields by position or by name)."""
        if kwargs or len(args) != len(_cls._fields):
            args = _bind(_cls, args, kwargs)
        return _tuple_new(_cls, args)

    def _bind(cls, args: tuple, kwargs: dict) -> tuple:   # noqa: ANN001
        """The values of a call with keywords, defaults or a wrong count, or a TypeError naming what is wrong."""
        fields, defaults, name = cls._fields, cls._field_defaults, cls.__name__
        if len(args) > len(fields):
            raise TypeError(f"{name}.__new__() takes {len(fields) + 1} positional arguments but "
                            f"{len(args) + 1} were given")
        values = list(args)
        for field in fields[len(args):]:
            if field in kwargs:
                values.append(kwargs.pop(field))
            elif field in defaults:
                values.append(defaults[field])
            else:
                raise TypeError(f"{name}.__new__() missing required argument: {field!r}")
        for key in kwargs:
            raise TypeError(f"{name}.__new__() got multiple values for argument {key!r}" if key in fields else
                            f"{name}.__new__() got an unexpected keyword argument {key!r}")
        return tuple(values)

    @classmethod   # type: ignore[misc]
    def _make(cls, iterable):   # noqa: ANN001, ANN202
        """Make a new record from a sequence or iterable."""
        result = _tuple_new(cls, iterable)
        if len(result) != len(cls._fields):
            raise TypeError(f"Expected {len(cls._fields)} arguments, got {len(result)}")
        return result

    def _replace(self, /, **changes):   # noqa: ANN001, ANN003, ANN202
        """Return a new record replacing the given fields with new values."""
        result = self._make(map(changes.pop, self._fields, self))
        if changes:
            raise _UNEXPECTED_FIELD(f"Got unexpected field names: {list(changes)!r}")
        return result

    def _asdict(self) -> dict:   # noqa: ANN001
        """Return a new dict which maps field names to their values."""
        return dict(zip(self._fields, self))

    def _repr(self) -> str:   # noqa: ANN001
        return f"{self.__class__.__name__}({', '.join(f'{k}={v!r}' for k, v in zip(self._fields, self))})"

    def _getnewargs(self) -> tuple:   # noqa: ANN001
        return tuple(self)

    class _Signature:
        """A record's ``__signature__`` (its fields, with their defaults), made when asked for:
        ``inspect.signature`` and ``help()`` would otherwise see the shared ``(*args, **kwargs)``.  Only a
        record class that calls the shared ``__new__`` has one (an instance, or a subclass with a ``__new__``
        of its own, gets the usual lookup, as with collections.namedtuple)."""

        def __get__(self, instance: object, owner: type) -> object:
            if instance is not None or owner.__new__ is not _new:
                raise AttributeError("__signature__")
            import inspect
            empty, kind = inspect.Parameter.empty, inspect.Parameter.POSITIONAL_OR_KEYWORD
            defaults = owner._field_defaults   # type: ignore[attr-defined]
            return inspect.Signature([inspect.Parameter(field, kind, default=defaults.get(field, empty))
                                      for field in owner._fields])   # type: ignore[attr-defined]

    _SIGNATURE = _Signature()

    def _record(name: str, fields: list[str], defaults: list, namespace: dict) -> type:
        """The record class: what collections.namedtuple makes of ``fields``, made without compiling."""
        for field in fields:
            if field.startswith("_"):
                raise ValueError(f"Field names cannot start with an underscore: {field!r}")
        body = {"__slots__": (), "__module__": namespace["__module__"], "__qualname__": namespace["__qualname__"],
                "__doc__": f"{name}({', '.join(fields)})", "_fields": tuple(fields),
                "_field_defaults": dict(zip(fields[len(fields) - len(defaults):], defaults)),
                "__match_args__": tuple(fields), "__new__": _new, "_make": _make, "_replace": _replace,
                "_asdict": _asdict, "__repr__": _repr, "__getnewargs__": _getnewargs, "__signature__": _SIGNATURE}
        if sys.version_info >= (3, 13):   # copy.replace(); collections.namedtuple has it from 3.13 on
            body["__replace__"] = _replace
        for index, field in enumerate(fields):
            body[field] = _tuplegetter(index, f"Alias for field number {index}")
        return type(name, (tuple,), body)

    class _RecordMaker(type):
        def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict):
            if not bases:                         # NamedTuple itself
                return super().__new__(mcls, name, bases, namespace)
            if bases != (NamedTuple,):
                raise TypeError(f"{name}: a NamedTuple record takes no other base classes")
            if "__annotations__" not in namespace and "__annotate__" in namespace:
                # Python 3.14 (PEP 649) keeps a body's annotations lazy unless the module has
                # ``from __future__ import annotations``, which every user of this class has.
                raise TypeError(f"{name}: a NamedTuple record needs 'from __future__ import annotations'")
            overridden = _RESERVED.intersection(namespace)
            if overridden:
                raise AttributeError(f"{name}: a NamedTuple record cannot override {sorted(overridden)}")
            annotations = namespace.get("__annotations__", {})
            fields = list(annotations)
            defaults = []
            for field in fields:
                if field in namespace:
                    defaults.append(namespace[field])
                elif defaults:
                    raise TypeError(f"{name}: field {field!r} without a default follows a field with one")
            record = _record(name, fields, defaults, namespace)
            record.__annotations__ = annotations
            for key, value in namespace.items():
                if key not in _BODY_ONLY and key not in fields:
                    setattr(record, key, value)
            return record

    class NamedTuple(metaclass=_RecordMaker):
        """Subclass it with typing.NamedTuple's class syntax (see the module docstring)."""

__all__ = ["NamedTuple"]
