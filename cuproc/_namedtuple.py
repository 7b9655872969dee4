"""``NamedTuple`` for cuproc's record types: typing's class syntax, built by ``collections.namedtuple``.

Why: ``typing.NamedTuple`` evaluates every field's annotation when it makes the class (under
``from __future__ import annotations`` each one is a string, compiled into a ``ForwardRef``) and
does more bookkeeping besides.  For the nine record classes that ``import cuproc`` makes, that was
about 0.8 ms of a 6.5 ms import (Python 3.12, 2026-11-24: 40 fresh processes each), and the
startup goal (issue 9) is counted in milliseconds.

Type checkers see ``typing.NamedTuple`` itself.  At run time a class body written for it makes the
same kind of class: ``collections.namedtuple`` of the annotated fields in order, with the body's
defaults, docstring and methods, and the annotations kept unevaluated.  As with typing's, a field
without a default may not follow one with a default, a field may not start with an underscore, and
the body may not replace what ``collections.namedtuple`` makes (``_replace``, ``__new__``, ...).  The
module that subclasses it needs ``from __future__ import annotations``: Python 3.14 would otherwise keep
the annotations lazy, out of the class body's namespace, and the class refuses to be made.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing at run time (startup, issue 9)
if TYPE_CHECKING:
    from typing import NamedTuple as NamedTuple
else:
    import collections

    # What a class body holds that is not a field, a method or a docstring of the record.
    _BODY_ONLY = frozenset({"__annotations__", "__module__", "__qualname__"})
    # What collections.namedtuple makes and a body may not replace (typing refuses these too).
    _RESERVED = frozenset({"__new__", "__init__", "__slots__", "__getnewargs__", "_fields", "_field_defaults",
                           "_make", "_replace", "_asdict", "_source"})

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
            record = collections.namedtuple(name, fields, defaults=defaults, module=namespace["__module__"])
            record.__qualname__ = namespace["__qualname__"]
            record.__annotations__ = annotations
            for key, value in namespace.items():
                if key not in _BODY_ONLY and key not in fields:
                    setattr(record, key, value)
            return record

    class NamedTuple(metaclass=_RecordMaker):
        """Subclass it with typing.NamedTuple's class syntax (see the module docstring)."""

__all__ = ["NamedTuple"]
