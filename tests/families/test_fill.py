"""FLUX.1 Fill through preheat.load, against diffusers' own ``FluxFillPipeline`` on a tiny
random-weight folder, the same image, mask and initial latents (its posterior made quiet, so that
diffusers' generator-drawn sample of the masked image and preheat's seeded one are both its mean);
a LoRA made with peft on the folder's (wider) transformer against ``load_lora_weights``, and fp8
weights against diffusers' layerwise casting."""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError
from tests._support.flow_fixtures import picture, reference_pipeline, reference_pixels, save_tiny_flow_model
from tests._support.fp8_reference import FP8, assert_fp8_matches, cast_layers, cast_layerwise, stored_low
from tests._support.lora_files import save_flux_lora, scale_0
from tests._support.numerics import assert_pixels_close, counting_traces, mean_abs_px, px_diff


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_flow_model(tmp_path_factory.mktemp("fill") / "fill", "flux-fill", quiet_posterior=True)


@pytest.fixture(scope="module")
def pipe(folder):
    return preheat.load(folder, cache="off")


@pytest.fixture(scope="module")
def reference(folder):
    return reference_pipeline(folder)


@pytest.fixture(scope="module")
def lora(reference, tmp_path_factory):
    pytest.importorskip("peft")
    return save_flux_lora(reference, tmp_path_factory.mktemp("fill-lora"), seed=4)


def _mask(width: int, height: int, soft: bool = True) -> np.ndarray:
    """White (repaint) in a box off centre, with a soft column that binarizes to repaint."""
    m = np.zeros((height, width), np.uint8)
    m[height // 4: 3 * height // 4, width // 3: width - 4] = 255
    if soft:
        m[height // 4: 3 * height // 4, width // 3 - 1] = 140
    return m


@pytest.mark.parametrize("image_size,prompt,guidance", [
    ((32, 32), "a red boat", 30.0),  # the image at the output size
    ((40, 36), ["a fox", "city at night"], 12.0),  # resized (Lanczos) to 32x32, two images
])
def test_matches_diffusers_from_the_same_latents(pipe, reference, image_size, prompt, guidance):
    from PIL import Image

    image, mask = picture(*image_size), _mask(*image_size)
    n = len(prompt) if isinstance(prompt, list) else 1
    noise = np.random.default_rng(1).standard_normal((n, 4, 16, 16)).astype(np.float32)
    theirs = reference_pixels(reference, prompt, noise, image=Image.fromarray(image),
                              mask_image=Image.fromarray(mask), num_inference_steps=3, guidance_scale=guidance)
    ours = pipe.generate(prompt, image=image, mask_image=mask, noise=noise, steps=3, guidance=guidance,
                         width=32, height=32)
    assert_pixels_close(ours, theirs, shape=(n, 32, 32, 3))


def _fill_call(ref, **kwargs) -> tuple[np.ndarray, np.ndarray, dict]:
    """(diffusers' image from ``ref`` with ``kwargs``, preheat's call on the same inputs): one image
    and mask at 32x32, the same latents, 3 steps, the pipeline's guidance 30."""
    from PIL import Image

    image, mask = picture(32, 32, seed=3), _mask(32, 32)
    noise = np.random.default_rng(2).standard_normal((1, 4, 16, 16)).astype(np.float32)
    theirs = reference_pixels(ref, "a red boat", noise, image=Image.fromarray(image), mask_image=Image.fromarray(mask),
                              num_inference_steps=3, guidance_scale=30.0, **kwargs)
    return theirs, dict(image=image, mask_image=mask, noise=noise, steps=3, guidance=30.0, width=32, height=32)


def test_a_lora_matches_diffusers(folder, pipe, lora):
    """A LoRA on the Fill transformer (its x_embedder takes the 48 channels of noise, masked image and
    mask) and the CLIP encoder at ``lora_scale``, against ``load_lora_weights`` with
    ``joint_attention_kwargs``' scale."""
    ref = reference_pipeline(folder)  # its own: the module's reference stays LoRA-free
    ref.load_lora_weights(str(lora))
    scale = 0.7
    theirs, call = _fill_call(ref, joint_attention_kwargs={"scale": scale})
    ours = pipe.generate("a red boat", lora=lora, lora_scale=scale, **call)
    assert_pixels_close(ours, theirs, shape=(1, 32, 32, 3))
    assert mean_abs_px(ours, pipe.generate("a red boat", **call, **scale_0(lora))) > 5  # the LoRA matters


def test_fp8_weights_match_diffusers_layerwise_casting(folder, pipe):
    """``weights_dtype="float8_e4m3fn"``: the layers diffusers' ``enable_layerwise_casting`` casts
    (the wider x_embedder among them) are the ones stored in fp8, and the image is diffusers' from
    the same latents."""
    ref = reference_pipeline(folder)  # its own: the module's reference stays full precision
    denoiser = cast_layerwise(ref.transformer)
    low = preheat.load(folder, cache="off", weights_dtype=FP8)
    assert stored_low(low.params) == cast_layers(denoiser) and "x_embedder" in cast_layers(denoiser)
    theirs, call = _fill_call(ref)
    assert_fp8_matches(low.generate("a red boat", **call), theirs, pipe.generate("a red boat", **call), "fill")


def test_the_mask_folds_into_channels_as_diffusers_packs_it(pipe, reference):
    """Each latent pixel's (s, s) block of the full-resolution mask, packed as diffusers does
    (``prepare_mask_latents``), the masked image's latents before it."""
    import torch

    from preheat.families.fill import mask_channels
    from preheat.models.flux import pack_latents

    rng = np.random.default_rng(0)
    mask = (rng.random((2, 32, 32)) > 0.5).astype(np.float32)  # (n, H, W) in {0, 1}
    latents = rng.standard_normal((2, 4, 16, 16)).astype(np.float32)  # already latents: diffusers skips the VAE
    theirs_mask, theirs_latents = reference.prepare_mask_latents(
        torch.from_numpy(mask[:, None]), torch.from_numpy(latents), 2, 4, 1, 32, 32, torch.float32, "cpu", None)
    ours = np.asarray(pack_latents(mask_channels(mask, 2)))  # (n, S, 4 s²)
    np.testing.assert_array_equal(ours, theirs_mask.numpy())
    vae = reference.vae.config
    scaled = (latents - vae.shift_factor) * vae.scaling_factor
    np.testing.assert_allclose(np.asarray(pack_latents(scaled.transpose(0, 2, 3, 1))), theirs_latents.numpy(),
                               rtol=1e-6, atol=1e-6)


def test_the_torch_backend_runs_diffusers_fill_pipeline(folder, reference):
    """``backend="torch"``: the Fill folder's own pipeline, with the same latents as given (the
    masked image's posterior is drawn from each side's generators: e^-15 apart, a level at most)."""
    from PIL import Image

    image, mask = picture(32, 32, seed=2), _mask(32, 32)
    noise = np.random.default_rng(4).standard_normal((1, 4, 16, 16)).astype(np.float32)
    torch_pipe = preheat.load(folder, backend="torch")
    ours = torch_pipe.generate("a cat", image=image, mask_image=mask, noise=noise, steps=2, guidance=30.0,
                               width=32, height=32)
    theirs = reference_pixels(reference, "a cat", noise, image=Image.fromarray(image),
                              mask_image=Image.fromarray(mask), num_inference_steps=2, guidance_scale=30.0)
    diff = px_diff(ours, theirs)
    assert ours.shape == theirs.shape and diff.max() <= 1 and diff.mean() < 0.01, (diff.max(), diff.mean())


def test_image_mask_strength_prompt_and_seed_are_data(pipe):
    """One denoising program (and one image encoder) serve every image, mask, strength, prompt and
    seed of a size; another size is another program."""
    pipe, traces = counting_traces(pipe)
    call = dict(steps=2, width=32, height=32, guidance=30.0)
    first = pipe.generate("a fox", image=picture(32, 32), mask_image=_mask(32, 32), seed=0, **call)
    traced, compiled = len(traces), len(pipe.executables)
    outs = [pipe.generate("a fox", image=picture(32, 32, seed=1), mask_image=_mask(32, 32), seed=0, **call),
            pipe.generate("a fox", image=picture(32, 32), mask_image=255 - _mask(32, 32, soft=False), seed=0, **call),
            pipe.generate("a fox", image=picture(32, 32), mask_image=_mask(32, 32), strength=0.5, seed=0, **call),
            pipe.generate("a cat", image=picture(32, 32), mask_image=_mask(32, 32), seed=0, **call),
            pipe.generate("a fox", image=picture(32, 32), mask_image=_mask(32, 32), seed=5, **call)]
    assert len(traces) == traced and len(pipe.executables) == compiled
    assert all(not np.array_equal(first, o) for o in outs)
    pipe.generate("a fox", image=picture(32, 32), mask_image=_mask(32, 32), seed=0, **{**call, "width": 48})
    assert len(traces) > traced


def test_defaults_are_the_fill_pipeline_s(pipe):
    assert (pipe.defaults["steps"], pipe.defaults["guidance"]) == (50, 30.0)
    request = pipe.validate("x", image=picture(32, 32), mask_image=_mask(32, 32), width=32, height=32)
    assert request.values["strength"] == 1.0


@pytest.mark.parametrize("kwargs,argument,needle", [
    (dict(image=None), "image", "image is required"),
    (dict(mask_image=None), "mask_image", "mask_image is required"),
    (dict(mask_image=np.zeros((16, 32), np.uint8)), "mask_image", "must be the same size"),
    (dict(strength=0.0), "strength", "outside (0, 1]"),
])
def test_bad_input_is_one_line_naming_it(pipe, kwargs, argument, needle):
    call = dict(image=picture(32, 32), mask_image=_mask(32, 32), width=32, height=32, steps=1)
    with pytest.raises(InvalidArgumentError, match=needle.replace("(", r"\(").replace("]", r"\]")) as err:
        pipe.generate("x", **{**call, **kwargs})
    assert err.value.argument == argument and "\n" not in str(err.value)
