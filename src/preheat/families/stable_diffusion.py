"""Stable Diffusion 1.x / 2.x and SDXL: diffusers' folders, loaded unchanged, in three stages.

    stage     program                                                        one executable per
    --------  -------------------------------------------------------------  ---------------------
    encode    token ids (2B or B, 77) -> CLIP embeddings                      batch
              SD:   hidden_states[-(k+1)] + final norm         (B, 77, D)
                    (k = clip_skip; 0: last_hidden_state)
              SDXL: both encoders' hidden_states[-(k+2)],      (B, 77, D1+D2)
                    concat (0: the penultimate states)
                    + the second encoder's pooled projection   (B, P)
    denoise   the engine's loop over UNet2DConditionModel                     sampler, batch, size,
              cond = {"context"[, "text_embeds", "time_ids"]}                 guidance on/off
    decode    latents / scaling_factor (+ shift) -> VAE decoder -> uint8      batch, size

Prompts are tokenized on the host (the folder's own tokenizer files, padded to 77). What each
input of ``generate`` is::

    input                                 SD  SDXL  static / data     reaches
    ------------------------------------  --  ----  ----------------  -------------------------------
    prompt, negative_prompt               x   x     data (token ids)  encode; both encoders on SDXL
    prompt_2, negative_prompt_2               x     data (token ids)  the second encoder (diffusers:
                                                                      absent or "" -> prompt / negative)
    clip_skip (int, or one per image)     x   x     data (B,) int32   encode: SD hidden_states[-(k+1)]
                                                                      + final norm; SDXL [-(k+2)]
    original_size, crops_coords_top_left,     x     data (time_ids)   the UNet's added time embedding
      target_size
    negative_original_size, _crops_..,        x     data (time_ids)   the unconditional branch only
      negative_target_size                                            (text: both sizes, as diffusers;
                                                                      image calls: either size, the
                                                                      prompt's crop, as its img2img)
    width, height                         x   x     static            one program per resolution
    guidance, steps, seed                 x   x     data              the denoising loop
    guidance_rescale (0: off; guided      x   x     data () float32   the guided prediction, before
      calls only)                                                     the sampler (``families.guidance``)
    image (img2img: its size, rounded)    x   x     data (size:       encode_image -> the loop's start
                                                      static)           (``samplers.Start``)
    mask_image (white = repaint)          x   x     data              9-channel UNets: mask + masked
                                                                      latents beside the sample; base
                                                                      UNets: blended after each step
    strength                              x   x     data              the start step (get_timesteps)
    padding_mask_crop (one, or per image) x   x     data (host)       the image and mask cropped around
                                                                      the mask, resized to width x
                                                                      height; the output pasted back
    control_image, and the ControlNet's   x   x     data (the image   a ControlNet beside the UNet, on
      scale, step window and guess mode               size: static)   both branches (guess mode: the
      (loaded with controlnet= only; image                            conditional one; ``families.control``);
      and mask_image too, not on a refiner)                           with an image: the window over the
                                                                      steps strength leaves

An SDXL refiner's folder (``StableDiffusionXLImg2ImgPipeline`` with ``requires_aesthetics_score``:
stable-diffusion-xl-refiner-1.0) is the ``stable-diffusion-xl-refiner`` family: the second encoder
alone (it takes the prompt; no ``prompt_2``), an image always (img2img or inpainting), and five
time ids -- ``original_size``, ``crops_coords_top_left``, ``aesthetic_score`` (no ``target_size``)
-- with the unconditional branch's own (``negative_original_size``, ``negative_crops_coords_top_left``,
``negative_aesthetic_score``; diffusers' defaults: the prompt's size, (0, 0), 6.0 and 2.5). Data, as SDXL's.

``clip_skip`` is data because every layer's state is computed anyway: the encode program picks
each text's state with a chain of selects, so one program serves every value and a batch may mix
them. Like diffusers, it shapes the prompt's embedding only; the negative's is the default one.
The unconditional branch is the empty prompt's embedding (SD) or, for SDXL folders with
``force_zeros_for_empty_prompt``, zeros -- exactly what diffusers' pipelines use -- unless a
negative prompt is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from preheat.errors import InvalidArgumentError
from preheat.families import image as image_input
from preheat.families.control import (CONTROL_SPECS, check_control_inputs, control_cond, control_window,
                                      refuse_without_controlnet)
from preheat.families.experts import (AESTHETIC_SCORE, IMAGE_INPUTS, NEGATIVE_AESTHETIC_SCORE, REFINER_SPECS,
                                      check_handoff, cutoff_leaf,
                                      refuse_image_inputs_with_refiner, refuse_without_refiner)
from preheat.families.guidance import GUIDANCE_RESCALE
from preheat.families.base import Conditioning, EngineView, LoadedModel, Request
from preheat.families.image import IMAGE, MASK_IMAGE, PADDING_MASK_CROP, STRENGTH
from preheat.lora import encoder_adapters
from preheat.families.inputs import InputSpec, Int, Pair, Text
from preheat.families.schedule import SCHEDULE_SPECS
from preheat.families.sd_loading import inpainting, load_sd
from preheat.samplers import DIFFUSION_SAMPLERS, EDM_SAMPLERS
from preheat.families.stages import EncodeArgs, Staged, joined
from preheat.families.text import (NEGATIVE_PROMPT, PROMPT, SAMPLER_OF_SCHEDULER, TextToImageFamily, component,
                                   encode)

if TYPE_CHECKING:
    from preheat.models.weights import LoadOptions


__all__ = ["StableDiffusionFamily", "SD", "SDXL", "SDXL_REFINER", "load_stable_diffusion", "load_stable_diffusion_xl",
           "SAMPLER_OF_SCHEDULER"]

# SDXL's micro-conditioning (diffusers' names and defaults): data, (height, width) pairs
SDXL_SIZE_SPECS = (
    InputSpec("original_size", Pair(), "SDXL: the (height, width) the image is conditioned as coming from.",
              default_doc="(height, width)"),
    InputSpec("crops_coords_top_left", Pair(), "SDXL: the (top, left) crop the image is conditioned on.",
              default_doc="(0, 0)"),
    InputSpec("target_size", Pair(), "SDXL: the (height, width) the image is conditioned to target.",
              default_doc="(height, width)"),
)
# the unconditional branch's own ids: diffusers' text-to-image pipeline uses them only when both sizes are
# given; its img2img and inpaint pipelines take either size alone, and the prompt's crop (the refiner: its own)
SDXL_NEGATIVE_SIZE_SPECS = (
    InputSpec("negative_original_size", Pair(), "SDXL: original_size for the unconditional branch (text-to-image: "
              "with negative_target_size).", needs_guidance=True),
    InputSpec("negative_crops_coords_top_left", Pair(), "SDXL: crops_coords_top_left for the unconditional branch "
              "(text-to-image, and the refiner).", needs_guidance=True),
    InputSpec("negative_target_size", Pair(), "SDXL: target_size for the unconditional branch (text-to-image: "
              "with negative_original_size).", needs_guidance=True),
)
# a refiner's unconditional branch takes its own size alone and its own crop (its img2img and inpaint pipelines)
REFINER_NEGATIVE_SIZE_SPECS = (
    replace(SDXL_NEGATIVE_SIZE_SPECS[0], description="SDXL refiner: original_size for the unconditional branch."),
    replace(SDXL_NEGATIVE_SIZE_SPECS[1], description="SDXL refiner: crops_coords_top_left for the unconditional "
            "branch."),
)
# SDXL's second text encoder: absent or "" means the first one's prompt, as diffusers
PROMPT_2 = InputSpec("prompt_2", Text(), "SDXL: the second text encoder's prompt (the prompt when absent).",
                     per_image=True, default_doc="the prompt")
NEGATIVE_PROMPT_2 = InputSpec("negative_prompt_2", Text(), "SDXL: the second text encoder's negative prompt "
                              "(the negative prompt when absent).", per_image=True, needs_guidance=True,
                              default_doc="the negative prompt")


def clip_skip_spec(high: int) -> InputSpec:
    """diffusers' clip_skip, bounded by the loaded model's text encoder depth."""
    return InputSpec("clip_skip", Int(0, high), "CLIP layers to skip from the end for the prompt's embedding "
                     "(0: the model's default), one for all or one per image.", per_image=True, default=0)


@dataclass(frozen=True)
class StableDiffusionFamily(TextToImageFamily):
    name: str = "stable-diffusion"
    defaults: Mapping[str, Any] = field(default_factory=lambda: {"sampler": "dpmpp_2m", "steps": 30, "guidance": 7.5})
    specs: tuple[InputSpec, ...] = (PROMPT, NEGATIVE_PROMPT, IMAGE, MASK_IMAGE, STRENGTH, PADDING_MASK_CROP,
                                    GUIDANCE_RESCALE, *SCHEDULE_SPECS)
    xl: bool = False
    # an SDXL refiner (model_index's requires_aesthetics_score): the second encoder alone, an image always,
    # and time ids of (original size, crop, aesthetic score) -- the unconditional branch's its own
    aesthetics: bool = False
    strength: tuple[float, float] = (0.8, 1.0)  # diffusers' default strength: (img2img, inpainting)
    # with a ControlNet, diffusers' ControlNet pipelines' own defaults: strength (img2img, inpainting) and
    # controlnet_conditioning_scale (text-to-image, img2img, inpainting)
    control_strength: tuple[float, float] = (0.8, 1.0)
    control_scale: tuple[float, float, float] = (1.0, 0.8, 0.5)
    # EDM's too: a folder saved with an EDM scheduler (Playground v2.5, CosXL) takes those, the others the rest
    samplers: tuple[str, ...] = DIFFUSION_SAMPLERS + EDM_SAMPLERS
    loader_takes: frozenset[str] = frozenset({"offload_encoders", "controlnet"})  # SDXL's: a refiner too

    # ------------------------------------------------------------------ inputs

    def input_specs(self, pipe: EngineView) -> tuple[InputSpec, ...]:
        layers = pipe.components.clip_layers
        specs = self._required_images(super().input_specs(pipe), pipe.components.inpaint)
        control = CONTROL_SPECS if pipe.components.controlnet is not None else ()  # loaded with controlnet=
        if pipe.components.refiner is not None:  # loaded with refiner=: the handoff and the refiner's scores
            specs = tuple(s for s in specs if s.name not in IMAGE_INPUTS)  # (the ensemble starts from noise)
            control = REFINER_SPECS
        return (*specs, clip_skip_spec(layers - 1 if self.xl else layers), *control)  # SDXL: from the penultimate

    def _required_images(self, specs: Sequence[InputSpec], inpaint: bool) -> tuple[InputSpec, ...]:
        """A 9-channel UNet repaints: it needs an image and a mask; a refiner refines an image
        (StableDiffusionXLImg2ImgPipeline's required image)."""
        required = ("image", "mask_image") if inpaint else ("image",) if self.aesthetics else ()
        return tuple(replace(s, required=True) if s.name in required else s for s in specs)

    def for_folder(self, root: Path) -> StableDiffusionFamily:
        from preheat.models.safetensors_files import read_json

        return self.for_index(read_json(Path(root) / "model_index.json", "pipeline index"))

    def for_index(self, index: Mapping[str, Any]) -> StableDiffusionFamily:
        """An SDXL refiner's index (StableDiffusionXLImg2ImgPipeline with ``requires_aesthetics_score``)
        makes the refiner family; any other index keeps its class's family."""
        return SDXL_REFINER if self.xl and index.get("requires_aesthetics_score") else self

    def folder_specs(self, root: Path) -> tuple[InputSpec, ...]:
        from preheat.models.safetensors_files import read_json

        root = Path(root)
        index = read_json(root / "model_index.json", "pipeline index")
        unet = read_json(component(root, index, "unet") / "config.json", "UNet config")
        vae = read_json(component(root, index, "vae") / "config.json", "VAE config")
        return self._required_images(self.specs, inpainting(unet.get("in_channels", 4), vae.get("latent_channels", 4)))

    def check_inputs(self, pipe: EngineView, n: int, inputs: dict[str, Any]) -> dict[str, Any]:
        control = pipe.components.controlnet is not None
        if not control:
            refuse_without_controlnet(inputs)
        if pipe.components.refiner is None:
            refuse_without_refiner(inputs, self.inputs)
        else:
            refuse_image_inputs_with_refiner(inputs)
        values = super().check_inputs(pipe, n, inputs)
        if control:
            check_control_inputs(pipe, values, inputs, self.max_size, self.control_scale)
        image_input.check_image_inputs(pipe, values, inputs, inpaint_model=pipe.components.inpaint,
                                       default_strength=self.control_strength if control else self.strength,
                                       max_size=self.max_size)
        if self.aesthetics:
            values["time_ids"] = _aesthetic_time_ids(values, "original_size", "crops_coords_top_left", "aesthetic_score")
            values["negative_time_ids"] = _aesthetic_time_ids(values, "negative_original_size",
                                                              "negative_crops_coords_top_left",
                                                              "negative_aesthetic_score")
        elif self.xl:
            values["prompt_2"] = _or_first(values["prompt_2"], values["prompt"])
            values["negative_prompt_2"] = _or_first(values["negative_prompt_2"], values["negative_prompt"])
            if (values["negative_prompt"] is None and values["negative_prompt_2"] is not None
                    and pipe.components.force_zeros):
                raise InvalidArgumentError("negative_prompt_2 needs negative_prompt on this model: its folder sets "
                                           "force_zeros_for_empty_prompt, so without negative_prompt the "
                                           "unconditional branch is zeros", argument="negative_prompt_2")
            values["time_ids"] = _time_ids(values)
            if values.get("image") is None:
                values["negative_time_ids"] = _negative_time_ids(values)
            elif control and values["mask_image"] is not None:
                values["negative_time_ids"] = _control_inpaint_negative_time_ids(values)
            else:
                values["negative_time_ids"] = _image_negative_time_ids(values)
            if pipe.components.refiner is not None:  # its img2img pipeline's ids, from the call's size and crop
                values["refiner_time_ids"] = _aesthetic_time_ids(values, "original_size", "crops_coords_top_left",
                                                                 "aesthetic_score")
                values["refiner_negative_time_ids"] = _aesthetic_time_ids(values, "negative_original_size",
                                                                          "negative_crops_coords_top_left",
                                                                          "negative_aesthetic_score")
        return values

    # ------------------------------------------------------------------ stages

    def condition(self, pipe: EngineView, request: Request) -> Staged:
        """The text conditioning (+ an inpainting UNet's mask channels), and a ControlNet's inputs
        beside it on each branch (``families.control``); with a refiner, its own beside the base's."""
        text = self._text_condition(pipe.components, pipe.lora_runtime, pipe.dtype, request)
        if pipe.components.refiner is not None:  # its own encoder on the prompts, its aesthetic ids, no LoRA
            values = {**request.values, "time_ids": request.values["refiner_time_ids"],
                      "negative_time_ids": request.values["refiner_negative_time_ids"]}
            own = SDXL_REFINER._text_condition(pipe.components.refiner, None, pipe.dtype,
                                               replace(request, values=values, lora=None))
            return joined([text, own], lambda base, refiner: self._with_refiner(pipe, request, base, refiner))
        control = None if pipe.components.controlnet is None else \
            control_cond(pipe, request, self._start_index(request) or 0)

        def conditioning(c: Conditioning, mask: Conditioning | None) -> Conditioning:
            for extra in (mask, control):
                if extra is not None:
                    c = Conditioning(cond={**c.cond, **extra.cond},
                                     uncond={**c.uncond, **extra.uncond} if request.guided else c.uncond)
            return c

        return joined([text, self._mask_channels(pipe, request)], conditioning)

    def _with_refiner(self, pipe: EngineView, request: Request, conditioning: Conditioning,
                      own: Conditioning) -> Conditioning:
        """The base's conditioning beside the refiner's own (``refiner_`` leaves), and the timestep
        where the refiner takes over."""
        cutoff = {"refiner_cutoff": cutoff_leaf(pipe, request)}

        def joined_leaves(base: dict[str, Any], refiner: dict[str, Any]) -> dict[str, Any]:
            return {**base, **{f"refiner_{k}": v for k, v in refiner.items()}, **cutoff}

        uncond = joined_leaves(conditioning.uncond, own.uncond) if request.guided else conditioning.uncond
        return Conditioning(cond=joined_leaves(conditioning.cond, own.cond), uncond=uncond)

    def restart_step(self, pipe: EngineView, request: Request) -> int | None:
        """With a refiner: the step it takes over at, where its own scheduler would start."""
        return None if pipe.components.refiner is None else check_handoff(pipe, request)

    def _text_condition(self, components: Any, lora_runtime: Any, dtype: str, request: Request) -> Staged:
        """The encode stage of ``components``' text encoders (the model's, or a refiner's own) and the
        ``Conditioning`` its output makes."""
        values, n = request.values, request.n
        negatives = values["negative_prompt"]
        zeros_uncond = request.guided and negatives is None and self.xl and components.force_zeros
        second = self.xl and not self.aesthetics  # a refiner has the second encoder alone: it takes the prompt
        texts = [list(values["prompt"])] + ([list(values["prompt_2"])] if second else [])
        skips = list(values["clip_skip"])
        if request.guided and not zeros_uncond:
            first = negatives if negatives is not None else [""] * n
            texts[0] += first
            if second:  # diffusers: negative_prompt_2 = negative_prompt_2 or negative_prompt (or "")
                texts[1] += values["negative_prompt_2"] or first
            skips += [0] * n  # diffusers applies clip_skip to the prompt's embedding, never the negative's
        encoders = components.text_encoders
        adapters = encoder_adapters(lora_runtime, request.lora, str(encoders[0].dtype))
        lora = None
        if adapters is not None:  # text-encoder LoRAs: each text takes its image's slot (negatives too)
            index = np.concatenate([request.lora.index] * (len(skips) // n))
            lora = (adapters, index, request.lora.signature)
        stage = encode(components, dtype, texts, lambda: _encode_program(encoders, self.xl, lora is not None),
                       outputs=2 if self.xl else 1, extra=(("xl", self.xl),), lora=lora,
                       clip_skip=np.asarray(skips, np.int32))

        def conditioning(out: Any) -> Conditioning:
            if not self.xl:
                context = np.asarray(out)
                return Conditioning(cond={"context": context[:n]},
                                    uncond={"context": context[n:]} if request.guided else {})
            context, pooled = np.asarray(out[0]), np.asarray(out[1])
            time_ids = np.repeat(values["time_ids"][None], n, axis=0)  # (n, 6); a refiner's (n, 5)
            cond = {"context": context[:n], "text_embeds": pooled[:n], "time_ids": time_ids}
            if not request.guided:
                return Conditioning(cond=cond, uncond={})
            negative_ids = values["negative_time_ids"]
            uncond_ids = time_ids if negative_ids is None else np.repeat(negative_ids[None], n, axis=0)  # (n, 6)
            if zeros_uncond:
                uncond = {"context": np.zeros_like(cond["context"]), "text_embeds": np.zeros_like(cond["text_embeds"]),
                          "time_ids": uncond_ids}
            else:
                uncond = {"context": context[n:], "text_embeds": pooled[n:], "time_ids": uncond_ids}
            return Conditioning(cond=cond, uncond=uncond)

        return Staged.of(stage, conditioning)

    def _mask_channels(self, pipe: EngineView, request: Request) -> Staged:
        """A 9-channel (inpainting) UNet's extra input channels, beside the sample: the latent-grid
        mask and the masked image's latents (the same for both guidance branches, as diffusers);
        None for any other UNet."""
        if not pipe.components.inpaint:
            return Staged.ready(None)
        images = image_input.inpaint_images(request.values, request.n)  # (n, H, W, 3), (n, H, W)
        masked = image_input.masked(images.pixels, images.mask)
        mask = image_input.latent_mask(images.mask, pipe.components.vae_scale)

        def channels(latents: Any) -> Conditioning:
            extra = {"mask": mask, "masked_image_latents": np.asarray(latents)}
            return Conditioning(cond=extra, uncond=extra)

        return Staged.of(image_input.encode_images(pipe, masked, request.seeds, 1), channels)

    def check_start(self, pipe: EngineView, request: Request) -> int | None:
        """The start step of an image-conditioned call (None: from noise), or a one-line error:
        a strength that leaves no step, a sampler that cannot blend a base model's mask."""
        values = request.values
        index = self._start_index(request)
        if pipe.components.controlnet is not None:  # a window the sampler cannot be told: before any device work
            control_window(pipe, request, index or 0)
        if pipe.components.refiner is not None:
            check_handoff(pipe, request)  # a handoff the sampler cannot take, refused before any device work
        if index is None:
            return None
        from preheat.samplers import BLEND_SOLVERS, make_spec

        blend = values["mask_image"] is not None and not pipe.components.inpaint
        if blend and make_spec(pipe.scheduler_config, request.sampler).solver not in BLEND_SOLVERS:
            raise InvalidArgumentError(f"sampler {request.sampler!r} cannot blend an inpainting mask on this model "
                                       "(diffusers blends between its two model calls per step); use another",
                                       argument="sampler")
        return index

    @staticmethod
    def _start_index(request: Request) -> int | None:
        """An image call's first step, diffusers' ``get_timesteps(strength)`` (None: from noise)."""
        if request.values.get("image") is None:
            return None
        from preheat.samplers import strength_start

        return strength_start(request.steps, request.values["strength"], "sd")

    def image_start(self, pipe: EngineView, request: Request, plan: Any) -> Staged:
        """img2img and inpainting begin as diffusers' pipelines: at ``get_timesteps(strength)``'s
        step, from the encoded image noised there -- or, inpainting at strength 1 (diffusers'
        ``is_strength_max``), from noise alone; a base model's 4 channels blend the mask after each step."""
        values, n = request.values, request.n
        if values.get("image") is None:
            return Staged.ready(None)
        from preheat.samplers import Start

        strength, mask_image = values["strength"], values["mask_image"]
        index = self.check_start(pipe, request)
        pure = mask_image is not None and strength == 1.0
        blend = mask_image is not None and not pipe.components.inpaint
        keep = None
        if pure and not blend:  # the image reaches the model only through the mask channels
            x0 = np.zeros((n, *request.sample_shape), np.float32)
            return Staged.ready(Start(index=np.int32(index), x0=x0, pure_noise=np.bool_(pure), keep=keep))
        if mask_image is None:
            x = np.repeat(image_input.pixels(values["image"], values["width"], values["height"])[None], n, axis=0)
        else:  # each image's own crop, with padding_mask_crop
            images = image_input.inpaint_images(values, n)
            x = images.pixels  # (n, H, W, 3)
            if blend:
                keep = image_input.latent_mask(images.mask, pipe.components.vae_scale)  # (n, h, w, 1)
        return Staged.of(image_input.encode_images(pipe, x, request.seeds, 0),  # -> (n, h, w, C)
                         lambda x0: Start(index=np.int32(index), x0=np.asarray(x0), pure_noise=np.bool_(pure),
                                          keep=keep))


SD = StableDiffusionFamily()
SDXL = StableDiffusionFamily(name="stable-diffusion-xl", xl=True, max_size=4096,
                             defaults={"sampler": "euler", "steps": 30, "guidance": 5.0}, strength=(0.3, 0.9999),
                             control_strength=(0.8, 0.9999), control_scale=(1.0, 0.8, 1.0),
                             loader_takes=frozenset({"offload_encoders", "controlnet", "refiner"}),
                             specs=(PROMPT, PROMPT_2, NEGATIVE_PROMPT, NEGATIVE_PROMPT_2, *SDXL_SIZE_SPECS,
                                    *SDXL_NEGATIVE_SIZE_SPECS, IMAGE, MASK_IMAGE, STRENGTH, PADDING_MASK_CROP,
                                    GUIDANCE_RESCALE, *SCHEDULE_SPECS))
# stabilityai/stable-diffusion-xl-refiner-1.0: no prompt_2 or target sizes (diffusers ignores them there)
SDXL_REFINER = replace(SDXL, name="stable-diffusion-xl-refiner", aesthetics=True,
                       specs=(PROMPT, NEGATIVE_PROMPT, *SDXL_SIZE_SPECS[:2], AESTHETIC_SCORE,
                              *REFINER_NEGATIVE_SIZE_SPECS, NEGATIVE_AESTHETIC_SCORE, IMAGE, MASK_IMAGE, STRENGTH,
                              PADDING_MASK_CROP, GUIDANCE_RESCALE, *SCHEDULE_SPECS))


def _encode_program(encoders: Sequence[Any], xl: bool, lora: bool = False) -> Any:
    """``EncodeArgs``: params and ids per encoder, clip_skip (B,) -> context (B, 77, D) [, pooled (B, P)].
    With ``lora``: ``args.lora`` holds a ``LoraArgs`` (or None) per encoder, each text's slot in it.

    ``clip_skip`` is data, as diffusers defines it: SD takes hidden_states[-(skip + 1)] through the
    final layer norm (0: last_hidden_state); SDXL takes each encoder's hidden_states[-(skip + 2)]
    (0: the penultimate state); the pooled projection is the last layer's either way."""
    import jax.numpy as jnp

    from preheat.models.clip import hidden_state_from_end
    def program(args: EncodeArgs) -> Any:
        params, ids, skip = args.params, args.ids, args.clip_skip
        adapters: Sequence[Any] = [None] * len(encoders)
        if lora:
            adapters = [None if a is None else a.adapters() for a in args.lora]
        outs = [te.apply(p, i, a) for te, p, i, a in zip(encoders, params, ids, adapters)]
        if not xl:
            return encoders[0].clip_skip(params[0], outs[0], skip).astype(jnp.float32)  # (B, 77, D)
        context = jnp.concatenate([hidden_state_from_end(o, skip + 2) for o in outs], axis=-1)  # (B, 77, D1 + D2)
        return context.astype(jnp.float32), outs[-1].text_embeds.astype(jnp.float32)

    return program


# --------------------------------------------------------------------------------------- checks


def _or_first(second: list[str] | None, first: list[str] | None) -> list[str] | None:
    """A second encoder's prompts: absent or "" means the first's, as diffusers' ``prompt_2 or prompt``."""
    return first if second is None or all(p == "" for p in second) else second


def _time_ids(values: dict[str, Any]) -> np.ndarray:
    """SDXL's micro-conditioning (6,): original_size + crops_coords_top_left + target_size, as diffusers."""
    size = (values["height"], values["width"])
    original = values["original_size"] or size
    crops = values["crops_coords_top_left"] or (0, 0)
    target = values["target_size"] or size
    return np.asarray([*original, *crops, *target], np.float32)


def _aesthetic_time_ids(values: dict[str, Any], original: str, crops: str, score: str) -> np.ndarray:
    """An SDXL refiner's ids (5,): original size + crop top-left + aesthetic score, as diffusers'
    img2img and inpaint pipelines build them with ``requires_aesthetics_score``. The negative
    branch's always its own: its size is the prompt's unless given, its crop (0, 0) unless given."""
    size = values[original] or values["original_size"] or (values["height"], values["width"])
    return np.asarray([*size, *(values[crops] or (0, 0)), values[score]], np.float32)


def _negative_time_ids(values: dict[str, Any]) -> np.ndarray | None:
    """A text-to-image call's unconditional ids (6,), or None (it shares the prompt's). diffusers'
    ``StableDiffusionXLPipeline`` uses them only when both negative_original_size and
    negative_target_size are given; a lone one is refused here rather than ignored."""
    original, target = values["negative_original_size"], values["negative_target_size"]
    crops = values["negative_crops_coords_top_left"]
    if original is None and target is None:
        if crops is not None:
            raise InvalidArgumentError("negative_crops_coords_top_left needs negative_original_size and "
                                       "negative_target_size", argument="negative_crops_coords_top_left")
        return None
    if original is None or target is None:
        given, missing = (("negative_original_size", "negative_target_size") if target is None
                          else ("negative_target_size", "negative_original_size"))
        raise InvalidArgumentError(f"{given} needs {missing} too (the negative branch's size ids take both)",
                                   argument=given)
    return np.asarray([*original, *(crops or (0, 0)), *target], np.float32)


def _image_negative_time_ids(values: dict[str, Any]) -> np.ndarray | None:
    """An image call's unconditional ids (6,), or None (it shares the prompt's), as diffusers' SDXL
    img2img and inpaint pipelines build them: each negative size alone (the prompt's when absent)
    around the prompt's own crop. They never read negative_crops_coords_top_left, so it is refused
    here rather than ignored."""
    if values["negative_crops_coords_top_left"] is not None:
        raise InvalidArgumentError("negative_crops_coords_top_left does not apply to an image call (img2img, "
                                   "inpainting): diffusers' SDXL image pipelines give the negative branch "
                                   "crops_coords_top_left", argument="negative_crops_coords_top_left")
    original, target = values["negative_original_size"], values["negative_target_size"]
    if original is None and target is None:
        return None
    ids = _time_ids(values)  # (6,): original size, crop, target size
    return np.asarray([*(original or ids[:2]), *ids[2:4], *(target or ids[4:])], np.float32)


def _control_inpaint_negative_time_ids(values: dict[str, Any]) -> None:
    """A ControlNet inpainting call's unconditional ids: the prompt's (None), as diffusers'
    ``StableDiffusionXLControlNetInpaintPipeline`` builds them -- it takes no negative sizes or crop,
    so any given is refused here rather than ignored."""
    for name in ("negative_original_size", "negative_target_size", "negative_crops_coords_top_left"):
        if values[name] is not None:
            raise InvalidArgumentError(f"{name} does not apply to ControlNet inpainting: diffusers' SDXL ControlNet "
                                       "inpaint pipeline gives the unconditional branch the prompt's size ids",
                                       argument=name)
    return None


# --------------------------------------------------------------------------------------- loading
# (each variant's parts: ``families.sd_loading``)


def load_stable_diffusion(root: Any, *, scheduler: Any = None, dtype: Any = "float32",
                          variant: str | None = None, offload_encoders: bool = False,
                          options: LoadOptions | None = None, controlnet: Any = None) -> LoadedModel:
    """A ``StableDiffusionPipeline`` folder (SD 1.x, 2.x; epsilon or v-prediction); ``controlnet``: a
    ControlNetModel folder to run beside the UNet (``families.control``)."""
    return load_sd(Path(root), SD, scheduler=scheduler, dtype=dtype, variant=variant,
                   offload_encoders=offload_encoders, options=options, controlnet=controlnet)


def load_stable_diffusion_xl(root: Any, *, scheduler: Any = None, dtype: Any = "float32",
                             variant: str | None = None, offload_encoders: bool = False,
                             options: LoadOptions | None = None, controlnet: Any = None,
                             refiner: Any = None) -> LoadedModel:
    """A ``StableDiffusionXLPipeline`` folder (base), or an SDXL refiner's (``requires_aesthetics_score``);
    ``controlnet``: an SDXL ControlNetModel folder (base only); ``refiner``: an SDXL refiner folder
    that takes over part-way (base only: ``families.experts``)."""
    return load_sd(Path(root), SDXL, scheduler=scheduler, dtype=dtype, variant=variant,
                   offload_encoders=offload_encoders, options=options, controlnet=controlnet, refiner=refiner)
