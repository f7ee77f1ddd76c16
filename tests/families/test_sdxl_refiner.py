"""An SDXL refiner (stable-diffusion-xl-refiner-1.0's folder: ``StableDiffusionXLImg2ImgPipeline``
with ``requires_aesthetics_score``, the second text encoder alone) against diffusers' own img2img
and inpaint pipelines from the same ε -- plain, with a LoRA, with fp8 weights -- the torch backend
beside it, and what it declares.

The refiner's UNet takes five time ids, (original size, crop top-left, aesthetic score), and the
unconditional branch its own (the negative size and crop, or the prompt's size and (0, 0), and
the negative aesthetic score); ``tests/families/test_image.py`` holds the base SDXL's calls.
"""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError, WeightsError
from tests._support import image_fixtures
from tests._support.fp8_reference import FP8, cast_layers, cast_layerwise, round_to_fp8, stored_low
from tests._support.lora_files import TE_TARGETS, UNET_TARGETS, peft_layers, save_lora, scale_0
from tests._support.numerics import assert_pixels_close, counting_traces, mean_abs_px

STEPS = 5
SHAPE = (1, 4, 16, 16)  # one image's latents, NCHW (32x32 pixels, VAE factor 2)
KIND = "sdxl-refiner"
# the micro-conditioning a refiner call may give, each away from its default
CONDITIONING = dict(aesthetic_score=8.0, negative_aesthetic_score=1.0, original_size=(64, 48),
                    crops_coords_top_left=(4, 2), negative_original_size=(40, 40),
                    negative_crops_coords_top_left=(1, 1))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return image_fixtures.save_image_sd(tmp_path_factory.mktemp("refiner") / "refiner", KIND)


@pytest.fixture(scope="module")
def pipe(folder):
    return preheat.load(folder, cache="off")


def _pil(array: np.ndarray):
    from PIL import Image

    return Image.fromarray(array)


# one img2img call, as diffusers' keywords and as preheat's (the same ε: diffusers draws it after the
# image's posterior sample)
CALL = dict(strength=0.6, num_inference_steps=STEPS, guidance_scale=6.0, negative_prompt="blurry")
OURS = dict(strength=0.6, steps=STEPS, guidance=6.0, negative_prompt="blurry", sampler="euler")


def _img2img(ref, seed: int = 3, **extra) -> np.ndarray:
    """diffusers' refiner img2img pixels of "a watercolor fox" (``extra``: its keywords)."""
    return image_fixtures.reference_pixels(ref, "a watercolor fox", seed, image=_pil(image_fixtures.sample_image()),
                                           **CALL, **extra)


def _ours(pipe, seed: int = 3, **extra) -> np.ndarray:
    eps = image_fixtures.replayed_noise(SHAPE, seed, draws_before=1)
    return pipe.generate("a watercolor fox", image=image_fixtures.sample_image(), noise=eps, **OURS, **extra)


@pytest.mark.parametrize("extra", [{}, CONDITIONING], ids=["defaults", "conditioning"])
def test_img2img_matches_diffusers(folder, pipe, extra):
    """diffusers' defaults (aesthetic score 6, negative 2.5, the image's size, crop (0, 0)), and every
    one of them given."""
    assert pipe.family.name == "stable-diffusion-xl-refiner"
    image = image_fixtures.sample_image()
    ref = image_fixtures.reference(folder, KIND, "euler", inpaint=False)
    call = dict(strength=0.6, num_inference_steps=STEPS, guidance_scale=6.0, negative_prompt="blurry")
    theirs = image_fixtures.reference_pixels(ref, "a watercolor fox", 3, image=_pil(image), **call, **extra)
    eps = image_fixtures.replayed_noise(SHAPE, 3, draws_before=1)  # after the image's posterior sample
    ours = pipe.generate("a watercolor fox", image=image, strength=0.6, steps=STEPS, guidance=6.0,
                         negative_prompt="blurry", sampler="euler", noise=eps, **extra)
    assert_pixels_close(ours, theirs, shape=(1, 32, 32, 3))


@pytest.mark.slow  # the mask blend is base SDXL's (tests/families/test_image.py); the ids are img2img's here
def test_inpainting_matches_diffusers(folder, pipe):
    """StableDiffusionXLInpaintPipeline on a refiner folder: its 4-channel UNet, the mask blended
    after each step, the same aesthetic-score ids."""
    image, mask = image_fixtures.sample_image(seed=1), image_fixtures.sample_mask()
    ref = image_fixtures.reference(folder, KIND, "euler", inpaint=True)
    call = dict(strength=0.6, num_inference_steps=STEPS, guidance_scale=5.0, height=32, width=32)
    theirs = image_fixtures.reference_pixels(ref, "a red boat", 5, image=_pil(image), mask_image=_pil(mask), **call,
                                             aesthetic_score=7.0)
    eps = image_fixtures.replayed_noise(SHAPE, 5, draws_before=1)
    ours = pipe.generate("a red boat", image=image, mask_image=mask, strength=0.6, steps=STEPS, guidance=5.0,
                         sampler="euler", noise=eps, aesthetic_score=7.0)
    assert_pixels_close(ours, theirs, shape=(1, 32, 32, 3))


def test_aesthetic_scores_and_sizes_are_data(pipe):
    """One program serves every score and size id (they are the UNet's time ids), and each moves
    the image: a score that reached nothing would leave it as it was."""
    counted, traces = counting_traces(pipe)
    image = image_fixtures.sample_image()
    common = dict(image=image, strength=0.6, steps=3, guidance=6.0, sampler="euler", seed=0)
    first = counted.generate("a cat", **common)
    traced = len(traces)
    others = [counted.generate("a cat", aesthetic_score=2.0, **common),
              counted.generate("a cat", negative_aesthetic_score=6.0, **common),
              counted.generate("a cat", original_size=(16, 16), **common)]
    assert len(traces) == traced
    for other in others:
        assert mean_abs_px(first, other) > 1.0


@pytest.mark.parametrize("inputs,argument,words", [
    (dict(), "image", "image is required: an image (this model takes one on every call)"),  # a refiner refines: StableDiffusionXLImg2ImgPipeline's image
    (dict(image=image_fixtures.sample_image(), prompt_2="a dog"), "prompt_2", "unexpected argument"),
    (dict(image=image_fixtures.sample_image(), target_size=(32, 32)), "target_size", "unexpected argument"),
    (dict(image=image_fixtures.sample_image(), negative_aesthetic_score=3.0, guidance=1.0), "negative_aesthetic_score",
     "needs classifier-free guidance"),
])
def test_what_diffusers_ignores_or_needs_is_one_line(pipe, inputs, argument, words):
    """diffusers' refiner pipelines take prompt_2 and target_size and ignore them (one encoder, the
    aesthetic score in the target's place): preheat refuses them by name."""
    with pytest.raises(InvalidArgumentError) as info:
        pipe.validate("a cat", **inputs)
    assert info.value.argument == argument and words in str(info.value) and "\n" not in str(info.value)


def test_warm_up_compiles_image_calls_only(pipe):
    """The image is required, so every warmed program takes one (a server offers no text-only call)."""
    from preheat import warm as warming

    sigs = warming.signatures(pipe, warming.resolve(pipe, warming.WarmSet(max_batch_size=1)))
    assert sigs and all("image" in dict(s.given) for s in sigs)


@pytest.mark.slow  # a torch load of the folder: test-slow
def test_the_torch_backend_runs_diffusers_refiner_pipelines(folder, pipe):
    """The torch backend keeps the folder's img2img pipeline (its aesthetic-score config) and passes
    the ids as diffusers' keywords: two images with negatives, the same ε, its pixels within a level."""
    torch_pipe = preheat.load(folder, backend="torch")
    assert torch_pipe.family.name == "stable-diffusion-xl-refiner"
    eps = np.random.default_rng(0).standard_normal((2, *SHAPE[1:])).astype(np.float32)
    call = dict(image=image_fixtures.sample_image(), strength=0.6, steps=STEPS, guidance=6.0,
                negative_prompt="blurry", sampler="euler", noise=eps, **CONDITIONING)
    prompts = ["a watercolor fox", "a boat"]
    assert_pixels_close(pipe.generate(prompts, **call), torch_pipe.generate(prompts, **call), shape=(2, 32, 32, 3))


LORA_SCALE = 0.8
LORA_TOL = 1.0  # tests/families/test_lora.py's: mean |pixel difference| <= 1 level of 255


@pytest.mark.slow  # the LoRA programs (the UNet's and the encoder's with adapters): test-slow
def test_lora_matches_diffusers(folder, pipe, tmp_path, record_property):
    """A LoRA made with peft on the refiner's UNet and its one text encoder (text_encoder_2), loaded
    by diffusers' img2img pipeline (``load_lora_weights``) and given to preheat per request: the
    same pixels from the same ε, and far from the plain image (both parts are read)."""
    ref = image_fixtures.reference(folder, KIND, "euler", inpaint=False)
    lora = save_lora(ref, tmp_path / "A", "unet", {
        "unet": peft_layers(ref.unet, UNET_TARGETS, 4, 8, seed=1),
        "text_encoder_2": peft_layers(ref.text_encoder_2, TE_TARGETS, 4, 4, seed=2)})
    ref.load_lora_weights(str(lora))
    theirs = _img2img(ref, cross_attention_kwargs={"scale": LORA_SCALE})
    ours = _ours(pipe, lora=lora, lora_scale=LORA_SCALE)
    plain = _ours(pipe, **scale_0(lora))
    record_property("mean_abs_px", mean_abs_px(ours, theirs))
    print(f"refiner LoRA: mean |Δpx| {mean_abs_px(ours, theirs):.4f} to diffusers, {mean_abs_px(ours, plain):.4f} "
          "to the plain image")
    assert mean_abs_px(ours, theirs) <= LORA_TOL and mean_abs_px(ours, plain) > 5
    (read, _), = pipe.validate("a fox", image=image_fixtures.sample_image(), lora=lora).lora.slots[0]
    assert set(read.layers) == {"denoiser", "text_encoder_2"}


def _first_encoder_lora(path, kohya: bool):
    """A LoRA file with a layer of SDXL's first text encoder (diffusers' or kohya's name) beside a UNet one."""
    from safetensors.numpy import save_file

    te = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj" if kohya else \
        "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"
    down, up = (".lora_down.weight", ".lora_up.weight") if kohya else (".lora_A.weight", ".lora_B.weight")
    unet = "lora_unet_mid_block_attentions_0_proj_in" if kohya else "unet.mid_block.attentions.0.proj_in"
    tensors = {}
    for name, width in ((te, 16), (unet, 64)):  # the tiny encoder's and mid block's widths
        tensors[name + down], tensors[name + up] = np.ones((4, width), np.float32), np.ones((width, 4), np.float32)
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("kohya", [False, True], ids=["diffusers-names", "kohya-names"])
def test_a_lora_for_the_first_text_encoder_is_refused_by_name(pipe, tmp_path, kohya):
    """A refiner has no first text encoder: an SDXL base LoRA's part for it matches nothing. diffusers'
    refiner pipeline fails on such a file too (``load_lora_weights`` loads it into the absent encoder:
    an AttributeError: the test after this one); preheat refuses it in one line that names the part."""
    lora = _first_encoder_lora(tmp_path / "te1.safetensors", kohya)
    with pytest.raises(WeightsError) as info:
        pipe.validate("a fox", image=image_fixtures.sample_image(), lora=lora)
    message = str(info.value)
    assert "2 LoRA key(s) are for text_encoder, which this stable-diffusion-xl-refiner model does not have" in message
    assert "\n" not in message


def test_diffusers_refiner_fails_on_a_first_text_encoder_lora_too(folder, tmp_path):
    """What preheat's refusal matches: diffusers' refiner pipeline does not skip a first-encoder part."""
    ref = image_fixtures.reference(folder, KIND, "euler", inpaint=False)
    with pytest.raises(AttributeError):
        ref.load_lora_weights(str(_first_encoder_lora(tmp_path / "te1.safetensors", kohya=False)))


ORDER_TOL = 0.01  # the same weights, products in another order (float32): tests/models/test_scaled_fp8.py


@pytest.mark.slow  # a second load of the folder and its fp8 programs: test-slow
def test_fp8_draws_diffusers_image_of_the_fp8_weights(folder, pipe, record_property):
    """fp8 storage on the refiner's UNet, as tests/models/test_storage.py checks SDXL's: the layers
    stored in fp8 are the ones ``enable_layerwise_casting`` casts; the image is diffusers' img2img
    with those weights rounded to fp8 (biases full, as preheat keeps them) to ``ORDER_TOL``, and
    moved from the full-precision one. Layerwise casting's own image (fp8 biases too: the same
    reference with the biases rounded, bit for bit) is recorded as ``layerwise_mean_abs_px``."""
    low = preheat.load(folder, cache="off", weights_dtype=FP8)
    names = stored_low(low.params)
    cast = image_fixtures.reference(folder, KIND, "euler", inpaint=False)
    cast_layerwise(cast.unet)
    assert names == cast_layers(cast.unet) and len(names) > 5
    assert {"add_embedding.linear_1", "add_embedding.linear_2", "mid_block.attentions.0.proj_in"} <= names

    ours, full = _ours(low), _ours(pipe)
    ref = image_fixtures.reference(folder, KIND, "euler", inpaint=False)
    round_to_fp8(ref.unet, names)
    theirs = _img2img(ref)
    record_property("mean_abs_px", mean_abs_px(ours, theirs))
    assert_pixels_close(ours, theirs, mean_tol=ORDER_TOL, max_tol=1, shape=(1, 32, 32, 3))
    moved = mean_abs_px(ours, full)
    print(f"refiner fp8: mean |Δpx| {mean_abs_px(ours, theirs):.4f} to diffusers' fp8 weights, {moved:.4f} to full")
    assert moved > 0.1 and moved > 2 * mean_abs_px(ours, theirs), moved

    round_to_fp8(ref.unet, names, biases=True)
    layerwise = _img2img(cast)
    np.testing.assert_array_equal(layerwise, _img2img(ref))
    record_property("layerwise_mean_abs_px", mean_abs_px(ours, layerwise))
    print(f"refiner fp8: mean |Δpx| {mean_abs_px(ours, layerwise):.4f} to enable_layerwise_casting's (fp8 biases)")
