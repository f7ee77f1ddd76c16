"""``backend="torch"`` with the JAX engine's second model folders: a ControlNet (diffusers'
StableDiffusion[XL]ControlNet[Img2Img|Inpaint]Pipeline) and SDXL's refiner (diffusers' two-pipeline
ensemble of experts), against preheat's JAX pixels on tiny random folders, from the same seeds; and
the one-line refusals both backends share."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

import preheat  # noqa: E402
from preheat.errors import InvalidArgumentError, PreheatError  # noqa: E402
from tests._support import image_fixtures  # noqa: E402
from tests._support.controlnet_fixtures import control_image, save_tiny_controlnet  # noqa: E402
from tests._support.numerics import assert_pixels_close, mean_abs_px  # noqa: E402


@pytest.fixture(scope="module")
def controlnet_folders(tmp_path_factory):
    """kind -> (pipeline folder, ControlNet folder): ``image_fixtures`` folders (a VAE posterior of
    negligible variance: img2img's start is the same on both backends), built on first use."""
    root = tmp_path_factory.mktemp("torch-controlnet")
    built = {}

    def get(kind):
        if kind not in built:
            sd = image_fixtures.save_image_sd(root / kind, kind)
            built[kind] = (sd, save_tiny_controlnet(root / f"{kind}-controlnet", sd))
        return built[kind]

    return get


@pytest.fixture(scope="module")
def ensemble_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch-ensemble")
    return (image_fixtures.save_image_sd(root / "base", "sdxl"),
            image_fixtures.save_image_sd(root / "refiner", "sdxl-refiner", seed=3))


def _both(folder, call, **load):
    """(torch's pixels, JAX's pixels) of one call, each backend loaded with ``load``."""
    theirs = preheat.load(folder, backend="torch", **load).generate("a red boat", **call)
    ours = preheat.load(folder, cache="off", **load).generate("a red boat", **call)
    return theirs, ours


CONTROL_CASES = [
    pytest.param("sd1", dict(sampler="euler", controlnet_conditioning_scale=0.7, control_guidance_start=0.25,
                             control_guidance_end=0.75), id="sd1-text-window"),
    pytest.param("sd1", dict(sampler="euler", image=True, strength=0.6), id="sd1-img2img", marks=pytest.mark.slow),
    pytest.param("sd1", dict(sampler="ddim", image=True, mask_image=True, strength=0.6), id="sd1-inpaint",
                 marks=pytest.mark.slow),
    pytest.param("sdxl", dict(sampler="dpmpp_2m", controlnet_conditioning_scale=1.3, control_guidance_end=0.5),
                 id="sdxl-text", marks=pytest.mark.slow),
    pytest.param("sdxl", dict(sampler="euler", image=True, strength=0.6, controlnet_conditioning_scale=1.5,
                              control_guidance_start=0.5),
                 id="sdxl-img2img", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,case", CONTROL_CASES)
def test_torch_controlnet_calls_match_the_jax_engine(controlnet_folders, kind, case):
    """diffusers' ControlNet pipeline of the call's kind on the family's declared inputs: the control
    image resized to width x height by its processor as by the JAX engine's, the scale, the window
    (over the steps strength leaves), the image pipelines' ε from the same seed."""
    sd, cn = controlnet_folders(kind)
    case = dict(case)
    if case.pop("image", False):
        case["image"] = image_fixtures.sample_image(seed=1)
    if case.pop("mask_image", False):
        case["mask_image"] = image_fixtures.sample_mask()
    call = dict(steps=4, guidance=5.0, seed=3, control_image=control_image(seed=2), **case)
    theirs, ours = _both(sd, call, controlnet=cn)
    assert_pixels_close(theirs, ours, shape=(1, 32, 32, 3))
    off = preheat.load(sd, backend="torch", controlnet=cn).generate(
        "a red boat", **{**call, "controlnet_conditioning_scale": 0.0})
    assert mean_abs_px(theirs, off) > 2.0  # the ControlNet moved torch's pixels (one that never ran would not)


ENSEMBLE_CASES = [
    pytest.param(dict(sampler="dpmpp_2m", steps=8, denoising_end=0.5, guidance=6.0, negative_prompt="blurry",
                      aesthetic_score=7.5, negative_aesthetic_score=1.5), id="dpmpp_2m-0.5-scores"),
    pytest.param(dict(sampler="euler", steps=6, denoising_end=0.8, n=2, seed=[3, 4]), id="euler-0.8-two",
                 marks=pytest.mark.slow),
    pytest.param(dict(sampler="euler", steps=6, denoising_end=0.5, original_size=(40, 48),
                      crops_coords_top_left=(2, 3), negative_original_size=(30, 30), negative_target_size=(32, 32),
                      negative_crops_coords_top_left=(1, 1)), id="euler-sizes", marks=pytest.mark.slow),
    pytest.param(dict(sampler="euler", steps=5, denoising_end=0.05), id="refiner-alone", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", ENSEMBLE_CASES)
def test_torch_ensemble_matches_the_jax_engine(ensemble_folders, case):
    """diffusers' recipe -- the base to denoising_end as latents, the refiner from there with a fresh
    scheduler of the same sampler, its own encoder and aesthetic ids from the call's sizes -- draws
    the JAX engine's one-program ensemble."""
    base, refiner = ensemble_folders
    call = {"guidance": 5.0, "seed": 3, **case}
    theirs, ours = _both(base, call, refiner=refiner)
    assert_pixels_close(theirs, ours, shape=(call.get("n", 1), 32, 32, 3))


def test_torch_ensemble_at_one_is_the_base_alone(ensemble_folders):
    """denoising_end=1: no handoff, the base's image (diffusers' refiner would take denoising_start=1
    as none, and refine the latents at its default strength); below it the refiner moves the image."""
    base, refiner = ensemble_folders
    pipe = preheat.load(base, backend="torch", refiner=refiner)
    call = dict(steps=5, guidance=5.0, seed=4, sampler="euler")
    alone = preheat.load(base, backend="torch").generate("a cat", **call)
    np.testing.assert_array_equal(pipe.generate("a cat", denoising_end=1.0, **call), alone)
    assert mean_abs_px(pipe.generate("a cat", denoising_end=0.6, **call), alone) > 1.0


def _one_line(error, fn, words, argument=None):
    with pytest.raises(error) as info:
        fn()
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    if argument is not None:
        assert info.value.argument == argument


def test_what_the_torch_backend_cannot_load_or_run_is_one_line(controlnet_folders, ensemble_folders, tmp_path):
    """The JAX engine's refusals (the same checks: whom a folder applies to, a ControlNet that does
    not fit, a window or handoff the sampler cannot take, control inputs without a ControlNet), and
    the torch backend's own: a custom schedule diffusers' ControlNet img2img pipeline takes none of."""
    from tests._support.reference import save_tiny_pipeline

    sd, cn = controlnet_folders("sd1")
    base, refiner = ensemble_folders
    _one_line(InvalidArgumentError, lambda: preheat.load(sd, backend="torch", refiner=refiner),
              "refiner applies to SDXL base models", "refiner")
    pixel = save_tiny_pipeline(tmp_path / "pixel")
    _one_line(InvalidArgumentError, lambda: preheat.load(pixel, backend="torch", controlnet=cn),
              "controlnet applies to Stable Diffusion 1.x/2.x and SDXL models", "controlnet")
    _one_line(PreheatError, lambda: preheat.load(base, backend="torch", controlnet=cn), "does not fit this model")
    _one_line(PreheatError, lambda: preheat.load(refiner, backend="torch", refiner=refiner),
              "a refiner with an SDXL refiner is not supported")
    _one_line(PreheatError, lambda: preheat.load(base, backend="torch", refiner=base), "is not an SDXL refiner")

    plain, pipe = preheat.load(sd, backend="torch"), preheat.load(sd, backend="torch", controlnet=cn)
    image = control_image()
    _one_line(InvalidArgumentError, lambda: plain.generate("a cat", steps=2, control_image=image),
              "control_image needs a ControlNet", "control_image")
    _one_line(InvalidArgumentError, lambda: pipe.generate("a cat", steps=4, control_image=image, sampler="heun",
                                                          control_guidance_end=0.5), "'heun' does not")
    _one_line(InvalidArgumentError, lambda: pipe.generate("a cat", control_image=image,
                                                          image=image_fixtures.sample_image(), strength=1.0,
                                                          timesteps=[999, 500]),
              "StableDiffusionControlNetImg2ImgPipeline takes none", "timesteps")
    ensemble = preheat.load(base, backend="torch", refiner=refiner)
    _one_line(InvalidArgumentError, lambda: ensemble.generate("a cat", steps=4, sampler="heun", denoising_end=0.5),
              "cannot hand over to the refiner", "sampler")
    _one_line(InvalidArgumentError, lambda: ensemble.generate("a cat", image=image_fixtures.sample_image()),
              "not supported with a refiner yet", "image")


@pytest.mark.slow  # torch.compile on the CPU, twice (the ControlNet and the refiner's UNet beside the denoiser)
def test_inductor_compiles_the_second_model_with_the_denoiser(controlnet_folders, ensemble_folders):
    """compile="inductor": the ControlNet (its scale a tensor: a new scale or window compiles no new
    graph) and an ensemble's refiner UNet are compiled in the warm-up beside the denoiser, and draw
    eager's pixels."""
    import torch

    sd, cn = controlnet_folders("sd1")
    eager = preheat.load(sd, backend="torch", controlnet=cn)
    compiled = preheat.load(sd, backend="torch", controlnet=cn, compile="inductor", cache="off")
    ctrl = control_image(seed=2)
    for i, window in enumerate((dict(controlnet_conditioning_scale=0.7, control_guidance_end=0.5),
                                dict(controlnet_conditioning_scale=1.3, control_guidance_start=0.25))):
        call = dict(steps=4, guidance=5.0, seed=3, sampler="euler", control_image=ctrl, **window)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert_pixels_close(compiled.generate("a red boat", **call), eager.generate("a red boat", **call))
        if i:  # the same graphs: the scale and window are data
            assert compiled.last.cache_layer == "memory"
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    base, refiner = ensemble_folders
    eager = preheat.load(base, backend="torch", refiner=refiner)
    compiled = preheat.load(base, backend="torch", refiner=refiner, compile="inductor", cache="off")
    call = dict(steps=6, guidance=5.0, seed=3, sampler="euler", denoising_end=0.5)
    assert_pixels_close(compiled.generate("a fox", **call), eager.generate("a fox", **call))
    assert compiled.last.compile_s > 0 and getattr(compiled.refiner.unet, "_preheat_compiled", False)
