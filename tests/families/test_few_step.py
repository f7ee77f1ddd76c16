"""Few-step models (issue 28 item 4) against diffusers on tiny random folders: SD-Turbo and
SDXL-Turbo (their published scheduler configs: Euler / Euler ancestral, trailing spacing, 1-4
steps, guidance off), SD3.5 Large Turbo (its folder's flow-matching Euler, shift 3, 4 steps,
guidance 0), LCM-LoRA on SD 1.x and SDXL (``LCMScheduler`` -> the ``lcm`` sampler), and
the distilled LoRAs run as their model cards say, each card's diffusers lines run as written on
the reference side: SDXL-Lightning (a kohya-named LoRA, Euler with trailing spacing, guidance 0),
Hyper-SD (DDIM with trailing spacing; the 1-step LoRA with ``TCDScheduler``, eta 1 and the card's
``timesteps=[800]``), Hyper-SD3 (on SD3-medium, the LoRA fused at scale 0.125, 8 steps, guidance 5)
and Hyper-FLUX.1-dev (the LoRA fused at scale 0.125, the pipeline's own scheduler, guidance 3.5).

The stochastic samplers (euler_a, lcm) draw fresh noise every step: diffusers' draws are replaced
by the engine's own per-step draws (``preheat.noise``), so both sides see the same noise."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import preheat
from preheat.noise import STEP_STREAM, image_keys, normal_per_image
from tests._support import flow_fixtures, sd_fixtures
from tests._support.numerics import mean_abs_px as _diff
from tests._support.server_fixtures import cli_on

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
def tiny_sd(tmp_path_factory):
    """``tiny_sd(kind, folder)``: a copy of the module's one tiny folder of ``kind`` (seed 0, built on
    first use), for a folder that then gets its own scheduler: the same weights, built once."""
    import shutil

    base, built = tmp_path_factory.mktemp("tiny"), {}

    def copy(kind: str, folder):
        if kind not in built:
            built[kind] = sd_fixtures.save_tiny_sd(base / kind, kind=kind)
        return shutil.copytree(built[kind], folder)

    return copy


@pytest.fixture(scope="module")
def few(tmp_path_factory, tiny_sd):
    """Turbo-configured SD 2.x-like and SDXL folders; SD 1.x and SDXL folders whose scheduler is
    LCMScheduler (as the LCM-LoRA cards set it), each with a random UNet LoRA standing in for
    the LCM-LoRA."""
    from diffusers import LCMScheduler

    from tests._support.lora_files import peft_layers, save_lora

    base = tmp_path_factory.mktemp("few")
    out = {}
    for name, kind, sched in (("sd-turbo", "sd2", SD_TURBO), ("sdxl-turbo", "sdxl", SDXL_TURBO)):
        folder = tiny_sd(kind, base / name)
        _with_scheduler(folder, sched)
        out[name] = {"folder": folder, "pipe": preheat.load(folder, cache="off")}
    for name, kind in (("sd1-lcm", "sd1"), ("sdxl-lcm", "sdxl")):
        folder = tiny_sd(kind, base / name)
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
    from diffusers.schedulers import scheduling_euler_ancestral_discrete, scheduling_lcm, scheduling_tcd

    calls = {"i": 0}

    def randn(shape, generator=None, device=None, dtype=None, layout=None):
        import torch

        n, c, h, w = shape
        keys = image_keys(jnp.asarray([SEED], jnp.uint32))
        nhwc = np.asarray(normal_per_image(keys, STEP_STREAM, jnp.int32(calls["i"] * draws_per_step), (h, w, c)))
        calls["i"] += 1
        return torch.from_numpy(np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2))).to(dtype or torch.float32)

    for mod in (scheduling_euler_ancestral_discrete, scheduling_lcm, scheduling_tcd):
        monkeypatch.setattr(mod, "randn_tensor", randn)


@pytest.mark.parametrize("name,sampler,steps", [  # make test: one step count per folder
    ("sd-turbo", "euler", 1), pytest.param("sd-turbo", "euler", 4, marks=pytest.mark.slow),
    pytest.param("sdxl-turbo", "euler_a", 1, marks=pytest.mark.slow), ("sdxl-turbo", "euler_a", 4),
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


# SD3.5 Large Turbo's scheduler/scheduler_config.json: the SD3 models' own (FlowMatchEuler, shift 3.0); its
# transformer is SD3.5 Large's (qk_norm "rms_norm")
SD35_TURBO_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


def _sd3_card_reference(folder):
    """diffusers' ``StableDiffusion3Pipeline.from_pretrained(folder)`` as a card loads it: the folder's
    own scheduler, nothing replaced."""
    from diffusers import DiffusionPipeline

    ref = DiffusionPipeline.from_pretrained(folder)
    ref.set_progress_bar_config(disable=True)
    return ref


@pytest.fixture(scope="module")
def sd35_turbo(tmp_path_factory):
    """A tiny SD3 folder shaped as SD3.5 Large Turbo: qk_norm transformer, the published scheduler config."""
    folder = flow_fixtures.save_tiny_flow_model(tmp_path_factory.mktemp("sd35-turbo") / "turbo", "sd3",
                                                transformer_config={"qk_norm": "rms_norm"})
    _with_scheduler(folder, SD35_TURBO_SCHEDULER)
    return {"folder": folder, "pipe": preheat.load(folder, cache="off")}


def test_sd35_large_turbo_matches_diffusers(sd35_turbo, record_property):
    """SD3.5 Large Turbo's card: ``StableDiffusion3Pipeline`` as published, ``num_inference_steps=4,
    guidance_scale=0.0``; preheat: ``steps=4, guidance=0`` on the folder's own sampler (flow_euler,
    shift 3). As in diffusers (``guidance_scale > 1`` turns it on), 0 runs no classifier-free
    guidance: one branch, the prompt's (CFG at scale 0 would be the empty prompt's image)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    entry, prompt, noise = sd35_turbo, "a photo of a cat", _noise(8)
    pipe = entry["pipe"]
    assert pipe.defaults["sampler"] == "flow_euler"
    ref = _sd3_card_reference(entry["folder"])
    assert type(ref.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and ref.scheduler.config.shift == 3.0
    assert ref.transformer.config.qk_norm == "rms_norm"
    card = dict(num_inference_steps=4, guidance_scale=0.0)
    theirs = flow_fixtures.reference_pixels(ref, prompt, noise, **card)
    ours = pipe.generate(prompt, noise=noise, steps=4, guidance=0.0, width=32, height=32)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert ours.std() > 5
    sig, _ = pipe.prepare(prompt, steps=4, guidance=0.0, width=32, height=32)
    assert not sig.guided  # one branch through the transformer, not CFG at scale 0
    # what a wrong reading would have drawn, on diffusers' side: CFG at scale 0 (the unconditional
    # branch alone: the empty prompt's image), or the schedule without the folder's shift
    assert _diff(theirs, flow_fixtures.reference_pixels(ref, "", noise, **card)) > 2  # measured 3.51
    ref.scheduler = FlowMatchEulerDiscreteScheduler.from_config(ref.scheduler.config, shift=1.0)
    assert _diff(theirs, flow_fixtures.reference_pixels(ref, prompt, noise, **card)) > 2  # measured 4.03


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
    # the LoRA at scale 0: the same program (a scale is data), the plain image (tests/families/test_lora.py)
    plain = pipe.generate("a photo of an owl", noise=noise, seed=SEED, steps=steps, guidance=guidance,
                          lora=entry["lora"], lora_scale=0.0, width=32, height=32)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(ours, plain) > 5  # the LoRA really changes the image
    if steps > 1:  # multi-step LCM re-noises between steps: other step noise, another image
        other = pipe.generate("a photo of an owl", noise=noise, seed=SEED + 1, steps=steps, guidance=guidance,
                              lora=entry["lora"], width=32, height=32)
        assert _diff(ours, other) > 1


# ------------------------------------------------------------------ distilled LoRAs, as their cards run them

# The Hyper-FLUX stand-in's layers: attention and MLPs only, as this card test was written (at alpha 64),
# not lora_files.FLUX_TARGETS (the LoRA parity tests'), whose modulation, x_embedder and output layers
# would make another LoRA and other numbers
HYPER_FLUX_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "proj_mlp", "ff.net.2"]


@pytest.fixture(scope="module")
def cards(tmp_path_factory, tiny_sd):
    """Base folders as published (SD 1.x: DDIM, SDXL: Euler, both "leading"; FLUX.1-dev:
    FlowMatchEuler) and random UNet/transformer LoRAs standing in for the distilled ones: SDXL's
    in kohya's original-layout names (``lora_unet_input_blocks_…``, as SDXL-Lightning's files),
    the others as diffusers/peft writes them. Hyper-FLUX's is strong (alpha 64, rank 4), since the
    card fuses it at 0.125."""
    from tests._support.lora_files import kohya_sgm_names, peft_layers, save_lora

    base = tmp_path_factory.mktemp("cards")
    out = {}
    for kind in ("sd1", "sdxl"):
        folder = tiny_sd(kind, base / kind)
        ref = sd_fixtures.reference_pipeline(folder, "euler")
        layers = peft_layers(ref.unet, UNET_TARGETS, 4, 8, seed=11)
        lora = save_lora(ref, base / f"{kind}-lora", "unet", {"unet": layers})
        out[kind] = {"folder": folder, "lora": lora, "pipe": preheat.load(folder, cache="off")}
    out["sdxl"]["kohya"] = kohya_sgm_names(out["sdxl"]["lora"], base / "sdxl-kohya.safetensors", layers=(1, 1))
    folder = flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")
    ref = flow_fixtures.reference_pipeline(folder)
    lora = save_lora(ref, base / "flux-lora", "transformer",
                     {"transformer": peft_layers(ref.transformer, HYPER_FLUX_TARGETS, 4, 64, seed=12)})
    out["flux"] = {"folder": folder, "lora": lora, "pipe": preheat.load(folder, cache="off")}
    return out


def _card_reference(folder, scheduler_line, lora):
    """diffusers' pipeline for ``folder`` as a card sets it up: ``scheduler_line(config)`` builds the
    scheduler from the folder's (``Class.from_config(pipe.scheduler.config, ...)``), the LoRA loaded."""
    from diffusers import DiffusionPipeline

    from preheat.backends.torch.text import restore_text_model

    ref = DiffusionPipeline.from_pretrained(folder)
    restore_text_model(ref)
    ref.scheduler = scheduler_line(ref.scheduler.config)
    ref.set_progress_bar_config(disable=True)
    ref.load_lora_weights(str(lora))
    return ref


def _without_lora(ref, prompt, noise, **kwargs):
    """diffusers' image with the LoRA switched off: the negative control. Ours matches the card's
    image within a level, so it could not have left out what changes this one by more than that
    (checked on diffusers' side, so that the control costs no second compiled program)."""
    ref.disable_lora()
    try:
        return sd_fixtures.reference_pixels(ref, prompt, noise, **kwargs)
    finally:
        ref.enable_lora()


# (card, folder kind, diffusers scheduler class, preheat sampler, LoRA file, steps, prompt, noise seed)
_TRAILING_CARDS = [
    ("lightning", "sdxl", "EulerDiscreteScheduler", "euler", "kohya", 2, "a girl smiling", 2),
    ("lightning", "sdxl", "EulerDiscreteScheduler", "euler", "kohya", 4, "a girl smiling", 2),
    ("hyper", "sd1", "DDIMScheduler", "ddim", "lora", 2, "a photo of a cat", 3),
    ("hyper", "sdxl", "DDIMScheduler", "ddim", "lora", 4, "a photo of a cat", 3),
]


@pytest.mark.parametrize("card,kind,scheduler,sampler,lora,steps,prompt,seed",  # make test: Lightning's 4 steps
                         [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[5]}", marks=pytest.mark.slow if c[:2] == ("lightning", "sdxl")
                                       and c[5] == 2 else ()) for c in _TRAILING_CARDS])
def test_trailing_spacing_lora_cards_match_diffusers(cards, card, kind, scheduler, sampler, lora, steps, prompt, seed,
                                                     record_property):
    """SDXL-Lightning's card (``EulerDiscreteScheduler.from_config(config, timestep_spacing="trailing")``,
    the kohya-named LoRA) and Hyper-SD's N-step cards (``DDIMScheduler``, trailing), guidance 0;
    preheat: ``sampler="euler"|"ddim", timestep_spacing="trailing"``."""
    import diffusers

    entry, noise = cards[kind], _noise(seed)
    scheduler_class = getattr(diffusers, scheduler)
    ref = _card_reference(entry["folder"], lambda c: scheduler_class.from_config(c, timestep_spacing="trailing"),
                          entry[lora])
    call = dict(num_inference_steps=steps, guidance_scale=0.0, height=32, width=32)
    theirs = sd_fixtures.reference_pixels(ref, prompt, noise, **call)
    pipe = entry["pipe"]
    ours_call = dict(noise=noise, steps=steps, guidance=0.0, sampler=sampler, lora=entry[lora])
    ours = pipe.generate(prompt, timestep_spacing="trailing", **ours_call)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(theirs, _without_lora(ref, prompt, noise, **call)) > 5  # the LoRA counts
    assert _diff(ours, pipe.generate(prompt, **ours_call)) > 5  # the folder's "leading" spacing differs


@pytest.mark.parametrize("steps,eta,timesteps", [(1, 1.0, [800]), (4, 0.3, None)])
def test_hyper_tcd_lora_matches_diffusers(cards, steps, eta, timesteps, monkeypatch, record_property):
    """Hyper-SD's 1-step LoRA: ``TCDScheduler.from_config(config)``, guidance 0, ``eta=1.0``,
    ``timesteps=[800]``; preheat: ``sampler="tcd", eta=1.0, timesteps=[800], steps=1``. And a 4-step
    TCD call with the scheduler's own eta 0.3 (fresh noise between steps: diffusers draws the engine's)."""
    from diffusers import EulerDiscreteScheduler, TCDScheduler

    _engine_step_noise(monkeypatch)
    entry, prompt, noise = cards["sdxl"], "a photo of an owl", _noise(4)
    ref = _card_reference(entry["folder"], TCDScheduler.from_config, entry["lora"])
    given = {} if timesteps is None else {"timesteps": timesteps}
    call = dict(num_inference_steps=steps, guidance_scale=0.0, eta=eta, height=32, width=32, **given)
    theirs = sd_fixtures.reference_pixels(ref, prompt, noise, **call)
    pipe = entry["pipe"]
    card = dict(noise=noise, seed=SEED, steps=steps, guidance=0.0, sampler="tcd", eta=eta)
    ours = pipe.generate(prompt, lora=entry["lora"], **card, **given)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(theirs, _without_lora(ref, prompt, noise, **call)) > 5
    if timesteps is None:  # several steps: the folder's own sampler (Euler) is another image
        ref.scheduler = EulerDiscreteScheduler.from_config(ref.scheduler.config)
        assert _diff(theirs, sd_fixtures.reference_pixels(ref, prompt, noise, **{**call, "eta": 0.0})) > 5
    else:  # one step from t = 800 is the x0 estimate whatever the class (Euler's is within 0.1 level of
        # TCD's, which re-noises it to t = 0's level); the card's list is what counts: t = 999 differs
        assert _diff(ours, pipe.generate(prompt, lora=entry["lora"], **card)) > 2


def test_hyper_flux_lora_at_an_eighth_matches_diffusers(cards, record_property):
    """Hyper-FLUX.1-dev's 8-step LoRA: loaded, ``fuse_lora(lora_scale=0.125)``, the pipeline's own
    scheduler, guidance 3.5; preheat: ``lora_scale=0.125`` (applied as data, the same sum)."""
    entry, prompt, steps = cards["flux"], "a watercolor fox", 8
    noise = np.random.default_rng(5).standard_normal((1, 4, 16, 16)).astype(np.float32)
    ref = flow_fixtures.reference_pipeline(entry["folder"])
    plain = flow_fixtures.reference_pixels(ref, prompt, noise, num_inference_steps=steps, guidance_scale=3.5)
    ref.load_lora_weights(str(entry["lora"]))
    ref.fuse_lora(lora_scale=0.125)
    theirs = flow_fixtures.reference_pixels(ref, prompt, noise, num_inference_steps=steps, guidance_scale=3.5)
    pipe = entry["pipe"]
    card = dict(noise=noise, steps=steps, guidance=3.5, width=32, height=32)
    ours = pipe.generate(prompt, lora=entry["lora"], lora_scale=0.125, **card)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(theirs, plain) > 2  # the LoRA counts at an eighth
    assert _diff(ours, pipe.generate(prompt, lora=entry["lora"], lora_scale=1.0, **card)) > 2  # and so does the scale


# The Hyper-SD3 stand-in's layers: the MMDiT blocks' attention (both streams) and MLPs, diffusers/peft names
HYPER_SD3_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                     "ff.net.2", "ff_context.net.2"]


@pytest.fixture(scope="module")
def hyper_sd3(tmp_path_factory):
    """A tiny SD3-medium-like folder (its published scheduler: FlowMatchEuler, shift 3) and a random
    transformer LoRA standing in for Hyper-SD3's, strong (alpha 64, rank 4) since the card fuses it
    at 0.125."""
    from tests._support.lora_files import peft_layers, save_lora

    base = tmp_path_factory.mktemp("hyper-sd3")
    folder = flow_fixtures.save_tiny_flow_model(base / "sd3", "sd3")
    ref = _sd3_card_reference(folder)
    lora = save_lora(ref, base / "sd3-lora", "transformer",
                     {"transformer": peft_layers(ref.transformer, HYPER_SD3_TARGETS, 4, 64, seed=13)})
    return {"folder": folder, "lora": lora, "pipe": preheat.load(folder, cache="off")}


def test_hyper_sd3_lora_at_an_eighth_matches_diffusers(hyper_sd3, record_property):
    """Hyper-SD3's 8-step CFG LoRA: on SD3-medium, loaded, ``fuse_lora(lora_scale=0.125)``, the
    pipeline's own scheduler, ``num_inference_steps=8, guidance_scale=5.0`` (a "CFG" LoRA: guidance
    runs); preheat: ``lora_scale=0.125, steps=8, guidance=5.0``."""
    entry, prompt, steps = hyper_sd3, "a photo of a cat", 8
    noise = _noise(9)
    ref = _sd3_card_reference(entry["folder"])
    card = dict(num_inference_steps=steps, guidance_scale=5.0)
    plain = flow_fixtures.reference_pixels(ref, prompt, noise, **card)
    ref.load_lora_weights(str(entry["lora"]))
    ref.fuse_lora(lora_scale=0.125)
    theirs = flow_fixtures.reference_pixels(ref, prompt, noise, **card)
    pipe = entry["pipe"]
    call = dict(noise=noise, steps=steps, guidance=5.0, width=32, height=32)
    ours = pipe.generate(prompt, lora=entry["lora"], lora_scale=0.125, **call)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(theirs, plain) > 5  # the LoRA counts at an eighth (measured 29.2)
    at_one = pipe.generate(prompt, lora=entry["lora"], lora_scale=1.0, **call)
    assert _diff(ours, at_one) > 5  # and so does the scale (55.1)


# ------------------------------------------------------------------ the card's scheduler line on every surface


def test_timestep_spacing_reaches_every_surface(cards, tmp_path, monkeypatch):
    """``timestep_spacing`` is a declared input (a data one: no new program), so the CLI flag, the
    server's field and its batch key come from the declaration; a value the sampler ignores, an
    unknown value and a family that has no such schedule are one line each."""
    from click.testing import CliRunner
    from PIL import Image

    from preheat.cli import main
    from preheat.errors import InputError, InvalidArgumentError, SchedulerConfigError
    from preheat.families.inputs import typed_flags
    from preheat.server.inputs import Limits, parse_input

    entry = cards["sd1"]
    pipe = entry["pipe"]
    specs = pipe.family.input_specs(pipe)
    flags = {"--timestep-spacing": ["trailing"]}
    assert typed_flags(specs, pipe.family.name, flags) == {"timestep_spacing": "trailing"}
    assert typed_flags(specs, pipe.family.name, {"--timesteps": ["999,499"]}) == {"timesteps": (999, 499)}

    images = tmp_path / "images"
    cli_on(monkeypatch, entry["folder"], pipe)  # the module's pipeline: its programs, not a second compile
    result = CliRunner().invoke(main, ["sample", str(entry["folder"]), "--prompt", "a red fox", "--steps", "2",
                                       "--sampler", "euler", "--timestep-spacing", "trailing", "--guidance", "0",
                                       "--cache", "off", "--out", str(tmp_path / "fox.png"), "--save-images",
                                       str(images)])
    assert result.exit_code == 0, result.output
    call = dict(steps=2, seed=0, sampler="euler", guidance=0.0)
    want = pipe.generate("a red fox", timestep_spacing="trailing", **call)
    np.testing.assert_array_equal(np.asarray(Image.open(images / "0000.png")), want[0])
    assert _diff(want, pipe.generate("a red fox", **call)) > 5  # the folder's "leading" is another image

    raw = {"prompt": "a red fox", "num_inference_steps": 2, "scheduler": "euler", "seed": 1}
    trailing, _ = parse_input({**raw, "timestep_spacing": "trailing"}, pipe, Limits())
    leading, _ = parse_input(raw, pipe, Limits())
    assert trailing.batch_key != leading.batch_key  # never batched together: one schedule per call
    assert trailing.request.values["timestep_spacing"] == "trailing"
    with pytest.raises(InputError) as bad:
        parse_input({**raw, "timestep_spacing": "sideways"}, pipe, Limits())
    assert bad.value.errors[0][0] == "timestep_spacing"
    with pytest.raises(InputError) as bad:
        parse_input({**raw, "scheduler": "lcm", "timestep_spacing": "trailing"}, pipe, Limits())
    # a server's message names the sampler by its field (scheduler), as the engine's names its keyword
    assert bad.value.errors[0] == ("timestep_spacing", "timestep_spacing does not apply to scheduler 'lcm': "
                                                       "LCMScheduler does not read it")
    tcd, _ = parse_input({**raw, "scheduler": "tcd", "num_inference_steps": 1, "timesteps": [800]}, pipe, Limits())
    assert tcd.request.values["timesteps"] == (800,) and ("timesteps", (800,)) in tcd.batch_key[3]
    with pytest.raises(InputError) as bad:  # steps must be their count; euler takes no list
        parse_input({**raw, "scheduler": "tcd", "timesteps": [800]}, pipe, Limits())
    assert bad.value.errors[0] == ("timesteps", "timesteps has 1 entries but num_inference_steps=2; leave "
                                                "num_inference_steps out or give num_inference_steps=1")
    no_steps, _ = parse_input({**raw, "scheduler": "tcd", "num_inference_steps": None, "timesteps": [800]}, pipe,
                              Limits())
    assert no_steps.steps == 1 and no_steps.batch_key == tcd.batch_key  # their count, as diffusers' pipelines
    with pytest.raises(InputError) as bad:
        parse_input({**raw, "num_inference_steps": 1, "timesteps": [800]}, pipe, Limits())
    assert bad.value.errors[0] == ("timesteps", "timesteps is not supported for scheduler 'euler'; only lcm, tcd take "
                                                "it")

    with pytest.raises(SchedulerConfigError, match="timestep_spacing does not apply to sampler 'tcd'") as err:
        pipe.check("x", sampler="tcd", timestep_spacing="trailing")
    assert err.value.argument == "timestep_spacing" and "\n" not in str(err.value)
    with pytest.raises(InvalidArgumentError, match="timestep_spacing='sideways' is not one of"):
        pipe.check("x", timestep_spacing="sideways")
    flux = cards["flux"]["pipe"]
    with pytest.raises(InvalidArgumentError, match="unexpected argument 'timestep_spacing' for a flux model"):
        flux.check("x", timestep_spacing="trailing")


def test_torch_backend_takes_the_same_spacing(cards, record_property):
    """``backend="torch"`` builds its diffusers scheduler from the folder's config with the call's
    overrides and passes the call's timesteps on: the images of diffusers' pipeline set up as the
    cards say (``EulerDiscreteScheduler.from_config(config, timestep_spacing="trailing")``;
    ``TCDScheduler.from_config(config)`` called with ``timesteps=[800]``), within a level, not the
    folder's spacing or TCD's own 1-step schedule. The JAX engine's images for the same lines are
    checked against the same diffusers set-up above (the Lightning and TCD cards), so this needs
    no SDXL program of its own (it compiled two, without a LoRA, for this check alone)."""
    from diffusers import EulerDiscreteScheduler, TCDScheduler

    entry, prompt = cards["sdxl"], "a red fox"
    torch_pipe = preheat.load(entry["folder"], backend="torch", cache="off")
    ref = sd_fixtures.reference_pipeline(entry["folder"], "euler")
    size = dict(height=32, width=32, guidance_scale=0.0)
    call = dict(noise=_noise(6), steps=2, sampler="euler", guidance=0.0)
    theirs = torch_pipe.generate(prompt, timestep_spacing="trailing", **call)
    ref.scheduler = EulerDiscreteScheduler.from_config(ref.scheduler.config, timestep_spacing="trailing")
    card = sd_fixtures.reference_pixels(ref, prompt, _noise(6), num_inference_steps=2, **size)
    record_property("mean_abs_px", _diff(card, theirs))
    assert _diff(card, theirs) <= MEAN_TOL, _diff(card, theirs)
    assert _diff(theirs, torch_pipe.generate(prompt, **call)) > 5
    one = dict(noise=_noise(6), steps=1, sampler="tcd", guidance=0.0, eta=1.0)  # diffusers' pipeline takes the list
    theirs = torch_pipe.generate(prompt, timesteps=[800], **one)
    ref.scheduler = TCDScheduler.from_config(ref.scheduler.config)
    card = sd_fixtures.reference_pixels(ref, prompt, _noise(6), timesteps=[800], eta=1.0, **size)
    assert _diff(card, theirs) <= MEAN_TOL, _diff(card, theirs)
    assert _diff(theirs, torch_pipe.generate(prompt, **one)) > 2
    # eta reaches diffusers' pipeline: TCD's gamma 0.3 against 0 (diffusers draws its own per-step noise
    # from the seeds' generators, so this is not compared with another pipeline's image)
    four = dict(noise=_noise(6), steps=4, sampler="tcd", guidance=0.0)
    assert _diff(torch_pipe.generate(prompt, eta=0.3, **four), torch_pipe.generate(prompt, eta=0.0, **four)) > 2
