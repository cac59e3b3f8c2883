"""Named registries: policies are chosen by name, never by if/elif chains (STYLE rule 8).

    EVICTION = Registry[EvictionPolicy]("eviction policy")

    @EVICTION.register("lru")
    class LruPolicy(EvictionPolicy): ...

    policy = EVICTION.make("lru")

Registration happens at import time; a registry is then only read, so it
needs no lock.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound=type)


class Registry(Generic[T]):
    """Classes by name, each given a ``name`` attribute when registered.

    Args:
        kind: what the classes are, for error messages ("eviction policy").
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[C], C]:
        """Class decorator: registers the class under ``name``.

        Raises:
            ValueError: ``name`` is taken by another class.
        """

        def decorate(cls: C) -> C:
            other = self.classes.get(name)
            if other is not None and other is not cls:
                raise ValueError(f"{self.kind} {name!r} already registered by {other.__name__}")
            cls.name = name
            self.classes[name] = cls
            return cls

        return decorate

    def make(self, name: str, **kwargs: Any) -> T:
        """Builds the class registered as ``name`` with ``kwargs``.

        Raises:
            KeyError: unknown name (the message lists the known ones).
        """
        try:
            cls = self.classes[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {sorted(self.classes)}") from None
        return cls(**kwargs)
