"""What a family's model holds besides its denoiser: one frozen, typed object per kind of family.

``Pipeline.components`` (and a family's ``LoadedModel.components``) is one of these, made by the
family's loader (or the torch backend's, which fills what the family's checks read). Families and
surfaces read typed attributes; nothing is added after loading -- the run-time LoRA state is the
pipeline's ``lora_runtime`` (``preheat.lora.LoraRuntime``), not a component.

    Components         every kind: the LoRA target layers (None: the model takes no LoRA)
    PixelComponents    pixel (UNet2DModel): nothing more
    TextComponents     text-to-image: tokenizers, text encoders, VAE, fingerprints of their stages
      SDComponents     + inpaint, force_zeros, clip_layers, controlnet, refiner (SD 1.x / 2.x / SDXL)
      SD3Components    + patch_size, joint_attention_dim
      FluxComponents   + guidance_embeds (FLUX.1 and Kontext)

``preheat.sharding.distribute_components`` places the weights of the models in them over a mesh
(``dataclasses.replace``: a new object, never one changed in place).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from preheat.lora import LoraTargets

__all__ = ["Components", "PixelComponents", "TextComponents", "SDComponents", "SD3Components", "FluxComponents"]


@dataclass(frozen=True, kw_only=True, eq=False)
class Components:
    """What every kind of family has: the layers a LoRA may target, and the text encoders that take one."""

    lora_targets: "LoraTargets | None" = None  # None: the model takes no LoRA
    lora_encoders: tuple[str, ...] = ()  # names in lora_targets.layers of the text encoders with adapters


@dataclass(frozen=True, kw_only=True, eq=False)
class PixelComponents(Components):
    """A pixel-space model (UNet2DModel): the denoiser is all there is."""


@dataclass(frozen=True, kw_only=True, eq=False)
class TextComponents(Components):
    """A text-to-image model's encoders and VAE (``preheat.families.text``).

    On the torch backend only what the family's checks read is filled (the sizes and the
    family's own fields); its diffusers pipeline holds the models."""

    vae_scale: int  # pixels per latent
    size_multiple: int  # width and height must be multiples of this
    vae: Any = None  # preheat.models.vae.AutoencoderKL (None on torch)
    tokenizers: tuple[Any, ...] = ()
    text_encoders: tuple[Any, ...] = ()  # an encoder may be None (SD3 without T5)
    offload_encoders: bool = False  # the encoders' weights are host arrays (preheat.load(offload_encoders=True))
    encoders_on: str = "device"  # "host": the encoders' weights live on the host's CPU and the encode stage runs there
    encode_fingerprint: Mapping[str, Any] = field(default_factory=dict)  # the encode stage's identity
    decode_fingerprint: Mapping[str, Any] = field(default_factory=dict)  # the VAE decode stage's identity


@dataclass(frozen=True, kw_only=True, eq=False)
class SDComponents(TextComponents):
    """Stable Diffusion 1.x / 2.x / SDXL."""

    inpaint: bool = False  # a 9-channel inpainting UNet
    force_zeros: bool = True  # SDXL: an empty negative prompt is zeros (model_index's force_zeros_for_empty_prompt)
    clip_layers: int = 0  # the text encoders' fewest hidden layers (bounds clip_skip)
    controlnet: Any = None  # a loaded ControlNet's config (preheat.models.controlnet.ControlNetConfig): the model
    #                         declares the control inputs (preheat.families.control); its weights are the denoiser's
    refiner: Any = None  # SDXL's ensemble of experts: the refiner's own SDComponents (its text encoder); the model
    #                      declares the handoff inputs (preheat.families.experts); its UNet's weights are the denoiser's


@dataclass(frozen=True, kw_only=True, eq=False)
class SD3Components(TextComponents):
    """Stable Diffusion 3 / 3.5."""

    patch_size: int = 2
    joint_attention_dim: int = 0  # the width of the joint text context


@dataclass(frozen=True, kw_only=True, eq=False)
class FluxComponents(TextComponents):
    """FLUX.1 (and Kontext)."""

    guidance_embeds: bool = False  # guidance is an input of the transformer (dev), not CFG
