"""FLOPs of one FLUX.1 transformer call, from its config: what a chip's fraction of peak is taken of.

A matrix product of (m, k) by (k, n) is 2mnk FLOPs; elementwise work (norms, RoPE, softmax, GELU) is
left out (under 1% at 1024²). With H the width (heads x head dim), S image tokens (the latent's
2x2 patches: (height / 16) (width / 16) for an 8x VAE), T text tokens and L = S + T:

    double block   each token through its stream's q, k, v, out (4 H²) and MLP (8 H²)   2 x 12 H² x L
                   joint attention, Q Kᵀ and A V over all heads                          4 L² H
                   AdaLN of each stream, once per image (H -> 6H, twice)                2 x 12 H²
    single block   q, k, v and the MLP's input (H -> 7H), its output (5H -> H)          2 x 12 H² x L
                   joint attention                                                      4 L² H
                   AdaLN (H -> 3H)                                                      2 x 3 H²
    around them    patches in (C -> H) and out (H -> C) on the S image tokens, the T5 context in
                   (J -> H) on the T text tokens, the timestep, guidance and pooled-text
                   embedders and the output AdaLN, once per image

FLUX.1 (H 3072, 19 + 38 blocks) at 1024² with T5's 512 tokens: 74.4 TFLOP a call, one call per step
(FLUX.1-dev's guidance is an input, not a second branch; true CFG doubles it).
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["flux_flops_per_call", "flux_image_tokens"]

_TIME_PROJ = 256  # the timestep and guidance sinusoids' width (diffusers' Timesteps(256))


def flux_image_tokens(width: int, height: int, vae_scale: int = 8) -> int:
    """Image tokens of a ``width`` x ``height`` image: its latent's 2x2 patches."""
    return (height // (2 * vae_scale)) * (width // (2 * vae_scale))


def flux_flops_per_call(config: Mapping[str, Any], width: int = 1024, height: int = 1024, text_tokens: int = 512,
                        vae_scale: int = 8, reference_tokens: int = 0) -> float:
    """FLOPs of one transformer call on one image (the module docstring's sum); ``config``: the
    transformer's config.json (diffusers' keys); ``reference_tokens``: Kontext's reference image's,
    which run through every block beside the noise's."""
    h = int(config.get("num_attention_heads", 24)) * int(config.get("attention_head_dim", 128))
    c_in = int(config.get("in_channels", 64))
    c_out = int(config.get("out_channels") or c_in)
    joint = int(config.get("joint_attention_dim", 4096))
    pooled = int(config.get("pooled_projection_dim", 768))
    s = flux_image_tokens(width, height, vae_scale) + int(reference_tokens)
    t = int(text_tokens)
    tokens = s + t
    attention = 4 * tokens * tokens * h
    double = 2 * 12 * h * h * tokens + attention + 2 * 12 * h * h
    single = 2 * 12 * h * h * tokens + attention + 2 * 3 * h * h
    around = 2 * c_in * h * s + 2 * h * c_out * s + 2 * joint * h * t
    embedders = 2 * (_TIME_PROJ * h + h * h) + 2 * (pooled * h + h * h) + 2 * h * 2 * h  # time, text, norm_out
    if config.get("guidance_embeds"):
        embedders += 2 * (_TIME_PROJ * h + h * h)
    return float(int(config.get("num_layers", 19)) * double + int(config.get("num_single_layers", 38)) * single
                 + around + embedders)
