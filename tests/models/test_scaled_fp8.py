"""Scaled fp8 single files (issue 28 item 2): a tiny FLUX.1-dev transformer in BFL's layout whose
Linear weights are stored ``F8_E4M3`` with a float32 ``scale_weight`` each (``amax / 448``), a
``scale_input`` each and the top-level ``scaled_fp8`` marker, as ComfyUI writes them. preheat's
image from it is the image of the same dequantised weights stored plainly, and the scales matter:
the same fp8 bytes without them give another image."""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.models import scaled_fp8
from tests._support import flow_fixtures
from tests._support.bfl_files import to_bfl

MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


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

    base = tmp_path_factory.mktemp("scaled")
    folder = flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")
    bfl = to_bfl(load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors")))
    scaled, plain = _quantise(bfl)
    out = {"folder": folder}
    for name, tensors in (("scaled", scaled), ("plain", plain),
                          ("unscaled", {k: v for k, v in scaled.items() if not k.endswith(".scale_weight")})):
        out[name] = base / f"{name}.safetensors"
        save_file(tensors, str(out[name]))
    return out


def _image(files, name: str, **load) -> np.ndarray:
    pipe = preheat.load(files[name], config=files["folder"], cache="off", **load)
    noise = np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)
    return pipe.generate("a watercolor fox", noise=noise, steps=3, sampler="flow_euler", guidance=3.5,
                         width=32, height=32)


def test_a_scaled_fp8_file_draws_its_dequantised_weights_image(files, tmp_path, monkeypatch, record_property):
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    plain, scaled = _image(files, "plain"), _image(files, "scaled")
    diff = float(np.abs(scaled.astype(np.int32) - plain.astype(np.int32)).mean())
    record_property("mean_abs_px", diff)
    print(f"scaled fp8 vs its dequantised weights: mean |Δpx| {diff:.4f}")
    assert diff <= MEAN_TOL and plain.std() > 5
    unscaled = _image(files, "unscaled")  # the same fp8 bytes read as plain F8_E4M3: the scales matter
    moved = float(np.abs(unscaled.astype(np.int32) - plain.astype(np.int32)).mean())
    print(f"scales ignored: mean |Δpx| {moved:.4f}")
    assert moved > 10 * max(diff, 0.1)


def test_fp8_storage_of_a_scaled_file_is_that_of_its_dequantised_weights(files, tmp_path, monkeypatch):
    """With weights_dtype=float8_e4m3fn the dequantised weights are stored in fp8 as any
    full-precision weights are: the same device bytes, so the same image."""
    from flax import nnx

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    pipes = {name: preheat.load(files[name], config=files["folder"], cache="off", weights_dtype="float8_e4m3fn")
             for name in ("scaled", "plain")}
    leaves = {name: {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(pipe.params)}
              for name, pipe in pipes.items()}
    assert leaves["scaled"].keys() == leaves["plain"].keys()
    low = [k for k, v in leaves["plain"].items() if v.dtype == np.dtype("float8_e4m3fn")]
    assert len(low) > 5
    for key, value in leaves["plain"].items():
        np.testing.assert_array_equal(leaves["scaled"][key].view(np.uint8), value.view(np.uint8), err_msg=key)


def test_scales_and_the_marker_are_not_parameters(files):
    from preheat.models.weights import read_tensors

    tensors = read_tensors([files["scaled"]])
    scales = scaled_fp8.weight_scales(tensors)
    assert scales["double_blocks.0.img_attn.qkv.weight"] == "double_blocks.0.img_attn.qkv.scale_weight"
    extra = [k for k in tensors if scaled_fp8.ignored(k, tensors)]
    assert len(extra) == 2 * len(scales) + 1 and scaled_fp8.MARKER in extra
    assert not scaled_fp8.ignored("double_blocks.0.img_attn.qkv.weight", tensors)
    assert not scaled_fp8.ignored("nowhere.scale_weight", tensors)  # a scale without its weight is reported
