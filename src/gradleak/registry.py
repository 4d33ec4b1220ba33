"""Name → class registries (timm style): adding a victim or a rule is one decorator."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from gradleak.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of factories, with errors that list what does exist."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorate(entry: T) -> T:
            if name in self._entries:
                raise ConfigError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return decorate

    def drop(self, name: str) -> None:
        """Forgets `name` (a module reloaded registers its entries again)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise ConfigError(f"unknown {self.kind} {name!r}; expected one of: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
