"""Scaled fp8 single files (issue 28 item 2): a tiny FLUX.1-dev transformer in BFL's layout whose
Linear weights are stored ``F8_E4M3`` with a float32 ``scale_weight`` each (``amax / 448``), a
``scale_input`` each and the top-level ``scaled_fp8`` marker, as ComfyUI writes them.

The fp8 bytes go to the device as they are, each beside its scale (``quantised.Quantised``), and the
compiled program applies the scale at use: a Linear scales its product, ``(x @ fp8) * scale``
(``Quantised.product``), so that on a GPU the GEMM reads the fp8 weight itself. That is the host
dequantisation's arithmetic in another order, so the image is the image of the same weights
dequantised and stored in float32 to float32 rounding (``ORDER_TOL``), not bit for bit. A file with
one scale per output channel draws diffusers' image of its dequantised weights. The scales matter:
the same fp8 bytes without them give another image, and another byte count."""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.models import scaled_fp8
from tests._support import flow_fixtures
from tests._support.bfl_files import to_bfl
from tests._support.numerics import mean_abs_px, px_diff

MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# The scale on the product instead of the weight: fl(fl(x @ v) * s) against x @ fl(v * s), in float32
# here. Each layer's output moves by a few float32 ulps (~1e-7 relative), a few thousandths of a
# level after ~20 layers, 3 steps and the VAE; a pixel changes only where its value sits that close
# to a rounding boundary, then by one level. So: at most one level anywhere, and on average a
# hundredth of one (measured: 0 on these images).
ORDER_TOL = 0.01


def _same_to_rounding(a: np.ndarray, b: np.ndarray) -> float:
    """Mean |Δpx| of two images that differ by float32 rounding order only (asserted: see ORDER_TOL)."""
    diff = px_diff(a, b)
    assert diff.mean() <= ORDER_TOL and diff.max() <= 1, (diff.mean(), diff.max())
    return float(diff.mean())


def _quantise_channels(state: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per output channel, in diffusers' layout: (the scaled tensors, each 2-D weight with an
    ``(out, 1)`` ``scale_weight`` of its rows' ``amax / 448``; the same weights dequantised in float32).
    BFL's fused q/k/v stack whole rows, so ``to_bfl`` stacks their scales alike."""
    import ml_dtypes

    scaled, plain = {}, {}
    for key, value in state.items():
        if value.ndim != 2 or not key.endswith(".weight"):
            scaled[key] = plain[key] = value
            continue
        scale = (np.abs(value).max(axis=1, keepdims=True) / FP8_MAX).astype(np.float32)  # (out, 1)
        fp8 = (value / scale).astype(ml_dtypes.float8_e4m3fn)
        scaled[key], scaled[key[:-len("weight")] + "scale_weight"] = fp8, scale
        plain[key] = fp8.astype(np.float32) * scale
    return scaled, plain


def _quantise(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the scaled fp8 file's tensors, the same weights dequantised in float32)."""
    import ml_dtypes

    scaled, plain = {}, {}
    for key, value in tensors.items():
        if value.ndim != 2 or not key.endswith(".weight"):  # biases, norms' scales: kept as they are
            scaled[key] = plain[key] = value
            continue
        scale = np.float32(np.abs(value).max() / FP8_MAX)
        fp8 = (value / scale).astype(ml_dtypes.float8_e4m3fn)
        scaled[key] = fp8
        scaled[key[:-len("weight")] + "scale_weight"] = np.array(scale, np.float32)
        scaled[key[:-len("weight")] + "scale_input"] = np.array(1.0, np.float32)
        plain[key] = fp8.astype(np.float32) * scale
    scaled[scaled_fp8.MARKER] = np.zeros((0,), ml_dtypes.float8_e4m3fn)
    return scaled, plain


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    import ml_dtypes

    base = tmp_path_factory.mktemp("scaled")
    folder = flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")
    state = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    scaled, plain = _quantise(to_bfl(state))
    channels, channels_plain = _quantise_channels(state)
    channels = {**to_bfl(channels), scaled_fp8.MARKER: np.zeros((0,), ml_dtypes.float8_e4m3fn)}
    out = {"folder": folder, "channel-weights": channels_plain}  # diffusers-named, for diffusers' reference
    for name, tensors in (("scaled", scaled), ("plain", plain),
                          ("unscaled", {k: v for k, v in scaled.items() if not k.endswith(".scale_weight")}),
                          ("channel", channels), ("channel-plain", to_bfl(channels_plain))):
        out[name] = base / f"{name}.safetensors"
        save_file(tensors, str(out[name]))
    return out


def _image(pipe) -> np.ndarray:
    return pipe.generate(**CALL)


NOISE = np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)
CALL = dict(prompt="a watercolor fox", noise=NOISE, steps=3, sampler="flow_euler", guidance=3.5, width=32, height=32)


@pytest.fixture(scope="module")
def pipes(files, tmp_path_factory):
    """The three files loaded once each (no weights_dtype), and the scaled one with fp8 storage."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREHEAT_HOME", str(tmp_path_factory.mktemp("home")))  # the converted folders' root
        out = {name: preheat.load(files[name], config=files["folder"], cache="off")
               for name in ("scaled", "plain", "unscaled", "channel", "channel-plain")}
        out["scaled-fp8"] = preheat.load(files["scaled"], config=files["folder"], cache="off",
                                         weights_dtype="float8_e4m3fn")
    return out


def _leaves(pipe) -> dict[str, object]:
    """{torch-style parameter path: its device value (an array, or a quantised.Quantised)}."""
    from flax import nnx

    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(pipe.params)}


def test_a_scaled_fp8_file_draws_its_dequantised_weights_image(pipes, record_property):
    """Without weights_dtype the file's fp8 weights stay fp8 on the device (as ComfyUI keeps them),
    with their scales; the image is the float32 dequantised weights' image to rounding order."""
    plain, scaled = _image(pipes["plain"]), _image(pipes["scaled"])
    assert plain.std() > 5
    diff = _same_to_rounding(scaled, plain)  # the scale on the product: float32 rounding in another order
    record_property("mean_abs_px", diff)
    print(f"scaled fp8 kept on the device vs its dequantised weights: mean |Δpx| {diff:.4f}")
    unscaled = _image(pipes["unscaled"])  # the same fp8 bytes read as plain F8_E4M3
    moved = mean_abs_px(unscaled, plain)
    print(f"scales ignored: mean |Δpx| {moved:.4f}")
    assert moved > 1.0


def test_the_device_holds_the_fp8_bytes_and_their_scales(files, pipes, record_property):
    """Every scaled Linear weight is placed as the file stores it (the fp8 bytes, transposed to the
    kernel's layout) beside its float32 scale: the denoiser's device bytes are the plain load's
    minus 3 bytes per fp8 element plus 4 per scale (a fused BFL weight's pieces each hold it)."""
    import ml_dtypes

    from preheat.models.quantised import Quantised
    from preheat.models.storage import device_bytes
    from preheat.models.safetensors_files import read_tensors

    leaves, plain = _leaves(pipes["scaled"]), _leaves(pipes["plain"])
    kept = {k: v for k, v in leaves.items() if isinstance(v, Quantised)}
    assert len(kept) > 10 and kept.keys() == {k for k in plain if k.endswith(".kernel")}
    for key, q in kept.items():
        assert q.values.dtype == ml_dtypes.float8_e4m3fn and q.scale.dtype == np.float32 and q.scale.shape == ()
        np.testing.assert_array_equal(np.asarray(q.values).astype(np.float32) * np.asarray(q.scale),
                                      np.asarray(plain[key]), err_msg=key)
    file = read_tensors([files["scaled"]])  # F8_E4M3 through ml_dtypes
    q = kept["transformer_blocks.0.ff.net.2.kernel"]  # BFL's double_blocks.0.img_mlp.2, one to one
    np.testing.assert_array_equal(np.asarray(q.values).T.view(np.uint8),
                                  file["double_blocks.0.img_mlp.2.weight"].view(np.uint8))
    assert np.asarray(q.scale) == file["double_blocks.0.img_mlp.2.scale_weight"]
    elements = sum(int(np.prod(q.shape)) for q in kept.values())
    full, ours = device_bytes(pipes["plain"].params), device_bytes(pipes["scaled"].params)
    record_property("device_bytes", {"scaled_kept": ours, "dequantised_fp32": full})
    print(f"denoiser on the device: scaled fp8 kept {ours} B, dequantised float32 {full} B ({ours / full:.3f}x)")
    assert ours == full - 3 * elements + 4 * len(kept)
    assert pipes["scaled"].load_report.parts[-2].placed_bytes == ours  # the load's own count agrees


def test_fp8_storage_keeps_the_scaled_layers_and_dequantises_the_others(pipes):
    """weights_dtype=float8_e4m3fn names diffusers' layerwise set: its layers stay as the file stores
    them (fp8 and scale), the ones it keeps at full precision (the AdaLN modulation, under ``norm``)
    are dequantised on the host. Nothing is rounded again, so the image is still the dequantised
    weights' image to rounding order (before, the dequantised weights were cast to fp8 again, unscaled)."""
    from preheat.models.quantised import Quantised

    leaves = _leaves(pipes["scaled-fp8"])
    kept = {k for k, v in leaves.items() if isinstance(v, Quantised)}
    full = {k for k, v in leaves.items() if k.endswith(".kernel") and not isinstance(v, Quantised)}
    assert "transformer_blocks.0.attn.to_q.kernel" in kept and "transformer_blocks.0.norm1.linear.kernel" in full
    assert all("norm" in k or k == "proj_out.kernel" for k in full) and len(kept) > 10
    assert all(leaves[k].dtype == np.float32 for k in full)
    _same_to_rounding(_image(pipes["scaled-fp8"]), _image(pipes["plain"]))


def test_a_lora_on_kept_scaled_layers_draws_the_dequantised_weights_lora_image(files, pipes, tmp_path):
    """A LoRA's low-rank path runs beside layers kept scaled as beside any layer (the scale multiplies
    the base weight's product only, the LoRA adds its own term): the image on the dequantised float32
    weights to rounding order, and not the image without it."""
    from tests._support.lora_files import peft_layers, save_lora

    ref = flow_fixtures.reference_pipeline(files["folder"], "flow_euler")
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "proj_mlp", "ff.net.2"]
    lora = save_lora(ref, tmp_path / "lora", "transformer",
                     {"transformer": peft_layers(ref.transformer, targets, 4, 4, seed=4)})
    with_lora = {name: pipes[name].generate(**CALL, lora=str(lora)) for name in ("scaled", "plain")}
    _same_to_rounding(with_lora["scaled"], with_lora["plain"])
    assert mean_abs_px(with_lora["scaled"], _image(pipes["scaled"])) > 1.0


def test_per_channel_scales_draw_diffusers_image_of_the_dequantised_weights(files, pipes, record_property):
    """One float32 scale per output channel (``(out, 1)`` as stored, ``(1, out)`` in the kernel's
    layout) stays on the device beside the fp8 bytes and scales each Linear's product: diffusers'
    pipeline with the dequantised weights draws the same image (across frameworks: MEAN_TOL), and
    preheat's own load of the dequantised file draws it to rounding order."""
    import torch

    from preheat.models.quantised import Quantised

    kept = {k: v for k, v in _leaves(pipes["channel"]).items() if isinstance(v, Quantised)}
    q = kept["transformer_blocks.0.attn.to_k.kernel"]  # a piece of BFL's fused qkv: its rows' scales
    assert len(kept) > 10 and q.scale.shape == (1, q.shape[1]) and q.per_output
    ref = flow_fixtures.reference_pipeline(files["folder"], "flow_euler")
    ref.transformer.load_state_dict({k: torch.from_numpy(v) for k, v in files["channel-weights"].items()})
    theirs = flow_fixtures.reference_pixels(ref, CALL["prompt"], NOISE, num_inference_steps=CALL["steps"],
                                            guidance_scale=CALL["guidance"])
    ours = _image(pipes["channel"])
    diff = px_diff(ours, theirs)
    record_property("mean_abs_px", float(diff.mean()))
    print(f"per-channel scaled fp8 vs diffusers on its dequantised weights: mean |Δpx| {diff.mean():.4f}, "
          f"max {diff.max()}")
    assert diff.mean() <= MEAN_TOL and ours.std() > 5
    _same_to_rounding(ours, _image(pipes["channel-plain"]))
    moved = mean_abs_px(ours, _image(pipes["plain"]))
    assert moved > 1.0, moved  # per-tensor rounding of the same weights draws another image


def test_kept_scales_are_placed_on_a_mesh_like_any_weight(files, pipes, tmp_path, monkeypatch):
    """Two devices (the suite's fake CPU devices), a batch split over them: each device holds the
    fp8 values and scales (``sharding.distribute`` sees two leaves), and the images are the
    single-device float32 load's (to XLA's rounding at another batch size per program)."""
    from preheat.models.quantised import Quantised

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    pipe = preheat.load(files["scaled"], config=files["folder"], cache="off", devices=2)
    q = next(v for v in _leaves(pipe).values() if isinstance(v, Quantised))
    assert len(q.values.sharding.device_set) == len(q.scale.sharding.device_set) == 2
    noise = np.concatenate([NOISE, -NOISE])
    # the single-device images one at a time: the batch-1 program the module's other calls compiled
    # (each device runs one image of the split batch, too)
    whole = np.concatenate([pipes["plain"].generate(**{**CALL, "noise": half}) for half in (NOISE, -NOISE)])
    diff = px_diff(pipe.generate(**{**CALL, "noise": noise, "n": 2}), whole)
    assert diff.mean() <= MEAN_TOL / 10 and diff.max() <= 1  # one image per device against one on one: XLA's rounding


def test_kept_scales_survive_the_compile_cache_and_prefetch(files, tmp_path, monkeypatch):
    """Placeholders of a prefetching load are (values, scale) shapes too: the executable the first
    load compiled is the one the second load fetches while the weights are read (``aot``)."""
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    call = {k: v for k, v in CALL.items() if k not in ("prompt", "noise")}
    images = []
    for _ in range(2):
        pipe = preheat.load(files["scaled"], config=files["folder"], prefetch=[{"n": 1, **call}])
        images.append(pipe.generate(**CALL))
    assert pipe.last.cache_layer == "aot"
    np.testing.assert_array_equal(images[0], images[1])


def test_quantised_expands_per_tensor_and_per_block():
    """``Quantised.expand``: one scale for the tensor, or one per block (a Q8_0 kernel's 32 rows)."""
    import jax.numpy as jnp
    import ml_dtypes

    from preheat.models.quantised import Quantised
    from preheat.models.storage import upcast

    rng = np.random.default_rng(0)
    fp8 = rng.standard_normal((64, 3)).astype(ml_dtypes.float8_e4m3fn)
    one = Quantised(jnp.asarray(fp8), jnp.float32(0.25)).expand(jnp.float32)
    np.testing.assert_array_equal(np.asarray(one), fp8.astype(np.float32) * np.float32(0.25))
    q = rng.integers(-127, 128, (64, 3)).astype(np.int8)  # (in, out): two blocks of 32 rows per column
    d = rng.standard_normal((2, 3)).astype(np.float16)
    want = q.astype(np.float32) * np.repeat(d.astype(np.float32), 32, axis=0)
    got = upcast({"w": Quantised(jnp.asarray(q), jnp.asarray(d)), "b": jnp.ones(3)}, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got["w"]), want)
    np.testing.assert_array_equal(np.asarray(got["b"]), np.ones(3))


def test_upcast_keeps_per_output_scales_for_the_linear_product():
    """``storage.upcast`` leaves a Linear weight (a 2-D ``kernel``) with a per-tensor or per-output-channel
    scale ``Quantised`` (values in the compute dtype, the scale as it is), and expands a block scale
    along the input (GGUF Q8_0) and any other leaf; ``layers.Linear`` then draws ``x @ (values * scale)``
    to float32 rounding, with its bias."""
    import jax.numpy as jnp
    import ml_dtypes
    from flax import nnx

    from preheat.models.layers import Linear
    from preheat.models.quantised import Quantised
    from preheat.models.storage import upcast

    rng = np.random.default_rng(1)
    fp8 = rng.standard_normal((64, 3)).astype(ml_dtypes.float8_e4m3fn)  # (in, out)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)  # (B, L, in)
    graphdef, state = nnx.split(Linear(64, 3, rngs=nnx.Rngs(0)))
    state["bias"].set_value(jnp.asarray(rng.standard_normal(3), jnp.float32))
    for scale, kept in ((np.float32(0.25), True), (rng.random((1, 3)).astype(np.float32) + 0.5, True),
                        (rng.random((2, 3)).astype(np.float32) + 0.5, False)):  # per tensor, channel, block
        q = Quantised(jnp.asarray(fp8), jnp.asarray(scale))
        state["kernel"].set_value(q)
        up = upcast(state, jnp.float32)
        assert isinstance(up["kernel"].get_value(), Quantised) == kept, scale.shape
        assert isinstance(upcast({"embedding": q}, jnp.float32)["embedding"], Quantised) is False
        if kept:
            assert up["kernel"].get_value().values.dtype == jnp.float32 and up["kernel"].get_value().scale is q.scale
        want = x @ np.asarray(q.expand(jnp.float32)) + np.asarray(state["bias"].get_value())
        np.testing.assert_allclose(np.asarray(nnx.merge(graphdef, up)(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)


def test_a_scale_that_is_neither_per_tensor_nor_per_block_is_one_line():
    from preheat.errors import ModelFormatError

    tensors = {"a.weight": np.zeros((4, 64), np.float32), "a.scale_weight": np.ones((3,), np.float32)}
    with pytest.raises(ModelFormatError, match=r"a.scale_weight has shape \(3,\); a scale is one per weight") as exc:
        scaled_fp8.scale_of(tensors, "a.weight", "a.scale_weight")
    assert "\n" not in str(exc.value)
    tensors["a.scale_weight"] = np.full((4, 2), 2, np.float16)  # one per block of 32: as stored
    assert scaled_fp8.scale_of(tensors, "a.weight", "a.scale_weight").dtype == np.float16
    tensors["a.scale_weight"] = np.full((1,), 2, np.float16)  # one per tensor: a float32 scalar
    assert scaled_fp8.scale_of(tensors, "a.weight", "a.scale_weight").shape == ()


def test_scales_and_the_marker_are_not_parameters(files):
    from preheat.models.safetensors_files import read_tensors

    tensors = read_tensors([files["scaled"]])
    scales = scaled_fp8.weight_scales(tensors)
    assert scales["double_blocks.0.img_attn.qkv.weight"] == "double_blocks.0.img_attn.qkv.scale_weight"
    extra = [k for k in tensors if scaled_fp8.ignored(k, tensors)]
    assert len(extra) == 2 * len(scales) + 1 and scaled_fp8.MARKER in extra
    assert not scaled_fp8.ignored("double_blocks.0.img_attn.qkv.weight", tensors)
    assert not scaled_fp8.ignored("nowhere.scale_weight", tensors)  # a scale without its weight is reported


# Convolutions: a tiny SD 1.x UNet whose conv weights (3x3 convs, 1x1 shortcuts and attention
# proj_in/proj_out) are stored scaled fp8, alternately one scale per output channel and one per tensor.
SD_CALL = dict(prompt="a photo of a cat", noise=NOISE, steps=3, sampler="ddim", guidance=5.0, width=32, height=32)


def _quantise_convs(state: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the UNet's tensors with every 4-D weight stored fp8 beside a ``scale_weight``: ``(out, 1, 1, 1)``
    per output channel for the even ones, a scalar for the odd ones; the same weights dequantised)."""
    import ml_dtypes

    scaled, plain = dict(state), dict(state)
    convs = sorted(k for k, v in state.items() if v.ndim == 4 and k.endswith(".weight"))
    for n, key in enumerate(convs):
        value = state[key]
        amax = np.abs(value).max(axis=(1, 2, 3), keepdims=True) if n % 2 == 0 else np.abs(value).max()
        scale = np.asarray(amax / FP8_MAX, np.float32)  # (out, 1, 1, 1) or ()
        fp8 = (value / scale).astype(ml_dtypes.float8_e4m3fn)
        scaled[key], scaled[key[:-len("weight")] + "scale_weight"] = fp8, scale
        plain[key] = fp8.astype(np.float32) * scale
    return scaled, plain


@pytest.fixture(scope="module")
def sd_files(tmp_path_factory):
    """A tiny SD 1.x folder, and two copies: its UNet's convs scaled fp8, and dequantised in float32."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from tests._support.sd_fixtures import save_tiny_sd

    base = tmp_path_factory.mktemp("scaled-sd")
    folder = save_tiny_sd(base / "sd", "sd1")
    unet = "unet/diffusion_pytorch_model.safetensors"
    scaled, plain = _quantise_convs(load_file(str(folder / unet)))
    out = {}
    for name, tensors in (("conv-scaled", scaled), ("conv-plain", plain)):
        out[name] = shutil.copytree(folder, base / name)
        save_file(tensors, str(out[name] / unet))
    return out


@pytest.fixture(scope="module")
def sd_pipes(sd_files):
    return {name: preheat.load(folder, cache="off") for name, folder in sd_files.items()}


def test_scaled_fp8_convs_draw_diffusers_image_of_the_dequantised_weights(sd_files, sd_pipes, record_property):
    """Every conv weight stays fp8 on the device beside its scale; a 1x1 conv scales its GEMM's output
    (``Quantised.matrix``), a 3x3 one expands the scale onto the weight in the program. diffusers'
    pipeline on the dequantised weights draws the same image to ORDER_TOL, the bound of float32
    rounding order (measured on this project's CPU: mean 0.0003, one value of 3072 one level off),
    and preheat's own load of the dequantised weights draws it to ORDER_TOL too."""
    import ml_dtypes

    from preheat.models.quantised import Quantised
    from tests._support.sd_fixtures import reference_pipeline, reference_pixels

    kept = {k: v for k, v in _leaves(sd_pipes["conv-scaled"]).items() if isinstance(v, Quantised)}
    assert all(q.values.dtype == ml_dtypes.float8_e4m3fn and len(q.shape) == 4 for q in kept.values())
    pointwise = {k: q for k, q in kept.items() if q.shape[:2] == (1, 1)}
    assert len(kept) > 20 and len(pointwise) >= 6 and len(kept) > len(pointwise)
    assert {q.scale.ndim for q in pointwise.values()} == {0, 4}  # per tensor and per channel reach the GEMM path
    ref = reference_pipeline(sd_files["conv-plain"], "ddim")
    theirs = reference_pixels(ref, SD_CALL["prompt"], NOISE, num_inference_steps=SD_CALL["steps"],
                              guidance_scale=SD_CALL["guidance"], height=32, width=32)
    ours = sd_pipes["conv-scaled"].generate(**SD_CALL)
    diff = px_diff(ours, theirs)
    record_property("mean_abs_px", float(diff.mean()))
    print(f"scaled fp8 convs vs diffusers on the dequantised weights: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert ours.std() > 5
    _same_to_rounding(ours, theirs)
    same = _same_to_rounding(ours, sd_pipes["conv-plain"].generate(**SD_CALL))
    print(f"scaled fp8 convs vs preheat on the dequantised weights: mean |Δpx| {same:.4f}")


def test_a_scaled_conv_matches_the_convolution_of_its_dequantised_weight():
    """``layers.Conv2d`` with a ``Quantised`` kernel after ``storage.upcast``: a 1x1 one kept (its scale
    on the GEMM's output), a 3x3 one and a 1x1 one with a block scale expanded; each is XLA's
    convolution of ``values * scale``, plus the bias, to float32 rounding. The old path (the scale on
    the weight) stays the reference."""
    import jax.numpy as jnp
    import ml_dtypes
    from flax import nnx

    from preheat.models.conv import conv2d
    from preheat.models.layers import Conv2d
    from preheat.models.quantised import Quantised
    from preheat.models.storage import upcast

    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 6, 64)).astype(np.float32)  # (B, H, W, Cin)
    bias = rng.standard_normal(3).astype(np.float32)
    cases = [(1, np.float32(0.25), True), (1, rng.random((1, 1, 1, 3)).astype(np.float32) + 0.5, True),
             (1, rng.random((1, 1, 2, 3)).astype(np.float32) + 0.5, False),  # per block of 32 inputs
             (3, rng.random((1, 1, 1, 3)).astype(np.float32) + 0.5, False)]
    for k, scale, kept in cases:
        graphdef, state = nnx.split(Conv2d(64, 3, k, padding=k // 2, rngs=nnx.Rngs(0)))
        state["bias"].set_value(jnp.asarray(bias))
        q = Quantised(jnp.asarray(rng.standard_normal((k, k, 64, 3)).astype(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale))
        state["kernel"].set_value(q)
        up = upcast(state, jnp.float32)
        assert isinstance(up["kernel"].get_value(), Quantised) == kept, (k, scale.shape)
        want = np.asarray(conv2d(jnp.asarray(x), q.expand(jnp.float32), 1, k // 2, impl="conv")) + bias
        np.testing.assert_allclose(np.asarray(nnx.merge(graphdef, up)(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # make test: a LoRA on kept scaled layers (the same factors, Linear kernels)
def test_a_lora_on_kept_scaled_convs_draws_the_dequantised_weights_lora_image(sd_files, sd_pipes, tmp_path):
    """A LoRA on the 1x1 convs kept scaled (attention ``proj_in``/``proj_out``, resnet ``conv_shortcut``:
    the layers that take an adapter) adds its low-rank term beside the scaled GEMM as beside any conv:
    the image is the dequantised weights' LoRA image to ORDER_TOL, and not the image without it."""
    from tests._support.lora_files import peft_layers, save_lora
    from tests._support.sd_fixtures import reference_pipeline

    ref = reference_pipeline(sd_files["conv-plain"], "ddim")
    lora = save_lora(ref, tmp_path / "lora", "unet",
                     {"unet": peft_layers(ref.unet, ["proj_in", "proj_out", "conv_shortcut"], 4, 4, seed=4)})
    with_lora = {name: sd_pipes[name].generate(**SD_CALL, lora=str(lora)) for name in ("conv-scaled", "conv-plain")}
    _same_to_rounding(with_lora["conv-scaled"], with_lora["conv-plain"])
    alone = sd_pipes["conv-scaled"].generate(**SD_CALL)
    assert mean_abs_px(with_lora["conv-scaled"], alone) > 1.0


@pytest.mark.parametrize("model", ["flux-linear", pytest.param("sd-conv", marks=pytest.mark.slow)])  # make test: one split
def test_fsdp_splits_kept_scaled_weights_and_draws_the_unsharded_image(model, request, tmp_path, monkeypatch):
    """``fsdp=2`` on two of the suite's fake CPU devices, with ``sharding.FSDP_MIN_SIZE`` lowered so that
    the tiny models' weights are split at all: each kept scaled weight's fp8 values and its per-channel
    scale (FLUX's Linear layers; SD's 1x1 and 3x3 convs, per channel and per tensor) are split over
    ``fsdp``, each device holding half of each, and XLA's SPMD partitioner gathers them where a layer
    uses them. The images are the unsharded load's to float32 rounding order (ORDER_TOL), not bit for
    bit: the partitioner may split a product over its contraction and add the halves in another order,
    and the mesh's program runs the one image padded to two (``preheat.sharding``). Measured: bit for
    bit on this CPU, both models."""
    from preheat import sharding
    from preheat.models.quantised import Quantised

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sharding, "FSDP_MIN_SIZE", 2)  # every weight of two or more elements
    if model == "flux-linear":
        files, whole, call = request.getfixturevalue("files"), request.getfixturevalue("pipes")["channel"], CALL
        pipe = preheat.load(files["channel"], config=files["folder"], cache="off", devices=2, fsdp=2)
    else:
        files, whole, call = request.getfixturevalue("sd_files"), request.getfixturevalue("sd_pipes")["conv-scaled"], SD_CALL
        pipe = preheat.load(files["conv-scaled"], cache="off", devices=2, fsdp=2)
    kept = [v for v in _leaves(pipe).values() if isinstance(v, Quantised)]
    assert len(kept) > 10 and any(q.scale.ndim for q in kept)
    for q in kept:
        for part in (q.values, q.scale) if q.scale.ndim else (q.values,):  # a scalar scale stays whole
            assert sharding.FSDP_AXIS in part.sharding.spec, part.sharding  # split, not replicated
            assert part.addressable_shards[0].data.size * 2 == part.size
    ours, theirs = pipe.generate(**call), whole.generate(**call)  # one image: padded to two on the mesh
    assert ours.std() > 5
    diff = _same_to_rounding(ours, theirs)
    print(f"fsdp=2 vs one device, {model} scaled fp8: mean |Δpx| {diff:.4f}, exact {np.array_equal(ours, theirs)}")
