"""FLUX.1 Kontext through preheat.load, against diffusers' own ``FluxKontextPipeline`` on a tiny
random-weight folder, the same reference image and the same initial latents (a LoRA too: made with
peft on the folder's transformer and CLIP encoder, loaded by ``load_lora_weights``; and fp8 weights
against diffusers' layerwise casting)."""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError
from preheat.families.image import pixels
from tests._support.flow_fixtures import picture, reference_pipeline, reference_pixels, save_tiny_flow_model
from tests._support.fp8_reference import FP8, assert_fp8_matches, cast_layers, cast_layerwise, stored_low
from tests._support.lora_files import save_flux_lora, scale_0
from tests._support.numerics import assert_pixels_close, counting_traces, mean_abs_px


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_flow_model(tmp_path_factory.mktemp("kontext") / "kontext", "flux-kontext")


@pytest.fixture(scope="module")
def pipe(folder):
    return preheat.load(folder, cache="off")


@pytest.fixture(scope="module")
def reference(folder):
    return reference_pipeline(folder)


@pytest.fixture(scope="module")
def lora(reference, tmp_path_factory):
    pytest.importorskip("peft")
    return save_flux_lora(reference, tmp_path_factory.mktemp("kontext-lora"), seed=4)


def _noise(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4, h, w)).astype(np.float32)


@pytest.mark.parametrize("image_size,size,prompt,guidance,true_cfg", [
    ((50, 34), (32, 32), "make it a watercolor", 3.5, {}),  # reference 48x32 (rounded down, Lanczos), output given
    ((40, 40), None, ["a red fox", "city at night"], 2.5, {}),  # output = the reference's size, two images
    # true CFG: the negative branch sees the same reference (FluxKontextPipeline's true_cfg_scale)
    ((40, 40), None, "make it a watercolor", 2.5, dict(negative_prompt="blurry", true_cfg_scale=3.0)),
])
def test_matches_diffusers_from_the_same_latents(pipe, reference, image_size, size, prompt, guidance, true_cfg):
    from PIL import Image

    image = picture(*image_size)
    w, h = size or (image_size[0] // 4 * 4, image_size[1] // 4 * 4)
    n = len(prompt) if isinstance(prompt, list) else 1
    noise = _noise(n, h // 2, w // 2)
    steps = 3
    theirs = reference_pixels(reference, prompt, noise, image=Image.fromarray(image), num_inference_steps=steps,
                              guidance_scale=guidance, max_area=w * h, _auto_resize=False, **true_cfg)
    ours = pipe.generate(prompt, image=image, image_resize="none", noise=noise, steps=steps, guidance=guidance,
                         **({} if size is None else dict(width=w, height=h)), **true_cfg)
    assert ours.shape == (n, h, w, 3)
    assert_pixels_close(ours, theirs)


def _kontext_call(ref, **kwargs) -> tuple[np.ndarray, dict]:
    """(diffusers' image from ``ref`` with ``kwargs``, preheat's call on the same inputs): a 40x40
    reference used as it is, a 32x32 output from the same latents, 3 steps, guidance 3.5."""
    from PIL import Image

    image, noise = picture(40, 40, seed=1), _noise(1, 16, 16)
    theirs = reference_pixels(ref, "make it a watercolor", noise, image=Image.fromarray(image), num_inference_steps=3,
                              guidance_scale=3.5, max_area=32 * 32, _auto_resize=False, **kwargs)
    return theirs, dict(image=image, image_resize="none", noise=noise, steps=3, guidance=3.5, width=32, height=32)


def test_a_lora_matches_diffusers(folder, pipe, lora):
    """A LoRA on the transformer (x_embedder, attention, MLPs, modulation, output) and the CLIP
    encoder at ``lora_scale``, against ``load_lora_weights`` with ``joint_attention_kwargs``' scale."""
    scale = 0.7
    ref = reference_pipeline(folder)  # its own: the module's reference stays LoRA-free
    ref.load_lora_weights(str(lora))
    theirs, call = _kontext_call(ref, joint_attention_kwargs={"scale": scale})
    ours = pipe.generate("make it a watercolor", lora=lora, lora_scale=scale, **call)
    assert_pixels_close(ours, theirs, shape=(1, 32, 32, 3))
    assert mean_abs_px(ours, pipe.generate("make it a watercolor", **call, **scale_0(lora))) > 5  # the LoRA matters


# test-slow: fp8 storage's layer rule is make test's in tests/models/test_storage.py (FLUX.1-dev)
@pytest.mark.slow
def test_fp8_weights_match_diffusers_layerwise_casting(folder, pipe):
    """``weights_dtype="float8_e4m3fn"``: the layers diffusers' ``enable_layerwise_casting`` casts
    are the ones stored in fp8, and the image is diffusers' from the same latents and reference
    (whose tokens go through the same fp8 layers as the noise's)."""
    ref = reference_pipeline(folder)  # its own: the module's reference stays full precision
    denoiser = cast_layerwise(ref.transformer)
    low = preheat.load(folder, cache="off", weights_dtype=FP8)
    assert stored_low(low.params) == cast_layers(denoiser) and "x_embedder" in cast_layers(denoiser)
    theirs, call = _kontext_call(ref)
    assert_fp8_matches(low.generate("make it a watercolor", **call), theirs,
                       pipe.generate("make it a watercolor", **call), "kontext")


@pytest.mark.parametrize("image_size", [(40, 20), (20, 40), (33, 31), (64, 48)])
def test_preferred_resize_snaps_the_reference_as_diffusers(pipe, reference, image_size):
    """``image_resize="preferred"`` (the default): the reference diffusers would encode, to the pixel."""
    from PIL import Image

    image = picture(*image_size, seed=3)
    seen = {}

    class Stop(Exception):
        pass

    def encode(x, *args, **kwargs):
        seen["x"] = x.numpy()  # (1, 3, H, W) in [-1, 1]
        raise Stop

    vae_encode = reference.vae.encode
    reference.vae.encode = encode
    try:
        with pytest.raises(Stop):
            reference(prompt="x", image=Image.fromarray(image), num_inference_steps=1, height=32, width=32,
                      max_area=32 * 32)
    finally:
        reference.vae.encode = vae_encode
    request = pipe.validate("x", image=image, width=32, height=32)
    size = request.values["reference_size"]
    assert size in pipe.family.served_sizes(pipe)
    ours = pixels(request.values["image"], *size)  # what the encode_image stage gets, (H', W', 3) in [-1, 1]
    theirs = seen["x"][0].transpose(1, 2, 0)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    assert request.sample_shape == (16, 16, 4)  # the output is what was asked, whatever the reference's size


def test_preferred_resolutions_are_the_served_sizes(pipe):
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    from preheat.server.inputs import Limits, served_sizes

    assert pipe.family.served_sizes(pipe) == tuple(PREFERRED_KONTEXT_RESOLUTIONS)
    assert served_sizes(pipe, Limits()) == tuple(PREFERRED_KONTEXT_RESOLUTIONS)
    assert served_sizes(pipe, Limits(sizes=((32, 32),))) == ((32, 32),)


def test_image_prompt_guidance_and_seed_are_data(pipe):
    """One denoising program (and one image encoder) serve every reference of a size, prompt,
    guidance scale and seed; another reference size is another program."""
    pipe, traces = counting_traces(pipe)
    call = dict(image_resize="none", steps=2, width=32, height=32)
    first = pipe.generate("a fox", image=picture(32, 32), guidance=3.5, seed=0, **call)
    traced, compiled = len(traces), len(pipe.executables)
    outs = [pipe.generate("a fox", image=picture(32, 32, seed=1), guidance=3.5, seed=0, **call),
            pipe.generate("a cat", image=picture(32, 32), guidance=2.0, seed=0, **call),
            pipe.generate("a fox", image=picture(32, 32), guidance=3.5, seed=5, **call)]
    assert len(traces) == traced and len(pipe.executables) == compiled
    assert all(not np.array_equal(first, o) for o in outs)
    pipe.generate("a fox", image=picture(48, 32), seed=0, **call)  # a wider reference: more tokens
    assert len(traces) > traced


@pytest.mark.parametrize("kwargs,argument,needle", [
    (dict(image=None), "image", "image is required"),
    (dict(mask_image=np.zeros((32, 32), np.uint8)), "mask_image", "takes no mask"),
    (dict(image_resize="bogus"), "image_resize", "not one of: preferred, none"),
    (dict(image=np.zeros((2, 2, 3), np.uint8)), "image", "at least 4x4"),
    (dict(width=30), "width", "multiple of 4"),
])
def test_bad_input_is_one_line(pipe, kwargs, argument, needle):
    call = {"image": picture(32, 32), **kwargs}
    with pytest.raises(InvalidArgumentError) as err:
        pipe.check("x", steps=2, **call)
    assert err.value.argument == argument and needle in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_torch_backend_draws_the_same_images(folder, pipe):
    """backend="torch" runs diffusers' FluxKontextPipeline on the reference preheat resized and the same seeds."""
    torch_pipe = preheat.load(folder, backend="torch")
    assert torch_pipe.defaults == pipe.defaults and torch_pipe.family is pipe.family
    call = dict(image=picture(50, 34, seed=2), image_resize="none", steps=3, seed=[4, 5], guidance=3.0)
    theirs = torch_pipe.generate(["a red fox", "a cat"], **call)
    ours = pipe.generate(["a red fox", "a cat"], **call)
    assert ours.shape == (2, 32, 48, 3)
    assert_pixels_close(ours, theirs)
    # true CFG through FluxKontextPipeline's own true_cfg_scale: the reference in both branches
    guided = dict(call, negative_prompt=["blurry", "dark"], true_cfg_scale=3.0)
    ours_guided = pipe.generate(["a red fox", "a cat"], **guided)
    assert not np.array_equal(ours_guided, ours)
    assert_pixels_close(ours_guided, torch_pipe.generate(["a red fox", "a cat"], **guided))
