"""`bench compare` stopped at its first child: the tests read what the parent prepared (the
child's spec: model, config, inputs) without running a benchmark."""

from __future__ import annotations

from typing import Any


class ChildStarted(Exception):
    """Raised where `bench compare` would start a child process."""


def stop_at_children(monkeypatch: Any) -> list[dict[str, Any]]:
    """Every child `bench compare` starts raises :class:`ChildStarted` instead; the returned list
    gets each one's spec, in order."""
    from preheat.bench import compare

    specs: list[dict[str, Any]] = []

    def child(spec: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        specs.append(spec)
        raise ChildStarted

    monkeypatch.setattr(compare, "_run_child", child)
    return specs
