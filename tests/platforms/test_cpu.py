"""The CPU's description: its programs as they always were (jax's default attention, XLA's
convolution, one-pass GroupNorm), no accelerator, no autotuning."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from preheat import platforms
from preheat.models.attention import dot_product_attention

CPU = platforms.get("cpu")


def test_the_cpu_keeps_its_choices():
    for layer in (platforms.AttentionLayer("bfloat16", 64, 4096, 4096),
                  platforms.AttentionLayer("float32", 40, 64, 77)):
        assert CPU.attention(layer) == platforms.Attention(None)
    assert CPU.conv_form(platforms.ConvLayer(16, 64, 64, 320, 320, 3)) == "conv" and CPU.conv_form(None) == "conv"
    assert CPU.groupnorm_form() == "one_pass" and not CPU.accelerator and not CPU.autotunes


def test_the_cpu_s_attention_program_is_jax_s_default():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 2, 16)), jnp.float32)
    ours = jax.jit(lambda q: dot_product_attention(q, q, q)).lower(q).as_text()
    theirs = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q)).lower(q).as_text()
    assert ours == theirs
