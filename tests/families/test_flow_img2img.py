"""Flux and SD3 img2img through preheat.load, against diffusers' ``FluxImg2ImgPipeline`` and
``StableDiffusion3Img2ImgPipeline`` on tiny random folders whose VAE posterior has negligible
variance, with the ε diffusers draws (replayed from its generators) given as ``noise``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import preheat
from preheat.cache.executables import Executables
from preheat.errors import PreheatError
from tests._support.flow_fixtures import picture, reference_pipeline, replayed_noise, save_tiny_flow_model
from tests._support.numerics import mean_abs_px, px_diff


MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255
MAX_TOL = 8
IMG2IMG_CLASS = {"flux-dev": "FluxImg2ImgPipeline", "sd3": "StableDiffusion3Img2ImgPipeline"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("flow-img2img")
    return {"flux-dev": save_tiny_flow_model(base / "flux", "flux-dev", quiet_posterior=True),
            "sd3": save_tiny_flow_model(base / "sd3", "sd3", t5=False, quiet_posterior=True)}


@pytest.fixture(scope="module")
def pipes(folders):
    return {name: preheat.load(folder, cache="off") for name, folder in folders.items()}


def _reference(folder, name: str):
    import diffusers

    return getattr(diffusers, IMG2IMG_CLASS[name]).from_pipe(reference_pipeline(folder))


def _theirs(ref, prompt, image: np.ndarray, seeds, **kwargs) -> np.ndarray:
    import torch
    from PIL import Image

    with torch.no_grad():
        n = len(prompt) if isinstance(prompt, list) else 1
        out = ref(prompt=prompt, image=[Image.fromarray(image)] * n, output_type="np",
                  generator=[torch.Generator().manual_seed(s) for s in seeds], **kwargs).images
    return (np.asarray(out) * 255).round().astype(np.uint8)


CASES = [  # (family, prompt, strength, steps, guidance, image size, other inputs): 0.6 of 4 steps starts at
    #         int(1.6) = 1
    ("flux-dev", "a watercolor fox", 0.6, 4, 3.5, (32, 32), {}),
    ("flux-dev", ["a red fox", "city at night"], 0.5, 4, 2.0, (40, 36), {}),  # resized to 32x32, two images
    ("flux-dev", "a watercolor fox", 1.0, 3, 3.5, (32, 32), {}),  # strength 1: every step, the image still noised in
    # FluxImg2ImgPipeline's true CFG: the negatives' branch from the same start
    ("flux-dev", "a watercolor fox", 0.6, 4, 3.5, (32, 32), dict(negative_prompt="blurry", true_cfg_scale=3.0)),
    ("sd3", "a photo of a dog", 0.75, 4, 5.0, (32, 32), {}),  # classifier-free guidance
    ("sd3", ["a red fox", "a cat"], 0.6, 5, 4.0, (32, 32), {}),
]


@pytest.mark.parametrize("name,prompt,strength,steps,guidance,size,other", CASES,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_matches_diffusers_from_the_same_noise(folders, pipes, name, prompt, strength, steps, guidance, size, other):
    n = len(prompt) if isinstance(prompt, list) else 1
    seeds = list(range(3, 3 + n))
    image = picture(*size, seed=1)
    # diffusers gets the image once per prompt (SD3's img2img cannot spread one image over a list of
    # generators): each generator draws that image's posterior sample, then its ε
    noise = replayed_noise((1, 4, 16, 16), seeds, 1)
    theirs = _theirs(_reference(folders[name], name), prompt, image, seeds, strength=strength,
                     num_inference_steps=steps, guidance_scale=guidance, height=32, width=32, **other)
    ours = pipes[name].generate(prompt, image=image, strength=strength, noise=noise, steps=steps,
                                guidance=guidance, width=32, height=32, **other)
    assert ours.shape == theirs.shape == (n, 32, 32, 3)
    diff = px_diff(ours, theirs)
    print(f"{name} strength {strength}: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= MEAN_TOL and diff.max() <= MAX_TOL, (diff.mean(), diff.max())
    assert ours.std() > 5


def test_the_output_is_the_images_size_and_low_strength_stays_close(pipes):
    pipe = pipes["flux-dev"]
    image = picture(50, 34, seed=2)
    out = pipe.generate("a fox", image=image, strength=0.25, steps=4, seed=0)
    assert out.shape == (1, 32, 48, 3)  # rounded down to the packing's multiple (4 px here)
    far = pipe.generate("a fox", image=image, strength=1.0, steps=4, seed=0)
    near_error = mean_abs_px(out, image[:32, :48])
    far_error = mean_abs_px(far, image[:32, :48])
    assert near_error < far_error  # one step from the image keeps more of it than four from noise


@pytest.mark.parametrize("name", ["flux-dev", "sd3"])
def test_strength_image_prompt_and_seed_are_data(pipes, name):
    pipe = dataclasses.replace(pipes[name], executables=Executables())
    traces = []
    apply = pipe.apply

    def counting(*args):
        traces.append(1)
        return apply(*args)

    pipe.apply = counting
    call = dict(steps=4, width=32, height=32)
    first = pipe.generate("a fox", image=picture(32, 32), strength=0.6, seed=0, **call)
    traced, compiled = len(traces), len(pipe.executables)
    outs = [pipe.generate("a fox", image=picture(32, 32), strength=0.3, seed=0, **call),
            pipe.generate("a fox", image=picture(32, 32, seed=5), strength=0.6, seed=0, **call),
            pipe.generate("a cat", image=picture(32, 32), strength=0.6, seed=0, **call),
            pipe.generate("a fox", image=picture(32, 32), strength=0.6, seed=9, **call)]
    assert len(traces) == traced and len(pipe.executables) == compiled  # no retrace, nothing compiled
    assert all(not np.array_equal(first, o) for o in outs)


@pytest.mark.parametrize("kwargs,argument,needle", [
    (dict(image=picture(32, 32), strength=0.0), "strength", "outside (0, 1]"),
    (dict(image=picture(32, 32), strength=1.5), "strength", "outside (0, 1]"),
    (dict(strength=0.5), "strength", "strength needs image"),
])
def test_bad_input_is_one_line(pipes, kwargs, argument, needle):
    call = {"steps": 2, **kwargs}
    for name in ("flux-dev", "sd3"):
        with pytest.raises(PreheatError) as err:
            pipes[name].check("x", **call)
        assert err.value.argument == argument and needle in str(err.value), str(err.value)
        assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("name,guidance", [("flux-dev", 3.5), ("sd3", 5.0)])
def test_torch_backend_draws_the_same_images(folders, pipes, name, guidance):
    """backend="torch" runs diffusers' own img2img pipeline, its scale_noise given the JAX engine's ε."""
    torch_pipe = preheat.load(folders[name], backend="torch")
    call = dict(image=picture(40, 36, seed=4), strength=0.6, steps=4, seed=[4, 5], guidance=guidance,
                width=32, height=32)
    theirs = torch_pipe.generate(["a red fox", "a cat"], **call)
    ours = pipes[name].generate(["a red fox", "a cat"], **call)
    assert ours.shape == theirs.shape == (2, 32, 32, 3)
    diff = px_diff(ours, theirs)
    assert diff.mean() <= MEAN_TOL and diff.max() <= MAX_TOL, (diff.mean(), diff.max())
