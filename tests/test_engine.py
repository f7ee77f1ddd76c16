"""The engine: one compiled program per signature, per-image seeds, runtime steps/guidance, errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError, SchedulerConfigError
from tests._support.numerics import px_diff
from tests._support.reference import TINY_CLASS_CONDITIONAL, save_random_unet, save_tiny_pipeline


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return preheat.load(save_tiny_pipeline(tmp_path_factory.mktemp("e") / "pipe"), cache="off")


def test_seed_gives_the_same_image_whatever_else_is_in_the_batch(pipe):
    a = pipe.generate(4, seed=[10, 11, 12, 13], class_labels=[3, 4, 5, 6], sampler="euler_a", steps=5)
    b = pipe.generate(4, seed=[99, 11, 98, 97], class_labels=[0, 4, 9, 9], sampler="euler_a", steps=5)
    assert np.array_equal(a[1], b[1])  # same batch size: bit-exact
    assert not np.array_equal(a[0], b[0])
    alone = pipe.generate(1, seed=[11], class_labels=[4], sampler="euler_a", steps=5)
    # Another batch size is another XLA program; its float rounding may differ by one level on a pixel.
    diff = px_diff(alone[0], a[1])
    assert diff.max() <= 1 and diff.mean() < 0.05


def test_int_seed_means_seed_plus_index(pipe):
    # three images, the default (ancestral) sampler: test_call_returns_pil_images' program
    a = pipe.generate(3, seed=5, class_labels=2, steps=4)
    b = pipe.generate(3, seed=[5, 6, 7], class_labels=2, steps=4)
    assert np.array_equal(a, b)


def test_steps_guidance_labels_are_runtime_data(pipe):
    # (two images, dpmpp_2m, guided and not: the module's other two-image tests run these programs)
    pipe.generate(2, steps=3, guidance=2.0, sampler="dpmpp_2m", class_labels=[1, 2])
    compiled = len(pipe.executables)
    out3 = pipe.generate(2, steps=3, guidance=2.0, sampler="dpmpp_2m", class_labels=[1, 2])
    out7 = pipe.generate(2, steps=7, guidance=5.0, sampler="dpmpp_2m_karras", class_labels=[8, 9])
    assert len(pipe.executables) == compiled and pipe.last.cache_layer == "memory"
    assert not np.array_equal(out3, out7)
    guided, _ = pipe.prepare(2, steps=3, guidance=2.0, sampler="dpmpp_2m", class_labels=[1, 2])
    off, _ = pipe.prepare(2, steps=3, guidance=1.0, sampler="dpmpp_2m", class_labels=[1, 2])
    pipe.generate(2, steps=3, guidance=1.0, sampler="dpmpp_2m", class_labels=[1, 2])  # guidance off: 1x batch
    # another program (whichever test of the module compiled it first)
    assert guided in pipe.executables and off in pipe.executables and off != guided


def test_guidance_changes_the_image(pipe):
    lo = pipe.generate(2, steps=4, guidance=1.0, sampler="dpmpp_2m", class_labels=[1, 2])
    hi = pipe.generate(2, steps=4, guidance=4.0, sampler="dpmpp_2m", class_labels=[1, 2])
    assert not np.array_equal(lo, hi)


def test_user_noise_replaces_the_seed_noise(pipe):
    noise = np.random.RandomState(0).randn(2, 1, 8, 8).astype(np.float32)  # NCHW
    # a deterministic sampler: the seed draws the starting noise alone
    a = pipe.generate(2, noise=noise, seed=1, sampler="dpmpp_2m", steps=4, class_labels=[3, 3])
    b = pipe.generate(2, noise=noise, seed=999, sampler="dpmpp_2m", steps=4, class_labels=[3, 3])
    c = pipe.generate(2, seed=1, sampler="dpmpp_2m", steps=4, class_labels=[3, 3])
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_call_returns_pil_images(pipe):
    images = pipe(3, seed=0, steps=2)
    assert len(images) == 3 and images[0].size == (8, 8) and images[0].mode == "L"


def test_from_denoiser_matches_the_loaded_pipeline(tmp_path, pipe):
    unet = preheat.load_unet(save_tiny_pipeline(tmp_path / "p") / "unet")
    own = preheat.Pipeline.from_denoiser(unet.apply, unet.params, (8, 8, 1), pipe.scheduler_config,
                                         num_classes=10, null_class=10, name="tiny")
    ref = preheat.load(tmp_path / "p", cache="off")
    kwargs = dict(seed=[4, 5], class_labels=[1, 7], sampler="heun", steps=3, guidance=2.0)
    assert np.array_equal(own.generate(2, **kwargs), ref.generate(2, **kwargs))

    def nchw(params, x, t, y):  # the same model, written channels-first
        return jnp.transpose(unet.apply(params, jnp.transpose(x, (0, 2, 3, 1)), t, y), (0, 3, 1, 2))

    own_nchw = preheat.Pipeline.from_denoiser(nchw, unet.params, (1, 8, 8), pipe.scheduler_config, num_classes=10,
                                              null_class=10, layout="NCHW")
    assert np.array_equal(own_nchw.generate(2, **kwargs), ref.generate(2, **kwargs))


def test_from_denoiser_cache_key_follows_the_code_not_the_name(pipe):
    """Two denoisers with one qualified name but different bodies never share an executable."""
    from preheat.cache.keys import key_fields, key_of

    params = {"w": jnp.ones((1,), jnp.float32)}

    def make(scale: float):
        def denoise(p, x, t, y):
            return x * p["w"].reshape(1, 1, 1, 1) * scale

        return denoise

    a = preheat.Pipeline.from_denoiser(make(0.5), params, (4, 4, 1), pipe.scheduler_config)
    b = preheat.Pipeline.from_denoiser(make(0.25), params, (4, 4, 1), pipe.scheduler_config)
    same = preheat.Pipeline.from_denoiser(make(0.5), params, (4, 4, 1), pipe.scheduler_config)
    assert a.fingerprint["name"] == b.fingerprint["name"]  # same qualified name...
    keys = []
    for p in (a, b, same):
        sig, args = p.prepare(1, steps=2, sampler="ddim")
        keys.append(key_of(key_fields(p.fingerprint, sig, args)))
    assert keys[0] != keys[1]  # ...different code: different keys
    assert keys[0] == keys[2]  # the same code: the same key


@pytest.mark.parametrize("kwargs,error,needle", [
    (dict(n=0), InvalidArgumentError, "n=0 must be a positive int"),
    (dict(sampler="plms"), SchedulerConfigError, "unknown sampler 'plms'; supported: ddpm, ddim"),
    (dict(steps=0), InvalidArgumentError, "steps=0 must be a positive int"),
    (dict(steps=5000), SchedulerConfigError, "steps=5000"),
    (dict(class_labels=[12]), InvalidArgumentError, "class_labels=12 is not a class of this model; classes are 0.."),
    (dict(class_labels=np.array([12])), InvalidArgumentError, "class_labels=12 is not a class"),  # not np.int64(12)
    (dict(class_labels=["cat"]), InvalidArgumentError, "class_labels='cat' is not a class of this model"),
    (dict(n=2, class_labels=[1, 2, 3]), InvalidArgumentError, "got 3 class_labels for n=2"),
    (dict(seed=-1), InvalidArgumentError, "seeds must be in [0, 2**32)"),
    (dict(seed="x"), InvalidArgumentError, "seed='x' must be an int"),
    (dict(guidance=float("nan")), InvalidArgumentError, "guidance=nan must be a finite number"),
    (dict(noise=np.zeros((1, 8, 8, 1))), InvalidArgumentError, "noise has shape (1, 8, 8, 1), expected (1, 1, 8, 8)"),
    (dict(guidance_rescale=0.7), InvalidArgumentError, "unexpected argument 'guidance_rescale' for a pixel model"),
])
def test_bad_arguments_are_one_line_errors(pipe, kwargs, error, needle):
    with pytest.raises(error) as err:
        pipe.generate(**{"n": 1, **kwargs})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_unconditional_model_refuses_labels_and_guidance(tmp_path):
    cfg = {k: v for k, v in TINY_CLASS_CONDITIONAL.items() if k != "num_class_embeds"}
    save_random_unet(cfg, tmp_path / "u")
    p = preheat.load(tmp_path / "u", scheduler={"num_train_timesteps": 1000}, cache="off")
    assert p.generate(2, steps=2).shape == (2, 8, 8, 1)
    with pytest.raises(InvalidArgumentError, match="not class-conditional"):
        p.generate(1, class_labels=[1])
    with pytest.raises(InvalidArgumentError, match="needs a class-conditional model with a null class"):
        p.generate(1, guidance=3.0)


def test_bare_unet_folder_needs_a_scheduler(tmp_path):
    save_random_unet(TINY_CLASS_CONDITIONAL, tmp_path / "u")
    with pytest.raises(preheat.errors.ModelNotFoundError, match="scheduler"):
        preheat.load(tmp_path / "u")


def test_a_call_is_described_with_every_key_before_anything_runs(tmp_path):
    """A family's hooks describe its stages and the engine runs them: ``describe`` knows every
    program's key (encode, denoise, decode) with nothing compiled or run, and the call then compiles
    exactly those programs, in that order."""
    from preheat.cache.keys import key_of
    from tests._support.sd_fixtures import save_tiny_sd

    pipe = preheat.load(save_tiny_sd(tmp_path / "sd"))
    call = {"prompt": "a fox", "steps": 1, "guidance": 2.0}
    stages = pipe.describe(**call)
    assert [s.name for s in stages] == ["encode", "denoise", "decode"]
    assert pipe.compiler.events == [] and len(pipe.executables) == 0  # described: nothing compiled, nothing run
    keys = [key_of(pipe.compiler.fields_for(s.fingerprint, s.sig, s.args)) for s in stages]
    pipe.generate(**call)
    assert [(e["stage"], e["key"]) for e in pipe.compiler.events] == list(zip(("encode", "denoise", "decode"), keys))
