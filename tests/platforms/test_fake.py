"""The test platform: its answers are the test's, it records the layers it was asked about, and the
model code takes its choices."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from preheat import platforms
from preheat.models.attention import dot_product_attention
from preheat.models.conv import conv2d, groupnorm_impl


def test_the_model_code_takes_the_fake_s_choices():
    fake = platforms.FakePlatform(conv=lambda layer: "im2col" if layer.batch >= 4 else "conv", groupnorm="one_pass",
                                  attention=platforms.Attention("xla"))
    x1, x4 = jax.ShapeDtypeStruct((1, 8, 8, 4), jnp.float32), jax.ShapeDtypeStruct((4, 8, 8, 4), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 4, 4), jnp.float32)
    q = jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.float32)
    conv = jax.jit(lambda x, w: conv2d(x, w, 1, 1))
    with platforms.selected(fake):
        assert "convolution" in conv.lower(x1, w).as_text() and "convolution" not in conv.lower(x4, w).as_text()
        assert groupnorm_impl() == "one_pass"
        jax.jit(lambda q: dot_product_attention(q, q, q)).lower(q)
    assert fake.layers == [platforms.AttentionLayer("float32", 16, 64, 64, 2, False, False)]
