"""A toy family, declared here and nowhere else: the built-in digits model plus one new input.

``brightness`` (a float in [0, 1], one per call, data) lifts the final sample before it becomes
pixels. Its only declaration is the ``InputSpec`` below: the test beside this file shows that the
Python API, ``preheat sample --help``, the Cog and OpenAI schemas and the warm-up set all take it
with no code of their own.

``ToyImageFamily`` declares the shared image inputs (``image``, ``mask_image``, ``strength``) the
same way, for the image surfaces' tests (``tests/server/test_image_surfaces.py`` ...). Its
``finish`` blends the given image into the sample: ``out = image + mask * strength * (sample -
image)``, so that a black mask returns the image's own pixels (grey) and a request can prove what
arrived.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from preheat.families.base import EngineView, LoadedModel, Request, to_pixels
from preheat.families.image import IMAGE, MASK_IMAGE, STRENGTH
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


@dataclass(frozen=True)
class ToyImageFamily(PixelFamily):
    name: str = "toy-image"
    specs: tuple[InputSpec, ...] = (CLASS_LABELS, IMAGE, MASK_IMAGE, STRENGTH)
    pixels_in_loop: bool = False  # finish() converts, after the blend

    def finish(self, pipe: EngineView, request: Request, out: Any) -> np.ndarray:
        from PIL import Image

        sample = np.asarray(out, np.float32)  # (n, H, W, C) in [-1, 1]
        image = request.values["image"]
        if image is None:
            return np.asarray(to_pixels(sample))
        h, w, c = sample.shape[1:]

        def fit(pixels: np.ndarray, mode: str) -> np.ndarray:  # (h, w, c) in [0, 1]
            resized = Image.fromarray(pixels).convert(mode).resize((w, h), Image.BILINEAR)
            grey = np.asarray(resized, np.float32)[..., None] / 255.0 if mode == "L" else \
                np.asarray(resized, np.float32) / 255.0
            return np.broadcast_to(grey, (h, w, c)) if grey.shape[-1] == 1 else grey

        base = fit(image, "L" if c == 1 else "RGB") * 2 - 1  # (h, w, c) in [-1, 1]
        mask = request.values["mask_image"]
        keep = 1.0 if mask is None else fit(mask, "L")
        strength = 1.0 if request.values["strength"] is None else request.values["strength"]
        mixed = base + keep * strength * (sample - base)  # (n, h, w, c)
        return np.asarray(to_pixels(mixed))


TOY_IMAGE = ToyImageFamily()


def load_toy_image(root: Any, **options: Any) -> LoadedModel:
    return dataclasses.replace(load_pixel(root, **options), family=TOY_IMAGE)
