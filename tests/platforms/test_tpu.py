"""The TPU's description: the flash kernel for long self-attention (SDXL's, SD 1.5's and Flux's
1024-4608 tokens), XLA's for cross-attention and short sequences, blocks that divide the sequence
where one does, head dims above 128 padded; im2col convolutions from batch ``IM2COL_MIN_BATCH``.
A trace for the TPU lowers the kernel for the chip (a Mosaic call), deviceless, here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from preheat import platforms
from preheat.models.attention import dot_product_attention
from preheat.models.conv import conv2d
from preheat.platforms import _tpu

TPU = platforms.get("tpu")


def _choice(q_len, kv_len, head_dim=64, dtype="bfloat16", masked=False):
    return TPU.attention(platforms.AttentionLayer(dtype, head_dim, q_len, kv_len, 10, masked))


@pytest.mark.parametrize("q_len, kv_len, head_dim, expected", [
    (4096, 4096, 64, platforms.Attention("flash", 1024, 1024, 64)),  # SDXL 1024^2, measured 2.0 ms vs 4.7
    (4096, 4096, 40, platforms.Attention("flash", 1024, 1024, 64)),  # SD 1.5 512^2, first blocks: run at 64
    (1024, 1024, 80, platforms.Attention("flash", 1024, 1024, 128)),  # SD 1.5's second blocks: at 128
    (1024, 1024, 64, platforms.Attention("flash", 1024, 1024, 64)),  # SDXL's 32^2 blocks: 0.78 ms vs 1.16
    (4096, 4096, 160, platforms.Attention("flash", 1024, 1024, 256)),  # a 160-wide head, padded
    (4608, 4608, 128, platforms.Attention("flash", 512, 512, 128)),  # Flux 1024^2: 4096 + 512 text tokens
    (8704, 8704, 128, platforms.Attention("flash", 512, 512, 128)),  # Kontext 1024^2: 4096 + 4096 + 512
    (4173, 4173, 64, platforms.Attention("flash", 512, 512, 64)),  # no block divides: padded to 4608
    (4096, 77, 64, platforms.Attention("xla")),  # cross-attention to the text
    (4096, 154, 64, platforms.Attention("xla")),
    (256, 256, 160, platforms.Attention("xla")),  # SD 1.5's 8^2 blocks: short
])
def test_the_flash_kernel_takes_long_self_attention(q_len, kv_len, head_dim, expected):
    assert _choice(q_len, kv_len, head_dim) == expected


def test_masked_or_half_precision_layers_keep_xla_s_attention():
    assert _choice(4096, 4096, masked=True).impl == "xla" and _choice(4096, 4096, dtype="float16").impl == "xla"
    assert _choice(4096, 4096, dtype="float32").impl == "flash"


def test_blocks_divide_the_sequence_where_one_does():
    assert [_tpu.flash_block(n) for n in (4096, 4608, 2048, 1536, 640, 300, 4173)] == [1024, 512, 1024, 512, 128,
                                                                                       128, 512]


def test_large_batch_convolutions_are_im2col():
    """libtpu's compiler crashed on SD 1.5's batch-8 UNet with XLA's convolution (16 latents with
    guidance); 2 and 4 latents compiled. From there no convolution is left at all (1x1 ones are
    plain matrix products)."""
    def form(batch, kernel=3):
        return TPU.conv_form(platforms.ConvLayer(batch, 64, 64, 320, 320, kernel))

    assert [form(1), form(2), form(4), form(_tpu.IM2COL_MIN_BATCH - 1)] == ["conv"] * 4
    assert [form(_tpu.IM2COL_MIN_BATCH), form(16)] == ["im2col"] * 2
    assert form(16, kernel=1) == "im2col" and form(2, kernel=1) == "conv"
    assert TPU.conv_form(None) == "conv" and TPU.groupnorm_form() == "two_pass"
    x16, x2 = (jax.ShapeDtypeStruct((b, 16, 16, 8), jnp.bfloat16) for b in (16, 2))
    w3, w1 = (jax.ShapeDtypeStruct((k, k, 8, 8), jnp.bfloat16) for k in (3, 1))
    convs = jax.jit(lambda x, w3, w1: conv2d(conv2d(x, w3, 1, 1), w1, 1, 0))
    with platforms.compiling_for("tpu"):
        assert "convolution" not in convs.lower(x16, w3, w1).as_text()
        assert convs.lower(x2, w3, w1).as_text().count("stablehlo.convolution") == 2


def test_a_trace_for_the_tpu_lowers_the_kernel_for_the_chip():
    """Deviceless: the flash kernel lowers to a Mosaic call for the TPU (libtpu compiles it there),
    and a cross-attention layer to XLA's dot products."""
    q = jax.ShapeDtypeStruct((2, 4096, 10, 64), jnp.bfloat16)
    ctx = jax.ShapeDtypeStruct((2, 77, 10, 64), jnp.bfloat16)
    self_attn = jax.jit(lambda q: dot_product_attention(q, q, q))
    cross_attn = jax.jit(lambda q, c: dot_product_attention(q, c, c))
    with platforms.compiling_for("tpu"):
        mosaic = self_attn.trace(q).lower(lowering_platforms=("tpu",)).as_text()
        plain = cross_attn.trace(q, ctx).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in mosaic and "tpu_custom_call" not in plain


@pytest.mark.parametrize("image_tokens", [4096, 8192])  # FLUX.1 at 1024^2; Kontext's image and reference
def test_flux_joint_attention_lowers_to_the_flash_kernel_for_the_chip(image_tokens):
    """Deviceless: a Flux transformer (one double and one single block, 2 heads of 128, bf16) at
    ``image_tokens`` + 512 text tokens traced for the TPU runs each block's joint attention in the
    Pallas kernel (a Mosaic call)."""
    from preheat.models.flux import FluxTransformer, FluxTransformerConfig, build_abstract

    config = FluxTransformerConfig.from_dict(dict(in_channels=64, num_layers=1, num_single_layers=1,
                                                  attention_head_dim=128, num_attention_heads=2,
                                                  joint_attention_dim=64, pooled_projection_dim=32,
                                                  axes_dims_rope=[16, 56, 56], guidance_embeds=True), "flux")
    graphdef, abstract = build_abstract(config)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), abstract)
    model = FluxTransformer(config, graphdef, None, jnp.bfloat16)
    S = jax.ShapeDtypeStruct
    args = (params, S((1, image_tokens, 64), jnp.bfloat16), S((1, 512, 64), jnp.bfloat16), S((1, 32), jnp.bfloat16),
            S((1,), jnp.float32), S((image_tokens, 3), jnp.float32), S((512, 3), jnp.float32), S((1,), jnp.float32))
    with platforms.compiling_for("tpu"):
        text = jax.jit(model.apply).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    # the kernel (one function, called by both blocks) on the joint sequence, heads first: (B, nH, L, Dh)
    assert "tpu_custom_call" in text and f"tensor<1x2x{image_tokens + 512}x128xbf16>" in text


def test_a_chip_s_key_is_the_one_a_target_for_it_computes(monkeypatch):
    """The chip's host and a deviceless target give the same fields when the target names the chip's
    kind and runtime; a builder's XLA:CPU flags are left out, libtpu's own flags kept."""

    class Client:
        platform_version = "libtpu 0.0.42.1"

    class Chip:
        platform, device_kind, client = "tpu", "TPU v5 lite", Client()

    class Target:
        def key_fields(self):
            return {"device_kind": "TPU v5 lite", "platform_version": "libtpu 0.0.42.1"}

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", " --xla_tpu_use_enhanced_launch_barrier=true")
    own, built = TPU.device_fields(Chip(), None), TPU.device_fields(Chip(), None, Target())
    assert own == built and own["xla_flags"] == "" and own["device_count"] == 1
    assert own["libtpu_init_args"] == "--xla_tpu_use_enhanced_launch_barrier=true"
    assert TPU.device_fields(Chip(), 4)["device_count"] == 4
