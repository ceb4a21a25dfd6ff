"""Options are checked against the spec's dataclass annotations when a spec is created, for every plugin."""

import collections.abc
import dataclasses
import math
import numbers
import typing

from .errors import KerasdistError


def check_option_types(spec, where):
    """Raise a KerasdistError naming the first option whose value does not fit its annotation."""
    if not dataclasses.is_dataclass(spec):
        return
    try:
        hints = typing.get_type_hints(type(spec))
    except Exception:  # an annotation that cannot be resolved: nothing to check against
        return
    for field in dataclasses.fields(spec):
        if not field.init or field.name not in hints:
            continue
        value = getattr(spec, field.name)
        expected = hints[field.name]
        if not _fits(value, expected):
            raise KerasdistError(f"{where}: {field.name}={value!r} is not valid; expected {_describe(expected)}.")


def _fits(value, expected):
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is typing.Any or expected is object:
        return True
    if origin is typing.Union:
        return any(_fits(value, arg) for arg in args)
    if expected is type(None):
        return value is None
    if expected is bool:
        return _is_bool(value)
    if expected is int:
        return isinstance(value, numbers.Integral) and not _is_bool(value)
    if expected is float:
        return isinstance(value, numbers.Real) and not _is_bool(value) and math.isfinite(float(value))
    if expected is str:
        return isinstance(value, str)
    if origin in (collections.abc.Sequence, list, tuple) or expected in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return False
        item = args[0] if args and args[0] is not Ellipsis else typing.Any
        return all(_fits(v, item) for v in value)
    if origin is collections.abc.Callable or expected is collections.abc.Callable:
        return callable(value)
    if origin is dict or expected is dict:
        return isinstance(value, dict)
    return True  # a class or construct this check does not know: the plugin checks it


def _is_bool(value):
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def _describe(expected):
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin is typing.Union:
        return " or ".join(_describe(a) for a in args)
    if expected is type(None):
        return "None"
    names = {bool: "True or False", int: "a whole number", float: "a finite number", str: "a string",
             dict: "a dict"}
    if expected in names:
        return names[expected]
    if origin in (collections.abc.Sequence, list, tuple) or expected in (list, tuple):
        item = args[0] if args and args[0] is not Ellipsis else None
        plural = {str: "strings", int: "whole numbers", float: "numbers"}.get(item, "values")
        return f"a list of {plural}"
    if origin is collections.abc.Callable or expected is collections.abc.Callable:
        return "a function"
    return getattr(expected, "__name__", str(expected))
