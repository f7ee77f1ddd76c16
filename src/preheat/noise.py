"""Per-image randomness, drawn the same way by every backend and every family.

Image ``b`` draws all its randomness from ``key(seed_b)``: its initial noise is stream 0, index 0;
a sampler's per-step draws are stream 1; the VAE posterior's draws when an image goes in, stream 2. So an image is the same whatever else shares its batch,
and the torch backend can reproduce the JAX engine's starting noise exactly.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["INIT_STREAM", "STEP_STREAM", "IMAGE_STREAM", "image_keys", "normal_per_image", "initial_noise"]

INIT_STREAM, STEP_STREAM = 0, 1
IMAGE_STREAM = 2  # the VAE posterior's samples of an image the call passes in (index: which image)


def image_keys(seeds: jax.Array) -> jax.Array:
    """(B,) uint32 seeds -> (B,) typed keys."""
    return jax.vmap(jax.random.key)(seeds)


def normal_per_image(keys: jax.Array, stream: int, index: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """One standard-normal draw per image, from that image's own key only. -> (B, *shape)."""
    def one(key: jax.Array) -> jax.Array:
        return jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, stream), index), shape, jnp.float32)

    return jax.vmap(one)(keys)


@functools.lru_cache(maxsize=None)
def _one_image(sample_shape: tuple[int, ...]) -> Callable[[Any], Any]:
    def draw(seed: Any) -> Any:
        return normal_per_image(image_keys(seed[None]), INIT_STREAM, jnp.int32(0), sample_shape)[0]

    return jax.jit(draw)


def initial_noise(seeds: Sequence[int] | np.ndarray, sample_shape: Sequence[int]) -> np.ndarray:
    """The initial noise the engine draws for ``seeds`` (one per image), as float32 NCHW.

    ``sample_shape`` is one image (or latent) in the engine's NHWC order, (H, W, C). Seeds are
    per image, so drawing image by image (one small program per shape, not per batch) gives the
    engine's batch draw exactly.
    """
    seeds = np.asarray(seeds, np.uint32).reshape(-1)
    program = _one_image(tuple(int(s) for s in sample_shape))
    nhwc = np.stack([np.asarray(program(np.uint32(s))) for s in seeds])
    return np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2))
