"""The CPU's description: its programs as they always were (jax's default attention, XLA's
convolution, one-pass GroupNorm), no accelerator, no autotuning."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preheat import platforms
from preheat.errors import InvalidArgumentError
from preheat.models.attention import dot_product_attention
from tests._support.tpu_fixtures import VM_HOST_FLAGS

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


def test_a_host_stage_computes_in_float32_where_the_cpu_has_no_native_half_products(monkeypatch):
    """XLA:CPU converts every half-type product a CPU has no instructions for (a TPU v5e VM's AMD
    host: 1.13 TFLOP/s in float32, 0.30 in bfloat16), so a stage run there is computed in float32."""
    monkeypatch.delenv("PREHEAT_HOST_DTYPE", raising=False)
    avx2 = VM_HOST_FLAGS
    assert platforms.host_compute_dtype("bfloat16", avx2) == "float32"
    assert platforms.host_compute_dtype("float16", avx2) == "float32"
    for native in ("avx512_bf16", "amx_bf16", "bf16"):  # x86's AVX512 and AMX forms, Arm's Features
        assert platforms.host_compute_dtype("bfloat16", avx2 | {native}) == "bfloat16"
    assert platforms.host_compute_dtype("float16", avx2 | {"asimdhp"}) == "float16"
    assert platforms.host_compute_dtype("float16", avx2 | {"avx512_bf16"}) == "float32"  # bf16 alone is not fp16
    assert platforms.host_compute_dtype("float32", frozenset()) == "float32"


def test_the_host_dtype_setting_overrides_the_rule_and_a_bad_one_is_one_line(monkeypatch):
    amx = frozenset({"amx_bf16"})
    monkeypatch.setenv("PREHEAT_HOST_DTYPE", "float32")
    assert platforms.host_compute_dtype("bfloat16", amx) == "float32"
    assert dict(platforms.host_fields())["host_dtype"] == "float32"  # a host program's key names it
    monkeypatch.setenv("PREHEAT_HOST_DTYPE", "as-loaded")
    assert platforms.host_compute_dtype("bfloat16", frozenset()) == "bfloat16"
    monkeypatch.setenv("PREHEAT_HOST_DTYPE", "fp32")
    with pytest.raises(InvalidArgumentError, match=r"^PREHEAT_HOST_DTYPE='fp32'; supported: auto, float32, as-loaded$"):
        platforms.host_compute_dtype("bfloat16")
