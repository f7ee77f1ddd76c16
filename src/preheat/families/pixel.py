"""Pixel-space UNet2DModel checkpoints (DDPM, the built-in digits model): class labels or nothing.

Conditioning is ``{"class_labels": (B,) int32}`` for class-conditional models and ``{}`` for
unconditional ones. Classifier-free guidance needs a "null" class (``model_index.json``'s
``preheat.null_class``); the unconditional branch is that class as runtime data. The final
sample is converted to uint8 inside the denoising program (no separate decode stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from preheat.errors import InvalidArgumentError
from preheat.families.base import Conditioning, EngineView, Family, LoadedModel, Request
from preheat.families.inputs import InputSpec, Label
from preheat.families.schedule import SCHEDULE_SPECS
from preheat.families.stages import Staged

if TYPE_CHECKING:
    from preheat.models.weights import LoadOptions


__all__ = ["PixelFamily", "PIXEL"]


CLASS_LABELS = InputSpec("class_labels", Label(None), "Class index or label name, one for all images or one per image "
                         "(class-conditional models; a tour of the classes when absent).", per_image=True,
                         field="class_label", aliases=("prompt",), flag="--class")


@dataclass(frozen=True)
class PixelFamily(Family):
    name: str = "pixel"
    defaults: Mapping[str, Any] = field(default_factory=lambda: {"sampler": "ddpm", "steps": 50, "guidance": None})
    # a card's schedule (timestep_spacing, custom timesteps): the samplers are the same discrete
    # schedules as SD's, and DDPMPipeline runs whatever its scheduler is configured to
    specs: tuple[InputSpec, ...] = (CLASS_LABELS, *SCHEDULE_SPECS)
    pixels_in_loop: bool = True

    def input_specs(self, pipe: EngineView) -> tuple[InputSpec, ...]:
        label = replace(CLASS_LABELS, type=Label(pipe.num_classes, tuple(pipe.labels)),
                        warm=() if pipe.num_classes is None else (0,))
        return tuple(label if s.name == "class_labels" else s for s in super().input_specs(pipe))

    def check_inputs(self, pipe: EngineView, n: int, inputs: dict[str, Any]) -> dict[str, Any]:
        values = super().check_inputs(pipe, n, inputs)
        labels = values["class_labels"]
        if labels is None and pipe.num_classes is not None:
            labels = list(np.arange(n) % pipe.num_classes)  # a tour of the classes
        values["class_labels"] = None if labels is None else np.asarray(labels, np.int32)
        return values

    def guidance_error(self, pipe: EngineView, values: dict[str, Any]) -> str | None:
        if pipe.null_class is None:
            return "needs a class-conditional model with a null class; this model has none (use guidance=1)"
        return None

    def condition(self, pipe: EngineView, request: Request) -> Staged:
        labels = request.values["class_labels"]
        if labels is None:
            return Staged.ready(Conditioning(cond={}, uncond={}))
        null = np.full_like(labels, pipe.null_class if pipe.null_class is not None else 0)
        return Staged.ready(Conditioning(cond={"class_labels": labels}, uncond={"class_labels": null}))


def class_index(pipe: EngineView, c: Any) -> int:
    """A class given as an index or a label name -> its index; unknown -> one-line error."""
    if pipe.num_classes is None:
        raise InvalidArgumentError("this model is not class-conditional", argument="class_labels")
    return Label(pipe.num_classes, tuple(pipe.labels)).check("class_labels", c)


PIXEL = PixelFamily()


def load_pixel(root: Any, *, scheduler: Any = None, dtype: Any = "float32", variant: str | None = None,
               options: LoadOptions | None = None) -> LoadedModel:
    """A pixel-space UNet2DModel folder (a pipeline folder with ``unet/`` or a bare UNet)."""
    import jax.numpy as jnp

    from preheat.samplers import find_scheduler_config, load_scheduler_config
    from preheat.models.folders import class_count, image_size, pipeline_extras
    from preheat.models.loading import load_unet, resolve_unet_dir

    unet_dir = resolve_unet_dir(root)
    sched = load_scheduler_config(scheduler if scheduler is not None else find_scheduler_config(root, unet_dir))
    unet = load_unet(unet_dir, dtype=jnp.dtype(dtype), variant=variant, options=options)
    cfg = unet.config
    extra = pipeline_extras(root)
    h, w = image_size(cfg.sample_size, unet_dir)
    null_class = extra.get("null_class")
    num_classes = class_count(cfg.num_class_embeds, cfg.class_embed_type, null_class)
    fingerprint = {"kind": "unet2d", "config": cfg.architecture_dict(), "sample_size": [h, w]}

    def apply(params: Any, x: Any, t: Any, cond: dict[str, Any], lora: Any = None) -> Any:  # no LoRA targets
        return unet.apply(params, x, t, cond.get("class_labels"))

    return LoadedModel(apply=apply, params=unet.params, sample_shape=(h, w, cfg.in_channels), scheduler_config=sched,
                       fingerprint=fingerprint, family=PIXEL, num_classes=num_classes, null_class=null_class,
                       labels=tuple(extra.get("labels", ())), defaults=dict(extra.get("defaults", {})),
                       dtype=str(jnp.dtype(dtype)), layout="NCHW")
