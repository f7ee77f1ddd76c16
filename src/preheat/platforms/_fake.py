"""A platform description for tests, as httpx ships a mock transport: every choice is a value the
test sets, selected with ``preheat.platforms.selected(FakePlatform(...))``."""

from __future__ import annotations

from typing import Any, Callable, Optional

from preheat.platforms._base import Attention, AttentionLayer, ConvLayer, Platform

__all__ = ["FakePlatform"]


class FakePlatform(Platform):
    """A platform whose answers are given: ``attention`` (an ``Attention``, or a function of the
    layer returning one), ``conv`` (a form, or a function of the layer), ``groupnorm``, and
    ``autotunes``/``doctor_checks``/``accelerator``/``fences``. It records every attention layer it was
    asked about in ``layers``."""

    def __init__(self, name: str = "fake", *,
                 attention: Attention | Callable[[AttentionLayer], Attention] = Attention(None),
                 conv: str | Callable[[Optional[ConvLayer]], str] = "conv", groupnorm: str = "two_pass",
                 autotunes: bool = False, accelerator: bool = True, doctor_checks: tuple[str, ...] = (),
                 fences: bool = False) -> None:
        super().__init__(name)
        self.fences = fences
        self._attention, self._conv, self._groupnorm = attention, conv, groupnorm
        self.autotunes, self.accelerator, self.doctor_checks = autotunes, accelerator, doctor_checks
        self.layers: list[AttentionLayer] = []

    def attention(self, layer: AttentionLayer, capability: Any = None, deviceless: bool = False) -> Attention:
        self.layers.append(layer)
        return self._attention(layer) if callable(self._attention) else self._attention

    def conv_form(self, layer: Optional[ConvLayer], deviceless: bool = False) -> str:
        return self._conv(layer) if callable(self._conv) else self._conv

    def groupnorm_form(self) -> str:
        return self._groupnorm
