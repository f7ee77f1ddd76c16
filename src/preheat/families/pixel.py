"""Pixel-space UNet2DModel checkpoints (DDPM, the built-in digits model): class labels or nothing.

Conditioning is ``{"class_labels": (B,) int32}`` for class-conditional models and ``{}`` for
unconditional ones. Classifier-free guidance needs a "null" class (``model_index.json``'s
``preheat.null_class``); the unconditional branch is that class as runtime data. The final
sample is converted to uint8 inside the denoising program (no separate decode stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from preheat.errors import InvalidArgumentError
from preheat.families.base import Conditioning, EngineView, Family, LoadedModel, Request


__all__ = ["PixelFamily", "PIXEL"]


@dataclass(frozen=True)
class PixelFamily(Family):
    name: str = "pixel"
    defaults: Mapping[str, Any] = field(default_factory=lambda: {"sampler": "ddpm", "steps": 50, "guidance": None})
    inputs: tuple[str, ...] = ("class_labels", "width", "height")
    pixels_in_loop: bool = True

    def check_inputs(self, pipe: EngineView, n: int, inputs: dict[str, Any]) -> dict[str, Any]:
        inputs = super().check_inputs(pipe, n, inputs)
        h, w = pipe.sample_shape[0], pipe.sample_shape[1]
        for name, native in (("width", w), ("height", h)):
            value = inputs.get(name)
            if value is not None and value != native:
                raise InvalidArgumentError(f"{name}={value!r}: this model makes {w}x{h} images only", argument=name)
        return {"class_labels": labels_for(pipe, n, inputs.get("class_labels"))}

    def guidance_error(self, pipe: EngineView, values: dict[str, Any]) -> str | None:
        if pipe.null_class is None:
            return "needs a class-conditional model with a null class; this model has none (use guidance=1)"
        return None

    def condition(self, pipe: EngineView, request: Request) -> Conditioning:
        labels = request.values["class_labels"]
        if labels is None:
            return Conditioning(cond={}, uncond={})
        null = np.full_like(labels, pipe.null_class if pipe.null_class is not None else 0)
        return Conditioning(cond={"class_labels": labels}, uncond={"class_labels": null})


def labels_for(pipe: EngineView, n: int, class_labels: Any) -> np.ndarray | None:
    """Class indices for n images: one per image, one for all, or a tour of the classes (None)."""
    if pipe.num_classes is None:
        if class_labels is not None:
            raise InvalidArgumentError("class_labels given, but this model is not class-conditional",
                                       argument="class_labels")
        return None
    if class_labels is None:
        return (np.arange(n) % pipe.num_classes).astype(np.int32)  # a tour of the classes
    if isinstance(class_labels, (int, str, np.integer)):
        class_labels = [class_labels] * n
    class_labels = list(class_labels)
    if len(class_labels) != n:
        raise InvalidArgumentError(f"got {len(class_labels)} class_labels for n={n}; give one per image or one for all",
                                   argument="class_labels")
    return np.asarray([class_index(pipe, c) for c in class_labels], np.int32)


def class_index(pipe: EngineView, c: Any) -> int:
    """A class given as an index or a label name -> its index; unknown -> one-line error."""
    if pipe.num_classes is None:
        raise InvalidArgumentError("this model is not class-conditional", argument="class_labels")
    if isinstance(c, str):
        if c in pipe.labels:
            return pipe.labels.index(c)
        if c.strip().lstrip("-").isascii() and c.strip().lstrip("-").isdigit():  # not "٧" or "７"
            c = int(c)
        else:
            known = ", ".join(pipe.labels) or f"0..{pipe.num_classes - 1}"
            raise InvalidArgumentError(f"unknown class {c!r}; known classes: {known}", argument="class_labels")
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= int(c) < pipe.num_classes:
        raise InvalidArgumentError(f"unknown class {c!r}; classes are 0..{pipe.num_classes - 1}", argument="class_labels")
    return int(c)


PIXEL = PixelFamily()


def load_pixel(root: Any, *, scheduler: Any = None, dtype: Any = "float32", variant: str | None = None) -> LoadedModel:
    """A pixel-space UNet2DModel folder (a pipeline folder with ``unet/`` or a bare UNet)."""
    import jax.numpy as jnp

    from preheat.samplers import find_scheduler_config, load_scheduler_config
    from preheat.models.folders import class_count, image_size, pipeline_extras
    from preheat.models.loading import load_unet, resolve_unet_dir

    unet_dir = resolve_unet_dir(root)
    sched = load_scheduler_config(scheduler if scheduler is not None else find_scheduler_config(root, unet_dir))
    unet = load_unet(unet_dir, dtype=jnp.dtype(dtype), variant=variant)
    cfg = unet.config
    extra = pipeline_extras(root)
    h, w = image_size(cfg.sample_size, unet_dir)
    null_class = extra.get("null_class")
    num_classes = class_count(cfg.num_class_embeds, cfg.class_embed_type, null_class)
    fingerprint = {"kind": "unet2d", "config": cfg.architecture_dict(), "sample_size": [h, w]}

    def apply(params: Any, x: Any, t: Any, cond: dict[str, Any]) -> Any:
        return unet.apply(params, x, t, cond.get("class_labels"))

    return LoadedModel(apply=apply, params=unet.params, sample_shape=(h, w, cfg.in_channels), scheduler_config=sched,
                       fingerprint=fingerprint, family=PIXEL, num_classes=num_classes, null_class=null_class,
                       labels=tuple(extra.get("labels", ())), defaults=dict(extra.get("defaults", {})),
                       dtype=str(jnp.dtype(dtype)), layout="NCHW")
