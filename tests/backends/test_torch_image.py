"""``backend="torch"`` runs diffusers' own img2img and inpaint pipelines from the JAX engine's ε
(``preheat.backends.torch.image``), so the two backends' image-conditioned calls agree."""

from __future__ import annotations

import pytest

import preheat
from preheat.errors import InvalidArgumentError
from tests._support import image_fixtures
from tests._support.numerics import px_diff

STEPS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return image_fixtures.save_image_sd(tmp_path_factory.mktemp("torch-image") / "sd1", "sd1")


CASES = [dict(strength=0.6, sampler="euler"),  # img2img: the start's add_noise
         dict(strength=0.6, sampler="ddim", mask=True),  # blending: add_noise after every step too
         dict(strength=1.0, sampler="ddim", mask=True),  # is_strength_max: the ε as latents
         dict(strength=0.6, sampler="ddim", mask=True, padding_mask_crop=2)]  # diffusers' own crop and paste


@pytest.mark.parametrize("case", [pytest.param(c, id=i, marks=pytest.mark.slow if i in ("blend-strength-1", "blend-crop") else ())
                                  for c, i in zip(CASES, ["img2img", "blend", "blend-strength-1", "blend-crop"])])  # make test: two
def test_torch_image_calls_match_the_jax_engine(folder, case):
    case = dict(case)
    extra = {"mask_image": image_fixtures.sample_mask()} if case.pop("mask", False) else {}
    call = dict(image=image_fixtures.sample_image(seed=2), steps=STEPS, guidance=5.0, seed=11, **case, **extra)
    torch_pipe = preheat.load(folder, backend="torch")
    theirs = torch_pipe.generate("a lighthouse", **call)
    ours = preheat.load(folder, cache="off").generate("a lighthouse", **call)  # its ε from the same seed
    assert ours.shape == theirs.shape == (1, 32, 32, 3)
    diff = px_diff(ours, theirs)
    assert diff.mean() <= 1.0 and diff.max() <= 8, (diff.mean(), diff.max())
    assert ours.std() > 5
    if "padding_mask_crop" in call:  # diffusers crops once per call: one padding for all images
        with pytest.raises(InvalidArgumentError) as info:
            torch_pipe.generate("a lighthouse", **{**call, "n": 2, "padding_mask_crop": [2, 3]})
        assert info.value.argument == "padding_mask_crop" and "\n" not in str(info.value)


@pytest.mark.slow  # torch.compile on the CPU
def test_inductor_warms_up_on_the_call_s_own_image_pipeline(folder):
    """``compile="inductor"`` warms the denoiser with one step of the call's own pipeline (the img2img
    or inpaint one, at strength 1, without its crop) on generators of its own: an image call then
    draws eager's pixels (the same posterior sample and step noise), where a warm-up on the text
    pipeline could not run a refiner's or an inpainting UNet's call, and one on the call's own
    generators would have advanced them."""
    eager, compiled = preheat.load(folder, backend="torch"), preheat.load(folder, backend="torch", compile="inductor")
    for i, case in enumerate((dict(strength=0.6, sampler="euler_a"),
                              dict(strength=0.6, sampler="ddim", mask_image=image_fixtures.sample_mask(),
                                   padding_mask_crop=2))):
        call = dict(image=image_fixtures.sample_image(seed=2), steps=STEPS, guidance=5.0, seed=11, **case)
        want, got = eager.generate("a lighthouse", **call), compiled.generate("a lighthouse", **call)
        diff = px_diff(want, got)
        assert diff.mean() <= 1.0 and diff.max() <= 8, (case["sampler"], diff.mean(), diff.max())
        # the first call compiled the denoiser (the second reuses it: the same model batch and size)
        assert compiled.last.compile_s > 0 if i == 0 else compiled.last.cache_layer == "memory", compiled.last
