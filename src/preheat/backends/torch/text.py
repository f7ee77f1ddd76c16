"""``TorchTextPipeline``: SD 1.x/2.x, SDXL, SD3, Flux and FLUX.1 Kontext folders through diffusers' own pipeline classes.

The same call API and argument checks as the JAX ``Pipeline`` (borrowed, not copied), the same
initial latents (``latents=``, drawn from the same per-image seeds by ``preheat.noise``) and the
same sampler mapping, so ``bench compare`` and the parity tests put both backends side by side.

``compile="inductor"`` wraps the denoiser (UNet or transformer) in ``torch.compile`` and warms
each model batch and latent size through preheat's torch compile cache (Mega-Cache artifacts and CPU kernels, under the
same entry rules as the JAX side). ``compile="regional"`` and ``"aot"`` apply
``preheat.torch.compile`` (the denoiser's repeated blocks: torch.compile'd, or an AOTInductor
package each, without weights; same cache) and warm it the same way.

Where the backends differ: a guidance scale below 1 is classifier-free guidance in preheat and
"no guidance" in diffusers (``guidance_scale > 1``); stochastic samplers draw their per-step
noise from a ``torch.Generator`` per image, not from JAX's keys.
"""

from __future__ import annotations

import inspect
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from preheat.backends.torch.calls import diffusers_calls, size_ids
from preheat.backends.torch.companions import refiner_kwargs, refiner_runs
from preheat.backends.torch.compile_cache import INDUCTOR_OPTIONS, TorchCompiler, torch_key_fields
from preheat.backends.torch.sampling import make_scheduler
from preheat.backends.torch.arguments import EngineArguments
from preheat.errors import InvalidArgumentError
from preheat.families.base import Request
from preheat.families.inputs import IMAGE_SIZE
from preheat.file_configs import GGUFSource
from preheat.families.guidance import guidance_rescale
from preheat.families.request import plan_inputs, scheduler_overrides
from preheat.families.components import FluxComponents, SD3Components, SDComponents, TextComponents
from preheat.noise import initial_noise
from preheat.samplers import SchedulerConfig
from preheat.timings import Timings

__all__ = ["TorchTextPipeline", "load_gguf_denoiser", "load_text", "TEXT_FAMILIES", "restore_text_model"]

# model_index.json's _class_name -> (families module, family object)
TEXT_FAMILIES = {
    "StableDiffusionPipeline": ("stable_diffusion", "SD"),
    "StableDiffusionXLPipeline": ("stable_diffusion", "SDXL"),
    "StableDiffusionImg2ImgPipeline": ("stable_diffusion", "SD"),
    "StableDiffusionInpaintPipeline": ("stable_diffusion", "SD"),
    "StableDiffusionXLImg2ImgPipeline": ("stable_diffusion", "SDXL"),
    "StableDiffusionXLInpaintPipeline": ("stable_diffusion", "SDXL"),
    "StableDiffusion3Pipeline": ("sd3", "SD3"),
    "FluxPipeline": ("flux", "FLUX"),
    "FluxKontextPipeline": ("kontext", "KONTEXT"),
    "FluxFillPipeline": ("fill", "FILL"),
}


@dataclass
class TorchTextPipeline(EngineArguments):
    """A diffusers text-to-image pipeline with preheat's call API. Build with :func:`load_text`."""

    pipe: Any  # diffusers StableDiffusionPipeline / StableDiffusionXLPipeline
    family: Any
    scheduler_config: SchedulerConfig
    scheduler_dict: dict[str, Any]
    sample_shape: tuple[int, ...]  # default latent (h, w, C)
    components: TextComponents  # vae_scale, size_multiple, the family's own (what the family's checks read)
    fingerprint: dict[str, Any]
    defaults: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    device: str = "cpu"
    compile: str = "none"
    compiler: TorchCompiler | None = None
    num_classes: int | None = None
    null_class: int | None = None
    labels: tuple[str, ...] = ()
    layout: str = "NCHW"
    last: Timings = field(default_factory=Timings)
    _warm: set = field(default_factory=set, repr=False)
    controlnet: Any = None  # diffusers ControlNetModel (controlnet=): the call runs its ControlNet pipeline
    refiner: Any = None  # diffusers StableDiffusionXLImg2ImgPipeline (refiner=): SDXL's ensemble of experts
    _image_pipes: dict = field(default_factory=dict, repr=False)  # (family, inpaint) -> diffusers pipeline

    def run(self, request: Request) -> np.ndarray:
        """Sample a validated request: uint8 pixels (n, H, W, C)."""
        v = request.values
        n = request.n
        self.last = Timings(cache_layer="memory")
        latent_shape = request.sample_shape
        nchw = (request.noise.transpose(0, 3, 1, 2) if request.noise is not None
                else initial_noise(request.seeds, latent_shape))
        latents = torch.from_numpy(np.ascontiguousarray(nchw, np.float32)).to(self.device, self.torch_dtype)
        kwargs: dict[str, Any] = dict(
            prompt=v["prompt"], **IMAGE_SIZE.inputs(IMAGE_SIZE.of(v)), num_inference_steps=request.steps,
            generator=[torch.Generator("cpu").manual_seed(int(s)) for s in request.seeds], output_type="np")
        if diffusers_calls(self.family.name).packed_latents:  # embedded guidance; FluxPipeline takes packed latents
            b, c, h, w = latents.shape
            kwargs.update(prompt_2=v["prompt_2"], guidance_scale=request.guidance,
                          latents=self.pipe._pack_latents(latents, b, c, h, w))
            if request.guided:  # true CFG (families.guidance): the negatives, combined at cfg_scale
                kwargs.update(negative_prompt=v["negative_prompt"], true_cfg_scale=request.cfg_scale)
            if v.get("reference_size") is not None:  # Kontext: diffusers resizes the reference itself;
                from PIL import Image  # the output is width x height exactly (max_area fits it)

                kwargs.update(image=Image.fromarray(v["image"]), _auto_resize=v["image_resize"] == "preferred",
                              max_area=math.prod(IMAGE_SIZE.of(v)))
        else:
            kwargs.update(negative_prompt=v["negative_prompt"], latents=latents,
                          guidance_scale=request.cfg_scale if request.guided else 1.0)
        if "eta" in inspect.signature(type(self.pipe).__call__).parameters:  # the flow pipelines take none
            kwargs["eta"] = request.eta
        kwargs.update(_second_encoder(v))
        if v.get("max_sequence_length") is not None:  # Flux's and SD3's T5 length: their pipelines' own keyword
            kwargs["max_sequence_length"] = v["max_sequence_length"]
        kwargs.update({k: list(t) for k, t in plan_inputs(self, request).items()})  # set_timesteps(timesteps=...)
        overrides = scheduler_overrides(self, request)  # a card's from_config(config, timestep_spacing=...)
        self.pipe.scheduler = make_scheduler(request.sampler, {**self.scheduler_dict, **overrides})
        # CFG's two branches are one batch of 2n; FLUX.1's true CFG calls the transformer twice with n
        doubled = request.guided and self.family.guidance_mode(self) == "cfg"
        pipe = self.pipe
        if self.controlnet is not None or self.refiner is not None:  # the JAX engine's window and handoff checks
            self.family.check_start(self, request)
        if self.controlnet is not None:  # diffusers' ControlNet pipeline of this call's kind
            from preheat.backends.torch.companions import control_kwargs, control_pipeline

            pipe = control_pipeline(self.pipe, self.family.name, v, self.controlnet, self._image_pipes)
        elif v.get("strength") is not None:  # diffusers' img2img / inpaint pipeline
            from preheat.backends.torch.image import image_pipeline

            pipe = image_pipeline(self.pipe, self.family.name, v.get("mask_image") is not None, self._image_pipes)
        if v.get("strength") is not None:  # the image (and mask) and strength, noised with the same ε
            from preheat.backends.torch.image import image_kwargs

            kwargs = image_kwargs(v, kwargs, self.family.name)
        if self.controlnet is not None:
            kwargs = control_kwargs(v, kwargs)
        _refuse_unread(pipe, plan_inputs(self, request))
        kwargs.update(_guidance_rescale(pipe, request))
        refiner_call = None
        if self.refiner is not None and refiner_runs(self, request):  # diffusers' ensemble of experts: the
            refiner_call = refiner_kwargs(v, kwargs)  # base's latents at denoising_end, then the refiner
            kwargs.update(denoising_end=float(v["denoising_end"]), output_type="latent")
            self.refiner.scheduler = make_scheduler(request.sampler, {**self.scheduler_dict, **overrides})
        timings = self._prepare_denoiser(n * (2 if doubled else 1), latent_shape, kwargs, pipe, refiner_call)
        events = self.compiler.events if self.compiler is not None else []
        seen = len(events)
        if v.get("strength") is not None:
            from preheat.backends.torch.image import same_noise

            same_noise(pipe.scheduler, latents)

        start = time.perf_counter()
        with torch.no_grad():
            images = pipe(**kwargs).images
            if refiner_call is not None:  # from the base's latents, no noise (denoising_start); the base's VAE decodes
                images = self.refiner(image=images, **refiner_call).images
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        timings.run_s = time.perf_counter() - start
        if len(events) > seen:  # regional / aot: the blocks were loaded or compiled inside this call
            timings = _loaded_in_call(events[seen:], timings.run_s)
        self.last = timings
        from preheat.backends.torch.image import pixels_of

        return pixels_of(images)

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    def _prepare_denoiser(self, model_batch: int, latent_shape: tuple[int, ...], call: dict[str, Any],
                          pipe: Any, refiner_call: dict[str, Any] | None = None) -> Timings:
        """Compile (or load from the cache) the denoiser for this model batch and latent size, with
        the models that run beside it: a ControlNet, a refiner's UNet when the call hands over
        (``refiner_call``: its keywords).

        The warm-up is the call's own pipeline (``pipe``: the text one, or an image call's img2img
        or inpaint one, a ControlNet's) for one step with this call's arguments, so whatever the denoiser (UNet,
        Flux or SD3 transformer, an inpainting UNet's 9 channels) it sees exactly the inputs serving
        will. An image call's step runs at strength 1 (below it, one step is int(1 x s) = 0 steps),
        without its crop (diffusers crops for PIL outputs only), and every warm-up draws from
        generators of its own. An ensemble's base step is followed by one refiner step on its latents.
        """
        key = (model_batch, tuple(latent_shape), refiner_call is not None)
        if self.compile == "none" or key in self._warm:
            return Timings(cache_layer="memory" if key in self._warm or self.compile != "none" else "none")
        denoisers = [self.pipe.unet if hasattr(self.pipe, "unet") else self.pipe.transformer]
        denoisers += [self.controlnet] if self.controlnet is not None else []
        denoisers += [self.refiner.unet] if refiner_call is not None else []
        if self.compile in ("regional", "aot"):
            return self._prepare_regional(denoisers, key, call)
        h, w, c = latent_shape
        fingerprint = {**self.fingerprint, "refiner_runs": True} if refiner_call is not None else self.fingerprint
        fields = torch_key_fields(fingerprint, mode="inductor", model_batch=model_batch, sample_chw=(c, h, w),
                                  class_conditional=False, dtype=self.dtype, device=self.device)
        if self.compiler is not None and self.compiler.explains:
            self.compiler.explain(fields)  # compile nothing; this call runs eagerly
            self._warm.add(key)
            return Timings(cache_layer="explain")
        for denoiser in denoisers:
            if not getattr(denoiser, "_preheat_compiled", False):
                try:
                    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
                except AttributeError:  # pragma: no cover - older torch
                    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
                compiled = torch.compile(denoiser.forward, **INDUCTOR_OPTIONS)
                denoiser.forward = _scale_as_tensor(compiled) if denoiser is self.controlnet else compiled
                denoiser._preheat_compiled = True

        def one_step(keywords: dict[str, Any]) -> dict[str, Any]:
            once = {**keywords, "num_inference_steps": 1, "output_type": "latent"}
            # generators of its own: the call's draw its posterior sample and step noise, so they stay unadvanced
            once["generator"] = [torch.Generator("cpu").manual_seed(0) for _ in keywords["generator"]]
            once.pop("padding_mask_crop", None)
            once.pop("denoising_end", None)  # one step: the base's, whatever the fraction
            if "strength" in once:
                once["strength"] = 1.0
            return once

        def warm_up() -> None:
            with torch.no_grad():
                latents = pipe(**one_step(call)).images
                if refiner_call is not None:  # img2img on the base's latents, one step at strength 1
                    own = one_step(refiner_call)
                    own.pop("denoising_start")
                    self.refiner(image=latents, strength=1.0, **own)

        timings = (self.compiler or TorchCompiler(mode="off")).warm_inductor(fields, warm_up)
        self._warm.add(key)
        return timings

    def _prepare_regional(self, denoisers: list[Any], key: tuple, call: dict[str, Any]) -> Timings:
        """``preheat.torch.compile(mode="regional" | "aot")`` on each denoiser. No warm-up run of
        its own: the blocks are loaded or compiled (and stored) by their first call, inside this
        call, whose timings ``generate`` then splits (a separate one-step warm-up would add a
        text encoding and a denoiser step to every start)."""
        from preheat.backends.torch.compiled import compile_with

        for denoiser in denoisers:
            compile_with(denoiser, self.compile, False, self.compiler or TorchCompiler(mode="off"))
        self._warm.add(key)
        return Timings(cache_layer="memory")


def _scale_as_tensor(forward: Any) -> Any:
    """A compiled ControlNet forward taking diffusers' ``conditioning_scale`` float as a 0-d tensor:
    data to the graph, where a float is specialised, and every scale (and the 0 outside the step
    window) would compile a graph of its own."""
    def call(*args: Any, conditioning_scale: Any = 1.0, **kwargs: Any) -> Any:
        sample = args[0] if args else kwargs["sample"]
        scale = torch.as_tensor(conditioning_scale, dtype=torch.float32, device=sample.device)
        return forward(*args, conditioning_scale=scale, **kwargs)

    return call


def restore_text_model(pipe: Any) -> None:
    """Let diffusers' SD ``clip_skip`` run on transformers >= 5.6.

    transformers 5.6 flattened ``CLIPTextModel`` (no ``text_model`` submodule), but diffusers' SD
    ``encode_prompt`` still reads ``text_encoder.text_model.final_layer_norm`` when clip_skip is
    set (diffusers#14124, open). Point the old name at the model itself -- the same final norm --
    outside torch's module registry, so nothing else (state dict, ``.to``) sees it.
    """
    encoder = getattr(pipe, "text_encoder", None)
    if encoder is not None and not hasattr(encoder, "text_model") and hasattr(encoder, "final_layer_norm"):
        object.__setattr__(encoder, "text_model", encoder)


def _second_encoder(v: dict[str, Any]) -> dict[str, Any]:
    """SD/SDXL's clip_skip, the later encoders' prompts (SDXL's, SD3's, FLUX.1's T5) and SDXL's size
    ids, as diffusers' keywords."""
    kwargs: dict[str, Any] = {}
    if "negative_prompt_2" in v:  # SDXL's second encoder, FLUX.1's T5 (its prompt_2 is passed with its guidance)
        kwargs.update(prompt_2=v["prompt_2"], negative_prompt_2=v["negative_prompt_2"])
    if "negative_prompt_3" in v:  # SD3's T5
        kwargs.update(prompt_3=v["prompt_3"], negative_prompt_3=v["negative_prompt_3"])
    if v.get("negative_time_ids") is not None and len(v["prompt"]) > 1 and v.get("image") is None:
        # diffusers' text-to-image pipeline repeats cat([negative ids, ids]) per image, against embeddings
        # laid out as all negatives then all prompts: with two or more images it pairs the ids with the
        # wrong branch (its img2img and inpaint pipelines, a refiner's, repeat each before the cat)
        raise InvalidArgumentError("the torch backend takes negative_original_size / negative_target_size for one "
                                   "image per call (diffusers pairs them with the wrong images for n > 1)",
                                   argument="negative_original_size")
    kwargs.update(size_ids(v, "time_ids", "negative_time_ids"))
    skips = set(v.get("clip_skip") or ())
    if len(skips) > 1:
        raise InvalidArgumentError("the torch backend takes one clip_skip per call (diffusers' pipeline does)",
                                   argument="clip_skip")
    if skips and skips != {0}:  # 0 is diffusers' default embedding: leave the keyword out
        kwargs["clip_skip"] = skips.pop()
    return kwargs


def _refuse_unread(pipe: Any, planned: dict[str, Any]) -> None:
    """A call's custom schedule (``plan_inputs``: ``timesteps=`` / ``sigmas=``) on a diffusers pipeline
    whose call takes no such keyword (its ControlNet img2img and inpaint pipelines) is one line,
    not a schedule diffusers drops."""
    params = inspect.signature(type(pipe).__call__).parameters
    for name in planned:
        if name not in params:
            raise InvalidArgumentError(f"the torch backend cannot run this call's custom {name}: diffusers' "
                                       f"{type(pipe).__name__} takes none (the JAX engine does)", argument=name)


def _guidance_rescale(pipe: Any, request: Request) -> dict[str, Any]:
    """A guided call's ``guidance_rescale`` (``preheat.families.guidance``) as diffusers' keyword;
    none at 0 (its default). A pipeline class whose call takes no such keyword (diffusers' SD 1.x / 2.x
    img2img and inpaint pipelines) refuses it in one line rather than drop it."""
    rescale = guidance_rescale(request)
    if rescale is None or rescale == 0:
        return {}
    if "guidance_rescale" not in inspect.signature(type(pipe).__call__).parameters:
        raise InvalidArgumentError(f"the torch backend cannot apply guidance_rescale to this call: diffusers' "
                                   f"{type(pipe).__name__} takes none (the JAX engine does)",
                                   argument="guidance_rescale")
    return {"guidance_rescale": float(rescale)}


def _loaded_in_call(events: list[dict[str, Any]], elapsed: float) -> Timings:
    """A call's Timings when blocks were loaded or compiled inside it (one event per block kind
    or signature): their trace and compile/load seconds summed, the rest of the call as run_s."""
    trace = sum(float(e.get("trace_lower_s") or 0.0) for e in events)
    compile_s = sum(float(e.get("compile_or_load_s") or 0.0) for e in events)
    layers = {str(e.get("layer")) for e in events}
    layer = "none" if "none" in layers else sorted(layers)[0]  # the coldest, as Timings keeps it
    return Timings(trace_lower_s=trace, compile_s=compile_s, cache_layer=layer, run_s=max(elapsed - trace - compile_s, 0.0))


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _denoiser_name(root: Path) -> str:
    """The pipeline's denoiser component: ``transformer`` (SD3, Flux) or ``unet`` (SD, SDXL)."""
    return "transformer" if "transformer" in json.loads((root / "model_index.json").read_text()) else "unet"


def load_gguf_denoiser(source: GGUFSource, dtype: str) -> Any:
    """The denoiser of a GGUF file as diffusers users load it: its class's ``from_single_file``
    with ``GGUFQuantizationConfig(compute_dtype=dtype)`` and the config folder's config (the
    weights stay quantised; each Linear dequantises in ``dtype`` where it is used). A file whose
    tensors do not fit that config is one line naming both."""
    import diffusers
    from diffusers import GGUFQuantizationConfig

    from preheat.errors import CheckpointMismatchError

    name = _denoiser_name(source.configs)
    cls = getattr(diffusers, json.loads((source.configs / name / "config.json").read_text())["_class_name"])
    try:
        return cls.from_single_file(str(source.file), config=str(source.configs), subfolder=name,
                                    quantization_config=GGUFQuantizationConfig(compute_dtype=_TORCH_DTYPES[dtype]),
                                    torch_dtype=_TORCH_DTYPES[dtype])
    except (ValueError, RuntimeError, KeyError) as exc:  # a shape, a missing or an extra tensor
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointMismatchError(f"GGUF file {source.file} does not fit the {name} config of {source.configs}: "
                                      f"{reason}") from None


def load_text(root: Path, class_name: str, *, compile: str, dtype: str, device: str, scheduler: Any,
              compiler: TorchCompiler | None, variant: str | None, denoiser: Any = None, controlnet: Any = None,
              refiner: Any = None) -> TorchTextPipeline:
    """A diffusers SD/SDXL/SD3/Flux pipeline for ``root`` with preheat's checks and defaults;
    ``denoiser`` (a GGUF file's, ``load_gguf_denoiser``) replaces the folder's UNet or transformer;
    ``controlnet``, ``refiner``: second model folders (``preheat.backends.torch.companions``)."""
    from preheat.backends.torch.companions import check_companions, load_controlnet, load_refiner

    import importlib

    from diffusers import DiffusionPipeline

    from preheat.families.text import load_scheduler

    module, name = TEXT_FAMILIES[class_name]
    index = json.loads((root / "model_index.json").read_text())
    own_refiner = class_name.startswith("StableDiffusionXL") and bool(index.get("requires_aesthetics_score"))
    if own_refiner:
        name = "SDXL_REFINER"  # an SDXL refiner: its pipelines' aesthetic-score ids (as the JAX loader)
    family = getattr(importlib.import_module(f"preheat.families.{module}"), name)
    check_companions(family, root, controlnet, refiner)

    kwargs: dict[str, Any] = {"torch_dtype": _TORCH_DTYPES[dtype]}
    if denoiser is not None:
        kwargs[_denoiser_name(root)] = denoiser
    if variant:
        kwargs["variant"] = variant
    kwargs.update({k: None for k, v in index.items() if v == [None, None]})  # e.g. SD3 saved without its T5
    if class_name.startswith("StableDiffusionXL"):
        kwargs["add_watermarker"] = False
    elif diffusers_calls(family.name).safety_checker:
        kwargs.update(safety_checker=None, requires_safety_checker=False)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    # preheat reports its own phases: no "Loading pipeline components" / "Loading weights" bars
    quiet = [lib for lib in (diffusers_logging, transformers_logging) if lib.is_progress_bar_enabled()]
    for lib in quiet:
        lib.disable_progress_bar()
    try:
        pipe = DiffusionPipeline.from_pretrained(str(root), **kwargs).to(device)
    finally:
        for lib in quiet:
            lib.enable_progress_bar()
    if class_name.endswith("Img2ImgPipeline") and not own_refiner:  # text-to-image calls run the text
        # pipeline (image_pipeline the rest); a refiner takes an image always, and keeps its config's aesthetic ids
        import diffusers

        pipe = getattr(diffusers, class_name.replace("Img2Img", "")).from_pipe(pipe)
    pipe.set_progress_bar_config(disable=True)
    restore_text_model(pipe)
    sched_source = scheduler if scheduler is not None else root / "scheduler"
    sched, defaults = load_scheduler(root, family, scheduler)
    sched_dict = dict(scheduler) if isinstance(scheduler, dict) else json.loads(
        (Path(sched_source) / "scheduler_config.json" if Path(sched_source).is_dir() else Path(sched_source)).read_text())
    denoiser = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
    cfg = denoiser.config
    vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    components: TextComponents
    channels, size = cfg.in_channels, cfg.get("sample_size")
    if class_name.startswith("Flux"):  # as the JAX loader: packed 2x2 tokens out (Fill takes more in), 128-latent side
        channels, size = (cfg.out_channels or cfg.in_channels) // 4, 128
        components = FluxComponents(vae_scale=vae_scale, size_multiple=2 * vae_scale,
                                    guidance_embeds=bool(cfg.guidance_embeds))
        defaults.update(family.model_defaults(bool(cfg.guidance_embeds)))
    elif class_name == "StableDiffusion3Pipeline":
        components = SD3Components(vae_scale=vae_scale, size_multiple=vae_scale * cfg.patch_size,
                                   patch_size=cfg.patch_size)
    else:  # SD / SDXL: what the family's clip_skip and negative_prompt_2 checks read, as the JAX loader's
        encoders = [e for e in (pipe.text_encoder, getattr(pipe, "text_encoder_2", None)) if e is not None]
        inpaint = channels == 2 * pipe.vae.config.latent_channels + 1
        control = expert = None  # the second model folders: diffusers' models, and what the family's checks read
        if controlnet is not None:
            control = load_controlnet(controlnet, root, family, inpaint, vae_scale, _TORCH_DTYPES[dtype], variant)
        if refiner is not None:
            expert = load_refiner(refiner, pipe, family, inpaint, control is not None, scheduler, sched,
                                  _TORCH_DTYPES[dtype], variant)
        components = SDComponents(vae_scale=vae_scale, size_multiple=vae_scale,
                                  clip_layers=min(e.config.num_hidden_layers for e in encoders),
                                  force_zeros=bool(pipe.config.get("force_zeros_for_empty_prompt", True)),
                                  inpaint=inpaint, controlnet=None if control is None else control[1],
                                  refiner=None if expert is None else expert[1])
        channels = pipe.vae.config.latent_channels  # an inpainting UNet's extra channels are the mask's
    latent = (size, size) if isinstance(size, int) else tuple(size)
    architecture = {k: v for k, v in dict(cfg).items() if not k.startswith("_")}
    identity: dict[str, Any] = {"kind": f"diffusers.{type(denoiser).__name__}", "config": architecture}
    extra: dict[str, Any] = {}
    if controlnet is not None:  # the models beside the denoiser: their architectures in the compile key
        model = extra["controlnet"] = control[0].to(device)
        identity["controlnet"] = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    if refiner is not None:
        extra["refiner"] = expert[0].to(device)
        restore_text_model(extra["refiner"])
        identity["refiner"] = {k: v for k, v in dict(extra["refiner"].unet.config).items() if not k.startswith("_")}
    fingerprint = json.loads(json.dumps(identity, default=str))
    return TorchTextPipeline(
        pipe=pipe, family=family, scheduler_config=sched, scheduler_dict=sched_dict,
        sample_shape=(int(latent[0]), int(latent[1]), channels), components=components,
        fingerprint=fingerprint, defaults=defaults, dtype=dtype, device=device, compile=compile, compiler=compiler,
        **extra)
