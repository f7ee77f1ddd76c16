"""Parity of preheat's JAX UNet2DModel with diffusers' torch UNet2DModel (the reference)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import preheat
from tests._support.reference import (
    BUTTERFLIES_AT_32,
    CLASS_CONDITIONAL,
    DDPM_CHURCH_256_AT_32,
    DDPM_CIFAR10_32,
    SCALE_SHIFT_HEADS,
    save_random_unet,
    torch_unet_output,
)

FP32_TOL = 1e-4

SMALL = dict(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
             norm_num_groups=8, down_block_types=("AttnDownBlock2D", "DownBlock2D"),
             up_block_types=("UpBlock2D", "AttnUpBlock2D"))

# (name, config, batch sizes, timesteps per call). A one-entry list is a scalar timestep broadcast
# to the batch: class-conditional's call (the same code for every config), not the 35.7 M-parameter
# cifar UNet's, which would compile a second program for it.
CASES = [
    ("ddpm-cifar10-32", DDPM_CIFAR10_32, 32, [(3, [0, 250, 999])]),
    ("ddpm-church-256@32", DDPM_CHURCH_256_AT_32, 32, [(2, [17, 640])]),
    ("butterflies@32", BUTTERFLIES_AT_32, 32, [(2, [5, 901])]),
    ("class-conditional", CLASS_CONDITIONAL, 16, [(1, [3]), (4, [0, 10, 500, 999])]),
    ("scale-shift+heads", SCALE_SHIFT_HEADS, 16, [(2, [1, 700])]),
    # Options beyond the published set, each exercised once.
    ("fourier", {**SMALL, "time_embedding_type": "fourier", "flip_sin_to_cos": False}, 16, [(2, [0.5, 30.0])]),
    ("class-timestep+gelu", {**SMALL, "class_embed_type": "timestep", "act_fn": "gelu"}, 16, [(2, [3, 600])]),
    ("mish+center+noattn", {**SMALL, "act_fn": "mish", "center_input_sample": True, "add_attention": False,
                            "mid_block_scale_factor": 1.41421356, "freq_shift": 1, "norm_eps": 1e-6}, 16, [(2, [9, 99])]),
    ("scale-shift-mid-groups", {**SMALL, "resnet_time_scale_shift": "scale_shift", "attn_norm_num_groups": 8,
                                "attention_head_dim": None, "downsample_padding": 0}, 16, [(2, [2, 222])]),
    ("no-mid-block", {**SMALL, "mid_block_type": None, "time_embedding_dim": 96}, 16, [(2, [2, 222])]),
]


def _labels(config, batch, rng):
    if config.get("class_embed_type") == "timestep":
        return rng.randint(0, 1000, size=batch).astype(np.int64)
    if config.get("num_class_embeds"):
        return rng.randint(0, config["num_class_embeds"], size=batch).astype(np.int64)
    return None


# the full-size cifar UNet (35.7 M parameters, ~20 s) in test-slow; its blocks are the @32 ones
@pytest.mark.parametrize("name,config,size,calls", [pytest.param(*c, id=c[0], marks=pytest.mark.slow if c[0] == "ddpm-cifar10-32" else ())
                                                   for c in CASES])
def test_matches_diffusers_fp32(tmp_path, name, config, size, calls):
    path = save_random_unet(config, tmp_path / name, perturb=0.02)
    unet = preheat.load_unet(path)
    forward = jax.jit(unet.__call__)
    rng = np.random.RandomState(0)
    for batch, ts in calls:
        x = rng.randn(batch, config["in_channels"], size, size).astype(np.float32)
        t = np.asarray(ts, dtype=np.float32 if config.get("time_embedding_type") == "fourier" else np.int64)
        if len(ts) == 1:
            t = t[0]  # scalar timestep, broadcast to the batch
        y = _labels(config, batch, rng)
        ref = torch_unet_output(path, x, np.asarray(t), y)
        out = np.asarray(forward(x, t, y))
        assert out.shape == ref.shape == (batch, config["out_channels"], size, size)
        err = np.abs(out - ref).max()
        assert err <= FP32_TOL, f"{name}: max abs error {err:.3g} > {FP32_TOL}"


def test_bf16_runs_close_to_fp32_reference(tmp_path):
    """bf16 weights and activations: measured max abs error ~3e-2 on outputs of magnitude ~1."""
    path = save_random_unet(SCALE_SHIFT_HEADS, tmp_path / "m", perturb=0.02)
    unet = preheat.load_unet(path, dtype=jnp.bfloat16)
    assert jax.tree.leaves(unet.params)[0].dtype == jnp.bfloat16
    x = np.random.RandomState(1).randn(2, 3, 16, 16).astype(np.float32)
    t = np.array([10, 800])
    out = np.asarray(jax.jit(unet.__call__)(x, t).astype(jnp.float32))
    ref = torch_unet_output(path, x, t)
    err = np.abs(out - ref).max()
    assert np.isfinite(out).all()
    assert err <= 0.1 * max(1.0, np.abs(ref).max()), err


def test_params_are_arguments_not_constants(tmp_path):
    """One compiled program serves two weight sets of the same architecture."""
    a = preheat.load_unet(save_random_unet(CLASS_CONDITIONAL, tmp_path / "a", seed=0))
    b = preheat.load_unet(save_random_unet(CLASS_CONDITIONAL, tmp_path / "b", seed=1))
    traces = []

    @jax.jit
    def f(params, x, t, y):
        traces.append(1)
        return a.apply(params, x, t, y)

    x = jnp.ones((1, 16, 16, 1))
    t, y = jnp.array([5.0]), jnp.array([2])
    out_a, out_b = f(a.params, x, t, y), f(b.params, x, t, y)
    assert len(traces) == 1
    assert not np.allclose(out_a, out_b)
    hlo = f.lower(a.params, x, t, y).as_text()
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(a.params))
    # Baked-in weights would be printed in full (several characters per byte).
    assert len(hlo) < weight_bytes / 4, (len(hlo), weight_bytes)


def test_pipeline_folder_and_deprecated_attention_names(tmp_path):
    """A pipeline folder (model_index.json + unet/) with pre-0.14 attention key names loads."""
    import torch
    from safetensors.torch import load_file, save_file

    unet_dir = save_random_unet(SMALL, tmp_path / "pipe" / "unet", perturb=0.02)
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline", "unet": ["diffusers", "UNet2DModel"]}))
    weights = unet_dir / "diffusion_pytorch_model.safetensors"
    sd = load_file(weights)
    old = {}
    for k, v in sd.items():
        k = k.replace("to_q.", "query.").replace("to_k.", "key.").replace("to_v.", "value.").replace("to_out.0.", "proj_attn.")
        old[k] = v.contiguous()
    save_file(old, weights)
    assert any("proj_attn" in k for k in old)
    unet = preheat.load_unet(tmp_path / "pipe")
    x = np.random.RandomState(2).randn(1, 3, 16, 16).astype(np.float32)
    # diffusers converts the old names on load as well, so the torch model is still the reference.
    ref = torch_unet_output(unet_dir, x, np.array([42]))
    out = jax.jit(unet.__call__)(x, 42)  # one program, not some 180 op-by-op ones
    assert np.abs(np.asarray(out) - ref).max() <= FP32_TOL
    del torch
