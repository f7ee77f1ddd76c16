"""The compiled stages' arguments, by name: what the engine passes each program, and what is split.

Each stage's program takes one argument, a NamedTuple below (a pytree, so ``jit``, ``shard_map``
and the compile cache see its leaves as before). Its ``BATCHED`` names the fields batched on axis
0 -- split over the devices' ``data`` axis on a mesh (``preheat.sharding.batch_specs``), padded
with the batch -- and every other field is replicated (weights: kept where ``sharding.distribute``
put them). A field that is itself such a NamedTuple (``LoraArgs``) declares its own. Inside a
batched field only arrays of rank >= 1 are split: a ``Start``'s step index and flag stay whole.

    stage         argument        batched (split over devices)         replicated
    ------------  --------------  -----------------------------------  -------------------------
    encode        EncodeArgs      ids, clip_skip, lora.slots           params, lora.factors/scales
    denoise       DenoiseArgs     seeds, cond, uncond, noise, start,   params, plan, guidance,
                                  lora.slots                           guidance_rescale,
                                                                       lora.factors/scales
    decode        DecodeArgs      latents                              params
    encode_image  EncodeImageArgs images, seeds                        params, index

A new argument is a new field with a default: no other stage's call changes.

A family never runs a stage: its hooks return a ``Stage`` (what to compile and with which
argument) or a ``Staged`` value (stages, and how their outputs become the value), and the engine
runs them (``Pipeline.execute_stage``), or only describes them to learn every key up front.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

__all__ = ["LoraArgs", "EncodeArgs", "DenoiseArgs", "DecodeArgs", "EncodeImageArgs", "Stage", "Staged", "joined"]


class Stage(NamedTuple):
    """One compiled program of a call, described, not run: its key is ``(fingerprint, sig, args)``."""

    name: str  # "encode", "encode_image", "denoise", "decode": where its timings are recorded
    fingerprint: dict[str, Any]  # the component's identity (architecture, never weights)
    sig: Any  # what selects the program: a StageSignature (engine.Signature for denoise)
    program: Callable[[], Callable[[Any], Any]]  # () -> fn(args), built only on a miss
    args: Any  # the program's one argument, a NamedTuple of this module
    outputs: int = 1  # 1: the program returns an array; k: a k-tuple of arrays
    on_host: bool = False  # the host CPU's program on host arguments (encoders_on="host"): never on a mesh


class Staged(NamedTuple):
    """A value that needs stages run first: ``then(outputs)`` makes it from their outputs, in order
    (host-side, pure). What a family's ``condition`` and ``image_start`` return."""

    stages: tuple[Stage, ...]
    then: Callable[[Sequence[Any]], Any]

    @staticmethod
    def ready(value: Any) -> "Staged":
        """A value that needs no stage."""
        return Staged((), lambda _: value)

    @staticmethod
    def of(stage: Stage, then: Callable[[Any], Any] = lambda out: out) -> "Staged":
        """``then(the stage's output)``."""
        return Staged((stage,), lambda outs: then(outs[0]))


def joined(parts: Sequence[Staged], then: Callable[..., Any]) -> Staged:
    """Several staged values as one: every part's stages, in order; ``then(*their values)``."""
    cuts = [0]
    for part in parts:
        cuts.append(cuts[-1] + len(part.stages))

    def values(outs: Sequence[Any]) -> Any:
        return then(*(part.then(outs[a:b]) for part, a, b in zip(parts, cuts, cuts[1:])))

    return Staged(tuple(s for part in parts for s in part.stages), values)


class LoraArgs(NamedTuple):
    """One model's LoRA adapters for a call (``preheat.lora``; how a layer uses them:
    ``preheat.models.adapters``): K slots padded to a rank bucket R, and each image's slot."""

    factors: Any  # {layer path: (down (K, in, R), up (K, R, out))}, replicated
    scales: Any  # (K, R) float32: each rank column's user scale, replicated
    slots: Any  # (B,) int32: each image's (or text's) slot, split with the batch

    BATCHED = frozenset({"slots"})

    def adapters(self, repeat: int = 1) -> Any:
        """As the model's layers take them (``preheat.models.adapters.Adapters``), for a batch that
        runs ``repeat`` times over (2: classifier-free guidance's conditional and unconditional
        halves, each image keeping its slot in both)."""
        import jax.numpy as jnp

        from preheat.models.adapters import Adapters

        slots = self.slots if repeat == 1 else jnp.concatenate([self.slots] * repeat)
        return Adapters(self.factors, self.scales, slots)


class EncodeArgs(NamedTuple):
    """The text-encode stage (``families.text.encode``): B texts through every encoder."""

    params: tuple  # one entry per encoder: its weights (None: an absent encoder, like SD3 without T5)
    ids: tuple  # one entry per tokenizer: (B, L_i) int32 token ids
    lora: tuple | None = None  # text-encoder LoRAs: one LoraArgs (or None) per encoder; None: none at all
    clip_skip: Any = None  # (B,) int32: Stable Diffusion's clip_skip per text (None: families without it)

    BATCHED = frozenset({"ids", "clip_skip"})


class DenoiseArgs(NamedTuple):
    """The denoising program (``preheat.engine.build_program``): the whole sampling loop."""

    params: Any  # the denoiser's weights (replicated, or split over fsdp)
    plan: Any  # preheat.samplers.Plan: the padded schedule of this step count
    seeds: Any  # (B,) uint32: each image's seed (preheat.noise)
    cond: Any  # the conditioning pytree, every leaf (B, ...) ({} for unconditional models)
    uncond: Any  # the unconditional branch's, same structure (guided calls; {} otherwise)
    guidance: Any  # () float32: classifier-free guidance's scale (``Request.cfg_scale``; read only when guided)
    noise: Any  # (B, H, W, C) float32: the user's initial noise (NHWC); () zeros when drawn from the seeds
    start: Any = None  # preheat.samplers.Start: img2img / inpainting (its latents and mask split,
    #                    its step index and flag replicated); None: from noise
    lora: LoraArgs | None = None  # the denoiser's LoRA adapters; None: the program without LoRA
    guidance_rescale: Any = None  # () float32: diffusers' guidance_rescale phi, a guided call of a family
    #                               declaring it (``families.guidance``); None: the program without the rescale
    restart: Any = None  # () int32: the step from which the solver starts afresh (``Family.restart_step``: a
    #                      second expert's pipeline); None: the program without a restart

    BATCHED = frozenset({"seeds", "cond", "uncond", "noise", "start"})


class DecodeArgs(NamedTuple):
    """The VAE decode stage (``families.text.decode_program``)."""

    params: Any  # the VAE's weights
    latents: Any  # (B, h, w, C) float32: the final samples

    BATCHED = frozenset({"latents"})


class EncodeImageArgs(NamedTuple):
    """The VAE encode stage (``families.image.encode_image_program``): images a call passes in."""

    params: Any  # the VAE's weights
    images: Any  # (B, H, W, 3) float32 in [-1, 1]
    seeds: Any  # (B,) uint32: each image's posterior sample is drawn from its seed
    index: Any  # () int32: which draw of the image stream (preheat.noise.IMAGE_STREAM)

    BATCHED = frozenset({"images", "seeds"})
