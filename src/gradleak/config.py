"""Typed configs from their saved JSON: the one reader every stage's config uses."""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any

from gradleak.errors import ConfigError


def dataclass_from_dict(cls: type, data: dict[str, Any], source: str = "config") -> Any:
    """Rebuild a (nested) config dataclass from its JSON; fields absent there keep defaults.
    A section that is not an object, or a value of the wrong type, is named in the error."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected an object, found {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    values = {}
    for item in dataclasses.fields(cls):
        if item.name not in data:
            continue
        value, kind, where = data[item.name], hints[item.name], f"{source}.{item.name}"
        if dataclasses.is_dataclass(kind):
            values[item.name] = dataclass_from_dict(kind, value, where)
            continue
        _check_like(_default(item), value, where)
        values[item.name] = copy.deepcopy(value)
    return cls(**values)


def _default(item: dataclasses.Field) -> Any:
    if item.default is not dataclasses.MISSING:
        return item.default
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return None


def _check_like(default: Any, value: Any, where: str) -> None:
    """A saved value must have its field's JSON type (an int where 64 was, a list where [])."""
    if default is None or value is None:
        return
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, (int, float)):
        ok = isinstance(value, (int, float)) and (isinstance(default, float)
                                                  or isinstance(value, int))
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"{where} is {value!r}, expected a value like {default!r}")
