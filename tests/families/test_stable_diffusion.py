"""SD 1.x, SD 2.x (v-prediction) and SDXL through preheat.load, against diffusers' own pipelines
on the same tiny random-weight folders and the same initial latents."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import preheat
from preheat.cache.executables import Executables
from preheat.errors import InvalidArgumentError, ModelNotFoundError, PreheatError, UnsupportedConfigError
from tests._support.numerics import mean_abs_px, px_diff
from tests._support.sd_fixtures import KINDS, reference_pipeline, reference_pixels, save_tiny_sd


MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255 (1/255 on the [0, 1] scale)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("sd")
    return {kind: save_tiny_sd(base / kind, kind=kind) for kind in KINDS}


@pytest.fixture(scope="module")
def pipes(folders):
    return {kind: preheat.load(folder, cache="off") for kind, folder in folders.items()}


def _noise(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4, 16, 16)).astype(np.float32)


CASES = [
    ("sd1", "ddim", dict(prompt=["a photo of a cat", "an astronaut riding a horse"], guidance_scale=7.5)),
    ("sd1", "euler", dict(prompt="a watercolor fox", negative_prompt="blurry", guidance_scale=5.0)),
    ("sd2", "dpmpp_2m", dict(prompt="a red fox in the forest", guidance_scale=6.0)),
    ("sd2", "ddim", dict(prompt="city at night", guidance_scale=1.0)),
    ("sdxl", "euler", dict(prompt="a photo of a dog", guidance_scale=5.0)),
    ("sdxl", "dpmpp_2m", dict(prompt="a portrait of a woman", negative_prompt="low quality", guidance_scale=4.0,
                              original_size=(64, 48), crops_coords_top_left=(4, 2))),
]


# make test: one case per folder kind (sd1's prompt batch, sd2's dpm++, sdxl's micro-conditioning); the
# others in test-slow (each path also met against diffusers elsewhere in make test: a negative prompt in
# test_text_inputs, unguided calls in test_few_step's turbo cases, sdxl with euler in test_image and test_lora)
SLOW_CASES = {1, 3, 4}


@pytest.mark.parametrize("kind,sampler,call", [pytest.param(*c, id=f"{c[0]}-{c[1]}-{i}",
                                                            marks=pytest.mark.slow if i in SLOW_CASES else ())
                                               for i, c in enumerate(CASES)])
def test_matches_diffusers_from_the_same_latents(folders, pipes, kind, sampler, call, record_property):
    call = dict(call)
    prompt = call.pop("prompt")
    n = len(prompt) if isinstance(prompt, list) else 1
    noise = _noise(n)
    steps = 4
    ref = reference_pipeline(folders[kind], sampler)
    theirs = reference_pixels(ref, prompt, noise, num_inference_steps=steps, height=32, width=32, **call)
    ours = pipes[kind].generate(prompt, noise=noise, steps=steps, sampler=sampler, guidance=call.pop("guidance_scale"),
                                width=32, height=32, **call)
    assert ours.shape == theirs.shape == (n, 32, 32, 3) and ours.dtype == np.uint8
    diff = px_diff(ours, theirs)
    record_property("mean_abs_px", float(diff.mean()))
    print(f"{kind}/{sampler}: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= MEAN_TOL, (diff.mean(), diff.max())
    assert ours.std() > 5  # not a flat image (flat images would agree for any model)


def _default_sampler_matches_the_pipeline(folder, sampler: str, scheduler_class: str, prompt: str, steps: int,
                                          guidance: float, label: str, restore_text: bool = False):
    """``folder`` loads with ``sampler`` as its default, and its image is diffusers' pipeline's on
    the same folder (the scheduler it builds from the folder's config), from the same latents.
    Returns diffusers' pipeline."""
    from diffusers import DiffusionPipeline

    from preheat.backends.torch.text import restore_text_model
    from tests._support.sd_fixtures import reference_pixels

    pipe = preheat.load(folder, cache="off")
    assert pipe.defaults["sampler"] == sampler
    ref = DiffusionPipeline.from_pretrained(folder)  # the folder's own scheduler class
    if restore_text:
        restore_text_model(ref)
    ref.set_progress_bar_config(disable=True)
    assert type(ref.scheduler).__name__ == scheduler_class
    noise = _noise(1, seed=3)
    theirs = reference_pixels(ref, prompt, noise, num_inference_steps=steps, height=32, width=32,
                              guidance_scale=guidance)
    ours = pipe.generate(prompt, noise=noise, steps=steps, guidance=guidance, width=32, height=32)
    diff = px_diff(ours, theirs)
    print(f"{label}: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= MEAN_TOL, (diff.mean(), diff.max())
    assert ours.std() > 5  # not a flat image (flat images would agree for any model)
    return ref


def test_a_unipc_folder_defaults_to_unipc_and_matches_its_pipeline(folders, tmp_path):
    """A folder whose scheduler_config.json was saved by UniPCMultistepScheduler (as many deployed SD
    folders are) samples with ``unipc`` unless told otherwise, and its image is diffusers' pipeline's
    on the same folder with that scheduler."""
    import json

    from diffusers import UniPCMultistepScheduler

    folder = tmp_path / "sd2-unipc"
    shutil.copytree(folders["sd2"], folder)  # v-prediction: UniPC's x0 conversion of v
    config_path = folder / "scheduler" / "scheduler_config.json"
    UniPCMultistepScheduler.from_config(json.loads(config_path.read_text())).save_config(folder / "scheduler")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "scheduler": ["diffusers", "UniPCMultistepScheduler"]}))
    assert json.loads(config_path.read_text())["_class_name"] == "UniPCMultistepScheduler"
    _default_sampler_matches_the_pipeline(folder, "unipc", "UniPCMultistepScheduler", "a red fox in the forest",
                                          steps=5, guidance=6.0, label="sd2/unipc (the folder's default)")
    # (5 steps of dpmpp_2m on this folder land 1.4 levels from it: pixels are a coarse check of the
    # sampler, which tests/samplers compares step by step)


def test_prompt_guidance_steps_seed_and_negatives_are_data(sd1_cold):
    """One denoising program serves every prompt, guidance scale, step count, seed and negative prompt.
    The module's cold start traced and compiled it (its call is this test's first: the default
    sampler, guidance 7.5); the calls here count the denoiser's traces from then on."""
    pipe, traces = sd1_cold.pipe, sd1_cold.traces
    assert sd1_cold.cold_traces >= 1  # the counter sees a trace: the cold start's
    traced = len(traces)
    traced_before = len(pipe.executables)
    first = pipe.generate("a photo of a cat", steps=2, guidance=7.5, seed=0)
    np.testing.assert_array_equal(first, sd1_cold.image)  # the cold start's call, from memory
    outs = [
        pipe.generate("a red fox", steps=2, guidance=7.5, seed=0),
        pipe.generate("a photo of a cat", steps=5, guidance=3.0, seed=0),
        pipe.generate("a photo of a cat", negative_prompt="blurry", steps=2, guidance=7.5, seed=9),
    ]
    assert len(traces) == traced  # no retrace
    assert len(pipe.executables) == traced_before  # nothing new compiled
    assert pipe.last.cache_layer == "memory"
    assert all(not np.array_equal(first, o) for o in outs)  # and each input really changed the image


def test_sdxl_size_conditioning_is_data_and_changes_the_image(pipes):
    pipe = pipes["sdxl"]  # two images, seeded: the torch backend case's program (the module compiles it once)
    a = pipe.generate("a photo of a dog", n=2, steps=2, seed=[3, 4])
    count = len(pipe.executables)
    b = pipe.generate("a photo of a dog", n=2, steps=2, seed=[3, 4], original_size=(1024, 1024), target_size=(64, 64))
    assert len(pipe.executables) == count
    assert not np.array_equal(a, b)


def test_resolution_is_static_and_batches_are_per_image(pipes):
    pipe = pipes["sd1"]
    wide = pipe.generate("a photo of a cat", width=48, height=32, steps=2, seed=1)
    assert wide.shape == (1, 32, 48, 3)
    odd = pipe.generate("a photo of a cat", width=34, height=32, steps=2, seed=1)  # a 17-wide latent
    assert odd.shape == (1, 32, 34, 3)
    # two images at the native size, seeded: the program test_pil_images' and the torch case's calls run
    both = pipe.generate(["a photo of a cat", "a red fox"], steps=2, seed=[1, 2])
    again = pipe.generate(["a photo of a cat", "a red fox"], steps=2, seed=[1, 2])
    assert both.shape == (2, 32, 32, 3)
    np.testing.assert_array_equal(both, again)  # same program, same inputs: bit-exact


def test_pil_images_and_stage_timings(pipes):
    pipe = pipes["sd1"]
    images = pipe("a watercolor fox", n=2, steps=2)
    assert [im.size for im in images] == [(32, 32)] * 2 and images[0].mode == "RGB"
    assert set(pipe.last.stages) == {"encode", "denoise", "decode"}
    assert all(s.run_s > 0 for s in pipe.last.stages.values())


@pytest.mark.parametrize("kwargs,argument,needle", [
    (dict(prompt=7), "prompt", "prompt must be a string"),
    (dict(prompt="x", width=31), "width", "multiple of 2"),
    (dict(prompt="x", height=8192), "height", "must be an int in"),
    (dict(prompt="x", negative_prompt="blurry", guidance=1.0), "negative_prompt", "needs classifier-free guidance"),
    (dict(prompt=["a", "b"], n=3), "prompt", "got 2 prompts for n=3"),
    (dict(class_labels=3, prompt="x"), "class_labels", "unexpected argument 'class_labels'"),
    (dict(prompt="x", steps=0), "steps", "steps=0 must be a positive int"),
    (dict(prompt="x", guidance_rescale=1.5), "guidance_rescale", "guidance_rescale=1.5 must be a finite number in "
     "[0, 1]"),
    (dict(prompt="x", guidance_rescale=-0.1), "guidance_rescale", "guidance_rescale=-0.1 must be a finite number in"),
    (dict(prompt="x", guidance_rescale="high"), "guidance_rescale", "guidance_rescale='high' must be a number"),
    (dict(prompt="x", guidance_rescale=float("nan")), "guidance_rescale", "must be a finite number in [0, 1]"),
    (dict(prompt="x", guidance_rescale=0.7, guidance=1.0), "guidance_rescale", "guidance_rescale needs classifier-free "
     "guidance; use a guidance scale other than 1"),
])
def test_bad_inputs_are_one_line_errors_naming_the_argument(pipes, kwargs, argument, needle):
    with pytest.raises(InvalidArgumentError) as err:
        pipes["sd1"].generate(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert err.value.argument == argument


def test_missing_tokenizer_and_mismatched_encoder_are_refused(folders, tmp_path):
    import shutil

    broken = tmp_path / "no-tokenizer"
    shutil.copytree(folders["sd1"], broken)
    shutil.rmtree(broken / "tokenizer")
    with pytest.raises(ModelNotFoundError, match="no tokenizer/ folder"):
        preheat.load(broken, cache="off")

    mixed = tmp_path / "mixed"
    shutil.copytree(folders["sd1"], mixed)
    shutil.rmtree(mixed / "text_encoder")
    shutil.copytree(folders["sdxl"] / "text_encoder", mixed / "text_encoder")  # 16 wide, the UNet wants 32
    with pytest.raises(PreheatError, match="cross_attention_dim") as err:
        preheat.load(mixed, cache="off")
    assert "\n" not in str(err.value)


def test_unknown_pipeline_class_is_named(folders, tmp_path):
    import json
    import shutil

    other = tmp_path / "kandinsky"
    shutil.copytree(folders["sd1"], other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "KandinskyPipeline"}))
    with pytest.raises(UnsupportedConfigError, match="unsupported model class 'KandinskyPipeline'.*StableDiffusionPipeline"):
        preheat.load(other, cache="off")


def _with_scheduler(src: Path, dst: Path, scheduler: Any) -> Path:
    """A copy of the folder ``src`` whose pipeline saves ``scheduler`` (model_index.json and scheduler/)."""
    import json

    shutil.copytree(src, dst)
    index = json.loads((dst / "model_index.json").read_text())
    (dst / "model_index.json").write_text(json.dumps({**index, "scheduler": ["diffusers", type(scheduler).__name__]}))
    scheduler.save_config(dst / "scheduler")
    return dst


def test_a_pndm_folder_defaults_to_pndm_and_matches_its_diffusers_pipeline(folders, tmp_path):
    """SD 1.x's original folders save PNDMScheduler(skip_prk_steps=True): the load runs PLMS by
    default (steps + 1 model calls, its second timestep twice), as diffusers' pipeline loaded from
    the same folder -- with the scheduler it builds itself -- does from the same latents."""
    from diffusers import PNDMScheduler

    from tests._support.sd_fixtures import DDIM_EXTRA, SCHEDULER

    folder = _with_scheduler(folders["sd1"], tmp_path / "sd1-pndm",
                             PNDMScheduler(**SCHEDULER, skip_prk_steps=True,
                                           set_alpha_to_one=DDIM_EXTRA["set_alpha_to_one"]))
    ref = _default_sampler_matches_the_pipeline(folder, "pndm", "PNDMScheduler", "a watercolor fox", steps=4,
                                                guidance=7.5, label="sd1/pndm", restore_text=True)
    assert ref.scheduler.config.skip_prk_steps


@pytest.mark.parametrize("sampler,scheduler_class,extra", [("deis", "DEISMultistepScheduler", {"solver_order": 3}),
                                                           ("lms", "LMSDiscreteScheduler", {}),
                                                           ("dpm2", "KDPM2DiscreteScheduler", {}),
                                                           ("dpmpp_2s", "DPMSolverSinglestepScheduler", {})])
def test_a_multistep_folder_defaults_to_its_sampler_and_matches_its_diffusers_pipeline(folders, tmp_path, sampler,
                                                                                       scheduler_class, extra):
    """Some deployed SD 1.x fine-tunes save DEISMultistepScheduler, LMSDiscreteScheduler,
    KDPM2DiscreteScheduler or DPMSolverSinglestepScheduler: the load runs it by default and its image is
    diffusers' pipeline's from the same latents -- DEIS's third order included (order 3 over 5 steps:
    warm-up, one third-order step, the wind-down) and its last step landing on timestep 0's noise level,
    LMS's four-derivative steps, DPM2's second call at each step's log-midpoint sigma (one call on the
    last), DPM++ 2S's singlestep pairs (5 steps: two pairs, then one first-order step)."""
    import diffusers

    from tests._support.sd_fixtures import SCHEDULER

    # from_config, as a folder's config is read: DPMSolverSinglestepScheduler takes no spacing or offset
    scheduler = getattr(diffusers, scheduler_class).from_config({**SCHEDULER, **extra})
    folder = _with_scheduler(folders["sd1"], tmp_path / f"sd1-{sampler}", scheduler)
    ref = _default_sampler_matches_the_pipeline(folder, sampler, scheduler_class, "a watercolor fox",
                                                steps=5, guidance=7.5, label=f"sd1/{sampler}", restore_text=True)
    assert all(ref.scheduler.config[k] == v for k, v in extra.items())


@pytest.mark.parametrize("scheduler_class,sampler", [("EulerDiscreteScheduler", "euler"),
                                                     ("DDIMScheduler", "ddim")])
def test_a_zero_snr_folder_matches_its_diffusers_pipeline(folders, tmp_path, scheduler_class, sampler):
    """v-prediction fine-tunes trained with zero terminal SNR save ``rescale_betas_zero_snr=True`` with
    trailing timesteps: the first step starts at (ddim) or next to (euler: alphas_cumprod 2**-24,
    sigma ~4096) pure noise, and the image is diffusers' pipeline's on the same folder."""
    import json

    import diffusers

    from tests._support.sd_fixtures import SCHEDULER

    config = {**SCHEDULER, "prediction_type": "v_prediction", "rescale_betas_zero_snr": True,
              "timestep_spacing": "trailing"}
    if sampler == "ddim":
        config.update(clip_sample=False, set_alpha_to_one=False)
    folder = _with_scheduler(folders["sd2"], tmp_path / f"sd2-zsnr-{sampler}",
                             getattr(diffusers, scheduler_class)(**config))
    assert json.loads((folder / "scheduler" / "scheduler_config.json").read_text())["rescale_betas_zero_snr"]
    _default_sampler_matches_the_pipeline(folder, sampler, scheduler_class, "a dark alley at night", steps=5,
                                          guidance=7.0, label=f"sd2/zero-snr {sampler}")


# Playground v2.5's scheduler (and its VAE's per-channel latent statistics), CosXL's
EDM_FOLDERS = {
    "playground": ("edm_dpmpp_2m", "EDMDPMSolverMultistepScheduler",
                   {"sigma_min": 0.002, "sigma_max": 80.0, "sigma_data": 0.5, "solver_order": 2,
                    "prediction_type": "epsilon"},
                   {"latents_mean": [-1.6574, 1.886, -1.383, 2.5155], "latents_std": [8.4927, 5.9022, 6.5498, 5.2299],
                    "scaling_factor": 0.5}),
    "cosxl": ("edm_euler", "EDMEulerScheduler",
              {"sigma_min": 0.001, "sigma_max": 120.0, "sigma_data": 1.0, "sigma_schedule": "exponential",
               "prediction_type": "v_prediction"}, {}),
}


@pytest.mark.parametrize("name", EDM_FOLDERS)
def test_an_edm_folder_defaults_to_its_sampler_and_matches_its_diffusers_pipeline(folders, tmp_path, name):
    """SDXL fine-tunes trained with EDM's preconditioning (Playground v2.5, CosXL) save an EDM scheduler:
    the load runs it by default -- continuous sigmas, the UNet fed ``c_in x`` at ``c_noise`` -- and
    the image is diffusers' StableDiffusionXLPipeline's on the same folder from the same latents
    (Playground's VAE also un-normalises the latents by its per-channel mean and std); the other
    kind's samplers are refused in one line naming the EDM ones."""
    import json

    import diffusers

    from preheat.errors import SchedulerConfigError

    sampler, scheduler_class, config, vae_config = EDM_FOLDERS[name]
    folder = _with_scheduler(folders["sdxl"], tmp_path / f"sdxl-{name}", getattr(diffusers, scheduler_class)(**config))
    vae_path = folder / "vae" / "config.json"
    vae_path.write_text(json.dumps({**json.loads(vae_path.read_text()), **vae_config}))
    _default_sampler_matches_the_pipeline(folder, sampler, scheduler_class, "a lighthouse at dusk", steps=5,
                                          guidance=3.0, label=f"sdxl/{name}")
    pipe = preheat.load(folder, cache="off")
    with pytest.raises(SchedulerConfigError) as info:
        pipe.generate("x", sampler="euler", steps=2, width=32, height=32)
    assert "use one of: edm_euler, edm_dpmpp_2m, edm_dpmpp_2m_sde" in str(info.value)


def test_the_folder_scheduler_settings_pick_the_default_sampler(tmp_path, caplog):
    """DPMSolverMultistepScheduler's algorithm_type (+ use_karras_sigmas) picks dpmpp_2m[_sde][_karras];
    a scheduler we do not reproduce -- an unknown class, or settings of a known one -- falls back to
    the family's default with one warning naming it."""
    import logging

    from diffusers import (DEISMultistepScheduler, DPMSolverMultistepScheduler, DPMSolverSDEScheduler,
                           DPMSolverSinglestepScheduler, IPNDMScheduler, KDPM2AncestralDiscreteScheduler,
                           KDPM2DiscreteScheduler, LMSDiscreteScheduler, PNDMScheduler)

    from preheat.families.stable_diffusion import SD
    from preheat.families.text import default_sampler

    def folder(name: str, scheduler: Any) -> Path:
        scheduler.save_config(tmp_path / name / "scheduler")
        return tmp_path / name

    picked = {
        "sde": (DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++"), "dpmpp_2m_sde"),
        "sde-karras": (DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++", use_karras_sigmas=True),
                       "dpmpp_2m_sde_karras"),
        "ode": (DPMSolverMultistepScheduler(), "dpmpp_2m"),
        "ode-karras": (DPMSolverMultistepScheduler(use_karras_sigmas=True), "dpmpp_2m_karras"),
        "plms": (PNDMScheduler(skip_prk_steps=True), "pndm"),
        "deis": (DEISMultistepScheduler(), "deis"),
        "lms": (LMSDiscreteScheduler(), "lms"),
        "dpm2": (KDPM2DiscreteScheduler(), "dpm2"),
        "dpm2a": (KDPM2AncestralDiscreteScheduler(), "dpm2_a"),
        "dpmpp-sde": (DPMSolverSDEScheduler(use_karras_sigmas=True), "dpmpp_sde"),  # Karras: the folder's key
        "singlestep": (DPMSolverSinglestepScheduler(), "dpmpp_2s"),
        "singlestep-karras": (DPMSolverSinglestepScheduler(use_karras_sigmas=True), "dpmpp_2s_karras"),
    }
    caplog.set_level(logging.WARNING, logger="preheat.families")
    for name, (scheduler, sampler) in picked.items():
        assert default_sampler(folder(name, scheduler), SD) == {"sampler": sampler}, name
    assert not caplog.records
    refused = {
        "dpm": (DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver", final_sigmas_type="sigma_min"),
                "algorithm_type='sde-dpmsolver'"),
        "heun": (DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++", solver_type="heun"),
                 "solver_type='heun'"),
        "order3": (DPMSolverMultistepScheduler(solver_order=3), "solver_order=3"),
        "prk": (PNDMScheduler(), "skip_prk_steps=False"),
        "ipndm": (IPNDMScheduler(), "scheduler IPNDMScheduler is not implemented"),
        "singlestep-sde": (DPMSolverSinglestepScheduler(algorithm_type="sde-dpmsolver++"),
                           "algorithm_type='sde-dpmsolver++' is not supported for DPMSolverSinglestepScheduler"),
        "singlestep-order3": (DPMSolverSinglestepScheduler(solver_order=3), "solver_order=3"),
    }
    for name, (scheduler, needle) in refused.items():
        caplog.clear()
        assert default_sampler(folder(name, scheduler), SD) == {}, name
        (record,) = caplog.records
        line = record.getMessage()
        assert needle in line and "using sampler 'dpmpp_2m' instead" in line and "\n" not in line, line
        assert record.levelno == logging.WARNING
    # EDM: algorithm_type picks the SDE; an EDM setting we do not reproduce falls back to an EDM sampler
    from diffusers import EDMDPMSolverMultistepScheduler, EDMEulerScheduler

    for name, (scheduler, sampler) in {"edm-euler": (EDMEulerScheduler(), "edm_euler"),
                                       "edm-dpm": (EDMDPMSolverMultistepScheduler(), "edm_dpmpp_2m"),
                                       "edm-sde": (EDMDPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++"),
                                                   "edm_dpmpp_2m_sde")}.items():
        assert default_sampler(folder(name, scheduler), SD) == {"sampler": sampler}, name
    hand_written = folder("edm-dpmsolver", EDMDPMSolverMultistepScheduler())
    config = hand_written / "scheduler" / "scheduler_config.json"
    config.write_text(config.read_text().replace('"dpmsolver++"', '"dpmsolver"'))
    caplog.clear()
    assert default_sampler(hand_written, SD) == {"sampler": "edm_euler"}
    (record,) = caplog.records
    assert "algorithm_type='dpmsolver'" in record.getMessage()
    assert "using sampler 'edm_euler' instead" in record.getMessage()


def test_a_load_parses_the_folder_scheduler_once(tmp_path, monkeypatch):
    """load_scheduler: the config the load samples with is the one default_sampler learns the folder's kind
    from (parsed once); a scheduler= the load is given replaces it for sampling, while the default sampler
    stays the folder's own scheduler's."""
    from diffusers import DDIMScheduler, EDMEulerScheduler, IPNDMScheduler

    from preheat.families.stable_diffusion import SD
    from preheat.families.text import load_scheduler
    from preheat.samplers import SchedulerConfig

    parsed = []
    from_dict = SchedulerConfig.from_dict.__func__
    monkeypatch.setattr(SchedulerConfig, "from_dict", classmethod(lambda cls, d: parsed.append(d) or from_dict(cls, d)))
    EDMEulerScheduler().save_config(tmp_path / "scheduler")
    config, defaults = load_scheduler(tmp_path, SD)
    assert (config.class_name, defaults, len(parsed)) == ("EDMEulerScheduler", {"sampler": "edm_euler"}, 1)
    ddim = {**DDIMScheduler().config, "_class_name": "DDIMScheduler"}
    config, defaults = load_scheduler(tmp_path, SD, scheduler=ddim)
    assert (config.class_name, defaults) == ("DDIMScheduler", {"sampler": "edm_euler"})
    IPNDMScheduler().save_config(tmp_path / "scheduler")  # not reproduced: the family's default, as before
    assert load_scheduler(tmp_path, SD, scheduler=ddim)[1] == {}


# each kind's default sampler, two seeded images at the native size: the JAX side runs the program
# test_pil_images (sd1) and the size-conditioning test (sdxl) compile, not one of its own (the torch
# backend's sampler mapping, dpmpp_2m's too, is one piece of code: tests/backends/test_torch_backend.py)
@pytest.mark.parametrize("kind,sampler", [("sd1", "ddim"), ("sdxl", "euler")])
def test_torch_backend_runs_the_same_folder_with_the_same_latents(folders, pipes, kind, sampler):
    from preheat.backends.torch import load_torch_pipeline as torch_load

    assert pipes[kind].defaults["sampler"] == sampler
    torch_pipe = torch_load(folders[kind], cache="off")
    call = dict(steps=3, sampler=sampler, guidance=5.0, seed=[4, 5], negative_prompt="blurry")
    a = pipes[kind].generate(["a photo of a cat", "a red fox"], **call)
    b = torch_pipe.generate(["a photo of a cat", "a red fox"], **call)
    diff = px_diff(a, b)
    assert a.shape == b.shape and diff.mean() <= MEAN_TOL, diff.mean()
    assert torch_pipe.defaults == pipes[kind].defaults
    with pytest.raises(InvalidArgumentError, match="multiple of 2"):
        torch_pipe.generate("x", width=31)  # the same checks as the JAX side


# diffusers' guidance_rescale (preheat.families.guidance): one image with a negative prompt, 4 euler steps at
# guidance 7.5 (the paper's phi 0.7), its own latents: one program per kind, every value of the input through it
RESCALE_CALL = dict(negative_prompt="blurry", height=32, width=32)


@pytest.mark.parametrize("kind", ["sd1", "sdxl"])
def test_guidance_rescale_matches_diffusers_and_is_data(folders, pipes, kind, record_property):
    prompt, noise, steps = "a photo of a cat", _noise(1, seed=1), 4
    ref = reference_pipeline(folders[kind], "euler")
    theirs = reference_pixels(ref, prompt, noise, num_inference_steps=steps, guidance_scale=7.5, guidance_rescale=0.7,
                              **RESCALE_CALL)
    theirs_off = reference_pixels(ref, prompt, noise, num_inference_steps=steps, guidance_scale=7.5, **RESCALE_CALL)
    pipe = pipes[kind]
    call = dict(noise=noise, steps=steps, sampler="euler", guidance=7.5, **RESCALE_CALL)
    off = pipe.generate(prompt, **call)  # absent: diffusers' default, 0
    compiled = len(pipe.executables)
    ours = pipe.generate(prompt, guidance_rescale=0.7, **call)
    np.testing.assert_array_equal(pipe.generate(prompt, guidance_rescale=0.0, **call), off)
    assert len(pipe.executables) == compiled  # data: no value compiles anything new
    parity, parity_off, moved = mean_abs_px(ours, theirs), mean_abs_px(off, theirs_off), mean_abs_px(ours, off)
    record_property("mean_abs_px", parity)
    print(f"{kind} guidance_rescale=0.7: mean |Δpx| vs diffusers {parity:.4f} (at 0: {parity_off:.4f}); "
          f"0.7 vs 0 moves it {moved:.4f}")
    assert parity <= MEAN_TOL and parity_off <= MEAN_TOL, (parity, parity_off)
    # the rescale moves the image far more than we differ from diffusers: a family that ignored the
    # input (or applied it anywhere else) would fail here
    assert moved > 4 * max(parity, parity_off, 0.25), (parity, moved)
    assert ours.std() > 5  # not a flat image


def test_guidance_rescale_0_is_exactly_the_program_without_it(pipes):
    """0 selects the plain CFG combination exactly: the latents equal the program's that has no
    rescale at all (every other family's, and every unguided call's)."""
    import dataclasses

    pipe = pipes["sd1"]
    sig, args = pipe.prepare("a photo of a cat", noise=_noise(1, seed=1), steps=4, sampler="euler", guidance=7.5,
                             **RESCALE_CALL)  # the program the parity test compiled
    assert args.guidance_rescale == np.float32(0.0) and sig.guidance_rescale
    with_it = np.asarray(pipe.executable(sig, args)(args))
    bare, plain = dataclasses.replace(pipe, executables=Executables()), args._replace(guidance_rescale=None)
    plain_sig = dataclasses.replace(sig, guidance_rescale=False)  # the signature selects the program
    np.testing.assert_array_equal(np.asarray(bare.executable(plain_sig, plain)(plain)), with_it)
    unguided_sig, unguided = pipe.prepare("a photo of a cat", steps=4, guidance=1.0, guidance_rescale=0.0)  # no ask
    assert unguided.guidance_rescale is None and not unguided_sig.guidance_rescale


def test_torch_backend_passes_guidance_rescale_or_refuses_it(folders, pipes):
    """diffusers' pipeline gets the keyword (the same pixels as ours); SD 1.x's img2img pipeline has
    none, so the torch backend refuses it there in one line rather than drop it."""
    from preheat.backends.torch import load_torch_pipeline as torch_load

    call = dict(noise=_noise(1, seed=1), steps=4, sampler="euler", guidance=7.5, guidance_rescale=0.7, **RESCALE_CALL)
    ours = pipes["sdxl"].generate("a photo of a cat", **call)  # the parity test's program
    theirs = torch_load(folders["sdxl"], cache="off").generate("a photo of a cat", **call)
    assert mean_abs_px(ours, theirs) <= MEAN_TOL, mean_abs_px(ours, theirs)
    with pytest.raises(InvalidArgumentError) as err:
        torch_load(folders["sd1"], cache="off").generate("x", image=np.full((32, 32, 3), 128, np.uint8), steps=2,
                                                         guidance=7.5, guidance_rescale=0.7)
    assert err.value.argument == "guidance_rescale" and "\n" not in str(err.value)
    assert "StableDiffusionImg2ImgPipeline takes none" in str(err.value)


class ColdStart(NamedTuple):
    """SD 1.x's first start on an empty full-mode compile cache of its own."""
    root: Path  # the cache root it filled
    pipe: Any
    image: np.ndarray  # generate("a photo of a cat", steps=2, seed=0)
    layers: dict[str, str]  # each stage's cache layer on that call
    traces: list[int]  # one item per trace of the pipe's denoiser, from its first call on
    cold_traces: int  # of them, the cold call's


@pytest.fixture(scope="module")
def sd1_cold(folders, tmp_path_factory) -> ColdStart:
    """One cold start per module (load, then every stage traced, compiled and stored), shared by
    the tests that need it: they copy its root before they restart on it, so none sees another's
    entries but the one sampler's entry the restart test adds to it (and counts)."""
    from preheat.cache.compile import JaxCompiler

    root = tmp_path_factory.mktemp("sd1-cold-cache")
    pipe = preheat.load(folders["sd1"], cache="off")
    pipe.compiler = JaxCompiler(root=root, mode="full", remote=None)
    traces: list[int] = []
    apply = pipe.apply

    def counting(*args):
        traces.append(1)  # runs only while JAX traces the denoiser
        return apply(*args)

    pipe.apply = counting
    image = pipe.generate("a photo of a cat", steps=2, seed=0)
    return ColdStart(root, pipe, image, {s: t.cache_layer for s, t in pipe.last.stages.items()}, traces, len(traces))


def _copy_cache(cold: ColdStart, root: Path) -> None:
    shutil.copytree(cold.root, root, dirs_exist_ok=True)


def test_every_stage_has_its_own_cache_entry_and_a_restart_loads_all_three(folders, sd1_cold, tmp_path):
    from preheat.cache.compile import JaxCompiler

    def fresh():
        pipe = preheat.load(folders["sd1"], cache="off")
        pipe.compiler = JaxCompiler(root=tmp_path, mode="full", remote=None)
        return pipe

    first, a = sd1_cold.pipe, sd1_cold.image
    assert sd1_cold.layers == {"encode": "none", "denoise": "none", "decode": "none"}
    # another sampler and step count: only the denoising program is new; the encoder's is shared
    first.generate("a red fox", steps=3, sampler="euler", seed=0)
    assert first.last.stages["encode"].cache_layer == "memory"
    assert first.last.stages["decode"].cache_layer == "memory"
    assert first.last.stages["denoise"].cache_layer == "none"
    entries = [p for p in (sd1_cold.root / "compile" / "jax").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 4  # encode, decode, and one denoising program per sampler
    _copy_cache(sd1_cold, tmp_path)

    second = fresh()  # a restart: every stage from the aot layer, nothing traced
    b = second.generate("a photo of a cat", steps=2, seed=0)
    assert {s: t.cache_layer for s, t in second.last.stages.items()} == {"encode": "aot", "denoise": "aot",
                                                                         "decode": "aot"}
    assert second.last.trace_lower_s == 0.0
    np.testing.assert_array_equal(a, b)
    _prefetched_restarts(folders["sd1"], tmp_path, a)


def _prefetched_restarts(folder, root, want):
    """Restarts that prefetch (issue 17): every stage's executable loads on the background thread
    while the weights are read -- keys from a rehearsal on placeholder weights, the conditioning's
    shapes from the encoders traced abstractly -- and a background load that fails (the encoder's,
    injected) falls back to a compile of that stage alone; the image is the same each time."""
    from preheat.cache import serialized

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREHEAT_HOME", str(root))
        mp.delenv("PREHEAT_CACHE_URL", raising=False)
        call = {"n": 1, "steps": 20}  # no prompt (its words are data), another step count (data): the same keys
        third = preheat.load(folder, prefetch=[call])
        np.testing.assert_array_equal(third.generate("a photo of a cat", steps=2, seed=0), want)
        got = [(e["stage"], e["layer"], e.get("prefetch")) for e in third.compiler.events]
        assert got == [(s, "aot", "background") for s in ("encode", "denoise", "decode")], third.compiler.events
        assert third.last.trace_lower_s == 0.0 and "executable.keys" in third.startup.spans

        load, failed = serialized.load_executable, []

        def fail_the_first_background_load(*a, **k):
            if threading.current_thread().name == "preheat-executable-prefetch" and not failed:
                failed.append(True)  # the first program the call runs: the encoder's
                raise RuntimeError("injected: cannot load this executable")
            return load(*a, **k)

        mp.setattr(serialized, "load_executable", fail_the_first_background_load)
        # the prefetch thread's load is what this fault is for: forget the keys the third start
        # remembered, so that no executable is deserialised early (tests/cache/test_early.py)
        shutil.rmtree(third.compiler.root / "compile" / "recent", ignore_errors=True)
        fourth = preheat.load(folder, prefetch=[call])
        np.testing.assert_array_equal(fourth.generate("a photo of a cat", steps=2, seed=0), want)
        events = {e["stage"]: e for e in fourth.compiler.events}
        assert "injected" in events["encode"]["quarantined"] and events["encode"]["layer"] in ("none", "xla")
        assert events["encode"]["prefetch"] == "background" and events["encode"]["trace_lower_s"] > 0
        assert [events[s]["layer"] for s in ("denoise", "decode")] == ["aot", "aot"], fourth.compiler.events


def test_cli_samples_a_text_to_image_folder(folders, tmp_path):
    import json

    from click.testing import CliRunner

    from preheat.cli import main

    out, report = tmp_path / "fox.png", tmp_path / "r.json"
    # two seeded images at sd1's native size: the program test_resolution's and the torch case's calls run
    result = CliRunner().invoke(main, ["sample", str(folders["sd1"]), "--prompt", "a watercolor fox",
                                       "--negative-prompt", "blurry", "--width", "32", "--height", "32", "--steps", "2",
                                       "--n", "2", "--out", str(out), "--report", str(report), "--cache", "off"])
    assert result.exit_code == 0, result.output
    rec = json.loads(report.read_text())
    assert rec["family"] == "stable-diffusion" and rec["batch"] == 2 and set(rec["stages"]) == {"encode", "denoise",
                                                                                                  "decode"}
    from PIL import Image

    assert Image.open(out).size[1] in (32, 64)  # a grid of two 32x32 images (upscaled when small)
    bad = CliRunner().invoke(main, ["sample", str(folders["sd1"]), "--prompt", "x", "--width", "31", "--cache", "off",
                                    "--out", str(tmp_path / "bad.png")])
    assert bad.exit_code == 2 and "multiple of 2" in bad.output and not (tmp_path / "bad.png").exists()


def test_a_cached_stage_that_fails_on_its_first_run_is_quarantined_and_recompiled(folders, sd1_cold, tmp_path,
                                                                                   monkeypatch):
    """Every stage, not only the denoising loop, survives an entry that loads but cannot run."""
    import jax

    from preheat.cache import compile as compile_mod
    from preheat.cache.compile import JaxCompiler

    def fresh():
        pipe = preheat.load(folders["sd1"], cache="off")
        pipe.compiler = JaxCompiler(root=tmp_path, mode="full", remote=None)
        return pipe

    _copy_cache(sd1_cold, tmp_path)  # a filled cache: the module's cold start's entries
    want = sd1_cold.image
    real_load = compile_mod.JaxCompiler._load

    def load_a_broken_program(self, *a, **k):
        if real_load(self, *a, **k) is None:
            return None

        def broken(*args):
            raise jax.errors.JaxRuntimeError("NOT_FOUND: Function fusion not found (type id: 1)")

        return broken

    monkeypatch.setattr(compile_mod.JaxCompiler, "_load", load_a_broken_program)
    pipe = fresh()
    np.testing.assert_array_equal(pipe.generate("a photo of a cat", steps=2, seed=0), want)
    quarantined = [e["stage"] for e in pipe.compiler.events if "failed on its first run" in e.get("quarantined", "")]
    assert sorted(quarantined) == ["decode", "denoise", "encode"]
