"""int8 weight storage (``weights_dtype="int8"``): per-channel quantisation at load, the layers it
stores (fp8's: diffusers' layerwise-casting set), and the image against an independent reference.

The reference is diffusers' own pipeline on the same tiny folder, its denoiser's layers quantised to
int8 and back in torch by the same rule written again (tests/_support/int8_reference.py), from the
same latents: preheat's int8 image is within 2/255 mean of it (issue 59's bar), and moved from the
full-precision image (the storage really is int8).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import preheat
from preheat.models.quantised import Quantised, int8_scale_shape, quantise_int8
from tests._support.flow_fixtures import reference_pipeline as flow_reference
from tests._support.flow_fixtures import reference_pixels as flow_pixels
from tests._support.built_on_use import BuiltOnUse
from tests._support.flow_fixtures import save_tiny_flow_model
from tests._support.fp8_reference import FP8
from tests._support.fp8_reference import stored_low as stored_fp8
from tests._support.int8_reference import INT8, MEAN_TOL, round_to_int8, stored_int8
from tests._support.numerics import mean_abs_px
from tests._support.sd_fixtures import reference_pipeline as sd_reference
from tests._support.sd_fixtures import reference_pixels as sd_pixels
from tests._support.sd_fixtures import save_tiny_sd
from tests._support.tpu_fixtures import v5e_device

CALLS = {"flux": dict(prompt="a watercolor fox", guidance=3.5), "sd1": dict(prompt="a photo of a cat", guidance=5.0),
         "sd3": dict(prompt="a photo of a cat", guidance=5.0)}
FLOW = ("flux", "sd3")

pytestmark = pytest.mark.usefixtures("one_compile_per_program")


def test_quantise_int8_is_symmetric_per_output_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)).astype(np.float32) * np.array([1, 10, 0.01, 3, 0], np.float32)  # (in, out)
    q, scale = quantise_int8(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (1, 5) == int8_scale_shape(w.shape)
    np.testing.assert_array_equal(scale[0], np.abs(w).max(axis=0) * np.float32(1 / 127))
    assert np.abs(q).max() == 127 and (q[:, 4] == 0).all() and scale[0, 4] == 0  # a zero channel stays zero
    assert (np.abs(q * scale - w) <= scale / 2 + 1e-7).all()  # half a step per channel, at most
    conv = rng.standard_normal((3, 3, 4, 8)).astype(np.float32)  # (kh, kw, in, out)
    assert quantise_int8(conv)[1].shape == (1, 1, 1, 8)


def test_quantise_int8_is_the_torch_references_rule_bit_for_bit():
    """The device program (here XLA's CPU) and the independent torch rule give the same weights."""
    import torch

    from tests._support.int8_reference import quantise_dequantise

    w = (np.random.default_rng(1).standard_normal((960, 800)) * 0.05).astype(np.float32)  # torch's (out, in)
    q, scale = quantise_int8(w.T)  # (in, out)
    theirs = quantise_dequantise(torch.from_numpy(w)).numpy()
    np.testing.assert_array_equal(np.asarray(q, np.float32) * np.asarray(scale), theirs.T)


def test_an_int8_weight_stacks_along_a_leading_axis():
    """A scanned stage's weights are stacked once at load: a Quantised's values and scales stack."""
    a, b = (Quantised(*map(jnp.asarray, quantise_int8(np.full((4, 3), v, np.float32)))) for v in (1.0, 2.0))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), a, b)
    assert isinstance(stacked, Quantised) and stacked.values.shape == (2, 4, 3) and stacked.scale.shape == (2, 1, 3)
    one = jax.tree.map(lambda x: x[1], stacked)
    assert one.per_output and np.allclose(one.product(jnp.ones((1, 4), jnp.float32)), 8.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("int8")
    return BuiltOnUse(lambda name: save_tiny_flow_model(base / name, "flux-dev" if name == "flux" else name)
                      if name in FLOW else save_tiny_sd(base / name, name))


@pytest.fixture(scope="module")
def pipes(folders):
    return BuiltOnUse(lambda key: preheat.load(folders[key[0]], cache="off", weights_dtype=key[1]))


def _noise() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((1, 4, 16, 16)).astype(np.float32)


def _ours(pipes, name: str, weights_dtype: str | None) -> np.ndarray:
    call = CALLS[name]
    return pipes[(name, weights_dtype)].generate(call["prompt"], noise=_noise(), steps=3, guidance=call["guidance"],
                                                 sampler="flow_euler" if name in FLOW else "ddim", width=32, height=32)


def _theirs(folders, name: str, names: set[str]) -> np.ndarray:
    """diffusers' pipeline with the layers ``names`` quantised to int8 and back in torch."""
    ref = flow_reference(folders[name], "flow_euler") if name in FLOW else sd_reference(folders[name], "ddim")
    round_to_int8(ref.transformer if name in FLOW else ref.unet, names)
    call = CALLS[name]
    pixels = flow_pixels if name in FLOW else sd_pixels
    size = {} if name in FLOW else dict(height=32, width=32)
    return pixels(ref, call["prompt"], _noise(), num_inference_steps=3, guidance_scale=call["guidance"], **size)


KINDS = [pytest.param(name, marks=(pytest.mark.slow,) if name == "sd3" else (), id=name) for name in ("flux", "sd1", "sd3")]


@pytest.mark.parametrize("name", KINDS)
def test_int8_stores_the_layers_fp8_stores(pipes, name):
    """The same skip rules as fp8 (diffusers' layerwise casting): norms, embeddings of positions and
    patches, the top-level proj_in/proj_out stay full precision."""
    ours = stored_int8(pipes[(name, INT8)].params)
    assert ours == stored_fp8(pipes[(name, FP8)].params) and len(ours) > 5
    assert "proj_out" not in ours and not any("norm" in n for n in ours)


@pytest.mark.parametrize("name", KINDS)
def test_int8_draws_the_image_of_torch_quantised_weights(folders, pipes, name, record_property):
    ours, full = _ours(pipes, name, INT8), _ours(pipes, name, None)
    theirs = _theirs(folders, name, stored_int8(pipes[(name, INT8)].params))
    gap, moved = mean_abs_px(ours, theirs), mean_abs_px(ours, full)
    record_property("mean_abs_px", gap)
    print(f"{name} int8: mean |Δpx| {gap:.4f} to diffusers' int8 weights, {moved:.4f} to full precision")
    assert ours.shape == theirs.shape and ours.std() > 5
    assert gap <= MEAN_TOL
    assert moved > 2 * gap, (moved, gap)


def test_int8_is_part_of_the_compile_key(pipes):
    low = pipes[("sd1", INT8)]
    assert low.fingerprint == {**pipes[("sd1", None)].fingerprint, "weights_dtype": INT8, "weights_layers": "layerwise"}


def test_a_full_size_flux_dev_in_int8_places_about_its_fp8_bytes():
    """FLUX.1-dev's published transformer config, built abstractly: int8 is fp8's bytes plus a float32
    scale per output channel of each stored layer."""
    from preheat.models.flux import FluxTransformerConfig, build_abstract
    from preheat.models.published import CONFIGS
    from preheat.models.storage import placed_bytes

    config = FluxTransformerConfig.from_dict(
        json.loads((CONFIGS / "FLUX.1-dev" / "transformer" / "config.json").read_text()), "FLUX.1-dev")
    _, abstract = build_abstract(config)
    extra = ("pos_embed", "norm")
    for layers in ("layerwise", "linear"):
        fp8 = placed_bytes(abstract, jnp.bfloat16, FP8, extra, weights_layers=layers)
        int8 = placed_bytes(abstract, jnp.bfloat16, INT8, extra, weights_layers=layers)
        print(f"FLUX.1-dev transformer {layers}: fp8 {fp8 / 1e9:.3f} GB, int8 {int8 / 1e9:.3f} GB")
        assert fp8 < int8 < fp8 * 1.002  # FLUX.1-dev: 12 MB of scales


def test_int8_survives_the_compile_cache_prefetch_and_a_mesh(folders, pipes, tmp_path, monkeypatch):
    """A prefetching load's placeholders are (int8 values, float32 scales) shapes, so the executable the
    first load compiled is the one the second fetches while the weights are read and quantised; on two
    devices (the suite's fake CPU ones) each holds the values and the scales, and draws the one-device
    image."""
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    call = dict(prompt=CALLS["flux"]["prompt"], noise=_noise(), steps=3, guidance=CALLS["flux"]["guidance"],
                sampler="flow_euler", width=32, height=32)
    shapes = {k: v for k, v in call.items() if k not in ("prompt", "noise")}
    images = []
    for _ in range(2):
        pipe = preheat.load(folders["flux"], weights_dtype=INT8, prefetch=[{"n": 1, **shapes}])
        images.append(pipe.generate(**call))
    assert pipe.last.cache_layer == "aot"
    np.testing.assert_array_equal(images[0], images[1])
    np.testing.assert_array_equal(images[0], _ours(pipes, "flux", INT8))
    two = preheat.load(folders["flux"], cache="off", weights_dtype=INT8, devices=2)
    from flax import nnx

    q = next(v.get_value() for _, v in nnx.to_flat_state(two.params) if isinstance(v.get_value(), Quantised))
    assert len(q.values.sharding.device_set) == len(q.scale.sharding.device_set) == 2
    assert mean_abs_px(two.generate(**call), images[0]) <= 0.01




def test_on_a_v5e_the_int8_product_is_one_fusion_reading_the_int8_weight():
    """Compiled for a v5e chip on this CPU: a Flux-sized Linear (4096 tokens, 3072 -> 12288) on an int8
    weight with per-channel scales is one convolution fusion whose weight operand is the s8 array (no
    bf16 copy of the weight: no temporary buffer at all), the scale and the bf16 convert in its output
    fusion; XLA's cost model puts it within 1% of the same product on a bf16 weight."""
    import re

    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(v5e_device())

    def linear(x, values, scale):
        return Quantised(values, scale).converted(jnp.bfloat16).product(x)  # what storage.upcast and layers.Linear do

    compiled = {}
    for dtype in (jnp.int8, jnp.bfloat16):
        args = (jax.ShapeDtypeStruct((4096, 3072), jnp.bfloat16, sharding=sharding),
                jax.ShapeDtypeStruct((3072, 12288), dtype, sharding=sharding),
                jax.ShapeDtypeStruct((1, 12288), jnp.float32, sharding=sharding))
        compiled[jnp.dtype(dtype).name] = jax.jit(linear).lower(*args).compile()
    hlo = compiled["int8"].as_text()
    convs = [line for line in hlo.splitlines() if " convolution(" in line]
    assert len(convs) == 1 and "f32[4096,12288]" in convs[0], convs
    assert re.search(r"s8\[3072,12288\]", hlo) and not re.search(r"bf16\[3072,12288\]", hlo)  # never a bf16 weight
    assert compiled["int8"].memory_analysis().temp_size_in_bytes == 0
    cycles = {k: int(re.findall(r'"estimated_cycles":"(\d+)"', c.as_text())[-1]) for k, c in compiled.items()}
    print(f"v5e estimated cycles: {cycles}")
    assert cycles["int8"] <= 1.01 * cycles["bfloat16"]
