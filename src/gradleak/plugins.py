"""Plugins: a user's victims, attacks and defenses, registered by importing their module.

A plugin is any importable module whose import registers something (`@register_victim("mine")`,
`register_defense`, ...). gradleak imports every module named by `--plugin module.path` and
every entry point in the group `gradleak.plugins` of the installed distributions:

    [project.entry-points."gradleak.plugins"]
    my-victims = "my_package.victims"
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points

from gradleak.errors import ConfigError

GROUP = "gradleak.plugins"
_loaded: set[str] = set()


def load_plugins(modules: Iterable[str] = ()) -> list[str]:
    """Import the installed entry points, then `modules`; returns what was loaded, in order."""
    loaded = []
    for point in entry_points(group=GROUP):
        if point.value not in _loaded:
            _import(point.value, f"entry point {point.name!r} ({GROUP})", point.load)
            loaded.append(point.value)
    for module in modules:
        if module not in _loaded:
            _import(module, f"--plugin {module}", lambda name=module: importlib.import_module(name))
            loaded.append(module)
    return loaded


def _import(name: str, label: str, load: Callable[[], object]) -> None:
    try:
        load()
    except ImportError as err:
        raise ConfigError(f"{label}: cannot import it ({err})") from None
    _loaded.add(name)
