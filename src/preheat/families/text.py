"""What the text-to-image families share: prompt and size checks, the folder's own default
sampler, component folders, and the VAE decode stage.

Kept apart from any one family so that Stable Diffusion, SDXL, SD3 and Flux validate a prompt, a
width or a missing ``text_encoder_2/`` with the same words.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from dataclasses import dataclass, replace

import numpy as np

from preheat import platforms
from preheat.errors import ModelNotFoundError, SchedulerConfigError
from preheat.families.base import EngineView, Family, Request, StageSignature, to_pixels
from preheat.families.image import pasted_back
from preheat.families.inputs import InputSpec, Int, Text
from preheat.families.stages import DecodeArgs, EncodeArgs, LoraArgs, Stage
from preheat.samplers import (DIFFUSERS_CLASS, DPM_FIXED_SETTINGS, SchedulerConfig, load_scheduler_config,
                              samplers_of_kind)

__all__ = ["TextToImageFamily", "SAMPLER_OF_SCHEDULER", "PROMPT", "NEGATIVE_PROMPT", "max_sequence_length_spec", "fill_later_prompts",
           "component", "default_sampler", "load_scheduler", "folder_sampler", "decode_program", "encode", "offload"]

log = logging.getLogger("preheat.families")

@dataclass(frozen=True)
class TextToImageFamily(Family):
    """A latent text-to-image family: a VAE decode stage after the loop, sizes in pixels.

    ``components`` is a ``preheat.families.components.TextComponents`` (its ``vae``, ``vae_scale``
    (pixels per latent), ``size_multiple`` and ``decode_fingerprint`` are read here).
    """

    positional: str | None = "prompt"
    preview_n: int = 1
    pixels_in_loop: bool = False
    max_size: int = 2048
    loader_takes: frozenset[str] = frozenset({"offload_encoders"})  # the text encoders' weights in host memory

    def native_size(self, pipe: EngineView) -> tuple[int, int]:
        scale = pipe.components.vae_scale
        return pipe.sample_shape[1] * scale, pipe.sample_shape[0] * scale

    def size_rule(self, pipe: EngineView) -> tuple[int, int, bool]:
        return pipe.components.size_multiple, self.max_size, False

    def sample_shape(self, pipe: EngineView, values: dict[str, Any]) -> tuple[int, ...]:
        scale = pipe.components.vae_scale
        return (values["height"] // scale, values["width"] // scale, pipe.sample_shape[2])

    def finish(self, pipe: EngineView, request: Request, out: Any) -> np.ndarray:
        """Decoded pixels; a padding_mask_crop call's pasted back into its image, host side."""
        return pasted_back(np.asarray(out), request.values)

    def decode(self, pipe: EngineView, request: Request, latents: Any) -> Stage:
        vae = pipe.components.vae
        sig = StageSignature("decode", batch=request.n, shape=tuple(request.sample_shape), dtype=str(vae.dtype))
        return Stage("decode", pipe.components.decode_fingerprint, sig, lambda: decode_program(vae),
                     DecodeArgs(params=vae.params, latents=latents))


# The folder's scheduler class -> the sampler a diffusers pipeline would run by default.
SAMPLER_OF_SCHEDULER = {
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler_a",
    "DDIMScheduler": "ddim",
    "DDPMScheduler": "ddpm",
    "HeunDiscreteScheduler": "heun",
    "DPMSolverMultistepScheduler": "dpmpp_2m",
    "LCMScheduler": "lcm",
    "TCDScheduler": "tcd",
    "UniPCMultistepScheduler": "unipc",
    "PNDMScheduler": "pndm",  # with skip_prk_steps=True (folder_sampler refuses the Runge-Kutta warm-up)
    "DEISMultistepScheduler": "deis",
    "LMSDiscreteScheduler": "lms",
    "KDPM2DiscreteScheduler": "dpm2",
    "KDPM2AncestralDiscreteScheduler": "dpm2_a",
    "DPMSolverSDEScheduler": "dpmpp_sde",
    "DPMSolverSinglestepScheduler": "dpmpp_2s",
    "FlowMatchEulerDiscreteScheduler": "flow_euler",
    "FlowMatchHeunDiscreteScheduler": "flow_heun",
    "EDMEulerScheduler": "edm_euler",
    "EDMDPMSolverMultistepScheduler": "edm_dpmpp_2m",
}


# warm: the words are data (tokenizers pad to fixed lengths); a negative prompt given or not are two
# programs for SDXL (zeros or the encoded negatives), so warm-up compiles both
PROMPT = InputSpec("prompt", Text(), "What to draw: one prompt for all images, or one per image.", per_image=True,
                   required=True, warm=("",), example="a watercolor fox")
NEGATIVE_PROMPT = InputSpec("negative_prompt", Text(), "What to steer away from (needs guidance).", per_image=True,
                            needs_guidance=True, warm=(None, ""))


def fill_later_prompts(values: dict[str, Any], pairs: Sequence[tuple[str, str]]) -> None:
    """diffusers' ``prompt_2 = prompt_2 or prompt`` for each (later encoder's input, the input it falls
    back to) of ``pairs``: an absent or all-empty later prompt takes the other's value, in place."""
    for later, first in pairs:
        if later in values and (values[later] is None or all(p == "" for p in values[later])):
            values[later] = values[first]


def max_sequence_length_spec(default: int) -> InputSpec:
    """diffusers' ``max_sequence_length`` for a T5 encoder's prompt (Flux, SD3): tokens per prompt,
    </s> included, at most 512 as its pipelines check. Static: the text context's length selects the
    encode and denoise programs, so a server serves its default only (``server.inputs``)."""
    return InputSpec("max_sequence_length", Int(1, 512), "T5 tokens per prompt, </s> included (the pipeline's "
                     "default when absent: FLUX.1 512, SD3 256); a longer prompt is truncated with a warning.",
                     static=True, default=default)


def component(root: Path, index: dict[str, Any], name: str) -> Path:
    """A pipeline folder's ``name/`` component, or a one-line error listing what the index has."""
    folder = root / name
    if name not in index or not folder.is_dir():
        raise ModelNotFoundError(f"{root} has no {name}/ folder (model_index.json lists "
                                 f"{', '.join(k for k in index if not k.startswith('_')) or 'nothing'})")
    return folder


# The DPM-Solver settings whose folder value must be one a dpm++ sampler of its class fixes
# (DPM_FIXED_SETTINGS); the rest (lower_order_final, ...) the sampler's name sets whatever the folder says
_DPM_CHECKED = ("algorithm_type", "solver_type", "solver_order")
# EDMDPMSolverMultistepScheduler's (its other keys are read from the config by the sampler itself)
SAMPLER_OF_EDM_DPM_ALGORITHM = {"dpmsolver++": "edm_dpmpp_2m", "sde-dpmsolver++": "edm_dpmpp_2m_sde",
                                "deis": "edm_dpmpp_2m"}  # the class registers "deis" as dpmsolver++


def folder_sampler(raw: Mapping[str, Any]) -> str | None:
    """The sampler that reproduces a ``scheduler_config.json`` as diffusers' pipeline runs it; None
    for a class we do not implement. Settings of an implemented class that we do not reproduce
    (DPM-Solver's ``algorithm_type="sde-dpmsolver"``, ``solver_type="heun"``, PNDM's Runge-Kutta
    warm-up) are a one-line ``SchedulerConfigError`` naming the key."""
    class_name = str(raw.get("_class_name"))
    sampler = SAMPLER_OF_SCHEDULER.get(class_name)
    if sampler in DPM_FIXED_SETTINGS:
        sampler = _dpm_sampler(raw, class_name, sampler)
    if sampler == "edm_dpmpp_2m":
        algorithm = raw.get("algorithm_type", "dpmsolver++")
        if algorithm not in SAMPLER_OF_EDM_DPM_ALGORITHM:
            raise SchedulerConfigError(f"algorithm_type={algorithm!r} is not supported for "
                                       "EDMDPMSolverMultistepScheduler; supported: 'dpmsolver++', 'sde-dpmsolver++'")
        sampler = SAMPLER_OF_EDM_DPM_ALGORITHM[algorithm]
    if sampler == "pndm" and not raw.get("skip_prk_steps", False):  # PNDMScheduler's default is False
        raise SchedulerConfigError("skip_prk_steps=False (PNDM's Runge-Kutta warm-up) is not supported for "
                                   "PNDMScheduler; only skip_prk_steps=True (PLMS, sampler 'pndm') is")
    return sampler


def _dpm_sampler(raw: Mapping[str, Any], class_name: str, plain: str) -> str:
    """The dpm++ sampler of ``class_name`` for the folder's ``algorithm_type`` and ``use_karras_sigmas``;
    ``plain`` is the class's default config's, so an absent key reads as its value there."""
    names = [s for s in DPM_FIXED_SETTINGS if DIFFUSERS_CLASS[s] == class_name]
    folder = {key: raw.get(key, value) for key, value in DPM_FIXED_SETTINGS[plain].items()}
    for key in _DPM_CHECKED:
        supported = tuple(dict.fromkeys(DPM_FIXED_SETTINGS[s][key] for s in names))
        if folder[key] not in supported:
            raise SchedulerConfigError(f"{key}={folder[key]!r} is not supported for {class_name}; "
                                       f"supported: {', '.join(map(repr, supported))}")
    return next(s for s in names if DPM_FIXED_SETTINGS[s]["algorithm_type"] == folder["algorithm_type"]
                and DPM_FIXED_SETTINGS[s]["use_karras_sigmas"] == bool(folder["use_karras_sigmas"]))


def load_scheduler(root: Path, family: Family, scheduler: Any = None,
                   index: Mapping[str, Any] | None = None) -> tuple[SchedulerConfig, dict[str, Any]]:
    """A text-to-image load's scheduler config and its defaults (``default_sampler``), the folder's
    ``scheduler_config.json`` parsed once.

    The config is ``scheduler`` (a SchedulerConfig, dict, file or folder) when given, else the
    folder's ``scheduler/`` (checked against ``index``, its model_index.json, when given); the
    default sampler is the folder's own scheduler's either way.
    """
    if scheduler is not None:
        return load_scheduler_config(scheduler), default_sampler(root, family)
    config = load_scheduler_config(component(root, index, "scheduler") if index is not None else root / "scheduler")
    return config, default_sampler(root, family, config)


def default_sampler(root: Path, family: Family, config: SchedulerConfig | None = None) -> dict[str, Any]:
    """The sampler diffusers would run for this folder's scheduler (the family's default otherwise).

    A scheduler we do not reproduce -- an unknown class, or settings ``folder_sampler`` refuses --
    falls back to the family's default with one warning naming it, since the images will differ
    from the diffusers pipeline the folder was saved with. ``config``: the folder's
    ``scheduler/`` as the load parsed it (``load_scheduler``), else it is parsed here.
    """
    from preheat.models.safetensors_files import read_json

    path = root / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        return {}
    raw = read_json(path, "scheduler config")  # folder_sampler reads keys no SchedulerConfig keeps (algorithm_type)
    instead = family.defaults.get("sampler")
    fallback: dict[str, Any] = {}
    try:  # a default of the config's kind (an EDM folder falls back to edm_euler, not to the family's euler)
        fits = samplers_of_kind(config if config is not None else SchedulerConfig.from_dict(raw))
        if instead not in fits:
            instead = next((s for s in family.samplers if s in fits), instead)
            fallback = {"sampler": instead}
    except SchedulerConfigError:
        pass  # the load names what is wrong with the config
    try:
        sampler = folder_sampler(raw)
    except SchedulerConfigError as e:
        log.warning("%s: %s; using sampler %r instead", root, e, instead)
        return fallback
    if sampler is None:
        log.warning("%s: scheduler %s is not implemented; using sampler %r instead", root,
                    raw.get("_class_name", "(no _class_name)"), instead)
        return fallback
    return {"sampler": sampler}


def decode_program(vae: Any) -> Any:
    """``DecodeArgs``: latents (B, h, w, C) float32 -> uint8 pixels (B, H, W, 3), through the VAE's
    own scaling/shift."""
    def program(args: DecodeArgs) -> Any:
        return to_pixels(vae.latents_to_images(args.params, args.latents.astype(vae.dtype)).astype("float32"))

    return program


def encode(components: Any, dtype: str, texts: Sequence[Sequence[str]], program: Callable[[], Callable],
           outputs: int, extra: tuple[tuple[str, Any], ...] = (), lora: tuple[Any, Any, Any] | None = None,
           clip_skip: np.ndarray | None = None, lengths: Sequence[int | None] = ()) -> Stage:
    """Tokenize on the host (``texts[i]`` for the i-th tokenizer): the encode stage of ``components``
    (a model's text encoders, or an SDXL refiner's own), described, not run.

    The stage's executable is chosen by the batch and every tokenizer's padded length, so a new
    prompt is data; the encoders' weights are arguments (``components.text_encoders``; an
    absent encoder, like SD3 without T5, is None and gets no weights).

        texts: one list of B strings per tokenizer; program: () -> fn(EncodeArgs)

    ``lora``: (per-encoder (factors, scales) or None, each text's slot (B,), the signature's
    (bucket, slots)) for text-encoder LoRAs: the program's ``args.lora`` then holds a ``LoraArgs``
    per encoder (``preheat.lora.encoder_adapters``). ``clip_skip``: (B,) int32, SD's. ``lengths``:
    the i-th tokenizer's padded length for this call where not None (a T5 prompt's
    ``max_sequence_length``; the tokenizer's own otherwise).
    """
    tokenizers = [tok if length is None else replace(tok, max_length=length)
                  for tok, length in zip(components.tokenizers, [*lengths, *[None] * len(texts)])]
    ids = tuple(tok.encode(list(t)) for tok, t in zip(tokenizers, texts))  # each (B, L_i) int32
    # with offload_encoders the weights are host arrays: they reach the device for this call only
    params = tuple(te.params if te is not None else None for te in components.text_encoders)
    args = EncodeArgs(params=params, ids=ids, clip_skip=clip_skip)
    if lora is not None:
        adapters, index, lora_sig = lora
        extra = (*extra, ("lora", (*lora_sig, tuple(a is not None for a in adapters))))
        args = args._replace(lora=tuple(None if a is None else LoraArgs(factors=a[0], scales=a[1], slots=index)
                                        for a in adapters))
    on_host = components.encoders_on == "host"
    if on_host:
        extra, args = (*extra, *platforms.host_fields()), _on_host(args)
    elif components.offload_encoders and (kind := platforms.offload_memory()):
        # the executable reads its weights from host memory (a program of its own: in the key)
        extra, args = (*extra, ("weights_memory", kind)), args._replace(params=_in_memory(args.params, kind))
        program = _from_host(program)
    sig = StageSignature("encode", batch=len(texts[0]), shape=tuple(i.shape[1] for i in ids), dtype=dtype,
                         extra=extra)
    return Stage("encode", components.encode_fingerprint, sig, program, args, outputs, on_host=on_host)


def _on_host(args: EncodeArgs) -> EncodeArgs:
    """``encoders_on="host"``: the encode stage's arguments on the host's CPU, beside its weights
    (already there: no copy). Its signature names the CPU (``platforms.host_fields``), so its
    executable is the host's in memory and in the cache; the engine traces and runs it there
    (``Stage.on_host``) and hands its embeddings (a few MB) back as host arrays, which the denoising
    program's arguments move to the chip once per call, before its loop. A prefetch's placeholders
    (``jax.ShapeDtypeStruct``) are placed on the host too, so a prefetched executable is the host's."""
    import jax

    host = platforms.host_device()
    on = jax.sharding.SingleDeviceSharding(host)

    def placed(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on)
        return jax.device_put(x, host) if isinstance(x, (np.ndarray, jax.Array)) else x

    return jax.tree.map(placed, args)


def _in_memory(params: Any, kind: str) -> Any:
    """Offloaded encoders' weights as the encode program takes them: in ``kind`` memory (``offload``
    put them there once read); a prefetch's placeholders (``jax.ShapeDtypeStruct``) placed there too,
    so a prefetched executable reads host memory as the loaded weights will be, and a weight a
    prefetch's rehearsal meets already read but not yet moved (``offload`` moves an encoder's
    weights once all are read) moved now."""
    import jax

    from preheat.models.block_paths import is_stacked_path
    from preheat.models.storage import offloaded_leaf

    def placed(path: Any, x: Any) -> Any:
        if not isinstance(x, (jax.ShapeDtypeStruct, jax.Array)):
            return x
        if not offloaded_leaf(len(x.shape) - is_stacked_path(path)):  # a vector: kept on the device
            return x
        if isinstance(x, jax.Array):
            return x if x.sharding.memory_kind == kind else jax.device_put(x, x.sharding.with_memory_kind(kind))
        sharding = x.sharding if x.sharding is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.with_memory_kind(kind))

    return jax.tree_util.tree_map_with_path(placed, params)


def _from_host(program: Callable[[], Callable]) -> Callable[[], Callable]:
    """The encode program, traced as one whose weights are in host memory (``storage.weights_from_host``)."""
    from preheat.models.storage import weights_from_host

    def make() -> Callable:
        run = program()

        def streamed(args: EncodeArgs) -> Any:
            with weights_from_host():
                return run(args)

        return streamed

    return make


def offload(encoder: Any, options: Any = None) -> Any:
    """``offload_encoders``: keep an encoder's weights in host memory, so that the device holds
    them only while the encode stage runs (FLUX.1's T5-XXL beside its transformer on a 16 GB TPU
    chip; GPUs that cannot hold encoders and denoiser). Where the device has pinned host memory
    (``platforms.offload_memory``) the weights stay device arrays of that memory kind, and the encode
    program moves each in where it is used (``storage.upcast``): a scanned stack's a block at a time
    (T5-XXL: 0.36 GiB of its 8.9 at once in bfloat16), at the device's DMA rate; elsewhere they are
    numpy arrays, moved in whole for each call. Each weight is moved once it is read
    (``weights.after_reads``: at once, or after the deferred reads of ``preheat.load(prefetch=...)``:
    ``options``, a ``weights.LoadOptions``), in place, so the encoder keeps its State."""
    import jax
    from flax import nnx

    from preheat.models.block_paths import is_stacked_path
    from preheat.models.storage import offloaded_leaf
    from preheat.models.weights import after_reads

    def to_host() -> None:
        flat = nnx.to_flat_state(encoder.params)
        first = next((v.get_value() for _, v in flat if isinstance(v.get_value(), jax.Array)), None)
        kind = None if first is None else platforms.offload_memory(next(iter(first.devices())))
        for path, var in flat:
            value = var.get_value()
            if not kind or not isinstance(value, jax.Array):
                var.set_value(jax.device_get(value))
            elif offloaded_leaf(value.ndim - is_stacked_path(path)):  # a vector stays: storage.offloaded_leaf
                var.set_value(jax.device_put(value, value.sharding.with_memory_kind(kind)))

    after_reads(to_host, options)
    return encoder


def on_host(encoder: Any, options: Any = None) -> Any:
    """``encoders_on="host"``: an encoder loaded with ``options.device`` the host's CPU (its weights
    read straight into host memory, never onto the chip), each weight then committed there once it
    is read (``weights.after_reads``), so that the encode stage runs there too."""
    import jax
    from flax import nnx

    from preheat.models.weights import after_reads

    def commit() -> None:
        for _, var in nnx.to_flat_state(encoder.params):
            var.set_value(jax.device_put(var.get_value(), options.device))

    after_reads(commit, options)
    return encoder
