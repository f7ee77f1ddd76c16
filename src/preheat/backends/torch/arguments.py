"""The call API both torch pipelines share: ``preheat.families.request``'s checks, as methods.

The torch pipelines validate a call exactly as the JAX engine does -- the same function, so the
same defaults, bounds and one-line errors -- without importing the engine.
"""

from __future__ import annotations

from typing import Any

from preheat.families import request as request_of
from preheat.families.base import Request
from preheat.families.pixel import class_index

__all__ = ["EngineArguments"]


class EngineArguments:
    """Mixed into ``TorchPipeline`` and ``TorchTextPipeline`` (dataclasses with the fields of
    ``preheat.families.request.ArgumentView`` and a ``run(request)``)."""

    # what the JAX pipeline has and a torch one does not: one device, no start-up phases, no load report
    mesh: Any = None
    startup: Any = None
    load_report: Any = None
    lora_runtime: Any = None  # no LoRAs on torch
    reports_progress = False  # run() takes no progress callback: diffusers' loop is not ours to report from

    @property
    def device_count(self) -> int:
        return 1

    def __post_init__(self) -> None:
        self.defaults = request_of.resolved_defaults(self.family, self.defaults)  # type: ignore[attr-defined]

    def __call__(self, first: Any = None, /, **inputs: Any) -> list:
        """Sample images; returns ``list[PIL.Image]`` (see ``preheat.engine.Pipeline.__call__``)."""
        return request_of.images(self.generate(first, **inputs))

    def generate(self, first: Any = None, /, **inputs: Any) -> Any:
        """Like ``__call__`` but returns uint8 pixels, (n, H, W, C)."""
        return self.run(self.validate(first, **inputs))  # type: ignore[attr-defined]

    def validate(self, first: Any = None, /, **inputs: Any) -> Request:
        return request_of.validate(self, first, inputs)  # type: ignore[arg-type]

    def check(self, first: Any = None, /, **inputs: Any) -> Request:
        return request_of.check(self, first, inputs)  # type: ignore[arg-type]

    def class_index(self, c: Any) -> int:
        return class_index(self, c)  # type: ignore[arg-type]

    def is_guided(self, guidance: float | None = None, **inputs: Any) -> bool:
        return request_of.guidance(self, guidance, inputs)[0]  # type: ignore[arg-type]
