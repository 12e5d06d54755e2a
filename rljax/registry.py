"""A small named registry: one per variant axis (advantages, losses, rewards, ...).

Names are resolved once, when a step or loop is built; call sites never compare names.
Duplicate registration is an error and an unknown name lists the valid choices.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects (usually functions) of one signature."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering `fn` under `name`; registering a name twice raises."""

        def decorator(fn: T) -> T:
            self.add(name, fn)
            return fn

        return decorator

    def add(self, name: str, fn: T) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"duplicate {self.kind} name {name!r}: already registered")
        self._entries[name] = fn

    def get(self, name: str) -> T:
        """Returns the entry for `name`; an unknown name raises KeyError listing the valid names."""
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), self._entries, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise KeyError(
                f"unknown {self.kind} {name!r}{hint}; valid names: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
