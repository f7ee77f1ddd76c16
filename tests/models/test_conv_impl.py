"""The per-platform model-code switches (``PREHEAT_CONV``, ``PREHEAT_GROUPNORM``): every
implementation computes the same convolution as XLA's and the same GroupNorm as a float64
reference, and the whole UNet keeps diffusers parity with each."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError
from preheat.models.conv import (CONV_IMPLS, FENCE_SETTINGS, FP8_1X1_IMPLS, GROUPNORM_IMPLS, conv2d, conv_impl, fence,
                                 fp8_1x1_impl,
                                 groupnorm_impl)
from preheat.models.layers import GroupNorm
from tests._support.reference import save_random_unet, torch_unet_output

# Outputs are O(1) sums of k*k*Cin <= 144 products; the implementations add the same products in
# another order, so they differ by float32 reassociation only: a few ulps of the partial sums,
# measured <= 1.2e-6 here and on whole UNets. 1e-5 leaves room for other CPUs' kernels, and is
# 100x below what a wrong tap, stride or padding gives (O(0.1-1)).
IMPL_TOL = 1e-5
FP32_TOL = 1e-4  # parity with diffusers, as tests/models/test_unet2d.py


@pytest.mark.parametrize("impl", [i for i in CONV_IMPLS if i != "conv"])
@pytest.mark.parametrize("k,stride,padding", [(3, 1, 1), (3, 2, 1), (3, 2, 0), (1, 1, 0)])
def test_impls_agree_with_xla_convolution(impl, k, stride, padding):
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(2, 9, 9, 16).astype(np.float32))  # odd size: stride 2 floors
    kernel = jnp.asarray((rng.rand(k, k, 16, 24).astype(np.float32) * 2 - 1) / np.sqrt(k * k * 16))
    ref = jax.lax.conv_general_dilated(x, kernel, (stride, stride), ((padding, padding),) * 2,
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                       precision=jax.lax.Precision.HIGHEST)
    out = jax.jit(conv2d, static_argnums=(2, 3, 4))(x, kernel, stride, padding, impl)
    assert out.shape == ref.shape
    assert float(jnp.abs(out - ref).max()) <= IMPL_TOL


@pytest.fixture(scope="module")
def unet_case(tmp_path_factory):
    # Tiny, but with every conv kind: 3x3, stride-2 with the asymmetric pad, 1x1 shortcut (32 -> 64).
    config = dict(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
                  norm_num_groups=8, down_block_types=("DownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "UpBlock2D"), downsample_padding=0)
    path = save_random_unet(config, tmp_path_factory.mktemp("conv-impl") / "m", perturb=0.02)
    rng = np.random.RandomState(0)
    x = rng.randn(2, 3, 8, 8).astype(np.float32)
    t = np.array([3, 700], np.int64)
    return path, x, t, torch_unet_output(path, x, t)


SWITCHES = {"PREHEAT_CONV": conv_impl, "PREHEAT_GROUPNORM": groupnorm_impl}


@pytest.mark.parametrize("switch,impl", [("PREHEAT_CONV", i) for i in CONV_IMPLS]
                         + [("PREHEAT_GROUPNORM", i) for i in GROUPNORM_IMPLS])
def test_unet_parity_with_diffusers_for_each_setting(unet_case, switch, impl, monkeypatch):
    path, x, t, ref = unet_case
    monkeypatch.setenv(switch, impl)
    assert SWITCHES[switch]() == impl
    unet = preheat.load_unet(path)
    out = np.asarray(jax.jit(unet.__call__)(x, t))  # a fresh bound method: traced under this setting
    assert float(np.abs(out - ref).max()) <= FP32_TOL


@pytest.mark.parametrize("impl", GROUPNORM_IMPLS)
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_groupnorm_matches_a_float64_reference_far_from_zero(impl, offset, monkeypatch):
    """A group whose mean is 1000x its spread: E[x^2] - E[x]^2 in float32 would lose the variance
    (its error ~ ulp(1e6) ~ 0.06 of a variance of 1); the shifted one-pass moments keep it."""
    monkeypatch.setenv("PREHEAT_GROUPNORM", impl)
    rng = np.random.RandomState(1)
    x = (offset + rng.randn(2, 6, 5, 12)).astype(np.float32)  # (B, H, W, C), 4 groups of 3
    norm = GroupNorm(4, 12, 1e-5)
    norm.scale[...] = jnp.asarray(rng.rand(12).astype(np.float32) + 0.5)
    norm.bias[...] = jnp.asarray(rng.randn(12).astype(np.float32))
    xg = x.astype(np.float64).reshape(2, -1, 4, 3)
    want = (xg - xg.mean(axis=(1, 3), keepdims=True)) / np.sqrt(xg.var(axis=(1, 3), keepdims=True) + 1e-5)
    want = want.reshape(x.shape) * np.asarray(norm.scale[...]) + np.asarray(norm.bias[...])
    got = np.asarray(jax.jit(lambda v: norm(v))(jnp.asarray(x)))
    # float32 rounding of x itself at 1000 is ~6e-5 of the spread; 1e-3 is 60x below a lost variance
    assert float(np.abs(got - want).max()) <= (1e-5 if offset == 0 else 1e-3)


@pytest.mark.parametrize("variable, read, auto, unknown", [
    ("PREHEAT_CONV", conv_impl, "conv", "winograd"),
    ("PREHEAT_GROUPNORM", groupnorm_impl, "one_pass" if jax.default_backend() == "cpu" else "two_pass", "welford"),
    ("PREHEAT_FP8_1X1", fp8_1x1_impl, "gemm", "cudnn"),
    ("PREHEAT_FENCES", lambda: "on" if "optimization_barrier" in jax.jit(lambda a: fence(a)).lower(jnp.ones(2)).as_text() else "off",
     "off", "sometimes"),
])
def test_each_switch_has_its_auto_and_refuses_an_unknown_value(monkeypatch, variable, read, auto, unknown):
    monkeypatch.delenv(variable, raising=False)
    assert read() == auto
    monkeypatch.setenv(variable, "auto")
    assert read() == auto
    monkeypatch.setenv(variable, unknown)
    with pytest.raises(InvalidArgumentError, match=f"{variable}='{unknown}'"):
        read()


def test_a_deviceless_gpu_trace_writes_convolutions_as_matrix_products(monkeypatch):
    """``warm --target``: a cuDNN convolution compiled without the GPU has no algorithm and a GPU
    rejects it (docs/gpu.md), so ``auto`` traces one product per tap there; the device that runs
    the program, and an explicit setting, keep theirs."""
    from preheat.platforms import compiling_for

    monkeypatch.delenv("PREHEAT_CONV", raising=False)
    with compiling_for("gpu", (9, 0)):
        assert conv_impl() == "taps"
        monkeypatch.setenv("PREHEAT_CONV", "conv")
        assert conv_impl() == "conv"
    monkeypatch.delenv("PREHEAT_CONV")
    assert conv_impl() == "conv"


def test_compile_cache_key_names_each_switch_setting(monkeypatch):
    """A program traced with another implementation is another executable: never served for this one."""
    from dataclasses import dataclass

    from preheat.cache.keys import key_fields, key_of

    @dataclass(frozen=True)
    class Sig:
        batch: int = 1

    keys = set()
    for impl in CONV_IMPLS:
        monkeypatch.setenv("PREHEAT_CONV", impl)
        keys.add(key_of(key_fields({"model": "m"}, Sig(), (np.zeros(2, np.float32),))))
    assert len(keys) == len(CONV_IMPLS)
    for impl in GROUPNORM_IMPLS:
        monkeypatch.setenv("PREHEAT_GROUPNORM", impl)
        keys.add(key_of(key_fields({"model": "m"}, Sig(), (np.zeros(2, np.float32),))))
    assert len(keys) == len(CONV_IMPLS) + len(GROUPNORM_IMPLS)
    for impl in FP8_1X1_IMPLS:
        monkeypatch.setenv("PREHEAT_FP8_1X1", impl)
        keys.add(key_of(key_fields({"model": "m"}, Sig(), (np.zeros(2, np.float32),))))
    assert len(keys) == len(CONV_IMPLS) + len(GROUPNORM_IMPLS) + len(FP8_1X1_IMPLS)
    for setting in FENCE_SETTINGS:
        monkeypatch.setenv("PREHEAT_FENCES", setting)
        keys.add(key_of(key_fields({"model": "m"}, Sig(), (np.zeros(2, np.float32),))))
    assert len(keys) == len(CONV_IMPLS) + len(GROUPNORM_IMPLS) + len(FP8_1X1_IMPLS) + len(FENCE_SETTINGS)


def test_a_fencing_platform_fences_the_flash_kernels_operands_and_changes_no_value(monkeypatch):
    """On a platform with ``fences`` (the TPU) the flash kernel's q/k/v reach it through an
    optimization barrier; the block's output is the same array."""
    from flax import nnx

    from preheat import platforms
    from preheat.models.transformer2d import BasicTransformerBlock

    monkeypatch.delenv("PREHEAT_FENCES", raising=False)
    block = BasicTransformerBlock(64, 2, 32, 48, False, rngs=nnx.Rngs(0))
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(1, 128, 64).astype(np.float32))  # the kernel's blocks are multiples of 128
    ctx = jnp.asarray(rng.randn(1, 7, 48).astype(np.float32))

    def run(platform):
        with platforms.selected(platform):
            fn = jax.jit(lambda a, c: block(a, c))
            return fn.lower(x, ctx).as_text().count("optimization_barrier"), np.asarray(fn(x, ctx))

    flash = platforms.Attention("flash", block_q=128, block_k=128, head_dim=32)
    plain, want = run(platforms.FakePlatform(attention=flash))
    fenced, got = run(platforms.FakePlatform(attention=flash, fences=True))
    assert plain == 0
    assert fenced == 2  # the self- and the cross-attention's q/k/v (flash forced on both)
    np.testing.assert_array_equal(got, want)
