"""Named extension points, one `Registry` each: the scheduler's policies, routers, cost models,
trace formats, synthetic workloads and SLO profiles, the worker's engines and the vLLM
plug-in's policies. Adding one is a new module plus one `@REGISTRY.register("name")` line (or
`REGISTRY.add(name, item)` for an entry that is data, such as an engine's import path)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def add(self, name: str, item: T) -> T:
        if name in self._items or name in self._aliases:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._items[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            return self.add(name, item)

        return add

    @contextmanager
    def registered(self, name: str, item: T) -> Iterator[T]:
        """`item` under `name` while the block runs: an extension only a harness uses (the
        simulator's model of the vLLM plug-in) is never listed to users or to other code."""
        self.add(name, item)
        try:
            yield item
        finally:
            del self._items[name]

    def alias(self, alias: str, name: str) -> None:
        """`alias` answers for the registered `name`."""
        if name not in self._items:
            raise KeyError(f"{self.kind} alias {alias!r} names unknown {name!r}")
        if alias in self._items or alias in self._aliases:
            raise ValueError(f"{self.kind} {alias!r} registered twice")
        self._aliases[alias] = name

    def canonical(self, name: str) -> str:
        """The registered name `name` stands for (itself unless it is an alias)."""
        return self._aliases.get(name, name)

    def get(self, name: str) -> T:
        try:
            return self._items[self.canonical(name)]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.choices())}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def aliases(self) -> list[str]:
        return sorted(self._aliases)

    def choices(self) -> list[str]:
        """Every name a user may give: the registered ones, then the aliases."""
        return [*self.names(), *self.aliases()]

    def __contains__(self, name: str) -> bool:
        return name in self._items or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
