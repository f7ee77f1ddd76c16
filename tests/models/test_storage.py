"""fp8 weight storage (``weights_dtype="float8_e4m3fn"``) against diffusers' layerwise casting.

Tiny random FLUX.1-dev, SD 1.x, SD 2.x, SDXL and SD3 folders written by diffusers, fp32 compute: the
layers stored in fp8 are the ones ``enable_layerwise_casting`` casts (by name); the image is
diffusers' from the same latents with those layers' weights rounded to fp8 (to float32 rounding
order), differs from the full-precision one, and differs from ``enable_layerwise_casting``'s by its
fp8 biases alone (preheat keeps them full); a file stored as ``F8_E4M3`` loads without a cast. The
full-size FLUX.1-dev transformer is measured abstractly (nothing allocated).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError, ModelFormatError
from tests._support.flow_fixtures import reference_pipeline as flow_reference
from tests._support.flow_fixtures import reference_pixels as flow_pixels
from tests._support.built_on_use import BuiltOnUse
from tests._support.flow_fixtures import save_tiny_flow_model
from tests._support.fp8_reference import FP8, cast_layers, cast_layerwise, round_to_fp8
from tests._support.fp8_reference import stored_low as _stored_low
from tests._support.numerics import assert_pixels_close, mean_abs_px
from tests._support.sd_fixtures import reference_pipeline as sd_reference
from tests._support.sd_fixtures import reference_pixels as sd_pixels
from tests._support.sd_fixtures import save_tiny_sd
from tests._support.tiers import gpu_only

ORDER_TOL = 0.01  # the same weights, products in another order (float32): test_scaled_fp8.py says why
# One call per folder kind: each kind's family's own sampler (the UNets': DDIM; the flow ones': flow Euler).
# SD 2.x's folder is v-prediction with linear attention projections (proj_in/proj_out Linear, not 1x1 convs),
# SDXL's adds the second encoder and the added-condition embeddings, SD3's is an MMDiT with three encoders.
CALLS = {"flux": dict(prompt="a watercolor fox", guidance=3.5), "sd1": dict(prompt="a photo of a cat", guidance=5.0),
         "sd2": dict(prompt="a photo of a cat", guidance=5.0), "sdxl": dict(prompt="a photo of a cat", guidance=5.0),
         "sd3": dict(prompt="a photo of a cat", guidance=5.0)}
FLOW = ("flux", "sd3")  # transformers, flow_euler; the others UNets, DDIM


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    return BuiltOnUse(lambda name: save_tiny_flow_model(base / name, "flux-dev" if name == "flux" else name)
                      if name in FLOW else save_tiny_sd(base / name, name))


@pytest.fixture(scope="module")
def pipes(folders):
    return BuiltOnUse(lambda key: preheat.load(folders[key[0]], cache="off", weights_dtype=FP8 if key[1] else None))


def _noise(n: int = 1) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, 4, 16, 16)).astype(np.float32)


def _reference(folders, name: str, cast: bool = True):
    """diffusers' pipeline and its denoiser, under ``enable_layerwise_casting`` (fp8 storage, fp32
    compute) unless ``cast=False``."""
    ref = flow_reference(folders[name], "flow_euler") if name in FLOW else sd_reference(folders[name], "ddim")
    denoiser = ref.transformer if name in FLOW else ref.unet
    return ref, cast_layerwise(denoiser) if cast else denoiser


def _theirs(ref, name: str) -> np.ndarray:
    call = CALLS[name]
    pixels = flow_pixels if name in FLOW else sd_pixels
    size = {} if name in FLOW else dict(height=32, width=32)
    return pixels(ref, call["prompt"], _noise(), num_inference_steps=3, guidance_scale=call["guidance"], **size)


def _ours(pipes, name: str, low: bool) -> np.ndarray:
    call = CALLS[name]
    return pipes[(name, low)].generate(call["prompt"], noise=_noise(), steps=3, guidance=call["guidance"],
                                       sampler="flow_euler" if name in FLOW else "ddim", width=32, height=32)


# make test checks a UNet (SD 1.x) and both transformers; SD 2.x's and SDXL's UNets (the same layer
# rule, other configs) in test-slow, as their folders take the time
KINDS = [pytest.param(name, marks=(pytest.mark.slow,) if name in ("sd2", "sdxl") else (), id=name)
         for name in ("flux", "sd1", "sd2", "sdxl", "sd3")]


@pytest.mark.parametrize("name", KINDS)
def test_the_fp8_layers_are_the_ones_diffusers_casts(folders, pipes, name):
    _, denoiser = _reference(folders, name)
    theirs = cast_layers(denoiser)
    ours = _stored_low(pipes[(name, True)].params)
    assert ours == theirs and len(ours) > 5
    top = {n.split(".")[0] for n in ours}
    assert "proj_out" not in top and not any("norm" in n for n in ours)  # top-level proj_out and norms stay full
    if name not in FLOW:  # the anchored patterns: an attention block's inner proj_in/proj_out is cast
        assert {"mid_block.attentions.0.proj_in", "mid_block.attentions.0.proj_out"} <= ours
    if name == "sd1":  # its plain fp8 1x1 convs (attention proj_in/proj_out, resnet conv_shortcut): layers.Conv2d
        # applies them as matrix products on the fp8 weight, the 3x3 ones as XLA's convolution of the converted one
        modules = dict(denoiser.named_modules())
        pointwise = {n for n in ours if n.endswith(("proj_in", "proj_out", "conv_shortcut"))}
        assert len(pointwise) >= 4 and {"down_blocks.0.attentions.0.proj_in"} <= pointwise, pointwise
        assert all(modules[n].weight.ndim == 4 for n in pointwise)  # convolutions in diffusers' SD 1.x UNet
    if name == "sdxl":  # the added (text, time) embedding's Linear layers too
        assert {"add_embedding.linear_1", "add_embedding.linear_2"} <= ours
    if name == "sd3":  # the MMDiT's own projections are cast, its patch embedding is not
        assert {"context_embedder", "transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.net.2"} <= ours
        assert not any(n.startswith("pos_embed") for n in ours)


@pytest.mark.parametrize("name", KINDS)
def test_fp8_draws_diffusers_image_of_the_fp8_weights(folders, pipes, name, record_property):
    """preheat's fp8 image is diffusers' pipeline's with the cast layers' weights rounded to fp8 and
    back (biases full, as preheat keeps them) to ``ORDER_TOL``: the same products in another order,
    float32 compute; and it moved from the full-precision image (the storage really is fp8).

    ``enable_layerwise_casting`` stores those layers' biases in fp8 as well: its image is that
    reference with the biases rounded too, bit for bit, so the biases are all that separates it
    from preheat's. How far that moves the image (recorded as ``layerwise_mean_abs_px``) is the
    folder's: on these, 0.31 (FLUX.1-dev), 0.28 (SD 1.x), 0.74 (SD 2.x), 2.16 (SDXL), 0.21 (SD3)."""
    ours, full = _ours(pipes, name, True), _ours(pipes, name, False)
    ref, denoiser = _reference(folders, name, cast=False)
    names = _stored_low(pipes[(name, True)].params)
    round_to_fp8(denoiser, names)
    theirs = _theirs(ref, name)
    record_property("mean_abs_px", mean_abs_px(ours, theirs))
    assert_pixels_close(ours, theirs, mean_tol=ORDER_TOL, max_tol=1)
    moved = mean_abs_px(ours, full)
    print(f"{name} fp8: mean |Δpx| {mean_abs_px(ours, theirs):.4f} to diffusers' fp8 weights, {moved:.4f} to full")
    assert moved > 0.1 and moved > 2 * mean_abs_px(ours, theirs), moved

    round_to_fp8(denoiser, names, biases=True)
    with_biases = _theirs(ref, name)
    cast, _ = _reference(folders, name)
    layerwise = _theirs(cast, name)
    np.testing.assert_array_equal(layerwise, with_biases)
    record_property("layerwise_mean_abs_px", mean_abs_px(ours, layerwise))
    print(f"{name} fp8: mean |Δpx| {mean_abs_px(ours, layerwise):.4f} to enable_layerwise_casting's (fp8 biases)")


def test_fp8_is_part_of_the_compile_key(pipes):
    from preheat.cache.keys import key_fields, key_of

    full, low = pipes[("sd1", False)], pipes[("sd1", True)]
    assert low.fingerprint == {**full.fingerprint, "weights_dtype": FP8, "weights_layers": "layerwise"}
    keys = []
    for pipe in (full, low):
        sig, args = pipe.prepare("a fox", steps=2, width=32, height=32)
        keys.append(key_of(key_fields(pipe.fingerprint, sig, args)))
    assert keys[0] != keys[1]


def test_an_f8_e4m3_file_loads_as_it_is_stored(folders, pipes, tmp_path):
    """A transformer file whose cast layers are stored F8_E4M3 (as fp8 checkpoints ship) places
    those bytes unchanged, and draws the image of the fp32 folder loaded as fp8."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from preheat.models.storage import layerwise

    folder = tmp_path / "flux-f8"
    shutil.copytree(folders["flux"], folder)
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    low = layerwise(("pos_embed", "norm"))
    tensors = {k: (v.to(torch.float8_e4m3fn) if v.ndim == 2 and low(k) else v) for k, v in load_file(path).items()}
    save_file(tensors, path)
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    stored = {k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F8_E4M3"}
    pipe = preheat.load(folder, cache="off", weights_dtype=FP8)
    assert {f"{m}.weight" for m in _stored_low(pipe.params)} == stored and stored
    read, placed = pipe.load_report.parts[-2].bytes_read, pipe.load_report.parts[-2].placed_bytes
    assert "transformer" in pipe.load_report.parts[-2].source and read == placed  # no cast on the way
    from flax import nnx

    values = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(pipe.params)}
    key = sorted(stored)[0]
    np.testing.assert_array_equal(np.asarray(values[key[:-len("weight")] + "kernel"]).T.view(np.uint8),
                                  tensors[key].view(torch.uint8).numpy())
    np.testing.assert_array_equal(_ours({("flux", True): pipe}, "flux", True), _ours(pipes, "flux", True))


def test_a_full_size_flux_dev_places_at_most_055_of_its_bf16_bytes():
    """FLUX.1-dev's published transformer config, built abstractly: the bytes each load would place."""
    import jax.numpy as jnp

    from preheat.models.flux import FluxTransformerConfig, build_abstract
    from preheat.models.published import CONFIGS
    from preheat.models.storage import placed_bytes

    config = FluxTransformerConfig.from_dict(  # the published config preheat ships for single files
        json.loads((CONFIGS / "FLUX.1-dev" / "transformer" / "config.json").read_text()), "FLUX.1-dev")
    _, abstract = build_abstract(config)
    bf16 = placed_bytes(abstract, jnp.bfloat16)
    layerwise = placed_bytes(abstract, jnp.bfloat16, FP8, ("pos_embed", "norm"))
    linear = placed_bytes(abstract, jnp.bfloat16, FP8, ("pos_embed", "norm"), weights_layers="linear")
    print(f"FLUX.1-dev transformer: bf16 {bf16 / 1e9:.2f} GB, fp8 layerwise {layerwise / 1e9:.2f} GB "
          f"({layerwise / bf16:.3f}x), fp8 linear {linear / 1e9:.2f} GB ({linear / bf16:.3f}x)")
    assert 23.0 < bf16 / 1e9 < 24.5  # 11.9 B parameters
    # diffusers' set keeps the AdaLN modulation ("norm*.linear", a quarter of the weights) in bf16
    assert 0.6 < layerwise / bf16 < 0.65
    assert linear <= 0.55 * bf16


def test_weights_layers_linear_stores_the_modulation_layers_too(folders):
    pipe = preheat.load(folders["flux"], cache="off", weights_dtype=FP8, weights_layers="linear")
    low = _stored_low(pipe.params)
    assert {"transformer_blocks.0.norm1.linear", "single_transformer_blocks.0.norm.linear", "norm_out.linear"} <= low
    assert "proj_out" not in low and pipe.fingerprint["weights_layers"] == "linear"


def test_bad_fp8_requests_are_one_line(folders, monkeypatch):
    with pytest.raises(InvalidArgumentError, match="weights_dtype='float8_e5m3'") as bad:
        preheat.load(None, weights_dtype="float8_e5m3", cache="off")
    assert bad.value.argument == "weights_dtype"
    with pytest.raises(InvalidArgumentError, match="backend='jax'"):
        preheat.load(folders["sd1"], backend="torch", weights_dtype=FP8)
    import jax

    def refuse(x, *args, **kwargs):  # a runtime without fp8 buffers refuses the transfer
        if np.dtype(getattr(x, "dtype", np.float32)) == np.dtype(FP8):
            raise jax.errors.JaxRuntimeError("UNIMPLEMENTED: float8_e4m3fn buffers are not supported")
        return real(x, *args, **kwargs)

    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", refuse)
    with pytest.raises(ModelFormatError, match="cannot hold float8_e4m3fn weights: UNIMPLEMENTED") as exc:
        preheat.load(None, weights_dtype=FP8, cache="off")
    assert "\n" not in str(exc.value)


def test_the_upcast_runs_inside_the_sampling_loop():
    """The compiled program converts each fp8 weight inside the loop's body (per step, where it is
    used), not once before the loop, which would hold a full-precision copy of every weight."""
    import re

    import jax

    from preheat.engine import build_program

    pipe = preheat.load(None, weights_dtype=FP8, cache="off")
    sig, args = pipe.prepare(2, steps=4)
    hlo = jax.jit(build_program(sig, pipe.apply)).lower(args).compile().as_text()
    bodies = {m.group(1) for m in re.finditer(r" while\(.*?body=(%[\w.\-]+)", hlo)}
    comps = {c.split(" ", 1)[0]: c for c in re.split(r"\n(?=%)", hlo) if c.startswith("%")}
    called = {m.group(1) for name in bodies for m in re.finditer(r"calls=(%[\w.\-]+)", comps.get(name, ""))}
    fp8_reads = [name for name in called if "f8e4m3fn" in comps.get(name, "").split("\n", 1)[0]]
    assert bodies and len(fp8_reads) > 10, (bodies, len(fp8_reads))


def _h200_hlo(fn, *args) -> str:
    """``fn`` compiled for XLA's H200 description on this CPU (deviceless, not autotuned): its HLO
    text, with XLA's convolutions (``PREHEAT_CONV=conv`` unless set): the program a pod traces for
    itself, whose kernels these tests read (a deviceless ``auto`` trace writes them as GEMMs)."""
    import os
    from unittest import mock

    import jax

    from preheat import platforms
    from preheat.cache import targets
    from preheat.cache.compile import on_device
    from preheat.platforms import compiling_for

    if not any(k.startswith("jax-cuda") for k in platforms.cuda_versions()):
        pytest.skip("needs the test-gpu extra's jax-cuda13-plugin (make test-slow installs it)")
    device = targets.target_device(targets.resolve_target("h200"))
    conv = {"PREHEAT_CONV": os.environ.get("PREHEAT_CONV", "conv")}
    with compiling_for("gpu", (9, 0)), mock.patch.dict(os.environ, conv):
        return jax.jit(fn).lower(*on_device(args, device)).compile().as_text()


def _header(hlo: str, kernel) -> str:
    """A kernel's fused computation's first line: the parameters it reads, with their types."""
    from benchmarks.fp8 import computation

    return computation(hlo, kernel.name).split("\n", 1)[0]


def _convs(ks) -> list[str]:
    """The cuDNN convolution calls among ``ks``: their targets."""
    return [k.name for k in ks if k.op == "custom-call" and k.name.startswith("__cudnn$conv")]


@gpu_only  # a deviceless CUDA compile for the H200 (make test-slow)
def test_on_the_h200_the_gemm_reads_the_fp8_weight_itself():
    """Issue 28 asks which happens on a Hopper GPU: the compiled HLO for XLA's H200 description
    (a deviceless compile on this CPU, not autotuned). The weight's f8 -> bf16 convert is fused
    into the GEMM's own kernel (a Triton GEMM fusion whose parameter is the fp8 weight), so no
    bf16 copy of the weight is written to memory; the dot inside runs on bf16 operands
    (weight-only fp8 storage, not fp8 math: the activations are bf16)."""
    import re

    import jax
    import jax.numpy as jnp

    from benchmarks.fp8 import computation, kernels, one_gemm_on_fp8
    from preheat.models.storage import upcast

    def dense(params, x):  # x (tokens, in) @ kernel (in, out), as a Linear layer applies it
        return x @ upcast(params, jnp.bfloat16, tie=x)["kernel"]

    hlo = _h200_hlo(dense, {"kernel": jax.ShapeDtypeStruct((3072, 3072), jnp.float8_e4m3fn)},
                    jax.ShapeDtypeStruct((4096, 3072), jnp.bfloat16))  # FLUX.1's hidden width, 4096 image tokens
    ks = kernels(hlo)
    assert one_gemm_on_fp8(ks, 3072), ks  # one kernel, the GEMM reading the fp8 weight: no separate convert
    gemm = computation(hlo, ks[0].name)
    dots = re.findall(r"= (\w+)\[[\d,]*\]\{[\d,]*\} dot\(", gemm)
    assert dots == ["bf16"], dots
    operands = re.findall(r"(\w+)\[[\d,]+\]\{[\d,]+\} (?:convert|parameter)", gemm)
    assert "bf16" in operands and "f8e4m3fn" in operands, operands


@gpu_only  # a deviceless CUDA compile for the H200 (make test-slow)
@pytest.mark.parametrize("scale", [None, (), (1, 3072)], ids=["plain", "per-tensor", "per-channel"])
def test_on_the_h200_a_scaled_fp8_linear_is_one_gemm_on_the_fp8_weight(scale):
    """A scaled fp8 weight (``quantised.Quantised``: fp8 values and a float32 scale per tensor or per
    output channel) in a real ``layers.Linear`` with a bias, after ``storage.upcast``, as a denoiser
    applies it: one kernel, the Triton GEMM, which reads the fp8 weight and its scale itself (the
    scale multiplies the product in the GEMM's epilogue, then the bias). No kernel writes a
    (3072, 3072) weight-shaped copy. The same layer with the scale put back on the weight
    (``values * scale`` before the product, the path before) compiles to two kernels, the first
    writing a bf16 copy of the weight: that is what this test refuses. A plain fp8 weight's layer is
    one kernel too: its bias, outside ``upcast``'s optimization barrier, is added in the epilogue (it
    was a second kernel re-reading the product while the barrier held every parameter)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.fp8 import kernels, one_gemm_on_fp8
    from preheat.models.layers import Linear
    from preheat.models.quantised import Quantised
    from preheat.models.storage import upcast
    from preheat.models.weights import build_abstract

    n = 3072  # FLUX.1's hidden width
    graphdef, abstract = build_abstract(lambda rngs: Linear(n, n, rngs=rngs))
    fp8 = jax.ShapeDtypeStruct((n, n), jnp.float8_e4m3fn)
    abstract["kernel"].set_value(fp8 if scale is None else Quantised(fp8, jax.ShapeDtypeStruct(scale, jnp.float32)))
    abstract["bias"].set_value(jax.ShapeDtypeStruct((n,), jnp.bfloat16))
    x = jax.ShapeDtypeStruct((4096, n), jnp.bfloat16)  # 4096 image tokens

    def layer(params, x):  # (tokens, in) -> (tokens, out)
        return nnx.merge(graphdef, upcast(params, jnp.bfloat16, tie=x))(x)

    hlo = _h200_hlo(layer, abstract, x)
    ks = kernels(hlo)
    assert one_gemm_on_fp8(ks, n), ks  # one kernel: the GEMM, reading the fp8 weight itself
    assert not [k for k in ks if k.output.startswith(f"bf16[{n},{n}]")], ks  # no weight-sized output
    header = _header(hlo, ks[0])
    if scale is None:
        return
    assert ("f32[]" if scale == () else f"f32[{n}]") in header, header  # and the scale, in its epilogue

    def on_weight(params, x):  # the control: the scale on the weight, before the product
        params = upcast(params, jnp.bfloat16, tie=x)
        q = params["kernel"].get_value()
        params["kernel"].set_value(q.expand(jnp.bfloat16) if isinstance(q, Quantised) else q)
        return nnx.merge(graphdef, params)(x)

    before = kernels(_h200_hlo(on_weight, abstract, x))
    assert len(before) == 2 and before[0].output.startswith(f"bf16[{n},{n}]"), before  # a bf16 weight copy, written


@gpu_only  # a deviceless CUDA compile for the H200 (make test-slow)
@pytest.mark.parametrize("k", [1, 3], ids=["1x1", "3x3"])
@pytest.mark.parametrize("scale", [(), "channel"], ids=["per-tensor", "per-channel"])
def test_on_the_h200_a_scaled_fp8_conv_scales_where_it_costs_no_kernel(k, scale):
    """A scaled fp8 Conv2d with a bias (SD's 640-channel convs, 2 x 64 x 64 pixels), after
    ``storage.upcast``, compiled for XLA's H200 description. A 1x1 conv is a Linear on each pixel:
    ``(x @ values) * scale`` (``Quantised.matrix``) is one kernel, the Triton GEMM reading the fp8
    weight and its scale itself; the old path (the scale on the weight, then XLA's convolution: the
    control) writes a bf16 copy of the weight in cuDNN's layout, then runs cuDNN. A 3x3 conv runs
    on cuDNN, which reads a bf16 weight in its own (O, H, W, I) layout: XLA writes that copy at every
    use whatever the stored dtype (a plain fp8 weight too), and the scale on the weight fuses into
    that same copy, so ``conv(x, values) * scale`` (the control here) buys nothing and costs a
    kernel: the scale cannot join cuDNN's conv-bias epilogue, so a loop fusion re-reads the output."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.fp8 import kernels, one_gemm_on_fp8
    from preheat.models.conv import conv2d
    from preheat.models.layers import Conv2d, lift
    from preheat.models.quantised import Quantised
    from preheat.models.storage import upcast
    from preheat.models.weights import build_abstract

    c = 640
    graphdef, abstract = build_abstract(lambda rngs: Conv2d(c, c, k, padding=k // 2, rngs=rngs))
    fp8 = jax.ShapeDtypeStruct((k, k, c, c), jnp.float8_e4m3fn)
    scale_shape = () if scale == () else (1, 1, 1, c)
    abstract["kernel"].set_value(Quantised(fp8, jax.ShapeDtypeStruct(scale_shape, jnp.float32)))
    abstract["bias"].set_value(jax.ShapeDtypeStruct((c,), jnp.bfloat16))
    x = jax.ShapeDtypeStruct((2, 64, 64, c), jnp.bfloat16)

    def layer(params, x):  # (B, H, W, C) -> (B, H, W, C), as a denoiser applies it
        return nnx.merge(graphdef, upcast(params, jnp.bfloat16, tie=x))(x)

    hlo = _h200_hlo(layer, abstract, x)
    ks = kernels(hlo)
    if k == 1:
        assert one_gemm_on_fp8(ks, c), ks  # one GEMM, reading the fp8 weight itself
        assert ("f32[]" if scale == () else f"f32[{c}]") in _header(hlo, ks[0]), ks  # and the scale, in its epilogue
    else:
        assert len(ks) == 2 and ks[0].output.startswith(f"bf16[{c},{k},{k},{c}]"), ks  # cuDNN's OHWI layout copy
        assert "f32" in _header(hlo, ks[0])  # the copy reads the scale (fused in)
        assert _convs(ks) == ["__cudnn$convBiasActivationForward"], ks  # the bias in cuDNN's epilogue

    def control(params, x):  # k=1: the old path (the scale on the weight); k=3: the scale on the output
        q = params["kernel"].get_value()  # as placed: the fp8 values and their scale
        (values,), _ = jax.lax.optimization_barrier(((q.values,), x))  # tied to the step, as upcast ties them
        bias = lift(params["bias"].get_value(), 4)
        if k == 1:
            return conv2d(x, Quantised(values, q.scale).expand(jnp.bfloat16), 1, 0, impl="conv") + bias
        scale = q.scale.reshape((1, 1, 1, -1)) if q.scale.ndim else q.scale  # (1, 1, 1, C): no rank promotion
        y = conv2d(x, values.astype(jnp.bfloat16), 1, 1, impl="conv").astype(jnp.float32) * scale
        return y.astype(x.dtype) + bias

    before = kernels(_h200_hlo(control, abstract, x))
    if k == 1:
        assert len(before) == 2 and before[0].output.startswith(f"bf16[{c},1,1,{c}]"), before  # a bf16 weight copy
        assert _convs(before) == ["__cudnn$convBiasActivationForward"], before  # then cuDNN
    else:
        assert len(before) == 3 and before[0].output.startswith(f"bf16[{c},3,3,{c}]"), before  # the same copy
        assert _convs(before) == ["__cudnn$convForward"], before  # cuDNN without the bias,
        assert before[2].op == "fusion" and before[2].output.startswith("bf16[2,64,64,"), before  # which re-reads


@gpu_only  # a deviceless CUDA compile for the H200 (make test-slow)
def test_on_the_h200_a_plain_fp8_1x1_conv_is_one_gemm_on_the_fp8_weight():
    """``weights_dtype="float8_e4m3fn"``'s 1x1 convs (SD/SDXL UNets' attention ``proj_in``/``proj_out``,
    resnet ``conv_shortcut``: no scale, preheat's own cast) compiled for XLA's H200 description: a real
    ``layers.Conv2d`` with a bias after ``storage.upcast``, as a denoiser applies it, is one kernel,
    the Triton GEMM reading the fp8 weight itself, bias in its epilogue. The control is the path
    before (``upcast`` converting the weight, then XLA's convolution): a kernel writing a bf16 copy
    of the weight in cuDNN's layout at every step, then cuDNN."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.fp8 import kernels, one_gemm_on_fp8
    from preheat.models.conv import conv2d
    from preheat.models.layers import Conv2d, lift
    from preheat.models.storage import upcast
    from preheat.models.weights import build_abstract

    c = 640  # SD's middle width, 2 x 64 x 64 pixels
    graphdef, abstract = build_abstract(lambda rngs: Conv2d(c, c, 1, rngs=rngs))
    abstract["kernel"].set_value(jax.ShapeDtypeStruct((1, 1, c, c), jnp.float8_e4m3fn))
    abstract["bias"].set_value(jax.ShapeDtypeStruct((c,), jnp.bfloat16))
    x = jax.ShapeDtypeStruct((2, 64, 64, c), jnp.bfloat16)

    def layer(params, x):  # (B, H, W, C) -> (B, H, W, C)
        return nnx.merge(graphdef, upcast(params, jnp.bfloat16, tie=x))(x)

    def before(params, x):  # the control: the weight converted, then XLA's convolution
        (values,), _ = jax.lax.optimization_barrier(((params["kernel"].get_value(),), x))
        return conv2d(x, values.astype(jnp.bfloat16), 1, 0, impl="conv") + lift(params["bias"].get_value(), 4)

    ks = kernels(_h200_hlo(layer, abstract, x))
    assert one_gemm_on_fp8(ks, c), ks  # one kernel: the GEMM, reading the fp8 weight itself
    assert not _convs(ks) and not [k for k in ks if k.output.startswith(f"bf16[{c},1,1,{c}]")], ks
    old = kernels(_h200_hlo(before, abstract, x))
    assert len(old) == 2 and old[0].output.startswith(f"bf16[{c},1,1,{c}]") and old[0].reads_fp8, old  # the copy
    assert _convs(old) == ["__cudnn$convBiasActivationForward"], old  # then cuDNN


def test_preheat_fp8_1x1_conv_switches_the_real_layer_to_the_convolution(monkeypatch):
    """``PREHEAT_FP8_1X1=conv`` (the GPU check's ``fp8unet`` row times both settings): the same real
    ``layers.Conv2d`` after ``storage.upcast`` compiles for the H200 to what it did before the GEMM
    path (a kernel writing the bf16 weight copy, then cuDNN), and ``gemm``/``auto`` to the one GEMM
    on the fp8 weight; on this CPU the two agree to rounding (the same fp8 weights)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.fp8 import kernels, one_gemm_on_fp8
    from preheat.models.layers import Conv2d
    from preheat.models.storage import upcast
    from preheat.models.weights import build_abstract

    c = 640
    graphdef, abstract = build_abstract(lambda rngs: Conv2d(c, c, 1, rngs=rngs))
    abstract["kernel"].set_value(jax.ShapeDtypeStruct((1, 1, c, c), jnp.float8_e4m3fn))
    abstract["bias"].set_value(jax.ShapeDtypeStruct((c,), jnp.bfloat16))
    x = jax.ShapeDtypeStruct((2, 64, 64, c), jnp.bfloat16)

    def program(graphdef=graphdef):  # a fresh function per setting: traced under it
        return lambda params, x: nnx.merge(graphdef, upcast(params, jnp.bfloat16, tie=x))(x)

    monkeypatch.setenv("PREHEAT_FP8_1X1", "conv")
    ks = kernels(_h200_hlo(program(), abstract, x))
    assert len(ks) == 2 and ks[0].output.startswith(f"bf16[{c},1,1,{c}]") and ks[0].reads_fp8, ks  # the copy
    assert _convs(ks) == ["__cudnn$convBiasActivationForward"], ks  # then cuDNN
    for setting in ("gemm", "auto"):
        monkeypatch.setenv("PREHEAT_FP8_1X1", setting)
        assert one_gemm_on_fp8(kernels(_h200_hlo(program(), abstract, x)), c)

    rng = np.random.default_rng(0)  # small and on this CPU: both settings compute the same products
    small, state = nnx.split(Conv2d(32, 16, 1, rngs=nnx.Rngs(0)))
    state["kernel"].set_value(jnp.asarray(rng.standard_normal((1, 1, 32, 16)) / 6, jnp.float8_e4m3fn))
    state["bias"].set_value(jnp.asarray(rng.standard_normal(16), jnp.bfloat16))
    xs = jnp.asarray(rng.standard_normal((2, 4, 4, 32)), jnp.bfloat16)
    outs = {}
    for setting in ("gemm", "conv"):
        monkeypatch.setenv("PREHEAT_FP8_1X1", setting)
        outs[setting] = np.asarray(jax.jit(program(small))(state, xs), np.float32)
        names = {e.primitive.name for e in jax.make_jaxpr(program(small))(state, xs).jaxpr.eqns}
        assert ("conv_general_dilated" in names) == (setting == "conv"), names
    # bf16 outputs of sums of 32 products: the two orders differ by a bf16 rounding at most
    assert np.abs(outs["gemm"] - outs["conv"]).max() <= 2 ** -7 * np.abs(outs["conv"]).max()


@gpu_only  # a deviceless CUDA compile for the H200 (make test-slow)
@pytest.mark.parametrize("scale", [None, (), "row", "q8_0"], ids=["plain", "per-tensor", "per-row", "q8_0-blocks"])
def test_on_the_h200_an_fp8_embedding_widens_only_the_rows_it_gathers(scale):
    """An fp8 or scaled Embedding table (the UNet's ``class_embedding``; 1000 classes x 1280 here, as
    an ImageNet model's) after ``storage.upcast``, as a denoiser applies it, compiled for XLA's H200
    description: ``upcast`` widens (and scales) the whole table in the program's text, then
    ``Embedding`` gathers B rows, but XLA fuses the convert and the scale into the gather's own
    kernel, which computes them for the gathered elements only: one kernel, reading the stored
    table, writing the (B, dim) rows, and no kernel writes a widened table. (Gathering the stored
    rows first, then widening them, compiles to the same one kernel: it was tried and not kept.)
    The control forces the widened table to memory (a barrier between the convert and the gather),
    so the check can tell: then a kernel writes bf16[1000,1280]."""
    import re

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.fp8 import kernels
    from preheat.models.layers import Embedding
    from preheat.models.quantised import Quantised
    from preheat.models.storage import upcast
    from preheat.models.weights import build_abstract

    num, dim = 1000, 1280
    graphdef, abstract = build_abstract(lambda rngs: Embedding(num, dim, rngs=rngs))
    stored = jax.ShapeDtypeStruct((num, dim), jnp.int8 if scale == "q8_0" else jnp.float8_e4m3fn)
    shape = {"row": (num, 1), "q8_0": (num, dim // 32)}.get(scale, scale)  # a scaled file's (out, 1); GGUF's blocks
    abstract["embedding"].set_value(stored if scale is None else Quantised(
        stored, jax.ShapeDtypeStruct(shape, jnp.float16 if scale == "q8_0" else jnp.float32)))
    ids = jax.ShapeDtypeStruct((2,), jnp.int32)

    def layer(params, ids):  # (B,) -> (B, dim)
        return nnx.merge(graphdef, upcast(params, jnp.bfloat16, tie=ids))(ids)

    def control(params, ids):  # the widened table made a value of its own, then gathered
        (table,), _ = jax.lax.optimization_barrier(((upcast(params, jnp.bfloat16)["embedding"].get_value(),), ids))
        return jnp.take(table, ids, axis=0)

    def widened(ks) -> list:  # kernels writing a float copy of the whole table, in any layout (Q8_0: (num, 1, 40, 32))
        out = []
        for k in ks:
            m = re.match(r"(bf16|f16|f32)\[([\d,]*)\]", k.output)
            if m and int(np.prod([int(d) for d in m[2].split(",") if d])) == num * dim:
                out.append(k)
        return out

    hlo = _h200_hlo(layer, abstract, ids)
    ks = kernels(hlo)
    assert len(ks) == 1 and re.match(r"bf16\[2,[\d,]*\]", ks[0].output), ks  # one kernel: the gathered rows
    assert re.search(rf"(f8e4m3fn|s8)\[{num},{dim}\]", _header(hlo, ks[0])), ks  # reading the stored table
    assert not widened(ks), ks
    old = kernels(_h200_hlo(control, abstract, ids))
    assert widened(old), old  # the check sees a widened table when there is one
