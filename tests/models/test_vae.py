"""Parity of preheat's JAX AutoencoderKL with diffusers' torch AutoencoderKL (the reference)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preheat.errors import InvalidArgumentError, ModelNotFoundError, UnsupportedConfigError, WeightsError
from preheat.models.vae import AutoencoderKLConfig, LatentStat, build_abstract, load_vae
from preheat.models.weights import expected_torch_shape, torch_key
from tests._support.vae_fixtures import nchw, nhwc, save_tiny_vae, torch_vae

FP32_TOL = 1e-4

# name -> AutoencoderKL overrides of the tiny config (32/64 channels, 1 layer, 8 groups, 4 latent channels)
CASES = {
    "sd-like": {},
    "flux-like-16ch": dict(latent_channels=16, layers_per_block=2, norm_num_groups=32, use_quant_conv=False,
                           use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159),
    "3-levels-no-mid-attn": dict(block_out_channels=(32, 64, 64), norm_num_groups=16, mid_block_add_attention=False,
                                 use_quant_conv=False, scaling_factor=0.13025),
}

# Published configs (vae/config.json), the fields that differ from diffusers' defaults.
_FOUR_LEVELS = dict(
    block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32, act_fn="silu",
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
SD15_VAE = dict(_FOUR_LEVELS, latent_channels=4, sample_size=512)
SDXL_VAE = dict(_FOUR_LEVELS, latent_channels=4, sample_size=1024, scaling_factor=0.13025, force_upcast=True)
FLUX_VAE = dict(_FOUR_LEVELS, latent_channels=16, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                force_upcast=True, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True)


class _Models(dict):
    """name -> (torch model, saved folder), each built on first use and kept for the module."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp = tmp_path_factory

    def __missing__(self, name: str):
        folder = save_tiny_vae(self.tmp.mktemp(name), **CASES[name])
        self[name] = (torch_vae(**CASES[name]), folder)
        return self[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Models(tmp_path_factory)


def _torch(fn, *arrays):
    import torch

    with torch.no_grad():
        return fn(*(torch.from_numpy(a) for a in arrays))


def _err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


@pytest.mark.parametrize("name", list(CASES))
def test_decode_and_encode_match_diffusers_fp32(models, name):
    ref, folder = models[name]
    vae = load_vae(folder)
    f = vae.downscale
    rng = np.random.RandomState(0)
    x = rng.uniform(-1, 1, (2, 8 * f, 6 * f, 3)).astype(np.float32)  # non-square, NHWC
    z = rng.randn(2, 8, 6, vae.latent_channels).astype(np.float32)

    images = np.asarray(jax.jit(vae.decode)(vae.params, z))
    ref_images = nhwc(_torch(lambda t: ref.decode(t).sample, nchw(z)).numpy())
    assert images.shape == ref_images.shape == (2, 8 * f, 6 * f, 3)
    assert _err(images, ref_images) <= FP32_TOL

    mean, logvar = jax.jit(vae.encode)(vae.params, x)
    posterior = _torch(lambda t: ref.encode(t).latent_dist, nchw(x))
    assert mean.shape == logvar.shape == (2, 8, 6, vae.latent_channels)
    assert _err(mean, nhwc(posterior.mean.numpy())) <= FP32_TOL
    assert _err(logvar, nhwc(posterior.logvar.numpy())) <= FP32_TOL


def test_latents_to_images_and_back_follow_the_pipeline_formulas(models):
    """``z = latents / scaling_factor + shift_factor`` (Flux/SD3 pipelines) and its inverse for img2img."""
    ref, folder = models["flux-like-16ch"]
    vae = load_vae(folder)
    sf, shift = 0.3611, 0.1159
    rng = np.random.RandomState(1)
    latents = rng.randn(1, 8, 6, 16).astype(np.float32)
    images = np.asarray(jax.jit(vae.latents_to_images)(vae.params, latents))
    ref_images = nhwc(_torch(lambda t: ref.decode(t / sf + shift).sample, nchw(latents)).numpy())
    assert _err(images, ref_images) <= FP32_TOL

    x = rng.uniform(-1, 1, (1, 16, 12, 3)).astype(np.float32)
    posterior = _torch(lambda t: ref.encode(t).latent_dist, nchw(x))
    key = jax.random.key(3)
    # One program for both (XLA shares the encoder between them).
    mode, sampled = jax.jit(lambda p, x, k: (vae.images_to_latents(p, x), vae.images_to_latents(p, x, k)))(
        vae.params, x, key)
    mode, sampled = np.asarray(mode), np.asarray(sampled)
    assert _err(mode, nhwc(((posterior.mean - shift) * sf).numpy())) <= FP32_TOL
    noise = np.asarray(jax.random.normal(key, mode.shape, jnp.float32))
    expected = (nhwc(posterior.mean.numpy()) + nhwc(posterior.std.numpy()) * noise - shift) * sf
    assert _err(sampled, expected) <= FP32_TOL
    assert _err(sampled, mode) > 1e-3  # the key really samples


def test_latent_statistics_are_data_not_architecture(models, tmp_path):
    """Same weights, different scaling/shift/latents_mean: one key, one compiled program, each its own formula."""
    ref, folder = models["sd-like"]
    other = tmp_path / "sdxl-stats"
    shutil.copytree(folder, other)
    mean, std = [0.1, -0.2, 0.3, 0.05], [0.9, 1.1, 0.8, 1.2]
    raw = json.loads((other / "config.json").read_text())
    raw.update(scaling_factor=0.5, latents_mean=mean, latents_std=std)
    (other / "config.json").write_text(json.dumps(raw))
    a, b = load_vae(folder), load_vae(other)
    assert a.config.architecture_dict() == b.config.architecture_dict()

    traces = []

    def decode(params, latents):
        traces.append(1)
        return a.latents_to_images(params, latents)

    f = jax.jit(decode)
    latents = np.random.RandomState(2).randn(1, 8, 8, 4).astype(np.float32)
    out_a, out_b = np.asarray(f(a.params, latents)), np.asarray(f(b.params, latents))
    assert len(traces) == 1
    # SD pipeline: latents / 0.18215; SDXL pipeline with latents_mean/std: latents * std / sf + mean.
    ref_a = _torch(lambda t: ref.decode(t / 0.18215).sample, nchw(latents)).numpy()
    m, s = np.asarray(mean, np.float32).reshape(1, 4, 1, 1), np.asarray(std, np.float32).reshape(1, 4, 1, 1)
    ref_b = _torch(lambda t, s, m: ref.decode(t * s / 0.5 + m).sample, nchw(latents), s, m).numpy()
    assert _err(out_a, nhwc(ref_a)) <= FP32_TOL
    assert _err(out_b, nhwc(ref_b)) <= FP32_TOL


def test_tiled_decode_matches_diffusers_enable_tiling(models):
    """6 tiles of 4 shapes (edges included) on a non-square latent, blended like diffusers; compiles once."""
    ref, folder = models["sd-like"]
    vae = load_vae(folder)
    traces = []

    @jax.jit
    def tiled(params, latents):  # diffusion latents, as a pipeline would pass them
        traces.append(1)
        return vae.decode_tiled(params, vae.unscale(params, latents), tile_latent_min_size=8, tile_sample_min_size=16)

    rng = np.random.RandomState(4)
    z = rng.randn(1, 14, 10, 4).astype(np.float32) * 0.18215
    ref.enable_tiling()
    ref.tile_latent_min_size, ref.tile_sample_min_size = 8, 16
    try:
        expected = nhwc(_torch(lambda t: ref.decode(t / 0.18215).sample, nchw(z)).numpy())
    finally:
        ref.disable_tiling()
    whole = nhwc(_torch(lambda t: ref.decode(t / 0.18215).sample, nchw(z)).numpy())
    out = np.asarray(tiled(vae.params, z))
    assert out.shape == expected.shape == (1, 28, 20, 3)
    assert _err(out, expected) <= FP32_TOL
    assert _err(out, whole) > 1e-3  # the tiles really differ from one whole decode
    tiled(vae.params, z + 1.0)
    assert len(traces) == 1
    # A latent that fits one tile is decoded whole (the same program), as diffusers does; the image tile
    # size follows from the latent one.
    small = z[:, :8, :8]
    assert str(jax.make_jaxpr(lambda p, z: vae.decode_tiled(p, z, tile_latent_min_size=8))(vae.params, small)) == \
        str(jax.make_jaxpr(vae.decode)(vae.params, small))


def test_force_upcast_keeps_the_vae_in_float32(tmp_path):
    upcast = save_tiny_vae(tmp_path / "upcast", force_upcast=True)
    for dtype in (jnp.bfloat16, jnp.float16):
        vae = load_vae(upcast, dtype=dtype)
        assert vae.dtype == jnp.float32
        weights = [v for p, v in nnx_flat(vae.params) if p[-1] != "latent_scale" and p[-1] != "latent_shift"]
        assert {w.dtype for w in weights} == {jnp.dtype(jnp.float32)}
        assert jax.eval_shape(vae.decode, vae.params, jnp.zeros((1, 2, 2, 4), dtype)).dtype == jnp.float32
    plain = save_tiny_vae(tmp_path / "plain", force_upcast=False)
    vae = load_vae(plain, dtype=jnp.bfloat16)
    assert vae.dtype == jnp.bfloat16
    assert {v.dtype for p, v in nnx_flat(vae.params) if p[-1] not in ("latent_scale", "latent_shift")} == {
        jnp.dtype(jnp.bfloat16)}


def test_bf16_runs_close_to_fp32_reference(models, tmp_path):
    """bf16 weights and activations (force_upcast off): a loose bound, measured error ~2e-2 of outputs ~3."""
    ref, _ = models["sd-like"]
    folder = save_tiny_vae(tmp_path / "bf16", force_upcast=False)
    vae = load_vae(folder, dtype=jnp.bfloat16)
    z = np.random.RandomState(5).randn(1, 8, 8, 4).astype(np.float32)
    out = np.asarray(jax.jit(vae.decode)(vae.params, z).astype(jnp.float32))
    expected = nhwc(_torch(lambda t: ref.decode(t).sample, nchw(z)).numpy())
    assert np.isfinite(out).all()
    assert _err(out, expected) <= 0.1 * max(1.0, float(np.abs(expected).max()))


def test_fp16_variant_and_sharded_checkpoints_load(tmp_path):
    import torch
    from diffusers import AutoencoderKL

    fp16 = save_tiny_vae(tmp_path / "fp16", variant="fp16")
    assert (fp16 / "diffusion_pytorch_model.fp16.safetensors").is_file()
    with pytest.raises(ModelNotFoundError, match="diffusion_pytorch_model.safetensors"):
        load_vae(fp16)  # only the variant is there
    vae = load_vae(fp16, variant="fp16")
    ref = AutoencoderKL.from_pretrained(fp16, variant="fp16", torch_dtype=torch.float32).eval()
    z = np.random.RandomState(6).randn(1, 8, 8, 4).astype(np.float32)
    decode = jax.jit(vae.decode)
    assert _err(decode(vae.params, z), nhwc(_torch(lambda t: ref.decode(t).sample, nchw(z)).numpy())) <= FP32_TOL

    sharded = save_tiny_vae(tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("diffusion_pytorch_model-*.safetensors"))) > 1
    vae = load_vae(sharded)
    ref = torch_vae()  # same seed, same weights
    assert _err(decode(vae.params, z), nhwc(_torch(lambda t: ref.decode(t).sample, nchw(z)).numpy())) <= FP32_TOL


def test_pipeline_folder_and_deprecated_attention_names(models, tmp_path):
    """A pipeline folder's vae/ with pre-0.14 attention names loads to exactly the same weights."""
    from safetensors.numpy import load_file, save_file

    _, folder = models["sd-like"]
    vae_dir = tmp_path / "pipe" / "vae"
    shutil.copytree(folder, vae_dir)
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    path = vae_dir / "diffusion_pytorch_model.safetensors"
    renamed = {}
    for k, v in load_file(path).items():
        for new, old in (("to_q.", "query."), ("to_k.", "key."), ("to_v.", "value."), ("to_out.0.", "proj_attn.")):
            k = k.replace(new, old)
        renamed[k] = v
    assert any(".proj_attn." in k for k in renamed)
    save_file(renamed, path)
    old, new = load_vae(tmp_path / "pipe"), load_vae(folder)
    for (pa, va), (pb, vb) in zip(nnx_flat(old.params), nnx_flat(new.params), strict=True):
        assert pa == pb and np.array_equal(va, vb)


def nnx_flat(state):
    from flax import nnx

    return [(tuple(str(p) for p in path), np.asarray(v.get_value())) for path, v in nnx.to_flat_state(state)]


@pytest.mark.parametrize("name,config", [("sd15", SD15_VAE), ("sdxl", SDXL_VAE), ("flux", FLUX_VAE)])
def test_published_configs_map_every_tensor_both_ways(name, config):
    """Full size, by shape only: JAX abstractly, diffusers on torch's meta device (no memory)."""
    import torch
    from diffusers import AutoencoderKL
    from flax import nnx

    with torch.device("meta"):
        reference = AutoencoderKL(**config)
    torch_shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    cfg = AutoencoderKLConfig.from_dict(config)
    _, abstract = build_abstract(cfg)
    jax_shapes = {}
    for path, var in nnx.to_flat_state(abstract):
        if isinstance(var, LatentStat):
            assert var.shape == (cfg.latent_channels,)
            continue
        jax_shapes[torch_key(path)] = expected_torch_shape(tuple(var.shape), str(path[-1]))
    assert sorted(set(torch_shapes) - set(jax_shapes)) == []  # nothing missing
    assert sorted(set(jax_shapes) - set(torch_shapes)) == []  # nothing extra
    assert {k: v for k, v in jax_shapes.items() if torch_shapes[k] != v} == {}
    assert len(jax_shapes) > 200
    if name == "flux":
        assert "quant_conv.weight" not in jax_shapes and jax_shapes["decoder.conv_in.weight"] == (512, 16, 3, 3)
    else:
        assert jax_shapes["quant_conv.weight"] == (8, 8, 1, 1)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


def test_bad_folders_get_one_line_errors(models, tmp_path):
    _, folder = models["sd-like"]

    def variant(name: str, **changes) -> Path:
        d = tmp_path / name
        shutil.copytree(folder, d)
        raw = json.loads((d / "config.json").read_text())
        raw.update(changes)
        (d / "config.json").write_text(json.dumps(raw))
        return d

    with pytest.raises(UnsupportedConfigError) as exc:
        load_vae(variant("class", _class_name="VQModel"))
    assert "'VQModel'" in _one_line(exc)
    with pytest.raises(UnsupportedConfigError) as exc:
        load_vae(variant("block", down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"]))
    assert "down_block_types 'AttnDownEncoderBlock2D'" in _one_line(exc)
    with pytest.raises(UnsupportedConfigError) as exc:
        load_vae(variant("key", norm_type="spatial"))
    assert "norm_type" in _one_line(exc)
    with pytest.raises(UnsupportedConfigError) as exc:
        load_vae(variant("stats", latents_mean=[0.0, 0.0], latents_std=[1.0, 1.0]))
    assert "latents_mean" in _one_line(exc)

    missing = variant("missing")
    (missing / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError) as exc:
        load_vae(missing)
    assert "diffusion_pytorch_model.safetensors" in _one_line(exc)
    with pytest.raises(ModelNotFoundError) as exc:
        load_vae(tmp_path / "nowhere")
    _one_line(exc)

    vae = load_vae(folder)
    z = jnp.zeros((1, 16, 16, 4))
    for kwargs in (dict(tile_latent_min_size=8, tile_overlap_factor=1.0), dict(tile_latent_min_size=-8)):
        with pytest.raises(InvalidArgumentError) as exc:
            vae.decode_tiled(vae.params, z, **kwargs)
        assert "tile" in _one_line(exc)

    from safetensors.numpy import load_file, save_file

    bad = variant("shape")
    path = bad / "diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    tensors["decoder.conv_out.weight"] = np.zeros((3, 32, 5, 5), np.float32)
    save_file(tensors, path)
    with pytest.raises(WeightsError) as exc:
        load_vae(bad)
    assert "decoder.conv_out.weight has shape (3, 32, 5, 5), expected (3, 32, 3, 3)" in _one_line(exc)
