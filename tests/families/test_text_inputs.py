"""The text families' second-encoder and conditioning inputs reach the image exactly as diffusers'.

Flux's ``prompt_2`` (T5), SDXL's ``prompt_2`` / ``negative_prompt_2`` and size ids, and SD's and
SDXL's ``clip_skip``: each is compared with diffusers' own pipeline from the same latents, and
each is shown to move the image by more than that tolerance, so a family that ignored it would fail.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import preheat
from preheat.cache.executables import Executables
from preheat.errors import InvalidArgumentError
from tests._support import flow_fixtures, sd_fixtures
from tests._support.numerics import mean_abs_px

MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255 (1/255 on the [0, 1] scale)
STEPS = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("text-inputs")
    return {"sd1": sd_fixtures.save_tiny_sd(base / "sd1", kind="sd1"),
            "sdxl": sd_fixtures.save_tiny_sd(base / "sdxl", kind="sdxl"),
            "flux-dev": flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")}


@pytest.fixture(scope="module")
def pipes(folders):
    return {name: preheat.load(folder, cache="off") for name, folder in folders.items()}


def _noise(n: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, 4, 16, 16)).astype(np.float32)


# (model, the call without the inputs under test, the inputs under test); one sampler per model and
# mostly one image, so the module compiles few programs
CASES = [
    ("sd1", dict(prompt="a photo of a cat", negative_prompt="blurry", guidance_scale=7.5), dict(clip_skip=1)),
    ("sd1", dict(prompt=["a red fox", "city at night"], guidance_scale=5.0), dict(clip_skip=2)),
    ("sdxl", dict(prompt="a photo of a dog", negative_prompt="low quality", guidance_scale=5.0),
     dict(prompt_2="an oil painting of a harbour", negative_prompt_2="blurry")),
    ("sdxl", dict(prompt=["a photo of a dog"], guidance_scale=5.0),
     dict(prompt_2=["a castle"])),  # no negative: force_zeros keeps the uncond branch zeros
    ("sdxl", dict(prompt="a portrait", negative_prompt="low quality", guidance_scale=4.0), dict(clip_skip=1)),
    ("sdxl", dict(prompt="a portrait of a woman", negative_prompt="low quality", guidance_scale=4.0),
     dict(original_size=(64, 48), crops_coords_top_left=(60, 20), target_size=(96, 40))),
    # one image: diffusers pairs the negative ids with the wrong images for n > 1 (see the torch backend)
    ("sdxl", dict(prompt="a lighthouse", negative_prompt="blurry", guidance_scale=6.0),
     dict(negative_original_size=(512, 512), negative_crops_coords_top_left=(30, 8), negative_target_size=(256, 512))),
    ("flux-dev", dict(prompt="a watercolor fox", guidance_scale=3.5),
     dict(prompt_2="an astronaut riding a horse on the moon")),
    ("flux-dev", dict(prompt=["a red fox"], guidance_scale=3.5), dict(prompt_2=["a castle on a quiet forest lake"])),
]
SAMPLER = {"sd1": "euler", "sdxl": "euler", "flux-dev": "flow_euler"}


@pytest.mark.parametrize("name,call,extra", CASES, ids=[f"{n}-{'+'.join(e)}-{i}" for i, (n, _, e) in enumerate(CASES)])
def test_input_matches_diffusers_and_moves_the_image(folders, pipes, name, call, extra, record_property):
    call = dict(call)
    prompt = call.pop("prompt")
    n = len(prompt) if isinstance(prompt, list) else 1
    noise = _noise(n)
    fixtures = flow_fixtures if name == "flux-dev" else sd_fixtures
    ref = fixtures.reference_pipeline(folders[name], SAMPLER[name])
    size = {} if name == "flux-dev" else dict(height=32, width=32)  # flow_fixtures sizes from the latents
    theirs = fixtures.reference_pixels(ref, prompt, noise, num_inference_steps=STEPS, **size, **call, **extra)
    guidance = call.pop("guidance_scale")
    common = dict(noise=noise, steps=STEPS, sampler=SAMPLER[name], guidance=guidance, width=32, height=32, **call)
    ours = pipes[name].generate(prompt, **common, **extra)
    without = pipes[name].generate(prompt, **common)
    assert ours.shape == theirs.shape == (n, 32, 32, 3)
    parity, moved = mean_abs_px(ours, theirs), mean_abs_px(ours, without)
    record_property("mean_abs_px", parity)
    print(f"{name} {sorted(extra)}: mean |Δpx| vs diffusers {parity:.4f}; the input moves it {moved:.4f}")
    assert parity <= MEAN_TOL, parity
    # the input moves the image, and diffusers' image with it is far nearer ours than ours without it
    # is: a family that ignored the input, or fed it to the wrong place, would fail here
    assert moved > 0 and parity <= moved / 4, (parity, moved)
    assert ours.std() > 5  # not a flat image


def test_clip_skip_0_and_an_empty_prompt_2_are_the_defaults(pipes):
    """diffusers: clip_skip=0 is the default embedding; prompt_2 = prompt_2 or prompt."""
    sdxl, flux = pipes["sdxl"], pipes["flux-dev"]
    base = dict(steps=2, seed=3, width=32, height=32)
    np.testing.assert_array_equal(sdxl.generate("a dog", clip_skip=0, **base), sdxl.generate("a dog", **base))
    np.testing.assert_array_equal(sdxl.generate("a dog", prompt_2="", **base), sdxl.generate("a dog", **base))
    np.testing.assert_array_equal(flux.generate("a dog", prompt_2="", **base),
                                  flux.generate("a dog", prompt_2="a dog", **base))


def _counting_encoders(pipe, monkeypatch) -> list[int]:
    """Count traces of the encode program: its encoders' ``apply`` runs only while JAX traces it."""
    traces: list[int] = []
    for encoder in pipe.components.text_encoders:
        apply = encoder.apply

        def counting(*args, _apply=apply, **kwargs):
            traces.append(1)
            return _apply(*args, **kwargs)

        monkeypatch.setattr(encoder, "apply", counting)
    return traces


@pytest.mark.parametrize("name,calls", [
    ("sd1", [dict(clip_skip=1), dict(clip_skip=2)]),
    ("sdxl", [dict(clip_skip=1), dict(prompt_2="a castle", negative_prompt_2="grainy"),
              dict(original_size=(64, 64), crops_coords_top_left=(8, 8), target_size=(16, 48)),
              dict(negative_original_size=(8, 8), negative_target_size=(8, 8))]),
    ("flux-dev", [dict(prompt_2="a castle"), dict(prompt_2="a quiet lake")]),
])
def test_the_inputs_are_data_one_program_serves_every_value(pipes, monkeypatch, name, calls):
    """No value of these inputs traces or compiles anything new (encode or denoise)."""
    pipe = dataclasses.replace(pipes[name], executables=Executables())
    traces = _counting_encoders(pipe, monkeypatch)
    base = dict(steps=2, seed=0, width=32, height=32, sampler=SAMPLER[name], guidance=3.5 if name == "flux-dev" else 5.0)
    if name != "flux-dev":
        base["negative_prompt"] = "blurry"  # every call guided with a negative: one encode batch shape
    first = pipe.generate("a photo of a cat", **base)
    traced, compiled = len(traces), len(pipe.executables)
    assert traced >= 1
    for call in calls:
        out = pipe.generate("a photo of a cat", **base, **call)
        assert not np.array_equal(out, first)  # the input changed the image
    assert len(traces) == traced  # no retrace of the encoders
    assert len(pipe.executables) == compiled  # nothing new compiled


def test_clip_skip_per_image_is_each_images_own(pipes):
    """A batch may mix clip_skip values: each image is what its value alone gives, from one program."""
    pipe = pipes["sd1"]
    call = dict(steps=2, seed=[1, 2], width=32, height=32, sampler="euler", guidance=5.0)
    prompts = ["a photo of a cat", "a red fox"]
    uniform = [pipe.generate(prompts, clip_skip=k, **call) for k in (0, 2)]
    compiled = len(pipe.executables)
    mixed = pipe.generate(prompts, clip_skip=[0, 2], **call)
    assert len(pipe.executables) == compiled
    np.testing.assert_array_equal(mixed[0], uniform[0][0])
    np.testing.assert_array_equal(mixed[1], uniform[1][1])
    assert not np.array_equal(mixed[1], uniform[0][1])


@pytest.mark.parametrize("name,kwargs,argument,needle", [
    ("sd1", dict(clip_skip=3), "clip_skip", "clip_skip=3 must be an int in [0, 2]"),  # 2 layers: skip all -> embeddings
    ("sd1", dict(clip_skip=-1), "clip_skip", "must be an int in [0, 2]"),
    ("sd1", dict(clip_skip=True), "clip_skip", "must be an int"),
    ("sd1", dict(clip_skip=1.0), "clip_skip", "must be an int"),
    ("sd1", dict(clip_skip=[1], n=2), "clip_skip", "got 1 clip_skips for n=2"),
    ("sd1", dict(prompt_2="x"), "prompt_2", "unexpected argument 'prompt_2'"),
    ("sdxl", dict(clip_skip=2), "clip_skip", "must be an int in [0, 1]"),  # SDXL counts from the penultimate
    ("sdxl", dict(prompt_2=3), "prompt_2", "prompt_2 must be a string"),
    ("sdxl", dict(prompt_2=["a", "b"]), "prompt_2", "got 2 prompt_2s for n=1"),
    ("sdxl", dict(negative_prompt_2="x"), "negative_prompt_2", "needs negative_prompt"),
    ("sdxl", dict(negative_prompt="a", negative_prompt_2="b", guidance=1.0), "negative_prompt", "needs classifier"),
    ("sdxl", dict(negative_original_size=(8, 8), negative_target_size=(8, 8), guidance=1.0),
     "negative_original_size", "needs classifier-free guidance"),
    ("sdxl", dict(negative_original_size=(8, 8)), "negative_original_size", "needs negative_target_size"),
    ("sdxl", dict(negative_target_size=(8, 8)), "negative_target_size", "needs negative_original_size"),
    ("sdxl", dict(negative_crops_coords_top_left=(1, 1)), "negative_crops_coords_top_left", "needs negative_orig"),
    ("sdxl", dict(target_size=(64,)), "target_size", "two non-negative ints"),
    ("sdxl", dict(crops_coords_top_left=(-1, 0)), "crops_coords_top_left", "two non-negative ints"),
    ("flux-dev", dict(prompt_2=7), "prompt_2", "prompt_2 must be a string"),
    ("flux-dev", dict(clip_skip=1), "clip_skip", "unexpected argument 'clip_skip'"),
    ("flux-dev", dict(guidance_rescale=0.7), "guidance_rescale", "unexpected argument 'guidance_rescale' for a flux"),
])
def test_bad_values_are_one_line_errors_naming_the_argument(pipes, name, kwargs, argument, needle):
    kwargs = {"prompt": "a fox", **kwargs}
    with pytest.raises(InvalidArgumentError) as err:
        pipes[name].generate(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert err.value.argument == argument


TORCH_CALLS = {
    "sd1": dict(negative_prompt="blurry", clip_skip=1),
    "sdxl": dict(negative_prompt="blurry", prompt_2=["a castle", "a lake"], negative_prompt_2="grainy", clip_skip=1,
                 original_size=(64, 48), crops_coords_top_left=(4, 2), target_size=(40, 40)),
}


@pytest.mark.parametrize("name", sorted(TORCH_CALLS))
def test_the_torch_backend_takes_the_same_inputs(folders, pipes, name):
    """diffusers through preheat's torch backend gets every input (same latents, same pixels)."""
    from preheat.backends.torch import load_torch_pipeline

    torch_pipe = load_torch_pipeline(folders[name], cache="off")
    call = dict(steps=3, sampler="euler", guidance=5.0, seed=[4, 5], width=32, height=32, **TORCH_CALLS[name])
    prompts = ["a photo of a cat", "a red fox"]
    a = pipes[name].generate(prompts, **call)
    b = torch_pipe.generate(prompts, **call)
    assert a.shape == b.shape and mean_abs_px(a, b) <= MEAN_TOL
    without = torch_pipe.generate(prompts, **{**call, "clip_skip": 0})
    assert mean_abs_px(b, without) > 4 * mean_abs_px(a, b)  # clip_skip reached diffusers
    with pytest.raises(InvalidArgumentError) as err:
        torch_pipe.generate(prompts, clip_skip=[0, 1], steps=1)
    assert err.value.argument == "clip_skip"
    if name == "sdxl":  # diffusers mis-pairs the negative branch's ids with two or more images: refused
        with pytest.raises(InvalidArgumentError) as err:
            torch_pipe.generate(prompts, negative_prompt="x", negative_original_size=(8, 8),
                                negative_target_size=(8, 8), steps=1)
        assert err.value.argument == "negative_original_size" and "\n" not in str(err.value)
