"""Stable Diffusion 3 / 3.5: diffusers' ``StableDiffusion3Pipeline`` folders, loaded unchanged.

    stage     program                                                        one executable per
    --------  -------------------------------------------------------------  ---------------------
    encode    CLIP-L ids, CLIP-G ids (B, 77), T5 ids (B, L) ->               batch, L
              context = [CLIP-L | CLIP-G penultimate states, zero-padded to
              the T5 width ; T5 last hidden state]       (B, 77 + L, D)
              pooled  = [CLIP-L | CLIP-G projections]    (B, 768 + 1280)
              (a folder without T5 gets zeros in its place, as diffusers)
    denoise   the engine's flow-matching loop over SD3Transformer2DModel,    sampler, batch, size,
              classifier-free guidance with "" or the negative prompt        guidance on/off
    decode    latents / scaling_factor + shift_factor -> VAE -> uint8        batch, size

``image`` and ``strength``: img2img as ``StableDiffusion3Img2ImgPipeline`` (``families.image``:
the ``encode_image`` stage, the loop begun at ``int(n - n strength)`` from ``scale_noise``).
``mask_image`` (and ``padding_mask_crop``): inpainting as ``StableDiffusion3InpaintPipeline`` with a
base transformer -- from the noise alone at strength 1, and after each step the kept (black) region
put back as the encoded image at the next step's sigma. Its decode is the other SD3 pipelines'
(``latents / scaling_factor + shift_factor``; diffusers' inpaint pipeline drops the shift).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from preheat.errors import UnsupportedConfigError
from preheat.families import image as image_input
from preheat.families.components import SD3Components
from preheat.families.base import Conditioning, EngineView, LoadedModel, Request
from preheat.families.image import IMAGE, MASK_IMAGE, PADDING_MASK_CROP, STRENGTH
from preheat.families.inputs import InputSpec, Text
from preheat.families.stages import EncodeArgs, Staged
from preheat.families.text import (NEGATIVE_PROMPT, PROMPT, TextToImageFamily, component, encode, fill_later_prompts,
                                   load_scheduler, max_sequence_length_spec, offload)
from preheat.samplers import FLOW_SAMPLERS

if TYPE_CHECKING:
    from preheat.models.weights import LoadOptions

__all__ = ["SD3Family", "SD3", "load_stable_diffusion_3"]

T5_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length default
MAX_SEQUENCE_LENGTH = max_sequence_length_spec(T5_LENGTH)
# diffusers' StableDiffusion3Pipeline: one prompt per encoder (CLIP-L, CLIP-G, T5); an absent or empty one is
# the first's, and a negative one the negative prompt's (itself "" when absent)
PROMPT_2 = InputSpec("prompt_2", Text(), "SD3: CLIP-G's prompt (the prompt when absent).", per_image=True,
                     default_doc="the prompt")
PROMPT_3 = InputSpec("prompt_3", Text(), "SD3: T5's prompt (the prompt when absent).", per_image=True,
                     default_doc="the prompt")
NEGATIVE_PROMPT_2 = InputSpec("negative_prompt_2", Text(), "SD3: CLIP-G's negative prompt (the negative prompt "
                              "when absent).", per_image=True, needs_guidance=True, default_doc="the negative prompt")
NEGATIVE_PROMPT_3 = InputSpec("negative_prompt_3", Text(), "SD3: T5's negative prompt (the negative prompt when "
                              "absent).", per_image=True, needs_guidance=True, default_doc="the negative prompt")


@dataclass(frozen=True)
class SD3Family(TextToImageFamily):
    name: str = "stable-diffusion-3"
    defaults: Mapping[str, Any] = field(default_factory=lambda: {"sampler": "flow_euler", "steps": 28,
                                                                  "guidance": 7.0})
    specs: tuple[InputSpec, ...] = (PROMPT, NEGATIVE_PROMPT, PROMPT_2, PROMPT_3, NEGATIVE_PROMPT_2, NEGATIVE_PROMPT_3,
                                    MAX_SEQUENCE_LENGTH, IMAGE, MASK_IMAGE, STRENGTH, PADDING_MASK_CROP)
    samplers: tuple[str, ...] = FLOW_SAMPLERS
    max_size: int = 4096

    def check_inputs(self, pipe: EngineView, n: int, inputs: dict[str, Any]) -> dict[str, Any]:
        """img2img (``StableDiffusion3Img2ImgPipeline``): strength defaults to its 0.6; the output is
        the image's size unless width/height are given (diffusers' default would be the native size).
        With a mask (``StableDiffusion3InpaintPipeline``, strength 0.6 too): width x height, else the
        native size."""
        values = super().check_inputs(pipe, n, inputs)
        fill_later_prompts(values, (("prompt_2", "prompt"), ("prompt_3", "prompt"),
                                    ("negative_prompt_2", "negative_prompt"), ("negative_prompt_3", "negative_prompt")))
        image_input.check_image_inputs(pipe, values, inputs, inpaint_model=False, default_strength=(0.6, 0.6),
                                       max_size=self.max_size)
        return values

    def check_start(self, pipe: EngineView, request: Request) -> int | None:
        return image_input.flow_start(pipe, request)

    def image_start(self, pipe: EngineView, request: Request, plan: Any) -> Staged:
        """img2img, or with a mask ``StableDiffusion3InpaintPipeline``'s blend after each step: its
        get_timesteps, int(n - n s); ``scale_noise``; at strength 1 the noise alone (``is_strength_max``)."""
        return image_input.img2img_start(pipe, request, blend=True, pure_at_max=True)

    def plan_options(self, pipe: EngineView, request: Request) -> dict[str, Any]:
        from preheat.samplers import MU_SIGMAS_SAMPLERS, flow_mu

        if not pipe.scheduler_config.use_dynamic_shifting or request.sampler not in MU_SIGMAS_SAMPLERS:
            return {}  # (make_plan names the problem if the sampler cannot shift dynamically)
        h, w, _ = request.sample_shape
        patch = pipe.components.patch_size
        return {"mu": flow_mu(pipe.scheduler_config, (h // patch) * (w // patch))}

    def condition(self, pipe: EngineView, request: Request) -> Staged:
        values, n = request.values, request.n
        texts = [list(values[name]) for name in ("prompt", "prompt_2", "prompt_3")]  # CLIP-L's, CLIP-G's, T5's
        if request.guided:  # the unconditional branch's: each encoder's negative prompt, "" when none is given
            for encoder, name in enumerate(("negative_prompt", "negative_prompt_2", "negative_prompt_3")):
                texts[encoder] += values[name] if values[name] is not None else [""] * n
        stage = encode(pipe.components, pipe.dtype, texts, lambda: _encode_program(pipe.components), outputs=2,
                       extra=(("family", self.name),), lengths=(None, None, values["max_sequence_length"]))

        def conditioning(out: Any) -> Conditioning:
            context, pooled = np.asarray(out[0]), np.asarray(out[1])
            cond = {"context": context[:n], "pooled": pooled[:n]}
            uncond = {"context": context[n:], "pooled": pooled[n:]} if request.guided else {}
            return Conditioning(cond=cond, uncond=uncond)

        return Staged.of(stage, conditioning)

SD3 = SD3Family()


def _encode_program(components: SD3Components) -> Any:
    """``EncodeArgs``: params and ids of CLIP-L, CLIP-G, T5 -> (context (B, 77 + L, D) f32, pooled
    (B, P_l + P_g) f32)."""
    import jax.numpy as jnp

    clip_l, clip_g, t5 = components.text_encoders
    width = components.joint_attention_dim

    def program(args: EncodeArgs) -> Any:
        params, ids = args.params, args.ids
        out_l, out_g = clip_l.apply(params[0], ids[0]), clip_g.apply(params[1], ids[1])
        clip = jnp.concatenate([out_l.hidden_states[-2], out_g.hidden_states[-2]], axis=-1)  # (B, 77, D_l + D_g)
        clip = jnp.pad(clip.astype(jnp.float32), ((0, 0), (0, 0), (0, width - clip.shape[-1])))  # (B, 77, D)
        b = ids[0].shape[0]
        if t5 is None:
            t5_states = jnp.zeros((b, ids[2].shape[1], width), jnp.float32)  # (B, max_sequence_length, D)
        else:
            t5_states = t5.apply(params[2], ids[2]).astype(jnp.float32)  # (B, L, D)
        pooled = jnp.concatenate([out_l.text_embeds, out_g.text_embeds], axis=-1).astype(jnp.float32)
        return jnp.concatenate([clip, t5_states], axis=1), pooled

    return program


@dataclass(frozen=True)
class _ZeroTokens:
    """Stands in for a missing T5 tokenizer: the encode stage puts zeros where T5 states would be,
    ``max_length`` of them (the call's ``max_sequence_length``, as diffusers)."""

    max_length: int

    def encode(self, texts: list[str]) -> np.ndarray:
        return np.zeros((len(texts), self.max_length), np.int32)


def load_stable_diffusion_3(root: Any, *, scheduler: Any = None, dtype: Any = "float32", variant: str | None = None,
                            offload_encoders: bool = False, options: LoadOptions | None = None) -> LoadedModel:
    """A ``StableDiffusion3Pipeline`` folder (SD3-medium, SD3.5-large/-medium as far as the transformer
    supports them; with or without ``text_encoder_3``)."""
    import jax.numpy as jnp

    from preheat.lora import LoraTargets
    from preheat.models.clip import load_clip_text
    from preheat.models.adapters import targets as lora_targets
    from preheat.models.safetensors_files import read_json
    from preheat.models.sd3 import load_sd3_transformer
    from preheat.models.t5 import load_t5_encoder
    from preheat.models.t5_tokenizer import T5Tokenizer
    from preheat.models.tokenizer import CLIPTokenizer
    from preheat.models.vae import load_vae
    from preheat.models.weights import check_dtype

    root = Path(root)
    dtype = check_dtype(dtype)
    index = read_json(root / "model_index.json", "pipeline index")
    tokenizers: list[Any] = []
    encoders: list[Any] = []
    for te_name, tok_name in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
        tokenizers.append(CLIPTokenizer.from_folder(component(root, index, tok_name)))
        entry = index.get(te_name)
        model_class = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 else None
        encoders.append(load_clip_text(component(root, index, te_name), dtype=dtype, variant=variant, options=options,
                                       model_class=model_class))
    has_t5 = isinstance(index.get("text_encoder_3"), (list, tuple)) and index["text_encoder_3"][0] is not None
    if has_t5:
        tokenizers.append(T5Tokenizer.from_folder(component(root, index, "tokenizer_3"), max_length=T5_LENGTH))
        encoders.append(load_t5_encoder(component(root, index, "text_encoder_3"), dtype=dtype, variant=variant, options=options))
    else:
        tokenizers.append(_ZeroTokens(T5_LENGTH))
        encoders.append(None)
    if offload_encoders:
        encoders = [offload(e, options) if e is not None else None for e in encoders]
    transformer = load_sd3_transformer(component(root, index, "transformer"), dtype=dtype, variant=variant, options=options)
    vae = load_vae(component(root, index, "vae"), dtype=dtype, variant=variant, options=options)
    sched, defaults = load_scheduler(root, SD3, scheduler, index)

    cfg = transformer.config
    for name, enc in (("text_encoder", encoders[0]), ("text_encoder_2", encoders[1])):
        if not enc.config.with_projection:
            raise UnsupportedConfigError(f"{root}: {name} must be a CLIPTextModelWithProjection (SD3 pools its "
                                         "projection)")
    pooled = encoders[0].config.projection_dim + encoders[1].config.projection_dim
    if pooled != cfg.pooled_projection_dim:
        raise UnsupportedConfigError(f"{root}: the CLIP projections give {pooled} pooled features, the transformer's "
                                     f"pooled_projection_dim is {cfg.pooled_projection_dim}")
    clip_width = encoders[0].config.hidden_size + encoders[1].config.hidden_size
    if clip_width > cfg.joint_attention_dim:
        raise UnsupportedConfigError(f"{root}: the CLIP states are {clip_width} wide, more than the transformer's "
                                     f"joint_attention_dim {cfg.joint_attention_dim}")
    if has_t5 and encoders[2].config.d_model != cfg.joint_attention_dim:
        raise UnsupportedConfigError(f"{root}: the T5 encoder's width is {encoders[2].config.d_model}, the "
                                     f"transformer's joint_attention_dim is {cfg.joint_attention_dim}")
    if vae.config.latent_channels != cfg.in_channels:
        raise UnsupportedConfigError(f"{root}: the VAE has {vae.config.latent_channels} latent channels, the "
                                     f"transformer takes {cfg.in_channels}")
    vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)

    def apply(params: Any, x: Any, t: Any, cond: dict[str, Any], lora: Any = None) -> Any:
        return transformer.apply(params, x, cond["context"].astype(x.dtype), cond["pooled"].astype(x.dtype), t,
                                 lora=lora)

    # LoRA: every Linear of the transformer takes an adapter (preheat.lora); diffusers' SD3 LoRA names
    # ("transformer.transformer_blocks.0.attn.to_q") are the layers' own. Text-encoder parts are refused by name.
    targets = LoraTargets(family=SD3.name, layers={"denoiser": lora_targets(transformer.graphdef, transformer.params)},
                          prefixes={"transformer": "denoiser", "lora_transformer": "denoiser"}, path_prefix={})

    components = SD3Components(
        tokenizers=tuple(tokenizers),
        text_encoders=tuple(encoders),
        offload_encoders=offload_encoders,
        vae=vae,
        vae_scale=vae_scale,
        size_multiple=vae_scale * cfg.patch_size,
        patch_size=cfg.patch_size,
        joint_attention_dim=cfg.joint_attention_dim,
        lora_targets=targets,
        lora_encoders=(),
        encode_fingerprint={"kind": "sd3-text", "clip": [e.config.architecture_dict() for e in encoders[:2]],
                               "t5": encoders[2].config.architecture_dict() if has_t5 else None,
                               "joint_attention_dim": cfg.joint_attention_dim, "dtype": str(dtype)},
        decode_fingerprint={"kind": "vae-decode", "config": vae.config.architecture_dict(), "dtype": str(vae.dtype)},
    )
    fingerprint = {"kind": "sd3-transformer", "family": SD3.name, "config": cfg.architecture_dict()}
    side = int(cfg.sample_size)  # diffusers: default_sample_size = transformer.config.sample_size (latents)
    return LoadedModel(apply=apply, params=transformer.params, sample_shape=(side, side, cfg.in_channels),
                       scheduler_config=sched, fingerprint=fingerprint, family=SD3, defaults=defaults,
                       dtype=str(jnp.dtype(dtype)), layout="NCHW", components=components)
