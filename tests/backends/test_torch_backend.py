"""The torch backend against the JAX engine: same arguments, same errors, same noise, same images."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

import preheat  # noqa: E402
from preheat import engine, noise  # noqa: E402
from preheat.backends.torch import TorchPipeline, initial_noise  # noqa: E402
from preheat.backends.torch import load_torch_pipeline as torch_load  # noqa: E402
from preheat.errors import InvalidArgumentError, ModelNotFoundError, PreheatError, UnsupportedConfigError  # noqa: E402
from tests._support.numerics import px_diff
from tests._support.reference import TINY_CLASS_CONDITIONAL, save_tiny_pipeline  # noqa: E402

# mean |Δ| over all pixels must stay within one uint8 level (1/255)
MEAN_TOL = 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny-pipeline"))


@pytest.fixture(scope="module")
def pipes(tiny):
    return preheat.load(tiny, cache="off"), torch_load(tiny)


def _mean_and_max_px(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """(mean, max) |difference| of two uint8 images of one shape, in levels of 255: the torch-vs-JAX
    checks record both and the per-image seed check bounds the max, so not numerics.mean_abs_px."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    d = px_diff(a, b)
    return float(d.mean()), int(d.max())


def test_initial_noise_is_the_engines_batch_draw():
    seeds = np.array([0, 1, 7, 2**32 - 1], np.uint32)
    for shape in [(8, 8, 1), (5, 6, 3)]:
        ref = jax.jit(lambda s, shape=shape: noise.normal_per_image(
            noise.image_keys(s), noise.INIT_STREAM, jnp.int32(0), shape))(seeds)
        got = initial_noise(seeds, shape)
        assert got.shape == (4, shape[2], shape[0], shape[1]) and got.dtype == np.float32
        np.testing.assert_array_equal(got, np.asarray(ref).transpose(0, 3, 1, 2))
    # per image: an image's noise does not depend on what else is in the batch
    np.testing.assert_array_equal(initial_noise([7], (8, 8, 1))[0], initial_noise([3, 7], (8, 8, 1))[1])


@pytest.mark.parametrize("case", [
    # the model's defaults: dpmpp_2m, classifier-free guidance 2 (doubled batch), seeds from an int
    dict(n=4, steps=6, seed=0),
    # ddim without guidance, explicit labels and seeds, and the user's own NCHW noise
    dict(n=3, sampler="ddim", steps=5, guidance=1.0, seed=[7, 8, 9], class_labels=[1, "2", 3], noise=True),
], ids=["dpmpp_2m-guided", "ddim-user-noise"])
def test_torch_matches_jax_on_a_tiny_class_conditional_model(pipes, case, record_property):
    jax_pipe, torch_pipe = pipes
    case = dict(case)
    if case.pop("noise", False):
        case["noise"] = np.random.default_rng(0).standard_normal((case["n"], 1, 8, 8)).astype(np.float32)
    a = jax_pipe.generate(**case)
    b = torch_pipe.generate(**case)
    mean, worst = _mean_and_max_px(a, b)
    record_property("mean_abs_px", mean)
    record_property("max_abs_px", worst)
    print(f"torch vs jax: mean |Δpx| {mean:.4f}, max {worst}")
    assert mean <= MEAN_TOL, (mean, worst)
    # and the images are not trivial (all-equal images would agree for any model)
    assert a.std() > 5


@pytest.mark.skipif(not (engine.BUILTIN_MODEL / "model_index.json").is_file(), reason="built-in model not trained yet")
def test_torch_matches_jax_on_the_builtin_model(record_property):
    jax_pipe, torch_pipe = preheat.load(cache="off"), torch_load()
    a = jax_pipe.generate(4, seed=0)
    b = torch_pipe.generate(4, seed=0)
    mean, worst = _mean_and_max_px(a, b)
    record_property("mean_abs_px", mean)
    record_property("max_abs_px", worst)
    print(f"built-in model, torch vs jax: mean |Δpx| {mean:.4f}, max {worst}")
    assert mean <= MEAN_TOL, (mean, worst)


BAD_CALLS = [
    dict(n=0),
    dict(n=2, steps=0),
    dict(n=2, sampler="nope"),
    dict(n=2, class_labels=[1]),
    dict(n=1, class_labels="eleven"),
    dict(n=1, class_labels=10),
    dict(n=1, guidance=-1.0),
    dict(n=1, guidance="much"),
    dict(n=2, seed=[1]),
    dict(n=1, seed=-1),
    dict(n=2, noise=np.zeros((2, 8, 8, 1), np.float32)),  # NHWC where NCHW is expected
]


@pytest.mark.parametrize("kwargs", BAD_CALLS, ids=[str(i) for i in range(len(BAD_CALLS))])
def test_same_one_line_errors_as_jax(pipes, kwargs):
    jax_pipe, torch_pipe = pipes
    with pytest.raises(PreheatError) as from_jax:
        jax_pipe.generate(**kwargs)
    with pytest.raises(PreheatError) as from_torch:
        torch_pipe.generate(**kwargs)
    assert type(from_torch.value) is type(from_jax.value)
    assert str(from_torch.value) == str(from_jax.value)
    assert "\n" not in str(from_torch.value)


def test_load_errors(tiny, tmp_path):
    missing = tmp_path / "nothing-here"
    with pytest.raises(ModelNotFoundError) as from_torch:
        torch_load(missing)
    with pytest.raises(ModelNotFoundError) as from_jax:
        preheat.load(missing, cache="off")
    assert str(from_torch.value) == str(from_jax.value)
    with pytest.raises(InvalidArgumentError, match="compile='jit' is not supported"):
        torch_load(tiny, compile="jit")
    with pytest.raises(InvalidArgumentError, match="dtype='int8' is not supported"):
        torch_load(tiny, dtype="int8")


def test_call_api_and_metadata(pipes):
    jax_pipe, torch_pipe = pipes
    assert isinstance(torch_pipe, TorchPipeline)
    for attr in ("sample_shape", "num_classes", "null_class", "labels", "defaults"):
        assert getattr(torch_pipe, attr) == getattr(jax_pipe, attr), attr
    images = torch_pipe(5, steps=2, class_labels="4")  # guided by default: the UNet sees batch 10
    assert [im.size for im in images] == [(8, 8)] * 5 and images[0].mode == "L"
    assert torch_pipe.last.cache_layer in ("none", "memory")
    torch_pipe(5, steps=2, class_labels="4")
    assert torch_pipe.last.cache_layer == "memory"
    assert torch_pipe.last.run_s > 0 and torch_pipe.last.compile_s == 0
    request = torch_pipe.validate(3, guidance=2.0)
    assert request.guided and request.n == 3


def test_stochastic_sampler_is_reproducible_per_image(pipes):
    """euler_a draws per-step noise from one torch generator per image: the image for a seed does
    not depend on its batch (it does differ from JAX's, which draws with JAX keys)."""
    _, torch_pipe = pipes
    both = torch_pipe.generate(2, sampler="euler_a", steps=4, seed=[5, 6], class_labels=[1, 1])
    alone = torch_pipe.generate(1, sampler="euler_a", steps=4, seed=5, class_labels=[1])
    again = torch_pipe.generate(2, sampler="euler_a", steps=4, seed=[5, 6], class_labels=[1, 1])
    np.testing.assert_array_equal(both, again)
    assert _mean_and_max_px(both[:1], alone)[1] <= 1
    assert _mean_and_max_px(both[:1], both[1:])[1] > 10  # different seeds, different images


def test_timestep_class_embedding_loads_and_samples_like_diffusers(tmp_path):
    """class_embed_type 'timestep': integer labels through the time projection, guided with the
    null class, through preheat.load -- the same images as diffusers' UNet and scheduler."""
    folder = save_tiny_pipeline(tmp_path / "timestep-labels",
                                config=dict(TINY_CLASS_CONDITIONAL, class_embed_type="timestep"))
    jax_pipe, torch_pipe = preheat.load(folder, cache="off"), torch_load(folder)
    assert jax_pipe.num_classes == torch_pipe.num_classes == 10  # num_class_embeds 11, less the null class
    case = dict(n=3, sampler="ddim", steps=5, seed=[1, 2, 3], class_labels=[1, 4, 9])  # guidance 2: the model's
    a = jax_pipe.generate(**case)
    mean, worst = _mean_and_max_px(a, torch_pipe.generate(**case))
    assert mean <= MEAN_TOL, (mean, worst)
    assert a.std() > 5
    assert not np.array_equal(a, jax_pipe.generate(**dict(case, class_labels=[0, 0, 0])))  # the labels are used


@pytest.mark.parametrize("config,needle", [
    (dict(TINY_CLASS_CONDITIONAL, class_embed_type="identity"), "class_embed_type 'identity' takes embedding vectors"),
    ({k: v for k, v in dict(TINY_CLASS_CONDITIONAL, class_embed_type="timestep").items() if k != "num_class_embeds"},
     "class_embed_type 'timestep' needs num_class_embeds"),
], ids=["identity", "timestep-without-count"])
def test_class_embeddings_preheat_load_cannot_feed_are_refused_in_one_line(tmp_path, config, needle):
    folder = save_tiny_pipeline(tmp_path / "model", config=config)
    for load in (lambda: preheat.load(folder, cache="off"), lambda: torch_load(folder)):
        with pytest.raises(UnsupportedConfigError, match=needle) as err:
            load()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("sampler", ["dpmpp_2m", "dpmpp_2m_karras", "dpmpp_2m_sde", "dpmpp_2m_sde_karras",
                                     "dpmpp_2s", "dpmpp_2s_karras"])
def test_a_dpm_sampler_runs_the_solver_its_name_says_on_both_backends(sampler):
    """A folder saved with DPM-Solver's other settings (Heun-type, Karras, Euler at the final step, order 3,
    no lower-order final): asked for by name, a dpm++ sampler ignores them on JAX (samplers._config),
    and the torch backend's diffusers scheduler must too, so both run one solver on one schedule."""
    from preheat.backends.torch.sampling import make_scheduler
    from preheat.samplers import SchedulerConfig, make_plan

    singlestep = sampler.startswith("dpmpp_2s")
    folder = {"_class_name": "DPMSolverSinglestepScheduler" if singlestep else "DPMSolverMultistepScheduler",
              "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "num_train_timesteps": 1000,
              "solver_type": "heun", "solver_order": 3, "lower_order_final": False,
              "use_karras_sigmas": not sampler.endswith("_karras")}
    if not singlestep:  # (a multistep class's key only)
        folder["euler_at_final"] = True
    scheduler = make_scheduler(sampler, folder)
    assert (scheduler.config.solver_type, scheduler.config.solver_order, scheduler.config.lower_order_final,
            scheduler.config.use_karras_sigmas) == ("midpoint", 2, True, sampler.endswith("_karras"))
    assert singlestep or scheduler.config.euler_at_final is False
    scheduler.set_timesteps(12)
    plan = make_plan(SchedulerConfig.from_dict(folder), sampler, 12)
    np.testing.assert_array_equal(scheduler.timesteps.numpy(), plan.timesteps[:12])
    if singlestep:  # its pairs, as the class's own order list
        assert plan.order[:12].tolist() == scheduler.order_list


def test_dpmpp_sde_on_the_torch_backend_names_torchsde_when_it_is_missing(monkeypatch) -> None:
    """diffusers' DPMSolverSDEScheduler draws its noise with torchsde (the torch extra installs it); without
    it the torch backend says so in one line, naming the extra, instead of diffusers' stand-in class's error."""
    import importlib.util

    from preheat.backends.torch.sampling import make_scheduler
    from preheat.errors import MissingExtraError

    config = {"beta_schedule": "scaled_linear", "use_karras_sigmas": True}
    assert type(make_scheduler("dpmpp_sde", config)).__name__ == "DPMSolverSDEScheduler"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchsde" else find_spec(name, *a))
    with pytest.raises(MissingExtraError) as info:
        make_scheduler("dpmpp_sde", config)
    message = str(info.value)
    assert "\n" not in message and "torchsde" in message and 'pip install ".[torch]"' in message, message
    assert type(make_scheduler("dpm2_a", config)).__name__ == "KDPM2AncestralDiscreteScheduler"  # needs nothing more
