"""The denoising stage (``preheat.denoise``): its guidance rescale against diffusers'; the whole
program is tested through the engine (tests/test_engine.py) and every family's parity suite."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from preheat.denoise import rescaled_guidance


@pytest.mark.parametrize("phi", [0.0, 0.3, 0.7, 1.0])
def test_rescaled_guidance_is_diffusers_rescale_noise_cfg(phi):
    """The guidance rescale's math against diffusers' own function (NCHW there, NHWC here); 0 is
    the guided prediction exactly, and a flat one stays finite (diffusers' would be 0/0)."""
    import torch
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

    rng = np.random.default_rng(0)
    c, u = (rng.standard_normal((3, 8, 6, 4)).astype(np.float32) for _ in range(2))  # (B, H, W, C)
    guided = u + 7.5 * (c - u)
    ours = np.asarray(rescaled_guidance(jnp.asarray(guided), jnp.asarray(c), jnp.float32(phi)))
    nchw = (torch.from_numpy(a).permute(0, 3, 1, 2) for a in (guided, c))
    theirs = rescale_noise_cfg(*nchw, guidance_rescale=phi).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-5)
    if phi == 0.0:
        np.testing.assert_array_equal(ours, guided)
    flat = np.asarray(rescaled_guidance(jnp.zeros_like(guided), jnp.asarray(c), jnp.float32(phi)))
    np.testing.assert_array_equal(flat, np.zeros_like(guided))
