"""``benchmarks/op_profile.py``'s accounting: the HLO classifier counts a program's FLOPs
and classes its thunks (timings themselves are benchmarks, not tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.op_profile import _torch_class, classify_hlo


def _norm_silu(h):  # (B, H, W, C): GroupNorm with one group, then SiLU
    mean = h.mean(axis=(1, 2, 3), keepdims=True)
    var = jnp.square(h - mean).mean(axis=(1, 2, 3), keepdims=True)
    return jax.nn.silu((h - mean) * jax.lax.rsqrt(var + 1e-5))


def test_classifier_counts_conv_and_dot_flops_and_classes_the_rest():
    def f(x, k3, k1, w):
        h = jax.lax.conv_general_dilated(x, k3, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = _norm_silu(h)
        h = jax.lax.conv_general_dilated(h, k1, (1, 1), ((0, 0), (0, 0)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
        q = h.reshape(2, 64, 16)
        att = jax.nn.softmax(jnp.einsum("bld,bmd->blm", q, q), axis=-1)  # (2, 64, 64)
        return jnp.einsum("blm,bmd->bld", att, q) @ w

    args = (jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 16)), jnp.ones((1, 1, 16, 16)), jnp.ones((16, 8)))
    info = classify_hlo(jax.jit(f).lower(*args).compile().as_text())
    flops = {}
    for hit in info.values():
        flops[hit["class"]] = flops.get(hit["class"], 0.0) + hit["flops"]
    conv3 = 2 * 2 * 8 * 8 * 16 * 3 * 3 * 4
    conv1 = 2 * 2 * 8 * 8 * 16 * 16
    attention = 2 * (2 * 2 * 64 * 64 * 16)  # two batched products, each 2 * B*L*L * D
    linear = 2 * 2 * 64 * 16 * 8
    # XLA may rewrite a 1x1 convolution as a dot, so the two matmul-like kinds are checked together.
    assert flops.get("conv 3x3") == conv3
    assert flops.get("conv 1x1", 0) + flops.get("linear", 0) + flops.get("attention", 0) == conv1 + attention + linear
    assert flops.get("attention", 0) >= attention
    assert "groupnorm+silu" in {hit["class"] for hit in info.values()}
    assert all(hit["bytes"] > 0 for hit in info.values())


def test_torch_kernel_names_are_classed_by_what_they_fuse():
    assert _torch_class("aten::mkldnn_convolution", [[16, 64, 8, 8], [64, 64, 3, 3], [64]]) == "conv 3x3"
    assert _torch_class("aten::mkldnn_convolution", [[16, 32, 8, 8], [64, 32, 1, 1], [64]]) == "conv 1x1"
    assert _torch_class("aten::convolution", []) == "other"
    assert _torch_class("aten::addmm", []) == "linear"
    assert _torch_class("aten::_scaled_dot_product_flash_attention_for_cpu", []) == "attention"
    assert _torch_class("graph_0_cpp_fused_add_convolution_native_group_norm_silu_13", []) == "groupnorm+silu"
    assert _torch_class("graph_0_cpp_fused_add_convolution_div_5", []) == "elementwise"
    assert _torch_class("graph_0_cpp_fused_cat_clone_2", []) == "copies/layout"
