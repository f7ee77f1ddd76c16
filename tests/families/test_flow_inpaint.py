"""Flux and SD3 inpainting on base folders (the mask blended after each step) through preheat.load,
against diffusers' ``FluxInpaintPipeline`` and ``StableDiffusion3InpaintPipeline`` on tiny random
folders whose VAE posterior has negligible variance, with the ε diffusers draws (replayed from its
generators: the image's posterior sample first, then ε) given as ``noise``.

SD3's folder has 16 latent channels: diffusers' SD3 inpaint pipeline blends only for a 16-channel
transformer. Its decode drops the VAE's ``shift_factor`` (diffusers issue 13611, item 1; every other
SD3 pipeline adds it), so its reference here is its own latents decoded as its img2img pipeline
decodes them."""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError
from tests._support.flow_fixtures import picture, reference_pipeline, replayed_noise, save_tiny_flow_model
from tests._support.numerics import assert_pixels_close, counting_traces, px_diff


INPAINT_CLASS = {"flux-dev": "FluxInpaintPipeline", "sd3": "StableDiffusion3InpaintPipeline"}
CHANNELS = {"flux-dev": 4, "sd3": 16}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("flow-inpaint")
    return {"flux-dev": save_tiny_flow_model(base / "flux", "flux-dev", quiet_posterior=True),
            "sd3": save_tiny_flow_model(base / "sd3", "sd3", t5=False, quiet_posterior=True, latent_channels=16)}


@pytest.fixture(scope="module")
def pipes(folders):
    return {name: preheat.load(folder, cache="off") for name, folder in folders.items()}


@pytest.fixture(scope="module")
def references(folders):
    import diffusers

    return {name: getattr(diffusers, INPAINT_CLASS[name]).from_pipe(reference_pipeline(folder))
            for name, folder in folders.items()}


def mask_of(width: int, height: int) -> np.ndarray:
    """White (repaint) in a box off centre, with a soft column that binarizes to repaint."""
    m = np.zeros((height, width), np.uint8)
    m[height // 4: 3 * height // 4, width // 3: width - 4] = 255
    m[height // 4: 3 * height // 4, width // 3 - 1] = 140
    return m


def _theirs(ref, name: str, prompt, image: np.ndarray, mask: np.ndarray, seeds, **kwargs) -> np.ndarray:
    """diffusers' uint8 (n, H, W, 3); SD3's latents decoded with the VAE's shift (see the module docstring)."""
    import torch
    from PIL import Image

    n = len(prompt) if isinstance(prompt, list) else 1
    crop = "padding_mask_crop" in kwargs
    call = dict(prompt=prompt, image=Image.fromarray(image) if crop else [Image.fromarray(image)] * n,
                mask_image=Image.fromarray(mask), generator=[torch.Generator().manual_seed(s) for s in seeds],
                output_type="pil" if crop else ("latent" if name == "sd3" else "np"), **kwargs)
    with torch.no_grad():
        out = ref(**call).images
        if name == "sd3" and not crop:
            vae = ref.vae
            decoded = vae.decode(out / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
            out = ref.image_processor.postprocess(decoded, output_type="np")
    if crop:
        return np.stack([np.asarray(o.convert("RGB")) for o in out])
    return (np.asarray(out) * 255).round().astype(np.uint8)


CASES = [  # (family, prompt, strength, steps, guidance, image size): 0.6 of 4 steps starts at int(1.6) = 1
    ("flux-dev", "a watercolor fox", 0.6, 4, 3.5, (32, 32)),
    ("flux-dev", ["a red fox", "city at night"], 1.0, 3, 2.0, (40, 36)),  # image and mask resized to 32x32
    ("sd3", "a photo of a dog", 0.75, 4, 5.0, (32, 32)),  # classifier-free guidance
    ("sd3", ["a red fox", "a cat"], 1.0, 3, 4.0, (40, 36)),  # is_strength_max: from the noise alone
]


@pytest.mark.parametrize("name,prompt,strength,steps,guidance,size", CASES,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_matches_diffusers_from_the_same_noise(references, pipes, name, prompt, strength, steps, guidance, size):
    n = len(prompt) if isinstance(prompt, list) else 1
    seeds = list(range(3, 3 + n))
    image, mask = picture(*size, seed=1), mask_of(*size)
    noise = replayed_noise((1, CHANNELS[name], 16, 16), seeds, 1)
    theirs = _theirs(references[name], name, prompt, image, mask, seeds, strength=strength,
                     num_inference_steps=steps, guidance_scale=guidance, height=32, width=32)
    ours = pipes[name].generate(prompt, image=image, mask_image=mask, strength=strength, noise=noise, steps=steps,
                                guidance=guidance, width=32, height=32)
    assert_pixels_close(ours, theirs, shape=(n, 32, 32, 3))
    if size == (32, 32):  # black mask pixels: the image, through the VAE (a tiny random one: loosely)
        kept = mask_of(*size) == 0
        img2img = pipes[name].generate(prompt, image=image, strength=strength, noise=noise, steps=steps,
                                       guidance=guidance, width=32, height=32)
        err = lambda out: px_diff(out[0], image)[kept].mean()  # noqa: E731
        assert err(ours) < err(img2img)  # the blend keeps more of the image than img2img does


def test_padding_mask_crop_matches_diffusers(references, pipes):
    """Flux: the mask's box (padded, grown to square, shifted back inside) filled to 32x32,
    inpainted, pasted back: the image's size, the kept pixels the image's own."""
    image, mask = picture(48, 32, seed=2), np.zeros((32, 48), np.uint8)
    mask[26:31, 34:42] = 255
    noise = replayed_noise((1, 4, 16, 16), [7], 1)
    theirs = _theirs(references["flux-dev"], "flux-dev", "a cat", image, mask, [7], strength=0.6,
                     num_inference_steps=3, guidance_scale=3.5, height=32, width=32, padding_mask_crop=2)
    ours = pipes["flux-dev"].generate("a cat", image=image, mask_image=mask, strength=0.6, noise=noise, steps=3,
                                      guidance=3.5, width=32, height=32, padding_mask_crop=2)
    assert_pixels_close(ours, theirs, shape=(1, 32, 48, 3))
    np.testing.assert_array_equal(ours[0][mask == 0], image[mask == 0])


@pytest.mark.parametrize("name", ["flux-dev", "sd3"])
def test_image_mask_strength_prompt_and_seed_are_data(pipes, name):
    pipe, traces = counting_traces(pipes[name])
    call = dict(steps=3, width=32, height=32)
    first = pipe.generate("a fox", image=picture(32, 32), mask_image=mask_of(32, 32), strength=0.6, seed=0, **call)
    traced, compiled = len(traces), len(pipe.executables)
    outs = [pipe.generate("a fox", image=picture(32, 32, seed=5), mask_image=mask_of(32, 32), strength=0.6, seed=0,
                          **call),
            pipe.generate("a fox", image=picture(32, 32), mask_image=255 - mask_of(32, 32), strength=0.6, seed=0,
                          **call),
            pipe.generate("a fox", image=picture(32, 32), mask_image=mask_of(32, 32), strength=1.0, seed=0, **call),
            pipe.generate("a cat", image=picture(32, 32), mask_image=mask_of(32, 32), strength=0.6, seed=0, **call),
            pipe.generate("a fox", image=picture(32, 32), mask_image=mask_of(32, 32), strength=0.6, seed=9, **call)]
    assert len(traces) == traced and len(pipe.executables) == compiled  # no retrace, nothing compiled
    assert all(not np.array_equal(first, o) for o in outs)


def test_bad_input_is_one_line_naming_it(pipes, tmp_path):
    text = tmp_path / "mask.png"
    text.write_text("not an image")
    cases = [(dict(mask_image=np.zeros((16, 32), np.uint8)), "mask_image", "must be the same size"),
             (dict(mask_image=str(text)), "mask_image", ""),
             (dict(image=None), "mask_image", "needs image"),
             (dict(sampler="flow_heun"), "sampler", "cannot blend")]
    for name, pipe in pipes.items():
        for kwargs, argument, needle in cases:
            if "sampler" in kwargs and name != "sd3":
                continue  # Flux runs flow_euler only
            call = dict(image=picture(32, 32), mask_image=mask_of(32, 32), width=32, height=32, steps=2)
            with pytest.raises(InvalidArgumentError) as err:
                pipe.check("x", **{**call, **kwargs})
            assert err.value.argument == argument and needle in str(err.value), str(err.value)
            assert "\n" not in str(err.value)


def test_defaults_and_inputs(pipes):
    request = pipes["flux-dev"].validate("x", image=picture(40, 36), mask_image=mask_of(40, 36))
    assert request.values["strength"] == 0.6  # FluxInpaintPipeline's
    assert (request.values["width"], request.values["height"]) == pipes["flux-dev"].family.native_size(
        pipes["flux-dev"])  # an inpainting call's size: width x height, else the native size
    for pipe in pipes.values():  # declared inputs: every surface and warm-up derive them
        names = {s.name for s in pipe.family.input_specs(pipe)}
        assert {"image", "mask_image", "strength", "padding_mask_crop"} <= names
        variants = {tuple(sorted(v)) for v in pipe.family.warm_inputs(pipe, guided=False)}
        assert ("image", "mask_image", "prompt", "strength") in variants, variants


@pytest.mark.parametrize("name,strength,guidance", [("flux-dev", 0.6, 3.5), ("sd3", 1.0, 5.0)])
def test_torch_backend_runs_diffusers_inpaint_pipeline(folders, pipes, name, strength, guidance):
    """backend="torch": FluxInpaintPipeline / StableDiffusion3InpaintPipeline, their scale_noise
    (at the start and in every blend) given the JAX engine's ε; SD3's decode given the VAE's shift."""
    torch_pipe = preheat.load(folders[name], backend="torch")
    call = dict(image=picture(40, 36, seed=4), mask_image=mask_of(40, 36), strength=strength, steps=3, seed=[4, 5],
                guidance=guidance, width=32, height=32)
    theirs = torch_pipe.generate(["a red fox", "a cat"], **call)
    ours = pipes[name].generate(["a red fox", "a cat"], **call)
    assert_pixels_close(ours, theirs, shape=(2, 32, 32, 3))
