"""The denoising stage: what selects its program (``Signature``) and the program (``build_program``).

The program is the whole call's sampling loop, one ``lax.fori_loop`` (``samplers.denoise_loop``):
initial noise from each image's seed, every step, classifier-free guidance; a pixel family's
conversion to uint8 too. What is static (changes the program) and what is data (does not):

    static (one executable each)          runtime data (no recompile)
    ------------------------------------  ----------------------------------------------
    model architecture, dtype             weights (an argument, never a constant)
    solver + prediction type + clipping   step count, schedule tables (a padded Plan)
    batch size, sample (latent) shape     guidance scale, seeds, the user's initial noise
    guidance on/off, user noise or not    conditioning: class labels, prompt embeddings,
    conditioning structure                negative prompts, SDXL's size/crop ids
    guidance rescale or not (a guided     the guidance rescale phi (``families.guidance``;
      call of a family declaring it)        0 selects the plain combination exactly)
    the device mesh (load(devices=...))
    LoRA: rank bucket, adapter slots      LoRA factors, scales, each image's adapter
                                          (``preheat.lora``; no LoRA = the program without)
    from noise / an image / + mask blend  img2img / inpainting: the start step (strength),
      (Signature.image)                   the image's latents, the mask (``samplers.Start``)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from preheat.families.base import Request, to_pixels
from preheat.families.stages import DenoiseArgs
from preheat.noise import INIT_STREAM, STEP_STREAM, image_keys, normal_per_image
from preheat.samplers import SolverSpec, denoise_loop

__all__ = ["Denoiser", "Signature", "denoise_output", "rescaled_guidance", "build_program"]

Denoiser = Callable[..., jax.Array]
"""``fn(params, x, t, cond, lora=None) -> prediction``: x (B, *sample_shape), t (B,) float32, cond a
pytree batched on axis 0 (``{}`` for unconditional models), lora the denoiser's adapters for this
batch (``preheat.models.adapters.Adapters``: factors, scales, each image's slot (B,)) or None.

The denoising program's one argument is a ``DenoiseArgs`` (``preheat.families.stages``): its
``BATCHED`` fields are split over the devices, the rest (weights, schedule, guidance scale and
rescale, LoRA factors) replicated."""


@dataclass(frozen=True)
class Signature:
    """Everything that selects one compiled denoising program (hashable; the cache key builds on it)."""

    family: str
    spec: SolverSpec
    batch: int
    sample_shape: tuple[int, ...]  # NHWC per image: (H, W, C) of the sample (latent for VAE families)
    dtype: str
    guided: bool  # classifier-free guidance on (2x batch through the model)
    user_noise: bool  # initial noise passed in rather than drawn from the seeds
    conditioning: tuple[str, ...]  # the names of the conditioning leaves ((), ("class_labels",), ...)
    pixels: bool  # the program ends with the conversion to uint8
    lora: tuple[int, int] | None = None  # (rank bucket, adapter slots); None: the program without LoRA
    progress: bool = False  # the loop reports each step to the host (preheat.progress: why it is static)
    image: str = ""  # "": from noise; "img2img": from an image at a start step (samplers.Start);
    #                  "blend": that, and the unmasked region put back after every step (inpainting)
    # each conditioning leaf's shape past the batch: a Kontext reference image's latent size selects a program
    cond_shapes: tuple[tuple[int, ...], ...] = ()
    guidance_rescale: bool = False  # the guided prediction is rescaled (``families.guidance``: a guided call of a
    #                                 family declaring it); its phi is data
    restart: bool = False  # the solver starts afresh at a step (``Family.restart_step``); the step is data

    @classmethod
    def of(cls, family: str, spec: SolverSpec, request: Request, args: DenoiseArgs, dtype: str, pixels: bool,
           progress: bool) -> "Signature":
        """A denoising call's signature, derived from its request and its argument's structure."""
        start = args.start
        return cls(family=family, spec=spec, batch=request.n, sample_shape=request.sample_shape, dtype=dtype,
                   guided=request.guided, user_noise=request.noise is not None,
                   conditioning=tuple(sorted(args.cond)), pixels=pixels,
                   lora=None if args.lora is None else request.lora.signature, progress=progress,
                   image="" if start is None else "img2img" if start.keep is None else "blend",
                   cond_shapes=tuple(tuple(np.shape(c)[1:]) for c in jax.tree.leaves(args.cond)),
                   guidance_rescale=args.guidance_rescale is not None, restart=args.restart is not None)


def denoise_output(sig: Signature) -> jax.ShapeDtypeStruct:
    """What the denoising program returns (``build_program``): the final sample, as uint8 pixels
    when the program converts them. Known without tracing the loop."""
    return jax.ShapeDtypeStruct((sig.batch, *sig.sample_shape), jnp.uint8 if sig.pixels else jnp.float32)


def rescaled_guidance(guided: jax.Array, cond: jax.Array, phi: jax.Array) -> jax.Array:
    """diffusers' ``rescale_noise_cfg`` (guidance_rescale; the paper's section 3.4): each image's
    guided prediction scaled to the std of its conditional one, blended with itself by ``phi``,
    against the over-exposure a high guidance scale gives. ``phi`` is data: 0 selects ``guided``
    exactly (a select, not the blend), and a flat guided prediction (std 0) is kept as it is rather
    than divided by zero (diffusers' would be NaN)."""
    axes = tuple(range(1, guided.ndim))  # every axis but the batch
    # torch's .std is unbiased (ddof=1), as here; the correction cancels in the ratio anyway
    std_cond = jnp.std(cond, axis=axes, keepdims=True, ddof=1)  # (B, 1, 1, 1)
    std_guided = jnp.std(guided, axis=axes, keepdims=True, ddof=1)  # (B, 1, 1, 1)
    flat = std_guided == 0
    ratio = jnp.where(flat, 1.0, std_cond / jnp.where(flat, 1.0, std_guided))  # (B, 1, 1, 1)
    blended = phi * (guided * ratio) + (1 - phi) * guided  # (B, H, W, C)
    return jnp.where(phi > 0, blended, guided)


def build_program(sig: Signature, apply: Denoiser) -> Callable[[DenoiseArgs], jax.Array]:
    """The whole denoising call as one pure function of a ``DenoiseArgs``.

    ``args.start`` (``preheat.samplers.Start``, only when ``sig.image``): the loop begins at its
    step index from the encoded image, noised with the same ε the text-to-image call would start
    from (the user's ``noise``, or the seeds' draw) -- every family's img2img and inpainting start
    here. ``args.lora`` (only when ``sig.lora``): the denoiser's adapters, each image's slot
    repeated for the unconditional half of a guided batch. ``args.guidance_rescale`` (only when
    ``sig.guidance_rescale``: a guided call of a family that declares it): :func:`rescaled_guidance`
    on the combined prediction, before the sampler sees it, as diffusers' pipelines apply it.
    ``args.restart`` (only when ``sig.restart``): the solver's state starts afresh at that step
    (``samplers.denoise_loop``), as a second pipeline's scheduler does when it goes on from the first's latents."""
    spec = sig.spec
    draws = max(spec.noise_draws_per_step, 1)

    def program(args: DenoiseArgs) -> jax.Array:
        params, cond, guidance, rescale = args.params, args.cond, args.guidance, args.guidance_rescale
        b = args.seeds.shape[0]  # sig.batch, or each device's slice of it under data parallelism
        keys = image_keys(args.seeds)
        if sig.user_noise:
            x_t = args.noise.astype(jnp.float32)  # (B, H, W, C)
        else:
            x_t = normal_per_image(keys, INIT_STREAM, jnp.int32(0), sig.sample_shape)
        both_cond = jax.tree.map(lambda c, u: jnp.concatenate([c, u]), cond, args.uncond) if sig.guided else None
        lora = None  # (B,) slots, or (2B,) for the conditional and unconditional halves
        if sig.lora is not None:
            lora = args.lora.adapters(repeat=2 if sig.guided else 1)

        def model(x: jax.Array, t: jax.Array) -> jax.Array:
            x = x.astype(sig.dtype)
            tb = jnp.broadcast_to(t.astype(jnp.float32), (b,))
            if not sig.guided:
                return apply(params, x, tb, cond, lora).astype(jnp.float32)
            both = apply(params, jnp.concatenate([x, x]), jnp.concatenate([tb, tb]), both_cond,
                         lora).astype(jnp.float32)
            c, u = both[:b], both[b:]  # (B, H, W, C) each
            guided = u + guidance.astype(jnp.float32) * (c - u)  # (B, H, W, C)
            if not sig.guidance_rescale:  # structure, not a value: no rescale declared, or the call is unguided
                return guided
            return rescaled_guidance(guided, c, rescale.astype(jnp.float32))

        def noise_fn(i: jax.Array, k: int) -> jax.Array:
            return normal_per_image(keys, STEP_STREAM, i * draws + k, sig.sample_shape)

        x0 = denoise_loop(spec, model, args.plan, x_t, noise_fn, args.start if sig.image else None, progress=sig.progress,
                 restart=args.restart if sig.restart else None)
        return to_pixels(x0) if sig.pixels else x0

    return program
