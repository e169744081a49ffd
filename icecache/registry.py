"""Name -> class registries for methods, tasks and model sources; the only global state in the harness."""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection filled by a decorator at import time, e.g. ``@METHODS.register("quest")``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries and self._entries[name] is not entry:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def unregister(self, name: str) -> None:
        """Remove an entry (tests that register a throw-away one)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        if name not in self._entries:
            known = ", ".join(sorted(self._entries)) or "none"
            raise ConfigError(f"unknown {self.kind} {name!r}; known: {known}")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def names(self) -> list[str]:
        return sorted(self._entries)
