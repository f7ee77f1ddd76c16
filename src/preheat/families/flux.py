"""FLUX.1 (schnell and dev): diffusers' ``FluxPipeline`` folders, loaded unchanged, in three stages.

    stage     program                                                        one executable per
    --------  -------------------------------------------------------------  ---------------------
    encode    CLIP ids (B, 77) -> pooled output            (B, 768)           batch
              T5 ids (B, L)    -> last hidden state        (B, L, 4096)       batch, L
    denoise   the engine's flow-matching loop over FluxTransformer2DModel;   sampler, batch, size
              latents (B, h, w, 16) are packed into 2x2 tokens (B, hw/4, 64)
              and unpacked inside the denoiser, so samplers and seeds see
              the same NHWC latent as every other family
              cond = {"context", "pooled"[, "guidance"]}
    decode    latents / scaling_factor + shift_factor -> VAE -> uint8        batch, size

Inputs: ``prompt`` feeds CLIP (the pooled vector), ``prompt_2`` feeds T5 (the context); an absent
or empty ``prompt_2`` is ``prompt``, as diffusers. Both are data (token ids); width and height
are static (one program per resolution), as is ``max_sequence_length`` (L: T5's padded length,
512 by default, as diffusers). ``image`` and ``strength``: img2img as
``FluxImg2ImgPipeline`` -- the image encoded (``encode_image`` stage), the loop begun at step
``int(n - n strength)`` from ``scale_noise`` of it (``families.image``); strength and the image's
content are data, its size static. ``mask_image`` (and ``padding_mask_crop``): inpainting on this
base folder as ``FluxInpaintPipeline`` -- after each step the kept (black) region is put back as
the encoded image at the next step's sigma (``samplers.Start.keep``); the mask's content is data.

Guidance: FLUX.1-dev is guidance-distilled -- the scale is an input of the transformer
(``guidance_embeds``), so it is conditioning data: one branch, no recompile for a new scale.
FLUX.1-schnell has no guidance input and refuses a scale. Either runs classifier-free guidance
only as diffusers' "true CFG" (``families.guidance.TRUE_CFG_SCALE``): ``negative_prompt`` (CLIP)
and ``negative_prompt_2`` (T5; the negative prompt when absent) encoded as the unconditional
branch, the two predictions combined at ``true_cfg_scale`` > 1, the embedded scale in both.

The schedule is diffusers': the pipeline's own sigmas ``linspace(1, 1/steps, steps)``, shifted by
``mu`` from the image's token count (``use_dynamic_shifting``); both are host-side data of the
static resolution, so steps stay data too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from preheat.errors import UnsupportedConfigError
from preheat.families import image as image_input
from preheat.families.components import FluxComponents
from preheat.families.base import Conditioning, EngineView, LoadedModel, Request
from preheat.families.image import IMAGE, MASK_IMAGE, PADDING_MASK_CROP, STRENGTH
from preheat.families.guidance import TRUE_CFG_SCALE, true_cfg_scale
from preheat.families.inputs import InputSpec, Text
from preheat.families.stages import EncodeArgs, Staged
from preheat.families.text import (NEGATIVE_PROMPT, PROMPT, TextToImageFamily, component, encode, load_scheduler,
                                   fill_later_prompts, max_sequence_length_spec, offload, on_host)
from preheat.lora import encoder_adapters
from preheat.models.bfl import Piece, bfl_modules
from preheat.samplers import MU_SIGMAS_SAMPLERS

if TYPE_CHECKING:
    from preheat.models.weights import LoadOptions

__all__ = ["FluxFamily", "FLUX", "load_flux", "flux_defaults"]

T5_LENGTH = 512  # FluxPipeline's max_sequence_length default (FLUX.1-schnell's card passes 256)
MAX_SEQUENCE_LENGTH = max_sequence_length_spec(T5_LENGTH)
PROMPT_2 = InputSpec("prompt_2", Text(), "The T5 encoder's prompt (the prompt when absent), one for all or one per image.",
                     per_image=True, default_doc="the prompt")
# diffusers' FluxPipeline reads a negative prompt only for true CFG (ignored otherwise; here refused). A
# server offers it only when --inputs names it: its true-CFG programs would double a FLUX.1 server's
# warm-up for an input few deployments use (FluxPipeline's own default runs without it).
FLUX_NEGATIVE_PROMPT = replace(NEGATIVE_PROMPT, description="What to steer away from (with true_cfg_scale > 1).",
                               offered_by_default=False)
NEGATIVE_PROMPT_2 = InputSpec("negative_prompt_2", Text(), "The T5 encoder's negative prompt (the negative prompt "
                              "when absent).", per_image=True, needs_guidance=True, needs=("negative_prompt",),
                              default_doc="the negative prompt")
TRUE_CFG_SPECS = (FLUX_NEGATIVE_PROMPT, NEGATIVE_PROMPT_2, TRUE_CFG_SCALE)


@dataclass(frozen=True)
class FluxFamily(TextToImageFamily):
    name: str = "flux"
    defaults: Mapping[str, Any] = field(default_factory=lambda: {"sampler": "flow_euler", "steps": 28,
                                                                  "guidance": 3.5})
    specs: tuple[InputSpec, ...] = (PROMPT, PROMPT_2, *TRUE_CFG_SPECS, MAX_SEQUENCE_LENGTH, IMAGE, MASK_IMAGE,
                                    STRENGTH, PADDING_MASK_CROP)
    # FluxPipeline passes its own sigmas and mu to set_timesteps: only flow_euler's scheduler takes them
    samplers: tuple[str, ...] = MU_SIGMAS_SAMPLERS
    max_size: int = 4096
    # the text encoders' weights in host memory (moved in to encode), or kept and run on the host's CPU
    loader_takes: frozenset[str] = frozenset({"offload_encoders", "encoders_on"})

    def guidance_mode(self, pipe: EngineView) -> str:
        return "embedded" if pipe.components.guidance_embeds else "none"

    def true_cfg(self, values: dict[str, Any]) -> float | None:
        """diffusers' ``do_true_cfg``: ``true_cfg_scale`` > 1 with a negative prompt (its specs'
        ``needs`` refuse either without the other; a family without them never guides)."""
        return true_cfg_scale(values) if any(s.name == TRUE_CFG_SCALE.name for s in self.specs) else None

    def guidance_hint(self) -> str:
        return f"give {TRUE_CFG_SCALE.name} above 1"  # the embedded scale never turns CFG on

    def condition_channels(self, latent_channels: int, vae_scale: int) -> int:
        """Channels per latent pixel that ride beside the noise in every token (``cond["fill"]``,
        packed with it): none for Flux; FLUX.1 Fill's masked image and mask (``families.fill``)."""
        return 0

    def model_defaults(self, guidance_embeds: bool) -> dict[str, Any]:
        """The folder's steps and guidance (``flux_defaults``)."""
        return flux_defaults(guidance_embeds)

    def check_inputs(self, pipe: EngineView, n: int, inputs: dict[str, Any]) -> dict[str, Any]:
        values = super().check_inputs(pipe, n, inputs)
        fill_later_prompts(values, (("prompt_2", "prompt"), ("negative_prompt_2", "negative_prompt")))  # T5's
        self.check_images(pipe, values, inputs)
        return values

    def check_images(self, pipe: EngineView, values: dict[str, Any], inputs: dict[str, Any]) -> None:
        """img2img (``FluxImg2ImgPipeline``): strength defaults to its 0.6; the output is the image's
        size unless width/height are given (diffusers' default would be the native size). With a
        mask (``FluxInpaintPipeline``, strength 0.6 too): width x height, else the native size."""
        image_input.check_image_inputs(pipe, values, inputs, inpaint_model=False, default_strength=(0.6, 0.6),
                                       max_size=self.max_size)

    def check_start(self, pipe: EngineView, request: Request) -> int | None:
        return image_input.flow_start(pipe, request)

    def image_start(self, pipe: EngineView, request: Request, plan: Any) -> Staged:
        """img2img (``FluxImg2ImgPipeline``), or with a mask ``FluxInpaintPipeline``'s blend after
        each step: int(n - n s), ``scale_noise`` (also at strength 1)."""
        return image_input.img2img_start(pipe, request, blend=True)

    def plan_options(self, pipe: EngineView, request: Request) -> dict[str, Any]:
        from preheat.samplers import flow_mu, flux_sigmas

        h, w, _ = request.sample_shape
        options: dict[str, Any] = {}
        config = pipe.scheduler_config
        if config.use_dynamic_shifting:
            options["mu"] = flow_mu(config, (h // 2) * (w // 2))  # from the packed token count
        if not config.use_flow_sigmas:
            options["sigmas"] = flux_sigmas(request.steps)  # what FluxPipeline passes to set_timesteps
        return options

    def condition(self, pipe: EngineView, request: Request) -> Staged:
        values, n = request.values, request.n
        texts = [list(values["prompt"]), list(values["prompt_2"])]  # CLIP's, T5's
        if request.guided:  # true CFG: the negatives are the unconditional branch's texts
            texts[0] += values["negative_prompt"]
            texts[1] += values["negative_prompt_2"]
        clip_dtype = str(pipe.components.text_encoders[0].dtype)
        adapters = encoder_adapters(pipe.lora_runtime, request.lora, clip_dtype)  # CLIP LoRA layers, when a file has them
        lora = None  # each text takes its image's slot (negatives too)
        if adapters is not None:
            lora = (adapters, np.concatenate([request.lora.index] * (len(texts[0]) // n)), request.lora.signature)
        stage = encode(pipe.components, pipe.dtype, texts, lambda: _encode_program(pipe.components, lora is not None),
                       outputs=2, extra=(("family", self.name),), lora=lora,
                       lengths=(None, values["max_sequence_length"]))

        def conditioning(out: Any) -> Conditioning:
            context, pooled = np.asarray(out[0]), np.asarray(out[1])  # (B, L, D), (B, P); B = n or 2n
            cond = {"context": context[:n], "pooled": pooled[:n]}
            uncond = {"context": context[n:], "pooled": pooled[n:]} if request.guided else {}
            if pipe.components.guidance_embeds:  # the embedded scale, in both branches (diffusers passes it to both)
                cond["guidance"] = np.full((n,), request.guidance, np.float32)
                if request.guided:
                    uncond["guidance"] = cond["guidance"]
            return Conditioning(cond=cond, uncond=uncond)

        return Staged.of(stage, conditioning)

FLUX = FluxFamily()


def flux_defaults(guidance_embeds: bool) -> dict[str, Any]:
    """FLUX.1-dev (guidance-distilled): 28 steps at 3.5, as diffusers; schnell (timestep-distilled):
    4 steps and no guidance input, as its model card runs it."""
    return {"steps": 28, "guidance": 3.5} if guidance_embeds else {"steps": 4, "guidance": None}


def _encode_program(components: FluxComponents, lora: bool = False) -> Any:
    """``EncodeArgs``: params and ids (clip (B, 77), t5 (B, L)) -> (context (B, L, D) f32, pooled
    (B, P) f32). With ``lora``: ``args.lora`` holds the CLIP encoder's ``LoraArgs``."""
    import jax.numpy as jnp

    clip, t5 = components.text_encoders

    def program(args: EncodeArgs) -> Any:
        params, ids = args.params, args.ids
        adapter = args.lora[0].adapters() if lora else None
        pooled = clip.apply(params[0], ids[0], adapter).pooled  # diffusers: CLIPTextModel's pooler_output
        context = t5.apply(params[1], ids[1])
        return context.astype(jnp.float32), pooled.astype(jnp.float32)

    return program


def bfl_lora_names(layers: Mapping[str, tuple[int, int]]) -> dict[str, tuple[Piece, ...]]:
    """Flux LoRA layer names of the original (BFL) code -- kohya's ``lora_unet_double_blocks_0_img_attn_qkv``,
    ComfyUI's ``diffusion_model.double_blocks.0.img_attn.qkv`` -- and XLabs' ``double_blocks.0.processor.qkv_lora1``,
    with "_" for ".", -> the diffusers layers they feed (``preheat.models.bfl``'s table, the one
    single files use). A fused ``qkv`` (and a single block's ``linear1``: q, k, v, mlp) shares A
    and splits B's rows; ``layers``: the model's LoRA targets, path -> (in, out)."""
    doubles = sorted({int(p.split(".")[1]) for p in layers if p.startswith("transformer_blocks.")})
    singles = sorted({int(p.split(".")[1]) for p in layers if p.startswith("single_transformer_blocks.")})
    modules = bfl_modules(doubles, singles, lambda path: layers[path][1])
    # LoRA targets are linear layers: the table's norms (and guidance_in for schnell) have none
    names = {bfl.replace(".", "_"): pieces for bfl, pieces in modules.items() if all(p.path in layers for p in pieces)}
    for i in doubles:  # XLabs' names for the attention's fused and output layers
        for xlabs, bfl in (("processor_qkv_lora1", "img_attn.qkv"), ("processor_qkv_lora2", "txt_attn.qkv"),
                           ("processor_proj_lora1", "img_attn.proj"), ("processor_proj_lora2", "txt_attn.proj")):
            names[f"double_blocks_{i}_{xlabs}"] = modules[f"double_blocks.{i}.{bfl}"]
    for i in singles:
        names[f"single_blocks_{i}_processor_qkv_lora"] = modules[f"single_blocks.{i}.linear1"][:3]  # q, k, v
        names[f"single_blocks_{i}_processor_proj_lora"] = modules[f"single_blocks.{i}.linear2"]
    return names


def load_flux(root: Any, *, scheduler: Any = None, dtype: Any = "float32", variant: str | None = None,
              offload_encoders: bool = False, options: LoadOptions | None = None,
              family: FluxFamily = FLUX, encoders_on: str = "device") -> LoadedModel:
    """A ``FluxPipeline`` folder (FLUX.1-schnell, FLUX.1-dev and fine-tunes of them); ``family``:
    a Flux-derived family whose folders hold the same parts (``families.kontext``). ``encoders_on``:
    "host" reads CLIP's and T5's weights into host memory and runs the encode stage on the host's
    CPU (``platforms.host_device``), in float32 where that CPU has no native bfloat16 products
    (``platforms.host_compute_dtype``): T5-XXL never occupies the chip (``families.text.on_host``)."""
    import jax.numpy as jnp

    from preheat.lora import LoraTargets
    from preheat.models.clip import load_clip_text
    from preheat.models.adapters import targets as lora_targets
    from preheat.models.flux import latent_image_ids, load_flux_transformer, pack_latents, unpack_latents
    from preheat.models.safetensors_files import read_json
    from preheat.models.t5 import load_t5_encoder
    from preheat.models.t5_tokenizer import T5Tokenizer
    from preheat.models.tokenizer import CLIPTokenizer
    from preheat.models.vae import load_vae
    from preheat.models.weights import check_dtype

    root = Path(root)
    dtype = check_dtype(dtype)
    index = read_json(root / "model_index.json", "pipeline index")
    tokenizers = [CLIPTokenizer.from_folder(component(root, index, "tokenizer")),
                  T5Tokenizer.from_folder(component(root, index, "tokenizer_2"), max_length=T5_LENGTH)]
    placed, encoder_dtype = options, dtype
    if encoders_on == "host":  # read straight into host memory, kept there, and computed in what the CPU multiplies fast
        from preheat import platforms
        from preheat.models.weights import LoadOptions as _Options

        placed = replace(options or _Options(), device=platforms.host_device())
        encoder_dtype = platforms.host_compute_dtype(dtype)
    encoders = [load_clip_text(component(root, index, "text_encoder"), dtype=encoder_dtype, variant=variant,
                               options=placed),
                load_t5_encoder(component(root, index, "text_encoder_2"), dtype=encoder_dtype, variant=variant,
                                options=placed)]
    if encoders_on == "host":
        encoders = [on_host(e, placed) for e in encoders]
    elif offload_encoders:
        encoders = [offload(e, options) for e in encoders]
    transformer = load_flux_transformer(component(root, index, "transformer"), dtype=dtype, variant=variant, options=options)
    vae = load_vae(component(root, index, "vae"), dtype=dtype, variant=variant, options=options)
    sched, defaults = load_scheduler(root, family, scheduler, index)

    cfg = transformer.config
    clip_width = encoders[0].config.hidden_size
    if clip_width != cfg.pooled_projection_dim:
        raise UnsupportedConfigError(f"{root}: the CLIP encoder's width is {clip_width}, the transformer's "
                                     f"pooled_projection_dim is {cfg.pooled_projection_dim}")
    t5_width = encoders[1].config.d_model
    if t5_width != cfg.joint_attention_dim:
        raise UnsupportedConfigError(f"{root}: the T5 encoder's width is {t5_width}, the transformer's "
                                     f"joint_attention_dim is {cfg.joint_attention_dim}")
    latent_channels = vae.config.latent_channels
    vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
    extra = family.condition_channels(latent_channels, vae_scale)  # FLUX.1 Fill: the masked image and the mask
    if cfg.in_channels != 4 * (latent_channels + extra) or cfg.output_channels != 4 * latent_channels:
        packed = f"{4 * latent_channels}" + (f" + {4 * extra} of {family.name} conditioning" if extra else "")
        raise UnsupportedConfigError(f"{root}: the transformer takes {cfg.in_channels} channels per token and gives "
                                     f"{cfg.output_channels}; the VAE's {latent_channels} latent channels pack into "
                                     f"{packed} in, {4 * latent_channels} out")
    guidance_embeds = bool(cfg.guidance_embeds)

    def apply(params: Any, x: Any, t: Any, cond: dict[str, Any], lora: Any = None) -> Any:
        b, h, w, _ = x.shape  # (B, h, w, C) latents; h, w even (size_multiple)
        tokens = pack_latents(x)  # (B, S, 4C), S = hw/4
        fill = cond.get("fill")  # FLUX.1 Fill: (B, h, w, C + s²), the masked image's latents and the folded mask
        if fill is not None:
            tokens = jnp.concatenate([tokens, pack_latents(fill.astype(x.dtype))], axis=-1)  # (B, S, 4C + 4C + 4s²)
        ids = latent_image_ids(h, w)  # (S, 3)
        reference = cond.get("image_latents")  # Kontext: (B, rh, rw, C), the encoded reference image
        if reference is not None:  # its tokens sit after the noise tokens, ids [1, row, col]
            rh, rw = reference.shape[1:3]
            tokens = jnp.concatenate([tokens, pack_latents(reference.astype(x.dtype))], axis=1)  # (B, S + R, 4C)
            ids = np.concatenate([ids, latent_image_ids(rh, rw, index=1)])  # (S + R, 3)
        txt_ids = jnp.zeros((cond["context"].shape[1], 3), jnp.float32)  # FluxPipeline's text ids are zeros
        out = transformer.apply(params, tokens, cond["context"].astype(x.dtype), cond["pooled"].astype(x.dtype),
                                t / 1000, ids, txt_ids, cond.get("guidance"), lora)
        return unpack_latents(out[:, :(h // 2) * (w // 2)], h, w)  # (B, h, w, C): the noise tokens' velocity

    # LoRA: every Linear of the transformer and of the CLIP encoder takes an adapter (preheat.lora)
    targets = LoraTargets(family=family.name,
                          layers={"denoiser": lora_targets(transformer.graphdef, transformer.params),
                                  "text_encoder": lora_targets(encoders[0].graphdef, encoders[0].params)},
                          prefixes={"transformer": "denoiser", "lora_transformer": "denoiser",
                                    "text_encoder": "text_encoder", "lora_te": "text_encoder",
                                    "lora_te1": "text_encoder"},
                          path_prefix={"text_encoder": "text_model."},
                          aliases=bfl_lora_names(lora_targets(transformer.graphdef, transformer.params)),
                          alias_prefixes=("lora_unet_", "diffusion_model.", "transformer."))

    components = FluxComponents(
        tokenizers=tuple(tokenizers),
        text_encoders=tuple(encoders),
        offload_encoders=offload_encoders,
        encoders_on=encoders_on,
        vae=vae,
        vae_scale=vae_scale,
        size_multiple=2 * vae_scale,  # latents pack into 2x2 tokens
        guidance_embeds=guidance_embeds,
        lora_targets=targets,
        lora_encoders=("text_encoder",),
        encode_fingerprint={"kind": "flux-text", "clip": encoders[0].config.architecture_dict(),
                               "t5": encoders[1].config.architecture_dict(), "dtype": str(dtype)},
        decode_fingerprint={"kind": "vae-decode", "config": vae.config.architecture_dict(), "dtype": str(vae.dtype)},
    )
    defaults = {**defaults, **family.model_defaults(guidance_embeds)}
    # diffusers' FluxPipeline: default_sample_size 128 latents per side (1024 px with an 8x VAE)
    fingerprint = {"kind": "flux-transformer", "family": family.name, "config": cfg.architecture_dict()}
    return LoadedModel(apply=apply, params=transformer.params, sample_shape=(128, 128, latent_channels),
                       scheduler_config=sched, fingerprint=fingerprint, family=family, defaults=defaults,
                       dtype=str(jnp.dtype(dtype)), layout="NCHW", components=components)

