"""FLUX.1-schnell, FLUX.1-dev and SD3 through preheat.load, against diffusers' own pipelines on the
same tiny random-weight folders and the same initial latents."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import preheat
from preheat.cache.executables import Executables
from preheat.engine import Signature
from preheat.errors import InvalidArgumentError, PreheatError, SchedulerConfigError
from preheat.families.request import plan
from tests._support.flow_fixtures import reference_pipeline, reference_pixels, save_tiny_flow_model
from tests._support.numerics import px_diff

MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255 (1/255 on the [0, 1] scale)
FOLDERS = {"flux-schnell": ("flux-schnell", True), "flux-dev": ("flux-dev", True), "sd3": ("sd3", True),
           "sd3-no-t5": ("sd3", False)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("flow")
    return {name: save_tiny_flow_model(base / name, kind, t5=t5) for name, (kind, t5) in FOLDERS.items()}


@pytest.fixture(scope="module")
def pipes(folders):
    return {name: preheat.load(folder, cache="off") for name, folder in folders.items()}


# The size of the parity cases: FLUX.1's native size is 256x256 here (128 latents a side, a 2x VAE),
# 64 times the pixels; the tests below whose point is not the size draw at this one.
SMALL = dict(width=32, height=32)


def _noise(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4, 16, 16)).astype(np.float32)


CASES = [
    ("flux-schnell", "flow_euler", dict(prompt=["a photo of a cat", "an astronaut riding a horse"])),
    ("flux-dev", "flow_euler", dict(prompt="a watercolor fox", guidance_scale=3.5)),
    ("flux-dev", "flow_euler", dict(prompt=["a red fox", "city at night"], guidance_scale=5.0)),
    ("sd3", "flow_euler", dict(prompt=["a photo of a dog", "a red fox"], guidance_scale=7.0)),
    ("sd3", "flow_euler", dict(prompt="a portrait", negative_prompt="blurry", guidance_scale=4.0)),
    ("sd3", "flow_heun", dict(prompt="a photo of a cat", guidance_scale=5.0)),
    ("sd3", "flow_euler", dict(prompt="city at night", guidance_scale=1.0)),
    ("sd3-no-t5", "flow_euler", dict(prompt="a photo of a cat", guidance_scale=6.0)),
    # diffusers' true CFG: the negatives' branch beside the embedded scale (dev), or alone (schnell)
    ("flux-dev", "flow_euler", dict(prompt=["a red fox", "city at night"], negative_prompt=["blurry", "dark"],
                                    true_cfg_scale=4.0, guidance_scale=3.5)),
    ("flux-schnell", "flow_euler", dict(prompt="a photo of a cat", negative_prompt="blurry",
                                        negative_prompt_2="a drawing", true_cfg_scale=2.5)),
    # max_sequence_length: T5's padded length (a prompt longer than it truncated); without T5, SD3's zeros
    ("flux-dev", "flow_euler", dict(prompt="a red fox in the snow at night, watercolor", guidance_scale=3.5,
                                    max_sequence_length=8)),
    ("sd3-no-t5", "flow_euler", dict(prompt="a photo of a cat", guidance_scale=6.0, max_sequence_length=32)),
    # SD3's prompt per encoder (CLIP-L, CLIP-G, T5), and the negatives' (the third from the negative prompt)
    ("sd3", "flow_euler", dict(prompt=["a photo of a dog", "a red fox"], prompt_2=["an oil painting"] * 2,
                               prompt_3=["a dog on a beach at sunset", "a fox in the snow"], negative_prompt="blurry",
                               negative_prompt_2="dark", guidance_scale=5.0)),
]


@pytest.mark.parametrize("name,sampler,call", CASES, ids=[f"{k}-{s}-{i}" for i, (k, s, _) in enumerate(CASES)])
def test_matches_diffusers_from_the_same_latents(folders, pipes, name, sampler, call, record_property):
    call = dict(call)
    prompt = call.pop("prompt")
    n = len(prompt) if isinstance(prompt, list) else 1
    noise = _noise(n)
    steps = 4
    ref = reference_pipeline(folders[name], sampler)
    theirs = reference_pixels(ref, prompt, noise, num_inference_steps=steps, **call)
    guidance = call.pop("guidance_scale", None)
    ours = pipes[name].generate(prompt, noise=noise, steps=steps, sampler=sampler, guidance=guidance,
                                width=32, height=32, **call)
    assert ours.shape == theirs.shape == (n, 32, 32, 3) and ours.dtype == np.uint8
    diff = px_diff(ours, theirs)
    record_property("mean_abs_px", float(diff.mean()))
    print(f"{name}/{sampler}: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= MEAN_TOL, (diff.mean(), diff.max())
    assert ours.std() > 5  # not a flat image (flat images would agree for any model)


@pytest.mark.parametrize("name,calls", [
    ("flux-dev", [dict(prompt="a red fox", steps=2, guidance=2.0, seed=0),
                  dict(prompt="a photo of a cat", steps=5, guidance=3.5, seed=0),
                  dict(prompt="a photo of a cat", steps=2, guidance=3.5, seed=7)]),
    ("sd3", [dict(prompt="a red fox", steps=2, guidance=7.0, seed=0),
             dict(prompt="a photo of a cat", steps=5, guidance=3.0, seed=0),
             dict(prompt="a photo of a cat", negative_prompt="blurry", steps=2, guidance=7.0, seed=9),
             # each encoder's own prompt is data of the same programs, and reaches the image
             dict(prompt="a photo of a cat", prompt_2="a red fox", steps=2, guidance=7.0, seed=0),
             dict(prompt="a photo of a cat", prompt_3="a red fox", steps=2, guidance=7.0, seed=0),
             dict(prompt="a photo of a cat", negative_prompt_2="a red fox", steps=2, guidance=7.0, seed=0),
             dict(prompt="a photo of a cat", negative_prompt_3="a red fox", steps=2, guidance=7.0, seed=0)]),
])
def test_prompt_guidance_steps_and_seed_are_data(pipes, name, calls):
    """One denoising program serves every prompt, guidance scale, step count and seed (a trace counter)."""
    pipe = dataclasses.replace(pipes[name], executables=Executables())
    traces = []
    apply = pipe.apply

    def counting(*args):
        traces.append(1)  # runs only while JAX traces the denoiser
        return apply(*args)

    pipe.apply = counting
    first = pipe.generate("a photo of a cat", steps=2, guidance=calls[0]["guidance"], seed=0, **SMALL)
    traced, compiled = len(traces), len(pipe.executables)
    assert traced >= 1
    outs = [pipe.generate(**c, **SMALL) for c in calls]
    assert len(traces) == traced  # no retrace
    assert len(pipe.executables) == compiled  # nothing new compiled
    assert all(not np.array_equal(first, o) for o in outs)  # and each input really changed the image


def test_flux_dev_guidance_is_one_branch_of_data(pipes):
    pipe = pipes["flux-dev"]
    assert pipe.defaults["guidance"] == 3.5 and pipe.defaults["steps"] == 28
    assert not pipe.is_guided(7.0)  # embedded guidance never doubles the batch
    a = pipe.generate("a fox", steps=2, guidance=1.0, seed=1, **SMALL)  # the parity case's program
    b = pipe.generate("a fox", steps=2, guidance=4.0, seed=1, **SMALL)
    assert not np.array_equal(a, b)  # 1.0 is a real value for an embedded scale, not "off"


def test_flux_true_cfg_is_two_branches_and_its_scale_is_data(pipes):
    """A negative prompt with true_cfg_scale > 1 guides (another program: two branches); the scale,
    the negative prompt and the embedded guidance are data of that one program."""
    pipe = dataclasses.replace(pipes["flux-dev"], executables=Executables())
    assert pipe.is_guided(3.5, negative_prompt="", true_cfg_scale=1.5)
    assert not pipe.is_guided(3.5, negative_prompt="", true_cfg_scale=1.0)  # 1 is off, as diffusers
    request = pipe.validate("a fox", negative_prompt="blurry", true_cfg_scale=4.0, guidance=2.0)
    assert request.guided and (request.guidance, request.cfg_scale) == (2.0, 4.0)
    calls = [dict(negative_prompt="blurry", true_cfg_scale=4.0, guidance=3.5),
             dict(negative_prompt="blurry", true_cfg_scale=2.0, guidance=3.5),
             dict(negative_prompt="a dark room", true_cfg_scale=2.0, guidance=3.5),
             dict(negative_prompt="a dark room", true_cfg_scale=2.0, guidance=5.0)]
    outs = [pipe.generate("a fox", steps=2, seed=1, **c, **SMALL) for c in calls]
    denoisers = [s for s in pipe.executables.signatures() if isinstance(s, Signature)]
    assert len(denoisers) == 1 and denoisers[0].guided  # one guided program served all four calls
    assert all(not np.array_equal(a, b) for a, b in zip(outs, outs[1:]))  # each value reached the image


@pytest.mark.parametrize("name", ["flux-dev", "flux-schnell"])
def test_warm_up_compiles_true_cfg_with_guidance_on(pipes, name):
    """FLUX.1's guided programs are its true-CFG ones: warmed with guidance "on" (a negative prompt
    and true_cfg_scale given), never with "off", and not where the negative prompt is not offered.
    Each signature's call runs the mode it is listed under."""
    from preheat import warm as warming

    pipe = pipes[name]

    def sigs(*modes: str, inputs: tuple[str, ...] = ("negative_prompt",)) -> list:  # no image programs
        declared = warming.WarmSet(max_batch_size=1, sizes=((32, 32),), guidance=modes, inputs=inputs, progress=False)
        return warming.signatures(pipe, warming.resolve(pipe, declared))

    off, on = sigs("off"), sigs("on")
    assert [(s.guided, s.given) for s in off] == [(False, (("prompt", ""),))]
    assert [(s.guided, s.variant) for s in on] == [(True, ("negative_prompt", "true_cfg_scale"))]
    assert sigs("on", inputs=()) == []  # --inputs none: no negative prompt, so nothing guides
    assert sigs("on", inputs=None) == []  # nor by default: a FLUX.1 server offers it only when --inputs names it
    for sig in off + on:
        assert pipe.validate(sig.bucket, **warming.call_inputs(pipe, sig)).guided == sig.guided
    assert "guidance off" in off[0].describe() and "+negative_prompt +true_cfg_scale" in on[0].describe()


@pytest.mark.parametrize("name,default", [("flux-dev", 512), ("sd3", 256)])
def test_max_sequence_length_is_static_and_reaches_the_image(pipes, name, default):
    """diffusers' defaults (Flux 512, SD3 256); another length is another encode and denoise program
    (the context's length), and it changes the image."""
    pipe = pipes[name]
    assert pipe.validate("a fox").values["max_sequence_length"] == default
    spec = next(s for s in pipe.family.input_specs(pipe) if s.name == "max_sequence_length")
    assert spec.static and spec.default == default
    call = dict(steps=2, seed=3, guidance=3.5, **SMALL)
    full = pipe.generate("a fox", **call)
    np.testing.assert_array_equal(pipe.generate("a fox", max_sequence_length=default, **call), full)
    assert not np.array_equal(pipe.generate("a fox", max_sequence_length=16, **call), full)


def test_a_server_offers_flux_negative_prompts_only_when_declared(pipes):
    """The true-CFG programs would double a FLUX.1 server's warm-up for an input few deployments
    use: without --inputs naming negative_prompt the request is refused in one line per field, naming
    the --inputs that offers it; with it, the request is a guided job."""
    from preheat.errors import PreheatError
    from preheat.server.inputs import Limits, parse_input

    pipe = pipes["flux-dev"]
    request = {"prompt": "x", "negative_prompt": "y", "true_cfg_scale": 3.0}
    with pytest.raises(PreheatError) as err:
        parse_input(request, pipe, Limits())
    assert "negative_prompt is not served here (start the server with --inputs negative_prompt,image,mask_image" \
        in str(err.value)
    job, _ = parse_input(request, pipe, Limits(inputs=("negative_prompt",)))
    assert dict(job.values)["true_cfg_scale"] == 3.0 and dict(job.values)["negative_prompt_2"] == ("y",)


def test_schnell_defaults_and_no_guidance(pipes):
    pipe = pipes["flux-schnell"]
    assert pipe.defaults["steps"] == 4 and pipe.defaults["guidance"] is None
    with pytest.raises(InvalidArgumentError, match="takes no guidance") as err:
        pipe.generate("a fox", steps=1, guidance=3.5)
    assert len(str(err.value).splitlines()) == 1
    # 1 = off everywhere in preheat (two seeded images: the torch case's program, not one of its own)
    assert pipe.generate(["a fox", "a cat"], steps=1, guidance=1.0, seed=[4, 5], **SMALL).shape[0] == 2


@pytest.mark.parametrize("name,kwargs,exc,needle", [
    ("flux-dev", dict(prompt="x", sampler="ddpm"), SchedulerConfigError, "use one of: flow_euler"),
    ("sd3", dict(prompt="x", sampler="dpmpp_2m"), SchedulerConfigError, "not for a stable-diffusion-3 model"),
    # diffusers ignores a negative prompt without true_cfg_scale > 1, and warns about the reverse
    ("flux-dev", dict(prompt="x", negative_prompt="y"), InvalidArgumentError, "give true_cfg_scale above 1"),
    ("flux-dev", dict(prompt="x", negative_prompt="y", true_cfg_scale=1.0), InvalidArgumentError,
     "negative_prompt needs classifier-free guidance"),
    ("flux-schnell", dict(prompt="x", true_cfg_scale=4.0), InvalidArgumentError,
     "true_cfg_scale needs negative_prompt"),
    ("flux-dev", dict(prompt="x", negative_prompt="y", true_cfg_scale=-2), InvalidArgumentError,
     "true_cfg_scale=-2 must be a finite number >= 0"),
    ("flux-dev", dict(prompt="x", negative_prompt_2="y", true_cfg_scale=4.0), InvalidArgumentError,
     "negative_prompt_2 needs negative_prompt"),
    ("flux-dev", dict(prompt="x", max_sequence_length=513), InvalidArgumentError,
     "max_sequence_length=513 must be an int in [1, 512]"),
    ("sd3", dict(prompt="x", max_sequence_length=0), InvalidArgumentError, "max_sequence_length=0 must be"),
    ("flux-dev", dict(prompt="x", width=42), InvalidArgumentError, "multiple of 4"),  # 2x2 packing of 2x latents
    ("sd3", dict(prompt="x", width=34), InvalidArgumentError, "multiple of 4"),  # patch 2 of 2x latents
    ("sd3", dict(prompt="x", negative_prompt="y", guidance=1.0), InvalidArgumentError, "needs classifier-free"),
    ("flux-schnell", dict(prompt=None), InvalidArgumentError, "prompt is required"),
])
def test_bad_input_is_one_line(pipes, name, kwargs, exc, needle):
    with pytest.raises(exc) as err:
        pipes[name].check(**kwargs, steps=2)
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1


def test_flux_resolution_is_static_and_shifts_the_schedule(pipes):
    """mu follows the token count: a wider image is another program and another schedule."""
    pipe = pipes["flux-dev"]
    wide = pipe.generate("a fox", width=48, height=32, steps=2, seed=1)
    assert wide.shape == (1, 32, 48, 3)
    small = plan(pipe, pipe.validate("a fox", width=32, height=32, steps=2))
    large = plan(pipe, pipe.validate("a fox", width=64, height=64, steps=2))
    assert large.sigmas[1] > small.sigmas[1]  # more tokens: more shift toward noise


def test_offload_encoders_keeps_text_weights_on_the_host(folders, pipes):
    """In the device's pinned host memory (the CPU backend has it too), read by the encode program."""
    pipe = preheat.load(folders["sd3"], cache="off", offload_encoders=True)
    leaves = [leaf for te in pipe.components.text_encoders for leaf in
              __import__("jax").tree.leaves(te.params)]
    assert leaves and all(leaf.sharding.memory_kind == "pinned_host" for leaf in leaves if leaf.ndim >= 2)
    same = pipes["sd3"].generate("a fox", steps=2, seed=4)
    np.testing.assert_array_equal(pipe.generate("a fox", steps=2, seed=4), same)


def test_offloaded_encoders_deferred_reads_reach_the_host(folders, pipes):
    """With ``prefetch`` the reads wait (``weights.LoadOptions.pending``): an offloaded encoder's weights
    are placeholders until read, then on the host, equal to a direct load's."""
    import jax

    from preheat.families.sd3 import load_stable_diffusion_3
    from preheat.models.weights import DeferredFills, LoadOptions

    pending = DeferredFills()
    loaded = load_stable_diffusion_3(folders["sd3"], offload_encoders=True, options=LoadOptions(pending=pending))
    encoders = [te for te in loaded.components.text_encoders if te is not None]
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for te in encoders for leaf in jax.tree.leaves(te.params))
    pending.run()
    leaves = [leaf for te in encoders for leaf in jax.tree.leaves(te.params)]
    direct = [leaf for te in pipes["sd3"].components.text_encoders if te is not None
              for leaf in jax.tree.leaves(te.params)]
    assert leaves and all(leaf.sharding.memory_kind == "pinned_host" for leaf in leaves if leaf.ndim >= 2)
    assert len(leaves) == len(direct) and all(np.array_equal(a, np.asarray(b)) for a, b in zip(leaves, direct))


def test_a_restart_prefetches_every_stage_of_a_flow_model(folders):
    """Issue 17: SD3's three encoders (T5 included), its flow loop and its decoder are loaded on the
    background thread while the weights are read; the keys come from a rehearsal on placeholder
    weights (no prompt needed: its words are data; the step count is data too). The image is the
    first start's."""
    call = dict(prompt="a fox", steps=2, seed=4)
    cold = preheat.load(folders["sd3"])  # this test's own cache root (conftest): compiles and stores
    want = cold.generate(**call)
    warm = preheat.load(folders["sd3"], prefetch=[{"steps": 28}])
    np.testing.assert_array_equal(warm.generate(**call), want)
    got = [(e["stage"], e["layer"], e.get("prefetch")) for e in warm.compiler.events]
    assert got == [(s, "aot", "background") for s in ("encode", "denoise", "decode")], warm.compiler.events


def test_a_cold_prefetch_compiles_the_three_stages_at_once(folders):
    """Nothing cached: SD3's encode, flow loop and decoder compile together on the prefetch's
    threads while the weights are read (not one after another on the first call); the image is an
    uncached load's."""
    call = dict(prompt="a fox", steps=2, seed=4)
    want = preheat.load(folders["sd3"], cache="off").generate(**call)
    cold = preheat.load(folders["sd3"], prefetch=[{"steps": 28}])  # this test's own, empty cache root
    np.testing.assert_array_equal(cold.generate(**call), want)
    got = [(e["stage"], e.get("prefetch"), e.get("background_compile")) for e in cold.compiler.events]
    assert got == [(s, "background", "done") for s in ("encode", "denoise", "decode")], cold.compiler.events


def test_offload_encoders_is_refused_for_models_without_text():
    with pytest.raises(PreheatError, match="offload_encoders applies to text-to-image models"):
        preheat.load(None, cache="off", offload_encoders=True)


@pytest.mark.parametrize("name,call", [("flux-dev", dict(guidance=3.5)), ("flux-schnell", {}),
                                       ("sd3", dict(prompt_3="a watercolor", negative_prompt_3="a photo",
                                                    guidance=5.0)),
                                       ("flux-dev", dict(guidance=3.5, negative_prompt=["blurry", "dark"],
                                                         negative_prompt_2="a drawing", true_cfg_scale=3.0,
                                                         max_sequence_length=64)),
                                       ("sd3", dict(negative_prompt="blurry", guidance=5.0))])
def test_torch_backend_draws_the_same_images(folders, pipes, name, call):
    """backend="torch" runs diffusers' own pipeline on the same seeds (the same initial latents)."""
    torch_pipe = preheat.load(folders[name], backend="torch")
    assert torch_pipe.defaults == pipes[name].defaults
    theirs = torch_pipe.generate(["a red fox", "a cat"], steps=3, seed=[4, 5], width=32, height=32, **call)
    ours = pipes[name].generate(["a red fox", "a cat"], steps=3, seed=[4, 5], width=32, height=32, **call)
    diff = px_diff(ours, theirs)
    assert diff.mean() <= MEAN_TOL, (diff.mean(), diff.max())
