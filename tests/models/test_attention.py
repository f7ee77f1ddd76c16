"""Attention's implementations against XLA's (``jax.nn.dot_product_attention``): jax's Pallas TPU
flash kernel, run here in Pallas's TPU interpret mode, on a few small shapes -- a head dim the
kernel takes as it is, one it takes padded (160 -> 256), a query and key length no block divides
(padded, the padding masked), cross-attention to 77 tokens -- tight in float32 and within bf16
rounding in bfloat16. And the override: ``PREHEAT_ATTENTION`` chooses, and keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preheat import platforms
from preheat.errors import InvalidArgumentError
from preheat.models.attention import attention_for, dot_product_attention, flash_attention


def _qkv(b, l, m, h, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, l, h, d)), dtype)  # (B, L, nH, Dh)
    k, v = (jnp.asarray(rng.standard_normal((b, m, h, d)), dtype) for _ in range(2))  # (B, M, nH, Dh)
    return q, k, v


@pytest.mark.parametrize("l, m, d, block, dtype, tol", [
    (256, 256, 64, 128, jnp.float32, 2e-5),  # two blocks each way, no padding
    (256, 256, 64, 128, jnp.bfloat16, 3e-2),  # bf16 operands: within bf16 rounding of XLA's
    (128, 128, 160, 128, jnp.float32, 2e-5),  # SD 1.5's 160-wide heads, padded to 256
    (200, 200, 40, 128, jnp.float32, 2e-5),  # 200 tokens: queries and keys padded to 256, padding masked
    (128, 77, 80, 128, jnp.bfloat16, 3e-2),  # cross-attention to 77 text tokens (keys padded to 128)
])
def test_the_flash_kernel_matches_xla_s_attention(l, m, d, block, dtype, tol):
    q, k, v = _qkv(1, l, m, 2, d, dtype)
    choice = platforms.flash_choice(platforms.AttentionLayer(jnp.dtype(dtype).name, d, l, m))
    choice = choice._replace(block_q=block, block_k=block)
    out = jax.jit(lambda q, k, v: flash_attention(q, k, v, choice))(q, k, v)
    ref = jax.nn.dot_product_attention(q, k, v)
    assert out.shape == ref.shape == (1, l, 2, d) and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


def test_a_platform_that_picks_flash_runs_the_kernel():
    """A layer a (fake) platform gives the flash kernel goes through it (interpret mode off a TPU)."""
    fake = platforms.FakePlatform(attention=lambda layer: platforms.flash_choice(layer)._replace(block_q=128,
                                                                                                block_k=128))
    q, k, v = _qkv(1, 128, 128, 2, 32, jnp.float32, seed=1)
    with platforms.selected(fake):
        lowered = jax.jit(lambda q, k, v: dot_product_attention(q, k, v)).lower(q, k, v)
        out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v))(q, k, v)
    assert "dot_general" in lowered.as_text() and fake.layers[0].head_dim == 32
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.nn.dot_product_attention(q, k, v)), atol=2e-5)


def test_the_override_chooses_and_is_a_key_field(monkeypatch):
    from preheat.cache.keys import key_fields

    assert attention_for(jnp.bfloat16, 64, 4096, 4096).impl is None  # the CPU: jax's default
    monkeypatch.setenv("PREHEAT_ATTENTION", "xla")
    assert attention_for(jnp.bfloat16, 64, 4096, 4096).impl == "xla"
    monkeypatch.setenv("PREHEAT_ATTENTION", "flash")
    assert attention_for(jnp.bfloat16, 160, 4096, 77) == platforms.Attention("flash", 1024, 128, 256)
    assert attention_for(jnp.bfloat16, 64, 4096, 77, masked=True).impl == "xla"  # the kernel takes no mask
    monkeypatch.setenv("PREHEAT_ATTENTION", "cudnn")
    with pytest.raises(InvalidArgumentError, match="PREHEAT_ATTENTION='cudnn'; supported: auto, xla, flash"):
        attention_for(jnp.bfloat16, 64, 64, 64)
    import dataclasses

    @dataclasses.dataclass
    class Sig:
        stage: str = "denoise"

    monkeypatch.setenv("PREHEAT_ATTENTION", "flash")
    assert key_fields({}, Sig(), ())["attention_impl"] == "flash"
    monkeypatch.delenv("PREHEAT_ATTENTION")
    assert key_fields({}, Sig(), ())["attention_impl"] == "auto"
