"""A toy family, declared here and nowhere else: the built-in digits model plus one new input.

``brightness`` (a float in [0, 1], one per call, data) lifts the final sample before it becomes
pixels. Its only declaration is the ``InputSpec`` below: the test beside this file shows that the
Python API, ``preheat sample --help``, the Cog and OpenAI schemas and the warm-up set all take it
with no code of their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from preheat.families.base import EngineView, LoadedModel, Request, to_pixels
from preheat.families.inputs import Float, InputSpec
from preheat.families.pixel import CLASS_LABELS, PixelFamily, load_pixel

BRIGHTNESS = InputSpec("brightness", Float(0.0, 1.0), "How much to lift the image before it becomes pixels.",
                       default=0.0, warm=(0.0, 0.5))


@dataclass(frozen=True)
class ToyFamily(PixelFamily):
    name: str = "toy"
    specs: tuple[InputSpec, ...] = (CLASS_LABELS, BRIGHTNESS)
    pixels_in_loop: bool = False  # finish() converts, after the lift

    def finish(self, pipe: EngineView, request: Request, out: Any) -> np.ndarray:
        import jax.numpy as jnp

        return np.asarray(to_pixels(jnp.asarray(out) + 2.0 * request.values["brightness"]))  # [-1, 1] + lift


TOY = ToyFamily()


def load_toy(root: Any, **options: Any) -> LoadedModel:
    return dataclasses.replace(load_pixel(root, **options), family=TOY)
