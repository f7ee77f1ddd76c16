"""An image goes in (``preheat.families.image``): SD 1.x / SDXL img2img and inpainting against
diffusers' own pipelines from the same ε, the inputs that are data, and the one-line refusals.

Each parity case is diffusers' ``StableDiffusion[XL]Img2ImgPipeline`` / ``...InpaintPipeline`` on a
tiny folder whose VAE posterior has negligible variance (``tests/_support/image_fixtures``), seeded
by a generator; preheat gets the ε that generator adds (replayed), so from the same start both
must agree within mean |Δ| <= 1 level and max <= 8 levels of 255. ``padding_mask_crop`` calls are
compared the same way, on the image's size (a crop inpainted and pasted back).
"""

from __future__ import annotations


import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError, SchedulerConfigError
from preheat.families import image as image_input
from preheat.families.request import concat
from tests._support import image_fixtures
from tests._support.numerics import assert_pixels_close, mean_abs_px, px_diff


MEAN_TOL, MAX_TOL = 1.0, 8
STEPS = 5
SHAPE = (1, 4, 16, 16)  # one image's latents, NCHW (32x32 pixels, VAE factor 2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("image-inputs")
    return {"sd1": image_fixtures.save_image_sd(base / "sd1", "sd1"),
            "sdxl": image_fixtures.save_image_sd(base / "sdxl", "sdxl"),
            "sd1-inpaint": image_fixtures.save_image_sd(base / "sd1-inpaint", "sd1", inpaint=True),
            "sdxl-inpaint": image_fixtures.save_image_sd(base / "sdxl-inpaint", "sdxl", inpaint=True)}


TRACES: dict[str, list[int]] = {}  # per loaded pipe: one item per trace of its denoiser


@pytest.fixture(scope="module")
def pipes(folders):
    loaded: dict = {}

    def get(name: str):
        if name not in loaded:
            pipe = preheat.load(folders[name], cache="off")
            traces = TRACES[name] = []
            apply = pipe.apply

            def counting(*args):
                traces.append(1)  # runs only while JAX traces the denoiser
                return apply(*args)

            pipe.apply = counting
            loaded[name] = pipe
        return loaded[name]

    return get


def _pil(array: np.ndarray):
    from PIL import Image

    return Image.fromarray(array)


def _compare(ours: np.ndarray, theirs: np.ndarray, shape: tuple[int, ...] = (1, 32, 32, 3)) -> None:
    assert_pixels_close(ours, theirs, MEAN_TOL, MAX_TOL, shape=shape)


IMG2IMG = [("sd1", "ddim"), ("sd1", "euler"), ("sd1", "dpmpp_2m"), ("sd1", "heun"), ("sdxl", "euler"),
           ("sd1", "pndm")]  # pndm: t_start indexes its list with the repeated timestep, counter from 0
# make test: DDIM and PNDM (timestep samplers) and Euler on SDXL; the others' starts are checked step
# for step against diffusers' schedulers in tests/samplers/test_start.py, their pipelines here in test-slow
IMG2IMG_SLOW = {("sd1", "euler"), ("sd1", "dpmpp_2m"), ("sd1", "heun")}


@pytest.mark.parametrize("kind,sampler", [pytest.param(*case, id=f"{case[0]}-{case[1]}",
                                                       marks=(pytest.mark.slow,) if case in IMG2IMG_SLOW else ())
                                          for case in IMG2IMG])
def test_img2img_matches_diffusers(folders, pipes, kind, sampler):
    """From step n - int(n s), the image noised with diffusers' ε by the scheduler's own add_noise;
    dpm++ starts first order without history and Heun on its first-order call, as diffusers."""
    image = image_fixtures.sample_image()
    ref = image_fixtures.reference(folders[kind], kind, sampler, inpaint=False)
    call = dict(strength=0.6, num_inference_steps=STEPS, guidance_scale=6.0, negative_prompt="blurry")
    theirs = image_fixtures.reference_pixels(ref, "a watercolor fox", 3, image=_pil(image), **call)
    eps = image_fixtures.replayed_noise(SHAPE, 3, draws_before=1)  # after the image's posterior sample
    ours = pipes(kind).generate("a watercolor fox", image=image, strength=0.6, steps=STEPS, guidance=6.0,
                                negative_prompt="blurry", sampler=sampler, noise=eps)
    _compare(ours, theirs)
    from_noise = pipes(kind).generate("a watercolor fox", steps=STEPS, guidance=6.0, negative_prompt="blurry",
                                      sampler=sampler, noise=eps)
    assert mean_abs_px(ours, from_noise) > 4 * MEAN_TOL  # the image counts


INPAINT = [("sd1-inpaint", "ddim", 1.0), ("sdxl-inpaint", "euler", 1.0), ("sd1", "ddim", 0.6), ("sd1", "euler", 1.0),
           ("sd1", "pndm", 0.6)]  # pndm: the blend after every call, its call 1 restarting from the start


def _inpainted(folders, pipes, name: str, sampler: str, strength: float, image: np.ndarray, mask: np.ndarray,
               **extra) -> tuple[np.ndarray, np.ndarray]:
    """(preheat's, diffusers') 32x32 inpainting of ``image`` from the same ε (``extra``: keywords
    both take). At strength 1 the start is the noise alone (diffusers' is_strength_max), given to
    diffusers as latents; below it a base folder encodes the image first, then draws ε."""
    kind = name.split("-")[0]
    ref = image_fixtures.reference(folders[name], kind, sampler, inpaint=True)
    call = dict(image=_pil(image), mask_image=_pil(mask), strength=strength, num_inference_steps=STEPS,
                guidance_scale=5.0, height=32, width=32, **extra)
    if strength == 1.0:
        import torch

        eps = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)
        theirs = image_fixtures.reference_pixels(ref, "a red boat", 5, latents=torch.from_numpy(eps), **call)
    else:
        theirs = image_fixtures.reference_pixels(ref, "a red boat", 5, **call)
        eps = image_fixtures.replayed_noise(SHAPE, 5, draws_before=1)
    ours = pipes(name).generate("a red boat", image=image, mask_image=mask, strength=strength, steps=STEPS,
                                guidance=5.0, sampler=sampler, noise=eps, **extra)
    return ours, theirs


@pytest.mark.parametrize("name", ["sdxl", "sdxl-inpaint"])
def test_guidance_rescale_reaches_sdxl_img2img_and_inpainting(folders, pipes, name):
    """diffusers' SDXL img2img and inpaint pipelines take guidance_rescale (SD 1.x's take none): the
    same rescale here, on the programs the cases above compile (the input is data), the same pixels,
    and an image that moves by more than that (tests/families/test_stable_diffusion.py: text-to-image)."""
    if name == "sdxl":
        image = image_fixtures.sample_image()
        ref = image_fixtures.reference(folders[name], name, "euler", inpaint=False)
        call = dict(strength=0.6, num_inference_steps=STEPS, guidance_scale=6.0, negative_prompt="blurry")
        theirs = image_fixtures.reference_pixels(ref, "a watercolor fox", 3, image=_pil(image), guidance_rescale=0.7,
                                                 **call)
        eps = image_fixtures.replayed_noise(SHAPE, 3, draws_before=1)
        ours, off = (pipes(name).generate("a watercolor fox", image=image, strength=0.6, steps=STEPS, guidance=6.0,
                                          negative_prompt="blurry", sampler="euler", noise=eps, guidance_rescale=phi)
                     for phi in (0.7, 0.0))
    else:
        image, mask = image_fixtures.sample_image(seed=1), image_fixtures.sample_mask()
        ours, theirs = _inpainted(folders, pipes, name, "euler", 1.0, image, mask, guidance_rescale=0.7)
        off, _ = _inpainted(folders, pipes, name, "euler", 1.0, image, mask)
    _compare(ours, theirs)
    parity = mean_abs_px(ours, theirs)
    moved = mean_abs_px(ours, off)
    print(f"{name} guidance_rescale=0.7: mean |Δpx| vs diffusers {parity:.4f}; 0.7 vs 0 moves it {moved:.4f}")
    assert moved > 4 * max(parity, 0.25), (parity, moved)


@pytest.mark.parametrize("name,sampler,strength", INPAINT, ids=[f"{n}-{s}-{x}" for n, s, x in INPAINT])
def test_inpainting_matches_diffusers(folders, pipes, name, sampler, strength):
    """9-channel UNets take the mask and the masked image's latents beside the sample; a base
    folder's 4 channels get diffusers' mask blending after every step."""
    image, mask = image_fixtures.sample_image(seed=1), image_fixtures.sample_mask()
    _compare(*_inpainted(folders, pipes, name, sampler, strength, image, mask))


# crops_coords_top_left away from (0, 0) and the negative sizes away from the image's: diffusers' SDXL
# img2img and inpaint pipelines give the unconditional branch the prompt's crop and each negative size
# alone; negative_crops_coords_top_left (given to diffusers only) they never read
NEGATIVE_IDS = [dict(crops_coords_top_left=(4, 2), negative_original_size=(40, 40), negative_target_size=(24, 56)),
                dict(crops_coords_top_left=(4, 2), negative_original_size=(40, 40))]


@pytest.mark.parametrize("name", ["sdxl", "sdxl-inpaint"])
@pytest.mark.parametrize("extra", NEGATIVE_IDS, ids=["both-sizes", "original-size"])
def test_sdxl_image_calls_take_diffusers_negative_ids(folders, pipes, name, extra):
    """The unconditional ids of an SDXL image call are (negative original size or the prompt's,
    the prompt's crop, negative target size or the prompt's), as diffusers' image pipelines build
    them (its text-to-image pipeline: both sizes and their own crop, tests/families/test_text_inputs.py);
    on the programs the cases above compile (the ids are data). The negative sizes move the image."""
    image = image_fixtures.sample_image(seed=1)
    if name == "sdxl":
        ref = image_fixtures.reference(folders[name], name, "euler", inpaint=False)
        call = dict(strength=0.6, num_inference_steps=STEPS, guidance_scale=6.0, negative_prompt="blurry")
        theirs = image_fixtures.reference_pixels(ref, "a watercolor fox", 3, image=_pil(image), **call, **extra,
                                                 negative_crops_coords_top_left=(1, 1))
        eps = image_fixtures.replayed_noise(SHAPE, 3, draws_before=1)
        ours, without = (pipes(name).generate("a watercolor fox", image=image, strength=0.6, steps=STEPS, guidance=6.0,
                                              negative_prompt="blurry", sampler="euler", noise=eps, **given)
                         for given in (extra, dict(crops_coords_top_left=(4, 2))))
    else:
        ours, theirs = _inpainted(folders, pipes, name, "euler", 1.0, image, image_fixtures.sample_mask(), **extra)
        without, _ = _inpainted(folders, pipes, name, "euler", 1.0, image, image_fixtures.sample_mask(),
                                crops_coords_top_left=(4, 2))
    _compare(ours, theirs)
    parity = mean_abs_px(ours, theirs)
    moved = mean_abs_px(ours, without)
    print(f"{name} {sorted(extra)}: mean |Δpx| vs diffusers {parity:.4f}; the negative sizes move it {moved:.4f}")
    assert moved > 4 * max(parity, 0.25), (parity, moved)


def test_sdxl_image_calls_refuse_negative_crops_coords_top_left(pipes):
    """diffusers' SDXL img2img and inpaint pipelines take negative_crops_coords_top_left and never
    read it (the refiner's do): refused by name rather than dropped. Text-to-image calls take it."""
    with pytest.raises(InvalidArgumentError) as info:
        pipes("sdxl").validate("a cat", image=image_fixtures.sample_image(), negative_crops_coords_top_left=(1, 1),
                               negative_original_size=(40, 40), negative_target_size=(24, 56))
    assert info.value.argument == "negative_crops_coords_top_left" and "\n" not in str(info.value)
    assert "crops_coords_top_left" in str(info.value).split(":", 1)[1]
    pipes("sdxl").validate("a cat", negative_crops_coords_top_left=(1, 1), negative_original_size=(40, 40),
                           negative_target_size=(24, 56))


CROP = [("sd1-inpaint", "ddim", 1.0), ("sd1", "ddim", 0.6), ("sdxl-inpaint", "euler", 1.0)]


@pytest.mark.parametrize("name,sampler,strength", CROP, ids=[f"{n}-{s}-{x}" for n, s, x in CROP])
def test_padding_mask_crop_matches_diffusers(folders, pipes, name, sampler, strength):
    """A small mask by the edge of a 48x32 image, padding_mask_crop=2, output 32x32: diffusers'
    box (padded, grown to square, shifted back inside), the crop filled to 32x32 and inpainted,
    then pasted back -- the image's size, within a level of diffusers' on average over the image
    and over the box, the kept pixels the image's own."""
    image, mask = image_fixtures.sample_image(seed=1, width=48), image_fixtures.corner_mask(32, 48)
    ours, theirs = _inpainted(folders, pipes, name, sampler, strength, image, mask, padding_mask_crop=2)
    _compare(ours, theirs, shape=(1, 32, 48, 3))
    left, top, right, bottom = image_input.crop_regions({"padding_mask_crop": [2], "mask_image": mask,
                                                         "width": 32, "height": 32})[0]
    assert (right - left, bottom - top) == (13, 13) and bottom == 32  # grown to square and shifted up
    box = px_diff(ours, theirs)[0, top:bottom, left:right]
    print(f"in the box: mean |Δpx| {box.mean():.4f}, max {box.max()}")
    assert box.mean() <= MEAN_TOL
    np.testing.assert_array_equal(ours[0][mask == 0], image[mask == 0])


def test_padding_mask_crop_repaints_the_box_and_keeps_the_rest(pipes):
    """The same call without the crop repaints the mask at 32x32 from the whole image and returns
    the VAE's round trip of every kept pixel; with it the mask's box fills the 32x32, so the
    repainted pixels differ, and every kept pixel is the image's own."""
    image, mask = image_fixtures.sample_image(seed=1), image_fixtures.sample_mask()
    call = dict(image=image, mask_image=mask, steps=STEPS, guidance=5.0, sampler="ddim", seed=5)
    plain = pipes("sd1-inpaint").generate("a red boat", **call)
    cropped = pipes("sd1-inpaint").generate("a red boat", padding_mask_crop=2, **call)
    assert plain.shape == cropped.shape == (1, 32, 32, 3)
    repaint, kept = mask >= 128, mask == 0
    assert px_diff(cropped, plain)[0][repaint].mean() > 4 * MEAN_TOL
    np.testing.assert_array_equal(cropped[0][kept], image[kept])
    assert not np.array_equal(plain[0][kept], image[kept])


def test_each_image_of_a_batch_has_its_own_crop(pipes):
    """A server's batch (``concat``) of two requests whose padding differs: each image is inpainted
    from its own box (its own start latents, masked-image latents and mask) and pasted back there,
    as each request alone."""
    pipe = pipes("sd1-inpaint")
    image, mask = image_fixtures.sample_image(seed=1, width=48), image_fixtures.corner_mask(32, 48)
    call = dict(image=image, mask_image=mask, strength=0.6, steps=STEPS, guidance=5.0, sampler="ddim")
    requests = [pipe.validate("a red boat", padding_mask_crop=2, seed=3, **call),
                pipe.validate("a red boat", padding_mask_crop=[12], seed=4, **call)]
    boxes = [image_input.crop_regions(r.values)[0] for r in requests]
    assert boxes[0] != boxes[1]
    together = pipe.run(concat(pipe, requests))
    alone = np.concatenate([pipe.run(r) for r in requests])
    assert together.shape == alone.shape == (2, 32, 48, 3)
    diff = px_diff(together, alone)
    print(f"batched vs alone: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.max() <= 2, diff.max()
    assert mean_abs_px(alone[0], alone[1]) > MEAN_TOL  # the boxes count


def test_mask_processing_is_diffusers():
    """Binarized at 0.5 after /255, resized with PIL's lanczos, downsampled nearest at (s i, s j)."""
    import torch
    from diffusers.image_processor import VaeImageProcessor

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (48, 40), dtype=np.uint8)
    processor = VaeImageProcessor(vae_scale_factor=8, do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    theirs = processor.preprocess(_pil(raw), height=32, width=24)  # (1, 1, 32, 24)
    ours = image_input.mask(raw, 24, 32)
    np.testing.assert_array_equal(ours, theirs[0, 0].numpy())
    down = torch.nn.functional.interpolate(theirs, size=(4, 3))[0, 0].numpy()
    np.testing.assert_array_equal(image_input.latent_mask(ours, 8)[..., 0], down)
    rgb = rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)
    pixels = VaeImageProcessor(vae_scale_factor=8).preprocess(_pil(rgb), height=32, width=24)[0].numpy()
    np.testing.assert_allclose(image_input.pixels(rgb, 24, 32), pixels.transpose(1, 2, 0), atol=1e-6)


def test_strength_image_mask_prompt_and_seed_are_data(pipes):
    """One denoising program (and one encode_image program) serves every strength, image, mask,
    prompt and seed; each of them really changes the image."""
    pipe = pipes("sd1")  # its img2img and mask-blending programs: the module's other sd1 tests' too
    traces = TRACES["sd1"]
    image, other = image_fixtures.sample_image(seed=0), image_fixtures.sample_image(seed=9)[::-1].copy()
    mask = image_fixtures.sample_mask()
    common = dict(steps=4, guidance=5.0, sampler="ddim")
    first = pipe.generate("a cat", image=image, strength=0.6, seed=0, **common)
    masked = pipe.generate("a cat", image=image, mask_image=mask, strength=0.6, seed=0, **common)
    traced, compiled = len(traces), len(pipe.executables)
    assert traced >= 2  # the two programs were traced (here or by the test that compiled them first)
    outs = [pipe.generate("a cat", image=image, strength=0.9, seed=0, **common),
            pipe.generate("a cat", image=other, strength=0.6, seed=0, **common),
            pipe.generate("a dog", image=image, strength=0.6, seed=0, **common),
            pipe.generate("a cat", image=image, strength=0.6, seed=7, **common)]
    moved = pipe.generate("a cat", image=image, mask_image=255 - mask, strength=0.6, seed=0, **common)
    cropped = pipe.generate("a cat", image=image, mask_image=mask, strength=0.6, seed=0, padding_mask_crop=2,
                            **common)  # the crop is resized to the call's size: the same programs
    assert len(traces) == traced and len(pipe.executables) == compiled  # no retrace, nothing compiled
    assert all(not np.array_equal(first, o) for o in outs) and not np.array_equal(masked, moved)
    assert not np.array_equal(masked, cropped)


@pytest.mark.parametrize("inputs,argument,words", [
    (dict(strength=0.0), "strength", "outside (0, 1]"),
    (dict(strength=1.5), "strength", "outside (0, 1]"),
    (dict(mask_image=np.zeros((16, 32), np.uint8)), "mask_image", "same size"),
    (dict(padding_mask_crop=2), "padding_mask_crop", "needs mask_image"),
    (dict(mask_image=image_fixtures.sample_mask(), padding_mask_crop=-1), "padding_mask_crop", ">= 0"),
    (dict(mask_image=image_fixtures.sample_mask(), padding_mask_crop=[1, 2]), "padding_mask_crop", "one per image"),
    (dict(mask_image=np.zeros((32, 32), np.uint8), padding_mask_crop=2), "padding_mask_crop", "all black"),
])
def test_bad_image_inputs_are_one_line_errors(pipes, inputs, argument, words):
    with pytest.raises(InvalidArgumentError) as info:
        pipes("sd1").validate("a cat", image=image_fixtures.sample_image(), **inputs)
    assert info.value.argument == argument and words in str(info.value) and "\n" not in str(info.value)


def test_image_inputs_need_an_image_and_inpainting_models_need_both(pipes):
    for inputs, argument in ((dict(strength=0.5), "strength"), (dict(mask_image=image_fixtures.sample_mask()),
                                                               "mask_image")):
        with pytest.raises(InvalidArgumentError) as info:
            pipes("sd1").validate("a cat", **inputs)
        assert info.value.argument == argument
    with pytest.raises(InvalidArgumentError) as info:
        pipes("sd1-inpaint").validate("a cat", image=image_fixtures.sample_image())
    assert info.value.argument == "mask_image"
    with pytest.raises(SchedulerConfigError) as info:  # int(5 * 0.1) = 0 steps: diffusers has nothing to run
        pipes("sd1").check("a cat", image=image_fixtures.sample_image(), strength=0.1, steps=5)  # host side only
    assert info.value.argument == "strength"
    with pytest.raises(InvalidArgumentError) as info:  # Heun's two model calls per step: no blend between them
        pipes("sd1").check("a cat", image=image_fixtures.sample_image(), mask_image=image_fixtures.sample_mask(),
                           sampler="heun")
    assert info.value.argument == "sampler"


def test_img2img_size_is_the_images_rounded():
    assert image_input.image_size(np.zeros((37, 50, 3), np.uint8), 8) == (48, 32)
