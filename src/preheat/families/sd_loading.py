"""Loading a Stable Diffusion folder (SD 1.x/2.x, SDXL, an SDXL refiner) and the second model that
runs beside it, one small function each; ``load_sd`` dispatches:

    function          reads                                        gives
    ----------------  -------------------------------------------  ------------------------------------
    _load_base        the folder: encoders, UNet, VAE, scheduler   ``_Base`` (an inpainting UNet:
                      (``_check_channels``: 2C + 1 input channels)   ``inpaint``)
    _load_controlnet  controlnet=FOLDER, checked against the base  the ControlNet (``families.control``)
    _load_refiner     refiner=FOLDER: its own ``_Base``, the base's  the refiner's ``LoadedModel``
                      VAE (an SDXL base's text-to-image only)        (``families.experts``)
    _assemble         a ``_Base`` and its companion, if any        ``LoadedModel``: apply, params, key

The denoiser's ``params`` (``LoadedModel.params``) is the UNet's; with a ControlNet (the UNet's, the
ControlNet's); in an ensemble (the base UNet's, the refiner's). Each companion's architecture joins
the denoiser's fingerprint, its weights are arguments. Weights are read in this order: the encoders,
the UNet, the VAE, then the ControlNet or the refiner (a refiner's encoders, then its UNet).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from preheat.errors import UnsupportedConfigError
from preheat.families.base import LoadedModel
from preheat.families.components import SDComponents
from preheat.families.control import keep_scale
from preheat.families.experts import by_expert, check_refiner
from preheat.families.text import component, load_scheduler, offload

if TYPE_CHECKING:
    from preheat.models.weights import LoadOptions

__all__ = ["load_sd", "check_controlnet", "inpainting", "sgm_lora_names"]

SDFamily = Any  # a families.stable_diffusion.StableDiffusionFamily (that module imports this one)


@dataclass(frozen=True)
class _Base:
    """One folder's own parts, loaded and checked against each other."""

    root: Path
    family: SDFamily  # the folder's own (an SDXL refiner's index: SDXL_REFINER)
    index: Mapping[str, Any]  # model_index.json
    encoder_names: tuple[str, ...]  # "text_encoder"[, "text_encoder_2"]: a refiner has the second alone
    tokenizers: tuple[Any, ...]
    encoders: tuple[Any, ...]
    unet: Any
    vae: Any
    scheduler: Any  # preheat.samplers.SchedulerConfig
    defaults: dict[str, Any]
    inpaint: bool  # a 9-channel UNet: the sample, the mask, the masked image's latents
    vae_scale: int  # pixels per latent
    dtype: Any  # the checked weights dtype


def load_sd(root: Path, family: SDFamily, *, scheduler: Any, dtype: Any, variant: str | None,
            offload_encoders: bool, options: LoadOptions | None, controlnet: Any = None,
            refiner: Any = None) -> LoadedModel:
    """A Stable Diffusion folder of ``family``'s class, with a ControlNet or an SDXL refiner beside it."""
    base = _load_base(root, family, scheduler=scheduler, dtype=dtype, variant=variant,
                      offload_encoders=offload_encoders, options=options)
    control = None if controlnet is None else _load_controlnet(controlnet, base, options)
    expert = None
    if refiner is not None:  # after the ControlNet: a refiner beside one is refused in one line
        expert = _load_refiner(refiner, base, scheduler=scheduler, variant=variant,
                               offload_encoders=offload_encoders, options=options, control=control is not None)
    return _assemble(base, control, expert)


def _load_base(root: Path, family: SDFamily, *, scheduler: Any, dtype: Any, variant: str | None,
               offload_encoders: bool, options: LoadOptions | None, shared_vae: Any = None) -> _Base:
    """The folder's encoders, UNet, VAE (``shared_vae``: an ensemble's refiner decodes nothing, it
    uses the base's) and scheduler, checked to fit one another."""
    from preheat.models.clip import load_clip_text
    from preheat.models.safetensors_files import read_json
    from preheat.models.tokenizer import CLIPTokenizer
    from preheat.models.unet2d_condition import load_unet_condition
    from preheat.models.vae import load_vae
    from preheat.models.weights import check_dtype

    root = Path(root)
    dtype = check_dtype(dtype)
    index = read_json(root / "model_index.json", "pipeline index")
    family = family.for_index(index)  # an SDXL refiner's index: the refiner family
    names = [("text_encoder", "tokenizer")] + ([("text_encoder_2", "tokenizer_2")] if family.xl else [])
    if family.aesthetics:  # a refiner's index has no first encoder: [null, null]
        names = [(te, tok) for te, tok in names if index.get(te) != [None, None]]
    tokenizers, encoders = [], []
    for te_name, tok_name in names:
        tokenizers.append(CLIPTokenizer.from_folder(component(root, index, tok_name)))
        entry = index.get(te_name)
        model_class = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 else None
        encoder = load_clip_text(component(root, index, te_name), dtype=dtype, variant=variant, options=options,
                                 model_class=model_class)
        encoders.append(offload(encoder, options) if offload_encoders else encoder)
    unet = load_unet_condition(component(root, index, "unet"), dtype=dtype, variant=variant, options=options)
    vae = (shared_vae if shared_vae is not None
           else load_vae(component(root, index, "vae"), dtype=dtype, variant=variant, options=options))
    sched, defaults = load_scheduler(root, family, scheduler, index)

    cfg = unet.config
    width = sum(te.config.hidden_size for te in encoders)
    if family.xl and cfg.addition_embed_type != "text_time":
        raise UnsupportedConfigError(f"{root}: an SDXL UNet needs addition_embed_type 'text_time', "
                                     f"got {cfg.addition_embed_type!r}")
    # the UNet's own check: cross_attention_dim vs the encoders' width (and SDXL's pooled + 6 ids; a refiner's 5)
    unet.check_text_conditioning(width, encoders[-1].config.projection_dim if family.xl else None,
                                 5 if family.aesthetics else 6)
    return _Base(root=root, family=family, index=index, encoder_names=tuple(te for te, _ in names),
                 tokenizers=tuple(tokenizers), encoders=tuple(encoders), unet=unet, vae=vae, scheduler=sched,
                 defaults=defaults, inpaint=_check_channels(root, cfg.in_channels, vae.config.latent_channels),
                 vae_scale=2 ** (len(vae.config.block_out_channels) - 1), dtype=dtype)


def inpainting(unet_in_channels: int, latent_channels: int) -> bool:
    """An inpainting UNet (StableDiffusion[XL]InpaintPipeline) takes the sample, the mask and the
    masked image's latents."""
    return unet_in_channels == 2 * latent_channels + 1


def _check_channels(root: Path, unet_in_channels: int, latent_channels: int) -> bool:
    """Whether the UNet is an inpainting one (``inpainting``: the sample, the mask and the masked
    image's latents, 2C + 1 channels); a base UNet takes the sample (C); any other count: one line."""
    if inpainting(unet_in_channels, latent_channels):
        return True
    if unet_in_channels != latent_channels:
        raise UnsupportedConfigError(f"{root}: the VAE has {latent_channels} latent channels, the UNet takes "
                                     f"{unet_in_channels} (an inpainting UNet takes {2 * latent_channels + 1})")
    return False


def _load_controlnet(source: Any, base: _Base, options: LoadOptions | None) -> Any:
    """A ControlNet folder that fits the base's UNet (``check_controlnet``)."""
    from preheat.models.controlnet import load_controlnet

    control = load_controlnet(source, dtype=base.dtype, options=options)
    check_controlnet(control.config, base.unet.config, base.family, base.inpaint, base.vae_scale, str(source))
    return control


def _load_refiner(source: Any, base: _Base, *, scheduler: Any, variant: str | None, offload_encoders: bool,
                  options: LoadOptions | None, control: bool) -> LoadedModel:
    """An SDXL refiner folder that takes over from the base part-way (``families.experts``): its own
    encoders and UNet, the base's VAE, the base's schedule."""
    check_refiner(Path(source), base.family, base.inpaint, control)  # so the base is SDXL, the folder a refiner
    # read as the base's class, as FAMILY_OF_CLASS reads the folder alone: its index makes it the refiner family
    expert = _assemble(_load_base(Path(source), base.family, scheduler=scheduler, dtype=base.dtype,
                                  variant=variant, offload_encoders=offload_encoders, options=options,
                                  shared_vae=base.vae))
    if expert.components.inpaint or expert.scheduler_config != base.scheduler:
        raise UnsupportedConfigError(f"refiner={source}: " + ("an inpainting refiner UNet is not supported"
                                     if expert.components.inpaint else "its scheduler config differs from the "
                                     "base's (the ensemble runs one schedule); give both the same"))
    return expert


def _assemble(base: _Base, control: Any = None, expert: LoadedModel | None = None) -> LoadedModel:
    """The ``LoadedModel`` of a base and its companion (a ControlNet, or a refiner), if any."""
    import jax.numpy as jnp

    cfg = base.unet.config
    fingerprint: dict[str, Any] = {"kind": "unet2d-condition", "family": base.family.name,
                                   "config": cfg.architecture_dict()}
    params, apply = base.unet.params, _denoiser(base, control)
    if control is not None:  # its architecture changes the program; its weights are arguments, as the UNet's
        fingerprint["controlnet"] = {"config": control.config.architecture_dict(), "dtype": str(control.dtype)}
        params = (base.unet.params, control.params)
    if expert is not None:  # the refiner's UNet too: its architecture in the key, its weights an argument
        fingerprint["refiner"] = expert.fingerprint
        params, apply = (base.unet.params, expert.params), _ensemble(base, expert)
    latent = cfg.sample_size if isinstance(cfg.sample_size, (list, tuple)) else (cfg.sample_size, cfg.sample_size)
    return LoadedModel(apply=apply, params=params,
                       sample_shape=(int(latent[0]), int(latent[1]), base.vae.config.latent_channels),
                       scheduler_config=base.scheduler, fingerprint=fingerprint, family=base.family,
                       defaults=base.defaults, dtype=str(jnp.dtype(base.dtype)), layout="NCHW",
                       components=_components(base, control, expert))


def _added(cond: dict[str, Any], xl: bool) -> dict[str, Any] | None:
    """SDXL's added conditioning (pooled text embeds and time ids); None for SD 1.x/2.x."""
    return {"text_embeds": cond["text_embeds"], "time_ids": cond["time_ids"]} if xl else None


def _denoiser(base: _Base, control: Any) -> Callable[..., Any]:
    """The UNet's apply: an inpainting UNet's extra channels, a ControlNet's residuals."""
    import jax.numpy as jnp

    unet, xl, inpaint = base.unet, base.family.xl, base.inpaint

    def apply(params: Any, x: Any, t: Any, cond: dict[str, Any], lora: Any = None) -> Any:
        added = _added(cond, xl)
        residuals = None
        if control is not None:  # params: (the UNet's, the ControlNet's); both branches take it (guess mode: its
            # unconditional residuals scaled by 0, as diffusers' zeros), each residual its own scale
            params, control_params = params
            # outside its window the ControlNet still runs, scaled by 0: a lax.cond skipping it costs more per
            # step it runs than it saves on this CPU (docs/benchmarks.md, round 19)
            residuals = control.apply(control_params, x, t, cond["context"], cond["control_image"],
                                      keep_scale(cond, t), added)
        if inpaint:  # (B, h, w, C + 1 + C): after the scheduler's input scaling, as diffusers concatenates
            x = jnp.concatenate([x, cond["mask"].astype(x.dtype), cond["masked_image_latents"].astype(x.dtype)], -1)
        return unet.apply(params, x, t, cond["context"], added, lora, residuals)

    return apply


def _ensemble(base: _Base, expert: LoadedModel) -> Callable[..., Any]:
    """SDXL's ensemble of experts: the base UNet, then the refiner from the call's cutoff on."""
    unet, xl = base.unet, base.family.xl

    def apply(params: Any, x: Any, t: Any, cond: dict[str, Any], lora: Any = None) -> Any:
        added = _added(cond, xl)
        params, refiner_params = params  # (the base UNet's, the refiner's); the refiner takes no LoRA
        own = {k: cond[f"refiner_{k}"] for k in ("context", "text_embeds", "time_ids")}
        return by_expert(t, cond["refiner_cutoff"],
                         lambda y: unet.apply(params, y, t, cond["context"], added, lora),
                         lambda y: expert.apply(refiner_params, y, t, own), x)

    return apply


def _components(base: _Base, control: Any, expert: LoadedModel | None) -> SDComponents:
    """What the family's hooks read of a loaded Stable Diffusion model (``families.components``)."""
    encoders, vae = base.encoders, base.vae
    return SDComponents(
        tokenizers=base.tokenizers,
        text_encoders=encoders,
        vae=vae,
        vae_scale=base.vae_scale,
        size_multiple=base.vae_scale,  # odd latent sides are fine: the UNet upsamples to each skip's size
        inpaint=base.inpaint,
        force_zeros=bool(base.index.get("force_zeros_for_empty_prompt", True)),
        clip_layers=min(te.config.num_hidden_layers for te in encoders),  # bounds clip_skip
        controlnet=None if control is None else control.config,
        refiner=None if expert is None else expert.components,
        lora_targets=_lora_targets(base),
        lora_encoders=base.encoder_names,
        encode_fingerprint={"kind": "clip-text", "encoders": [te.config.architecture_dict() for te in encoders],
                            "dtype": str(base.dtype), "xl": base.family.xl},
        # scaling/shift factors live in the VAE's params (data), not in the program
        decode_fingerprint={"kind": "vae-decode", "config": vae.config.architecture_dict(), "dtype": str(vae.dtype)},
    )


def _lora_targets(base: _Base) -> Any:
    """LoRA: every Linear / 1x1 conv of the UNet and the text encoders takes an adapter (preheat.lora)."""
    from preheat.lora import LoraTargets
    from preheat.models.adapters import targets as lora_targets

    te_names = base.encoder_names
    layers = {"denoiser": lora_targets(base.unet.graphdef, base.unet.params),
              **{name: lora_targets(te.graphdef, te.params) for name, te in zip(te_names, base.encoders)}}
    prefixes = {"unet": "denoiser", "lora_unet": "denoiser"}
    first = {"text_encoder": "text_encoder", "lora_te": "text_encoder", "lora_te1": "text_encoder"}
    if "text_encoder" in te_names:
        prefixes.update(first)
    if "text_encoder_2" in te_names:
        prefixes.update({"text_encoder_2": "text_encoder_2", "lora_te2": "text_encoder_2"})
    return LoraTargets(family=base.family.name, layers=layers, prefixes=prefixes,
                       path_prefix={name: "text_model." for name in te_names},
                       aliases=sgm_lora_names(base.unet.config, layers["denoiser"]), alias_prefixes=("lora_unet_",),
                       absent={} if "text_encoder" in te_names else first)  # a refiner: refused, as diffusers


def check_controlnet(config: Any, unet: Any, family: SDFamily, inpaint: bool, vae_scale: int,
                      source: str) -> None:
    """A ControlNet that fits the UNet (its residuals' count and widths, its text and time
    conditioning, its control image's scale), and a pipeline diffusers runs it in; else one line.
    Beside an inpainting UNet it takes the latents alone, as diffusers' ControlNet inpaint pipelines
    give it the sample before the mask channels join it."""
    from preheat.models.controlnet import skip_widths

    if family.aesthetics:
        raise UnsupportedConfigError(f"controlnet={source}: a ControlNet with an SDXL refiner is not supported")
    own, theirs = skip_widths(config.unet_config()), skip_widths(unet)
    checks = (("its residuals' widths", own, theirs), ("cross_attention_dim", config.cross_attention_dim,
                                                       unet.cross_attention_dim),
              ("addition_embed_type", config.addition_embed_type, unet.addition_embed_type),
              ("projection_class_embeddings_input_dim", config.projection_class_embeddings_input_dim,
               unet.projection_class_embeddings_input_dim),
              ("in_channels", config.in_channels, (unet.in_channels - 1) // 2 if inpaint else unet.in_channels),
              ("pixels per latent", config.downscale, vae_scale))
    for what, got, want in checks:
        if got != want:
            raise UnsupportedConfigError(f"controlnet={source} does not fit this model: {what} {got!r}, the model's "
                                         f"{want!r}")


def sgm_lora_names(cfg: Any, layers: Mapping[str, tuple[int, int]]) -> dict[str, tuple[tuple[str, None, None, bool], ...]]:
    """kohya LoRA names in the original (LDM/SGM) UNet layout -- ``lora_unet_input_blocks_4_1_transformer_blocks_0_
    attn1_to_k``, most SDXL LoRAs -- with "_" for ".", -> the diffusers layer each names. Each down level is
    ``layers + 1`` input blocks (the last a downsampler), each up level ``layers + 1`` output blocks; ``_1``
    is a block's transformer."""
    blocks: dict[str, str] = {"mid_block.attentions.0": "middle_block_1"}
    n = 1
    for level, count in enumerate(cfg.layers):
        for j in range(count):
            blocks[f"down_blocks.{level}.attentions.{j}"] = f"input_blocks_{n + j}_1"
        n += count + 1
    n = 0
    for level, count in enumerate(reversed(cfg.layers)):
        for j in range(count + 1):
            blocks[f"up_blocks.{level}.attentions.{j}"] = f"output_blocks_{n + j}_1"
        n += count + 1
    names = {}
    for path in layers:
        parts = path.split(".")
        head = ".".join(parts[:3] if parts[0] == "mid_block" else parts[:4])  # the transformer block
        if head in blocks:
            names[f"{blocks[head]}_{path[len(head) + 1:]}".replace(".", "_")] = ((path, None, None, False),)
    return names
