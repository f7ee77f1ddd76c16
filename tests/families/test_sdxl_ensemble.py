"""SDXL's ensemble of experts (``preheat.load(base, refiner=REFINER)``, ``preheat.families.experts``)
against diffusers' two-pipeline recipe on tiny random folders: ``StableDiffusionXLPipeline`` with
``denoising_end`` and ``output_type="latent"``, then ``StableDiffusionXLImg2ImgPipeline`` on those
latents with ``denoising_start``, the base's VAE shared (diffusers' docs); one program for every
handoff; and the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError, PreheatError
from tests._support import image_fixtures, sd_fixtures
from tests._support.numerics import assert_pixels_close, counting_traces, mean_abs_px

SHAPE = (1, 4, 16, 16)  # one image's latents, NCHW (32x32 pixels, VAE factor 2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ensemble")
    return (image_fixtures.save_image_sd(root / "base", "sdxl"),
            image_fixtures.save_image_sd(root / "refiner", "sdxl-refiner", seed=3))


@pytest.fixture(scope="module")
def pipe(folders):
    base, refiner = folders
    return preheat.load(base, refiner=refiner, cache="off")


def _diffusers(folders, sampler: str, prompt: str, noise: np.ndarray, steps: int, fraction: float,
               **extra) -> np.ndarray:
    """diffusers' recipe: the base's latents at ``denoising_end``, the refiner on from there."""
    import torch

    base = sd_fixtures.reference_pipeline(folders[0], sampler)
    refiner = sd_fixtures.reference_pipeline(folders[1], sampler)  # its StableDiffusionXLImg2ImgPipeline
    refiner.vae = base.vae
    refiner_extra = {k: v for k, v in extra.items() if k in ("aesthetic_score", "negative_aesthetic_score",
                                                            "negative_prompt", "guidance_scale")}
    base_extra = {k: v for k, v in extra.items() if k not in ("aesthetic_score", "negative_aesthetic_score")}
    with torch.no_grad():
        latents = base(prompt=prompt, latents=torch.from_numpy(noise), num_inference_steps=steps,
                       denoising_end=fraction, output_type="latent", **base_extra).images
        out = refiner(prompt=prompt, image=latents, num_inference_steps=steps, denoising_start=fraction,
                      output_type="np", **refiner_extra).images
    return (np.asarray(out) * 255).round().astype(np.uint8)


@pytest.mark.parametrize("sampler,steps,fraction,extra", [
    ("euler", 10, 0.8, dict(guidance_scale=5.0)),
    pytest.param("dpmpp_2m", 8, 0.5, dict(guidance_scale=6.0, negative_prompt="blurry", aesthetic_score=7.5,
                                          negative_aesthetic_score=1.5), marks=pytest.mark.slow),
], ids=["euler-0.8", "dpmpp_2m-0.5-negative-scores"])  # (dpm++'s restart alone: tests/samplers/test_start.py)
def test_the_ensemble_matches_diffusers_two_pipelines(folders, pipe, sampler, steps, fraction, extra):
    """The base's steps above the cutoff, the refiner's below from the same latents (no noise added),
    its scheduler fresh (dpm++ 2M first order again at the handoff), its own encoder and ids."""
    noise = np.random.default_rng(7).standard_normal(SHAPE).astype(np.float32)
    theirs = _diffusers(folders, sampler, "a watercolor fox", noise, steps, fraction, **extra)
    ours_extra = {{"guidance_scale": "guidance"}.get(k, k): v for k, v in extra.items()}
    ours = pipe.generate("a watercolor fox", noise=noise, steps=steps, sampler=sampler, denoising_end=fraction,
                         **ours_extra)
    assert_pixels_close(ours, theirs, shape=(1, 32, 32, 3))


def test_the_handoff_is_data_and_each_expert_counts(pipe):
    """One program serves every denoising_end; the refiner's share moves the image (a refiner that
    never ran would leave 0.5 and 1 alike), and 1 is the base alone."""
    counted, traces = counting_traces(pipe)
    common = dict(steps=6, guidance=5.0, seed=0)
    images = {0.8: counted.generate("a red boat", denoising_end=0.8, **common)}
    traced = len(traces)
    images.update({f: counted.generate("a red boat", denoising_end=f, **common) for f in (0.5, 1.0, 0.3)})
    assert traced and len(traces) == traced
    assert mean_abs_px(images[0.8], images[0.5]) > 1.0
    assert mean_abs_px(images[0.8], images[1.0]) > 1.0


@pytest.mark.slow  # loads the base alone too, and a diffusers reference
def test_the_base_alone_at_one_the_refiner_alone_near_zero(folders, pipe):
    """denoising_end=1: every step the base's, as the base loaded alone draws it; a fraction that
    leaves the base no step: the refiner's from the noise, as diffusers' recipe (its base returns
    the noise, its refiner runs every step)."""
    base = preheat.load(folders[0], cache="off")
    common = dict(steps=5, guidance=5.0, seed=4)
    assert np.array_equal(pipe.generate("a cat", denoising_end=1.0, **common), base.generate("a cat", **common))
    noise = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    theirs = _diffusers(folders, "euler", "a cat", noise, 5, 0.05, guidance_scale=5.0)
    ours = pipe.generate("a cat", noise=noise, steps=5, guidance=5.0, sampler="euler", denoising_end=0.05)
    assert_pixels_close(ours, theirs, shape=(1, 32, 32, 3))


@pytest.mark.parametrize("inputs,argument,words", [
    (dict(sampler="heun", denoising_end=0.5), "sampler", "cannot hand over to the refiner"),
    (dict(image=image_fixtures.sample_image()), "image", "not supported with a refiner yet"),
    (dict(denoising_end=1.5), "denoising_end", "denoising_end"),
])
def test_what_the_ensemble_cannot_run_is_one_line(pipe, inputs, argument, words):
    with pytest.raises(InvalidArgumentError) as info:
        pipe.check("a cat", **inputs)
    assert info.value.argument == argument and words in str(info.value) and "\n" not in str(info.value)


def test_refiner_inputs_without_a_refiner_say_how_to_load_one(folders):
    base = preheat.load(folders[0], cache="off")
    for name, value in (("denoising_end", 0.8), ("aesthetic_score", 6.0)):
        with pytest.raises(InvalidArgumentError) as info:
            base.validate("a cat", **{name: value})
        assert info.value.argument == name and "refiner=FOLDER" in str(info.value)


def test_a_refiner_that_does_not_fit_is_one_line(folders, tmp_path):
    base, refiner = folders
    cases = [(dict(model=refiner, refiner=refiner), "a refiner with an SDXL refiner is not supported"),
             (dict(model=base, refiner=base), "is not an SDXL refiner"),
             (dict(model=image_fixtures.save_image_sd(tmp_path / "sd1", "sd1"), refiner=refiner),
              "refiner applies to SDXL base models")]
    for kwargs, words in cases:
        with pytest.raises(PreheatError) as info:
            preheat.load(kwargs.pop("model"), cache="off", **kwargs)
        assert words in str(info.value) and "\n" not in str(info.value)
