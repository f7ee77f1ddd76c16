"""A dict whose values are made on first use: a module fixture's folders or pipelines per kind, so
that a test of one kind builds no other (the int8 and fp8 storage tests share it)."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["BuiltOnUse"]


class BuiltOnUse(dict):
    """``d[key]`` is ``make(key)``, made once."""

    def __init__(self, make: Callable[[Any], Any]):
        super().__init__()
        self._make = make

    def __missing__(self, key: Any) -> Any:
        value = self[key] = self._make(key)
        return value
