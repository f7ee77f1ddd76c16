"""Few-step models (issue 28 item 4) against diffusers on tiny random folders: SD-Turbo and
SDXL-Turbo (their published scheduler configs: Euler / Euler ancestral, trailing spacing, 1-4
steps, guidance off) and LCM-LoRA on SD 1.x and SDXL (``LCMScheduler`` -> the ``lcm`` sampler).

The stochastic samplers (euler_a, lcm) draw fresh noise every step: diffusers' draws are replaced
by the engine's own per-step draws (``preheat.noise``), so both sides see the same noise."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import preheat
from preheat.noise import STEP_STREAM, image_keys, normal_per_image
from tests._support import sd_fixtures

peft = pytest.importorskip("peft")

MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255
SEED = 7
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2"]  # the layers an LCM-LoRA adapts
# the published turbo repositories' scheduler/scheduler_config.json (math-relevant keys)
_TURBO = {"beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
          "interpolation_type": "linear", "num_train_timesteps": 1000, "prediction_type": "epsilon",
          "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
          "timestep_spacing": "trailing", "trained_betas": None}
SD_TURBO = {"_class_name": "EulerDiscreteScheduler", **_TURBO, "use_karras_sigmas": False}
SDXL_TURBO = {"_class_name": "EulerAncestralDiscreteScheduler", **_TURBO}


def _with_scheduler(folder, config: dict) -> None:
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def few(tmp_path_factory):
    """Turbo-configured SD 2.x-like and SDXL folders; SD 1.x and SDXL folders whose scheduler is
    LCMScheduler (as the LCM-LoRA cards set it), each with a random UNet LoRA standing in for
    the LCM-LoRA."""
    from diffusers import LCMScheduler

    from tests._support.lora_files import peft_layers, save_lora

    base = tmp_path_factory.mktemp("few")
    out = {}
    for name, kind, sched in (("sd-turbo", "sd2", SD_TURBO), ("sdxl-turbo", "sdxl", SDXL_TURBO)):
        folder = sd_fixtures.save_tiny_sd(base / name, kind=kind)
        _with_scheduler(folder, sched)
        out[name] = {"folder": folder, "pipe": preheat.load(folder, cache="off")}
    for name, kind in (("sd1-lcm", "sd1"), ("sdxl-lcm", "sdxl")):
        folder = sd_fixtures.save_tiny_sd(base / name, kind=kind)
        old = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        _with_scheduler(folder, json.loads(LCMScheduler.from_config(old).to_json_string()))
        ref = sd_fixtures.reference_pipeline(folder, "lcm")
        lora = save_lora(ref, base / f"{name}-lora", "unet", {"unet": peft_layers(ref.unet, UNET_TARGETS, 4, 8, seed=5)})
        out[name] = {"folder": folder, "lora": lora, "pipe": preheat.load(folder, cache="off")}
    return out


def _noise(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 4, 16, 16)).astype(np.float32)


def _engine_step_noise(monkeypatch, draws_per_step: int = 1) -> None:
    """diffusers' schedulers draw what the engine draws for image SEED at step i (NCHW)."""
    from diffusers.schedulers import scheduling_euler_ancestral_discrete, scheduling_lcm

    calls = {"i": 0}

    def randn(shape, generator=None, device=None, dtype=None, layout=None):
        import torch

        n, c, h, w = shape
        keys = image_keys(jnp.asarray([SEED], jnp.uint32))
        nhwc = np.asarray(normal_per_image(keys, STEP_STREAM, jnp.int32(calls["i"] * draws_per_step), (h, w, c)))
        calls["i"] += 1
        return torch.from_numpy(np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2))).to(dtype or torch.float32)

    for mod in (scheduling_euler_ancestral_discrete, scheduling_lcm):
        monkeypatch.setattr(mod, "randn_tensor", randn)


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int32) - b.astype(np.int32)).mean())


@pytest.mark.parametrize("name,sampler,steps", [
    ("sd-turbo", "euler", 1), ("sd-turbo", "euler", 4), ("sdxl-turbo", "euler_a", 1), ("sdxl-turbo", "euler_a", 4),
])
def test_turbo_matches_diffusers(few, name, sampler, steps, monkeypatch, record_property):
    entry = few[name]
    assert entry["pipe"].defaults["sampler"] == {"sd-turbo": "euler", "sdxl-turbo": "euler_a"}[name]
    _engine_step_noise(monkeypatch)
    noise = _noise()
    ref = sd_fixtures.reference_pipeline(entry["folder"], sampler)
    assert ref.scheduler.config.timestep_spacing == "trailing"
    theirs = sd_fixtures.reference_pixels(ref, "a cinematic shot of a raccoon", noise, num_inference_steps=steps,
                                          guidance_scale=0.0, height=32, width=32)
    ours = entry["pipe"].generate("a cinematic shot of a raccoon", noise=noise, seed=SEED, steps=steps,
                                  sampler=sampler, guidance=0.0, width=32, height=32)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert ours.std() > 5


@pytest.mark.parametrize("name,steps,guidance", [("sd1-lcm", 2, 1.5), ("sdxl-lcm", 4, 1.0)])
def test_lcm_lora_matches_diffusers(few, name, steps, guidance, monkeypatch, record_property):
    entry = few[name]
    assert entry["pipe"].defaults["sampler"] == "lcm"  # the folder's LCMScheduler picks it
    _engine_step_noise(monkeypatch)
    noise = _noise(1)
    ref = sd_fixtures.reference_pipeline(entry["folder"], "lcm")
    ref.load_lora_weights(str(entry["lora"]))
    theirs = sd_fixtures.reference_pixels(ref, "a photo of an owl", noise, num_inference_steps=steps,
                                          guidance_scale=guidance, height=32, width=32)
    pipe = entry["pipe"]
    ours = pipe.generate("a photo of an owl", noise=noise, seed=SEED, steps=steps, guidance=guidance,
                         lora=entry["lora"], width=32, height=32)
    plain = pipe.generate("a photo of an owl", noise=noise, seed=SEED, steps=steps, guidance=guidance,
                          width=32, height=32)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(ours, plain) > 5  # the LoRA really changes the image
    if steps > 1:  # multi-step LCM re-noises between steps: other step noise, another image
        other = pipe.generate("a photo of an owl", noise=noise, seed=SEED + 1, steps=steps, guidance=guidance,
                              lora=entry["lora"], width=32, height=32)
        assert _diff(ours, other) > 1
