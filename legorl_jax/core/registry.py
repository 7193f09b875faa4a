"""Name → entry registries: advantage estimators, policy losses, harnesses.

Configs and requests name these as strings, so a new variant is one registered
entry rather than an edit to a dispatch table, and a wrong name is an error that
lists the right ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """A config named something no one registered; the message lists what exists."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class Registry(Generic[T]):
    """Entries of one `kind` by name. `error` is raised for an unknown name."""

    def __init__(self, kind: str, error: type[Exception] = UnknownNameError) -> None:
        self.kind = kind
        self._error = error
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers what it decorates under `name`."""

        def decorate(entry: T) -> T:
            self.add(name, entry)
            return entry

        return decorate

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            registered = ", ".join(self.names())
            raise self._error(f"unknown {self.kind} {name!r}; registered: {registered}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)
